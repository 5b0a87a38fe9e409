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
use crate::store::leases::{self, LeaseRef, NotReleased, ReleaseRequest};

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
    /// The model name as this credential serves it (an alias resolved).
    provider_model: String,
    #[serde(with = "time::serde::rfc3339")]
    lease_until: OffsetDateTime,
    /// True for the single probe lease of a credential back from a cooldown: report its outcome.
    probe: bool,
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
        probe: lease.probe,
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
    /// The provider's Retry-After in whole seconds, passed on with `rate_limited` or
    /// `quota_exhausted`; 0 means "use the default".
    retry_after_seconds: Option<u32>,
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
    let request = ReleaseRequest {
        lease: LeaseRef {
            key_id: body.key_id,
            provider: body.provider,
            pool: body.pool,
            lease_id: body.lease_id,
        },
        outcome: body.outcome,
        retry_after_seconds: body.retry_after_seconds,
    };
    let result = leases::release(&state.db, &request, &state.health).await?;
    let lease = &request.lease;
    state.allocator.views().note_release(
        &lease.provider,
        &lease.pool,
        &lease.key_id,
        result.released.is_ok(),
        result.health.map(|(_, health)| health),
    );
    tracing::info!(released = result.released.is_ok(), reason = ?result.released.err(), outcome = ?request.outcome, "release");
    Ok(Json(ReleaseResponse {
        released: result.released.is_ok(),
        reason: result.released.err(),
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
