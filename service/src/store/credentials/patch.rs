//! Changing part of a credential (`PATCH /api/admin/keys/{key_id}`; `credpool keys disable`,
//! `enable`, `drain`, `rate-limits`): disable, enable or drain it, or change its limit, models,
//! aliases, pool or rate windows.

use std::collections::BTreeMap;

use super::read::{CredentialDetail, details_one};
use super::validation::check_models;
use super::{Actor, audit, configuration, lock_credential, provider_of};
use crate::domain::health::HealthPolicy;
use crate::domain::windows::RateLimits;
use crate::domain::{InvalidValue, KeyId, ModelName, PoolName};
use crate::store::Db;
use crate::store::leases::fit_slots;

/// An operator's change of state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StateChange {
    /// Out of traffic until enabled (`disabled`).
    Disable,
    /// Back to `available`: clears cooldowns, backoff and draining.
    Enable,
    /// No new leases while the current ones finish.
    Drain,
}

/// What a PATCH changes; `None` fields stay as they are.
#[derive(Debug, Clone, Default)]
pub struct Patch {
    /// Disable, enable or drain.
    pub state: Option<StateChange>,
    /// Why (recorded as the status reason and in the audit row).
    pub reason: Option<String>,
    /// A new limit.
    pub max_concurrent_uses: Option<i32>,
    /// New models.
    pub models: Option<Vec<ModelName>>,
    /// New aliases.
    pub aliases: Option<BTreeMap<ModelName, ModelName>>,
    /// A new pool.
    pub pool: Option<PoolName>,
    /// New rate windows (an empty list removes them).
    pub rate_limits: Option<RateLimits>,
}

/// The result of a PATCH.
#[derive(Debug)]
pub enum PatchOutcome {
    /// Changed; the credential as it is now.
    Changed(Box<CredentialDetail>),
    /// The change breaks a rule (aliases pointing outside the models); nothing changed.
    Invalid(InvalidValue),
    /// No such credential.
    NotFound,
}

/// Applies a PATCH in one transaction and audits it (`updated`, old and new configuration, plus
/// `status_changed` when the status moves). Lowering the limit revokes nothing; raising it takes
/// effect for the next allocation (`credpool_fit_slots`).
#[tracing::instrument(skip(db, policy), err(level = "debug"))]
pub async fn patch(
    db: &Db,
    key_id: &KeyId,
    patch: &Patch,
    actor: &Actor,
    policy: &HealthPolicy,
) -> Result<PatchOutcome, sqlx::Error> {
    let mut tx = db.begin().await?;
    if !lock_credential(&mut tx, key_id).await? {
        return Ok(PatchOutcome::NotFound);
    }
    let old = configuration(&mut tx, key_id).await?.unwrap_or_default();
    if patch.models.is_some() || patch.aliases.is_some() {
        let current_models = || -> Vec<ModelName> {
            old["models"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m.as_str().and_then(|m| ModelName::parse(m).ok()))
                .collect()
        };
        let current_aliases = || -> BTreeMap<ModelName, ModelName> {
            serde_json::from_value(old["aliases"].clone()).unwrap_or_default()
        };
        let models = patch.models.clone().unwrap_or_else(current_models);
        let aliases = patch.aliases.clone().unwrap_or_else(current_aliases);
        if let Err(invalid) = check_models(&models, &aliases) {
            return Ok(PatchOutcome::Invalid(invalid));
        }
    }
    let models: Option<Vec<String>> = patch
        .models
        .as_ref()
        .map(|ms| ms.iter().map(|m| m.as_str().to_owned()).collect());
    let aliases = patch
        .aliases
        .as_ref()
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    let state = patch.state.map(|s| match s {
        StateChange::Disable => "disable",
        StateChange::Enable => "enable",
        StateChange::Drain => "drain",
    });
    sqlx::query!(
        r#"
        UPDATE credentials
        SET status = CASE WHEN $2::text = 'disable' THEN 'disabled'
                          WHEN $2::text = 'enable' THEN 'available' ELSE status END,
            status_reason = CASE WHEN $2::text = 'disable' THEN coalesce($3, 'disabled by an operator')
                                 WHEN $2::text = 'enable' THEN NULL
                                 ELSE status_reason END,
            cooldown_until = CASE WHEN $2::text IN ('disable', 'enable') THEN NULL ELSE cooldown_until END,
            cooldowns_in_a_row = CASE WHEN $2::text = 'enable' THEN 0 ELSE cooldowns_in_a_row END,
            recent_failures = CASE WHEN $2::text = 'enable' THEN '{}' ELSE recent_failures END,
            -- (searched CASEs: Citus 13.2 sends `CASE $2 WHEN ...` to a worker with its WHEN
            -- values lost)
            draining = CASE WHEN $2::text = 'drain' THEN true
                            WHEN $2::text IN ('enable', 'disable') THEN false ELSE draining END,
            max_concurrent_uses = coalesce($4, max_concurrent_uses),
            models = coalesce($5, models),
            model_aliases = coalesce($6, model_aliases),
            pool = coalesce($7, pool),
            rate_limits = coalesce($8, rate_limits),
            updated_at = now()
        WHERE key_id = $1 AND provider = $9
        "#,
        key_id.as_str(),
        state,
        patch.reason,
        patch.max_concurrent_uses,
        models.as_deref(),
        aliases,
        patch.pool.as_ref().map(PoolName::as_str),
        patch.rate_limits.as_ref().map(RateLimits::to_json),
        provider_of(Some(&old)),
    )
    .execute(&mut *tx)
    .await?;
    // the limit, the drain state and the windows are gates on the slot rows
    if patch.max_concurrent_uses.is_some() || patch.state.is_some() || patch.rate_limits.is_some() {
        fit_slots(&mut *tx, key_id).await?;
    }
    let new = configuration(&mut tx, key_id).await?.unwrap_or_default();
    let reason = patch.reason.clone().unwrap_or_else(|| match state {
        Some(state) => format!("{state} by an operator"),
        None => "configuration changed by an operator".to_owned(),
    });
    let details = serde_json::json!({"old": old, "new": new});
    audit(&mut tx, key_id, "updated", actor, &reason, details.clone()).await?;
    if old["status"] != new["status"] {
        audit(&mut tx, key_id, "status_changed", actor, &reason, details).await?;
    }
    let detail = details_one(&mut tx, key_id, policy).await?;
    tx.commit().await?;
    Ok(match detail {
        Some(detail) => PatchOutcome::Changed(Box::new(detail)),
        None => PatchOutcome::NotFound,
    })
}
