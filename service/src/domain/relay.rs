//! The relay's values (`/relay/{provider}/{pool}/<upstream path>`): a provider's upstream as an
//! operator sets it ([`UpstreamInput`], checked into an [`Upstream`]), the URL a call is forwarded
//! to ([`forward_url`]), what an upstream's answer reports (its [`outcome_of`], its
//! [`retry_after_seconds`], the tokens it used: [`UsageScanner`]) and credpool's own refusals in
//! the error shape of the API the client speaks ([`refusal_body`]). Values only: the forwarding
//! itself is `crate::http::relay`'s.

use http::HeaderName;
use serde::{Deserialize, Serialize};

use credpool_protocol::MAX_RETRY_AFTER_SECONDS;

use super::{InvalidValue, Outcome, ProviderName, check_endpoint_url, windows::MAX_COUNT};

/// The API an upstream speaks: it decides the error shape of credpool's own refusals (a client
/// SDK reads them as it reads the provider's) and the default place of the credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub enum ApiStyle {
    /// OpenAI's and the many APIs compatible with it: errors `{"error": {"message", "type",
    /// "code"}}`; the credential as `Authorization: Bearer`.
    #[serde(rename = "openai")]
    OpenAi,
    /// Anthropic's: errors `{"type": "error", "error": {"type", "message"}}`; the credential in
    /// `x-api-key` (an OAuth access token as `Authorization: Bearer`).
    #[serde(rename = "anthropic")]
    Anthropic,
}

impl ApiStyle {
    /// The spelling stored in `relay_upstreams.api`.
    pub fn as_str(self) -> &'static str {
        match self {
            ApiStyle::OpenAi => "openai",
            ApiStyle::Anthropic => "anthropic",
        }
    }

    /// The style spelled `value` (as stored).
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "openai" => Some(ApiStyle::OpenAi),
            "anthropic" => Some(ApiStyle::Anthropic),
            _ => None,
        }
    }

    /// The style a request's headers suggest, for refusals answered before its provider's
    /// upstream is known (a missing key, an unconfigured provider): Anthropic's SDKs send
    /// `anthropic-version` on every call; anything else is answered as OpenAI's.
    pub fn of_request(headers: &http::HeaderMap) -> Self {
        if headers.contains_key("anthropic-version") {
            ApiStyle::Anthropic
        } else {
            ApiStyle::OpenAi
        }
    }

    /// Where the credential goes when the operator names no header.
    fn default_credential_header(self) -> HeaderName {
        match self {
            ApiStyle::OpenAi => http::header::AUTHORIZATION,
            ApiStyle::Anthropic => HeaderName::from_static("x-api-key"),
        }
    }
}

/// The default of `wait_ms`: a relay call waits up to 10 s for a free credential (capped by the
/// service's `--max-wait-ms`), since the clients behind a relay cannot be taught to retry.
pub const DEFAULT_WAIT_MS: u32 = 10_000;
/// The largest `wait_ms`, in milliseconds (10 minutes); the database holds the same bound.
pub const MAX_WAIT_MS: u32 = 600_000;
/// The default of `timeout_seconds`: 600 s, for long completions that answer only when done.
pub const DEFAULT_TIMEOUT_SECONDS: u32 = 600;
/// The largest `timeout_seconds` (one hour); the database holds the same bound.
pub const MAX_TIMEOUT_SECONDS: u32 = 3600;

/// `PUT /api/admin/relay/upstreams/{provider}` body (also `credpool relay set`).
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpstreamInput {
    /// Where calls go: `https://api.openai.com` (a call to `/relay/openai/{pool}/v1/chat/completions`
    /// goes to `https://api.openai.com/v1/chat/completions`), or `http://` on a loopback address
    /// for tests and local gateways. No user info, query or fragment.
    pub base_url: String,
    /// `openai` or `anthropic`: the shape of credpool's own refusals, and the default
    /// `credential_header`.
    pub api: ApiStyle,
    /// The request header that carries the leased credential: `authorization` (as `Bearer
    /// <credential>`) or another (the credential as it is, e.g. `x-api-key`). Default:
    /// `authorization` for `openai`, `x-api-key` for `anthropic`. An OAuth credential's access
    /// token always goes as `Authorization: Bearer`.
    pub credential_header: Option<String>,
    /// How long a call waits for a free credential, in milliseconds, 0..=600000 (default
    /// 10000; the service's `--max-wait-ms` caps it). A call overrides it with the
    /// `X-Credpool-Wait-Ms` header.
    #[schema(minimum = 0, maximum = 600000)]
    pub wait_ms: Option<u64>,
    /// A request header whose value is the call's affinity key (e.g. `x-session-id`): calls of
    /// one conversation go to the credential that served its last call while it can serve.
    pub affinity_header: Option<String>,
    /// The longest the upstream may take to start its answer, and between two chunks of it, in
    /// seconds, 1..=3600 (default 600). Past it the call ends: 504 `upstream_timeout` before
    /// the answer started, a cut stream after.
    #[schema(minimum = 1, maximum = 3600)]
    pub timeout_seconds: Option<u64>,
}

/// A provider's upstream, checked: what the relay forwards its calls to and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// The provider whose calls go there.
    pub provider: ProviderName,
    /// The base URL (https, or http on loopback).
    pub base_url: url::Url,
    /// The API it speaks.
    pub api: ApiStyle,
    /// The header the credential goes in (lowercase).
    pub credential_header: HeaderName,
    /// The default wait for a free credential, in milliseconds.
    pub wait_ms: u32,
    /// The header that names the call's conversation, if any (lowercase).
    pub affinity_header: Option<HeaderName>,
    /// The longest wait for the answer to start, and between two of its chunks, in seconds.
    pub timeout_seconds: u32,
}

/// Request headers that can carry neither the credential nor a conversation's key: the relay
/// sets or strips them itself.
const RESERVED_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "cookie",
    "x-internal-key",
    "x-admin-key",
];

/// Headers clients carry API keys in: never a conversation's key.
const KEY_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "x-goog-api-key",
];

/// A header name an operator gave for `field`: a valid HTTP token, 1..=64 characters, not one
/// the relay sets or strips itself.
fn header_name(field: &'static str, value: &str) -> Result<HeaderName, InvalidValue> {
    let name = HeaderName::from_bytes(value.trim().as_bytes())
        .ok()
        .filter(|n| (1..=64).contains(&n.as_str().len()))
        .ok_or_else(|| {
            InvalidValue::new(field, "must be an HTTP header name of 1 to 64 characters")
        })?;
    if RESERVED_HEADERS.contains(&name.as_str()) || name.as_str().starts_with("x-credpool-") {
        return Err(InvalidValue::new(
            field,
            "may not be a header the relay sets or strips itself (host, content-*, connection, cookie, x-internal-key, x-admin-key, x-credpool-*)",
        ));
    }
    Ok(name)
}

impl UpstreamInput {
    /// Checks every field (the error names the field) and fills in the defaults.
    pub fn check(self, provider: ProviderName) -> Result<Upstream, InvalidValue> {
        let base_url = check_endpoint_url("base_url", &self.base_url)?;
        if base_url.query().is_some() || base_url.fragment().is_some() {
            return Err(InvalidValue::new(
                "base_url",
                "must have no query or fragment (the call's own path and query are appended)",
            ));
        }
        let credential_header = match &self.credential_header {
            Some(name) => header_name("credential_header", name)?,
            None => self.api.default_credential_header(),
        };
        let wait_ms = match self.wait_ms {
            None => DEFAULT_WAIT_MS,
            Some(ms) => u32::try_from(ms)
                .ok()
                .filter(|ms| *ms <= MAX_WAIT_MS)
                .ok_or_else(|| {
                    InvalidValue::new(
                        "wait_ms",
                        format!("must be an integer from 0 to {MAX_WAIT_MS}"),
                    )
                })?,
        };
        let timeout_seconds = match self.timeout_seconds {
            None => DEFAULT_TIMEOUT_SECONDS,
            Some(s) => u32::try_from(s)
                .ok()
                .filter(|s| (1..=MAX_TIMEOUT_SECONDS).contains(s))
                .ok_or_else(|| {
                    InvalidValue::new(
                        "timeout_seconds",
                        format!("must be an integer from 1 to {MAX_TIMEOUT_SECONDS}"),
                    )
                })?,
        };
        let affinity_header = self
            .affinity_header
            .as_deref()
            .map(|name| header_name("affinity_header", name))
            .transpose()?;
        if let Some(name) = &affinity_header
            && (KEY_HEADERS.contains(&name.as_str()) || *name == credential_header)
        {
            // its value is kept as the conversation's key, in the clear
            return Err(InvalidValue::new(
                "affinity_header",
                "may not be a header that carries a key (authorization, x-api-key, api-key, ...) or the credential_header",
            ));
        }
        Ok(Upstream {
            provider,
            base_url,
            api: self.api,
            credential_header,
            wait_ms,
            affinity_header,
            timeout_seconds,
        })
    }
}

/// The URL a call is forwarded to: the upstream's base URL with `rest` (the call's path after
/// `/relay/{provider}/{pool}`, still percent-encoded as the client sent it) appended to its path,
/// and the call's query. The host, port and scheme are the base URL's whatever `rest` holds: it
/// replaces only the path. Refused (the error names `path`): a segment that is `.` or `..`
/// (percent-encoded or not), an empty segment, a percent-encoded `/` or `\`, a backslash, and any
/// character outside a path's (RFC 3986 `pchar` and `/`), so that nothing an upstream might
/// normalize differently leaves the base URL's path.
pub fn forward_url(
    base: &url::Url,
    rest: &str,
    query: Option<&str>,
) -> Result<url::Url, InvalidValue> {
    let refuse = || {
        InvalidValue::new(
            "path",
            "the path after /relay/{provider}/{pool} must be plain segments (no empty, . or .. segments, no encoded slashes)",
        )
    };
    // no `;`: gateways on Tomcat, Jetty or Spring read `..;` as `..`
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-._~!$&'()*+,=:@%/".contains(c);
    if !rest.chars().all(allowed) {
        return Err(refuse());
    }
    if !rest.is_empty() {
        let segments = rest.strip_prefix('/').ok_or_else(refuse)?;
        for segment in segments.split('/') {
            let lower = segment.to_ascii_lowercase();
            let decoded = lower.replace("%2e", ".");
            if segment.is_empty()
                || decoded == "."
                || decoded == ".."
                || lower.contains("%2f")
                || lower.contains("%5c")
            {
                return Err(refuse());
            }
        }
    }
    let mut url = base.clone();
    let path = format!("{}{rest}", base.path().trim_end_matches('/'));
    url.set_path(&path);
    url.set_query(query);
    Ok(url)
}

/// The value the leased credential gives the upstream, and whether it is an OAuth access token
/// (then it always goes as `Authorization: Bearer`): the secret's `access_token` (an OAuth
/// credential's), else its `api_key`. `None`: the secret holds neither as a string, so the relay
/// cannot use it (the call is answered 502 `credential_not_relayable`).
pub fn credential_value(secret: &serde_json::Value) -> Option<(&str, bool)> {
    let text = |field: &str| secret.get(field).and_then(serde_json::Value::as_str);
    text("access_token")
        .map(|token| (token, true))
        .or_else(|| text("api_key").map(|key| (key, false)))
        .filter(|(value, _)| !value.is_empty())
}

/// Error codes and types in an answer's body that mean the account's quota or credit is used up
/// (the Python client's `outcome_for` reads the same).
const QUOTA_CODES: &[&str] = &[
    "insufficient_quota",
    "billing_hard_limit_reached",
    "billing_not_active",
    "billing_error",
    "quota_exceeded",
    "resource_exhausted_quota",
];

/// What the relay reports at release for an upstream's error answer with `status` and `body` (the
/// Python client's `outcome_for` follows the same rules for an SDK's exceptions):
/// `quota_exhausted` for 402, a quota or billing code in the body (OpenAI's
/// `insufficient_quota`, ...) or Anthropic's "credit balance is too low" (a 400); `rate_limited`
/// for 429; `auth_expired` for 401 (an OAuth credential's token is refreshed; on any other
/// credential it counts as `auth_error`); `failure` for 403, 408 and 5xx (Anthropic's 529 too).
/// Any other status is `success`: the credential served, and a 400 or 404 is the caller's
/// request, not the credential's fault.
pub fn outcome_of(status: u16, body: &[u8]) -> Outcome {
    let quota = QUOTA_CODES
        .iter()
        .any(|code| contains(body, format!("\"{code}\"").as_bytes()))
        || contains(&body.to_ascii_lowercase(), b"credit balance is too low");
    match status {
        402 => Outcome::QuotaExhausted,
        400..=499 if quota => Outcome::QuotaExhausted,
        429 => Outcome::RateLimited,
        401 => Outcome::AuthExpired,
        403 | 408 | 500..=599 => Outcome::Failure,
        _ => Outcome::Success,
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// An upstream's `Retry-After` in whole seconds (at least 1, at most
/// [`MAX_RETRY_AFTER_SECONDS`]): OpenAI's `retry-after-ms` rounded up, else the `retry-after`
/// header's seconds (the Python client's order). An HTTP date or anything unreadable: `None` (the
/// release then rests the credential for the service's default).
pub fn retry_after_seconds(headers: &http::HeaderMap) -> Option<u32> {
    let number = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
    };
    let seconds = number("retry-after-ms")
        .map(|ms| ms / 1000.0)
        .or_else(|| number("retry-after"))?;
    Some((seconds.ceil() as u64).clamp(1, u64::from(MAX_RETRY_AFTER_SECONDS)) as u32)
}

/// The longest server-sent event line, and the longest unstreamed answer, read for its usage, in
/// bytes (1 MiB and 4 MiB): longer ones pass through whole but report no usage.
const MAX_EVENT_BYTES: usize = 1 << 20;
const MAX_ANSWER_BYTES: usize = 4 << 20;

/// Reads the tokens an answer reports as it passes through, without holding it back: an
/// unstreamed JSON answer's `usage`, or a stream's events (`data:` lines) that carry one. Knows
/// OpenAI's chat completions (`usage.total_tokens`, in a stream's last chunk when the caller
/// asked for `stream_options.include_usage`), OpenAI's responses (`response.usage`) and
/// Anthropic's messages (`usage.input_tokens` + `output_tokens`, the input in a stream's
/// `message_start`, the output counted up in `message_delta`). An answer that reports none:
/// [`UsageScanner::tokens`] is `None`, and the lease's reservation stands.
#[derive(Debug, Default)]
pub struct UsageScanner {
    events: bool,
    buffer: Vec<u8>,
    overflowed: bool,
    /// A stream's last event has passed (OpenAI's `data: [DONE]`, Anthropic's `message_stop`, the
    /// responses API's `response.completed`).
    ended: bool,
    input: Option<u64>,
    output: Option<u64>,
    total: Option<u64>,
}

impl UsageScanner {
    /// A scanner of a stream of server-sent events (`events`) or of one JSON answer.
    pub fn new(events: bool) -> Self {
        Self {
            events,
            ..Self::default()
        }
    }

    /// Reads the next bytes of the answer.
    pub fn feed(&mut self, chunk: &[u8]) {
        if !self.events {
            if self.buffer.len() + chunk.len() > MAX_ANSWER_BYTES {
                self.overflowed = true;
                self.buffer = Vec::new();
            } else if !self.overflowed {
                self.buffer.extend_from_slice(chunk);
            }
            return;
        }
        let mut rest = chunk;
        while let Some(end) = rest.iter().position(|b| *b == b'\n') {
            if !self.overflowed {
                self.buffer.extend_from_slice(&rest[..end]);
                let line = std::mem::take(&mut self.buffer);
                self.read_event_line(&line);
            }
            self.overflowed = false;
            self.buffer.clear();
            rest = &rest[end + 1..];
        }
        if self.buffer.len() + rest.len() > MAX_EVENT_BYTES {
            self.overflowed = true;
            self.buffer = Vec::new();
        } else if !self.overflowed {
            self.buffer.extend_from_slice(rest);
        }
    }

    fn read_event_line(&mut self, line: &[u8]) {
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]"
            || contains(data, b"\"type\":\"message_stop\"")
            || contains(data, b"\"type\": \"message_stop\"")
            || contains(data, b"\"type\":\"response.completed\"")
            || contains(data, b"\"type\": \"response.completed\"")
        {
            self.ended = true;
        }
        if contains(data, b"\"usage\"")
            && let Ok(value) = serde_json::from_slice::<serde_json::Value>(data.trim_ascii())
        {
            self.read(&value);
        }
    }

    /// Whether a stream's last event has passed through: a client may close its connection then,
    /// before the upstream's own end, and the call still counts as whole.
    pub fn stream_ended(&self) -> bool {
        self.ended
    }

    /// The tokens the answer reported, once it has ended: a total where one was given, else
    /// input and output together; at most 10^9. `None` when it reported none.
    pub fn tokens(mut self) -> Option<u64> {
        if !self.events
            && !self.overflowed
            && contains(&self.buffer, b"\"usage\"")
            && let Ok(value) = serde_json::from_slice::<serde_json::Value>(&self.buffer)
        {
            self.read(&value);
        }
        let parts = match (self.input, self.output) {
            (None, None) => None,
            (input, output) => Some(input.unwrap_or(0).saturating_add(output.unwrap_or(0))),
        };
        self.total.or(parts).map(|t| t.min(MAX_COUNT))
    }

    fn read(&mut self, value: &serde_json::Value) {
        for usage in [
            value.get("usage"),
            value.get("message").and_then(|m| m.get("usage")),
            value.get("response").and_then(|r| r.get("usage")),
        ]
        .into_iter()
        .flatten()
        {
            let count = |field: &str| usage.get(field).and_then(serde_json::Value::as_u64);
            if let Some(total) = count("total_tokens") {
                self.total = Some(total);
            } else if let (Some(prompt), Some(completion)) =
                (count("prompt_tokens"), count("completion_tokens"))
            {
                self.total = Some(prompt.saturating_add(completion));
            }
            if let Some(input) = count("input_tokens") {
                let created = count("cache_creation_input_tokens").unwrap_or(0);
                self.input = Some(input.saturating_add(created));
            }
            if let Some(output) = count("output_tokens") {
                self.output = Some(output);
            }
        }
    }
}

/// credpool's own refusal of a relay call (`code`, with the HTTP `status` it is answered with),
/// in the error shape of `api`, so that the client's SDK reads it as it reads the provider's:
/// OpenAI's `{"error": {"message", "type", "code", "param"}}` with credpool's code as `code`;
/// Anthropic's `{"type": "error", "error": {"type", "message"}}` with credpool's code beside
/// them as `code`. The `type` is the one the provider uses for the status (`rate_limit_error`
/// for 429, `authentication_error` for 401, ...).
pub fn refusal_body(api: ApiStyle, status: u16, code: &str, message: &str) -> serde_json::Value {
    let kind = match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 if api == ApiStyle::Anthropic => "not_found_error",
        413 if api == ApiStyle::Anthropic => "request_too_large",
        429 => "rate_limit_error",
        500..=599 if api == ApiStyle::Anthropic => "api_error",
        500..=599 => "server_error",
        _ => "invalid_request_error",
    };
    match api {
        ApiStyle::OpenAi => serde_json::json!({
            "error": {"message": message, "type": kind, "code": code, "param": null}
        }),
        ApiStyle::Anthropic => serde_json::json!({
            "type": "error",
            "error": {"type": kind, "message": message, "code": code}
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base(url: &str) -> url::Url {
        url::Url::parse(url).unwrap()
    }

    #[test]
    fn a_call_keeps_the_upstreams_host_whatever_its_path_says() {
        let b = base("https://api.example.com/openai");
        let url = forward_url(&b, "/v1/chat/completions", Some("a=1")).unwrap();
        assert_eq!(
            url.as_str(),
            "https://api.example.com/openai/v1/chat/completions?a=1"
        );
        assert_eq!(
            forward_url(&base("http://127.0.0.1:9/"), "/v1/messages", None)
                .unwrap()
                .as_str(),
            "http://127.0.0.1:9/v1/messages"
        );
        for forged in [
            "//evil.example.com/v1",
            "/v1/../../admin",
            "/v1/%2e%2e/admin",
            "/v1/.%2E/admin",
            "/v1/./x",
            "/v1%2f..%2fadmin",
            "/v1/%5c..",
            "/v1\\..\\admin",
            "/@evil.example.com",
            "/v1/\u{0}",
            "/v1/..;/admin",
            "/v1 x",
            "v1",
        ] {
            match forward_url(&b, forged, None) {
                Err(e) => assert!(e.to_string().contains("path"), "{forged}: {e}"),
                Ok(url) => {
                    // a path of its own that the host keeps ("@" is a path character)
                    assert_eq!(url.host_str(), Some("api.example.com"), "{forged}");
                    assert!(url.path().starts_with("/openai/"), "{forged}: {url}");
                }
            }
        }
        assert!(forward_url(&b, "//evil.example.com/v1", None).is_err());
        assert!(forward_url(&b, "/v1/../../admin", None).is_err());
    }

    #[test]
    fn upstream_urls_are_https_or_loopback_http_without_extras() {
        let check = |url: &str| {
            UpstreamInput {
                base_url: url.into(),
                api: ApiStyle::OpenAi,
                credential_header: None,
                wait_ms: None,
                affinity_header: None,
                timeout_seconds: None,
            }
            .check(ProviderName::parse("openai").unwrap())
        };
        assert!(check("https://api.openai.com").is_ok());
        assert!(check("http://127.0.0.1:8081/v1").is_ok());
        assert!(check("http://localhost:8081").is_ok());
        for refused in [
            "http://api.openai.com",
            "https://user:pw@api.openai.com",
            "https://api.openai.com/?a=1",
            "https://api.openai.com/#x",
            "ftp://api.openai.com",
            "https://api.openai.com/\n",
        ] {
            let error = check(refused).unwrap_err().to_string();
            assert!(error.contains("base_url"), "{refused}: {error}");
        }
        let defaults = check("https://api.openai.com").unwrap();
        assert_eq!(defaults.credential_header, http::header::AUTHORIZATION);
        assert_eq!(defaults.wait_ms, DEFAULT_WAIT_MS);
        assert_eq!(defaults.timeout_seconds, DEFAULT_TIMEOUT_SECONDS);
    }

    #[test]
    fn the_credential_header_is_not_one_the_relay_strips() {
        for (header, ok) in [
            ("x-api-key", true),
            ("X-Goog-Api-Key", true),
            ("authorization", true),
            ("host", false),
            ("x-internal-key", false),
            ("x-credpool-wait-ms", false),
            ("bad header", false),
        ] {
            assert_eq!(
                header_name("credential_header", header).is_ok(),
                ok,
                "{header}"
            );
        }
    }

    #[test]
    fn outcomes_follow_the_upstreams_status() {
        assert_eq!(outcome_of(200, b""), Outcome::Success);
        assert_eq!(outcome_of(400, b""), Outcome::Success);
        assert_eq!(outcome_of(429, b"{}"), Outcome::RateLimited);
        assert_eq!(
            outcome_of(429, br#"{"error":{"code":"insufficient_quota"}}"#),
            Outcome::QuotaExhausted
        );
        assert_eq!(outcome_of(401, b""), Outcome::AuthExpired);
        assert_eq!(outcome_of(402, b""), Outcome::QuotaExhausted);
        let credit = br#"{"type":"error","error":{"type":"invalid_request_error","message":"Your credit balance is too low to access the Anthropic API."}}"#;
        assert_eq!(outcome_of(400, credit), Outcome::QuotaExhausted);
        assert_eq!(
            outcome_of(403, br#"{"error":{"code":"billing_not_active"}}"#),
            Outcome::QuotaExhausted
        );
        assert_eq!(outcome_of(529, b""), Outcome::Failure);
        assert_eq!(outcome_of(503, b""), Outcome::Failure);
    }

    #[test]
    fn retry_after_is_whole_seconds_from_either_header() {
        let mut h = http::HeaderMap::new();
        assert_eq!(retry_after_seconds(&h), None);
        h.insert("retry-after-ms", "1500".parse().unwrap());
        assert_eq!(retry_after_seconds(&h), Some(2));
        h.insert("retry-after", "30".parse().unwrap());
        assert_eq!(
            retry_after_seconds(&h),
            Some(2),
            "the milliseconds are the finer figure"
        );
        h.remove("retry-after-ms");
        assert_eq!(retry_after_seconds(&h), Some(30));
        h.insert("retry-after", "0".parse().unwrap());
        assert_eq!(retry_after_seconds(&h), Some(1));
        h.insert("retry-after", "99999999999".parse().unwrap());
        assert_eq!(retry_after_seconds(&h), Some(MAX_RETRY_AFTER_SECONDS));
    }

    #[test]
    fn usage_is_read_from_answers_and_streams_of_both_apis() {
        let mut json = UsageScanner::new(false);
        let body =
            br#"{"id":"x","usage":{"prompt_tokens":10,"completion_tokens":6,"total_tokens":16}}"#;
        json.feed(&body[..20]);
        json.feed(&body[20..]);
        assert_eq!(json.tokens(), Some(16));

        let mut anthropic = UsageScanner::new(true);
        let stream = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"usage\"}}\n\n",
            "event: message_delta\r\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":6}}\r\n\r\n",
        );
        // split anywhere, even inside an event
        for piece in stream.as_bytes().chunks(7) {
            anthropic.feed(piece);
        }
        assert_eq!(anthropic.tokens(), Some(16));

        let mut openai = UsageScanner::new(true);
        openai.feed(b"data: {\"choices\":[]}\n\ndata: {\"choices\":[],\"usage\":{\"total_tokens\":21}}\n\ndata: [DONE]\n\n");
        assert!(openai.stream_ended());
        assert_eq!(openai.tokens(), Some(21));
        assert!(anthropic_ended(stream));

        let mut none = UsageScanner::new(true);
        none.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n");
        assert!(!none.stream_ended());
        assert_eq!(none.tokens(), None);

        // an event longer than the bound is skipped, the next one still read
        let mut long = UsageScanner::new(true);
        long.feed(b"data: {\"usage\":{\"total_tokens\":5},\"pad\":\"");
        long.feed(&vec![b'a'; MAX_EVENT_BYTES + 1]);
        long.feed(b"\"}\ndata: {\"usage\":{\"total_tokens\":7}}\n");
        assert_eq!(long.tokens(), Some(7));
    }

    /// Whether `stream`, then Anthropic's last event, reads as ended (and `stream` alone not).
    fn anthropic_ended(stream: &str) -> bool {
        let mut scanner = UsageScanner::new(true);
        scanner.feed(stream.as_bytes());
        let before = scanner.stream_ended();
        scanner.feed(b"event: message_stop\ndata: {\"type\": \"message_stop\"}\n\n");
        !before && scanner.stream_ended()
    }

    #[test]
    fn refusals_take_the_shape_of_the_clients_api() {
        let openai = refusal_body(ApiStyle::OpenAi, 429, "pool_exhausted", "busy");
        assert_eq!(openai["error"]["code"], "pool_exhausted");
        assert_eq!(openai["error"]["type"], "rate_limit_error");
        let anthropic = refusal_body(ApiStyle::Anthropic, 503, "store_unavailable", "down");
        assert_eq!(anthropic["type"], "error");
        assert_eq!(anthropic["error"]["type"], "api_error");
        assert_eq!(anthropic["error"]["message"], "down");
    }

    #[test]
    fn the_credential_is_the_access_token_or_the_api_key() {
        let oauth = serde_json::json!({"access_token": "at", "expires_at": "x"});
        assert_eq!(credential_value(&oauth), Some(("at", true)));
        let key = serde_json::json!({"api_key": "sk"});
        assert_eq!(credential_value(&key), Some(("sk", false)));
        assert_eq!(credential_value(&serde_json::json!({"cookie": "c"})), None);
        assert_eq!(credential_value(&serde_json::json!({"api_key": ""})), None);
    }
}
