//! Creating or updating credentials: one (`PUT /api/admin/keys/{key_id}`) or many in one
//! transaction (`credpool keys import`).

use sqlx::PgConnection;

use super::read::{CredentialDetail, ListFilter, details};
use super::validation::CredentialSpec;
use super::{Actor, audit, configuration, lock_credential, lock_credentials, provider_of};
use crate::domain::Status;
use crate::domain::health::HealthPolicy;
use crate::store::Db;
use crate::store::leases::fit_slots;

/// Why a PUT or an import stored nothing (its transaction was rolled back).
#[derive(Debug, thiserror::Error)]
pub enum UpsertError {
    /// `If-Match` named a token generation the credential is no longer at (or it is not an
    /// OAuth credential).
    #[error("generation moved")]
    GenerationMoved,
    /// The credential exists under another provider. A credential keeps its provider: the rows of
    /// its leases, windows and trail are the provider's (on Citus they live on the provider's
    /// worker, and a row's distribution column cannot change), and a key of one provider is never
    /// a key of another. To move it, delete it and add it again.
    #[error(
        "credential {key_id} exists under provider {provider}; a credential keeps its provider \
         (delete it and add it again to move it)"
    )]
    ProviderChanged {
        /// The credential.
        key_id: String,
        /// The provider it has.
        provider: String,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] sqlx::Error),
}

/// Creates or updates a credential and fits its slot rows to its limit, in one transaction, and
/// audits it (`created` / `updated`, old and new configuration; the secret only as "replaced").
/// Returns the stored credential and whether it was created. Lowering the limit revokes no lease
/// (see `credpool_fit_slots`).
///
/// # Errors
/// [`UpsertError::ProviderChanged`] when the credential exists under another provider (judged
/// under its locks); [`UpsertError::GenerationMoved`] (below); [`UpsertError::Store`].
///
/// `if_generation` (`If-Match` on PUT, for refreshers outside credpool): store only if the
/// credential is an OAuth credential whose token generation is still this one, judged under the
/// credential's locks; otherwise change nothing and answer [`UpsertError::GenerationMoved`], so
/// that two refreshers can never roll back a rotated token.
#[tracing::instrument(skip_all, fields(key_id = %spec.key_id), err(level = "debug"))]
pub async fn upsert(
    db: &Db,
    spec: &CredentialSpec,
    actor: &Actor,
    policy: &HealthPolicy,
    if_generation: Option<i64>,
) -> Result<(CredentialDetail, bool), UpsertError> {
    let mut tx = db.begin().await?;
    if let Some(expected) = if_generation {
        lock_credential(&mut tx, &spec.key_id).await?;
        let generation =
            crate::store::oauth::locked_generation(&mut tx, &spec.key_id, &spec.provider).await?;
        if generation != Some(expected) {
            return Err(UpsertError::GenerationMoved);
        }
    }
    let created = upsert_in(&mut tx, spec, actor).await?;
    let detail = details(
        &mut tx,
        Some(&spec.key_id),
        &ListFilter {
            limit: 1,
            ..Default::default()
        },
        policy,
    )
    .await?
    .pop()
    .ok_or(sqlx::Error::RowNotFound)?;
    tx.commit().await?;
    Ok((detail, created))
}

async fn upsert_in(
    conn: &mut PgConnection,
    spec: &CredentialSpec,
    actor: &Actor,
) -> Result<bool, UpsertError> {
    lock_credential(conn, &spec.key_id).await?;
    // (read under the credential's operator lock, which every creation and deletion of the key
    // takes: the provider read here stays true until this transaction commits)
    let old = configuration(conn, &spec.key_id).await?;
    let provider = provider_of(old.as_ref());
    if !provider.is_empty() && provider != spec.provider.as_str() {
        return Err(UpsertError::ProviderChanged {
            key_id: spec.key_id.as_str().to_owned(),
            provider: provider.to_owned(),
        });
    }
    let models: Vec<String> = spec.models.iter().map(|m| m.as_str().to_owned()).collect();
    let aliases =
        serde_json::to_value(&spec.aliases).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    let created = sqlx::query_scalar!(
        r#"
        INSERT INTO credentials
            (key_id, provider, pool, models, model_aliases, max_concurrent_uses, status,
             secret_ciphertext, rate_limits, token_expires_at, updated_at)
        VALUES ($1, $2, $3, $4, $5, $6, COALESCE($7, 'available'), $8, $9, $10, now())
        ON CONFLICT ON CONSTRAINT credentials_pkey DO UPDATE
        SET pool = EXCLUDED.pool,
            models = EXCLUDED.models,
            model_aliases = EXCLUDED.model_aliases,
            max_concurrent_uses = EXCLUDED.max_concurrent_uses,
            rate_limits = EXCLUDED.rate_limits,
            status = COALESCE($7, credentials.status),
            cooldown_until = CASE WHEN $7::text IS NULL THEN credentials.cooldown_until END,
            secret = NULL,
            secret_ciphertext = EXCLUDED.secret_ciphertext,
            token_expires_at = EXCLUDED.token_expires_at,
            -- (the inserted row's time: Citus takes no function but an immutable one here)
            updated_at = EXCLUDED.updated_at
        RETURNING (xmax = 0) AS "created!"
        "#,
        spec.key_id.as_str(),
        spec.provider.as_str(),
        spec.pool.as_str(),
        &models,
        aliases,
        spec.max_concurrent_uses,
        spec.status.map(Status::as_str),
        &spec.sealed_secret,
        spec.rate_limits.to_json(),
        spec.oauth.as_ref().map(|o| o.token_expires_at),
    )
    .fetch_one(&mut *conn)
    .await?;
    crate::store::oauth::store_config(
        &mut *conn,
        &spec.key_id,
        &spec.provider,
        spec.oauth.as_ref(),
    )
    .await?;
    fit_slots(&mut *conn, &spec.key_id).await?;
    let new = configuration(conn, &spec.key_id).await?;
    let (event, reason) = if created {
        ("created", "credential created")
    } else {
        ("updated", "credential replaced (PUT)")
    };
    let details = serde_json::json!({"old": old, "new": new, "secret": "replaced"});
    audit(conn, &spec.key_id, event, actor, reason, details).await?;
    Ok(created)
}

/// Imports this large refresh the planner's statistics at once (see [`import`]).
const ANALYZE_AFTER_IMPORT: usize = 100;

/// Creates or updates many credentials in ONE transaction: all or nothing. Returns how many
/// were created and how many updated.
///
/// # Errors
/// [`UpsertError::ProviderChanged`] (nothing imported) when one of them exists under another
/// provider; [`UpsertError::Store`].
///
/// After a large import (100 credentials or more) the statistics of `credentials` and
/// `lease_slots` are refreshed at once, best effort: until autovacuum gets to it, the planner
/// would still see the tables as they were, and a pool it believes tiny gets plans that read all
/// of it on every claim (measured: 4-5x slower allocation right after loading 1,000 credentials).
pub async fn import(
    db: &Db,
    specs: &[CredentialSpec],
    actor: &Actor,
) -> Result<(usize, usize), UpsertError> {
    let mut tx = db.begin().await?;
    // every lock first, in the lock order (slot rows, then credential rows, each ascending), and
    // the credentials in key order: an import holding one credential's row while it waits for
    // another's slot could deadlock with a release group holding that slot
    let mut specs: Vec<&CredentialSpec> = specs.iter().collect();
    specs.sort_by(|a, b| a.key_id.cmp(&b.key_id));
    let key_ids: Vec<&str> = specs.iter().map(|s| s.key_id.as_str()).collect();
    lock_credentials(&mut tx, &key_ids).await?;
    let (mut created, mut updated) = (0, 0);
    for spec in &specs {
        if upsert_in(&mut tx, spec, actor).await? {
            created += 1;
        } else {
            updated += 1;
        }
    }
    tx.commit().await?;
    if specs.len() >= ANALYZE_AFTER_IMPORT
        && let Err(error) = async {
            let mut work = db.work().await?;
            sqlx::query("ANALYZE credentials, lease_slots")
                .execute(&mut *work)
                .await?;
            work.done().await
        }
        .await
    {
        tracing::warn!(error = %error, "refreshing statistics after the import failed");
    }
    Ok((created, updated))
}
