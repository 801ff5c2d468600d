//! What a worker can be told: its settings ([`WorkerConfig`]) and their defaults. The
//! defaults are stated, with units, on the fields of [`WorkerConfig`] and the methods of
//! [`WorkerBuilder`]; `WorkerConfig::default()` holds them all.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::cron::CronSchedule;
use crate::job::QUEUE_DEFAULT;

use super::Retention;
#[cfg(doc)]
use super::{Worker, WorkerBuilder};

/// Jobs run at once by a worker unless configured.
pub(crate) const CONCURRENCY_DEFAULT: usize = 32;
/// Fallback poll interval when no notification arrives (LISTEN/NOTIFY does the fast path).
pub(crate) const POLL_INTERVAL_DEFAULT: Duration = Duration::from_secs(1);
/// How often a worker extends its claims.
pub(crate) const HEARTBEAT_INTERVAL_DEFAULT: Duration = Duration::from_secs(2);
/// A running job whose heartbeat is older than this is taken back by the reaper.
pub(crate) const STALE_AFTER_DEFAULT: Duration = Duration::from_secs(30);
/// How often each worker's reaper looks for stale claims.
pub(crate) const REAP_INTERVAL_DEFAULT: Duration = Duration::from_secs(5);
/// How long a graceful shutdown waits for running jobs before releasing them.
pub(crate) const SHUTDOWN_GRACE_DEFAULT: Duration = Duration::from_secs(30);
/// How often each worker's pruner deletes expired finished jobs.
pub(crate) const PRUNE_INTERVAL_DEFAULT: Duration = Duration::from_secs(30);
/// How often each worker looks for due cron slots.
pub(crate) const CRON_INTERVAL_DEFAULT: Duration = Duration::from_secs(1);
/// Most claims or outcomes written by one statement: bounds how long one statement holds
/// its rows locked and its snapshot open.
pub(crate) const BATCH_MAX_DEFAULT: usize = 2000;
/// Largest queue weight ([`WorkerBuilder::queue_weight`]).
pub const QUEUE_WEIGHT_MAX: u32 = 1000;
/// Most claimed jobs a worker keeps ready in its local buffer when its jobs are short
/// (the buffer grows toward this from `prefetch`, see [`PREFETCH_HORIZON`]): it binds
/// only above 40,000 jobs started per second. Each claim has a fixed cost (a plan, a
/// commit); with a cap of 2,000 a drain of short jobs ran 8 % slower (docs/benchmarks.md).
pub(crate) const PREFETCH_MAX_DEFAULT: usize = 4000;
/// How much work the local buffer holds, at the rate jobs are starting: the buffer grows
/// until it covers this much (between `prefetch` and `prefetch_max` jobs), so short jobs
/// are claimed in large batches and a claimed job waits about this long at most before
/// it starts. 100 ms covers a claim round trip many times over.
pub(crate) const PREFETCH_HORIZON: Duration = Duration::from_millis(100);

/// Everything a worker can be told. Build it with [`Worker::builder`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WorkerConfig {
    /// Identity written to `claimed_by`. Default `host:pid:suffix`, the suffix random.
    pub worker_id: String,
    /// Queues to claim from. Default `["default"]`. They share `concurrency` slots by
    /// weight, except those named in `queue_concurrency`.
    pub queues: Vec<String>,
    /// Jobs run at once (1 or more) across the shared queues. Default 32.
    pub concurrency: usize,
    /// Weights of the queues that share `concurrency` (1 when not named; 1 to 1,000). Each
    /// queue has its own claims and buffer; while several have work, a freed slot goes to
    /// the one running the fewest jobs per unit of weight, so their running jobs follow
    /// the weights; a queue with nothing to do lends its share to the others.
    pub queue_weights: BTreeMap<String, u32>,
    /// Queues with slots of their own: each gets its own producer, buffer and limit, so a
    /// busy queue cannot starve it and it cannot exceed its limit.
    pub queue_concurrency: BTreeMap<String, usize>,
    /// Claimed jobs kept ready in the local buffer so a freed slot never waits on a claim
    /// round trip, at least. Default: equal to `concurrency` (32).
    pub prefetch: usize,
    /// Claimed jobs kept ready at most. Between `prefetch` and this, the buffer follows
    /// the start rate to hold about 100 ms of work: short jobs get large claim batches,
    /// long jobs are not hoarded. Default 4,000 jobs (never below `prefetch`): it binds
    /// only above 40,000 jobs started per second. [`WorkerBuilder::prefetch`] sets both to
    /// one fixed size.
    pub prefetch_max: usize,
    /// How often the worker claims without having been woken: the fallback for missed or
    /// absent notifications (LISTEN/NOTIFY does the fast path). Default 1 s.
    pub poll_interval: Duration,
    /// How often the worker extends its claims (one statement for all of them). Default
    /// 2 s.
    pub heartbeat_interval: Duration,
    /// Heartbeat age after which any worker's reaper takes a claim back; must exceed twice
    /// the heartbeat interval. Default 30 s. Also how long a claimed job may wait in this
    /// worker for a slot: past that, without having started, it is given back to the
    /// queue (its attempt not counted) for any worker to claim.
    pub stale_after: Duration,
    /// How often this worker's reaper looks for stale claims. Default 5 s.
    pub reap_interval: Duration,
    /// How long a graceful shutdown waits for running jobs before it stops their handlers
    /// and releases the jobs. Default 30 s.
    pub shutdown_grace: Duration,
    /// Exit once no job of this worker's queues and kinds is runnable or running. Default
    /// false.
    pub exit_when_idle: bool,
    /// How long finished jobs are kept. Default 1 day (succeeded, cancelled), 14 days
    /// (dead).
    pub retention: Retention,
    /// How often this worker's pruner deletes expired finished jobs; `None` disables it in
    /// this worker. Default 30 s.
    pub prune_interval: Option<Duration>,
    /// Most claims or outcomes one statement carries: bounds how long one statement holds
    /// its rows locked and its snapshot open. Default 2,000.
    pub batch_max: usize,
    /// Cron schedules this worker writes to the database when it starts.
    pub cron_schedules: Vec<CronSchedule>,
    /// How often this worker looks for due cron slots; `None` disables the cron scheduler
    /// in this worker. Default 1 s.
    pub cron_interval: Option<Duration>,
    /// The pool goes through PgBouncer in transaction-pooling mode: every statement runs
    /// in a transaction of its own, unnamed (see [`WorkerBuilder::pgbouncer`]), and LISTEN
    /// needs [`WorkerBuilder::listen_options`] or is replaced by polling every
    /// `poll_interval`. Default false (a pooler found in front anyway switches it on, with
    /// a warning).
    pub pgbouncer: bool,
    /// Claim this job alone, once, then stop when it is settled (`skiplock::testing`).
    pub(crate) only_job: Option<i64>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            worker_id: default_worker_id(),
            queues: vec![QUEUE_DEFAULT.to_owned()],
            concurrency: CONCURRENCY_DEFAULT,
            queue_weights: BTreeMap::new(),
            queue_concurrency: BTreeMap::new(),
            prefetch: CONCURRENCY_DEFAULT,
            prefetch_max: PREFETCH_MAX_DEFAULT,
            poll_interval: POLL_INTERVAL_DEFAULT,
            heartbeat_interval: HEARTBEAT_INTERVAL_DEFAULT,
            stale_after: STALE_AFTER_DEFAULT,
            reap_interval: REAP_INTERVAL_DEFAULT,
            shutdown_grace: SHUTDOWN_GRACE_DEFAULT,
            exit_when_idle: false,
            retention: Retention::default(),
            prune_interval: Some(PRUNE_INTERVAL_DEFAULT),
            batch_max: BATCH_MAX_DEFAULT,
            cron_schedules: Vec::new(),
            cron_interval: Some(CRON_INTERVAL_DEFAULT),
            pgbouncer: false,
            only_job: None,
        }
    }
}

fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".to_owned());
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
    format!("{host}:{}:{suffix}", std::process::id())
}
