//! The heartbeat: one statement per interval extends every claim the worker holds, and
//! stops the handlers of claims the database no longer honours (reaped or cancelled).

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::Shared;
use crate::db::jobs::jobs_heartbeat_many;

/// Beats until `stop`. Keeps going through the graceful shutdown: running jobs still need
/// their claims extended while they finish.
pub(super) async fn beat(shared: Arc<Shared>, stop: CancellationToken) {
    let mut ticker = tokio::time::interval(shared.config.heartbeat_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let (ids, tokens) = shared.claims.snapshot();
        if ids.is_empty() {
            continue;
        }
        match jobs_heartbeat_many(&shared.pool, &ids, &tokens).await {
            Ok(lost) => {
                for id in shared.claims.stop_lost(&lost) {
                    tracing::warn!(
                        job_id = id,
                        "claim lost (reaped or cancelled); stopping its handler"
                    );
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, jobs = ids.len(), "heartbeat failed; will retry next interval")
            }
        }
    }
}
