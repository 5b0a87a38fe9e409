//! Lease state: the candidate read, the one-statement claim, release and renewal.

use sqlx::PgExecutor;
use time::OffsetDateTime;

use crate::domain::{
    Holder, KeyId, LeaseId, LeaseSeconds, ModelName, Outcome, PoolName, ProviderName, Secret,
};

/// One credential of a (provider, pool) as the candidate read saw it. Feeds both the ranking and
/// the classification of a failed allocation (404 / 409 / 429).
#[derive(Debug, Clone)]
pub struct CandidateRow {
    /// The credential.
    pub key_id: KeyId,
    /// Its concurrency limit.
    pub max_concurrent_uses: i32,
    /// Whether it lists the requested model.
    pub serves_model: bool,
    /// Whether it may be leased now (`credential_usable`, database clock).
    pub usable: bool,
    /// When a credential that is cooling down becomes usable on its own (`credential_recovers_at`).
    pub recovers_at: Option<OffsetDateTime>,
    /// When its latest lease was granted.
    pub last_used_at: Option<OffsetDateTime>,
    /// Whether more leases are in flight than its limit allows (the limit was lowered under load).
    pub slots_over_limit: bool,
    /// Unexpired leases on it.
    pub in_flight: i64,
    /// The earliest lease_until among its unexpired leases.
    pub next_lease_end: Option<OffsetDateTime>,
}

/// The credentials of one (provider, pool), and the database clock they were read at.
#[derive(Debug, Clone)]
pub struct Candidates {
    /// Every credential of the pool, whatever its state.
    pub rows: Vec<CandidateRow>,
    /// `now()` of the read; `None` when the pool has no credentials.
    pub db_now: Option<OffsetDateTime>,
}

/// Reads every credential of `provider`/`pool` with its occupancy, in one statement.
///
/// Cost: one index range scan of `credentials_provider_pool_idx` plus the slot rows of those
/// credentials.
#[tracing::instrument(skip(executor), err(level = "debug"))]
pub async fn read_candidates(
    executor: impl PgExecutor<'_>,
    provider: &ProviderName,
    pool: &PoolName,
    model: &ModelName,
) -> Result<Candidates, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        SELECT c.key_id,
               c.max_concurrent_uses,
               $3 = ANY (c.models) AS "serves_model!",
               credential_usable(c.status, c.cooldown_until, now()) AS "usable!",
               credential_recovers_at(c.status, c.cooldown_until, now()) AS recovers_at,
               c.last_used_at,
               c.slots_over_limit,
               count(s.lease_id) FILTER (WHERE s.lease_until > now()) AS "in_flight!",
               min(s.lease_until) FILTER (WHERE s.lease_until > now()) AS next_lease_end,
               now() AS "db_now!"
        FROM credentials c
        LEFT JOIN lease_slots s ON s.key_id = c.key_id
        WHERE c.provider = $1 AND c.pool = $2
        GROUP BY c.key_id
        "#,
        provider.as_str(),
        pool.as_str(),
        model.as_str(),
    )
    .fetch_all(executor)
    .await?;

    let db_now = rows.first().map(|r| r.db_now);
    let rows = rows
        .into_iter()
        .map(|r| {
            Ok(CandidateRow {
                key_id: decoded(KeyId::parse(r.key_id))?,
                max_concurrent_uses: r.max_concurrent_uses,
                serves_model: r.serves_model,
                usable: r.usable,
                recovers_at: r.recovers_at,
                last_used_at: r.last_used_at,
                slots_over_limit: r.slots_over_limit,
                in_flight: r.in_flight,
                next_lease_end: r.next_lease_end,
            })
        })
        .collect::<Result<_, sqlx::Error>>()?;
    Ok(Candidates { rows, db_now })
}

/// Values read back from the database passed the same validation on the way in (and the
/// table's CHECK constraints); a failure here is a decode error, not bad input.
pub(crate) fn decoded<T>(value: Result<T, crate::domain::InvalidValue>) -> Result<T, sqlx::Error> {
    value.map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

/// What the claim needs besides the ranked candidates.
#[derive(Debug, Clone)]
pub struct ClaimRequest<'a> {
    /// Candidate key ids, best first.
    pub ranked: &'a [KeyId],
    /// The provider requested.
    pub provider: &'a ProviderName,
    /// The pool being tried (one step of the pool sequence).
    pub pool: &'a PoolName,
    /// The model requested.
    pub model: &'a ModelName,
    /// The id the new lease will carry.
    pub lease_id: LeaseId,
    /// The executor's name for itself, if it gave one.
    pub holder: Option<&'a Holder>,
    /// The lease length.
    pub lease_seconds: LeaseSeconds,
}

/// A lease the claim statement granted.
#[derive(Debug, Clone)]
pub struct GrantedLease {
    /// The credential leased.
    pub key_id: KeyId,
    /// The lease's id.
    pub lease_id: LeaseId,
    /// When the lease stops counting (database clock).
    pub lease_until: OffsetDateTime,
    /// The credential material (redacted in `Debug`).
    pub secret: Secret,
    /// Expired leases the claim ended in the trail while reusing their slot (0 or 1).
    pub pruned_expired: i64,
}

/// Runs the one-statement claim in `src/store/claim_slot.sql` (read its comment for why it cannot
/// oversell). Returns `None` when no candidate has a free slot at the moment of the claim.
#[tracing::instrument(skip_all, fields(provider = %request.provider, pool = %request.pool, candidates = request.ranked.len()), err(level = "debug"))]
pub async fn claim_slot(
    executor: impl PgExecutor<'_>,
    request: &ClaimRequest<'_>,
) -> Result<Option<GrantedLease>, sqlx::Error> {
    let ranked: Vec<String> = request
        .ranked
        .iter()
        .map(|k| k.as_str().to_owned())
        .collect();
    let lease_seconds = i32::try_from(request.lease_seconds.get()).unwrap_or(i32::MAX);
    let row = sqlx::query_file!(
        "src/store/claim_slot.sql",
        &ranked,
        request.provider.as_str(),
        request.pool.as_str(),
        request.model.as_str(),
        request.lease_id.as_uuid(),
        request.holder.map(Holder::as_str),
        lease_seconds,
    )
    .fetch_optional(executor)
    .await?;
    row.map(|r| {
        Ok(GrantedLease {
            key_id: decoded(KeyId::parse(r.key_id))?,
            lease_id: LeaseId::from(r.lease_id),
            lease_until: r.lease_until,
            secret: decoded(Secret::parse(r.secret))?,
            pruned_expired: r.pruned_expired,
        })
    })
    .transpose()
}

/// Brings a credential's slot rows in line with its limit (SQL function `credpool_fit_slots`;
/// see its comment). Runs in the caller's transaction.
#[tracing::instrument(skip(executor), err(level = "debug"))]
pub async fn fit_slots(executor: impl PgExecutor<'_>, key_id: &KeyId) -> Result<(), sqlx::Error> {
    sqlx::query!("SELECT credpool_fit_slots($1)", key_id.as_str())
        .execute(executor)
        .await?;
    Ok(())
}

/// The four values that name a lease in release and renew (DESIGN.md "The protocol", step 4).
#[derive(Debug, Clone)]
pub struct LeaseRef {
    /// The credential the lease is on.
    pub key_id: KeyId,
    /// The provider the lease was granted from.
    pub provider: ProviderName,
    /// The pool the lease was granted from (the pool that served, after any fallback).
    pub pool: PoolName,
    /// The lease.
    pub lease_id: LeaseId,
}

/// Why a release released nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NotReleased {
    /// The lease exists, but the key_id, provider or pool given do not match it.
    Mismatch,
    /// The lease's lease_until has passed; its slot is already free for others.
    Expired,
    /// No such lease: never granted, already released, or its slot was reused after expiry.
    NotFound,
}

/// Releases a lease if all four of its values match and it has not expired: frees its slot and
/// writes a `released` trail row with the outcome, in one statement. Otherwise changes nothing and
/// says why.
#[tracing::instrument(skip(executor), err(level = "debug"))]
pub async fn release(
    executor: impl PgExecutor<'_> + Copy,
    lease: &LeaseRef,
    outcome: Option<Outcome>,
) -> Result<Result<(), NotReleased>, sqlx::Error> {
    // A lease moved to another slot by credpool_fit_slots while this release waited for its row
    // lock is still live under its id: try again (moves are rare and bounded, so a few attempts do).
    for _ in 0..3 {
        let released = sqlx::query_scalar!(
            r#"
            WITH target AS (
                SELECT key_id, slot, lease_id, provider, pool, holder, lease_until
                FROM lease_slots
                WHERE lease_id = $1 AND key_id = $2 AND provider = $3 AND pool = $4
                  AND lease_until > now()
                FOR UPDATE
            ),
            freed AS (
                UPDATE lease_slots s
                SET lease_id = NULL, provider = NULL, pool = NULL, holder = NULL,
                    granted_at = NULL, lease_until = NULL
                FROM target
                WHERE s.key_id = target.key_id AND s.slot = target.slot
                RETURNING target.*
            ),
            trail AS (
                INSERT INTO lease_events
                    (event, lease_id, key_id, provider, pool, slot, holder, outcome, lease_until, at)
                SELECT 'released', lease_id, key_id, provider, pool, slot, holder, $5, lease_until, now()
                FROM freed
            )
            SELECT count(*) AS "released!" FROM freed
            "#,
            lease.lease_id.as_uuid(),
            lease.key_id.as_str(),
            lease.provider.as_str(),
            lease.pool.as_str(),
            outcome.map(Outcome::as_str),
        )
        .fetch_one(executor)
        .await?;
        if released > 0 {
            return Ok(Ok(()));
        }
        match diagnose(executor, lease).await? {
            Diagnosis::Live => continue,
            Diagnosis::Gone(reason) => return Ok(Err(reason)),
        }
    }
    Ok(Err(NotReleased::NotFound))
}

enum Diagnosis {
    Live,
    Gone(NotReleased),
}

/// Why a lease named by `lease` cannot be released or renewed, read in a fresh snapshot. Read-only.
async fn diagnose(
    executor: impl PgExecutor<'_>,
    lease: &LeaseRef,
) -> Result<Diagnosis, sqlx::Error> {
    let row = sqlx::query!(
        r#"
        SELECT key_id = $2 AND provider = $3 AND pool = $4 AS "matches!",
               lease_until <= now() AS "expired!"
        FROM lease_slots
        WHERE lease_id = $1
        "#,
        lease.lease_id.as_uuid(),
        lease.key_id.as_str(),
        lease.provider.as_str(),
        lease.pool.as_str(),
    )
    .fetch_optional(executor)
    .await?;
    Ok(match row {
        None => Diagnosis::Gone(NotReleased::NotFound),
        Some(r) if !r.matches => Diagnosis::Gone(NotReleased::Mismatch),
        Some(r) if r.expired => Diagnosis::Gone(NotReleased::Expired),
        Some(_) => Diagnosis::Live,
    })
}

/// Extends an unexpired lease to `now() + lease_seconds` (database clock) and writes a `renewed`
/// trail row, in one statement. Returns the new lease_until, or `None` when the lease is expired,
/// unknown, released or named with a wrong key_id/provider/pool. Never resurrects an expired lease:
/// the statement only touches a slot whose lease is still unexpired under this lease_id.
#[tracing::instrument(skip(executor), err(level = "debug"))]
pub async fn renew(
    executor: impl PgExecutor<'_> + Copy,
    lease: &LeaseRef,
    lease_seconds: LeaseSeconds,
) -> Result<Option<OffsetDateTime>, sqlx::Error> {
    let lease_seconds = i32::try_from(lease_seconds.get()).unwrap_or(i32::MAX);
    for _ in 0..3 {
        let renewed = sqlx::query_scalar!(
            r#"
            WITH renewed AS (
                UPDATE lease_slots
                SET lease_until = now() + make_interval(secs => $5::int4)
                WHERE lease_id = $1 AND key_id = $2 AND provider = $3 AND pool = $4
                  AND lease_until > now()
                RETURNING key_id, slot, lease_id, provider, pool, holder, lease_until
            ),
            trail AS (
                INSERT INTO lease_events
                    (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at)
                SELECT 'renewed', lease_id, key_id, provider, pool, slot, holder, lease_until, now()
                FROM renewed
            )
            SELECT lease_until AS "lease_until!" FROM renewed
            "#,
            lease.lease_id.as_uuid(),
            lease.key_id.as_str(),
            lease.provider.as_str(),
            lease.pool.as_str(),
            lease_seconds,
        )
        .fetch_optional(executor)
        .await?;
        if renewed.is_some() {
            return Ok(renewed);
        }
        match diagnose(executor, lease).await? {
            Diagnosis::Live => continue,
            Diagnosis::Gone(_) => return Ok(None),
        }
    }
    Ok(None)
}
