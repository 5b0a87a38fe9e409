//! The relay (`/relay/{provider}/{pool}/...`), against a mock upstream of the test's own on
//! 127.0.0.1 that records what reaches it, counts the calls it serves at once, streams its answers
//! chunk by chunk at a pace the call asks for (`x-mock-chunks`, `x-mock-interval-ms`; an unstreamed
//! answer after `x-mock-delay-ms`; the end of a stream `x-mock-linger-ms` after its last event:
//! plain headers the relay passes on), and answers a credential scripted so with 429.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use credpool_test_support::*;

/// What reached the mock upstream, per call.
#[derive(Debug, Clone)]
struct Seen {
    path_and_query: String,
    headers: HeaderMap,
}

#[derive(Default)]
struct Mock {
    seen: Mutex<Vec<Seen>>,
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    /// Streams whose client went away before their last chunk.
    abandoned: AtomicUsize,
    /// Credentials answered 429 with `Retry-After: 30`.
    rate_limited: Mutex<HashSet<String>>,
}

/// Counts a call in flight until dropped (its answer's last chunk, or its client gone).
struct Serving {
    mock: Arc<Mock>,
    finished: bool,
}

impl Serving {
    fn start(mock: &Arc<Mock>) -> Self {
        let now = mock.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        mock.peak.fetch_max(now, Ordering::SeqCst);
        Self {
            mock: mock.clone(),
            finished: false,
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.mock.in_flight.fetch_sub(1, Ordering::SeqCst);
        if !self.finished {
            self.mock.abandoned.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// The credential a call presents: its bearer token or its `x-api-key`.
fn credential_of(headers: &HeaderMap) -> String {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    text("authorization")
        .and_then(|a| a.strip_prefix("Bearer ").map(str::to_owned))
        .or_else(|| text("x-api-key"))
        .unwrap_or_default()
}

fn header_number(headers: &HeaderMap, name: &str, default: u64) -> u64 {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(default)
}

/// Every call: recorded; 429 for a scripted credential; else a streamed answer when the body asks
/// for `stream` (one event per chunk, usage in the last), or JSON with `usage` (16 tokens).
async fn answer(State(mock): State<Arc<Mock>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    mock.seen.lock().unwrap().push(Seen {
        path_and_query: parts
            .uri
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default(),
        headers: parts.headers.clone(),
    });
    let credential = credential_of(&parts.headers);
    if mock.rate_limited.lock().unwrap().contains(&credential) {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "30")],
            axum::Json(json!({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}})),
        )
            .into_response();
    }
    let body: Value = axum::body::to_bytes(body, 1 << 20)
        .await
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    let mut serving = Serving::start(&mock);
    if body["stream"] != json!(true) {
        let delay = header_number(&parts.headers, "x-mock-delay-ms", 0);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        serving.finished = true;
        return axum::Json(json!({
            "id": "chatcmpl-mock", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16},
        }))
        .into_response();
    }
    let chunks = header_number(&parts.headers, "x-mock-chunks", 3);
    let interval = Duration::from_millis(header_number(&parts.headers, "x-mock-interval-ms", 10));
    let linger = Duration::from_millis(header_number(&parts.headers, "x-mock-linger-ms", 0));
    let events = futures::stream::unfold((0, serving), move |(n, mut serving)| async move {
        if n == chunks {
            // the last event has gone; the answer's own end comes after `linger`
            tokio::time::sleep(linger).await;
            serving.finished = true;
            drop(serving);
            return None;
        }
        tokio::time::sleep(interval).await;
        let line = if n + 1 == chunks {
            let usage = json!({"choices": [], "usage": {"total_tokens": 21}});
            format!("data: {usage}\n\ndata: [DONE]\n\n")
        } else {
            let delta = json!({"choices": [{"delta": {"content": format!("chunk {n}")}}]});
            format!("data: {delta}\n\n")
        };
        Some((Ok::<_, std::io::Error>(line), (n + 1, serving)))
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(events))
        .unwrap()
}

/// A mock upstream on 127.0.0.1.
async fn mock_upstream() -> (SocketAddr, Arc<Mock>) {
    let mock = Arc::new(Mock::default());
    let app = axum::Router::new()
        .fallback(answer)
        .with_state(mock.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, mock)
}

/// An app whose `openai` upstream is the mock (OpenAI's API), with credential `k1` of `limit`
/// slots; the lease length is `lease_seconds` (renewed every third of it while a call runs).
async fn relay_app(limit: u32, lease_seconds: u32) -> (TestApp, SocketAddr, Arc<Mock>) {
    let mut options = AppOptions::default();
    options.settings.max_lease_seconds = lease_seconds;
    relay_app_with(limit, options).await
}

/// [`relay_app`] with `options`.
async fn relay_app_with(limit: u32, options: AppOptions) -> (TestApp, SocketAddr, Arc<Mock>) {
    let app = TestApp::spawn_with(options).await;
    let (addr, mock) = mock_upstream().await;
    app.put_gpt4o_key("k1", "default", limit).await;
    let response = app
        .admin(
            Method::PUT,
            "/api/admin/relay/upstreams/openai",
            Some(json!({"base_url": format!("http://{addr}"), "api": "openai"})),
        )
        .await;
    assert_eq!(response.status(), StatusCode::CREATED);
    (app, addr, mock)
}

/// A relay call of `key` (as a bearer token) with `body` and `headers`.
async fn call(
    app: &TestApp,
    path: &str,
    key: &str,
    body: Value,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut request = app.client.post(app.url(path)).bearer_auth(key).json(&body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

const CHAT: &str = "/relay/openai/default/v1/chat/completions";

fn chat(stream: bool) -> Value {
    json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": stream})
}

/// An unstreamed chat call of the internal key, with `headers`.
async fn chat_call(app: &TestApp, headers: &[(&str, &str)]) -> reqwest::Response {
    call(app, CHAT, INTERNAL_KEY, chat(false), headers).await
}

/// A streamed chat call of the internal key, with `headers` (the mock's pace).
async fn stream_call(app: &TestApp, headers: &[(&str, &str)]) -> reqwest::Response {
    call(app, CHAT, INTERNAL_KEY, chat(true), headers).await
}

/// A streamed call of 100 chunks 100 ms apart (10 s in all), once its first chunk has come.
async fn streaming(app: &TestApp) -> reqwest::Response {
    let chunks = [("x-mock-chunks", "100"), ("x-mock-interval-ms", "100")];
    let mut response = stream_call(app, &chunks).await;
    response.chunk().await.unwrap().unwrap();
    response
}

/// A trail row of a relay lease: (event, holder, outcome, tokens).
type TrailRow = (String, Option<String>, Option<String>, Option<i64>);

/// The trail rows of the relay's leases, in order.
async fn relay_trail(app: &TestApp) -> Vec<TrailRow> {
    sqlx::query_as(
        "SELECT event, holder, outcome, tokens FROM lease_events
          WHERE holder LIKE 'relay%' ORDER BY event_id",
    )
    .fetch_all(&app.db)
    .await
    .unwrap()
}

/// A relay call of the internal key to `path` exactly as written (no client resolves its dot
/// segments first): its status and JSON body.
async fn raw_post(app: &TestApp, path: &str, body: &Value) -> (u16, Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = body.to_string();
    let mut stream = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {INTERNAL_KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        app.addr,
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    let status = answer[9..12].parse().unwrap();
    let json = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    (status, serde_json::from_str(json).unwrap_or(Value::Null))
}

/// Asserts that `k1`'s slot is free within a second: its lease did not outlive its client.
async fn slot_freed_within_a_second(app: &TestApp) {
    assert!(
        eventually(Duration::from_secs(1), async || app.in_flight("k1").await
            == 0)
        .await,
        "the lease outlived its client"
    );
}

/// Asserts that the mock upstream sees one stream's client go away within 2 s (the relay let its
/// connection go).
async fn upstream_saw_its_client_leave(mock: &Mock) {
    assert!(
        eventually(Duration::from_secs(2), async || mock
            .abandoned
            .load(Ordering::SeqCst)
            == 1)
        .await,
        "the upstream's call went on"
    );
}

/// Polls `check` every 20 ms for up to `within`; true as soon as it holds.
async fn eventually(within: Duration, mut check: impl AsyncFnMut() -> bool) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check().await
}

#[tokio::test]
async fn a_call_reaches_the_upstream_with_the_credential_and_never_the_callers_key() {
    let (app, _, mock) = relay_app(2, 35).await;
    let response = call(
        &app,
        &format!("{CHAT}?api-version=1"),
        INTERNAL_KEY,
        chat(false),
        &[
            ("cookie", "session=1"),
            ("x-forwarded-for", "10.1.2.3"),
            ("x-forwarded-port", "443"),
            ("via", "1.1 gateway"),
            // the caller's key again, where Azure-style clients send it
            ("api-key", INTERNAL_KEY),
            ("openai-beta", "assistants=v2"),
        ],
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers().contains_key("x-credpool-lease-id"));
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["usage"]["total_tokens"], 16);

    let seen = mock.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].path_and_query, "/v1/chat/completions?api-version=1");
    let headers = &seen[0].headers;
    assert_eq!(headers["authorization"], "Bearer sk-test-k1");
    assert_eq!(headers["openai-beta"], "assistants=v2");
    for gone in [
        "cookie",
        "x-forwarded-for",
        "x-forwarded-port",
        "via",
        "x-internal-key",
        "x-api-key",
        "api-key",
    ] {
        assert!(!headers.contains_key(gone), "{gone} reached the upstream");
    }
    let everything = format!("{headers:?}");
    assert!(
        !everything.contains(INTERNAL_KEY),
        "the executor key reached the upstream"
    );

    // released when the answer ended, with the usage it reported, as a relay call
    let trail = relay_trail(&app).await;
    assert_eq!(
        trail,
        [
            ("granted".into(), Some("relay".into()), None, Some(50)),
            (
                "released".into(),
                Some("relay".into()),
                Some("success".into()),
                Some(16)
            ),
        ]
    );
    assert_eq!(app.in_flight("k1").await, 0);
    let metrics = app.metrics().await;
    assert!(
        metrics.contains(
            r#"credpool_relay_calls_total{provider="openai",pool="default",outcome="success"} 1"#
        ),
        "{metrics}"
    );
    // the credential appears in no answer the client got
    assert!(
        !serde_json::to_string(&answer)
            .unwrap()
            .contains("sk-test-k1")
    );
    // the dashboard's pool card counts the relay's calls of the last hour, from the trail
    let page = app.admin_text("/dashboard/fragments/pools").await;
    assert!(page.contains("relay, last hour: 1 success"), "{page}");
}

#[tokio::test]
async fn a_stream_is_passed_on_as_it_comes_and_its_usage_lands_in_the_trail() {
    let (app, _, _mock) = relay_app(1, 35).await;
    let response = stream_call(
        &app,
        &[("x-mock-chunks", "5"), ("x-mock-interval-ms", "300")],
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    let started = Instant::now();
    let mut response = response;
    let first = response.chunk().await.unwrap().unwrap();
    let first_at = started.elapsed();
    assert!(String::from_utf8_lossy(&first).contains("chunk 0"));
    let mut rest = Vec::new();
    while let Some(chunk) = response.chunk().await.unwrap() {
        rest.extend_from_slice(&chunk);
    }
    let last_at = started.elapsed();
    // the first chunk came while the upstream was still sending the other four (300 ms apart)
    assert!(
        last_at >= first_at + Duration::from_millis(900),
        "first chunk at {first_at:?}, the end at {last_at:?}: the answer was held back"
    );
    assert!(String::from_utf8_lossy(&rest).contains("\"total_tokens\":21"));
    let trail = relay_trail(&app).await;
    assert_eq!(trail.last().unwrap().2.as_deref(), Some("success"));
    assert_eq!(
        trail.last().unwrap().3,
        Some(21),
        "the stream's usage replaces the estimate"
    );
    // released before the end reached the client: the slot is free now
    assert_eq!(app.in_flight("k1").await, 0);
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_frees_the_slot_at_once() {
    let (app, _, mock) = relay_app(1, 35).await;
    let response = streaming(&app).await;
    assert_eq!(app.in_flight("k1").await, 1);
    drop(response);
    // within a second, not at the lease's end 35 s on
    slot_freed_within_a_second(&app).await;
    upstream_saw_its_client_leave(&mock).await;
    let trail = relay_trail(&app).await;
    assert_eq!(trail.last().unwrap().0, "released");
    assert_eq!(
        trail.last().unwrap().2,
        None,
        "a client's leaving is not the credential's failure"
    );
    assert!(
        app.metrics()
            .await
            .contains(r#"outcome="client_closed"} 1"#)
    );
}

#[tokio::test]
async fn calls_never_put_more_on_a_credential_than_its_limit() {
    let (app, _, mock) = relay_app(2, 35).await;
    let calls = (0..12).map(|_| {
        stream_call(
            &app,
            &[("x-mock-chunks", "3"), ("x-mock-interval-ms", "50")],
        )
    });
    let mut served = 0;
    for response in futures::future::join_all(calls).await {
        assert_eq!(
            response.status(),
            StatusCode::OK,
            "a call did not wait for its slot"
        );
        response.bytes().await.unwrap();
        served += 1;
    }
    assert_eq!(served, 12);
    assert_eq!(
        mock.peak.load(Ordering::SeqCst),
        2,
        "the upstream served more at once than the limit"
    );
}

#[tokio::test]
async fn an_upstream_429_rests_the_credential_and_reaches_the_client() {
    let (app, _, mock) = relay_app(1, 35).await;
    mock.rate_limited
        .lock()
        .unwrap()
        .insert("sk-test-k1".into());
    let response = chat_call(&app, &[]).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()["retry-after"], "30");
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["error"]["code"], "rate_limit_exceeded",
        "the upstream's own answer"
    );
    let credential = app.credential("k1").await;
    assert_eq!(credential["status"], "rate_limited", "{credential}");
    assert_eq!(
        relay_trail(&app).await.last().unwrap().2.as_deref(),
        Some("rate_limited")
    );

    // the next call finds no credential that can serve before its wait ends: credpool's own 429
    let refused = chat_call(&app, &[("x-credpool-wait-ms", "0")]).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let seconds: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((25..=31).contains(&seconds), "{seconds}");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "pool_exhausted");
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert_eq!(
        mock.seen.lock().unwrap().len(),
        1,
        "the refused call reached the upstream"
    );
}

#[tokio::test]
async fn refusals_reach_no_upstream() {
    let (app, addr, mock) = relay_app(1, 35).await;
    let tenant_key = app
        .tenant_key("team-a", json!({"pools": ["openai/*"]}))
        .await;
    let other_scope = app
        .tenant_key("team-b", json!({"pools": ["anthropic/*"]}))
        .await;
    // (path, key, an extra header, status, code)
    let cases = [
        (
            CHAT,
            "wrong-key",
            None,
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            "/relay/nope/default/v1/chat/completions",
            INTERNAL_KEY,
            None,
            StatusCode::NOT_FOUND,
            "upstream_not_configured",
        ),
        (
            CHAT,
            &other_scope,
            None,
            StatusCode::FORBIDDEN,
            "pool_not_allowed",
        ),
        (
            CHAT,
            INTERNAL_KEY,
            Some(("x-credpool-wait-ms", "soon")),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
    ];
    for (path, key, header, status, code) in cases {
        let headers: Vec<_> = header.into_iter().collect();
        let response = call(&app, path, key, chat(false), &headers).await;
        assert_eq!(response.status(), status, "{path}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], code, "{path}: {body}");
        assert!(body["error"]["message"].is_string());
    }
    // paths that would leave the base URL's path, sent as they are (an HTTP client library
    // would resolve the dot segments itself)
    for forged in [
        "/relay/openai/default//evil.example.com/v1",
        "/relay/openai/default/v1/../../admin",
        "/relay/openai/default/v1/%2e%2e/admin",
        "/relay/openai/default/v1%2f..%2fadmin",
    ] {
        let (status, body) = raw_post(&app, forged, &chat(false)).await;
        assert_eq!(status, 400, "{forged}: {body}");
        assert_eq!(body["error"]["code"], "invalid_request", "{forged}: {body}");
    }
    // the executor key in the query (`?key=`, as some SDKs send one) would reach the upstream
    let in_query = call(
        &app,
        &format!("{CHAT}?key={INTERNAL_KEY}"),
        INTERNAL_KEY,
        chat(false),
        &[],
    )
    .await;
    assert_eq!(in_query.status(), StatusCode::BAD_REQUEST);
    // no key at all; a body without a model
    let bare = app
        .client
        .post(app.url(CHAT))
        .json(&chat(false))
        .send()
        .await
        .unwrap();
    assert_eq!(bare.status(), StatusCode::UNAUTHORIZED);
    let modelless = call(&app, CHAT, INTERNAL_KEY, json!({"messages": []}), &[]).await;
    assert_eq!(modelless.status(), StatusCode::BAD_REQUEST);
    // an Anthropic client gets Anthropic's error shape
    let anthropic = app
        .client
        .post(app.url("/relay/nope/default/v1/messages"))
        .header("x-api-key", "wrong-key")
        .header("anthropic-version", "2023-06-01")
        .json(&chat(false))
        .send()
        .await
        .unwrap();
    assert_eq!(anthropic.status(), StatusCode::UNAUTHORIZED);
    let body: Value = anthropic.json().await.unwrap();
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "authentication_error");

    // a tenant key works until revoked (the answer read to its end: its lease is released)
    let served = call(&app, CHAT, &tenant_key, chat(false), &[]).await;
    assert_eq!(served.status(), StatusCode::OK);
    served.bytes().await.unwrap();
    let key_id: String =
        sqlx::query_scalar("SELECT key_id::text FROM tenant_keys WHERE tenant_id = 'team-a'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    let revoked = app
        .admin(
            Method::DELETE,
            &format!("/api/admin/tenants/team-a/keys/{key_id}"),
            None,
        )
        .await;
    assert!(revoked.status().is_success(), "{}", revoked.status());
    let after = call(&app, CHAT, &tenant_key, chat(false), &[]).await;
    assert_eq!(after.status(), StatusCode::UNAUTHORIZED);

    assert_eq!(
        mock.seen.lock().unwrap().len(),
        1,
        "only the tenant's one good call reached {addr}"
    );
    assert_eq!(app.in_flight("k1").await, 0);
}

#[tokio::test]
async fn a_call_whose_lease_is_taken_away_is_cut() {
    // a 3 s lease, renewed every second while the call runs
    let (app, _, mock) = relay_app(1, 3).await;
    let mut response = streaming(&app).await;
    let lease_id = response.headers()["x-credpool-lease-id"]
        .to_str()
        .unwrap()
        .to_owned();
    // renewed past its first length: the call outlives its 3 s lease
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        app.in_flight("k1").await,
        1,
        "the lease was not renewed while the call ran"
    );
    assert!(mock.abandoned.load(Ordering::SeqCst) == 0);
    // an operator takes it away: the next renewal finds it gone, and the call ends
    let forced = app.force_release(&lease_id, "test").await;
    assert!(forced.status().is_success());
    let cut = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match response.chunk().await {
                Ok(Some(_)) => continue,
                Ok(None) => return false,
                Err(_) => return true,
            }
        }
    })
    .await
    .expect("the call went on after its lease was taken away");
    assert!(cut, "a cut call must not read as a whole answer");
    upstream_saw_its_client_leave(&mock).await;
}

#[tokio::test]
async fn upstreams_are_checked_and_every_change_is_trailed() {
    let app = TestApp::spawn().await;
    let put = |body: Value| app.admin(Method::PUT, "/api/admin/relay/upstreams/openai", Some(body));
    for refused in [
        json!({"base_url": "http://api.openai.com", "api": "openai"}),
        json!({"base_url": "https://user:pw@api.openai.com", "api": "openai"}),
        json!({"base_url": "https://api.openai.com", "api": "gemini"}),
        json!({"base_url": "https://api.openai.com", "api": "openai", "credential_header": "host"}),
        json!({"base_url": "https://api.openai.com", "api": "openai", "wait_ms": 600001}),
        json!({"base_url": "https://api.openai.com", "api": "openai", "timeout_seconds": 0}),
    ] {
        let response = put(refused.clone()).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{refused}");
    }
    let created = put(json!({"base_url": "https://api.openai.com", "api": "openai"})).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let replaced = put(json!({"base_url": "https://gateway.example.com/v1", "api": "openai", "affinity_header": "x-session-id"})).await;
    assert_eq!(replaced.status(), StatusCode::OK);
    let listed = app.admin_get("/api/admin/relay/upstreams").await;
    assert_eq!(
        listed["upstreams"][0]["base_url"],
        "https://gateway.example.com/v1"
    );
    assert_eq!(listed["upstreams"][0]["affinity_header"], "x-session-id");
    assert_eq!(listed["upstreams"][0]["updated_by"], OPERATOR);
    // the executor key may not
    let executor = app
        .client
        .get(app.url("/api/admin/relay/upstreams"))
        .header("x-admin-key", INTERNAL_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(executor.status(), StatusCode::FORBIDDEN);
    let path = "/api/admin/relay/upstreams/openai";
    assert_eq!(
        app.admin(Method::DELETE, path, None).await.status(),
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        app.admin(Method::DELETE, path, None).await.status(),
        StatusCode::NOT_FOUND
    );
    let events: Vec<(String, String)> =
        sqlx::query_as("SELECT event, actor FROM relay_upstream_events ORDER BY event_id")
            .fetch_all(&app.db)
            .await
            .unwrap();
    let events: Vec<_> = events
        .iter()
        .map(|(e, a)| (e.as_str(), a.as_str()))
        .collect();
    assert_eq!(
        events,
        [("set", OPERATOR), ("set", OPERATOR), ("removed", OPERATOR)]
    );
}

#[tokio::test]
async fn a_conversation_stays_on_its_credential_through_the_configured_header() {
    let (app, addr, mock) = relay_app(4, 35).await;
    for key in ["k2", "k3"] {
        app.put_gpt4o_key(key, "default", 4).await;
    }
    let response = app
        .admin(
            Method::PUT,
            "/api/admin/relay/upstreams/openai",
            Some(json!({"base_url": format!("http://{addr}"), "api": "openai", "affinity_header": "x-session-id"})),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    for session in ["conversation-a", "conversation-b"] {
        for _ in 0..4 {
            let answer = chat_call(&app, &[("x-session-id", session)]).await;
            assert_eq!(answer.status(), StatusCode::OK);
            answer.bytes().await.unwrap();
        }
    }
    let seen = mock.seen.lock().unwrap().clone();
    let used = |session: &str| -> HashSet<String> {
        seen.iter()
            .filter(|s| s.headers["x-session-id"] == session)
            .map(|s| credential_of(&s.headers))
            .collect()
    };
    // every call of a conversation on one credential (the session header still reaches the
    // upstream: it is the caller's, not credpool's)
    assert_eq!(
        used("conversation-a").len(),
        1,
        "{:?}",
        used("conversation-a")
    );
    assert_eq!(
        used("conversation-b").len(),
        1,
        "{:?}",
        used("conversation-b")
    );
    let affinity: Vec<String> = sqlx::query_scalar(
        "SELECT affinity FROM lease_events WHERE event = 'granted' AND holder = 'relay' ORDER BY event_id",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    assert_eq!(
        affinity.iter().filter(|a| *a == "hit").count(),
        6,
        "{affinity:?}"
    );
}

#[tokio::test]
async fn an_upstream_that_is_slow_or_away_is_a_gateway_error_and_frees_the_slot() {
    let (app, addr, _mock) = relay_app(1, 35).await;
    let set = |base_url: String| {
        app.admin(
            Method::PUT,
            "/api/admin/relay/upstreams/openai",
            Some(json!({"base_url": base_url, "api": "openai", "timeout_seconds": 1})),
        )
    };
    assert_eq!(set(format!("http://{addr}")).await.status(), StatusCode::OK);
    let slow = chat_call(&app, &[("x-mock-delay-ms", "3000")]).await;
    assert_eq!(slow.status(), StatusCode::GATEWAY_TIMEOUT);
    let body: Value = slow.json().await.unwrap();
    assert_eq!(body["error"]["code"], "upstream_timeout");
    assert_eq!(app.in_flight("k1").await, 0);

    // a port nothing listens on
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let nowhere = closed.local_addr().unwrap();
    drop(closed);
    assert_eq!(
        set(format!("http://{nowhere}")).await.status(),
        StatusCode::OK
    );
    let away = chat_call(&app, &[]).await;
    assert_eq!(away.status(), StatusCode::BAD_GATEWAY);
    let body: Value = away.json().await.unwrap();
    assert_eq!(body["error"]["code"], "upstream_unreachable");
    assert_eq!(app.in_flight("k1").await, 0);
    let outcomes: Vec<Option<String>> = relay_trail(&app)
        .await
        .into_iter()
        .filter(|row| row.0 == "released")
        .map(|row| row.2)
        .collect();
    assert_eq!(outcomes, [Some("failure".into()), Some("failure".into())]);
}

#[tokio::test]
async fn a_client_that_leaves_after_the_last_event_made_a_whole_call() {
    let (app, _, _mock) = relay_app(1, 35).await;
    // the upstream keeps the answer open 5 s after its last event; the client, as OpenAI's SDK
    // does, leaves once it has read `data: [DONE]`
    let mut response = stream_call(
        &app,
        &[("x-mock-chunks", "3"), ("x-mock-linger-ms", "5000")],
    )
    .await;
    let mut read = Vec::new();
    while !String::from_utf8_lossy(&read).contains("[DONE]") {
        read.extend_from_slice(&response.chunk().await.unwrap().unwrap());
    }
    drop(response);
    slot_freed_within_a_second(&app).await;
    let trail = relay_trail(&app).await;
    let released = trail.last().unwrap();
    assert_eq!(
        (released.2.as_deref(), released.3),
        (Some("success"), Some(21)),
        "a whole answer counts as a success with its usage: {trail:?}"
    );
}

#[tokio::test]
async fn a_stream_longer_than_the_idle_timeout_is_a_request_in_flight_not_an_idle_connection() {
    let mut options = AppOptions::default();
    options.settings.http.idle_timeout = Duration::from_secs(1);
    let (app, _, mock) = relay_app_with(1, options).await;
    // 3 s of answer, a chunk every 300 ms, on a service that closes connections idle for 1 s
    let mut response = stream_call(
        &app,
        &[("x-mock-chunks", "10"), ("x-mock-interval-ms", "300")],
    )
    .await;
    let mut read = Vec::new();
    while let Some(chunk) = response.chunk().await.expect("the stream was cut") {
        read.extend_from_slice(&chunk);
    }
    assert!(String::from_utf8_lossy(&read).contains("[DONE]"));
    assert_eq!(mock.abandoned.load(Ordering::SeqCst), 0);
    assert_eq!(
        relay_trail(&app).await.last().unwrap().2.as_deref(),
        Some("success")
    );
}
