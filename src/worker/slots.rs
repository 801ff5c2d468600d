//! Job slots shared by a worker's queues, by weight.
//!
//! Each queue has its own producer and buffer; the queues that share the worker's
//! `concurrency` draw their slots from one [`SlotPool`]. A freed slot goes to the waiting
//! queue (one with a job in hand) that uses the smallest part of its weighted share: the
//! fewest running jobs per unit of weight. So a flood in one queue never holds the others
//! back by more than the time it takes one of its jobs to end, two queues with work split
//! the slots by their weights (equal by default), and a queue with nothing to do lends its
//! share to the others until it has work again (no slot is kept idle for it, and none is
//! taken from a running job).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;

/// Slots shared by the queues ("members") of one pool.
pub(crate) struct SlotPool {
    state: Mutex<PoolState>,
    /// Wakes a member waiting for a slot.
    wakers: Vec<Notify>,
}

struct PoolState {
    free: usize,
    running: Vec<usize>,
    weights: Vec<u32>,
    /// Members waiting for a slot with a job in hand.
    waiting: Vec<bool>,
}

impl PoolState {
    /// Whether member `a` uses less of its share than member `b`: running per weight,
    /// compared without division.
    fn before(&self, a: usize, b: usize) -> bool {
        (self.running[a] as u128) * u128::from(self.weights[b])
            < (self.running[b] as u128) * u128::from(self.weights[a])
    }

    /// Whether another waiting member should have the next slot before `member`.
    fn someone_before(&self, member: usize) -> bool {
        (0..self.running.len()).any(|m| m != member && self.waiting[m] && self.before(m, member))
    }

    /// Wakes the waiting member that should have a free slot next, if a slot is free.
    fn wake_next(&self, wakers: &[Notify]) {
        if self.free == 0 {
            return;
        }
        let next = (0..self.running.len())
            .filter(|&m| self.waiting[m])
            .reduce(|best, m| if self.before(m, best) { m } else { best });
        if let Some(member) = next {
            wakers[member].notify_one();
        }
    }
}

impl SlotPool {
    /// A pool of `slots` slots shared by members with these `weights` (each at least 1).
    pub(crate) fn new(slots: usize, weights: Vec<u32>) -> Self {
        let members = weights.len();
        Self {
            state: Mutex::new(PoolState {
                free: slots,
                running: vec![0; members],
                weights: weights.into_iter().map(|w| w.max(1)).collect(),
                waiting: vec![false; members],
            }),
            wakers: (0..members).map(|_| Notify::new()).collect(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a slot for `member`, which has a job in hand. The slot is given back when
    /// the returned [`Slot`] is dropped. Cancel-safe: a member that stops waiting no longer
    /// holds back the others.
    pub(crate) async fn acquire(self: &Arc<Self>, member: usize) -> Slot {
        loop {
            {
                let mut state = self.lock();
                if state.free > 0 && !state.someone_before(member) {
                    state.free -= 1;
                    state.running[member] += 1;
                    state.waiting[member] = false;
                    // Another slot may be free for the next in line.
                    state.wake_next(&self.wakers);
                    return Slot {
                        pool: self.clone(),
                        member,
                    };
                }
                state.waiting[member] = true;
            }
            let waiting = Waiting { pool: self, member };
            self.wakers[member].notified().await;
            // Woken: keep the place in line for the retry.
            std::mem::forget(waiting);
        }
    }

    /// Jobs of `member` running now.
    #[cfg(test)]
    fn running(&self, member: usize) -> usize {
        self.lock().running[member]
    }
}

/// A member's wait for a slot, forgotten once woken; dropped when the wait is given up
/// (shutdown), it ends the member's place in line and passes the turn on.
struct Waiting<'a> {
    pool: &'a SlotPool,
    member: usize,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut state = self.pool.lock();
        state.waiting[self.member] = false;
        state.wake_next(&self.pool.wakers);
    }
}

/// One slot held by a running job; given back to its pool when dropped.
pub(crate) struct Slot {
    pool: Arc<SlotPool>,
    member: usize,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut state = self.pool.lock();
        state.running[self.member] -= 1;
        state.free += 1;
        state.wake_next(&self.pool.wakers);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Whether `acquire` for `member` completes without waiting.
    async fn try_acquire(pool: &Arc<SlotPool>, member: usize) -> Option<Slot> {
        tokio::time::timeout(Duration::from_millis(20), pool.acquire(member))
            .await
            .ok()
    }

    #[tokio::test]
    async fn an_idle_member_lends_its_share_and_gets_the_next_slot_back() {
        let pool = Arc::new(SlotPool::new(4, vec![1, 1]));
        // Member 0 alone takes every slot: member 1 has nothing to run.
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(try_acquire(&pool, 0).await.expect("a free slot"));
        }
        assert!(try_acquire(&pool, 0).await.is_none(), "the pool is full");
        // Member 1 gets work: it waits for the next slot, and gets it before member 0.
        let one = tokio::spawn({
            let pool = pool.clone();
            async move { pool.acquire(1).await }
        });
        let zero = tokio::spawn({
            let pool = pool.clone();
            async move { pool.acquire(0).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(held.pop());
        let slot = tokio::time::timeout(Duration::from_secs(5), one)
            .await
            .expect("member 1 gets the freed slot")
            .unwrap();
        assert_eq!((pool.running(0), pool.running(1)), (3, 1));
        assert!(!zero.is_finished(), "member 0 waits for the next one");
        drop(slot);
        let _zero = tokio::time::timeout(Duration::from_secs(5), zero)
            .await
            .expect("member 0 gets the slot member 1 gave back")
            .unwrap();
    }

    #[tokio::test]
    async fn busy_members_share_the_slots_by_weight() {
        let pool = Arc::new(SlotPool::new(4, vec![3, 1]));
        let mut held: Vec<Slot> = Vec::new();
        // Both always have work; each freed slot goes to the one furthest below its share.
        held.push(try_acquire(&pool, 1).await.unwrap());
        held.push(try_acquire(&pool, 0).await.unwrap());
        held.push(try_acquire(&pool, 0).await.unwrap());
        held.push(try_acquire(&pool, 0).await.unwrap());
        for _ in 0..20 {
            let waiters = [0, 1].map(|member| {
                let pool = pool.clone();
                tokio::spawn(async move { pool.acquire(member).await })
            });
            tokio::time::sleep(Duration::from_millis(5)).await;
            // The oldest job ends.
            held.remove(0);
            let [mut zero, mut one] = waiters;
            let winner = tokio::select! {
                slot = &mut zero => {
                    one.abort();
                    let _ = one.await;
                    slot.unwrap()
                }
                slot = &mut one => {
                    zero.abort();
                    let _ = zero.await;
                    slot.unwrap()
                }
            };
            held.push(winner);
            assert_eq!((pool.running(0), pool.running(1)), (3, 1), "3:1 by weight");
        }
    }

    #[tokio::test]
    async fn a_member_that_stops_waiting_does_not_hold_the_others_back() {
        let pool = Arc::new(SlotPool::new(1, vec![1, 1]));
        let held = try_acquire(&pool, 0).await.unwrap();
        // Member 1 waits, then gives up (its worker is shutting down).
        assert!(try_acquire(&pool, 1).await.is_none());
        drop(held);
        // Member 1 is no longer in line: member 0 takes the slot.
        assert!(try_acquire(&pool, 0).await.is_some());
    }
}
