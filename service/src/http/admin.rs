//! Operator routes (`X-Admin-Key`; the executor key gets 403). Every mutation is audited with the
//! operator's name from `X-Operator` (default `admin-key`). No route returns a secret.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{
    AdminKey, ApiError, ApiJson, ApiPath, ApiQuery, AppState, BodyRefusals, ErrorBody,
    OperatorRefusals,
};
use crate::domain::{InvalidValue, KeyId, LeaseId, ModelName, PoolName, ProviderName, Status};
use crate::store::credentials::{
    self, Actor, CredentialDetail, CredentialInput, ForceReleaseOutcome, ForcedRelease, ListFilter,
    Patch, PatchOutcome, PoolSummary, StateChange,
};

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_keys))
        .routes(routes!(put_key, get_key, patch_key, delete_key))
        .routes(routes!(release_all))
        .routes(routes!(release_lease))
        .routes(routes!(pools))
}

/// The admin key, and who is using it (`X-Operator`, else `admin-key`).
pub struct Operator(pub Actor);

impl axum::extract::FromRequestParts<AppState> for Operator {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, ApiError> {
        AdminKey::from_request_parts(parts, state).await?;
        let name = match parts.headers.get("x-operator") {
            None => "admin-key".to_owned(),
            Some(value) => value
                .to_str()
                .map_err(|_| InvalidValue::new("X-Operator", "must be printable ASCII"))?
                .to_owned(),
        };
        Ok(Operator(Actor::parse(name)?))
    }
}

fn key_id(raw: String) -> Result<KeyId, ApiError> {
    Ok(KeyId::parse(raw)?)
}

/// An operator's reason: 1..=500 printable characters.
fn reason(raw: &str) -> Result<String, ApiError> {
    let len = raw.chars().count();
    if len == 0 || len > 500 || raw.chars().any(char::is_control) {
        return Err(InvalidValue::new("reason", "must be 1 to 500 printable characters").into());
    }
    Ok(raw.to_owned())
}

/// `If-Match: <generation>` (or `"<generation>"`): the OAuth token generation a PUT replaces.
fn if_match_generation(headers: &axum::http::HeaderMap) -> Result<Option<i64>, ApiError> {
    let Some(value) = headers.get(axum::http::header::IF_MATCH) else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .map(|v| v.trim().trim_matches('"'))
        .and_then(|v| v.parse::<i64>().ok())
        .filter(|g| *g >= 1)
        .map(Some)
        .ok_or_else(|| {
            InvalidValue::new(
                "If-Match",
                "must be an OAuth token generation (an integer from 1)",
            )
            .into()
        })
}

/// Creates (201) or updates (200) a credential. The response is the stored credential without its
/// secret; no route ever returns a secret except to the executor that holds a lease.
#[utoipa::path(put, path = "/api/admin/keys/{key_id}", tag = "operator",
    request_body = CredentialInput,
    security(("admin_key" = [])),
    params(("X-Operator" = Option<String>, Header, description = "who you are, for the audit trail (default `admin-key`)"), ("If-Match" = Option<i64>, Header, description = "OAuth: the token generation this PUT replaces; 412 `generation_moved` when it moved"), ("key_id" = KeyId, Path, description = "the credential")),
    responses(
        (status = 200, description = "updated", body = CredentialDetail),
        (status = 409, description = "`provider_changed`: the credential exists under another provider (delete it and add it again to move it)", body = ErrorBody),
        (status = 412, description = "`generation_moved`: If-Match names another generation", body = ErrorBody),
        (status = 201, description = "created", body = CredentialDetail),
        (status = 400, description = "`invalid_request`; `token_url_not_allowed`: an OAuth `token_url` that is neither https nor http on a loopback address, or an https one whose host is or resolves to a private, loopback or link-local address (unless --oauth-allow-private-token-urls)", body = ErrorBody),
        OperatorRefusals,
        BodyRefusals,
    ))]
#[tracing::instrument(skip_all, fields(key_id = %raw_key_id))]
async fn put_key(
    State(state): State<AppState>,
    Operator(actor): Operator,
    ApiPath(raw_key_id): ApiPath<String>,
    headers: axum::http::HeaderMap,
    ApiJson(body): ApiJson<CredentialInput>,
) -> Result<(StatusCode, Json<CredentialDetail>), ApiError> {
    let key_id = key_id(raw_key_id)?;
    let if_generation = if_match_generation(&headers)?;
    if let Some(oauth) = &body.oauth {
        crate::oauth::check_token_url_reach(&oauth.token_url, state.allow_private_token_urls)
            .await
            .map_err(|e| ApiError::TokenUrlNotAllowed(e.to_string()))?;
    }
    let spec = body.into_spec(key_id, &state.keyring)?;
    let (detail, created) =
        credentials::upsert(&state.db, &spec, &actor, &state.health, if_generation).await?;
    tracing::info!(created, actor = actor.as_str(), "credential stored");
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(detail)))
}

/// `GET /api/admin/keys` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct ListQuery {
    provider: Option<ProviderName>,
    pool: Option<PoolName>,
    status: Option<Status>,
    /// The `next_after` of the previous page.
    after: Option<KeyId>,
    /// 1..=1000, default 100.
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<u32>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct KeyPage {
    keys: Vec<CredentialDetail>,
    /// Pass as `after` for the next page; `null` on the last page.
    next_after: Option<String>,
}

/// Lists credentials (filters: provider, pool, status), in key_id order, a page at a time.
#[utoipa::path(get, path = "/api/admin/keys", tag = "operator",
    security(("admin_key" = [])),
    params(ListQuery),
    responses(
        (status = 200, description = "a page of credentials", body = KeyPage),
        (status = 400, description = "`invalid_request`", body = ErrorBody),
        OperatorRefusals,
    ))]
async fn list_keys(
    State(state): State<AppState>,
    _operator: Operator,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Json<KeyPage>, ApiError> {
    let limit = query.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(InvalidValue::new("limit", "must be an integer from 1 to 1000").into());
    }
    let filter = ListFilter {
        provider: query.provider,
        pool: query.pool,
        status: query.status,
        after: query.after,
        limit,
    };
    let keys = credentials::list(&state.db, &filter, &state.health).await?;
    let next_after = (keys.len() == limit as usize)
        .then(|| keys.last().map(|k| k.key_id.clone()))
        .flatten();
    Ok(Json(KeyPage { keys, next_after }))
}

/// One credential: configuration, status, cooldown, health figures and in-flight leases.
#[utoipa::path(get, path = "/api/admin/keys/{key_id}", tag = "operator",
    security(("admin_key" = [])),
    params(("key_id" = KeyId, Path, description = "the credential")),
    responses(
        (status = 200, description = "the credential", body = CredentialDetail),
        (status = 400, description = "`invalid_request`", body = ErrorBody),
        (status = 404, description = "`credential_not_found`", body = ErrorBody),
        OperatorRefusals,
    ))]
async fn get_key(
    State(state): State<AppState>,
    _operator: Operator,
    ApiPath(raw_key_id): ApiPath<String>,
) -> Result<Json<CredentialDetail>, ApiError> {
    let key_id = key_id(raw_key_id)?;
    credentials::get(&state.db, &key_id, &state.health)
        .await?
        .map(Json)
        .ok_or(ApiError::CredentialNotFound)
}

/// `PATCH /api/admin/keys/{key_id}` body: any of the fields.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct PatchBody {
    /// `disable`, `enable` or `drain`.
    state: Option<StateChange>,
    /// Why (kept as the status reason and in the audit trail).
    reason: Option<String>,
    #[schema(minimum = 1, maximum = 10000)]
    max_concurrent_uses: Option<u64>,
    models: Option<Vec<ModelName>>,
    aliases: Option<BTreeMap<ModelName, ModelName>>,
    pool: Option<PoolName>,
    /// New rate windows (`[]` removes them): at most `requests` grants, or `tokens`
    /// reserved-or-used, in any `seconds`.
    rate_limits: Option<crate::domain::windows::RateLimits>,
}

/// Changes a credential while traffic flows: state (disable, enable, drain), limit, models,
/// aliases, pool, rate windows.
#[utoipa::path(patch, path = "/api/admin/keys/{key_id}", tag = "operator",
    request_body = PatchBody,
    security(("admin_key" = [])),
    params(("X-Operator" = Option<String>, Header, description = "who you are, for the audit trail (default `admin-key`)"), ("key_id" = KeyId, Path, description = "the credential")),
    responses(
        (status = 200, description = "changed", body = CredentialDetail),
        (status = 400, description = "`invalid_request`", body = ErrorBody),
        (status = 404, description = "`credential_not_found`", body = ErrorBody),
        OperatorRefusals,
        BodyRefusals,
    ))]
#[tracing::instrument(skip_all, fields(key_id = %raw_key_id))]
async fn patch_key(
    State(state): State<AppState>,
    Operator(actor): Operator,
    ApiPath(raw_key_id): ApiPath<String>,
    ApiJson(body): ApiJson<PatchBody>,
) -> Result<Json<CredentialDetail>, ApiError> {
    let key_id = key_id(raw_key_id)?;
    if body.state.is_none()
        && body.max_concurrent_uses.is_none()
        && body.models.is_none()
        && body.aliases.is_none()
        && body.pool.is_none()
        && body.rate_limits.is_none()
    {
        return Err(ApiError::InvalidRequest(
            "nothing to change: give state, max_concurrent_uses, models, aliases, pool or rate_limits"
                .into(),
        ));
    }
    let patch = Patch {
        state: body.state,
        reason: body.reason.as_deref().map(reason).transpose()?,
        max_concurrent_uses: body
            .max_concurrent_uses
            .map(credentials::check_limit)
            .transpose()?,
        models: body.models,
        aliases: body.aliases,
        pool: body.pool,
        rate_limits: body.rate_limits,
    };
    match credentials::patch(&state.db, &key_id, &patch, &actor, &state.health).await? {
        PatchOutcome::Changed(detail) => {
            tracing::info!(actor = actor.as_str(), "credential changed");
            Ok(Json(*detail))
        }
        PatchOutcome::Invalid(invalid) => Err(invalid.into()),
        PatchOutcome::NotFound => Err(ApiError::CredentialNotFound),
    }
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct Deleted {
    deleted: bool,
    /// Leases that were in flight, ended as `force_released` in the trail.
    force_released: Vec<ForcedRelease>,
}

/// Deletes a credential and its lease state in one transaction; history stays in the trail.
#[utoipa::path(delete, path = "/api/admin/keys/{key_id}", tag = "operator",
    security(("admin_key" = [])),
    params(("X-Operator" = Option<String>, Header, description = "who you are, for the audit trail (default `admin-key`)"), ("key_id" = KeyId, Path, description = "the credential")),
    responses(
        (status = 200, description = "deleted", body = Deleted),
        (status = 400, description = "`invalid_request`", body = ErrorBody),
        (status = 404, description = "`credential_not_found`", body = ErrorBody),
        OperatorRefusals,
    ))]
#[tracing::instrument(skip_all, fields(key_id = %raw_key_id))]
async fn delete_key(
    State(state): State<AppState>,
    Operator(actor): Operator,
    ApiPath(raw_key_id): ApiPath<String>,
) -> Result<Json<Deleted>, ApiError> {
    let key_id = key_id(raw_key_id)?;
    let force_released = credentials::delete(&state.db, &key_id, &actor)
        .await?
        .ok_or(ApiError::CredentialNotFound)?;
    tracing::info!(
        actor = actor.as_str(),
        force_released = force_released.len(),
        "credential deleted"
    );
    Ok(Json(Deleted {
        deleted: true,
        force_released,
    }))
}

/// Body of the forced-release routes.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct ForceReleaseBody {
    /// Why; recorded with each `force_released` trail row.
    reason: String,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct ReleasedAll {
    released: usize,
    leases: Vec<ForcedRelease>,
}

/// Force-releases every in-flight lease of one credential.
#[utoipa::path(post, path = "/api/admin/keys/{key_id}/release-all", tag = "operator",
    request_body = ForceReleaseBody,
    security(("admin_key" = [])),
    params(("X-Operator" = Option<String>, Header, description = "who you are, for the audit trail (default `admin-key`)"), ("key_id" = KeyId, Path, description = "the credential")),
    responses(
        (status = 200, description = "released", body = ReleasedAll),
        (status = 400, description = "`invalid_request`", body = ErrorBody),
        (status = 404, description = "`credential_not_found`", body = ErrorBody),
        OperatorRefusals,
        BodyRefusals,
    ))]
#[tracing::instrument(skip_all, fields(key_id = %raw_key_id))]
async fn release_all(
    State(state): State<AppState>,
    Operator(actor): Operator,
    ApiPath(raw_key_id): ApiPath<String>,
    ApiJson(body): ApiJson<ForceReleaseBody>,
) -> Result<Json<ReleasedAll>, ApiError> {
    let key_id = key_id(raw_key_id)?;
    let reason = reason(&body.reason)?;
    let leases = credentials::release_all(&state.db, &key_id, &reason, &actor)
        .await?
        .ok_or(ApiError::CredentialNotFound)?;
    tracing::info!(
        actor = actor.as_str(),
        released = leases.len(),
        "leases force-released"
    );
    Ok(Json(ReleasedAll {
        released: leases.len(),
        leases,
    }))
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct LeaseReleased {
    released: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<ForceReleaseOutcome>,
}

/// Force-releases one lease by id. (There is no route without a lease id: "all" is always the
/// explicit `release-all` of one credential.)
#[utoipa::path(post, path = "/api/admin/leases/{lease_id}/release", tag = "operator",
    request_body = ForceReleaseBody,
    security(("admin_key" = [])),
    params(("X-Operator" = Option<String>, Header, description = "who you are, for the audit trail (default `admin-key`)"), ("lease_id" = LeaseId, Path, description = "the lease")),
    responses(
        (status = 200, description = "`released: true`, or `released: false` with `reason` `expired` or `not_found`", body = LeaseReleased),
        (status = 400, description = "`invalid_request`", body = ErrorBody),
        OperatorRefusals,
        BodyRefusals,
    ))]
#[tracing::instrument(skip_all, fields(lease_id = %raw_lease_id))]
async fn release_lease(
    State(state): State<AppState>,
    Operator(actor): Operator,
    ApiPath(raw_lease_id): ApiPath<String>,
    ApiJson(body): ApiJson<ForceReleaseBody>,
) -> Result<Json<LeaseReleased>, ApiError> {
    let lease_id = LeaseId::parse(&raw_lease_id)?;
    let reason = reason(&body.reason)?;
    let outcome = credentials::force_release_lease(&state.db, lease_id, &reason, &actor).await?;
    tracing::info!(actor = actor.as_str(), outcome = ?outcome, "forced release");
    Ok(Json(LeaseReleased {
        released: outcome == ForceReleaseOutcome::Released,
        reason: (outcome != ForceReleaseOutcome::Released).then_some(outcome),
    }))
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct Pools {
    pools: Vec<PoolSummary>,
}

/// Every (provider, pool): credentials by status, slots, in-flight leases, cooling down.
#[utoipa::path(get, path = "/api/admin/pools", tag = "operator",
    security(("admin_key" = [])),
    responses(
        (status = 200, description = "every pool", body = Pools),
        OperatorRefusals,
    ))]
async fn pools(
    State(state): State<AppState>,
    _operator: Operator,
) -> Result<Json<Pools>, ApiError> {
    Ok(Json(Pools {
        pools: credentials::pools(&state.db).await?,
    }))
}
