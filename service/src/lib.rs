//! credpool leases upstream credentials (LLM API keys, OAuth tokens, browser sessions) to
//! executors, never more at once than each credential allows. PostgreSQL is the one source of
//! truth: every capacity decision, every lease and every audit row lives there. See
//! docs/design.md for the protocol and the book (docs/src) for the API.
//!
//! # Layout
//! - [`domain`]: validated newtypes (`KeyId`, `LeaseId`, `PoolName`, ...), status and outcome.
//! - [`allocator`]: grants leases: the pool sequence, ranking and scoring, the one-statement
//!   claim run in groups, waiting for a slot, health from outcome reports, rate windows, and the
//!   404/409/429 answer of an allocation that found nothing. Its pure parts (ranking, the attempt
//!   state machine, scoring, health, windows) take time and randomness as parameters.
//! - [`store`]: every SQL statement the Rust side runs; each lease transition is one SQL
//!   function of the `sql/` files, one file per transition (whose comments say why the claim
//!   cannot oversell; docs/design.md gives the lock order and the clock rule); [`store::schema`] applies the migrations and the `sql/` files;
//!   [`store::Db`] carries the statements straight to PostgreSQL or through a transaction pooler;
//!   [`store::credentials`] is one file per operator transition.
//! - [`http`]: the axum router, one module per audience (executors, operators, probes, the
//!   operator dashboard at `/dashboard`), and the one error type.
//! - [`startup`]: binding and serving; [`database`]: `DATABASE_URL` or the embedded default;
//!   [`embedded`]: the private PostgreSQL cluster launcher; [`config`]: the service's flags and
//!   environment variables; [`secrets`]: sealing credential material; [`telemetry`]: metrics
//!   and trace context; [`oauth`]: OAuth credentials, their access tokens refreshed by one
//!   writer per generation; [`background`]: the supervisor that restarts a background task
//!   that panicked, and tells `/readyz` and the metrics.
//!
//! The `credpool` command (the repository's root package) runs this library's service and
//! carries the tooling around it: the operator commands, the demo fleet and the load generator.

pub mod allocator;
pub mod background;
pub mod config;
pub mod database;
pub mod domain;
pub mod embedded;
pub mod http;
pub mod oauth;
pub mod secrets;
pub mod startup;
pub mod store;
pub mod telemetry;

/// An error and its causes on one line, each cause once: libraries often repeat their source's
/// text in their own message, which `{:#}` would print twice. An error PostgreSQL sent reads as
/// the server's message, then its detail and hint, also where a wrapper (a failed migration)
/// repeats it: the text sqlx gives it starts with "error returned from database" and ends with
/// the line of PostgreSQL's own C source that raised it (`database "x" does not exist at line
/// 948`), which tells a user nothing.
pub fn error_report(error: &anyhow::Error) -> String {
    // sqlx's text of each PostgreSQL error in the chain, and what people should read instead
    let rewrites: Vec<(String, String)> = error
        .chain()
        .filter_map(|cause| Some((cause.to_string(), postgres_error_text(cause)?)))
        .collect();
    let mut report = String::new();
    for cause in error.chain() {
        let text = rewrites
            .iter()
            .fold(cause.to_string(), |text, (raw, clean)| {
                text.replace(raw, clean)
            });
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

/// The server's message, detail and hint, when `error` is one PostgreSQL sent.
fn postgres_error_text(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    use sqlx::error::DatabaseError;
    // a `sqlx::Error::Database`, or the boxed `DatabaseError` it holds (its `source()`)
    let database: &dyn DatabaseError = match error.downcast_ref::<sqlx::Error>() {
        Some(error) => error.as_database_error()?,
        None => &**error.downcast_ref::<Box<dyn DatabaseError>>()?,
    };
    let postgres = database.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?;
    let mut text = postgres.message().to_owned();
    if let Some(detail) = postgres.detail() {
        text.push_str(&format!(" ({detail})"));
    }
    if let Some(hint) = postgres.hint() {
        text.push_str(&format!(" (hint: {hint})"));
    }
    Some(text)
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
