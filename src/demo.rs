//! `credpool demo`: the service in-process on a free port, a demo pool of 20 credentials, and a
//! fleet of simulated executors driving it over real HTTP — allocating, holding for a random
//! time (some calls outlive the lease and renew; a few executors "crash" and never release),
//! reporting outcomes and releasing. The summary's per-credential peak is computed in SQL from the
//! audit trail; the command exits non-zero if any peak exceeds its credential's limit.
//!
//! The demo credentials live under the provider `demo` with key ids `demo-*`, so running the demo
//! against a real database never mixes with real credentials.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use credpool_client::{Client, Error, LeaseGuard, LeaseRequest, Outcome};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::json;

use crate::config::DemoArgs;
use crate::local::LocalService;
use credpool::database::Database;
use credpool::store::audit;

const PROVIDER: &str = "demo";
const MODELS: [&str; 3] = ["gpt-4o", "gpt-4o-mini", "o3-mini"];

/// The demo pool: 14 `default` and 6 `vip` credentials, limits 1 to 4, serving overlapping models.
fn demo_credentials() -> Vec<(String, &'static str, u32, Vec<&'static str>)> {
    (0..20)
        .map(|i| {
            let pool = if i < 14 { "default" } else { "vip" };
            let limit = (i % 4) + 1;
            let models = match i % 3 {
                0 => vec![MODELS[0], MODELS[1]],
                1 => vec![MODELS[0], MODELS[2]],
                _ => MODELS.to_vec(),
            };
            (format!("demo-{pool}-{i:02}"), pool, limit, models)
        })
        .collect()
}

#[derive(Debug, Default)]
struct Stats {
    granted: u64,
    served_by_pool: BTreeMap<String, u64>,
    exhausted: u64,
    /// error code (or `transport`) -> count
    errors: BTreeMap<String, u64>,
    /// (outcome reported, what release answered) -> count
    released: BTreeMap<(&'static str, String), u64>,
    renew_lost: u64,
    crashed: u64,
}

/// The simulated executors, each using the client crate (`credpool-client`) as a real executor
/// would: the lease guard renews long calls, reports the outcome on `finish`, and a "crash" is
/// an abandoned guard.
struct Fleet {
    client: Client,
    lease_seconds: u32,
    deadline: Instant,
    stats: Mutex<Stats>,
}

impl Fleet {
    fn stats(&self) -> std::sync::MutexGuard<'_, Stats> {
        self.stats
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// One executor: lease (waiting up to half a second for a slot), "call upstream", report,
    /// repeat until the deadline.
    async fn executor(self: Arc<Self>, index: usize) {
        let mut rng = StdRng::seed_from_u64(rand::random());
        let holder = format!("demo-executor-{index:02}");
        while Instant::now() < self.deadline {
            let pool = if rng.random_bool(0.25) {
                "vip"
            } else {
                "default"
            };
            let model = MODELS[rng.random_range(0..MODELS.len())];
            let request = LeaseRequest::new(PROVIDER, model)
                .pool(pool)
                .lease_seconds(self.lease_seconds)
                .holder(holder.clone())
                .wait(Duration::from_millis(rng.random_range(0..500)));
            match self.client.lease(request).await {
                Ok(lease) => {
                    {
                        let mut stats = self.stats();
                        stats.granted += 1;
                        *stats
                            .served_by_pool
                            .entry(lease.pool().to_owned())
                            .or_default() += 1;
                    }
                    self.use_lease(lease, &mut rng).await;
                }
                Err(Error::PoolExhausted { .. }) => {
                    self.stats().exhausted += 1;
                    // back off, but not for the whole Retry-After: the demo wants traffic
                    tokio::time::sleep(Duration::from_millis(rng.random_range(20..120))).await;
                }
                Err(other) => {
                    let kind = other.code().unwrap_or("transport").to_owned();
                    *self.stats().errors.entry(kind).or_default() += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    async fn use_lease(&self, lease: LeaseGuard, rng: &mut StdRng) {
        let roll: f64 = rng.random();
        if roll < 0.03 {
            // crashed: never releases; the slot frees at lease_until
            self.stats().crashed += 1;
            lease.abandon();
            tokio::time::sleep(Duration::from_millis(rng.random_range(50..500))).await;
            return;
        }
        // most calls are short; some outlive the lease, and the guard renews them
        let lease_ms = u64::from(self.lease_seconds) * 1000;
        let call_ms = if roll < 0.13 {
            rng.random_range(lease_ms * 3 / 2..lease_ms * 5 / 2)
        } else {
            rng.random_range(20..400)
        };
        let (outcome, label) = tokio::select! {
            () = lease.lost() => {
                // lease lost: stop using the credential at once
                self.stats().renew_lost += 1;
                (Outcome::Failure, "failure")
            }
            () = tokio::time::sleep(Duration::from_millis(call_ms)) => match rng.random_range(0..100) {
                0..85 => (Outcome::Success, "success"),
                85..93 => (Outcome::Failure, "failure"),
                // the provider's Retry-After, passed on: the credential rests, then recovers
                // through a probe lease within the run
                _ => (
                    Outcome::RateLimited {
                        retry_after: Some(Duration::from_secs(rng.random_range(1..=4))),
                    },
                    "rate_limited",
                ),
            },
        };
        let result = match lease.finish(outcome).await {
            Ok(released) if released.released => "released".to_owned(),
            Ok(released) => format!("not released ({:?})", released.reason),
            Err(error) => format!("error ({})", error.code().unwrap_or("transport")),
        };
        *self.stats().released.entry((label, result)).or_default() += 1;
    }
}

/// Runs the demo; the exit code is non-zero when any credential's peak exceeded its limit.
pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    credpool::startup::check_secret_config(&args.local.secrets, &args.local.db)?;
    let database = Database::open(&args.local.db).await?;
    let result = run_on(&args, &database).await;
    database.close().await;
    result
}

async fn run_on(args: &DemoArgs, database: &Database) -> anyhow::Result<ExitCode> {
    let keyring = credpool::startup::prepare_keyring(&args.local.secrets, database).await?;
    let service = LocalService::start(database, keyring, &args.local.service).await?;
    let (base, admin_key) = (&service.base, &service.admin_key);

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let credentials = demo_credentials();
    for (key_id, pool, limit, models) in &credentials {
        let response = client
            .put(format!("{base}/api/admin/keys/{key_id}"))
            .header("x-admin-key", admin_key)
            .json(&json!({"provider": PROVIDER, "pool": pool, "models": models, "max_concurrent_uses": limit,
                          "status": "available", "secret": {"api_key": format!("sk-demo-{}", hex::encode(rand::random::<[u8; 8]>()))}}))
            .send()
            .await?;
        anyhow::ensure!(
            response.status().is_success(),
            "loading {key_id}: HTTP {}",
            response.status()
        );
    }
    println!(
        "credpool demo: {} executors for {} s on {} credentials (limits 1-4, pools default and vip), lease {} s, service at {base}",
        args.executors,
        args.duration_seconds,
        credentials.len(),
        args.lease_seconds
    );

    let since = audit::now(&database.pool).await?;
    let fleet = Arc::new(Fleet {
        client: Client::new(base.clone(), service.internal_key.clone())?,
        lease_seconds: args.lease_seconds.max(1),
        deadline: Instant::now() + Duration::from_secs(args.duration_seconds),
        stats: Mutex::new(Stats::default()),
    });
    let tasks: Vec<_> = (0..args.executors)
        .map(|i| tokio::spawn(fleet.clone().executor(i as usize)))
        .collect();
    for task in tasks {
        task.await?;
    }
    service.stop().await?;

    // let crashed executors' leases run out, so that the trail's view of them is final
    tokio::time::sleep(Duration::from_millis(
        u64::from(args.lease_seconds) * 1000 + 200,
    ))
    .await;
    let until = audit::now(&database.pool).await?;
    let key_ids: Vec<String> = credentials.iter().map(|c| c.0.clone()).collect();
    let mut work = database.pool.work().await?;
    let proof: std::collections::HashMap<String, audit::OversellRow> =
        audit::oversell_check(&mut *work, since, until)
            .await?
            .into_iter()
            .map(|row| (row.key_id.clone(), row))
            .collect();
    let expired = audit::expired_without_release(&mut *work, since, until, &key_ids).await?;
    let renewals = audit::renewals(&mut *work, since, until, &key_ids).await?;
    work.done().await?;

    let stats = fleet.stats();
    let line = |label: &str, n: u64| println!("{label:<42} {n:>8}");
    println!();
    line("leases granted", stats.granted);
    for (pool, n) in &stats.served_by_pool {
        line(&format!("  served by pool {pool}"), *n);
    }
    line("429 pool_exhausted (after waiting)", stats.exhausted);
    for (kind, n) in &stats.errors {
        line(&format!("errors: {kind}"), *n);
    }
    for ((outcome, result), n) in &stats.released {
        line(&format!("release with outcome {outcome}: {result}"), *n);
    }
    line("renewals (from the audit trail)", renewals as u64);
    line(
        "renewals lost (410; the executor stopped)",
        stats.renew_lost,
    );
    line("executor crashes (never released)", stats.crashed);
    line("expired leases (from the audit trail)", expired as u64);
    println!();
    println!(
        "{:<20} {:<8} {:>6} {:>8} {:>5}",
        "credential", "pool", "limit", "leases", "peak"
    );
    let mut exceeded = Vec::new();
    for (key_id, pool, limit, _) in &credentials {
        let (leases, peak, over) = proof
            .get(key_id)
            .map_or((0, 0, 0), |r| (r.leases, r.peak, r.grants_over_limit));
        let flag = if over > 0 || peak > i64::from(*limit) {
            exceeded.push(key_id.clone());
            "  LIMIT EXCEEDED"
        } else {
            ""
        };
        println!("{key_id:<20} {pool:<8} {limit:>6} {leases:>8} {peak:>5}{flag}");
    }
    println!();
    if exceeded.is_empty() {
        println!(
            "every credential's peak concurrent leases (from the audit trail) stayed within its limit"
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!("LIMIT EXCEEDED on {}", exceeded.join(", "));
        Ok(ExitCode::FAILURE)
    }
}
