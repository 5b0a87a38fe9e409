//! A credpool service as the tests call it over HTTP ([`Service`]): the executor API with the
//! internal key or a tenant's key, the operator API with the admin key, tenants and their keys,
//! and `/metrics`. The in-process [`crate::TestApp`], a [`crate::ServeProcess`] and a [`Remote`]
//! (any base URL) all answer it.

use std::net::SocketAddr;
use std::time::Duration;

use reqwest::{Method, Response, StatusCode};
use serde_json::{Value, json};

use crate::requests::lease_ref;
use crate::{ADMIN_KEY, INTERNAL_KEY};

/// The operator the tests' admin calls name (`X-Operator`), as the trail records them.
pub const OPERATOR: &str = "alice";

/// `POST` an allocation (the executor API's paths: this one, [`RELEASE`], [`RENEW`]).
pub const ALLOCATE: &str = "/api/internal/allocate-key";
/// `POST` a release (with an outcome) of a lease.
pub const RELEASE: &str = "/api/internal/release-key";
/// `POST` a renewal of a lease.
pub const RENEW: &str = "/api/internal/renew-lease";

/// The calls a test makes on a credpool service. Every method sends the tests' keys
/// ([`INTERNAL_KEY`], [`ADMIN_KEY`]) unless it takes a key; those named `*_ok` or returning a
/// parsed body panic unless the service answers as the scenario expects.
// The futures are only awaited on the kit's own types, whose auto traits the compiler sees.
#[allow(async_fn_in_trait)]
pub trait Service {
    /// The HTTP client the calls go through.
    fn http(&self) -> &reqwest::Client;

    /// The service's URL for `path` (`""` for its base, `http://<address>`).
    fn url(&self, path: &str) -> String;

    /// `GET path` with no key (a probe, a page, a route that does not exist).
    async fn get(&self, path: &str) -> Response {
        self.http().get(self.url(path)).send().await.expect("GET")
    }

    /// `POST path` with executor key `key` (the internal key or a tenant's) and a JSON body.
    async fn post_as(&self, path: &str, key: &str, body: Value) -> Response {
        post_json(self.http(), &self.url(path), ("x-internal-key", key), body).await
    }

    /// `POST path` with the internal key and a JSON body.
    async fn post_internal(&self, path: &str, body: Value) -> Response {
        self.post_as(path, INTERNAL_KEY, body).await
    }

    /// `POST /api/internal/allocate-key` with the internal key.
    async fn allocate(&self, body: Value) -> Response {
        self.post_as(ALLOCATE, INTERNAL_KEY, body).await
    }

    /// `POST /api/internal/release-key` with the internal key.
    async fn release(&self, body: Value) -> Response {
        self.post_as(RELEASE, INTERNAL_KEY, body).await
    }

    /// `POST /api/internal/renew-lease` with the internal key.
    async fn renew(&self, body: Value) -> Response {
        self.post_as(RENEW, INTERNAL_KEY, body).await
    }

    /// `POST /api/internal/allocate-key` with executor key `key`.
    async fn allocate_as(&self, key: &str, body: Value) -> Response {
        self.post_as(ALLOCATE, key, body).await
    }

    /// [`Service::allocate_as`] in a task of its own, for a request that waits while the test
    /// goes on: the task ends with its answer.
    fn spawn_allocate_as(&self, key: &str, body: Value) -> tokio::task::JoinHandle<Response> {
        let (remote, key) = (self.remote(), key.to_owned());
        tokio::spawn(async move { remote.allocate_as(&key, body).await })
    }

    /// `POST /api/internal/release-key` with executor key `key`.
    async fn release_as(&self, key: &str, body: Value) -> Response {
        self.post_as(RELEASE, key, body).await
    }

    /// `POST /api/internal/renew-lease` with executor key `key`.
    async fn renew_as(&self, key: &str, body: Value) -> Response {
        self.post_as(RENEW, key, body).await
    }

    /// Allocates `body` with the internal key; panics unless granted (200): the lease.
    async fn lease(&self, body: Value) -> Value {
        json_body(self.allocate(body).await, StatusCode::OK).await
    }

    /// A lease of gpt-4o (openai) from `pool` for 600 seconds with executor key `key`; panics
    /// unless granted (200).
    async fn lease_as(&self, key: &str, pool: &str) -> Value {
        let body = crate::gpt4o_in_for(pool, 600);
        json_body(self.allocate_as(key, body).await, StatusCode::OK).await
    }

    /// Releases `lease` (as allocate answered it) with `outcome` and the internal key; panics
    /// unless the service answers 200 with `"released": true`.
    async fn release_ok(&self, lease: &Value, outcome: &str) {
        let body = json_body(
            self.release(crate::release_body(lease, outcome)).await,
            StatusCode::OK,
        )
        .await;
        assert_eq!(body["released"], true, "{body}");
    }

    /// Releases `lease` with executor key `key`, naming it by [`lease_ref`] alone (no outcome);
    /// panics unless the service answers 200: its body.
    async fn release_as_ok(&self, key: &str, lease: &Value) -> Value {
        json_body(self.release_as(key, lease_ref(lease)).await, StatusCode::OK).await
    }

    /// An operator's request ([`OPERATOR`], with the admin key) to `path`, with a JSON body if
    /// given.
    async fn admin(&self, method: Method, path: &str, body: Option<Value>) -> Response {
        let request = self
            .http()
            .request(method, self.url(path))
            .header("x-admin-key", ADMIN_KEY)
            .header("x-operator", OPERATOR);
        send(request, body).await
    }

    /// [`Service::admin`] without `X-Operator`: the service records the actor `admin-key`.
    async fn admin_unnamed(&self, method: Method, path: &str, body: Option<Value>) -> Response {
        let request = self
            .http()
            .request(method, self.url(path))
            .header("x-admin-key", ADMIN_KEY);
        send(request, body).await
    }

    /// `GET path` with the admin key ([`Service::admin`]); panics unless 200: the JSON body.
    async fn admin_get(&self, path: &str) -> Value {
        json_body(self.admin(Method::GET, path, None).await, StatusCode::OK).await
    }

    /// `GET path` with the admin key and no operator named: the body as text, whatever the
    /// status (a dashboard page or fragment).
    async fn admin_text(&self, path: &str) -> String {
        let response = self.admin_unnamed(Method::GET, path, None).await;
        response.text().await.expect("body")
    }

    /// `PUT /api/admin/keys/{key_id}` with `body`, whatever it answers.
    async fn put_key_raw(&self, key_id: &str, body: Value) -> Response {
        let path = format!("/api/admin/keys/{key_id}");
        self.admin_unnamed(Method::PUT, &path, Some(body)).await
    }

    /// Stores a credential serving `models` with `limit` slots and the secret
    /// `sk-test-{key_id}`; panics unless stored.
    async fn put_key(&self, key_id: &str, provider: &str, pool: &str, models: &[&str], limit: u32) {
        let body = json!({
            "provider": provider,
            "pool": pool,
            "models": models,
            "max_concurrent_uses": limit,
            "secret": {"api_key": format!("sk-test-{key_id}")},
        });
        let response = self.put_key_raw(key_id, body).await;
        assert!(
            response.status().is_success(),
            "PUT {key_id}: {}",
            response.status()
        );
    }

    /// [`Service::put_key`] of an openai credential serving gpt-4o.
    async fn put_gpt4o_key(&self, key_id: &str, pool: &str, limit: u32) {
        self.put_key(key_id, "openai", pool, &["gpt-4o"], limit)
            .await;
    }

    /// `PATCH /api/admin/keys/{key_id}` with `body`, as [`OPERATOR`].
    async fn patch_key(&self, key_id: &str, body: Value) -> Response {
        let path = format!("/api/admin/keys/{key_id}");
        self.admin(Method::PATCH, &path, Some(body)).await
    }

    /// `GET /api/admin/keys/{key_id}`: the credential as an operator reads it (panics unless
    /// 200).
    async fn credential(&self, key_id: &str) -> Value {
        self.admin_get(&format!("/api/admin/keys/{key_id}")).await
    }

    /// `POST /api/admin/leases/{lease_id}/release` with `reason`: an operator ends one lease
    /// (the admin key, no operator named: the actor `admin-key`).
    async fn force_release(&self, lease_id: impl std::fmt::Display, reason: &str) -> Response {
        let path = format!("/api/admin/leases/{lease_id}/release");
        let body = json!({"reason": reason});
        self.admin_unnamed(Method::POST, &path, Some(body)).await
    }

    /// Creates or updates tenant `id` with `body`, scoped to every pool (`"pools": ["*/*"]`)
    /// unless `body` names its `pools`; panics unless it answers 200 or 201: the tenant.
    async fn put_tenant(&self, id: &str, mut body: Value) -> Value {
        if let Some(fields) = body.as_object_mut() {
            fields.entry("pools").or_insert(json!(["*/*"]));
        }
        let path = format!("/api/admin/tenants/{id}");
        let response = self.admin(Method::PUT, &path, Some(body)).await;
        let status = response.status();
        assert!(
            status == StatusCode::OK || status == StatusCode::CREATED,
            "PUT tenant {id}: {status}: {}",
            response.text().await.unwrap()
        );
        response.json().await.unwrap()
    }

    /// Mints a key for tenant `id` (panics unless 201): (key id, key).
    async fn mint_key(&self, id: &str) -> (String, String) {
        let path = format!("/api/admin/tenants/{id}/keys");
        let response = self.admin(Method::POST, &path, None).await;
        let minted = json_body(response, StatusCode::CREATED).await;
        (
            minted["key_id"].as_str().unwrap().to_owned(),
            minted["key"].as_str().unwrap().to_owned(),
        )
    }

    /// Creates tenant `id` with `body` ([`Service::put_tenant`]) and mints it a key: the key.
    async fn tenant_key(&self, id: &str, body: Value) -> String {
        self.put_tenant(id, body).await;
        self.mint_key(id).await.1
    }

    /// A tenant `id` with `max_concurrent_leases` `cap` and a key of its own: the key.
    async fn capped_tenant(&self, id: &str, cap: u32) -> String {
        self.tenant_key(id, json!({"max_concurrent_leases": cap}))
            .await
    }

    /// The tenant's line of `GET /api/admin/tenants`.
    async fn tenant_line(&self, id: &str) -> Value {
        let list = self.admin_get("/api/admin/tenants").await;
        list["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tenant_id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no tenant {id} in {list}"))
    }

    /// The service as a [`Remote`] of the same client: a handle a spawned task can own.
    fn remote(&self) -> Remote {
        Remote::new(self.http(), &self.url(""))
    }

    /// The Prometheus page of `GET /metrics`.
    async fn metrics(&self) -> String {
        let response = self.http().get(self.url("/metrics")).send().await.unwrap();
        response.text().await.unwrap()
    }
}

/// Sends `request`, with `body` as its JSON body if given.
async fn send(request: reqwest::RequestBuilder, body: Option<Value>) -> Response {
    let request = match body {
        Some(body) => request.json(&body),
        None => request,
    };
    request.send().await.expect("admin request")
}

/// A service at a base URL the test has (a replica, a process it started itself), called
/// through a client of its choosing.
#[derive(Clone)]
pub struct Remote {
    /// The client the calls go through.
    pub client: reqwest::Client,
    /// `http://<address>`, no trailing slash.
    pub base: String,
}

impl Remote {
    /// The service at `base` through `client` (a clone: one connection pool with the caller's).
    pub fn new(client: &reqwest::Client, base: &str) -> Self {
        Self {
            client: client.clone(),
            base: base.to_owned(),
        }
    }

    /// The service listening on `addr`, through a new [`client`].
    pub fn at(addr: SocketAddr) -> Self {
        Self {
            client: client(),
            base: format!("http://{addr}"),
        }
    }
}

impl Service for Remote {
    fn http(&self) -> &reqwest::Client {
        &self.client
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

/// An HTTP client with a 60-second timeout and room for 128 idle connections per host.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(128)
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// `POST url` with header `key` (name, value) and a JSON body.
pub async fn post_json(
    client: &reqwest::Client,
    url: &str,
    key: (&str, &str),
    body: Value,
) -> Response {
    client
        .post(url)
        .header(key.0, key.1)
        .json(&body)
        .send()
        .await
        .expect("POST")
}

/// Checks of an answer still to come, written after the call that makes it:
/// `app.allocate(body).refused(StatusCode::CONFLICT, "no_usable_credentials").await`.
// The futures are only awaited on the kit's own calls, whose auto traits the compiler sees.
#[allow(async_fn_in_trait)]
pub trait Answer: IntoFuture<Output = Response> + Sized {
    /// Awaits the answer and asserts an error of `status` with error code `code` (and a message
    /// that says something): the error body.
    async fn refused(self, status: StatusCode, code: &str) -> Value {
        assert_error(self.await, status, code).await
    }

    /// Awaits the answer and asserts 200: its JSON body.
    async fn ok_json(self) -> Value {
        json_body(self.await, StatusCode::OK).await
    }
}

impl<F: IntoFuture<Output = Response>> Answer for F {}

/// Reads a JSON body, asserting the status first.
pub async fn json_body(response: Response, expected: StatusCode) -> Value {
    let status = response.status();
    let text = response.text().await.expect("body");
    assert_eq!(status, expected, "unexpected status; body: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// Asserts an error response's status and code (and a message that says something): the body.
pub async fn assert_error(response: Response, expected: StatusCode, code: &str) -> Value {
    let body = json_body(response, expected).await;
    assert_eq!(body["error"]["code"], code, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    body
}

/// The text `field` of each object in the JSON array `list`, in order; panics where `list` is no
/// array or an object has no such text.
pub fn texts<'a>(list: &'a Value, field: &str) -> Vec<&'a str> {
    let objects = list
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {list}"));
    objects
        .iter()
        .map(|o| {
            o[field]
                .as_str()
                .unwrap_or_else(|| panic!("no {field}: {o}"))
        })
        .collect()
}

/// The message of an error body (`{"error": {"code", "message"}}`); panics when it has none.
pub fn error_message(body: &Value) -> &str {
    body["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error message: {body}"))
}

/// The `Retry-After` of a response, in seconds; panics when it has none.
pub fn retry_after(response: &Response) -> u64 {
    response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}
