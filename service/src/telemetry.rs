//! Metrics (Prometheus text format at `GET /metrics`, through the `metrics` crate and its
//! Prometheus exporter) and the names of every series. Label values are bounded: results,
//! reasons, routes, and the provider / pool names operators configure — never lease ids, key ids
//! or secrets.
//!
//! "No capacity" and "store down" are different results of the same counter
//! (`credpool_allocations_total{result="pool_exhausted"}` vs `{result="store_unavailable"}`), so
//! an alert on the second never fires for the first.

use std::sync::OnceLock;

use credpool_protocol::ErrorCode;
use std::time::Duration;

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Allocations by `provider`, `pool` (asked for), `served_pool` (after any fallback; empty unless
/// leased) and `result`: [`ALLOCATION_RESULTS`] for requests that reached the allocator,
/// [`REFUSED_RESULTS`] (with empty provider and pool) for those refused before. A refused
/// request's provider and pool are labels only when the pool exists (this process's view of it
/// has credentials); otherwise both are empty, so no request can add series.
pub const ALLOCATIONS: &str = "credpool_allocations_total";
/// Allocate requests by the caller's `tenant` (a configured tenant: bounded) and `result` (as
/// [`ALLOCATIONS`]).
pub const TENANT_ALLOCATIONS: &str = "credpool_tenant_allocations_total";
/// Leased allocations that named an `affinity_key`, by `provider`, `pool` (asked for) and `result`
/// ([`AFFINITY_RESULTS`]): whether the conversation's bound credential served it.
pub const ALLOCATIONS_AFFINITY: &str = "credpool_allocations_affinity_total";
/// What `result` of [`ALLOCATIONS_AFFINITY`] can say (bounded: one series per pool and result).
pub const AFFINITY_RESULTS: [&str; 3] = ["hit", "new", "moved"];
/// Request latency in seconds by `route` (the matched path) and `status` class (`2xx`, `4xx`, ...).
pub const REQUEST_SECONDS: &str = "credpool_request_duration_seconds";
/// Releases by `result` (`released`, `not_released`) and `reason` (`mismatch`, `expired`,
/// `not_found`, or empty).
pub const RELEASES: &str = "credpool_releases_total";
/// Renewals by `result` (`renewed`, `lost`).
pub const RENEWALS: &str = "credpool_renewals_total";
/// Relay calls (`/relay/{provider}/{pool}/...`) by `provider`, `pool` (that served; both empty
/// for a call refused before a lease) and `outcome` ([`RELAY_OUTCOMES`]).
pub const RELAY_CALLS: &str = "credpool_relay_calls_total";
/// What `outcome` of [`RELAY_CALLS`] can say: the outcome the relay reported at release, or how
/// the call ended without one (`client_closed`: the client went away first; `lease_lost`: the
/// lease could not be renewed and the call was cut; `upstream_unreachable`, `upstream_timeout`;
/// `refused`: credpool answered the call itself, before it took a lease).
pub const RELAY_OUTCOMES: [&str; 9] = [
    "success",
    "failure",
    "rate_limited",
    "auth_expired",
    "quota_exhausted",
    "client_closed",
    "lease_lost",
    "upstream_unreachable",
    "upstream_timeout",
];
/// OAuth access token refreshes this process ran, by `result` (`refreshed`, `superseded`,
/// `failed`, `invalid_grant`).
pub const OAUTH_REFRESHES: &str = "credpool_oauth_refreshes_total";
/// Leases that ended by expiry, by `source`: `claim` (a claim reused the slot), `reaper` (the
/// cleanup this service ran).
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
/// Seconds until the earliest OAuth access token (of a credential not disabled) expires, per
/// `provider` / `pool` (sampled; negative: already expired or rejected; +Inf: the pool has no
/// OAuth credential in traffic).
pub const OAUTH_TOKEN_EXPIRES_IN: &str = "credpool_oauth_token_expires_in_seconds";
/// 1 when the last sample of the per-pool gauges read PostgreSQL, 0 when it failed.
pub const STORE_UP: &str = "credpool_store_up";
/// Database connections of this process by `state` (`in_use`, `idle`).
pub const DB_CONNECTIONS: &str = "credpool_db_connections";
/// Seconds a request waited for a database connection.
pub const DB_ACQUIRE_SECONDS: &str = "credpool_db_acquire_seconds";
/// Requests that gave up waiting for a database connection.
pub const DB_ACQUIRE_TIMEOUTS: &str = "credpool_db_acquire_timeouts_total";

/// Allocations waiting for a slot right now (`wait_ms`).
pub const WAITERS: &str = "credpool_allocations_waiting";
/// 1 while this process's listening connection for waiting allocations is up,
/// 0 while it is down or not opened yet.
pub const WAITS_LISTENING: &str = "credpool_waits_listening";
/// Seconds a waiting allocation waited, by `result` (`leased`, `pool_exhausted`, or the other
/// allocation results).
pub const WAIT_SECONDS: &str = "credpool_allocation_wait_seconds";

/// Allocations answered 429 `pool_exhausted`, by `provider`, `pool` (asked for) and `held_by`:
/// what held back the candidate that frees first (`slots`, `cooldown`, `requests_window`,
/// `tokens_window`, `token_refresh`, `fair_share`).
pub const HELD_BACK: &str = "credpool_allocations_held_back_total";

/// What `held_by` of [`HELD_BACK`] can say.
pub const HELD_BY: [&str; 6] = [
    "slots",
    "cooldown",
    "requests_window",
    "tokens_window",
    "token_refresh",
    "fair_share",
];

/// Background tasks that panicked and were made again, by `task` (a fixed name:
/// the background supervisor).
pub const BACKGROUND_TASK_RESTARTS: &str = "credpool_background_task_restarts_total";
/// Instances of a background task that panicked and wait to be made again, by `task`; `/readyz`
/// answers 503 while one does.
pub const BACKGROUND_TASKS_DOWN: &str = "credpool_background_tasks_down";

/// HTTP connections open now in this process.
pub const HTTP_CONNECTIONS: &str = "credpool_http_connections";
/// HTTP connections the service closed itself, by `reason` ([`HTTP_DROP_REASONS`]).
pub const HTTP_CONNECTIONS_DROPPED: &str = "credpool_http_connections_dropped_total";
/// What `reason` of [`HTTP_CONNECTIONS_DROPPED`] can say.
pub const HTTP_DROP_REASONS: [&str; 3] = ["header_timeout", "idle_timeout", "evicted"];

/// Seconds the continuous proof of the audit trail is behind, per `proof`
/// ([`crate::domain::AUDIT_PROOFS`]): now minus the moment up to which it has judged every grant
/// (sampled; +Inf before its first chunk).
pub const AUDIT_PROOF_LAG: &str = "credpool_audit_proof_lag_seconds";
/// Grants the continuous proof has found breaking its rule since it began, per `proof` (sampled):
/// anything but 0 is a breach.
pub const AUDIT_VIOLATIONS: &str = "credpool_audit_violations";

/// Operations per group transaction (the allocator's claim, release and renewal groups), by `kind` (`claim`, `release`,
/// `renewal`).
pub const GROUP_SIZE: &str = "credpool_group_size";

/// Always 1, labelled with the `version` (Cargo.toml) and the `git_commit` the binary was built
/// from (`build.rs`; `unknown` when built without git).
pub const BUILD_INFO: &str = "credpool_build_info";

/// The git commit this binary was built from (`build.rs`), or `unknown`.
pub const GIT_COMMIT: &str = env!("CREDPOOL_GIT_COMMIT");

/// The version line of `credpool --version`: the package version and the git commit.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (git ",
    env!("CREDPOOL_GIT_COMMIT"),
    ")"
);

/// The `result` of an allocation that reached the allocator, per provider and pool: `leased`, or
/// the code of the error it answered with.
pub const ALLOCATION_RESULTS: [&str; 10] = [
    "leased",
    ErrorCode::PoolExhausted.as_str(),
    ErrorCode::TenantLimit.as_str(),
    ErrorCode::ModelNotSupported.as_str(),
    ErrorCode::NoUsableCredentials.as_str(),
    ErrorCode::PoolNotFound.as_str(),
    ErrorCode::RequestIdConflict.as_str(),
    ErrorCode::TokensExceedBudget.as_str(),
    ErrorCode::InternalError.as_str(),
    ErrorCode::StoreUnavailable.as_str(),
];

/// The `result` of an allocation refused before its provider and pool were read, or of one
/// whose pool does not exist (counted with empty `provider`, `pool` and `served_pool`): a
/// malformed body, a wrong key, a pool outside the tenant's scope, a pool without credentials, a
/// panic, a request timeout.
pub const REFUSED_RESULTS: [&str; 6] = [
    "bad_request",
    ErrorCode::Unauthorized.as_str(),
    ErrorCode::PoolNotAllowed.as_str(),
    ErrorCode::PoolNotFound.as_str(),
    ErrorCode::InternalError.as_str(),
    ErrorCode::StoreUnavailable.as_str(),
];

/// What kind of series a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (resets when the process restarts).
    Counter,
    /// A value now.
    Gauge,
    /// A distribution, in buckets.
    Histogram,
}

/// One of credpool's metrics: the `# HELP` line says what it counts and in which unit.
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    /// The series name.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: Kind,
    /// Its labels, in the order they are documented.
    pub labels: &'static [&'static str],
    /// The unit of its values, in words (`seconds`, `leases`, ...).
    pub unit: &'static str,
    /// What it is for.
    pub help: &'static str,
}

/// Every metric credpool exports besides the `process_*` ones (`metrics-process`). docs/metrics.md
/// lists the same, and a test keeps the two in step.
pub const METRICS: &[Metric] = &[
    Metric {
        name: ALLOCATIONS,
        kind: Kind::Counter,
        labels: &["provider", "pool", "served_pool", "result"],
        unit: "requests",
        help: "Allocate requests by provider and pool asked for (both empty when the pool does not exist or the request was refused before it was read), the pool that served (empty unless leased) and result: leased, pool_exhausted (429, no capacity), tenant_limit (429, the caller's tenant at its cap), pool_not_allowed (403, outside the tenant's pools), store_unavailable (503, store down), or another error code.",
    },
    Metric {
        name: TENANT_ALLOCATIONS,
        kind: Kind::Counter,
        labels: &["tenant", "result"],
        unit: "requests",
        help: "Allocate requests whose key named a tenant, by tenant (default for the internal key; tenants are configured, so the label is bounded) and result, as in credpool_allocations_total: tenant_limit (429, the tenant at its cap) apart from pool_exhausted (429, the pool full).",
    },
    Metric {
        name: ALLOCATIONS_AFFINITY,
        kind: Kind::Counter,
        labels: &["provider", "pool", "result"],
        unit: "requests",
        help: "Leased allocate requests that named an affinity_key, by provider and pool asked for and result: hit (the conversation's bound credential served), new (no live binding), moved (the bound credential could not serve now; another did and the binding moved).",
    },
    Metric {
        name: HELD_BACK,
        kind: Kind::Counter,
        labels: &["provider", "pool", "held_by"],
        unit: "requests",
        help: "Allocate requests answered 429 pool_exhausted, by provider and pool asked for and what held back the candidate that frees first: slots (all leased), cooldown, requests_window or tokens_window (a rate window full), token_refresh (an OAuth token waiting for its refresh), fair_share (a waiting request yielded to a tenant further below its share).",
    },
    Metric {
        name: RELEASES,
        kind: Kind::Counter,
        labels: &["result", "reason"],
        unit: "releases",
        help: "Release requests by result (released, not_released) and reason (mismatch, expired, not_found; empty when released).",
    },
    Metric {
        name: RELAY_CALLS,
        kind: Kind::Counter,
        labels: &["provider", "pool", "outcome"],
        unit: "calls",
        help: "Relay calls by provider, pool (that served) and outcome (success, failure, rate_limited, auth_expired, quota_exhausted, client_closed, lease_lost, upstream_unreachable, upstream_timeout; refused, with empty provider and pool, for calls credpool answered itself).",
    },
    Metric {
        name: RENEWALS,
        kind: Kind::Counter,
        labels: &["result"],
        unit: "renewals",
        help: "Renewal requests by result: renewed, or lost (410: the lease had expired or ended).",
    },
    Metric {
        name: OAUTH_REFRESHES,
        kind: Kind::Counter,
        labels: &["result"],
        unit: "refreshes",
        help: "OAuth access token refreshes this process ran, by result: refreshed, superseded (the generation moved while the call ran; nothing written), failed (retried with backoff) or invalid_grant (the refresh token was rejected; the credential is disabled until an operator PUTs a new secret).",
    },
    Metric {
        name: LEASES_EXPIRED,
        kind: Kind::Counter,
        labels: &["source"],
        unit: "leases",
        help: "Leases that ended by running out instead of a release (a crashed or slow executor), by who noticed: claim (an allocation reused the slot) or reaper (this process's cleanup).",
    },
    Metric {
        name: BACKGROUND_TASK_RESTARTS,
        kind: Kind::Counter,
        labels: &["task"],
        unit: "restarts",
        help: "Background tasks of this process that panicked and were started again after a backoff, by task (oauth_refresher, view_refresher, claim_group, release_group, renewal_group, waits_listener, waiters_alive, slot_announcer, maintenance, metrics_sampler).",
    },
    Metric {
        name: BACKGROUND_TASKS_DOWN,
        kind: Kind::Gauge,
        labels: &["task"],
        unit: "tasks",
        help: "Instances of a background task that panicked and wait to be started again, by task; /readyz answers 503 not_ready while one does.",
    },
    Metric {
        name: HTTP_CONNECTIONS_DROPPED,
        kind: Kind::Counter,
        labels: &["reason"],
        unit: "connections",
        help: "HTTP connections the service closed itself, by reason: header_timeout (a request head not sent whole within --http-header-read-timeout-seconds, or nothing sent on a new connection within it), idle_timeout (a keep-alive connection with no request for --http-idle-timeout-seconds), evicted (at --http-max-connections, the oldest connection with no request in flight made room for a new one).",
    },
    Metric {
        name: HTTP_CONNECTIONS,
        kind: Kind::Gauge,
        labels: &[],
        unit: "connections",
        help: "HTTP connections open now in this process (at most --http-max-connections, as fitted to the open-file limit, plus the one being accepted).",
    },
    Metric {
        name: DB_ACQUIRE_TIMEOUTS,
        kind: Kind::Counter,
        labels: &[],
        unit: "requests",
        help: "Requests that gave up waiting for a database connection (answered 503).",
    },
    Metric {
        name: REQUEST_SECONDS,
        kind: Kind::Histogram,
        labels: &["route", "status"],
        unit: "seconds",
        help: "Time from receiving a request to its response, by matched route and status class (2xx, 4xx, 5xx).",
    },
    Metric {
        name: DB_ACQUIRE_SECONDS,
        kind: Kind::Histogram,
        labels: &[],
        unit: "seconds",
        help: "Time a request waited for a database connection from the pool.",
    },
    Metric {
        name: WAIT_SECONDS,
        kind: Kind::Histogram,
        labels: &["result"],
        unit: "seconds",
        help: "Time a waiting allocation (wait_ms) waited for a slot, by how it ended (leased, pool_exhausted, ...).",
    },
    Metric {
        name: GROUP_SIZE,
        kind: Kind::Histogram,
        labels: &["kind"],
        unit: "operations",
        help: "Operations per group transaction, by kind (claim, release, renewal).",
    },
    Metric {
        name: LEASES_IN_FLIGHT,
        kind: Kind::Gauge,
        labels: &["provider", "pool"],
        unit: "leases",
        help: "Unexpired leases per provider and pool, sampled from PostgreSQL every --metrics-sample-seconds (every replica reports the same value).",
    },
    Metric {
        name: SLOTS_FREE,
        kind: Kind::Gauge,
        labels: &["provider", "pool"],
        unit: "slots",
        help: "Slots not held by an unexpired lease per provider and pool (of every credential, usable or not), sampled.",
    },
    Metric {
        name: CREDENTIALS,
        kind: Kind::Gauge,
        labels: &["provider", "pool", "status"],
        unit: "credentials",
        help: "Credentials per provider, pool and status (available, rate_limited, cooldown, pending, disabled, exhausted), sampled.",
    },
    Metric {
        name: CREDENTIALS_COOLING,
        kind: Kind::Gauge,
        labels: &["provider", "pool"],
        unit: "credentials",
        help: "Credentials resting until a known moment (cooldown, rate limit) per provider and pool, sampled.",
    },
    Metric {
        name: CREDENTIALS_DRAINING,
        kind: Kind::Gauge,
        labels: &["provider", "pool"],
        unit: "credentials",
        help: "Credentials an operator is draining (no new leases) per provider and pool, sampled.",
    },
    Metric {
        name: OAUTH_TOKEN_EXPIRES_IN,
        kind: Kind::Gauge,
        labels: &["provider", "pool"],
        unit: "seconds",
        help: "Seconds until the earliest OAuth access token of a credential in traffic expires, per provider and pool, sampled (negative: expired or rejected and not yet refreshed; +Inf: no OAuth credential in traffic).",
    },
    Metric {
        name: STORE_UP,
        kind: Kind::Gauge,
        labels: &[],
        unit: "boolean",
        help: "1 when the last sample of the per-pool gauges read PostgreSQL, 0 when it failed (the store is down or slow).",
    },
    Metric {
        name: DB_CONNECTIONS,
        kind: Kind::Gauge,
        labels: &["state"],
        unit: "connections",
        help: "Database connections of this process by state (in_use, idle), at scrape time.",
    },
    Metric {
        name: WAITERS,
        kind: Kind::Gauge,
        labels: &[],
        unit: "requests",
        help: "Allocations waiting for a slot (wait_ms) right now in this process.",
    },
    Metric {
        name: WAITS_LISTENING,
        kind: Kind::Gauge,
        labels: &[],
        unit: "boolean",
        help: "1 while this process's LISTEN connection for waiting allocations is up; 0 while it is down or not opened yet (waiters then wake on their timers and this process's own releases only).",
    },
    Metric {
        name: AUDIT_PROOF_LAG,
        kind: Kind::Gauge,
        labels: &["proof"],
        unit: "seconds",
        help: "How far behind the trail the continuous proof of the audit trail is, per proof (oversell, windows, tenant_cap, tenant_windows): now minus the moment up to which it has judged every grant, sampled from PostgreSQL (+Inf before its first chunk).",
    },
    Metric {
        name: AUDIT_VIOLATIONS,
        kind: Kind::Gauge,
        labels: &["proof"],
        unit: "grants",
        help: "Grants the continuous proof of the audit trail has found over a credential's limit (oversell), a credential's rate window (windows), a tenant's cap (tenant_cap) or a tenant's rate window (tenant_windows) since it began, sampled from PostgreSQL: anything but 0 is a breach (credpool audit verify names them).",
    },
    Metric {
        name: BUILD_INFO,
        kind: Kind::Gauge,
        labels: &["version", "git_commit"],
        unit: "constant 1",
        help: "Always 1; the labels name the credpool version and the git commit it was built from.",
    },
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// The `process_*` metrics (CPU seconds, resident and virtual memory, open and max fds, threads,
/// start time), read from `/proc` at each scrape.
static PROCESS: OnceLock<metrics_process::Collector> = OnceLock::new();

/// How often the recorder folds the histogram samples recorded since into its buckets.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// The process's Prometheus recorder, installed on first use (one per process, shared by every
/// app the process serves), with a thread that runs its upkeep every [`UPKEEP_INTERVAL`]: the
/// recorder keeps every histogram sample until upkeep folds it into the buckets, so without it
/// memory grows with each request whenever nobody scrapes `/metrics` (the soak found ~4 MB a
/// minute).
///
/// Installing it describes every metric of [`METRICS`] (their `# HELP` lines) and the process
/// metrics, sets `credpool_build_info`, and creates every series whose labels are known in
/// advance at zero (see [`zero_series`]), so that a fresh process already shows them.
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
        describe();
        let process = PROCESS.get_or_init(metrics_process::Collector::default);
        process.describe();
        zero_series();
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

/// The `# HELP` line of every metric: what it is for, then its unit.
fn describe() {
    for metric in METRICS {
        let help = format!("{} Unit: {}.", metric.help, metric.unit);
        let unit = match metric.unit {
            "seconds" => Unit::Seconds,
            _ => Unit::Count,
        };
        match metric.kind {
            Kind::Counter => describe_counter!(metric.name, unit, help),
            Kind::Gauge => describe_gauge!(metric.name, unit, help),
            Kind::Histogram => describe_histogram!(metric.name, unit, help),
        }
    }
}

/// Every series whose label values are known before anything happens, at zero (Prometheus'
/// instrumentation guide: avoid missing metrics), so that `rate()` and alerts have something to
/// compare against from the first scrape: releases by result and reason, renewals by result,
/// expiries by source, connection timeouts, the waiter gauge, the allocations refused before
/// their pool was known, and `credpool_build_info`. Per-pool series come with the pools:
/// [`pool_known`].
fn zero_series() {
    counter!(RELEASES, "result" => "released", "reason" => "").absolute(0);
    for reason in ["mismatch", "expired", "not_found"] {
        counter!(RELEASES, "result" => "not_released", "reason" => reason).absolute(0);
    }
    for result in ["renewed", "lost"] {
        counter!(RENEWALS, "result" => result).absolute(0);
    }
    counter!(RELAY_CALLS, "provider" => "", "pool" => "", "outcome" => "refused").absolute(0);
    for result in ["refreshed", "superseded", "failed", "invalid_grant"] {
        counter!(OAUTH_REFRESHES, "result" => result).absolute(0);
    }
    for source in ["claim", "reaper"] {
        counter!(LEASES_EXPIRED, "source" => source).absolute(0);
    }
    counter!(DB_ACQUIRE_TIMEOUTS).absolute(0);
    for reason in HTTP_DROP_REASONS {
        counter!(HTTP_CONNECTIONS_DROPPED, "reason" => reason).absolute(0);
    }
    gauge!(HTTP_CONNECTIONS).set(0.0);
    gauge!(WAITERS).set(0.0);
    gauge!(WAITS_LISTENING).set(0.0);
    for result in [
        "leased",
        ErrorCode::PoolExhausted.as_str(),
        ErrorCode::TenantLimit.as_str(),
    ] {
        counter!(TENANT_ALLOCATIONS, "tenant" => "default", "result" => result).absolute(0);
    }
    for result in REFUSED_RESULTS {
        counter!(ALLOCATIONS, "provider" => "", "pool" => "", "served_pool" => "", "result" => result)
            .absolute(0);
    }
    for proof in crate::domain::AUDIT_PROOFS {
        gauge!(AUDIT_PROOF_LAG, "proof" => proof).set(f64::INFINITY);
        gauge!(AUDIT_VIOLATIONS, "proof" => proof).set(0.0);
    }
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION"), "git_commit" => GIT_COMMIT).set(1.0);
}

/// Creates the allocation series of a pool at zero (adding nothing to those that exist): every
/// result of [`ALLOCATION_RESULTS`], `leased` once per pool of its sequence (`vip` may be served
/// by `default`).
pub fn pool_known(provider: &str, pool: &str) {
    for held_by in HELD_BY {
        counter!(HELD_BACK, "provider" => provider.to_owned(), "pool" => pool.to_owned(),
                 "held_by" => held_by)
        .increment(0);
    }
    for result in AFFINITY_RESULTS {
        counter!(ALLOCATIONS_AFFINITY, "provider" => provider.to_owned(),
                 "pool" => pool.to_owned(), "result" => result)
        .increment(0);
    }
    for result in ALLOCATION_RESULTS {
        if result == "leased" {
            let served = match crate::domain::PoolName::parse(pool) {
                Ok(name) => name.sequence().iter().map(|p| p.to_string()).collect(),
                Err(_) => vec![pool.to_owned()],
            };
            for served_pool in served {
                counter!(ALLOCATIONS, "provider" => provider.to_owned(), "pool" => pool.to_owned(),
                         "served_pool" => served_pool, "result" => result)
                .increment(0);
            }
        } else {
            counter!(ALLOCATIONS, "provider" => provider.to_owned(), "pool" => pool.to_owned(),
                     "served_pool" => "", "result" => result)
            .increment(0);
        }
    }
}

/// Renders every series, after updating the connection gauges (`connections` open in the
/// service's pool, `idle` of them) and the process metrics.
pub fn render(connections: u32, idle: usize) -> String {
    let handle = prometheus();
    let size = f64::from(connections);
    let idle = idle as f64;
    gauge!(DB_CONNECTIONS, "state" => "in_use").set(size - idle);
    gauge!(DB_CONNECTIONS, "state" => "idle").set(idle);
    if let Some(process) = PROCESS.get() {
        process.collect();
    }
    handle.run_upkeep();
    handle.render()
}

/// Records one allocation, and for a caller whose tenant the store named (`tenant` not empty:
/// a configured tenant, so the label is bounded) its tenant's series too.
pub fn allocation(
    provider: &str,
    pool: &str,
    served_pool: &str,
    tenant: &str,
    result: &'static str,
) {
    counter!(ALLOCATIONS, "provider" => provider.to_owned(), "pool" => pool.to_owned(),
             "served_pool" => served_pool.to_owned(), "result" => result)
    .increment(1);
    if !tenant.is_empty() {
        counter!(TENANT_ALLOCATIONS, "tenant" => tenant.to_owned(), "result" => result)
            .increment(1);
    }
}

/// Records a leased allocation's affinity result (`provider`, `pool` asked for).
pub fn affinity(provider: &str, pool: &str, result: crate::domain::AffinityResult) {
    counter!(ALLOCATIONS_AFFINITY, "provider" => provider.to_owned(), "pool" => pool.to_owned(),
             "result" => result.as_str())
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
/// An allocation of `provider`/`pool` answered 429, held back by `held_by`.
pub fn held_back(
    provider: &crate::domain::ProviderName,
    pool: &crate::domain::PoolName,
    held_by: crate::domain::HeldBy,
) {
    counter!(HELD_BACK, "provider" => provider.to_string(), "pool" => pool.to_string(),
             "held_by" => held_by.as_str())
    .increment(1);
}

pub fn release(released: bool, reason: &'static str) {
    let result = if released { "released" } else { "not_released" };
    counter!(RELEASES, "result" => result, "reason" => reason).increment(1);
}

/// Counts a relay call that ended with `outcome` ([`RELAY_OUTCOMES`], or `refused` with empty
/// provider and pool). `provider` is a configured upstream's and `pool` one that served, so that
/// no request can add series.
pub fn relay_call(provider: &str, pool: &str, outcome: &'static str) {
    counter!(RELAY_CALLS, "provider" => provider.to_owned(), "pool" => pool.to_owned(),
             "outcome" => outcome)
    .increment(1);
}

/// Sets how many HTTP connections are open.
pub fn http_connections(open: usize) {
    gauge!(HTTP_CONNECTIONS).set(open as f64);
}

/// Counts a connection the service closed itself, by `reason` ([`HTTP_DROP_REASONS`]).
pub fn http_connection_dropped(reason: &'static str) {
    counter!(HTTP_CONNECTIONS_DROPPED, "reason" => reason).increment(1);
}

/// Creates a background task's series at zero (adding nothing to those that exist).
pub fn background_task_known(task: &'static str) {
    counter!(BACKGROUND_TASK_RESTARTS, "task" => task).increment(0);
    gauge!(BACKGROUND_TASKS_DOWN, "task" => task).increment(0.0);
}

/// Counts a restart of a panicked background task.
pub fn background_task_restarted(task: &'static str) {
    counter!(BACKGROUND_TASK_RESTARTS, "task" => task).increment(1);
}

/// Sets how many instances of a background task are down now.
pub fn background_tasks_down(task: &'static str, down: usize) {
    gauge!(BACKGROUND_TASKS_DOWN, "task" => task).set(down as f64);
}

/// Counts an OAuth refresh by `result` (see [`OAUTH_REFRESHES`]).
pub fn oauth_refresh(result: &'static str) {
    counter!(OAUTH_REFRESHES, "result" => result).increment(1);
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

/// Whether the listening connection for waiting allocations is up.
pub fn waits_listening(up: bool) {
    gauge!(WAITS_LISTENING).set(if up { 1.0 } else { 0.0 });
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

/// One pool's figures, as the metrics sampler read them from PostgreSQL (the per-pool gauges).
#[derive(Debug, Clone, Copy)]
pub struct PoolFigures<'a> {
    /// The provider.
    pub provider: &'a str,
    /// The pool.
    pub pool: &'a str,
    /// Unexpired leases.
    pub in_flight: i64,
    /// Sum of the credentials' limits.
    pub total_slots: i64,
    /// Credentials cooling down now.
    pub cooling_down: i64,
    /// Credentials draining.
    pub draining: i64,
    /// Seconds until the earliest access token of its OAuth credentials expires (`None`: none).
    pub oauth_expires_in_seconds: Option<f64>,
    /// Credentials by status (a status absent: none).
    pub by_status: &'a std::collections::BTreeMap<String, i64>,
}

/// Sets one pool's gauges from a sample (and creates its allocation series the first time,
/// [`pool_known`]).
pub fn pool_sampled(p: PoolFigures<'_>) {
    pool_known(p.provider, p.pool);
    let labels = [
        ("provider", p.provider.to_owned()),
        ("pool", p.pool.to_owned()),
    ];
    gauge!(LEASES_IN_FLIGHT, &labels).set(p.in_flight as f64);
    gauge!(SLOTS_FREE, &labels).set((p.total_slots - p.in_flight).max(0) as f64);
    gauge!(CREDENTIALS_COOLING, &labels).set(p.cooling_down as f64);
    gauge!(CREDENTIALS_DRAINING, &labels).set(p.draining as f64);
    gauge!(OAUTH_TOKEN_EXPIRES_IN, &labels)
        .set(p.oauth_expires_in_seconds.unwrap_or(f64::INFINITY));
    for status in crate::domain::Status::ALL {
        let n = p.by_status.get(status.as_str()).copied().unwrap_or(0);
        gauge!(CREDENTIALS, "provider" => p.provider.to_owned(), "pool" => p.pool.to_owned(),
               "status" => status.as_str())
        .set(n as f64);
    }
}

/// Sets `credpool_store_up`: whether the last sample could read the store.
pub fn store_up(up: bool) {
    gauge!(STORE_UP).set(if up { 1.0 } else { 0.0 });
}

/// Sets the gauges of one proof of the continuous audit ([`AUDIT_PROOF_LAG`], seconds it lags
/// behind the database clock; [`AUDIT_VIOLATIONS`], what it has found).
pub fn audit_checkpoint(proof: &str, lag_seconds: f64, violations: i64) {
    gauge!(AUDIT_PROOF_LAG, "proof" => proof.to_owned()).set(lag_seconds);
    gauge!(AUDIT_VIOLATIONS, "proof" => proof.to_owned()).set(violations as f64);
}

/// The W3C trace context (`traceparent`) a request came with: credpool's request span carries
/// it (fields `trace_id` and `parent_span_id`), so that every log line of the request names the
/// trace of the gateway or executor that sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceParent {
    /// 32 lowercase hex digits.
    pub trace_id: String,
    /// The caller's span: 16 lowercase hex digits.
    pub parent_span_id: String,
    /// Whether the caller sampled the trace.
    pub sampled: bool,
}

/// The `traceparent` header of `headers`, if it is a valid W3C trace context; anything else
/// (absent, malformed, all-zero ids, an unknown version in the wrong shape) is ignored, never an
/// error: a caller's tracing must not break its requests.
///
/// Parsed by OpenTelemetry's `TraceContextPropagator` (versions, all-zero ids, flags), after a
/// check that the first four fields are 2, 32, 16 and 2 lowercase hex digits, which the
/// propagator leaves to `u128::from_str_radix` (it would read `00-1-2-01` as trace 1).
pub fn trace_parent(headers: &axum::http::HeaderMap) -> Option<TraceParent> {
    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry::trace::{TraceContextExt, TraceFlags};

    /// The request's headers, as the propagator reads them.
    struct Headers<'a>(&'a axum::http::HeaderMap);

    impl opentelemetry::propagation::Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(|k| k.as_str()).collect()
        }
    }

    let value = headers.get("traceparent")?.to_str().ok()?.trim();
    let fields: Vec<&str> = value.split('-').take(4).collect();
    let lowercase_hex = |f: &str| f.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if fields.iter().map(|f| f.len()).ne([2, 32, 16, 2]) || !fields.iter().all(|f| lowercase_hex(f))
    {
        return None;
    }
    let propagator = opentelemetry_sdk::propagation::TraceContextPropagator::new();
    let context = propagator.extract(&Headers(headers));
    let span = context.span();
    let parent = span.span_context();
    parent.is_valid().then(|| TraceParent {
        trace_id: parent.trace_id().to_string(),
        parent_span_id: parent.span_id().to_string(),
        sampled: parent.trace_flags() & TraceFlags::SAMPLED == TraceFlags::SAMPLED,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(value: &str) -> Option<TraceParent> {
        let mut headers = axum::http::HeaderMap::new();
        headers.insert("traceparent", value.parse().unwrap());
        trace_parent(&headers)
    }

    #[test]
    fn a_valid_traceparent_gives_its_trace_and_parent_span() {
        let parent = parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(parent.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(parent.parent_span_id, "00f067aa0ba902b7");
        assert!(parent.sampled);
        let unsampled = parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        assert!(!unsampled.sampled);
        // a later version may append fields (W3C Trace Context, "Versioning")
        assert!(parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra").is_some());
    }

    #[test]
    fn a_malformed_traceparent_is_ignored() {
        for value in [
            "",
            "garbage",
            "00-1-2-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47zz-00f067aa0ba902b7-01",
        ] {
            assert_eq!(parse(value), None, "{value:?}");
        }
        assert_eq!(trace_parent(&axum::http::HeaderMap::new()), None);
    }

    #[test]
    fn every_metric_has_a_unit_and_a_help_text() {
        let mut names = std::collections::BTreeSet::new();
        for metric in METRICS {
            assert!(metric.name.starts_with("credpool_"), "{}", metric.name);
            assert!(
                !metric.unit.is_empty() && !metric.help.is_empty(),
                "{}",
                metric.name
            );
            assert!(names.insert(metric.name), "{} listed twice", metric.name);
            if metric.kind == Kind::Counter {
                assert!(metric.name.ends_with("_total"), "{}", metric.name);
            }
        }
    }
}
