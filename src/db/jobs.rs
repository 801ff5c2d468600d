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
//! dropped. The claim alone updates by ctid (see `skiplock.claim_batch` in the schema).
//!
//! The statements that finish or release claims lock their rows in id order (the claim
//! list is sorted by id first): locking in one global order means two of them touching
//! overlapping rows queue behind each other instead of deadlocking (a deadlock costs
//! `deadlock_timeout`, one second by default). `FOR UPDATE` re-checks the
//! claim token on the newest row version after any wait, so a claim lost meanwhile drops
//! out. The heartbeat never waits at all (see [`jobs_heartbeat_many`]).

use super::timestamp::{MaybeTimestamp, Timestamp};
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

use crate::state::{JobId, JobState};

/// A full row of `skiplock.jobs`, as operators see it.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
#[non_exhaustive]
pub struct JobRow {
    /// Job id.
    pub id: i64,
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
    #[sqlx(try_from = "Timestamp")]
    pub scheduled_at: DateTime<Utc>,
    /// Attempts started so far.
    pub attempt: i32,
    /// Attempt budget.
    pub max_attempts: i32,
    /// Current claim's fencing token (running jobs only).
    pub claim_token: Option<Uuid>,
    /// Worker that holds or last held the job.
    pub claimed_by: Option<String>,
    /// When the current or last claim was taken.
    #[sqlx(try_from = "MaybeTimestamp")]
    pub claimed_at: Option<DateTime<Utc>>,
    /// Last heartbeat of the current claim.
    #[sqlx(try_from = "MaybeTimestamp")]
    pub heartbeat_at: Option<DateTime<Utc>>,
    /// Strict FIFO lane.
    pub ordering_key: Option<String>,
    /// Deduplication key.
    pub unique_key: Option<String>,
    /// What a second enqueue with the same pending unique key does.
    pub unique_policy: Option<String>,
    /// Latest progress reported by the handler.
    pub progress: Option<Json<Value>>,
    /// Output recorded by the handler.
    pub output: Option<Json<Value>>,
    /// Message of the latest failure.
    pub last_error: Option<String>,
    /// Recent failures: `{attempt, at, message}`, oldest first.
    pub errors: Json<Value>,
    /// When the job was enqueued.
    #[sqlx(try_from = "Timestamp")]
    pub created_at: DateTime<Utc>,
    /// When the job reached a final state.
    #[sqlx(try_from = "MaybeTimestamp")]
    pub finished_at: Option<DateTime<Utc>>,
}

/// A job as a claim hands it to a worker.
#[derive(Debug, Clone, FromRow)]
pub struct ClaimedJob {
    /// Job id.
    pub id: i64,
    /// Queue name.
    pub queue: String,
    /// Handler kind.
    pub kind: String,
    /// Payload.
    pub args: Json<Value>,
    /// This attempt's number (already incremented by the claim).
    pub attempt: i32,
    /// Attempt budget.
    pub max_attempts: i32,
    /// The claim's fencing token.
    pub claim_token: Uuid,
    /// Priority (lower runs first), part of the claim key.
    pub priority: i16,
    /// `scheduled_at` in microseconds since the Unix epoch, part of the claim key;
    /// `i64::MIN` for a row scheduled at `-infinity`.
    pub scheduled_at_us: i64,
}

impl ClaimedJob {
    /// The job's place in claim order: a claim from this position takes only jobs after it.
    pub fn position(&self) -> ClaimPosition {
        ClaimPosition {
            priority: self.priority,
            scheduled_at_us: self.scheduled_at_us,
            id: self.id,
        }
    }
}

/// A place in claim order, the key `(priority, scheduled_at, id)` of a claimed job,
/// compared in that order (as `jobs_claim_idx` sorts within a queue). See [`jobs_claim_batch_after`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClaimPosition {
    /// Priority.
    pub priority: i16,
    /// `scheduled_at` in microseconds since the Unix epoch (`i64::MIN`: `-infinity`).
    pub scheduled_at_us: i64,
    /// Job id.
    pub id: i64,
}

#[cfg(feature = "internals")]
/// Claims up to `limit` runnable jobs of the given queues and kinds, in claim order
/// (priority, then `scheduled_at`, then id), in one statement.
///
/// It calls `skiplock.claim_batch` (`migrations/0001_schema.sql`, where the statement and its
/// reasons are): rows are picked with `FOR UPDATE SKIP LOCKED`, so concurrent claimers never
/// wait on each other and never pick the same row, and each is stamped with its own fresh
/// `claim_token`, the claimant and the database's `now()` as first heartbeat. The function
/// fixes the plan to an ordered walk of the claim index, so the claim stays O(limit) even
/// when the table's statistics are stale. It takes a lane's job only when it is the lane's
/// oldest unfinished one and nothing of the lane runs, and never fails on what the rows
/// hold (a lane conflict it could not see is retried without lane jobs).
pub async fn jobs_claim_batch(
    db: impl PgExecutor<'_>,
    queues: &[String],
    kinds: &[String],
    limit: i64,
    claimed_by: &str,
) -> sqlx::Result<Vec<ClaimedJob>> {
    jobs_claim_batch_after(db, queues, kinds, limit, claimed_by, None, None).await
}

/// [`jobs_claim_batch`] from a position: only jobs after `after` in claim order are
/// claimed (all of them with `None`, a full walk).
///
/// Claiming from the position of the caller's last claimed job steps over none of the
/// index entries its own earlier claims left behind, which Postgres cannot remove while an
/// older snapshot is held (`claim_batch` has the measurements). Jobs that land behind the
/// position (a higher priority, a job that waited and became queued) are claimed only by
/// a full walk, so a caller must still do one now and then; the worker's producer does
/// (`worker::claim_cursor`).
///
/// With `claim_with`, every job the claim takes holds it as its claim token, so a caller
/// whose reply was lost can find them with [`jobs_claimed_with`]; use a fresh
/// token for every claim, as it is the fence of each job's claim. Without it, each job
/// gets a random token of its own.
pub async fn jobs_claim_batch_after(
    db: impl PgExecutor<'_>,
    queues: &[String],
    kinds: &[String],
    limit: i64,
    claimed_by: &str,
    after: Option<ClaimPosition>,
    claim_with: Option<Uuid>,
) -> sqlx::Result<Vec<ClaimedJob>> {
    sqlx::query_as(
        "SELECT id, queue, kind, args, attempt, max_attempts, claim_token, priority,
                scheduled_at_us
         FROM skiplock.claim_batch($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(queues)
    .bind(kinds)
    .bind(limit)
    .bind(claimed_by)
    .bind(after.map(|p| p.priority))
    .bind(after.map(|p| p.scheduled_at_us))
    .bind(after.map(|p| p.id))
    .bind(claim_with)
    .fetch_all(db)
    .await
}

/// Claims job `id` alone, now, whatever its `scheduled_at`, if it is `queued`, with the
/// token `claim_with`: for running one chosen job through a worker (`skiplock::testing`).
/// Lane and unique-key rules hold as for any claim (a lane whose job runs refuses it with
/// `jobs_ordering_key_running_idx`).
pub async fn jobs_claim_one(
    db: impl PgExecutor<'_>,
    id: i64,
    claimed_by: &str,
    claim_with: Uuid,
) -> sqlx::Result<Vec<ClaimedJob>> {
    sqlx::query_as(
        "UPDATE skiplock.jobs
         SET state = 'running', claim_token = $3, claimed_by = $2, claimed_at = now(),
             heartbeat_at = now(), attempt = least(attempt, 2147483646) + 1
         WHERE id = $1 AND state = 'queued'
         RETURNING id, queue, kind, args, attempt, max_attempts, claim_token, priority,
                   CASE WHEN isfinite(scheduled_at)
                        THEN (extract(epoch FROM scheduled_at) * 1000000)::bigint
                        ELSE -9223372036854775808 END AS scheduled_at_us",
    )
    .bind(id)
    .bind(claimed_by)
    .bind(claim_with)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// The jobs still held by the claim made with `claim_with` (see
/// [`jobs_claim_batch_after`]): for a claim whose reply was lost, whose jobs nobody runs
/// and which the caller releases with [`jobs_release_many`]. Reads only `running` rows
/// (`jobs_running_idx`).
pub async fn jobs_claimed_with(
    db: impl PgExecutor<'_>,
    claim_with: Uuid,
) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar("SELECT id FROM skiplock.jobs WHERE state = 'running' AND claim_token = $1")
        .bind(claim_with)
        .fetch_all(db)
        .await
}

/// A job whose outcome was saved, and whether other jobs wait on it.
#[derive(Debug, Clone, FromRow)]
pub struct SavedJob {
    /// Job id.
    pub id: i64,
    /// State it moved to. Read as text: sqlx 0.9 loses an unnamed statement when it looks
    /// up a custom type's OID on a fresh connection (transact-rs/sqlx#4305), and the
    /// statements returning it are unnamed (see the module's doc).
    #[sqlx(try_from = "String")]
    pub state: JobState,
    /// Whether `skiplock.job_dependencies` names it as a parent.
    pub has_dependants: bool,
    /// Its ordering lane, if any: the next job of the lane may be promoted now.
    pub ordering_key: Option<String>,
}

/// Marks held jobs `succeeded`; returns those whose claim was still valid.
pub async fn jobs_complete_many(
    db: impl PgExecutor<'_>,
    ids: &[i64],
    tokens: &[Uuid],
) -> sqlx::Result<Vec<SavedJob>> {
    let claims = ClaimList::sorted(ids, tokens);
    sqlx::query_as(
        "WITH held AS (
             SELECT j.id FROM unnest($1::bigint[], $2::uuid[]) AS c(id, token),
             LATERAL (SELECT id FROM skiplock.jobs j
                      WHERE j.id = c.id AND j.claim_token = c.token
                      FOR UPDATE) j
         )
         UPDATE skiplock.jobs j
         SET state = 'succeeded', finished_at = now(), claim_token = NULL, heartbeat_at = NULL
         WHERE j.id = ANY(ARRAY(SELECT id FROM held))
         RETURNING j.id, j.state::text AS state,
                   EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = j.id)
                       AS has_dependants,
                   j.ordering_key",
    )
    .bind(&claims.ids)
    .bind(&claims.tokens)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// Of `ids`, the jobs `succeeded` under `worker`'s name, as [`jobs_complete_many`] returns
/// them: for a completion write whose reply was lost, the jobs it did complete.
pub async fn jobs_completed_by(
    db: impl PgExecutor<'_>,
    ids: &[i64],
    worker: &str,
) -> sqlx::Result<Vec<SavedJob>> {
    sqlx::query_as(
        "SELECT j.id, j.state::text AS state,
                EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = j.id)
                    AS has_dependants,
                j.ordering_key
         FROM skiplock.jobs j
         WHERE j.id = ANY($1) AND j.state = 'succeeded' AND j.claimed_by = $2",
    )
    .bind(ids)
    .bind(worker)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// Of the failed attempts `ids` (each with the `message` its failure wrote), the jobs a
/// failure write of `worker` settled, as [`jobs_fail_many`] returns them: for a failure
/// write whose reply was lost, the failures it did save. Such a row is no longer held, is
/// still named after `worker`, and its last error is that message for its current attempt
/// (the reaper writes its own message; a new claim moves the attempt on).
pub async fn jobs_failed_by(
    db: impl PgExecutor<'_>,
    ids: &[i64],
    messages: &[String],
    worker: &str,
) -> sqlx::Result<Vec<SavedJob>> {
    sqlx::query_as(
        "SELECT j.id, j.state::text AS state,
                EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = j.id)
                    AS has_dependants,
                j.ordering_key
         FROM unnest($1::bigint[], $2::text[]) AS f(id, message)
         JOIN skiplock.jobs j ON j.id = f.id
         WHERE j.claimed_by = $3 AND j.claim_token IS NULL
           AND j.state IN ('queued', 'dead', 'cancelled')
           AND j.errors -> -1 -> 'message' = to_jsonb(f.message)
           AND j.errors -> -1 -> 'attempt' = to_jsonb(j.attempt)",
    )
    .bind(ids)
    .bind(messages)
    .bind(worker)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// Of the claims `ids` (each held at attempt `attempts`), the jobs a release of `worker`
/// gave back, as [`jobs_release_many`] returns them: for a release whose reply was lost,
/// the jobs it did release. Such a row is no longer held, is still named after `worker`,
/// and is one attempt behind the claim (a release gives the attempt back; the reaper keeps
/// it, and a new claim moves it on).
pub async fn jobs_released_by(
    db: impl PgExecutor<'_>,
    ids: &[i64],
    attempts: &[i32],
    worker: &str,
) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar(
        "SELECT j.id
         FROM unnest($1::bigint[], $2::int[]) AS f(id, attempt)
         JOIN skiplock.jobs j ON j.id = f.id
         WHERE j.claimed_by = $3 AND j.claim_token IS NULL
           AND j.state IN ('queued', 'cancelled')
           AND j.attempt = greatest(f.attempt - 1, 0)",
    )
    .bind(ids)
    .bind(attempts)
    .bind(worker)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// What a failed attempt asks for, as [`jobs_fail_many`] takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailAction {
    /// Back to `queued` after the delay, or `dead` if no attempt is left.
    Retry,
    /// `dead` now.
    Dead,
    /// `cancelled` now.
    Cancel,
}

impl FailAction {
    fn as_str(self) -> &'static str {
        match self {
            FailAction::Retry => "retry",
            FailAction::Dead => "dead",
            FailAction::Cancel => "cancel",
        }
    }
}

/// Column-wise batch of failed attempts for [`jobs_fail_many`].
#[derive(Debug, Default)]
pub struct FailBatch {
    /// Job ids.
    pub ids: Vec<i64>,
    /// Claim tokens presented.
    pub tokens: Vec<Uuid>,
    /// Error messages.
    pub messages: Vec<String>,
    /// Retry delays in milliseconds (used by [`FailAction::Retry`]).
    pub delays_ms: Vec<i64>,
    /// What each failure asks for.
    pub actions: Vec<&'static str>,
}

impl FailBatch {
    /// Adds one failed attempt.
    pub fn push(
        &mut self,
        id: i64,
        token: Uuid,
        message: String,
        delay_ms: i64,
        action: FailAction,
    ) {
        self.ids.push(id);
        self.tokens.push(token);
        self.messages.push(sanitize_message(&message));
        self.delays_ms.push(delay_ms);
        self.actions.push(action.as_str());
    }

    /// Whether the batch holds nothing.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Number of failed attempts in the batch.
    #[cfg(feature = "internals")]
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// The failures at `range`, as a batch of their own.
    pub fn slice(&self, range: std::ops::Range<usize>) -> FailBatch {
        FailBatch {
            ids: self.ids[range.clone()].to_vec(),
            tokens: self.tokens[range.clone()].to_vec(),
            messages: self.messages[range.clone()].to_vec(),
            delays_ms: self.delays_ms[range.clone()].to_vec(),
            actions: self.actions[range].to_vec(),
        }
    }

    /// The same failures ordered by job id, the order the statement locks rows in.
    fn sorted(&self) -> FailBatch {
        let mut order: Vec<usize> = (0..self.ids.len()).collect();
        order.sort_unstable_by_key(|&i| self.ids[i]);
        FailBatch {
            ids: order.iter().map(|&i| self.ids[i]).collect(),
            tokens: order.iter().map(|&i| self.tokens[i]).collect(),
            messages: order.iter().map(|&i| self.messages[i].clone()).collect(),
            delays_ms: order.iter().map(|&i| self.delays_ms[i]).collect(),
            actions: order.iter().map(|&i| self.actions[i]).collect(),
        }
    }
}

/// Longest error message saved on a job, in bytes; longer ones are cut at a character
/// boundary and marked. Bounds the row (and `errors`, which keeps 20 of them).
pub const ERROR_MESSAGE_MAX_BYTES: usize = 8 * 1024;

/// An error message as it can be saved: Postgres `text` cannot hold NUL bytes (a handler's
/// or a program's output may contain them; the whole batch write used to fail on one), so
/// they become U+FFFD, and the message is bounded to [`ERROR_MESSAGE_MAX_BYTES`].
pub fn sanitize_message(message: &str) -> String {
    let mut clean = message.replace('\0', "\u{FFFD}");
    if clean.len() > ERROR_MESSAGE_MAX_BYTES {
        const MARK: &str = "… (truncated)";
        let mut end = ERROR_MESSAGE_MAX_BYTES - MARK.len();
        while !clean.is_char_boundary(end) {
            end -= 1;
        }
        clean.truncate(end);
        clean.push_str(MARK);
    }
    clean
}

/// Claims (job id and token) sorted by job id: the statements that finish claims lock
/// rows in the order of this list, and one global order means no deadlocks.
struct ClaimList {
    ids: Vec<i64>,
    tokens: Vec<Uuid>,
}

impl ClaimList {
    fn sorted(ids: &[i64], tokens: &[Uuid]) -> Self {
        let mut pairs: Vec<(i64, Uuid)> = ids.iter().copied().zip(tokens.iter().copied()).collect();
        pairs.sort_unstable_by_key(|&(id, _)| id);
        let (ids, tokens) = pairs.into_iter().unzip();
        Self { ids, tokens }
    }
}

/// Records failed attempts: each job goes back to `queued` with its delay, or `dead`, or
/// `cancelled`, and its error is appended. Returns the jobs whose claim was still valid.
///
/// A retry whose `unique_key` another pending job took while this one ran is superseded
/// by it (`skiplock.fold_into_key_holder`): the job ends `cancelled`.
pub async fn jobs_fail_many(
    db: impl PgExecutor<'_>,
    batch: &FailBatch,
) -> sqlx::Result<Vec<SavedJob>> {
    let batch = batch.sorted();
    sqlx::query_as(
        "WITH failed AS (
             SELECT f.*, j.unique_key, CASE
                     WHEN f.action = 'cancel' THEN 'cancelled'
                     WHEN f.action = 'dead' OR j.attempt >= j.max_attempts THEN 'dead'
                     ELSE 'queued'
                 END::skiplock.job_state AS next_state
             FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::bigint[], $5::text[])
                  AS f(id, token, message, delay_ms, action),
             LATERAL (SELECT id, attempt, max_attempts, unique_key FROM skiplock.jobs j
                      WHERE j.id = f.id AND j.claim_token = f.token
                      FOR UPDATE) j
         ), folded AS (
             SELECT f.*, CASE WHEN f.next_state = 'queued' AND f.unique_key IS NOT NULL
                              THEN skiplock.fold_into_key_holder(f.id) END AS holder
             FROM failed f
         )
         UPDATE skiplock.jobs j
         SET state = CASE WHEN f.holder IS NULL THEN f.next_state ELSE 'cancelled' END,
             scheduled_at = CASE WHEN f.next_state = 'queued' AND f.holder IS NULL
                 THEN now() + f.delay_ms * interval '1 millisecond' ELSE j.scheduled_at END,
             finished_at = CASE WHEN f.next_state = 'queued' AND f.holder IS NULL
                 THEN NULL ELSE now() END,
             claim_token = NULL, heartbeat_at = NULL,
             last_error = CASE WHEN f.holder IS NULL THEN f.message
                 ELSE skiplock.superseded_message(f.holder, f.unique_key) END,
             errors = skiplock.append_error(j.errors, j.attempt, f.message)
         FROM folded f
         WHERE j.id = ANY(ARRAY(SELECT id FROM folded)) AND j.id = f.id
         RETURNING j.id, j.state::text AS state,
                   EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = j.id)
                       AS has_dependants,
                   j.ordering_key",
    )
    .bind(&batch.ids)
    .bind(&batch.tokens)
    .bind(&batch.messages)
    .bind(&batch.delays_ms)
    .bind(&batch.actions)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// Gives held jobs back to the queue without counting the attempt: a graceful shutdown
/// (`delays_ms` 0: they keep their `scheduled_at`, they were due already, and so their
/// place in line) or a handler's snooze (due again `delays_ms` milliseconds from now). A
/// job whose `unique_key` another pending job took meanwhile is superseded by it and ends
/// `cancelled`. Returns the ids whose claim was still valid.
pub async fn jobs_release_many(
    db: impl PgExecutor<'_>,
    ids: &[i64],
    tokens: &[Uuid],
    delays_ms: &[i64],
) -> sqlx::Result<Vec<i64>> {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_unstable_by_key(|&i| ids[i]);
    let ids: Vec<i64> = order.iter().map(|&i| ids[i]).collect();
    let tokens: Vec<Uuid> = order.iter().map(|&i| tokens[i]).collect();
    let delays_ms: Vec<i64> = order.iter().map(|&i| delays_ms[i]).collect();
    sqlx::query_scalar(
        "WITH held AS (
             SELECT j.id, j.unique_key, c.delay_ms
             FROM unnest($1::bigint[], $2::uuid[], $3::bigint[]) AS c(id, token, delay_ms),
             LATERAL (SELECT id, unique_key FROM skiplock.jobs j
                      WHERE j.id = c.id AND j.claim_token = c.token
                      FOR UPDATE) j
         ), folded AS (
             SELECT h.*, CASE WHEN h.unique_key IS NOT NULL
                              THEN skiplock.fold_into_key_holder(h.id) END AS holder
             FROM held h
         ), released AS (
             UPDATE skiplock.jobs j
             SET state = CASE WHEN f.holder IS NULL THEN 'queued' ELSE 'cancelled' END
                     ::skiplock.job_state,
                 attempt = greatest(j.attempt - 1, 0),
                 scheduled_at = CASE WHEN f.holder IS NULL AND f.delay_ms > 0
                     THEN now() + f.delay_ms * interval '1 millisecond'
                     ELSE j.scheduled_at END,
                 claim_token = NULL, heartbeat_at = NULL,
                 finished_at = CASE WHEN f.holder IS NULL THEN NULL ELSE now() END,
                 last_error = CASE WHEN f.holder IS NULL THEN j.last_error
                     ELSE skiplock.superseded_message(f.holder, f.unique_key) END
             FROM folded f
             WHERE j.id = ANY(ARRAY(SELECT id FROM folded)) AND j.id = f.id
             RETURNING j.id, j.queue, j.state, f.delay_ms
         ), woken AS (
             SELECT pg_notify('skiplock_jobs', queue)
             FROM (SELECT DISTINCT queue FROM released
                   WHERE state = 'queued' AND delay_ms <= 0) q
         )
         SELECT id FROM released, (SELECT count(*) FROM woken) w",
    )
    .bind(&ids)
    .bind(&tokens)
    .bind(&delays_ms)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// Extends held claims with the database clock, in one statement per worker per
/// heartbeat interval whatever the number of jobs; returns the claims (id and token) that
/// are gone (reaped, cancelled, finished by someone else, deleted).
///
/// Rows locked by another statement (most often this worker's own completer, saving the
/// job's outcome right now) are skipped rather than waited on: a heartbeat must never
/// queue behind a slow commit, or it would itself go stale. A skipped claim still counts
/// as held when the statement's snapshot shows it running under our token; the next
/// heartbeat extends it or finds it gone. The time written is `clock_timestamp()`, taken
/// when the row is written: a heartbeat that had to wait for a table lock records the end
/// of the wait, not its start. The claims gone are found by one primary-key probe per
/// claim (`LIMIT 1` keeps the lookup from being flattened into a join, which the planner
/// may run as a scan of the whole table).
pub async fn jobs_heartbeat_many(
    db: impl PgExecutor<'_>,
    ids: &[i64],
    tokens: &[Uuid],
) -> sqlx::Result<Vec<(i64, Uuid)>> {
    sqlx::query_as(
        "WITH held AS (
             SELECT j.id FROM unnest($1::bigint[], $2::uuid[]) AS c(id, token),
             LATERAL (SELECT id FROM skiplock.jobs j
                      WHERE j.id = c.id AND j.claim_token = c.token
                      FOR UPDATE SKIP LOCKED) j
         ), beat AS (
             UPDATE skiplock.jobs j SET heartbeat_at = clock_timestamp()
             WHERE j.id = ANY(ARRAY(SELECT id FROM held))
         )
         SELECT c.id, c.token FROM unnest($1::bigint[], $2::uuid[]) AS c(id, token)
         LEFT JOIN LATERAL (SELECT true AS holds FROM skiplock.jobs j
                            WHERE j.id = c.id AND j.claim_token = c.token
                            LIMIT 1) h ON true
         WHERE h.holds IS NULL",
    )
    .bind(ids)
    .bind(tokens)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// The last resort for a claim whose outcome cannot be saved as it is (the statement
/// fails for this row alone, for a reason no retry will change): the job goes `dead` with
/// `message` as its last error, its claim ends, and its lane and dependants move on as for
/// any dead job. Matches the claim token like every claim-holder write. Returns the jobs
/// whose claim was still valid.
pub async fn jobs_abandon_many(
    db: impl PgExecutor<'_>,
    ids: &[i64],
    tokens: &[Uuid],
    message: &str,
) -> sqlx::Result<Vec<SavedJob>> {
    let claims = ClaimList::sorted(ids, tokens);
    let message = sanitize_message(message);
    sqlx::query_as(
        "WITH held AS (
             SELECT j.id FROM unnest($1::bigint[], $2::uuid[]) AS c(id, token),
             LATERAL (SELECT id FROM skiplock.jobs j
                      WHERE j.id = c.id AND j.claim_token = c.token
                      FOR UPDATE) j
         )
         UPDATE skiplock.jobs j
         SET state = 'dead', finished_at = now(), claim_token = NULL, heartbeat_at = NULL,
             last_error = $3,
             errors = CASE WHEN jsonb_typeof(j.errors) = 'array'
                 THEN skiplock.append_error(j.errors, j.attempt, $3)
                 ELSE jsonb_build_array(jsonb_build_object('attempt', j.attempt, 'at', now(), 'message', $3))
                 END
         WHERE j.id = ANY(ARRAY(SELECT id FROM held))
         RETURNING j.id, j.state::text AS state,
                   EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = j.id)
                       AS has_dependants,
                   j.ordering_key",
    )
    .bind(&claims.ids)
    .bind(&claims.tokens)
    .bind(&message)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// What a running job's handler may record on its row ([`jobs_set_note`]).
#[derive(Debug, Clone, Copy)]
pub enum RunningNote {
    /// `progress`: how far it got.
    Progress,
    /// `output`: what it produced.
    Output,
}

/// Records a running job's progress or output, if `token` still holds its claim.
pub async fn jobs_set_note(
    db: impl PgExecutor<'_>,
    id: i64,
    token: Uuid,
    note: RunningNote,
    value: &Value,
) -> sqlx::Result<bool> {
    let statement = match note {
        RunningNote::Progress => {
            "UPDATE skiplock.jobs SET progress = $3
             WHERE id = $1 AND claim_token = $2 AND state = 'running'"
        }
        RunningNote::Output => {
            "UPDATE skiplock.jobs SET output = $3
             WHERE id = $1 AND claim_token = $2 AND state = 'running'"
        }
    };
    let updated = sqlx::query(statement)
        .bind(id)
        .bind(token)
        .bind(Json(value))
        .execute(db)
        .await?;
    Ok(updated.rows_affected() == 1)
}

/// One job by id.
pub async fn jobs_get(db: impl PgExecutor<'_>, id: JobId) -> sqlx::Result<Option<JobRow>> {
    sqlx::query_as("SELECT * FROM skiplock.jobs WHERE id = $1")
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
