//! Operator routes (`X-Admin-Key`).

use std::collections::BTreeMap;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::put;
use axum::{Json, Router};
use serde::Deserialize;

use super::{AdminKey, ApiError, ApiJson, AppState};
use crate::domain::{InvalidValue, KeyId, ModelName, PoolName, ProviderName, Secret, Status};
use crate::store::credentials::{self, CredentialSpec, CredentialView};

/// Most models one credential may list.
pub const MAX_MODELS: usize = 256;

pub(super) fn routes() -> Router<AppState> {
    Router::new().route("/api/admin/keys/{key_id}", put(put_key))
}

/// `PUT /api/admin/keys/{key_id}` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PutKeyBody {
    provider: ProviderName,
    #[serde(default)]
    pool: PoolName,
    models: Vec<ModelName>,
    /// Request model name -> one of `models` (`{"gpt-4o": "gpt-4o-2024-08-06"}`).
    #[serde(default)]
    aliases: BTreeMap<ModelName, ModelName>,
    max_concurrent_uses: u64,
    status: Option<Status>,
    secret: Secret,
}

/// Creates (201) or updates (200) a credential. The response is the stored credential without its
/// secret; no route ever returns a secret except to the executor that holds a lease.
#[tracing::instrument(skip_all, fields(key_id = %key_id))]
async fn put_key(
    State(state): State<AppState>,
    _key: AdminKey,
    Path(key_id): Path<String>,
    ApiJson(body): ApiJson<PutKeyBody>,
) -> Result<(StatusCode, Json<CredentialView>), ApiError> {
    let key_id = KeyId::parse(key_id)?;
    if body.models.is_empty() || body.models.len() > MAX_MODELS {
        return Err(
            InvalidValue::new("models", format!("must list 1 to {MAX_MODELS} models")).into(),
        );
    }
    if body.aliases.len() > MAX_MODELS {
        return Err(
            InvalidValue::new("aliases", format!("may map at most {MAX_MODELS} names")).into(),
        );
    }
    if let Some((alias, _)) = body
        .aliases
        .iter()
        .find(|(_, target)| !body.models.contains(target))
    {
        return Err(InvalidValue::new(
            "aliases",
            format!("`{alias}` must map to one of the credential's models"),
        )
        .into());
    }
    let max_concurrent_uses = match i32::try_from(body.max_concurrent_uses) {
        Ok(n) if (1..=10_000).contains(&n) => n,
        _ => {
            return Err(InvalidValue::new(
                "max_concurrent_uses",
                "must be an integer from 1 to 10000",
            )
            .into());
        }
    };
    if matches!(body.status, Some(Status::RateLimited | Status::Cooldown)) {
        return Err(InvalidValue::new(
            "status",
            "rate_limited and cooldown come from outcome reports (they need a cooldown end); set available, pending, disabled or exhausted",
        )
        .into());
    }
    let spec = CredentialSpec {
        key_id,
        provider: body.provider,
        pool: body.pool,
        models: body.models,
        aliases: body.aliases,
        max_concurrent_uses,
        status: body.status,
        secret: body.secret,
    };
    let (view, created) = credentials::upsert(&state.db, &spec).await?;
    tracing::info!(created, "credential stored");
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(view)))
}
