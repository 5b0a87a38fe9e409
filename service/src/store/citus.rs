//! Distributing a credpool database on a Citus coordinator (`credpool citus distribute`): the
//! plan of docs/src/citus.md ("The distribution") carried out on a migrated database, empty or
//! not. Every lease row is distributed by its provider and co-located with its credential, a
//! tenant's slot and window rows by the tenant, the other tenant rows are reference tables (a copy
//! on every node: read on every claim, written by operators), and the operator's bookkeeping stays
//! on the coordinator.
//!
//! Idempotent: a table Citus already knows is left as it is, so a second run (or a run after a
//! partial one) does only what is missing. Refuses, changing nothing, where the database has no
//! Citus extension.

use sqlx::{AssertSqlSafe, PgConnection};

use super::Db;

/// The tables distributed by `provider`, co-located: `credentials` first (the others follow its
/// shards), then every table whose rows belong to one credential's provider.
pub const DISTRIBUTED: [&str; 10] = [
    "credentials",
    "lease_slots",
    "lease_windows",
    "oauth_credentials",
    "affinity_bindings",
    "lease_requests",
    "pool_versions",
    "pool_waiters",
    "lease_events",
    "credential_departures",
];

/// The reference tables (a copy on every node), `tenants` first (the others point to it).
pub const REFERENCE: [&str; 4] = [
    "tenants",
    "tenant_keys",
    "tenant_events",
    "pool_waiter_processes",
];

/// The tables distributed by `tenant_id`, co-located with each other (not with the credentials):
/// a tenant's cap and windows span providers, and a claim locks its tenant's rows on the
/// tenant's worker. Reference rows would do, but Citus serializes every row lock on a reference
/// table cluster-wide, and concurrent capped claims of providers on two workers deadlocked
/// (docs/src/citus.md, "Tenant slots cannot stay reference rows").
pub const BY_TENANT: [&str; 2] = ["tenant_slots", "tenant_windows"];

/// The keys Citus needs the distribution column in, as credpool writes them on plain PostgreSQL
/// (`table`, `constraint`, `columns` with `provider`): each is replaced under its own name, so
/// that `ON CONFLICT ON CONSTRAINT <name>` means the same on both. The provider is a function of
/// the key id (a credential has one), so each key is as unique as before.
const KEYS: [(&str, &str, &str); 6] = [
    ("credentials", "credentials_pkey", "key_id, provider"),
    ("lease_slots", "lease_slots_pkey", "key_id, slot, provider"),
    ("lease_windows", "lease_windows_pkey", "key_id, provider"),
    (
        "oauth_credentials",
        "oauth_credentials_pkey",
        "key_id, provider",
    ),
    (
        "lease_requests",
        "lease_requests_pkey",
        "tenant, request_id, provider",
    ),
    ("pool_waiters", "pool_waiters_pkey", "waiter, provider"),
];

/// The foreign keys to a credential (`table`, `constraint`): on Citus they name the provider too.
const CREDENTIAL_FOREIGN_KEYS: [(&str, &str); 4] = [
    ("lease_slots", "lease_slots_key_id_fkey"),
    ("lease_windows", "lease_windows_key_id_fkey"),
    ("oauth_credentials", "oauth_credentials_key_id_fkey"),
    ("affinity_bindings", "affinity_bindings_key_id_fkey"),
];

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Distribution {
    /// The Citus version of the coordinator's extension.
    pub citus_version: String,
    /// Worker nodes that hold shards (the coordinator not counted).
    pub workers: i64,
    /// Tables this run distributed by provider.
    pub distributed: Vec<String>,
    /// Tables this run made reference tables.
    pub reference: Vec<String>,
    /// Keys this run rebuilt with the provider in them.
    pub keys: Vec<String>,
    /// credpool's SQL functions this run sent to every node.
    pub functions: i64,
    /// credpool's SQL functions this run made plan each call for its values
    /// ([`super::schema::adapt_to_citus`]).
    pub per_call_plans: i64,
}

impl Distribution {
    /// Whether the run found everything done already.
    pub fn was_done(&self) -> bool {
        self.distributed.is_empty()
            && self.reference.is_empty()
            && self.keys.is_empty()
            && self.functions == 0
            && self.per_call_plans == 0
    }
}

/// Why a database could not be distributed.
#[derive(Debug, thiserror::Error)]
pub enum CitusError {
    /// The database has no `citus` extension: nothing was changed.
    #[error(
        "this database has no Citus extension: install Citus, `CREATE EXTENSION citus` on the \
         coordinator's database and add the workers (`SELECT citus_add_node(host, port)`) first; \
         see docs/src/citus.md. Nothing was changed"
    )]
    NotInstalled,
    /// The store failed (the transaction was rolled back: nothing was changed).
    #[error(transparent)]
    Store(#[from] sqlx::Error),
}

/// Distributes the database `db` points to, which must be a migrated credpool database on a
/// Citus coordinator, in one transaction (all of it or nothing), with `shard_count` shards per
/// distributed table (Citus's default when `None`; providers hash to shards, so more shards
/// than providers buys nothing). See the module documentation.
///
/// # Errors
/// [`CitusError::NotInstalled`] without the extension; [`CitusError::Store`] when a statement
/// fails (say a worker is down).
pub async fn distribute(db: &Db, shard_count: Option<u32>) -> Result<Distribution, CitusError> {
    let mut tx = db.begin().await?;
    let Some(citus_version) = citus_version(&mut tx).await? else {
        return Err(CitusError::NotInstalled);
    };
    let mut done = Distribution {
        citus_version,
        ..Default::default()
    };
    // (every statement on one connection to each worker: a transaction that changes a
    // distributed table's schema and then its shards may not use several)
    sqlx::raw_sql(
        "SET LOCAL citus.multi_shard_modify_mode TO 'sequential';
         SET LOCAL citus.enable_unsafe_triggers TO on;
         SET LOCAL client_min_messages TO warning;",
    )
    .execute(&mut *tx)
    .await?;
    // credpool's triggers (on credentials, the trail and the event tables) fire on each shard
    // and touch only rows of the same provider, so they are safe to distribute; later migrations
    // that create them again need the setting too
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&mut *tx)
        .await?;
    run(
        &mut tx,
        format!(
            "ALTER DATABASE {} SET citus.enable_unsafe_triggers TO on",
            quote_ident(&database)
        ),
    )
    .await?;
    done.workers = sqlx::query_scalar(
        "SELECT count(*) FROM pg_dist_node
         WHERE groupid <> 0 AND noderole = 'primary' AND isactive AND shouldhaveshards",
    )
    .fetch_one(&mut *tx)
    .await?;

    let placed: Vec<String> = sqlx::query_scalar(
        // (hash-distributed, or a reference table: one shard, replicated to every node)
        "SELECT logicalrelid::regclass::text FROM pg_dist_partition
         WHERE partmethod = 'h' OR (partmethod = 'n' AND repmodel = 't')",
    )
    .fetch_all(&mut *tx)
    .await?;
    let to_distribute: Vec<&str> = DISTRIBUTED
        .into_iter()
        .filter(|t| !placed.iter().any(|p| p == t))
        .collect();
    if !to_distribute.is_empty() {
        for (table, constraint) in CREDENTIAL_FOREIGN_KEYS {
            run(
                &mut tx,
                format!("ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {constraint}"),
            )
            .await?;
        }
        for (table, constraint, columns) in KEYS {
            if rebuild_key(&mut tx, table, constraint, columns).await? {
                done.keys.push(format!("{table} ({columns})"));
            }
        }
        // the pool-change notification cannot work there (sql/pools.sql says why, and leaves
        // it out once pool_versions is distributed)
        sqlx::raw_sql("DROP TRIGGER IF EXISTS pool_versions_changed ON pool_versions")
            .execute(&mut *tx)
            .await?;
    }
    // (copying a table's rows into its shards inserts them there: credentials' insert triggers
    // would stamp them and move their pools' versions again, half-way through)
    let copies_credentials = to_distribute.contains(&"credentials");
    if copies_credentials {
        sqlx::raw_sql("ALTER TABLE credentials DISABLE TRIGGER USER")
            .execute(&mut *tx)
            .await?;
    }
    for table in to_distribute {
        let statement = if table == "credentials" {
            match shard_count {
                Some(count) => format!(
                    "SELECT create_distributed_table('credentials', 'provider', shard_count := {count})"
                ),
                None => "SELECT create_distributed_table('credentials', 'provider')".to_owned(),
            }
        } else {
            format!(
                "SELECT create_distributed_table('{table}', 'provider', colocate_with := 'credentials')"
            )
        };
        run(&mut tx, statement).await?;
        done.distributed.push(table.to_owned());
    }
    if copies_credentials {
        sqlx::raw_sql("ALTER TABLE credentials ENABLE TRIGGER USER")
            .execute(&mut *tx)
            .await?;
    }
    for (table, constraint) in CREDENTIAL_FOREIGN_KEYS {
        let present: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = $1)")
                .bind(constraint)
                .fetch_one(&mut *tx)
                .await?;
        if !present {
            run(
                &mut tx,
                format!(
                    "ALTER TABLE {table} ADD CONSTRAINT {constraint} FOREIGN KEY (key_id, provider)
                     REFERENCES credentials (key_id, provider) ON DELETE CASCADE"
                ),
            )
            .await?;
        }
    }
    for table in REFERENCE {
        if !placed.iter().any(|p| p == table) {
            sqlx::query("SELECT create_reference_table($1::regclass)")
                .bind(table)
                .execute(&mut *tx)
                .await?;
            done.reference.push(table.to_owned());
        }
    }
    for table in BY_TENANT {
        if !placed.iter().any(|p| p == table) {
            let colocate = if table == BY_TENANT[0] {
                "none"
            } else {
                BY_TENANT[0]
            };
            run(
                &mut tx,
                format!(
                    "SELECT create_distributed_table('{table}', 'tenant_id', colocate_with := '{colocate}')"
                ),
            )
            .await?;
            done.distributed.push(table.to_owned());
        }
    }
    done.per_call_plans = super::schema::adapt_to_citus(&mut tx).await?;
    // The coordinator keeps its copy of a reference table as a shard (`tenants_102040`), and a
    // function of the table's row type then takes the shard's: drop those and apply the SQL
    // files again, which define them on the table's type.
    let stale: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT p.oid::regprocedure::text
         FROM pg_proc p
         CROSS JOIN LATERAL unnest(p.proargtypes::oid[] || coalesce(p.proallargtypes, '{}')) AS a (type)
         JOIN pg_type t ON t.oid = a.type OR t.typarray = a.type
         -- (by the type's name: Citus hides its shards from pg_class)
         JOIN pg_dist_shard s ON t.typname = (s.logicalrelid::regclass)::text || '_' || s.shardid
         WHERE p.pronamespace = 'public'::regnamespace",
    )
    .fetch_all(&mut *tx)
    .await?;
    for function in &stale {
        run(&mut tx, format!("DROP FUNCTION {function}")).await?;
    }
    if !stale.is_empty() {
        sqlx::raw_sql("DELETE FROM credpool_sql_files")
            .execute(&mut *tx)
            .await?;
        super::schema::apply_sql_files(&mut tx).await?;
    }
    // every function of credpool's on every node: triggers fire on the workers, and the
    // functions they call must be there
    done.functions = sqlx::query_scalar(
        "SELECT count(create_distributed_function(p.oid::regprocedure))
         FROM pg_proc p
         WHERE p.pronamespace = 'public'::regnamespace
           AND p.prokind = 'f'
           AND NOT EXISTS (SELECT 1 FROM pg_depend d
                           WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid
                             AND d.deptype = 'e')
           AND NOT EXISTS (SELECT 1 FROM pg_dist_object o
                           WHERE o.classid = 'pg_proc'::regclass AND o.objid = p.oid)",
    )
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(done)
}

/// The version of the database's `citus` extension, if it has one.
pub async fn citus_version(conn: &mut PgConnection) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT extversion FROM pg_extension WHERE extname = 'citus'")
        .fetch_optional(conn)
        .await
}

/// Rebuilds `table`'s key `constraint` on `columns` unless it is on them already; returns
/// whether it did.
async fn rebuild_key(
    conn: &mut PgConnection,
    table: &str,
    constraint: &str,
    columns: &str,
) -> Result<bool, sqlx::Error> {
    let current: Option<String> = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint
         WHERE conrelid = $1::regclass AND conname = $2",
    )
    .bind(table)
    .bind(constraint)
    .fetch_optional(&mut *conn)
    .await?;
    if current.as_deref() == Some(&format!("PRIMARY KEY ({columns})")) {
        return Ok(false);
    }
    run(
        conn,
        format!(
            "ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {constraint},
                 ADD CONSTRAINT {constraint} PRIMARY KEY ({columns})"
        ),
    )
    .await?;
    Ok(true)
}

/// Runs one statement built here: every name in it is one of this module's constants, a
/// number, or quoted with [`quote_ident`].
async fn run(conn: &mut PgConnection, statement: String) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(statement))
        .execute(conn)
        .await?;
    Ok(())
}

/// `name` as an SQL identifier.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
