//! The pruner: removes finished jobs past their retention without ever blocking claims
//! or completions, and keeps their numbers in the history rollup
//! (`skiplock.job_history`); hourly history older than a year is folded into lifetime
//! totals.
//!
//! Finished jobs are stored a day per partition (`skiplock.jobs_done_<state>_<yyyymmdd>`,
//! see migrations/0001_initial.sql). Under a retention of a day or more, a day goes whole
//! once every job in it is past retention: the pruner locks the day against writes, rolls
//! it up, and drops its table (`skiplock.internal_drop_done_partition` settles what other
//! jobs knew of it first), so no row is deleted and no dead tuple is left anywhere. A job
//! is then kept at least its retention and at most a day longer. What no day holds (rows
//! of `skiplock.jobs_done_default`, and every finished row under a retention shorter than
//! a day) is deleted in small batches that skip locked rows, each added to the rollup in
//! the same statement.
//!
//! When a batch fails for a reason a retry will not change (one row whose numbers the
//! rollup cannot read, say an `errors` list written by hand), the pruner deletes the due
//! jobs one at a time; a job that still cannot be rolled up is deleted without its
//! history, logged with its id. One row never stops pruning. A day that is busy (a lock
//! not granted within 100 ms: a long transaction reading it) is dropped at a later pass.

use std::sync::Arc;
use std::time::Duration;

use crate::DbPool;
use crate::db::history::{
    HISTORY_RETENTION_DEFAULT, job_history_prune_expired, job_history_roll_up_finished_between,
    jobs_delete_rolled_up, jobs_prune_finished_rolled_up,
};
use crate::db::maintenance::{jobs_delete_finished_unrolled, jobs_list_prunable};
use crate::db::partitions::{
    DonePartition, done_partition_drop, done_partition_lock, done_partitions_expired,
    done_partitions_prepare,
};
use crate::enqueue::duration_ms;
use crate::error::{describe_sqlx, is_transient_sqlx};
use crate::job::JobId;
use crate::maintenance::Maintenance;
use crate::pacing::sleep_jittered;
use crate::pool::BEGIN_PINNED;
use tokio_util::sync::CancellationToken;

/// How long finished jobs stay in `skiplock.jobs` before the pruner removes them.
///
/// A retention of a day or more drops whole days (UTC): a job stays at least its retention
/// and at most a day longer. A shorter one (zero included: the next pass) deletes each job
/// as it passes, one batch at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// For `succeeded` jobs. Default one day.
    pub succeeded: Duration,
    /// For `cancelled` jobs. Default one day.
    pub cancelled: Duration,
    /// For `dead` jobs. Default 14 days.
    pub dead: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        const DAY: Duration = Duration::from_secs(24 * 3600);
        Self {
            succeeded: DAY,
            cancelled: DAY,
            dead: DAY * 14,
        }
    }
}

/// Rows deleted per statement: small enough that each delete is a short transaction.
pub(crate) const PRUNE_BATCH: i64 = 1000;

/// What one pruning pass removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Pruned {
    /// Finished jobs removed: in whole days and one by one.
    pub jobs: u64,
    /// Days of one finished state dropped whole (one partition each).
    pub days: u64,
    /// Days past retention left for a later pass: busy (a lock not granted within 100 ms,
    /// a long transaction reading them), or failing (logged).
    pub days_left: u64,
}

/// Prunes every `interval` (jittered) until `stop`.
pub(crate) async fn prune(context: Arc<Maintenance>, interval: Duration) {
    let stop = &context.stop;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = sleep_jittered(interval) => {}
        }
        match prune_finished(&context.pool, context.retention, stop).await {
            Ok(pruned) => {
                if pruned.jobs > 0 || pruned.days_left > 0 {
                    tracing::debug!(
                        jobs = pruned.jobs,
                        days = pruned.days,
                        days_left = pruned.days_left,
                        "pruned finished jobs"
                    );
                }
            }
            Err(e) => {
                crate::metrics::maintenance_failed("pruner");
                if crate::read_only::worth_a_warning(&e) {
                    tracing::warn!(error = %describe_sqlx(&e), "pruner pass failed; will retry");
                }
            }
        }
        if let Err(e) =
            job_history_prune_expired(&context.pool, duration_ms(HISTORY_RETENTION_DEFAULT)).await
        {
            crate::metrics::maintenance_failed("pruner");
            if crate::read_only::worth_a_warning(&e) {
                tracing::warn!(error = %e, "folding old history failed; will retry");
            }
        }
    }
}

/// One pruning pass: makes the days ahead, deletes what no day holds, then drops every
/// day past retention. Errors only when the database is unreachable or refuses the
/// pass's first statements; a day that cannot go now is counted in
/// [`Pruned::days_left`].
/// Stops between statements once `stop` is cancelled (a worker shutting down).
pub(crate) async fn prune_finished(
    pool: &DbPool,
    retention: Retention,
    stop: &CancellationToken,
) -> sqlx::Result<Pruned> {
    let (succeeded_ms, cancelled_ms, dead_ms) = (
        duration_ms(retention.succeeded),
        duration_ms(retention.cancelled),
        duration_ms(retention.dead),
    );
    let mut pruned = Pruned::default();
    done_partitions_prepare(pool).await?;
    // Rows first: a day that cannot be dropped never holds them up.
    loop {
        let pass = jobs_prune_finished_rolled_up(
            pool.pool(),
            succeeded_ms,
            cancelled_ms,
            dead_ms,
            PRUNE_BATCH,
        )
        .await;
        match pass {
            Ok(deleted) => {
                pruned.jobs += deleted;
                if (deleted as i64) < PRUNE_BATCH || stop.is_cancelled() {
                    break;
                }
            }
            Err(e) if is_transient_sqlx(&e) => return Err(e),
            Err(e) => {
                tracing::warn!(error = %describe_sqlx(&e), "pruning a batch failed; pruning its jobs one at a time");
                pruned.jobs += prune_one_by_one(pool, retention).await;
                break;
            }
        }
    }
    for day in done_partitions_expired(pool, succeeded_ms, cancelled_ms, dead_ms).await? {
        if stop.is_cancelled() {
            break;
        }
        match drop_day(pool, &day).await {
            Ok(Some(jobs)) => {
                pruned.jobs += jobs;
                pruned.days += 1;
            }
            Ok(None) => {}
            Err(e) => {
                pruned.days_left += 1;
                if is_transient_sqlx(&e) {
                    tracing::debug!(partition = %day.leaf, error = %e, "a day of finished jobs is busy; dropping it at a later pass");
                } else {
                    tracing::warn!(partition = %day.leaf, error = %describe_sqlx(&e), "dropping a day of finished jobs failed; will retry");
                }
            }
        }
    }
    Ok(pruned)
}

/// Rolls `day` up into the history and drops it, in one transaction; returns how many
/// jobs went with it, or `None` when another pruner dropped it first.
async fn drop_day(pool: &DbPool, day: &DonePartition) -> sqlx::Result<Option<u64>> {
    let mut tx = pool.pool().begin_with(BEGIN_PINNED).await?;
    if !done_partition_lock(&mut *tx, &day.leaf).await? {
        return Ok(None);
    }
    let jobs =
        job_history_roll_up_finished_between(&mut *tx, &day.state, day.starts, day.ends).await?;
    done_partition_drop(&mut *tx, &day.leaf).await?;
    tx.commit().await?;
    Ok(Some(jobs))
}

/// Deletes up to one batch of due jobs, each in its own statement; returns how many went.
async fn prune_one_by_one(pool: &DbPool, retention: Retention) -> u64 {
    let due = jobs_list_prunable(
        pool,
        duration_ms(retention.succeeded),
        duration_ms(retention.cancelled),
        duration_ms(retention.dead),
        PRUNE_BATCH,
    )
    .await;
    let due = match due {
        Ok(due) => due,
        Err(e) => {
            tracing::warn!(error = %e, "listing prunable jobs failed; will retry");
            return 0;
        }
    };
    let mut deleted = 0;
    for id in due {
        match jobs_delete_rolled_up(pool, JobId(id)).await {
            Ok(gone) => deleted += u64::from(gone),
            Err(e) if is_transient_sqlx(&e) => {
                if crate::read_only::worth_a_warning(&e) {
                    tracing::warn!(job_id = id, error = %e, "pruning a job failed; will retry");
                }
            }
            Err(e) => {
                tracing::error!(
                    job_id = id,
                    error = %describe_sqlx(&e),
                    "cannot add a pruned job to the history; deleting it without its numbers"
                );
                match jobs_delete_finished_unrolled(pool, id).await {
                    Ok(gone) => deleted += u64::from(gone),
                    Err(e) => {
                        tracing::error!(job_id = id, error = %describe_sqlx(&e), "could not prune the job")
                    }
                }
            }
        }
    }
    deleted
}
