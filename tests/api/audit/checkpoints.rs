//! The incremental proofs (`audit_checkpoints`, `credpool_audit_advance`): a run proves only what
//! the trail gained since its checkpoint, in bounded chunks that commit as they go, resumes after
//! an interruption, judges every grant exactly as one proof over the whole range does, and keeps
//! up as the maintenance pass's continuous proof, with `/metrics` showing how far behind it is
//! and what it found.

use std::collections::BTreeMap;
use std::time::Duration;

use credpool::store::audit::{self, Run};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use credpool_test_support::*;

use crate::BIN;

/// `credpool ARGS` on `database`, with `envs` on top of the tests' usual environment (without
/// the statement timeouts a shell may have set).
async fn credpool(database: &TestDatabase, args: &[&str], envs: &[(&str, &str)]) -> Ran {
    let mut command = credpool_command(BIN, &database.url());
    command
        .args(args)
        .env_remove("CREDPOOL_DB_STATEMENT_TIMEOUT_MS")
        .env_remove("CREDPOOL_OPERATOR_STATEMENT_TIMEOUT_MS")
        .envs(envs.iter().copied());
    run(&mut command).await
}

/// Writes a trail shaped like `credpool bench`'s traffic into `db`: `leases` leases on 200
/// credentials of limit 4 (created, as the service records them), at 1,150 grants a second from
/// `ago_seconds` ago on, each `granted` and `released` 5 to 25 ms later by tenant `default`: two
/// trail rows per lease.
async fn bench_trail(db: &sqlx::PgPool, leases: i64, ago_seconds: f64) {
    sqlx::raw_sql(
        "INSERT INTO credentials (key_id, provider, pool, models, max_concurrent_uses, secret)
         SELECT 'bench-' || i, 'openai', 'default', ARRAY['gpt-4o'], 4, '{}'
         FROM generate_series(0, 199) i
         ON CONFLICT DO NOTHING;
         INSERT INTO credential_events (key_id, event, reason, actor, details, at)
         SELECT 'bench-' || i, 'created', 'created', 'test',
                '{\"new\": {\"max_concurrent_uses\": 4, \"rate_limits\": []}}', now() - interval '2 hours'
         FROM generate_series(0, 199) i
         WHERE NOT EXISTS (SELECT 1 FROM credential_events WHERE key_id = 'bench-' || i)",
    )
    .execute(db)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, holder, outcome,
                                   lease_until, at, tenant)
         SELECT ev.event, l.id, l.key, 'openai', 'default', l.slot, 'bench', ev.outcome,
                l.g + interval '60 s', CASE ev.event WHEN 'granted' THEN l.g ELSE l.g + l.hold END,
                'default'
         FROM (SELECT gen_random_uuid() AS id, 'bench-' || (n % 200) AS key, (n / 200) % 4 AS slot,
                      now() - $2 * interval '1 second' + n * interval '1 second' / 1150 AS g,
                      interval '5 ms' + (n % 21) * interval '1 ms' AS hold
               FROM generate_series(0, $1 - 1) n) l
         CROSS JOIN LATERAL (VALUES ('granted', NULL), ('released', 'success')) ev(event, outcome)",
    )
    .bind(leases)
    .bind(ago_seconds)
    .execute(db)
    .await
    .unwrap();
    sqlx::query("ANALYZE lease_events")
        .execute(db)
        .await
        .unwrap();
}

/// A fresh database with [`bench_trail`]'s `leases` from `ago_seconds` ago on: it, and a pool of
/// 2 connections on it.
async fn database_with_bench_trail(leases: i64, ago_seconds: f64) -> (TestDatabase, sqlx::PgPool) {
    let database = TestDatabase::create().await;
    let db = database.pool(2).await;
    bench_trail(&db, leases, ago_seconds).await;
    (database, db)
}

#[tokio::test]
async fn a_proof_over_millions_of_trail_rows_completes_with_the_operator_defaults() {
    // Two million trail rows: before chunks and the operators' own statement timeout, one
    // statement proved them and the request path's 5 s cancelled it.
    let (database, _) = database_with_bench_trail(1_000_000, 900.0).await;

    let ran = credpool(&database, &["audit", "verify", "--json"], &[]).await;
    assert!(ran.success, "{}{}", ran.stdout, ran.stderr);
    let report = ran.report();
    let leases: i64 = report["credentials"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["leases"].as_i64().unwrap())
        .sum();
    assert_eq!(leases, 1_000_000, "every grant judged");
    assert_eq!(report["grants_over_limit"], 0);
    assert_eq!(report["tenants"][0]["leases"], 1_000_000);
    assert_eq!(report["rows_read"], 2_000_000);
    assert!(
        report["chunks"].as_u64().unwrap() >= 10,
        "{}",
        report["chunks"]
    );
}

#[tokio::test]
async fn the_services_maintenance_pass_proves_a_chunk_longer_than_a_requests_statement_timeout() {
    // The service runs its maintenance pass on the request path's pool, whose connections carry
    // the request path's statement timeout; a proof chunk of 200,000 trail rows takes far longer
    // than the 100 ms given here, and must not be cancelled by it.
    let (database, _) = database_with_bench_trail(100_000, 600.0).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            database
                .options
                .clone()
                .options([("statement_timeout", "100")]),
        )
        .await
        .unwrap();
    let timeout: String = pool.scalar("SHOW statement_timeout").await;
    assert_eq!(timeout, "100ms");
    let report =
        credpool::store::maintenance::run_steps(&pool.into(), Duration::from_secs(30 * 86_400))
            .await
            .expect("the maintenance pass failed")
            .expect("the pass was skipped");
    assert_eq!(report.audit_rows_proven, 200_000, "{report:?}");
}

#[tokio::test]
async fn operator_commands_take_their_own_statement_timeout_not_the_request_paths() {
    let (database, _) = database_with_bench_trail(20_000, 600.0).await;
    // the service's setting, as a deployment's environment would give it to every command
    let ran = credpool(
        &database,
        &["audit", "verify"],
        &[("CREDPOOL_DB_STATEMENT_TIMEOUT_MS", "1")],
    )
    .await;
    assert!(ran.success, "{}{}", ran.stdout, ran.stderr);
    assert!(
        ran.stdout.contains("no grant ever exceeded a limit"),
        "{}",
        ran.stdout
    );
    // the operators' own setting applies
    let ran = credpool(
        &database,
        &["audit", "verify", "--full", "--statement-timeout-ms", "1"],
        &[],
    )
    .await;
    assert!(!ran.success, "{}", ran.stdout);
    assert!(
        ran.stderr.contains("statement timeout"),
        "{}{}",
        ran.stdout,
        ran.stderr
    );
}

/// Tuples of `lease_events` this transaction has read so far: rows of sequential scans, and
/// entries of index scans (heap fetches, or index-only).
async fn trail_tuples_read(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT coalesce(seq_tup_read, 0) FROM pg_stat_xact_user_tables
                 WHERE relname = 'lease_events')
              + (SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(i.indexrelid)), 0)::bigint
                 FROM pg_index i WHERE i.indrelid = 'lease_events'::regclass)",
    )
    .fetch_one(conn)
    .await
    .unwrap()
}

/// Advances `run` until it has nothing more to do; returns the trail rows proven.
async fn advance_all(conn: &mut PgConnection, run: &Run, chunk_rows: u32) -> i64 {
    let mut rows = 0;
    loop {
        let advanced = audit::advance(&mut *conn, run, chunk_rows)
            .await
            .unwrap()
            .expect("no other session advances this run");
        rows += advanced.rows_read;
        if !advanced.more {
            return rows;
        }
    }
}

#[tokio::test]
async fn the_next_incremental_run_reads_only_the_new_rows_and_finds_an_oversell_among_them() {
    let (database, db) = database_with_bench_trail(100_000, 1800.0).await;
    let ran = credpool(&database, &["audit", "verify", "--json"], &[]).await;
    assert!(ran.success, "{}{}", ran.stdout, ran.stderr);
    assert_eq!(ran.report()["rows_read"], 200_000);

    // traffic since the checkpoint: 500 leases of the same shape, and among them a fifth lease
    // held at once on a limit-4 credential, as a claim that oversold would have written it
    bench_trail(&db, 500, 0.5).await;
    db.run_sql("INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at, tenant)
         SELECT 'granted', gen_random_uuid(), 'bench-7', 'openai', 'default', s, now() + interval '1 minute',
                now() - interval '100 ms' + s * interval '1 ms', 'default'
         FROM generate_series(0, 4) s").await;

    // the next run, in a transaction of the test's own, so that its reads of the trail can be
    // counted (pg_stat_xact_*: this transaction's, exact and at once)
    let mut conn = PgConnection::connect_with(&database.options).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let before = trail_tuples_read(&mut tx).await;
    let proven = advance_all(&mut tx, &Run::Continuous, 200_000).await;
    let read = trail_tuples_read(&mut tx).await - before;
    let found = audit::findings(&mut tx, &Run::Continuous).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(proven, 1_005, "the new rows");
    // the chunk's end is found on the index, and each concurrency proof reads the new rows
    // once (the window proofs have no window to judge): never the 200,000 rows proven before
    assert!(
        read <= 4 * 1_005,
        "the incremental run read {read} trail tuples for 1,005 new rows"
    );

    let bench_7 = found
        .credentials
        .iter()
        .find(|c| c.key_id == "bench-7")
        .unwrap();
    assert_eq!(bench_7.grants_over_limit, 1, "{bench_7:?}");
    assert_eq!(bench_7.peak, 5);
    let leases: i64 = found.credentials.iter().map(|c| c.leases).sum();
    assert_eq!(leases, 100_000 + 500 + 5);
    let ran = credpool(&database, &["audit", "verify"], &[]).await;
    assert!(!ran.success, "{}", ran.stdout);
    assert!(
        ran.stdout.contains("1 grants exceeded a limit"),
        "{}",
        ran.stdout
    );
}

#[tokio::test]
async fn an_interrupted_proof_resumes_from_its_checkpoint_and_finds_what_a_whole_proof_finds() {
    let (database, db) = database_with_bench_trail(20_000, 1200.0).await;
    // two oversells in the range, ten minutes apart
    for minutes_ago in [15, 5] {
        db.run_sql_with("INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at, tenant)
             SELECT 'granted', gen_random_uuid(), 'bench-3', 'openai', 'default', s,
                    now() - $1 * interval '1 minute' + interval '30 s',
                    now() - $1 * interval '1 minute' + s * interval '1 ms', 'default'
             FROM generate_series(0, 4) s", minutes_ago).await;
    }
    let (since, until): (OffsetDateTime, OffsetDateTime) =
        sqlx::query_as("SELECT min(at), now() FROM lease_events")
            .fetch_one(&db)
            .await
            .unwrap();
    let (since, until) = (
        since.format(&Rfc3339).unwrap(),
        until.format(&Rfc3339).unwrap(),
    );
    let run = Run::Range {
        since: OffsetDateTime::parse(&since, &Rfc3339).unwrap(),
    }
    .name();
    let args = [
        "audit",
        "verify",
        "--json",
        "--since",
        &since,
        "--until",
        &until,
        "--chunk-rows",
        "400",
    ];

    // a run in small chunks; once it has committed some, its next chunk cannot have the
    // checkpoint table and fails (the operator's statement timeout cancels it)
    let mut interrupted: Vec<&str> = args.to_vec();
    interrupted.extend(["--statement-timeout-ms", "1000"]);
    let running = tokio::spawn({
        let url = database.url();
        let args: Vec<String> = interrupted.iter().map(|a| a.to_string()).collect();
        async move {
            tokio::process::Command::new(BIN)
                .args(args)
                .env("DATABASE_URL", url)
                .env("RUST_LOG", "warn")
                .output()
                .await
                .unwrap()
        }
    });
    let mut blocker = PgConnection::connect_with(&database.options).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let chunks: Option<i64> = sqlx::query_scalar(
            "SELECT min(chunks) FROM audit_checkpoints WHERE run = $1 AND proof = 'oversell'",
        )
        .bind(&run)
        .fetch_one(&mut blocker)
        .await
        .unwrap();
        if chunks.unwrap_or(0) >= 3 {
            break;
        }
        assert!(
            !running.is_finished(),
            "the run ended before its third chunk: {:?}",
            running.await.unwrap()
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "the run never proved three chunks"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut lock = blocker.begin().await.unwrap();
    sqlx::query("LOCK TABLE audit_checkpoints IN EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let output = running.await.unwrap();
    lock.rollback().await.unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("statement timeout"), "{stderr}");
    let stopped_at: OffsetDateTime =
        sqlx::query_scalar("SELECT max(proven_until) FROM audit_checkpoints WHERE run = $1")
            .bind(&run)
            .fetch_one(&mut blocker)
            .await
            .unwrap();

    // the same command again continues from the checkpoint
    let resumed = credpool(&database, &args, &[]).await;
    assert!(!resumed.success, "two oversells: {}", resumed.stdout);
    let resumed = resumed.report();
    assert_eq!(
        resumed["resumed_from"],
        stopped_at.format(&Rfc3339).unwrap(),
        "{}",
        resumed["checkpoints"]
    );
    assert!(stopped_at > OffsetDateTime::parse(&since, &Rfc3339).unwrap());
    assert_eq!(
        resumed["grants_over_limit"], 2,
        "{}",
        resumed["checkpoints"]
    );

    // a finished range is proven again from scratch: the same findings
    let whole = credpool(&database, &args, &[]).await.report();
    assert_eq!(
        whole["resumed_from"],
        Value::Null,
        "{}",
        whole["checkpoints"]
    );
    for field in [
        "credentials",
        "tenants",
        "grants_over_limit",
        "grants_over_cap",
    ] {
        assert_eq!(resumed[field], whole[field], "{field}");
    }
    // and the one-statement proof of the range agrees
    let over: i64 = sqlx::query_scalar(
        "SELECT sum(grants_over_limit)::bigint FROM credpool_oversell_check($1::timestamptz, $2::timestamptz)",
    )
    .bind(&since)
    .bind(&until)
    .fetch_one(&db)
    .await
    .unwrap();
    assert_eq!(over, 2);
}

#[tokio::test]
async fn the_continuous_proof_finds_an_oversell_written_after_its_checkpoint_and_metrics_show_it() {
    let database = TestDatabase::create().await;
    let mut envs = keyed_env(&database);
    envs.push(("CREDPOOL_MAINTENANCE_INTERVAL_SECONDS", "1".into()));
    envs.push(("CREDPOOL_METRICS_SAMPLE_SECONDS", "1".into()));
    let serve = ServeProcess::start(BIN, &envs, &[]).await;
    let client = client();
    let put = client
        .put(format!("{}/api/admin/keys/solo", serve.base))
        .header("x-admin-key", ADMIN_KEY)
        .json(
            &json!({"provider": "openai", "pool": "default", "models": ["gpt-4o"],
                      "max_concurrent_uses": 1, "secret": {"api_key": "sk-solo"}}),
        )
        .send()
        .await
        .unwrap();
    assert!(put.status().is_success(), "{}", put.status());
    for _ in 0..3 {
        let lease = serve.allocate(gpt4o()).ok_json().await;
        let released = serve.release(release_body(&lease, "success")).await;
        json_body(released, StatusCode::OK).await;
    }
    let metrics = async || serve.metrics().await;
    let lag = |page: &str| {
        sample(
            page,
            r#"credpool_audit_proof_lag_seconds{proof="oversell"}"#,
        )
    };
    let violations = |page: &str| sample(page, r#"credpool_audit_violations{proof="oversell"}"#);
    let db = database.pool(2).await;
    // the maintenance pass has proven the traffic: the checkpoint is past the last grant
    let last_grant: OffsetDateTime = db
        .scalar("SELECT max(at) FROM lease_events WHERE event = 'granted'")
        .await;
    let page = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let proven: Option<OffsetDateTime> = db
                .scalar("SELECT min(proven_until) FROM audit_checkpoints WHERE run = 'continuous'")
                .await;
            let page = metrics().await;
            // the gauges are exported (a missing series samples as 0), the lag no longer +Inf
            let exported = page.contains(r#"credpool_audit_proof_lag_seconds{proof="oversell"}"#)
                && page.contains(r#"credpool_audit_violations{proof="oversell"}"#);
            if proven.is_some_and(|p| p > last_grant) && exported && lag(&page).is_finite() {
                return page;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the continuous proof did not prove the traffic");
    assert_eq!(violations(&page), 0.0);

    // after the checkpoint, a second lease held at once on the limit-1 credential
    db.run_sql("INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, lease_until, at, tenant)
         SELECT 'granted', gen_random_uuid(), 'solo', 'openai', 'default', 0,
                now() + interval '1 minute', now() + s * interval '1 ms', 'default'
         FROM generate_series(0, 1) s").await;
    let page = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let page = metrics().await;
            if violations(&page) > 0.0 {
                return page;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the continuous proof did not report the oversell in /metrics");
    assert_eq!(violations(&page), 1.0, "{page}");

    let ran = credpool(&database, &["audit", "verify", "--json"], &[]).await;
    assert!(!ran.success, "{}", ran.stdout);
    let report = ran.report();
    assert_eq!(report["grants_over_limit"], 1, "{report}");
    assert_eq!(report["continuous"]["violations"], 1, "{report}");
    assert!(serve.terminate().await.success());
}

// Random trails: a proof in many small chunks, the one-statement proofs over the whole range,
// and the rules computed here grant by grant, must find exactly the same.

/// A moment of a random trail: milliseconds after its start.
type Ms = i64;

/// A window: kind, seconds, count.
type Window = (&'static str, i64, i64);

/// A configuration row: when it took effect, the limit (or cap; `None`: no cap) and windows.
#[derive(Clone)]
struct Setting {
    at: Ms,
    allowed: Option<i64>,
    windows: Vec<Window>,
}

/// How a random lease ended.
enum End {
    Released {
        at: Ms,
        usage: Option<i64>,
    },
    ForceReleased {
        at: Ms,
    },
    Expired {
        reaped: bool,
        late_report: Option<(Ms, i64)>,
    },
}

struct RandomLease {
    key: usize,
    tenant: Option<usize>,
    granted: Ms,
    tokens: Option<i64>,
    /// (renewed at, new lease_until); the first is the grant's own lease_until at `granted`
    untils: Vec<(Ms, Ms)>,
    end: End,
}

impl RandomLease {
    fn lease_until(&self) -> Ms {
        self.untils.iter().map(|u| u.1).max().unwrap()
    }

    /// When it stops counting: its release, else its last lease_until.
    fn ends(&self) -> Ms {
        match self.end {
            End::Released { at, .. } | End::ForceReleased { at } => at,
            End::Expired { .. } => self.lease_until(),
        }
    }

    /// The usage it reported, and when.
    fn report(&self) -> Option<(Ms, i64)> {
        match self.end {
            End::Released { at, usage } => usage.map(|u| (at, u)),
            End::Expired { late_report, .. } => late_report,
            End::ForceReleased { .. } => None,
        }
    }
}

/// A random trail: credentials and tenants whose limits, caps and windows change over it, and
/// leases on them granted with no regard for any of it (so that the rules break often).
struct RandomTrail {
    /// Per credential: its configuration rows (none: the current settings alone), then its
    /// current settings.
    keys: Vec<(Vec<Setting>, Setting)>,
    tenants: Vec<(Vec<Setting>, Setting)>,
    leases: Vec<RandomLease>,
}

fn random_windows(rng: &mut StdRng) -> Vec<Window> {
    let mut windows = Vec::new();
    if rng.random_bool(0.5) {
        windows.push(("requests", rng.random_range(5..30), rng.random_range(2..6)));
    }
    if rng.random_bool(0.5) {
        windows.push((
            "tokens",
            rng.random_range(5..30),
            rng.random_range(200..900),
        ));
    }
    windows
}

fn random_settings(rng: &mut StdRng, capped: bool, rows: bool) -> (Vec<Setting>, Setting) {
    let setting = |rng: &mut StdRng, at| Setting {
        at,
        allowed: if capped || rng.random_bool(0.7) {
            Some(rng.random_range(1..4))
        } else {
            None
        },
        windows: random_windows(rng),
    };
    let current = setting(rng, 0);
    if !rows {
        return (Vec::new(), current);
    }
    let mut history = vec![setting(rng, -10_000)];
    for _ in 0..rng.random_range(0..3) {
        // on a whole second sometimes, where grants fall too
        let at = rng.random_range(0..6000) * 100;
        history.push(setting(rng, at));
    }
    history.sort_by_key(|s| s.at);
    let current = Setting {
        at: 0,
        ..history.last().unwrap().clone()
    };
    (history, current)
}

impl RandomTrail {
    fn new(seed: u64, leases: usize) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        // the last credential and tenant have no configuration rows: their current settings
        let keys = (0..4)
            .map(|i| random_settings(&mut rng, true, i < 3))
            .collect();
        let tenants = (0..3)
            .map(|i| random_settings(&mut rng, false, i < 2))
            .collect();
        let leases = (0..leases)
            .map(|_| {
                // whole 100 ms often, so that grants, ends and changes share instants
                let granted = rng.random_range(0..6000) * 100
                    + rng.random_range(0..2) * rng.random_range(1..100);
                let mut untils = vec![(granted, granted + rng.random_range(1_000..40_000))];
                for _ in 0..rng.random_range(0..3) {
                    let (at, until) = *untils.last().unwrap();
                    let renewed = rng.random_range(at + 1..until);
                    untils.push((renewed, renewed + rng.random_range(1_000..40_000)));
                }
                let live_from = untils.last().unwrap().0 + 1;
                let until = untils.iter().map(|u| u.1).max().unwrap();
                let end = match rng.random_range(0..10) {
                    0..6 => End::Released {
                        at: rng.random_range(live_from..until),
                        usage: rng.random_bool(0.6).then(|| rng.random_range(0..400)),
                    },
                    6 => End::ForceReleased {
                        at: rng.random_range(live_from..until),
                    },
                    _ => End::Expired {
                        reaped: rng.random_bool(0.5),
                        late_report: rng.random_bool(0.3).then(|| {
                            (until + rng.random_range(1..5_000), rng.random_range(0..400))
                        }),
                    },
                };
                RandomLease {
                    key: rng.random_range(0..4),
                    tenant: (rng.random_range(0..4) < 3).then(|| rng.random_range(0..3)),
                    granted,
                    tokens: rng.random_bool(0.8).then(|| rng.random_range(0..300)),
                    untils,
                    end,
                }
            })
            .collect();
        Self {
            keys,
            tenants,
            leases,
        }
    }

    fn windows_json(windows: &[Window]) -> Value {
        Value::Array(
            windows
                .iter()
                .map(|&(kind, seconds, count)| {
                    let mut window = serde_json::Map::new();
                    window.insert(kind.to_owned(), count.into());
                    window.insert("seconds".to_owned(), seconds.into());
                    Value::Object(window)
                })
                .collect(),
        )
    }

    /// Writes it into `db`, `t0` being its moment 0.
    async fn write(&self, db: &sqlx::PgPool, t0: OffsetDateTime) {
        let mut rows = Vec::new();
        let mut configs = Vec::new();
        for (i, (history, current)) in self.keys.iter().enumerate() {
            rows.push(json!({"table": "credentials", "id": format!("k{i}"),
                             "allowed": current.allowed,
                             "rate_limits": Self::windows_json(&current.windows)}));
            let mut old: Option<&Setting> = None;
            for s in history {
                let new = json!({"max_concurrent_uses": s.allowed,
                                 "rate_limits": Self::windows_json(&s.windows)});
                let details = match old {
                    None => json!({ "new": new }),
                    Some(o) => json!({"old": {"max_concurrent_uses": o.allowed,
                                              "rate_limits": Self::windows_json(&o.windows)},
                                      "new": new}),
                };
                configs.push(json!({"table": "credential_events", "id": format!("k{i}"),
                                    "event": if old.is_none() { "created" } else { "updated" },
                                    "at": s.at, "details": details}));
                old = Some(s);
            }
        }
        for (i, (history, current)) in self.tenants.iter().enumerate() {
            rows.push(json!({"table": "tenants", "id": format!("t{i}"),
                             "allowed": current.allowed,
                             "rate_limits": Self::windows_json(&current.windows)}));
            for (n, s) in history.iter().enumerate() {
                configs.push(json!({"table": "tenant_events", "id": format!("t{i}"),
                                    "event": if n == 0 { "created" } else { "updated" },
                                    "at": s.at, "allowed": s.allowed,
                                    "rate_limits": Self::windows_json(&s.windows)}));
            }
        }
        sqlx::query(
            "WITH r AS (SELECT * FROM jsonb_to_recordset($1) AS r(\"table\" text, id text,
                                                                allowed integer, rate_limits jsonb)),
             k AS (INSERT INTO credentials (key_id, provider, pool, models, max_concurrent_uses,
                                            rate_limits, secret)
                   SELECT id, 'openai', 'default', ARRAY['gpt-4o'], allowed, rate_limits, '{}'
                   FROM r WHERE \"table\" = 'credentials')
             INSERT INTO tenants (tenant_id, max_concurrent_leases, rate_limits)
             SELECT id, allowed, rate_limits FROM r WHERE \"table\" = 'tenants'",
        )
        .bind(Value::Array(rows))
        .execute(db)
        .await
        .unwrap();
        sqlx::query(
            "WITH r AS (SELECT * FROM jsonb_to_recordset($1) AS r(\"table\" text, id text, event text,
                                                                at bigint, details jsonb,
                                                                allowed integer, rate_limits jsonb)),
             c AS (INSERT INTO credential_events (key_id, event, reason, actor, details, at)
                   SELECT id, event, event, 'test', details, $2 + at * interval '1 ms'
                   FROM r WHERE \"table\" = 'credential_events')
             INSERT INTO tenant_events (tenant_id, event, max_concurrent_leases, weight, rate_limits,
                                        actor, at)
             SELECT id, event, allowed, 1, rate_limits, 'test', $2 + at * interval '1 ms'
             FROM r WHERE \"table\" = 'tenant_events'",
        )
        .bind(Value::Array(configs))
        .bind(t0)
        .execute(db)
        .await
        .unwrap();

        let mut events = Vec::new();
        for (n, l) in self.leases.iter().enumerate() {
            let id = format!("{:032x}", n as u128 + ((t0.unix_timestamp() as u128) << 64));
            let row = |event: &str, at: Ms, until: Ms| {
                json!({"event": event, "lease_id": id, "key_id": format!("k{}", l.key),
                       "tenant": l.tenant.map(|t| format!("t{t}")), "at": at,
                       "lease_until": until})
            };
            let mut granted = row("granted", l.granted, l.untils[0].1);
            granted["tokens"] = json!(l.tokens);
            events.push(granted);
            let mut until = l.untils[0].1;
            for &(at, new_until) in &l.untils[1..] {
                events.push(row("renewed", at, new_until));
                until = until.max(new_until);
            }
            match l.end {
                End::Released { at, usage } => {
                    let mut released = row("released", at, until);
                    released["outcome"] = json!("success");
                    released["tokens"] = json!(usage);
                    events.push(released);
                }
                End::ForceReleased { at } => events.push(row("force_released", at, until)),
                End::Expired {
                    reaped,
                    late_report,
                } => {
                    if reaped {
                        events.push(row("expired", until, until));
                    }
                    if let Some((at, tokens)) = late_report {
                        let mut report = row("outcome_after_expiry", at, until);
                        report["outcome"] = json!("success");
                        report["tokens"] = json!(tokens);
                        events.push(report);
                    }
                }
            }
        }
        sqlx::query(
            "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, outcome,
                                       lease_until, at, tokens, tenant)
             SELECT r.event, r.lease_id, r.key_id, 'openai', 'default', 0, r.outcome,
                    $2 + r.lease_until * interval '1 ms', $2 + r.at * interval '1 ms', r.tokens,
                    r.tenant
             FROM jsonb_to_recordset($1) AS r(event text, lease_id uuid, key_id text, outcome text,
                                              lease_until bigint, at bigint, tokens bigint,
                                              tenant text)",
        )
        .bind(Value::Array(events))
        .bind(t0)
        .execute(db)
        .await
        .unwrap();
    }

    /// What a setting history says at `at`: the latest row at or before it, else the current.
    fn setting_at(settings: &(Vec<Setting>, Setting), at: Ms) -> &Setting {
        settings
            .0
            .iter()
            .rev()
            .find(|s| s.at <= at)
            .unwrap_or(&settings.1)
    }

    /// The rules, grant by grant: per subject (and window), [grants, peak, violations] and the
    /// first violation (a moment), for the leases' subjects by `subject` (`Some(i)`: the i-th
    /// of `settings`).
    fn judge(
        &self,
        settings: &[(Vec<Setting>, Setting)],
        subject: impl Fn(&RandomLease) -> Option<usize>,
    ) -> (Lines, Lines) {
        let mut caps = Lines::new();
        let mut windows = Lines::new();
        for (s, config) in settings.iter().enumerate() {
            let mine: Vec<&RandomLease> = self
                .leases
                .iter()
                .filter(|l| subject(l) == Some(s))
                .collect();
            for g in &mine {
                let t = g.granted;
                let setting = Self::setting_at(config, t);
                // the leases held with it: every lease granted at the same moment counts, each
                // grant of the moment seeing one more than the one before
                let before = mine
                    .iter()
                    .filter(|l| l.granted < t && l.ends() > t)
                    .count() as i64;
                let same: Vec<&&RandomLease> = mine.iter().filter(|l| l.granted == t).collect();
                let rank = same.iter().position(|l| std::ptr::eq(**l, *g)).unwrap() as i64;
                let held = before + rank + 1;
                caps.add(
                    (s, "", 0),
                    None,
                    held,
                    setting.allowed.is_some_and(|a| held > a),
                    t,
                );
                for &(kind, seconds, count) in &setting.windows {
                    let charged: i64 = mine
                        .iter()
                        .filter(|l| l.granted > t - seconds * 1000 && l.granted <= t)
                        .map(|l| match kind {
                            "requests" => 1,
                            _ => match l.report() {
                                Some((at, usage)) if at < t => usage,
                                _ => l.tokens.unwrap_or(0),
                            },
                        })
                        .sum();
                    windows.add((s, kind, seconds), Some(count), charged, charged > count, t);
                }
            }
        }
        (caps, windows)
    }
}

/// A line's subject: (credential or tenant, window kind, window seconds; `""` and 0 for caps).
type Subject = (String, String, i64);

/// A line's figures: window count, [grants, peak, violations], first violation.
type Figures = (Option<i64>, [i64; 3], Option<OffsetDateTime>);

/// Lines of a proof, by subject.
#[derive(Debug, Default, PartialEq)]
struct Lines(BTreeMap<Subject, Figures>);

impl Lines {
    fn new() -> Self {
        Self::default()
    }

    fn add(
        &mut self,
        (s, kind, seconds): (usize, &str, i64),
        count: Option<i64>,
        charged: i64,
        over: bool,
        at: Ms,
    ) {
        // filled in with the subject's name and the moment's time by `named`
        let line = self
            .0
            .entry((s.to_string(), kind.to_owned(), seconds))
            .or_insert((None, [0, 0, 0], None));
        line.0 = line.0.max(count);
        line.1[0] += 1;
        line.1[1] = line.1[1].max(charged);
        if over {
            line.1[2] += 1;
            let at = OffsetDateTime::UNIX_EPOCH + time::Duration::milliseconds(at);
            line.2 = Some(line.2.map_or(at, |f| f.min(at)));
        }
    }

    /// With subjects named `prefix` + index and moments after `t0`.
    fn named(self, prefix: &str, t0: OffsetDateTime) -> Self {
        Self(
            self.0
                .into_iter()
                .map(|((s, kind, seconds), (count, figures, first))| {
                    let first = first.map(|f| t0 + (f - OffsetDateTime::UNIX_EPOCH));
                    (
                        (format!("{prefix}{s}"), kind, seconds),
                        (count, figures, first),
                    )
                })
                .collect(),
        )
    }
}

/// A run's findings as [`Lines`]: the concurrency proof's and the window proof's, per scope.
fn lines(found: &audit::Findings) -> [Lines; 4] {
    // a concurrency proof's line: whom, and its leases, peak and grants over the limit or cap
    let cap = |id: &str, figures: [i64; 3], first: Option<OffsetDateTime>| {
        ((id.to_owned(), String::new(), 0), (None, figures, first))
    };
    let windows = |rows: &[audit::WindowRow]| {
        Lines(
            rows.iter()
                .map(|w| {
                    (
                        (
                            w.subject.id().to_owned(),
                            w.kind.clone(),
                            i64::from(w.seconds),
                        ),
                        (
                            Some(w.window_count),
                            [w.grants, w.peak, w.grants_over_window],
                            w.first_violation_at,
                        ),
                    )
                })
                .collect(),
        )
    };
    let credentials = found.credentials.iter().map(|r| {
        let figures = [r.leases, r.peak, r.grants_over_limit];
        cap(&r.key_id, figures, r.first_violation_at)
    });
    let tenants = found.tenants.iter().map(|r| {
        let figures = [r.leases, r.peak, r.grants_over_cap];
        cap(&r.tenant_id, figures, r.first_violation_at)
    });
    [
        Lines(credentials.collect()),
        windows(&found.windows),
        Lines(tenants.collect()),
        windows(&found.tenant_windows),
    ]
}

#[tokio::test]
async fn incremental_proofs_find_exactly_what_one_proof_of_the_whole_trail_finds_on_random_trails()
{
    for seed in [1, 2, 3] {
        let database = TestDatabase::create().await;
        let db = database.pool(2).await;
        let t0: OffsetDateTime = db
            .scalar("SELECT date_trunc('second', now()) - interval '2 hours'")
            .await;
        let trail = RandomTrail::new(seed, 300);
        trail.write(&db, t0).await;

        // the continuous proof in chunks of a few rows: leases live across every boundary
        let mut conn = PgConnection::connect_with(&database.options).await.unwrap();
        let mut rng = StdRng::seed_from_u64(seed);
        loop {
            let advanced = audit::advance(&mut conn, &Run::Continuous, rng.random_range(3..40))
                .await
                .unwrap()
                .unwrap();
            if !advanced.more {
                break;
            }
        }
        let chunked = audit::findings(&mut conn, &Run::Continuous).await.unwrap();
        let chunks: i64 = sqlx::query_scalar(
            "SELECT min(chunks) FROM audit_checkpoints WHERE run = 'continuous'",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        assert!(chunks > 20, "{chunks} chunks");

        // one statement per proof over the whole trail
        let (since, until): (OffsetDateTime, OffsetDateTime) =
            sqlx::query_as("SELECT min(at), now() FROM lease_events")
                .fetch_one(&db)
                .await
                .unwrap();
        let whole = audit::Findings {
            credentials: audit::oversell_check(&db, since, until).await.unwrap(),
            windows: audit::window_check(&db, since, until).await.unwrap(),
            tenants: audit::tenant_cap_check(&db, since, until).await.unwrap(),
            tenant_windows: audit::tenant_window_check(&db, since, until).await.unwrap(),
        };

        // the rules, grant by grant
        let (limits, key_windows) = trail.judge(&trail.keys, |l| Some(l.key));
        let (caps, tenant_windows) = trail.judge(&trail.tenants, |l| l.tenant);
        let rules = [
            limits.named("k", t0),
            key_windows.named("k", t0),
            caps.named("t", t0),
            tenant_windows.named("t", t0),
        ];
        let violations: i64 = rules
            .iter()
            .flat_map(|l| l.0.values())
            .map(|v| v.1[2])
            .sum();
        assert!(
            violations > 10,
            "seed {seed}: a trail that breaks the rules"
        );
        let [chunked, whole] = [lines(&chunked), lines(&whole)];
        for (i, proof) in audit::PROOFS.iter().enumerate() {
            assert_eq!(chunked[i], rules[i], "seed {seed}, {proof}: chunked");
            assert_eq!(whole[i], rules[i], "seed {seed}, {proof}: one statement");
        }
    }
}
