//! Scenario 6, "Time": every lease and cooldown time comes from the database clock, so the service
//! host's clock and the time zones in play change no decision.
//!
//! Each test runs one real `credpool serve` under a condition — its host clock 10 minutes ahead
//! (libfaketime), its process in `TZ=Pacific/Kiritimati` (UTC+14), or its database sessions in
//! `America/Los_Angeles` — next to a baseline `credpool serve` in UTC with an unskewed clock, drives
//! both through the same scenario on a limit-1 credential with 3-second leases, and checks:
//!
//! - every time the service answers or writes (lease_until on allocate and renew, the audit rows'
//!   `at` and `lease_until`, the cooldown a `rate_limited` report starts) against the database
//!   clock read by the test around the call (`clock_timestamp()` before and after);
//! - every decision at its database-clock moment: the slot is held (429 `pool_exhausted` with
//!   `Retry-After` = the seconds left) until lease_until, also past the original end after a
//!   renewal (counted from the renewed end), and free from lease_until on;
//!   the credential rests for the reported retry_after and serves its probe lease from the end of
//!   the rest on;
//! - that the two runs' transcripts of decisions are equal.
//!
//! The test waits with `pg_sleep_until` on the database clock and never measures its own duration.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgPool};
use time::format_description::well_known::Rfc3339;
use time::macros::format_description;
use time::{Duration, OffsetDateTime, PrimitiveDateTime, UtcOffset};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};

use credpool_test_support::Service as _;
use credpool_test_support::*;

use crate::BIN;

const PROVIDER: &str = "clock";
const MODEL: &str = "clock-model";
const KEY_ID: &str = "clock-key";
/// Every lease of the scenario, seconds.
const LEASE_SECONDS: i64 = 3;
/// The provider's Retry-After the scenario reports with `rate_limited`, seconds.
const RETRY_AFTER_SECONDS: i64 = 3;
/// How far ahead libfaketime puts the service host's clock, seconds.
const SKEW_SECONDS: f64 = 600.0;
/// The process time zone of [`Condition::ProcessTimeZone`]: UTC+14, the furthest ahead of UTC.
const PROCESS_TIME_ZONE: &str = "Pacific/Kiritimati";
/// The database session time zone of [`Condition::SessionTimeZone`]: UTC-7 or UTC-8.
const SESSION_TIME_ZONE: &str = "America/Los_Angeles";

/// How a `credpool serve` of the scenario runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Condition {
    /// `TZ=UTC`, the host's own clock, UTC database sessions.
    Baseline,
    /// libfaketime with `FAKETIME=+10m`: the service's wall clock 10 minutes ahead of the host's.
    HostClockAhead,
    /// libfaketime with `FAKETIME=-10m`: the service's wall clock 10 minutes behind the host's.
    HostClockBehind,
    /// `TZ=Pacific/Kiritimati` on the process.
    ProcessTimeZone,
    /// Every database session of the service in `TimeZone=America/Los_Angeles`.
    SessionTimeZone,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn host_clock_ten_minutes_ahead_changes_no_expiry_or_cooldown_decision() {
    same_as_baseline(Condition::HostClockAhead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn process_time_zone_kiritimati_changes_no_expiry_or_cooldown_decision() {
    same_as_baseline(Condition::ProcessTimeZone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_session_time_zone_los_angeles_changes_no_expiry_or_cooldown_decision() {
    same_as_baseline(Condition::SessionTimeZone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_request_is_recorded_on_the_database_clock_whatever_the_host_clock() {
    // A request that waits (wait_ms) is recorded in `pool_waiters`, where every replica's claims
    // read it (fair share) against the database clock. Before, its arrival and the end of its
    // wait were the service host's clock: 10 minutes behind, the row had expired before it was
    // written, and no other tenant ever yielded to it.
    let service = Service::start(Condition::HostClockBehind).await;
    let put = service.put_credential().await;
    assert!(put.status().is_success(), "{}", put.status());
    service.allocate().ok_json().await;
    let before = db_clock(&service.db).await;
    let waiting = {
        let serve = service.serve.remote();
        let body = json!({"provider": PROVIDER, "model": MODEL, "wait_ms": 2_000});
        tokio::spawn(async move { serve.allocate(body).await.status() })
    };
    let row = loop {
        let row: Option<(OffsetDateTime, OffsetDateTime)> =
            sqlx::query_as("SELECT since, until FROM pool_waiters")
                .fetch_optional(&service.db)
                .await
                .unwrap();
        if let Some(row) = row {
            break row;
        }
        assert!(!waiting.is_finished(), "the request never waited");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    let after = db_clock(&service.db).await;
    let (since, until) = row;
    assert!(
        before <= since && since <= after,
        "arrival {since} is not on the database clock ({before} .. {after})"
    );
    let wait = (until - since).as_seconds_f64();
    assert!(
        (1.9..=2.01).contains(&wait),
        "the wait recorded, {wait} s, is not the request's 2 s ({since} .. {until})"
    );
    assert_eq!(waiting.await.unwrap(), StatusCode::TOO_MANY_REQUESTS);
}

/// Runs the scenario under `condition` and under the baseline at the same time; both must pass
/// every check against the database clock and decide the same.
async fn same_as_baseline(condition: Condition) {
    let (baseline, tested) = tokio::join!(scenario(Condition::Baseline), scenario(condition));
    assert_eq!(
        tested, baseline,
        "{condition:?} decided differently from the UTC, unskewed baseline"
    );
}

/// One `credpool serve` under a condition, with its own database.
struct Service {
    serve: ServeProcess,
    /// The test's own connections (UTC sessions, straight to the server).
    db: PgPool,
    _proxy: Option<TimeZoneProxy>,
    _database: TestDatabase,
}

impl Service {
    /// `PUT /api/admin/keys/{KEY_ID}`: the scenario's one credential, of limit 1.
    async fn put_credential(&self) -> reqwest::Response {
        let body = json!({"provider": PROVIDER, "models": [MODEL], "max_concurrent_uses": 1,
                          "secret": {"api_key": "sk-clock"}});
        self.serve.put_key_raw(KEY_ID, body).await
    }

    async fn start(condition: Condition) -> Self {
        let database = TestDatabase::create().await;
        let db = database.pool(2).await;
        let mut env = keyed_env(&database);
        let mut proxy = None;
        match condition {
            Condition::Baseline => env.push(("TZ", "UTC".into())),
            Condition::HostClockAhead | Condition::HostClockBehind => {
                env.push(("TZ", "UTC".into()));
                env.push(("LD_PRELOAD", libfaketime().display().to_string()));
                let skew = if condition == Condition::HostClockAhead {
                    "+10m"
                } else {
                    "-10m"
                };
                env.push(("FAKETIME", skew.into()));
                // A host clock that is set wrong moves the wall clock (CLOCK_REALTIME) only;
                // CLOCK_MONOTONIC, which Instant and tokio's timers read, keeps counting as before.
                env.push(("FAKETIME_DONT_FAKE_MONOTONIC", "1".into()));
            }
            Condition::ProcessTimeZone => env.push(("TZ", PROCESS_TIME_ZONE.into())),
            Condition::SessionTimeZone => {
                env.push(("TZ", "UTC".into()));
                let started = TimeZoneProxy::start(&database.options, SESSION_TIME_ZONE).await;
                let url = format!(
                    "postgres://{}@{}/{}",
                    database.options.get_username(),
                    started.addr,
                    database.name
                );
                // proof that a session through the proxy runs in the zone
                let options: PgConnectOptions = url.parse().unwrap();
                let mut conn = options.connect().await.unwrap();
                let zone: String = sqlx::query_scalar("SHOW TimeZone")
                    .fetch_one(&mut conn)
                    .await
                    .unwrap();
                assert_eq!(
                    zone, SESSION_TIME_ZONE,
                    "the proxy did not set the time zone"
                );
                env.retain(|(name, _)| *name != "DATABASE_URL");
                env.push(("DATABASE_URL", url));
                proxy = Some(started);
            }
        }
        let serve = ServeProcess::start(BIN, &env, &[]).await;
        if let Some(proxy) = &proxy {
            // the check above, then the service's connections (its migrations' at least)
            assert!(proxy.rewritten.load(Ordering::SeqCst) >= 2);
        }
        Self {
            serve,
            db,
            _proxy: proxy,
            _database: database,
        }
    }

    async fn allocate(&self) -> reqwest::Response {
        let body = json!({"provider": PROVIDER, "model": MODEL, "lease_seconds": LEASE_SECONDS,
                          "holder": "clock-test"});
        self.serve.allocate(body).await
    }

    async fn renew(&self, lease: &Value) -> reqwest::Response {
        self.serve
            .renew(renew_body(lease, LEASE_SECONDS as u64))
            .await
    }

    async fn release(&self, body: Value) -> reqwest::Response {
        self.serve.release(body).await
    }

    async fn credential(&self) -> Value {
        self.serve.credential(KEY_ID).await
    }

    /// The service's wall clock minus the database clock, seconds, from the `Date` header of a
    /// response (whole seconds, so within -1..+1 of the truth).
    async fn wall_clock_skew(&self) -> f64 {
        let before = db_clock(&self.db).await;
        let response = self.serve.get("/healthz").await;
        let date = response.headers()["date"].to_str().unwrap().to_owned();
        let date = PrimitiveDateTime::parse(
            &date,
            format_description!(
                "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] GMT"
            ),
        )
        .unwrap_or_else(|e| panic!("Date header {date:?}: {e}"))
        .assume_utc();
        (date - before).as_seconds_f64()
    }
}

/// The database clock just before and just after a call: the service decided in between.
#[derive(Debug, Clone, Copy)]
struct Window {
    before: OffsetDateTime,
    after: OffsetDateTime,
}

impl Window {
    /// Whether `at` lies in the window.
    fn holds(&self, at: OffsetDateTime) -> bool {
        self.before <= at && at <= self.after
    }

    /// Whether `at` lies in the window moved `seconds` later.
    fn holds_after(&self, seconds: i64, at: OffsetDateTime) -> bool {
        let shift = Duration::seconds(seconds);
        self.before + shift <= at && at <= self.after + shift
    }
}

/// Asserts the trail of `lease`, granted then released: its grant written within `granted.0`,
/// not before `granted.1`, with lease_until `granted.2`; its release written within `released`.
/// Returns its events.
async fn granted_then_released(
    db: &PgPool,
    condition: Condition,
    lease: &Value,
    granted: (Window, OffsetDateTime, OffsetDateTime),
    released: Window,
) -> Vec<String> {
    let (window, not_before, lease_until) = granted;
    let trail = lease_trail(db, lease).await;
    let events: Vec<String> = trail.iter().map(|(event, _, _)| event.clone()).collect();
    assert_eq!(events, ["granted", "released"], "{condition:?}: {trail:?}");
    assert!(window.holds(trail[0].2), "{condition:?}: {trail:?}");
    assert!(trail[0].2 >= not_before, "{condition:?}: {trail:?}");
    assert_eq!(trail[0].1, lease_until, "{condition:?}: {trail:?}");
    assert!(released.holds(trail[1].2), "{condition:?}: {trail:?}");
    events
}

/// The database clock (`clock_timestamp()`, not the transaction's start).
async fn db_clock(db: &PgPool) -> OffsetDateTime {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(db)
        .await
        .unwrap()
}

/// Runs `call` and returns its output with the database-clock window around it.
async fn timed<T>(db: &PgPool, call: impl Future<Output = T>) -> (T, Window) {
    let before = db_clock(db).await;
    let output = call.await;
    let after = db_clock(db).await;
    (output, Window { before, after })
}

/// Waits until the database clock reads `at` or later.
async fn sleep_until_db(db: &PgPool, at: OffsetDateTime) {
    while db_clock(db).await < at {
        sqlx::query("SELECT pg_sleep_until($1)")
            .bind(at)
            .execute(db)
            .await
            .unwrap();
    }
}

/// An RFC 3339 time of a response, and its UTC offset.
fn instant(value: &Value) -> (OffsetDateTime, UtcOffset) {
    let text = value
        .as_str()
        .unwrap_or_else(|| panic!("not a time: {value}"));
    let at = OffsetDateTime::parse(text, &Rfc3339).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    (at, at.offset())
}

/// Asserts a 429 `pool_exhausted` and returns its `Retry-After`, whole seconds.
async fn assert_busy(condition: Condition, step: &str, response: reqwest::Response) -> i64 {
    let retry_after = response
        .headers()
        .get("retry-after")
        .unwrap_or_else(|| panic!("{condition:?}, {step}: a 429 without Retry-After"))
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_error(response, StatusCode::TOO_MANY_REQUESTS, "pool_exhausted").await;
    retry_after
}

/// The whole seconds (at least 1) a `Retry-After` may give for `frees_at` when the service decided
/// somewhere in `window`.
fn retry_after_bounds(window: Window, frees_at: OffsetDateTime) -> std::ops::RangeInclusive<i64> {
    let whole_seconds = |d: Duration| (d.as_seconds_f64().ceil() as i64).max(1);
    // the service's estimate of the database clock may run ahead by a request's one-way latency
    let least = whole_seconds(frees_at - window.after - Duration::milliseconds(50));
    let most = whole_seconds(frees_at - window.before);
    least..=most
}

/// Allocates, and asserts a 429 `pool_exhausted` whose `Retry-After` is the whole seconds left
/// until `frees_at` at the service's moment of decision: the transcript's line for `step`.
async fn allocate_busy_until(
    service: &Service,
    condition: Condition,
    step: &str,
    frees_at: OffsetDateTime,
) -> String {
    let (response, window) = timed(&service.db, service.allocate()).await;
    let retry_after = assert_busy(condition, step, response).await;
    let bounds = retry_after_bounds(window, frees_at);
    assert!(
        bounds.contains(&retry_after),
        "{condition:?}, {step}: Retry-After {retry_after}, expected {bounds:?} seconds until \
         {frees_at}"
    );
    format!("allocate {step}: pool_exhausted")
}

/// One row of `lease_events`: (event, lease_until, at).
type TrailRow = (String, OffsetDateTime, OffsetDateTime);

async fn lease_trail(db: &PgPool, lease: &Value) -> Vec<TrailRow> {
    sqlx::query_as(
        "SELECT event, lease_until, at FROM lease_events
         WHERE lease_id = $1::text::uuid ORDER BY event_id",
    )
    .bind(lease["lease_id"].as_str().unwrap())
    .fetch_all(db)
    .await
    .unwrap()
}

/// The scenario under `condition`; returns its transcript of decisions.
async fn scenario(condition: Condition) -> Vec<String> {
    let service = Service::start(condition).await;
    let db = &service.db;
    let mut transcript = Vec::new();

    let skew = service.wall_clock_skew().await;
    let expected_skew = match condition {
        Condition::HostClockAhead => SKEW_SECONDS,
        Condition::HostClockBehind => -SKEW_SECONDS,
        _ => 0.0,
    };
    assert!(
        (skew - expected_skew).abs() < 2.0,
        "{condition:?}: the service's wall clock is {skew:.1} s off the database's, expected \
         {expected_skew} s (did libfaketime take effect?)"
    );

    let put = service.put_credential().await;
    json_body(put, StatusCode::CREATED).await;

    // A lease lasts lease_seconds from its grant on the database clock.
    let (response, granted) = timed(db, service.allocate()).await;
    let first = json_body(response, StatusCode::OK).await;
    let (first_until, offset) = instant(&first["lease_until"]);
    assert_eq!(first["probe"], false, "{condition:?}: {first}");
    assert!(
        granted.holds_after(LEASE_SECONDS, first_until),
        "{condition:?}: lease_until {first_until} is not {LEASE_SECONDS} s after the grant, \
         between {} and {} on the database clock",
        granted.before,
        granted.after
    );
    transcript.push(format!(
        "allocate: leased, probe {}, lease_until at UTC{offset}",
        first["probe"]
    ));
    let detail = service.credential().await;
    let (shown_until, offset) = instant(&detail["leases"][0]["lease_until"]);
    let (shown_granted, _) = instant(&detail["leases"][0]["granted_at"]);
    assert_eq!(shown_until, first_until, "{condition:?}: {detail}");
    assert!(granted.holds(shown_granted), "{condition:?}: {detail}");
    transcript.push(format!("credential: lease_until at UTC{offset}"));

    // While it lives, its slot is taken: 429 until lease_until.
    let line = allocate_busy_until(&service, condition, "while the lease lives", first_until).await;
    transcript.push(line);

    // A renewal extends it to lease_seconds from the renewal, on the database clock...
    sleep_until_db(db, first_until - Duration::seconds(1)).await;
    let (response, renewed) = timed(db, service.renew(&first)).await;
    let body = json_body(response, StatusCode::OK).await;
    let (renewed_until, offset) = instant(&body["lease_until"]);
    assert!(
        renewed.holds_after(LEASE_SECONDS, renewed_until),
        "{condition:?}: renewed lease_until {renewed_until} is not {LEASE_SECONDS} s after the \
         renewal, between {} and {}",
        renewed.before,
        renewed.after
    );
    transcript.push(format!("renew: renewed, lease_until at UTC{offset}"));

    // ...so past its first end the slot is still taken, up to the renewed end...
    sleep_until_db(db, renewed_until - Duration::milliseconds(1500)).await;
    assert!(db_clock(db).await > first_until);
    // the candidate view still has the first end, which has passed: the service must notice and
    // count from the renewed end (a Retry-After of 1 here was the bug)
    let line = allocate_busy_until(
        &service,
        condition,
        "past the first end, before the renewed one",
        renewed_until,
    )
    .await;
    transcript.push(line);

    // ...and from the renewed end on, the lease is lost and its slot free.
    sleep_until_db(db, renewed_until).await;
    let response = service.renew(&first).await;
    assert_error(response, StatusCode::GONE, "lease_lost").await;
    transcript.push("renew at lease_until: lease_lost".into());
    let (response, regranted) = timed(db, service.allocate()).await;
    let second = json_body(response, StatusCode::OK).await;
    let (second_until, offset) = instant(&second["lease_until"]);
    assert_eq!(second["probe"], false, "{condition:?}: {second}");
    assert!(regranted.holds_after(LEASE_SECONDS, second_until));
    transcript.push(format!(
        "allocate at lease_until: leased, probe {}, lease_until at UTC{offset}",
        second["probe"]
    ));

    // A rate_limited report rests the credential for its retry_after on the database clock...
    let mut report = release_body(&second, "rate_limited");
    report["retry_after_seconds"] = json!(RETRY_AFTER_SECONDS);
    let (response, reported) = timed(db, service.release(report)).await;
    let body = json_body(response, StatusCode::OK).await;
    assert_eq!(body, json!({"released": true}), "{condition:?}");
    transcript.push(format!("release rate_limited: {body}"));
    let (status, cooldown_until): (String, OffsetDateTime) =
        sqlx::query_as("SELECT status, cooldown_until FROM credentials WHERE key_id = $1")
            .bind(KEY_ID)
            .fetch_one(db)
            .await
            .unwrap();
    assert_eq!(status, "rate_limited", "{condition:?}");
    assert!(
        reported.holds_after(RETRY_AFTER_SECONDS, cooldown_until),
        "{condition:?}: cooldown_until {cooldown_until} is not {RETRY_AFTER_SECONDS} s after the \
         report, between {} and {}",
        reported.before,
        reported.after
    );
    let detail = service.credential().await;
    let (shown_cooldown, offset) = instant(&detail["cooldown_until"]);
    assert_eq!(shown_cooldown, cooldown_until, "{condition:?}: {detail}");
    transcript.push(format!(
        "credential: {}, cooldown_until at UTC{offset}",
        detail["status"]
    ));

    // ...429 with the seconds left until then...
    let line = allocate_busy_until(&service, condition, "while resting", cooldown_until).await;
    transcript.push(line);
    sleep_until_db(db, cooldown_until - Duration::milliseconds(1500)).await;
    let line = allocate_busy_until(
        &service,
        condition,
        "shortly before the rest ends",
        cooldown_until,
    )
    .await;
    transcript.push(line);

    // ...and from its end on, the probe lease.
    sleep_until_db(db, cooldown_until).await;
    let (response, probed) = timed(db, service.allocate()).await;
    let probe = json_body(response, StatusCode::OK).await;
    let (probe_until, offset) = instant(&probe["lease_until"]);
    assert_eq!(probe["probe"], true, "{condition:?}: {probe}");
    assert!(probed.holds_after(LEASE_SECONDS, probe_until));
    transcript.push(format!(
        "allocate at cooldown_until: leased, probe {}, lease_until at UTC{offset}",
        probe["probe"]
    ));
    let (response, recovered) = timed(db, service.release(release_body(&probe, "success"))).await;
    let body = json_body(response, StatusCode::OK).await;
    assert_eq!(body, json!({"released": true}), "{condition:?}");
    transcript.push(format!("release the probe with success: {body}"));
    // The first lease's slot was reused; its late report still counts for health.
    let (response, late) = timed(db, service.release(release_body(&first, "success"))).await;
    let body = json_body(response, StatusCode::OK).await;
    assert_eq!(
        body,
        json!({"released": false, "reason": "not_found"}),
        "{condition:?}"
    );
    transcript.push(format!("release the expired first lease: {body}"));

    // The audit trail holds the same instants.
    let trail = lease_trail(db, &first).await;
    let events: Vec<&str> = trail.iter().map(|(event, _, _)| event.as_str()).collect();
    assert_eq!(
        events,
        ["granted", "renewed", "expired", "outcome_after_expiry"],
        "{condition:?}: {trail:?}"
    );
    assert!(granted.holds(trail[0].2), "{condition:?}: {trail:?}");
    assert_eq!(trail[0].1, first_until, "{condition:?}: {trail:?}");
    assert!(renewed.holds(trail[1].2), "{condition:?}: {trail:?}");
    assert_eq!(trail[1].1, renewed_until, "{condition:?}: {trail:?}");
    assert_eq!(
        trail[1].1 - trail[1].2,
        Duration::seconds(LEASE_SECONDS),
        "{condition:?}: {trail:?}"
    );
    // an expired lease ends at its lease_until, whoever writes the row
    assert_eq!(trail[2].1, renewed_until, "{condition:?}: {trail:?}");
    assert_eq!(trail[2].2, renewed_until, "{condition:?}: {trail:?}");
    assert_eq!(trail[3].1, renewed_until, "{condition:?}: {trail:?}");
    assert!(late.holds(trail[3].2), "{condition:?}: {trail:?}");
    transcript.push(format!("first lease's trail: {events:?}"));

    let granted_from = (regranted, renewed_until, second_until);
    let events = granted_then_released(db, condition, &second, granted_from, reported).await;
    transcript.push(format!("second lease's trail: {events:?}"));
    let granted_from = (probed, cooldown_until, probe_until);
    let events = granted_then_released(db, condition, &probe, granted_from, recovered).await;
    transcript.push(format!("probe lease's trail: {events:?}"));

    // So do the credential's health transitions.
    let health: Vec<(
        String,
        Option<String>,
        Option<OffsetDateTime>,
        OffsetDateTime,
    )> = sqlx::query_as(
        "SELECT event, new_status, cooldown_until, at FROM credential_events
             WHERE key_id = $1 AND event IN ('status_changed', 'probe_granted') ORDER BY event_id",
    )
    .bind(KEY_ID)
    .fetch_all(db)
    .await
    .unwrap();
    let steps: Vec<(&str, Option<&str>)> = health
        .iter()
        .map(|(event, status, _, _)| (event.as_str(), status.as_deref()))
        .collect();
    assert_eq!(
        steps,
        [
            ("status_changed", Some("rate_limited")),
            ("probe_granted", Some("rate_limited")),
            ("status_changed", Some("available")),
        ],
        "{condition:?}: {health:?}"
    );
    let (_, _, rest_until, rested_at) = &health[0];
    assert!(reported.holds(*rested_at), "{condition:?}: {health:?}");
    assert_eq!(
        *rest_until,
        Some(cooldown_until),
        "{condition:?}: {health:?}"
    );
    assert_eq!(
        cooldown_until - *rested_at,
        Duration::seconds(RETRY_AFTER_SECONDS),
        "{condition:?}: {health:?}"
    );
    assert!(probed.holds(health[1].3), "{condition:?}: {health:?}");
    assert!(recovered.holds(health[2].3), "{condition:?}: {health:?}");
    transcript.push(format!("health transitions: {steps:?}"));

    transcript
}

/// Where Debian's `libfaketime` package puts the library; the test fails without it.
fn libfaketime() -> PathBuf {
    let candidates = [
        format!(
            "/usr/lib/{}-linux-gnu/faketime/libfaketime.so.1",
            std::env::consts::ARCH
        ),
        "/usr/lib/faketime/libfaketime.so.1".to_owned(),
        "/usr/local/lib/faketime/libfaketime.so.1".to_owned(),
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|path| path.exists())
        .unwrap_or_else(|| {
            panic!(
                "libfaketime is not installed (looked for {candidates:?}); the host clock skew \
                 test needs it: `apt-get install libfaketime` (Debian/Ubuntu)"
            )
        })
}

/// A TCP proxy in front of the test server that sets `TimeZone` in the startup packet of every
/// connection it forwards, then passes the bytes through.
///
/// Why a proxy: sqlx sends `TimeZone=UTC` as a startup parameter on every connection, and
/// PostgreSQL applies startup parameters after the `options` switches and over database and role
/// defaults, so neither `?options=-c TimeZone=...` in DATABASE_URL nor `ALTER DATABASE ... SET
/// timezone` reaches the service's sessions.
struct TimeZoneProxy {
    addr: SocketAddr,
    /// Startup packets rewritten so far.
    rewritten: Arc<AtomicUsize>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for TimeZoneProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// The server the proxy forwards to.
#[derive(Debug, Clone)]
enum Upstream {
    Tcp(String, u16),
    Unix(PathBuf),
}

const PROTOCOL_3_0: u32 = 196_608;
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

impl TimeZoneProxy {
    async fn start(server: &PgConnectOptions, time_zone: &'static str) -> Self {
        let upstream = match server.get_socket() {
            Some(dir) => Upstream::Unix(dir.join(format!(".s.PGSQL.{}", server.get_port()))),
            None => Upstream::Tcp(server.get_host().to_owned(), server.get_port()),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let rewritten = Arc::new(AtomicUsize::new(0));
        let counter = rewritten.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (upstream, counter) = (upstream.clone(), counter.clone());
                tokio::spawn(async move {
                    // a connection that ends, well or badly, just ends
                    let _ = forward(client, upstream, time_zone, counter).await;
                });
            }
        });
        Self {
            addr,
            rewritten,
            accept,
        }
    }
}

/// Answers `N` to SSL and GSS encryption requests, rewrites the startup packet, then pipes.
async fn forward(
    mut client: TcpStream,
    upstream: Upstream,
    time_zone: &str,
    rewritten: Arc<AtomicUsize>,
) -> std::io::Result<()> {
    let packet = loop {
        let length = client.read_u32().await? as usize;
        if !(8..=10_000).contains(&length) {
            return Err(std::io::Error::other("not a PostgreSQL startup packet"));
        }
        let mut body = vec![0; length - 4];
        client.read_exact(&mut body).await?;
        match u32::from_be_bytes(body[..4].try_into().unwrap()) {
            SSL_REQUEST | GSSENC_REQUEST => client.write_all(b"N").await?,
            PROTOCOL_3_0 => {
                rewritten.fetch_add(1, Ordering::SeqCst);
                break startup_packet(&body[4..], time_zone);
            }
            // a cancel request: as it came
            _ => break [&(length as u32).to_be_bytes()[..], &body].concat(),
        }
    };
    match upstream {
        Upstream::Tcp(host, port) => {
            pipe(
                client,
                TcpStream::connect((host.as_str(), port)).await?,
                &packet,
            )
            .await
        }
        Upstream::Unix(path) => pipe(client, UnixStream::connect(path).await?, &packet).await,
    }
}

async fn pipe(
    mut client: TcpStream,
    mut server: impl AsyncRead + AsyncWrite + Unpin,
    packet: &[u8],
) -> std::io::Result<()> {
    server.write_all(packet).await?;
    tokio::io::copy_bidirectional(&mut client, &mut server).await?;
    Ok(())
}

/// A protocol 3.0 startup packet with `params` (NUL-terminated name/value pairs, then a NUL) and
/// `TimeZone` set to `time_zone`.
fn startup_packet(params: &[u8], time_zone: &str) -> Vec<u8> {
    let mut fields: Vec<&[u8]> = params.split(|b| *b == 0).collect();
    // the pairs end at the first empty name
    let end = fields
        .iter()
        .step_by(2)
        .position(|name| name.is_empty())
        .map_or(fields.len(), |i| i * 2);
    fields.truncate(end);
    let mut pairs: Vec<(&[u8], &[u8])> = fields
        .chunks(2)
        .filter(|pair| pair.len() == 2)
        .map(|pair| (pair[0], pair[1]))
        .filter(|(name, _)| !name.eq_ignore_ascii_case(b"timezone"))
        .collect();
    pairs.push((b"TimeZone", time_zone.as_bytes()));
    let mut packet = vec![0; 4];
    packet.extend_from_slice(&PROTOCOL_3_0.to_be_bytes());
    for (name, value) in pairs {
        packet.extend_from_slice(name);
        packet.push(0);
        packet.extend_from_slice(value);
        packet.push(0);
    }
    packet.push(0);
    let length = packet.len() as u32;
    packet[..4].copy_from_slice(&length.to_be_bytes());
    packet
}
