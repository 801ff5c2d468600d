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
//! use skiplock::{EnqueueOptions, Job, JobContext, JobError, Worker};
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
//! skiplock::enqueue(&mut *tx, &SendWelcome { user_id: 42 }, EnqueueOptions::default()).await?;
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
//!
//! ## Where things are
//!
//! - **Enqueue**, in three forms, each on any executor (a pool, a connection, `&mut *tx`)
//!   and each saying what it did ([`EnqueueResult`]): [`enqueue`] (one typed job, with
//!   [`EnqueueOptions`]), [`enqueue_many`] (many, one statement) and [`enqueue_raw`]
//!   (untyped: [`NewJob`], a kind and JSON args).
//! - **Run**: the [`Job`] trait, and a [`Worker`] built with [`Worker::builder`], whose
//!   methods ([`WorkerBuilder`]) state every setting's default.
//! - **Jobs and queues**, at the root: [`job`], [`jobs`], [`retry`], [`retry_dead`],
//!   [`cancel`], [`pause_queue`], [`resume_queue`], [`paused_queues`]. The operator's
//!   other reads (history, dependencies, counts) are in [`admin`], numbers in [`stats`],
//!   schedules in [`cron`], the default retry delays in [`backoff`].
//! - **Schema**: [`migrate`] at every start, [`check_schema`] to refuse a mismatch.
//! - **Behind PgBouncer** in transaction-pooling mode: skiplock's functions on your pool
//!   through [`PgBouncer`], a worker with [`WorkerBuilder::pgbouncer`].
//!
//! ## How big args may be
//!
//! The database refuses `args` larger than 1 MiB by default, measured as Postgres prints
//! jsonb (`octet_length(args::text)`). Big payloads belong in your own tables or object
//! storage, with the job carrying a reference. The limit is the database's, enforced on
//! every path (the Rust API, plain `INSERT`, `skiplock.enqueue`) and read from the setting
//! `skiplock.args_max_bytes`: per database (`ALTER DATABASE app SET
//! skiplock.args_max_bytes = 4194304`), per role, or per pool (a session setting in the
//! connect options, as `skiplock --args-max-bytes` does), at least 4096: the database
//! checks only args over 4 KiB. An enqueue over it fails with [`Error::InvalidJob`] and
//! writes nothing.

// The public surface is what users need: an item `pub` inside a private module must be
// exported, or be `pub(crate)`.
#![warn(unreachable_pub)]

pub mod admin;
mod awaiting;
pub mod backoff;
pub mod builtin;
pub mod cron;
// Every statement skiplock runs. Private, so that an application cannot run one that only
// the runtime may (a claim, a heartbeat, a reap); the operator's reads and actions are
// public at the root (src/operations.rs) and in `admin`. The `internals` feature, for skiplock's own tests and benchmarks,
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
mod operations;
mod pacing;
mod pgbouncer;
#[cfg_attr(
    not(any(feature = "cli", feature = "internals")),
    allow(unreachable_pub)
)]
mod pool;
mod queue_limits;
// What the `skiplock` binary needs beyond the API (the `cli` feature), named as unstable.
mod read_only;
mod state;
pub mod stats;
#[cfg(feature = "testing")]
pub mod testing;
mod trace_context;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod unstable_cli;
pub mod worker;

#[cfg(feature = "internals")]
#[doc(hidden)]
pub use awaiting::wait_for_with_fallbacks;
pub use awaiting::{JobOutcome, wait_for};
pub use db::jobs::JobRow;
pub use enqueue::{
    EnqueueOutcome, EnqueueResult, NewJob, QUEUE_NAME_MAX_BYTES, enqueue, enqueue_many, enqueue_raw,
};
pub use error::{Error, Result};
pub use job::{
    EnqueueOptions, Fate, Job, JobContext, JobError, JobId, JobState, Schedule, UniquePolicy,
};
pub use operations::{
    JobFilter, cancel, job, jobs, pause_queue, paused_queues, resume_queue, retry, retry_dead,
};
pub use pgbouncer::PgBouncer;
pub(crate) use pool::DbPool;
pub use queue_limits::{
    LimitKind, QueueLimitStatus, QueueLimits, RATE_LIMIT_MAX_STARTS, RateLimit, queue_limits,
    set_queue_limits,
};
pub use trace_context::{TRACEPARENT_MAX_BYTES, TRACESTATE_MAX_BYTES, TraceContext};
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
