//! Operator routes for tenants (`X-Admin-Key`): create or update a tenant and its cap, list
//! tenants with their usage, delete one, mint and revoke its executor keys. A key is returned
//! once, by the POST that mints it; only its SHA-256 is stored, and no route, log line, metric
//! or trail row ever carries it again.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::admin::Operator;
use super::{ApiError, ApiJson, ApiPath, AppState, BodyRefusals, ErrorBody, OperatorRefusals};
use crate::domain::windows::RateLimits;
use crate::domain::{InvalidValue, PoolPattern, TenantId, TenantScope};
use crate::store::tenants::{self, DeleteRefused, TenantDetail, TenantSpec};

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_tenants))
        .routes(routes!(put_tenant, delete_tenant))
        .routes(routes!(mint_key))
        .routes(routes!(revoke_key))
}

/// The largest cap a tenant may have (the number of its slot rows).
const MAX_CAP: u64 = 100_000;
/// The largest weight.
const MAX_WEIGHT: u64 = 1000;

fn tenant_id(raw: String) -> Result<TenantId, ApiError> {
    Ok(TenantId::parse(raw)?)
}

/// `PUT /api/admin/tenants/{tenant_id}` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct TenantInput {
    /// Live leases the tenant may hold at once over every credential, 1..=100000; absent or
    /// `null`: no cap. Decided in the claim across every replica; at the cap an allocate gets
    /// 429 `tenant_limit`. Lowering it under load revokes nothing: the tenant grants nothing
    /// until it is back under. 0 is refused (400 `invalid_request`): a tenant that may hold no
    /// lease would be answered 429 forever; revoke its keys instead.
    #[schema(minimum = 1, maximum = 100000)]
    max_concurrent_leases: Option<u64>,
    /// Its share of a saturated pool, 1..=1000 (default 1): when requests wait (`wait_ms`), a
    /// freed slot goes to the waiting tenant furthest below its weighted share.
    #[schema(minimum = 1, maximum = 1000)]
    weight: Option<u64>,
    /// Rate windows over all the tenant's leases, like a credential's (`[{"requests": N,
    /// "seconds": S}, {"tokens": N, "seconds": S}]`, up to 8): decided in the claim across every
    /// replica; without room an allocate gets 429 `tenant_limit`, and an estimate larger than a
    /// token window 409 `tokens_exceed_budget`. Absent: none.
    rate_limits: Option<RateLimits>,
    /// The providers and pools the tenant's keys may lease from, up to 64 `provider/pool`
    /// patterns whose halves are names or `*`: `["openai/*", "anthropic/default"]`, `["*/*"]`
    /// for everything. Absent or `[]`: none (every allocate answers 403 `pool_not_allowed`
    /// until an operator names its pools). A `vip` request falls back to `default` only when
    /// both are in it. Not settable for `default` (the internal key leases from every pool).
    #[schema(value_type = Option<Vec<String>>, example = json!(["openai/*"]))]
    pools: Option<Vec<PoolPattern>>,
    /// Whether an outcome report of the tenant's leases alone may take a credential out of
    /// traffic until an operator acts: `auth_error` disables it, `quota_exhausted` without
    /// `retry_after_seconds` rests it with no end. Default `false`: such a report rests the
    /// credential for a bounded time instead (docs/src/security.md). Not settable for `default`
    /// (the internal key's reports always could).
    reports_may_disable: Option<bool>,
}

/// Creates (201) or updates (200) a tenant and fits its slot rows to its cap, in one
/// transaction, with a `tenant_events` trail row.
#[utoipa::path(put, path = "/api/admin/tenants/{tenant_id}", tag = "operator",
    request_body = TenantInput,
    security(("admin_key" = [])),
    params(("X-Operator" = Option<String>, Header, description = "who you are, for the audit trail (default `admin-key`)"), ("tenant_id" = String, Path, description = "the tenant: 1..=64 of `a-z 0-9 . _ -`")),
    responses(
        (status = 200, description = "updated", body = TenantDetail),
        (status = 201, description = "created", body = TenantDetail),
        (status = 400, description = "`invalid_request` (changes nothing)", body = ErrorBody),
        OperatorRefusals,
        BodyRefusals,
    ))]
#[tracing::instrument(skip_all, fields(tenant_id = %raw))]
async fn put_tenant(
    State(state): State<AppState>,
    Operator(actor): Operator,
    ApiPath(raw): ApiPath<String>,
    ApiJson(body): ApiJson<TenantInput>,
) -> Result<(StatusCode, Json<TenantDetail>), ApiError> {
    let tenant_id = tenant_id(raw)?;
    let max_concurrent_leases = body
        .max_concurrent_leases
        .map(|cap| {
            (1..=MAX_CAP)
                .contains(&cap)
                .then_some(cap as i32)
                .ok_or_else(|| {
                    InvalidValue::new(
                        "max_concurrent_leases",
                        format!("must be an integer from 1 to {MAX_CAP}, or null for no cap"),
                    )
                })
        })
        .transpose()?;
    let weight = match body.weight {
        None => 1,
        Some(w) if (1..=MAX_WEIGHT).contains(&w) => w as i32,
        Some(_) => {
            return Err(InvalidValue::new(
                "weight",
                format!("must be an integer from 1 to {MAX_WEIGHT}"),
            )
            .into());
        }
    };
    // the internal key's tenant: it leases from every pool and its reports have full reach,
    // whatever a row says (its key is compared in process, no row is read)
    let is_default = tenant_id == TenantId::default_tenant();
    if is_default && (body.pools.is_some() || body.reports_may_disable.is_some()) {
        return Err(InvalidValue::new(
            "pools",
            "the default tenant is the internal key's: it leases from every pool and its reports may disable credentials; mint tenant keys for executors that should have less (pools and reports_may_disable are not settable for default)",
        )
        .into());
    }
    let (pools, reports_may_disable) = if is_default {
        (TenantScope::everything(), true)
    } else {
        (
            TenantScope::new(body.pools.unwrap_or_default())?,
            body.reports_may_disable.unwrap_or(false),
        )
    };
    let spec = TenantSpec {
        tenant_id,
        max_concurrent_leases,
        weight,
        rate_limits: body.rate_limits.unwrap_or_default(),
        pools,
        reports_may_disable,
    };
    let (detail, created) = tenants::upsert(&state.db, &spec, &actor).await?;
    tracing::info!(created, actor = actor.as_str(), "tenant stored");
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(detail)))
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct TenantList {
    tenants: Vec<TenantDetail>,
}

/// Lists every tenant with its cap and its live leases now (`in_flight`), and its keys' ids.
#[utoipa::path(get, path = "/api/admin/tenants", tag = "operator",
    security(("admin_key" = [])),
    responses(
        (status = 200, description = "every tenant", body = TenantList),
        OperatorRefusals,
    ))]
async fn list_tenants(
    State(state): State<AppState>,
    _operator: Operator,
) -> Result<Json<TenantList>, ApiError> {
    Ok(Json(TenantList {
        tenants: tenants::list(&state.db).await?,
    }))
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct TenantDeleted {
    deleted: bool,
}

/// Deletes a tenant and its keys (refused from the commit on). Refused for `default` and for a
/// tenant holding live leases (409 `tenant_in_use`).
#[utoipa::path(delete, path = "/api/admin/tenants/{tenant_id}", tag = "operator",
    security(("admin_key" = [])),
    params(("X-Operator" = Option<String>, Header, description = "who you are, for the audit trail (default `admin-key`)"), ("tenant_id" = String, Path, description = "the tenant")),
    responses(
        (status = 200, description = "deleted", body = TenantDeleted),
        (status = 400, description = "`invalid_request`", body = ErrorBody),
        OperatorRefusals,
        (status = 404, description = "`tenant_not_found`", body = ErrorBody),
        (status = 409, description = "`tenant_in_use`: `default`, or it holds live leases", body = ErrorBody),
    ))]
#[tracing::instrument(skip_all, fields(tenant_id = %raw))]
async fn delete_tenant(
    State(state): State<AppState>,
    Operator(actor): Operator,
    ApiPath(raw): ApiPath<String>,
) -> Result<Json<TenantDeleted>, ApiError> {
    let tenant_id = tenant_id(raw)?;
    match tenants::delete(&state.db, &tenant_id, &actor).await? {
        Ok(()) => {
            tracing::info!(actor = actor.as_str(), "tenant deleted");
            Ok(Json(TenantDeleted { deleted: true }))
        }
        Err(DeleteRefused::NotFound) => Err(ApiError::TenantNotFound),
        Err(DeleteRefused::Default) => Err(ApiError::TenantInUse(
            "the default tenant (the internal key's) cannot be deleted",
        )),
        Err(DeleteRefused::HoldsLeases) => Err(ApiError::TenantInUse(
            "the tenant holds live leases; delete it once they have ended",
        )),
    }
}

/// A newly minted executor key: shown here, once.
#[derive(Serialize, utoipa::ToSchema)]
struct MintedKey {
    /// The key's id, to revoke it with.
    key_id: Uuid,
    /// The tenant.
    tenant_id: String,
    /// The executor key (`cpk_` and 64 hex digits), for `X-Internal-Key`. Shown only in this
    /// answer: credpool keeps only its SHA-256.
    key: String,
}

/// Mints an executor key for the tenant (201). The answer is the only place the key ever
/// appears.
#[utoipa::path(post, path = "/api/admin/tenants/{tenant_id}/keys", tag = "operator",
    security(("admin_key" = [])),
    params(("X-Operator" = Option<String>, Header, description = "who you are, for the audit trail (default `admin-key`)"), ("tenant_id" = String, Path, description = "the tenant")),
    responses(
        (status = 201, description = "minted", body = MintedKey),
        (status = 400, description = "`invalid_request`", body = ErrorBody),
        OperatorRefusals,
        (status = 404, description = "`tenant_not_found`", body = ErrorBody),
    ))]
#[tracing::instrument(skip_all, fields(tenant_id = %raw))]
async fn mint_key(
    State(state): State<AppState>,
    Operator(actor): Operator,
    ApiPath(raw): ApiPath<String>,
) -> Result<(StatusCode, Json<MintedKey>), ApiError> {
    let tenant_id = tenant_id(raw)?;
    let (key_id, key) = tenants::mint_key(&state.db, &tenant_id, &actor)
        .await?
        .ok_or(ApiError::TenantNotFound)?;
    tracing::info!(key_id = %key_id, actor = actor.as_str(), "tenant key minted");
    Ok((
        StatusCode::CREATED,
        Json(MintedKey {
            key_id,
            tenant_id: tenant_id.to_string(),
            key: key.expose().to_owned(),
        }),
    ))
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct KeyRevoked {
    revoked: bool,
}

/// Revokes a tenant's executor key: once this answers, no request with it succeeds on any
/// replica.
#[utoipa::path(delete, path = "/api/admin/tenants/{tenant_id}/keys/{key_id}", tag = "operator",
    security(("admin_key" = [])),
    params(("X-Operator" = Option<String>, Header, description = "who you are, for the audit trail (default `admin-key`)"), ("tenant_id" = String, Path, description = "the tenant"), ("key_id" = Uuid, Path, description = "the key's id")),
    responses(
        (status = 200, description = "revoked", body = KeyRevoked),
        (status = 400, description = "`invalid_request`", body = ErrorBody),
        OperatorRefusals,
        (status = 404, description = "`tenant_key_not_found`: no live key with this id", body = ErrorBody),
    ))]
#[tracing::instrument(skip_all, fields(tenant_id = %raw.0, key_id = %raw.1))]
async fn revoke_key(
    State(state): State<AppState>,
    Operator(actor): Operator,
    ApiPath(raw): ApiPath<(String, String)>,
) -> Result<Json<KeyRevoked>, ApiError> {
    let tenant_id = tenant_id(raw.0)?;
    let key_id = Uuid::parse_str(&raw.1)
        .map_err(|_| InvalidValue::new("key_id", "must be a key id (a UUID)"))?;
    if !tenants::revoke_key(&state.db, &tenant_id, key_id, &actor).await? {
        return Err(ApiError::TenantKeyNotFound);
    }
    tracing::info!(actor = actor.as_str(), "tenant key revoked");
    Ok(Json(KeyRevoked { revoked: true }))
}
