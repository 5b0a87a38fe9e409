//! The embedded default database: a private PostgreSQL cluster in a data directory, started from
//! the PostgreSQL server binaries installed on the machine, reached over a Unix socket only
//! (tests may choose its port and open TCP too: [`StartOptions`]).
//!
//! Why our own launcher rather than the `postgresql_embedded` crate: that crate's model is to
//! download a PostgreSQL bundle (this project's machines reach no such server) and to run
//! `initdb`/`postgres` as the current user, which PostgreSQL refuses when that user is root. This
//! launcher finds installed binaries and, as root, runs the cluster as an unprivileged user.
//!
//! Layout under the data directory:
//! - `pgdata/`: the cluster (owned by the user PostgreSQL runs as, mode 0700);
//! - `run/`: the Unix socket directory (same owner, mode 0700: nobody else can connect);
//! - `postgres.log`: the server's log.
//!
//! The server runs in its own process group (a terminal's Ctrl-C reaches credpool, which then
//! shuts down in order) and, on Linux, gets SIGINT (fast shutdown) if credpool dies without
//! stopping it. If a server is already running on the data directory (say `credpool serve` in
//! another terminal), it is reused and left running.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::{Pid, User, chown, geteuid};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};

/// The database the service uses inside the private cluster.
pub const DATABASE: &str = "credpool";
/// The cluster's superuser (created by `initdb`).
pub const SUPERUSER: &str = "credpool";
/// The port of a server started without one ([`StartOptions::port`]): the number in its socket's
/// name (`.s.PGSQL.5432`); no TCP port is opened.
pub const DEFAULT_PORT: u16 = 5432;
/// Longest Unix socket path the kernel accepts, less the terminating NUL.
const MAX_SOCKET_PATH: usize = 107;
/// How long the server may take to accept connections after it starts.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a fast shutdown may take before the server is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the embedded database could not be started.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    /// No `initdb` + `postgres` pair was found.
    #[error(
        "PostgreSQL server binaries (initdb and postgres) were not found; searched {searched}. \
         Install PostgreSQL (Debian/Ubuntu: `apt-get install postgresql`; Fedora: `dnf install \
         postgresql-server`; macOS: `brew install postgresql@16`), point --pg-bin-dir at its bin \
         directory, or set DATABASE_URL to use an existing server"
    )]
    BinariesNotFound {
        /// The directories looked in.
        searched: String,
    },
    /// Running as root and no unprivileged user to run PostgreSQL as.
    #[error(
        "running as root, and neither a `postgres` nor a `nobody` user exists to run PostgreSQL as"
    )]
    NoUnprivilegedUser,
    /// The data directory cannot be used.
    #[error("data directory {path}: {reason}")]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// `initdb` failed.
    #[error("initdb failed ({status}); its output:\n{output}")]
    Initdb {
        /// Its exit status.
        status: String,
        /// What it printed.
        output: String,
    },
    /// The server did not come up.
    #[error("PostgreSQL did not start: {reason}; the end of {log}:\n{tail}")]
    Start {
        /// What happened.
        reason: String,
        /// The log file.
        log: String,
        /// Its last lines.
        tail: String,
    },
    /// A file-system or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Talking to the freshly started server failed.
    #[error("preparing the embedded database: {0}")]
    Sql(#[from] sqlx::Error),
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> EmbeddedError {
    let context = context.into();
    move |source| EmbeddedError::Io { context, source }
}

/// Where to look for `initdb` and `postgres`, in order: an explicit directory, `PATH`, then the
/// usual install locations of Debian/Ubuntu (`/usr/lib/postgresql/<version>/bin`, newest first),
/// RHEL (`/usr/pgsql-<version>/bin`), Homebrew and source builds.
pub fn find_binaries(explicit: Option<&Path>) -> Result<PathBuf, EmbeddedError> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(dir) = explicit {
        dirs.push(dir.to_path_buf());
    } else {
        if let Some(path) = std::env::var_os("PATH") {
            dirs.extend(std::env::split_paths(&path));
        }
        for pattern_root in [
            "/usr/lib/postgresql",
            "/usr",
            "/opt/homebrew/opt",
            "/usr/local/opt",
        ] {
            let mut versioned: Vec<(u32, PathBuf)> = fs::read_dir(pattern_root)
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|entry| {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let version = name
                        .strip_prefix("pgsql-")
                        .or_else(|| name.strip_prefix("postgresql@"))
                        .or(if pattern_root == "/usr/lib/postgresql" {
                            Some(name.as_str())
                        } else {
                            None
                        })?
                        .split('.')
                        .next()?
                        .parse::<u32>()
                        .ok()?;
                    Some((version, entry.path().join("bin")))
                })
                .collect();
            versioned.sort_by_key(|(version, _)| std::cmp::Reverse(*version));
            dirs.extend(versioned.into_iter().map(|(_, dir)| dir));
        }
        dirs.extend(
            [
                "/usr/local/pgsql/bin",
                "/opt/homebrew/bin",
                "/usr/local/bin",
            ]
            .into_iter()
            .map(PathBuf::from),
        );
    }
    dirs.iter()
        .find(|dir| dir.join("initdb").is_file() && dir.join("postgres").is_file())
        // a symlink on PATH (/usr/local/bin/postgres -> /usr/lib/postgresql/15/bin/postgres)
        // stands for the installation it points into, whose lib/ holds extensions like pg_cron
        .map(|dir| {
            fs::canonicalize(dir.join("postgres"))
                .ok()
                .and_then(|p| p.parent().map(Path::to_path_buf))
                .filter(|real| real.join("initdb").is_file())
                .unwrap_or_else(|| dir.clone())
        })
        .ok_or_else(|| EmbeddedError::BinariesNotFound {
            searched: dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// The default data directory: `/var/lib/credpool` for root (the cluster's unprivileged owner
/// must be able to reach it, which root's home does not allow), else the user's data directory
/// (`~/.local/share/credpool` on Linux).
pub fn default_data_dir() -> PathBuf {
    if geteuid().is_root() {
        PathBuf::from("/var/lib/credpool")
    } else {
        dirs::data_dir()
            .unwrap_or_else(std::env::temp_dir)
            .join("credpool")
    }
}

/// The user the cluster runs as: the current user, or as root `postgres` (if it exists) else
/// `nobody`.
fn cluster_user() -> Result<Option<User>, EmbeddedError> {
    if !geteuid().is_root() {
        return Ok(None);
    }
    for name in ["postgres", "nobody"] {
        if let Ok(Some(user)) = User::from_name(name) {
            return Ok(Some(user));
        }
    }
    Err(EmbeddedError::NoUnprivilegedUser)
}

/// How [`EmbeddedCluster::start_with`] starts a server. The default is what `credpool serve`
/// uses: port [`DEFAULT_PORT`], socket only, no extra libraries or settings. A server found
/// already running keeps the settings it has.
#[derive(Debug, Clone, Copy)]
pub struct StartOptions<'a> {
    /// The server's port: the number in its socket's name (`.s.PGSQL.<port>`) and, when
    /// `settings` sets `listen_addresses`, its TCP port. Connections from
    /// [`EmbeddedCluster::connect_options`] use it.
    pub port: u16,
    /// Libraries for `shared_preload_libraries`, in this order and ahead of pg_cron (preloaded
    /// when installed), say `&["citus"]` (Citus must be loaded first) for `citus,pg_cron`. Set
    /// them here rather than as a setting, which would drop pg_cron and leave its `cron.*`
    /// settings without it.
    pub preload_libraries: &'a [&'a str],
    /// Extra server settings, each passed as `-c name=value` after credpool's own, so they win:
    /// say `("max_connections", "300")`, or `("listen_addresses", "127.0.0.1")` for TCP on
    /// `port` (credpool's own `listen_addresses` is empty: socket only).
    pub settings: &'a [(&'a str, &'a str)],
}

impl Default for StartOptions<'_> {
    fn default() -> Self {
        StartOptions {
            port: DEFAULT_PORT,
            preload_libraries: &[],
            settings: &[],
        }
    }
}

/// A private PostgreSQL cluster. Stop it with [`EmbeddedCluster::stop`]; dropping it stops it too
/// (blocking). A cluster found already running is left running.
#[derive(Debug)]
pub struct EmbeddedCluster {
    data_dir: PathBuf,
    socket_dir: PathBuf,
    port: u16,
    server: Option<Server>,
    pg_cron: bool,
}

#[derive(Debug)]
struct Server {
    pid: Pid,
    // a Mutex only to make the cluster Sync (tests keep it in a static); never contended
    exited: std::sync::Mutex<mpsc::Receiver<()>>,
    waiter: Option<JoinHandle<()>>,
}

impl EmbeddedCluster {
    /// Initialises the cluster on first use, starts it (or finds it running), and makes sure the
    /// `credpool` database exists. `bin_dir` overrides the binary search.
    pub async fn start(data_dir: &Path, bin_dir: Option<&Path>) -> Result<Self, EmbeddedError> {
        Self::start_with(data_dir, bin_dir, &StartOptions::default()).await
    }

    /// [`EmbeddedCluster::start`] with extra server settings, each passed as `-c name=value` to
    /// a server this call starts (say `("max_connections", "300")` for a test server; they come
    /// after credpool's own, so they win). A server found running keeps the settings it has.
    pub async fn start_with_settings(
        data_dir: &Path,
        bin_dir: Option<&Path>,
        settings: &[(&str, &str)],
    ) -> Result<Self, EmbeddedError> {
        let options = StartOptions {
            settings,
            ..StartOptions::default()
        };
        Self::start_with(data_dir, bin_dir, &options).await
    }

    /// [`EmbeddedCluster::start`] with a port, preloaded libraries and settings of the caller's
    /// ([`StartOptions`]), for a server this call starts. Errors as [`EmbeddedCluster::start`].
    pub async fn start_with(
        data_dir: &Path,
        bin_dir: Option<&Path>,
        options: &StartOptions<'_>,
    ) -> Result<Self, EmbeddedError> {
        // the cluster's processes run from "/", so a relative path would point elsewhere
        let data_dir = std::path::absolute(data_dir).map_err(io(format!(
            "resolving the data directory {}",
            data_dir.display()
        )))?;
        let bin = find_binaries(bin_dir)?;
        let user = cluster_user()?;
        let pgdata = data_dir.join("pgdata");
        let socket_dir = data_dir.join("run");
        let socket = socket_dir.join(format!(".s.PGSQL.{}", options.port));
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(EmbeddedError::DataDir {
                path: data_dir,
                reason: format!(
                    "the socket path {} is longer than {MAX_SOCKET_PATH} bytes; choose a shorter --data-dir",
                    socket.display()
                ),
            });
        }

        prepare_dirs(&data_dir, &pgdata, &socket_dir, user.as_ref())?;
        // pg_cron, when the machine has it (Debian: postgresql-<version>-cron), runs the cleanup
        let pg_cron = bin.join("../lib/pg_cron.so").is_file();
        let mut cluster = EmbeddedCluster {
            data_dir: data_dir.clone(),
            socket_dir,
            port: options.port,
            server: None,
            pg_cron,
        };

        if cluster.connect_to("postgres").await.is_ok() {
            // the usual case for every command next to a running `serve`: nothing to report
            tracing::debug!(data_dir = %data_dir.display(), "embedded PostgreSQL already running; reusing it");
        } else {
            if !pgdata.join("PG_VERSION").is_file() {
                initdb(&bin, &pgdata, user.as_ref())?;
            }
            cluster.server = Some(spawn_server(
                &bin,
                &pgdata,
                &cluster.socket_dir,
                &cluster.log_path(),
                user.as_ref(),
                pg_cron,
                options,
            )?);
            cluster.wait_ready().await?;
            tracing::info!(data_dir = %data_dir.display(), bin = %bin.display(), "embedded PostgreSQL started");
        }
        cluster.ensure_database().await?;
        Ok(cluster)
    }

    /// Connection options for the `credpool` database over the cluster's socket.
    pub fn connect_options(&self) -> PgConnectOptions {
        self.options_for(DATABASE)
    }

    fn options_for(&self, database: &str) -> PgConnectOptions {
        PgConnectOptions::new()
            .socket(&self.socket_dir)
            .port(self.port)
            .username(SUPERUSER)
            .database(database)
    }

    /// The server's port ([`StartOptions::port`]).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether the cluster preloads pg_cron (found next to the server binaries). A cluster found
    /// already running reports whether it has pg_cron loaded after [`EmbeddedCluster::start`].
    pub fn has_pg_cron(&self) -> bool {
        self.pg_cron
    }

    /// The server's log file.
    pub fn log_path(&self) -> PathBuf {
        self.data_dir.join("postgres.log")
    }

    async fn connect_to(&self, database: &str) -> Result<sqlx::PgConnection, sqlx::Error> {
        self.options_for(database).connect().await
    }

    async fn wait_ready(&mut self) -> Result<(), EmbeddedError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            match self.connect_to("postgres").await {
                Ok(conn) => {
                    let _ = conn.close().await;
                    return Ok(());
                }
                Err(error) => {
                    let exited = self.server.as_ref().is_some_and(|s| s.has_exited());
                    if exited || Instant::now() > deadline {
                        let reason = if exited {
                            "the server exited".to_owned()
                        } else {
                            format!(
                                "no connection within {} s ({})",
                                START_TIMEOUT.as_secs(),
                                crate::error_report(&error.into())
                            )
                        };
                        return Err(EmbeddedError::Start {
                            reason,
                            log: self.log_path().display().to_string(),
                            tail: log_tail(&self.log_path()),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    async fn ensure_database(&self) -> Result<(), EmbeddedError> {
        let mut conn = self.connect_to("postgres").await?;
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
                .bind(DATABASE)
                .fetch_one(&mut conn)
                .await?;
        if !exists {
            // CREATE DATABASE takes no parameters; the name is a constant identifier.
            match sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {DATABASE}")))
                .execute(&mut conn)
                .await
            {
                Ok(_) => {}
                // another process created it between our check and now
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => {}
                Err(e) => return Err(e.into()),
            }
        }
        let _ = conn.close().await;
        Ok(())
    }

    /// Stops the server this process started (fast shutdown: open sessions are closed, committed
    /// work is durable), waiting up to 30 s before killing it. A server found running is left alone.
    pub async fn stop(mut self) {
        if let Some(server) = self.server.take() {
            let _ = tokio::task::spawn_blocking(move || server.stop()).await;
        }
    }
}

impl Drop for EmbeddedCluster {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.stop();
        }
    }
}

impl Server {
    fn has_exited(&self) -> bool {
        self.exited.lock().is_ok_and(|rx| rx.try_recv().is_ok())
    }

    fn stop(mut self) {
        let _ = kill(self.pid, Signal::SIGINT);
        let exited = self.exited.get_mut().unwrap_or_else(|p| p.into_inner());
        if exited.recv_timeout(STOP_TIMEOUT).is_err() {
            tracing::warn!(pid = %self.pid, "embedded PostgreSQL did not stop in time; killing it");
            let _ = kill(self.pid, Signal::SIGKILL);
            let _ = exited.recv_timeout(STOP_TIMEOUT);
        }
        if let Some(waiter) = self.waiter.take() {
            let _ = waiter.join();
        }
        tracing::info!("embedded PostgreSQL stopped");
    }
}

fn prepare_dirs(
    data_dir: &Path,
    pgdata: &Path,
    socket_dir: &Path,
    user: Option<&User>,
) -> Result<(), EmbeddedError> {
    fs::create_dir_all(data_dir).map_err(io(format!("creating {}", data_dir.display())))?;
    if let Some(user) = user {
        // Root keeps the data directory; the cluster's user may pass through it but not list it.
        fs::set_permissions(data_dir, fs::Permissions::from_mode(0o711))
            .map_err(io(format!("setting the mode of {}", data_dir.display())))?;
        check_traversable(data_dir, user)?;
    }
    for dir in [pgdata, socket_dir] {
        fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(io(format!("setting the mode of {}", dir.display())))?;
        if let Some(user) = user {
            chown(dir, Some(user.uid), Some(user.gid))
                .map_err(|e| io(format!("handing {} to {}", dir.display(), user.name))(e.into()))?;
        }
    }
    Ok(())
}

/// As root, the cluster's user must be able to reach the data directory through every ancestor.
fn check_traversable(dir: &Path, user: &User) -> Result<(), EmbeddedError> {
    let dir = dir
        .canonicalize()
        .map_err(io(format!("resolving {}", dir.display())))?;
    for ancestor in dir.ancestors().skip(1) {
        let meta = fs::metadata(ancestor).map_err(io(format!("reading {}", ancestor.display())))?;
        let mode = meta.permissions().mode();
        use std::os::unix::fs::MetadataExt;
        let passable = mode & 0o001 != 0
            || (meta.uid() == user.uid.as_raw() && mode & 0o100 != 0)
            || (meta.gid() == user.gid.as_raw() && mode & 0o010 != 0);
        if !passable {
            return Err(EmbeddedError::DataDir {
                path: dir.clone(),
                reason: format!(
                    "PostgreSQL runs as `{}` (it refuses to run as root), and that user cannot pass \
                     through {}; choose a --data-dir outside it (the default for root is /var/lib/credpool)",
                    user.name,
                    ancestor.display()
                ),
            });
        }
    }
    Ok(())
}

fn as_user(command: &mut Command, user: Option<&User>) {
    if let Some(user) = user {
        // HOME too, as `su` sets it: libpq inside the server (Citus's connections to other nodes,
        // postgres_fdw) looks for ~/.postgresql/postgresql.crt, and root's home refuses entry
        command
            .uid(user.uid.as_raw())
            .gid(user.gid.as_raw())
            .env("HOME", &user.dir);
    }
    command.current_dir("/");
}

fn initdb(bin: &Path, pgdata: &Path, user: Option<&User>) -> Result<(), EmbeddedError> {
    let mut command = Command::new(bin.join("initdb"));
    command
        .arg("--pgdata")
        .arg(pgdata)
        .args([
            "--username",
            SUPERUSER,
            "--auth",
            "trust",
            "--encoding",
            "UTF8",
            "--locale",
            "C",
        ])
        .stdin(Stdio::null());
    as_user(&mut command, user);
    let output = command.output().map_err(io("running initdb"))?;
    if output.status.success() {
        tracing::info!(pgdata = %pgdata.display(), "initialised the embedded PostgreSQL cluster");
        Ok(())
    } else {
        Err(EmbeddedError::Initdb {
            status: output.status.to_string(),
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        })
    }
}

fn spawn_server(
    bin: &Path,
    pgdata: &Path,
    socket_dir: &Path,
    log_path: &Path,
    user: Option<&User>,
    pg_cron: bool,
    options: &StartOptions<'_>,
) -> Result<Server, EmbeddedError> {
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(log_path)
        .map_err(io(format!("opening {}", log_path.display())))?;
    let log_err = log.try_clone().map_err(io("duplicating the log handle"))?;
    let mut preload = options.preload_libraries.to_vec();
    if pg_cron {
        preload.push("pg_cron");
    }
    let mut command = Command::new(bin.join("postgres"));
    command
        .arg("-D")
        .arg(pgdata)
        .arg("-k")
        .arg(socket_dir)
        .args(["-p", &options.port.to_string(), "-c", "listen_addresses="])
        .args(if preload.is_empty() {
            Vec::new()
        } else {
            vec![
                "-c".to_owned(),
                format!("shared_preload_libraries={}", preload.join(",")),
            ]
        })
        .args(if pg_cron {
            // jobs run in background workers: no TCP connection back to this socket-only server
            vec![
                "-c".to_owned(),
                format!("cron.database_name={DATABASE}"),
                "-c".to_owned(),
                "cron.use_background_workers=on".to_owned(),
                "-c".to_owned(),
                "max_worker_processes=16".to_owned(),
            ]
        } else {
            Vec::new()
        })
        .args(
            options
                .settings
                .iter()
                .flat_map(|(name, value)| ["-c".to_owned(), format!("{name}={value}")]),
        )
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .process_group(0);
    as_user(&mut command, user);
    #[cfg(target_os = "linux")]
    unsafe {
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec. It runs
        // after std has switched to the cluster's user, which would otherwise clear the setting.
        command.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(Signal::SIGINT).map_err(std::io::Error::from)
        });
    }

    // A dedicated thread spawns and reaps the server: the parent-death signal follows the thread
    // that forked, and this thread lives exactly as long as the server.
    let (started_tx, started_rx) = mpsc::channel();
    let (exited_tx, exited_rx) = mpsc::channel();
    let waiter = std::thread::Builder::new()
        .name("embedded-postgres".into())
        .spawn(move || match command.spawn() {
            Ok(mut child) => {
                let _ = started_tx.send(Ok(Pid::from_raw(child.id() as i32)));
                let _ = child.wait();
                let _ = exited_tx.send(());
            }
            Err(e) => {
                let _ = started_tx.send(Err(e));
            }
        })
        .map_err(io("starting the embedded-postgres thread"))?;
    let pid = started_rx
        .recv()
        .map_err(|_| EmbeddedError::Start {
            reason: "the launcher thread died".into(),
            log: log_path.display().to_string(),
            tail: String::new(),
        })?
        .map_err(io(format!("running {}", bin.join("postgres").display())))?;
    Ok(Server {
        pid,
        exited: std::sync::Mutex::new(exited_rx),
        waiter: Some(waiter),
    })
}

/// The last 20 lines of the server log, for error messages.
fn log_tail(path: &Path) -> String {
    let mut text = String::new();
    if let Ok(mut file) = File::open(path) {
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = file.seek(SeekFrom::Start(len.saturating_sub(8192)));
        let _ = file.read_to_string(&mut text);
    }
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}
