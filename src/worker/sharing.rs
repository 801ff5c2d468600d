//! Sharing: whether other claimers work this worker's queues, which sets how many claims
//! its producers and how many writes its completer keep in flight.
//!
//! Alone on a queue, two of each let one statement's commit and round trip overlap the
//! next one's work. Beside other processes, each claim steps over the rows the others'
//! claims hold or just took (claim-index entries read per job grow from 2.9 with one
//! process to 18.9 with eight), and a second claim or write in flight per process adds to
//! that. So a worker that sees another claimer keeps one of each. Measured against two of
//! each always (docs/benchmarks.md, "Processes on one queue"; 5 alternating rounds,
//! Postgres and workers pinned apart): one process within the noise, 2 processes +4 to
//! +11 %, 4 +5 to +18 %, 8 +26 to +42 % (entries read per job 9.7 with eight). Alone, two
//! claims are 8–25 % faster in the drain whose worker shares the cores with Postgres.
//!
//! The signal is deterministic and read from the database: a running job of the queue
//! claimed by someone else (`skiplock.internal_others_claiming`), looked up once a
//! [`CHECK_INTERVAL`] while the worker holds claims. Another worker, a worker on the SQL
//! protocol or a claim not yet reaped all count. A failed check changes nothing.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Shared;
use crate::db::jobs::jobs_others_claiming;

/// How often the worker looks for other claimers of its queues: processes started together
/// run the first quarter second of a drain with two of each. One short statement that stops
/// at the first other claimer found (0.2 ms), or reads the worker's own running jobs when
/// it is alone (0.8 ms for 6,000): at most 0.3 % of a core.
const CHECK_INTERVAL: Duration = Duration::from_millis(250);

/// Claims a producer keeps in flight: alone on its queue, and beside other claimers.
const CLAIMS_IN_FLIGHT_ALONE: usize = 2;
const CLAIMS_IN_FLIGHT_SHARED: usize = 1;

/// Outcome batches the completer writes at once: alone, and beside other claimers.
const WRITES_IN_FLIGHT_ALONE: usize = 2;
const WRITES_IN_FLIGHT_SHARED: usize = 1;

/// Looks for other claimers of the groups' queues, all in one statement, until `stop`.
pub(super) async fn watch(shared: Arc<Shared>, stop: CancellationToken) {
    let queues: Vec<String> = shared
        .groups
        .iter()
        .map(|group| group.queue.clone())
        .collect();
    let mut ticker = tokio::time::interval(CHECK_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        // Idle, the numbers in flight do not matter; the first claims of the next burst
        // go by the last answer.
        if shared.claims.len() == 0 {
            continue;
        }
        match jobs_others_claiming(&shared.pool, &queues, &shared.config.worker_id).await {
            Ok(shared_queues) => {
                for group in &shared.groups {
                    let others = shared_queues.contains(&group.queue);
                    group.others_claiming.store(others, Ordering::Relaxed);
                }
            }
            Err(e) => tracing::debug!(
                error = %e,
                "looking for other claimers of the queues failed; keeping the last answer"
            ),
        }
    }
}

/// Claims the producer of `group` keeps in flight now.
pub(super) fn claims_in_flight(shared: &Shared, group: usize) -> usize {
    if shared.groups[group].others_claiming.load(Ordering::Relaxed) {
        CLAIMS_IN_FLIGHT_SHARED
    } else {
        CLAIMS_IN_FLIGHT_ALONE
    }
}

/// Outcome batches the completer writes at once now: one when any queue is shared.
pub(super) fn writes_in_flight(shared: &Shared) -> usize {
    if shared
        .groups
        .iter()
        .any(|group| group.others_claiming.load(Ordering::Relaxed))
    {
        WRITES_IN_FLIGHT_SHARED
    } else {
        WRITES_IN_FLIGHT_ALONE
    }
}
