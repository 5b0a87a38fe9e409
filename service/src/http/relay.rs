//! The relay: `/relay/{provider}/{pool}/<upstream path>`, any method. A client that takes a base
//! URL and an API key (an OpenAI or Anthropic SDK, a coding agent, curl) points its base URL at
//! `{credpool}/relay/{provider}/{pool}` and passes its executor or tenant key as its API key; it
//! never sees a credential. Each call is one lease: allocated (with the caller's tenant, a bounded
//! wait, the conversation's affinity and the body's `max_tokens` as its token estimate), renewed
//! while the call runs, and released when the answer ends, with the outcome and usage the answer
//! reports, or at once when the client goes away. The operator routes that set each provider's
//! upstream are here too (`/api/admin/relay/upstreams`).
//!
//! What leaves: only to the base URL an operator set for the provider (the call's path is appended
//! to its path and changes nothing else: [`forward_url`]); without the caller's key (wherever it
//! was sent again), cookies, forwarding or hop-by-hop headers; with the credential in the header
//! the operator named. Bodies are never logged, and credpool puts the credential in no answer, log
//! line, metric or trail row.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::admin::Operator;
use super::{
    ApiError, ApiJson, ApiPath, AppState, BodyRefusals, Caller, ErrorBody, OperatorRefusals,
};
use crate::allocator::{Affinity, AllocateRequest, Allocation};
use crate::domain::relay::{
    ApiStyle, Upstream, UpstreamInput, UsageScanner, credential_value, forward_url, outcome_of,
    refusal_body, retry_after_seconds,
};
use crate::domain::{
    AffinityKey, AffinityTtl, Holder, InvalidValue, LeaseSeconds, ModelName, Outcome, PoolName,
    ProviderName, windows::MAX_COUNT,
};
use crate::store::leases::{LeaseRef, ReleaseRequest, Renewed};
use crate::store::relay::{self as store, UpstreamDetail};

/// The relay's route (matched path), for the request metrics and the request timeout, which the
/// relay does not take: it bounds its own wait, and its upstream's answer by `timeout_seconds`.
pub(super) const ROUTE: &str = "/relay/{provider}/{pool}/{*path}";

/// Largest relay request body, in bytes (32 MiB: long prompts with images); larger ones get 413
/// `payload_too_large`.
pub const MAX_RELAY_BODY_BYTES: usize = 32 << 20;

/// The largest upstream error answer passed on, in bytes (1 MiB): an error answer is read whole
/// before it is passed on, for the outcome it reports (`insufficient_quota` in a 429).
const MAX_ERROR_ANSWER_BYTES: usize = 1 << 20;

/// The relay's route, any method (not in the OpenAPI document: its requests and answers are the
/// upstream API's).
pub(super) fn route() -> axum::Router<AppState> {
    axum::Router::new().route(ROUTE, axum::routing::any(relay))
}

/// The operator routes of the relay's upstreams.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_upstreams))
        .routes(routes!(put_upstream, delete_upstream))
}

/// How long a replica answers relay calls from the upstream it read last, in seconds: a change
/// by an operator reaches the calls of every other replica within this (the replica that made it
/// at once).
const UPSTREAM_FRESH_FOR: Duration = Duration::from_secs(1);

/// The most providers whose upstream (or its absence) a replica keeps; past it the memory is
/// emptied (callers are authenticated, but may name any provider).
const MAX_REMEMBERED_UPSTREAMS: usize = 1024;

/// The upstreams a replica read lately, by provider: when each was read, and what (`None`: the
/// provider had none).
type Remembered = std::collections::HashMap<ProviderName, (Instant, Option<Upstream>)>;

/// The HTTP client relay calls go out through (any address the operator's base URL names: an
/// upstream may be a gateway on a private network), and the upstreams read lately, so that a
/// call reads its provider's upstream from the store at most once a second per replica.
#[derive(Clone)]
pub struct RelayClient {
    http: crate::oauth::OutboundClient<hyper_util::client::legacy::connect::dns::GaiResolver>,
    upstreams: Arc<std::sync::Mutex<Remembered>>,
}

impl RelayClient {
    /// A client with its own connection pool.
    pub fn new() -> Self {
        Self {
            http: crate::oauth::https_client(
                hyper_util::client::legacy::connect::dns::GaiResolver::new(),
            ),
            upstreams: Arc::default(),
        }
    }

    /// `provider`'s upstream: as read within the last [`UPSTREAM_FRESH_FOR`], else from the
    /// store. Errors: the store's.
    async fn upstream(
        &self,
        db: &crate::store::Db,
        provider: &ProviderName,
    ) -> Result<Option<Upstream>, sqlx::Error> {
        if let Some((read_at, upstream)) = self.remembered().get(provider)
            && read_at.elapsed() < UPSTREAM_FRESH_FOR
        {
            return Ok(upstream.clone());
        }
        let read_at = Instant::now();
        let upstream = store::get(db, provider).await?;
        let mut remembered = self.remembered();
        if remembered.len() >= MAX_REMEMBERED_UPSTREAMS {
            remembered.clear();
        }
        remembered.insert(provider.clone(), (read_at, upstream.clone()));
        Ok(upstream)
    }

    /// Forgets `provider`'s upstream: this replica's next call reads it again.
    fn forget(&self, provider: &ProviderName) {
        self.remembered().remove(provider);
    }

    fn remembered(&self) -> std::sync::MutexGuard<'_, Remembered> {
        // a panic while the map was held leaves nothing half-written in it
        self.upstreams
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Default for RelayClient {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for RelayClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RelayClient")
    }
}

/// `{"upstreams": [...]}`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct Upstreams {
    upstreams: Vec<UpstreamDetail>,
}

/// Every provider's relay upstream.
#[utoipa::path(get, path = "/api/admin/relay/upstreams", tag = "operator",
    security(("admin_key" = [])),
    responses(
        (status = 200, description = "every upstream, by provider", body = Upstreams),
        OperatorRefusals,
    ))]
#[tracing::instrument(skip_all)]
async fn list_upstreams(
    State(state): State<AppState>,
    _operator: Operator,
) -> Result<Json<Upstreams>, ApiError> {
    Ok(Json(Upstreams {
        upstreams: store::list(&state.db).await?,
    }))
}

/// Sets where a provider's relay calls go: created (201) or replaced (200), with a
/// `relay_upstream_events` row, in one transaction. Calls already forwarded run to their end.
#[utoipa::path(put, path = "/api/admin/relay/upstreams/{provider}", tag = "operator",
    request_body = UpstreamInput,
    security(("admin_key" = [])),
    params(("X-Operator" = Option<String>, Header, description = "who you are, for the audit trail (default `admin-key`)"), ("provider" = String, Path, description = "the provider whose calls go there")),
    responses(
        (status = 200, description = "replaced", body = UpstreamDetail),
        (status = 201, description = "created", body = UpstreamDetail),
        (status = 400, description = "`invalid_request` (changes nothing)", body = ErrorBody),
        OperatorRefusals,
        BodyRefusals,
    ))]
#[tracing::instrument(skip_all, fields(provider = %raw))]
async fn put_upstream(
    State(state): State<AppState>,
    Operator(actor): Operator,
    ApiPath(raw): ApiPath<String>,
    ApiJson(body): ApiJson<UpstreamInput>,
) -> Result<(StatusCode, Json<UpstreamDetail>), ApiError> {
    let upstream = body.check(ProviderName::parse(raw)?)?;
    let (detail, created) = store::put(&state.db, &upstream, &actor).await?;
    state.relay.forget(&upstream.provider);
    tracing::info!(actor = actor.as_str(), base_url = %upstream.base_url, "relay upstream set");
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(detail)))
}

/// Removes a provider's upstream: its relay calls answer 404 `upstream_not_configured` from then
/// on.
#[utoipa::path(delete, path = "/api/admin/relay/upstreams/{provider}", tag = "operator",
    security(("admin_key" = [])),
    params(("X-Operator" = Option<String>, Header, description = "who you are, for the audit trail (default `admin-key`)"), ("provider" = String, Path, description = "the provider")),
    responses(
        (status = 204, description = "removed"),
        (status = 404, description = "`upstream_not_configured`", body = ErrorBody),
        OperatorRefusals,
    ))]
#[tracing::instrument(skip_all, fields(provider = %raw))]
async fn delete_upstream(
    State(state): State<AppState>,
    Operator(actor): Operator,
    ApiPath(raw): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    let provider = ProviderName::parse(raw)?;
    let removed = store::remove(&state.db, &provider, &actor).await?;
    state.relay.forget(&provider);
    if removed {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::UpstreamNotConfigured)
    }
}

/// One relay call, answered in full: the upstream's answer passed through, or credpool's own
/// refusal in the error shape of the API the client speaks.
#[tracing::instrument(skip_all, fields(method = %request.method()))]
async fn relay(State(state): State<AppState>, request: Request) -> Response {
    let mut api = ApiStyle::of_request(request.headers());
    match forward(&state, request, &mut api).await {
        Ok(response) => response,
        Err(Refused { error, leased }) => {
            // a call that held a lease was counted by its release, under how it ended
            if !leased {
                crate::telemetry::relay_call("", "", "refused");
            }
            refusal(api, error)
        }
    }
}

/// credpool's own answer to a relay call, and whether the call held a lease (released by then).
struct Refused {
    error: ApiError,
    leased: bool,
}

impl Refused {
    /// `error`, answered after the call's lease was released.
    fn after_lease(error: ApiError) -> Self {
        Self {
            error,
            leased: true,
        }
    }
}

impl<E: Into<ApiError>> From<E> for Refused {
    fn from(error: E) -> Self {
        Self {
            error: error.into(),
            leased: false,
        }
    }
}

/// credpool's answer `error` in `api`'s error shape, with the status and `Retry-After` it has on
/// the executor API.
fn refusal(api: ApiStyle, error: ApiError) -> Response {
    let code = error.code();
    let message = error.to_string();
    let (mut parts, _) = error.into_response().into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    let body = refusal_body(api, code.status(), code.as_str(), &message);
    Response::from_parts(parts, Body::from(body.to_string()))
}

/// The executor key a relay call presents, where SDKs put an API key: `Authorization: Bearer`
/// (OpenAI's), `x-api-key` (Anthropic's), or credpool's own `X-Internal-Key`.
fn presented_key(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(key) = headers
        .get("x-internal-key")
        .or_else(|| headers.get("x-api-key"))
    {
        return Some(key.as_bytes());
    }
    let bearer = headers.get(header::AUTHORIZATION)?.as_bytes();
    match bearer.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => Some(bearer[7..].trim_ascii()),
        _ => None,
    }
}

/// The provider, the pool and the rest of a relay path (still percent-encoded).
fn route_parts(path: &str) -> Result<(ProviderName, PoolName, &str), ApiError> {
    let rest = path
        .strip_prefix("/relay/")
        .ok_or(ApiError::RouteNotFound)?;
    let (provider, rest) = rest.split_once('/').ok_or(ApiError::RouteNotFound)?;
    let (pool, rest) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    Ok((ProviderName::parse(provider)?, PoolName::parse(pool)?, rest))
}

/// What the relay reads from a call's JSON body: the model (or `X-Credpool-Model`, for calls
/// without one) and the token estimate.
#[derive(Deserialize)]
struct CallFields {
    model: Option<String>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    max_output_tokens: Option<u64>,
}

/// A request header's value as text, or 400 naming it.
fn header_text<'a>(
    headers: &'a HeaderMap,
    name: &'static str,
) -> Result<Option<&'a str>, ApiError> {
    headers
        .get(name)
        .map(|v| {
            v.to_str()
                .map_err(|_| InvalidValue::new(name, "must be printable ASCII").into())
        })
        .transpose()
}

/// Whether a request's body is JSON by its `Content-Type` (absent: taken as JSON, as SDKs that
/// send JSON without saying so mean it).
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase()
        })
        .is_none_or(|kind| kind == "application/json" || kind.ends_with("+json"))
}

/// The allocation a relay call asks for, from the pools its caller may use (`pools`).
fn allocation(
    state: &AppState,
    upstream: &Upstream,
    caller: &Caller,
    (pool, pools): (PoolName, Vec<PoolName>),
    headers: &HeaderMap,
    body: &[u8],
) -> Result<AllocateRequest, ApiError> {
    let fields: Option<CallFields> = if body.is_empty() || !is_json(headers) {
        None
    } else {
        Some(serde_json::from_slice(body).map_err(|_| {
            ApiError::InvalidRequest(
                "the relay reads the call's model from its JSON body: the body is not a JSON object with a string model".into(),
            )
        })?)
    };
    let named = header_text(headers, "x-credpool-model")?;
    let model = match (fields.as_ref().and_then(|f| f.model.as_deref()), named) {
        (Some(body), Some(header)) if body != header => {
            return Err(InvalidValue::new(
                "X-Credpool-Model",
                "names another model than the body's (the body's model is the one leased for)",
            )
            .into());
        }
        (Some(model), _) | (None, Some(model)) => model.to_owned(),
        (None, None) => {
            return Err(ApiError::InvalidRequest(
                "the relay needs the call's model: a JSON body with \"model\", or the X-Credpool-Model header".into(),
            ));
        }
    };
    let tokens = fields
        .as_ref()
        .and_then(|f| {
            f.max_tokens
                .or(f.max_completion_tokens)
                .or(f.max_output_tokens)
        })
        .unwrap_or(0)
        .min(MAX_COUNT);
    let wait_ms = match header_text(headers, "x-credpool-wait-ms")? {
        None => u64::from(upstream.wait_ms),
        Some(text) => text.trim().parse::<u64>().map_err(|_| {
            InvalidValue::new(
                "X-Credpool-Wait-Ms",
                "must be a whole number of milliseconds",
            )
        })?,
    };
    let holder = match header_text(headers, "x-credpool-holder")? {
        None => Holder::parse("relay".to_owned())?,
        Some(name) => Holder::parse(format!("relay:{name}"))?,
    };
    // a preference: a value that cannot be a conversation's key leaves the call without one
    let affinity = upstream
        .affinity_header
        .as_ref()
        .and_then(|name| headers.get(name))
        .and_then(|value| value.to_str().ok())
        .and_then(|value| AffinityKey::parse(value.to_owned()).ok())
        .map(|key| Affinity {
            key,
            ttl: AffinityTtl::DEFAULT,
            mode: Default::default(),
        });
    Ok(AllocateRequest {
        pools,
        provider: upstream.provider.clone(),
        model: ModelName::parse(model)?,
        pool,
        lease_seconds: LeaseSeconds::default_within(state.max_lease_seconds),
        holder: Some(holder),
        request_id: None,
        wait: Duration::from_millis(wait_ms).min(state.max_wait),
        tokens,
        caller: caller.tenant_key(),
        affinity,
    })
}

/// Headers that belong to one hop's framing, never passed on either way (RFC 9110 section
/// 7.6.1, and `content-length`: hyper frames each side itself; an answer goes on chunked, so that
/// its end is seen and the lease released when its last chunk has been read). `proxy-*` and the
/// names `Connection` lists are held back too ([`passed_on`]).
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

/// Request headers never forwarded besides [`HOP_BY_HOP`]: the caller's keys and cookies, what
/// says where the call came from (`x-forwarded-*` too), `host` (the upstream's is set), `expect`
/// (the body is whole already), and `accept-encoding` (the answer is read for its usage, so it
/// comes unencoded).
const REQUEST_HEADERS_KEPT_BACK: &[&str] = &[
    "host",
    "authorization",
    "x-api-key",
    "x-internal-key",
    "x-admin-key",
    "accept-encoding",
    "cookie",
    "forwarded",
    "x-real-ip",
    "via",
    "expect",
];

/// Answer headers never passed back besides [`HOP_BY_HOP`]: cookies the upstream sets for the
/// credential's session, and `location` (a redirect is not followed, nor offered to the client,
/// which would send its key there).
const ANSWER_HEADERS_KEPT_BACK: &[&str] = &["location", "set-cookie"];

/// The headers `Connection` names (hop-by-hop for this one message).
fn named_by_connection(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect()
}

/// `headers` less [`HOP_BY_HOP`], `kept_back`, those `Connection` names, `x-credpool-*`,
/// `x-forwarded-*`, `proxy-*`, and any header whose value holds `key` (the caller's key, sent again
/// where the relay does not look for it: `api-key`, `x-goog-api-key`, ...).
fn passed_on(headers: &HeaderMap, kept_back: &[&str], key: Option<&[u8]>) -> HeaderMap {
    let connection = named_by_connection(headers);
    let holds_key = |value: &HeaderValue| {
        key.is_some_and(|key| {
            !key.is_empty() && value.as_bytes().windows(key.len()).any(|w| w == key)
        })
    };
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let name_str = name.as_str();
        if HOP_BY_HOP.contains(&name_str)
            || kept_back.contains(&name_str)
            || connection.iter().any(|c| c == name_str)
            || ["x-credpool-", "x-forwarded-", "proxy-"]
                .iter()
                .any(|prefix| name_str.starts_with(prefix))
            || holds_key(value)
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

/// Authenticates, leases, forwards and answers one call (`api` becomes the upstream's once it is
/// known, for the refusals after that).
async fn forward(
    state: &AppState,
    request: Request,
    api: &mut ApiStyle,
) -> Result<Response, Refused> {
    let (parts, body) = request.into_parts();
    // the key first, before anything is read for the caller (docs/src/security.md), then the
    // tenant's pools: the same answer whether or not the provider has an upstream
    let key = presented_key(&parts.headers);
    let caller = Caller::of_key(state, key).await?;
    let (provider, pool, rest) = route_parts(parts.uri.path())?;
    let pools = caller.pools(&provider, &pool)?;
    let query = parts.uri.query();
    if let (Some(key), Some(query)) = (key, query)
        && !key.is_empty()
        && query.as_bytes().windows(key.len()).any(|w| w == key)
    {
        return Err(InvalidValue::new("query", "must not carry the executor key").into());
    }
    let upstream = state
        .relay
        .upstream(&state.db, &provider)
        .await?
        .ok_or(ApiError::UpstreamNotConfigured)?;
    *api = upstream.api;
    let uri: hyper::Uri = forward_url(&upstream.base_url, rest, query)?
        .as_str()
        .parse()
        .map_err(|_| ApiError::from(InvalidValue::new("path", "is not a valid request path")))?;
    let body = tokio::time::timeout(
        state.request_timeout,
        axum::body::to_bytes(body, MAX_RELAY_BODY_BYTES),
    )
    .await
    .map_err(|_| {
        ApiError::InvalidRequest(
            "the request's body did not arrive within the request timeout".into(),
        )
    })?
    .map_err(|_| ApiError::PayloadTooLarge)?;
    let request = allocation(
        state,
        &upstream,
        &caller,
        (pool, pools),
        &parts.headers,
        &body,
    )?;
    // the lease's length runs from before the claim: a renewal is due before the store's
    // lease_until, never after
    let claimed_at = Instant::now();
    let lease = tokio::time::timeout(
        state.request_timeout + request.wait,
        state.allocator.allocate(&request),
    )
    .await
    .map_err(|_| ApiError::Timeout)?
    .map_err(|error| ApiError::from_allocate(error, &request))?;
    let held = HeldLease::hold(state, &lease, &caller, request.lease_seconds, claimed_at);

    let Some(credential) = credential_header(&upstream, &lease) else {
        tracing::error!(key_id = %lease.key_id, "a leased credential has neither api_key nor access_token: the relay cannot use it");
        held.settle(Some(Outcome::Failure), None, None, "failure")
            .await;
        return Err(Refused::after_lease(ApiError::CredentialNotRelayable));
    };
    let mut headers = passed_on(&parts.headers, REQUEST_HEADERS_KEPT_BACK, key);
    headers.insert(credential.0, credential.1);
    let mut outbound = hyper::Request::new(http_body_util::Full::new(body));
    *outbound.method_mut() = parts.method.clone();
    *outbound.uri_mut() = uri;
    *outbound.headers_mut() = headers;

    let timeout = Duration::from_secs(u64::from(upstream.timeout_seconds));
    let answer = tokio::select! {
        answer = tokio::time::timeout(timeout, state.relay.http.request(outbound)) => answer,
        () = held.lost.notified() => {
            held.settle(None, None, None, "lease_lost").await;
            return Err(Refused::after_lease(ApiError::Timeout));
        }
    };
    let answer = match answer {
        Ok(Ok(answer)) => answer,
        Ok(Err(error)) => {
            tracing::warn!(provider = %provider, error = %error, "the relay's upstream could not be reached");
            held.settle(Some(Outcome::Failure), None, None, "upstream_unreachable")
                .await;
            return Err(Refused::after_lease(ApiError::UpstreamUnreachable));
        }
        Err(_) => {
            held.settle(Some(Outcome::Failure), None, None, "upstream_timeout")
                .await;
            return Err(Refused::after_lease(ApiError::UpstreamTimeout));
        }
    };
    let (mut answer_parts, answer_body) = answer.into_parts();
    let status = answer_parts.status;
    answer_parts.headers = passed_on(&answer_parts.headers, ANSWER_HEADERS_KEPT_BACK, None);
    if let Ok(value) = HeaderValue::from_str(&lease.lease_id.to_string()) {
        answer_parts
            .headers
            .insert(HeaderName::from_static("x-credpool-lease-id"), value);
    }
    if !status.is_success() {
        // read whole, for the outcome it reports, and released before it is passed on
        let read = tokio::time::timeout(
            timeout,
            http_body_util::Limited::new(answer_body, MAX_ERROR_ANSWER_BYTES).collect(),
        )
        .await;
        let bytes = match read {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(error)) if error.is::<http_body_util::LengthLimitError>() => {
                // too long to pass on whole: its status alone says what happened
                let outcome = outcome_of(status.as_u16(), b"");
                held.settle(Some(outcome), None, None, outcome.as_str())
                    .await;
                return Err(Refused::after_lease(ApiError::UpstreamUnreachable));
            }
            _ => {
                held.settle(Some(Outcome::Failure), None, None, "upstream_unreachable")
                    .await;
                return Err(Refused::after_lease(ApiError::UpstreamUnreachable));
            }
        };
        let outcome = outcome_of(status.as_u16(), &bytes);
        let retry_after = match outcome {
            Outcome::RateLimited | Outcome::QuotaExhausted => {
                retry_after_seconds(&answer_parts.headers)
            }
            _ => None,
        };
        held.settle(Some(outcome), retry_after, None, outcome.as_str())
            .await;
        return Ok(Response::from_parts(answer_parts, Body::from(bytes)));
    }
    if parts.method == axum::http::Method::HEAD || hyper::body::Body::is_end_stream(&answer_body) {
        // nothing to stream (HEAD, 204): hyper would drop the body unread
        held.settle(Some(Outcome::Success), None, None, "success")
            .await;
        return Ok(Response::from_parts(answer_parts, Body::empty()));
    }
    let events = answer_parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let passing = Passing {
        upstream: Some(answer_body),
        scanner: UsageScanner::new(events),
        held: Some(held),
        idle: timeout,
    };
    Ok(Response::from_parts(
        answer_parts,
        Body::from_stream(futures::stream::unfold(passing, Passing::next)),
    ))
}

/// The header and value that give the upstream the leased credential: an OAuth access token as
/// `Authorization: Bearer`, an API key in the upstream's `credential_header` (as a bearer token
/// when that is `authorization`). `None` when the secret holds neither, or a value no header
/// can carry.
fn credential_header(upstream: &Upstream, lease: &Allocation) -> Option<(HeaderName, HeaderValue)> {
    let (value, oauth) = credential_value(lease.credential.expose())?;
    let (name, text) = if oauth || upstream.credential_header == header::AUTHORIZATION {
        (header::AUTHORIZATION, format!("Bearer {value}"))
    } else {
        (upstream.credential_header.clone(), value.to_owned())
    };
    let mut value = HeaderValue::from_str(&text).ok()?;
    value.set_sensitive(true);
    Some((name, value))
}

/// A successful answer on its way to the client, chunk by chunk as the upstream sends them: read
/// for its usage as it passes, and its lease released when it ends (before the client sees the
/// end, so that a client that calls again at once finds the slot free), or when the client goes
/// away (the body is dropped: [`HeldLease`]'s drop, unless the stream's last event had passed:
/// then the call was whole, and is released as a success with its usage).
struct Passing {
    /// `None` once cut: the upstream's connection is let go before the release.
    upstream: Option<hyper::body::Incoming>,
    scanner: UsageScanner,
    /// `None` once the lease is settled: the stream has ended.
    held: Option<HeldLease>,
    /// The longest wait for the next chunk.
    idle: Duration,
}

impl Drop for Passing {
    fn drop(&mut self) {
        // SDKs close their connection once they have read a stream's last event (OpenAI's after
        // `data: [DONE]`), which can come before the upstream's own end of the answer
        if self.scanner.stream_ended()
            && let Some(held) = self.held.take()
        {
            let usage = std::mem::take(&mut self.scanner).tokens();
            tokio::spawn(held.settle(Some(Outcome::Success), None, usage, "success"));
        }
    }
}

impl Passing {
    async fn next(mut self) -> Option<(Result<Bytes, std::io::Error>, Self)> {
        loop {
            let held = self.held.as_ref()?;
            let upstream = self.upstream.as_mut()?;
            let frame = tokio::select! {
                frame = tokio::time::timeout(self.idle, upstream.frame()) => frame,
                () = held.lost.notified() => {
                    return self.cut(None, "lease_lost", "the call's lease could not be renewed").await;
                }
            };
            match frame {
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        self.scanner.feed(&data);
                        return Some((Ok(data), self));
                    }
                    // trailers: not passed on
                }
                Ok(None) => {
                    let usage = std::mem::take(&mut self.scanner).tokens();
                    let held = self.held.take()?;
                    held.settle(Some(Outcome::Success), None, usage, "success")
                        .await;
                    return None;
                }
                Ok(Some(Err(_))) => {
                    return self
                        .cut(
                            Some(Outcome::Failure),
                            "upstream_unreachable",
                            "the upstream's answer broke off",
                        )
                        .await;
                }
                Err(_) => {
                    return self
                        .cut(
                            Some(Outcome::Failure),
                            "upstream_timeout",
                            "the upstream sent nothing within its timeout_seconds",
                        )
                        .await;
                }
            }
        }
    }

    /// Ends the answer early: the lease released with `outcome`, and the client's connection
    /// broken (an answer cut short must not read as a whole one).
    async fn cut(
        mut self,
        outcome: Option<Outcome>,
        label: &'static str,
        why: &'static str,
    ) -> Option<(Result<Bytes, std::io::Error>, Self)> {
        let held = self.held.take()?;
        // the credential's call upstream ends first, then the lease
        self.upstream = None;
        tracing::warn!(why, "a relay answer was cut short");
        held.settle(outcome, None, None, label).await;
        Some((Err(std::io::Error::other(why)), self))
    }
}

/// A relay call's lease while the call runs: renewed every third of its length, and released
/// once: by [`HeldLease::settle`] with what the answer reported, or, dropped unsettled (the client
/// went away, or the handler was cancelled), at once with no outcome and no usage (the
/// credential is not to blame; its token reservation stands). A lease whose renewal fails past
/// its end is lost (another caller may hold the slot now): [`HeldLease::lost`] fires and the call
/// is cut.
struct HeldLease {
    state: AppState,
    release: Option<ReleaseRequest>,
    provider: String,
    pool: String,
    renewal: tokio::task::JoinHandle<()>,
    lost: Arc<Notify>,
}

impl HeldLease {
    /// Holds `lease`, claimed no earlier than `claimed_at`, for `caller`.
    fn hold(
        state: &AppState,
        lease: &Allocation,
        caller: &Caller,
        seconds: LeaseSeconds,
        claimed_at: Instant,
    ) -> Self {
        let lease_ref = LeaseRef {
            key_id: lease.key_id.clone(),
            provider: lease.provider.clone(),
            pool: lease.pool.clone(),
            lease_id: lease.lease_id,
            fence: Some(lease.fence),
        };
        let lost = Arc::new(Notify::new());
        let renewal = tokio::spawn(renew_while_held(
            state.clone(),
            (lease_ref.clone(), claimed_at),
            seconds,
            caller.tenant_key(),
            lost.clone(),
        ));
        Self {
            state: state.clone(),
            release: Some(ReleaseRequest {
                lease: lease_ref,
                outcome: None,
                retry_after_seconds: None,
                usage_tokens: None,
                caller: caller.tenant_key(),
                may_disable: caller.reports_may_disable(),
            }),
            provider: lease.provider.to_string(),
            pool: lease.pool.to_string(),
            renewal,
            lost,
        }
    }

    /// Releases the lease with `outcome`, the upstream's Retry-After and the `usage` its answer
    /// reported, and counts the call under `label`. The release runs as a task of its own, and
    /// is awaited: a client that goes away while it runs (the OpenAI SDK closes its connection
    /// once it has read `data: [DONE]`, before the answer's end) makes hyper drop the answer's
    /// body, and with it this future; a release dropped half-way would hold the slot until the
    /// lease's end.
    async fn settle(
        mut self,
        outcome: Option<Outcome>,
        retry_after_seconds: Option<u32>,
        usage: Option<u64>,
        label: &'static str,
    ) {
        self.renewal.abort();
        if let Some(mut request) = self.release.take() {
            request.outcome = outcome;
            request.retry_after_seconds = retry_after_seconds;
            request.usage_tokens = usage;
            crate::telemetry::relay_call(&self.provider, &self.pool, label);
            let state = self.state.clone();
            // an Err is the task's panic, which the panic hook has logged
            let _ = tokio::spawn(async move { release(&state, request).await }).await;
        }
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        self.renewal.abort();
        if let Some(request) = self.release.take() {
            crate::telemetry::relay_call(&self.provider, &self.pool, "client_closed");
            let state = self.state.clone();
            tokio::spawn(async move { release(&state, request).await });
        }
    }
}

/// Gives a relay call's lease back. A release that fails (the store is down) leaves the lease to
/// free at its end, as any crashed executor's.
async fn release(state: &AppState, request: ReleaseRequest) {
    let lease_id = request.lease.lease_id;
    match state.allocator.release(request).await {
        Ok(result) => {
            tracing::debug!(lease_id = %lease_id, released = result.released.is_ok(), "relay lease released")
        }
        Err(error) => {
            tracing::warn!(lease_id = %lease_id, error = %error, "a relay lease could not be released; it frees at its lease_until")
        }
    }
}

/// Renews `lease` (claimed no earlier than the instant beside it) every third of its length while
/// the call runs (sooner after a failed renewal); fires `lost` when the store says it is gone
/// (expired, released by an operator, its key revoked) or when no renewal has succeeded within a
/// lease length of the last one's start: a renewal that hangs (the store out of reach from this
/// replica alone) is given up at that deadline, when the store may let another caller have the
/// slot.
async fn renew_while_held(
    state: AppState,
    (lease, claimed_at): (LeaseRef, Instant),
    seconds: LeaseSeconds,
    caller: Option<crate::domain::TenantKeyHash>,
    lost: Arc<Notify>,
) {
    let length = Duration::from_secs(u64::from(seconds.get()));
    let every = (length / 3).max(Duration::from_millis(200));
    let mut good_until = claimed_at + length;
    let mut pause = every;
    loop {
        tokio::time::sleep(pause).await;
        let asked = Instant::now();
        let renewal = state.allocator.renew(lease.clone(), seconds, caller);
        match tokio::time::timeout_at(good_until.into(), renewal).await {
            Ok(Ok(Renewed::Until(_))) => {
                good_until = asked + length;
                pause = every;
            }
            Ok(Ok(Renewed::Lost | Renewed::Unauthorized)) | Err(_) => {
                lost.notify_one();
                return;
            }
            Ok(Err(error)) => {
                tracing::warn!(lease_id = %lease.lease_id, error = %error, "a relay lease's renewal failed; trying again");
                pause = every.min(Duration::from_secs(1));
                if Instant::now() + pause >= good_until {
                    lost.notify_one();
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_executor_key_is_read_where_sdks_send_an_api_key() {
        let mut h = HeaderMap::new();
        assert_eq!(presented_key(&h), None);
        h.insert("authorization", "Bearer cpk_abc".parse().unwrap());
        assert_eq!(presented_key(&h), Some(&b"cpk_abc"[..]));
        h.insert("authorization", "Basic abc".parse().unwrap());
        assert_eq!(presented_key(&h), None);
        h.insert("x-api-key", "k2".parse().unwrap());
        assert_eq!(presented_key(&h), Some(&b"k2"[..]));
    }

    #[test]
    fn nothing_of_the_caller_or_the_hop_is_forwarded() {
        let mut h = HeaderMap::new();
        for (name, value) in [
            ("authorization", "Bearer executor-key"),
            ("x-api-key", "executor-key"),
            ("cookie", "a=b"),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "1"),
            ("transfer-encoding", "chunked"),
            ("proxy-authorization", "Basic abc"),
            ("x-credpool-wait-ms", "5"),
            ("x-forwarded-for", "10.0.0.1"),
            ("content-type", "application/json"),
            ("anthropic-version", "2023-06-01"),
        ] {
            h.insert(name, value.parse().unwrap());
        }
        h.insert("api-key", "executor-key".parse().unwrap());
        h.insert("x-forwarded-port", "443".parse().unwrap());
        let kept = passed_on(&h, REQUEST_HEADERS_KEPT_BACK, Some(b"executor-key"));
        let names: Vec<_> = kept.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["content-type", "anthropic-version"]);
    }

    #[test]
    fn a_relay_path_names_its_provider_and_pool() {
        let (provider, pool, rest) =
            route_parts("/relay/openai/default/v1/chat/completions").unwrap();
        assert_eq!(
            (provider.as_str(), pool.as_str(), rest),
            ("openai", "default", "/v1/chat/completions")
        );
        assert!(route_parts("/relay/Open%41I/default/v1").is_err());
        assert!(route_parts("/relay/openai/../v1").is_err());
    }
}
