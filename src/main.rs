//! The `credpool` binary: parses the command line, sets up logging, and hands over to the library.

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = credpool::config::Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("credpool=info,warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match credpool::run(cli).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("credpool: {error:#}");
            ExitCode::FAILURE
        }
    }
}
