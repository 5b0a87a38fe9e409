//! The test harness: a PostgreSQL server for the whole test process, a fresh migrated database per
//! test, and the real app served on port 0 against it.
//!
//! The server is found in this order: `DATABASE_URL` (any database on it; tests create their own),
//! else a container through testcontainers when a Docker engine answers, else a private cluster
//! started from the PostgreSQL binaries installed on the machine (credpool's own embedded
//! launcher, in a temporary directory).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::str::FromStr;
use std::time::Duration;

use credpool::config::ServiceSettings;
use credpool::embedded::EmbeddedCluster;
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

pub const INTERNAL_KEY: &str = "test-internal-key";
/// The master key the tests seal secrets with.
pub const MASTER_KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

pub fn keyring() -> std::sync::Arc<credpool::secrets::Keyring> {
    let key = credpool::secrets::MasterKey::parse(MASTER_KEY).unwrap();
    std::sync::Arc::new(credpool::secrets::Keyring::new(key, vec![]))
}
pub const ADMIN_KEY: &str = "test-admin-key";

/// What keeps the shared server alive for the whole process.
enum ServerKeeper {
    External,
    #[allow(dead_code)]
    Container(Box<testcontainers::ContainerAsync<testcontainers_modules::postgres::Postgres>>),
    #[allow(dead_code)]
    Embedded(EmbeddedCluster, tempfile::TempDir),
}

struct Server {
    /// Options for a maintenance database on the server (where tests create theirs).
    admin: PgConnectOptions,
    _keeper: ServerKeeper,
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
                    _keeper: ServerKeeper::External,
                };
            }
            if docker_available() {
                use testcontainers::ImageExt;
                use testcontainers::runners::AsyncRunner;
                let container = testcontainers_modules::postgres::Postgres::default()
                    .with_host_auth()
                    .with_tag("15-alpine")
                    .with_cmd(["postgres", "-c", "max_connections=300"])
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
                    _keeper: ServerKeeper::Container(Box::new(container)),
                };
            }
            let dir = tempfile::Builder::new()
                .prefix("credpool-test-pg-")
                .tempdir_in("/tmp")
                .expect("temporary directory");
            let cluster = EmbeddedCluster::start(dir.path(), None)
                .await
                .expect("no DATABASE_URL, no Docker, and the local PostgreSQL binaries failed");
            let admin = cluster.connect_options().database("postgres");
            Server {
                admin,
                _keeper: ServerKeeper::Embedded(cluster, dir),
            }
        })
        .await
}

/// A fresh, migrated database, dropped when this value is dropped.
pub struct TestDatabase {
    pub name: String,
    pub options: PgConnectOptions,
    admin: PgConnectOptions,
}

impl TestDatabase {
    pub async fn create() -> Self {
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
        let pool = PgPool::connect_with(options.clone())
            .await
            .expect("connecting to the new database");
        store::migrate(&pool).await.expect("migrations");
        pool.close().await;
        Self {
            name,
            options,
            admin: server.admin.clone(),
        }
    }

    /// A `postgres://` URL for child processes.
    pub fn url(&self) -> String {
        let host = self.options.get_host();
        let user = self.options.get_username();
        let port = self.options.get_port();
        if host.starts_with('/') {
            format!(
                "postgres://{user}@localhost/{}?host={host}&port={port}",
                self.name
            )
        } else {
            format!("postgres://{user}@{host}:{port}/{}", self.name)
        }
    }

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

pub struct AppOptions {
    pub db_max_connections: u32,
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
    pub addr: SocketAddr,
    pub client: reqwest::Client,
    /// A separate pool for the test's own queries.
    pub db: PgPool,
    pub database: TestDatabase,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl TestApp {
    pub async fn spawn() -> Self {
        Self::spawn_with(AppOptions::default()).await
    }

    pub async fn spawn_with(options: AppOptions) -> Self {
        let database = TestDatabase::create().await;
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

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

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

    pub async fn allocate(&self, body: Value) -> reqwest::Response {
        self.post_internal("/api/internal/allocate-key", body).await
    }

    pub async fn release(&self, body: Value) -> reqwest::Response {
        self.post_internal("/api/internal/release-key", body).await
    }

    pub async fn renew(&self, body: Value) -> reqwest::Response {
        self.post_internal("/api/internal/renew-lease", body).await
    }

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
        for table in ["credentials", "lease_slots", "lease_events"] {
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

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(128)
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

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

pub const BIN: &str = env!("CARGO_BIN_EXE_credpool");

/// A running `credpool serve` process; killed when dropped.
pub struct ServeProcess {
    pub child: Child,
    pub base: String,
    /// Lines printed to stdout before "listening".
    pub banner: Vec<String>,
    _stdout: BufReader<ChildStdout>,
}

impl ServeProcess {
    /// `credpool serve ARGS` (with `--listen 127.0.0.1:0` unless ARGS name a listen address),
    /// run in `cwd` if given.
    pub async fn start_in(
        cwd: Option<&Path>,
        stderr: Stdio,
        envs: &[(&str, String)],
        args: &[&str],
    ) -> Self {
        let mut command = Command::new(BIN);
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
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true);
        for (name, value) in envs {
            command.env(name, value);
        }
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

    pub async fn start(envs: &[(&str, String)], args: &[&str]) -> Self {
        Self::start_in(None, Stdio::inherit(), envs, args).await
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

pub fn keyed_env(database: &TestDatabase) -> Vec<(&'static str, String)> {
    vec![
        ("DATABASE_URL", database.url()),
        ("CREDPOOL_INTERNAL_KEY", INTERNAL_KEY.to_owned()),
        ("CREDPOOL_ADMIN_KEY", ADMIN_KEY.to_owned()),
        ("CREDPOOL_DB_MAX_CONNECTIONS", "32".to_owned()),
        ("CREDPOOL_MASTER_KEY", MASTER_KEY.to_owned()),
    ]
}

/// `credpool audit verify` over the whole trail of `database`: (passed, everything it printed).
pub async fn audit_verify(database: &TestDatabase) -> (bool, String) {
    let output = tokio::process::Command::new(BIN)
        .args(["audit", "verify"])
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
