//! The reaper: returns `running` jobs whose heartbeat went stale (a crashed, frozen or
//! cut-off worker) to `queued` with backoff, or to `dead` when their attempts are spent.
//!
//! It reaps in batches. When a batch statement fails for a reason a retry will not change
//! (one row the statement cannot write), it reaps the stale jobs one at a time instead,
//! and a job that still cannot be reaped goes `dead` with the reason: one row never keeps
//! the others `running` behind a dead worker.

use std::sync::Arc;

use crate::db::jobs::jobs_abandon_many;
use crate::db::maintenance::{ReapedJob, jobs_list_stale, jobs_reap_stale, jobs_reap_stale_one};
use crate::enqueue::duration_ms;
use crate::error::{describe_sqlx, is_transient_sqlx};
use crate::maintenance::Maintenance;
use crate::maintenance::dependencies::MoveOn;
use crate::pacing::sleep_jittered;

/// Reaps every `reap_interval` (jittered) until `stop`.
pub(crate) async fn reap(context: Arc<Maintenance>) {
    let limit = context.batch_max as i64;
    loop {
        tokio::select! {
            () = context.stop.cancelled() => return,
            () = sleep_jittered(context.reap_interval) => {}
        }
        loop {
            match jobs_reap_stale(&context.pool, duration_ms(context.stale_after), limit).await {
                Ok(reaped) => {
                    crate::metrics::reaped(reaped.len());
                    follow_up(&context, &reaped).await;
                    if (reaped.len() as i64) < limit {
                        break;
                    }
                }
                Err(e) if is_transient_sqlx(&e) => {
                    crate::metrics::maintenance_failed("reaper");
                    tracing::warn!(error = %e, "reaper pass failed; will retry");
                    break;
                }
                Err(e) => {
                    tracing::warn!(
                        error = %describe_sqlx(&e),
                        "reaping a batch failed; reaping its jobs one at a time"
                    );
                    reap_one_by_one(&context, limit).await;
                    break;
                }
            }
        }
    }
}

/// Reaps up to `limit` stale jobs, each in its own statement; a job whose reap fails for
/// good goes `dead` with the reason.
async fn reap_one_by_one(context: &Maintenance, limit: i64) {
    let stale_after_ms = duration_ms(context.stale_after);
    let stale = match jobs_list_stale(&context.pool, stale_after_ms, limit).await {
        Ok(stale) => stale,
        Err(e) => {
            tracing::warn!(error = %e, "listing stale jobs failed; will retry");
            return;
        }
    };
    for (id, token) in stale {
        match jobs_reap_stale_one(&context.pool, stale_after_ms, id).await {
            Ok(reaped) => follow_up(context, &reaped).await,
            Err(e) if is_transient_sqlx(&e) => {
                tracing::warn!(job_id = id, error = %e, "reaping a job failed; will retry");
            }
            Err(e) => {
                let reason = describe_sqlx(&e);
                tracing::error!(job_id = id, error = %reason, "a stale job cannot be requeued; marking it dead with the reason");
                let message =
                    format!("taken back from a stale claim, but could not be requeued: {reason}");
                match jobs_abandon_many(&context.pool, &[id], &[token], &message).await {
                    Ok(saved) => {
                        let mut move_on = MoveOn::default();
                        saved.iter().for_each(|job| move_on.note(job));
                        move_on.run(&context.pool).await;
                    }
                    Err(e) => {
                        tracing::error!(job_id = id, error = %describe_sqlx(&e), "could not mark the stale job dead either")
                    }
                }
            }
        }
    }
}

/// Logs what was reaped and moves on the lanes and dependants of jobs that finished
/// (dead, or cancelled because a pending job took their unique key).
async fn follow_up(context: &Maintenance, reaped: &[ReapedJob]) {
    for job in reaped {
        tracing::warn!(
            job_id = job.id,
            holder = job.claimed_by.as_deref().unwrap_or("unknown"),
            state = %job.state,
            "took back a job whose heartbeat went stale"
        );
    }
    let mut move_on = MoveOn::default();
    reaped.iter().for_each(|job| move_on.note_reaped(job));
    move_on.run(&context.pool).await;
}
