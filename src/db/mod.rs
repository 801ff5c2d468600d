//! Every SQL statement skiplock runs, one function per statement, named table first and
//! verb second. Nothing outside this module builds SQL, and every value is bound, never
//! formatted into the statement text.
//!
//! Functions take `impl PgExecutor` so they run on a pool, a connection or inside the
//! caller's transaction alike.

/// The finished jobs past their state's retention that the pruner deletes one statement
/// at a time (`skiplock.internal_prune_cutoff`: rows under a retention shorter than a day,
/// and the rows of `jobs_done_default`; the rest go with their day, dropped whole).
/// `$1`, `$2`, `$3`: the retention of succeeded, cancelled and dead jobs, milliseconds.
/// Each cutoff is computed once per statement (a subquery), so the partitions a row cannot
/// be in are left out when the statement starts.
macro_rules! finished_past_retention {
    () => {
        "((state = 'succeeded'
               AND finished_at <= (SELECT skiplock.internal_prune_cutoff('succeeded', $1)))
           OR (state = 'cancelled'
               AND finished_at <= (SELECT skiplock.internal_prune_cutoff('cancelled', $2)))
           OR (state = 'dead'
               AND finished_at <= (SELECT skiplock.internal_prune_cutoff('dead', $3))))"
    };
}

pub mod admin;
pub mod cron;
#[cfg(any(feature = "cli", feature = "internals"))]
pub mod dashboard;
#[cfg(feature = "cli")]
pub mod demo;
pub mod enqueue;
pub mod history;
pub mod jobs;
pub mod json;
pub mod maintenance;
pub mod migrations;
pub mod partitions;
pub mod queues;
#[cfg(feature = "testbed")]
pub mod testbed;
pub mod timestamp;
