//! Tenant rate windows: a tenant's `rate_limits` hold over all its credentials and
//! every replica, decided in the claim on the tenant's tenant_windows row (locked), and the trail
//! proves no window was ever exceeded. Pause points hold a claim between its snapshot and its
//! lock, and a change of the tenant while a claim is in flight.

use std::time::Duration;

use credpool::store;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use sqlx::Executor;

use credpool_test_support::*;

use crate::BIN;
use crate::common::{
    app_with_pools_a_and_b, claim_answer, claim_refused_after_a_grant, granted_of, pause_claim,
    race_tenant, two_replicas,
};

/// An allocate body of gpt-4o from openai's `default` pool for 600 seconds, reserving `tokens`.
fn reserving(tokens: u64) -> Value {
    json!({"provider": "openai", "model": "gpt-4o", "pool": "default", "lease_seconds": 600,
           "tokens": tokens})
}

/// `racers` simultaneous allocates reserving `tokens` each, alternating between `replicas`:
/// the leases granted and the Retry-After of every `tenant_limit` (any other answer panics).
async fn race(
    replicas: &[Remote],
    key: &str,
    racers: usize,
    tokens: u64,
) -> (Vec<Value>, Vec<u64>) {
    race_tenant(replicas, key, vec![reserving(tokens); racers]).await
}

/// What tenant `tenant`'s grants in the trail charged its token window, as the window counts
/// it: each grant's reported usage, else its reservation.
async fn tokens_charged(pool: &sqlx::PgPool, tenant: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(coalesce(
                    (SELECT e.tokens FROM lease_events e
                     WHERE e.lease_id = g.lease_id AND e.event = 'released'), g.tokens)), 0)::bigint
         FROM lease_events g WHERE g.event = 'granted' AND g.tenant = $1",
    )
    .bind(tenant)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_token_window_holds_over_every_replica_and_the_trail_proves_it() {
    // A tenant with a window of 1000 tokens an hour, over 4 credentials with 64 free slots and
    // two service processes. Each round a new tenant: 40 simultaneous allocates of 100 tokens
    // get exactly 10 leases and 30 `tenant_limit` with the window's Retry-After; the internal
    // key (tenant `default`, no windows) is served meanwhile; 5 releases reporting 20 tokens
    // each give 400 back, which 20 more racers fill with exactly 4 leases. The trail: no more
    // than 1000 tokens charged to any tenant, and `credpool audit verify` passes.
    let (database, a, b) = two_replicas(4, 16).await;
    let replicas = [a.remote(), b.remote()];
    let pool = database.pool(1).await;
    for round in 0..4 {
        let tenant = format!("team-{round}");
        let put = a
            .put_tenant(
                &tenant,
                json!({"rate_limits": [{"tokens": 1000, "seconds": 3600}]}),
            )
            .await;
        assert_eq!(
            put["rate_limits"],
            json!([{"tokens": 1000, "seconds": 3600}])
        );
        let (_, key) = b.mint_key(&tenant).await;

        let (granted, refused) = race(&replicas, &key, 40, 100).await;
        assert_eq!(granted.len(), 10, "round {round}: {granted:?}");
        assert_eq!(refused.len(), 30);
        // the window frees when its oldest bucket leaves it: about an hour from now
        for retry_after in &refused {
            assert!(
                (3000..=3900).contains(retry_after),
                "round {round}: Retry-After {retry_after}"
            );
        }
        for lease in &granted {
            assert_eq!(lease["tenant"], tenant.as_str(), "{lease}");
        }
        // a tenant without windows is served while this one has no room
        let other = a.lease(reserving(100)).await;
        assert_eq!(other["tenant"], "default");

        // usage below the reservation gives the difference back to the tenant's window
        for (i, lease) in granted.iter().take(5).enumerate() {
            let mut release = release_body(lease, "success");
            release["usage"] = json!({"tokens": 20});
            let replica = if i % 2 == 0 { &a } else { &b };
            let released = replica.release_as(&key, release).ok_json().await;
            assert_eq!(released["released"], true, "{released}");
        }
        let (again, refused) = race(&replicas, &key, 20, 100).await;
        assert_eq!(again.len(), 4, "round {round}: after 400 tokens came back");
        assert_eq!(refused.len(), 16);
        assert_eq!(tokens_charged(&pool, &tenant).await, 1000, "round {round}");
    }
    audit_passes(BIN, &database).await;
}

#[tokio::test]
async fn an_estimate_larger_than_the_tenant_token_window_is_409_and_a_requests_window_counts_grants()
 {
    let app = TestApp::with_credential("k", 8).await;
    app.put_tenant(
        "team",
        json!({"rate_limits": [{"requests": 3, "seconds": 600}, {"tokens": 500, "seconds": 60}]}),
    )
    .await;
    let (_, key) = app.mint_key("team").await;
    // no wait can make room for 501 tokens in a window of 500
    let response = app.allocate_as(&key, reserving(501)).await;
    let body = json_body(response, StatusCode::CONFLICT).await;
    assert_eq!(body["error"]["code"], "tokens_exceed_budget", "{body}");
    // three requests, whatever their tokens; the fourth waits for the requests window
    for _ in 0..3 {
        app.allocate_as(&key, reserving(0)).ok_json().await;
    }
    let response = app.allocate_as(&key, reserving(0)).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = retry_after(&response);
    assert!((550..=640).contains(&retry_after), "{retry_after}");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "tenant_limit");
    assert!(error_message(&body).contains("window"), "{body}");
    // removing the windows lifts them at once
    app.put_tenant("team", json!({})).await;
    app.allocate_as(&key, reserving(501)).ok_json().await;
    let rows: i64 = app.scalar("SELECT count(*) FROM tenant_windows").await;
    assert_eq!(
        rows, 0,
        "a tenant without windows keeps no tenant_windows row"
    );
}

#[tokio::test]
async fn a_claim_paused_before_the_tenant_window_lock_never_grants_into_a_window_another_filled() {
    // A requests window of 1. A claim takes its snapshot with the window empty, then waits (test
    // hook `claim.before_tenant_window_lock`) while the service grants the tenant a lease in
    // another pool and commits. Resumed, the claim locks the tenant_windows row, finds it full
    // (the re-check of the locked row) and grants nothing: 'tenant_limit'. Decided on the row
    // as the snapshot had it, it would grant a second request into a window of one.
    let app = app_with_pools_a_and_b().await;
    app.put_tenant(
        "team",
        json!({"rate_limits": [{"requests": 1, "seconds": 600}]}),
    )
    .await;
    let (_, key) = app.mint_key("team").await;

    claim_refused_after_a_grant(
        &app,
        ("team", &key),
        "claim.before_tenant_window_lock",
        "a second request in a window of one",
    )
    .await;
}

/// Tenant `team` (no cap, no windows) with a claim of its paused in PICK, after its snapshot
/// (test hook `claim.before_lock`), while an operator PUTs `change` for the tenant: the PUT
/// must wait for the claim to commit. Returns the claim's lease (key_id), the PUT's answer, and
/// the answer to one more allocate of the tenant afterwards.
async fn change_while_a_claim_is_in_flight(
    change: Value,
) -> (Option<String>, u16, reqwest::Response) {
    let app = app_with_pools_a_and_b().await;
    app.put_tenant("team", json!({})).await;
    let (_, key) = app.mint_key("team").await;

    let (hook, claiming) = pause_claim(&app, &key, "claim.before_lock").await;
    let mut putting = {
        let app = app.remote();
        tokio::spawn(async move {
            app.admin(Method::PUT, "/api/admin/tenants/team", Some(change))
                .await
                .status()
                .as_u16()
        })
    };
    // the PUT waits for the tenant's lock, which the claim holds (shared) until it commits: a
    // second backend waiting beside the paused claim. A PUT that answers first did not wait, and
    // the race this is for did not happen.
    tokio::select! {
        () = wait_for_lock_waiters(&app, 2) => {}
        _ = &mut putting => panic!("the PUT answered while a claim of the tenant was in flight"),
    }
    hook.open().await;
    let (key_id, _) = claim_answer(claiming).await;
    let put = tokio::time::timeout(Duration::from_secs(30), putting)
        .await
        .expect("the PUT answered")
        .unwrap();
    let after = app.allocate_as(&key, gpt4o_in_for("b", 600)).await;
    audit_passes(BIN, &app.database).await;
    (key_id, put, after)
}

/// [`change_while_a_claim_is_in_flight`] of `change`: the claim in flight is served, the PUT
/// answers 200 after it, and one more allocate of the tenant is refused 429 (`refused` says why
/// it must be).
async fn counts_the_claim_in_flight(change: Value, refused: &str) {
    let (key_id, put, after) = change_while_a_claim_is_in_flight(change).await;
    assert_eq!(
        key_id.as_deref(),
        Some("ka"),
        "the claim in flight is served"
    );
    assert_eq!(put, 200);
    assert_eq!(after.status(), StatusCode::TOO_MANY_REQUESTS, "{refused}");
}

#[tokio::test]
async fn a_window_set_while_a_claim_of_the_tenant_is_in_flight_counts_that_claim() {
    // Before, the claim read the tenant from its snapshot and the PUT seeded the new window from
    // the trail without the claim's grant, which committed after it: the next allocate found
    // the window of one request empty and a second request was granted into it.
    counts_the_claim_in_flight(
        json!({"rate_limits": [{"requests": 1, "seconds": 600}], "pools": ["*/*"]}),
        "a second request in a window of one",
    )
    .await;
}

#[tokio::test]
async fn a_cap_set_while_a_claim_of_the_tenant_is_in_flight_counts_that_claim() {
    // Before, the PUT fitted the tenant's slot rows without the claim's lease (uncommitted), so
    // the claim's lease lived outside them and the next allocate took the one free row: two
    // leases for a tenant capped at one.
    counts_the_claim_in_flight(
        json!({"max_concurrent_leases": 1, "pools": ["*/*"]}),
        "a second lease for a tenant capped at one",
    )
    .await;
}

#[tokio::test]
async fn an_upgrade_seeds_the_windows_set_before_they_were_enforced_and_names_live_leases_tenant_rows()
 {
    // As a database of the release before tenant windows would be when this one starts: a capped
    // tenant's lease in flight whose slot row names no tenant slot row, and a tenant whose
    // rate_limits were stored (never enforced) after two of its grants, without a tenant_windows
    // row. The upgrade (sql/tenants.sql applied again) names the lease's row, so its release frees
    // the tenant's cap, and seeds the window from the trail, so the window of two is full.
    let app = TestApp::with_credential("k", 8).await;
    let capped = app.capped_tenant("capped", 1).await;
    app.put_tenant("windowed", json!({})).await;
    let (_, windowed) = app.mint_key("windowed").await;
    let held = app.lease_as(&capped, "default").await;
    for _ in 0..2 {
        app.lease_as(&windowed, "default").await;
    }
    app.db
        .execute(
            "UPDATE tenants SET rate_limits = '[{\"requests\": 2, \"seconds\": 600}]'
             WHERE tenant_id = 'windowed';
             UPDATE lease_slots SET tenant_slot = NULL WHERE lease_id IS NOT NULL;
             DELETE FROM credpool_sql_files WHERE name = 'tenants.sql';",
        )
        .await
        .unwrap();

    store::migrate(&app.db).await.expect("the upgrade failed");

    let named: i64 = app
        .scalar(
            "SELECT count(*) FROM lease_slots s JOIN tenant_slots t
             ON t.tenant_id = s.tenant AND t.slot = s.tenant_slot AND t.lease_id = s.lease_id
         WHERE s.tenant = 'capped'",
        )
        .await;
    assert_eq!(
        named, 1,
        "the live lease of the capped tenant names its tenant slot row"
    );
    let response = app
        .allocate_as(&windowed, gpt4o_in_for("default", 600))
        .await;
    assert_eq!(
        response.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "a third request in a window of two"
    );
    // the capped tenant's release frees its cap
    app.release_as(&capped, release_body(&held, "success"))
        .ok_json()
        .await;
    app.lease_as(&capped, "default").await;
}

#[tokio::test]
async fn a_late_report_of_usage_replaces_the_reservation_in_the_tenant_window() {
    // A lease of a tenant with a token window of 1,000 reserved 600 and expired; its late report
    // says it used 100: 500 come back, so an estimate of 800 fits in the window where it did not.
    let app = TestApp::with_credential("k", 8).await;
    app.put_tenant(
        "team",
        json!({"rate_limits": [{"tokens": 1000, "seconds": 600}]}),
    )
    .await;
    let (_, key) = app.mint_key("team").await;
    let lease = app
        .allocate_as(
            &key,
            json!({"provider": "openai", "model": "gpt-4o", "pool": "default",
                   "lease_seconds": 1, "tokens": 600}),
        )
        .ok_json()
        .await;
    let refused = app.allocate_as(&key, reserving(800)).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let live: i64 = app
        .scalar("SELECT count(*) FROM lease_slots WHERE lease_until > now()")
        .await;
    assert_eq!(live, 0, "the lease has not expired yet");
    // the cleanup pass ends it as `expired`: its reservation still holds, an expiry gives no
    // tokens back, only a report does
    let reaped: i32 = app.scalar("SELECT credpool_reap_expired_leases()").await;
    assert_eq!(reaped, 1, "the expired lease left its slot");
    let refused = app.allocate_as(&key, reserving(800)).await;
    assert_eq!(
        refused.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the expiry returned the reservation"
    );
    let mut report = release_body(&lease, "success");
    report["usage"] = json!({"tokens": 100});
    app.release_as(&key, report).ok_json().await;
    app.allocate_as(&key, reserving(800)).ok_json().await;
    // 100 used and 800 reserved: exactly 100 left
    let refused = app.allocate_as(&key, reserving(101)).await;
    assert_eq!(
        refused.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the report gave back more than its reservation less its usage"
    );
    app.allocate_as(&key, reserving(100)).ok_json().await;
    audit_passes(BIN, &app.database).await;
}

/// An allocate of gpt-4o (600 s) with `key`'s tenant is refused 429, its message naming `cause`.
async fn refused_naming(app: &TestApp, key: &str, cause: &str) {
    let body = json_body(
        app.allocate_as(key, gpt4o_in_for("default", 600)).await,
        StatusCode::TOO_MANY_REQUESTS,
    )
    .await;
    assert!(error_message(&body).contains(cause), "{body}");
}

#[tokio::test]
async fn windows_and_a_cap_removed_and_set_again_start_from_the_trail_and_the_leases_in_flight() {
    // Remove a tenant's window and cap, grant more, set them again: the window counts every grant
    // of its last length (before, while and after it was removed), the cap every lease in flight.
    let app = TestApp::with_credential("k", 8).await;
    let limits =
        json!({"max_concurrent_leases": 3, "rate_limits": [{"requests": 4, "seconds": 600}]});
    app.put_tenant("team", limits.clone()).await;
    let (_, key) = app.mint_key("team").await;
    for _ in 0..2 {
        app.lease_as(&key, "default").await;
    }
    app.put_tenant("team", json!({})).await;
    app.lease_as(&key, "default").await;
    app.put_tenant("team", limits).await;
    // 3 leases in flight: at the cap of 3
    refused_naming(&app, &key, "max_concurrent_leases").await;
    app.put_tenant(
        "team",
        json!({"max_concurrent_leases": 10, "rate_limits": [{"requests": 4, "seconds": 600}]}),
    )
    .await;
    // 3 grants in the window of 4: one more, then the window holds
    app.lease_as(&key, "default").await;
    refused_naming(&app, &key, "window").await;
    audit_passes(BIN, &app.database).await;
}

#[tokio::test]
async fn a_window_set_on_a_busy_tenant_never_holds_its_claims_back_while_it_reads_the_trail() {
    // Setting a window reads the tenant's grants of the window's last length from the trail: on
    // a long trail, seconds. The test holds that read at `tenant.seeding` while the tenant keeps
    // allocating. Before, the read ran under the tenant's exclusive lock, so every claim of the
    // tenant answered `busy` and then 429 after a second. The window still counts every grant:
    // the three before the change and the four made while it read the trail.
    let app = TestApp::spawn_with_hooks("tenant.seeding").await;
    app.put_gpt4o_key("k1", "default", 64).await;
    app.put_tenant("team", json!({})).await;
    let (_, key) = app.mint_key("team").await;
    for _ in 0..3 {
        app.lease_as(&key, "default").await;
    }
    let hook = Hook::close(&app, "tenant.seeding").await;
    let putting = {
        let app = app.remote();
        tokio::spawn(async move {
            app.admin(
                Method::PUT,
                "/api/admin/tenants/team",
                Some(json!({
                    "pools": ["*/*"],
                    "rate_limits": [{"requests": 8, "seconds": 600}]
                })),
            )
            .await
            .status()
        })
    };
    wait_for_lock_waiters(&app, 1).await;
    for n in 0..4 {
        let response = app.allocate_as(&key, gpt4o_in_for("default", 600)).await;
        assert_eq!(
            response.status(),
            StatusCode::OK,
            "allocate {n} while the window's seed was read: {}",
            response.text().await.unwrap()
        );
    }
    hook.open().await;
    assert_eq!(putting.await.unwrap(), StatusCode::OK);
    let granted = granted_of(&app, &key, 3).await;
    assert_eq!(
        granted, 1,
        "the window of 8 did not count the 7 grants before it"
    );
    audit_passes(BIN, &app.database).await;
}
