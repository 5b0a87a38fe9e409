//! The client crate (`credpool-client`) against the real service: the lease guard's renewal,
//! loss, finish and drop; retries that never take a second slot; waiting; fences.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use credpool_client::{Client, Error, LeaseGuard, LeaseRequest, NotReleased, Outcome};
use reqwest::StatusCode;
use serde_json::json;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

use credpool_test_support::*;

fn client_for(addr: SocketAddr) -> Client {
    Client::new(format!("http://{addr}"), INTERNAL_KEY).expect("client")
}

/// An app with credential `k1` of limit 1, and its one lease (gpt-4o from openai for
/// `lease_seconds` seconds) taken through the client.
async fn leased_through_the_client(lease_seconds: u32) -> (TestApp, LeaseGuard) {
    let app = TestApp::with_credential("k1", 1).await;
    let lease = client_for(app.addr)
        .lease(LeaseRequest::new("openai", "gpt-4o").lease_seconds(lease_seconds))
        .await
        .expect("lease");
    (app, lease)
}

async fn events_of(app: &TestApp, lease_id: &str, event: &str) -> Vec<(Option<String>,)> {
    sqlx::query_as(
        "SELECT outcome FROM lease_events WHERE lease_id = $1::text::uuid AND event = $2 ORDER BY event_id",
    )
    .bind(lease_id)
    .bind(event)
    .fetch_all(&app.db)
    .await
    .unwrap()
}

/// Polls `check` every 20 ms for up to 10 s (a bound against hanging, not a timing claim).
async fn eventually<F: std::future::Future<Output = bool>>(what: &str, check: impl Fn() -> F) {
    for _ in 0..500 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never happened: {what}");
}

#[tokio::test]
async fn the_guard_renews_past_the_lease_length_and_finish_releases_with_the_outcome() {
    let app = TestApp::with_credential("k1", 1).await;
    let client = client_for(app.addr);
    let lease = client
        .lease(
            LeaseRequest::new("openai", "gpt-4o")
                .lease_seconds(2)
                .holder("worker-1"),
        )
        .await
        .expect("lease");
    assert_eq!(lease.key_id(), "k1");
    assert_eq!(
        lease.credential().get_str("api_key"),
        Some("sk-test-k1"),
        "the credential material"
    );
    assert!(!format!("{lease:?}").contains("sk-test-k1"));
    // three lease lengths later the lease still counts, renewed by the guard (2 s leases: a
    // renewal every 0.67 s, so a loaded machine's scheduling delays do not lose it)
    tokio::time::sleep(Duration::from_millis(6_000)).await;
    assert!(!lease.is_lost());
    assert_eq!(app.in_flight("k1").await, 1, "the lease ran out");
    assert!(events_of(&app, lease.lease_id(), "renewed").await.len() >= 3);

    let lease_id = lease.lease_id().to_owned();
    let released = lease
        .finish(Outcome::RateLimited {
            retry_after: Some(Duration::from_secs(2)),
        })
        .await
        .expect("finish");
    assert!(released.released);
    assert_eq!(app.in_flight("k1").await, 0);
    assert_eq!(
        events_of(&app, &lease_id, "released").await,
        vec![(Some("rate_limited".to_owned()),)]
    );
    // the outcome reached the credential: it rests for the 2 s passed on
    let error = client
        .lease(LeaseRequest::new("openai", "gpt-4o"))
        .await
        .expect_err("resting");
    assert!(matches!(error, Error::PoolExhausted { .. }), "{error:?}");
}

#[tokio::test]
async fn lost_fires_when_an_operator_force_releases_the_lease() {
    let (app, lease) = leased_through_the_client(3).await;
    assert!(!lease.is_lost());
    let response = app.force_release(lease.lease_id(), "stuck worker").await;
    assert_eq!(response.status(), StatusCode::OK);
    // the next renewal (within a third of the lease) is refused: lost
    tokio::time::timeout(Duration::from_secs(10), lease.lost())
        .await
        .expect("lost() never fired");
    assert!(lease.is_lost());
    let released = lease.finish(Outcome::Failure).await.expect("finish");
    assert!(!released.released);
    assert_eq!(released.reason, Some(NotReleased::NotFound));
}

#[tokio::test]
async fn dropping_the_guard_releases_the_lease_with_failure() {
    let (app, lease) = leased_through_the_client(600).await;
    let lease_id = lease.lease_id().to_owned();
    drop(lease);
    eventually("the dropped guard's release", || async {
        app.in_flight("k1").await == 0
    })
    .await;
    assert_eq!(
        events_of(&app, &lease_id, "released").await,
        vec![(Some("failure".to_owned()),)]
    );
}

/// A proxy in front of the service that forwards the first connection's request but never
/// returns its answer (a timeout after the server granted), and passes later connections through.
async fn losing_first_answer_proxy(target: SocketAddr) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let seen = connections.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                return;
            };
            let first = seen.fetch_add(1, Ordering::SeqCst) == 0;
            tokio::spawn(async move {
                let Ok(mut outbound) = TcpStream::connect(target).await else {
                    return;
                };
                if first {
                    let (mut from_client, mut to_server) = (inbound, outbound);
                    let (mut read_half, mut write_half) = to_server.split();
                    let forward = tokio::io::copy(&mut from_client, &mut write_half);
                    // wait for the answer to start, then drop everything: the answer is lost
                    let mut byte = [0u8; 1];
                    tokio::select! {
                        _ = forward => {}
                        _ = read_half.read(&mut byte) => {}
                    }
                } else {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (addr, connections)
}

#[tokio::test]
async fn an_allocate_retried_after_a_lost_answer_takes_no_second_slot() {
    let app = TestApp::with_credential("k1", 5).await;
    let (proxy, connections) = losing_first_answer_proxy(app.addr).await;
    let lease = client_for(proxy)
        .lease(LeaseRequest::new("openai", "gpt-4o").lease_seconds(60))
        .await
        .expect("lease after a retry");
    assert!(connections.load(Ordering::SeqCst) >= 2, "no retry happened");
    // the server granted on the first attempt; the retry got that lease, not a second one
    assert_eq!(app.in_flight("k1").await, 1);
    let held: String = app
        .scalar(
            "SELECT lease_id::text FROM lease_slots WHERE key_id = 'k1' AND lease_id IS NOT NULL",
        )
        .await;
    assert_eq!(held.replace('-', ""), lease.lease_id());
    let grants: i64 = app
        .scalar("SELECT count(*) FROM lease_events WHERE event = 'granted'")
        .await;
    assert_eq!(grants, 1);
    assert!(lease.finish(Outcome::Success).await.unwrap().released);
}

#[tokio::test]
async fn a_waiting_lease_gets_the_slot_when_another_executor_finishes() {
    let _waiters = exclusive_waiters().await;
    let app = TestApp::with_credential("only", 1).await;
    let client = client_for(app.addr);
    let mut delays = Vec::new();
    for round in 0..10 {
        let holder = client
            .lease(LeaseRequest::new("openai", "gpt-4o").lease_seconds(60))
            .await
            .expect("lease");
        let waiting_client = client.clone();
        let waiter = tokio::spawn(async move {
            let lease = waiting_client
                .lease(
                    LeaseRequest::new("openai", "gpt-4o")
                        .lease_seconds(60)
                        .wait(Duration::from_secs(20)),
                )
                .await;
            (lease, Instant::now())
        });
        waiters_queued(&app, 1).await;
        assert!(!waiter.is_finished(), "round {round}: served while full");
        let first_fence = holder.fence();
        assert!(holder.finish(Outcome::Success).await.unwrap().released);
        let released = Instant::now();
        let (lease, served) = waiter.await.unwrap();
        let lease = lease.expect("the waiter's lease");
        assert!(lease.fence() > first_fence);
        delays.push(served.saturating_duration_since(released));
        assert!(lease.finish(Outcome::Success).await.unwrap().released);
    }
    delays.sort();
    // reported in the note, not asserted (benchmark figure)
    println!(
        "client hand-over delay (finish answered -> waiting lease returned): min {:?}, median {:?}, max {:?}",
        delays[0],
        delays[delays.len() / 2],
        delays[delays.len() - 1]
    );
}

#[tokio::test]
async fn fences_increase_and_a_release_with_a_stale_fence_is_refused() {
    let app = TestApp::with_credential("only", 1).await;
    let client = client_for(app.addr);
    let first = client
        .lease(LeaseRequest::new("openai", "gpt-4o"))
        .await
        .unwrap();
    let stale = first.fence();
    assert!(first.finish(Outcome::Success).await.unwrap().released);
    let second = client
        .lease(LeaseRequest::new("openai", "gpt-4o"))
        .await
        .unwrap();
    assert!(second.fence() > stale);
    // an executor that still holds the old fence cannot release the new holder's lease
    let answer = app
        .release(
            json!({"provider": "openai", "pool": second.pool(), "key_id": second.key_id(),
                           "lease_id": second.lease_id(), "fence": stale, "outcome": "success"}),
        )
        .ok_json()
        .await;
    assert_eq!(answer, json!({"released": false, "reason": "mismatch"}));
    assert_eq!(app.in_flight("only").await, 1);
    assert!(second.finish(Outcome::Success).await.unwrap().released);
}
