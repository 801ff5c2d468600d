//! Outcome statements: complete, fail, release, abandon, heartbeat and the running job's
//! notes. Each matches the job id and its `claim_token` (see the module docs of `db::jobs`
//! for how they find and lock their rows).

use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::{FromRow, PgExecutor, Row};
use uuid::Uuid;

use super::ClaimedJob;
use crate::state::JobState;

/// A job whose outcome was saved, and whether other jobs wait on it.
///
/// Read from a row by position, in the order of `saved_job_columns!` (a completion
/// returns hundreds of rows; by name, each column was a lookup of its own).
#[derive(Debug, Clone)]
pub struct SavedJob {
    /// Job id.
    pub id: i64,
    /// State it moved to. Read as text: sqlx 0.9 loses an unnamed statement when it looks
    /// up a custom type's OID on a fresh connection (transact-rs/sqlx#4305), and the
    /// statements returning it are unnamed (see the module's doc).
    pub state: JobState,
    /// Whether `skiplock.job_dependencies` names it as a parent.
    pub has_dependants: bool,
    /// Its ordering lane, if any: the next job of the lane may be promoted now.
    pub ordering_key: Option<String>,
}

impl<'r> FromRow<'r, PgRow> for SavedJob {
    fn from_row(row: &'r PgRow) -> sqlx::Result<Self> {
        let state: &str = row.try_get(1)?;
        Ok(Self {
            id: row.try_get(0)?,
            state: state
                .parse()
                .map_err(|e: String| sqlx::Error::ColumnDecode {
                    index: "1 (state)".into(),
                    source: e.into(),
                })?,
            has_dependants: row.try_get(2)?,
            ordering_key: row.try_get(3)?,
        })
    }
}

/// The columns of a [`SavedJob`], read from the row `j`: every statement that returns one
/// lists them, so they change together (`skiplock.internal_complete_claims` lists them in SQL).
macro_rules! saved_job_columns {
    () => {
        "j.id, j.state::text AS state,
         EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = j.id)
             AS has_dependants,
         j.ordering_key"
    };
}

/// Marks held jobs `succeeded`; returns those whose claim was still valid.
///
/// One update joined to the claim list, in `skiplock.internal_complete_claims`
/// (`migrations/functions/07_claim.sql`), whose planner settings hold it to a nested
/// loop driven by the list, so that it locks rows in id order as the other statements
/// here do; it returns the columns of `saved_job_columns!`. Before, a lateral lock per
/// claim fixed that order and the update looked each row up again: 5 % more Postgres CPU
/// per job in a drain (docs/benchmarks.md).
pub async fn jobs_complete_many(
    db: impl PgExecutor<'_>,
    ids: &[i64],
    tokens: &[Uuid],
) -> sqlx::Result<Vec<SavedJob>> {
    let claims = ClaimList::sorted(ids, tokens);
    sqlx::query_as(
        "SELECT id, state, has_dependants, ordering_key
         FROM skiplock.internal_complete_claims($1::bigint[], $2::uuid[])",
    )
    .bind(&claims.ids)
    .bind(&claims.tokens)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// Where a completion hands a key's freed slot on: the worker that takes the key's next
/// job, the kinds it runs, and the claim token the jobs it takes get (chosen by the
/// worker, so that it can find them if the reply is lost).
#[derive(Debug, Clone, Copy)]
pub struct Handoff<'a> {
    /// The claimant, stored in `claimed_by`.
    pub worker: &'a str,
    /// Kinds the worker runs.
    pub kinds: &'a [String],
    /// The claim token of every job handed on by the statement.
    pub token: Uuid,
}

/// What a completion with a [`Handoff`] did: the jobs it completed, and the jobs of
/// key-limited queues it handed on to the worker (claimed, `running`).
#[derive(Debug, Default)]
pub struct Completion {
    /// The completed jobs, as [`jobs_complete_many`] returns them.
    pub saved: Vec<SavedJob>,
    /// The jobs handed on, as a claim returns them.
    pub handed: Vec<ClaimedJob>,
}

/// [`jobs_complete_many`], then each key's freed slot in a queue whose one limit is
/// `key_max_running` handed on to `hand.worker`, in the same transaction
/// (`skiplock.internal_complete_handing_on`): the key's next due job, claimed, when no
/// other key's due job is ahead of it in claim order. For batches with a job whose key has
/// a running limit ([`ClaimedJob::key_limited`]): the statement costs more than the plain
/// completion.
pub async fn jobs_complete_handing_on(
    db: impl PgExecutor<'_>,
    ids: &[i64],
    tokens: &[Uuid],
    hand: &Handoff<'_>,
) -> sqlx::Result<Completion> {
    let claims = ClaimList::sorted(ids, tokens);
    let rows = sqlx::query(
        "SELECT id, state, has_dependants, ordering_key, queue, kind, args, attempt,
                max_attempts, claim_token, priority, scheduled_at_us, traceparent, tracestate
         FROM skiplock.internal_complete_handing_on($1::bigint[], $2::uuid[], $3, $4, $5)",
    )
    .bind(&claims.ids)
    .bind(&claims.tokens)
    .bind(hand.worker)
    .bind(hand.kinds)
    .bind(hand.token)
    .persistent(false)
    .fetch_all(db)
    .await?;
    let mut completion = Completion::default();
    for row in &rows {
        if row.try_get::<&str, _>(1)? == "running" {
            let mut job = ClaimedJob::from_row_after(row, 4)?;
            job.key_limited = true;
            completion.handed.push(job);
        } else {
            completion.saved.push(SavedJob::from_row(row)?);
        }
    }
    Ok(completion)
}

/// Of `ids`, the jobs `succeeded` under `worker`'s name, as [`jobs_complete_many`] returns
/// them: for a completion write whose reply was lost, the jobs it did complete.
pub async fn jobs_completed_by(
    db: impl PgExecutor<'_>,
    ids: &[i64],
    worker: &str,
) -> sqlx::Result<Vec<SavedJob>> {
    sqlx::query_as(concat!(
        "SELECT ",
        saved_job_columns!(),
        "
         FROM skiplock.jobs j
         WHERE j.id = ANY($1) AND j.state = 'succeeded' AND j.claimed_by = $2"
    ))
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
    sqlx::query_as(concat!(
        "SELECT ",
        saved_job_columns!(),
        "
         FROM unnest($1::bigint[], $2::text[]) AS f(id, message)
         JOIN skiplock.jobs j ON j.id = f.id
         WHERE j.claimed_by = $3 AND j.claim_token IS NULL
           AND j.state IN ('queued', 'dead', 'cancelled')
           AND j.errors -> -1 -> 'message' = to_jsonb(f.message)
           AND j.errors -> -1 -> 'attempt' = to_jsonb(j.attempt)"
    ))
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
/// by it (`skiplock.internal_fold_into_key_holder`): the job ends `cancelled`.
pub async fn jobs_fail_many(
    db: impl PgExecutor<'_>,
    batch: &FailBatch,
) -> sqlx::Result<Vec<SavedJob>> {
    let batch = batch.sorted();
    sqlx::query_as(
        "SELECT id, state, has_dependants, ordering_key
         FROM skiplock.internal_fail_claims($1, $2, $3, $4, $5)",
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
    sqlx::query_scalar("SELECT id FROM skiplock.internal_release_claims($1, $2, $3)")
        .bind(&ids)
        .bind(&tokens)
        .bind(&delays_ms)
        .persistent(false)
        .fetch_all(db)
        .await
}

/// Extends held claims with the database clock, in one statement per worker per
/// heartbeat interval whatever the number of jobs; returns the claims (id and token) that
/// are gone (reaped, cancelled, finished by someone else, deleted): their handlers must be
/// stopped. A claim whose row is locked right now (by this worker's own completer, most
/// often) is skipped, not waited on, and counts as held.
///
/// `claims_in_flight` are the tokens of claim statements the worker sent and has not yet
/// read the reply of: the jobs holding one are extended too. Usually empty, which costs
/// nothing. How and why: `skiplock.internal_heartbeat_claims` in migrations/functions/08_outcomes.sql.
pub async fn jobs_heartbeat_many(
    db: impl PgExecutor<'_>,
    ids: &[i64],
    tokens: &[Uuid],
    claims_in_flight: &[Uuid],
) -> sqlx::Result<Vec<(i64, Uuid)>> {
    sqlx::query_as("SELECT id, claim_token FROM skiplock.internal_heartbeat_claims($1, $2, $3)")
        .bind(ids)
        .bind(tokens)
        .bind(claims_in_flight)
        .persistent(false)
        .fetch_all(db)
        .await
}

/// Of the jobs whose claims a heartbeat found gone, those cancelled (`skiplock.cancel_job`
/// or an operator's UPDATE): a worker whose heartbeat saw the claim gone before the
/// cancel's notification arrived reports them cancelled, not lost. By id, once per beat
/// that lost claims (seldom).
pub async fn jobs_cancelled_among(db: impl PgExecutor<'_>, ids: &[i64]) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar(
        "SELECT j.id FROM unnest($1::bigint[]) AS i(id)
         CROSS JOIN LATERAL (SELECT j.id, j.state FROM skiplock.jobs j
                             WHERE j.id = i.id LIMIT 1) j
         WHERE j.state = 'cancelled'",
    )
    .bind(ids)
    .persistent(false)
    .fetch_all(db)
    .await
}

/// Marks held jobs `dead` with `message` as their last error: the last resort for claims
/// whose outcome cannot be saved as it is (`skiplock.internal_abandon_claims` in
/// migrations/functions/08_outcomes.sql says when and how). The caller moves the returned jobs' lanes
/// and dependants on, as for any dead job. Returns the jobs whose claim was still valid.
pub async fn jobs_abandon_many(
    db: impl PgExecutor<'_>,
    ids: &[i64],
    tokens: &[Uuid],
    message: &str,
) -> sqlx::Result<Vec<SavedJob>> {
    let claims = ClaimList::sorted(ids, tokens);
    sqlx::query_as(
        "SELECT id, state, has_dependants, ordering_key
         FROM skiplock.internal_abandon_claims($1, $2, $3)",
    )
    .bind(&claims.ids)
    .bind(&claims.tokens)
    .bind(sanitize_message(message))
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
        // The live states, not `state = 'running'`: that matches jobs_running_idx's
        // predicate and lets the planner walk every running job for this one (see
        // docs/architecture.md, "Live and finished jobs"); the token alone proves the
        // claim (jobs_claim_token_only_running).
        RunningNote::Progress => {
            "UPDATE skiplock.jobs SET progress = $3
             WHERE id = $1 AND claim_token = $2 AND state IN ('waiting', 'queued', 'running')"
        }
        RunningNote::Output => {
            "UPDATE skiplock.jobs SET output = $3
             WHERE id = $1 AND claim_token = $2 AND state IN ('waiting', 'queued', 'running')"
        }
    };
    let updated = sqlx::query(statement)
        .bind(id)
        .bind(token)
        .bind(Json(value))
        .execute(db)
        .await;
    match updated {
        Ok(updated) => Ok(updated.rows_affected() == 1),
        // The job left `running` while the write waited for its row (a cancel, the reaper
        // making it dead): moved to the finished partition, the claim lost. Nothing is
        // written, as for a stale token.
        Err(e) if crate::error::is_row_moved(&e) => Ok(false),
        Err(e) => Err(e),
    }
}
