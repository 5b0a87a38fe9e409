//! [`Client`], its builder and retry policy, and the three executor calls (allocate, renew,
//! release) with their retries.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use reqwest::Url;
use reqwest::header::{HeaderValue, RETRY_AFTER};
use serde::Serialize;
use time::OffsetDateTime;
use tokio::time::Instant;

use crate::api::{AffinityMode, LeaseRequest, LeaseState, Outcome, Released};
use crate::error::{self, Error, TransportError};
use crate::wire;

/// The header that carries the internal key on every executor route.
const INTERNAL_KEY_HEADER: &str = "x-internal-key";

/// The shortest timeout a renewal attempt gets, even when the lease's end is nearer: a lease
/// whose local deadline passed may still be alive on the server (the deadline is conservative).
const MIN_ATTEMPT_TIMEOUT: Duration = Duration::from_millis(200);

/// A 429 that came back sooner than this after the request was sent was not held by the server
/// (an older server, or one that knows nothing frees in time): the client pauses before asking
/// again instead of spinning.
const HELD_AT_LEAST: Duration = Duration::from_millis(100);

/// The longest `wait` a lease request may ask for; longer ones are cut to this (24 h).
const MAX_WAIT: Duration = Duration::from_secs(86_400);

/// How the client retries a 503 or a transport error: capped exponential backoff with jitter.
///
/// The n-th sleep is `base_delay * 2^(n-1)`, capped at `max_delay`, plus a random jitter of up
/// to the same amount again (so a sleep is at most `2 * max_delay`). Retries stop at whichever
/// comes first of `max_retries` and `max_elapsed`; at least one of the two must be set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The first sleep. Default 100 ms.
    pub base_delay: Duration,
    /// The longest sleep before jitter. Default 5 s.
    pub max_delay: Duration,
    /// The most retries after the first attempt; `None` for no limit by count. Default `None`.
    pub max_retries: Option<usize>,
    /// The longest time from the first attempt after which no retry starts; `None` for no
    /// limit by time. Default 30 s.
    pub max_elapsed: Option<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
            max_retries: None,
            max_elapsed: Some(Duration::from_secs(30)),
        }
    }
}

impl RetryPolicy {
    fn backoff(&self) -> ExponentialBuilder {
        let builder = ExponentialBuilder::new()
            .with_min_delay(self.base_delay)
            .with_max_delay(self.max_delay)
            .with_jitter();
        match self.max_retries {
            Some(retries) => builder.with_max_times(retries),
            None => builder.without_max_times(),
        }
    }

    fn check(&self) -> Result<(), String> {
        if self.base_delay.is_zero() {
            return Err("retry base_delay must be positive".into());
        }
        if self.max_delay < self.base_delay {
            return Err("retry max_delay must be at least base_delay".into());
        }
        if self.max_retries.is_none() && self.max_elapsed.is_none() {
            return Err("a retry policy needs max_retries or max_elapsed".into());
        }
        Ok(())
    }
}

/// Builds a [`Client`]; start with [`Client::builder`].
pub struct ClientBuilder {
    base_url: String,
    internal_key: String,
    retry: RetryPolicy,
    http_timeout: Duration,
    renew_fraction: f64,
}

impl ClientBuilder {
    /// How 503s and transport errors are retried. Default: [`RetryPolicy::default`].
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// The timeout of one HTTP request, connect included. Default 10 s. An allocate that asks
    /// the server to wait gets the wait on top of this.
    pub fn http_timeout(mut self, timeout: Duration) -> Self {
        self.http_timeout = timeout;
        self
    }

    /// The share of the lease length between renewals, in (0, 1). Default 1/3: a 30 s lease is
    /// renewed every 10 s. Renewals never come closer than 200 ms apart.
    pub fn renew_fraction(mut self, fraction: f64) -> Self {
        self.renew_fraction = fraction;
        self
    }

    /// The client.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the base URL does not parse or is not `http://` (this build
    /// has no TLS: see the crate docs), the internal key is empty or not a valid header value,
    /// the timeout is zero, the renew fraction is outside (0, 1), or the retry policy is unusable.
    pub fn build(self) -> Result<Client, Error> {
        let invalid = |message: String| Error::InvalidConfig { message };
        let mut base_url = Url::parse(&self.base_url)
            .map_err(|error| invalid(format!("the base URL does not parse: {error}")))?;
        match base_url.scheme() {
            "http" => {}
            "https" => {
                return Err(invalid(
                    "https:// needs TLS, which this build of credpool-client leaves out: \
                     use http:// to a TLS-terminating sidecar or a trusted network"
                        .into(),
                ));
            }
            other => {
                return Err(invalid(format!(
                    "the base URL's scheme is {other}, not http"
                )));
            }
        }
        if self.internal_key.is_empty() {
            return Err(invalid("the internal key is empty".into()));
        }
        let mut internal_key = HeaderValue::from_str(&self.internal_key).map_err(|_| {
            invalid("the internal key has characters an HTTP header cannot carry".into())
        })?;
        internal_key.set_sensitive(true);
        if self.http_timeout.is_zero() {
            return Err(invalid("the HTTP timeout must be positive".into()));
        }
        if !(self.renew_fraction > 0.0 && self.renew_fraction < 1.0) {
            return Err(invalid("the renew fraction must be in (0, 1)".into()));
        }
        self.retry.check().map_err(invalid)?;

        // Routes are joined onto the base, so a base with a path prefix
        // (`http://host/credpool`) keeps it.
        base_url.set_query(None);
        base_url.set_fragment(None);
        if !base_url.path().ends_with('/') {
            let path = format!("{}/", base_url.path());
            base_url.set_path(&path);
        }
        let route = |path: &str| {
            base_url
                .join(path)
                .map_err(|error| invalid(format!("the base URL cannot take routes: {error}")))
        };
        let http = reqwest::Client::builder()
            .connect_timeout(self.http_timeout)
            // The internal key is a custom header, which a redirect would carry to wherever it
            // points; credpool never redirects.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("credpool-client/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|error| invalid(format!("the HTTP client cannot be built: {error}")))?;
        Ok(Client {
            inner: Arc::new(Inner {
                allocate_url: route("api/internal/allocate-key")?,
                renew_url: route("api/internal/renew-lease")?,
                release_url: route("api/internal/release-key")?,
                base_url,
                http,
                internal_key,
                internal_key_text: self.internal_key,
                retry: self.retry,
                http_timeout: self.http_timeout,
                renew_fraction: self.renew_fraction,
            }),
        })
    }
}

impl fmt::Debug for ClientBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientBuilder")
            .field("base_url", &self.base_url)
            .field("internal_key", &"<redacted>")
            .field("retry", &self.retry)
            .field("http_timeout", &self.http_timeout)
            .field("renew_fraction", &self.renew_fraction)
            .finish()
    }
}

/// A client of credpool's executor API. Cheap to clone (one `Arc`); clones share one HTTP
/// connection pool. `Debug` never shows the internal key.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    http: reqwest::Client,
    base_url: Url,
    allocate_url: Url,
    renew_url: Url,
    release_url: Url,
    /// Marked sensitive, so the HTTP library's own `Debug` hides it too.
    internal_key: HeaderValue,
    /// Kept only to scrub it from server messages.
    internal_key_text: String,
    retry: RetryPolicy,
    http_timeout: Duration,
    renew_fraction: f64,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("base_url", &self.inner.base_url.as_str())
            .field("internal_key", &"<redacted>")
            .field("retry", &self.inner.retry)
            .field("http_timeout", &self.inner.http_timeout)
            .field("renew_fraction", &self.inner.renew_fraction)
            .finish()
    }
}

/// An HTTP answer, read whole.
struct Answer {
    status: u16,
    retry_after: Option<String>,
    body: Vec<u8>,
}

impl Client {
    /// A client with default settings for the credpool at `base_url` (for example
    /// `http://127.0.0.1:8080`; a path prefix is kept), authenticating with `internal_key`
    /// (sent as `X-Internal-Key`).
    ///
    /// # Errors
    /// As [`ClientBuilder::build`].
    pub fn new(
        base_url: impl Into<String>,
        internal_key: impl Into<String>,
    ) -> Result<Client, Error> {
        Self::builder(base_url, internal_key).build()
    }

    /// A builder for a client with non-default retries, timeout or renew fraction.
    pub fn builder(base_url: impl Into<String>, internal_key: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            base_url: base_url.into(),
            internal_key: internal_key.into(),
            retry: RetryPolicy::default(),
            http_timeout: Duration::from_secs(10),
            renew_fraction: 1.0 / 3.0,
        }
    }

    /// The allocate loop of [`Client::lease`] (see there: one `request_id` for every attempt,
    /// retries, waiting): the grant, and the instant its run of attempts started (the lease
    /// started no earlier, so its renewal clock counts from there).
    pub(crate) async fn allocate(
        &self,
        request: &LeaseRequest,
    ) -> Result<(wire::Granted, Instant), Error> {
        let request_id = uuid::Uuid::new_v4().hyphenated().to_string();
        let wait_until = request
            .wait
            .filter(|wait| !wait.is_zero())
            .map(|wait| Instant::now() + wait.min(MAX_WAIT));
        // Pauses after 429s that the server did not hold.
        let mut pauses =
            backon::BackoffBuilder::build(self.inner.retry.backoff().without_max_times());
        loop {
            // Any attempt of this run may be the one the server granted (a lost answer to a
            // granted request is retried and gets the same lease back), so the lease started no
            // earlier than this: the renewal clock counts from here.
            let run_started = Instant::now();
            let result = self
                .with_retries("allocate", None, || {
                    self.allocate_once(request, &request_id, wait_until)
                })
                .await;
            let retry_after = match result {
                Ok(granted) => {
                    tracing::debug!(key_id = %granted.key_id, pool = %granted.pool, fence = granted.fence, "leased");
                    return Ok((granted, run_started));
                }
                Err(Error::PoolExhausted { retry_after }) => retry_after,
                Err(error) => return Err(error),
            };
            let now = Instant::now();
            let left =
                wait_until.map_or(Duration::ZERO, |until| until.saturating_duration_since(now));
            // under a millisecond left is still left: giving up then would end the wait early
            if left.is_zero() {
                return Err(Error::PoolExhausted { retry_after });
            }
            if now - run_started < HELD_AT_LEAST {
                let pause = pauses
                    .next()
                    .unwrap_or(self.inner.retry.max_delay)
                    .min(retry_after)
                    .min(left);
                tracing::debug!(
                    pause_ms = pause.as_millis() as u64,
                    "pool exhausted; pausing"
                );
                tokio::time::sleep(pause).await;
            }
        }
    }

    /// One allocate request, asking the server to wait for what is left until `wait_until`.
    async fn allocate_once(
        &self,
        request: &LeaseRequest,
        request_id: &str,
        wait_until: Option<Instant>,
    ) -> Result<wire::Granted, Error> {
        let wait = wait_until
            .map(|until| until.saturating_duration_since(Instant::now()))
            .filter(|wait| wait.as_millis() > 0);
        let body = wire::AllocateBody {
            provider: &request.provider,
            model: &request.model,
            pool: request.pool.as_deref(),
            lease_seconds: request.lease_seconds,
            holder: request.holder.as_deref(),
            request_id,
            wait_ms: wait.map(|wait| u64::try_from(wait.as_millis()).unwrap_or(u64::MAX)),
            tokens: request.tokens,
            affinity_key: request.affinity_key.as_deref(),
            // whole seconds, rounded up (the server refuses 0)
            affinity_ttl_seconds: request.affinity_ttl.map(|ttl| {
                ttl.as_secs()
                    .saturating_add(u64::from(ttl.subsec_nanos() > 0))
            }),
            affinity_mode: request.affinity_mode.map(AffinityMode::wire),
        };
        let timeout = self.inner.http_timeout + wait.unwrap_or_default();
        let answer = self.post(&self.inner.allocate_url, &body, timeout).await?;
        if answer.status != 200 {
            return Err(self.error_of(answer));
        }
        wire::parse_granted(&answer.body).map_err(|detail| Error::UnexpectedResponse {
            status: 200,
            detail,
        })
    }

    /// Renews `lease` (`POST /api/internal/renew-lease`), retrying 503s and transport errors
    /// until `deadline` (the local estimate of the lease's end). Returns the new `lease_until`
    /// and when the request that got it was sent.
    pub(crate) async fn renew(
        &self,
        lease: &LeaseState,
        deadline: Instant,
    ) -> Result<(OffsetDateTime, Instant), Error> {
        let body = wire::RenewBody {
            lease: lease_body(lease),
            lease_seconds: lease.requested_seconds,
        };
        self.with_retries("renew", Some(deadline), || async {
            let sent_at = Instant::now();
            let timeout = self
                .inner
                .http_timeout
                .min(deadline.saturating_duration_since(sent_at))
                .max(MIN_ATTEMPT_TIMEOUT);
            let answer = self.post(&self.inner.renew_url, &body, timeout).await?;
            if answer.status != 200 {
                return Err(self.error_of(answer));
            }
            let lease_until =
                wire::parse_renewed(&answer.body).map_err(|detail| Error::UnexpectedResponse {
                    status: 200,
                    detail,
                })?;
            Ok((lease_until, sent_at))
        })
        .await
    }

    /// Releases `lease` with `outcome` and the tokens used, if known (`POST
    /// /api/internal/release-key`), retrying 503s and transport errors under the retry policy.
    pub(crate) async fn release(
        &self,
        lease: &LeaseState,
        outcome: Outcome,
        usage_tokens: Option<u64>,
    ) -> Result<Released, Error> {
        let (outcome, retry_after_seconds) = outcome.wire();
        let body = wire::ReleaseBody {
            lease: lease_body(lease),
            outcome,
            retry_after_seconds,
            usage: usage_tokens.map(|tokens| wire::UsageBody { tokens }),
        };
        self.with_retries("release", None, || async {
            let answer = self
                .post(&self.inner.release_url, &body, self.inner.http_timeout)
                .await?;
            if answer.status != 200 {
                return Err(self.error_of(answer));
            }
            wire::parse_released(&answer.body).map_err(|detail| Error::UnexpectedResponse {
                status: 200,
                detail,
            })
        })
        .await
    }

    /// The share of a lease's length between renewals.
    pub(crate) fn renew_fraction(&self) -> f64 {
        self.inner.renew_fraction
    }

    /// Runs `attempt` until it succeeds, fails with an error the client does not retry, or the
    /// retry policy (or `deadline`, if sooner) gives up; then returns the last error.
    async fn with_retries<T, Fut>(
        &self,
        call: &'static str,
        deadline: Option<Instant>,
        attempt: impl FnMut() -> Fut,
    ) -> Result<T, Error>
    where
        Fut: Future<Output = Result<T, Error>>,
    {
        let give_up_at = self
            .inner
            .retry
            .max_elapsed
            .and_then(|elapsed| Instant::now().checked_add(elapsed));
        let deadline = match (give_up_at, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        attempt
            .retry(self.inner.retry.backoff())
            .when(Error::retried_by_client)
            // No retry whose sleep would end past the deadline.
            .adjust(move |_, delay| {
                delay.filter(|delay| {
                    deadline.is_none_or(|deadline| {
                        Instant::now()
                            .checked_add(*delay)
                            .is_some_and(|wake| wake < deadline)
                    })
                })
            })
            .notify(|error, delay| {
                tracing::debug!(call, %error, delay_ms = delay.as_millis() as u64, "retrying");
            })
            .await
    }

    async fn post(
        &self,
        url: &Url,
        body: &impl Serialize,
        timeout: Duration,
    ) -> Result<Answer, Error> {
        let transport = |error| Error::Transport(TransportError::from_reqwest(error));
        let response = self
            .inner
            .http
            .post(url.clone())
            .header(INTERNAL_KEY_HEADER, self.inner.internal_key.clone())
            .json(body)
            .timeout(timeout)
            .send()
            .await
            .map_err(transport)?;
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let body = response.bytes().await.map_err(transport)?.to_vec();
        Ok(Answer {
            status,
            retry_after,
            body,
        })
    }

    fn error_of(&self, answer: Answer) -> Error {
        let key = self.inner.internal_key_text.as_str();
        error::from_answer(
            answer.status,
            answer.retry_after.as_deref(),
            &answer.body,
            |message| {
                if message.contains(key) {
                    message.replace(key, "<redacted>")
                } else {
                    message
                }
            },
        )
    }
}

/// How a renewal or a release names `lease`.
fn lease_body(lease: &LeaseState) -> wire::LeaseBody<'_> {
    wire::LeaseBody {
        provider: &lease.provider,
        pool: &lease.pool,
        key_id: &lease.key_id,
        lease_id: &lease.lease_id,
        fence: lease.fence,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_error(result: Result<Client, Error>) -> String {
        match result {
            Err(Error::InvalidConfig { message }) => message,
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn routes_join_onto_the_base_and_keep_its_path() {
        let client = Client::new("http://127.0.0.1:8080", "k").expect("builds");
        assert_eq!(
            client.inner.allocate_url.as_str(),
            "http://127.0.0.1:8080/api/internal/allocate-key"
        );
        let client = Client::new("http://proxy.local/credpool?x=1", "k").expect("builds");
        assert_eq!(
            client.inner.release_url.as_str(),
            "http://proxy.local/credpool/api/internal/release-key"
        );
    }

    #[test]
    fn unusable_settings_are_refused() {
        assert!(config_error(Client::new("https://example.com", "k")).contains("TLS"));
        assert!(config_error(Client::new("not a url", "k")).contains("parse"));
        assert!(config_error(Client::new("ftp://example.com", "k")).contains("scheme"));
        assert!(config_error(Client::new("http://h", "")).contains("empty"));
        assert!(config_error(Client::new("http://h", "bad\nkey")).contains("header"));
        let builder = || Client::builder("http://h", "k");
        config_error(builder().renew_fraction(1.0).build());
        config_error(builder().renew_fraction(f64::NAN).build());
        config_error(builder().http_timeout(Duration::ZERO).build());
        config_error(
            builder()
                .retry(RetryPolicy {
                    max_retries: None,
                    max_elapsed: None,
                    ..RetryPolicy::default()
                })
                .build(),
        );
    }

    #[test]
    fn debug_hides_the_internal_key() {
        let key = "INTERNAL-KEY-that-must-not-show";
        let builder = Client::builder("http://h", key);
        assert!(!format!("{builder:?}").contains(key));
        let client = builder.build().expect("builds");
        assert!(!format!("{client:?}").contains(key));
        assert!(!format!("{:?}", client.inner.internal_key).contains(key));
    }
}
