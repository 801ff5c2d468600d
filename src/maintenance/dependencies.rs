//! The dependency sweep: settles waiting jobs that the fast path missed.
//!
//! Workers settle a finished job's dependants right after saving its outcome. A child
//! enqueued in a transaction that commits *after* its parent finished is not seen by that
//! fast path (its dependency row was not yet visible), so every worker also sweeps
//! periodically: waiting jobs whose parents have all finished are queued or cancelled.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::db::jobs::jobs_settle_waiting;
use crate::worker::{Shared, sleep_jittered};

/// Sweeps every `reap_interval` (jittered) until `stop`.
pub(crate) async fn sweep(shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = sleep_jittered(shared.config.reap_interval) => {}
        }
        match jobs_settle_waiting(&shared.pool).await {
            Ok(0) => {}
            Ok(moved) => tracing::debug!(moved, "settled waiting jobs whose parents finished"),
            Err(e) => tracing::warn!(error = %e, "dependency sweep failed; will retry"),
        }
    }
}
