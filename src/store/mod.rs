//! The storage layer: every SQL statement of credpool lives here. Functions take
//! `impl PgExecutor<'_>` so they compose inside one transaction; each state change is one
//! statement or one transaction, never half-written.
//!
//! Errors are [`sqlx::Error`]; the HTTP layer maps them to 503 `store_unavailable` and logs them
//! once, without SQL text reaching a client.

/// A credential's [`crate::health::Health`] from a row of a query that selects the health columns
/// under their own names (`status`, `status_reason`, `cooldown_until`, `health_successes`,
/// `health_failures`, `health_rate_limits`, `health_decayed_at`, `recent_failures`,
/// `cooldowns_in_a_row`, `last_success_at`, `recovered_at`). Moves those fields out of the row;
/// evaluates to `Result<Health, sqlx::Error>` (an unknown status is a decode error).
macro_rules! health_of_row {
    ($row:expr) => {
        $crate::store::leases::decoded($crate::domain::Status::parse(&$row.status)).map(|status| {
            $crate::health::Health {
                status,
                status_reason: $row.status_reason,
                cooldown_until: $row.cooldown_until,
                successes: $row.health_successes,
                failures: $row.health_failures,
                rate_limits: $row.health_rate_limits,
                decayed_at: $row.health_decayed_at,
                recent_failures: $row.recent_failures,
                cooldowns_in_a_row: $row.cooldowns_in_a_row,
                last_success_at: $row.last_success_at,
                recovered_at: $row.recovered_at,
            }
        })
    };
}
pub(crate) use health_of_row;

pub mod audit;
pub mod candidates;
mod connection;
pub mod credentials;
pub mod dashboard;
pub mod leases;
pub mod maintenance;

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool, Row};

pub use connection::{Conn, Db, Work};

/// The migrations in `migrations/`, embedded in the binary. Applied at start-up and by
/// `credpool migrate`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// How the service's connection pool behaves.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    /// Most connections open at once.
    pub max_connections: u32,
    /// How long a request waits for a connection (or for a new one to be established) before it
    /// gives up with 503 `store_unavailable`.
    pub acquire_timeout: Duration,
}

/// Opens a connection pool. Connections are made lazily, so a database that is down at start-up
/// makes requests fail with 503 rather than the process fail to start; callers that need the
/// database now (migrations) find out on first use.
pub fn connect_lazy(options: PgConnectOptions, settings: &PoolSettings) -> PgPool {
    PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        .connect_lazy_with(options)
}

/// Applies every pending migration (forward only). Safe to run from several processes at once:
/// sqlx serialises migrators with a session advisory lock, so `db` must reach PostgreSQL
/// directly, not through a transaction pooler.
pub async fn migrate<'a, A>(db: A) -> Result<(), sqlx::migrate::MigrateError>
where
    A: sqlx::Acquire<'a, Database = sqlx::Postgres>,
    <A::Connection as std::ops::Deref>::Target: sqlx::migrate::Migrate,
{
    MIGRATOR.run(db).await
}

/// Whether the database has every migration of this binary applied, each with the checksum
/// of the binary's copy, and no failed one: then there is nothing for the migrator to do, and
/// start-up skips it (and the session advisory lock it takes, which a transaction pooler would
/// break). A database without the migrations table is not up to date. One simple-protocol
/// statement, safe through a transaction pooler.
pub async fn migrations_up_to_date(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    let rows = match sqlx::raw_sql("SELECT version, checksum, success FROM _sqlx_migrations")
        .fetch_all(conn)
        .await
    {
        Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("42P01") => {
            return Ok(false);
        }
        rows => rows?,
    };
    let mut applied = std::collections::HashMap::new();
    for row in rows {
        if !row.try_get::<bool, _>("success")? {
            return Ok(false);
        }
        applied.insert(
            row.try_get::<i64, _>("version")?,
            row.try_get::<Vec<u8>, _>("checksum")?,
        );
    }
    Ok(MIGRATOR
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .all(|m| applied.get(&m.version).map(Vec::as_slice) == Some(&*m.checksum)))
}

/// The newest migration this binary knows; `/readyz` is ready only once the database has it.
pub fn latest_migration() -> i64 {
    MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0)
}

/// Whether the database answers and has every migration of this binary applied.
pub async fn ready(db: &Db) -> Result<bool, sqlx::Error> {
    let mut work = db.work().await?;
    let applied = sqlx::query_scalar!(
        r#"SELECT coalesce(max(version), 0) AS "version!" FROM _sqlx_migrations WHERE success"#
    )
    .fetch_one(&mut *work)
    .await?;
    work.done().await?;
    Ok(applied >= latest_migration())
}
