//! Opening the database: `DATABASE_URL` (one host, or several of which credpool uses the
//! writable one) when given, else the embedded default cluster.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use sqlx::Connection;
use sqlx::postgres::PgConnectOptions;

use crate::config::{DatabaseArgs, DbPooler};
use crate::embedded::{self, EmbeddedCluster};
use crate::store::failover::{self, ConnectError};
use crate::store::target::{self, Target};
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
    /// How to connect (for tools that need their own connection, like pg_cron's database): the
    /// server found writable at start-up.
    pub options: PgConnectOptions,
}

impl Database {
    /// Connects (starting the embedded cluster when no URL is configured) and applies pending
    /// migrations, unless the database has them all already. Behind a transaction pooler
    /// (`--db-pooler transaction`) it applies none: a pending migration is an error that says to
    /// run `credpool migrate` against PostgreSQL directly (sqlx's migrator holds a session
    /// advisory lock, which a transaction pooler does not keep).
    ///
    /// A `DATABASE_URL` with several hosts (libpq's `host1:port1,host2:port2`, and
    /// `target_session_attrs`: [`Target`]) connects to the first writable one, trying them in
    /// order until `--db-acquire-timeout-ms` has passed, and the pool follows the writable server
    /// from then on (`crate::store::failover`).
    pub async fn open(args: &DatabaseArgs) -> anyhow::Result<Self> {
        let (target, embedded, data_dir) = match &args.database_url {
            Some(url) => (Target::parse(url)?, None, None),
            None => {
                let data_dir = args
                    .data_dir
                    .clone()
                    .unwrap_or_else(embedded::default_data_dir);
                let cluster = EmbeddedCluster::start(&data_dir, args.pg_bin_dir.as_deref())
                    .await
                    .context("starting the embedded default database")?;
                (
                    Target::single(cluster.connect_options()),
                    Some(cluster),
                    Some(data_dir),
                )
            }
        };
        // One direct connection first, which also applies the migrations (without the pool's
        // statement timeout: a migration may build an index on a large table). If the database
        // is unreachable it says why, where the pool would only report that it timed out.
        let settings = args.pool_settings();
        let migrated = match failover::connect_writable(&target, settings.acquire_timeout).await {
            Ok((mut conn, at)) => {
                let result = migrate_if_needed(&mut conn, args.db_pooler).await;
                let _ = conn.close().await;
                result.map(|()| at)
            }
            Err(ConnectError::Failed(error)) => Err(connect_error(error, &target.hosts()[0])),
            Err(error) => Err(anyhow::anyhow!("connecting to PostgreSQL: {error}")),
        };
        let at = match migrated {
            Ok(at) => at,
            Err(error) => {
                if let Some(cluster) = embedded {
                    cluster.stop().await;
                }
                return Err(error);
            }
        };
        if target.hosts().len() > 1 {
            tracing::debug!(
                hosts = %target.describe(),
                writable = %target::host_port(&target.hosts()[at]),
                "database: several hosts; following the writable one"
            );
        }
        let statement_timeout = (args.db_statement_timeout_ms > 0)
            .then(|| Duration::from_millis(args.db_statement_timeout_ms));
        let options = target.hosts()[at].clone();
        let pool = match args.db_pooler {
            DbPooler::None => {
                let pool_target = match statement_timeout {
                    Some(timeout) => target.map(|options| {
                        options
                            .options([("statement_timeout", format!("{}ms", timeout.as_millis()))])
                    }),
                    None => target,
                };
                Db::connect_lazy(&pool_target, at, &settings)
            }
            // a server connection is lent per transaction: no prepared statement may outlive
            // one, and the timeout is set by each transaction (PgBouncer rejects `options`)
            DbPooler::Transaction => Db::connect_lazy(
                &target.map(|options| options.statement_cache_capacity(0)),
                at,
                &settings,
            )
            .through_transaction_pooler(statement_timeout),
        };
        Ok(Database {
            pool,
            embedded,
            data_dir,
            options,
        })
    }

    /// On the embedded default, when the machine has pg_cron (which the cluster then preloads),
    /// schedules the cleanup there, keeping `retention` of audit history; elsewhere does nothing
    /// (`credpool cron install` schedules it on a server of your own). `credpool serve` calls it
    /// at start-up; the other commands do not, so a read-only command changes nothing. A failure
    /// is logged: the service then runs the cleanup itself.
    pub async fn schedule_cleanup_in_pg_cron(&self, retention: Duration) {
        if !self
            .embedded
            .as_ref()
            .is_some_and(EmbeddedCluster::has_pg_cron)
        {
            return;
        }
        match store::maintenance::install_cron(&self.pool, &self.options, retention).await {
            Ok(_) => tracing::info!("cleanup scheduled in pg_cron"),
            Err(error) => {
                tracing::warn!(error = %error, "could not schedule the cleanup in pg_cron; the service runs it")
            }
        }
    }

    /// Logs a warning when the server has standbys but none synchronous, or commits that do not
    /// wait for them ([`failover::replication_warning`]): a failover could then lose committed
    /// grants and move lease fences backwards. `credpool serve` calls it at start-up; a failure
    /// to ask is logged and otherwise ignored.
    pub async fn check_replication(&self) {
        let checked = async {
            let mut conn = self.pool.acquire().await?;
            let mut work = conn.work().await?;
            let warning = failover::check_replication(&mut work).await?;
            work.done().await?;
            Ok::<_, sqlx::Error>(warning)
        };
        match checked.await {
            Ok(Some(warning)) => tracing::warn!("database replication: {warning}"),
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(error = %error, "database replication: could not read pg_stat_replication")
            }
        }
    }

    /// Closes the pool, then stops the embedded cluster if this process started it.
    pub async fn close(self) {
        self.pool.pool().close().await;
        if let Some(cluster) = self.embedded {
            cluster.stop().await;
        }
    }
}

/// Why the first connection failed. A database that does not exist is the operator's to create:
/// credpool creates one only inside its embedded default, so the message says how.
fn connect_error(error: sqlx::Error, options: &PgConnectOptions) -> anyhow::Error {
    let missing_database = error
        .as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|code| code == "3D000");
    let error = anyhow::Error::new(error).context("connecting to PostgreSQL");
    if !missing_database {
        return error;
    }
    // PostgreSQL's default database is the one named like the user
    let name = options.get_database().unwrap_or(options.get_username());
    anyhow::anyhow!(
        "{}; credpool does not create the database of DATABASE_URL: create it first \
         (`createdb {name}`, or `CREATE DATABASE {name}` in psql)",
        crate::error_report(&error)
    )
}

/// Applies the pending migrations on `conn` and then the repeatable SQL files that changed, or
/// nothing when the database has them all. Behind a transaction pooler a pending versioned
/// migration is an error instead (sqlx's migrator holds a session advisory lock); the repeatable
/// files need only a transaction-scoped one and are applied in either mode.
async fn migrate_if_needed(conn: &mut sqlx::PgConnection, pooler: DbPooler) -> anyhow::Result<()> {
    if !store::versioned_up_to_date(conn)
        .await
        .context("reading the applied database migrations")?
    {
        match pooler {
            DbPooler::None => {}
            DbPooler::Transaction => anyhow::bail!(
                "the database lacks migrations of this credpool version (or one failed), and they \
                 cannot be applied through a transaction pooler (--db-pooler transaction): run \
                 `credpool migrate` with a DATABASE_URL that reaches PostgreSQL directly, then start again"
            ),
        }
        store::migrate(&mut *conn)
            .await
            .context("applying database migrations")?;
    }
    store::apply_sql_files(conn)
        .await
        .context("applying the SQL functions (sql/)")?;
    Ok(())
}
