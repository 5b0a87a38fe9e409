//! `credpool bench` and its baselines: a short run of each allocator against a fresh
//! database (and Redis, when one answers), checking that every one completes cycles without
//! errors and that the run removes what it created.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::process::Command;

use credpool_test_support::*;

use crate::BIN;

/// The Redis the redis baseline runs on, with a connection to it.
struct Redis {
    url: String,
    conn: redis::aio::MultiplexedConnection,
    /// The redis-server this test started, stopped when dropped.
    _server: Option<tokio::process::Child>,
}

/// A connection to the Redis at `url`, if it answers PING within a second.
async fn redis_connection(url: &str) -> Option<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(url).ok()?;
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

/// The Redis for the redis baseline: `CREDPOOL_TEST_REDIS_URL` when set (it must answer); else
/// the local default when one answers; else a `redis-server` of the test's own on a free port
/// (no persistence). `None` (the baseline skipped, and said so) only with
/// `CREDPOOL_TEST_SKIP_REDIS` set; without it a missing Redis fails the test naming the package.
async fn redis() -> Option<Redis> {
    if let Ok(url) = std::env::var("CREDPOOL_TEST_REDIS_URL") {
        let conn = redis_connection(&url)
            .await
            .unwrap_or_else(|| panic!("no Redis answers at {url} (CREDPOOL_TEST_REDIS_URL)"));
        return Some(Redis {
            url,
            conn,
            _server: None,
        });
    }
    let default = "redis://127.0.0.1:6379".to_owned();
    if let Some(conn) = redis_connection(&default).await {
        return Some(Redis {
            url: default,
            conn,
            _server: None,
        });
    }
    if std::env::var_os("CREDPOOL_TEST_SKIP_REDIS").is_some() {
        report_skipped("the redis baseline: CREDPOOL_TEST_SKIP_REDIS is set");
        return None;
    }
    let port = free_port();
    let server = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|error| {
            panic!(
                "no Redis answers at {default}, and redis-server could not be started: {error} \
                 (Debian: apt-get install redis-server); set CREDPOOL_TEST_SKIP_REDIS=1 to skip \
                 the redis baseline"
            )
        });
    let url = format!("redis://127.0.0.1:{port}");
    for _ in 0..200 {
        if let Some(conn) = redis_connection(&url).await {
            return Some(Redis {
                url,
                conn,
                _server: Some(server),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the redis-server started on port {port} never answered PING");
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

/// `credpool bench ARGS` on `database_url`: 8 credentials of limit 2, one second, no warm-up (the
/// redis baseline, if asked for, on `redis_url`); its output, within two minutes.
async fn bench(database_url: &str, redis_url: Option<&str>, args: &[&str]) -> std::process::Output {
    tokio::time::timeout(
        Duration::from_secs(120),
        Command::new(BIN)
            .arg("bench")
            .args(args)
            .args(["--credentials", "8", "--limit", "2"])
            .args(["--duration-seconds", "1", "--warmup-seconds", "0"])
            .env("DATABASE_URL", database_url)
            .env("CREDPOOL_MASTER_KEY", MASTER_KEY)
            .envs(redis_url.map(|url| ("CREDPOOL_BENCH_REDIS_URL", url)))
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("the bench run took longer than two minutes")
    .unwrap()
}

/// [`bench`], which must succeed: what it printed (stdout, stderr) and the last JSON line of
/// its stdout (the report).
async fn bench_report(
    database_url: &str,
    redis_url: Option<&str>,
    args: &[&str],
) -> (String, String, Value) {
    let output = bench(database_url, redis_url, args).await;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    );
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let line: Value = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("no JSON line in: {stdout}"));
    (stdout, stderr, line)
}

/// The report's server time is what its header says: measured for every PostgreSQL mode
/// (claims and releases that took time) when it names `pg_stat_statements` as the source, and
/// absent everywhere when it says that is unavailable (a server that does not load it).
fn server_time_as_reported(stdout: &str, results: &[Value]) {
    let header = stdout
        .lines()
        .find_map(|line| line.strip_prefix("server time: "))
        .unwrap_or_else(|| panic!("no server time line: {stdout}"));
    for result in results.iter().filter(|r| r["mode"] != "redis") {
        if header.starts_with("pg_stat_statements unavailable") {
            assert!(result["server_time"].is_null(), "{result}");
            continue;
        }
        assert!(header.starts_with("pg_stat_statements"), "{header}");
        let time = &result["server_time"];
        assert_eq!(time["source"], "pg_stat_statements", "{result}");
        assert!(
            time["ms_per_cycle"].as_f64().is_some_and(|ms| ms > 0.0),
            "{result}"
        );
        let operations = time["operations"].as_array().unwrap();
        assert_eq!(operations.len(), 2, "a claim and a release: {result}");
        for operation in operations {
            assert!(
                operation["count"].as_i64().is_some_and(|count| count > 0)
                    && operation["ms_per_operation"]
                        .as_f64()
                        .is_some_and(|ms| ms > 0.0),
                "{result}"
            );
        }
    }
}

#[tokio::test]
async fn every_baseline_completes_cycles_without_errors_next_to_credpool() {
    let database = TestDatabase::create().await;
    let mut redis = redis().await;
    let mut baselines = vec!["sql", "unbatched"];
    if redis.is_some() {
        baselines.push("redis");
    }
    let (stdout, stderr, line) = bench_report(
        &database.url(),
        redis.as_ref().map(|r| r.url.as_str()),
        &["--baseline", &baselines.join(","), "--executors", "2"],
    )
    .await;

    let results = line["results"].as_array().unwrap();
    let modes = texts(&line["results"], "mode");
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
    server_time_as_reported(&stdout, results);

    // the run removed what it created: the sql baseline's schema, the Redis keys, the
    // credentials
    let run_id = stderr
        .split("into pool bench/run-")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no pool name in: {stderr}"))
        .to_owned();
    let pool = database.pool(1).await;
    let schemas: i64 = pool
        .scalar_of(
            "SELECT count(*) FROM pg_namespace WHERE nspname = $1",
            format!("bench_baseline_{run_id}"),
        )
        .await;
    assert_eq!(schemas, 0, "the sql baseline's schema is dropped");
    let credentials: i64 = pool.scalar("SELECT count(*) FROM credentials").await;
    assert_eq!(credentials, 0);
    if let Some(Redis { conn, .. }) = redis.as_mut() {
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
    let (stdout, _, line) = bench_report(&database.url(), None, TENANT_RUN).await;
    let modes = texts(&line["results"], "mode");
    assert_eq!(modes, ["credpool-untenanted", "credpool"]);
    assert_eq!(line["ratios"].as_array().unwrap().len(), 1);
    assert!(
        stdout.contains("credpool / credpool-untenanted:"),
        "{stdout}"
    );

    let pool = database.pool(1).await;
    // the tenant's run: its leases are in the trail under its name, never more than 3 at once
    // (4 executors), and it is gone afterwards
    let tenant_grants: i64 = pool
        .scalar(
            "SELECT count(*) FROM lease_events WHERE event = 'granted' AND tenant LIKE 'bench-%'",
        )
        .await;
    assert!(
        tenant_grants > 0,
        "the tenant's executors were granted leases"
    );
    let tenants: i64 = pool
        .scalar("SELECT count(*) FROM tenants WHERE tenant_id LIKE 'bench-%'")
        .await;
    assert_eq!(tenants, 0, "the run's tenant is deleted");
    let mut verify = credpool_command(BIN, &database.url());
    verify.args(["audit", "verify"]);
    let verified = tokio::time::timeout(Duration::from_secs(60), run(&mut verify))
        .await
        .unwrap();
    assert!(verified.success, "{}", verified.stdout);
}

#[tokio::test]
async fn a_run_whose_tenant_cannot_be_created_still_removes_its_credentials() {
    // The database refuses the run's tenant (a trigger of the test's). The run fails, and still
    // removes the credentials it loaded before. Before, the failure returned at once and left
    // them in the pool.
    let database = TestDatabase::create().await;
    let pool = database.pool(1).await;
    pool.run_sql(
        "CREATE FUNCTION refuse_bench_tenants() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'no bench tenants in this database'; END $$",
    )
    .await;
    pool.run_sql(
        "CREATE TRIGGER refuse_bench_tenants BEFORE INSERT ON tenants FOR EACH ROW
         WHEN (NEW.tenant_id LIKE 'bench-%') EXECUTE FUNCTION refuse_bench_tenants()",
    )
    .await;
    let output = bench(&database.url(), None, TENANT_RUN).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the run succeeded: {stderr}");
    let credentials: i64 = pool.scalar("SELECT count(*) FROM credentials").await;
    assert_eq!(credentials, 0, "the run's credentials were left behind");
    let tenants: i64 = pool
        .scalar("SELECT count(*) FROM tenants WHERE tenant_id LIKE 'bench-%'")
        .await;
    assert_eq!(tenants, 0);
    assert!(
        stderr.contains("creating the run's tenant"),
        "the run does not say what failed: {stderr}"
    );
}

#[tokio::test]
async fn the_report_gives_the_cpu_and_server_time_of_the_server_it_ran_on() {
    // A private cluster that loads pg_stat_statements, on this machine: the report measures
    // each mode's server time, and its CPU per cycle counts this server's processes (found
    // through its postmaster) and the load generator, which both did work for every cycle.
    let dir = tmp_dir("credpool-bench-");
    let (cluster, pool) = statements_cluster(dir.path(), &[]).await;
    let options = cluster.connect_options();
    let (stdout, _, line) = bench_report(
        &url_for(&options, "postgres"),
        None,
        &["--baseline", "sql", "--executors", "2"],
    )
    .await;
    assert!(
        stdout.contains("server time: pg_stat_statements") && !stdout.contains("unavailable"),
        "{stdout}"
    );
    let results = line["results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "{line}");
    server_time_as_reported(&stdout, results);
    for result in results {
        let cpu = &result["cpu"];
        for group in ["postgres_us", "generator_us"] {
            assert!(
                cpu[group].as_f64().is_some_and(|us| us > 0.0),
                "{group} per cycle: {result}"
            );
        }
    }
    pool.close().await;
}

#[tokio::test]
async fn a_relay_run_measures_direct_and_relayed_calls_and_puts_the_upstream_back() {
    // `--relay`: the same calls to the run's mock upstream, directly and through the relay. Every
    // call completes, both rows and the relay's ratios are reported, the relay's calls were leases
    // released with the usage the mock's answers report, and provider `bench` has no upstream
    // afterwards (it had none before).
    let database = TestDatabase::create().await;
    let (stdout, _, line) =
        bench_report(&database.url(), None, &["--relay", "--executors", "2"]).await;
    assert_eq!(line["relay"], true, "{line}");
    let results = line["results"].as_array().unwrap();
    let modes = texts(&line["results"], "mode");
    assert_eq!(modes, ["direct", "relay"], "{line}");
    for result in results {
        assert!(
            result["calls_per_second"].as_f64().unwrap() > 0.0,
            "no calls: {result}"
        );
        assert_eq!(result["errors"], 0, "{result}");
        for p in ["p50", "p99"] {
            assert!(
                result["call_ms"][p].as_f64().is_some_and(|ms| ms > 0.0),
                "{result}"
            );
        }
    }
    let ratios = line["ratios"].as_array().unwrap();
    assert_eq!(ratios.len(), 1, "{line}");
    assert_eq!(ratios[0]["baseline"], "direct");
    for ratio in ["calls", "latency_p50", "latency_p99"] {
        assert!(
            ratios[0][ratio].as_f64().is_some_and(|r| r > 0.0),
            "{ratio}: {line}"
        );
    }
    assert!(stdout.contains("relay / direct:"), "{stdout}");
    assert_eq!(line["grants_over_limit"], 0);

    let pool = database.pool(1).await;
    let relayed = "SELECT count(*) FROM lease_events
         WHERE event = 'released' AND holder = 'relay' AND outcome = 'success' AND tokens = 10";
    let upstreams = "SELECT count(*) FROM relay_upstreams WHERE provider = 'bench'";
    assert!(
        pool.scalar::<i64>(relayed).await > 0,
        "the relay's calls were released with their usage"
    );
    assert_eq!(
        pool.scalar::<i64>(upstreams).await,
        0,
        "the bench provider's upstream is removed"
    );
    let credentials: i64 = pool.scalar("SELECT count(*) FROM credentials").await;
    assert_eq!(credentials, 0);
}
