//! Claim statements: a worker takes queued jobs (a batch, the next batch after a position,
//! or one job by id), and finds what a claim whose reply was lost took.

use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::{FromRow, PgExecutor, Row};
use uuid::Uuid;

/// A job as a claim hands it to a worker.
///
/// Read from a row by position, in the order of its fields (every claim statement lists
/// its columns so): a claim returns hundreds of rows, and looking each column up by name
/// cost about 3 % of a worker's CPU in a drain.
#[derive(Debug, Clone)]
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
    /// The W3C `traceparent` the job was enqueued with, as stored (unchecked).
    pub traceparent: Option<String>,
    /// The W3C `tracestate` that goes with it.
    pub tracestate: Option<String>,
    /// Whether its key has a running limit (`key_max_running`): its completion may hand
    /// the key's freed slot on ([`jobs_complete_handing_on`](super::jobs_complete_handing_on)).
    pub key_limited: bool,
}

impl<'r> FromRow<'r, PgRow> for ClaimedJob {
    fn from_row(row: &'r PgRow) -> sqlx::Result<Self> {
        Self::from_row_after(row, 1)
    }
}

impl ClaimedJob {
    /// Read from a row with the id first and the other columns from `rest`, in the
    /// claim's order (a completion's handed-on rows carry them after its own columns).
    pub(crate) fn from_row_after(row: &PgRow, rest: usize) -> sqlx::Result<Self> {
        Ok(Self {
            id: row.try_get(0)?,
            queue: row.try_get(rest)?,
            kind: row.try_get(rest + 1)?,
            args: Json(super::super::json::json_lossy(row, rest + 2)?.unwrap_or(Value::Null)),
            attempt: row.try_get(rest + 3)?,
            max_attempts: row.try_get(rest + 4)?,
            claim_token: row.try_get(rest + 5)?,
            priority: row.try_get(rest + 6)?,
            scheduled_at_us: row.try_get(rest + 7)?,
            traceparent: row.try_get(rest + 8)?,
            tracestate: row.try_get(rest + 9)?,
            // The worker's claim says; a statement without the column claims for no limit.
            key_limited: if row.len() > rest + 10 {
                row.try_get(rest + 10)?
            } else {
                false
            },
        })
    }
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
/// Claims up to `limit` runnable jobs of one queue and the given kinds, in claim order
/// (priority, then `scheduled_at`, then id), in one statement.
///
/// It calls `skiplock.internal_claim_batch` (`migrations/functions/07_claim.sql`, where the
/// statement and its reasons are): rows are picked
/// with `FOR UPDATE SKIP LOCKED`, so concurrent claimers never wait on each other and never
/// pick the same row, and each is stamped with its own fresh `claim_token`, the claimant and
/// the database's `clock_timestamp()` at the update as first heartbeat (not the
/// transaction's start: a claim that waited behind a lock would commit its jobs stale).
/// The function fixes the plan to an ordered walk of the claim index, so the claim stays
/// O(limit) even when the table's statistics are stale. A lane's queued job is the one
/// whose turn it is, taken like any other. A job cancelled under the claim (its row moved
/// to `jobs_done` after the statement's snapshot) fails the claim with SQLSTATE 40001
/// having claimed nothing: claim again, as the worker does (`skiplock.claim` does it
/// inside).
pub async fn jobs_claim_batch(
    db: impl PgExecutor<'_>,
    queue: &str,
    kinds: &[String],
    limit: i64,
    claimed_by: &str,
) -> sqlx::Result<Vec<ClaimedJob>> {
    jobs_claim_batch_after(db, queue, kinds, limit, claimed_by, None, None).await
}

/// [`jobs_claim_batch`] from a position: only jobs after `after` in claim order are
/// claimed (all of them with `None`, a full walk).
///
/// Claiming from the position of the caller's last claimed job steps over none of the
/// index entries its own earlier claims left behind, which Postgres cannot remove while an
/// older snapshot is held (docs/benchmarks.md, "Held snapshot and big backlog"). Jobs that land behind the
/// position (a higher priority, a job that waited and became queued) are claimed only by
/// a full walk, so a caller must still do one now and then; the worker's producer does
/// (`worker::claim_cursor`).
///
/// With `claim_with`, every job the claim takes holds it as its claim token, so a caller
/// whose reply was lost can find them with [`jobs_claimed_with`]; use a fresh
/// token for every claim, as it is the fence of each job's claim. Without it, each job
/// gets a random token of its own.
#[cfg(feature = "internals")]
pub async fn jobs_claim_batch_after(
    db: impl PgExecutor<'_>,
    queue: &str,
    kinds: &[String],
    limit: i64,
    claimed_by: &str,
    after: Option<ClaimPosition>,
    claim_with: Option<Uuid>,
) -> sqlx::Result<Vec<ClaimedJob>> {
    jobs_claim(
        db,
        &ClaimArgs {
            queue,
            kinds,
            limit,
            claimed_by,
            after,
            claim_with,
            mode: ClaimMode::default(),
        },
    )
    .await
}

/// How a claim treats the rows other claims are taking
/// (`skiplock.internal_claim_batch` in `migrations/functions/07_claim.sql`). The default is the
/// function's own: no filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ClaimMode {
    /// Pass over rows that transactions running when the claim began (or begun since)
    /// hold, before `FOR UPDATE SKIP LOCKED` takes them to the lock manager. A row whose
    /// `xmax` is a multixact can be passed over by mistake while that lasts, so a caller
    /// that sets it must also claim without it now and then.
    pub skip_in_flight: bool,
}

/// What one claim statement asks for: see [`jobs_claim_batch_after`] and [`ClaimMode`].
#[derive(Debug, Clone, Copy)]
pub struct ClaimArgs<'a> {
    /// The queue to claim from.
    pub queue: &'a str,
    /// Kinds the caller runs.
    pub kinds: &'a [String],
    /// At most this many jobs.
    pub limit: i64,
    /// The claimant, stored in `claimed_by`.
    pub claimed_by: &'a str,
    /// Only jobs after this key in claim order (`None`: a full walk).
    pub after: Option<ClaimPosition>,
    /// The claim token every job gets (`None`: a random one each).
    pub claim_with: Option<Uuid>,
    /// The in-flight filter.
    pub mode: ClaimMode,
}

/// One claim statement as `args` says ([`jobs_claim_batch_after`] with a [`ClaimMode`]).
pub async fn jobs_claim(
    db: impl PgExecutor<'_>,
    args: &ClaimArgs<'_>,
) -> sqlx::Result<Vec<ClaimedJob>> {
    // The position as the claim key's three numbers, one array (the function's `after`).
    let after = args
        .after
        .map(|p| [i64::from(p.priority), p.scheduled_at_us, p.id]);
    sqlx::query_as(
        "SELECT id, queue, kind, args, attempt, max_attempts, claim_token, priority,
                scheduled_at_us, traceparent, tracestate, key_limited
         FROM skiplock.internal_claim_batch($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(args.queue)
    .bind(args.kinds)
    .bind(args.limit)
    .bind(args.claimed_by)
    .bind(after.as_ref().map(|a| &a[..]))
    .bind(args.claim_with)
    .bind(args.mode.skip_in_flight)
    .fetch_all(db)
    .await
}

/// Of `queues`, those in which a claimer other than `claimed_by` holds running jobs
/// (`skiplock.internal_others_claiming`), in one statement.
pub async fn jobs_others_claiming(
    db: impl PgExecutor<'_>,
    queues: &[String],
    claimed_by: &str,
) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar("SELECT skiplock.internal_others_claiming($1, $2)")
        .bind(queues)
        .bind(claimed_by)
        .fetch_one(db)
        .await
}

/// Claims job `id` alone, now, whatever its `scheduled_at`, if it is `queued`, with the
/// token `claim_with`: for running one chosen job through a worker (`skiplock::testing`).
/// Lanes hold as for any claim (a queued lane job has its lane's turn,
/// `jobs_lane_turn_idx`); a pause and the queue's global and per-key limits do not: the
/// test names the job it runs.
pub async fn jobs_claim_one(
    db: impl PgExecutor<'_>,
    id: i64,
    claimed_by: &str,
    claim_with: Uuid,
) -> sqlx::Result<Vec<ClaimedJob>> {
    sqlx::query_as(
        "UPDATE skiplock.jobs
         SET state = 'running', claim_token = $3, claimed_by = $2, claimed_at = now(),
             heartbeat_at = clock_timestamp(), attempt = least(attempt, 2147483646) + 1
         WHERE id = $1 AND state = 'queued'
         RETURNING id, queue, kind, args, attempt, max_attempts, claim_token, priority,
                   CASE WHEN isfinite(scheduled_at)
                        THEN (extract(epoch FROM scheduled_at) * 1000000)::bigint
                        ELSE -9223372036854775808 END AS scheduled_at_us,
                   traceparent, tracestate",
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
/// and which the caller releases with [`jobs_release_many`](super::jobs_release_many).
/// Reads only `running` rows (`jobs_running_idx`).
pub async fn jobs_claimed_with(
    db: impl PgExecutor<'_>,
    claim_with: Uuid,
) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar("SELECT id FROM skiplock.jobs WHERE state = 'running' AND claim_token = $1")
        .bind(claim_with)
        .fetch_all(db)
        .await
}
