//! Maintenance services every worker runs alongside its jobs. They use `SKIP LOCKED` and
//! the database clock, so any number of workers can run them at once without a leader.
//!
//! They know nothing of the worker's pipeline: the worker builds a [`Maintenance`] context
//! (the pool, the settings they need, a stop token) and spawns them with [`spawn`]. The
//! completer settles what finished jobs set in motion with [`dependencies::MoveOn`]; nothing here calls back
//! into the worker.

pub(crate) mod cron;
pub(crate) mod dependencies;
pub(crate) mod pruner;
pub(crate) mod reaper;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::DbPool;

use pruner::Retention;

/// What the maintenance tasks need from the worker that runs them.
pub(crate) struct Maintenance {
    /// The worker's pool, in its mode (direct or through PgBouncer).
    pub(crate) pool: DbPool,
    /// How often the reaper and the dependency sweep run (each pass jittered ±20 %).
    pub(crate) reap_interval: Duration,
    /// Heartbeat age after which the reaper takes a claim back.
    pub(crate) stale_after: Duration,
    /// Most jobs one reaper statement takes back.
    pub(crate) batch_max: usize,
    /// How long finished jobs are kept.
    pub(crate) retention: Retention,
    /// Cancelled once the worker's claims are all settled: every task returns.
    pub(crate) stop: CancellationToken,
}

/// Spawns the reaper and the dependency sweep, and the cron scheduler and the pruner when
/// they have an interval (`None` disables them in this worker), on `tasks`.
pub(crate) fn spawn(
    context: Maintenance,
    tasks: &TaskTracker,
    cron_interval: Option<Duration>,
    prune_interval: Option<Duration>,
) {
    let context = Arc::new(context);
    tasks.spawn(reaper::reap(context.clone()));
    tasks.spawn(dependencies::sweep(context.clone()));
    if let Some(interval) = cron_interval {
        tasks.spawn(cron::schedule(context.clone(), interval));
    }
    if let Some(interval) = prune_interval {
        tasks.spawn(pruner::prune(context, interval));
    }
}
