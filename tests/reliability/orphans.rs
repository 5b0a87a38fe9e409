//! Reliability scenario 5: orphaned leases. An executor that vanishes without releasing strands
//! its slot until `lease_until` on the database clock, and not a moment longer or shorter: no
//! cleanup job is needed for the slot to free (crash insurance: docs/design.md "The protocol",
//! step 5), the reaper, when it runs, ends such leases in the trail as `expired`, and rejected
//! allocations on a full credential never touch the orphan (every 4xx leaves the database
//! unchanged).
//!
//! The in-process app runs no cleanup of its own (only `credpool serve` schedules one), so every
//! slot that frees here is freed by the claim itself, until a test runs the reaper by hand.

use std::time::Duration;

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use time::OffsetDateTime;

use credpool_test_support::*;

/// The database clock.
async fn db_now(app: &TestApp) -> OffsetDateTime {
    app.scalar("SELECT clock_timestamp()").await
}

/// An orphan: a lease whose executor vanished; all we keep is what the allocation answered and
/// its `lease_until` as stored (database clock).
struct Orphan {
    lease: Value,
    until: OffsetDateTime,
}

impl Orphan {
    fn id(&self) -> &str {
        self.lease["lease_id"].as_str().unwrap()
    }
}

/// Takes a lease and forgets it (the executor crashed).
async fn orphan(app: &TestApp, body: Value) -> Orphan {
    let lease = app.lease(body).await;
    let until = lease_until(app, lease["lease_id"].as_str().unwrap())
        .await
        .expect("a granted lease holds a slot");
    Orphan { lease, until }
}

/// The `lease_until` of a lease that still sits in its slot row.
async fn lease_until(app: &TestApp, lease_id: &str) -> Option<OffsetDateTime> {
    sqlx::query_scalar("SELECT lease_until FROM lease_slots WHERE lease_id = $1::text::uuid")
        .bind(lease_id)
        .fetch_optional(&app.db)
        .await
        .unwrap()
}

/// When the trail says a lease was granted (database clock).
async fn granted_at(app: &TestApp, lease_id: &str) -> OffsetDateTime {
    app.scalar_of(
        "SELECT at FROM lease_events WHERE lease_id = $1::text::uuid AND event = 'granted'",
        lease_id,
    )
    .await
}

/// The trail of one lease: (event, at, lease_until), in order.
async fn trail(app: &TestApp, lease_id: &str) -> Vec<(String, OffsetDateTime, OffsetDateTime)> {
    sqlx::query_as(
        "SELECT event, at, lease_until FROM lease_events WHERE lease_id = $1::text::uuid
         ORDER BY event_id",
    )
    .bind(lease_id)
    .fetch_all(&app.db)
    .await
    .unwrap()
}

/// Asserts the orphan's life in the trail: granted, then expired at exactly its `lease_until`,
/// and nothing else (never released, never renewed).
async fn assert_ended_as_expired(app: &TestApp, orphan: &Orphan) {
    let events = trail(app, orphan.id()).await;
    let names: Vec<&str> = events.iter().map(|(event, _, _)| event.as_str()).collect();
    assert_eq!(names, ["granted", "expired"], "lease {}", orphan.id());
    let (_, at, until) = events[1];
    assert_eq!(at, orphan.until, "an orphan ends at its own lease_until");
    assert_eq!(until, orphan.until);
}

/// Allocates on a pool whose slots are all held by `orphans` (sorted by `until`) every 100 ms
/// until each orphan's slot has been granted again, checking every answer against the database
/// clock: while the next orphan to expire is live (the clock read before sending is not past its
/// `lease_until`) the answer may be 429 `pool_exhausted`; once the clock is past it the answer
/// must be 200; and a grant is never made before that `lease_until`. Returns the new leases (the
/// caller releases them) and the number of 429s.
async fn allocate_as_orphans_expire(
    app: &TestApp,
    body: &Value,
    orphans: &[&Orphan],
) -> (Vec<Value>, usize) {
    let mut granted = Vec::new();
    let mut refused = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
    while granted.len() < orphans.len() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "slots did not free: {} of {} granted again",
            granted.len(),
            orphans.len()
        );
        let frees_at = orphans[granted.len()].until;
        let sent_at = db_now(app).await;
        let response = app.allocate(body.clone()).await;
        match response.status() {
            StatusCode::OK => {
                let lease = json_body(response, StatusCode::OK).await;
                let at = granted_at(app, lease["lease_id"].as_str().unwrap()).await;
                assert!(
                    at >= frees_at,
                    "a slot was granted at {at}, before the orphan's lease_until {frees_at}"
                );
                granted.push(lease);
            }
            _ => {
                let retry_after: u64 = response
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .expect("a 429 carries Retry-After");
                assert!(retry_after >= 1);
                assert_error(response, StatusCode::TOO_MANY_REQUESTS, "pool_exhausted").await;
                assert!(
                    sent_at <= frees_at,
                    "refused an allocation sent at {sent_at}, after the orphan's slot freed at {frees_at}"
                );
                refused += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    (granted, refused)
}

#[tokio::test]
async fn an_orphaned_lease_stops_counting_at_its_lease_until_and_not_before_without_any_cleanup() {
    let app = TestApp::spawn().await;
    app.put_gpt4o_key("orphaned-2", "crashes", 2).await;
    let lease = |seconds: u64, holder: &str| {
        json!({"provider": "openai", "model": "gpt-4o", "pool": "crashes",
               "lease_seconds": seconds, "holder": holder})
    };
    // two executors take both slots and vanish, one with a shorter lease
    let short = orphan(&app, lease(2, "crashed-early")).await;
    let long = orphan(&app, lease(4, "crashed-late")).await;
    assert!(short.until < long.until);

    let (granted, refused) =
        allocate_as_orphans_expire(&app, &lease(60, "survivor"), &[&short, &long]).await;
    assert!(
        refused > 0,
        "no allocation was refused while the orphans held both slots"
    );
    // the claims that reused the slots ended the orphans in the trail; nothing else did
    assert_ended_as_expired(&app, &short).await;
    assert_ended_as_expired(&app, &long).await;
    assert_eq!(app.in_flight("orphaned-2").await, 2);
    // an executor that comes back after its slot was reused releases nothing, and its renewal
    // is refused: the lease is gone for good
    let late = app.release(release_body(&short.lease, "success")).await;
    let late = json_body(late, StatusCode::OK).await;
    assert_eq!(late, json!({"released": false, "reason": "not_found"}));
    let renewal = lease_ref(&long.lease);
    app.renew(renewal)
        .refused(StatusCode::GONE, "lease_lost")
        .await;
    assert_eq!(app.in_flight("orphaned-2").await, 2);
    for lease in &granted {
        app.release_ok(lease, "success").await;
    }
}

#[tokio::test]
async fn expired_orphans_do_not_count_before_the_reaper_runs_and_the_reaper_ends_them_as_expired() {
    let app = TestApp::spawn().await;
    for (key, limit) in [("reap-1", 1), ("reap-2", 2), ("reap-3", 3)] {
        app.put_gpt4o_key(key, "reaped", limit).await;
    }
    let lease = |seconds: u64, holder: String| {
        json!({"provider": "openai", "model": "gpt-4o", "pool": "reaped",
               "lease_seconds": seconds, "holder": holder})
    };
    // six slots: five executors crash with short leases, one keeps a long lease
    let mut orphans = Vec::new();
    for i in 0..5 {
        orphans.push(orphan(&app, lease(1 + i % 2, format!("crashed-{i}"))).await);
    }
    let live = orphan(&app, lease(600, "alive".into())).await;
    app.allocate(lease(60, "late".into()))
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;

    let last = orphans.iter().map(|o| o.until).max().unwrap();
    while db_now(&app).await <= last {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // nothing has cleaned up: the orphans still sit in their slot rows, yet they no longer count
    for orphan in &orphans {
        assert_eq!(lease_until(&app, orphan.id()).await, Some(orphan.until));
        assert_eq!(trail(&app, orphan.id()).await.len(), 1);
    }
    let mut in_flight = 0;
    for key in ["reap-1", "reap-2", "reap-3"] {
        in_flight += app.in_flight(key).await;
    }
    assert_eq!(in_flight, 1, "only the live lease counts");
    let active: Vec<String> = app
        .scalars("SELECT lease_id::text FROM active_leases")
        .await;
    assert_eq!(active.len(), 1, "{active:?}");

    // the reaper (credpool_maintenance, as `credpool serve` or pg_cron runs it)
    let report = credpool::store::maintenance::run_pass(&app.db, Duration::from_secs(86_400))
        .await
        .unwrap()
        .expect("no other scheduler on a fresh database");
    assert_eq!(report.expired_leases_reaped, 5);
    for orphan in &orphans {
        assert_ended_as_expired(&app, orphan).await;
        assert_eq!(lease_until(&app, orphan.id()).await, None, "slot not freed");
    }
    // the live lease is untouched
    assert_eq!(lease_until(&app, live.id()).await, Some(live.until));
    assert_eq!(app.events(live.id()).await, ["granted"]);
    // the audit answers "which executors crash without releasing?"
    let crashed: Vec<(String, String)> = sqlx::query_as(
        "SELECT holder, ended_by FROM credpool_lease_lifetimes(now() - interval '1 hour', now())
         WHERE key_id LIKE 'reap-%' AND ended_by IS NOT NULL ORDER BY holder",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    let expected: Vec<(String, String)> = (0..5)
        .map(|i| (format!("crashed-{i}"), "expired".to_owned()))
        .collect();
    assert_eq!(crashed, expected);
    // a second pass finds nothing more to end
    let again = credpool::store::maintenance::run_pass(&app.db, Duration::from_secs(86_400))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.expired_leases_reaped, 0);

    // the five freed slots are granted again, the live one is not
    for i in 0..5 {
        app.lease(lease(60, format!("new-{i}"))).await;
    }
    app.allocate(lease(60, "late".into()))
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    for orphan in &orphans {
        assert_eq!(
            trail(&app, orphan.id()).await.len(),
            2,
            "ended exactly once"
        );
    }
}

#[tokio::test]
async fn rejected_allocations_on_a_full_credential_never_extend_an_orphans_lease() {
    const ATTEMPTS: usize = 200;
    let app = TestApp::spawn().await;
    app.put_gpt4o_key("hammered", "hammer", 1).await;
    let body = |holder: &str| {
        json!({"provider": "openai", "model": "gpt-4o", "pool": "hammer",
               "lease_seconds": 60, "holder": holder})
    };
    let lost = orphan(
        &app,
        json!({"provider": "openai", "model": "gpt-4o", "pool": "hammer",
               "lease_seconds": 10, "holder": "crashed"}),
    )
    .await;
    let slot_row = || async {
        app.scalar::<String>(
            "SELECT to_jsonb(s)::text FROM lease_slots s WHERE key_id = 'hammered'",
        )
        .await
    };
    let row_before = slot_row().await;
    let before = app.snapshot().await;

    // 200 allocations, 16 at a time, while the orphan holds the only slot
    let statuses: Vec<(StatusCode, Option<u64>)> = futures::stream::iter(0..ATTEMPTS)
        .map(|i| {
            let body = body(&format!("hammer-{i}"));
            let app = &app;
            async move {
                let response = app.allocate(body).await;
                let retry_after = response
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.parse().ok());
                (response.status(), retry_after)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let finished_at = db_now(&app).await;
    assert!(
        finished_at < lost.until,
        "the {ATTEMPTS} allocations outlived the orphan's 10 s lease (a very slow machine)"
    );
    for (status, retry_after) in &statuses {
        assert_eq!(*status, StatusCode::TOO_MANY_REQUESTS);
        // whole seconds until the orphan's lease ends, never more than its length
        assert!(
            retry_after.is_some_and(|s| (1..=10).contains(&s)),
            "{retry_after:?}"
        );
    }

    // nothing changed: the orphan's lease_until is exactly as granted, no row anywhere moved
    assert_eq!(slot_row().await, row_before);
    assert_eq!(lease_until(&app, lost.id()).await, Some(lost.until));
    assert_eq!(app.snapshot().await, before, "a 429 changed the database");
    assert_eq!(app.events(lost.id()).await, ["granted"]);

    // and the slot frees at the original lease_until
    let (granted, _) = allocate_as_orphans_expire(&app, &body("after"), &[&lost]).await;
    assert_ended_as_expired(&app, &lost).await;
    assert_eq!(granted[0]["key_id"], "hammered");
}
