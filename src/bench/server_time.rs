//! Server time per operation: what each claim and release costs the database itself,
//! apart from round trips and the client.
//!
//! From `pg_stat_statements` when the server has it loaded (it needs
//! `shared_preload_libraries`, so a default server does not): the run snapshots the view before
//! and after each mode and reports the differences, the statements of this database only. The
//! differences say the same as a reset before each mode would, without wiping the statistics
//! other users of the server keep. When the extension is loaded but not created in the
//! database, the run creates it and drops it again afterwards (the statistics live in shared
//! memory and stay).
//!
//! What `pg_stat_statements` counts: execution of top-level statements (a PL/pgSQL function's
//! whole call, not its inner statements), planning only with `pg_stat_statements.track_planning`;
//! not the commit, whose WAL flush happens after the statement has finished.
//!
//! For the Redis baseline: `INFO commandstats` (EVALSHA's calls and microseconds on the server,
//! the two scripts together).

use std::collections::HashMap;

use sqlx::{AssertSqlSafe, Row};

use credpool::store::Db;

/// Whether `pg_stat_statements` can be read on this database.
#[derive(Debug, Clone)]
pub(super) enum Source {
    /// Readable as `{schema}.pg_stat_statements`.
    PgStatStatements {
        /// The view's schema, quoted.
        schema: String,
        /// This run created the extension (and drops it at the end).
        created: bool,
    },
    /// Not available, and why.
    Unavailable(String),
}

impl Source {
    /// One line for the report.
    pub(super) fn describe(&self) -> String {
        match self {
            Source::PgStatStatements { created: false, .. } => "pg_stat_statements".to_owned(),
            Source::PgStatStatements { created: true, .. } => {
                "pg_stat_statements (extension created for the run, dropped after it)".to_owned()
            }
            Source::Unavailable(why) => format!("pg_stat_statements unavailable: {why}"),
        }
    }
}

/// Finds out whether `pg_stat_statements` is usable, creating the extension in this database if
/// the server has it loaded but the database lacks it. Never fails: a reason comes back instead.
pub(super) async fn detect(db: &Db) -> Source {
    match try_detect(db).await {
        Ok(source) => source,
        Err(error) => Source::Unavailable(format!("could not be checked: {error}")),
    }
}

async fn try_detect(db: &Db) -> Result<Source, sqlx::Error> {
    let pool = db.pool();
    let available: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'pg_stat_statements')",
    )
    .fetch_one(pool)
    .await?;
    if !available {
        return Ok(Source::Unavailable(
            "not installed on the server (not in pg_available_extensions)".to_owned(),
        ));
    }
    let loaded: bool = sqlx::query_scalar(
        "SELECT 'pg_stat_statements' = ANY (string_to_array(
                    translate(current_setting('shared_preload_libraries'), ' \"', ''), ','))",
    )
    .fetch_one(pool)
    .await?;
    if !loaded {
        return Ok(Source::Unavailable(
            "installed but not loaded: it needs shared_preload_libraries = 'pg_stat_statements' \
             and a server restart"
                .to_owned(),
        ));
    }
    let schema_of = || {
        sqlx::query_scalar::<_, String>(
            "SELECT quote_ident(extnamespace::regnamespace::text)
             FROM pg_extension WHERE extname = 'pg_stat_statements'",
        )
        .fetch_optional(pool)
    };
    let (schema, created) = match schema_of().await? {
        Some(schema) => (schema, false),
        None => {
            if let Err(error) = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                .execute(pool)
                .await
            {
                return Ok(Source::Unavailable(format!(
                    "loaded, but not created in this database, and CREATE EXTENSION failed: {error}"
                )));
            }
            (
                schema_of().await?.unwrap_or_else(|| "public".to_owned()),
                true,
            )
        }
    };
    let source = Source::PgStatStatements { schema, created };
    if let Err(error) = snapshot(db, &source).await {
        return Ok(Source::Unavailable(format!(
            "loaded, but its view cannot be read: {error}"
        )));
    }
    Ok(source)
}

/// Drops the extension if this run created it.
pub(super) async fn cleanup(db: &Db, source: &Source) -> Result<(), sqlx::Error> {
    if let Source::PgStatStatements { created: true, .. } = source {
        sqlx::query("DROP EXTENSION IF EXISTS pg_stat_statements")
            .execute(db.pool())
            .await?;
    }
    Ok(())
}

/// One statement's totals in a snapshot.
#[derive(Debug, Clone, Default)]
struct Totals {
    query: String,
    calls: i64,
    rows: i64,
    /// Milliseconds.
    exec: f64,
    /// Milliseconds.
    plan: f64,
}

/// The view's totals for this database, by (userid, queryid).
#[derive(Debug, Clone, Default)]
pub(super) struct Snapshot(HashMap<(i64, i64), Totals>);

/// The view's totals for this database now (empty when the source is unavailable).
pub(super) async fn snapshot(db: &Db, source: &Source) -> Result<Snapshot, sqlx::Error> {
    let Source::PgStatStatements { schema, .. } = source else {
        return Ok(Snapshot::default());
    };
    // the schema comes from the catalog, quoted by quote_ident
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT userid::bigint AS userid, queryid, min(query) AS query,
                sum(calls)::bigint AS calls, sum(rows)::bigint AS rows,
                sum(total_exec_time)::float8 AS exec, sum(total_plan_time)::float8 AS plan
         FROM {schema}.pg_stat_statements
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND queryid IS NOT NULL
         GROUP BY userid, queryid"
    )))
    .fetch_all(db.pool())
    .await?;
    let mut totals = HashMap::with_capacity(rows.len());
    for row in rows {
        totals.insert(
            (row.try_get("userid")?, row.try_get("queryid")?),
            Totals {
                query: row
                    .try_get::<Option<String>, _>("query")?
                    .unwrap_or_default(),
                calls: row.try_get("calls")?,
                rows: row.try_get("rows")?,
                exec: row.try_get("exec")?,
                plan: row.try_get("plan")?,
            },
        );
    }
    Ok(Snapshot(totals))
}

/// The server time one statement took during a mode.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StatementTime {
    /// `claim`, `release`, `claim + release` (Redis: one command runs both scripts) or `other`.
    pub operation: &'static str,
    /// The statement, shortened.
    pub statement: String,
    /// Times it ran.
    pub calls: i64,
    /// Rows it returned or changed, summed (a group claim returns one row per claim); `None`
    /// where the source does not count them.
    pub rows: Option<i64>,
    /// Mean server time per call, milliseconds (execution, plus planning where counted).
    pub ms_per_call: f64,
}

/// The server time of one operation during a mode.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OperationTime {
    /// `claim` or `release`.
    pub operation: &'static str,
    /// How many operations: claims or releases (rows of a group statement, calls of a
    /// one-at-a-time one).
    pub count: i64,
    /// Server time of the operation's statements per operation, milliseconds.
    pub ms_per_operation: f64,
}

/// What a mode cost the server.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ServerTime {
    /// `pg_stat_statements` or `redis commandstats`.
    pub source: &'static str,
    /// Per claim and per release.
    pub operations: Vec<OperationTime>,
    /// The claim and release statements, and the costliest others.
    pub statements: Vec<StatementTime>,
    /// Server time of every statement of the mode in this database (or every EVALSHA) per
    /// completed cycle, warm-up included, milliseconds.
    pub ms_per_cycle: Option<f64>,
}

/// How a statement of an allocator is recognized, and what counts one operation.
struct Kind {
    operation: &'static str,
    matches: fn(&str) -> bool,
    /// One operation per returned row (a group statement) rather than per call.
    per_row: bool,
    /// The statement that counts the operations (others of the same operation add time only).
    counts: bool,
}

const KINDS: &[Kind] = &[
    Kind {
        operation: "claim",
        matches: |q| q.contains("credpool_claim("),
        per_row: true,
        counts: true,
    },
    Kind {
        operation: "release",
        matches: |q| q.contains("credpool_release("),
        per_row: true,
        counts: true,
    },
    Kind {
        operation: "claim",
        matches: |q| q.starts_with("UPDATE slots s SET lease_id"),
        per_row: false,
        counts: true,
    },
    Kind {
        operation: "release",
        // pg_stat_statements shows its NULLs as parameters: `SET lease_id = $5, ...`
        matches: |q| q.starts_with("UPDATE slots SET lease_id"),
        per_row: false,
        counts: true,
    },
];

/// Other statements listed per mode, costliest first.
const OTHERS_LISTED: usize = 3;

fn shortened(query: &str) -> String {
    let words: Vec<&str> = query.split_whitespace().collect();
    let mut text = words.join(" ");
    if text.len() > 72 {
        let mut end = 71;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// The differences between two snapshots: the statements of one mode. `cycles` counts every
/// cycle the mode completed, warm-up included.
pub(super) fn between(before: &Snapshot, after: &Snapshot, cycles: u64) -> ServerTime {
    let mut matched: Vec<(&Kind, StatementTime, f64)> = Vec::new();
    let mut others: Vec<(StatementTime, f64)> = Vec::new();
    let mut total = 0.0;
    for (id, now) in &after.0 {
        let then = before.0.get(id).cloned().unwrap_or_default();
        let calls = now.calls - then.calls;
        if calls <= 0 || now.query.contains("pg_stat_statements") {
            continue;
        }
        let ms = (now.exec - then.exec) + (now.plan - then.plan);
        total += ms;
        let time = StatementTime {
            operation: "other",
            statement: shortened(&now.query),
            calls,
            rows: Some(now.rows - then.rows),
            ms_per_call: ms / calls as f64,
        };
        let query = now.query.trim_start();
        match KINDS.iter().find(|kind| (kind.matches)(query)) {
            Some(kind) => matched.push((
                kind,
                StatementTime {
                    operation: kind.operation,
                    ..time
                },
                ms,
            )),
            None => others.push((time, ms)),
        }
    }
    let mut operations = Vec::new();
    for operation in ["claim", "release"] {
        let of_it = || matched.iter().filter(|(k, ..)| k.operation == operation);
        let count: i64 = of_it()
            .filter(|(k, ..)| k.counts)
            .map(|(k, s, _)| {
                if k.per_row {
                    s.rows.unwrap_or(0)
                } else {
                    s.calls
                }
            })
            .sum();
        if count > 0 {
            operations.push(OperationTime {
                operation,
                count,
                ms_per_operation: of_it().map(|(.., ms)| ms).sum::<f64>() / count as f64,
            });
        }
    }
    // claims first, then releases, each costliest first
    matched.sort_by(|a, b| {
        (a.0.operation != "claim")
            .cmp(&(b.0.operation != "claim"))
            .then(b.2.total_cmp(&a.2))
    });
    others.sort_by(|a, b| b.1.total_cmp(&a.1));
    let statements = matched
        .into_iter()
        .map(|(_, s, _)| s)
        .chain(others.into_iter().take(OTHERS_LISTED).map(|(s, _)| s))
        .collect();
    ServerTime {
        source: "pg_stat_statements",
        operations,
        statements,
        ms_per_cycle: (cycles > 0).then(|| total / cycles as f64),
    }
}

/// The Redis baseline's server time from two readings of EVALSHA's `(calls, usec)`.
pub(super) fn between_redis(before: (u64, u64), after: (u64, u64), cycles: u64) -> ServerTime {
    let calls = after.0.saturating_sub(before.0);
    let ms = after.1.saturating_sub(before.1) as f64 / 1000.0;
    ServerTime {
        source: "redis commandstats",
        operations: Vec::new(),
        statements: vec![StatementTime {
            operation: "claim + release",
            statement: "EVALSHA (the ALLOCATE and RELEASE scripts)".to_owned(),
            calls: calls as i64,
            rows: None,
            ms_per_call: if calls > 0 { ms / calls as f64 } else { 0.0 },
        }],
        ms_per_cycle: (cycles > 0).then(|| ms / cycles as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(entries: &[(i64, &str, i64, i64, f64)]) -> Snapshot {
        Snapshot(
            entries
                .iter()
                .map(|&(id, query, calls, rows, exec)| {
                    (
                        (10, id),
                        Totals {
                            query: query.to_owned(),
                            calls,
                            rows,
                            exec,
                            plan: 0.0,
                        },
                    )
                })
                .collect(),
        )
    }

    #[test]
    fn group_claims_and_releases_count_per_row() {
        let before = snapshot(&[(1, "SELECT claim FROM credpool_claim($1)", 5, 10, 4.0)]);
        let after = snapshot(&[
            (1, "SELECT claim FROM credpool_claim($1)", 15, 50, 24.0),
            (
                2,
                "SELECT release FROM credpool_release($1, $2)",
                10,
                40,
                16.0,
            ),
            (4, "SELECT credpool_announce_freed($1)", 10, 10, 0.5),
            (5, "SELECT * FROM pg_stat_statements", 1, 1, 9.0),
        ]);
        let time = between(&before, &after, 40);
        let claim = &time.operations[0];
        assert_eq!((claim.operation, claim.count), ("claim", 40));
        assert!((claim.ms_per_operation - 0.5).abs() < 1e-9);
        let release = &time.operations[1];
        assert_eq!((release.operation, release.count), ("release", 40));
        assert!((release.ms_per_operation - 0.4).abs() < 1e-9);
        // everything but the snapshot's own query, per cycle
        assert!((time.ms_per_cycle.unwrap() - 36.5 / 40.0).abs() < 1e-9);
        assert!(
            time.statements
                .iter()
                .any(|s| s.statement.contains("credpool_announce_freed"))
        );
    }

    #[test]
    fn one_statement_claims_count_per_call() {
        let after = snapshot(&[
            (
                1,
                "UPDATE slots s SET lease_id = $1, lease_until = now() + $2",
                100,
                90,
                30.0,
            ),
            (
                2,
                "UPDATE slots SET lease_id = $5, lease_until = $6 WHERE",
                90,
                90,
                9.0,
            ),
        ]);
        let time = between(&Snapshot::default(), &after, 90);
        assert_eq!(time.operations[0].count, 100);
        assert!((time.operations[0].ms_per_operation - 0.3).abs() < 1e-9);
        assert_eq!(time.operations[1].count, 90);
        assert!((time.operations[1].ms_per_operation - 0.1).abs() < 1e-9);
    }
}
