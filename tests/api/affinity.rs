//! Conversation affinity: a conversation (`affinity_key`) keeps the credential that
//! served it while that credential can serve now, and moves at once when it cannot (full,
//! disabled, cooling down, moved to another pool); `strict` waits for it instead; bindings die
//! with their TTL; bad input is a 400 that writes nothing; the binding's write never makes a
//! claim wait, across replicas.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::sync::Barrier;

use credpool_test_support::*;

/// An allocate body of conversation `conversation` (600-second leases, `gpt-4o`).
fn call(pool: &str, conversation: &str) -> Value {
    json!({
        "provider": "openai", "model": "gpt-4o", "pool": pool, "lease_seconds": 600,
        "affinity_key": conversation,
    })
}

/// [`call`] in pool `default` with `affinity_mode` `mode`.
fn call_in_mode(conversation: &str, mode: &str) -> Value {
    let mut body = call("default", conversation);
    body["affinity_mode"] = json!(mode);
    body
}

/// A call that binds its conversation: leased with `body`, then released with `success`. The
/// lease.
async fn lease_and_release(app: &TestApp, body: &Value) -> Value {
    let lease = app.lease(body.clone()).await;
    app.release_ok(&lease, "success").await;
    lease
}

/// The credential a conversation is bound to (pool asked for `pool`), if any row exists.
async fn bound(app: &TestApp, pool: &str, conversation: &str) -> Option<String> {
    sqlx::query_scalar(
        "SELECT key_id FROM affinity_bindings
         WHERE tenant = 'default' AND provider = 'openai' AND pool = $1 AND affinity_key = $2",
    )
    .bind(pool)
    .bind(conversation)
    .fetch_optional(&app.db)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conversations_keep_their_credential_while_it_has_room_and_the_load_stays_spread() {
    const CREDENTIALS: usize = 10;
    const CONVERSATIONS: usize = 100;
    const CALLS: usize = 20;
    let app = Arc::new(TestApp::spawn().await);
    for k in 0..CREDENTIALS {
        // a pool of its own: the metrics are the test binary's, shared by every test
        app.put_gpt4o_key(&format!("key-{k:02}"), "spread", 4).await;
    }
    // 8 conversations in flight at once over 40 slots: room everywhere, all the time
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (app, next) = (app.clone(), next.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                loop {
                    let c = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if c >= CONVERSATIONS {
                        return seen;
                    }
                    let conversation = format!("conversation-{c}");
                    for i in 0..CALLS {
                        let lease = app.lease(call("spread", &conversation)).await;
                        app.release_ok(&lease, "success").await;
                        let key = lease["key_id"].as_str().unwrap().to_owned();
                        let affinity = lease["affinity"].as_str().unwrap_or("absent").to_owned();
                        seen.push((c, i, key, affinity));
                    }
                }
            })
        })
        .collect();
    let mut calls = Vec::new();
    for task in tasks {
        calls.extend(task.await.unwrap());
    }
    assert_eq!(calls.len(), CONVERSATIONS * CALLS);
    let firsts: Vec<_> = calls.iter().filter(|(_, i, _, _)| *i == 0).collect();
    assert!(firsts.iter().all(|(_, _, _, a)| a == "new"), "{firsts:?}");
    let later: Vec<_> = calls.iter().filter(|(_, i, _, _)| *i > 0).collect();
    let hits = later.iter().filter(|(_, _, _, a)| a == "hit").count();
    assert!(
        hits * 100 >= later.len() * 95,
        "{hits} hits of {} calls after the first",
        later.len()
    );
    // the load still spread: each conversation counts for the credential that served it first
    let mut per_credential: HashMap<&str, usize> = HashMap::new();
    for (_, _, key, _) in &firsts {
        *per_credential.entry(key.as_str()).or_default() += 1;
    }
    let fair = CONVERSATIONS / CREDENTIALS;
    assert!(
        per_credential.values().all(|n| *n <= 2 * fair),
        "{per_credential:?}"
    );
    // the metric counts the same
    let page = app.metrics().await;
    let hit_series =
        r#"credpool_allocations_affinity_total{provider="openai",pool="spread",result="hit"}"#;
    assert_eq!(sample(&page, hit_series) as usize, hits, "{page}");
    // and the trail, for the dashboard
    let trail_hits: i64 = app
        .scalar("SELECT count(*) FROM lease_events WHERE event = 'granted' AND affinity = 'hit'")
        .await;
    assert_eq!(trail_hits as usize, hits);
}

#[tokio::test]
async fn a_full_bound_credential_moves_the_conversation_at_once_and_strict_waits_for_it() {
    let _waiters = exclusive_waiters().await;
    let app = Arc::new(TestApp::spawn_with(AppOptions::deterministic()).await);
    app.put_gpt4o_key("key-a", "default", 1).await;
    app.put_gpt4o_key("key-b", "default", 1).await;

    let first = app.lease(call("default", "c1")).await;
    assert_eq!(first["affinity"], "new", "{first}");
    let bound_key = first["key_id"].as_str().unwrap().to_owned();
    assert_eq!(
        bound(&app, "default", "c1").await.as_deref(),
        Some(&*bound_key)
    );
    // the bound credential is full (its one slot held by the first call): served by the other in
    // the same request, without waiting, and the binding moves
    let started = Instant::now();
    let second = app.lease(call("default", "c1")).await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_ne!(second["key_id"], first["key_id"]);
    assert_eq!(second["affinity"], "moved", "{second}");
    assert_eq!(
        bound(&app, "default", "c1").await,
        second["key_id"].as_str().map(String::from)
    );
    app.release_ok(&second, "success").await;
    app.release_ok(&first, "success").await;

    // strict: the bound credential alone, though the other one is free
    let held = app.lease(call("default", "c2")).await;
    let mut strict = call("default", "c2");
    strict["affinity_mode"] = json!("strict");
    app.allocate(strict.clone())
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    strict["wait_ms"] = json!(10_000);
    let waiting = {
        let (app, strict) = (app.clone(), strict.clone());
        tokio::spawn(async move { (app.lease(strict).await, Instant::now()) })
    };
    waiters_queued(&app, 1).await;
    assert!(
        !waiting.is_finished(),
        "a strict call was served by another credential"
    );
    let freed = Instant::now();
    app.release_ok(&held, "success").await;
    let (served, at) = waiting.await.unwrap();
    assert!(at >= freed);
    assert_eq!(served["key_id"], held["key_id"], "{served}");
    assert_eq!(served["affinity"], "hit", "{served}");
    assert_eq!(app.in_flight(held["key_id"].as_str().unwrap()).await, 1);
}

#[tokio::test]
async fn a_disabled_or_cooling_bound_credential_moves_the_conversation_never_refuses_it() {
    let app = TestApp::spawn_with(AppOptions::deterministic()).await;
    app.put_gpt4o_key("key-a", "default", 2).await;
    app.put_gpt4o_key("key-b", "default", 2).await;

    for mode in ["preferred", "strict"] {
        // disabled by an operator
        let conversation = format!("disabled-{mode}");
        let body = call_in_mode(&conversation, mode);
        let first = lease_and_release(&app, &body).await;
        let key = first["key_id"].as_str().unwrap().to_owned();
        let response = app
            .patch_key(&key, json!({"state": "disable", "reason": "test"}))
            .await;
        assert!(response.status().is_success(), "{}", response.status());
        let next = app.lease(body.clone()).await;
        assert_ne!(next["key_id"], first["key_id"], "{next}");
        assert_eq!(next["affinity"], "moved", "{next}");
        app.release_ok(&next, "success").await;
        let response = app.patch_key(&key, json!({"state": "enable"})).await;
        assert!(response.status().is_success(), "{}", response.status());

        // cooling down after a rate_limited report
        let body = call_in_mode(&format!("cooling-{mode}"), mode);
        let first = app.lease(body.clone()).await;
        let mut report = release_body(&first, "rate_limited");
        report["retry_after_seconds"] = json!(120);
        app.release(report).ok_json().await;
        let next = app.lease(body.clone()).await;
        assert_ne!(next["key_id"], first["key_id"], "{next}");
        assert_eq!(next["affinity"], "moved", "{next}");
        app.release_ok(&next, "success").await;
        // back to health for the next mode
        app.set_status(first["key_id"].as_str().unwrap(), "available", None)
            .await;
    }
}

#[tokio::test]
async fn a_binding_outlives_neither_its_ttl_nor_its_credentials_pool_move() {
    let app = TestApp::spawn_with(AppOptions::deterministic()).await;
    app.put_gpt4o_key("key-a", "default", 2).await;
    app.put_gpt4o_key("key-b", "default", 2).await;

    // TTL: refreshed by each hit, gone after it
    let mut body = call("default", "short");
    body["affinity_ttl_seconds"] = json!(2);
    lease_and_release(&app, &body).await;
    let ttl: f64 = app
        .scalar(
            "SELECT extract(epoch FROM expires_at - last_hit_at)::float8 FROM affinity_bindings
         WHERE affinity_key = 'short'",
        )
        .await;
    assert_eq!(ttl, 2.0);
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let again = app.lease(body.clone()).await;
        assert_eq!(again["affinity"], "hit", "{again}");
        app.release_ok(&again, "success").await;
    }
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let after = app.lease(body.clone()).await;
    assert_eq!(after["affinity"], "new", "{after}");
    app.release_ok(&after, "success").await;

    // expired bindings are purged by the maintenance pass
    app.run_sql("UPDATE affinity_bindings SET last_hit_at = now() - interval '2 hours', expires_at = now() - interval '1 hour'").await;
    let purged: i32 = app.scalar("SELECT credpool_purge_affinity()").await;
    assert_eq!(purged, 1);

    // a pool move: the next call is served in the pool asked for, by another credential, even
    // strict
    for mode in ["preferred", "strict"] {
        let conversation = format!("moving-{mode}");
        let body = call_in_mode(&conversation, mode);
        let first = lease_and_release(&app, &body).await;
        let key = first["key_id"].as_str().unwrap().to_owned();
        app.put_gpt4o_key(&key, "elsewhere", 2).await;
        let next = app.lease(body.clone()).await;
        assert_ne!(next["key_id"], first["key_id"], "{next}");
        assert_eq!(next["pool"], "default");
        assert_eq!(next["affinity"], "moved", "{next}");
        app.release_ok(&next, "success").await;
        assert_eq!(
            bound(&app, "default", &conversation).await,
            next["key_id"].as_str().map(String::from)
        );
        app.put_gpt4o_key(&key, "default", 2).await;
    }
}

#[tokio::test]
async fn the_maintenance_pass_keeps_bindings_under_their_cap_oldest_hit_first_and_a_delete_drops_them()
 {
    let app = TestApp::with_credential("key-a", 8).await;
    for c in 0..5 {
        let lease = app.lease(call("default", &format!("capped-{c}"))).await;
        app.release_ok(&lease, "success").await;
    }
    let evicted: i32 = app.scalar("SELECT credpool_purge_affinity(3)").await;
    assert_eq!(evicted, 2);
    let left: Vec<String> = app
        .scalars("SELECT affinity_key FROM affinity_bindings ORDER BY affinity_key")
        .await;
    assert_eq!(left, ["capped-2", "capped-3", "capped-4"]);
    // the maintenance pass runs it with the default cap: nothing more to do
    let step: (String, Option<i32>) =
        sqlx::query_as("SELECT name, done FROM credpool_maintenance_step(8, '30 days')")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(step, ("affinity_bindings_purged".to_owned(), Some(0)));

    let response = app
        .admin(Method::DELETE, "/api/admin/keys/key-a", None)
        .await;
    assert!(response.status().is_success(), "{}", response.status());
    let left: i64 = app.scalar("SELECT count(*) FROM affinity_bindings").await;
    assert_eq!(left, 0);
}

#[tokio::test]
async fn bad_affinity_input_is_a_400_and_writes_nothing() {
    let app = TestApp::with_credential("key-a", 2).await;
    let before = app.snapshot().await;
    let base = gpt4o();
    let long = "x".repeat(257);
    for extra in [
        json!({"affinity_key": ""}),
        json!({"affinity_key": long}),
        json!({"affinity_key": "line\nbreak"}),
        json!({"affinity_key": 42}),
        json!({"affinity_key": "c", "affinity_ttl_seconds": 0}),
        json!({"affinity_key": "c", "affinity_ttl_seconds": 86_401}),
        json!({"affinity_key": "c", "affinity_ttl_seconds": -1}),
        json!({"affinity_key": "c", "affinity_mode": "sticky"}),
        json!({"affinity_ttl_seconds": 60}),
        json!({"affinity_mode": "strict"}),
    ] {
        let mut body = base.clone();
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let error = app
            .allocate(body)
            .refused(StatusCode::BAD_REQUEST, "invalid_request")
            .await;
        assert!(
            error_message(&error).contains("affinity"),
            "{extra}: {error}"
        );
    }
    assert_eq!(app.snapshot().await, before);

    // the longest key and a TTL of a day are fine; a replay of the same request_id answers the
    // same lease, without an affinity result (the first attempt's answer had it)
    let mut body = call("default", &"y".repeat(256));
    body["affinity_ttl_seconds"] = json!(86_400);
    body["request_id"] = json!("req-1");
    let first = app.lease(body.clone()).await;
    assert_eq!(first["affinity"], "new");
    let replay = app.lease(body).await;
    assert_eq!(replay["lease_id"], first["lease_id"]);
    assert!(replay.get("affinity").is_none(), "{replay}");
    // without an affinity_key, no affinity in the answer
    let plain = app.lease(gpt4o()).await;
    assert!(plain.get("affinity").is_none(), "{plain}");
}

/// 48 concurrent allocates of one conversation, spread over three replicas, on 4 credentials of
/// limit 2: exactly 8 winners (no oversell, no false "pool full"), no 503 (no deadlock, no lock
/// wait timeout), every round; strict rounds: exactly the bound credential's 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_allocates_of_one_conversation_over_replicas_never_oversell_or_deadlock() {
    const RACERS: usize = 48;
    let _turn = race_turn().await;
    let app = Arc::new(TestApp::spawn_with(AppOptions::connections(16)).await);
    let (second, _stop_second) = app.replica(16).await;
    let (third, _stop_third) = app.replica(16).await;
    let bases = [
        app.url(""),
        format!("http://{second}"),
        format!("http://{third}"),
    ];
    for k in 0..4 {
        app.put_gpt4o_key(&format!("key-{k}"), "default", 2).await;
    }
    for round in 0..race_rounds().max(6) {
        let strict = round % 2 == 1;
        let barrier = Arc::new(Barrier::new(RACERS));
        let tasks: Vec<_> = (0..RACERS)
            .map(|i| {
                let barrier = barrier.clone();
                let replica = Remote::new(&app.client, &bases[i % bases.len()]);
                let mut body = call("default", "one-conversation");
                if strict {
                    body["affinity_mode"] = json!("strict");
                }
                tokio::spawn(async move {
                    barrier.wait().await;
                    let response = replica.allocate(body).await;
                    let status = response.status();
                    (status, response.json::<Value>().await.unwrap())
                })
            })
            .collect();
        let mut leases = Vec::new();
        for task in tasks {
            let (status, body) = task.await.unwrap();
            match status {
                StatusCode::OK => leases.push(body),
                StatusCode::TOO_MANY_REQUESTS => {}
                other => panic!("round {round}: {other} {body}"),
            }
        }
        let bound_key = bound(&app, "default", "one-conversation").await;
        if strict {
            assert_eq!(leases.len(), 2, "round {round}");
            assert!(leases.iter().all(|l| l["key_id"].as_str() == bound_key.as_deref() && l["affinity"] == "hit"));
        } else {
            assert_eq!(leases.len(), 8, "round {round}");
            assert!(
                leases.iter().all(|l| l["affinity"].is_string()),
                "{leases:?}"
            );
        }
        for k in 0..4 {
            assert!(
                app.in_flight(&format!("key-{k}")).await <= 2,
                "round {round}"
            );
        }
        assert!(bound_key.is_some());
        for lease in &leases {
            app.release_ok(lease, "success").await;
        }
    }
}

/// The Rust client sends the affinity fields and reads the answer's result.
#[tokio::test]
async fn the_rust_client_keeps_a_conversation_on_its_credential() {
    use credpool_client::{AffinityMode, AffinityResult, Client, LeaseRequest, Outcome};
    let app = TestApp::with_credential("key-a", 2).await;
    app.put_gpt4o_key("key-b", "default", 2).await;
    let client = Client::new(app.url(""), INTERNAL_KEY).expect("client");
    let request = LeaseRequest::new("openai", "gpt-4o")
        .affinity_key("conversation-from-rust")
        .affinity_ttl(Duration::from_millis(1500))
        .affinity_mode(AffinityMode::Preferred);
    let first = client.lease(request.clone()).await.expect("lease");
    assert_eq!(first.affinity(), Some(&AffinityResult::New));
    let key = first.key_id().to_owned();
    first.finish(Outcome::Success).await.expect("release");
    let second = client.lease(request).await.expect("lease");
    assert_eq!(second.affinity(), Some(&AffinityResult::Hit));
    assert_eq!(second.key_id(), key);
    second.finish(Outcome::Success).await.expect("release");
    // the TTL went in whole seconds, rounded up
    let ttl: f64 = app
        .scalar(
            "SELECT extract(epoch FROM expires_at - last_hit_at)::float8 FROM affinity_bindings",
        )
        .await;
    assert_eq!(ttl, 2.0);
}

/// A binding row another transaction holds (an operator's delete cascading to it, say) and an
/// affinity key whose advisory lock another transaction holds: the claim is served at once and
/// leaves that binding as it is; it never waits for either lock.
#[tokio::test]
async fn a_binding_held_by_another_transaction_is_left_as_it_is_never_waited_for() {
    let app = TestApp::spawn_with(AppOptions::deterministic()).await;
    app.put_gpt4o_key("key-a", "default", 1).await;
    app.put_gpt4o_key("key-b", "default", 1).await;
    let first = app.lease(call("default", "held-row")).await;
    let second = app.lease(call("default", "held-lock")).await;
    let (row_key, lock_key) = (first["key_id"].clone(), second["key_id"].clone());
    app.release_ok(&first, "success").await;
    app.release_ok(&second, "success").await;
    let held = [
        "SELECT 1 FROM affinity_bindings WHERE affinity_key = 'held-row' FOR UPDATE",
        "SELECT pg_advisory_xact_lock(credpool_affinity_lock('default', 'openai', 'default', 'held-lock'))",
    ];
    let holder = holding(&app, &held).await;
    for (conversation, was) in [("held-row", &row_key), ("held-lock", &lock_key)] {
        let started = Instant::now();
        let served = tokio::time::timeout(
            Duration::from_secs(5),
            app.allocate(call("default", conversation)),
        )
        .await
        .expect("the claim waited for a binding's lock");
        let served = json_body(served, StatusCode::OK).await;
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(served["affinity"], "hit", "{served}");
        app.release_ok(&served, "success").await;
        // the binding was not refreshed: the other transaction holds it
        assert_eq!(
            bound(&app, "default", conversation).await.as_deref(),
            was.as_str()
        );
    }
    let refreshed: i64 = app
        .scalar("SELECT count(*) FROM affinity_bindings WHERE last_hit_at > bound_at")
        .await;
    assert_eq!(
        refreshed, 0,
        "a binding another transaction holds was written"
    );
    holder.rollback().await.unwrap();
}

/// The dashboard's pools page shows each pool's hit ratio over the last hour, from the trail:
/// grants through another replica count too.
#[tokio::test]
async fn the_dashboard_shows_each_pools_hit_ratio_from_the_trail() {
    let app = TestApp::spawn_with(AppOptions::deterministic()).await;
    let (other, _stop) = app.replica(4).await;
    app.put_gpt4o_key("key-a", "default", 1).await;
    app.put_gpt4o_key("key-b", "default", 1).await;
    app.put_gpt4o_key("key-v", "vip", 1).await;
    // default: new, hit (through the other replica), then moved (its credential full), hit
    let first = app.lease(call("default", "dash")).await;
    app.release_ok(&first, "success").await;
    let replica = Remote::new(&app.client, &format!("http://{other}"));
    let second = replica.lease(call("default", "dash")).await;
    assert_eq!(second["affinity"], "hit");
    let third = app.lease(call("default", "dash")).await;
    assert_eq!(third["affinity"], "moved");
    app.release_ok(&second, "success").await;
    app.release_ok(&third, "success").await;
    let fourth = app.lease(call("default", "dash")).await;
    assert_eq!(fourth["affinity"], "hit");
    assert_eq!(fourth["key_id"], third["key_id"]);
    app.release_ok(&fourth, "success").await;
    // vip: a first call only, no ratio yet
    let vip = app.lease(call("vip", "dash-vip")).await;
    app.release_ok(&vip, "success").await;

    let page = app.admin_text("/dashboard/fragments/pools").await;
    let card = |pool: &str| {
        let start = page
            .find(&format!("data-pool=\"openai/{pool}\""))
            .unwrap_or_else(|| panic!("no card for {pool}: {page}"));
        let end = page[start..].find("</article>").unwrap() + start;
        page[start..end].to_owned()
    };
    let default = card("default");
    assert!(
        default.contains(r#"<dd class="affinity" title="2 hit, 1 moved, 1 new">66 %</dd>"#),
        "{default}"
    );
    let vip = card("vip");
    assert!(
        vip.contains(r#"<dd class="affinity" title="0 hit, 0 moved, 1 new">-</dd>"#),
        "{vip}"
    );
}

/// A bound credential with rate windows, outside a ranked batch of credentials without any
/// (batch of 1: the ranking's best, the idle credential without windows): the claim picks with
/// the windows' shape so the bound credential is still tried first, and it serves (`hit`).
#[tokio::test]
async fn a_bound_credential_with_rate_windows_is_tried_first_from_a_batch_without_any() {
    let mut options = AppOptions::deterministic();
    options.settings.claims.batch = 1;
    // the view learns of key-p within 50 ms (the ranking must know it to prefer it)
    options.settings.view_refresh = Duration::from_millis(50);
    let app = TestApp::spawn_with(options).await;
    let response = app
        .put_key_raw(
            "key-w",
            json!({"provider": "openai", "pool": "default", "models": ["gpt-4o"],
                   "max_concurrent_uses": 4, "rate_limits": [{"requests": 100, "seconds": 60}],
                   "secret": {"api_key": "sk-test-key-w"}}),
        )
        .await;
    assert!(response.status().is_success(), "{}", response.status());
    // key-w busy (one lease held), so the ranking's best is the idle key-p
    let busy = app.lease(gpt4o_for(600)).await;
    assert_eq!(busy["key_id"], "key-w");
    app.put_gpt4o_key("key-p", "default", 4).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    app.run_sql("INSERT INTO affinity_bindings (provider, pool, affinity_key, key_id, bound_at, last_hit_at, expires_at)
         VALUES ('openai', 'default', 'windowed', 'key-w', now(), now(), now() + interval '1 hour')").await;
    let served = app.lease(call("default", "windowed")).await;
    assert_eq!(served["key_id"], "key-w", "{served}");
    assert_eq!(served["affinity"], "hit", "{served}");
    // the ranking alone picks the other one: the claim's batch was [key-p]
    let plain = app.lease(gpt4o_for(600)).await;
    assert_eq!(plain["key_id"], "key-p", "{plain}");
}

#[tokio::test]
async fn a_conversation_key_is_bound_per_tenant() {
    let app = TestApp::spawn().await;
    for k in ["key-a", "key-b"] {
        app.put_gpt4o_key(k, "default", 4).await;
    }
    let put = app
        .admin_unnamed(
            Method::PUT,
            "/api/admin/tenants/other-team",
            Some(json!({"pools": ["*/*"]})),
        )
        .await;
    assert_eq!(put.status(), StatusCode::CREATED);
    let minted = json_body(
        app.admin_unnamed(Method::POST, "/api/admin/tenants/other-team/keys", None)
            .await,
        StatusCode::CREATED,
    )
    .await;
    let other_key = minted["key"].as_str().unwrap().to_owned();
    let as_other = |body: Value| app.allocate_as(&other_key, body);

    // the internal key's tenant (`default`) binds the conversation ...
    let first = app.lease(call("default", "shared-name")).await;
    assert_eq!(first["affinity"], "new");
    assert_eq!(first["tenant"], "default");
    // ... and another tenant's conversation of the same name is its own: new, not a hit
    let other = as_other(call("default", "shared-name")).ok_json().await;
    assert_eq!(other["tenant"], "other-team");
    assert_eq!(other["affinity"], "new", "{other}");
    let tenants: Vec<String> = app.scalars("SELECT tenant FROM affinity_bindings WHERE affinity_key = 'shared-name' ORDER BY tenant").await;
    assert_eq!(tenants, ["default", "other-team"]);
    // each tenant's next call hits its own binding
    assert_eq!(
        app.lease(call("default", "shared-name")).await["affinity"],
        "hit"
    );
    let again = as_other(call("default", "shared-name")).ok_json().await;
    assert_eq!(again["affinity"], "hit");
    assert_eq!(again["key_id"], other["key_id"]);
}
