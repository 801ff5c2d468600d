//! The days of finished jobs (`migrations/functions/15_partitions.sql`, which owns the
//! layout of `skiplock.jobs`): made ahead, listed when past retention, locked and dropped
//! whole by the pruner (`src/maintenance/pruner.rs`). Each statement is unnamed: the days
//! change every day, and a plan cached over yesterday's tables would not know today's.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};

/// A day partition of `skiplock.jobs_done`: the jobs that finished in `state` within
/// `[starts, ends)`.
#[derive(Debug, Clone, FromRow)]
pub struct DonePartition {
    /// Its table's name, in the `skiplock` schema (`jobs_done_succeeded_20261127`).
    pub leaf: String,
    /// The finished state of its rows, as Postgres spells it.
    pub state: String,
    /// The first instant it holds (midnight UTC).
    pub starts: DateTime<Utc>,
    /// The first instant past it (the next midnight UTC).
    pub ends: DateTime<Utc>,
}

/// Makes the day partitions of `skiplock.jobs_done` for today and the next two days (UTC)
/// that do not exist yet; returns how many it made. A day busy now is made at a later
/// call (`skiplock.internal_prepare_done_partitions`).
pub async fn done_partitions_prepare(db: impl PgExecutor<'_>) -> sqlx::Result<i32> {
    sqlx::query_scalar("SELECT skiplock.internal_prepare_done_partitions()")
        .persistent(false)
        .fetch_one(db)
        .await
}

/// The day partitions all of whose rows are past their state's retention (milliseconds),
/// oldest first.
pub async fn done_partitions_expired(
    db: impl PgExecutor<'_>,
    succeeded_ms: i64,
    cancelled_ms: i64,
    dead_ms: i64,
) -> sqlx::Result<Vec<DonePartition>> {
    sqlx::query_as(
        "SELECT leaf, state::text AS state, starts, ends
         FROM skiplock.internal_expired_done_partitions($1, $2, $3)",
    )
    .bind(succeeded_ms)
    .bind(cancelled_ms)
    .bind(dead_ms)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// Locks the day partition `leaf` against writes until the transaction ends, waiting at
/// most 100 ms (`lock_not_available` when busy); false when it is gone already (another
/// pruner dropped it).
pub async fn done_partition_lock(db: impl PgExecutor<'_>, leaf: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar("SELECT skiplock.internal_lock_done_partition($1)")
        .bind(leaf)
        .persistent(false)
        .fetch_one(db)
        .await
}

/// Drops the day partition `leaf` after settling the edges of its jobs
/// (`skiplock.internal_drop_done_partition`), waiting at most 100 ms for each lock.
pub async fn done_partition_drop(db: impl PgExecutor<'_>, leaf: &str) -> sqlx::Result<()> {
    sqlx::query("SELECT skiplock.internal_drop_done_partition($1)")
        .bind(leaf)
        .persistent(false)
        .execute(db)
        .await?;
    Ok(())
}
