//! Scenario 9: the soak. A fleet runs against one `credpool serve` process — allocate, hold, renew,
//! sometimes crash without a release, release with mixed outcomes (some `failure`, some
//! `rate_limited`, so credentials cool down and recover on their own) — then the checks: the
//! oversell proof passes, the trail and the slots agree, once the reaper has run no slot is held by
//! an expired lease, the service's memory is flat, and nothing failed but what was meant to.
//!
//! CI runs the bounded version (30 seconds). The 30-minute soak is its own command:
//! `CREDPOOL_SOAK_SECONDS=1800 DATABASE_URL=postgres://... cargo test --release --test reliability
//! soak_long -- --ignored --nocapture` (docs/reliability.md).

use std::time::Duration;

use credpool_test_support::fleet::{self, Fleet, Plan, Replicas};
use credpool_test_support::*;

use crate::BIN;

/// The reaper's interval in the soaked service, in seconds.
const REAPER_SECONDS: u64 = 5;

async fn soak(duration: Duration) {
    let _turn = race_turn().await;
    let database = TestDatabase::create().await;
    let mut env = keyed_env(&database);
    // a pool of 32 for the soak's executors (keyed_env's 8 is sized for functional tests)
    for (name, value) in env.iter_mut() {
        if *name == "CREDPOOL_DB_MAX_CONNECTIONS" {
            *value = "32".to_owned();
        }
    }
    env.push((
        "CREDPOOL_MAINTENANCE_INTERVAL_SECONDS",
        REAPER_SECONDS.to_string(),
    ));
    let service = ServeProcess::start(BIN, &env, &[]).await;
    let pid = service.child.id().expect("service pid");
    let http = client();
    let limits = fleet::put_credentials(&http, &service.base, "soak", &[1, 2, 3], 6).await;
    let plan = Plan {
        hold_ms: 5..=200,
        lease_seconds: 3,
        renew_percent: 20,
        crash_percent: 3,
        failure_percent: 3,
        rate_limited_percent: 1,
        ..Plan::quick("soak", 32, duration)
    };
    let fleet = Fleet::start(plan, Replicas::new(vec![service.base.clone()]), limits);

    // RSS samples every twentieth of the run; "start" is the first one after a tenth of the run
    // (connections opened, views loaded, allocator warmed up).
    let step = duration / 20;
    let mut samples = Vec::new();
    for _ in 0..20 {
        tokio::time::sleep(step).await;
        samples.push(fleet::rss_kib(pid));
    }
    let report = fleet.finish().await;
    let start = samples[1];
    let end = *samples.last().unwrap();
    let peak = *samples.iter().max().unwrap();
    println!(
        "soak {} s: {report:?}\nservice RSS KiB: start {start}, end {end}, peak {peak}, samples {samples:?}",
        duration.as_secs()
    );

    assert_eq!(report.error_count, 0, "errors: {:?}", report.errors);
    assert_eq!(report.unreachable, 0, "the service stopped answering");
    assert!(
        report.oversold.is_empty(),
        "oversold: {:?}",
        report.oversold
    );
    assert!(
        report.crashes > 0 && report.renewals > 0 && report.releases > 0,
        "{report:?}"
    );
    // flat: no growth beyond half the starting set plus 16 MiB of allocator slack
    assert!(
        end <= start + start / 2 + 16 * 1024,
        "service memory grew from {start} KiB to {end} KiB"
    );

    // The crashed executors' leases end by themselves; once the reaper has run after the last
    // lease_until, no slot is held by an expired lease.
    tokio::time::sleep(Duration::from_secs(3 + 2 * REAPER_SECONDS)).await;
    let db = database.pool(2).await;
    let stale: i64 = db
        .scalar(
            "SELECT count(*) FROM lease_slots WHERE lease_id IS NOT NULL AND lease_until <= now()",
        )
        .await;
    assert_eq!(
        stale, 0,
        "slots still held by expired leases after the reaper ran"
    );
    let reaped: i64 = db
        .scalar("SELECT count(*) FROM lease_events WHERE event = 'expired'")
        .await;
    assert!(
        reaped > 0,
        "crashed executors' leases never ended as expired in the trail"
    );
    audit_passes(BIN, &database).await;
    let broken = fleet::trail_inconsistencies(&db).await;
    assert!(broken.is_empty(), "trail and slots disagree: {broken:?}");
    assert!(service.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_bounded() {
    soak(Duration::from_secs(30)).await;
}

/// The long soak: `CREDPOOL_SOAK_SECONDS` (default 1800).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "30 minutes; run by its command (docs/reliability.md)"]
async fn soak_long() {
    let seconds = env_number("CREDPOOL_SOAK_SECONDS", 1800);
    soak(Duration::from_secs(seconds)).await;
}
