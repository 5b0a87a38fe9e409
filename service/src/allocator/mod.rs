//! The allocator: grants leases, and tells a refused executor why (the executor API's status
//! table, docs/design.md "Error semantics (executor API)").
//!
//! An allocation walks the pool sequence (`vip` falls back to `default`); for each pool it ranks
//! the candidates of this process's view of the pool and runs the one-statement claim of
//! `sql/claim.sql` over the best few, until a grant or an answer. The parts:
//! - [`ranking`]: judging a pool from its view (404/409/429 or the candidates to claim) and the
//!   ranking itself, pure;
//! - [`attempt`]: one request's attempt at one pool as a small state machine (claim, read the
//!   pool again, answer), pure;
//! - [`scoring`]: the score of a candidate, pure (clock and randomness passed in); the outcome ->
//!   health state machine and the rate windows' arithmetic it uses are the domain's
//!   ([`crate::domain::health`], [`crate::domain::windows`]);
//! - [`candidates`]: each process's per-pool candidate views;
//! - [`groups`]: claims, releases and renewals of concurrent requests sharing one transaction;
//! - [`waiting`]: allocations that wait for a slot, woken when one frees.
//!
//! This file holds the [`Allocator`], the loop that runs those steps against the store.

mod attempt;
pub(crate) mod candidates;
pub(crate) mod groups;
mod ranking;
pub mod scoring;
pub(crate) mod waiting;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::SmallRng;
use time::OffsetDateTime;

use crate::domain::health::HealthPolicy;
use crate::domain::{
    AffinityKey, AffinityMode, AffinityResult, AffinityTtl, Holder, KeyId, LeaseId, LeaseSeconds,
    ModelName, PoolName, ProviderName, RequestId, Secret, TenantKeyHash,
};
use crate::secrets::{Keyring, SecretsError};
use crate::store::leases::{
    self, Claim, ClaimAffinity, ClaimAnswer, ClaimOutcome, LeaseRef, ReleaseRequest, ReleaseResult,
    RequestKey,
};
use candidates::CandidateViews;
use credpool_protocol::ErrorCode;
use groups::Groups;
use waiting::{Hint, Registration, WaitingRequest, Waits};

use attempt::{PoolAttempt, Step};
use ranking::{PoolVerdict, judge, retry_after_seconds};

/// The pure rules the allocator applies, kept at the bottom floor (`crate::domain`) so that the
/// store can use them too; named here as well for callers that know them as the allocator's.
pub use crate::domain::{HeldBy, health, windows};
pub use candidates::PoolView;
pub use groups::GroupSettings;
pub use ranking::rank;

/// An executor's request for a lease.
#[derive(Debug, Clone)]
pub struct AllocateRequest {
    /// The provider wanted.
    pub provider: ProviderName,
    /// The model wanted (a provider model name or an alias).
    pub model: ModelName,
    /// The pool asked for; the pool sequence may serve it from another (`vip` -> `default`).
    pub pool: PoolName,
    /// The pool sequence tried, in order: the pool's [`PoolName::sequence`], less the pools the
    /// caller's tenant may not lease from (`vip` -> `default` only where both are in its scope).
    /// The pool asked for comes first and is always in it (the HTTP layer refuses one outside the
    /// scope before any candidate is read).
    pub pools: Vec<PoolName>,
    /// How long the lease lasts unless renewed.
    pub lease_seconds: LeaseSeconds,
    /// The executor's name for itself.
    pub holder: Option<Holder>,
    /// The client's idempotency key: a retry with the same key and parameters gets the same
    /// lease while it lives, instead of a second slot.
    pub request_id: Option<RequestId>,
    /// How long the request may wait for a slot when every candidate is busy (zero: answer at
    /// once). The HTTP layer caps it (`--max-wait-ms`).
    pub wait: Duration,
    /// The tokens the call expects to use (0..=10^9): reserved in the credential's token windows
    /// at the grant, until the release reports its usage.
    pub tokens: u64,
    /// The hash of the tenant key the executor presented (`None`: the configured internal key,
    /// tenant `default`). The claim checks it in the store and takes the tenant from it.
    pub caller: Option<TenantKeyHash>,
    /// The conversation the call belongs to, if the executor named one: the credential bound to
    /// it is tried first (docs/design.md "Affinity").
    pub affinity: Option<Affinity>,
}

/// An allocation's conversation affinity, as the executor asked for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Affinity {
    /// The conversation's key.
    pub key: AffinityKey,
    /// How long the binding lives after this grant (refreshed on each hit).
    pub ttl: AffinityTtl,
    /// Preferred (the default) or strict.
    pub mode: AffinityMode,
}

/// A granted lease, as the executor receives it.
#[derive(Debug, Clone)]
pub struct Allocation {
    /// The credential leased.
    pub key_id: KeyId,
    /// The lease, to renew and release with.
    pub lease_id: LeaseId,
    /// The provider.
    pub provider: ProviderName,
    /// The pool that served (differs from the pool asked for after a `vip` -> `default` fallback).
    pub pool: PoolName,
    /// The model name as the credential serves it (after alias mapping).
    pub provider_model: String,
    /// When the lease stops counting unless renewed (database clock).
    pub lease_until: OffsetDateTime,
    /// Whether this is the single probe lease of a credential back from a cooldown.
    pub probe: bool,
    /// The fencing token: strictly increasing per credential with each grant, never reused.
    pub fence: i64,
    /// The tenant holding the lease (the caller's).
    pub tenant: String,
    /// For a request with an `affinity_key`: whether its conversation's bound credential served
    /// it. `None` without one, and for a replay of an earlier attempt (`request_id`).
    pub affinity: Option<AffinityResult>,
    /// The credential material (redacted in `Debug`).
    pub credential: Secret,
}

/// Why an allocation granted nothing. Each variant names the HTTP status it answers with (the
/// executor API's table: docs/design.md "Error semantics (executor API)").
#[derive(Debug, thiserror::Error)]
pub enum AllocateError {
    /// 404: the provider/pool (and every pool of its sequence) has no credentials at all.
    #[error("no credentials for this provider and pool")]
    PoolNotFound,
    /// 409: the pool has credentials but none serves the model.
    #[error("no credential in this pool serves the model")]
    ModelNotSupported,
    /// 409: credentials serve the model but every one waits for an operator (disabled, pending,
    /// exhausted without a retry_after, or cooling down with no known end).
    #[error("every credential that serves the model waits for an operator")]
    NoUsableCredentials,
    /// 429: candidates exist but none is free now; one may free in `retry_after_seconds`
    /// (whole seconds, at least 1: the earliest lease end or cooldown end among the candidates).
    #[error("every candidate credential is busy or cooling down")]
    PoolExhausted {
        /// Seconds until the earliest lease or cooldown among the candidates ends (>= 1).
        retry_after_seconds: u64,
        /// What holds back the candidate that frees first (a slot, a cooldown, a window, an OAuth
        /// token waiting for its refresh, fair share).
        held_by: HeldBy,
    },
    /// 500: the credential's secret cannot be opened with the configured master keys (its lease
    /// was given back at once).
    #[error("the secret of credential {key_id} cannot be opened: {error}")]
    SecretUnreadable {
        /// The credential.
        key_id: KeyId,
        /// Why (never the material).
        error: SecretsError,
    },
    /// 409: the request's `request_id` holds a live lease granted for other parameters.
    #[error("this request_id holds a lease granted for other parameters")]
    RequestIdConflict,
    /// 409: credentials serve the model, but every one has a token window smaller than the
    /// request's `tokens` estimate, or the caller's tenant has one: no wait can make room for it.
    #[error("the token estimate is larger than a token window every candidate is held to")]
    TokensExceedBudget,
    /// 429: the caller's tenant holds as many live leases as its `max_concurrent_leases`
    /// allows (decided in the claim on the tenant's slot rows), or a window of its
    /// `rate_limits` has no room for the request (`window`; decided on its tenant_windows row);
    /// that frees in `retry_after_seconds` (whole seconds, at least 1).
    #[error("the tenant is at its cap or out of window room")]
    TenantLimit {
        /// The tenant.
        tenant: String,
        /// Whether a window holds it back (else its cap).
        window: bool,
        /// Seconds until the tenant may be served again: the earliest end of its leases, or when
        /// its windows have room (>= 1).
        retry_after_seconds: u64,
    },
    /// 401: the tenant key presented is unknown or revoked (checked by the claim).
    #[error("unknown or revoked executor key")]
    Unauthorized,
    /// 403: the caller's tenant may no longer lease from this provider and pool: its `pools`
    /// changed while the request was served (checked by the claim; a request that arrives after
    /// the change is refused before anything is read).
    #[error("the tenant may not lease from {provider}/{pool}")]
    PoolNotAllowed {
        /// The provider asked for.
        provider: ProviderName,
        /// The pool whose claim was refused.
        pool: PoolName,
    },
    /// 503: PostgreSQL failed or could not be reached in time.
    #[error("store unavailable")]
    Store(#[from] sqlx::Error),
}

impl AllocateError {
    /// The API's error code for this error (the `result` label of the allocation metrics).
    pub fn code(&self) -> ErrorCode {
        match self {
            AllocateError::PoolNotFound => ErrorCode::PoolNotFound,
            AllocateError::ModelNotSupported => ErrorCode::ModelNotSupported,
            AllocateError::NoUsableCredentials => ErrorCode::NoUsableCredentials,
            AllocateError::PoolExhausted { .. } => ErrorCode::PoolExhausted,
            AllocateError::TenantLimit { .. } => ErrorCode::TenantLimit,
            AllocateError::Unauthorized => ErrorCode::Unauthorized,
            AllocateError::PoolNotAllowed { .. } => ErrorCode::PoolNotAllowed,
            AllocateError::RequestIdConflict => ErrorCode::RequestIdConflict,
            AllocateError::TokensExceedBudget => ErrorCode::TokensExceedBudget,
            AllocateError::SecretUnreadable { .. } => ErrorCode::InternalError,
            AllocateError::Store(_) => ErrorCode::StoreUnavailable,
        }
    }

    /// The `result` label of the allocation metrics for this error: its code's spelling.
    pub fn result(&self) -> &'static str {
        self.code().as_str()
    }
}

/// An allocation that granted nothing, and when something among its candidates ends (for a
/// waiting request's timer).
#[derive(Debug)]
struct Refusal {
    error: AllocateError,
    frees_in: Option<Duration>,
    /// The tenant a waiting request's claims were made for (`None` when no claim ran, or the
    /// request does not wait).
    tenant: Option<String>,
    /// The pool where a waiting request's claim yielded, and the tenant it yielded to
    /// (docs/design.md "Fair share").
    yielded_to: Option<(PoolName, String)>,
}

impl From<AllocateError> for Refusal {
    fn from(error: AllocateError) -> Self {
        Self {
            error,
            frees_in: None,
            tenant: None,
            yielded_to: None,
        }
    }
}

/// What one pass over the pool sequence learned from its claims besides their answers.
#[derive(Debug, Default)]
struct Pass {
    /// Whether a claim statement ran: with a request_id it has looked for the request's lease.
    claimed: bool,
    /// The tenant a waiting request's claims were made for.
    tenant: Option<String>,
    /// The pool where a claim yielded, and the tenant it yielded to.
    yielded_to: Option<(PoolName, String)>,
}

/// What a request's claims carry besides their candidates: its idempotency key and its
/// conversation affinity, each if it named one.
#[derive(Debug, Clone, Copy)]
struct Keys<'a> {
    request: Option<&'a RequestKey>,
    affinity: Option<&'a ClaimAffinity>,
    /// A request that may wait, as its claims record it (they yield to tenants further below
    /// their share); `None` for one that answers at once.
    waiting: Option<&'a WaitingRequest>,
}

impl Keys<'_> {
    /// The claim of `request` over `ranked` (best first) in `pool`, carrying these keys; a new
    /// lease id. `windowed`: whether a candidate has rate windows, as the view says.
    fn claim(
        &self,
        request: &AllocateRequest,
        pool: &PoolName,
        ranked: Vec<KeyId>,
        windowed: bool,
    ) -> Claim {
        Claim {
            ranked,
            provider: request.provider.clone(),
            pool: pool.clone(),
            model: request.model.clone(),
            lease_id: LeaseId::generate(),
            holder: request.holder.clone(),
            lease_seconds: request.lease_seconds,
            request: self.request.cloned(),
            tokens: request.tokens,
            caller: request.caller,
            affinity: self.affinity.cloned(),
            waiting: self.waiting.map(WaitingRequest::claim),
            windowed: Some(windowed),
        }
    }
}

/// How long a claim waits before it tries again when another attempt of its request is in flight.
const IN_FLIGHT_PAUSE: Duration = Duration::from_millis(5);

/// How long a request keeps claiming again while a candidate that may serve at once is held by
/// another transaction (a claim group committing, a window row, the reaper's short transaction, an
/// operator's change): that transaction takes milliseconds alone and tens of milliseconds under
/// load, so a bound in attempts would answer 429 while a slot or a window still had room; the
/// request timeout bounds it too.
const BUSY_PATIENCE: Duration = Duration::from_secs(1);

/// The longest a waiting request at its tenant's cap sleeps before it claims again (a release of
/// one of the tenant's leases is announced to the waiters of that lease's pool only).
const TENANT_RECHECK: Duration = Duration::from_millis(250);

/// How long the first waiting request waits for the listening connection to come up.
const LISTEN_CONNECT_WAIT: Duration = Duration::from_secs(1);

/// The shortest sleep of a waiting request between two attempts when its timer is all it has:
/// a bound on its claims per second (10) when the view keeps saying something has just ended.
const MIN_WAIT_STEP: Duration = Duration::from_millis(100);

/// How many candidates a claim statement gets, and how hard one request tries a pool.
///
/// A request keeps claiming while its view shows an untried candidate with a free slot (each
/// miss marks the tried candidates full and doubles the batch, so even heavy contention ends in
/// O(log pool) statements); when the view shows none, it still makes `attempts` claims on the
/// best candidates it believes full, in case the view is stale, before answering 429.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimSettings {
    /// Candidates in the first claim statement (the top of the ranking).
    pub batch: usize,
    /// Claims made on candidates the view believes full.
    pub attempts: usize,
    /// Free candidates one ranking considers: a pool with more is ranked over a window of this
    /// many, starting at a random place, so allocation cost does not grow with the pool.
    pub rank_window: usize,
}

impl Default for ClaimSettings {
    /// 8 candidates in the first claim; 1 claim on candidates believed full; a window of 256.
    fn default() -> Self {
        Self {
            batch: 8,
            attempts: 1,
            rank_window: 256,
        }
    }
}

/// Grants leases. Cheap to clone. Built by the service's start-up from its parts.
#[derive(Debug, Clone)]
pub struct Allocator {
    /// Claims, releases and renewals go through these groups.
    pub(crate) groups: Groups,
    /// The candidate views it ranks from.
    pub(crate) views: Arc<CandidateViews>,
    /// Where waiting requests are parked.
    pub(crate) waits: Arc<Waits>,
    /// How many candidates a claim tries.
    pub(crate) claims: ClaimSettings,
    /// Opens the secrets of granted credentials.
    pub(crate) keyring: Arc<Keyring>,
    /// How outcome reports move health.
    pub(crate) health: HealthPolicy,
}

impl Allocator {
    /// Releases a lease with its outcome (through the next release group, which announces a
    /// freed slot to the waiting allocations of every process), then tells this process's
    /// candidate view what the release freed and how the credential's health moved.
    pub async fn release(&self, request: ReleaseRequest) -> Result<ReleaseResult, sqlx::Error> {
        let result = self
            .groups
            .release(request.clone(), &self.health, &self.waits)
            .await?;
        let lease = &request.lease;
        self.views.note_release(
            &lease.provider,
            &lease.pool,
            &lease.key_id,
            result.released,
            result.health.clone().map(|(_, health)| health),
            result.usage,
        );
        Ok(result)
    }

    /// Ends every wait of this process's allocations (the end of a shutdown drain): each waiting
    /// allocation answers at once, as it would at the end of its `wait_ms`, and later ones do not
    /// wait.
    pub fn stop_waiting(&self) {
        self.waits.stop_waiting();
    }

    /// Whether `provider`/`pool` has credentials, as this process last read the pool (never reads
    /// the database): a refused request names a pool in metric labels only when it does, so that
    /// no request can add series.
    pub fn knows_pool(&self, provider: &ProviderName, pool: &PoolName) -> bool {
        self.views.has_credentials(provider, pool)
    }

    /// Renews a lease (through the next renewal group) for the caller presenting key `caller`
    /// (`None`: the internal key, tenant `default`): [`Renewed`](crate::store::leases::Renewed),
    /// the new lease_until, lost, or unauthorized (the key is not live, or is another tenant's
    /// than the lease's).
    pub async fn renew(
        &self,
        lease: LeaseRef,
        lease_seconds: LeaseSeconds,
        caller: Option<crate::domain::TenantKeyHash>,
    ) -> Result<crate::store::leases::Renewed, sqlx::Error> {
        self.groups.renew(lease, lease_seconds, caller).await
    }

    /// One claim through the claim groups. A claim that met another attempt of the same request in
    /// flight (`in_flight`: a client's retry overtook its first attempt) is made again after a
    /// pause, until that attempt has committed and can be answered; the request timeout bounds it.
    ///
    /// A claim that passed over a candidate another transaction held or changed at that moment
    /// (`busy`: a concurrent claim, a window row, the reaper, an operator's change) is made again
    /// too, for up to a second: that transaction commits within milliseconds and may or may not
    /// leave room.
    ///
    /// The answer's outcome is never [`ClaimOutcome::Busy`] (settled once patience runs out) nor
    /// [`ClaimOutcome::InFlight`].
    async fn claim(&self, claim: &Arc<Claim>) -> Result<ClaimAnswer, AllocateError> {
        let started = Instant::now();
        loop {
            let answer = self.groups.claim(Arc::clone(claim)).await?;
            match answer.outcome {
                ClaimOutcome::InFlight => {}
                ClaimOutcome::Busy { .. } if started.elapsed() < BUSY_PATIENCE => {}
                outcome => {
                    return Ok(ClaimAnswer {
                        outcome: outcome.settled(),
                        ..answer
                    });
                }
            }
            tokio::time::sleep(IN_FLIGHT_PAUSE).await;
        }
    }

    /// Tries each pool of the request's pool sequence in turn: ranks its candidate view and runs
    /// the one-statement claim over the best few, trying further candidates (up to the configured
    /// attempts) before giving up on the pool. The first grant wins. When nothing is granted,
    /// answers with the most actionable failure of the sequence; a 404 or 409 is only given after
    /// re-reading the pool from the database, so a stale view never causes one.
    ///
    /// Every failure leaves the database unchanged (the claim writes only when it grants).
    ///
    /// With a `request_id`, a lease the same request already holds is answered again (same
    /// lease_id, no second slot; `RequestIdConflict` when it was granted for other parameters).
    /// With a `wait`, a request that finds every candidate busy waits up to that long for a slot
    /// ([`waiting`]) and claims again whenever one may have freed; when the wait is over it
    /// answers as an immediate request would at that moment. Its claims yield to a waiting
    /// tenant further below its weighted share of the pool (docs/design.md "Fair share"); a
    /// request without a wait never yields.
    pub async fn allocate(&self, request: &AllocateRequest) -> Result<Allocation, AllocateError> {
        let request_key = request.request_id.clone().map(|id| {
            RequestKey::new(
                id,
                &request.provider,
                &request.pool,
                &request.model,
                request.lease_seconds,
                request.holder.as_ref(),
                request.tokens,
            )
        });
        // the binding is the pool asked for's; a strict one confines claims only while its
        // credential is in this sequence
        let affinity = request.affinity.as_ref().map(|a| ClaimAffinity {
            key: a.key.clone(),
            pools: request.pools.clone(),
            ttl: a.ttl,
            mode: a.mode,
        });
        let waiting = (!request.wait.is_zero()).then(|| {
            self.waits.waiting_request(
                request.provider.clone(),
                request.pools.clone(),
                request.wait,
            )
        });
        let key = Keys {
            request: request_key.as_ref(),
            affinity: affinity.as_ref(),
            waiting: waiting.as_ref(),
        };
        let started = Instant::now();
        let deadline = started + request.wait;
        // queued after the first pass that found nothing free (a request without a wait never is)
        let mut registration: Option<Registration> = None;
        let mut hint = None;
        loop {
            let result = self.allocate_once(request, key, &mut hint).await;
            // a wake-up that this pass did not reach (served from an earlier pool of the
            // sequence): the freed slot is the next waiter's; one it yielded (a slot that may be
            // free now): the waiter's of the tenant it yielded to
            let mut unused = hint.take();
            if let Err(Refusal {
                yielded_to: Some((pool, ahead)),
                ..
            }) = &result
            {
                let freed = unused.take_if(|(freed_pool, _)| freed_pool == pool);
                self.waits.yield_to(
                    &request.provider,
                    pool,
                    ahead,
                    freed.as_ref().map(|(_, key_id)| key_id),
                );
            }
            let frees_in = match &result {
                Err(Refusal {
                    error: AllocateError::PoolExhausted { .. },
                    frees_in,
                    ..
                }) if Instant::now() < deadline => *frees_in,
                // a release of the tenant's lease in another pool wakes nobody here: look again
                // at least every TENANT_RECHECK
                Err(Refusal {
                    error: AllocateError::TenantLimit { .. },
                    frees_in,
                    ..
                }) if Instant::now() < deadline => {
                    Some(frees_in.map_or(TENANT_RECHECK, |d| d.min(TENANT_RECHECK)))
                }
                _ => {
                    if registration.take().is_some() {
                        let label = match &result {
                            Ok(_) => "leased",
                            Err(refusal) => refusal.error.result(),
                        };
                        crate::telemetry::waited(label, started.elapsed());
                    }
                    if let Some(unused) = unused {
                        Registration::pass_on(&self.waits, &request.provider, unused);
                    }
                    return result.map_err(|refusal| refusal.error);
                }
            };
            if let Some(unused) = unused {
                Registration::pass_on(&self.waits, &request.provider, unused);
            }
            let Some(registration) = &registration else {
                // queue up, then look again at once: a slot freed between the first look and
                // the queueing would otherwise wake nobody
                registration = Some(
                    self.waits
                        .register(
                            &request.provider,
                            &request.pools,
                            &request.model,
                            result.err().and_then(|refusal| refusal.tenant),
                            LISTEN_CONNECT_WAIT.min(request.wait),
                        )
                        .await,
                );
                continue;
            };
            let mut wake_at = frees_in
                .map_or(deadline, |d| Instant::now() + d.max(MIN_WAIT_STEP))
                .min(deadline);
            if registration.first_in_line() {
                // the floor under a freed slot whose announcement never came
                wake_at = wake_at.min(Instant::now() + waiting::RECHECK_EVERY);
            }
            hint = tokio::select! {
                hint = registration.woken() => hint,
                () = tokio::time::sleep_until(wake_at.into()) => registration.take_hint(),
                // the service's shutdown drain is over: answer this 429 now, not a reset connection
                () = self.waits.waiting_stopped() => {
                    crate::telemetry::waited(ErrorCode::PoolExhausted.as_str(), started.elapsed());
                    return result.map_err(|refusal| refusal.error);
                }
            };
        }
    }

    /// One pass over the pool sequence (see [`Allocator::allocate`]); `hint` is a credential
    /// whose slot was just freed, claimed first in its pool (taken out of `hint` when its pool is
    /// reached; still there when the pass ended before).
    async fn allocate_once(
        &self,
        request: &AllocateRequest,
        keys: Keys<'_>,
        hint: &mut Option<Hint>,
    ) -> Result<Allocation, Refusal> {
        let mut failure: Option<PoolVerdict> = None;
        let mut soonest: Option<(OffsetDateTime, OffsetDateTime)> = None;
        let mut held: Option<HeldBy> = None;
        let mut pass = Pass::default();

        for pool in request.pools.iter().cloned() {
            let hint_here = hint.take_if(|(hinted, _)| *hinted == pool).map(|(_, k)| k);
            let verdict = self
                .allocate_in(request, &pool, keys, hint_here.clone(), &mut pass)
                .await?;
            // a freed slot's wake-up this pool yielded is not used: handed on by the caller
            if pass.yielded_to.as_ref().is_some_and(|(p, _)| *p == pool) {
                *hint = hint_here.map(|key_id| (pool.clone(), key_id));
            }
            let verdict = match verdict {
                Ok(allocation) => return Ok(allocation),
                Err(verdict) => verdict,
            };
            if let PoolVerdict::Try {
                frees_at: Some((at, now)),
                held_by,
                ..
            } = &verdict
                && soonest.is_none_or(|(s, _)| *at < s)
            {
                soonest = Some((*at, *now));
                held = *held_by;
            }
            if failure
                .as_ref()
                .is_none_or(|f| verdict.precedence() > f.precedence())
            {
                failure = Some(verdict);
            }
        }

        if let Some(key) = keys.request
            && !pass.claimed
        {
            // every pool was judged from its view alone: the request may still hold a lease from
            // an earlier attempt (taking the last slot, or on a credential since disabled)
            if let Some(allocation) = self.replay(request, key).await? {
                return Ok(allocation);
            }
        }
        let error = match failure {
            Some(PoolVerdict::Try { .. }) => {
                let held_by = held.unwrap_or(if pass.yielded_to.is_some() {
                    HeldBy::FairShare
                } else {
                    HeldBy::Slots
                });
                crate::telemetry::held_back(&request.provider, &request.pool, held_by);
                AllocateError::PoolExhausted {
                    retry_after_seconds: retry_after_seconds(soonest),
                    held_by,
                }
            }
            Some(PoolVerdict::NoUsableCredentials) => AllocateError::NoUsableCredentials,
            Some(PoolVerdict::TokensExceedBudget) => AllocateError::TokensExceedBudget,
            Some(PoolVerdict::ModelNotSupported) => AllocateError::ModelNotSupported,
            Some(PoolVerdict::NotFound) | None => AllocateError::PoolNotFound,
        };
        Err(Refusal {
            error,
            // an end already passed (the view is behind): look again soon
            frees_in: soonest.map(|(at, now)| Duration::try_from(at - now).unwrap_or_default()),
            tenant: pass.tenant,
            yielded_to: pass.yielded_to,
        })
    }

    /// The lease `key`'s request already holds, if any: a claim statement over no candidate,
    /// which only looks the request up.
    async fn replay(
        &self,
        request: &AllocateRequest,
        key: &RequestKey,
    ) -> Result<Option<Allocation>, AllocateError> {
        let keys = Keys {
            request: Some(key),
            affinity: None,
            waiting: None,
        };
        let claim = Arc::new(keys.claim(request, &request.pool, Vec::new(), false));
        match self.claim(&claim).await?.outcome {
            ClaimOutcome::Unauthorized => Err(AllocateError::Unauthorized),
            ClaimOutcome::PoolNotAllowed => Err(AllocateError::PoolNotAllowed {
                provider: request.provider.clone(),
                pool: request.pool.clone(),
            }),
            ClaimOutcome::Conflict => Err(AllocateError::RequestIdConflict),
            ClaimOutcome::Granted(granted) | ClaimOutcome::Replayed(granted) => {
                Ok(Some(self.hand_out(request, granted).await?))
            }
            _ => Ok(None),
        }
    }

    /// Opens a granted lease's secret and makes it an [`Allocation`]. A secret that cannot be
    /// opened gives the slot back at once rather than strand it until lease_until (released with
    /// the request's own key: a lease is released only by a key of its tenant).
    async fn hand_out(
        &self,
        request: &AllocateRequest,
        granted: leases::GrantedLease,
    ) -> Result<Allocation, AllocateError> {
        let provider = &request.provider;
        let credential = match self.keyring.open(&granted.key_id, &granted.sealed_secret) {
            Ok(credential) => credential,
            Err(error) => {
                let release = ReleaseRequest {
                    lease: LeaseRef {
                        key_id: granted.key_id.clone(),
                        provider: provider.clone(),
                        pool: granted.pool.clone(),
                        lease_id: granted.lease_id,
                        fence: Some(granted.fence),
                    },
                    outcome: None,
                    retry_after_seconds: None,
                    usage_tokens: None,
                    caller: request.caller,
                    // no outcome: nothing to reach
                    may_disable: true,
                };
                self.groups
                    .release(release, &HealthPolicy::default(), &self.waits)
                    .await?;
                return Err(AllocateError::SecretUnreadable {
                    key_id: granted.key_id,
                    error,
                });
            }
        };
        Ok(Allocation {
            key_id: granted.key_id,
            lease_id: granted.lease_id,
            provider: provider.clone(),
            pool: granted.pool,
            provider_model: granted.provider_model,
            lease_until: granted.lease_until,
            probe: granted.probe,
            fence: granted.fence,
            tenant: granted.tenant,
            affinity: granted.affinity,
            credential,
        })
    }

    /// One pool of the sequence: a lease, or the verdict to report if no pool serves. Each round
    /// takes one [`Snapshot`] of the pool's view and runs whatever read or claim the
    /// [`PoolAttempt`]'s next step asks for; nothing goes back to the view mid-round.
    async fn allocate_in(
        &self,
        request: &AllocateRequest,
        pool: &PoolName,
        keys: Keys<'_>,
        hint: Option<KeyId>,
        pass: &mut Pass,
    ) -> Result<Result<Allocation, PoolVerdict>, AllocateError> {
        let provider = &request.provider;
        // (a freed credential that woke this request is claimed first: part of every batch)
        let hinted = hint.clone();
        let mut attempt = PoolAttempt::new(&self.claims, hint);
        loop {
            let (view, loaded) = self
                .views
                .with_view(provider, pool, |view| {
                    Snapshot::take(
                        view,
                        request,
                        &attempt,
                        hinted.as_ref(),
                        &self.claims,
                        self.views.scoring(),
                    )
                })
                .await?;
            let age = view.counted.elapsed();
            let (batch, free_seen) = match attempt.decide(view.verdict, loaded, age, &self.claims) {
                Step::Reload => {
                    self.views.reload(provider, pool, None).await?;
                    attempt.reloaded();
                    continue;
                }
                Step::CatchUp => {
                    self.views
                        .reload_unless_newer(provider, pool, view.counted)
                        .await?;
                    attempt.reloaded();
                    continue;
                }
                Step::Answer(mut verdict) => {
                    attempt.date_database_frees(&mut verdict, view.now);
                    return Ok(Err(verdict));
                }
                Step::Claim { batch, free_seen } => (batch, free_seen),
            };
            let claim = Arc::new(keys.claim(request, pool, batch, view.windowed));
            let answer = self.claim(&claim).await?;
            pass.claimed = true;
            if let Some(waiting) = keys.waiting {
                // (only a waiting request registers a waiter under its tenant)
                if answer.tenant.is_some() {
                    pass.tenant.clone_from(&answer.tenant);
                }
                waiting.claimed(matches!(
                    answer.outcome,
                    ClaimOutcome::TenantLimit { .. }
                        | ClaimOutcome::Yield { .. }
                        | ClaimOutcome::Bound(_)
                        | ClaimOutcome::Nothing(_)
                ));
            }
            let stale = answer.pool_version != view.version;
            let replayed = matches!(answer.outcome, ClaimOutcome::Replayed(_));
            // the batch claimed, read back from the claim (shared with the claim group, not copied)
            let batch = &claim.ranked;
            match answer.outcome {
                ClaimOutcome::Yield { to } => {
                    // a tenant further below its share waits for this pool: nothing was looked
                    // at, and the rest of the pool is that tenant's first
                    pass.yielded_to = Some((pool.clone(), to));
                    return Ok(Err(PoolVerdict::Try {
                        batch: Vec::new(),
                        free_seen: false,
                        frees_at: None,
                        held_by: Some(HeldBy::FairShare),
                    }));
                }
                ClaimOutcome::Unauthorized => return Err(AllocateError::Unauthorized),
                ClaimOutcome::PoolNotAllowed => {
                    return Err(AllocateError::PoolNotAllowed {
                        provider: request.provider.clone(),
                        pool: pool.clone(),
                    });
                }
                ClaimOutcome::Conflict => return Err(AllocateError::RequestIdConflict),
                // the tenant's own cap or windows, whatever the pool has free: no other pool or
                // candidate can serve it; a window that never frees is smaller than the estimate
                ClaimOutcome::TenantLimit {
                    window: true,
                    frees_at: None,
                } => return Err(AllocateError::TokensExceedBudget),
                ClaimOutcome::TenantLimit { window, frees_at } => {
                    return Err(AllocateError::TenantLimit {
                        tenant: answer.tenant.unwrap_or_default(),
                        window,
                        retry_after_seconds: retry_after_seconds(frees_at.zip(answer.db_now)),
                    });
                }
                ClaimOutcome::Granted(granted) | ClaimOutcome::Replayed(granted) => {
                    let reload = stale.then_some(answer.pool_version);
                    return self
                        .granted(request, pool, granted, replayed, reload)
                        .await
                        .map(Ok);
                }
                ClaimOutcome::Bound(missed) => {
                    // a strict binding confined the claim to its credential (in this pool, or in
                    // another of the sequence): the rest of the batch was not looked at, and
                    // claiming it again would not be either. The database's word on when the
                    // bound one frees is the answer (and a waiting request's timer), dated on
                    // the claim's own clock.
                    attempt.missed(batch, missed.frees_at, missed.held_by);
                    let mut verdict = PoolVerdict::Try {
                        batch: Vec::new(),
                        free_seen: false,
                        frees_at: None,
                        held_by: None,
                    };
                    attempt.date_database_frees(&mut verdict, answer.db_now.unwrap_or(view.now));
                    return Ok(Err(verdict));
                }
                ClaimOutcome::Nothing(missed) | ClaimOutcome::Busy { missed, .. } => {
                    attempt.missed(batch, missed.frees_at, missed.held_by);
                }
                ClaimOutcome::InFlight => {
                    unreachable!("Allocator::claim claims again while an attempt is in flight")
                }
            };
            tracing::debug!(
                candidates = batch.len(),
                stale,
                free_seen,
                "claim found no free slot"
            );
            self.views.note_full(provider, pool, batch);
            if stale {
                self.views
                    .reload(provider, pool, answer.pool_version)
                    .await?;
                attempt.changes_read();
            }
        }
    }

    /// A lease the claim granted (`replayed`: to an earlier attempt of the request) in `pool`:
    /// logged, counted in the view (unless replayed: it was counted when granted), and handed
    /// out. `reload`: the view was behind the pool's version (`Some(version)`), so it is read
    /// again in the background.
    async fn granted(
        &self,
        request: &AllocateRequest,
        pool: &PoolName,
        granted: leases::GrantedLease,
        replayed: bool,
        reload: Option<Option<i64>>,
    ) -> Result<Allocation, AllocateError> {
        let provider = &request.provider;
        tracing::info!(
            key_id = %granted.key_id,
            lease_id = %granted.lease_id,
            served_pool = %granted.pool,
            probe = granted.probe,
            fence = granted.fence,
            replayed,
            pruned_expired = granted.pruned_expired,
            "lease granted"
        );
        if !replayed {
            self.views
                .note_grant(provider, pool, &granted, request.tokens);
        }
        crate::telemetry::expired("claim", u64::from(granted.pruned_expired));
        if let Some(version) = reload {
            let (views, provider, pool) = (self.views.clone(), provider.clone(), pool.clone());
            tokio::spawn(async move {
                if let Err(error) = views.reload(&provider, &pool, version).await {
                    tracing::warn!(error = %error, "candidate view reload failed");
                }
            });
        }
        self.hand_out(request, granted).await
    }
}

/// What one round of a pool attempt takes from the pool's view, in one visit: the verdict on the
/// pool, when the view's occupancy was read whole, its estimate of the database clock, its
/// version, and whether the batch to claim has rate windows.
struct Snapshot {
    verdict: PoolVerdict,
    /// [`PoolView::counted_at`].
    counted: Instant,
    now: OffsetDateTime,
    version: Option<i64>,
    /// Whether the claim must take the shape that locks window rows (the slots' `windowed` gate
    /// covers a view that is behind).
    windowed: bool,
}

impl Snapshot {
    fn take(
        view: &PoolView,
        request: &AllocateRequest,
        attempt: &PoolAttempt,
        hinted: Option<&KeyId>,
        claims: &ClaimSettings,
        scoring: &scoring::ScoringPolicy,
    ) -> Self {
        let verdict = judge(
            view,
            &request.model,
            request.tokens,
            &attempt.tried,
            attempt.batch_size,
            claims.rank_window,
            scoring,
            // a fast generator per ranking: jitter needs spread, not secrecy
            &mut SmallRng::from_rng(&mut rand::rng()),
        );
        let windowed = match &verdict {
            PoolVerdict::Try { batch, .. } => view.any_windowed(batch.iter().chain(hinted)),
            _ => false,
        };
        Self {
            verdict,
            counted: view.counted_at(),
            now: view.now(),
            version: view.version,
            windowed,
        }
    }
}
