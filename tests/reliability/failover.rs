//! Reliability scenario 10: the primary lost under load, on a real failover engine.
//!
//! The test starts its own pg_auto_failover formation from Debian's packages
//! (`postgresql-15-auto-failover`, `pg-auto-failover-cli`): a monitor, a primary and a
//! synchronous secondary (`synchronous_standby_names = 'ANY 1 (...)'`), each on a free port of
//! 127.0.0.1, run as an unprivileged user. `credpool migrate` and `credpool serve` get the
//! multi-host URL `postgres://postgres@127.0.0.1:P1,127.0.0.1:P2/credpool` (read-write by
//! default) and nothing else: no one tells credpool which node is the primary.
//!
//! 64 executors lease through the client crate (`credpool-client`) via a recording proxy, which
//! keeps every answer the service gave: 52 on a pool with more slots than executors (a 429 there
//! would be a lie), 12 of them renewing 2-second leases every 200 ms; 8 waiting (`wait`) on a
//! pool of 4 slots; 4 long leases, granted before the failover and renewed across it. Leases are
//! held 50-500 ms. Then the primary goes away, once by a planned switchover and once by SIGKILL of
//! its keeper and postmaster (a lost machine: with its keeper alive, pg_auto_failover would
//! restart the postmaster in place instead of failing over). Asserts:
//! - every answer is one the API's table allows: during the outage allocations wait for a
//!   connection and are granted, or answer 503 `store_unavailable` (never 500; never 429 while
//!   slots are free; a switchover may cause no 503 at all), and grants resume on their own;
//! - every lease answered 200 is in the new primary's trail (`lease_events` `granted`), once; the
//!   oversell proof (`credpool audit verify`, through the same multi-host URL) passes; fences
//!   granted after the failover are above every fence granted before it;
//! - the long leases from before the failover renew and release after it;
//! - after the switchover, the standby made asynchronous, a new `credpool serve` warns at start-up.
//!
//! The outage window (the longest stretch without a grant, from the failover's start to the first
//! grant after the new primary took writes) and the 503 count are printed; docs/reliability.md
//! keeps the figures.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode as HttpStatus;
use axum::response::{IntoResponse, Response};
use credpool::store::Target;
use credpool::store::failover::{Server, connect_writable, server_of};
use credpool_client::{Client, Error as ClientError, LeaseRequest, Outcome, RetryPolicy};
use nix::sys::signal::{Signal, kill};
use nix::unistd::{Pid, User};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use credpool_test_support::*;

use crate::BIN;

const PROVIDER: &str = "ha";
const MODEL: &str = "gpt-4o";
/// The formation's database (created by `pg_autoctl create postgres --dbname`).
const DATABASE: &str = "credpool";
/// Executors on the roomy pool (`default`: 16 credentials of limit 4, 64 slots), the last
/// `RENEWING` of them renewing short leases.
const ROOMY: usize = 52;
const ROOMY_CREDENTIALS: usize = 16;
const ROOMY_LIMIT: u32 = 4;
const RENEWING: usize = 12;
/// Executors that wait for a slot on the tight pool (2 credentials of limit 2).
const WAITING: usize = 8;
/// Long leases granted before the failover and renewed across it (pool `held`, limit 1 each).
const HELD: usize = 4;
/// Load before the failover, and after the service is back.
const BEFORE: Duration = Duration::from_secs(4);
const AFTER: Duration = Duration::from_secs(4);

/// One failover test at a time: each starts three PostgreSQL servers and 64 executors on a
/// 2-core CI machine, and the outage figures are only comparable without the other one running.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_planned_switchover_under_load_loses_no_lease_and_the_service_follows_the_new_primary() {
    let Some(engine) = Engine::find() else { return };
    let _turn = ONE_AT_A_TIME.lock().await;
    let formation = Formation::start(engine).await;
    let mut run = Run::start(&formation).await;
    assert!(
        !run.log().contains("database replication:"),
        "a replication warning with a synchronous standby:\n{}",
        run.log()
    );
    run.load(BEFORE).await;
    let old = formation.primary().await;
    let standby = if old == "node1" { "node2" } else { "node1" };
    let promoted = formation.watch_writable(standby);
    let failed_at = Instant::now();
    formation.switchover().await;
    let new = formation.primary().await;
    assert_eq!(new, standby, "the switchover did not promote the standby");
    let writable_at = formation.writable(promoted).await;
    let report = run.finish(&formation, failed_at, writable_at).await;
    eprintln!("switchover ({old} -> {new}): {report}");

    // the new primary's standby (the old primary) made asynchronous: start-up says so (before
    // it listens; the process is killed once it does)
    formation.make_standby_async().await;
    let (serve, log) = Run::serve(&formation, "async").await;
    drop(serve);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("database replication:")
            && text.contains("synchronous_standby_names is empty"),
        "no warning about asynchronous replication at start-up:\n{text}"
    );
    formation.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_primary_killed_under_load_fails_over_loses_no_lease_and_the_service_follows() {
    let Some(engine) = Engine::find() else { return };
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut formation = Formation::start(engine).await;
    let mut run = Run::start(&formation).await;
    run.load(BEFORE).await;
    let old = formation.primary().await;
    let standby = if old == "node1" { "node2" } else { "node1" };
    let promoted = formation.watch_writable(standby);
    let failed_at = Instant::now();
    formation.kill(&old);
    let writable_at = formation.writable(promoted).await;
    let new = formation.primary().await;
    assert_eq!(new, standby, "the standby was not promoted");
    let report = run.finish(&formation, failed_at, writable_at).await;
    eprintln!("killed primary ({old} -> {new}): {report}");
    formation.stop().await;
}

/// `host:port` of a server for a multi-host URL (a socket directory percent-encoded).
fn url_host(options: &sqlx::postgres::PgConnectOptions) -> String {
    match options.get_socket() {
        Some(dir) => format!(
            "{}:{}",
            dir.display().to_string().replace('/', "%2F"),
            options.get_port()
        ),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    }
}

#[tokio::test]
async fn a_multi_host_url_skips_a_dead_host_for_migrate_the_cli_and_serve() {
    let database = TestDatabase::create().await;
    // a port nobody listens on comes first
    let url = format!(
        "postgres://{}@127.0.0.1:{},{}/{}",
        database.options.get_username(),
        free_port(),
        url_host(&database.options),
        database.name
    );
    let credpool = async |args: &[&str]| {
        let ran = run(credpool_command(BIN, &url)
            .args(args)
            .env("CREDPOOL_MASTER_KEY", MASTER_KEY))
        .await;
        assert!(ran.success, "credpool {args:?}: {}", ran.printed());
        ran.stdout
    };
    credpool(&["migrate"]).await;
    let env = keyed_env_at(url.clone(), 8);
    let serve = ServeProcess::start(BIN, &env, &[]).await;
    let app = reqwest::Client::new();
    let response = app
        .put(format!("{}/api/admin/keys/k1", serve.base))
        .header("x-admin-key", ADMIN_KEY)
        .json(
            &json!({"provider": PROVIDER, "pool": "default", "models": [MODEL],
                      "max_concurrent_uses": 1, "secret": {"api_key": "sk-1"}}),
        )
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success());
    let lease = client(&serve.base, 0.3)
        .lease(LeaseRequest::new(PROVIDER, MODEL))
        .await
        .unwrap();
    assert!(lease.finish(Outcome::Success).await.unwrap().released);
    let listed: Value = serde_json::from_str(&credpool(&["keys", "list", "--json"]).await).unwrap();
    assert!(listed.to_string().contains("\"k1\""), "{listed}");
    assert!(serve.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_leaves_a_server_that_turns_read_only_and_follows_the_writable_one() {
    // two independent servers stand in for a primary and a standby: "failover" is turning
    // the first read-only and the second writable, then back
    let dirs: Vec<tempfile::TempDir> = (0..2).map(|_| tmp_dir("credpool-follow-")).collect();
    let mut clusters = Vec::new();
    for dir in &dirs {
        clusters.push(
            credpool::embedded::EmbeddedCluster::start(dir.path(), None)
                .await
                .unwrap(),
        );
    }
    let options: Vec<_> = clusters.iter().map(|c| c.connect_options()).collect();
    let read_only = async |index: usize, on: bool| {
        // its own session stays writable, whatever the server's default
        let admin = options[index]
            .clone()
            .options([("default_transaction_read_only", "off")]);
        let conn = PgConnection::connect_with(&admin).await.unwrap();
        let statement = if on {
            "ALTER SYSTEM SET default_transaction_read_only = on"
        } else {
            "ALTER SYSTEM RESET default_transaction_read_only"
        };
        run_and_close(conn, &[statement, "SELECT pg_reload_conf()"]).await;
    };
    let dir_of = |index: usize| options[index].get_socket().unwrap().clone();
    read_only(1, true).await;
    let url = format!(
        "postgres://{}@{},{}/{}",
        options[0].get_username(),
        url_host(&options[0]),
        url_host(&options[1]),
        credpool::embedded::DATABASE
    );
    let target = Target::parse(&url).unwrap();
    assert!(target.checks());
    let (conn, at) = connect_writable(&target, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(at, 0);
    drop(conn);
    let settings = credpool::store::PoolSettings {
        max_connections: 4,
        acquire_timeout: Duration::from_secs(1),
    };
    let db = credpool::store::Db::connect_lazy(&target, at, &settings);
    // which server a unit of work ran on (its socket directory), and whether it could write
    let on = async || -> Result<(PathBuf, String), sqlx::Error> {
        let mut work = db.work().await?;
        let (socket, read_only): (String, String) = sqlx::query_as(
            "SELECT current_setting('unix_socket_directories'),
                    current_setting('transaction_read_only')",
        )
        .fetch_one(&mut *work)
        .await?;
        work.done().await?;
        Ok((PathBuf::from(socket), read_only))
    };
    let follow = async |to: usize| -> usize {
        let since = Instant::now();
        let mut timeouts = 0;
        loop {
            match on().await {
                Ok((dir, read_only)) => {
                    assert_eq!(read_only, "off", "a unit of work ran on a read-only server");
                    if dir == dir_of(to) {
                        return timeouts;
                    }
                }
                Err(sqlx::Error::PoolTimedOut) => timeouts += 1,
                Err(error) => panic!("{error}"),
            }
            assert!(
                since.elapsed() < Duration::from_secs(20),
                "the pool did not move to server {to}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    assert_eq!(on().await.unwrap().0, dir_of(0));
    // fill the pool: idle connections to the first server
    let held: Vec<_> = futures::future::join_all((0..4).map(|_| db.acquire())).await;
    drop(held);
    // "failover" to the second server
    read_only(0, true).await;
    read_only(1, false).await;
    let first = follow(1).await;
    // and back
    read_only(1, true).await;
    read_only(0, false).await;
    let second = follow(0).await;
    eprintln!("pool followed the writable server; acquire timeouts on the way: {first}, {second}");
    // a pool of its own on the same servers (the LISTEN connection's) is on the writable one
    let sibling = db.sibling(1);
    let mut work = sibling.work().await.unwrap();
    let socket: String = sqlx::query_scalar("SELECT current_setting('unix_socket_directories')")
        .fetch_one(&mut *work)
        .await
        .unwrap();
    assert_eq!(PathBuf::from(socket), dir_of(0));
    drop(work);
    sibling.pool().close().await;
    db.pool().close().await;
    for cluster in clusters {
        cluster.stop().await;
    }
}

// ---------------------------------------------------------------------------------------------
// The engine: pg_auto_failover from Debian's packages.

/// Where pg_auto_failover is installed, and the user its servers run as.
struct Engine {
    autoctl: PathBuf,
    pg_bin: PathBuf,
    /// As root: `postgres` (PostgreSQL refuses root; the formation's Unix sockets go to
    /// /var/run/postgresql, which belongs to it). Otherwise the current user.
    user: Option<User>,
}

impl Engine {
    /// The installed engine; without it, a panic that says what to install, or `None` (the test
    /// is skipped) when `CREDPOOL_TEST_SKIP_FAILOVER` is set.
    fn find() -> Option<Self> {
        let autoctl = PathBuf::from("/usr/bin/pg_autoctl");
        let pg_bin = std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|dir| {
                let version = dir.file_name().to_string_lossy().into_owned();
                Path::new(&format!(
                    "/usr/share/postgresql/{version}/extension/pgautofailover.control"
                ))
                .is_file()
            })
            .map(|dir| dir.path().join("bin"))
            .max();
        match (autoctl.is_file(), pg_bin) {
            (true, Some(pg_bin)) => {
                let user = nix::unistd::geteuid().is_root().then(|| {
                    User::from_name("postgres")
                        .ok()
                        .flatten()
                        .expect("running as root and no `postgres` user to run pg_auto_failover as")
                });
                Some(Self {
                    autoctl,
                    pg_bin,
                    user,
                })
            }
            _ if std::env::var_os("CREDPOOL_TEST_SKIP_FAILOVER").is_some() => {
                report_skipped(
                    "CREDPOOL_TEST_SKIP_FAILOVER is set and pg_auto_failover is not installed",
                );
                None
            }
            _ => panic!(
                "pg_auto_failover is not installed (Debian: apt-get install \
                 postgresql-15-auto-failover pg-auto-failover-cli); set \
                 CREDPOOL_TEST_SKIP_FAILOVER=1 to skip this test"
            ),
        }
    }

    /// `pg_autoctl ARGS` as the engine's user, with its configuration under `home`.
    fn command(&self, home: &Path, args: &[&str]) -> Command {
        let mut command = Command::new(&self.autoctl);
        command
            .args(args)
            .env_clear()
            .env("PATH", format!("{}:/usr/bin:/bin", self.pg_bin.display()))
            .env("HOME", home)
            .env("XDG_CONFIG_HOME", home.join("config"))
            .env("XDG_DATA_HOME", home.join("data"))
            .env("XDG_RUNTIME_DIR", home.join("run"))
            .current_dir(home)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        if let Some(user) = &self.user {
            command.uid(user.uid.as_raw()).gid(user.gid.as_raw());
        }
        command
    }
}

/// One `pg_autoctl ... --run` process (monitor or node) and its server.
struct Keeper {
    name: String,
    port: u16,
    pgdata: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Keeper {
    /// The postmaster's pid, from `postmaster.pid`.
    fn postmaster(&self) -> Option<Pid> {
        let text = std::fs::read_to_string(self.pgdata.join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok().map(Pid::from_raw)
    }

    /// SIGKILL to every `pg_autoctl` process of this keeper, then to its postmaster.
    fn kill(&mut self) {
        if let Some(pid) = self.child.as_ref().and_then(Child::id) {
            let root = Pid::from_raw(pid as i32);
            for pid in std::iter::once(root).chain(descendants(root)) {
                if command_line(pid).starts_with("pg_autoctl") {
                    let _ = kill(pid, Signal::SIGKILL);
                }
            }
        }
        // only a postmaster of this data directory (postmaster.pid outlives a killed one)
        if let Some(postmaster) = self.postmaster()
            && command_line(postmaster).contains(&*self.pgdata.to_string_lossy())
        {
            let _ = kill(postmaster, Signal::SIGKILL);
            // gone before anyone removes its data directory
            for _ in 0..100 {
                if !Path::new(&format!("/proc/{postmaster}")).exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.child = None;
    }
}

/// A node's state as the monitor sees it.
#[derive(Debug, Clone)]
struct NodeState {
    name: String,
    reported: String,
    goal: String,
}

/// A pg_auto_failover formation: a monitor and two nodes, in a temporary directory.
struct Formation {
    engine: Engine,
    dir: tempfile::TempDir,
    monitor: Keeper,
    nodes: Vec<Keeper>,
}

impl Formation {
    /// Starts the monitor (with health checks tuned for a test: a node that does not answer for
    /// about 2 s is failed over), then node1 (the primary) and node2 (its synchronous standby),
    /// and waits until node2 is a streaming `secondary`.
    async fn start(engine: Engine) -> Self {
        let started = Instant::now();
        let dir = tmp_dir("credpool-failover-");
        // pg_autoctl keeps its pid files in XDG_RUNTIME_DIR only when that directory exists;
        // otherwise in /tmp/pg_autoctl/<pgdata>, which would outlive the test
        let run = dir.path().join("run");
        std::fs::create_dir(&run).unwrap();
        std::fs::set_permissions(&run, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .unwrap();
        if let Some(user) = &engine.user {
            for path in [dir.path(), run.as_path()] {
                nix::unistd::chown(path, Some(user.uid), Some(user.gid)).unwrap();
            }
        }
        let keeper = |name: &str| Keeper {
            name: name.to_owned(),
            port: free_port(),
            pgdata: dir.path().join(name),
            log: dir.path().join(format!("{name}.log")),
            child: None,
        };
        let mut formation = Formation {
            monitor: keeper("monitor"),
            nodes: vec![keeper("node1"), keeper("node2")],
            engine,
            dir,
        };
        formation.monitor.child = Some(formation.create(&formation.monitor, "monitor", &[]));
        let mut monitor = formation
            .connect(formation.monitor.port, "pg_auto_failover", "the monitor")
            .await;
        let since = Instant::now();
        while sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_extension WHERE extname = 'pgautofailover'",
        )
        .fetch_one(&mut monitor)
        .await
        .unwrap()
            == 0
        {
            assert!(
                since.elapsed() < Duration::from_secs(60),
                "the monitor has no pgautofailover extension after 60 s:\n{}",
                formation.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        run_and_close(
            monitor,
            &[
                "ALTER SYSTEM SET pgautofailover.health_check_period = 1000",
                "ALTER SYSTEM SET pgautofailover.health_check_timeout = 1000",
                "ALTER SYSTEM SET pgautofailover.health_check_max_retries = 1",
                "ALTER SYSTEM SET pgautofailover.health_check_retry_delay = 500",
                "ALTER SYSTEM SET pgautofailover.node_considered_unhealthy_timeout = 2000",
                // the killed node's keeper is dead too: nothing can demote it, no need to wait
                "ALTER SYSTEM SET pgautofailover.primary_demote_timeout = 2000",
                "SELECT pg_reload_conf()",
            ],
        )
        .await;

        formation.start_node(0);
        formation
            .wait_until("node1 runs as a single primary", |nodes| {
                nodes
                    .iter()
                    .any(|n| n.name == "node1" && n.reported == "single")
            })
            .await;
        // pg_basebackup of node2 starts with a spread checkpoint, paced at 10 buffers a second
        // over what initdb and createdb dirtied (about 90 s): leave it nothing to write
        let node1 = formation
            .connect(formation.nodes[0].port, DATABASE, "node1")
            .await;
        run_and_close(node1, &["CHECKPOINT"]).await;
        formation.start_node(1);
        formation
            .wait_until("node2 streams as a synchronous secondary", |nodes| {
                nodes
                    .iter()
                    .any(|n| n.name == "node1" && n.reported == "primary" && n.goal == "primary")
                    && nodes
                        .iter()
                        .any(|n| n.name == "node2" && n.reported == "secondary")
            })
            .await;
        let mut primary = formation
            .connect(formation.nodes[0].port, DATABASE, "node1")
            .await;
        let names: String =
            sqlx::query_scalar("SELECT current_setting('synchronous_standby_names')")
                .fetch_one(&mut primary)
                .await
                .unwrap();
        assert!(!names.is_empty(), "node2 is not a synchronous standby");
        primary.close().await.unwrap();
        eprintln!(
            "pg_auto_failover formation up in {:.1} s (monitor :{}, node1 :{}, node2 :{}; {names})",
            started.elapsed().as_secs_f64(),
            formation.monitor.port,
            formation.nodes[0].port,
            formation.nodes[1].port
        );
        formation
    }

    /// Runs `pg_autoctl create <what>` for `keeper` on its port and data directory, trusting
    /// every local connection, with `extra` arguments; its output goes to the keeper's log.
    fn create(&self, keeper: &Keeper, what: &str, extra: &[&str]) -> Child {
        let (port, pgdata) = (keeper.port.to_string(), keeper.pgdata.display().to_string());
        let mut args = vec![
            "create",
            what,
            "--pgdata",
            &pgdata,
            "--pgport",
            &port,
            "--hostname",
            "127.0.0.1",
            "--auth",
            "trust",
            "--no-ssl",
        ];
        args.extend_from_slice(extra);
        args.push("--run");
        let file = std::fs::File::create(&keeper.log).unwrap();
        if let Some(user) = &self.engine.user {
            nix::unistd::chown(&keeper.log, Some(user.uid), Some(user.gid)).unwrap();
        }
        self.engine
            .command(self.dir.path(), &args)
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("starting pg_autoctl")
    }

    fn monitor_url(&self) -> String {
        format!(
            "postgres://autoctl_node@127.0.0.1:{}/pg_auto_failover?sslmode=disable",
            self.monitor.port
        )
    }

    fn start_node(&mut self, index: usize) {
        let node = &self.nodes[index];
        let monitor = self.monitor_url();
        let child = self.create(
            node,
            "postgres",
            &[
                "--monitor",
                &monitor,
                "--name",
                &node.name,
                "--dbname",
                DATABASE,
            ],
        );
        self.nodes[index].child = Some(child);
    }

    /// A connection to a server of the formation as `postgres`, waiting (up to 60 s) for it.
    async fn connect(&self, port: u16, database: &str, what: &str) -> PgConnection {
        let options = as_postgres(port, database);
        let since = Instant::now();
        loop {
            match PgConnection::connect_with(&options).await {
                Ok(conn) => return conn,
                Err(error) if since.elapsed() > Duration::from_secs(60) => {
                    panic!(
                        "{what} did not accept connections in 60 s ({error}):\n{}",
                        self.logs()
                    )
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// The monitor's view of the nodes.
    async fn states(&self) -> Result<Vec<NodeState>, sqlx::Error> {
        let mut conn =
            PgConnection::connect_with(&as_postgres(self.monitor.port, "pg_auto_failover")).await?;
        let rows: Vec<(String, String, String)> = sqlx::query_as(
            "SELECT nodename, reportedstate::text, goalstate::text
             FROM pgautofailover.node ORDER BY nodeid",
        )
        .fetch_all(&mut conn)
        .await?;
        let _ = conn.close().await;
        Ok(rows
            .into_iter()
            .map(|(name, reported, goal)| NodeState {
                name,
                reported,
                goal,
            })
            .collect())
    }

    /// Polls the monitor until `done` holds (up to 180 s: node2's base backup included).
    async fn wait_until(&self, what: &str, done: impl Fn(&[NodeState]) -> bool) -> Vec<NodeState> {
        let since = Instant::now();
        let mut last = Vec::new();
        loop {
            if let Ok(nodes) = self.states().await {
                if done(&nodes) {
                    return nodes;
                }
                last = nodes;
            }
            assert!(
                since.elapsed() < Duration::from_secs(180),
                "{what}: not within 180 s; last states {last:?}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The name of the node the monitor has as primary now (reported and assigned: a killed
    /// node keeps its last reported state).
    async fn primary(&self) -> String {
        let is_primary = |n: &NodeState| {
            matches!(n.reported.as_str(), "primary" | "wait_primary")
                && matches!(n.goal.as_str(), "primary" | "wait_primary")
        };
        let nodes = self
            .wait_until("a primary", |nodes| nodes.iter().any(is_primary))
            .await;
        nodes.into_iter().find(is_primary).unwrap().name
    }

    /// The node's port.
    fn port(&self, name: &str) -> u16 {
        self.nodes.iter().find(|n| n.name == name).unwrap().port
    }

    /// Watches the node `name` from now on and answers when it first was writable (checked every
    /// 50 ms with a fresh connection): when the engine had a primary again.
    fn watch_writable(&self, name: &str) -> tokio::task::JoinHandle<Instant> {
        let options = sqlx::postgres::PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port(name))
            .username("postgres")
            .database(DATABASE);
        tokio::spawn(async move {
            loop {
                if let Ok(mut conn) = PgConnection::connect_with(&options).await {
                    let server = server_of(&mut conn).await;
                    let _ = conn.close().await;
                    if matches!(server, Ok(Server::Writable)) {
                        return Instant::now();
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    }

    /// When [`Formation::watch_writable`]'s node was first writable (within 120 s).
    async fn writable(&self, watch: tokio::task::JoinHandle<Instant>) -> Instant {
        match tokio::time::timeout(Duration::from_secs(120), watch).await {
            Ok(at) => at.unwrap(),
            Err(_) => panic!(
                "the standby was not writable within 120 s; states {:?}\n{}",
                self.states().await.ok(),
                self.logs()
            ),
        }
    }

    /// The multi-host URL, nodes in their creation order.
    fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        format!("postgres://postgres@{}/{DATABASE}", hosts.join(","))
    }

    /// A planned switchover (`pgautofailover.perform_failover` with a healthy primary, what
    /// `pg_autoctl perform switchover` calls: the primary drains, the secondary is promoted),
    /// waited for until the old primary streams again as a secondary.
    async fn switchover(&self) {
        let before = self.primary().await;
        let monitor = self
            .connect(self.monitor.port, "pg_auto_failover", "the monitor")
            .await;
        run_and_close(
            monitor,
            &["SELECT pgautofailover.perform_failover('default', 0)"],
        )
        .await;
        self.wait_until("the switchover", |nodes| {
            nodes
                .iter()
                .any(|n| n.name != before && n.reported == "primary" && n.goal == "primary")
                && nodes
                    .iter()
                    .any(|n| n.name == before && n.reported == "secondary")
        })
        .await;
    }

    /// SIGKILL to the node's keeper and its postmaster.
    fn kill(&mut self, name: &str) {
        let node = self.nodes.iter_mut().find(|n| n.name == name).unwrap();
        node.kill();
    }

    /// The standby leaves the write quorum (`pg_autoctl set node replication-quorum false`), and
    /// the primary's `synchronous_standby_names` empties.
    async fn make_standby_async(&self) {
        let primary = self.primary().await;
        let standby = self.nodes.iter().find(|n| n.name != primary).unwrap();
        let primary = self.nodes.iter().find(|n| n.name == primary).unwrap();
        let pgdata = standby.pgdata.display().to_string();
        let output = self
            .engine
            .command(
                self.dir.path(),
                &[
                    "set",
                    "node",
                    "replication-quorum",
                    "false",
                    "--pgdata",
                    &pgdata,
                ],
            )
            .output()
            .await
            .unwrap();
        assert!(
            output.status.success(),
            "pg_autoctl set node replication-quorum: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let since = Instant::now();
        loop {
            let mut conn = self.connect(primary.port, DATABASE, "the primary").await;
            let names: String =
                sqlx::query_scalar("SELECT current_setting('synchronous_standby_names')")
                    .fetch_one(&mut conn)
                    .await
                    .unwrap();
            let _ = conn.close().await;
            if names.is_empty() {
                return;
            }
            assert!(
                since.elapsed() < Duration::from_secs(60),
                "synchronous_standby_names still {names:?}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The end of every keeper's log, for failure messages.
    fn logs(&self) -> String {
        std::iter::once(&self.monitor)
            .chain(&self.nodes)
            .map(|keeper| format!("--- {} ---\n{}", keeper.name, tail(&keeper.log)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Stops the keepers (SIGTERM: each stops its server, fast), nodes first.
    async fn stop(mut self) {
        for keeper in self
            .nodes
            .iter_mut()
            .chain(std::iter::once(&mut self.monitor))
        {
            if let Some(mut child) = keeper.child.take() {
                if let Some(pid) = child.id() {
                    let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
                }
                if tokio::time::timeout(Duration::from_secs(30), child.wait())
                    .await
                    .is_err()
                {
                    keeper.child = Some(child);
                    keeper.kill();
                }
            }
        }
    }
}

impl Drop for Formation {
    /// A test that failed half-way leaves no server running: the keepers are killed, then
    /// anything still running in the formation's directory (a keeper may have restarted a
    /// service in between).
    fn drop(&mut self) {
        for keeper in self
            .nodes
            .iter_mut()
            .chain(std::iter::once(&mut self.monitor))
        {
            keeper.kill();
        }
        for _ in 0..50 {
            let left = running_in(self.dir.path());
            if left.is_empty() {
                break;
            }
            for pid in left {
                let _ = kill(pid, Signal::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if std::env::var_os("CREDPOOL_TEST_KEEP_FAILOVER_DIR").is_some() {
            let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap());
            eprintln!(
                "kept {} (CREDPOOL_TEST_KEEP_FAILOVER_DIR)",
                dir.keep().display()
            );
        }
    }
}

/// Every process below `root` (from /proc).
fn descendants(root: Pid) -> Vec<Pid> {
    let mut parents: HashMap<i32, Vec<i32>> = HashMap::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...; comm may hold spaces and parentheses
        let Some(after) = stat.rfind(')').map(|at| &stat[at + 1..]) else {
            continue;
        };
        if let Some(ppid) = after.split_whitespace().nth(1).and_then(|p| p.parse().ok()) {
            parents.entry(ppid).or_default().push(pid);
        }
    }
    let mut found = Vec::new();
    let mut queue = vec![root.as_raw()];
    while let Some(pid) = queue.pop() {
        for &child in parents.get(&pid).map(Vec::as_slice).unwrap_or_default() {
            found.push(Pid::from_raw(child));
            queue.push(child);
        }
    }
    found
}

/// How a test connects to `database` on a server of the formation: as `postgres`, trusted.
fn as_postgres(port: u16, database: &str) -> sqlx::postgres::PgConnectOptions {
    sqlx::postgres::PgConnectOptions::new()
        .host("127.0.0.1")
        .port(port)
        .username("postgres")
        .database(database)
}

/// Every process whose working directory is `dir` or below it: the keepers run in the
/// formation's directory, each server in its data directory there.
fn running_in(dir: &Path) -> Vec<Pid> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_string_lossy().parse::<i32>().ok()?;
            let cwd = std::fs::read_link(entry.path().join("cwd")).ok()?;
            cwd.starts_with(dir).then(|| Pid::from_raw(pid))
        })
        .collect()
}

fn command_line(pid: Pid) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|bytes| String::from_utf8_lossy(&bytes).replace('\0', " "))
        .unwrap_or_default()
}

/// What the proxy saw of the outage, for a failure message: how many answers were 503 and
/// the last few of them (path, seconds after the failover began, request).
fn outage_summary(exchanges: &[Exchange], failed_at: Instant) -> String {
    let unavailable: Vec<&Exchange> = exchanges.iter().filter(|e| e.status == Some(503)).collect();
    let last: Vec<String> = unavailable
        .iter()
        .rev()
        .take(5)
        .map(|e| {
            format!(
                "{} at {:.2} s {} -> {}",
                e.path,
                e.answered
                    .saturating_duration_since(failed_at)
                    .as_secs_f64(),
                e.request,
                e.body
            )
        })
        .collect();
    format!(
        "{} answers, {} of them 503 (the last: {})",
        exchanges.len(),
        unavailable.len(),
        last.join("; ")
    )
}

/// The last lines of a log file, for failure messages.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

// ---------------------------------------------------------------------------------------------
// The recording proxy between the executors and the service.

/// One request as the service answered it.
#[derive(Debug, Clone)]
struct Exchange {
    path: String,
    request: Value,
    sent: Instant,
    answered: Instant,
    /// `None`: the service could not be reached.
    status: Option<u16>,
    body: Value,
}

impl Exchange {
    fn is_allocate(&self) -> bool {
        self.path.ends_with("/allocate-key")
    }

    fn code(&self) -> Option<&str> {
        self.body["error"]["code"].as_str()
    }
}

struct Proxy {
    upstream: String,
    http: reqwest::Client,
    exchanges: Mutex<Vec<Exchange>>,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `upstream`; returns its base URL.
    async fn start(upstream: &str) -> (Arc<Proxy>, String) {
        let proxy = Arc::new(Proxy {
            upstream: upstream.to_owned(),
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(128)
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap(),
            exchanges: Mutex::new(Vec::new()),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let app = axum::Router::new()
            .fallback(forward)
            .with_state(proxy.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (proxy, base)
    }

    fn exchanges(&self) -> Vec<Exchange> {
        self.exchanges.lock().unwrap().clone()
    }
}

async fn forward(State(proxy): State<Arc<Proxy>>, request: Request) -> Response {
    let path = request.uri().path().to_owned();
    let method = request.method().clone();
    let key = request.headers().get("x-internal-key").cloned();
    let bytes = axum::body::to_bytes(request.into_body(), 1 << 20)
        .await
        .unwrap_or_default();
    let sent = Instant::now();
    let mut outgoing = proxy
        .http
        .request(method, format!("{}{path}", proxy.upstream))
        .header("content-type", "application/json")
        .body(bytes.clone());
    if let Some(key) = key {
        outgoing = outgoing.header("x-internal-key", key);
    }
    let (status, retry_after, body) = match outgoing.send().await {
        Ok(response) => {
            let status = response.status().as_u16();
            let retry_after = response.headers().get("retry-after").cloned();
            (
                Some(status),
                retry_after,
                response.bytes().await.unwrap_or_default(),
            )
        }
        Err(_) => (None, None, Default::default()),
    };
    proxy.exchanges.lock().unwrap().push(Exchange {
        path,
        request: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        sent,
        answered: Instant::now(),
        status,
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    });
    let mut response = Response::builder()
        .status(status.unwrap_or(502))
        .header("content-type", "application/json");
    if let Some(retry_after) = retry_after {
        response = response.header("retry-after", retry_after);
    }
    response
        .body(Body::from(body))
        .unwrap_or_else(|_| HttpStatus::BAD_GATEWAY.into_response())
}

// ---------------------------------------------------------------------------------------------
// The run: a service on the formation, executors through the client crate.

/// What the executors saw that the proxy cannot: errors the client gave up with.
#[derive(Default)]
struct Seen {
    client_errors: Mutex<Vec<String>>,
}

struct Run {
    serve: ServeProcess,
    log: PathBuf,
    proxy: Arc<Proxy>,
    base: String,
    stop: Arc<AtomicBool>,
    seen: Arc<Seen>,
    executors: Vec<tokio::task::JoinHandle<()>>,
    held: Vec<credpool_client::LeaseGuard>,
}

fn client(base: &str, renew_fraction: f64) -> Client {
    Client::builder(base, INTERNAL_KEY)
        .retry(RetryPolicy {
            base_delay: Duration::from_millis(50),
            max_delay: Duration::from_millis(250),
            max_retries: None,
            max_elapsed: Some(Duration::from_secs(60)),
        })
        .http_timeout(Duration::from_secs(15))
        .renew_fraction(renew_fraction)
        .build()
        .unwrap()
}

impl Run {
    /// `credpool serve` on the formation's multi-host URL (after `credpool migrate` on the same
    /// URL), its log in the formation's directory under `name`.
    async fn serve(formation: &Formation, name: &str) -> (ServeProcess, PathBuf) {
        let log = formation.dir.path().join(format!("serve-{name}.log"));
        let mut env = keyed_env_at(formation.url(), 32);
        env.push(("RUST_LOG", "credpool=info,warn".to_owned()));
        let serve = ServeProcess::start_in(
            BIN,
            None,
            std::fs::File::create(&log).unwrap().into(),
            &env,
            &[],
        )
        .await;
        (serve, log)
    }

    /// Migrates through the multi-host URL, starts the service and the proxy, loads the
    /// credentials and takes the long leases.
    async fn start(formation: &Formation) -> Self {
        let migrated = run(credpool_command(BIN, &formation.url()).arg("migrate")).await;
        assert!(
            migrated.success,
            "credpool migrate on the multi-host URL: {}",
            migrated.stderr
        );
        let (serve, log) = Self::serve(formation, "load").await;
        let (proxy, base) = Proxy::start(&serve.base).await;
        let put = async |key_id: String, pool: &str, limit: u32| {
            let response = serve
                .put_key_raw(
                    &key_id,
                    json!({"provider": PROVIDER, "pool": pool, "models": [MODEL],
                              "max_concurrent_uses": limit,
                              "secret": {"api_key": format!("sk-{key_id}")}}),
                )
                .await;
            assert!(response.status().is_success(), "PUT {key_id}");
        };
        for i in 0..ROOMY_CREDENTIALS {
            put(format!("roomy-{i}"), "default", ROOMY_LIMIT).await;
        }
        for i in 0..2 {
            put(format!("tight-{i}"), "tight", 2).await;
        }
        for i in 0..HELD {
            put(format!("held-{i}"), "held", 1).await;
        }
        // renewed every 2 s, so they outlive an outage of up to about 16 s
        let holder = client(&base, 0.1);
        let mut held = Vec::new();
        for i in 0..HELD {
            let lease = holder
                .lease(
                    LeaseRequest::new(PROVIDER, MODEL)
                        .pool("held")
                        .lease_seconds(20)
                        .holder(format!("held-{i}")),
                )
                .await
                .unwrap();
            held.push(lease);
        }
        Self {
            serve,
            log,
            proxy,
            base,
            stop: Arc::new(AtomicBool::new(false)),
            seen: Arc::new(Seen::default()),
            executors: Vec::new(),
            held,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Starts the executors and lets them run for `before`.
    async fn load(&mut self, before: Duration) {
        let mut executors = Vec::new();
        for id in 0..ROOMY + WAITING {
            let (pool, request, renew_fraction) = if id < ROOMY - RENEWING {
                (
                    "default",
                    LeaseRequest::new(PROVIDER, MODEL).lease_seconds(30),
                    0.3,
                )
            } else if id < ROOMY {
                // renewed every 200 ms while held
                (
                    "default",
                    LeaseRequest::new(PROVIDER, MODEL).lease_seconds(2),
                    0.1,
                )
            } else {
                (
                    "tight",
                    LeaseRequest::new(PROVIDER, MODEL)
                        .lease_seconds(30)
                        .wait(Duration::from_secs(2)),
                    0.3,
                )
            };
            let request = request.pool(pool).holder(format!("executor-{id}"));
            executors.push(tokio::spawn(executor(
                client(&self.base, renew_fraction),
                request,
                self.stop.clone(),
                self.seen.clone(),
            )));
        }
        self.executors = executors;
        tokio::time::sleep(before).await;
    }

    /// After the failover: waits for the service to serve again, runs on for [`AFTER`], stops
    /// the executors, renews and releases the long leases, and checks everything; returns the
    /// figures.
    async fn finish(
        mut self,
        formation: &Formation,
        failed_at: Instant,
        writable_at: Instant,
    ) -> String {
        // serving again: an allocation answered 200 after the new primary took writes, and no
        // 503 in the last second (a planned switchover may cause none: requests wait for a
        // connection while the pool finds the new primary)
        let since = Instant::now();
        loop {
            let exchanges = self.proxy.exchanges();
            let quiet = exchanges
                .iter()
                .filter(|e| e.status == Some(503))
                .all(|e| e.answered.elapsed() > Duration::from_secs(1));
            if quiet && served_again(&exchanges, writable_at).is_some() {
                break;
            }
            assert!(
                since.elapsed() < Duration::from_secs(60),
                "the service did not serve again within 60 s of the failover: {}; log:\n{}\n{}",
                outage_summary(&exchanges, failed_at),
                tail(&self.log),
                formation.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(AFTER).await;
        self.stop.store(true, Ordering::SeqCst);
        let executors = std::mem::take(&mut self.executors);
        for executor in executors {
            tokio::time::timeout(Duration::from_secs(90), executor)
                .await
                .expect("an executor did not finish")
                .unwrap();
        }
        // the long leases from before the failover: alive, renewed since, and they release
        let mut held_ids = Vec::new();
        for lease in std::mem::take(&mut self.held) {
            assert!(
                !lease.is_lost(),
                "a long lease was lost across the failover: {lease:?}"
            );
            held_ids.push(lease.lease_id().to_owned());
            let released = lease.finish(Outcome::Success).await.unwrap();
            assert!(released.released, "{released:?}");
        }
        let exchanges = self.proxy.exchanges();
        let report = check(
            &exchanges,
            failed_at,
            writable_at,
            &held_ids,
            &self.seen,
            formation,
        )
        .await;
        assert!(
            self.serve.terminate().await.success(),
            "{}",
            tail(&self.log)
        );
        // the pool followed the primary, and so did the LISTEN connection of waiting allocations
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let moved = log
            .find("database: the writable server moved")
            .unwrap_or_else(|| panic!("the service did not follow the primary:\n{log}"));
        assert!(
            log[moved..].contains("waiting allocations: listening for freed slots"),
            "the LISTEN connection did not come back after the move:\n{log}"
        );
        report
    }
}

/// One executor: lease (the client retries 503s), hold 50-500 ms, release; until `stop`.
async fn executor(client: Client, request: LeaseRequest, stop: Arc<AtomicBool>, seen: Arc<Seen>) {
    while !stop.load(Ordering::SeqCst) {
        match client.lease(request.clone()).await {
            Ok(lease) => {
                let hold = Duration::from_millis(rand::random_range(50..=500));
                tokio::select! {
                    () = tokio::time::sleep(hold) => {}
                    () = lease.lost() => {}
                }
                if let Err(error) = lease.finish(Outcome::Success).await {
                    seen.client_errors
                        .lock()
                        .unwrap()
                        .push(format!("release: {error}"));
                }
            }
            // the tight pool: no slot within the wait
            Err(ClientError::PoolExhausted { .. }) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(error) => {
                seen.client_errors
                    .lock()
                    .unwrap()
                    .push(format!("lease: {error}"));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Checks the run against the proxy's record and the new primary's trail; returns the figures.
async fn check(
    exchanges: &[Exchange],
    failed_at: Instant,
    writable_at: Instant,
    held: &[String],
    seen: &Seen,
    formation: &Formation,
) -> String {
    let errors = seen.client_errors.lock().unwrap().clone();
    assert!(errors.is_empty(), "executors gave up: {errors:?}");
    // every answer is in the API's table; 503 is store_unavailable; a 429 only where slots run out
    for exchange in exchanges {
        let status = exchange
            .status
            .unwrap_or_else(|| panic!("the service did not answer: {exchange:?}"));
        let allowed: &[u16] = if exchange.is_allocate() {
            &[200, 429, 503]
        } else if exchange.path.ends_with("/renew-lease") {
            &[200, 410, 503]
        } else {
            &[200, 503]
        };
        assert!(allowed.contains(&status), "{exchange:?}");
        if status == 503 {
            assert_eq!(exchange.code(), Some("store_unavailable"), "{exchange:?}");
        }
        if status == 429 {
            assert_eq!(
                exchange.request["pool"], "tight",
                "a 429 on a pool with free slots: {exchange:?}"
            );
        }
    }
    let unavailable: Vec<&Exchange> = exchanges.iter().filter(|e| e.status == Some(503)).collect();
    assert!(
        unavailable.iter().all(|e| e.answered >= failed_at),
        "a 503 before the failover"
    );
    let grants: Vec<&Exchange> = exchanges
        .iter()
        .filter(|e| e.is_allocate() && e.status == Some(200))
        .collect();
    let back = served_again(exchanges, writable_at).expect("no grant after the failover");
    let outage = longest_without_grant(&grants, failed_at, back);
    let allocate_503s = unavailable.iter().filter(|e| e.is_allocate()).count();

    // every lease answered 200 is in the new primary's trail, once
    let mut lease_ids: Vec<String> = grants
        .iter()
        .map(|e| e.body["lease_id"].as_str().unwrap().to_owned())
        .collect();
    let answered = lease_ids.len();
    lease_ids.sort();
    lease_ids.dedup();
    let replays = answered - lease_ids.len();
    let target = Target::parse(&formation.url()).unwrap();
    let (mut conn, at) = connect_writable(&target, Duration::from_secs(10))
        .await
        .unwrap();
    let primary_port = target.hosts()[at].get_port();
    let in_trail: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT lease_id::text, count(*), max(fence) FROM lease_events
         WHERE event = 'granted' AND lease_id = ANY (SELECT l::uuid FROM unnest($1::text[]) l)
         GROUP BY lease_id",
    )
    .bind(&lease_ids)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let trail: HashMap<String, (i64, i64)> = in_trail
        .into_iter()
        .map(|(id, count, fence)| (id.replace('-', ""), (count, fence)))
        .collect();
    for id in &lease_ids {
        let (count, _) = trail
            .get(&id.replace('-', ""))
            .unwrap_or_else(|| panic!("lease {id} was answered 200 but is not in the trail"));
        assert_eq!(*count, 1, "lease {id} granted {count} times");
    }
    // a replayed answer (a retry with the same request_id) is the same lease: same fence
    let mut fence_of: HashMap<&str, u64> = HashMap::new();
    for grant in &grants {
        let id = grant.body["lease_id"].as_str().unwrap();
        let fence = grant.body["fence"].as_u64().unwrap();
        assert_eq!(*fence_of.entry(id).or_insert(fence), fence, "{grant:?}");
        assert_eq!(
            trail[&id.replace('-', "")].1 as u64,
            fence,
            "the trail's fence of {id}"
        );
    }
    // fences keep increasing across the failover: every request first sent after the service
    // was back got a fence above every fence answered before the failover began
    let mut first_sent: HashMap<&str, Instant> = HashMap::new();
    for exchange in exchanges.iter().filter(|e| e.is_allocate()) {
        if let Some(id) = exchange.request["request_id"].as_str() {
            let at = first_sent.entry(id).or_insert(exchange.sent);
            *at = (*at).min(exchange.sent);
        }
    }
    let before_max = grants
        .iter()
        .filter(|e| e.answered < failed_at)
        .map(|e| e.body["fence"].as_u64().unwrap())
        .max()
        .expect("no grant before the failover");
    let after: Vec<u64> = grants
        .iter()
        .filter(|e| {
            e.request["request_id"]
                .as_str()
                .is_some_and(|id| first_sent[id] > back)
        })
        .map(|e| e.body["fence"].as_u64().unwrap())
        .collect();
    let after_min = *after.iter().min().expect("no grant after the failover");
    assert!(
        after_min > before_max,
        "a fence went backwards: {after_min} after the failover, {before_max} before"
    );
    // the long leases renewed after the service was back
    let renewed: HashSet<String> = exchanges
        .iter()
        .filter(|e| e.path.ends_with("/renew-lease") && e.status == Some(200) && e.sent > back)
        .filter_map(|e| e.request["lease_id"].as_str())
        .map(|id| id.replace('-', ""))
        .collect();
    for id in held {
        assert!(
            renewed.contains(&id.replace('-', "")),
            "long lease {id} was not renewed after the failover"
        );
    }
    let _ = conn.close().await;

    // the oversell proof over the whole run, through the multi-host URL
    let verified = audit_verify_json(BIN, &formation.url()).await;
    let printed = verified.printed();
    assert!(verified.success, "{printed}");
    let proof = verified.report();
    assert_eq!(proof["grants_over_limit"], 0, "{printed}");

    let renewals = exchanges
        .iter()
        .filter(|e| e.path.ends_with("/renew-lease"))
        .count();
    let waited = grants
        .iter()
        .filter(|e| e.request["pool"] == "tight")
        .count();
    let rejected = exchanges.iter().filter(|e| e.status == Some(429)).count();
    // a release answered "not released": an earlier attempt released it and its answer was lost
    // (or a short lease ran out while its renewals failed); the service's view must not go on
    // counting those leases (a 429 on the roomy pool, checked above)
    let gone = exchanges
        .iter()
        .filter(|e| e.path.ends_with("/release-key") && e.body["released"] == false)
        .count();
    let first_503 = unavailable
        .iter()
        .map(|e| e.answered)
        .min()
        .map_or("none".to_owned(), |at| {
            format!(
                "the first {:.2} s after the failover began",
                (at - failed_at).as_secs_f64()
            )
        });
    format!(
        "{} requests, {answered} grants ({replays} replayed answers, {waited} on the waiting pool), \
         {renewals} renewals, {rejected} 429s on the waiting pool, {gone} releases answered not \
         released; {} 503s ({allocate_503s} allocations), {first_503}; no grant answered for \
         {:.2} s (the outage window); the new primary was writable {:.2} s after the failover \
         began and the service granted again {:.2} s after that; fences {before_max} before, \
         {after_min} and up after; new primary on port {primary_port}",
        exchanges.len(),
        unavailable.len(),
        outage.as_secs_f64(),
        (writable_at - failed_at).as_secs_f64(),
        back.saturating_duration_since(writable_at).as_secs_f64(),
    )
}

/// When the service served again: the first allocation answered 200 after `writable_at` (when
/// the new primary first took a write), if any.
fn served_again(exchanges: &[Exchange], writable_at: Instant) -> Option<Instant> {
    exchanges
        .iter()
        .filter(|e| e.is_allocate() && e.status == Some(200) && e.answered > writable_at)
        .map(|e| e.answered)
        .min()
}

/// The outage a caller saw: the longest stretch between `failed_at` and `back` in which no
/// allocation was answered 200.
fn longest_without_grant(grants: &[&Exchange], failed_at: Instant, back: Instant) -> Duration {
    let mut answered: Vec<Instant> = grants
        .iter()
        .map(|e| e.answered)
        .filter(|at| *at > failed_at && *at < back)
        .collect();
    answered.push(failed_at);
    answered.push(back);
    answered.sort();
    answered
        .windows(2)
        .map(|pair| pair[1] - pair[0])
        .max()
        .unwrap_or_default()
}

/// Runs each of `statements` on `conn`, whole and unprepared (`ALTER SYSTEM`, `CHECKPOINT`),
/// then closes it; panics, naming the statement, if one fails.
async fn run_and_close(mut conn: PgConnection, statements: &[&str]) {
    for statement in statements {
        sqlx::raw_sql(sqlx::AssertSqlSafe(*statement))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    conn.close().await.unwrap();
}
