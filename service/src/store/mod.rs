//! The storage layer: every SQL statement of credpool lives here. Functions take
//! `impl PgExecutor<'_>` so they compose inside one transaction; each state change is one
//! statement or one transaction, never half-written.
//!
//! Errors are [`sqlx::Error`]; the HTTP layer maps them to 503 `store_unavailable` and logs them
//! once, without SQL text reaching a client.

/// A credential's [`crate::domain::health::Health`] from a row of a query that selects the health columns
/// under their own names (`status`, `status_reason`, `cooldown_until`, `health_successes`,
/// `health_failures`, `health_rate_limits`, `health_decayed_at`, `recent_failures`,
/// `cooldowns_in_a_row`, `last_success_at`, `recovered_at`). Moves those fields out of the row;
/// evaluates to `Result<Health, sqlx::Error>` (an unknown status is a decode error).
macro_rules! health_of_row {
    ($row:expr) => {
        $crate::store::leases::decoded($crate::domain::Status::parse(&$row.status)).map(|status| {
            $crate::domain::health::Health {
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
pub mod citus;
mod connection;
pub mod credentials;
pub mod dashboard;
pub mod failover;
pub mod leases;
pub mod maintenance;
pub mod oauth;
pub mod relay;
pub mod schema;
pub mod target;
pub mod tenants;

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

pub use connection::{Conn, Db, Work};
pub use schema::{
    MIGRATOR, apply_sql_files, latest_migration, migrate, migrations_up_to_date,
    versioned_up_to_date,
};
pub use target::Target;

/// How the service's connection pool behaves.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    /// Most connections open at once.
    pub max_connections: u32,
    /// How long a request waits for a connection (or for a new one to be established) before it
    /// gives up with 503 `store_unavailable`.
    pub acquire_timeout: Duration,
}

/// Opens a connection pool on one server. Connections are made lazily, so a database that is
/// down at start-up makes requests fail with 503 rather than the process fail to start; callers
/// that need the database now (migrations) find out on first use. For a URL that may name
/// several servers, [`Db::connect_lazy`] on a [`Target`].
pub fn connect_lazy(options: PgConnectOptions, settings: &PoolSettings) -> PgPool {
    PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        .connect_lazy_with(options)
}

/// Whether the database answers, has every migration of this binary applied, and its SQL
/// functions are this binary's (or a newer one's). This is the one store check behind `/readyz`:
/// anything else the store must have before this binary may serve belongs here.
pub async fn ready(db: &Db) -> Result<bool, sqlx::Error> {
    let mut work = db.work().await?;
    let applied = sqlx::query_scalar!(
        r#"SELECT coalesce(max(version), 0) AS "version!" FROM _sqlx_migrations WHERE success"#
    )
    .fetch_one(&mut *work)
    .await?;
    let functions =
        applied >= latest_migration() && schema::sql_files_up_to_date(&mut work).await?;
    work.done().await?;
    Ok(functions)
}

/// Runs `pass` on `db` every `interval` (a late tick runs once, not once per tick missed) until
/// `db`'s pool is closed: the service's timers (the metrics sampler, the in-process maintenance
/// scheduler).
pub async fn every<F, Fut>(db: &Db, interval: std::time::Duration, mut pass: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        if db.pool().is_closed() {
            return;
        }
        pass().await;
    }
}
