//! Tenants and their executor keys: who holds a lease, and the cap on the live leases
//! each may hold. The cap itself is decided by the claim on the tenant's `tenant_slots` rows
//! (`sql/claim.sql`, CLAIM, "Tenants"); this module writes the configuration, fits the rows to it
//! (`credpool_fit_tenant`) and keeps the keys, of which it stores only SHA-256 hashes.
//!
//! Every change is one transaction, with its `tenant_events` trail row dated `clock_timestamp()`
//! after the change's locks (the cap proof of `credpool audit verify` judges each grant by the
//! cap in force then). Lock order (docs/design.md, "Lock order"): the tenant's advisory lock,
//! then its `tenants` row, then (fit) slot rows, then tenant slot rows.

use serde::Serialize;
use sqlx::PgExecutor;
use time::OffsetDateTime;
use uuid::Uuid;

use super::Db;
use super::credentials::Actor;
use crate::domain::windows::RateLimits;
use crate::domain::{PoolPattern, TenantId, TenantKey, TenantKeyHash, TenantScope};

/// A tenant's configuration as an operator sets it (`PUT /api/admin/tenants/{tenant_id}`).
#[derive(Debug, Clone)]
pub struct TenantSpec {
    /// The tenant.
    pub tenant_id: TenantId,
    /// Live leases it may hold at once over every credential (1..=100000; the API refuses 0);
    /// `None`: no cap.
    pub max_concurrent_leases: Option<i32>,
    /// Its share of a saturated pool (1..=1000): fair share when requests wait.
    pub weight: i32,
    /// Its rate windows over all its leases, decided in the claim (its tenant_windows row).
    pub rate_limits: RateLimits,
    /// The providers and pools its keys may lease from (empty: none).
    pub pools: TenantScope,
    /// Whether an outcome report of its leases alone may take a credential out of traffic until
    /// an operator acts (`auth_error`; `quota_exhausted` without a retry_after); otherwise such a
    /// report rests the credential for a bounded time.
    pub reports_may_disable: bool,
}

/// A tenant as the admin API shows it: its configuration, its usage now, and its keys (ids
/// only: a key is shown once, when it is minted).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct TenantDetail {
    /// The tenant.
    #[schema(value_type = String)]
    pub tenant_id: String,
    /// Its cap on live leases; `null`: none.
    pub max_concurrent_leases: Option<i32>,
    /// Its weight.
    pub weight: i32,
    /// Its rate windows, as set: an array of `{"requests" | "tokens": N, "seconds": S}`.
    #[schema(value_type = Vec<Object>)]
    pub rate_limits: serde_json::Value,
    /// The providers and pools its keys may lease from: `provider/pool` patterns whose halves
    /// are names or `*` (`[]`: none).
    pub pools: Vec<String>,
    /// Whether a report of its leases alone may disable a credential (`auth_error`) or rest it
    /// until an operator acts (`quota_exhausted` without `retry_after_seconds`).
    pub reports_may_disable: bool,
    /// Live leases it holds now (lease_until after the database clock), over every credential.
    pub in_flight: i64,
    /// Its executor keys, live and revoked (never the key or its hash).
    pub keys: Vec<TenantKeyInfo>,
    /// When it was created (database clock).
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When its configuration last changed.
    #[serde(with = "time::serde::rfc3339")]
    pub updated_at: OffsetDateTime,
}

/// One executor key of a tenant, without the key.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct TenantKeyInfo {
    /// The key's id (for `DELETE .../keys/{key_id}`).
    pub key_id: Uuid,
    /// When it was minted.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When it was revoked; `null` while it is live.
    #[serde(with = "time::serde::rfc3339::option")]
    pub revoked_at: Option<OffsetDateTime>,
}

/// Why a tenant was not deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteRefused {
    /// No such tenant.
    NotFound,
    /// `default`: the configured internal key's tenant.
    Default,
    /// It holds live leases (delete it once they have ended).
    HoldsLeases,
}

/// Creates or updates a tenant, fits its slot rows to its cap and writes its trail row, in one
/// transaction. Returns the tenant and whether it was created.
#[tracing::instrument(skip_all, fields(tenant = %spec.tenant_id), err(level = "debug"))]
pub async fn upsert(
    db: &Db,
    spec: &TenantSpec,
    actor: &Actor,
) -> Result<(TenantDetail, bool), sqlx::Error> {
    let rate_limits =
        serde_json::to_value(&spec.rate_limits).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    let seed = seed_windows(db, &spec.tenant_id, &rate_limits).await?;
    let pools: Vec<&str> = spec
        .pools
        .patterns()
        .iter()
        .map(PoolPattern::as_str)
        .collect();
    let mut tx = db.begin().await?;
    lock_tenant(&mut *tx, &spec.tenant_id).await?;
    let created = sqlx::query_scalar!(
        r#"
        INSERT INTO tenants AS t (tenant_id, max_concurrent_leases, weight, rate_limits, pools,
                                  reports_may_disable, updated_at)
        VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp())
        ON CONFLICT ON CONSTRAINT tenants_pkey DO UPDATE
        SET max_concurrent_leases = EXCLUDED.max_concurrent_leases, weight = EXCLUDED.weight,
            rate_limits = EXCLUDED.rate_limits, pools = EXCLUDED.pools,
            reports_may_disable = EXCLUDED.reports_may_disable,
            -- the time the VALUES read: Citus takes no volatile function in DO UPDATE SET
            updated_at = EXCLUDED.updated_at
        RETURNING (xmax = 0) AS "created!"
        "#,
        spec.tenant_id.as_str(),
        spec.max_concurrent_leases,
        spec.weight,
        rate_limits,
        &pools[..] as &[&str],
        spec.reports_may_disable,
    )
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query!(
        "SELECT credpool_fit_tenant($1, $2)",
        spec.tenant_id.as_str(),
        seed
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query!(
        r#"
        INSERT INTO tenant_events (tenant_id, event, max_concurrent_leases, weight, rate_limits,
                                   pools, reports_may_disable, actor, at)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, clock_timestamp())
        "#,
        spec.tenant_id.as_str(),
        if created { "created" } else { "updated" },
        spec.max_concurrent_leases,
        spec.weight,
        rate_limits,
        &pools[..] as &[&str],
        spec.reports_may_disable,
        actor.as_str(),
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    let detail = get(db, &spec.tenant_id)
        .await?
        .ok_or(sqlx::Error::RowNotFound)?;
    Ok((detail, created))
}

/// The windows `rate_limits` of `tenant` seeded from the trail, before the change that sets them
/// takes the tenant's lock (SQL functions `credpool_tenant_cut` and `credpool_seed_tenant_windows`:
/// read their comments): a first, short transaction waits for the tenant's grants in flight and
/// marks the moment up to which every grant has committed; the trail up to it is then read with
/// no lock held, so the tenant's claims go on while a long window's history is counted. `None`
/// without windows.
async fn seed_windows(
    db: &Db,
    tenant: &TenantId,
    rate_limits: &serde_json::Value,
) -> Result<Option<serde_json::Value>, sqlx::Error> {
    if rate_limits.as_array().is_none_or(Vec::is_empty) {
        return Ok(None);
    }
    let mut work = db.work().await?;
    let cut = sqlx::query_scalar!(
        r#"SELECT credpool_tenant_cut($1) AS "cut!""#,
        tenant.as_str()
    )
    .fetch_one(&mut *work)
    .await?;
    work.done().await?;
    let mut work = db.work().await?;
    let seed = sqlx::query_scalar!(
        r#"SELECT credpool_seed_tenant_windows($1, $2, $3) AS "seed!""#,
        tenant.as_str(),
        rate_limits,
        cut,
    )
    .fetch_one(&mut *work)
    .await?;
    work.done().await?;
    Ok(Some(seed))
}

/// The tenant's advisory lock (the first lock of every change of a tenant; `credpool_fit_tenant`
/// takes it too, which is re-entrant within a transaction).
async fn lock_tenant(executor: impl PgExecutor<'_>, tenant: &TenantId) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "SELECT pg_advisory_xact_lock(hashtextextended('credpool.tenant:' || $1, 0))",
        tenant.as_str()
    )
    .execute(executor)
    .await?;
    Ok(())
}

/// Every tenant with its usage, in tenant_id order.
#[tracing::instrument(skip_all, err(level = "debug"))]
pub async fn list(db: &Db) -> Result<Vec<TenantDetail>, sqlx::Error> {
    read(db, None).await
}

/// One tenant with its usage.
pub async fn get(db: &Db, tenant: &TenantId) -> Result<Option<TenantDetail>, sqlx::Error> {
    Ok(read(db, Some(tenant)).await?.pop())
}

async fn read(db: &Db, only: Option<&TenantId>) -> Result<Vec<TenantDetail>, sqlx::Error> {
    let mut work = db.work().await?;
    let rows = sqlx::query!(
        r#"
        SELECT u.tenant_id AS "tenant_id!", u.max_concurrent_leases, u.weight AS "weight!",
               u.rate_limits AS "rate_limits!", t.pools, t.reports_may_disable,
               u.in_flight AS "in_flight!",
               u.created_at AS "created_at!", u.updated_at AS "updated_at!",
               coalesce((SELECT jsonb_agg(jsonb_build_object(
                                    'key_id', k.key_id, 'created_at', k.created_at,
                                    'revoked_at', k.revoked_at) ORDER BY k.created_at, k.key_id)
                         FROM tenant_keys k WHERE k.tenant_id = u.tenant_id), '[]') AS "keys!"
        FROM tenant_usage u
        JOIN tenants t ON t.tenant_id = u.tenant_id
        WHERE $1::text IS NULL OR u.tenant_id = $1
        ORDER BY u.tenant_id
        "#,
        only.map(TenantId::as_str),
    )
    .fetch_all(&mut *work)
    .await?;
    work.done().await?;
    rows.into_iter()
        .map(|r| {
            #[derive(serde::Deserialize)]
            struct Key {
                key_id: Uuid,
                #[serde(with = "time::serde::rfc3339")]
                created_at: OffsetDateTime,
                #[serde(with = "time::serde::rfc3339::option")]
                revoked_at: Option<OffsetDateTime>,
            }
            let keys: Vec<Key> =
                serde_json::from_value(r.keys).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
            Ok(TenantDetail {
                tenant_id: r.tenant_id,
                max_concurrent_leases: r.max_concurrent_leases,
                weight: r.weight,
                rate_limits: r.rate_limits,
                pools: r.pools,
                reports_may_disable: r.reports_may_disable,
                in_flight: r.in_flight,
                keys: keys
                    .into_iter()
                    .map(|k| TenantKeyInfo {
                        key_id: k.key_id,
                        created_at: k.created_at,
                        revoked_at: k.revoked_at,
                    })
                    .collect(),
                created_at: r.created_at,
                updated_at: r.updated_at,
            })
        })
        .collect()
}

/// Deletes a tenant and its keys (their requests are refused from the commit on), unless it is
/// `default` or holds live leases.
#[tracing::instrument(skip_all, fields(tenant = %tenant), err(level = "debug"))]
pub async fn delete(
    db: &Db,
    tenant: &TenantId,
    actor: &Actor,
) -> Result<Result<(), DeleteRefused>, sqlx::Error> {
    if tenant == &TenantId::default_tenant() {
        return Ok(Err(DeleteRefused::Default));
    }
    let mut tx = db.begin().await?;
    // On Citus the leases in flight are read from every worker, over several connections per
    // worker, and the tenant's row then deleted with its rows on the workers (a foreign key to a
    // reference table), which Citus does only over one connection per worker in a transaction
    // that has used no other: read sequentially. (On plain PostgreSQL a setting nothing reads.)
    sqlx::query("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
        .execute(&mut *tx)
        .await?;
    lock_tenant(&mut *tx, tenant).await?;
    let found = sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM tenants WHERE tenant_id = $1 FOR UPDATE) AS "found!""#,
        tenant.as_str()
    )
    .fetch_one(&mut *tx)
    .await?;
    if !found {
        return Ok(Err(DeleteRefused::NotFound));
    }
    let in_flight = sqlx::query_scalar!(
        r#"SELECT in_flight AS "in_flight!" FROM tenant_usage WHERE tenant_id = $1"#,
        tenant.as_str()
    )
    .fetch_one(&mut *tx)
    .await?;
    if in_flight > 0 {
        return Ok(Err(DeleteRefused::HoldsLeases));
    }
    sqlx::query!("DELETE FROM tenants WHERE tenant_id = $1", tenant.as_str())
        .execute(&mut *tx)
        .await?;
    sqlx::query!(
        "INSERT INTO tenant_events (tenant_id, event, actor, at) VALUES ($1, 'deleted', $2, clock_timestamp())",
        tenant.as_str(),
        actor.as_str(),
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Ok(()))
}

/// Mints an executor key for a tenant: the key (returned here and never again: only its hash
/// is stored) and its id. `None` when the tenant does not exist, or a delete of it commits while
/// the key is being minted.
#[tracing::instrument(skip_all, fields(tenant = %tenant), err(level = "debug"))]
pub async fn mint_key(
    db: &Db,
    tenant: &TenantId,
    actor: &Actor,
) -> Result<Option<(Uuid, TenantKey)>, sqlx::Error> {
    let key = TenantKey::generate();
    let key_id = Uuid::new_v4();
    let mut tx = db.begin().await?;
    // The tenant's lock, which a delete takes: the INSERT's snapshot then starts after any delete
    // of the tenant has committed. Without it the INSERT could read the tenant a delete was
    // removing and fail on the foreign key once the delete committed (a 503, not a 404). Shared:
    // a mint changes nothing a claim decides on, so the tenant's claims go on meanwhile.
    sqlx::query!(
        "SELECT pg_advisory_xact_lock_shared(hashtextextended('credpool.tenant:' || $1, 0))",
        tenant.as_str()
    )
    .execute(&mut *tx)
    .await?;
    let inserted = sqlx::query!(
        r#"
        INSERT INTO tenant_keys (key_id, tenant_id, key_hash)
        SELECT $1, t.tenant_id, $3 FROM tenants t WHERE t.tenant_id = $2
        "#,
        key_id,
        tenant.as_str(),
        &key.hash().0[..],
    )
    .execute(&mut *tx)
    .await?
    .rows_affected();
    let created = key_changed(tx, inserted, tenant, "key_created", key_id, actor).await?;
    Ok(created.then_some((key_id, key)))
}

/// Revokes a tenant's key: from the commit on, no request with it succeeds, on any replica (every
/// executor call reads the key's row). `false` when the tenant has no live key with this id.
#[tracing::instrument(skip_all, fields(tenant = %tenant, key_id = %key_id), err(level = "debug"))]
pub async fn revoke_key(
    db: &Db,
    tenant: &TenantId,
    key_id: Uuid,
    actor: &Actor,
) -> Result<bool, sqlx::Error> {
    let mut tx = db.begin().await?;
    let revoked = sqlx::query!(
        r#"
        -- (the statement's start: Citus takes no volatile function in an UPDATE of its tables)
        UPDATE tenant_keys SET revoked_at = statement_timestamp()
        WHERE key_id = $1 AND tenant_id = $2 AND revoked_at IS NULL
        "#,
        key_id,
        tenant.as_str(),
    )
    .execute(&mut *tx)
    .await?
    .rows_affected();
    key_changed(tx, revoked, tenant, "key_revoked", key_id, actor).await
}

/// Ends a change to one of `tenant`'s keys: when the change wrote a row (`rows`), records
/// `event` ([`key_event`]) and commits; otherwise drops `tx`, which rolls it back. Whether it
/// wrote one.
async fn key_changed(
    mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
    rows: u64,
    tenant: &TenantId,
    event: &str,
    key_id: Uuid,
    actor: &Actor,
) -> Result<bool, sqlx::Error> {
    if rows == 0 {
        return Ok(false);
    }
    key_event(&mut *tx, tenant, event, key_id, actor).await?;
    tx.commit().await?;
    Ok(true)
}

async fn key_event(
    executor: impl PgExecutor<'_>,
    tenant: &TenantId,
    event: &str,
    key_id: Uuid,
    actor: &Actor,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "INSERT INTO tenant_events (tenant_id, event, key_id, actor, at) VALUES ($1, $2, $3, $4, clock_timestamp())",
        tenant.as_str(),
        event,
        key_id,
        actor.as_str(),
    )
    .execute(executor)
    .await?;
    Ok(())
}

/// What a live tenant key may do: its tenant, the pools it may lease from and whether its
/// reports may disable a credential.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyTenant {
    /// The key's tenant.
    pub tenant: TenantId,
    /// The providers and pools it may lease from.
    pub pools: TenantScope,
    /// Whether a report of its leases alone may take a credential out of traffic until an
    /// operator acts.
    pub reports_may_disable: bool,
}

/// The tenant of a live key with this hash, with its scope; `None` for a key that is unknown or
/// revoked. One statement: an index probe of `tenant_keys` (SQL function `credpool_key_tenant`,
/// the definition claim, renew and release check keys with in their own statements) and one of
/// `tenants`, read at the call, so a revoke or a change of scope is seen by every replica as soon
/// as it has committed. Every executor request with a tenant key makes it before its body is read
/// (docs/src/security.md, "Authentication first").
pub async fn key_tenant(db: &Db, hash: TenantKeyHash) -> Result<Option<KeyTenant>, sqlx::Error> {
    let mut work = db.work().await?;
    let row = sqlx::query!(
        r#"
        SELECT t.tenant_id, t.pools, t.reports_may_disable
        FROM credpool_key_tenant($1) AS k (tenant)
        JOIN tenants t ON t.tenant_id = k.tenant
        "#,
        hash.to_hex(),
    )
    .fetch_optional(&mut *work)
    .await?;
    work.done().await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let decode = |e: crate::domain::InvalidValue| sqlx::Error::Decode(Box::new(e));
    let patterns = row
        .pools
        .into_iter()
        .map(PoolPattern::parse)
        .collect::<Result<Vec<_>, _>>()
        .map_err(decode)?;
    Ok(Some(KeyTenant {
        tenant: TenantId::parse(row.tenant_id).map_err(decode)?,
        pools: TenantScope::new(patterns).map_err(decode)?,
        reports_may_disable: row.reports_may_disable,
    }))
}
