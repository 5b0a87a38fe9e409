//! The selection layer against a real PostgreSQL: outcome reports drive health (cooldown
//! max-merge, the N-in-window rule, auth errors, quota), half-open probes, recovery without any
//! job, model aliases, late reports, and traffic shares under the scoring.

use std::collections::HashMap;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use credpool_test_support::*;

async fn report(app: &TestApp, lease: &Value, outcome: &str, retry_after: Option<u32>) -> Value {
    let mut body = release_body(lease, outcome);
    if let Some(seconds) = retry_after {
        body["retry_after_seconds"] = json!(seconds);
    }
    app.release(body).ok_json().await
}

/// (status, seconds until cooldown_until on the database clock)
async fn health(app: &TestApp, key_id: &str) -> (String, Option<f64>) {
    sqlx::query_as(
        "SELECT status, extract(epoch FROM cooldown_until - now())::float8 FROM credentials WHERE key_id = $1",
    )
    .bind(key_id)
    .fetch_one(&app.db)
    .await
    .unwrap()
}

/// Health transitions (not operator actions) of a credential, in order.
async fn transitions(app: &TestApp, key_id: &str) -> Vec<(String, Option<String>, Option<String>)> {
    sqlx::query_as(
        "SELECT event, old_status, new_status FROM credential_events
         WHERE key_id = $1 AND (actor IS NULL OR actor LIKE 'tenant:%') ORDER BY event_id",
    )
    .bind(key_id)
    .fetch_all(&app.db)
    .await
    .unwrap()
}

#[tokio::test]
async fn rate_limited_report_rests_the_credential_and_a_shorter_report_never_shortens_it() {
    let app = TestApp::with_credential("key-a", 3).await;
    let (first, second, third) = (
        app.lease(gpt4o_for(600)).await,
        app.lease(gpt4o_for(600)).await,
        app.lease(gpt4o_for(600)).await,
    );

    report(&app, &first, "rate_limited", Some(120)).await;
    let (status, left) = health(&app, "key-a").await;
    assert_eq!(status, "rate_limited");
    assert!((118.0..=120.0).contains(&left.unwrap()), "{left:?}");

    // a 10 s report and a "use the default" (0) report do not shorten the 120 s rest
    report(&app, &second, "rate_limited", Some(10)).await;
    report(&app, &third, "rate_limited", Some(0)).await;
    let (_, left) = health(&app, "key-a").await;
    assert!((117.0..=120.0).contains(&left.unwrap()), "{left:?}");

    let response = app.allocate(gpt4o_for(600)).await;
    assert!(
        (118..=120).contains(&retry_after(&response)),
        "{:?}",
        response.headers()
    );
    assert_error(response, StatusCode::TOO_MANY_REQUESTS, "pool_exhausted").await;
    let events = transitions(&app, "key-a").await;
    assert_eq!(
        events[0],
        (
            "status_changed".into(),
            Some("available".into()),
            Some("rate_limited".into())
        )
    );
}

#[tokio::test]
async fn rate_limited_without_retry_after_rests_for_the_configured_default() {
    let app = TestApp::with_credential("key-a", 1).await;
    let first = app.lease(gpt4o_for(600)).await;
    report(&app, &first, "rate_limited", None).await;
    let (_, left) = health(&app, "key-a").await;
    assert!((28.0..=30.0).contains(&left.unwrap()), "{left:?}");
}

#[tokio::test]
async fn five_failures_within_a_minute_start_a_cooldown_and_fewer_do_not() {
    let app = TestApp::with_credential("key-a", 5).await;
    let mut leases = Vec::new();
    for _ in 0..5 {
        leases.push(app.lease(gpt4o_for(600)).await);
    }
    for (i, l) in leases.iter().enumerate().take(4) {
        report(&app, l, "failure", None).await;
        assert_eq!(
            health(&app, "key-a").await.0,
            "available",
            "after failure {}",
            i + 1
        );
    }
    report(&app, &leases[4], "failure", None).await;
    let (status, left) = health(&app, "key-a").await;
    assert_eq!(status, "cooldown");
    assert!((58.0..=60.0).contains(&left.unwrap()), "{left:?}");

    let response = app.allocate(gpt4o_for(600)).await;
    let retry = retry_after(&response);
    assert!((58..=60).contains(&retry), "Retry-After {retry}");
    assert_error(response, StatusCode::TOO_MANY_REQUESTS, "pool_exhausted").await;
    let failures: f64 = app
        .scalar("SELECT health_failures FROM credentials WHERE key_id = 'key-a'")
        .await;
    assert!((4.99..=5.0).contains(&failures), "{failures}");
}

#[tokio::test]
async fn recovery_needs_no_job_and_starts_with_a_single_probe_lease() {
    let app = TestApp::with_credential("key-a", 3).await;
    app.set_status("key-a", "cooldown", Some(1.0)).await;
    app.allocate(gpt4o_for(600))
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;

    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let probe = app.lease(gpt4o_for(600)).await;
    assert_eq!(probe["probe"], true);
    // half-open: one probe at a time, although two more slots are free
    app.allocate(gpt4o_for(600))
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    assert_eq!(health(&app, "key-a").await.0, "cooldown");

    report(&app, &probe, "success", None).await;
    assert_eq!(health(&app, "key-a").await, ("available".into(), None));
    for _ in 0..3 {
        let l = app.lease(gpt4o_for(600)).await;
        assert_eq!(l["probe"], false);
    }
    let events = transitions(&app, "key-a").await;
    assert_eq!(
        events,
        [
            (
                "probe_granted".into(),
                Some("cooldown".into()),
                Some("cooldown".into())
            ),
            (
                "status_changed".into(),
                Some("cooldown".into()),
                Some("available".into())
            ),
        ]
    );
}

#[tokio::test]
async fn a_failed_probe_starts_a_longer_cooldown() {
    let app = TestApp::with_credential("key-a", 2).await;
    app.set_status("key-a", "cooldown", Some(1.0)).await;
    app.run_sql("UPDATE credentials SET cooldowns_in_a_row = 1 WHERE key_id = 'key-a'")
        .await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let probe = app.lease(gpt4o_for(600)).await;
    assert_eq!(probe["probe"], true);
    report(&app, &probe, "failure", None).await;
    let (status, left) = health(&app, "key-a").await;
    assert_eq!(status, "cooldown");
    // the second cooldown in a row: 60 s doubled
    assert!((118.0..=120.0).contains(&left.unwrap()), "{left:?}");
}

#[tokio::test]
async fn auth_error_disables_the_credential() {
    let app = TestApp::with_credential("key-a", 2).await;
    let l = app.lease(gpt4o_for(600)).await;
    report(&app, &l, "auth_error", None).await;
    let (status, reason): (String, Option<String>) =
        sqlx::query_as("SELECT status, status_reason FROM credentials WHERE key_id = 'key-a'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(status, "disabled");
    assert!(reason.unwrap().contains("auth_error"));
    app.allocate(gpt4o_for(600))
        .refused(StatusCode::CONFLICT, "no_usable_credentials")
        .await;
}

#[tokio::test]
async fn quota_exhausted_waits_for_retry_after_or_for_an_operator() {
    let app = TestApp::with_credential("timed", 1).await;
    let l = app.lease(gpt4o_for(600)).await;
    report(&app, &l, "quota_exhausted", Some(3600)).await;
    let response = app.allocate(gpt4o_for(600)).await;
    assert!((3599..=3600).contains(&retry_after(&response)));
    assert_error(response, StatusCode::TOO_MANY_REQUESTS, "pool_exhausted").await;

    let app = TestApp::with_credential("forever", 1).await;
    let l = app.lease(gpt4o_for(600)).await;
    report(&app, &l, "quota_exhausted", None).await;
    assert_eq!(health(&app, "forever").await, ("exhausted".into(), None));
    app.allocate(gpt4o_for(600))
        .refused(StatusCode::CONFLICT, "no_usable_credentials")
        .await;
}

#[tokio::test]
async fn an_outcome_after_expiry_counts_for_health_once_and_releases_nothing() {
    let app = TestApp::with_credential("key-a", 1).await;
    let body = gpt4o_for(1);
    let late = app.lease(body).await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    for _ in 0..2 {
        let answer = report(&app, &late, "failure", None).await;
        assert_eq!(answer["released"], false);
    }
    let failures: f64 = app
        .scalar("SELECT health_failures FROM credentials WHERE key_id = 'key-a'")
        .await;
    assert!((0.99..=1.0).contains(&failures), "counted {failures} times");
    let mut events = app.lease_events(&late).await;
    events.sort();
    assert_eq!(events, ["expired", "granted", "outcome_after_expiry"]);
    // the slot is free for the next executor
    app.lease(gpt4o_for(600)).await;
}

#[tokio::test]
async fn aliases_map_a_request_model_to_each_credentials_own_name() {
    let app = TestApp::spawn_with(AppOptions::deterministic()).await;
    let put = app
        .put_key_raw(
            "dated",
            json!({"provider": "openai", "models": ["gpt-4o-2024-08-06"], "aliases": {"gpt-4o": "gpt-4o-2024-08-06"},
                   "max_concurrent_uses": 1, "secret": {"api_key": "sk-dated"}}),
        )
        .await;
    assert_eq!(put.status(), StatusCode::CREATED);
    app.put_gpt4o_key("plain", "default", 1).await;

    let mut served = HashMap::new();
    for _ in 0..2 {
        let l = app.lease(gpt4o_for(600)).await;
        served.insert(
            l["key_id"].as_str().unwrap().to_owned(),
            l["provider_model"].as_str().unwrap().to_owned(),
        );
    }
    assert_eq!(served["dated"], "gpt-4o-2024-08-06");
    assert_eq!(served["plain"], "gpt-4o");
    // the alias is not a model of its own elsewhere
    app.allocate(json!({"provider": "openai", "model": "claude-3"}))
        .refused(StatusCode::CONFLICT, "model_not_supported")
        .await;
}

#[tokio::test]
async fn an_alias_must_point_at_one_of_the_credentials_models() {
    let app = TestApp::spawn().await;
    let response = app
        .put_key_raw(
            "dated",
            json!({"provider": "openai", "models": ["gpt-4o-2024-08-06"], "aliases": {"gpt-4o": "gpt-4o-mini"},
                   "max_concurrent_uses": 1, "secret": {"api_key": "sk"}}),
        )
        .await;
    assert_error(response, StatusCode::BAD_REQUEST, "invalid_request").await;
}

#[tokio::test]
async fn a_status_change_made_elsewhere_is_seen_at_once() {
    let app = TestApp::with_credential("key-a", 1).await;
    let l = app.lease(gpt4o_for(600)).await;
    report(&app, &l, "success", None).await;
    // another replica (here: plain SQL) disables the credential; this service's view is stale
    app.set_status("key-a", "disabled", None).await;
    app.allocate(gpt4o_for(600))
        .refused(StatusCode::CONFLICT, "no_usable_credentials")
        .await;
    app.set_status("key-a", "available", None).await;
    app.lease(gpt4o_for(600)).await;
}

#[tokio::test]
async fn the_rust_usability_rule_matches_the_sql_function() {
    let app = TestApp::spawn().await;
    for status in credpool::domain::Status::ALL {
        for offset in [None, Some(-5.0), Some(5.0)] {
            let (usable, recovers): (bool, bool) = sqlx::query_as(
                "SELECT credential_usable($1, now() + make_interval(secs => $2), now()),
                        credential_recovers_at($1, now() + make_interval(secs => $2), now()) IS NOT NULL",
            )
            .bind(status.as_str())
            .bind(offset)
            .fetch_one(&app.db)
            .await
            .unwrap();
            let now = time::OffsetDateTime::now_utc();
            let mut health = credpool::allocator::health::Health::new(status);
            health.cooldown_until = offset.map(|s| now + time::Duration::seconds_f64(s));
            assert_eq!(health.usable(now), usable, "{status:?} {offset:?}");
            assert_eq!(
                health.recovers_at(now).is_some(),
                recovers,
                "{status:?} {offset:?}"
            );
        }
    }
}

async fn traffic_shares(
    app: &TestApp,
    cycles: usize,
    flaky: Option<&str>,
) -> HashMap<String, usize> {
    let mut counts: HashMap<String, usize> = HashMap::new();
    for i in 0..cycles {
        let l = app.lease(gpt4o_for(600)).await;
        let key = l["key_id"].as_str().unwrap().to_owned();
        let outcome = if flaky == Some(key.as_str()) && i % 2 == 0 {
            "failure"
        } else {
            "success"
        };
        report(app, &l, outcome, None).await;
        *counts.entry(key).or_default() += 1;
    }
    counts
}

#[tokio::test]
async fn equal_credentials_share_sequential_traffic_evenly() {
    let app = TestApp::spawn().await;
    for i in 0..8 {
        app.put_gpt4o_key(&format!("eq-{i}"), "default", 1).await;
    }
    let cycles = 2_000;
    let counts = traffic_shares(&app, cycles, None).await;
    for i in 0..8 {
        let share =
            counts.get(&format!("eq-{i}")).copied().unwrap_or(0) as f64 * 100.0 / cycles as f64;
        assert!(
            (share - 12.5).abs() <= 3.0,
            "eq-{i} got {share}% ({counts:?})"
        );
    }
}

#[tokio::test]
async fn a_credential_failing_half_its_calls_gets_clearly_less_traffic() {
    let app = TestApp::spawn().await;
    for i in 0..8 {
        app.put_gpt4o_key(&format!("c-{i}"), "default", 1).await;
    }
    let cycles = 800;
    let counts = traffic_shares(&app, cycles, Some("c-0")).await;
    let flaky = counts.get("c-0").copied().unwrap_or(0) as f64;
    let healthy_mean = (1..8)
        .map(|i| counts.get(&format!("c-{i}")).copied().unwrap_or(0))
        .sum::<usize>() as f64
        / 7.0;
    assert!(
        flaky < healthy_mean / 2.0,
        "flaky {flaky}, healthy mean {healthy_mean} ({counts:?})"
    );
}

#[tokio::test]
async fn the_sql_health_rules_match_the_rust_state_machine_on_random_reports() {
    // The release applies outcome reports in SQL (credpool_health_apply); the scoring simulation
    // and the documentation's table are the Rust state machine (allocator::health::apply). Both
    // on the same 3,000 random (health, report) pairs, under the default policy and a tight one:
    // every field of the health after the report, whether it is a transition, and what a clamp
    // says, must be equal.
    use credpool::allocator::health::{Health, HealthPolicy, Report, apply};
    use credpool::domain::{Outcome, Status};
    use rand::{RngExt, SeedableRng};
    use time::{Duration, OffsetDateTime};

    let app = TestApp::spawn().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(36_37);
    // microseconds, as the database keeps them
    let now = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
        + Duration::microseconds(123_456);
    let tight = HealthPolicy {
        failure_threshold: 2,
        failure_window_seconds: 30.0,
        cooldown_seconds: 5.0,
        max_cooldown_seconds: 40.0,
        rate_limit_seconds: 15.0,
        max_report_rest_seconds: 20.0,
        ..HealthPolicy::default()
    };
    let outcomes = [
        Outcome::Success,
        Outcome::Failure,
        Outcome::RateLimited,
        Outcome::AuthError,
        Outcome::AuthExpired,
        Outcome::QuotaExhausted,
    ];
    let around = |rng: &mut rand::rngs::StdRng| {
        now + Duration::microseconds(rng.random_range(-600_000_000..600_000_000))
    };
    let mut cases = Vec::new();
    for i in 0..3_000 {
        let policy = if i % 2 == 0 {
            HealthPolicy::default()
        } else {
            tight.clone()
        };
        let status = Status::ALL[rng.random_range(0..Status::ALL.len())];
        let health = Health {
            status,
            status_reason: rng.random_bool(0.5).then(|| format!("reason {i}")),
            cooldown_until: rng.random_bool(0.7).then(|| around(&mut rng)),
            successes: rng.random_range(0.0..20.0),
            failures: rng.random_range(0.0..20.0),
            rate_limits: rng.random_range(0.0..5.0),
            decayed_at: rng.random_bool(0.8).then(|| around(&mut rng).min(now)),
            recent_failures: (0..rng.random_range(0..6))
                .map(|_| now - Duration::microseconds(rng.random_range(0..90_000_000)))
                .collect(),
            cooldowns_in_a_row: rng.random_range(0..6),
            last_success_at: rng.random_bool(0.5).then(|| around(&mut rng)),
            recovered_at: rng.random_bool(0.3).then(|| around(&mut rng)),
        };
        let report = Report {
            outcome: outcomes[rng.random_range(0..outcomes.len())],
            retry_after_seconds: match rng.random_range(0..4) {
                0 => None,
                1 => Some(0),
                2 => Some(rng.random_range(1..60)),
                _ => Some(rng.random_range(1..3_000_000)),
            },
            probe: rng.random_bool(0.3),
            may_disable: rng.random_bool(0.5),
        };
        cases.push((health, report, policy));
    }
    let rfc = |at: OffsetDateTime| {
        at.format(&time::format_description::well_known::Rfc3339)
            .unwrap()
    };
    let body: Vec<Value> = cases
        .iter()
        .map(|(h, r, p)| {
            json!({
                "row": {
                    "key_id": "k", "provider": "openai", "pool": "default", "models": ["m"],
                    "max_concurrent_uses": 1, "status": h.status.as_str(),
                    "status_reason": h.status_reason, "cooldown_until": h.cooldown_until.map(rfc),
                    "health_successes": h.successes, "health_failures": h.failures,
                    "health_rate_limits": h.rate_limits,
                    "health_decayed_at": h.decayed_at.map(rfc),
                    "recent_failures": h.recent_failures.iter().copied().map(rfc).collect::<Vec<_>>(),
                    "cooldowns_in_a_row": h.cooldowns_in_a_row,
                    "last_success_at": h.last_success_at.map(rfc),
                    "recovered_at": h.recovered_at.map(rfc),
                },
                "outcome": r.outcome.as_str(), "retry_after": r.retry_after_seconds,
                "probe": r.probe, "may_disable": r.may_disable,
                "policy": credpool::store::leases::policy_json(p),
            })
        })
        .collect();
    type Row = (
        String,
        Option<String>,
        Option<OffsetDateTime>,
        f64,
        f64,
        f64,
        Option<OffsetDateTime>,
        Option<Vec<OffsetDateTime>>,
        i32,
        Option<OffsetDateTime>,
        Option<OffsetDateTime>,
        bool,
        Option<i32>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT (a.next).status, (a.next).status_reason, (a.next).cooldown_until,
                (a.next).health_successes, (a.next).health_failures, (a.next).health_rate_limits,
                (a.next).health_decayed_at, (a.next).recent_failures,
                (a.next).cooldowns_in_a_row, (a.next).last_success_at, (a.next).recovered_at,
                a.changed, a.clamped_from
         FROM jsonb_array_elements($1) WITH ORDINALITY AS e (c, n)
         CROSS JOIN LATERAL credpool_health_apply(
             jsonb_populate_record(NULL::credentials, e.c -> 'row'), e.c ->> 'outcome',
             (e.c ->> 'retry_after')::integer, (e.c ->> 'probe')::boolean,
             (e.c ->> 'may_disable')::boolean, $2, e.c -> 'policy') AS a
         ORDER BY e.n",
    )
    .bind(Value::Array(body))
    .bind(now)
    .fetch_all(&app.db)
    .await
    .unwrap();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
    for ((health, report, policy), row) in cases.iter().zip(rows) {
        let (next, transition) = apply(health, *report, now, policy);
        let sql = format!(
            "({:?}, {:?}, {:?}, {}, {}, {}, {:?}, {:?}, {}, {:?}, {:?}, {}, {:?})",
            row.0,
            row.1,
            row.2,
            row.3,
            row.4,
            row.5,
            row.6,
            row.7,
            row.8,
            row.9,
            row.10,
            row.11,
            row.12
        );
        let case = format!(
            "{health:?} + {report:?} under {policy:?}: sql {sql}, rust {next:?} {transition:?}"
        );
        assert_eq!(row.0, next.status.as_str(), "status: {case}");
        assert_eq!(row.1, next.status_reason, "status_reason: {case}");
        assert_eq!(row.2, next.cooldown_until, "cooldown_until: {case}");
        assert!(close(row.3, next.successes), "successes: {case}");
        assert!(close(row.4, next.failures), "failures: {case}");
        assert!(close(row.5, next.rate_limits), "rate_limits: {case}");
        assert_eq!(row.6, next.decayed_at, "decayed_at: {case}");
        assert_eq!(
            row.7.unwrap_or_default(),
            next.recent_failures,
            "recent_failures: {case}"
        );
        assert_eq!(row.8, next.cooldowns_in_a_row, "cooldowns_in_a_row: {case}");
        assert_eq!(row.9, next.last_success_at, "last_success_at: {case}");
        assert_eq!(row.10, next.recovered_at, "recovered_at: {case}");
        assert_eq!(row.11, transition.is_some(), "transition: {case}");
        if let Some(transition) = transition {
            assert_eq!(
                row.12.map(|s| s as u32),
                transition.clamped_from,
                "clamped_from: {case}"
            );
        }
    }
}
