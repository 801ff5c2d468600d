//! Writing outcomes: a statement retried through transient errors, and a batch the
//! database refuses split in halves down to single claims, so that one row that cannot be
//! saved never holds back the others (used by the completer and the producer's release of
//! lost claims).

use std::future::Future;
use std::ops::Range;

use uuid::Uuid;

use super::claims::ClaimKey;
use super::{Shared, schema_mismatch, stop_if_schema_outgrown};
use crate::db::jobs::jobs_release_many;
use crate::error::{describe_sqlx, is_transient_sqlx};
use crate::pacing::db_retry_delay;

/// Attempts at one write once the worker is shutting down hard.
const WRITE_ATTEMPTS_AFTER_HARD_STOP: u32 = 3;

/// What [`write_split`] made of a list of claims.
pub(super) struct SplitWrite<T> {
    /// The claims written to.
    pub(super) claims: Vec<ClaimKey>,
    /// What the statements returned for them (the claims still valid).
    pub(super) saved: Vec<T>,
    /// Claims whose row could not be saved as asked, each with the reason.
    pub(super) unsaved: Vec<(ClaimKey, String)>,
    /// Claims left held because the database stayed unreachable during a hard stop.
    pub(super) abandoned_to_reaper: Vec<ClaimKey>,
    /// Whether an attempt lost its reply before a later one succeeded: claims the later
    /// one did not find may have been saved by it.
    pub(super) reply_lost: bool,
}

/// Writes outcomes for the claims `ids`/`tokens` with `statement(range)`, retrying
/// transient errors. When a statement fails for good on several claims, each half is
/// written on its own, down to single claims, so one row that cannot be saved never holds
/// back the others (a unique key, a byte Postgres refuses, a trigger of the user's).
pub(super) async fn write_split<T, F, Fut>(
    shared: &Shared,
    what: &str,
    ids: &[i64],
    tokens: &[Uuid],
    mut statement: F,
) -> SplitWrite<T>
where
    F: FnMut(Range<usize>) -> Fut,
    Fut: Future<Output = sqlx::Result<Vec<T>>>,
{
    let mut result = SplitWrite {
        claims: ids.iter().copied().zip(tokens.iter().copied()).collect(),
        saved: Vec::new(),
        unsaved: Vec::new(),
        abandoned_to_reaper: Vec::new(),
        reply_lost: false,
    };
    let mut parts: Vec<Range<usize>> = Vec::with_capacity(1);
    parts.push(0..ids.len());
    while let Some(range) = parts.pop() {
        match write(shared, what, || statement(range.clone())).await {
            Ok((rows, reply_lost)) => {
                result.saved.extend(rows);
                result.reply_lost |= reply_lost;
            }
            Err(WriteError::GaveUp) => {
                result
                    .abandoned_to_reaper
                    .extend(range.map(|i| (ids[i], tokens[i])));
            }
            Err(WriteError::Refused(e)) if range.len() > 1 => {
                tracing::warn!(
                    statement = what,
                    jobs = range.len(),
                    error = %describe_sqlx(&e),
                    "saving outcomes failed for the batch; saving its halves separately"
                );
                let middle = range.start + range.len() / 2;
                parts.push(middle..range.end);
                parts.push(range.start..middle);
            }
            Err(WriteError::Refused(e)) => {
                let i = range.start;
                result
                    .unsaved
                    .push(((ids[i], tokens[i]), describe_sqlx(&e)));
            }
        }
    }
    result
}

/// Why a write did not happen.
pub(super) enum WriteError {
    /// The database refused it for a reason a retry will not change.
    Refused(sqlx::Error),
    /// Transient errors went on during a hard stop; the worker is leaving.
    GaveUp,
}

/// Runs a write, retrying transient errors (until the worker shuts down hard). Also says
/// whether an attempt before the one that succeeded lost its reply: that one may have
/// committed, and saved some of the outcomes the successful one found already settled.
pub(super) async fn write<T, F, Fut>(
    shared: &Shared,
    what: &str,
    mut statement: F,
) -> Result<(T, bool), WriteError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = sqlx::Result<T>>,
{
    let mut failures = 0u32;
    let mut reply_lost = false;
    loop {
        match statement().await {
            Ok(value) => return Ok((value, reply_lost)),
            // A database migrated past this build: its jobs stay held until the worker
            // exits, then a worker of the new version reaps and runs them. Marking them
            // dead for a statement only this old build gets wrong would lose them.
            Err(e) if schema_mismatch(&e) && stop_if_schema_outgrown(shared).await => {
                tracing::error!(statement = what, error = %e, "cannot save job outcomes with the upgraded schema; leaving the jobs to the reaper");
                return Err(WriteError::GaveUp);
            }
            Err(e) if !is_transient_sqlx(&e) => return Err(WriteError::Refused(e)),
            Err(e) => {
                failures += 1;
                reply_lost |= super::reply_lost(&e);
                if shared.hard.is_cancelled() && failures >= WRITE_ATTEMPTS_AFTER_HARD_STOP {
                    tracing::error!(statement = what, error = %e, "could not save job outcomes before the hard stop");
                    return Err(WriteError::GaveUp);
                }
                if crate::read_only::worth_a_warning(&e) {
                    tracing::warn!(statement = what, error = %e, failures, "saving job outcomes failed; retrying");
                }
                tokio::time::sleep(db_retry_delay(failures)).await;
            }
        }
    }
}

/// Gives the claims `ids`/`tokens` back to the queue at once (no delay, the attempt not
/// counted), split as [`write_split`] splits: the jobs of a claim whose reply was lost, or
/// handed on to a worker that no longer claims. Returns the released ids and the claims
/// that refused it (each with the reason), which the reaper takes back.
pub(super) async fn release_at_once(
    shared: &Shared,
    what: &str,
    ids: &[i64],
    tokens: &[Uuid],
) -> SplitWrite<i64> {
    let delays_ms = vec![0; ids.len()];
    write_split(shared, what, ids, tokens, |range| {
        jobs_release_many(
            &shared.pool,
            &ids[range.clone()],
            &tokens[range.clone()],
            &delays_ms[range],
        )
    })
    .await
}
