//! Removing a credential.

use super::force_release::{ForcedRelease, release_all_in};
use super::{Actor, audit, configuration, provider_of};
use crate::domain::KeyId;
use crate::store::Db;

/// Deletes a credential and everything that refers to it (its slots and their leases) in one
/// transaction; its in-flight leases are ended in the trail as `force_released` ("credential
/// deleted"), and the deletion is audited. History stays in the trail. `None` if no such
/// credential.
#[tracing::instrument(skip(db), err(level = "debug"))]
pub async fn delete(
    db: &Db,
    key_id: &KeyId,
    actor: &Actor,
) -> Result<Option<Vec<ForcedRelease>>, sqlx::Error> {
    let mut tx = db.begin().await?;
    let reason = "credential deleted";
    let Some((released, ids)) = release_all_in(&mut tx, key_id, reason, actor).await? else {
        return Ok(None);
    };
    // (the leases' end leaves the configuration as it was)
    let old = configuration(&mut tx, key_id).await?;
    sqlx::query!(
        "DELETE FROM credentials WHERE provider = $2 AND key_id = $1",
        key_id.as_str(),
        provider_of(old.as_ref())
    )
    .execute(&mut *tx)
    .await?;
    let details = serde_json::json!({"old": old, "force_released": ids});
    audit(&mut tx, key_id, "deleted", actor, reason, details).await?;
    tx.commit().await?;
    Ok(Some(released))
}
