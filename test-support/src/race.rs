//! Allocations raced against each other: every racer waits at one barrier, then all send at
//! once, spread over the replicas of one database.

use std::sync::Arc;

use reqwest::StatusCode;
use serde_json::Value;
use tokio::sync::Barrier;

use crate::service::{Remote, Service};

/// What one racer's allocate was answered.
#[derive(Debug)]
pub struct Raced {
    /// The status.
    pub status: StatusCode,
    /// `Retry-After`, in seconds, when the answer has one.
    pub retry_after: Option<u64>,
    /// The JSON body (`null` when the body is not JSON).
    pub body: Value,
    /// The body as it came.
    pub text: String,
}

/// Sends every allocate body of `bodies` at once with executor key `key`: the i-th through
/// `replicas[i % replicas.len()]`, all released by one barrier. The answers, in the order of
/// `bodies`.
pub async fn allocate_at_once(replicas: &[Remote], key: &str, bodies: Vec<Value>) -> Vec<Raced> {
    let barrier = Arc::new(Barrier::new(bodies.len()));
    let racers: Vec<_> = bodies
        .into_iter()
        .enumerate()
        .map(|(i, body)| {
            let (replica, key) = (replicas[i % replicas.len()].clone(), key.to_owned());
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                let response = replica.allocate_as(&key, body).await;
                let status = response.status();
                let retry_after = response
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
                let text = response.text().await.unwrap_or_default();
                let body = serde_json::from_str(&text).unwrap_or(Value::Null);
                Raced {
                    status,
                    retry_after,
                    body,
                    text,
                }
            })
        })
        .collect();
    let mut answers = Vec::new();
    for racer in racers {
        answers.push(racer.await.expect("a racer panicked"));
    }
    answers
}
