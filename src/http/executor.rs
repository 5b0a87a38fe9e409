//! Executor routes (`X-Internal-Key`): allocate, renew, release.

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use super::{ApiError, ApiJson, AppState, ExecutorKey};
use crate::allocation::AllocateRequest;
use crate::domain::{
    Holder, KeyId, LeaseId, LeaseSeconds, ModelName, Outcome, PoolName, ProviderName, Secret,
};
use crate::store::leases::{self, LeaseRef, NotReleased};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/internal/allocate-key", post(allocate))
        .route("/api/internal/release-key", post(release))
        .route("/api/internal/renew-lease", post(renew))
}

/// `POST /api/internal/allocate-key` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AllocateBody {
    provider: ProviderName,
    model: ModelName,
    #[serde(default)]
    pool: PoolName,
    /// 1..=max_lease_seconds; default 35.
    lease_seconds: Option<u64>,
    holder: Option<Holder>,
}

/// A granted lease.
#[derive(Debug, Serialize)]
struct AllocateResponse {
    key_id: KeyId,
    lease_id: LeaseId,
    provider: ProviderName,
    /// The pool that served.
    pool: PoolName,
    provider_model: ModelName,
    #[serde(with = "time::serde::rfc3339")]
    lease_until: OffsetDateTime,
    credential: Secret,
}

fn lease_seconds(requested: Option<u64>, max: u32) -> Result<LeaseSeconds, ApiError> {
    match requested {
        None => Ok(LeaseSeconds::default_within(max)),
        Some(seconds) => Ok(LeaseSeconds::parse(seconds, max)?),
    }
}

#[tracing::instrument(skip_all, fields(provider = %body.provider, pool = %body.pool, model = %body.model))]
async fn allocate(
    State(state): State<AppState>,
    _key: ExecutorKey,
    ApiJson(body): ApiJson<AllocateBody>,
) -> Result<Json<AllocateResponse>, ApiError> {
    let request = AllocateRequest {
        lease_seconds: lease_seconds(body.lease_seconds, state.max_lease_seconds)?,
        provider: body.provider,
        model: body.model,
        pool: body.pool,
        holder: body.holder,
    };
    let lease = state.allocator.allocate(&request).await?;
    Ok(Json(AllocateResponse {
        key_id: lease.key_id,
        lease_id: lease.lease_id,
        provider: lease.provider,
        pool: lease.pool,
        provider_model: lease.provider_model,
        lease_until: lease.lease_until,
        credential: lease.credential,
    }))
}

/// `POST /api/internal/release-key` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseBody {
    provider: ProviderName,
    pool: PoolName,
    key_id: KeyId,
    lease_id: LeaseId,
    outcome: Option<Outcome>,
}

/// `{"released":true}` or `{"released":false,"reason":...}`.
#[derive(Debug, Serialize)]
struct ReleaseResponse {
    released: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<NotReleased>,
}

#[tracing::instrument(skip_all, fields(key_id = %body.key_id, lease_id = %body.lease_id))]
async fn release(
    State(state): State<AppState>,
    _key: ExecutorKey,
    ApiJson(body): ApiJson<ReleaseBody>,
) -> Result<Json<ReleaseResponse>, ApiError> {
    let lease = LeaseRef {
        key_id: body.key_id,
        provider: body.provider,
        pool: body.pool,
        lease_id: body.lease_id,
    };
    let result = leases::release(&state.db, &lease, body.outcome).await?;
    tracing::info!(released = result.is_ok(), reason = ?result.err(), "release");
    Ok(Json(ReleaseResponse {
        released: result.is_ok(),
        reason: result.err(),
    }))
}

/// `POST /api/internal/renew-lease` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RenewBody {
    provider: ProviderName,
    pool: PoolName,
    key_id: KeyId,
    lease_id: LeaseId,
    /// 1..=max_lease_seconds from now (database clock); default 35.
    lease_seconds: Option<u64>,
}

#[derive(Debug, Serialize)]
struct RenewResponse {
    #[serde(with = "time::serde::rfc3339")]
    lease_until: OffsetDateTime,
}

#[tracing::instrument(skip_all, fields(key_id = %body.key_id, lease_id = %body.lease_id))]
async fn renew(
    State(state): State<AppState>,
    _key: ExecutorKey,
    ApiJson(body): ApiJson<RenewBody>,
) -> Result<Json<RenewResponse>, ApiError> {
    let seconds = lease_seconds(body.lease_seconds, state.max_lease_seconds)?;
    let lease = LeaseRef {
        key_id: body.key_id,
        provider: body.provider,
        pool: body.pool,
        lease_id: body.lease_id,
    };
    match leases::renew(&state.db, &lease, seconds).await? {
        Some(lease_until) => Ok(Json(RenewResponse { lease_until })),
        None => Err(ApiError::LeaseLost),
    }
}
