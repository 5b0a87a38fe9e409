//! The real app served in-process on port 0 against a fresh database ([`TestApp`]), and what a
//! test reads of it straight from the database.

use std::net::SocketAddr;
use std::time::Duration;

use credpool::config::ServiceSettings;
use credpool::http::ApiKeys;
use credpool::startup::Application;
use credpool::store;
use sqlx::PgPool;

use crate::database::TestDatabase;
use crate::metrics::sample;
use crate::service::{Service, client};
use crate::{ADMIN_KEY, INTERNAL_KEY, keyring};

/// How [`TestApp`] runs the app.
pub struct AppOptions {
    /// The app's own pool size (default 8).
    pub db_max_connections: u32,
    /// The service's settings (default: the service's defaults).
    pub settings: ServiceSettings,
}

impl Default for AppOptions {
    fn default() -> Self {
        Self {
            db_max_connections: 8,
            settings: ServiceSettings::default(),
        }
    }
}

impl AppOptions {
    /// Scoring without jitter: a deterministic order.
    pub fn deterministic() -> Self {
        let mut options = Self::default();
        options.settings.scoring.jitter = 0.0;
        options
    }

    /// The default options with an app pool of `max_connections` (a race's or a window test's
    /// racers each hold one).
    pub fn connections(max_connections: u32) -> Self {
        Self {
            db_max_connections: max_connections,
            ..Self::default()
        }
    }
}

/// The real app, served in-process on port 0 against a fresh database. Its HTTP calls are the
/// [`Service`] trait's.
pub struct TestApp {
    /// Where the app listens (127.0.0.1, a port the system chose).
    pub addr: SocketAddr,
    /// An HTTP client for it ([`client`]).
    pub client: reqwest::Client,
    /// A separate pool for the test's own queries.
    pub db: PgPool,
    /// The app's database (dropped with the app).
    pub database: TestDatabase,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Service for TestApp {
    fn http(&self) -> &reqwest::Client {
        &self.client
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl TestApp {
    /// The app with [`AppOptions::default`].
    pub async fn spawn() -> Self {
        Self::spawn_with(AppOptions::default()).await
    }

    /// The app with `options`, on a fresh database.
    pub async fn spawn_with(options: AppOptions) -> Self {
        Self::spawn_on(TestDatabase::create().await, options).await
    }

    /// The app on a database the test has prepared (settings every connection must have, say).
    pub async fn spawn_on(database: TestDatabase, options: AppOptions) -> Self {
        let app_pool = crate::lazy_pool(
            database.options.clone(),
            options.db_max_connections,
            Duration::from_secs(10),
        );
        let (addr, shutdown) = serve(app_pool, &options).await;
        let db = database.pool(4).await;
        Self {
            addr,
            client: client(),
            db,
            database,
            shutdown: Some(shutdown),
        }
    }

    /// The app ([`AppOptions::default`]) with one credential, `key_id` (openai, pool
    /// `default`, gpt-4o), of `limit` slots.
    pub async fn with_credential(key_id: &str, limit: u32) -> Self {
        let app = Self::spawn().await;
        app.put_gpt4o_key(key_id, "default", limit).await;
        app
    }

    /// Another service over the app's database, served in this process: a replica in miniature,
    /// with its own connection pool of `max_connections`, candidate views and waiters. Returns
    /// its address and its shutdown trigger (sending or dropping it stops the replica).
    pub async fn replica(
        &self,
        max_connections: u32,
    ) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let pool = crate::lazy_pool(
            self.database.options.clone(),
            max_connections,
            Duration::from_secs(10),
        );
        serve(pool, &AppOptions::default()).await
    }

    /// Stops serving (in-flight requests finish; the app's connections close); the database
    /// stays until the app is dropped.
    pub fn stop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }

    /// Sets a credential's health columns directly (the operator API for this is a later issue):
    /// `status`, and a cooldown ending `cooldown_seconds` from now on the database clock (none
    /// when `None`).
    pub async fn set_status(&self, key_id: &str, status: &str, cooldown_seconds: Option<f64>) {
        sqlx::query(
            "UPDATE credentials SET status = $2,
                 cooldown_until = now() + make_interval(secs => $3)
             WHERE key_id = $1",
        )
        .bind(key_id)
        .bind(status)
        .bind(cooldown_seconds)
        .execute(&self.db)
        .await
        .expect("set status");
    }

    /// Unexpired leases on a credential, straight from the database.
    pub async fn in_flight(&self, key_id: &str) -> i64 {
        in_flight(&self.db, key_id).await
    }

    /// Every row of every credpool table, as text: equal snapshots mean nothing changed.
    pub async fn snapshot(&self) -> String {
        let mut out = String::new();
        for table in [
            "credentials",
            "lease_slots",
            "lease_events",
            "lease_requests",
            "credential_events",
            "affinity_bindings",
        ] {
            let rows: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT string_agg(to_jsonb(t)::text, E'\\n' ORDER BY to_jsonb(t)::text) FROM {table} t"
            )))
            .fetch_one(&self.db)
            .await
            .expect("snapshot");
            out.push_str(&format!("== {table}\n{}\n", rows.unwrap_or_default()));
        }
        out
    }

    /// The `lease_events` of a lease, oldest first, straight from the database.
    pub async fn events(&self, lease_id: &str) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT event FROM lease_events WHERE lease_id = $1::text::uuid ORDER BY event_id",
        )
        .bind(lease_id)
        .fetch_all(&self.db)
        .await
        .expect("events")
    }

    /// [`TestApp::events`] of `lease` as allocate answered it.
    pub async fn lease_events(&self, lease: &serde_json::Value) -> Vec<String> {
        self.events(lease["lease_id"].as_str().expect("a lease_id"))
            .await
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

/// Unexpired leases on a credential, read on `db` (the app's database, or any way to it).
pub async fn in_flight(db: &PgPool, key_id: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM lease_slots WHERE key_id = $1 AND lease_id IS NOT NULL AND lease_until > now()",
    )
    .bind(key_id)
    .fetch_one(db)
    .await
    .expect("count in-flight")
}

/// Serves the app on 127.0.0.1:0 over `pool` with the tests' keys; returns the address and a
/// shutdown trigger.
pub async fn serve(
    pool: impl Into<store::Db>,
    options: &AppOptions,
) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let keys = ApiKeys::new(INTERNAL_KEY.into(), ADMIN_KEY.into()).unwrap();
    let app = Application::bind("127.0.0.1:0", pool, keys, keyring(), &options.settings)
        .await
        .expect("bind");
    let addr = app.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(app.run_until(async {
        let _ = rx.await;
    }));
    (addr, tx)
}

/// Held by every test of a suite's process that makes allocations wait (`wait_ms`): the waiting
/// gauge (`credpool_allocations_waiting`) is one per process, shared by every app the process
/// runs, so a test that counts its own waiters through it must be the only one with waiters.
pub async fn exclusive_waiters() -> tokio::sync::MutexGuard<'static, ()> {
    static WAITERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    WAITERS.lock().await
}

/// Waits until exactly `count` requests wait in `app`, queued for wake-ups: `count` live
/// `pool_waiters` rows in its database (a waiting request's first claim writes its row) and
/// the process's waiting gauge (`credpool_allocations_waiting`) at `count` (each registered,
/// after that claim, for the wake-ups of its pools). Panics after 60 seconds. The gauge is one
/// per test process: the caller holds [`exclusive_waiters`], and waiters queued by a test that
/// does not hold it make this panic rather than pass for the caller's own.
pub async fn waiters_queued(app: &TestApp, count: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let (mut rows, mut gauge) = (0, 0.0);
    while tokio::time::Instant::now() < deadline {
        rows = sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pool_waiters WHERE until > clock_timestamp()",
        )
        .fetch_one(&app.db)
        .await
        .expect("pool_waiters");
        gauge = sample(&app.metrics().await, "credpool_allocations_waiting");
        if rows == count as i64 && gauge == count as f64 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never {count} requests waiting: {rows} waiter rows, the process's gauge at {gauge}");
}
