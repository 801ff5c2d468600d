//! [`WorkerBuilder`]: collects a worker's handlers and settings, checks them, and lays
//! out its queue groups and slot pools.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use tokio_util::sync::CancellationToken;

use crate::DbPool;
use crate::cron::CronSchedule;
use crate::error::{Error, Result};
use crate::job::{DataMap, Job};

use super::claims::HeldClaims;
use super::due_timers::DueTimers;
use super::handler::{Handler, TypedHandler};
use super::{
    Counters, QUEUE_WEIGHT_MAX, QueueGroup, Retention, Shared, Worker, WorkerConfig, events, slots,
};

impl Worker {
    /// Starts building a worker on `pool`. The worker runs at most a handful of statements
    /// at once (two claims, two completion batches, maintenance; one of each while other
    /// processes claim from its queues), so a few connections suffice; handlers that use
    /// `ctx.pool()` need more. Two sessions are opened outside
    /// the pool with its connect options: the LISTEN connection (with
    /// [`WorkerBuilder::listen_options`] when given; none behind PgBouncer without them)
    /// and the heartbeat's (the heartbeat runs on a thread of its own so that busy or
    /// blocked handlers cannot delay it; it closes its connection after 30 s without
    /// claims).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use skiplock::{Job, JobContext, JobError, Worker};
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct SendWelcome { user_id: i64 }
    /// # impl Job for SendWelcome { const KIND: &'static str = "send_welcome";
    /// #   async fn run(self, _: JobContext) -> Result<(), JobError> { Ok(()) } }
    /// # struct Mailer;
    /// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let worker = Worker::builder(pool)
    ///     .register::<SendWelcome>()
    ///     .queues(["default", "mail"])
    ///     .concurrency(16)
    ///     .queue_weight("mail", 3) // while both have work, "mail" gets 3 slots in 4
    ///     .data(Mailer) // handlers read it with `ctx.data::<Mailer>()`
    ///     .shutdown_grace(Duration::from_secs(10))
    ///     .build()?;
    /// let stop = worker.shutdown_handle();
    /// tokio::spawn(async move {
    ///     tokio::signal::ctrl_c().await.ok();
    ///     stop.shutdown(); // stop claiming, let running jobs finish, release the rest
    /// });
    /// let summary = worker.run().await?;
    /// println!("{} jobs succeeded", summary.succeeded);
    /// # Ok(()) }
    /// ```
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

    /// Registers a job type; the worker claims jobs of its kind ([`Job::KIND`]) and no
    /// others.
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

    /// Sets the queues to claim from (replaces the default `["default"]`). They share the
    /// `concurrency` slots by weight.
    pub fn queues<I, Q>(mut self, queues: I) -> Self
    where
        I: IntoIterator<Item = Q>,
        Q: Into<String>,
    {
        self.config.queues = queues.into_iter().map(Into::into).collect();
        self
    }

    /// Sets how many jobs run at once across the shared queues (default 32), and the
    /// prefetch, unless set explicitly.
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

    /// Gives `queue` its own `concurrency` slots (and claims from it): a busy shared queue
    /// cannot starve it, and it never runs more than that. Default: none.
    pub fn queue_concurrency(mut self, queue: impl Into<String>, concurrency: usize) -> Self {
        self.config
            .queue_concurrency
            .insert(queue.into(), concurrency);
        self
    }

    /// Fixes how many claimed jobs wait in the local buffer (instead of the default, a
    /// size that follows the start rate between `concurrency` and 4,000 jobs).
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

    /// Sets the most claims or outcomes one statement carries (default 2,000); smaller
    /// batches mean shorter statements and locks, larger ones fewer commits.
    pub fn batch_max(mut self, batch_max: usize) -> Self {
        self.config.batch_max = batch_max;
        self
    }

    /// Sets the worker identity written to `claimed_by` (default `host:pid:suffix`).
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

    /// Sets how often the worker claims without a wake-up (default 1 s): the fallback for
    /// missed notifications, and the pace of new work behind PgBouncer without LISTEN.
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
    /// Default false; a worker that finds a pooler in front anyway switches to this mode
    /// and logs a warning. The application's own calls on that pool (an enqueue, a
    /// handler's statements on [`JobContext::pool`](crate::JobContext::pool)) go through
    /// [`PgBouncer`](crate::PgBouncer).
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

    /// Sets how often claims are extended (default 2 s) and the heartbeat age after which
    /// a reaper takes a claim back (default 30 s; it must exceed twice the interval). A
    /// claimed job that waits in this worker for a slot for longer than `stale_after` is
    /// given back to the queue, its attempt not counted.
    pub fn heartbeat(mut self, interval: Duration, stale_after: Duration) -> Self {
        self.config.heartbeat_interval = interval;
        self.config.stale_after = stale_after;
        self
    }

    /// Sets how often this worker's reaper looks for stale claims (default 5 s).
    pub fn reap_interval(mut self, interval: Duration) -> Self {
        self.config.reap_interval = interval;
        self
    }

    /// Sets how long a graceful shutdown waits for running jobs (default 30 s) before it
    /// stops their handlers and releases the jobs without spending their attempt.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.config.shutdown_grace = grace;
        self
    }

    /// Makes [`Worker::run`] return once no job of its queues and kinds is runnable,
    /// running, or held back by a per-key limit (default false: run until shut down). A
    /// paused queue's jobs are not waited for; the exit's log line says what is left
    /// behind (a paused queue's jobs, retries in their backoff, jobs scheduled later).
    pub fn exit_when_idle(mut self, exit: bool) -> Self {
        self.config.exit_when_idle = exit;
        self
    }

    /// Sets how long finished jobs are kept (default 1 day for succeeded and cancelled,
    /// 14 days for dead).
    pub fn retention(mut self, retention: Retention) -> Self {
        self.config.retention = retention;
        self
    }

    /// Sets how often this worker's pruner runs (default 30 s); `None` disables it in this
    /// worker.
    pub fn prune_interval(mut self, interval: Option<Duration>) -> Self {
        self.config.prune_interval = interval;
        self
    }

    /// Defines a cron schedule: written to the database (created, or updated keeping its
    /// progress) when the worker starts, before it claims anything.
    pub fn cron(mut self, schedule: CronSchedule) -> Self {
        self.config.cron_schedules.push(schedule);
        self
    }

    /// Sets how often this worker looks for due cron slots (default 1 s); `None` disables
    /// the cron scheduler in this worker.
    pub fn cron_interval(mut self, interval: Option<Duration>) -> Self {
        self.config.cron_interval = interval;
        self
    }

    /// Checks the configuration and builds the worker.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when no kind is registered, a kind is registered twice, a queue
    /// name is empty or over [`QUEUE_NAME_MAX_BYTES`](crate::QUEUE_NAME_MAX_BYTES), or a
    /// setting is out of range; [`Error::InvalidCron`] for a cron schedule with an empty
    /// name, kind or queue or no attempts (its expression and time zone are checked by the
    /// database when [`Worker::run`] writes it, and a malformed one ends `run` with this
    /// error).
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
        // No job can be in such a queue: the table refuses its name.
        if let Some(why) = config
            .queues
            .iter()
            .find_map(|q| crate::enqueue::queue_name_over_limit(q))
        {
            return fail(format!("a queue name {why}"));
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
        let due_timers = DueTimers::new(groups.len(), std::time::Instant::now());
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
                listening: std::sync::atomic::AtomicBool::new(false),
                due_timers,
            }),
        })
    }
}
