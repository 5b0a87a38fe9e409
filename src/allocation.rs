//! Allocation: the pool sequence, the candidate view, the scoring and the one-statement claim,
//! and the classification of an allocation that found nothing (DESIGN.md "Error semantics").

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use time::OffsetDateTime;

use crate::candidates::{CandidateViews, PoolView, unix_seconds};
use crate::domain::{
    Holder, KeyId, LeaseId, LeaseSeconds, ModelName, PoolName, ProviderName, RequestId, Secret,
};
use crate::groups::Groups;
use crate::health::HealthPolicy;
use crate::scoring::{self, ScoringPolicy};
use crate::secrets::{Keyring, SecretsError};
use crate::store::Db;
use crate::store::leases::{self, ClaimRequest, LeaseRef, ReleaseRequest, RequestKey};
use crate::waiting::{Hint, Waits};

/// An executor's request for a lease.
#[derive(Debug, Clone)]
pub struct AllocateRequest {
    /// The provider wanted.
    pub provider: ProviderName,
    /// The model wanted (a provider model name or an alias).
    pub model: ModelName,
    /// The pool asked for; the pool sequence may serve it from another (`vip` -> `default`).
    pub pool: PoolName,
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
    /// The credential material (redacted in `Debug`).
    pub credential: Secret,
}

/// Why an allocation granted nothing. Each variant is one row of DESIGN.md's error table.
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
    /// 503: PostgreSQL failed or could not be reached in time.
    #[error("store unavailable")]
    Store(#[from] sqlx::Error),
}

impl AllocateError {
    /// The `result` label of the allocation metrics for this error (the API's error code).
    pub fn result(&self) -> &'static str {
        match self {
            AllocateError::PoolNotFound => "pool_not_found",
            AllocateError::ModelNotSupported => "model_not_supported",
            AllocateError::NoUsableCredentials => "no_usable_credentials",
            AllocateError::PoolExhausted { .. } => "pool_exhausted",
            AllocateError::RequestIdConflict => "request_id_conflict",
            AllocateError::SecretUnreadable { .. } => "internal_error",
            AllocateError::Store(_) => "store_unavailable",
        }
    }
}

/// An allocation that granted nothing, and when something among its candidates ends (for a
/// waiting request's timer).
#[derive(Debug)]
struct Refusal {
    error: AllocateError,
    frees_in: Option<Duration>,
}

impl From<AllocateError> for Refusal {
    fn from(error: AllocateError) -> Self {
        Self {
            error,
            frees_in: None,
        }
    }
}

/// How long the first waiting request waits for the listening connection to come up.
const LISTEN_CONNECT_WAIT: Duration = Duration::from_secs(1);

/// The shortest sleep of a waiting request between two attempts when its timer is all it has:
/// a bound on its claims per second (10) when the view keeps saying something has just ended.
const MIN_WAIT_STEP: Duration = Duration::from_millis(100);

/// What one pool of the sequence can offer, judged from its candidate view. Pure.
#[derive(Debug)]
enum PoolVerdict {
    NotFound,
    ModelNotSupported,
    NoUsableCredentials,
    /// Try the claim over `batch` (may be empty: everything is busy or cooling, or tried).
    Try {
        batch: Vec<KeyId>,
        /// Whether the view shows an untried candidate with a free slot (the batch starts with it).
        free_seen: bool,
        /// Over-limit credentials that look back under their limit: fit their slots first.
        refit: Vec<KeyId>,
        /// The earliest moment a lease or cooldown among the candidates ends, and the view's
        /// clock when judged.
        frees_at: Option<(OffsetDateTime, OffsetDateTime)>,
    },
}

impl PoolVerdict {
    /// How a failed verdict ranks when the pool sequence has several: the most actionable answer
    /// wins (busy beats unusable beats model-less beats absent).
    fn precedence(&self) -> u8 {
        match self {
            PoolVerdict::Try { .. } => 3,
            PoolVerdict::NoUsableCredentials => 2,
            PoolVerdict::ModelNotSupported => 1,
            PoolVerdict::NotFound => 0,
        }
    }

    fn conclusive_without_claim(&self) -> bool {
        !matches!(self, PoolVerdict::Try { .. })
    }
}

/// Judges a pool from its view: classification, and the best `take` candidates not in `tried`
/// among (at most) `window` free ones.
fn judge<R: rand::Rng + ?Sized>(
    view: &PoolView,
    model: &ModelName,
    tried: &HashSet<KeyId>,
    take: usize,
    window: usize,
    scoring_policy: &ScoringPolicy,
    rng: &mut R,
) -> PoolVerdict {
    if view.entries.is_empty() {
        return PoolVerdict::NotFound;
    }
    let now = view.now();
    let serving = view.serving(model.as_str());
    if serving.is_empty() {
        return PoolVerdict::ModelNotSupported;
    }
    let now_unix = unix_seconds(now);
    let mut any_usable = false;
    let mut best = scoring::TopK::new(take, scoring_policy);
    let (capacity_weight, idle_weight) =
        (scoring_policy.capacity_weight, scoring_policy.idle_weight);
    let inv_idle_cap = if scoring_policy.idle_cap_seconds > 0.0 {
        1.0 / scoring_policy.idle_cap_seconds
    } else {
        f64::INFINITY
    };
    let mut free_seen = false;
    let mut refit = Vec::new();
    // the earliest moment a lease or a cooldown among the candidates ends, Unix seconds
    let mut frees_at = f64::INFINITY;
    // Start at a random place and stop after `window` free candidates: ranking costs O(window),
    // not O(pool), and a pool with fewer free candidates than that is ranked exactly.
    // (without jitter, always from the first: the order is then fully deterministic)
    let start = if serving.is_empty() || scoring_policy.jitter_amplitude() == 0.0 {
        0
    } else {
        rng.random_range(0..serving.len())
    };
    let mut free_found = 0;
    for &index in serving[start..].iter().chain(&serving[..start]) {
        if free_found >= window {
            break;
        }
        let row = &view.rows[index];
        if !row.usable(now_unix) {
            // cooling down: usable again, on its own, at the end of its cooldown (+inf: never)
            frees_at = frees_at.min(row.usable_from);
            continue;
        }
        any_usable = true;
        frees_at = frees_at.min(row.next_lease_end);
        if row.over_limit && row.in_flight < i64::from(row.limit) {
            refit.push(view.entries[index].facts.key_id.clone());
        }
        if !tried.is_empty() && tried.contains(&view.entries[index].facts.key_id) {
            continue;
        }
        // the score of `Scored::score`, from parts precomputed for this loop
        let free_slots = row.free_slots(now_unix);
        let capacity = (free_slots as f64 * row.inv_limit).min(1.0);
        let idle = if row.last_used.is_nan() {
            1.0
        } else {
            ((now_unix - row.last_used) * inv_idle_cap).clamp(0.0, 1.0)
        };
        let score = row.health_score + capacity_weight * capacity + idle_weight * idle;
        if free_slots > 0 {
            free_seen = true;
            free_found += 1;
        }
        best.offer_scored(index, free_slots > 0, score, index, rng);
    }
    if !any_usable && frees_at.is_infinite() {
        return PoolVerdict::NoUsableCredentials;
    }
    let frees_at = frees_at
        .is_finite()
        .then(|| OffsetDateTime::from_unix_timestamp_nanos((frees_at * 1e9) as i128).ok())
        .flatten();
    let batch = best
        .into_keys()
        .into_iter()
        .map(|i| view.entries[i].facts.key_id.clone())
        .collect();
    PoolVerdict::Try {
        batch,
        free_seen,
        refit,
        frees_at: frees_at.map(|at| (at, now)),
    }
}

/// The best `take` candidates of `view` for `model`, best first, ranked over at most `window`
/// free ones (the ranking every allocation runs; public for the ranking benchmark). Empty when
/// the view has no usable candidate serving the model.
pub fn rank<R: rand::Rng + ?Sized>(
    view: &PoolView,
    model: &ModelName,
    take: usize,
    window: usize,
    scoring_policy: &ScoringPolicy,
    rng: &mut R,
) -> Vec<KeyId> {
    match judge(
        view,
        model,
        &HashSet::new(),
        take,
        window,
        scoring_policy,
        rng,
    ) {
        PoolVerdict::Try { batch, .. } => batch,
        _ => Vec::new(),
    }
}

/// Whole seconds from `now` until `at` of `soonest = (at, now)`, rounded up, at least 1 (the
/// `Retry-After` rule); 1 when nothing is known to end (a claim lost a race for a free slot).
fn retry_after_seconds(soonest: Option<(OffsetDateTime, OffsetDateTime)>) -> u64 {
    match soonest {
        Some((at, now)) => {
            let seconds = (at - now).as_seconds_f64().ceil();
            if seconds.is_finite() && seconds >= 1.0 {
                seconds as u64
            } else {
                1
            }
        }
        _ => 1,
    }
}

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

/// Largest batch a retried claim grows to.
const MAX_BATCH: usize = 1024;

/// Claim statements one request may run on one pool, whatever its view says: a bound on the work
/// a request does even while other replicas keep changing the pool under it.
const MAX_CLAIMS_PER_POOL: usize = 16;

/// Grants leases. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Allocator {
    db: Db,
    groups: Groups,
    views: Arc<CandidateViews>,
    waits: Arc<Waits>,
    claims: ClaimSettings,
    keyring: Arc<Keyring>,
}

impl Allocator {
    /// An allocator over `db`, claiming through `groups`, ranking from `views`, parking waiting
    /// requests in `waits`, opening secrets with `keyring`.
    pub fn new(
        db: Db,
        groups: Groups,
        views: Arc<CandidateViews>,
        waits: Arc<Waits>,
        claims: ClaimSettings,
        keyring: Arc<Keyring>,
    ) -> Self {
        Self {
            db,
            groups,
            views,
            waits,
            claims,
            keyring,
        }
    }

    /// The waiting requests of this process (releases announce freed slots to them).
    pub fn waits(&self) -> &Arc<Waits> {
        &self.waits
    }

    /// The group queues this allocator claims through (releases and renewals go through them
    /// too).
    pub fn groups(&self) -> &Groups {
        &self.groups
    }

    /// The candidate views this allocator ranks from.
    pub fn views(&self) -> &Arc<CandidateViews> {
        &self.views
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
    /// (src/waiting.rs) and claims again whenever one may have freed; when the wait is over it
    /// answers as an immediate request would at that moment.
    pub async fn allocate(&self, request: &AllocateRequest) -> Result<Allocation, AllocateError> {
        let key = request.request_id.clone().map(|id| {
            RequestKey::new(
                id,
                &request.provider,
                &request.pool,
                &request.model,
                request.lease_seconds,
                request.holder.as_ref(),
            )
        });
        let started = Instant::now();
        let first = self.allocate_once(request, key.as_ref(), None).await;
        let busy = matches!(
            &first,
            Err(Refusal {
                error: AllocateError::PoolExhausted { .. },
                ..
            })
        );
        if request.wait.is_zero() || !busy {
            return first.map_err(|refusal| refusal.error);
        }
        // queue up, then look again: a slot freed between the first look and the queueing would
        // otherwise wake nobody
        let deadline = started + request.wait;
        let registration = self
            .waits
            .register(
                &request.provider,
                &request.pool.sequence(),
                &request.model,
                LISTEN_CONNECT_WAIT.min(request.wait),
            )
            .await;
        let mut hint = None;
        loop {
            let result = self.allocate_once(request, key.as_ref(), hint.take()).await;
            let frees_in = match &result {
                Err(Refusal {
                    error: AllocateError::PoolExhausted { .. },
                    frees_in,
                }) if Instant::now() < deadline => *frees_in,
                _ => {
                    let label = match &result {
                        Ok(_) => "leased",
                        Err(refusal) => refusal.error.result(),
                    };
                    crate::telemetry::waited(label, started.elapsed());
                    return result.map_err(|refusal| refusal.error);
                }
            };
            let wake_at = frees_in
                .map_or(deadline, |d| Instant::now() + d.max(MIN_WAIT_STEP))
                .min(deadline);
            hint = tokio::select! {
                hint = registration.woken() => hint,
                () = tokio::time::sleep_until(wake_at.into()) => registration.take_hint(),
            };
        }
    }

    /// One pass over the pool sequence (see [`Allocator::allocate`]); `hint` is a credential
    /// whose slot was just freed, claimed first in its pool.
    async fn allocate_once(
        &self,
        request: &AllocateRequest,
        key: Option<&RequestKey>,
        mut hint: Option<Hint>,
    ) -> Result<Allocation, Refusal> {
        let mut failure: Option<PoolVerdict> = None;
        let mut soonest: Option<(OffsetDateTime, OffsetDateTime)> = None;
        // whether a claim statement ran: with a request_id it has looked for the request's lease
        let mut claimed = false;

        for pool in request.pool.sequence() {
            let hint_here = hint.take_if(|(hinted, _)| *hinted == pool).map(|(_, k)| k);
            let verdict = self
                .allocate_in(request, &pool, key, hint_here, &mut claimed)
                .await?;
            let verdict = match verdict {
                Ok(allocation) => return Ok(allocation),
                Err(verdict) => verdict,
            };
            if let PoolVerdict::Try {
                frees_at: Some((at, now)),
                ..
            } = &verdict
                && soonest.is_none_or(|(s, _)| *at < s)
            {
                soonest = Some((*at, *now));
            }
            if failure
                .as_ref()
                .is_none_or(|f| verdict.precedence() > f.precedence())
            {
                failure = Some(verdict);
            }
        }

        if let Some(key) = key
            && !claimed
        {
            // every pool was judged from its view alone: the request may still hold a lease from
            // an earlier attempt (taking the last slot, or on a credential since disabled)
            if let Some(allocation) = self.replay(request, key).await? {
                return Ok(allocation);
            }
        }
        let error = match failure {
            Some(PoolVerdict::Try { .. }) => AllocateError::PoolExhausted {
                retry_after_seconds: retry_after_seconds(soonest),
            },
            Some(PoolVerdict::NoUsableCredentials) => AllocateError::NoUsableCredentials,
            Some(PoolVerdict::ModelNotSupported) => AllocateError::ModelNotSupported,
            Some(PoolVerdict::NotFound) | None => AllocateError::PoolNotFound,
        };
        Err(Refusal {
            error,
            // an end already passed (the view is behind): look again soon
            frees_in: soonest.map(|(at, now)| Duration::try_from(at - now).unwrap_or_default()),
        })
    }

    /// The lease `key`'s request already holds, if any: a claim statement over no candidate,
    /// which only looks the request up.
    async fn replay(
        &self,
        request: &AllocateRequest,
        key: &RequestKey,
    ) -> Result<Option<Allocation>, AllocateError> {
        let claim = ClaimRequest {
            ranked: &[],
            provider: &request.provider,
            pool: &request.pool,
            model: &request.model,
            lease_id: LeaseId::generate(),
            holder: request.holder.as_ref(),
            lease_seconds: request.lease_seconds,
            request: Some(key),
        };
        let result = self.groups.claim(&claim).await?;
        if result.conflict {
            return Err(AllocateError::RequestIdConflict);
        }
        match result.granted {
            Some(granted) => Ok(Some(self.hand_out(&request.provider, granted).await?)),
            None => Ok(None),
        }
    }

    /// Opens a granted lease's secret and makes it an [`Allocation`]. A secret that cannot be
    /// opened gives the slot back at once rather than strand it until lease_until.
    async fn hand_out(
        &self,
        provider: &ProviderName,
        granted: leases::GrantedLease,
    ) -> Result<Allocation, AllocateError> {
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
                };
                self.groups
                    .release(release, &HealthPolicy::default())
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
            credential,
        })
    }

    /// One pool of the sequence: a lease, or the verdict to report if no pool serves.
    async fn allocate_in(
        &self,
        request: &AllocateRequest,
        pool: &PoolName,
        key: Option<&RequestKey>,
        mut hint: Option<KeyId>,
        claimed: &mut bool,
    ) -> Result<Result<Allocation, PoolVerdict>, AllocateError> {
        let provider = &request.provider;
        let scoring = self.views.scoring().clone();
        let mut tried: HashSet<KeyId> = HashSet::new();
        let mut fresh = false;
        let mut refitted = false;
        let mut attempts = 0;
        let mut batch_size = self.claims.batch.max(1);
        let mut claims = 0;
        loop {
            let (mut verdict, loaded) = self
                .views
                .with_view(provider, pool, |view| {
                    judge(
                        view,
                        &request.model,
                        &tried,
                        batch_size,
                        self.claims.rank_window,
                        &scoring,
                        // a fast generator per ranking: jitter needs spread, not secrecy
                        &mut SmallRng::from_rng(&mut rand::rng()),
                    )
                })
                .await?;
            fresh |= loaded;
            if verdict.conclusive_without_claim() {
                if fresh {
                    return Ok(Err(verdict));
                }
                // never answer 404/409 from a stale view
                self.views.reload(provider, pool, None).await?;
                fresh = true;
                continue;
            }
            let PoolVerdict::Try {
                batch,
                refit,
                free_seen,
                ..
            } = &mut verdict
            else {
                unreachable!("conclusive verdicts returned above")
            };
            // a freed slot woke this (waiting) request: that credential first
            if let Some(hinted) = hint.take()
                && !tried.contains(&hinted)
            {
                batch.retain(|k| *k != hinted);
                batch.insert(0, hinted);
                *free_seen = true;
            }
            let (batch, refit, free_seen) = (&*batch, &*refit, *free_seen);
            if !refit.is_empty() && !refitted {
                refitted = true;
                // capacity changed structurally: what was full before may not be now
                tried.clear();
                for key_id in refit {
                    let mut tx = self.db.begin().await?;
                    leases::fit_slots(&mut *tx, key_id).await?;
                    tx.commit().await?;
                }
                self.views.reload(provider, pool, None).await?;
                fresh = true;
                continue;
            }
            claims += 1;
            // A view with no claimable candidate at all (every one cooling down) is still checked
            // by one claim when nothing in this request has reached the database yet: a claim of
            // no candidate grants nothing but reads the pool's version, so a stale view is
            // reloaded and judged again, and an unreachable database answers 503. A 429 is never
            // given from the cached view alone (DESIGN.md: a 429 and a 503 are different facts).
            let confirm_empty = batch.is_empty() && claims == 1 && !fresh;
            if !confirm_empty
                && (batch.is_empty()
                    || (!free_seen && attempts >= self.claims.attempts)
                    || claims > MAX_CLAIMS_PER_POOL)
            {
                // The view expected a lease to have ended by now, yet the pool is full: the view
                // is behind (a renewal moved that end; renewals do not reach the view), and its
                // Retry-After would be too short. Read the pool once and answer from that.
                let behind = matches!(&verdict, PoolVerdict::Try { frees_at: Some((at, now)), .. } if at <= now);
                if behind && !fresh {
                    let (read_at, _) = self
                        .views
                        .with_view(provider, pool, |v| v.read_at())
                        .await?;
                    self.views
                        .reload_unless_newer(provider, pool, read_at)
                        .await?;
                    fresh = true;
                    continue;
                }
                return Ok(Err(verdict));
            }
            if !free_seen {
                attempts += 1;
            }
            let claim = ClaimRequest {
                ranked: batch,
                provider,
                pool,
                model: &request.model,
                lease_id: LeaseId::generate(),
                holder: request.holder.as_ref(),
                lease_seconds: request.lease_seconds,
                request: key,
            };
            let result = self.groups.claim(&claim).await?;
            *claimed = true;
            if result.conflict {
                return Err(AllocateError::RequestIdConflict);
            }
            let view_version = self.views.with_view(provider, pool, |v| v.version).await?.0;
            let stale = result.pool_version != view_version;
            if let Some(granted) = result.granted {
                tracing::info!(
                    key_id = %granted.key_id,
                    lease_id = %granted.lease_id,
                    served_pool = %granted.pool,
                    probe = granted.probe,
                    fence = granted.fence,
                    replayed = granted.replayed,
                    pruned_expired = granted.pruned_expired,
                    "lease granted"
                );
                // a replayed lease was counted when it was granted
                if !granted.replayed {
                    self.views.note_grant(provider, pool, &granted);
                }
                crate::telemetry::expired("claim", u64::from(granted.pruned_expired));
                if stale {
                    let (views, provider, pool, version) = (
                        self.views.clone(),
                        provider.clone(),
                        pool.clone(),
                        result.pool_version,
                    );
                    tokio::spawn(async move {
                        if let Err(error) = views.reload(&provider, &pool, version).await {
                            tracing::warn!(error = %error, "candidate view reload failed");
                        }
                    });
                }
                return self.hand_out(provider, granted).await.map(Ok);
            }
            tracing::debug!(
                candidates = batch.len(),
                stale,
                free_seen,
                "claim found no free slot"
            );
            self.views.note_full(provider, pool, batch);
            tried.extend(batch.iter().cloned());
            batch_size = (batch_size * 2).min(MAX_BATCH);
            if stale {
                self.views
                    .reload(provider, pool, result.pool_version)
                    .await?;
                fresh = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Status;
    use crate::health::{Health, HealthPolicy};
    use crate::store::candidates::{CredentialFacts, PoolSnapshot};
    use rand::SeedableRng;
    use rand::rngs::StdRng;
    use time::Duration;

    fn now() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    fn facts(id: &str, models: &[&str]) -> CredentialFacts {
        CredentialFacts {
            key_id: KeyId::parse(id).unwrap(),
            models: models.iter().map(|m| m.to_string()).collect(),
            aliases: Default::default(),
            max_concurrent_uses: 2,
            health: Health::new(Status::Available),
            slots_over_limit: false,
            draining: false,
            in_flight: 0,
            slot0_free: true,
            next_lease_end: None,
            last_used_at: None,
        }
    }

    fn view(credentials: Vec<CredentialFacts>) -> PoolView {
        PoolView::from_snapshot(
            PoolSnapshot {
                version: Some(1),
                db_now: now(),
                read_at: std::time::Instant::now(),
                credentials,
            },
            &ScoringPolicy::default(),
            &HealthPolicy::default(),
        )
    }

    fn judged(credentials: Vec<CredentialFacts>, model: &str) -> PoolVerdict {
        judge(
            &view(credentials),
            &ModelName::parse(model).unwrap(),
            &HashSet::new(),
            8,
            256,
            &ScoringPolicy::default(),
            &mut StdRng::seed_from_u64(1),
        )
    }

    #[test]
    fn empty_pool_is_not_found() {
        assert!(matches!(judged(vec![], "gpt-4o"), PoolVerdict::NotFound));
    }

    #[test]
    fn pool_without_the_model_or_an_alias_for_it_is_model_not_supported() {
        assert!(matches!(
            judged(vec![facts("a", &["o3"])], "gpt-4o"),
            PoolVerdict::ModelNotSupported
        ));
        let mut aliased = facts("a", &["gpt-4o-2024-08-06"]);
        aliased
            .aliases
            .insert("gpt-4o".into(), "gpt-4o-2024-08-06".into());
        assert!(matches!(
            judged(vec![aliased], "gpt-4o"),
            PoolVerdict::Try { .. }
        ));
    }

    #[test]
    fn only_disabled_exhausted_or_pending_credentials_is_no_usable_credentials() {
        let mut rows = Vec::new();
        for (id, status) in [
            ("d", Status::Disabled),
            ("e", Status::Exhausted),
            ("p", Status::Pending),
        ] {
            let mut row = facts(id, &["gpt-4o"]);
            row.health.status = status;
            rows.push(row);
        }
        assert!(matches!(
            judged(rows, "gpt-4o"),
            PoolVerdict::NoUsableCredentials
        ));
    }

    #[test]
    fn cooling_credentials_are_busy_until_their_cooldown_ends() {
        let mut row = facts("a", &["gpt-4o"]);
        row.health.status = Status::RateLimited;
        row.health.cooldown_until = Some(now() + Duration::seconds(30));
        match judged(vec![row], "gpt-4o") {
            PoolVerdict::Try {
                batch,
                frees_at: Some((at, _)),
                ..
            } => {
                assert!(batch.is_empty());
                assert_eq!(at, now() + Duration::seconds(30));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn over_limit_credential_is_refit_only_when_back_under_its_limit() {
        let mut full = facts("full", &["gpt-4o"]);
        full.slots_over_limit = true;
        full.in_flight = 3;
        let mut under = facts("under", &["gpt-4o"]);
        under.slots_over_limit = true;
        under.in_flight = 1;
        match judged(vec![full, under], "gpt-4o") {
            PoolVerdict::Try { refit, .. } => {
                assert_eq!(refit, vec![KeyId::parse("under").unwrap()])
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_large_pool_is_ranked_over_a_window_of_free_candidates_and_a_small_one_exactly() {
        let rows: Vec<_> = (0..100)
            .map(|i| facts(&format!("k{i:03}"), &["gpt-4o"]))
            .collect();
        let mut exact = view(rows);
        // one clearly best credential: an exact ranking finds it every time
        exact.entries[57].health_score += 5.0;
        exact.rows[57].health_score += 5.0;
        let model = ModelName::parse("gpt-4o").unwrap();
        let mut rng = StdRng::seed_from_u64(5);
        let mut found = 0;
        for _ in 0..50 {
            let PoolVerdict::Try { batch, .. } = judge(
                &exact,
                &model,
                &HashSet::new(),
                1,
                256,
                &ScoringPolicy::default(),
                &mut rng,
            ) else {
                panic!()
            };
            found += usize::from(batch[0].as_str() == "k057");
        }
        assert_eq!(found, 50);
        // with a window of 10 the best is found only when the window covers it (about 1 in 10)
        let mut found = 0;
        for _ in 0..1000 {
            let PoolVerdict::Try {
                batch, free_seen, ..
            } = judge(
                &exact,
                &model,
                &HashSet::new(),
                1,
                10,
                &ScoringPolicy::default(),
                &mut rng,
            )
            else {
                panic!()
            };
            assert!(free_seen);
            found += usize::from(batch[0].as_str() == "k057");
        }
        assert!((50..200).contains(&found), "{found}");
    }

    #[test]
    fn tried_candidates_are_not_offered_again() {
        let rows = vec![facts("a", &["gpt-4o"]), facts("b", &["gpt-4o"])];
        let tried: HashSet<KeyId> = [KeyId::parse("a").unwrap()].into();
        let verdict = judge(
            &view(rows),
            &ModelName::parse("gpt-4o").unwrap(),
            &tried,
            8,
            256,
            &ScoringPolicy::default(),
            &mut StdRng::seed_from_u64(1),
        );
        match verdict {
            PoolVerdict::Try { batch, .. } => assert_eq!(batch, vec![KeyId::parse("b").unwrap()]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one_second() {
        let now = OffsetDateTime::now_utc();
        let after = |ms| retry_after_seconds(Some((now + time::Duration::milliseconds(ms), now)));
        assert_eq!(after(1_200), 2);
        assert_eq!(after(10), 1);
        assert_eq!(after(-5_000), 1);
        assert_eq!(retry_after_seconds(None), 1);
    }
}
