//! The completer: saves outcomes in batches.
//!
//! It takes the first outcome that arrives plus everything queued behind it (up to the
//! batch limit) and writes them with at most three statements: completions, failures,
//! releases. Up to [`WRITES_IN_FLIGHT`] batches are written at once; while they are, the
//! next accumulates, so under load a statement carries many jobs and when idle a single
//! job is written at once. Each outcome is in exactly one batch, so concurrent writes
//! never touch the same row.
//!
//! Transient database errors are retried until the write succeeds or the worker shuts
//! down hard; an outcome that cannot be saved leaves its job `running`, and the reaper
//! returns it to the queue once its heartbeat goes stale. Nothing is lost either way.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;

use super::executor::{Finished, Outcome};
use super::{Shared, db_retry_delay};
use crate::db::jobs::{
    FailAction, FailBatch, SavedJob, jobs_advance_lanes, jobs_complete_many, jobs_fail_many,
    jobs_release_many, jobs_settle_dependants,
};
use crate::error::is_transient_sqlx;
use crate::job::{Fate, JobState};

/// Attempts at one write once the worker is shutting down hard.
const WRITE_ATTEMPTS_AFTER_HARD_STOP: u32 = 3;

/// Batches written at once. Two let one batch's commit wait for its WAL flush while the
/// next one's rows are written (one at a time left both cores idle a fifth of the time
/// in the drain benchmark).
const WRITES_IN_FLIGHT: usize = 2;

/// Runs until every sender is dropped and every outcome received has been written.
pub(super) async fn complete(shared: Arc<Shared>, mut outcomes: mpsc::UnboundedReceiver<Finished>) {
    let max = shared.config.batch_max;
    let slots = Arc::new(Semaphore::new(WRITES_IN_FLIGHT));
    let mut writes = JoinSet::new();
    loop {
        // Wait for a free write slot first, so outcomes accumulate meanwhile.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            break;
        };
        let Some(first) = outcomes.recv().await else {
            break;
        };
        let mut batch = Vec::with_capacity(max.min(1024));
        batch.push(first);
        while batch.len() < max {
            match outcomes.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let shared = shared.clone();
        writes.spawn(async move {
            save(&shared, &mut batch).await;
            drop(slot);
        });
        // Reap finished writes so the set does not grow (a panic is logged, and its
        // claims stay held until the reaper returns them).
        while let Some(done) = writes.try_join_next() {
            log_write_panic(done);
        }
    }
    while let Some(done) = writes.join_next().await {
        log_write_panic(done);
    }
}

fn log_write_panic(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done {
        tracing::error!(error = %e, "saving a batch of outcomes panicked");
    }
}

/// Writes one batch of outcomes and forgets their claims.
async fn save(shared: &Shared, batch: &mut Vec<Finished>) {
    let mut done = (Vec::new(), Vec::new());
    let mut released = (Vec::new(), Vec::new());
    let mut failed = FailBatch::default();
    let mut settled: Vec<i64> = Vec::with_capacity(batch.len());
    for finished in batch.drain(..) {
        let (id, token) = (finished.id, finished.token);
        match finished.outcome {
            Outcome::Succeeded => {
                done.0.push(id);
                done.1.push(token);
            }
            Outcome::Released => {
                released.0.push(id);
                released.1.push(token);
            }
            Outcome::Failed {
                message,
                fate,
                delay_ms,
            } => {
                let action = match fate {
                    Fate::Dead => FailAction::Dead,
                    Fate::Cancel => FailAction::Cancel,
                    _ => FailAction::Retry,
                };
                failed.push(id, token, message, delay_ms, action);
            }
            Outcome::Lost => {
                shared.counters.lost.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    job_id = id,
                    "claim lost while running (reaped or cancelled); handler stopped"
                );
                settled.push(id);
            }
        }
    }
    let counters = &shared.counters;
    let mut parents = Vec::new();
    let mut lanes = Vec::new();
    if !done.0.is_empty() {
        let saved = write(shared, "complete", || {
            jobs_complete_many(&shared.pool, &done.0, &done.1)
        })
        .await;
        let kept = saved.map(|rows| settled_ids(rows, &mut parents, &mut lanes));
        settle(
            shared,
            &done.0,
            kept.as_deref(),
            &mut settled,
            &counters.succeeded,
        );
    }
    if !failed.is_empty() {
        let saved = write(shared, "fail", || jobs_fail_many(&shared.pool, &failed)).await;
        let kept = saved.map(|rows| settled_ids(rows, &mut parents, &mut lanes));
        settle(
            shared,
            &failed.ids,
            kept.as_deref(),
            &mut settled,
            &counters.failed,
        );
    }
    if !released.0.is_empty() {
        let kept = write(shared, "release", || {
            jobs_release_many(&shared.pool, &released.0, &released.1)
        })
        .await;
        settle(
            shared,
            &released.0,
            kept.as_deref(),
            &mut settled,
            &counters.released,
        );
    }
    if !parents.is_empty() {
        // Jobs waiting on these may run now (or are cancelled). Should this fail, the
        // periodic sweep (maintenance::dependencies) settles them a little later.
        write(shared, "settle dependants", || {
            jobs_settle_dependants(&shared.pool, &parents)
        })
        .await;
    }
    if !lanes.is_empty() {
        // The next job of each lane becomes its head (promotion notifies the workers).
        lanes.sort_unstable();
        lanes.dedup();
        write(shared, "advance lanes", || {
            jobs_advance_lanes(&shared.pool, &lanes)
        })
        .await;
    }
    shared.claims.remove_many(&settled);
    // Producers held back by the claim bound may claim again (a stored permit covers a
    // producer that is about to wait).
    for group in &shared.groups {
        group.settled.notify_one();
    }
    if shared.config.exit_when_idle && shared.claims.len() == 0 {
        // The producer may be waiting only to notice that the worker went idle.
        shared.wake_all();
    }
}

/// Ids of saved jobs; those that finished go to `parents` when jobs depend on them and
/// to `lanes` when they headed an ordering lane.
fn settled_ids(rows: Vec<SavedJob>, parents: &mut Vec<i64>, lanes: &mut Vec<String>) -> Vec<i64> {
    rows.into_iter()
        .map(|row| {
            if row.state != JobState::Queued
                && let Some(key) = row.ordering_key
            {
                lanes.push(key);
            }
            if row.has_dependants && row.state != JobState::Queued {
                parents.push(row.id);
            }
            row.id
        })
        .collect()
}

/// Notes which outcomes were saved and warns about claims that had gone stale.
fn settle(
    shared: &Shared,
    ids: &[i64],
    kept: Option<&[i64]>,
    settled: &mut Vec<i64>,
    counter: &std::sync::atomic::AtomicU64,
) {
    // A failed write leaves the claims held: the job stays `running` until it is reaped.
    let Some(kept) = kept else { return };
    counter.fetch_add(kept.len() as u64, Ordering::Relaxed);
    if kept.len() < ids.len() {
        let kept: HashSet<i64> = kept.iter().copied().collect();
        for id in ids.iter().filter(|id| !kept.contains(id)) {
            shared.counters.lost.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                job_id = id,
                "outcome discarded: the claim is no longer ours (reaped, cancelled or deleted)"
            );
        }
    }
    settled.extend_from_slice(ids);
}

/// Runs a write, retrying transient errors; `None` if it could not be saved.
async fn write<T, F, Fut>(shared: &Shared, what: &str, mut statement: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = sqlx::Result<T>>,
{
    let mut failures = 0u32;
    loop {
        match statement().await {
            Ok(value) => return Some(value),
            Err(e) => {
                failures += 1;
                let give_up = !is_transient_sqlx(&e)
                    || (shared.hard.is_cancelled() && failures >= WRITE_ATTEMPTS_AFTER_HARD_STOP);
                if give_up {
                    tracing::error!(statement = what, error = %e, "could not save job outcomes");
                    return None;
                }
                tracing::warn!(statement = what, error = %e, failures, "saving job outcomes failed; retrying");
                tokio::time::sleep(db_retry_delay(failures)).await;
            }
        }
    }
}
