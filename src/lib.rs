//! credpool leases upstream credentials (LLM API keys, OAuth tokens, browser sessions) to
//! executors, never more at once than each credential allows. PostgreSQL is the one source of
//! truth: every capacity decision, every lease and every audit row lives there. See
//! `DESIGN.md` for the protocol and README.md for the API.
//!
//! # Layout
//! - [`domain`]: validated newtypes (`KeyId`, `LeaseId`, `PoolName`, ...), status and outcome.
//! - [`ranking`]: the pure ranking of candidates (no I/O; clock and randomness passed in).
//! - [`allocation`]: the pool sequence, ranking and one-statement claim, and the 404/409/429
//!   classification of an allocation that found nothing.
//! - [`store`]: every SQL statement; `store/claim_slot.sql` is the claim and explains why it
//!   cannot oversell.
//! - [`http`]: the axum router, one module per audience, and the one error type.
//! - [`startup`]: binding and serving; [`database`]: `DATABASE_URL` or the embedded default;
//!   [`embedded`]: the private PostgreSQL cluster launcher.
//! - [`demo`]: `credpool demo`, a simulated executor fleet over real HTTP.
//! - [`config`]: flags and environment variables.

pub mod allocation;
pub mod config;
pub mod database;
pub mod demo;
pub mod domain;
pub mod embedded;
pub mod http;
pub mod ranking;
pub mod startup;
pub mod store;

/// Runs one subcommand of the `credpool` binary.
pub async fn run(cli: config::Cli) -> anyhow::Result<std::process::ExitCode> {
    use config::Command;
    match cli.command {
        Command::Serve(args) => startup::serve(args).await?,
        Command::Migrate(args) => startup::migrate(args).await?,
        Command::Demo(args) => return demo::run(args).await,
    }
    Ok(std::process::ExitCode::SUCCESS)
}
