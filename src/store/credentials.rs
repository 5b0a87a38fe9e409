//! Credentials: create or update, in one transaction with the slot rows that carry their capacity.

use std::collections::BTreeMap;

use sqlx::{PgConnection, PgPool};
use time::OffsetDateTime;

use crate::domain::{KeyId, ModelName, PoolName, ProviderName, Secret, Status};

/// A credential's configuration as an operator writes it (`PUT /api/admin/keys/{key_id}`).
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
    /// The material executors receive with a lease.
    pub secret: Secret,
}

/// A credential as stored, without its secret.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CredentialView {
    /// The operator's id.
    pub key_id: String,
    /// Its provider.
    pub provider: String,
    /// Its pool.
    pub pool: String,
    /// The models it serves.
    pub models: Vec<String>,
    /// Request model name -> one of `models`.
    pub aliases: serde_json::Value,
    /// Its concurrency limit.
    pub max_concurrent_uses: i32,
    /// Its health status.
    pub status: String,
    /// When its cooldown ends (database clock), if it has one.
    #[serde(with = "time::serde::rfc3339::option")]
    pub cooldown_until: Option<OffsetDateTime>,
    /// When its latest lease was granted.
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_used_at: Option<OffsetDateTime>,
    /// When it was first stored.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When its configuration last changed.
    #[serde(with = "time::serde::rfc3339")]
    pub updated_at: OffsetDateTime,
}

/// Creates or updates a credential and fits its slot rows to its limit, in one transaction.
/// Returns the stored view and whether the credential was created.
///
/// Lowering the limit revokes no lease: see `credpool_fit_slots`.
#[tracing::instrument(skip_all, fields(key_id = %spec.key_id), err(level = "debug"))]
pub async fn upsert(
    pool: &PgPool,
    spec: &CredentialSpec,
) -> Result<(CredentialView, bool), sqlx::Error> {
    let mut tx = pool.begin().await?;
    let result = upsert_in(&mut tx, spec).await?;
    tx.commit().await?;
    Ok(result)
}

async fn upsert_in(
    conn: &mut PgConnection,
    spec: &CredentialSpec,
) -> Result<(CredentialView, bool), sqlx::Error> {
    // Lock order: slot rows first, then the credential row (see the migration's header).
    sqlx::query!(
        "SELECT slot FROM lease_slots WHERE key_id = $1 ORDER BY slot FOR UPDATE",
        spec.key_id.as_str()
    )
    .fetch_all(&mut *conn)
    .await?;

    let models: Vec<String> = spec.models.iter().map(|m| m.as_str().to_owned()).collect();
    let aliases =
        serde_json::to_value(&spec.aliases).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    let row = sqlx::query!(
        r#"
        INSERT INTO credentials (key_id, provider, pool, models, model_aliases, max_concurrent_uses, status, secret)
        VALUES ($1, $2, $3, $4, $8, $5, COALESCE($6, 'available'), $7)
        ON CONFLICT ON CONSTRAINT credentials_pkey DO UPDATE
        SET provider = EXCLUDED.provider,
            pool = EXCLUDED.pool,
            models = EXCLUDED.models,
            model_aliases = EXCLUDED.model_aliases,
            max_concurrent_uses = EXCLUDED.max_concurrent_uses,
            status = COALESCE($6, credentials.status),
            cooldown_until = CASE WHEN $6::text IS NULL THEN credentials.cooldown_until END,
            secret = EXCLUDED.secret,
            updated_at = now()
        RETURNING key_id, provider, pool, models, model_aliases, max_concurrent_uses, status, cooldown_until,
                  last_used_at, created_at, updated_at, (xmax = 0) AS "created!"
        "#,
        spec.key_id.as_str(),
        spec.provider.as_str(),
        spec.pool.as_str(),
        &models,
        spec.max_concurrent_uses,
        spec.status.map(Status::as_str),
        spec.secret.expose(),
        aliases,
    )
    .fetch_one(&mut *conn)
    .await?;

    super::leases::fit_slots(&mut *conn, &spec.key_id).await?;

    Ok((
        CredentialView {
            key_id: row.key_id,
            provider: row.provider,
            pool: row.pool,
            models: row.models,
            aliases: row.model_aliases,
            max_concurrent_uses: row.max_concurrent_uses,
            status: row.status,
            cooldown_until: row.cooldown_until,
            last_used_at: row.last_used_at,
            created_at: row.created_at,
            updated_at: row.updated_at,
        },
        row.created,
    ))
}
