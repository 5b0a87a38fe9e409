//! The one kit both of credpool's test suites (`tests/api`, `tests/reliability`) use: a
//! PostgreSQL server for the whole test process, a fresh migrated database per test, the real app
//! served on port 0 against it, `credpool serve` as a child process, and the calls a test makes
//! on either. A suite imports it whole (`use credpool_test_support::*;`); a test file never
//! imports another test file.
//!
//! # Layout
//! - [`database`]: the server of the test process and [`TestDatabase`], a fresh database per test.
//! - [`app`]: [`TestApp`], the app served in-process, and what a test reads of its database.
//! - [`service`]: the [`Service`] trait, every HTTP call a test makes (executor calls with the
//!   internal key or a tenant's, operator calls, tenants and their keys, `/metrics`), answered
//!   by [`TestApp`], [`ServeProcess`] and [`Remote`]; and the checks of an answer
//!   ([`json_body`], [`assert_error`], [`Answer`]: `.refused(status, code)`, `.ok_json()`).
//! - [`requests`]: request bodies (`gpt4o*`, [`lease_ref`], [`release_body`]).
//! - [`hooks`]: windows held open on purpose: test hooks in the SQL functions ([`Hook`]),
//!   transactions of the test's own ([`holding`], [`transaction_waiting`],
//!   [`release_group_waiting`]) and waits until a backend waits for a lock.
//! - [`sql`]: the test's own statements on a database ([`Sql`], on a pool or the app).
//! - [`metrics`]: reading a Prometheus page.
//! - [`race`]: allocations raced against each other over replicas ([`allocate_at_once`]).
//! - [`process`]: the `credpool` binary: [`ServeProcess`], its environment ([`keyed_env`]) and
//!   one-shot commands ([`credpool_command`], [`run`], [`audit_passes`], [`audit_fails`]).
//! - [`fleet`]: a fleet of executors over `credpool serve` replicas (the reliability suite's
//!   replica and soak scenarios); not re-exported at the top, used as `fleet::...`.

#![warn(missing_docs)]

pub mod app;
pub mod database;
pub mod fleet;
pub mod hooks;
pub mod metrics;
pub mod oauth_mock;
pub mod process;
pub mod race;
pub mod requests;
pub mod service;
pub mod sql;

pub use app::*;
pub use database::*;
pub use hooks::*;
pub use metrics::*;
pub use process::*;
pub use race::*;
pub use requests::*;
pub use service::*;
pub use sql::*;

/// The internal (executor) API key the tests' services accept.
pub const INTERNAL_KEY: &str = "test-internal-key";
/// The admin API key the tests' services accept (16 characters: the shortest key a service takes).
pub const ADMIN_KEY: &str = "test-admin-key-0";
/// The master key the tests seal secrets with.
pub const MASTER_KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

/// The number in the environment variable `name` (a scenario's rounds or seconds), or `default`
/// when it is unset or not a number.
pub fn env_number<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A keyring holding [`MASTER_KEY`] alone, as the tests' services seal and open secrets.
pub fn keyring() -> std::sync::Arc<credpool::secrets::Keyring> {
    let key = credpool::secrets::MasterKey::parse(MASTER_KEY).unwrap();
    std::sync::Arc::new(credpool::secrets::Keyring::new(key, vec![]))
}

/// Reports that the running test skips itself, or a part of itself, as `skipped: <test>:
/// <reason>`, on the process's stderr itself: libtest captures `eprintln!` of a passing test and
/// shows only "ok", so a skipped run would read as a full pass. The line shows in `cargo test`'s
/// output next to the test results.
pub fn report_skipped(reason: &str) {
    use std::io::Write;
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    // straight to the file descriptor: the capture only intercepts the print macros
    let _ = writeln!(std::io::stderr().lock(), "skipped: {test}: {reason}");
}
