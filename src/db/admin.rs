//! Statements operators run: listing and inspecting jobs, stats from the operator views,
//! bulk retry and pruning on demand. Used by the `skiplock` binary and by [`crate::stats`].
//!
//! The views and `skiplock.retry_dead_jobs` are defined in `migrations/functions/` (13_views.sql, 11_operator.sql).

use chrono::{DateTime, Utc};
#[cfg(any(feature = "cli", feature = "testing", feature = "internals"))]
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{FromRow, PgExecutor};

use crate::db::jobs::JobRow;
use crate::state::{JobId, JobState};

/// Which jobs [`skiplock::jobs`](crate::jobs) returns. Empty filters match everything;
/// the default is the 50 newest jobs, as `skiplock jobs` lists them.
#[derive(Debug, Clone)]
pub struct JobFilter {
    /// Any of these states (all states when empty).
    pub states: Vec<JobState>,
    /// Only this queue.
    pub queue: Option<String>,
    /// Only this kind.
    pub kind: Option<String>,
    /// At most this many jobs, newest first. Default 50.
    pub limit: i64,
}

impl Default for JobFilter {
    fn default() -> Self {
        Self {
            states: Vec::new(),
            queue: None,
            kind: None,
            limit: 50,
        }
    }
}

/// Jobs matching `filter`, newest (highest id) first.
///
/// The states are bound as text and cast to `skiplock.job_state[]` in SQL, so the filter
/// can use the state indexes without a Rust-side array type for the enum.
pub async fn jobs_list(db: impl PgExecutor<'_>, filter: &JobFilter) -> sqlx::Result<Vec<JobRow>> {
    let states: Vec<&str> = filter.states.iter().map(|s| s.as_str()).collect();
    sqlx::query_as(
        "SELECT * FROM skiplock.jobs
         WHERE (cardinality($1::text[]) = 0 OR state = ANY ($1::text[]::skiplock.job_state[]))
           AND ($2::text IS NULL OR queue = $2)
           AND ($3::text IS NULL OR kind = $3)
         ORDER BY id DESC
         LIMIT $4",
    )
    .bind(&states)
    .bind(filter.queue.as_deref())
    .bind(filter.kind.as_deref())
    .bind(filter.limit)
    .fetch_all(db)
    .await
}

#[cfg(any(feature = "testing", feature = "internals"))]
/// A job of the kind [`jobs_of_kind`] looked for, and whether it matches the rest.
#[derive(Debug, Clone, FromRow)]
pub struct KindJob {
    /// The job.
    #[sqlx(flatten)]
    pub job: JobRow,
    /// Whether its args contain the given args and its queue and priority are the given
    /// ones (those given).
    pub matches: bool,
}

#[cfg(any(feature = "testing", feature = "internals"))]
/// Jobs of `kind` in one of `states`, oldest first, each with whether its args contain
/// `args` (JSON containment, `@>`) and its queue and priority are the given ones, when
/// given (`skiplock::testing`: the jobs that match, and the others to show when none does).
pub async fn jobs_of_kind(
    db: impl PgExecutor<'_>,
    kind: &str,
    states: &[JobState],
    args: Option<&Value>,
    queue: Option<&str>,
    priority: Option<i16>,
) -> sqlx::Result<Vec<KindJob>> {
    let states: Vec<&str> = states.iter().map(|s| s.as_str()).collect();
    sqlx::query_as(
        "SELECT *,
                ($3::jsonb IS NULL OR args @> $3)
                AND ($4::text IS NULL OR queue = $4)
                AND ($5::smallint IS NULL OR priority = $5) AS matches
         FROM skiplock.jobs
         WHERE kind = $1 AND state = ANY ($2::text[]::skiplock.job_state[])
         ORDER BY id",
    )
    .bind(kind)
    .bind(&states)
    .bind(args)
    .bind(queue)
    .bind(priority)
    .fetch_all(db)
    .await
}

/// One job as a JSON object with every column of `skiplock.jobs`, including columns this
/// build does not model in [`JobRow`] (so `skiplock show` never hides one).
#[cfg(any(feature = "cli", feature = "internals"))]
pub async fn jobs_get_json(db: impl PgExecutor<'_>, id: JobId) -> sqlx::Result<Option<Value>> {
    // Field by field, each read with json_lossy: JSON serde_json cannot hold in one of them
    // (args of `1e400`) shows as its text instead of failing the whole job.
    let fields = sqlx::query(
        "SELECT e.key, e.value
         FROM (SELECT to_jsonb(j) AS row FROM skiplock.internal_job_by_id($1) j LIMIT 1) r,
              jsonb_each(r.row) e",
    )
    .bind(id.0)
    .fetch_all(db)
    .await?;
    if fields.is_empty() {
        return Ok(None);
    }
    let mut job = serde_json::Map::new();
    for field in &fields {
        let value = super::json::json_lossy(field, 1)?.unwrap_or(Value::Null);
        job.insert(sqlx::Row::try_get(field, 0)?, value);
    }
    Ok(Some(Value::Object(job)))
}

/// The state of one job, `None` if it does not exist: `skiplock.internal_job_state`, which
/// probes the days of finished jobs from the job's id's day on, not every day kept, and reads
/// only what an enqueuer may read (docs/roles.sql), not the whole row
/// `skiplock.internal_job_by_id` reads.
pub async fn jobs_get_state(db: impl PgExecutor<'_>, id: JobId) -> sqlx::Result<Option<JobState>> {
    sqlx::query_scalar("SELECT skiplock.internal_job_state($1)")
        .bind(id.0)
        .fetch_one(db)
        .await
}

/// `skiplock.why_not_running(id)`.
pub async fn jobs_why_not_running(
    db: impl PgExecutor<'_>,
    id: JobId,
) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar("SELECT skiplock.why_not_running($1)")
        .bind(id.0)
        .fetch_one(db)
        .await
}

/// The jobs `id` depends on (its parents, deleted ones included) and the jobs that depend
/// on it (its dependants), each with its current state, parents first, by id.
pub async fn job_dependencies_of(
    db: impl PgExecutor<'_>,
    id: JobId,
) -> sqlx::Result<Vec<DependencyRow>> {
    sqlx::query_as(
        "SELECT 'parent' AS relation, d.parent_id AS id,
                coalesce(p.state, d.parent_state, 'succeeded') AS state, p.id IS NULL AS deleted
         FROM skiplock.job_dependencies d LEFT JOIN skiplock.jobs p ON p.id = d.parent_id
         WHERE d.job_id = $1
         UNION ALL
         SELECT 'dependant', d.job_id, c.state, false
         FROM skiplock.job_dependencies d JOIN skiplock.jobs c ON c.id = d.job_id
         WHERE d.parent_id = $1
         ORDER BY relation DESC, id",
    )
    .bind(id.0)
    .fetch_all(db)
    .await
}

/// A dependency edge as [`admin::job_dependencies`](crate::admin::job_dependencies) returns it.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
pub struct DependencyRow {
    /// `parent` (the job waits for it) or `dependant` (it waits for the job).
    pub relation: String,
    /// The other job's id.
    pub id: JobId,
    /// The other job's state; for a deleted parent, its state when it was deleted
    /// (`succeeded` when it was pruned after succeeding).
    pub state: JobState,
    /// Whether the other job (a parent) was deleted. A parent deleted before it succeeded
    /// still blocks its dependants (a tombstone; see `skiplock.job_dependencies`).
    pub deleted: bool,
}

/// Puts every dead job of `queue` (of all queues when `None`) back in line to run now
/// (`skiplock.retry_dead_jobs`); returns the ids retried, ascending.
pub async fn jobs_retry_dead(
    db: impl PgExecutor<'_>,
    queue: Option<&str>,
) -> sqlx::Result<Vec<JobId>> {
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM skiplock.retry_dead_jobs($1) AS r(id)")
        .bind(queue)
        .fetch_all(db)
        .await?;
    Ok(ids.into_iter().map(JobId).collect())
}

/// One row of the `skiplock.stats` view: the numbers of one queue and kind.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct StatsRow {
    /// Queue name.
    pub queue: String,
    /// Job kind.
    pub kind: String,
    /// Whether the queue is paused.
    pub paused: bool,
    /// Queued and due.
    pub runnable: i64,
    /// Queued, due later (including retries in backoff).
    pub scheduled: i64,
    /// Waiting for parent jobs.
    pub waiting: i64,
    /// Claimed by a worker.
    pub running: i64,
    /// Succeeded within the last hour.
    pub succeeded_last_hour: i64,
    /// Went dead within the last hour.
    pub dead_last_hour: i64,
    /// Succeeded within the last minute.
    pub succeeded_last_minute: i64,
    /// Seconds since the oldest runnable job became due (0 when none is).
    pub lag_seconds: f64,
    /// Successes per second over the last minute.
    pub per_second: f64,
}

/// Every row of the `skiplock.stats` view, by queue and kind, with the database's clock.
///
/// One statement (rows aggregated into a JSON array), so the clock and the numbers come
/// from the same snapshot and an empty table still yields the time.
pub async fn stats_by_queue_kind(
    db: impl PgExecutor<'_>,
) -> sqlx::Result<(DateTime<Utc>, Vec<StatsRow>)> {
    let (at, rows): (DateTime<Utc>, Json<Vec<StatsRow>>) = sqlx::query_as(
        "SELECT now(), coalesce(jsonb_agg(to_jsonb(s) ORDER BY s.queue, s.kind), '[]')
         FROM skiplock.stats s",
    )
    .fetch_one(db)
    .await?;
    Ok((at, rows.0))
}
