//! credpool on Citus: a real Citus cluster (a coordinator and two workers, each a private
//! PostgreSQL cluster started by credpool's embedded launcher) per test. The harness is
//! [`cluster::CitusCluster`]; a machine without Citus skips these tests with a `skipped:` line
//! (build Citus with `../shared/citus/build.sh`, see docs/src/citus.md), as does one with
//! `CREDPOOL_TEST_SKIP_CITUS=1`.

mod cluster;

use std::time::Instant;

use cluster::CitusCluster;
use sqlx::{Connection, PgConnection};

/// The test table, distributed by its text column `pool`.
const TABLE: &str = "leases_by_pool";

#[tokio::test(flavor = "multi_thread")]
async fn a_distributed_table_keeps_two_pools_on_different_workers() {
    let started = Instant::now();
    let Some(cluster) = CitusCluster::start().await else {
        return;
    };
    eprintln!(
        "the Citus cluster started in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let mut coordinator = connect(&cluster.coordinator_url()).await;

    // the coordinator (group 0) and the two workers, all active primaries; the workers alone
    // hold shards
    let active: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_dist_node WHERE noderole = 'primary' AND isactive",
    )
    .fetch_one(&mut coordinator)
    .await
    .unwrap();
    assert_eq!(active, 3);
    let coordinator_holds_shards: bool =
        sqlx::query_scalar("SELECT shouldhaveshards FROM pg_dist_node WHERE groupid = 0")
            .fetch_one(&mut coordinator)
            .await
            .unwrap();
    assert!(!coordinator_holds_shards);
    let mut shard_ports: Vec<i32> = sqlx::query_scalar(
        "SELECT nodeport FROM pg_dist_node WHERE groupid <> 0 AND shouldhaveshards",
    )
    .fetch_all(&mut coordinator)
    .await
    .unwrap();
    shard_ports.sort_unstable();
    let mut worker_ports = [0, 1].map(|i| i32::from(cluster.worker_port(i)));
    worker_ports.sort_unstable();
    assert_eq!(shard_ports, worker_ports);

    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {TABLE} (pool text NOT NULL, lease int NOT NULL);
         SELECT create_distributed_table('{TABLE}', 'pool');"
    )))
    .execute(&mut coordinator)
    .await
    .unwrap();
    let (first, second) = pools_on_different_workers(&mut coordinator).await;
    for (shard, rows) in [(&first, 3), (&second, 2)] {
        for lease in 0..rows {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {TABLE} (pool, lease) VALUES ($1, $2)"
            )))
            .bind(&shard.pool)
            .bind(lease)
            .execute(&mut coordinator)
            .await
            .unwrap();
        }
    }

    // each pool's rows are in its shard's table on its worker, and that table is on no other
    for (shard, rows) in [(&first, 3_i64), (&second, 2)] {
        for i in 0..2 {
            let mut worker = connect(&cluster.worker_url(i)).await;
            let here = i32::from(cluster.worker_port(i)) == shard.nodeport;
            let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(&shard.shard_name)
                .fetch_one(&mut worker)
                .await
                .unwrap();
            assert_eq!(exists, here, "{} on worker {i}", shard.shard_name);
            if here {
                let stored: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT count(*) FROM {} WHERE pool = $1",
                    shard.shard_name
                )))
                .bind(&shard.pool)
                .fetch_one(&mut worker)
                .await
                .unwrap();
                assert_eq!(stored, rows, "{} on worker {i}", shard.shard_name);
            }
            let _ = worker.close().await;
        }
    }
    let _ = coordinator.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pool_on_a_stopped_worker_answers_again_once_it_restarts() {
    let Some(mut cluster) = CitusCluster::start().await else {
        return;
    };
    let mut coordinator = connect(&cluster.coordinator_url()).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {TABLE} (pool text NOT NULL, lease int NOT NULL);
         SELECT create_distributed_table('{TABLE}', 'pool');"
    )))
    .execute(&mut coordinator)
    .await
    .unwrap();
    let (first, second) = pools_on_different_workers(&mut coordinator).await;
    for shard in [&first, &second] {
        insert_lease(&mut coordinator, &shard.pool).await.unwrap();
    }
    let down = (0..2)
        .find(|&i| i32::from(cluster.worker_port(i)) == second.nodeport)
        .expect("the second pool's worker");

    cluster.stop_worker(down).await;
    // the other worker's pool still takes writes; the stopped one's does not
    insert_lease(&mut coordinator, &first.pool).await.unwrap();
    assert!(insert_lease(&mut coordinator, &second.pool).await.is_err());

    cluster.start_worker(down).await;
    insert_lease(&mut coordinator, &second.pool).await.unwrap();
    let leases: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {TABLE} WHERE pool = $1"
    )))
    .bind(&second.pool)
    .fetch_one(&mut coordinator)
    .await
    .unwrap();
    assert_eq!(leases, 2);
    let _ = coordinator.close().await;
}

/// Where a pool's rows of [`TABLE`] live: the shard's table and its worker's port.
#[derive(Debug)]
struct Shard {
    pool: String,
    shard_name: String,
    nodeport: i32,
}

/// Two pools whose shards are on different workers, by the coordinator's `citus_shards`.
async fn pools_on_different_workers(coordinator: &mut PgConnection) -> (Shard, Shard) {
    let mut first: Option<Shard> = None;
    for n in 0..64 {
        let pool = format!("pool-{n}");
        let (shard_name, nodeport): (String, i32) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT shard_name, nodeport FROM citus_shards
             WHERE table_name = '{TABLE}'::regclass
               AND shardid = get_shard_id_for_distribution_column('{TABLE}', $1)"
        )))
        .bind(&pool)
        .fetch_one(&mut *coordinator)
        .await
        .unwrap();
        let shard = Shard {
            pool,
            shard_name,
            nodeport,
        };
        match first {
            None => first = Some(shard),
            Some(ref one) if one.nodeport != shard.nodeport => {
                return (first.unwrap(), shard);
            }
            Some(_) => {}
        }
    }
    panic!("64 pools, all on one worker: {TABLE} is not spread over the workers");
}

async fn insert_lease(coordinator: &mut PgConnection, pool: &str) -> Result<(), sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {TABLE} (pool, lease) VALUES ($1, 0)"
    )))
    .bind(pool)
    .execute(coordinator)
    .await
    .map(drop)
}

async fn connect(url: &str) -> PgConnection {
    PgConnection::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connecting to {url}: {e}"))
}
