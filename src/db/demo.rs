//! The statements of `skiplock demo` (feature `cli`): the one job it enqueues with plain
//! SQL, as another language would, and the demo's own database (named by `demo
//! --database`, [`DEMO_DATABASE`] by default), which it drops and creates again at each run
//! but never one it did not create.

use sqlx::{PgConnection, PgExecutor, PgPool};

/// The database the demo creates (and drops at its next run) unless told another.
pub const DEMO_DATABASE: &str = "skiplock_demo";

/// `name` as an SQL identifier, double-quoted.
fn quoted(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The comment that marks the demo's database as its own, so that the demo drops only
/// what it created.
pub const DEMO_MARK: &str = "created by skiplock demo; dropped and recreated by each run";

/// The plain-SQL enqueue the demo runs and prints: `skiplock.enqueue(kind, args)`, the
/// function other languages call.
pub const ENQUEUE_BY_SQL_FUNCTION: &str = "SELECT skiplock.enqueue('sleep', '{\"ms\": 50}')";

/// Runs [`ENQUEUE_BY_SQL_FUNCTION`]: one `sleep` job of 50 ms; returns its id.
pub async fn jobs_enqueue_by_sql_function(db: impl PgExecutor<'_>) -> sqlx::Result<i64> {
    sqlx::query_scalar(ENQUEUE_BY_SQL_FUNCTION)
        .fetch_one(db)
        .await
}

/// The comment on database `name`: `None` when no such database exists, `Some(None)` when
/// it has no comment.
pub async fn demo_database_comment(
    db: impl PgExecutor<'_>,
    name: &str,
) -> sqlx::Result<Option<Option<String>>> {
    sqlx::query_scalar(
        "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = $1",
    )
    .bind(name)
    .fetch_optional(db)
    .await
}

/// Drops database `name`, closing its sessions. The caller checks first that it is the
/// demo's ([`demo_database_comment`]).
pub async fn demo_database_drop(db: impl PgExecutor<'_>, name: &str) -> sqlx::Result<()> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {} WITH (FORCE)",
        quoted(name)
    )))
    .execute(db)
    .await?;
    Ok(())
}

/// Creates database `name` and marks it with [`DEMO_MARK`]. Two statements: `CREATE
/// DATABASE` cannot share an implicit transaction.
pub async fn demo_database_create(db: &PgPool, name: &str) -> sqlx::Result<()> {
    for statement in [
        format!("CREATE DATABASE {}", quoted(name)),
        format!("COMMENT ON DATABASE {} IS '{DEMO_MARK}'", quoted(name)),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(db)
            .await?;
    }
    Ok(())
}

/// How many tables, views and foreign tables the connected database holds outside the
/// `skiplock` schema and the system's: none in what a demo of an earlier version (which
/// left no mark) created.
pub async fn database_tables_outside_skiplock(db: &mut PgConnection) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f') AND n.nspname <> 'skiplock'
           AND n.nspname NOT IN ('pg_catalog', 'information_schema')
           AND n.nspname NOT LIKE 'pg_toast%'",
    )
    .fetch_one(db)
    .await
}
