//! Race tests (docs/design.md "Invariants the tests must prove"): 64 concurrent allocations of one
//! credential give exactly `limit` winners, every round, for limits 1, 2 and 5 — through HTTP, and
//! straight through the claim statement on 64 separate connections; 80 concurrent allocations over
//! 100 free credentials give 80 winners on 80 distinct credentials, also while the candidate view
//! is refreshed under concurrent releases.

use std::collections::HashSet;
use std::sync::Arc;

use credpool::domain::{KeyId, LeaseSeconds, ModelName, PoolName, ProviderName};
use credpool::store::leases::{self, Claim};
use reqwest::StatusCode;
use serde_json::json;
use tokio::sync::Barrier;

use credpool_test_support::*;

const RACERS: usize = 64;

async fn race_app() -> TestApp {
    TestApp::spawn_with(AppOptions::connections(RACERS as u32)).await
}

/// One round: a fresh credential with `limit` slots in its own pool, 64 allocations released at
/// once by a barrier. Returns (200s, 429s).
async fn http_round(app: &Arc<TestApp>, limit: u32, round: usize) -> (usize, usize) {
    let pool = format!("race-{limit}-{round}");
    let key = format!("race-{limit}-{round}");
    app.put_key(&key, "openai", &pool, &["gpt-4o"], limit).await;
    let barrier = Arc::new(Barrier::new(RACERS));
    let tasks: Vec<_> = (0..RACERS)
        .map(|i| {
            let app = app.clone();
            let barrier = barrier.clone();
            let pool = pool.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                app.allocate(json!({
                    "provider": "openai", "model": "gpt-4o", "pool": pool,
                    "lease_seconds": 600, "holder": format!("racer-{i}"),
                }))
                .await
                .status()
            })
        })
        .collect();
    let (mut won, mut busy) = (0, 0);
    for task in tasks {
        match task.await.unwrap() {
            StatusCode::OK => won += 1,
            StatusCode::TOO_MANY_REQUESTS => busy += 1,
            other => panic!("round {round}: unexpected status {other}"),
        }
    }
    assert_eq!(
        app.in_flight(&key).await,
        won as i64,
        "round {round}: database disagrees with the responses"
    );
    (won, busy)
}

async fn http_race(limit: u32) {
    let _turn = race_turn().await;
    let app = Arc::new(race_app().await);
    for round in 0..race_rounds() {
        let (won, busy) = http_round(&app, limit, round).await;
        assert_eq!(
            won, limit as usize,
            "round {round}: {won} winners on a limit-{limit} credential"
        );
        assert_eq!(busy, RACERS - limit as usize, "round {round}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_race_limit_1_has_exactly_one_winner_every_round() {
    http_race(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_race_limit_2_has_exactly_two_winners_every_round() {
    http_race(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_race_limit_5_has_exactly_five_winners_every_round() {
    http_race(5).await;
}

/// The claim statement alone, on 64 separate connections that all start it at once.
async fn statement_race(limit: u32) {
    let _turn = race_turn().await;
    let app = race_app().await;
    let pool = app.database.pool(RACERS as u32).await;
    // open every connection before the race so that the barrier releases statements, not logins
    let mut conns = Vec::new();
    for _ in 0..RACERS {
        conns.push(pool.acquire().await.unwrap());
    }
    let provider = ProviderName::parse("openai").unwrap();
    let model = ModelName::parse("gpt-4o").unwrap();
    for round in 0..race_rounds() {
        let key = format!("stmt-{limit}-{round}");
        app.put_key(&key, "openai", "default", &["gpt-4o"], limit)
            .await;
        let ranked = Arc::new(vec![KeyId::parse(key.clone()).unwrap()]);
        let barrier = Arc::new(Barrier::new(RACERS));
        let tasks: Vec<_> = conns
            .drain(..)
            .map(|mut conn| {
                let (ranked, barrier, provider, model) = (
                    ranked.clone(),
                    barrier.clone(),
                    provider.clone(),
                    model.clone(),
                );
                tokio::spawn(async move {
                    let claim = Claim::new(
                        ranked.to_vec(),
                        provider,
                        PoolName::default_pool(),
                        model,
                        LeaseSeconds::parse(600, 3600).unwrap(),
                    );
                    barrier.wait().await;
                    let claimed = leases::claim_slot(&mut conn, &claim).await.unwrap();
                    (conn, claimed.outcome.into_lease().is_some())
                })
            })
            .collect();
        let mut won = 0;
        for task in tasks {
            let (conn, granted) = task.await.unwrap();
            conns.push(conn);
            won += usize::from(granted);
        }
        assert_eq!(
            won, limit as usize,
            "round {round}: {won} claims won on a limit-{limit} credential"
        );
        assert_eq!(app.in_flight(&key).await, i64::from(limit), "round {round}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn statement_race_limit_1_never_oversells() {
    statement_race(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn statement_race_limit_2_never_oversells_or_underfills() {
    statement_race(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn statement_race_limit_5_never_oversells_or_underfills() {
    statement_race(5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eighty_racers_over_a_hundred_free_credentials_get_eighty_distinct_credentials() {
    let _turn = race_turn().await;
    let app = Arc::new(race_app().await);
    wide_race(&app, "wide", 100, 80, race_rounds().min(20)).await;
}

/// The candidate view refreshed every 20 ms, so refreshes keep overlapping the releases
/// between rounds: a refresh that read the pool before a release committed must not leave the
/// released credential looking busy (that once answered 429 with free credentials left).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_view_refresh_overlapping_releases_never_hides_a_free_credential() {
    let _turn = race_turn().await;
    let mut options = AppOptions::connections(RACERS as u32);
    options.settings.view_refresh = std::time::Duration::from_millis(20);
    let app = Arc::new(TestApp::spawn_with(options).await);
    wide_race(&app, "snug", 64, 64, race_rounds()).await;
}

/// `racers` concurrent allocations over `credentials` free limit-1 credentials in the default
/// pool, every round: each must win, on distinct credentials; then all are released.
async fn wide_race(
    app: &Arc<TestApp>,
    prefix: &str,
    credentials: usize,
    racers: usize,
    rounds: usize,
) {
    for i in 0..credentials {
        app.put_key(
            &format!("{prefix}-{i:03}"),
            "openai",
            "default",
            &["gpt-4o"],
            1,
        )
        .await;
    }
    for round in 0..rounds {
        let barrier = Arc::new(Barrier::new(racers));
        let tasks: Vec<_> = (0..racers)
            .map(|_| {
                let (app, barrier) = (app.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let response = app
                        .allocate(
                            json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 600}),
                        )
                        .await;
                    json_body(response, StatusCode::OK).await
                })
            })
            .collect();
        let mut leases = Vec::new();
        for task in tasks {
            leases.push(task.await.unwrap());
        }
        let distinct: HashSet<_> = leases
            .iter()
            .map(|l| l["key_id"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(distinct.len(), racers, "round {round}");

        // release everything for the next round, all at once
        release_all_at_once(app, leases, round).await;
    }
}

/// Group claiming forced on: every group waits 20 ms for more, so the 64 racers of a round share
/// a few transactions, and so do their renewals and releases. Each round's pool has three
/// credentials of limits 1, 2 and 3: exactly six win, each credential exactly at its limit, the
/// database agrees, and every winner's renewal and release succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grouped_claims_renewals_and_releases_never_oversell() {
    let _turn = race_turn().await;
    let mut options = AppOptions::connections(RACERS as u32);
    options.settings.groups = credpool::allocator::GroupSettings {
        max_size: RACERS,
        max_wait: std::time::Duration::from_millis(20),
        transactions: 2,
    };
    let app = Arc::new(TestApp::spawn_with(options).await);
    let big_groups_before = big_groups(&app.metrics().await);
    for round in 0..race_rounds() {
        let pool = format!("grouped-{round}");
        for limit in 1..=3 {
            app.put_key(
                &format!("{pool}-{limit}"),
                "openai",
                &pool,
                &["gpt-4o"],
                limit,
            )
            .await;
        }
        let barrier = Arc::new(Barrier::new(RACERS));
        let tasks: Vec<_> = (0..RACERS)
            .map(|_| {
                let (app, barrier, pool) = (app.clone(), barrier.clone(), pool.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let response = app
                        .allocate(
                            json!({"provider": "openai", "model": "gpt-4o", "pool": pool,
                                         "lease_seconds": 600}),
                        )
                        .await;
                    match response.status() {
                        StatusCode::OK => Some(json_body(response, StatusCode::OK).await),
                        StatusCode::TOO_MANY_REQUESTS => None,
                        other => panic!("round {round}: unexpected status {other}"),
                    }
                })
            })
            .collect();
        let mut leases = Vec::new();
        for task in tasks {
            leases.extend(task.await.unwrap());
        }
        assert_eq!(leases.len(), 6, "round {round}: winners");
        for limit in 1..=3 {
            let key = format!("{pool}-{limit}");
            let held = leases
                .iter()
                .filter(|l| l["key_id"] == key.as_str())
                .count();
            assert_eq!(held, limit as usize, "round {round}: leases on {key}");
            assert_eq!(app.in_flight(&key).await, limit as i64, "round {round}");
        }
        let renewals: Vec<_> = leases
            .iter()
            .cloned()
            .map(|lease| {
                let app = app.clone();
                tokio::spawn(async move {
                    let mut body = release_body(&lease, "success");
                    body.as_object_mut().unwrap().remove("outcome");
                    body["lease_seconds"] = json!(900);
                    json_body(app.renew(body).await, StatusCode::OK).await
                })
            })
            .collect();
        for renewal in renewals {
            assert!(renewal.await.unwrap()["lease_until"].is_string());
        }
        release_all_at_once(&app, leases, round).await;
        for limit in 1..=3 {
            assert_eq!(app.in_flight(&format!("{pool}-{limit}")).await, 0);
        }
    }
    // the groups really formed (other tests only add groups to the count, rarely big ones)
    assert!(
        big_groups(&app.metrics().await) > big_groups_before,
        "no claim group of more than 8 operations"
    );
}

/// Releases `leases` with `success`, all at once; each must be released.
async fn release_all_at_once(app: &Arc<TestApp>, leases: Vec<serde_json::Value>, round: usize) {
    let releases: Vec<_> = leases
        .into_iter()
        .map(|lease| {
            let app = app.clone();
            tokio::spawn(async move {
                let response = app.release(release_body(&lease, "success")).await;
                json_body(response, StatusCode::OK).await
            })
        })
        .collect();
    for release in releases {
        assert_eq!(release.await.unwrap()["released"], true, "round {round}");
    }
}

/// Claim groups of more than 8 operations so far, from `credpool_group_size`.
fn big_groups(page: &str) -> f64 {
    let value = |prefix: &str| {
        page.lines()
            .filter(|l| l.starts_with(prefix))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum::<f64>()
    };
    value("credpool_group_size_count{kind=\"claim\"}")
        - value("credpool_group_size_bucket{kind=\"claim\",le=\"8\"}")
}
