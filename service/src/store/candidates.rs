//! The candidate read: every credential of one (provider, pool) with its health and occupancy,
//! for a service's candidate view. Runs on a cache miss, when the claim statement reports that the
//! pool changed, and on the periodic refresh — never once per allocation.

use std::collections::HashMap;
use std::time::Instant;

use sqlx::PgConnection;
use time::OffsetDateTime;

use super::leases::decoded;
use crate::domain::health::Health;
use crate::domain::windows::{RING, RateLimit, WindowKind, WindowState};
use crate::domain::{KeyId, PoolName, ProviderName};

/// A `lease_windows` row's columns as a [`WindowState`]; a row whose arrays disagree in length is a
/// decode error (the table's CHECK refuses it).
pub(crate) fn window_state(
    kinds: Vec<String>,
    counts: Vec<i64>,
    seconds: Vec<i32>,
    bucket_ids: Vec<i64>,
    bucket_charged: Vec<i64>,
) -> Result<WindowState, sqlx::Error> {
    let n = kinds.len();
    if counts.len() != n
        || seconds.len() != n
        || bucket_ids.len() != n * RING
        || bucket_charged.len() != n * RING
    {
        return Err(sqlx::Error::Decode(
            "lease_windows arrays of unequal lengths".into(),
        ));
    }
    let windows = kinds
        .iter()
        .zip(counts)
        .zip(seconds)
        .map(|((kind, count), seconds)| {
            Ok(RateLimit {
                kind: decoded(WindowKind::parse(kind))?,
                count: u64::try_from(count).unwrap_or(0),
                seconds: u32::try_from(seconds).unwrap_or(1),
            })
        })
        .collect::<Result<_, sqlx::Error>>()?;
    Ok(WindowState {
        windows,
        bucket_ids,
        bucket_charged,
    })
}

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
    /// Its slots are over a lowered limit: more leases were in flight than the limit when they were
    /// last fit. Its rows within the limit reopen as their leases end (the earliest of those ends
    /// is [`Self::next_lease_end`]); its surplus rows never do.
    pub slots_over_limit: bool,
    /// Drained by an operator: no new leases.
    pub draining: bool,
    /// Unexpired leases.
    pub in_flight: i64,
    /// Whether slot 0 is free (the probe slot of a recovering credential).
    pub slot0_free: bool,
    /// The earliest end among its unexpired leases (not counting surplus rows of a lowered
    /// limit, which never reopen).
    pub next_lease_end: Option<OffsetDateTime>,
    /// When its latest lease was granted.
    pub last_used_at: Option<OffsetDateTime>,
    /// Its rate windows and what they have counted (empty: none).
    pub windows: WindowState,
}

#[cfg(test)]
impl CredentialFacts {
    /// An available credential serving `models` with `limit` slots, none of them leased, without
    /// rate windows or history: the starting point of the ranking and view tests.
    pub(crate) fn idle(key_id: &str, models: &[&str], limit: i32) -> Self {
        Self {
            key_id: KeyId::parse(key_id).unwrap(),
            models: models.iter().map(|m| m.to_string()).collect(),
            aliases: Default::default(),
            max_concurrent_uses: limit,
            health: Health::new(crate::domain::Status::Available),
            slots_over_limit: false,
            draining: false,
            in_flight: 0,
            slot0_free: true,
            next_lease_end: None,
            last_used_at: None,
            windows: Default::default(),
        }
    }
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
    /// The read's snapshot xmin (`pg_snapshot_xmin`, as a number): every transaction below it
    /// had ended before the read, so a later read of the changes since it misses none.
    pub xmin: i64,
    /// Every credential of the pool; for a read of the changes since an xmin, only the credentials
    /// changed since.
    pub credentials: Vec<CredentialFacts>,
    /// For a read of the changes since an xmin: the credentials that left the pool since
    /// (deleted, or moved to another pool), some perhaps back in it (then in `credentials` too).
    pub departed: Vec<KeyId>,
}

/// Reads one pool: its version, clock and snapshot xmin first, then its credentials, all of them
/// (`since` `None`; cost O(credentials and slots of the pool)) or those changed since a read
/// whose xmin was `since`, with the credentials that left the pool since (cost O(changes), but
/// for a filter over the pool's credential rows).
#[tracing::instrument(skip(conn), err(level = "debug"))]
pub async fn load_pool(
    conn: &mut PgConnection,
    provider: &ProviderName,
    pool: &PoolName,
    since: Option<i64>,
) -> Result<PoolSnapshot, sqlx::Error> {
    let read_at = Instant::now();
    let head = sqlx::query!(
        r#"
        SELECT now() AS "db_now!",
               credpool_pool_version($1, $2) AS version,
               pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS "xmin!"
        "#,
        provider.as_str(),
        pool.as_str(),
    )
    .fetch_one(&mut *conn)
    .await?;

    let rows = sqlx::query!(
        r#"
        SELECT c.key_id, c.models, c.model_aliases, c.max_concurrent_uses, c.status, c.status_reason,
               c.cooldown_until, max(s.last_granted_at) AS last_used_at,
               coalesce(bool_or(s.over_limit), false) AS "slots_over_limit!", c.draining,
               c.health_successes, c.health_failures, c.health_rate_limits, c.health_decayed_at,
               c.recent_failures, c.cooldowns_in_a_row, c.last_success_at, c.recovered_at,
               count(s.lease_id) FILTER (WHERE s.lease_until > now()) AS "in_flight!",
               coalesce(bool_or(s.slot = 0 AND (s.lease_id IS NULL OR s.lease_until <= now())), false)
                   AS "slot0_free!",
               min(s.lease_until) FILTER (WHERE s.lease_until > now() AND NOT s.surplus) AS next_lease_end,
               w.window_kinds AS "window_kinds?", w.window_counts AS "window_counts?",
               w.window_seconds AS "window_seconds?", w.bucket_ids AS "bucket_ids?",
               w.bucket_charged AS "bucket_charged?"
        FROM credentials c
        LEFT JOIN lease_slots s ON s.key_id = c.key_id AND s.provider = c.provider
        LEFT JOIN lease_windows w ON w.key_id = c.key_id AND w.provider = c.provider
        WHERE c.provider = $1 AND c.pool = $2
          AND ($3::bigint IS NULL OR c.changed_by >= $3::bigint::text::xid8)
        GROUP BY c.key_id, c.provider, w.key_id, w.provider
        ORDER BY c.key_id
        "#,
        provider.as_str(),
        pool.as_str(),
        since,
    )
    .fetch_all(&mut *conn)
    .await?;
    let departed = match since {
        None => Vec::new(),
        Some(since) => sqlx::query_scalar!(
            r#"
            SELECT DISTINCT key_id AS "key_id!" FROM credential_departures
            WHERE provider = $1 AND pool = $2 AND departed_by >= $3::bigint::text::xid8
            "#,
            provider.as_str(),
            pool.as_str(),
            since,
        )
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(|key_id| decoded(KeyId::parse(key_id)))
        .collect::<Result<_, _>>()?,
    };

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
                windows: window_state(
                    r.window_kinds.unwrap_or_default(),
                    r.window_counts.unwrap_or_default(),
                    r.window_seconds.unwrap_or_default(),
                    r.bucket_ids.unwrap_or_default(),
                    r.bucket_charged.unwrap_or_default(),
                )?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()?;
    Ok(PoolSnapshot {
        version: head.version,
        db_now: head.db_now,
        read_at,
        xmin: head.xmin,
        credentials,
        departed,
    })
}
