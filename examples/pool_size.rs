//! Benchmark (not a test): allocate latency against pool size and against the size of the audit
//! trail, to show that the cost of an allocation grows with neither (the candidate view is read
//! once, not per request; the claim statement gets only the top few candidates; the trail is only
//! appended to, through indexes).
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo run --release --example pool_size -- 100 10000
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo run --release --example pool_size -- 100 100+5000000
//! ```
//!
//! Each argument is a pool size, optionally `+` a number of audit rows to load first (leases
//! granted and released over the last 29 days). For each it creates a fresh database on the
//! server of `DATABASE_URL`, loads that many limit-4 credentials, serves the real app in-process,
//! warms up, then runs sequential allocate + release cycles over HTTP from one client and reports
//! allocate latency percentiles. The targets are measured in alternating rounds so that drift of
//! the machine affects all alike. The first target is the baseline of the ratio column.

use std::str::FromStr;
use std::time::{Duration, Instant};

use credpool::config::ServiceSettings;
use credpool::http::ApiKeys;
use credpool::secrets::{Keyring, MasterKey};
use credpool::startup::Application;
use credpool::store::credentials::{self, Actor};
use credpool::store::{self, PoolSettings};
use serde_json::json;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};
use std::sync::Arc;

const ROUNDS: usize = 5;
const CYCLES_PER_ROUND: usize = 400;
const WARMUP: usize = 200;

struct Target {
    label: String,
    database: String,
    base: String,
    client: reqwest::Client,
    samples: Vec<Duration>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn prepare(
    admin: &PgConnectOptions,
    size: usize,
    audit_rows: usize,
) -> anyhow::Result<Target> {
    let name = format!(
        "credpool_bench_{size}_{}",
        hex::encode(rand::random::<[u8; 4]>())
    );
    let mut conn = admin.connect().await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut conn)
        .await?;
    conn.close().await?;
    let options = admin.clone().database(&name);
    let pool = store::connect_lazy(
        options,
        &PoolSettings {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(10),
        },
    );
    store::migrate(&pool).await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO credentials (key_id, provider, pool, models, max_concurrent_uses, secret)
         SELECT 'bench-' || g, 'openai', 'default', ARRAY['gpt-4o'], 4, '{{\"api_key\": \"sk-bench\"}}'
         FROM generate_series(1, {size}) g;
         INSERT INTO lease_slots (key_id, slot)
         SELECT key_id, s FROM credentials, generate_series(0, 3) s;
         ANALYZE;"
    )))
    .execute(&pool)
    .await?;
    if audit_rows > 0 {
        // half granted, half released: leases of 1 to 60 s spread over the last 29 days
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, holder, outcome, lease_until, at)
             SELECT CASE WHEN g % 2 = 0 THEN 'granted' ELSE 'released' END,
                    md5((g / 2)::text)::uuid,
                    'bench-' || (1 + (g / 2) % {size}), 'openai', 'default', 0, 'history',
                    CASE WHEN g % 2 = 1 THEN 'success' END,
                    t + interval '60 seconds',
                    t + CASE WHEN g % 2 = 1 THEN ((g / 2) % 60 + 1) * interval '1 second' ELSE interval '0' END
             FROM generate_series(0, {audit_rows} - 1) g,
                  LATERAL (SELECT now() - interval '29 days' + (g / 2) * (interval '29 days' / ({audit_rows} / 2 + 1))) AS at(t);
             ANALYZE lease_events;"
        )))
        .execute(&pool)
        .await?;
    }
    // the rows above hold plaintext secrets: seal them, as `credpool serve` does at start-up
    let keyring = Arc::new(Keyring::new(MasterKey::generate(), vec![]));
    let actor = Actor::parse("bench").map_err(anyhow::Error::msg)?;
    credentials::reseal(&pool, &keyring, true, &actor).await?;
    let keys =
        ApiKeys::new("bench-internal".into(), "bench-admin".into()).map_err(anyhow::Error::msg)?;
    let settings = ServiceSettings::default();
    let app = Application::bind("127.0.0.1:0", pool, keys, keyring, &settings).await?;
    let base = format!("http://{}", app.local_addr()?);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(app.run_until(async {
        let _ = rx.await;
    }));
    let target = Target {
        label: if audit_rows > 0 {
            format!("{size}+{audit_rows}")
        } else {
            size.to_string()
        },
        database: name,
        base,
        client: reqwest::Client::new(),
        samples: Vec::new(),
        _stop: tx,
    };
    for _ in 0..WARMUP {
        cycle(&target).await?;
    }
    Ok(target)
}

/// One allocate + release; returns the allocate latency.
async fn cycle(target: &Target) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let response = target
        .client
        .post(format!("{}/api/internal/allocate-key", target.base))
        .header("x-internal-key", "bench-internal")
        .json(&json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 60}))
        .send()
        .await?;
    anyhow::ensure!(
        response.status().is_success(),
        "allocate: HTTP {}",
        response.status()
    );
    let lease: serde_json::Value = response.json().await?;
    let elapsed = started.elapsed();
    let release = json!({"provider": lease["provider"], "pool": lease["pool"], "key_id": lease["key_id"],
                         "lease_id": lease["lease_id"], "outcome": "success"});
    let response = target
        .client
        .post(format!("{}/api/internal/release-key", target.base))
        .header("x-internal-key", "bench-internal")
        .json(&release)
        .send()
        .await?;
    anyhow::ensure!(
        response.status().is_success(),
        "release: HTTP {}",
        response.status()
    );
    Ok(elapsed)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| anyhow::anyhow!("set DATABASE_URL to a PostgreSQL server"))?;
    let admin = PgConnectOptions::from_str(&url)?;
    let mut specs: Vec<(usize, usize)> = Vec::new();
    for arg in std::env::args().skip(1) {
        let (size, rows) = arg.split_once('+').unwrap_or((&arg, "0"));
        specs.push((size.parse()?, rows.parse()?));
    }
    if specs.is_empty() {
        specs = vec![(100, 0), (10_000, 0)];
    }

    let mut targets = Vec::new();
    for (size, audit_rows) in specs {
        targets.push(prepare(&admin, size, audit_rows).await?);
    }
    for _ in 0..ROUNDS {
        for target in &mut targets {
            for _ in 0..CYCLES_PER_ROUND {
                let latency = cycle(target).await?;
                target.samples.push(latency);
            }
        }
    }
    let baseline = {
        let mut s = targets[0].samples.clone();
        s.sort();
        percentile(&s, 0.5)
    };
    println!(
        "{:>14} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "target", "p50 µs", "p90 µs", "p99 µs", "mean µs", "p50 ratio"
    );
    for target in &targets {
        let mut s = target.samples.clone();
        s.sort();
        let mean = s.iter().sum::<Duration>() / s.len() as u32;
        println!(
            "{:>14} {:>10} {:>10} {:>10} {:>10} {:>8.3}",
            target.label,
            percentile(&s, 0.5).as_micros(),
            percentile(&s, 0.9).as_micros(),
            percentile(&s, 0.99).as_micros(),
            mean.as_micros(),
            percentile(&s, 0.5).as_secs_f64() / baseline.as_secs_f64()
        );
    }
    let databases: Vec<String> = targets.iter().map(|t| t.database.clone()).collect();
    drop(targets);
    let mut conn = admin.connect().await?;
    for name in databases {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .execute(&mut conn)
        .await?;
    }
    Ok(())
}
