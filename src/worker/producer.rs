//! The producer: claims batches of runnable jobs into the local buffer.
//!
//! It claims as many jobs as the buffer has room for, in one statement: from the start of
//! claim order, or from just after the last job it claimed when walking from the start has
//! become expensive (a held snapshot; see [`super::claim_cursor`], which chooses). When a
//! claim comes back short, and the jobs behind that position were looked at too, the queue
//! is drained for now, and it waits for a wake-up (a notification from the listener) or the
//! jittered poll interval, whichever comes first.
//!
//! The buffer's size follows the rate at which jobs start: it holds about
//! [`PREFETCH_HORIZON`] of work, between the group's `prefetch` and `prefetch_max`. Short
//! jobs thus get claim batches of hundreds (one statement and one commit for many jobs);
//! long jobs keep the buffer at `prefetch` and are not hoarded from other workers.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::{Notify, mpsc};
use uuid::Uuid;

use super::claim_cursor::{ClaimCursor, Landing, LookFrom, Walk};
use super::claims::ClaimInFlight;
use super::executor::BufferedJob;
use super::sharing::claims_in_flight;
use super::split_write::release_at_once;
use super::{PREFETCH_HORIZON, Shared, reply_lost, schema_mismatch, stop_if_schema_outgrown};
use crate::db::jobs::{
    ClaimArgs, ClaimMode, ClaimedJob, jobs_claim, jobs_claim_one, jobs_claimed_with,
};
use crate::db::maintenance::{jobs_any_active, jobs_left_behind};
use crate::metrics;
use crate::pacing::{db_retry_delay, sleep_jittered};

/// Why the producer is not claiming right now.
enum Pause {
    /// Claim whenever the buffer has room.
    No,
    /// The last claim came back short: wait for a wake-up or the poll interval, or until
    /// the full walk still owed may run.
    Drained { look_behind_at: Option<Instant> },
    /// The last claim failed: wait this long.
    Failed(Duration),
}

/// Runs until the graceful shutdown signal and until the claims in flight have landed in
/// the buffer; dropping `buffer` on return tells the dispatcher that no more jobs will
/// come.
pub(super) async fn produce(
    shared: Arc<Shared>,
    group_index: usize,
    buffer: mpsc::Sender<BufferedJob>,
    space: Arc<Notify>,
) {
    let config = &shared.config;
    let group = &shared.groups[group_index];
    let _close_handed = CloseHanded(group);
    let mut rate = StartRate::new(group.started.load(Ordering::Relaxed));
    let mut in_flight = FuturesUnordered::new();
    // Buffer room promised to the claims in flight.
    let mut reserved = 0usize;
    let mut pause = Pause::No;
    let mut failures = 0u32;
    let mut cursor = ClaimCursor::new(Instant::now());
    loop {
        let stopping = shared.graceful.is_cancelled();
        if stopping && in_flight.is_empty() {
            break;
        }
        cursor.set_notified(shared.listening.load(Ordering::Relaxed), Instant::now());
        if let Some(from) = group.take_runnable() {
            cursor.notified(from);
        }
        if !stopping
            && matches!(pause, Pause::No)
            && in_flight.len() < claims_in_flight(&shared, group_index)
        {
            let target = rate.buffer_target(
                group.started.load(Ordering::Relaxed),
                group.prefetch,
                group.prefetch_max,
            );
            // Refill once a quarter of the buffer is free: claims are batches, not trickles.
            let refill_at = (target / 4).max(1);
            let buffered = buffer.max_capacity() - buffer.capacity();
            // Backpressure: claims held by the whole worker (buffered, running, or
            // finished and waiting for the completer) stay under a bound, so a completer
            // that falls behind slows claiming instead of piling up `running` rows.
            let unsettled_room = shared
                .held_limit
                .saturating_sub(shared.claims.len() + reserved);
            let free = target
                .saturating_sub(buffered + reserved)
                .min(unsettled_room);
            if free >= refill_at {
                let walk = cursor.next_walk(Instant::now());
                let limit = cursor.claim_limit(&walk, free.min(config.batch_max));
                reserved += limit;
                in_flight.push(claim(shared.clone(), group_index, limit, walk));
                continue;
            }
        }
        let idle_wait = in_flight.is_empty() && !stopping;
        tokio::select! {
            Some((limit, walk, claimed, sent)) = in_flight.next(), if !in_flight.is_empty() => {
                reserved -= limit;
                let jobs = match claimed {
                    Ok(jobs) => {
                        failures = 0;
                        crate::read_only::writes_accepted();
                        jobs
                    }
                    Err(e) => {
                        metrics::claim_failed();
                        cursor.failed(walk);
                        if schema_mismatch(&e) && stop_if_schema_outgrown(&shared).await {
                            continue;
                        }
                        // A row moved between the partitions under the claim (40001: a job
                        // cancelled while the claim waited for it) is another claimer's
                        // race, not a sick database: claim again at once.
                        if crate::error::is_row_moved(&e) {
                            tracing::debug!(error = %e, "a job moved under the claim; claiming again");
                            continue;
                        }
                        failures += 1;
                        if crate::read_only::worth_a_warning(&e) {
                            tracing::warn!(error = %e, "claim failed; retrying");
                        }
                        pause = Pause::Failed(db_retry_delay(failures));
                        continue;
                    }
                };
                let count = jobs.len();
                metrics::claimed(walk.elapsed(), count);
                metrics::buffered(count as f64);
                let landing = cursor.landed(walk, limit, &jobs, Instant::now());
                shared
                    .counters
                    .claimed
                    .fetch_add(count as u64, Ordering::Relaxed);
                for job in jobs {
                    let handles = shared.claims.insert((job.id, job.claim_token));
                    // Room was reserved for this claim before it was sent.
                    if let Err(e) = buffer.try_send(BufferedJob { job, handles }) {
                        tracing::error!(error = %e, "local buffer refused a claimed job");
                    }
                }
                // Its jobs are held now: the heartbeat extends them by id and token.
                drop(sent);
                match (landing, &pause) {
                    (Landing::Drained { look_behind_at }, Pause::No) => {
                        pause = Pause::Drained { look_behind_at };
                    }
                    // The paced full walk owed by this landing is kept, whichever landed
                    // first.
                    (
                        Landing::Drained {
                            look_behind_at: Some(at),
                        },
                        Pause::Drained {
                            look_behind_at: earlier,
                        },
                    ) => {
                        pause = Pause::Drained {
                            look_behind_at: Some(earlier.map_or(at, |earlier| earlier.min(at))),
                        };
                    }
                    // A claim that landed after another came back short may still find
                    // more, or owe a walk from behind: claim again.
                    (Landing::More | Landing::LookBehind, Pause::Drained { .. }) => {
                        pause = Pause::No;
                    }
                    _ => {}
                }
                if config.exit_when_idle
                    && !stopping
                    && count == 0
                    && in_flight.is_empty()
                    && shared.claims.len() == 0
                    && config.only_job.is_none()
                    && !walk.is_full()
                {
                    // Idleness is decided after a full walk (jobs may wait behind the
                    // position that no write announced): walk from the start now rather
                    // than when the pacing allows.
                    cursor.notified(LookFrom::Start);
                    pause = Pause::No;
                }
                // One chosen job: done once it was claimed and settled (or was not there).
                let only_job_done = config.only_job.is_some()
                    && shared.only_job_claimed.load(Ordering::SeqCst);
                if config.exit_when_idle
                    && !stopping
                    && count == 0
                    && in_flight.is_empty()
                    && shared.claims.len() == 0
                    && (only_job_done || (walk.is_full() && idle(&shared).await))
                {
                    // Said once, by the group that decides first (each group asks).
                    let left =
                        jobs_left_behind(&shared.pool, &shared.config.queues, &shared.kinds)
                            .await;
                    match left {
                        _ if shared.graceful.is_cancelled() => {}
                        Ok(Some(left)) => tracing::info!(
                            "no runnable or running job left; exiting as asked ({left})"
                        ),
                        Ok(None) => {
                            tracing::info!("no runnable or running job left; exiting as asked")
                        }
                        Err(e) => tracing::info!(
                            error = %e,
                            "no runnable or running job left; exiting as asked (cannot say what is left behind)"
                        ),
                    }
                    shared.graceful.cancel();
                }
            }
            () = shared.graceful.cancelled(), if !stopping => {}
            () = space.notified(), if matches!(pause, Pause::No) => {}
            () = group.settled.notified(), if matches!(pause, Pause::No) => {}
            // A wake-up does not wait for a claim in flight (a full walk can take a while
            // under a held snapshot): the next claim starts beside it.
            () = group.wake.notified(),
                if !stopping
                    && in_flight.len() < claims_in_flight(&shared, group_index)
                    && matches!(pause, Pause::Drained { .. }) => {
                pause = Pause::No;
            }
            () = sleep_jittered(config.poll_interval),
                if idle_wait && matches!(pause, Pause::Drained { .. }) => {
                pause = Pause::No;
            }
            () = wait_look_behind(&pause),
                if idle_wait && matches!(pause, Pause::Drained { look_behind_at: Some(_) }) => {
                pause = Pause::No;
            }
            () = wait_failed(&pause), if idle_wait && matches!(pause, Pause::Failed(_)) => {
                pause = Pause::No;
            }
        }
    }
}

/// Closes the group's inbox of handed-on jobs when the producer returns or panics, as
/// dropping the buffer's sender closes the buffer: handoffs after that are released by
/// the completer, and the dispatcher, draining both, is not left waiting.
struct CloseHanded<'a>(&'a super::QueueGroup);

impl Drop for CloseHanded<'_> {
    fn drop(&mut self) {
        self.0
            .handed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
    }
}

/// One claim statement for `limit` jobs, walking as planned; returns the limit and the
/// walk with the result so the producer can give back the room it reserved and move its
/// cursor, and the claim's [`ClaimInFlight`], to drop once its jobs are held.
async fn claim(
    shared: Arc<Shared>,
    group_index: usize,
    limit: usize,
    mut walk: Walk,
) -> (
    usize,
    Walk,
    Result<Vec<ClaimedJob>, sqlx::Error>,
    Option<ClaimInFlight>,
) {
    let group = &shared.groups[group_index];
    if group.lost_claims.any() {
        release_lost_claims(&shared, &group.lost_claims).await;
    }
    let mut connection = match shared.pool.acquire().await {
        Ok(connection) => connection,
        Err(e) => return (limit, walk, Err(e), None),
    };
    // The walk's cost is what the statement takes, not the wait for a connection (a busy
    // pool would otherwise hold full walks back for ten times that wait).
    walk.start(Instant::now());
    let token = Uuid::new_v4();
    let sent = shared.claims.claim_sent(token);
    let claimed = match shared.config.only_job {
        // One chosen job, claimed once (`skiplock::testing`).
        Some(id) if !shared.only_job_claimed.swap(true, Ordering::SeqCst) => {
            jobs_claim_one(&mut connection, id, &shared.config.worker_id, token).await
        }
        Some(_) => Ok(Vec::new()),
        None => {
            // Outside a subtransaction, so that the filter sees what other claims in
            // flight hold.
            let args = ClaimArgs {
                queue: &group.queue,
                kinds: &shared.kinds,
                limit: limit as i64,
                claimed_by: &shared.config.worker_id,
                after: walk.from,
                claim_with: Some(token),
                mode: ClaimMode {
                    skip_in_flight: walk.skips_in_flight(),
                },
            };
            jobs_claim(&mut connection, &args).await
        }
    };
    if let Err(e) = &claimed
        && reply_lost(e)
    {
        group.lost_claims.add(token, Instant::now());
    }
    (limit, walk, claimed, Some(sent))
}

/// Claims whose reply was lost. The worker knows their tokens (it chose them), so it finds
/// the jobs they took, if they committed, and releases them at once without spending the
/// attempt, instead of leaving them `running` with no heartbeat until the reaper takes them
/// back a stale timeout later with an attempt spent.
#[derive(Default)]
pub(crate) struct LostClaims {
    pending: Mutex<Vec<LostClaim>>,
}

struct LostClaim {
    token: Uuid,
    lost_at: Instant,
    next_look: Instant,
}

/// How often a lost claim's jobs are looked for while none are found: the statement may
/// still commit after its connection is gone (the server finishes it before it notices).
const LOST_CLAIM_LOOK_INTERVAL: Duration = Duration::from_secs(1);

impl LostClaims {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<LostClaim>> {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn add(&self, token: Uuid, now: Instant) {
        self.lock().push(LostClaim {
            token,
            lost_at: now,
            next_look: now,
        });
    }

    fn any(&self) -> bool {
        !self.lock().is_empty()
    }

    /// Tokens to look for now; each is looked for again no sooner than
    /// [`LOST_CLAIM_LOOK_INTERVAL`] later.
    fn due(&self, now: Instant) -> Vec<Uuid> {
        let mut pending = self.lock();
        pending
            .iter_mut()
            .filter(|lost| lost.next_look <= now)
            .map(|lost| {
                lost.next_look = now + LOST_CLAIM_LOOK_INTERVAL;
                lost.token
            })
            .collect()
    }

    /// Forgets `token`: its jobs were released, or it was looked for until `give_up_after`
    /// passed (by then the reaper takes back whatever it held).
    fn settle(&self, token: Uuid, released: bool, give_up_after: Duration, now: Instant) {
        self.lock().retain(|lost| {
            lost.token != token
                || (!released && now.saturating_duration_since(lost.lost_at) < give_up_after)
        });
    }
}

/// Releases the jobs of lost claims that committed; see [`LostClaims`]. The release is
/// written as the completer writes outcomes: a row that refuses it (a trigger of the
/// user's, say) is split off and left to the reaper, and the others are released now.
async fn release_lost_claims(shared: &Shared, lost: &LostClaims) {
    for token in lost.due(Instant::now()) {
        let ids = match jobs_claimed_with(&shared.pool, token).await {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "cannot look for the jobs of a claim whose reply was lost; will try again"
                );
                continue;
            }
        };
        if !ids.is_empty() {
            let tokens = vec![token; ids.len()];
            let write = release_at_once(shared, "release lost claim", &ids, &tokens).await;
            if !write.saved.is_empty() {
                tracing::info!(
                    jobs = write.saved.len(),
                    ids = ?write.saved,
                    "released the jobs of a claim whose reply was lost; no attempt spent"
                );
            }
            for ((id, _), reason) in &write.unsaved {
                tracing::error!(
                    job_id = id,
                    error = %reason,
                    "cannot release a job of a claim whose reply was lost; the reaper will take it back"
                );
            }
        }
        lost.settle(
            token,
            !ids.is_empty(),
            shared.config.stale_after,
            Instant::now(),
        );
    }
}

/// Sleeps until the full walk a drained producer still owes may run.
async fn wait_look_behind(pause: &Pause) {
    if let Pause::Drained {
        look_behind_at: Some(at),
    } = pause
    {
        tokio::time::sleep_until((*at).into()).await;
    }
}

/// Sleeps out a failed claim's retry delay.
async fn wait_failed(pause: &Pause) {
    if let Pause::Failed(delay) = pause {
        tokio::time::sleep(*delay).await;
    }
}

/// The rate at which the group's jobs start, measured over windows of at least
/// [`StartRate::WINDOW`] and smoothed.
struct StartRate {
    since: Instant,
    started_then: u64,
    /// Jobs started per second, smoothed over the recent windows.
    per_sec: f64,
}

impl StartRate {
    /// Shortest window a rate sample covers.
    const WINDOW: Duration = Duration::from_millis(50);

    fn new(started: u64) -> Self {
        Self {
            since: Instant::now(),
            started_then: started,
            per_sec: 0.0,
        }
    }

    /// The buffer size that holds [`PREFETCH_HORIZON`] of work at the current rate,
    /// within `[min, max]`.
    fn buffer_target(&mut self, started: u64, min: usize, max: usize) -> usize {
        let elapsed = self.since.elapsed();
        if elapsed >= Self::WINDOW {
            let sample = (started - self.started_then) as f64 / elapsed.as_secs_f64();
            self.per_sec = (self.per_sec + sample) / 2.0;
            self.since = Instant::now();
            self.started_then = started;
        }
        let wanted = (self.per_sec * PREFETCH_HORIZON.as_secs_f64()) as usize;
        wanted.clamp(min, max)
    }
}

/// Whether the database holds no runnable or running job of this worker's queues and kinds.
async fn idle(shared: &Shared) -> bool {
    match jobs_any_active(&shared.pool, &shared.config.queues, &shared.kinds).await {
        Ok(active) => !active,
        Err(e) => {
            tracing::warn!(error = %e, "idle check failed; assuming work remains");
            false
        }
    }
}
