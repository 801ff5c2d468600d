//! The worker's metrics, recorded through the [`metrics`] facade: nothing is exported
//! unless the application installs a recorder (`skiplock work --metrics-addr` installs a
//! Prometheus one). Every series is named here; docs/metrics.md lists them with their
//! type, labels and unit.
//!
//! It sits beside `worker` and `maintenance` rather than inside either, because both
//! record into it; users read the names at `skiplock::worker::metrics`.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use metrics::{Counter, Histogram};

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

/// Every `outcome` label of [`JOBS`].
const OUTCOMES: [&str; 8] = [
    "succeeded",
    "retried",
    "dead",
    "cancelled",
    "released",
    "snoozed",
    "lost",
    "unknown",
];

/// The per-job series of one queue, by kind: their handles are registered with the
/// recorder once per kind and outcome, so a job's end costs a read lock and two atomic
/// updates instead of building three owned labels and looking the series up (measured in
/// docs/benchmarks.md, "What the event hook and the metrics cost"). A recorder installed
/// after a kind's first job in this worker is not seen by that kind's series: install it
/// before starting the worker, as `skiplock work --metrics-addr` does.
pub(crate) struct JobSeries {
    queue: String,
    by_kind: RwLock<HashMap<String, Arc<KindSeries>>>,
}

/// One kind's series in one queue.
struct KindSeries {
    /// [`JOBS`] by outcome (index in [`OUTCOMES`]), registered on first use so that only
    /// outcomes that happened are exported.
    jobs: [OnceLock<Counter>; OUTCOMES.len()],
    duration: Histogram,
}

impl JobSeries {
    pub(crate) fn new(queue: &str) -> Self {
        JobSeries {
            queue: queue.to_owned(),
            by_kind: RwLock::default(),
        }
    }

    fn kind(&self, kind: &str) -> Arc<KindSeries> {
        let found = self
            .by_kind
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(kind)
            .cloned();
        found.unwrap_or_else(|| {
            let series = Arc::new(KindSeries {
                jobs: Default::default(),
                duration: metrics::histogram!(JOB_DURATION, "kind" => kind.to_owned()),
            });
            self.by_kind
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .entry(kind.to_owned())
                .or_insert(series)
                .clone()
        })
    }

    fn count(&self, kind: &str, series: &KindSeries, outcome: &'static str) {
        let index = OUTCOMES
            .iter()
            .position(|known| *known == outcome)
            .unwrap_or(OUTCOMES.len() - 1);
        series.jobs[index]
            .get_or_init(|| {
                metrics::counter!(JOBS, "kind" => kind.to_owned(), "queue" => self.queue.clone(), "outcome" => OUTCOMES[index])
            })
            .increment(1);
    }

    /// A job's attempt ended with `outcome` after running `took`.
    pub(crate) fn job_ended(&self, kind: &str, outcome: &'static str, took: Duration) {
        let series = self.kind(kind);
        self.count(kind, &series, outcome);
        series.duration.record(took.as_secs_f64());
    }

    /// A claimed job was given back before it started (a shutdown, or a wait for a slot
    /// longer than the stale timeout).
    pub(crate) fn job_released_unstarted(&self, kind: &str) {
        let series = self.kind(kind);
        self.count(kind, &series, "released");
    }
}

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
