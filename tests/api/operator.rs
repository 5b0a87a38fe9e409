//! The operator API: reading credentials and pools, PATCH (disable, enable, drain, limits,
//! models, pool), DELETE while leased, forced releases, the audit of every mutation, and secrets
//! sealed at rest.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use credpool_test_support::*;

#[tokio::test]
async fn get_and_list_show_configuration_health_and_leases_but_never_the_secret() {
    let app = TestApp::with_credential("key-a", 3).await;
    app.put_gpt4o_key("key-b", "vip", 1).await;
    app.put_key("key-c", "anthropic", "default", &["claude"], 1)
        .await;
    let body = json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 600, "holder": "worker-9"});
    let held = app.lease(body).await;

    let response = app.admin(Method::GET, "/api/admin/keys/key-a", None).await;
    let text = response.text().await.unwrap();
    assert!(!text.contains("sk-test"), "{text}");
    let detail: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(detail["max_concurrent_uses"], 3);
    assert_eq!(detail["in_flight"], 1);
    assert_eq!(detail["leases"][0]["lease_id"], held["lease_id"]);
    assert_eq!(detail["leases"][0]["holder"], "worker-9");
    assert_eq!(detail["health"]["success_rate"], 1.0);
    assert!(detail.get("secret").is_none());

    let page = app
        .admin(Method::GET, "/api/admin/keys?provider=openai", None)
        .ok_json()
        .await;
    let ids = texts(&page["keys"], "key_id");
    assert_eq!(ids, ["key-a", "key-b"]);
    let page = app
        .admin(Method::GET, "/api/admin/keys?pool=default&limit=1", None)
        .ok_json()
        .await;
    assert_eq!(page["keys"][0]["key_id"], "key-a");
    assert_eq!(page["next_after"], "key-a");
    let next = app
        .admin(
            Method::GET,
            "/api/admin/keys?pool=default&limit=1&after=key-a",
            None,
        )
        .ok_json()
        .await;
    assert_eq!(next["keys"][0]["key_id"], "key-c");
    assert_eq!(
        app.admin(Method::GET, "/api/admin/keys?limit=1&after=key-c", None)
            .ok_json()
            .await["keys"],
        json!([])
    );

    for bad in [
        "/api/admin/keys?limit=0",
        "/api/admin/keys?status=sleepy",
        "/api/admin/keys?color=red",
    ] {
        app.admin(Method::GET, bad, None)
            .refused(StatusCode::BAD_REQUEST, "invalid_request")
            .await;
    }
    app.admin(Method::GET, "/api/admin/keys/nope", None)
        .refused(StatusCode::NOT_FOUND, "credential_not_found")
        .await;
}

#[tokio::test]
async fn a_drained_credential_lets_its_leases_finish_and_takes_no_new_ones() {
    let app = TestApp::with_credential("key-a", 3).await;
    let held = app.lease(gpt4o_for(600)).await;

    let drained = app
        .patch_key("key-a", json!({"state": "drain", "reason": "rotating"}))
        .ok_json()
        .await;
    assert_eq!(drained["draining"], true);
    assert_eq!(drained["status"], "available");
    app.allocate(gpt4o_for(600))
        .refused(StatusCode::CONFLICT, "no_usable_credentials")
        .await;

    // the lease in flight carries on: renew and release work
    let renew = renew_body(&held, 60);
    app.renew(renew).ok_json().await;
    assert_eq!(
        app.release(release_body(&held, "success")).ok_json().await["released"],
        true
    );

    app.patch_key("key-a", json!({"state": "enable"}))
        .ok_json()
        .await;
    app.lease(gpt4o_for(600)).await;
}

/// (event, old_status, new_status, actor, reason, details)
type AuditRow = (
    String,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Value,
);

#[tokio::test]
async fn disable_and_enable_are_audited_with_the_operator_and_old_and_new_values() {
    let app = TestApp::with_credential("key-a", 1).await;
    let disabled = app
        .patch_key(
            "key-a",
            json!({"state": "disable", "reason": "leaked on a forum"}),
        )
        .ok_json()
        .await;
    assert_eq!(disabled["status"], "disabled");
    assert_eq!(disabled["status_reason"], "leaked on a forum");
    app.allocate(gpt4o_for(600))
        .refused(StatusCode::CONFLICT, "no_usable_credentials")
        .await;
    app.patch_key("key-a", json!({"state": "enable"}))
        .ok_json()
        .await;
    app.lease(gpt4o_for(600)).await;

    let rows: Vec<AuditRow> = sqlx::query_as(
        "SELECT event, old_status, new_status, actor, reason, details FROM credential_events
         WHERE key_id = 'key-a' AND actor = 'alice' ORDER BY event_id",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    let events: Vec<(&str, Option<&str>, Option<&str>)> = rows
        .iter()
        .map(|r| (r.0.as_str(), r.1.as_deref(), r.2.as_deref()))
        .collect();
    assert_eq!(
        events,
        [
            ("updated", Some("available"), Some("disabled")),
            ("status_changed", Some("available"), Some("disabled")),
            ("updated", Some("disabled"), Some("available")),
            ("status_changed", Some("disabled"), Some("available")),
        ]
    );
    assert_eq!(rows[0].4.as_deref(), Some("leaked on a forum"));
    assert_eq!(rows[0].5["old"]["status"], "available");
    assert_eq!(rows[0].5["new"]["status"], "disabled");
    // the PUT that created it was audited too, with the admin key as the actor, never the secret
    let created: (Option<String>, Value) = sqlx::query_as(
        "SELECT actor, details FROM credential_events WHERE key_id = 'key-a' AND event = 'created'",
    )
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert_eq!(created.0.as_deref(), Some("admin-key"));
    assert_eq!(created.1["secret"], "replaced");
    assert!(!created.1.to_string().contains("sk-test"));
}

#[tokio::test]
async fn patch_changes_models_aliases_and_pool_and_refuses_bad_changes_whole() {
    let app = TestApp::with_credential("key-a", 1).await;
    let before = app.snapshot().await;
    for (body, code, status) in [
        (json!({}), "invalid_request", StatusCode::BAD_REQUEST),
        (
            json!({"aliases": {"fast": "o3"}}),
            "invalid_request",
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"max_concurrent_uses": 0}),
            "invalid_request",
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"state": "explode"}),
            "invalid_request",
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"pool": "Bad Pool"}),
            "invalid_request",
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"models": ["o3"], "mystery": 1}),
            "invalid_request",
            StatusCode::BAD_REQUEST,
        ),
    ] {
        assert_error(app.patch_key("key-a", body).await, status, code).await;
    }
    app.patch_key("nope", json!({"state": "drain"}))
        .refused(StatusCode::NOT_FOUND, "credential_not_found")
        .await;
    assert_eq!(app.snapshot().await, before);

    let changed = app
        .patch_key(
            "key-a",
            json!({"models": ["o3-2025"], "aliases": {"o3": "o3-2025"}, "pool": "batch"}),
        )
        .ok_json()
        .await;
    assert_eq!(changed["pool"], "batch");
    let l = app
        .lease(json!({"provider": "openai", "model": "o3", "pool": "batch"}))
        .await;
    assert_eq!(l["provider_model"], "o3-2025");
    app.allocate(gpt4o_for(600))
        .refused(StatusCode::NOT_FOUND, "pool_not_found")
        .await;
}

#[tokio::test]
async fn deleting_a_leased_credential_ends_its_leases_in_the_trail_and_late_releases_are_not_errors()
 {
    let app = TestApp::with_credential("key-a", 2).await;
    let (first, second) = (
        app.lease(gpt4o_for(600)).await,
        app.lease(gpt4o_for(600)).await,
    );

    let deleted = app
        .admin(Method::DELETE, "/api/admin/keys/key-a", None)
        .ok_json()
        .await;
    assert_eq!(deleted["deleted"], true);
    assert_eq!(deleted["force_released"].as_array().unwrap().len(), 2);

    let answer = app.release(release_body(&first, "success")).ok_json().await;
    assert_eq!(answer, json!({"released": false, "reason": "not_found"}));
    app.renew(lease_ref(&second))
        .refused(StatusCode::GONE, "lease_lost")
        .await;
    app.admin(Method::GET, "/api/admin/keys/key-a", None)
        .refused(StatusCode::NOT_FOUND, "credential_not_found")
        .await;
    app.allocate(gpt4o_for(600))
        .refused(StatusCode::NOT_FOUND, "pool_not_found")
        .await;

    let slots: i64 = app.scalar("SELECT count(*) FROM lease_slots").await;
    assert_eq!(slots, 0);
    for l in [&first, &second] {
        let mut events = app.lease_events(l).await;
        events.sort();
        assert!(events.contains(&"force_released".to_owned()), "{events:?}");
    }
    let reason: String = app
        .scalar("SELECT reason FROM lease_events WHERE event = 'force_released' LIMIT 1")
        .await;
    assert_eq!(reason, "credential deleted");
    app.admin(Method::DELETE, "/api/admin/keys/key-a", None)
        .refused(StatusCode::NOT_FOUND, "credential_not_found")
        .await;
}

#[tokio::test]
async fn forced_release_frees_leases_with_the_operators_reason_and_executors_learn_it() {
    let app = TestApp::with_credential("key-a", 3).await;
    let (one, two, three) = (
        app.lease(gpt4o_for(600)).await,
        app.lease(gpt4o_for(600)).await,
        app.lease(gpt4o_for(600)).await,
    );

    // one lease by id
    let path = format!(
        "/api/admin/leases/{}/release",
        one["lease_id"].as_str().unwrap()
    );
    let answer = app
        .admin(Method::POST, &path, Some(json!({"reason": "stuck worker"})))
        .ok_json()
        .await;
    assert_eq!(answer, json!({"released": true}));
    app.renew(lease_ref(&one))
        .refused(StatusCode::GONE, "lease_lost")
        .await;
    assert_eq!(app.in_flight("key-a").await, 2);
    let again = app
        .admin(Method::POST, &path, Some(json!({"reason": "again"})))
        .ok_json()
        .await;
    assert_eq!(again, json!({"released": false, "reason": "not_found"}));

    // all of a credential's
    let all = app
        .admin(
            Method::POST,
            "/api/admin/keys/key-a/release-all",
            Some(json!({"reason": "key rotated"})),
        )
        .ok_json()
        .await;
    assert_eq!(all["released"], 2);
    assert_eq!(app.in_flight("key-a").await, 0);
    for l in [&two, &three] {
        assert_eq!(
            app.release(release_body(l, "success")).ok_json().await["released"],
            false
        );
    }
    let trail: Vec<(String, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT replace(lease_id::text, '-', ''), reason, actor FROM lease_events WHERE event = 'force_released' ORDER BY event_id",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    assert_eq!(trail.len(), 3);
    assert_eq!(
        trail[0],
        (
            one["lease_id"].as_str().unwrap().to_owned(),
            Some("stuck worker".into()),
            Some("alice".into())
        )
    );
    assert!(
        trail[1..]
            .iter()
            .all(|t| t.1.as_deref() == Some("key rotated"))
    );

    // a missing lease id never means "all"; a reason is required
    let missing = app
        .admin(
            Method::POST,
            "/api/admin/leases//release",
            Some(json!({"reason": "x"})),
        )
        .await;
    assert!(missing.status().is_client_error(), "{}", missing.status());
    app.admin(
        Method::POST,
        "/api/admin/leases/not-hex/release",
        Some(json!({"reason": "x"})),
    )
    .refused(StatusCode::BAD_REQUEST, "invalid_request")
    .await;
    app.admin(
        Method::POST,
        "/api/admin/keys/key-a/release-all",
        Some(json!({})),
    )
    .refused(StatusCode::BAD_REQUEST, "invalid_request")
    .await;
}

#[tokio::test]
async fn pools_summarise_credentials_slots_and_leases() {
    let app = TestApp::with_credential("a1", 2).await;
    app.put_gpt4o_key("a2", "default", 3).await;
    app.put_gpt4o_key("b1", "vip", 1).await;
    app.set_status("a2", "rate_limited", Some(60.0)).await;
    app.lease(gpt4o_for(600)).await;
    app.patch_key("b1", json!({"state": "drain"})).await;

    let pools = app.admin_get("/api/admin/pools").await;
    let by_pool: HashMap<String, Value> = pools["pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["pool"].as_str().unwrap().to_owned(), p.clone()))
        .collect();
    let default = &by_pool["default"];
    assert_eq!(default["credentials"], 2);
    assert_eq!(default["total_slots"], 5);
    assert_eq!(default["in_flight"], 1);
    assert_eq!(default["cooling_down"], 1);
    assert_eq!(
        default["by_status"],
        json!({"available": 1, "rate_limited": 1})
    );
    assert_eq!(by_pool["vip"]["draining"], 1);
}

#[tokio::test]
async fn operator_routes_refuse_the_executor_key_with_403_and_no_key_with_401() {
    let app = TestApp::with_credential("key-a", 1).await;
    for (method, path) in [
        (Method::GET, "/api/admin/keys"),
        (Method::GET, "/api/admin/keys/key-a"),
        (Method::PATCH, "/api/admin/keys/key-a"),
        (Method::DELETE, "/api/admin/keys/key-a"),
        (Method::POST, "/api/admin/keys/key-a/release-all"),
        (Method::GET, "/api/admin/pools"),
    ] {
        let executor = app
            .client
            .request(method.clone(), app.url(path))
            .header("x-internal-key", INTERNAL_KEY)
            .json(&json!({"reason": "x", "state": "drain"}))
            .send()
            .await
            .unwrap();
        assert_error(executor, StatusCode::FORBIDDEN, "forbidden").await;
        let anonymous = app
            .client
            .request(method, app.url(path))
            .json(&json!({"reason": "x", "state": "drain"}))
            .send()
            .await
            .unwrap();
        assert_error(anonymous, StatusCode::UNAUTHORIZED, "unauthorized").await;
    }
    assert_eq!(app.in_flight("key-a").await, 0);
    let detail = app.credential("key-a").await;
    assert_eq!(detail["draining"], false);
}

#[tokio::test]
async fn secrets_are_sealed_at_rest_and_a_ciphertext_moved_to_another_credential_never_opens() {
    let app = TestApp::with_credential("key-a", 1).await;
    app.put_gpt4o_key("key-b", "other", 1).await;
    let rows: Vec<(Option<Value>, Vec<u8>)> =
        sqlx::query_as("SELECT secret, secret_ciphertext FROM credentials")
            .fetch_all(&app.db)
            .await
            .unwrap();
    for (plain, sealed) in &rows {
        assert!(plain.is_none());
        assert!(!sealed.windows(7).any(|w| w == b"sk-test"));
    }
    // move key-b's ciphertext into key-a's row
    app.run_sql("UPDATE credentials SET secret_ciphertext = (SELECT secret_ciphertext FROM credentials WHERE key_id = 'key-b') WHERE key_id = 'key-a'").await;
    let response = app.allocate(gpt4o_for(600)).await;
    let text = response.text().await.unwrap();
    assert!(!text.contains("sk-test-key-b"), "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["code"], "internal_error");
    // the slot it took is given back at once
    assert_eq!(app.in_flight("key-a").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lowering_the_limit_under_load_never_grants_beyond_the_new_limit() {
    let _turn = race_turn().await;
    let app = Arc::new(TestApp::spawn_with(AppOptions::connections(40)).await);
    app.put_gpt4o_key("hot", "default", 5).await;
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(app.lease(gpt4o_for(600)).await);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..32)
        .map(|_| {
            let (app, stop) = (app.clone(), stop.clone());
            tokio::spawn(async move {
                let mut granted = 0;
                while !stop.load(Ordering::Relaxed) {
                    let response = app.allocate(gpt4o_for(600)).await;
                    match response.status() {
                        StatusCode::OK => {
                            granted += 1;
                            let l: Value = response.json().await.unwrap();
                            tokio::time::sleep(Duration::from_millis(15)).await;
                            app.release(release_body(&l, "success")).await;
                        }
                        StatusCode::TOO_MANY_REQUESTS => {
                            tokio::time::sleep(Duration::from_millis(3)).await
                        }
                        other => panic!("unexpected {other}"),
                    }
                }
                granted
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    app.patch_key("hot", json!({"max_concurrent_uses": 2}))
        .ok_json()
        .await;
    let after_patch: time::OffsetDateTime = app.scalar("SELECT now()").await;
    // the five old leases end one by one; new grants may only start once in-flight is under 2
    for l in &held {
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(
            app.release(release_body(l, "success")).ok_json().await["released"],
            true
        );
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.await.unwrap();
    }

    // Rebuild every lease's lifetime from the trail: each grant after the change must have found
    // fewer than 2 other leases in flight.
    let events: Vec<(uuid::Uuid, String, time::OffsetDateTime, time::OffsetDateTime)> =
        sqlx::query_as("SELECT lease_id, event, at, lease_until FROM lease_events WHERE key_id = 'hot' ORDER BY event_id")
            .fetch_all(&app.db)
            .await
            .unwrap();
    let mut spans: HashMap<
        uuid::Uuid,
        (
            Option<time::OffsetDateTime>,
            Option<time::OffsetDateTime>,
            time::OffsetDateTime,
        ),
    > = HashMap::new();
    for (lease, event, at, until) in events {
        let span = spans.entry(lease).or_insert((None, None, until));
        match event.as_str() {
            "granted" => span.0 = Some(at),
            "released" | "force_released" => span.1 = Some(at),
            _ => {}
        }
        span.2 = span.2.max(until);
    }
    let spans: Vec<(time::OffsetDateTime, time::OffsetDateTime)> = spans
        .values()
        .map(|(start, end, until)| (start.unwrap(), end.unwrap_or(*until)))
        .collect();
    let late_grants: Vec<_> = spans
        .iter()
        .filter(|(start, _)| *start > after_patch)
        .collect();
    assert!(
        !late_grants.is_empty(),
        "no lease was granted after in-flight fell under the new limit"
    );
    for (start, _) in &late_grants {
        let others = spans.iter().filter(|(s, e)| s < start && e > start).count();
        assert!(
            others < 2,
            "a lease granted at {start} joined {others} others under a limit of 2"
        );
    }
}

#[tokio::test]
async fn capacity_under_a_lowered_limit_returns_whichever_replica_sees_the_releases() {
    // Replica A still believes the credential is over its limit with every lease in flight;
    // the leases end through replica B. A's next allocation must be served at once, not after A
    // happens to refresh its view.
    let app = TestApp::with_credential("hot", 3).await;
    let held = vec![
        app.lease(gpt4o_for(600)).await,
        app.lease(gpt4o_for(600)).await,
        app.lease(gpt4o_for(600)).await,
    ];
    app.patch_key("hot", json!({"max_concurrent_uses": 1}))
        .ok_json()
        .await;
    // A's view now shows three leases in flight over a limit of one
    app.allocate(gpt4o_for(600))
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;

    let (replica_b, _stop) = serve(app.database.pool(4).await, &AppOptions::default()).await;
    for l in &held {
        let released = Remote::at(replica_b)
            .release(release_body(l, "success"))
            .ok_json()
            .await;
        assert_eq!(released["released"], true);
    }

    let granted = app.lease(gpt4o_for(600)).await;
    assert_eq!(granted["key_id"], "hot");
    assert_eq!(app.in_flight("hot").await, 1);
    // and the new limit holds
    app.allocate(gpt4o_for(600))
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
}
