//! Helpers of the api suite alone, beside the kit (`credpool-test-support`): claims sent straight
//! to `credpool_claim`, as the service sends them, for the tests that step a claim by hand, and
//! two `credpool serve` replicas of this package's binary, and a tenant's allocations raced.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use sqlx::Row;

use credpool_test_support::*;

use crate::BIN;

/// One claim over `ranked` (gpt-4o from openai's `pool`, 600 seconds, holder `test`) as the
/// service sends it to `credpool_claim`, under `request_id` if given.
pub fn claim_body(ranked: &[&str], pool: &str, request_id: Option<&str>) -> Value {
    json!([{
        "ranked": ranked, "provider": "openai", "pool": pool, "model": "gpt-4o",
        "lease_id": uuid::Uuid::new_v4(), "holder": "test", "lease_seconds": 600,
        "request_id": request_id, "request_digest": request_id.map(|_| "digest"),
    }])
}

/// The hex SHA-256 of tenant key `key`, as a claim names its tenant (`key_hash`).
async fn key_hash(app: &TestApp, key: &str) -> String {
    app.scalar_of("SELECT encode(sha256(convert_to($1, 'UTF8')), 'hex')", key)
        .await
}

/// What a claim answered: the credential it granted (if any) and its `request`.
pub type ClaimAnswer = Result<(Option<String>, Option<String>), sqlx::Error>;

/// A claim for tenant key hash `hash` of a slot of `ranked` in `pool` (gpt-4o from openai, 600
/// seconds, holder `paused`), on connection `conn` (which stops at the test hooks it was given):
/// its answer once it finishes.
fn paused_claim(
    mut conn: sqlx::PgConnection,
    ranked: &str,
    pool: &str,
    hash: &str,
) -> tokio::task::JoinHandle<ClaimAnswer> {
    let body = json!([{
        "ranked": [ranked], "provider": "openai", "pool": pool, "model": "gpt-4o",
        "lease_id": uuid::Uuid::new_v4(), "holder": "paused", "lease_seconds": 600,
        "key_hash": hash,
    }]);
    tokio::spawn(async move {
        sqlx::query("SELECT key_id, request FROM credpool_claim($1)")
            .bind(body)
            .fetch_one(&mut conn)
            .await
            .map(|row| {
                (
                    row.get::<Option<String>, _>(0),
                    row.get::<Option<String>, _>(1),
                )
            })
    })
}

/// A claim for tenant key `key`'s tenant of a slot of `ka` in pool `a`, on a connection of its
/// own that stops at test hook `point` (closed here): returns once the claim waits there, with
/// the hook (to open) and the claim's answer to come ([`claim_answer`]).
pub async fn pause_claim(
    app: &TestApp,
    key: &str,
    point: &'static str,
) -> (Hook, tokio::task::JoinHandle<ClaimAnswer>) {
    let hash = key_hash(app, key).await;
    let hook = Hook::close(app, point).await;
    let mut conn = hooked(app, point).await;
    let pid = backend_pid(&mut conn).await;
    let claiming = paused_claim(conn, "ka", "a", &hash);
    until_waiting(app, pid).await;
    (hook, claiming)
}

/// What a paused claim answered once its hook opened: the credential it granted (if any) and
/// its `request`. Panics unless it finishes within 30 seconds, without an error.
pub async fn claim_answer(
    claiming: tokio::task::JoinHandle<ClaimAnswer>,
) -> (Option<String>, Option<String>) {
    tokio::time::timeout(Duration::from_secs(30), claiming)
        .await
        .expect("the claim finished")
        .unwrap()
        .expect("the claim failed")
}

/// The app with a credential of 4 slots in each of two pools: `ka` in pool `a` (which the
/// claims paused here take) and `kb` in pool `b` (which the tenant's other requests take).
pub async fn app_with_pools_a_and_b() -> TestApp {
    let app = TestApp::spawn().await;
    app.put_gpt4o_key("ka", "a", 4).await;
    app.put_gpt4o_key("kb", "b", 4).await;
    app
}

/// A claim of `key`'s tenant for `ka` in pool `a` paused at test hook `point` ([`pause_claim`])
/// while the service grants the tenant a lease of `kb` in pool `b` and commits; then the hook
/// opens: the paused claim must grant nothing and answer `tenant_limit` (`why`: the rule it
/// would break otherwise), and `tenant` holds that one grant alone (one `granted` event, one
/// live slot), which the audit proves.
pub async fn claim_refused_after_a_grant(
    app: &TestApp,
    (tenant, key): (&str, &str),
    point: &'static str,
    why: &str,
) {
    let (hook, claiming) = pause_claim(app, key, point).await;
    // the paused claim holds no tenant row yet: the service's grant commits meanwhile
    let granted = app.lease_as(key, "b").await;
    assert_eq!(granted["key_id"], "kb");
    hook.open().await;
    let (key_id, request) = claim_answer(claiming).await;
    assert_eq!(key_id, None, "{why}");
    assert_eq!(request.as_deref(), Some("tenant_limit"));
    for (what, count) in [
        (
            "granted events",
            "SELECT count(*) FROM lease_events WHERE event = 'granted' AND tenant = $1",
        ),
        (
            "live slots",
            "SELECT count(*) FROM lease_slots WHERE tenant = $1 AND lease_until > now()",
        ),
    ] {
        let counted: i64 = app.scalar_of(count, tenant).await;
        assert_eq!(counted, 1, "{what}: {why}");
    }
    audit_passes(BIN, &app.database).await;
}

/// `n` simultaneous allocations of gpt-4o from `default` for 600 seconds with executor key
/// `key`: how many were granted. Panics on any answer but 200 and 429.
pub async fn granted_of(app: &TestApp, key: &str, n: usize) -> usize {
    let answers =
        futures::future::join_all((0..n).map(|_| app.allocate_as(key, gpt4o_for(600)))).await;
    let mut granted = 0;
    for answer in answers {
        match answer.status() {
            StatusCode::OK => granted += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("allocate answered {other}"),
        }
    }
    granted
}

/// Two `credpool serve` processes on a fresh database, with credentials k0..k`count` of limit
/// `limit` (provider openai, model gpt-4o, pool default).
pub async fn two_replicas(count: usize, limit: u32) -> (TestDatabase, ServeProcess, ServeProcess) {
    let database = TestDatabase::create().await;
    let env = keyed_env(&database);
    let (a, b) = tokio::join!(
        ServeProcess::start(BIN, &env, &[]),
        ServeProcess::start(BIN, &env, &[])
    );
    for i in 0..count {
        let response = a
            .admin(
                Method::PUT,
                &format!("/api/admin/keys/k{i}"),
                Some(
                    json!({"provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": limit,
                        "secret": {"api_key": format!("sk-{i}")}}),
                ),
            )
            .await;
        assert!(response.status().is_success());
    }
    (database, a, b)
}

/// Allocates every body of `bodies` at once with tenant key `key`, spread over `replicas`: the
/// leases granted, and the `Retry-After` (seconds) of every 429 `tenant_limit`; any other
/// answer panics.
pub async fn race_tenant(
    replicas: &[Remote],
    key: &str,
    bodies: Vec<Value>,
) -> (Vec<Value>, Vec<u64>) {
    let mut granted = Vec::new();
    let mut refused = Vec::new();
    for answer in allocate_at_once(replicas, key, bodies).await {
        let body = answer.body;
        match answer.status {
            StatusCode::OK => granted.push(body),
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(body["error"]["code"], "tenant_limit", "{body}");
                refused.push(answer.retry_after.expect("Retry-After on tenant_limit"));
            }
            other => panic!("unexpected {other}: {body}"),
        }
    }
    (granted, refused)
}

/// What an import of `entries` (key id, provider) carries: available credentials of pool
/// `default` serving gpt-4o, with `limit` slots each.
pub fn import_specs(
    entries: &[(&str, &str)],
    limit: u32,
) -> Vec<credpool::store::credentials::CredentialSpec> {
    entries
        .iter()
        .map(|(key, provider)| {
            let input: credpool::store::credentials::CredentialInput =
                serde_json::from_value(json!({
                    "provider": provider, "pool": "default", "models": ["gpt-4o"],
                    "max_concurrent_uses": limit, "status": "available",
                    "secret": {"api_key": format!("sk-test-{key}")},
                }))
                .unwrap();
            input
                .into_spec(credpool::domain::KeyId::parse(*key).unwrap(), &keyring())
                .unwrap()
        })
        .collect()
}
