//! The operator dashboard's reads: leases (held and recently expired), recent events, and
//! utilization per minute over the last hour. Read-only, one statement each, bounded row counts.
//! None selects a secret column (`secret`, `secret_ciphertext`); the dashboard's pools and
//! credentials come from `credentials::pools` and `credentials::list`.

use serde::Serialize;
use time::OffsetDateTime;

use super::Db;

/// Most held leases the dashboard lists (oldest grant first).
pub const MAX_HELD_LEASES: i64 = 200;
/// Most expired-without-release leases the dashboard lists (newest first).
pub const MAX_EXPIRED_LEASES: i64 = 50;
/// Most events the dashboard lists (newest first).
pub const MAX_EVENTS: i64 = 50;

/// Which lease, on which credential's slot, held by whom: the part of a [`LeaseRow`] that the
/// dashboard and `credpool leases` show as read.
#[derive(Debug, Clone, Serialize)]
pub struct LeaseHolding {
    /// 32 hex digits.
    pub lease_id: String,
    /// The credential it is on.
    pub key_id: String,
    /// The provider and pool it was granted from.
    pub provider: String,
    /// See `provider`.
    pub pool: String,
    /// The slot it holds (or held).
    pub slot: i32,
    /// The executor that holds (held) it.
    pub holder: Option<String>,
}

/// A lease as the dashboard shows it: held now, or ended by expiry without a release (its
/// executor crashed or lost track of it).
#[derive(Debug, Clone)]
pub struct LeaseRow {
    /// Which lease, where, and whose.
    pub holding: LeaseHolding,
    /// When it was granted (`None` if the trail no longer has its grant).
    pub granted_at: Option<OffsetDateTime>,
    /// When it stops (stopped) counting.
    pub lease_until: OffsetDateTime,
    /// A recovering credential's probe.
    pub probe: bool,
    /// Its fencing token (held leases only).
    pub fence: Option<i64>,
    /// Ended by expiry without a release: still in its slot past `lease_until` (the reaper has
    /// not run yet) or reaped in the last hour.
    pub expired: bool,
}

/// Held leases (at most [`MAX_HELD_LEASES`], oldest grant first), then leases that expired
/// without a release in the last hour (at most [`MAX_EXPIRED_LEASES`], newest first), with the
/// database clock.
#[tracing::instrument(skip_all, err(level = "debug"))]
pub async fn leases(db: &Db) -> Result<(Vec<LeaseRow>, OffsetDateTime), sqlx::Error> {
    let mut work = db.work().await?;
    let rows = sqlx::query!(
        r#"
        (SELECT replace(s.lease_id::text, '-', '') AS "lease_id!", s.key_id AS "key_id!",
                s.provider AS "provider!", s.pool AS "pool!", s.slot AS "slot!",
                s.holder AS "holder?", s.granted_at AS "granted_at?",
                s.lease_until AS "lease_until!", s.probe AS "probe!", s.fence AS "fence?",
                s.lease_until <= now() AS "expired!", now() AS "db_now!"
         FROM lease_slots s
         WHERE s.lease_id IS NOT NULL
         ORDER BY s.granted_at
         LIMIT $1)
        UNION ALL
        (SELECT replace(e.lease_id::text, '-', ''), e.key_id, e.provider, e.pool, e.slot,
                e.holder,
                (SELECT g.at FROM lease_events g
                 WHERE g.lease_id = e.lease_id AND g.event = 'granted' LIMIT 1),
                e.lease_until, false, NULL::bigint, true, now()
         FROM lease_events e
         WHERE e.event = 'expired' AND e.at > now() - interval '1 hour'
         ORDER BY e.at DESC
         LIMIT $2)
        "#,
        MAX_HELD_LEASES,
        MAX_EXPIRED_LEASES,
    )
    .fetch_all(&mut *work)
    .await?;
    let now = match rows.first() {
        Some(r) => r.db_now,
        None => super::audit::database_now(&mut *work).await?,
    };
    work.done().await?;
    let leases = rows
        .into_iter()
        .map(|r| LeaseRow {
            holding: LeaseHolding {
                lease_id: r.lease_id,
                key_id: r.key_id,
                provider: r.provider,
                pool: r.pool,
                slot: r.slot,
                holder: r.holder,
            },
            granted_at: r.granted_at,
            lease_until: r.lease_until,
            probe: r.probe,
            fence: r.fence,
            expired: r.expired,
        })
        .collect();
    Ok((leases, now))
}

/// A recent event: a credential's health transition or operator action (`credential_events`),
/// or a forced release (`lease_events`). Never the audit row's `details`.
#[derive(Debug, Clone)]
pub struct EventRow {
    /// When it took effect.
    pub at: OffsetDateTime,
    /// The credential.
    pub key_id: String,
    /// `status_changed`, `probe_granted`, `cooldown_ended`, `created`, `updated`, `deleted`,
    /// `leases_released`, `secret_resealed` or `force_released`.
    pub event: String,
    /// The status before (credential events that carry one).
    pub old_status: Option<String>,
    /// The status after.
    pub new_status: Option<String>,
    /// Why (the health rule's or the operator's words).
    pub reason: Option<String>,
    /// The operator, for operator actions.
    pub actor: Option<String>,
    /// The lease, for forced releases (32 hex digits).
    pub lease_id: Option<String>,
}

/// The newest [`MAX_EVENTS`] events, newest first.
#[tracing::instrument(skip_all, err(level = "debug"))]
pub async fn events(db: &Db) -> Result<Vec<EventRow>, sqlx::Error> {
    let mut work = db.work().await?;
    let rows = sqlx::query!(
        r#"
        SELECT at AS "at!", key_id AS "key_id!", event AS "event!", old_status AS "old_status?",
               new_status AS "new_status?", reason AS "reason?", actor AS "actor?",
               lease_id AS "lease_id?"
        FROM (
            (SELECT ce.at, ce.key_id, ce.event, ce.old_status, ce.new_status, ce.reason,
                    ce.actor, NULL::text AS lease_id
             FROM credential_events ce
             ORDER BY ce.at DESC
             LIMIT $1)
            UNION ALL
            (SELECT e.at, e.key_id, e.event, NULL, NULL, e.reason, e.actor,
                    replace(e.lease_id::text, '-', '')
             FROM lease_events e
             WHERE e.event = 'force_released'
             ORDER BY e.at DESC
             LIMIT $1)
        ) recent
        ORDER BY at DESC
        LIMIT $1
        "#,
        MAX_EVENTS,
    )
    .fetch_all(&mut *work)
    .await?;
    work.done().await?;
    Ok(rows
        .into_iter()
        .map(|r| EventRow {
            at: r.at,
            key_id: r.key_id,
            event: r.event,
            old_status: r.old_status,
            new_status: r.new_status,
            reason: r.reason,
            actor: r.actor,
            lease_id: r.lease_id,
        })
        .collect())
}

/// One pool's lease-seconds in one minute of the last hour.
#[derive(Debug, Clone)]
pub struct MinuteRow {
    /// The provider.
    pub provider: String,
    /// The pool (the one the leases were granted from).
    pub pool: String,
    /// The minute's start (database clock).
    pub minute: OffsetDateTime,
    /// Seconds of leases held during the minute, summed over the pool's leases.
    pub lease_seconds: f64,
    /// Seconds of the minute that have passed (60, less for the current minute).
    pub minute_seconds: f64,
}

/// Lease-seconds per pool and minute over the last 60 minutes (the current one included), from
/// the audit trail (`credpool_lease_lifetimes`): 60 rows per (provider, pool) that has a
/// credential, in order of provider, pool and minute. Divide `lease_seconds` by
/// `minute_seconds` for the leases held on average during the minute.
#[tracing::instrument(skip_all, err(level = "debug"))]
pub async fn utilization(db: &Db) -> Result<Vec<MinuteRow>, sqlx::Error> {
    let mut work = db.work().await?;
    let rows = sqlx::query_as!(
        MinuteRow,
        r#"
        WITH minutes AS (
            SELECT m FROM generate_series(date_trunc('minute', now()) - interval '59 minutes',
                                          date_trunc('minute', now()), interval '1 minute') m
        ),
        lives AS (
            SELECT l.provider, l.pool, l.granted_at, coalesce(l.ended_at, now()) AS ended_at
            FROM credpool_lease_lifetimes(now() - interval '1 hour', now()) l
        ),
        pools AS (
            SELECT DISTINCT provider, pool FROM credentials
        )
        SELECT p.provider AS "provider!", p.pool AS "pool!", mi.m AS "minute!",
               -- least / greatest skip NULLs: without the FILTER, a minute with no lease (the
               -- LEFT JOIN's row of NULLs) would count as a whole minute held
               coalesce(sum(extract(epoch FROM
                   least(l.ended_at, mi.m + interval '1 minute', now()) - greatest(l.granted_at, mi.m)))
                   FILTER (WHERE l.granted_at IS NOT NULL), 0)::float8 AS "lease_seconds!",
               extract(epoch FROM least(mi.m + interval '1 minute', now()) - mi.m)::float8
                   AS "minute_seconds!"
        FROM pools p
        CROSS JOIN minutes mi
        LEFT JOIN lives l ON l.provider = p.provider AND l.pool = p.pool
                         AND l.granted_at < mi.m + interval '1 minute' AND l.ended_at > mi.m
        GROUP BY p.provider, p.pool, mi.m
        ORDER BY p.provider, p.pool, mi.m
        "#
    )
    .fetch_all(&mut *work)
    .await?;
    work.done().await?;
    Ok(rows)
}

/// One pool's affinity results over the last hour.
#[derive(Debug, Clone)]
pub struct AffinityRow {
    /// The provider.
    pub provider: String,
    /// The pool that served the leases.
    pub pool: String,
    /// Grants served by the conversation's bound credential.
    pub hit: i64,
    /// Grants of conversations without a live binding.
    pub new: i64,
    /// Grants whose bound credential could not serve (the binding moved).
    pub moved: i64,
}

/// Grants with an affinity key over the last hour, per provider and pool that served, by result,
/// from the trail (`lease_events.affinity` of `granted` rows): every replica's grants, unlike a
/// process's counters. Only pools with such grants have a row.
#[tracing::instrument(skip_all, err(level = "debug"))]
pub async fn affinity(db: &Db) -> Result<Vec<AffinityRow>, sqlx::Error> {
    let mut work = db.work().await?;
    let rows = sqlx::query_as!(
        AffinityRow,
        r#"
        SELECT e.provider AS "provider!", e.pool AS "pool!",
               count(*) FILTER (WHERE e.affinity = 'hit') AS "hit!",
               count(*) FILTER (WHERE e.affinity = 'new') AS "new!",
               count(*) FILTER (WHERE e.affinity = 'moved') AS "moved!"
        FROM lease_events e
        WHERE e.at > now() - interval '1 hour' AND e.event = 'granted' AND e.affinity IS NOT NULL
        GROUP BY e.provider, e.pool
        ORDER BY e.provider, e.pool
        "#
    )
    .fetch_all(&mut *work)
    .await?;
    work.done().await?;
    Ok(rows)
}
