//! Where the producer's next claim starts: just after the last job it claimed (a cursor
//! walk), or at the left edge of the claim index (a full walk).
//!
//! A claimed job leaves its entry in `jobs_claim_idx` until no snapshot can see the row
//! as `queued`. While another transaction holds an older snapshot (a long report,
//! `pg_dump`, a forgotten `BEGIN`), a full walk steps over the entries of every job
//! claimed since, and a drain becomes quadratic (`claim_batch` has the measurements). A
//! cursor walk steps only over what other claimers took since this producer's last claim.
//!
//! Jobs can land behind the position (a higher priority, a job that waited for a parent or
//! its lane and became queued with its old `scheduled_at`, an insert whose transaction
//! committed late), and only a full walk finds them. Full walks also mark the entries
//! they pass dead once no snapshot needs them, so later walks skip them cheaply. So full
//! walks stay the rule and are paced only by what they cost beyond a cursor walk: one at a time, each no sooner than [`FULL_WALK_COST_FACTOR`] times its
//! extra cost after the last one. In a clean database that extra cost is about nothing,
//! and nearly every claim is a full walk, as if there were no cursor; under a held
//! snapshot it grows with every claim, full walks thin out, and they never take more than
//! about a tenth of the producer's claim time. The cost of a cursor walk is measured
//! by the cursor walks themselves: one runs at least every [`CURSOR_COST_MAX_AGE`]. A
//! cursor walk that comes back short is followed by a full walk (as soon as the pacing
//! allows) before the producer calls the queue drained.

use std::time::{Duration, Instant};

use crate::db::jobs::{ClaimPosition, ClaimedJob};

/// A full walk starts no sooner than this many times its extra cost (its duration beyond
/// a cursor walk's) after the last one ended: the extra cost of full walks takes at most
/// about 1/(1 + factor) of the claim time.
const FULL_WALK_COST_FACTOR: u32 = 10;

/// The longest a full walk may be held back by the pacing. Jobs that land behind the
/// position (a higher priority, a lane or a parent released) wait for a full walk, so a
/// single slow one (a checkpoint, a stalled server) must not hold them back for ten times
/// its duration; with walks that cost more than half a second beyond a cursor walk, this
/// lets them take a larger share of the claim time instead.
const FULL_WALK_GAP_MAX: Duration = Duration::from_secs(5);

/// The measured cost of a cursor walk is trusted this long; after that the next claim is
/// a cursor walk, to measure it again (at most one extra cursor walk a second when full
/// walks are cheap).
const CURSOR_COST_MAX_AGE: Duration = Duration::from_secs(1);

/// The producer's position in claim order and the pacing of its full walks.
#[derive(Debug)]
pub(super) struct ClaimCursor {
    /// Key of the last job claimed by a cursor walk, or where a full walk stopped; `None`
    /// until the first job is claimed.
    after: Option<ClaimPosition>,
    /// Full walks sent and not landed.
    full_walks_in_flight: usize,
    /// Earliest start of the next full walk.
    next_full_walk: Instant,
    /// Smoothed duration of the cursor walks (each new one weighs a quarter), and when
    /// the last one landed; `None` until one has.
    cursor_cost: Option<(Duration, Instant)>,
    /// Whether the last full walk cost more than twice a cursor walk: the left edge is
    /// crowded with entries nothing can remove yet (a held snapshot).
    full_walks_expensive: bool,
}

/// One claim as planned by [`ClaimCursor::next_walk`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Walk {
    /// Start after this position; `None` for a full walk.
    pub from: Option<ClaimPosition>,
    /// When the claim statement started: set again once it has a connection, so that a
    /// wait for the pool is not taken for the cost of the walk.
    started: Instant,
}

impl Walk {
    /// Marks the statement as starting now (it has its connection).
    pub(super) fn start(&mut self, now: Instant) {
        self.started = now;
    }

    /// Time since the statement started.
    pub(super) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

/// What a landed claim says about the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Landing {
    /// It claimed as many as asked: claim again when there is room.
    More,
    /// A cursor walk came back short and a full walk may run now: claim again at once
    /// (the next walk is a full one).
    LookBehind,
    /// Nothing more for now. `look_behind_at`: a full walk is still owed (a cursor walk
    /// came back short while the pacing held full walks back) and may run then.
    Drained { look_behind_at: Option<Instant> },
}

impl ClaimCursor {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            after: None,
            full_walks_in_flight: 0,
            next_full_walk: now,
            cursor_cost: None,
            full_walks_expensive: false,
        }
    }

    /// Whether a full walk may start now.
    fn full_walk_allowed(&self, now: Instant) -> bool {
        self.full_walks_in_flight == 0 && now >= self.next_full_walk
    }

    /// Whether the cost of a cursor walk is unknown or too old to pace full walks by.
    fn cursor_cost_stale(&self, now: Instant) -> bool {
        self.cursor_cost
            .is_none_or(|(_, at)| now.saturating_duration_since(at) >= CURSOR_COST_MAX_AGE)
    }

    /// Plans the next claim: a full walk when no position is known or the pacing allows
    /// one (and the cost of a cursor walk is known), a cursor walk otherwise.
    pub(super) fn next_walk(&mut self, now: Instant) -> Walk {
        if self.after.is_none() || (self.full_walk_allowed(now) && !self.cursor_cost_stale(now)) {
            self.full_walks_in_flight += 1;
            Walk {
                from: None,
                started: now,
            }
        } else {
            Walk {
                from: self.after,
                started: now,
            }
        }
    }

    /// Takes in a landed claim of `limit` jobs that returned `jobs` (in claim order).
    pub(super) fn landed(
        &mut self,
        walk: Walk,
        limit: usize,
        jobs: &[ClaimedJob],
        now: Instant,
    ) -> Landing {
        let last = jobs.last().map(ClaimedJob::position);
        let full = jobs.len() >= limit;
        if walk.from.is_none() {
            self.full_walk_ended(walk, now);
            // A full batch from the left edge may have stopped behind the position: go
            // on from where it stopped. A short one took everything there was.
            self.after = if full { last } else { self.after.max(last) };
            return if full {
                Landing::More
            } else {
                Landing::Drained {
                    look_behind_at: None,
                }
            };
        }
        self.cursor_walk_ended(walk, now);
        self.after = self.after.max(last);
        if full {
            Landing::More
        } else if self.full_walk_allowed(now) {
            Landing::LookBehind
        } else {
            Landing::Drained {
                look_behind_at: (self.full_walks_in_flight == 0).then_some(self.next_full_walk),
            }
        }
    }

    /// Takes in a claim that failed. Its duration says nothing about the cost of a walk
    /// (it may have waited for a timeout), so it does not pace the next full walk.
    pub(super) fn failed(&mut self, walk: Walk) {
        if walk.from.is_none() {
            self.full_walks_in_flight = self.full_walks_in_flight.saturating_sub(1);
        }
    }

    fn full_walk_ended(&mut self, walk: Walk, now: Instant) {
        self.full_walks_in_flight = self.full_walks_in_flight.saturating_sub(1);
        let cost = now.saturating_duration_since(walk.started);
        let cursor = self.cursor_cost.map_or(cost, |(cursor, _)| cursor);
        let extra = cost.saturating_sub(cursor);
        self.full_walks_expensive = extra > cursor;
        self.next_full_walk = now + (extra * FULL_WALK_COST_FACTOR).min(FULL_WALK_GAP_MAX);
    }

    /// How many of `room` free buffer places a claim planned as `walk` should ask for.
    ///
    /// An expensive full walk runs for a while (a quarter of a second with a million
    /// entries behind the position), and the room a claim asks for is reserved until it
    /// lands: with all of it reserved, no cursor walk could start beside it, and new jobs
    /// would wait for the full walk. Such a walk looks for the few jobs that landed behind
    /// the position, so it asks for a quarter of the room; if it fills that, the position
    /// moves back to where it stopped and cursor walks take the rest from there.
    pub(super) fn claim_limit(&self, walk: &Walk, room: usize) -> usize {
        if walk.from.is_none() && self.full_walks_expensive {
            (room / 4).max(1)
        } else {
            room
        }
    }

    fn cursor_walk_ended(&mut self, walk: Walk, now: Instant) {
        let cost = now.saturating_duration_since(walk.started);
        let smoothed = match self.cursor_cost {
            Some((old, _)) => (old * 3 + cost) / 4,
            None => cost,
        };
        self.cursor_cost = Some((smoothed, now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::types::Json;
    use uuid::Uuid;

    fn job(id: i64) -> ClaimedJob {
        ClaimedJob {
            id,
            queue: "default".into(),
            kind: "noop".into(),
            args: Json(serde_json::Value::Null),
            attempt: 1,
            max_attempts: 25,
            claim_token: Uuid::nil(),
            priority: 0,
            scheduled_at_us: 1_000,
        }
    }

    fn jobs(ids: std::ops::RangeInclusive<i64>) -> Vec<ClaimedJob> {
        ids.map(job).collect()
    }

    const MS: Duration = Duration::from_millis(1);

    /// A cursor that has claimed jobs 1..=2 with a full walk and then measured a cursor
    /// walk of `cursor_cost` (claiming job 3), at the returned time.
    fn warmed_up(t0: Instant, cursor_cost: Duration) -> (ClaimCursor, Instant) {
        let mut cursor = ClaimCursor::new(t0);
        let first = cursor.next_walk(t0);
        assert_eq!(first.from, None, "no position yet: a full walk");
        assert_eq!(cursor.landed(first, 2, &jobs(1..=2), t0), Landing::More);
        let probe = cursor.next_walk(t0);
        assert_eq!(
            probe.from.map(|p| p.id),
            Some(2),
            "cursor cost unknown: a cursor walk measures it"
        );
        let t1 = t0 + cursor_cost;
        assert_eq!(cursor.landed(probe, 1, &jobs(3..=3), t1), Landing::More);
        (cursor, t1)
    }

    #[test]
    fn cheap_full_walks_are_the_rule() {
        let t0 = Instant::now();
        let (mut cursor, t1) = warmed_up(t0, 2 * MS);
        let mut t = t1;
        for step in 0..5 {
            let walk = cursor.next_walk(t);
            assert_eq!(walk.from, None, "claim {step} walks from the left edge");
            // As long as a cursor walk (2 ms): no extra cost, no pacing.
            t += 2 * MS;
            cursor.landed(walk, 3, &jobs(4..=6), t);
        }
    }

    #[test]
    fn the_cursor_cost_is_measured_again_once_a_second() {
        let t0 = Instant::now();
        let (mut cursor, t1) = warmed_up(t0, MS);
        let later = t1 + CURSOR_COST_MAX_AGE;
        let walk = cursor.next_walk(later);
        assert_eq!(walk.from.map(|p| p.id), Some(3));
        cursor.landed(walk, 5, &jobs(4..=8), later + MS);
        assert_eq!(cursor.next_walk(later + MS).from, None);
    }

    #[test]
    fn an_expensive_full_walk_spaces_the_next_by_ten_times_its_extra_cost() {
        let t0 = Instant::now();
        let (mut cursor, t1) = warmed_up(t0, 5 * MS);
        let walk = cursor.next_walk(t1);
        assert_eq!(walk.from, None);
        // 305 ms against 5 ms for a cursor walk: 300 ms extra, so 3 s until the next one.
        let t2 = t1 + 305 * MS;
        assert_eq!(cursor.landed(walk, 2, &jobs(4..=5), t2), Landing::More);
        let mut t = t2;
        while t < t2 + Duration::from_secs(3) {
            let walk = cursor.next_walk(t);
            assert!(walk.from.is_some(), "{:?} after the expensive walk", t - t2);
            cursor.landed(walk, 1, &jobs(6..=6), t + 5 * MS);
            t += 100 * MS;
        }
        assert_eq!(cursor.next_walk(t2 + Duration::from_secs(3)).from, None);
    }

    #[test]
    fn one_slow_full_walk_holds_the_next_back_five_seconds_at_most() {
        let t0 = Instant::now();
        let (mut cursor, t1) = warmed_up(t0, MS);
        let walk = cursor.next_walk(t1);
        assert_eq!(walk.from, None);
        // A 3 s full walk (a stalled server) would space the next by 30 s.
        let t2 = t1 + Duration::from_secs(3);
        cursor.landed(walk, 2, &jobs(4..=5), t2);
        // Just before the gap ends: the cursor cost is measured again (it is old), and
        // the pacing still holds full walks back.
        let t3 = t2 + FULL_WALK_GAP_MAX - 10 * MS;
        let probe = cursor.next_walk(t3);
        assert!(probe.from.is_some(), "the cursor cost is seconds old");
        cursor.landed(probe, 1, &jobs(6..=6), t3 + MS);
        assert!(cursor.next_walk(t3 + MS).from.is_some(), "still paced");
        assert_eq!(cursor.next_walk(t2 + FULL_WALK_GAP_MAX).from, None);
    }

    #[test]
    fn a_failed_full_walk_does_not_pace_the_next() {
        let t0 = Instant::now();
        let (mut cursor, t1) = warmed_up(t0, MS);
        let walk = cursor.next_walk(t1);
        assert_eq!(walk.from, None);
        cursor.failed(walk);
        assert_eq!(cursor.next_walk(t1 + MS).from, None);
    }

    #[test]
    fn a_short_cursor_walk_looks_behind_before_the_queue_counts_as_drained() {
        let t0 = Instant::now();
        let (mut cursor, t1) = warmed_up(t0, MS);
        let full = cursor.next_walk(t1);
        assert_eq!(full.from, None);
        let t2 = t1 + 51 * MS;
        cursor.landed(full, 2, &jobs(4..=5), t2);
        let walk = cursor.next_walk(t2);
        assert!(walk.from.is_some());
        // The pacing (500 ms after the 50 ms of extra cost) holds full walks back:
        // drained, with a look behind owed.
        let t3 = t2 + MS;
        assert_eq!(
            cursor.landed(walk, 2, &jobs(6..=6), t3),
            Landing::Drained {
                look_behind_at: Some(t2 + 500 * MS)
            }
        );
        // Once the pacing allows, a short cursor walk asks for the full walk at once.
        let t4 = t2 + 500 * MS;
        let walk = cursor.next_walk(t4 - MS);
        assert_eq!(walk.from.map(|p| p.id), Some(6));
        assert_eq!(cursor.landed(walk, 2, &[], t4), Landing::LookBehind);
        let behind = cursor.next_walk(t4);
        assert_eq!(behind.from, None);
        assert_eq!(
            cursor.landed(behind, 2, &[], t4),
            Landing::Drained {
                look_behind_at: None
            }
        );
        assert_eq!(
            cursor.next_walk(t4 + 100 * MS).from,
            None,
            "an empty full walk costs nothing extra"
        );
    }

    #[test]
    fn an_empty_full_walk_keeps_the_position() {
        let t0 = Instant::now();
        let (mut cursor, t1) = warmed_up(t0, MS);
        let full = cursor.next_walk(t1);
        cursor.landed(full, 2, &[], t1 + MS);
        let t2 = t1 + CURSOR_COST_MAX_AGE;
        assert_eq!(cursor.next_walk(t2).from.map(|p| p.id), Some(3));
    }

    #[test]
    fn a_full_batch_from_the_left_edge_continues_behind_the_position() {
        let t0 = Instant::now();
        let mut cursor = ClaimCursor::new(t0);
        let walk = cursor.next_walk(t0);
        cursor.landed(walk, 2, &jobs(10..=11), t0);
        let probe = cursor.next_walk(t0);
        cursor.landed(probe, 2, &jobs(12..=13), t0 + MS);
        let full = cursor.next_walk(t0 + MS);
        assert_eq!(full.from, None);
        // Jobs 1 and 2 landed behind position 13 (say, a higher priority); the batch was
        // full, so there may be more there.
        assert_eq!(
            cursor.landed(full, 2, &jobs(1..=2), t0 + 2 * MS),
            Landing::More
        );
        assert!(cursor.full_walk_allowed(t0 + 2 * MS));
        // Both claims in flight: the second is a cursor walk from where the first stopped.
        let next = cursor.next_walk(t0 + 2 * MS);
        assert_eq!(next.from, None);
        assert_eq!(cursor.next_walk(t0 + 2 * MS).from.map(|p| p.id), Some(2));
    }

    #[test]
    fn an_expensive_full_walk_leaves_room_for_cursor_walks_beside_the_next() {
        let t0 = Instant::now();
        let (mut cursor, t1) = warmed_up(t0, MS);
        let cheap = cursor.next_walk(t1);
        assert_eq!(
            cursor.claim_limit(&cheap, 400),
            400,
            "a cheap full walk asks for all"
        );
        cursor.landed(cheap, 2, &jobs(4..=5), t1 + 2 * MS);
        let t2 = t1 + 20 * MS;
        let expensive = cursor.next_walk(t2);
        assert_eq!(expensive.from, None);
        cursor.landed(expensive, 2, &jobs(6..=7), t2 + 250 * MS);
        // 249 ms of extra cost: the next full walk after 2.49 s, the cursor cost measured
        // again before it.
        let t3 = t2 + Duration::from_secs(3);
        let probe = cursor.next_walk(t3 - 10 * MS);
        assert!(probe.from.is_some());
        cursor.landed(probe, 1, &jobs(8..=8), t3 - 9 * MS);
        let next = cursor.next_walk(t3);
        assert_eq!(next.from, None);
        assert_eq!(cursor.claim_limit(&next, 400), 100);
        assert_eq!(cursor.claim_limit(&next, 3), 1);
        let beside = cursor.next_walk(t3);
        assert!(beside.from.is_some());
        assert_eq!(
            cursor.claim_limit(&beside, 300),
            300,
            "a cursor walk asks for all"
        );
    }

    #[test]
    fn a_failed_full_walk_frees_the_slot() {
        let t0 = Instant::now();
        let mut cursor = ClaimCursor::new(t0);
        let walk = cursor.next_walk(t0);
        cursor.failed(walk);
        assert_eq!(cursor.full_walks_in_flight, 0);
        assert!(cursor.next_walk(t0).from.is_none(), "no position yet");
    }
}
