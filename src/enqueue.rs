//! Enqueue jobs on any executor: a pool, a connection, or the caller's own transaction.
//!
//! Because every function takes `impl PgExecutor`, "enqueue inside my transaction" needs no
//! special API: pass `&mut *tx`, and the job exists if and only if the transaction commits.

use std::time::Duration;

use serde_json::Value;
use sqlx::PgExecutor;
use sqlx::types::Json;

use crate::db::enqueue::{InsertBatch, InsertedJobs, jobs_insert_reporting};
use crate::error::{Error, Result};
use crate::job::{EnqueueOptions, Job, JobId, MAX_ATTEMPTS_DEFAULT, QUEUE_DEFAULT, Schedule};

/// An untyped job: a kind and JSON args, for callers without a [`Job`] type (the CLI, other
/// services' payloads).
#[derive(Debug, Clone, PartialEq)]
pub struct NewJob {
    /// Handler kind.
    pub kind: String,
    /// Payload: any JSON value, at most 1 MiB as text unless the database says otherwise
    /// (`skiplock.args_max_bytes`).
    pub args: Value,
    /// Queue, priority, schedule, attempts.
    pub options: EnqueueOptions,
}

impl NewJob {
    /// A job of `kind` with `args` and default options.
    pub fn new(kind: impl Into<String>, args: Value) -> Self {
        Self {
            kind: kind.into(),
            args,
            options: EnqueueOptions::default(),
        }
    }

    /// Replaces the options.
    pub fn with_options(mut self, options: EnqueueOptions) -> Self {
        self.options = options;
        self
    }

    /// Encodes a typed job, filling unset options from the type's constants.
    ///
    /// # Errors
    ///
    /// [`Error::EncodeArgs`] if serde cannot encode the job.
    pub fn from_job<J: Job>(job: &J, mut options: EnqueueOptions) -> Result<Self> {
        let args = serde_json::to_value(job).map_err(|source| Error::EncodeArgs {
            kind: J::KIND.to_owned(),
            source,
        })?;
        options.queue.get_or_insert_with(|| J::QUEUE.to_owned());
        options.max_attempts.get_or_insert(J::MAX_ATTEMPTS);
        Ok(Self {
            kind: J::KIND.to_owned(),
            args,
            options,
        })
    }
}

/// Enqueues a typed job and says what the enqueue did: a new job, or (with a unique key)
/// the pending job it was folded into. Options the caller leaves unset come from the job
/// type ([`Job::QUEUE`], [`Job::MAX_ATTEMPTS`]), then from the defaults; pass
/// `EnqueueOptions::default()` for none.
///
/// `db` is any executor: a pool, a connection, or `&mut *tx` to enqueue inside the
/// caller's transaction, so that the job exists if and only if the transaction commits.
///
/// # Errors
///
/// [`Error::EncodeArgs`] if the job cannot be encoded, [`Error::InvalidJob`] for options
/// the job cannot have (see [`enqueue_raw`]), [`Error::Database`] if the insert fails.
///
/// # Examples
///
/// ```no_run
/// use skiplock::{EnqueueOptions, EnqueueOutcome, Job, JobContext, JobError, UniquePolicy};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct Welcome { user_id: i64 }
/// # impl Job for Welcome { const KIND: &'static str = "welcome";
/// #   async fn run(self, _: JobContext) -> Result<(), JobError> { Ok(()) } }
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO users (id) VALUES (42)").execute(&mut *tx).await?;
/// let job = skiplock::enqueue(&mut *tx, &Welcome { user_id: 42 }, EnqueueOptions::default())
///     .await?;
/// tx.commit().await?; // the job exists from here on, and only if this succeeds
///
/// // At most one pending welcome per user: a second enqueue returns the first job.
/// let options = EnqueueOptions::new().unique_key("welcome:42", UniquePolicy::Skip);
/// let again = skiplock::enqueue(&pool, &Welcome { user_id: 42 }, options).await?;
/// assert_eq!(again.outcome, EnqueueOutcome::Skipped);
/// println!("job {} ({:?})", job.id, job.outcome);
/// # Ok(()) }
/// ```
pub async fn enqueue<'e, J: Job>(
    db: impl PgExecutor<'e>,
    job: &J,
    options: EnqueueOptions,
) -> Result<EnqueueResult> {
    let new_job = NewJob::from_job(job, options)?;
    let results = enqueue_raw(db, std::slice::from_ref(&new_job)).await?;
    Ok(results[0])
}

/// What an enqueue did with a job: a new job, or one folded by its unique key into the
/// pending job of that key (whose id comes back), by the key's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EnqueueOutcome {
    /// A new job was written.
    Inserted,
    /// A job with the same `unique_key` was pending; it was left as it was (policy skip).
    Skipped,
    /// A job with the same `unique_key` was pending; it took the new args (replace).
    Replaced,
    /// A job with the same `unique_key` was pending; the new args were appended (merge).
    Merged,
}

impl EnqueueOutcome {
    /// The outcome's name, as `skiplock.enqueue_job` and `skiplock enqueue --json` give it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Inserted => "inserted",
            Self::Skipped => "skipped",
            Self::Replaced => "replaced",
            Self::Merged => "merged",
        }
    }

    fn from_sql(outcome: &str) -> Self {
        match outcome {
            "skipped" => Self::Skipped,
            "replaced" => Self::Replaced,
            "merged" => Self::Merged,
            _ => Self::Inserted,
        }
    }
}

/// A job's id and what its enqueue did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnqueueResult {
    /// The new job's id, or the id of the pending job its unique key folded it into.
    pub id: JobId,
    /// What happened.
    pub outcome: EnqueueOutcome,
}

/// Enqueues many typed jobs of one type, with the same options, in a single statement;
/// results come back in input order. Thousands per statement are fine (the batch is sent
/// as arrays, not as one `VALUES` row per job).
///
/// # Errors
///
/// As [`enqueue`]; on error no job of the batch is inserted.
///
/// # Examples
///
/// ```no_run
/// use skiplock::{EnqueueOptions, Job, JobContext, JobError};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct Resize { image: i64 }
/// # impl Job for Resize { const KIND: &'static str = "resize";
/// #   async fn run(self, _: JobContext) -> Result<(), JobError> { Ok(()) } }
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let jobs: Vec<Resize> = (1..=1000).map(|image| Resize { image }).collect();
/// let results = skiplock::enqueue_many(&pool, &jobs, EnqueueOptions::new().priority(5)).await?;
/// assert_eq!(results.len(), 1000);
/// # Ok(()) }
/// ```
pub async fn enqueue_many<'e, 'j, J: Job>(
    db: impl PgExecutor<'e>,
    jobs: impl IntoIterator<Item = &'j J>,
    options: EnqueueOptions,
) -> Result<Vec<EnqueueResult>> {
    let new_jobs = jobs
        .into_iter()
        .map(|job| NewJob::from_job(job, options.clone()))
        .collect::<Result<Vec<_>>>()?;
    enqueue_raw(db, &new_jobs).await
}

/// Enqueues untyped jobs (a kind and JSON args each, with options of their own) in a
/// single statement; results come back in input order. For jobs whose type lives
/// elsewhere: another service's payloads, a file of jobs.
///
/// # Errors
///
/// [`Error::InvalidJob`] if a job has an empty kind or queue, a queue name over
/// [`QUEUE_NAME_MAX_BYTES`], a non-positive attempt budget, a delay too large to
/// represent, a parent that does not exist, or args over the database's limit (1 MiB by
/// default, the setting `skiplock.args_max_bytes`); [`Error::Database`] if the insert
/// fails. On error no job of the batch is inserted.
///
/// # Examples
///
/// ```no_run
/// use serde_json::json;
/// use skiplock::{EnqueueOptions, NewJob};
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let jobs = [
///     NewJob::new("send_email", json!({"to": "ada@example.com"})),
///     NewJob::new("http", json!({"url": "https://example.com/hook"}))
///         .with_options(EnqueueOptions::new().queue("webhooks")),
/// ];
/// let results = skiplock::enqueue_raw(&pool, &jobs).await?;
/// println!("enqueued jobs {} and {}", results[0].id, results[1].id);
/// # Ok(()) }
/// ```
pub async fn enqueue_raw<'e>(
    db: impl PgExecutor<'e>,
    jobs: &[NewJob],
) -> Result<Vec<EnqueueResult>> {
    let inserted = insert(db, jobs).await?;
    Ok(match inserted.outcomes {
        None => inserted
            .ids
            .into_iter()
            .map(|id| EnqueueResult {
                id,
                outcome: EnqueueOutcome::Inserted,
            })
            .collect(),
        Some(outcomes) => inserted
            .ids
            .into_iter()
            .zip(outcomes)
            .map(|(id, outcome)| EnqueueResult {
                id,
                outcome: EnqueueOutcome::from_sql(&outcome),
            })
            .collect(),
    })
}

async fn insert<'e>(db: impl PgExecutor<'e>, jobs: &[NewJob]) -> Result<InsertedJobs> {
    if jobs.is_empty() {
        return Ok(InsertedJobs {
            ids: Vec::new(),
            outcomes: None,
        });
    }
    let mut batch = InsertBatch::default();
    // The enqueuer's trace, for the jobs whose options name none: read once per call.
    #[cfg(feature = "opentelemetry")]
    let current = jobs
        .iter()
        .any(|job| job.options.trace_context.is_none())
        .then(crate::trace_context::TraceContext::current)
        .flatten();
    #[cfg(not(feature = "opentelemetry"))]
    let current: Option<crate::trace_context::TraceContext> = None;
    for (index, job) in jobs.iter().enumerate() {
        validate(job).map_err(|why| {
            Error::InvalidJob(if jobs.len() == 1 {
                why
            } else {
                format!("job {} of the batch: {why}", index + 1)
            })
        })?;
        let options = &job.options;
        batch.kinds.push(job.kind.clone());
        batch.args.push(Json(job.args.clone()));
        batch.queues.push(
            options
                .queue
                .clone()
                .unwrap_or_else(|| QUEUE_DEFAULT.to_owned()),
        );
        batch.priorities.push(options.priority.unwrap_or(0));
        let (run_at, delay_ms) = match options.schedule {
            Some(Schedule::At(at)) => (Some(at), 0),
            Some(Schedule::After(delay)) => (None, duration_ms(delay)),
            None => (None, 0),
        };
        batch.run_at.push(run_at);
        batch.delays_ms.push(delay_ms);
        batch
            .max_attempts
            .push(options.max_attempts.unwrap_or(MAX_ATTEMPTS_DEFAULT));
        batch.ordering_keys.push(options.ordering_key.clone());
        batch.concurrency_keys.push(options.concurrency_key.clone());
        batch.unique_keys.push(options.unique_key.clone());
        batch.unique_policies.push(options.on_conflict.as_str());
        batch
            .depends_on
            .push(Json(options.depends_on.iter().map(|id| id.0).collect()));
        let trace = options.trace_context.as_ref().or(current.as_ref());
        batch
            .traceparents
            .push(trace.map(|trace| trace.traceparent().to_owned()));
        batch
            .tracestates
            .push(trace.and_then(|trace| trace.tracestate().map(str::to_owned)));
    }
    jobs_insert_reporting(db, &batch).await.map_err(refused)
}

/// Turns the refusals of `skiplock.enqueue(…)` (missing parent, bad option, args over
/// the database's limit) into [`Error::InvalidJob`] with the database's message (and hint);
/// other errors stay database errors.
fn refused(error: sqlx::Error) -> Error {
    match &error {
        sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("23503" | "22023")) => {
            Error::InvalidJob(db.message().to_owned())
        }
        // The hint says what to do: pass a reference, or raise the setting.
        sqlx::Error::Database(db) if db.code().as_deref() == Some("54000") => {
            Error::InvalidJob(crate::error::describe_sqlx(&error))
        }
        _ => Error::Database(error),
    }
}

/// Longest queue name, in bytes of UTF-8. Workers learn of runnable jobs from
/// notifications that carry the queue's name, and Postgres caps a notification at 8,000
/// bytes; the table refuses a longer name on every path (`jobs_queue_name_length`,
/// `queues_name_length`), and an enqueue of one fails with [`Error::InvalidJob`] and
/// writes nothing.
pub const QUEUE_NAME_MAX_BYTES: usize = 1000;

/// What is wrong with the length of queue name `queue`, to follow "the queue name ":
/// `None` while it is within [`QUEUE_NAME_MAX_BYTES`]. One check for every Rust path that
/// takes a queue name (enqueue, cron schedules, the worker's queues).
pub(crate) fn queue_name_over_limit(queue: &str) -> Option<String> {
    (queue.len() > QUEUE_NAME_MAX_BYTES).then(|| {
        format!(
            "is {} bytes; it must be at most {QUEUE_NAME_MAX_BYTES}",
            queue.len()
        )
    })
}

/// Checks what the database would otherwise reject with a less helpful message.
fn validate(job: &NewJob) -> std::result::Result<(), String> {
    if job.kind.is_empty() {
        return Err("the kind is empty; name the handler that runs this job".into());
    }
    if job.options.queue.as_deref() == Some("") {
        return Err("the queue name is empty; omit it to use `default`".into());
    }
    if let Some(why) = job.options.queue.as_deref().and_then(queue_name_over_limit) {
        return Err(format!("the queue name {why}"));
    }
    if let Some(max) = job.options.max_attempts
        && max < 1
    {
        return Err(format!("max_attempts is {max}; it must be at least 1"));
    }
    if !job.options.depends_on.is_empty() {
        if job.options.unique_key.is_some() {
            return Err("a job cannot have both a unique key and dependencies".into());
        }
        if job.options.ordering_key.is_some() {
            return Err("a job cannot have both an ordering key and dependencies".into());
        }
    }
    if job.options.ordering_key.as_deref() == Some("")
        || job.options.unique_key.as_deref() == Some("")
        || job.options.concurrency_key.as_deref() == Some("")
    {
        return Err(
            "ordering, unique and concurrency keys must not be empty; omit them instead".into(),
        );
    }
    if let Some(Schedule::After(delay)) = job.options.schedule
        && delay.as_millis() > i64::MAX as u128
    {
        return Err(format!("run_after {delay:?} is too large"));
    }
    Ok(())
}

/// A duration in whole milliseconds, saturating at `i64::MAX`.
pub(crate) fn duration_ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}
