//! # skiplock
//!
//! A job queue that keeps its jobs in Postgres.
//!
//! - **Transactional enqueue**: enqueue inside the transaction that writes your data; the
//!   job exists if and only if the transaction commits.
//! - **Fenced claims**: workers claim jobs in batches with `SELECT … FOR UPDATE SKIP
//!   LOCKED`; each claim carries a fresh `claim_token`, and only a write presenting it can
//!   heartbeat, complete or fail the job. A worker whose claim was taken back changes
//!   nothing.
//! - **No stuck jobs**: every worker heartbeats its claims once per interval, and a reaper
//!   returns jobs whose heartbeat went stale to the queue, by the database clock.
//!
//! ## Quick start
//!
//! ```no_run
//! use serde::{Deserialize, Serialize};
//! use skiplock::{Job, JobContext, JobError, Worker};
//!
//! #[derive(Serialize, Deserialize)]
//! struct SendWelcome {
//!     user_id: i64,
//! }
//!
//! impl Job for SendWelcome {
//!     const KIND: &'static str = "send_welcome";
//!
//!     async fn run(self, ctx: JobContext) -> Result<(), JobError> {
//!         println!("welcome, user {} (attempt {})", self.user_id, ctx.attempt());
//!         Ok(())
//!     }
//! }
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
//! skiplock::migrate(&pool).await?;
//!
//! // Enqueue in the same transaction as the data it refers to.
//! let mut tx = pool.begin().await?;
//! skiplock::enqueue(&mut *tx, &SendWelcome { user_id: 42 }).await?;
//! tx.commit().await?;
//!
//! // Run a worker until it has nothing left to do.
//! Worker::builder(pool)
//!     .register::<SendWelcome>()
//!     .exit_when_idle(true)
//!     .build()?
//!     .run()
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! Other languages enqueue with plain SQL: `SELECT skiplock.enqueue('send_welcome',
//! '{"user_id": 42}')` or `INSERT INTO skiplock.jobs (kind, args) VALUES (…)`.

// The public surface is what users need: an item `pub` inside a private module must be
// exported, or be `pub(crate)`.
#![warn(unreachable_pub)]

pub mod admin;
pub mod builtin;
pub mod cron;
// Every statement skiplock runs. Private, so that an application cannot run one that only
// the runtime may (a claim, a heartbeat, a reap); the operator's reads and actions are
// public in `admin`. The `internals` feature, for skiplock's own tests and benchmarks,
// makes it public; it is not part of the API.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod db;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub)] // its items are `pub` for the `internals` build
mod db;
#[cfg(feature = "embedded")]
pub mod embedded;
mod enqueue;
mod error;
mod job;
mod maintenance;
mod metrics;
mod pacing;
mod pool;
mod read_only;
pub mod retry;
mod state;
pub mod stats;
#[cfg(feature = "testing")]
pub mod testing;
pub mod worker;

pub use db::jobs::JobRow;
pub use enqueue::{
    ARGS_MAX_BYTES_DEFAULT, EnqueueOutcome, EnqueueResult, NewJob, QUEUE_NAME_MAX_BYTES, enqueue,
    enqueue_many, enqueue_raw, enqueue_raw_with_results, enqueue_with, enqueue_with_result,
};
pub use error::{Error, Result};
pub use job::{
    EnqueueOptions, Fate, Job, JobContext, JobError, JobId, JobState, MAX_ATTEMPTS_DEFAULT,
    QUEUE_DEFAULT, UniquePolicy,
};
pub use pool::{DbPool, SESSION_PINNED, pin_session};
pub use worker::events::{JobEvent, JobEventOutcome, JobEvents};
pub use worker::{Retention, ShutdownHandle, Worker, WorkerBuilder, WorkerConfig, WorkerSummary};

/// Brings the `skiplock` schema up to date; safe to call at every start and from many
/// processes at once. Returns the schema version now in force.
///
/// # Errors
///
/// [`Error::SchemaTooNew`] if a newer skiplock migrated this database,
/// [`Error::Migration`] if a migration fails (nothing of it is kept),
/// [`Error::Database`] if Postgres cannot be reached.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<i32> {
    db::migrations::migrations_apply(pool).await
}

/// Checks that the database holds exactly the schema version this build was written
/// for. Workers call it before they start; so does `skiplock enqueue`, so a job is never
/// written into a schema that no worker of this build would run.
///
/// # Errors
///
/// [`Error::SchemaOutdated`] (run [`migrate`]) or [`Error::SchemaTooNew`] (upgrade
/// skiplock) when the versions differ, [`Error::Database`] if Postgres cannot be reached.
pub async fn check_schema(pool: &sqlx::PgPool) -> Result<()> {
    schema_fits(db::migrations::schema_version(pool).await?)
}

/// Whether schema version `found` is the one this build was written for; the error
/// [`check_schema`] returns when it is not.
pub(crate) fn schema_fits(found: i32) -> Result<()> {
    let expected = db::migrations::SCHEMA_VERSION_LATEST;
    match found.cmp(&expected) {
        std::cmp::Ordering::Less => Err(Error::SchemaOutdated { found, expected }),
        std::cmp::Ordering::Greater => Err(Error::SchemaTooNew {
            found,
            supported: expected,
        }),
        std::cmp::Ordering::Equal => Ok(()),
    }
}

/// Pauses a queue: workers claim nothing from it until it is resumed; running jobs
/// finish. Same as `SELECT skiplock.pause_queue(name)`.
///
/// # Errors
///
/// [`Error::Database`] if the statement fails.
pub async fn pause_queue<'e>(db: impl sqlx::PgExecutor<'e>, queue: &str) -> Result<()> {
    Ok(db::queues::queues_pause(db, queue).await?)
}

/// Resumes a paused queue and wakes its workers. Same as
/// `SELECT skiplock.resume_queue(name)`.
///
/// # Errors
///
/// [`Error::Database`] if the statement fails.
pub async fn resume_queue<'e>(db: impl sqlx::PgExecutor<'e>, queue: &str) -> Result<()> {
    Ok(db::queues::queues_resume(db, queue).await?)
}

/// Fetches one job by id, as operators see it.
///
/// # Errors
///
/// [`Error::Database`] if the query fails.
pub async fn job<'e>(db: impl sqlx::PgExecutor<'e>, id: JobId) -> Result<Option<JobRow>> {
    Ok(db::jobs::jobs_get(db, id).await?)
}

/// Puts a `dead`, `cancelled`, `succeeded` or scheduled job back in line to run now, with
/// one more attempt if it had none left. Returns false if the job is running, waiting or
/// does not exist. Same as `SELECT skiplock.retry_job(id)`.
///
/// # Errors
///
/// [`Error::Database`] if the statement fails.
pub async fn retry<'e>(db: impl sqlx::PgExecutor<'e>, id: JobId) -> Result<bool> {
    Ok(db::jobs::jobs_retry(db, id).await?)
}

/// Cancels a job that has not finished: a queued job never runs, a running job's handler
/// is stopped at its worker's next heartbeat. Returns false if the job had finished or
/// does not exist. Same as `SELECT skiplock.cancel_job(id)`.
///
/// # Errors
///
/// [`Error::Database`] if the statement fails.
pub async fn cancel<'e>(db: impl sqlx::PgExecutor<'e>, id: JobId) -> Result<bool> {
    Ok(db::jobs::jobs_cancel(db, id).await?)
}
