//! Moving waiting jobs on: the fast path after jobs finish ([`MoveOn`]) and the sweep
//! that settles what the fast path missed.
//!
//! The completer and the reaper settle a finished job's dependants and advance its lane
//! right after saving its outcome. A child or lane job whose enqueue overlaps that end is
//! not missed: the lane's step waits for the enqueue's commit (both take the lane's lock),
//! and a child's edge either holds its parent until it commits (the parent's end then
//! sees it) or finds the parent ended and settles the child itself. A fast path can still
//! fail, or its worker die between the outcome's commit and the follow-up, so every worker
//! also sweeps periodically: waiting jobs whose parents have all finished are queued or
//! cancelled, and lanes whose head finished move on.

use std::sync::Arc;

use crate::DbPool;
use crate::db::jobs::SavedJob;
use crate::db::maintenance::{
    ReapedJob, jobs_advance_lanes, jobs_settle_dependants, jobs_settle_waiting,
};
use crate::error::is_transient_sqlx;
use crate::job::JobState;
use crate::maintenance::Maintenance;
use crate::pacing::{db_retry_delay, sleep_jittered};

/// Sweeps every `reap_interval` (jittered) until `stop`.
pub(crate) async fn sweep(context: Arc<Maintenance>) {
    loop {
        tokio::select! {
            () = context.stop.cancelled() => return,
            () = sleep_jittered(context.reap_interval) => {}
        }
        match jobs_settle_waiting(&context.pool).await {
            Ok(0) => {}
            Ok(moved) => tracing::debug!(moved, "settled waiting jobs whose parents finished"),
            Err(e) => {
                crate::metrics::maintenance_failed("dependencies");
                if crate::read_only::worth_a_warning(&e) {
                    tracing::warn!(error = %e, "dependency sweep failed; will retry");
                }
            }
        }
    }
}

/// What jobs that just finished set in motion, gathered by the completer and the reaper
/// as they save outcomes, then [`run`](Self::run) once per batch: the waiting dependants
/// of the parents are queued or cancelled, and the next job of each lane becomes its head.
#[derive(Default)]
pub(crate) struct MoveOn {
    /// Finished jobs that other jobs wait on.
    parents: Vec<i64>,
    /// Lanes whose head finished (repeats allowed; removed before the statement).
    lanes: Vec<String>,
}

impl MoveOn {
    /// Notes a job whose outcome was saved. One back in `queued` (a retry, a snooze, a
    /// release) still holds its lane and its dependants' wait: it sets nothing in motion.
    pub(crate) fn note(&mut self, job: &SavedJob) {
        if job.state == JobState::Queued {
            return;
        }
        if let Some(key) = &job.ordering_key {
            self.lanes.push(key.clone());
        }
        if job.has_dependants {
            self.parents.push(job.id);
        }
    }

    /// Notes a job the reaper took back. The reaper does not know whether other jobs wait
    /// on it, so every finished one is a parent to settle (the statement finds none when
    /// nothing waits).
    pub(crate) fn note_reaped(&mut self, job: &ReapedJob) {
        if job.state == JobState::Queued {
            return;
        }
        if let Some(key) = &job.ordering_key {
            self.lanes.push(key.clone());
        }
        self.parents.push(job.id);
    }

    /// Whether nothing was noted: no statement to run.
    pub(crate) fn is_empty(&self) -> bool {
        self.parents.is_empty() && self.lanes.is_empty()
    }

    /// Settles the dependants and advances the lanes noted.
    pub(crate) async fn run(mut self, pool: &DbPool) {
        move_on(pool, &self.parents, &mut self.lanes).await;
    }
}

/// The waiting dependants of `parents` are queued or cancelled, and the next job of each
/// of `lanes` becomes its head (promotion notifies the workers). Transient errors are
/// retried a few times; then the failure is logged, and the periodic [`sweep`] does the
/// same a little later.
async fn move_on(pool: &DbPool, parents: &[i64], lanes: &mut Vec<String>) {
    if !parents.is_empty() {
        retrying("settle the dependants of finished jobs", || {
            jobs_settle_dependants(pool, parents)
        })
        .await;
    }
    if !lanes.is_empty() {
        lanes.sort_unstable();
        lanes.dedup();
        let lanes = &*lanes;
        retrying("advance the lanes of finished jobs", || {
            jobs_advance_lanes(pool, lanes)
        })
        .await;
    }
}

/// Attempts at a follow-up statement before it is left to the sweep.
const MOVE_ON_ATTEMPTS: u32 = 3;

async fn retrying<F, Fut>(what: &str, mut statement: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = sqlx::Result<i32>>,
{
    for failures in 1..=MOVE_ON_ATTEMPTS {
        match statement().await {
            Ok(_) => return,
            Err(e) if is_transient_sqlx(&e) && failures < MOVE_ON_ATTEMPTS => {
                tokio::time::sleep(db_retry_delay(failures)).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not {what}; the dependency sweep will");
                return;
            }
        }
    }
}
