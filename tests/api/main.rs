//! credpool's integration tests: the real app on port 0 against a real PostgreSQL, a fresh
//! database per test (the harness is the `credpool-test-support` crate, `test-support/`). One
//! binary, one module per area.

/// The `credpool` binary this package builds (Cargo tells only this package's test crates where
/// it is), for the harness's helpers that run it.
const BIN: &str = env!("CARGO_BIN_EXE_credpool");

mod admin;
mod affinity;
mod allocate;
mod audit;
mod bench;
mod claim_answers;
mod cli;
mod client;
mod common;
mod dashboard;
mod executor_protocol;
mod gates;
mod handover;
mod lease_state;
mod oauth;
mod observability;
mod operations;
mod operator;
mod processes;
mod races;
mod relay;
mod release_renew;
mod selection;
mod tenant_windows;
mod tenants;
mod trail;
mod view_changes;
mod windows;
