//! The completer: saves outcomes in batches.
//!
//! It takes the first outcome that arrives plus everything queued behind it (up to the
//! batch limit) and writes them with at most three statements: completions, failures,
//! releases. Up to two batches are written at once (one when other processes claim from
//! the worker's queues, [`super::sharing`]): one batch's commit waits for its WAL flush
//! while the next one's rows are written. Meanwhile the next batch accumulates, so under
//! load a statement carries many jobs and when idle a single job is written at once. Each
//! outcome is in exactly one batch, so concurrent writes never touch the same row.
//!
//! Transient database errors (lost connections, deadlocks, serialization failures, class
//! 53 resource errors, a read-only server during a failover) are retried until the write
//! succeeds or the worker shuts down hard. A statement refused for good is split in halves
//! down to single jobs, so the other outcomes of the batch are saved; a job whose own row
//! still cannot be saved goes `dead` with the database's reason as its last error. Only a
//! database that stays unreachable through a hard stop leaves jobs `running`, for the
//! reaper, as a crash would.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use super::Shared;
use super::claims::ClaimKey;
use super::events::{JobEvent, JobEventOutcome};
use super::executor::BufferedJob;
use super::executor::{Finished, Outcome};
use super::reply_lost;
use super::sharing::writes_in_flight;
use super::split_write::{SplitWrite, WriteError, release_at_once, write, write_split};
use crate::db::jobs::{
    ClaimedJob, FailAction, FailBatch, Handoff, SavedJob, jobs_abandon_many,
    jobs_complete_handing_on, jobs_complete_many, jobs_completed_by, jobs_fail_many,
    jobs_failed_by, jobs_release_many, jobs_released_by,
};
use crate::error::describe_sqlx;
use crate::job::Fate;
use crate::maintenance::dependencies::MoveOn;
use crate::metrics;

/// Runs until every sender is dropped and every outcome received has been written.
pub(super) async fn complete(shared: Arc<Shared>, mut outcomes: mpsc::UnboundedReceiver<Finished>) {
    let max = shared.config.batch_max;
    let mut writes = JoinSet::new();
    let follow_ups = TaskTracker::new();
    loop {
        // Wait for a free write slot first, so outcomes accumulate meanwhile.
        while writes.len() >= writes_in_flight(&shared) {
            if let Some(done) = writes.join_next().await {
                log_write_panic(done);
            }
        }
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
        let follow_ups = follow_ups.clone();
        writes.spawn(async move { save(&shared, &mut batch, &follow_ups).await });
        // Reap finished writes so the set does not grow (a panic is logged, and its
        // claims stay held until the reaper returns them).
        while let Some(done) = writes.try_join_next() {
            log_write_panic(done);
        }
    }
    while let Some(done) = writes.join_next().await {
        log_write_panic(done);
    }
    follow_ups.close();
    follow_ups.wait().await;
}

fn log_write_panic(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done {
        tracing::error!(error = %e, "saving a batch of outcomes panicked");
    }
}

/// Writes one batch of outcomes, then sets in motion what they let go (dependants, lanes)
/// and forgets their claims.
async fn save(shared: &Arc<Shared>, batch: &mut Vec<Finished>, follow_ups: &TaskTracker) {
    let mut done = (Vec::new(), Vec::new());
    let mut released = Releases::default();
    let mut snoozed = Releases::default();
    let mut failed = FailBatch::default();
    let mut settled: Vec<ClaimKey> = Vec::with_capacity(batch.len());
    let mut events: HashMap<ClaimKey, JobEvent> = HashMap::new();
    let mut follow_up = MoveOn::default();
    // Whether a completion of the batch may hand its key's freed slot on.
    let mut key_limited = false;
    let completed_in_tx = completed_in_handler_tx(shared, batch).await;
    for finished in batch.drain(..) {
        let (id, token) = (finished.id, finished.token);
        if finished.completed_in_tx
            && let Some(row) = completed_in_tx.get(&id)
        {
            // Saved already, by the handler's own transaction.
            follow_up.note(row);
            shared.counters.succeeded.fetch_add(1, Ordering::Relaxed);
            if !matches!(finished.outcome, Outcome::Succeeded) {
                tracing::info!(
                    job_id = id,
                    "the handler completed the job in its transaction before it returned \
                     another outcome; the job stays succeeded"
                );
            }
            let event = finished.event.map(|event| JobEvent {
                outcome: JobEventOutcome::Completed {
                    took: finished.took,
                },
                ..event
            });
            publish(shared, event);
            settled.push((id, token));
            continue;
        }
        if let Some(event) = finished.event {
            events.insert((id, token), event);
        }
        match finished.outcome {
            Outcome::Succeeded => {
                done.0.push(id);
                done.1.push(token);
                key_limited |= finished.key_limited;
            }
            Outcome::Released => released.push(id, token, finished.attempt, 0),
            Outcome::Snoozed { delay_ms } => {
                snoozed.push(id, token, finished.attempt, delay_ms);
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
                if shared.claims.was_cancelled((id, token)) {
                    // An operator's cancel: expected, not a warning.
                    tracing::info!(job_id = id, "job cancelled while running; handler stopped");
                } else {
                    tracing::warn!(
                        job_id = id,
                        "claim lost while running (reaped or cancelled); handler stopped"
                    );
                }
                publish(shared, events.remove(&(id, token)));
                settled.push((id, token));
            }
        }
    }
    let counters = &shared.counters;
    if !done.0.is_empty() {
        let (ids, tokens) = (&done.0, &done.1);
        // A key's freed slot is handed on to this worker (not while it stops, nor when it
        // runs one chosen job).
        let hand_on =
            key_limited && !shared.graceful.is_cancelled() && shared.config.only_job.is_none();
        let mut saved = write_split(shared, "complete", ids, tokens, |range| {
            complete_handing_on(shared, &ids[range.clone()], &tokens[range], hand_on)
        })
        .await;
        if saved.reply_lost {
            find_saved_unseen("completions", &mut saved, |unseen| async move {
                jobs_completed_by(&shared.pool, &unseen, &shared.config.worker_id).await
            })
            .await;
        }
        settle(
            shared,
            saved,
            &mut follow_up,
            &mut settled,
            &mut events,
            &counters.succeeded,
        )
        .await;
    }
    if !failed.is_empty() {
        let mut saved = write_split(shared, "fail", &failed.ids, &failed.tokens, |range| {
            let part = failed.slice(range);
            async move { jobs_fail_many(&shared.pool, &part).await }
        })
        .await;
        if saved.reply_lost {
            let messages: HashMap<i64, &String> =
                failed.ids.iter().copied().zip(&failed.messages).collect();
            find_saved_unseen("failures", &mut saved, |unseen| {
                let messages: Vec<String> = unseen.iter().map(|id| messages[id].clone()).collect();
                async move {
                    jobs_failed_by(&shared.pool, &unseen, &messages, &shared.config.worker_id).await
                }
            })
            .await;
        }
        settle(
            shared,
            saved,
            &mut follow_up,
            &mut settled,
            &mut events,
            &counters.failed,
        )
        .await;
    }
    for (releases, what, counter) in [
        (&released, "release", &counters.released),
        (&snoozed, "snooze", &counters.snoozed),
    ] {
        if releases.ids.is_empty() {
            continue;
        }
        let (ids, tokens, delays_ms) = (&releases.ids, &releases.tokens, &releases.delays_ms);
        let mut saved = write_split(shared, what, ids, tokens, |range| {
            jobs_release_many(
                &shared.pool,
                &ids[range.clone()],
                &tokens[range.clone()],
                &delays_ms[range],
            )
        })
        .await;
        if saved.reply_lost {
            let attempts: HashMap<i64, i32> = ids
                .iter()
                .copied()
                .zip(releases.attempts.iter().copied())
                .collect();
            find_saved_unseen(what, &mut saved, |unseen| {
                let attempts: Vec<i32> = unseen.iter().map(|id| attempts[id]).collect();
                async move {
                    jobs_released_by(&shared.pool, &unseen, &attempts, &shared.config.worker_id)
                        .await
                }
            })
            .await;
        }
        settle(
            shared,
            saved,
            &mut follow_up,
            &mut settled,
            &mut events,
            counter,
        )
        .await;
    }
    if follow_up.is_empty() {
        forget(shared, &settled);
        return;
    }
    // A lane's step waits for an application's transaction that enqueues into the lane
    // (see skiplock.internal_advance_lanes), and a dependants' settle for one that adds a
    // child: the follow-up runs beside the next writes, not in this write slot. The claims
    // stay held until it is done, so an idle check never sees a lane between its head's
    // end and its next job's turn.
    let shared = shared.clone();
    follow_ups.spawn(async move {
        follow_up.run(&shared.pool).await;
        forget(&shared, &settled);
    });
}

/// One completion statement; with `hand_on`, the jobs it hands on to this worker (see
/// `skiplock.internal_free_slots`) are held and go to their group's dispatcher at once. They
/// carry a token of their own, chosen here: beaten while the statement is in flight, and,
/// if its reply is lost, looked for and released as a lost claim's jobs are.
async fn complete_handing_on(
    shared: &Arc<Shared>,
    ids: &[i64],
    tokens: &[Uuid],
    hand_on: bool,
) -> sqlx::Result<Vec<SavedJob>> {
    if !hand_on {
        return jobs_complete_many(&shared.pool, ids, tokens).await;
    }
    let token = Uuid::new_v4();
    let sent = shared.claims.claim_sent(token);
    let hand = Handoff {
        worker: &shared.config.worker_id,
        kinds: &shared.kinds,
        token,
    };
    match jobs_complete_handing_on(&shared.pool, ids, tokens, &hand).await {
        Ok(completion) => {
            take_handed(shared, completion.handed).await;
            drop(sent);
            Ok(completion.saved)
        }
        Err(e) => {
            if reply_lost(&e) {
                // Released by the next claim of any group, which the wake-up brings now.
                let now = std::time::Instant::now();
                for group in &shared.groups {
                    group.lost_claims.add(token, now);
                }
                shared.wake_all();
            }
            Err(e)
        }
    }
}

/// Holds the jobs a completion handed on and gives each to its group's dispatcher; those
/// that no dispatcher takes any more (the producer has stopped) are released at once,
/// their attempt not counted.
async fn take_handed(shared: &Arc<Shared>, handed: Vec<ClaimedJob>) {
    let mut refused: Vec<ClaimKey> = Vec::new();
    for job in handed {
        let claim = (job.id, job.claim_token);
        let Some(group) = shared.group_of(&job.queue) else {
            refused.push(claim);
            continue;
        };
        let handles = shared.claims.insert(claim);
        let inbox = shared.groups[group]
            .handed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let sent = match inbox.as_ref() {
            Some(inbox) => inbox.send(BufferedJob { job, handles }).is_ok(),
            None => false,
        };
        drop(inbox);
        if sent {
            shared.counters.claimed.fetch_add(1, Ordering::Relaxed);
            metrics::buffered(1.0);
        } else {
            refused.push(claim);
        }
    }
    if refused.is_empty() {
        return;
    }
    let (ids, tokens): (Vec<i64>, Vec<Uuid>) = refused.iter().copied().unzip();
    let write = release_at_once(shared, "release handed on", &ids, &tokens).await;
    for ((id, _), reason) in &write.unsaved {
        tracing::error!(
            job_id = id,
            error = %reason,
            "cannot release a job handed on after the worker stopped claiming; the reaper will take it back"
        );
    }
    shared.claims.remove_many(&refused);
}

/// Forgets claims whose outcome is saved and whose follow-up is done.
fn forget(shared: &Shared, settled: &[ClaimKey]) {
    shared.claims.remove_many(settled);
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

/// Of the finished jobs whose handler completed them in its own transaction
/// ([`JobContext::complete_in`](crate::JobContext::complete_in)), those that transaction
/// did complete (it committed), by id. The handler has returned, so its transaction has
/// ended; one that rolled back left the claim held, and the handler's outcome is saved as
/// usual. If the database cannot say, the outcomes are written as usual too: a job the
/// transaction completed is then reported lost, the worst case being a wrong count.
async fn completed_in_handler_tx(shared: &Shared, batch: &[Finished]) -> HashMap<i64, SavedJob> {
    let ids: Vec<i64> = batch
        .iter()
        .filter(|finished| finished.completed_in_tx)
        .map(|finished| finished.id)
        .collect();
    if ids.is_empty() {
        return HashMap::new();
    }
    let look = || jobs_completed_by(&shared.pool, &ids, &shared.config.worker_id);
    match write(shared, "find completions in handlers' transactions", look).await {
        Ok((rows, _)) => rows.into_iter().map(|row| (row.id, row)).collect(),
        Err(WriteError::Refused(e)) => {
            tracing::warn!(error = %describe_sqlx(&e), "cannot check which jobs their handler completed in its own transaction");
            HashMap::new()
        }
        Err(WriteError::GaveUp) => HashMap::new(),
    }
}

/// After a write whose reply was lost: the claims the successful retry did not find (their
/// token was already cleared) may have been settled by the lost write. `look(unseen)`
/// returns those it did settle, recognised by what only this worker's write leaves on the
/// row (see `jobs_completed_by`, `jobs_failed_by`, `jobs_released_by`); they count as
/// saved, with their follow-up, instead of being reported as discarded.
async fn find_saved_unseen<T, F, Fut>(what: &str, write: &mut SplitWrite<T>, look: F)
where
    T: SavedRow,
    F: FnOnce(Vec<i64>) -> Fut,
    Fut: Future<Output = sqlx::Result<Vec<T>>>,
{
    let found: HashSet<i64> = write.saved.iter().map(SavedRow::id).collect();
    let unsaved: HashSet<i64> = write.unsaved.iter().map(|(claim, _)| claim.0).collect();
    let unseen: Vec<i64> = write
        .claims
        .iter()
        .map(|claim| claim.0)
        .filter(|id| !found.contains(id) && !unsaved.contains(id))
        .collect();
    if unseen.is_empty() {
        return;
    }
    match look(unseen).await {
        Ok(rows) => {
            if !rows.is_empty() {
                tracing::info!(
                    jobs = rows.len(),
                    "{what} saved by an earlier write whose reply was lost"
                );
            }
            write.saved.extend(rows);
        }
        Err(e) => tracing::warn!(
            error = %e,
            "cannot check whether a write whose reply was lost saved its {what}"
        ),
    }
}

/// A row a finishing statement returns, by job id.
trait SavedRow {
    fn id(&self) -> i64;
}

impl SavedRow for SavedJob {
    fn id(&self) -> i64 {
        self.id
    }
}

impl SavedRow for i64 {
    fn id(&self) -> i64 {
        *self
    }
}

/// Claims to give back without spending their attempt, each due again after its delay (0:
/// keep its place in line).
#[derive(Default)]
struct Releases {
    ids: Vec<i64>,
    tokens: Vec<Uuid>,
    /// The attempt each claim held (see `jobs_released_by`).
    attempts: Vec<i32>,
    delays_ms: Vec<i64>,
}

impl Releases {
    fn push(&mut self, id: i64, token: Uuid, attempt: i32, delay_ms: i64) {
        self.ids.push(id);
        self.tokens.push(token);
        self.attempts.push(attempt);
        self.delays_ms.push(delay_ms);
    }
}

/// Counts and settles what [`write_split`] did: saved claims are forgotten (their lanes
/// and dependants noted), claims that were no longer ours are reported, and a row that
/// could not be saved as asked goes `dead` with the reason, so that nothing stays
/// `running` behind a finished handler.
async fn settle<T: Into<SavedOrId>>(
    shared: &Shared,
    write: SplitWrite<T>,
    follow_up: &mut MoveOn,
    settled: &mut Vec<ClaimKey>,
    events: &mut HashMap<ClaimKey, JobEvent>,
    counter: &std::sync::atomic::AtomicU64,
) {
    let mut kept: HashSet<i64> = HashSet::with_capacity(write.saved.len());
    for row in write.saved {
        match row.into() {
            SavedOrId::Saved(row) => {
                follow_up.note(&row);
                kept.insert(row.id);
            }
            SavedOrId::Id(id) => {
                kept.insert(id);
            }
        }
    }
    counter.fetch_add(kept.len() as u64, Ordering::Relaxed);
    for (claim, reason) in &write.unsaved {
        let (id, token) = *claim;
        tracing::error!(
            job_id = id,
            error = %reason,
            "the job's outcome cannot be saved as it is; marking it dead with the reason"
        );
        let message = format!("the outcome of this attempt could not be saved: {reason}");
        let (ids, tokens) = ([id], [token]);
        let abandoned = write_split(shared, "mark unsavable", &ids, &tokens, |_| {
            jobs_abandon_many(&shared.pool, &ids, &tokens, &message)
        })
        .await;
        for row in &abandoned.saved {
            follow_up.note(row);
            kept.insert(row.id);
            let event = events.remove(claim).map(|event| JobEvent {
                outcome: JobEventOutcome::Dead {
                    error: message.clone(),
                },
                ..event
            });
            publish(shared, event);
        }
        if let Some((_, why)) = abandoned.unsaved.first() {
            tracing::error!(
                job_id = id,
                error = %why,
                "could not mark the job dead either; the reaper will take it back"
            );
        }
    }
    let unsaved: HashSet<ClaimKey> = write.unsaved.iter().map(|(claim, _)| *claim).collect();
    let left_held: HashSet<ClaimKey> = write.abandoned_to_reaper.iter().copied().collect();
    for claim in write.claims {
        if left_held.contains(&claim) {
            // The database stayed unreachable during a hard stop: the job stays `running`
            // until the reaper returns it, as with a crash.
            continue;
        }
        if !kept.contains(&claim.0) && !unsaved.contains(&claim) {
            shared.counters.lost.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                job_id = claim.0,
                "outcome discarded: the claim is no longer ours (reaped, cancelled or deleted)"
            );
            let event = events.remove(&claim).map(|event| JobEvent {
                outcome: JobEventOutcome::Lost,
                ..event
            });
            publish(shared, event);
        } else if kept.contains(&claim.0) {
            publish(shared, events.remove(&claim));
        }
        // Saved, found stale, or given up on: the heartbeat stops either way (an unsavable
        // job that could not be marked dead either is left to the reaper).
        settled.push(claim);
    }
}

/// Publishes a saved outcome's event to the subscribers, if it was built (someone was
/// subscribed) and anyone still is. Never waits: a subscriber that lags loses the oldest.
fn publish(shared: &Shared, event: Option<JobEvent>) {
    if let Some(event) = event {
        let _ = shared.events.send(event);
    }
}

/// A row a finishing statement returns: a saved job, or just its id (release).
enum SavedOrId {
    Saved(SavedJob),
    Id(i64),
}

impl From<SavedJob> for SavedOrId {
    fn from(row: SavedJob) -> Self {
        SavedOrId::Saved(row)
    }
}

impl From<i64> for SavedOrId {
    fn from(id: i64) -> Self {
        SavedOrId::Id(id)
    }
}
