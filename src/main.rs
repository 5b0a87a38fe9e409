//! The `credpool` binary: parses the command line, sets up logging, and hands over to the library.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use credpool::config::{Cli, Command, LogFormat};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // the demo and the bench print their own summaries; per-lease log lines would bury them
    let default_filter = match cli.command {
        Command::Demo(_) => "warn",
        // the bench's own bulk statements (history, the oversell proof) are slow by design
        Command::Bench(_) => "warn,sqlx::query=error",
        _ => "credpool=info,warn",
    };
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Human => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .init(),
    }
    match credpool::run(cli).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("credpool: {}", credpool::error_report(&error));
            ExitCode::FAILURE
        }
    }
}
