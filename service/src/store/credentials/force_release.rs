//! Operators ending leases: one lease, or every lease of a credential.

use serde::Serialize;
use sqlx::PgConnection;

use super::{Actor, audit, lock_credential};
use crate::domain::{KeyId, LeaseId};
use crate::store::Db;

/// A lease an operator ended.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ForcedRelease {
    /// The lease.
    pub lease_id: LeaseId,
    /// Its credential.
    pub key_id: String,
    /// Its holder.
    pub holder: Option<String>,
}

/// Ends the in-flight leases of `key_id` (all, or only `lease_id`) as `force_released` (SQL
/// function `credpool_force_release`), in the caller's transaction.
pub(super) async fn force_release_in(
    conn: &mut PgConnection,
    key_id: Option<&KeyId>,
    lease_id: Option<LeaseId>,
    reason: &str,
    actor: &Actor,
) -> Result<Vec<ForcedRelease>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        SELECT lease_id AS "lease_id!", key_id AS "key_id!", holder
        FROM credpool_force_release($1, $2, $3, $4)
        "#,
        key_id.map(KeyId::as_str),
        lease_id.map(|l| l.as_uuid()),
        reason,
        actor.as_str(),
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| ForcedRelease {
            lease_id: LeaseId::from(r.lease_id),
            key_id: r.key_id,
            holder: r.holder,
        })
        .collect())
}

/// Locks credential `key_id` and ends its in-flight leases as `force_released` with `reason`, in
/// the caller's transaction: the leases ended, and their ids (for the caller's audit row). `None`
/// if no such credential.
pub(super) async fn release_all_in(
    conn: &mut PgConnection,
    key_id: &KeyId,
    reason: &str,
    actor: &Actor,
) -> Result<Option<(Vec<ForcedRelease>, Vec<String>)>, sqlx::Error> {
    if !lock_credential(conn, key_id).await? {
        return Ok(None);
    }
    let released = force_release_in(conn, Some(key_id), None, reason, actor).await?;
    let ids = released.iter().map(|r| r.lease_id.to_string()).collect();
    Ok(Some((released, ids)))
}

/// Force-releases every in-flight lease of a credential (audited `force_released` with the
/// operator's reason, and a `leases_released` credential event). `None` if no such credential.
#[tracing::instrument(skip(db), err(level = "debug"))]
pub async fn release_all(
    db: &Db,
    key_id: &KeyId,
    reason: &str,
    actor: &Actor,
) -> Result<Option<Vec<ForcedRelease>>, sqlx::Error> {
    let mut tx = db.begin().await?;
    let Some((released, ids)) = release_all_in(&mut tx, key_id, reason, actor).await? else {
        return Ok(None);
    };
    audit(
        &mut tx,
        key_id,
        "leases_released",
        actor,
        reason,
        serde_json::json!({"leases": ids}),
    )
    .await?;
    tx.commit().await?;
    Ok(Some(released))
}

/// What a forced release of one lease found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ForceReleaseOutcome {
    /// Released.
    Released,
    /// Its lease_until had passed: its slot is already free.
    Expired,
    /// No lease with this id holds a slot.
    NotFound,
}

/// Force-releases one lease by id (audited `force_released` with the operator's reason).
#[tracing::instrument(skip(db), err(level = "debug"))]
pub async fn force_release_lease(
    db: &Db,
    lease_id: LeaseId,
    reason: &str,
    actor: &Actor,
) -> Result<ForceReleaseOutcome, sqlx::Error> {
    let mut tx = db.begin().await?;
    let released = force_release_in(&mut tx, None, Some(lease_id), reason, actor).await?;
    // nothing released: the lease had run out (still in its slot), or holds no slot
    let expired = if released.is_empty() {
        sqlx::query_scalar!(
            r#"SELECT s.lease_until <= clock_timestamp() AS "expired!"
               FROM lease_events g
               JOIN lease_slots s
                 ON s.key_id = g.key_id AND s.provider = g.provider AND s.lease_id = g.lease_id
               WHERE g.lease_id = $1 AND g.event = 'granted'"#,
            lease_id.as_uuid()
        )
        .fetch_optional(&mut *tx)
        .await?
    } else {
        None
    };
    tx.commit().await?;
    Ok(match (released.is_empty(), expired) {
        (false, _) => ForceReleaseOutcome::Released,
        (true, Some(true)) => ForceReleaseOutcome::Expired,
        (true, _) => ForceReleaseOutcome::NotFound,
    })
}
