//! Rate windows (docs/src/executor-api.md, "Rate windows"): requests and token windows per credential, exact across
//! replicas, decided in the same claim. Races of 64 simultaneous allocates, also through two
//! service processes; reservations and usage above and below them; 429 with the moment a window
//! frees versus 409 for an estimate no window can hold; waiters served when a window frees; the
//! trail's window proof; and the Rust estimate of the rule equal to the database's.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use credpool::allocator::windows::{RING, RateLimit, WindowKind, WindowState};
use rand::{Rng, RngExt, SeedableRng};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use credpool_test_support::*;

use crate::BIN;

const RACERS: usize = 64;

async fn window_app() -> TestApp {
    TestApp::spawn_with(AppOptions::connections(32)).await
}

async fn put_windowed(app: &TestApp, key: &str, pool: &str, limit: u32, rate_limits: Value) {
    let response = app
        .put_key_raw(
            key,
            json!({"provider": "openai", "pool": pool, "models": ["gpt-4o"],
                   "max_concurrent_uses": limit, "rate_limits": rate_limits,
                   "secret": {"api_key": format!("sk-test-{key}")}}),
        )
        .await;
    assert!(
        response.status().is_success(),
        "PUT {key}: {}",
        response.status()
    );
}

/// 64 allocates at once (half through `other` when given), each with its token estimate.
/// Returns the leases granted (with their estimate as `tokens`) and the estimates refused.
async fn race(
    app: &TestApp,
    other: Option<SocketAddr>,
    pool: &str,
    estimates: &[u64],
) -> (Vec<Value>, Vec<u64>) {
    let mut replicas = vec![app.remote()];
    replicas.extend(other.map(Remote::at));
    let bodies = estimates.iter().enumerate().map(|(i, tokens)| {
        json!({"provider": "openai", "model": "gpt-4o", "pool": pool, "lease_seconds": 60,
               "tokens": tokens, "holder": format!("racer-{i}")})
    });
    let answers = allocate_at_once(&replicas, INTERNAL_KEY, bodies.collect()).await;
    let mut granted = Vec::new();
    let mut refused = Vec::new();
    for (answer, &tokens) in answers.into_iter().zip(estimates) {
        match answer.status {
            StatusCode::OK => {
                let mut body = answer.body;
                body["tokens"] = json!(tokens);
                granted.push(body);
            }
            StatusCode::TOO_MANY_REQUESTS => refused.push(tokens),
            other => panic!("racer answered {other}: {}", answer.body),
        }
    }
    (granted, refused)
}

async fn release_all(app: &TestApp, leases: &[Value]) {
    for lease in leases {
        let response = app.release(release_body(lease, "success")).await;
        assert_eq!(response.status(), StatusCode::OK);
    }
}

/// One allocate of gpt-4o from openai's default pool, which must be granted: the lease.
async fn grant(app: &TestApp) -> Value {
    app.lease(gpt4o()).await
}

async fn window_proof(app: &TestApp) -> (i64, i64) {
    sqlx::query_as(
        "SELECT coalesce(sum(grants), 0)::int8, coalesce(sum(grants_over_window), 0)::int8
         FROM credpool_window_check(now() - interval '1 hour', now() + interval '1 hour')",
    )
    .fetch_one(&app.db)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_requests_window_gives_exactly_its_count_of_64_racers_every_round_then_as_many_again() {
    // limit 100, {"requests": 10, "seconds": 2}: slots are never what holds the racers back
    let app = Arc::new(window_app().await);
    let (other, _stop) = app.replica(32).await;
    let _turn = race_turn().await;
    for round in 0..race_rounds().min(8) {
        let pool = format!("rw-{round}");
        put_windowed(
            &app,
            &pool,
            &pool,
            100,
            json!([{"requests": 10, "seconds": 2}]),
        )
        .await;
        let (first, refused) = race(&app, Some(other), &pool, &[0; RACERS]).await;
        assert_eq!(first.len(), 10, "round {round}: {} winners", first.len());
        assert_eq!(refused.len(), 54);
        release_all(&app, &first).await;
        // released or not, the window has counted them: still nothing until it frees
        let response = app
            .allocate(json!({"provider": "openai", "model": "gpt-4o", "pool": pool}))
            .await;
        let retry_after: u64 = retry_after(&response);
        assert!((1..=3).contains(&retry_after), "Retry-After {retry_after}");
        assert_error(response, StatusCode::TOO_MANY_REQUESTS, "pool_exhausted").await;
        tokio::time::sleep(Duration::from_millis(2200)).await;
        let (second, _) = race(&app, Some(other), &pool, &[0; RACERS]).await;
        assert_eq!(
            second.len(),
            10,
            "round {round}, after the window: {}",
            second.len()
        );
        release_all(&app, &second).await;
    }
    let (grants, over) = window_proof(&app).await;
    assert!(grants >= 20 * race_rounds().min(8) as i64, "{grants}");
    assert_eq!(over, 0, "grants over a window in the trail");
    audit_passes(BIN, &app.database).await;
}

#[tokio::test]
async fn a_token_window_admits_exactly_the_estimates_that_fit_and_usage_replaces_them() {
    let app = Arc::new(window_app().await);
    let (other, _stop) = app.replica(32).await;
    let _turn = race_turn().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for round in 0..race_rounds().min(8) {
        let pool = format!("tw-{round}");
        put_windowed(
            &app,
            &pool,
            &pool,
            100,
            json!([{"tokens": 1000, "seconds": 30}]),
        )
        .await;
        let estimates: Vec<u64> = (0..RACERS)
            .map(|_| [50, 100, 150, 200, 300][rng.random_range(0..5)])
            .collect();
        let (granted, refused) = race(&app, Some(other), &pool, &estimates).await;
        let reserved: u64 = granted.iter().map(|l| l["tokens"].as_u64().unwrap()).sum();
        assert!(
            reserved <= 1000,
            "round {round}: {reserved} tokens reserved"
        );
        // and nobody was refused who would have fit in what was left
        let smallest_refused = refused.iter().min().copied().unwrap_or(u64::MAX);
        assert!(
            1000 - reserved < smallest_refused,
            "round {round}: {} tokens left, yet an estimate of {smallest_refused} was refused",
            1000 - reserved
        );
    }
    // usage below the estimate gives the difference back; above it takes more
    for (usage, racers_then) in [(100u64, 9usize), (600, 4)] {
        let pool = format!("usage-{usage}");
        put_windowed(
            &app,
            &pool,
            &pool,
            100,
            json!([{"tokens": 1000, "seconds": 60}]),
        )
        .await;
        let estimate = if usage < 600 { 600 } else { 100 };
        let lease = app
            .lease(
                json!({"provider": "openai", "model": "gpt-4o", "pool": pool, "tokens": estimate}),
            )
            .await;
        let mut body = release_body(&lease, "success");
        body["usage"] = json!({"tokens": usage});
        assert_eq!(app.release(body).ok_json().await["released"], true);
        let (granted, _) = race(&app, None, &pool, &[100; RACERS]).await;
        assert_eq!(
            granted.len(),
            racers_then,
            "usage {usage} after an estimate of {estimate}"
        );
    }
    let (_, over) = window_proof(&app).await;
    assert_eq!(over, 0, "grants over a window in the trail");
}

#[tokio::test]
async fn an_estimate_no_window_can_hold_is_409_and_a_full_window_429_until_the_moment_it_frees() {
    let _waiters = exclusive_waiters().await;
    let app = window_app().await;
    put_windowed(
        &app,
        "small",
        "default",
        4,
        json!([{"tokens": 500, "seconds": 3}, {"requests": 2, "seconds": 3}]),
    )
    .await;
    let before = app.snapshot().await;
    let response = app
        .allocate(json!({"provider": "openai", "model": "gpt-4o", "tokens": 501}))
        .await;
    assert_error(response, StatusCode::CONFLICT, "tokens_exceed_budget").await;
    assert_eq!(app.snapshot().await, before, "a 409 changed the database");

    for _ in 0..2 {
        app.lease(json!({"provider": "openai", "model": "gpt-4o", "tokens": 100}))
            .await;
    }
    // the requests window is full: Retry-After says when it frees, within a second
    let response = app.allocate(gpt4o()).await;
    let retry_after: u64 = retry_after(&response);
    assert_error(response, StatusCode::TOO_MANY_REQUESTS, "pool_exhausted").await;
    let frees_at: f64 = app
        .scalar(
            "SELECT extract(epoch FROM credpool_window_frees_at(w, now(), 0) - now())::float8
         FROM lease_windows w WHERE key_id = 'small'",
        )
        .await;
    let true_moment = frees_at;
    assert!(
        (retry_after as f64 - true_moment).abs() <= 1.0 + 0.05,
        "Retry-After {retry_after} s, the window frees in {true_moment:.2} s"
    );
    let metrics = app.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("credpool_allocations_held_back_total")
                && l.contains("held_by=\"requests_window\"")
                && !l.ends_with(" 0")),
        "the 429 was not counted as held back by a requests window"
    );

    // a waiter is served when the window frees, before its own deadline
    let waited = Instant::now();
    let response = app
        .allocate(json!({"provider": "openai", "model": "gpt-4o", "wait_ms": 10_000}))
        .await;
    json_body(response, StatusCode::OK).await;
    let elapsed = waited.elapsed();
    assert!(
        elapsed.as_secs_f64() >= frees_at - 0.5 && elapsed < Duration::from_secs(8),
        "the waiter was served after {elapsed:?}; the window freed after {frees_at:.2} s"
    );
}

#[tokio::test]
async fn rate_limits_are_set_shown_changed_and_validated_over_http() {
    let app = window_app().await;
    put_windowed(
        &app,
        "tier-1",
        "default",
        8,
        json!([{"requests": 500, "seconds": 60}, {"tokens": 30000, "seconds": 60}]),
    )
    .await;
    let lease = app
        .lease(json!({"provider": "openai", "model": "gpt-4o", "tokens": 1200}))
        .await;
    let detail = app
        .admin_unnamed(Method::GET, "/api/admin/keys/tier-1", None)
        .ok_json()
        .await;
    assert_eq!(
        detail["rate_limits"],
        json!([{"requests": 500, "seconds": 60}, {"tokens": 30000, "seconds": 60}])
    );
    assert_eq!(detail["windows"][0]["used"], 1);
    assert_eq!(detail["windows"][1]["used"], 1200);
    assert_eq!(detail["windows"][1]["headroom"], 28800);
    let mut body = release_body(&lease, "success");
    body["usage"] = json!({"tokens": 900});
    app.release(body).ok_json().await;

    let patch = |body: Value| {
        app.client
            .patch(app.url("/api/admin/keys/tier-1"))
            .header("x-admin-key", ADMIN_KEY)
            .json(&body)
            .send()
    };
    let changed = json_body(
        patch(json!({"rate_limits": [{"tokens": 30000, "seconds": 60}]}))
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    assert_eq!(changed["windows"].as_array().unwrap().len(), 1);
    assert_eq!(
        changed["windows"][0]["used"], 900,
        "a kept window forgot what it counted"
    );
    for bad in [
        json!({"rate_limits": [{"requests": 0, "seconds": 60}]}),
        json!({"rate_limits": [{"requests": 5, "seconds": 2678401}]}),
        json!({"rate_limits": [{"requests": 5, "tokens": 5, "seconds": 60}]}),
        json!({"rate_limits": {"requests": 5, "seconds": 60}}),
    ] {
        let before = app.snapshot().await;
        assert_error(
            patch(bad.clone()).await.unwrap(),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        )
        .await;
        assert_eq!(app.snapshot().await, before, "{bad} changed the database");
    }
    for bad in [json!({"tokens": 1_000_000_001u64}), json!({"tokens": -1})] {
        let mut request = gpt4o();
        request["tokens"] = bad["tokens"].clone();
        app.allocate(request)
            .refused(StatusCode::BAD_REQUEST, "invalid_request")
            .await;
    }
    let removed = json_body(
        patch(json!({"rate_limits": []})).await.unwrap(),
        StatusCode::OK,
    )
    .await;
    assert_eq!(removed["rate_limits"], json!([]));
}

/// Waits until a transaction on the app's database queues for a row lock (an operator's change
/// behind a transaction the test holds).
async fn until_a_transaction_waits_for_a_lock(app: &TestApp) {
    wait_for_lock_waiters(app, 1).await;
}

#[tokio::test]
async fn grants_made_before_a_credential_had_windows_are_not_judged_by_the_windows_set_later() {
    let app = window_app().await;
    put_windowed(&app, "legacy", "default", 8, json!([])).await;
    // a credential created by a release from before rate windows: its `created` row has no
    // `rate_limits` at all (the trail is append-only; the row is replaced, not edited)
    app.run_sql("WITH old AS (DELETE FROM credential_events WHERE key_id = 'legacy' RETURNING *)
         INSERT INTO credential_events (key_id, event, old_status, new_status, reason, actor, details, at)
         SELECT key_id, event, old_status, new_status, reason, actor, details #- '{new,rate_limits}', at
         FROM old").await;
    let mut leases = Vec::new();
    for _ in 0..5 {
        leases.push(grant(&app).await);
    }
    release_all(&app, &leases).await;
    let changed = app
        .admin_unnamed(
            Method::PATCH,
            "/api/admin/keys/legacy",
            Some(json!({"rate_limits": [{"requests": 2, "seconds": 60}]})),
        )
        .ok_json()
        .await;
    assert_eq!(
        changed["rate_limits"],
        json!([{"requests": 2, "seconds": 60}])
    );
    // the new window counts the five grants of the last minute: nothing more until they leave it
    app.allocate(gpt4o())
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    let (_, over) = window_proof(&app).await;
    assert_eq!(
        over, 0,
        "grants made while the credential had no window were judged by the window set later"
    );
    audit_passes(BIN, &app.database).await;

    // a grant into the full window, written straight into the trail as a bug in the claim would
    // have: the proof still reports it
    app.run_sql("INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at, tokens)
         VALUES ('granted', gen_random_uuid(), 'legacy', 'openai', 'default', 0,
                 clock_timestamp() + interval '60 seconds', clock_timestamp(), 0)").await;
    let (_, over) = window_proof(&app).await;
    assert_eq!(over, 1, "a grant over the window went unreported");
    audit_fails(
        BIN,
        &app.database,
        &["legacy", "1 grants exceeded a window"],
    )
    .await;
}

#[tokio::test]
async fn a_window_lowered_while_a_claim_commits_judges_that_grant_by_the_window_it_was_admitted_under()
 {
    // A change of windows takes effect once its transaction holds the credential's slot rows. A
    // grant committed while the change waited for them was admitted under the old window; the
    // trail must date the change after that grant, or the proof judges it by the lowered count.
    let app = window_app().await;
    put_windowed(
        &app,
        "lowered",
        "default",
        5,
        json!([{"requests": 3, "seconds": 60}]),
    )
    .await;
    for _ in 0..2 {
        grant(&app).await;
    }
    // a transaction holds slot 0 (a release in progress, say): the change queues behind it,
    // after its own transaction has begun
    let holder = holding(
        &app,
        &["SELECT 1 FROM lease_slots WHERE key_id = 'lowered' AND slot = 0 FOR UPDATE"],
    )
    .await;
    let change = tokio::spawn(
        app.client
            .patch(app.url("/api/admin/keys/lowered"))
            .header("x-admin-key", ADMIN_KEY)
            .json(&json!({"rate_limits": [{"requests": 2, "seconds": 60}]}))
            .send(),
    );
    until_a_transaction_waits_for_a_lock(&app).await;
    // meanwhile a third grant, which the window of 3 admits (slot 2 is not locked yet)
    grant(&app).await;
    holder.commit().await.unwrap();
    let changed = json_body(change.await.unwrap().unwrap(), StatusCode::OK).await;
    assert_eq!(
        changed["rate_limits"],
        json!([{"requests": 2, "seconds": 60}])
    );
    let (grants, over) = window_proof(&app).await;
    assert_eq!(grants, 3);
    assert_eq!(
        over, 0,
        "a grant admitted before the change took effect was judged by the lowered window"
    );
    audit_passes(BIN, &app.database).await;
}

#[tokio::test]
async fn a_window_row_held_longer_than_a_few_claims_take_is_waited_for_not_answered_429() {
    // A claim passes over a window row another transaction holds (a claim group committing) and
    // tries again while, read now, that window has room. Under load such a commit takes tens of
    // milliseconds: the request must keep trying, not answer 429 while the window and a slot are
    // free. The test holds the row for 300 ms.
    let app = window_app().await;
    put_windowed(
        &app,
        "held",
        "default",
        2,
        json!([{"requests": 10, "seconds": 60}]),
    )
    .await;
    grant(&app).await;
    let holder = holding(
        &app,
        &["SELECT 1 FROM lease_windows WHERE key_id = 'held' FOR UPDATE"],
    )
    .await;
    let allocate = tokio::spawn(
        app.client
            .post(app.url("/api/internal/allocate-key"))
            .header("x-internal-key", INTERNAL_KEY)
            .json(&gpt4o())
            .send(),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.commit().await.unwrap();
    let lease = json_body(allocate.await.unwrap().unwrap(), StatusCode::OK).await;
    assert_eq!(lease["key_id"], "held");
    let (grants, over) = window_proof(&app).await;
    assert_eq!((grants, over), (2, 0));
}

#[tokio::test]
async fn usage_reported_above_the_estimate_counts_against_every_grant_after_the_report() {
    // The proof judges each grant by what credpool could know when it granted: the usage of
    // earlier grants if already reported, else their reservations.
    let app = window_app().await;
    for key in ["reported-later", "reported-first"] {
        put_windowed(&app, key, key, 4, json!([{"tokens": 100, "seconds": 60}])).await;
    }
    let allocate = |pool: &'static str| {
        app.allocate(json!({"provider": "openai", "model": "gpt-4o", "pool": pool, "tokens": 50}))
    };
    let release = |lease: &Value, usage: u64| {
        let mut body = release_body(lease, "success");
        body["usage"] = json!({"tokens": usage});
        app.release(body)
    };
    // the second grant comes before the first one's usage (90) is reported: it was admitted on
    // the reservations (50 + 50), and a usage reported afterwards does not make it a violation
    let first = allocate("reported-later").ok_json().await;
    let second = allocate("reported-later").ok_json().await;
    release(&first, 90).ok_json().await;
    release(&second, 50).ok_json().await;
    // the first grant's usage (90) is reported before the second allocate: no room for 50 more
    let first = allocate("reported-first").ok_json().await;
    release(&first, 90).ok_json().await;
    allocate("reported-first")
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    let (grants, over) = window_proof(&app).await;
    assert_eq!((grants, over), (3, 0));
    audit_passes(BIN, &app.database).await;

    // the grant a claim that dropped the usage above the estimate would have made, written
    // straight into the trail: 90 used + 50 reserved in a window of 100
    app.run_sql("INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at, tokens)
         VALUES ('granted', gen_random_uuid(), 'reported-first', 'openai', 'reported-first', 1,
                 clock_timestamp() + interval '60 seconds', clock_timestamp(), 50)").await;
    let (_, over) = window_proof(&app).await;
    assert_eq!(
        over, 1,
        "a grant over the usage reported before it went unreported"
    );
    audit_fails(
        BIN,
        &app.database,
        &["reported-first", "1 grants exceeded a window"],
    )
    .await;
}

fn random_state<R: Rng>(rng: &mut R, now_micros: i64) -> WindowState {
    let windows: Vec<RateLimit> = (0..rng.random_range(1..4))
        .map(|i| RateLimit {
            kind: if i % 2 == 0 {
                WindowKind::Requests
            } else {
                WindowKind::Tokens
            },
            count: rng.random_range(1..50),
            seconds: [1, 2, 7, 60][rng.random_range(0..4)] + i,
        })
        .collect();
    let mut bucket_ids = Vec::new();
    let mut bucket_charged = Vec::new();
    for window in &windows {
        let width = i64::from(window.seconds) * 1_000_000 / 16;
        let current = now_micros / width;
        for _ in 0..RING {
            let id = current - rng.random_range(0..25);
            bucket_ids.push(if rng.random_bool(0.2) { 0 } else { id });
            bucket_charged.push(rng.random_range(0..20));
        }
    }
    WindowState {
        windows,
        bucket_ids,
        bucket_charged,
    }
}

#[tokio::test]
async fn the_rust_estimate_of_a_window_agrees_with_the_database_rule() {
    let app = TestApp::spawn().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let now = time::OffsetDateTime::now_utc();
    let now = now.replace_nanosecond(now.microsecond() * 1000).unwrap();
    let now_micros = (now.unix_timestamp_nanos() / 1000) as i64;
    for case in 0..300 {
        let state = random_state(&mut rng, now_micros);
        let tokens: u64 = rng.random_range(0..30);
        let kinds: Vec<&str> = state.windows.iter().map(|w| w.kind.as_str()).collect();
        let counts: Vec<i64> = state.windows.iter().map(|w| w.count as i64).collect();
        let seconds: Vec<i32> = state.windows.iter().map(|w| w.seconds as i32).collect();
        let (room, frees, used): (bool, Option<time::OffsetDateTime>, i64) = sqlx::query_as(
            "SELECT credpool_window_room(w, $6, $7),
                    nullif(credpool_window_frees_at(w, $6, $7), 'infinity'),
                    credpool_window_used(w, 1, $6)
             FROM (SELECT ROW('case', $1::text[], $2::int8[], $3::int4[], $4::int8[], $5::int8[], 'bench')::lease_windows AS w) x",
        )
        .bind(&kinds)
        .bind(&counts)
        .bind(&seconds)
        .bind(&state.bucket_ids)
        .bind(&state.bucket_charged)
        .bind(now)
        .bind(tokens as i64)
        .fetch_one(&app.db)
        .await
        .unwrap();
        assert_eq!(
            state.room(now, tokens),
            room,
            "case {case}: room, {state:?}"
        );
        assert_eq!(state.used(0, now), used, "case {case}: used");
        assert_eq!(
            state.frees_at(now, tokens),
            frees,
            "case {case}: frees_at, {state:?}"
        );
    }
}
