//! An in-process fake of credpool's executor routes (axum on 127.0.0.1:0) that records every
//! request it gets and answers from a script: queued replies first, then a standing reply if one
//! is set, then a well-formed success.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio::net::TcpListener;

/// The secret in every credential the fake hands out.
pub const SECRET: &str = "sk-SECRET-credential-9f8e7d";
/// The lease id the fake hands out.
pub const LEASE_ID: &str = "0123456789abcdef0123456789abcdef";
/// The fence the fake hands out.
pub const FENCE: u64 = 42;
/// The pool that serves, whatever pool was asked for (as after a `vip` -> `default` fallback).
pub const SERVED_POOL: &str = "default";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    Allocate,
    Renew,
    Release,
}

/// One scripted answer.
#[derive(Debug, Clone)]
pub struct Reply {
    status: u16,
    content_type: &'static str,
    body: String,
    headers: Vec<(&'static str, String)>,
    delay: Duration,
}

impl Reply {
    pub fn json(status: u16, body: Value) -> Self {
        Self::raw(status, "application/json", body.to_string())
    }

    /// A credpool error body `{"error":{"code","message"}}`.
    pub fn error(status: u16, code: &str) -> Self {
        Self::json(
            status,
            json!({"error": {"code": code, "message": format!("fake says {code}")}}),
        )
    }

    pub fn raw(status: u16, content_type: &'static str, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type,
            body: body.into(),
            headers: Vec::new(),
            delay: Duration::ZERO,
        }
    }

    pub fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    /// Answers only after `delay`.
    pub fn after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

/// A well-formed allocate answer, as the fake gives by default: granted for `lease_seconds`
/// (the request's, else 35), which the answer says, as today's server does. Remove the field to
/// act out an older server.
pub fn grant(lease_seconds: i64) -> Value {
    json!({
        "key_id": "key-1",
        "lease_id": LEASE_ID,
        "fence": FENCE,
        "provider": "openai",
        "pool": SERVED_POOL,
        "provider_model": "gpt-4o-2024-08-06",
        "lease_until": in_seconds(lease_seconds),
        "probe": false,
        "lease_seconds": lease_seconds,
        "credential": {"api_key": SECRET},
    })
}

fn in_seconds(seconds: i64) -> String {
    (OffsetDateTime::now_utc() + time::Duration::seconds(seconds))
        .format(&Rfc3339)
        .expect("formats")
}

/// A request as the fake got it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub route: Route,
    /// When the fake got it.
    pub at: Instant,
    pub body: Value,
    pub internal_key: Option<String>,
}

#[derive(Default)]
struct Script {
    queued: HashMap<Route, VecDeque<Reply>>,
    standing: HashMap<Route, Reply>,
    recorded: Vec<Recorded>,
}

#[derive(Clone)]
pub struct Fake {
    pub url: String,
    script: Arc<Mutex<Script>>,
}

impl Fake {
    /// Serves on a fresh port.
    pub async fn start() -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        Self::serve(listener, false)
    }

    /// Serves on `addr` (a port that was free a moment ago).
    pub async fn start_on(addr: SocketAddr) -> Fake {
        let listener = TcpListener::bind(addr).await.expect("binds again");
        Self::serve(listener, false)
    }

    /// Serves on a fresh port, but closes the first connection without answering.
    pub async fn start_closing_first_connection() -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        Self::serve(listener, true)
    }

    fn serve(listener: TcpListener, close_first: bool) -> Fake {
        let url = format!("http://{}", listener.local_addr().expect("has an address"));
        let script = Arc::new(Mutex::new(Script::default()));
        let route = |route: Route| {
            post(
                move |State(script): State<Arc<Mutex<Script>>>, headers: HeaderMap, body: Bytes| {
                    answer(route, script, headers, body)
                },
            )
        };
        let app = Router::new()
            .route("/api/internal/allocate-key", route(Route::Allocate))
            .route("/api/internal/renew-lease", route(Route::Renew))
            .route("/api/internal/release-key", route(Route::Release))
            .with_state(script.clone());
        tokio::spawn(async move {
            if close_first && let Ok((stream, _)) = listener.accept().await {
                drop(stream);
            }
            axum::serve(listener, app).await.expect("serves");
        });
        Fake { url, script }
    }

    /// Queues replies for `route`, answered in order before anything else.
    pub fn queue(&self, route: Route, replies: impl IntoIterator<Item = Reply>) {
        let mut script = self.script.lock().expect("not poisoned");
        script.queued.entry(route).or_default().extend(replies);
    }

    /// Answers `route` with `reply` whenever nothing is queued (instead of a success).
    pub fn always(&self, route: Route, reply: Reply) {
        let mut script = self.script.lock().expect("not poisoned");
        script.standing.insert(route, reply);
    }

    /// Every request to `route` so far, oldest first.
    pub fn requests(&self, route: Route) -> Vec<Recorded> {
        let script = self.script.lock().expect("not poisoned");
        script
            .recorded
            .iter()
            .filter(|r| r.route == route)
            .cloned()
            .collect()
    }

    pub fn count(&self, route: Route) -> usize {
        self.requests(route).len()
    }
}

async fn answer(
    route: Route,
    script: Arc<Mutex<Script>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let reply = {
        let mut script = script.lock().expect("not poisoned");
        script.recorded.push(Recorded {
            route,
            at: Instant::now(),
            body: body.clone(),
            internal_key: headers
                .get("x-internal-key")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
        });
        let queued = script.queued.get_mut(&route).and_then(VecDeque::pop_front);
        queued.or_else(|| script.standing.get(&route).cloned())
    };
    let lease_seconds = body
        .get("lease_seconds")
        .and_then(Value::as_i64)
        .unwrap_or(35);
    let reply = reply.unwrap_or_else(|| match route {
        Route::Allocate => Reply::json(200, grant(lease_seconds)),
        Route::Renew => Reply::json(200, json!({"lease_until": in_seconds(lease_seconds)})),
        Route::Release => Reply::json(200, json!({"released": true})),
    });
    tokio::time::sleep(reply.delay).await;
    let mut response = Response::builder()
        .status(reply.status)
        .header("content-type", reply.content_type);
    for (name, value) in reply.headers {
        response = response.header(name, value);
    }
    response
        .body(Body::from(reply.body))
        .expect("a valid response")
}
