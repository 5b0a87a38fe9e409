//! Audit in SQL and the cleanup functions: reaping, recorded recoveries, retention, lease
//! lifetimes, the oversell proof (`credpool audit verify`), the tenant window proof, the
//! in-process scheduler, and pg_cron actually running the cleanup in a cluster that preloads it.

use std::time::Duration;

use credpool::embedded::EmbeddedCluster;
use credpool::store::audit;
use credpool::store::maintenance::{self, Skipped};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use sqlx::Connection;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use credpool_test_support::*;

use crate::BIN;

mod checkpoints;

/// An allocate body of gpt-4o for `seconds`, held by `auditor`.
fn audited(seconds: u32) -> Value {
    json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": seconds, "holder": "auditor"})
}

async fn scalar_i32(app: &TestApp, sql: &'static str) -> i32 {
    sqlx::query_scalar(sql).fetch_one(&app.db).await.unwrap()
}

/// Runs `sql` once for each of `answers`, asserting that the calls answer them in turn.
async fn calls_answer(app: &TestApp, sql: &'static str, answers: &[i32]) {
    for (call, answer) in answers.iter().enumerate() {
        assert_eq!(scalar_i32(app, sql).await, *answer, "call {call} of {sql}");
    }
}

#[tokio::test]
async fn the_reaper_ends_expired_leases_in_the_trail_in_bounded_batches_and_is_idempotent() {
    let app = TestApp::with_credential("key-a", 4).await;
    let leases = [
        app.lease(audited(1)).await,
        app.lease(audited(1)).await,
        app.lease(audited(1)).await,
    ];
    let live = app.lease(audited(600)).await.to_string();
    assert!(live.contains("lease_id"));
    calls_answer(&app, "SELECT credpool_reap_expired_leases(10)", &[0]).await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    calls_answer(&app, "SELECT credpool_reap_expired_leases(2)", &[2, 1, 0]).await;
    for l in &leases {
        assert_eq!(app.lease_events(l).await, ["granted", "expired"]);
    }
    let active: i64 = app.scalar("SELECT count(*) FROM active_leases").await;
    assert_eq!(active, 1);
}

#[tokio::test]
async fn ended_cooldowns_are_recorded_once_and_the_status_waits_for_the_probe() {
    let app = TestApp::with_credential("key-a", 1).await;
    app.set_status("key-a", "cooldown", Some(0.5)).await;
    calls_answer(&app, "SELECT credpool_recover_cooldowns()", &[0]).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    calls_answer(&app, "SELECT credpool_recover_cooldowns()", &[1, 0]).await;
    let status: String = app.scalar("SELECT status FROM credentials").await;
    assert_eq!(status, "cooldown");
    // usable: the next lease is the probe
    assert_eq!(app.lease(audited(60)).await["probe"], true);
}

#[tokio::test]
async fn purging_deletes_history_past_retention_but_never_that_of_a_held_lease() {
    let app = TestApp::with_credential("key-a", 1).await;
    let held = app.lease(audited(600)).await;
    // old history: a finished lease 40 days ago, and an old row of the lease still held
    app.run_sql_with("INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at)
         VALUES ('granted', gen_random_uuid(), 'key-a', 'openai', 'default', 0, now() - interval '40 days', now() - interval '40 days' - interval '1 minute'),
                ('renewed', $1::text::uuid, 'key-a', 'openai', 'default', 0, now() + interval '1 hour', now() - interval '40 days')", held["lease_id"].as_str()).await;
    let before: i64 = app.scalar("SELECT count(*) FROM lease_events").await;
    let purged = scalar_i32(
        &app,
        "SELECT credpool_purge_audit(interval '30 days', 1000)",
    )
    .await;
    assert_eq!(purged, 1);
    let after: i64 = app.scalar("SELECT count(*) FROM lease_events").await;
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
    let app = TestApp::with_credential("key-a", 4).await;
    let released = app.lease(audited(600)).await;
    let renew = lease_ref(&released);
    app.renew(renew).ok_json().await;
    app.release(release_body(&released, "failure"))
        .ok_json()
        .await;
    let expired = app.lease(audited(1)).await;
    let forced = app.lease(audited(600)).await;
    let held = app.lease(audited(600)).await;
    app.run_sql("SELECT credpool_reap_expired_leases()").await;
    let response = app
        .force_release(forced["lease_id"].as_str().unwrap(), "test")
        .await;
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
    let app = TestApp::with_credential("solo", 1).await;
    for _ in 0..3 {
        let l = app.lease(audited(600)).await;
        app.release(release_body(&l, "success")).ok_json().await;
    }
    let output = audit_passes(BIN, &app.database).await;
    assert!(
        output.contains("no grant ever exceeded a limit"),
        "{output}"
    );

    // two hours ago, a second lease on the limit-1 credential while the first was held: written
    // straight into the trail, as a bug in the claim would have
    app.run_sql("INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at)
         VALUES ('granted', gen_random_uuid(), 'solo', 'openai', 'default', 0, now() - interval '110 minutes', now() - interval '120 minutes'),
                ('granted', gen_random_uuid(), 'solo', 'openai', 'default', 0, now() - interval '110 minutes', now() - interval '115 minutes')").await;
    audit_fails(BIN, &app.database, &["solo", "1 grants exceeded a limit"]).await;
}

#[tokio::test]
async fn lowering_a_limit_under_load_is_not_an_oversell_but_a_grant_above_it_is() {
    let app = TestApp::with_credential("shrink", 3).await;
    let leases = [
        app.lease(audited(600)).await,
        app.lease(audited(600)).await,
        app.lease(audited(600)).await,
    ];
    app.put_gpt4o_key("shrink", "default", 1).await;
    let (ok, output) = audit_verify(BIN, &app.database).await;
    assert!(
        ok,
        "three leases held under a lowered limit revoke nothing and are no oversell: {output}"
    );
    for l in &leases {
        app.release(release_body(l, "success")).ok_json().await;
    }
    // the service grants again within the lowered limit: one lease, held to the end
    let _held = app.lease(audited(600)).await;
    audit_passes(BIN, &app.database).await;
    // a second grant beside it, written straight into the trail as a claim that read the old
    // limit would have: two live leases, within the limit of 3 the credential once had but
    // over the 1 it has had since
    app.run_sql(
        "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at)
         VALUES ('granted', gen_random_uuid(), 'shrink', 'openai', 'default', 1,
                 now() + interval '10 minutes', now())",
    )
    .await;
    audit_fails(BIN, &app.database, &["shrink", "1 grants exceeded a limit"]).await;
}

#[tokio::test]
async fn grants_older_than_the_oldest_configuration_row_kept_are_judged_by_the_limit_it_changed() {
    // Retention purged the credential's `created` row; the oldest row kept lowered its limit from
    // 4 to 2 a minute ago, while 4 leases granted ten minutes ago were held. Those grants were
    // within the limit of their time (4): the proof must take it from that row's `old`, not
    // judge them by today's 2.
    let app = TestApp::with_credential("aged", 2).await;
    sqlx::raw_sql(
        "DELETE FROM credential_events WHERE key_id = 'aged';
         INSERT INTO credential_events (key_id, event, reason, actor, details, at)
         VALUES ('aged', 'updated', 'updated', 'test',
                 '{\"old\": {\"max_concurrent_uses\": 4}, \"new\": {\"max_concurrent_uses\": 2}}',
                 now() - interval '1 minute');
         INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at)
         SELECT 'granted', gen_random_uuid(), 'aged', 'openai', 'default', s,
                now() + interval '10 minutes', now() - interval '10 minutes' + s * interval '1 s'
         FROM generate_series(0, 3) s",
    )
    .execute(&app.db)
    .await
    .unwrap();
    audit_passes(BIN, &app.database).await;
}

#[tokio::test]
async fn a_grant_over_a_tenants_cap_written_into_the_trail_fails_audit_verify() {
    // The tenant cap proof must be able to fail: the service never grants past a cap, so the
    // grant past it is written straight into the trail, as a claim that missed the tenant's
    // slot rows would have. The cap was 2 and is 1 when the fabricated grant is made, so a
    // proof that judged by the highest cap ever set would pass it too.
    let app = TestApp::spawn().await;
    app.put_gpt4o_key("east", "east", 4).await;
    app.put_gpt4o_key("west", "west", 4).await;
    let key = app.capped_tenant("team", 2).await;
    // held to the end
    app.lease_as(&key, "east").await;
    let second = app.lease_as(&key, "west").await;
    let release = app.release_as(&key, lease_ref(&second));
    release.ok_json().await;
    app.put_tenant("team", json!({"max_concurrent_leases": 1}))
        .await;
    let (ok, output) = audit_verify(BIN, &app.database).await;
    assert!(
        ok,
        "two leases under a cap of 2, then one under 1: {output}"
    );
    assert!(
        output.contains("no grant ever exceeded a tenant's cap"),
        "{output}"
    );

    // beside the tenant's live lease on east, a second one on west, now that its cap is 1
    app.run_sql(
        "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at,
                                   tenant)
         VALUES ('granted', gen_random_uuid(), 'west', 'openai', 'west', 1,
                 now() + interval '10 minutes', now(), 'team')",
    )
    .await;
    audit_fails(
        BIN,
        &app.database,
        &["team", "1 grants exceeded a tenant's cap"],
    )
    .await;
}

#[tokio::test]
async fn a_limit_lowered_while_a_claim_commits_judges_that_grant_by_the_limit_it_was_admitted_under()
 {
    // A change of limit takes effect once its transaction holds the credential's slot rows; a
    // grant committed while it waited for them was admitted under the old limit, and the trail
    // dates the change after it (its audit row is written at clock_timestamp(), after the locks).
    let app = TestApp::with_credential("busy", 3).await;
    app.lease(audited(600)).await;
    app.lease(audited(600)).await;
    // a transaction holds slot 0: the change queues behind it, after its own transaction began
    let holder = holding(
        &app,
        &["SELECT 1 FROM lease_slots WHERE key_id = 'busy' AND slot = 0 FOR UPDATE"],
    )
    .await;
    let change = tokio::spawn(
        app.client
            .patch(app.url("/api/admin/keys/busy"))
            .header("x-admin-key", ADMIN_KEY)
            .json(&json!({"max_concurrent_uses": 2}))
            .send(),
    );
    // the change queues behind the held transaction
    wait_for_lock_waiters(&app, 1).await;
    // meanwhile a third lease, within the limit of 3 (slot 2 is not locked yet)
    app.lease(audited(600)).await;
    holder.commit().await.unwrap();
    json_body(change.await.unwrap().unwrap(), StatusCode::OK).await;
    let (ok, output) = audit_verify(BIN, &app.database).await;
    assert!(
        ok,
        "a grant admitted before the lowered limit took effect was judged by it: {output}"
    );
}

// The tenant window proof (`credpool_tenant_window_check`): a tenant's grants over all its
// credentials against the rate windows it had at each grant. The claim enforces them, so only a
// trail written straight into the tables (as a broken claim would have) can break them.

/// `PUT /api/admin/tenants/{id}` with `rate_limits`, then a key minted for it: the key.
async fn windowed_tenant(app: &TestApp, id: &str, rate_limits: Value) -> String {
    let put = app
        .admin_unnamed(
            Method::PUT,
            &format!("/api/admin/tenants/{id}"),
            Some(json!({ "rate_limits": rate_limits, "pools": ["*/*"] })),
        )
        .await;
    assert_eq!(put.status(), StatusCode::CREATED);
    let minted = app
        .admin_unnamed(Method::POST, &format!("/api/admin/tenants/{id}/keys"), None)
        .await;
    json_body(minted, StatusCode::CREATED).await["key"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// A trail written straight into `tenants`, `tenant_events` and `lease_events`, as the service
/// (or a broken claim) would have written it: every row at `t0` plus whole seconds, `t0` an hour
/// ago on the database clock. A lease is named by the test; its lease_id is the name's MD5.
struct Trail {
    db: sqlx::PgPool,
    t0: OffsetDateTime,
}

impl Trail {
    async fn new(db: sqlx::PgPool) -> Self {
        let t0 = db
            .scalar("SELECT date_trunc('second', now()) - interval '1 hour'")
            .await;
        Self { db, t0 }
    }

    /// `t0` + `seconds`.
    fn at(&self, seconds: i64) -> OffsetDateTime {
        self.t0 + time::Duration::seconds(seconds)
    }

    /// Tenant `tenant` created (the first time) or updated at `t0` + `seconds` with
    /// `rate_limits`: its `tenants` row and its `tenant_events` row.
    async fn configure(&self, tenant: &str, seconds: i64, rate_limits: Value) {
        sqlx::query(
            "WITH t AS (
                 INSERT INTO tenants AS t (tenant_id, rate_limits) VALUES ($1, $2)
                 ON CONFLICT (tenant_id) DO UPDATE SET rate_limits = EXCLUDED.rate_limits
                 RETURNING (xmax = 0) AS created)
             INSERT INTO tenant_events (tenant_id, event, weight, rate_limits, actor, at)
             SELECT $1, CASE WHEN t.created THEN 'created' ELSE 'updated' END, 1, $2, 'test', $3
             FROM t",
        )
        .bind(tenant)
        .bind(rate_limits)
        .bind(self.at(seconds))
        .execute(&self.db)
        .await
        .unwrap();
    }

    /// Lease `lease` of `tenant` granted on `key_id` at `t0` + `seconds`, reserving `tokens`.
    async fn grant(&self, tenant: &str, lease: &str, key_id: &str, seconds: i64, tokens: i64) {
        sqlx::query(
            "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at,
                                       tokens, tenant)
             VALUES ('granted', md5($1)::uuid, $2, 'openai', 'default', 0, $3 + interval '60 seconds',
                     $3, $4, $5)",
        )
        .bind(lease)
        .bind(key_id)
        .bind(self.at(seconds))
        .bind(tokens)
        .bind(tenant)
        .execute(&self.db)
        .await
        .unwrap();
    }

    /// Lease `lease` released at `t0` + `seconds`, reporting a usage of `tokens`.
    async fn release(&self, lease: &str, seconds: i64, tokens: i64) {
        sqlx::query(
            "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, outcome,
                                       lease_until, at, tokens, tenant)
             SELECT 'released', lease_id, key_id, provider, pool, slot, 'success', lease_until, $2,
                    $3, tenant
             FROM lease_events WHERE lease_id = md5($1)::uuid AND event = 'granted'",
        )
        .bind(lease)
        .bind(self.at(seconds))
        .bind(tokens)
        .execute(&self.db)
        .await
        .unwrap();
    }

    /// The tenant window proof from 5 minutes before `t0` to now, a [`line`] per row.
    /// Panics unless the tenant window proof finds `lines`, one a tenant and window, and
    /// `audit verify` of `database` fails saying that one grant exceeded a tenant's window, and
    /// each of `findings`.
    async fn one_grant_over_a_window(
        &self,
        database: &TestDatabase,
        lines: &[Line],
        findings: &[&str],
    ) {
        assert_eq!(self.proof().await, lines);
        let mut said = vec!["tenant rate windows: 1 grants exceeded a tenant's window"];
        said.extend(findings);
        audit_fails(BIN, database, &said).await;
    }

    async fn proof(&self) -> Vec<Line> {
        let until = audit::database_now(&self.db).await.unwrap();
        audit::tenant_window_check(&self.db, self.at(-300), until)
            .await
            .unwrap()
            .into_iter()
            .map(|r| {
                let figures = [r.window_count, r.grants, r.peak, r.grants_over_window];
                line(
                    r.subject.id(),
                    &r.kind,
                    r.seconds,
                    figures,
                    r.first_violation_at,
                )
            })
            .collect()
    }
}

/// A row of the tenant window proof: tenant, kind, seconds, [window count, grants, peak, grants
/// over window], first violation.
type Line = (String, String, i32, [i64; 4], Option<OffsetDateTime>);

fn line(
    tenant: &str,
    kind: &str,
    seconds: i32,
    figures: [i64; 4],
    first_violation_at: Option<OffsetDateTime>,
) -> Line {
    (
        tenant.to_owned(),
        kind.to_owned(),
        seconds,
        figures,
        first_violation_at,
    )
}

#[tokio::test]
async fn a_tenants_grants_over_two_credentials_within_its_token_window_pass_the_tenant_window_proof()
 {
    let app = TestApp::spawn().await;
    app.put_gpt4o_key("east", "east", 4).await;
    app.put_gpt4o_key("west", "west", 4).await;
    let key = windowed_tenant(&app, "team", json!([{"tokens": 1000, "seconds": 600}])).await;
    let allocate = |key: String, pool: &'static str, tokens: u64| {
        let url = app.url("/api/internal/allocate-key");
        let client = app.client.clone();
        async move {
            let body = json!({"provider": "openai", "model": "gpt-4o", "pool": pool,
                              "tokens": tokens, "lease_seconds": 600});
            let lease = post_json(&client, &url, ("x-internal-key", &key), body)
                .ok_json()
                .await;
            assert_eq!(lease["key_id"], pool);
            lease
        }
    };
    // the tenant reserves 300 on each credential, and its first lease reports 350 used
    let first = allocate(key.clone(), "east", 300).await;
    allocate(key.clone(), "west", 300).await;
    let mut release = release_body(&first, "success");
    release["usage"] = json!({"tokens": 350});
    let released = post_json(
        &app.client,
        &app.url("/api/internal/release-key"),
        ("x-internal-key", &key),
        release,
    )
    .await;
    assert_eq!(json_body(released, StatusCode::OK).await["released"], true);
    // another tenant (the internal key's, without windows) reserves 800 on the same credentials
    // meanwhile: none of it is the tenant's
    allocate(INTERNAL_KEY.to_owned(), "east", 400).await;
    allocate(INTERNAL_KEY.to_owned(), "west", 400).await;
    // 350 used + 300 reserved + 300 = 950 of the tenant's 1000
    allocate(key.clone(), "east", 300).await;

    let until = audit::database_now(&app.db).await.unwrap();
    let since = until - time::Duration::hours(1);
    let proof = audit::tenant_window_check(&app.db, since, until)
        .await
        .unwrap();
    assert_eq!(proof.len(), 1, "{proof:?}");
    let team = &proof[0];
    assert_eq!(
        (
            team.subject.id(),
            team.kind.as_str(),
            team.seconds,
            team.window_count
        ),
        ("team", "tokens", 600, 1000)
    );
    assert_eq!(
        (team.grants, team.peak, team.grants_over_window),
        (3, 950, 0),
        "{team:?}"
    );
    assert_eq!(team.first_violation_at, None);
    let output = audit_passes(BIN, &app.database).await;
    assert!(
        output.contains("1000 tokens / 600 s")
            && output.contains("tenant rate windows: no grant ever exceeded a tenant's window"),
        "{output}"
    );
}

#[tokio::test]
async fn a_grant_over_a_tenants_window_written_into_the_trail_fails_audit_verify_at_that_grant() {
    let database = TestDatabase::create().await;
    let trail = Trail::new(database.pool(2).await).await;
    trail
        .configure("team", 0, json!([{"tokens": 100, "seconds": 60}]))
        .await;
    trail.grant("team", "t1", "east", 10, 40).await;
    trail.grant("team", "t2", "west", 20, 40).await;
    // another tenant's grant in the same window is not the tenant's
    trail.grant("other", "o1", "east", 25, 50).await;
    // 40 + 40 + 30 over a window of 100, on the first credential again: what a claim that lost
    // the tenant's window would have granted
    trail.grant("team", "t3", "east", 30, 30).await;
    // (t0 + 10, t0 + 70] holds 40 + 30 + 30: room again at the very moment the first grant
    // leaves the window
    trail.grant("team", "t4", "west", 70, 30).await;
    trail
        .one_grant_over_a_window(
            &database,
            &[line(
                "team",
                "tokens",
                60,
                [100, 4, 110, 1],
                Some(trail.at(30)),
            )],
            &[
                "team",
                "100 tokens / 60 s",
                "no grant ever exceeded a limit",
            ],
        )
        .await;
    let verified = audit_verify_json(BIN, &database.url()).await;
    let (ok, report) = (verified.success, verified.report());
    assert!(!ok, "{report}");
    assert_eq!(report["grants_over_tenant_window"], 1, "{report}");
    assert_eq!(
        report["tenant_windows"][0]["first_violation_at"],
        trail.at(30).format(&Rfc3339).unwrap(),
        "{report}"
    );
}

#[tokio::test]
async fn a_usage_counts_against_the_tenants_grants_after_its_report_and_never_before() {
    let database = TestDatabase::create().await;
    let trail = Trail::new(database.pool(2).await).await;
    for tenant in ["later", "first"] {
        trail
            .configure(tenant, 0, json!([{"tokens": 100, "seconds": 60}]))
            .await;
    }
    // 50 + 50 reserved; the first lease's usage of 90 is reported after the second grant, which
    // therefore was admitted into a window holding 100, not 140
    trail.grant("later", "l1", "east", 1, 50).await;
    trail.grant("later", "l2", "west", 5, 50).await;
    trail.release("l1", 10, 90).await;
    trail.release("l2", 12, 50).await;
    // the first lease's usage of 90 is reported before the second grant: 90 + 20 is over 100
    trail.grant("first", "f1", "east", 1, 50).await;
    trail.release("f1", 3, 90).await;
    trail.grant("first", "f2", "west", 5, 20).await;
    trail.release("f2", 6, 20).await;
    // a usage below the reservation gives the difference back from its report: 10 + 60, not
    // 80 + 60, in (t0 + 42, t0 + 102]
    trail.grant("first", "f3", "east", 100, 80).await;
    trail.release("f3", 101, 10).await;
    trail.grant("first", "f4", "west", 102, 60).await;
    trail
        .one_grant_over_a_window(
            &database,
            &[
                line("first", "tokens", 60, [100, 4, 110, 1], Some(trail.at(5))),
                line("later", "tokens", 60, [100, 2, 100, 0], None),
            ],
            &[],
        )
        .await;
}

#[tokio::test]
async fn a_tenants_grant_is_judged_by_the_windows_the_tenant_had_when_it_was_granted() {
    let database = TestDatabase::create().await;
    let trail = Trail::new(database.pool(2).await).await;
    let (two, four, one) = (
        json!([{"requests": 2, "seconds": 60}]),
        json!([{"requests": 4, "seconds": 60}]),
        json!([{"requests": 1, "seconds": 60}]),
    );
    // no windows at first: two grants 10 s apart, judged by nothing (the windows set later
    // would find them over)
    trail.configure("shifting", -120, json!([])).await;
    trail.grant("shifting", "s0", "east", -100, 0).await;
    trail.grant("shifting", "s1", "west", -90, 0).await;
    trail.configure("shifting", 0, two.clone()).await;
    trail.grant("shifting", "s2", "east", 10, 0).await;
    trail.grant("shifting", "s3", "west", 20, 0).await;
    // raised to 4: the third and fourth grant in the minute are within it (over the earlier 2)
    trail.configure("shifting", 30, four.clone()).await;
    trail.grant("shifting", "s4", "east", 40, 0).await;
    trail.grant("shifting", "s5", "west", 50, 0).await;
    // lowered to 1: nothing granted before is over it; one grant a minute from then on
    trail.configure("shifting", 55, one.clone()).await;
    trail.grant("shifting", "s6", "east", 115, 0).await;
    trail.grant("shifting", "s7", "west", 130, 0).await;

    let windows_at = |tenant: &'static str, seconds: i64| {
        sqlx::query_scalar::<_, Value>("SELECT credpool_tenant_rate_limits_at($1, $2)")
            .bind(tenant)
            .bind(trail.at(seconds))
            .fetch_one(&trail.db)
    };
    assert_eq!(windows_at("shifting", -100).await.unwrap(), json!([]));
    assert_eq!(windows_at("shifting", 29).await.unwrap(), two);
    assert_eq!(windows_at("shifting", 30).await.unwrap(), four);
    assert_eq!(windows_at("shifting", 130).await.unwrap(), one);
    // no configuration row yet: the current windows; no such tenant: none
    assert_eq!(windows_at("shifting", -121).await.unwrap(), one);
    assert_eq!(windows_at("nobody", 0).await.unwrap(), json!([]));

    // six grants judged (not the two made without windows), the one over its window at t0 + 130
    trail
        .one_grant_over_a_window(
            &database,
            &[line(
                "shifting",
                "requests",
                60,
                [4, 6, 4, 1],
                Some(trail.at(130)),
            )],
            &["shifting"],
        )
        .await;
}

#[tokio::test]
async fn the_in_process_scheduler_runs_on_one_replica_and_steps_aside_for_pg_cron() {
    let app = TestApp::with_credential("key-a", 2).await;
    app.lease(audited(1)).await;
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

    app.run_sql("INSERT INTO maintenance_schedule (scheduler) VALUES ('pg_cron')")
        .await;
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
    let dir = tmp_dir("credpool-cron-");
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
    let scheduled: i64 = db
        .scalar("SELECT count(*) FROM cron.job WHERE jobname LIKE 'credpool:%'")
        .await;
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

    // pg_cron schedules by the minute: wait for a tick (at most a little over two minutes), and
    // for its run to end (the pass commits step by step, so the lease is reaped before the run
    // is recorded as succeeded)
    let mut reaped = false;
    let mut runs: Vec<(String, Option<String>)> = Vec::new();
    for _ in 0..75 {
        let expired: i64 = db
            .scalar("SELECT count(*) FROM lease_events WHERE event = 'expired'")
            .await;
        reaped = expired == 1;
        runs = sqlx::query_as(
            "SELECT status, return_message FROM cron.job_run_details ORDER BY runid",
        )
        .fetch_all(&db)
        .await
        .unwrap();
        let ended = runs
            .iter()
            .any(|(status, _)| status == "succeeded" || status == "failed");
        if reaped && ended {
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    assert!(
        reaped,
        "pg_cron did not reap the expired lease; runs: {runs:?}"
    );
    assert!(
        runs.iter().any(|(status, _)| status == "succeeded"),
        "{runs:?}"
    );
    let free: i64 = db
        .scalar("SELECT count(*) FROM lease_slots WHERE lease_id IS NULL")
        .await;
    assert_eq!(free, 1);
    db.close().await;
    cluster.stop().await;
}
