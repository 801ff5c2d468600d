//! The cron scheduler: turns due slots of `skiplock.cron_schedules` into jobs.
//!
//! Every worker runs it; `skiplock.internal_enqueue_cron_slots` (the function
//! `skiplock.maintain` runs too) reads the expressions, enqueues each due slot exactly once
//! however many workers call it, and records on its row why a schedule cannot produce its
//! job. Schedules defined on the worker are written when it starts
//! ([`crate::Worker::run`]).

use std::sync::Arc;
use std::time::Duration;

use crate::db::cron::cron_enqueue_due_slots;
use crate::maintenance::Maintenance;

/// Enqueues due slots every `interval`.
pub(crate) async fn schedule(context: Arc<Maintenance>, interval: Duration) {
    loop {
        match cron_enqueue_due_slots(&context.pool).await {
            Ok(0) => {}
            Ok(enqueued) => tracing::debug!(enqueued, "enqueued cron jobs"),
            Err(e) => {
                crate::metrics::maintenance_failed("cron");
                if crate::read_only::worth_a_warning(&e) {
                    tracing::warn!(error = %e, "cron pass failed; will retry");
                }
            }
        }
        tokio::select! {
            () = context.stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}
