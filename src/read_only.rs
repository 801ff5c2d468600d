//! A server that refuses writes: a hot standby (a worker whose URL or failover endpoint
//! reaches a replica, or a primary demoted mid-failover), or a database its owner made
//! read-only (`default_transaction_read_only`). Every write fails with SQLSTATE 25006
//! (`read_only_sql_transaction`; LISTEN fails with it too during recovery), which the
//! runtime retries as transient.
//!
//! Without this, each task of the worker logged every refused attempt (the claim loop, the
//! listener, the reaper, the dependency sweep, cron, the pruner: four warnings a second),
//! and none said what was wrong. Now the first refusal is logged once, as one line that
//! says what the server is and what to do; the tasks stay quiet while it lasts; and the
//! first claim the server accepts again says so.
//!
//! The notice is per process: a refusal is a fact about the server, and the workers of
//! one process nearly always share it. [`worth_a_warning`] is what every retrying task
//! asks before it logs a failed statement.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{describe_sqlx, is_row_moved};

/// Whether a refusal was reported and no write succeeded since.
static REPORTED: AtomicBool = AtomicBool::new(false);

/// Whether `error` is the server refusing a write because it is read-only.
pub(crate) fn is_read_only(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("25006"))
}

/// For a task about to log a failed statement: `true` when `error` is the server refusing
/// a write because it is read-only, in which case the one line about it has been logged
/// (by this call or an earlier one) and the caller logs nothing.
pub(crate) fn quiet(error: &sqlx::Error) -> bool {
    if !is_read_only(error) {
        return false;
    }
    if !REPORTED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            error = %describe_sqlx(error),
            "the database server is read-only (a hot standby, or default_transaction_read_only \
             is on): claiming nothing and waiting until it accepts writes (a promotion, or the \
             failover endpoint moving to the new primary); if it never will, point the worker \
             at the primary's URL"
        );
    }
    true
}

/// After a write succeeded: if a read-only server was reported, says that it accepts
/// writes again.
pub(crate) fn writes_accepted() {
    if REPORTED.swap(false, Ordering::Relaxed) {
        tracing::info!("the database server accepts writes again; claiming");
    }
}

/// Whether a transient error of a statement that will be retried is worth a warning: not a
/// job moved between the partitions meanwhile ([`is_row_moved`]), nor a read-only server
/// already reported ([`crate::read_only::quiet`]).
pub(crate) fn worth_a_warning(error: &sqlx::Error) -> bool {
    if is_row_moved(error) {
        tracing::debug!(error = %describe_sqlx(error), "a job moved between the partitions meanwhile; retrying");
        return false;
    }
    !quiet(error)
}
