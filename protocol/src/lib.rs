//! The words credpool's HTTP API and its clients share, written once: [`ErrorCode`], every stable
//! error code an answer's body can carry (`{"error": {"code", "message"}}`), with its HTTP status
//! and whether the answer carries `Retry-After`. The service answers with these, labels its
//! metrics with them and lists them in its OpenAPI document; the Rust client reads answers with
//! them.

use serde::{Deserialize, Serialize};

macro_rules! error_codes {
    ($($(#[$doc:meta])* $variant:ident = $code:literal, $status:literal, $retry_after:literal;)*) => {
        /// A stable, snake_case error code of the API. Adding one is a change of the API: the
        /// clients learn it from this list (the Python client's test reads the OpenAPI document).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
        #[serde(rename_all = "snake_case")]
        pub enum ErrorCode {
            $($(#[$doc])* $variant,)*
        }

        impl ErrorCode {
            /// Every code, in the order of the list.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The code as the API spells it (`"pool_exhausted"`).
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $code,)*
                }
            }

            /// The HTTP status the API answers this code with.
            pub const fn status(self) -> u16 {
                match self {
                    $(ErrorCode::$variant => $status,)*
                }
            }

            /// Whether an answer with this code carries `Retry-After` (whole seconds, at least 1).
            pub const fn retry_after(self) -> bool {
                match self {
                    $(ErrorCode::$variant => $retry_after,)*
                }
            }

            /// The code spelled `code`; `None` for a code this version does not know (a newer
            /// server's).
            pub fn parse(code: &str) -> Option<Self> {
                match code {
                    $($code => Some(ErrorCode::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

error_codes! {
    /// 400: malformed body, wrong types, unknown or missing fields, values out of range.
    InvalidRequest = "invalid_request", 400, false;
    /// 400: an OAuth credential's `token_url` is neither https nor http on a loopback address,
    /// or reaches a private address the operator does not allow.
    TokenUrlNotAllowed = "token_url_not_allowed", 400, false;
    /// 401: the key is missing, wrong, unknown or revoked.
    Unauthorized = "unauthorized", 401, false;
    /// 403: a valid key, but not the one this route needs.
    Forbidden = "forbidden", 403, false;
    /// 403: the caller's tenant may not lease from this provider and pool.
    PoolNotAllowed = "pool_not_allowed", 403, false;
    /// 404 (relay): no upstream is configured for the provider.
    UpstreamNotConfigured = "upstream_not_configured", 404, false;
    /// 404: no credentials at all for the provider and pool asked for.
    PoolNotFound = "pool_not_found", 404, false;
    /// 404: no credential with this key_id.
    CredentialNotFound = "credential_not_found", 404, false;
    /// 404: no tenant with this tenant_id.
    TenantNotFound = "tenant_not_found", 404, false;
    /// 404: the tenant has no live key with this id.
    TenantKeyNotFound = "tenant_key_not_found", 404, false;
    /// 404: no such route.
    RouteNotFound = "route_not_found", 404, false;
    /// 405: the route does not take this method.
    MethodNotAllowed = "method_not_allowed", 405, false;
    /// 409: the pool has credentials but none serves the model.
    ModelNotSupported = "model_not_supported", 409, false;
    /// 409: every credential that serves the model waits for an operator.
    NoUsableCredentials = "no_usable_credentials", 409, false;
    /// 409: the allocate's `request_id` holds a live lease granted for other parameters.
    RequestIdConflict = "request_id_conflict", 409, false;
    /// 409: the `tokens` estimate is larger than a token window every candidate (or the
    /// caller's tenant) is held to: no wait can make room.
    TokensExceedBudget = "tokens_exceed_budget", 409, false;
    /// 409: the tenant cannot be deleted (it is `default`, or holds live leases).
    TenantInUse = "tenant_in_use", 409, false;
    /// 409: a PUT or import names a credential that exists under another provider (a credential
    /// keeps its provider: delete it and add it again to move it).
    ProviderChanged = "provider_changed", 409, false;
    /// 410: the lease is expired, unknown, released or does not match: stop using the credential.
    LeaseLost = "lease_lost", 410, false;
    /// 412: a PUT with `If-Match` found the credential's OAuth token at another generation.
    GenerationMoved = "generation_moved", 412, false;
    /// 413: the body is larger than the service takes.
    PayloadTooLarge = "payload_too_large", 413, false;
    /// 415: the body is not `Content-Type: application/json`.
    UnsupportedMediaType = "unsupported_media_type", 415, false;
    /// 429: candidates exist but none is free now (or none freed within `wait_ms`).
    PoolExhausted = "pool_exhausted", 429, true;
    /// 429: the caller's tenant is at its cap, or a window of its rate limits has no room.
    TenantLimit = "tenant_limit", 429, true;
    /// 500: a bug (a handler panicked) or a credential whose secret cannot be opened.
    InternalError = "internal_error", 500, false;
    /// 502 (relay): the upstream could not be reached, or failed before its answer started.
    UpstreamUnreachable = "upstream_unreachable", 502, false;
    /// 502 (relay): the leased credential's secret has neither an `api_key` nor an
    /// `access_token` to give the upstream.
    CredentialNotRelayable = "credential_not_relayable", 502, false;
    /// 503: PostgreSQL failed or did not answer in time; retry.
    StoreUnavailable = "store_unavailable", 503, false;
    /// 504 (relay): the upstream did not start its answer within its `timeout_seconds`.
    UpstreamTimeout = "upstream_timeout", 504, false;
    /// 503 (`/readyz`): a background task is restarting, or the database is unreachable, slow or
    /// not current for this version.
    NotReady = "not_ready", 503, false;
    /// 503 (`/readyz`): the service received SIGTERM and is about to stop.
    ShuttingDown = "shutting_down", 503, false;
}

/// The longest rest an outcome report may ask for (`retry_after_seconds`): 31 days, in seconds (a
/// monthly quota's reset). Longer values are a caller's bug, not a provider's answer, and would
/// rest a credential for decades: the service refuses them, the clients cut them to this.
pub const MAX_RETRY_AFTER_SECONDS: u32 = 31 * 86_400;

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_reads_back_and_serializes_as_it_is_spelled() {
        for &code in ErrorCode::ALL {
            assert_eq!(ErrorCode::parse(code.as_str()), Some(code));
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
            assert!((400..600).contains(&code.status()), "{code}");
            assert!(
                code.as_str()
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c == '_'),
                "{code} is not snake_case"
            );
        }
        assert_eq!(ErrorCode::parse("no_such_code"), None);
        let retry: Vec<_> = ErrorCode::ALL.iter().filter(|c| c.retry_after()).collect();
        assert_eq!(
            retry,
            [&ErrorCode::PoolExhausted, &ErrorCode::TenantLimit],
            "only the 429s carry Retry-After"
        );
    }
}
