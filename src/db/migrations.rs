//! Schema migrations: plain SQL files in `migrations/`, compiled into the library.
//!
//! Two kinds of file make the schema:
//! - `migrations/NNNN_*.sql`: tables, types, indexes, constraints, and the drop of a
//!   function whose signature changes. Each is applied once, in order, and recorded in
//!   `skiplock.schema_migrations`. `0001_initial.sql` is the schema of 0.1.0; from then on
//!   migrations only move forward: a change is a new file with the next version, appended
//!   to `MIGRATIONS`; an applied file is never edited, and nothing is ever rolled back.
//! - `migrations/functions/`: every function, trigger and view, each defined once with
//!   `CREATE OR REPLACE` (which keeps owners and grants), one area a file. The files are
//!   applied, in the order of their names, after the migrations whenever their text differs
//!   from the one recorded in
//!   `skiplock.schema_functions`, so a changed body is a diff of its own lines, not a copy
//!   in a new migration.
//!
//! `schema/skiplock.sql` is the schema both produce, as `pg_dump` prints it, and
//! `schema/check.sh` (run by CI) fails when they disagree.
//!
//! skiplock keeps its own ledger instead of sqlx's `_sqlx_migrations` so that it never
//! collides with the application's own sqlx migrations in the same database.
//!
//! Every statement here runs inside a transaction and unnamed (`persistent(false)`), so
//! `migrate` and the schema check also work through PgBouncer in transaction-pooling
//! mode: the advisory lock is transaction-scoped and the migration holds one transaction.

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};

use crate::error::{Error, Result};

/// One migration file.
struct Migration {
    version: i32,
    name: &'static str,
    sql: &'static str,
}

/// The columns 0001_initial.sql added last (table, column): a schema at version 1 without
/// one of them was made by a development build from before it, and cannot be upgraded in
/// place. Name here any column added to 0001_initial.sql before 0.1.0 is released; the unit
/// test `the_newest_column_is_the_last_one_of_jobs` fails when a column is added to
/// `skiplock.jobs` after its entry.
const INITIAL_NEWEST_COLUMNS: &[(&str, &str)] = &[
    ("skiplock.jobs", "tracestate"),
    ("skiplock.key_slots_freed", "from_id"),
    ("skiplock.job_id_days", "id_reached"),
    ("skiplock.rate_windows", "hold_pending"),
];

/// Every migration, in order. Append only: an applied migration never changes.
const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "0001_initial.sql",
    sql: include_str!("../../migrations/0001_initial.sql"),
}];

/// Every function, trigger and view, each defined once with `CREATE OR REPLACE`, one area
/// a file (`migrations/functions/`), applied in the order of the file names: applied after
/// the migrations whenever the text differs from the text last applied, so that a changed
/// function body needs no migration. A file added there and not here fails the unit test
/// `every_functions_file_is_applied`.
const FUNCTIONS_SQL: &str = concat!(
    include_str!("../../migrations/functions/01_helpers.sql"),
    include_str!("../../migrations/functions/02_notifications.sql"),
    include_str!("../../migrations/functions/03_unique_keys.sql"),
    include_str!("../../migrations/functions/04_dependencies_and_lanes.sql"),
    include_str!("../../migrations/functions/05_enqueue.sql"),
    include_str!("../../migrations/functions/06_global_limits.sql"),
    include_str!("../../migrations/functions/07_claim.sql"),
    include_str!("../../migrations/functions/08_outcomes.sql"),
    include_str!("../../migrations/functions/09_cron.sql"),
    include_str!("../../migrations/functions/10_protocol.sql"),
    include_str!("../../migrations/functions/11_operator.sql"),
    include_str!("../../migrations/functions/12_history_and_retention.sql"),
    include_str!("../../migrations/functions/13_views.sql"),
    include_str!("../../migrations/functions/14_awaited_outcomes.sql"),
    include_str!("../../migrations/functions/15_partitions.sql"),
);

/// The schema version this build of skiplock expects.
pub const SCHEMA_VERSION_LATEST: i32 = MIGRATIONS[MIGRATIONS.len() - 1].version;

/// The statement_timeout a migration sets for its own transaction when the server's is
/// shorter (an interval as Postgres reads it).
const MIGRATION_STATEMENT_TIMEOUT: &str = "15min";

/// Advisory lock key that serialises concurrent migrators ("skiplock" in ASCII, truncated).
const MIGRATION_LOCK_KEY: i64 = 0x736b_6970_6c6f_636b;

/// Applies every migration not yet applied, all in one transaction: either the schema
/// reaches [`SCHEMA_VERSION_LATEST`] or it stays as it was. Safe to run concurrently and
/// repeatedly.
///
/// # Errors
///
/// [`Error::SchemaTooNew`] if a newer skiplock already migrated this database,
/// [`Error::Migration`] if a file fails, [`Error::Database`] if Postgres is unreachable.
pub async fn migrations_apply(pool: &PgPool) -> Result<i32> {
    // DDL on skiplock.jobs locks the parent table, then its partitions; a running claim or
    // heartbeat that writes jobs_live directly may lock jobs_live, then the parent (to
    // check the partition's constraint after its cached copy was invalidated). Postgres
    // ends such a cycle by rolling one side back; when that is the migration, nothing of
    // it was kept, and it runs again.
    let mut attempt = 1;
    loop {
        match migrations_apply_once(pool).await {
            Err(error) if attempt < MIGRATION_DEADLOCK_ATTEMPTS && is_deadlock(&error) => {
                tracing::info!(
                    attempt,
                    "the migration was a deadlock's victim; running it again"
                );
                tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt))).await;
                attempt += 1;
            }
            result => return result,
        }
    }
}

/// Times a migration chosen as a deadlock's victim runs in all.
const MIGRATION_DEADLOCK_ATTEMPTS: u32 = 5;

/// Whether a migration failed as a deadlock's victim (SQLSTATE 40P01), and was rolled back.
fn is_deadlock(error: &Error) -> bool {
    let source = match error {
        Error::Database(source) | Error::Migration { source, .. } => source,
        _ => return false,
    };
    matches!(source, sqlx::Error::Database(db) if db.code().as_deref() == Some("40P01"))
}

/// One attempt of [`migrations_apply`], in one transaction.
async fn migrations_apply_once(pool: &PgPool) -> Result<i32> {
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin().await?;
    // A migration may legitimately run longer than a statement_timeout the database's
    // owner set for short queries (an index built on a full table): its own bound, for
    // this transaction only, when the server's is shorter. Not lock_timeout: a migration
    // queued behind running workers' locks should give up as the owner wants, and
    // [`Error::Migration`] says which setting stopped it.
    sqlx::query(
        "SELECT set_config('statement_timeout', $1, true) \
         WHERE current_setting('statement_timeout')::interval <> interval '0' \
           AND current_setting('statement_timeout')::interval < $1::interval",
    )
    .bind(MIGRATION_STATEMENT_TIMEOUT)
    .persistent(false)
    .execute(&mut *tx)
    .await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATION_LOCK_KEY)
        .persistent(false)
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql(
        // Not CREATE SCHEMA IF NOT EXISTS: Postgres checks that against CREATE on the
        // database even when the schema exists, which a migrating role that owns only
        // the schema lacks (docs/operating.md, "Least privilege").
        "DO $$ BEGIN
             IF to_regnamespace('skiplock') IS NULL THEN
                 CREATE SCHEMA skiplock;
             END IF;
         END $$;
         CREATE TABLE IF NOT EXISTS skiplock.schema_migrations (
             version    int PRIMARY KEY,
             name       text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );",
    )
    .execute(&mut *tx)
    .await?;
    let current = schema_version_in(&mut tx).await?;
    if current > SCHEMA_VERSION_LATEST {
        return Err(Error::SchemaTooNew {
            found: current,
            supported: SCHEMA_VERSION_LATEST,
        });
    }
    for migration in MIGRATIONS.iter().filter(|m| m.version > current) {
        let failed = |source| Error::Migration {
            version: migration.version,
            name: migration.name,
            previous: current,
            source,
        };
        sqlx::raw_sql(migration.sql)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        sqlx::query("INSERT INTO skiplock.schema_migrations (version, name) VALUES ($1, $2)")
            .bind(migration.version)
            .bind(migration.name)
            .persistent(false)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
    }
    functions_apply(&mut tx, current).await?;
    tx.commit().await?;
    Ok(SCHEMA_VERSION_LATEST)
}

/// Applies the functions (`migrations/functions/`) unless the text last applied is the same (by its
/// md5, computed by the server), and records it with this build's version.
///
/// Replacing the trigger definitions takes a lock on `skiplock.jobs` that waits for running
/// writes, so an unchanged file is not applied again: a `migrate` at every start of every
/// process costs one read. A build older than the one that applied the functions last
/// leaves them alone (its bodies would undo the newer ones); it may still run on them, as a
/// worker of an older version runs on a newer schema.
async fn functions_apply(conn: &mut PgConnection, previous: i32) -> Result<()> {
    let failed = |source| Error::Migration {
        version: SCHEMA_VERSION_LATEST,
        name: "functions/",
        previous,
        source,
    };
    let recorded: Option<(bool, String)> =
        sqlx::query_as("SELECT md5 = md5($1), skiplock_version FROM skiplock.schema_functions")
            .bind(FUNCTIONS_SQL)
            .persistent(false)
            .fetch_optional(&mut *conn)
            .await
            .map_err(failed)?;
    if let Some((same, applied_by)) = recorded
        && (same || version_newer(&applied_by, env!("CARGO_PKG_VERSION")))
    {
        return Ok(());
    }
    sqlx::raw_sql(FUNCTIONS_SQL)
        .execute(&mut *conn)
        .await
        .map_err(failed)?;
    sqlx::query(
        "INSERT INTO skiplock.schema_functions (md5, skiplock_version) VALUES (md5($1), $2)
         ON CONFLICT (singleton) DO UPDATE
         SET md5 = EXCLUDED.md5, skiplock_version = EXCLUDED.skiplock_version,
             applied_at = now()",
    )
    .bind(FUNCTIONS_SQL)
    .bind(env!("CARGO_PKG_VERSION"))
    .persistent(false)
    .execute(&mut *conn)
    .await
    .map_err(failed)?;
    Ok(())
}

/// Whether version `a` (`major.minor.patch`, any pre-release suffix ignored) is newer than
/// `b`. A version that does not parse is not newer.
fn version_newer(a: &str, b: &str) -> bool {
    fn parse(v: &str) -> Option<(u64, u64, u64)> {
        let core = v.split(['-', '+']).next()?;
        let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
        Some((parts.next()??, parts.next()??, parts.next()??))
    }
    matches!((parse(a), parse(b)), (Some(a), Some(b)) if a > b)
}

/// The highest applied migration, 0 when skiplock was never migrated here. Takes a pool
/// or a connection.
///
/// # Errors
///
/// [`Error::Database`] if the query fails.
pub async fn schema_version<'c>(
    db: impl sqlx::Acquire<'c, Database = sqlx::Postgres>,
) -> Result<i32> {
    let mut tx = db.begin().await?;
    let version = schema_version_in(&mut tx).await?;
    tx.commit().await?;
    Ok(version)
}

async fn schema_version_in(conn: &mut PgConnection) -> Result<i32> {
    let exists: bool =
        sqlx::query_scalar("SELECT to_regclass('skiplock.schema_migrations') IS NOT NULL")
            .persistent(false)
            .fetch_one(&mut *conn)
            .await?;
    if !exists {
        return Ok(0);
    }
    // The ledger and, in the same statement, whether the newest column of
    // 0001_initial.sql is there (see below).
    let (tables, columns): (Vec<&str>, Vec<&str>) = INITIAL_NEWEST_COLUMNS.iter().copied().unzip();
    let (version, first, complete): (Option<i32>, Option<String>, bool) = sqlx::query_as(
        "SELECT max(version), min(name) FILTER (WHERE version = 1),
                (SELECT bool_and(EXISTS (SELECT FROM pg_attribute
                                         WHERE attrelid = to_regclass(c.t) AND attname = c.a
                                           AND NOT attisdropped))
                 FROM unnest($1::text[], $2::text[]) AS c(t, a))
         FROM skiplock.schema_migrations",
    )
    .bind(&tables)
    .bind(&columns)
    .persistent(false)
    .fetch_one(&mut *conn)
    .await?;
    // A first migration of another name was made by a development build from before the
    // migrations were folded into 0.1.0's; its versions mean other schemas than today's.
    // And until 0.1.0 is released its schema is still written in 0001_initial.sql: a
    // column added there reaches no database a development build migrated before, which
    // is refused as well rather than given functions that name columns it lacks (every
    // enqueue and claim would fail).
    if first
        .as_deref()
        .is_some_and(|name| name != MIGRATIONS[0].name)
        || (version.is_some_and(|v| v >= 1) && !complete)
    {
        return Err(Error::SchemaFromBeforeFold {
            found: version.unwrap_or(0),
        });
    }
    Ok(version.unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::{FUNCTIONS_SQL, INITIAL_NEWEST_COLUMNS, MIGRATIONS, version_newer};

    #[test]
    fn the_newest_column_is_the_last_one_of_jobs() {
        // The column lines of `CREATE TABLE skiplock.jobs (`, up to its first constraint.
        let sql = MIGRATIONS[0].sql;
        let start = sql
            .find("CREATE TABLE skiplock.jobs (")
            .expect("jobs is made");
        let last = sql[start..]
            .lines()
            .skip(1)
            .map(str::trim)
            .take_while(|line| !line.starts_with("CONSTRAINT"))
            .filter(|line| !line.is_empty() && !line.starts_with("--"))
            .last()
            .and_then(|line| line.split_whitespace().next())
            .expect("jobs has columns");
        assert!(
            INITIAL_NEWEST_COLUMNS.contains(&("skiplock.jobs", last)),
            "a column was added to skiplock.jobs in 0001_initial.sql: name it in \
             INITIAL_NEWEST_COLUMNS, so that a database migrated before it is refused"
        );
    }

    #[test]
    fn every_functions_file_is_applied() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/functions");
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        let mut rest = FUNCTIONS_SQL;
        for name in names {
            let text = std::fs::read_to_string(format!("{dir}/{name}")).unwrap();
            let at = rest.find(&text).unwrap_or_else(|| {
                panic!("migrations/functions/{name} is not in FUNCTIONS_SQL, in file-name order")
            });
            rest = &rest[at + text.len()..];
        }
    }

    #[test]
    fn versions_compare_by_number_not_text() {
        assert!(version_newer("0.10.0", "0.9.1"));
        assert!(version_newer("1.0.0", "0.99.99"));
        assert!(!version_newer("0.1.0", "0.1.0"));
        assert!(!version_newer("0.1.0", "0.2.0"));
        assert!(!version_newer("0.2.0-rc.1", "0.2.0"));
        assert!(!version_newer("garbage", "0.1.0"));
    }
}
