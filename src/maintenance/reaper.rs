//! The reaper: returns `running` jobs whose heartbeat went stale (a crashed, frozen or
//! cut-off worker) to `queued` with backoff, or to `dead` when their attempts are spent.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::db::jobs::{jobs_advance_lanes, jobs_reap_stale, jobs_settle_dependants};
use crate::enqueue::duration_ms;
use crate::job::JobState;
use crate::worker::{Shared, sleep_jittered};

/// Reaps every `reap_interval` (jittered) until `stop`.
pub(crate) async fn reap(shared: Arc<Shared>, stop: CancellationToken) {
    let config = &shared.config;
    let stale_after_ms = duration_ms(config.stale_after);
    let limit = config.batch_max as i64;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = sleep_jittered(config.reap_interval) => {}
        }
        loop {
            match jobs_reap_stale(&shared.pool, stale_after_ms, limit).await {
                Ok(reaped) => {
                    for job in &reaped {
                        tracing::warn!(
                            job_id = job.id,
                            holder = job.claimed_by.as_deref().unwrap_or("unknown"),
                            state = %job.state,
                            "took back a job whose heartbeat went stale"
                        );
                    }
                    let dead: Vec<i64> = reaped
                        .iter()
                        .filter(|job| job.state == JobState::Dead)
                        .map(|job| job.id)
                        .collect();
                    let lanes: Vec<String> = reaped
                        .iter()
                        .filter(|job| job.state == JobState::Dead)
                        .filter_map(|job| job.ordering_key.clone())
                        .collect();
                    // On failure the periodic sweep settles them a little later.
                    if !dead.is_empty()
                        && let Err(e) = jobs_settle_dependants(&shared.pool, &dead).await
                    {
                        tracing::warn!(error = %e, "could not settle dependants of reaped jobs");
                    }
                    if !lanes.is_empty()
                        && let Err(e) = jobs_advance_lanes(&shared.pool, &lanes).await
                    {
                        tracing::warn!(error = %e, "could not advance lanes of reaped jobs");
                    }
                    if (reaped.len() as i64) < limit {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reaper pass failed; will retry");
                    break;
                }
            }
        }
    }
}
