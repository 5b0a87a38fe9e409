//! OAuth credentials (issue 28), against a mock token endpoint of the test's own on 127.0.0.1
//! that counts calls, rotates the refresh token on every success (answering `invalid_grant` to
//! a refresh token already used, as providers that rotate do), and can answer slowly, with 503
//! or with `invalid_grant`. Times are kept short with `refresh_before_seconds`; a test "moves the
//! clock" by raising `refresh_before_seconds` in the database (the token is then due at once).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Form, State};
use axum::response::IntoResponse;
use reqwest::StatusCode;
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use credpool::oauth::{OAuthSettings, Refresher};
use credpool_test_support::*;

/// How the mock token endpoint answers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// A new access token and a rotated refresh token, after `delay`.
    Ok { delay: Duration },
    /// 503.
    Unavailable,
    /// 400 `{"error": "invalid_grant"}`.
    InvalidGrant,
}

/// The mock answers at once.
const ANSWERS: Mode = Mode::Ok {
    delay: Duration::ZERO,
};

struct Mock {
    mode: Mutex<Mode>,
    /// Every call, answered or not.
    calls: AtomicUsize,
    /// Successful refreshes (access token `at-<n>`, refresh token `rtok-<n>`).
    issued: AtomicUsize,
    /// Calls that presented a refresh token other than the current one (a rotated-away token:
    /// two writers refreshed one generation).
    stale: AtomicUsize,
    /// The refresh token the next call must present.
    current: Mutex<String>,
    /// The form bodies received, in order.
    forms: Mutex<Vec<HashMap<String, String>>>,
    /// `expires_in` of the n-th answer: n times this, seconds (each new token lives longer than
    /// the one before, so a test can make one generation due and not the next).
    expires_in: u64,
}

impl Mock {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }
}

async fn token(
    State(mock): State<Arc<Mock>>,
    Form(form): Form<HashMap<String, String>>,
) -> axum::response::Response {
    mock.calls.fetch_add(1, Ordering::SeqCst);
    mock.forms.lock().unwrap().push(form.clone());
    let mode = *mock.mode.lock().unwrap();
    match mode {
        Mode::Unavailable => {
            return (axum::http::StatusCode::SERVICE_UNAVAILABLE, "down").into_response();
        }
        Mode::InvalidGrant => {
            return (
                axum::http::StatusCode::BAD_REQUEST,
                axum::Json(json!({"error": "invalid_grant", "error_description": "expired"})),
            )
                .into_response();
        }
        Mode::Ok { delay } => tokio::time::sleep(delay).await,
    }
    let presented = form.get("refresh_token").cloned().unwrap_or_default();
    let n = {
        let mut current = mock.current.lock().unwrap();
        if form.get("grant_type").map(String::as_str) != Some("refresh_token")
            || presented != *current
        {
            mock.stale.fetch_add(1, Ordering::SeqCst);
            return (
                axum::http::StatusCode::BAD_REQUEST,
                axum::Json(json!({"error": "invalid_grant"})),
            )
                .into_response();
        }
        let n = mock.issued.fetch_add(1, Ordering::SeqCst) + 1;
        *current = format!("rtok-{n}");
        n
    };
    axum::Json(json!({
        "access_token": format!("at-{n}"),
        "token_type": "Bearer",
        "expires_in": mock.expires_in * n as u64,
        "refresh_token": format!("rtok-{n}"),
    }))
    .into_response()
}

/// Serves a mock token endpoint on 127.0.0.1:0; returns it and its URL.
async fn mock_endpoint(mode: Mode, expires_in: u64) -> (Arc<Mock>, String) {
    let mock = Arc::new(Mock {
        mode: Mutex::new(mode),
        calls: AtomicUsize::new(0),
        issued: AtomicUsize::new(0),
        stale: AtomicUsize::new(0),
        current: Mutex::new("rtok-0".to_owned()),
        forms: Mutex::new(Vec::new()),
        expires_in,
    });
    let router = axum::Router::new()
        .route("/token", axum::routing::post(token))
        .with_state(mock.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    (mock, format!("http://{addr}/token"))
}

/// Refresher settings for tests: a check every 50 ms, a quick backoff.
fn fast() -> OAuthSettings {
    OAuthSettings {
        check_every: Duration::from_millis(50),
        call_timeout: Duration::from_secs(5),
        claim_for: Duration::from_secs(10),
        backoff_first: Duration::from_millis(100),
        backoff_max: Duration::from_millis(400),
    }
}

async fn app() -> TestApp {
    let mut options = AppOptions::default();
    options.settings.oauth = fast();
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
    app.put_key_raw(
        "k",
        json!({
            "provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 4,
            "secret": {"access_token": "at-0", "refresh_token": "rtok-0",
                       "expires_at": rfc3339(OffsetDateTime::now_utc() + time::Duration::seconds(expires_in))},
            "oauth": {"token_url": token_url, "client_id": "client-1",
                      "client_secret": "cs-do-not-leak", "refresh_before_seconds": refresh_before},
        }),
    )
    .await
}

async fn admin_get(app: &TestApp, path: &str) -> Value {
    let response = app
        .client
        .get(app.url(path))
        .header("x-admin-key", ADMIN_KEY)
        .send()
        .await
        .unwrap();
    json_body(response, StatusCode::OK).await
}

async fn allocate(app: &TestApp, lease_seconds: u32) -> reqwest::Response {
    app.allocate(json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": lease_seconds}))
        .await
}

/// A lease of `k`; returns its access token.
async fn leased_token(app: &TestApp) -> String {
    let lease = json_body(allocate(app, 5).await, StatusCode::OK).await;
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
    sqlx::query("UPDATE oauth_credentials SET refresh_before_seconds = $1")
        .bind(seconds)
        .execute(&app.db)
        .await
        .unwrap();
}

async fn generation(app: &TestApp) -> i64 {
    admin_get(app, "/api/admin/keys/k").await["oauth"]["generation"]
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

    until("the first refresh", || async {
        generation(&app).await == 2
    })
    .await;
    assert_eq!(leased_token(&app).await, "at-1");
    // the new token lives an hour: nothing more to refresh, however many passes run
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(mock.calls(), 1);
    let refreshed_before_expiry: bool = sqlx::query_scalar(
        "SELECT at < $1::timestamptz FROM credential_events WHERE event = 'token_refreshed'",
    )
    .bind(&original_expiry)
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert!(refreshed_before_expiry);

    // due again (at-1 lives 3600 s, at-2 will live 7200 s): the refresh presents the rotated
    // refresh token
    set_refresh_before(&app, 3650).await;
    until("the second refresh", || async {
        generation(&app).await == 3
    })
    .await;
    assert_eq!(leased_token(&app).await, "at-2");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(mock.calls(), 2);
    let forms = mock.forms.lock().unwrap().clone();
    let presented: Vec<&str> = forms.iter().map(|f| f["refresh_token"].as_str()).collect();
    assert_eq!(presented[..2], ["rtok-0", "rtok-1"]);
    assert_eq!(forms[0]["grant_type"], "refresh_token");
    assert_eq!(forms[0]["client_id"], "client-1");
    assert_eq!(forms[0]["client_secret"], "cs-do-not-leak");
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
async fn replicas_and_concurrent_refreshers_make_one_token_call_per_generation() {
    let app = app().await;
    // slow answers: every refresher's pass overlaps the call in flight
    let (mock, url) = mock_endpoint(
        Mode::Ok {
            delay: Duration::from_millis(200),
        },
        3600,
    )
    .await;
    assert_eq!(
        put_oauth(&app, &url, 3600, 0).await.status(),
        StatusCode::CREATED
    );
    // three more service processes' worth of refreshers (apps on the same database) ...
    let mut options = AppOptions::default();
    options.settings.oauth = fast();
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
    let detail = admin_get(&app, "/api/admin/keys/k").await;
    assert_eq!(detail["status"], "available");
    assert_eq!(leased_token(&app).await, format!("at-{issued}"));
}

async fn refreshers(app: &TestApp, n: usize) -> Vec<Arc<Refresher>> {
    let mut refreshers = Vec::new();
    for _ in 0..n {
        refreshers.push(Arc::new(Refresher::new(
            app.database.pool(2).await.into(),
            keyring(),
            fast(),
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
    assert_eq!(
        put_oauth(&app, &url, 100, 200).await.status(),
        StatusCode::CREATED
    );
    until("retried failures", || async { mock.calls() >= 3 }).await;
    for _ in 0..3 {
        assert_eq!(leased_token(&app).await, "at-0");
    }
    let detail = admin_get(&app, "/api/admin/keys/k").await;
    assert_eq!(detail["status"], "available");
    assert_eq!(detail["oauth"]["generation"], 1);
    assert!(
        detail["oauth"]["last_error"]
            .as_str()
            .unwrap()
            .contains("503"),
        "{detail}"
    );
    let events = refresh_events(&app).await;
    assert!(
        events
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
    let detail = admin_get(&app, "/api/admin/keys/k").await;
    assert_eq!(detail["oauth"]["last_error"], Value::Null);
}

#[tokio::test]
async fn invalid_grant_disables_the_credential_until_an_operator_puts_a_new_secret() {
    let app = app().await;
    let (mock, url) = mock_endpoint(Mode::InvalidGrant, 3600).await;
    assert_eq!(
        put_oauth(&app, &url, 3600, 7200).await.status(),
        StatusCode::CREATED
    );
    until("the credential disabled", || async {
        admin_get(&app, "/api/admin/keys/k").await["status"] == "disabled"
    })
    .await;
    assert_error(
        allocate(&app, 5).await,
        StatusCode::CONFLICT,
        "no_usable_credentials",
    )
    .await;
    let detail = admin_get(&app, "/api/admin/keys/k").await;
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
    let lease = allocate(&app, 5).await;
    seen.push(lease.text().await.unwrap());
    seen.push(admin_get(&app, "/api/admin/keys/k").await.to_string());
    seen.push(admin_get(&app, "/api/admin/keys").await.to_string());
    seen.push(app.metrics().await);
    let trail: Vec<String> = sqlx::query_scalar(
        "SELECT row_to_json(e)::text FROM credential_events e
         UNION ALL SELECT row_to_json(l)::text FROM lease_events l",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    seen.extend(trail);
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT row_to_json(c)::text FROM credentials c
         UNION ALL SELECT row_to_json(o)::text FROM oauth_credentials o",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    seen.extend(rows);
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
    assert_eq!(
        put_oauth(&app, &url, 30, 0).await.status(),
        StatusCode::CREATED
    );
    let detail = admin_get(&app, "/api/admin/keys/k").await;
    let expires_at = OffsetDateTime::parse(
        detail["oauth"]["token_expires_at"].as_str().unwrap(),
        &Rfc3339,
    )
    .unwrap();

    assert_error(
        allocate(&app, 120).await,
        StatusCode::TOO_MANY_REQUESTS,
        "pool_exhausted",
    )
    .await;
    assert_eq!(app.in_flight("k").await, 0);
    let lease = json_body(allocate(&app, 10).await, StatusCode::OK).await;
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
        assert_error(
            put_oauth(&app, url, 3600, 0).await,
            StatusCode::BAD_REQUEST,
            "token_url_not_allowed",
        )
        .await;
    }
    let missing = app
        .client
        .get(app.url("/api/admin/keys/k"))
        .header("x-admin-key", ADMIN_KEY)
        .send()
        .await
        .unwrap();
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
    assert_eq!(
        put_oauth(&app, &url, 3600, 0).await.status(),
        StatusCode::CREATED
    );
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
    assert_error(
        put_if("2", "at-stale").await,
        StatusCode::PRECONDITION_FAILED,
        "generation_moved",
    )
    .await;
    assert_eq!(generation(&app).await, 1);
    assert_eq!(leased_token(&app).await, "at-0");
    // the one that read generation 1 stores its token: generation 2
    let stored = json_body(put_if("\"1\"", "at-outside").await, StatusCode::OK).await;
    assert_eq!(stored["oauth"]["generation"], 2);
    assert_eq!(leased_token(&app).await, "at-outside");
    // a second refresher that also read generation 1 can no longer roll it back
    assert_error(
        put_if("1", "at-rollback").await,
        StatusCode::PRECONDITION_FAILED,
        "generation_moved",
    )
    .await;
    assert_eq!(leased_token(&app).await, "at-outside");
    assert_error(
        put_if("soon", "at-x").await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    )
    .await;
}

#[tokio::test]
async fn reencrypting_under_a_new_master_key_reseals_the_oauth_grant_too() {
    use credpool::secrets::{Keyring, MasterKey};
    let app = app().await;
    let (_mock, url) = mock_endpoint(Mode::Unavailable, 3600).await;
    assert_eq!(
        put_oauth(&app, &url, 3600, 0).await.status(),
        StatusCode::CREATED
    );
    let old = MasterKey::parse(MASTER_KEY).unwrap();
    let ring = Keyring::new(MasterKey::generate(), vec![old]);
    let db: credpool::store::Db = app.database.pool(2).await.into();
    let actor = credpool::store::credentials::Actor::parse("cli:test").unwrap();
    let resealed = credpool::store::credentials::reseal(&db, &ring, false, &actor)
        .await
        .unwrap();
    assert_eq!(resealed, 2, "the access token and the grant");
    let sealed: Vec<u8> =
        sqlx::query_scalar("SELECT refresh_ciphertext FROM oauth_credentials WHERE key_id = 'k'")
            .fetch_one(&app.db)
            .await
            .unwrap();
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
async fn the_pools_summary_says_when_the_earliest_token_expires() {
    let app = app().await;
    let (_mock, url) = mock_endpoint(Mode::Unavailable, 3600).await;
    assert_eq!(
        put_oauth(&app, &url, 600, 0).await.status(),
        StatusCode::CREATED
    );
    app.put_key("plain", "openai", "other", &["gpt-4o"], 1)
        .await;
    let pools = admin_get(&app, "/api/admin/pools").await;
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
}
