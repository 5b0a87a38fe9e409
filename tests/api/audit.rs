//! Audit in SQL and the cleanup functions: reaping, recorded recoveries, retention, lease
//! lifetimes, the oversell proof (`credpool audit verify`), the in-process scheduler, and pg_cron
//! actually running the cleanup in a cluster that preloads it.

use std::time::Duration;

use credpool::embedded::EmbeddedCluster;
use credpool::store::maintenance::{self, Skipped};
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::Connection;

use credpool_test_support::*;

use crate::BIN;

async fn lease(app: &TestApp, seconds: u32) -> Value {
    let body = json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": seconds, "holder": "auditor"});
    json_body(app.allocate(body).await, StatusCode::OK).await
}

async fn scalar_i32(app: &TestApp, sql: &'static str) -> i32 {
    sqlx::query_scalar(sql).fetch_one(&app.db).await.unwrap()
}

#[tokio::test]
async fn the_reaper_ends_expired_leases_in_the_trail_in_bounded_batches_and_is_idempotent() {
    let app = TestApp::spawn().await;
    app.put_key("key-a", "openai", "default", &["gpt-4o"], 4)
        .await;
    let leases = [
        lease(&app, 1).await,
        lease(&app, 1).await,
        lease(&app, 1).await,
    ];
    let live = lease(&app, 600).await.to_string();
    assert!(live.contains("lease_id"));
    assert_eq!(
        scalar_i32(&app, "SELECT credpool_reap_expired_leases(10)").await,
        0
    );
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    assert_eq!(
        scalar_i32(&app, "SELECT credpool_reap_expired_leases(2)").await,
        2
    );
    assert_eq!(
        scalar_i32(&app, "SELECT credpool_reap_expired_leases(2)").await,
        1
    );
    assert_eq!(
        scalar_i32(&app, "SELECT credpool_reap_expired_leases(2)").await,
        0
    );
    for l in &leases {
        assert_eq!(
            app.events(l["lease_id"].as_str().unwrap()).await,
            ["granted", "expired"]
        );
    }
    let active: i64 = sqlx::query_scalar("SELECT count(*) FROM active_leases")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(active, 1);
}

#[tokio::test]
async fn ended_cooldowns_are_recorded_once_and_the_status_waits_for_the_probe() {
    let app = TestApp::spawn().await;
    app.put_key("key-a", "openai", "default", &["gpt-4o"], 1)
        .await;
    app.set_status("key-a", "cooldown", Some(0.5)).await;
    assert_eq!(
        scalar_i32(&app, "SELECT credpool_recover_cooldowns()").await,
        0
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        scalar_i32(&app, "SELECT credpool_recover_cooldowns()").await,
        1
    );
    assert_eq!(
        scalar_i32(&app, "SELECT credpool_recover_cooldowns()").await,
        0
    );
    let status: String = sqlx::query_scalar("SELECT status FROM credentials")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(status, "cooldown");
    // usable: the next lease is the probe
    assert_eq!(lease(&app, 60).await["probe"], true);
}

#[tokio::test]
async fn purging_deletes_history_past_retention_but_never_that_of_a_held_lease() {
    let app = TestApp::spawn().await;
    app.put_key("key-a", "openai", "default", &["gpt-4o"], 1)
        .await;
    let held = lease(&app, 600).await;
    // old history: a finished lease 40 days ago, and an old row of the lease still held
    sqlx::query(
        "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at)
         VALUES ('granted', gen_random_uuid(), 'key-a', 'openai', 'default', 0, now() - interval '40 days', now() - interval '40 days' - interval '1 minute'),
                ('renewed', $1::text::uuid, 'key-a', 'openai', 'default', 0, now() + interval '1 hour', now() - interval '40 days')",
    )
    .bind(held["lease_id"].as_str())
    .execute(&app.db)
    .await
    .unwrap();
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM lease_events")
        .fetch_one(&app.db)
        .await
        .unwrap();
    let purged = scalar_i32(
        &app,
        "SELECT credpool_purge_audit(interval '30 days', 1000)",
    )
    .await;
    assert_eq!(purged, 1);
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM lease_events")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(after, before - 1);
    assert_eq!(
        scalar_i32(
            &app,
            "SELECT credpool_purge_audit(interval '30 days', 1000)"
        )
        .await,
        0
    );
}

/// (lease_id, ended_by, outcome, renewals, holder)
type LifetimeRow = (String, Option<String>, Option<String>, i64, Option<String>);

#[tokio::test]
async fn lease_lifetimes_are_rebuilt_from_the_trail_with_how_each_ended() {
    let app = TestApp::spawn().await;
    app.put_key("key-a", "openai", "default", &["gpt-4o"], 4)
        .await;
    let released = lease(&app, 600).await;
    let mut renew = release_body(&released, "success");
    renew.as_object_mut().unwrap().remove("outcome");
    json_body(app.renew(renew).await, StatusCode::OK).await;
    json_body(
        app.release(release_body(&released, "failure")).await,
        StatusCode::OK,
    )
    .await;
    let expired = lease(&app, 1).await;
    let forced = lease(&app, 600).await;
    let held = lease(&app, 600).await;
    sqlx::query("SELECT credpool_reap_expired_leases()")
        .execute(&app.db)
        .await
        .unwrap();
    let response = app
        .client
        .post(app.url(&format!(
            "/api/admin/leases/{}/release",
            forced["lease_id"].as_str().unwrap()
        )))
        .header("x-admin-key", ADMIN_KEY)
        .json(&json!({"reason": "test"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    let rows: Vec<LifetimeRow> = sqlx::query_as(
        "SELECT lease_id, ended_by, outcome, renewals, holder
         FROM credpool_lease_lifetimes(now() - interval '1 hour', now(), 'key-a')",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    let ended = |l: &Value| {
        rows.iter()
            .find(|r| r.0 == l["lease_id"].as_str().unwrap())
            .map(|r| (r.1.clone(), r.2.clone(), r.3))
            .unwrap()
    };
    assert_eq!(
        ended(&released),
        (Some("released".into()), Some("failure".into()), 1)
    );
    assert_eq!(ended(&expired).0.as_deref(), Some("expired"));
    assert_eq!(ended(&forced).0.as_deref(), Some("force_released"));
    assert_eq!(ended(&held).0, None);
    assert!(rows.iter().all(|r| r.4.as_deref() == Some("auditor")));

    let utilization: Vec<(String, f64)> = sqlx::query_as(
        "SELECT key_id, utilization::float8 FROM credpool_utilization(now() - interval '1 hour', now())",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    assert!(
        utilization.iter().any(|(k, u)| k == "key-a" && *u > 0.0),
        "{utilization:?}"
    );
}

#[tokio::test]
async fn audit_verify_passes_on_real_traffic_and_fails_on_a_fabricated_oversell() {
    let app = TestApp::spawn().await;
    app.put_key("solo", "openai", "default", &["gpt-4o"], 1)
        .await;
    for _ in 0..3 {
        let l = lease(&app, 600).await;
        json_body(
            app.release(release_body(&l, "success")).await,
            StatusCode::OK,
        )
        .await;
    }
    let (ok, output) = audit_verify(BIN, &app.database).await;
    assert!(ok, "{output}");
    assert!(
        output.contains("no grant ever exceeded a limit"),
        "{output}"
    );

    // two hours ago, a second lease on the limit-1 credential while the first was held: written
    // straight into the trail, as a bug in the claim would have
    sqlx::query(
        "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at)
         VALUES ('granted', gen_random_uuid(), 'solo', 'openai', 'default', 0, now() - interval '110 minutes', now() - interval '120 minutes'),
                ('granted', gen_random_uuid(), 'solo', 'openai', 'default', 0, now() - interval '110 minutes', now() - interval '115 minutes')",
    )
    .execute(&app.db)
    .await
    .unwrap();
    let (ok, output) = audit_verify(BIN, &app.database).await;
    assert!(!ok, "{output}");
    assert!(
        output.contains("solo") && output.contains("1 grants exceeded a limit"),
        "{output}"
    );
}

#[tokio::test]
async fn lowering_a_limit_under_load_is_not_an_oversell_but_a_grant_above_it_is() {
    let app = TestApp::spawn().await;
    app.put_key("shrink", "openai", "default", &["gpt-4o"], 3)
        .await;
    let leases = [
        lease(&app, 600).await,
        lease(&app, 600).await,
        lease(&app, 600).await,
    ];
    app.put_key("shrink", "openai", "default", &["gpt-4o"], 1)
        .await;
    let (ok, output) = audit_verify(BIN, &app.database).await;
    assert!(
        ok,
        "three leases held under a lowered limit revoke nothing and are no oversell: {output}"
    );
    for l in &leases {
        json_body(
            app.release(release_body(l, "success")).await,
            StatusCode::OK,
        )
        .await;
    }
    lease(&app, 600).await;
    let (ok, output) = audit_verify(BIN, &app.database).await;
    assert!(ok, "{output}");
}

#[tokio::test]
async fn a_limit_lowered_while_a_claim_commits_judges_that_grant_by_the_limit_it_was_admitted_under()
 {
    // A change of limit takes effect once its transaction holds the credential's slot rows; a
    // grant committed while it waited for them was admitted under the old limit, and the trail
    // dates the change after it (its audit row is written at clock_timestamp(), after the locks).
    let app = TestApp::spawn().await;
    app.put_key("busy", "openai", "default", &["gpt-4o"], 3)
        .await;
    lease(&app, 600).await;
    lease(&app, 600).await;
    // a transaction holds slot 0: the change queues behind it, after its own transaction began
    let mut holder = app.db.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM lease_slots WHERE key_id = 'busy' AND slot = 0 FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let change = tokio::spawn(
        app.client
            .patch(app.url("/api/admin/keys/busy"))
            .header("x-admin-key", ADMIN_KEY)
            .json(&json!({"max_concurrent_uses": 2}))
            .send(),
    );
    // the change queues behind the held transaction
    crate::lease_state::wait_for_lock_waiters(&app, 1).await;
    // meanwhile a third lease, within the limit of 3 (slot 2 is not locked yet)
    lease(&app, 600).await;
    holder.commit().await.unwrap();
    json_body(change.await.unwrap().unwrap(), StatusCode::OK).await;
    let (ok, output) = audit_verify(BIN, &app.database).await;
    assert!(
        ok,
        "a grant admitted before the lowered limit took effect was judged by it: {output}"
    );
}

#[tokio::test]
async fn the_in_process_scheduler_runs_on_one_replica_and_steps_aside_for_pg_cron() {
    let app = TestApp::spawn().await;
    app.put_key("key-a", "openai", "default", &["gpt-4o"], 2)
        .await;
    lease(&app, 1).await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let retention = Duration::from_secs(30 * 86_400);

    // another replica is running this tick's first step (the reaper) right now
    let mut other = sqlx::PgConnection::connect_with(&app.database.options)
        .await
        .unwrap();
    let mut tx = other.begin().await.unwrap();
    // the lock of that step (credpool_maintenance_step)
    let locked: bool = sqlx::query_scalar(
        "SELECT pg_try_advisory_xact_lock(hashtextextended('credpool.maintenance:expired_leases_reaped', 0))",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert!(locked);
    assert_eq!(
        maintenance::run_pass(&app.db, retention).await.unwrap(),
        Err(Skipped::OtherReplica)
    );
    tx.rollback().await.unwrap();

    let report = maintenance::run_pass(&app.db, retention)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.expired_leases_reaped, 1);

    sqlx::query("INSERT INTO maintenance_schedule (scheduler) VALUES ('pg_cron')")
        .execute(&app.db)
        .await
        .unwrap();
    assert_eq!(
        maintenance::run_pass(&app.db, retention).await.unwrap(),
        Err(Skipped::PgCron)
    );
}

#[tokio::test]
async fn pg_cron_runs_the_cleanup_in_a_cluster_that_preloads_it() {
    if std::env::var_os("CREDPOOL_TEST_SKIP_PG_CRON").is_some() {
        report_skipped("CREDPOOL_TEST_SKIP_PG_CRON is set");
        return;
    }
    let bin = credpool::embedded::find_binaries(None).expect("PostgreSQL server binaries");
    assert!(
        bin.join("../lib/pg_cron.so").is_file(),
        "pg_cron is not installed next to {} (Debian: apt-get install postgresql-15-cron); \
         set CREDPOOL_TEST_SKIP_PG_CRON=1 to skip this test",
        bin.display()
    );
    let dir = tempfile::Builder::new()
        .prefix("credpool-cron-")
        .tempdir_in("/tmp")
        .unwrap();
    let cluster = EmbeddedCluster::start(dir.path(), None).await.unwrap();
    assert!(cluster.has_pg_cron());
    let options = cluster.connect_options();
    let db = sqlx::PgPool::connect_with(options.clone()).await.unwrap();
    credpool::store::migrate(&db).await.unwrap();
    let jobs = maintenance::install_cron(&db, &options, Duration::from_secs(30 * 86_400))
        .await
        .unwrap();
    assert_eq!(jobs.len(), 1);
    // installing again replaces, never duplicates
    maintenance::install_cron(&db, &options, Duration::from_secs(30 * 86_400))
        .await
        .unwrap();
    let scheduled: i64 =
        sqlx::query_scalar("SELECT count(*) FROM cron.job WHERE jobname LIKE 'credpool:%'")
            .fetch_one(&db)
            .await
            .unwrap();
    assert_eq!(scheduled, 1);

    // an expired lease, as a crashed executor leaves it
    sqlx::raw_sql(
        "INSERT INTO credentials (key_id, provider, pool, models, max_concurrent_uses, secret)
         VALUES ('cron-key', 'openai', 'default', ARRAY['gpt-4o'], 1, '{}');
         SELECT credpool_fit_slots('cron-key');
         UPDATE lease_slots SET lease_id = gen_random_uuid(), provider = 'openai', pool = 'default',
                granted_at = now() - interval '2 minutes', lease_until = now() - interval '1 minute',
                fence = nextval('lease_fence_seq')
         WHERE key_id = 'cron-key';
         INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at)
         SELECT 'granted', lease_id, key_id, provider, pool, slot, lease_until, granted_at FROM lease_slots;",
    )
    .execute(&db)
    .await
    .unwrap();

    // pg_cron schedules by the minute: wait for a tick (at most a little over two minutes)
    let mut reaped = false;
    for _ in 0..75 {
        let expired: i64 =
            sqlx::query_scalar("SELECT count(*) FROM lease_events WHERE event = 'expired'")
                .fetch_one(&db)
                .await
                .unwrap();
        if expired == 1 {
            reaped = true;
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let runs: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT status, return_message FROM cron.job_run_details ORDER BY runid")
            .fetch_all(&db)
            .await
            .unwrap();
    assert!(
        reaped,
        "pg_cron did not reap the expired lease; runs: {runs:?}"
    );
    assert!(
        runs.iter().any(|(status, _)| status == "succeeded"),
        "{runs:?}"
    );
    let free: i64 = sqlx::query_scalar("SELECT count(*) FROM lease_slots WHERE lease_id IS NULL")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(free, 1);
    db.close().await;
    cluster.stop().await;
}
