//! The operator commands (`keys`, `leases`, `pools`, `audit`, `cron`, `maintenance`, `env`),
//! which `operator.rs` runs straight against the database.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use credpool::config::{DatabaseArgs, SecretArgs};

/// `credpool audit ...`.
#[derive(Debug, Clone, Args)]
pub struct AuditArgs {
    /// Shared settings.
    #[command(flatten)]
    pub cli: CliArgs,

    /// What to ask; without one, `verify` with its defaults (the continuous proof).
    #[command(subcommand)]
    pub command: Option<AuditCommand>,
}

/// The `credpool audit` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum AuditCommand {
    /// The proofs, from the trail alone: each credential's most simultaneous leases next to its
    /// limit, each tenant's next to its cap, and every credential's and tenant's rate windows;
    /// exits non-zero if any grant ever exceeded a limit, a cap or a window. Without a range,
    /// advances the continuous proof (which the maintenance pass keeps advancing) to the end of
    /// the trail and reports everything it has found; with one, proves that range. Either way
    /// in chunks, each committed as it goes: an interrupted run resumes where it stopped.
    /// `credpool audit` alone runs this with its defaults.
    Verify(VerifyArgs),
}

/// `credpool audit verify`'s settings.
#[derive(Debug, Clone, Args)]
pub struct VerifyArgs {
    /// Start of a range to prove, RFC 3339 (default with --until: 24 hours before it).
    #[arg(long)]
    pub since: Option<String>,
    /// End of a range to prove, RFC 3339 (default with --since: the end of the trail).
    #[arg(long)]
    pub until: Option<String>,
    /// Prove the whole trail again, from its oldest row, instead of the continuous proof.
    #[arg(long, conflicts_with = "since")]
    pub full: bool,
    /// Trail rows per chunk: each chunk is one statement and one commit.
    #[arg(long, env = "CREDPOOL_AUDIT_CHUNK_ROWS", default_value_t = 200_000,
          value_parser = clap::value_parser!(u32).range(1..=100_000_000))]
    pub chunk_rows: u32,
}

impl VerifyArgs {
    /// The settings of `credpool audit verify` given no flag: what `credpool audit` alone runs
    /// (the defaults, and `CREDPOOL_AUDIT_CHUNK_ROWS` when it is set).
    pub fn defaults() -> Result<Self, clap::Error> {
        /// `verify` on its own, to read its defaults the way clap reads them.
        #[derive(clap::Parser)]
        struct Verify {
            #[command(flatten)]
            args: VerifyArgs,
        }
        <Verify as clap::Parser>::try_parse_from(["verify"]).map(|v| v.args)
    }
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

/// `credpool citus ...`.
#[derive(Debug, Clone, Args)]
pub struct CitusArgs {
    /// Shared settings.
    #[command(flatten)]
    pub cli: CliArgs,

    /// What to do.
    #[command(subcommand)]
    pub command: CitusCommand,
}

/// The `credpool citus` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum CitusCommand {
    /// Distribute the database (a migrated credpool database on a Citus coordinator, empty or
    /// not) by provider: the lease tables co-located by provider, the tenant tables as
    /// reference tables (docs/src/citus.md). Idempotent; refuses, changing nothing, where the
    /// database has no Citus extension.
    Distribute {
        /// Shards per distributed table (Citus's `citus.shard_count` when absent). Providers
        /// hash to shards: more shards than providers buys nothing.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
        shard_count: Option<u32>,
    },
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

/// `credpool env`.
#[derive(Debug, Clone, Args)]
pub struct EnvArgs {
    /// Data directory of the embedded default, where `credpool serve` keeps the keys it
    /// generated. Default: /var/lib/credpool for root, else ~/.local/share/credpool.
    #[arg(long, env = "CREDPOOL_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
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

    /// Milliseconds a statement of an operator command may run before PostgreSQL cancels it; 0
    /// leaves the server's setting. Operator commands do not take the service's
    /// --db-statement-timeout-ms (CREDPOOL_DB_STATEMENT_TIMEOUT_MS, meant for requests): a proof
    /// chunk or an import may need longer.
    #[arg(long, env = "CREDPOOL_OPERATOR_STATEMENT_TIMEOUT_MS", global = true,
          default_value_t = 3_600_000, value_parser = clap::value_parser!(u64).range(0..=86_400_000))]
    pub statement_timeout_ms: u64,
}

impl CliArgs {
    /// The database settings of an operator command: the shared ones with its own statement
    /// timeout (`--statement-timeout-ms`) in place of the request path's.
    pub fn database(&self) -> DatabaseArgs {
        DatabaseArgs {
            db_statement_timeout_ms: self.statement_timeout_ms,
            ..self.db.clone()
        }
    }
}

/// `credpool keys ...`.
#[derive(Debug, Clone, Args)]
pub struct KeysArgs {
    /// Shared settings.
    #[command(flatten)]
    pub cli: CliArgs,

    /// What to do; without one, `list` every credential.
    #[command(subcommand)]
    pub command: Option<KeysCommand>,
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
    /// List credentials (`credpool keys` alone lists them all).
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
    /// Set a credential's rate windows: WINDOWS is a JSON list like
    /// '[{"requests": 500, "seconds": 60}, {"tokens": 30000, "seconds": 60}]' (`[]` removes them).
    /// A window kept (same kind and length) keeps what it has counted.
    RateLimits {
        /// The credential.
        key_id: String,
        /// The windows, as JSON.
        windows: String,
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

    /// What to do; without one, `list` the leases held now.
    #[command(subcommand)]
    pub command: Option<LeasesCommand>,
}

/// The `credpool leases` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum LeasesCommand {
    /// List the leases held now (unexpired), oldest grant first: at most the first
    /// 200, with the count of every lease held.
    List,
    /// Force-release every in-flight lease of a credential.
    ReleaseAll {
        /// The credential.
        key_id: String,
        /// Why (recorded with each released lease).
        #[arg(long)]
        reason: String,
    },
}

/// `credpool relay`: where each provider's relay calls go (`/relay/{provider}/{pool}/...`).
#[derive(Debug, Clone, Args)]
pub struct RelayArgs {
    #[command(flatten)]
    pub cli: CliArgs,

    /// What to do; without one, `list` the upstreams.
    #[command(subcommand)]
    pub command: Option<RelayCommand>,
}

/// The `credpool relay` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum RelayCommand {
    /// List every provider's upstream.
    List,
    /// Set where a provider's relay calls go (created or replaced); the same checks and defaults
    /// as `PUT /api/admin/relay/upstreams/{provider}`.
    Set {
        /// The provider whose calls go there.
        provider: String,
        /// `https://...`, or `http://` on a loopback address.
        #[arg(long)]
        base_url: String,
        /// The API the upstream speaks: the shape of credpool's own refusals and the default
        /// credential header.
        #[arg(long, value_parser = ["openai", "anthropic"])]
        api: String,
        /// The header the leased credential goes in (default: `authorization` for openai,
        /// `x-api-key` for anthropic).
        #[arg(long)]
        credential_header: Option<String>,
        /// How long a call waits for a free credential, in milliseconds (default 10000).
        #[arg(long)]
        wait_ms: Option<u64>,
        /// A request header whose value is the call's affinity key (e.g. `x-session-id`).
        #[arg(long)]
        affinity_header: Option<String>,
        /// The longest the upstream may take to start its answer, and between two chunks of it,
        /// in seconds (default 600).
        #[arg(long)]
        timeout_seconds: Option<u64>,
    },
    /// Remove a provider's upstream: its relay calls are refused from then on.
    Remove {
        /// The provider.
        provider: String,
    },
}
