//! The candidate read: every credential of one (provider, pool) with its health and occupancy,
//! for a service's candidate view. Runs on a cache miss, when the claim statement reports that the
//! pool changed, and on the periodic refresh — never once per allocation.

use std::collections::HashMap;
use std::time::Instant;

use sqlx::PgConnection;
use time::OffsetDateTime;

use super::leases::decoded;
use crate::domain::{KeyId, PoolName, ProviderName};
use crate::health::Health;

/// One credential as the candidate read saw it.
#[derive(Debug, Clone)]
pub struct CredentialFacts {
    /// The credential.
    pub key_id: KeyId,
    /// Provider model names it serves.
    pub models: Vec<String>,
    /// Request name -> provider model name.
    pub aliases: HashMap<String, String>,
    /// Its limit.
    pub max_concurrent_uses: i32,
    /// Its health.
    pub health: Health,
    /// More leases in flight than its limit (claims skip it until refit).
    pub slots_over_limit: bool,
    /// Drained by an operator: no new leases.
    pub draining: bool,
    /// Unexpired leases.
    pub in_flight: i64,
    /// Whether slot 0 is free (the probe slot of a recovering credential).
    pub slot0_free: bool,
    /// The earliest end among its unexpired leases.
    pub next_lease_end: Option<OffsetDateTime>,
    /// When its latest lease was granted.
    pub last_used_at: Option<OffsetDateTime>,
}

/// A pool as read at one moment.
#[derive(Debug, Clone)]
pub struct PoolSnapshot {
    /// The pool's version, read before the rows (so a change racing the read shows up as a newer
    /// version at the next claim); `None` if the pool never had a credential.
    pub version: Option<i64>,
    /// The database clock at the read.
    pub db_now: OffsetDateTime,
    /// This process's clock just before the read was sent: `db_now` is at least this late, so
    /// `db_now + read_at.elapsed()` runs ahead of the database clock by the one-way latency at
    /// most, instead of behind it by the whole read.
    pub read_at: Instant,
    /// Every credential of the pool.
    pub credentials: Vec<CredentialFacts>,
}

/// Reads one pool: its version and clock first, then its credentials. Cost: O(credentials and
/// slots of the pool).
#[tracing::instrument(skip(conn), err(level = "debug"))]
pub async fn load_pool(
    conn: &mut PgConnection,
    provider: &ProviderName,
    pool: &PoolName,
) -> Result<PoolSnapshot, sqlx::Error> {
    let read_at = Instant::now();
    let head = sqlx::query!(
        r#"
        SELECT now() AS "db_now!",
               (SELECT version FROM pool_versions WHERE provider = $1 AND pool = $2) AS version
        "#,
        provider.as_str(),
        pool.as_str(),
    )
    .fetch_one(&mut *conn)
    .await?;

    let rows = sqlx::query!(
        r#"
        SELECT c.key_id, c.models, c.model_aliases, c.max_concurrent_uses, c.status, c.status_reason,
               c.cooldown_until, max(s.last_granted_at) AS last_used_at, c.slots_over_limit, c.draining,
               c.health_successes, c.health_failures, c.health_rate_limits, c.health_decayed_at,
               c.recent_failures, c.cooldowns_in_a_row, c.last_success_at, c.recovered_at,
               count(s.lease_id) FILTER (WHERE s.lease_until > now()) AS "in_flight!",
               coalesce(bool_or(s.slot = 0 AND (s.lease_id IS NULL OR s.lease_until <= now())), false)
                   AS "slot0_free!",
               min(s.lease_until) FILTER (WHERE s.lease_until > now()) AS next_lease_end
        FROM credentials c
        LEFT JOIN lease_slots s ON s.key_id = c.key_id
        WHERE c.provider = $1 AND c.pool = $2
        GROUP BY c.key_id
        ORDER BY c.key_id
        "#,
        provider.as_str(),
        pool.as_str(),
    )
    .fetch_all(&mut *conn)
    .await?;

    let credentials = rows
        .into_iter()
        .map(|r| {
            let aliases = match r.model_aliases {
                serde_json::Value::Object(map) => map
                    .into_iter()
                    .filter_map(|(k, v)| v.as_str().map(|v| (k, v.to_owned())))
                    .collect(),
                _ => HashMap::new(),
            };
            Ok(CredentialFacts {
                key_id: decoded(KeyId::parse(r.key_id))?,
                models: r.models,
                aliases,
                max_concurrent_uses: r.max_concurrent_uses,
                health: super::health_of_row!(r)?,
                slots_over_limit: r.slots_over_limit,
                draining: r.draining,
                in_flight: r.in_flight,
                slot0_free: r.slot0_free,
                next_lease_end: r.next_lease_end,
                last_used_at: r.last_used_at,
            })
        })
        .collect::<Result<_, sqlx::Error>>()?;
    Ok(PoolSnapshot {
        version: head.version,
        db_now: head.db_now,
        read_at,
        credentials,
    })
}
