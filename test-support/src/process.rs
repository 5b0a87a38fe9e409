//! The `credpool` binary as the suites run it: `credpool serve` as a child process
//! ([`ServeProcess`]), its environment, and one-shot commands (`audit verify`, `migrate`, the
//! operator commands) run to their end.
//!
//! Cargo gives a binary's path (`CARGO_BIN_EXE_credpool`) only to the test crates of its own
//! package, so every helper here takes the path from the calling suite (`bin`).

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};

use crate::database::TestDatabase;
use crate::service::{Service, client};
use crate::{ADMIN_KEY, INTERNAL_KEY, MASTER_KEY};

/// A running `credpool serve` process; killed when dropped. Its HTTP calls are the
/// [`Service`] trait's, through a client of its own.
pub struct ServeProcess {
    /// The process.
    pub child: Child,
    /// Its base URL, as it printed it (`http://<address it bound>`).
    pub base: String,
    /// Lines printed to stdout before "listening".
    pub banner: Vec<String>,
    http: reqwest::Client,
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
            http: client(),
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

impl Service for ServeProcess {
    fn http(&self) -> &reqwest::Client {
        &self.http
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

/// The environment of a `credpool serve` on `database` with the tests' keys and 8 connections
/// (as an in-process app's: a pool keeps its connections open while idle, and two tests with
/// two processes each must fit in a server's default 100 beside the suite's racers).
pub fn keyed_env(database: &TestDatabase) -> Vec<(&'static str, String)> {
    keyed_env_at(database.url(), 8)
}

/// `keyed_env(database)` with the service's pool at `max_connections`
/// (`CREDPOOL_DB_MAX_CONNECTIONS`) instead of 8: a replica of a fleet, a soak's service.
pub fn keyed_env_with_connections(
    database: &TestDatabase,
    max_connections: u32,
) -> Vec<(&'static str, String)> {
    keyed_env_at(database.url(), max_connections)
}

/// The environment of a `credpool serve` on the database at `database_url` (one a test built
/// itself: a multi-host URL, a server it restarts) with the tests' keys and a pool of
/// `max_connections` (`CREDPOOL_DB_MAX_CONNECTIONS`).
pub fn keyed_env_at(database_url: String, max_connections: u32) -> Vec<(&'static str, String)> {
    vec![
        ("DATABASE_URL", database_url),
        ("CREDPOOL_INTERNAL_KEY", INTERNAL_KEY.to_owned()),
        ("CREDPOOL_ADMIN_KEY", ADMIN_KEY.to_owned()),
        ("CREDPOOL_DB_MAX_CONNECTIONS", max_connections.to_string()),
        ("CREDPOOL_MASTER_KEY", MASTER_KEY.to_owned()),
    ]
}

/// What a one-shot `credpool` command did.
pub struct Ran {
    /// Whether it exited with status 0.
    pub success: bool,
    /// Everything it printed on stdout.
    pub stdout: String,
    /// Everything it printed on stderr.
    pub stderr: String,
}

impl Ran {
    /// Its `--json` report (stdout); panics, with all it printed, unless that is JSON.
    pub fn report(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}{}", self.stdout, self.stderr))
    }

    /// Everything it printed, stdout then stderr.
    pub fn printed(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// `BIN` (the suite's `CARGO_BIN_EXE_credpool`) on the database at `database_url`, with
/// `RUST_LOG=warn` and stdin closed: the caller adds the arguments and the environment of its
/// command, then [`run`]s it.
pub fn credpool_command(bin: &str, database_url: &str) -> Command {
    let mut command = Command::new(bin);
    command
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null());
    command
}

/// Runs `command` to its end: what it did.
pub async fn run(command: &mut Command) -> Ran {
    let output = command.output().await.expect("running credpool");
    Ran {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// `BIN audit verify --full` (`bin`: the suite's `CARGO_BIN_EXE_credpool`): a proof of the
/// whole trail of `database`, from scratch (rows a test writes into the past are judged too):
/// (passed, everything it printed).
pub async fn audit_verify(bin: &str, database: &TestDatabase) -> (bool, String) {
    let ran = run(credpool_command(bin, &database.url()).args(["audit", "verify", "--full"])).await;
    (ran.success, ran.printed())
}

/// [`audit_verify`], which must pass: everything it printed.
pub async fn audit_passes(bin: &str, database: &TestDatabase) -> String {
    let (ok, output) = audit_verify(bin, database).await;
    assert!(ok, "credpool audit verify failed:\n{output}");
    output
}

/// [`audit_verify`], which must fail, printing each of `findings`: everything it printed.
pub async fn audit_fails(bin: &str, database: &TestDatabase, findings: &[&str]) -> String {
    let (ok, output) = audit_verify(bin, database).await;
    assert!(!ok, "credpool audit verify passed:\n{output}");
    for finding in findings {
        assert!(
            output.contains(finding),
            "{finding:?} not found in:\n{output}"
        );
    }
    output
}

/// `BIN audit verify --json` on the database at `database_url` (`bin`: the suite's
/// `CARGO_BIN_EXE_credpool`): what it did; its report is [`Ran::report`].
pub async fn audit_verify_json(bin: &str, database_url: &str) -> Ran {
    audit_verify_json_with(bin, database_url, &[]).await
}

/// [`audit_verify_json`] with more flags (`--full`, `--chunk-rows N`, ...).
pub async fn audit_verify_json_with(bin: &str, database_url: &str, flags: &[&str]) -> Ran {
    run(credpool_command(bin, database_url)
        .args(["audit", "verify", "--json"])
        .args(flags))
    .await
}

/// A TCP port on 127.0.0.1 that nothing listens on right now (the system chose it), for a
/// server a test starts itself.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

/// Writes `contents` to `dir/name` with `mode`; returns the path, for a `_FILE` setting.
pub fn secret_file(dir: &Path, name: &str, contents: &str, mode: u32) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path.to_str().unwrap().to_owned()
}
