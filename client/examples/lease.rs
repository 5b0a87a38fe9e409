//! One lease, start to end: allocate a credential, use it in an upstream call while the client
//! renews the lease, and release it with the call's outcome. The Rust example of the book's
//! "Clients" chapter, which includes this file.
//!
//! Against a service that holds a credential for openai/gpt-4o in pool `default` (README
//! Quickstart, steps 3 to 5):
//!
//! ```sh
//! CREDPOOL_INTERNAL_KEY=... cargo run -p credpool-client --example lease
//! ```
//!
//! `CREDPOOL_URL` names another service than http://127.0.0.1:8080. The upstream call is a
//! stand-in defined below: replace it with your SDK's.

use std::time::Duration;

use credpool_client::{Client, LeaseRequest, Outcome};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("CREDPOOL_URL").unwrap_or_else(|_| "http://127.0.0.1:8080".into());
    let internal_key =
        std::env::var("CREDPOOL_INTERNAL_KEY").map_err(|_| "set CREDPOOL_INTERNAL_KEY")?;

    let client = Client::new(url, internal_key)?;
    let lease = client
        .lease(
            LeaseRequest::new("openai", "gpt-4o")
                .holder("worker-7")
                .wait(Duration::from_secs(5)),
        )
        .await?; // Err(Error::PoolExhausted { retry_after }) when nothing freed within 5 s
    let api_key = lease.credential().get_str("api_key").unwrap_or_default();
    let outcome = tokio::select! {
        () = lease.lost() => Outcome::Failure, // force-released or expired: stop at once
        result = call_upstream(api_key, lease.fence()) => match result {
            Ok(answer) => {
                println!("{answer}");
                Outcome::Success
            }
            Err(e) if e.is_rate_limit() => Outcome::RateLimited { retry_after: e.retry_after() },
            Err(_) => Outcome::Failure,
        },
    };
    let released = lease.finish(outcome).await?;
    println!("released: {}", released.released);
    Ok(())
}

/// A stand-in for the upstream call made with the leased credential (an LLM request, say). It
/// gets the lease's fence to pass on where a downstream can refuse a stale holder.
async fn call_upstream(api_key: &str, fence: u64) -> Result<String, UpstreamError> {
    tokio::time::sleep(Duration::from_millis(100)).await;
    if api_key.is_empty() {
        return Err(UpstreamError::Refused);
    }
    Ok(format!("the upstream answered (fence {fence})"))
}

/// What the stand-in upstream fails with, shaped like an SDK's error.
#[derive(Debug)]
enum UpstreamError {
    /// 429, with the upstream's Retry-After if it sent one.
    #[allow(dead_code)] // the stand-in never rate-limits; a real upstream does
    RateLimited { retry_after: Option<Duration> },
    /// Anything else.
    Refused,
}

impl UpstreamError {
    fn is_rate_limit(&self) -> bool {
        matches!(self, Self::RateLimited { .. })
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::RateLimited { retry_after } => *retry_after,
            Self::Refused => None,
        }
    }
}
