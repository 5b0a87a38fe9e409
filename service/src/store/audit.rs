//! Questions answered from the audit trail alone (the SQL functions of `sql/audit.sql`;
//! docs/audit.md shows each query), and the incremental proofs: runs that record in
//! `audit_checkpoints` what they have proven, so that each chunk proves only what the trail gained
//! since ([`advance`]).

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
    sqlx::query_as!(
        OversellRow,
        r#"
        SELECT key_id AS "key_id!", max_concurrent_uses, leases AS "leases!", peak AS "peak!",
               grants_over_limit AS "grants_over_limit!", first_violation_at
        FROM credpool_oversell_check($1, $2)
        "#,
        since,
        until,
    )
    .fetch_all(executor)
    .await
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
    sqlx::query_as!(
        TenantCapRow,
        r#"
        SELECT tenant_id AS "tenant_id!", max_concurrent_leases, leases AS "leases!",
               peak AS "peak!", grants_over_cap AS "grants_over_cap!", first_violation_at
        FROM credpool_tenant_cap_check($1, $2)
        "#,
        since,
        until,
    )
    .fetch_all(executor)
    .await
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

pub use crate::domain::AUDIT_PROOFS as PROOFS;

/// A record of proofs (SQL table `audit_checkpoints`): what was proven, up to when, and what
/// was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Run {
    /// The continuous proof: advanced by the maintenance pass and by `credpool audit verify`,
    /// from the trail's oldest row (at most a day before it first ran) onwards, as the trail
    /// grows.
    Continuous,
    /// One proof of a range from `since`: `credpool audit verify --since/--until/--full`, kept
    /// by its start so that an interrupted run resumes.
    Range {
        /// Grants from this moment on are judged.
        since: OffsetDateTime,
    },
}

impl Run {
    /// Its name in `audit_checkpoints.run`: `continuous`, or `range:` and its start in RFC 3339.
    pub fn name(&self) -> String {
        match self {
            Run::Continuous => "continuous".to_owned(),
            Run::Range { since } => format!(
                "range:{}",
                since
                    .format(&time::format_description::well_known::Rfc3339)
                    .unwrap_or_else(|_| since.unix_timestamp_nanos().to_string())
            ),
        }
    }
}

/// Where one proof of a run stands (a row of `audit_checkpoints`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Checkpoint {
    /// One of [`PROOFS`].
    pub proof: String,
    /// Grants from this moment on are judged.
    #[serde(with = "time::serde::rfc3339")]
    pub since: OffsetDateTime,
    /// Where the run stops; `None`: it follows the trail.
    #[serde(with = "time::serde::rfc3339::option")]
    pub until_target: Option<OffsetDateTime>,
    /// Every grant in `[since, proven_until)` has been judged. Before `since` while the run
    /// still reads the day before its start for the leases live then (the concurrency proofs).
    #[serde(with = "time::serde::rfc3339")]
    pub proven_until: OffsetDateTime,
    /// Grants judged.
    pub grants: i64,
    /// Grants that broke the proof's rule. Anything but 0 is a breach.
    pub violations: i64,
    /// When the first of them was granted.
    #[serde(with = "time::serde::rfc3339::option")]
    pub first_violation_at: Option<OffsetDateTime>,
    /// Trail rows the proof has read, over its chunks.
    pub rows_read: i64,
    /// Chunks run.
    pub chunks: i64,
    /// When the checkpoint last moved (database clock).
    #[serde(with = "time::serde::rfc3339")]
    pub updated_at: OffsetDateTime,
}

/// What one call of [`advance`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Advanced {
    /// Trail rows of the chunk (the most any proof read; each proof reads its chunk).
    pub rows_read: i64,
    /// A proof stopped short of its target: call again.
    pub more: bool,
}

/// Opens the ranged run from `since` to `until`, or keeps it when an earlier one with the same
/// start was interrupted (it has not reached its end) and has not passed `until`, so that it
/// resumes (SQL function `credpool_audit_open`); a finished range is proven again. Returns
/// whether it resumed.
pub async fn open_range(
    executor: impl PgExecutor<'_>,
    since: OffsetDateTime,
    until: OffsetDateTime,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT credpool_audit_open($1, $2, $3) AS "resumed!""#,
        Run::Range { since }.name(),
        since,
        until,
    )
    .fetch_one(executor)
    .await
}

/// Advances every proof of `run` by one chunk of at most `rows` trail rows, committed with the
/// statement (SQL function `credpool_audit_advance`; the continuous proof is opened on first
/// use). `None`: another session is advancing this run right now, nothing was done. The
/// statement runs as long as its chunk needs: run it without the request path's statement
/// timeout.
pub async fn advance(
    executor: impl PgExecutor<'_>,
    run: &Run,
    rows: u32,
) -> Result<Option<Advanced>, sqlx::Error> {
    let row = sqlx::query!(
        r#"SELECT rows_read, more FROM credpool_audit_advance($1, $2)"#,
        run.name(),
        i32::try_from(rows).unwrap_or(i32::MAX),
    )
    .fetch_one(executor)
    .await?;
    Ok(row.rows_read.map(|rows_read| Advanced {
        rows_read,
        more: row.more.unwrap_or(false),
    }))
}

/// The checkpoints of `run`, in the order of [`PROOFS`] (none before it first ran).
pub async fn checkpoints(
    executor: impl PgExecutor<'_>,
    run: &Run,
) -> Result<Vec<Checkpoint>, sqlx::Error> {
    let mut rows = sqlx::query_as!(
        Checkpoint,
        r#"
        SELECT proof, since, until_target, proven_until, grants, violations, first_violation_at,
               rows_read, chunks, updated_at
        FROM audit_checkpoints
        WHERE run = $1
        "#,
        run.name(),
    )
    .fetch_all(executor)
    .await?;
    rows.sort_by_key(|c| PROOFS.iter().position(|p| *p == c.proof));
    Ok(rows)
}

/// What a run has found, line by line, as the proof functions report it over its range.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Findings {
    /// The oversell proof: one line per credential with grants judged.
    pub credentials: Vec<OversellRow>,
    /// The window proof: one line per credential and window.
    pub windows: Vec<WindowRow>,
    /// The tenant cap proof: one line per tenant.
    pub tenants: Vec<TenantCapRow>,
    /// The tenant window proof: one line per tenant and window.
    pub tenant_windows: Vec<WindowRow>,
}

/// What `run` has found so far (SQL table `audit_checkpoint_subjects`), with each credential's
/// limit and each tenant's cap as they are now.
pub async fn findings(conn: &mut sqlx::PgConnection, run: &Run) -> Result<Findings, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        SELECT s.proof AS "proof!", s.subject AS "subject!", s.kind AS "kind!",
               s.seconds AS "seconds!", s.window_count, s.grants AS "grants!", s.peak AS "peak!",
               s.violations AS "violations!", s.first_violation_at
        FROM audit_checkpoint_subjects s
        WHERE s.run = $1
        ORDER BY s.proof, s.subject, s.kind, s.seconds
        "#,
        run.name(),
    )
    .fetch_all(&mut *conn)
    .await?;
    // the limits now, read apart: on Citus the subjects' rows stay on the coordinator and the
    // credentials are on the workers, which one statement cannot join
    let subjects = |proof: &str| -> Vec<String> {
        rows.iter()
            .filter(|r| r.proof == proof)
            .map(|r| r.subject.clone())
            .collect()
    };
    let limits: std::collections::HashMap<(bool, String), Option<i32>> = sqlx::query!(
        r#"
        SELECT true AS "credential!", c.key_id AS "subject!", c.max_concurrent_uses AS "limit_now"
        FROM credentials c WHERE c.key_id = ANY ($1)
        UNION ALL
        SELECT false, t.tenant_id, t.max_concurrent_leases
        FROM tenants t WHERE t.tenant_id = ANY ($2)
        "#,
        &subjects("oversell"),
        &subjects("tenant_cap"),
    )
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|l| ((l.credential, l.subject), l.limit_now))
    .collect();
    let limit_now = |credential: bool, subject: &str| {
        limits
            .get(&(credential, subject.to_owned()))
            .copied()
            .flatten()
    };
    let mut found = Findings::default();
    for r in rows {
        let window = |subject| WindowRow {
            subject,
            kind: r.kind.clone(),
            seconds: r.seconds,
            window_count: r.window_count.unwrap_or_default(),
            grants: r.grants,
            peak: r.peak,
            grants_over_window: r.violations,
            first_violation_at: r.first_violation_at,
        };
        match r.proof.as_str() {
            "oversell" => found.credentials.push(OversellRow {
                max_concurrent_uses: limit_now(true, &r.subject),
                key_id: r.subject.clone(),
                leases: r.grants,
                peak: r.peak,
                grants_over_limit: r.violations,
                first_violation_at: r.first_violation_at,
            }),
            "windows" => found
                .windows
                .push(window(WindowSubject::KeyId(r.subject.clone()))),
            "tenant_cap" => found.tenants.push(TenantCapRow {
                max_concurrent_leases: limit_now(false, &r.subject),
                tenant_id: r.subject.clone(),
                leases: r.grants,
                peak: r.peak,
                grants_over_cap: r.violations,
                first_violation_at: r.first_violation_at,
            }),
            _ => found
                .tenant_windows
                .push(window(WindowSubject::TenantId(r.subject.clone()))),
        }
    }
    Ok(found)
}

/// The oldest trail row's time (`None`: the trail is empty): where `credpool audit verify
/// --full` starts.
pub async fn oldest_trail_row(
    executor: impl PgExecutor<'_>,
) -> Result<Option<OffsetDateTime>, sqlx::Error> {
    sqlx::query_scalar!(r#"SELECT min(at) FROM lease_events"#)
        .fetch_one(executor)
        .await
}
