//! An OAuth credential's refresh configuration, as the admin API takes it ([`OAuthInput`]) and
//! as the store keeps it ([`OAuthSpec`]). Values only: checking and sealing an input is the
//! refresher's (`crate::oauth`), which also runs the refreshes.

use serde::Deserialize;
use time::OffsetDateTime;

/// The default of `refresh_before_seconds`: refresh 300 s before the access token expires.
pub const DEFAULT_REFRESH_BEFORE_SECONDS: u32 = 300;
/// The largest `refresh_before_seconds` (one day); the database holds the same bound.
pub const MAX_REFRESH_BEFORE_SECONDS: u32 = 86_400;

/// The `oauth` object of `PUT /api/admin/keys/{key_id}`: how to refresh the credential's access
/// token (RFC 6749 section 6). Its secret must then be `{"access_token", "refresh_token",
/// "expires_at"}` (RFC 3339).
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OAuthInput {
    /// The token endpoint: `https://...`, or `http://` on a loopback address (127.0.0.0/8, ::1,
    /// `localhost`) for tests and local token proxies. Anything else is 400 `token_url_not_allowed`.
    pub token_url: String,
    /// Sent as `client_id` with every refresh.
    pub client_id: String,
    /// Sent as `client_secret` in the form body when present (client_secret_post). Sealed; never
    /// returned.
    pub client_secret: Option<String>,
    /// Sent as `scope` when present.
    pub scope: Option<String>,
    /// Seconds before the access token's expiry at which the refresh starts (0..=86,400,
    /// default 300).
    pub refresh_before_seconds: Option<u32>,
}

impl std::fmt::Debug for OAuthInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OAuthInput")
            .field("token_url", &self.token_url)
            .field("client_id", &self.client_id)
            .field("scope", &self.scope)
            .field("refresh_before_seconds", &self.refresh_before_seconds)
            .finish_non_exhaustive()
    }
}

/// An OAuth credential's configuration and sealed grant, ready to store.
#[derive(Debug, Clone)]
pub struct OAuthSpec {
    /// The checked token endpoint.
    pub token_url: String,
    /// The client id.
    pub client_id: String,
    /// The scope sent with refreshes.
    pub scope: Option<String>,
    /// Seconds before expiry at which the refresh starts.
    pub refresh_before_seconds: i32,
    /// Sealed `{"refresh_token", "client_secret"?}` (`Keyring::seal_oauth`).
    pub sealed_grant: Vec<u8>,
    /// When the access token expires.
    pub token_expires_at: OffsetDateTime,
}
