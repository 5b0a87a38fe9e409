//! Client for credpool's executor API: lease an upstream credential, keep the lease renewed
//! while the work runs, release it with the outcome of the upstream call.
//!
//! ```no_run
//! use std::time::Duration;
//! use credpool_client::{Client, LeaseRequest, Outcome};
//!
//! # async fn call_upstream(_api_key: &str, _fence: u64) {}
//! # async fn run() -> Result<(), credpool_client::Error> {
//! let client = Client::new("http://127.0.0.1:8080", "internal-key")?;
//! let lease = client
//!     .lease(LeaseRequest::new("openai", "gpt-4o").wait(Duration::from_secs(5)))
//!     .await?;
//! let api_key = lease.credential().get_str("api_key").unwrap_or_default().to_owned();
//! let outcome = tokio::select! {
//!     // Another executor may hold the slot now: stop using the credential.
//!     () = lease.lost() => Outcome::Failure,
//!     () = call_upstream(&api_key, lease.fence()) => Outcome::Success,
//! };
//! lease.finish(outcome).await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//! From the top down (each module uses only those below it):
//! - `lease`: [`Client::lease`], [`LeaseGuard`] and its background renewal task.
//! - `client`: [`Client`], [`ClientBuilder`], [`RetryPolicy`]; the allocate, renew and release
//!   calls and their retries (capped exponential backoff with jitter, from `backon`).
//! - `error`: [`Error`], one variant per API error code, and how an answer becomes one.
//! - `wire`: the JSON bodies, and parsing that names a bad field without quoting its value.
//! - `api`: what the API takes and answers: [`LeaseRequest`], [`Credential`], [`Outcome`],
//!   [`Released`], and the state a guard shares with the client's calls.
//!
//! # TLS
//! This crate is built without TLS (`reqwest` with `default-features = false`): the only TLS
//! backend `reqwest` 0.13 offers out of the box (`rustls`) builds `aws-lc-sys` with cmake. Reach
//! credpool over `http://` on a trusted network or through a TLS-terminating sidecar;
//! `https://` base URLs are refused with [`Error::InvalidConfig`].
//!
//! # Secrets
//! Neither the internal key nor credential material appears in any `Debug` or `Display` output
//! of this crate, nor in its logs (`tracing`, at debug and warn level).

mod api;
mod client;
mod error;
mod lease;
mod wire;

pub use api::{
    AffinityMode, AffinityResult, Credential, DEFAULT_LEASE_SECONDS, LeaseRequest,
    MAX_RETRY_AFTER_SECONDS, NotReleased, Outcome, Released,
};
pub use client::{Client, ClientBuilder, RetryPolicy};
pub use error::{Error, TransportError, TransportKind};
pub use lease::LeaseGuard;
pub use time::OffsetDateTime;
pub use tokio_util::sync::CancellationToken;
