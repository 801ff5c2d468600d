//! Statements on `skiplock.job_history`, the hourly rollup that keeps the numbers of
//! finished jobs after the pruner deleted them (`migrations/0001_initial.sql` and `migrations/functions/12_history_and_retention.sql`; the days themselves: `migrations/functions/15_partitions.sql`).
//!
//! A finished job is counted live in `skiplock.jobs` until a statement of this file deletes
//! it, and in the rollup from then on: the delete and the rollup happen in one statement
//! (`DELETE … RETURNING` in a CTE feeding `INSERT … ON CONFLICT DO UPDATE`), so no job is
//! ever counted twice or lost. History queries add both halves up, counting the live half
//! with the very SQL that rolls rows up. The completion path writes nothing here.

use super::timestamp::Timestamp;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor, PgPool};

use crate::pgbouncer::BEGIN_PINNED;

use crate::state::JobId;

/// How long the hourly rollup keeps its detail by default: 365 days. Older hours are folded
/// into lifetime totals by each worker's pruner.
pub const HISTORY_RETENTION_DEFAULT: Duration = Duration::from_secs(365 * 24 * 3600);

/// Adds a row to the rollup row of its bucket, queue and kind (alias `h`), or inserts it.
macro_rules! upsert_into_history {
    () => {
        " ON CONFLICT (bucket, queue, kind) DO UPDATE SET
             succeeded = h.succeeded + excluded.succeeded,
             failed = h.failed + excluded.failed,
             dead = h.dead + excluded.dead,
             cancelled = h.cancelled + excluded.cancelled,
             run_count = h.run_count + excluded.run_count,
             run_seconds = h.run_seconds + excluded.run_seconds,
             wait_count = h.wait_count + excluded.wait_count,
             wait_seconds = h.wait_seconds + excluded.wait_seconds,
             run_histogram = skiplock.internal_job_history_array_add(h.run_histogram, excluded.run_histogram)"
    };
}

/// Per hour (UTC), queue and kind, what the finished rows of `$from` (alias `j`, with the
/// columns of `skiplock.jobs`) that pass `$filter` (an `AND …` fragment) count in the
/// history. Columns: `bucket, queue, kind, succeeded, failed, dead, cancelled, run_count,
/// run_seconds, wait_count, wait_seconds, run_histogram`; a bucket, queue and kind may come
/// twice (outcomes, failures), so callers group again.
///
/// - outcomes, run and wait times in the hour of `finished_at`; run time is
///   `finished_at - claimed_at` and wait time `claimed_at - scheduled_at`, of succeeded and
///   dead jobs (a claim older than the schedule belongs to a run before a manual retry: no
///   wait to tell);
/// - one failed attempt per entry of `errors`, in the hour of its `at`;
/// - the run-time histogram counts the 17 intervals of `skiplock.internal_job_history_run_bounds()`.
///
/// The rollup statements and the live half of the history queries both use it, so a job
/// counts the same before and after it is pruned.
///
/// `OFFSET 0` fences the per-row subquery: the planner takes the statistics of
/// `finished_at` (nearly unique) for any expression of it, expects millions of hours, and
/// sorts every row to disk; behind the fence it assumes few groups and hashes them.
/// Hours are computed from the epoch, which is cheaper than `date_trunc` in a time zone.
macro_rules! history_of {
    ($from:literal, $filter:literal) => {
        concat!(
            "SELECT t.bucket, t.queue, t.kind,
                    count(*) FILTER (WHERE t.state = 'succeeded') AS succeeded,
                    0::bigint AS failed,
                    count(*) FILTER (WHERE t.state = 'dead') AS dead,
                    count(*) FILTER (WHERE t.state = 'cancelled') AS cancelled,
                    count(t.run) AS run_count, coalesce(sum(t.run), 0)::float8 AS run_seconds,
                    count(t.wait) AS wait_count, coalesce(sum(t.wait), 0)::float8 AS wait_seconds,
                    ARRAY[count(*) FILTER (WHERE t.slot = 0), count(*) FILTER (WHERE t.slot = 1),
                          count(*) FILTER (WHERE t.slot = 2), count(*) FILTER (WHERE t.slot = 3),
                          count(*) FILTER (WHERE t.slot = 4), count(*) FILTER (WHERE t.slot = 5),
                          count(*) FILTER (WHERE t.slot = 6), count(*) FILTER (WHERE t.slot = 7),
                          count(*) FILTER (WHERE t.slot = 8), count(*) FILTER (WHERE t.slot = 9),
                          count(*) FILTER (WHERE t.slot = 10), count(*) FILTER (WHERE t.slot = 11),
                          count(*) FILTER (WHERE t.slot = 12), count(*) FILTER (WHERE t.slot = 13),
                          count(*) FILTER (WHERE t.slot = 14), count(*) FILTER (WHERE t.slot = 15),
                          count(*) FILTER (WHERE t.slot = 16)] AS run_histogram
             FROM (
                 SELECT to_timestamp(floor(date_part('epoch', j.finished_at) / 3600) * 3600)
                            AS bucket,
                        j.queue, j.kind, j.state, r.run, r.wait,
                        width_bucket(r.run, skiplock.internal_job_history_run_bounds()) AS slot
                 FROM ", $from, " j,
                      LATERAL (SELECT
                          CASE WHEN j.state IN ('succeeded', 'dead') AND j.finished_at >= j.claimed_at
                                    AND isfinite(j.finished_at) AND isfinite(j.claimed_at)
                               THEN date_part('epoch', j.finished_at - j.claimed_at) END AS run,
                          CASE WHEN j.state IN ('succeeded', 'dead') AND j.claimed_at >= j.scheduled_at
                                    AND isfinite(j.claimed_at) AND isfinite(j.scheduled_at)
                               THEN date_part('epoch', j.claimed_at - j.scheduled_at) END AS wait
                      ) r
                 WHERE j.finished_at IS NOT NULL ", $filter, "
                 OFFSET 0
             ) t
             GROUP BY 1, 2, 3
             UNION ALL
             SELECT to_timestamp(floor(date_part('epoch', skiplock.internal_error_time(e)) / 3600) * 3600),
                    j.queue, j.kind,
                    0, count(*), 0, 0, 0, 0, 0, 0, '{}'::bigint[]
             FROM ", $from, " j,
                  jsonb_array_elements(CASE WHEN jsonb_typeof(j.errors) = 'array'
                                            THEN j.errors ELSE '[]' END) e
             WHERE j.finished_at IS NOT NULL AND j.errors <> '[]'
               AND skiplock.internal_error_time(e) IS NOT NULL ", $filter, "
             GROUP BY 1, 2, 3"
        )
    };
}

/// Adds the groups of `$groups` (rows of [`history_of!`], alias free) to the rollup,
/// grouped again by bucket, queue and kind.
///
/// Groups are inserted in key order so that concurrent pruners lock rollup rows in one
/// order and wait for each other instead of deadlocking.
macro_rules! insert_into_history {
    ($groups:literal) => {
        concat!(
            "INSERT INTO skiplock.job_history AS h
                 (bucket, queue, kind, succeeded, failed, dead, cancelled, run_count,
                  run_seconds, wait_count, wait_seconds, run_histogram)
             SELECT bucket, queue, kind, sum(succeeded), sum(failed), sum(dead),
                    sum(cancelled), sum(run_count), sum(run_seconds), sum(wait_count),
                    sum(wait_seconds), skiplock.internal_job_history_array_sum(run_histogram)
             FROM ",
            $groups,
            "
             GROUP BY bucket, queue, kind
             ORDER BY bucket, queue, kind",
            upsert_into_history!()
        )
    };
}

/// The tail shared by every statement that deletes finished jobs: given a CTE `gone` that
/// returns the deleted rows (`RETURNING j.*`), it adds them to the rollup and counts them.
macro_rules! rolled_up {
    ($($gone:tt)+) => {
        concat!(
            $($gone)+,
            ", f AS (",
            history_of!("gone", ""),
            "), rolled AS (",
            insert_into_history!("f"),
            "
             )
             SELECT count(*) FROM gone"
        )
    };
}

/// Deletes up to `limit` finished jobs past their state's retention (milliseconds since
/// `finished_at`) that are not dropped with their day (see `finished_past_retention!`),
/// and adds them to the history rollup, in one statement; returns how many went. Deletes
/// exactly the rows `maintenance::jobs_prune_finished` (the tests' reference) deletes.
/// Locked rows are skipped, never waited on.
///
/// A data-modifying CTE always runs to completion, so the rollup `INSERT` happens although
/// the final `SELECT` reads only the deleted rows.
///
/// Runs in a transaction of its own with JIT off: the planner's estimate of the rows past
/// retention grows with the days kept, not with `limit`, so beside a large history the
/// statement passed `jit_above_cost` and Postgres compiled it at every pass (1.2-2.9 s of
/// CPU against 0.03-0.05 s without JIT, also when it deleted nothing).
/// tests/maintenance.rs `the_pruners_delete_is_never_jit_compiled` watches it.
pub async fn jobs_prune_finished_rolled_up(
    pool: &PgPool,
    succeeded_ms: i64,
    cancelled_ms: i64,
    dead_ms: i64,
    limit: i64,
) -> sqlx::Result<u64> {
    let mut tx = pool.begin_with(BEGIN_PINNED).await?;
    sqlx::query("SET LOCAL jit = off")
        .persistent(false)
        .execute(&mut *tx)
        .await?;
    let deleted: i64 = sqlx::query_scalar(rolled_up!(concat!(
        "WITH doomed AS (
             SELECT id FROM skiplock.jobs
             WHERE ",
        finished_past_retention!(),
        "
             LIMIT $4
             FOR UPDATE SKIP LOCKED
         ), gone AS (
             DELETE FROM skiplock.jobs j USING doomed WHERE j.id = doomed.id
             RETURNING j.*
         )"
    )))
    .bind(succeeded_ms)
    .bind(cancelled_ms)
    .bind(dead_ms)
    .bind(limit)
    .persistent(false)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(deleted as u64)
}

/// Adds the jobs that finished in `state` within `[starts, ends)`, one day partition of
/// `skiplock.jobs_done`, to the history rollup, without deleting them; returns how many.
/// The pruner runs it in the transaction that locked the partition against writes
/// (`skiplock.internal_lock_done_partition`) and then drops it, so every job is counted
/// once: live until its day is dropped, in the rollup after.
pub async fn job_history_roll_up_finished_between(
    db: impl PgExecutor<'_>,
    state: &str,
    starts: DateTime<Utc>,
    ends: DateTime<Utc>,
) -> sqlx::Result<u64> {
    let jobs: i64 = sqlx::query_scalar(concat!(
        "WITH f AS (",
        history_of!(
            "skiplock.jobs",
            "AND j.state = $1::skiplock.job_state AND j.finished_at >= $2 AND j.finished_at < $3"
        ),
        "), rolled AS (",
        insert_into_history!("f"),
        ")
         SELECT coalesce(sum(succeeded + dead + cancelled), 0)::bigint FROM f"
    ))
    .bind(state)
    .bind(starts)
    .bind(ends)
    .persistent(false)
    .fetch_one(db)
    .await?;
    Ok(jobs as u64)
}

/// Deletes one job that is not running and that no waiting job depends on, adding it to
/// the history rollup when it had finished (an unfinished job never counted there).
/// Returns false, deleting nothing, if the job is running, has waiting dependants (cancel
/// it instead, which cancels them too) or does not exist.
pub async fn jobs_delete_rolled_up(db: impl PgExecutor<'_>, id: JobId) -> sqlx::Result<bool> {
    let deleted: i64 = sqlx::query_scalar(rolled_up!(
        "WITH gone AS (
             DELETE FROM skiplock.jobs j
             WHERE j.id = $1 AND j.state <> 'running'
               AND NOT EXISTS (
                   SELECT 1 FROM skiplock.job_dependencies d
                   JOIN skiplock.jobs c ON c.id = d.job_id
                   WHERE d.parent_id = j.id AND c.state = 'waiting'
               )
             RETURNING j.*
         )"
    ))
    .bind(id.0)
    .fetch_one(db)
    .await?;
    Ok(deleted == 1)
}

/// Folds rollup hours older than `keep_ms` milliseconds into one lifetime row per queue and
/// kind (bucket `-infinity`); returns how many hourly rows went. Totals stay exact; only the
/// hour-by-hour detail is dropped. Run it now and then, e.g. with the pruner, with
/// [`HISTORY_RETENTION_DEFAULT`].
pub async fn job_history_prune_expired(db: impl PgExecutor<'_>, keep_ms: i64) -> sqlx::Result<u64> {
    let folded: i64 = sqlx::query_scalar(concat!(
        "WITH expired AS (
             DELETE FROM skiplock.job_history
             WHERE bucket < now() - $1 * interval '1 millisecond' AND bucket <> '-infinity'
             RETURNING *
         ), folded AS (
             INSERT INTO skiplock.job_history AS h
                 (bucket, queue, kind, succeeded, failed, dead, cancelled, run_count,
                  run_seconds, wait_count, wait_seconds, run_histogram)
             SELECT '-infinity', queue, kind, sum(succeeded), sum(failed), sum(dead),
                    sum(cancelled), sum(run_count), sum(run_seconds), sum(wait_count),
                    sum(wait_seconds), skiplock.internal_job_history_array_sum(run_histogram)
             FROM expired
             GROUP BY queue, kind
             ORDER BY queue, kind
",
        upsert_into_history!(),
        "
         )
         SELECT count(*) FROM expired"
    ))
    .bind(keep_ms)
    .fetch_one(db)
    .await?;
    Ok(folded as u64)
}

/// The width of a history bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// One row per hour (UTC).
    Hour,
    /// One row per day (UTC).
    Day,
}

impl Granularity {
    /// The `date_trunc` field name.
    pub fn as_str(self) -> &'static str {
        match self {
            Granularity::Hour => "hour",
            Granularity::Day => "day",
        }
    }
}

/// The numbers of one bucket, queue and kind.
#[derive(Debug, Clone, PartialEq, FromRow, serde::Serialize)]
pub struct HistoryRow {
    /// Start of the hour or day (UTC).
    #[sqlx(try_from = "Timestamp")]
    pub bucket: DateTime<Utc>,
    /// Queue name.
    pub queue: String,
    /// Job kind.
    pub kind: String,
    /// Jobs that succeeded.
    pub succeeded: i64,
    /// Failed attempts (a job retried three times counts three).
    pub failed: i64,
    /// Jobs that went dead.
    pub dead: i64,
    /// Jobs cancelled.
    pub cancelled: i64,
    /// Succeeded and dead jobs with a known run time.
    pub run_count: i64,
    /// Sum of their run times (`finished_at - claimed_at`), seconds.
    pub run_seconds: f64,
    /// Succeeded and dead jobs with a known wait time.
    pub wait_count: i64,
    /// Sum of their wait times (`claimed_at - scheduled_at`), seconds.
    pub wait_seconds: f64,
}

/// Which history [`admin::history`](crate::admin::history) returns.
#[derive(Debug, Clone)]
pub struct HistoryFilter {
    /// Bucket width.
    pub granularity: Granularity,
    /// Buckets starting at or after the bucket that holds this instant.
    pub since: DateTime<Utc>,
    /// Only this queue.
    pub queue: Option<String>,
    /// Only this kind.
    pub kind: Option<String>,
}

/// History per bucket, queue and kind since `filter.since`, oldest bucket first: the rollup
/// plus finished jobs not pruned yet.
///
/// The live half reads only jobs that finished since the first bucket (through the
/// `(state, finished_at)` index); a failed attempt always precedes its job's finish, so
/// that misses none.
pub async fn job_history_list(
    db: impl PgExecutor<'_>,
    filter: &HistoryFilter,
) -> sqlx::Result<Vec<HistoryRow>> {
    // $4 is the first bucket: `since` truncated to the granularity.
    sqlx::query_as(concat!(
        "SELECT date_trunc($1, h.bucket, 'UTC') AS bucket, h.queue, h.kind,
                sum(h.succeeded)::bigint AS succeeded, sum(h.failed)::bigint AS failed,
                sum(h.dead)::bigint AS dead, sum(h.cancelled)::bigint AS cancelled,
                sum(h.run_count)::bigint AS run_count, sum(h.run_seconds)::float8 AS run_seconds,
                sum(h.wait_count)::bigint AS wait_count,
                sum(h.wait_seconds)::float8 AS wait_seconds
         FROM (
             SELECT r.bucket, r.queue, r.kind, r.succeeded, r.failed, r.dead, r.cancelled,
                    r.run_count, r.run_seconds, r.wait_count, r.wait_seconds
             FROM skiplock.job_history r
             WHERE r.bucket >= $4
               AND ($2::text IS NULL OR r.queue = $2) AND ($3::text IS NULL OR r.kind = $3)
             UNION ALL
             SELECT l.bucket, l.queue, l.kind, l.succeeded, l.failed, l.dead, l.cancelled,
                    l.run_count, l.run_seconds, l.wait_count, l.wait_seconds
             FROM (",
        history_of!(
            "skiplock.jobs",
            "AND j.state IN ('succeeded', 'dead', 'cancelled') AND j.finished_at >= $4
             AND ($2::text IS NULL OR j.queue = $2) AND ($3::text IS NULL OR j.kind = $3)"
        ),
        ") l
             WHERE l.bucket >= $4
         ) h
         GROUP BY 1, 2, 3
         ORDER BY 1, 2, 3"
    ))
    .bind(filter.granularity.as_str())
    .bind(filter.queue.as_deref())
    .bind(filter.kind.as_deref())
    .bind(truncate(filter.since, filter.granularity))
    .fetch_all(db)
    .await
}

/// `at` truncated to the start of its hour or day (UTC).
fn truncate(at: DateTime<Utc>, granularity: Granularity) -> DateTime<Utc> {
    let step = match granularity {
        Granularity::Hour => 3600,
        Granularity::Day => 86_400,
    };
    let seconds = at.timestamp().div_euclid(step) * step;
    DateTime::from_timestamp(seconds, 0).unwrap_or(at)
}

/// Lifetime totals of one queue and kind, as [`admin::history_totals`](crate::admin::history_totals)
/// returns them.
#[derive(Debug, Clone, PartialEq, FromRow)]
pub struct HistoryTotals {
    /// Queue name.
    pub queue: String,
    /// Job kind.
    pub kind: String,
    /// Jobs that succeeded.
    pub succeeded: i64,
    /// Failed attempts.
    pub failed: i64,
    /// Jobs that went dead.
    pub dead: i64,
    /// Jobs cancelled.
    pub cancelled: i64,
    /// Succeeded and dead jobs with a known run time.
    pub run_count: i64,
    /// Sum of their run times, seconds.
    pub run_seconds: f64,
    /// Run times per histogram bucket: element `i` counts run times below `bounds[i]` and
    /// at or above `bounds[i - 1]`; the last element counts those at or above the last
    /// bound. Not cumulative.
    pub run_histogram: Vec<i64>,
}

/// Lifetime totals per queue and kind (the whole rollup plus every retained finished job),
/// by queue then kind. Reading it visits every retained finished job, so its cost follows
/// the retention.
pub async fn job_history_totals(db: impl PgExecutor<'_>) -> sqlx::Result<Vec<HistoryTotals>> {
    // The histograms are summed element by element through unnest: the rollup holds a row
    // per hour, and an aggregate calling a SQL function per row would be slow.
    sqlx::query_as(concat!(
        "WITH everything AS (
             SELECT queue, kind, succeeded, failed, dead, cancelled, run_count, run_seconds,
                    run_histogram
             FROM skiplock.job_history
             UNION ALL
             SELECT l.queue, l.kind, l.succeeded, l.failed, l.dead, l.cancelled, l.run_count,
                    l.run_seconds, l.run_histogram
             FROM (",
        history_of!(
            "skiplock.jobs",
            "AND j.state IN ('succeeded', 'dead', 'cancelled')"
        ),
        ") l
         ),
         slots AS (
             SELECT queue, kind, i, sum(n)::bigint AS n
             FROM everything, unnest(run_histogram) WITH ORDINALITY AS u(n, i)
             GROUP BY queue, kind, i
         )
         SELECT t.queue, t.kind, t.succeeded, t.failed, t.dead, t.cancelled, t.run_count,
                t.run_seconds,
                coalesce((SELECT array_agg(s.n ORDER BY s.i) FROM slots s
                          WHERE s.queue = t.queue AND s.kind = t.kind), '{}') AS run_histogram
         FROM (
             SELECT queue, kind, sum(succeeded)::bigint AS succeeded,
                    sum(failed)::bigint AS failed, sum(dead)::bigint AS dead,
                    sum(cancelled)::bigint AS cancelled, sum(run_count)::bigint AS run_count,
                    sum(run_seconds)::float8 AS run_seconds
             FROM everything
             GROUP BY queue, kind
         ) t
         ORDER BY t.queue, t.kind"
    ))
    .fetch_all(db)
    .await
}

/// Upper bounds, in seconds and ascending, of the run-time histogram buckets
/// (`skiplock.internal_job_history_run_bounds()`).
#[cfg(any(feature = "cli", feature = "internals"))]
pub async fn job_history_run_bounds(db: impl PgExecutor<'_>) -> sqlx::Result<Vec<f64>> {
    sqlx::query_scalar("SELECT skiplock.internal_job_history_run_bounds()")
        .fetch_one(db)
        .await
}
