//! The pruner: deletes finished jobs past their retention, in small batches that skip
//! locked rows, so it never blocks claims or completions. Each batch is added to the
//! history rollup (`skiplock.job_history`) in the same statement, so pruning never erases
//! history; hourly history older than a year is folded into lifetime totals.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::db::history::{
    HISTORY_RETENTION_DEFAULT, job_history_prune_expired, jobs_prune_finished_rolled_up,
};
use crate::enqueue::duration_ms;
use crate::worker::{Shared, sleep_jittered};

/// Rows deleted per statement: small enough that each delete is a short transaction.
pub(crate) const PRUNE_BATCH: i64 = 1000;

/// Prunes every `interval` (jittered) until `stop`.
pub(crate) async fn prune(shared: Arc<Shared>, interval: Duration, stop: CancellationToken) {
    let retention = shared.config.retention;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = sleep_jittered(interval) => {}
        }
        loop {
            let pass = jobs_prune_finished_rolled_up(
                &shared.pool,
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
                Err(e) => {
                    tracing::warn!(error = %e, "pruner pass failed; will retry");
                    break;
                }
            }
        }
        if let Err(e) =
            job_history_prune_expired(&shared.pool, duration_ms(HISTORY_RETENTION_DEFAULT)).await
        {
            tracing::warn!(error = %e, "folding old history failed; will retry");
        }
    }
}
