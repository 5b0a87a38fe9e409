//! Scheduling the cleanup pass of `sql/maintenance.sql` (`credpool_maintenance`, its steps in
//! `credpool_maintenance_step`, in this order: reap expired leases, refit credentials back under a
//! lowered limit, record ended cooldowns, purge old audit rows, purge old request ids, fold the
//! pool versions of exited backends, refit tenants over a lowered cap, purge expired (and, over
//! their cap, the least recently hit) affinity bindings, make the trail's days a week ahead,
//! advance the continuous proof of the audit trail, drop the trail's days past retention): with
//! pg_cron when it is installed (`credpool cron install`), else by each service process, one
//! replica per tick.

use std::time::Duration;

use serde::Serialize;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};

use super::Db;

/// What one maintenance pass did: one field per step of `credpool_maintenance_step`, in its
/// order (a step skipped because another session ran it counts 0).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct MaintenanceReport {
    /// Expired leases ended in the trail and freed (`credpool_reap_expired_leases`).
    pub expired_leases_reaped: i64,
    /// Credentials over a lowered limit fitted again (`credpool_refit_over_limit`).
    pub credentials_refitted: i64,
    /// Ended cooldowns recorded (`credpool_recover_cooldowns`).
    pub cooldowns_recorded: i64,
    /// Audit rows past retention deleted (`credpool_purge_audit`).
    pub audit_rows_purged: i64,
    /// Request ids of ended leases deleted (`credpool_purge_requests`).
    pub request_ids_purged: i64,
    /// Pool version rows of exited backends folded (`credpool_compact_pool_versions`).
    pub pool_versions_folded: i64,
    /// Tenants over a lowered cap fitted again (`credpool_refit_tenants`).
    pub tenants_refitted: i64,
    /// Affinity bindings deleted: expired, or the least recently hit beyond the cap
    /// (`credpool_purge_affinity`).
    pub affinity_bindings_purged: i64,
    /// Days of the lease trail made ahead, today and the next 7 (`credpool_make_trail_days`).
    pub trail_days_made: i64,
    /// Trail rows the continuous proof covered in this pass, over its chunks
    /// (`credpool_audit_advance`, docs/audit.md).
    pub audit_rows_proven: i64,
    /// Days of the lease trail dropped whole, retention having passed them
    /// (`credpool_drop_trail_days`).
    pub trail_days_dropped: i64,
}

/// How long one pass may repeat a step that has more to do (the continuous proof, one bounded
/// chunk per call), counted from the pass's start; the same bound as `credpool_maintenance`'s
/// `p_seconds` (sql/maintenance.sql), which pg_cron runs.
pub const PASS_SECONDS: Duration = Duration::from_secs(30);

/// Why a pass did not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Skipped {
    /// pg_cron runs the functions for this database.
    PgCron,
    /// Another replica holds the maintenance lock this tick.
    OtherReplica,
}

/// One in-process pass: skipped when pg_cron is scheduled for this database, or when another
/// replica is running the pass's first step right now. `db`: a [`Db`], or a `&PgPool` for a
/// direct connection.
pub async fn run_pass(
    db: impl Into<Db>,
    retention: Duration,
) -> Result<Result<MaintenanceReport, Skipped>, sqlx::Error> {
    let db = db.into();
    let mut work = db.work().await?;
    let cron: bool = sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM maintenance_schedule WHERE scheduler = 'pg_cron') AS "cron!""#
    )
    .fetch_one(&mut *work)
    .await?;
    work.done().await?;
    if cron {
        return Ok(Err(Skipped::PgCron));
    }
    run_steps(&db, retention).await
}

/// One pass of the cleanup steps (`credpool_maintenance_step`), without the pg_cron check of
/// [`run_pass`]. Each step is its own transaction, committed before the next starts, so a long
/// step (an audit purge) never holds the row locks of an earlier one (the slot rows the reaper
/// ended); a step with more to do (the continuous proof) runs again, a transaction each time,
/// while the pass is younger than [`PASS_SECONDS`]. Skipped as a whole when another session runs
/// the first step right now. Steps run without a statement timeout, as under pg_cron: the
/// service's connections carry the request path's (`--db-statement-timeout-ms`, 5 s), and a
/// step is bounded by its own batch (the proof's chunk of 200,000 trail rows takes seconds),
/// not by a request's budget.
pub async fn run_steps(
    db: &Db,
    retention: Duration,
) -> Result<Result<MaintenanceReport, Skipped>, sqlx::Error> {
    let started = std::time::Instant::now();
    let mut report = serde_json::Map::new();
    let mut step = 1;
    loop {
        let mut tx = db.begin().await?;
        sqlx::query("SET LOCAL statement_timeout = 0")
            .execute(&mut *tx)
            .await?;
        let row = sqlx::query!(
            r#"SELECT name, done, more FROM credpool_maintenance_step($1::integer, make_interval(secs => $2))"#,
            step,
            retention.as_secs_f64()
        )
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        let Some(name) = row.name else { break };
        match row.done {
            Some(done) => {
                let before = report.get(&name).and_then(|v| v.as_i64()).unwrap_or(0);
                report.insert(name, (before + i64::from(done)).into());
            }
            None if step == 1 => return Ok(Err(Skipped::OtherReplica)),
            None => {}
        }
        if !(row.more == Some(true) && started.elapsed() < PASS_SECONDS) {
            step += 1;
        }
    }
    serde_json::from_value(serde_json::Value::Object(report))
        .map(Ok)
        .map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

/// The in-process scheduler: a pass every `interval`, logging what it did, until the pool
/// closes. Used only where pg_cron is not scheduled (each pass checks). The service runs it as
/// the supervised background task `maintenance`.
pub async fn scheduler(db: Db, interval: Duration, retention: Duration) {
    super::every(&db, interval, || async {
        match run_pass(&db, retention).await {
            Ok(Ok(report)) if report != MaintenanceReport::default() => {
                crate::telemetry::expired("reaper", report.expired_leases_reaped.max(0) as u64);
                tracing::info!(
                    reaped = report.expired_leases_reaped,
                    credentials_refitted = report.credentials_refitted,
                    cooldowns = report.cooldowns_recorded,
                    purged = report.audit_rows_purged,
                    request_ids = report.request_ids_purged,
                    pool_versions = report.pool_versions_folded,
                    tenants_refitted = report.tenants_refitted,
                    affinity_bindings = report.affinity_bindings_purged,
                    trail_days_made = report.trail_days_made,
                    audit_rows_proven = report.audit_rows_proven,
                    trail_days_dropped = report.trail_days_dropped,
                    "maintenance pass"
                );
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(error = %error, "maintenance pass failed"),
        }
    })
    .await
}

/// The pg_cron jobs credpool schedules: (name suffix, schedule, SQL).
pub fn cron_jobs(retention: Duration) -> Vec<(&'static str, &'static str, String)> {
    vec![(
        "maintenance",
        "* * * * *",
        format!(
            "CALL credpool_maintenance(make_interval(secs => {}))",
            retention.as_secs()
        ),
    )]
}

/// Why pg_cron could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CronError {
    /// The server does not preload pg_cron.
    #[error(
        "pg_cron is not loaded on this server: install it (Debian: postgresql-15-cron), add it to \
         shared_preload_libraries, restart PostgreSQL; or let `credpool serve` run the cleanup itself"
    )]
    NotLoaded,
    /// A database error.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// Where pg_cron lives: its database (`cron.database_name`) and whether that is this one.
async fn cron_database(db: &Db) -> Result<(String, String), CronError> {
    let mut work = db.work().await?;
    let row = sqlx::query!(
        r#"
        SELECT current_database() AS "current!",
               current_setting('cron.database_name', true) AS cron_database
        "#
    )
    .fetch_one(&mut *work)
    .await?;
    work.done().await?;
    match row.cron_database {
        Some(name) if !name.is_empty() => Ok((row.current, name)),
        _ => Err(CronError::NotLoaded),
    }
}

/// Schedules the cleanup with pg_cron, idempotently (named jobs are replaced): creates the
/// extension in pg_cron's database (`cron.database_name`, connecting there with the same
/// credentials when it is not this database), schedules the jobs to run in this database, and
/// records that pg_cron now owns the schedule (so services stop running it themselves).
/// Returns the job names. `db`: a [`Db`], or a `&PgPool` for a direct connection.
pub async fn install_cron(
    db: impl Into<Db>,
    options: &PgConnectOptions,
    retention: Duration,
) -> Result<Vec<String>, CronError> {
    let db = db.into();
    let (current, cron_db) = cron_database(&db).await?;
    // pg_cron's objects exist only where it is installed: these statements are checked at run
    // time, not against the development database.
    // one transaction: the jobs are replaced all at once (and this works through a pooler)
    let mut conn = options.clone().database(&cron_db).connect().await?;
    let mut tx = conn.begin().await?;
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_cron")
        .execute(&mut *tx)
        .await?;
    let mut names = Vec::new();
    for (suffix, schedule, command) in cron_jobs(retention) {
        let name = format!("credpool:{current}:{suffix}");
        sqlx::query("SELECT cron.unschedule(jobid) FROM cron.job WHERE jobname = $1")
            .bind(&name)
            .fetch_all(&mut *tx)
            .await?;
        sqlx::query("SELECT cron.schedule_in_database($1, $2, $3, $4)")
            .bind(&name)
            .bind(schedule)
            .bind(command)
            .bind(&current)
            .fetch_one(&mut *tx)
            .await?;
        names.push(name);
    }
    tx.commit().await?;
    conn.close().await?;
    let mut tx = db.begin().await?;
    sqlx::query!(
        "INSERT INTO maintenance_schedule (scheduler) VALUES ('pg_cron') ON CONFLICT DO NOTHING"
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(names)
}

/// Removes credpool's pg_cron jobs for this database and hands the schedule back to the services.
pub async fn uninstall_cron(db: &Db, options: &PgConnectOptions) -> Result<usize, CronError> {
    let (current, cron_db) = cron_database(db).await?;
    let mut conn = options.clone().database(&cron_db).connect().await?;
    let mut tx = conn.begin().await?;
    let removed = sqlx::query("SELECT cron.unschedule(jobid) FROM cron.job WHERE jobname LIKE $1")
        .bind(format!("credpool:{current}:%"))
        .fetch_all(&mut *tx)
        .await?
        .len();
    tx.commit().await?;
    conn.close().await?;
    let mut tx = db.begin().await?;
    sqlx::query!("DELETE FROM maintenance_schedule WHERE scheduler = 'pg_cron'")
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(removed)
}

/// Whether the server preloads pg_cron.
pub async fn cron_loaded(db: &Db) -> Result<bool, sqlx::Error> {
    match cron_database(db).await {
        Ok(_) => Ok(true),
        Err(CronError::NotLoaded) => Ok(false),
        Err(CronError::Sql(e)) => Err(e),
    }
}
