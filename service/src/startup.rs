//! Building and running the service: `credpool serve` and the in-process server of the demo and
//! the tests share [`Application`].

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;

use crate::allocator::Allocator;
use crate::allocator::candidates::CandidateViews;
use crate::allocator::groups::Groups;
use crate::allocator::waiting::{ListenTarget, Waits};
use crate::background::Supervisor;
use crate::config::{DatabaseArgs, SecretArgs, ServeArgs, ServiceSettings};
use crate::database::Database;
use crate::embedded;
use crate::http::server::HttpLimits;
use crate::http::{self, ApiKeys, AppState, Shared, ShuttingDown};
use crate::secrets::{Keyring, MasterKey};
use crate::store::{self, credentials::Actor};
use crate::telemetry;

/// A pool nobody allocated from for this long drops out of the periodic view refresh.
const VIEW_FORGET_AFTER: std::time::Duration = std::time::Duration::from_secs(600);

/// A bound, not yet serving, instance of the HTTP API.
#[derive(Debug)]
pub struct Application {
    listener: TcpListener,
    state: AppState,
    /// The connection limits it serves under (the cap fitted to the open-file limit).
    http: HttpLimits,
}

impl Application {
    /// Binds `listen` (port 0 picks a free port) and prepares the router over `db` (a `PgPool`
    /// for a direct connection, or a [`store::Db`]). Must run in a Tokio runtime: it starts the
    /// candidate views' periodic refresh, which stops when the application is dropped.
    pub async fn bind(
        listen: &str,
        db: impl Into<store::Db>,
        keys: ApiKeys,
        keyring: Arc<Keyring>,
        settings: &ServiceSettings,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let db = db.into();
        let http = settings
            .http
            .fitted_to_open_files(db.pool().options().get_max_connections());
        // install the metrics recorder before the first request records anything
        crate::telemetry::prometheus();
        let background = Supervisor::new();
        let views = CandidateViews::new(
            db.clone(),
            settings.scoring.clone(),
            settings.health.clone(),
        );
        views.spawn_refresher(settings.view_refresh, VIEW_FORGET_AFTER, &background);
        let listen = match (&settings.listen_url, db.is_pooled()) {
            (Some(url), _) => ListenTarget::Url(url.clone()),
            (None, false) => ListenTarget::SameAs(db.clone()),
            (None, true) => {
                if !settings.max_wait.is_zero() {
                    tracing::warn!(
                        "--db-pooler transaction without --db-listen-url: waiting allocations wake only on their timers and this process's releases"
                    );
                }
                ListenTarget::None
            }
        };
        let waits = Waits::new(views.clone(), listen, Some(db.clone()), background.clone());
        let state = AppState::new(Shared {
            allocator: Allocator {
                groups: Groups::start(db.clone(), settings.groups, &background),
                views,
                waits,
                claims: settings.claims,
                keyring: keyring.clone(),
                health: settings.health.clone(),
            },
            db,
            keys,
            max_lease_seconds: settings.max_lease_seconds,
            health: settings.health.clone(),
            keyring,
            request_timeout: settings.request_timeout,
            max_wait: settings.max_wait,
            shutting_down: ShuttingDown::default(),
            background: background.clone(),
            allow_private_token_urls: settings.oauth.allow_private_token_urls,
            relay: crate::http::relay::RelayClient::new(),
        });
        // the OAuth refresher runs in every replica; PostgreSQL picks one writer per generation
        crate::oauth::Refresher::new(
            state.db.clone(),
            state.keyring.clone(),
            settings.oauth.clone(),
        )
        .spawn(state.downgrade(), &background);
        // the pools there are now: their series exist (at zero) from the first scrape on
        sample_pools(&state.db).await;
        Ok(Self {
            listener,
            state,
            http,
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The supervisor of this application's background tasks: a task spawned on it that panics is
    /// made again after a backoff, counted in `credpool_background_task_restarts_total`, and
    /// makes `/readyz` answer 503 until then.
    pub fn supervisor(&self) -> &Supervisor {
        &self.state.background
    }

    /// Serves until `shutdown` resolves, then stops accepting and lets in-flight requests finish
    /// (however long they take), under the connection limits ([`http::server`]). `credpool serve`
    /// stops in phases instead: [`Application::run_with_shutdown`].
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        http::server::serve(self.listener, http::app(self.state), self.http, shutdown).await
    }

    /// Serves until the first item of `stops` (a SIGINT or SIGTERM: [`stop_signals`]), then shuts
    /// down in three phases, so that a rolling update loses no request:
    /// 1. **Not ready, still serving**, for `phases.delay`: `/readyz` answers 503
    ///    `shutting_down` at once, everything else is served as before (load balancers and
    ///    Kubernetes take a few seconds to stop routing here after the signal).
    /// 2. **Stop accepting**: the listener closes.
    /// 3. **Drain**, for up to `phases.drain`: in-flight requests finish, waiting allocations
    ///    keep waiting; when the drain time is over, waiting allocations answer 429 at once
    ///    (they get [`ANSWER_GRACE`] to be written), and whatever is still running is cut.
    ///
    /// Returns when every connection has closed. A second item of `stops` skips what is left of
    /// the delay and the drain.
    pub async fn run_with_shutdown(
        self,
        mut stops: impl Stream<Item = ()> + Unpin + Send,
        phases: ShutdownPhases,
    ) -> std::io::Result<()> {
        let shutting_down = self.state.shutting_down.clone();
        let allocator = self.state.allocator.clone();
        let (close, closed) = tokio::sync::oneshot::channel::<()>();
        let mut server = tokio::spawn(self.run_until(async {
            let _ = closed.await;
        }));
        let ended = |joined: Result<std::io::Result<()>, tokio::task::JoinError>| {
            joined.map_err(std::io::Error::other)?
        };
        tokio::select! {
            // the server ended on its own (a listener error)
            joined = &mut server => return ended(joined),
            Some(()) = stops.next() => {}
        }

        shutting_down.begin();
        tracing::info!(
            delay_seconds = phases.delay.as_secs_f64(),
            "shutting down: /readyz answers 503 shutting_down; still serving for the delay"
        );
        let hurry = tokio::select! {
            joined = &mut server => return ended(joined),
            () = tokio::time::sleep(phases.delay) => false,
            Some(()) = stops.next() => true,
        };

        let _ = close.send(());
        tracing::info!(
            drain_seconds = phases.drain.as_secs_f64(),
            "shutting down: no new connections; draining in-flight requests"
        );
        if !hurry {
            tokio::select! {
                drained = tokio::time::timeout(phases.drain, &mut server) => {
                    if let Ok(joined) = drained {
                        return ended(joined);
                    }
                }
                Some(()) = stops.next() => {}
            }
        }

        // waiting allocations answer now (429); give them a moment to be written
        allocator.stop_waiting();
        match tokio::time::timeout(ANSWER_GRACE, &mut server).await {
            Ok(joined) => ended(joined),
            Err(_) => {
                tracing::warn!(
                    drain_seconds = phases.drain.as_secs_f64(),
                    "requests still in flight after the drain time; stopping anyway"
                );
                server.abort();
                Ok(())
            }
        }
    }
}

/// The phases of a shutdown ([`Application::run_with_shutdown`]).
#[derive(Debug, Clone, Copy)]
pub struct ShutdownPhases {
    /// How long the service keeps serving, not ready, after the signal
    /// (`--shutdown-delay-seconds`).
    pub delay: Duration,
    /// How long in-flight requests get once the listener has closed
    /// (`--shutdown-drain-seconds`).
    pub drain: Duration,
}

/// After the drain, how long the waiting allocations get to write their 429 before the server
/// is cut: they answer at once, but one may be in the middle of a claim statement.
pub const ANSWER_GRACE: Duration = Duration::from_secs(2);

/// The generated keys of the embedded default, kept in the data directory (mode 0600).
#[derive(Debug, Serialize, Deserialize)]
struct StoredKeys {
    internal_key: String,
    admin_key: String,
}

const KEYS_FILE: &str = "service-keys.json";

fn random_key() -> String {
    hex::encode(rand::random::<[u8; 32]>())
}

/// The service's API keys: as configured; with the embedded default, missing ones come from (or
/// are generated into) `<data dir>/service-keys.json` and printed once when generated. With an
/// explicit `DATABASE_URL`, a missing key is an error.
/// The keys given by flag or environment, checked before anything else happens: both, or with
/// an explicit `DATABASE_URL` an error naming the missing one; `None` when the embedded default
/// may fill in the missing ones.
fn configured_keys(args: &ServeArgs) -> anyhow::Result<Option<ApiKeys>> {
    match (&args.internal_key, &args.admin_key) {
        (Some(internal), Some(admin)) => Ok(Some(
            ApiKeys::new(internal.clone(), admin.clone()).map_err(anyhow::Error::msg)?,
        )),
        (internal, _) if args.db.database_url.is_some() => bail!(
            "{} must be set when DATABASE_URL is (keys are generated only for the embedded default)",
            if internal.is_none() {
                "CREDPOOL_INTERNAL_KEY (or CREDPOOL_INTERNAL_KEY_FILE)"
            } else {
                "CREDPOOL_ADMIN_KEY (or CREDPOOL_ADMIN_KEY_FILE)"
            }
        ),
        _ => Ok(None),
    }
}

/// With the embedded default: the configured keys, the missing ones from (or generated into)
/// `<data dir>/service-keys.json`.
fn embedded_keys(args: &ServeArgs, data_dir: &Path) -> anyhow::Result<ApiKeys> {
    let stored = load_or_generate_keys(data_dir, args)?;
    ApiKeys::new(
        args.internal_key.clone().unwrap_or(stored.internal_key),
        args.admin_key.clone().unwrap_or(stored.admin_key),
    )
    .map_err(anyhow::Error::msg)
}

fn load_or_generate_keys(dir: &Path, args: &ServeArgs) -> anyhow::Result<StoredKeys> {
    let path = dir.join(KEYS_FILE);
    // how to print the keys again from another shell
    let program = own_command();
    let env_command = if dir == embedded::default_data_dir() {
        format!("{program} env")
    } else {
        format!(
            "{program} env --data-dir {}",
            shell_word(&dir.display().to_string())
        )
    };
    if path.exists() {
        let keys = read_keys(&path)?;
        let from_file = match (&args.internal_key, &args.admin_key) {
            (None, None) => "API keys",
            (None, Some(_)) => "the internal key (the admin key is configured)",
            (Some(_), _) => "the admin key (the internal key is configured)",
        };
        println!(
            "credpool: {from_file} from {} (`eval \"$({env_command})\"` exports them in a shell)",
            path.display()
        );
        return Ok(keys);
    }
    let keys = StoredKeys {
        internal_key: random_key(),
        admin_key: random_key(),
    };
    write_private(&path, &serde_json::to_vec_pretty(&keys)?)?;
    println!(
        "credpool: generated API keys, stored in {} (mode 0600); in another shell, \
         `eval \"$({env_command})\"` exports them:\n{}",
        path.display(),
        export_lines(&keys)
    );
    Ok(keys)
}

/// How another shell runs this binary: `credpool` when that is what `PATH` finds, else this
/// binary's path (`cargo run -- serve` runs `target/.../credpool`, which is not on `PATH` until
/// `cargo install` puts it there).
fn own_command() -> String {
    let Ok(exe) = std::env::current_exe().and_then(|exe| exe.canonicalize()) else {
        return "credpool".to_owned();
    };
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("credpool"))
            .find(|candidate| candidate.is_file())
    });
    match on_path.and_then(|found| found.canonicalize().ok()) {
        Some(found) if found == exe => "credpool".to_owned(),
        _ => shell_word(&exe.display().to_string()),
    }
}

fn read_keys(path: &Path) -> anyhow::Result<StoredKeys> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid", path.display()))
}

/// The keys as lines a POSIX shell can `eval` or source.
fn export_lines(keys: &StoredKeys) -> String {
    format!(
        "export CREDPOOL_INTERNAL_KEY={}\nexport CREDPOOL_ADMIN_KEY={}",
        shell_word(&keys.internal_key),
        shell_word(&keys.admin_key)
    )
}

/// `text` as one word of a POSIX shell: as it is when it holds nothing the shell would
/// interpret, else in single quotes.
fn shell_word(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.,/:@%+=".contains(c));
    if plain {
        text.to_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// `credpool env`: the API keys `serve` generated for the embedded default in `data_dir` (default
/// [`embedded::default_data_dir`]), as `export` lines on stdout.
pub fn print_env(data_dir: Option<PathBuf>) -> anyhow::Result<()> {
    let dir = data_dir.unwrap_or_else(embedded::default_data_dir);
    let path = dir.join(KEYS_FILE);
    if !path.exists() {
        bail!(
            "{} does not exist: `credpool serve` generates the API keys there when it first \
             starts on the embedded default (no DATABASE_URL) with this data directory; with \
             DATABASE_URL, the keys are the ones you configured",
            path.display()
        );
    }
    println!("{}", export_lines(&read_keys(&path)?));
    Ok(())
}

const MASTER_KEY_FILE: &str = "master.key";

/// Checked before anything else happens: with an explicit `DATABASE_URL`, a master key must be
/// configured (keys are generated only for the embedded default).
pub fn check_secret_config(secrets: &SecretArgs, db: &DatabaseArgs) -> anyhow::Result<()> {
    if db.database_url.is_some() && !secrets.configured() {
        bail!(
            "CREDPOOL_MASTER_KEY (or CREDPOOL_MASTER_KEY_FILE) must be set when DATABASE_URL is: it seals credential secrets at rest (generate one with `openssl rand -hex 32`)"
        );
    }
    Ok(())
}

/// The keyring from configuration, or with the embedded default from (or generated into)
/// `<data dir>/master.key` (mode 0600). Then checks that every stored secret opens with it, and
/// seals any secret still stored as plaintext.
pub async fn prepare_keyring(
    secrets: &SecretArgs,
    database: &Database,
) -> anyhow::Result<Arc<Keyring>> {
    let mut previous = Vec::new();
    if let Some(list) = &secrets.previous_master_keys {
        for key in list.split(',').filter(|k| !k.trim().is_empty()) {
            previous.push(MasterKey::parse(key).context("CREDPOOL_PREVIOUS_MASTER_KEYS")?);
        }
    }
    let current = if let Some(key) = &secrets.master_key {
        MasterKey::parse(key).context("CREDPOOL_MASTER_KEY")?
    } else {
        let path = match (&secrets.master_key_file, &database.data_dir) {
            (Some(path), _) => path.clone(),
            (None, Some(dir)) => dir.join(MASTER_KEY_FILE),
            (None, None) => bail!("no master key configured"),
        };
        if secrets.master_key_file.is_none() && !path.exists() {
            let key = MasterKey::generate();
            write_private(&path, format!("{}\n", key.to_hex().as_str()).as_bytes())?;
            println!(
                "credpool: generated a master key for credential secrets in {} (mode 0600)",
                path.display()
            );
        }
        let text = crate::config::read_secret_file(&path, "CREDPOOL_MASTER_KEY_FILE")?;
        let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
        let current = MasterKey::parse(lines.next().unwrap_or_default())
            .with_context(|| format!("the first line of {}", path.display()))?;
        for line in lines {
            previous.push(
                MasterKey::parse(line)
                    .with_context(|| format!("a later line of {}", path.display()))?,
            );
        }
        current
    };
    let keyring = Keyring::new(current, previous);

    let known: Vec<String> = keyring.keys().map(MasterKey::fingerprint).collect();
    let missing: Vec<String> = store::credentials::sealing_keys(&database.pool)
        .await?
        .into_iter()
        .filter(|(fingerprint, _)| !known.contains(fingerprint))
        .map(|(fingerprint, count)| format!("{count} under master key {fingerprint}"))
        .collect();
    if !missing.is_empty() {
        bail!(
            "stored credential secrets are sealed under master keys that are not configured ({}); configure the key as CREDPOOL_MASTER_KEY or in CREDPOOL_PREVIOUS_MASTER_KEYS",
            missing.join(", ")
        );
    }
    let actor = Actor::parse("credpool start-up").map_err(anyhow::Error::msg)?;
    let sealed = store::credentials::reseal(&database.pool, &keyring, true, &actor).await?;
    if sealed > 0 {
        tracing::info!(sealed, "sealed credential secrets stored as plaintext");
    }
    tracing::info!(master_key = %keyring.current().fingerprint(), previous = keyring.keys().count() - 1, "master keys loaded");
    Ok(Arc::new(keyring))
}

/// Writes a file only its owner can read (created with mode 0600, then moved into place).
fn write_private(path: &Path, contents: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    file.write_all(contents)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// SIGINT and SIGTERM, one item each time either arrives. The handlers are installed when this
/// is called (from then on the signals no longer end the process by themselves), so call it
/// before announcing that the service listens.
pub fn stop_signals() -> std::io::Result<impl Stream<Item = ()> + Unpin + Send> {
    use tokio::signal::unix::{SignalKind, signal};
    let interrupt = signal(SignalKind::interrupt())?;
    let terminate = signal(SignalKind::terminate())?;
    Ok(Box::pin(futures::stream::unfold(
        (interrupt, terminate),
        |(mut interrupt, mut terminate)| async move {
            let name = tokio::select! {
                Some(()) = interrupt.recv() => "SIGINT",
                Some(()) = terminate.recv() => "SIGTERM",
                else => return None,
            };
            tracing::info!(signal = name, "stop signal received");
            Some(((), (interrupt, terminate)))
        },
    )))
}

/// `credpool serve`: opens the database (embedded or `DATABASE_URL`), applies migrations, serves
/// until SIGINT/SIGTERM and shuts down in phases ([`Application::run_with_shutdown`]), then
/// closes the pool and stops the embedded cluster.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let keys = configured_keys(&args)?;
    check_secret_config(&args.secrets, &args.db)?;
    let database = Database::open(&args.db).await?;
    database.check_replication().await;
    database
        .schedule_cleanup_in_pg_cron(args.maintenance.retention())
        .await;
    let result = serve_on(&args, keys, &database).await;
    database.close().await;
    result
}

async fn serve_on(
    args: &ServeArgs,
    keys: Option<ApiKeys>,
    database: &Database,
) -> anyhow::Result<()> {
    let keys = match (keys, database.data_dir.as_deref()) {
        (Some(keys), _) => keys,
        (None, Some(dir)) => embedded_keys(args, dir)?,
        (None, None) => unreachable!("configured_keys requires both keys with DATABASE_URL"),
    };
    let keyring = prepare_keyring(&args.secrets, database).await?;
    let app = Application::bind(
        &args.listen,
        database.pool.clone(),
        keys,
        keyring,
        &args.service.settings(),
    )
    .await
    .with_context(|| format!("cannot listen on --listen {}", args.listen))?;
    let addr = app.local_addr()?;
    let stops = stop_signals().context("installing the SIGINT/SIGTERM handlers")?;
    // stdout, so that scripts and tests can read the bound port
    println!("credpool listening on http://{addr}");
    tracing::info!(%addr, "listening");
    let (maintenance_every, retention) = (
        Duration::from_secs(args.maintenance.maintenance_interval_seconds),
        args.maintenance.retention(),
    );
    let sample_every = Duration::from_secs(args.metrics_sample_seconds);
    let db = database.pool.clone();
    let background = [
        app.supervisor().spawn("maintenance", {
            let db = db.clone();
            move || store::maintenance::scheduler(db.clone(), maintenance_every, retention)
        }),
        app.supervisor().spawn("metrics_sampler", move || {
            sample_metrics(db.clone(), sample_every)
        }),
    ];
    // the caller closes the pool and the embedded database after this returns
    let served = app
        .run_with_shutdown(
            stops,
            ShutdownPhases {
                delay: Duration::from_secs(args.shutdown_delay_seconds),
                drain: Duration::from_secs(args.shutdown_drain_seconds),
            },
        )
        .await;
    for task in background {
        task.abort();
    }
    served?;
    tracing::info!("stopped");
    Ok(())
}

/// `credpool migrate`.
pub async fn migrate(args: crate::config::DatabaseArgs) -> anyhow::Result<()> {
    let database = Database::open(&args).await?;
    println!("credpool: migrations applied");
    database.close().await;
    Ok(())
}

/// Reads every pool's figures from PostgreSQL once and sets the per-pool gauges
/// ([`telemetry::pool_sampled`]); `credpool_store_up` says whether it could. A failed sample
/// keeps the previous values.
pub async fn sample_pools(db: &store::Db) -> bool {
    match store::credentials::pools(db).await {
        Ok(pools) => {
            for p in &pools {
                telemetry::pool_sampled(telemetry::PoolFigures {
                    provider: &p.provider,
                    pool: &p.pool,
                    in_flight: p.in_flight,
                    total_slots: p.total_slots,
                    cooling_down: p.cooling_down,
                    draining: p.draining,
                    oauth_expires_in_seconds: p.oauth_expires_in_seconds,
                    by_status: &p.by_status,
                });
            }
            telemetry::store_up(true);
            true
        }
        Err(error) => {
            tracing::debug!(error = %error, "metrics sample failed");
            telemetry::store_up(false);
            false
        }
    }
}

/// Reads where the continuous proof of the audit trail stands and sets its gauges
/// ([`telemetry::audit_checkpoint`]: seconds behind the database clock, violations found); a
/// failed read keeps the previous values (and [`sample_pools`] reports the store down).
async fn sample_audit(db: &store::Db) {
    use store::audit::{self, Run};
    let read = async {
        let mut work = db.work().await?;
        let checkpoints = audit::checkpoints(&mut *work, &Run::Continuous).await?;
        let now = audit::database_now(&mut *work).await?;
        work.done().await?;
        Ok::<_, sqlx::Error>((checkpoints, now))
    };
    match read.await {
        Ok((checkpoints, now)) => {
            for c in checkpoints {
                let lag = (now - c.proven_until).as_seconds_f64();
                telemetry::audit_checkpoint(&c.proof, lag, c.violations);
            }
        }
        Err(error) => tracing::debug!(error = %error, "audit sample failed"),
    }
}

/// Samples the per-pool gauges and the continuous proof's from PostgreSQL every `interval` (not
/// per scrape), until the pool closes ([`sample_pools`], `sample_audit`). The service runs it
/// as the supervised background task `metrics_sampler`.
async fn sample_metrics(db: store::Db, interval: Duration) {
    store::every(&db, interval, || async {
        sample_pools(&db).await;
        sample_audit(&db).await;
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::shell_word;

    #[test]
    fn shell_word_quotes_only_what_a_shell_would_interpret() {
        assert_eq!(shell_word("0a1b2c"), "0a1b2c");
        assert_eq!(shell_word("/var/lib/credpool"), "/var/lib/credpool");
        assert_eq!(shell_word("my data"), "'my data'");
        assert_eq!(shell_word("it's $HOME"), r"'it'\''s $HOME'");
        assert_eq!(shell_word(""), "''");
    }
}
