//! Opening the database: `DATABASE_URL` when given, else the embedded default cluster.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};

use crate::config::{DatabaseArgs, DbPooler};
use crate::embedded::{self, EmbeddedCluster};
use crate::store::{self, Db};

/// An open connection pool, and the embedded cluster behind it if credpool started one.
#[derive(Debug)]
pub struct Database {
    /// The connection pool, and how statements travel over it (`--db-pooler`).
    pub pool: Db,
    /// The embedded cluster, when no `DATABASE_URL` was given.
    pub embedded: Option<EmbeddedCluster>,
    /// The embedded default's data directory, when in use.
    pub data_dir: Option<PathBuf>,
    /// How to connect (for tools that need their own connection, like pg_cron's database).
    pub options: PgConnectOptions,
}

impl Database {
    /// Connects (starting the embedded cluster when no URL is configured) and applies pending
    /// migrations, unless the database has them all already. Behind a transaction pooler
    /// (`--db-pooler transaction`) it applies none: a pending migration is an error that says to
    /// run `credpool migrate` against PostgreSQL directly (sqlx's migrator holds a session
    /// advisory lock, which a transaction pooler does not keep).
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
                let result = migrate_if_needed(&mut conn, args.db_pooler).await;
                let _ = conn.close().await;
                result
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
        let statement_timeout = (args.db_statement_timeout_ms > 0)
            .then(|| Duration::from_millis(args.db_statement_timeout_ms));
        let pool = match args.db_pooler {
            DbPooler::None => {
                let pool_options = match statement_timeout {
                    Some(timeout) => options
                        .clone()
                        .options([("statement_timeout", format!("{}ms", timeout.as_millis()))]),
                    None => options.clone(),
                };
                Db::direct(store::connect_lazy(pool_options, &settings))
            }
            // a server connection is lent per transaction: no prepared statement may outlive
            // one, and the timeout is set by each transaction (PgBouncer rejects `options`)
            DbPooler::Transaction => Db::transaction_pooled(
                store::connect_lazy(options.clone().statement_cache_capacity(0), &settings),
                statement_timeout,
            ),
        };
        let database = Database {
            pool,
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
        self.pool.pool().close().await;
        if let Some(cluster) = self.embedded {
            cluster.stop().await;
        }
    }
}

/// Applies the pending migrations on `conn`, or nothing when the database has them all. Behind a
/// transaction pooler a pending migration is an error instead.
async fn migrate_if_needed(conn: &mut sqlx::PgConnection, pooler: DbPooler) -> anyhow::Result<()> {
    if store::migrations_up_to_date(conn)
        .await
        .context("reading the applied database migrations")?
    {
        return Ok(());
    }
    match pooler {
        DbPooler::None => store::migrate(conn)
            .await
            .context("applying database migrations"),
        DbPooler::Transaction => anyhow::bail!(
            "the database lacks migrations of this credpool version (or one failed), and they \
             cannot be applied through a transaction pooler (--db-pooler transaction): run \
             `credpool migrate` with a DATABASE_URL that reaches PostgreSQL directly, then start again"
        ),
    }
}
