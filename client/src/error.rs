//! [`Error`], the one error type of the client, and how an HTTP answer that is not a success
//! becomes one.

use std::fmt;
use std::time::Duration;

use credpool_protocol::ErrorCode;

/// Everything a call to credpool can fail with.
///
/// API errors carry one variant per stable error code of the executor API (the HTTP status and
/// code are in each variant's doc). Neither `Display` nor `Debug` ever contains the internal key
/// or credential material: server messages are passed on with the internal key scrubbed, and
/// malformed answers are described by shape, never by content.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// 400 `invalid_request`: the server refused the request as malformed (a name out of its
    /// character set, `lease_seconds` out of range, ...). Fix the caller; retrying will not help.
    #[error("credpool refused the request as malformed: {message}")]
    InvalidRequest {
        /// The server's explanation.
        message: String,
    },
    /// 401 `unauthorized`: missing or wrong internal key.
    #[error("credpool refused the internal key (401 unauthorized)")]
    Unauthorized,
    /// 403 `forbidden`: the key is valid but not for this route (for example the admin key).
    #[error("credpool refused this key for this route (403 forbidden)")]
    Forbidden,
    /// 403 `pool_not_allowed`: the tenant of the client's key may not lease from this provider and
    /// pool (its `pools`); an operator adds the pool to the tenant. Retrying will not help.
    #[error("this key's tenant may not lease from this provider and pool (403 pool_not_allowed)")]
    PoolNotAllowed,
    /// 404 `pool_not_found`: no credentials at all for this provider and pool.
    #[error("credpool has no credentials for this provider and pool (404 pool_not_found)")]
    PoolNotFound,
    /// 409 `model_not_supported`: the pool exists but no credential in it serves the model.
    #[error("no credential in the pool serves this model (409 model_not_supported)")]
    ModelNotSupported,
    /// 409 `no_usable_credentials`: every credential that serves the model waits for an operator
    /// (disabled, exhausted). Switch pool or model, and alert.
    #[error(
        "every credential that serves this model waits for an operator (409 no_usable_credentials)"
    )]
    NoUsableCredentials,
    /// 409 `request_id_conflict`: the same `request_id` came with different parameters.
    #[error("credpool saw this request id with different parameters (409 request_id_conflict)")]
    RequestIdConflict,
    /// 409 `tokens_exceed_budget`: the `tokens` estimate is larger than a token window of every
    /// credential that serves the model; no wait can make room.
    #[error(
        "the token estimate exceeds every credential's token window (409 tokens_exceed_budget)"
    )]
    TokensExceedBudget,
    /// 410 `lease_lost`: the lease expired, was released or force-released, or the ids or fence do
    /// not match. Stop using the credential.
    #[error("the lease is lost: stop using the credential (410 lease_lost)")]
    LeaseLost,
    /// 413 `payload_too_large`: the request body is over the server's limit.
    #[error("credpool refused the request body as too large (413 payload_too_large)")]
    PayloadTooLarge,
    /// 415 `unsupported_media_type`: the request was not sent as JSON.
    #[error("credpool refused the request's content type (415 unsupported_media_type)")]
    UnsupportedMediaType,
    /// 429 `pool_exhausted`: candidates exist but none is free now (and the wait, if any, is used
    /// up). `retry_after` is the server's `Retry-After` (whole seconds, at least 1 s; 1 s when the
    /// header is missing or not a number of seconds).
    #[error("every credential of the pool is busy or cooling down; retry after {} s (429 pool_exhausted)", retry_after.as_secs())]
    PoolExhausted {
        /// When a slot may free, from the server's `Retry-After`.
        retry_after: Duration,
    },
    /// 429 `tenant_limit`: the tenant of the client's key holds as many leases as its cap allows,
    /// or a window of its `rate_limits` has no room (whatever the pool has free). `retry_after` is
    /// the server's `Retry-After`: until the first of the tenant's own leases ends, or its window
    /// has room (1 s when the header is missing).
    #[error("this key's tenant is at its cap or out of window room; retry after {} s (429 tenant_limit)", retry_after.as_secs())]
    TenantLimit {
        /// When the tenant may be served again, from the server's `Retry-After`.
        retry_after: Duration,
    },
    /// 500 `internal_error`: a bug on the server. Not retried.
    #[error("credpool failed internally (500 internal_error): {message}")]
    Internal {
        /// The server's explanation.
        message: String,
    },
    /// 503 `store_unavailable`: the server's database is unreachable or slow. The client retries
    /// these with backoff; this error means the retries gave up.
    #[error("credpool's store is unavailable (503 store_unavailable), and retries gave up")]
    StoreUnavailable,
    /// 404 `route_not_found`: the base URL does not point at a credpool, or at the wrong path.
    #[error("credpool does not know this route (404 route_not_found): check the base URL")]
    RouteNotFound,
    /// 405 `method_not_allowed`: the route exists but not for POST; check the base URL.
    #[error("credpool does not allow this method on the route (405 method_not_allowed)")]
    MethodNotAllowed,
    /// An error body in credpool's shape with a code this client does not know.
    #[error("credpool answered {status} {code}: {message}")]
    Api {
        /// The HTTP status.
        status: u16,
        /// The stable error code.
        code: String,
        /// The server's explanation.
        message: String,
    },
    /// The request did not get an answer from credpool: connect error, timeout, connection reset,
    /// or a 502/503/504 from a proxy without a credpool error body. The client retries these with
    /// backoff; this error means the retries gave up.
    #[error("could not reach credpool: {0}")]
    Transport(#[source] TransportError),
    /// An answer that does not follow the protocol: a success body that is not JSON or lacks a
    /// field, a malformed `lease_id`, `lease_until` or `lease_seconds`, an error body without a
    /// code. `detail` says what was wrong, never what the body held.
    #[error("credpool answered {status} with a body that does not follow the protocol: {detail}")]
    UnexpectedResponse {
        /// The HTTP status.
        status: u16,
        /// What was wrong with the body.
        detail: String,
    },
    /// The client was built or called with settings it cannot use (a base URL that is not
    /// `http://`, an empty internal key, a lease outside a tokio runtime, ...).
    #[error("invalid client configuration: {message}")]
    InvalidConfig {
        /// What is wrong.
        message: String,
    },
}

impl Error {
    /// The API's stable error code (`"pool_exhausted"`, ...), or `None` for errors that did not
    /// come from a credpool error body (transport, malformed answers, configuration).
    pub fn code(&self) -> Option<&str> {
        let code = match self {
            Error::InvalidRequest { .. } => ErrorCode::InvalidRequest,
            Error::Unauthorized => ErrorCode::Unauthorized,
            Error::Forbidden => ErrorCode::Forbidden,
            Error::PoolNotAllowed => ErrorCode::PoolNotAllowed,
            Error::PoolNotFound => ErrorCode::PoolNotFound,
            Error::ModelNotSupported => ErrorCode::ModelNotSupported,
            Error::NoUsableCredentials => ErrorCode::NoUsableCredentials,
            Error::RequestIdConflict => ErrorCode::RequestIdConflict,
            Error::TokensExceedBudget => ErrorCode::TokensExceedBudget,
            Error::LeaseLost => ErrorCode::LeaseLost,
            Error::PayloadTooLarge => ErrorCode::PayloadTooLarge,
            Error::UnsupportedMediaType => ErrorCode::UnsupportedMediaType,
            Error::PoolExhausted { .. } => ErrorCode::PoolExhausted,
            Error::TenantLimit { .. } => ErrorCode::TenantLimit,
            Error::Internal { .. } => ErrorCode::InternalError,
            Error::StoreUnavailable => ErrorCode::StoreUnavailable,
            Error::RouteNotFound => ErrorCode::RouteNotFound,
            Error::MethodNotAllowed => ErrorCode::MethodNotAllowed,
            Error::Api { code, .. } => return Some(code),
            Error::Transport(_)
            | Error::UnexpectedResponse { .. }
            | Error::InvalidConfig { .. } => {
                return None;
            }
        };
        Some(code.as_str())
    }

    /// True when the same call may succeed if made again later: [`Error::PoolExhausted`] (after
    /// `retry_after`), [`Error::StoreUnavailable`] and [`Error::Transport`]. The client has
    /// already retried the last two for as long as its retry policy allows.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::PoolExhausted { .. } | Error::StoreUnavailable | Error::Transport(_)
        )
    }

    /// True for the failures the client itself retries with backoff: a 503 and a transport error
    /// may not have reached the store, and every request is safe to repeat (allocate carries a
    /// `request_id`; renew and release are idempotent).
    pub(crate) fn retried_by_client(&self) -> bool {
        match self {
            Error::StoreUnavailable => true,
            Error::Transport(transport) => transport.kind != TransportKind::Other,
            _ => false,
        }
    }
}

/// What went wrong below HTTP: see [`TransportError::kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportKind {
    /// The connection could not be made (refused, unreachable, DNS).
    Connect,
    /// No answer within the request's timeout.
    Timeout,
    /// The connection broke while the request or the answer was under way (reset, closed).
    Connection,
    /// A 502, 503 or 504 without a credpool error body: a proxy or load balancer answered.
    Gateway {
        /// The HTTP status.
        status: u16,
    },
    /// Anything else (the request could not be built); not retried.
    Other,
}

/// A request that got no answer from credpool. Its source, if any, is the HTTP library's error
/// with the URL removed; nothing in it holds request headers, so the internal key cannot show.
pub struct TransportError {
    kind: TransportKind,
    source: Option<reqwest::Error>,
}

impl TransportError {
    /// What went wrong.
    pub fn kind(&self) -> TransportKind {
        self.kind
    }

    pub(crate) fn from_reqwest(error: reqwest::Error) -> Self {
        let kind = if error.is_timeout() {
            TransportKind::Timeout
        } else if error.is_connect() {
            TransportKind::Connect
        } else if error.is_request() || error.is_body() || error.is_decode() {
            TransportKind::Connection
        } else {
            TransportKind::Other
        };
        Self {
            kind,
            source: Some(error.without_url()),
        }
    }

    pub(crate) fn gateway(status: u16) -> Self {
        Self {
            kind: TransportKind::Gateway { status },
            source: None,
        }
    }
}

impl fmt::Display for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            TransportKind::Connect => f.write_str("could not connect")?,
            TransportKind::Timeout => f.write_str("timed out")?,
            TransportKind::Connection => f.write_str("the connection failed mid-request")?,
            TransportKind::Gateway { status } => {
                write!(f, "HTTP {status} from a proxy (no credpool error body)")?
            }
            TransportKind::Other => f.write_str("the request failed")?,
        }
        // The HTTP library's own message is generic ("error sending request"); the innermost
        // cause ("Connection refused (os error 111)") is the useful part.
        if let Some(source) = &self.source {
            let mut innermost: &dyn std::error::Error = source;
            while let Some(next) = innermost.source() {
                innermost = next;
            }
            write!(f, " ({innermost})")?;
        }
        Ok(())
    }
}

impl fmt::Debug for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransportError")
            .field("kind", &self.kind)
            .field("source", &self.source)
            .finish()
    }
}

impl std::error::Error for TransportError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// The error an answer other than 200 stands for. `retry_after` is the raw `Retry-After` header;
/// `body` the raw body. Server messages go through `scrub` (which removes the internal key) before
/// they are kept.
pub(crate) fn from_answer(
    status: u16,
    retry_after: Option<&str>,
    body: &[u8],
    scrub: impl Fn(String) -> String,
) -> Error {
    let Some((code, message)) = crate::wire::parse_error_body(body) else {
        if matches!(status, 502..=504) {
            return Error::Transport(TransportError::gateway(status));
        }
        return Error::UnexpectedResponse {
            status,
            detail: "the body is not a credpool error (`{\"error\":{\"code\",\"message\"}}`)"
                .into(),
        };
    };
    match ErrorCode::parse(&code) {
        Some(ErrorCode::InvalidRequest) => Error::InvalidRequest {
            message: scrub(message),
        },
        Some(ErrorCode::Unauthorized) => Error::Unauthorized,
        Some(ErrorCode::Forbidden) => Error::Forbidden,
        Some(ErrorCode::PoolNotAllowed) => Error::PoolNotAllowed,
        Some(ErrorCode::PoolNotFound) => Error::PoolNotFound,
        Some(ErrorCode::ModelNotSupported) => Error::ModelNotSupported,
        Some(ErrorCode::NoUsableCredentials) => Error::NoUsableCredentials,
        Some(ErrorCode::RequestIdConflict) => Error::RequestIdConflict,
        Some(ErrorCode::TokensExceedBudget) => Error::TokensExceedBudget,
        Some(ErrorCode::LeaseLost) => Error::LeaseLost,
        Some(ErrorCode::PayloadTooLarge) => Error::PayloadTooLarge,
        Some(ErrorCode::UnsupportedMediaType) => Error::UnsupportedMediaType,
        Some(ErrorCode::PoolExhausted) => Error::PoolExhausted {
            retry_after: crate::wire::retry_after(retry_after),
        },
        Some(ErrorCode::TenantLimit) => Error::TenantLimit {
            retry_after: crate::wire::retry_after(retry_after),
        },
        Some(ErrorCode::InternalError) => Error::Internal {
            message: scrub(message),
        },
        Some(ErrorCode::StoreUnavailable) => Error::StoreUnavailable,
        Some(ErrorCode::RouteNotFound) => Error::RouteNotFound,
        Some(ErrorCode::MethodNotAllowed) => Error::MethodNotAllowed,
        // the operator routes' codes, the probes', the relay's (which this client never calls),
        // and a newer server's: passed on as they came
        Some(
            ErrorCode::UpstreamNotConfigured
            | ErrorCode::UpstreamUnreachable
            | ErrorCode::CredentialNotRelayable
            | ErrorCode::UpstreamTimeout
            | ErrorCode::TokenUrlNotAllowed
            | ErrorCode::CredentialNotFound
            | ErrorCode::TenantNotFound
            | ErrorCode::TenantKeyNotFound
            | ErrorCode::TenantInUse
            | ErrorCode::GenerationMoved
            | ErrorCode::ProviderChanged
            | ErrorCode::NotReady
            | ErrorCode::ShuttingDown,
        )
        | None => Error::Api {
            status,
            code: scrub(code),
            message: scrub(message),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, body: &str) -> Error {
        from_answer(status, None, body.as_bytes(), |m| m)
    }

    #[test]
    fn known_codes_map_to_their_variants() {
        let body = |code: &str| format!(r#"{{"error":{{"code":"{code}","message":"m"}}}}"#);
        assert!(
            matches!(answer(400, &body("invalid_request")), Error::InvalidRequest { message } if message == "m")
        );
        assert!(matches!(answer(410, &body("lease_lost")), Error::LeaseLost));
        let not_allowed = answer(403, &body("pool_not_allowed"));
        assert!(matches!(not_allowed, Error::PoolNotAllowed));
        assert_eq!(not_allowed.code(), Some("pool_not_allowed"));
        assert!(matches!(
            answer(503, &body("store_unavailable")),
            Error::StoreUnavailable
        ));
        assert!(matches!(
            answer(404, &body("route_not_found")),
            Error::RouteNotFound
        ));
        assert!(
            matches!(answer(418, &body("teapot")), Error::Api { status: 418, code, .. } if code == "teapot")
        );
    }

    #[test]
    fn gateway_answers_without_a_credpool_body_are_transport_errors() {
        for status in [502, 503, 504] {
            let error = answer(status, "<html>Bad Gateway</html>");
            assert!(error.retried_by_client(), "{status}: {error:?}");
            assert!(matches!(error, Error::Transport(_)));
        }
        let error = answer(500, "<html>oops</html>");
        assert!(matches!(
            error,
            Error::UnexpectedResponse { status: 500, .. }
        ));
        assert!(!error.retried_by_client());
    }

    #[test]
    fn tenant_limit_is_its_own_error_with_its_retry_after() {
        let body = br#"{"error":{"code":"tenant_limit","message":"at its cap"}}"#;
        let error = from_answer(429, Some("7"), body, |m| m);
        assert!(
            matches!(error, Error::TenantLimit { retry_after } if retry_after == Duration::from_secs(7)),
            "{error:?}"
        );
        assert_eq!(error.code(), Some("tenant_limit"));
    }

    #[test]
    fn pool_exhausted_reads_retry_after_or_falls_back_to_one_second() {
        let body = br#"{"error":{"code":"pool_exhausted","message":"busy"}}"#;
        let of = |header| match from_answer(429, header, body, |m| m) {
            Error::PoolExhausted { retry_after } => retry_after,
            other => panic!("{other:?}"),
        };
        assert_eq!(of(Some("7")), Duration::from_secs(7));
        assert_eq!(of(Some(" 3 ")), Duration::from_secs(3));
        assert_eq!(of(Some("0")), Duration::from_secs(1));
        assert_eq!(of(Some("soon")), Duration::from_secs(1));
        assert_eq!(
            of(Some("Wed, 21 Oct 2015 07:28:00 GMT")),
            Duration::from_secs(1)
        );
        assert_eq!(of(None), Duration::from_secs(1));
    }

    #[test]
    fn every_code_of_the_api_reads_back_as_itself() {
        for &code in ErrorCode::ALL {
            let body = format!(r#"{{"error":{{"code":"{code}","message":"m"}}}}"#);
            let error = from_answer(code.status(), Some("1"), body.as_bytes(), |m| m);
            assert_eq!(error.code(), Some(code.as_str()), "{error:?}");
        }
    }

    #[test]
    fn codes_round_trip() {
        assert_eq!(Error::LeaseLost.code(), Some("lease_lost"));
        assert_eq!(
            Error::PoolExhausted {
                retry_after: Duration::from_secs(1)
            }
            .code(),
            Some("pool_exhausted")
        );
        assert_eq!(
            Error::UnexpectedResponse {
                status: 200,
                detail: String::new()
            }
            .code(),
            None
        );
    }
}
