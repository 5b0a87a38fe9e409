//! `credpool bench`: the load generator and its baselines.

use clap::Args;

use super::LocalArgs;

/// An allocator `credpool bench` can measure next to the service (an honest baseline).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchBaseline {
    /// The simplest correct allocator one would write by hand on PostgreSQL: one slot row per
    /// concurrency slot in tables of its own (a throwaway schema the run creates and drops), one
    /// `UPDATE ... FOR UPDATE SKIP LOCKED` statement per claim and one `UPDATE` per release, one
    /// connection per executor, autocommit, no trail.
    Sql,
    /// credpool's own claim and release statements run one request at a time straight on the
    /// database, one connection per executor, no HTTP and no grouping.
    Unbatched,
    /// The original article's Redis + Lua design: its ALLOCATE and RELEASE scripts (EVALSHA) on
    /// `--redis-url`, the credentials loaded under a run-specific key prefix.
    Redis,
    /// credpool itself, its executors presenting the configured internal key (tenant `default`,
    /// no cap): the baseline of a run whose executors present a tenant key (`--tenant-cap`), so
    /// that one run says what tenants cost.
    Untenanted,
}

impl BenchBaseline {
    /// The allocator's name in the report.
    pub(crate) fn name(self) -> &'static str {
        match self {
            BenchBaseline::Sql => "sql",
            BenchBaseline::Unbatched => "unbatched",
            BenchBaseline::Redis => "redis",
            BenchBaseline::Untenanted => "credpool-untenanted",
        }
    }
}

/// `credpool bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// The database, the master keys and the in-process service's behaviour.
    #[command(flatten)]
    pub local: LocalArgs,

    /// Drive a running credpool at this base URL (`http://host:port`) instead of one started
    /// in-process; it must use the same database.
    #[arg(long, env = "CREDPOOL_BENCH_URL")]
    pub url: Option<String>,

    /// The executor API key of the service at --url.
    #[arg(long, env = "CREDPOOL_INTERNAL_KEY", hide_env_values = true)]
    pub internal_key: Option<String>,

    /// Also measure this baseline first, on the same credentials in the same run; repeat the flag
    /// (or give a comma-separated list) to measure several, in the order given.
    #[arg(
        long,
        env = "CREDPOOL_BENCH_BASELINE",
        value_enum,
        value_delimiter = ','
    )]
    pub baseline: Vec<BenchBaseline>,

    /// Measure the relay's overhead instead of allocate/release cycles: the executors make an
    /// OpenAI-style chat completion to a mock upstream this run serves on 127.0.0.1, directly
    /// (`direct`) and then through `/relay/bench/{pool}/v1/chat/completions` (`relay`: a lease per
    /// call), and the report gives the relay's latency (p50, p99) and CPU per call over the
    /// direct call's. The run sets the mock as provider `bench`'s relay upstream (with `--url`,
    /// the service must run on this machine) and puts the previous one back afterwards.
    #[arg(long, env = "CREDPOOL_BENCH_RELAY", conflicts_with = "baseline")]
    pub relay: bool,

    /// The Redis server `--baseline redis` runs on (`redis://host:port[/db]`); the run's keys
    /// live under a run-specific prefix and are deleted afterwards.
    #[arg(
        long,
        env = "CREDPOOL_BENCH_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    pub redis_url: String,

    /// Concurrent simulated executors.
    #[arg(long, env = "CREDPOOL_BENCH_EXECUTORS", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub executors: u32,

    /// Seconds measured, per mode.
    #[arg(long, env = "CREDPOOL_BENCH_DURATION_SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub duration_seconds: u64,

    /// Seconds of unmeasured warm-up before each mode.
    #[arg(long, env = "CREDPOOL_BENCH_WARMUP_SECONDS", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(0..=3_600))]
    pub warmup_seconds: u64,

    /// Milliseconds each executor holds a lease before releasing it. With `--relay`: how long the
    /// mock upstream takes to answer each call (each relay call holds its lease about as long).
    #[arg(long, env = "CREDPOOL_BENCH_HOLD_MS", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    pub hold_ms: u64,

    /// Credentials in the bench pool.
    #[arg(long, env = "CREDPOOL_BENCH_CREDENTIALS", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub credentials: u32,

    /// max_concurrent_uses of each bench credential.
    #[arg(long, env = "CREDPOOL_BENCH_LIMIT", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub limit: u32,

    /// Hot-spot mode: every executor wants the same N credentials (the rest of the pool serves
    /// another model). 0: every credential serves every executor.
    #[arg(long, env = "CREDPOOL_BENCH_HOT_SPOT", default_value_t = 0)]
    pub hot_spot: u32,

    /// Lease length the executors ask for, in seconds.
    #[arg(long, env = "CREDPOOL_BENCH_LEASE_SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u32).range(1..=86_400))]
    pub lease_seconds: u32,

    /// Historical trail rows to add first (leases on the bench credentials over the last 29
    /// days; they stay in the trail), to measure against a large audit trail.
    #[arg(long, env = "CREDPOOL_BENCH_AUDIT_ROWS", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=1_000_000_000))]
    pub audit_rows: u64,

    /// Every allocate carries a fresh `request_id`, as the client crate's do (idempotent
    /// allocation: one advisory lock and one lookup per claim).
    #[arg(long, env = "CREDPOOL_BENCH_REQUEST_IDS")]
    pub request_ids: bool,

    /// How the bench credentials are created: `import` (one transaction, statistics refreshed
    /// after it, as `credpool keys import` does) or `put` (one at a time, as
    /// `PUT /api/admin/keys/{key_id}` does: the planner's statistics stay as they were).
    #[arg(long, env = "CREDPOOL_BENCH_CREATE_BY", value_enum, default_value_t = BenchCreateBy::Import)]
    pub create_by: BenchCreateBy,

    /// The executors present a tenant's key: a tenant this run creates with this cap on live
    /// leases (0: no cap), mints one key for, and deletes afterwards. Compare with
    /// `--baseline untenanted` (the same service with the internal key) in the same run.
    #[arg(long, env = "CREDPOOL_BENCH_TENANT_CAP",
          value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub tenant_cap: Option<u32>,

    /// Rate windows of every bench credential, as the API takes them:
    /// `'[{"requests": 600, "seconds": 60}]'`. Default: none.
    #[arg(long, env = "CREDPOOL_BENCH_RATE_LIMITS", value_parser = parse_rate_limits)]
    pub rate_limits: Option<credpool::allocator::windows::RateLimits>,

    /// Rate windows of the run's tenant, as the API takes them (`'[{"requests": 100000,
    /// "seconds": 60}]'`): the executors present a tenant's key, as with `--tenant-cap` (no cap
    /// unless that flag gives one). Default: none.
    #[arg(long, env = "CREDPOOL_BENCH_TENANT_RATE_LIMITS", value_parser = parse_rate_limits)]
    pub tenant_rate_limits: Option<credpool::allocator::windows::RateLimits>,

    /// Every allocate carries an `affinity_key`, one conversation per executor (`bench-<n>`), so
    /// each executor's claims try the credential that served its last call first.
    #[arg(long, env = "CREDPOOL_BENCH_AFFINITY")]
    pub affinity: bool,
}

impl BenchArgs {
    /// Whether the executors present a tenant's key (`--tenant-cap` or `--tenant-rate-limits`).
    pub(crate) fn tenanted(&self) -> bool {
        self.tenant_cap.is_some() || self.tenant_rate_limits.is_some()
    }
}

fn parse_rate_limits(text: &str) -> Result<credpool::allocator::windows::RateLimits, String> {
    let json: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    credpool::allocator::windows::RateLimits::from_json(json).map_err(|e| e.to_string())
}

/// How `credpool bench` creates its credentials.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchCreateBy {
    /// `credpool keys import`: one transaction, then ANALYZE.
    Import,
    /// `PUT /api/admin/keys/{key_id}`: one transaction per credential, no ANALYZE.
    Put,
}
