//! A lease from the executor's side: [`LeaseRequest`] in, [`LeaseGuard`] out (with its
//! background renewal), [`Outcome`] and [`Released`] at the end.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use time::OffsetDateTime;
use tokio::runtime::Handle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::client::Client;
use crate::error::Error;
use crate::wire::Granted;

/// The lease length, in seconds, the client schedules renewals by when neither the allocate
/// answer nor [`LeaseRequest::lease_seconds`] gives one: the server's default. Servers that
/// send `lease_seconds` in the allocate answer are always taken at their word (their default is
/// 35 s, or their `--max-lease-seconds` if that is lower); with an older server whose maximum
/// is below 35, set `lease_seconds` explicitly.
pub const DEFAULT_LEASE_SECONDS: u32 = 35;

pub use credpool_protocol::MAX_RETRY_AFTER_SECONDS;

/// Renewals never come closer together than this, whatever the lease length and renew fraction.
const MIN_RENEW_INTERVAL: Duration = Duration::from_millis(200);

/// The renewal gives up this long before the lease's local end: a tenth of the lease length, at
/// most 2 s, so that work is told to stop while the lease still holds.
const MAX_RENEW_MARGIN: Duration = Duration::from_secs(2);

/// What to lease: `provider` and `model` are required, everything else has the server's
/// default. Build with [`LeaseRequest::new`] and the setters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseRequest {
    /// The provider (`openai`, ...).
    pub provider: String,
    /// The model, or an alias the operator mapped.
    pub model: String,
    /// The pool to lease from; `None` for `default`. `vip` falls back to `default`.
    pub pool: Option<String>,
    /// Lease length in seconds (1..=the server's maximum); `None` for the server's default
    /// (35 s, or its maximum if lower), which the allocate answer reports
    /// ([`LeaseGuard::lease_seconds`]). Renewals extend by the same length.
    pub lease_seconds: Option<u32>,
    /// The executor's name for itself (1..=200 printable characters), kept on the lease and in
    /// the audit trail.
    pub holder: Option<String>,
    /// How long to wait for a slot when the pool is exhausted; `None` or zero to fail at once
    /// with [`Error::PoolExhausted`]. Cut to 24 h.
    pub wait: Option<Duration>,
    /// The tokens the call expects to use (0..=10^9), reserved in the credential's token
    /// windows until the release reports its usage ([`LeaseGuard::finish_with_usage`]).
    pub tokens: Option<u64>,
    /// The conversation this call belongs to (1..=256 printable characters, e.g. a conversation
    /// id): the server tries the credential that served the conversation's last call first,
    /// while it can serve now, because providers cache prompts per account
    /// ([`LeaseGuard::affinity`] says whether it did). `None`: no affinity.
    pub affinity_key: Option<String>,
    /// How long the conversation's binding lives after this call (1 s..=1 day, sent in whole
    /// seconds, rounded up); `None` for the server's default, one hour. Refreshed on each hit.
    pub affinity_ttl: Option<Duration>,
    /// [`AffinityMode::Preferred`] (`None`: the server's default) or [`AffinityMode::Strict`].
    pub affinity_mode: Option<AffinityMode>,
}

/// How strongly a lease request keeps to its conversation's credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AffinityMode {
    /// The bound credential first when it can serve now; otherwise another one serves at once
    /// and the conversation moves to it.
    Preferred,
    /// Only the bound credential while it could serve but for its slots (the request waits for
    /// it, up to [`LeaseRequest::wait`], or fails with [`Error::PoolExhausted`]); a credential
    /// that cannot serve at all (disabled, cooling down, moved) is left as under `Preferred`.
    Strict,
}

impl AffinityMode {
    pub(crate) fn wire(self) -> &'static str {
        match self {
            AffinityMode::Preferred => "preferred",
            AffinityMode::Strict => "strict",
        }
    }
}

/// Whether a lease request's conversation ([`LeaseRequest::affinity_key`]) was served by the
/// credential it was bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AffinityResult {
    /// `hit`: the bound credential served it (its prompt cache is warm).
    Hit,
    /// `new`: the conversation had no live binding; it is bound to this credential now.
    New,
    /// `moved`: the bound credential could not serve now; the conversation is bound to this one.
    Moved,
    /// A result this client does not know, as the server spelled it.
    Other(String),
}

impl AffinityResult {
    pub(crate) fn from_wire(result: &str) -> Self {
        match result {
            "hit" => AffinityResult::Hit,
            "new" => AffinityResult::New,
            "moved" => AffinityResult::Moved,
            other => AffinityResult::Other(other.to_owned()),
        }
    }
}

impl LeaseRequest {
    /// A request for `model` from `provider`, with every other field at its default.
    pub fn new(provider: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            provider: provider.into(),
            model: model.into(),
            ..Self::default()
        }
    }

    /// Sets [`LeaseRequest::pool`].
    pub fn pool(mut self, pool: impl Into<String>) -> Self {
        self.pool = Some(pool.into());
        self
    }

    /// Sets [`LeaseRequest::lease_seconds`] (seconds).
    pub fn lease_seconds(mut self, seconds: u32) -> Self {
        self.lease_seconds = Some(seconds);
        self
    }

    /// Sets [`LeaseRequest::holder`].
    pub fn holder(mut self, holder: impl Into<String>) -> Self {
        self.holder = Some(holder.into());
        self
    }

    /// Sets [`LeaseRequest::wait`].
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Sets [`LeaseRequest::tokens`].
    pub fn tokens(mut self, tokens: u64) -> Self {
        self.tokens = Some(tokens);
        self
    }

    /// Sets [`LeaseRequest::affinity_key`].
    pub fn affinity_key(mut self, key: impl Into<String>) -> Self {
        self.affinity_key = Some(key.into());
        self
    }

    /// Sets [`LeaseRequest::affinity_ttl`].
    pub fn affinity_ttl(mut self, ttl: Duration) -> Self {
        self.affinity_ttl = Some(ttl);
        self
    }

    /// Sets [`LeaseRequest::affinity_mode`].
    pub fn affinity_mode(mut self, mode: AffinityMode) -> Self {
        self.affinity_mode = Some(mode);
        self
    }
}

/// The credential material of a lease: the JSON object the operator stored, such as
/// `{"api_key": "sk-..."}`. `Debug` prints `Credential(<redacted>)`; nothing in this crate
/// serializes or logs it.
#[derive(Clone)]
pub struct Credential(serde_json::Value);

impl Credential {
    /// The whole object. Handle with care: it is the secret.
    pub fn expose(&self) -> &serde_json::Value {
        &self.0
    }

    /// The string field `field` of the object (`get_str("api_key")`), or `None` when it is
    /// missing or not a string.
    pub fn get_str(&self, field: &str) -> Option<&str> {
        self.0.get(field).and_then(serde_json::Value::as_str)
    }
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Credential(<redacted>)")
    }
}

/// What happened upstream, reported when the lease is released; it drives the credential's
/// health on the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The upstream call succeeded.
    Success,
    /// The upstream call failed for a reason other than those below.
    Failure,
    /// The provider rate-limited the call (an upstream 429). `retry_after` is the provider's
    /// `Retry-After`, if it gave one; sent in whole seconds, rounded up, at most
    /// [`MAX_RETRY_AFTER_SECONDS`].
    RateLimited {
        /// The provider's `Retry-After`.
        retry_after: Option<Duration>,
    },
    /// The provider rejected the credential.
    AuthError,
    /// The provider rejected an OAuth access token (an upstream 401 with a leased OAuth token):
    /// the server takes that token out of traffic and refreshes it once, however many executors
    /// report it; allocate again for the new token. On a credential that is not OAuth the server
    /// counts it as [`Outcome::AuthError`].
    AuthExpired,
    /// The credential's quota is used up. `retry_after` as for [`Outcome::RateLimited`] (for
    /// example until a monthly reset).
    QuotaExhausted {
        /// When the quota resets, if the provider said.
        retry_after: Option<Duration>,
    },
}

impl Outcome {
    /// The wire `outcome` and `retry_after_seconds`.
    pub(crate) fn wire(self) -> (&'static str, Option<u32>) {
        match self {
            Outcome::Success => ("success", None),
            Outcome::Failure => ("failure", None),
            Outcome::RateLimited { retry_after } => {
                ("rate_limited", retry_after.map(whole_seconds))
            }
            Outcome::AuthError => ("auth_error", None),
            Outcome::AuthExpired => ("auth_expired", None),
            Outcome::QuotaExhausted { retry_after } => {
                ("quota_exhausted", retry_after.map(whole_seconds))
            }
        }
    }
}

/// `duration` in whole seconds, rounded up, at most [`MAX_RETRY_AFTER_SECONDS`].
fn whole_seconds(duration: Duration) -> u32 {
    let seconds = duration
        .as_secs()
        .saturating_add(u64::from(duration.subsec_nanos() > 0));
    u32::try_from(seconds)
        .unwrap_or(u32::MAX)
        .min(MAX_RETRY_AFTER_SECONDS)
}

/// The answer to a release: `released` is false when nothing was released, and `reason` says why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// True when this call freed the slot.
    pub released: bool,
    /// Why nothing was released; `None` when `released` is true.
    pub reason: Option<NotReleased>,
}

/// Why a release released nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NotReleased {
    /// `mismatch`: the ids, provider, pool or fence do not match the lease.
    Mismatch,
    /// `expired`: the lease had already ended.
    Expired,
    /// `not_found`: no such lease (already released, or force-released by an operator).
    NotFound,
    /// A reason this client does not know, as the server spelled it.
    Other(String),
}

impl NotReleased {
    pub(crate) fn from_wire(reason: &str) -> Self {
        match reason {
            "mismatch" => NotReleased::Mismatch,
            "expired" => NotReleased::Expired,
            "not_found" => NotReleased::NotFound,
            other => NotReleased::Other(other.to_owned()),
        }
    }
}

/// What the guard and its renewal task share about a lease.
pub(crate) struct LeaseState {
    pub provider: String,
    /// The pool that served.
    pub pool: String,
    pub key_id: String,
    pub lease_id: String,
    pub fence: u64,
    pub provider_model: String,
    pub probe: bool,
    /// The answer's `affinity`, if it had one.
    pub affinity: Option<AffinityResult>,
    /// As requested; sent again with every renewal (`None`: the server extends by the length
    /// it granted).
    pub requested_seconds: Option<u32>,
    /// The length the lease was granted for, in seconds: renewal and the loss deadline are
    /// scheduled by it. See [`LeaseGuard::lease_seconds`].
    pub lease_seconds: u32,
    /// Latest known end (server clock), updated by renewals.
    lease_until: Mutex<OffsetDateTime>,
}

impl LeaseState {
    fn lease_until(&self) -> OffsetDateTime {
        *self
            .lease_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn set_lease_until(&self, lease_until: OffsetDateTime) {
        *self
            .lease_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = lease_until;
    }
}

/// A leased credential. Renews itself in the background while held.
///
/// - **Renewal**: a tokio task renews every [`LeaseGuard::lease_seconds`] `* renew_fraction`
///   (default a third of the lease; never more often than every 200 ms), sending the fence and
///   the requested `lease_seconds`, if any. A 410 (or any error the client does not retry)
///   loses the lease at once; a 503 or transport error is retried with backoff until the lease
///   would end by the local monotonic clock (its length from the send time of the last
///   successful renewal, less a tenth of the lease, at most 2 s), and loses it then.
/// - **Lost**: [`LeaseGuard::lost`] completes, [`LeaseGuard::lost_token`] is cancelled and
///   [`LeaseGuard::is_lost`] turns true. Stop using the credential at once: another executor
///   may hold its slot.
/// - **End**: [`LeaseGuard::finish`] releases with an outcome. Dropping the guard without it
///   releases with outcome `failure` in the background, on the tokio runtime the guard was made
///   on; if that runtime is gone, nothing is sent and the lease ends at `lease_until`.
///   [`LeaseGuard::abandon`] sends nothing.
///
/// `Debug` shows ids, fence and lease end, never the credential.
pub struct LeaseGuard {
    client: Client,
    lease: Arc<LeaseState>,
    credential: Credential,
    /// Cancelled by the renewal task when the lease is lost; users get child tokens, so they
    /// cannot fire it for each other.
    lost: CancellationToken,
    /// Cancelled when the guard is finished, abandoned or dropped: stops the renewal task.
    stop: CancellationToken,
    runtime: Handle,
    /// Set once a release was made (or deliberately skipped), so drop sends none.
    settled: bool,
}

impl LeaseGuard {
    /// Wraps a fresh grant and starts its renewal task on `runtime`. `started` is no later than
    /// the server's grant: the renewal clock counts from it.
    pub(crate) fn start(
        client: Client,
        granted: Granted,
        request: &LeaseRequest,
        started: Instant,
        runtime: Handle,
    ) -> LeaseGuard {
        // The server's word first: it may have granted its default, or less than 35 s.
        let lease_seconds = granted
            .lease_seconds
            .or(request.lease_seconds)
            .unwrap_or(DEFAULT_LEASE_SECONDS)
            .max(1);
        let lease = Arc::new(LeaseState {
            provider: granted.provider,
            pool: granted.pool,
            key_id: granted.key_id,
            lease_id: granted.lease_id,
            fence: granted.fence,
            provider_model: granted.provider_model,
            probe: granted.probe,
            affinity: granted.affinity.as_deref().map(AffinityResult::from_wire),
            requested_seconds: request.lease_seconds,
            lease_seconds,
            lease_until: Mutex::new(granted.lease_until),
        });
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        let length = Duration::from_secs(u64::from(lease_seconds));
        runtime.spawn(keep_renewed(
            client.clone(),
            lease.clone(),
            length,
            started,
            stop.clone(),
            lost.clone(),
        ));
        LeaseGuard {
            client,
            lease,
            credential: Credential(granted.credential),
            lost,
            stop,
            runtime,
            settled: false,
        }
    }

    /// The credential's id.
    pub fn key_id(&self) -> &str {
        &self.lease.key_id
    }

    /// The lease's id (32 hex digits).
    pub fn lease_id(&self) -> &str {
        &self.lease.lease_id
    }

    /// The lease's fencing token, a positive integer issued by the server with the lease and
    /// sent back with every renewal and the release. Pass it to anything downstream that must
    /// refuse a stale holder (a later lease carries a larger fence).
    pub fn fence(&self) -> u64 {
        self.lease.fence
    }

    /// The provider.
    pub fn provider(&self) -> &str {
        &self.lease.provider
    }

    /// The pool that served (`default` after a `vip` fallback).
    pub fn pool(&self) -> &str {
        &self.lease.pool
    }

    /// The model name as this credential serves it (an alias resolved).
    pub fn provider_model(&self) -> &str {
        &self.lease.provider_model
    }

    /// True for the single probe lease of a credential back from a cooldown: report its outcome
    /// faithfully, it decides whether the credential returns to service.
    pub fn probe(&self) -> bool {
        self.lease.probe
    }

    /// With an [`LeaseRequest::affinity_key`]: whether the conversation's bound credential
    /// served this lease. `None` without one, and when the client's retry of the allocate was
    /// answered with the lease its first attempt got (the server does not repeat it).
    pub fn affinity(&self) -> Option<&AffinityResult> {
        self.lease.affinity.as_ref()
    }

    /// When the lease ends unless renewed (server clock): the latest known value, updated by
    /// each successful renewal.
    pub fn lease_until(&self) -> OffsetDateTime {
        self.lease.lease_until()
    }

    /// The lease's length in seconds, which each renewal extends it by: as the allocate answer
    /// says (`lease_seconds`), else as requested ([`LeaseRequest::lease_seconds`]) from a server
    /// that does not say, else [`DEFAULT_LEASE_SECONDS`]. Renewals come every
    /// `lease_seconds * renew_fraction`, and renewal failures lose the lease by the local end
    /// this length gives.
    pub fn lease_seconds(&self) -> u32 {
        self.lease.lease_seconds
    }

    /// The credential material.
    pub fn credential(&self) -> &Credential {
        &self.credential
    }

    /// Completes when the lease is lost (see the type's docs); pending forever while it holds.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + '_ {
        self.lost.cancelled()
    }

    /// A token cancelled when the lease is lost, for `tokio::select!` or to hand to other
    /// tasks. Cancelling it yourself affects only that token.
    pub fn lost_token(&self) -> CancellationToken {
        self.lost.child_token()
    }

    /// True once the lease is lost.
    pub fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// Stops renewing and releases the lease with `outcome` (and its `retry_after`, for
    /// [`Outcome::RateLimited`] and [`Outcome::QuotaExhausted`]) and the fence, retrying 503s
    /// and transport errors under the retry policy. A lease that was already lost is still
    /// reported; the server then answers `released: false`.
    ///
    /// If this future is dropped before it completes, the guard's drop releases with `failure`.
    ///
    /// # Errors
    /// Any [`Error`] of the release call, after retries.
    #[tracing::instrument(skip_all, fields(key_id = %self.lease.key_id, outcome = ?outcome))]
    pub async fn finish(self, outcome: Outcome) -> Result<Released, Error> {
        self.release(outcome, None).await
    }

    /// [`LeaseGuard::finish`], reporting the tokens the call really used: they replace the
    /// lease's [`LeaseRequest::tokens`] reservation in the credential's token windows.
    ///
    /// # Errors
    /// Any [`Error`] of the release call, after retries.
    pub async fn finish_with_usage(
        self,
        outcome: Outcome,
        usage_tokens: u64,
    ) -> Result<Released, Error> {
        self.release(outcome, Some(usage_tokens)).await
    }

    async fn release(
        mut self,
        outcome: Outcome,
        usage_tokens: Option<u64>,
    ) -> Result<Released, Error> {
        self.stop.cancel();
        let released = self
            .client
            .release(&self.lease, outcome, usage_tokens)
            .await;
        self.settle();
        released
    }

    /// Stops renewing and does NOT release: the lease runs out at `lease_until` and its slot
    /// stays taken until then. Meant for demos and tests that act out a crashed executor; real
    /// executors call [`LeaseGuard::finish`].
    pub fn abandon(mut self) {
        self.stop.cancel();
        self.settle();
    }

    /// Marks the guard as released (or deliberately not), so its drop sends nothing.
    fn settle(&mut self) {
        self.settled = true;
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.stop.cancel();
        if self.settled {
            return;
        }
        let client = self.client.clone();
        let lease = self.lease.clone();
        tracing::debug!(key_id = %lease.key_id, "lease guard dropped without finish: releasing with outcome failure");
        // A runtime that has shut down drops the task unrun; nothing panics.
        drop(self.runtime.spawn(async move {
            match client.release(&lease, Outcome::Failure, None).await {
                Ok(released) => {
                    tracing::debug!(key_id = %lease.key_id, ?released, "released on drop");
                }
                Err(error) => {
                    tracing::warn!(key_id = %lease.key_id, %error, "release on drop failed; the lease ends at lease_until");
                }
            }
        }));
    }
}

impl fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("key_id", &self.lease.key_id)
            .field("lease_id", &self.lease.lease_id)
            .field("fence", &self.lease.fence)
            .field("provider", &self.lease.provider)
            .field("pool", &self.lease.pool)
            .field("provider_model", &self.lease.provider_model)
            .field("probe", &self.lease.probe)
            .field("lease_until", &self.lease.lease_until())
            .field("lease_seconds", &self.lease.lease_seconds)
            .field("lost", &self.is_lost())
            .finish_non_exhaustive()
    }
}

/// The renewal task: renews `lease` every `length * renew_fraction` counted from the send time of
/// the last successful renewal (`renewed_at`, first the allocation's start), until `stop` is
/// cancelled or the lease is lost (then it cancels `lost`).
async fn keep_renewed(
    client: Client,
    lease: Arc<LeaseState>,
    length: Duration,
    mut renewed_at: Instant,
    stop: CancellationToken,
    lost: CancellationToken,
) {
    let interval = length
        .mul_f64(client.renew_fraction())
        .max(MIN_RENEW_INTERVAL);
    let margin = (length / 10).min(MAX_RENEW_MARGIN);
    loop {
        tokio::select! {
            biased;
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(renewed_at + interval) => {}
        }
        let ends = renewed_at + length - margin;
        let renewed = tokio::select! {
            biased;
            () = stop.cancelled() => return,
            renewed = client.renew(&lease, ends) => renewed,
        };
        match renewed {
            Ok((lease_until, sent_at)) => {
                lease.set_lease_until(lease_until);
                renewed_at = sent_at;
            }
            Err(error) => {
                tracing::warn!(key_id = %lease.key_id, lease_id = %lease.lease_id, %error, "lease lost: stop using the credential");
                lost.cancel();
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_go_on_the_wire_in_whole_seconds_rounded_up_and_capped() {
        let rate_limited = |retry_after| Outcome::RateLimited { retry_after }.wire();
        assert_eq!(rate_limited(None), ("rate_limited", None));
        assert_eq!(
            rate_limited(Some(Duration::from_secs(12))),
            ("rate_limited", Some(12))
        );
        assert_eq!(
            rate_limited(Some(Duration::from_millis(12_001))),
            ("rate_limited", Some(13))
        );
        assert_eq!(
            rate_limited(Some(Duration::from_millis(1))),
            ("rate_limited", Some(1))
        );
        assert_eq!(
            rate_limited(Some(Duration::from_secs(u64::MAX))),
            ("rate_limited", Some(MAX_RETRY_AFTER_SECONDS))
        );
        assert_eq!(
            Outcome::QuotaExhausted {
                retry_after: Some(Duration::from_secs(40 * 86_400))
            }
            .wire(),
            ("quota_exhausted", Some(MAX_RETRY_AFTER_SECONDS))
        );
        assert_eq!(Outcome::Success.wire(), ("success", None));
        assert_eq!(Outcome::Failure.wire(), ("failure", None));
        assert_eq!(Outcome::AuthError.wire(), ("auth_error", None));
        assert_eq!(Outcome::AuthExpired.wire(), ("auth_expired", None));
    }

    #[test]
    fn credential_debug_is_redacted() {
        let credential = Credential(serde_json::json!({"api_key": "sk-SECRET"}));
        assert_eq!(format!("{credential:?}"), "Credential(<redacted>)");
        assert_eq!(credential.get_str("api_key"), Some("sk-SECRET"));
        assert_eq!(credential.get_str("missing"), None);
    }

    #[test]
    fn lease_request_setters_fill_the_optional_fields() {
        let request = LeaseRequest::new("openai", "gpt-4o")
            .pool("vip")
            .lease_seconds(10)
            .holder("worker-1")
            .wait(Duration::from_secs(2));
        assert_eq!(request.pool.as_deref(), Some("vip"));
        assert_eq!(request.lease_seconds, Some(10));
        assert_eq!(request.holder.as_deref(), Some("worker-1"));
        assert_eq!(request.wait, Some(Duration::from_secs(2)));
        assert_eq!(LeaseRequest::new("p", "m").pool, None);
    }
}
