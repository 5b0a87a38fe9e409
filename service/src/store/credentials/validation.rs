//! What an operator's credential input must satisfy, checked before anything reaches the
//! database: the values together (models, aliases, limit, status) and the sealed secret.

use std::collections::BTreeMap;

use crate::domain::oauth::{OAuthInput, OAuthSpec};
use crate::domain::windows::RateLimits;
use crate::domain::{InvalidValue, KeyId, ModelName, PoolName, ProviderName, Secret, Status};
use crate::secrets::Keyring;

/// A credential's configuration as an operator writes it (`PUT /api/admin/keys/{key_id}`,
/// `credpool keys import`). The secret travels sealed ([`Keyring::seal`]).
#[derive(Debug, Clone)]
pub struct CredentialSpec {
    /// The operator's id of the credential.
    pub key_id: KeyId,
    /// Its provider.
    pub provider: ProviderName,
    /// Its pool.
    pub pool: PoolName,
    /// The models it serves, as the provider spells them.
    pub models: Vec<ModelName>,
    /// Request model name -> one of `models`.
    pub aliases: BTreeMap<ModelName, ModelName>,
    /// How many leases it may carry at once (1..=10,000).
    pub max_concurrent_uses: i32,
    /// Its status; `None` keeps the stored one (`available` for a new credential). Setting a
    /// status clears `cooldown_until`.
    pub status: Option<Status>,
    /// Its rate windows (empty: none).
    pub rate_limits: RateLimits,
    /// The secret, sealed for this key_id (for an OAuth credential: `{"access_token",
    /// "expires_at"}`, what executors receive).
    pub sealed_secret: Vec<u8>,
    /// The OAuth configuration and sealed grant; `None`: not an OAuth credential.
    pub oauth: Option<OAuthSpec>,
}

/// A credential as an operator submits it: the body of `PUT /api/admin/keys/{key_id}` (where
/// `key_id` may be omitted) and one entry of `credpool keys import` (where it is required).
/// Unknown fields are refused; the secret is deserialized without ever being quoted in an error.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CredentialInput {
    /// The operator's id (the path names it for PUT).
    pub key_id: Option<KeyId>,
    /// Its provider.
    pub provider: ProviderName,
    /// Its pool (default `default`).
    #[serde(default)]
    pub pool: PoolName,
    /// Provider model names it serves (1..=256).
    pub models: Vec<ModelName>,
    /// Request model name -> one of `models` (`{"gpt-4o": "gpt-4o-2024-08-06"}`).
    #[serde(default)]
    pub aliases: BTreeMap<ModelName, ModelName>,
    /// 1..=10,000.
    pub max_concurrent_uses: u64,
    /// `available`, `pending`, `disabled` or `exhausted`; omitted keeps the stored status.
    pub status: Option<Status>,
    /// Rate windows, at most 8: `[{"requests": 500, "seconds": 60}, {"tokens": 200000,
    /// "seconds": 60}]` (counts 1..=10^9, seconds 1..=2,678,400). Omitted: none.
    #[serde(default)]
    pub rate_limits: RateLimits,
    /// The material executors receive with a lease (a JSON object). For an OAuth credential:
    /// `{"access_token", "refresh_token", "expires_at"}` (RFC 3339), of which executors receive
    /// `access_token` and `expires_at` only.
    pub secret: Secret,
    /// Makes the credential an OAuth credential whose access token credpool refreshes.
    pub oauth: Option<OAuthInput>,
}

impl CredentialInput {
    /// Validates the input as a whole and seals its secret for `key_id`.
    pub fn into_spec(
        self,
        key_id: KeyId,
        keyring: &Keyring,
    ) -> Result<CredentialSpec, InvalidValue> {
        if self.key_id.as_ref().is_some_and(|k| *k != key_id) {
            return Err(InvalidValue::new(
                "key_id",
                "must match the key_id in the path",
            ));
        }
        check_models(&self.models, &self.aliases)?;
        let max_concurrent_uses = check_limit(self.max_concurrent_uses)?;
        if matches!(self.status, Some(Status::RateLimited | Status::Cooldown)) {
            return Err(InvalidValue::new(
                "status",
                "rate_limited and cooldown come from outcome reports (they need a cooldown end); set available, pending, disabled or exhausted",
            ));
        }
        let (oauth, sealed_secret) = match self.oauth {
            Some(oauth) => {
                let (spec, lease_secret) = oauth.into_spec(&key_id, &self.secret, keyring)?;
                (Some(spec), keyring.seal(&key_id, &lease_secret))
            }
            None => (None, keyring.seal(&key_id, &self.secret)),
        };
        Ok(CredentialSpec {
            sealed_secret,
            oauth,
            key_id,
            provider: self.provider,
            pool: self.pool,
            models: self.models,
            aliases: self.aliases,
            max_concurrent_uses,
            status: self.status,
            rate_limits: self.rate_limits,
        })
    }
}

/// Checks the rules a spec's values must satisfy together (beyond each value's own type): 1 to
/// 256 models, at most 256 aliases each pointing at one of the models, a limit of 1..=10,000.
pub fn check_models(
    models: &[ModelName],
    aliases: &BTreeMap<ModelName, ModelName>,
) -> Result<(), InvalidValue> {
    if models.is_empty() || models.len() > MAX_MODELS {
        return Err(InvalidValue::new(
            "models",
            format!("must list 1 to {MAX_MODELS} models"),
        ));
    }
    if aliases.len() > MAX_MODELS {
        return Err(InvalidValue::new(
            "aliases",
            format!("may map at most {MAX_MODELS} names"),
        ));
    }
    if let Some((alias, _)) = aliases.iter().find(|(_, target)| !models.contains(target)) {
        return Err(InvalidValue::new(
            "aliases",
            format!("`{alias}` must map to one of the credential's models"),
        ));
    }
    Ok(())
}

/// Validates a limit: 1..=10,000.
pub fn check_limit(value: u64) -> Result<i32, InvalidValue> {
    match i32::try_from(value) {
        Ok(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
        _ => Err(InvalidValue::new(
            "max_concurrent_uses",
            format!("must be an integer from 1 to {MAX_LIMIT}"),
        )),
    }
}

/// Most models (and aliases) one credential may list.
const MAX_MODELS: usize = 256;
/// The largest `max_concurrent_uses`; the database holds the same bound (constraint
/// `credentials_max_concurrent_uses_range`).
const MAX_LIMIT: i32 = 10_000;
