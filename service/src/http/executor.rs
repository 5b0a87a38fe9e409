//! Executor routes (`X-Internal-Key`): allocate, renew, release.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use credpool_protocol::MAX_RETRY_AFTER_SECONDS;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use time::OffsetDateTime;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{
    AllocationOutcome, ApiError, ApiJson, AppState, BodyRefusals, Caller, ErrorBody, ErrorCode,
};
use crate::allocator::{Affinity, AllocateRequest};
use crate::domain::{
    AffinityKey, AffinityMode, AffinityResult, AffinityTtl, Holder, InvalidValue, KeyId, LeaseId,
    LeaseSeconds, ModelName, Outcome, PoolName, ProviderName, RequestId, Secret,
};
use crate::store::leases::{LeaseRef, NotReleased, ReleaseRequest, Renewed};

/// The allocate route, for the allocation counter.
pub(super) const ALLOCATE_ROUTE: &str = "/api/internal/allocate-key";

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(allocate))
        .routes(routes!(release))
        .routes(routes!(renew))
}

/// `POST /api/internal/allocate-key` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct AllocateBody {
    provider: ProviderName,
    /// A model name, or an alias an operator mapped.
    model: ModelName,
    /// Default `default`; `vip` falls back to `default`.
    #[serde(default)]
    #[schema(default = "default")]
    pool: PoolName,
    /// Lease length in seconds, 1..=`--max-lease-seconds` (default 3600); default 35.
    #[schema(value_type = Option<u64>, minimum = 1, maximum = 86400)]
    lease_seconds: Option<i64>,
    /// The executor's name for itself, kept on the lease and in the audit trail.
    holder: Option<Holder>,
    /// An idempotency key the client chose (1..=128 of `A-Z a-z 0-9 . _ : -`; a UUID fits): a
    /// retry with the same request_id and the same parameters, while the lease lives, gets the
    /// same lease instead of a second slot; with other parameters, 409 `request_id_conflict`.
    request_id: Option<RequestId>,
    /// Milliseconds to wait for a slot when every candidate is busy (default 0: answer 429 at
    /// once); values above the service's cap (`--max-wait-ms`, default 30000) wait the cap.
    #[schema(minimum = 0)]
    wait_ms: Option<u64>,
    /// The tokens the call expects to use, 0..=10^9 (default 0): reserved in the credential's
    /// token windows from the grant until the release reports its `usage`.
    #[schema(minimum = 0, maximum = 1_000_000_000)]
    tokens: Option<u64>,
    /// The conversation this call belongs to (1..=256 printable characters, e.g. a conversation
    /// id): the credential that served the conversation's last call is tried first while it can
    /// serve now, because providers cache prompts per account; when it cannot (full, disabled,
    /// drained, cooling down, moved to another pool), another serves at once and the binding
    /// moves to it. Not part of the `request_id`'s parameters.
    affinity_key: Option<AffinityKey>,
    /// How long the binding lives after this call, in seconds, 1..=86400 (default 3600);
    /// refreshed on each hit. Only with `affinity_key`.
    #[schema(minimum = 1, maximum = 86400)]
    affinity_ttl_seconds: Option<u64>,
    /// `preferred` (default): the bound credential first, never waited for. `strict`: while the
    /// bound credential could serve but for its slots and windows, only it is considered (the
    /// request waits up to `wait_ms` for it, or answers 429). Only with `affinity_key`.
    affinity_mode: Option<AffinityMode>,
}

/// The allocation a body asks for, under the service's longest lease and longest wait.
fn allocate_request(
    body: AllocateBody,
    max_lease_seconds: u32,
    max_wait: Duration,
    caller: &Caller,
) -> Result<AllocateRequest, ApiError> {
    Ok(AllocateRequest {
        lease_seconds: lease_seconds(body.lease_seconds, max_lease_seconds)?,
        pools: caller.pools(&body.provider, &body.pool)?,
        provider: body.provider,
        model: body.model,
        pool: body.pool,
        holder: body.holder,
        request_id: body.request_id,
        wait: Duration::from_millis(body.wait_ms.unwrap_or(0)).min(max_wait),
        tokens: tokens(body.tokens, "tokens")?.unwrap_or(0),
        caller: caller.tenant_key(),
        affinity: affinity(
            body.affinity_key,
            body.affinity_ttl_seconds,
            body.affinity_mode,
        )?,
    })
}

/// The affinity a body asks for: `affinity_key` with its TTL (default one hour) and mode
/// (default preferred). A TTL or a mode without a key is a 400: the caller meant something the
/// service would silently ignore.
fn affinity(
    key: Option<AffinityKey>,
    ttl_seconds: Option<u64>,
    mode: Option<AffinityMode>,
) -> Result<Option<Affinity>, ApiError> {
    let ttl = ttl_seconds.map(AffinityTtl::parse).transpose()?;
    match key {
        Some(key) => Ok(Some(Affinity {
            key,
            ttl: ttl.unwrap_or(AffinityTtl::DEFAULT),
            mode: mode.unwrap_or_default(),
        })),
        None if ttl.is_some() || mode.is_some() => Err(InvalidValue::new(
            "affinity_key",
            "is required with affinity_ttl_seconds and affinity_mode",
        )
        .into()),
        None => Ok(None),
    }
}

/// A token count as the API takes it: 0..=10^9.
fn tokens(given: Option<u64>, field: &'static str) -> Result<Option<u64>, ApiError> {
    match given {
        Some(n) if n > crate::domain::windows::MAX_COUNT => Err(InvalidValue::new(
            field,
            format!(
                "must be an integer from 0 to {}",
                crate::domain::windows::MAX_COUNT
            ),
        )
        .into()),
        other => Ok(other),
    }
}

/// Parses an allocate body as `POST /api/internal/allocate-key` does once its key is checked
/// (here: the internal key): the JSON (unknown fields refused, every name validated), then the
/// lease length under `max_lease_seconds` and the wait under `max_wait`. A bad body is the handler's 400
/// `invalid_request`. Public for the request-parsing benchmark.
pub fn parse_allocate(
    body: &[u8],
    max_lease_seconds: u32,
    max_wait: Duration,
) -> Result<AllocateRequest, ApiError> {
    let body: AllocateBody = serde_json::from_slice(body)
        .map_err(|error| ApiError::InvalidRequest(error.to_string()))?;
    allocate_request(body, max_lease_seconds, max_wait, &Caller::internal())
}

/// A granted lease.
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct AllocateResponse {
    key_id: KeyId,
    lease_id: LeaseId,
    provider: ProviderName,
    /// The pool that served (after a `vip` -> `default` fallback, `default`).
    pool: PoolName,
    /// The model name as this credential serves it (an alias resolved).
    provider_model: String,
    /// When the lease stops counting unless renewed (database clock).
    #[serde(with = "time::serde::rfc3339")]
    lease_until: OffsetDateTime,
    /// The lease's length in seconds as granted: the request's `lease_seconds`, or the service's
    /// default (35, or `--max-lease-seconds` when that is lower). A renewal without
    /// `lease_seconds` extends by this much; renew well within it (a client renews every third).
    #[schema(minimum = 1, maximum = 86400)]
    lease_seconds: u32,
    /// True for the single probe lease of a credential back from a cooldown: report its outcome.
    probe: bool,
    /// The fencing token (a positive integer): strictly greater than the fence of every earlier
    /// lease of this credential. Pass it upstream where the upstream can refuse stale writers,
    /// and with renew and release.
    fence: i64,
    /// The tenant holding the lease: the one the executor key belongs to (`default` for the
    /// configured internal key).
    tenant: String,
    /// With an `affinity_key`: `hit` (the credential bound to the conversation served it), `new`
    /// (the conversation had no live binding; it is bound now) or `moved` (the bound credential
    /// could not serve now; the conversation is bound to this one). Absent without an
    /// `affinity_key`, and in the answer of a retry that replays an earlier attempt's lease
    /// (`request_id`).
    #[serde(skip_serializing_if = "Option::is_none")]
    affinity: Option<AffinityResult>,
    /// The credential material, as the operator stored it.
    credential: Secret,
}

/// The lease length a body asked for (`None`: the default within `max`). Taken as any integer so
/// that a negative one gets the API's own range sentence, as 0 does, rather than the JSON
/// decoder's.
fn lease_seconds(requested: Option<i64>, max: u32) -> Result<LeaseSeconds, ApiError> {
    match requested {
        None => Ok(LeaseSeconds::default_within(max)),
        Some(seconds) => Ok(LeaseSeconds::parse(
            u64::try_from(seconds).unwrap_or(0),
            max,
        )?),
    }
}

/// Leases a credential: the best free one of the pool (`vip` falls back to `default`) that
/// serves the model.
#[utoipa::path(post, path = "/api/internal/allocate-key", tag = "executor",
    request_body = AllocateBody,
    security(("internal_key" = [])),
    responses(
        (status = 200, description = "leased: use it, then release", body = AllocateResponse),
        (status = 400, description = "`invalid_request`", body = ErrorBody),
        (status = 401, description = "`unauthorized`: missing or wrong key (answered before the body is read)", body = ErrorBody),
        (status = 403, description = "`pool_not_allowed`: the caller's tenant may not lease from this provider and pool (its `pools`); the same answer whether or not the pool exists", body = ErrorBody),
        (status = 404, description = "`pool_not_found`: no credentials for the provider and pool", body = ErrorBody),
        (status = 409, description = "`model_not_supported`, `no_usable_credentials` (every credential that serves the model waits for an operator), `request_id_conflict` (the request_id holds a live lease granted for other parameters), or `tokens_exceed_budget` (the `tokens` estimate is larger than a token window of every credential that serves the model, or of the caller's tenant)", body = ErrorBody),
        BodyRefusals,
        (status = 429, description = "`pool_exhausted`: candidates exist but none is free now (or none freed within `wait_ms`); `tenant_limit`: the caller's tenant holds as many live leases as its `max_concurrent_leases` allows, or a window of its `rate_limits` has no room", body = ErrorBody,
         headers(("Retry-After" = u64, description = "whole seconds (>= 1) until the earliest lease or cooldown among the candidates ends (`tenant_limit`: the earliest end of the tenant's own leases, or when its windows have room)"))),
        (status = 500, description = "`internal_error`", body = ErrorBody),
        (status = 503, description = "`store_unavailable`: PostgreSQL unreachable or too slow", body = ErrorBody),
    ))]
#[tracing::instrument(skip_all, fields(provider = %body.provider, pool = %body.pool, model = %body.model))]
async fn allocate(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<AllocateBody>,
) -> Result<Response, ApiError> {
    let tenant = caller.tenant().to_string();
    let (provider, pool) = (body.provider.clone(), body.pool.clone());
    // A refused request names its provider and pool in the metric labels only when the pool
    // exists (this process's view has credentials in it), so that no request can add series.
    let refused = |result| {
        let known = state.allocator.knows_pool(&provider, &pool);
        AllocationOutcome {
            provider: if known {
                provider.to_string()
            } else {
                String::new()
            },
            pool: if known {
                pool.to_string()
            } else {
                String::new()
            },
            served_pool: String::new(),
            tenant: tenant.clone(),
            result,
        }
    };
    let request = match allocate_request(body, state.max_lease_seconds, state.max_wait, &caller) {
        Ok(request) => request,
        Err(error) => {
            let result = match error {
                ApiError::PoolNotAllowed { .. } => ErrorCode::PoolNotAllowed.as_str(),
                _ => "bad_request",
            };
            let labels = refused(result);
            let mut response = error.into_response();
            response.extensions_mut().insert(labels);
            return Ok(response);
        }
    };
    // the request timeout bounds the work; a waiting request gets its wait on top
    let allocated = tokio::time::timeout(
        state.request_timeout + request.wait,
        state.allocator.allocate(&request),
    )
    .await
    .map_err(|_| ApiError::Timeout)?;
    let (mut response, labels) = match allocated {
        Ok(lease) => {
            let labels = AllocationOutcome {
                provider: provider.to_string(),
                pool: pool.to_string(),
                served_pool: lease.pool.to_string(),
                tenant: lease.tenant.clone(),
                result: "leased",
            };
            if let Some(result) = lease.affinity {
                crate::telemetry::affinity(provider.as_str(), pool.as_str(), result);
            }
            let body = AllocateResponse {
                key_id: lease.key_id,
                lease_id: lease.lease_id,
                provider: lease.provider,
                pool: lease.pool,
                provider_model: lease.provider_model,
                lease_until: lease.lease_until,
                lease_seconds: request.lease_seconds.get(),
                probe: lease.probe,
                fence: lease.fence,
                tenant: lease.tenant,
                affinity: lease.affinity,
                credential: lease.credential,
            };
            (Json(body).into_response(), labels)
        }
        Err(error) => {
            let labels = refused(error.result());
            let error = ApiError::from_allocate(error, &request);
            (error.into_response(), labels)
        }
    };
    response.extensions_mut().insert(labels);
    Ok(response)
}

/// `POST /api/internal/release-key` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct ReleaseBody {
    provider: ProviderName,
    /// The pool that served the lease.
    pool: PoolName,
    key_id: KeyId,
    lease_id: LeaseId,
    /// The lease's fence, from the allocate answer: a lease with another fence is not released
    /// (`mismatch`).
    #[schema(minimum = 1)]
    fence: Option<u64>,
    /// What happened upstream; drives the credential's health.
    outcome: Option<Outcome>,
    /// The provider's Retry-After in whole seconds, passed on with `rate_limited` or
    /// `quota_exhausted`; 0 means "use the default"; at most [`MAX_RETRY_AFTER_SECONDS`].
    retry_after_seconds: Option<u32>,
    /// What the call really used: `{"tokens": N}` (0..=10^9) replaces the lease's reservation in
    /// its credential's token windows (also for a lease that had expired, once).
    usage: Option<UsageBody>,
}

/// A release's `usage`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct UsageBody {
    /// Tokens used (prompt and completion together, as the provider counts them against its
    /// token limit).
    #[schema(minimum = 0, maximum = 1_000_000_000)]
    tokens: u64,
}

/// `{"released":true}` or `{"released":false,"reason":...}`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct ReleaseResponse {
    released: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<NotReleased>,
}

/// Releases a lease and reports the outcome of the upstream call.
#[utoipa::path(post, path = "/api/internal/release-key", tag = "executor",
    request_body = ReleaseBody,
    security(("internal_key" = [])),
    responses(
        (status = 200, description = "`released: true`, or `released: false` with `reason` `mismatch`, `expired` or `not_found` (nothing released)", body = ReleaseResponse),
        (status = 400, description = "`invalid_request`", body = ErrorBody),
        (status = 401, description = "`unauthorized`: missing or wrong key, or a key of another tenant than the lease's (nothing released or reported)", body = ErrorBody),
        BodyRefusals,
        (status = 503, description = "`store_unavailable`", body = ErrorBody),
    ))]
#[tracing::instrument(skip_all, fields(key_id = %body.key_id, lease_id = %body.lease_id))]
async fn release(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<ReleaseBody>,
) -> Result<Json<ReleaseResponse>, ApiError> {
    if body
        .retry_after_seconds
        .is_some_and(|s| s > MAX_RETRY_AFTER_SECONDS)
    {
        return Err(InvalidValue::new(
            "retry_after_seconds",
            format!("must be an integer from 0 to {MAX_RETRY_AFTER_SECONDS} (31 days)"),
        )
        .into());
    }
    let request = ReleaseRequest {
        lease: LeaseRef {
            key_id: body.key_id,
            provider: body.provider,
            pool: body.pool,
            lease_id: body.lease_id,
            fence: fence(body.fence)?,
        },
        outcome: body.outcome,
        retry_after_seconds: body.retry_after_seconds,
        usage_tokens: tokens(body.usage.map(|u| u.tokens), "usage.tokens")?,
        // the key is checked again by the release statement itself: a key revoked meanwhile,
        // or a key of another tenant than the lease's, releases nothing (the lease frees at its
        // lease_until)
        caller: caller.tenant_key(),
        may_disable: caller.reports_may_disable(),
    };
    let result = state.allocator.release(request.clone()).await?;
    let reason = result.released.err();
    if reason == Some(NotReleased::Unauthorized) {
        return Err(ApiError::Unauthorized);
    }
    crate::telemetry::release(
        reason.is_none(),
        match reason {
            None => "",
            Some(NotReleased::Mismatch) => "mismatch",
            Some(NotReleased::Expired) => "expired",
            Some(NotReleased::NotFound) => "not_found",
            Some(NotReleased::Unauthorized) => unreachable!("answered 401 above"),
        },
    );
    tracing::info!(released = reason.is_none(), reason = ?reason, outcome = ?request.outcome, "release");
    Ok(Json(ReleaseResponse {
        released: reason.is_none(),
        reason,
    }))
}

/// A fence from a request body: fences are positive and fit PostgreSQL's bigint.
fn fence(given: Option<u64>) -> Result<Option<i64>, ApiError> {
    given
        .map(|f| {
            i64::try_from(f)
                .ok()
                .filter(|f| *f >= 1)
                .ok_or_else(|| InvalidValue::new("fence", "must be an integer from 1 to 2^63-1"))
        })
        .transpose()
        .map_err(ApiError::from)
}

/// `POST /api/internal/renew-lease` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct RenewBody {
    provider: ProviderName,
    /// The pool that served the lease.
    pool: PoolName,
    key_id: KeyId,
    lease_id: LeaseId,
    /// The lease's fence, from the allocate answer: a lease with another fence is not renewed
    /// (410 `lease_lost`).
    #[schema(minimum = 1)]
    fence: Option<u64>,
    /// 1..=`--max-lease-seconds` from now (database clock); default 35.
    #[schema(value_type = Option<u64>, minimum = 1, maximum = 86400)]
    lease_seconds: Option<i64>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct RenewResponse {
    /// The new end of the lease (database clock).
    #[serde(with = "time::serde::rfc3339")]
    lease_until: OffsetDateTime,
}

/// Extends a lease that has not expired. Never brings back an expired one.
#[utoipa::path(post, path = "/api/internal/renew-lease", tag = "executor",
    request_body = RenewBody,
    security(("internal_key" = [])),
    responses(
        (status = 200, description = "renewed", body = RenewResponse),
        (status = 400, description = "`invalid_request`", body = ErrorBody),
        (status = 401, description = "`unauthorized`: missing or wrong key, or a key of another tenant than the lease's (nothing renewed)", body = ErrorBody),
        (status = 410, description = "`lease_lost`: expired, unknown, released or mismatched; stop using the credential", body = ErrorBody),
        BodyRefusals,
        (status = 503, description = "`store_unavailable`", body = ErrorBody),
    ))]
#[tracing::instrument(skip_all, fields(key_id = %body.key_id, lease_id = %body.lease_id))]
async fn renew(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<RenewBody>,
) -> Result<Json<RenewResponse>, ApiError> {
    let seconds = lease_seconds(body.lease_seconds, state.max_lease_seconds)?;
    let lease = LeaseRef {
        key_id: body.key_id,
        provider: body.provider,
        pool: body.pool,
        lease_id: body.lease_id,
        fence: fence(body.fence)?,
    };
    // the key is checked again by the renewal statement itself: a key revoked meanwhile, or a
    // key of another tenant than the lease's, renews nothing
    match state
        .allocator
        .renew(lease, seconds, caller.tenant_key())
        .await?
    {
        Renewed::Until(lease_until) => {
            crate::telemetry::renewal(true);
            Ok(Json(RenewResponse { lease_until }))
        }
        Renewed::Lost => {
            crate::telemetry::renewal(false);
            Err(ApiError::LeaseLost)
        }
        Renewed::Unauthorized => Err(ApiError::Unauthorized),
    }
}
