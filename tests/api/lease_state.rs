//! The lease-state transitions under the races they must survive, each window widened on purpose:
//! transactions stepped by hand on separate connections, or paused inside the SQL functions at a
//! test hook (`credpool_test_hook`, which waits for an advisory lock the test holds). Each of these
//! failed before the lease state was defined once (sql/): deadlocks between release
//! groups across pools and between an import and a release, a request_id claim waiting for a
//! refit, a grant over a lowered limit, a claim waiting for a row lock. Plus: the claim reads
//! only its candidates whatever the planner's statistics, and a database migrated by the previous
//! release upgrades cleanly.

use std::time::Duration;

use credpool::store::{self, Db};
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::{Executor, PgConnection, Row};

use credpool_test_support::*;

use crate::BIN;
use crate::common::{claim_body, import_specs};

#[tokio::test]
async fn health_changes_in_two_pools_in_opposite_orders_never_wait_for_each_other() {
    // A release group writes the health of every credential its outcomes changed, in one
    // statement; with a version row per pool, two groups whose credentials interleave across two
    // pools took those rows in opposite orders and deadlocked (a rate-limit storm did it).
    let app = TestApp::spawn().await;
    for (key, pool) in [("a1", "pa"), ("a2", "pa"), ("b1", "pb"), ("b2", "pb")] {
        app.put_gpt4o_key(key, pool, 4).await;
    }
    let before = deadlocks(&app.db).await;
    let rest = "UPDATE credentials SET status = 'rate_limited',
                    cooldown_until = now() + interval '1 second' WHERE key_id = $1";
    let mut first = connect(&app).await;
    let mut second = connect(&app).await;
    for conn in [&mut first, &mut second] {
        conn.execute("SET lock_timeout = '2s'").await.unwrap();
        conn.execute("BEGIN").await.unwrap();
    }
    sqlx::query(rest)
        .bind("a1")
        .execute(&mut first)
        .await
        .unwrap();
    sqlx::query(rest)
        .bind("b2")
        .execute(&mut second)
        .await
        .unwrap();
    let crossing = tokio::spawn(async move {
        sqlx::query(rest).bind("b1").execute(&mut first).await?;
        first.execute("COMMIT").await?;
        Ok::<_, sqlx::Error>(())
    });
    sqlx::query(rest)
        .bind("a2")
        .execute(&mut second)
        .await
        .expect("the second writer waited for the first one's pool version");
    second.execute("COMMIT").await.unwrap();
    crossing
        .await
        .unwrap()
        .expect("the first writer waited for the second one's pool version");
    assert_eq!(deadlocks(&app.db).await, before);
    // both pools moved on: the versions tell every view
    let versions: Vec<(String, i64)> = sqlx::query_as(
        "SELECT pool, credpool_pool_version('openai', pool) FROM (VALUES ('pa'), ('pb')) p (pool)",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    for (pool, version) in versions {
        assert!(
            version >= 4,
            "{pool}: version {version} after 2 creations and 2 changes"
        );
    }
}

#[tokio::test]
async fn an_import_and_a_release_group_never_deadlock() {
    // The import below waits for a slot of `ky` that the test holds. Before, it held `kx`'s
    // credential row and its pool's version row while waiting, and a release on `ky` reporting a
    // rate limit waited for that version row: once the test let go, the import wanted the
    // release's slot and the two deadlocked. Now an import takes every slot row before any
    // credential row, and pool versions are never waited for. The release group also carries a
    // late report of a lease of `kx`, which counts for kx's health: holding ky's slot, the group
    // takes kx's credential row, which an import that locked one credential after the other
    // would hold while it waits for ky's slots.
    let app = TestApp::with_credential("kx", 2).await;
    let late = app.lease(gpt4o_in_for("default", 600)).await;
    app.run_sql_with(
        "UPDATE lease_slots SET granted_at = now() - interval '2 seconds',
             lease_until = now() - interval '1 second' WHERE lease_id = $1::uuid",
        late["lease_id"].as_str().unwrap(),
    )
    .await;
    let reaped: i32 = app.scalar("SELECT credpool_reap_expired_leases()").await;
    assert_eq!(reaped, 1, "kx's lease left its slot");
    app.put_gpt4o_key("ky", "default", 2).await;
    // both of ky's slots leased; the one in slot 1 is released below
    app.run_sql("UPDATE credentials SET status = 'disabled' WHERE key_id = 'kx'")
        .await;
    let mut by_slot = std::collections::HashMap::new();
    for _ in 0..2 {
        let leased = app.lease(gpt4o_in_for("default", 600)).await;
        let slot: i32 = app
            .scalar_of(
                "SELECT slot FROM lease_slots WHERE lease_id = $1::uuid",
                leased["lease_id"].as_str().unwrap(),
            )
            .await;
        by_slot.insert(slot, leased);
    }
    let released = by_slot.remove(&1).expect("a lease in slot 1");
    let held = 0;
    let before = deadlocks(&app.db).await;

    let mut blocker = transaction_holding_with(
        &app,
        &["SELECT 1 FROM lease_slots WHERE key_id = 'ky' AND slot = $1 FOR UPDATE"],
        held,
    )
    .await;

    let import_db = Db::direct(app.database.pool(2).await);
    let specs = import_specs(&[("kx", "openai"), ("ky", "openai")], 2);
    let actor = credpool::store::credentials::Actor::parse("test").unwrap();
    let import =
        tokio::spawn(async move { store::credentials::import(&import_db, &specs, &actor).await });
    // the import waits for the slot the test holds: the race this test is for (an import
    // that never waits has nothing to deadlock with, and must fail the test, not pass it)
    wait_for_lock_waiters(&app, 1).await;

    // the release group, as the service runs it
    let group = json!([
        group_release(&late, "rate_limited"),
        group_release(&released, "rate_limited")
    ]);
    let releasing = sqlx::query_scalar::<_, String>(
        "SELECT verdict FROM credpool_release($1, $2) ORDER BY release",
    )
    .bind(group)
    .bind(policy())
    .fetch_all(&app.db);
    let verdicts = tokio::time::timeout(Duration::from_secs(20), releasing)
        .await
        .expect("the release group hung")
        .expect("the release group failed");
    assert_eq!(verdicts, ["not_found", "released"]);
    let late_reports: i64 = app
        .scalar("SELECT count(*) FROM lease_events WHERE event = 'outcome_after_expiry'")
        .await;
    assert_eq!(late_reports, 1, "the late report was not recorded");
    blocker.execute("COMMIT").await.unwrap();
    let (created, updated) = import.await.unwrap().expect("the import failed");
    assert_eq!((created, updated), (0, 2));
    // the service's connections close, so their backends report what they saw
    let mut app = app;
    app.stop();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(deadlocks(&app.db).await, before);
}

#[tokio::test]
async fn an_import_and_a_release_group_across_providers_lock_in_one_order() {
    // Slot rows are locked provider by provider (on Citus a statement that locks rows names one
    // provider), so the order is (provider, key_id, slot) everywhere. Here the key ids sort one
    // way (k1 < k9) and their providers the other (zeta > alpha). The import locks alpha's k9
    // (waiting for the test's lock on it), then would take zeta's k1; the release group of a
    // lease on each arrives second. In key order it would take k1 first and wait for k9 behind
    // the import, which, once it has k9, waits for k1: a deadlock. In the one order it waits for
    // k9 first, holding nothing.
    let app = TestApp::spawn().await;
    app.put_key("k1", "zeta", "default", &["gpt-4o"], 1).await;
    app.put_key("k9", "alpha", "default", &["gpt-4o"], 1).await;
    let on_k1 = app
        .lease(json!({"provider": "zeta", "model": "gpt-4o"}))
        .await;
    let on_k9 = app
        .lease(json!({"provider": "alpha", "model": "gpt-4o"}))
        .await;
    let before = deadlocks(&app.db).await;
    let mut blocker = transaction_holding_with(
        &app,
        &["SELECT 1 FROM lease_slots WHERE key_id = 'k9' AND slot = $1 FOR UPDATE"],
        0,
    )
    .await;

    let import_db = Db::direct(app.database.pool(2).await);
    let specs = import_specs(&[("k1", "zeta"), ("k9", "alpha")], 1);
    let actor = credpool::store::credentials::Actor::parse("test").unwrap();
    let import =
        tokio::spawn(async move { store::credentials::import(&import_db, &specs, &actor).await });
    wait_for_lock_waiters(&app, 1).await;

    let group = json!([
        group_release(&on_k1, "success"),
        group_release(&on_k9, "success")
    ]);
    let release_db = app.database.pool(1).await;
    let releasing = tokio::spawn(async move {
        sqlx::query_scalar::<_, String>(
            "SELECT verdict FROM credpool_release($1, $2) ORDER BY release",
        )
        .bind(group)
        .bind(policy())
        .fetch_all(&release_db)
        .await
    });
    wait_for_lock_waiters(&app, 2).await;
    blocker.execute("COMMIT").await.unwrap();

    let (created, updated) = tokio::time::timeout(Duration::from_secs(20), import)
        .await
        .expect("the import hung")
        .unwrap()
        .expect("the import failed");
    assert_eq!((created, updated), (0, 2));
    let verdicts = tokio::time::timeout(Duration::from_secs(20), releasing)
        .await
        .expect("the release group hung")
        .unwrap()
        .expect("the release group failed");
    assert_eq!(verdicts, ["released", "released"]);
    let mut app = app;
    app.stop();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(deadlocks(&app.db).await, before);
}

/// Makes credential `key_id` one that refreshes by OAuth (an `oauth_credentials` row, whose token
/// endpoint is never called here): what makes a release lock it whole on an `auth_expired` report.
async fn oauth_refreshed(app: &TestApp, key_id: &str) {
    app.run_sql_with(
        "INSERT INTO oauth_credentials (key_id, provider, token_url, client_id, refresh_ciphertext)
         SELECT $1, provider, 'http://127.0.0.1:9/token', 'client', '\\x00'
         FROM credentials WHERE key_id = $1",
        key_id,
    )
    .await;
}

/// Release group `group` (each lease, as allocate answered it, with the outcome it reports) run
/// as the service runs it beside another transaction of the test's own, which has run each of
/// `other`'s statements (`$1`: the lease id of its lease) and holds what they locked; once the
/// group waits, the other transaction takes `lock` (a row the group may be holding) and commits.
/// Panics if the group hangs or fails, or if the other transaction cannot take `lock` (`what`:
/// that lock) or commit: the group's verdicts, in order.
async fn release_group_beside(
    app: &TestApp,
    other: (&Value, &[&'static str]),
    group: &[(&Value, &str)],
    lock: &'static str,
    what: &str,
) -> Vec<String> {
    let (held, statements) = other;
    let mut other =
        transaction_holding_with(app, statements, held["lease_id"].as_str().unwrap()).await;
    let group: Vec<Value> = group
        .iter()
        .map(|(lease, outcome)| group_release(lease, outcome))
        .collect();
    let releasing = release_group_waiting(app, json!(group)).await;
    let locked = sqlx::query(lock).execute(&mut other).await;
    let committed = other.execute("COMMIT").await;
    let verdicts = tokio::time::timeout(Duration::from_secs(20), releasing)
        .await
        .expect("the release group hung")
        .unwrap();
    locked.unwrap_or_else(|e| panic!("{what} failed: {e}"));
    committed.unwrap();
    verdicts.expect("the release group failed")
}

#[tokio::test]
async fn a_release_group_with_an_auth_expired_report_and_a_late_report_never_deadlocks() {
    // Release group G reports `auth_expired` on a live lease of `k` and, late, an outcome for an
    // expired lease of `k` that another group (stepped by hand here, in the lock order: its late
    // report's lease lock and trail row, then the credential row) reported first. Before, G
    // locked every row of `k` up front, the credential row included (credpool_lock_credentials),
    // and then waited for the other group's late report, while that group waited for the
    // credential row: a deadlock. Now G takes the credential rows after its late reports' lease
    // locks, like every release.
    let app = TestApp::with_credential("k", 2).await;
    // k refreshes by OAuth: an `auth_expired` report of its lease locks the whole credential
    oauth_refreshed(&app, "k").await;
    let live = app.lease(gpt4o_in_for("default", 600)).await;
    let short = app
        .lease(
            json!({"provider": "openai", "model": "gpt-4o", "pool": "default", "lease_seconds": 1}),
        )
        .await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let reaped: i32 = app.scalar("SELECT credpool_reap_expired_leases()").await;
    assert_eq!(reaped, 1, "the short lease left its slot");
    let before = deadlocks(&app.db).await;

    // the other group: its late report's lease lock and trail row (credpool_release_late); G
    // waits for that lease lock; the other group goes on, in the lock order: the credential row
    // of its outcome
    let other = [
        "SELECT pg_advisory_xact_lock(hashtextextended('credpool.lease:' || $1::text::uuid, 0))",
        "INSERT INTO lease_events
             (event, lease_id, key_id, provider, pool, slot, holder, outcome, lease_until, at, tenant)
         SELECT 'outcome_after_expiry', lease_id, key_id, provider, pool, slot, holder, 'failure',
                lease_until, clock_timestamp(), tenant
         FROM lease_events WHERE lease_id = $1::text::uuid AND event = 'granted'",
    ];
    let verdicts = release_group_beside(
        &app,
        (&short, &other),
        &[(&live, "auth_expired"), (&short, "failure")],
        "SELECT 1 FROM credentials WHERE key_id = 'k' FOR NO KEY UPDATE",
        "the other group's lock of the credential row",
    )
    .await;
    // the late report counted once, the other group's
    assert_eq!(verdicts, ["released", "not_found"]);
    assert_eq!(app.in_flight("k").await, 0);
    assert_eq!(deadlocks(&app.db).await, before, "a deadlock was detected");
}

#[tokio::test]
async fn a_release_group_with_an_auth_expired_report_locks_the_other_leases_slots_in_key_order() {
    // Release group G reports `auth_expired` on a lease of `kb` and `success` on a lease of `ka`.
    // Another transaction (a release or renewal group of both, in key order) holds ka's slot
    // and then wants a slot row of kb. Before, G locked every slot row of kb first and then
    // waited for ka's: a deadlock. Now G takes ka's slot row in the same ordered statement as
    // kb's, so it waits there holding nothing of kb.
    let app = TestApp::spawn().await;
    app.put_gpt4o_key("ka", "a", 2).await;
    app.put_gpt4o_key("kb", "b", 2).await;
    // kb refreshes by OAuth: an `auth_expired` report of its lease locks the whole credential
    oauth_refreshed(&app, "kb").await;
    let on_a = app.lease(gpt4o_in_for("a", 600)).await;
    let on_b = app.lease(gpt4o_in_for("b", 600)).await;
    let before = deadlocks(&app.db).await;

    // the other transaction holds ka's slot, then goes on in key order: a slot row of kb
    let verdicts = release_group_beside(
        &app,
        (
            &on_a,
            &["SELECT 1 FROM lease_slots WHERE lease_id = $1::text::uuid FOR UPDATE"],
        ),
        &[(&on_b, "auth_expired"), (&on_a, "success")],
        "SELECT 1 FROM lease_slots WHERE key_id = 'kb' AND slot = 1 FOR UPDATE",
        "the other transaction's lock of kb's slot row",
    )
    .await;
    assert_eq!(verdicts, ["released", "released"]);
    assert_eq!(deadlocks(&app.db).await, before, "a deadlock was detected");
}

#[tokio::test]
async fn a_claim_for_a_request_id_whose_lease_expired_does_not_wait_for_a_refit() {
    // A claim transaction that holds one slot of a credential, then claims for a request_id
    // whose earlier lease expired in another slot of it, while a refit of the credential holds
    // that other slot and waits for the first: before, the claim cleared the request_id with a
    // plain UPDATE of that slot and the two deadlocked. Now request ids live in their own table
    // and the claim writes no slot it did not claim.
    let app = TestApp::with_credential("kb", 4).await;
    let mut leases = Vec::new();
    for i in 0..4 {
        let response = app
            .allocate(json!({
                "provider": "openai", "model": "gpt-4o", "lease_seconds": 600,
                "request_id": if i == 1 { Some("req-expired") } else { None },
            }))
            .await;
        leases.push(json_body(response, StatusCode::OK).await);
    }
    let mut slots = Vec::new();
    for lease in &leases {
        let slot: i32 = app
            .scalar_of(
                "SELECT slot FROM lease_slots WHERE lease_id = $1::uuid",
                lease["lease_id"].as_str().unwrap(),
            )
            .await;
        slots.push(slot);
    }
    let expired_slot = slots[1];
    // the request's lease runs out; the highest slot of the others is released (free)
    app.run_sql_with(
        "UPDATE lease_slots SET granted_at = now() - interval '2 seconds',
             lease_until = now() - interval '1 second'
         WHERE lease_id = $1::uuid",
        leases[1]["lease_id"].as_str().unwrap(),
    )
    .await;
    let (freed_at, free_slot) = slots
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 1)
        .map(|(i, slot)| (i, *slot))
        .max_by_key(|(_, slot)| *slot)
        .unwrap();
    assert!(
        free_slot > expired_slot,
        "slots were not handed out in order: {slots:?}"
    );
    let freed = leases[freed_at].clone();
    app.release_ok(&freed, "success").await;

    // the claim group takes the free slot while the expired one is held by somebody else
    let mut holder = transaction_holding_with(
        &app,
        &["SELECT 1 FROM lease_slots WHERE key_id = 'kb' AND slot = $1 FOR UPDATE"],
        expired_slot,
    )
    .await;
    let mut group = connect(&app).await;
    group.execute("SET lock_timeout = '3s'").await.unwrap();
    group.execute("BEGIN").await.unwrap();
    let taken: Option<i64> = sqlx::query_scalar("SELECT fence FROM credpool_claim($1)")
        .bind(claim_body(&["kb"], "default", None))
        .fetch_one(&mut group)
        .await
        .unwrap();
    assert!(
        taken.is_some(),
        "the group's first claim found no free slot"
    );
    holder.execute("COMMIT").await.unwrap();

    // a refit locks kb's slots in order: it gets the expired one and waits for the group's
    let refit = &["SELECT credpool_fit_slots('kb')"];
    let refitting = transaction_waiting(&app, connect(&app).await, refit, true).await;

    // the group's next claim is for the request whose lease expired in the refit's slot
    let row = sqlx::query("SELECT fence, request FROM credpool_claim($1)")
        .bind(claim_body(&["kb"], "default", Some("req-expired")))
        .fetch_one(&mut group)
        .await
        .expect("the request_id claim waited for the refit");
    // not replayed; nothing granted while the refit holds the slot, which read now is free: the
    // caller is told to claim again
    let request: Option<String> = row.get("request");
    assert_eq!(
        request.as_deref(),
        Some("busy"),
        "the expired lease was replayed"
    );
    group.execute("COMMIT").await.unwrap();
    refitting.await.unwrap().expect("the refit failed");
}

#[tokio::test]
async fn a_claim_that_read_before_a_limit_was_lowered_grants_nothing_over_it() {
    // The refit of a lowered limit decides while a lease is still live (so the credential is
    // over its limit) and is held before it commits; the lease then runs out; a claim reads its
    // snapshot before the refit commits and locks the slot after. Before, "over limit" was on
    // the credential row, which the claim read from its stale snapshot, and it granted over the
    // new limit. Now it is on the slot row the claim locks.
    let app = TestApp::with_credential("kl", 3).await;
    let short = app.lease(gpt4o_in_for("default", 600)).await;
    app.lease(gpt4o_in_for("default", 600)).await;
    app.lease(gpt4o_in_for("default", 600)).await;
    app.run_sql_with(
        "UPDATE lease_slots SET lease_until = clock_timestamp() + interval '1500 milliseconds'
         WHERE lease_id = $1::uuid",
        short["lease_id"].as_str().unwrap(),
    )
    .await;

    let fit_hook = Hook::close(&app, "fit.done").await;
    let claim_hook = Hook::close(&app, "claim.before_lock").await;
    let refit = &[
        "UPDATE credentials SET max_concurrent_uses = 1 WHERE key_id = 'kl'",
        "SELECT credpool_fit_slots('kl')",
    ];
    let refitting = transaction_waiting(&app, hooked(&app, "fit.done").await, refit, true).await;
    // the short lease runs out while the refit, which judged it live, has not committed
    loop {
        let left: f64 = app
            .scalar_of(
                "SELECT extract(epoch FROM lease_until - clock_timestamp())::float8
             FROM lease_slots WHERE lease_id = $1::uuid",
                short["lease_id"].as_str().unwrap(),
            )
            .await;
        if left < -0.05 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut claim = hooked(&app, "claim.before_lock").await;
    let claim_pid = backend_pid(&mut claim).await;
    let claiming = tokio::spawn(async move {
        sqlx::query_scalar::<_, Option<String>>("SELECT key_id FROM credpool_claim($1)")
            .bind(claim_body(&["kl"], "default", None))
            .fetch_one(&mut claim)
            .await
    });
    until_waiting(&app, claim_pid).await;
    fit_hook.open().await;
    refitting.await.unwrap().expect("the refit failed");
    claim_hook.open().await;
    let granted = claiming.await.unwrap().expect("the claim failed");
    assert_eq!(granted, None, "a lease was granted over the lowered limit");
    assert!(app.in_flight("kl").await <= 2);
    audit_passes(BIN, &app.database).await;
}

#[tokio::test]
async fn a_refit_holds_what_it_counts_from_its_locks_to_its_commit() {
    // A refit in a transaction of its own (as a release that freed a slot over a lowered limit
    // runs one after its commit) is held right after its locks (`fit.locked`), having read the
    // limit of 4 it will fit to and before it counts the leases in flight. Meanwhile a claim
    // finds the free slots locked and grants nothing, and a renewal of the lease in flight and
    // an operator's lowering of the limit to 1 wait for the refit. Without those locks the claim
    // could fill a slot while the refit counts, and the refit, going on with the limit it read,
    // would reopen 4 slots after the operator's own fit to 1: an oversell.
    let app = TestApp::with_credential("kf", 4).await;
    let held = app.lease(gpt4o_for(600)).await;
    let hook = Hook::close(&app, "fit.locked").await;
    let refit = &["SELECT credpool_fit_slots('kf')"];
    let refitting = transaction_waiting(&app, hooked(&app, "fit.locked").await, refit, true).await;

    let row = sqlx::query("SELECT key_id, request FROM credpool_claim($1)")
        .bind(claim_body(&["kf"], "default", None))
        .fetch_one(&mut connect(&app).await)
        .await
        .expect("the claim failed");
    let key: Option<String> = row.get("key_id");
    let request: Option<String> = row.get("request");
    assert_eq!(key, None, "a claim filled a slot while the refit held it");
    assert_eq!(request.as_deref(), Some("busy"));
    let renewing = {
        let (app, body) = (app.remote(), renew_body(&held, 600));
        tokio::spawn(async move { app.renew(body).await.status() })
    };
    let lowering = {
        let app = app.remote();
        let body = json!({"max_concurrent_uses": 1});
        tokio::spawn(async move { app.patch_key("kf", body).await.status() })
    };
    // the refit at its hook, the renewal and the operator's change behind it
    wait_for_lock_waiters(&app, 3).await;
    hook.open().await;
    refitting.await.unwrap().expect("the refit failed");
    assert_eq!(renewing.await.unwrap(), StatusCode::OK);
    assert_eq!(lowering.await.unwrap(), StatusCode::OK);

    // the lease in flight fills the lowered limit
    let slots: i64 = app
        .scalar("SELECT count(*) FROM lease_slots WHERE key_id = 'kf'")
        .await;
    assert_eq!(slots, 1, "slot rows of a credential of limit 1");
    app.allocate(gpt4o_for(600))
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    app.release_ok(&held, "success").await;
    app.lease(gpt4o_for(600)).await;
    audit_passes(BIN, &app.database).await;
}

#[tokio::test]
async fn a_claim_never_waits_for_a_lock() {
    // Everything a claim could touch is locked by another transaction; claims, with and without
    // a request_id (one whose lease expired, one in flight elsewhere), still answer at once.
    let app = TestApp::with_credential("kw", 2).await;
    let response = app
        .allocate(json!({"provider": "openai", "model": "gpt-4o", "request_id": "req-old"}))
        .await;
    let old = json_body(response, StatusCode::OK).await;
    app.run_sql_with(
        "UPDATE lease_slots SET granted_at = now() - interval '2 seconds',
             lease_until = now() - interval '1 second' WHERE lease_id = $1::uuid",
        old["lease_id"].as_str().unwrap(),
    )
    .await;

    let mut holder = transaction_holding(
        &app,
        &[
            "SELECT 1 FROM lease_slots FOR UPDATE",
            "SELECT 1 FROM credentials FOR UPDATE",
            "SELECT 1 FROM lease_requests FOR UPDATE",
            "SELECT 1 FROM pool_versions FOR UPDATE",
            "SELECT pg_advisory_xact_lock(hashtextextended('credpool.request_id:default/req-busy', 0))",
        ],
    )
    .await;
    let mut claim = connect(&app).await;
    claim.execute("SET lock_timeout = '500ms'").await.unwrap();
    // a free slot held elsewhere: nothing granted, and `busy` (claim again in a moment)
    for (request_id, expected) in [
        (None, Some("busy")),
        (Some("req-old"), Some("busy")),
        (Some("req-new"), Some("busy")),
        (Some("req-busy"), Some("in_flight")),
    ] {
        let row = sqlx::query("SELECT key_id, request FROM credpool_claim($1)")
            .bind(claim_body(&["kw"], "default", request_id))
            .fetch_one(&mut claim)
            .await
            .unwrap_or_else(|e| panic!("claim with request_id {request_id:?} waited: {e}"));
        let key: Option<String> = row.get("key_id");
        let request: Option<String> = row.get("request");
        assert_eq!(key, None, "a slot locked elsewhere was granted");
        assert_eq!(request.as_deref(), expected, "request_id {request_id:?}");
    }
    holder.execute("COMMIT").await.unwrap();
    // and once the locks are gone the request whose lease expired gets a new one
    let row = sqlx::query("SELECT key_id, request FROM credpool_claim($1)")
        .bind(claim_body(&["kw"], "default", Some("req-old")))
        .fetch_one(&mut claim)
        .await
        .unwrap();
    let key: Option<String> = row.get("key_id");
    assert_eq!(key.as_deref(), Some("kw"));
}

/// Seq scans and rows read, per table, by this transaction so far.
async fn reads(conn: &mut PgConnection) -> Vec<(String, i64, i64)> {
    // the trail's reads are its days' (partitions') reads
    sqlx::query_as(
        "SELECT CASE WHEN i.inhrelid IS NULL THEN t.relname::text ELSE 'lease_events' END AS name,
                sum(t.seq_scan)::bigint,
                sum(coalesce(t.seq_tup_read, 0) + coalesce(t.idx_tup_fetch, 0))::bigint
         FROM pg_stat_xact_user_tables t
         LEFT JOIN pg_inherits i ON i.inhrelid = t.relid AND i.inhparent = 'lease_events'::regclass
         WHERE t.relname IN ('credentials', 'lease_slots', 'lease_requests', 'pool_versions',
                             'tenants', 'tenant_keys', 'tenant_slots', 'tenant_windows',
                             'pool_waiters', 'pool_waiter_processes', 'affinity_bindings')
            OR i.inhrelid IS NOT NULL
         GROUP BY 1
         ORDER BY 1",
    )
    .fetch_all(conn)
    .await
    .unwrap()
}

/// The tenant the plan test's tenant claims are made for: capped, with windows, its key's hash.
struct PlanTenant {
    key_hash: String,
}

/// One claim of the plan test over `ranked` in pool `big`: a plain one, or (`tenant`) one of a
/// capped tenant with windows that reserves tokens, names an affinity key bound to a credential
/// of the pool and may wait.
fn plan_claim(ranked: &[String], request_id: &str, tenant: Option<&PlanTenant>, i: usize) -> Value {
    let ranked: Vec<&str> = ranked.iter().map(String::as_str).collect();
    let mut body = claim_body(&ranked, "big", Some(request_id));
    if let Some(tenant) = tenant {
        let claim = &mut body[0];
        claim["key_hash"] = json!(tenant.key_hash);
        claim["tokens"] = json!(10);
        claim["affinity_key"] = json!(format!("conversation-{}", (i * 7919) % 5_000));
        claim["affinity_pools"] = json!(["big"]);
        claim["affinity_ttl_seconds"] = json!(3600);
        claim["affinity_mode"] = json!("preferred");
        claim["waiting"] = json!({"waiter": uuid::Uuid::new_v4(), "instance": "plan",
                                  "pools": ["big"], "waited_ms": 0.0, "wait_ms": 10_000.0});
    }
    body
}

/// 20 claims of 8 candidates each in pool `big` (of `tenant`, when given; see [`plan_claim`]),
/// their renewals and their releases (with a usage, for a tenant's), in one transaction on
/// `conn`: then no sequential scan and O(candidates) rows read of every table, not O(pool).
async fn claims_read_only_their_rows(
    conn: &mut PgConnection,
    phase: &str,
    tenant: Option<&PlanTenant>,
) {
    let part = if tenant.is_some() { "tenant" } else { "plain" };
    let key_hash = tenant.map(|t| t.key_hash.as_str());
    conn.execute("BEGIN").await.unwrap();
    let mut leases = Vec::new();
    for i in 0..20 {
        let ranked: Vec<String> = (0..8)
            .map(|j| format!("big-{}", (i * 97 + j * 13) % 10_000))
            .collect();
        let body = plan_claim(&ranked, &format!("plan-{phase}-{part}-{i}"), tenant, i);
        let row = sqlx::query("SELECT key_id, lease_id, request FROM credpool_claim($1)")
            .bind(body)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        let key: Option<String> = row.get("key_id");
        let request: Option<String> = row.get("request");
        let key = key.unwrap_or_else(|| panic!("{phase} {part}: claim {i} answered {request:?}"));
        let lease: uuid::Uuid = row.get("lease_id");
        leases.push((key, lease));
    }
    let renewals: Vec<Value> = leases
        .iter()
        .map(|(key, lease)| json!({"lease_id": lease, "key_id": key, "provider": "openai", "pool": "big", "fence": null, "lease_seconds": 60, "key_hash": key_hash}))
        .collect();
    let renewed: Vec<Option<time::OffsetDateTime>> =
        sqlx::query_scalar("SELECT lease_until FROM credpool_renew($1)")
            .bind(Value::Array(renewals))
            .fetch_all(&mut *conn)
            .await
            .unwrap();
    assert!(renewed.iter().all(Option::is_some), "{phase} {part}");
    let usage = tenant.map(|_| 5);
    let releases: Vec<Value> = leases
        .iter()
        .map(|(key, lease)| json!({"lease_id": lease, "key_id": key, "provider": "openai", "pool": "big", "fence": null, "outcome": "success", "key_hash": key_hash, "usage_tokens": usage}))
        .collect();
    let verdicts: Vec<String> = sqlx::query_scalar("SELECT verdict FROM credpool_release($1, $2)")
        .bind(Value::Array(releases))
        .bind(policy())
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    assert!(
        verdicts.iter().all(|v| v == "released"),
        "{phase} {part}: {verdicts:?}"
    );
    for (table, seq_scans, rows) in reads(conn).await {
        assert_eq!(seq_scans, 0, "{phase} {part}: a sequential scan of {table}");
        // 20 claims x 8 candidates x (1 credential + 4 slots), a tenant's slot rows (its cap of
        // 24) per claim; bindings, waiters, renewals and releases by key
        assert!(
            rows < 2_000,
            "{phase} {part}: {rows} rows of {table} read for 20 leases"
        );
    }
    conn.execute("ROLLBACK").await.unwrap();
}

/// The plan test's tenants `plan-<first>` .. `plan-<first + 999>` (cap 4, a window), their keys,
/// 5 waiters each for another model of pool `big`, and bindings `conversation-<n>` to credentials
/// `big-<first + n>` for n below 5,000, of `team` and of each of them in turn. Every waiter waits
/// for the one other model: statistics that show one model only are where a plan made for any
/// model (a cached generic plan) would read every waiter to find the claim's.
async fn plan_tenants(app: &TestApp, first: i32) {
    app.run_sql_with(
        "INSERT INTO tenants (tenant_id, max_concurrent_leases, rate_limits, pools)
         SELECT 'plan-' || g, 4, '[{\"tokens\": 1000000, \"seconds\": 600}]', '{*/*}'
         FROM generate_series($1::int, $1::int + 999) g",
        first,
    )
    .await;
    app.run_sql_with(
        "SELECT credpool_fit_tenant('plan-' || g) FROM generate_series($1::int, $1::int + 999) g",
        first,
    )
    .await;
    app.run_sql_with(
        "INSERT INTO tenant_keys (key_id, tenant_id, key_hash)
         SELECT gen_random_uuid(), 'plan-' || g, sha256(convert_to('plan-key-' || g, 'UTF8'))
         FROM generate_series($1::int, $1::int + 999) g",
        first,
    )
    .await;
    app.run_sql_with(
        "INSERT INTO pool_waiters (waiter, instance, tenant, provider, pools, model, since, until)
         SELECT gen_random_uuid(), 'plan-other', 'plan-' || (g / 5), 'openai', '{big}',
                'model-other', now(), now() + interval '1 hour'
         FROM generate_series($1::int * 5, $1::int * 5 + 4999) g",
        first,
    )
    .await;
    app.run_sql_with(
        "INSERT INTO affinity_bindings
             (tenant, provider, pool, affinity_key, key_id, bound_at, last_hit_at, expires_at)
         SELECT t, 'openai', 'big', 'conversation-' || n, 'big-' || ($1::int + n), now(), now(),
                now() + interval '1 hour'
         FROM generate_series(0, 4999) n,
              LATERAL (VALUES ('team'), ('plan-' || ($1::int + n / 5))) AS x (t)
         ON CONFLICT DO NOTHING",
        first,
    )
    .await;
}

#[tokio::test]
async fn the_claim_release_and_renewal_read_only_their_rows_whatever_the_statistics() {
    // 10,000 credentials of limit 4 in one pool, 2,000 capped tenants with windows and keys,
    // 10,000 waiters for other models and 15,000 affinity bindings: never analyzed, then
    // analyzed while the tables were tiny (stale), then analyzed now. Each time 20 plain claims
    // over 8 candidates, and 20 of a capped tenant with windows that reserve tokens, name a bound
    // affinity key and may wait, their renewals and releases must do no sequential scan and read
    // O(candidates) rows, not O(pool), of every table.
    let app = TestApp::spawn().await;
    let days: Vec<String> = app
        .scalars("SELECT day::text FROM credpool_trail_days()")
        .await;
    for table in [
        "credentials",
        "lease_slots",
        "lease_requests",
        "tenants",
        "tenant_keys",
        "tenant_slots",
        "tenant_windows",
        "pool_waiters",
        "pool_waiter_processes",
        "affinity_bindings",
    ]
    .into_iter()
    .chain(days.iter().map(String::as_str))
    {
        app.db
            .execute(sqlx::AssertSqlSafe(format!(
                "ALTER TABLE {table} SET (autovacuum_enabled = false)"
            )))
            .await
            .unwrap();
    }
    app.put_gpt4o_key("seed", "big", 4).await;
    let limits = json!({"max_concurrent_leases": 24,
                        "rate_limits": [{"tokens": 1_000_000, "seconds": 600},
                                        {"requests": 100_000, "seconds": 600}]});
    let key = app.tenant_key("team", limits).await;
    let tenant = PlanTenant {
        key_hash: app
            .scalar_of("SELECT encode(sha256(convert_to($1, 'UTF8')), 'hex')", &key)
            .await,
    };
    // another tenant waits for the pool's model, at its cap of 0: never yielded to, but each
    // waiting claim of `team` weighs its share against it (the pool's live leases)
    app.run_sql(
        "INSERT INTO tenants (tenant_id, max_concurrent_leases, pools)
         VALUES ('blocked', 0, '{*/*}')",
    )
    .await;
    app.run_sql(
        "INSERT INTO pool_waiters (waiter, instance, tenant, provider, pools, model, since, until)
         VALUES (gen_random_uuid(), 'plan-other', 'blocked', 'openai', '{big}', 'gpt-4o', now(),
                 now() + interval '1 hour')",
    )
    .await;
    for phase in ["never-analyzed", "stale", "fresh"] {
        match phase {
            "stale" => {
                app.db.execute("ANALYZE").await.unwrap();
            }
            "fresh" => {
                app.db
                    .execute(
                        "ANALYZE credentials, lease_slots, tenants, tenant_keys, tenant_slots,
                                 tenant_windows, pool_waiters, affinity_bindings",
                    )
                    .await
                    .unwrap();
            }
            _ => {}
        }
        if phase != "fresh" {
            let start = if phase == "stale" { 5000 } else { 0 };
            app.run_sql_with("INSERT INTO credentials (key_id, provider, pool, models, max_concurrent_uses, secret_ciphertext)
                 SELECT 'big-' || g, 'openai', 'big', '{gpt-4o}', 4, '\\x00'::bytea
                 FROM generate_series($1::int, $1::int + 4999) g", start).await;
            app.run_sql_with("SELECT credpool_fit_slots('big-' || g) FROM generate_series($1::int, $1::int + 4999) g", start).await;
            plan_tenants(&app, start).await;
        }
        // a connection each: a backend's counts of a transaction stay in its `pg_stat_xact_*`
        // views until they are flushed, which may be after its next transaction began
        claims_read_only_their_rows(&mut connect(&app).await, phase, None).await;
        // the waiters' processes said they are alive just now
        app.run_sql(
            "INSERT INTO pool_waiter_processes (instance, seen_at)
             VALUES ('plan', now()), ('plan-other', now())
             ON CONFLICT (instance) DO UPDATE SET seen_at = EXCLUDED.seen_at",
        )
        .await;
        claims_read_only_their_rows(&mut connect(&app).await, phase, Some(&tenant)).await;
    }
}

#[tokio::test]
async fn an_operators_change_reads_only_its_credentials_slot_rows() {
    // 2,500 credentials of limit 4 (10,000 slot rows), never analyzed, then analyzed. An
    // operator's raise and lower of one credential's limit (its locks, then FIT), a forced release
    // of its leases, and the locks a release with a rejected report takes (the credential, with
    // the group's other leases found by their credential and lease) must read that credential's
    // rows, not the table's. The lock statement once matched the leases by lease id alone, which
    // no index serves: every operator change read every slot row, dead ones included, and a
    // credential's limit raised and lowered a few hundred times made each change take seconds
    // (one ran into the statement timeout under the API fuzzer).
    let app = TestApp::spawn().await;
    for table in ["credentials", "lease_slots"] {
        app.db
            .execute(sqlx::AssertSqlSafe(format!(
                "ALTER TABLE {table} SET (autovacuum_enabled = false)"
            )))
            .await
            .unwrap();
    }
    app.run_sql(
        "INSERT INTO credentials (key_id, provider, pool, models, max_concurrent_uses, secret_ciphertext)
         SELECT 'big-' || g, 'openai', 'big', '{gpt-4o}', 4, '\\x00'::bytea
         FROM generate_series(0, 2499) g",
    )
    .await;
    app.run_sql("SELECT credpool_fit_slots('big-' || g) FROM generate_series(0, 2499) g")
        .await;
    for phase in ["never-analyzed", "analyzed"] {
        if phase == "analyzed" {
            app.db
                .execute("ANALYZE credentials, lease_slots")
                .await
                .unwrap();
        }
        let key = if phase == "analyzed" {
            "big-17"
        } else {
            "big-7"
        };
        // a connection each: see the claims' plan test
        let mut conn = connect(&app).await;
        conn.execute("BEGIN").await.unwrap();
        let mut leases = Vec::new();
        for i in 0..3 {
            let lease: uuid::Uuid = sqlx::query_scalar("SELECT lease_id FROM credpool_claim($1)")
                .bind(claim_body(&[key], "big", Some(&format!("op-{phase}-{i}"))))
                .fetch_one(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("{phase}: claim {i}: {e}"));
            leases.push(lease);
        }
        // raised, then lowered under the three leases (FIT's over-limit branch), as PATCH does
        for limit in [8, 1] {
            sqlx::query("SELECT credpool_lock_credentials(ARRAY[$1])")
                .bind(key)
                .execute(&mut conn)
                .await
                .unwrap();
            sqlx::query("UPDATE credentials SET max_concurrent_uses = $2 WHERE key_id = $1")
                .bind(key)
                .bind(limit)
                .execute(&mut conn)
                .await
                .unwrap();
            sqlx::query("SELECT credpool_fit_slots($1)")
                .bind(key)
                .execute(&mut conn)
                .await
                .unwrap();
        }
        let over: i64 =
            sqlx::query_scalar("SELECT count(*) FROM lease_slots WHERE key_id = $1 AND over_limit")
                .bind(key)
                .fetch_one(&mut conn)
                .await
                .unwrap();
        assert_eq!(
            over, 3,
            "{phase}: the lowered limit did not reach the slot rows"
        );
        // a release's locks: a rejected credential, the group's other lease on `key`
        sqlx::query("SELECT credpool_lock_credentials(ARRAY['big-2000'], false, $1, $2)")
            .bind(&leases[..1])
            .bind([key])
            .execute(&mut conn)
            .await
            .unwrap();
        let ended: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT lease_id FROM credpool_force_release($1, NULL, 'plan', 'operator')",
        )
        .bind(key)
        .fetch_all(&mut conn)
        .await
        .unwrap();
        assert_eq!(ended.len(), 3, "{phase}: forced release ended {ended:?}");
        for (table, seq_scans, rows) in reads(&mut conn).await {
            if table != "lease_slots" && table != "credentials" {
                continue;
            }
            assert_eq!(seq_scans, 0, "{phase}: a sequential scan of {table}");
            // a few statements over the credential's at most 8 slot rows and its own row
            assert!(
                rows < 300,
                "{phase}: {rows} rows of {table} read for one credential's change"
            );
        }
        conn.execute("ROLLBACK").await.unwrap();
    }
}

#[tokio::test]
async fn a_database_migrated_by_the_previous_release_upgrades_cleanly() {
    // The schema as the previous release left it (migrations up to the executor protocol, whose
    // functions it defined), with live state in it: leases, a request_id, a credential over a
    // lowered limit, a drained one.
    let (_server, pool) = TestDatabase::create_at(20261130000006).await;
    pool.execute(
        "INSERT INTO credentials (key_id, provider, pool, models, max_concurrent_uses, secret_ciphertext)
         VALUES ('up-a', 'openai', 'default', '{gpt-4o}', 2, '\\x00'),
                ('up-over', 'openai', 'default', '{gpt-4o}', 3, '\\x00'),
                ('up-drained', 'openai', 'default', '{gpt-4o}', 1, '\\x00');
         SELECT credpool_fit_slots(k) FROM unnest('{up-a,up-over,up-drained}'::text[]) k;",
    )
    .await
    .unwrap();
    let claim = |ranked: &str, request: Option<&str>| {
        json!([{"ranked": [ranked], "provider": "openai", "pool": "default", "model": "gpt-4o",
                "lease_id": uuid::Uuid::new_v4(), "holder": "old", "lease_seconds": 600,
                "request_id": request, "request_digest": request.map(|_| "digest")}])
    };
    let mut old_leases = Vec::new();
    for (ranked, request) in [
        ("up-a", Some("req-upgrade")),
        ("up-over", None),
        ("up-over", None),
    ] {
        let row = sqlx::query("SELECT key_id, lease_id, fence FROM credpool_claim($1)")
            .bind(claim(ranked, request))
            .fetch_one(&pool)
            .await
            .unwrap();
        let lease: uuid::Uuid = row.get("lease_id");
        let fence: i64 = row.get("fence");
        old_leases.push((ranked, lease, fence));
    }
    pool.execute(
        "UPDATE credentials SET max_concurrent_uses = 1 WHERE key_id = 'up-over';
         SELECT credpool_fit_slots('up-over');
         UPDATE credentials SET draining = true WHERE key_id = 'up-drained';",
    )
    .await
    .unwrap();
    let version_before: i64 = pool
        .scalar("SELECT version FROM pool_versions WHERE provider = 'openai' AND pool = 'default'")
        .await;

    store::migrate(&pool).await.expect("the upgrade failed");

    // the gates moved onto the slot rows
    let gates: Vec<(String, bool, bool)> = sqlx::query_as(
        "SELECT key_id, bool_and(over_limit), bool_and(draining) FROM lease_slots
         WHERE key_id IN ('up-over', 'up-drained') GROUP BY key_id ORDER BY key_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        gates,
        vec![
            ("up-drained".to_owned(), false, true),
            ("up-over".to_owned(), true, false)
        ]
    );
    // the pool's version only grows
    let version_after: i64 = pool
        .scalar("SELECT credpool_pool_version('openai', 'default')")
        .await;
    assert!(version_after >= version_before);
    // the request_id still names its lease: a retry replays it
    let row = sqlx::query("SELECT lease_id, request FROM credpool_claim($1)")
        .bind(claim("up-a", Some("req-upgrade")))
        .fetch_one(&pool)
        .await
        .unwrap();
    let replayed: Option<uuid::Uuid> = row.get("lease_id");
    let request: Option<String> = row.get("request");
    assert_eq!(
        (replayed, request.as_deref()),
        (Some(old_leases[0].1), Some("replayed"))
    );
    // nothing is granted on the drained or the over-limit credential
    for ranked in ["up-drained", "up-over"] {
        let granted: Option<String> = pool
            .scalar_of("SELECT key_id FROM credpool_claim($1)", claim(ranked, None))
            .await;
        assert_eq!(granted, None, "{ranked} granted after the upgrade");
    }
    // leases granted before the upgrade renew and release with their fences
    for (key, lease, fence) in &old_leases {
        let body = json!([{"lease_id": lease, "key_id": key, "provider": "openai", "pool": "default", "fence": fence, "lease_seconds": 60}]);
        let renewed: Option<time::OffsetDateTime> = pool
            .scalar_of("SELECT lease_until FROM credpool_renew($1)", body)
            .await;
        assert!(renewed.is_some(), "{key}: lease lost in the upgrade");
        let body = json!([{"lease_id": lease, "key_id": key, "provider": "openai", "pool": "default", "fence": fence, "outcome": null}]);
        let (verdict, refit): (String, bool) =
            sqlx::query_as("SELECT verdict, refit FROM credpool_release($1, $2)")
                .bind(body)
                .bind(policy())
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(verdict, "released", "{key}");
        if refit {
            pool.execute(sqlx::AssertSqlSafe(format!(
                "SELECT credpool_fit_slots('{key}')"
            )))
            .await
            .unwrap();
        }
    }
    // released back under its limit, the over-limit credential serves again, one lease at most
    let granted: Option<String> = pool
        .scalar_of(
            "SELECT key_id FROM credpool_claim($1)",
            claim("up-over", None),
        )
        .await;
    assert_eq!(granted.as_deref(), Some("up-over"));
    let slots: i64 = pool
        .scalar("SELECT count(*) FROM lease_slots WHERE key_id = 'up-over'")
        .await;
    assert_eq!(slots, 1);
    // and a second migrate changes nothing
    assert!(
        store::migrations_up_to_date(&mut pool.acquire().await.unwrap())
            .await
            .unwrap()
    );
    pool.close().await;
}

#[tokio::test]
async fn one_group_of_claims_over_the_same_credentials_fills_each_exactly_to_its_limit() {
    // A group's claims are decided together (PICK: every claim locks the first free slot of its
    // own ranking, all from one snapshot, so several pick the same slot; one winner per
    // credential per round, the others pick again). Nine claims that all rank `r1` (limit 3)
    // first, then `r2` (limit 2), then `r3` (limit 1), in one call: six grants, each slot once,
    // the first three claims on r1, the next two on r2, the sixth on r3, three with nothing.
    let app = TestApp::spawn().await;
    for (key, limit) in [("r1", 3), ("r2", 2), ("r3", 1)] {
        app.put_gpt4o_key(key, "rounds", limit).await;
    }
    let claims: Vec<Value> = (0..9)
        .map(|_| claim_body(&["r1", "r2", "r3"], "rounds", None)[0].clone())
        .collect();
    let mut conn = connect(&app).await;
    let rows = sqlx::query(
        "SELECT claim, key_id, fence, frees_at, held_by FROM credpool_claim($1) ORDER BY claim",
    )
    .bind(Value::Array(claims))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let granted: Vec<Option<String>> = rows.iter().map(|r| r.get("key_id")).collect();
    let expected = ["r1", "r1", "r1", "r2", "r2", "r3"]
        .into_iter()
        .map(|k| Some(k.to_owned()))
        .chain(std::iter::repeat_n(None, 3))
        .collect::<Vec<_>>();
    assert_eq!(granted, expected);
    // the claims left without a slot learn when one frees, and why
    for row in &rows[6..] {
        let held_by: Option<String> = row.get("held_by");
        assert_eq!(held_by.as_deref(), Some("slots"));
        assert!(
            row.get::<Option<time::OffsetDateTime>, _>("frees_at")
                .is_some()
        );
    }
    // each slot holds one lease, and the trail has one grant per lease
    let (leases, slots_used, grants): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(lease_id), count(DISTINCT (key_id, slot)) FILTER (WHERE lease_id IS NOT NULL),
                (SELECT count(*) FROM lease_events WHERE event = 'granted' AND pool = 'rounds')
         FROM lease_slots WHERE key_id IN ('r1', 'r2', 'r3')",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!((leases, slots_used, grants), (6, 6, 6));
}

/// Every statement PostgreSQL ran on `conn`'s server since the counters were reset, nested ones
/// included (pg_stat_statements, `track = all`): (query, calls), the counters' own queries left
/// out.
async fn statements_run(conn: &mut PgConnection) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT regexp_replace(query, '\\s+', ' ', 'g'), calls FROM pg_stat_statements
         WHERE query NOT ILIKE '%pg_stat_statements%'
         ORDER BY query",
    )
    .fetch_all(conn)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_plain_claim_and_a_plain_release_run_only_their_own_statements() {
    // The claim and the release as the service runs them, for a request that uses no tenant cap
    // or window, no rate window, no affinity and no request id: the statements PostgreSQL
    // executes, nested ones included, counted by pg_stat_statements in a private cluster that
    // loads it. A feature that adds work to every claim or release (a statement, or a phase that
    // runs when it is not used) fails this count.
    use credpool::domain::{Holder, KeyId, LeaseSeconds, ModelName, PoolName, ProviderName};
    use credpool::store::leases::{self, Claim, ClaimOutcome};

    let dir = tmp_dir("credpool-statements-");
    let (_cluster, pool) = statements_cluster(
        dir.path(),
        &[
            ("pg_stat_statements.track", "all"),
            ("pg_stat_statements.track_utility", "on"),
        ],
    )
    .await;
    sqlx::raw_sql(
        "CREATE EXTENSION IF NOT EXISTS pg_stat_statements;
         INSERT INTO credentials (key_id, provider, pool, models, max_concurrent_uses,
                                  secret_ciphertext)
         SELECT 'k' || g, 'openai', 'default', '{gpt-4o}', 4, '\\x00'::bytea
         FROM generate_series(1, 16) AS g;
         SELECT credpool_fit_slots('k' || g) FROM generate_series(1, 16) AS g;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let db = Db::from(pool.clone());
    let ranked: Vec<KeyId> = (1..=16)
        .map(|i| KeyId::parse(format!("k{i}")).unwrap())
        .collect();
    let (provider, pool_name, model) = (
        ProviderName::parse("openai").unwrap(),
        PoolName::parse("default").unwrap(),
        ModelName::parse("gpt-4o").unwrap(),
    );
    let holder = Holder::parse("counted").unwrap();
    let mut conn = db.acquire().await.unwrap();
    let claim = async |conn: &mut credpool::store::Conn<'static>| {
        let claim = Claim {
            holder: Some(holder.clone()),
            windowed: Some(false),
            ..Claim::new(
                ranked.clone(),
                provider.clone(),
                pool_name.clone(),
                model.clone(),
                LeaseSeconds::default_within(86_400),
            )
        };
        let mut work = conn.work().await.unwrap();
        let answer = leases::claim_slot(&mut work, &claim).await.unwrap();
        work.done().await.unwrap();
        match answer.outcome {
            ClaimOutcome::Granted(granted) => granted,
            outcome => panic!("no lease: {outcome:?}"),
        }
    };
    // once to warm the plans up, then counted
    claim(&mut conn).await;
    pool.run_sql("SELECT pg_stat_statements_reset()").await;
    let granted = claim(&mut conn).await;
    let mut counting = pool.acquire().await.unwrap();
    let run = statements_run(&mut counting).await;
    let total: i64 = run.iter().map(|(_, calls)| calls).sum();
    assert_eq!(total, 7, "the plain claim ran {total} statements: {run:#?}");

    // the release of a lease with its outcome, as a release group runs it
    let release = |granted: leases::GrantedLease| leases::ReleaseRequest {
        lease: leases::LeaseRef {
            key_id: granted.key_id,
            provider: provider.clone(),
            pool: granted.pool,
            lease_id: granted.lease_id,
            fence: Some(granted.fence),
        },
        outcome: Some(credpool::domain::Outcome::Success),
        retry_after_seconds: None,
        usage_tokens: None,
        caller: None,
        may_disable: true,
    };
    let policy = credpool::allocator::health::HealthPolicy::default();
    let warm = release(claim(&mut conn).await);
    let mut work = conn.work().await.unwrap();
    leases::release_group(&mut *work, &[&warm], &policy)
        .await
        .unwrap();
    work.done().await.unwrap();
    let counted = release(granted);
    pool.run_sql("SELECT pg_stat_statements_reset()").await;
    let mut work = conn.work().await.unwrap();
    let released = leases::release_group(&mut *work, &[&counted], &policy)
        .await
        .unwrap();
    work.done().await.unwrap();
    assert!(released[0].result().released.is_ok());
    let run = statements_run(&mut counting).await;
    let total: i64 = run.iter().map(|(_, calls)| calls).sum();
    assert_eq!(
        total, 11,
        "the plain release ran {total} statements: {run:#?}"
    );
}
