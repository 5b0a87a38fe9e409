//! credpool's integration tests: the real app on port 0 against a real PostgreSQL, a fresh
//! database per test (see `helpers`). One binary, one module per area.

mod helpers;

mod admin;
mod allocate;
mod audit;
mod cli;
mod client;
mod dashboard;
mod executor_protocol;
mod operations;
mod operator;
mod processes;
mod races;
mod release_renew;
mod selection;
