//! The worker's metrics, recorded through the [`metrics`] facade: nothing is exported
//! unless the application installs a recorder (`skiplock work --metrics-addr` installs a
//! Prometheus one). Every series is named here; docs/metrics.md lists them with their
//! type, labels and unit.

use std::time::Duration;

/// Counter, labels `kind`, `queue`, `outcome`: jobs that ended an attempt in this worker.
/// `outcome` is `succeeded`, `retried` (failed, will run again), `dead`, `cancelled`
/// (by the handler, or by `cancel_job` while running), `released` (given back without
/// spending the attempt) or `lost` (reaped while it ran).
pub const JOBS: &str = "skiplock_jobs_total";
/// Histogram, label `kind`, seconds: how long handlers ran, whatever their outcome.
pub const JOB_DURATION: &str = "skiplock_job_duration_seconds";
/// Gauge: handlers running now.
pub const JOBS_RUNNING: &str = "skiplock_jobs_running";
/// Gauge: claimed jobs waiting in the local buffer for a free slot.
pub const CLAIMS_BUFFERED: &str = "skiplock_claims_buffered";
/// Histogram, seconds: claim statements, from sending to the reply (the wait for a pool
/// connection excluded).
pub const CLAIM_DURATION: &str = "skiplock_claim_duration_seconds";
/// Histogram, jobs: how many jobs each claim statement took.
pub const CLAIM_BATCH: &str = "skiplock_claim_batch_jobs";
/// Counter: claim statements that failed (retried).
pub const CLAIM_ERRORS: &str = "skiplock_claim_errors_total";
/// Counter: heartbeat statements that failed (retried at the next interval).
pub const HEARTBEAT_ERRORS: &str = "skiplock_heartbeat_errors_total";
/// Counter, label `task` (`reaper`, `pruner`, `dependencies`, `cron`): maintenance
/// passes that failed (retried at the next interval).
pub const MAINTENANCE_ERRORS: &str = "skiplock_maintenance_errors_total";
/// Counter: stale jobs this worker's reaper took back.
pub const JOBS_REAPED: &str = "skiplock_jobs_reaped_total";

/// A job's attempt ended with `outcome` after running `took`.
pub(crate) fn job_ended(kind: &str, queue: &str, outcome: &'static str, took: Duration) {
    metrics::counter!(JOBS, "kind" => kind.to_owned(), "queue" => queue.to_owned(), "outcome" => outcome)
        .increment(1);
    metrics::histogram!(JOB_DURATION, "kind" => kind.to_owned()).record(took.as_secs_f64());
}

/// A job of `kind`/`queue` ended without running (given back from the buffer).
pub(crate) fn job_released_unstarted(kind: &str, queue: &str) {
    metrics::counter!(JOBS, "kind" => kind.to_owned(), "queue" => queue.to_owned(), "outcome" => "released")
        .increment(1);
}

/// A handler started (`+1`) or returned (`-1`).
pub(crate) fn running(change: f64) {
    metrics::gauge!(JOBS_RUNNING).increment(change);
}

/// Jobs entered (`+n`) or left (`-n`) the local buffer.
pub(crate) fn buffered(change: f64) {
    metrics::gauge!(CLAIMS_BUFFERED).increment(change);
}

/// A claim statement took `took` and returned `jobs` jobs.
pub(crate) fn claimed(took: Duration, jobs: usize) {
    metrics::histogram!(CLAIM_DURATION).record(took.as_secs_f64());
    metrics::histogram!(CLAIM_BATCH).record(jobs as f64);
}

/// A claim statement failed.
pub(crate) fn claim_failed() {
    metrics::counter!(CLAIM_ERRORS).increment(1);
}

/// A heartbeat statement failed.
pub(crate) fn heartbeat_failed() {
    metrics::counter!(HEARTBEAT_ERRORS).increment(1);
}

/// A maintenance pass of `task` failed.
pub(crate) fn maintenance_failed(task: &'static str) {
    metrics::counter!(MAINTENANCE_ERRORS, "task" => task).increment(1);
}

/// The reaper took back `jobs` stale jobs.
pub(crate) fn reaped(jobs: usize) {
    if jobs > 0 {
        metrics::counter!(JOBS_REAPED).increment(jobs as u64);
    }
}
