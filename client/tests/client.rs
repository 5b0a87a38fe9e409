//! The client against an in-process fake of credpool's executor routes.

mod fake;

use std::time::{Duration, Instant};

use credpool_client::{
    Client, DEFAULT_LEASE_SECONDS, Error, LeaseGuard, LeaseRequest, NotReleased, Outcome, Released,
    RetryPolicy, TransportKind,
};
use fake::{FENCE, Fake, LEASE_ID, Reply, Route, SECRET, SERVED_POOL};
use serde_json::{Value, json};

const INTERNAL_KEY: &str = "INTERNAL-KEY-5c4b3a-do-not-leak";

/// Fast retries, so that tests that exhaust them stay short.
fn fast_retries() -> RetryPolicy {
    RetryPolicy {
        base_delay: Duration::from_millis(5),
        max_delay: Duration::from_millis(50),
        max_retries: None,
        max_elapsed: Some(Duration::from_secs(3)),
    }
}

/// A client of `base_url` with [`fast_retries`] that gives up after `max_retries` retries.
fn client_retrying(base_url: impl Into<String>, max_retries: usize) -> Client {
    Client::builder(base_url, INTERNAL_KEY)
        .retry(RetryPolicy {
            max_retries: Some(max_retries),
            ..fast_retries()
        })
        .build()
        .expect("builds")
}

/// An address on 127.0.0.1 that nothing listens on (the listener bound to it is gone).
fn closed_address() -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    listener.local_addr().expect("has an address")
}

/// The server's 429 `pool_exhausted` with `Retry-After: {retry_after}` (seconds).
fn exhausted(retry_after: u64) -> Reply {
    Reply::error(429, "pool_exhausted").header("retry-after", retry_after.to_string())
}

/// Panics unless `error` is `PoolExhausted` with a `Retry-After` of `seconds` (`context`
/// names the case).
fn assert_exhausted(error: &Error, seconds: u64, context: impl std::fmt::Debug) {
    assert!(
        matches!(error, Error::PoolExhausted { retry_after } if *retry_after == Duration::from_secs(seconds)),
        "{context:?}: {error:?}"
    );
}

fn client(fake: &Fake) -> Client {
    Client::builder(&fake.url, INTERNAL_KEY)
        .retry(fast_retries())
        .http_timeout(Duration::from_secs(2))
        .build()
        .expect("client builds")
}

fn request() -> LeaseRequest {
    LeaseRequest::new("openai", "gpt-4o")
}

/// A lease of 1 s, renewed every ~333 ms.
async fn short_lease(fake: &Fake) -> LeaseGuard {
    client(fake)
        .lease(request().pool("vip").lease_seconds(1).holder("test-worker"))
        .await
        .expect("leases")
}

fn request_ids(fake: &Fake) -> Vec<String> {
    fake.requests(Route::Allocate)
        .iter()
        .map(|r| {
            r.body["request_id"]
                .as_str()
                .expect("has a request_id")
                .to_owned()
        })
        .collect()
}

/// Polls `condition` every 20 ms for up to `limit`.
async fn eventually(limit: Duration, condition: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if condition() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    condition()
}

fn assert_no_secret(text: &str) {
    assert!(!text.contains(SECRET), "credential leaked: {text}");
    assert!(!text.contains(INTERNAL_KEY), "internal key leaked: {text}");
}

// ---- allocate: retries and idempotency ----

#[tokio::test]
async fn allocate_retries_503s_with_the_same_request_id() {
    let fake = Fake::start().await;
    fake.queue(
        Route::Allocate,
        [
            Reply::error(503, "store_unavailable"),
            Reply::error(503, "store_unavailable"),
        ],
    );
    let guard = client(&fake).lease(request()).await.expect("leases");
    assert_eq!(guard.lease_id(), LEASE_ID);
    assert_eq!(guard.fence(), FENCE);

    let ids = request_ids(&fake);
    assert_eq!(ids.len(), 3);
    assert!(ids.iter().all(|id| id == &ids[0]), "{ids:?}");
    assert!(uuid_v4(&ids[0]), "{}", ids[0]);
    for recorded in fake.requests(Route::Allocate) {
        assert_eq!(recorded.internal_key.as_deref(), Some(INTERNAL_KEY));
    }
    guard.abandon();
}

fn uuid_v4(id: &str) -> bool {
    id.len() == 36
        && id.as_bytes()[14] == b'4'
        && id.chars().all(|c| c == '-' || c.is_ascii_hexdigit())
}

#[tokio::test]
async fn each_lease_call_gets_its_own_request_id() {
    let fake = Fake::start().await;
    let client = client(&fake);
    client.lease(request()).await.expect("leases").abandon();
    client.lease(request()).await.expect("leases").abandon();
    let ids = request_ids(&fake);
    assert_eq!(ids.len(), 2);
    assert_ne!(ids[0], ids[1]);
}

#[tokio::test]
async fn allocate_retries_a_closed_connection() {
    let fake = Fake::start_closing_first_connection().await;
    let guard = client(&fake).lease(request()).await.expect("leases");
    assert_eq!(fake.count(Route::Allocate), 1);
    guard.abandon();
}

#[tokio::test]
async fn allocate_retries_a_refused_connection() {
    let addr = closed_address();
    let client = Client::builder(format!("http://{addr}"), INTERNAL_KEY)
        .retry(fast_retries())
        .build()
        .expect("builds");
    let lease = tokio::spawn(async move { client.lease(request()).await });
    // Nothing listens yet: the first attempts are refused.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fake = Fake::start_on(addr).await;
    let guard = lease.await.expect("joins").expect("leases");
    assert_eq!(fake.count(Route::Allocate), 1);
    guard.abandon();
}

#[tokio::test]
async fn allocate_retries_a_timed_out_attempt_with_the_same_request_id() {
    let fake = Fake::start().await;
    fake.queue(
        Route::Allocate,
        [Reply::error(503, "store_unavailable").after(Duration::from_secs(2))],
    );
    let client = Client::builder(&fake.url, INTERNAL_KEY)
        .retry(fast_retries())
        .http_timeout(Duration::from_millis(300))
        .build()
        .expect("builds");
    let guard = client.lease(request()).await.expect("leases");
    let ids = request_ids(&fake);
    assert_eq!(ids.len(), 2);
    assert_eq!(ids[0], ids[1]);
    guard.abandon();
}

#[tokio::test]
async fn store_unavailable_and_proxy_errors_give_up_after_the_retry_policy() {
    let fake = Fake::start().await;
    let client = client_retrying(&fake.url, 2);

    fake.always(Route::Allocate, Reply::error(503, "store_unavailable"));
    let error = client.lease(request()).await.expect_err("gives up");
    assert!(matches!(error, Error::StoreUnavailable), "{error:?}");
    assert_eq!(fake.count(Route::Allocate), 3);

    fake.always(
        Route::Allocate,
        Reply::raw(502, "text/html", "<html>Bad Gateway</html>"),
    );
    let error = client.lease(request()).await.expect_err("gives up");
    match &error {
        Error::Transport(transport) => {
            assert_eq!(transport.kind(), TransportKind::Gateway { status: 502 })
        }
        other => panic!("{other:?}"),
    }
    assert!(error.is_retryable());
    assert_eq!(fake.count(Route::Allocate), 6);
}

// ---- allocate: 429 and waiting ----

#[tokio::test]
async fn pool_exhausted_without_wait_returns_retry_after_at_once() {
    let fake = Fake::start().await;
    fake.always(Route::Allocate, exhausted(7));
    let error = client(&fake).lease(request()).await.expect_err("exhausted");
    assert_exhausted(&error, 7, "no wait");
    let requests = fake.requests(Route::Allocate);
    assert_eq!(requests.len(), 1);
    assert!(requests[0].body.get("wait_ms").is_none());

    // A zero wait is no wait.
    let error = client(&fake)
        .lease(request().wait(Duration::ZERO))
        .await
        .expect_err("exhausted");
    assert!(matches!(error, Error::PoolExhausted { .. }));
    assert_eq!(fake.count(Route::Allocate), 2);
}

#[tokio::test]
async fn pool_exhausted_with_wait_resends_with_the_time_left() {
    let fake = Fake::start().await;
    // The server holds each request 200 ms (its cap), then answers 429.
    fake.always(
        Route::Allocate,
        exhausted(3).after(Duration::from_millis(200)),
    );
    let started = Instant::now();
    let error = client(&fake)
        .lease(request().wait(Duration::from_millis(900)))
        .await
        .expect_err("exhausted");
    assert_exhausted(&error, 3, "a wait of 900 ms");
    assert!(started.elapsed() >= Duration::from_millis(800));

    let waits: Vec<u64> = fake
        .requests(Route::Allocate)
        .iter()
        .map(|r| r.body["wait_ms"].as_u64().expect("sends wait_ms"))
        .collect();
    assert!(waits.len() >= 3, "{waits:?}");
    assert!(waits[0] <= 900 && waits[0] > 700, "{waits:?}");
    assert!(waits.windows(2).all(|w| w[1] < w[0]), "{waits:?}");
    let ids = request_ids(&fake);
    assert!(ids.iter().all(|id| id == &ids[0]));
}

#[tokio::test]
async fn a_waiting_lease_succeeds_when_a_later_send_gets_a_slot() {
    let fake = Fake::start().await;
    fake.queue(
        Route::Allocate,
        [exhausted(1).after(Duration::from_millis(150))],
    );
    let guard = client(&fake)
        .lease(request().wait(Duration::from_secs(5)))
        .await
        .expect("leases on the second send");
    let requests = fake.requests(Route::Allocate);
    assert_eq!(requests.len(), 2);
    assert_eq!(
        requests[0].body["request_id"],
        requests[1].body["request_id"]
    );
    guard.abandon();
}

#[tokio::test]
async fn a_server_that_does_not_hold_the_request_is_not_hammered() {
    let fake = Fake::start().await;
    fake.always(Route::Allocate, exhausted(1));
    let client = Client::builder(&fake.url, INTERNAL_KEY)
        .retry(RetryPolicy {
            base_delay: Duration::from_millis(100),
            ..RetryPolicy::default()
        })
        .build()
        .expect("builds");
    let started = Instant::now();
    let error = client
        .lease(request().wait(Duration::from_millis(700)))
        .await
        .expect_err("exhausted");
    assert!(matches!(error, Error::PoolExhausted { .. }));
    // the 429 comes when the wait is used up, never before
    assert!(started.elapsed() >= Duration::from_millis(700));
    let count = fake.count(Route::Allocate);
    assert!((2..=6).contains(&count), "{count} requests in 700 ms");
}

// ---- allocate: error mapping and malformed answers ----

#[tokio::test]
async fn every_error_code_maps_to_its_variant() {
    let fake = Fake::start().await;
    let client = client_retrying(&fake.url, 1);
    type Expected = fn(&Error) -> bool;
    let cases: Vec<(u16, &str, Expected)> = vec![
        (
            400,
            "invalid_request",
            |e| matches!(e, Error::InvalidRequest { message } if message == "fake says invalid_request"),
        ),
        (401, "unauthorized", |e| matches!(e, Error::Unauthorized)),
        (403, "forbidden", |e| matches!(e, Error::Forbidden)),
        (404, "pool_not_found", |e| matches!(e, Error::PoolNotFound)),
        (409, "model_not_supported", |e| {
            matches!(e, Error::ModelNotSupported)
        }),
        (409, "no_usable_credentials", |e| {
            matches!(e, Error::NoUsableCredentials)
        }),
        (409, "request_id_conflict", |e| {
            matches!(e, Error::RequestIdConflict)
        }),
        (409, "tokens_exceed_budget", |e| {
            matches!(e, Error::TokensExceedBudget)
        }),
        (410, "lease_lost", |e| matches!(e, Error::LeaseLost)),
        (413, "payload_too_large", |e| {
            matches!(e, Error::PayloadTooLarge)
        }),
        (415, "unsupported_media_type", |e| {
            matches!(e, Error::UnsupportedMediaType)
        }),
        (
            429,
            "pool_exhausted",
            |e| matches!(e, Error::PoolExhausted { retry_after } if *retry_after == Duration::from_secs(1)),
        ),
        (
            500,
            "internal_error",
            |e| matches!(e, Error::Internal { message } if message == "fake says internal_error"),
        ),
        (503, "store_unavailable", |e| {
            matches!(e, Error::StoreUnavailable)
        }),
        (404, "route_not_found", |e| {
            matches!(e, Error::RouteNotFound)
        }),
        (405, "method_not_allowed", |e| {
            matches!(e, Error::MethodNotAllowed)
        }),
        (
            418,
            "teapot",
            |e| matches!(e, Error::Api { status: 418, code, message } if code == "teapot" && message == "fake says teapot"),
        ),
    ];
    for (status, code, expected) in cases {
        fake.always(Route::Allocate, Reply::error(status, code));
        let before = fake.count(Route::Allocate);
        let error = client.lease(request()).await.expect_err(code);
        assert!(expected(&error), "{status} {code}: got {error:?}");
        assert_eq!(error.code(), Some(code));
        let sent = fake.count(Route::Allocate) - before;
        let retried = code == "store_unavailable";
        assert_eq!(sent, if retried { 2 } else { 1 }, "{code} sent {sent}");
        assert_no_secret(&format!("{error:?} {error}"));
    }
}

#[tokio::test]
async fn malformed_answers_are_typed_errors() {
    let fake = Fake::start().await;
    let client = client(&fake);
    let without = |field: &str| {
        let mut body = fake::grant(35);
        body.as_object_mut().map(|o| o.remove(field));
        Reply::json(200, body)
    };
    let with = |field: &str, value: Value| {
        let mut body = fake::grant(35);
        body[field] = value;
        Reply::json(200, body)
    };
    let cases = vec![
        ("200 not JSON", Reply::raw(200, "text/plain", "ok"), 200),
        ("200 empty", Reply::raw(200, "application/json", ""), 200),
        ("200 missing fence", without("fence"), 200),
        ("200 missing credential", without("credential"), 200),
        ("200 bad lease_id", with("lease_id", json!(SECRET)), 200),
        (
            "200 bad lease_until",
            with("lease_until", json!("tomorrow")),
            200,
        ),
        ("200 fence zero", with("fence", json!(0)), 200),
        ("200 fence a string", with("fence", json!(SECRET)), 200),
        (
            "200 lease_seconds zero",
            with("lease_seconds", json!(0)),
            200,
        ),
        (
            "200 lease_seconds a string",
            with("lease_seconds", json!(SECRET)),
            200,
        ),
        (
            "200 lease_seconds fractional",
            with("lease_seconds", json!(1.5)),
            200,
        ),
        (
            "500 HTML",
            Reply::raw(500, "text/html", format!("<html>{SECRET}</html>")),
            500,
        ),
        (
            "400 error without code",
            Reply::json(400, json!({"error": {"message": SECRET}})),
            400,
        ),
        (
            "429 without a credpool body",
            Reply::raw(429, "text/plain", "slow down"),
            429,
        ),
    ];
    for (case, reply, expected_status) in cases {
        fake.always(Route::Allocate, reply);
        let error = client.lease(request()).await.expect_err(case);
        match &error {
            Error::UnexpectedResponse { status, .. } => {
                assert_eq!(*status, expected_status, "{case}")
            }
            other => panic!("{case}: got {other:?}"),
        }
        assert_eq!(error.code(), None);
        assert_no_secret(&format!("{error:?} {error}"));
    }

    // A 429 in credpool's shape without a usable Retry-After counts as 1 s.
    for header in [None, Some("soon"), Some("0")] {
        let mut reply = Reply::error(429, "pool_exhausted");
        if let Some(value) = header {
            reply = reply.header("retry-after", value);
        }
        fake.always(Route::Allocate, reply);
        let error = client.lease(request()).await.expect_err("exhausted");
        assert_exhausted(&error, 1, header);
    }
}

// ---- renewal ----

#[tokio::test]
async fn the_guard_renews_past_the_initial_lease_with_the_fence_and_served_pool() {
    let fake = Fake::start().await;
    let guard = short_lease(&fake).await;
    let first_until = guard.lease_until();
    assert_eq!(guard.pool(), SERVED_POOL);
    assert_eq!(guard.credential().get_str("api_key"), Some(SECRET));

    let allocate = &fake.requests(Route::Allocate)[0].body;
    assert_eq!(allocate["pool"], "vip");
    assert_eq!(allocate["lease_seconds"], 1);
    assert_eq!(allocate["holder"], "test-worker");

    // Three times the lease length.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!guard.is_lost());
    let renewals = fake.requests(Route::Renew);
    assert!(renewals.len() >= 4, "{} renewals in 3 s", renewals.len());
    for renewal in &renewals {
        assert_eq!(
            renewal.body,
            json!({
                "provider": "openai", "pool": SERVED_POOL, "key_id": "key-1",
                "lease_id": LEASE_ID, "fence": FENCE, "lease_seconds": 1,
            })
        );
        assert_eq!(renewal.internal_key.as_deref(), Some(INTERNAL_KEY));
    }
    assert!(guard.lease_until() > first_until);
    guard.finish(Outcome::Success).await.expect("releases");
}

#[tokio::test]
async fn a_renewal_answered_410_fires_lost() {
    let fake = Fake::start().await;
    fake.always(Route::Renew, Reply::error(410, "lease_lost"));
    let guard = short_lease(&fake).await;
    let token = guard.lost_token();
    assert!(!guard.is_lost());
    tokio::time::timeout(Duration::from_secs(3), guard.lost())
        .await
        .expect("lost fires");
    assert!(guard.is_lost());
    assert!(token.is_cancelled());
    // A lost lease is not renewed again.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(fake.count(Route::Renew), 1);
    let released = guard.finish(Outcome::Failure).await.expect("answers");
    assert!(released.released);
}

#[tokio::test]
async fn renewals_failing_with_503_until_the_lease_ends_fire_lost() {
    let fake = Fake::start().await;
    fake.always(Route::Renew, Reply::error(503, "store_unavailable"));
    let started = Instant::now();
    let guard = short_lease(&fake).await;
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("lost fires");
    // Not before the first renewal (~333 ms) was retried for a while; the lease ends at ~1 s.
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    assert!(fake.count(Route::Renew) >= 2);
    guard.abandon();
}

/// A grant as a server older than the answer's `lease_seconds` gives it.
fn grant_without_lease_seconds(lease_seconds: i64) -> Reply {
    let mut body = fake::grant(lease_seconds);
    body.as_object_mut().map(|o| o.remove("lease_seconds"));
    Reply::json(200, body)
}

#[tokio::test]
async fn renewals_follow_the_granted_length_when_none_was_asked_for() {
    let fake = Fake::start().await;
    // A server whose maximum is 6 s grants its default, 6 s, and says so.
    fake.queue(Route::Allocate, [Reply::json(200, fake::grant(6))]);
    let started = Instant::now();
    let guard = client(&fake).lease(request()).await.expect("leases");
    assert_eq!(guard.lease_seconds(), 6);
    assert!(
        fake.requests(Route::Allocate)[0]
            .body
            .get("lease_seconds")
            .is_none()
    );

    assert!(eventually(Duration::from_secs(8), || fake.count(Route::Renew) >= 2).await);
    assert!(!guard.is_lost());
    let renewals = fake.requests(Route::Renew);
    // Every third of 6 s: 2 s after the allocate was sent, then 2 s after each renewal.
    let gaps = [renewals[0].at - started, renewals[1].at - renewals[0].at];
    for gap in gaps {
        assert!(
            gap >= Duration::from_millis(1900) && gap < Duration::from_secs(3),
            "{gaps:?}"
        );
    }
    // Nothing asked for, nothing sent: the server renews by the length it granted.
    assert!(
        renewals
            .iter()
            .all(|r| r.body.get("lease_seconds").is_none()),
        "{renewals:?}"
    );
    guard.finish(Outcome::Success).await.expect("releases");
}

#[tokio::test]
async fn the_lease_length_is_the_answers_else_the_requested_else_the_default() {
    let fake = Fake::start().await;
    let client = client(&fake);

    // The answer wins over the request.
    fake.queue(Route::Allocate, [Reply::json(200, fake::grant(1))]);
    let guard = client
        .lease(request().lease_seconds(30))
        .await
        .expect("leases");
    assert_eq!(guard.lease_seconds(), 1);
    guard.abandon();

    // An older server does not say: the requested length, renewed every ~333 ms ...
    fake.queue(Route::Allocate, [grant_without_lease_seconds(1)]);
    let guard = client
        .lease(request().lease_seconds(1))
        .await
        .expect("leases");
    assert_eq!(guard.lease_seconds(), 1);
    assert!(eventually(Duration::from_secs(2), || fake.count(Route::Renew) >= 2).await);
    guard.finish(Outcome::Success).await.expect("releases");

    // ... and with nothing requested either, the server's default, 35 s: no renewal for 11 s.
    fake.queue(Route::Allocate, [grant_without_lease_seconds(35)]);
    let renewals = fake.count(Route::Renew);
    let guard = client.lease(request()).await.expect("leases");
    assert_eq!(guard.lease_seconds(), DEFAULT_LEASE_SECONDS);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(fake.count(Route::Renew), renewals);
    guard.abandon();
}

#[tokio::test]
async fn renewals_failing_with_503_lose_the_lease_before_the_granted_length_ends() {
    let fake = Fake::start().await;
    fake.queue(Route::Allocate, [Reply::json(200, fake::grant(2))]);
    fake.always(Route::Renew, Reply::error(503, "store_unavailable"));
    let started = Instant::now();
    let guard = client(&fake).lease(request()).await.expect("leases");
    tokio::time::timeout(Duration::from_secs(4), guard.lost())
        .await
        .expect("lost fires");
    // The first renewal (~667 ms) is retried until 2 s less a tenth, not for 35 s.
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_secs(1) && elapsed < Duration::from_secs(2),
        "{elapsed:?}"
    );
    guard.abandon();
}

#[tokio::test]
async fn a_passing_renewal_failure_keeps_the_lease() {
    let fake = Fake::start().await;
    fake.queue(
        Route::Renew,
        [
            Reply::error(503, "store_unavailable"),
            Reply::raw(504, "text/html", "<html>Gateway Timeout</html>"),
        ],
    );
    let guard = short_lease(&fake).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!guard.is_lost());
    assert!(fake.count(Route::Renew) >= 4);
    guard.finish(Outcome::Success).await.expect("releases");
}

// ---- release ----

#[tokio::test]
async fn finish_reports_rate_limited_with_retry_after_and_fence() {
    let fake = Fake::start().await;
    let guard = short_lease(&fake).await;
    let released = guard
        .finish(Outcome::RateLimited {
            retry_after: Some(Duration::from_secs(12)),
        })
        .await
        .expect("releases");
    assert_eq!(
        released,
        Released {
            released: true,
            reason: None
        }
    );
    let releases = fake.requests(Route::Release);
    assert_eq!(releases.len(), 1);
    assert_eq!(
        releases[0].body,
        json!({
            "provider": "openai", "pool": SERVED_POOL, "key_id": "key-1", "lease_id": LEASE_ID,
            "fence": FENCE, "outcome": "rate_limited", "retry_after_seconds": 12,
        })
    );
    assert_eq!(releases[0].internal_key.as_deref(), Some(INTERNAL_KEY));

    // Renewals stop with the release.
    let renewals = fake.count(Route::Renew);
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(fake.count(Route::Renew), renewals);
}

#[tokio::test]
async fn a_token_estimate_goes_with_the_allocate_and_the_usage_with_the_release() {
    let fake = Fake::start().await;
    let client = client(&fake);
    let guard = client.lease(request().tokens(1200)).await.expect("leases");
    assert_eq!(fake.requests(Route::Allocate)[0].body["tokens"], 1200);
    guard
        .finish_with_usage(Outcome::Success, 930)
        .await
        .expect("releases");
    let releases = fake.requests(Route::Release);
    assert_eq!(releases[0].body["usage"], json!({"tokens": 930}));
    // without them, neither field is sent
    let guard = client.lease(request()).await.expect("leases");
    assert!(
        fake.requests(Route::Allocate)[1]
            .body
            .get("tokens")
            .is_none()
    );
    guard.finish(Outcome::Success).await.expect("releases");
    assert!(fake.requests(Route::Release)[1].body.get("usage").is_none());
}

#[tokio::test]
async fn finish_sends_each_outcome_and_no_retry_after_unless_given() {
    let fake = Fake::start().await;
    let outcomes = [
        (Outcome::Success, json!("success"), None),
        (Outcome::Failure, json!("failure"), None),
        (Outcome::AuthError, json!("auth_error"), None),
        (Outcome::AuthExpired, json!("auth_expired"), None),
        (
            Outcome::RateLimited { retry_after: None },
            json!("rate_limited"),
            None,
        ),
        (
            Outcome::QuotaExhausted {
                retry_after: Some(Duration::from_millis(86_400_500)),
            },
            json!("quota_exhausted"),
            Some(86_401),
        ),
    ];
    for (outcome, wire, retry_after) in outcomes {
        short_lease(&fake)
            .await
            .finish(outcome)
            .await
            .expect("releases");
        let body = fake.requests(Route::Release).pop().expect("sent").body;
        assert_eq!(body["outcome"], wire);
        assert_eq!(
            body.get("retry_after_seconds").and_then(Value::as_u64),
            retry_after
        );
    }
}

#[tokio::test]
async fn finish_retries_a_503_and_passes_on_not_released_reasons() {
    let fake = Fake::start().await;
    fake.queue(
        Route::Release,
        [
            Reply::error(503, "store_unavailable"),
            Reply::json(200, json!({"released": false, "reason": "expired"})),
            Reply::json(200, json!({"released": false, "reason": "moon_phase"})),
            Reply::json(200, json!({"released": false})),
        ],
    );
    let reason = |released: Released| {
        assert!(!released.released);
        released.reason
    };
    let first = short_lease(&fake).await.finish(Outcome::Success).await;
    assert_eq!(reason(first.expect("answers")), Some(NotReleased::Expired));
    assert_eq!(fake.count(Route::Release), 2);
    let second = short_lease(&fake).await.finish(Outcome::Success).await;
    assert_eq!(
        reason(second.expect("answers")),
        Some(NotReleased::Other("moon_phase".into()))
    );
    let third = short_lease(&fake).await.finish(Outcome::Success).await;
    assert_eq!(reason(third.expect("answers")), None);
}

#[tokio::test]
async fn dropping_the_guard_releases_once_with_failure() {
    let fake = Fake::start().await;
    let guard = short_lease(&fake).await;
    drop(guard);
    assert!(eventually(Duration::from_secs(2), || fake.count(Route::Release) == 1).await);
    // Give a duplicate, or a renewal, time to show up.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let releases = fake.requests(Route::Release);
    assert_eq!(releases.len(), 1);
    assert_eq!(releases[0].body["outcome"], "failure");
    assert_eq!(releases[0].body["fence"], FENCE);
    assert_eq!(fake.count(Route::Renew), 0);
}

#[tokio::test]
async fn a_dropped_finish_still_releases_through_the_drop() {
    let fake = Fake::start().await;
    fake.queue(
        Route::Release,
        [Reply::json(200, json!({"released": true})).after(Duration::from_secs(5))],
    );
    let guard = short_lease(&fake).await;
    let finish = tokio::time::timeout(Duration::from_millis(200), guard.finish(Outcome::Success));
    assert!(finish.await.is_err(), "finish was cut short");
    assert!(eventually(Duration::from_secs(2), || fake.count(Route::Release) == 2).await);
    assert_eq!(fake.requests(Route::Release)[1].body["outcome"], "failure");
}

#[tokio::test]
async fn abandon_sends_no_release_and_stops_renewing() {
    let fake = Fake::start().await;
    let guard = short_lease(&fake).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    guard.abandon();
    let renewals = fake.count(Route::Renew);
    assert!(renewals >= 1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(fake.count(Route::Release), 0);
    assert_eq!(fake.count(Route::Renew), renewals);
}

#[test]
fn dropping_the_guard_after_its_runtime_is_gone_sends_nothing_and_does_not_panic() {
    let server = tokio::runtime::Runtime::new().expect("runtime");
    let fake = server.block_on(Fake::start());
    let executor = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let guard = executor
        .block_on(async { client(&fake).lease(request()).await })
        .expect("leases");
    drop(executor);
    drop(guard);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(fake.count(Route::Release), 0);
}

// ---- secrets ----

#[tokio::test]
async fn debug_and_display_never_show_the_secret_or_the_internal_key() {
    let fake = Fake::start().await;
    let client = client_retrying(&fake.url, 1);
    assert_no_secret(&format!("{client:?}"));

    let guard = client.lease(request()).await.expect("leases");
    let shown = format!("{guard:?}");
    assert_no_secret(&shown);
    assert!(shown.contains(LEASE_ID) && shown.contains(&FENCE.to_string()));
    assert_eq!(
        format!("{:?}", guard.credential()),
        "Credential(<redacted>)"
    );
    guard.abandon();

    let mut errors = Vec::new();
    // A server message that echoes the internal key is scrubbed.
    fake.always(
        Route::Allocate,
        Reply::json(
            400,
            json!({"error": {"code": "invalid_request", "message": format!("bad key {INTERNAL_KEY}")}}),
        ),
    );
    errors.push(client.lease(request()).await.expect_err("refused"));
    fake.always(
        Route::Allocate,
        Reply::json(
            418,
            json!({"error": {"code": INTERNAL_KEY, "message": INTERNAL_KEY}}),
        ),
    );
    errors.push(client.lease(request()).await.expect_err("refused"));
    fake.always(Route::Allocate, Reply::error(500, "internal_error"));
    errors.push(client.lease(request()).await.expect_err("refused"));
    fake.always(Route::Allocate, Reply::raw(200, "text/plain", SECRET));
    errors.push(client.lease(request()).await.expect_err("refused"));
    fake.always(Route::Allocate, Reply::raw(502, "text/plain", SECRET));
    errors.push(client.lease(request()).await.expect_err("refused"));
    // A transport error: nothing listens.
    let unreachable = client_retrying(format!("http://{}", closed_address()), 1);
    let error = unreachable.lease(request()).await.expect_err("unreachable");
    assert!(
        matches!(&error, Error::Transport(t) if t.kind() == TransportKind::Connect),
        "{error:?}"
    );
    errors.push(error);
    errors.push(Client::new("https://h", INTERNAL_KEY).expect_err("no TLS"));

    for error in &errors {
        assert_no_secret(&format!("{error:?}"));
        assert_no_secret(&error.to_string());
        let mut source = std::error::Error::source(error);
        while let Some(inner) = source {
            assert_no_secret(&format!("{inner} {inner:?}"));
            source = inner.source();
        }
    }
}
