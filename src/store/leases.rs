//! Lease state: the one-statement claim, release with the outcome's effect on health, renewal.

use sqlx::{PgConnection, PgExecutor, PgPool};
use time::OffsetDateTime;

use crate::domain::{
    Holder, KeyId, LeaseId, LeaseSeconds, ModelName, Outcome, PoolName, ProviderName, Status,
};
use crate::health::{self, Health, HealthPolicy, Report};

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
    /// When it was granted (database clock).
    pub granted_at: OffsetDateTime,
    /// When the lease stops counting (database clock).
    pub lease_until: OffsetDateTime,
    /// Whether it is the single probe lease of a credential back from a cooldown.
    pub probe: bool,
    /// The model name as this credential serves it (after alias mapping).
    pub provider_model: String,
    /// The credential material, sealed ([`crate::secrets::Keyring::open`] opens it).
    pub sealed_secret: Vec<u8>,
    /// Whether the claim reused the slot of an expired lease (ending it in the trail).
    pub pruned_expired: bool,
}

/// What one run of the claim statement found.
#[derive(Debug, Clone)]
pub struct ClaimResult {
    /// The pool's version when the statement ran; compare with the candidate view's.
    pub pool_version: Option<i64>,
    /// The lease, if a slot was free.
    pub granted: Option<GrantedLease>,
}

/// Runs the one-statement claim in `src/store/claim_slot.sql` (read its comment for why it cannot
/// oversell).
#[tracing::instrument(skip_all, fields(provider = %request.provider, pool = %request.pool, candidates = request.ranked.len()), err(level = "debug"))]
pub async fn claim_slot(
    executor: impl PgExecutor<'_>,
    request: &ClaimRequest<'_>,
) -> Result<ClaimResult, sqlx::Error> {
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
    .fetch_one(executor)
    .await?;
    let granted = match (
        row.key_id,
        row.lease_id,
        row.granted_at,
        row.lease_until,
        row.sealed_secret,
    ) {
        (
            Some(key_id),
            Some(lease_id),
            Some(granted_at),
            Some(lease_until),
            Some(sealed_secret),
        ) => Some(GrantedLease {
            key_id: decoded(KeyId::parse(key_id))?,
            lease_id: LeaseId::from(lease_id),
            granted_at,
            lease_until,
            probe: row.probe.unwrap_or(false),
            provider_model: row
                .provider_model
                .unwrap_or_else(|| request.model.as_str().to_owned()),
            sealed_secret,
            pruned_expired: row.pruned_expired.unwrap_or(false),
        }),
        _ => None,
    };
    Ok(ClaimResult {
        pool_version: row.pool_version,
        granted,
    })
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NotReleased {
    /// The lease exists, but the key_id, provider or pool given do not match it.
    Mismatch,
    /// The lease's lease_until has passed; its slot is already free for others.
    Expired,
    /// No such lease: never granted, already released, or its slot was reused after expiry.
    NotFound,
}

/// An executor's release: which lease, and what happened upstream.
#[derive(Debug, Clone)]
pub struct ReleaseRequest {
    /// The lease, by its four values.
    pub lease: LeaseRef,
    /// What happened upstream, if the executor says.
    pub outcome: Option<Outcome>,
    /// The provider's `Retry-After`, in whole seconds, if the executor passed it on.
    pub retry_after_seconds: Option<u32>,
}

/// What a release did.
#[derive(Debug, Clone)]
pub struct ReleaseResult {
    /// `Ok` when the lease was released; otherwise why nothing was.
    pub released: Result<(), NotReleased>,
    /// The credential's health after the outcome was applied (also when the lease had expired:
    /// the call happened), for the caller's candidate view.
    pub health: Option<(KeyId, Health)>,
}

/// Releases a lease if all four of its values match and it has not expired: frees its slot,
/// writes a `released` trail row with the outcome, and applies the outcome to the credential's
/// health ([`crate::health::apply`]), all in one transaction. A lease that has already expired
/// releases nothing, but its outcome still counts for health, once (`outcome_after_expiry`).
/// A mismatch or an unknown lease changes nothing.
#[tracing::instrument(skip(db, policy), err(level = "debug"))]
pub async fn release(
    db: &PgPool,
    request: &ReleaseRequest,
    policy: &HealthPolicy,
) -> Result<ReleaseResult, sqlx::Error> {
    let mut conn = super::acquire(db).await?;
    release_on(&mut conn, request, policy).await
}

/// [`release`] on a connection the caller holds (the raw-SQL baseline of `credpool bench`).
pub async fn release_on(
    conn: &mut PgConnection,
    request: &ReleaseRequest,
    policy: &HealthPolicy,
) -> Result<ReleaseResult, sqlx::Error> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let staged = release_in(&mut tx, request, policy).await?;
    tx.commit().await?;
    Ok(staged.committed(conn).await)
}

/// A release done inside a transaction that has not committed yet.
#[derive(Debug)]
pub struct StagedRelease {
    result: ReleaseResult,
    /// The freed slot's credential, when it was over a lowered limit: it may now be back under.
    refit: Option<KeyId>,
}

impl StagedRelease {
    /// What the release did (final once its transaction commits).
    pub fn result(&self) -> &ReleaseResult {
        &self.result
    }

    /// After the transaction has committed: refits the credential if the release brought it back
    /// under a lowered limit, and returns the result.
    ///
    /// The refit runs in its own transaction, after the release's: credpool_fit_slots locks every
    /// slot row of the credential in ascending order, which a transaction already holding one of
    /// them must not do (two such releases would deadlock). It is done here rather than left to
    /// the next allocation so that capacity returns no matter which replica, or whose stale view,
    /// comes next; if this process dies first, the next allocation that sees the credential back
    /// under its limit refits it. The release itself has committed, so a failure here is logged,
    /// not reported.
    pub async fn committed(self, conn: &mut PgConnection) -> ReleaseResult {
        if let Some(key_id) = self.refit {
            let refitted = async {
                let mut tx = sqlx::Connection::begin(&mut *conn).await?;
                fit_slots(&mut *tx, &key_id).await?;
                tx.commit().await
            };
            if let Err(error) = refitted.await {
                tracing::warn!(key_id = %key_id, error = %error, "refit after release failed");
            }
        }
        self.result
    }
}

/// The work of [`release`] inside the caller's transaction. Row locks taken, in this order: the
/// lease's slot row, then (with an outcome) its credential row.
pub async fn release_in(
    tx: &mut PgConnection,
    request: &ReleaseRequest,
    policy: &HealthPolicy,
) -> Result<StagedRelease, sqlx::Error> {
    let lease = &request.lease;
    // A lease moved to another slot by credpool_fit_slots while this release waited for its row
    // lock is still live under its id: try again (moves are rare and bounded, so a few attempts do).
    let mut verdict = Err(NotReleased::NotFound);
    let mut reported: Option<(KeyId, bool)> = None;
    let mut refit: Option<KeyId> = None;
    for _ in 0..3 {
        let freed = sqlx::query!(
            r#"
            WITH target AS (
                SELECT key_id, slot, lease_id, provider, pool, holder, lease_until, probe
                FROM lease_slots
                WHERE lease_id = $1 AND key_id = $2 AND provider = $3 AND pool = $4
                  AND lease_until > statement_timestamp()
                FOR UPDATE
            ),
            freed AS (
                UPDATE lease_slots s
                SET lease_id = NULL, provider = NULL, pool = NULL, holder = NULL,
                    granted_at = NULL, lease_until = NULL, probe = false
                FROM target
                WHERE s.key_id = target.key_id AND s.slot = target.slot
                RETURNING target.*
            ),
            trail AS (
                INSERT INTO lease_events
                    (event, lease_id, key_id, provider, pool, slot, holder, outcome, lease_until, at)
                SELECT 'released', lease_id, key_id, provider, pool, slot, holder, $5, lease_until, statement_timestamp()
                FROM freed
            )
            SELECT key_id AS "key_id!", probe AS "probe!",
                   coalesce((SELECT c.slots_over_limit FROM credentials c
                             WHERE c.key_id = freed.key_id), false) AS "over_limit!"
            FROM freed
            "#,
            lease.lease_id.as_uuid(),
            lease.key_id.as_str(),
            lease.provider.as_str(),
            lease.pool.as_str(),
            request.outcome.map(Outcome::as_str),
        )
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(freed) = freed {
            verdict = Ok(());
            let key_id = decoded(KeyId::parse(freed.key_id))?;
            if freed.over_limit {
                refit = Some(key_id.clone());
            }
            reported = Some((key_id, freed.probe));
            break;
        }
        match diagnose(&mut *tx, lease).await? {
            Diagnosis::Live => continue,
            Diagnosis::Gone(reason) => {
                verdict = Err(reason);
                if matches!(reason, NotReleased::Expired | NotReleased::NotFound)
                    && request.outcome.is_some()
                {
                    reported = report_after_expiry(&mut *tx, request)
                        .await?
                        .map(|key_id| (key_id, false));
                }
                break;
            }
        }
    }

    let mut health = None;
    if let (Some((key_id, probe)), Some(outcome)) = (reported, request.outcome) {
        let report = Report {
            outcome,
            retry_after_seconds: request.retry_after_seconds,
            probe,
        };
        if let Some(next) = apply_report(&mut *tx, &key_id, lease.lease_id, report, policy).await? {
            health = Some((key_id, next));
        }
    }
    Ok(StagedRelease {
        result: ReleaseResult {
            released: verdict,
            health,
        },
        refit,
    })
}

/// Records the outcome of a lease that expired before its release, once: ends it in the trail if
/// it still sits in its slot, then writes `outcome_after_expiry` unless the lease was released or
/// reported before (a unique index decides, so concurrent retries count once). Returns the
/// credential when the outcome is to be counted.
async fn report_after_expiry(
    conn: &mut PgConnection,
    request: &ReleaseRequest,
) -> Result<Option<KeyId>, sqlx::Error> {
    let lease = &request.lease;
    let key_id = sqlx::query_scalar!(
        r#"
        WITH stale AS (
            SELECT key_id, slot, lease_id, provider, pool, holder, lease_until
            FROM lease_slots
            WHERE lease_id = $1 AND key_id = $2 AND provider = $3 AND pool = $4
              AND lease_until <= statement_timestamp()
            FOR UPDATE
        ),
        freed AS (
            UPDATE lease_slots s
            SET lease_id = NULL, provider = NULL, pool = NULL, holder = NULL,
                granted_at = NULL, lease_until = NULL, probe = false
            FROM stale
            WHERE s.key_id = stale.key_id AND s.slot = stale.slot
            RETURNING stale.*
        ),
        expired_trail AS (
            INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at)
            SELECT 'expired', lease_id, key_id, provider, pool, slot, holder, lease_until, lease_until
            FROM freed
        ),
        granted AS (
            SELECT key_id, provider, pool, slot, holder,
                   (SELECT max(e.lease_until) FROM lease_events e WHERE e.lease_id = $1) AS lease_until
            FROM lease_events
            WHERE lease_id = $1 AND event = 'granted'
              AND key_id = $2 AND provider = $3 AND pool = $4
        )
        INSERT INTO lease_events
            (event, lease_id, key_id, provider, pool, slot, holder, outcome, lease_until, at)
        SELECT 'outcome_after_expiry', $1, key_id, provider, pool, slot, holder, $5, lease_until, statement_timestamp()
        FROM granted
        ON CONFLICT (lease_id) WHERE event IN ('released', 'outcome_after_expiry') DO NOTHING
        RETURNING key_id
        "#,
        lease.lease_id.as_uuid(),
        lease.key_id.as_str(),
        lease.provider.as_str(),
        lease.pool.as_str(),
        request.outcome.map(Outcome::as_str),
    )
    .fetch_optional(&mut *conn)
    .await?;
    key_id.map(|k| decoded(KeyId::parse(k))).transpose()
}

/// Applies one report to a credential's health under its row lock, in the caller's transaction,
/// and writes the transition (if any) to `credential_events`. Returns the new health, or `None`
/// if the credential no longer exists.
async fn apply_report(
    conn: &mut PgConnection,
    key_id: &KeyId,
    lease_id: LeaseId,
    report: Report,
    policy: &HealthPolicy,
) -> Result<Option<Health>, sqlx::Error> {
    let Some(row) = sqlx::query!(
        r#"
        SELECT status, status_reason, cooldown_until, health_successes, health_failures,
               health_rate_limits, health_decayed_at, recent_failures, cooldowns_in_a_row,
               last_success_at, recovered_at, statement_timestamp() AS "db_now!"
        FROM credentials
        WHERE key_id = $1
        FOR UPDATE
        "#,
        key_id.as_str(),
    )
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(None);
    };
    let current = Health {
        status: decoded(Status::parse(&row.status))?,
        status_reason: row.status_reason,
        cooldown_until: row.cooldown_until,
        successes: row.health_successes,
        failures: row.health_failures,
        rate_limits: row.health_rate_limits,
        decayed_at: row.health_decayed_at,
        recent_failures: row.recent_failures,
        cooldowns_in_a_row: row.cooldowns_in_a_row,
        last_success_at: row.last_success_at,
        recovered_at: row.recovered_at,
    };
    let (next, transition) = health::apply(&current, report, row.db_now, policy);
    sqlx::query!(
        r#"
        WITH updated AS (
            UPDATE credentials
            SET status = $2, status_reason = $3, cooldown_until = $4,
                health_successes = $5, health_failures = $6, health_rate_limits = $7,
                health_decayed_at = $8, recent_failures = $9, cooldowns_in_a_row = $10,
                last_success_at = $11, recovered_at = $12
            WHERE key_id = $1
            RETURNING key_id
        )
        INSERT INTO credential_events (key_id, event, old_status, new_status, reason, cooldown_until, lease_id, at)
        SELECT key_id, 'status_changed', $13, $14, $15, $4, $16, $8
        FROM updated
        WHERE $13::text IS NOT NULL
        "#,
        key_id.as_str(),
        next.status.as_str(),
        next.status_reason,
        next.cooldown_until,
        next.successes,
        next.failures,
        next.rate_limits,
        next.decayed_at,
        &next.recent_failures,
        next.cooldowns_in_a_row,
        next.last_success_at,
        next.recovered_at,
        transition.as_ref().map(|t| t.old_status.as_str()),
        transition.as_ref().map(|t| t.new_status.as_str()),
        transition.as_ref().map(|t| t.reason.as_str()),
        lease_id.as_uuid(),
    )
    .execute(&mut *conn)
    .await?;
    if let Some(t) = &transition {
        tracing::info!(key_id = %key_id, old = t.old_status.as_str(), new = t.new_status.as_str(), reason = %t.reason, "credential health changed");
    }
    Ok(Some(next))
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
               lease_until <= statement_timestamp() AS "expired!"
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
#[tracing::instrument(skip(conn), err(level = "debug"))]
pub async fn renew(
    conn: &mut PgConnection,
    lease: &LeaseRef,
    lease_seconds: LeaseSeconds,
) -> Result<Option<OffsetDateTime>, sqlx::Error> {
    let lease_seconds = i32::try_from(lease_seconds.get()).unwrap_or(i32::MAX);
    for _ in 0..3 {
        let renewed = sqlx::query_scalar!(
            r#"
            WITH renewed AS (
                UPDATE lease_slots
                SET lease_until = statement_timestamp() + make_interval(secs => $5::int4)
                WHERE lease_id = $1 AND key_id = $2 AND provider = $3 AND pool = $4
                  AND lease_until > statement_timestamp()
                RETURNING key_id, slot, lease_id, provider, pool, holder, lease_until
            ),
            trail AS (
                INSERT INTO lease_events
                    (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at)
                SELECT 'renewed', lease_id, key_id, provider, pool, slot, holder, lease_until, statement_timestamp()
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
        .fetch_optional(&mut *conn)
        .await?;
        if renewed.is_some() {
            return Ok(renewed);
        }
        match diagnose(&mut *conn, lease).await? {
            Diagnosis::Live => continue,
            Diagnosis::Gone(_) => return Ok(None),
        }
    }
    Ok(None)
}
