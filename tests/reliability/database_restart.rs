//! Reliability scenario 3: PostgreSQL restarts under load. A real `credpool serve` process on a
//! private cluster, executors allocating, holding, renewing and releasing all the while, and long
//! leases held across the outage. While the database is down every executor call answers 503
//! `store_unavailable` within the configured request timeout (never a hang, a 429 or a 500); when
//! the same cluster comes back the service serves again without a restart; every lease granted
//! before the outage still holds its slot; and the audit trail proves no slot was ever granted
//! twice.
//!
//! The calls that a cached candidate view could answer without the database are made on purpose
//! during the outage: a pool whose credentials are all full, and one whose only credential rests
//! after a rate limit (that one used to get a 429 from the view while PostgreSQL was down).
//!
//! The private cluster listens on a Unix socket in its own data directory, never on a TCP port:
//! started again on the same directory it is at the same address, and nothing else can be.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use credpool::embedded::{self, EmbeddedCluster};
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

use credpool_test_support::Service as _;
use credpool_test_support::*;

use crate::BIN;

/// `--request-timeout-ms`: no request is answered later than this.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(1000);
/// What the bound allows on top for the client's side of the loopback: on a loaded 2-core
/// machine, 24 executors and the service share the cores (answers that the service gave in time
/// were measured up to ~600 ms late). Well under the 5 s connection wait the service is
/// configured with, so a request timeout that did not fire would still be caught.
const LATENCY_MARGIN: Duration = Duration::from_millis(1500);
/// The client gives up only far beyond the bound: a hang shows up as a transport error.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);
/// Executors on the shared pool.
const EXECUTORS: usize = 24;
/// How long the database stays down.
const OUTAGE: Duration = Duration::from_secs(5);
/// Executors' leases: shorter than the outage, so some expire while the database is down.
const EXECUTOR_LEASE_SECONDS: u64 = 4;
const PROVIDER: &str = "restart";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Allocate,
    Renew,
    Release,
}

impl Op {
    fn path(self) -> &'static str {
        match self {
            Op::Allocate => "/api/internal/allocate-key",
            Op::Renew => "/api/internal/renew-lease",
            Op::Release => "/api/internal/release-key",
        }
    }

    /// Every answer an executor call may get at any time, database up or down.
    fn allowed(self, status: StatusCode) -> bool {
        let allowed: &[StatusCode] = match self {
            Op::Allocate => &[
                StatusCode::OK,
                StatusCode::TOO_MANY_REQUESTS,
                StatusCode::SERVICE_UNAVAILABLE,
            ],
            // 410: an executor's lease that expired while the database was down
            Op::Renew => &[
                StatusCode::OK,
                StatusCode::GONE,
                StatusCode::SERVICE_UNAVAILABLE,
            ],
            Op::Release => &[StatusCode::OK, StatusCode::SERVICE_UNAVAILABLE],
        };
        allowed.contains(&status)
    }
}

/// One executor call as the client saw it.
#[derive(Debug, Clone)]
struct Call {
    op: Op,
    started: Instant,
    elapsed: Duration,
    /// The status and JSON body, or the transport error (a hang ends as the client's timeout).
    answer: Result<(StatusCode, Value), String>,
}

impl Call {
    fn status(&self) -> Option<StatusCode> {
        self.answer.as_ref().ok().map(|(status, _)| *status)
    }

    fn body(&self) -> &Value {
        &self.answer.as_ref().unwrap().1
    }

    fn code(&self) -> Option<&str> {
        self.answer.as_ref().ok()?.1["error"]["code"].as_str()
    }

    fn ended(&self) -> Instant {
        self.started + self.elapsed
    }
}

/// The service as its executors reach it; every call is timed and logged.
struct Service {
    client: reqwest::Client,
    base: String,
    calls: Mutex<Vec<Call>>,
}

impl Service {
    async fn call(&self, op: Op, body: Value) -> Call {
        let started = Instant::now();
        let sent = self
            .client
            .post(format!("{}{}", self.base, op.path()))
            .header("x-internal-key", INTERNAL_KEY)
            .json(&body)
            .send()
            .await;
        let answer = match sent {
            Ok(response) => {
                let status = response.status();
                match response.text().await {
                    Ok(text) => serde_json::from_str(&text)
                        .map(|body| (status, body))
                        .map_err(|e| format!("{status}: not JSON ({e}): {text}")),
                    Err(error) => Err(format!("reading the body: {error}")),
                }
            }
            Err(error) => Err(format!("{error:?}")),
        };
        let call = Call {
            op,
            started,
            elapsed: started.elapsed(),
            answer,
        };
        self.calls.lock().unwrap().push(call.clone());
        call
    }

    async fn allocate(&self, pool: &str, lease_seconds: u64, holder: &str) -> Call {
        self.call(
            Op::Allocate,
            json!({"provider": PROVIDER, "model": "gpt-4o", "pool": pool,
                   "lease_seconds": lease_seconds, "holder": holder}),
        )
        .await
    }

    async fn renew(&self, lease: &Value, lease_seconds: u64) -> Call {
        let body = renew_body(lease, lease_seconds);
        self.call(Op::Renew, body).await
    }

    async fn release(&self, lease: &Value) -> Call {
        self.call(Op::Release, release_body(lease, "success")).await
    }

    async fn put_key(&self, key_id: &str, pool: &str, limit: u32) {
        let response = Remote::new(&self.client, &self.base)
            .put_key_raw(
                key_id,
                json!({"provider": PROVIDER, "pool": pool, "models": ["gpt-4o"],
                       "max_concurrent_uses": limit, "secret": {"api_key": format!("sk-{key_id}")}}),
            )
            .await;
        assert!(response.status().is_success(), "PUT {key_id}");
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }
}

/// Asserts a call's status (and, for errors, its code).
fn expect(call: &Call, status: StatusCode, code: Option<&str>) -> Value {
    assert_eq!(call.status(), Some(status), "{call:?}");
    if code.is_some() {
        assert_eq!(call.code(), code, "{call:?}");
    }
    call.body().clone()
}

/// One executor: allocate, hold a little, sometimes renew, release; back off on 429 and 503; a
/// lease whose release failed is renewed or released again until the service answers (or its
/// renewal says it is lost). After `stop` it gives back what it holds and ends.
async fn executor(id: usize, service: Arc<Service>, stop: Arc<AtomicBool>) {
    let holder = format!("executor-{id}");
    let mut lease: Option<Value> = None;
    let mut renewed = false;
    let mut attempts_after_stop = 0;
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        if stopping {
            attempts_after_stop += 1;
            if lease.is_none() || attempts_after_stop > 50 {
                return;
            }
        }
        let Some(held) = &lease else {
            let call = service
                .allocate("default", EXECUTOR_LEASE_SECONDS, &holder)
                .await;
            if call.status() == Some(StatusCode::OK) {
                lease = Some(call.body().clone());
                renewed = false;
                tokio::time::sleep(Duration::from_millis(rand::random_range(10..150))).await;
            } else {
                tokio::time::sleep(Duration::from_millis(rand::random_range(20..60))).await;
            }
            continue;
        };
        if !renewed && !stopping && rand::random::<bool>() {
            let call = service.renew(held, EXECUTOR_LEASE_SECONDS).await;
            match call.status() {
                Some(StatusCode::OK) => {
                    renewed = true;
                    tokio::time::sleep(Duration::from_millis(rand::random_range(10..100))).await;
                }
                // lost: stop using the credential
                Some(StatusCode::GONE) => lease = None,
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        } else {
            let call = service.release(held).await;
            if call.status() == Some(StatusCode::OK) {
                lease = None;
            } else {
                renewed = false;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The private cluster's URL for child processes (its Unix socket; no TCP port to collide).
fn cluster_url(cluster: &EmbeddedCluster) -> String {
    url_for(&cluster.connect_options(), embedded::DATABASE)
}

/// The last lines of a log file, for failure messages.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_restart_under_load_answers_503_in_time_loses_no_lease_and_recovers_without_a_service_restart()
 {
    let dir = tmp_dir("credpool-restart-");
    let cluster = EmbeddedCluster::start(dir.path(), None).await.unwrap();
    let options = cluster.connect_options();
    let url = cluster_url(&cluster);
    {
        let db = PgPool::connect_with(options.clone()).await.unwrap();
        credpool::store::migrate(&db).await.unwrap();
        db.close().await;
    }
    let log_path = dir.path().join("serve.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut env = keyed_env_at(url.clone(), 32);
    env.extend([
        (
            "CREDPOOL_REQUEST_TIMEOUT_MS",
            REQUEST_TIMEOUT.as_millis().to_string(),
        ),
        // a connection wait longer than the request timeout: the request timeout is the bound
        // that answers (a database that is starting up or shutting down makes the pool wait)
        ("CREDPOOL_DB_ACQUIRE_TIMEOUT_MS", "5000".to_owned()),
        // the in-process reaper runs every second: through the outage, and after it
        ("CREDPOOL_MAINTENANCE_INTERVAL_SECONDS", "1".to_owned()),
    ]);
    let serve = ServeProcess::start_in(BIN, None, log.into(), &env, &[]).await;
    let service = Arc::new(Service {
        client: reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .timeout(CLIENT_TIMEOUT)
            .build()
            .unwrap(),
        base: serve.base.clone(),
        calls: Mutex::new(Vec::new()),
    });

    // the executors' pool: 8 credentials of limits 1 to 3, 15 slots for 24 executors
    for (i, limit) in [1, 2, 3, 1, 2, 3, 1, 2].into_iter().enumerate() {
        service
            .put_key(&format!("shared-{i}"), "default", limit)
            .await;
    }
    // long leases that must survive the outage: every slot of three credentials
    let held_limits = [("held-1", 1), ("held-2", 2), ("held-3", 3)];
    for (key, limit) in held_limits {
        service.put_key(key, "held", limit).await;
    }
    let mut held = Vec::new();
    for i in 0..6 {
        let call = service.allocate("held", 600, &format!("long-{i}")).await;
        held.push(expect(&call, StatusCode::OK, None));
    }
    let call = service.allocate("held", 600, "one-too-many").await;
    expect(&call, StatusCode::TOO_MANY_REQUESTS, Some("pool_exhausted"));
    // a credential resting after a rate limit: "none free now" as far as the pool knows
    service.put_key("resting", "resting", 1).await;
    let rest = expect(
        &service.allocate("resting", 60, "rate-limited").await,
        StatusCode::OK,
        None,
    );
    let mut report = release_body(&rest, "rate_limited");
    report["retry_after_seconds"] = json!(600);
    let released = service.call(Op::Release, report).await;
    assert_eq!(expect(&released, StatusCode::OK, None)["released"], true);
    let call = service.allocate("resting", 60, "too-early").await;
    expect(&call, StatusCode::TOO_MANY_REQUESTS, Some("pool_exhausted"));
    // a pool the test polls to see the service serve again
    service.put_key("probe", "probe", 1).await;

    let stop = Arc::new(AtomicBool::new(false));
    let executors: Vec<_> = (0..EXECUTORS)
        .map(|id| tokio::spawn(executor(id, service.clone(), stop.clone())))
        .collect();
    tokio::time::sleep(Duration::from_secs(3)).await;

    // PostgreSQL stops (fast shutdown: sessions are cut, committed work is durable)
    cluster.stop().await;
    let down = Instant::now();
    // calls from the test itself: the held leases' renewal and release, and the allocations that
    // a stale view could answer without the database (full credentials, a resting one)
    let outage_calls = [
        service.allocate("held", 600, "during-outage").await,
        service.allocate("resting", 60, "during-outage").await,
        service.allocate("probe", 60, "during-outage").await,
        service.renew(&held[0], 600).await,
        service.release(&held[1]).await,
    ];
    for call in &outage_calls {
        expect(
            call,
            StatusCode::SERVICE_UNAVAILABLE,
            Some("store_unavailable"),
        );
    }
    let readiness = service
        .client
        .get(format!("{}/readyz", service.base))
        .send()
        .await
        .unwrap();
    assert_eq!(readiness.status(), StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::sleep(OUTAGE.saturating_sub(down.elapsed())).await;

    // the SAME cluster comes back: same data directory, same socket (no TCP port to lose)
    let up_from = Instant::now();
    let cluster = EmbeddedCluster::start(dir.path(), None).await.unwrap();
    assert_eq!(cluster_url(&cluster), url);
    let up = Instant::now();
    // the service serves again without a restart
    let recovered = loop {
        let call = service.allocate("probe", 60, "probe").await;
        if call.status() == Some(StatusCode::OK) {
            expect(&service.release(call.body()).await, StatusCode::OK, None);
            break Instant::now();
        }
        assert!(
            up.elapsed() < Duration::from_secs(30),
            "no recovery 30 s after the database came back; last answer {call:?}; log:\n{}",
            tail(&log_path)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // and readiness follows
    let mut ready = false;
    for _ in 0..50 {
        let readiness = service
            .client
            .get(format!("{}/readyz", service.base))
            .send();
        if readiness.await.unwrap().status() == StatusCode::OK {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(ready, "readiness did not recover");
    // the executors keep going for a while, then give back what they hold
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    for executor in executors {
        tokio::time::timeout(Duration::from_secs(60), executor)
            .await
            .expect("an executor did not finish")
            .unwrap();
    }

    let calls = service.calls();
    let outage: Vec<&Call> = calls
        .iter()
        .filter(|c| c.started >= down && c.ended() <= up_from)
        .collect();
    let settled = recovered + Duration::from_secs(1);
    let after: Vec<&Call> = calls.iter().filter(|c| c.started >= settled).collect();
    let max_latency = |calls: &[&Call]| calls.iter().map(|c| c.elapsed).max().unwrap_or_default();
    let slowest = calls.iter().max_by_key(|c| c.elapsed).unwrap();
    eprintln!(
        "database restart: {} calls in all; {} during the {:.1} s outage ({} allocate, {} renew, \
         {} release), slowest {:.0} ms there; slowest overall {:.0} ms ({:?} {:?} sent {:.2} s \
         after the stop); cluster start {:.2} s; service serving {:.0} ms after the database was \
         back; {} calls after recovery",
        calls.len(),
        outage.len(),
        (up_from - down).as_secs_f64(),
        outage.iter().filter(|c| c.op == Op::Allocate).count(),
        outage.iter().filter(|c| c.op == Op::Renew).count(),
        outage.iter().filter(|c| c.op == Op::Release).count(),
        max_latency(&outage).as_secs_f64() * 1e3,
        slowest.elapsed.as_secs_f64() * 1e3,
        slowest.op,
        slowest.status(),
        slowest
            .started
            .saturating_duration_since(down)
            .as_secs_f64()
            - down
                .saturating_duration_since(slowest.started)
                .as_secs_f64(),
        (up - up_from).as_secs_f64(),
        (recovered - up).as_secs_f64() * 1e3,
        after.len(),
    );

    // never a hang, never an answer outside the API's table, never later than the bound
    for call in &calls {
        let status = call
            .status()
            .unwrap_or_else(|| panic!("no answer (a hang?): {call:?}"));
        assert!(
            call.op.allowed(status),
            "unexpected answer {call:?}; log:\n{}",
            tail(&log_path)
        );
        if status == StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(call.code(), Some("store_unavailable"), "{call:?}");
        }
        assert!(
            call.elapsed <= REQUEST_TIMEOUT + LATENCY_MARGIN,
            "answered after {:?}, beyond the request timeout: {call:?}",
            call.elapsed
        );
    }
    // while the database was down, every executor call was a 503 store_unavailable
    assert!(
        outage.len() >= 50,
        "only {} calls during the outage",
        outage.len()
    );
    for op in [Op::Allocate, Op::Renew, Op::Release] {
        assert!(
            outage.iter().any(|c| c.op == op),
            "no {op:?} during the outage"
        );
    }
    for call in &outage {
        assert_eq!(
            call.status(),
            Some(StatusCode::SERVICE_UNAVAILABLE),
            "during the outage: {call:?}"
        );
        assert_eq!(call.code(), Some("store_unavailable"), "{call:?}");
    }
    // once recovered, it stays recovered (and the executors were served before and after)
    assert!(
        after.len() >= 50,
        "only {} calls after recovery",
        after.len()
    );
    for call in &after {
        assert_ne!(
            call.status(),
            Some(StatusCode::SERVICE_UNAVAILABLE),
            "503 after recovery: {call:?}"
        );
    }
    let granted = |calls: &[&Call]| {
        calls
            .iter()
            .filter(|c| c.op == Op::Allocate && c.status() == Some(StatusCode::OK))
            .count()
    };
    let before: Vec<&Call> = calls.iter().filter(|c| c.ended() <= down).collect();
    assert!(granted(&before) > 0 && granted(&after) > 0);

    // every lease granted before the outage is still honoured: its slot stays taken, exactly as
    // granted (the renewal and release sent during the outage changed nothing), and it renews
    // and releases as usual
    let db = PgPool::connect_with(options.clone()).await.unwrap();
    for lease in &held {
        let (until,): (time::OffsetDateTime,) =
            sqlx::query_as("SELECT lease_until FROM lease_slots WHERE lease_id = $1::text::uuid")
                .bind(lease["lease_id"].as_str().unwrap())
                .fetch_one(&db)
                .await
                .unwrap_or_else(|e| panic!("held lease {lease} lost: {e}"));
        let granted_until = time::OffsetDateTime::parse(
            lease["lease_until"].as_str().unwrap(),
            &time::format_description::well_known::Rfc3339,
        )
        .unwrap();
        assert_eq!(until, granted_until, "{lease}");
    }
    let call = service.allocate("held", 600, "after-outage").await;
    expect(&call, StatusCode::TOO_MANY_REQUESTS, Some("pool_exhausted"));
    for lease in &held {
        let renewed = expect(&service.renew(lease, 600).await, StatusCode::OK, None);
        assert!(renewed["lease_until"].as_str().unwrap() > lease["lease_until"].as_str().unwrap());
    }
    for lease in &held {
        let released = expect(&service.release(lease).await, StatusCode::OK, None);
        assert_eq!(released, json!({"released": true}), "{lease}");
    }
    let call = service.allocate("held", 60, "after-release").await;
    expect(
        &service.release(&expect(&call, StatusCode::OK, None)).await,
        StatusCode::OK,
        None,
    );
    // the rate-limited credential still rests
    let call = service.allocate("resting", 60, "after-outage").await;
    expect(&call, StatusCode::TOO_MANY_REQUESTS, Some("pool_exhausted"));

    // no lease was granted twice: every lease id an executor got is distinct and in the trail
    // exactly once, and the oversell proof over the whole trail finds no grant over a limit
    let mut lease_ids: Vec<String> = calls
        .iter()
        .filter(|c| c.op == Op::Allocate && c.status() == Some(StatusCode::OK))
        .map(|c| c.body()["lease_id"].as_str().unwrap().to_owned())
        .collect();
    let total = lease_ids.len();
    lease_ids.sort();
    lease_ids.dedup();
    assert_eq!(lease_ids.len(), total, "a lease id was handed out twice");
    let in_trail: i64 = db
        .scalar_of(
            "SELECT count(*) FROM lease_events WHERE event = 'granted'
         AND lease_id = ANY (SELECT l::uuid FROM unnest($1::text[]) l)",
            &lease_ids,
        )
        .await;
    assert_eq!(in_trail, total as i64);
    let granted_twice: Vec<String> = db
        .scalars(
            "SELECT lease_id::text FROM lease_events WHERE event = 'granted'
         GROUP BY lease_id HAVING count(*) > 1",
        )
        .await;
    assert!(granted_twice.is_empty(), "{granted_twice:?}");
    let verified = audit_verify_json(BIN, &url).await;
    let printed = verified.printed();
    assert!(verified.success, "{printed}");
    let proof = verified.report();
    assert_eq!(proof["grants_over_limit"], 0, "{printed}");
    for row in proof["credentials"].as_array().unwrap() {
        assert!(
            row["peak"].as_i64() <= row["max_concurrent_uses"].as_i64(),
            "{row}"
        );
    }
    for (key, limit) in held_limits {
        let row = proof["credentials"]
            .as_array()
            .unwrap()
            .iter()
            .find(|row| row["key_id"] == key)
            .unwrap_or_else(|| panic!("{key} not in {printed}"));
        assert_eq!(row["peak"], limit, "{row}");
    }
    db.close().await;

    assert!(serve.terminate().await.success(), "{}", tail(&log_path));
    cluster.stop().await;
}
