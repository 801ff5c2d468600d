//! Waiting for a job's outcome: [`wait_for`].
//!
//! A waiter marks its job awaited (`skiplock.watch_job`, which also says where the job
//! stands), and an awaited job that finishes notifies `skiplock_finished` with its id
//! (`migrations/functions/14_awaited_outcomes.sql`): only jobs someone waits for notify,
//! and a job nobody waits for costs its finishing statement the test of one column.
//!
//! Every waiter of a process on one pool shares one listening connection (a [`Hub`]),
//! opened with the first waiter and closed with the last: a thousand waiters cost one
//! connection, and the pool is used only for each waiter's short `watch_job` calls. The
//! hub listens before any of its waiters looks at its job, so a job that finishes between
//! the look and the wait is heard; a waiter looks again at each notification of its id,
//! after each (re)subscription of the listener (notifications sent while it was down are
//! lost), and at a slow fallback interval ([`FALLBACK_LISTENING`]), which bounds the wait
//! when a notification is lost some other way. Where no notification can arrive (the
//! listening connection fails, or the pool reaches Postgres through PgBouncer in
//! transaction mode, which does not keep a LISTEN) waiters look every
//! [`FALLBACK_POLLING`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::db::jobs::{WatchedJob, jobs_watch};
use crate::error::{Error, Result};
use crate::pacing::db_retry_delay;
use crate::pool::{Reach, pin_session, probe_reach};
use crate::state::{JobId, JobState};

/// The channel an awaited job notifies when it finishes, with its id as the payload.
pub(crate) const FINISHED_CHANNEL: &str = "skiplock_finished";

/// How often a waiter looks at its job while the hub listens: only a lost notification
/// makes this the wake-up (a listener reconnecting wakes every waiter itself).
const FALLBACK_LISTENING: Duration = Duration::from_secs(10);

/// How long a waiter waits for the listening connection before its first look, at most:
/// past it, it looks (and looks every [`FALLBACK_POLLING`] until the listener is up).
const READY_WAIT_MAX: Duration = Duration::from_secs(5);

/// How often a waiter looks at its job while no notification can arrive (no listening
/// connection, or PgBouncer in transaction mode).
const FALLBACK_POLLING: Duration = Duration::from_secs(1);

/// A finished job's outcome, as [`wait_for`] returns it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct JobOutcome {
    /// The job.
    pub id: JobId,
    /// `Succeeded`, `Dead` or `Cancelled`.
    pub state: JobState,
    /// Attempts it took.
    pub attempt: i32,
    /// What the handler recorded (a `Succeeded` job's output, if its handler gave one).
    pub output: Option<Value>,
    /// Message of its latest failure: why a `Dead` job died, or why a job was cancelled.
    pub last_error: Option<String>,
    /// When it finished.
    pub finished_at: DateTime<Utc>,
}

/// Waits until job `id` has finished (succeeded, dead or cancelled) and returns its
/// outcome, woken by the job's own notification at the commit of the statement that
/// finished it. Call it after the enqueue's transaction committed.
///
/// Every call of a process on the same pool shares one listening connection of its own
/// (opened with the first waiter, closed with the last); each call also runs a short
/// statement on `pool` when it starts and each time it is woken. A job that finished
/// already returns at once. Waiting marks the job `awaited` (a column of `skiplock.jobs`),
/// which makes it notify `skiplock_finished` when it finishes; that is all it changes.
/// The same from any language: `skiplock.watch_job` (docs/sql.md).
///
/// Behind PgBouncer in transaction mode no notification arrives, and the call looks at
/// the job once a second instead; give it a pool of direct connections to be woken at
/// the commit.
///
/// # Errors
///
/// [`Error::JobNotFound`] when no job has this id (never enqueued, not committed yet, or
/// deleted or pruned, also while waited for), [`Error::WaitTimedOut`] when it has not
/// finished after `timeout`, [`Error::Database`] when a look at the job fails.
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// # async fn example(pool: sqlx::PgPool, id: skiplock::JobId) -> Result<(), skiplock::Error> {
/// let outcome = skiplock::wait_for(&pool, id, Duration::from_secs(30)).await?;
/// match outcome.state {
///     skiplock::JobState::Succeeded => println!("done: {:?}", outcome.output),
///     _ => println!("{}: {:?}", outcome.state, outcome.last_error),
/// }
/// # Ok(()) }
/// ```
pub async fn wait_for(pool: &PgPool, id: JobId, timeout: Duration) -> Result<JobOutcome> {
    wait_for_with_fallbacks(pool, id, timeout, FALLBACK_LISTENING, FALLBACK_POLLING).await
}

/// [`wait_for`] with its fallback intervals given: how often a waiter looks at its job
/// while notifications reach it, and while they cannot. For skiplock's own tests (a test
/// that must tell a wake-up by notification from one by time sets the first to hours);
/// not part of the API.
#[doc(hidden)]
#[cfg_attr(not(feature = "internals"), allow(unreachable_pub))]
pub async fn wait_for_with_fallbacks(
    pool: &PgPool,
    id: JobId,
    timeout: Duration,
    fallback_listening: Duration,
    fallback_polling: Duration,
) -> Result<JobOutcome> {
    let deadline = Instant::now() + timeout;
    let waiter = Hub::register(pool, id);
    let mut listening = waiter.hub.listening.subscribe();
    // LISTEN first (or know that nothing will be heard), so that a finish after the look
    // below is heard; for [`READY_WAIT_MAX`] at most (a connection that hangs must not
    // keep a finished job from being returned).
    let ready = listening.wait_for(|state| *state != Listening::Starting);
    let _ = tokio::time::timeout_at(deadline.min(Instant::now() + READY_WAIT_MAX), ready).await;
    let mut last_state = None;
    loop {
        // The listening state before the look: a change after it (the listener back after
        // a finish it could not hear) wakes the wait below.
        let fallback = match *listening.borrow_and_update() {
            Listening::Yes => fallback_listening,
            Listening::Starting | Listening::No => fallback_polling,
        };
        // Bounded by the deadline: the look waits for the job's row while another
        // transaction holds it locked.
        let Ok(looked) = tokio::time::timeout_at(deadline, look(pool, id)).await else {
            return Err(Error::WaitTimedOut {
                id,
                waited: timeout,
                state: last_state,
            });
        };
        let job = looked?.ok_or(Error::JobNotFound { id })?;
        last_state = Some(job.state);
        if let Some(outcome) = finished(job) {
            return Ok(outcome);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::WaitTimedOut {
                id,
                waited: timeout,
                state: last_state,
            });
        }
        tokio::select! {
            () = waiter.wake.notified() => {}
            _ = listening.changed() => {}
            () = tokio::time::sleep_until(deadline.min(now + fallback)) => {}
        }
    }
}

/// One look at the job (`skiplock.watch_job`), run again on a serialization failure: under
/// a database whose default isolation is above READ COMMITTED (the caller's pool is not
/// pinned), a finish committed while the look waited for the row fails the statement
/// instead of being read; a new statement, a new snapshot, reads it.
async fn look(pool: &PgPool, id: JobId) -> Result<Option<WatchedJob>> {
    let mut failures = 0u32;
    loop {
        match jobs_watch(pool, id).await {
            Err(sqlx::Error::Database(e))
                if e.code().as_deref() == Some("40001") && failures < 10 =>
            {
                failures += 1;
                tokio::time::sleep(Duration::from_millis(u64::from(failures) * 5)).await;
            }
            looked => return Ok(looked?),
        }
    }
}

/// The outcome of a job that finished; `None` while it is live.
fn finished(job: WatchedJob) -> Option<JobOutcome> {
    Some(JobOutcome {
        finished_at: job.finished_at?,
        id: job.id,
        state: job.state,
        attempt: job.attempt,
        output: job.output,
        last_error: job.last_error,
    })
}

/// Whether the hub's notifications reach its waiters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Listening {
    /// Not known yet: the listening connection is being opened.
    Starting,
    /// LISTEN is in effect.
    Yes,
    /// Not now (the connection failed or was lost; it is opened again), or never (the
    /// pool reaches Postgres through a pooler that keeps no LISTEN).
    No,
}

/// The waiters of a process on one pool, and the one connection that listens for them.
struct Hub {
    /// The pool's connect options, whose address names the pool in [`HUBS`] (held, so
    /// that the address is not reused while the hub lives).
    options: Arc<PgConnectOptions>,
    /// Each awaited job's waiters.
    waiters: Mutex<HashMap<i64, Vec<Arc<Notify>>>>,
    /// Whether notifications reach the waiters; every change wakes them all.
    listening: watch::Sender<Listening>,
    /// Stops the listener when the last waiter leaves.
    stop: CancellationToken,
}

/// Every hub, by the address of its pool's connect options (a pool's clones share them).
static HUBS: OnceLock<Mutex<HashMap<usize, Arc<Hub>>>> = OnceLock::new();

fn hubs() -> std::sync::MutexGuard<'static, HashMap<usize, Arc<Hub>>> {
    HUBS.get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One waiter's place in its hub; leaves it when dropped (the last one closes the hub).
struct Waiter {
    hub: Arc<Hub>,
    id: i64,
    wake: Arc<Notify>,
}

impl Hub {
    /// A waiter for job `id` in the hub of `pool`, which is opened if it has none.
    fn register(pool: &PgPool, id: JobId) -> Waiter {
        let options = pool.connect_options();
        let key = Arc::as_ptr(&options) as usize;
        let wake = Arc::new(Notify::new());
        let mut hubs = hubs();
        let hub = hubs
            .entry(key)
            .or_insert_with(|| {
                let hub = Arc::new(Hub {
                    options,
                    waiters: Mutex::default(),
                    listening: watch::Sender::new(Listening::Starting),
                    stop: CancellationToken::new(),
                });
                tokio::spawn(listen(hub.clone()));
                hub
            })
            .clone();
        hub.lock_waiters()
            .entry(id.0)
            .or_default()
            .push(wake.clone());
        Waiter {
            hub,
            id: id.0,
            wake,
        }
    }

    fn lock_waiters(&self) -> std::sync::MutexGuard<'_, HashMap<i64, Vec<Arc<Notify>>>> {
        self.waiters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Wakes the waiters of job `id`; a waiter not waiting yet keeps the wake-up.
    fn wake(&self, id: i64) {
        if let Some(waiters) = self.lock_waiters().get(&id) {
            for wake in waiters {
                wake.notify_one();
            }
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut hubs = hubs();
        let mut waiters = self.hub.lock_waiters();
        if let Some(of_job) = waiters.get_mut(&self.id) {
            of_job.retain(|wake| !Arc::ptr_eq(wake, &self.wake));
            if of_job.is_empty() {
                waiters.remove(&self.id);
            }
        }
        if waiters.is_empty() {
            hubs.remove(&(Arc::as_ptr(&self.hub.options) as usize));
            self.hub.stop.cancel();
        }
    }
}

/// The hub's listener: LISTEN on [`FINISHED_CHANNEL`] on a connection of its own and wake
/// the waiters of each id notified, reconnecting with backoff, until the last waiter
/// leaves. Behind a pooler that keeps no LISTEN it does not listen at all.
async fn listen(hub: Arc<Hub>) {
    let options = pin_session((*hub.options).clone());
    let reach = tokio::select! {
        () = hub.stop.cancelled() => return,
        reach = probe_reach(&options) => reach,
    };
    if let Reach::Pooler(what) = reach {
        tracing::info!(
            "waiting for job outcomes through a connection pooler ({what}): no notification \
             can arrive, each waiter looks at its job every {FALLBACK_POLLING:?}; give \
             skiplock::wait_for a pool of direct connections to be woken at once"
        );
        hub.listening.send_replace(Listening::No);
        return;
    }
    let own_connection = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .connect_lazy_with(options);
    let mut failures = 0u32;
    loop {
        let session = async {
            let mut listener = PgListener::connect_with(&own_connection).await?;
            listener.listen(FINISHED_CHANNEL).await?;
            failures = 0;
            // Every waiter looks again: what finished while nothing listened was not heard.
            hub.listening.send_replace(Listening::Yes);
            loop {
                let Some(notification) = listener.try_recv().await? else {
                    return Ok::<(), sqlx::Error>(());
                };
                if let Ok(id) = notification.payload().parse::<i64>() {
                    hub.wake(id);
                }
            }
        };
        let ended = tokio::select! {
            () = hub.stop.cancelled() => return,
            ended = session => ended,
        };
        hub.listening.send_replace(Listening::No);
        match ended {
            Ok(()) => {
                tracing::warn!("the listener of job outcomes lost its connection; reconnecting")
            }
            Err(e) => {
                failures += 1;
                if crate::read_only::worth_a_warning(&e) {
                    tracing::warn!(error = %e, "the listener of job outcomes failed; waiters look every second until it reconnects");
                }
            }
        }
        tokio::select! {
            () = hub.stop.cancelled() => return,
            () = tokio::time::sleep(db_retry_delay(failures)) => {}
        }
    }
}
