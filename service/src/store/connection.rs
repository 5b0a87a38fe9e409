//! How the storage layer reaches PostgreSQL: [`Db`], straight or through a pooler in transaction
//! pooling mode (PgBouncer `pool_mode = transaction`, `--db-pooler transaction`).
//!
//! # Why a pooler needs more than a pool
//! A transaction pooler lends a server connection to a client for one transaction and takes it
//! back at the first ReadyForQuery outside a transaction block. sqlx runs a statement with bind
//! parameters in two exchanges (Parse + Describe + Sync, then Bind + Execute + Sync), so outside a
//! transaction block the second half may reach another server connection than the first: the
//! statement fails, or runs a statement someone else prepared under the same name. Session state
//! (session advisory locks, `SET`, LISTEN, cached prepared statements) does not survive either.
//! So behind a pooler every statement runs inside an explicit transaction, opened with
//! `BEGIN; SET LOCAL statement_timeout = ...` in one round trip (the timeout cannot be a
//! startup parameter there), and committed before anything is reported to a client. The
//! connections cache no prepared statement (`statement_cache_capacity = 0`, set by
//! [`crate::database::Database::open`]); sqlx still gives each statement it prepares a name and
//! leaves it on the server connection, so the pooler must reset server connections between
//! clients (PgBouncer `server_reset_query = DISCARD ALL`, `server_reset_query_always = 1`).
//!
//! Direct connections keep their statements and round trips exactly: a [`Work`] over a direct
//! connection adds no statement, and [`Conn::begin`] is a plain `BEGIN`.
//!
//! A [`Db`] opened on a multi-host target ([`Db::connect_lazy`]) also carries the search that
//! keeps its pool on the writable server (`crate::store::failover`); an acquire that fails tells
//! it.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, Postgres, Transaction};

use super::PoolSettings;
use super::failover::{self, PrimarySearch};
use super::target::Target;

/// The service's database handle: a connection pool and how statements must travel over it.
/// Cheap to clone (the pool is shared). `From<PgPool>` makes a direct one.
#[derive(Debug, Clone)]
pub struct Db {
    pool: PgPool,
    /// Behind a transaction pooler: the statement that opens every transaction. `None`: direct.
    pooled_begin: Option<Arc<str>>,
    /// On a checked (multi-host) target: the search that keeps the pool on the writable server.
    primary: Option<Arc<PrimarySearch>>,
}

impl Db {
    /// Straight to PostgreSQL: each statement may run on its own (autocommit), session settings
    /// such as the statement timeout come with the connection.
    pub fn direct(pool: PgPool) -> Self {
        Self {
            pool,
            pooled_begin: None,
            primary: None,
        }
    }

    /// A direct, lazy pool on `target`, pointing at `target.hosts()[at]` (the server found by
    /// [`failover::connect_writable`], or 0). On a checked target (several hosts, or
    /// `target_session_attrs`) every connection is checked writable and a search task keeps the
    /// pool on the writable server (`crate::store::failover`); unchecked it is exactly
    /// [`crate::store::connect_lazy`]. Must be called inside a Tokio runtime.
    pub fn connect_lazy(target: &Target, at: usize, settings: &PoolSettings) -> Self {
        let (pool, primary) = failover::pool(target, at, settings);
        Self {
            pool,
            pooled_begin: None,
            primary: primary.map(Arc::new),
        }
    }

    /// A pool of its own of at most `max_connections`, on the same server(s) with the same
    /// options and acquire timeout, for a connection that must not take one of this pool's (the
    /// LISTEN connection of waiting allocations). On a checked target it starts at the server
    /// this pool uses now and follows the writable server by itself. Must be called inside a
    /// Tokio runtime.
    pub fn sibling(&self, max_connections: u32) -> Self {
        match &self.primary {
            None => Self::direct(
                PgPoolOptions::new()
                    .max_connections(max_connections)
                    .connect_lazy_with(self.pool.connect_options().as_ref().clone()),
            ),
            Some(primary) => {
                let (target, at) = primary.position();
                let settings = PoolSettings {
                    max_connections,
                    acquire_timeout: self.pool.options().get_acquire_timeout(),
                };
                Self::connect_lazy(target, at, &settings)
            }
        }
    }

    /// Through a pooler in transaction pooling mode: every statement runs inside an explicit
    /// transaction, which sets `statement_timeout` (milliseconds; `None` leaves the server's
    /// setting) for itself alone. The pool's connections must not cache prepared statements
    /// (`statement_cache_capacity(0)`), and the pooler must reset server connections between
    /// clients (PgBouncer `server_reset_query_always = 1`).
    pub fn transaction_pooled(pool: PgPool, statement_timeout: Option<Duration>) -> Self {
        Self::direct(pool).through_transaction_pooler(statement_timeout)
    }

    /// This pool, through a pooler in transaction pooling mode (see
    /// [`Db::transaction_pooled`]).
    pub fn through_transaction_pooler(self, statement_timeout: Option<Duration>) -> Self {
        let begin = match statement_timeout {
            Some(timeout) => format!(
                "BEGIN; SET LOCAL statement_timeout = {}",
                timeout.as_millis()
            ),
            None => "BEGIN".to_owned(),
        };
        Self {
            pooled_begin: Some(begin.into()),
            ..self
        }
    }

    /// Whether statements travel through a transaction pooler.
    pub fn is_pooled(&self) -> bool {
        self.pooled_begin.is_some()
    }

    /// The connection pool (for its statistics, and to close it).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Takes a connection from the pool, recording the wait (`credpool_db_acquire_seconds`) and
    /// giving up after the pool's acquire timeout (`credpool_db_acquire_timeouts_total`, then
    /// 503). For a caller that runs several units of work on one connection; one unit is
    /// [`Db::work`].
    pub async fn acquire(&self) -> Result<Conn<'static>, sqlx::Error> {
        let conn = self.acquired(self.pool.acquire()).await?;
        Ok(Conn {
            conn: Held::Pooled(conn),
            pooled_begin: self.pooled_begin.clone(),
        })
    }

    /// One unit of work on a connection of the pool: direct, the bare connection (each statement
    /// commits on its own); through a pooler, a transaction (the recorded wait then includes the
    /// round trip that opens it). [`Work::done`] ends it, and must be awaited before a write it
    /// did is reported to anyone.
    pub async fn work(&self) -> Result<Work<'static>, sqlx::Error> {
        Ok(Work(match &self.pooled_begin {
            None => WorkInner::Direct(Held::Pooled(self.acquired(self.pool.acquire()).await?)),
            Some(begin) => WorkInner::Pooled(
                self.acquired(self.pool.begin_with(AssertSqlSafe(begin.clone())))
                    .await?,
            ),
        }))
    }

    /// A transaction on a connection of the pool: `BEGIN`, or behind a pooler `BEGIN` with the
    /// statement timeout.
    pub async fn begin(&self) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        let begun = match &self.pooled_begin {
            None => self.pool.begin().await,
            Some(begin) => self.pool.begin_with(AssertSqlSafe(begin.clone())).await,
        };
        if let Err(error) = &begun {
            self.failed(error);
        }
        begun
    }

    /// Awaits a connection (or a transaction on one), recording the wait
    /// (`credpool_db_acquire_seconds`) and whether it timed out
    /// (`credpool_db_acquire_timeouts_total`). On a checked target a failure that may mean a
    /// failover ([`failover::is_failover_sign`]) sets the search for the writable server going.
    async fn acquired<T>(
        &self,
        acquiring: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, sqlx::Error> {
        let started = std::time::Instant::now();
        let result = acquiring.await;
        crate::telemetry::acquired(
            started.elapsed(),
            matches!(result, Err(sqlx::Error::PoolTimedOut)),
        );
        if let Err(error) = &result {
            self.failed(error);
        }
        result
    }

    /// A connection could not be had: on a checked target, if the error may mean a failover,
    /// the search for the writable server starts (or keeps going).
    fn failed(&self, error: &sqlx::Error) {
        if let Some(primary) = &self.primary
            && failover::is_failover_sign(error)
        {
            primary.trouble();
        }
    }
}

impl From<PgPool> for Db {
    /// A direct [`Db`].
    fn from(pool: PgPool) -> Self {
        Self::direct(pool)
    }
}

impl From<&PgPool> for Db {
    /// A direct [`Db`] over the same pool.
    fn from(pool: &PgPool) -> Self {
        Self::direct(pool.clone())
    }
}

impl From<&Db> for Db {
    /// The same database handle.
    fn from(db: &Db) -> Self {
        db.clone()
    }
}

/// A connection that knows how statements must travel over it: take a [`Work`] or a
/// transaction from it for each unit of work. It has no `Deref` to the bare connection on
/// purpose: behind a pooler a statement outside a transaction is not safe.
#[derive(Debug)]
pub struct Conn<'c> {
    conn: Held<'c>,
    pooled_begin: Option<Arc<str>>,
}

#[derive(Debug)]
enum Held<'c> {
    Pooled(PoolConnection<Postgres>),
    Borrowed(&'c mut PgConnection),
}

impl Held<'_> {
    fn raw(&mut self) -> &mut PgConnection {
        match self {
            Held::Pooled(conn) => conn,
            Held::Borrowed(conn) => conn,
        }
    }
}

impl<'c> Conn<'c> {
    /// A direct connection the caller opened itself (the raw-SQL baseline of `credpool bench`).
    pub fn direct(conn: &'c mut PgConnection) -> Self {
        Self {
            conn: Held::Borrowed(conn),
            pooled_begin: None,
        }
    }

    /// One unit of work on this connection (see [`Db::work`]): direct, the connection itself, no
    /// statement sent; through a pooler, a transaction (one round trip to open it).
    pub async fn work(&mut self) -> Result<Work<'_>, sqlx::Error> {
        let begin = self.pooled_begin.clone();
        let conn = self.conn.raw();
        Ok(Work(match begin {
            None => WorkInner::Direct(Held::Borrowed(conn)),
            Some(begin) => WorkInner::Pooled(conn.begin_with(AssertSqlSafe(begin)).await?),
        }))
    }

    /// A transaction on this connection: `BEGIN`, or behind a pooler `BEGIN` with the statement
    /// timeout.
    pub async fn begin(&mut self) -> Result<Transaction<'_, Postgres>, sqlx::Error> {
        let begin = self.pooled_begin.clone();
        let conn = self.conn.raw();
        match begin {
            None => conn.begin().await,
            Some(begin) => conn.begin_with(AssertSqlSafe(begin)).await,
        }
    }
}

/// One unit of work: dereferences to the connection to run its statements on. Direct, that is
/// the bare connection and each statement commits on its own; behind a pooler, it is a
/// transaction that [`Work::done`] commits (dropped without it, the transaction rolls back).
#[derive(Debug)]
pub struct Work<'c>(WorkInner<'c>);

#[derive(Debug)]
enum WorkInner<'c> {
    Direct(Held<'c>),
    Pooled(Transaction<'c, Postgres>),
}

impl Work<'_> {
    /// Ends the unit of work: behind a pooler commits its transaction; direct, where every
    /// statement has committed already, sends nothing.
    pub async fn done(self) -> Result<(), sqlx::Error> {
        match self.0 {
            WorkInner::Direct(_) => Ok(()),
            WorkInner::Pooled(tx) => tx.commit().await,
        }
    }
}

impl Deref for Work<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match &self.0 {
            WorkInner::Direct(Held::Pooled(conn)) => conn,
            WorkInner::Direct(Held::Borrowed(conn)) => conn,
            WorkInner::Pooled(tx) => tx,
        }
    }
}

impl DerefMut for Work<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match &mut self.0 {
            WorkInner::Direct(held) => held.raw(),
            WorkInner::Pooled(tx) => tx,
        }
    }
}
