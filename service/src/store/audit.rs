//! Questions answered from the audit trail alone (the SQL functions of `sql/audit.sql`;
//! docs/audit.md shows each query).

use sqlx::PgExecutor;

use super::Db;
use time::OffsetDateTime;

/// One credential's line of the oversell proof (SQL function `credpool_oversell_check`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct OversellRow {
    /// The credential.
    pub key_id: String,
    /// Its limit now (`None` if it has been deleted).
    pub max_concurrent_uses: Option<i32>,
    /// Leases granted in the range.
    pub leases: i64,
    /// The most leases it held at one moment.
    pub peak: i64,
    /// Grants that left more leases held than its limit at that moment allowed. Anything but 0
    /// is an oversell.
    pub grants_over_limit: i64,
    /// When the first such grant happened.
    #[serde(with = "time::serde::rfc3339::option")]
    pub first_violation_at: Option<OffsetDateTime>,
}

/// The oversell proof over `[since, until)`, from the audit trail alone (see the SQL function
/// `credpool_oversell_check` for the exact rule).
#[tracing::instrument(skip(executor), err(level = "debug"))]
pub async fn oversell_check(
    executor: impl PgExecutor<'_>,
    since: OffsetDateTime,
    until: OffsetDateTime,
) -> Result<Vec<OversellRow>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        SELECT key_id AS "key_id!", max_concurrent_uses, leases AS "leases!", peak AS "peak!",
               grants_over_limit AS "grants_over_limit!", first_violation_at
        FROM credpool_oversell_check($1, $2)
        "#,
        since,
        until,
    )
    .fetch_all(executor)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| OversellRow {
            key_id: r.key_id,
            max_concurrent_uses: r.max_concurrent_uses,
            leases: r.leases,
            peak: r.peak,
            grants_over_limit: r.grants_over_limit,
            first_violation_at: r.first_violation_at,
        })
        .collect())
}

/// Whom a line of a window proof is about: a credential (`credpool_window_check`) or a tenant
/// (`credpool_tenant_window_check`). Serialized as `"key_id": ...` or `"tenant_id": ...`.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WindowSubject {
    /// The credential.
    KeyId(String),
    /// The tenant, over all its credentials.
    TenantId(String),
}

impl WindowSubject {
    /// The credential's key_id or the tenant's id.
    pub fn id(&self) -> &str {
        match self {
            WindowSubject::KeyId(id) | WindowSubject::TenantId(id) => id,
        }
    }
}

/// One credential's or tenant's and window's line of a window proof.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WindowRow {
    /// The credential or the tenant.
    #[serde(flatten)]
    pub subject: WindowSubject,
    /// `requests` or `tokens`.
    pub kind: String,
    /// The window's length in seconds.
    pub seconds: i32,
    /// Its count: requests, or tokens (the largest in effect over the range).
    pub window_count: i64,
    /// Grants in the range under this window (a tenant's: over all its credentials).
    pub grants: i64,
    /// The most the window had charged at a grant (requests, or reserved-or-reported tokens).
    pub peak: i64,
    /// Grants at which the window had charged more than its count. Anything but 0 is a grant
    /// over a rate window.
    pub grants_over_window: i64,
    /// When the first such grant happened.
    #[serde(with = "time::serde::rfc3339::option")]
    pub first_violation_at: Option<OffsetDateTime>,
}

/// The window proof over `[since, until)`, from the audit trail alone (see the SQL function
/// `credpool_window_check` for the exact rule).
#[tracing::instrument(skip(executor), err(level = "debug"))]
pub async fn window_check(
    executor: impl PgExecutor<'_>,
    since: OffsetDateTime,
    until: OffsetDateTime,
) -> Result<Vec<WindowRow>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        SELECT key_id AS "key_id!", kind AS "kind!", seconds AS "seconds!",
               window_count AS "window_count!", grants AS "grants!", peak AS "peak!",
               grants_over_window AS "grants_over_window!", first_violation_at
        FROM credpool_window_check($1, $2)
        ORDER BY key_id, kind, seconds
        "#,
        since,
        until,
    )
    .fetch_all(executor)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| WindowRow {
            subject: WindowSubject::KeyId(r.key_id),
            kind: r.kind,
            seconds: r.seconds,
            window_count: r.window_count,
            grants: r.grants,
            peak: r.peak,
            grants_over_window: r.grants_over_window,
            first_violation_at: r.first_violation_at,
        })
        .collect())
}

/// The tenant window proof over `[since, until)`, from the audit trail alone: per tenant and
/// window (`requests` or `tokens` per `seconds`) it had, whether any grant was made while the
/// tenant's grants over all its credentials in the window's last `seconds` had charged more than
/// its count, judged by the windows in force at that grant (`tenant_events`) and by what credpool
/// could know then (reservations, replaced by reported usage only from the moment it was
/// reported). The same rule as [`window_check`]; see the SQL functions
/// `credpool_tenant_window_check` and `credpool_scope_window_check`.
#[tracing::instrument(skip(executor), err(level = "debug"))]
pub async fn tenant_window_check(
    executor: impl PgExecutor<'_>,
    since: OffsetDateTime,
    until: OffsetDateTime,
) -> Result<Vec<WindowRow>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        SELECT tenant_id AS "tenant_id!", kind AS "kind!", seconds AS "seconds!",
               window_count AS "window_count!", grants AS "grants!", peak AS "peak!",
               grants_over_window AS "grants_over_window!", first_violation_at
        FROM credpool_tenant_window_check($1, $2)
        ORDER BY tenant_id, kind, seconds
        "#,
        since,
        until,
    )
    .fetch_all(executor)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| WindowRow {
            subject: WindowSubject::TenantId(r.tenant_id),
            kind: r.kind,
            seconds: r.seconds,
            window_count: r.window_count,
            grants: r.grants,
            peak: r.peak,
            grants_over_window: r.grants_over_window,
            first_violation_at: r.first_violation_at,
        })
        .collect())
}

/// One tenant's line of the tenant cap proof (SQL function `credpool_tenant_cap_check`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct TenantCapRow {
    /// The tenant.
    pub tenant_id: String,
    /// Its cap now (`None`: no cap, or deleted).
    pub max_concurrent_leases: Option<i32>,
    /// Leases granted to it in the range.
    pub leases: i64,
    /// The most leases it held at one moment.
    pub peak: i64,
    /// Grants that left it holding more leases than its cap at that moment allowed. Anything
    /// but 0 is a grant over a tenant's cap.
    pub grants_over_cap: i64,
    /// When the first such grant happened.
    #[serde(with = "time::serde::rfc3339::option")]
    pub first_violation_at: Option<OffsetDateTime>,
}

/// The tenant cap proof over `[since, until)`, from the audit trail alone (see the SQL function
/// `credpool_tenant_cap_check` for the exact rule).
#[tracing::instrument(skip(executor), err(level = "debug"))]
pub async fn tenant_cap_check(
    executor: impl PgExecutor<'_>,
    since: OffsetDateTime,
    until: OffsetDateTime,
) -> Result<Vec<TenantCapRow>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        SELECT tenant_id AS "tenant_id!", max_concurrent_leases, leases AS "leases!",
               peak AS "peak!", grants_over_cap AS "grants_over_cap!", first_violation_at
        FROM credpool_tenant_cap_check($1, $2)
        "#,
        since,
        until,
    )
    .fetch_all(executor)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| TenantCapRow {
            tenant_id: r.tenant_id,
            max_concurrent_leases: r.max_concurrent_leases,
            leases: r.leases,
            peak: r.peak,
            grants_over_cap: r.grants_over_cap,
            first_violation_at: r.first_violation_at,
        })
        .collect())
}

/// Leases among `key_ids` granted in `[since, until)` that ended by expiry (SQL function
/// `credpool_lease_lifetimes`).
pub async fn expired_without_release(
    executor: impl PgExecutor<'_>,
    since: OffsetDateTime,
    until: OffsetDateTime,
    key_ids: &[String],
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar!(
        r#"
        SELECT count(*) AS "count!"
        FROM credpool_lease_lifetimes($1, $2)
        WHERE ended_by = 'expired' AND key_id = ANY ($3) AND granted_at >= $1
        "#,
        since,
        until,
        key_ids,
    )
    .fetch_one(executor)
    .await
}

/// Renewals of leases on `key_ids` recorded in [since, until).
pub async fn renewals(
    executor: impl PgExecutor<'_>,
    since: OffsetDateTime,
    until: OffsetDateTime,
    key_ids: &[String],
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar!(
        r#"
        SELECT count(*) AS "count!"
        FROM lease_events
        WHERE event = 'renewed' AND key_id = ANY ($3) AND at >= $1 AND at < $2
        "#,
        since,
        until,
        key_ids,
    )
    .fetch_one(executor)
    .await
}

/// The database clock.
pub async fn database_now(executor: impl PgExecutor<'_>) -> Result<OffsetDateTime, sqlx::Error> {
    sqlx::query_scalar!(r#"SELECT now() AS "now!""#)
        .fetch_one(executor)
        .await
}

/// The database clock, read on a connection of `db` (see [`database_now`]).
pub async fn now(db: &Db) -> Result<OffsetDateTime, sqlx::Error> {
    let mut work = db.work().await?;
    let now = database_now(&mut *work).await?;
    work.done().await?;
    Ok(now)
}
