//! `credpool bench`: a load generator for sizing a deployment, and the side-by-side measurement
//! of credpool against honest baselines on the same machine in the same run.
//!
//! W simulated executors loop for D seconds (after an unmeasured warm-up): allocate, hold the
//! lease H milliseconds, release it with the outcome `success`. The credpool mode drives a
//! service over HTTP (one started in-process on the database, or a running one given with
//! `--url`). Each `--baseline` runs the same cycles on the same credentials (count, limit, hold)
//! first, through the same executor loop and tallies ([`Allocator`], [`drive`]):
//!
//! - `sql` (`simple_sql.rs`): the simplest correct allocator written by hand on PostgreSQL, in
//!   tables of its own: one slot row per concurrency slot, one statement per claim and one per
//!   release, one connection per executor, autocommit, no trail. What a user would write instead.
//! - `unbatched`: credpool's own claim and release statements (`credpool_claim` with one claim,
//!   [`leases::release_on`]) one request at a time, one connection per executor, no HTTP.
//! - `redis` (`redis_lua.rs`): the original article's ALLOCATE and RELEASE Lua scripts on Redis.
//!
//! `--relay` (`relay.rs`) measures the relay instead: the same executors make an OpenAI-style call
//! to a mock upstream in this process, directly and then through `/relay/bench/{pool}/...`, and
//! the report gives the relay's latency and CPU per call over the direct call's.
//!
//! Server time per claim and release (`server_time.rs`) comes from `pg_stat_statements` when the
//! server has it loaded, and for Redis from `INFO commandstats`; the report says when it is not
//! available. The credpool and unbatched modes share one pool of bench credentials (provider
//! `bench`, a fresh pool per run, removed afterwards); the sql baseline's schema and the Redis
//! keys are removed afterwards too.
//!
//! After the run the oversell proof is computed from the audit trail (SQL function
//! `credpool_oversell_check`) over the run's credentials (credpool and unbatched: the sql and
//! redis baselines keep no trail); the command exits non-zero if any grant exceeded a limit or
//! if there was any error.

mod cpu;
mod redis_lua;
mod relay;
mod server_time;
mod simple_sql;

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use rand::RngExt;
use reqwest::StatusCode;
use serde_json::json;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgConnection};

use crate::config::{BenchArgs, BenchBaseline};
use crate::local::LocalService;
use credpool::allocator::health::HealthPolicy;
use credpool::database::Database;
use credpool::domain::{
    Holder, KeyId, LeaseSeconds, ModelName, Outcome, PoolName, ProviderName, Secret, Status,
    TenantId, TenantKey,
};
use credpool::store::credentials::{self, Actor, CredentialSpec};
use credpool::store::leases::{self, Claim, GrantedLease, LeaseRef, ReleaseRequest};
use credpool::store::{Conn, Db, audit, tenants};

use server_time::ServerTime;

const PROVIDER: &str = "bench";
/// The model every executor asks for (in hot-spot mode only the hot credentials serve it).
const MODEL: &str = "bench-model";
/// The model the rest of the pool serves in hot-spot mode.
const OTHER_MODEL: &str = "bench-other";
/// Candidates the unbatched baseline passes to each claim: a window of the serving credentials
/// at a random place (the claim takes the first with a free slot).
const UNBATCHED_CANDIDATES: usize = 16;

/// How one allocator fared.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModeReport {
    /// `credpool`, or the baseline's name (`sql`, `unbatched`, `redis`).
    pub mode: &'static str,
    /// Completed allocate + release cycles per second.
    pub cycles_per_second: f64,
    /// Allocate latency, milliseconds.
    pub allocate_ms: Percentiles,
    /// Release latency, milliseconds.
    pub release_ms: Percentiles,
    /// Allocations answered "no capacity" (HTTP 429; for a baseline, a claim that found no
    /// free slot).
    pub exhausted: u64,
    /// Anything else that failed (other HTTP statuses, transport, database or Redis errors).
    pub errors: u64,
    /// What the mode cost the server (PostgreSQL or Redis), when that could be measured.
    pub server_time: Option<ServerTime>,
    /// CPU per completed cycle in the measured window, per process group (Linux).
    pub cpu: Option<cpu::CpuPerCycle>,
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Percentiles {
    fn of(histogram: &Histogram<u64>) -> Self {
        let ms = |micros: u64| micros as f64 / 1000.0;
        Self {
            p50: ms(histogram.value_at_quantile(0.50)),
            p90: ms(histogram.value_at_quantile(0.90)),
            p99: ms(histogram.value_at_quantile(0.99)),
            max: ms(histogram.max()),
        }
    }
}

/// One executor's tally over the measured window.
struct Tally {
    cycles: u64,
    /// Cycles completed including the warm-up (server time is per cycle of the whole mode).
    all_cycles: u64,
    exhausted: u64,
    errors: u64,
    /// Microseconds.
    allocate: Histogram<u64>,
    /// Microseconds.
    release: Histogram<u64>,
}

impl Tally {
    fn new() -> Self {
        let histogram = || Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds");
        Self {
            cycles: 0,
            all_cycles: 0,
            exhausted: 0,
            errors: 0,
            allocate: histogram(),
            release: histogram(),
        }
    }

    /// The tally of an executor that could not even connect.
    fn not_connected(mode: &str, error: &dyn std::fmt::Display) -> Self {
        tracing::warn!(mode, error = %error, "bench executor could not connect");
        let mut tally = Self::new();
        tally.errors += 1;
        tally
    }

    fn merge(&mut self, other: &Tally) {
        self.cycles += other.cycles;
        self.all_cycles += other.all_cycles;
        self.exhausted += other.exhausted;
        self.errors += other.errors;
        self.allocate.add(&other.allocate).expect("same bounds");
        self.release.add(&other.release).expect("same bounds");
    }

    fn record(histogram: &mut Histogram<u64>, elapsed: Duration) {
        histogram.saturating_record(elapsed.as_micros().max(1) as u64);
    }
}

/// The measured window, shared by a mode's executors: cycles that start before `measured_from`
/// are warm-up and not counted; no cycle starts after `until`.
#[derive(Clone, Copy)]
struct Window {
    measured_from: Instant,
    until: Instant,
    /// When executors may drop their connections: after the CPU reading at `until` (a database
    /// backend that exits before it is read takes its CPU time with it, and the baselines' one
    /// connection per executor would then count for nothing).
    release_connections: Instant,
}

impl Window {
    fn starting_now(warmup: Duration, measured: Duration) -> Self {
        let measured_from = Instant::now() + warmup;
        let until = measured_from + measured;
        Self {
            measured_from,
            until,
            release_connections: until + Duration::from_millis(500),
        }
    }
}

/// What every executor of a run shares.
struct Plan {
    pool: PoolName,
    /// The credentials that serve [`MODEL`].
    serving: Vec<KeyId>,
    lease_seconds: u32,
    hold: Duration,
    /// Whether each HTTP allocate carries a fresh `request_id`.
    request_ids: bool,
    /// Whether each HTTP allocate carries its executor's `affinity_key`.
    affinity: bool,
    /// Cycles completed in the current mode so far, for the progress bar.
    progress: AtomicU64,
    /// The PostgreSQL server's postmaster, when it runs on this machine (for the CPU split).
    postmaster: Option<u32>,
}

impl Plan {
    /// `n` serving credentials from a random place on: how the baselines rank (they have no
    /// scoring; a random window spreads executors as jitter does).
    fn window(&self, n: usize) -> impl Iterator<Item = &KeyId> {
        let start = rand::rng().random_range(0..self.serving.len());
        self.serving
            .iter()
            .cycle()
            .skip(start)
            .take(n.min(self.serving.len()))
    }
}

/// Runs the benchmark; the exit code is non-zero on any error or oversell.
pub async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    credpool::startup::check_secret_config(&args.local.secrets, &args.local.db)?;
    anyhow::ensure!(
        args.hot_spot <= args.credentials,
        "--hot-spot ({}) cannot exceed --credentials ({})",
        args.hot_spot,
        args.credentials
    );
    let baselines = baselines(&args);
    anyhow::ensure!(
        !(baselines
            .iter()
            .any(|b| matches!(b, BenchBaseline::Sql | BenchBaseline::Unbatched))
            && args.local.db.db_pooler == credpool::config::DbPooler::Transaction),
        "--baseline sql and --baseline unbatched run single statements outside transactions, \
         which a transaction pooler cannot carry: run them with a DATABASE_URL that reaches \
         PostgreSQL directly"
    );
    if baselines.contains(&BenchBaseline::Redis) {
        redis_lua::check(&args.redis_url).await?;
    }
    let serving = if args.hot_spot == 0 {
        args.credentials
    } else {
        args.hot_spot
    };
    anyhow::ensure!(
        !args.relay || u64::from(serving) * u64::from(args.limit) >= u64::from(args.executors),
        "--relay measures the relay's overhead, not waits for a credential: the serving \
         credentials' slots ({serving} of limit {}) must be at least --executors ({})",
        args.limit,
        args.executors
    );
    let database = Database::open(&args.local.db).await?;
    let result = run_on(&args, &baselines, &database).await;
    database.close().await;
    result
}

/// The baselines asked for, each once, in the order given.
fn baselines(args: &BenchArgs) -> Vec<BenchBaseline> {
    let mut baselines = Vec::new();
    for baseline in &args.baseline {
        if !baselines.contains(baseline) {
            baselines.push(*baseline);
        }
    }
    baselines
}

async fn run_on(
    args: &BenchArgs,
    baselines: &[BenchBaseline],
    database: &Database,
) -> anyhow::Result<ExitCode> {
    let keyring = credpool::startup::prepare_keyring(&args.local.secrets, database).await?;
    let run_id = hex::encode(rand::random::<[u8; 4]>());
    let pool = PoolName::parse(format!("run-{run_id}")).map_err(anyhow::Error::msg)?;
    let actor = Actor::parse("bench").map_err(anyhow::Error::msg)?;

    // the service: a running one, or one in-process on this database
    let (base, internal_key, server) = match &args.url {
        Some(url) => {
            let key = args
                .internal_key
                .clone()
                .context("--url needs the service's executor key (CREDPOOL_INTERNAL_KEY)")?;
            (url.trim_end_matches('/').to_owned(), key, None)
        }
        None => {
            let service =
                LocalService::start(database, keyring.clone(), &args.local.service).await?;
            (
                service.base.clone(),
                service.internal_key.clone(),
                Some(service),
            )
        }
    };

    eprintln!(
        "credpool bench: loading {} credentials of limit {} into pool {PROVIDER}/{pool}",
        args.credentials, args.limit
    );
    let serving = load_credentials(args, &database.pool, &keyring, &pool, &actor, &run_id).await?;
    let key_ids: Vec<String> = all_key_ids(args, &run_id);
    let tenant = TenantId::parse(format!("bench-{run_id}")).map_err(anyhow::Error::msg)?;
    let db = &database.pool;
    let sql_schema = simple_sql::schema_name(&run_id);
    let source = server_time::detect(db).await;
    // whatever happens from here on (the run's tenant failing to be created included), the run's
    // credentials, tenant, tables and keys are removed again
    let measured = async {
        let tenant_key = if args.tenanted() {
            Some(bench_tenant(db, &tenant, args, &actor).await?)
        } else {
            None
        };
        if args.audit_rows > 0 {
            eprintln!("adding {} historical audit rows", args.audit_rows);
            load_history(db, &serving, args.audit_rows).await?;
        }
        let plan = Arc::new(Plan {
            pool: pool.clone(),
            serving,
            lease_seconds: args.lease_seconds,
            // with --relay the hold is the mock upstream's, inside each call
            hold: if args.relay {
                Duration::ZERO
            } else {
                Duration::from_millis(args.hold_ms)
            },
            request_ids: args.request_ids,
            affinity: args.affinity,
            progress: AtomicU64::new(0),
            postmaster: sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
                .fetch_one(db.pool())
                .await
                .ok()
                .and_then(|backend| cpu::postmaster_of(backend.try_into().ok()?)),
        });

        let executor_key = match &tenant_key {
            Some(key) => key.expose().to_owned(),
            None => internal_key.clone(),
        };
        let since = audit::now(db).await?;
        let mut reports = Vec::new();
        if args.relay {
            reports = relay::measure(args, db, &plan, &base, &executor_key).await?;
        }
        let options = (*db.pool().connect_options()).clone();
        for baseline in baselines {
            let mode = match baseline {
                BenchBaseline::Sql => {
                    simple_sql::create(db, &sql_schema, &key_ids, pool.as_str(), args.limit)
                        .await?;
                    Mode::Sql(Box::new(simple_sql::connect_options(&options, &sql_schema)))
                }
                BenchBaseline::Unbatched => Mode::Unbatched(Box::new(options.clone())),
                BenchBaseline::Untenanted => Mode::Http {
                    client: http_client(args)?,
                    base: base.clone(),
                    executor_key: internal_key.clone(),
                    name: baseline.name(),
                },
                BenchBaseline::Redis => Mode::Redis(Box::new(
                    redis_lua::load(
                        &args.redis_url,
                        &run_id,
                        pool.as_str(),
                        &key_ids,
                        args.limit,
                    )
                    .await?,
                )),
            };
            reports.push(run_measured(args, db, &source, &plan, mode).await?);
        }
        if !args.relay {
            let credpool = Mode::Http {
                client: http_client(args)?,
                base: base.clone(),
                executor_key,
                name: "credpool",
            };
            reports.push(run_measured(args, db, &source, &plan, credpool).await?);
        }
        let until = audit::now(db).await?;

        if let Some(service) = server {
            service.stop().await?;
        }
        // the proof reads the run's whole trail: more than a request's statement timeout
        let mut tx = without_statement_timeout(db).await?;
        let proof = audit::oversell_check(&mut *tx, since, until).await?;
        tx.commit().await?;
        let oversold: i64 = proof
            .iter()
            .filter(|row| key_ids.contains(&row.key_id))
            .map(|row| row.grants_over_limit)
            .sum();
        anyhow::Ok((reports, oversold))
    }
    .await;
    let removed = remove_credentials(db, &key_ids, &actor).await;
    // after the credentials: deleting them ended every lease the tenant held (a tenant whose
    // creation failed is not there to delete)
    let tenant_removed = if args.tenanted() {
        match tenants::delete(db, &tenant, &actor).await {
            Ok(Ok(()) | Err(tenants::DeleteRefused::NotFound)) => Ok(()),
            Ok(Err(refused)) => Err(anyhow::anyhow!("{refused:?}")),
            Err(error) => Err(error.into()),
        }
    } else {
        Ok(())
    };
    let dropped = if baselines.contains(&BenchBaseline::Sql) {
        simple_sql::drop(db, &sql_schema).await
    } else {
        Ok(())
    };
    let unlinked = if baselines.contains(&BenchBaseline::Redis) {
        redis_lua::remove(&args.redis_url, &run_id)
            .await
            .map(|_| ())
    } else {
        Ok(())
    };
    let extension = server_time::cleanup(db, &source).await;
    let (reports, oversold) = measured?;
    removed?;
    tenant_removed.context("deleting the run's tenant")?;
    dropped.context("dropping the sql baseline's schema")?;
    unlinked.context("deleting the redis baseline's keys")?;
    extension.context("dropping pg_stat_statements, created for the run")?;

    let rss_peak_mb = peak_rss_mb();
    if args.relay {
        relay::print_report(args, &reports, oversold, rss_peak_mb);
    } else {
        print_report(args, &reports, &source, oversold, rss_peak_mb);
    }
    let errors: u64 = reports.iter().map(|r| r.errors).sum();
    Ok(if oversold == 0 && errors == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Runs one mode between two readings of the server's statistics (a reading that fails leaves
/// the mode without server time, with a warning; the run goes on).
async fn run_measured(
    args: &BenchArgs,
    db: &Db,
    source: &server_time::Source,
    plan: &Arc<Plan>,
    mode: Mode,
) -> anyhow::Result<ModeReport> {
    fn read<T, E: std::fmt::Display>(mode: &str, reading: Result<T, E>) -> Option<T> {
        reading
            .inspect_err(|error| tracing::warn!(mode, error = %error, "server time not read"))
            .ok()
    }
    let name = mode.name();
    if let Mode::Redis(_) = mode {
        let before = read(name, redis_lua::evalsha_stats(&args.redis_url).await);
        let (mut report, all_cycles) = run_mode(args, plan, mode).await?;
        let after = read(name, redis_lua::evalsha_stats(&args.redis_url).await);
        report.server_time = before
            .zip(after)
            .map(|(before, after)| server_time::between_redis(before, after, all_cycles));
        return Ok(report);
    }
    let measurable = matches!(source, server_time::Source::PgStatStatements { .. });
    let before = if measurable {
        read(name, server_time::snapshot(db, source).await)
    } else {
        None
    };
    let (mut report, all_cycles) = run_mode(args, plan, mode).await?;
    if let Some(before) = before {
        let after = read(name, server_time::snapshot(db, source).await);
        report.server_time = after.map(|after| server_time::between(&before, &after, all_cycles));
    }
    Ok(report)
}

fn all_key_ids(args: &BenchArgs, run_id: &str) -> Vec<String> {
    (0..args.credentials)
        .map(|i| format!("bench-{run_id}-{i:05}"))
        .collect()
}

/// Creates the run's credentials (sealed like any other, by `--create-by`); returns those
/// that serve [`MODEL`].
async fn load_credentials(
    args: &BenchArgs,
    db: &Db,
    keyring: &credpool::secrets::Keyring,
    pool: &PoolName,
    actor: &Actor,
    run_id: &str,
) -> anyhow::Result<Vec<KeyId>> {
    let provider = ProviderName::parse(PROVIDER).map_err(anyhow::Error::msg)?;
    let (model, other) = (
        ModelName::parse(MODEL).map_err(anyhow::Error::msg)?,
        ModelName::parse(OTHER_MODEL).map_err(anyhow::Error::msg)?,
    );
    let hot = if args.hot_spot == 0 {
        args.credentials
    } else {
        args.hot_spot
    };
    let mut specs = Vec::new();
    let mut serving = Vec::new();
    for (i, key_id) in all_key_ids(args, run_id).into_iter().enumerate() {
        let key_id = KeyId::parse(key_id).map_err(anyhow::Error::msg)?;
        let secret = Secret::parse(json!({"api_key": format!("sk-bench-{i}")}))
            .map_err(anyhow::Error::msg)?;
        let models = if (i as u32) < hot {
            serving.push(key_id.clone());
            vec![model.clone()]
        } else {
            vec![other.clone()]
        };
        specs.push(CredentialSpec {
            sealed_secret: keyring.seal(&key_id, &secret),
            key_id,
            provider: provider.clone(),
            pool: pool.clone(),
            models,
            aliases: Default::default(),
            max_concurrent_uses: credentials::check_limit(u64::from(args.limit))
                .map_err(anyhow::Error::msg)?,
            status: Some(Status::Available),
            rate_limits: args.rate_limits.clone().unwrap_or_default(),
            oauth: None,
        });
    }
    match args.create_by {
        crate::config::BenchCreateBy::Import => {
            credentials::import(db, &specs, actor).await?;
        }
        crate::config::BenchCreateBy::Put => {
            for spec in &specs {
                credentials::upsert(
                    db,
                    spec,
                    actor,
                    &credpool::allocator::health::HealthPolicy::default(),
                    None,
                )
                .await?;
            }
        }
    }
    Ok(serving)
}

/// Adds `rows` historical trail rows on the serving credentials: leases granted and released
/// over the last 29 days, half `granted` and half `released`.
async fn load_history(db: &Db, serving: &[KeyId], rows: u64) -> anyhow::Result<()> {
    let key_ids: Vec<String> = serving.iter().map(|k| k.as_str().to_owned()).collect();
    let mut tx = without_statement_timeout(db).await?;
    let pool: String = sqlx::query_scalar("SELECT pool FROM credentials WHERE key_id = $1")
        .bind(&key_ids[0])
        .fetch_one(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, holder, outcome, lease_until, at)
         SELECT CASE WHEN g % 2 = 0 THEN 'granted' ELSE 'released' END,
                md5($4 || (g / 2)::text)::uuid,
                $1[1 + (g / 2) % cardinality($1)], $2, $3, 0, 'bench-history',
                CASE WHEN g % 2 = 1 THEN 'success' END,
                t + interval '60 seconds',
                t + CASE WHEN g % 2 = 1 THEN ((g / 2) % 60 + 1) * interval '1 second' ELSE interval '0' END
         FROM generate_series(0, $5 - 1) g,
              LATERAL (SELECT now() - interval '29 days' + (g / 2) * (interval '29 days' / ($5 / 2 + 1))) AS at(t)",
    )
    .bind(&key_ids)
    .bind(PROVIDER)
    .bind(&pool)
    .bind(hex::encode(rand::random::<[u8; 8]>()))
    .bind(rows as i64)
    .execute(&mut *tx)
    .await?;
    sqlx::query("ANALYZE lease_events")
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// A transaction whose statements may run as long as they need (bulk work of the benchmark,
/// not requests): `statement_timeout` is lifted for it alone.
async fn without_statement_timeout(
    db: &Db,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
    let mut tx = db.begin().await?;
    sqlx::query("SET LOCAL statement_timeout = 0")
        .execute(&mut *tx)
        .await?;
    Ok(tx)
}

/// The HTTP client of the executors of one HTTP mode.
fn http_client(args: &BenchArgs) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .pool_max_idle_per_host(args.executors as usize)
        .timeout(Duration::from_secs(30))
        .build()
}

/// Creates the run's tenant `tenant` (capped at `cap` live leases; 0: no cap) and returns one
/// executor key of it.
async fn bench_tenant(
    db: &Db,
    tenant: &TenantId,
    args: &BenchArgs,
    actor: &Actor,
) -> anyhow::Result<TenantKey> {
    let spec = tenants::TenantSpec {
        tenant_id: tenant.clone(),
        max_concurrent_leases: args.tenant_cap.filter(|&cap| cap > 0).map(|cap| cap as i32),
        weight: 1,
        rate_limits: args.tenant_rate_limits.clone().unwrap_or_default(),
        pools: credpool::domain::TenantScope::everything(),
        reports_may_disable: false,
    };
    tenants::upsert(db, &spec, actor)
        .await
        .context("creating the run's tenant")?;
    let (_, key) = tenants::mint_key(db, tenant, actor)
        .await?
        .context("the run's tenant was created a moment ago")?;
    Ok(key)
}

/// Deletes the run's credentials (their history stays in the trail, as for any deletion).
async fn remove_credentials(db: &Db, key_ids: &[String], actor: &Actor) -> anyhow::Result<()> {
    use futures::StreamExt;
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(key_ids)
        .map(|key_id| async move {
            let key_id = KeyId::parse(key_id.clone()).map_err(anyhow::Error::msg)?;
            credentials::delete(db, &key_id, actor).await?;
            Ok(())
        })
        .buffer_unordered(8)
        .collect()
        .await;
    results.into_iter().collect()
}

/// One allocator under test and what its executors share.
enum Mode {
    Http {
        client: reqwest::Client,
        base: String,
        /// What the executors send as `X-Internal-Key`: the internal key or a tenant's key.
        executor_key: String,
        /// The allocator's name in the report.
        name: &'static str,
    },
    /// OpenAI-style calls (`--relay`): to the mock upstream directly, or through the relay.
    Call {
        client: reqwest::Client,
        /// The chat completions URL.
        url: String,
        /// The `Authorization` header: a bench credential's key, or the executor key.
        authorization: String,
        /// The call's JSON body.
        body: String,
        /// `direct` or `relay`.
        name: &'static str,
    },
    Sql(Box<PgConnectOptions>),
    Unbatched(Box<PgConnectOptions>),
    Redis(Box<redis_lua::RedisBaseline>),
}

impl Mode {
    fn name(&self) -> &'static str {
        match self {
            Mode::Http { name, .. } | Mode::Call { name, .. } => name,
            Mode::Sql(_) => BenchBaseline::Sql.name(),
            Mode::Unbatched(_) => BenchBaseline::Unbatched.name(),
            Mode::Redis(_) => BenchBaseline::Redis.name(),
        }
    }

    /// One executor's whole run: connect (for the baselines, one connection each), then
    /// [`drive`] until the window ends.
    async fn execute(&self, plan: &Plan, index: u32, window: Window) -> Tally {
        match self {
            Mode::Http {
                client,
                base,
                executor_key,
                ..
            } => {
                let allocator = HttpAllocator::new(plan, client, base, executor_key, index);
                drive(plan, window, allocator).await
            }
            Mode::Call {
                client,
                url,
                authorization,
                body,
                ..
            } => {
                let allocator = relay::CallAllocator::new(client, url, authorization, body);
                drive(plan, window, allocator).await
            }
            Mode::Sql(options) => {
                match simple_sql::SqlAllocator::connect(options, plan.lease_seconds).await {
                    Ok(allocator) => drive(plan, window, allocator).await,
                    Err(error) => Tally::not_connected(self.name(), &error),
                }
            }
            Mode::Unbatched(options) => match UnbatchedAllocator::connect(options, index).await {
                Ok(allocator) => drive(plan, window, allocator).await,
                Err(error) => Tally::not_connected(self.name(), &error),
            },
            Mode::Redis(baseline) => match redis_lua::RedisAllocator::connect(baseline).await {
                Ok(allocator) => drive(plan, window, allocator).await,
                Err(error) => Tally::not_connected(self.name(), &error),
            },
        }
    }
}

/// Runs one mode; returns its report (without server time) and the cycles it completed
/// including the warm-up.
async fn run_mode(
    args: &BenchArgs,
    plan: &Arc<Plan>,
    mode: Mode,
) -> anyhow::Result<(ModeReport, u64)> {
    let name = mode.name();
    let mode = Arc::new(mode);
    let measured = Duration::from_secs(args.duration_seconds);
    let window = Window::starting_now(Duration::from_secs(args.warmup_seconds), measured);
    plan.progress.store(0, Ordering::Relaxed);
    let progress = progress_bar(name, args, plan, window);
    // CPU readings at the measured window's start and end
    let postmaster = plan.postmaster;
    let cpu_window = tokio::spawn(async move {
        tokio::time::sleep_until(window.measured_from.into()).await;
        let before = cpu::read(postmaster);
        tokio::time::sleep_until(window.until.into()).await;
        before.zip(cpu::read(postmaster))
    });
    let tasks: Vec<_> = (0..args.executors)
        .map(|index| {
            let (plan, mode) = (plan.clone(), mode.clone());
            tokio::spawn(async move { mode.execute(&plan, index, window).await })
        })
        .collect();
    let mut total = Tally::new();
    for task in tasks {
        total.merge(&task.await?);
    }
    progress.abort();
    let cpu = cpu_window.await?.and_then(|(before, after)| {
        cpu::per_cycle(before, after, total.cycles, args.url.is_some())
    });
    let report = ModeReport {
        mode: name,
        cycles_per_second: total.cycles as f64 / measured.as_secs_f64(),
        allocate_ms: Percentiles::of(&total.allocate),
        release_ms: Percentiles::of(&total.release),
        exhausted: total.exhausted,
        errors: total.errors,
        server_time: None,
        cpu,
    };
    Ok((report, total.all_cycles))
}

/// A progress bar on stderr (hidden when stderr is not a terminal) until the window ends.
fn progress_bar(
    name: &str,
    args: &BenchArgs,
    plan: &Arc<Plan>,
    window: Window,
) -> tokio::task::JoinHandle<()> {
    let total = args.warmup_seconds + args.duration_seconds;
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix:>9} [{bar:30}] {pos}/{len} s  {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(name.to_owned());
    let plan = plan.clone();
    let started = Instant::now();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        while Instant::now() < window.until {
            tick.tick().await;
            bar.set_position(started.elapsed().as_secs().min(total));
            let phase = if Instant::now() < window.measured_from {
                "warming up"
            } else {
                "measuring"
            };
            bar.set_message(format!(
                "{phase}, {} cycles",
                plan.progress.load(Ordering::Relaxed)
            ));
        }
        bar.finish_and_clear();
    })
}

/// What one allocate came to.
enum Claimed {
    /// A lease is held (until [`Allocator::release`]).
    Leased,
    /// No free slot among the candidates (HTTP 429; a baseline's empty answer).
    Exhausted,
    /// Anything else: an error status, a transport, database or Redis error.
    Failed,
}

impl Claimed {
    /// What a baseline's claim statement or script came to: `Some(key_id)`, a slot of `key_id`
    /// is held under `lease_id` (kept in `held` for the release); `None`, the ranked list has no
    /// free slot now (the baseline's 429, not a failure); an error is logged at debug as
    /// `failed` and counts as failed.
    fn of_baseline<L>(
        answer: Result<Option<String>, impl std::fmt::Display>,
        lease_id: L,
        held: &mut Option<(String, L)>,
        failed: &str,
    ) -> Claimed {
        match answer {
            Ok(Some(key_id)) => {
                *held = Some((key_id, lease_id));
                Claimed::Leased
            }
            Ok(None) => Claimed::Exhausted,
            Err(error) => {
                tracing::debug!(error = %error, "{failed}");
                Claimed::Failed
            }
        }
    }
}

/// One simulated executor of one allocator. It holds at most one lease, from an `allocate`
/// that answered [`Claimed::Leased`] to the next `release`.
trait Allocator: Send {
    /// Asks for a lease.
    fn allocate(&mut self, plan: &Plan) -> impl Future<Output = Claimed> + Send;
    /// Releases the lease held with the outcome `success`; whether it was released.
    fn release(&mut self, plan: &Plan) -> impl Future<Output = bool> + Send;
}

/// The executor loop every allocator runs: allocate, hold, release, until the window ends;
/// after "no capacity" it backs off 5 ms, after a failure 10 ms.
async fn drive(plan: &Plan, window: Window, mut allocator: impl Allocator) -> Tally {
    let mut tally = Tally::new();
    loop {
        let started = Instant::now();
        if started >= window.until {
            tokio::time::sleep_until(window.release_connections.into()).await;
            return tally;
        }
        let measured = started >= window.measured_from;
        match allocator.allocate(plan).await {
            Claimed::Leased => {
                if measured {
                    Tally::record(&mut tally.allocate, started.elapsed());
                }
            }
            Claimed::Exhausted => {
                if measured {
                    Tally::record(&mut tally.allocate, started.elapsed());
                    tally.exhausted += 1;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            Claimed::Failed => {
                if measured {
                    tally.errors += 1;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        }
        // a zero hold does not sleep: tokio rounds a timer up to the next millisecond, which
        // would add up to 1 ms to every cycle of every allocator
        if !plan.hold.is_zero() {
            tokio::time::sleep(plan.hold).await;
        }
        let releasing = Instant::now();
        let released = allocator.release(plan).await;
        if released {
            tally.all_cycles += 1;
        }
        if measured {
            Tally::record(&mut tally.release, releasing.elapsed());
            if released {
                tally.cycles += 1;
                plan.progress.fetch_add(1, Ordering::Relaxed);
            } else {
                tally.errors += 1;
            }
        }
    }
}

/// credpool over HTTP, as an executor without the client crate would call it.
struct HttpAllocator<'a> {
    client: &'a reqwest::Client,
    internal_key: &'a str,
    allocate_url: String,
    release_url: String,
    body: serde_json::Value,
    lease: Option<serde_json::Value>,
}

impl<'a> HttpAllocator<'a> {
    fn new(
        plan: &Plan,
        client: &'a reqwest::Client,
        base: &str,
        internal_key: &'a str,
        index: u32,
    ) -> Self {
        Self {
            client,
            internal_key,
            allocate_url: format!("{base}/api/internal/allocate-key"),
            release_url: format!("{base}/api/internal/release-key"),
            body: {
                let mut body = json!({"provider": PROVIDER, "pool": plan.pool.as_str(),
                                      "model": MODEL, "lease_seconds": plan.lease_seconds,
                                      "holder": format!("bench-{index}")});
                if plan.affinity {
                    body["affinity_key"] = json!(format!("bench-{index}"));
                }
                body
            },
            lease: None,
        }
    }

    fn post(&self, url: &str, body: &serde_json::Value) -> reqwest::RequestBuilder {
        self.client
            .post(url)
            .header("x-internal-key", self.internal_key)
            .json(body)
    }
}

impl Allocator for HttpAllocator<'_> {
    async fn allocate(&mut self, plan: &Plan) -> Claimed {
        if plan.request_ids {
            self.body["request_id"] = json!(hex::encode(rand::random::<[u8; 16]>()));
        }
        match self.post(&self.allocate_url, &self.body).send().await {
            Ok(response) => match response.status() {
                StatusCode::OK => match response.json::<serde_json::Value>().await {
                    Ok(lease) => {
                        self.lease = Some(lease);
                        Claimed::Leased
                    }
                    Err(_) => Claimed::Failed,
                },
                StatusCode::TOO_MANY_REQUESTS => Claimed::Exhausted,
                _ => Claimed::Failed,
            },
            Err(_) => Claimed::Failed,
        }
    }

    async fn release(&mut self, _plan: &Plan) -> bool {
        let Some(lease) = self.lease.take() else {
            return false;
        };
        let body = json!({"provider": lease["provider"], "pool": lease["pool"],
                          "key_id": lease["key_id"], "lease_id": lease["lease_id"],
                          "outcome": "success"});
        match self.post(&self.release_url, &body).send().await {
            Ok(response) if response.status() == StatusCode::OK => response
                .json::<serde_json::Value>()
                .await
                .is_ok_and(|body| body["released"] == json!(true)),
            _ => false,
        }
    }
}

/// credpool's own claim and release statements, one request at a time on one connection.
struct UnbatchedAllocator {
    conn: PgConnection,
    provider: ProviderName,
    model: ModelName,
    holder: Holder,
    policy: HealthPolicy,
    lease: Option<GrantedLease>,
}

impl UnbatchedAllocator {
    async fn connect(options: &PgConnectOptions, index: u32) -> Result<Self, sqlx::Error> {
        Ok(Self {
            conn: options.connect().await?,
            provider: ProviderName::parse(PROVIDER).expect("valid provider"),
            model: ModelName::parse(MODEL).expect("valid model"),
            holder: Holder::parse(format!("bench-unbatched-{index}")).expect("valid holder"),
            policy: HealthPolicy::default(),
            lease: None,
        })
    }
}

impl Allocator for UnbatchedAllocator {
    async fn allocate(&mut self, plan: &Plan) -> Claimed {
        let ranked: Vec<KeyId> = plan.window(UNBATCHED_CANDIDATES).cloned().collect();
        let lease_seconds =
            LeaseSeconds::parse(u64::from(plan.lease_seconds), u32::MAX).expect("at least 1 s");
        let claim = Claim {
            holder: Some(self.holder.clone()),
            windowed: Some(false),
            ..Claim::new(
                ranked,
                self.provider.clone(),
                plan.pool.clone(),
                self.model.clone(),
                lease_seconds,
            )
        };
        match leases::claim_slot(&mut self.conn, &claim).await {
            Ok(answer) => match answer.outcome.into_lease() {
                Some(granted) => {
                    self.lease = Some(granted);
                    Claimed::Leased
                }
                None => Claimed::Exhausted,
            },
            Err(error) => {
                tracing::debug!(error = %error, "unbatched baseline claim failed");
                Claimed::Failed
            }
        }
    }

    async fn release(&mut self, plan: &Plan) -> bool {
        let Some(granted) = self.lease.take() else {
            return false;
        };
        let release = ReleaseRequest {
            lease: LeaseRef {
                key_id: granted.key_id,
                provider: self.provider.clone(),
                pool: plan.pool.clone(),
                lease_id: granted.lease_id,
                fence: None,
            },
            outcome: Some(Outcome::Success),
            retry_after_seconds: None,
            usage_tokens: None,
            caller: None,
            may_disable: true,
        };
        let released =
            leases::release_on(&mut Conn::direct(&mut self.conn), &release, &self.policy).await;
        released.is_ok_and(|r| r.released.is_ok())
    }
}

/// This process's peak resident set, MB (Linux; `None` elsewhere).
fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// credpool against one baseline, in the same run.
#[derive(Debug, Clone, serde::Serialize)]
struct Ratio {
    baseline: &'static str,
    /// credpool's cycles/s over the baseline's.
    cycles: f64,
    /// credpool's allocate p50 over the baseline's.
    allocate_p50: f64,
}

fn print_report(
    args: &BenchArgs,
    reports: &[ModeReport],
    source: &server_time::Source,
    oversold: i64,
    rss_peak_mb: Option<f64>,
) {
    let mut table = crate::operator::table(&[
        "allocator",
        "cycles/s",
        "allocate p50/p90/p99/max ms",
        "release p50/p90/p99/max ms",
        "429",
        "errors",
        "CPU µs/cycle: service / PostgreSQL / Redis / generator",
    ]);
    let fmt =
        |p: &Percentiles| format!("{:.2} / {:.2} / {:.2} / {:.1}", p.p50, p.p90, p.p99, p.max);
    for report in reports {
        table.add_row([
            report.mode.to_owned(),
            format!("{:.0}", report.cycles_per_second),
            fmt(&report.allocate_ms),
            fmt(&report.release_ms),
            report.exhausted.to_string(),
            report.errors.to_string(),
            report.cpu.map_or_else(
                || "-".to_owned(),
                |c| {
                    let service = match (report.mode, c.service_us) {
                        ("credpool" | "credpool-untenanted", Some(us)) => format!("{us:.0}"),
                        ("credpool" | "credpool-untenanted", None) => "(in generator)".to_owned(),
                        _ => "-".to_owned(),
                    };
                    format!(
                        "{service} / {:.0} / {:.0} / {:.0}",
                        c.postgres_us, c.redis_us, c.generator_us
                    )
                },
            ),
        ]);
    }
    let hot = if args.hot_spot == 0 {
        String::new()
    } else {
        format!(", hot spot: all want the same {}", args.hot_spot)
    };
    println!(
        "{}{hot}, hold {} ms, {} audit rows added",
        run_shape(args, ""),
        args.hold_ms,
        args.audit_rows
    );
    println!("{table}");
    let mut ratios = Vec::new();
    if let Some((credpool, baselines)) = reports.split_last() {
        for baseline in baselines {
            if baseline.cycles_per_second > 0.0 && baseline.allocate_ms.p50 > 0.0 {
                let ratio = Ratio {
                    baseline: baseline.mode,
                    cycles: credpool.cycles_per_second / baseline.cycles_per_second,
                    allocate_p50: credpool.allocate_ms.p50 / baseline.allocate_ms.p50,
                };
                println!(
                    "credpool / {}: {:.2}x the cycles/s, {:.2}x the allocate p50",
                    ratio.baseline, ratio.cycles, ratio.allocate_p50
                );
                ratios.push(ratio);
            }
        }
    }
    print_server_time(reports, source);
    print_oversell_check(
        oversold,
        "this run's credentials; the sql and redis baselines keep no trail",
    );
    if let Some(mb) = rss_peak_mb {
        let what = if args.url.is_some() {
            "this load generator"
        } else {
            "this process (service and load generator)"
        };
        println!("peak RSS of {what}: {mb:.0} MB");
    }
    let line = json!({
        "executors": args.executors,
        "duration_seconds": args.duration_seconds,
        "credentials": args.credentials,
        "limit": args.limit,
        "hot_spot": args.hot_spot,
        "hold_ms": args.hold_ms,
        "audit_rows": args.audit_rows,
        "results": reports,
        "ratios": ratios,
        "server_time_source": source.describe(),
        "grants_over_limit": oversold,
        "rss_peak_mb": rss_peak_mb,
        "in_process": args.url.is_none(),
    });
    println!("{line}");
}

/// The server-time part of the report: per claim and per release, then the statements.
fn print_server_time(reports: &[ModeReport], source: &server_time::Source) {
    println!("server time: {}", source.describe());
    if let server_time::Source::Unavailable(_) = source
        && reports
            .iter()
            .any(|r| matches!(r.mode, "sql" | "unbatched"))
    {
        println!(
            "  instead, client-observed: each allocate and each release of the sql baseline above \
             is one statement in one round trip on its own loopback connection (an upper bound on \
             its server time); unbatched's allocate and release are one statement each"
        );
    }
    let measured: Vec<&ModeReport> = reports.iter().filter(|r| r.server_time.is_some()).collect();
    if measured.is_empty() {
        return;
    }
    let mut operations = crate::operator::table(&[
        "allocator",
        "source",
        "claim ms",
        "release ms",
        "all statements per cycle ms",
    ]);
    let mut statements = crate::operator::table(&[
        "allocator",
        "operation",
        "statement",
        "calls",
        "rows",
        "ms per call",
    ]);
    for report in &measured {
        let time = report.server_time.as_ref().expect("filtered");
        let of = |operation: &str| {
            time.operations
                .iter()
                .find(|o| o.operation == operation)
                .map_or("-".to_owned(), |o| {
                    format!("{:.3} (of {})", o.ms_per_operation, o.count)
                })
        };
        operations.add_row([
            report.mode.to_owned(),
            time.source.to_owned(),
            of("claim"),
            of("release"),
            time.ms_per_cycle
                .map_or("-".to_owned(), |ms| format!("{ms:.3}")),
        ]);
        for statement in &time.statements {
            statements.add_row([
                report.mode.to_owned(),
                statement.operation.to_owned(),
                statement.statement.clone(),
                statement.calls.to_string(),
                statement.rows.map_or("-".to_owned(), |r| r.to_string()),
                format!("{:.3}", statement.ms_per_call),
            ]);
        }
    }
    println!(
        "  mean server time per operation over each whole mode (warm-up included); \
         pg_stat_statements: execution of top-level statements, planning only with \
         pg_stat_statements.track_planning, never the commit's WAL flush; redis: EVALSHA's \
         time in the server, both scripts"
    );
    println!("{operations}");
    println!("{statements}");
}

/// The report's line on the oversell check of the audit trail over `what` (its credentials).
pub(crate) fn print_oversell_check(oversold: i64, what: &str) {
    println!(
        "oversell check (audit trail, {what}): {}",
        if oversold == 0 {
            "no grant exceeded a limit".to_owned()
        } else {
            format!("{oversold} grants exceeded a limit")
        }
    );
}

/// The report's opening words on what was run: `"16 executors, 10 s measured after 2 s warm-up
/// {per}, 200 credentials of limit 4"`.
pub(crate) fn run_shape(args: &BenchArgs, per: &str) -> String {
    format!(
        "{} executors, {} s measured after {} s warm-up{per}, {} credentials of limit {}",
        args.executors, args.duration_seconds, args.warmup_seconds, args.credentials, args.limit,
    )
}
