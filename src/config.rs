//! Command line and configuration: every setting is a flag and an environment variable (clap
//! with `env`); `credpool --help` and README list them with defaults and units.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::allocation::ClaimSettings;
use crate::groups::GroupSettings;
use crate::health::HealthPolicy;
use crate::scoring::ScoringPolicy;
use crate::store::PoolSettings;

/// credpool: leases upstream credentials to executors under per-credential concurrency limits.
#[derive(Debug, Parser)]
#[command(name = "credpool", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,

    /// Log lines for people (`human`, coloured on a terminal) or one JSON object per line
    /// (`json`). Filter with RUST_LOG.
    #[arg(long, global = true, env = "CREDPOOL_LOG_FORMAT", value_enum, default_value_t = LogFormat::Human)]
    pub log_format: LogFormat,
}

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Readable text.
    Human,
    /// One JSON object per line, with the span fields (request id, route, ...).
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the HTTP service (applies pending migrations first, except with `--db-pooler
    /// transaction`).
    Serve(ServeArgs),
    /// Apply pending database migrations and exit.
    Migrate(DatabaseArgs),
    /// Run the service in-process and drive a simulated executor fleet against it, then print a
    /// summary (exits non-zero if any credential was ever leased beyond its limit).
    Demo(DemoArgs),
    /// Manage credentials, straight in the database (DATABASE_URL or the embedded default).
    Keys(KeysArgs),
    /// Force-release leases, straight in the database.
    Leases(LeasesArgs),
    /// Show every (provider, pool): credentials by status, slots, in-flight leases.
    Pools(CliArgs),
    /// Questions answered from the audit trail.
    Audit(AuditArgs),
    /// Schedule the cleanup functions with pg_cron.
    Cron(CronArgs),
    /// Run one cleanup pass now (reap expired leases, record ended cooldowns, purge old audit rows).
    Maintenance(MaintenanceRunArgs),
    /// Measure throughput and latency: simulated executors allocate and release as fast as they
    /// can on a pool of bench credentials (created for the run, removed after), through the
    /// service and optionally through the raw-SQL baseline; exits non-zero on any error or
    /// oversell.
    Bench(BenchArgs),
}

/// How often the cleanup runs and what it keeps.
#[derive(Debug, Clone, Args)]
pub struct MaintenanceArgs {
    /// Seconds between cleanup passes run by the service itself (only where pg_cron does not run
    /// them; with several replicas, one runs each pass).
    #[arg(long, env = "CREDPOOL_MAINTENANCE_INTERVAL_SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub maintenance_interval_seconds: u64,

    /// Days of audit history to keep.
    #[arg(long, env = "CREDPOOL_AUDIT_RETENTION_DAYS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=36_500))]
    pub audit_retention_days: u64,
}

impl MaintenanceArgs {
    /// The retention as a duration.
    pub fn retention(&self) -> Duration {
        Duration::from_secs(self.audit_retention_days * 86_400)
    }
}

/// `credpool audit ...`.
#[derive(Debug, Clone, Args)]
pub struct AuditArgs {
    /// Shared settings.
    #[command(flatten)]
    pub cli: CliArgs,

    /// What to ask.
    #[command(subcommand)]
    pub command: AuditCommand,
}

/// The `credpool audit` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum AuditCommand {
    /// The oversell proof: from the trail alone, each credential's most simultaneous leases over
    /// the range next to its limit; exits non-zero if any grant ever exceeded a limit.
    Verify {
        /// Start of the range, RFC 3339 (default: 24 hours before --until).
        #[arg(long)]
        since: Option<String>,
        /// End of the range, RFC 3339 (default: now).
        #[arg(long)]
        until: Option<String>,
    },
}

/// `credpool cron ...`.
#[derive(Debug, Clone, Args)]
pub struct CronArgs {
    /// Shared settings.
    #[command(flatten)]
    pub cli: CliArgs,

    /// What to do.
    #[command(subcommand)]
    pub command: CronCommand,
}

/// The `credpool cron` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum CronCommand {
    /// Schedule the cleanup in pg_cron (idempotent); services then stop running it themselves.
    Install {
        /// Days of audit history to keep.
        #[arg(long, env = "CREDPOOL_AUDIT_RETENTION_DAYS", default_value_t = 30)]
        audit_retention_days: u64,
    },
    /// Remove credpool's pg_cron jobs; services run the cleanup again.
    Uninstall,
}

/// `credpool maintenance`.
#[derive(Debug, Clone, Args)]
pub struct MaintenanceRunArgs {
    /// Shared settings.
    #[command(flatten)]
    pub cli: CliArgs,

    /// Days of audit history to keep.
    #[arg(long, env = "CREDPOOL_AUDIT_RETENTION_DAYS", default_value_t = 30)]
    pub audit_retention_days: u64,
}

/// What every operator command takes.
#[derive(Debug, Clone, Args)]
pub struct CliArgs {
    /// Database settings.
    #[command(flatten)]
    pub db: DatabaseArgs,

    /// Master keys (for commands that seal or open secrets).
    #[command(flatten)]
    pub secrets: SecretArgs,

    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,

    /// Who you are, for the audit trail (default `cli:<login name>`).
    #[arg(long, env = "CREDPOOL_OPERATOR", global = true)]
    pub operator: Option<String>,
}

/// `credpool keys ...`.
#[derive(Debug, Clone, Args)]
pub struct KeysArgs {
    /// Shared settings.
    #[command(flatten)]
    pub cli: CliArgs,

    /// What to do.
    #[command(subcommand)]
    pub command: KeysCommand,
}

/// The `credpool keys` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum KeysCommand {
    /// Create or update credentials from FILE (a JSON array or JSON lines; `-` for stdin), each
    /// like the PUT body plus its `key_id`. Validated as a whole first; written in one
    /// transaction, or not at all.
    Import {
        /// The file, or `-`.
        file: PathBuf,
    },
    /// List credentials.
    List {
        /// Only this provider.
        #[arg(long)]
        provider: Option<String>,
        /// Only this pool.
        #[arg(long)]
        pool: Option<String>,
        /// Only this status.
        #[arg(long)]
        status: Option<String>,
    },
    /// Take a credential out of traffic (status `disabled`).
    Disable {
        /// The credential.
        key_id: String,
        /// Why.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Put a credential back into traffic (status `available`; clears cooldown and draining).
    Enable {
        /// The credential.
        key_id: String,
    },
    /// No new leases on a credential while its current ones finish.
    Drain {
        /// The credential.
        key_id: String,
        /// Why.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Delete a credential (its in-flight leases are force-released; history stays).
    Rm {
        /// The credential.
        key_id: String,
    },
    /// Reseal every secret under the current master key (after adding a new key and listing the
    /// old one in CREDPOOL_PREVIOUS_MASTER_KEYS).
    Reencrypt,
}

/// `credpool leases ...`.
#[derive(Debug, Clone, Args)]
pub struct LeasesArgs {
    /// Shared settings.
    #[command(flatten)]
    pub cli: CliArgs,

    /// What to do.
    #[command(subcommand)]
    pub command: LeasesCommand,
}

/// The `credpool leases` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum LeasesCommand {
    /// Force-release every in-flight lease of a credential.
    ReleaseAll {
        /// The credential.
        key_id: String,
        /// Why (recorded with each released lease).
        #[arg(long)]
        reason: String,
    },
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

    /// Milliseconds a database statement may run before PostgreSQL cancels it (then 503); 0 leaves
    /// the server's setting. Sent as a connection startup parameter; with `--db-pooler
    /// transaction`, set by each transaction for itself (`SET LOCAL`).
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
    /// (key rotation), on the lines after it.
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

/// `credpool serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Database settings.
    #[command(flatten)]
    pub db: DatabaseArgs,

    /// Master keys.
    #[command(flatten)]
    pub secrets: SecretArgs,

    /// Cleanup schedule.
    #[command(flatten)]
    pub maintenance: MaintenanceArgs,

    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM before the service stops.
    #[arg(long, env = "CREDPOOL_SHUTDOWN_DRAIN_SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub shutdown_drain_seconds: u64,

    /// Seconds between samples of the per-pool gauges (leases in flight, free slots, credentials
    /// by status) from PostgreSQL.
    #[arg(long, env = "CREDPOOL_METRICS_SAMPLE_SECONDS", default_value_t = 15,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub metrics_sample_seconds: u64,

    /// Address to listen on, `host:port` (`localhost:8080`, `0.0.0.0:8080`, `[::1]:8080`); port
    /// 0 picks a free port, printed at start-up.
    #[arg(long, env = "CREDPOOL_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: String,

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
    #[arg(long, env = "CREDPOOL_MAX_LEASE_SECONDS", default_value_t = ServiceSettings::default().max_lease_seconds,
          value_parser = clap::value_parser!(u32).range(1..=86_400))]
    pub max_lease_seconds: u32,

    /// Candidates handed to the first claim statement (the top of the ranking); a request that
    /// misses retries while its view shows untried free candidates, doubling the batch.
    #[arg(long, env = "CREDPOOL_CLAIM_BATCH", default_value_t = ServiceSettings::default().claims.batch as u32,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub claim_batch: u32,

    /// Claims a request makes on candidates its view believes full (in case the view is stale)
    /// before answering 429.
    #[arg(long, env = "CREDPOOL_CLAIM_ATTEMPTS", default_value_t = ServiceSettings::default().claims.attempts as u32,
          value_parser = clap::value_parser!(u32).range(0..=100))]
    pub claim_attempts: u32,

    /// Milliseconds a request may take before it is answered 503 `store_unavailable` (a slow or
    /// unreachable database never hangs a caller longer).
    #[arg(long, env = "CREDPOOL_REQUEST_TIMEOUT_MS", default_value_t = ServiceSettings::default().request_timeout.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub request_timeout_ms: u64,

    /// Longest wait for a slot an allocate may ask for (`wait_ms`), in milliseconds; longer asks
    /// wait this long. 0 turns waiting off.
    #[arg(long, env = "CREDPOOL_MAX_WAIT_MS", default_value_t = ServiceSettings::default().max_wait.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(0..=600_000))]
    pub max_wait_ms: u64,

    /// PostgreSQL URL of the one connection each service process LISTENs on for freed slots
    /// (waiting allocations). Default: a connection like the service's others. With `--db-pooler
    /// transaction` set it to a URL that reaches PostgreSQL directly (a transaction pooler cannot
    /// carry LISTEN); without it, waiting allocations there wake on their timers and this
    /// process's own releases only.
    #[arg(long, env = "CREDPOOL_DB_LISTEN_URL", hide_env_values = true)]
    pub db_listen_url: Option<String>,

    /// Free candidates one ranking considers: a pool with more free credentials is ranked over a
    /// window of this many, starting at a random place, so allocation cost stays flat with pool
    /// size.
    #[arg(long, env = "CREDPOOL_RANK_WINDOW", default_value_t = ServiceSettings::default().claims.rank_window as u32,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub rank_window: u32,

    /// How often each candidate view is re-read from the database, in milliseconds (it is also
    /// re-read whenever a claim reports that its pool changed).
    #[arg(long, env = "CREDPOOL_VIEW_REFRESH_MS", default_value_t = ServiceSettings::default().view_refresh.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    pub view_refresh_ms: u64,

    /// Most claims (or releases, or renewals) run in one transaction with one commit (group
    /// claiming); 1 turns grouping off.
    #[arg(long, env = "CREDPOOL_GROUP_MAX_SIZE", default_value_t = GroupSettings::default().max_size as u32,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub group_max_size: u32,

    /// Microseconds a group waits for more operations once it has its first; 0 sends what is
    /// queued at once (a lone request is never delayed).
    #[arg(long, env = "CREDPOOL_GROUP_WAIT_US", default_value_t = GroupSettings::default().max_wait.as_micros() as u64,
          value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub group_wait_us: u64,

    /// Group transactions of each kind (claims, releases, renewals) in flight at once; each holds
    /// one database connection while it runs.
    #[arg(long, env = "CREDPOOL_GROUP_TRANSACTIONS", default_value_t = GroupSettings::default().transactions as u32,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub group_transactions: u32,

    /// Scoring weights.
    #[command(flatten)]
    pub scoring: ScoringArgs,

    /// How outcome reports change health.
    #[command(flatten)]
    pub health: HealthArgs,
}

impl ServiceArgs {
    /// The settings these flags describe.
    pub fn settings(&self) -> ServiceSettings {
        ServiceSettings {
            max_lease_seconds: self.max_lease_seconds,
            claims: ClaimSettings {
                batch: self.claim_batch as usize,
                attempts: self.claim_attempts as usize,
                rank_window: self.rank_window as usize,
            },
            view_refresh: Duration::from_millis(self.view_refresh_ms),
            groups: GroupSettings {
                max_size: self.group_max_size as usize,
                max_wait: Duration::from_micros(self.group_wait_us),
                transactions: self.group_transactions as usize,
            },
            request_timeout: Duration::from_millis(self.request_timeout_ms),
            max_wait: Duration::from_millis(self.max_wait_ms),
            listen_url: self.db_listen_url.clone(),
            scoring: self.scoring.policy(),
            health: self.health.policy(),
        }
    }
}

/// How the lease API behaves: the parsed form of [`ServiceArgs`]. The defaults of every flag come
/// from here and from the policies' defaults.
#[derive(Debug, Clone)]
pub struct ServiceSettings {
    /// Longest lease (and renewal) an executor may ask for, in seconds.
    pub max_lease_seconds: u32,
    /// Candidates per claim statement, and claims per pool and request.
    pub claims: ClaimSettings,
    /// How often candidate views are re-read.
    pub view_refresh: Duration,
    /// How claims, releases and renewals are grouped into transactions.
    pub groups: GroupSettings,
    /// The longest a request may take before it is answered 503.
    pub request_timeout: Duration,
    /// The longest an allocate may wait for a slot.
    pub max_wait: Duration,
    /// Where waiting allocations LISTEN (`None`: a connection like the service's others).
    pub listen_url: Option<String>,
    /// Scoring weights.
    pub scoring: ScoringPolicy,
    /// How outcome reports change health.
    pub health: HealthPolicy,
}

impl Default for ServiceSettings {
    /// Leases up to 3600 s; 8 candidates in the first claim; views re-read every 5 s; the
    /// grouping defaults; requests
    /// answered within 10 s; waits of up to 30 s; the policies' defaults.
    fn default() -> Self {
        Self {
            max_lease_seconds: 3600,
            claims: ClaimSettings::default(),
            view_refresh: Duration::from_secs(5),
            groups: GroupSettings::default(),
            request_timeout: Duration::from_secs(10),
            max_wait: Duration::from_secs(30),
            listen_url: None,
            scoring: ScoringPolicy::default(),
            health: HealthPolicy::default(),
        }
    }
}

fn non_negative(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("`{value}` is not a finite number >= 0")),
    }
}

fn positive(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("`{value}` is not a finite number > 0")),
    }
}

/// The weights of the score (see `docs/selection.md`). Defaults: [`ScoringPolicy::default`].
#[derive(Debug, Clone, Args)]
pub struct ScoringArgs {
    /// Weight of the free share of a credential's slots.
    #[arg(long, env = "CREDPOOL_SCORE_CAPACITY_WEIGHT", default_value_t = ScoringPolicy::default().capacity_weight, value_parser = non_negative)]
    pub score_capacity_weight: f64,
    /// Weight of idle time (since the last lease, capped).
    #[arg(long, env = "CREDPOOL_SCORE_IDLE_WEIGHT", default_value_t = ScoringPolicy::default().idle_weight, value_parser = non_negative)]
    pub score_idle_weight: f64,
    /// Weight of the decayed success rate.
    #[arg(long, env = "CREDPOOL_SCORE_SUCCESS_WEIGHT", default_value_t = ScoringPolicy::default().success_weight, value_parser = non_negative)]
    pub score_success_weight: f64,
    /// Weight of recent failures.
    #[arg(long, env = "CREDPOOL_SCORE_ERROR_WEIGHT", default_value_t = ScoringPolicy::default().error_weight, value_parser = non_negative)]
    pub score_error_weight: f64,
    /// Weight of recent rate limits.
    #[arg(long, env = "CREDPOOL_SCORE_RATE_LIMIT_WEIGHT", default_value_t = ScoringPolicy::default().rate_limit_weight, value_parser = non_negative)]
    pub score_rate_limit_weight: f64,
    /// Weight of a recent recovery from cooldown.
    #[arg(long, env = "CREDPOOL_SCORE_COOLDOWN_WEIGHT", default_value_t = ScoringPolicy::default().cooldown_weight, value_parser = non_negative)]
    pub score_cooldown_weight: f64,
    /// Flat penalty when a credential's last success is missing or older than the freshness age.
    #[arg(long, env = "CREDPOOL_SCORE_FRESHNESS_PENALTY", default_value_t = ScoringPolicy::default().freshness_penalty, value_parser = non_negative)]
    pub score_freshness_penalty: f64,
    /// Jitter amplitude, relative to the score range (0 = deterministic order).
    #[arg(long, env = "CREDPOOL_SCORE_JITTER", default_value_t = ScoringPolicy::default().jitter, value_parser = non_negative)]
    pub score_jitter: f64,
    /// Idle time at which idle counts in full, in seconds.
    #[arg(long, env = "CREDPOOL_SCORE_IDLE_CAP_SECONDS", default_value_t = ScoringPolicy::default().idle_cap_seconds, value_parser = positive)]
    pub score_idle_cap_seconds: f64,
    /// Age beyond which a last success is no longer fresh, in seconds.
    #[arg(long, env = "CREDPOOL_SCORE_FRESHNESS_MAX_AGE_SECONDS", default_value_t = ScoringPolicy::default().freshness_max_age_seconds, value_parser = positive)]
    pub score_freshness_max_age_seconds: f64,
    /// Seconds over which the penalty of a recent recovery fades.
    #[arg(long, env = "CREDPOOL_SCORE_COOLDOWN_PENALTY_SECONDS", default_value_t = ScoringPolicy::default().cooldown_penalty_seconds, value_parser = positive)]
    pub score_cooldown_penalty_seconds: f64,
}

impl ScoringArgs {
    /// The policy these flags describe.
    pub fn policy(&self) -> ScoringPolicy {
        ScoringPolicy {
            capacity_weight: self.score_capacity_weight,
            idle_weight: self.score_idle_weight,
            success_weight: self.score_success_weight,
            error_weight: self.score_error_weight,
            rate_limit_weight: self.score_rate_limit_weight,
            cooldown_weight: self.score_cooldown_weight,
            freshness_penalty: self.score_freshness_penalty,
            jitter: self.score_jitter,
            idle_cap_seconds: self.score_idle_cap_seconds,
            freshness_max_age_seconds: self.score_freshness_max_age_seconds,
            cooldown_penalty_seconds: self.score_cooldown_penalty_seconds,
            ..ScoringPolicy::default()
        }
    }
}

/// How outcome reports change health (see `docs/selection.md`). Defaults:
/// [`HealthPolicy::default`].
#[derive(Debug, Clone, Args)]
pub struct HealthArgs {
    /// Half-life of the outcome counters, in seconds.
    #[arg(long, env = "CREDPOOL_HEALTH_HALF_LIFE_SECONDS", default_value_t = HealthPolicy::default().half_life_seconds, value_parser = positive)]
    pub health_half_life_seconds: f64,
    /// Failures within the failure window that put a credential in cooldown.
    #[arg(long, env = "CREDPOOL_HEALTH_FAILURE_THRESHOLD", default_value_t = HealthPolicy::default().failure_threshold,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub health_failure_threshold: u32,
    /// The failure window, in seconds.
    #[arg(long, env = "CREDPOOL_HEALTH_FAILURE_WINDOW_SECONDS", default_value_t = HealthPolicy::default().failure_window_seconds, value_parser = positive)]
    pub health_failure_window_seconds: f64,
    /// The first cooldown, in seconds; doubles with each cooldown before a recovery.
    #[arg(long, env = "CREDPOOL_HEALTH_COOLDOWN_SECONDS", default_value_t = HealthPolicy::default().cooldown_seconds, value_parser = positive)]
    pub health_cooldown_seconds: f64,
    /// The longest cooldown, in seconds.
    #[arg(long, env = "CREDPOOL_HEALTH_MAX_COOLDOWN_SECONDS", default_value_t = HealthPolicy::default().max_cooldown_seconds, value_parser = positive)]
    pub health_max_cooldown_seconds: f64,
    /// Rest after a `rate_limited` report without retry_after_seconds, in seconds.
    #[arg(long, env = "CREDPOOL_HEALTH_RATE_LIMIT_SECONDS", default_value_t = HealthPolicy::default().rate_limit_seconds, value_parser = positive)]
    pub health_rate_limit_seconds: f64,
}

impl HealthArgs {
    /// The policy these flags describe.
    pub fn policy(&self) -> HealthPolicy {
        HealthPolicy {
            half_life_seconds: self.health_half_life_seconds,
            failure_threshold: self.health_failure_threshold,
            failure_window_seconds: self.health_failure_window_seconds,
            cooldown_seconds: self.health_cooldown_seconds,
            max_cooldown_seconds: self.health_max_cooldown_seconds,
            rate_limit_seconds: self.health_rate_limit_seconds,
        }
    }
}

/// `credpool demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Database settings.
    #[command(flatten)]
    pub db: DatabaseArgs,

    /// Master keys.
    #[command(flatten)]
    pub secrets: SecretArgs,

    /// Service behaviour.
    #[command(flatten)]
    pub service: ServiceArgs,

    /// How long executors start new calls, in seconds (calls in flight then finish, and the
    /// summary waits one lease length for crashed executors' leases to expire).
    #[arg(long, env = "CREDPOOL_DEMO_DURATION_SECONDS", default_value_t = 20)]
    pub duration_seconds: u64,

    /// Concurrent simulated executors.
    #[arg(long, env = "CREDPOOL_DEMO_EXECUTORS", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub executors: u32,

    /// Lease length the executors ask for, in seconds (some calls run longer and renew).
    #[arg(long, env = "CREDPOOL_DEMO_LEASE_SECONDS", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub lease_seconds: u32,
}

/// The baseline `credpool bench` can measure next to the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchBaseline {
    /// The per-request claim and release statements straight on the database, one connection
    /// per executor, no HTTP and no grouping.
    Sql,
}

/// `credpool bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Database settings (the bench credentials, the baseline and the oversell check use it; the
    /// in-process service runs on it).
    #[command(flatten)]
    pub db: DatabaseArgs,

    /// Master keys (the bench credentials are sealed like any other; with --url, give the
    /// service's).
    #[command(flatten)]
    pub secrets: SecretArgs,

    /// Behaviour of the in-process service.
    #[command(flatten)]
    pub service: ServiceArgs,

    /// Drive a running credpool at this base URL (`http://host:port`) instead of one started
    /// in-process; it must use the same database.
    #[arg(long, env = "CREDPOOL_BENCH_URL")]
    pub url: Option<String>,

    /// The executor API key of the service at --url.
    #[arg(long, env = "CREDPOOL_INTERNAL_KEY", hide_env_values = true)]
    pub internal_key: Option<String>,

    /// Also measure this baseline first, on the same credentials in the same run.
    #[arg(long, env = "CREDPOOL_BENCH_BASELINE", value_enum)]
    pub baseline: Option<BenchBaseline>,

    /// Concurrent simulated executors.
    #[arg(long, env = "CREDPOOL_BENCH_EXECUTORS", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub executors: u32,

    /// Seconds measured, per mode.
    #[arg(long, env = "CREDPOOL_BENCH_DURATION_SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub duration_seconds: u64,

    /// Seconds of unmeasured warm-up before each mode.
    #[arg(long, env = "CREDPOOL_BENCH_WARMUP_SECONDS", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(0..=3_600))]
    pub warmup_seconds: u64,

    /// Milliseconds each executor holds a lease before releasing it.
    #[arg(long, env = "CREDPOOL_BENCH_HOLD_MS", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    pub hold_ms: u64,

    /// Credentials in the bench pool.
    #[arg(long, env = "CREDPOOL_BENCH_CREDENTIALS", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub credentials: u32,

    /// max_concurrent_uses of each bench credential.
    #[arg(long, env = "CREDPOOL_BENCH_LIMIT", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub limit: u32,

    /// Hot-spot mode: every executor wants the same N credentials (the rest of the pool serves
    /// another model). 0: every credential serves every executor.
    #[arg(long, env = "CREDPOOL_BENCH_HOT_SPOT", default_value_t = 0)]
    pub hot_spot: u32,

    /// Lease length the executors ask for, in seconds.
    #[arg(long, env = "CREDPOOL_BENCH_LEASE_SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u32).range(1..=86_400))]
    pub lease_seconds: u32,

    /// Historical trail rows to add first (leases on the bench credentials over the last 29
    /// days; they stay in the trail), to measure against a large audit trail.
    #[arg(long, env = "CREDPOOL_BENCH_AUDIT_ROWS", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=1_000_000_000))]
    pub audit_rows: u64,

    /// Every allocate carries a fresh `request_id`, as the client crate's do (idempotent
    /// allocation: one advisory lock and one lookup per claim).
    #[arg(long, env = "CREDPOOL_BENCH_REQUEST_IDS")]
    pub request_ids: bool,
}
