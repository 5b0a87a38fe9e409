//! The PostgreSQL server of a test process and the fresh, migrated database each test gets.
//!
//! The server is found in this order: `DATABASE_URL` (any database on it; tests create their own),
//! else a container through testcontainers when a Docker engine answers, else a private cluster
//! started from the PostgreSQL binaries installed on the machine (credpool's own embedded
//! launcher, in a temporary directory that goes when the test process exits: `private_cluster`).
//! Child processes reach the server through [`TestDatabase::url`], also over the private
//! cluster's Unix socket.

use std::str::FromStr;

use credpool::store;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgPool};
use tokio::sync::{Mutex, MutexGuard, OnceCell};

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

/// A directory of a test's own under `/tmp` (a private cluster's, a process's files), named
/// `prefix` and a random tail; removed when dropped. (Under `/tmp`, not `$TMPDIR`: a Unix
/// socket's path must stay short.)
pub fn tmp_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .unwrap_or_else(|e| panic!("a directory {prefix}* in /tmp: {e}"))
}

/// A private cluster in `dir` that preloads pg_stat_statements (postgresql-contrib), with
/// `settings` besides, and its `postgres` database migrated: the cluster, and a pool on it.
pub async fn statements_cluster(
    dir: &std::path::Path,
    settings: &[(&str, &str)],
) -> (credpool::embedded::EmbeddedCluster, PgPool) {
    let settings = [
        &[("shared_preload_libraries", "pg_stat_statements")],
        settings,
    ]
    .concat();
    let cluster = credpool::embedded::EmbeddedCluster::start_with_settings(dir, None, &settings)
        .await
        .expect("a private cluster with pg_stat_statements (postgresql-contrib)");
    let pool = PgPool::connect_with(cluster.connect_options())
        .await
        .unwrap();
    store::migrate(&pool).await.unwrap();
    (cluster, pool)
}

/// A pool as the service opens its own ([`store::connect_lazy`]) on `options`: at most
/// `max_connections`, each waited for at most `acquire_timeout`.
pub fn lazy_pool(
    options: PgConnectOptions,
    max_connections: u32,
    acquire_timeout: std::time::Duration,
) -> PgPool {
    store::connect_lazy(
        options,
        &store::PoolSettings {
            max_connections,
            acquire_timeout,
        },
    )
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

    /// A fresh database migrated up to and including migration `version` (the schema of an
    /// earlier release, for an upgrade to start from), with a pool of 2 connections on it.
    pub async fn create_at(version: i64) -> (Self, PgPool) {
        let database = Self::create_empty().await;
        let pool = database.pool(2).await;
        store::MIGRATOR
            .run_to(version, &pool)
            .await
            .unwrap_or_else(|e| panic!("the migrations up to {version}: {e}"));
        (database, pool)
    }

    /// A `postgres://` URL of this database for child processes.
    pub fn url(&self) -> String {
        url_for(&self.options, &self.name)
    }

    /// `ALTER DATABASE ... SET {setting}` (`name = value`): a setting every connection made
    /// afterwards starts with, the service's too.
    pub async fn set(&self, setting: &str) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE \"{}\" SET {setting}",
            self.name
        )))
        .execute(&self.pool(1).await)
        .await
        .unwrap_or_else(|e| panic!("SET {setting}: {e}"));
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
    crate::env_number("CREDPOOL_RACE_ROUNDS", 60)
}
