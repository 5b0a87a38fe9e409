//! credpool's reliability suite (docs/reliability.md): real `credpool serve` processes and real
//! PostgreSQL under the conditions production brings — several replicas, PgBouncer, database
//! restarts, killed processes, orphaned leases, clock and time-zone skew, hostile input, and
//! duplicate or late calls. The harness is the one the integration tests use: the
//! `credpool-test-support` crate (`test-support/`).

/// The `credpool` binary this package builds (Cargo tells only this package's test crates where
/// it is), for the harness's helpers that run it.
const BIN: &str = env!("CARGO_BIN_EXE_credpool");

mod clock;
mod database_restart;
mod failover;
mod hostile_input;
mod late_calls;
mod orphans;
mod pgbouncer;
mod replicas;
mod soak;
mod storm;
