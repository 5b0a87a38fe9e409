//! `--baseline sql`: the simplest correct allocator one would write by hand on PostgreSQL, the
//! figure a user compares credpool with.
//!
//! Its own tables, in a throwaway schema the run creates and drops (`bench_baseline_{run}`; it
//! never touches credpool's tables): `credentials` (id, provider, pool, status) and `slots`, one
//! row per concurrency slot of each credential (its lease_id, lease_until, and the provider/pool
//! the lease was taken in). The executor ranks a window of [`CANDIDATES`] credentials at a random
//! place itself; a claim is the ONE statement [`CLAIM`], a release the ONE statement [`RELEASE`];
//! one connection per executor, autocommit, no audit trail, no health, no fence.
//!
//! Why it cannot oversell: the row each claim locks is the slot row whose own state (`lease_id`,
//! `lease_until`) decides whether it is free, so PostgreSQL's re-check of a locked row under READ
//! COMMITTED sees the truth: a slot another transaction took and committed after this
//! statement's snapshot is re-read when locked and fails `lease_id IS NULL OR lease_until <=
//! now()`; a slot being taken right now is skipped (SKIP LOCKED), never waited for. The slot
//! count per credential is the limit, so a credential never has more live leases than slots.

use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::postgres::types::PgInterval;
use sqlx::{AssertSqlSafe, ConnectOptions, PgConnection};

use super::{Allocator, Claimed, PROVIDER, Plan};
use credpool::domain::LeaseId;
use credpool::store::Db;

/// Candidates each claim passes: a window of the ranking, as an executor would pass it.
pub(super) const CANDIDATES: usize = 20;

/// The claim, as one would write it by hand: $1 the new lease_id, $2 the lease length, $3/$4 the
/// provider and pool, $5 the ranked key ids, best first. Returns the key_id leased, or no row
/// when no candidate had a free slot.
pub(super) const CLAIM: &str = "UPDATE slots s SET lease_id = $1, lease_until = now() + $2, \
     provider = $3, pool = $4 \
     FROM (SELECT s2.key_id, s2.slot \
           FROM unnest($5::text[]) WITH ORDINALITY c(id, ord) \
           JOIN credentials k ON k.id = c.id \
           JOIN slots s2 ON s2.key_id = k.id \
           WHERE k.provider = $3 AND k.pool = $4 AND k.status = 'available' \
             AND (s2.lease_id IS NULL OR s2.lease_until <= now()) \
           ORDER BY c.ord, s2.slot \
           LIMIT 1 \
           FOR UPDATE OF s2 SKIP LOCKED) pick \
     WHERE (s.key_id, s.slot) = (pick.key_id, pick.slot) \
     RETURNING s.key_id";

/// The release, as one would write it by hand: frees the slot only when all four values match
/// (an expired lease whose slot was taken again no longer matches its lease_id).
pub(super) const RELEASE: &str = "UPDATE slots SET lease_id = NULL, lease_until = NULL \
     WHERE lease_id = $1 AND key_id = $2 AND provider = $3 AND pool = $4";

/// The baseline's schema for a run.
pub(super) fn schema_name(run_id: &str) -> String {
    format!("bench_baseline_{run_id}")
}

/// Creates the baseline's schema and tables and loads `key_ids` (each `limit` free slots, all
/// `available`, in `pool` of the bench provider), then refreshes their statistics.
pub(super) async fn create(
    db: &Db,
    schema: &str,
    key_ids: &[String],
    pool: &str,
    limit: u32,
) -> anyhow::Result<()> {
    let mut tx = super::without_statement_timeout(db).await?;
    // the schema name is ours (`bench_baseline_` and hex digits), not input
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA {schema};
         CREATE TABLE {schema}.credentials (
             id text PRIMARY KEY,
             provider text NOT NULL,
             pool text NOT NULL,
             status text NOT NULL
         );
         CREATE TABLE {schema}.slots (
             key_id text NOT NULL REFERENCES {schema}.credentials (id),
             slot integer NOT NULL,
             lease_id uuid,
             lease_until timestamptz,
             provider text,
             pool text,
             PRIMARY KEY (key_id, slot)
         );"
    )))
    .execute(&mut *tx)
    .await?;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {schema}.credentials (id, provider, pool, status)
         SELECT id, $2, $3, 'available' FROM unnest($1::text[]) AS id"
    )))
    .bind(key_ids)
    .bind(PROVIDER)
    .bind(pool)
    .execute(&mut *tx)
    .await?;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {schema}.slots (key_id, slot)
         SELECT id, slot FROM {schema}.credentials, generate_series(0, $1 - 1) AS slot"
    )))
    .bind(limit as i32)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ANALYZE {schema}.credentials; ANALYZE {schema}.slots;"
    )))
    .execute(db.pool())
    .await?;
    Ok(())
}

/// Drops the baseline's schema and everything in it (if it exists).
pub(super) async fn drop(db: &Db, schema: &str) -> anyhow::Result<()> {
    let mut tx = super::without_statement_timeout(db).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE"
    )))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Connection options of the baseline's executors: the database's, with the baseline's schema
/// first on the search path, so that the statements read exactly as one would write them by hand.
pub(super) fn connect_options(database: &PgConnectOptions, schema: &str) -> PgConnectOptions {
    database.clone().options([("search_path", schema)])
}

/// One executor of the baseline, on its own connection.
pub(super) struct SqlAllocator {
    conn: PgConnection,
    lease_length: PgInterval,
    lease: Option<(String, LeaseId)>,
}

impl SqlAllocator {
    pub(super) async fn connect(
        options: &PgConnectOptions,
        lease_seconds: u32,
    ) -> Result<Self, sqlx::Error> {
        let lease_length = PgInterval::try_from(Duration::from_secs(u64::from(lease_seconds)))
            .map_err(sqlx::Error::Encode)?;
        Ok(Self {
            conn: options.connect().await?,
            lease_length,
            lease: None,
        })
    }
}

impl Allocator for SqlAllocator {
    async fn allocate(&mut self, plan: &Plan) -> Claimed {
        let ranked: Vec<&str> = plan.window(CANDIDATES).map(|k| k.as_str()).collect();
        let lease_id = LeaseId::generate();
        let claimed = sqlx::query_scalar::<_, String>(CLAIM)
            .bind(lease_id.as_uuid())
            .bind(self.lease_length)
            .bind(PROVIDER)
            .bind(plan.pool.as_str())
            .bind(&ranked)
            .fetch_optional(&mut self.conn)
            .await;
        Claimed::of_baseline(
            claimed,
            lease_id,
            &mut self.lease,
            "sql baseline claim failed",
        )
    }

    async fn release(&mut self, plan: &Plan) -> bool {
        let Some((key_id, lease_id)) = self.lease.take() else {
            return false;
        };
        let released = sqlx::query(RELEASE)
            .bind(lease_id.as_uuid())
            .bind(&key_id)
            .bind(PROVIDER)
            .bind(plan.pool.as_str())
            .execute(&mut self.conn)
            .await;
        match released {
            Ok(done) => done.rows_affected() == 1,
            Err(error) => {
                tracing::debug!(error = %error, "sql baseline release failed");
                false
            }
        }
    }
}
