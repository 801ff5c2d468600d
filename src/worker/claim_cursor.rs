//! Where the producer's next claim starts: just after the last job it claimed (a cursor
//! walk), or at the left edge of the claim index (a full walk).
//!
//! A claimed job leaves its entry in `jobs_claim_idx` until no snapshot can see the row
//! as `queued`. While another transaction holds an older snapshot (a long report,
//! `pg_dump`, a forgotten `BEGIN`), a full walk steps over the entries of every job
//! claimed since, and a drain becomes quadratic (migration 0009 has the measurements). A
//! cursor walk steps only over what other claimers took since this producer's last claim.
//!
//! Jobs can land behind the position (a higher priority, a job that waited for a parent or
//! its lane and became queued with its old `scheduled_at`, an insert whose transaction
//! committed late), and only a full walk finds them. So full walks still run, paced by
//! their own cost: one at a time, each no sooner than [`FULL_WALK_COST_FACTOR`] times the
//! last one's duration after it (and [`FULL_WALK_SPACING_MIN`]). In a clean database a full
//! walk costs what a cursor walk costs and runs every few milliseconds; under a held
//! snapshot it costs more and runs less often, never taking more than about a tenth of the
//! producer's claim time. A cursor walk that comes back short is followed by a full walk
//! (as soon as the pacing allows) before the producer calls the queue drained.

use std::time::{Duration, Instant};

use crate::db::jobs::{ClaimPosition, ClaimedJob};

/// A full walk starts no sooner than this many times the last one's duration after it
/// ended: full walks take at most about 1/(1 + factor) of the claim time.
const FULL_WALK_COST_FACTOR: u32 = 10;

/// Shortest time between two full walks, so that a cheap one does not run on every claim
/// of a drain (where the cursor walk finds the next jobs anyway).
const FULL_WALK_SPACING_MIN: Duration = Duration::from_millis(10);

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
}

/// One claim as planned by [`ClaimCursor::next_walk`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Walk {
    /// Start after this position; `None` for a full walk.
    pub from: Option<ClaimPosition>,
    /// When the claim was sent.
    started: Instant,
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
        }
    }

    /// Whether a full walk may start now.
    fn full_walk_allowed(&self, now: Instant) -> bool {
        self.full_walks_in_flight == 0 && now >= self.next_full_walk
    }

    /// Plans the next claim: a full walk when no position is known or the pacing allows
    /// one, a cursor walk otherwise.
    pub(super) fn next_walk(&mut self, now: Instant) -> Walk {
        if self.after.is_none() || self.full_walk_allowed(now) {
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

    /// Takes in a claim that failed.
    pub(super) fn failed(&mut self, walk: Walk, now: Instant) {
        if walk.from.is_none() {
            self.full_walk_ended(walk, now);
        }
    }

    fn full_walk_ended(&mut self, walk: Walk, now: Instant) {
        self.full_walks_in_flight = self.full_walks_in_flight.saturating_sub(1);
        let cost = now.saturating_duration_since(walk.started);
        self.next_full_walk = now + (cost * FULL_WALK_COST_FACTOR).max(FULL_WALK_SPACING_MIN);
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

    #[test]
    fn the_first_claim_is_a_full_walk_and_later_ones_start_after_the_last_job() {
        let t0 = Instant::now();
        let mut cursor = ClaimCursor::new(t0);
        let first = cursor.next_walk(t0);
        assert_eq!(first.from, None);
        let t1 = t0 + Duration::from_millis(2);
        assert_eq!(cursor.landed(first, 3, &jobs(1..=3), t1), Landing::More);
        // 2 ms walk: the next full walk waits 20 ms.
        let second = cursor.next_walk(t1);
        assert_eq!(second.from.map(|p| p.id), Some(3));
        assert_eq!(cursor.landed(second, 3, &jobs(4..=6), t1), Landing::More);
        assert_eq!(cursor.next_walk(t1).from.map(|p| p.id), Some(6));
        let later = t1 + Duration::from_millis(20);
        assert_eq!(cursor.next_walk(later).from, None, "paced full walk");
    }

    #[test]
    fn a_short_cursor_walk_looks_behind_before_the_queue_counts_as_drained() {
        let t0 = Instant::now();
        let mut cursor = ClaimCursor::new(t0);
        let full = cursor.next_walk(t0);
        cursor.landed(full, 2, &jobs(1..=2), t0);
        let walk = cursor.next_walk(t0);
        assert!(walk.from.is_some());
        // The pacing still holds full walks back: drained, with a look behind owed.
        let t1 = t0 + Duration::from_millis(1);
        assert_eq!(
            cursor.landed(walk, 2, &jobs(3..=3), t1),
            Landing::Drained {
                look_behind_at: Some(t0 + FULL_WALK_SPACING_MIN)
            }
        );
        // Once the pacing allows, a short cursor walk asks for the full walk at once.
        let t2 = t0 + FULL_WALK_SPACING_MIN;
        let walk = Walk {
            from: Some(job(3).position()),
            started: t2,
        };
        assert_eq!(cursor.landed(walk, 2, &[], t2), Landing::LookBehind);
        let behind = cursor.next_walk(t2);
        assert_eq!(behind.from, None);
        assert_eq!(
            cursor.landed(behind, 2, &[], t2),
            Landing::Drained {
                look_behind_at: None
            }
        );
        assert_eq!(
            cursor.next_walk(t2).from.map(|p| p.id),
            Some(3),
            "an empty full walk keeps the position"
        );
    }

    #[test]
    fn a_full_batch_from_the_left_edge_continues_behind_the_position() {
        let t0 = Instant::now();
        let mut cursor = ClaimCursor::new(t0);
        let walk = cursor.next_walk(t0);
        cursor.landed(walk, 2, &jobs(10..=11), t0);
        let t1 = t0 + FULL_WALK_SPACING_MIN;
        let full = cursor.next_walk(t1);
        assert_eq!(full.from, None);
        // Jobs 1 and 2 landed behind position 11 (say, a higher priority); the batch was
        // full, so there may be more there.
        assert_eq!(cursor.landed(full, 2, &jobs(1..=2), t1), Landing::More);
        assert_eq!(cursor.next_walk(t1).from.map(|p| p.id), Some(2));
    }

    #[test]
    fn an_expensive_full_walk_spaces_the_next_by_ten_times_its_cost() {
        let t0 = Instant::now();
        let mut cursor = ClaimCursor::new(t0);
        let walk = cursor.next_walk(t0);
        let t1 = t0 + Duration::from_millis(300);
        cursor.landed(walk, 2, &jobs(1..=2), t1);
        assert!(
            cursor
                .next_walk(t1 + Duration::from_millis(2_999))
                .from
                .is_some()
        );
        assert!(cursor.next_walk(t1 + Duration::from_secs(3)).from.is_none());
    }

    #[test]
    fn a_failed_full_walk_frees_the_slot() {
        let t0 = Instant::now();
        let mut cursor = ClaimCursor::new(t0);
        let walk = cursor.next_walk(t0);
        cursor.failed(walk, t0);
        assert_eq!(cursor.full_walks_in_flight, 0);
        assert!(cursor.next_walk(t0).from.is_none(), "no position yet");
    }
}
