//! Job and queue operations, at the crate root: fetch, list, retry and cancel jobs;
//! pause, resume and list paused queues. Each takes any executor, so it runs inside the
//! caller's transaction too, and each is also a SQL function or view for operators
//! (docs/sql.md).

use crate::db;
use crate::db::jobs::JobRow;
use crate::error::Result;
use crate::state::JobId;

pub use crate::db::admin::JobFilter;

/// Jobs matching `filter`, newest (highest id) first, at most `filter.limit`; as
/// `skiplock jobs` lists them.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the query fails.
///
/// # Examples
///
/// ```no_run
/// use skiplock::{JobFilter, JobState};
/// # async fn example(pool: sqlx::PgPool) -> Result<(), skiplock::Error> {
/// let dead = JobFilter {
///     states: vec![JobState::Dead],
///     queue: Some("mail".to_owned()),
///     limit: 100,
///     ..JobFilter::default()
/// };
/// for job in skiplock::jobs(&pool, &dead).await? {
///     println!("{} {}: {:?}", job.id, job.kind, job.last_error);
/// }
/// # Ok(()) }
/// ```
pub async fn jobs<'e>(db: impl sqlx::PgExecutor<'e>, filter: &JobFilter) -> Result<Vec<JobRow>> {
    Ok(db::admin::jobs_list(db, filter).await?)
}

/// Puts every `dead` job of `queue` (of every queue when `None`) back in line to run now,
/// each with one more attempt; returns their ids, ascending. Same as
/// `SELECT skiplock.retry_dead_jobs(queue)`.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the statement fails.
pub async fn retry_dead<'e>(
    db: impl sqlx::PgExecutor<'e>,
    queue: Option<&str>,
) -> Result<Vec<JobId>> {
    Ok(db::admin::jobs_retry_dead(db, queue).await?)
}

/// Names of the paused queues, in order.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the query fails.
pub async fn paused_queues<'e>(db: impl sqlx::PgExecutor<'e>) -> Result<Vec<String>> {
    Ok(db::queues::queues_paused(db).await?)
}

/// Pauses a queue: workers claim nothing from it until it is resumed; running jobs
/// finish. Same as `SELECT skiplock.pause_queue(name)`.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the statement fails.
pub async fn pause_queue<'e>(db: impl sqlx::PgExecutor<'e>, queue: &str) -> Result<()> {
    Ok(db::queues::queues_pause(db, queue).await?)
}

/// Resumes a paused queue and wakes its workers. Same as
/// `SELECT skiplock.resume_queue(name)`.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the statement fails.
pub async fn resume_queue<'e>(db: impl sqlx::PgExecutor<'e>, queue: &str) -> Result<()> {
    Ok(db::queues::queues_resume(db, queue).await?)
}

/// Fetches one job by id, as operators see it (`skiplock show ID`).
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the query fails.
///
/// # Examples
///
/// ```no_run
/// use skiplock::{JobId, JobState};
/// # async fn example(pool: sqlx::PgPool) -> Result<(), skiplock::Error> {
/// let id = JobId(42);
/// if let Some(job) = skiplock::job(&pool, id).await? {
///     match job.state {
///         JobState::Dead => {
///             println!("job {id} died: {:?}", job.last_error);
///             skiplock::retry(&pool, id).await?; // one more attempt, now
///         }
///         JobState::Queued | JobState::Running => {
///             skiplock::cancel(&pool, id).await?;
///         }
///         state => println!("job {id} is {state}"),
///     }
/// }
/// # Ok(()) }
/// ```
pub async fn job<'e>(db: impl sqlx::PgExecutor<'e>, id: JobId) -> Result<Option<JobRow>> {
    Ok(db::jobs::jobs_get(db, id).await?)
}

/// Puts a `dead`, `cancelled`, `succeeded` or scheduled job back in line to run now, with
/// one more attempt if it had none left. Returns false if the job is running, waiting or
/// does not exist. Same as `SELECT skiplock.retry_job(id)`.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the statement fails.
pub async fn retry<'e>(db: impl sqlx::PgExecutor<'e>, id: JobId) -> Result<bool> {
    Ok(db::jobs::jobs_retry(db, id).await?)
}

/// Cancels a job that has not finished: a queued job never runs, a running job's handler
/// is stopped at its worker's next heartbeat. Returns false if the job had finished or
/// does not exist. Same as `SELECT skiplock.cancel_job(id)`.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the statement fails.
pub async fn cancel<'e>(db: impl sqlx::PgExecutor<'e>, id: JobId) -> Result<bool> {
    Ok(db::jobs::jobs_cancel(db, id).await?)
}
