//! A fleet of executors driving real `credpool serve` replicas, shared by the replica,
//! killed-replica and soak scenarios: each executor allocates, holds, sometimes renews, sometimes
//! vanishes without releasing, and releases with an outcome; every request goes to the next live
//! replica (a load balancer in miniature). The fleet counts what a user would notice and keeps, per
//! credential, how many of its executors hold a lease right now: more than the limit at any moment
//! is an oversell seen from the client side (the database side is `credpool audit verify`).

use std::collections::HashMap;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rand::RngExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::{ADMIN_KEY, INTERNAL_KEY, client};

/// The provider of every credential the fleet leases.
pub const PROVIDER: &str = "openai";
/// The model every executor asks for.
pub const MODEL: &str = "gpt-4o";

/// The base URLs of the replicas an executor may call, in turn. A replica is taken out before a
/// planned restart and put back after it; one that refuses a connection is taken out at once.
#[derive(Default)]
pub struct Replicas {
    bases: RwLock<Vec<String>>,
    next: AtomicUsize,
}

impl Replicas {
    /// The replicas at `bases` (`http://<address>` each), called in turn from the first.
    pub fn new(bases: Vec<String>) -> Arc<Self> {
        Arc::new(Self {
            bases: RwLock::new(bases),
            next: AtomicUsize::new(0),
        })
    }

    fn pick(&self) -> Option<String> {
        let bases = self.bases.read().unwrap();
        if bases.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % bases.len();
        Some(bases[i].clone())
    }

    /// Takes the replica at `base` out of the turn (before a planned restart).
    pub fn remove(&self, base: &str) {
        self.bases.write().unwrap().retain(|b| b != base);
    }

    /// Puts the replica at `base` (back) into the turn.
    pub fn add(&self, base: String) {
        self.bases.write().unwrap().push(base);
    }
}

/// What the fleet does; see the module docs.
#[derive(Clone)]
pub struct Plan {
    /// The pool every executor leases from.
    pub pool: String,
    /// How many executors run at once.
    pub executors: usize,
    /// How long they run; each finishes its last call after it.
    pub duration: Duration,
    /// How long an executor uses a lease, in milliseconds.
    pub hold_ms: RangeInclusive<u64>,
    /// Every lease's length, in seconds.
    pub lease_seconds: u32,
    /// Percent of leases renewed once midway through the hold.
    pub renew_percent: u32,
    /// Percent of leases abandoned without a release (a crashed executor).
    pub crash_percent: u32,
    /// Percent of releases that report `failure` (the rest report `success`).
    pub failure_percent: u32,
    /// Percent of releases that report `rate_limited` with a 1-second retry-after.
    pub rate_limited_percent: u32,
}

impl Plan {
    /// Quick leases, all released with `success`.
    pub fn quick(pool: &str, executors: usize, duration: Duration) -> Self {
        Self {
            pool: pool.to_owned(),
            executors,
            duration,
            hold_ms: 2..=8,
            lease_seconds: 10,
            renew_percent: 10,
            crash_percent: 0,
            failure_percent: 0,
            rate_limited_percent: 0,
        }
    }
}

/// What the fleet saw.
#[derive(Debug, Default)]
pub struct Report {
    /// Leases granted.
    pub grants: u64,
    /// Leases renewed (200).
    pub renewals: u64,
    /// Leases released (200).
    pub releases: u64,
    /// Leases abandoned on purpose.
    pub crashes: u64,
    /// 429 `pool_exhausted` answers.
    pub exhausted: u64,
    /// Requests that reached no replica (a replica killed under them).
    pub unreachable: u64,
    /// Anything else: a 5xx, an unexpected status or body (the first few, described).
    pub errors: Vec<String>,
    /// How many such answers there were in all.
    pub error_count: u64,
    /// Moments when more executors held a credential than its limit.
    pub oversold: Vec<String>,
}

#[derive(Default)]
struct Counters {
    grants: AtomicU64,
    renewals: AtomicU64,
    releases: AtomicU64,
    crashes: AtomicU64,
    exhausted: AtomicU64,
    unreachable: AtomicU64,
    error_count: AtomicU64,
    errors: Mutex<Vec<String>>,
    oversold: Mutex<Vec<String>>,
}

impl Counters {
    fn error(&self, what: String) {
        self.error_count.fetch_add(1, Ordering::Relaxed);
        let mut errors = self.errors.lock().unwrap();
        if errors.len() < 20 {
            errors.push(what);
        }
    }
}

/// A running fleet; [`Fleet::grants`] can be read while it runs.
pub struct Fleet {
    counters: Arc<Counters>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Stores `count` credentials of each limit in `limits` in `pool` through `base`; returns
/// key id → limit.
pub async fn put_credentials(
    client: &reqwest::Client,
    base: &str,
    pool: &str,
    limits: &[i64],
    count: usize,
) -> HashMap<String, i64> {
    let mut stored = HashMap::new();
    for &limit in limits {
        for i in 0..count {
            let key_id = format!("{pool}-l{limit}-{i}");
            let response = client
                .put(format!("{base}/api/admin/keys/{key_id}"))
                .header("x-admin-key", ADMIN_KEY)
                .json(
                    &json!({"provider": PROVIDER, "pool": pool, "models": [MODEL],
                              "max_concurrent_uses": limit,
                              "secret": {"api_key": format!("sk-fleet-{key_id}")}}),
                )
                .send()
                .await
                .expect("PUT credential");
            assert!(
                response.status().is_success(),
                "PUT {key_id}: {}",
                response.status()
            );
            stored.insert(key_id, limit);
        }
    }
    stored
}

impl Fleet {
    /// Starts `plan.executors` executors over `limits` (key id → max_concurrent_uses).
    pub fn start(plan: Plan, replicas: Arc<Replicas>, limits: HashMap<String, i64>) -> Self {
        let counters = Arc::new(Counters::default());
        let holders: Arc<HashMap<String, (i64, AtomicI64)>> = Arc::new(
            limits
                .into_iter()
                .map(|(key, limit)| (key, (limit, AtomicI64::new(0))))
                .collect(),
        );
        let deadline = tokio::time::Instant::now() + plan.duration;
        let http = client();
        let tasks = (0..plan.executors)
            .map(|i| {
                let executor = Executor {
                    name: format!("executor-{i}"),
                    plan: plan.clone(),
                    replicas: replicas.clone(),
                    http: http.clone(),
                    counters: counters.clone(),
                    holders: holders.clone(),
                };
                tokio::spawn(executor.run(deadline))
            })
            .collect();
        Self { counters, tasks }
    }

    /// Leases granted so far.
    pub fn grants(&self) -> u64 {
        self.counters.grants.load(Ordering::Relaxed)
    }

    /// Waits for every executor to finish its last call.
    pub async fn finish(self) -> Report {
        for task in self.tasks {
            task.await.expect("executor task panicked");
        }
        let c = &self.counters;
        Report {
            grants: c.grants.load(Ordering::Relaxed),
            renewals: c.renewals.load(Ordering::Relaxed),
            releases: c.releases.load(Ordering::Relaxed),
            crashes: c.crashes.load(Ordering::Relaxed),
            exhausted: c.exhausted.load(Ordering::Relaxed),
            unreachable: c.unreachable.load(Ordering::Relaxed),
            error_count: c.error_count.load(Ordering::Relaxed),
            errors: c.errors.lock().unwrap().clone(),
            oversold: c.oversold.lock().unwrap().clone(),
        }
    }
}

struct Executor {
    name: String,
    plan: Plan,
    replicas: Arc<Replicas>,
    http: reqwest::Client,
    counters: Arc<Counters>,
    holders: Arc<HashMap<String, (i64, AtomicI64)>>,
}

/// How a call ended, as far as the executor cares.
enum Call {
    Answered(StatusCode, Value),
    Unreachable,
}

impl Executor {
    async fn call(&self, path: &str, body: &Value) -> Call {
        let Some(base) = self.replicas.pick() else {
            return Call::Unreachable;
        };
        let sent = self
            .http
            .post(format!("{base}{path}"))
            .header("x-internal-key", INTERNAL_KEY)
            .json(body)
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(error) if error.is_connect() || error.is_request() => {
                // the replica is gone (killed, or stopped between pick and connect)
                self.replicas.remove(&base);
                self.counters.unreachable.fetch_add(1, Ordering::Relaxed);
                return Call::Unreachable;
            }
            Err(error) => {
                self.counters.error(format!("{path} via {base}: {error}"));
                return Call::Unreachable;
            }
        };
        let status = response.status();
        match response.bytes().await {
            Ok(bytes) => Call::Answered(
                status,
                serde_json::from_slice(&bytes).unwrap_or_else(
                    |_| json!({"unparsed": String::from_utf8_lossy(&bytes).into_owned()}),
                ),
            ),
            Err(_) => {
                self.replicas.remove(&base);
                self.counters.unreachable.fetch_add(1, Ordering::Relaxed);
                Call::Unreachable
            }
        }
    }

    async fn run(self, deadline: tokio::time::Instant) {
        while tokio::time::Instant::now() < deadline {
            let allocate = json!({"provider": PROVIDER, "model": MODEL, "pool": self.plan.pool,
                                  "lease_seconds": self.plan.lease_seconds, "holder": self.name});
            let lease = match self.call("/api/internal/allocate-key", &allocate).await {
                Call::Answered(StatusCode::OK, lease) => lease,
                Call::Answered(StatusCode::TOO_MANY_REQUESTS, _) => {
                    self.counters.exhausted.fetch_add(1, Ordering::Relaxed);
                    let pause = rand::rng().random_range(5..=40);
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                    continue;
                }
                Call::Answered(status, body) => {
                    self.counters.error(format!("allocate: {status} {body}"));
                    continue;
                }
                Call::Unreachable => continue,
            };
            self.counters.grants.fetch_add(1, Ordering::Relaxed);
            self.hold(&lease).await;
        }
    }

    async fn hold(&self, lease: &Value) {
        let key_id = lease["key_id"].as_str().unwrap_or_default().to_owned();
        let Some((limit, holding)) = self.holders.get(&key_id) else {
            self.counters
                .error(format!("allocate granted an unknown credential: {lease}"));
            return;
        };
        let now_holding = holding.fetch_add(1, Ordering::SeqCst) + 1;
        if now_holding > *limit {
            self.counters.oversold.lock().unwrap().push(format!(
                "{key_id}: {now_holding} holders, limit {limit} (lease {})",
                lease["lease_id"]
            ));
        }
        let (hold_ms, renew, crash, outcome) = {
            let mut rng = rand::rng();
            let roll = rng.random_range(0..100);
            let outcome = if roll < self.plan.rate_limited_percent {
                json!({"outcome": "rate_limited", "retry_after_seconds": 1})
            } else if roll < self.plan.rate_limited_percent + self.plan.failure_percent {
                json!({"outcome": "failure"})
            } else {
                json!({"outcome": "success"})
            };
            (
                rng.random_range(self.plan.hold_ms.clone()),
                rng.random_range(0..100) < self.plan.renew_percent,
                rng.random_range(0..100) < self.plan.crash_percent,
                outcome,
            )
        };
        let reference = json!({"provider": lease["provider"], "pool": lease["pool"],
                               "key_id": lease["key_id"], "lease_id": lease["lease_id"]});
        if renew {
            tokio::time::sleep(Duration::from_millis(hold_ms / 2)).await;
            let mut body = reference.clone();
            body["lease_seconds"] = json!(self.plan.lease_seconds);
            match self.call("/api/internal/renew-lease", &body).await {
                Call::Answered(StatusCode::OK, _) => {
                    self.counters.renewals.fetch_add(1, Ordering::Relaxed);
                }
                Call::Answered(status, body) => {
                    self.counters.error(format!("renew: {status} {body}"))
                }
                Call::Unreachable => {}
            }
            tokio::time::sleep(Duration::from_millis(hold_ms - hold_ms / 2)).await;
        } else {
            tokio::time::sleep(Duration::from_millis(hold_ms)).await;
        }
        // done with the credential (or crashed): from here this executor no longer uses it
        holding.fetch_sub(1, Ordering::SeqCst);
        if crash {
            self.counters.crashes.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut body = reference;
        body.as_object_mut()
            .unwrap()
            .extend(outcome.as_object().unwrap().clone());
        match self.call("/api/internal/release-key", &body).await {
            Call::Answered(StatusCode::OK, answer) if answer["released"] == true => {
                self.counters.releases.fetch_add(1, Ordering::Relaxed);
            }
            Call::Answered(status, answer) => {
                self.counters.error(format!("release: {status} {answer}"))
            }
            Call::Unreachable => {}
        }
    }
}

/// Whether the audit trail and the slots tell one consistent story — nothing half-written, nothing
/// lost. Returns the broken rules (empty when consistent):
/// - every slot that holds a lease has that lease's `granted` row, for the same slot;
/// - every lease in the trail was granted, and ended at most once;
/// - every granted lease either still holds its slot or has ended in the trail.
pub async fn trail_inconsistencies(db: &PgPool) -> Vec<String> {
    let checks = [
        (
            "a slot holds a lease with no granted row",
            "SELECT count(*) FROM lease_slots s WHERE s.lease_id IS NOT NULL AND NOT EXISTS (
                 SELECT 1 FROM lease_events e WHERE e.lease_id = s.lease_id AND e.event = 'granted'
                     AND e.key_id = s.key_id AND e.slot = s.slot)",
        ),
        (
            "a lease in the trail was never granted",
            "SELECT count(DISTINCT lease_id) FROM lease_events e WHERE NOT EXISTS (
                 SELECT 1 FROM lease_events g WHERE g.lease_id = e.lease_id AND g.event = 'granted')",
        ),
        (
            "a lease was granted twice",
            "SELECT count(*) FROM (SELECT lease_id FROM lease_events WHERE event = 'granted'
                 GROUP BY lease_id HAVING count(*) > 1) d",
        ),
        (
            "a lease ended more than once",
            "SELECT count(*) FROM (SELECT lease_id FROM lease_events
                 WHERE event IN ('released', 'expired', 'force_released')
                 GROUP BY lease_id HAVING count(*) > 1) d",
        ),
        (
            "a granted lease neither holds its slot nor ended",
            "SELECT count(*) FROM lease_events g WHERE g.event = 'granted'
                 AND NOT EXISTS (SELECT 1 FROM lease_slots s WHERE s.lease_id = g.lease_id)
                 AND NOT EXISTS (SELECT 1 FROM lease_events e WHERE e.lease_id = g.lease_id
                     AND e.event IN ('released', 'expired', 'force_released'))",
        ),
    ];
    let mut broken = Vec::new();
    for (rule, sql) in checks {
        let count: i64 = sqlx::query_scalar(sql)
            .fetch_one(db)
            .await
            .expect("trail check");
        if count > 0 {
            broken.push(format!("{rule}: {count}"));
        }
    }
    broken
}

/// The resident set size of process `pid`, in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}
