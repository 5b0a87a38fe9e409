//! The HTTP surface: [`app`] builds the router from one module per audience (executors,
//! operators); [`ApiError`] is the one error type of every route, rendered as
//! `{"error":{"code","message"}}` with a stable snake_case code.

mod admin;
mod dashboard;
mod executor;
mod ops;
pub mod relay;
pub mod server;
mod tenants;

pub use executor::parse_allocate;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use subtle::ConstantTimeEq;

pub use credpool_protocol::ErrorCode;

use crate::allocator::{AllocateError, Allocator};
use crate::domain::InvalidValue;

/// Largest request body accepted, in bytes; larger bodies get 413 `payload_too_large`.
pub const MAX_BODY_BYTES: usize = 256 * 1024;

/// The service's own API keys: executors present the internal key in `X-Internal-Key`, operators
/// the admin key in `X-Admin-Key`. `Debug` never shows them.
#[derive(Clone)]
pub struct ApiKeys {
    internal: Arc<str>,
    admin: Arc<str>,
}

/// The shortest internal or admin key accepted, in characters: a key short enough to guess (or to
/// have been typed as a placeholder: `secret`, `changeme`) is refused at start-up. Generated keys
/// are 64 hex digits; `openssl rand -hex 32` makes one.
pub const MIN_KEY_CHARS: usize = 16;

impl ApiKeys {
    /// Each key at least [`MIN_KEY_CHARS`] characters, without control characters; and the two
    /// must differ, so that one can never stand in for the other.
    pub fn new(internal: String, admin: String) -> Result<Self, &'static str> {
        for key in [&internal, &admin] {
            if key.chars().count() < MIN_KEY_CHARS {
                return Err(
                    "the internal and admin keys must be at least 16 characters (generate one with `openssl rand -hex 32`)",
                );
            }
            if key.chars().any(char::is_control) {
                return Err("the internal and admin keys must not hold control characters");
            }
        }
        if internal == admin {
            return Err("the internal and admin keys must differ");
        }
        Ok(Self {
            internal: internal.into(),
            admin: admin.into(),
        })
    }
}

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKeys(<redacted>)")
    }
}

/// Everything a handler needs ([`Shared`]), behind one reference count: axum clones the state
/// for every request and every extractor and middleware that asks for it, so a clone must not
/// copy or count each part.
#[derive(Debug, Clone)]
pub struct AppState(Arc<Shared>);

impl AppState {
    /// The state every route reads.
    pub fn new(shared: Shared) -> Self {
        Self(Arc::new(shared))
    }

    /// A handle that stops upgrading once every clone of this state is dropped: background
    /// tasks (the OAuth refresher) end with the application.
    pub fn downgrade(&self) -> std::sync::Weak<Shared> {
        Arc::downgrade(&self.0)
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The parts of [`AppState`].
#[derive(Debug)]
pub struct Shared {
    /// Grants leases.
    pub allocator: Allocator,
    /// The database, for the operator routes and readiness.
    pub db: crate::store::Db,
    /// The service's API keys.
    pub keys: ApiKeys,
    /// Longest lease (and renewal) an executor may ask for, in seconds.
    pub max_lease_seconds: u32,
    /// How outcome reports change health.
    pub health: crate::domain::health::HealthPolicy,
    /// Seals and opens credential secrets.
    pub keyring: Arc<crate::secrets::Keyring>,
    /// The longest a request may take before it is answered 503 (a waiting allocate: plus its
    /// wait).
    pub request_timeout: Duration,
    /// The longest an allocate may wait for a slot (`wait_ms` is capped to it).
    pub max_wait: Duration,
    /// Set when the service starts to shut down.
    pub shutting_down: ShuttingDown,
    /// The background tasks' supervisor: `/readyz` fails while one of them is down.
    pub background: crate::background::Supervisor,
    /// Whether an OAuth credential's https token URL may reach a private, loopback or link-local
    /// address (`--oauth-allow-private-token-urls`).
    pub allow_private_token_urls: bool,
    /// The client relay calls go out through (`/relay/...`).
    pub relay: relay::RelayClient,
}

/// Whether the service has begun to shut down (SIGINT/SIGTERM; [`crate::startup`]): from then on
/// `/readyz` answers 503 `shutting_down`, so that load balancers and Kubernetes stop routing to
/// this process, while every other route is served as before until the listener closes, and
/// HTTP/1 responses carry `Connection: close` so that clients move their keep-alive connections
/// elsewhere before then. Cheap to clone; every clone is the same flag.
#[derive(Debug, Clone, Default)]
pub struct ShuttingDown(Arc<std::sync::atomic::AtomicBool>);

impl ShuttingDown {
    /// Marks the service as shutting down (for good).
    pub fn begin(&self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether [`ShuttingDown::begin`] was called.
    pub fn is_set(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The OpenAPI document of every route, generated from the handlers' annotations.
pub fn openapi() -> utoipa::openapi::OpenApi {
    routes().split_for_parts().1
}

#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "credpool",
        description = "Leases upstream credentials to executors under per-credential concurrency limits. Executors authenticate with X-Internal-Key, operators with X-Admin-Key.",
    ),
    components(schemas(ErrorBody)),
    modifiers(&SecuritySchemes),
    tags(
        (name = "executor", description = "Allocate, renew and release leases (X-Internal-Key)"),
        (name = "operator", description = "Manage credentials and leases (X-Admin-Key)"),
        (name = "operations", description = "Health, readiness, metrics and this document (no key)"),
    )
)]
struct ApiDoc;

/// The two API keys, as OpenAPI security schemes.
struct SecuritySchemes;

impl utoipa::Modify for SecuritySchemes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{ApiKey, ApiKeyValue, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "internal_key",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "X-Internal-Key",
                "the executor key (CREDPOOL_INTERNAL_KEY)",
            ))),
        );
        components.add_security_scheme(
            "admin_key",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "X-Admin-Key",
                "the operator key (CREDPOOL_ADMIN_KEY); the executor key gets 403",
            ))),
        );
    }
}

fn routes() -> utoipa_axum::router::OpenApiRouter<AppState> {
    use utoipa::OpenApi;
    utoipa_axum::router::OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(executor::routes())
        .merge(admin::routes())
        .merge(tenants::routes())
        .merge(ops::routes())
        .merge(relay::routes())
}

/// The whole router: executor routes under `/api/internal`, operator routes under `/api/admin`,
/// the operator dashboard under `/dashboard`, `/livez`, `/readyz`, `/healthz`, `/metrics` and
/// `/openapi.json`, and JSON errors for unknown routes and
/// methods. Every request gets an id (`X-Request-Id`, taken from the request when
/// [`request_id_is_safe`], else generated; echoed in the response and on every log line of the
/// request), the caller's W3C trace context on its
/// span when it sent a valid `traceparent`, a latency sample, and an answer within
/// `request_timeout` (else 503).
pub fn app(state: AppState) -> Router {
    let (router, mut api) = routes().split_for_parts();
    ops::document_openapi_route(&mut api);
    let api = Arc::new(api);
    let request_id = axum::http::HeaderName::from_static("x-request-id");
    router
        .route(
            "/openapi.json",
            axum::routing::get(move || {
                let api = api.clone();
                async move { Json(api.as_ref().clone()) }
            }),
        )
        .merge(dashboard::routes())
        .merge(relay::route())
        .fallback(|| async { ApiError::RouteNotFound })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(state.clone(), observe))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(|_panic| {
            ApiError::Internal.into_response()
        }))
        .layer(
            tower_http::trace::TraceLayer::new_for_http()
                .make_span_with(request_span)
                .on_failure(failure_log(state.shutting_down.clone())),
        )
        .layer(tower_http::request_id::PropagateRequestIdLayer::new(
            request_id.clone(),
        ))
        .layer(tower_http::request_id::SetRequestIdLayer::new(
            request_id,
            tower_http::request_id::MakeRequestUuid,
        ))
        // before all of the above: a client's id that is not safe to echo and log is replaced
        .layer(axum::middleware::map_request(drop_unsafe_request_id))
        .with_state(state)
}

/// The longest `X-Request-Id` kept from a client, in characters.
pub const MAX_REQUEST_ID_CHARS: usize = 128;

/// Whether a client's `X-Request-Id` is kept (echoed in the response and written on every log
/// line of the request): 1..=[`MAX_REQUEST_ID_CHARS`] characters from `A-Z a-z 0-9 . _ : - + / =`
/// (UUIDs, hex and base64 trace ids fit). Anything else (60 KB of it, or a value crafted to forge
/// log text) is replaced by a generated UUID.
pub fn request_id_is_safe(value: &[u8]) -> bool {
    (1..=MAX_REQUEST_ID_CHARS).contains(&value.len())
        && value
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-+/=".contains(b))
}

/// Removes a client's `X-Request-Id` that [`request_id_is_safe`] refuses, so that
/// `SetRequestIdLayer` generates one instead.
async fn drop_unsafe_request_id(mut request: Request) -> Request {
    let keep = match request
        .headers()
        .get_all("x-request-id")
        .iter()
        .collect::<Vec<_>>()[..]
    {
        [] => true,
        [one] => request_id_is_safe(one.as_bytes()),
        // two ids: neither is the request's
        _ => false,
    };
    if !keep {
        request.headers_mut().remove("x-request-id");
    }
    request
}

/// The span of one request, on every log line it writes: method, path, request id, and the
/// caller's trace (`trace_id`, `parent_span_id`) when it sent a valid W3C `traceparent` (a
/// malformed one is ignored), so that a gateway's trace continues through credpool's logs.
fn request_span(request: &Request) -> tracing::Span {
    let id = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let span = tracing::info_span!(
        "request",
        method = %request.method(),
        uri = %request.uri().path(),
        request_id = %id,
        trace_id = tracing::field::Empty,
        parent_span_id = tracing::field::Empty,
    );
    if let Some(parent) = crate::telemetry::trace_parent(request.headers()) {
        span.record("trace_id", parent.trace_id.as_str());
        span.record("parent_span_id", parent.parent_span_id.as_str());
    }
    span
}

/// How a 5xx response is logged: as an error (tower-http's default), except while the service
/// shuts down, when `/readyz` answers 503 `shutting_down` on purpose to every probe: then at
/// debug level, so that a routine rolling update writes no error lines. (Store failures and
/// panics are logged where they happen, at error level, either way.)
fn failure_log(
    shutting_down: ShuttingDown,
) -> impl Fn(tower_http::classify::ServerErrorsFailureClass, Duration, &tracing::Span) + Clone {
    move |class, latency, _span| {
        let latency_ms = latency.as_millis() as u64;
        if shutting_down.is_set() {
            tracing::debug!(classification = %class, latency_ms, "response failed");
        } else {
            tracing::error!(classification = %class, latency_ms, "response failed");
        }
    }
}

/// What an allocation ended as, attached to its response for [`observe`] to count.
#[derive(Debug, Clone)]
pub(crate) struct AllocationOutcome {
    provider: String,
    pool: String,
    served_pool: String,
    /// The caller's tenant, as the store knows it (a configured tenant: a bounded label); empty
    /// when the key was refused.
    tenant: String,
    result: &'static str,
}

/// Times every request, answers 503 when it takes longer than the request timeout, counts
/// allocations by result (also those refused before the handler ran: bad requests, bad keys), and
/// while the service shuts down asks HTTP/1 clients to close the connection after the response.
async fn observe(
    axum::extract::State(state): axum::extract::State<AppState>,
    matched: Option<axum::extract::MatchedPath>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let started = std::time::Instant::now();
    let route = matched
        .map(|m| m.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".into());
    // allocate bounds itself (its wait comes on top of the request timeout)
    let http1 = request.version() <= axum::http::Version::HTTP_11;
    let timeout = if route == executor::ALLOCATE_ROUTE {
        state.request_timeout + state.max_wait
    } else if route == relay::ROUTE {
        // bounded by its own wait and its upstream's timeout_seconds
        Duration::MAX
    } else {
        state.request_timeout
    };
    let mut response = match tokio::time::timeout(timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            tracing::error!(route = %route, timeout_ms = state.request_timeout.as_millis() as u64, "request timed out");
            ApiError::Timeout.into_response()
        }
    };
    if http1 && state.shutting_down.is_set() {
        // the next request opens a new connection, which the load balancer sends elsewhere
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    let status = response.status();
    crate::telemetry::request(route.clone(), status.as_u16(), started.elapsed());
    if route == executor::ALLOCATE_ROUTE {
        match response.extensions().get::<AllocationOutcome>() {
            Some(o) => crate::telemetry::allocation(
                &o.provider,
                &o.pool,
                &o.served_pool,
                &o.tenant,
                o.result,
            ),
            None => {
                let result = match status {
                    StatusCode::UNAUTHORIZED => "unauthorized",
                    StatusCode::SERVICE_UNAVAILABLE => "store_unavailable",
                    s if s.is_server_error() => "internal_error",
                    _ => "bad_request",
                };
                crate::telemetry::allocation("", "", "", "", result);
            }
        }
    }
    response
}

/// Every error an API route can answer with. The doc of each variant gives its status and code.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400 `invalid_request`: malformed body, wrong types, unknown or missing fields, values out
    /// of range. Changes nothing.
    #[error("{0}")]
    InvalidRequest(String),
    /// 400 `token_url_not_allowed`: an OAuth credential's `token_url` is neither https nor http on
    /// a loopback address, or is https to a host that is (or resolves to) a private, loopback or
    /// link-local address while the operator does not allow it. Changes nothing.
    #[error("{0}")]
    TokenUrlNotAllowed(String),
    /// 401 `unauthorized`: the key header is missing or wrong.
    #[error("missing or wrong API key")]
    Unauthorized,
    /// 403 `forbidden`: a valid key, but not the one this route needs (the executor key on an
    /// operator route).
    #[error("this key may not use this route")]
    Forbidden,
    /// 403 `pool_not_allowed`: the caller's tenant may not lease from this provider and pool
    /// (its `pools`). Decided before anything is read: the same answer whether or not the pool
    /// exists. Changes nothing.
    #[error("this key may not lease from provider {provider} pool {pool}")]
    PoolNotAllowed {
        /// The provider the request named.
        provider: String,
        /// The pool the request named.
        pool: String,
    },
    /// 404 `pool_not_found`: no credentials at all for the provider and pool (as asked for).
    #[error("no credentials for provider {provider} in pool {pool}")]
    PoolNotFound {
        /// The provider the request named.
        provider: String,
        /// The pool the request named.
        pool: String,
    },
    /// 404 `credential_not_found`: no credential with this key_id (operator routes).
    #[error("no credential with this key_id")]
    CredentialNotFound,
    /// 404 `tenant_not_found`: no tenant with this tenant_id (operator routes).
    #[error("no tenant with this tenant_id")]
    TenantNotFound,
    /// 404 `tenant_key_not_found`: the tenant has no live key with this id (operator routes).
    #[error("the tenant has no live key with this id")]
    TenantKeyNotFound,
    /// 409 `tenant_in_use`: the tenant cannot be deleted: it is `default` (the internal key's),
    /// or it holds live leases. Changes nothing.
    #[error("{0}")]
    TenantInUse(&'static str),
    /// 404 `route_not_found`.
    #[error("no such route")]
    RouteNotFound,
    /// 405 `method_not_allowed`.
    #[error("method not allowed on this route")]
    MethodNotAllowed,
    /// 409 `model_not_supported`: the pool has credentials but none serves the model.
    #[error("no credential of provider {provider} in pool {pool} serves model {model}")]
    ModelNotSupported {
        /// The provider the request named.
        provider: String,
        /// The pool the request named.
        pool: String,
        /// The model the request named.
        model: String,
    },
    /// 409 `no_usable_credentials`: every credential that serves the model waits for an operator
    /// (disabled, pending, exhausted without a retry_after, or cooling down with no known end).
    #[error(
        "every credential that serves the model waits for an operator (disabled, pending, exhausted, or cooling down with no known end)"
    )]
    NoUsableCredentials,
    /// 409 `request_id_conflict`: the allocate's `request_id` holds a live lease granted for other
    /// parameters.
    #[error("this request_id holds a live lease granted for other parameters")]
    RequestIdConflict,
    /// 409 `tokens_exceed_budget`: the allocate's `tokens` estimate is larger than a token window
    /// of every credential that serves the model, or than a token window of the caller's tenant:
    /// no wait can make room for it.
    #[error(
        "the tokens estimate is larger than a token window of every credential that serves the model, or of the caller's tenant"
    )]
    TokensExceedBudget,
    /// 409 `provider_changed`: a PUT names a credential that exists under another provider. A
    /// credential keeps its provider (its leases', windows' and trail's rows are the provider's);
    /// changes nothing.
    #[error("{0}")]
    ProviderChanged(String),
    /// 410 `lease_lost`: renewal of a lease that is expired, unknown, released or mismatched.
    /// Stop using the credential.
    #[error("the lease is expired, unknown, released or does not match; stop using the credential")]
    LeaseLost,
    /// 412 `generation_moved`: a PUT with `If-Match: <generation>` found the credential's OAuth
    /// token at another generation (refreshed since, or not an OAuth credential). Changes
    /// nothing.
    #[error("the credential's token generation is not the one If-Match names; read it again")]
    GenerationMoved,
    /// 413 `payload_too_large`: body over [`MAX_BODY_BYTES`].
    #[error("request body too large")]
    PayloadTooLarge,
    /// 415 `unsupported_media_type`: the body is not `Content-Type: application/json`.
    #[error("expected Content-Type: application/json")]
    UnsupportedMediaType,
    /// 429 `pool_exhausted` with `Retry-After`: candidates exist but none is free now.
    #[error(
        "{}; retry after {retry_after_seconds} s",
        if *.oauth_refresh {
            "every candidate credential waits for its OAuth access token to be refreshed (it expired or would expire within the lease, or its refresh is failing: see the credential's oauth state)"
        } else {
            "every candidate credential is busy or cooling down"
        }
    )]
    PoolExhausted {
        /// Whole seconds, at least 1.
        retry_after_seconds: u64,
        /// Whether what frees first is an OAuth access token's refresh (`held_by`
        /// `token_refresh`): said in the message, since no slot is what it waits for.
        oauth_refresh: bool,
    },
    /// 429 `tenant_limit` with `Retry-After`: the caller's tenant holds as many live leases as
    /// its `max_concurrent_leases` allows, or a window of its `rate_limits` has no room
    /// (`window`), whatever the pool has free. Retry-After: the earliest end of the tenant's own
    /// leases, or when its windows have room.
    #[error(
        "tenant {tenant} {}; retry after {retry_after_seconds} s",
        if *.window { "has no room in a window of its rate_limits" } else { "holds as many leases as its max_concurrent_leases allows" }
    )]
    TenantLimit {
        /// The tenant.
        tenant: String,
        /// Whether a window holds it back (else its cap).
        window: bool,
        /// Whole seconds, at least 1.
        retry_after_seconds: u64,
    },
    /// 404 `upstream_not_configured` (relay): no upstream is set for the provider
    /// (`PUT /api/admin/relay/upstreams/{provider}`); nothing was leased or sent.
    #[error("no relay upstream is configured for this provider")]
    UpstreamNotConfigured,
    /// 502 `upstream_unreachable` (relay): the upstream could not be reached, or its answer broke
    /// off before it started. The lease was released with outcome `failure`.
    #[error("the upstream could not be reached")]
    UpstreamUnreachable,
    /// 502 `credential_not_relayable` (relay): the leased credential's secret has neither an
    /// `api_key` nor an `access_token` (a string a header can carry). Released; logged with its
    /// key_id.
    #[error("the leased credential has no api_key or access_token the relay can send")]
    CredentialNotRelayable,
    /// 504 `upstream_timeout` (relay): the upstream did not start its answer within its
    /// `timeout_seconds`. The lease was released with outcome `failure`.
    #[error("the upstream did not answer within its timeout_seconds")]
    UpstreamTimeout,
    /// 500 `internal_error`: a bug (a handler panicked). Logged; changes nothing the request had
    /// not committed.
    #[error("internal error")]
    Internal,
    /// 503 `store_unavailable`: the request did not finish within the request timeout (the store
    /// is slow or unreachable).
    #[error("the request timed out waiting for the store; retry")]
    Timeout,
    /// 503 `store_unavailable`: PostgreSQL failed or did not answer in time. Logged once here;
    /// the client never sees SQL or driver text.
    #[error("the store is unavailable; retry")]
    StoreUnavailable(#[source] sqlx::Error),
}

impl ApiError {
    /// The stable error code (its HTTP status and whether it carries Retry-After are the code's).
    pub fn code(&self) -> ErrorCode {
        match self {
            ApiError::InvalidRequest(_) => ErrorCode::InvalidRequest,
            ApiError::TokenUrlNotAllowed(_) => ErrorCode::TokenUrlNotAllowed,
            ApiError::Unauthorized => ErrorCode::Unauthorized,
            ApiError::Forbidden => ErrorCode::Forbidden,
            ApiError::PoolNotAllowed { .. } => ErrorCode::PoolNotAllowed,
            ApiError::PoolNotFound { .. } => ErrorCode::PoolNotFound,
            ApiError::RouteNotFound => ErrorCode::RouteNotFound,
            ApiError::CredentialNotFound => ErrorCode::CredentialNotFound,
            ApiError::TenantNotFound => ErrorCode::TenantNotFound,
            ApiError::TenantKeyNotFound => ErrorCode::TenantKeyNotFound,
            ApiError::TenantInUse(_) => ErrorCode::TenantInUse,
            ApiError::TenantLimit { .. } => ErrorCode::TenantLimit,
            ApiError::MethodNotAllowed => ErrorCode::MethodNotAllowed,
            ApiError::ModelNotSupported { .. } => ErrorCode::ModelNotSupported,
            ApiError::NoUsableCredentials => ErrorCode::NoUsableCredentials,
            ApiError::RequestIdConflict => ErrorCode::RequestIdConflict,
            ApiError::TokensExceedBudget => ErrorCode::TokensExceedBudget,
            ApiError::LeaseLost => ErrorCode::LeaseLost,
            ApiError::GenerationMoved => ErrorCode::GenerationMoved,
            ApiError::ProviderChanged(_) => ErrorCode::ProviderChanged,
            ApiError::PayloadTooLarge => ErrorCode::PayloadTooLarge,
            ApiError::UnsupportedMediaType => ErrorCode::UnsupportedMediaType,
            ApiError::PoolExhausted { .. } => ErrorCode::PoolExhausted,
            ApiError::UpstreamNotConfigured => ErrorCode::UpstreamNotConfigured,
            ApiError::UpstreamUnreachable => ErrorCode::UpstreamUnreachable,
            ApiError::CredentialNotRelayable => ErrorCode::CredentialNotRelayable,
            ApiError::UpstreamTimeout => ErrorCode::UpstreamTimeout,
            ApiError::Internal => ErrorCode::InternalError,
            ApiError::StoreUnavailable(_) | ApiError::Timeout => ErrorCode::StoreUnavailable,
        }
    }

    /// The HTTP status and the stable error code.
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        let code = self.code();
        (status_of(code), code.as_str())
    }
}

/// The HTTP status of `code` (every code's status is a valid one).
pub fn status_of(code: ErrorCode) -> StatusCode {
    StatusCode::from_u16(code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// An answer with `code`'s status and the API's error body.
pub fn error_response(code: ErrorCode, message: &str) -> Response {
    let body = serde_json::json!({"error": {"code": code, "message": message}});
    (status_of(code), Json(body)).into_response()
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        match &self {
            ApiError::StoreUnavailable(source) => {
                tracing::error!(error = %source, "store unavailable");
            }
            ApiError::PoolExhausted { .. } | ApiError::TenantLimit { .. } => {
                tracing::debug!(code, "no capacity")
            }
            ApiError::Internal => tracing::error!("request handler panicked"),
            _ => tracing::debug!(code, message = %self, "request refused"),
        }
        let mut response = error_response(self.code(), &self.to_string());
        debug_assert_eq!(response.status(), status);
        if let ApiError::PoolExhausted {
            retry_after_seconds,
            ..
        }
        | ApiError::TenantLimit {
            retry_after_seconds,
            ..
        } = self
        {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_seconds));
        }
        response
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        ApiError::StoreUnavailable(error)
    }
}

impl From<crate::store::credentials::UpsertError> for ApiError {
    fn from(error: crate::store::credentials::UpsertError) -> Self {
        use crate::store::credentials::UpsertError;
        match error {
            UpsertError::GenerationMoved => ApiError::GenerationMoved,
            UpsertError::ProviderChanged { .. } => ApiError::ProviderChanged(error.to_string()),
            UpsertError::Store(error) => ApiError::StoreUnavailable(error),
        }
    }
}

impl From<InvalidValue> for ApiError {
    fn from(error: InvalidValue) -> Self {
        ApiError::InvalidRequest(error.to_string())
    }
}

impl ApiError {
    /// The answer to `request`, an allocate that failed with `error` (a refusal names the
    /// provider, pool and model the request did).
    pub fn from_allocate(
        error: AllocateError,
        request: &crate::allocator::AllocateRequest,
    ) -> Self {
        let (provider, pool) = (request.provider.to_string(), request.pool.to_string());
        match error {
            AllocateError::PoolNotFound => ApiError::PoolNotFound { provider, pool },
            AllocateError::ModelNotSupported => ApiError::ModelNotSupported {
                provider,
                pool,
                model: request.model.to_string(),
            },
            AllocateError::NoUsableCredentials => ApiError::NoUsableCredentials,
            AllocateError::RequestIdConflict => ApiError::RequestIdConflict,
            AllocateError::TokensExceedBudget => ApiError::TokensExceedBudget,
            AllocateError::PoolExhausted {
                retry_after_seconds,
                held_by,
            } => ApiError::PoolExhausted {
                retry_after_seconds,
                oauth_refresh: held_by == crate::domain::HeldBy::TokenRefresh,
            },
            AllocateError::TenantLimit {
                tenant,
                window,
                retry_after_seconds,
            } => ApiError::TenantLimit {
                tenant,
                window,
                retry_after_seconds,
            },
            AllocateError::Unauthorized => ApiError::Unauthorized,
            AllocateError::PoolNotAllowed { provider, pool } => ApiError::PoolNotAllowed {
                provider: provider.to_string(),
                pool: pool.to_string(),
            },
            AllocateError::Store(e) => ApiError::StoreUnavailable(e),
            AllocateError::SecretUnreadable { key_id, error } => {
                tracing::error!(key_id = %key_id, error = %error, "a credential's secret cannot be opened; check the master keys");
                ApiError::Internal
            }
        }
    }
}

/// The refusals every operator route may answer, for the OpenAPI document (never built: it
/// only describes responses).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(crate) enum OperatorRefusals {
    /// A missing or wrong key.
    #[response(status = 401, description = "`unauthorized`: missing or wrong key")]
    Unauthorized(ErrorBody),
    /// The executor key.
    #[response(status = 403, description = "`forbidden`: the executor key")]
    Forbidden(ErrorBody),
    /// PostgreSQL down or out of reach.
    #[response(status = 503, description = "`store_unavailable`")]
    StoreUnavailable(ErrorBody),
}

/// The refusals of a route's JSON body, for the OpenAPI document (never built: it only
/// describes responses).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(crate) enum BodyRefusals {
    /// A body over the size limit.
    #[response(status = 413, description = "`payload_too_large`")]
    PayloadTooLarge(ErrorBody),
    /// A body that is not JSON.
    #[response(status = 415, description = "`unsupported_media_type`")]
    UnsupportedMediaType(ErrorBody),
}

/// The error body of every route: `{"error": {"code": "...", "message": "..."}}`.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// A stable snake_case code and a human-readable message.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// Stable, snake_case: one of [`ErrorCode`] (the list the clients share).
    pub code: ErrorCode,
    /// What happened, for people.
    pub message: String,
}

/// `axum::Json`, with rejections in the API's error shape.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(ApiJson(value)),
            Err(JsonRejection::MissingJsonContentType(_)) => Err(ApiError::UnsupportedMediaType),
            Err(JsonRejection::BytesRejection(r))
                if r.status() == StatusCode::PAYLOAD_TOO_LARGE =>
            {
                Err(ApiError::PayloadTooLarge)
            }
            Err(JsonRejection::JsonSyntaxError(e)) => Err(rejected(format!(
                "the body is not valid JSON: {}",
                cause(&e)
            ))),
            Err(JsonRejection::JsonDataError(e)) => {
                Err(rejected(format!("invalid request body: {}", cause(&e))))
            }
            Err(rejection) => Err(rejected(rejection.body_text())),
        }
    }
}

/// What an extractor's rejection says without the framework's lead-in ("Failed to deserialize
/// the JSON body into the target type: "): serde's own words, with the path to the field that
/// failed (`usage.tokens: invalid type: ...`), or a message of our own domain types.
fn cause(rejection: &dyn std::error::Error) -> String {
    match rejection.source() {
        Some(source) => source.to_string(),
        None => rejection.to_string(),
    }
}

/// Longest message a malformed request gets back, in characters. serde's messages quote what
/// they could not take (an unknown field's name, a string where a number belongs); without a
/// bound, a 256 KiB body came back whole in the answer and in the debug log.
const MAX_REJECTION_CHARS: usize = 1024;

/// 400 `invalid_request` with an extractor's rejection text, cut to [`MAX_REJECTION_CHARS`].
fn rejected(mut text: String) -> ApiError {
    if let Some((cut, _)) = text.char_indices().nth(MAX_REJECTION_CHARS) {
        text.truncate(cut);
        text.push_str("...");
    }
    ApiError::InvalidRequest(text)
}

/// `axum::extract::Query`, with rejections in the API's error shape.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(ApiQuery(value)),
            Err(QueryRejection::FailedToDeserializeQueryString(e)) => {
                Err(rejected(format!("invalid query string: {}", cause(&e))))
            }
            Err(rejection) => Err(rejected(rejection.body_text())),
        }
    }
}

/// `axum::extract::Path`, with rejections in the API's error shape (a path parameter that is not
/// UTF-8 after percent-decoding is 400 `invalid_request`, like any other bad id).
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(ApiPath(value)),
            // the kind alone: "invalid key_id: ...", not "Invalid URL: invalid key_id: ..."
            Err(PathRejection::FailedToDeserializePathParams(e)) => {
                Err(rejected(e.kind().to_string()))
            }
            Err(rejection) => Err(rejected(rejection.body_text())),
        }
    }
}

fn key_matches(headers: &HeaderMap, name: &str, expected: &str) -> bool {
    headers
        .get(name)
        .is_some_and(|given| given.as_bytes().ct_eq(expected.as_bytes()).into())
}

/// Who an executor request comes from (`X-Internal-Key`), established before its body is read
/// and before any statement but the key's own look-up runs (docs/src/security.md,
/// "Authentication first"): the configured internal key, compared in process in constant time
/// (tenant `default`, every pool, full reach of its reports); or a tenant's key (`cpk_` + 64 hex
/// digits), looked up by its hash in one statement ([`crate::store::tenants::key_tenant`]),
/// which also gives the tenant's scope. Anything else, or a tenant key that is unknown or revoked:
/// 401 at once. The statements that serve the call (claim, renewal, release) check a tenant key
/// again themselves, so a revoke that commits meanwhile still holds.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The tenant key's hash, which the claim, renewal and release statements check again;
    /// `None`: the internal key.
    key: Option<crate::domain::TenantKeyHash>,
    /// The caller's tenant.
    tenant: crate::domain::TenantId,
    /// Where it may lease.
    pools: crate::domain::TenantScope,
    /// Whether its reports may take a credential out of traffic until an operator acts.
    reports_may_disable: bool,
}

impl Caller {
    /// The configured internal key: tenant `default`, every provider and pool, and reports of
    /// full reach (what it could before tenants were scoped).
    pub fn internal() -> Self {
        Self {
            key: None,
            tenant: crate::domain::TenantId::default_tenant(),
            pools: crate::domain::TenantScope::everything(),
            reports_may_disable: true,
        }
    }

    /// The hash the claim, renewal and release statements check; `None` for the internal key.
    pub fn tenant_key(&self) -> Option<crate::domain::TenantKeyHash> {
        self.key
    }

    /// The caller's tenant.
    pub fn tenant(&self) -> &crate::domain::TenantId {
        &self.tenant
    }

    /// The pool sequence an allocate of `provider`/`pool` tries for this caller: the pool's
    /// sequence less the pools outside the caller's scope. 403 `pool_not_allowed` when the pool
    /// asked for is outside it, decided before anything is read, so the answer is the same
    /// whether or not the pool exists.
    pub fn pools(
        &self,
        provider: &crate::domain::ProviderName,
        pool: &crate::domain::PoolName,
    ) -> Result<Vec<crate::domain::PoolName>, ApiError> {
        if !self.pools.admits(provider, pool) {
            return Err(ApiError::PoolNotAllowed {
                provider: provider.to_string(),
                pool: pool.to_string(),
            });
        }
        Ok(pool
            .sequence()
            .into_iter()
            .filter(|p| self.pools.admits(provider, p))
            .collect())
    }

    /// Whether this caller's outcome reports may take a credential out of traffic until an
    /// operator acts (the internal key; a tenant with `reports_may_disable`).
    pub fn reports_may_disable(&self) -> bool {
        self.reports_may_disable
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        Caller::of_key(
            state,
            parts
                .headers
                .get("x-internal-key")
                .map(HeaderValue::as_bytes),
        )
        .await
    }
}

impl Caller {
    /// The caller `key` (the executor key as presented, in whatever header) names: the internal
    /// key compared in constant time, else a live tenant key looked up by its hash. 401
    /// `unauthorized` for anything else, or none.
    pub async fn of_key(state: &AppState, key: Option<&[u8]>) -> Result<Self, ApiError> {
        let key = key.ok_or(ApiError::Unauthorized)?;
        if bool::from(key.ct_eq(state.keys.internal.as_bytes())) {
            return Ok(Caller::internal());
        }
        let hash = std::str::from_utf8(key)
            .ok()
            .and_then(crate::domain::TenantKey::parse)
            .map(|key| key.hash())
            .ok_or(ApiError::Unauthorized)?;
        let found = crate::store::tenants::key_tenant(&state.db, hash)
            .await?
            .ok_or(ApiError::Unauthorized)?;
        Ok(Caller {
            key: Some(hash),
            tenant: found.tenant,
            pools: found.pools,
            reports_may_disable: found.reports_may_disable,
        })
    }
}

/// Proof that the request carries the operator key (`X-Admin-Key`). The executor key, in either
/// header, gets 403; a missing or wrong key 401.
pub struct AdminKey;

impl FromRequestParts<AppState> for AdminKey {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let headers = &parts.headers;
        if key_matches(headers, "x-admin-key", &state.keys.admin) {
            Ok(AdminKey)
        } else if key_matches(headers, "x-admin-key", &state.keys.internal)
            || key_matches(headers, "x-internal-key", &state.keys.internal)
        {
            Err(ApiError::Forbidden)
        } else {
            Err(ApiError::Unauthorized)
        }
    }
}
