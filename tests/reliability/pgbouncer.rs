//! Scenario 2: the race tests through PgBouncer in transaction pooling mode. The test starts its
//! own PgBouncer (Debian package `pgbouncer`) on a free port in front of the test server, with few
//! server connections (`default_pool_size = 10`) shared by many more clients, so that any state
//! left on a server connection beyond a transaction (a prepared statement, a session setting, a
//! session advisory lock, half of a Parse/Bind exchange) meets another client.
//!
//! With `--db-pooler transaction` (credpool's [`credpool::store::Db::transaction_pooled`]), 64
//! concurrent allocations give exactly `limit` winners every round, in process and across several
//! `credpool serve` processes that also renew and release, and the trail proves no oversell
//! (`credpool audit verify`). Without it, the same race through the same PgBouncer fails: the
//! mode is what makes credpool safe there.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use credpool::store::{self, Db};
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::postgres::PgConnectOptions;
use tokio::process::{Child, Command};

use credpool_test_support::*;

use crate::BIN;

const RACERS: usize = 64;
const LIMITS: [u32; 3] = [1, 2, 5];
/// Server connections PgBouncer opens per database and user: far fewer than its clients.
const SERVER_CONNECTIONS: u32 = 10;

/// A PgBouncer in transaction pooling mode in front of the test server, listening on a free
/// port of 127.0.0.1; killed when dropped.
struct Bouncer {
    port: u16,
    dir: tempfile::TempDir,
    _child: Child,
}

/// The pgbouncer binary: on PATH or in /usr/sbin (Debian's package installs it there).
fn pgbouncer_binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
        .map(|dir| dir.join("pgbouncer"))
        .find(|candidate| candidate.is_file())
        .expect(
            "pgbouncer is not installed (not on PATH, not in /usr/sbin): this test needs it \
             (Debian/Ubuntu: apt-get install pgbouncer)",
        )
}

/// The user PgBouncer runs as: the current one, or as root (PgBouncer refuses to run as root)
/// `postgres` if it exists, else `nobody` — as credpool's embedded cluster does.
fn unprivileged_user() -> Option<nix::unistd::User> {
    if !nix::unistd::geteuid().is_root() {
        return None;
    }
    ["postgres", "nobody"]
        .into_iter()
        .find_map(|name| nix::unistd::User::from_name(name).ok().flatten())
        .or_else(|| panic!("running as root, and neither a `postgres` nor a `nobody` user exists to run pgbouncer as"))
}

impl Bouncer {
    /// Starts PgBouncer in front of the server of `database` (every database on it, as the
    /// connecting user) and waits until it accepts connections.
    async fn start(database: &TestDatabase) -> Self {
        let binary = pgbouncer_binary();
        let user = unprivileged_user();
        let dir = tmp_dir("credpool-pgbouncer-");
        let port = free_port();
        let server = &database.options;
        let config = format!(
            "[databases]\n\
             * = host={host} port={server_port}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/users.txt\n\
             pool_mode = transaction\n\
             server_reset_query = DISCARD ALL\n\
             server_reset_query_always = 1\n\
             default_pool_size = {SERVER_CONNECTIONS}\n\
             max_client_conn = 1000\n\
             ignore_startup_parameters = extra_float_digits\n\
             logfile = {dir}/pgbouncer.log\n",
            // a socket directory, for a server that has no TCP port
            host = server.get_socket().map_or_else(
                || server.get_host().to_owned(),
                |dir| dir.display().to_string()
            ),
            server_port = server.get_port(),
            dir = dir.path().display(),
        );
        std::fs::write(dir.path().join("pgbouncer.ini"), config).unwrap();
        std::fs::write(
            dir.path().join("users.txt"),
            format!("\"{}\" \"\"\n", server.get_username()),
        )
        .unwrap();
        let mut command = Command::new(&binary);
        command
            .arg(dir.path().join("pgbouncer.ini"))
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        if let Some(user) = &user {
            for path in [
                dir.path().to_path_buf(),
                dir.path().join("pgbouncer.ini"),
                dir.path().join("users.txt"),
            ] {
                nix::unistd::chown(&path, Some(user.uid), Some(user.gid)).unwrap();
            }
            command.uid(user.uid.as_raw()).gid(user.gid.as_raw());
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
        for _ in 0..200 {
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "pgbouncer exited at start-up ({status}); its log:\n{}",
                    log_of(dir.path())
                );
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return Self {
                    port,
                    dir,
                    _child: child,
                };
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "pgbouncer did not listen on port {port} within 10 s; its log:\n{}",
            log_of(dir.path())
        );
    }

    /// Connection options for `database` through PgBouncer.
    fn options(&self, database: &TestDatabase) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username(database.options.get_username())
            .database(&database.name)
    }

    /// A `postgres://` URL for `database` through PgBouncer, for child processes.
    fn url(&self, database: &TestDatabase) -> String {
        format!(
            "postgres://{}@127.0.0.1:{}/{}",
            database.options.get_username(),
            self.port,
            database.name
        )
    }

    /// What PgBouncer logged so far.
    fn log(&self) -> String {
        log_of(self.dir.path())
    }
}

fn log_of(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default()
}

/// A pool through PgBouncer as `credpool serve --db-pooler transaction` builds it: no cached
/// prepared statements, the statement timeout set by each transaction.
fn pooled_db(bouncer: &Bouncer, database: &TestDatabase) -> Db {
    let pool = lazy_pool(
        bouncer.options(database).statement_cache_capacity(0),
        RACERS as u32,
        Duration::from_secs(10),
    );
    Db::transaction_pooled(pool, Some(Duration::from_secs(5)))
}

/// Stores credential `key_id` (gpt-4o, in a pool of its own name) with `limit` slots through
/// `replica`; panics unless stored.
async fn put_key(replica: &Remote, key_id: &str, limit: u32) {
    let response = replica
        .put_key_raw(
            key_id,
            json!({
                "provider": "openai", "pool": key_id, "models": ["gpt-4o"],
                "max_concurrent_uses": limit, "secret": {"api_key": format!("sk-test-{key_id}")},
            }),
        )
        .await;
    let status = response.status();
    assert!(
        status.is_success(),
        "PUT {key_id}: {status} {}",
        response.text().await.unwrap_or_default()
    );
}

/// What one race round saw.
struct Round {
    /// The granted leases (allocate bodies).
    won: Vec<Value>,
    /// 429s.
    busy: usize,
    /// Any other status, with its body.
    other: Vec<(StatusCode, String)>,
}

/// One round: a fresh credential with `limit` slots in its own pool (stored through the first of
/// `replicas`), then 64 allocations of it, spread over `replicas` in turn, released at once by a
/// barrier.
async fn race_round(replicas: &[Remote], key_id: &str, limit: u32) -> Round {
    put_key(&replicas[0], key_id, limit).await;
    let bodies = (0..RACERS).map(|i| {
        json!({
            "provider": "openai", "model": "gpt-4o", "pool": key_id,
            "lease_seconds": 600, "holder": format!("racer-{i}"),
        })
    });
    let mut round = Round {
        won: Vec::new(),
        busy: 0,
        other: Vec::new(),
    };
    for answer in allocate_at_once(replicas, INTERNAL_KEY, bodies.collect()).await {
        match answer.status {
            StatusCode::OK => round.won.push(serde_json::from_str(&answer.text).unwrap()),
            StatusCode::TOO_MANY_REQUESTS => round.busy += 1,
            other => round.other.push((other, answer.text)),
        }
    }
    round
}

/// Asserts that a round had exactly `limit` winners, everyone else a 429, and that the
/// database holds exactly the winners' leases.
async fn assert_exact(
    round: &Round,
    limit: u32,
    key_id: &str,
    direct: &sqlx::PgPool,
    bouncer: &Bouncer,
) {
    assert!(
        round.other.is_empty(),
        "{key_id}: statuses other than 200 and 429: {:?}\npgbouncer log:\n{}",
        round.other,
        bouncer.log()
    );
    assert_eq!(
        round.won.len(),
        limit as usize,
        "{key_id}: {} winners on a limit-{limit} credential",
        round.won.len()
    );
    assert_eq!(round.busy, RACERS - limit as usize, "{key_id}");
    assert_eq!(
        in_flight(direct, key_id).await,
        i64::from(limit),
        "{key_id}: the database disagrees with the responses"
    );
}

/// Renews (through `renew_at`) then releases (through `release_at`) every lease a round won;
/// each must succeed.
async fn renew_and_release(round: &Round, renew_at: &Remote, release_at: &Remote) {
    for lease in &round.won {
        renew_at.renew(renew_body(lease, 120)).ok_json().await;
        let released = release_at.release(release_body(lease, "success"));
        assert_eq!(released.ok_json().await, json!({"released": true}));
    }
}

/// [`race_rounds`] rounds of a race for each of [`LIMITS`] over `replicas`, each on a credential
/// of its own (`<name>-<limit>-<round>`): exact winners ([`assert_exact`]), every lease renewed
/// and released through the pair of `renew_and_release`, and none left held.
async fn race_rounds_of_every_limit(
    name: &str,
    replicas: &[Remote],
    (renew_at, release_at): (&Remote, &Remote),
    direct: &sqlx::PgPool,
    bouncer: &Bouncer,
) {
    for round in 0..race_rounds() {
        for limit in LIMITS {
            let key_id = format!("{name}-{limit}-{round}");
            let result = race_round(replicas, &key_id, limit).await;
            assert_exact(&result, limit, &key_id, direct, bouncer).await;
            renew_and_release(&result, renew_at, release_at).await;
            assert_eq!(in_flight(direct, &key_id).await, 0, "{key_id}: released");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_race_through_pgbouncer_has_exact_winners_every_round_in_pooler_mode() {
    let _turn = race_turn().await;
    let database = TestDatabase::create().await;
    let bouncer = Bouncer::start(&database).await;
    let (addr, _stop) = serve(pooled_db(&bouncer, &database), &AppOptions::default()).await;
    let replicas = [Remote::at(addr)];
    let direct = database.pool(2).await;
    let one = &replicas[0];
    race_rounds_of_every_limit("race", &replicas, (one, one), &direct, &bouncer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serve_processes_through_pgbouncer_race_renew_and_release_without_oversell() {
    let _turn = race_turn().await;
    let database = TestDatabase::create().await;
    let bouncer = Bouncer::start(&database).await;
    let mut env = keyed_env_at(bouncer.url(&database), 16);
    env.push(("CREDPOOL_DB_POOLER", "transaction".to_owned()));
    let mut processes = Vec::new();
    for _ in 0..3 {
        processes.push(ServeProcess::start(BIN, &env, &[]).await);
    }
    let replicas: Vec<Remote> = processes.iter().map(ServeProcess::remote).collect();
    let direct = database.pool(2).await;
    // renewed and released by other processes than the ones that granted them
    let others = (&replicas[1], &replicas[2]);
    race_rounds_of_every_limit("replicas", &replicas, others, &direct, &bouncer).await;
    for process in processes {
        assert!(
            process.terminate().await.success(),
            "a replica did not stop cleanly"
        );
    }
    audit_passes(BIN, &database).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_race_through_pgbouncer_fails_without_pooler_mode() {
    let _turn = race_turn().await;
    let database = TestDatabase::create().await;
    let bouncer = Bouncer::start(&database).await;
    // a direct-mode pool pointed at PgBouncer (without the statement-timeout startup parameter,
    // which PgBouncer would reject outright): statements outside transactions, cached prepared
    // statements
    let pool = lazy_pool(
        bouncer.options(&database),
        RACERS as u32,
        Duration::from_secs(10),
    );
    let (addr, _stop) = serve(Db::direct(pool), &AppOptions::default()).await;
    let replicas = [Remote::at(addr)];
    let mut failed = Vec::new();
    for round in 0..race_rounds().min(10) {
        for limit in LIMITS {
            let key_id = format!("unsafe-{limit}-{round}");
            // storing the credential itself may already fail
            let response = replicas[0]
                .put_key_raw(
                    &key_id,
                    json!({
                        "provider": "openai", "pool": key_id, "models": ["gpt-4o"],
                        "max_concurrent_uses": limit, "secret": {"api_key": "sk-test"},
                    }),
                )
                .await;
            if !response.status().is_success() {
                failed.push((response.status(), response.text().await.unwrap_or_default()));
                continue;
            }
            let bodies = vec![gpt4o_in(&key_id); RACERS];
            for answer in allocate_at_once(&replicas, INTERNAL_KEY, bodies).await {
                if answer.status != StatusCode::OK && answer.status != StatusCode::TOO_MANY_REQUESTS
                {
                    failed.push((answer.status, answer.text));
                }
            }
        }
        if !failed.is_empty() {
            break;
        }
    }
    assert!(
        !failed.is_empty(),
        "every request succeeded through a transaction pooler without --db-pooler transaction: \
         this test no longer shows what the mode is for"
    );
    println!(
        "without pooler mode: {} failed requests, e.g. {:?}",
        failed.len(),
        failed.first()
    );
}

#[tokio::test]
async fn pooler_mode_start_up_refuses_pending_migrations_and_skips_applied_ones() {
    let database = TestDatabase::create().await;
    let bouncer = Bouncer::start(&database).await;
    let direct = database.pool(1).await;
    let latest = store::latest_migration();
    direct
        .run_sql_with(
            "UPDATE _sqlx_migrations SET version = -version WHERE version = $1",
            latest,
        )
        .await;
    let mut env = keyed_env(&database);
    env.retain(|(name, _)| *name != "DATABASE_URL");
    env.push(("DATABASE_URL", bouncer.url(&database)));
    env.push(("CREDPOOL_DB_POOLER", "transaction".to_owned()));
    let output = Command::new(BIN)
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env("RUST_LOG", "warn")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "started with a pending migration");
    assert!(
        stderr.contains("credpool migrate"),
        "the error does not say what to do: {stderr}"
    );
    // put back as it was: the next start-up has nothing to apply and runs no migrator
    direct
        .run_sql_with(
            "UPDATE _sqlx_migrations SET version = -version WHERE version = $1",
            -latest,
        )
        .await;
    let process = ServeProcess::start(BIN, &env, &[]).await;
    let ready = client()
        .get(format!("{}/readyz", process.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), StatusCode::OK);
    assert!(process.terminate().await.success());
}
