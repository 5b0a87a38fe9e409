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
use crate::config::{ServeArgs, ServiceArgs};
use crate::database::Database;
use crate::embedded;
use crate::http::{self, ApiKeys, AppState};

/// A bound, not yet serving, instance of the HTTP API.
#[derive(Debug)]
pub struct Application {
    listener: TcpListener,
    state: AppState,
}

impl Application {
    /// Binds `listen` (port 0 picks a free port) and prepares the router over `db`.
    pub async fn bind(
        listen: SocketAddr,
        db: PgPool,
        keys: ApiKeys,
        service: &ServiceArgs,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let state = AppState {
            allocator: Allocator::new(db.clone(), service.ranking_jitter_seconds),
            db,
            keys,
            max_lease_seconds: service.max_lease_seconds,
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
fn resolve_keys(args: &ServeArgs, data_dir: Option<&Path>) -> anyhow::Result<ApiKeys> {
    let (internal, admin) = match (args.internal_key.clone(), args.admin_key.clone(), data_dir) {
        (Some(internal), Some(admin), _) => (internal, admin),
        (internal, admin, Some(dir)) => {
            let stored = load_or_generate_keys(dir)?;
            (
                internal.unwrap_or(stored.internal_key),
                admin.unwrap_or(stored.admin_key),
            )
        }
        (internal, _, None) => bail!(
            "{} must be set when DATABASE_URL is (keys are generated only for the embedded default)",
            if internal.is_none() {
                "CREDPOOL_INTERNAL_KEY"
            } else {
                "CREDPOOL_ADMIN_KEY"
            }
        ),
    };
    ApiKeys::new(internal, admin).map_err(anyhow::Error::msg)
}

fn load_or_generate_keys(dir: &Path) -> anyhow::Result<StoredKeys> {
    let path = dir.join(KEYS_FILE);
    if path.exists() {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let keys = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid", path.display()))?;
        println!("credpool: API keys from {}", path.display());
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
    let database = Database::open(&args.db).await?;
    let result = serve_on(&args, &database).await;
    database.close().await;
    result
}

async fn serve_on(args: &ServeArgs, database: &Database) -> anyhow::Result<()> {
    let keys = resolve_keys(args, database.data_dir.as_deref())?;
    let app = Application::bind(args.listen, database.pool.clone(), keys, &args.service)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
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
