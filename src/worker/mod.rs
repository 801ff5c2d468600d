//! The worker runtime: claims jobs in batches, runs them concurrently, saves outcomes.
//!
//! A running worker is a small pipeline of tasks, one per file:
//!
//! ```text
//!  listener ──wake──▶ producer ──claimed jobs──▶ executor (≤ concurrency) ──outcomes──▶ completer
//!  (LISTEN/NOTIFY)    (claim, local buffer)        (runs handlers, no SQL)               (batched writes)
//!     └─due later──▶ due timers ──wake when due──▶ producer
//!                      heartbeat: extends every held claim, one statement per interval
//!                      sharing: are others claiming these queues? (claims and writes in flight)
//!                      reaper, pruner (crate::maintenance): stale claims and old rows
//! ```
//!
//! Shutdown has two phases. [`ShutdownHandle::shutdown`] stops claiming, releases jobs
//! still in the local buffer at once, and lets running jobs finish for
//! [`WorkerConfig::shutdown_grace`]; after that, or on [`ShutdownHandle::shutdown_now`],
//! the remaining handlers are stopped and their jobs released. Released jobs go back to
//! `queued` without losing an attempt.

mod builder;
mod claim_cursor;
mod claims;
mod completer;
mod config;
mod due_timers;
pub mod events;
mod executor;
mod handler;
mod heartbeat;
mod listener;
pub mod metrics;
mod producer;
mod sharing;
mod slots;
mod split_write;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::postgres::PgConnectOptions;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::DbPool;
use crate::error::{Error, Result, describe_sqlx, is_transient_sqlx};
use crate::job::DataMap;
use crate::maintenance::{self, Maintenance};

pub use crate::maintenance::pruner::Retention;
pub use builder::WorkerBuilder;
use config::PREFETCH_HORIZON;
pub use config::{QUEUE_WEIGHT_MAX, WorkerConfig};

use claims::HeldClaims;
use handler::Handler;

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
    /// Whether the listener is subscribed to the runnable-job notifications: the
    /// producers pace their full walks by it (see [`claim_cursor`]).
    pub(crate) listening: std::sync::atomic::AtomicBool,
    /// Keys of jobs that come due later, per group, until they do.
    pub(crate) due_timers: due_timers::DueTimers,
}

/// One queue: its producer's claims, its buffer, and where its job slots come from.
pub(crate) struct QueueGroup {
    /// The queue.
    pub(crate) queue: String,
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
    /// Where notifications said jobs became runnable since the producer last looked, the
    /// lowest; the producer hands it to its [`claim_cursor::ClaimCursor`].
    pub(crate) runnable: std::sync::Mutex<Option<claim_cursor::LookFrom>>,
    /// Signalled by the completer after it settles a batch: claims were freed.
    pub(crate) settled: Notify,
    /// Claims of this group whose reply was lost, until their jobs are released.
    pub(crate) lost_claims: producer::LostClaims,
    /// Where the completer puts the jobs a completion handed on to this worker (a key's
    /// freed slot taken again, see `skiplock.internal_free_slots`), for the dispatcher to
    /// start before the buffer's; `None` once the producer has stopped, and then the
    /// completer releases them.
    handed: std::sync::Mutex<Option<mpsc::UnboundedSender<executor::BufferedJob>>>,
    /// The queue's per-job metrics.
    pub(crate) series: crate::metrics::JobSeries,
    /// Whether another claimer holds running jobs of this queue, as last seen
    /// ([`sharing`]): then fewer claims and writes are kept in flight.
    pub(crate) others_claiming: std::sync::atomic::AtomicBool,
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
            queue,
            slots,
            member,
            prefetch,
            prefetch_max: prefetch_max.max(prefetch),
            started: AtomicU64::new(0),
            wake: Notify::new(),
            runnable: std::sync::Mutex::new(None),
            settled: Notify::new(),
            lost_claims: producer::LostClaims::default(),
            handed: std::sync::Mutex::new(None),
            others_claiming: std::sync::atomic::AtomicBool::new(false),
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

    /// Tells every producer to look at its queue from the start of claim order, and wakes
    /// it: notifications may have been missed (the listener was down).
    pub(crate) fn look_from_start_all(&self) {
        for group in &self.groups {
            group.note_runnable(claim_cursor::LookFrom::Start);
        }
    }

    /// The index of the group that claims from `queue`, if any.
    pub(crate) fn group_of(&self, queue: &str) -> Option<usize> {
        self.groups.iter().position(|g| g.queue == queue)
    }

    /// Tells the producer that claims from `queue`, if any, that jobs became runnable
    /// there from `from` on, and wakes it.
    pub(crate) fn runnable(&self, queue: &str, from: claim_cursor::LookFrom) {
        if let Some(group) = self.group_of(queue) {
            self.groups[group].note_runnable(from);
        }
    }

    /// Tells the producer that claims from `queue`, if any, that jobs become runnable there
    /// from `from` on between `due_in_us` microseconds after `now` (the first and the last
    /// of them), at [`due_timers::handovers`]: at once for those already due.
    pub(crate) fn due_later(
        &self,
        queue: &str,
        from: claim_cursor::LookFrom,
        due_in_us: [i64; 2],
        now: std::time::Instant,
    ) {
        let Some(group) = self.group_of(queue) else {
            return;
        };
        let mut now_given = false;
        for us in due_timers::handovers(due_in_us) {
            match u64::try_from(us) {
                Ok(us) if us > 0 => {
                    self.due_timers
                        .add(group, from, std::time::Duration::from_micros(us), now);
                }
                // Due already: once, however many handovers are past.
                _ if !now_given => {
                    now_given = true;
                    self.groups[group].note_runnable(from);
                }
                _ => {}
            }
        }
    }
}

impl QueueGroup {
    fn note_runnable(&self, from: claim_cursor::LookFrom) {
        let mut runnable = self
            .runnable
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *runnable = Some(from.min_with(*runnable));
        drop(runnable);
        self.wake.notify_one();
    }

    /// Where jobs became runnable since the last call, the lowest.
    pub(crate) fn take_runnable(&self) -> Option<claim_cursor::LookFrom> {
        self.runnable
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
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
    /// Transient database errors are logged and retried, never returned, from the first
    /// statement on: a session killed during the start-up schema check is retried like
    /// any other.
    ///
    /// # Errors
    ///
    /// [`Error::SchemaOutdated`] or [`Error::SchemaTooNew`] when the database schema does
    /// not match this build, [`Error::InvalidCron`] when the database refuses a cron
    /// schedule defined on the worker (a malformed expression, an unknown time zone),
    /// [`Error::Database`] if the database cannot be reached at start
    /// (no server answers within the pool's acquire timeout, an unknown host, a refused
    /// login).
    pub async fn run(self) -> Result<WorkerSummary> {
        let shared = self.shared;
        // Before anything else runs on the pool: its sessions pinned, a pooler found.
        shared.pool.pin_sessions().await;
        if !check_schema_at_start(&shared).await? {
            tracing::info!(worker_id = %shared.config.worker_id, "shut down before it started");
            return Ok(WorkerSummary::default());
        }
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
            pgbouncer = shared.pool.is_pgbouncer(),
            "worker started"
        );

        // Background tasks that live until every claim is settled.
        let background = CancellationToken::new();
        let tasks = TaskTracker::new();
        tasks.spawn(listener::listen(shared.clone(), background.clone()));
        tasks.spawn(due_timers::hand_over(shared.clone(), background.clone()));
        tasks.spawn(heartbeat::beat(shared.clone(), background.clone()));
        tasks.spawn(sharing::watch(shared.clone(), background.clone()));
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
            config.cron_interval,
            config.prune_interval,
        );

        let (outcome_tx, outcome_rx) = mpsc::unbounded_channel();
        let completer = tokio::spawn(completer::complete(shared.clone(), outcome_rx));
        let executors = TaskTracker::new();
        let mut pipelines = Vec::new();
        for group in 0..shared.groups.len() {
            let (buffer_tx, buffer_rx) = mpsc::channel(shared.groups[group].prefetch_max);
            let (handed_tx, handed_rx) = mpsc::unbounded_channel();
            *shared.groups[group]
                .handed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(handed_tx);
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
                executor::Inboxes {
                    buffer: buffer_rx,
                    handed: handed_rx,
                },
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

/// The schema check before the worker starts; false if the worker was shut down first.
///
/// A database that cannot be reached at all is an error to return (a wrong URL, a server
/// that is down): the pool found no server to connect to. But once a server answered, a
/// transient failure (its session killed by `pg_terminate_backend`, a pooler or a
/// failover; the server shutting down, starting up or out of connections) says nothing
/// about the worker's settings, and the check is retried as every statement of a running
/// worker is.
async fn check_schema_at_start(shared: &Shared) -> Result<bool> {
    let mut failures = 0u32;
    loop {
        let error = match shared.pool.pool().acquire().await {
            Ok(mut connection) => {
                match crate::db::migrations::schema_version(&mut *connection).await {
                    Ok(found) => {
                        crate::schema_fits(found)?;
                        drop(connection);
                        match write_cron_schedules(shared).await {
                            Ok(()) => return Ok(true),
                            Err(Error::Database(e)) if is_transient_sqlx(&e) => e,
                            Err(e) => return Err(e),
                        }
                    }
                    Err(Error::Database(e)) if is_transient_sqlx(&e) => e,
                    Err(e) => return Err(e),
                }
            }
            // The server answered, and refused for now.
            Err(e @ sqlx::Error::Database(_)) if is_transient_sqlx(&e) => e,
            Err(e) => return Err(e.into()),
        };
        failures += 1;
        tracing::warn!(
            error = %describe_sqlx(&error),
            "the schema check before the worker starts failed; retrying"
        );
        tokio::select! {
            () = tokio::time::sleep(crate::pacing::db_retry_delay(failures)) => {}
            () = shared.graceful.cancelled() => return Ok(false),
        }
    }
}

/// Writes the cron schedules defined on the worker (created, or updated keeping their
/// progress), so that a malformed one ends [`Worker::run`] at start with the database's
/// reason rather than never firing.
async fn write_cron_schedules(shared: &Shared) -> Result<()> {
    for schedule in &shared.config.cron_schedules {
        crate::db::cron::cron_schedules_upsert(&shared.pool, &schedule.columns())
            .await
            .map_err(crate::cron::refused_schedule)?;
    }
    Ok(())
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
