//! Scenario 8, duplicate and late calls: an executor that retries a release (or several of its
//! threads release the same lease at once), and a heartbeat that arrives while the release is in
//! flight. A lease is released exactly once, its slot is freed exactly once (capacity never
//! grows or shrinks), and a renewal never brings a released lease back.

use std::sync::Arc;

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::sync::Barrier;

use credpool_test_support::*;

/// How many copies of one release race each other.
const DUPLICATES: usize = 16;

/// The limit of the credential whose capacity the duplicate releases must not change.
const LIMIT: usize = 3;

/// Rounds of the renew-versus-release race: `CREDPOOL_RACE_ROUNDS` when set, else 200.
fn renew_release_rounds() -> usize {
    env_number("CREDPOOL_RACE_ROUNDS", 200)
}

fn request(pool: &str) -> Value {
    json!({"provider": "openai", "model": "gpt-4o", "pool": pool, "lease_seconds": 600,
           "holder": "late-caller"})
}

/// Takes every slot of `pool`'s single credential of limit `limit`: exactly `limit` grants, then
/// 429 `pool_exhausted`.
async fn fill(app: &TestApp, pool: &str, limit: usize) -> Vec<Value> {
    let mut leases = Vec::new();
    for _ in 0..limit {
        leases.push(app.lease(request(pool)).await);
    }
    app.allocate(request(pool))
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    leases
}

/// How many `lease_slots` rows hold `lease_id`.
async fn slots_holding(app: &TestApp, lease_id: &str) -> i64 {
    app.scalar_of(
        "SELECT count(*) FROM lease_slots WHERE lease_id = $1::text::uuid",
        lease_id,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_parallel_releases_of_one_lease_release_it_once_and_keep_capacity() {
    let app = Arc::new(TestApp::spawn().await);
    app.put_key("key-n", "openai", "dup", &["gpt-4o"], LIMIT as u32)
        .await;
    let rounds = (race_rounds() / 3).max(1);
    for round in 0..rounds {
        let leases = fill(&app, "dup", LIMIT).await;
        let victim = &leases[round % LIMIT];
        let start = Arc::new(Barrier::new(DUPLICATES));
        let answers = futures::future::join_all((0..DUPLICATES).map(|_| {
            let (app, start) = (app.clone(), start.clone());
            let body = release_body(victim, "success");
            tokio::spawn(async move {
                start.wait().await;
                app.release(body).ok_json().await
            })
        }))
        .await;
        let answers: Vec<Value> = answers.into_iter().map(Result::unwrap).collect();
        let released = answers.iter().filter(|a| a["released"] == true).count();
        assert_eq!(released, 1, "round {round}: {answers:?}");
        for answer in answers.iter().filter(|a| a["released"] != true) {
            assert_eq!(
                *answer,
                json!({"released": false, "reason": "not_found"}),
                "round {round}"
            );
        }
        // one release in the trail (so the outcome counted once), and one slot freed
        let lease_id = victim["lease_id"].as_str().unwrap();
        assert_eq!(
            app.events(lease_id).await,
            ["granted", "released"],
            "round {round}"
        );
        assert_eq!(
            app.in_flight("key-n").await,
            LIMIT as i64 - 1,
            "round {round}"
        );
        for other in leases
            .iter()
            .filter(|l| l["lease_id"] != victim["lease_id"])
        {
            let answer = json_body(
                app.release(release_body(other, "success")).await,
                StatusCode::OK,
            );
            assert_eq!(answer.await, json!({"released": true}), "round {round}");
        }
        assert_eq!(app.in_flight("key-n").await, 0, "round {round}");
    }
    // after every round, the credential still grants exactly its limit
    fill(&app, "dup", LIMIT).await;
}

/// What the heartbeat got while the release was in flight.
#[derive(Debug, PartialEq)]
enum Renewal {
    /// 200: it ran before the release.
    Renewed,
    /// 410 `lease_lost`: it ran after.
    Lost,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_renewal_racing_the_release_never_brings_the_lease_back() {
    let app = Arc::new(TestApp::spawn().await);
    app.put_gpt4o_key("key-1", "late", 1).await;
    let (mut renewed, mut lost) = (0, 0);
    for round in 0..renew_release_rounds() {
        // the slot is free: the limit-1 credential grants a lease
        let lease = app.lease(request("late")).await;
        let lease_id = lease["lease_id"].as_str().unwrap().to_owned();
        let renewal_body = renew_body(&lease, 600);

        let start = Arc::new(Barrier::new(2));
        let renew = tokio::spawn({
            let (app, start, body) = (app.clone(), start.clone(), renewal_body.clone());
            async move {
                start.wait().await;
                let response = app.renew(body).await;
                if response.status() == StatusCode::OK {
                    json_body(response, StatusCode::OK).await;
                    Renewal::Renewed
                } else {
                    assert_error(response, StatusCode::GONE, "lease_lost").await;
                    Renewal::Lost
                }
            }
        });
        let release = tokio::spawn({
            let (app, start, body) = (app.clone(), start.clone(), release_body(&lease, "success"));
            async move {
                start.wait().await;
                app.release(body).ok_json().await
            }
        });
        let (renewal, released) = (renew.await.unwrap(), release.await.unwrap());
        assert_eq!(released, json!({"released": true}), "round {round}");

        // the trail agrees with what the heartbeat was told: renewed before the release, or not
        // at all
        let expected: &[&str] = match renewal {
            Renewal::Renewed => &["granted", "renewed", "released"],
            Renewal::Lost => &["granted", "released"],
        };
        assert_eq!(app.events(&lease_id).await, expected, "round {round}");
        if renewal == Renewal::Renewed {
            renewed += 1;
        } else {
            lost += 1;
        }

        // late calls after the round: the lease stays gone
        app.renew(renewal_body)
            .refused(StatusCode::GONE, "lease_lost")
            .await;
        assert_eq!(
            app.release(release_body(&lease, "success")).ok_json().await,
            json!({"released": false, "reason": "not_found"}),
            "round {round}"
        );
        assert_eq!(slots_holding(&app, &lease_id).await, 0, "round {round}");
        assert_eq!(app.in_flight("key-1").await, 0, "round {round}");
    }
    // the last round's slot is free too
    let lease = app.lease(request("late")).await;
    assert_eq!(
        slots_holding(&app, lease["lease_id"].as_str().unwrap()).await,
        1
    );
    eprintln!("renew before release: {renewed} rounds; after: {lost}");
}
