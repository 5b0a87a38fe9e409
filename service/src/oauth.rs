//! OAuth credentials: an access token that expires, refreshed before it does by
//! exactly one writer per token generation, however many replicas run.
//!
//! What executors receive with a lease is `{"access_token", "expires_at"}`; the refresh token and
//! the client secret are sealed apart ([`Keyring::seal_oauth`]) and never leave the service.
//!
//! The single-writer rule lives in PostgreSQL ([`crate::store::oauth`]): a writer first takes
//! the refresh of one generation with a marker that expires (one `UPDATE` of the credential's
//! `oauth_credentials` row, decided on that locked row's newest version, in its own short
//! transaction), then calls the token endpoint with no transaction open, then writes the new
//! access token, the rotated refresh token and generation + 1 in one transaction that takes the
//! credential's locks in the lock order (`credpool_lock_credentials`) and re-reads the generation
//! and the marker: a writer whose marker was taken over writes nothing. A writer keeps its marker
//! alive (every third of its life) from the take until its result is written, however long the
//! call or the write's wait for the credential's locks takes, so a marker only expires under a
//! writer that has stopped: a second writer would present the refresh token the first call has
//! already rotated away.
//!
//! Failures while the token is valid are retried with exponential backoff and jitter (the
//! credential keeps serving); `invalid_grant` disables the credential until an operator PUTs a
//! new secret.

use std::sync::{Arc, Weak};
use std::time::Duration;

use backon::Retryable;
use serde::Deserialize;
use time::OffsetDateTime;

pub use crate::domain::oauth::{
    DEFAULT_REFRESH_BEFORE_SECONDS, MAX_REFRESH_BEFORE_SECONDS, OAuthInput, OAuthSpec,
};
use crate::domain::{InvalidValue, KeyId, ProviderName, Secret};
use crate::secrets::Keyring;
use crate::store::Db;
use crate::store::oauth::{self as store, Failure, RefreshTaken};

/// `value` of `field` is 1..=`max` characters, none of them a control character (NUL, newline,
/// escape, ...): what reaches the database and the token endpoint's form is text a person can
/// read, and PostgreSQL refuses a NUL in text (which was a 503).
fn printable(field: &'static str, value: &str, max: usize) -> Result<(), InvalidValue> {
    crate::domain::check_name(
        field,
        value,
        max,
        |c| !c.is_control(),
        "printable characters",
    )
}

/// Whether `url` may be a token endpoint: https, or http on a loopback host
/// ([`crate::domain::check_endpoint_url`]). The error names the rule, never more of the URL
/// than the operator sent.
pub fn check_token_url(url: &str) -> Result<url::Url, InvalidValue> {
    crate::domain::check_endpoint_url("oauth.token_url", url)
}

/// Whether `ip` is a public unicast address a token endpoint may have: not loopback, private
/// (RFC 1918, unique local `fc00::/7`), link-local (`169.254.0.0/16`, where cloud metadata
/// services answer, and `fe80::/10`), shared (`100.64.0.0/10`), unspecified, multicast, broadcast,
/// documentation or otherwise reserved; an IPv4-mapped IPv6 address is judged as its IPv4.
pub fn is_public(ip: std::net::IpAddr) -> bool {
    use std::net::IpAddr;
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            !(v4.is_private()
                || v4.is_loopback()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 192 && b == 0 && c == 0)
                || (a == 198 && (18..20).contains(&b))
                || a >= 240)
        }
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => is_public(IpAddr::V4(v4)),
            None => {
                let first = v6.segments()[0];
                !(v6.is_loopback()
                    || v6.is_unspecified()
                    || v6.is_multicast()
                    || v6.is_unique_local()
                    || v6.is_unicast_link_local()
                    || first == 0x2001 && v6.segments()[1] == 0x0db8
                    || first == 0)
            }
        },
    }
}

/// The refusal of a token URL that reaches a non-public address.
fn private_refused() -> InvalidValue {
    InvalidValue::new(
        "oauth.token_url",
        "an https token_url must not point at a private, loopback or link-local address (an operator allows it with --oauth-allow-private-token-urls)",
    )
}

/// The part of the private-address rule that needs no name resolution: an https token URL whose
/// host is an IP address that is not [`is_public`], or `localhost`, is refused unless
/// `allow_private`. (http is only ever allowed on loopback, by [`check_token_url`], for tests and
/// local token proxies.) Checked when a credential is stored and before every refresh.
pub fn check_token_url_host(url: &url::Url, allow_private: bool) -> Result<(), InvalidValue> {
    if allow_private || url.scheme() != "https" {
        return Ok(());
    }
    let public = match url.host() {
        Some(url::Host::Ipv4(ip)) => is_public(ip.into()),
        Some(url::Host::Ipv6(ip)) => is_public(ip.into()),
        Some(url::Host::Domain(name)) => {
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            name != "localhost" && !name.ends_with(".localhost")
        }
        None => false,
    };
    if public {
        Ok(())
    } else {
        Err(private_refused())
    }
}

/// [`check_token_url_host`], and for a host name the addresses it resolves to now: one that is
/// not [`is_public`] is refused unless `allow_private`. A name that does not resolve within
/// 2 s is let through: every refresh resolves it again and connects only to public addresses
/// ([`PublicResolver`]), which also holds against a name that changes its answer later.
pub async fn check_token_url_reach(url: &str, allow_private: bool) -> Result<(), InvalidValue> {
    let parsed = check_token_url(url)?;
    check_token_url_host(&parsed, allow_private)?;
    if allow_private || parsed.scheme() != "https" {
        return Ok(());
    }
    let (Some(url::Host::Domain(name)), Some(port)) =
        (parsed.host(), parsed.port_or_known_default())
    else {
        return Ok(());
    };
    let resolved = tokio::time::timeout(
        Duration::from_secs(2),
        tokio::net::lookup_host((name, port)),
    )
    .await;
    match resolved {
        Ok(Ok(addresses)) => {
            let addresses: Vec<_> = addresses.collect();
            if addresses.iter().any(|a| !is_public(a.ip())) {
                return Err(private_refused());
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// The refresher's name resolution: the system's (`getaddrinfo`), keeping only public addresses
/// ([`is_public`]) unless the operator allows private ones, or the name is `localhost` (reached
/// only by the http-on-loopback URLs [`check_token_url`] admits). A token endpoint whose name
/// resolves to nothing public fails to connect: that credential's refresh error.
#[derive(Clone)]
pub struct PublicResolver {
    inner: hyper_util::client::legacy::connect::dns::GaiResolver,
    allow_private: bool,
}

/// The error of a name that resolves only to addresses a token endpoint may not have.
const PRIVATE_ONLY: &str = "the name resolves only to private, loopback or link-local addresses";

impl tower_service::Service<hyper_util::client::legacy::connect::dns::Name> for PublicResolver {
    type Response = std::vec::IntoIter<std::net::SocketAddr>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, std::io::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), std::io::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, name: hyper_util::client::legacy::connect::dns::Name) -> Self::Future {
        let allow = self.allow_private || name.as_str().eq_ignore_ascii_case("localhost");
        let resolving = self.inner.call(name);
        Box::pin(async move {
            let kept: Vec<std::net::SocketAddr> = resolving
                .await?
                .filter(|address| allow || is_public(address.ip()))
                .collect();
            if kept.is_empty() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    PRIVATE_ONLY,
                ));
            }
            Ok(kept.into_iter())
        })
    }
}

impl OAuthInput {
    /// Checks the configuration and splits `secret` (`{"access_token", "refresh_token",
    /// "expires_at"}`) into what executors receive (`{"access_token", "expires_at"}`, returned
    /// as a [`Secret`]) and the sealed grant. Errors name the field, never its value.
    pub fn into_spec(
        self,
        key_id: &KeyId,
        secret: &Secret,
        keyring: &Keyring,
    ) -> Result<(OAuthSpec, Secret), InvalidValue> {
        check_token_url(&self.token_url)?;
        printable("oauth.client_id", &self.client_id, 512)?;
        if let Some(scope) = &self.scope {
            printable("oauth.scope", scope, 1024)?;
        }
        let refresh_before = self
            .refresh_before_seconds
            .unwrap_or(DEFAULT_REFRESH_BEFORE_SECONDS);
        if refresh_before > MAX_REFRESH_BEFORE_SECONDS {
            return Err(InvalidValue::new(
                "oauth.refresh_before_seconds",
                format!("must be an integer from 0 to {MAX_REFRESH_BEFORE_SECONDS}"),
            ));
        }
        let text = |field: &'static str| {
            secret
                .expose()
                .get(field)
                .and_then(serde_json::Value::as_str)
                .filter(|v| !v.is_empty())
                .ok_or_else(|| {
                    InvalidValue::new(
                        "secret",
                        "an OAuth credential's secret is {\"access_token\", \"refresh_token\", \"expires_at\"} (non-empty strings; expires_at in RFC 3339)",
                    )
                })
        };
        let access_token = text("access_token")?;
        let refresh_token = text("refresh_token")?;
        let expires_at = OffsetDateTime::parse(
            text("expires_at")?,
            &time::format_description::well_known::Rfc3339,
        )
        .map_err(|_| InvalidValue::new("secret", "expires_at must be an RFC 3339 timestamp"))?;
        if secret.expose().as_object().is_some_and(|o| o.len() != 3) {
            return Err(InvalidValue::new(
                "secret",
                "an OAuth credential's secret has exactly access_token, refresh_token and expires_at",
            ));
        }
        let grant = grant_secret(refresh_token, self.client_secret.as_deref());
        let lease_secret = lease_secret(access_token, expires_at);
        Ok((
            OAuthSpec {
                token_url: self.token_url,
                client_id: self.client_id,
                scope: self.scope,
                refresh_before_seconds: i32::try_from(refresh_before).unwrap_or(i32::MAX),
                sealed_grant: keyring.seal_oauth(key_id, &grant),
                token_expires_at: expires_at,
            },
            lease_secret,
        ))
    }
}

/// What executors receive with a lease of an OAuth credential.
fn lease_secret(access_token: &str, expires_at: OffsetDateTime) -> Secret {
    let expires_at = expires_at
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    Secret::parse(serde_json::json!({"access_token": access_token, "expires_at": expires_at}))
        .expect("a JSON object")
}

/// The sealed half: the refresh token and, when configured, the client secret.
fn grant_secret(refresh_token: &str, client_secret: Option<&str>) -> Secret {
    let mut grant = serde_json::json!({"refresh_token": refresh_token});
    if let Some(client_secret) = client_secret {
        grant["client_secret"] = client_secret.into();
    }
    Secret::parse(grant).expect("a JSON object")
}

/// How the refresher runs. Durations, not counts.
#[derive(Debug, Clone)]
pub struct OAuthSettings {
    /// How often a service looks for access tokens due for a refresh (default 1 s).
    pub check_every: Duration,
    /// The whole token endpoint call, connect included (default 10 s). Must be shorter than
    /// `claim_for`.
    pub call_timeout: Duration,
    /// How long a writer's "refresh in progress" marker holds others off (default 30 s): a
    /// writer that stopped mid-call is replaced after this.
    pub claim_for: Duration,
    /// The first retry's delay after a failed refresh (default 1 s); doubles per failure.
    pub backoff_first: Duration,
    /// The longest retry delay (default 60 s).
    pub backoff_max: Duration,
    /// Whether an https token URL may reach a private, loopback or link-local address (default
    /// false: `--oauth-allow-private-token-urls`).
    pub allow_private_token_urls: bool,
}

impl Default for OAuthSettings {
    fn default() -> Self {
        Self {
            check_every: Duration::from_secs(1),
            call_timeout: Duration::from_secs(10),
            claim_for: Duration::from_secs(30),
            backoff_first: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            allow_private_token_urls: false,
        }
    }
}

/// The delay before the retry that follows `failures` failed attempts in a row (1 or more):
/// `first * 2^(failures-1)`, at most `max`, scaled by `jitter` in [0.5, 1.0) (full jitter would
/// allow an immediate retry; half keeps a floor). Pure.
pub fn backoff(failures: u32, first: Duration, max: Duration, jitter: f64) -> Duration {
    let exponent = failures.saturating_sub(1).min(30);
    let delay = first.saturating_mul(1 << exponent).min(max);
    delay.mul_f64(jitter.clamp(0.5, 1.0))
}

/// Why a token endpoint call did not give a new access token. The text never carries a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RefreshError {
    /// The endpoint rejected the refresh token (`{"error": "invalid_grant"}`): retrying cannot
    /// help; an operator must authorize again.
    InvalidGrant(String),
    /// Anything else (timeout, connection, 5xx, another error code, an answer without an access
    /// token): retried with backoff.
    Failed(String),
}

/// How often a refresh's marker of `claim_for` is extended while the refresh runs: a third of
/// its life, so that a beat whose statement waits a while still lands before the marker lapses.
fn beat(claim_for: Duration) -> Duration {
    claim_for / 3
}

/// A refresh's marker kept alive while the refresh runs: a task that extends it every
/// [`beat`] ([`store::keep_refresh`]) until it is dropped or the marker is no longer this
/// writer's.
struct MarkerKept(tokio::task::JoinHandle<()>);

impl MarkerKept {
    fn start(
        db: Db,
        key_id: KeyId,
        provider: ProviderName,
        generation: i64,
        holder: uuid::Uuid,
        claim_for: Duration,
    ) -> Self {
        Self(tokio::spawn(async move {
            loop {
                tokio::time::sleep(beat(claim_for)).await;
                match store::keep_refresh(&db, &key_id, &provider, generation, holder, claim_for)
                    .await
                {
                    Ok(true) => {}
                    Ok(false) => return,
                    // (the next beat tries again; a marker that lapses meanwhile is taken over,
                    // and this writer's write then finds it is not its own and writes nothing)
                    Err(error) => {
                        tracing::warn!(error = %error, "cannot keep the refresh's marker");
                    }
                }
            }
        }))
    }
}

impl Drop for MarkerKept {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A token endpoint's successful answer (RFC 6749 section 5.1).
#[derive(Deserialize)]
struct TokenAnswer {
    access_token: String,
    /// Seconds; RFC 6749 only recommends it. Absent: 3600.
    expires_in: Option<u64>,
    /// Present when the endpoint rotates refresh tokens.
    refresh_token: Option<String>,
}

/// A token endpoint's error answer (RFC 6749 section 5.2).
#[derive(Deserialize)]
struct TokenError {
    error: String,
}

/// The access token's lifetime when the answer has no `expires_in`, in seconds.
const DEFAULT_EXPIRES_IN: u64 = 3600;

/// The longest access token lifetime taken from a token endpoint, in seconds (ten years): an
/// `expires_in` beyond it is refused as the credential's refresh error. (A value near `u64::MAX`
/// overflowed the expiry's timestamp and panicked the refresher, which then never ran again.)
pub const MAX_EXPIRES_IN_SECONDS: u64 = 10 * 365 * 86_400;

/// A token answer's lifetime in seconds: its `expires_in` (absent: [`DEFAULT_EXPIRES_IN`]), 1..=
/// [`MAX_EXPIRES_IN_SECONDS`]; anything else is the refresh's error, retried with backoff. Pure.
pub fn expires_in(given: Option<u64>) -> Result<i64, RefreshError> {
    match given.unwrap_or(DEFAULT_EXPIRES_IN) {
        seconds @ 1..=MAX_EXPIRES_IN_SECONDS => Ok(seconds as i64),
        seconds => Err(RefreshError::Failed(format!(
            "the token endpoint answered an expires_in of {seconds} s; credpool takes 1 to {MAX_EXPIRES_IN_SECONDS} s"
        ))),
    }
}

/// The largest token endpoint answer read, in bytes.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

type HttpsClient = OutboundClient<PublicResolver>;

/// The service's client for the endpoints it calls (OAuth token endpoints, relay upstreams):
/// HTTP/1 through hyper, TLS through rustls with the ring provider and the webpki roots, names
/// resolved by `R`. Request bodies are whole (`Full`).
pub type OutboundClient<R> = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector<R>>,
    http_body_util::Full<bytes::Bytes>,
>;

/// An [`OutboundClient`] resolving names with `resolver`: https for any host, http as well (the
/// callers admit http on loopback hosts only: [`crate::domain::check_endpoint_url`]). It follows
/// no redirect (hyper's client never does), so an endpoint cannot send a call elsewhere.
pub fn https_client<R>(resolver: R) -> OutboundClient<R>
where
    R: tower_service::Service<
            hyper_util::client::legacy::connect::dns::Name,
            Response: Iterator<Item = std::net::SocketAddr>,
            Error: Into<Box<dyn std::error::Error + Send + Sync>>,
            Future: Send,
        > + Clone
        + Send
        + Sync
        + 'static,
{
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("ring supports the default protocol versions")
    .with_root_certificates(rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    })
    .with_no_client_auth();
    let mut resolving =
        hyper_util::client::legacy::connect::HttpConnector::new_with_resolver(resolver);
    resolving.enforce_http(false);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(resolving);
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(connector)
}

/// The refresher of one service process: finds tokens due, takes their refresh in PostgreSQL,
/// calls the token endpoint, and writes the answer.
pub struct Refresher {
    db: Db,
    keyring: Arc<Keyring>,
    http: HttpsClient,
    settings: OAuthSettings,
    /// This process's name on the markers it takes.
    holder: uuid::Uuid,
}

impl std::fmt::Debug for Refresher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Refresher")
            .field("holder", &self.holder)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Refresher {
    /// A refresher over `db`, opening grants with `keyring`.
    pub fn new(db: Db, keyring: Arc<Keyring>, settings: OAuthSettings) -> Self {
        // names resolved to public addresses only, unless the operator allows private ones
        let http = https_client(PublicResolver {
            inner: hyper_util::client::legacy::connect::dns::GaiResolver::new(),
            allow_private: settings.allow_private_token_urls,
        });
        Self {
            db,
            keyring,
            http,
            settings,
            holder: uuid::Uuid::new_v4(),
        }
    }

    /// Runs [`Refresher::run_once`] every `check_every` until `alive` can no longer be upgraded
    /// (the application it belongs to was dropped), as task `oauth_refresher` of `supervisor`
    /// (made again should it panic).
    pub fn spawn<T: Send + Sync + 'static>(
        self,
        alive: Weak<T>,
        supervisor: &crate::background::Supervisor,
    ) -> tokio::task::JoinHandle<()> {
        let refresher = Arc::new(self);
        supervisor.spawn("oauth_refresher", move || {
            let (refresher, alive) = (refresher.clone(), alive.clone());
            async move {
                let mut ticker = tokio::time::interval(refresher.settings.check_every);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticker.tick().await;
                    if alive.upgrade().is_none() {
                        return;
                    }
                    if let Err(error) = refresher.run_once().await {
                        tracing::warn!(error = %error, "OAuth refresh pass failed");
                    }
                }
            }
        })
    }

    /// One pass: every credential whose access token is due (within its `refresh_before_seconds`
    /// of expiring, not disabled, not in backoff, nobody else refreshing it) is refreshed, one
    /// after the other. Returns how many new access tokens this pass wrote. Errors: the store's.
    pub async fn run_once(&self) -> Result<usize, sqlx::Error> {
        let mut written = 0;
        for (key_id, provider, generation) in store::due(&self.db).await? {
            if self.refresh(&key_id, &provider, generation).await? {
                written += 1;
            }
        }
        Ok(written)
    }

    /// Refreshes `key_id`'s token of `generation` if this process takes its refresh. Returns
    /// whether it wrote a new access token.
    #[tracing::instrument(skip(self), fields(generation))]
    async fn refresh(
        &self,
        key_id: &KeyId,
        provider: &ProviderName,
        generation: i64,
    ) -> Result<bool, sqlx::Error> {
        let claim_for = self.settings.claim_for;
        let mut sent = tokio::time::Instant::now();
        let Some(taken) = store::take_refresh(
            &self.db,
            key_id,
            provider,
            generation,
            self.holder,
            claim_for,
        )
        .await?
        else {
            return Ok(false);
        };
        // The marker is dated at its statement's start, which came after `sent`: it holds at
        // least until `sent + claim_for`. A take (or keep) that waited for the row's lock comes
        // back with less of that left, or none: another writer may be taking the generation
        // over already. So the marker is kept again, from a statement sent now, until one comes
        // back within a beat (`MarkerKept`'s first beat comes one beat later, and the call runs
        // under the two thirds left: `serve` makes `claim_for` at least three call timeouts);
        // one that cannot keep it calls nothing.
        while sent.elapsed() >= beat(claim_for) {
            sent = tokio::time::Instant::now();
            if !store::keep_refresh(
                &self.db,
                key_id,
                provider,
                taken.generation,
                self.holder,
                claim_for,
            )
            .await?
            {
                tracing::debug!("the refresh's marker lapsed while its take waited; given up");
                return Ok(false);
            }
        }
        let _kept = MarkerKept::start(
            self.db.clone(),
            key_id.clone(),
            provider.clone(),
            taken.generation,
            self.holder,
            claim_for,
        );
        let grant = match self.keyring.open_oauth(key_id, &taken.sealed_grant) {
            Ok(grant) => grant,
            Err(error) => {
                let failure = Failure::Retry {
                    error: format!("the sealed grant does not open: {error}"),
                    after: self.settings.backoff_max,
                };
                store::write_failure(&self.db, key_id, &taken, self.holder, &failure).await?;
                return Ok(false);
            }
        };
        match self.call(&taken, &grant).await {
            Ok((answer, expires_in)) => {
                // within MAX_EXPIRES_IN_SECONDS (`call` refuses more): this cannot overflow
                let expires_at = taken.started_at + time::Duration::seconds(expires_in);
                let refresh_token = answer
                    .refresh_token
                    .as_deref()
                    .or_else(|| grant.expose()["refresh_token"].as_str())
                    .unwrap_or_default();
                let client_secret = grant.expose()["client_secret"].as_str();
                let new_grant = grant_secret(refresh_token, client_secret);
                let sealed_secret = self
                    .keyring
                    .seal(key_id, &lease_secret(&answer.access_token, expires_at));
                let sealed_grant = self.keyring.seal_oauth(key_id, &new_grant);
                // The endpoint may have rotated the refresh token: the answer exists only here
                // now, so a failed write is retried while this process's marker holds (the
                // write re-checks the marker, so a retry after a takeover writes nothing).
                let written = (|| {
                    store::write_token(
                        &self.db,
                        key_id,
                        &taken,
                        self.holder,
                        &sealed_secret,
                        &sealed_grant,
                        expires_at,
                    )
                })
                .retry(self.write_retries())
                .notify(|error, after| {
                    tracing::warn!(error = %error, retry_in_seconds = after.as_secs_f64(), "writing a refreshed token failed; retrying");
                })
                .await?;
                crate::telemetry::oauth_refresh(if written { "refreshed" } else { "superseded" });
                if written {
                    tracing::info!(generation = taken.generation + 1, "access token refreshed");
                }
                Ok(written)
            }
            Err(RefreshError::InvalidGrant(error)) => {
                crate::telemetry::oauth_refresh("invalid_grant");
                tracing::warn!(error = %error, "refresh token rejected; credential disabled");
                store::write_failure(
                    &self.db,
                    key_id,
                    &taken,
                    self.holder,
                    &Failure::InvalidGrant { error },
                )
                .await?;
                Ok(false)
            }
            Err(RefreshError::Failed(error)) => {
                crate::telemetry::oauth_refresh("failed");
                let failures = u32::try_from(taken.failed_attempts + 1).unwrap_or(u32::MAX);
                let after = backoff(
                    failures,
                    self.settings.backoff_first,
                    self.settings.backoff_max,
                    rand::random_range(0.5..1.0),
                );
                tracing::info!(error = %error, retry_in_seconds = after.as_secs_f64(), "token refresh failed");
                store::write_failure(
                    &self.db,
                    key_id,
                    &taken,
                    self.holder,
                    &Failure::Retry { error, after },
                )
                .await?;
                Ok(false)
            }
        }
    }

    /// Retries of a refreshed token's write: 100 ms doubling to 2 s, jittered, for as long as the
    /// marker outlasts the call (`claim_for - call_timeout`), so that no other writer can have
    /// taken the generation over while this one still tries.
    fn write_retries(&self) -> backon::ExponentialBuilder {
        backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(2))
            .with_jitter()
            .without_max_times()
            .with_total_delay(Some(
                self.settings
                    .claim_for
                    .saturating_sub(self.settings.call_timeout),
            ))
    }

    /// The refresh request (RFC 6749 section 6), form-encoded, client authentication in the body.
    /// Returns the answer and its lifetime in seconds (1..=[`MAX_EXPIRES_IN_SECONDS`]).
    async fn call(
        &self,
        taken: &RefreshTaken,
        grant: &Secret,
    ) -> Result<(TokenAnswer, i64), RefreshError> {
        let mut form: Vec<(&str, &str)> = vec![
            ("grant_type", "refresh_token"),
            (
                "refresh_token",
                grant.expose()["refresh_token"].as_str().unwrap_or_default(),
            ),
            ("client_id", &taken.client_id),
        ];
        if let Some(client_secret) = grant.expose()["client_secret"].as_str() {
            form.push(("client_secret", client_secret));
        }
        if let Some(scope) = &taken.scope {
            form.push(("scope", scope));
        }
        let body = serde_urlencoded::to_string(&form)
            .map_err(|_| RefreshError::Failed("the refresh form did not encode".to_owned()))?;
        // the rule in force now, not only the one of the day it was stored
        check_token_url(&taken.token_url)
            .and_then(|url| check_token_url_host(&url, self.settings.allow_private_token_urls))
            .map_err(|refused| RefreshError::Failed(refused.to_string()))?;
        let request = http::Request::post(taken.token_url.as_str())
            .header(
                http::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .header(http::header::ACCEPT, "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .map_err(|_| {
                RefreshError::Failed("the token_url is not a valid request URI".to_owned())
            })?;
        let exchange = async {
            let response = self.http.request(request).await.map_err(|error| {
                // the only cause quoted: ours (never a URL or a body)
                let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&error);
                while let Some(e) = cause {
                    if e.to_string() == PRIVATE_ONLY {
                        return RefreshError::Failed(format!(
                            "the token endpoint could not be reached: {PRIVATE_ONLY} (--oauth-allow-private-token-urls)"
                        ));
                    }
                    cause = e.source();
                }
                RefreshError::Failed("the token endpoint could not be reached".to_owned())
            })?;
            let status = response.status();
            let body = http_body_util::BodyExt::collect(http_body_util::Limited::new(
                response.into_body(),
                MAX_ANSWER_BYTES,
            ))
            .await
            .map_err(|_| {
                RefreshError::Failed(format!(
                    "the token endpoint's answer ({status}) was cut off or too large"
                ))
            })?
            .to_bytes();
            Ok::<_, RefreshError>((status, body))
        };
        let (status, body) = tokio::time::timeout(self.settings.call_timeout, exchange)
            .await
            .map_err(|_| {
                RefreshError::Failed("the token endpoint did not answer in time".to_owned())
            })??;
        if status.is_success() {
            let answer: TokenAnswer = serde_json::from_slice(&body).map_err(|_| {
                RefreshError::Failed(
                    "the token endpoint's answer has no access_token (not RFC 6749 JSON)"
                        .to_owned(),
                )
            })?;
            if answer.access_token.is_empty() {
                return Err(RefreshError::Failed(
                    "the token endpoint answered an empty access_token".to_owned(),
                ));
            }
            let expires_in = expires_in(answer.expires_in)?;
            return Ok((answer, expires_in));
        }
        // only the standard error code is quoted (a closed set of short words), never the body
        let code = serde_json::from_slice::<TokenError>(&body)
            .ok()
            .map(|e| e.error)
            .filter(|c| c.len() <= 64 && c.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'));
        match code.as_deref() {
            Some("invalid_grant") => Err(RefreshError::InvalidGrant(format!(
                "invalid_grant: the token endpoint rejected the refresh token ({status})"
            ))),
            Some(code) => Err(RefreshError::Failed(format!(
                "the token endpoint answered {status} {code}"
            ))),
            None => Err(RefreshError::Failed(format!(
                "the token endpoint answered {status}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_urls_are_https_or_loopback_http() {
        assert!(check_token_url("https://auth.example.com/oauth/token").is_ok());
        assert!(check_token_url("http://127.0.0.1:8080/token").is_ok());
        assert!(check_token_url("http://[::1]:8080/token").is_ok());
        assert!(check_token_url("http://localhost/token").is_ok());
        assert!(check_token_url("http://auth.example.com/token").is_err());
        assert!(check_token_url("http://10.0.0.1/token").is_err());
        assert!(check_token_url("ftp://127.0.0.1/token").is_err());
        assert!(check_token_url("https://user:pw@auth.example.com/token").is_err());
        assert!(check_token_url("not a url").is_err());
    }

    #[test]
    fn an_expires_in_that_cannot_be_a_timestamp_is_the_refresh_error() {
        assert_eq!(expires_in(None), Ok(3600));
        assert_eq!(expires_in(Some(1)), Ok(1));
        assert_eq!(
            expires_in(Some(MAX_EXPIRES_IN_SECONDS)),
            Ok(MAX_EXPIRES_IN_SECONDS as i64)
        );
        for seconds in [
            0,
            MAX_EXPIRES_IN_SECONDS + 1,
            1_000_000_000_000_000,
            u64::MAX,
        ] {
            match expires_in(Some(seconds)) {
                Err(RefreshError::Failed(error)) => {
                    assert!(error.contains("expires_in"), "{error}")
                }
                other => panic!("{seconds}: {other:?}"),
            }
        }
        // the largest accepted lifetime is a timestamp far from overflowing
        let now = OffsetDateTime::now_utc();
        assert!(
            now.checked_add(time::Duration::seconds(MAX_EXPIRES_IN_SECONDS as i64))
                .is_some()
        );
    }

    #[test]
    fn private_loopback_and_link_local_addresses_are_not_public() {
        for private in [
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "127.0.0.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "255.255.255.255",
            "224.0.0.1",
            "192.0.2.1",
            "240.0.0.1",
            "::1",
            "::",
            "fc00::1",
            "fd12::1",
            "fe80::1",
            "::ffff:10.0.0.1",
            "::ffff:127.0.0.1",
            "2001:db8::1",
        ] {
            assert!(!is_public(private.parse().unwrap()), "{private}");
        }
        for public in [
            "1.1.1.1",
            "93.184.216.34",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
        ] {
            assert!(is_public(public.parse().unwrap()), "{public}");
        }
    }

    #[test]
    fn an_https_token_url_on_a_private_host_is_refused_unless_allowed() {
        let url = |u: &str| check_token_url(u).unwrap();
        for refused in [
            "https://10.0.0.5/token",
            "https://169.254.169.254/latest/meta-data",
            "https://[::1]/token",
            "https://[fe80::1]/token",
            "https://localhost/token",
            "https://auth.localhost/token",
        ] {
            assert!(
                check_token_url_host(&url(refused), false).is_err(),
                "{refused}"
            );
            assert!(
                check_token_url_host(&url(refused), true).is_ok(),
                "{refused}"
            );
        }
        for allowed in [
            "https://auth.example.com/token",
            "https://1.1.1.1/token",
            // http is loopback only, and loopback http stays allowed (tests, local proxies)
            "http://127.0.0.1:8080/token",
            "http://localhost/token",
        ] {
            assert!(
                check_token_url_host(&url(allowed), false).is_ok(),
                "{allowed}"
            );
        }
        // and control characters never pass
        assert!(check_token_url("https://auth.example.com/to\u{0}ken").is_err());
        assert!(check_token_url("https://auth.example.com/to\nken").is_err());
    }

    #[tokio::test]
    async fn the_refreshers_resolver_keeps_public_addresses_only_unless_allowed() {
        use hyper_util::client::legacy::connect::dns::{GaiResolver, Name};
        use std::str::FromStr;
        use tower_service::Service;
        let resolve = |name: &str, allow_private: bool| {
            let mut resolver = PublicResolver {
                inner: GaiResolver::new(),
                allow_private,
            };
            resolver.call(Name::from_str(name).unwrap())
        };
        // a name that resolves to loopback (a numeric name resolves to itself)
        let refused = resolve("127.0.0.1", false).await.unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::PermissionDenied);
        assert_eq!(refused.to_string(), PRIVATE_ONLY);
        let refused = resolve("169.254.169.254", false).await.unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::PermissionDenied);
        let allowed: Vec<_> = resolve("127.0.0.1", true).await.unwrap().collect();
        assert!(allowed.iter().all(|a| a.ip().is_loopback()) && !allowed.is_empty());
        // localhost: reached only by the loopback http URLs check_token_url admits
        assert!(resolve("localhost", false).await.unwrap().next().is_some());
        let public: Vec<_> = resolve("1.1.1.1", false).await.unwrap().collect();
        assert_eq!(public.len(), 1);
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_keeps_a_floor() {
        let (first, max) = (Duration::from_secs(1), Duration::from_secs(60));
        assert_eq!(backoff(1, first, max, 1.0), Duration::from_secs(1));
        assert_eq!(backoff(3, first, max, 1.0), Duration::from_secs(4));
        assert_eq!(backoff(30, first, max, 1.0), Duration::from_secs(60));
        assert_eq!(backoff(3, first, max, 0.0), Duration::from_secs(2));
        assert_eq!(backoff(u32::MAX, first, max, 0.75), Duration::from_secs(45));
    }

    #[test]
    fn the_secret_splits_into_the_lease_half_and_the_sealed_grant() {
        let keyring = Keyring::new(crate::secrets::MasterKey::generate(), vec![]);
        let key_id = KeyId::parse("k").unwrap();
        let input: OAuthInput = serde_json::from_value(serde_json::json!({
            "token_url": "https://auth.example.com/token", "client_id": "c",
            "client_secret": "cs-secret"}))
        .unwrap();
        let secret = Secret::parse(serde_json::json!({"access_token": "at-1",
            "refresh_token": "rt-1", "expires_at": "2030-01-01T00:00:00Z"}))
        .unwrap();
        let (spec, lease) = input.into_spec(&key_id, &secret, &keyring).unwrap();
        assert_eq!(
            lease.expose(),
            &serde_json::json!({"access_token": "at-1", "expires_at": "2030-01-01T00:00:00Z"})
        );
        assert_eq!(spec.refresh_before_seconds, 300);
        let grant = keyring.open_oauth(&key_id, &spec.sealed_grant).unwrap();
        assert_eq!(
            grant.expose(),
            &serde_json::json!({"refresh_token": "rt-1", "client_secret": "cs-secret"})
        );
        assert!(!format!("{spec:?}").contains("rt-1"));
    }
}
