//! The worker runtime: claims jobs in batches, runs them concurrently, saves outcomes.
//!
//! A running worker is a small pipeline of tasks, one per file:
//!
//! ```text
//!  listener ──wake──▶ producer ──claimed jobs──▶ executor (≤ concurrency) ──outcomes──▶ completer
//!  (LISTEN/NOTIFY)    (claim_batch, local buffer)  (runs handlers, no SQL)               (batched writes)
//!                      heartbeat: extends every held claim, one statement per interval
//!                      reaper, pruner (crate::maintenance): stale claims and old rows
//! ```
//!
//! Shutdown has two phases. [`ShutdownHandle::shutdown`] stops claiming, releases jobs
//! still in the local buffer at once, and lets running jobs finish for
//! [`WorkerConfig::shutdown_grace`]; after that, or on [`ShutdownHandle::shutdown_now`],
//! the remaining handlers are stopped and their jobs released. Released jobs go back to
//! `queued` without losing an attempt.

mod claim_cursor;
mod claims;
mod completer;
pub mod events;
mod executor;
mod handler;
mod heartbeat;
mod listener;
pub mod metrics;
mod producer;
mod slots;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::DbPool;
use crate::cron::CronSchedule;
use crate::error::{Error, Result};
use crate::job::{DataMap, Job, QUEUE_DEFAULT};
use crate::maintenance::{self, Maintenance};

pub use crate::maintenance::pruner::Retention;

use claims::HeldClaims;
use handler::{Handler, TypedHandler};

/// Jobs run at once by a worker unless configured.
pub const CONCURRENCY_DEFAULT: usize = 32;
/// Fallback poll interval when no notification arrives (LISTEN/NOTIFY does the fast path).
pub const POLL_INTERVAL_DEFAULT: Duration = Duration::from_secs(1);
/// How often a worker extends its claims.
pub const HEARTBEAT_INTERVAL_DEFAULT: Duration = Duration::from_secs(2);
/// A running job whose heartbeat is older than this is taken back by the reaper.
pub const STALE_AFTER_DEFAULT: Duration = Duration::from_secs(30);
/// How often each worker's reaper looks for stale claims.
pub const REAP_INTERVAL_DEFAULT: Duration = Duration::from_secs(5);
/// How long a graceful shutdown waits for running jobs before releasing them.
pub const SHUTDOWN_GRACE_DEFAULT: Duration = Duration::from_secs(30);
/// How often each worker's pruner deletes expired finished jobs.
pub const PRUNE_INTERVAL_DEFAULT: Duration = Duration::from_secs(30);
/// How often each worker looks for due cron slots.
pub const CRON_INTERVAL_DEFAULT: Duration = Duration::from_secs(1);
/// Most claims or outcomes written by one statement.
pub const BATCH_MAX_DEFAULT: usize = 2000;
/// Largest queue weight ([`WorkerBuilder::queue_weight`]).
pub const QUEUE_WEIGHT_MAX: u32 = 1000;
/// Most claimed jobs a worker keeps ready in its local buffer when its jobs are short
/// (the buffer grows toward this from `prefetch`, see [`PREFETCH_HORIZON`]).
pub const PREFETCH_MAX_DEFAULT: usize = 2000;
/// How much work the local buffer holds, at the rate jobs are starting: the buffer grows
/// until it covers this much (between `prefetch` and `prefetch_max` jobs), so short jobs
/// are claimed in large batches and a claimed job waits about this long at most before
/// it starts. 100 ms covers a claim round trip many times over.
pub const PREFETCH_HORIZON: Duration = Duration::from_millis(100);

/// Everything a worker can be told. Build it with [`Worker::builder`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WorkerConfig {
    /// Identity written to `claimed_by`: host, pid and a random suffix by default.
    pub worker_id: String,
    /// Queues to claim from. Default `["default"]`. They share `concurrency` slots by
    /// weight, except those named in `queue_concurrency`.
    pub queues: Vec<String>,
    /// Jobs run at once (1 or more) across the shared queues.
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
    /// round trip, at least. Default: equal to `concurrency`.
    pub prefetch: usize,
    /// Claimed jobs kept ready at most. Between `prefetch` and this, the buffer follows
    /// the start rate to hold [`PREFETCH_HORIZON`] of work: short jobs get large claim
    /// batches, long jobs are not hoarded. Default [`PREFETCH_MAX_DEFAULT`] (never below
    /// `prefetch`); [`WorkerBuilder::prefetch`] sets both to one fixed size.
    pub prefetch_max: usize,
    /// Fallback poll interval.
    pub poll_interval: Duration,
    /// How often claims are extended.
    pub heartbeat_interval: Duration,
    /// Heartbeat age after which the reaper takes a claim back; must exceed twice the
    /// heartbeat interval.
    pub stale_after: Duration,
    /// How often the reaper runs.
    pub reap_interval: Duration,
    /// How long a graceful shutdown waits for running jobs.
    pub shutdown_grace: Duration,
    /// Exit once no job of this worker's queues and kinds is runnable or running.
    pub exit_when_idle: bool,
    /// How long finished jobs are kept.
    pub retention: Retention,
    /// How often the pruner runs; `None` disables it in this worker.
    pub prune_interval: Option<Duration>,
    /// Most claims or outcomes per statement.
    pub batch_max: usize,
    /// Cron schedules this worker writes to the database when it starts.
    pub cron_schedules: Vec<CronSchedule>,
    /// How often the cron scheduler runs; `None` disables it in this worker.
    pub cron_interval: Option<Duration>,
    /// The pool goes through PgBouncer in transaction-pooling mode: every statement runs
    /// in a transaction of its own, unnamed (see [`DbPool::pgbouncer`]), and LISTEN needs
    /// [`WorkerBuilder::listen_options`] or is replaced by polling every `poll_interval`.
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

/// Builds a [`Worker`].
pub struct WorkerBuilder {
    pool: PgPool,
    listen_options: Option<PgConnectOptions>,
    config: WorkerConfig,
    prefetch_set: bool,
    handlers: HashMap<String, Arc<dyn Handler>>,
    duplicate: Option<String>,
    data: DataMap,
}

impl WorkerBuilder {
    /// Shares `value` with every handler, which reads it with
    /// [`JobContext::data`](crate::JobContext::data). One value per type; a second call
    /// with the same type replaces the first.
    pub fn data<T: Send + Sync + 'static>(mut self, value: T) -> Self {
        self.data
            .insert(std::any::TypeId::of::<T>(), Arc::new(value));
        self
    }

    /// Registers a job type; the worker claims jobs of its kind.
    pub fn register<J: Job>(mut self) -> Self {
        if self
            .handlers
            .insert(J::KIND.to_owned(), Arc::new(TypedHandler::<J>::new()))
            .is_some()
        {
            self.duplicate = Some(J::KIND.to_owned());
        }
        self
    }

    /// Sets the queues to claim from (replaces the default `["default"]`).
    pub fn queues<I, Q>(mut self, queues: I) -> Self
    where
        I: IntoIterator<Item = Q>,
        Q: Into<String>,
    {
        self.config.queues = queues.into_iter().map(Into::into).collect();
        self
    }

    /// Sets how many jobs run at once (and the prefetch, unless set explicitly).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.config.concurrency = concurrency;
        if !self.prefetch_set {
            self.config.prefetch = concurrency;
        }
        self
    }

    /// Sets the weight of `queue` among the queues that share `concurrency` (default 1;
    /// 1 to [`QUEUE_WEIGHT_MAX`]): while they all have work, their running jobs follow
    /// their weights. See [`WorkerConfig::queue_weights`].
    pub fn queue_weight(mut self, queue: impl Into<String>, weight: u32) -> Self {
        self.config.queue_weights.insert(queue.into(), weight);
        self
    }

    /// Gives `queue` its own `concurrency` slots (and claims from it).
    pub fn queue_concurrency(mut self, queue: impl Into<String>, concurrency: usize) -> Self {
        self.config
            .queue_concurrency
            .insert(queue.into(), concurrency);
        self
    }

    /// Fixes how many claimed jobs wait in the local buffer (instead of a size that
    /// follows the start rate between `concurrency` and [`PREFETCH_MAX_DEFAULT`]).
    pub fn prefetch(mut self, prefetch: usize) -> Self {
        self.config.prefetch = prefetch;
        self.config.prefetch_max = prefetch;
        self.prefetch_set = true;
        self
    }

    /// Sets the most claimed jobs the adaptive local buffer may hold (see
    /// [`WorkerConfig::prefetch_max`]).
    pub fn prefetch_max(mut self, prefetch_max: usize) -> Self {
        self.config.prefetch_max = prefetch_max;
        self
    }

    /// Sets the most claims or outcomes one statement carries (default
    /// [`BATCH_MAX_DEFAULT`]); smaller batches mean shorter statements and locks, larger
    /// ones fewer commits.
    pub fn batch_max(mut self, batch_max: usize) -> Self {
        self.config.batch_max = batch_max;
        self
    }

    /// Sets the worker identity written to `claimed_by`.
    pub fn worker_id(mut self, id: impl Into<String>) -> Self {
        self.config.worker_id = id.into();
        self
    }

    /// Makes the worker claim job `id` alone, now, and stop once it is settled.
    #[cfg(feature = "testing")]
    pub(crate) fn only_job(mut self, id: i64) -> Self {
        self.config.only_job = Some(id);
        self
    }

    /// The pool the worker will use.
    #[cfg(feature = "testing")]
    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether a handler for `kind` is registered.
    #[cfg(feature = "testing")]
    pub(crate) fn handles(&self, kind: &str) -> bool {
        self.handlers.contains_key(kind)
    }

    /// Sets the fallback poll interval.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.config.poll_interval = interval;
        self
    }

    /// Says that the pool's connections go through PgBouncer in transaction-pooling mode
    /// (the usual mode of managed Postgres poolers). Each statement of the worker then
    /// runs in a transaction of its own and unnamed, so PgBouncer keeps it on one server
    /// connection (two more round trips per statement). LISTEN cannot work through
    /// transaction pooling: give the worker a direct connection for it with
    /// [`listen_options`](Self::listen_options), or it polls every `poll_interval`.
    /// The heartbeat's own session goes through PgBouncer too, with the same wrapping.
    pub fn pgbouncer(mut self, pgbouncer: bool) -> Self {
        self.config.pgbouncer = pgbouncer;
        self
    }

    /// Where the worker's LISTEN session connects (wake-ups for new jobs and
    /// cancellations), instead of the pool's connect options: a direct connection to
    /// Postgres when the pool goes through PgBouncer in transaction mode.
    pub fn listen_options(mut self, options: PgConnectOptions) -> Self {
        self.listen_options = Some(options);
        self
    }

    /// Sets the heartbeat interval and the stale timeout.
    pub fn heartbeat(mut self, interval: Duration, stale_after: Duration) -> Self {
        self.config.heartbeat_interval = interval;
        self.config.stale_after = stale_after;
        self
    }

    /// Sets how often the reaper runs.
    pub fn reap_interval(mut self, interval: Duration) -> Self {
        self.config.reap_interval = interval;
        self
    }

    /// Sets how long a graceful shutdown waits for running jobs.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.config.shutdown_grace = grace;
        self
    }

    /// Makes [`Worker::run`] return once no job of its queues and kinds is runnable or
    /// running.
    pub fn exit_when_idle(mut self, exit: bool) -> Self {
        self.config.exit_when_idle = exit;
        self
    }

    /// Sets the retention of finished jobs.
    pub fn retention(mut self, retention: Retention) -> Self {
        self.config.retention = retention;
        self
    }

    /// Sets how often the pruner runs; `None` disables it in this worker.
    pub fn prune_interval(mut self, interval: Option<Duration>) -> Self {
        self.config.prune_interval = interval;
        self
    }

    /// Defines a cron schedule: written to the database (created or updated) when the
    /// worker starts.
    pub fn cron(mut self, schedule: CronSchedule) -> Self {
        self.config.cron_schedules.push(schedule);
        self
    }

    /// Sets how often the cron scheduler runs; `None` disables it in this worker.
    pub fn cron_interval(mut self, interval: Option<Duration>) -> Self {
        self.config.cron_interval = interval;
        self
    }

    /// Checks the configuration and builds the worker.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when no kind is registered, a kind is registered twice, or a
    /// setting is out of range; [`Error::InvalidCron`] for a malformed cron schedule.
    pub fn build(self) -> Result<Worker> {
        let config = self.config;
        let fail = |why: String| Err(Error::Config(why));
        if let Some(kind) = self.duplicate {
            return fail(format!("kind `{kind}` is registered twice"));
        }
        if self.handlers.is_empty() {
            return fail("no job kind is registered; call `register::<YourJob>()`".into());
        }
        if config.queues.is_empty() || config.queues.iter().any(String::is_empty) {
            return fail("queue names must be non-empty and at least one queue is needed".into());
        }
        if config.queue_concurrency.keys().any(String::is_empty)
            || config.queue_concurrency.values().any(|&n| n == 0)
        {
            return fail(
                "per-queue concurrency needs a queue name and a limit of at least 1".into(),
            );
        }
        for (queue, &weight) in &config.queue_weights {
            if !(1..=QUEUE_WEIGHT_MAX).contains(&weight) {
                return fail(format!(
                    "the weight of queue `{queue}` is {weight}; weights go from 1 to {QUEUE_WEIGHT_MAX}"
                ));
            }
            if config.queue_concurrency.contains_key(queue) {
                return fail(format!(
                    "queue `{queue}` has slots of its own (queue_concurrency); a weight applies only to queues sharing `concurrency`"
                ));
            }
            if !config.queues.contains(queue) {
                return fail(format!(
                    "queue `{queue}` has a weight but this worker does not claim from it; add it to the queues"
                ));
            }
        }
        if config.concurrency == 0
            || config.prefetch == 0
            || config.prefetch_max == 0
            || config.batch_max == 0
        {
            return fail("concurrency, prefetch and batch size must be at least 1".into());
        }
        if config.heartbeat_interval.is_zero() || config.poll_interval.is_zero() {
            return fail("heartbeat and poll intervals must be positive".into());
        }
        if config.stale_after <= config.heartbeat_interval * 2 {
            return fail(format!(
                "stale_after ({:?}) must exceed twice the heartbeat interval ({:?}), or live jobs get reaped",
                config.stale_after, config.heartbeat_interval
            ));
        }
        for schedule in &config.cron_schedules {
            schedule.validate()?;
        }
        let mut kinds: Vec<String> = self.handlers.keys().cloned().collect();
        kinds.sort();
        let mut config = config;
        let shared_queues: Vec<String> = config
            .queues
            .iter()
            .filter(|q| !config.queue_concurrency.contains_key(*q))
            .cloned()
            .collect();
        let mut groups = Vec::new();
        // One producer and buffer per queue; the shared queues draw their slots from one
        // pool by weight. Each buffer's floor is the queue's part of `prefetch`.
        let weights: Vec<u32> = shared_queues
            .iter()
            .map(|q| config.queue_weights.get(q).copied().unwrap_or(1))
            .collect();
        let total_weight: u64 = weights.iter().map(|&w| u64::from(w)).sum();
        let shared_slots = Arc::new(slots::SlotPool::new(config.concurrency, weights.clone()));
        for (member, (queue, &weight)) in shared_queues.iter().zip(&weights).enumerate() {
            let prefetch = (config.prefetch as u64 * u64::from(weight)).div_ceil(total_weight);
            groups.push(QueueGroup::new(
                queue.clone(),
                (prefetch as usize).max(1),
                config.prefetch_max,
                shared_slots.clone(),
                member,
            ));
        }
        for (queue, &limit) in &config.queue_concurrency {
            let prefetch_max = if self.prefetch_set {
                limit
            } else {
                config.prefetch_max
            };
            groups.push(QueueGroup::new(
                queue.clone(),
                limit,
                prefetch_max,
                Arc::new(slots::SlotPool::new(limit, vec![1])),
                0,
            ));
            if !config.queues.contains(queue) {
                config.queues.push(queue.clone());
            }
        }
        let shared_slots_total = if shared_queues.is_empty() {
            0
        } else {
            config.concurrency
        };
        let slots_total = shared_slots_total + config.queue_concurrency.values().sum::<usize>();
        Ok(Worker {
            shared: Arc::new(Shared {
                pool: if config.pgbouncer {
                    DbPool::pgbouncer(self.pool)
                } else {
                    DbPool::direct(self.pool)
                },
                listen_options: self.listen_options,
                config,
                kinds,
                handlers: self.handlers,
                data: Arc::new(self.data),
                claims: HeldClaims::default(),
                held_limit: 2
                    * (slots_total + groups.iter().map(|g| g.prefetch_max).sum::<usize>()),
                groups,
                graceful: CancellationToken::new(),
                hard: CancellationToken::new(),
                counters: Counters::default(),
                schema_outgrown: std::sync::OnceLock::new(),
                events: tokio::sync::broadcast::Sender::new(events::EVENTS_BUFFERED),
                only_job_claimed: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }
}

/// State shared by a worker's tasks.
pub(crate) struct Shared {
    /// The pool, in its mode (direct or through PgBouncer).
    pub(crate) pool: DbPool,
    /// Where the LISTEN session connects; `None`: the pool's connect options, or no
    /// LISTEN at all behind PgBouncer.
    pub(crate) listen_options: Option<PgConnectOptions>,
    pub(crate) config: WorkerConfig,
    /// Registered kinds, sorted; bound as the claim's kind filter.
    pub(crate) kinds: Vec<String>,
    pub(crate) handlers: HashMap<String, Arc<dyn Handler>>,
    /// Values shared with handlers through [`JobContext::data`](crate::JobContext::data).
    pub(crate) data: Arc<DataMap>,
    pub(crate) claims: HeldClaims,
    /// One producer and executor pool per group.
    pub(crate) groups: Vec<QueueGroup>,
    /// Most claims the worker holds at once: twice its slots plus buffers.
    pub(crate) held_limit: usize,
    /// Phase one of shutdown: stop claiming.
    pub(crate) graceful: CancellationToken,
    /// Phase two: stop handlers and release their jobs now.
    pub(crate) hard: CancellationToken,
    pub(crate) counters: Counters,
    /// Set when the database was migrated past this build while the worker ran: the
    /// schema version found. The worker stops claiming and [`Worker::run`] returns
    /// [`Error::SchemaTooNew`] once its running jobs are settled.
    pub(crate) schema_outgrown: std::sync::OnceLock<i32>,
    /// Job events for subscribers ([`Worker::subscribe`]).
    pub(crate) events: tokio::sync::broadcast::Sender<events::JobEvent>,
    /// Set once the claim of [`WorkerConfig::only_job`] was sent.
    pub(crate) only_job_claimed: std::sync::atomic::AtomicBool,
}

/// One queue: its producer's claims, its buffer, and where its job slots come from.
pub(crate) struct QueueGroup {
    /// The queue, as the claim's one-element filter.
    pub(crate) queues: Vec<String>,
    /// The pool its slots come from (shared with the other queues sharing `concurrency`),
    /// and its member number there.
    pub(crate) slots: Arc<slots::SlotPool>,
    pub(crate) member: usize,
    /// Smallest and largest local buffer (see [`PREFETCH_HORIZON`]).
    pub(crate) prefetch: usize,
    pub(crate) prefetch_max: usize,
    /// Jobs the dispatcher has started: the producer sizes the buffer by their rate.
    pub(crate) started: AtomicU64,
    /// Wakes this group's producer: a notification arrived or the listener reconnected.
    pub(crate) wake: Notify,
    /// Signalled by the completer after it settles a batch: claims were freed.
    pub(crate) settled: Notify,
    /// Claims of this group whose reply was lost, until their jobs are released.
    pub(crate) lost_claims: producer::LostClaims,
    /// The queue's per-job metrics.
    pub(crate) series: crate::metrics::JobSeries,
}

impl QueueGroup {
    fn new(
        queue: String,
        prefetch: usize,
        prefetch_max: usize,
        slots: Arc<slots::SlotPool>,
        member: usize,
    ) -> Self {
        Self {
            series: crate::metrics::JobSeries::new(&queue),
            queues: vec![queue],
            slots,
            member,
            prefetch,
            prefetch_max: prefetch_max.max(prefetch),
            started: AtomicU64::new(0),
            wake: Notify::new(),
            settled: Notify::new(),
            lost_claims: producer::LostClaims::default(),
        }
    }
}

impl Shared {
    /// Wakes the producer of every group.
    pub(crate) fn wake_all(&self) {
        for group in &self.groups {
            group.wake.notify_one();
        }
    }

    /// Wakes the producer that claims from `queue`, if any.
    pub(crate) fn wake_queue(&self, queue: &str) {
        if let Some(group) = self
            .groups
            .iter()
            .find(|g| g.queues.iter().any(|q| q == queue))
        {
            group.wake.notify_one();
        }
    }
}

/// Outcome counters of one [`Worker::run`].
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) claimed: AtomicU64,
    pub(crate) succeeded: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) snoozed: AtomicU64,
    pub(crate) lost: AtomicU64,
}

/// What one [`Worker::run`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerSummary {
    /// Jobs claimed.
    pub claimed: u64,
    /// Jobs completed successfully.
    pub succeeded: u64,
    /// Failed attempts recorded (retried, dead or cancelled by their handler).
    pub failed: u64,
    /// Jobs given back without counting the attempt (shutdown).
    pub released: u64,
    /// Jobs whose handler snoozed them ([`crate::JobError::snooze`]).
    pub snoozed: u64,
    /// Outcomes discarded because the claim was no longer ours (reaped or cancelled).
    pub lost: u64,
}

/// Stops a running worker from anywhere. Cheap to clone.
#[derive(Clone)]
pub struct ShutdownHandle {
    graceful: CancellationToken,
    hard: CancellationToken,
}

impl ShutdownHandle {
    /// Phase one: stop claiming, release buffered jobs, let running jobs finish within
    /// the grace period.
    pub fn shutdown(&self) {
        self.graceful.cancel();
    }

    /// Phase two: stop every handler now and release its job.
    pub fn shutdown_now(&self) {
        self.graceful.cancel();
        self.hard.cancel();
    }

    /// Whether a shutdown was requested.
    pub fn is_shutting_down(&self) -> bool {
        self.graceful.is_cancelled()
    }
}

/// A configured worker. [`run`](Worker::run) it on a tokio runtime.
///
/// # Examples
///
/// ```no_run
/// # use skiplock::{Job, JobContext, JobError, Worker};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct Welcome { user_id: i64 }
/// # impl Job for Welcome { const KIND: &'static str = "welcome";
/// #   async fn run(self, _: JobContext) -> Result<(), JobError> { Ok(()) } }
/// # async fn example(pool: sqlx::PgPool) -> skiplock::Result<()> {
/// let worker = Worker::builder(pool).register::<Welcome>().concurrency(64).build()?;
/// let stop = worker.shutdown_handle();
/// tokio::spawn(async move {
///     tokio::signal::ctrl_c().await.ok();
///     stop.shutdown();
/// });
/// worker.run().await?;
/// # Ok(()) }
/// ```
pub struct Worker {
    shared: Arc<Shared>,
}

impl Worker {
    /// Starts building a worker on `pool`. The worker runs at most a handful of statements
    /// at once (two claims, two completion batches, maintenance), so a few connections
    /// suffice; handlers that use `ctx.pool()` need more. Two sessions are opened outside
    /// the pool with its connect options: the LISTEN connection (with
    /// [`WorkerBuilder::listen_options`] when given; none behind PgBouncer without them)
    /// and the heartbeat's (the heartbeat runs on a thread of its own so that busy or
    /// blocked handlers cannot delay it; it closes its connection after 30 s without
    /// claims).
    pub fn builder(pool: PgPool) -> WorkerBuilder {
        WorkerBuilder {
            pool,
            listen_options: None,
            config: WorkerConfig::default(),
            prefetch_set: false,
            handlers: HashMap::new(),
            duplicate: None,
            data: DataMap::new(),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &WorkerConfig {
        &self.shared.config
    }

    /// A subscription to what becomes of every job this worker runs, once each outcome is
    /// saved (see [`events`]). Subscribe before [`run`](Worker::run); events of jobs that
    /// ended before a subscription are not replayed.
    pub fn subscribe(&self) -> events::JobEvents {
        events::JobEvents::new(self.shared.events.subscribe())
    }

    /// A handle that stops this worker.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            graceful: self.shared.graceful.clone(),
            hard: self.shared.hard.clone(),
        }
    }

    /// Runs until shut down (or idle, with `exit_when_idle`), then returns what it did.
    /// Transient database errors are logged and retried, never returned.
    ///
    /// # Errors
    ///
    /// [`Error::SchemaOutdated`] or [`Error::SchemaTooNew`] when the database schema does
    /// not match this build, [`Error::Database`] if the database cannot be reached at start.
    pub async fn run(self) -> Result<WorkerSummary> {
        let shared = self.shared;
        crate::check_schema(shared.pool.pool()).await?;
        let config = &shared.config;
        tracing::info!(
            worker_id = %config.worker_id,
            queues = ?config.queues,
            kinds = ?shared.kinds,
            concurrency = config.concurrency,
            queue_weights = ?config.queue_weights,
            queue_concurrency = ?config.queue_concurrency,
            prefetch = config.prefetch,
            prefetch_max = config.prefetch_max,
            poll_interval_ms = config.poll_interval.as_millis() as u64,
            heartbeat_ms = config.heartbeat_interval.as_millis() as u64,
            stale_after_ms = config.stale_after.as_millis() as u64,
            prune_interval_ms = config.prune_interval.map(|i| i.as_millis() as u64),
            retain_succeeded_s = config.retention.succeeded.as_secs(),
            retain_cancelled_s = config.retention.cancelled.as_secs(),
            retain_dead_s = config.retention.dead.as_secs(),
            pgbouncer = config.pgbouncer,
            "worker started"
        );

        // Background tasks that live until every claim is settled.
        let background = CancellationToken::new();
        let tasks = TaskTracker::new();
        tasks.spawn(listener::listen(shared.clone(), background.clone()));
        tasks.spawn(heartbeat::beat(shared.clone(), background.clone()));
        maintenance::spawn(
            Maintenance {
                pool: shared.pool.clone(),
                reap_interval: config.reap_interval,
                stale_after: config.stale_after,
                batch_max: config.batch_max,
                retention: config.retention,
                stop: background.clone(),
            },
            &tasks,
            config.cron_schedules.clone(),
            config.cron_interval,
            config.prune_interval,
        );

        let (outcome_tx, outcome_rx) = mpsc::unbounded_channel();
        let completer = tokio::spawn(completer::complete(shared.clone(), outcome_rx));
        let executors = TaskTracker::new();
        let mut pipelines = Vec::new();
        for group in 0..shared.groups.len() {
            let (buffer_tx, buffer_rx) = mpsc::channel(shared.groups[group].prefetch_max);
            let space = Arc::new(Notify::new());
            pipelines.push(tokio::spawn(producer::produce(
                shared.clone(),
                group,
                buffer_tx,
                space.clone(),
            )));
            pipelines.push(tokio::spawn(executor::dispatch(
                shared.clone(),
                group,
                buffer_rx,
                space,
                outcome_tx.clone(),
                executors.clone(),
            )));
        }
        drop(outcome_tx);

        shared.graceful.cancelled().await;
        tracing::info!(worker_id = %config.worker_id, "shutting down: no new claims");
        for task in pipelines {
            join_logged("producer or dispatcher", task).await;
        }
        executors.close();
        tokio::select! {
            () = executors.wait() => {}
            () = tokio::time::sleep(config.shutdown_grace) => {
                tracing::warn!(
                    grace = ?config.shutdown_grace,
                    "grace period over: stopping running jobs and releasing them"
                );
                shared.hard.cancel();
            }
            () = shared.hard.cancelled() => {}
        }
        if shared.hard.is_cancelled() {
            shared.claims.stop_all();
        }
        executors.wait().await;
        // Every outcome sender is gone now; the completer drains and returns.
        join_logged("completer", completer).await;
        background.cancel();
        tasks.close();
        tasks.wait().await;

        let left = shared.claims.len();
        if left > 0 {
            tracing::warn!(
                jobs = left,
                "could not save the outcome of some jobs; the reaper will return them to the queue"
            );
        }
        let counters = &shared.counters;
        let summary = WorkerSummary {
            claimed: counters.claimed.load(Ordering::Relaxed),
            succeeded: counters.succeeded.load(Ordering::Relaxed),
            failed: counters.failed.load(Ordering::Relaxed),
            released: counters.released.load(Ordering::Relaxed),
            snoozed: counters.snoozed.load(Ordering::Relaxed),
            lost: counters.lost.load(Ordering::Relaxed),
        };
        tracing::info!(worker_id = %config.worker_id, ?summary, "worker stopped");
        if let Some(&found) = shared.schema_outgrown.get() {
            return Err(Error::SchemaTooNew {
                found,
                supported: crate::db::migrations::SCHEMA_VERSION_LATEST,
            });
        }
        Ok(summary)
    }
}

/// Whether a failed statement may have committed: the connection failed before its reply
/// came (a server restart, a failover, a network cut). An error the server sent means it
/// rolled back. (A claim whose reply came but could not be decoded is left to the reaper,
/// which spends an attempt, so a job whose row cannot be read does not loop forever.)
pub(crate) fn reply_lost(error: &sqlx::Error) -> bool {
    matches!(
        error,
        sqlx::Error::Io(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::WorkerCrashed
    )
}

/// Whether a failed statement says the schema changed under the worker: an object it uses
/// is gone or changed (class 42: an undefined function, column or table, a mismatched
/// type) or a cached plan's result type changed (0A000).
pub(crate) fn schema_mismatch(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|code| code.starts_with("42") || code == "0A000"),
        _ => false,
    }
}

/// After a statement failed on a changed schema: if the database was migrated past what
/// this build supports (`skiplock migrate` of a newer version while this worker ran), stops
/// claiming (the graceful shutdown: running jobs finish, buffered ones are released) and
/// returns true. Migrations that stay compatible never get here: the worker's statements
/// go on working.
pub(crate) async fn stop_if_schema_outgrown(shared: &Shared) -> bool {
    let Ok(found) = crate::db::migrations::schema_version(shared.pool.pool()).await else {
        return false;
    };
    let supported = crate::db::migrations::SCHEMA_VERSION_LATEST;
    if found <= supported {
        return false;
    }
    if shared.schema_outgrown.set(found).is_ok() {
        tracing::error!(
            found,
            supported,
            "the database schema was upgraded past this skiplock while it ran; the worker \
             stops claiming, lets its running jobs finish and exits: upgrade skiplock"
        );
    }
    shared.graceful.cancel();
    true
}

async fn join_logged(name: &str, handle: tokio::task::JoinHandle<()>) {
    if let Err(e) = handle.await {
        tracing::error!(task = name, error = %e, "worker task ended abnormally");
    }
}
