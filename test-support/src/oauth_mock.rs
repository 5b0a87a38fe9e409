//! A mock OAuth token endpoint on 127.0.0.1, for the refresher's tests: it counts calls,
//! rotates the refresh token on every success (answering `invalid_grant` to a refresh token
//! already used, as providers that rotate do), and can answer slowly, with 503 or with
//! `invalid_grant`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Form, State};
use axum::response::IntoResponse;
use credpool::oauth::OAuthSettings;
use serde_json::json;

/// How the mock token endpoint answers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode {
    /// A new access token and a rotated refresh token, after `delay`.
    Ok {
        /// How long the endpoint takes to answer.
        delay: Duration,
    },
    /// 503.
    Unavailable,
    /// 400 `{"error": "invalid_grant"}`.
    InvalidGrant,
    /// A token with an `expires_in` no timestamp can hold (10^15 s).
    Unrepresentable,
}

/// The mock answers at once.
pub const ANSWERS: Mode = Mode::Ok {
    delay: Duration::ZERO,
};

/// The endpoint's state, shared with the test ([`mock_endpoint`]).
pub struct Mock {
    /// How it answers the next call ([`Mock::set`]).
    pub mode: Mutex<Mode>,
    /// Every call, answered or not.
    pub calls: AtomicUsize,
    /// Successful refreshes (access token `at-<n>`, refresh token `rtok-<n>`).
    pub issued: AtomicUsize,
    /// Calls that presented a refresh token other than the current one (a rotated-away token:
    /// two writers refreshed one generation).
    pub stale: AtomicUsize,
    /// The refresh token the next call must present.
    pub current: Mutex<String>,
    /// The form bodies received, in order.
    pub forms: Mutex<Vec<HashMap<String, String>>>,
    /// `expires_in` of the n-th answer: n times this, seconds (each new token lives longer than
    /// the one before, so a test can make one generation due and not the next).
    pub expires_in: u64,
}

impl Mode {
    /// A new access token and a rotated refresh token, after `ms` milliseconds.
    pub fn slow(ms: u64) -> Self {
        Mode::Ok {
            delay: Duration::from_millis(ms),
        }
    }
}

impl Mock {
    /// Calls so far, answered or not.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Makes the endpoint answer as `mode` says from now on.
    pub fn set(&self, mode: Mode) {
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
        Mode::Unrepresentable => {
            return axum::Json(json!({"access_token": "at-forever", "token_type": "Bearer",
                                     "expires_in": 1_000_000_000_000_000_u64}))
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

/// Serves a mock token endpoint on 127.0.0.1:0 answering as `mode` says, the n-th token living
/// `expires_in` x n seconds, its first refresh token expected `rtok-0`; returns it and its URL
/// (`http://127.0.0.1:PORT/token`).
pub async fn mock_endpoint(mode: Mode, expires_in: u64) -> (Arc<Mock>, String) {
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
pub fn fast_refresher() -> OAuthSettings {
    OAuthSettings {
        check_every: Duration::from_millis(50),
        call_timeout: Duration::from_secs(5),
        claim_for: Duration::from_secs(10),
        backoff_first: Duration::from_millis(100),
        backoff_max: Duration::from_millis(400),
        ..OAuthSettings::default()
    }
}
