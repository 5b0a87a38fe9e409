//! Questions answered from the audit trail alone.

use sqlx::PgExecutor;
use time::OffsetDateTime;

/// One credential's most concurrent leases over a time range, next to its limit.
#[derive(Debug, Clone)]
pub struct PeakRow {
    /// The credential.
    pub key_id: String,
    /// Its pool.
    pub pool: String,
    /// Its limit now.
    pub max_concurrent_uses: i32,
    /// Leases whose lifetime overlaps the range.
    pub leases: i64,
    /// The most leases held at the same moment.
    pub peak: i64,
}

/// The oversell check: for each credential in `key_ids`, the maximum number of leases held at
/// the same moment among leases whose lifetime overlaps `[since, until)`, reconstructed from the
/// trail alone.
///
/// A lease's lifetime is `[granted.at, end)` where `end` is its `released` event's time, or else
/// the last lease_until of its `granted`/`renewed` events (expiry needs no event to end a lease).
/// At equal times an end sorts before a start, so a slot handed straight from one lease to the
/// next does not count twice.
#[tracing::instrument(skip(executor, key_ids), err(level = "debug"))]
pub async fn peak_concurrency(
    executor: impl PgExecutor<'_>,
    since: OffsetDateTime,
    until: OffsetDateTime,
    key_ids: &[String],
) -> Result<Vec<PeakRow>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        WITH spans AS (
            SELECT lease_id, key_id,
                   min(at) FILTER (WHERE event = 'granted') AS started,
                   coalesce(min(at) FILTER (WHERE event = 'released'),
                            max(lease_until) FILTER (WHERE event IN ('granted', 'renewed'))) AS ended
            FROM lease_events
            WHERE key_id = ANY ($3)
            GROUP BY lease_id, key_id
        ),
        in_range AS (
            SELECT * FROM spans WHERE started IS NOT NULL AND started < $2 AND ended > $1
        ),
        edges AS (
            SELECT key_id, started AS at, 1 AS delta FROM in_range
            UNION ALL
            SELECT key_id, ended AS at, -1 AS delta FROM in_range
        ),
        running AS (
            SELECT key_id, delta,
                   sum(delta) OVER (PARTITION BY key_id ORDER BY at, delta
                                    ROWS UNBOUNDED PRECEDING) AS held
            FROM edges
        )
        SELECT c.key_id, c.pool, c.max_concurrent_uses,
               count(r.delta) FILTER (WHERE r.delta = 1) AS "leases!",
               coalesce(max(r.held), 0)::int8 AS "peak!"
        FROM credentials c
        LEFT JOIN running r ON r.key_id = c.key_id
        WHERE c.key_id = ANY ($3)
        GROUP BY c.key_id
        ORDER BY c.pool, c.key_id
        "#,
        since,
        until,
        key_ids,
    )
    .fetch_all(executor)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| PeakRow {
            key_id: r.key_id,
            pool: r.pool,
            max_concurrent_uses: r.max_concurrent_uses,
            leases: r.leases,
            peak: r.peak,
        })
        .collect())
}

/// Leases among `key_ids` granted in `[since, until)` that ended by expiry: no `released` event,
/// and their last lease_until has passed.
pub async fn expired_without_release(
    executor: impl PgExecutor<'_>,
    since: OffsetDateTime,
    until: OffsetDateTime,
    key_ids: &[String],
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar!(
        r#"
        SELECT count(*) AS "count!" FROM (
            SELECT lease_id
            FROM lease_events
            WHERE key_id = ANY ($3)
            GROUP BY lease_id
            HAVING min(at) FILTER (WHERE event = 'granted') >= $1
               AND min(at) FILTER (WHERE event = 'granted') < $2
               AND count(*) FILTER (WHERE event = 'released') = 0
               AND max(lease_until) <= now()
        ) ended
        "#,
        since,
        until,
        key_ids,
    )
    .fetch_one(executor)
    .await
}

/// The database clock.
pub async fn database_now(executor: impl PgExecutor<'_>) -> Result<OffsetDateTime, sqlx::Error> {
    sqlx::query_scalar!(r#"SELECT now() AS "now!""#)
        .fetch_one(executor)
        .await
}
