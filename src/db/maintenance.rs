//! Statements of the maintenance services every worker runs (`src/maintenance/`): the
//! reaper, the pruner, the dependency sweep, and the lane and dependant moves that follow a
//! finished job. They take no claim token: they act on rows whose holder is gone (stale
//! heartbeats) or that no one holds (finished, waiting), and skip locked rows so that any
//! number of workers can run them at once.
//!
//! The reaper's, pruner's and sweep's statements and the idle check are planned at every
//! call (unnamed statements), for the reason given in [`crate::db::jobs`]: a plan cached
//! while the table was small goes on scanning it whole once it is large.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

use crate::state::JobState;

/// A job the reaper took back from a vanished holder.
#[derive(Debug, Clone, FromRow)]
pub struct ReapedJob {
    /// Job id.
    pub id: i64,
    /// `queued` (will run again) or `dead` (no attempt left); read as text, as
    /// [`crate::db::jobs::SavedJob::state`].
    #[sqlx(try_from = "String")]
    pub state: JobState,
    /// The holder that stopped heartbeating.
    pub claimed_by: Option<String>,
    /// Its ordering lane, if any.
    pub ordering_key: Option<String>,
}

/// Takes back up to `limit` running jobs whose heartbeat is older than `stale_after_ms` (by
/// the database clock), or as far in the future: `queued` with the default backoff, `dead`
/// when their attempts are spent, or `cancelled` when a pending job took their
/// `unique_key`. Safe from any number of workers at once. The caller moves on the lanes and
/// dependants of those that finished. How and why: `skiplock.internal_reap_stale` in
/// migrations/functions/08_outcomes.sql.
pub async fn jobs_reap_stale(
    db: impl PgExecutor<'_>,
    stale_after_ms: i64,
    limit: i64,
) -> sqlx::Result<Vec<ReapedJob>> {
    jobs_reap_stale_matching(db, stale_after_ms, limit, None, None).await
}

/// [`jobs_reap_stale`] over the heartbeats from `since` on only (and those in the future):
/// the reaper's pass between its full passes, where `since` is where the previous pass's
/// stale range ended.
///
/// A full pass walks `jobs_running_idx` from its left edge. Every job that was ever
/// `running` left an entry there with its last heartbeat time, and while another session
/// holds a snapshot with an xid (a long report, `pg_dump`, a forgotten `BEGIN`) none of
/// them can be removed: the full pass then fetches a heap row for every job processed
/// since the snapshot began (300,000 jobs into a held snapshot: 6,772 buffers and 21 ms a
/// pass, growing without bound). From `since` on, it steps over the entries of one reaper
/// interval only.
pub async fn jobs_reap_stale_since(
    db: impl PgExecutor<'_>,
    stale_after_ms: i64,
    limit: i64,
    since: DateTime<Utc>,
) -> sqlx::Result<Vec<ReapedJob>> {
    jobs_reap_stale_matching(db, stale_after_ms, limit, None, Some(since)).await
}

/// Where a reaper pass's stale range ends: the database's `now() - stale_after_ms`. A
/// pass that starts after this statement looks at every heartbeat before it (and reaps
/// those it can lock).
pub async fn jobs_stale_threshold(
    db: impl PgExecutor<'_>,
    stale_after_ms: i64,
) -> sqlx::Result<DateTime<Utc>> {
    sqlx::query_scalar("SELECT now() - $1 * interval '1 millisecond'")
        .bind(stale_after_ms)
        .persistent(false)
        .fetch_one(db)
        .await
}

/// [`jobs_reap_stale`] for one job only, if its claim is stale: the reaper's way round a
/// batch that failed on one row.
pub async fn jobs_reap_stale_one(
    db: impl PgExecutor<'_>,
    stale_after_ms: i64,
    id: i64,
) -> sqlx::Result<Vec<ReapedJob>> {
    jobs_reap_stale_matching(db, stale_after_ms, 1, Some(id), None).await
}

async fn jobs_reap_stale_matching(
    db: impl PgExecutor<'_>,
    stale_after_ms: i64,
    limit: i64,
    only: Option<i64>,
    since: Option<DateTime<Utc>>,
) -> sqlx::Result<Vec<ReapedJob>> {
    sqlx::query_as(
        "SELECT id, state, claimed_by, ordering_key
         FROM skiplock.internal_reap_stale($1, $2, $3, $4)",
    )
    .bind(stale_after_ms)
    .bind(limit)
    .bind(only)
    .bind(since)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// The claims (id, token) [`jobs_reap_stale`] would take back, oldest first, without
/// taking them: the reaper lists them to reap one at a time when a batch failed
/// (`skiplock.internal_stale_claims`, which `skiplock.maintain` uses the same way).
pub async fn jobs_list_stale(
    db: impl PgExecutor<'_>,
    stale_after_ms: i64,
    limit: i64,
) -> sqlx::Result<Vec<(i64, Uuid)>> {
    sqlx::query_as("SELECT id, claim_token FROM skiplock.internal_stale_claims($1, $2)")
        .bind(stale_after_ms)
        .bind(limit)
        .persistent(false)
        .fetch_all(db)
        .await
}

#[cfg(feature = "internals")]
/// Deletes up to `limit` finished jobs past their state's retention (milliseconds since
/// `finished_at`) that are not dropped with their day (see `finished_past_retention!`);
/// returns how many went. Locked rows are skipped, never waited on.
pub async fn jobs_prune_finished(
    db: impl PgExecutor<'_>,
    succeeded_ms: i64,
    cancelled_ms: i64,
    dead_ms: i64,
    limit: i64,
) -> sqlx::Result<u64> {
    let result = sqlx::query(concat!(
        "WITH doomed AS (
             SELECT id FROM skiplock.jobs
             WHERE ",
        finished_past_retention!(),
        "
             LIMIT $4
             FOR UPDATE SKIP LOCKED
         )
         DELETE FROM skiplock.jobs j USING doomed WHERE j.id = doomed.id"
    ))
    .bind(succeeded_ms)
    .bind(cancelled_ms)
    .bind(dead_ms)
    .bind(limit)
    .persistent(false)
    .execute(db)
    .await?;
    Ok(result.rows_affected())
}

/// Ids of up to `limit` finished jobs as [`jobs_prune_finished`] would delete them: the
/// pruner's list when a batch failed and it deletes one job at a time.
pub async fn jobs_list_prunable(
    db: impl PgExecutor<'_>,
    succeeded_ms: i64,
    cancelled_ms: i64,
    dead_ms: i64,
    limit: i64,
) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar(concat!(
        "SELECT id FROM skiplock.jobs WHERE ",
        finished_past_retention!(),
        " LIMIT $4"
    ))
    .bind(succeeded_ms)
    .bind(cancelled_ms)
    .bind(dead_ms)
    .bind(limit)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// Deletes one finished job without adding it to the history rollup: the pruner's last
/// resort for a row whose rollup fails (an `errors` list written by hand that is not what
/// skiplock writes). Returns whether it was deleted.
pub async fn jobs_delete_finished_unrolled(db: impl PgExecutor<'_>, id: i64) -> sqlx::Result<bool> {
    let deleted = sqlx::query(
        "DELETE FROM skiplock.jobs WHERE id = $1 AND state IN ('succeeded', 'dead', 'cancelled')",
    )
    .bind(id)
    .execute(db)
    .await?;
    Ok(deleted.rows_affected() == 1)
}

/// Whether any job of these queues and kinds is runnable now or running anywhere, or held
/// back by a per-key limit (it becomes runnable when its key has room, without a write):
/// `skiplock.has_work`, which the example workers in other languages ask too. It runs only
/// when a worker with `exit_when_idle` finds nothing to claim.
pub async fn jobs_any_active(
    db: impl PgExecutor<'_>,
    queues: &[String],
    kinds: &[String],
) -> sqlx::Result<bool> {
    sqlx::query_scalar("SELECT skiplock.has_work($1, $2)")
        .bind(queues)
        .bind(kinds)
        .persistent(false)
        .fetch_one(db)
        .await
}

/// What a worker that exits when idle leaves behind in these queues and kinds (jobs of a
/// paused queue, in a retry's backoff or a snooze, scheduled later), as the line to print,
/// or `None`: `skiplock.left_behind`, which the example workers print too.
pub async fn jobs_left_behind(
    db: impl PgExecutor<'_>,
    queues: &[String],
    kinds: &[String],
) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar("SELECT skiplock.left_behind($1, $2)")
        .bind(queues)
        .bind(kinds)
        .persistent(false)
        .fetch_optional(db)
        .await
        .map(Option::flatten)
}

/// Moves the waiting children of `parent_ids` on: `queued` once all their parents
/// succeeded, `cancelled` (transitively) once one is dead or cancelled. Returns how many
/// jobs moved.
pub async fn jobs_settle_dependants(
    db: impl PgExecutor<'_>,
    parent_ids: &[i64],
) -> sqlx::Result<i32> {
    sqlx::query_scalar("SELECT skiplock.internal_settle_dependants($1)")
        .bind(parent_ids)
        .fetch_one(db)
        .await
}

/// Promotes the next job of each lane whose head finished. Returns how many moved.
pub async fn jobs_advance_lanes(db: impl PgExecutor<'_>, keys: &[String]) -> sqlx::Result<i32> {
    sqlx::query_scalar("SELECT skiplock.internal_advance_lanes($1)")
        .bind(keys)
        .fetch_one(db)
        .await
}

/// Repairs what a race may have left (waiting jobs whose parents have all finished, lanes
/// whose head finished while a new lane job was being enqueued); returns how many jobs
/// moved. What it repairs and why: `skiplock.internal_settle_waiting` in
/// migrations/functions/08_outcomes.sql. Unnamed, as the module's statements are.
pub async fn jobs_settle_waiting(db: impl PgExecutor<'_>) -> sqlx::Result<i32> {
    sqlx::query_scalar("SELECT skiplock.internal_settle_waiting()")
        .persistent(false)
        .fetch_one(db)
        .await
}
