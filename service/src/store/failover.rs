//! Staying on the writable server of a multi-host target ([`Target`], libpq's
//! `target_session_attrs=read-write`) through failovers, with sqlx's own pool hooks; and what
//! start-up says about the primary's replication.
//!
//! # How a pool finds the primary
//! sqlx 0.9's pool opens each connection with the connect options it holds at that moment:
//! [`sqlx::Pool::set_connect_options`] changes them for every later connection, and the pool's
//! connect loop (which retries until the acquire timeout) reads them again at each attempt. It
//! hands every new connection to `after_connect` and every idle one to `before_acquire` before
//! giving it out. So a pool on a checked target:
//! - **checks each connection** when it is opened and each time it is handed out, with one
//!   simple-protocol query (`pg_is_in_recovery()`, `transaction_read_only`). The check replaces
//!   sqlx's ping before acquire (`test_before_acquire(false)`), so it adds no round trip. A
//!   connection to a server in recovery or read-only is closed, and so is one whose check fails:
//!   `after_connect` fails, and sqlx's connect loop tries again; `before_acquire` says no, and the
//!   pool takes another idle connection or opens one. A connection that answered 25006
//!   (`read_only_sql_transaction`) to a statement is read-only at its next check; one that
//!   answered 57P01 (`admin_shutdown`) has been closed by the server, and its check fails.
//! - **searches for the writable server** in a task of its own, woken by trouble: a connection
//!   found on the wrong server or lost, an acquire that failed ([`is_failover_sign`]). It tries
//!   the hosts in the URL's order, each with a probe connection, and points the pool at the first
//!   writable one; while none is, it tries again (pausing 50 ms, doubling to 500 ms) until the
//!   acquire timeout has passed since the last trouble. Requests waiting in sqlx's connect loop
//!   reach the new server at their next attempt; each waits no longer than the acquire timeout
//!   (then 503, and the search goes on).
//!
//! A pool on an unchecked target (one host, no `target_session_attrs`) is a plain sqlx pool, as
//! before: no check, no search.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool, Row};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::PoolSettings;
use super::target::{Target, host_port};

/// The first pause between two rounds of the search (and of [`connect_writable`]).
const FIRST_PAUSE: Duration = Duration::from_millis(50);
/// The longest pause between two rounds.
const LONGEST_PAUSE: Duration = Duration::from_millis(500);
/// The longest one probe connection may take (less when the acquire timeout is shorter): a host
/// that does not answer must not hold up the hosts after it for long.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// After a search, trouble reported meanwhile waits this long before the next one.
const SEARCH_GAP: Duration = Duration::from_millis(100);

/// What a connection's server is, to credpool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// Not in recovery, transactions read-write: credpool can write there.
    Writable,
    /// In recovery: a standby (or a demoted primary that came back as one).
    InRecovery,
    /// Not in recovery, but its transactions are read-only (`default_transaction_read_only`).
    ReadOnly,
}

impl Server {
    /// The verdict from the check query's two answers.
    pub fn judge(in_recovery: bool, transaction_read_only: &str) -> Self {
        match (in_recovery, transaction_read_only) {
            (true, _) => Server::InRecovery,
            (false, "off") => Server::Writable,
            (false, _) => Server::ReadOnly,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Server::Writable => "writable",
            Server::InRecovery => "in recovery (a standby)",
            Server::ReadOnly => "read-only",
        }
    }
}

/// Asks the server of `conn` what it is: one simple-protocol statement (no prepared statement,
/// safe through a transaction pooler).
pub async fn server_of(conn: &mut PgConnection) -> Result<Server, sqlx::Error> {
    let row = sqlx::raw_sql(
        "SELECT pg_catalog.pg_is_in_recovery() AS in_recovery, \
                pg_catalog.current_setting('transaction_read_only') AS read_only",
    )
    .fetch_one(conn)
    .await?;
    Ok(Server::judge(
        row.try_get("in_recovery")?,
        row.try_get::<&str, _>("read_only")?,
    ))
}

/// Whether an error may mean that the server is gone, is going away, or is not (or no longer)
/// the writable one, so that the search should look for the primary: a failed or timed-out
/// connection, a broken one, and the SQLSTATEs a failover brings — class 08 (connection
/// exception), 25006 `read_only_sql_transaction`, 57P01 `admin_shutdown`, 57P02
/// `crash_shutdown`, 57P03 `cannot_connect_now`. Not: a closed pool, a configuration error, and
/// every other SQL error (a constraint, a statement timeout: the server answered).
pub fn is_failover_sign(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(error) => error.code().is_some_and(|code| {
            code.starts_with("08") || matches!(&*code, "25006" | "57P01" | "57P02" | "57P03")
        }),
        _ => false,
    }
}

/// Why [`connect_writable`] found no server.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The one unchecked server refused or failed the connection.
    #[error(transparent)]
    Failed(sqlx::Error),
    /// The one unchecked server did not answer in time.
    #[error("no connection within {} ms (--db-acquire-timeout-ms)", .within.as_millis())]
    TimedOut {
        /// The time allowed.
        within: Duration,
    },
    /// No server of a checked target was writable in time; `tried` says what each one was last.
    #[error("no writable server within {} ms (--db-acquire-timeout-ms): {tried}", .within.as_millis())]
    NoWritable {
        /// The time allowed.
        within: Duration,
        /// `host:port` and its last answer, for each host.
        tried: String,
    },
}

/// One direct connection to the server credpool may use, within `within`, and that server's
/// index in `target.hosts()`. Unchecked (one host): one attempt, as a plain connect. Checked: the
/// hosts in order, again and again (pausing between rounds) until one is writable or the time
/// is up.
pub async fn connect_writable(
    target: &Target,
    within: Duration,
) -> Result<(PgConnection, usize), ConnectError> {
    if !target.checks() {
        return match tokio::time::timeout(within, target.hosts()[0].connect()).await {
            Ok(Ok(conn)) => Ok((conn, 0)),
            Ok(Err(error)) => Err(ConnectError::Failed(error)),
            Err(_) => Err(ConnectError::TimedOut { within }),
        };
    }
    let deadline = Instant::now() + within;
    let mut last: Vec<String> = vec!["not tried".into(); target.hosts().len()];
    let mut pause = FIRST_PAUSE;
    loop {
        for (index, host) in target.hosts().iter().enumerate() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match probe(host, left.min(PROBE_TIMEOUT), true).await {
                Ok((Server::Writable, Some(conn))) => return Ok((conn, index)),
                Ok((server, _)) => last[index] = server.describe().to_owned(),
                Err(error) => last[index] = error.to_string(),
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let tried = target
                .hosts()
                .iter()
                .zip(&last)
                .map(|(host, last)| format!("{} ({last})", host_port(host)))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(ConnectError::NoWritable { within, tried });
        }
        tokio::time::sleep(pause.min(left)).await;
        pause = (pause * 2).min(LONGEST_PAUSE);
    }
}

/// Connects to `host` within `within` and asks what it is; keeps the connection when asked to
/// and the server is writable, else closes it.
async fn probe(
    host: &PgConnectOptions,
    within: Duration,
    keep: bool,
) -> Result<(Server, Option<PgConnection>), sqlx::Error> {
    let mut conn = tokio::time::timeout(within, host.connect())
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)??;
    let server = server_of(&mut conn).await;
    match server {
        Ok(Server::Writable) if keep => Ok((Server::Writable, Some(conn))),
        Ok(server) => {
            let _ = conn.close().await;
            Ok((server, None))
        }
        Err(error) => {
            let _ = conn.close_hard().await;
            Err(error)
        }
    }
}

/// A pool's search for the writable server (see the module docs). Stops when dropped (with the
/// last [`crate::store::Db`] that holds it) or when the pool closes.
pub struct PrimarySearch {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for PrimarySearch {
    // no connect options: they hold the password
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrimarySearch")
            .field("hosts", &self.shared.target.describe())
            .field("current", &self.shared.current.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Drop for PrimarySearch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PrimarySearch {
    /// Something went wrong that may mean a failover ([`is_failover_sign`]): search, unless a
    /// search is under way (then it keeps going for another acquire timeout).
    pub fn trouble(&self) {
        self.shared.trouble();
    }

    /// The target and the index of the server the pool points at now.
    pub(crate) fn position(&self) -> (&Target, usize) {
        (
            &self.shared.target,
            self.shared.current.load(Ordering::SeqCst),
        )
    }
}

/// What the pool's hooks and the search task share.
struct Shared {
    target: Target,
    /// The index (in `target.hosts()`) of the server the pool's options point at.
    current: AtomicUsize,
    /// How long the search keeps trying after the last trouble: the pool's acquire timeout.
    patience: Duration,
    wake: Notify,
    /// The search gives up (until the next trouble) when this passes.
    trouble_until: Mutex<Instant>,
}

impl Shared {
    fn trouble(&self) {
        *self.trouble_until.lock().unwrap_or_else(|p| p.into_inner()) =
            Instant::now() + self.patience;
        self.wake.notify_one();
    }

    fn trouble_until(&self) -> Instant {
        *self.trouble_until.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `after_connect`: a new connection is kept only on a writable server.
    async fn admit(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        match server_of(conn).await {
            Ok(Server::Writable) => Ok(()),
            Ok(server) => {
                self.trouble();
                Err(sqlx::Error::Io(std::io::Error::other(format!(
                    "the server is {}; looking for the writable one",
                    server.describe()
                ))))
            }
            Err(error) => {
                self.trouble();
                Err(error)
            }
        }
    }

    /// `before_acquire`: an idle connection is handed out only while its server is writable.
    async fn keep(&self, conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
        match server_of(conn).await {
            Ok(Server::Writable) => Ok(true),
            Ok(server) => {
                tracing::info!(
                    server = server.describe(),
                    "database: dropping a connection whose server is no longer writable"
                );
                self.trouble();
                Ok(false)
            }
            Err(error) => {
                if is_failover_sign(&error) {
                    self.trouble();
                }
                Err(error)
            }
        }
    }

    /// The first host, in order, that is writable now.
    async fn find(&self) -> Option<usize> {
        let within = PROBE_TIMEOUT.min(self.patience);
        for (index, host) in self.target.hosts().iter().enumerate() {
            match probe(host, within, false).await {
                Ok((Server::Writable, _)) => return Some(index),
                Ok((server, _)) => {
                    tracing::debug!(host = %host_port(host), server = server.describe(), "database: not writable")
                }
                Err(error) => {
                    tracing::debug!(host = %host_port(host), error = %error, "database: no answer")
                }
            }
        }
        None
    }
}

/// The search task: waits for trouble, then finds the writable server and points the pool at
/// it.
async fn search(shared: Arc<Shared>, pool: PgPool) {
    loop {
        tokio::select! {
            () = shared.wake.notified() => {}
            () = pool.close_event() => return,
        }
        let mut pause = FIRST_PAUSE;
        loop {
            if let Some(found) = shared.find().await {
                let before = shared.current.swap(found, Ordering::SeqCst);
                if before != found {
                    let host = &shared.target.hosts()[found];
                    pool.set_connect_options(host.clone());
                    tracing::warn!(
                        from = %host_port(&shared.target.hosts()[before]),
                        to = %host_port(host),
                        "database: the writable server moved; new connections go to it"
                    );
                }
                break;
            }
            if Instant::now() >= shared.trouble_until() {
                tracing::warn!(
                    hosts = %shared.target.describe(),
                    "database: no writable server among the hosts; looking again at the next failed connection"
                );
                break;
            }
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = pool.close_event() => return,
            }
            pause = (pause * 2).min(LONGEST_PAUSE);
        }
        tokio::time::sleep(SEARCH_GAP).await;
    }
}

/// A lazy pool on `target`, its options pointing at `target.hosts()[at]`; on a checked target
/// also the search that keeps it on the writable server (must be called inside a Tokio runtime:
/// it spawns the search task). Unchecked: exactly [`crate::store::connect_lazy`].
pub(crate) fn pool(
    target: &Target,
    at: usize,
    settings: &PoolSettings,
) -> (PgPool, Option<PrimarySearch>) {
    let options = target.hosts()[at].clone();
    if !target.checks() {
        return (super::connect_lazy(options, settings), None);
    }
    let shared = Arc::new(Shared {
        target: target.clone(),
        current: AtomicUsize::new(at),
        patience: settings.acquire_timeout,
        wake: Notify::new(),
        trouble_until: Mutex::new(Instant::now()),
    });
    let (on_connect, on_acquire) = (shared.clone(), shared.clone());
    let pool = PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        // the check in before_acquire is the liveness test
        .test_before_acquire(false)
        .after_connect(move |conn, _| {
            let shared = on_connect.clone();
            Box::pin(async move { shared.admit(conn).await })
        })
        .before_acquire(move |conn, _| {
            let shared = on_acquire.clone();
            Box::pin(async move { shared.keep(conn).await })
        })
        .connect_lazy_with(options);
    let task = tokio::spawn(search(shared.clone(), pool.clone()));
    (pool, Some(PrimarySearch { shared, task }))
}

/// What the primary's replication means for credpool's leases, if it deserves a warning: the
/// server has standbys (`pg_stat_replication`) but none is synchronous, or commits do not wait
/// for them (`synchronous_commit` `off` or `local`). Then a failover to a standby can lose
/// committed grants (their slots look free again) and move `lease_fence_seq` backwards. `None`
/// when there is no standby, or a synchronous one (or, when this role may not see
/// `pg_stat_replication`'s `sync_state`, when `synchronous_standby_names` names some).
pub fn replication_warning(
    standbys: i64,
    synchronous: i64,
    unseen: i64,
    synchronous_standby_names: &str,
    synchronous_commit: &str,
) -> Option<String> {
    if standbys == 0 {
        return None;
    }
    if matches!(synchronous_commit, "off" | "local") {
        return Some(format!(
            "synchronous_commit is {synchronous_commit}: commits do not wait for the {standbys} \
             standby(s), so a failover can lose committed grants (slots in use look free) and \
             move lease fences backwards; set synchronous_commit = on"
        ));
    }
    if synchronous_standby_names.trim().is_empty() {
        return Some(format!(
            "the primary has {standbys} standby(s) but synchronous_standby_names is empty \
             (asynchronous replication): a failover can lose committed grants (slots in use \
             look free) and move lease fences backwards; make a standby synchronous (Patroni \
             synchronous_mode, pg_auto_failover number_sync_standbys / replication-quorum)"
        ));
    }
    if synchronous == 0 && unseen == 0 {
        return Some(format!(
            "none of the primary's {standbys} standby(s) is synchronous now (pg_stat_replication \
             sync_state): a failover can lose committed grants and move lease fences backwards"
        ));
    }
    None
}

/// Reads what [`replication_warning`] needs from the server of `conn` (one simple-protocol
/// statement) and returns its verdict. Standbys are the walsenders of `pg_stat_replication`
/// but those of a base backup and those that feed a logical replication slot (a subscriber or a
/// change-data-capture tool is never promoted).
pub async fn check_replication(conn: &mut PgConnection) -> Result<Option<String>, sqlx::Error> {
    let row = sqlx::raw_sql(
        "SELECT count(*) AS standbys, \
                count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')) AS synchronous, \
                count(*) FILTER (WHERE sync_state IS NULL) AS unseen, \
                pg_catalog.current_setting('synchronous_standby_names') AS names, \
                pg_catalog.current_setting('synchronous_commit') AS commit \
         FROM pg_catalog.pg_stat_replication \
         WHERE state IS DISTINCT FROM 'backup' \
           AND pid NOT IN (SELECT active_pid FROM pg_catalog.pg_replication_slots \
                           WHERE slot_type = 'logical' AND active_pid IS NOT NULL)",
    )
    .fetch_one(conn)
    .await?;
    Ok(replication_warning(
        row.try_get("standbys")?,
        row.try_get("synchronous")?,
        row.try_get("unseen")?,
        row.try_get("names")?,
        row.try_get("commit")?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_server_out_of_recovery_with_read_write_transactions_is_writable() {
        assert_eq!(Server::judge(false, "off"), Server::Writable);
        assert_eq!(Server::judge(true, "on"), Server::InRecovery);
        assert_eq!(Server::judge(true, "off"), Server::InRecovery);
        assert_eq!(Server::judge(false, "on"), Server::ReadOnly);
    }

    #[derive(Debug)]
    struct Coded(&'static str);

    impl std::fmt::Display for Coded {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "SQLSTATE {}", self.0)
        }
    }

    impl std::error::Error for Coded {}

    impl sqlx::error::DatabaseError for Coded {
        fn message(&self) -> &str {
            "test"
        }
        fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
            Some(self.0.into())
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    fn sqlstate(code: &'static str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(Coded(code)))
    }

    #[test]
    fn failover_signs_are_lost_connections_and_the_sqlstates_of_a_moving_primary() {
        for code in ["25006", "57P01", "57P02", "57P03", "08006", "08001"] {
            assert!(is_failover_sign(&sqlstate(code)), "{code}");
        }
        assert!(is_failover_sign(&sqlx::Error::PoolTimedOut));
        assert!(is_failover_sign(&sqlx::Error::Io(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused
        ))));
        // the server answered: nothing to look for
        for code in ["23505", "57014", "40001", "42P01", "53300"] {
            assert!(!is_failover_sign(&sqlstate(code)), "{code}");
        }
        assert!(!is_failover_sign(&sqlx::Error::PoolClosed));
        assert!(!is_failover_sign(&sqlx::Error::RowNotFound));
    }

    #[test]
    fn standbys_without_a_synchronous_one_deserve_a_warning() {
        let names = "ANY 1 (pgautofailover_standby_2)";
        // no standby: a single server, nothing to say here
        assert_eq!(replication_warning(0, 0, 0, "", "on"), None);
        // a synchronous (or quorum) standby
        assert_eq!(replication_warning(1, 1, 0, names, "on"), None);
        assert_eq!(replication_warning(2, 1, 0, names, "remote_apply"), None);
        // asynchronous replication
        let warning = replication_warning(1, 0, 0, "", "on").unwrap();
        assert!(
            warning.contains("synchronous_standby_names is empty"),
            "{warning}"
        );
        // named, but none synchronous now
        let warning = replication_warning(1, 0, 0, names, "on").unwrap();
        assert!(warning.contains("none of"), "{warning}");
        // commits that do not wait
        for commit in ["off", "local"] {
            let warning = replication_warning(1, 1, 0, names, commit).unwrap();
            assert!(warning.contains(commit), "{warning}");
        }
        // a role that cannot see sync_state: the names decide
        assert_eq!(replication_warning(1, 0, 1, names, "on"), None);
        assert!(replication_warning(1, 0, 1, " ", "on").is_some());
    }
}
