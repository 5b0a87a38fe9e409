//! Credentials as operators manage them: create or update, read, change, drain, delete, force
//! releases, pool summaries, bulk import and resealing. Each operation is one transaction; every
//! mutation writes `credential_events` (who, what, old and new values — never a secret).
//!
//! Lock order, as everywhere (docs/design.md "Lock order" lists it and says why no
//! cycle can form): a credential's slot rows (ascending), then its lease_windows row, then the
//! credential row.
//!
//! One file per transition: `validation.rs` (what an operator's input must satisfy), `read.rs`
//! (one credential, a page, pool summaries), `upsert.rs` (create or update, bulk import),
//! `patch.rs` (change, drain), `force_release.rs`, `delete.rs` and `reseal.rs`. This file holds
//! what they share: the operator's name, the locks and the audit row.

mod delete;
mod force_release;
mod patch;
mod read;
mod reseal;
mod upsert;
mod validation;

use serde::Serialize;
use sqlx::PgConnection;

use crate::domain::{InvalidValue, KeyId};

pub use delete::delete;
pub use force_release::release_all;
pub(crate) use force_release::{ForceReleaseOutcome, ForcedRelease, force_release_lease};
pub use patch::{Patch, PatchOutcome, StateChange, patch};
pub use read::{CredentialDetail, ListFilter, PoolSummary, get, list, pools};
pub use reseal::{reseal, sealing_keys};
pub use upsert::import;
pub use upsert::{UpsertError, upsert};
pub use validation::{CredentialInput, CredentialSpec};
pub use validation::{check_limit, check_models};

/// Who performed an operator action: the `X-Operator` header, `admin-key`, or `cli:<user>`.
/// 1..=200 printable characters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Actor(String);

impl Actor {
    /// Validates an operator's name for themselves.
    pub fn parse(value: impl Into<String>) -> Result<Self, InvalidValue> {
        let value = value.into();
        let len = value.chars().count();
        if len == 0 || len > 200 || value.chars().any(char::is_control) {
            return Err(InvalidValue::new(
                "X-Operator",
                "must be 1 to 200 printable characters",
            ));
        }
        Ok(Self(value))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Locks every slot row of `key_ids` (including rows a concurrent fit inserted while this waited),
/// then their windows rows, then their credential rows, each kind in ascending order: the lock
/// order (`credpool_lock_credentials`, `sql/locks.sql`). Returns how many of the credentials
/// exist.
async fn lock_credentials(conn: &mut PgConnection, key_ids: &[&str]) -> Result<usize, sqlx::Error> {
    let found = sqlx::query_scalar!(
        r#"SELECT credpool_lock_credentials($1) AS "found!""#,
        key_ids as &[&str]
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(usize::try_from(found).unwrap_or(0))
}

/// [`lock_credentials`] for one credential: whether it exists.
pub(crate) async fn lock_credential(
    conn: &mut PgConnection,
    key_id: &KeyId,
) -> Result<bool, sqlx::Error> {
    Ok(lock_credentials(conn, &[key_id.as_str()]).await? == 1)
}

/// The non-secret configuration of a credential, for the `details` of audit rows.
async fn configuration(
    conn: &mut PgConnection,
    key_id: &KeyId,
) -> Result<Option<serde_json::Value>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"
        SELECT jsonb_build_object(
                   'provider', provider, 'pool', pool, 'models', models, 'aliases', model_aliases,
                   'max_concurrent_uses', max_concurrent_uses, 'status', status,
                   'cooldown_until', cooldown_until, 'draining', draining,
                   'rate_limits', rate_limits) AS "configuration!"
        FROM credentials WHERE key_id = $1
        "#,
        key_id.as_str()
    )
    .fetch_optional(&mut *conn)
    .await
}

/// The provider of a credential's [`configuration`] (empty when there is none): statements that
/// change a credential's rows name it, so that on Citus they run on the provider's worker alone.
fn provider_of(configuration: Option<&serde_json::Value>) -> &str {
    configuration
        .and_then(|c| c["provider"].as_str())
        .unwrap_or_default()
}

/// Writes a `credential_events` row for `key_id`: `event`, `reason`, `actor` and `details`, whose
/// `old` and `new` objects (when present) give the row's old and new status and the new
/// cooldown. The caller holds the credential's locks.
pub(crate) async fn audit(
    conn: &mut PgConnection,
    key_id: &KeyId,
    event: &str,
    actor: &Actor,
    reason: &str,
    details: serde_json::Value,
) -> Result<(), sqlx::Error> {
    // Dated when the change takes effect: every caller has taken the credential's locks by now,
    // and no grant of it can commit between this row and the transaction's commit, so the proofs
    // (sql/audit.sql) judge a grant committed while the change waited for those locks by the
    // limit and windows it was admitted under, not by the transaction's start (now()).
    sqlx::query!(
        r#"
        INSERT INTO credential_events
            (key_id, event, old_status, new_status, reason, cooldown_until, actor, details, at)
        VALUES ($1, $2, $3::jsonb ->> 'status', $4::jsonb ->> 'status', $5,
                ($4::jsonb ->> 'cooldown_until')::timestamptz, $6, $7, clock_timestamp())
        "#,
        key_id.as_str(),
        event,
        details
            .get("old")
            .cloned()
            .unwrap_or(serde_json::Value::Null),
        details
            .get("new")
            .cloned()
            .unwrap_or(serde_json::Value::Null),
        reason,
        actor.as_str(),
        details,
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}
