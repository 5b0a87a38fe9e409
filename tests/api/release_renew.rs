//! Release verification and renewal (docs/design.md "The protocol", steps 3 and 4).

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use credpool_test_support::*;

#[tokio::test]
async fn release_frees_the_slot_at_once_and_records_the_outcome() {
    let app = TestApp::with_credential("key-a", 1).await;
    let lease = app.lease(gpt4o_for(600)).await;
    let released = app.release(release_body(&lease, "failure")).ok_json().await;
    assert_eq!(released, json!({"released": true}));
    assert_eq!(app.in_flight("key-a").await, 0);

    let outcome: Option<String> = app.scalar_of("SELECT outcome FROM lease_events WHERE lease_id = $1::text::uuid AND event = 'released'", lease["lease_id"].as_str()).await;
    assert_eq!(outcome.as_deref(), Some("failure"));
    // the slot is free for the next executor immediately
    app.lease(gpt4o_for(600)).await;
}

#[tokio::test]
async fn release_without_outcome_is_accepted() {
    let app = TestApp::with_credential("key-a", 1).await;
    let lease = app.lease(gpt4o_for(600)).await;
    let body = lease_ref(&lease);
    assert_eq!(app.release(body).ok_json().await, json!({"released": true}));
}

#[tokio::test]
async fn release_with_wrong_key_id_provider_or_pool_keeps_the_lease() {
    let app = TestApp::with_credential("key-a", 1).await;
    app.put_key("key-b", "openai", "default", &["o3"], 1).await;
    let lease = app.lease(gpt4o_for(600)).await;
    for (field, value) in [
        ("key_id", "key-b"),
        ("provider", "anthropic"),
        ("pool", "vip"),
    ] {
        let mut body = release_body(&lease, "success");
        body[field] = json!(value);
        let refused = app.release(body).ok_json().await;
        assert_eq!(
            refused,
            json!({"released": false, "reason": "mismatch"}),
            "wrong {field}"
        );
        assert_eq!(
            app.in_flight("key-a").await,
            1,
            "wrong {field} released the lease"
        );
    }
    // still held: nobody else can lease the credential
    let body = gpt4o();
    app.allocate(body)
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    // and the real holder can still release it
    let released = app.release(release_body(&lease, "success")).ok_json().await;
    assert_eq!(released, json!({"released": true}));
}

#[tokio::test]
async fn releasing_twice_reports_not_released_the_second_time() {
    let app = TestApp::with_credential("key-a", 1).await;
    let lease = app.lease(gpt4o_for(600)).await;
    let first = app.release(release_body(&lease, "success")).ok_json().await;
    let second = app.release(release_body(&lease, "success")).ok_json().await;
    assert_eq!(first, json!({"released": true}));
    assert_eq!(second, json!({"released": false, "reason": "not_found"}));
    assert_eq!(app.lease_events(&lease).await, ["granted", "released"]);
}

#[tokio::test]
async fn releasing_an_unknown_lease_is_not_found() {
    let app = TestApp::with_credential("key-a", 1).await;
    let body = json!({"provider": "openai", "pool": "default", "key_id": "key-a", "lease_id": "ab".repeat(16)});
    let refused = app.release(body).ok_json().await;
    assert_eq!(refused, json!({"released": false, "reason": "not_found"}));
}

#[tokio::test]
async fn releasing_an_expired_lease_releases_nothing_and_leaves_others_intact() {
    let app = TestApp::with_credential("key-a", 2).await;
    let short = app.lease(gpt4o_for(1)).await;
    let long = app.lease(gpt4o_for(600)).await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    let refused = app.release(release_body(&short, "success")).ok_json().await;
    assert_eq!(refused, json!({"released": false, "reason": "expired"}));
    // nothing released; the late outcome is recorded (it counts for health) and the expired
    // lease is ended in the trail
    let mut events = app.lease_events(&short).await;
    events.sort();
    assert_eq!(events, ["expired", "granted", "outcome_after_expiry"]);
    assert_eq!(app.in_flight("key-a").await, 1);
    let still: i64 = app
        .scalar_of(
            "SELECT count(*) FROM lease_slots WHERE lease_id = $1::text::uuid",
            long["lease_id"].as_str(),
        )
        .await;
    assert_eq!(still, 1);
}

#[tokio::test]
async fn release_with_a_malformed_lease_id_is_invalid_request() {
    let app = TestApp::with_credential("key-a", 1).await;
    for lease_id in ["abc", "zz".repeat(16).as_str(), "ab".repeat(17).as_str()] {
        let body = json!({"provider": "openai", "pool": "default", "key_id": "key-a", "lease_id": lease_id});
        app.release(body)
            .refused(StatusCode::BAD_REQUEST, "invalid_request")
            .await;
    }
    let body = json!({"provider": "openai", "pool": "default", "key_id": "key-a", "lease_id": "ab".repeat(16), "outcome": "great"});
    app.release(body)
        .refused(StatusCode::BAD_REQUEST, "invalid_request")
        .await;
}

#[tokio::test]
async fn renew_extends_the_lease_on_the_database_clock() {
    let app = TestApp::with_credential("key-a", 1).await;
    let lease = app.lease(gpt4o_for(2)).await;
    let body = renew_body(&lease, 120);
    let renewed = app.renew(body).ok_json().await;
    let seconds_left: f64 = app
        .scalar_of(
            "SELECT extract(epoch FROM $1::text::timestamptz - now())::float8",
            renewed["lease_until"].as_str().unwrap(),
        )
        .await;
    assert!((118.0..=120.0).contains(&seconds_left), "{seconds_left}");

    // past the original 2 s the lease still holds its slot
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    assert_eq!(app.in_flight("key-a").await, 1);
    app.allocate(gpt4o())
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    assert_eq!(app.lease_events(&lease).await, ["granted", "renewed"]);
}

#[tokio::test]
async fn renewing_an_expired_lease_fails_and_never_resurrects_it() {
    let app = TestApp::with_credential("key-a", 1).await;
    let lease = app.lease(gpt4o_for(1)).await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    // the slot is still physically holding the expired lease (nothing reused it yet)
    let body = renew_body(&lease, 600);
    app.renew(body.clone())
        .refused(StatusCode::GONE, "lease_lost")
        .await;
    assert_eq!(app.in_flight("key-a").await, 0);
    assert_eq!(app.lease_events(&lease).await, ["granted"]);

    // the slot is free for someone else, and renewing after that fails too
    let next = app.lease(gpt4o_for(600)).await;
    app.renew(body)
        .refused(StatusCode::GONE, "lease_lost")
        .await;
    let holder_lease: String = app
        .scalar("SELECT replace(lease_id::text, '-', '') FROM lease_slots WHERE key_id = 'key-a'")
        .await;
    assert_eq!(holder_lease, next["lease_id"].as_str().unwrap());
}

#[tokio::test]
async fn renewing_a_released_or_mismatched_lease_is_lease_lost() {
    let app = TestApp::with_credential("key-a", 1).await;
    let lease = app.lease(gpt4o_for(600)).await;
    let body = lease_ref(&lease);

    let mut mismatched = body.clone();
    mismatched["pool"] = json!("vip");
    app.renew(mismatched)
        .refused(StatusCode::GONE, "lease_lost")
        .await;

    app.release(release_body(&lease, "success")).ok_json().await;
    app.renew(body)
        .refused(StatusCode::GONE, "lease_lost")
        .await;
    assert_eq!(app.in_flight("key-a").await, 0);
}

#[tokio::test]
async fn parallel_releases_of_one_lease_release_it_exactly_once() {
    let app = TestApp::with_credential("key-a", 1).await;
    for _ in 0..10 {
        let lease = app.lease(gpt4o_for(600)).await;
        let results = futures::future::join_all(
            (0..16).map(|_| app.release(release_body(&lease, "success"))),
        )
        .await;
        let mut released = 0;
        for response in results {
            let body = json_body(response, StatusCode::OK).await;
            if body["released"] == json!(true) {
                released += 1;
            } else {
                assert_eq!(body["reason"], "not_found", "{body}");
            }
        }
        assert_eq!(released, 1);
        assert_eq!(app.in_flight("key-a").await, 0);
    }
}

/// Releases forced into one group (each group waits 300 ms for more): a live lease, one named with
/// the wrong pool, an expired one reported with an outcome, and an unknown one. Each gets the
/// answer it would get alone, and only the live one frees its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_group_answers_each_release_as_if_it_were_alone() {
    let mut options = AppOptions::default();
    options.settings.groups = credpool::allocator::GroupSettings {
        max_size: 64,
        max_wait: Duration::from_millis(300),
        transactions: 1,
    };
    let app = std::sync::Arc::new(TestApp::spawn_with(options).await);
    let mut leases = Vec::new();
    for (pool, lease_seconds) in [("live", 600), ("mismatch", 600), ("expired", 1)] {
        app.put_gpt4o_key(&format!("g-{pool}"), pool, 1).await;
        let body = json!({"provider": "openai", "model": "gpt-4o", "pool": pool,
                          "lease_seconds": lease_seconds});
        leases.push(app.lease(body).await);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut mismatch = release_body(&leases[1], "success");
    mismatch["pool"] = json!("live");
    let mut unknown = release_body(&leases[0], "success");
    unknown["lease_id"] = json!("0123456789abcdef0123456789abcdef");
    let bodies = [
        release_body(&leases[0], "success"),
        mismatch,
        release_body(&leases[2], "failure"),
        unknown,
    ];
    let answers = futures::future::join_all(bodies.into_iter().map(|body| {
        let app = app.clone();
        async move { app.release(body).ok_json().await }
    }))
    .await;
    assert_eq!(answers[0], json!({"released": true}));
    assert_eq!(answers[1], json!({"released": false, "reason": "mismatch"}));
    assert_eq!(answers[2], json!({"released": false, "reason": "expired"}));
    assert_eq!(
        answers[3],
        json!({"released": false, "reason": "not_found"})
    );
    assert_eq!(app.in_flight("g-live").await, 0);
    assert_eq!(app.in_flight("g-mismatch").await, 1);
    // the expired lease's outcome still counted, once
    let expired_events = app.events(leases[2]["lease_id"].as_str().unwrap()).await;
    assert!(
        expired_events.contains(&"outcome_after_expiry".to_owned()),
        "{expired_events:?}"
    );
}

#[tokio::test]
async fn a_lease_named_twice_in_one_renewal_call_is_renewed_by_the_entry_that_names_it_rightly() {
    // A group of renewals (as the service's group commit sends them) that names one lease first
    // with a stale fence, then with its own: the stale entry renews nothing, the right one does,
    // as a release group decides (the first request that names the lease by all of its values).
    let app = TestApp::with_credential("key-a", 1).await;
    let lease = app.lease(gpt4o_for(60)).await;
    let fence = lease["fence"].as_i64().unwrap();
    let entry = |fence: i64| {
        json!({"lease_id": lease["lease_id"], "key_id": "key-a", "provider": "openai",
               "pool": "default", "fence": fence, "lease_seconds": 600})
    };
    let renewed: Vec<(i32, Option<time::OffsetDateTime>)> =
        sqlx::query_as("SELECT renewal, lease_until FROM credpool_renew($1) ORDER BY renewal")
            .bind(json!([entry(fence - 1), entry(fence)]))
            .fetch_all(&app.db)
            .await
            .unwrap();
    assert_eq!(renewed.len(), 2);
    assert_eq!(renewed[0].1, None, "the stale fence renewed: {renewed:?}");
    let until = renewed[1]
        .1
        .expect("the lease named rightly was not renewed");
    assert!(until > time::OffsetDateTime::now_utc() + Duration::from_secs(300));
}
