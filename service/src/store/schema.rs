//! The database schema: the versioned migrations (`migrations/`, tables and the data moves a table
//! change needs, forward only) and the repeatable SQL files (`sql/`, every SQL function, trigger
//! and view, each file the one current definition of what it holds).
//!
//! A repeatable file is applied after the versioned migrations whenever its content differs from
//! what the database recorded for it (`credpool_sql_files`: name, SHA-256, and in `migration` the
//! revision of the binary that applied it: its newest migration, or its SQL revision when that is
//! higher), the convention of Flyway's repeatable migrations: all changed files
//! in one transaction, in the order of [`SQL_FILES`], under a transaction-scoped advisory lock (so
//! it also works through a transaction pooler, and concurrent start-ups apply them once). A binary
//! older than the one that applied a file (its revision is lower) leaves the file alone,
//! so that restarting an old replica during a rolling upgrade does not bring back old functions.

use sha2::{Digest, Sha256};
use sqlx::{PgConnection, Row};

/// The migrations in `migrations/`, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// The repeatable SQL files, in the order they are applied (a file may use what an earlier one
/// defines: SQL-language functions are checked when they are created).
pub const SQL_FILES: &[(&str, &str)] = &[
    ("pools.sql", include_str!("../../../sql/pools.sql")),
    ("windows.sql", include_str!("../../../sql/windows.sql")),
    ("locks.sql", include_str!("../../../sql/locks.sql")),
    ("claim.sql", include_str!("../../../sql/claim.sql")),
    ("renew.sql", include_str!("../../../sql/renew.sql")),
    ("release.sql", include_str!("../../../sql/release.sql")),
    ("fit.sql", include_str!("../../../sql/fit.sql")),
    ("tenants.sql", include_str!("../../../sql/tenants.sql")),
    ("audit.sql", include_str!("../../../sql/audit.sql")),
    (
        "maintenance.sql",
        include_str!("../../../sql/maintenance.sql"),
    ),
];

/// The transaction-scoped advisory lock that serialises appliers of the repeatable files
/// ("credsql!" in ASCII).
const SQL_FILES_LOCK: i64 = 0x6372_6564_7371_6c21;

/// The newest migration this binary knows; `/readyz` is ready only once the database has it.
pub fn latest_migration() -> i64 {
    MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0)
}

/// The revision of the repeatable files' contract, in the migrations' numbering: raised (to the
/// number a migration written now would get) when a file changes what an older binary calls —
/// a signature, a result, a meaning — without a migration to go with it. Files applied by a
/// binary of a higher revision are left alone (see [`stale`]): with equal newest migrations, an
/// old replica restarted during a rolling upgrade would otherwise bring its functions back (and
/// an old `credpool_release(jsonb)` next to the new one with a defaulted second argument makes
/// every old call of it ambiguous).
const SQL_REVISION: i64 = 20261201000009;

/// What this binary records as the applier of a repeatable file: the higher of its newest
/// migration and [`SQL_REVISION`].
fn applier_revision() -> i64 {
    latest_migration().max(SQL_REVISION)
}

fn checksum(text: &str) -> Vec<u8> {
    Sha256::digest(text.as_bytes()).to_vec()
}

/// Applies every pending migration, then every repeatable file whose content changed. Safe to
/// run from several processes at once: sqlx serialises migrators with a session advisory lock,
/// so `db` must reach PostgreSQL directly, not through a transaction pooler (see
/// [`apply_sql_files`] for that case).
pub async fn migrate<'a, A>(db: A) -> Result<(), sqlx::migrate::MigrateError>
where
    A: sqlx::Acquire<'a, Database = sqlx::Postgres>,
{
    let mut conn = db.acquire().await?;
    MIGRATOR.run(&mut *conn).await?;
    apply_sql_files(&mut conn)
        .await
        .map_err(sqlx::migrate::MigrateError::Execute)?;
    Ok(())
}

/// What the database recorded for each repeatable file: name -> (checksum, migration of the
/// applier). Empty when the table does not exist yet. One simple-protocol statement.
async fn recorded(
    conn: &mut PgConnection,
) -> Result<std::collections::HashMap<String, (Vec<u8>, i64)>, sqlx::Error> {
    let rows = match sqlx::raw_sql("SELECT name, checksum, migration FROM credpool_sql_files")
        .fetch_all(conn)
        .await
    {
        Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("42P01") => {
            return Ok(Default::default());
        }
        rows => rows?,
    };
    rows.into_iter()
        .map(|row| {
            Ok((
                row.try_get::<String, _>("name")?,
                (row.try_get("checksum")?, row.try_get("migration")?),
            ))
        })
        .collect()
}

/// Whether a recorded file needs this binary's copy applied: it differs, and was not applied by
/// a newer binary (a higher [`applier_revision`]).
fn stale(recorded: Option<&(Vec<u8>, i64)>, ours: &[u8]) -> bool {
    stale_for(recorded, ours, applier_revision())
}

/// [`stale`] as decided by a binary of revision `revision`.
fn stale_for(recorded: Option<&(Vec<u8>, i64)>, ours: &[u8], revision: i64) -> bool {
    match recorded {
        None => true,
        Some((sum, recorded_by)) => sum.as_slice() != ours && *recorded_by <= revision,
    }
}

/// Applies, in one transaction under [`SQL_FILES_LOCK`], every repeatable file whose content
/// differs from what the database recorded (see the module comment). Returns the names applied.
/// Needs the versioned migrations applied first.
pub async fn apply_sql_files(conn: &mut PgConnection) -> Result<Vec<&'static str>, sqlx::Error> {
    use sqlx::Connection;
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(SQL_FILES_LOCK)
        .execute(&mut *tx)
        .await?;
    let recorded = recorded(&mut tx).await?;
    let mut applied = Vec::new();
    for (name, text) in SQL_FILES {
        let sum = checksum(text);
        if !stale(recorded.get(*name), &sum) {
            continue;
        }
        // one statement at a time: Citus sends some of them (a function's definition) on to the
        // workers as the text it was given, and a worker refuses several statements in one
        for statement in statements(text) {
            sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query(
            "INSERT INTO credpool_sql_files (name, checksum, migration) VALUES ($1, $2, $3)
             ON CONFLICT (name) DO UPDATE
             SET checksum = EXCLUDED.checksum, migration = EXCLUDED.migration, applied_at = now()",
        )
        .bind(*name)
        .bind(&sum)
        .bind(applier_revision())
        .execute(&mut *tx)
        .await?;
        applied.push(*name);
    }
    if !applied.is_empty() && is_distributed(&mut tx).await? {
        adapt_to_citus(&mut tx).await?;
    }
    tx.commit().await?;
    if !applied.is_empty() {
        tracing::info!(files = ?applied, "SQL functions applied");
    }
    Ok(applied)
}

/// Whether the database's `credentials` table is distributed by Citus.
///
/// # Errors
/// When the store fails.
pub async fn is_distributed(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    // (the catalog table is there only with Citus: looked up before it is named)
    let citus: bool =
        sqlx::query_scalar("SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await?;
    if !citus {
        return Ok(false);
    }
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition
                        WHERE logicalrelid = 'credentials'::regclass)",
    )
    .fetch_one(conn)
    .await
}

/// Adapts credpool's SQL functions to a distributed database: run by `credpool citus distribute`
/// and by [`apply_sql_files`] after every application of the SQL files there (which define them
/// for plain PostgreSQL). Each statement is planned per call (`plan_per_call`), the lease path's
/// statements are routed by provider (`route_by_provider`), and tenant keys are looked up by a
/// function of its own (`look_up_keys_apart`). Returns how many functions now plan per call.
///
/// # Errors
/// When the store fails.
pub async fn adapt_to_citus(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
    let planned = plan_per_call(&mut *conn).await?;
    route_by_provider(&mut *conn).await?;
    look_up_keys_apart(conn).await?;
    Ok(planned)
}

/// Takes `plan_cache_mode` off every credpool SQL function that sets it (the claim's, the
/// release's, END's: on plain PostgreSQL they keep one generic plan per statement, so that a pool
/// just loaded gets index probes whatever its statistics), so that on Citus each statement is
/// planned for the values of its call: Citus routes a statement to a worker by the provider's
/// value, which a generic plan does not have, and refuses to plan a generic one that joins
/// ("could not create distributed plan", measured). Returns how many functions it changed.
async fn plan_per_call(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
    let functions: Vec<String> = sqlx::query_scalar(
        "SELECT p.oid::regprocedure::text
         FROM pg_proc p
         WHERE p.pronamespace = 'public'::regnamespace
           AND EXISTS (SELECT 1 FROM unnest(p.proconfig) AS c WHERE c LIKE 'plan_cache_mode=%')",
    )
    .fetch_all(&mut *conn)
    .await?;
    for function in &functions {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER FUNCTION {function} RESET plan_cache_mode"
        )))
        .execute(&mut *conn)
        .await?;
    }
    Ok(i64::try_from(functions.len()).unwrap_or(i64::MAX))
}

/// Redefines `credpool_on_provider(row_provider, provider)`, the predicate the lease path's
/// statements put on every table they read by key, as `row_provider = provider`: on Citus that
/// equality is what routes a statement to the provider's worker. The SQL files define it as
/// `true` (on plain PostgreSQL the rows are reached by key, and a provider predicate only
/// misleads the planner). Likewise `credpool_on_tenant(row_tenant, tenant)`, for the tenant
/// rows distributed by tenant (`tenant_slots`, `tenant_windows`).
async fn route_by_provider(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "CREATE OR REPLACE FUNCTION credpool_on_provider(p_row_provider text, p_provider text)
         RETURNS boolean
         LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT p_row_provider = p_provider $$",
    )
    .execute(&mut *conn)
    .await?;
    sqlx::raw_sql(
        "CREATE OR REPLACE FUNCTION credpool_on_tenant(p_row_tenant text, p_tenant text)
         RETURNS boolean
         LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT p_row_tenant = p_tenant $$",
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Makes `credpool_key_tenant(key_hash)` (the tenant of a live key, the rule of tenant keys) a
/// PL/pgSQL function with the same query. The SQL files define it in SQL, which PostgreSQL
/// inlines into the statements that call it (one index probe within the statement); but Citus
/// plans a statement by the tables it names before the function is inlined, and refuses it once
/// the inlined function names `tenant_keys`, a reference table ("parameterized queries for SQL
/// functions referencing distributed tables are not supported", measured on the renewal's and
/// the release's reads of their keys). As PL/pgSQL it runs its query on its own. Done only while
/// it is still SQL (the SQL files were applied again), so it is taken from its current text.
async fn look_up_keys_apart(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "DO $$
         DECLARE
             v_query text;
         BEGIN
             SELECT p.prosrc INTO v_query FROM pg_proc p
             WHERE p.oid = 'credpool_key_tenant(text)'::regprocedure
               AND p.prolang = (SELECT l.oid FROM pg_language l WHERE l.lanname = 'sql');
             IF FOUND THEN
                 EXECUTE format(
                     'CREATE OR REPLACE FUNCTION credpool_key_tenant(p_key_hash text)
                      RETURNS SETOF text LANGUAGE plpgsql STABLE PARALLEL SAFE AS %L',
                     'BEGIN RETURN QUERY ' || v_query || '; END');
             END IF;
         END
         $$",
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Whether the database has every migration of this binary applied, each with the checksum of
/// the binary's copy, no failed one, and no repeatable file that this binary would apply: then
/// there is nothing to do, and start-up skips the migrator (and the session advisory lock it
/// takes, which a transaction pooler would break). Simple-protocol statements, safe through a
/// transaction pooler.
pub async fn migrations_up_to_date(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    Ok(versioned_up_to_date(conn).await? && sql_files_up_to_date(conn).await?)
}

/// The versioned half of [`migrations_up_to_date`].
pub async fn versioned_up_to_date(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    let rows = match sqlx::raw_sql("SELECT version, checksum, success FROM _sqlx_migrations")
        .fetch_all(conn)
        .await
    {
        Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("42P01") => {
            return Ok(false);
        }
        rows => rows?,
    };
    let mut applied = std::collections::HashMap::new();
    for row in rows {
        if !row.try_get::<bool, _>("success")? {
            return Ok(false);
        }
        applied.insert(
            row.try_get::<i64, _>("version")?,
            row.try_get::<Vec<u8>, _>("checksum")?,
        );
    }
    Ok(MIGRATOR
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .all(|m| applied.get(&m.version).map(Vec::as_slice) == Some(&*m.checksum)))
}

/// Whether no repeatable file needs applying (see [`apply_sql_files`]).
pub async fn sql_files_up_to_date(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    let recorded = recorded(conn).await?;
    Ok(SQL_FILES
        .iter()
        .all(|(name, text)| !stale(recorded.get(*name), &checksum(text))))
}

/// The statements of SQL text `text`, each without its `;`: split at every `;` outside a quoted
/// string (`'...'`, with `''` inside), a quoted name (`"..."`), a dollar-quoted body
/// (`$$...$$`, `$q$...$q$`) and a comment (`-- ...`, `/* ... */`, not nested). Statements
/// that are only blanks and comments are left out.
fn statements(text: &str) -> Vec<&str> {
    let bytes = text.as_bytes();
    let mut found = Vec::new();
    let (mut start, mut at) = (0, 0);
    let mut code = false;
    while at < bytes.len() {
        let rest = &text[at..];
        let skip = if rest.starts_with("--") {
            rest.find('\n').unwrap_or(rest.len())
        } else if let Some(comment) = rest.strip_prefix("/*") {
            comment.find("*/").map_or(rest.len(), |end| end + 4)
        } else if let Some(quote @ ('\'' | '"')) = rest.chars().next() {
            code = true;
            rest[1..].find(quote).map_or(rest.len(), |end| end + 2)
        } else if let Some(tag) = dollar_tag(rest) {
            code = true;
            rest[tag.len()..]
                .find(tag)
                .map_or(rest.len(), |end| end + 2 * tag.len())
        } else {
            if bytes[at] == b';' {
                if code {
                    found.push(&text[start..at]);
                }
                start = at + 1;
                code = false;
            } else if !bytes[at].is_ascii_whitespace() {
                code = true;
            }
            rest.chars().next().map_or(1, char::len_utf8)
        };
        at += skip;
    }
    if code {
        found.push(&text[start..]);
    }
    found
}

/// The dollar-quote tag `rest` starts with (`$$`, `$body$`), if it starts with one.
fn dollar_tag(rest: &str) -> Option<&str> {
    let body = rest.strip_prefix('$')?;
    let end = body.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))?;
    (body[end..].starts_with('$') && !body[..end].starts_with(|c: char| c.is_ascii_digit()))
        .then(|| &rest[..end + 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_split_at_semicolons_outside_quotes_bodies_and_comments() {
        let text = "-- a comment; not a statement\n\
                    CREATE FUNCTION f() RETURNS text LANGUAGE sql AS $$ SELECT 'a;b' $$;\n\
                    /* x; y */ SELECT 'it''s; one', \"odd;name\" FROM t;\n\
                    DO $q$ BEGIN PERFORM 1; PERFORM $1; END $q$;\n\
                    -- only a comment after the last one;\n";
        assert_eq!(
            statements(text),
            vec![
                "-- a comment; not a statement\n\
                 CREATE FUNCTION f() RETURNS text LANGUAGE sql AS $$ SELECT 'a;b' $$",
                "\n/* x; y */ SELECT 'it''s; one', \"odd;name\" FROM t",
                "\nDO $q$ BEGIN PERFORM 1; PERFORM $1; END $q$",
            ]
        );
    }

    #[test]
    fn every_sql_file_splits_into_whole_statements() {
        // a cut inside a body or a string would leave a part that starts mid-statement or holds
        // half a body
        for (name, text) in SQL_FILES {
            for part in statements(text) {
                let code: String = part
                    .lines()
                    .map(str::trim)
                    .filter(|line| !line.starts_with("--"))
                    .collect::<Vec<_>>()
                    .join(" ");
                let first = code.split_whitespace().next().unwrap_or_default();
                assert!(
                    [
                        "CREATE", "DROP", "DO", "ALTER", "COMMENT", "SELECT", "UPDATE", "INSERT",
                        "DELETE"
                    ]
                    .contains(&first),
                    "{name}: a statement starts with {first:?}: {part}"
                );
                assert_eq!(
                    part.matches("$$").count() % 2,
                    0,
                    "{name}: cut inside a body: {part}"
                );
            }
        }
    }

    #[test]
    fn a_file_is_stale_when_absent_or_changed_unless_a_newer_binary_applied_it() {
        let ours = checksum("CREATE FUNCTION f() ...");
        assert!(stale(None, &ours));
        assert!(!stale(Some(&(ours.clone(), applier_revision())), &ours));
        let theirs = checksum("CREATE FUNCTION f() ... changed");
        assert!(stale(Some(&(theirs.clone(), applier_revision())), &ours));
        assert!(stale(
            Some(&(theirs.clone(), applier_revision() - 1)),
            &ours
        ));
        assert!(!stale(Some(&(theirs, applier_revision() + 1)), &ours));
    }

    #[test]
    fn the_previous_release_leaves_the_files_this_binary_applied_alone() {
        // The previous release decides with a lower revision than ours (an older newest
        // migration, or the same one when only SQL_REVISION was raised): it must not put its
        // older copy back over ours, and ours replaces its copy.
        let ours = checksum("CREATE FUNCTION f(a jsonb, b boolean DEFAULT false) ...");
        let previous = checksum("CREATE FUNCTION f(a jsonb) ...");
        let previous_release = applier_revision() - 1;
        assert!(!stale_for(
            Some(&(ours.clone(), applier_revision())),
            &previous,
            previous_release
        ));
        assert!(stale(Some(&(previous, previous_release)), &ours));
    }

    #[test]
    fn every_sql_file_is_listed_once_and_defines_nothing_twice() {
        let mut names: Vec<_> = SQL_FILES.iter().map(|(n, _)| *n).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), SQL_FILES.len());
        let on_disk: Vec<String> =
            std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../sql"))
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .filter(|n| n.ends_with(".sql"))
                .collect();
        for name in &on_disk {
            assert!(names.contains(&name.as_str()), "{name} is not in SQL_FILES");
        }
        // one definition per function: a name defined in two files would depend on their order
        let mut defined = std::collections::HashMap::new();
        for (file, text) in SQL_FILES {
            for line in text.lines() {
                let line = line.trim_start();
                let Some(rest) = line
                    .strip_prefix("CREATE OR REPLACE FUNCTION ")
                    .or_else(|| line.strip_prefix("CREATE FUNCTION "))
                else {
                    continue;
                };
                let name = rest.split('(').next().unwrap().to_owned();
                if let Some(other) = defined.insert(name.clone(), *file) {
                    panic!("{name} is defined in {other} and {file}");
                }
            }
        }
    }
}
