//! The operator's other reads: a job's state and dependencies, counts by state, and the
//! per-hour and per-day history that survives pruning (what `skiplock show`, `stats` and
//! the dashboard read), for tools of your own. None of them can take or settle a claim:
//! what only a worker may do (claim, heartbeat, complete, reap) is not public. Fetching,
//! listing, retrying and cancelling jobs and pausing queues are at the crate root
//! ([`job`](crate::job()), [`jobs`](crate::jobs), [`retry`](crate::retry),
//! [`cancel`](crate::cancel), [`pause_queue`](crate::pause_queue), …) and in the schema as
//! SQL functions. [`prune`] removes finished jobs past a retention now, as each worker's
//! pruner does on its own.

use sqlx::PgExecutor;

use crate::db;
use crate::error::Result;
use crate::state::{JobId, JobState};

pub use crate::db::admin::DependencyRow;
pub use crate::db::history::{Granularity, HistoryFilter, HistoryRow, HistoryTotals};
pub use crate::maintenance::pruner::Pruned;

/// The state of one job, `None` if it does not exist (a cheaper read than
/// [`job`](crate::job())).
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the query fails.
pub async fn job_state(db: impl PgExecutor<'_>, id: JobId) -> Result<Option<JobState>> {
    Ok(db::admin::jobs_get_state(db, id).await?)
}

/// The jobs `id` depends on (its parents, deleted ones included) and the jobs that depend
/// on it (its dependants), each with its current state, parents first, by id.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the query fails.
pub async fn job_dependencies(db: impl PgExecutor<'_>, id: JobId) -> Result<Vec<DependencyRow>> {
    Ok(db::admin::job_dependencies_of(db, id).await?)
}

/// Why a job that has not finished is not running now, in words (its lane, its parents,
/// its schedule, a paused queue, a global limit, or no free worker yet); `None` for a
/// running or finished job or none by that id. Same as `SELECT skiplock.why_not_running(id)`.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the query fails.
pub async fn why_not_running(db: impl PgExecutor<'_>, id: JobId) -> Result<Option<String>> {
    Ok(db::admin::jobs_why_not_running(db, id).await?)
}

/// How many jobs are in each state, every state listed (zero included), in the order of
/// the states.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the query fails.
pub async fn counts_by_state(db: impl PgExecutor<'_>) -> Result<Vec<(JobState, i64)>> {
    Ok(db::jobs::jobs_count_by_state(db).await?)
}

/// History per bucket (hour or day), queue and kind since `filter.since`, oldest bucket
/// first: what the pruner rolled up plus the finished jobs not pruned yet.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the query fails.
pub async fn history(db: impl PgExecutor<'_>, filter: &HistoryFilter) -> Result<Vec<HistoryRow>> {
    Ok(db::history::job_history_list(db, filter).await?)
}

/// Lifetime totals per queue and kind (the whole rollup plus every retained finished job),
/// by queue then kind. It reads every retained finished job, so its cost follows the
/// retention.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the query fails.
pub async fn history_totals(db: impl PgExecutor<'_>) -> Result<Vec<HistoryTotals>> {
    Ok(db::history::job_history_totals(db).await?)
}

/// Removes finished jobs past `retention` now, as every worker's pruner does each
/// `prune_interval`: days of finished jobs all past retention are dropped whole, the rest
/// due (under a retention shorter than a day, or rows written outside any day) deleted in
/// batches, and all of it added to the history first (see [`Retention`](crate::Retention)).
/// Safe beside running workers and their pruners, and behind PgBouncer in transaction
/// mode (no named prepared statements).
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the database cannot be reached or
/// refuses the pass; a day that is busy now is left for a later call and counted in
/// [`Pruned::days_left`].
pub async fn prune(pool: &sqlx::PgPool, retention: crate::Retention) -> Result<Pruned> {
    let pool = crate::DbPool::direct(pool.clone());
    let never = tokio_util::sync::CancellationToken::new();
    Ok(crate::maintenance::pruner::prune_finished(&pool, retention, &never).await?)
}
