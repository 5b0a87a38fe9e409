//! Command line and configuration: every setting is a flag and an environment variable (clap
//! with `env`); `credpool --help` and README list them with defaults and units.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::store::PoolSettings;

/// credpool: leases upstream credentials to executors under per-credential concurrency limits.
#[derive(Debug, Parser)]
#[command(name = "credpool", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the HTTP service (applies migrations first).
    Serve(ServeArgs),
    /// Apply pending database migrations and exit.
    Migrate(DatabaseArgs),
    /// Run the service in-process and drive a simulated executor fleet against it, then print a
    /// summary (exits non-zero if any credential was ever leased beyond its limit).
    Demo(DemoArgs),
}

/// Where the database is.
#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// PostgreSQL URL (`postgres://user:pass@host:5432/db`). Without it, credpool starts its
    /// embedded default: a private PostgreSQL cluster in --data-dir.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// Data directory of the embedded default database (and its generated API keys).
    /// Default: /var/lib/credpool for root, else ~/.local/share/credpool.
    #[arg(long, env = "CREDPOOL_DATA_DIR")]
    pub data_dir: Option<PathBuf>,

    /// Directory holding PostgreSQL's `initdb` and `postgres`, for the embedded default.
    /// Default: searched on PATH and in the usual install locations.
    #[arg(long, env = "CREDPOOL_PG_BIN_DIR")]
    pub pg_bin_dir: Option<PathBuf>,

    /// Most database connections the service opens.
    #[arg(long, env = "CREDPOOL_DB_MAX_CONNECTIONS", default_value_t = 32,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub db_max_connections: u32,

    /// Milliseconds a request waits for a database connection before answering 503
    /// `store_unavailable`.
    #[arg(long, env = "CREDPOOL_DB_ACQUIRE_TIMEOUT_MS", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub db_acquire_timeout_ms: u64,
}

impl DatabaseArgs {
    /// The connection pool settings these arguments describe.
    pub fn pool_settings(&self) -> PoolSettings {
        PoolSettings {
            max_connections: self.db_max_connections,
            acquire_timeout: Duration::from_millis(self.db_acquire_timeout_ms),
        }
    }
}

/// `credpool serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Database settings.
    #[command(flatten)]
    pub db: DatabaseArgs,

    /// Address to listen on (`host:port`; port 0 picks a free port, printed at start-up).
    #[arg(long, env = "CREDPOOL_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// The key executors send in `X-Internal-Key`. Required with DATABASE_URL; generated and
    /// stored in the data directory with the embedded default.
    #[arg(long, env = "CREDPOOL_INTERNAL_KEY", hide_env_values = true)]
    pub internal_key: Option<String>,

    /// The key operators send in `X-Admin-Key` (must differ from the internal key). Required with
    /// DATABASE_URL; generated and stored in the data directory with the embedded default.
    #[arg(long, env = "CREDPOOL_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,

    /// Service behaviour.
    #[command(flatten)]
    pub service: ServiceArgs,
}

/// Behaviour of the lease API.
#[derive(Debug, Clone, Args)]
pub struct ServiceArgs {
    /// Longest lease (and renewal) an executor may ask for, in seconds.
    #[arg(long, env = "CREDPOOL_MAX_LEASE_SECONDS", default_value_t = 3600,
          value_parser = clap::value_parser!(u32).range(1..=86_400))]
    pub max_lease_seconds: u32,

    /// Amplitude of the random jitter added to a candidate's idle time when ranking, in seconds
    /// (0 = deterministic order).
    #[arg(long, env = "CREDPOOL_RANKING_JITTER_SECONDS", default_value_t = 1.0)]
    pub ranking_jitter_seconds: f64,
}

/// `credpool demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Database settings.
    #[command(flatten)]
    pub db: DatabaseArgs,

    /// Service behaviour.
    #[command(flatten)]
    pub service: ServiceArgs,

    /// How long the fleet runs, in seconds.
    #[arg(long, default_value_t = 20)]
    pub duration_seconds: u64,

    /// Concurrent simulated executors.
    #[arg(long, default_value_t = 64)]
    pub executors: usize,

    /// Lease length the executors ask for, in seconds (some calls run longer and renew).
    #[arg(long, default_value_t = 3)]
    pub lease_seconds: u32,
}
