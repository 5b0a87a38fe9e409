//! `credpool demo`: the simulated executor fleet.

use clap::Args;

use super::LocalArgs;

/// `credpool demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// The database, the master keys and the in-process service's behaviour.
    #[command(flatten)]
    pub local: LocalArgs,

    /// How long executors start new calls, in seconds (calls in flight then finish, and the
    /// summary waits one lease length for crashed executors' leases to expire).
    #[arg(long, env = "CREDPOOL_DEMO_DURATION_SECONDS", default_value_t = 20)]
    pub duration_seconds: u64,

    /// Concurrent simulated executors.
    #[arg(long, env = "CREDPOOL_DEMO_EXECUTORS", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub executors: u32,

    /// Lease length the executors ask for, in seconds (some calls run longer and renew).
    #[arg(long, env = "CREDPOOL_DEMO_LEASE_SECONDS", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub lease_seconds: u32,
}
