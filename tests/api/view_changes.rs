//! The incremental read of a pool (what changed since a read, by that read's snapshot xmin),
//! against a real PostgreSQL: a change whose transaction was still open when a read ran is not
//! in that read, and the next read of the changes since it has it, departures included.

use credpool::domain::{PoolName, ProviderName};
use credpool::store::candidates::load_pool;
use credpool_test_support::*;
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
