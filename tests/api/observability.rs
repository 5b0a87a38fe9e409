//! What a Prometheus scrape of a fresh process shows (every metric described, every series known
//! in advance at zero, build and process metrics), and the documents built on the metrics
//! (docs/metrics.md, the Grafana dashboard, the alerting rules) naming only metrics that exist.

use std::collections::BTreeSet;

use credpool::telemetry::{self, Kind, METRICS};
use serde_json::{Value, json};

use credpool_test_support::*;

use crate::BIN;

/// The `process_*` series of `metrics-process` on Linux.
const PROCESS_METRICS: [&str; 8] = [
    "process_cpu_seconds_total",
    "process_open_fds",
    "process_max_fds",
    "process_virtual_memory_bytes",
    "process_virtual_memory_max_bytes",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_threads",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_process_describes_every_metric_and_shows_the_series_known_in_advance_at_zero() {
    let database = TestDatabase::create().await;
    let env = keyed_env(&database);
    // a first process stores credentials in three pools, then stops
    let first = ServeProcess::start(BIN, &env, &[]).await;
    for (key, provider, pool) in [
        ("m-a", "openai", "default"),
        ("m-v", "openai", "vip"),
        ("m-b", "anthropic", "batch"),
    ] {
        let put = first
            .put_key_raw(
                key,
                json!({"provider": provider, "pool": pool, "models": ["gpt-4o"],
                          "max_concurrent_uses": 2, "secret": {"api_key": "sk-metrics"}}),
            )
            .await;
        assert!(put.status().is_success());
    }
    assert!(first.terminate().await.success());

    // the second process's very first scrape, before any request was served
    let serve = ServeProcess::start(BIN, &env, &[]).await;
    let page = serve.metrics().await;
    let samples = samples(&page);
    let value = |name: &str, pairs: &[(&str, &str)]| {
        samples
            .get(&(name.to_owned(), labels(pairs)))
            .copied()
            .unwrap_or_else(|| panic!("no {name}{pairs:?} in the first scrape:\n{page}"))
    };

    // every metric has a # HELP line (credpool's own: with its unit)
    let types: BTreeSet<&str> = page
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap())
        .collect();
    for name in &types {
        let help = page
            .lines()
            .find(|l| l.starts_with(&format!("# HELP {name} ")))
            .unwrap_or_else(|| panic!("{name} has no # HELP line"));
        if name.starts_with("credpool_") {
            assert!(help.contains(" Unit: "), "{help}");
        }
    }
    // every counter and gauge is there from the start (histograms come with their first sample)
    for metric in METRICS.iter().filter(|m| m.kind != Kind::Histogram) {
        assert!(
            types.contains(metric.name),
            "{} missing at start",
            metric.name
        );
    }
    for name in PROCESS_METRICS {
        assert!(types.contains(name), "{name} missing");
    }
    assert!(value("process_resident_memory_bytes", &[]) > 0.0);
    assert!(value("process_open_fds", &[]) > 0.0);

    // allocations: every result of every pool known at start, at zero; `leased` per served pool
    for (provider, pool) in [
        ("openai", "default"),
        ("openai", "vip"),
        ("anthropic", "batch"),
    ] {
        for result in telemetry::ALLOCATION_RESULTS
            .iter()
            .filter(|r| **r != "leased")
        {
            let series = [
                ("provider", provider),
                ("pool", pool),
                ("served_pool", ""),
                ("result", result),
            ];
            assert_eq!(value(telemetry::ALLOCATIONS, &series), 0.0);
        }
    }
    for (provider, pool, served) in [
        ("openai", "default", "default"),
        ("openai", "vip", "vip"),
        ("openai", "vip", "default"),
        ("anthropic", "batch", "batch"),
    ] {
        let series = [
            ("provider", provider),
            ("pool", pool),
            ("served_pool", served),
            ("result", "leased"),
        ];
        assert_eq!(value(telemetry::ALLOCATIONS, &series), 0.0);
    }
    for result in telemetry::REFUSED_RESULTS {
        let series = [
            ("provider", ""),
            ("pool", ""),
            ("served_pool", ""),
            ("result", result),
        ];
        assert_eq!(value(telemetry::ALLOCATIONS, &series), 0.0);
    }
    // releases, renewals, expiries: every result and reason
    assert_eq!(
        value(
            telemetry::RELEASES,
            &[("result", "released"), ("reason", "")]
        ),
        0.0
    );
    for reason in ["mismatch", "expired", "not_found"] {
        let series = [("result", "not_released"), ("reason", reason)];
        assert_eq!(value(telemetry::RELEASES, &series), 0.0);
    }
    for result in ["renewed", "lost"] {
        assert_eq!(value(telemetry::RENEWALS, &[("result", result)]), 0.0);
    }
    for source in ["claim", "reaper"] {
        assert_eq!(value(telemetry::LEASES_EXPIRED, &[("source", source)]), 0.0);
    }
    assert_eq!(value(telemetry::DB_ACQUIRE_TIMEOUTS, &[]), 0.0);
    assert_eq!(value(telemetry::WAITERS, &[]), 0.0);
    // the pools' gauges were read at start-up
    assert_eq!(value(telemetry::STORE_UP, &[]), 1.0);
    let pool = [("provider", "openai"), ("pool", "vip")];
    assert_eq!(value(telemetry::SLOTS_FREE, &pool), 2.0);
    assert_eq!(value(telemetry::LEASES_IN_FLIGHT, &pool), 0.0);
    let available = [
        ("provider", "openai"),
        ("pool", "vip"),
        ("status", "available"),
    ];
    assert_eq!(value(telemetry::CREDENTIALS, &available), 1.0);

    // build info: the package version and the commit it was built from
    let build = samples
        .keys()
        .find(|(name, _)| name == telemetry::BUILD_INFO)
        .map(|(_, labels)| labels.clone())
        .expect("credpool_build_info");
    assert_eq!(build["version"], env!("CARGO_PKG_VERSION"));
    let commit = &build["git_commit"];
    assert!(!commit.is_empty());
    let head = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    match head {
        // built here, from this checkout (unless the build named another commit)
        Some(head) if std::env::var_os("CREDPOOL_GIT_COMMIT").is_none() => {
            assert_eq!(commit, &head)
        }
        _ => {}
    }
    assert!(serve.terminate().await.success());
}

/// The metric names a text mentions (`credpool_*`, `process_*`).
fn metric_names(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|t| t.starts_with("credpool_") || t.starts_with("process_"))
        .map(str::to_owned)
        .collect()
}

/// Every series name credpool exports: its metrics (histograms with their `_bucket`, `_sum`
/// and `_count` series) and the process metrics.
fn exported() -> BTreeSet<String> {
    let mut names: BTreeSet<String> = PROCESS_METRICS.iter().map(|n| n.to_string()).collect();
    for metric in METRICS {
        names.insert(metric.name.to_owned());
        if metric.kind == Kind::Histogram {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{}{suffix}", metric.name));
            }
        }
    }
    names
}

fn doc(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every `expr` of a Grafana dashboard, however deep.
fn exprs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr" | "query", Value::String(expr)) => out.push(expr.clone()),
                    _ => exprs(value, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

#[test]
fn the_metrics_list_the_dashboard_and_the_alerts_name_only_exported_metrics() {
    let exported = exported();

    // docs/metrics.md lists every metric, and nothing else
    let list = doc("docs/metrics.md");
    for metric in METRICS {
        assert!(
            list.contains(&format!("`{}`", metric.name)),
            "docs/metrics.md does not list {}",
            metric.name
        );
        for label in metric.labels {
            assert!(
                list.contains(&format!("`{label}`")),
                "docs/metrics.md does not name the label {label} of {}",
                metric.name
            );
        }
    }
    let unknown: Vec<_> = metric_names(&list)
        .into_iter()
        .filter(|n| !exported.contains(n))
        .collect();
    assert!(unknown.is_empty(), "docs/metrics.md names {unknown:?}");

    // the dashboard: valid JSON, every query on exported metrics
    let dashboard: Value = serde_json::from_str(&doc("docs/grafana-dashboard.json")).unwrap();
    let mut queries = Vec::new();
    exprs(&dashboard, &mut queries);
    assert!(queries.len() >= 10, "only {} queries", queries.len());
    let used: BTreeSet<String> = queries.iter().flat_map(|q| metric_names(q)).collect();
    let unknown: Vec<_> = used.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(unknown.is_empty(), "the dashboard queries {unknown:?}");
    for needed in [
        telemetry::ALLOCATIONS,
        telemetry::SLOTS_FREE,
        telemetry::CREDENTIALS,
        telemetry::STORE_UP,
        "credpool_request_duration_seconds_bucket",
        "process_resident_memory_bytes",
    ] {
        assert!(
            used.contains(needed),
            "the dashboard does not show {needed}"
        );
    }

    // the alerting rules: the ones the runbook names, on exported metrics
    let alerts = doc("docs/alerts.yml");
    for alert in [
        "CredpoolStoreDown",
        "CredpoolPoolSaturated",
        "CredpoolCredentialDisabled",
        "CredpoolAuditViolation",
        "CredpoolAuditProofBehind",
    ] {
        assert!(
            alerts.contains(&format!("alert: {alert}")),
            "no {alert} rule"
        );
    }
    let unknown: Vec<_> = metric_names(&alerts)
        .into_iter()
        .filter(|n| !exported.contains(n))
        .collect();
    assert!(unknown.is_empty(), "docs/alerts.yml names {unknown:?}");
}

#[tokio::test]
async fn refused_allocations_of_pools_that_do_not_exist_add_no_series() {
    // 300 allocates with random provider and pool names used to add 300 series to
    // credpool_allocations_total (the refused request's names became labels). The metrics are the
    // process's, shared with the tests running beside this one: the check is on this test's own
    // random names, which no other test uses.
    let app = TestApp::spawn().await;
    // the pool that exists has a name of this test's own too
    let existing = format!("r{}", hex::encode(rand::random::<[u8; 6]>()));
    app.put_gpt4o_key("k", &existing, 1).await;
    let refused = |page: &str| {
        samples(page)
            .into_iter()
            .filter(|((name, labels), _)| {
                name == telemetry::ALLOCATIONS
                    && labels.get("result").map(String::as_str) == Some("pool_not_found")
                    && labels.get("provider").map(String::as_str) == Some("")
            })
            .map(|(_, value)| value)
            .sum::<f64>()
    };
    let before = refused(&app.metrics().await);
    let names: Vec<(String, String)> = (0..300)
        .map(|_| {
            let id = hex::encode(rand::random::<[u8; 6]>());
            (format!("p{id}"), format!("q{id}"))
        })
        .collect();
    for (provider, pool) in &names {
        let response = app
            .allocate(json!({"provider": provider, "model": "gpt-4o", "pool": pool}))
            .await;
        assert_error(response, reqwest::StatusCode::NOT_FOUND, "pool_not_found").await;
    }
    let page = app.metrics().await;
    let named: Vec<&str> = page
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            names
                .iter()
                .any(|(provider, pool)| l.contains(provider.as_str()) || l.contains(pool.as_str()))
        })
        .collect();
    assert!(
        named.is_empty(),
        "{} series name a pool that does not exist, e.g. {:?}",
        named.len(),
        named.first()
    );
    // they are counted, under empty provider and pool (others' refusals may add to the counter,
    // never take from it)
    let counted = refused(&page) - before;
    assert!(counted >= 300.0, "{counted}");
    // a pool that exists keeps its labels
    let leased = app
        .allocate(json!({"provider": "openai", "model": "gpt-4o", "pool": existing}))
        .await;
    json_body(leased, reqwest::StatusCode::OK).await;
    let full = app
        .allocate(json!({"provider": "openai", "model": "gpt-4o", "pool": existing}))
        .await;
    assert_error(
        full,
        reqwest::StatusCode::TOO_MANY_REQUESTS,
        "pool_exhausted",
    )
    .await;
    let page = app.metrics().await;
    assert!(
        page.lines()
            .any(|l| l.starts_with("credpool_allocations_total{")
                && l.contains("provider=\"openai\"")
                && l.contains(&format!("pool=\"{existing}\""))
                && l.contains("result=\"pool_exhausted\"")
                && !l.ends_with(" 0")),
        "no pool_exhausted series for openai/{existing}"
    );
}

#[tokio::test]
async fn a_background_task_that_panics_is_restarted_and_shows_in_readyz_and_metrics() {
    // Before, a background task that panicked (the OAuth refresher, on a token answer it could
    // not represent) was gone for the life of the process, and /readyz said ready.
    let database = TestDatabase::create().await;
    let pool = database.pool(8).await;
    let keys = credpool::http::ApiKeys::new(INTERNAL_KEY.into(), ADMIN_KEY.into()).unwrap();
    let app = credpool::startup::Application::bind(
        "127.0.0.1:0",
        pool,
        keys,
        keyring(),
        &credpool::config::ServiceSettings::default(),
    )
    .await
    .unwrap();
    let base = format!("http://{}", app.local_addr().unwrap());
    // its first run panics; the run made after it works on (here: forever)
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    app.supervisor().spawn("test_injected_panic", move || {
        let run = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async move {
            if run == 0 {
                panic!("injected by the test");
            }
            std::future::pending::<()>().await
        }
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(app.run_until(async {
        let _ = stopped.await;
    }));
    let client = client();
    let get = |path: &'static str| {
        let (client, base) = (client.clone(), base.clone());
        async move { client.get(format!("{base}{path}")).send().await.unwrap() }
    };
    let series = |page: &str, name: &str| {
        samples(page)
            .into_iter()
            .find(|((n, labels), _)| {
                n == name && labels.get("task").map(String::as_str) == Some("test_injected_panic")
            })
            .map(|(_, value)| value)
    };
    // down: not ready (within a moment of the panic), and the metrics say which task and that
    // it was restarted
    let mut not_ready = get("/readyz").await;
    for _ in 0..50 {
        if not_ready.status() != reqwest::StatusCode::OK {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        not_ready = get("/readyz").await;
    }
    let body = assert_error(
        not_ready,
        reqwest::StatusCode::SERVICE_UNAVAILABLE,
        "not_ready",
    )
    .await;
    assert!(
        error_message(&body).contains("test_injected_panic"),
        "{body}"
    );
    let page = get("/metrics").await.text().await.unwrap();
    assert_eq!(
        series(&page, telemetry::BACKGROUND_TASK_RESTARTS),
        Some(1.0)
    );
    assert_eq!(series(&page, telemetry::BACKGROUND_TASKS_DOWN), Some(1.0));
    // made again after its delay: ready, and the gauge back at 0
    let mut ready = false;
    for _ in 0..100 {
        if get("/readyz").await.status() == reqwest::StatusCode::OK {
            ready = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        ready,
        "not ready 10 s after the task was due to be made again"
    );
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    let page = get("/metrics").await.text().await.unwrap();
    assert_eq!(series(&page, telemetry::BACKGROUND_TASKS_DOWN), Some(0.0));
    let _ = stop.send(());
}
