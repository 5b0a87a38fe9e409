//! The lease trail in days: partitions made ahead, retention that drops whole days (never one
//! holding a live lease's history or one the continuous proof has not proven), reports counted
//! once without a unique index, and a trail of the release before partitions kept whole by the
//! upgrade.

use serde_json::json;
use time::OffsetDateTime;

use credpool_test_support::*;

/// The trail's partitions, oldest first: (name, first instant or None for MINVALUE, end).
async fn days(db: &sqlx::PgPool) -> Vec<(String, Option<OffsetDateTime>, OffsetDateTime)> {
    sqlx::query_as("SELECT day::text, day_from, day_to FROM credpool_trail_days() ORDER BY day_to")
        .fetch_all(db)
        .await
        .unwrap()
}

async fn trail_rows(db: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM lease_events")
        .fetch_one(db)
        .await
        .unwrap()
}

/// Writes the trail of a finished lease `lease_id` of `key-a` three and a half days ahead (a
/// day of its own), by hand.
async fn finished_lease_days_ahead(db: &sqlx::PgPool, lease_id: &str) {
    sqlx::query(
        "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at)
         SELECT e, $1::uuid, 'key-a', 'openai', 'default', 1,
                date_trunc('day', now()) + interval '3 days 12 hours',
                date_trunc('day', now()) + interval '3 days 12 hours'
         FROM unnest(ARRAY['granted', 'released']) AS e",
    )
    .bind(lease_id)
    .execute(db)
    .await
    .unwrap();
}

#[tokio::test]
async fn the_trail_is_kept_in_days_made_a_week_ahead() {
    // Every grant needs a partition for its day: the maintenance pass keeps today and the next
    // seven days there, each [midnight, midnight) UTC, and making them again does nothing.
    let app = TestApp::spawn().await;
    let made: i32 = app.scalar("SELECT credpool_make_trail_days(7)").await;
    let again: i32 = app.scalar("SELECT credpool_make_trail_days(7)").await;
    assert_eq!(again, 0, "a day made twice");
    let days = days(&app.db).await;
    let now: OffsetDateTime = app.scalar("SELECT now()").await;
    let today = now.replace_time(time::Time::MIDNIGHT);
    for ahead in 0..=7 {
        let day = today + time::Duration::days(ahead);
        assert!(
            days.iter()
                .any(|(_, from, to)| from.is_none_or(|from| from <= day) && *to > day),
            "no partition for {day} ({made} made): {days:?}"
        );
    }
    for (name, from, to) in &days {
        if let Some(from) = from {
            assert_eq!(*to - *from, time::Duration::days(1), "{name}");
            assert_eq!(from.time(), time::Time::MIDNIGHT, "{name}");
        }
    }
    // a day later (the clock given), the eighth day is made
    let later: i32 = app
        .scalar("SELECT credpool_make_trail_days(7, now() + interval '1 day')")
        .await;
    assert_eq!(later, 1);
}

#[tokio::test]
async fn retention_drops_whole_days_but_never_one_holding_a_live_lease() {
    // A lease held now, and a finished lease whose rows are three days ahead (written there by
    // hand: a day of its own). Forty days later (the clock given), with 30 days of retention,
    // every day is past retention, but the held lease's grant keeps its day and every later one;
    // once it is released, those days are dropped whole, and the trail goes on in days made again.
    let app = TestApp::with_credential("key-a", 2).await;
    app.run_sql("SELECT credpool_make_trail_days(7)").await;
    let held = app.lease(gpt4o_for(600)).await;
    finished_lease_days_ahead(&app.db, "0190aaaa-0000-7000-8000-000000000001").await;
    let rows = trail_rows(&app.db).await;
    let before = days(&app.db).await;
    let forty_days_on = "SELECT credpool_drop_trail_days('30 days', now() + interval '40 days')";
    let dropped: i32 = sqlx::query_scalar(forty_days_on)
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(dropped, 0, "a day with a live lease's grant was dropped");
    assert_eq!(days(&app.db).await, before);
    assert_eq!(trail_rows(&app.db).await, rows);

    app.release(release_body(&held, "success")).ok_json().await;
    let dropped: i32 = sqlx::query_scalar(forty_days_on)
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(
        dropped as usize,
        before.len(),
        "every day is past retention"
    );
    assert_eq!(trail_rows(&app.db).await, 0);
    app.run_sql("SELECT credpool_make_trail_days(7)").await;
    let again = app.lease(gpt4o_for(600)).await;
    assert_eq!(app.lease_events(&again).await, ["granted"]);
}

#[tokio::test]
async fn a_late_report_retried_while_the_first_is_uncommitted_counts_once() {
    // The trail has no unique index (its partitions are by day): a report for a lease that has
    // left its slot is written under the lease's advisory lock. A group reporting it while
    // another group's report of the same lease is not committed waits, then finds that report
    // and writes nothing: one `outcome_after_expiry` row, one failure counted.
    let app = TestApp::with_credential("key-a", 2).await;
    let short = app.lease(gpt4o_for(1)).await;
    expire_and_reap(&app).await;
    let report = json!([{"lease_id": short["lease_id"], "key_id": "key-a", "provider": "openai",
                         "pool": "default", "fence": null, "outcome": "failure",
                         "usage_tokens": null}]);
    let policy = policy();
    let mut first = app.db.begin().await.unwrap();
    let counted: Vec<bool> = sqlx::query_scalar("SELECT counted FROM credpool_release($1, $2)")
        .bind(&report)
        .bind(&policy)
        .fetch_all(&mut *first)
        .await
        .unwrap();
    assert_eq!(counted, [true]);
    let second = {
        let (db, report, policy) = (app.db.clone(), report.clone(), policy.clone());
        tokio::spawn(async move {
            sqlx::query_scalar::<_, bool>("SELECT counted FROM credpool_release($1, $2)")
                .bind(report)
                .bind(policy)
                .fetch_all(&db)
                .await
        })
    };
    wait_for_lock_waiters(&app, 1).await;
    first.commit().await.unwrap();
    let counted = second.await.unwrap().unwrap();
    assert_eq!(counted, [false], "the retry counted again");
    let reports: i64 = app
        .scalar("SELECT count(*) FROM lease_events WHERE event = 'outcome_after_expiry'")
        .await;
    assert_eq!(reports, 1);
}

#[tokio::test]
async fn an_upgrade_keeps_the_trail_before_partitions_whole_and_its_ids_go_on() {
    // A database of the release before partitions, with a lease's history: after the upgrade
    // the old rows are in the trail (the partition `lease_events_before`), new rows get larger
    // event ids, the lease still releases, and retention deletes its old rows in batches until
    // the whole partition is past retention.
    let (database, pool) = TestDatabase::create_at(20261204000020).await;
    sqlx::raw_sql(
        "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at)
         VALUES ('granted', '0190aaaa-0000-7000-8000-000000000002', 'gone', 'openai', 'default', 0,
                 now() - interval '40 days', now() - interval '40 days' - interval '1 minute'),
                ('released', '0190aaaa-0000-7000-8000-000000000002', 'gone', 'openai', 'default', 0,
                 now() - interval '40 days', now() - interval '40 days'),
                ('granted', '0190aaaa-0000-7000-8000-000000000003', 'gone', 'openai', 'default', 0,
                 now() + interval '1 minute', now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let last_id: i64 = pool.scalar("SELECT max(event_id) FROM lease_events").await;
    credpool::store::migrate(&pool).await.expect("the upgrade");
    pool.close().await;

    let app = TestApp::spawn_on(database, AppOptions::default()).await;
    assert_eq!(trail_rows(&app.db).await, 3);
    let days = days(&app.db).await;
    assert_eq!(days[0].0, "lease_events_before");
    assert_eq!(days[0].1, None);
    app.put_gpt4o_key("key-a", "default", 1).await;
    let new = app.lease(gpt4o_for(600)).await;
    let id: i64 = app
        .scalar_of(
            "SELECT event_id FROM lease_events WHERE lease_id = $1::text::uuid",
            new["lease_id"].as_str(),
        )
        .await;
    assert!(id > last_id, "event id {id} after {last_id}");
    let purged: i32 = app
        .scalar("SELECT credpool_purge_audit('30 days', 1000)")
        .await;
    assert_eq!(purged, 2, "the finished lease's rows 40 days old");
    assert_eq!(trail_rows(&app.db).await, 2);
    // the trail stays append-only
    let update = sqlx::query("UPDATE lease_events SET holder = 'x'")
        .execute(&app.db)
        .await;
    assert!(update.is_err(), "an update of the trail was accepted");
}

#[tokio::test]
async fn retention_never_drops_a_day_the_continuous_proof_has_not_proven() {
    // The continuous proof has judged the trail up to about now; rows dated three days ahead
    // (written by hand) are not proven yet. Forty days on (the clock given) retention has passed
    // every day, but only a proof that has judged a day lets it go: nothing is dropped while the
    // proof stands where it is, and, with no continuous proof at all, every day is.
    let app = TestApp::with_credential("key-a", 2).await;
    let held = app.lease(gpt4o_for(600)).await;
    app.release(release_body(&held, "success")).ok_json().await;
    finished_lease_days_ahead(&app.db, "0190aaaa-0000-7000-8000-000000000004").await;
    app.run_sql("SELECT * FROM credpool_audit_advance('continuous', 1000)")
        .await;
    let proven: OffsetDateTime = app
        .scalar("SELECT min(proven_until) FROM audit_checkpoints WHERE run = 'continuous'")
        .await;
    let now: OffsetDateTime = app.scalar("SELECT now()").await;
    assert!(proven <= now, "the proof is past the clock: {proven}");
    let rows = trail_rows(&app.db).await;
    let forty_days_on = "SELECT credpool_drop_trail_days('30 days', now() + interval '40 days')";
    let dropped: i32 = sqlx::query_scalar(forty_days_on)
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(dropped, 0, "a day the proof has not judged was dropped");
    assert_eq!(trail_rows(&app.db).await, rows);

    app.run_sql("DELETE FROM audit_checkpoints WHERE run = 'continuous'")
        .await;
    let dropped: i32 = sqlx::query_scalar(forty_days_on)
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert!(dropped > 0);
    assert_eq!(trail_rows(&app.db).await, 0);
}
