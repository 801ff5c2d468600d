//! The producer: claims batches of runnable jobs into the local buffer.
//!
//! It claims as many jobs as the buffer has room for, in one statement. When a claim
//! comes back short the queue is drained for now, and it waits for a wake-up (a
//! notification from the listener) or the jittered poll interval, whichever comes first.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::{Notify, mpsc};

use super::{Shared, db_retry_delay, sleep_jittered};
use crate::db::jobs::{ClaimedJob, jobs_any_active, jobs_claim_batch};

/// Runs until the graceful shutdown signal; dropping `buffer` on return tells the
/// dispatcher that no more jobs will come.
pub(super) async fn produce(
    shared: Arc<Shared>,
    group: usize,
    buffer: mpsc::Sender<ClaimedJob>,
    space: Arc<Notify>,
) {
    let config = &shared.config;
    let group = &shared.groups[group];
    // Refill once a quarter of the buffer is free, so claims are batches, not trickles.
    let refill_at = (group.prefetch / 4).max(1);
    let mut failures = 0u32;
    while !shared.graceful.is_cancelled() {
        // Backpressure: claims held by the whole worker (buffered, running, or finished
        // and waiting for the completer) stay under a bound, so a completer that falls
        // behind slows claiming instead of piling up `running` rows and heartbeat work.
        let unsettled_room = shared.held_limit.saturating_sub(shared.claims.len());
        let free = buffer.capacity().min(unsettled_room);
        if free < refill_at {
            tokio::select! {
                () = shared.graceful.cancelled() => break,
                () = space.notified() => continue,
                () = group.settled.notified() => continue,
            }
        }
        let limit = free.min(config.batch_max);
        let claimed = jobs_claim_batch(
            &shared.pool,
            &group.queues,
            &shared.kinds,
            limit as i64,
            &config.worker_id,
        )
        .await;
        let jobs = match claimed {
            Ok(jobs) => {
                failures = 0;
                jobs
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, "claim failed; retrying");
                tokio::select! {
                    () = shared.graceful.cancelled() => break,
                    () = tokio::time::sleep(db_retry_delay(failures)) => continue,
                }
            }
        };
        let count = jobs.len();
        shared
            .counters
            .claimed
            .fetch_add(count as u64, Ordering::Relaxed);
        for job in jobs {
            shared.claims.insert(job.id, job.claim_token);
            // Only this task sends and it checked the capacity, so there is room.
            if let Err(e) = buffer.try_send(job) {
                tracing::error!(error = %e, "local buffer refused a claimed job");
            }
        }
        if count == limit {
            continue;
        }
        if config.exit_when_idle && count == 0 && shared.claims.len() == 0 && idle(&shared).await {
            tracing::info!("no runnable or running job left; exiting as asked");
            shared.graceful.cancel();
            break;
        }
        tokio::select! {
            () = shared.graceful.cancelled() => break,
            () = group.wake.notified() => {}
            () = sleep_jittered(config.poll_interval) => {}
        }
    }
}

/// Whether the database holds no runnable or running job of this worker's queues and kinds.
async fn idle(shared: &Shared) -> bool {
    match jobs_any_active(&shared.pool, &shared.config.queues, &shared.kinds).await {
        Ok(active) => !active,
        Err(e) => {
            tracing::warn!(error = %e, "idle check failed; assuming work remains");
            false
        }
    }
}
