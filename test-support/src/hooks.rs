//! Windows held open on purpose: test hooks inside the SQL functions (`credpool_test_hook`, which
//! waits for an advisory lock the test holds), connections of the test's own, and waits until a
//! backend waits for a lock.

use std::time::Duration;

use serde_json::Value;
use sqlx::{Connection, PgConnection, PgPool};

use crate::app::{AppOptions, TestApp};
use crate::database::TestDatabase;

/// A connection of the test's own to the app's database.
pub async fn connect(app: &TestApp) -> PgConnection {
    PgConnection::connect_with(&app.database.options)
        .await
        .expect("test connection")
}

/// A connection of the test's own ([`connect`]) in a transaction that has run each of
/// `statements` (locking selects, a refit, a row written) and holds what they locked until the
/// test commits or rolls back on it: another transaction in progress, stepped by hand. Panics,
/// naming the statement, if one fails.
pub async fn transaction_holding(app: &TestApp, statements: &[&'static str]) -> PgConnection {
    use sqlx::Executor;
    let mut conn = connect(app).await;
    conn.execute("BEGIN").await.unwrap();
    for statement in statements {
        conn.execute(*statement)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    conn
}

/// [`transaction_holding`] with `$1` bound to `arg` in each of `statements`.
pub async fn transaction_holding_with<'a, A>(
    app: &TestApp,
    statements: &[&'static str],
    arg: A,
) -> PgConnection
where
    A: 'a + Copy + Send + sqlx::Encode<'a, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    use sqlx::Executor;
    let mut conn = connect(app).await;
    conn.execute("BEGIN").await.unwrap();
    for statement in statements {
        sqlx::query(*statement)
            .bind(arg)
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    conn
}

/// The backend process id of `conn` (`pg_backend_pid()`), for [`until_waiting`].
pub async fn backend_pid(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// Waits until backend `pid` waits for a lock (a row lock, or a test hook's advisory lock);
/// panics after 60 seconds.
pub async fn until_waiting(app: &TestApp, pid: i32) {
    // a deadline, not a count of looks: on a loaded machine a look takes far longer than its sleep
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while tokio::time::Instant::now() < deadline {
        let waiting: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_optional(&app.db)
                .await
                .unwrap()
                .flatten();
        if waiting.as_deref() == Some("Lock") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("backend {pid} never waited for a lock");
}

/// Waits until exactly `n` backends of the app's database wait for a lock (a row lock, or a test
/// hook's advisory lock); panics after 60 seconds. Read from `pg_locks`, where a lock given up at
/// its holder's commit shows as granted to its waiter at once: `pg_stat_activity` keeps saying
/// the waiter waits until it runs again, so a caller whose waiter moves from one lock to the
/// next, or whose count goes down, would be answered by the lock already given.
pub async fn wait_for_lock_waiters(app: &TestApp, n: i64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut waiting = 0;
    while tokio::time::Instant::now() < deadline {
        waiting = sqlx::query_scalar(
            "SELECT count(DISTINCT l.pid) FROM pg_locks l
             JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE a.datname = current_database() AND NOT l.granted",
        )
        .fetch_one(&app.db)
        .await
        .unwrap();
        if waiting == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("never {n} backends waiting for a lock (the last look saw {waiting})");
}

impl TestApp {
    /// The app on a fresh database every connection of which (the app's and the test's) stops
    /// at the test hooks `points` (comma-separated) while they are closed ([`Hook`]): for a
    /// window inside a transaction the service itself runs.
    pub async fn spawn_with_hooks(points: &str) -> Self {
        Self::spawn_with_hooks_and(points, AppOptions::default()).await
    }

    /// [`TestApp::spawn_with_hooks`] with `options`.
    pub async fn spawn_with_hooks_and(points: &str, options: AppOptions) -> Self {
        let database = TestDatabase::create().await;
        database
            .set(&format!("credpool.test_hooks = '{points}'"))
            .await;
        Self::spawn_on(database, options).await
    }
}

/// Deadlocks PostgreSQL has detected in the database of `db` so far.
pub async fn deadlocks(db: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(db)
        .await
        .unwrap()
}

/// Ends every lease held in `app` as if it had run out a second ago, and lets the reaper take
/// them out of their slots: their reports from now on are late.
pub async fn expire_and_reap(app: &TestApp) {
    sqlx::query(
        "UPDATE lease_slots SET granted_at = now() - interval '2 seconds',
                lease_until = now() - interval '1 second'
         WHERE lease_id IS NOT NULL",
    )
    .execute(&app.db)
    .await
    .unwrap();
    sqlx::query("SELECT credpool_reap_expired_leases()")
        .execute(&app.db)
        .await
        .unwrap();
}

/// Holds a test hook closed (see `credpool_test_hook`) until [`Hook::open`].
pub struct Hook {
    conn: PgConnection,
    point: &'static str,
}

impl Hook {
    /// Closes hook `point` (an advisory lock on a connection of the test's own): connections
    /// that stop there ([`hooked`], [`TestApp::spawn_with_hooks`]) wait until it opens.
    pub async fn close(app: &TestApp, point: &'static str) -> Self {
        let lock = "SELECT pg_advisory_lock(hashtextextended('credpool.test_hook:' || $1, 0))";
        let conn = connect_and_run(app, lock, point).await;
        Self { conn, point }
    }

    /// Opens the hook: whatever waits there goes on.
    pub async fn open(mut self) {
        run_with(
            &mut self.conn,
            "SELECT pg_advisory_unlock(hashtextextended('credpool.test_hook:' || $1, 0))",
            self.point,
        )
        .await;
    }
}

/// A connection of the test's own ([`connect`]) that has run `sql`, its `$1` bound to `value`.
async fn connect_and_run(app: &TestApp, sql: &'static str, value: &str) -> PgConnection {
    let mut conn = connect(app).await;
    run_with(&mut conn, sql, value).await;
    conn
}

/// Runs `sql`, its `$1` bound to `value`, on `conn`.
async fn run_with(conn: &mut PgConnection, sql: &'static str, value: &str) {
    sqlx::query(sql)
        .bind(value)
        .execute(conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// A connection whose SQL functions stop at `points` while their hooks are closed.
pub async fn hooked(app: &TestApp, points: &str) -> PgConnection {
    connect_and_run(
        app,
        "SELECT set_config('credpool.test_hooks', $1, false)",
        points,
    )
    .await
}

/// A transaction of the test's own on `conn` (from [`connect`] or [`hooked`]), run in a task:
/// `BEGIN`, then each of `statements` in order, then `COMMIT` when `commit`. Returns once the
/// transaction waits for a lock (a row lock, or a closed hook), with the task, which hands the
/// connection back when its statements are done.
pub async fn transaction_waiting(
    app: &TestApp,
    mut conn: PgConnection,
    statements: &'static [&'static str],
    commit: bool,
) -> tokio::task::JoinHandle<Result<PgConnection, sqlx::Error>> {
    use sqlx::Executor;
    let pid = backend_pid(&mut conn).await;
    let running = tokio::spawn(async move {
        conn.execute("BEGIN").await?;
        for statement in statements {
            conn.execute(*statement).await?;
        }
        if commit {
            conn.execute("COMMIT").await?;
        }
        Ok(conn)
    });
    until_waiting(app, pid).await;
    running
}

/// One release of a release group as `credpool_release` takes it: `lease` (as allocate
/// answered it) reporting `outcome`, with no fence and no usage.
pub fn group_release(lease: &Value, outcome: &str) -> Value {
    serde_json::json!({"lease_id": lease["lease_id"], "key_id": lease["key_id"],
                       "provider": lease["provider"], "pool": lease["pool"], "fence": null,
                       "outcome": outcome, "usage_tokens": null})
}

/// Release group `group` (an array of [`group_release`]s) run as the service runs it, with the
/// default [`policy`], on a new connection of the test's own in a transaction, in a task.
/// Returns once the group waits for a lock, with the task: each release's verdict, in order.
pub async fn release_group_waiting(
    app: &TestApp,
    group: Value,
) -> tokio::task::JoinHandle<Result<Vec<String>, sqlx::Error>> {
    use sqlx::Executor;
    let mut conn = connect(app).await;
    let pid = backend_pid(&mut conn).await;
    let releasing = tokio::spawn(async move {
        conn.execute("BEGIN").await?;
        let verdicts =
            sqlx::query_scalar("SELECT verdict FROM credpool_release($1, $2) ORDER BY release")
                .bind(group)
                .bind(policy())
                .fetch_all(&mut conn)
                .await?;
        conn.execute("COMMIT").await?;
        Ok(verdicts)
    });
    until_waiting(app, pid).await;
    releasing
}

/// The default health policy, as the service passes it to `credpool_release`.
pub fn policy() -> Value {
    credpool::store::leases::policy_json(&credpool::allocator::health::HealthPolicy::default())
}

/// A transaction of the test's own, on the app's pool, that has run `statements` (locking
/// selects, a delete, an advisory lock) and holds what they locked until the test commits or
/// rolls it back: another transaction in progress, as a test needs it.
pub async fn holding<'a>(
    app: &'a TestApp,
    statements: &[&'static str],
) -> sqlx::Transaction<'a, sqlx::Postgres> {
    let mut holder = app.db.begin().await.unwrap();
    for statement in statements {
        sqlx::query(*statement)
            .execute(&mut *holder)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    holder
}
