//! A toy executor: N tasks that each lease a credential, make a fake upstream call with it and
//! release it with the outcome, for a while; then a summary.
//!
//! ```sh
//! CREDPOOL_INTERNAL_KEY=... cargo run -p credpool-client --example executor
//! ```
//!
//! Environment (defaults in brackets): `CREDPOOL_URL` [http://127.0.0.1:8080],
//! `CREDPOOL_INTERNAL_KEY` (required), `CREDPOOL_PROVIDER` [openai], `CREDPOOL_MODEL`
//! [gpt-4o-mini], `CREDPOOL_POOL` [the server's default], `CREDPOOL_TASKS` [8],
//! `CREDPOOL_DURATION_SECONDS` [30], `CREDPOOL_LEASE_SECONDS` [10], `CREDPOOL_WAIT_SECONDS` [3].
//!
//! The fake upstream call sleeps 50-500 ms; one call in ten answers "429" (reported as
//! `rate_limited` with the upstream's Retry-After), one in twenty fails, and one in ten runs for
//! 1.5 lease lengths, so it lives on renewals and stops early if the lease is lost.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use credpool_client::{Client, Error, LeaseRequest, Outcome};
use tokio::time::Instant;

#[derive(Debug, Default)]
struct Summary {
    leases: u64,
    outcomes: BTreeMap<&'static str, u64>,
    not_released: u64,
    lost: u64,
    errors: BTreeMap<String, u64>,
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn env_number(name: &str, default: u64) -> Result<u64, String> {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .map_err(|_| format!("{name} must be a whole number, not {value:?}")),
        Err(_) => Ok(default),
    }
}

/// The error's API code, or a name for errors that have none.
fn kind(error: &Error) -> String {
    match (error.code(), error) {
        (Some(code), _) => code.to_owned(),
        (None, Error::Transport(_)) => "transport".into(),
        (None, Error::UnexpectedResponse { .. }) => "unexpected_response".into(),
        (None, _) => "other".into(),
    }
}

/// A pretend upstream call with the credential; what happened, as the outcome to report.
async fn fake_upstream_call(_api_key: &str, lease_seconds: u64) -> Outcome {
    let roll = fastrand::u32(0..100);
    if roll < 10 {
        // Outlives the lease: only renewals keep it.
        tokio::time::sleep(Duration::from_millis(lease_seconds * 1500)).await;
        return Outcome::Success;
    }
    tokio::time::sleep(Duration::from_millis(fastrand::u64(50..=500))).await;
    match roll {
        10..20 => Outcome::RateLimited {
            retry_after: Some(Duration::from_secs(fastrand::u64(1..=20))),
        },
        20..25 => Outcome::Failure,
        _ => Outcome::Success,
    }
}

fn outcome_name(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Success => "success",
        Outcome::Failure => "failure",
        Outcome::RateLimited { .. } => "rate_limited",
        Outcome::AuthError => "auth_error",
        Outcome::AuthExpired => "auth_expired",
        Outcome::QuotaExhausted { .. } => "quota_exhausted",
    }
}

async fn work(
    client: Client,
    request: LeaseRequest,
    lease_seconds: u64,
    until: Instant,
    summary: Arc<Mutex<Summary>>,
) {
    let note = |update: &dyn Fn(&mut Summary)| {
        update(&mut summary.lock().unwrap_or_else(|e| e.into_inner()));
    };
    while Instant::now() < until {
        let lease = match client.lease(request.clone()).await {
            Ok(lease) => lease,
            Err(error) => {
                note(&|s| *s.errors.entry(kind(&error)).or_default() += 1);
                let pause = match error {
                    Error::PoolExhausted { retry_after } => retry_after.min(Duration::from_secs(1)),
                    _ => Duration::from_millis(500),
                };
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        note(&|s| s.leases += 1);
        let api_key = lease
            .credential()
            .get_str("api_key")
            .unwrap_or_default()
            .to_owned();
        let outcome = tokio::select! {
            () = lease.lost() => {
                note(&|s| s.lost += 1);
                Outcome::Failure
            }
            outcome = fake_upstream_call(&api_key, lease_seconds) => outcome,
        };
        let name = outcome_name(&outcome);
        match lease.finish(outcome).await {
            Ok(released) => note(&|s| {
                *s.outcomes.entry(name).or_default() += 1;
                if !released.released {
                    s.not_released += 1;
                }
            }),
            Err(error) => note(&|s| *s.errors.entry(kind(&error)).or_default() += 1),
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = env_or("CREDPOOL_URL", "http://127.0.0.1:8080");
    let key = std::env::var("CREDPOOL_INTERNAL_KEY").map_err(|_| "set CREDPOOL_INTERNAL_KEY")?;
    let tasks = env_number("CREDPOOL_TASKS", 8)?;
    let duration = Duration::from_secs(env_number("CREDPOOL_DURATION_SECONDS", 30)?);
    let lease_seconds = env_number("CREDPOOL_LEASE_SECONDS", 10)?;
    let wait = Duration::from_secs(env_number("CREDPOOL_WAIT_SECONDS", 3)?);

    let client = Client::new(url, key)?;
    let mut request = LeaseRequest::new(
        env_or("CREDPOOL_PROVIDER", "openai"),
        env_or("CREDPOOL_MODEL", "gpt-4o-mini"),
    )
    .lease_seconds(u32::try_from(lease_seconds)?)
    .wait(wait);
    if let Ok(pool) = std::env::var("CREDPOOL_POOL") {
        request = request.pool(pool);
    }

    println!(
        "{tasks} tasks for {} s against {client:?}, {request:?}",
        duration.as_secs()
    );
    let summary = Arc::new(Mutex::new(Summary::default()));
    let until = Instant::now() + duration;
    let workers: Vec<_> = (0..tasks)
        .map(|n| {
            let request = request.clone().holder(format!("example-executor-{n}"));
            tokio::spawn(work(
                client.clone(),
                request,
                lease_seconds,
                until,
                summary.clone(),
            ))
        })
        .collect();
    for worker in workers {
        worker.await?;
    }

    let summary = summary.lock().unwrap_or_else(|e| e.into_inner());
    println!("leases:       {}", summary.leases);
    println!("outcomes:     {:?}", summary.outcomes);
    println!("not released: {}", summary.not_released);
    println!("lost:         {}", summary.lost);
    println!("errors:       {:?}", summary.errors);
    Ok(())
}
