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
    sqlx::query("UPDATE credentials SET draining = true WHERE key_id = 'key-a'")
        .execute(&mut *open)
        .await
        .unwrap();
    sqlx::query("DELETE FROM credentials WHERE key_id = 'key-b'")
        .execute(&mut *open)
        .await
        .unwrap();
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
