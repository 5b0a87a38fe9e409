//! Credentials as operators manage them: create or update, read, change, drain, delete, force
//! releases, pool summaries, bulk import and resealing. Each operation is one transaction; every
//! mutation writes `credential_events` (who, what, old and new values — never a secret).
//!
//! Lock order, as everywhere (see the first migration): a credential's slot rows (ascending), then
//! the credential row.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;
use sqlx::PgConnection;

use super::Db;
use time::OffsetDateTime;

use super::leases::{decoded, fit_slots};
use crate::domain::{
    InvalidValue, KeyId, LeaseId, ModelName, PoolName, ProviderName, Secret, Status,
};
use crate::health::HealthPolicy;
use crate::secrets::Keyring;

/// Who performed an operator action: the `X-Operator` header, `admin-key`, or `cli:<user>`.
/// 1..=200 printable characters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Actor(String);

impl Actor {
    /// Validates an operator's name for themselves.
    pub fn parse(value: impl Into<String>) -> Result<Self, InvalidValue> {
        let value = value.into();
        let len = value.chars().count();
        if len == 0 || len > 200 || value.chars().any(char::is_control) {
            return Err(InvalidValue::new(
                "X-Operator",
                "must be 1 to 200 printable characters",
            ));
        }
        Ok(Self(value))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

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
    /// The secret, sealed for this key_id.
    pub sealed_secret: Vec<u8>,
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
    /// The material executors receive with a lease (a JSON object).
    pub secret: Secret,
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
        Ok(CredentialSpec {
            sealed_secret: keyring.seal(&key_id, &self.secret),
            key_id,
            provider: self.provider,
            pool: self.pool,
            models: self.models,
            aliases: self.aliases,
            max_concurrent_uses,
            status: self.status,
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
pub const MAX_MODELS: usize = 256;
/// The largest `max_concurrent_uses` (the migration's CHECK).
pub const MAX_LIMIT: i32 = 10_000;

/// One in-flight lease of a credential, as operators see it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct LeaseView {
    /// The lease.
    pub lease_id: LeaseId,
    /// The pool it was granted from.
    pub pool: String,
    /// The executor that holds it.
    pub holder: Option<String>,
    /// When it was granted.
    #[serde(with = "time::serde::rfc3339")]
    pub granted_at: OffsetDateTime,
    /// When it stops counting unless renewed.
    #[serde(with = "time::serde::rfc3339")]
    pub lease_until: OffsetDateTime,
    /// Whether it is a recovering credential's probe.
    pub probe: bool,
}

/// Outcome counters decayed to the moment of reading.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct HealthFigures {
    /// Decayed successes.
    pub successes: f64,
    /// Decayed failures.
    pub failures: f64,
    /// Decayed rate limits.
    pub rate_limits: f64,
    /// successes / (successes + failures); 1.0 without history.
    pub success_rate: f64,
    /// Cooldowns since the last recovery (the backoff's exponent).
    pub cooldowns_in_a_row: i32,
    /// The last successful use or probe.
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_success_at: Option<OffsetDateTime>,
    /// The last recovery from a cooldown.
    #[serde(with = "time::serde::rfc3339::option")]
    pub recovered_at: Option<OffsetDateTime>,
}

/// A credential as operators see it: configuration, status, health, in-flight leases. Never the
/// secret.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct CredentialDetail {
    /// The operator's id.
    pub key_id: String,
    /// Its provider.
    pub provider: String,
    /// Its pool.
    pub pool: String,
    /// The models it serves.
    pub models: Vec<String>,
    /// Request model name -> one of `models`.
    #[schema(value_type = Object)]
    pub aliases: serde_json::Value,
    /// Its concurrency limit.
    pub max_concurrent_uses: i32,
    /// Its health status.
    pub status: String,
    /// Why the status is what it is.
    pub status_reason: Option<String>,
    /// When its cooldown ends (database clock), if it has one.
    #[serde(with = "time::serde::rfc3339::option")]
    pub cooldown_until: Option<OffsetDateTime>,
    /// Drained: no new leases while the current ones finish.
    pub draining: bool,
    /// When its latest lease was granted.
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_used_at: Option<OffsetDateTime>,
    /// Outcome figures.
    pub health: HealthFigures,
    /// Unexpired leases.
    pub in_flight: usize,
    /// The unexpired leases, oldest first.
    pub leases: Vec<LeaseView>,
    /// When it was first stored.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When its configuration last changed.
    #[serde(with = "time::serde::rfc3339")]
    pub updated_at: OffsetDateTime,
}

/// Which credentials to list: filters, and keyset pagination by key_id.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Only this provider.
    pub provider: Option<ProviderName>,
    /// Only this pool.
    pub pool: Option<PoolName>,
    /// Only this status.
    pub status: Option<Status>,
    /// Only key_ids after this one (the previous page's last).
    pub after: Option<KeyId>,
    /// At most this many (1..=1000).
    pub limit: u32,
}

/// Reads credentials matching `key_id` (one) or `filter` (a page), with their leases.
async fn details(
    conn: &mut PgConnection,
    key_id: Option<&KeyId>,
    filter: &ListFilter,
    policy: &HealthPolicy,
) -> Result<Vec<CredentialDetail>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        SELECT key_id, provider, pool, models, model_aliases, max_concurrent_uses, status,
               status_reason, cooldown_until, draining,
               (SELECT max(s.last_granted_at) FROM lease_slots s WHERE s.key_id = credentials.key_id)
                   AS last_used_at,
               last_success_at, recovered_at,
               health_successes, health_failures, health_rate_limits, health_decayed_at,
               recent_failures, cooldowns_in_a_row, created_at, updated_at, now() AS "db_now!"
        FROM credentials
        WHERE ($1::text IS NULL OR key_id = $1)
          AND ($2::text IS NULL OR provider = $2)
          AND ($3::text IS NULL OR pool = $3)
          AND ($4::text IS NULL OR status = $4)
          AND ($5::text IS NULL OR key_id > $5)
        ORDER BY key_id
        LIMIT $6
        "#,
        key_id.map(KeyId::as_str),
        filter.provider.as_ref().map(ProviderName::as_str),
        filter.pool.as_ref().map(PoolName::as_str),
        filter.status.map(Status::as_str),
        filter.after.as_ref().map(KeyId::as_str),
        i64::from(filter.limit.max(1)),
    )
    .fetch_all(&mut *conn)
    .await?;
    let ids: Vec<String> = rows.iter().map(|r| r.key_id.clone()).collect();
    let mut leases: HashMap<String, Vec<LeaseView>> = HashMap::new();
    for lease in sqlx::query!(
        r#"
        SELECT key_id, lease_id AS "lease_id!", pool AS "pool!", holder,
               granted_at AS "granted_at!", lease_until AS "lease_until!", probe
        FROM lease_slots
        WHERE key_id = ANY ($1) AND lease_id IS NOT NULL AND lease_until > now()
        ORDER BY granted_at
        "#,
        &ids,
    )
    .fetch_all(&mut *conn)
    .await?
    {
        leases.entry(lease.key_id).or_default().push(LeaseView {
            lease_id: LeaseId::from(lease.lease_id),
            pool: lease.pool,
            holder: lease.holder,
            granted_at: lease.granted_at,
            lease_until: lease.lease_until,
            probe: lease.probe,
        });
    }
    rows.into_iter()
        .map(|r| {
            let health = super::health_of_row!(r)?;
            let (successes, failures, rate_limits) = health.counters_at(r.db_now, policy);
            let leases = leases.remove(&r.key_id).unwrap_or_default();
            Ok(CredentialDetail {
                key_id: r.key_id,
                provider: r.provider,
                pool: r.pool,
                models: r.models,
                aliases: r.model_aliases,
                max_concurrent_uses: r.max_concurrent_uses,
                status: r.status,
                status_reason: health.status_reason,
                cooldown_until: r.cooldown_until,
                draining: r.draining,
                last_used_at: r.last_used_at,
                health: HealthFigures {
                    successes,
                    failures,
                    rate_limits,
                    success_rate: if successes + failures < 1e-9 {
                        1.0
                    } else {
                        successes / (successes + failures)
                    },
                    cooldowns_in_a_row: r.cooldowns_in_a_row,
                    last_success_at: r.last_success_at,
                    recovered_at: r.recovered_at,
                },
                in_flight: leases.len(),
                leases,
                created_at: r.created_at,
                updated_at: r.updated_at,
            })
        })
        .collect()
}

/// One credential with its leases, or `None`.
pub async fn get(
    db: &Db,
    key_id: &KeyId,
    policy: &HealthPolicy,
) -> Result<Option<CredentialDetail>, sqlx::Error> {
    let mut work = db.work().await?;
    let filter = ListFilter {
        limit: 1,
        ..ListFilter::default()
    };
    let detail = details(&mut work, Some(key_id), &filter, policy)
        .await?
        .pop();
    work.done().await?;
    Ok(detail)
}

/// A page of credentials in key_id order.
pub async fn list(
    db: &Db,
    filter: &ListFilter,
    policy: &HealthPolicy,
) -> Result<Vec<CredentialDetail>, sqlx::Error> {
    let mut work = db.work().await?;
    let page = details(&mut work, None, filter, policy).await?;
    work.done().await?;
    Ok(page)
}

/// Locks a credential's slot rows and then its row, in the global lock order. Returns whether
/// the credential exists.
async fn lock_credential(conn: &mut PgConnection, key_id: &KeyId) -> Result<bool, sqlx::Error> {
    sqlx::query!(
        "SELECT slot FROM lease_slots WHERE key_id = $1 ORDER BY slot FOR UPDATE",
        key_id.as_str()
    )
    .fetch_all(&mut *conn)
    .await?;
    let found = sqlx::query_scalar!(
        r#"SELECT 1 AS "one!" FROM credentials WHERE key_id = $1 FOR UPDATE"#,
        key_id.as_str()
    )
    .fetch_optional(&mut *conn)
    .await?;
    Ok(found.is_some())
}

/// The non-secret configuration of a credential, for the `details` of audit rows.
async fn configuration(
    conn: &mut PgConnection,
    key_id: &KeyId,
) -> Result<Option<serde_json::Value>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"
        SELECT jsonb_build_object(
                   'provider', provider, 'pool', pool, 'models', models, 'aliases', model_aliases,
                   'max_concurrent_uses', max_concurrent_uses, 'status', status,
                   'cooldown_until', cooldown_until, 'draining', draining) AS "configuration!"
        FROM credentials WHERE key_id = $1
        "#,
        key_id.as_str()
    )
    .fetch_optional(&mut *conn)
    .await
}

async fn audit(
    conn: &mut PgConnection,
    key_id: &KeyId,
    event: &str,
    actor: &Actor,
    reason: &str,
    details: serde_json::Value,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        r#"
        INSERT INTO credential_events (key_id, event, old_status, new_status, reason, cooldown_until, actor, details)
        VALUES ($1, $2, $3::jsonb ->> 'status', $4::jsonb ->> 'status', $5,
                ($4::jsonb ->> 'cooldown_until')::timestamptz, $6, $7)
        "#,
        key_id.as_str(),
        event,
        details.get("old").cloned().unwrap_or(serde_json::Value::Null),
        details.get("new").cloned().unwrap_or(serde_json::Value::Null),
        reason,
        actor.as_str(),
        details,
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Creates or updates a credential and fits its slot rows to its limit, in one transaction, and
/// audits it (`created` / `updated`, old and new configuration; the secret only as "replaced").
/// Returns the stored credential and whether it was created. Lowering the limit revokes no lease
/// (see `credpool_fit_slots`).
#[tracing::instrument(skip_all, fields(key_id = %spec.key_id), err(level = "debug"))]
pub async fn upsert(
    db: &Db,
    spec: &CredentialSpec,
    actor: &Actor,
    policy: &HealthPolicy,
) -> Result<(CredentialDetail, bool), sqlx::Error> {
    let mut tx = db.begin().await?;
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
) -> Result<bool, sqlx::Error> {
    lock_credential(conn, &spec.key_id).await?;
    let old = configuration(conn, &spec.key_id).await?;
    let models: Vec<String> = spec.models.iter().map(|m| m.as_str().to_owned()).collect();
    let aliases =
        serde_json::to_value(&spec.aliases).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    let created = sqlx::query_scalar!(
        r#"
        INSERT INTO credentials
            (key_id, provider, pool, models, model_aliases, max_concurrent_uses, status, secret_ciphertext)
        VALUES ($1, $2, $3, $4, $5, $6, COALESCE($7, 'available'), $8)
        ON CONFLICT ON CONSTRAINT credentials_pkey DO UPDATE
        SET provider = EXCLUDED.provider,
            pool = EXCLUDED.pool,
            models = EXCLUDED.models,
            model_aliases = EXCLUDED.model_aliases,
            max_concurrent_uses = EXCLUDED.max_concurrent_uses,
            status = COALESCE($7, credentials.status),
            cooldown_until = CASE WHEN $7::text IS NULL THEN credentials.cooldown_until END,
            secret = NULL,
            secret_ciphertext = EXCLUDED.secret_ciphertext,
            updated_at = now()
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
    )
    .fetch_one(&mut *conn)
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
/// After a large import (100 credentials or more) the statistics of `credentials` and
/// `lease_slots` are refreshed at once, best effort: until autovacuum gets to it, the planner
/// would still see the tables as they were, and a pool it believes tiny gets plans that read all
/// of it on every claim (measured: 4-5x slower allocation right after loading 1,000 credentials).
pub async fn import(
    db: &Db,
    specs: &[CredentialSpec],
    actor: &Actor,
) -> Result<(usize, usize), sqlx::Error> {
    let mut tx = db.begin().await?;
    let (mut created, mut updated) = (0, 0);
    for spec in specs {
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
        SET status = CASE $2::text WHEN 'disable' THEN 'disabled' WHEN 'enable' THEN 'available' ELSE status END,
            status_reason = CASE $2::text
                WHEN 'disable' THEN coalesce($3, 'disabled by an operator')
                WHEN 'enable' THEN NULL
                ELSE status_reason END,
            cooldown_until = CASE WHEN $2::text IN ('disable', 'enable') THEN NULL ELSE cooldown_until END,
            cooldowns_in_a_row = CASE WHEN $2::text = 'enable' THEN 0 ELSE cooldowns_in_a_row END,
            recent_failures = CASE WHEN $2::text = 'enable' THEN '{}' ELSE recent_failures END,
            draining = CASE $2::text WHEN 'drain' THEN true WHEN 'enable' THEN false WHEN 'disable' THEN false ELSE draining END,
            max_concurrent_uses = coalesce($4, max_concurrent_uses),
            models = coalesce($5, models),
            model_aliases = coalesce($6, model_aliases),
            pool = coalesce($7, pool),
            updated_at = now()
        WHERE key_id = $1
        "#,
        key_id.as_str(),
        state,
        patch.reason,
        patch.max_concurrent_uses,
        models.as_deref(),
        aliases,
        patch.pool.as_ref().map(PoolName::as_str),
    )
    .execute(&mut *tx)
    .await?;
    if patch.max_concurrent_uses.is_some() {
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

async fn details_one(
    conn: &mut PgConnection,
    key_id: &KeyId,
    policy: &HealthPolicy,
) -> Result<Option<CredentialDetail>, sqlx::Error> {
    let filter = ListFilter {
        limit: 1,
        ..ListFilter::default()
    };
    Ok(details(conn, Some(key_id), &filter, policy).await?.pop())
}

/// A lease an operator ended.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ForcedRelease {
    /// The lease.
    pub lease_id: LeaseId,
    /// Its credential.
    pub key_id: String,
    /// Its holder.
    pub holder: Option<String>,
}

/// Frees the in-flight leases of `key_id` (all, or only `lease_id`) and writes a
/// `force_released` trail row for each, in the caller's transaction. Slots must be locked.
async fn force_release_in(
    conn: &mut PgConnection,
    key_id: &KeyId,
    lease_id: Option<LeaseId>,
    reason: &str,
    actor: &Actor,
) -> Result<Vec<ForcedRelease>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        WITH target AS (
            SELECT key_id, slot, lease_id, provider, pool, holder, lease_until
            FROM lease_slots
            WHERE key_id = $1 AND lease_id IS NOT NULL AND lease_until > now()
              AND ($2::uuid IS NULL OR lease_id = $2)
            FOR UPDATE
        ),
        freed AS (
            UPDATE lease_slots s
            SET lease_id = NULL, provider = NULL, pool = NULL, holder = NULL,
                granted_at = NULL, lease_until = NULL, probe = false,
                fence = NULL, request_id = NULL, request_digest = NULL
            FROM target
            WHERE s.key_id = target.key_id AND s.slot = target.slot
            RETURNING target.*
        ),
        trail AS (
            INSERT INTO lease_events
                (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at, reason, actor)
            SELECT 'force_released', lease_id, key_id, provider, pool, slot, holder, lease_until, now(), $3, $4
            FROM freed
        )
        SELECT lease_id AS "lease_id!", key_id AS "key_id!", holder FROM freed
        "#,
        key_id.as_str(),
        lease_id.map(|l| l.as_uuid()),
        reason,
        actor.as_str(),
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| ForcedRelease {
            lease_id: LeaseId::from(r.lease_id),
            key_id: r.key_id,
            holder: r.holder,
        })
        .collect())
}

/// Force-releases every in-flight lease of a credential (audited `force_released` with the
/// operator's reason, and a `leases_released` credential event). `None` if no such credential.
#[tracing::instrument(skip(db), err(level = "debug"))]
pub async fn release_all(
    db: &Db,
    key_id: &KeyId,
    reason: &str,
    actor: &Actor,
) -> Result<Option<Vec<ForcedRelease>>, sqlx::Error> {
    let mut tx = db.begin().await?;
    if !lock_credential(&mut tx, key_id).await? {
        return Ok(None);
    }
    let released = force_release_in(&mut tx, key_id, None, reason, actor).await?;
    let ids: Vec<String> = released.iter().map(|r| r.lease_id.to_string()).collect();
    audit(
        &mut tx,
        key_id,
        "leases_released",
        actor,
        reason,
        serde_json::json!({"leases": ids}),
    )
    .await?;
    tx.commit().await?;
    Ok(Some(released))
}

/// What a forced release of one lease found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ForceReleaseOutcome {
    /// Released.
    Released,
    /// Its lease_until had passed: its slot is already free.
    Expired,
    /// No lease with this id holds a slot.
    NotFound,
}

/// Force-releases one lease by id (audited `force_released` with the operator's reason).
#[tracing::instrument(skip(db), err(level = "debug"))]
pub async fn force_release_lease(
    db: &Db,
    lease_id: LeaseId,
    reason: &str,
    actor: &Actor,
) -> Result<ForceReleaseOutcome, sqlx::Error> {
    let mut tx = db.begin().await?;
    let Some(found) = sqlx::query!(
        r#"SELECT key_id, lease_until <= now() AS "expired!" FROM lease_slots WHERE lease_id = $1"#,
        lease_id.as_uuid()
    )
    .fetch_optional(&mut *tx)
    .await?
    else {
        return Ok(ForceReleaseOutcome::NotFound);
    };
    if found.expired {
        return Ok(ForceReleaseOutcome::Expired);
    }
    let key_id = decoded(KeyId::parse(found.key_id))?;
    lock_credential(&mut tx, &key_id).await?;
    let released = force_release_in(&mut tx, &key_id, Some(lease_id), reason, actor).await?;
    tx.commit().await?;
    // released concurrently by its executor between the look-up and the lock: nothing left to do
    Ok(if released.is_empty() {
        ForceReleaseOutcome::NotFound
    } else {
        ForceReleaseOutcome::Released
    })
}

/// Deletes a credential and everything that refers to it (its slots and their leases) in one
/// transaction; its in-flight leases are ended in the trail as `force_released` ("credential
/// deleted"), and the deletion is audited. History stays in the trail. `None` if no such
/// credential.
#[tracing::instrument(skip(db), err(level = "debug"))]
pub async fn delete(
    db: &Db,
    key_id: &KeyId,
    actor: &Actor,
) -> Result<Option<Vec<ForcedRelease>>, sqlx::Error> {
    let mut tx = db.begin().await?;
    if !lock_credential(&mut tx, key_id).await? {
        return Ok(None);
    }
    let old = configuration(&mut tx, key_id).await?;
    let released = force_release_in(&mut tx, key_id, None, "credential deleted", actor).await?;
    sqlx::query!("DELETE FROM credentials WHERE key_id = $1", key_id.as_str())
        .execute(&mut *tx)
        .await?;
    let ids: Vec<String> = released.iter().map(|r| r.lease_id.to_string()).collect();
    let details = serde_json::json!({"old": old, "force_released": ids});
    audit(
        &mut tx,
        key_id,
        "deleted",
        actor,
        "credential deleted",
        details,
    )
    .await?;
    tx.commit().await?;
    Ok(Some(released))
}

/// One (provider, pool) at a glance.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct PoolSummary {
    /// The provider.
    pub provider: String,
    /// The pool.
    pub pool: String,
    /// Credentials in it.
    pub credentials: i64,
    /// Credentials by status.
    pub by_status: BTreeMap<String, i64>,
    /// Credentials draining.
    pub draining: i64,
    /// Credentials cooling down now (status rate_limited, cooldown or exhausted with a cooldown
    /// end in the future).
    pub cooling_down: i64,
    /// Sum of their limits.
    pub total_slots: i64,
    /// Unexpired leases.
    pub in_flight: i64,
}

/// Every (provider, pool) with its counts, in order.
pub async fn pools(db: &Db) -> Result<Vec<PoolSummary>, sqlx::Error> {
    let mut work = db.work().await?;
    let rows = sqlx::query!(
        r#"
        SELECT c.provider, c.pool,
               count(*) AS "credentials!",
               count(*) FILTER (WHERE c.draining) AS "draining!",
               count(*) FILTER (WHERE credential_recovers_at(c.status, c.cooldown_until, now()) IS NOT NULL)
                   AS "cooling_down!",
               sum(c.max_concurrent_uses)::int8 AS "total_slots!",
               coalesce(sum(s.in_flight), 0)::int8 AS "in_flight!",
               array_agg(c.status) AS "statuses!"
        FROM credentials c
        LEFT JOIN (
            SELECT key_id, count(*) AS in_flight
            FROM lease_slots
            WHERE lease_id IS NOT NULL AND lease_until > now()
            GROUP BY key_id
        ) s ON s.key_id = c.key_id
        GROUP BY c.provider, c.pool
        ORDER BY c.provider, c.pool
        "#
    )
    .fetch_all(&mut *work)
    .await?;
    work.done().await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let mut by_status = BTreeMap::new();
            for status in r.statuses {
                *by_status.entry(status).or_insert(0) += 1;
            }
            PoolSummary {
                provider: r.provider,
                pool: r.pool,
                credentials: r.credentials,
                by_status,
                draining: r.draining,
                cooling_down: r.cooling_down,
                total_slots: r.total_slots,
                in_flight: r.in_flight,
            }
        })
        .collect())
}

/// Seals under the keyring's current key every secret still stored as plaintext (written before
/// secrets were sealed) and, unless `plaintext_only`, every secret sealed under an older master
/// key; in batches of 500, one transaction each. Returns how many were resealed. Audited
/// `secret_resealed`.
pub async fn reseal(
    db: &Db,
    keyring: &Keyring,
    plaintext_only: bool,
    actor: &Actor,
) -> Result<usize, sqlx::Error> {
    let mut resealed = 0;
    let mut after = String::new();
    loop {
        let mut tx = db.begin().await?;
        let rows = sqlx::query!(
            r#"
            SELECT key_id, secret, secret_ciphertext
            FROM credentials
            WHERE key_id > $1
            ORDER BY key_id
            LIMIT 500
            FOR UPDATE
            "#,
            after
        )
        .fetch_all(&mut *tx)
        .await?;
        let Some(last) = rows.last() else { break };
        after = last.key_id.clone();
        for row in rows {
            let key_id = decoded(KeyId::parse(row.key_id))?;
            let secret = match (row.secret, row.secret_ciphertext) {
                (Some(plain), _) => decoded(crate::domain::Secret::parse(plain))?,
                (None, Some(sealed)) if !plaintext_only && !keyring.is_current(&sealed) => keyring
                    .open(&key_id, &sealed)
                    .map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
                _ => continue,
            };
            let sealed = keyring.seal(&key_id, &secret);
            sqlx::query!(
                "UPDATE credentials SET secret = NULL, secret_ciphertext = $2 WHERE key_id = $1",
                key_id.as_str(),
                &sealed
            )
            .execute(&mut *tx)
            .await?;
            let details = serde_json::json!({"master_key": keyring.current().fingerprint()});
            audit(
                &mut tx,
                &key_id,
                "secret_resealed",
                actor,
                "secret sealed under the current master key",
                details,
            )
            .await?;
            resealed += 1;
        }
        tx.commit().await?;
    }
    Ok(resealed)
}

/// Master key fingerprints (hex) that sealed secrets need, with how many credentials need each.
pub async fn sealing_keys(db: &Db) -> Result<Vec<(String, i64)>, sqlx::Error> {
    let mut work = db.work().await?;
    let rows = sqlx::query!(
        r#"
        SELECT encode(substring(secret_ciphertext FROM 4 FOR 8), 'hex') AS "fingerprint!", count(*) AS "count!"
        FROM credentials
        WHERE secret_ciphertext IS NOT NULL
        GROUP BY 1
        "#
    )
    .fetch_all(&mut *work)
    .await?;
    work.done().await?;
    Ok(rows.into_iter().map(|r| (r.fingerprint, r.count)).collect())
}
