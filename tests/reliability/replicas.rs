//! Scenarios 1 and 4: several `credpool serve` replicas on one database under a sustained fleet,
//! one of them restarted in the middle, and one killed with `kill -9` while it holds leases and
//! serves requests.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use credpool_test_support::fleet::{self, Fleet, Plan, Replicas};
use credpool_test_support::*;

use crate::BIN;

/// How long the bounded fleet runs, in seconds: `CREDPOOL_RELIABILITY_SECONDS`, default 20.
fn run_seconds() -> u64 {
    env_number("CREDPOOL_RELIABILITY_SECONDS", 20)
}

/// The replicas' environment: the keys, and few enough connections each that three replicas and
/// the test fit in the server's `max_connections`.
fn replica_env(database: &TestDatabase) -> Vec<(&'static str, String)> {
    let mut env = keyed_env(database);
    for (name, value) in &mut env {
        if *name == "CREDPOOL_DB_MAX_CONNECTIONS" {
            *value = "16".to_owned();
        }
    }
    env
}

async fn start_replicas(env: &[(&'static str, String)], n: usize) -> Vec<ServeProcess> {
    let mut replicas = Vec::new();
    for _ in 0..n {
        replicas.push(ServeProcess::start(BIN, env, &[]).await);
    }
    replicas
}

/// Asserts what every fleet run must show: no oversell seen by a client, no error, real traffic;
/// then that the trail proves the same on the database side and tells one consistent story.
async fn assert_clean_run(report: &fleet::Report, database: &TestDatabase) {
    println!("{report:?}");
    assert!(
        report.oversold.is_empty(),
        "oversold: {:?}",
        report.oversold
    );
    assert_eq!(report.error_count, 0, "errors: {:?}", report.errors);
    assert!(
        report.grants >= 100,
        "too little traffic to prove anything: {report:?}"
    );
    // more executors than slots: the limits were contended, not merely respected
    assert!(
        report.exhausted > 0,
        "no executor ever found the pool full: {report:?}"
    );
    audit_passes(BIN, database).await;
    let db = database.pool(2).await;
    let broken = fleet::trail_inconsistencies(&db).await;
    assert!(broken.is_empty(), "trail and slots disagree: {broken:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_under_a_sustained_fleet_never_oversell_even_when_one_restarts() {
    let _turn = race_turn().await;
    let database = TestDatabase::create().await;
    let env = replica_env(&database);
    let mut processes = start_replicas(&env, 3).await;
    let http = client();
    let limits = fleet::put_credentials(&http, &processes[0].base, "replicas", &[1, 2, 3], 4).await;
    let replicas = Replicas::new(processes.iter().map(|p| p.base.clone()).collect());
    let duration = Duration::from_secs(run_seconds());
    let fleet = Fleet::start(
        Plan::quick("replicas", 64, duration),
        replicas.clone(),
        limits,
    );

    // Midway, restart replica 0 the way a rolling deploy does: out of the balancer, a moment for
    // requests already routed to it, SIGTERM (it drains in-flight requests), a new process, back
    // in.
    tokio::time::sleep(duration / 2).await;
    let before_restart = fleet.grants();
    let old = processes.remove(0);
    replicas.remove(&old.base);
    // requests that picked it a moment ago still reach it; it drains those after SIGTERM
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        old.terminate().await.success(),
        "replica 0 did not stop cleanly"
    );
    let new = ServeProcess::start(BIN, &env, &[]).await;
    replicas.add(new.base.clone());
    processes.push(new);

    let report = fleet.finish().await;
    assert!(
        report.grants > before_restart,
        "no lease granted after the restart: {report:?}"
    );
    assert_eq!(
        report.unreachable, 0,
        "a planned restart must not drop requests"
    );
    assert_clean_run(&report, &database).await;
    // every executor released what it took: all slots are free again
    let db = database.pool(2).await;
    let held: i64 = db
        .scalar(
            "SELECT count(*) FROM lease_slots WHERE lease_id IS NOT NULL AND lease_until > now()",
        )
        .await;
    assert_eq!(held, 0, "slots still held after every lease was released");
}

fn rfc3339(value: &Value) -> time::OffsetDateTime {
    time::OffsetDateTime::parse(
        value.as_str().expect("a timestamp string"),
        &time::format_description::well_known::Rfc3339,
    )
    .expect("an RFC 3339 timestamp")
}

async fn allocate_on(http: &reqwest::Client, base: &str, pool: &str) -> reqwest::Response {
    post_json(
        http,
        &format!("{base}/api/internal/allocate-key"),
        ("x-internal-key", INTERNAL_KEY),
        json!({"provider": fleet::PROVIDER, "model": fleet::MODEL, "pool": pool,
               "lease_seconds": 5, "holder": "doomed-replica"}),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_killed_with_leases_outstanding_writes_nothing_half_and_its_leases_free_at_lease_until()
 {
    let _turn = race_turn().await;
    let database = TestDatabase::create().await;
    let env = replica_env(&database);
    let mut processes = start_replicas(&env, 3).await;
    let http = client();
    let doomed = processes.remove(0);
    fleet::put_credentials(&http, &doomed.base, "held", &[1], 4).await;

    // A fleet on all three replicas, the doomed one included.
    let limits = fleet::put_credentials(&http, &processes[0].base, "busy", &[1, 2, 3], 4).await;
    let mut bases = vec![doomed.base.clone()];
    bases.extend(processes.iter().map(|p| p.base.clone()));
    let replicas = Replicas::new(bases);
    let duration = Duration::from_secs(run_seconds().max(12));
    let fleet = Fleet::start(
        Plan {
            lease_seconds: 3,
            ..Plan::quick("busy", 48, duration)
        },
        replicas.clone(),
        limits,
    );
    tokio::time::sleep(duration / 3).await;

    // Leases the doomed replica grants and never gets to release (every limit-1 credential of
    // their own pool, 5-second leases), then kill -9 while the fleet's requests are in flight.
    let mut held: Vec<Value> = Vec::new();
    for _ in 0..4 {
        held.push(allocate_on(&http, &doomed.base, "held").ok_json().await);
    }
    let mut doomed = doomed;
    doomed.child.start_kill().expect("kill -9");
    doomed.child.wait().await.unwrap();
    let at_kill = fleet.grants();

    // Its leases still hold their slots, unchanged, and a survivor refuses the full pool.
    let survivor = processes[0].base.clone();
    let db = database.pool(2).await;
    for lease in &held {
        let lease_until: Option<time::OffsetDateTime> = sqlx::query_scalar(
            "SELECT lease_until FROM lease_slots WHERE lease_id = $1::text::uuid",
        )
        .bind(lease["lease_id"].as_str().unwrap())
        .fetch_optional(&db)
        .await
        .unwrap();
        assert_eq!(
            lease_until,
            Some(rfc3339(&lease["lease_until"])),
            "a lease of the killed replica lost its slot or changed: {lease}"
        );
    }
    allocate_on(&http, &survivor, "held")
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;

    let report = fleet.finish().await;
    // executors on the other replicas carried on
    assert!(
        report.grants > at_kill + 50,
        "the surviving replicas stopped granting after the kill: {report:?}"
    );
    println!(
        "requests in flight to the killed replica: {}",
        report.unreachable
    );

    // The leases free by themselves at lease_until (no reaper ran: the test's database has no
    // pg_cron and the survivors' in-process schedulers run every 60 seconds).
    let latest = held
        .iter()
        .map(|l| rfc3339(&l["lease_until"]))
        .max()
        .unwrap();
    let db_now: time::OffsetDateTime = db.scalar("SELECT now()").await;
    let wait = (latest - db_now).as_seconds_f64().max(0.0) + 0.2;
    tokio::time::sleep(Duration::from_secs_f64(wait)).await;
    let mut regranted = Vec::new();
    for _ in 0..4 {
        regranted.push(allocate_on(&http, &survivor, "held").ok_json().await);
    }
    let old: Vec<&str> = held.iter().map(|l| l["key_id"].as_str().unwrap()).collect();
    for lease in &regranted {
        assert!(old.contains(&lease["key_id"].as_str().unwrap()));
    }
    for lease in regranted {
        let released = post_json(
            &http,
            &format!("{survivor}/api/internal/release-key"),
            ("x-internal-key", INTERNAL_KEY),
            release_body(&lease, "success"),
        )
        .ok_json()
        .await;
        assert_eq!(released["released"], true);
    }
    assert_clean_run(&report, &database).await;
    // the killed replica's leases ended in the trail as expired (pruned by the new claims)
    for lease in &held {
        let events = sqlx::query_scalar::<_, String>(
            "SELECT event FROM lease_events WHERE lease_id = $1::text::uuid ORDER BY event_id",
        )
        .bind(lease["lease_id"].as_str().unwrap())
        .fetch_all(&db)
        .await
        .unwrap();
        assert_eq!(events, ["granted", "expired"], "{lease}");
    }
}
