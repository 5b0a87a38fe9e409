//! `PUT /api/admin/keys/{key_id}`: create or update, the secret stays write-only, and changing
//! `max_concurrent_uses` under load never breaks the limit.

use reqwest::StatusCode;
use serde_json::{Value, json};

use credpool_test_support::*;

use crate::common::import_specs;

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
    let slots: i64 = app
        .scalar("SELECT count(*) FROM lease_slots WHERE key_id = 'key-a'")
        .await;
    assert_eq!(slots, 3);
    // executors receive the new secret
    let lease = app
        .lease(json!({"provider": "openai", "model": "o3"}))
        .await;
    assert_eq!(lease["credential"], json!({"api_key": "sk-rotated"}));
}

#[tokio::test]
async fn put_without_status_keeps_the_stored_status() {
    let app = TestApp::with_credential("key-a", 1).await;
    app.set_status("key-a", "disabled", None).await;
    let mut body = spec(1);
    body.as_object_mut().unwrap().remove("status");
    let view = app.put_key_raw("key-a", body).ok_json().await;
    assert_eq!(view["status"], "disabled");
}

#[tokio::test]
async fn admin_routes_refuse_the_executor_key_with_403_and_no_key_with_401() {
    let app = TestApp::spawn().await;
    let url = app.url("/api/admin/keys/key-a");
    let put = |key: Option<(&str, &str)>| {
        let request = app.client.put(&url).json(&spec(1));
        match key {
            Some((name, value)) => request.header(name, value).send(),
            None => request.send(),
        }
    };
    // no key, a wrong one; the executor key, also sent as the admin key
    for key in [None, Some(("x-admin-key", "nope"))] {
        let refused = put(key).await.unwrap();
        assert_error(refused, StatusCode::UNAUTHORIZED, "unauthorized").await;
    }
    for key in [
        ("x-internal-key", INTERNAL_KEY),
        ("x-admin-key", INTERNAL_KEY),
    ] {
        let refused = put(Some(key)).await.unwrap();
        assert_error(refused, StatusCode::FORBIDDEN, "forbidden").await;
    }
    let count: i64 = app.scalar("SELECT count(*) FROM credentials").await;
    assert_eq!(count, 0);
}

#[tokio::test]
async fn invalid_credentials_are_rejected_without_echoing_the_secret_and_change_nothing() {
    let app = TestApp::with_credential("key-a", 1).await;
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
    let app = TestApp::with_credential("key-a", 3).await;
    let allocate = || app.allocate(gpt4o_for(600));
    let mut leases = Vec::new();
    for _ in 0..3 {
        leases.push(allocate().ok_json().await);
    }
    app.put_gpt4o_key("key-a", "default", 1).await;
    assert_eq!(
        app.in_flight("key-a").await,
        3,
        "lowering the limit revoked a lease"
    );

    // 3 in flight, limit 1: nothing until in-flight falls under 1
    for lease in &leases[..2] {
        allocate()
            .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
            .await;
        app.release_ok(lease, "success").await;
    }
    allocate()
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    app.release(release_body(&leases[2], "success"))
        .ok_json()
        .await;

    let next = allocate().ok_json().await;
    allocate()
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    let slots: i64 = app
        .scalar("SELECT count(*) FROM lease_slots WHERE key_id = 'key-a'")
        .await;
    assert_eq!(slots, 1);
    app.release(release_body(&next, "success")).ok_json().await;
}

#[tokio::test]
async fn lowering_the_limit_keeps_in_flight_leases_renewable_and_releasable() {
    let app = TestApp::with_credential("key-a", 4).await;
    let mut leases = Vec::new();
    for _ in 0..4 {
        let body = gpt4o_for(600);
        leases.push(app.lease(body).await);
    }
    // release the two lowest slots, then lower to 2: leases in slots 2 and 3 move into 0 and 1
    for lease in &leases[..2] {
        app.release(release_body(lease, "success")).ok_json().await;
    }
    app.put_gpt4o_key("key-a", "default", 2).await;
    let max_slot: i32 = app
        .scalar("SELECT max(slot) FROM lease_slots WHERE key_id = 'key-a'")
        .await;
    assert_eq!(max_slot, 1);
    for lease in &leases[2..] {
        let renew = lease_ref(lease);
        app.renew(renew).ok_json().await;
        app.release_ok(lease, "success").await;
    }
}

#[tokio::test]
async fn raising_the_limit_takes_effect_for_the_next_allocation() {
    let app = TestApp::with_credential("key-a", 1).await;
    let body = gpt4o_for(600);
    app.lease(body.clone()).await;
    app.allocate(body.clone())
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    app.put_gpt4o_key("key-a", "default", 3).await;
    app.lease(body.clone()).await;
    app.lease(body.clone()).await;
    app.allocate(body)
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    assert_eq!(app.in_flight("key-a").await, 3);
}

#[tokio::test]
async fn a_credential_keeps_its_provider_a_put_or_import_that_moves_it_is_refused_and_changes_nothing()
 {
    let app = TestApp::with_credential("key-a", 2).await;
    let lease = app.lease(gpt4o()).await;
    let before = app.credential("key-a").await;

    // a PUT that names another provider: 409, and the credential, its slots and the lease stay
    let mut moved = spec(3);
    moved["provider"] = json!("anthropic");
    let refused = app
        .put_key_raw("key-a", moved.clone())
        .refused(StatusCode::CONFLICT, "provider_changed")
        .await;
    let message = error_message(&refused);
    assert!(message.contains("openai"), "{message}");
    assert!(!message.contains("sk-admin-test-secret"), "{message}");
    let after = app.credential("key-a").await;
    assert_eq!(after["provider"], "openai");
    assert_eq!(after["max_concurrent_uses"], before["max_concurrent_uses"]);
    let slots: Vec<(String, i32)> = sqlx::query_as(
        "SELECT provider, slot FROM lease_slots WHERE key_id = 'key-a' ORDER BY slot",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    assert_eq!(
        slots,
        vec![("openai".to_owned(), 0), ("openai".to_owned(), 1)]
    );
    app.renew(renew_body(&lease, 60)).ok_json().await;

    // an import that moves one credential imports none of the others either
    let specs = import_specs(&[("key-a", "anthropic"), ("key-new", "openai")], 1);
    let db = credpool::store::Db::direct(app.database.pool(1).await);
    let actor = credpool::store::credentials::Actor::parse("test").unwrap();
    let error = credpool::store::credentials::import(&db, &specs, &actor)
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            credpool::store::credentials::UpsertError::ProviderChanged { .. }
        ),
        "{error:?}"
    );
    let created: i64 = app
        .scalar("SELECT count(*) FROM credentials WHERE key_id = 'key-new'")
        .await;
    assert_eq!(created, 0, "nothing of a refused import is written");
    app.release_ok(&lease, "success").await;
}

#[tokio::test]
async fn two_puts_creating_one_key_under_two_providers_store_the_first_and_refuse_the_second() {
    // The first PUT of a new key (openai, limit 2) is held before its commit (`fit.done`); a
    // second PUT of the key under anthropic (limit 3) queues behind it on the key's operator
    // lock. It reads the key's provider after that lock: 409, and the credential stays the
    // first's. Read before the lock (the key did not exist yet), the second would pass the check
    // and overwrite the first's configuration on a credential of another provider.
    let app = TestApp::spawn_with_hooks("fit.done").await;
    let put = |provider: &'static str, limit: u32| {
        let app = app.remote();
        tokio::spawn(async move {
            let mut body = spec(limit);
            body["provider"] = json!(provider);
            app.put_key_raw("new", body).await
        })
    };
    let hook = Hook::close(&app, "fit.done").await;
    let first = put("openai", 2);
    wait_for_lock_waiters(&app, 1).await;
    let second = put("anthropic", 3);
    wait_for_lock_waiters(&app, 2).await;
    hook.open().await;
    assert_eq!(first.await.unwrap().status(), StatusCode::CREATED);
    assert_error(
        second.await.unwrap(),
        StatusCode::CONFLICT,
        "provider_changed",
    )
    .await;
    let stored = app.credential("new").await;
    assert_eq!(stored["provider"], "openai");
    assert_eq!(stored["max_concurrent_uses"], 2);
}

#[tokio::test]
async fn a_credential_of_ten_thousand_slots_is_refitted_within_the_default_statement_timeout() {
    // Under the service's default statement timeout (5 s, set here on the database as the service
    // sets it on its connections), every change of a large credential's limit answers 200 (a
    // fuzz run found a 503: docs/reliability.md, "Fuzzing"). Small fits come first, and the
    // database keeps the plans made for them (`plan_cache_mode`: what a connection did in that
    // run once a statement had run five times on a small table); then the limit goes up to
    // 10,000, down past held leases (they move to lower numbers), under them (the rest are
    // surplus) and up again. The fit before this test answered 503 here (three runs).
    let database = TestDatabase::create().await;
    database.set("statement_timeout = '5s'").await;
    database.set("plan_cache_mode = force_generic_plan").await;
    let app = TestApp::spawn_on(database, AppOptions::default()).await;
    app.put_gpt4o_key("big", "default", 1).await;
    let set_limit = |limit: u32| {
        let app = &app;
        async move {
            app.patch_key("big", json!({"max_concurrent_uses": limit}))
                .ok_json()
                .await;
        }
    };
    for limit in [2, 1, 2, 1, 2, 1, 2, 1, 3_000, 6_000, 10_000] {
        set_limit(limit).await;
    }
    let mut leases = Vec::new();
    for _ in 0..20 {
        leases.push(app.lease(gpt4o_for(600)).await);
    }
    // the ten leases at the lowest numbers go; the rest, higher up, will have to move
    let lowest: Vec<String> = app
        .scalars(
            "SELECT replace(lease_id::text, '-', '') FROM lease_slots
             WHERE key_id = 'big' AND lease_id IS NOT NULL ORDER BY slot LIMIT 10",
        )
        .await;
    let (gone, leases): (Vec<Value>, Vec<Value>) = leases
        .into_iter()
        .partition(|lease| lowest.contains(&lease["lease_id"].as_str().unwrap().replace('-', "")));
    for lease in &gone {
        app.release_ok(lease, "success").await;
    }
    let above: i64 = app
        .scalar("SELECT count(*) FROM lease_slots WHERE key_id = 'big' AND lease_id IS NOT NULL AND slot >= 15")
        .await;
    assert!(above >= 2, "{above} leases to move");
    // [slot rows, live leases, rows not surplus, highest slot]
    let counts = || {
        app.scalar::<Vec<i64>>(
            "SELECT ARRAY[count(*), count(lease_id), count(*) FILTER (WHERE NOT surplus), max(slot)]
             FROM lease_slots WHERE key_id = 'big'",
        )
    };
    // the leases at 15 and above move below it
    set_limit(15).await;
    assert_eq!(counts().await, [15, 10, 15, 14]);
    // 10 leases over a limit of 3: the 3 that end last are within it
    set_limit(3).await;
    let [rows, live, within, _] = counts().await[..] else {
        unreachable!()
    };
    assert_eq!((rows, live, within), (10, 10, 3));
    set_limit(10_000).await;
    assert_eq!(counts().await, [10_000, 10, 10_000, 9_999]);
    for lease in &leases {
        app.release_ok(lease, "success").await;
    }
}
