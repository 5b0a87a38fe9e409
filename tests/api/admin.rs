//! `PUT /api/admin/keys/{key_id}`: create or update, the secret stays write-only, and changing
//! `max_concurrent_uses` under load never breaks the limit.

use reqwest::StatusCode;
use serde_json::{Value, json};

use credpool_test_support::*;

fn spec(limit: u32) -> Value {
    json!({
        "provider": "openai",
        "pool": "default",
        "models": ["gpt-4o"],
        "max_concurrent_uses": limit,
        "status": "available",
        "secret": {"api_key": "sk-admin-test-secret"},
    })
}

#[tokio::test]
async fn put_creates_then_updates_and_never_returns_the_secret() {
    let app = TestApp::spawn().await;
    let created = app.put_key_raw("key-a", spec(2)).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let text = created.text().await.unwrap();
    assert!(!text.contains("sk-admin-test-secret"), "{text}");
    let view: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(view["key_id"], "key-a");
    assert_eq!(view["max_concurrent_uses"], 2);
    assert_eq!(view["status"], "available");
    assert!(view.get("secret").is_none());

    let mut changed = spec(3);
    changed["models"] = json!(["gpt-4o", "o3"]);
    changed["secret"] = json!({"api_key": "sk-rotated"});
    let updated = app.put_key_raw("key-a", changed).await;
    assert_eq!(updated.status(), StatusCode::OK);
    let view = json_body(updated, StatusCode::OK).await;
    assert_eq!(view["models"], json!(["gpt-4o", "o3"]));
    let slots: i64 = sqlx::query_scalar("SELECT count(*) FROM lease_slots WHERE key_id = 'key-a'")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(slots, 3);
    // executors receive the new secret
    let lease = json_body(
        app.allocate(json!({"provider": "openai", "model": "o3"}))
            .await,
        StatusCode::OK,
    )
    .await;
    assert_eq!(lease["credential"], json!({"api_key": "sk-rotated"}));
}

#[tokio::test]
async fn put_without_status_keeps_the_stored_status() {
    let app = TestApp::spawn().await;
    app.put_key("key-a", "openai", "default", &["gpt-4o"], 1)
        .await;
    app.set_status("key-a", "disabled", None).await;
    let mut body = spec(1);
    body.as_object_mut().unwrap().remove("status");
    let view = json_body(app.put_key_raw("key-a", body).await, StatusCode::OK).await;
    assert_eq!(view["status"], "disabled");
}

#[tokio::test]
async fn admin_routes_refuse_the_executor_key_with_403_and_no_key_with_401() {
    let app = TestApp::spawn().await;
    let url = app.url("/api/admin/keys/key-a");
    let none = app.client.put(&url).json(&spec(1)).send().await.unwrap();
    assert_error(none, StatusCode::UNAUTHORIZED, "unauthorized").await;
    let wrong = app
        .client
        .put(&url)
        .header("x-admin-key", "nope")
        .json(&spec(1))
        .send()
        .await
        .unwrap();
    assert_error(wrong, StatusCode::UNAUTHORIZED, "unauthorized").await;
    let executor = app
        .client
        .put(&url)
        .header("x-internal-key", INTERNAL_KEY)
        .json(&spec(1))
        .send()
        .await
        .unwrap();
    assert_error(executor, StatusCode::FORBIDDEN, "forbidden").await;
    let executor_as_admin = app
        .client
        .put(&url)
        .header("x-admin-key", INTERNAL_KEY)
        .json(&spec(1))
        .send()
        .await
        .unwrap();
    assert_error(executor_as_admin, StatusCode::FORBIDDEN, "forbidden").await;
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM credentials")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(count, 0);
}

#[tokio::test]
async fn invalid_credentials_are_rejected_without_echoing_the_secret_and_change_nothing() {
    let app = TestApp::spawn().await;
    app.put_key("key-a", "openai", "default", &["gpt-4o"], 1)
        .await;
    let before = app.snapshot().await;
    let mut cases: Vec<(&str, Value)> = Vec::new();
    let with = |field: &str, value: Value| {
        let mut body = spec(1);
        body[field] = value;
        body
    };
    cases.push(("key-a", with("max_concurrent_uses", json!(0))));
    cases.push(("key-a", with("max_concurrent_uses", json!(10_001))));
    cases.push(("key-a", with("models", json!([]))));
    cases.push(("key-a", with("models", json!(["bad model"]))));
    cases.push(("key-a", with("status", json!("sleepy"))));
    cases.push(("key-a", with("status", json!("cooldown"))));
    cases.push(("key-a", with("provider", json!("OpenAI"))));
    cases.push(("key-a", with("secret", json!("sk-admin-test-secret"))));
    cases.push(("key-a", with("secret", json!(["sk-admin-test-secret"]))));
    cases.push(("key-a", with("extra", json!(1))));
    cases.push(("bad%20id", spec(1)));
    cases.push(("-leading", spec(1)));
    for (key_id, body) in cases {
        let response = app.put_key_raw(key_id, body.clone()).await;
        let text = format!(
            "{:?}",
            assert_error(response, StatusCode::BAD_REQUEST, "invalid_request").await
        );
        assert!(
            !text.contains("sk-admin-test-secret"),
            "{key_id} {body}: {text}"
        );
    }
    assert_eq!(app.snapshot().await, before);
}

#[tokio::test]
async fn lowering_the_limit_under_load_revokes_nothing_and_grants_nothing_until_under_the_new_limit()
 {
    let app = TestApp::spawn().await;
    app.put_key("key-a", "openai", "default", &["gpt-4o"], 3)
        .await;
    let allocate =
        || app.allocate(json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 600}));
    let mut leases = Vec::new();
    for _ in 0..3 {
        leases.push(json_body(allocate().await, StatusCode::OK).await);
    }
    app.put_key("key-a", "openai", "default", &["gpt-4o"], 1)
        .await;
    assert_eq!(
        app.in_flight("key-a").await,
        3,
        "lowering the limit revoked a lease"
    );

    // 3 in flight, limit 1: nothing until in-flight falls under 1
    for lease in &leases[..2] {
        assert_error(
            allocate().await,
            StatusCode::TOO_MANY_REQUESTS,
            "pool_exhausted",
        )
        .await;
        let released = json_body(
            app.release(release_body(lease, "success")).await,
            StatusCode::OK,
        )
        .await;
        assert_eq!(released["released"], true);
    }
    assert_error(
        allocate().await,
        StatusCode::TOO_MANY_REQUESTS,
        "pool_exhausted",
    )
    .await;
    json_body(
        app.release(release_body(&leases[2], "success")).await,
        StatusCode::OK,
    )
    .await;

    let next = json_body(allocate().await, StatusCode::OK).await;
    assert_error(
        allocate().await,
        StatusCode::TOO_MANY_REQUESTS,
        "pool_exhausted",
    )
    .await;
    let slots: i64 = sqlx::query_scalar("SELECT count(*) FROM lease_slots WHERE key_id = 'key-a'")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(slots, 1);
    json_body(
        app.release(release_body(&next, "success")).await,
        StatusCode::OK,
    )
    .await;
}

#[tokio::test]
async fn lowering_the_limit_keeps_in_flight_leases_renewable_and_releasable() {
    let app = TestApp::spawn().await;
    app.put_key("key-a", "openai", "default", &["gpt-4o"], 4)
        .await;
    let mut leases = Vec::new();
    for _ in 0..4 {
        let body = json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 600});
        leases.push(json_body(app.allocate(body).await, StatusCode::OK).await);
    }
    // release the two lowest slots, then lower to 2: leases in slots 2 and 3 move into 0 and 1
    for lease in &leases[..2] {
        json_body(
            app.release(release_body(lease, "success")).await,
            StatusCode::OK,
        )
        .await;
    }
    app.put_key("key-a", "openai", "default", &["gpt-4o"], 2)
        .await;
    let max_slot: i32 =
        sqlx::query_scalar("SELECT max(slot) FROM lease_slots WHERE key_id = 'key-a'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(max_slot, 1);
    for lease in &leases[2..] {
        let mut renew = release_body(lease, "success");
        renew.as_object_mut().unwrap().remove("outcome");
        json_body(app.renew(renew).await, StatusCode::OK).await;
        let released = json_body(
            app.release(release_body(lease, "success")).await,
            StatusCode::OK,
        )
        .await;
        assert_eq!(released["released"], true);
    }
}

#[tokio::test]
async fn raising_the_limit_takes_effect_for_the_next_allocation() {
    let app = TestApp::spawn().await;
    app.put_key("key-a", "openai", "default", &["gpt-4o"], 1)
        .await;
    let body = json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 600});
    json_body(app.allocate(body.clone()).await, StatusCode::OK).await;
    assert_error(
        app.allocate(body.clone()).await,
        StatusCode::TOO_MANY_REQUESTS,
        "pool_exhausted",
    )
    .await;
    app.put_key("key-a", "openai", "default", &["gpt-4o"], 3)
        .await;
    json_body(app.allocate(body.clone()).await, StatusCode::OK).await;
    json_body(app.allocate(body.clone()).await, StatusCode::OK).await;
    assert_error(
        app.allocate(body).await,
        StatusCode::TOO_MANY_REQUESTS,
        "pool_exhausted",
    )
    .await;
    assert_eq!(app.in_flight("key-a").await, 3);
}
