//! credpool's reliability suite (docs/reliability.md): real `credpool serve` processes and real
//! PostgreSQL under the conditions production brings — several replicas, PgBouncer, database
//! restarts, killed processes, orphaned leases, clock and time-zone skew, hostile input, and
//! duplicate or late calls. The harness is the integration tests' (`tests/api/helpers.rs`).

#[path = "../api/helpers.rs"]
#[allow(dead_code)]
mod helpers;

mod clock;
mod database_restart;
mod fleet;
mod hostile_input;
mod late_calls;
mod orphans;
mod pgbouncer;
mod replicas;
mod soak;
