//! What several commands share: where the database is (and how to reach it) and the master
//! keys that seal and open secrets.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::load_secret_file;
use crate::store::PoolSettings;

/// Where the database is.
#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// PostgreSQL URL (`postgres://user:pass@host:5432/db`), or several hosts of which credpool
    /// uses the writable one (`postgres://user@db1:5432,db2:5432/db`, libpq's form;
    /// docs/src/high-availability.md). Without it, credpool starts its embedded default: a
    /// private PostgreSQL cluster in --data-dir.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// A file holding the PostgreSQL URL (a mounted secret, so that the password is in no
    /// environment variable), instead of --database-url: one line (a trailing newline is
    /// dropped), readable by its owner (and group) only (credpool refuses a file that other users may
    /// read or write, or its group may write).
    #[arg(long, env = "DATABASE_URL_FILE", conflicts_with = "database_url")]
    pub database_url_file: Option<PathBuf>,

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

    /// Milliseconds a database statement of the service may run before PostgreSQL cancels it
    /// (then 503); 0 leaves the server's setting. Sent as a connection startup parameter; with
    /// `--db-pooler transaction`, set by each transaction for itself (`SET LOCAL`). The operator
    /// commands (`credpool audit`, `keys`, ...) take their own `--statement-timeout-ms` instead.
    #[arg(long, env = "CREDPOOL_DB_STATEMENT_TIMEOUT_MS", default_value_t = 5000,
          value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    pub db_statement_timeout_ms: u64,

    /// Milliseconds a request waits for a database connection before answering 503
    /// `store_unavailable`.
    #[arg(long, env = "CREDPOOL_DB_ACQUIRE_TIMEOUT_MS", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub db_acquire_timeout_ms: u64,

    /// What stands between credpool and PostgreSQL: `none` (DATABASE_URL is the server itself)
    /// or `transaction` (DATABASE_URL is a pooler in transaction pooling mode, such as PgBouncer
    /// with `pool_mode = transaction` and `server_reset_query_always = 1`). With `transaction`,
    /// every statement runs inside an explicit transaction, committed before the reply, that
    /// sets the statement timeout for itself; connections keep no prepared statements; and
    /// start-up applies no migrations (it refuses to start while any is pending: run `credpool
    /// migrate` with a DATABASE_URL that reaches PostgreSQL directly).
    #[arg(long, env = "CREDPOOL_DB_POOLER", value_enum, default_value_t = DbPooler::None)]
    pub db_pooler: DbPooler,
}

impl DatabaseArgs {
    /// Reads `--database-url-file` into `database_url`.
    pub fn load_secret_files(&mut self) -> anyhow::Result<()> {
        load_secret_file(
            &mut self.database_url,
            &self.database_url_file,
            "DATABASE_URL_FILE",
        )
    }
}

/// What stands between credpool and PostgreSQL (`--db-pooler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DbPooler {
    /// Nothing: connections reach PostgreSQL itself (or a pooler in session mode).
    #[default]
    None,
    /// A pooler in transaction pooling mode: a server connection is lent per transaction, so no
    /// state may outlive a transaction.
    Transaction,
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

/// Where the master keys that seal credential secrets come from.
#[derive(Debug, Clone, Args)]
pub struct SecretArgs {
    /// The master key that seals credential secrets: 32 bytes as 64 hexadecimal digits or base64.
    /// Required with DATABASE_URL (or --master-key-file); the embedded default generates one in
    /// its data directory (`master.key`, mode 0600).
    #[arg(long, env = "CREDPOOL_MASTER_KEY", hide_env_values = true)]
    pub master_key: Option<String>,

    /// A file with the master key on its first line and older keys, still accepted for opening
    /// (key rotation), on the lines after it; readable by its owner (and group) only.
    #[arg(long, env = "CREDPOOL_MASTER_KEY_FILE", conflicts_with = "master_key")]
    pub master_key_file: Option<PathBuf>,

    /// Older master keys, comma-separated: secrets sealed under them still open until
    /// `credpool keys reencrypt` reseals them under the current key.
    #[arg(long, env = "CREDPOOL_PREVIOUS_MASTER_KEYS", hide_env_values = true)]
    pub previous_master_keys: Option<String>,
}

impl SecretArgs {
    /// Whether a master key is configured (by value or file).
    pub fn configured(&self) -> bool {
        self.master_key.is_some() || self.master_key_file.is_some()
    }
}
