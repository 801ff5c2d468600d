//! Helpers to test your jobs against a real Postgres, as `rivertest` and `Oban.Testing` do
//! (feature `testing`).
//!
//! - [`assert_enqueued`], [`refute_enqueued`] and [`enqueued`] look at what your code
//!   enqueued, on a pool or inside the test's own transaction, by kind and optionally by
//!   args (JSON containment: the keys you give must match), queue and priority.
//! - [`perform_job`] runs one enqueued job now through a real worker, the same executor
//!   and completer as in production (the same claim token fencing, the same outcome
//!   handling), and returns what became of it.
//! - [`drain_queue`] runs a worker on one queue until nothing in it is runnable, and
//!   returns what became of each job it ran, in the order the outcomes were saved.
//!
//! The guide, with a complete example, is `docs/testing-your-jobs.md`; the example is
//! `tests/testing_guide.rs`, which CI runs and compares with the guide.
//!
//! ```no_run
//! use serde::{Deserialize, Serialize};
//! use serde_json::json;
//! use skiplock::testing::{Enqueued, assert_enqueued, perform_job};
//! use skiplock::{EnqueueOptions, Job, JobContext, JobError, JobEventOutcome, Worker};
//!
//! #[derive(Serialize, Deserialize)]
//! struct SendWelcome {
//!     user_id: i64,
//! }
//!
//! impl Job for SendWelcome {
//!     const KIND: &'static str = "send_welcome";
//!     async fn run(self, _ctx: JobContext) -> Result<(), JobError> {
//!         Ok(())
//!     }
//! }
//!
//! # async fn example(pool: sqlx::PgPool) -> Result<(), skiplock::Error> {
//! skiplock::enqueue(&pool, &SendWelcome { user_id: 42 }, EnqueueOptions::default()).await?;
//! let job = assert_enqueued(&pool, &Enqueued::of::<SendWelcome>().args(json!({"user_id": 42})))
//!     .await
//!     .remove(0);
//! let event = perform_job(Worker::builder(pool.clone()).register::<SendWelcome>(), job.id).await?;
//! assert!(matches!(event.outcome, JobEventOutcome::Completed { .. }));
//! # Ok(()) }
//! ```

use std::future::Future;
use std::panic::Location;
use std::time::Duration;

use serde_json::Value;
use sqlx::PgExecutor;

use crate::db::admin::{KindJob, jobs_of_kind};
use crate::db::jobs::{JobRow, jobs_get};
use crate::error::{Error, Result};
use crate::job::{Job, JobId, JobState};
use crate::worker::WorkerBuilder;
use crate::worker::events::JobEvent;

/// Which enqueued jobs to look for: a kind, and optionally args, queue and priority. By
/// default only pending jobs (`waiting` or `queued`) match.
#[derive(Debug, Clone)]
pub struct Enqueued {
    kind: String,
    args: Option<Value>,
    queue: Option<String>,
    priority: Option<i16>,
    states: Vec<JobState>,
}

impl Enqueued {
    /// Jobs of `J`'s kind.
    pub fn of<J: Job>() -> Self {
        Self::kind(J::KIND)
    }

    /// Jobs of `kind` (for kinds enqueued with plain SQL or another language).
    pub fn kind(kind: impl Into<String>) -> Self {
        Self {
            kind: kind.into(),
            args: None,
            queue: None,
            priority: None,
            states: vec![JobState::Waiting, JobState::Queued],
        }
    }

    /// Only jobs whose args contain `args`: each key given must be there with that value
    /// (nested objects alike; Postgres's `@>`). A job enqueued under a unique key with
    /// policy `merge` has an array of payloads: match it with an array.
    pub fn args(mut self, args: Value) -> Self {
        self.args = Some(args);
        self
    }

    /// Only jobs of this queue.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// Only jobs of this priority.
    pub fn priority(mut self, priority: i16) -> Self {
        self.priority = Some(priority);
        self
    }

    /// Jobs in these states instead of the pending ones (for example
    /// `[JobState::Succeeded]` after a drain).
    pub fn in_states(mut self, states: &[JobState]) -> Self {
        self.states = states.to_vec();
        self
    }
}

/// Every job matching `what`, oldest first.
///
/// # Errors
///
/// [`Error::Database`] if the query fails.
pub async fn enqueued<'e>(db: impl PgExecutor<'e>, what: &Enqueued) -> Result<Vec<JobRow>> {
    let (matching, _) = of_kind(db, what).await?;
    Ok(matching)
}

/// The jobs of `what`'s kind and states: those that match `what`, and the others.
async fn of_kind<'e>(
    db: impl PgExecutor<'e>,
    what: &Enqueued,
) -> Result<(Vec<JobRow>, Vec<JobRow>)> {
    let rows = jobs_of_kind(
        db,
        &what.kind,
        &what.states,
        what.args.as_ref(),
        what.queue.as_deref(),
        what.priority,
    )
    .await?;
    let (matching, others): (Vec<KindJob>, Vec<KindJob>) =
        rows.into_iter().partition(|row| row.matches);
    Ok((
        matching.into_iter().map(|row| row.job).collect(),
        others.into_iter().map(|row| row.job).collect(),
    ))
}

/// Asserts that at least one job matches `what` and returns the matching jobs, oldest
/// first. Pass `&mut *tx` to look inside the test's own transaction.
///
/// A failed assertion's message starts with the file, line and column of this call: your
/// test's line, not skiplock's. (The check runs inside the returned future, which
/// `#[track_caller]` cannot reach, so the location is taken when this function is called
/// and written into the message.)
///
/// # Panics
///
/// When none matches (the message lists the other jobs of that kind in those states), or
/// when the query fails.
#[track_caller]
pub fn assert_enqueued<'e>(
    db: impl PgExecutor<'e>,
    what: &Enqueued,
) -> impl Future<Output = Vec<JobRow>> {
    let caller = Location::caller();
    async move {
        let (matching, others) = of_kind_or_panic(db, what, "assert_enqueued", caller).await;
        assert!(
            !matching.is_empty(),
            "{caller}: assert_enqueued: expected a job matching {what:?}; jobs of kind `{}` in \
             those states: {}",
            what.kind,
            describe(&others)
        );
        matching
    }
}

/// Asserts that no job matches `what`.
///
/// The panic message starts with the file, line and column of the call, as for
/// [`assert_enqueued`].
///
/// # Panics
///
/// When one does (the message lists them), or when the query fails.
#[track_caller]
pub fn refute_enqueued<'e>(db: impl PgExecutor<'e>, what: &Enqueued) -> impl Future<Output = ()> {
    let caller = Location::caller();
    async move {
        let (matching, _) = of_kind_or_panic(db, what, "refute_enqueued", caller).await;
        assert!(
            matching.is_empty(),
            "{caller}: refute_enqueued: expected no job matching {what:?}; found {}",
            describe(&matching)
        );
    }
}

/// [`of_kind`], or a panic that names the assert and where it was called.
async fn of_kind_or_panic<'e>(
    db: impl PgExecutor<'e>,
    what: &Enqueued,
    assert: &str,
    caller: &Location<'_>,
) -> (Vec<JobRow>, Vec<JobRow>) {
    of_kind(db, what)
        .await
        .unwrap_or_else(|e| panic!("{caller}: {assert}: cannot look for enqueued jobs: {e}"))
}

fn describe(jobs: &[JobRow]) -> String {
    if jobs.is_empty() {
        return "none".to_owned();
    }
    jobs.iter()
        .map(|job| {
            format!(
                "#{} {} queue {} priority {} args {}",
                job.id, job.state, job.queue, job.priority, job.args.0
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Longest a helper waits for its worker: a handler that runs longer fails the helper.
const PATIENCE: Duration = Duration::from_secs(300);

/// Runs the `queued` job `id` now (whatever its `scheduled_at`) through a worker built from
/// `builder` (register the job's kind and give it its data), and returns what became of
/// it once its outcome is saved: completed, retried (with the delay), snoozed, dead or
/// cancelled. Other jobs are left alone. `id` is a [`JobId`] (what `enqueue` returns) or
/// the `i64` of a row's `id` (what [`assert_enqueued`] returns).
///
/// **Not the production claim**: a paused queue, `max_running`, `rate_limit`,
/// `key_max_running` and `key_rate_limit` do not stop it (the test names the job it runs);
/// a lane does, as its waiting jobs are not `queued`. [`drain_queue`] claims as production
/// does, limits included.
///
/// # Errors
///
/// [`Error::InvalidJob`] when the job does not exist, is not `queued`, its kind is not
/// registered, or it could not be claimed (a job of its lane runs); what
/// [`Worker::run`](crate::Worker::run) returns otherwise.
pub async fn perform_job(builder: WorkerBuilder, id: impl Into<JobId>) -> Result<JobEvent> {
    let id: JobId = id.into();
    let job = jobs_get(builder.pool(), id)
        .await?
        .ok_or_else(|| Error::InvalidJob(format!("job {id} does not exist")))?;
    if job.state != JobState::Queued {
        return Err(Error::InvalidJob(format!(
            "job {id} is {}, not queued; only a queued job can be performed",
            job.state
        )));
    }
    if !builder.handles(&job.kind) {
        return Err(Error::InvalidJob(format!(
            "job {id} is of kind `{}`, which the worker does not register",
            job.kind
        )));
    }
    let worker = fast(builder)
        .queues([job.queue.clone()])
        .only_job(id.0)
        .build()?;
    let mut events = worker.subscribe();
    tokio::time::timeout(PATIENCE, worker.run())
        .await
        .map_err(|_| Error::InvalidJob(format!("job {id} did not finish within {PATIENCE:?}")))??;
    while let Some(event) = events.recv().await {
        if event.id == id {
            return Ok(event);
        }
    }
    Err(Error::InvalidJob(format!(
        "job {id} could not be claimed (a job of its ordering lane is running?)"
    )))
}

/// Runs a worker built from `builder` on `queue` until nothing in it is runnable (jobs
/// scheduled later stay), and returns the outcome of every attempt it ran, in the order
/// they were saved. A job that fails and is retried at once runs again within the drain.
///
/// # Errors
///
/// What [`Worker::run`](crate::Worker::run) returns.
pub async fn drain_queue(builder: WorkerBuilder, queue: &str) -> Result<Vec<JobEvent>> {
    let worker = fast(builder).queues([queue.to_owned()]).build()?;
    let mut events = worker.subscribe();
    tokio::time::timeout(PATIENCE, worker.run())
        .await
        .map_err(|_| {
            Error::InvalidJob(format!("queue `{queue}` did not drain within {PATIENCE:?}"))
        })??;
    let mut seen = Vec::new();
    while let Some(event) = events.recv().await {
        seen.push(event);
    }
    Ok(seen)
}

/// `builder` set to exit when idle, with short intervals and no maintenance, so that a
/// helper returns as soon as its work is done.
fn fast(builder: WorkerBuilder) -> WorkerBuilder {
    builder
        .exit_when_idle(true)
        .poll_interval(Duration::from_millis(50))
        .prune_interval(None)
        .cron_interval(None)
}
