//! Statements the web dashboard (`skiplock dashboard`) runs beyond those of
//! [`admin`](super::admin), [`jobs`](super::jobs) and [`history`](super::history): the jobs
//! page with keyset paging and text search, live workers, the per-second throughput of the
//! live chart, the ordering lane of a job and retained dead and cancelled counts.
//!
//! Every query here reads only unfinished jobs, recently finished ones or one page of
//! jobs, so its cost follows the backlog and the recent traffic, not the retained history.

use super::timestamp::{MaybeTimestamp, Timestamp};
use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{FromRow, PgExecutor, Postgres, QueryBuilder};

use crate::state::JobState;

/// Which jobs [`dashboard_jobs_page`] returns.
#[derive(Debug, Clone, Default)]
pub struct JobsPageFilter {
    /// Only this state.
    pub state: Option<JobState>,
    /// Only this queue.
    pub queue: Option<String>,
    /// Only this kind.
    pub kind: Option<String>,
    /// Only jobs whose args, last error or error list contain this text (case-insensitive).
    pub text: Option<String>,
    /// Where the page starts.
    pub cursor: Cursor,
    /// At most this many jobs.
    pub limit: i64,
}

/// A keyset paging position: pages are ordered by id, newest first, and a page is named by
/// the id it continues from, so any page costs the same however deep it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Cursor {
    /// The newest jobs.
    #[default]
    First,
    /// Jobs older than this id (the next page).
    Before(i64),
    /// Jobs newer than this id (the previous page).
    After(i64),
}

/// One line of the jobs page.
#[derive(Debug, Clone, FromRow, serde::Serialize, serde::Deserialize)]
pub struct JobSummary {
    /// Job id.
    pub id: i64,
    /// Queue name.
    pub queue: String,
    /// Job kind.
    pub kind: String,
    /// State.
    pub state: JobState,
    /// Attempts started.
    pub attempt: i32,
    /// Attempt budget.
    pub max_attempts: i32,
    /// Not run before this.
    #[sqlx(try_from = "Timestamp")]
    #[serde(deserialize_with = "super::timestamp::deserialize_saturated")]
    pub scheduled_at: DateTime<Utc>,
    /// Enqueued at.
    #[sqlx(try_from = "Timestamp")]
    #[serde(deserialize_with = "super::timestamp::deserialize_saturated")]
    pub created_at: DateTime<Utc>,
    /// Finished at.
    #[sqlx(try_from = "MaybeTimestamp")]
    #[serde(deserialize_with = "super::timestamp::deserialize_saturated_option")]
    pub finished_at: Option<DateTime<Utc>>,
    /// The first 120 characters of the args as JSON text.
    pub args_preview: String,
    /// The first 120 characters of the last error.
    pub error_preview: Option<String>,
}

/// Jobs a text search reads for one page at most: plenty to fill a page when the text is
/// common, and a bound on the cost (tens of milliseconds) when it is rare.
pub const TEXT_SEARCH_SCAN: i64 = 20_000;

/// One page of the jobs list.
#[derive(Debug, Clone)]
pub struct JobsPage {
    /// The jobs, newest first.
    pub jobs: Vec<JobSummary>,
    /// Set when a text search read [`TEXT_SEARCH_SCAN`] jobs and stopped: the id of the
    /// last one it read, where the search continues (older jobs for [`Cursor::First`] and
    /// [`Cursor::Before`], newer ones for [`Cursor::After`]).
    pub searched_to: Option<i64>,
}

/// One page of jobs matching `filter`, newest first, by keyset on `id`.
///
/// The statement is assembled from fixed fragments for the filters in use (every value
/// bound), so each combination gets its own plan: a generic plan full of `$n IS NULL OR …`
/// would scan where an index fits. A text search cannot use an index: it reads at most
/// [`TEXT_SEARCH_SCAN`] jobs (matching the other filters) from the cursor on, and says
/// where it stopped.
pub async fn dashboard_jobs_page(
    db: impl PgExecutor<'_>,
    filter: &JobsPageFilter,
) -> sqlx::Result<JobsPage> {
    let (order, last) = match filter.cursor {
        Cursor::After(_) => (" ORDER BY id ASC", "max"),
        _ => (" ORDER BY id DESC", "min"),
    };
    let mut query = QueryBuilder::<Postgres>::new(
        "WITH scanned AS (
             SELECT id, queue, kind, state, attempt, max_attempts, scheduled_at, created_at,
                    finished_at, args, last_error, errors
             FROM skiplock.jobs WHERE true",
    );
    if let Some(state) = filter.state {
        query.push(" AND state = ").push_bind(state);
    }
    if let Some(queue) = &filter.queue {
        query.push(" AND queue = ").push_bind(queue);
    }
    if let Some(kind) = &filter.kind {
        query.push(" AND kind = ").push_bind(kind);
    }
    match filter.cursor {
        Cursor::First => {}
        Cursor::Before(id) => {
            query.push(" AND id < ").push_bind(id);
        }
        Cursor::After(id) => {
            query.push(" AND id > ").push_bind(id);
        }
    }
    let scan = match filter.text {
        Some(_) => TEXT_SEARCH_SCAN,
        None => filter.limit,
    };
    query.push(order).push(" LIMIT ").push_bind(scan);
    query.push(
        "), page AS (
             SELECT id, queue, kind, state, attempt, max_attempts, scheduled_at, created_at,
                    finished_at, left(args::text, 120) AS args_preview,
                    left(last_error, 120) AS error_preview
             FROM scanned WHERE true",
    );
    if let Some(text) = &filter.text {
        let pattern = format!("%{}%", like_escape(text));
        query
            .push(" AND (args::text ILIKE ")
            .push_bind(pattern.clone())
            .push(" OR last_error ILIKE ")
            .push_bind(pattern.clone())
            .push(" OR errors::text ILIKE ")
            .push_bind(pattern)
            .push(")");
    }
    query.push(order).push(" LIMIT ").push_bind(filter.limit);
    query.push(format_args!(
        ")
         SELECT (SELECT count(*) FROM scanned), (SELECT {last}(id) FROM scanned),
                coalesce((SELECT jsonb_agg(to_jsonb(p) ORDER BY p.id DESC) FROM page p), '[]')"
    ));
    let (scanned, searched_to, jobs): (i64, Option<i64>, Json<Vec<JobSummary>>) =
        query.build_query_as().fetch_one(db).await?;
    Ok(JobsPage {
        jobs: jobs.0,
        searched_to: searched_to.filter(|_| filter.text.is_some() && scanned == scan),
    })
}

/// `text` with the `LIKE` wildcards and the escape character escaped, to match literally.
fn like_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '\\' | '%' | '_') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// A worker as seen from the jobs it holds right now.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
pub struct WorkerRow {
    /// `claimed_by` of its running jobs.
    pub identity: String,
    /// Running jobs it holds.
    pub jobs: i64,
    /// Its most recent heartbeat on any of them.
    #[sqlx(try_from = "Timestamp")]
    pub last_heartbeat_at: DateTime<Utc>,
    /// Seconds since that heartbeat, by the database clock.
    pub heartbeat_age_seconds: f64,
    /// Queues of the jobs it holds.
    pub queues: Vec<String>,
    /// Kinds of the jobs it holds.
    pub kinds: Vec<String>,
}

/// Workers that hold running jobs, by identity. A worker holding nothing is not seen: the
/// database knows workers only through their claims.
pub async fn dashboard_workers(db: impl PgExecutor<'_>) -> sqlx::Result<Vec<WorkerRow>> {
    sqlx::query_as(
        "SELECT coalesce(claimed_by, 'unknown') AS identity, count(*) AS jobs,
                max(heartbeat_at) AS last_heartbeat_at,
                -- Not now() - max(heartbeat_at): an 'infinity' written by hand fails that.
                (extract(epoch FROM now()) - extract(epoch FROM max(heartbeat_at)))::float8
                    AS heartbeat_age_seconds,
                array_agg(DISTINCT queue ORDER BY queue) AS queues,
                array_agg(DISTINCT kind ORDER BY kind) AS kinds
         FROM skiplock.jobs
         WHERE state = 'running'
         GROUP BY 1
         ORDER BY 1",
    )
    .fetch_all(db)
    .await
}

/// Successes and failed attempts per second, as [`dashboard_throughput`] returns them.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
pub struct Throughput {
    /// The database clock, in Unix seconds.
    pub now: i64,
    /// `[second, count]` pairs of jobs that succeeded, ascending, seconds without any left
    /// out.
    pub succeeded: Json<Vec<(i64, i64)>>,
    /// `[second, count]` pairs of failed attempts (retried, dead or reaped), ascending.
    pub failed: Json<Vec<(i64, i64)>>,
}

/// Successes and failed attempts per second (Unix seconds) after `since`.
///
/// A failure at instant `t` leaves its job finished at or after `t`, running with a
/// heartbeat at or after `t`, or queued with `scheduled_at` at or after `t` (retries and
/// the reaper schedule forward; a manual retry or a release schedules at its own, later,
/// now). So only those jobs are read for failures: the finished and running ones through
/// their indexes, the queued ones that carry an error through the claim index.
pub async fn dashboard_throughput(db: impl PgExecutor<'_>, since: i64) -> sqlx::Result<Throughput> {
    sqlx::query_as(
        "WITH succeeded AS (
             SELECT floor(extract(epoch FROM finished_at))::bigint AS second, count(*) AS n
             FROM skiplock.jobs
             WHERE state = 'succeeded' AND finished_at > to_timestamp($1)
               AND isfinite(finished_at)
             GROUP BY 1
         ),
         failed AS (
             SELECT floor(extract(epoch FROM skiplock.internal_error_time(e)))::bigint AS second,
                    count(*) AS n
             FROM skiplock.jobs j,
                  jsonb_array_elements(CASE WHEN jsonb_typeof(j.errors) = 'array'
                                            THEN j.errors ELSE '[]' END) e
             WHERE ((j.state IN ('succeeded', 'dead', 'cancelled')
                     AND j.finished_at > to_timestamp($1))
                    OR (j.state = 'running' AND j.heartbeat_at > to_timestamp($1))
                    OR (j.state = 'queued' AND j.last_error IS NOT NULL
                        AND j.scheduled_at > to_timestamp($1)))
               AND skiplock.internal_error_time(e) > to_timestamp($1)
             GROUP BY 1
         )
         SELECT floor(extract(epoch FROM now()))::bigint AS now,
                (SELECT coalesce(jsonb_agg(jsonb_build_array(second, n) ORDER BY second), '[]')
                 FROM succeeded) AS succeeded,
                (SELECT coalesce(jsonb_agg(jsonb_build_array(second, n) ORDER BY second), '[]')
                 FROM failed) AS failed",
    )
    .bind(since as f64)
    .fetch_one(db)
    .await
}

/// A job of an ordering lane, as [`dashboard_lane`] returns it.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
pub struct LaneJob {
    /// Job id.
    pub id: i64,
    /// State.
    pub state: JobState,
}

/// The first `limit` unfinished jobs of an ordering lane, in the order they will run (by
/// id), and how many unfinished jobs the lane holds in all.
pub async fn dashboard_lane(
    db: impl PgExecutor<'_>,
    ordering_key: &str,
    limit: i64,
) -> sqlx::Result<(i64, Vec<LaneJob>)> {
    let (total, jobs): (i64, Json<Vec<(i64, JobState)>>) = sqlx::query_as(
        "WITH lane AS (
             SELECT id, state FROM skiplock.jobs
             WHERE ordering_key = $1 AND state IN ('waiting', 'queued', 'running')
         )
         SELECT (SELECT count(*) FROM lane),
                coalesce((SELECT jsonb_agg(jsonb_build_array(id, state) ORDER BY id)
                          FROM (SELECT id, state FROM lane ORDER BY id LIMIT $2) first), '[]')",
    )
    .bind(ordering_key)
    .bind(limit)
    .fetch_one(db)
    .await?;
    let jobs = jobs
        .0
        .into_iter()
        .map(|(id, state)| LaneJob { id, state })
        .collect();
    Ok((total, jobs))
}

/// Retained dead and cancelled jobs of one queue and kind.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
pub struct EndedCounts {
    /// Queue name.
    pub queue: String,
    /// Job kind.
    pub kind: String,
    /// Dead jobs not pruned yet.
    pub dead: i64,
    /// Cancelled jobs not pruned yet.
    pub cancelled: i64,
}

/// Dead and cancelled jobs still retained, per queue and kind (only those with any), by
/// queue then kind. Reads them through the `(state, finished_at)` index.
pub async fn dashboard_ended_counts(db: impl PgExecutor<'_>) -> sqlx::Result<Vec<EndedCounts>> {
    sqlx::query_as(
        "SELECT queue, kind,
                count(*) FILTER (WHERE state = 'dead') AS dead,
                count(*) FILTER (WHERE state = 'cancelled') AS cancelled
         FROM skiplock.jobs
         WHERE state IN ('dead', 'cancelled') AND finished_at IS NOT NULL
         GROUP BY queue, kind
         ORDER BY queue, kind",
    )
    .fetch_all(db)
    .await
}
