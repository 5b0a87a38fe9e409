//! What a process's candidate view of a pool knows, against a real PostgreSQL. The incremental
//! read of a pool (what changed since a read, by that read's snapshot xmin): a change whose
//! transaction was still open when a read ran is not in that read, and the next read of the
//! changes since it has it, departures included. And a view never answers 429 from counts it
//! was not told were wrong: a lease whose release was answered "not released", occupancy older
//! than a second behind a read of changes.

use std::time::Duration;

use credpool::domain::{PoolName, ProviderName};
use credpool::store::candidates::load_pool;
use credpool_test_support::*;
use reqwest::StatusCode;
use serde_json::json;
use sqlx::Connection;

#[tokio::test]
async fn a_change_still_open_during_a_read_is_in_the_next_read_of_the_changes() {
    let app = TestApp::spawn().await;
    for key in ["key-a", "key-b", "key-c"] {
        app.put_key(key, "openai", "default", &["gpt-4o"], 1).await;
    }
    let (provider, pool) = (
        ProviderName::parse("openai").unwrap(),
        PoolName::default_pool(),
    );
    let mut reader = connect(&app).await;
    let mut writer = connect(&app).await;

    // a drain of key-a and the deletion of key-b, written but not committed...
    let mut open = writer.begin().await.unwrap();
    run_on(
        &mut *open,
        "UPDATE credentials SET draining = true WHERE key_id = 'key-a'",
    )
    .await;
    run_on(&mut *open, "DELETE FROM credentials WHERE key_id = 'key-b'").await;
    // ...while the pool is read whole: the read sees neither
    let whole = load_pool(&mut reader, &provider, &pool, None)
        .await
        .unwrap();
    let draining = |snapshot: &credpool::store::candidates::PoolSnapshot, key: &str| {
        snapshot
            .credentials
            .iter()
            .find(|c| c.key_id.as_str() == key)
            .map(|c| c.draining)
    };
    assert_eq!(whole.credentials.len(), 3);
    assert_eq!(draining(&whole, "key-a"), Some(false));
    open.commit().await.unwrap();

    // the changes since that read: both, though they committed after it began
    let changes = load_pool(&mut reader, &provider, &pool, Some(whole.xmin))
        .await
        .unwrap();
    assert_eq!(draining(&changes, "key-a"), Some(true), "{changes:?}");
    assert!(
        changes.departed.iter().any(|k| k.as_str() == "key-b"),
        "{:?}",
        changes.departed
    );
    // (key-c did not change, but it may be read again: xids are the cluster's, and a transaction
    // of another database older than key-c's write and still open at the whole read keeps the
    // xmin below it. Reading a row again is harmless; missing one is what must not happen.)
    assert!(changes.version > whole.version);
}

#[tokio::test]
async fn deletes_in_one_pool_never_wait_for_each_others_departures() {
    // A credential's delete drops its pool's departures older than ten minutes. Two deletes in
    // one pool, the first still open after dropping an old departure: the second passes over it
    // rather than wait for the first's commit (a lock no lock order names).
    let app = TestApp::spawn().await;
    for key in ["key-a", "key-b"] {
        app.put_key(key, "openai", "default", &["gpt-4o"], 1).await;
    }
    let mut first = connect(&app).await;
    let mut second = connect(&app).await;
    run_on(
        &mut first,
        "INSERT INTO credential_departures (provider, pool, key_id, departed_at)
         VALUES ('openai', 'default', 'long-gone', now() - interval '11 minutes')",
    )
    .await;

    let mut open = first.begin().await.unwrap();
    run_on(&mut *open, "DELETE FROM credentials WHERE key_id = 'key-a'").await;
    // (the bound turns a wait into a failure; a delete that does not wait takes milliseconds)
    run_on(&mut second, "SET lock_timeout = '10s'").await;
    let deleted = sqlx::query("DELETE FROM credentials WHERE key_id = 'key-b'")
        .execute(&mut second)
        .await;
    assert!(
        deleted.is_ok(),
        "the second delete waited for the first's departures: {deleted:?}"
    );
    open.commit().await.unwrap();

    let departures: Vec<String> =
        sqlx::query_scalar("SELECT key_id FROM credential_departures ORDER BY key_id")
            .fetch_all(&mut second)
            .await
            .unwrap();
    assert_eq!(
        departures,
        ["key-a", "key-b"],
        "the old departure is dropped once"
    );
}

/// A release whose answer was lost is made again and answered "not released" (here the caller's
/// request timed out while the release waited in the database, which committed it after; in a
/// failover, the connection went before the answer came). The process's view counted that lease,
/// and a 429 answered from it would say "every slot is busy" with the slot free: the answer
/// frees the slot in the view too. (With `--claim-attempts 0` a 429 comes from the view alone;
/// at the default of 1 the same happens whenever the free credential is not in the claim's batch:
/// CI saw it in the planned switchover of tests/reliability/failover.rs, 16 credentials of 4
/// slots and 52 executors.) Without the fix this fails unless over a second passes between the
/// 409's read and the last allocate (the view is then read again before a 429).
#[tokio::test]
async fn a_release_made_again_after_its_answer_was_lost_leaves_no_429_with_the_slot_free() {
    let mut options = AppOptions::default();
    options.settings.claims.attempts = 0;
    options.settings.request_timeout = Duration::from_secs(2);
    let app = TestApp::spawn_with_hooks_and("release.locked", options).await;
    app.put_gpt4o_key("key-a", "default", 1).await;
    let gpt4o = json!({"provider": "openai", "model": "gpt-4o"});
    let lease = app.lease(gpt4o.clone()).await;

    // the release waits in the database past the request timeout: 503, and it commits later
    let hook = Hook::close(&app, "release.locked").await;
    let response = app.release(release_body(&lease, "success")).await;
    assert_error(
        response,
        StatusCode::SERVICE_UNAVAILABLE,
        "store_unavailable",
    )
    .await;
    // the pool read whole while the release still holds the slot (a 409 is answered only after
    // one): the view counts the lease, rightly so far
    let response = app
        .allocate(json!({"provider": "openai", "model": "gpt-4o-mini"}))
        .await;
    assert_error(response, StatusCode::CONFLICT, "model_not_supported").await;
    hook.open().await;
    while app.in_flight("key-a").await > 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // made again: the lease is gone
    let body = json_body(
        app.release(release_body(&lease, "success")).await,
        StatusCode::OK,
    )
    .await;
    assert_eq!(body["released"], false, "{body}");
    // the slot is free, and the next allocation gets it
    let response = app.allocate(gpt4o).await;
    let body = json_body(response, StatusCode::OK).await;
    assert_eq!(body["key_id"], "key-a", "{body}");
}

/// A read of what changed in a pool brings only the credentials whose configuration or health
/// moved: the occupancy of the others is as old as the last whole read. A release through
/// another replica is not told to this one; a 429 is only answered from occupancy read whole in
/// the last second, and a read of changes since does not make it younger. (Without the fix this
/// fails unless the read of changes brings key-a too, which an open transaction elsewhere on the
/// server can cause by holding the snapshot's xmin back.)
#[tokio::test]
async fn a_read_of_changes_does_not_make_old_occupancy_young_enough_for_a_429() {
    let mut options = AppOptions::default();
    options.settings.claims.attempts = 0;
    // no periodic whole read during the test
    options.settings.view_refresh = Duration::from_secs(600);
    let app = TestApp::spawn_with(options).await;
    let (other, _stop) = app.replica(4).await;
    let replica = Remote::new(&app.client, &format!("http://{other}"));
    app.put_gpt4o_key("key-a", "default", 1).await;
    app.put_key("key-c", "openai", "default", &["gpt-4o-mini"], 1)
        .await;
    let gpt4o = json!({"provider": "openai", "model": "gpt-4o"});
    let mini = json!({"provider": "openai", "model": "gpt-4o-mini"});
    // the pool read whole here; then, through the other replica, key-a's lease released and
    // key-c taken, neither told to this one
    let lease = app.lease(gpt4o.clone()).await;
    replica.release_ok(&lease, "success").await;
    let taken = replica.lease(mini.clone()).await;
    assert_eq!(taken["key_id"], "key-c");
    tokio::time::sleep(Duration::from_millis(1_100)).await;

    // the pool's version moves (a credential joins); a claim on key-c finds it full and the
    // version newer, and this replica reads the changes (key-o, not key-a) before it answers:
    // key-c is full, rightly
    app.put_key("key-o", "openai", "default", &["o1"], 1).await;
    let response = app.allocate(mini).await;
    assert_error(response, StatusCode::TOO_MANY_REQUESTS, "pool_exhausted").await;

    // key-a is free, and the next allocation gets it
    let body = json_body(app.allocate(gpt4o).await, StatusCode::OK).await;
    assert_eq!(body["key_id"], "key-a", "{body}");
}
