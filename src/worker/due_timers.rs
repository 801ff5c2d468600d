//! The due timers: a write that makes jobs due later (a retry after its delay, a snooze, an
//! enqueue for later, a stale claim taken back, a lane or a parent letting a job go whose
//! time has not come) says when (`skiplock_due_later`); the listener hands the claim key
//! here, and when it comes due this stage tells the queue's producer, as a notification
//! of a job runnable now would. A job that comes due behind the producer's position (a
//! higher priority than the one it claims from) is walked back to then, instead of
//! waiting for a full walk, which under a held snapshot can be a minute away (see
//! [`super::claim_cursor`]); one ahead of it is claimed then, instead of at the next poll.
//!
//! The delay comes from the database: the time from the write's `clock_timestamp()` to the
//! job's `scheduled_at`. The worker hears of it at commit, later, and starts its timer
//! then: the key is handed over once the job is due by the database clock, never before,
//! whatever the worker's own clock says; late by the time from the write to its commit.
//! A write of several jobs of one queue and priority names the first and the last to come
//! due: the first's key is handed over when the first comes due, at
//! [`HANDOVERS_PER_SPAN`] evenly spaced moments after it, and when the last does, and a
//! walk from it takes every one of them that is due by then. So a job due in between is
//! handed over at most 1/32 of the span from the first to the last after it comes due
//! (before, it waited for the last: 6.2 s under a held snapshot, issue 38).
//!
//! Due times are rounded up to a grid of milliseconds whose step, a power of two, is at
//! most 1/32 of the delay, and the keys due at one grid point are kept as the lowest of
//! them, which a walk from it covers. So a queue keeps at most about 130 times for each
//! doubling of the delay (a few thousand up to the day ahead that writes announce at
//! most), however many jobs are written, and a key is handed over at most about 3 % of its
//! delay late.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::Shared;
use super::claim_cursor::LookFrom;

/// A grid step is at most the delay divided by this (rounded down to a power of two of
/// milliseconds): it bounds how late a key is handed over (1/32 of its delay at most) and
/// how many grid points a doubling of the delay holds (about 2 × 64).
const GRID_STEPS_PER_DELAY: u128 = 64;

/// The key of a write of several jobs due later is handed over this many times over the
/// span from its first due time to its last (its first and last included, see
/// [`handovers`]): a job due in between waits at most 1/32 of the span.
pub(crate) const HANDOVERS_PER_SPAN: i64 = 32;

/// The delays (microseconds after the write) at which the key of a write whose jobs come
/// due from `first` to `last` microseconds after it is handed over: the first, the last,
/// and evenly spaced moments between them, at most 1/[`HANDOVERS_PER_SPAN`] of the span
/// apart (fewer when the span is under 32 µs).
pub(crate) fn handovers([first, last]: [i64; 2]) -> impl Iterator<Item = i64> {
    let (first, last) = (first.min(last), first.max(last));
    let span = i128::from(last) - i128::from(first);
    let steps = span.clamp(1, i128::from(HANDOVERS_PER_SPAN));
    (0..=steps).map(move |k| {
        // At most `last`, so within i64.
        (i128::from(first) + span * k / steps) as i64
    })
}

/// Keys of jobs due later, per queue group, until they come due.
pub(crate) struct DueTimers {
    /// Where the grid's milliseconds count from.
    origin: Instant,
    /// Per group (by index): grid point (milliseconds since `origin`) → the lowest key due
    /// then.
    pending: Mutex<Vec<BTreeMap<u64, LookFrom>>>,
    /// Signalled when a key is added before every other of its group: the stage looks at
    /// its next deadline again.
    sooner: Notify,
}

impl DueTimers {
    pub(crate) fn new(groups: usize, origin: Instant) -> Self {
        Self {
            origin,
            pending: Mutex::new(vec![BTreeMap::new(); groups]),
            sooner: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<BTreeMap<u64, LookFrom>>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `from` for `group` until `delay` after `now`, rounded up to the grid. A delay
    /// beyond what an `Instant` can hold is dropped: the full walks find that job.
    pub(crate) fn add(&self, group: usize, from: LookFrom, delay: Duration, now: Instant) {
        let Some(point) = self.grid_point(now, delay) else {
            return;
        };
        let mut pending = self.lock();
        let Some(keys) = pending.get_mut(group) else {
            return;
        };
        let sooner = keys
            .first_key_value()
            .is_none_or(|(&first, _)| point < first);
        keys.entry(point)
            .and_modify(|key| *key = (*key).min(from))
            .or_insert(from);
        drop(pending);
        if sooner {
            self.sooner.notify_one();
        }
    }

    /// The grid point at or after `now + delay`, in milliseconds since `origin`.
    fn grid_point(&self, now: Instant, delay: Duration) -> Option<u64> {
        let due = now.checked_add(delay)?;
        let since_origin = due.saturating_duration_since(self.origin).as_micros();
        let step = (delay.as_millis() / GRID_STEPS_PER_DELAY)
            .max(1)
            .checked_next_power_of_two()?;
        let point = since_origin
            .div_ceil(1000)
            .div_ceil(step)
            .checked_mul(step)?;
        u64::try_from(point).ok()
    }

    /// When the earliest key pending comes due.
    fn next_due(&self) -> Option<Instant> {
        let earliest = self
            .lock()
            .iter()
            .filter_map(|keys| keys.first_key_value().map(|(&point, _)| point))
            .min()?;
        self.origin.checked_add(Duration::from_millis(earliest))
    }

    /// Takes the keys due at `now`: the lowest of each group's, with the group's index.
    fn take_due(&self, now: Instant) -> Vec<(usize, LookFrom)> {
        let now_ms = u64::try_from(now.saturating_duration_since(self.origin).as_millis())
            .unwrap_or(u64::MAX);
        let mut due = Vec::new();
        for (group, keys) in self.lock().iter_mut().enumerate() {
            let later = keys.split_off(&now_ms.saturating_add(1));
            let lowest = keys.values().copied().min();
            *keys = later;
            if let Some(lowest) = lowest {
                due.push((group, lowest));
            }
        }
        due
    }
}

/// Hands each key to its queue's producer when it comes due, until `stop`.
pub(super) async fn hand_over(shared: Arc<Shared>, stop: CancellationToken) {
    let timers = &shared.due_timers;
    loop {
        for (group, from) in timers.take_due(Instant::now()) {
            shared.groups[group].note_runnable(from);
        }
        let next = timers.next_due();
        tokio::select! {
            () = stop.cancelled() => return,
            () = timers.sooner.notified() => {}
            () = sleep_until(next) => {}
        }
    }
}

/// Sleeps until `at`, or for ever when there is nothing to wait for.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn key(priority: i16, scheduled_at_us: i64) -> LookFrom {
        LookFrom::at(priority, scheduled_at_us)
    }

    #[test]
    fn a_span_is_handed_over_at_most_a_32nd_of_it_apart_ends_included() {
        for (first, last) in [
            (1_000_000, 7_000_000),
            (5, 5),
            (-3, 10),
            (0, 31),
            (i64::MIN, i64::MAX),
            (7_000_000, 1_000_000),
        ] {
            let at: Vec<i64> = handovers([first, last]).collect();
            let (low, high) = (first.min(last), first.max(last));
            assert_eq!(at.first(), Some(&low), "{first}..{last}: {at:?}");
            assert_eq!(at.last(), Some(&high), "{first}..{last}: {at:?}");
            assert!(at.len() <= 33, "{first}..{last}: {} handovers", at.len());
            let gap = at.windows(2).map(|w| i128::from(w[1]) - i128::from(w[0]));
            let span = i128::from(high) - i128::from(low);
            for g in gap {
                assert!(
                    g >= 0 && g <= span / 32 + 1,
                    "{first}..{last}: a gap of {g}"
                );
            }
        }
    }

    #[test]
    fn a_key_is_handed_over_once_due_and_not_before() {
        let t0 = Instant::now();
        let timers = DueTimers::new(2, t0);
        timers.add(1, key(-5, 7), 40 * MS, t0);
        assert_eq!(timers.next_due(), Some(t0 + 40 * MS));
        assert!(timers.take_due(t0 + 39 * MS).is_empty());
        assert_eq!(timers.take_due(t0 + 40 * MS), [(1, key(-5, 7))]);
        assert!(timers.take_due(t0 + 41 * MS).is_empty(), "handed over once");
        assert_eq!(timers.next_due(), None);
    }

    #[test]
    fn keys_due_by_then_are_handed_over_as_the_lowest_per_queue() {
        let t0 = Instant::now();
        let timers = DueTimers::new(2, t0);
        timers.add(0, key(0, 9), 10 * MS, t0);
        timers.add(0, key(-1, 20), 20 * MS, t0);
        timers.add(0, key(3, 1), 30 * MS, t0);
        timers.add(1, key(2, 2), 15 * MS, t0);
        let mut due = timers.take_due(t0 + 25 * MS);
        due.sort();
        assert_eq!(due, [(0, key(-1, 20)), (1, key(2, 2))]);
        assert_eq!(timers.take_due(t0 + 30 * MS), [(0, key(3, 1))]);
    }

    #[test]
    fn due_times_are_rounded_up_by_at_most_a_32nd_of_the_delay() {
        let t0 = Instant::now();
        let timers = DueTimers::new(1, t0);
        let now = t0 + 3 * MS;
        for delay_ms in [1, 63, 64, 100, 1_000, 2_000, 60_000, 86_400_000] {
            let delay = Duration::from_millis(delay_ms);
            let point = timers.grid_point(now, delay).unwrap();
            let due_ms = 3 + delay_ms;
            assert!(point >= due_ms, "{delay_ms} ms: {point}");
            assert!(
                point - due_ms <= (delay_ms / 32).max(1),
                "{delay_ms} ms: {point} is {} ms late",
                point - due_ms
            );
        }
        // A delay in microseconds is never rounded down.
        assert_eq!(
            timers.grid_point(now, Duration::from_micros(1_500)),
            Some(5)
        );
    }

    #[test]
    fn keys_coalesce_on_the_grid_so_a_flood_keeps_few_timers() {
        let t0 = Instant::now();
        let timers = DueTimers::new(1, t0);
        // One key every millisecond for ten seconds, each due a minute later.
        for n in 0..10_000u32 {
            let now = t0 + n * MS;
            timers.add(0, key(0, i64::from(n)), Duration::from_secs(60), now);
        }
        let kept = timers.lock()[0].len();
        // A minute's step is 1,024 ms: ten seconds hold 10 or 11 grid points.
        assert!(kept <= 11, "{kept} timers kept");
        // The first point holds the lowest of the keys rounded to it.
        let (_, first) = timers.take_due(t0 + Duration::from_secs(71)).remove(0);
        assert_eq!(first, key(0, 0));
    }

    #[test]
    fn a_delay_no_instant_can_hold_is_dropped() {
        let t0 = Instant::now();
        let timers = DueTimers::new(1, t0);
        timers.add(0, key(0, 1), Duration::MAX, t0);
        assert_eq!(timers.next_due(), None);
    }

    #[test]
    fn an_unknown_group_is_ignored() {
        let t0 = Instant::now();
        let timers = DueTimers::new(1, t0);
        timers.add(3, key(0, 1), MS, t0);
        assert_eq!(timers.next_due(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_added_sooner_than_the_others_wakes_the_stage() {
        let t0 = Instant::now();
        let timers = DueTimers::new(1, t0);
        timers.add(0, key(0, 1), Duration::from_secs(10), t0);
        // The stage takes the permit of the first add, then waits for the next deadline.
        timers.sooner.notified().await;
        timers.add(0, key(0, 2), Duration::from_secs(20), t0);
        let waited = tokio::time::timeout(Duration::from_secs(1), timers.sooner.notified()).await;
        assert!(waited.is_err(), "a later key changes no deadline");
        timers.add(0, key(0, 3), Duration::from_secs(5), t0);
        tokio::time::timeout(Duration::from_secs(1), timers.sooner.notified())
            .await
            .expect("a sooner key wakes the stage");
    }
}
