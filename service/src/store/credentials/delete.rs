//! Removing a credential.

use super::force_release::{ForcedRelease, force_release_in};
use super::{Actor, audit, configuration, lock_credential};
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
    if !lock_credential(&mut tx, key_id).await? {
        return Ok(None);
    }
    let old = configuration(&mut tx, key_id).await?;
    let released =
        force_release_in(&mut tx, Some(key_id), None, "credential deleted", actor).await?;
    sqlx::query!("DELETE FROM credentials WHERE key_id = $1", key_id.as_str())
        .execute(&mut *tx)
        .await?;
    let ids: Vec<String> = released.iter().map(|r| r.lease_id.to_string()).collect();
    let details = serde_json::json!({"old": old, "force_released": ids});
    audit(
        &mut tx,
        key_id,
        "deleted",
        actor,
        "credential deleted",
        details,
    )
    .await?;
    tx.commit().await?;
    Ok(Some(released))
}
