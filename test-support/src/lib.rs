//! The harness both of credpool's test suites (`tests/api`, `tests/reliability`) use: a
//! PostgreSQL server for the whole test process, a fresh migrated database per test, the real app
//! served on port 0 against it, `credpool serve` as a child process, and HTTP helpers.
//!
//! The server is found in this order: `DATABASE_URL` (any database on it; tests create their own),
//! else a container through testcontainers when a Docker engine answers, else a private cluster
//! started from the PostgreSQL binaries installed on the machine (credpool's own embedded
//! launcher, in a temporary directory that goes when the test process exits: `private_cluster`).
//! Child processes reach the server through [`TestDatabase::url`], also over the private
//! cluster's Unix socket.
//!
//! Cargo gives a binary's path (`CARGO_BIN_EXE_credpool`) only to the test crates of its own
//! package, so the helpers that run `credpool` take the path from the calling suite.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::str::FromStr;
use std::time::Duration;

use credpool::config::ServiceSettings;
use credpool::http::ApiKeys;
use credpool::startup::Application;
use credpool::store::{self, PoolSettings};
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgPool};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};
use tokio::sync::{Mutex, MutexGuard, OnceCell};

/// The internal (executor) API key the tests' services accept.
pub const INTERNAL_KEY: &str = "test-internal-key";
/// The master key the tests seal secrets with.
pub const MASTER_KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

/// A keyring holding [`MASTER_KEY`] alone, as the tests' services seal and open secrets.
pub fn keyring() -> std::sync::Arc<credpool::secrets::Keyring> {
    let key = credpool::secrets::MasterKey::parse(MASTER_KEY).unwrap();
    std::sync::Arc::new(credpool::secrets::Keyring::new(key, vec![]))
}
/// The admin API key the tests' services accept (16 characters: the shortest key a service takes).
pub const ADMIN_KEY: &str = "test-admin-key-0";

/// Reports that the running test skips itself, or a part of itself, as `skipped: <test>:
/// <reason>`, on the process's stderr itself: libtest captures `eprintln!` of a passing test and
/// shows only "ok", so a skipped run would read as a full pass. The line shows in `cargo test`'s
/// output next to the test results.
pub fn report_skipped(reason: &str) {
    use std::io::Write;
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    // straight to the file descriptor: the capture only intercepts the print macros
    let _ = writeln!(std::io::stderr().lock(), "skipped: {test}: {reason}");
}

struct Server {
    /// Options for a maintenance database on the server (where tests create theirs).
    admin: PgConnectOptions,
    /// The container, when the server is one: held only so it lives as long as the process (a
    /// static is never dropped; testcontainers' reaper removes the container afterwards).
    _container:
        Option<Box<testcontainers::ContainerAsync<testcontainers_modules::postgres::Postgres>>>,
}

static SERVER: OnceCell<Server> = OnceCell::const_new();

fn docker_available() -> bool {
    std::env::var_os("DOCKER_HOST").is_some()
        || std::path::Path::new("/var/run/docker.sock").exists()
}

async fn server() -> &'static Server {
    SERVER
        .get_or_init(|| async {
            if let Ok(url) = std::env::var("DATABASE_URL") {
                let admin =
                    PgConnectOptions::from_str(&url).expect("DATABASE_URL is not a valid URL");
                return Server {
                    admin,
                    _container: None,
                };
            }
            if docker_available() {
                use testcontainers::ImageExt;
                use testcontainers::runners::AsyncRunner;
                let container = testcontainers_modules::postgres::Postgres::default()
                    .with_host_auth()
                    .with_tag("15-alpine")
                    .with_cmd([
                        "postgres".to_owned(),
                        "-c".to_owned(),
                        format!("max_connections={MAX_CONNECTIONS}"),
                    ])
                    .start()
                    .await
                    .expect("starting a PostgreSQL container");
                let host = container
                    .get_host()
                    .await
                    .expect("container host")
                    .to_string();
                let port = container
                    .get_host_port_ipv4(5432)
                    .await
                    .expect("container port");
                let admin = PgConnectOptions::new()
                    .host(&host)
                    .port(port)
                    .username("postgres")
                    .database("postgres");
                return Server {
                    admin,
                    _container: Some(Box::new(container)),
                };
            }
            Server {
                admin: private_cluster::start().await.database("postgres"),
                _container: None,
            }
        })
        .await
}

/// `max_connections` of a server the tests start (a container or the private cluster; with
/// `DATABASE_URL` it is the server's own business): a race test opens 64 connections, and
/// several service processes 16 to 32 each.
const MAX_CONNECTIONS: u32 = 300;

/// The private cluster for a test process that has neither `DATABASE_URL` nor Docker: credpool's
/// embedded launcher on the local PostgreSQL binaries, in `/tmp/credpool-test-pg-*`.
///
/// A static is never dropped, so the cluster is kept where an `atexit` hook finds it: libtest
/// ends the process with `std::process::exit` (after every test, also when some failed), which
/// runs the hook; it stops the server (fast shutdown) and removes the directory. A process that
/// dies without exiting (a signal, an abort) cannot clean up: its directory is removed by the
/// next test process that starts a private cluster, once neither its test process nor its server
/// runs.
mod private_cluster {
    use std::path::Path;
    use std::sync::Mutex;
    use std::time::Duration;

    use credpool::embedded::EmbeddedCluster;
    use sqlx::postgres::PgConnectOptions;

    const PARENT: &str = "/tmp";
    const PREFIX: &str = "credpool-test-pg-";
    /// The pid of the test process that owns a directory, written first thing into it.
    const OWNER_FILE: &str = "test-process.pid";
    /// A directory without an owner file (made by an older harness) is left alone this long
    /// after its last change: it may be one another process is still setting up.
    const UNOWNED_GRACE: Duration = Duration::from_secs(600);

    /// The running cluster and its directory, until the process exits. The cluster comes first:
    /// a tuple drops in order, so the server stops before its directory is removed.
    static RUNNING: Mutex<Option<(EmbeddedCluster, tempfile::TempDir)>> = Mutex::new(None);

    /// Starts the cluster (once per process: the caller holds the `OnceCell`) and returns how to
    /// reach it.
    pub(super) async fn start() -> PgConnectOptions {
        remove_stale();
        let dir = tempfile::Builder::new()
            .prefix(PREFIX)
            .tempdir_in(PARENT)
            .expect("temporary directory");
        std::fs::write(
            dir.path().join(OWNER_FILE),
            format!("{}\n", std::process::id()),
        )
        .expect("writing the owner file");
        // SAFETY: registering a plain `extern "C" fn` is always sound; it runs once, at exit.
        if unsafe { libc::atexit(stop_at_exit) } != 0 {
            panic!("could not register the private cluster's at-exit hook");
        }
        let max_connections = super::MAX_CONNECTIONS.to_string();
        let settings = [("max_connections", max_connections.as_str())];
        let cluster = EmbeddedCluster::start_with_settings(dir.path(), None, &settings)
            .await
            .expect("no DATABASE_URL, no Docker, and the local PostgreSQL binaries failed");
        let options = cluster.connect_options();
        *RUNNING.lock().unwrap_or_else(|p| p.into_inner()) = Some((cluster, dir));
        options
    }

    extern "C" fn stop_at_exit() {
        let running = RUNNING.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(running);
    }

    /// Removes the directories of earlier test processes that died without their at-exit hook.
    fn remove_stale() {
        let Ok(entries) = std::fs::read_dir(PARENT) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let ours = entry.file_name().to_string_lossy().starts_with(PREFIX)
                && entry.file_type().is_ok_and(|t| t.is_dir());
            if !ours || pid_in_file_runs(&path.join("pgdata/postmaster.pid")) {
                continue;
            }
            let stale = match std::fs::read_to_string(path.join(OWNER_FILE)) {
                Ok(text) => !pid_runs(&text),
                Err(_) => entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > UNOWNED_GRACE)),
            };
            if stale {
                let _ = std::fs::remove_dir_all(&path);
            }
        }
    }

    /// Whether the process whose pid is the first line of `file` runs (a server's
    /// `postmaster.pid`; a missing file: no).
    fn pid_in_file_runs(file: &Path) -> bool {
        std::fs::read_to_string(file).is_ok_and(|text| pid_runs(&text))
    }

    /// Whether the process whose pid is the first line of `text` runs; unreadable: assume so.
    fn pid_runs(text: &str) -> bool {
        match text
            .lines()
            .next()
            .and_then(|line| line.trim().parse::<i32>().ok())
        {
            Some(pid) if pid > 0 => !matches!(
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
                Err(nix::errno::Errno::ESRCH)
            ),
            _ => true,
        }
    }
}

/// A `postgres://` URL for child processes that reaches the server of `options`, database
/// `database`: over TCP, or over the Unix socket in the directory the options name, in the form
/// credpool's URL parsing takes (`postgres://user@localhost/db?host=/socket/dir&port=5432`).
pub fn url_for(options: &PgConnectOptions, database: &str) -> String {
    let user = options.get_username();
    let port = options.get_port();
    match options.get_socket() {
        Some(dir) => format!(
            "postgres://{user}@localhost/{database}?host={}&port={port}",
            query_value(&dir.to_string_lossy())
        ),
        None => format!("postgres://{user}@{}:{port}/{database}", options.get_host()),
    }
}

/// `value` percent-encoded for a URL's query, slashes kept.
fn query_value(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A fresh, migrated database, dropped when this value is dropped.
pub struct TestDatabase {
    /// The database's name on the test server.
    pub name: String,
    /// How to connect to it from the test process.
    pub options: PgConnectOptions,
    admin: PgConnectOptions,
}

impl TestDatabase {
    /// A fresh database with every migration and `sql/` file applied.
    pub async fn create() -> Self {
        let database = Self::create_empty().await;
        let pool = PgPool::connect_with(database.options.clone())
            .await
            .expect("connecting to the new database");
        store::migrate(&pool).await.expect("migrations");
        pool.close().await;
        database
    }

    /// A fresh database with nothing in it (no migration applied).
    pub async fn create_empty() -> Self {
        let server = server().await;
        let name = format!("credpool_test_{}", hex::encode(rand::random::<[u8; 8]>()));
        let mut conn = server
            .admin
            .connect()
            .await
            .expect("connecting to the test server");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .expect("CREATE DATABASE");
        conn.close().await.ok();
        let options = server.admin.clone().database(&name);
        Self {
            name,
            options,
            admin: server.admin.clone(),
        }
    }

    /// A `postgres://` URL of this database for child processes.
    pub fn url(&self) -> String {
        url_for(&self.options, &self.name)
    }

    /// A pool of at most `max_connections` on this database, for the test's own queries.
    pub async fn pool(&self, max_connections: u32) -> PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(max_connections)
            .connect_with(self.options.clone())
            .await
            .expect("test pool")
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let admin = self.admin.clone();
        let name = self.name.clone();
        // Drop runs inside the test's runtime; use a thread with its own runtime and wait for it,
        // so the database is gone before the test is reported done.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(mut conn) = admin.connect().await {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .execute(&mut conn)
                    .await;
                }
            });
        })
        .join();
    }
}

/// Race tests open up to 64 connections each; they take turns so that parallel tests stay under
/// the server's `max_connections`.
pub async fn race_turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::const_new(());
    TURN.lock().await
}

/// How many rounds each race repeats: `CREDPOOL_RACE_ROUNDS`, default 60.
pub fn race_rounds() -> usize {
    std::env::var("CREDPOOL_RACE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60)
}

/// How [`TestApp`] runs the app.
pub struct AppOptions {
    /// The app's own pool size (default 8).
    pub db_max_connections: u32,
    /// The service's settings (default: the service's defaults).
    pub settings: ServiceSettings,
}

impl Default for AppOptions {
    fn default() -> Self {
        Self {
            db_max_connections: 8,
            settings: ServiceSettings::default(),
        }
    }
}

impl AppOptions {
    /// Scoring without jitter: a deterministic order.
    pub fn deterministic() -> Self {
        let mut options = Self::default();
        options.settings.scoring.jitter = 0.0;
        options
    }
}

/// The real app, served in-process on port 0 against a fresh database.
pub struct TestApp {
    /// Where the app listens (127.0.0.1, a port the system chose).
    pub addr: SocketAddr,
    /// An HTTP client for it ([`client`]).
    pub client: reqwest::Client,
    /// A separate pool for the test's own queries.
    pub db: PgPool,
    /// The app's database (dropped with the app).
    pub database: TestDatabase,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl TestApp {
    /// The app with [`AppOptions::default`].
    pub async fn spawn() -> Self {
        Self::spawn_with(AppOptions::default()).await
    }

    /// The app with `options`, on a fresh database.
    pub async fn spawn_with(options: AppOptions) -> Self {
        Self::spawn_on(TestDatabase::create().await, options).await
    }

    /// The app on a database the test has prepared (settings every connection must have, say).
    pub async fn spawn_on(database: TestDatabase, options: AppOptions) -> Self {
        let app_pool = store::connect_lazy(
            database.options.clone(),
            &PoolSettings {
                max_connections: options.db_max_connections,
                acquire_timeout: Duration::from_secs(10),
            },
        );
        let (addr, shutdown) = serve(app_pool, &options).await;
        let db = database.pool(4).await;
        Self {
            addr,
            client: client(),
            db,
            database,
            shutdown: Some(shutdown),
        }
    }

    /// Another service over the app's database, served in this process: a replica in miniature,
    /// with its own connection pool of `max_connections`, candidate views and waiters. Returns
    /// its address and its shutdown trigger (sending or dropping it stops the replica).
    pub async fn replica(
        &self,
        max_connections: u32,
    ) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let pool = store::connect_lazy(
            self.database.options.clone(),
            &PoolSettings {
                max_connections,
                acquire_timeout: Duration::from_secs(10),
            },
        );
        serve(pool, &AppOptions::default()).await
    }

    /// The app's URL for `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Stops serving (in-flight requests finish; the app's connections close); the database
    /// stays until the app is dropped.
    pub fn stop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }

    /// `POST path` with the internal key and a JSON body.
    pub async fn post_internal(&self, path: &str, body: Value) -> reqwest::Response {
        post_json(
            &self.client,
            &self.url(path),
            ("x-internal-key", INTERNAL_KEY),
            body,
        )
        .await
    }

    /// The Prometheus page of `GET /metrics`.
    pub async fn metrics(&self) -> String {
        let response = self.client.get(self.url("/metrics")).send().await.unwrap();
        response.text().await.unwrap()
    }

    /// `POST /api/internal/allocate-key`.
    pub async fn allocate(&self, body: Value) -> reqwest::Response {
        self.post_internal("/api/internal/allocate-key", body).await
    }

    /// `POST /api/internal/release-key`.
    pub async fn release(&self, body: Value) -> reqwest::Response {
        self.post_internal("/api/internal/release-key", body).await
    }

    /// `POST /api/internal/renew-lease`.
    pub async fn renew(&self, body: Value) -> reqwest::Response {
        self.post_internal("/api/internal/renew-lease", body).await
    }

    /// `PUT /api/admin/keys/{key_id}` with `body`, whatever it answers.
    pub async fn put_key_raw(&self, key_id: &str, body: Value) -> reqwest::Response {
        self.client
            .put(self.url(&format!("/api/admin/keys/{key_id}")))
            .header("x-admin-key", ADMIN_KEY)
            .json(&body)
            .send()
            .await
            .expect("PUT key")
    }

    /// Stores a credential serving `models` with the given limit; panics unless stored.
    pub async fn put_key(
        &self,
        key_id: &str,
        provider: &str,
        pool: &str,
        models: &[&str],
        limit: u32,
    ) {
        let response = self
            .put_key_raw(
                key_id,
                json!({
                    "provider": provider,
                    "pool": pool,
                    "models": models,
                    "max_concurrent_uses": limit,
                    "secret": {"api_key": format!("sk-test-{key_id}")},
                }),
            )
            .await;
        assert!(
            response.status().is_success(),
            "PUT {key_id}: {}",
            response.status()
        );
    }

    /// Sets a credential's health columns directly (the operator API for this is a later issue).
    pub async fn set_status(&self, key_id: &str, status: &str, cooldown_seconds: Option<f64>) {
        sqlx::query(
            "UPDATE credentials SET status = $2,
                 cooldown_until = now() + make_interval(secs => $3)
             WHERE key_id = $1",
        )
        .bind(key_id)
        .bind(status)
        .bind(cooldown_seconds)
        .execute(&self.db)
        .await
        .expect("set status");
    }

    /// Unexpired leases on a credential, straight from the database.
    pub async fn in_flight(&self, key_id: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM lease_slots WHERE key_id = $1 AND lease_id IS NOT NULL AND lease_until > now()",
        )
        .bind(key_id)
        .fetch_one(&self.db)
        .await
        .expect("count in-flight")
    }

    /// Every row of every credpool table, as text: equal snapshots mean nothing changed.
    pub async fn snapshot(&self) -> String {
        let mut out = String::new();
        for table in [
            "credentials",
            "lease_slots",
            "lease_events",
            "lease_requests",
            "credential_events",
            "affinity_bindings",
        ] {
            let rows: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT string_agg(to_jsonb(t)::text, E'\\n' ORDER BY to_jsonb(t)::text) FROM {table} t"
            )))
            .fetch_one(&self.db)
            .await
            .expect("snapshot");
            out.push_str(&format!("== {table}\n{}\n", rows.unwrap_or_default()));
        }
        out
    }

    /// The `lease_events` of a lease, oldest first, straight from the database.
    pub async fn events(&self, lease_id: &str) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT event FROM lease_events WHERE lease_id = $1::text::uuid ORDER BY event_id",
        )
        .bind(lease_id)
        .fetch_all(&self.db)
        .await
        .expect("events")
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

/// Serves the app on 127.0.0.1:0 over `pool`; returns the address and a shutdown trigger.
pub async fn serve(
    pool: PgPool,
    options: &AppOptions,
) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let keys = ApiKeys::new(INTERNAL_KEY.into(), ADMIN_KEY.into()).unwrap();
    let app = Application::bind("127.0.0.1:0", pool, keys, keyring(), &options.settings)
        .await
        .expect("bind");
    let addr = app.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(app.run_until(async {
        let _ = rx.await;
    }));
    (addr, tx)
}

/// An HTTP client with a 60-second timeout and room for 128 idle connections per host.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(128)
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// `POST url` with header `key` (name, value) and a JSON body.
pub async fn post_json(
    client: &reqwest::Client,
    url: &str,
    key: (&str, &str),
    body: Value,
) -> reqwest::Response {
    client
        .post(url)
        .header(key.0, key.1)
        .json(&body)
        .send()
        .await
        .expect("POST")
}

/// Held by every test of a suite's process that makes allocations wait (`wait_ms`): the waiting
/// gauge (`credpool_allocations_waiting`) is one per process, shared by every app the process
/// runs, so a test that counts its own waiters through it must be the only one with waiters.
pub async fn exclusive_waiters() -> tokio::sync::MutexGuard<'static, ()> {
    static WAITERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    WAITERS.lock().await
}

/// Waits until exactly `count` requests wait in `app`, queued for wake-ups: `count` live
/// `pool_waiters` rows in its database (a waiting request's first claim writes its row) and
/// the process's waiting gauge (`credpool_allocations_waiting`) at `count` (each registered,
/// after that claim, for the wake-ups of its pools). Panics after 60 seconds. The gauge is one
/// per test process: the caller holds [`exclusive_waiters`], and waiters queued by a test that
/// does not hold it make this panic rather than pass for the caller's own.
pub async fn waiters_queued(app: &TestApp, count: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let (mut rows, mut gauge) = (0, 0.0);
    while tokio::time::Instant::now() < deadline {
        rows = sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pool_waiters WHERE until > clock_timestamp()",
        )
        .fetch_one(&app.db)
        .await
        .expect("pool_waiters");
        gauge = sample(&app.metrics().await, "credpool_allocations_waiting");
        if rows == count as i64 && gauge == count as f64 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never {count} requests waiting: {rows} waiter rows, the process's gauge at {gauge}");
}

/// The value of the series `name` without labels on a Prometheus page (0 when absent: a gauge
/// not set yet).
pub fn sample(page: &str, name: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .map_or(0.0, |v| v.parse().expect("a sample value"))
}

/// `credpool_allocations_total` of `provider` with `result` on a Prometheus page, summed over
/// its other labels (pools, tenants).
pub fn allocations(page: &str, provider: &str, result: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with("credpool_allocations_total{"))
        .filter(|l| {
            l.contains(&format!("provider=\"{provider}\""))
                && l.contains(&format!("result=\"{result}\""))
        })
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

/// Reads a JSON body, asserting the status first.
pub async fn json_body(response: reqwest::Response, expected: StatusCode) -> Value {
    let status = response.status();
    let text = response.text().await.expect("body");
    assert_eq!(status, expected, "unexpected status; body: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// Asserts an error response's status and code.
pub async fn assert_error(response: reqwest::Response, expected: StatusCode, code: &str) -> Value {
    let body = json_body(response, expected).await;
    assert_eq!(body["error"]["code"], code, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    body
}

/// The release body for a granted lease (as returned by allocate).
pub fn release_body(lease: &Value, outcome: &str) -> Value {
    json!({
        "provider": lease["provider"],
        "pool": lease["pool"],
        "key_id": lease["key_id"],
        "lease_id": lease["lease_id"],
        "outcome": outcome,
    })
}

/// A running `credpool serve` process; killed when dropped.
pub struct ServeProcess {
    /// The process.
    pub child: Child,
    /// Its base URL, as it printed it (`http://<address it bound>`).
    pub base: String,
    /// Lines printed to stdout before "listening".
    pub banner: Vec<String>,
    _stdout: BufReader<ChildStdout>,
}

impl ServeProcess {
    /// `BIN serve ARGS` (`bin`: the suite's `CARGO_BIN_EXE_credpool`; with `--listen
    /// 127.0.0.1:0` unless ARGS name a listen address), run in `cwd` if given, with
    /// `CREDPOOL_SHUTDOWN_DELAY_SECONDS=0` unless `envs` set it.
    pub async fn start_in(
        bin: &str,
        cwd: Option<&Path>,
        stderr: Stdio,
        envs: &[(&str, String)],
        args: &[&str],
    ) -> Self {
        Self::launch(Self::command(bin, cwd, stderr, envs, args)).await
    }

    /// [`ServeProcess::start`] with the process's open-file limit (soft and hard) at
    /// `open_files`, as `ulimit -n` would set it.
    pub async fn start_with_open_files(
        bin: &str,
        envs: &[(&str, String)],
        args: &[&str],
        open_files: u64,
    ) -> Self {
        let mut command = Self::command(bin, None, Stdio::inherit(), envs, args);
        // SAFETY: between fork and exec the closure only calls setrlimit, which is
        // async-signal-safe, and allocates nothing.
        unsafe {
            command.pre_exec(move || {
                nix::sys::resource::setrlimit(
                    nix::sys::resource::Resource::RLIMIT_NOFILE,
                    open_files,
                    open_files,
                )
                .map_err(std::io::Error::from)
            });
        }
        Self::launch(command).await
    }

    /// The command [`ServeProcess::start_in`] runs.
    fn command(
        bin: &str,
        cwd: Option<&Path>,
        stderr: Stdio,
        envs: &[(&str, String)],
        args: &[&str],
    ) -> Command {
        let mut command = Command::new(bin);
        command.arg("serve");
        if !args.contains(&"--listen") {
            command.args(["--listen", "127.0.0.1:0"]);
        }
        if let Some(dir) = cwd {
            command.current_dir(dir);
        }
        command
            .args(args)
            .env_remove("DATABASE_URL")
            .env_remove("CREDPOOL_INTERNAL_KEY")
            .env_remove("CREDPOOL_ADMIN_KEY")
            .env_remove("CREDPOOL_MASTER_KEY")
            .env("RUST_LOG", "warn")
            // stop at once on SIGTERM (tests that exercise the delay set it in `envs`)
            .env("CREDPOOL_SHUTDOWN_DELAY_SECONDS", "0")
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true);
        for (name, value) in envs {
            command.env(name, value);
        }
        command
    }

    /// Starts `command` and reads its stdout up to the line that says where it listens.
    async fn launch(mut command: Command) -> Self {
        let mut child = command.spawn().expect("spawn credpool serve");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut banner = Vec::new();
        let base = tokio::time::timeout(Duration::from_secs(120), async {
            loop {
                let mut line = String::new();
                if stdout.read_line(&mut line).await.unwrap() == 0 {
                    panic!("credpool serve exited before listening; it printed: {banner:?}");
                }
                if let Some(addr) = line.trim().strip_prefix("credpool listening on ") {
                    return addr.to_owned();
                }
                banner.push(line.trim_end().to_owned());
            }
        })
        .await
        .expect("credpool serve did not start listening");
        Self {
            child,
            base,
            banner,
            _stdout: stdout,
        }
    }

    /// [`ServeProcess::start_in`] in the test's directory, stderr inherited.
    pub async fn start(bin: &str, envs: &[(&str, String)], args: &[&str]) -> Self {
        Self::start_in(bin, None, Stdio::inherit(), envs, args).await
    }

    /// SIGTERM, then wait for a clean exit.
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id().unwrap() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .expect("credpool serve did not exit after SIGTERM")
            .unwrap()
    }
}

/// The environment of a `credpool serve` on `database` with the tests' keys and 8 connections
/// (as an in-process app's: a pool keeps its connections open while idle, and two tests with
/// two processes each must fit in a server's default 100 beside the suite's racers).
pub fn keyed_env(database: &TestDatabase) -> Vec<(&'static str, String)> {
    vec![
        ("DATABASE_URL", database.url()),
        ("CREDPOOL_INTERNAL_KEY", INTERNAL_KEY.to_owned()),
        ("CREDPOOL_ADMIN_KEY", ADMIN_KEY.to_owned()),
        ("CREDPOOL_DB_MAX_CONNECTIONS", "8".to_owned()),
        ("CREDPOOL_MASTER_KEY", MASTER_KEY.to_owned()),
    ]
}

/// `BIN audit verify --full` (`bin`: the suite's `CARGO_BIN_EXE_credpool`): a proof of the
/// whole trail of `database`, from scratch (rows a test writes into the past are judged too):
/// (passed, everything it printed).
pub async fn audit_verify(bin: &str, database: &TestDatabase) -> (bool, String) {
    let output = tokio::process::Command::new(bin)
        .args(["audit", "verify", "--full"])
        .env("DATABASE_URL", database.url())
        .env("RUST_LOG", "warn")
        .output()
        .await
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr),
    )
}

/// Writes `contents` to `dir/name` with `mode`; returns the path, for a `_FILE` setting.
pub fn secret_file(dir: &Path, name: &str, contents: &str, mode: u32) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path.to_str().unwrap().to_owned()
}
