//! Tenants: executor keys of their own, and a cap on live leases that holds across
//! replicas, decided in the claim on the tenant's slot rows. Several `credpool serve` processes
//! where it matters (the cap and a revoke must hold on every replica).

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use credpool_test_support::*;

use crate::BIN;
use crate::common::{
    app_with_pools_a_and_b, claim_refused_after_a_grant, granted_of, race_tenant, two_replicas,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_at_its_cap_gets_tenant_limit_on_every_replica_while_another_tenant_is_served() {
    // Cap 3; 30 simultaneous allocates from the tenant over two service processes, on a pool
    // with 20 free slots: exactly 3 granted, 27 answered 429 tenant_limit (not pool_exhausted),
    // while another tenant is served meanwhile; the trail proves the cap held.
    let (database, a, b) = two_replicas(10, 2).await;
    let batch = a
        .put_tenant("batch", json!({"max_concurrent_leases": 3}))
        .await;
    assert_eq!(batch["max_concurrent_leases"], 3);
    assert_eq!(batch["weight"], 1);
    b.put_tenant("web", json!({"weight": 2})).await;
    let (_, batch_key) = a.mint_key("batch").await;
    let (_, web_key) = b.mint_key("web").await;

    let replicas = [a.remote(), b.remote()];
    let racing = race_tenant(
        &replicas,
        &batch_key,
        vec![gpt4o_in_for("default", 600); 30],
    );
    // the other tenant, served while the batch tenant is at its cap
    let ((granted, refused), web) = tokio::join!(racing, b.lease_as(&web_key, "default"));
    assert_eq!(web["tenant"], "web");
    for body in &granted {
        assert_eq!(body["tenant"], "batch", "{body}");
    }
    // the earliest end of the tenant's own leases: 600 s away (from a grant that may have come
    // a moment after this claim started)
    for retry_after in &refused {
        assert!((590..=601).contains(retry_after), "{retry_after}");
    }
    assert_eq!(granted.len(), 3, "granted: {granted:?}");
    assert_eq!(refused.len(), 27);
    // the web tenant is served again while batch is still at its cap
    a.lease_as(&web_key, "default").await;

    // the admin list: in flight against the cap
    let line = a.tenant_line("batch").await;
    assert_eq!(line["in_flight"], 3, "{line}");
    assert_eq!(line["max_concurrent_leases"], 3);
    assert_eq!(b.tenant_line("web").await["in_flight"], 2);

    // the trail carries the tenant; tenant_limit is its own series, apart from pool_exhausted
    let pool = database.pool(1).await;
    let tenants: Vec<Option<String>> = pool
        .scalars("SELECT tenant FROM lease_events WHERE event = 'granted' ORDER BY event_id")
        .await;
    assert_eq!(
        tenants
            .iter()
            .filter(|t| t.as_deref() == Some("batch"))
            .count(),
        3
    );
    assert_eq!(
        tenants
            .iter()
            .filter(|t| t.as_deref() == Some("web"))
            .count(),
        2
    );
    // (tenant, result) -> the sum over both processes of credpool_tenant_allocations_total
    let mut series = std::collections::BTreeMap::<(String, String), f64>::new();
    for replica in [&a, &b] {
        let page = replica.metrics().await;
        for line in page
            .lines()
            .filter(|l| l.starts_with("credpool_tenant_allocations_total{"))
        {
            let label = |name: &str| {
                let start = line.find(&format!("{name}=\"")).unwrap() + name.len() + 2;
                line[start..start + line[start..].find('"').unwrap()].to_owned()
            };
            let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
            *series
                .entry((label("tenant"), label("result")))
                .or_default() += value;
        }
        assert!(!page.contains(&batch_key) && !page.contains(&web_key));
    }
    let count = |tenant: &str, result: &str| {
        series
            .get(&(tenant.to_owned(), result.to_owned()))
            .copied()
            .unwrap_or(0.0)
    };
    assert_eq!(count("batch", "tenant_limit"), 27.0, "{series:?}");
    assert_eq!(count("batch", "leased"), 3.0, "{series:?}");
    assert_eq!(count("batch", "pool_exhausted"), 0.0, "{series:?}");
    assert_eq!(count("web", "leased"), 2.0, "{series:?}");

    // a release frees the tenant's slot at once, on any replica
    let released = b.release_as_ok(&batch_key, &granted[0]).await;
    assert_eq!(released["released"], true);
    a.lease_as(&batch_key, "default").await;
    b.allocate_as(&batch_key, gpt4o_in_for("default", 600))
        .refused(StatusCode::TOO_MANY_REQUESTS, "tenant_limit")
        .await;

    let report = audit_passes(BIN, &database).await;
    assert!(
        report.contains("no grant ever exceeded a tenant's cap"),
        "{report}"
    );
    assert!(a.terminate().await.success());
    assert!(b.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_key_is_refused_on_every_replica_as_soon_as_the_delete_answered() {
    let database = TestDatabase::create().await;
    let env = keyed_env(&database);
    let (a, b) = tokio::join!(
        ServeProcess::start(BIN, &env, &[]),
        ServeProcess::start(BIN, &env, &[])
    );
    let response = a
        .admin(
            Method::PUT,
            "/api/admin/keys/k",
            Some(
                json!({"provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 8,
                    "secret": {"api_key": "sk-k"}}),
            ),
        )
        .await;
    assert!(response.status().is_success());
    a.put_tenant("team", json!({"max_concurrent_leases": 5}))
        .await;
    let (key_id, key) = a.mint_key("team").await;
    let (_, other_key) = a.mint_key("team").await;

    // both replicas serve the key (each has looked it up once: nothing may be kept from that)
    let mut leases = Vec::new();
    for replica in [&a, &b, &a, &b] {
        leases.push(replica.lease_as(&key, "default").await);
    }
    let renew = renew_body(&leases[0], 600);
    b.renew_as(&key, renew.clone()).ok_json().await;

    let revoked = a
        .admin(
            Method::DELETE,
            &format!("/api/admin/tenants/team/keys/{key_id}"),
            None,
        )
        .await;
    assert_eq!(json_body(revoked, StatusCode::OK).await["revoked"], true);
    // at once, on both replicas: allocate, renew and release are refused, and change nothing
    let events_before: i64 = sqlx::query_scalar("SELECT count(*) FROM lease_events")
        .fetch_one(&database.pool(1).await)
        .await
        .unwrap();
    for replica in [&b, &a] {
        let refused = [
            replica
                .allocate_as(&key, gpt4o_in_for("default", 600))
                .await,
            replica.renew_as(&key, renew.clone()).await,
            replica.release_as(&key, lease_ref(&leases[1])).await,
            // an allocate the pool could never serve is refused for the key, not answered 404
            replica
                .allocate_as(&key, gpt4o_in_for("nowhere", 600))
                .await,
        ];
        for response in refused {
            assert_error(response, StatusCode::UNAUTHORIZED, "unauthorized").await;
        }
    }
    let events_after: i64 = sqlx::query_scalar("SELECT count(*) FROM lease_events")
        .fetch_one(&database.pool(1).await)
        .await
        .unwrap();
    assert_eq!(
        events_before, events_after,
        "a revoked key changed the trail"
    );
    // the tenant's other key still works; revoking twice is a 404
    b.lease_as(&other_key, "default").await;
    b.admin(
        Method::DELETE,
        &format!("/api/admin/tenants/team/keys/{key_id}"),
        None,
    )
    .refused(StatusCode::NOT_FOUND, "tenant_key_not_found")
    .await;
    assert!(a.terminate().await.success());
    assert!(b.terminate().await.success());
}

#[tokio::test]
async fn a_key_of_another_tenant_neither_renews_nor_releases_a_lease() {
    // Tenant B holds a lease. Tenant A's live key, and the internal key (tenant `default`), name
    // it by all of its values: both are answered as an unknown key would be (401), and nothing
    // changes. Before, any live key renewed or released any tenant's lease.
    let app = TestApp::with_credential("k", 2).await;
    app.put_tenant("team-a", json!({})).await;
    app.put_tenant("team-b", json!({"max_concurrent_leases": 2}))
        .await;
    let (_, key_a) = app.mint_key("team-a").await;
    let (_, key_b) = app.mint_key("team-b").await;
    let lease = app.lease_as(&key_b, "default").await;
    assert_eq!(lease["tenant"], "team-b");
    let mut renew = lease_ref(&lease);
    renew["fence"] = lease["fence"].clone();
    renew["lease_seconds"] = json!(900);
    let mut release = lease_ref(&lease);
    release["fence"] = lease["fence"].clone();
    release["outcome"] = json!("rate_limited");
    let tenant_slots = || async {
        app.scalar::<Option<String>>("SELECT string_agg(to_jsonb(t)::text, E'\\n' ORDER BY t.tenant_id, t.slot) FROM tenant_slots t").await
    };
    let (before, slots_before) = (app.snapshot().await, tenant_slots().await);
    for key in [key_a.as_str(), INTERNAL_KEY] {
        for (path, body) in [
            ("/api/internal/renew-lease", &renew),
            ("/api/internal/release-key", &release),
        ] {
            app.post_as(path, key, body.clone())
                .refused(StatusCode::UNAUTHORIZED, "unauthorized")
                .await;
        }
    }
    assert_eq!(
        app.snapshot().await,
        before,
        "another tenant's key changed the lease, its credential or the trail"
    );
    assert_eq!(tenant_slots().await, slots_before);
    assert_eq!(app.in_flight("k").await, 1, "the lease is no longer live");

    // its own tenant renews and releases it
    app.renew_as(&key_b, renew.clone()).ok_json().await;
    let released = app.release_as(&key_b, release.clone()).ok_json().await;
    assert_eq!(released["released"], true, "{released}");
    assert_eq!(app.in_flight("k").await, 0);
    // and a report on the ended lease with another tenant's key is refused too (no late report)
    let before = app.snapshot().await;
    app.release_as(&key_a, release)
        .refused(StatusCode::UNAUTHORIZED, "unauthorized")
        .await;
    assert_eq!(app.snapshot().await, before);
}

#[tokio::test]
async fn a_store_failure_reading_the_key_is_a_503_counted_as_store_unavailable() {
    // A tenant key is read before anything else of the request (its body included); when that
    // read fails, the answer is 503 `store_unavailable`, never 401, and the allocations counter
    // says so too (under empty provider and pool: the body was never read). Before, it counted
    // the 503 under `unauthorized`. A service process of its own, so that its counters count
    // this request alone.
    let database = TestDatabase::create().await;
    let serve = ServeProcess::start(BIN, &keyed_env(&database), &[]).await;
    serve.put_tenant("team", json!({})).await;
    let (_, key) = serve.mint_key("team").await;
    // the key's table is gone for this database: reading any key fails
    let db = database.pool(1).await;
    db.run_sql("ALTER TABLE tenant_keys RENAME TO tenant_keys_away")
        .await;
    let body = gpt4o_for(60);
    serve
        .allocate_as(&key, body)
        .refused(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable")
        .await;
    let page = serve.metrics().await;
    assert_eq!(allocations(&page, "", "store_unavailable"), 1.0, "{page}");
    assert_eq!(allocations(&page, "", "unauthorized"), 0.0, "{page}");
    assert!(serve.terminate().await.success());
}

#[tokio::test]
async fn a_tenant_key_is_shown_once_and_never_again() {
    let app = TestApp::with_credential("k", 2).await;
    app.put_tenant("team", json!({})).await;
    let (key_id, key) = app.mint_key("team").await;
    assert!(key.starts_with("cpk_") && key.len() == 68, "{key}");
    let lease = app.lease_as(&key, "default").await;
    app.release_as(&key, release_body(&lease, "success"))
        .ok_json()
        .await;

    // the list names the key by its id, never the key
    let listed = app
        .admin(Method::GET, "/api/admin/tenants", None)
        .await
        .text()
        .await
        .unwrap();
    assert!(listed.contains(&key_id), "{listed}");
    assert!(!listed.contains(&key), "the list returned the key");
    assert!(
        !listed.contains(&key[4..]),
        "the list returned the key's digits"
    );
    // the store keeps only its SHA-256: no row of any table holds the key
    let rows: String = app
        .scalar(
            "SELECT concat_ws(' ', (SELECT string_agg(t::text, ' ') FROM tenant_keys t),
                              (SELECT string_agg(t::text, ' ') FROM tenant_events t),
                              (SELECT string_agg(t::text, ' ') FROM lease_events t))",
        )
        .await;
    assert!(!rows.contains(&key[4..]), "a row holds the key");
    let hashed: bool = sqlx::query_scalar(
        "SELECT key_hash = sha256(convert_to($1, 'UTF8')) FROM tenant_keys WHERE key_id = $2::uuid",
    )
    .bind(&key)
    .bind(&key_id)
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert!(hashed, "the stored hash is not the key's SHA-256");
    // a second mint is another key
    let (_, second) = app.mint_key("team").await;
    assert_ne!(second, key);
}

#[tokio::test]
async fn a_key_minted_while_its_tenant_is_deleted_is_a_404_and_leaves_no_key() {
    // An operator deletes the tenant while another mints it a key. The delete holds the tenant's
    // lock and its row until it commits; the mint must then answer 404 `tenant_not_found` and
    // leave nothing behind. Before, the mint's INSERT read the tenant from a snapshot taken
    // while the delete was still open and failed on the foreign key when it committed: a 503
    // (found by the schema fuzzer).
    let app = TestApp::spawn().await;
    app.put_tenant("team", json!({})).await;
    let deleting = holding(
        &app,
        &[
            "SELECT pg_advisory_xact_lock(hashtextextended('credpool.tenant:team', 0))",
            "DELETE FROM tenants WHERE tenant_id = 'team'",
        ],
    )
    .await;
    let minting = {
        let app = app.remote();
        tokio::spawn(async move {
            app.admin(Method::POST, "/api/admin/tenants/team/keys", None)
                .await
        })
    };
    wait_for_lock_waiters(&app, 1).await;
    deleting.commit().await.unwrap();
    let refused = json_body(minting.await.unwrap(), StatusCode::NOT_FOUND).await;
    assert_eq!(refused["error"]["code"], "tenant_not_found", "{refused}");
    let keys: i64 = app
        .scalar("SELECT count(*) FROM tenant_keys WHERE tenant_id = 'team'")
        .await;
    assert_eq!(keys, 0, "a key of a deleted tenant was stored");
}

#[tokio::test]
async fn bad_tenant_input_gets_a_stable_4xx_and_changes_nothing() {
    let app = TestApp::spawn().await;
    let snapshot = || async {
        app.scalar::<String>("SELECT concat_ws(' | ', (SELECT string_agg(t::text, ' ' ORDER BY tenant_id) FROM tenants t),
                                     (SELECT count(*)::text FROM tenant_events),
                                     (SELECT count(*)::text FROM tenant_keys),
                                     (SELECT count(*)::text FROM tenant_slots))").await
    };
    app.put_tenant("team", json!({"max_concurrent_leases": 2}))
        .await;
    let before = snapshot().await;
    for (id, body) in [
        ("team", json!({"max_concurrent_leases": -1})),
        // a cap of 0 would answer every allocate 429 tenant_limit, forever
        ("team", json!({"max_concurrent_leases": 0})),
        ("team", json!({"max_concurrent_leases": 100_001})),
        ("team", json!({"max_concurrent_leases": "3"})),
        ("team", json!({"weight": 0})),
        ("team", json!({"weight": 1001})),
        ("team", json!({"cap": 3})),
        (
            "team",
            json!({"rate_limits": [{"requests": 0, "seconds": 60}]}),
        ),
        (
            "team",
            json!({"rate_limits": [{"bananas": 5, "seconds": 60}]}),
        ),
        ("Team", json!({})),
        ("-team", json!({})),
    ] {
        let response = app
            .admin(
                Method::PUT,
                &format!("/api/admin/tenants/{id}"),
                Some(body.clone()),
            )
            .await;
        assert_error(response, StatusCode::BAD_REQUEST, "invalid_request").await;
    }
    app.admin(Method::DELETE, "/api/admin/tenants/default", None)
        .refused(StatusCode::CONFLICT, "tenant_in_use")
        .await;
    app.admin(Method::DELETE, "/api/admin/tenants/nobody", None)
        .refused(StatusCode::NOT_FOUND, "tenant_not_found")
        .await;
    let (post, delete) = (Method::POST, Method::DELETE);
    app.admin(post, "/api/admin/tenants/nobody/keys", None)
        .refused(StatusCode::NOT_FOUND, "tenant_not_found")
        .await;
    app.admin(
        delete.clone(),
        "/api/admin/tenants/team/keys/not-a-uuid",
        None,
    )
    .refused(StatusCode::BAD_REQUEST, "invalid_request")
    .await;
    let unknown_key = format!("/api/admin/tenants/team/keys/{}", uuid::Uuid::new_v4());
    app.admin(delete, &unknown_key, None)
        .refused(StatusCode::NOT_FOUND, "tenant_key_not_found")
        .await;
    // the executor key may not manage tenants
    let forbidden = app
        .client
        .put(app.url("/api/admin/tenants/team"))
        .header("x-admin-key", INTERNAL_KEY)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_error(forbidden, StatusCode::FORBIDDEN, "forbidden").await;
    // a key-shaped string that was never minted, and one of the wrong shape
    for key in [format!("cpk_{}", "0".repeat(64)), "cpk_short".to_owned()] {
        app.allocate_as(&key, gpt4o_in_for("default", 600))
            .refused(StatusCode::UNAUTHORIZED, "unauthorized")
            .await;
    }
    assert_eq!(
        snapshot().await,
        before,
        "a refused request changed tenants"
    );
}

#[tokio::test]
async fn a_lowered_cap_grants_nothing_until_the_tenant_is_back_under_it() {
    // Cap 2 with 2 leases held, lowered to 1: the tenant is over its cap, so nothing is granted
    // until its leases in flight are below 1 + ... exactly: one release leaves 1 held (= the
    // cap: still 429); the second release reopens it, and it grants exactly one again.
    let app = TestApp::with_credential("k", 8).await;
    let key = app.capped_tenant("team", 2).await;
    let first = app.lease_as(&key, "default").await;
    let second = app.lease_as(&key, "default").await;
    app.put_tenant("team", json!({"max_concurrent_leases": 1}))
        .await;
    app.allocate_as(&key, gpt4o_in_for("default", 600))
        .refused(StatusCode::TOO_MANY_REQUESTS, "tenant_limit")
        .await;
    for (lease, open_after) in [(&first, false), (&second, true)] {
        app.release_as_ok(&key, lease).await;
        let response = app.allocate_as(&key, gpt4o_in_for("default", 600)).await;
        if open_after {
            json_body(response, StatusCode::OK).await;
        } else {
            assert_error(response, StatusCode::TOO_MANY_REQUESTS, "tenant_limit").await;
        }
    }
    app.allocate_as(&key, gpt4o_in_for("default", 600))
        .refused(StatusCode::TOO_MANY_REQUESTS, "tenant_limit")
        .await;
    // the internal key's tenant has no cap: unaffected throughout
    app.lease(gpt4o()).await;
    audit_passes(BIN, &app.database).await;
}

#[tokio::test]
async fn a_claim_paused_before_the_tenant_lock_never_takes_a_row_another_claim_filled() {
    // Cap 1. A claim takes its snapshot with the tenant's one row free, then waits (test hook
    // `claim.before_tenant_lock`) while the service grants the tenant a lease in another pool
    // and commits. Resumed, the claim locks the row, finds it holding a live lease (the
    // re-check of the locked row) and grants nothing: 'tenant_limit'. Decided on a count or a
    // row read from the snapshot, it would grant a second lease to a tenant capped at one.
    let app = app_with_pools_a_and_b().await;
    let key = app.capped_tenant("team", 1).await;

    claim_refused_after_a_grant(
        &app,
        ("team", &key),
        "claim.before_tenant_lock",
        "a second lease for a tenant capped at one",
    )
    .await;
}

#[tokio::test]
async fn a_release_takes_its_tenant_row_right_after_its_slot_row_before_any_window_row() {
    // The lock order puts tenant slot rows right after slot rows and before lease_windows rows.
    // A release reporting usage (which locks its credential's lease_windows row) meets its
    // lease's tenant row held by another transaction: while it waits there it must hold no
    // lease_windows row. Before, it locked the windows row first and the tenant row only when it
    // ended the lease, so a third transaction found the windows row taken.
    let app = TestApp::with_credential("k", 2).await;
    let key = app.capped_tenant("team", 2).await;
    let lease = app.lease_as(&key, "default").await;
    let mut holder = app.db.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM tenant_slots WHERE lease_id = $1::text::uuid FOR UPDATE")
        .bind(lease["lease_id"].as_str().unwrap())
        .execute(&mut *holder)
        .await
        .unwrap();
    let mut release = release_body(&lease, "success");
    release["usage"] = json!({"tokens": 10});
    let releasing = {
        let (app, key) = (app.remote(), key.clone());
        tokio::spawn(async move { app.release_as(&key, release).await })
    };
    wait_for_lock_waiters(&app, 1).await;
    let mut third = app.db.begin().await.unwrap();
    let window = sqlx::query("SELECT 1 FROM lease_windows WHERE key_id = 'k' FOR UPDATE NOWAIT")
        .execute(&mut *third)
        .await;
    third.rollback().await.unwrap();
    holder.rollback().await.unwrap();
    let released = json_body(releasing.await.unwrap(), StatusCode::OK).await;
    assert!(
        window.is_ok(),
        "the release waiting for its tenant row held its credential's lease_windows row: {window:?}"
    );
    assert_eq!(released["released"], true, "{released}");
    assert_eq!(app.in_flight("k").await, 0);
}

#[tokio::test]
async fn a_renewal_keeps_the_tenant_slot_and_an_expiry_frees_it_without_cleanup() {
    // Cap 1. A lease of 2 s renewed to 600 s still counts once its first end has passed (the
    // tenant's row moved with the renewal: read from the lease's first end, the row would look
    // free and a second lease would be granted). A lease that simply runs out frees the row on
    // the database clock, with no cleanup pass run.
    let app = TestApp::with_credential("k", 8).await;
    let key = app.capped_tenant("team", 1).await;
    let short = |seconds: u64| app.allocate_as(&key, gpt4o_for(seconds));
    let lease = short(2).ok_json().await;
    let renew = renew_body(&lease, 600);
    app.renew_as(&key, renew).ok_json().await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    short(1)
        .refused(StatusCode::TOO_MANY_REQUESTS, "tenant_limit")
        .await;
    app.release_as_ok(&key, &lease).await;

    short(1).ok_json().await;
    short(1)
        .refused(StatusCode::TOO_MANY_REQUESTS, "tenant_limit")
        .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    short(1).ok_json().await;
    audit_passes(BIN, &app.database).await;
}

#[tokio::test]
async fn a_waiting_allocate_at_its_tenant_cap_is_served_when_the_tenant_releases() {
    // wait_ms also waits out the tenant's cap: the release of the tenant's lease (here in
    // another pool, whose waiters are not this request's) lets the waiting request in.
    let _waiters = exclusive_waiters().await;
    let app = app_with_pools_a_and_b().await;
    let key = app.capped_tenant("team", 1).await;
    let held = app.lease_as(&key, "a").await;
    let waiting = {
        let (app, key) = (app.remote(), key.clone());
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let response = app.allocate_as(&key,
                json!({"provider": "openai", "model": "gpt-4o", "pool": "b", "wait_ms": 10_000}),
            )
            .await;
            (response, started.elapsed())
        })
    };
    // it waits, held back by its cap, though pool b has four free slots
    waiters_queued(&app, 1).await;
    assert!(!waiting.is_finished(), "served past the tenant's cap");
    app.release_as_ok(&key, &held).await;
    let (response, waited) = waiting.await.unwrap();
    let lease = json_body(response, StatusCode::OK).await;
    assert_eq!(lease["key_id"], "kb");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
}

#[tokio::test]
async fn the_dashboard_shows_each_tenant_in_flight_against_its_cap() {
    let app = TestApp::with_credential("k", 8).await;
    app.put_tenant("team", json!({"max_concurrent_leases": 2}))
        .await;
    app.put_tenant("batch", json!({"max_concurrent_leases": 5}))
        .await;
    let (_, key) = app.mint_key("team").await;
    for _ in 0..2 {
        app.lease_as(&key, "default").await;
    }
    let pools = app.admin_text("/dashboard/fragments/pools").await;
    let row = |tenant: &str| {
        let start = pools
            .find(&format!("data-tenant=\"{tenant}\""))
            .unwrap_or_else(|| panic!("no row for {tenant}: {pools}"));
        let end = start + pools[start..].find("</tr>").unwrap();
        pools[start..end].to_owned()
    };
    assert!(row("team").contains("2 / 2"), "{}", row("team"));
    assert!(row("team").contains("at cap"), "{}", row("team"));
    assert!(row("batch").contains("0 / 5"), "{}", row("batch"));
    assert!(!row("batch").contains("at cap"));
    assert!(row("default").contains("no cap"), "{}", row("default"));
    assert!(!pools.contains(&key), "the dashboard never shows a key");
}

/// What [`saturate`] saw after its first 2 seconds: the grants each tenant got, and the mean
/// number of live leases in the pool (sampled from `db` every 20 ms).
struct Saturated {
    grants: std::collections::HashMap<&'static str, u64>,
    occupancy: f64,
}

/// Three tenants keep `waiting` requests each against a pool of 8 slots over two service
/// processes, each lease held 50 ms then released, for `seconds`, counted after the first 2
/// seconds (the queues filling up). A tenant of `idle` sends nothing.
async fn saturate(
    db: &sqlx::PgPool,
    bases: [&str; 2],
    keys: &[(&'static str, String)],
    idle: &[&str],
    waiting: usize,
    seconds: u64,
) -> Saturated {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let client = client();
    let counting = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut loops = Vec::new();
    let mut counts = Vec::new();
    for (tenant, key) in keys.iter().filter(|(t, _)| !idle.contains(t)) {
        let granted = Arc::new(AtomicU64::new(0));
        counts.push((*tenant, granted.clone()));
        for i in 0..waiting {
            let (replica, key) = (Remote::new(&client, bases[i % 2]), key.clone());
            let (counting, stop, granted) = (counting.clone(), stop.clone(), granted.clone());
            loops.push(tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let response = replica
                        .allocate_as(
                            &key,
                            json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 60,
                               "wait_ms": 10_000}),
                        )
                        .await;
                    if response.status() != StatusCode::OK {
                        continue;
                    }
                    let lease: Value = response.json().await.unwrap();
                    if counting.load(Ordering::SeqCst) {
                        granted.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let released = replica.release_as(&key, lease_ref(&lease)).await;
                    assert_eq!(released.status(), StatusCode::OK);
                }
            }));
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    counting.store(true, Ordering::SeqCst);
    let until = tokio::time::Instant::now() + Duration::from_secs(seconds);
    let mut samples = Vec::new();
    while tokio::time::Instant::now() < until {
        let live: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM lease_slots WHERE lease_id IS NOT NULL AND lease_until > now()",
        )
        .fetch_one(db)
        .await
        .unwrap();
        samples.push(live as f64);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    counting.store(false, Ordering::SeqCst);
    stop.store(true, Ordering::SeqCst);
    for running in loops {
        running.await.unwrap();
    }
    Saturated {
        grants: counts
            .into_iter()
            .map(|(tenant, granted)| (tenant, granted.load(Ordering::SeqCst)))
            .collect(),
        occupancy: samples.iter().sum::<f64>() / samples.len() as f64,
    }
}

/// Each tenant's share of `grants`, in percent.
fn shares(grants: &std::collections::HashMap<&'static str, u64>) -> Vec<(&'static str, f64)> {
    let total: u64 = grants.values().sum();
    assert!(total > 0, "nothing was granted");
    let mut shares: Vec<_> = grants
        .iter()
        .map(|(tenant, n)| (*tenant, 100.0 * *n as f64 / total as f64))
        .collect();
    shares.sort_by(|a, b| a.0.cmp(b.0));
    shares
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_saturated_pool_is_shared_by_weight_between_the_waiting_tenants_of_every_replica() {
    // Weights 1:2:1, each tenant keeping 20 requests waiting (wait_ms) on a pool of 8 slots
    // over two service processes, leases held ~50 ms: each tenant's share of the grants is
    // within 5 points of 25/50/25. With the middle tenant idle, its share is lent: the other
    // two keep the pool as full as the three did (a share held back for the idle tenant would
    // leave about half the slots free), and share it 50/50. Without fair share the waiters are
    // served in arrival order, about a third each.
    let (database, a, b) = two_replicas(2, 4).await;
    let db = database.pool(1).await;
    let mut keys = Vec::new();
    for (tenant, weight) in [("light", 1), ("heavy", 2), ("other", 1)] {
        a.put_tenant(tenant, json!({"weight": weight})).await;
        keys.push((tenant, a.mint_key(tenant).await.1));
    }
    let bases = [a.base.as_str(), b.base.as_str()];

    let three = saturate(&db, bases, &keys, &[], 20, 20).await;
    let all = shares(&three.grants);
    for (tenant, share) in &all {
        let expected = if *tenant == "heavy" { 50.0 } else { 25.0 };
        assert!(
            (share - expected).abs() <= 5.0,
            "{tenant}: {share:.1}% of the grants, expected {expected}% +-5 (all: {all:?})"
        );
    }

    let two = saturate(&db, bases, &keys, &["heavy"], 20, 10).await;
    assert!(
        two.occupancy >= 0.8 * three.occupancy,
        "with heavy idle the pool held {:.1} leases on average, against {:.1} with all three \
         busy: the idle tenant's share was not lent",
        two.occupancy,
        three.occupancy
    );
    let both = shares(&two.grants);
    for (tenant, share) in &both {
        assert!(
            (share - 50.0).abs() <= 5.0,
            "{tenant}: {share:.1}% of the grants with heavy idle, expected 50% +-5 (all: {both:?})"
        );
    }
    eprintln!(
        "fair share: weights 1:2:1 {all:?} ({:.1} of 8 slots held); with heavy idle {both:?} \
         ({:.1} held)",
        three.occupancy, two.occupancy
    );
}

#[tokio::test]
async fn a_waiter_whose_process_is_gone_holds_no_slot_back() {
    // A tenant further below its share "waits" for the pool, but its process stopped saying it is
    // alive: a waiting allocate of another tenant is served at once from the free slot. While the
    // process is alive, the same allocate yields to it (and answers 429 at the end of its wait
    // with the slot still free: the yielded-to waiter is expected to take it), while an allocate
    // that does not wait is served at once.
    let _waiters = exclusive_waiters().await;
    let app = TestApp::with_credential("k1", 1).await;
    app.put_tenant("ghost", json!({})).await;
    let waiting = |process_seen_seconds_ago: i64| {
        let db = app.db.clone();
        async move {
            db.run_sql("DELETE FROM pool_waiters").await;
            db.run_sql_with(
                "INSERT INTO pool_waiter_processes (instance, seen_at)
                 VALUES ('gone', now() - make_interval(secs => $1))
                 ON CONFLICT (instance) DO UPDATE SET seen_at = EXCLUDED.seen_at",
                process_seen_seconds_ago as f64,
            )
            .await;
            db.run_sql("INSERT INTO pool_waiters (waiter, instance, tenant, provider, pools, model, since, until)
                 VALUES (gen_random_uuid(), 'gone', 'ghost', 'openai', '{default}', 'gpt-4o',
                         now() - interval '1 second', now() + interval '1 minute')").await;
        }
    };
    let allocate_waiting = || {
        app.allocate_as(
            INTERNAL_KEY,
            json!({"provider": "openai", "model": "gpt-4o", "wait_ms": 400}),
        )
    };

    waiting(0).await;
    let response = allocate_waiting().await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let held: i64 = app
        .scalar("SELECT count(*) FROM lease_slots WHERE lease_until > now()")
        .await;
    assert_eq!(held, 0, "the yielding request took the slot");
    // a request that does not wait never yields: nobody is refused while a slot is free
    let at_once = app.allocate_as(INTERNAL_KEY, gpt4o()).ok_json().await;
    app.release_as_ok(INTERNAL_KEY, &at_once).await;

    waiting(30).await;
    let lease = allocate_waiting().ok_json().await;
    assert_eq!(lease["key_id"], "k1");
    assert_eq!(lease["tenant"], "default");
}

/// Asserts 403 `pool_not_allowed` for an allocate of `provider`/`pool` with `key`, with the
/// message that names only what the request named.
async fn assert_not_allowed(app: &TestApp, key: &str, provider: &str, pool: &str) {
    let response = app
        .allocate_as(
            key,
            json!({"provider": provider, "model": "gpt-4o", "pool": pool}),
        )
        .await;
    let body = assert_error(response, StatusCode::FORBIDDEN, "pool_not_allowed").await;
    assert_eq!(
        body["error"]["message"],
        format!("this key may not lease from provider {provider} pool {pool}"),
        "{body}"
    );
}

#[tokio::test]
async fn a_tenant_key_outside_its_pools_gets_the_same_403_whether_the_pool_exists_or_not() {
    let app = TestApp::with_credential("openai-default", 4).await;
    app.put_gpt4o_key("openai-vip", "vip", 4).await;
    app.put_key("anthropic-default", "anthropic", "default", &["gpt-4o"], 4)
        .await;
    let team = app
        .put_tenant("team", json!({"pools": ["openai/default"]}))
        .await;
    assert_eq!(team["pools"], json!(["openai/default"]));
    assert_eq!(team["reports_may_disable"], false);
    let (_, key) = app.mint_key("team").await;

    let lease = app.lease_as(&key, "default").await;
    assert_eq!(lease["key_id"], "openai-default");
    // a pool that exists and one that does not, another provider that exists and one that does
    // not: one answer, which names only what the request named
    assert_not_allowed(&app, &key, "openai", "vip").await;
    assert_not_allowed(&app, &key, "openai", "nothing-here").await;
    assert_not_allowed(&app, &key, "anthropic", "default").await;
    assert_not_allowed(&app, &key, "nobody", "default").await;
    // the internal key keeps its meaning: every provider and pool
    let vip = app
        .lease(json!({"provider": "openai", "model": "gpt-4o", "pool": "vip"}))
        .await;
    assert_eq!(vip["key_id"], "openai-vip");

    // a pattern: every pool of one provider
    app.put_tenant("team", json!({"pools": ["anthropic/*"]}))
        .await;
    assert_not_allowed(&app, &key, "openai", "default").await;
    let other = app
        .allocate_as(&key, json!({"provider": "anthropic", "model": "gpt-4o"}))
        .ok_json()
        .await;
    assert_eq!(other["key_id"], "anthropic-default");

    // narrowing the pools ended nothing held: the openai/default lease still renews and releases
    let renew = renew_body(&lease, 600);
    let renewed = app.renew_as(&key, renew).await;
    json_body(renewed, StatusCode::OK).await;
    let released = app.release_as(&key, lease_ref(&lease)).await;
    assert_eq!(json_body(released, StatusCode::OK).await["released"], true);
}

#[tokio::test]
async fn a_new_tenant_leases_nowhere_until_an_operator_names_its_pools() {
    let app = TestApp::with_credential("k", 4).await;
    // created without pools (the raw PUT, not the helper, which names every pool)
    let created = json_body(
        app.admin(
            Method::PUT,
            "/api/admin/tenants/newcomer",
            Some(json!({"max_concurrent_leases": 2})),
        )
        .await,
        StatusCode::CREATED,
    )
    .await;
    assert_eq!(created["pools"], json!([]));
    let (_, key) = app.mint_key("newcomer").await;
    assert_not_allowed(&app, &key, "openai", "default").await;
    let before = app.snapshot().await;
    assert_not_allowed(&app, &key, "openai", "vip").await;
    assert_eq!(app.snapshot().await, before, "a refusal changed something");
    // the default tenant is the internal key's: it cannot be scoped (mint tenant keys instead)
    for body in [
        json!({"pools": ["openai/default"]}),
        json!({"reports_may_disable": false}),
    ] {
        let response = app
            .admin(Method::PUT, "/api/admin/tenants/default", Some(body))
            .await;
        assert_error(response, StatusCode::BAD_REQUEST, "invalid_request").await;
    }
    let default = app.tenant_line("default").await;
    assert_eq!(default["pools"], json!(["*/*"]), "{default}");
    assert_eq!(default["reports_may_disable"], true, "{default}");
    // named: it leases
    app.put_tenant("newcomer", json!({"pools": ["openai/default"]}))
        .await;
    app.lease_as(&key, "default").await;
    let trail: Vec<Option<Vec<String>>> = app.scalars("SELECT pools FROM tenant_events WHERE tenant_id = 'newcomer' AND event IN ('created', 'updated') ORDER BY event_id").await;
    assert_eq!(
        trail,
        [Some(vec![]), Some(vec!["openai/default".to_owned()])]
    );
}

#[tokio::test]
async fn vip_falls_back_to_default_only_where_the_tenant_may_lease_from_default() {
    let app = TestApp::with_credential("open", 4).await;
    app.put_gpt4o_key("held", "vip", 1).await;
    app.put_tenant("vip-only", json!({"pools": ["openai/vip"]}))
        .await;
    let (_, key) = app.mint_key("vip-only").await;
    let first = app.lease_as(&key, "vip").await;
    assert_eq!(first["key_id"], "held");
    // vip is full: the fallback to default is outside the tenant's pools
    let full = app.allocate_as(&key, gpt4o_in_for("vip", 600)).await;
    assert_error(full, StatusCode::TOO_MANY_REQUESTS, "pool_exhausted").await;
    // the internal key falls back as always
    let fallback = app
        .lease(json!({"provider": "openai", "model": "gpt-4o", "pool": "vip"}))
        .await;
    assert_eq!(
        (&fallback["key_id"], &fallback["pool"]),
        (&json!("open"), &json!("default"))
    );
}

/// Seconds until `key_id`'s cooldown ends (database clock).
async fn rest_seconds(db: &sqlx::PgPool, key_id: &str) -> f64 {
    sqlx::query_scalar(
        "SELECT extract(epoch FROM cooldown_until - now())::float8 FROM credentials WHERE key_id = $1",
    )
    .bind(key_id)
    .fetch_one(db)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_tenants_report_rests_a_credential_at_most_the_bound_and_cannot_disable_it() {
    // One tenant's executor reported a 31-day quota rest and an auth_error: every other tenant
    // got 429 for a month. Now a report rests a credential for at most --max-report-rest-seconds
    // (an hour by default; the clamp is in the trail), a tenant's auth_error rests it for the
    // backoff instead of disabling it, and the trail names the tenant.
    let app = TestApp::with_credential("k1", 1).await;
    app.put_gpt4o_key("k2", "default", 1).await;
    app.put_tenant("team", json!({})).await;
    let (_, key) = app.mint_key("team").await;
    let release = |lease: &Value, outcome: &str, retry_after: Option<u32>| {
        let mut body = release_body(lease, outcome);
        if let Some(seconds) = retry_after {
            body["retry_after_seconds"] = json!(seconds);
        }
        app.release_as(&key, body)
    };

    let first = app.lease_as(&key, "default").await;
    let rested = first["key_id"].as_str().unwrap().to_owned();
    release(&first, "quota_exhausted", Some(2_678_400))
        .ok_json()
        .await;
    let detail = app.credential(&rested).await;
    assert_eq!(detail["status"], "exhausted", "{detail}");
    let left = rest_seconds(&app.db, &rested).await;
    assert!(
        (3500.0..=3600.0).contains(&left),
        "rested for {left} s, not at most the hour's bound"
    );

    let second = app.lease_as(&key, "default").await;
    let reported = second["key_id"].as_str().unwrap().to_owned();
    assert_ne!(reported, rested);
    release(&second, "auth_error", None).ok_json().await;
    let detail = app.credential(&reported).await;
    assert_eq!(detail["status"], "cooldown", "{detail}");
    let left = rest_seconds(&app.db, &reported).await;
    assert!((0.0..=60.0).contains(&left), "rested for {left} s");

    // the trail: which tenant's report changed each credential, and the clamp
    let events: Vec<(String, String, Option<String>, Option<Value>)> = sqlx::query_as(
        "SELECT key_id, reason, actor, details FROM credential_events
         WHERE event = 'status_changed' ORDER BY event_id",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    assert_eq!(events.len(), 2, "{events:?}");
    let (key_id, reason, actor, details) = &events[0];
    assert_eq!(key_id, &rested);
    assert!(reason.contains("clamped"), "{reason}");
    assert_eq!(actor.as_deref(), Some("tenant:team"));
    let details = details.as_ref().unwrap();
    assert_eq!(details["tenant"], "team", "{details}");
    assert_eq!(details["retry_after_seconds"], 2_678_400, "{details}");
    assert_eq!(details["clamped_from_seconds"], 2_678_400, "{details}");
    let (key_id, _, actor, details) = &events[1];
    assert_eq!(key_id, &reported);
    assert_eq!(actor.as_deref(), Some("tenant:team"));
    assert_eq!(details.as_ref().unwrap()["outcome"], "auth_error");

    // an operator who trusts the tenant's reports says so: then its auth_error disables
    app.put_tenant("trusted", json!({"reports_may_disable": true}))
        .await;
    let (_, trusted) = app.mint_key("trusted").await;
    app.set_status(&reported, "available", None).await;
    let lease = app.lease_as(&trusted, "default").await;
    app.release_as(&trusted, release_body(&lease, "auth_error"))
        .ok_json()
        .await;
    let detail = app.credential(lease["key_id"].as_str().unwrap()).await;
    assert_eq!(detail["status"], "disabled", "{detail}");
}

#[tokio::test]
async fn an_unauthenticated_request_is_refused_before_its_body_is_read_or_a_claim_runs() {
    // A key shaped like a tenant's passed a first check, the body was parsed (400 with the
    // fields' names) and the claim ran in PostgreSQL before the 401. Now the key's look-up is the
    // only statement: with every table a claim reads locked, the answer is still 401 at once.
    let app = TestApp::with_credential("k", 4).await;
    let unknown = format!("cpk_{}", "0".repeat(64));
    for path in [
        "/api/internal/allocate-key",
        "/api/internal/renew-lease",
        "/api/internal/release-key",
    ] {
        for key in [unknown.as_str(), "not-a-key-at-all"] {
            let response = app
                .client
                .post(app.url(path))
                .header("x-internal-key", key)
                .header("content-type", "application/json")
                .body("{\"provider\": 42, garbage")
                .send()
                .await
                .unwrap();
            assert_error(response, StatusCode::UNAUTHORIZED, "unauthorized").await;
        }
    }
    let every_table_a_claim_reads = "LOCK TABLE credentials, lease_slots, lease_requests, pool_versions IN ACCESS EXCLUSIVE MODE";
    let lock = holding(&app, &[every_table_a_claim_reads]).await;
    let response =
        tokio::time::timeout(Duration::from_secs(30), app.allocate_as(&unknown, gpt4o()))
            .await
            .expect("no answer within 30 s");
    lock.rollback().await.unwrap();
    assert_error(response, StatusCode::UNAUTHORIZED, "unauthorized").await;
}

#[tokio::test]
async fn an_upgrade_keeps_existing_tenants_leasing_everywhere_and_new_ones_start_with_none() {
    // A database of the release before scopes, with a tenant and its key: after the upgrade the
    // tenant still leases from every pool (nobody's traffic stops), its reports may not disable,
    // and a tenant created afterwards leases nowhere until it is given pools.
    let (database, pool) = TestDatabase::create_at(20261203000016).await;
    let key = format!("cpk_{}", "ab".repeat(32));
    let hash = credpool::domain::TenantKey::parse(&key).unwrap().hash();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO tenants (tenant_id) VALUES ('old-team');
         INSERT INTO tenant_keys (key_id, tenant_id, key_hash)
         VALUES (gen_random_uuid(), 'old-team', '\\x{}'::bytea)",
        hex::encode(hash.0)
    )))
    .execute(&pool)
    .await
    .unwrap();
    credpool::store::migrate(&pool).await.expect("the upgrade");
    pool.close().await;

    let app = TestApp::spawn_on(database, AppOptions::default()).await;
    app.put_gpt4o_key("vip-key", "vip", 2).await;
    let old = app.tenant_line("old-team").await;
    assert_eq!(old["pools"], json!(["*/*"]), "{old}");
    assert_eq!(old["reports_may_disable"], false, "{old}");
    let lease = app.lease_as(&key, "vip").await;
    assert_eq!(lease["tenant"], "old-team");
    let default = app.tenant_line("default").await;
    assert_eq!(default["reports_may_disable"], true, "{default}");
    let created = json_body(
        app.admin(Method::PUT, "/api/admin/tenants/new-team", Some(json!({})))
            .await,
        StatusCode::CREATED,
    )
    .await;
    assert_eq!(created["pools"], json!([]));
}

/// The `pool_waiters` rows of tenant `tenant`, straight from the database.
async fn waiter_rows(app: &TestApp, tenant: &str) -> i64 {
    app.scalar_of(
        "SELECT count(*) FROM pool_waiters WHERE tenant = $1",
        tenant,
    )
    .await
}

/// `POST /api/internal/allocate-key` of gpt-4o from `default` with `key`, waiting up to
/// `wait_ms`.
async fn allocate_waiting(app: &TestApp, key: &str, wait_ms: u64) -> reqwest::Response {
    app.allocate_as(
        key,
        json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 600, "wait_ms": wait_ms}),
    )
    .await
}

#[tokio::test]
async fn fair_share_never_yields_to_a_tenant_whose_window_has_no_room() {
    // Tenant `metered` may make one request per 10 minutes and has made it; a request of it
    // waits (wait_ms) all the same. Tenant `busy` holds a lease and asks for the free slot with
    // a wait. `metered` is further below its share, but it cannot take the slot: its window
    // holds it back, not the pool. Before, `metered` was recorded as waiting for the pool and
    // `busy` yielded to it for its whole wait: 429 with a slot free.
    let _waiters = exclusive_waiters().await;
    let app = TestApp::with_credential("k1", 2).await;
    app.put_tenant(
        "metered",
        json!({"rate_limits": [{"requests": 1, "seconds": 600}]}),
    )
    .await;
    let metered = app.mint_key("metered").await.1;
    app.put_tenant("busy", json!({})).await;
    let busy = app.mint_key("busy").await.1;
    let used = app.lease_as(&metered, "default").await;
    let released = app.release_as(&metered, lease_ref(&used)).await;
    assert_eq!(released.status(), StatusCode::OK);
    app.lease_as(&busy, "default").await;
    let held_back = app.spawn_allocate_as(
        &metered,
        json!({"provider": "openai", "model": "gpt-4o", "wait_ms": 6_000}),
    );
    // the metered request has been looked at (and refused by its window) at least once
    waiters_queued(&app, 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let served = allocate_waiting(&app, &busy, 2_000).await;
    assert_eq!(
        served.status(),
        StatusCode::OK,
        "the busy tenant yielded a free slot to a tenant that cannot take it"
    );
    let refused = held_back.await.unwrap();
    assert_error(refused, StatusCode::TOO_MANY_REQUESTS, "tenant_limit").await;
}

#[tokio::test]
async fn a_waiter_whose_caller_left_during_its_first_claim_leaves_no_row_behind() {
    // A waiting request's first claim is held at `claim.before_lock` while its caller gives up;
    // the claim then grants nothing (the only slot is held) and records the request as waiting.
    // Before, that row outlived its caller until the end of its wait (20 s), and another
    // tenant's waiting request yielded the free slot to nobody until then.
    let _waiters = exclusive_waiters().await;
    let app = TestApp::spawn_with_hooks("claim.before_lock").await;
    app.put_gpt4o_key("k1", "default", 1).await;
    app.put_tenant("left", json!({})).await;
    let left = app.mint_key("left").await.1;
    app.put_tenant("stays", json!({})).await;
    let stays = app.mint_key("stays").await.1;
    let held = app.lease_as(&stays, "default").await;
    let hook = Hook::close(&app, "claim.before_lock").await;
    let gone = app
        .client
        .post(app.url("/api/internal/allocate-key"))
        .header("x-internal-key", &left)
        .timeout(Duration::from_millis(300))
        .json(&json!({"provider": "openai", "model": "gpt-4o", "wait_ms": 20_000}))
        .send();
    let (gone, ()) = tokio::join!(gone, wait_for_lock_waiters(&app, 1));
    assert!(gone.is_err(), "the caller was answered: {gone:?}");
    hook.open().await;
    // the held claim runs (nothing to grant) and commits; its caller is gone by then (its wait
    // had 20 s to go: a row still there 5 s later was left behind)
    let mut left_rows = 1;
    for _ in 0..50 {
        left_rows = waiter_rows(&app, "left").await;
        if left_rows == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        left_rows, 0,
        "a departed caller is still recorded as waiting"
    );
    let released = app.release_as(&stays, lease_ref(&held)).await;
    assert_eq!(released.status(), StatusCode::OK);
    let lease = allocate_waiting(&app, &stays, 1_500).ok_json().await;
    assert_eq!(lease["key_id"], "k1");
}

#[tokio::test]
async fn a_lowered_cap_reopens_when_the_leases_over_it_end_without_maintenance() {
    // Cap 3 -> 1 while three 2-second leases are held; their holders crash. Nothing runs the
    // cleanup pass (the in-process app has no scheduler). Once the last of them has ended, on the
    // database clock, the tenant is served again: exactly its new cap. Before, the tenant's rows
    // stayed closed (`over_limit`) until a cleanup pass refitted it: tenant_limit meanwhile.
    let app = TestApp::with_credential("k1", 8).await;
    let key = app.capped_tenant("crashy", 3).await;
    for _ in 0..3 {
        app.allocate_as(&key, gpt4o_for(2)).ok_json().await;
    }
    app.put_tenant("crashy", json!({"max_concurrent_leases": 1}))
        .await;
    app.allocate_as(&key, gpt4o_in_for("default", 600))
        .refused(StatusCode::TOO_MANY_REQUESTS, "tenant_limit")
        .await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let granted = granted_of(&app, &key, 3).await;
    assert_eq!(granted, 1, "not exactly the new cap once the leases ended");
    audit_passes(BIN, &app.database).await;
}

#[tokio::test]
async fn two_tenants_with_one_request_id_are_two_requests() {
    // Request ids belong to the tenant that presents them. Before, a tenant that used another
    // tenant's (predictable) request_id got 409 request_id_conflict, which also told it that the
    // other tenant had used that id.
    let app = TestApp::with_credential("k1", 4).await;
    app.put_tenant("alpha", json!({})).await;
    let alpha = app.mint_key("alpha").await.1;
    app.put_tenant("beta", json!({})).await;
    let beta = app.mint_key("beta").await.1;
    let body = json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 600,
                      "request_id": "job-42"});
    let allocate_as = async |key: &str| app.allocate_as(key, body.clone()).await;
    let first = allocate_as(&alpha).ok_json().await;
    let other = allocate_as(&beta).ok_json().await;
    assert_ne!(
        first["lease_id"], other["lease_id"],
        "one lease for two tenants"
    );
    assert_eq!(other["tenant"], "beta");
    // each tenant's retry replays its own lease, and only its own
    let again = allocate_as(&alpha).ok_json().await;
    assert_eq!(again["lease_id"], first["lease_id"]);
    let again = allocate_as(&beta).ok_json().await;
    assert_eq!(again["lease_id"], other["lease_id"]);
    assert_eq!(app.in_flight("k1").await, 2);
}

#[tokio::test]
async fn a_waiting_request_is_refused_a_pool_its_tenant_lost_while_it_waited() {
    // Tenant `narrowed` may lease from openai/*; its request waits for the one slot. The operator
    // takes openai out of its pools while it waits; the slot then frees. The waiter's next claim
    // is refused (403 pool_not_allowed): a change of pools applies to every claim after it, not
    // only to requests that arrive after it. Before, the waiter was served from the pool its
    // tenant no longer had.
    let _waiters = exclusive_waiters().await;
    let app = TestApp::with_credential("k1", 1).await;
    app.put_tenant("narrowed", json!({"pools": ["openai/*"]}))
        .await;
    let (_, key) = app.mint_key("narrowed").await;
    let held = app.lease(gpt4o_in_for("default", 600)).await;
    let waiting = app.spawn_allocate_as(
        &key,
        json!({"provider": "openai", "model": "gpt-4o", "wait_ms": 20_000}),
    );
    waiters_queued(&app, 1).await;
    app.put_tenant("narrowed", json!({"pools": ["anthropic/*"]}))
        .await;
    let released = app.release(lease_ref(&held)).await;
    assert_eq!(released.status(), StatusCode::OK);

    let refused = waiting.await.unwrap();
    assert_error(refused, StatusCode::FORBIDDEN, "pool_not_allowed").await;
    let leases: i64 = app
        .scalar_of(
            "SELECT count(*) FROM lease_slots WHERE lease_id IS NOT NULL AND tenant = $1",
            "narrowed",
        )
        .await;
    assert_eq!(leases, 0, "the tenant holds a lease of a pool it lost");
}
