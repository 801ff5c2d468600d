//! What a job is: the [`Job`] trait, its identity and state, enqueue options, and the
//! error a handler returns to decide the job's fate.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::PgPool;

use crate::trace_context::TraceContext;
use tokio_util::sync::CancellationToken;

use crate::backoff;
use crate::db::jobs::{RunningNote, jobs_set_note};
pub use crate::state::{JobId, JobState, UniquePolicy};

/// Maximum attempts when neither the job type nor the enqueue options say otherwise:
/// [`Job::MAX_ATTEMPTS`]'s default, for the places that have no job type.
pub(crate) const MAX_ATTEMPTS_DEFAULT: i32 = Defaults::MAX_ATTEMPTS;

/// Queue name when neither the job type nor the enqueue options say otherwise:
/// [`Job::QUEUE`]'s default, for the places that have no job type (an untyped enqueue, a
/// cron schedule, a worker's queues).
pub(crate) const QUEUE_DEFAULT: &str = Defaults::QUEUE;

/// A job type that keeps every default of [`Job`], so that the defaults are written once,
/// as literals in the trait (where rustdoc shows them), and read from there.
#[derive(serde::Serialize, serde::Deserialize)]
struct Defaults;

impl Job for Defaults {
    const KIND: &'static str = "";

    async fn run(self, _ctx: JobContext) -> Result<(), JobError> {
        Ok(())
    }
}

/// A typed job: its serde-encoded value is the job's `args`.
///
/// Implement it on the struct that carries the arguments; `run` does the work.
///
/// ```
/// use skiplock::{Job, JobContext, JobError};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct SendEmail { to: String }
///
/// impl Job for SendEmail {
///     const KIND: &'static str = "send_email";
///
///     async fn run(self, _ctx: JobContext) -> Result<(), JobError> {
///         if self.to.is_empty() {
///             return Err(JobError::permanent("no recipient"));
///         }
///         Ok(())
///     }
/// }
/// ```
pub trait Job: Serialize + DeserializeOwned + Send + 'static {
    /// The kind stored in `skiplock.jobs.kind`; workers claim only kinds they registered.
    const KIND: &'static str;

    /// Queue used when the enqueue options name none.
    const QUEUE: &'static str = "default";

    /// Attempts before the job goes `dead`, when the enqueue options name none.
    const MAX_ATTEMPTS: i32 = 25;

    /// Does the work. `Ok` completes the job; an error decides its fate (see [`JobError`]).
    fn run(self, ctx: JobContext) -> impl Future<Output = Result<(), JobError>> + Send;

    /// Delay before retry number `attempt` (1-based: the attempt that just failed).
    /// Defaults to [`backoff::default_delay`].
    fn retry_delay(attempt: i32) -> Duration {
        backoff::default_delay(attempt)
    }

    /// Longest a single attempt may run; past it the handler is stopped and the attempt
    /// fails as retryable. `None` (the default) means no limit.
    fn timeout() -> Option<Duration> {
        None
    }
}

/// When an enqueued job may run first ([`EnqueueOptions::schedule`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Not before this instant.
    At(DateTime<Utc>),
    /// Not before this long after the enqueuing statement, by the database clock (so
    /// that a worker host's clock does not matter).
    After(Duration),
}

/// Options for one enqueued job. Unset fields fall back to the job type's constants
/// (typed jobs) or the column defaults.
///
/// Built with [`EnqueueOptions::new`] and its setters; the fields are public to read (and
/// to set one by one), and `#[non_exhaustive]` so that options added later break no
/// caller.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct EnqueueOptions {
    /// Queue name; workers claim only their configured queues.
    pub queue: Option<String>,
    /// Lower runs first. Default 0.
    pub priority: Option<i16>,
    /// When the job may run first; `None`: at once.
    pub schedule: Option<Schedule>,
    /// Attempts before the job goes `dead` (at least 1).
    pub max_attempts: Option<i32>,
    /// Strict FIFO lane: jobs with the same key run one at a time, in enqueue order.
    pub ordering_key: Option<String>,
    /// Concurrency key (a tenant, an account): in a queue with a `key_max_running`
    /// ([`QueueLimits::key_max_running`](crate::QueueLimits::key_max_running)), at most
    /// that many jobs of one key run at once, in no particular order among them.
    pub concurrency_key: Option<String>,
    /// Deduplication key: at most one pending (not yet running) job per key.
    pub unique_key: Option<String>,
    /// What happens when a pending job already has `unique_key`.
    pub on_conflict: UniquePolicy,
    /// Jobs that must all succeed before this one runs. Cannot be combined with a unique
    /// key or an ordering key.
    pub depends_on: Vec<JobId>,
    /// The trace the job continues (see [`TraceContext`]). `None`: under the
    /// `opentelemetry` feature, the current span's context; without it, no trace. A job
    /// folded into a pending one by its unique key keeps the pending job's trace.
    pub trace_context: Option<TraceContext>,
}

impl EnqueueOptions {
    /// Options with every field unset.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the queue.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// Sets the priority (lower runs first).
    pub fn priority(mut self, priority: i16) -> Self {
        self.priority = Some(priority);
        self
    }

    /// Runs the job no earlier than `at`. Replaces a [`run_after`](Self::run_after) set
    /// before: the last of the two set decides.
    pub fn run_at(mut self, at: DateTime<Utc>) -> Self {
        self.schedule = Some(Schedule::At(at));
        self
    }

    /// Runs the job no earlier than `delay` after it is enqueued (database clock).
    /// Replaces a [`run_at`](Self::run_at) set before: the last of the two set decides.
    pub fn run_after(mut self, delay: Duration) -> Self {
        self.schedule = Some(Schedule::After(delay));
        self
    }

    /// Sets the attempt budget.
    pub fn max_attempts(mut self, max_attempts: i32) -> Self {
        self.max_attempts = Some(max_attempts);
        self
    }

    /// Puts the job in a strict FIFO lane.
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Sets the concurrency key: the queue's `key_max_running`, if it has one, bounds the
    /// jobs of this key that run at once.
    pub fn concurrency_key(mut self, key: impl Into<String>) -> Self {
        self.concurrency_key = Some(key.into());
        self
    }

    /// Deduplicates on `key` with `policy`.
    pub fn unique_key(mut self, key: impl Into<String>, policy: UniquePolicy) -> Self {
        self.unique_key = Some(key.into());
        self.on_conflict = policy;
        self
    }

    /// Makes the job wait until every job in `parents` succeeded.
    pub fn depends_on(mut self, parents: impl IntoIterator<Item = JobId>) -> Self {
        self.depends_on.extend(parents);
        self
    }

    /// Records `context` as the trace each attempt of the job continues: the headers of
    /// the request that caused the job, say ([`TraceContext::from_headers`]).
    pub fn trace_context(mut self, context: TraceContext) -> Self {
        self.trace_context = Some(context);
        self
    }
}

/// What a running handler knows about its job, and how it learns it must stop.
#[derive(Debug, Clone)]
pub struct JobContext {
    pub(crate) id: JobId,
    pub(crate) kind: String,
    pub(crate) queue: String,
    pub(crate) attempt: i32,
    pub(crate) max_attempts: i32,
    pub(crate) pool: crate::DbPool,
    pub(crate) claim_token: uuid::Uuid,
    pub(crate) stop: CancellationToken,
    /// Set once [`complete_in`](JobContext::complete_in) wrote the completion (see
    /// `worker::claims`).
    pub(crate) completed_in_tx: Arc<std::sync::atomic::AtomicBool>,
    pub(crate) data: Arc<DataMap>,
    pub(crate) trace_context: Option<TraceContext>,
}

/// Values shared with every handler of a worker, by type (see
/// [`WorkerBuilder::data`](crate::WorkerBuilder::data)).
pub(crate) type DataMap = HashMap<TypeId, Arc<dyn Any + Send + Sync>>;

impl JobContext {
    /// The job's id.
    pub fn id(&self) -> JobId {
        self.id
    }

    /// The job's kind.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The job's queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// This attempt's number, starting at 1.
    pub fn attempt(&self) -> i32 {
        self.attempt
    }

    /// The job's attempt budget.
    pub fn max_attempts(&self) -> i32 {
        self.max_attempts
    }

    /// The trace context the job was enqueued with, as stored (`traceparent`,
    /// `tracestate`): for a handler that passes it on, to an HTTP call or a program it
    /// starts. `None` for a job enqueued outside any trace. Under the `opentelemetry`
    /// feature the attempt's span already continues it, and the current span's context
    /// (`TraceContext::current()`) is the one to pass on.
    pub fn trace_context(&self) -> Option<&TraceContext> {
        self.trace_context.as_ref()
    }

    /// The worker's connection pool, for handlers that write to the database. Behind
    /// PgBouncer's transaction pooling, run statements on it through
    /// [`PgBouncer`](crate::PgBouncer) (or unnamed, `.persistent(false)`, inside a
    /// transaction).
    pub fn pool(&self) -> &PgPool {
        self.pool.pool()
    }

    /// The value of type `T` given to the worker with
    /// [`WorkerBuilder::data`](crate::WorkerBuilder::data): an HTTP client, a config, a
    /// shared recorder. `None` if the worker was given none.
    pub fn data<T: Send + Sync + 'static>(&self) -> Option<&T> {
        self.data.get(&TypeId::of::<T>())?.downcast_ref::<T>()
    }

    /// Records the job's progress (any JSON) in `skiplock.jobs.progress`, where operators
    /// see it. Fenced like every write: it changes nothing once the claim is lost.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database) if the write fails.
    pub async fn set_progress(&self, progress: serde_json::Value) -> crate::Result<()> {
        self.set_note(RunningNote::Progress, &progress).await
    }

    /// Records the job's output (any JSON) in `skiplock.jobs.output`. Fenced like
    /// [`set_progress`](Self::set_progress).
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database) if the write fails.
    pub async fn set_output(&self, output: serde_json::Value) -> crate::Result<()> {
        self.set_note(RunningNote::Output, &output).await
    }

    async fn set_note(&self, note: RunningNote, value: &serde_json::Value) -> crate::Result<()> {
        jobs_set_note(&self.pool, self.id.0, self.claim_token, note, value).await?;
        Ok(())
    }

    /// Completes the job inside `tx`, the handler's own transaction: the handler's writes
    /// and the job's `succeeded` commit together or not at all. This is the path to an
    /// exactly-once *effect* for work that stays in this database (the job itself still
    /// runs at least once: a crash before the commit runs it again, and the rolled-back
    /// writes are as if that attempt never happened).
    ///
    /// Fenced by the claim token like every completion: if the claim was lost (the job
    /// was reaped, cancelled or deleted), this returns [`Error::ClaimLost`] and the
    /// handler must roll back (`?` does, by dropping the transaction). Once the
    /// transaction commits the job has succeeded, whatever the handler returns after; if
    /// it rolls back, the handler's result decides as usual. Lanes and dependants move on
    /// after the handler returns, as for any completion.
    ///
    /// ```no_run
    /// # use skiplock::{Job, JobContext, JobError};
    /// # #[derive(serde::Serialize, serde::Deserialize)]
    /// # struct Credit { account: i64, cents: i64 }
    /// # impl Job for Credit {
    /// #     const KIND: &'static str = "credit";
    /// async fn run(self, ctx: JobContext) -> Result<(), JobError> {
    ///     let mut tx = ctx.pool().begin().await?;
    ///     sqlx::query("UPDATE accounts SET cents = cents + $2 WHERE id = $1")
    ///         .bind(self.account)
    ///         .bind(self.cents)
    ///         .execute(&mut *tx)
    ///         .await?;
    ///     ctx.complete_in(&mut tx).await?;
    ///     tx.commit().await?;
    ///     Ok(())
    /// }
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::ClaimLost`] if the claim is no longer held;
    /// [`Error::Database`](crate::Error::Database) if the write fails.
    ///
    /// [`Error::ClaimLost`]: crate::Error::ClaimLost
    pub async fn complete_in(&self, tx: &mut sqlx::PgConnection) -> crate::Result<()> {
        let saved =
            match crate::db::jobs::jobs_complete_many(&mut *tx, &[self.id.0], &[self.claim_token])
                .await
            {
                Ok(saved) => saved,
                // The job left `running` while the statement waited for its row (a cancel,
                // the reaper making it dead): Postgres moved it to the finished partition.
                // The claim is lost; the transaction is aborted either way.
                Err(e) if crate::error::is_row_moved(&e) => Vec::new(),
                Err(e) => return Err(e.into()),
            };
        if saved.is_empty() {
            return Err(crate::Error::ClaimLost { id: self.id });
        }
        self.completed_in_tx
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Resolves when the handler should stop: the claim was lost (reaped, cancelled) or the
    /// worker is shutting down hard. The runtime drops the handler's future soon after,
    /// so a handler needs this only to stop work it started outside its future.
    pub async fn stopped(&self) {
        self.stop.cancelled().await
    }

    /// Whether [`stopped`](Self::stopped) has resolved.
    pub fn is_stopped(&self) -> bool {
        self.stop.is_cancelled()
    }
}

/// What a handler's failure means for its job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fate {
    /// Retry with the kind's backoff, or go `dead` when attempts are exhausted.
    Retry,
    /// Retry after exactly this delay (still bounded by `max_attempts`).
    RetryAfter(Duration),
    /// Go `dead` now, whatever attempts remain.
    Dead,
    /// Go `cancelled` now.
    Cancel,
    /// Not a failure: run again after this delay, without spending the attempt and without
    /// an entry in `errors` (see [`JobError::snooze`]).
    Snooze(Duration),
}

/// A handler's failure: a message for `last_error` and the job's [`Fate`].
///
/// Every error a Rust developer has at hand converts into a retryable `JobError`, so `?`
/// works in handlers: any `std::error::Error + Send + Sync`, `anyhow::Error`,
/// `Box<dyn Error + Send + Sync>`, `String` and `&str` (whatever converts into
/// `Box<dyn Error + Send + Sync>`). The message keeps the cause chain, each cause after a
/// `": "` as anyhow's `{:#}` prints it (a cause the message already ends with is not
/// repeated).
#[derive(Debug)]
pub struct JobError {
    message: String,
    fate: Fate,
}

impl JobError {
    /// A failure worth retrying with the kind's backoff.
    pub fn retry(message: impl fmt::Display) -> Self {
        Self::with_fate(message, Fate::Retry)
    }

    /// A failure to retry after `delay` (for example a `Retry-After` header).
    pub fn retry_after(delay: Duration, message: impl fmt::Display) -> Self {
        Self::with_fate(message, Fate::RetryAfter(delay))
    }

    /// A failure no retry can fix: the job goes `dead` at once.
    pub fn permanent(message: impl fmt::Display) -> Self {
        Self::with_fate(message, Fate::Dead)
    }

    /// Gives up on the job: it goes `cancelled`.
    pub fn cancel(message: impl fmt::Display) -> Self {
        Self::with_fate(message, Fate::Cancel)
    }

    /// Not a failure: the job goes back to `queued`, due `delay` from when the worker saves
    /// it, with its attempt given back and nothing added to `errors` or `last_error`. For
    /// work that is not ready yet (an upstream still processing, a rate limit's window).
    /// A lane's next job still waits behind a snoozed one. `delay` is saved in whole
    /// milliseconds, at most 100 years (as every retry delay).
    pub fn snooze(delay: Duration) -> Self {
        Self::with_fate(format!("snoozed for {delay:?}"), Fate::Snooze(delay))
    }

    fn with_fate(message: impl fmt::Display, fate: Fate) -> Self {
        Self {
            message: message.to_string(),
            fate,
        }
    }

    /// The message recorded in `last_error`.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// What happens to the job.
    pub fn fate(&self) -> Fate {
        self.fate
    }
}

impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl<E> From<E> for JobError
where
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
{
    fn from(error: E) -> Self {
        let error: Box<dyn std::error::Error + Send + Sync + 'static> = error.into();
        JobError::retry(with_causes(&*error))
    }
}

/// `error`'s message followed by each of its causes.
fn with_causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut cause = error.source();
    while let Some(next) = cause {
        let text = next.to_string();
        if !message.ends_with(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        cause = next.source();
    }
    message
}
