//! What the executor API takes and answers, as the client shows them: [`LeaseRequest`],
//! [`AffinityMode`], [`Credential`], [`Outcome`], [`Released`]; and [`LeaseState`], what a
//! lease's guard and the client's renew and release calls share about it.

use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use time::OffsetDateTime;

/// The lease length, in seconds, the client schedules renewals by when neither the allocate
/// answer nor [`LeaseRequest::lease_seconds`] gives one: the server's default. Servers that
/// send `lease_seconds` in the allocate answer are always taken at their word (their default is
/// 35 s, or their `--max-lease-seconds` if that is lower); with an older server whose maximum
/// is below 35, set `lease_seconds` explicitly.
pub const DEFAULT_LEASE_SECONDS: u32 = 35;

pub use credpool_protocol::MAX_RETRY_AFTER_SECONDS;

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
    ///
    /// [`LeaseGuard::lease_seconds`]: crate::LeaseGuard::lease_seconds
    pub lease_seconds: Option<u32>,
    /// The executor's name for itself (1..=200 printable characters), kept on the lease and in
    /// the audit trail.
    pub holder: Option<String>,
    /// How long to wait for a slot when the pool is exhausted; `None` or zero to fail at once
    /// with [`Error::PoolExhausted`]. Cut to 24 h.
    ///
    /// [`Error::PoolExhausted`]: crate::Error::PoolExhausted
    pub wait: Option<Duration>,
    /// The tokens the call expects to use (0..=10^9), reserved in the credential's token
    /// windows until the release reports its usage ([`LeaseGuard::finish_with_usage`]).
    ///
    /// [`LeaseGuard::finish_with_usage`]: crate::LeaseGuard::finish_with_usage
    pub tokens: Option<u64>,
    /// The conversation this call belongs to (1..=256 printable characters, e.g. a conversation
    /// id): the server tries the credential that served the conversation's last call first,
    /// while it can serve now, because providers cache prompts per account
    /// ([`LeaseGuard::affinity`] says whether it did). `None`: no affinity.
    ///
    /// [`LeaseGuard::affinity`]: crate::LeaseGuard::affinity
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
    ///
    /// [`Error::PoolExhausted`]: crate::Error::PoolExhausted
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
pub struct Credential(pub(crate) serde_json::Value);

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
    ///
    /// [`LeaseGuard::lease_seconds`]: crate::LeaseGuard::lease_seconds
    pub lease_seconds: u32,
    /// Latest known end (server clock), updated by renewals.
    pub(crate) lease_until: Mutex<OffsetDateTime>,
}

impl LeaseState {
    pub(crate) fn lease_until(&self) -> OffsetDateTime {
        *self
            .lease_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn set_lease_until(&self, lease_until: OffsetDateTime) {
        *self
            .lease_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = lease_until;
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
