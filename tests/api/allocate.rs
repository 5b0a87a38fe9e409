//! Allocation over HTTP: every status code of the executor API, the pool sequence, the model
//! filter, expiry without cleanup, and "every 4xx leaves the database unchanged".

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use credpool_test_support::*;

#[tokio::test]
async fn allocate_returns_a_lease_with_the_credential_and_database_clock_expiry() {
    let app = TestApp::spawn().await;
    app.put_key("key-a", "openai", "default", &["gpt-4o", "gpt-4o-mini"], 2)
        .await;

    let response = app
        .allocate(json!({"provider": "openai", "model": "gpt-4o-mini", "lease_seconds": 40, "holder": "worker-7"}))
        .await;
    let lease = json_body(response, StatusCode::OK).await;

    assert_eq!(lease["key_id"], "key-a");
    assert_eq!(lease["provider"], "openai");
    assert_eq!(lease["pool"], "default");
    assert_eq!(lease["provider_model"], "gpt-4o-mini");
    assert_eq!(lease["credential"], json!({"api_key": "sk-test-key-a"}));
    let lease_id = lease["lease_id"].as_str().unwrap();
    assert_eq!(lease_id.len(), 32);
    assert!(
        lease_id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    );

    // lease_until is now() + 40 s on the database clock
    let seconds_left: f64 = app
        .scalar_of(
            "SELECT extract(epoch FROM $1::text::timestamptz - now())::float8",
            lease["lease_until"].as_str().unwrap(),
        )
        .await;
    assert!((38.0..=40.0).contains(&seconds_left), "{seconds_left}");
    assert_eq!(lease["lease_seconds"], 40);

    let holder: String = app
        .scalar_of(
            "SELECT holder FROM lease_slots WHERE lease_id = $1::text::uuid",
            lease_id,
        )
        .await;
    assert_eq!(holder, "worker-7");
    assert_eq!(app.events(lease_id).await, ["granted"]);
}

#[tokio::test]
async fn allocate_defaults_to_the_default_pool_and_a_35_second_lease() {
    let app = TestApp::with_credential("key-a", 1).await;
    let lease = app.lease(gpt4o()).await;
    assert_eq!(lease["pool"], "default");
    let seconds: f64 = app.scalar("SELECT extract(epoch FROM lease_until - granted_at)::float8 FROM lease_slots WHERE key_id = 'key-a' AND lease_id IS NOT NULL").await;
    assert!((34.9..=35.1).contains(&seconds), "{seconds}");
    assert_eq!(lease["lease_seconds"], 35);
}

/// A client that leaves out `lease_seconds` learns the length it was granted from the answer:
/// with a service maximum below the default, assuming 35 s would schedule its renewals after the
/// lease ended.
#[tokio::test]
async fn the_answer_says_the_length_granted_also_when_the_maximum_is_below_the_default() {
    let mut options = AppOptions::default();
    options.settings.max_lease_seconds = 9;
    let app = TestApp::spawn_with(options).await;
    app.put_gpt4o_key("key-a", "default", 1).await;
    let lease = app.lease(gpt4o()).await;
    assert_eq!(lease["lease_seconds"], 9);
    let seconds: f64 = app.scalar("SELECT extract(epoch FROM lease_until - granted_at)::float8 FROM lease_slots WHERE key_id = 'key-a' AND lease_id IS NOT NULL").await;
    assert!((8.9..=9.1).contains(&seconds), "{seconds}");
}

#[tokio::test]
async fn unknown_provider_or_pool_is_pool_not_found() {
    let app = TestApp::with_credential("key-a", 1).await;
    app.allocate(json!({"provider": "anthropic", "model": "gpt-4o"}))
        .refused(StatusCode::NOT_FOUND, "pool_not_found")
        .await;
    app.allocate(gpt4o_in("batch"))
        .refused(StatusCode::NOT_FOUND, "pool_not_found")
        .await;
}

#[tokio::test]
async fn refusals_name_what_was_asked_and_read_as_the_apis_own_sentences() {
    let mut options = AppOptions::default();
    options.settings.max_lease_seconds = 600;
    let app = TestApp::spawn_with(options).await;
    app.put_gpt4o_key("key-a", "default", 1).await;
    let message = |body: Value| body["error"]["message"].as_str().unwrap().to_owned();

    // a 404 names the provider and the pool asked for
    let missing = app
        .allocate(gpt4o_in("batch"))
        .refused(StatusCode::NOT_FOUND, "pool_not_found")
        .await;
    assert_eq!(
        message(missing),
        "no credentials for provider openai in pool batch"
    );

    // a range error says which setting raises the limit
    let too_long = app
        .allocate(gpt4o_for(601))
        .refused(StatusCode::BAD_REQUEST, "invalid_request")
        .await;
    let too_long = message(too_long);
    assert!(
        too_long.contains("from 1 to 600") && too_long.contains("--max-lease-seconds"),
        "{too_long}"
    );

    // a body serde refuses: its words, not the framework's lead-in
    let unknown = app
        .allocate(json!({"provider": "openai", "model": "gpt-4o", "surprise": true}))
        .refused(StatusCode::BAD_REQUEST, "invalid_request")
        .await;
    let unknown = message(unknown);
    assert!(
        unknown.starts_with("invalid request body: ")
            && unknown.contains("unknown field `surprise`"),
        "{unknown}"
    );
    let not_json = app
        .client
        .post(app.url("/api/internal/allocate-key"))
        .header("x-internal-key", INTERNAL_KEY)
        .header("content-type", "application/json")
        .body("not json")
        .send()
        .await
        .unwrap();
    let not_json =
        message(assert_error(not_json, StatusCode::BAD_REQUEST, "invalid_request").await);
    assert!(
        not_json.starts_with("the body is not valid JSON: "),
        "{not_json}"
    );
    for text in [&unknown, &not_json] {
        assert!(!text.contains("Failed to"), "{text}");
    }
}

#[tokio::test]
async fn pool_without_the_model_is_model_not_supported() {
    let app = TestApp::spawn().await;
    app.put_key("key-a", "openai", "default", &["gpt-4o-mini"], 1)
        .await;
    let body = app
        .allocate(gpt4o_in("default"))
        .refused(StatusCode::CONFLICT, "model_not_supported")
        .await;
    // the refusal names what was asked for
    let message = body["error"]["message"].as_str().unwrap();
    for named in ["openai", "default", "gpt-4o"] {
        assert!(message.contains(named), "{message} does not name {named}");
    }
}

#[tokio::test]
async fn only_disabled_exhausted_or_pending_credentials_is_no_usable_credentials() {
    let app = TestApp::spawn().await;
    for (key, status) in [
        ("key-d", "disabled"),
        ("key-e", "exhausted"),
        ("key-p", "pending"),
    ] {
        app.put_gpt4o_key(key, "default", 1).await;
        app.set_status(key, status, None).await;
    }
    // a credential that does not serve the model does not change the answer
    app.put_key("key-other", "openai", "default", &["o3"], 1)
        .await;
    app.allocate(gpt4o_in("default"))
        .refused(StatusCode::CONFLICT, "no_usable_credentials")
        .await;
}

#[tokio::test]
async fn busy_pool_is_pool_exhausted_with_retry_after_until_the_earliest_lease_ends() {
    let app = TestApp::with_credential("key-a", 1).await;
    app.put_gpt4o_key("key-b", "default", 1).await;
    let body = gpt4o_for(30);
    app.lease(body.clone()).await;
    let body_long = gpt4o_for(120);
    app.lease(body_long.clone()).await;

    let response = app.allocate(body).await;
    let retry_after: u64 = retry_after(&response);
    assert!(
        (29..=30).contains(&retry_after),
        "Retry-After {retry_after}"
    );
    assert_error(response, StatusCode::TOO_MANY_REQUESTS, "pool_exhausted").await;
}

/// A process's view of a pool misses what it was not told (another replica's releases, leases
/// that ran out): a pool it believes full is read again before a 429, so a slot freed elsewhere
/// is leased, not hidden until the view's periodic refresh. 40 credentials of limit 1, all leased
/// through one replica; each round another replica frees one, and the first replica must lease
/// exactly that one. (A 429 answered from the stale view after claiming its 8 best-ranked
/// candidates would pass a round one time in five.)
#[tokio::test]
async fn a_slot_freed_by_another_replica_is_leased_not_hidden_by_a_stale_view() {
    let mut options = AppOptions::default();
    // no periodic refresh during the test: only the rule under test may read the pool again
    options.settings.view_refresh = Duration::from_secs(600);
    let app = TestApp::spawn_with(options).await;
    for i in 0..40 {
        app.put_gpt4o_key(&format!("key-{i:02}"), "default", 1)
            .await;
    }
    let body = gpt4o_for(300);
    let mut leases = Vec::new();
    for _ in 0..40 {
        leases.push(app.lease(body.clone()).await);
    }
    app.allocate(body.clone())
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    let (other, _stop) = app.replica(4).await;
    for lease in leases.iter().take(3) {
        let released = Remote::at(other)
            .release(release_body(lease, "success"))
            .ok_json()
            .await;
        assert_eq!(released["released"], true, "{released}");
        // past the age a view may answer a 429 from
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let granted = app.lease(body.clone()).await;
        assert_eq!(granted["key_id"], lease["key_id"], "{granted}");
    }
}

#[tokio::test]
async fn cooling_credentials_are_pool_exhausted_until_the_cooldown_ends_then_usable_again() {
    let app = TestApp::with_credential("key-a", 1).await;
    app.set_status("key-a", "rate_limited", Some(1.5)).await;

    let response = app.allocate(gpt4o_in("default")).await;
    assert_eq!(response.headers()["retry-after"], "2");
    assert_error(response, StatusCode::TOO_MANY_REQUESTS, "pool_exhausted").await;

    // opportunistic recovery: once cooldown_until passes the credential is usable, no job needed
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    app.lease(gpt4o_in("default")).await;
}

#[tokio::test]
async fn rate_limited_cooldown_or_exhausted_with_unknown_cooldown_end_is_not_usable() {
    // one credential per status, each alone in its pool
    let app = TestApp::spawn().await;
    for status in ["rate_limited", "cooldown", "exhausted"] {
        app.put_gpt4o_key(status, status, 1).await;
        app.set_status(status, status, None).await;
    }
    for status in ["rate_limited", "cooldown", "exhausted"] {
        let response = app.allocate(gpt4o_in(status)).await;
        let answer = (response.status(), response.text().await.unwrap());
        assert!(
            answer.0 == StatusCode::CONFLICT && answer.1.contains("\"no_usable_credentials\""),
            "{status} with no cooldown end: {answer:?}"
        );
    }
}

#[tokio::test]
async fn vip_falls_back_to_default_and_says_which_pool_served() {
    let app = TestApp::spawn().await;
    app.put_gpt4o_key("vip-1", "vip", 1).await;
    app.put_gpt4o_key("def-1", "default", 1).await;

    let first = app.lease(gpt4o_in("vip")).await;
    assert_eq!(
        (first["key_id"].as_str(), first["pool"].as_str()),
        (Some("vip-1"), Some("vip"))
    );
    let second = app.lease(gpt4o_in("vip")).await;
    assert_eq!(
        (second["key_id"].as_str(), second["pool"].as_str()),
        (Some("def-1"), Some("default"))
    );
    app.allocate(gpt4o_in("vip"))
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;

    // the lease served from default is released as a default-pool lease
    let released = app
        .release(release_body(&second, "success"))
        .ok_json()
        .await;
    assert_eq!(released, json!({"released": true}));
}

#[tokio::test]
async fn vip_request_is_served_by_default_when_vip_has_no_credentials() {
    let app = TestApp::with_credential("def-1", 1).await;
    let lease = app.lease(gpt4o_in("vip")).await;
    assert_eq!(lease["pool"], "default");
}

#[tokio::test]
async fn default_never_takes_a_vip_credential() {
    let app = TestApp::spawn().await;
    app.put_gpt4o_key("vip-1", "vip", 5).await;
    app.allocate(gpt4o_in("default"))
        .refused(StatusCode::NOT_FOUND, "pool_not_found")
        .await;

    app.put_gpt4o_key("def-1", "default", 1).await;
    app.lease(gpt4o_in("default")).await;
    // default is full; vip has four free slots, and default must still not take them
    app.allocate(gpt4o_in("default"))
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    assert_eq!(app.in_flight("vip-1").await, 0);
}

#[tokio::test]
async fn expired_lease_frees_its_slot_without_any_cleanup_job() {
    let app = TestApp::with_credential("key-a", 1).await;
    let body = gpt4o_for(1);
    let first = app.lease(body.clone()).await;
    app.allocate(body.clone())
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;

    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let second = app.lease(body).await;
    assert_ne!(first["lease_id"], second["lease_id"]);
    // the expired lease was ended in the trail by the claim that reused its slot
    assert_eq!(app.lease_events(&first).await, ["granted", "expired"]);
    assert_eq!(app.in_flight("key-a").await, 1);
}

#[tokio::test]
async fn least_recently_used_credential_is_leased_first() {
    let app = TestApp::spawn_with(AppOptions::deterministic()).await;
    for key in ["key-a", "key-b", "key-c"] {
        app.put_gpt4o_key(key, "default", 5).await;
    }
    // never-used credentials come first (ties broken by key id with zero jitter)
    let mut order = Vec::new();
    for _ in 0..6 {
        let lease = app.lease(gpt4o_in("default")).await;
        order.push(lease["key_id"].as_str().unwrap().to_owned());
        app.release(release_body(&lease, "success")).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        order,
        ["key-a", "key-b", "key-c", "key-a", "key-b", "key-c"]
    );
}

#[tokio::test]
async fn missing_or_wrong_internal_key_is_unauthorized() {
    let app = TestApp::with_credential("key-a", 1).await;
    let url = app.url("/api/internal/allocate-key");
    let no_key = app
        .client
        .post(&url)
        .json(&gpt4o_in("default"))
        .send()
        .await
        .unwrap();
    assert_error(no_key, StatusCode::UNAUTHORIZED, "unauthorized").await;
    let wrong = post_json(
        &app.client,
        &url,
        ("x-internal-key", "nope"),
        gpt4o_in("default"),
    )
    .await;
    assert_error(wrong, StatusCode::UNAUTHORIZED, "unauthorized").await;
    let admin_key = post_json(
        &app.client,
        &url,
        ("x-internal-key", ADMIN_KEY),
        gpt4o_in("default"),
    )
    .await;
    assert_error(admin_key, StatusCode::UNAUTHORIZED, "unauthorized").await;
    assert_eq!(app.in_flight("key-a").await, 0);
}

#[tokio::test]
async fn malformed_allocate_requests_are_invalid_request() {
    let mut options = AppOptions::default();
    options.settings.max_lease_seconds = 600;
    let app = TestApp::spawn_with(options).await;
    app.put_gpt4o_key("key-a", "default", 1).await;
    let bad = [
        json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 0}),
        json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": -1}),
        json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 1.5}),
        json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": "60"}),
        json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 601}),
        json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 9_223_372_036_854_775_807_u64}),
        json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 1e308}),
        json!({"provider": "openai", "model": "gpt-4o", "surprise": true}),
        json!({"provider": "openai"}),
        json!({"provider": "Open AI", "model": "gpt-4o"}),
        json!({"provider": "openai", "model": "gpt-4o", "pool": "x'; DROP TABLE credentials; --"}),
        json!({"provider": "openai", "model": "gpt 4o"}),
        json!({"provider": "openai", "model": "gpt-4o", "holder": "bad\u{0007}holder"}),
        json!({"provider": "openai", "model": "x".repeat(201)}),
        json!(["not", "an", "object"]),
    ];
    let before = app.snapshot().await;
    for body in bad {
        let response = app.allocate(body.clone()).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");
        let answer = assert_error(response, StatusCode::BAD_REQUEST, "invalid_request").await;
        // a lease length out of range, negative or not, gets the API's own sentence, not the
        // JSON decoder's
        if [json!(0), json!(-1), json!(601)].contains(&body["lease_seconds"]) {
            let message = answer["error"]["message"].as_str().unwrap();
            assert!(
                message.contains("must be an integer from 1 to 600"),
                "{body}: {message}"
            );
        }
    }
    // a body that is not JSON at all, and one that is cut short
    for raw in ["not json", r#"{"provider": "openai", "model": "#] {
        let response = app
            .client
            .post(app.url("/api/internal/allocate-key"))
            .header("x-internal-key", INTERNAL_KEY)
            .header("content-type", "application/json")
            .body(raw)
            .send()
            .await
            .unwrap();
        assert_error(response, StatusCode::BAD_REQUEST, "invalid_request").await;
    }
    let wrong_type = app
        .client
        .post(app.url("/api/internal/allocate-key"))
        .header("x-internal-key", INTERNAL_KEY)
        .header("content-type", "text/plain")
        .body(gpt4o_in("default").to_string())
        .send()
        .await
        .unwrap();
    assert_error(
        wrong_type,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
    )
    .await;
    let huge = app
        .client
        .post(app.url("/api/internal/allocate-key"))
        .header("x-internal-key", INTERNAL_KEY)
        .json(&json!({"provider": "openai", "model": "x".repeat(1 << 20)}))
        .send()
        .await
        .unwrap();
    assert_error(huge, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large").await;
    assert_eq!(app.snapshot().await, before);
}

#[tokio::test]
async fn every_4xx_leaves_the_database_unchanged() {
    let app = TestApp::with_credential("busy", 1).await;
    app.put_gpt4o_key("off", "batch", 1).await;
    app.set_status("off", "disabled", None).await;
    let lease = app.lease(gpt4o_in("default")).await;
    let before = app.snapshot().await;

    // 429, 409 x2, 404, 400, 401, 410: none may touch a lease, a counter or a cooldown
    app.allocate(gpt4o_in("default"))
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    app.allocate(gpt4o_in("batch"))
        .refused(StatusCode::CONFLICT, "no_usable_credentials")
        .await;
    app.allocate(json!({"provider": "openai", "model": "o3", "pool": "default"}))
        .refused(StatusCode::CONFLICT, "model_not_supported")
        .await;
    app.allocate(gpt4o_in("nowhere"))
        .refused(StatusCode::NOT_FOUND, "pool_not_found")
        .await;
    app.allocate(gpt4o_for(0))
        .refused(StatusCode::BAD_REQUEST, "invalid_request")
        .await;
    let mut wrong = release_body(&lease, "failure");
    wrong["key_id"] = json!("off");
    app.renew(json!({"provider": "openai", "pool": "default", "key_id": "off", "lease_id": lease["lease_id"]})).refused(StatusCode::GONE, "lease_lost").await;
    let unauthorized = post_json(
        &app.client,
        &app.url("/api/internal/release-key"),
        ("x-internal-key", "x"),
        wrong.clone(),
    )
    .await;
    assert_error(unauthorized, StatusCode::UNAUTHORIZED, "unauthorized").await;
    // a mismatched release is a 200 that releases nothing: also no change
    let refused = app.release(wrong).ok_json().await;
    assert_eq!(refused, json!({"released": false, "reason": "mismatch"}));

    assert_eq!(app.snapshot().await, before);
}

#[tokio::test]
async fn unknown_routes_and_methods_answer_in_the_error_shape() {
    let app = TestApp::spawn().await;
    let response = app.get("/api/internal/nope").await;
    assert_error(response, StatusCode::NOT_FOUND, "route_not_found").await;
    let response = app.get("/api/internal/allocate-key").await;
    assert_error(
        response,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    )
    .await;
}

#[tokio::test]
async fn unreachable_database_is_store_unavailable_not_pool_exhausted() {
    // A pool pointed at a port where nothing listens, with a short acquire timeout.
    let options: sqlx::postgres::PgConnectOptions =
        "postgres://postgres@127.0.0.1:1/none".parse().unwrap();
    let pool = lazy_pool(options, 2, Duration::from_millis(500));
    let (addr, _shutdown) = serve(pool, &AppOptions::default()).await;
    let client = client();
    let url = |path: &str| format!("http://{addr}{path}");
    let lease_ref =
        json!({"provider": "openai", "pool": "default", "key_id": "k", "lease_id": "0".repeat(32)});
    for (path, body) in [
        ("/api/internal/allocate-key", gpt4o_in("default")),
        ("/api/internal/release-key", lease_ref.clone()),
        ("/api/internal/renew-lease", lease_ref),
    ] {
        let response = post_json(&client, &url(path), ("x-internal-key", INTERNAL_KEY), body).await;
        assert!(response.headers().get("retry-after").is_none());
        let body = assert_error(
            response,
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
        )
        .await;
        // the client sees no driver or SQL text
        assert_eq!(
            body["error"]["message"], "the store is unavailable; retry",
            "{path}"
        );
    }
}
