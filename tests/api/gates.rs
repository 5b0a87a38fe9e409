//! Gates on the locked row (docs/design.md, "Gate on the locked row" and "Lock order"): an
//! operator's change that has committed is never granted past, a lowered limit reopens when the
//! leases over it end, and operator transactions, releases and late reports take their locks in
//! one order. Each window is held open on purpose: a claim paused between its snapshot and its
//! lock (test hook `claim.before_lock`), transactions stepped by hand on connections of the test's
//! own. Every test here failed before the claim required the slot row's configuration version,
//! before lowered limits kept rows within the limit, and before operators locked every slot row.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use sqlx::{Executor, Row};

use credpool_test_support::*;

use crate::BIN;
use crate::common::{claim_body, granted_of};

/// Sets credential `k`'s limit through the operator API; panics unless it answers 200.
async fn set_limit(app: &TestApp, limit: u32) {
    let body = json!({"max_concurrent_uses": limit});
    let status = app.patch_key("k", body).await.status();
    assert_eq!(status, StatusCode::OK);
}

/// An app whose credential `k` of limit 3 has three leases of `lease_seconds` seconds held when
/// its limit is lowered to `limit`.
async fn full_then_lowered_to(limit: u32, lease_seconds: u64) -> TestApp {
    let app = TestApp::with_credential("k", 3).await;
    for _ in 0..3 {
        app.lease(gpt4o_for(lease_seconds)).await;
    }
    set_limit(&app, limit).await;
    app
}

/// How the operator changes credential `k` (provider openai, pool default, models gpt-4o and
/// gpt-4o-mini, alias `fast` -> gpt-4o, limit 2, one lease held) while a claim for `model` in
/// `default` waits between its snapshot and its lock.
enum Change {
    Patch(Value),
    Delete,
    Put(Value),
    /// Any writer of the columns, as `credpool keys reseal` writes a new ciphertext.
    Sql(&'static str),
}

async fn apply(app: &TestApp, change: &Change) {
    let status = match change {
        Change::Patch(body) => app.patch_key("k", body.clone()).await.status(),
        Change::Delete => app
            .admin(Method::DELETE, "/api/admin/keys/k", Some(json!({})))
            .await
            .status(),
        Change::Put(body) => app.put_key_raw("k", body.clone()).await.status(),
        Change::Sql(sql) => {
            sqlx::query(sqlx::AssertSqlSafe(*sql))
                .execute(&app.db)
                .await
                .expect("the operator's SQL");
            StatusCode::OK
        }
    };
    assert!(status.is_success(), "the change answered {status}");
}

fn spec(pool: &str, limit: u32, secret: &str) -> Value {
    json!({"provider": "openai", "pool": pool, "models": ["gpt-4o", "gpt-4o-mini"],
           "aliases": {"fast": "gpt-4o"}, "max_concurrent_uses": limit,
           "secret": {"api_key": secret}})
}

#[tokio::test]
async fn no_claim_grants_on_a_configuration_replaced_after_its_snapshot() {
    // (what changes, the model the paused claim asks for, whether the credential as it is
    // NOW still serves the claim: then the claim must grant it, with the secret it has now;
    // otherwise it must grant nothing)
    let changes: Vec<(&str, Change, &str, bool)> = vec![
        // the control: a paused claim that never granted would pass every other case
        ("nothing changed", Change::Sql("SELECT 1"), "gpt-4o", true),
        (
            "disable",
            Change::Patch(json!({"state": "disable"})),
            "gpt-4o",
            false,
        ),
        (
            "drain",
            Change::Patch(json!({"state": "drain"})),
            "gpt-4o",
            false,
        ),
        (
            "pool move",
            Change::Patch(json!({"pool": "vip"})),
            "gpt-4o",
            false,
        ),
        (
            "model list",
            Change::Patch(json!({"models": ["gpt-4o-mini"], "aliases": {}})),
            "gpt-4o",
            false,
        ),
        (
            "alias",
            Change::Patch(json!({"aliases": {}})),
            "fast",
            false,
        ),
        (
            "limit lowered",
            Change::Patch(json!({"max_concurrent_uses": 1})),
            "gpt-4o",
            false,
        ),
        ("delete", Change::Delete, "gpt-4o", false),
        (
            "PUT, new secret",
            Change::Put(spec("default", 2, "sk-new")),
            "gpt-4o",
            true,
        ),
        (
            "PUT, new pool",
            Change::Put(spec("vip", 2, "sk-old")),
            "gpt-4o",
            false,
        ),
        (
            // an OAuth token that will expire before the paused claim's lease would end: the
            // claim read the credential before it had an expiry
            "token expiry moved before lease_until",
            Change::Sql(
                "UPDATE credentials SET token_expires_at = clock_timestamp() + interval '1 second'",
            ),
            "gpt-4o",
            false,
        ),
        (
            "new ciphertext by any writer",
            Change::Sql(
                "UPDATE credentials SET secret_ciphertext = secret_ciphertext || '\\x00'::bytea",
            ),
            "gpt-4o",
            true,
        ),
    ];
    let mut granted_past = Vec::new();
    for (name, change, model, new_is_fine) in changes {
        let app = TestApp::spawn().await;
        assert!(
            app.put_key_raw("k", spec("default", 2, "sk-old"))
                .await
                .status()
                .is_success()
        );
        app.lease(gpt4o_for(600)).await;

        let hook = Hook::close(&app, "claim.before_lock").await;
        let mut claim = hooked(&app, "claim.before_lock").await;
        let pid = backend_pid(&mut claim).await;
        let mut body = claim_body(&["k"], "default", None);
        body[0]["model"] = json!(model);
        let again = body.clone();
        let claiming = tokio::spawn(async move {
            sqlx::query("SELECT key_id, sealed_secret, request FROM credpool_claim($1)")
                .bind(body)
                .fetch_one(&mut claim)
                .await
                .map(|row| {
                    (
                        row.get::<Option<String>, _>(0),
                        row.get::<Option<Vec<u8>>, _>(1),
                        row.get::<Option<String>, _>(2),
                    )
                })
        });
        until_waiting(&app, pid).await;
        // the paused claim holds no row lock: the change commits while it waits
        apply(&app, &change).await;
        hook.open().await;
        let (mut granted, mut sealed, request) = claiming.await.unwrap().expect("the claim failed");
        let current: Option<Vec<u8>> =
            sqlx::query_scalar("SELECT secret_ciphertext FROM credentials WHERE key_id = 'k'")
                .fetch_optional(&app.db)
                .await
                .unwrap()
                .flatten();
        // a claim that saw its snapshot overtaken may answer 'busy' instead: its caller (the
        // service) claims again at once, and that claim must grant
        if granted.is_none() && new_is_fine && request.as_deref() == Some("busy") {
            (granted, sealed) =
                sqlx::query_as("SELECT key_id, sealed_secret FROM credpool_claim($1)")
                    .bind(again)
                    .fetch_one(&app.db)
                    .await
                    .expect("the claim again");
        }
        match granted {
            None if new_is_fine => granted_past.push(format!(
                "{name}: granted nothing ({request:?}), with the credential free"
            )),
            None => {}
            Some(_) if new_is_fine && sealed == current => {}
            Some(_) if new_is_fine => granted_past.push(format!("{name}: the replaced secret")),
            Some(key) => granted_past.push(format!("{name}: granted {key}")),
        }
        audit_passes(BIN, &app.database).await;
    }
    assert!(
        granted_past.is_empty(),
        "a paused claim decided on a configuration it did not lock: {granted_past:?}"
    );
}

#[tokio::test]
async fn a_claim_paused_while_its_first_candidate_is_disabled_takes_the_next() {
    // The disable commits (through the operator API) while the claim waits between its snapshot
    // and its lock: the claim passes over the disabled credential to the next in its ranked
    // order, and the service never leases the disabled one afterwards.
    let app = TestApp::with_credential("k", 4).await;
    app.put_gpt4o_key("other", "default", 4).await;
    let hook = Hook::close(&app, "claim.before_lock").await;
    let mut claim = hooked(&app, "claim.before_lock").await;
    let pid = backend_pid(&mut claim).await;
    let claiming = tokio::spawn(async move {
        sqlx::query_scalar::<_, Option<String>>("SELECT key_id FROM credpool_claim($1)")
            .bind(claim_body(&["k", "other"], "default", None))
            .fetch_one(&mut claim)
            .await
    });
    until_waiting(&app, pid).await;
    let status = app
        .patch_key("k", json!({"state": "disable"}))
        .await
        .status();
    assert_eq!(status, StatusCode::OK);
    hook.open().await;
    // passed over the disabled credential, served by the next in its ranked order
    assert_eq!(claiming.await.unwrap().unwrap().as_deref(), Some("other"));
    for _ in 0..3 {
        let lease = app.lease(gpt4o_for(600)).await;
        assert_eq!(lease["key_id"], "other");
    }
}

#[tokio::test]
async fn a_lowered_limit_reopens_when_the_leases_over_it_end_without_maintenance() {
    // Limit 3 -> 1 while three 2-second leases are held; the holders crash. Nothing runs the
    // cleanup pass (the in-process app has no scheduler). Once the last of them has ended, on the
    // database clock, the credential grants again: exactly its new limit.
    let app = full_then_lowered_to(1, 2).await;
    assert_eq!(
        granted_of(&app, INTERNAL_KEY, 3).await,
        0,
        "granted over the lowered limit"
    );
    let last_end: f64 = app
        .scalar(
            "SELECT extract(epoch FROM max(lease_until) - clock_timestamp())::float8
         FROM lease_slots WHERE key_id = 'k'",
        )
        .await;
    tokio::time::sleep(Duration::from_secs_f64(last_end.max(0.0) + 0.3)).await;
    assert_eq!(
        granted_of(&app, INTERNAL_KEY, 3).await,
        1,
        "not exactly the new limit once the leases ended"
    );
    assert_eq!(app.in_flight("k").await, 1);
    audit_passes(BIN, &app.database).await;
}

#[tokio::test]
async fn a_force_release_over_a_lowered_limit_reopens_at_once() {
    let app = full_then_lowered_to(2, 600).await;
    assert_eq!(granted_of(&app, INTERNAL_KEY, 3).await, 0);
    let status = app
        .admin(
            Method::POST,
            "/api/admin/keys/k/release-all",
            Some(json!({"reason": "limit lowered by the provider"})),
        )
        .await
        .status();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        granted_of(&app, INTERNAL_KEY, 4).await,
        2,
        "not exactly the new limit after the force release"
    );
}

#[tokio::test]
async fn a_lease_over_a_lowered_limit_is_never_renewed_past_the_leases_within_it() {
    // Limit 2 -> 1: the lease that ends last keeps the row within the limit; the other, renewed
    // for longer, ends no later than it, so the row reopens only when nothing over the limit is
    // held; and an executor's release within the limit while the other is held reopens nothing.
    let app = TestApp::with_credential("k", 2).await;
    let short = app.lease(gpt4o_for(30)).await;
    let long = app.lease(gpt4o_for(60)).await;
    set_limit(&app, 1).await;
    let renewal = renew_body(&short, 600);
    let renewed = app.renew(renewal).ok_json().await;
    let until = |v: &Value| {
        time::OffsetDateTime::parse(
            v["lease_until"].as_str().unwrap(),
            &time::format_description::well_known::Rfc3339,
        )
        .unwrap()
    };
    assert!(until(&renewed) <= until(&long), "{renewed} outlives {long}");
    // the lease within the limit ends early: its row closes while the surplus lease is held
    app.release_ok(&long, "success").await;
    assert_eq!(
        granted_of(&app, INTERNAL_KEY, 2).await,
        0,
        "granted while the surplus lease was held"
    );
    app.release_ok(&short, "success").await;
    assert_eq!(granted_of(&app, INTERNAL_KEY, 2).await, 1);
}

#[tokio::test]
async fn a_release_all_that_waited_for_a_raised_limit_locks_the_new_slots_before_the_credential() {
    // A release-all queues behind a refit that raises the limit (its snapshot has no slot 1), and
    // an executor's release with an outcome of a lease on the new slot runs meanwhile, holding
    // that slot and waiting for the credential row. Before, the release-all locked the slot rows
    // its snapshot knew, then the credential row, then the new slot: a deadlock, 503 to both.
    let app = TestApp::with_credential("k", 1).await;
    app.lease(gpt4o_for(600)).await;
    let before = deadlocks(&app.db).await;

    // the limit is raised (committed), and the refit that follows is held before its commit
    app.run_sql("UPDATE credentials SET max_concurrent_uses = 2 WHERE key_id = 'k'")
        .await;
    let mut fit = transaction_holding(&app, &["SELECT credpool_fit_slots('k')"]).await;
    // someone holds the credential row next: queued behind the refit for the operator lock,
    // ahead of the release-all, it takes the row and lets the operator lock go, so the
    // release-all then waits for the row (two transactions that both wait for the refit's row
    // would take it in either order)
    let hold = &[
        "SELECT pg_advisory_lock(credpool_operator_lock('k'))",
        "SELECT 1 FROM credentials WHERE key_id = 'k' FOR NO KEY UPDATE",
        "SELECT pg_advisory_unlock(credpool_operator_lock('k'))",
    ];
    let holding = transaction_waiting(&app, connect(&app).await, hold, false).await;
    let release_all = {
        let app = app.remote();
        let body = json!({"reason": "test"});
        let path = "/api/admin/keys/k/release-all";
        tokio::spawn(async move {
            app.admin_unnamed(Method::POST, path, Some(body))
                .await
                .status()
        })
    };
    wait_for_lock_waiters(&app, 2).await;
    fit.execute("COMMIT").await.unwrap();
    let mut holder = holding.await.unwrap().unwrap();
    // the release-all now waits for the credential row (or, fixed, holds every slot row)
    wait_for_lock_waiters(&app, 1).await;
    // fixed: the release-all holds the new slot too, so nothing can be granted on it
    let executor = release_held_at_the_credential_row(&app, "k").await;
    holder.execute("COMMIT").await.unwrap();
    finished_without_deadlock(&app, release_all, "the release-all", executor, before).await;
}

/// The end of a three-way race: the operator's call answered 200 (`what` failed otherwise), the
/// executor's release (when it ran) succeeded, and PostgreSQL detected no deadlock since it
/// counted `before`.
async fn finished_without_deadlock(
    app: &TestApp,
    operator: tokio::task::JoinHandle<StatusCode>,
    what: &str,
    executor: Option<tokio::task::JoinHandle<Result<Vec<String>, sqlx::Error>>>,
    before: i64,
) {
    assert_eq!(operator.await.unwrap(), StatusCode::OK, "{what} failed");
    if let Some(releasing) = executor {
        releasing
            .await
            .unwrap()
            .expect("the executor's release failed");
    }
    assert_eq!(deadlocks(&app.db).await, before, "a deadlock was detected");
}

/// Leases gpt-4o from `default` and, if granted (it must be on `key_id`), releases it with an
/// outcome in a transaction of the test's own, returned once that release waits for a lock (the
/// credential row, which it takes after the lease's slot row). `None` (after asserting a 429)
/// when every slot of the pool is held by a transaction that locked them all.
async fn release_held_at_the_credential_row(
    app: &TestApp,
    key_id: &str,
) -> Option<tokio::task::JoinHandle<Result<Vec<String>, sqlx::Error>>> {
    let answer = app.allocate(gpt4o_for(600)).await;
    if answer.status() != StatusCode::OK {
        assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
        return None;
    }
    let lease = json_body(answer, StatusCode::OK).await;
    assert_eq!(lease["key_id"], key_id);
    let group = json!([group_release(&lease, "success")]);
    Some(release_group_waiting(app, group).await)
}

#[tokio::test]
async fn late_reports_of_the_same_leases_in_opposite_orders_never_deadlock() {
    // Two leases end (the reaper ended them); two release groups report outcomes for both, in
    // opposite orders. Each late report takes its lease's advisory lock before it looks for an
    // earlier report and writes its trail row, so the second group waits for the first's; taken
    // in request order, the first group (having reported `a`) would wait for `b` while the second
    // (having reported `b`) waits for `a`.
    let app = TestApp::with_credential("ka", 1).await;
    app.put_gpt4o_key("kb", "default", 1).await;
    let a = app.lease(gpt4o_for(600)).await;
    let b = app.lease(gpt4o_for(600)).await;
    expire_and_reap(&app).await;
    let report = |lease: &Value| group_release(lease, "failure");
    let before = deadlocks(&app.db).await;
    let mut first = connect(&app).await;
    first.execute("BEGIN").await.unwrap();
    // the first group has reported `a` (lower lease_id first, whichever of the two it is)
    let (low, high) = if a["lease_id"].as_str() < b["lease_id"].as_str() {
        (&a, &b)
    } else {
        (&b, &a)
    };
    sqlx::query("SELECT verdict FROM credpool_release($1, $2)")
        .bind(json!([report(low)]))
        .bind(policy())
        .fetch_all(&mut first)
        .await
        .unwrap();
    let reporting = release_group_waiting(&app, json!([report(high), report(low)])).await;
    let finished = sqlx::query("SELECT verdict FROM credpool_release($1, $2)")
        .bind(json!([report(high)]))
        .bind(policy())
        .fetch_all(&mut first)
        .await;
    finished.expect("the first group's report failed");
    first.execute("COMMIT").await.unwrap();
    reporting
        .await
        .unwrap()
        .expect("the second group's report failed");
    assert_eq!(deadlocks(&app.db).await, before);
    let reports: i64 = app
        .scalar("SELECT count(*) FROM lease_events WHERE event = 'outcome_after_expiry'")
        .await;
    assert_eq!(reports, 2, "each late report counts once");
}

#[tokio::test]
async fn two_puts_creating_one_key_never_write_its_slot_rows_after_its_credential_row() {
    // The first PUT of a new key is held before its commit (`fit.done`); a second PUT of the same
    // key queues behind it; once the first commits, the second is held where its update of the
    // credential row writes the new configuration into the slot rows (`config.before_slots`);
    // meanwhile an executor's release with an outcome holds a slot row of the key and waits for
    // the credential row. Before the operator lock, the second PUT had locked no slot row (the key
    // did not exist when it looked), so it then waited for that slot: a deadlock, 503.
    let app = TestApp::spawn_with_hooks("fit.done,config.before_slots").await;
    let before = deadlocks(&app.db).await;
    let put = |secret: &'static str| {
        let app = app.remote();
        tokio::spawn(async move {
            let body = spec("default", 2, secret);
            app.put_key_raw("new", body).await.status()
        })
    };
    let fit_hook = Hook::close(&app, "fit.done").await;
    let first = put("sk-first");
    wait_for_lock_waiters(&app, 1).await;
    let second = put("sk-second");
    wait_for_lock_waiters(&app, 2).await;
    let slots_hook = Hook::close(&app, "config.before_slots").await;
    fit_hook.open().await;
    assert_eq!(first.await.unwrap(), StatusCode::CREATED);
    // the second PUT waits at its slot update
    wait_for_lock_waiters(&app, 1).await;
    // fixed: the second PUT holds every slot row of the key while it waits: nothing to lease
    let releasing = release_held_at_the_credential_row(&app, "new").await;
    slots_hook.open().await;
    finished_without_deadlock(&app, second, "the second PUT", releasing, before).await;
}

#[tokio::test]
async fn a_short_renewal_within_a_lowered_limit_never_ends_it_before_the_surplus_lease() {
    // Limit 2 -> 1 with a 300 s and a 100 s lease: the 300 s one stays within the limit, the
    // 100 s one is surplus. Its executor renews the lease within the limit for 3 s (any renewal
    // with the default length does the same to a longer lease). Before, the row within the
    // limit then ended first and reopened 3 s later while the surplus lease still counted: a
    // second live lease on a credential of limit 1.
    let app = TestApp::with_credential("k", 2).await;
    let long = app.lease(gpt4o_for(300)).await;
    let short = app.lease(gpt4o_for(100)).await;
    set_limit(&app, 1).await;
    let until = |v: &Value| {
        time::OffsetDateTime::parse(
            v["lease_until"].as_str().unwrap(),
            &time::format_description::well_known::Rfc3339,
        )
        .unwrap()
    };
    let renewed = app.renew(renew_body(&long, 3)).ok_json().await;
    assert!(
        until(&renewed) >= until(&short),
        "the lease within the limit ({renewed}) now ends before the surplus lease ({short})"
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        granted_of(&app, INTERNAL_KEY, 2).await,
        0,
        "granted on a limit-1 credential while the surplus lease is live"
    );
    assert_eq!(app.in_flight("k").await, 2);
    // the surplus lease renewed: never an end before the renewal itself
    let renewed = app.renew(renew_body(&short, 30)).ok_json().await;
    let now: time::OffsetDateTime = app.scalar("SELECT now()").await;
    assert!(until(&renewed) > now, "renewed into the past: {renewed}");
    audit_passes(BIN, &app.database).await;
}

#[tokio::test]
async fn a_reported_rest_never_waits_for_the_credentials_other_slot_rows() {
    // A release that rests its credential holds its lease's slot row and then the credential row.
    // Were the rest to move the configuration version (as an operator's change of status does),
    // it would write the credential's other slot rows after its row, against the lock order: here
    // it would wait for the slot row another transaction holds, and a release of that lease would
    // then deadlock with it. The rest moves no version; the operator's disable does.
    let app = TestApp::with_credential("k", 2).await;
    let resting = app.lease(gpt4o_for(600)).await;
    let other = app.lease(gpt4o_for(600)).await;
    let version = "SELECT config_version FROM credentials WHERE key_id = 'k'";
    let before: i64 = app.scalar(version).await;
    let mut holder = connect(&app).await;
    holder.execute("BEGIN").await.unwrap();
    sqlx::query("SELECT 1 FROM lease_slots WHERE lease_id = $1::uuid FOR UPDATE")
        .bind(other["lease_id"].as_str().unwrap())
        .execute(&mut holder)
        .await
        .unwrap();
    let mut report = release_body(&resting, "rate_limited");
    report["retry_after_seconds"] = json!(120);
    let releasing = {
        let remote = app.remote();
        tokio::spawn(async move { remote.release(report).await })
    };
    let answer = tokio::time::timeout(Duration::from_secs(30), releasing)
        .await
        .expect("the release waited for the other lease's slot row")
        .unwrap();
    assert_eq!(json_body(answer, StatusCode::OK).await["released"], true);
    holder.execute("COMMIT").await.unwrap();
    assert_eq!(app.credential("k").await["status"], "rate_limited");
    assert_eq!(app.scalar::<i64>(version).await, before);
    let status = app
        .patch_key("k", json!({"state": "disable"}))
        .await
        .status();
    assert_eq!(status, StatusCode::OK);
    assert!(app.scalar::<i64>(version).await > before);
}
