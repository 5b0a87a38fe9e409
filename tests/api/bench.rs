//! `credpool bench` and its baselines (issue 19): a short run of each allocator against a fresh
//! database (and Redis, when one answers), checking that every one completes cycles without
//! errors and that the run removes what it created.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::process::Command;

use credpool_test_support::*;

use crate::BIN;

/// The Redis the redis baseline runs on: `CREDPOOL_TEST_REDIS_URL`, else the local default.
fn redis_url() -> String {
    std::env::var("CREDPOOL_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A connection to that Redis, if it answers PING within a second.
async fn redis_connection() -> Option<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(redis_url()).ok()?;
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(Duration::from_secs(1)));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .ok()?;
    let pong: String = redis::cmd("PING").query_async(&mut conn).await.ok()?;
    (pong == "PONG").then_some(conn)
}

/// A run whose executors present the key of a tenant capped at 3, next to the internal key's.
const TENANT_RUN: &[&str] = &[
    "--baseline",
    "untenanted",
    "--tenant-cap",
    "3",
    "--executors",
    "4",
];

/// `credpool bench ARGS` on `database`: 8 credentials of limit 2, one second, no warm-up (the
/// redis baseline, if asked for, on [`redis_url`]); its output, within two minutes.
async fn bench(database: &TestDatabase, args: &[&str]) -> std::process::Output {
    tokio::time::timeout(
        Duration::from_secs(120),
        Command::new(BIN)
            .arg("bench")
            .args(args)
            .args(["--credentials", "8", "--limit", "2"])
            .args(["--duration-seconds", "1", "--warmup-seconds", "0"])
            .env("DATABASE_URL", database.url())
            .env("CREDPOOL_MASTER_KEY", MASTER_KEY)
            .env("CREDPOOL_BENCH_REDIS_URL", redis_url())
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("the bench run took longer than two minutes")
    .unwrap()
}

#[tokio::test]
async fn every_baseline_completes_cycles_without_errors_next_to_credpool() {
    let database = TestDatabase::create().await;
    let mut redis = redis_connection().await;
    let mut baselines = vec!["sql", "unbatched"];
    if redis.is_some() {
        baselines.push("redis");
    } else {
        report_skipped(&format!(
            "the redis baseline: no Redis answers at {} (set CREDPOOL_TEST_REDIS_URL)",
            redis_url()
        ));
    }
    let output = bench(
        &database,
        &["--baseline", &baselines.join(","), "--executors", "2"],
    )
    .await;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "{stdout}\n{stderr}");

    let line: Value = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("no JSON line in: {stdout}"));
    let results = line["results"].as_array().unwrap();
    let modes: Vec<&str> = results
        .iter()
        .map(|r| r["mode"].as_str().unwrap())
        .collect();
    let mut expected = baselines.clone();
    expected.push("credpool");
    assert_eq!(modes, expected, "one row per allocator, credpool last");
    for result in results {
        assert!(
            result["cycles_per_second"].as_f64().unwrap() > 0.0,
            "no cycles: {result}"
        );
        assert_eq!(result["errors"], 0, "{result}");
    }
    assert_eq!(line["ratios"].as_array().unwrap().len(), baselines.len());
    assert_eq!(line["grants_over_limit"], 0);
    assert!(
        stdout.contains("server time: pg_stat_statements"),
        "the report says where server time comes from: {stdout}"
    );

    // the run removed what it created: the sql baseline's schema, the Redis keys, the
    // credentials
    let run_id = stderr
        .split("into pool bench/run-")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no pool name in: {stderr}"))
        .to_owned();
    let pool = database.pool(1).await;
    let schemas: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname = $1")
        .bind(format!("bench_baseline_{run_id}"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(schemas, 0, "the sql baseline's schema is dropped");
    let credentials: i64 = sqlx::query_scalar("SELECT count(*) FROM credentials")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(credentials, 0);
    if let Some(conn) = redis.as_mut() {
        let (_, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(0)
            .arg("MATCH")
            .arg(format!("credpool-bench:{run_id}:*"))
            .arg("COUNT")
            .arg(100_000)
            .query_async(conn)
            .await
            .unwrap();
        assert!(
            keys.is_empty(),
            "the run's Redis keys are deleted: {keys:?}"
        );
    }
}

#[tokio::test]
async fn a_run_with_a_tenant_key_compares_with_the_internal_key_and_removes_its_tenant() {
    let database = TestDatabase::create().await;
    let output = bench(&database, TENANT_RUN).await;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let line: Value = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("no JSON line in: {stdout}"));
    let modes: Vec<&str> = line["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["mode"].as_str().unwrap())
        .collect();
    assert_eq!(modes, ["credpool-untenanted", "credpool"]);
    assert_eq!(line["ratios"].as_array().unwrap().len(), 1);
    assert!(
        stdout.contains("credpool / credpool-untenanted:"),
        "{stdout}"
    );

    let pool = database.pool(1).await;
    // the tenant's run: its leases are in the trail under its name, never more than 3 at once
    // (4 executors), and it is gone afterwards
    let tenant_grants: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM lease_events WHERE event = 'granted' AND tenant LIKE 'bench-%'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        tenant_grants > 0,
        "the tenant's executors were granted leases"
    );
    let tenants: i64 =
        sqlx::query_scalar("SELECT count(*) FROM tenants WHERE tenant_id LIKE 'bench-%'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(tenants, 0, "the run's tenant is deleted");
    let exceeded = tokio::time::timeout(
        Duration::from_secs(60),
        Command::new(BIN)
            .args(["audit", "verify"])
            .env("DATABASE_URL", database.url())
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(
        exceeded.status.success(),
        "{}",
        String::from_utf8_lossy(&exceeded.stdout)
    );
}

#[tokio::test]
async fn a_run_whose_tenant_cannot_be_created_still_removes_its_credentials() {
    // The database refuses the run's tenant (a trigger of the test's). The run fails, and still
    // removes the credentials it loaded before. Before, the failure returned at once and left
    // them in the pool.
    let database = TestDatabase::create().await;
    let pool = database.pool(1).await;
    sqlx::query(
        "CREATE FUNCTION refuse_bench_tenants() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'no bench tenants in this database'; END $$",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "CREATE TRIGGER refuse_bench_tenants BEFORE INSERT ON tenants FOR EACH ROW
         WHEN (NEW.tenant_id LIKE 'bench-%') EXECUTE FUNCTION refuse_bench_tenants()",
    )
    .execute(&pool)
    .await
    .unwrap();
    let output = bench(&database, TENANT_RUN).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the run succeeded: {stderr}");
    let credentials: i64 = sqlx::query_scalar("SELECT count(*) FROM credentials")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(credentials, 0, "the run's credentials were left behind");
    let tenants: i64 =
        sqlx::query_scalar("SELECT count(*) FROM tenants WHERE tenant_id LIKE 'bench-%'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(tenants, 0);
    assert!(
        stderr.contains("creating the run's tenant"),
        "the run does not say what failed: {stderr}"
    );
}
