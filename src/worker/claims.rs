//! The claims a worker holds: every job it claimed whose outcome is not yet saved, whether
//! it waits in the local buffer, runs, or waits for the completer. The heartbeat extends
//! exactly these, and the jobs of claim statements still in flight (see
//! [`ClaimInFlight`]).
//!
//! A claim is identified by its job id *and* its claim token, never by the id alone: the
//! same worker can hold a stale claim of a job (an earlier attempt that was reaped or
//! cancelled and retried, whose outcome is still on its way to the completer) and the live
//! re-claim of the same job at once. Keyed by id alone, settling the stale one forgot the
//! live one: its heartbeat stopped and the job was reaped while it ran.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// One claim: a job id and the fencing token the claim was made with.
pub(crate) type ClaimKey = (i64, Uuid);

/// Where a claimed job is: in the local buffer (or in the dispatcher's hand, waiting for a
/// slot), started, or given back by the heartbeat after waiting too long (see
/// [`HeldClaims::beat_list`]). Moves from `BUFFERED` to one of the others, once.
const BUFFERED: u8 = 0;
const STARTED: u8 = 1;
const GIVEN_BACK: u8 = 2;

struct HeldClaim {
    /// Stops the job's handler (lost claim, hard shutdown).
    stop: CancellationToken,
    /// `BUFFERED`, `STARTED` or `GIVEN_BACK`, shared with the dispatcher's handles.
    phase: Arc<AtomicU8>,
    /// When the claim landed.
    claimed: Instant,
    /// The handler has returned; only the completer's write remains.
    finished: bool,
    /// Stopped because the job was cancelled (a notification from `cancel_job`), not
    /// because the claim was found lost.
    cancelled: bool,
    /// Set by [`JobContext::complete_in`](crate::JobContext::complete_in): the handler
    /// completed its job inside its own transaction, so once that commits the claim is
    /// gone by our own hand and the handler must not be stopped for it.
    completed_in_tx: Arc<AtomicBool>,
}

/// What a handler gets from its claim: the signal that stops it and the flag its
/// in-transaction completion sets.
#[derive(Clone)]
pub(crate) struct ClaimHandles {
    pub(crate) stop: CancellationToken,
    pub(crate) completed_in_tx: Arc<AtomicBool>,
    phase: Arc<AtomicU8>,
}

impl ClaimHandles {
    /// Marks the job started, as its dispatcher hands it a slot; false when the heartbeat
    /// gave the claim back first (the job is not this worker's to run any more).
    pub(crate) fn start(&self) -> bool {
        self.phase
            .compare_exchange(BUFFERED, STARTED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Whether the heartbeat gave the claim back while the job waited for a slot.
    pub(crate) fn given_back(&self) -> bool {
        self.phase.load(Ordering::Acquire) == GIVEN_BACK
    }
}

/// Hashes the keys of held claims: a multiply-rotate mix of their words (the scheme of
/// rustc's FxHasher). The map sees every job three times (claimed, finished, settled); with
/// std's SipHash it took 13 % of a worker's CPU in a drain, much of it hashing. Job ids
/// and claim tokens come from the database and the worker, not from whoever could aim
/// for collisions.
#[derive(Default, Clone, Copy)]
struct ClaimKeyHasher(u64);

impl ClaimKeyHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for ClaimKeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_i64(&mut self, n: i64) {
        self.add(n as u64);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
}

type ClaimMap = HashMap<ClaimKey, HeldClaim, BuildHasherDefault<ClaimKeyHasher>>;

/// Held claims by (job id, claim token).
#[derive(Default)]
pub(crate) struct HeldClaims {
    inner: Mutex<ClaimMap>,
    /// Claim statements sent and not yet landed, by the token their jobs hold, with the
    /// moment each was sent.
    in_flight: Arc<Mutex<HashMap<Uuid, Instant>>>,
}

/// A claim statement between the moment it is sent and the moment its jobs are held
/// (recorded in [`HeldClaims`]); dropping it ends that span.
///
/// The jobs of a claim are `running` from its commit, but the worker learns them only
/// when the producer reads the reply. A handler that blocks its runtime thread can strand
/// the producer for longer than the stale timeout (tokio's LIFO slot, which no other
/// thread may steal): the claim's jobs then went unbeaten, the reaper took them back and
/// they ran twice. The heartbeat, on its own thread, extends the jobs of a claim that has
/// been in flight for a beat interval by the claim's token, which every job of that claim
/// holds and which fences it like any claim token.
pub(crate) struct ClaimInFlight {
    token: Uuid,
    registry: Arc<Mutex<HashMap<Uuid, Instant>>>,
}

impl Drop for ClaimInFlight {
    fn drop(&mut self) {
        lock(&self.registry).remove(&self.token);
    }
}

/// Locks a registry; every critical section is a single map operation, so a panic while
/// holding the lock cannot leave the map half-updated.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl HeldClaims {
    fn lock(&self) -> std::sync::MutexGuard<'_, ClaimMap> {
        lock(&self.inner)
    }

    /// Notes a claim statement about to be sent whose jobs will hold `token`. Drop the
    /// result once those jobs are recorded with [`insert`](Self::insert), or once the
    /// claim failed.
    pub(crate) fn claim_sent(&self, token: Uuid) -> ClaimInFlight {
        lock(&self.in_flight).insert(token, Instant::now());
        ClaimInFlight {
            token,
            registry: self.in_flight.clone(),
        }
    }

    /// Tokens of the claims in flight for at least `min` and at most `max`. Past `max` a
    /// claim's jobs are no longer extended: a reply that never comes (a connection gone
    /// silent after the commit) must not keep them alive for as long as the process
    /// lives; the reaper takes them back as it did before claims in flight were beaten.
    pub(crate) fn in_flight_for(&self, min: Duration, max: Duration) -> Vec<Uuid> {
        lock(&self.in_flight)
            .iter()
            .filter(|(_, sent)| (min..=max).contains(&sent.elapsed()))
            .map(|(token, _)| *token)
            .collect()
    }

    /// Records a new claim and returns what its handler gets.
    pub(crate) fn insert(&self, claim: ClaimKey) -> ClaimHandles {
        let handles = ClaimHandles {
            stop: CancellationToken::new(),
            completed_in_tx: Arc::default(),
            phase: Arc::new(AtomicU8::new(BUFFERED)),
        };
        self.lock().insert(
            claim,
            HeldClaim {
                stop: handles.stop.clone(),
                phase: handles.phase.clone(),
                claimed: Instant::now(),
                finished: false,
                cancelled: false,
                completed_in_tx: handles.completed_in_tx.clone(),
            },
        );
        handles
    }

    /// What a held claim's handler gets.
    #[cfg(test)]
    pub(crate) fn handles(&self, claim: ClaimKey) -> Option<ClaimHandles> {
        self.lock().get(&claim).map(|held| ClaimHandles {
            stop: held.stop.clone(),
            completed_in_tx: held.completed_in_tx.clone(),
            phase: held.phase.clone(),
        })
    }

    /// Notes that a claim's handler returned.
    pub(crate) fn mark_finished(&self, claim: ClaimKey) {
        if let Some(held) = self.lock().get_mut(&claim) {
            held.finished = true;
        }
    }

    /// What the heartbeat extends: the ids and tokens of the held claims, column-wise for
    /// its statement, and, taken out of the held claims and returned apart, those whose
    /// job has waited for a slot for longer than `unstarted_max` without starting, which
    /// it gives back to the queue instead.
    ///
    /// A job waits in the local buffer (or in its dispatcher's hand) until a slot frees.
    /// Behind long jobs that can take as long as they run, while other workers sit idle;
    /// and a dispatcher that never gets its slot (a wedged runtime, a slot never given
    /// back) held its jobs for as long as the process lived, since the heartbeat runs on a
    /// thread of its own and kept their claims alive (the randomized model once saw two
    /// lane heads claimed and never started, everything behind them waiting). Given back,
    /// a job goes to whichever worker claims it next, its attempt not counted; its
    /// dispatcher, if it ever gets to it, finds it gone ([`ClaimHandles::start`]).
    pub(crate) fn beat_list(
        &self,
        unstarted_max: Duration,
    ) -> (Vec<i64>, Vec<Uuid>, Vec<ClaimKey>) {
        self.beat_list_at(Instant::now(), unstarted_max)
    }

    /// [`beat_list`](Self::beat_list) as of `now`.
    fn beat_list_at(
        &self,
        now: Instant,
        unstarted_max: Duration,
    ) -> (Vec<i64>, Vec<Uuid>, Vec<ClaimKey>) {
        let mut map = self.lock();
        let mut given_back = Vec::new();
        map.retain(|claim, held| {
            let waited_too_long = now.saturating_duration_since(held.claimed) > unstarted_max
                && held
                    .phase
                    .compare_exchange(BUFFERED, GIVEN_BACK, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok();
            if waited_too_long {
                given_back.push(*claim);
            }
            !waited_too_long
        });
        let (ids, tokens) = map.keys().copied().unzip();
        (ids, tokens, given_back)
    }

    /// Forgets claims whose outcome was saved or found stale.
    pub(crate) fn remove_many(&self, claims: &[ClaimKey]) {
        let mut map = self.lock();
        for claim in claims {
            map.remove(claim);
        }
    }

    /// Stops the handlers of claims the database no longer honours; returns the ids whose
    /// handler was still running (the others only awaited their completion write). A
    /// claim its handler completed in its own transaction is left alone: it is gone
    /// because that transaction committed.
    pub(crate) fn stop_lost(&self, claims: &[ClaimKey]) -> Vec<i64> {
        let map = self.lock();
        claims
            .iter()
            .filter_map(|claim| {
                let held = map.get(claim)?;
                if held.completed_in_tx.load(Ordering::Acquire) || held.cancelled {
                    // Done in the handler's own transaction, or stopped by its cancel.
                    return None;
                }
                held.stop.cancel();
                (!held.finished).then_some(claim.0)
            })
            .collect()
    }

    /// Stops the handlers of every claim of job `id` (the job was cancelled: whichever of
    /// our claims of it is live, the database voided it). Returns the ids whose handler
    /// was still running.
    pub(crate) fn stop_job(&self, id: i64) -> Vec<i64> {
        let mut map = self.lock();
        map.iter_mut()
            .filter(|(claim, _)| claim.0 == id)
            .filter_map(|(claim, held)| {
                held.cancelled = true;
                held.stop.cancel();
                (!held.finished).then_some(claim.0)
            })
            .collect()
    }

    /// Whether a claim's handler was stopped because its job was cancelled.
    pub(crate) fn was_cancelled(&self, claim: ClaimKey) -> bool {
        self.lock().get(&claim).is_some_and(|held| held.cancelled)
    }

    /// Stops every handler (hard shutdown).
    pub(crate) fn stop_all(&self) {
        for held in self.lock().values() {
            held.stop.cancel();
        }
    }

    /// Number of held claims.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stale claim of a job settled while the same job's re-claim is live must leave the
    /// live one held (heartbeated, stoppable).
    #[test]
    fn settling_a_stale_claim_keeps_the_live_reclaim_of_the_same_job() {
        let claims = HeldClaims::default();
        let (stale, live) = ((7, Uuid::new_v4()), (7, Uuid::new_v4()));
        let stale_stop = claims.insert(stale).stop;
        let live_stop = claims.insert(live).stop;
        claims.mark_finished(stale);
        claims.remove_many(&[stale]);
        assert_eq!(claims.len(), 1);
        assert_eq!(
            claims.beat_list(Duration::MAX),
            (vec![7], vec![live.1], Vec::new())
        );
        assert!(!claims.handles(live).unwrap().stop.is_cancelled());
        // A hard stop reaches every handler, the stale attempt's included while it is held.
        claims.insert(stale);
        claims.stop_all();
        assert!(live_stop.is_cancelled());
        assert!(
            !stale_stop.is_cancelled(),
            "the removed claim's token is its own"
        );
        assert!(claims.handles(stale).unwrap().stop.is_cancelled());
    }

    /// The jobs of one claim share its token: their keys must still hash apart, or the
    /// map degrades to a list scanned per job.
    #[test]
    fn keys_of_one_claim_hash_apart() {
        use std::hash::BuildHasher;
        let build = BuildHasherDefault::<ClaimKeyHasher>::default();
        let token = Uuid::new_v4();
        let hashes: std::collections::HashSet<u64> = (1..=10_000i64)
            .map(|id| build.hash_one((id, token)))
            .collect();
        assert_eq!(hashes.len(), 10_000);
        // hashbrown picks the bucket from the low bits and a tag from the top 7: both vary.
        let low: std::collections::HashSet<u64> = hashes.iter().map(|h| h & 0xfff).collect();
        let top: std::collections::HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
        assert!(low.len() > 3_000, "low 12 bits: {} distinct", low.len());
        assert_eq!(top.len(), 128);
    }

    /// A claim in flight is listed once it is old enough and until it is too old, and
    /// forgotten when its guard drops, whether it landed or failed.
    #[test]
    fn a_claim_in_flight_is_listed_until_its_guard_drops() {
        let claims = HeldClaims::default();
        let token = Uuid::new_v4();
        let guard = claims.claim_sent(token);
        let hour = Duration::from_secs(3600);
        assert_eq!(claims.in_flight_for(Duration::ZERO, hour), vec![token]);
        assert!(claims.in_flight_for(hour, 2 * hour).is_empty(), "too young");
        std::thread::sleep(Duration::from_millis(2));
        assert!(
            claims
                .in_flight_for(Duration::ZERO, Duration::from_millis(1))
                .is_empty(),
            "too old"
        );
        drop(guard);
        assert!(claims.in_flight_for(Duration::ZERO, hour).is_empty());
    }

    /// A heartbeat that finds the stale claim lost stops only that claim's handler.
    #[test]
    fn a_lost_stale_claim_does_not_stop_the_live_reclaim() {
        let claims = HeldClaims::default();
        let (stale, live) = ((7, Uuid::new_v4()), (7, Uuid::new_v4()));
        let stale_stop = claims.insert(stale).stop;
        let live_stop = claims.insert(live).stop;
        assert_eq!(claims.stop_lost(&[stale]), vec![7]);
        assert!(stale_stop.is_cancelled());
        assert!(!live_stop.is_cancelled());
    }

    /// A claim its handler completed in its own transaction is gone by our own hand: the
    /// heartbeat that finds it gone must not stop the handler.
    #[test]
    fn a_claim_completed_in_the_handlers_transaction_is_not_stopped() {
        let claims = HeldClaims::default();
        let (done, lost) = ((7, Uuid::new_v4()), (8, Uuid::new_v4()));
        let done_handles = claims.insert(done);
        let lost_stop = claims.insert(lost).stop;
        done_handles.completed_in_tx.store(true, Ordering::Release);
        assert_eq!(claims.stop_lost(&[done, lost]), vec![8]);
        assert!(!done_handles.stop.is_cancelled());
        assert!(lost_stop.is_cancelled());
    }

    /// A job that waited for a slot longer than the bound is given back and taken out of
    /// the held claims; one that started, or has waited less, is extended. A claim given
    /// back never starts, and one that started is never given back. (Times are the
    /// instants around the inserts, so the test holds however slowly it runs.)
    #[test]
    fn a_job_that_waited_too_long_for_a_slot_is_given_back_once_and_never_starts() {
        let claims = HeldClaims::default();
        let (waited, running, fresh) = (
            (1, Uuid::new_v4()),
            (2, Uuid::new_v4()),
            (3, Uuid::new_v4()),
        );
        let waited_handles = claims.insert(waited);
        let running_handles = claims.insert(running);
        std::thread::sleep(Duration::from_millis(20));
        let fresh_at = Instant::now();
        let fresh_handles = claims.insert(fresh);
        // 5 ms after the fresh claim landed, at least 25 ms after the others.
        let beat = fresh_at + Duration::from_millis(5);
        let bound = Duration::from_millis(10);
        assert!(running_handles.start());
        let (mut ids, _, given_back) = claims.beat_list_at(beat, bound);
        ids.sort_unstable();
        assert_eq!((ids, given_back), (vec![2, 3], vec![waited]));
        assert!(waited_handles.given_back());
        assert!(!waited_handles.start(), "a job given back never starts");
        assert!(!running_handles.given_back());
        assert!(!running_handles.start(), "a job starts once");
        // Once started, the fresh job is extended however long it waited.
        assert!(fresh_handles.start());
        let (mut ids, _, given_back) = claims.beat_list_at(beat + Duration::from_secs(60), bound);
        ids.sort_unstable();
        assert_eq!((ids, given_back), (vec![2, 3], Vec::new()));
    }
}
