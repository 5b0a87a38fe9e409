//! Building and running the service: `credpool serve` and the in-process server of the demo and
//! the tests share [`Application`].

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::net::TcpListener;

use crate::allocation::Allocator;
use crate::candidates::CandidateViews;
use crate::config::{ServeArgs, ServiceSettings};
use crate::database::Database;
use crate::embedded;
use crate::http::{self, ApiKeys, AppState};

/// A pool nobody allocated from for this long drops out of the periodic view refresh.
const VIEW_FORGET_AFTER: std::time::Duration = std::time::Duration::from_secs(600);

/// A bound, not yet serving, instance of the HTTP API.
#[derive(Debug)]
pub struct Application {
    listener: TcpListener,
    state: AppState,
}

impl Application {
    /// Binds `listen` (port 0 picks a free port) and prepares the router over `db`. Must run in
    /// a Tokio runtime: it starts the candidate views' periodic refresh, which stops when the
    /// application is dropped.
    pub async fn bind(
        listen: &str,
        db: PgPool,
        keys: ApiKeys,
        settings: &ServiceSettings,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let views = CandidateViews::new(
            db.clone(),
            settings.scoring.clone(),
            settings.health.clone(),
        );
        views.spawn_refresher(settings.view_refresh, VIEW_FORGET_AFTER);
        let state = AppState {
            allocator: Allocator::new(db.clone(), views, settings.claims),
            db,
            keys,
            max_lease_seconds: settings.max_lease_seconds,
            health: settings.health.clone(),
        };
        Ok(Self { listener, state })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` resolves, then stops accepting and lets in-flight requests finish.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        axum::serve(self.listener, http::app(self.state))
            .with_graceful_shutdown(shutdown)
            .await
    }
}

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
                "CREDPOOL_INTERNAL_KEY"
            } else {
                "CREDPOOL_ADMIN_KEY"
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
    if path.exists() {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let keys = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid", path.display()))?;
        let from_file = match (&args.internal_key, &args.admin_key) {
            (None, None) => "API keys",
            (None, Some(_)) => "the internal key (the admin key is configured)",
            (Some(_), _) => "the admin key (the internal key is configured)",
        };
        println!("credpool: {from_file} from {}", path.display());
        return Ok(keys);
    }
    let keys = StoredKeys {
        internal_key: random_key(),
        admin_key: random_key(),
    };
    let tmp = dir.join(format!("{KEYS_FILE}.tmp"));
    std::fs::write(&tmp, serde_json::to_vec_pretty(&keys)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    embedded::restrict_to_owner(&tmp)?;
    std::fs::rename(&tmp, &path)?;
    println!(
        "credpool: generated API keys, stored in {} (mode 0600):\n  CREDPOOL_INTERNAL_KEY={}\n  CREDPOOL_ADMIN_KEY={}",
        path.display(),
        keys.internal_key,
        keys.admin_key
    );
    Ok(keys)
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = interrupt => {},
        _ = terminate => {},
    }
    tracing::info!("shutdown signal received; finishing in-flight requests");
}

/// `credpool serve`: opens the database (embedded or `DATABASE_URL`), applies migrations, serves
/// until SIGINT/SIGTERM, then closes the pool and stops the embedded cluster.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let keys = configured_keys(&args)?;
    let database = Database::open(&args.db).await?;
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
    let app = Application::bind(
        &args.listen,
        database.pool.clone(),
        keys,
        &args.service.settings(),
    )
    .await
    .with_context(|| format!("cannot listen on --listen {}", args.listen))?;
    let addr = app.local_addr()?;
    // stdout, so that scripts and tests can read the bound port
    println!("credpool listening on http://{addr}");
    tracing::info!(%addr, "listening");
    app.run_until(shutdown_signal()).await?;
    Ok(())
}

/// `credpool migrate`.
pub async fn migrate(args: crate::config::DatabaseArgs) -> anyhow::Result<()> {
    let database = Database::open(&args).await?;
    println!("credpool: migrations applied");
    database.close().await;
    Ok(())
}
