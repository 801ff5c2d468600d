//! The pruner: deletes finished jobs past their retention, in small batches that skip
//! locked rows, so it never blocks claims or completions. Each batch is added to the
//! history rollup (`skiplock.job_history`) in the same statement, so pruning never erases
//! history; hourly history older than a year is folded into lifetime totals. A dead or
//! cancelled job is kept while jobs that depend on it remain, so a retried child still
//! finds the parent that failed (and waits, then is cancelled again) instead of running.
//!
//! When a batch fails for a reason a retry will not change (one row whose numbers the
//! rollup cannot read, say an `errors` list written by hand), the pruner deletes the due
//! jobs one at a time; a job that still cannot be rolled up is deleted without its
//! history, logged with its id. One row never stops pruning.

use std::sync::Arc;
use std::time::Duration;

use crate::db::history::{
    HISTORY_RETENTION_DEFAULT, job_history_prune_expired, jobs_delete_rolled_up,
    jobs_prune_finished_rolled_up,
};
use crate::db::maintenance::{jobs_delete_finished_unrolled, jobs_list_prunable};
use crate::enqueue::duration_ms;
use crate::error::{describe_sqlx, is_transient_sqlx};
use crate::job::JobId;
use crate::maintenance::Maintenance;
use crate::pacing::sleep_jittered;

/// How long finished jobs stay in `skiplock.jobs` before the pruner deletes them.
/// Zero deletes them at the pruner's next pass.
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

/// Prunes every `interval` (jittered) until `stop`.
pub(crate) async fn prune(context: Arc<Maintenance>, interval: Duration) {
    let retention = context.retention;
    let stop = &context.stop;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = sleep_jittered(interval) => {}
        }
        loop {
            let pass = jobs_prune_finished_rolled_up(
                &context.pool,
                duration_ms(retention.succeeded),
                duration_ms(retention.cancelled),
                duration_ms(retention.dead),
                PRUNE_BATCH,
            )
            .await;
            match pass {
                Ok(deleted) => {
                    if deleted > 0 {
                        tracing::debug!(deleted, "pruned finished jobs");
                    }
                    if (deleted as i64) < PRUNE_BATCH || stop.is_cancelled() {
                        break;
                    }
                }
                Err(e) if is_transient_sqlx(&e) => {
                    crate::metrics::maintenance_failed("pruner");
                    if crate::error::worth_a_warning(&e) {
                        tracing::warn!(error = %e, "pruner pass failed; will retry");
                    }
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %describe_sqlx(&e), "pruning a batch failed; pruning its jobs one at a time");
                    prune_one_by_one(&context, retention).await;
                    break;
                }
            }
        }
        if let Err(e) =
            job_history_prune_expired(&context.pool, duration_ms(HISTORY_RETENTION_DEFAULT)).await
        {
            crate::metrics::maintenance_failed("pruner");
            if crate::error::worth_a_warning(&e) {
                tracing::warn!(error = %e, "folding old history failed; will retry");
            }
        }
    }
}

/// Deletes up to one batch of due jobs, each in its own statement.
async fn prune_one_by_one(context: &Maintenance, retention: Retention) {
    let due = jobs_list_prunable(
        &context.pool,
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
            return;
        }
    };
    for id in due {
        match jobs_delete_rolled_up(&context.pool, JobId(id)).await {
            Ok(_) => {}
            Err(e) if is_transient_sqlx(&e) => {
                if crate::error::worth_a_warning(&e) {
                    tracing::warn!(job_id = id, error = %e, "pruning a job failed; will retry");
                }
            }
            Err(e) => {
                tracing::error!(
                    job_id = id,
                    error = %describe_sqlx(&e),
                    "cannot add a pruned job to the history; deleting it without its numbers"
                );
                if let Err(e) = jobs_delete_finished_unrolled(&context.pool, id).await {
                    tracing::error!(job_id = id, error = %describe_sqlx(&e), "could not prune the job");
                }
            }
        }
    }
}
