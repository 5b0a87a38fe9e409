//! Scenario 7, hostile input: malformed requests to every executor and operator route — wrong
//! types, out-of-range and overflowing numbers, unknown, missing and duplicate fields, empty,
//! truncated and oversized bodies, wrong content types, control characters and SQL
//! metacharacters in ids, invalid UTF-8, bad lease ids, huge model lists. Each one answers its
//! documented 4xx with its stable code (never a 5xx, a 2xx or a hang), never echoes a key or a
//! secret, and leaves the database byte for byte as it was.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use credpool_test_support::*;

/// The secret of the credentials under attack, also planted in hostile bodies: no answer may
/// contain it.
const SECRET: &str = "sk-hostile-secret-7f3a9c";

const ALLOCATE: &str = "/api/internal/allocate-key";
const RENEW: &str = "/api/internal/renew-lease";
const RELEASE: &str = "/api/internal/release-key";

/// The longest any row may take before it counts as a hang.
const ANSWER_WITHIN: Duration = Duration::from_secs(15);

/// The longest answer any row may get, in bytes: a malformed request never comes back reflected.
const ANSWER_AT_MOST: usize = 2048;

/// How a row's request goes over the wire.
enum Wire {
    /// An HTTP request as reqwest sends it.
    Http {
        method: Method,
        path: String,
        headers: Vec<(&'static str, Vec<u8>)>,
        body: Option<Vec<u8>>,
    },
    /// Bytes written as they are to a fresh connection, whose write side is then closed: for
    /// framing no HTTP client produces on purpose.
    Raw(Vec<u8>),
    /// A whole request (with `Connection: close`) written as it is, the connection left open
    /// until the answer: for a path no HTTP client sends as written (it would resolve the dot
    /// segments itself).
    Verbatim(Vec<u8>),
}

/// A request under construction: the route's key and `Content-Type: application/json` unless
/// a row says otherwise.
struct Req {
    method: Method,
    path: String,
    headers: Vec<(&'static str, Vec<u8>)>,
    body: Option<Vec<u8>>,
}

fn request(method: Method, path: &str, key: (&'static str, &str)) -> Req {
    Req {
        method,
        path: path.to_owned(),
        headers: vec![
            (key.0, key.1.as_bytes().to_vec()),
            ("content-type", b"application/json".to_vec()),
        ],
        body: None,
    }
}

/// `POST path` with the executor key.
fn exec(path: &str) -> Req {
    request(Method::POST, path, ("x-internal-key", INTERNAL_KEY))
}

/// `method path` with the operator key.
fn admin(method: Method, path: &str) -> Req {
    request(method, path, ("x-admin-key", ADMIN_KEY))
}

impl Req {
    fn json(self, body: Value) -> Self {
        self.bytes(serde_json::to_vec(&body).unwrap())
    }

    fn bytes(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = Some(body.into());
        self
    }

    /// Sets (or, with `None`, removes) a header.
    fn header(mut self, name: &'static str, value: Option<&[u8]>) -> Self {
        self.headers.retain(|(n, _)| *n != name);
        if let Some(value) = value {
            self.headers.push((name, value.to_vec()));
        }
        self
    }

    fn content_type(self, value: Option<&str>) -> Self {
        self.header("content-type", value.map(str::as_bytes))
    }

    fn operator(self, value: &[u8]) -> Self {
        self.header("x-operator", Some(value))
    }

    fn wire(self) -> Wire {
        Wire::Http {
            method: self.method,
            path: self.path,
            headers: self.headers,
            body: self.body,
        }
    }
}

struct Row {
    endpoint: &'static str,
    what: String,
    wire: Wire,
    status: StatusCode,
    code: &'static str,
}

/// The table, built one endpoint at a time.
#[derive(Default)]
struct Table {
    endpoint: &'static str,
    rows: Vec<Row>,
}

impl Table {
    /// The rows that follow attack `endpoint` ("METHOD /path/{param}", as the OpenAPI document
    /// names it).
    fn on(&mut self, endpoint: &'static str) {
        self.endpoint = endpoint;
    }

    fn row(&mut self, what: impl Into<String>, wire: Wire, status: StatusCode, code: &'static str) {
        self.rows.push(Row {
            endpoint: self.endpoint,
            what: what.into(),
            wire,
            status,
            code,
        });
    }

    /// A row answered 400 `invalid_request`.
    fn bad(&mut self, what: impl Into<String>, req: Req) {
        self.row(what, req.wire(), StatusCode::BAD_REQUEST, "invalid_request");
    }

    /// A row sending the executor key as the admin key: answered 403 `forbidden`.
    fn executor_key_as_admin(&mut self, req: Req) {
        let req = req.header("x-admin-key", Some(INTERNAL_KEY.as_bytes()));
        self.row(
            "the executor key",
            req.wire(),
            StatusCode::FORBIDDEN,
            "forbidden",
        );
    }

    fn too_large(&mut self, what: impl Into<String>, req: Req) {
        let (status, code) = (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
        self.row(what, req.wire(), status, code);
    }

    fn media_type(&mut self, what: impl Into<String>, req: Req) {
        let (status, code) = (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type");
        self.row(what, req.wire(), status, code);
    }
}

/// Lease lengths no request may ask for, whatever the service's maximum: (what, value).
fn bad_lease_seconds() -> [(&'static str, Value); 7] {
    [
        ("0", json!(0)),
        ("-1", json!(-1)),
        ("1.5", json!(1.5)),
        ("\"60\"", json!("60")),
        ("2^31", json!(1_u64 << 31)),
        ("2^63-1", json!(i64::MAX)),
        ("1e308", json!(1e308)),
    ]
}

/// A lease length above the service's `--max-lease-seconds`: (what, value).
fn above_max_lease_seconds() -> (&'static str, Value) {
    ("above --max-lease-seconds", json!(3601))
}

/// `base` with `changes` merged in; a `null` in `changes` removes the field.
fn with(base: &Value, changes: Value) -> Value {
    let mut out = base.clone();
    for (field, value) in changes.as_object().unwrap() {
        if value.is_null() {
            out.as_object_mut().unwrap().remove(field);
        } else {
            out[field] = value.clone();
        }
    }
    out
}

/// `body` as JSON text with `field` written a second time, holding `raw` (JSON text).
fn duplicated(body: &Value, field: &str, raw: &str) -> Vec<u8> {
    let text = body.to_string();
    let open = text.strip_suffix('}').unwrap();
    format!("{open},\"{field}\":{raw}}}").into_bytes()
}

/// `body` as JSON text with the string `value` of `field` replaced by bytes that are not UTF-8.
fn not_utf8(body: &Value, field: &str) -> Vec<u8> {
    let text = body.to_string();
    let needle = format!("\"{field}\":\"");
    let at = text.find(&needle).unwrap() + needle.len();
    let mut bytes = text.into_bytes();
    bytes.splice(at..at, [0xff, 0xfe, 0xc3]);
    bytes
}

/// `body` as JSON text cut off in the middle.
fn truncated(body: &Value) -> Vec<u8> {
    let text = body.to_string();
    text.as_bytes()[..text.len() / 2].to_vec()
}

fn models(count: usize) -> Vec<String> {
    (0..count).map(|i| format!("m{i}")).collect()
}

/// A string of `n` bytes (1 MiB is over the body limit wherever it goes).
fn long(n: usize) -> String {
    "a".repeat(n)
}

const MIB: usize = 1 << 20;

/// An HTTP/1.1 request over a raw connection: the request line and headers, then `body` (which
/// may be shorter than `content_length` claims).
fn raw(path: &str, key: (&str, &str), content_length: usize, body: &[u8]) -> Wire {
    let mut bytes = format!(
        "POST {path} HTTP/1.1\r\nhost: credpool\r\n{}: {}\r\ncontent-type: application/json\r\n\
         content-length: {content_length}\r\nconnection: close\r\n\r\n",
        key.0, key.1
    )
    .into_bytes();
    bytes.extend_from_slice(body);
    Wire::Raw(bytes)
}

/// Every row of the table. `lease` is the live lease, on `key-a`.
fn table(lease: &Value) -> Vec<Row> {
    let lease_id = lease["lease_id"].as_str().unwrap().to_owned();
    let lease_ref = json!({"provider": lease["provider"], "pool": lease["pool"],
                           "key_id": lease["key_id"], "lease_id": lease_id});
    let mut t = Table::default();

    // ---- executor: allocate (key-a has a free slot, so an accepted row would lease it)
    let alloc = json!({"provider": "openai", "model": "gpt-4o", "pool": "default",
                       "lease_seconds": 60, "holder": "hostile-test"});
    t.on("POST /api/internal/allocate-key");
    let true_and_above = [("true", json!(true)), above_max_lease_seconds()];
    for (what, seconds) in bad_lease_seconds().into_iter().chain(true_and_above) {
        let body = with(&alloc, json!({"lease_seconds": seconds}));
        t.bad(format!("lease_seconds {what}"), exec(ALLOCATE).json(body));
    }
    let text = alloc.to_string();
    t.bad(
        "lease_seconds 2^64 (beyond every integer type)",
        exec(ALLOCATE).bytes(text.replace("60", "18446744073709551616")),
    );
    t.bad(
        "lease_seconds 6e1 (a float spelling of 60)",
        exec(ALLOCATE).bytes(text.replace("60", "6e1")),
    );
    for (what, fields) in [
        ("unknown field", json!({"priority": "high"})),
        (
            "unknown field with a 200 KiB name",
            json!({long(200 << 10): 1}),
        ),
        (
            "lease_seconds a 200 KiB string",
            json!({"lease_seconds": long(200 << 10)}),
        ),
        ("missing model", json!({"model": null})),
        ("missing provider", json!({"provider": null})),
    ] {
        t.bad(what, exec(ALLOCATE).json(with(&alloc, fields)));
    }
    t.bad("empty body", exec(ALLOCATE).bytes(""));
    t.bad("truncated JSON", exec(ALLOCATE).bytes(truncated(&alloc)));
    t.bad("JSON null", exec(ALLOCATE).bytes("null"));
    t.bad(
        "an array of two requests",
        exec(ALLOCATE).json(json!([alloc, alloc])),
    );
    t.bad(
        "byte order mark before the JSON",
        exec(ALLOCATE).bytes([b"\xef\xbb\xbf".as_slice(), text.as_bytes()].concat()),
    );
    t.bad(
        "trailing garbage after the JSON",
        exec(ALLOCATE).bytes(format!("{text} {{}}")),
    );
    t.bad(
        "form-encoded body labelled JSON",
        exec(ALLOCATE).bytes("provider=openai&model=gpt-4o"),
    );
    t.bad(
        "duplicate provider key",
        exec(ALLOCATE).bytes(duplicated(&alloc, "provider", "\"anthropic\"")),
    );
    t.bad(
        "invalid UTF-8 in model",
        exec(ALLOCATE).bytes(not_utf8(&alloc, "model")),
    );
    for (what, fields) in [
        ("provider as a number", json!({"provider": 42})),
        (
            "model as a list",
            json!({"model": ["gpt-4o", "gpt-4o-mini"]}),
        ),
    ] {
        t.bad(what, exec(ALLOCATE).json(with(&alloc, fields)));
    }
    t.bad(
        "provider with SQL",
        exec(ALLOCATE).json(with(
            &alloc,
            json!({"provider": "openai'; DROP TABLE credentials; --"}),
        )),
    );
    for (what, fields) in [
        ("pool with LIKE wildcards", json!({"pool": "def%"})),
        ("pool in upper case", json!({"pool": "DEFAULT"})),
        ("model with a NUL", json!({"model": "gpt-4o\u{0}"})),
    ] {
        t.bad(what, exec(ALLOCATE).json(with(&alloc, fields)));
    }
    t.bad(
        "model with a quote and a semicolon",
        exec(ALLOCATE).json(with(&alloc, json!({"model": "gpt-4o';--"}))),
    );
    t.bad(
        "model of 200 KiB (under the body limit)",
        exec(ALLOCATE).json(with(&alloc, json!({"model": long(200 << 10)}))),
    );
    t.too_large(
        "model of 1 MiB",
        exec(ALLOCATE).json(with(&alloc, json!({"model": long(MIB)}))),
    );
    for (what, fields) in [
        ("holder with a newline", json!({"holder": "worker\n7"})),
        (
            "holder with an escape sequence",
            json!({"holder": "\u{1b}[2Jworker"}),
        ),
        ("holder of 201 characters", json!({"holder": long(201)})),
        ("empty holder", json!({"holder": ""})),
    ] {
        t.bad(what, exec(ALLOCATE).json(with(&alloc, fields)));
    }
    for (what, content_type) in [
        ("Content-Type text/plain", Some("text/plain")),
        ("no Content-Type", None),
        (
            "Content-Type form-urlencoded",
            Some("application/x-www-form-urlencoded"),
        ),
    ] {
        t.media_type(
            what,
            exec(ALLOCATE)
                .json(alloc.clone())
                .content_type(content_type),
        );
    }
    t.row(
        "no key",
        exec(ALLOCATE)
            .json(alloc.clone())
            .header("x-internal-key", None)
            .wire(),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );
    t.row(
        "the admin key",
        exec(ALLOCATE)
            .json(alloc.clone())
            .header("x-internal-key", Some(ADMIN_KEY.as_bytes()))
            .wire(),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );
    t.row(
        "GET",
        request(Method::GET, ALLOCATE, ("x-internal-key", INTERNAL_KEY)).wire(),
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    );
    t.row(
        "body cut short of its Content-Length, then end of stream",
        raw(
            ALLOCATE,
            ("x-internal-key", INTERNAL_KEY),
            4096,
            text.as_bytes(),
        ),
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    t.row(
        "Content-Length of 1 GiB, one byte over the limit sent",
        raw(
            ALLOCATE,
            ("x-internal-key", INTERNAL_KEY),
            1 << 30,
            &vec![b' '; credpool::http::MAX_BODY_BYTES + 1],
        ),
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
    );

    // ---- executor: renew (an accepted row would move the live lease's lease_until)
    let renew = with(&lease_ref, json!({"lease_seconds": 600}));
    t.on("POST /api/internal/renew-lease");
    for (what, seconds) in bad_lease_seconds()
        .into_iter()
        .chain([above_max_lease_seconds()])
    {
        let body = with(&renew, json!({"lease_seconds": seconds}));
        t.bad(format!("lease_seconds {what}"), exec(RENEW).json(body));
    }
    for (what, id) in [
        ("31 hex digits", json!(&lease_id[..31])),
        ("33 hex digits", json!(format!("{lease_id}0"))),
        ("32 non-hex characters", json!("g".repeat(32))),
        ("a dashed UUID", json!(uuid_form(&lease_id))),
        ("32 bytes of multi-byte characters", json!("é".repeat(16))),
        (
            "SQL padded to 32 characters",
            json!("' OR '1'='1' --                 "),
        ),
        ("a number", json!(1234)),
        ("empty", json!("")),
    ] {
        let body = with(&renew, json!({"lease_id": id}));
        t.bad(format!("lease_id {what}"), exec(RENEW).json(body));
    }
    for (what, fields) in [
        ("missing lease_id", json!({"lease_id": null})),
        ("missing pool", json!({"pool": null})),
        ("a release field (outcome)", json!({"outcome": "success"})),
    ] {
        t.bad(what, exec(RENEW).json(with(&renew, fields)));
    }
    t.bad(
        "duplicate lease_id key",
        exec(RENEW).bytes(duplicated(&renew, "lease_id", &format!("\"{lease_id}\""))),
    );
    for (what, fields) in [
        ("key_id with SQL", json!({"key_id": "key-a' OR '1'='1"})),
        ("key_id with a tab", json!({"key_id": "key-a\t"})),
    ] {
        t.bad(what, exec(RENEW).json(with(&renew, fields)));
    }
    t.bad(
        "invalid UTF-8 in key_id",
        exec(RENEW).bytes(not_utf8(&renew, "key_id")),
    );
    t.bad("empty body", exec(RENEW).bytes(""));
    t.bad("truncated JSON", exec(RENEW).bytes(truncated(&renew)));
    t.too_large(
        "key_id of 1 MiB",
        exec(RENEW).json(with(&renew, json!({"key_id": long(MIB)}))),
    );
    t.media_type(
        "Content-Type text/plain",
        exec(RENEW)
            .json(renew.clone())
            .content_type(Some("text/plain")),
    );

    // ---- executor: release (an accepted row would end the live lease)
    let release = with(&lease_ref, json!({"outcome": "failure"}));
    t.on("POST /api/internal/release-key");
    for (what, changes) in [
        ("an unknown outcome", json!({"outcome": "exploded"})),
        (
            "an unknown outcome of 200 KiB",
            json!({"outcome": long(200 << 10)}),
        ),
        ("outcome as a number", json!({"outcome": 1})),
        ("outcome in upper case", json!({"outcome": "SUCCESS"})),
        (
            "retry_after_seconds -1",
            json!({"outcome": "rate_limited", "retry_after_seconds": -1}),
        ),
        (
            "retry_after_seconds 2^32",
            json!({"outcome": "rate_limited", "retry_after_seconds": 1_u64 << 32}),
        ),
        (
            "retry_after_seconds over 31 days",
            json!({"outcome": "rate_limited", "retry_after_seconds": 31 * 86_400 + 1}),
        ),
        (
            "retry_after_seconds 2^32 - 1",
            json!({"outcome": "quota_exhausted", "retry_after_seconds": u32::MAX}),
        ),
        (
            "retry_after_seconds 1.5",
            json!({"outcome": "rate_limited", "retry_after_seconds": 1.5}),
        ),
        (
            "retry_after_seconds \"60\"",
            json!({"outcome": "rate_limited", "retry_after_seconds": "60"}),
        ),
        (
            "retry_after_seconds 1e308",
            json!({"outcome": "rate_limited", "retry_after_seconds": 1e308}),
        ),
        (
            "lease_id of 31 hex digits",
            json!({"lease_id": &lease_id[..31]}),
        ),
        (
            "lease_id as a dashed UUID",
            json!({"lease_id": uuid_form(&lease_id)}),
        ),
        (
            "lease_id with a NUL",
            json!({"lease_id": format!("{}\u{0}", &lease_id[..31])}),
        ),
        ("missing key_id", json!({"key_id": null})),
        ("missing provider", json!({"provider": null})),
        (
            "a renew field (lease_seconds)",
            json!({"lease_seconds": 60}),
        ),
        ("provider with a NUL", json!({"provider": "openai\u{0}"})),
        ("pool with SQL", json!({"pool": "default' OR 1=1 --"})),
        ("key_id starting with a dash", json!({"key_id": "-key-a"})),
        ("key_id of 129 characters", json!({"key_id": long(129)})),
    ] {
        t.bad(what, exec(RELEASE).json(with(&release, changes)));
    }
    t.bad(
        "duplicate outcome key",
        exec(RELEASE).bytes(duplicated(&release, "outcome", "\"success\"")),
    );
    t.bad(
        "an array of two releases",
        exec(RELEASE).json(json!([release, release])),
    );
    t.bad("truncated JSON", exec(RELEASE).bytes(truncated(&release)));
    t.bad(
        "invalid UTF-8 in pool",
        exec(RELEASE).bytes(not_utf8(&release, "pool")),
    );
    t.too_large(
        "lease_id of 1 MiB",
        exec(RELEASE).json(with(&release, json!({"lease_id": long(MIB)}))),
    );
    t.media_type(
        "no Content-Type",
        exec(RELEASE).json(release.clone()).content_type(None),
    );
    t.row(
        "the admin key",
        exec(RELEASE)
            .json(release.clone())
            .header("x-internal-key", None)
            .header("x-admin-key", Some(ADMIN_KEY.as_bytes()))
            .wire(),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );

    // ---- operator: PUT a credential (an accepted row would replace key-a)
    let put = json!({"provider": "openai", "pool": "default", "models": ["gpt-4o"],
                     "max_concurrent_uses": 5, "secret": {"api_key": SECRET}});
    let key_a = "/api/admin/keys/key-a";
    let put_a = || admin(Method::PUT, key_a);
    t.on("PUT /api/admin/keys/{key_id}");
    t.too_large(
        "100,000 models",
        put_a().json(with(&put, json!({"models": models(100_000)}))),
    );
    t.bad(
        "60,000 one-letter models (under the body limit)",
        put_a().json(with(&put, json!({"models": vec!["a"; 60_000]}))),
    );
    for (what, fields) in [
        ("257 models", json!({"models": models(257)})),
        ("no models", json!({"models": []})),
        ("models as a string", json!({"models": "gpt-4o"})),
        ("a model with a space", json!({"models": ["gpt 4o"]})),
    ] {
        t.bad(what, put_a().json(with(&put, fields)));
    }
    let aliases: BTreeMap<String, &str> = models(300).into_iter().map(|m| (m, "gpt-4o")).collect();
    for (what, fields) in [
        ("300 aliases", json!({"aliases": aliases})),
        (
            "an alias to a model the credential lacks",
            json!({"aliases": {"gpt-4": "gpt-5"}}),
        ),
    ] {
        t.bad(what, put_a().json(with(&put, fields)));
    }
    for (what, limit) in [
        ("0", json!(0)),
        ("-1", json!(-1)),
        ("10001", json!(10_001)),
        ("2^31", json!(1_u64 << 31)),
        ("2^63-1", json!(i64::MAX)),
        ("1e308", json!(1e308)),
        ("1.5", json!(1.5)),
        ("\"2\"", json!("2")),
    ] {
        let body = with(&put, json!({"max_concurrent_uses": limit}));
        t.bad(format!("max_concurrent_uses {what}"), put_a().json(body));
    }
    for (what, fields) in [
        (
            "status rate_limited (only outcome reports set it)",
            json!({"status": "rate_limited"}),
        ),
        ("an unknown status", json!({"status": "on_fire"})),
        ("secret as a string", json!({"secret": SECRET})),
        ("secret as a list", json!({"secret": [SECRET]})),
        ("missing secret", json!({"secret": null})),
    ] {
        t.bad(what, put_a().json(with(&put, fields)));
    }
    t.bad(
        "secret nested 100,000 deep",
        put_a().bytes(put.to_string().replace(
            &json!({"api_key": SECRET}).to_string(),
            &format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)),
        )),
    );
    t.bad(
        "the secret's field at the top level",
        put_a().json(with(&put, json!({"api_key": SECRET}))),
    );
    t.bad(
        "duplicate secret key",
        put_a().bytes(duplicated(&put, "secret", &format!("\"{SECRET}\""))),
    );
    for (what, fields) in [
        (
            "key_id in the body differs from the path",
            json!({"key_id": "key-b"}),
        ),
        ("provider in upper case", json!({"provider": "OpenAI"})),
    ] {
        t.bad(what, put_a().json(with(&put, fields)));
    }
    t.bad(
        "invalid UTF-8 in provider",
        put_a().bytes(not_utf8(&put, "provider")),
    );
    t.bad("empty body", put_a().bytes(""));
    // an OAuth credential: its client_id, scope and token_url are stored and sent to the token
    // endpoint (a NUL was a 503 from PostgreSQL; control characters were stored)
    let oauth_put = json!({"provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 1,
        "secret": {"access_token": "at", "refresh_token": "rt", "expires_at": "2030-01-01T00:00:00Z"},
        "oauth": {"token_url": "http://127.0.0.1:9/token", "client_id": "client", "scope": "read"}});
    let oauth = |field: &str, value: &str| {
        let mut body = oauth_put.clone();
        body["oauth"][field] = json!(value);
        put_a().json(body)
    };
    t.bad(
        "oauth.client_id with a NUL",
        oauth("client_id", "cli\u{0}ent"),
    );
    t.bad(
        "oauth.client_id with an escape sequence",
        oauth("client_id", "\u{1b}[2Jclient"),
    );
    t.bad("oauth.scope with a NUL", oauth("scope", "read\u{0}"));
    t.bad("oauth.scope with a newline", oauth("scope", "read\nwrite"));
    t.bad(
        "oauth.scope of 1025 characters",
        oauth("scope", &long(1025)),
    );
    for (what, url) in [
        ("with a NUL in its path", "http://127.0.0.1:9/tok\u{0}en"),
        (
            "https to the metadata address",
            "https://169.254.169.254/latest/meta-data",
        ),
        ("https to a private address", "https://10.0.0.5/token"),
        (
            "https to an IPv6 link-local address",
            "https://[fe80::1]/token",
        ),
        ("https to localhost", "https://localhost/token"),
        (
            "https to an IPv4-mapped loopback address",
            "https://[::ffff:127.0.0.1]/token",
        ),
    ] {
        let (status, code) = (StatusCode::BAD_REQUEST, "token_url_not_allowed");
        t.row(
            format!("oauth.token_url {what}"),
            oauth("token_url", url).wire(),
            status,
            code,
        );
    }
    t.bad(
        "key_id in the path with SQL",
        admin(
            Method::PUT,
            "/api/admin/keys/key-a';DROP%20TABLE%20credentials;--",
        )
        .json(put.clone()),
    );
    t.bad(
        "key_id in the path with a NUL",
        admin(Method::PUT, "/api/admin/keys/key-a%00").json(put.clone()),
    );
    t.bad(
        "key_id in the path not UTF-8",
        admin(Method::PUT, "/api/admin/keys/key-a%FF").json(put.clone()),
    );
    t.bad(
        "key_id in the path with an encoded slash",
        admin(Method::PUT, "/api/admin/keys/key-a%2F..").json(put.clone()),
    );
    t.bad(
        "key_id in the path of 129 characters",
        admin(Method::PUT, &format!("/api/admin/keys/{}", long(129))).json(put.clone()),
    );
    t.bad(
        "key_id in the path of 16 KiB",
        admin(Method::PUT, &format!("/api/admin/keys/{}", long(16 << 10))).json(put.clone()),
    );
    t.bad(
        "X-Operator with a tab",
        put_a().json(put.clone()).operator(b"ali\tce"),
    );
    t.bad(
        "X-Operator not UTF-8",
        put_a().json(put.clone()).operator(b"ali\xffce"),
    );
    t.bad(
        "X-Operator of 201 characters",
        put_a().json(put.clone()).operator(long(201).as_bytes()),
    );
    t.media_type(
        "Content-Type text/plain",
        put_a().json(put.clone()).content_type(Some("text/plain")),
    );
    t.executor_key_as_admin(put_a().json(put.clone()));
    t.row(
        "no key",
        put_a().json(put.clone()).header("x-admin-key", None).wire(),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );

    // ---- operator: list credentials
    t.on("GET /api/admin/keys");
    for query in [
        "limit=0",
        "limit=1001",
        "limit=-1",
        "limit=1.5",
        "limit=abc",
        "limit=99999999999999999999",
        "limit=1&limit=2",
        "status=on_fire",
        "provider=Open%20AI",
        "pool=%27%20OR%201%3D1%20--",
        "after=key-a%00",
        "after=%FF",
        "sort=key_id",
    ] {
        t.bad(
            format!("?{query}"),
            admin(Method::GET, &format!("/api/admin/keys?{query}")),
        );
    }
    t.row(
        "the executor key",
        admin(Method::GET, "/api/admin/keys")
            .header("x-admin-key", None)
            .header("x-internal-key", Some(INTERNAL_KEY.as_bytes()))
            .wire(),
        StatusCode::FORBIDDEN,
        "forbidden",
    );

    // ---- operator: one credential
    t.on("GET /api/admin/keys/{key_id}");
    for (what, path) in [
        ("not UTF-8", "/api/admin/keys/%FF%FE"),
        ("with a quote", "/api/admin/keys/key-a'"),
        ("with a NUL", "/api/admin/keys/key-a%00"),
        ("starting with a dot", "/api/admin/keys/.key-a"),
        ("with a space", "/api/admin/keys/key%20a"),
    ] {
        t.bad(format!("key_id {what}"), admin(Method::GET, path));
    }
    t.row(
        "a wrong admin key",
        admin(Method::GET, key_a)
            .header("x-admin-key", Some(b"test-admin-key-guess"))
            .wire(),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );

    // ---- operator: PATCH a credential (an accepted row would change key-a)
    let patch_a = || admin(Method::PATCH, key_a);
    t.on("PATCH /api/admin/keys/{key_id}");
    t.bad("nothing to change", patch_a().json(json!({})));
    t.bad(
        "only a reason",
        patch_a().json(json!({"reason": "just because"})),
    );
    t.bad(
        "an unknown state",
        patch_a().json(json!({"state": "explode"})),
    );
    t.bad(
        "a PUT field (status)",
        patch_a().json(json!({"status": "disabled"})),
    );
    for (what, limit) in [
        ("0", json!(0)),
        ("-1", json!(-1)),
        ("2^63-1", json!(i64::MAX)),
        ("1e308", json!(1e308)),
    ] {
        let body = json!({"max_concurrent_uses": limit});
        t.bad(format!("max_concurrent_uses {what}"), patch_a().json(body));
    }
    t.bad("257 models", patch_a().json(json!({"models": models(257)})));
    t.too_large(
        "100,000 models",
        patch_a().json(json!({"models": models(100_000)})),
    );
    t.bad("no models", patch_a().json(json!({"models": []})));
    t.bad(
        "an alias to a model the credential lacks",
        patch_a().json(json!({"aliases": {"gpt-4": "gpt-5"}})),
    );
    t.bad(
        "a reason of 501 characters",
        patch_a().json(json!({"state": "drain", "reason": long(501)})),
    );
    t.bad(
        "a reason with control characters",
        patch_a().json(json!({"state": "disable", "reason": "rotated\r\nX-Injected: 1"})),
    );
    t.bad("pool in upper case", patch_a().json(json!({"pool": "VIP"})));
    t.bad("JSON null", patch_a().bytes("null"));
    t.bad(
        "duplicate state key",
        patch_a().bytes(duplicated(
            &json!({"state": "drain"}),
            "state",
            "\"disable\"",
        )),
    );
    t.bad(
        "X-Operator with a tab",
        patch_a()
            .json(json!({"state": "drain"}))
            .operator(b"mal\tlory"),
    );
    t.bad(
        "key_id in the path not UTF-8",
        admin(Method::PATCH, "/api/admin/keys/%C3%28").json(json!({"state": "drain"})),
    );
    t.media_type(
        "no Content-Type",
        patch_a().json(json!({"state": "drain"})).content_type(None),
    );

    // ---- operator: DELETE a credential (an accepted row would delete key-a and its lease)
    t.on("DELETE /api/admin/keys/{key_id}");
    t.bad(
        "X-Operator with a tab",
        admin(Method::DELETE, key_a).operator(b"mall\tory"),
    );
    t.bad(
        "key_id with SQL",
        admin(Method::DELETE, "/api/admin/keys/key-a'%20OR%20'1'='1"),
    );
    t.bad(
        "key_id not UTF-8",
        admin(Method::DELETE, "/api/admin/keys/%FF"),
    );
    t.bad(
        "key_id of 129 characters",
        admin(Method::DELETE, &format!("/api/admin/keys/{}", long(129))),
    );
    t.row(
        "the executor key in X-Internal-Key",
        admin(Method::DELETE, key_a)
            .header("x-admin-key", None)
            .header("x-internal-key", Some(INTERNAL_KEY.as_bytes()))
            .wire(),
        StatusCode::FORBIDDEN,
        "forbidden",
    );

    // ---- operator: release-all (an accepted row would end the live lease)
    let all_a = || admin(Method::POST, "/api/admin/keys/key-a/release-all");
    t.on("POST /api/admin/keys/{key_id}/release-all");
    t.bad("no reason", all_a().json(json!({})));
    t.bad("an empty reason", all_a().json(json!({"reason": ""})));
    t.bad(
        "a reason of 501 characters",
        all_a().json(json!({"reason": long(501)})),
    );
    t.bad(
        "a reason with a NUL",
        all_a().json(json!({"reason": "rotated\u{0}"})),
    );
    t.bad("reason as a number", all_a().json(json!({"reason": 7})));
    t.bad(
        "an unknown field",
        all_a().json(json!({"reason": "rotated", "force": true})),
    );
    t.bad("empty body", all_a().bytes(""));
    t.bad(
        "key_id in the path with SQL",
        admin(
            Method::POST,
            "/api/admin/keys/'%3BDELETE%20FROM%20lease_slots%3B--/release-all",
        )
        .json(json!({"reason": "rotated"})),
    );
    t.too_large(
        "a reason of 1 MiB",
        all_a().json(json!({"reason": long(MIB)})),
    );
    t.media_type(
        "no Content-Type",
        all_a()
            .json(json!({"reason": "rotated"}))
            .content_type(None),
    );

    // ---- operator: release one lease (an accepted row would end the live lease)
    let one = |id: &str| admin(Method::POST, &format!("/api/admin/leases/{id}/release"));
    let reason = json!({"reason": "hostile"});
    t.on("POST /api/admin/leases/{lease_id}/release");
    for (what, id) in [
        ("31 hex digits", lease_id[..31].to_owned()),
        ("33 hex digits", format!("{lease_id}0")),
        ("32 non-hex characters", "z".repeat(32)),
        ("a dashed UUID", uuid_form(&lease_id)),
        (
            "32 characters of SQL",
            "'%20OR%201=1%20--%20".to_owned() + &"x".repeat(15),
        ),
        ("not UTF-8", format!("{}%FF", &lease_id[..31])),
    ] {
        t.bad(format!("lease_id {what}"), one(&id).json(reason.clone()));
    }
    t.bad("no reason", one(&lease_id).json(json!({})));
    t.bad(
        "a reason with a bell",
        one(&lease_id).json(json!({"reason": "ding\u{7}"})),
    );
    t.bad(
        "invalid UTF-8 in the reason",
        one(&lease_id).bytes(not_utf8(&reason, "reason")),
    );
    t.media_type(
        "Content-Type text/plain",
        one(&lease_id)
            .json(reason.clone())
            .content_type(Some("text/plain")),
    );
    t.executor_key_as_admin(one(&lease_id).json(reason.clone()));
    t.row(
        "no lease id",
        admin(Method::POST, "/api/admin/leases/release")
            .json(reason.clone())
            .wire(),
        StatusCode::NOT_FOUND,
        "route_not_found",
    );

    // ---- operator: pools
    t.on("GET /api/admin/pools");
    t.bad(
        "X-Operator not UTF-8",
        admin(Method::GET, "/api/admin/pools").operator(b"\xc3\x28"),
    );
    t.row(
        "no key",
        admin(Method::GET, "/api/admin/pools")
            .header("x-admin-key", None)
            .wire(),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );
    t.executor_key_as_admin(admin(Method::GET, "/api/admin/pools"));
    t.row(
        "DELETE",
        admin(Method::DELETE, "/api/admin/pools").wire(),
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    );

    // ---- operator: tenants (an accepted row would create, change or delete a tenant, or mint
    // or revoke a key)
    let team = "/api/admin/tenants/team";
    t.on("PUT /api/admin/tenants/{tenant_id}");
    for (what, body) in [
        (
            "max_concurrent_leases 0",
            json!({"max_concurrent_leases": 0}),
        ),
        (
            "max_concurrent_leases -1",
            json!({"max_concurrent_leases": -1}),
        ),
        (
            "max_concurrent_leases \"3\"",
            json!({"max_concurrent_leases": "3"}),
        ),
        (
            "max_concurrent_leases 100001",
            json!({"max_concurrent_leases": 100_001}),
        ),
        ("weight 0", json!({"weight": 0})),
        ("weight 1001", json!({"weight": 1001})),
        ("weight 1.5", json!({"weight": 1.5})),
        (
            "rate_limits not an array",
            json!({"rate_limits": {"requests": 1, "seconds": 1}}),
        ),
        (
            "a window of 0 seconds",
            json!({"rate_limits": [{"requests": 1, "seconds": 0}]}),
        ),
        ("unknown field", json!({"priority": "high"})),
        ("pools not an array", json!({"pools": "openai/*"})),
        ("a pool without its provider", json!({"pools": ["default"]})),
        ("a pool pattern * alone", json!({"pools": ["*"]})),
        (
            "a pool pattern inside a name",
            json!({"pools": ["openai/v*"]}),
        ),
        ("a pool in upper case", json!({"pools": ["OpenAI/default"]})),
        (
            "a pool with a NUL",
            json!({"pools": ["openai/default\u{0}"]}),
        ),
        ("65 pools", json!({"pools": vec!["*/*"; 65]})),
        (
            "reports_may_disable \"yes\"",
            json!({"reports_may_disable": "yes"}),
        ),
    ] {
        t.bad(what, admin(Method::PUT, team).json(body));
    }
    for (what, body) in [
        (
            "pools for the default tenant",
            json!({"pools": ["openai/*"]}),
        ),
        (
            "reports_may_disable for the default tenant",
            json!({"reports_may_disable": false}),
        ),
    ] {
        t.bad(
            what,
            admin(Method::PUT, "/api/admin/tenants/default").json(body),
        );
    }
    for (what, path) in [
        ("tenant_id with a quote", "/api/admin/tenants/team'"),
        ("tenant_id not UTF-8", "/api/admin/tenants/%FF"),
        ("tenant_id with a space", "/api/admin/tenants/te%20am"),
    ] {
        t.bad(what, admin(Method::PUT, path).json(json!({})));
    }
    t.bad(
        "tenant_id of 65 characters",
        admin(Method::PUT, &format!("/api/admin/tenants/{}", long(65))).json(json!({})),
    );
    t.too_large(
        "a body of 1 MiB",
        admin(Method::PUT, team).json(json!({"note": long(MIB)})),
    );
    t.media_type(
        "no Content-Type",
        admin(Method::PUT, team).json(json!({})).content_type(None),
    );
    t.executor_key_as_admin(admin(Method::PUT, team).json(json!({})));

    t.on("GET /api/admin/tenants");
    t.row(
        "no key",
        admin(Method::GET, "/api/admin/tenants")
            .header("x-admin-key", None)
            .wire(),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );

    t.on("DELETE /api/admin/tenants/{tenant_id}");
    t.row(
        "the default tenant",
        admin(Method::DELETE, "/api/admin/tenants/default").wire(),
        StatusCode::CONFLICT,
        "tenant_in_use",
    );
    t.row(
        "a tenant that does not exist",
        admin(Method::DELETE, team).wire(),
        StatusCode::NOT_FOUND,
        "tenant_not_found",
    );
    t.bad(
        "tenant_id with SQL",
        admin(Method::DELETE, "/api/admin/tenants/team'%20OR%20'1'='1"),
    );

    t.on("POST /api/admin/tenants/{tenant_id}/keys");
    t.row(
        "a tenant that does not exist",
        admin(Method::POST, "/api/admin/tenants/team/keys").wire(),
        StatusCode::NOT_FOUND,
        "tenant_not_found",
    );
    t.executor_key_as_admin(admin(Method::POST, "/api/admin/tenants/default/keys"));

    t.on("DELETE /api/admin/tenants/{tenant_id}/keys/{key_id}");
    t.row(
        "a key that does not exist",
        admin(
            Method::DELETE,
            "/api/admin/tenants/default/keys/00000000-0000-0000-0000-000000000000",
        )
        .wire(),
        StatusCode::NOT_FOUND,
        "tenant_key_not_found",
    );
    t.bad(
        "key_id not a UUID",
        admin(Method::DELETE, "/api/admin/tenants/default/keys/key-a"),
    );

    t.on("PUT /api/admin/relay/upstreams/{provider}");
    let upstream = "/api/admin/relay/upstreams/openai";
    for (what, body) in [
        (
            "http to a host that is not loopback",
            json!({"base_url": "http://api.example.com", "api": "openai"}),
        ),
        (
            "a base_url with user info",
            json!({"base_url": "https://user:pw@api.example.com", "api": "openai"}),
        ),
        (
            "a base_url with a query",
            json!({"base_url": "https://api.example.com/?to=elsewhere", "api": "openai"}),
        ),
        (
            "an api credpool does not speak",
            json!({"base_url": "https://api.example.com", "api": "gemini"}),
        ),
        (
            "the credential in the Host header",
            json!({"base_url": "https://api.example.com", "api": "openai", "credential_header": "host"}),
        ),
        (
            "an affinity header that is not a header name",
            json!({"base_url": "https://api.example.com", "api": "openai", "affinity_header": "x session"}),
        ),
        (
            "wait_ms -1",
            json!({"base_url": "https://api.example.com", "api": "openai", "wait_ms": -1}),
        ),
        (
            "timeout_seconds 0",
            json!({"base_url": "https://api.example.com", "api": "openai", "timeout_seconds": 0}),
        ),
        (
            "an unknown field",
            json!({"base_url": "https://api.example.com", "api": "openai", "proxy": "yes"}),
        ),
    ] {
        t.bad(what, admin(Method::PUT, upstream).json(body));
    }
    t.bad(
        "provider with a quote",
        admin(Method::PUT, "/api/admin/relay/upstreams/open'ai")
            .json(json!({"base_url": "https://api.example.com", "api": "openai"})),
    );
    t.too_large(
        "a body of 1 MiB",
        admin(Method::PUT, upstream).json(json!({"note": long(MIB)})),
    );
    t.media_type(
        "no Content-Type",
        admin(Method::PUT, upstream)
            .json(json!({"base_url": "https://api.example.com", "api": "openai"}))
            .content_type(None),
    );
    t.executor_key_as_admin(
        admin(Method::PUT, upstream)
            .json(json!({"base_url": "https://api.example.com", "api": "openai"})),
    );

    t.on("GET /api/admin/relay/upstreams");
    t.row(
        "no key",
        admin(Method::GET, "/api/admin/relay/upstreams")
            .header("x-admin-key", None)
            .wire(),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );

    t.on("DELETE /api/admin/relay/upstreams/{provider}");
    t.row(
        "a provider without one",
        admin(Method::DELETE, "/api/admin/relay/upstreams/anthropic").wire(),
        StatusCode::NOT_FOUND,
        "upstream_not_configured",
    );
    t.bad(
        "provider with SQL",
        admin(
            Method::DELETE,
            "/api/admin/relay/upstreams/x'%20OR%20'1'='1",
        ),
    );

    // the relay itself (not in the OpenAPI document: it passes an upstream's API through); the
    // `openai` upstream is set, at an address nothing answers on: none of these reaches it
    t.on("POST /relay/{provider}/{pool}/{*path}");
    let chat = json!({"model": "gpt-4o", "messages": []});
    t.row(
        "no key",
        exec("/relay/openai/default/v1/chat/completions")
            .header("x-internal-key", None)
            .json(chat.clone())
            .wire(),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );
    t.row(
        "the admin key as a bearer token",
        exec("/relay/openai/default/v1/chat/completions")
            .header("x-internal-key", None)
            .header(
                "authorization",
                Some(format!("Bearer {ADMIN_KEY}").as_bytes()),
            )
            .json(chat.clone())
            .wire(),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );
    t.row(
        "a provider without an upstream",
        exec("/relay/anthropic/default/v1/messages")
            .json(chat.clone())
            .wire(),
        StatusCode::NOT_FOUND,
        "upstream_not_configured",
    );
    for (what, path) in [
        (
            "a path to another host",
            "/relay/openai/default//evil.example.com/v1",
        ),
        ("dot segments", "/relay/openai/default/v1/../../admin"),
        (
            "encoded dot segments",
            "/relay/openai/default/v1/%2e%2e/admin",
        ),
        ("an encoded slash", "/relay/openai/default/v1%2f..%2fadmin"),
        ("a backslash", "/relay/openai/default/v1\\..\\admin"),
        (
            "a Tomcat-style dot segment",
            "/relay/openai/default/v1/..;/admin",
        ),
    ] {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nX-Internal-Key: {INTERNAL_KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{chat}",
            chat.to_string().len()
        );
        t.row(
            what,
            Wire::Verbatim(head.into_bytes()),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        );
    }
    t.bad(
        "a body without a model",
        exec("/relay/openai/default/v1/chat/completions").json(json!({"messages": []})),
    );
    t.bad(
        "a body that is not JSON",
        exec("/relay/openai/default/v1/chat/completions").bytes(&b"{\"model\": "[..]),
    );
    t.bad(
        "a model with a NUL",
        exec("/relay/openai/default/v1/chat/completions").json(json!({"model": "gpt\u{0}4o"})),
    );
    t.bad(
        "a wait that is not a number",
        exec("/relay/openai/default/v1/chat/completions")
            .header("x-credpool-wait-ms", Some(b"soon"))
            .json(chat.clone()),
    );

    t.rows
}

/// `0123...` as `01234567-89ab-...`: the same id, spelled as a UUID.
fn uuid_form(hex: &str) -> String {
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// Sends one row's request; the status and the body text.
async fn send(app: &TestApp, wire: &Wire, label: &str) -> (StatusCode, String) {
    match wire {
        Wire::Http {
            method,
            path,
            headers,
            body,
        } => {
            let mut request = app.client.request(method.clone(), app.url(path));
            for (name, value) in headers {
                let value = reqwest::header::HeaderValue::from_bytes(value).unwrap();
                request = request.header(*name, value);
            }
            if let Some(body) = body {
                request = request.body(body.clone());
            }
            let response = match request.send().await {
                Ok(response) => response,
                Err(error) => panic!("{label}: no answer: {}", error.without_url()),
            };
            let status = response.status();
            (status, response.text().await.expect("body"))
        }
        Wire::Raw(bytes) | Wire::Verbatim(bytes) => {
            let mut stream = tokio::net::TcpStream::connect(app.addr).await.unwrap();
            stream.write_all(bytes).await.unwrap();
            if matches!(wire, Wire::Raw(_)) {
                stream.shutdown().await.unwrap();
            }
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer).await.unwrap();
            let answer = String::from_utf8_lossy(&answer).into_owned();
            let (head, body) = answer
                .split_once("\r\n\r\n")
                .unwrap_or_else(|| panic!("{label}: no HTTP answer: {answer:?}"));
            let status = head.split(' ').nth(1).and_then(|s| s.parse().ok());
            (
                StatusCode::from_u16(status.unwrap()).unwrap(),
                body.to_owned(),
            )
        }
    }
}

/// Everything the API can write, as text: the helper's snapshot (credentials, slots, lease trail)
/// plus the operator trail and the tenants, their keys and their trail.
async fn everything(app: &TestApp) -> String {
    let mut out = app.snapshot().await;
    for (table, order) in [
        ("credential_events", "event_id"),
        ("tenants", "tenant_id"),
        ("tenant_keys", "key_id"),
        ("tenant_events", "event_id"),
        ("relay_upstreams", "provider"),
        ("relay_upstream_events", "event_id"),
    ] {
        let rows: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT string_agg(to_jsonb(t)::text, E'\\n' ORDER BY t.{order}) FROM {table} t"
        )))
        .fetch_one(&app.db)
        .await
        .unwrap();
        out.push_str(&format!("== {table}\n{}\n", rows.unwrap_or_default()));
    }
    out
}

#[tokio::test]
async fn hostile_requests_to_every_route_get_their_4xx_code_and_change_nothing() {
    let app = TestApp::spawn().await;
    for (key_id, pool, limit) in [("key-a", "default", 2), ("key-b", "vip", 1)] {
        let body = json!({"provider": "openai", "pool": pool, "models": ["gpt-4o"],
                          "max_concurrent_uses": limit, "secret": {"api_key": SECRET}});
        json_body(app.put_key_raw(key_id, body).await, StatusCode::CREATED).await;
    }
    let lease = app
        .lease(
            json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 600,
                            "holder": "victim"}),
        )
        .await;
    assert_eq!(lease["key_id"], "key-a");
    let unanswered = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let nowhere = unanswered.local_addr().unwrap();
    drop(unanswered);
    let upstream = json!({"base_url": format!("http://{nowhere}"), "api": "openai"});
    let path = "/api/admin/relay/upstreams/openai";
    let set = app.admin(Method::PUT, path, Some(upstream)).await;
    assert_eq!(set.status(), StatusCode::CREATED);
    let before = everything(&app).await;

    let rows = table(&lease);
    let mut failures = Vec::new();
    for row in &rows {
        let label = format!("{} / {}", row.endpoint, row.what);
        let (status, text) = tokio::time::timeout(ANSWER_WITHIN, send(&app, &row.wire, &label))
            .await
            .unwrap_or_else(|_| panic!("{label}: no answer within {ANSWER_WITHIN:?}"));
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let code = body["error"]["code"].as_str().unwrap_or("<none>");
        let has_message = body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty());
        if status != row.status || code != row.code || !has_message {
            failures.push(format!(
                "{label}: expected {} {}, got {status} {code}: {}",
                row.status.as_u16(),
                row.code,
                text.chars().take(300).collect::<String>()
            ));
        }
        if text.len() > ANSWER_AT_MOST {
            failures.push(format!("{label}: an answer of {} bytes", text.len()));
        }
        for leaked in [SECRET, INTERNAL_KEY, ADMIN_KEY] {
            if text.contains(leaked) {
                failures.push(format!("{label}: the answer contains {leaked:?}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
    assert_eq!(
        everything(&app).await,
        before,
        "a refused request changed the database"
    );

    // every executor and operator route of the OpenAPI document has rows
    let document = serde_json::to_value(credpool::http::openapi()).unwrap();
    let mut routes = BTreeSet::new();
    for (path, item) in document["paths"].as_object().unwrap() {
        if path.starts_with("/api/") {
            for method in ["get", "put", "post", "delete", "patch"] {
                if item.get(method).is_some() {
                    routes.insert(format!("{} {path}", method.to_uppercase()));
                }
            }
        }
    }
    let attacked: BTreeSet<String> = rows.iter().map(|r| r.endpoint.to_owned()).collect();
    let missing: Vec<_> = routes.difference(&attacked).collect();
    assert!(
        missing.is_empty(),
        "routes without hostile rows: {missing:?}"
    );
    assert!(rows.len() >= 30, "{} rows", rows.len());
}

/// How long a probe or an allocate may take to answer while the sockets are open: a readiness
/// probe's own timeout is seconds (Kubernetes' default is 1 s); 5 s leaves room for a loaded
/// machine. A bound on waiting, not a speed requirement.
const PROBE_ANSWERS_WITHIN: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_half_sent_sockets_do_not_starve_probes_or_allocations() {
    // With the process's open-file limit at 128, 200 sockets that sent nothing or half a request
    // head were never closed: accept failed with "too many open files" every second, and
    // /livez, /readyz and allocate timed out for as long as the sockets stayed open.
    let database = TestDatabase::create().await;
    let env = keyed_env(&database);
    let serve = ServeProcess::start_with_open_files(
        crate::BIN,
        &env,
        &["--http-header-read-timeout-seconds", "3"],
        128,
    )
    .await;
    // a new connection per request, as a probe makes (a kept-alive one from before the sockets
    // opened would not be a probe coming in)
    let client = reqwest::Client::builder()
        .timeout(PROBE_ANSWERS_WITHIN)
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let put = client
        .put(format!("{}/api/admin/keys/k", serve.base))
        .header("x-admin-key", ADMIN_KEY)
        .json(
            &json!({"provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 4,
                       "secret": {"api_key": SECRET}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), StatusCode::CREATED);

    let addr = serve.base.strip_prefix("http://").unwrap().to_owned();
    let mut sockets = Vec::new();
    for i in 0..200 {
        let mut socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
        if i % 2 == 1 {
            socket
                .write_all(
                    b"POST /api/internal/allocate-key HTTP/1.1\r\nhost: credpool\r\ncontent-le",
                )
                .await
                .unwrap();
        }
        sockets.push(socket);
    }

    for path in ["/livez", "/readyz"] {
        let answer = client.get(format!("{}{path}", serve.base)).send().await;
        let answer = answer.unwrap_or_else(|e| {
            panic!(
                "{path}: no answer within {PROBE_ANSWERS_WITHIN:?} beside 200 idle sockets: {e:?}"
            )
        });
        assert_eq!(answer.status(), StatusCode::OK, "{path}");
    }
    let lease = client
        .post(format!("{}/api/internal/allocate-key", serve.base))
        .header("x-internal-key", INTERNAL_KEY)
        .json(&gpt4o())
        .send()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "allocate: no answer within {PROBE_ANSWERS_WITHIN:?} beside 200 idle sockets: {e}"
            )
        });
    assert_eq!(lease.status(), StatusCode::OK);

    // every one of the sockets is closed by the service: at once to make room, or when its
    // header read timeout (3 s here) runs out
    for (i, socket) in sockets.iter_mut().enumerate() {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(30), socket.read(&mut byte))
            .await
            .unwrap_or_else(|_| panic!("socket {i} still open 30 s later"));
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "socket {i}: the service sent {read:?}"
        );
    }
    let page = serve.metrics().await;
    let dropped = |reason: &str| {
        page.lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "credpool_http_connections_dropped_total{{reason=\"{reason}\"}} "
                ))
            })
            .map_or(0.0, |v| v.parse::<f64>().unwrap())
    };
    assert!(
        dropped("evicted") + dropped("header_timeout") >= 200.0,
        "{}",
        page.lines()
            .filter(|l| l.contains("connections_dropped"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test]
async fn a_client_request_id_is_kept_only_when_short_and_plain() {
    // Any X-Request-Id was echoed and written into every log line of its request: 60 KB of it,
    // or a value crafted to forge log text. Now only 1..=128 of `A-Z a-z 0-9 . _ : - + / =` is
    // kept; anything else is replaced by a generated id.
    let app = TestApp::spawn().await;
    let echoed = |sent: Vec<u8>| {
        let request = app
            .client
            .get(app.url("/livez"))
            .header(
                "x-request-id",
                reqwest::header::HeaderValue::from_bytes(&sent).unwrap(),
            )
            .send();
        async move {
            let response = request.await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            let ids: Vec<_> = response.headers().get_all("x-request-id").iter().collect();
            assert_eq!(ids.len(), 1, "{ids:?}");
            ids[0].as_bytes().to_vec()
        }
    };
    for kept in [
        "0af7651916cd43dd8448eb211c80319c",
        "7f9c0c1e-52b4-4a55-9d7e-55c4b1c2e0f1",
        "Root=1-5759e988:bd862e3fe1be46a994272793",
        &"a".repeat(128),
    ] {
        assert_eq!(echoed(kept.as_bytes().to_vec()).await, kept.as_bytes());
    }
    for replaced in [
        "a".repeat(60 * 1024),
        "a".repeat(129),
        "abc\" level=ERROR msg=\"forged".to_owned(),
        "id with spaces".to_owned(),
        "semi;colon".to_owned(),
    ] {
        let answer = echoed(replaced.clone().into_bytes()).await;
        assert_ne!(answer, replaced.as_bytes());
        let answer = String::from_utf8(answer).unwrap();
        assert!(
            uuid::Uuid::parse_str(&answer).is_ok(),
            "not a generated id: {answer}"
        );
    }
}
