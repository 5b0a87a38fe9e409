//! A real Citus cluster for a test: a coordinator and two workers, each a private PostgreSQL
//! cluster (credpool's embedded launcher, `credpool::embedded`) in a temporary directory,
//! listening on a free TCP port of 127.0.0.1 and preloading Citus.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use credpool::embedded::{self, EmbeddedCluster, StartOptions};
use credpool_test_support::{free_port, report_skipped};
use sqlx::{Connection, PgConnection};
use tempfile::TempDir;

/// Where the tests find the host every node listens on (and the nodes find each other).
const HOST: &str = "127.0.0.1";
/// How many workers a cluster has.
const WORKERS: usize = 2;
/// `max_connections` of every node: Citus opens connections from the coordinator to the
/// workers, per shard a query touches, besides the test's own.
const MAX_CONNECTIONS: &str = "300";
/// How long a node may take to turn SSL on after `CREATE EXTENSION citus` asked it to.
const SSL_TIMEOUT: Duration = Duration::from_secs(10);
/// The variable that skips the Citus tests on a machine that has Citus.
const SKIP_VARIABLE: &str = "CREDPOOL_TEST_SKIP_CITUS";

/// A coordinator and two workers, registered with each other (the coordinator's `pg_dist_node`
/// lists all three). Every server stops, and its directory goes, when the value drops.
#[derive(Debug)]
pub struct CitusCluster {
    coordinator: Node,
    workers: Vec<Node>,
    /// The PostgreSQL server binaries, next to which Citus is installed.
    bin_dir: PathBuf,
}

/// One node: its server (`None` while stopped by [`CitusCluster::stop_worker`]), its port, and
/// the directory that holds its data. The server comes first: a struct drops its fields in
/// order, so the server stops before its directory is removed.
#[derive(Debug)]
struct Node {
    server: Option<EmbeddedCluster>,
    port: u16,
    dir: TempDir,
}

impl CitusCluster {
    /// Starts the three nodes (in parallel on a multi-thread runtime), creates the `citus`
    /// extension in the `credpool` database of each and registers the workers with the
    /// coordinator. `None`, after a `skipped: <test>: <why>` line (test-support's
    /// `report_skipped`), when Citus is not installed next to the PostgreSQL server binaries or
    /// `CREDPOOL_TEST_SKIP_CITUS` is set.
    /// Panics when a node does not start or the cluster cannot be set up.
    pub async fn start() -> Option<CitusCluster> {
        let bin_dir = match citus_bin_dir() {
            Ok(bin_dir) => bin_dir,
            Err(reason) => {
                report_skipped(&reason);
                return None;
            }
        };
        let starting: Vec<_> = (0..=WORKERS)
            .map(|_| tokio::spawn(Node::start_new(bin_dir.clone())))
            .collect();
        let mut nodes = Vec::with_capacity(starting.len());
        for node in starting {
            nodes.push(node.await.expect("a Citus node's start panicked"));
        }
        let workers = nodes.split_off(1);
        let cluster = CitusCluster {
            coordinator: nodes.remove(0),
            workers,
            bin_dir,
        };
        cluster.register_nodes().await;
        Some(cluster)
    }

    /// The coordinator's `credpool` database over TCP, as the superuser `credpool`:
    /// `postgres://credpool@127.0.0.1:<port>/credpool?sslmode=disable` (Citus turns SSL on with
    /// a self-signed certificate, which sqlx's rustls refuses).
    pub fn coordinator_url(&self) -> String {
        self.coordinator.url()
    }

    /// Worker `i`'s (0 or 1) `credpool` database, in the shape of
    /// [`CitusCluster::coordinator_url`]. Panics on another `i`.
    pub fn worker_url(&self, i: usize) -> String {
        self.worker(i).url()
    }

    /// Worker `i`'s port on 127.0.0.1, as the coordinator's `pg_dist_node.nodeport` has it.
    /// Panics on an `i` other than 0 or 1.
    pub fn worker_port(&self, i: usize) -> u16 {
        self.worker(i).port
    }

    /// Stops worker `i` (fast shutdown: its sessions, the coordinator's among them, are closed),
    /// waiting up to 30 s before killing it. The coordinator still lists it. Panics when it is
    /// already stopped.
    pub async fn stop_worker(&mut self, i: usize) {
        let server = self.workers[i]
            .server
            .take()
            .unwrap_or_else(|| panic!("worker {i} is already stopped"));
        server.stop().await;
    }

    /// Starts worker `i` again after [`CitusCluster::stop_worker`], on the same port and data
    /// directory (its shards and its `citus` extension as they were). Panics when it is running
    /// or does not start.
    pub async fn start_worker(&mut self, i: usize) {
        let worker = &mut self.workers[i];
        assert!(worker.server.is_none(), "worker {i} is running");
        worker.server = Some(start_server(worker.dir.path(), &self.bin_dir, worker.port).await);
    }

    fn worker(&self, i: usize) -> &Node {
        self.workers
            .get(i)
            .unwrap_or_else(|| panic!("there is no worker {i}; the workers are 0 and 1"))
    }

    /// Tells the coordinator where it and the workers are. Citus connects to every node over
    /// TCP, as the connecting user (`credpool`) to the same database (`credpool`).
    async fn register_nodes(&self) {
        let mut conn = connect(&self.coordinator_url()).await;
        sqlx::query("SELECT citus_set_coordinator_host($1, $2)")
            .bind(HOST)
            .bind(i32::from(self.coordinator.port))
            .execute(&mut conn)
            .await
            .expect("citus_set_coordinator_host");
        for worker in &self.workers {
            sqlx::query("SELECT citus_add_node($1, $2)")
                .bind(HOST)
                .bind(i32::from(worker.port))
                .execute(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("citus_add_node for port {}: {e}", worker.port));
        }
        let _ = conn.close().await;
    }
}

impl Node {
    /// A node in a new temporary directory on a free port, with the `citus` extension created.
    async fn start_new(bin_dir: PathBuf) -> Node {
        // under /tmp, not $TMPDIR: the socket's path must stay short, and the cluster's
        // unprivileged user must be able to pass through its parents
        let dir = tempfile::Builder::new()
            .prefix("credpool-citus-")
            .tempdir_in("/tmp")
            .expect("a temporary directory");
        let port = free_port();
        let server = start_server(dir.path(), &bin_dir, port).await;
        let node = Node {
            server: Some(server),
            port,
            dir,
        };
        node.create_extension().await;
        node
    }

    fn url(&self) -> String {
        format!(
            "postgres://{}@{HOST}:{}/{}?sslmode=disable",
            embedded::SUPERUSER,
            self.port,
            embedded::DATABASE
        )
    }

    /// Creates the `citus` extension, then waits for the server to have turned SSL on (the
    /// extension's first creation asks for it with a configuration reload, which the server
    /// applies a moment later; the coordinator's connections to a worker require SSL).
    async fn create_extension(&self) {
        let mut conn = connect(&self.url()).await;
        sqlx::raw_sql("CREATE EXTENSION citus")
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("CREATE EXTENSION citus on port {}: {e}", self.port));
        let _ = conn.close().await;
        let deadline = Instant::now() + SSL_TIMEOUT;
        loop {
            // a new session: it starts with the configuration the server has now
            let mut conn = connect(&self.url()).await;
            let ssl: String = sqlx::query_scalar("SELECT current_setting('ssl')")
                .fetch_one(&mut conn)
                .await
                .expect("reading the ssl setting");
            let _ = conn.close().await;
            if ssl == "on" {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the node on port {} did not turn SSL on within {} s of CREATE EXTENSION citus",
                self.port,
                SSL_TIMEOUT.as_secs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Starts (or restarts) a node's server in `data_dir` from the binaries in `bin_dir` on `port`,
/// listening on 127.0.0.1 and preloading Citus.
async fn start_server(data_dir: &Path, bin_dir: &Path, port: u16) -> EmbeddedCluster {
    let options = StartOptions {
        port,
        preload_libraries: &["citus"],
        settings: &[
            ("listen_addresses", HOST),
            ("max_connections", MAX_CONNECTIONS),
        ],
    };
    EmbeddedCluster::start_with(data_dir, Some(bin_dir), &options)
        .await
        .unwrap_or_else(|e| panic!("starting a Citus node on port {port}: {e}"))
}

/// The directory of the PostgreSQL server binaries, when Citus is installed next to them; else
/// why the Citus tests skip themselves.
fn citus_bin_dir() -> Result<PathBuf, String> {
    if std::env::var_os(SKIP_VARIABLE).is_some() {
        return Err(format!("{SKIP_VARIABLE} is set"));
    }
    let bin_dir = embedded::find_binaries(None).map_err(|e| e.to_string())?;
    // find_binaries resolves symlinks, so bin/.. is the installation's root
    let citus = bin_dir
        .parent()
        .unwrap_or(&bin_dir)
        .join("lib")
        .join("citus.so");
    if citus.is_file() {
        Ok(bin_dir)
    } else {
        Err(format!(
            "Citus is not installed ({}); build it with ../shared/citus/build.sh, see docs/src/citus.md",
            citus.display()
        ))
    }
}

/// A connection to `url`; panics, naming it, when there is none.
pub async fn connect(url: &str) -> PgConnection {
    PgConnection::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connecting to {url}: {e}"))
}
