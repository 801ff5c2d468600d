//! The reaper: returns `running` jobs whose heartbeat went stale (a crashed, frozen or
//! cut-off worker) to `queued` with backoff, or to `dead` when their attempts are spent.
//!
//! Between full passes, paced, it looks only at the heartbeats since its previous pass
//! ([`ReapWindow`]), so a snapshot held for hours does not make every pass walk every job
//! processed meanwhile.
//!
//! It reaps in batches. When a batch statement fails for a reason a retry will not change
//! (one row the statement cannot write), it reaps the stale jobs one at a time instead,
//! and a job that still cannot be reaped goes `dead` with the reason: one row never keeps
//! the others `running` behind a dead worker.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeDelta, Utc};

use crate::db::jobs::jobs_abandon_many;
use crate::db::maintenance::{
    ReapedJob, jobs_list_stale, jobs_reap_stale, jobs_reap_stale_one, jobs_reap_stale_since,
    jobs_stale_threshold,
};
use crate::enqueue::duration_ms;
use crate::error::{describe_sqlx, is_transient_sqlx};
use crate::maintenance::Maintenance;
use crate::maintenance::dependencies::MoveOn;
use crate::pacing::sleep_jittered;

/// Full passes come at least this many reap intervals apart (a minute by default). A
/// stale job a window cannot see (its heartbeat written by hand far in the past, a row
/// skipped while locked by a holder that then rolled back, a job passed over while an
/// enqueue held its unique key) waits for the next full pass.
const FULL_PASS_EVERY_INTERVALS: u32 = 12;

/// A full pass starts no sooner than this many times the last one's duration after it
/// ended: under a held snapshot a full pass steps over every job processed since the
/// snapshot began, and its cost stays a tenth of the reaper's time at most.
const FULL_PASS_COST_FACTOR: u32 = 10;

/// The longest gap between full passes, whatever the last one cost: its cost is measured
/// by the clock, so a pass that waited behind a lock (a migration, `VACUUM FULL`) must
/// not hold the next one back for ten times that wait.
const FULL_PASS_GAP_MAX: Duration = Duration::from_secs(600);

/// How far before the previous pass's threshold a window starts. The thresholds are the
/// database's `now()` (its transaction start) and heartbeats its `clock_timestamp()`; the
/// overlap covers a statement's duration between the two.
const WINDOW_OVERLAP: TimeDelta = TimeDelta::seconds(1);

/// Where the reaper's next pass starts in heartbeat time. A pass reaps the heartbeats
/// older than its threshold (`now() - stale_after`) that it can see and lock; the next one
/// looks only from that threshold on. What a pass left below it (a row locked by a holder
/// that then rolled back, a job whose unique key an enqueue held, a heartbeat written by
/// hand far in the past) waits for the next full pass. Such a window steps over the `jobs_running_idx` entries of one reap interval
/// instead of every entry a held snapshot keeps (see [`jobs_reap_stale_since`]). Full
/// passes still run, paced, for what a window misses.
#[derive(Debug)]
struct ReapWindow {
    /// Lower bound of the next window; `None` until a pass completed.
    since: Option<DateTime<Utc>>,
    /// Earliest start of the next full pass.
    next_full: Instant,
}

impl ReapWindow {
    fn new(now: Instant) -> Self {
        Self {
            since: None,
            next_full: now,
        }
    }

    /// The lower bound of the pass starting `now`, or `None` for a full pass.
    fn bound(&self, now: Instant) -> Option<DateTime<Utc>> {
        if now >= self.next_full {
            None
        } else {
            self.since
        }
    }

    /// Records a pass that reaped everything stale in its range: from `bound` (`None`: a
    /// full pass) to `threshold`, between `started` and `ended`.
    fn completed(
        &mut self,
        bound: Option<DateTime<Utc>>,
        threshold: DateTime<Utc>,
        started: Instant,
        ended: Instant,
        interval: Duration,
    ) {
        self.since = Some(threshold - WINDOW_OVERLAP);
        if bound.is_none() {
            let cost = ended.saturating_duration_since(started);
            let gap = interval
                .saturating_mul(FULL_PASS_EVERY_INTERVALS)
                .max(cost.saturating_mul(FULL_PASS_COST_FACTOR))
                .min(FULL_PASS_GAP_MAX);
            self.next_full = ended + gap;
        }
    }
}

/// Reaps every `reap_interval` (jittered) until `stop`.
pub(crate) async fn reap(context: Arc<Maintenance>) {
    let limit = context.batch_max as i64;
    let stale_after_ms = duration_ms(context.stale_after);
    let mut window = ReapWindow::new(Instant::now());
    loop {
        tokio::select! {
            () = context.stop.cancelled() => return,
            () = sleep_jittered(context.reap_interval) => {}
        }
        let started = Instant::now();
        let bound = window.bound(started);
        let threshold = match jobs_stale_threshold(&context.pool, stale_after_ms).await {
            Ok(threshold) => threshold,
            Err(e) => {
                crate::metrics::maintenance_failed("reaper");
                tracing::warn!(error = %e, "reaper pass failed; will retry");
                continue;
            }
        };
        loop {
            let pass = match bound {
                Some(since) => {
                    jobs_reap_stale_since(&context.pool, stale_after_ms, limit, since).await
                }
                None => jobs_reap_stale(&context.pool, stale_after_ms, limit).await,
            };
            match pass {
                Ok(reaped) => {
                    crate::metrics::reaped(reaped.len());
                    follow_up(&context, &reaped).await;
                    if (reaped.len() as i64) < limit {
                        window.completed(
                            bound,
                            threshold,
                            started,
                            Instant::now(),
                            context.reap_interval,
                        );
                        break;
                    }
                }
                Err(e) if is_transient_sqlx(&e) => {
                    crate::metrics::maintenance_failed("reaper");
                    if crate::read_only::worth_a_warning(&e) {
                        tracing::warn!(error = %e, "reaper pass failed; will retry");
                    }
                    break;
                }
                Err(e) => {
                    tracing::warn!(
                        error = %describe_sqlx(&e),
                        "reaping a batch failed; reaping its jobs one at a time"
                    );
                    reap_one_by_one(&context, limit).await;
                    break;
                }
            }
        }
    }
}

/// Reaps up to `limit` stale jobs, each in its own statement; a job whose reap fails for
/// good goes `dead` with the reason.
async fn reap_one_by_one(context: &Maintenance, limit: i64) {
    let stale_after_ms = duration_ms(context.stale_after);
    let stale = match jobs_list_stale(&context.pool, stale_after_ms, limit).await {
        Ok(stale) => stale,
        Err(e) => {
            tracing::warn!(error = %e, "listing stale jobs failed; will retry");
            return;
        }
    };
    for (id, token) in stale {
        match jobs_reap_stale_one(&context.pool, stale_after_ms, id).await {
            Ok(reaped) => follow_up(context, &reaped).await,
            Err(e) if is_transient_sqlx(&e) => {
                if crate::read_only::worth_a_warning(&e) {
                    tracing::warn!(job_id = id, error = %e, "reaping a job failed; will retry");
                }
            }
            Err(e) => {
                let reason = describe_sqlx(&e);
                tracing::error!(job_id = id, error = %reason, "a stale job cannot be requeued; marking it dead with the reason");
                let message =
                    format!("taken back from a stale claim, but could not be requeued: {reason}");
                match jobs_abandon_many(&context.pool, &[id], &[token], &message).await {
                    Ok(saved) => {
                        let mut move_on = MoveOn::default();
                        saved.iter().for_each(|job| move_on.note(job));
                        move_on.run(&context.pool).await;
                    }
                    Err(e) => {
                        tracing::error!(job_id = id, error = %describe_sqlx(&e), "could not mark the stale job dead either")
                    }
                }
            }
        }
    }
}

/// Logs what was reaped and moves on the lanes and dependants of jobs that finished
/// (dead, or cancelled because a pending job took their unique key).
async fn follow_up(context: &Maintenance, reaped: &[ReapedJob]) {
    for job in reaped {
        tracing::warn!(
            job_id = job.id,
            holder = job.claimed_by.as_deref().unwrap_or("unknown"),
            state = %job.state,
            "took back a job whose heartbeat went stale"
        );
    }
    let mut move_on = MoveOn::default();
    reaped.iter().for_each(|job| move_on.note_reaped(job));
    move_on.run(&context.pool).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    const INTERVAL: Duration = Duration::from_secs(5);

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
    }

    /// The first pass is full; the ones after a completed pass start just before its
    /// threshold, until a full pass is due again, at least 12 intervals later.
    #[test]
    fn passes_are_windows_between_paced_full_passes() {
        let t0 = Instant::now();
        let mut window = ReapWindow::new(t0);
        assert_eq!(window.bound(t0), None);
        let ended = t0 + Duration::from_millis(10);
        window.completed(None, at(100), t0, ended, INTERVAL);
        let next = ended + INTERVAL;
        assert_eq!(window.bound(next), Some(at(99)));
        window.completed(Some(at(99)), at(105), next, next, INTERVAL);
        assert_eq!(window.bound(next + INTERVAL), Some(at(104)));
        // A window does not move the next full pass.
        assert_eq!(window.bound(ended + INTERVAL * 12), None);
    }

    /// A full pass that waited an hour (behind a lock) holds the next back ten minutes at
    /// most.
    #[test]
    fn the_gap_between_full_passes_is_capped() {
        let t0 = Instant::now();
        let mut window = ReapWindow::new(t0);
        let ended = t0 + Duration::from_secs(3600);
        window.completed(None, at(0), t0, ended, INTERVAL);
        assert_eq!(window.bound(ended + FULL_PASS_GAP_MAX), None);
    }

    /// A full pass that took long (a held snapshot) spaces the next by ten times its cost.
    #[test]
    fn an_expensive_full_pass_spaces_the_next_by_ten_times_its_cost() {
        let t0 = Instant::now();
        let mut window = ReapWindow::new(t0);
        let ended = t0 + Duration::from_secs(30);
        window.completed(None, at(0), t0, ended, INTERVAL);
        assert_eq!(window.bound(ended + Duration::from_secs(299)), Some(at(-1)));
        assert_eq!(window.bound(ended + Duration::from_secs(300)), None);
    }

    /// Until a pass completes there is no window: a failed first pass is retried in full.
    #[test]
    fn without_a_completed_pass_every_pass_is_full() {
        let t0 = Instant::now();
        let window = ReapWindow::new(t0 + Duration::from_secs(3600));
        assert_eq!(window.bound(t0), None);
    }
}
