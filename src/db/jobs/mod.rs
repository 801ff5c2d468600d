//! Statements on `skiplock.jobs`.
//!
//! Every statement that finishes, fails, extends or releases a claim matches both the job
//! id and its `claim_token`: a holder whose claim was reaped, cancelled or re-claimed
//! changes nothing, and learns so from the ids that come back. A token is set only while
//! the job is `running` (constraint `jobs_claim_token_only_running`), so a matching token
//! is also proof that the job still runs under that claim.
//!
//! These statements find their rows one primary-key lookup per claim, driven by the
//! claim list (`unnest(...)` joined `LATERAL`). The update that follows takes the locked
//! ids as an array, and how it reaches them is the planner's choice: a plan cached while
//! the table was nearly empty (a worker started on a fresh database, on a server where no
//! ANALYZE ever invalidates it) scanned the whole table for every batch, which made a
//! steady 5,000 jobs/s fall behind as the table grew (a 690-job completion took 313 ms,
//! filtering 82,701 rows). So every statement here that works on a batch of claims is
//! planned afresh at each call (an unnamed statement, `persistent(false)`), with the
//! table's size as it is then; that costs well under a millisecond and one more round
//! trip per batch, and no drain measured slower for it (docs/benchmarks.md). Their
//! columns and parameters are of built-in types only (a job state travels as text):
//! sqlx 0.9 looks up a custom type's OID on a fresh connection between preparing and
//! running an unnamed statement, which destroys it ("unnamed prepared statement does not
//! exist", transact-rs/sqlx#4305). They deliberately do not say `state = 'running'`:
//! that would let the planner scan the partial index `jobs_running_idx` for every claim
//! in the list, which a cached generic plan did once statistics said "nothing runs"
//! (1,000-job completions went from 11 ms to 128 ms, quadratic in the batch).
//!
//! They update by id, not by the `ctid` the lock returned: a row updated after the
//! statement's snapshot (a heartbeat that committed while we waited for its lock) has a
//! new version the update's snapshot cannot see by ctid, and the outcome would be
//! dropped. The claim alone updates by ctid (see `skiplock.internal_claim_batch` in the schema).
//!
//! The statements that finish or release claims lock their rows in id order (the claim
//! list is sorted by id first): locking in one global order means two of them touching
//! overlapping rows queue behind each other instead of deadlocking (a deadlock costs
//! `deadlock_timeout`, one second by default). The completion, the most frequent of them,
//! is one update joined to the claim list (`skiplock.internal_complete_claims`), whose planner
//! settings hold it to a nested loop driven by the list: it locks each row as it updates
//! it, in the list's order, with one lookup and no separate lock record, and re-checks
//! the token on the newest row version after any wait as `FOR UPDATE` does. Its lock is
//! the update's `FOR NO KEY UPDATE`, so the dependency trigger reads a parent `FOR SHARE`
//! to wait for it (`migrations/functions/04_dependencies_and_lanes.sql`). `FOR UPDATE` re-checks the
//! claim token on the newest row version after any wait, so a claim lost meanwhile drops
//! out. The heartbeat never waits at all (see [`jobs_heartbeat_many`]).

mod claim;
mod outcome;

pub use claim::*;
pub use outcome::*;

use super::timestamp::{MaybeTimestamp, Timestamp};
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::{FromRow, PgExecutor, Row};

use crate::state::UniquePolicy;
use crate::state::{JobId, JobState};

/// A full row of `skiplock.jobs`, as operators see it.
#[derive(Debug, Clone, serde::Serialize)]
#[non_exhaustive]
pub struct JobRow {
    /// Job id.
    pub id: JobId,
    /// Queue name.
    pub queue: String,
    /// Handler kind.
    pub kind: String,
    /// Payload.
    pub args: Json<Value>,
    /// Lifecycle state.
    pub state: JobState,
    /// Lower runs first.
    pub priority: i16,
    /// Not run before this.
    pub scheduled_at: DateTime<Utc>,
    /// Attempts started so far.
    pub attempt: i32,
    /// Attempt budget.
    pub max_attempts: i32,
    /// Worker that holds or last held the job.
    pub claimed_by: Option<String>,
    /// When the current or last claim was taken.
    pub claimed_at: Option<DateTime<Utc>>,
    /// Last heartbeat of the current claim.
    pub heartbeat_at: Option<DateTime<Utc>>,
    /// Strict FIFO lane.
    pub ordering_key: Option<String>,
    /// Deduplication key.
    pub unique_key: Option<String>,
    /// What a second enqueue with the same pending unique key does.
    pub unique_policy: Option<UniquePolicy>,
    /// Latest progress reported by the handler.
    pub progress: Option<Json<Value>>,
    /// Output recorded by the handler.
    pub output: Option<Json<Value>>,
    /// Message of the latest failure.
    pub last_error: Option<String>,
    /// Recent failures: `{attempt, at, message}`, oldest first.
    pub errors: Json<Value>,
    /// When the job was enqueued.
    pub created_at: DateTime<Utc>,
    /// When the job reached a final state.
    pub finished_at: Option<DateTime<Utc>>,
}

/// Decoded from Postgres rows alone, by hand: the derive's impl, generic over every
/// database, named skiplock's private timestamp types in its public where-clause. The
/// timestamps go through them so that `infinity` and dates past chrono's range read as the
/// nearest time chrono holds instead of failing the row.
impl<'r> FromRow<'r, PgRow> for JobRow {
    fn from_row(row: &'r PgRow) -> sqlx::Result<Self> {
        let time = |name: &str| row.try_get::<Timestamp, _>(name).map(DateTime::from);
        let lossy = |name: &str| super::json::json_lossy(row, name);
        let maybe_time = |name: &str| {
            row.try_get::<MaybeTimestamp, _>(name)
                .map(Option::<DateTime<Utc>>::from)
        };
        Ok(JobRow {
            id: row.try_get("id")?,
            queue: row.try_get("queue")?,
            kind: row.try_get("kind")?,
            args: Json(lossy("args")?.unwrap_or(Value::Null)),
            state: row.try_get("state")?,
            priority: row.try_get("priority")?,
            scheduled_at: time("scheduled_at")?,
            attempt: row.try_get("attempt")?,
            max_attempts: row.try_get("max_attempts")?,
            claimed_by: row.try_get("claimed_by")?,
            claimed_at: maybe_time("claimed_at")?,
            heartbeat_at: maybe_time("heartbeat_at")?,
            ordering_key: row.try_get("ordering_key")?,
            unique_key: row.try_get("unique_key")?,
            unique_policy: row.try_get("unique_policy")?,
            progress: lossy("progress")?.map(Json),
            output: lossy("output")?.map(Json),
            last_error: row.try_get("last_error")?,
            errors: Json(lossy("errors")?.unwrap_or(Value::Null)),
            created_at: time("created_at")?,
            finished_at: maybe_time("finished_at")?,
        })
    }
}

/// One job by id: among the live jobs, then a finished job from its id's day on
/// (`skiplock.internal_job_by_id`), not every day's table.
pub async fn jobs_get(db: impl PgExecutor<'_>, id: JobId) -> sqlx::Result<Option<JobRow>> {
    sqlx::query_as("SELECT * FROM skiplock.internal_job_by_id($1)")
        .bind(id.0)
        .fetch_optional(db)
        .await
}

/// Puts a finished or scheduled job back in line to run now (`skiplock.retry_job`).
/// Returns false if the job is running, waiting or missing.
pub async fn jobs_retry(db: impl PgExecutor<'_>, id: JobId) -> sqlx::Result<bool> {
    sqlx::query_scalar("SELECT skiplock.retry_job($1)")
        .bind(id.0)
        .fetch_one(db)
        .await
}

/// Cancels an unfinished job (`skiplock.cancel_job`). Returns false if it had finished or
/// does not exist.
pub async fn jobs_cancel(db: impl PgExecutor<'_>, id: JobId) -> sqlx::Result<bool> {
    sqlx::query_scalar("SELECT skiplock.cancel_job($1)")
        .bind(id.0)
        .fetch_one(db)
        .await
}

/// Number of jobs in each state, every state listed (zero included).
pub async fn jobs_count_by_state(db: impl PgExecutor<'_>) -> sqlx::Result<Vec<(JobState, i64)>> {
    sqlx::query_as(
        "SELECT s.state, count(j.id)
         FROM unnest(enum_range(NULL::skiplock.job_state)) AS s(state)
         LEFT JOIN skiplock.jobs j ON j.state = s.state
         GROUP BY s.state
         ORDER BY s.state",
    )
    .fetch_all(db)
    .await
}

/// Where a job someone waits for stands: a row of `skiplock.watch_job`.
#[derive(Debug, Clone)]
pub struct WatchedJob {
    /// Job id.
    pub id: JobId,
    /// Its state now.
    pub state: JobState,
    /// Attempts started so far.
    pub attempt: i32,
    /// Output recorded by the handler (finished jobs only).
    pub output: Option<Value>,
    /// Message of the latest failure (finished jobs only).
    pub last_error: Option<String>,
    /// When it finished (`DateTime::<Utc>::MIN_UTC` for a finished row written by hand
    /// without a time); `None` while it is live.
    pub finished_at: Option<DateTime<Utc>>,
}

/// Marks a job awaited and reads where it stands (`skiplock.watch_job`); `None` when it
/// does not exist. In the simple query protocol, its id written into the text (an integer),
/// every column a text Postgres writes the same way whatever the session's settings (the
/// time as microseconds since the epoch): one round trip and no prepared statement, so it
/// runs as it is through PgBouncer in transaction mode too, where a statement prepared on
/// one server connection may be executed on another.
pub async fn jobs_watch(db: impl PgExecutor<'_>, id: JobId) -> sqlx::Result<Option<WatchedJob>> {
    let sql = format!(
        "SELECT id, state::text, attempt, output::text, last_error,
                CASE WHEN finished_at = 'infinity' THEN 9223372036854775807
                     WHEN finished_at = '-infinity' THEN -9223372036854775808
                     WHEN finished_at IS NOT NULL
                     THEN least(extract(epoch FROM finished_at) * 1000000,
                                9223372036854775807)::bigint END
         FROM skiplock.watch_job({})",
        id.0
    );
    let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .fetch_optional(db)
        .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let state: &str = row.try_get(1)?;
    let output: Option<&str> = row.try_get(3)?;
    Ok(Some(WatchedJob {
        id: JobId(row.try_get(0)?),
        state: state
            .parse()
            .map_err(|e: String| sqlx::Error::ColumnDecode {
                index: "1 (state)".into(),
                source: e.into(),
            })?,
        attempt: row.try_get(2)?,
        // JSON that serde_json cannot hold (a number beyond f64, nesting deeper than 128)
        // comes back as its text, in a string: the outcome is still returned.
        output: output.map(|text| {
            serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
        }),
        last_error: row.try_get(4)?,
        finished_at: row
            .try_get::<Option<i64>, _>(5)?
            .map(super::timestamp::from_unix_micros_saturated),
    }))
}
