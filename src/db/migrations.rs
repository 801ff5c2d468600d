//! Schema migrations: plain forward-only SQL files in `migrations/`, compiled into the
//! library and recorded in `skiplock.schema_migrations`.
//!
//! `migrations/0001_schema.sql` is the whole schema, in one file to read (before any
//! release, the earlier files that patched one another were folded into it). From now on
//! migrations only move forward: a change is a new file with the next version, appended
//! to `MIGRATIONS`; an applied file is never edited, and nothing is ever rolled back.
//! `schema/skiplock.sql` is the schema those files produce, as `pg_dump` prints it, and
//! `schema/check.sh` (run by CI) fails when the two disagree.
//!
//! skiplock keeps its own ledger instead of sqlx's `_sqlx_migrations` so that it never
//! collides with the application's own sqlx migrations in the same database.
//!
//! Every statement here runs inside a transaction and unnamed (`persistent(false)`), so
//! `migrate` and the schema check also work through PgBouncer in transaction-pooling
//! mode: the advisory lock is transaction-scoped and the migration holds one transaction.

use sqlx::{Connection, PgConnection, PgPool};

use crate::error::{Error, Result};

/// One migration file.
struct Migration {
    version: i32,
    name: &'static str,
    sql: &'static str,
}

/// Every migration, in order. Append only: an applied migration never changes.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_schema.sql",
        sql: include_str!("../../migrations/0001_schema.sql"),
    },
    Migration {
        version: 2,
        name: "0002_claim_per_queue.sql",
        sql: include_str!("../../migrations/0002_claim_per_queue.sql"),
    },
    Migration {
        version: 3,
        name: "0003_queue_name_not_empty.sql",
        sql: include_str!("../../migrations/0003_queue_name_not_empty.sql"),
    },
    Migration {
        version: 4,
        name: "0004_enqueue_outcome.sql",
        sql: include_str!("../../migrations/0004_enqueue_outcome.sql"),
    },
    Migration {
        version: 5,
        name: "0005_error_time.sql",
        sql: include_str!("../../migrations/0005_error_time.sql"),
    },
    Migration {
        version: 6,
        name: "0006_claim_heartbeat_time.sql",
        sql: include_str!("../../migrations/0006_claim_heartbeat_time.sql"),
    },
    Migration {
        version: 7,
        name: "0007_runnable_notify.sql",
        sql: include_str!("../../migrations/0007_runnable_notify.sql"),
    },
    Migration {
        version: 8,
        name: "0008_queue_name_length.sql",
        sql: include_str!("../../migrations/0008_queue_name_length.sql"),
    },
    Migration {
        version: 9,
        name: "0009_complete_claims.sql",
        sql: include_str!("../../migrations/0009_complete_claims.sql"),
    },
    Migration {
        version: 10,
        name: "0010_claim_skip_in_flight.sql",
        sql: include_str!("../../migrations/0010_claim_skip_in_flight.sql"),
    },
    Migration {
        version: 11,
        name: "0011_claim_hint.sql",
        sql: include_str!("../../migrations/0011_claim_hint.sql"),
    },
];

/// What the ledger names version 1 in a database migrated by a development build from
/// before the migrations were folded into `0001_schema.sql`.
const FIRST_MIGRATION_BEFORE_FOLD: &str = "0001_jobs.sql";

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
        "CREATE SCHEMA IF NOT EXISTS skiplock;
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
    tx.commit().await?;
    Ok(SCHEMA_VERSION_LATEST)
}

/// The highest applied migration, 0 when skiplock was never migrated here.
///
/// # Errors
///
/// [`Error::Database`] if the query fails.
pub async fn schema_version(pool: &PgPool) -> Result<i32> {
    let mut tx = pool.begin().await?;
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
    let (version, first): (Option<i32>, Option<String>) = sqlx::query_as(
        "SELECT max(version), min(name) FILTER (WHERE version = 1)
         FROM skiplock.schema_migrations",
    )
    .persistent(false)
    .fetch_one(&mut *conn)
    .await?;
    // The first migration of the numbering before the fold; its versions mean other
    // schemas than today's.
    if first.as_deref() == Some(FIRST_MIGRATION_BEFORE_FOLD) {
        return Err(Error::SchemaFromBeforeFold {
            found: version.unwrap_or(0),
        });
    }
    Ok(version.unwrap_or(0))
}
