//! credpool leases upstream credentials (LLM API keys, OAuth tokens, browser sessions) to
//! executors, never more at once than each credential allows. PostgreSQL is the one source of
//! truth: every capacity decision, every lease and every audit row lives there. See
//! `DESIGN.md` for the protocol and README.md for the API.
//!
//! # Layout
//! - [`domain`]: validated newtypes (`KeyId`, `LeaseId`, `PoolName`, ...), status and outcome.
//! - [`scoring`]: the pure score of a candidate and the ranking (no I/O; clock and randomness
//!   passed in); [`health`]: the pure outcome -> health state machine.
//! - [`candidates`]: each process's per-pool candidate views, so ranking reads no pool per request.
//! - [`allocation`]: the pool sequence, ranking and one-statement claim, and the 404/409/429
//!   classification of an allocation that found nothing.
//! - [`store`]: every SQL statement but the claim, which is the SQL function `credpool_claim`
//!   (`migrations/20261130000005_performance.sql`, whose comment explains why it cannot oversell);
//!   [`store::Db`] carries them straight to PostgreSQL or through a transaction pooler.
//! - [`groups`]: group claiming, several claims, releases or renewals in one transaction.
//! - [`http`]: the axum router, one module per audience (executors, operators, the operator
//!   dashboard at `/dashboard`), and the one error type.
//! - [`startup`]: binding and serving; [`database`]: `DATABASE_URL` or the embedded default;
//!   [`embedded`]: the private PostgreSQL cluster launcher.
//! - [`demo`]: `credpool demo`, a simulated executor fleet over real HTTP.
//! - [`config`]: flags and environment variables.

pub mod allocation;
pub mod bench;
pub mod candidates;
pub mod cli;
pub mod config;
pub mod database;
pub mod demo;
pub mod domain;
pub mod embedded;
pub mod groups;
pub mod health;
pub mod http;
pub mod scoring;
pub mod secrets;
pub mod startup;
pub mod store;
pub mod telemetry;
pub mod waiting;

/// An error and its causes on one line, each cause once: libraries often repeat their source's
/// text in their own message, which `{:#}` would print twice.
pub fn error_report(error: &anyhow::Error) -> String {
    let mut report = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if text.is_empty() || report.contains(&text) {
            continue;
        }
        if !report.is_empty() {
            report.push_str(": ");
        }
        report.push_str(&text);
    }
    report
}

/// Runs one subcommand of the `credpool` binary.
pub async fn run(cli: config::Cli) -> anyhow::Result<std::process::ExitCode> {
    use config::Command;
    match cli.command {
        Command::Serve(args) => startup::serve(args).await?,
        Command::Migrate(args) => startup::migrate(args).await?,
        Command::Demo(args) => return demo::run(args).await,
        Command::Bench(args) => return bench::run(args).await,
        Command::Keys(args) => cli::keys(args).await?,
        Command::Leases(args) => cli::leases(args).await?,
        Command::Pools(args) => cli::pools(args).await?,
        Command::Audit(args) => return cli::audit(args).await,
        Command::Cron(args) => cli::cron(args).await?,
        Command::Maintenance(args) => cli::maintenance(args).await?,
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    #[test]
    fn error_report_names_each_cause_once() {
        let inner = std::io::Error::other("connection refused");
        let error = anyhow::Error::new(inner)
            .context("pool timed out: connection refused")
            .context("applying migrations");
        assert_eq!(
            crate::error_report(&error),
            "applying migrations: pool timed out: connection refused"
        );
    }
}
