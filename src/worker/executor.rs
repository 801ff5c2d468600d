//! The executor: takes claimed jobs from the local buffer as slots free up and runs each
//! on its own task. It decides each job's outcome and touches no SQL.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::{Notify, mpsc};
use tokio_util::task::TaskTracker;
use tracing::Instrument;
use uuid::Uuid;

use super::Shared;
use super::claims::ClaimHandles;
use super::events::{JobEvent, JobEventOutcome};
use crate::db::jobs::ClaimedJob;
use crate::enqueue::duration_ms;
use crate::job::{Fate, JobContext, JobId};
use crate::metrics;
use crate::trace_context::TraceContext;

/// What became of one claimed job, for the completer to save.
#[derive(Debug)]
pub(super) enum Outcome {
    /// The handler returned `Ok`.
    Succeeded,
    /// The attempt failed.
    Failed {
        message: String,
        fate: Fate,
        /// Retry delay the kind's policy chose, in milliseconds.
        delay_ms: i64,
    },
    /// Give the job back without counting the attempt.
    Released,
    /// The handler snoozed: give the job back without counting the attempt, due again in
    /// `delay_ms` milliseconds.
    Snoozed { delay_ms: i64 },
    /// The claim was taken from us; there is nothing to save.
    Lost,
}

/// An outcome tagged with the claim it belongs to.
#[derive(Debug)]
pub(super) struct Finished {
    pub(super) id: i64,
    pub(super) token: Uuid,
    /// The attempt the claim held: a release gives it back, which is how a release whose
    /// reply was lost is recognised as saved.
    pub(super) attempt: i32,
    pub(super) outcome: Outcome,
    /// The event to publish once the outcome is saved; `None` while nobody subscribes.
    pub(super) event: Option<JobEvent>,
    /// How long the handler ran.
    pub(super) took: Duration,
    /// The handler completed the job in its own transaction
    /// ([`JobContext::complete_in`]): if that transaction committed, the job succeeded
    /// whatever `outcome` says.
    pub(super) completed_in_tx: bool,
    /// Its key has a running limit ([`ClaimedJob::key_limited`]): its completion may hand
    /// the key's freed slot on to this worker.
    pub(super) key_limited: bool,
}

/// A claimed job in the local buffer, with what its handler gets from the claim
/// (registered by the producer when the claim landed).
pub(super) struct BufferedJob {
    pub(super) job: ClaimedJob,
    pub(super) handles: ClaimHandles,
}

/// Where a group's claimed jobs wait for a slot: the producer's buffer, and the jobs
/// completions handed on (see [`QueueGroup::handed`](super::QueueGroup::handed)), started
/// first, as their key's slot is already taken. Both close when the producer stops.
pub(super) struct Inboxes {
    pub(super) buffer: mpsc::Receiver<BufferedJob>,
    pub(super) handed: mpsc::UnboundedReceiver<BufferedJob>,
}

/// Starts buffered jobs while slots are free, until the graceful shutdown; then releases
/// whatever is still buffered.
pub(super) async fn dispatch(
    shared: Arc<Shared>,
    group: usize,
    inboxes: Inboxes,
    space: Arc<Notify>,
    outcomes: mpsc::UnboundedSender<Finished>,
    executors: TaskTracker,
) {
    let slots = shared.groups[group].slots.clone();
    let member = shared.groups[group].member;
    let Inboxes {
        mut buffer,
        mut handed,
    } = inboxes;
    // A job taken from the buffer that never got a slot before the shutdown.
    let mut in_hand = None;
    let mut handed_open = true;
    loop {
        // A job in hand first, then a slot: a queue waits for a slot only when it has work,
        // so an idle queue lends its share of the pool to the others (see `slots`).
        let buffered = tokio::select! {
            biased;
            () = shared.graceful.cancelled() => break,
            job = handed.recv(), if handed_open => match job {
                Some(buffered) => buffered,
                None => {
                    handed_open = false;
                    continue;
                }
            },
            job = buffer.recv() => match job {
                Some(buffered) => buffered,
                None => break,
            },
        };
        // A claim the heartbeat gave back while its job waited (see
        // `HeldClaims::beat_list`) is not this worker's to run: passed over, before or
        // after the wait for a slot.
        if buffered.handles.given_back() {
            space.notify_one();
            set_aside(&buffered.job, &shared.groups[group].series);
            continue;
        }
        let permit = tokio::select! {
            biased;
            () = shared.graceful.cancelled() => {
                in_hand = Some(buffered);
                break;
            }
            slot = slots.acquire(member) => slot,
        };
        space.notify_one();
        if !buffered.handles.start() {
            set_aside(&buffered.job, &shared.groups[group].series);
            continue;
        }
        metrics::buffered(-1.0);
        let BufferedJob { mut job, handles } = buffered;
        shared.groups[group]
            .started
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shared = shared.clone();
        let outcomes = outcomes.clone();
        // Every job runs in a span naming it, so the handler's own log lines carry it. At
        // ERROR level so that it is enabled whenever any line is: with RUST_LOG=warn an INFO
        // span is filtered out and a job's WARN and ERROR lines lost their context.
        let span = tracing::error_span!(
            "job",
            job_id = job.id,
            kind = %job.kind,
            queue = %job.queue,
            attempt = job.attempt
        );
        // The attempt continues the enqueuer's trace: its span is a child of the span that
        // enqueued the job (set before the span is first entered, as the layer requires).
        let trace = TraceContext::stored(job.traceparent.take(), job.tracestate.take());
        #[cfg(feature = "opentelemetry")]
        if let Some(trace) = &trace {
            trace.continue_in(&span);
        }
        executors.spawn(
            async move {
                let mut job = job;
                let id = job.id;
                let token = job.claim_token;
                let (attempt, max_attempts) = (job.attempt, job.max_attempts);
                let key_limited = job.key_limited;
                // The args go to the handler; the job's kind and queue stay here for the
                // metrics and the event, without a copy per job.
                let args = std::mem::take(&mut job.args.0);
                let started = std::time::Instant::now();
                metrics::running(1.0);
                let outcome = execute(&shared, &job, args, trace, &handles).await;
                let completed_in_tx = handles
                    .completed_in_tx
                    .load(std::sync::atomic::Ordering::Acquire);
                metrics::running(-1.0);
                let took = started.elapsed();
                let ended = report_outcome(&outcome, attempt, max_attempts, took);
                // Only a stopped handler can have been stopped by a cancel: no lock per
                // job otherwise.
                let ended = if matches!(outcome, Outcome::Lost)
                    && shared.claims.was_cancelled((id, token))
                {
                    "cancelled"
                } else {
                    ended
                };
                shared.groups[group]
                    .series
                    .job_ended(&job.kind, ended, took);
                let event = (shared.events.receiver_count() > 0).then(|| JobEvent {
                    id: JobId(id),
                    kind: job.kind,
                    queue: job.queue,
                    attempt,
                    outcome: event_outcome(&outcome, ended, took),
                });
                shared.claims.mark_finished((id, token));
                // The completer outlives every executor, so the send only fails if it
                // crashed.
                let _ = outcomes.send(Finished {
                    id,
                    token,
                    attempt,
                    outcome,
                    event,
                    took,
                    completed_in_tx,
                    key_limited,
                });
                drop(permit);
            }
            .instrument(span),
        );
    }
    // The producer stops on the same signal; once its claims in flight have landed, the
    // buffer closes. Nothing is released before then: a release committed earlier could be
    // claimed again by one of those claims, and the job released twice.
    let mut unstarted: Vec<BufferedJob> = in_hand.into_iter().collect();
    while let Some(buffered) = buffer.recv().await {
        unstarted.push(buffered);
    }
    while let Some(buffered) = handed.recv().await {
        unstarted.push(buffered);
    }
    for buffered in unstarted {
        if buffered.handles.given_back() {
            // Released by the heartbeat already.
            set_aside(&buffered.job, &shared.groups[group].series);
            continue;
        }
        release_unstarted(buffered.job, &shared.groups[group].series, &outcomes);
    }
}

/// Counts a claimed job that leaves the buffer without starting as released: given back
/// by the heartbeat, or by [`release_unstarted`].
fn set_aside(job: &ClaimedJob, series: &metrics::JobSeries) {
    metrics::buffered(-1.0);
    series.job_released_unstarted(&job.kind);
}

/// Gives a claimed job that never started back to the queue (through the completer).
fn release_unstarted(
    job: ClaimedJob,
    series: &metrics::JobSeries,
    outcomes: &mpsc::UnboundedSender<Finished>,
) {
    set_aside(&job, series);
    let _ = outcomes.send(Finished {
        id: job.id,
        token: job.claim_token,
        attempt: job.attempt,
        outcome: Outcome::Released,
        event: None,
        took: Duration::ZERO,
        completed_in_tx: false,
        key_limited: false,
    });
}

/// Runs one job to its outcome: decode, run with the kind's timeout, catch panics, and
/// stop early if the claim is lost or the worker shuts down hard.
async fn execute(
    shared: &Shared,
    job: &ClaimedJob,
    args: serde_json::Value,
    trace_context: Option<TraceContext>,
    handles: &ClaimHandles,
) -> Outcome {
    let Some(handler) = shared.handlers.get(&job.kind).cloned() else {
        // Unreachable: the claim filters on registered kinds. Give the job back untouched.
        return Outcome::Released;
    };
    let stop = handles.stop.clone();
    let ctx = JobContext {
        id: JobId(job.id),
        kind: job.kind.clone(),
        queue: job.queue.clone(),
        attempt: job.attempt,
        max_attempts: job.max_attempts,
        pool: shared.pool.clone(),
        claim_token: job.claim_token,
        stop: stop.clone(),
        completed_in_tx: handles.completed_in_tx.clone(),
        data: shared.data.clone(),
        trace_context,
    };
    let timeout = handler.timeout();
    let policy_delay_ms = delay_ms(handler.retry_delay(job.attempt));
    let run = AssertUnwindSafe(async move { handler.call(args, ctx).await }).catch_unwind();
    let timed = async {
        match timeout {
            Some(limit) => tokio::time::timeout(limit, run).await.ok(),
            None => Some(run.await),
        }
    };
    let result = tokio::select! {
        biased;
        () = stop.cancelled() => {
            return if shared.hard.is_cancelled() { Outcome::Released } else { Outcome::Lost };
        }
        result = timed => result,
    };
    let failed = |message: String, fate: Fate| Outcome::Failed {
        message,
        fate,
        delay_ms: match fate {
            Fate::RetryAfter(delay) => delay_ms(delay),
            _ => policy_delay_ms,
        },
    };
    match result {
        None => failed(
            format!(
                "timed out after {:?} (kind `{}`)",
                timeout.unwrap_or_default(),
                job.kind
            ),
            Fate::Retry,
        ),
        Some(Err(panic)) => failed(
            format!("handler panicked: {}", panic_message(&*panic)),
            Fate::Retry,
        ),
        Some(Ok(Ok(()))) => Outcome::Succeeded,
        Some(Ok(Err(error))) => match error.fate() {
            Fate::Snooze(delay) => Outcome::Snoozed {
                delay_ms: delay_ms(delay),
            },
            fate => failed(error.message().to_owned(), fate),
        },
    }
}

/// Longest retry or snooze delay saved, in milliseconds: 100 years. A longer one (say
/// `Duration::MAX`) would overflow Postgres's interval and the outcome could not be saved.
const DELAY_MAX_MS: i64 = 100 * 366 * 24 * 3600 * 1000;

/// `delay` in milliseconds, at most [`DELAY_MAX_MS`].
fn delay_ms(delay: Duration) -> i64 {
    duration_ms(delay).min(DELAY_MAX_MS)
}

/// Logs what became of a job, once, inside its span (id, kind, queue, attempt), at the
/// level an operator expects: a success at debug, a retry or a stop by cancellation at
/// info and warn, a job that goes `dead` at error (the completer reports a claim lost to
/// the reaper or to a cancellation). Returns the outcome's name for [`metrics::JOBS`].
fn report_outcome(
    outcome: &Outcome,
    attempt: i32,
    max_attempts: i32,
    took: Duration,
) -> &'static str {
    let took_ms = took.as_millis() as u64;
    let (message, fate, delay_ms) = match outcome {
        Outcome::Succeeded => {
            tracing::debug!(took_ms, "job succeeded");
            return "succeeded";
        }
        Outcome::Released => {
            tracing::debug!("job released: back in line, attempt given back");
            return "released";
        }
        Outcome::Lost => return "lost",
        Outcome::Snoozed { delay_ms } => {
            tracing::debug!(
                took_ms,
                snooze_ms = delay_ms,
                "job snoozed; attempt given back"
            );
            return "snoozed";
        }
        Outcome::Failed {
            message,
            fate,
            delay_ms,
        } => (message, fate, delay_ms),
    };
    match fate {
        Fate::Cancel => {
            tracing::info!(error = %message, took_ms, "job cancelled by its handler");
            "cancelled"
        }
        Fate::Dead => {
            tracing::error!(
                error = %message,
                took_ms,
                "job failed and is dead: its handler gave up"
            );
            "dead"
        }
        Fate::Retry | Fate::RetryAfter(_) | Fate::Snooze(_) if attempt >= max_attempts => {
            tracing::error!(
                error = %message,
                took_ms,
                max_attempts,
                "job failed and is dead: no attempt left"
            );
            "dead"
        }
        Fate::Retry | Fate::RetryAfter(_) | Fate::Snooze(_) => {
            tracing::warn!(
                error = %message,
                took_ms,
                retry_in_ms = delay_ms,
                "job failed; will retry"
            );
            "retried"
        }
    }
}

/// The event an outcome named `ended` (see [`report_outcome`]) publishes once saved.
fn event_outcome(outcome: &Outcome, ended: &str, took: Duration) -> JobEventOutcome {
    match (outcome, ended) {
        (_, "cancelled") => JobEventOutcome::Cancelled,
        (Outcome::Succeeded, _) => JobEventOutcome::Completed { took },
        (Outcome::Released, _) => JobEventOutcome::Released,
        (Outcome::Snoozed { delay_ms }, _) => JobEventOutcome::Snoozed {
            snooze_for: Duration::from_millis(u64::try_from(*delay_ms).unwrap_or(0)),
        },
        (Outcome::Lost, _) => JobEventOutcome::Lost,
        (Outcome::Failed { message, .. }, "dead") => JobEventOutcome::Dead {
            error: message.clone(),
        },
        (
            Outcome::Failed {
                message, delay_ms, ..
            },
            _,
        ) => JobEventOutcome::Retried {
            error: message.clone(),
            retry_in: Duration::from_millis(u64::try_from(*delay_ms).unwrap_or(0)),
        },
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_owned())
}
