//! The `credpool` command: parses the command line, sets up logging, and runs the subcommand:
//! the service itself from the `credpool` library (`serve`, `migrate`, `env`), or the tooling
//! around it that lives in this package: the operator commands (`operator.rs`), the demo fleet
//! (`demo.rs`) and the load generator with its baselines (`bench.rs`, `bench/`).

mod bench;
mod config;
mod demo;
mod local;
mod operator;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use config::{Cli, Command, LogFormat};
use tracing_subscriber::EnvFilter;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // The service logs what it does; every other command prints its answer on stdout and says
    // nothing on stderr unless something is wrong (the demo and the bench print summaries that
    // per-lease log lines would bury).
    let default_filter = match cli.command {
        Command::Serve(_) => "credpool=info,warn",
        // the bench's own bulk statements (history, the oversell proof) and the proofs' chunks
        // are slow by design
        Command::Bench(_) | Command::Audit(_) | Command::Maintenance(_) => "warn,sqlx::query=error",
        _ => "warn",
    };
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // Log lines are written to stderr by a thread of their own: the service logs every grant and
    // release, and a write(2) per line on the request's own thread was a measurable share of its
    // CPU per request. Lines are never dropped (a full buffer makes the logging thread wait, not
    // the line vanish), and the guard flushes what is buffered when `main` returns.
    let (writer, _flush_on_exit) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(false)
        .finish(std::io::stderr());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match cli.log_format {
        LogFormat::Human => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .init(),
    }
    match run(cli).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("credpool: {}", credpool::error_report(&error));
            ExitCode::FAILURE
        }
    }
}

/// Runs one subcommand, after reading the secrets its configuration names by file
/// (`DATABASE_URL_FILE`, `CREDPOOL_INTERNAL_KEY_FILE`, ...).
async fn run(mut cli: Cli) -> anyhow::Result<ExitCode> {
    cli.command.load_secret_files()?;
    match cli.command {
        Command::Serve(args) => credpool::startup::serve(args).await?,
        Command::Migrate(args) => credpool::startup::migrate(args).await?,
        Command::Env(args) => credpool::startup::print_env(args.data_dir)?,
        Command::Demo(args) => return demo::run(args).await,
        Command::Bench(args) => return bench::run(args).await,
        Command::Keys(args) => operator::keys(args).await?,
        Command::Leases(args) => operator::leases(args).await?,
        Command::Pools(args) => operator::pools(args).await?,
        Command::Relay(args) => operator::relay(args).await?,
        Command::Audit(args) => return operator::audit(args).await,
        Command::Cron(args) => operator::cron(args).await?,
        Command::Citus(args) => operator::citus(args).await?,
        Command::Maintenance(args) => operator::maintenance(args).await?,
    }
    Ok(ExitCode::SUCCESS)
}
