//! The test's own SQL on a database ([`Sql`]): statements a test writes whole, run on a pool of
//! its own (never the app's), each panicking with its text when it fails.

use sqlx::postgres::PgRow;
use sqlx::{PgPool, Postgres};

use crate::app::TestApp;

/// Statements a test runs on a database of its own: reads of one value or one column, and
/// writes. `$1`, where a method binds an argument, is that argument. Every method panics,
/// naming the statement, when it fails.
#[allow(async_fn_in_trait)] // called on the kit's own types only, whose auto traits are known
pub trait Sql {
    /// The pool the statements run on.
    fn sql_pool(&self) -> &PgPool;

    /// The first column of the one row `sql` returns.
    async fn scalar<T>(&self, sql: &'static str) -> T
    where
        T: Send + Unpin,
        (T,): for<'r> sqlx::FromRow<'r, PgRow>,
    {
        sqlx::query_scalar(sql)
            .fetch_one(self.sql_pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// [`Sql::scalar`] with `$1` bound to `arg`.
    async fn scalar_of<'a, T, A>(&self, sql: &'static str, arg: A) -> T
    where
        T: Send + Unpin,
        (T,): for<'r> sqlx::FromRow<'r, PgRow>,
        A: 'a + Send + sqlx::Encode<'a, Postgres> + sqlx::Type<Postgres>,
    {
        sqlx::query_scalar(sql)
            .bind(arg)
            .fetch_one(self.sql_pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// The first column of every row `sql` returns, in its order.
    async fn scalars<T>(&self, sql: &'static str) -> Vec<T>
    where
        T: Send + Unpin,
        (T,): for<'r> sqlx::FromRow<'r, PgRow>,
    {
        sqlx::query_scalar(sql)
            .fetch_all(self.sql_pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Runs `sql`.
    async fn run_sql(&self, sql: &'static str) {
        sqlx::query(sql)
            .execute(self.sql_pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Runs `sql` with `$1` bound to `arg`.
    async fn run_sql_with<'a, A>(&self, sql: &'static str, arg: A)
    where
        A: 'a + Send + sqlx::Encode<'a, Postgres> + sqlx::Type<Postgres>,
    {
        sqlx::query(sql)
            .bind(arg)
            .execute(self.sql_pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
}

/// Runs `sql` on `conn`, a connection or an open transaction of the test's own (where [`Sql`]
/// runs on a pool); panics, naming the statement, when it fails.
pub async fn run_on<'c>(conn: impl sqlx::PgExecutor<'c>, sql: &'static str) {
    sqlx::query(sql)
        .execute(conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

impl Sql for PgPool {
    fn sql_pool(&self) -> &PgPool {
        self
    }
}

impl Sql for TestApp {
    fn sql_pool(&self) -> &PgPool {
        &self.db
    }
}
