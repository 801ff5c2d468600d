//! Where the producer's next claim starts: just after the last job it claimed (a cursor
//! walk), at a key a notification or a stopped batch left owed (a walk from behind), or at
//! the left edge of the claim index (a full walk).
//!
//! A claimed job leaves its entry in `jobs_claim_idx` until no snapshot can see the row
//! as `queued`. While another transaction holds an older snapshot (a long report,
//! `pg_dump`, a forgotten `BEGIN`), a full walk steps over the entries of every job
//! claimed since, and a drain becomes quadratic (docs/benchmarks.md, "Held snapshot and big backlog"). A
//! cursor walk steps only over what other claimers took since this producer's last claim.
//!
//! Jobs can land behind the position: a higher priority, a job that waited for a parent
//! or its lane and became queued with its old `scheduled_at`, a released job, an insert
//! whose transaction committed late, a row written by hand. Every such write notifies the
//! lowest claim key it made runnable (`skiplock_runnable`, through
//! `skiplock.internal_announce`), and the
//! listener hands it here ([`ClaimCursor::notified`]): a key behind the position owes a
//! walk from that key, which steps only over the entries between it and the position. A
//! key ahead of the position needs nothing, unless a claim planned before the
//! notification is still in flight: that claim did not see the row and may move the
//! position past it, so the key is kept until it is known to be covered.
//!
//! Jobs can also come due behind the position: a retry after its delay, a snoozed job, a
//! job enqueued for later, at a higher priority than the one the producer claims from
//! when their time comes. Every write that makes jobs due later says when (within a day;
//! `skiplock_due_later`), and the due timers ([`super::due_timers`]) hand the key here
//! when it comes due by the database clock, as a notification of a job runnable now.
//! Claims planned before that moment did not take the job (it was not due) and are
//! treated as planned before a notification.
//!
//! Full walks remain, as a backstop for what no write announces or the worker did not
//! hear (an operator's `UPDATE`; a row a rolled-back transaction held locked when a claim
//! skipped it; a job written to come due more than a day later, or before the listener
//! was subscribed) and as the rule when they are cheap. They are paced by what they cost
//! beyond a cursor walk: one at a time, each
//! no sooner than a factor times its extra cost after the last one, and never held back
//! longer than a bound ([`Pacing`]). In a clean database that extra cost is about
//! nothing, and nearly every other claim is a full walk; under a held snapshot it grows
//! with every claim and full walks thin out. While notifications arrive (the listener is
//! subscribed) they are spaced far apart; without them (behind PgBouncer with no direct
//! URL to LISTEN on, or while the listener reconnects) they are the only way to find jobs
//! behind the position and stay frequent. The cost of a cursor walk is measured by the
//! cursor walks themselves: one runs at least every [`CURSOR_COST_MAX_AGE`].
//!
//! Walks pass over rows that other claims in flight hold before the lock manager sees
//! them (`skip_in_flight`), which is what makes claims of several
//! worker processes cheap. That filter can take a row for one in flight when its `xmax`
//! is a multixact (two transactions that locked it together), for as long as the number
//! looks like a running or brand-new transaction's, which on a quiet database can be
//! days. So at least every [`UNFILTERED_WALK_INTERVAL`] a full walk goes without it, and
//! so do the walks it owes when it fills its batch before the position, until one gets
//! there: everything behind the position is looked at without the filter.

use std::time::{Duration, Instant};

use crate::db::jobs::{ClaimPosition, ClaimedJob};

/// How full walks are spaced: each starts no sooner than `cost_factor` times its extra
/// cost (its duration beyond a cursor walk's) after the last one ended, so their extra
/// cost takes at most about 1/(1 + `cost_factor`) of the claim time; and no later than
/// `gap_max` after it, so one slow walk (a checkpoint, a stalled server) does not hold
/// the next back for `cost_factor` times its duration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pacing {
    cost_factor: u32,
    gap_max: Duration,
}

/// Pacing while notifications say where jobs become runnable and full walks keep costing
/// more than twice a cursor walk ([`EXPENSIVE_IN_A_ROW`] of them): the entries they step
/// over cannot be removed (a held snapshot keeps them), so each walk costs as much as the
/// last and cleans nothing, and they are only the backstop for what no write announces.
/// At 200 times its extra cost, a full walk of half a second (a million kept entries)
/// runs about once a minute and takes 0.5 % of the claim time; jobs no write announces
/// wait that long at most.
const PACING_BACKSTOP: Pacing = Pacing {
    cost_factor: 200,
    gap_max: Duration::from_secs(60),
};

/// Pacing otherwise: full walks take up to a tenth of the claim time and are never more
/// than 5 s apart. Without notifications they are the only way to find jobs that land
/// behind the position; in a clean database they also mark the entries of claimed jobs
/// dead as they pass them, which keeps the next walk cheap (spaced out further, those
/// entries pile up between vacuums and every claim index scan pays for them).
const PACING_CLEANING: Pacing = Pacing {
    cost_factor: 10,
    gap_max: Duration::from_secs(5),
};

/// Full walks in a row that cost more than twice a cursor walk before they are paced as a
/// backstop: one can be a burst or a stall; a second means the first removed nothing.
const EXPENSIVE_IN_A_ROW: u32 = 2;

/// The measured cost of a cursor walk is trusted this long; after that the next claim is
/// a cursor walk, to measure it again (at most one extra cursor walk a second when full
/// walks are cheap).
const CURSOR_COST_MAX_AGE: Duration = Duration::from_secs(1);

/// How often a full walk goes without the in-flight filter (with the walks it owes up to
/// the position), at least: what bounds how long a row the filter passes over by mistake
/// waits (module docs), with the pacing of full walks (a minute apart at most) and the
/// jobs ahead of it in claim order. It costs nothing but those walks' filter.
const UNFILTERED_WALK_INTERVAL: Duration = Duration::from_secs(30);

/// Where a walk owed by a notification or by a batch that stopped behind the position
/// starts. `Start` sorts first: it covers any key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum LookFrom {
    /// The left edge of claim order: a full walk.
    Start,
    /// Just after this key: with `id: i64::MIN`, every job of that priority and
    /// `scheduled_at`.
    After(ClaimPosition),
}

impl LookFrom {
    /// The lowest key a notification made runnable: every job with this priority and
    /// `scheduled_at`, whatever its id.
    pub(crate) fn at(priority: i16, scheduled_at_us: i64) -> Self {
        Self::After(ClaimPosition {
            priority,
            scheduled_at_us,
            id: i64::MIN,
        })
    }

    /// The earlier of two, for merging what is owed.
    pub(crate) fn min_with(self, other: Option<Self>) -> Self {
        other.map_or(self, |other| self.min(other))
    }
}

/// The producer's position in claim order, what it still owes to look at behind it, and
/// the pacing of its full walks.
#[derive(Debug)]
pub(super) struct ClaimCursor {
    /// Key of the last job claimed from the position onwards, the furthest any claim
    /// got; `None` until the first job is claimed.
    after: Option<ClaimPosition>,
    /// A walk owed from behind the position: a notified key behind it, or where a full
    /// batch from behind it stopped.
    owed: Option<LookFrom>,
    /// Notified keys at or after the position while claims planned before the
    /// notification were in flight (see [`Unsure`]).
    unsure: Option<Unsure>,
    /// Claims planned and not landed, of each kind.
    walks_in_flight: usize,
    full_walks_in_flight: usize,
    behind_walks_in_flight: usize,
    /// Claims planned so far: each walk's sequence number.
    planned: u64,
    /// Earliest start of the next paced full walk.
    next_full_walk: Instant,
    /// Smoothed duration of the cursor walks (each new one weighs a quarter), and when
    /// the last one landed; `None` until one has.
    cursor_cost: Option<(Duration, Instant)>,
    /// Full walks in a row that cost more than twice a cursor walk (the left edge is
    /// crowded with entries nothing can remove yet, a held snapshot); 0 when the last one
    /// did not.
    expensive_in_a_row: u32,
    /// Whether notifications of runnable jobs arrive (the listener is subscribed).
    notified: bool,
    /// Earliest start of the next full walk without the in-flight filter.
    next_unfiltered: Instant,
    /// Whether such a walk has started and its owed walks have not reached the position.
    unfiltered_pass: bool,
}

/// Keys notified at or after the position while claims planned before the notification
/// were in flight: such a claim did not see the rows, and when it lands it may move the
/// position past them. Settled when a claim planned after the notification walks over all
/// of them, or turned into an owed walk when the position passes the lowest.
#[derive(Debug, Clone, Copy)]
struct Unsure {
    lowest: ClaimPosition,
    highest: ClaimPosition,
    /// Claims with a sequence number from this one on were planned after the last
    /// notification merged in.
    planned_from: u64,
}

/// What kind of walk a claim makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WalkKind {
    /// From the left edge.
    Full,
    /// From an owed key behind the position.
    Behind,
    /// From the position.
    Cursor,
}

/// One claim as planned by [`ClaimCursor::next_walk`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Walk {
    /// Start after this position; `None` for a full walk.
    pub from: Option<ClaimPosition>,
    kind: WalkKind,
    /// Its sequence number among the producer's claims.
    sequence: u64,
    /// When the claim statement started: set again once it has a connection, so that a
    /// wait for the pool is not taken for the cost of the walk.
    started: Instant,
    /// Whether it passes over rows other claims in flight hold (see the module docs).
    skip_in_flight: bool,
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

    /// Whether it walks from the left edge: when it comes back empty, nothing of the
    /// queue was runnable for this worker when it started.
    pub(super) fn is_full(&self) -> bool {
        self.kind == WalkKind::Full
    }

    /// Whether the claim should pass over rows other claims in flight hold.
    pub(super) fn skips_in_flight(&self) -> bool {
        self.skip_in_flight
    }
}

/// What a landed claim says about the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Landing {
    /// It claimed as many as asked: claim again when there is room.
    More,
    /// It came back short, and a walk behind the position is owed and may run now: claim
    /// again at once.
    LookBehind,
    /// Nothing more for now. `look_behind_at`: a paced full walk is still owed (a cursor
    /// walk came back short while the pacing held full walks back) and may run then.
    Drained { look_behind_at: Option<Instant> },
}

impl ClaimCursor {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            after: None,
            owed: None,
            unsure: None,
            walks_in_flight: 0,
            full_walks_in_flight: 0,
            behind_walks_in_flight: 0,
            planned: 0,
            next_full_walk: now,
            cursor_cost: None,
            expensive_in_a_row: 0,
            notified: false,
            next_unfiltered: now,
            unfiltered_pass: false,
        }
    }

    /// Says whether notifications of runnable jobs arrive, which sets the pacing of the
    /// full walks from the next one on.
    pub(super) fn set_notified(&mut self, notified: bool, now: Instant) {
        if self.notified && !notified {
            // Paced for notifications that no longer come: not later than without them.
            self.next_full_walk = self.next_full_walk.min(now + PACING_CLEANING.gap_max);
        }
        self.notified = notified;
    }

    fn pacing(&self) -> Pacing {
        if self.notified && self.expensive_in_a_row >= EXPENSIVE_IN_A_ROW {
            PACING_BACKSTOP
        } else {
            PACING_CLEANING
        }
    }

    /// Takes in a notification: jobs became runnable from `from` on (or anywhere, for
    /// [`LookFrom::Start`]) in a transaction that has committed.
    pub(super) fn notified(&mut self, from: LookFrom) {
        let key = match from {
            LookFrom::Start => {
                self.owe(LookFrom::Start);
                return;
            }
            LookFrom::After(key) => key,
        };
        if self.after.is_some_and(|after| key < after) {
            self.owe(from);
        } else if self.walks_in_flight > 0 {
            self.unsure = Some(match self.unsure {
                Some(unsure) => Unsure {
                    lowest: unsure.lowest.min(key),
                    highest: unsure.highest.max(key),
                    planned_from: self.planned + 1,
                },
                None => Unsure {
                    lowest: key,
                    highest: key,
                    planned_from: self.planned + 1,
                },
            });
        }
        // Otherwise the next claim starts at or before the key, and it sees the rows.
    }

    fn owe(&mut self, from: LookFrom) {
        self.owed = Some(from.min_with(self.owed));
    }

    /// The owed walk, if one may start now (one of each kind at a time).
    fn owed_walk_ready(&self) -> Option<LookFrom> {
        match self.owed? {
            LookFrom::Start => (self.full_walks_in_flight == 0).then_some(LookFrom::Start),
            after => (self.behind_walks_in_flight == 0).then_some(after),
        }
    }

    /// Whether a paced full walk may start now.
    fn full_walk_allowed(&self, now: Instant) -> bool {
        self.full_walks_in_flight == 0 && now >= self.next_full_walk
    }

    /// Whether the cost of a cursor walk is unknown or too old to pace full walks by.
    fn cursor_cost_stale(&self, now: Instant) -> bool {
        self.cursor_cost
            .is_none_or(|(_, at)| now.saturating_duration_since(at) >= CURSOR_COST_MAX_AGE)
    }

    /// Plans the next claim: a full walk when no position is known; an owed walk when
    /// one may start; a paced full walk when the pacing allows one (and the cost of a
    /// cursor walk is known); a cursor walk otherwise.
    pub(super) fn next_walk(&mut self, now: Instant) -> Walk {
        let (kind, from) = if self.after.is_none() {
            // It walks everything, after whatever was owed.
            self.owed = None;
            (WalkKind::Full, None)
        } else if let Some(owed) = self.owed_walk_ready() {
            self.owed = None;
            match owed {
                LookFrom::Start => (WalkKind::Full, None),
                LookFrom::After(key) => (WalkKind::Behind, Some(key)),
            }
        } else if self.full_walk_allowed(now) && !self.cursor_cost_stale(now) {
            (WalkKind::Full, None)
        } else {
            (WalkKind::Cursor, self.after)
        };
        self.walks_in_flight += 1;
        match kind {
            WalkKind::Full => self.full_walks_in_flight += 1,
            WalkKind::Behind => self.behind_walks_in_flight += 1,
            WalkKind::Cursor => {}
        }
        self.planned += 1;
        let skip_in_flight = match kind {
            WalkKind::Full if self.unfiltered_pass || now >= self.next_unfiltered => {
                self.unfiltered_pass = true;
                false
            }
            WalkKind::Behind => !self.unfiltered_pass,
            WalkKind::Full | WalkKind::Cursor => true,
        };
        Walk {
            from,
            kind,
            sequence: self.planned,
            started: now,
            skip_in_flight,
        }
    }

    fn walk_ended(&mut self, walk: &Walk) {
        self.walks_in_flight = self.walks_in_flight.saturating_sub(1);
        match walk.kind {
            WalkKind::Full => {
                self.full_walks_in_flight = self.full_walks_in_flight.saturating_sub(1);
            }
            WalkKind::Behind => {
                self.behind_walks_in_flight = self.behind_walks_in_flight.saturating_sub(1);
            }
            WalkKind::Cursor => {}
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
        self.walk_ended(&walk);
        match walk.kind {
            WalkKind::Full => self.full_walk_ended(walk, now),
            WalkKind::Behind => {}
            WalkKind::Cursor => self.cursor_walk_ended(walk, now),
        }
        let last = jobs.last().map(ClaimedJob::position);
        let full = jobs.len() >= limit;
        let stopped_behind = match (walk.kind, last, self.after) {
            // A full batch from behind the position stopped behind it: there may be more
            // between there and the position.
            (WalkKind::Full | WalkKind::Behind, Some(last), Some(after))
                if full && last < after =>
            {
                self.owe(LookFrom::After(last));
                true
            }
            _ => {
                self.after = self.after.max(last);
                false
            }
        };
        if !walk.skip_in_flight && !stopped_behind {
            // The unfiltered pass got to the position.
            self.unfiltered_pass = false;
            self.next_unfiltered = now + UNFILTERED_WALK_INTERVAL;
        }
        self.settle_unsure(&walk, last, full);
        if full {
            Landing::More
        } else if self.owed_walk_ready().is_some() {
            Landing::LookBehind
        } else if walk.kind != WalkKind::Cursor || self.owed.is_some() {
            // A short walk from behind took everything from its start on; an owed walk
            // waits for the one of its kind in flight, whose landing asks for it.
            Landing::Drained {
                look_behind_at: None,
            }
        } else if self.full_walk_allowed(now) {
            Landing::LookBehind
        } else {
            Landing::Drained {
                look_behind_at: (self.full_walks_in_flight == 0).then_some(self.next_full_walk),
            }
        }
    }

    /// Settles the notified keys a landed claim covers, or owes a walk for them if the
    /// position passed them.
    fn settle_unsure(&mut self, walk: &Walk, last: Option<ClaimPosition>, full: bool) {
        let Some(unsure) = self.unsure else {
            return;
        };
        let walked_over = walk.sequence >= unsure.planned_from
            && walk.from.is_none_or(|from| from < unsure.lowest)
            && (!full || last.is_some_and(|last| last >= unsure.highest));
        if walked_over {
            self.unsure = None;
        } else if self.after.is_some_and(|after| after > unsure.lowest) {
            self.owe(LookFrom::After(unsure.lowest));
            self.unsure = None;
        } else if self.walks_in_flight == 0 {
            // Everything planned before the notification has landed without passing the
            // keys: the next claim starts at or before them.
            self.unsure = None;
        }
    }

    /// Takes in a claim that failed. Its duration says nothing about the cost of a walk
    /// (it may have waited for a timeout), so it does not pace the next full walk; what
    /// it was to look at is owed again.
    pub(super) fn failed(&mut self, walk: Walk) {
        self.walk_ended(&walk);
        match walk.kind {
            WalkKind::Full if self.after.is_some() => self.owe(LookFrom::Start),
            WalkKind::Behind => {
                if let Some(from) = walk.from {
                    self.owe(LookFrom::After(from));
                }
            }
            _ => {}
        }
        self.settle_unsure(&walk, None, true);
    }

    fn full_walk_ended(&mut self, walk: Walk, now: Instant) {
        let cost = now.saturating_duration_since(walk.started);
        let cursor = self.cursor_cost.map_or(cost, |(cursor, _)| cursor);
        let extra = cost.saturating_sub(cursor);
        self.expensive_in_a_row = if extra > cursor {
            self.expensive_in_a_row.saturating_add(1)
        } else {
            0
        };
        let pacing = self.pacing();
        self.next_full_walk = now + (extra * pacing.cost_factor).min(pacing.gap_max);
    }

    /// How many of `room` free buffer places a claim planned as `walk` should ask for.
    ///
    /// An expensive walk from behind runs for a while (a quarter of a second with a
    /// million entries behind the position), and the room a claim asks for is reserved
    /// until it lands: with all of it reserved, no cursor walk could start beside it, and
    /// new jobs would wait for it. Such a walk looks for the few jobs that landed behind
    /// the position, so it asks for a quarter of the room; if it fills that, a walk from
    /// where it stopped is owed, and cursor walks take new jobs beside it.
    pub(super) fn claim_limit(&self, walk: &Walk, room: usize) -> usize {
        if walk.kind != WalkKind::Cursor && self.expensive_in_a_row > 0 {
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
            traceparent: None,
            tracestate: None,
            key_limited: false,
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
        let t3 = t2 + PACING_CLEANING.gap_max - 10 * MS;
        let probe = cursor.next_walk(t3);
        assert!(probe.from.is_some(), "the cursor cost is seconds old");
        cursor.landed(probe, 1, &jobs(6..=6), t3 + MS);
        assert!(cursor.next_walk(t3 + MS).from.is_some(), "still paced");
        assert_eq!(cursor.next_walk(t2 + PACING_CLEANING.gap_max).from, None);
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
        assert!(full.is_full());
        // Jobs 1 and 2 landed behind position 13 (say, a higher priority); the batch was
        // full, so there may be more there.
        assert_eq!(
            cursor.landed(full, 2, &jobs(1..=2), t0 + 2 * MS),
            Landing::More
        );
        let behind = cursor.next_walk(t0 + 2 * MS);
        assert_eq!(behind.kind, WalkKind::Behind);
        assert_eq!(behind.from.map(|p| p.id), Some(2));
        // Beside it, the position is where the furthest claim got.
        let beside = cursor.next_walk(t0 + 2 * MS);
        assert!(beside.is_full(), "cheap full walks are still the rule");
        let third = cursor.next_walk(t0 + 2 * MS);
        assert_eq!(third.from.map(|p| p.id), Some(13));
        // The walk from behind comes back short: it took everything from 2 on.
        assert_eq!(
            cursor.landed(behind, 2, &jobs(3..=3), t0 + 3 * MS),
            Landing::Drained {
                look_behind_at: None
            }
        );
        assert_eq!(cursor.after.map(|p| p.id), Some(13));
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

    fn key(priority: i16, scheduled_at_us: i64) -> LookFrom {
        LookFrom::at(priority, scheduled_at_us)
    }

    /// A notified cursor at position 3 (scheduled at 1,000 µs) with nothing in flight.
    fn notified_at_3(t0: Instant) -> (ClaimCursor, Instant) {
        let (mut cursor, t1) = warmed_up(t0, MS);
        cursor.set_notified(true, t0);
        (cursor, t1)
    }

    #[test]
    fn a_key_notified_behind_the_position_owes_a_walk_from_it() {
        let t0 = Instant::now();
        let (mut cursor, t1) = notified_at_3(t0);
        cursor.notified(key(-1, 5_000));
        let walk = cursor.next_walk(t1);
        assert_eq!(walk.kind, WalkKind::Behind);
        assert_eq!(
            walk.from,
            Some(ClaimPosition {
                priority: -1,
                scheduled_at_us: 5_000,
                id: i64::MIN
            }),
            "every job of that priority and time, whatever its id"
        );
        assert_eq!(
            cursor.claim_limit(&walk, 40),
            40,
            "full walks are cheap here"
        );
        let next = cursor.next_walk(t1);
        assert_ne!(
            next.kind,
            WalkKind::Behind,
            "one walk from behind at a time"
        );
    }

    #[test]
    fn a_key_notified_ahead_of_an_idle_cursor_needs_nothing() {
        let t0 = Instant::now();
        let (mut cursor, t1) = notified_at_3(t0);
        cursor.notified(key(0, 2_000));
        assert!(cursor.owed.is_none() && cursor.unsure.is_none());
        let walk = cursor.next_walk(t1);
        assert_ne!(walk.kind, WalkKind::Behind);
    }

    #[test]
    fn a_key_passed_by_a_claim_planned_before_its_notification_is_owed() {
        let t0 = Instant::now();
        let (mut cursor, t1) = notified_at_3(t0);
        let t = t1 + CURSOR_COST_MAX_AGE;
        let before = cursor.next_walk(t);
        assert_eq!(before.kind, WalkKind::Cursor);
        // A job at 2,000 µs commits: ahead of position 3, but the claim in flight did not
        // see it and lands past it.
        cursor.notified(key(0, 2_000));
        let mut past = job(50);
        past.scheduled_at_us = 3_000;
        assert_eq!(
            cursor.landed(before, 5, &[past], t + MS),
            Landing::LookBehind
        );
        let walk = cursor.next_walk(t + MS);
        assert_eq!(walk.kind, WalkKind::Behind);
        assert_eq!(walk.from.map(|p| p.scheduled_at_us), Some(2_000));
    }

    #[test]
    fn a_key_walked_over_by_a_claim_planned_after_its_notification_is_settled() {
        let t0 = Instant::now();
        let (mut cursor, t1) = notified_at_3(t0);
        let t = t1 + CURSOR_COST_MAX_AGE;
        let before = cursor.next_walk(t);
        cursor.notified(key(0, 2_000));
        let after = cursor.next_walk(t);
        assert_eq!(after.kind, WalkKind::Cursor);
        // The later claim took the job (short: everything from the position on); the
        // earlier one lands past the key afterwards.
        let mut taken = job(40);
        taken.scheduled_at_us = 2_000;
        cursor.landed(after, 5, &[taken], t + MS);
        let mut past = job(50);
        past.scheduled_at_us = 3_000;
        cursor.landed(before, 5, &[past], t + 2 * MS);
        assert!(cursor.owed.is_none(), "{cursor:?}");
        assert!(cursor.unsure.is_none());
    }

    #[test]
    fn a_key_stays_unsure_while_a_full_batch_stops_short_of_it() {
        let t0 = Instant::now();
        let (mut cursor, t1) = notified_at_3(t0);
        let t = t1 + CURSOR_COST_MAX_AGE;
        let before = cursor.next_walk(t);
        cursor.notified(key(0, 9_000));
        let after = cursor.next_walk(t);
        // The later claim filled its batch before the key: it did not walk over it.
        cursor.landed(after, 1, &jobs(4..=4), t + MS);
        assert!(cursor.unsure.is_some());
        let mut past = job(50);
        past.scheduled_at_us = 10_000;
        cursor.landed(before, 5, &[past], t + 2 * MS);
        assert_eq!(cursor.owed, Some(key(0, 9_000)));
    }

    #[test]
    fn a_notified_start_owes_a_full_walk_whatever_the_pacing() {
        let t0 = Instant::now();
        let (mut cursor, t1) = notified_at_3(t0);
        let full = cursor.next_walk(t1);
        assert!(full.is_full());
        cursor.landed(full, 2, &[], t1 + 500 * MS);
        assert!(!cursor.full_walk_allowed(t1 + Duration::from_secs(1)));
        cursor.notified(LookFrom::Start);
        assert!(cursor.next_walk(t1 + Duration::from_secs(1)).is_full());
    }

    /// Runs a full walk costing `cost` at `t` after measuring a 1 ms cursor walk just
    /// before it; returns when it landed.
    fn full_walk_costing(cursor: &mut ClaimCursor, t: Instant, cost: Duration) -> Instant {
        let probe = cursor.next_walk(t);
        assert_eq!(
            probe.kind,
            WalkKind::Cursor,
            "the cursor cost is measured first"
        );
        cursor.landed(probe, 2, &[], t + MS);
        let full = cursor.next_walk(t + MS);
        assert!(full.is_full());
        cursor.landed(full, 2, &[], t + MS + cost);
        t + MS + cost
    }

    #[test]
    fn notified_full_walks_that_stay_expensive_are_spaced_by_200_times_their_extra_cost() {
        let t0 = Instant::now();
        let (mut cursor, t1) = notified_at_3(t0);
        // 101 ms against 1 ms: 100 ms extra. The first expensive walk may have been a
        // burst: the next one 1 s later (10x).
        let t2 = full_walk_costing(&mut cursor, t1 + CURSOR_COST_MAX_AGE, 101 * MS);
        assert!(!cursor.full_walk_allowed(t2 + 999 * MS));
        assert!(cursor.full_walk_allowed(t2 + Duration::from_secs(1)));
        // The second in a row removed nothing: 20 s until the next one (200x).
        let t3 = full_walk_costing(&mut cursor, t2 + Duration::from_secs(1), 101 * MS);
        assert!(!cursor.full_walk_allowed(t3 + Duration::from_secs(19)));
        assert!(cursor.full_walk_allowed(t3 + Duration::from_secs(20)));
        // A 2 s walk would space the next by 400 s: a minute at most.
        let t4 = full_walk_costing(&mut cursor, t3 + Duration::from_secs(20), 2001 * MS);
        assert!(!cursor.full_walk_allowed(t4 + Duration::from_secs(59)));
        assert!(cursor.full_walk_allowed(t4 + PACING_BACKSTOP.gap_max));
        // A cheap one (the snapshot was let go) brings the 10x pacing back.
        let t5 = full_walk_costing(&mut cursor, t4 + PACING_BACKSTOP.gap_max, MS);
        let t6 = full_walk_costing(&mut cursor, t5 + CURSOR_COST_MAX_AGE, 101 * MS);
        assert!(cursor.full_walk_allowed(t6 + Duration::from_secs(1)));
    }

    #[test]
    fn without_notifications_expensive_full_walks_stay_within_5_s() {
        let t0 = Instant::now();
        let (mut cursor, t1) = warmed_up(t0, MS);
        let t2 = full_walk_costing(&mut cursor, t1 + CURSOR_COST_MAX_AGE, 101 * MS);
        let t3 = full_walk_costing(&mut cursor, t2 + Duration::from_secs(1), 2001 * MS);
        assert!(cursor.full_walk_allowed(t3 + PACING_CLEANING.gap_max));
    }

    #[test]
    fn a_failed_walk_from_behind_is_owed_again() {
        let t0 = Instant::now();
        let (mut cursor, t1) = notified_at_3(t0);
        cursor.notified(key(-1, 5_000));
        let walk = cursor.next_walk(t1);
        assert_eq!(walk.kind, WalkKind::Behind);
        cursor.failed(walk);
        let again = cursor.next_walk(t1 + MS);
        assert_eq!(again.kind, WalkKind::Behind);
        assert_eq!(again.from, walk.from);
    }

    #[test]
    fn a_look_from_the_start_before_any_job_is_taken_by_the_first_full_walk() {
        let t0 = Instant::now();
        let mut cursor = ClaimCursor::new(t0);
        cursor.set_notified(true, t0);
        cursor.notified(LookFrom::Start);
        let walk = cursor.next_walk(t0);
        assert!(walk.is_full());
        // An empty queue: nothing owed is left, so the producer waits instead of walking
        // again at once.
        assert_eq!(
            cursor.landed(walk, 10, &[], t0 + MS),
            Landing::Drained {
                look_behind_at: None
            }
        );
    }

    #[test]
    fn full_walks_paced_for_notifications_come_within_5_s_once_they_stop() {
        let t0 = Instant::now();
        let (mut cursor, t1) = notified_at_3(t0);
        let t2 = full_walk_costing(&mut cursor, t1 + CURSOR_COST_MAX_AGE, 101 * MS);
        let t3 = full_walk_costing(&mut cursor, t2 + Duration::from_secs(1), 101 * MS);
        assert!(!cursor.full_walk_allowed(t3 + Duration::from_secs(10)));
        cursor.set_notified(false, t3);
        assert!(cursor.full_walk_allowed(t3 + PACING_CLEANING.gap_max));
    }

    #[test]
    fn a_full_walk_goes_without_the_in_flight_filter_every_30_s() {
        let t0 = Instant::now();
        let mut cursor = ClaimCursor::new(t0);
        let first = cursor.next_walk(t0);
        assert!(
            first.is_full() && !first.skips_in_flight(),
            "the first walk"
        );
        cursor.landed(first, 2, &jobs(1..=2), t0);
        let mut t = t0;
        let mut id = 3;
        while t < t0 + UNFILTERED_WALK_INTERVAL {
            let walk = cursor.next_walk(t);
            assert!(walk.skips_in_flight(), "{:?} after: {walk:?}", t - t0);
            cursor.landed(walk, 1, &jobs(id..=id), t + MS);
            id += 1;
            t += 100 * MS;
        }
        let mut walk = cursor.next_walk(t);
        while !walk.is_full() {
            assert!(walk.skips_in_flight(), "a cursor walk always filters");
            cursor.landed(walk, 1, &jobs(id..=id), t + MS);
            id += 1;
            t += 100 * MS;
            walk = cursor.next_walk(t);
        }
        assert!(!walk.skips_in_flight(), "the first full walk 30 s on");
        cursor.landed(walk, 1, &jobs(id..=id), t + MS);
        let walk = cursor.next_walk(t + Duration::from_secs(1));
        assert!(walk.skips_in_flight(), "filtered again after it");
    }

    #[test]
    fn the_unfiltered_pass_goes_on_behind_until_it_reaches_the_position() {
        let t0 = Instant::now();
        let (mut cursor, t1) = warmed_up(t0, MS);
        let mut t = t1 + UNFILTERED_WALK_INTERVAL;
        // The position is at job 3 (claim key of ids 1..=3 at one time); make it 100.
        let walk = cursor.next_walk(t);
        cursor.landed(walk, 1, &jobs(100..=100), t + MS);
        t += 2 * MS;
        let mut walk = cursor.next_walk(t);
        while !walk.is_full() {
            cursor.landed(walk, 1, &jobs(101..=101), t + MS);
            t += 100 * MS;
            walk = cursor.next_walk(t);
        }
        assert!(!walk.skips_in_flight(), "due: {walk:?}");
        // It fills its batch behind the position: the walk it owes goes on unfiltered.
        assert_eq!(cursor.landed(walk, 2, &jobs(4..=5), t + MS), Landing::More);
        let behind = cursor.next_walk(t + MS);
        assert_eq!(behind.from.map(|p| p.id), Some(5));
        assert!(!behind.skips_in_flight(), "the pass goes on: {behind:?}");
        // A walk beside it filters if it is a cursor walk; a full walk is part of the pass.
        let beside = cursor.next_walk(t + MS);
        assert_eq!(beside.skips_in_flight(), !beside.is_full(), "{beside:?}");
        cursor.landed(beside, 1, &jobs(102..=102), t + 2 * MS);
        // Short: it got to the position, and the pass is over.
        cursor.landed(behind, 10, &jobs(6..=7), t + 2 * MS);
        let mut t = t + 3 * MS;
        for _ in 0..50 {
            let walk = cursor.next_walk(t);
            assert!(walk.skips_in_flight(), "after the pass: {walk:?}");
            cursor.landed(walk, 1, &jobs(200..=200), t + MS);
            t += 100 * MS;
        }
    }
}
