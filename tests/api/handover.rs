//! Nothing stands between a free slot and the executor who should get it: a lease granted under a
//! `request_id` is kept for the retry of a caller who left, a granted lease that cannot be answered
//! is given back, a cleanup pass holds no lock that a claim needs, and a freed slot reaches the
//! waiters of every process even when its announcement never comes. Each window is held open on
//! purpose (a paused claim, a purge held by a row lock, a release that never announces), and each
//! test failed before the fix it names.

use std::time::Duration;

use credpool::store::maintenance;
use reqwest::StatusCode;
use serde_json::json;
use sqlx::Executor;

use credpool_test_support::*;

#[tokio::test]
async fn a_lease_granted_under_a_request_id_is_kept_for_the_retry_of_a_departed_caller() {
    // Every claim of this database pauses at `claim.before_lock` while the test holds the hook.
    // The caller's first attempt times out while its claim waits there; the claim then grants.
    // Before, the service gave that lease back at once (the caller was gone) and the retry with
    // the same request_id got a second lease, while the first attempt's caller might still be
    // using the credential upstream.
    let app = TestApp::spawn_with_hooks("claim.before_lock").await;
    app.put_gpt4o_key("k", "default", 2).await;
    let hook = Hook::close(&app, "claim.before_lock").await;
    let mut body = gpt4o_for(600);
    body["request_id"] = json!("retry-me-1");
    let first = app
        .client
        .post(app.url("/api/internal/allocate-key"))
        .header("x-internal-key", INTERNAL_KEY)
        .timeout(Duration::from_millis(300))
        .json(&body)
        .send();
    // the first attempt's claim waits at the hook; its caller gives up
    let (first, ()) = tokio::join!(first, wait_for_lock_waiters(&app, 1));
    assert!(first.is_err(), "the first attempt was answered: {first:?}");
    hook.open().await;
    // the claim grants once it runs; then its reply finds nobody
    let granted = loop {
        let granted: Option<String> =
            sqlx::query_scalar("SELECT lease_id::text FROM lease_events WHERE event = 'granted'")
                .fetch_optional(&app.db)
                .await
                .unwrap();
        if let Some(granted) = granted {
            break granted;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let retried = app.lease(body).await;
    assert_eq!(
        retried["lease_id"].as_str().unwrap().replace('-', ""),
        granted.replace('-', ""),
        "the retry got another lease"
    );
    assert_eq!(app.in_flight("k").await, 1);
    let ended: i64 = app
        .scalar("SELECT count(*) FROM lease_events WHERE event <> 'granted'")
        .await;
    assert_eq!(
        ended, 0,
        "the lease was ended while its request could still be retried"
    );
}

#[tokio::test]
async fn a_granted_lease_that_cannot_be_answered_is_given_back_at_once() {
    // A credential row whose sealed secret is NULL (a row written before secrets were sealed):
    // the claim grants, and the grant cannot be turned into an answer. Before, the lease stayed
    // in its slot until lease_until and the caller heard 429.
    let app = TestApp::with_credential("k", 1).await;
    app.run_sql(
        "UPDATE credentials SET secret = '{\"api_key\": \"sk-legacy\"}', secret_ciphertext = NULL
         WHERE key_id = 'k'",
    )
    .await;
    let answer = app.allocate(gpt4o_for(600)).await;
    assert_ne!(answer.status(), StatusCode::OK);
    let text = answer.text().await.unwrap();
    assert!(!text.contains("sk-legacy"), "{text}");
    assert_eq!(
        app.in_flight("k").await,
        0,
        "the granted lease was stranded"
    );
    let given_back: i64 = app
        .scalar(
            "SELECT count(*) FROM lease_events
         WHERE event = 'force_released' AND reason = 'granted but could not be answered'",
        )
        .await;
    assert_eq!(given_back, 1);
}

#[tokio::test]
async fn a_claim_is_served_while_a_cleanup_pass_is_still_purging() {
    // The only slot holds an expired lease; a cleanup pass reaps it, then its audit purge waits
    // (a row it would delete is locked). Before, the pass was one transaction: the reaped slot's
    // row stayed locked until the purge ended, and the claim passed over it and answered 429.
    let app = TestApp::with_credential("k", 1).await;
    app.lease(gpt4o_for(1)).await;
    app.run_sql(
        "INSERT INTO credential_events (key_id, event, reason, at)
         VALUES ('k', 'status_changed', 'long ago', now() - interval '40 days')",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let mut blocker = transaction_holding(
        &app,
        &["SELECT 1 FROM credential_events WHERE reason = 'long ago' FOR UPDATE"],
    )
    .await;
    let db = app.db.clone();
    let pass =
        tokio::spawn(
            async move { maintenance::run_pass(&db, Duration::from_secs(30 * 86_400)).await },
        );
    wait_for_lock_waiters(&app, 1).await;
    let served = app.allocate(gpt4o_for(600)).await;
    let status = served.status();
    blocker.execute("ROLLBACK").await.unwrap();
    let report = pass.await.unwrap().unwrap().unwrap();
    assert_eq!(status, StatusCode::OK, "refused while the cleanup pass ran");
    assert_eq!(report.expired_leases_reaped, 1);
    assert_eq!(report.audit_rows_purged, 1);
}

#[tokio::test]
async fn a_claim_binding_a_conversation_never_waits_for_the_cooldown_recorder() {
    // The only credential's cooldown has ended; a cleanup pass records that (`cooldowns_recorded`)
    // and has not committed yet. A claim with an affinity_key is served by that credential and
    // writes a new binding, whose foreign key takes a key share lock on the credential row.
    // Before, the recorder held that row FOR UPDATE, and the claim waited for the pass to commit.
    let app = TestApp::with_credential("k", 1).await;
    app.set_status("k", "cooldown", Some(-1.0)).await;
    let mut pass = connect(&app).await;
    pass.execute("BEGIN").await.unwrap();
    let recorded: i32 = sqlx::query_scalar("SELECT credpool_recover_cooldowns()")
        .fetch_one(&mut pass)
        .await
        .unwrap();
    assert_eq!(recorded, 1);
    let mut body = gpt4o_for(600);
    body["affinity_key"] = json!("conversation-1");
    let served = tokio::time::timeout(Duration::from_secs(5), app.allocate(body)).await;
    pass.execute("COMMIT").await.unwrap();
    let served = json_body(
        served.expect("the claim waited for the cleanup pass's lock on its credential row"),
        StatusCode::OK,
    )
    .await;
    assert_eq!(served["key_id"], "k");
    assert_eq!(served["affinity"], "new", "{served}");
    let bound: String = app
        .scalar("SELECT key_id FROM affinity_bindings WHERE affinity_key = 'conversation-1'")
        .await;
    assert_eq!(bound, "k");
}

#[tokio::test]
async fn a_freed_slot_whose_announcement_never_came_still_reaches_a_waiter() {
    // Another process released the only lease and stopped before announcing it (a release that
    // leaves the announcement to its caller, which never makes it). Before, the waiter slept
    // until its deadline with the slot free; now the longest waiter claims again every second.
    let _waiters = exclusive_waiters().await;
    let app = TestApp::with_credential("k", 1).await;
    let held = app.lease(gpt4o_for(600)).await;
    let mut waiting = gpt4o_for(600);
    waiting["wait_ms"] = json!(20_000);
    let waiter = {
        let client = app.client.clone();
        let url = app.url("/api/internal/allocate-key");
        tokio::spawn(async move {
            client
                .post(url)
                .header("x-internal-key", INTERNAL_KEY)
                .json(&waiting)
                .send()
                .await
                .unwrap()
        })
    };
    // the waiter has looked once and is waiting: the slot freed now reaches it only by its
    // recheck (nobody announces it)
    waiters_queued(&app, 1).await;
    sqlx::query("SELECT verdict FROM credpool_release($1, $2)")
        .bind(
            json!([{"lease_id": held["lease_id"], "key_id": "k", "provider": "openai",
                       "pool": "default", "fence": held["fence"], "outcome": "success",
                       "usage_tokens": null}]),
        )
        .bind(policy())
        .fetch_all(&app.db)
        .await
        .unwrap();
    // well before its 20-second deadline
    let answer = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter slept through the freed slot")
        .unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
}
