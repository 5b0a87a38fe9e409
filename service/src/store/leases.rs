//! Lease state from Rust: each transition is one call of its SQL function (`sql/`, which
//! says what each keeps and in which order it takes its locks): the claim, release with the
//! outcome's effect on health, renewal, and fitting a credential's slots to its limit.

use serde::Serialize;
use sqlx::{PgConnection, PgExecutor};

use super::{Conn, Db};
use time::OffsetDateTime;

use crate::domain::health::{Health, HealthPolicy};
use crate::domain::{
    AffinityKey, AffinityMode, AffinityResult, AffinityTtl, HeldBy, Holder, KeyId, LeaseId,
    LeaseSeconds, ModelName, Outcome, PoolName, ProviderName, RequestId, TenantKeyHash,
};

/// Values read back from the database passed the same validation on the way in (and the
/// table's CHECK constraints); a failure here is a decode error, not bad input.
pub(crate) fn decoded<T>(value: Result<T, crate::domain::InvalidValue>) -> Result<T, sqlx::Error> {
    value.map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

/// One claim, as the claim statement reads it: serialized once (serde) into the JSON object that
/// `credpool_claim` takes apart (sql/claim.sql, PARSE). Owned: it travels from the allocator
/// through the claim groups to the statement unchanged.
#[derive(Debug, Clone, Serialize)]
pub struct Claim {
    /// Candidate key ids, best first.
    pub ranked: Vec<KeyId>,
    /// The provider requested.
    pub provider: ProviderName,
    /// The pool being tried (one step of the pool sequence).
    pub pool: PoolName,
    /// The model requested.
    pub model: ModelName,
    /// The id the new lease will carry.
    pub lease_id: LeaseId,
    /// The executor's name for itself, if it gave one.
    pub holder: Option<Holder>,
    /// The lease length, in seconds.
    #[serde(serialize_with = "lease_seconds")]
    pub lease_seconds: LeaseSeconds,
    /// The client's idempotency key, if it gave one (`request_id`, `request_digest`): the claim
    /// then answers with the lease the request already holds instead of taking a second slot.
    #[serde(flatten)]
    pub request: Option<RequestKey>,
    /// The tokens the lease reserves in its credential's token windows (the allocate's estimate;
    /// 0: none).
    pub tokens: u64,
    /// The hash of the tenant key presented (`key_hash`, hex; `None`: the internal key, tenant
    /// `default`): the claim checks it is live and takes its tenant's cap.
    #[serde(rename = "key_hash", serialize_with = "key_hash")]
    pub caller: Option<TenantKeyHash>,
    /// The request's conversation affinity, if it named an `affinity_key` (`affinity_key`,
    /// `affinity_pools`, `affinity_ttl_seconds`, `affinity_mode`): its binding's credential is
    /// tried first, and the grant (re)binds it.
    #[serde(flatten)]
    pub affinity: Option<ClaimAffinity>,
    /// The request's wait, if it may wait for a slot (`wait_ms`): the claim then yields to a
    /// tenant further below its weighted share of the pool that waits too, and when it grants
    /// nothing it records the request as waiting (docs/design.md "Fair share"). `None`: it
    /// answers at once and never yields.
    pub waiting: Option<ClaimWaiting>,
    /// Whether a candidate has rate windows, as the caller's view of the pool says (the claim
    /// then locks window rows too; a credential given windows since is passed over by its slots'
    /// gate until the view catches up). `None`: the claim looks for itself, one probe per
    /// candidate.
    pub windowed: Option<bool>,
}

impl Claim {
    /// A claim of the internal key's tenant over `ranked` (best first) for a `lease_seconds`
    /// lease, with nothing else: no holder, idempotency key, token estimate, affinity or wait; a
    /// new lease id; the claim looks for rate windows itself.
    pub fn new(
        ranked: Vec<KeyId>,
        provider: ProviderName,
        pool: PoolName,
        model: ModelName,
        lease_seconds: LeaseSeconds,
    ) -> Self {
        Self {
            ranked,
            provider,
            pool,
            model,
            lease_id: LeaseId::generate(),
            holder: None,
            lease_seconds,
            request: None,
            tokens: 0,
            caller: None,
            affinity: None,
            waiting: None,
            windowed: None,
        }
    }
}

fn lease_seconds<S: serde::Serializer>(value: &LeaseSeconds, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u32(value.get())
}

fn key_hash<S: serde::Serializer>(value: &Option<TenantKeyHash>, s: S) -> Result<S::Ok, S::Error> {
    match value {
        Some(hash) => s.serialize_str(&hash.to_hex()),
        None => s.serialize_none(),
    }
}

fn milliseconds<S: serde::Serializer>(
    value: &std::time::Duration,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_f64(value.as_secs_f64() * 1e3)
}

/// A waiting request, as its claims record it in `pool_waiters` (docs/design.md "Fair share").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClaimWaiting {
    /// The request's id for its row.
    pub waiter: uuid::Uuid,
    /// Its process's name (whose liveness keeps the row live).
    pub instance: String,
    /// Its pool sequence.
    pub pools: Vec<PoolName>,
    /// How long it has waited, when the claim is sent (`waited_ms`): the claim dates its arrival
    /// on the database clock, that much before its own clock (ties between tenants of equal share
    /// go to the earliest). Durations, never dates: every decision is on the database clock,
    /// whatever the service host's.
    #[serde(rename = "waited_ms", serialize_with = "milliseconds")]
    pub waited: std::time::Duration,
    /// How much longer it may wait, from when the claim is sent (`wait_ms`; the claim dates the
    /// end of the wait on its clock likewise).
    #[serde(rename = "wait_ms", serialize_with = "milliseconds")]
    pub wait_left: std::time::Duration,
}

/// A claim's conversation affinity (docs/design.md "Affinity"): which binding it reads and
/// writes, how long a written binding lives, and whether it is strict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClaimAffinity {
    /// The conversation's key.
    #[serde(rename = "affinity_key")]
    pub key: AffinityKey,
    /// The pool sequence of the pool asked for, that pool first: the binding is the asked pool's
    /// (a `vip` conversation served from `default` stays a `vip` conversation), and a strict
    /// binding only confines a claim while its credential is in one of these pools.
    #[serde(rename = "affinity_pools")]
    pub pools: Vec<PoolName>,
    /// How long a binding this claim writes lives, in seconds (refreshed on each hit).
    #[serde(rename = "affinity_ttl_seconds", serialize_with = "ttl_seconds")]
    pub ttl: AffinityTtl,
    /// Preferred or strict.
    #[serde(rename = "affinity_mode")]
    pub mode: AffinityMode,
}

fn ttl_seconds<S: serde::Serializer>(value: &AffinityTtl, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u32(value.get())
}

/// An allocation's idempotency key: the client's `request_id` and a digest of the parameters it
/// came with, so that a retry with other parameters is told apart (409 `request_id_conflict`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestKey {
    /// The client's key.
    #[serde(rename = "request_id")]
    pub id: RequestId,
    /// SHA-256 (hex) of the request's provider, pool asked for, model, lease_seconds, holder and
    /// token estimate.
    #[serde(rename = "request_digest")]
    pub digest: String,
}

impl RequestKey {
    /// The key of a request with these parameters (`tokens`: its token estimate; a request
    /// without one digests as it did before estimates existed).
    pub fn new(
        id: RequestId,
        provider: &ProviderName,
        pool: &PoolName,
        model: &ModelName,
        lease_seconds: LeaseSeconds,
        holder: Option<&Holder>,
        tokens: u64,
    ) -> Self {
        use sha2::Digest;
        // unambiguous: every field is length-prefixed
        let mut hasher = sha2::Sha256::new();
        let tokens = (tokens > 0).then(|| tokens.to_string());
        for field in [
            provider.as_str(),
            pool.as_str(),
            model.as_str(),
            &lease_seconds.get().to_string(),
            holder.map_or("\u{0}", Holder::as_str),
        ]
        .into_iter()
        .chain(tokens.as_deref())
        {
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
    /// The tenant holding the lease.
    pub tenant: String,
    /// For a claim with an affinity key (not a replay): whether its bound credential served.
    pub affinity: Option<AffinityResult>,
}

/// What one run of the claim statement answered for one claim: its outcome, and what every
/// answer carries.
#[derive(Debug)]
pub struct ClaimAnswer {
    /// What the claim came to.
    pub outcome: ClaimOutcome,
    /// The pool's version when the statement ran; compare with the candidate view's.
    pub pool_version: Option<i64>,
    /// The tenant the claim was made for (`None` when unauthorized).
    pub tenant: Option<String>,
    /// The claim's clock (database), for a Retry-After from a `frees_at`.
    pub db_now: Option<OffsetDateTime>,
}

/// What a claim came to: the outcomes exclude each other. Decoded once from the claim
/// statement's row ([`ClaimOutcome::decode`]); a word the statement can say that this does not
/// know is a decode error, never a silent fallthrough.
#[derive(Debug)]
pub enum ClaimOutcome {
    /// A slot was free: the new lease.
    Granted(GrantedLease),
    /// The lease an earlier attempt of the same request (same `request_id` and parameters) was
    /// granted, answered again; this claim took no slot.
    Replayed(GrantedLease),
    /// The request's `request_id` holds a live lease granted for other parameters.
    Conflict,
    /// Another transaction is claiming for the same `request_id` right now (a retry that overtook
    /// its first attempt): nothing was done; claim again in a moment to get that attempt's answer.
    InFlight,
    /// The tenant key presented is unknown or revoked: nothing was done.
    Unauthorized,
    /// The tenant's `pools` no longer admit the claim's pool (changed since the request arrived):
    /// nothing was done.
    PoolNotAllowed,
    /// Nothing granted: the tenant holds as many live leases as its cap allows, or a window of
    /// its rate limits has no room (`window`). `frees_at`: when it may be served again (`None`
    /// for a window that can never hold the reservation).
    TenantLimit {
        /// Whether a window holds it back (else its cap).
        window: bool,
        /// When the tenant may be served again, on the database clock.
        frees_at: Option<OffsetDateTime>,
    },
    /// Nothing was looked at: the request waits, and this tenant, further below its weighted
    /// share of the pool, waits for it too (docs/design.md "Fair share"); wake its waiter.
    Yield {
        /// The tenant yielded to.
        to: String,
    },
    /// Nothing was granted, but a candidate that may serve at once (read after the claim) was
    /// held or changed by another transaction at that moment (a concurrent claim, the reaper, an
    /// operator's change): claiming again soon may succeed. `bound`: the claim was confined to
    /// a strict binding's credential ([`ClaimOutcome::Bound`] once it settles).
    Busy {
        /// Whether a strict binding confined the claim.
        bound: bool,
        /// When a candidate may serve, and what holds it back.
        missed: Missed,
    },
    /// Nothing was granted because a strict affinity binding confined the claim to its bound
    /// credential (`missed` is that credential's): other candidates were not considered, and
    /// claiming them again would not change that.
    Bound(Missed),
    /// Nothing was granted: no candidate could serve.
    Nothing(Missed),
}

/// When a claim that granted nothing may be served, and why not now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Missed {
    /// The earliest moment a candidate may serve the claim (a slot, a cooldown, a window or a
    /// token refresh ends), on the database clock; `None` when nothing known ends.
    pub frees_at: Option<OffsetDateTime>,
    /// What holds that candidate back.
    pub held_by: Option<HeldBy>,
}

impl ClaimOutcome {
    /// The lease the claim answered with, granted now or replayed; `None` for any other outcome.
    pub fn into_lease(self) -> Option<GrantedLease> {
        match self {
            ClaimOutcome::Granted(lease) | ClaimOutcome::Replayed(lease) => Some(lease),
            _ => None,
        }
    }

    /// A [`ClaimOutcome::Busy`] taken as final (the caller stopped claiming again): what it
    /// would have been had nothing been held. Any other outcome is itself.
    pub fn settled(self) -> Self {
        match self {
            ClaimOutcome::Busy {
                bound: true,
                missed,
            } => ClaimOutcome::Bound(missed),
            ClaimOutcome::Busy {
                bound: false,
                missed,
            } => ClaimOutcome::Nothing(missed),
            other => other,
        }
    }

    /// The outcome of a claim statement's row from its words (`state`: the `request` column,
    /// `held_by`, `affinity`; the enum types `credpool_claim_state`, `credpool_held_by` and
    /// `credpool_affinity_answer`), its `frees_at` and `yield_to`, and the lease it granted,
    /// if any. Errors name a word this decoder does not know, or one out of place.
    pub fn decode(
        state: Option<&str>,
        held_by: Option<&str>,
        affinity: Option<&str>,
        frees_at: Option<OffsetDateTime>,
        yield_to: Option<String>,
        granted: Option<GrantedLease>,
    ) -> Result<Self, String> {
        let unknown = |column: &str, word: &str| format!("the claim answered {column} {word:?}");
        if let Some(affinity) = affinity
            && affinity != "bound"
            && AffinityResult::parse(affinity).is_none()
        {
            return Err(unknown("affinity", affinity));
        }
        let missed = || -> Result<Missed, String> {
            Ok(Missed {
                frees_at,
                held_by: match held_by {
                    None => None,
                    Some(word) => {
                        Some(HeldBy::parse(word).ok_or_else(|| unknown("held_by", word))?)
                    }
                },
            })
        };
        let bound = affinity == Some("bound");
        Ok(match (state, granted) {
            (Some("replayed"), Some(lease)) => ClaimOutcome::Replayed(lease),
            (None, Some(lease)) => ClaimOutcome::Granted(lease),
            (state, Some(_)) => {
                return Err(unknown("a grant with state", state.unwrap_or_default()));
            }
            (Some("conflict"), None) => ClaimOutcome::Conflict,
            (Some("in_flight"), None) => ClaimOutcome::InFlight,
            (Some("unauthorized"), None) => ClaimOutcome::Unauthorized,
            (Some("pool_not_allowed"), None) => ClaimOutcome::PoolNotAllowed,
            (Some("tenant_limit"), None) => ClaimOutcome::TenantLimit {
                window: match held_by {
                    Some("tenant_window") => true,
                    Some("tenant") => false,
                    other => {
                        return Err(unknown("tenant_limit held by", other.unwrap_or_default()));
                    }
                },
                frees_at,
            },
            (Some("busy"), None) => ClaimOutcome::Busy {
                bound,
                missed: missed()?,
            },
            (Some("yield"), None) => ClaimOutcome::Yield {
                to: yield_to.ok_or_else(|| unknown("yield to", "nobody"))?,
            },
            (Some(state), None) => return Err(unknown("state", state)),
            (None, None) if bound => ClaimOutcome::Bound(missed()?),
            (None, None) => ClaimOutcome::Nothing(missed()?),
        })
    }
}

/// Deletes waiting request `waiter`'s `pool_waiters` row (docs/design.md "Fair share"): its wait
/// for a slot of `provider` ended without a lease, or its caller left while a claim of it was in
/// flight. Nothing when there is none. (The provider named: on Citus the row is on the
/// provider's worker alone.)
pub async fn forget_waiter(
    executor: impl PgExecutor<'_>,
    waiter: uuid::Uuid,
    provider: &ProviderName,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "DELETE FROM pool_waiters WHERE waiter = $1 AND provider = $2",
        waiter,
        provider.as_str()
    )
    .execute(executor)
    .await?;
    Ok(())
}

/// Runs one claim: [`claim_slots`] with a group of one.
pub async fn claim_slot(
    conn: &mut PgConnection,
    claim: &Claim,
) -> Result<ClaimAnswer, sqlx::Error> {
    claim_slots(conn, &[claim])
        .await?
        .pop()
        .ok_or(sqlx::Error::RowNotFound)
}

/// Runs the claim (SQL function `credpool_claim` in `sql/claim.sql`; read its comment for why it
/// cannot oversell and never waits for a lock) for each of `claims`, in order, in ONE statement:
/// a group of claims costs one round trip. Returns one answer per claim, in the same order.
///
/// A lease the statement granted (or replayed) that cannot be turned into an answer — a column
/// unexpectedly NULL, a value that does not parse, a word the decoder does not know — is given
/// back at once (force released, as actor `credpool`, see [`give_back_unanswerable`]) rather than
/// stranded until its lease_until, and its claim is answered as if nothing had been granted; the
/// error is logged (no secret in it). A word it does not know in an answer without a lease is a
/// decode error.
#[tracing::instrument(skip_all, fields(claims = claims.len()), err(level = "debug"))]
pub async fn claim_slots(
    conn: &mut PgConnection,
    claims: &[&Claim],
) -> Result<Vec<ClaimAnswer>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        SELECT claim AS "claim!", pool_version, key_id, lease_id, lease_pool, granted_at,
               lease_until, probe, provider_model, sealed_secret, pruned_expired, fence, request,
               frees_at, held_by, tenant, db_now, affinity, yield_to
        FROM credpool_claim($1)
        ORDER BY claim
        "#,
        serde_json::to_value(claims).map_err(|e| sqlx::Error::Encode(Box::new(e)))?,
    )
    .fetch_all(&mut *conn)
    .await?;
    if rows.len() != claims.len() {
        return Err(sqlx::Error::Protocol(format!(
            "credpool_claim returned {} rows for {} claims",
            rows.len(),
            claims.len()
        )));
    }
    let mut unanswerable = Vec::new();
    let mut answers = Vec::with_capacity(rows.len());
    for (mut row, claim) in rows.into_iter().zip(claims) {
        // the granted row's owned parts are moved out, not copied (the claim's hot path)
        let mut granted = || -> Result<Option<GrantedLease>, String> {
            let Some(lease_id) = row.lease_id else {
                return Ok(None);
            };
            let missing = |column: &str| format!("{column} is NULL");
            Ok(Some(GrantedLease {
                key_id: KeyId::parse(row.key_id.clone().ok_or_else(|| missing("key_id"))?)
                    .map_err(|e| e.to_string())?,
                lease_id: LeaseId::from(lease_id),
                granted_at: row.granted_at.ok_or_else(|| missing("granted_at"))?,
                lease_until: row.lease_until.ok_or_else(|| missing("lease_until"))?,
                probe: row.probe.unwrap_or(false),
                provider_model: row
                    .provider_model
                    .take()
                    .unwrap_or_else(|| claim.model.as_str().to_owned()),
                sealed_secret: row
                    .sealed_secret
                    .take()
                    .ok_or_else(|| missing("the sealed secret"))?,
                pruned_expired: row.pruned_expired.unwrap_or(false),
                pool: PoolName::parse(row.lease_pool.take().ok_or_else(|| missing("pool"))?)
                    .map_err(|e| e.to_string())?,
                fence: row.fence.ok_or_else(|| missing("fence"))?,
                tenant: row.tenant.clone().ok_or_else(|| missing("tenant"))?,
                affinity: row.affinity.as_deref().and_then(AffinityResult::parse),
            }))
        };
        let granted = granted();
        let leased = row.lease_id.is_some();
        let outcome = granted.and_then(|granted| {
            ClaimOutcome::decode(
                row.request.as_deref(),
                row.held_by.as_deref(),
                row.affinity.as_deref(),
                row.frees_at,
                row.yield_to.take(),
                granted,
            )
        });
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(why) if leased => {
                unanswerable.push((row.key_id.take(), row.lease_id, why));
                ClaimOutcome::Nothing(Missed::default())
            }
            Err(why) => return Err(sqlx::Error::Decode(why.into())),
        };
        answers.push(ClaimAnswer {
            outcome,
            pool_version: row.pool_version,
            tenant: row.tenant,
            db_now: row.db_now,
        });
    }
    for (key_id, lease_id, why) in unanswerable {
        give_back_unanswerable(&mut *conn, key_id.as_deref(), lease_id, &why).await?;
    }
    Ok(answers)
}

/// Gives back a lease that was granted but cannot be answered (see [`claim_slots`]): force
/// released in the trail with the reason "granted but could not be answered" and actor
/// `credpool`, so that its slot frees now and the trail says why.
async fn give_back_unanswerable(
    conn: &mut PgConnection,
    key_id: Option<&str>,
    lease_id: Option<uuid::Uuid>,
    why: &str,
) -> Result<(), sqlx::Error> {
    tracing::error!(
        key_id,
        ?lease_id,
        why,
        "a granted lease could not be answered; giving it back"
    );
    sqlx::query!(
        "SELECT lease_id FROM credpool_force_release($1, $2, 'granted but could not be answered', 'credpool')",
        key_id,
        lease_id,
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(())
}

/// Brings a credential's slot rows in line with its limit and drain state (SQL function
/// `credpool_fit_slots`; see its comment). Runs in the caller's transaction, which must not hold
/// a slot row of another credential (the lock order: all slot rows before any credential row).
#[tracing::instrument(skip(executor), err(level = "debug"))]
pub async fn fit_slots(executor: impl PgExecutor<'_>, key_id: &KeyId) -> Result<(), sqlx::Error> {
    sqlx::query!("SELECT credpool_fit_slots($1)", key_id.as_str())
        .execute(executor)
        .await?;
    Ok(())
}

/// The four values that name a lease in release and renew (docs/design.md "The protocol", step 4).
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
    /// The key presented names no live key (revoked, or never minted), or a key of another
    /// tenant than the lease's: nothing was done. Answered 401, never as a release's `reason`.
    Unauthorized,
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
    /// The tokens the call really used, if the executor says: they replace the lease's
    /// reservation in its credential's token windows.
    pub usage_tokens: Option<u64>,
    /// The tenant key the executor presented (its hash), checked by the release statement itself
    /// (a revoked or unknown key, or a key of another tenant than the lease's, releases nothing:
    /// [`NotReleased::Unauthorized`]); `None`: the configured internal key (tenant `default`).
    /// The service giving a lease back passes the key that claimed it.
    pub caller: Option<crate::domain::TenantKeyHash>,
    /// Whether the reporter's outcome may take the credential out of traffic until an operator
    /// acts (`auth_error`, or `quota_exhausted` without a retry_after): the internal key, a
    /// tenant with `reports_may_disable`, and the service's own releases (which report no
    /// outcome). A tenant's report has bounded reach by default; the trail names the
    /// tenant of the key the release presents.
    pub may_disable: bool,
}

/// What a release did.
#[derive(Debug, Clone)]
pub struct ReleaseResult {
    /// `Ok` when the lease was released; otherwise why nothing was.
    pub released: Result<(), NotReleased>,
    /// The credential's health after the outcome was applied (also when the lease had expired:
    /// the call happened), for the caller's candidate view.
    pub health: Option<(KeyId, Health)>,
    /// When a usage replaced the reservation: the lease's grant time and usage - reservation, for
    /// the caller's view of the windows.
    pub usage: Option<(OffsetDateTime, i64)>,
    /// The lease was released and a request waits for a slot of its pool on some service process
    /// (`pool_waiters`): the freed slot is to be announced to the other processes once the
    /// release has committed.
    pub waiters: bool,
}

/// Releases a lease if all four of its values (and the fence, when given) match and it has not
/// expired: frees its slot, writes a `released` trail row with the outcome, and applies the
/// outcome to the credential's health, all in one statement (SQL function `credpool_release`,
/// sql/release.sql). A lease that has already expired releases nothing, but its outcome still
/// counts for health, once (`outcome_after_expiry`). A mismatch or an unknown lease changes
/// nothing.
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
/// lease; the unbatched baseline of `credpool bench`).
pub async fn release_on(
    conn: &mut Conn<'_>,
    request: &ReleaseRequest,
    policy: &HealthPolicy,
) -> Result<ReleaseResult, sqlx::Error> {
    let mut work = conn.work().await?;
    let staged = release_group(&mut *work, &[request], policy)
        .await?
        .pop()
        .ok_or(sqlx::Error::RowNotFound)?;
    work.done().await?;
    Ok(staged.committed(conn).await)
}

/// A release done by a statement whose transaction may not have committed yet.
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

    /// After the transaction has committed: refits the credential if the release freed a slot
    /// that was over a lowered limit, and returns the result.
    ///
    /// The refit runs in its own transaction, after the release's: credpool_fit_slots locks every
    /// slot row of the credential in ascending order, which a transaction already holding some
    /// slot rows must not do (the lock order). It is done here rather than left to the next
    /// allocation so that capacity returns whichever replica, or whose stale view, comes next; if
    /// this process stops first, the cleanup pass refits it (`credpool_refit_over_limit`). The
    /// release itself has committed, so a failure here is logged, not reported.
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

/// The health policy as `credpool_release` reads it (`p_policy`; seconds).
pub fn policy_json(policy: &HealthPolicy) -> serde_json::Value {
    serde_json::json!({
        "half_life_seconds": policy.half_life_seconds,
        "failure_threshold": policy.failure_threshold,
        "failure_window_seconds": policy.failure_window_seconds,
        "cooldown_seconds": policy.cooldown_seconds,
        "max_cooldown_seconds": policy.max_cooldown_seconds,
        "rate_limit_seconds": policy.rate_limit_seconds,
        "max_report_rest_seconds": policy.max_report_rest_seconds,
    })
}

/// The work of [`release`] for one lease or a group (the allocator's groups): ONE statement,
/// `credpool_release` (sql/release.sql: it ends the leases or says why not, charges usage, applies
/// every counted outcome to its credential's health in request order and writes it, under the
/// lock order, so groups never deadlock one another). Needs no explicit transaction: autocommit
/// makes it one. Returns one result per request, in the order of `requests`.
pub async fn release_group(
    executor: impl PgExecutor<'_>,
    requests: &[&ReleaseRequest],
    policy: &HealthPolicy,
) -> Result<Vec<StagedRelease>, sqlx::Error> {
    let releases: Vec<serde_json::Value> = requests
        .iter()
        .map(|r| {
            serde_json::json!({
                "lease_id": r.lease.lease_id.as_uuid(),
                "key_id": r.lease.key_id.as_str(),
                "provider": r.lease.provider.as_str(),
                "pool": r.lease.pool.as_str(),
                "fence": r.lease.fence,
                "outcome": r.outcome.map(Outcome::as_str),
                "usage_tokens": r.usage_tokens,
                "key_hash": r.caller.map(|hash| hash.to_hex()),
                "retry_after_seconds": r.retry_after_seconds,
                "may_disable": r.may_disable,
            })
        })
        .collect();
    let rows = sqlx::query!(
        r#"
        SELECT release AS "release!", verdict AS "verdict!", key_id, refit AS "refit!",
               usage_granted_at, usage_delta, counted AS "counted!", status, status_reason,
               cooldown_until, health_successes, health_failures, health_rate_limits,
               health_decayed_at, recent_failures, cooldowns_in_a_row, last_success_at,
               recovered_at, waiters AS "waiters!"
        FROM credpool_release($1, $2)
        ORDER BY release
        "#,
        serde_json::Value::Array(releases),
        policy_json(policy),
    )
    .fetch_all(executor)
    .await?;
    if rows.len() != requests.len() {
        return Err(sqlx::Error::Protocol(format!(
            "credpool_release returned {} rows for {} releases",
            rows.len(),
            requests.len()
        )));
    }
    rows.into_iter()
        .map(|row| {
            let key_id = row.key_id.map(|k| decoded(KeyId::parse(k))).transpose()?;
            let released = match row.verdict.as_str() {
                "released" => Ok(()),
                "mismatch" => Err(NotReleased::Mismatch),
                "expired" => Err(NotReleased::Expired),
                "unauthorized" => Err(NotReleased::Unauthorized),
                _ => Err(NotReleased::NotFound),
            };
            let health = match (&key_id, row.status) {
                (Some(key_id), Some(status)) if row.counted => Some((
                    key_id.clone(),
                    Health {
                        status: decoded(crate::domain::Status::parse(&status))?,
                        status_reason: row.status_reason,
                        cooldown_until: row.cooldown_until,
                        successes: row.health_successes.unwrap_or(0.0),
                        failures: row.health_failures.unwrap_or(0.0),
                        rate_limits: row.health_rate_limits.unwrap_or(0.0),
                        decayed_at: row.health_decayed_at,
                        recent_failures: row.recent_failures.unwrap_or_default(),
                        cooldowns_in_a_row: row.cooldowns_in_a_row.unwrap_or(0),
                        last_success_at: row.last_success_at,
                        recovered_at: row.recovered_at,
                    },
                )),
                _ => None,
            };
            Ok(StagedRelease {
                result: ReleaseResult {
                    released,
                    health,
                    usage: row.usage_granted_at.zip(row.usage_delta),
                    waiters: row.waiters,
                },
                refit: key_id.filter(|_| row.refit),
            })
        })
        .collect()
}

/// Renews leases (SQL function `credpool_renew`): each live lease named by all of its values gets
/// `lease_until = now + lease_seconds` (database clock) and a `renewed` trail row, in ONE
/// statement for the whole group. Each renewal names its lease, its length and the hash of the
/// key its caller presented (`None`: the configured internal key, tenant `default`). Returns, per
/// renewal in order, what it did ([`Renewed`]): the new lease_until; lost (expired, unknown,
/// released, or named with a wrong key_id/provider/pool/fence); or unauthorized (the key is not
/// live, or is another tenant's than the lease's). Never resurrects an expired lease.
#[tracing::instrument(skip_all, fields(renewals = renewals.len()), err(level = "debug"))]
pub async fn renew_group(
    executor: impl PgExecutor<'_>,
    renewals: &[(
        &LeaseRef,
        LeaseSeconds,
        Option<crate::domain::TenantKeyHash>,
    )],
) -> Result<Vec<Renewed>, sqlx::Error> {
    let body: Vec<serde_json::Value> = renewals
        .iter()
        .map(|(lease, seconds, caller)| {
            serde_json::json!({
                "lease_id": lease.lease_id.as_uuid(),
                "key_id": lease.key_id.as_str(),
                "provider": lease.provider.as_str(),
                "pool": lease.pool.as_str(),
                "fence": lease.fence,
                "lease_seconds": i32::try_from(seconds.get()).unwrap_or(i32::MAX),
                "key_hash": caller.map(|hash| hash.to_hex()),
            })
        })
        .collect();
    let rows = sqlx::query!(
        r#"SELECT renewal AS "renewal!", lease_until, authorized AS "authorized!"
           FROM credpool_renew($1) ORDER BY renewal"#,
        serde_json::Value::Array(body),
    )
    .fetch_all(executor)
    .await?;
    if rows.len() != renewals.len() {
        return Err(sqlx::Error::Protocol(format!(
            "credpool_renew returned {} rows for {} renewals",
            rows.len(),
            renewals.len()
        )));
    }
    Ok(rows
        .into_iter()
        .map(|r| match (r.authorized, r.lease_until) {
            (false, _) => Renewed::Unauthorized,
            (true, Some(at)) => Renewed::Until(at),
            (true, None) => Renewed::Lost,
        })
        .collect())
}

/// What a renewal did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewed {
    /// Renewed: the new lease_until (database clock).
    Until(OffsetDateTime),
    /// The lease is lost (expired, unknown, released, or named with a wrong
    /// key_id/provider/pool/fence).
    Lost,
    /// The key presented names no live key, or a key of another tenant than the lease's:
    /// nothing was renewed (401).
    Unauthorized,
}

/// [`renew_group`] for one lease, renewed with the configured internal key (tenant `default`):
/// the new lease_until, or `None` when the lease is lost or held by another tenant.
pub async fn renew(
    executor: impl PgExecutor<'_>,
    lease: &LeaseRef,
    lease_seconds: LeaseSeconds,
) -> Result<Option<OffsetDateTime>, sqlx::Error> {
    let renewed = renew_group(executor, &[(lease, lease_seconds, None)]).await?;
    Ok(match renewed.first() {
        Some(Renewed::Until(at)) => Some(*at),
        _ => None,
    })
}
