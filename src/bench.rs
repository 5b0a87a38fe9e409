//! `credpool bench`: a load generator for sizing a deployment, and the side-by-side measurement
//! of credpool against the raw-SQL baseline on the same database in the same run.
//!
//! W simulated executors loop for D seconds (after an unmeasured warm-up): allocate, hold the
//! lease H milliseconds, release it with the outcome `success`. The credpool mode drives a
//! service over HTTP (one started in-process on the database, or a running one given with
//! `--url`). The `sql` baseline does the same cycles with the per-request claim and release
//! statements (the claim function `credpool_claim` with one claim, [`leases::release_on`])
//! straight on the database,
//! one connection per executor: what a naive design pays per lease, a durable commit for each
//! state change. Both run on one pool of bench credentials (provider `bench`, a fresh pool per
//! run, removed afterwards), so the ratio of the two is a property of the design, not of the
//! machine.
//!
//! After the run the oversell proof is computed from the audit trail (SQL function
//! `credpool_oversell_check`) over the run's credentials; the command exits non-zero if any grant
//! exceeded a limit or if there was any error.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use rand::RngExt;
use reqwest::StatusCode;
use serde_json::json;
use sqlx::ConnectOptions;
use sqlx::postgres::PgConnectOptions;

use crate::config::{BenchArgs, BenchBaseline};
use crate::database::Database;
use crate::domain::{
    Holder, KeyId, LeaseId, LeaseSeconds, ModelName, Outcome, PoolName, ProviderName, Secret,
    Status,
};
use crate::health::HealthPolicy;
use crate::http::ApiKeys;
use crate::startup::Application;
use crate::store::credentials::{self, Actor, CredentialSpec};
use crate::store::leases::{self, ClaimRequest, LeaseRef, ReleaseRequest};
use crate::store::{Conn, Db, audit};

const PROVIDER: &str = "bench";
/// The model every executor asks for (in hot-spot mode only the hot credentials serve it).
const MODEL: &str = "bench-model";
/// The model the rest of the pool serves in hot-spot mode.
const OTHER_MODEL: &str = "bench-other";
/// Candidates the baseline passes to each claim: a window of the serving credentials at a
/// random place (the claim takes the first with a free slot).
const BASELINE_CANDIDATES: usize = 16;

/// How one mode fared.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModeReport {
    /// `credpool` or `sql`.
    pub mode: &'static str,
    /// Completed allocate + release cycles per second.
    pub cycles_per_second: f64,
    /// Allocate latency, milliseconds.
    pub allocate_ms: Percentiles,
    /// Release latency, milliseconds.
    pub release_ms: Percentiles,
    /// Allocations answered "no capacity" (HTTP 429; for the baseline, a claim that found no
    /// free slot).
    pub exhausted: u64,
    /// Anything else that failed (other HTTP statuses, transport or database errors).
    pub errors: u64,
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
            exhausted: 0,
            errors: 0,
            allocate: histogram(),
            release: histogram(),
        }
    }

    fn merge(&mut self, other: &Tally) {
        self.cycles += other.cycles;
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
}

impl Window {
    fn starting_now(warmup: Duration, measured: Duration) -> Self {
        let measured_from = Instant::now() + warmup;
        Self {
            measured_from,
            until: measured_from + measured,
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
    /// Cycles completed in the current mode so far, for the progress bar.
    progress: AtomicU64,
}

/// Runs the benchmark; the exit code is non-zero on any error or oversell.
pub async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    crate::startup::check_secret_config(&args.secrets, &args.db)?;
    anyhow::ensure!(
        args.hot_spot <= args.credentials,
        "--hot-spot ({}) cannot exceed --credentials ({})",
        args.hot_spot,
        args.credentials
    );
    anyhow::ensure!(
        !(args.baseline == Some(BenchBaseline::Sql)
            && args.db.db_pooler == crate::config::DbPooler::Transaction),
        "--baseline sql runs single statements outside transactions, which a transaction pooler \
         cannot carry: run it with a DATABASE_URL that reaches PostgreSQL directly"
    );
    let database = Database::open(&args.db).await?;
    let result = run_on(&args, &database).await;
    database.close().await;
    result
}

async fn run_on(args: &BenchArgs, database: &Database) -> anyhow::Result<ExitCode> {
    let keyring = crate::startup::prepare_keyring(&args.secrets, database).await?;
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
            let internal_key = hex::encode(rand::random::<[u8; 16]>());
            let admin_key = hex::encode(rand::random::<[u8; 16]>());
            let keys = ApiKeys::new(internal_key.clone(), admin_key).map_err(anyhow::Error::msg)?;
            let app = Application::bind(
                "127.0.0.1:0",
                database.pool.clone(),
                keys,
                keyring.clone(),
                &args.service.settings(),
            )
            .await?;
            let base = format!("http://{}", app.local_addr()?);
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let handle = tokio::spawn(app.run_until(async {
                let _ = stopped.await;
            }));
            (base, internal_key, Some((stop, handle)))
        }
    };

    eprintln!(
        "credpool bench: loading {} credentials of limit {} into pool {PROVIDER}/{pool}",
        args.credentials, args.limit
    );
    let serving = load_credentials(args, &database.pool, &keyring, &pool, &actor, &run_id).await?;
    let key_ids: Vec<String> = all_key_ids(args, &run_id);
    // whatever happens from here on, the run's credentials are removed again
    let measured = async {
        if args.audit_rows > 0 {
            eprintln!("adding {} historical audit rows", args.audit_rows);
            load_history(&database.pool, &serving, args.audit_rows).await?;
        }
        let plan = Arc::new(Plan {
            pool,
            serving,
            lease_seconds: args.lease_seconds,
            hold: Duration::from_millis(args.hold_ms),
            request_ids: args.request_ids,
            progress: AtomicU64::new(0),
        });

        let since = audit::now(&database.pool).await?;
        let mut reports = Vec::new();
        if args.baseline == Some(BenchBaseline::Sql) {
            let options = (*database.pool.pool().connect_options()).clone();
            reports.push(run_mode(args, &plan, Mode::Sql(Box::new(options))).await?);
        }
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(args.executors as usize)
            .timeout(Duration::from_secs(30))
            .build()?;
        reports.push(
            run_mode(
                args,
                &plan,
                Mode::Http {
                    client,
                    base,
                    internal_key,
                },
            )
            .await?,
        );
        let until = audit::now(&database.pool).await?;

        if let Some((stop, handle)) = server {
            let _ = stop.send(());
            handle.await??;
        }
        // the proof reads the run's whole trail: more than a request's statement timeout
        let mut tx = without_statement_timeout(&database.pool).await?;
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
    let removed = remove_credentials(&database.pool, &key_ids, &actor).await;
    let (reports, oversold) = measured?;
    removed?;

    let rss_peak_mb = peak_rss_mb();
    print_report(args, &reports, oversold, rss_peak_mb);
    let errors: u64 = reports.iter().map(|r| r.errors).sum();
    Ok(if oversold == 0 && errors == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn all_key_ids(args: &BenchArgs, run_id: &str) -> Vec<String> {
    (0..args.credentials)
        .map(|i| format!("bench-{run_id}-{i:05}"))
        .collect()
}

/// Creates the run's credentials (in one transaction, sealed like any other); returns those
/// that serve [`MODEL`].
async fn load_credentials(
    args: &BenchArgs,
    db: &Db,
    keyring: &crate::secrets::Keyring,
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
        });
    }
    credentials::import(db, &specs, actor).await?;
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

enum Mode {
    Http {
        client: reqwest::Client,
        base: String,
        internal_key: String,
    },
    Sql(Box<PgConnectOptions>),
}

impl Mode {
    fn name(&self) -> &'static str {
        match self {
            Mode::Http { .. } => "credpool",
            Mode::Sql(_) => "sql",
        }
    }
}

async fn run_mode(args: &BenchArgs, plan: &Arc<Plan>, mode: Mode) -> anyhow::Result<ModeReport> {
    let name = mode.name();
    let mode = Arc::new(mode);
    let measured = Duration::from_secs(args.duration_seconds);
    let window = Window::starting_now(Duration::from_secs(args.warmup_seconds), measured);
    plan.progress.store(0, Ordering::Relaxed);
    let progress = progress_bar(name, args, plan, window);
    let tasks: Vec<_> = (0..args.executors)
        .map(|index| {
            let (plan, mode) = (plan.clone(), mode.clone());
            tokio::spawn(async move {
                match &*mode {
                    Mode::Http {
                        client,
                        base,
                        internal_key,
                    } => http_executor(&plan, client, base, internal_key, index, window).await,
                    Mode::Sql(options) => sql_executor(&plan, options, index, window).await,
                }
            })
        })
        .collect();
    let mut total = Tally::new();
    for task in tasks {
        total.merge(&task.await?);
    }
    progress.abort();
    Ok(ModeReport {
        mode: name,
        cycles_per_second: total.cycles as f64 / measured.as_secs_f64(),
        allocate_ms: Percentiles::of(&total.allocate),
        release_ms: Percentiles::of(&total.release),
        exhausted: total.exhausted,
        errors: total.errors,
    })
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

fn release_body(lease: &serde_json::Value) -> serde_json::Value {
    json!({"provider": lease["provider"], "pool": lease["pool"], "key_id": lease["key_id"],
           "lease_id": lease["lease_id"], "outcome": "success"})
}

/// One simulated executor over HTTP.
async fn http_executor(
    plan: &Plan,
    client: &reqwest::Client,
    base: &str,
    internal_key: &str,
    index: u32,
    window: Window,
) -> Tally {
    let mut tally = Tally::new();
    let allocate_url = format!("{base}/api/internal/allocate-key");
    let release_url = format!("{base}/api/internal/release-key");
    let mut body = json!({"provider": PROVIDER, "pool": plan.pool.as_str(), "model": MODEL,
                          "lease_seconds": plan.lease_seconds, "holder": format!("bench-{index}")});
    let post = |url: &str, body: &serde_json::Value| {
        client
            .post(url)
            .header("x-internal-key", internal_key)
            .json(body)
            .send()
    };
    loop {
        let started = Instant::now();
        if started >= window.until {
            return tally;
        }
        let measured = started >= window.measured_from;
        if plan.request_ids {
            body["request_id"] = json!(hex::encode(rand::random::<[u8; 16]>()));
        }
        let allocated = match post(&allocate_url, &body).await {
            Ok(response) => match response.status() {
                StatusCode::OK => response.json::<serde_json::Value>().await.ok(),
                StatusCode::TOO_MANY_REQUESTS => {
                    if measured {
                        Tally::record(&mut tally.allocate, started.elapsed());
                        tally.exhausted += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                _ => None,
            },
            Err(_) => None,
        };
        let Some(lease) = allocated else {
            if measured {
                tally.errors += 1;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        if measured {
            Tally::record(&mut tally.allocate, started.elapsed());
        }
        tokio::time::sleep(plan.hold).await;
        let releasing = Instant::now();
        let released = match post(&release_url, &release_body(&lease)).await {
            Ok(response) if response.status() == StatusCode::OK => response
                .json::<serde_json::Value>()
                .await
                .is_ok_and(|body| body["released"] == json!(true)),
            _ => false,
        };
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

/// One simulated executor doing the same cycles in raw SQL on its own connection.
async fn sql_executor(
    plan: &Plan,
    options: &PgConnectOptions,
    index: u32,
    window: Window,
) -> Tally {
    let mut tally = Tally::new();
    let mut conn = match options.connect().await {
        Ok(conn) => conn,
        Err(error) => {
            tracing::warn!(error = %error, "baseline executor could not connect");
            tally.errors += 1;
            return tally;
        }
    };
    let provider = ProviderName::parse(PROVIDER).expect("valid provider");
    let model = ModelName::parse(MODEL).expect("valid model");
    let holder = Holder::parse(format!("bench-sql-{index}")).expect("valid holder");
    let lease_seconds =
        LeaseSeconds::parse(u64::from(plan.lease_seconds), u32::MAX).expect("at least 1 s");
    let policy = HealthPolicy::default();
    let take = plan.serving.len().min(BASELINE_CANDIDATES);
    loop {
        let started = Instant::now();
        if started >= window.until {
            return tally;
        }
        let measured = started >= window.measured_from;
        let start = rand::rng().random_range(0..plan.serving.len());
        let ranked: Vec<KeyId> = plan
            .serving
            .iter()
            .cycle()
            .skip(start)
            .take(take)
            .cloned()
            .collect();
        let claim = ClaimRequest {
            ranked: &ranked,
            provider: &provider,
            pool: &plan.pool,
            model: &model,
            lease_id: LeaseId::generate(),
            holder: Some(&holder),
            lease_seconds,
            request: None,
        };
        let granted = match leases::claim_slot(&mut conn, &claim).await {
            Ok(result) => result.granted,
            Err(_) => {
                if measured {
                    tally.errors += 1;
                }
                continue;
            }
        };
        if measured {
            Tally::record(&mut tally.allocate, started.elapsed());
        }
        let Some(granted) = granted else {
            if measured {
                tally.exhausted += 1;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        tokio::time::sleep(plan.hold).await;
        let release = ReleaseRequest {
            lease: LeaseRef {
                key_id: granted.key_id,
                provider: provider.clone(),
                pool: plan.pool.clone(),
                lease_id: granted.lease_id,
                fence: None,
            },
            outcome: Some(Outcome::Success),
            retry_after_seconds: None,
        };
        let releasing = Instant::now();
        let released = leases::release_on(&mut Conn::direct(&mut conn), &release, &policy).await;
        if measured {
            Tally::record(&mut tally.release, releasing.elapsed());
            if released.is_ok_and(|r| r.released.is_ok()) {
                tally.cycles += 1;
                plan.progress.fetch_add(1, Ordering::Relaxed);
            } else {
                tally.errors += 1;
            }
        }
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

fn print_report(args: &BenchArgs, reports: &[ModeReport], oversold: i64, rss_peak_mb: Option<f64>) {
    let mut table = crate::cli::table(&[
        "mode",
        "cycles/s",
        "allocate p50/p90/p99/max ms",
        "release p50/p90/p99/max ms",
        "429",
        "errors",
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
        ]);
    }
    let hot = if args.hot_spot == 0 {
        String::new()
    } else {
        format!(", hot spot: all want the same {}", args.hot_spot)
    };
    println!(
        "{} executors, {} s measured after {} s warm-up, {} credentials of limit {}{hot}, hold {} ms, {} audit rows added",
        args.executors,
        args.duration_seconds,
        args.warmup_seconds,
        args.credentials,
        args.limit,
        args.hold_ms,
        args.audit_rows
    );
    println!("{table}");
    let ratio = match reports {
        [sql, credpool] if sql.cycles_per_second > 0.0 && sql.allocate_ms.p50 > 0.0 => {
            let throughput = credpool.cycles_per_second / sql.cycles_per_second;
            let latency = credpool.allocate_ms.p50 / sql.allocate_ms.p50;
            println!(
                "credpool / sql: {throughput:.2}x the cycles/s, {latency:.2}x the allocate p50"
            );
            Some((throughput, latency))
        }
        _ => None,
    };
    println!(
        "oversell check (audit trail, this run's credentials): {}",
        if oversold == 0 {
            "no grant exceeded a limit".to_owned()
        } else {
            format!("{oversold} grants exceeded a limit")
        }
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
        "ratio_cycles": ratio.map(|r| r.0),
        "ratio_allocate_p50": ratio.map(|r| r.1),
        "grants_over_limit": oversold,
        "rss_peak_mb": rss_peak_mb,
        "in_process": args.url.is_none(),
    });
    println!("{line}");
}
