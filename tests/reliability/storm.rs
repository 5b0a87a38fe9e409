//! Scenario 10: a rate-limit storm. 64 executors over 400 credentials in two pools (`pa`, `pb`,
//! limit 4); half of the releases report `rate_limited` with a one-second retry-after, so release
//! groups keep changing the health of credentials in both pools at once, interleaved. Before the
//! lease state was defined once, the pool-version rows those changes bump were locked in opposite
//! orders and PostgreSQL reported deadlocks, each answering a whole release group with 503.
//! Asserts: no deadlock, no 5xx, grants in both pools, the oversell proof.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::RngExt;
use reqwest::StatusCode;
use serde_json::{Value, json};

use credpool_test_support::*;

use crate::BIN;

const EXECUTORS: usize = 64;
const CREDENTIALS_PER_POOL: usize = 200;

fn storm_seconds() -> u64 {
    env_number("CREDPOOL_STORM_SECONDS", 30)
}

#[derive(Default)]
struct Tally {
    granted: AtomicU64,
    busy: AtomicU64,
    server_errors: AtomicU64,
    rate_limited_reports: AtomicU64,
}

#[tokio::test]
async fn a_rate_limit_storm_across_two_pools_deadlocks_nothing_and_answers_no_5xx() {
    let app = Arc::new(TestApp::spawn_with(AppOptions::connections(32)).await);
    for pool in ["pa", "pb"] {
        for i in 0..CREDENTIALS_PER_POOL {
            app.put_gpt4o_key(&format!("{pool}-{i:03}"), pool, 4).await;
        }
    }
    let deadlocks_before: i64 = app
        .scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .await;

    let tally = Arc::new(Tally::default());
    let deadline = Instant::now() + Duration::from_secs(storm_seconds());
    let executors: Vec<_> = (0..EXECUTORS)
        .map(|i| {
            let (app, tally) = (app.clone(), tally.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let pool = if rand::rng().random_bool(0.5) {
                        "pa"
                    } else {
                        "pb"
                    };
                    let response = app
                        .allocate(
                            json!({"provider": "openai", "model": "gpt-4o", "pool": pool,
                                         "lease_seconds": 30, "holder": format!("storm-{i}")}),
                        )
                        .await;
                    match response.status() {
                        StatusCode::OK => {}
                        StatusCode::TOO_MANY_REQUESTS => {
                            tally.busy.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        }
                        status if status.is_server_error() => {
                            tally.server_errors.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        other => panic!("allocate answered {other}"),
                    }
                    tally.granted.fetch_add(1, Ordering::Relaxed);
                    let lease: Value = response.json().await.unwrap();
                    let mut body = release_body(&lease, "success");
                    if rand::rng().random_bool(0.5) {
                        body["outcome"] = json!("rate_limited");
                        body["retry_after_seconds"] = json!(1);
                        tally.rate_limited_reports.fetch_add(1, Ordering::Relaxed);
                    }
                    let release = app.release(body).await;
                    if release.status().is_server_error() {
                        tally.server_errors.fetch_add(1, Ordering::Relaxed);
                    } else {
                        assert_eq!(release.status(), StatusCode::OK);
                    }
                }
            })
        })
        .collect();
    for executor in executors {
        executor.await.unwrap();
    }
    let mut app = Arc::try_unwrap(app).ok().expect("executors are done");
    // the app's connections close, so their backends report their statistics
    app.stop();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let deadlocks_after: i64 = app
        .scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .await;
    let granted = tally.granted.load(Ordering::Relaxed);
    println!(
        "storm: {granted} leases, {} rate_limited reports, {} 429s, {} 5xx, {} deadlocks",
        tally.rate_limited_reports.load(Ordering::Relaxed),
        tally.busy.load(Ordering::Relaxed),
        tally.server_errors.load(Ordering::Relaxed),
        deadlocks_after - deadlocks_before
    );
    assert_eq!(
        deadlocks_after, deadlocks_before,
        "PostgreSQL detected deadlocks"
    );
    assert_eq!(
        tally.server_errors.load(Ordering::Relaxed),
        0,
        "5xx answers"
    );
    assert!(granted > 1000, "only {granted} leases in the storm");
    let cooled: i64 = app.scalar("SELECT count(DISTINCT key_id) FROM credential_events WHERE new_status = 'rate_limited'").await;
    assert!(cooled > 100, "only {cooled} credentials rested: no storm");
    audit_passes(BIN, &app.database).await;
}
