//! OAuth credentials, against a mock token endpoint on 127.0.0.1 (`oauth_mock`: it counts calls,
//! rotates the refresh token on every success, answers `invalid_grant` to a refresh token already
//! used, and can answer slowly, with 503 or with `invalid_grant`). Times are kept short with `refresh_before_seconds`; a test "moves the
//! clock" by raising `refresh_before_seconds` in the database (the token is then due at once).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use credpool::oauth::{OAuthSettings, Refresher};
use credpool_test_support::oauth_mock::{ANSWERS, Mock, Mode, fast_refresher, mock_endpoint};
use credpool_test_support::*;

use crate::BIN;

async fn app() -> TestApp {
    let mut options = AppOptions::default();
    options.settings.oauth = fast_refresher();
    TestApp::spawn_with(options).await
}

fn rfc3339(at: OffsetDateTime) -> String {
    at.format(&Rfc3339).unwrap()
}

/// PUTs OAuth credential `k` (openai, default, gpt-4o, limit 4) whose access token `at-0`
/// expires in `expires_in` seconds; returns the response.
async fn put_oauth(
    app: &TestApp,
    token_url: &str,
    expires_in: i64,
    refresh_before: u32,
) -> reqwest::Response {
    put_oauth_limit(app, token_url, expires_in, refresh_before, 4).await
}

/// [`put_oauth`], which must store a new credential (201 Created).
async fn store_oauth(app: &TestApp, token_url: &str, expires_in: i64, refresh_before: u32) {
    assert_eq!(
        put_oauth(app, token_url, expires_in, refresh_before)
            .await
            .status(),
        StatusCode::CREATED
    );
}

/// [`put_oauth`] with `limit` concurrent leases.
async fn put_oauth_limit(
    app: &TestApp,
    token_url: &str,
    expires_in: i64,
    refresh_before: u32,
    limit: u32,
) -> reqwest::Response {
    app.put_key_raw(
        "k",
        json!({
            "provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": limit,
            "secret": {"access_token": "at-0", "refresh_token": "rtok-0",
                       "expires_at": rfc3339(OffsetDateTime::now_utc() + time::Duration::seconds(expires_in))},
            "oauth": {"token_url": token_url, "client_id": "client-1",
                      "client_secret": "cs-do-not-leak", "refresh_before_seconds": refresh_before},
        }),
    )
    .await
}

/// A lease of `k`; returns its access token.
async fn leased_token(app: &TestApp) -> String {
    let lease = app.allocate(gpt4o_for(5)).ok_json().await;
    let token = lease["credential"]["access_token"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        lease["credential"].as_object().unwrap().len(),
        2,
        "a lease carries access_token and expires_at only: {lease}"
    );
    let released = app.release(release_body(&lease, "success")).await;
    assert_eq!(released.status(), StatusCode::OK);
    token
}

/// Polls `probe` every 50 ms until it holds; panics after 30 s (a generous bound, not a speed
/// requirement).
async fn until<F, Fut>(what: &str, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..600 {
        if probe().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

async fn set_refresh_before(app: &TestApp, seconds: i32) {
    app.run_sql_with(
        "UPDATE oauth_credentials SET refresh_before_seconds = $1",
        seconds,
    )
    .await;
}

async fn generation(app: &TestApp) -> i64 {
    app.credential("k").await["oauth"]["generation"]
        .as_i64()
        .unwrap()
}

/// The trail's refresh events of `k`: (event, generation).
async fn refresh_events(app: &TestApp) -> Vec<(String, i64)> {
    sqlx::query_as::<_, (String, i64)>(
        "SELECT event, (details ->> 'generation')::bigint FROM credential_events
         WHERE key_id = 'k' AND event IN ('token_refreshed', 'token_refresh_failed')
         ORDER BY event_id",
    )
    .fetch_all(&app.db)
    .await
    .unwrap()
}

/// Waits for refresh generation `expected` of `k`, then: its lease carries access token `token`,
/// and the mock was called once per refresh so far (`expected - 1` times), also half a second
/// later.
async fn refreshed(app: &TestApp, mock: &Mock, expected: i64, token: &str) {
    let what = format!("refresh generation {expected}");
    until(&what, || async { generation(app).await == expected }).await;
    assert_eq!(leased_token(app).await, token);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(mock.calls(), expected as usize - 1);
}

#[tokio::test]
async fn a_token_due_is_refreshed_once_before_it_expires_and_the_next_refresh_uses_the_rotated_token()
 {
    let app = app().await;
    let (mock, url) = mock_endpoint(ANSWERS, 3600).await;
    // expires in 60 s, refreshed from 59 s before: due within a second
    let stored = json_body(put_oauth(&app, &url, 60, 59).await, StatusCode::CREATED).await;
    assert_eq!(stored["oauth"]["generation"], 1);
    let original_expiry: String = stored["oauth"]["token_expires_at"]
        .as_str()
        .unwrap()
        .to_owned();

    // the new token lives an hour: nothing more to refresh, however many passes run
    refreshed(&app, &mock, 2, "at-1").await;
    let refreshed_before_expiry: bool = app
        .scalar_of(
            "SELECT at < $1::timestamptz FROM credential_events WHERE event = 'token_refreshed'",
            &original_expiry,
        )
        .await;
    assert!(refreshed_before_expiry);

    // due again (at-1 lives 3600 s, at-2 will live 7200 s): the refresh presents the rotated
    // refresh token
    set_refresh_before(&app, 3650).await;
    refreshed(&app, &mock, 3, "at-2").await;
    let forms = mock.forms.lock().unwrap().clone();
    let presented: Vec<&str> = forms.iter().map(|f| f["refresh_token"].as_str()).collect();
    assert_eq!(presented[..2], ["rtok-0", "rtok-1"]);
    assert_eq!(forms[0]["grant_type"], "refresh_token");
    assert_eq!(forms[0]["client_id"], "client-1");
    assert_eq!(forms[0]["client_secret"], "cs-do-not-leak");
    assert!(
        !forms[0].contains_key("scope"),
        "a scope sent for a credential without one: {:?}",
        forms[0]
    );
    assert_eq!(mock.stale.load(Ordering::SeqCst), 0);
    let events = refresh_events(&app).await;
    assert_eq!(
        events[..2],
        [
            ("token_refreshed".to_owned(), 2),
            ("token_refreshed".to_owned(), 3)
        ]
    );
}

#[tokio::test]
async fn a_credential_with_a_scope_asks_for_it_at_every_refresh() {
    let app = app().await;
    let (mock, url) = mock_endpoint(ANSWERS, 3600).await;
    // expires in 60 s, refreshed from 59 s before: due within a second
    let response = app
        .put_key_raw(
            "k",
            json!({
                "provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 4,
                "secret": {"access_token": "at-0", "refresh_token": "rtok-0",
                           "expires_at": rfc3339(OffsetDateTime::now_utc() + time::Duration::seconds(60))},
                "oauth": {"token_url": url, "client_id": "client-1",
                          "scope": "openid offline_access", "refresh_before_seconds": 59},
            }),
        )
        .await;
    json_body(response, StatusCode::CREATED).await;
    refreshed(&app, &mock, 2, "at-1").await;
    let forms = mock.forms.lock().unwrap().clone();
    assert_eq!(forms.len(), 1, "{forms:?}");
    assert_eq!(forms[0]["grant_type"], "refresh_token");
    assert_eq!(
        forms[0].get("scope").map(String::as_str),
        Some("openid offline_access"),
        "{:?}",
        forms[0]
    );
}

#[tokio::test]
async fn replicas_and_concurrent_refreshers_make_one_token_call_per_generation() {
    let app = app().await;
    // slow answers: every refresher's pass overlaps the call in flight
    let (mock, url) = mock_endpoint(Mode::slow(200), 3600).await;
    store_oauth(&app, &url, 3600, 0).await;
    // three more service processes' worth of refreshers (apps on the same database) ...
    let mut options = AppOptions::default();
    options.settings.oauth = fast_refresher();
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(serve(app.database.pool(4).await, &options).await);
    }
    // ... and eight refreshers driven by hand, all at once, pass after pass
    let refreshers: Vec<Arc<Refresher>> = refreshers(&app, 8).await;
    // from here on every generation is due at once (the first 24 tokens live at most a day)
    set_refresh_before(&app, 86_400).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for refresher in &refreshers {
        let (refresher, stop) = (refresher.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                refresher.run_once().await.unwrap();
            }
        }));
    }
    until("five refreshes", || async {
        mock.issued.load(Ordering::SeqCst) >= 5
    })
    .await;
    set_refresh_before(&app, 0).await;
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        task.await.unwrap();
    }
    // let any call in flight land
    tokio::time::sleep(Duration::from_millis(600)).await;
    drop(replicas);

    let issued = mock.issued.load(Ordering::SeqCst);
    assert_eq!(
        mock.stale.load(Ordering::SeqCst),
        0,
        "a rotated refresh token was used twice"
    );
    assert_eq!(
        mock.calls(),
        issued,
        "every token call was the one of its generation"
    );
    let generation = generation(&app).await;
    assert_eq!(generation, 1 + issued as i64);
    let events = refresh_events(&app).await;
    let expected: Vec<(String, i64)> = (2..=generation)
        .map(|g| ("token_refreshed".to_owned(), g))
        .collect();
    assert_eq!(events, expected);
    let detail = app.credential("k").await;
    assert_eq!(detail["status"], "available");
    assert_eq!(leased_token(&app).await, format!("at-{issued}"));
}

async fn refreshers(app: &TestApp, n: usize) -> Vec<Arc<Refresher>> {
    let mut refreshers = Vec::new();
    for _ in 0..n {
        refreshers.push(Arc::new(Refresher::new(
            app.database.pool(2).await.into(),
            keyring(),
            fast_refresher(),
        )));
    }
    refreshers
}

#[tokio::test]
async fn a_failing_token_endpoint_leaves_the_valid_token_serving_and_one_refresh_follows_its_return()
 {
    let app = app().await;
    let (mock, url) = mock_endpoint(Mode::Unavailable, 3600).await;
    // at-0 expires in 100 s and is due; at-1 will live 3600 s and not be
    store_oauth(&app, &url, 100, 200).await;
    until("retried failures", || async { mock.calls() >= 3 }).await;
    for _ in 0..3 {
        assert_eq!(leased_token(&app).await, "at-0");
    }
    let detail = app.credential("k").await;
    assert_eq!(detail["status"], "available");
    assert_eq!(detail["oauth"]["generation"], 1);
    assert!(
        detail["oauth"]["last_error"]
            .as_str()
            .unwrap()
            .contains("503"),
        "{detail}"
    );
    // a trail row per failed call: the first two at least have committed once a third was made
    let events = refresh_events(&app).await;
    assert!(
        events.len() >= 2
            && events
                .iter()
                .all(|e| *e == ("token_refresh_failed".to_owned(), 1)),
        "{events:?}"
    );

    mock.set(ANSWERS);
    until("the refresh", || async { generation(&app).await == 2 }).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(mock.issued.load(Ordering::SeqCst), 1);
    assert_eq!(generation(&app).await, 2);
    assert_eq!(leased_token(&app).await, "at-1");
    let detail = app.credential("k").await;
    assert_eq!(detail["oauth"]["last_error"], Value::Null);
}

#[tokio::test]
async fn invalid_grant_disables_the_credential_until_an_operator_puts_a_new_secret() {
    let app = app().await;
    let (mock, url) = mock_endpoint(Mode::InvalidGrant, 3600).await;
    store_oauth(&app, &url, 3600, 7200).await;
    until("the credential disabled", || async {
        app.credential("k").await["status"] == "disabled"
    })
    .await;
    app.allocate(gpt4o_for(5))
        .refused(StatusCode::CONFLICT, "no_usable_credentials")
        .await;
    let detail = app.credential("k").await;
    assert!(
        detail["status_reason"]
            .as_str()
            .unwrap()
            .contains("invalid_grant"),
        "{detail}"
    );
    assert!(
        detail["oauth"]["last_error"]
            .as_str()
            .unwrap()
            .contains("invalid_grant"),
        "{detail}"
    );
    // no retry of a rejected refresh token
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(mock.calls(), 1);
    assert_eq!(
        refresh_events(&app).await,
        [("token_refresh_failed".to_owned(), 1)]
    );
    assert!(
        sample(
            &app.metrics().await,
            "credpool_oauth_refreshes_total{result=\"invalid_grant\"}"
        ) >= 1.0
    );

    // the operator authorizes again: a new secret, and the credential is back
    mock.set(ANSWERS);
    let response = app
        .put_key_raw(
            "k",
            json!({
                "provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 4,
                "status": "available",
                "secret": {"access_token": "at-new", "refresh_token": "rtok-0",
                           "expires_at": rfc3339(OffsetDateTime::now_utc() + time::Duration::hours(1))},
                "oauth": {"token_url": url, "client_id": "client-1", "refresh_before_seconds": 0},
            }),
        )
        .await;
    let detail = json_body(response, StatusCode::OK).await;
    assert_eq!(detail["oauth"]["generation"], 2);
    assert_eq!(detail["oauth"]["last_error"], Value::Null);
    assert_eq!(leased_token(&app).await, "at-new");
}

#[tokio::test]
async fn no_refresh_token_or_client_secret_in_any_answer_or_trail_row() {
    let app = app().await;
    let (mock, url) = mock_endpoint(ANSWERS, 3600).await;
    let mut seen = Vec::new();
    let put = put_oauth(&app, &url, 3600, 7200).await;
    seen.push(put.text().await.unwrap());
    until("a refresh", || async {
        mock.issued.load(Ordering::SeqCst) >= 2
    })
    .await;
    set_refresh_before(&app, 0).await;
    let lease = app.allocate(gpt4o_for(5)).await;
    seen.push(lease.text().await.unwrap());
    seen.push(app.credential("k").await.to_string());
    seen.push(app.admin_get("/api/admin/keys").await.to_string());
    seen.push(app.metrics().await);
    // the trail, then the rows themselves
    for rows in [
        "SELECT row_to_json(e)::text FROM credential_events e
         UNION ALL SELECT row_to_json(l)::text FROM lease_events l",
        "SELECT row_to_json(c)::text FROM credentials c
         UNION ALL SELECT row_to_json(o)::text FROM oauth_credentials o",
    ] {
        seen.extend(app.scalars::<String>(rows).await);
    }
    assert!(seen[1].contains("\"access_token\":\"at-"), "{}", seen[1]);
    for text in &seen {
        assert!(!text.contains("rtok-"), "a refresh token leaked: {text}");
        assert!(
            !text.contains("cs-do-not-leak"),
            "the client secret leaked: {text}"
        );
    }
}

#[tokio::test]
async fn a_credential_whose_token_expires_before_lease_until_is_not_granted() {
    let app = app().await;
    let (mock, url) = mock_endpoint(Mode::Unavailable, 3600).await;
    // expires in 30 s; not due for a refresh
    store_oauth(&app, &url, 30, 0).await;
    let detail = app.credential("k").await;
    let expires_at = OffsetDateTime::parse(
        detail["oauth"]["token_expires_at"].as_str().unwrap(),
        &Rfc3339,
    )
    .unwrap();

    // the 429 says when the refresh should land (at the token's expiry, refresh_before 0), not
    // "at once" or when a slot frees
    let refused = app.allocate(gpt4o_for(120)).await;
    let retry_after: f64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (20.0..=31.0).contains(&retry_after),
        "Retry-After {retry_after} s for a token that expires in 30 s"
    );
    let body = assert_error(refused, StatusCode::TOO_MANY_REQUESTS, "pool_exhausted").await;
    // the refusal says the token is what it waits for, not a busy slot
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("OAuth access token"), "{message}");
    assert!(
        sample(
            &app.metrics().await,
            "credpool_allocations_held_back_total{provider=\"openai\",pool=\"default\",held_by=\"token_refresh\"}"
        ) >= 1.0
    );
    assert_eq!(app.in_flight("k").await, 0);
    let lease = app.allocate(gpt4o_for(10)).ok_json().await;
    let lease_until =
        OffsetDateTime::parse(lease["lease_until"].as_str().unwrap(), &Rfc3339).unwrap();
    assert!(lease_until <= expires_at, "{lease_until} > {expires_at}");
    assert_eq!(lease["credential"]["access_token"], "at-0");
    assert_eq!(mock.calls(), 0);
}

#[tokio::test]
async fn a_token_url_that_is_neither_https_nor_loopback_http_is_refused() {
    let app = app().await;
    for url in [
        "http://auth.example.com/token",
        "http://10.1.2.3/token",
        "file:///etc/passwd",
    ] {
        put_oauth(&app, url, 3600, 0)
            .refused(StatusCode::BAD_REQUEST, "token_url_not_allowed")
            .await;
    }
    let missing = app
        .admin_unnamed(Method::GET, "/api/admin/keys/k", None)
        .await;
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    // an OAuth secret without its refresh token is a 400 too
    let response = app
        .put_key_raw(
            "k",
            json!({"provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 1,
                   "secret": {"access_token": "at-0", "expires_at": "2030-01-01T00:00:00Z"},
                   "oauth": {"token_url": "https://auth.example.com/token", "client_id": "c"}}),
        )
        .await;
    assert_error(response, StatusCode::BAD_REQUEST, "invalid_request").await;
}

#[tokio::test]
async fn a_put_whose_if_match_generation_moved_answers_412_and_changes_nothing() {
    let app = app().await;
    let (_mock, url) = mock_endpoint(Mode::Unavailable, 3600).await;
    store_oauth(&app, &url, 3600, 0).await;
    let put_if = |generation: &'static str, access_token: &'static str| {
        let (app, url) = (&app, url.clone());
        async move {
            app.client
                .put(app.url("/api/admin/keys/k"))
                .header("x-admin-key", ADMIN_KEY)
                .header("if-match", generation)
                .json(&json!({
                    "provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 4,
                    "secret": {"access_token": access_token, "refresh_token": "rtok-outside",
                               "expires_at": rfc3339(OffsetDateTime::now_utc() + time::Duration::hours(1))},
                    "oauth": {"token_url": url, "client_id": "client-1", "refresh_before_seconds": 0},
                }))
                .send()
                .await
                .unwrap()
        }
    };
    // an outside refresher that read generation 2, which never was: refused, nothing changed
    put_if("2", "at-stale")
        .refused(StatusCode::PRECONDITION_FAILED, "generation_moved")
        .await;
    assert_eq!(generation(&app).await, 1);
    assert_eq!(leased_token(&app).await, "at-0");
    // the one that read generation 1 stores its token: generation 2
    let stored = put_if("\"1\"", "at-outside").ok_json().await;
    assert_eq!(stored["oauth"]["generation"], 2);
    assert_eq!(leased_token(&app).await, "at-outside");
    // a second refresher that also read generation 1 can no longer roll it back
    put_if("1", "at-rollback")
        .refused(StatusCode::PRECONDITION_FAILED, "generation_moved")
        .await;
    assert_eq!(leased_token(&app).await, "at-outside");
    put_if("soon", "at-x")
        .refused(StatusCode::BAD_REQUEST, "invalid_request")
        .await;
}

#[tokio::test]
async fn reencrypting_under_a_new_master_key_reseals_the_oauth_grant_too() {
    use credpool::secrets::{Keyring, MasterKey};
    let app = app().await;
    let (_mock, url) = mock_endpoint(Mode::Unavailable, 3600).await;
    store_oauth(&app, &url, 3600, 0).await;
    let old = MasterKey::parse(MASTER_KEY).unwrap();
    let ring = Keyring::new(MasterKey::generate(), vec![old]);
    let db: credpool::store::Db = app.database.pool(2).await.into();
    let actor = credpool::store::credentials::Actor::parse("cli:test").unwrap();
    let resealed = credpool::store::credentials::reseal(&db, &ring, false, &actor)
        .await
        .unwrap();
    assert_eq!(resealed, 2, "the access token and the grant");
    let sealed: Vec<u8> = app
        .scalar("SELECT refresh_ciphertext FROM oauth_credentials WHERE key_id = 'k'")
        .await;
    assert!(ring.is_current(&sealed));
    let key_id = credpool::domain::KeyId::parse("k").unwrap();
    let grant = ring.open_oauth(&key_id, &sealed).unwrap();
    assert_eq!(grant.expose()["refresh_token"], "rtok-0");
    let needed = credpool::store::credentials::sealing_keys(&db)
        .await
        .unwrap();
    assert_eq!(needed, [(ring.current().fingerprint(), 2)]);
}

#[tokio::test]
async fn the_pools_summary_metrics_and_dashboard_say_when_the_earliest_token_expires() {
    let app = app().await;
    let (_mock, url) = mock_endpoint(Mode::Unavailable, 3600).await;
    store_oauth(&app, &url, 600, 0).await;
    app.put_gpt4o_key("plain", "other", 1).await;
    let pools = app.admin_get("/api/admin/pools").await;
    let pools = pools
        .as_array()
        .or_else(|| pools["pools"].as_array())
        .unwrap()
        .clone();
    let of = |pool: &str| {
        pools
            .iter()
            .find(|p| p["pool"] == pool)
            .unwrap_or_else(|| panic!("no pool {pool}: {pools:?}"))["oauth_expires_in_seconds"]
            .clone()
    };
    let seconds = of("default").as_f64().unwrap();
    assert!(seconds > 500.0 && seconds <= 600.0, "{seconds}");
    assert_eq!(of("other"), Value::Null);

    // the gauge, per pool, from a `credpool serve` of the database (its own metrics; sampled at
    // start-up, then every second)
    let mut env = keyed_env(&app.database);
    env.push(("CREDPOOL_METRICS_SAMPLE_SECONDS", "1".to_owned()));
    let serve = ServeProcess::start(BIN, &env, &[]).await;
    let page = serve.metrics().await;
    let gauge = |pool: &str| {
        sample(
            &page,
            &format!(
                "credpool_oauth_token_expires_in_seconds{{provider=\"openai\",pool=\"{pool}\"}}"
            ),
        )
    };
    assert!(gauge("default") > 500.0 && gauge("default") <= 600.0);
    assert_eq!(gauge("other"), f64::INFINITY);

    // the dashboard's credentials table: the token's expiry and generation
    let fragment = app
        .admin_unnamed(Method::GET, "/dashboard/fragments/credentials", None)
        .await
        .text()
        .await
        .unwrap();
    assert!(fragment.contains("token expires"), "{fragment}");
    assert!(fragment.contains("(generation 1)"), "{fragment}");
}

/// Sends `body` to `path` of the service at `base` with the internal key.
async fn internal(base: &str, path: &str, body: Value) -> reqwest::Response {
    post_json(
        &client(),
        &format!("{base}{path}"),
        ("x-internal-key", INTERNAL_KEY),
        body,
    )
    .await
}

/// The `token_rejected` rows of `k`'s trail: their generations.
async fn rejections(app: &TestApp) -> Vec<i64> {
    app.scalars(
        "SELECT (details ->> 'generation')::bigint FROM credential_events
         WHERE key_id = 'k' AND event = 'token_rejected' ORDER BY event_id",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auth_expired_reports_from_three_processes_make_one_token_call_and_no_lease_gets_the_rejected_token()
 {
    let app = app().await;
    // a slow endpoint: every process's refresher looks while the one call is in flight
    let (mock, url) = mock_endpoint(Mode::slow(1500), 3600).await;
    // valid for an hour, refreshed only in its last second: nothing is due but what is reported
    assert_eq!(
        put_oauth_limit(&app, &url, 3600, 1, 60).await.status(),
        StatusCode::CREATED
    );
    let env = keyed_env(&app.database);
    let (a, b, c) = tokio::join!(
        ServeProcess::start(BIN, &env, &[]),
        ServeProcess::start(BIN, &env, &[]),
        ServeProcess::start(BIN, &env, &[])
    );
    let bases = [a.base.clone(), b.base.clone(), c.base.clone()];
    let ask = gpt4o_for(300);
    let mut leases = Vec::new();
    for i in 0..50 {
        let lease = internal(&bases[i % 3], "/api/internal/allocate-key", ask.clone())
            .ok_json()
            .await;
        assert_eq!(lease["credential"]["access_token"], "at-0");
        leases.push(lease);
    }

    // the provider answered 401 to all of them at once: 50 reports over three processes
    let barrier = Arc::new(tokio::sync::Barrier::new(50));
    let tasks: Vec<_> = leases
        .iter()
        .enumerate()
        .map(|(i, lease)| {
            let (base, body, barrier) = (
                bases[i % 3].clone(),
                release_body(lease, "auth_expired"),
                barrier.clone(),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                internal(&base, "/api/internal/release-key", body).await
            })
        })
        .collect();
    for task in tasks {
        let released = json_body(task.await.unwrap(), StatusCode::OK).await;
        assert_eq!(released["released"], true, "{released}");
    }

    // from the moment the reports were answered, no lease carries the rejected token
    let mut refused = 0;
    for round in 0.. {
        let response = internal(&bases[round % 3], "/api/internal/allocate-key", ask.clone()).await;
        if response.status() == StatusCode::TOO_MANY_REQUESTS {
            refused += 1;
            assert_error(response, StatusCode::TOO_MANY_REQUESTS, "pool_exhausted").await;
            assert!(round < 200, "the refresh never landed");
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let lease = json_body(response, StatusCode::OK).await;
        assert_eq!(lease["credential"]["access_token"], "at-1", "{lease}");
        internal(
            &bases[0],
            "/api/internal/release-key",
            release_body(&lease, "success"),
        )
        .await;
        break;
    }
    assert!(
        refused > 0,
        "the endpoint takes 1.5 s: some allocate came before the new token"
    );
    // every refresher of four processes has looked again meanwhile
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        mock.calls(),
        1,
        "one token call for the rejected generation"
    );
    assert_eq!(mock.stale.load(Ordering::SeqCst), 0);
    assert_eq!(generation(&app).await, 2);
    assert_eq!(rejections(&app).await, [1]);
    for base in &bases {
        let lease = internal(base, "/api/internal/allocate-key", ask.clone())
            .ok_json()
            .await;
        assert_eq!(lease["credential"]["access_token"], "at-1");
    }
    let outcomes: i64 = app.scalar("SELECT count(*) FROM lease_events WHERE event = 'released' AND outcome = 'auth_expired'").await;
    assert_eq!(outcomes, 50);
    let detail = app.credential("k").await;
    assert_eq!(
        detail["status"], "available",
        "a rejected token is not a bad credential"
    );
}

#[tokio::test]
async fn auth_expired_on_a_lease_of_an_older_generation_leaves_the_current_token_serving() {
    let app = app().await;
    let (mock, url) = mock_endpoint(ANSWERS, 3600).await;
    store_oauth(&app, &url, 120, 0).await;
    let old = app.allocate(gpt4o_for(60)).ok_json().await;
    assert_eq!(old["credential"]["access_token"], "at-0");
    // a refresh lands while the lease is held (at-0 expires within 200 s, at-1 not)
    set_refresh_before(&app, 200).await;
    until("the refresh", || async { generation(&app).await == 2 }).await;
    set_refresh_before(&app, 0).await;
    let current = app.allocate(gpt4o_for(60)).ok_json().await;
    assert_eq!(current["credential"]["access_token"], "at-1");

    // the old lease's token is rejected: that says nothing about at-1
    app.release_ok(&old, "auth_expired").await;
    assert_eq!(rejections(&app).await, Vec::<i64>::new());
    assert_eq!(leased_token(&app).await, "at-1");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(mock.calls(), 1);

    // the current lease's token is rejected: out of traffic, refreshed once
    app.release(release_body(&current, "auth_expired"))
        .ok_json()
        .await;
    assert_eq!(rejections(&app).await, [2]);
    until("the refresh of generation 2", || async {
        generation(&app).await == 3
    })
    .await;
    assert_eq!(leased_token(&app).await, "at-2");
    assert_eq!(mock.calls(), 2);
}

#[tokio::test]
async fn auth_expired_on_a_credential_that_is_not_oauth_disables_it_like_auth_error() {
    let app = app().await;
    app.put_gpt4o_key("plain", "default", 2).await;
    let lease = app.allocate(gpt4o_for(30)).ok_json().await;
    app.release(release_body(&lease, "auth_expired"))
        .ok_json()
        .await;
    let detail = app.credential("plain").await;
    assert_eq!(detail["status"], "disabled", "{detail}");
    app.allocate(gpt4o_for(30))
        .refused(StatusCode::CONFLICT, "no_usable_credentials")
        .await;
}

#[tokio::test]
async fn a_renewal_never_extends_a_lease_past_the_expiry_of_the_token_it_holds() {
    let app = app().await;
    let (_mock, url) = mock_endpoint(ANSWERS, 3600).await;
    let stored = json_body(put_oauth(&app, &url, 120, 0).await, StatusCode::CREATED).await;
    let expires_at = OffsetDateTime::parse(
        stored["oauth"]["token_expires_at"].as_str().unwrap(),
        &Rfc3339,
    )
    .unwrap();
    let lease = app.allocate(gpt4o_for(30)).ok_json().await;
    let until_of = |answer: &Value| {
        OffsetDateTime::parse(answer["lease_until"].as_str().unwrap(), &Rfc3339).unwrap()
    };
    let renew = |seconds: u64| renew_body(&lease, seconds);

    // asked for 600 s; the token lasts 120 s
    let renewed = app.renew(renew(600)).ok_json().await;
    assert_eq!(until_of(&renewed), expires_at, "{renewed}");
    // a shorter renewal is as asked
    let renewed = app.renew(renew(20)).ok_json().await;
    assert!(until_of(&renewed) < expires_at);

    // a refresh lands (at-0 expires within 200 s, at-1 not): the lease holds the old token,
    // so it is not extended past it
    set_refresh_before(&app, 200).await;
    until("the refresh", || async { generation(&app).await == 2 }).await;
    set_refresh_before(&app, 0).await;
    let before = until_of(&renewed);
    let renewed = app.renew(renew(600)).ok_json().await;
    assert_eq!(until_of(&renewed), before, "{renewed}");
    // a lease of the new token renews to the new token's expiry
    let fresh = app.allocate(gpt4o_for(30)).ok_json().await;
    assert_eq!(fresh["credential"]["access_token"], "at-1");
    let renewed = app.renew(renew_body(&fresh, 600)).ok_json().await;
    assert!(until_of(&renewed) > expires_at, "{renewed}");
}

#[tokio::test]
async fn a_refreshed_token_whose_first_write_fails_is_written_by_a_retry_and_never_lost() {
    let app = app().await;
    let (mock, url) = mock_endpoint(ANSWERS, 3600).await;
    // the database refuses the first write of a new generation (a sequence counts across
    // rollbacks): the endpoint has rotated the refresh token by then
    sqlx::raw_sql(
        "CREATE SEQUENCE refresh_write_attempts;
         CREATE FUNCTION fail_the_first_refresh_write() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('refresh_write_attempts') = 1 THEN
                 RAISE EXCEPTION 'injected: the database is gone for a moment';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER fail_the_first_refresh_write BEFORE UPDATE ON oauth_credentials
             FOR EACH ROW WHEN (NEW.generation <> OLD.generation)
             EXECUTE FUNCTION fail_the_first_refresh_write();",
    )
    .execute(&app.db)
    .await
    .unwrap();
    store_oauth(&app, &url, 60, 59).await;
    until("the refresh", || async { generation(&app).await == 2 }).await;
    let attempts: i64 = app
        .scalar("SELECT last_value FROM refresh_write_attempts")
        .await;
    assert_eq!(attempts, 2, "the first write failed, a retry wrote it");
    assert_eq!(mock.calls(), 1, "no second token call for the generation");
    assert_eq!(leased_token(&app).await, "at-1");
    // the next refresh presents the rotated refresh token, which the endpoint still honours
    set_refresh_before(&app, 3650).await;
    until("the second refresh", || async {
        generation(&app).await == 3
    })
    .await;
    assert_eq!(mock.stale.load(Ordering::SeqCst), 0);
    assert_eq!(app.credential("k").await["status"], "available");
}

/// An app whose refreshers' markers last 2 s (calls 1 s), with OAuth credential `k` stored (not
/// due) against a mock endpoint that rotates refresh tokens; the refresher settings.
async fn short_marker_app() -> (TestApp, Arc<Mock>, OAuthSettings) {
    let short = OAuthSettings {
        claim_for: Duration::from_secs(2),
        call_timeout: Duration::from_secs(1),
        ..fast_refresher()
    };
    let mut options = AppOptions::default();
    options.settings.oauth = short.clone();
    let app = TestApp::spawn_with(options).await;
    let (mock, url) = mock_endpoint(ANSWERS, 3600).await;
    store_oauth(&app, &url, 3600, 0).await;
    (app, mock, short)
}

/// Another process's refresher (`settings`), pass after pass every 50 ms for `run_for`.
async fn refresher_passes(
    app: &TestApp,
    settings: OAuthSettings,
    run_for: Duration,
) -> tokio::task::JoinHandle<()> {
    let other = Refresher::new(app.database.pool(2).await.into(), keyring(), settings);
    tokio::spawn(async move {
        let end = tokio::time::Instant::now() + run_for;
        while tokio::time::Instant::now() < end {
            other.run_once().await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

#[tokio::test]
async fn a_refresh_whose_write_waits_longer_than_its_marker_is_never_overtaken() {
    // The refresher's marker holds other writers off for `claim_for` (2 s here). The test holds
    // the credential's slot rows, so the writer that got the new token waits for them longer
    // than that. Before, a second refresher then took the generation over and called the
    // endpoint with the refresh token the first call had already rotated away (`invalid_grant`
    // from a provider that rotates), and the credential was disabled. Now a writer keeps its
    // marker for as long as it may still write.
    let (app, mock, short) = short_marker_app().await;
    let mut holder = transaction_holding(
        &app,
        &["SELECT 1 FROM lease_slots WHERE key_id = 'k' FOR UPDATE"],
    )
    .await;
    set_refresh_before(&app, 86_400).await;
    until("the first token call", || async {
        mock.issued.load(Ordering::SeqCst) == 1
    })
    .await;
    // another process's refresher, pass after pass, for twice the marker's life
    let passes = refresher_passes(&app, short, Duration::from_secs(4)).await;
    // (its own write, if it had taken the generation over, would wait for the slot rows too)
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        mock.stale.load(Ordering::SeqCst),
        0,
        "another writer called the endpoint with the rotated refresh token"
    );
    // (the token to come is not due: one refresh in all)
    set_refresh_before(&app, 0).await;
    sqlx::Executor::execute(&mut holder, "ROLLBACK")
        .await
        .unwrap();
    passes.await.unwrap();
    refreshed(&app, &mock, 2, "at-1").await;
}

/// Backends of `app`'s database waiting for a row lock in a refresher's take
/// (`store::take_refresh`).
async fn takes_waiting(app: &TestApp) -> i64 {
    app.scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND query LIKE '%UPDATE oauth_credentials o%'",
    )
    .await
}

/// Makes `k` due while the test holds its `oauth_credentials` row, so that the service's
/// refresher's take waits for the row; `held` after that take started waiting, another process's
/// refresher (`settings`) starts its passes, whose take waits behind it; then the row is let go.
/// Returns once the other refresher's passes are over (3 s).
async fn take_held_for(app: &TestApp, settings: OAuthSettings, held: Duration) {
    let mut holder = transaction_holding(
        app,
        &["SELECT 1 FROM oauth_credentials WHERE key_id = 'k' FOR UPDATE"],
    )
    .await;
    // due now (the row held stays as it is: the token's end is the credential's)
    app.run_sql("UPDATE credentials SET token_expires_at = now() WHERE key_id = 'k'")
        .await;
    until(
        "the service's refresher's take waiting for the row",
        || async { takes_waiting(app).await == 1 },
    )
    .await;
    tokio::time::sleep(held).await;
    let passes = refresher_passes(app, settings, Duration::from_secs(3)).await;
    until("the other refresher's take waiting too", || async {
        takes_waiting(app).await == 2
    })
    .await;
    sqlx::Executor::execute(&mut holder, "COMMIT")
        .await
        .unwrap();
    passes.await.unwrap();
}

/// After a refresh of `k`'s generation 1: no call presented a rotated-away refresh token, and
/// generation 2 was written by one token call ([`refreshed`]). Waits for the new token or the
/// credential's disabling first, so that a second writer's call is named as such.
async fn refreshed_once_by_one_writer(app: &TestApp, mock: &Mock) {
    until(
        "the refresh's end: a new token written or the credential disabled",
        || async {
            let detail = app.credential("k").await;
            detail["oauth"]["generation"] == 2 || detail["status"] != "available"
        },
    )
    .await;
    assert_eq!(
        mock.stale.load(Ordering::SeqCst),
        0,
        "a refresher called the endpoint with the rotated refresh token"
    );
    refreshed(app, mock, 2, "at-1").await;
}

#[tokio::test]
async fn a_refresh_whose_take_waited_past_its_marker_calls_nothing_and_one_refresh_follows() {
    // A take dates its marker at its statement's start (Citus takes no volatile function in an
    // UPDATE of a distributed table). The test holds the credential's oauth_credentials row, so
    // the refresher's take waits for it longer than the marker's life (2 s): the marker it writes
    // has lapsed already when the take comes back. Before, that refresher called the endpoint
    // anyway while another process's refresher, whose take waited behind it, took the generation
    // over and called it too, with the refresh token the first call had rotated away
    // (`invalid_grant` from a provider that rotates: the credential disabled). Now a take that
    // came back late keeps its marker before the call, and gives the refresh up when it cannot.
    let (app, mock, short) = short_marker_app().await;
    take_held_for(&app, short, Duration::from_millis(2_500)).await;
    refreshed_once_by_one_writer(&app, &mock).await;
}

#[tokio::test]
async fn a_refresh_whose_take_waited_keeps_its_marker_through_a_slow_call() {
    // The take waits 1.2 s of its marker's 2 s, and the endpoint takes 0.9 s to answer: called at
    // once, the marker would lapse during the call and another process's refresher take the
    // generation over and call with the refresh token being rotated. The late take keeps its
    // marker first (from a statement sent then), so the call runs under a live marker.
    let (app, mock, short) = short_marker_app().await;
    mock.set(Mode::slow(900));
    take_held_for(&app, short, Duration::from_millis(1_200)).await;
    refreshed_once_by_one_writer(&app, &mock).await;
}

#[tokio::test]
async fn an_auth_expired_report_locks_nothing_of_a_credential_that_is_not_its_leases() {
    // A tenant's executor reports `auth_expired` on a lease that does not exist, naming an OAuth
    // credential of another pool. Its release is held at `release.locked` (after its locks).
    // Before, it had taken the operator locks and every slot row of the credential it named, so
    // while it was held that credential served nobody (the claims passed over its locked slots:
    // 429). Now a report locks only its own lease's credential.
    let app = TestApp::spawn_with_hooks("release.locked").await;
    let (_mock, url) = mock_endpoint(ANSWERS, 3600).await;
    store_oauth(&app, &url, 3600, 0).await;
    app.put_tenant("mallory", json!({})).await;
    let (_, key) = app.mint_key("mallory").await;
    let hook = Hook::close(&app, "release.locked").await;
    let hostile = {
        let (app, key) = (app.remote(), key.clone());
        tokio::spawn(async move {
            app.release_as(
                &key,
                json!({"provider": "openai", "pool": "default", "key_id": "k",
                       "lease_id": uuid::Uuid::new_v4().simple().to_string(),
                       "outcome": "auth_expired"}),
            )
            .await
        })
    };
    wait_for_lock_waiters(&app, 1).await;
    let response = app.allocate(gpt4o_for(60)).await;
    assert_eq!(
        response.status(),
        StatusCode::OK,
        "the credential served nobody while a stranger's report held it: {}",
        response.text().await.unwrap()
    );
    hook.open().await;
    let answer = json_body(hostile.await.unwrap(), StatusCode::OK).await;
    assert_eq!(answer["released"], false, "{answer}");
    assert_eq!(app.credential("k").await["oauth"]["generation"], 1);
}

#[tokio::test]
async fn an_expires_in_no_timestamp_can_hold_is_that_credentials_error_and_other_tokens_still_refresh()
 {
    // `"expires_in": 10^15` panicked the refresher (a timestamp out of range): no token of any
    // credential was refreshed again in that process, and /readyz still said ready.
    let app = app().await;
    let (bad, bad_url) = mock_endpoint(Mode::Unrepresentable, 3600).await;
    let (good, good_url) = mock_endpoint(ANSWERS, 3600).await;
    let put = |key_id: &'static str, url: String| {
        app.put_key_raw(
            key_id,
            json!({
                "provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 4,
                "secret": {"access_token": "at-0", "refresh_token": "rtok-0",
                           "expires_at": rfc3339(OffsetDateTime::now_utc() + time::Duration::seconds(120))},
                "oauth": {"token_url": url, "client_id": "client-1", "refresh_before_seconds": 110},
            }),
        )
    };
    // the bad answer first: due at once
    assert_eq!(put("bad", bad_url).await.status(), StatusCode::CREATED);
    until("the bad endpoint's answer", || async { bad.calls() >= 1 }).await;
    // then a credential whose endpoint answers well: refreshed all the same
    assert_eq!(put("good", good_url).await.status(), StatusCode::CREATED);
    until("the good credential's refresh", || async {
        app.credential("good").await["oauth"]["generation"] == 2
    })
    .await;
    assert_eq!(good.calls(), 1);
    // the bad answer is the bad credential's error, retried with backoff, its token serving on
    until("a retry of the bad endpoint", || async { bad.calls() >= 2 }).await;
    let detail = app.credential("bad").await;
    assert_eq!(detail["status"], "available", "{detail}");
    assert_eq!(detail["oauth"]["generation"], 1, "{detail}");
    let error = detail["oauth"]["last_error"].as_str().unwrap_or_default();
    assert!(error.contains("expires_in"), "{detail}");
    let failed: i64 = app.scalar("SELECT count(*) FROM credential_events WHERE key_id = 'bad' AND event = 'token_refresh_failed'").await;
    assert!(failed >= 1);
    // the process is ready, and its refresher never panicked (a panic is restarted within a
    // second, so readiness alone would not show one)
    let ready = app.get("/readyz").await;
    assert_eq!(ready.status(), StatusCode::OK);
    let restarts = sample(
        &app.metrics().await,
        r#"credpool_background_task_restarts_total{task="oauth_refresher"}"#,
    );
    assert_eq!(restarts, 0.0, "the refresher panicked and was restarted");
}
