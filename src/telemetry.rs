//! Metrics (Prometheus text format at `GET /metrics`, through the `metrics` crate and its
//! Prometheus exporter) and the names of every series. Label values are bounded: results,
//! reasons, routes, and the provider / pool names operators configure — never lease ids, key ids
//! or secrets.
//!
//! "No capacity" and "store down" are different results of the same counter
//! (`credpool_allocations_total{result="pool_exhausted"}` vs `{result="store_unavailable"}`), so
//! an alert on the second never fires for the first.

use std::sync::OnceLock;
use std::time::Duration;

use crate::store::Db;
use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Allocations by `provider`, `pool` (asked for), `served_pool` (after any fallback; empty unless
/// leased) and `result`: `leased`, `pool_exhausted`, `model_not_supported`,
/// `no_usable_credentials`, `pool_not_found`, `store_unavailable`, `bad_request`, `unauthorized`,
/// `internal_error`.
pub const ALLOCATIONS: &str = "credpool_allocations_total";
/// Request latency in seconds by `route` (the matched path) and `status` class (`2xx`, `4xx`, ...).
pub const REQUEST_SECONDS: &str = "credpool_request_duration_seconds";
/// Releases by `result` (`released`, `not_released`) and `reason` (`mismatch`, `expired`,
/// `not_found`, or empty).
pub const RELEASES: &str = "credpool_releases_total";
/// Renewals by `result` (`renewed`, `lost`).
pub const RENEWALS: &str = "credpool_renewals_total";
/// Leases that ended by expiry, by `source`: `claim` (a claim reused the slot), `reaper` (the
/// cleanup this service ran), `late_report` (an executor reported after expiry).
pub const LEASES_EXPIRED: &str = "credpool_leases_expired_total";
/// Unexpired leases per `provider` / `pool` (sampled).
pub const LEASES_IN_FLIGHT: &str = "credpool_leases_in_flight";
/// Free slots per `provider` / `pool` (sampled).
pub const SLOTS_FREE: &str = "credpool_slots_free";
/// Credentials per `provider` / `pool` / `status` (sampled).
pub const CREDENTIALS: &str = "credpool_credentials";
/// Credentials cooling down per `provider` / `pool` (sampled).
pub const CREDENTIALS_COOLING: &str = "credpool_credentials_cooling_down";
/// Credentials drained per `provider` / `pool` (sampled).
pub const CREDENTIALS_DRAINING: &str = "credpool_credentials_draining";
/// Database connections of this process by `state` (`in_use`, `idle`).
pub const DB_CONNECTIONS: &str = "credpool_db_connections";
/// Seconds a request waited for a database connection.
pub const DB_ACQUIRE_SECONDS: &str = "credpool_db_acquire_seconds";
/// Requests that gave up waiting for a database connection.
pub const DB_ACQUIRE_TIMEOUTS: &str = "credpool_db_acquire_timeouts_total";

/// Allocations waiting for a slot right now (`wait_ms`; src/waiting.rs).
pub const WAITERS: &str = "credpool_allocations_waiting";
/// Seconds a waiting allocation waited, by `result` (`leased`, `pool_exhausted`, or the other
/// allocation results).
pub const WAIT_SECONDS: &str = "credpool_allocation_wait_seconds";

/// Operations per group transaction (src/groups.rs), by `kind` (`claim`, `release`,
/// `renewal`).
pub const GROUP_SIZE: &str = "credpool_group_size";

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// How often the recorder folds the histogram samples recorded since into its buckets.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// The process's Prometheus recorder, installed on first use (one per process, shared by every
/// app the process serves), with a thread that runs its upkeep every [`UPKEEP_INTERVAL`]: the
/// recorder keeps every histogram sample until upkeep folds it into the buckets, so without it
/// memory grows with each request whenever nobody scrapes `/metrics` (the soak found ~4 MB a
/// minute).
pub fn prometheus() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let handle = PrometheusBuilder::new()
            .set_buckets(&[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0,
            ])
            .expect("static buckets")
            .set_buckets_for_metric(
                Matcher::Full(GROUP_SIZE.to_owned()),
                &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0],
            )
            .expect("static buckets")
            .set_buckets_for_metric(
                Matcher::Full(WAIT_SECONDS.to_owned()),
                &[
                    0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
                ],
            )
            .expect("static buckets")
            .install_recorder()
            .expect("the metrics recorder is installed once per process");
        let upkeep = handle.clone();
        std::thread::Builder::new()
            .name("metrics-upkeep".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(UPKEEP_INTERVAL);
                    upkeep.run_upkeep();
                }
            })
            .expect("starting the metrics upkeep thread");
        handle
    })
}

/// Renders every series, after updating the connection gauges of `db`.
pub fn render(db: &Db) -> String {
    let handle = prometheus();
    let db = db.pool();
    let size = db.size() as f64;
    let idle = db.num_idle() as f64;
    gauge!(DB_CONNECTIONS, "state" => "in_use").set(size - idle);
    gauge!(DB_CONNECTIONS, "state" => "idle").set(idle);
    handle.run_upkeep();
    handle.render()
}

/// Records one allocation.
pub fn allocation(provider: &str, pool: &str, served_pool: &str, result: &'static str) {
    counter!(ALLOCATIONS, "provider" => provider.to_owned(), "pool" => pool.to_owned(),
             "served_pool" => served_pool.to_owned(), "result" => result)
    .increment(1);
}

/// Records one request's latency.
pub fn request(route: String, status: u16, elapsed: Duration) {
    let class = match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    };
    histogram!(REQUEST_SECONDS, "route" => route, "status" => class).record(elapsed.as_secs_f64());
}

/// Records a release.
pub fn release(released: bool, reason: &'static str) {
    let result = if released { "released" } else { "not_released" };
    counter!(RELEASES, "result" => result, "reason" => reason).increment(1);
}

/// Records a renewal.
pub fn renewal(renewed: bool) {
    counter!(RENEWALS, "result" => if renewed { "renewed" } else { "lost" }).increment(1);
}

/// Records leases ended by expiry.
pub fn expired(source: &'static str, count: u64) {
    if count > 0 {
        counter!(LEASES_EXPIRED, "source" => source).increment(count);
    }
}

/// Counts waiters in (`1`) and out (`-1`).
pub fn waiters(delta: i8) {
    gauge!(WAITERS).increment(f64::from(delta));
}

/// Records how long a waiting allocation waited and how it ended.
pub fn waited(result: &'static str, elapsed: Duration) {
    histogram!(WAIT_SECONDS, "result" => result).record(elapsed.as_secs_f64());
}

/// Records the size of one group transaction.
pub fn group(kind: &'static str, operations: usize) {
    histogram!(GROUP_SIZE, "kind" => kind).record(operations as f64);
}

/// Records a wait for a database connection.
pub fn acquired(elapsed: Duration, timed_out: bool) {
    histogram!(DB_ACQUIRE_SECONDS).record(elapsed.as_secs_f64());
    if timed_out {
        counter!(DB_ACQUIRE_TIMEOUTS).increment(1);
    }
}

/// Samples the per-pool gauges from PostgreSQL every `interval` (not per scrape), until the pool
/// closes. A failed sample keeps the previous values.
pub fn spawn_sampler(db: Db, interval: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            if db.pool().is_closed() {
                return;
            }
            match crate::store::credentials::pools(&db).await {
                Ok(pools) => {
                    for p in pools {
                        let labels = [("provider", p.provider.clone()), ("pool", p.pool.clone())];
                        gauge!(LEASES_IN_FLIGHT, &labels).set(p.in_flight as f64);
                        gauge!(SLOTS_FREE, &labels)
                            .set((p.total_slots - p.in_flight).max(0) as f64);
                        gauge!(CREDENTIALS_COOLING, &labels).set(p.cooling_down as f64);
                        gauge!(CREDENTIALS_DRAINING, &labels).set(p.draining as f64);
                        for status in crate::domain::Status::ALL {
                            let n = p.by_status.get(status.as_str()).copied().unwrap_or(0);
                            gauge!(CREDENTIALS, "provider" => p.provider.clone(), "pool" => p.pool.clone(),
                                   "status" => status.as_str())
                            .set(n as f64);
                        }
                    }
                }
                Err(error) => tracing::debug!(error = %error, "metrics sample failed"),
            }
        }
    })
}
