//! Lease state: the one-statement claim, release with the outcome's effect on health, renewal.

use std::collections::HashMap;

use sqlx::{PgConnection, PgExecutor};

use super::{Conn, Db};
use time::OffsetDateTime;

use crate::domain::{
    Holder, KeyId, LeaseId, LeaseSeconds, ModelName, Outcome, PoolName, ProviderName, RequestId,
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
    /// The client's idempotency key, if it gave one: the claim then answers with the lease the
    /// request already holds instead of taking a second slot.
    pub request: Option<&'a RequestKey>,
}

/// An allocation's idempotency key: the client's `request_id` and a digest of the parameters it
/// came with, so that a retry with other parameters is told apart (409 `request_id_conflict`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestKey {
    /// The client's key.
    pub id: RequestId,
    /// SHA-256 (hex) of the request's provider, pool asked for, model, lease_seconds and holder.
    pub digest: String,
}

impl RequestKey {
    /// The key of a request with these parameters.
    pub fn new(
        id: RequestId,
        provider: &ProviderName,
        pool: &PoolName,
        model: &ModelName,
        lease_seconds: LeaseSeconds,
        holder: Option<&Holder>,
    ) -> Self {
        use sha2::Digest;
        // unambiguous: every field is length-prefixed
        let mut hasher = sha2::Sha256::new();
        for field in [
            provider.as_str(),
            pool.as_str(),
            model.as_str(),
            &lease_seconds.get().to_string(),
            holder.map_or("\u{0}", Holder::as_str),
        ] {
            hasher.update((field.len() as u64).to_be_bytes());
            hasher.update(field.as_bytes());
        }
        Self {
            id,
            digest: hex::encode(hasher.finalize()),
        }
    }
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
    /// The pool the lease is in: the pool claimed from, or for a replay the pool that served the
    /// request's first attempt.
    pub pool: PoolName,
    /// The lease's fencing token: strictly increasing per credential with each grant, never
    /// reused (`lease_fence_seq`).
    pub fence: i64,
    /// The lease was granted to an earlier attempt of the same request (same `request_id` and
    /// parameters); this claim took no slot.
    pub replayed: bool,
}

/// What one run of the claim statement found.
#[derive(Debug, Clone)]
pub struct ClaimResult {
    /// The pool's version when the statement ran; compare with the candidate view's.
    pub pool_version: Option<i64>,
    /// The lease, if a slot was free (or the request already held one).
    pub granted: Option<GrantedLease>,
    /// The request's `request_id` holds a live lease granted for other parameters.
    pub conflict: bool,
}

/// Runs the claim for one request: [`claim_slots`] with a group of one.
pub async fn claim_slot(
    executor: impl PgExecutor<'_>,
    request: &ClaimRequest<'_>,
) -> Result<ClaimResult, sqlx::Error> {
    claim_slots(executor, std::slice::from_ref(request))
        .await?
        .pop()
        .ok_or(sqlx::Error::RowNotFound)
}

/// Runs the claim (SQL function `credpool_claim` in `migrations/20261130000005_performance.sql`;
/// read its comment for why it cannot oversell) for each request, in order, in ONE statement: a
/// group of claims costs one round trip. Returns one result per request, in the same order.
#[tracing::instrument(skip_all, fields(claims = requests.len()), err(level = "debug"))]
pub async fn claim_slots(
    executor: impl PgExecutor<'_>,
    requests: &[ClaimRequest<'_>],
) -> Result<Vec<ClaimResult>, sqlx::Error> {
    let claims: Vec<serde_json::Value> = requests
        .iter()
        .map(|request| {
            serde_json::json!({
                "ranked": request.ranked.iter().map(KeyId::as_str).collect::<Vec<_>>(),
                "provider": request.provider.as_str(),
                "pool": request.pool.as_str(),
                "model": request.model.as_str(),
                "lease_id": request.lease_id.as_uuid(),
                "holder": request.holder.map(Holder::as_str),
                "lease_seconds": i32::try_from(request.lease_seconds.get()).unwrap_or(i32::MAX),
                "request_id": request.request.map(|r| r.id.as_str()),
                "request_digest": request.request.map(|r| r.digest.as_str()),
            })
        })
        .collect();
    let rows = sqlx::query!(
        r#"
        SELECT claim AS "claim!", pool_version, key_id, lease_id, lease_pool, granted_at,
               lease_until, probe, provider_model, sealed_secret, pruned_expired, fence, request
        FROM credpool_claim($1)
        ORDER BY claim
        "#,
        serde_json::Value::Array(claims),
    )
    .fetch_all(executor)
    .await?;
    if rows.len() != requests.len() {
        return Err(sqlx::Error::Protocol(format!(
            "credpool_claim returned {} rows for {} claims",
            rows.len(),
            requests.len()
        )));
    }
    rows.into_iter()
        .zip(requests)
        .map(|(row, request)| {
            let granted = match (
                row.key_id,
                row.lease_id,
                row.granted_at,
                row.lease_until,
                row.sealed_secret,
                row.lease_pool,
                row.fence,
            ) {
                (
                    Some(key_id),
                    Some(lease_id),
                    Some(granted_at),
                    Some(lease_until),
                    Some(sealed_secret),
                    Some(pool),
                    Some(fence),
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
                    pool: decoded(PoolName::parse(pool))?,
                    fence,
                    replayed: row.request.as_deref() == Some("replayed"),
                }),
                _ => None,
            };
            Ok(ClaimResult {
                pool_version: row.pool_version,
                granted,
                conflict: row.request.as_deref() == Some("conflict"),
            })
        })
        .collect()
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
    /// The lease's fencing token, if the executor gave it: a lease whose fence differs is not
    /// this executor's (release answers `mismatch`, renewal `lease_lost`).
    pub fence: Option<i64>,
}

/// Why a release released nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NotReleased {
    /// The lease exists, but the key_id, provider, pool or fence given do not match it.
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
    db: &Db,
    request: &ReleaseRequest,
    policy: &HealthPolicy,
) -> Result<ReleaseResult, sqlx::Error> {
    let mut conn = db.acquire().await?;
    release_on(&mut conn, request, policy).await
}

/// [`release`] on a connection the caller holds (a group worker giving back a departed caller's
/// lease; the raw-SQL baseline of `credpool bench`).
pub async fn release_on(
    conn: &mut Conn<'_>,
    request: &ReleaseRequest,
    policy: &HealthPolicy,
) -> Result<ReleaseResult, sqlx::Error> {
    let mut tx = conn.begin().await?;
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
    pub async fn committed(self, conn: &mut Conn<'_>) -> ReleaseResult {
        if let Some(key_id) = self.refit {
            let refitted = async {
                let mut tx = conn.begin().await?;
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

/// The work of [`release`] inside the caller's transaction: [`release_group_in`] for one lease.
/// Row locks taken, in this order: the lease's slot row, then (with an outcome) its credential
/// row.
pub async fn release_in(
    tx: &mut PgConnection,
    request: &ReleaseRequest,
    policy: &HealthPolicy,
) -> Result<StagedRelease, sqlx::Error> {
    release_group_in(tx, &[request], policy)
        .await?
        .pop()
        .ok_or(sqlx::Error::RowNotFound)
}

/// The work of [`release`] for several leases inside the caller's transaction (a release group,
/// `src/groups.rs`), in three steps whatever their number:
/// 1. ONE statement frees every lease that is live and named by all four of its values, taking
///    their slot rows in ascending (key_id, slot) order;
/// 2. the others, in ascending key_id order, are diagnosed (mismatch, expired, unknown, or moved
///    to another slot by credpool_fit_slots while waiting for its row lock: then freed again, a
///    few attempts at most), and an expired lease's outcome is recorded once;
/// 3. ONE read and ONE write apply every outcome to its credential's health, taking the credential
///    rows in ascending key_id order.
///
/// Returns one result per request, in the order of `requests`. Callers that run several releases
/// concurrently keep at most one per credential in a group, so that every group takes its locks in
/// one global order (slot rows by key_id, then credential rows by key_id) and groups cannot
/// deadlock each other.
pub async fn release_group_in(
    tx: &mut PgConnection,
    requests: &[&ReleaseRequest],
    policy: &HealthPolicy,
) -> Result<Vec<StagedRelease>, sqlx::Error> {
    let mut freed = free_leases(&mut *tx, requests).await?;
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by(|&a, &b| requests[a].lease.key_id.cmp(&requests[b].lease.key_id));

    let mut verdicts = vec![Err(NotReleased::NotFound); requests.len()];
    let mut refits: Vec<Option<KeyId>> = vec![None; requests.len()];
    let mut reports: Vec<PendingReport> = Vec::new();
    for &i in &order {
        let request = requests[i];
        let lease = &request.lease;
        let mut found = freed.remove(&lease.lease_id);
        let mut reported: Option<(KeyId, bool)> = None;
        for attempt in 0..3 {
            if attempt > 0 {
                found = free_leases(&mut *tx, &[request])
                    .await?
                    .remove(&lease.lease_id);
            }
            if let Some(lease_freed) = found.take() {
                verdicts[i] = Ok(());
                if lease_freed.over_limit {
                    refits[i] = Some(lease_freed.key_id.clone());
                }
                reported = Some((lease_freed.key_id, lease_freed.probe));
                break;
            }
            match diagnose(&mut *tx, lease).await? {
                Diagnosis::Live => continue,
                Diagnosis::Gone(reason) => {
                    verdicts[i] = Err(reason);
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
        if let (Some((key_id, probe)), Some(outcome)) = (reported, request.outcome) {
            reports.push(PendingReport {
                request: i,
                key_id,
                lease_id: lease.lease_id,
                report: Report {
                    outcome,
                    retry_after_seconds: request.retry_after_seconds,
                    probe,
                },
            });
        }
    }

    let mut health: Vec<Option<(KeyId, Health)>> = vec![None; requests.len()];
    for (report, next) in reports
        .iter()
        .zip(apply_reports(&mut *tx, &reports, policy).await?)
    {
        health[report.request] = next.map(|next| (report.key_id.clone(), next));
    }
    Ok(verdicts
        .into_iter()
        .zip(health)
        .zip(refits)
        .map(|((released, health), refit)| StagedRelease {
            result: ReleaseResult { released, health },
            refit,
        })
        .collect())
}

/// A lease step 1 of [`release_group_in`] freed.
struct Freed {
    key_id: KeyId,
    probe: bool,
    /// Its credential is over a lowered limit (it may now be back under).
    over_limit: bool,
}

/// Frees, in ONE statement, every requested lease that is unexpired and named by all four of its
/// values: clears its slot and writes a `released` trail row with the outcome. Slot rows are
/// locked in ascending (key_id, slot) order. Returns the leases freed, by lease_id.
async fn free_leases(
    conn: &mut PgConnection,
    requests: &[&ReleaseRequest],
) -> Result<HashMap<LeaseId, Freed>, sqlx::Error> {
    let lease_ids: Vec<uuid::Uuid> = requests
        .iter()
        .map(|r| r.lease.lease_id.as_uuid())
        .collect();
    let key_ids: Vec<&str> = requests.iter().map(|r| r.lease.key_id.as_str()).collect();
    let providers: Vec<&str> = requests.iter().map(|r| r.lease.provider.as_str()).collect();
    let pools: Vec<&str> = requests.iter().map(|r| r.lease.pool.as_str()).collect();
    let outcomes: Vec<Option<&str>> = requests
        .iter()
        .map(|r| r.outcome.map(Outcome::as_str))
        .collect();
    let fences: Vec<Option<i64>> = requests.iter().map(|r| r.lease.fence).collect();
    let rows = sqlx::query!(
        r#"
        WITH wanted AS (
            SELECT *
            FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int8[])
                AS w (lease_id, key_id, provider, pool, outcome, fence)
        ),
        target AS (
            SELECT s.key_id, s.slot, s.lease_id, s.provider, s.pool, s.holder, s.lease_until,
                   s.probe, w.outcome
            FROM lease_slots s
            JOIN wanted w ON w.lease_id = s.lease_id
            -- probes by the lease_id index, whatever the plan makes of the join
            WHERE s.lease_id = ANY ($1::uuid[])
              AND s.key_id = w.key_id AND s.provider = w.provider AND s.pool = w.pool
              AND (w.fence IS NULL OR s.fence = w.fence)
              AND s.lease_until > statement_timestamp()
            ORDER BY s.key_id, s.slot
            FOR UPDATE OF s
        ),
        freed AS (
            UPDATE lease_slots s
            SET lease_id = NULL, provider = NULL, pool = NULL, holder = NULL,
                granted_at = NULL, lease_until = NULL, probe = false,
                fence = NULL, request_id = NULL, request_digest = NULL
            FROM target
            WHERE s.key_id = target.key_id AND s.slot = target.slot
            RETURNING target.*
        ),
        trail AS (
            INSERT INTO lease_events
                (event, lease_id, key_id, provider, pool, slot, holder, outcome, lease_until, at)
            SELECT 'released', lease_id, key_id, provider, pool, slot, holder, outcome,
                   lease_until, statement_timestamp()
            FROM freed
        )
        SELECT lease_id AS "lease_id!", key_id AS "key_id!", probe AS "probe!",
               coalesce((SELECT c.slots_over_limit FROM credentials c
                         WHERE c.key_id = freed.key_id), false) AS "over_limit!"
        FROM freed
        "#,
        &lease_ids,
        &key_ids as &[&str],
        &providers as &[&str],
        &pools as &[&str],
        &outcomes as &[Option<&str>],
        &fences as &[Option<i64>],
    )
    .fetch_all(&mut *conn)
    .await?;
    rows.into_iter()
        .map(|row| {
            Ok((
                LeaseId::from(row.lease_id),
                Freed {
                    key_id: decoded(KeyId::parse(row.key_id))?,
                    probe: row.probe,
                    over_limit: row.over_limit,
                },
            ))
        })
        .collect()
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
                granted_at = NULL, lease_until = NULL, probe = false,
                fence = NULL, request_id = NULL, request_digest = NULL
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

/// An outcome to apply to a credential's health, for the request at index `request`.
struct PendingReport {
    request: usize,
    key_id: KeyId,
    lease_id: LeaseId,
    report: Report,
}

/// Applies reports to their credentials' health ([`crate::health::apply`], in the order given;
/// several on one credential apply one after the other) under the credential rows' locks, taken
/// in ascending key_id order by ONE read, then writes every new health and every transition to
/// `credential_events` in ONE statement. Returns, per report, the health after it, or `None` if
/// the credential no longer exists.
async fn apply_reports(
    conn: &mut PgConnection,
    reports: &[PendingReport],
    policy: &HealthPolicy,
) -> Result<Vec<Option<Health>>, sqlx::Error> {
    if reports.is_empty() {
        return Ok(Vec::new());
    }
    let key_ids: Vec<&str> = reports.iter().map(|r| r.key_id.as_str()).collect();
    let rows = sqlx::query!(
        r#"
        SELECT key_id, status, status_reason, cooldown_until, health_successes, health_failures,
               health_rate_limits, health_decayed_at, recent_failures, cooldowns_in_a_row,
               last_success_at, recovered_at, statement_timestamp() AS "db_now!"
        FROM credentials
        WHERE key_id = ANY ($1::text[])
        ORDER BY key_id
        FOR UPDATE
        "#,
        &key_ids as &[&str],
    )
    .fetch_all(&mut *conn)
    .await?;
    let mut current: HashMap<String, (Health, OffsetDateTime)> = HashMap::new();
    for row in rows {
        let health = super::health_of_row!(row)?;
        current.insert(row.key_id, (health, row.db_now));
    }

    let mut results = Vec::with_capacity(reports.len());
    let mut transitions = Vec::new();
    for pending in reports {
        let Some((health, db_now)) = current.get_mut(pending.key_id.as_str()) else {
            results.push(None);
            continue;
        };
        let (next, transition) = health::apply(health, pending.report, *db_now, policy);
        if let Some(t) = transition {
            tracing::info!(key_id = %pending.key_id, old = t.old_status.as_str(), new = t.new_status.as_str(), reason = %t.reason, "credential health changed");
            transitions.push(serde_json::json!({
                "key_id": pending.key_id.as_str(),
                "old_status": t.old_status.as_str(),
                "new_status": t.new_status.as_str(),
                "reason": t.reason,
                "cooldown_until": next.cooldown_until.map(rfc3339),
                "lease_id": pending.lease_id.as_uuid(),
                "at": next.decayed_at.map(rfc3339),
            }));
        }
        *health = next.clone();
        results.push(Some(next));
    }
    let next: Vec<serde_json::Value> = current
        .iter()
        .map(|(key_id, (h, _))| {
            serde_json::json!({
                "key_id": key_id,
                "status": h.status.as_str(),
                "status_reason": h.status_reason,
                "cooldown_until": h.cooldown_until.map(rfc3339),
                "health_successes": h.successes,
                "health_failures": h.failures,
                "health_rate_limits": h.rate_limits,
                "health_decayed_at": h.decayed_at.map(rfc3339),
                "recent_failures": h.recent_failures.iter().copied().map(rfc3339).collect::<Vec<_>>(),
                "cooldowns_in_a_row": h.cooldowns_in_a_row,
                "last_success_at": h.last_success_at.map(rfc3339),
                "recovered_at": h.recovered_at.map(rfc3339),
            })
        })
        .collect();
    sqlx::query!(
        r#"
        WITH next AS (
            SELECT *
            FROM jsonb_to_recordset($1) AS n (
                key_id text, status text, status_reason text, cooldown_until timestamptz,
                health_successes double precision, health_failures double precision,
                health_rate_limits double precision, health_decayed_at timestamptz,
                recent_failures timestamptz[], cooldowns_in_a_row integer,
                last_success_at timestamptz, recovered_at timestamptz)
        ),
        updated AS (
            UPDATE credentials c
            SET status = n.status, status_reason = n.status_reason,
                cooldown_until = n.cooldown_until, health_successes = n.health_successes,
                health_failures = n.health_failures, health_rate_limits = n.health_rate_limits,
                health_decayed_at = n.health_decayed_at, recent_failures = n.recent_failures,
                cooldowns_in_a_row = n.cooldowns_in_a_row, last_success_at = n.last_success_at,
                recovered_at = n.recovered_at
            FROM next n
            -- probes by the primary key, whatever the plan makes of the join
            WHERE c.key_id = ANY ($3::text[]) AND c.key_id = n.key_id
            RETURNING c.key_id
        )
        INSERT INTO credential_events
            (key_id, event, old_status, new_status, reason, cooldown_until, lease_id, at)
        SELECT t.key_id, 'status_changed', t.old_status, t.new_status, t.reason, t.cooldown_until,
               t.lease_id, coalesce(t.at, statement_timestamp())
        FROM jsonb_to_recordset($2) AS t (
            key_id text, old_status text, new_status text, reason text,
            cooldown_until timestamptz, lease_id uuid, at timestamptz)
        WHERE t.key_id IN (SELECT key_id FROM updated)
        "#,
        serde_json::Value::Array(next),
        serde_json::Value::Array(transitions),
        &key_ids as &[&str],
    )
    .execute(&mut *conn)
    .await?;
    Ok(results)
}

/// `at` as RFC 3339 text, for timestamps passed to PostgreSQL inside JSON.
fn rfc3339(at: OffsetDateTime) -> String {
    at.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
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
        SELECT key_id = $2 AND provider = $3 AND pool = $4
                   AND ($5::int8 IS NULL OR fence = $5) AS "matches!",
               lease_until <= statement_timestamp() AS "expired!"
        FROM lease_slots
        WHERE lease_id = $1
        "#,
        lease.lease_id.as_uuid(),
        lease.key_id.as_str(),
        lease.provider.as_str(),
        lease.pool.as_str(),
        lease.fence,
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
                  AND ($6::int8 IS NULL OR fence = $6)
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
            lease.fence,
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
