//! Opening the database: `DATABASE_URL` when given, else the embedded default cluster.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgPool};

use crate::config::DatabaseArgs;
use crate::embedded::{self, EmbeddedCluster};
use crate::store;

/// An open connection pool, and the embedded cluster behind it if credpool started one.
#[derive(Debug)]
pub struct Database {
    /// The connection pool.
    pub pool: PgPool,
    /// The embedded cluster, when no `DATABASE_URL` was given.
    pub embedded: Option<EmbeddedCluster>,
    /// The embedded default's data directory, when in use.
    pub data_dir: Option<PathBuf>,
    /// How to connect (for tools that need their own connection, like pg_cron's database).
    pub options: PgConnectOptions,
}

impl Database {
    /// Connects (starting the embedded cluster when no URL is configured) and applies pending
    /// migrations.
    pub async fn open(args: &DatabaseArgs) -> anyhow::Result<Self> {
        let (options, embedded, data_dir) = match &args.database_url {
            Some(url) => {
                let options = PgConnectOptions::from_str(url)
                    .context("DATABASE_URL is not a valid PostgreSQL URL")?;
                (options, None, None)
            }
            None => {
                let data_dir = args
                    .data_dir
                    .clone()
                    .unwrap_or_else(embedded::default_data_dir);
                let cluster = EmbeddedCluster::start(&data_dir, args.pg_bin_dir.as_deref())
                    .await
                    .context("starting the embedded default database")?;
                (cluster.connect_options(), Some(cluster), Some(data_dir))
            }
        };
        // One direct connection first, which also applies the migrations (without the pool's
        // statement timeout: a migration may build an index on a large table). If the database
        // is unreachable it says why, where the pool would only report that it timed out.
        let settings = args.pool_settings();
        let migrated = match tokio::time::timeout(settings.acquire_timeout, options.connect()).await
        {
            Ok(Ok(mut conn)) => {
                let result = store::migrate(&mut conn).await;
                let _ = conn.close().await;
                result.context("applying database migrations")
            }
            Ok(Err(error)) => Err(error).context("connecting to PostgreSQL"),
            Err(_) => Err(anyhow::anyhow!(
                "connecting to PostgreSQL: no connection within {} ms (--db-acquire-timeout-ms)",
                settings.acquire_timeout.as_millis()
            )),
        };
        if let Err(error) = migrated {
            if let Some(cluster) = embedded {
                cluster.stop().await;
            }
            return Err(error);
        }
        let pool_options = if args.db_statement_timeout_ms > 0 {
            options.clone().options([(
                "statement_timeout",
                format!("{}ms", args.db_statement_timeout_ms),
            )])
        } else {
            options.clone()
        };
        let database = Database {
            pool: store::connect_lazy(pool_options, &settings),
            embedded,
            data_dir,
            options,
        };
        // The embedded default preloads pg_cron when the machine has it: let it run the cleanup.
        if database
            .embedded
            .as_ref()
            .is_some_and(EmbeddedCluster::has_pg_cron)
        {
            let retention = Duration::from_secs(30 * 86_400);
            match store::maintenance::install_cron(&database.pool, &database.options, retention)
                .await
            {
                Ok(_) => tracing::info!("cleanup scheduled in pg_cron"),
                Err(error) => {
                    tracing::warn!(error = %error, "could not schedule the cleanup in pg_cron; the service runs it")
                }
            }
        }
        Ok(database)
    }

    /// Closes the pool, then stops the embedded cluster if this process started it.
    pub async fn close(self) {
        self.pool.close().await;
        if let Some(cluster) = self.embedded {
            cluster.stop().await;
        }
    }
}
