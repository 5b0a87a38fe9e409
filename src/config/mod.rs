//! Command line and configuration: every setting is a flag and an environment variable (clap
//! with `env`); `credpool --help` and the book's "Configuration" (docs/src/configuration.md) list them with defaults and units.
//!
//! One file per command family: `serve.rs` (the service: listener, limits, scoring, health,
//! cleanup), `operator.rs` (the operator commands: keys, leases, pools, audit, cron,
//! maintenance, env), `demo.rs`, `bench.rs`, and `database.rs` (the database and master-key
//! settings they share). This file holds the command line itself and the `_FILE` settings.

mod bench;
mod demo;
mod operator;

use clap::{Args, Parser, Subcommand};
use credpool::config::{DatabaseArgs, SecretArgs, ServeArgs, ServiceArgs};

pub use bench::{BenchArgs, BenchBaseline, BenchCreateBy};
pub use demo::DemoArgs;
pub use operator::{
    AuditArgs, AuditCommand, CitusArgs, CitusCommand, CliArgs, CronArgs, CronCommand, EnvArgs,
    KeysArgs, KeysCommand, LeasesArgs, LeasesCommand, MaintenanceRunArgs, RelayArgs, RelayCommand,
    VerifyArgs,
};

/// credpool: leases upstream credentials to executors under per-credential concurrency limits.
#[derive(Debug, Parser)]
#[command(name = "credpool", about,
          version = credpool::telemetry::VERSION)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,

    /// Log lines for people (`human`, coloured on a terminal) or one JSON object per line
    /// (`json`). Filter with RUST_LOG.
    #[arg(long, global = true, env = "CREDPOOL_LOG_FORMAT", value_enum, default_value_t = LogFormat::Human)]
    pub log_format: LogFormat,
}

/// What `demo` and `bench` share: the database they work on, the master keys, and the
/// behaviour of the service they run in-process (`bench` runs none with `--url`).
#[derive(Debug, Clone, Args)]
pub struct LocalArgs {
    /// Database settings (the in-process service runs on it; the bench's credentials, baselines
    /// and oversell check use it too).
    #[command(flatten)]
    pub db: DatabaseArgs,

    /// Master keys (the bench credentials are sealed like any other; with `bench --url`, give
    /// the service's).
    #[command(flatten)]
    pub secrets: SecretArgs,

    /// Behaviour of the in-process service.
    #[command(flatten)]
    pub service: ServiceArgs,
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
    /// Print the API keys `serve` generated for the embedded default as shell `export` lines,
    /// for `eval "$(credpool env)"` (read from `<data dir>/service-keys.json`).
    Env(EnvArgs),
    /// Run the service in-process and drive a simulated executor fleet against it, then print a
    /// summary (exits non-zero if any credential was ever leased beyond its limit).
    Demo(DemoArgs),
    /// Manage credentials, straight in the database (DATABASE_URL or the embedded default);
    /// alone, lists them.
    Keys(KeysArgs),
    /// List the leases held now, or force-release leases, straight in the database; alone,
    /// lists them.
    Leases(LeasesArgs),
    /// Show every (provider, pool): credentials by status, slots, in-flight leases.
    Pools(CliArgs),
    /// Questions answered from the audit trail; alone, runs `verify` (the continuous proof).
    Audit(AuditArgs),
    /// Where each provider's relay calls go (`/relay/{provider}/{pool}/...`), straight in the
    /// database; alone, lists them.
    Relay(RelayArgs),
    /// Schedule the cleanup functions with pg_cron.
    Cron(CronArgs),
    /// Run credpool on Citus, past one primary (docs/src/citus.md): distribute the database.
    Citus(CitusArgs),
    /// Run one cleanup pass now (reap expired leases, record ended cooldowns, purge old audit rows).
    Maintenance(MaintenanceRunArgs),
    /// Measure throughput and latency: simulated executors allocate and release as fast as they
    /// can on a pool of bench credentials (created for the run, removed after), through the
    /// service and optionally through baselines (the simplest correct SQL allocator, credpool's
    /// statements unbatched, the article's Redis + Lua scripts); exits non-zero on any error or
    /// oversell.
    Bench(BenchArgs),
}

impl Command {
    /// Reads every `_FILE` setting of the command (`DATABASE_URL_FILE`, and for `serve`
    /// `CREDPOOL_INTERNAL_KEY_FILE` and `CREDPOOL_ADMIN_KEY_FILE`) into the value it stands for,
    /// before anything else uses the configuration. clap has already refused a value given both
    /// directly and as a file (`conflicts_with`), as with `--master-key` and `--master-key-file`.
    pub(crate) fn load_secret_files(&mut self) -> anyhow::Result<()> {
        match self {
            Command::Serve(args) => args.load_secret_files(),
            Command::Migrate(db) => db.load_secret_files(),
            Command::Demo(args) => args.local.db.load_secret_files(),
            Command::Bench(args) => args.local.db.load_secret_files(),
            Command::Keys(KeysArgs { cli, .. })
            | Command::Leases(LeasesArgs { cli, .. })
            | Command::Pools(cli)
            | Command::Relay(RelayArgs { cli, .. })
            | Command::Audit(AuditArgs { cli, .. })
            | Command::Cron(CronArgs { cli, .. })
            | Command::Citus(CitusArgs { cli, .. })
            | Command::Maintenance(MaintenanceRunArgs { cli, .. }) => cli.db.load_secret_files(),
            // reads only the data directory's key file
            Command::Env(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_given_both_directly_and_as_a_file_is_refused() {
        use clap::Parser;
        for args in [
            &[
                "credpool",
                "serve",
                "--internal-key",
                "a",
                "--internal-key-file",
                "/k",
            ][..],
            &[
                "credpool",
                "serve",
                "--admin-key",
                "a",
                "--admin-key-file",
                "/k",
            ],
            &[
                "credpool",
                "migrate",
                "--database-url",
                "postgres://x@y/z",
                "--database-url-file",
                "/u",
            ],
            &[
                "credpool",
                "serve",
                "--master-key",
                "a",
                "--master-key-file",
                "/m",
            ],
        ] {
            let error = Cli::try_parse_from(args).unwrap_err();
            assert_eq!(
                error.kind(),
                clap::error::ErrorKind::ArgumentConflict,
                "{args:?}"
            );
        }
    }
}

#[cfg(test)]
mod oauth_flags {
    use super::*;
    use clap::Parser;
    use std::time::Duration;

    /// The refresher settings `credpool serve` with these flags runs with.
    fn serve_oauth(flags: &[&str]) -> credpool::oauth::OAuthSettings {
        let cli = Cli::try_parse_from(["credpool", "serve"].iter().chain(flags)).unwrap();
        let Command::Serve(args) = cli.command else {
            panic!("not serve");
        };
        args.service.settings().oauth
    }

    #[test]
    fn the_refresher_flags_set_its_settings_and_the_marker_outlasts_the_call() {
        let oauth = serve_oauth(&[
            "--oauth-check-ms",
            "250",
            "--oauth-call-timeout-seconds",
            "20",
            "--oauth-backoff-max-seconds",
            "300",
        ]);
        assert_eq!(oauth.check_every, Duration::from_millis(250));
        assert_eq!(oauth.call_timeout, Duration::from_secs(20));
        assert_eq!(oauth.claim_for, Duration::from_secs(60));
        assert_eq!(oauth.backoff_max, Duration::from_secs(300));
        assert_eq!(oauth.backoff_first, Duration::from_secs(1));

        let oauth = serve_oauth(&[]);
        assert_eq!(oauth.call_timeout, Duration::from_secs(10));
        assert_eq!(oauth.claim_for, Duration::from_secs(30));
        assert_eq!(oauth.check_every, Duration::from_secs(1));

        let zero = Cli::try_parse_from(["credpool", "serve", "--oauth-call-timeout-seconds", "0"]);
        assert!(zero.is_err(), "a call timeout of 0 s is refused");
    }
}
