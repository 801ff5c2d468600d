//! The cron scheduler: turns due slots of `skiplock.cron_schedules` into jobs.
//!
//! Every worker runs it; [`cron_schedules_enqueue_slot`] lets exactly one of them enqueue
//! each slot. Slots are computed from the database clock, in each schedule's time zone.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use crate::cron::{CRON_LATE_TOLERANCE, CronExpression, CronSchedule};
use crate::db::cron::{
    CronRow, cron_schedules_enabled, cron_schedules_enqueue_slot, cron_schedules_set_error,
    cron_schedules_skip_to, cron_schedules_upsert, db_now,
};
use crate::worker::Shared;

/// Writes the schedules defined in code, then checks for due slots every `interval`.
pub(crate) async fn schedule(
    shared: Arc<Shared>,
    defined: Vec<CronSchedule>,
    interval: Duration,
    stop: CancellationToken,
) {
    for schedule in &defined {
        // Validated when the worker was built.
        if let Err(e) =
            cron_schedules_upsert(&shared.pool, schedule, schedule.missed.as_str()).await
        {
            tracing::warn!(schedule = %schedule.name, error = %e, "could not save cron schedule");
        }
    }
    loop {
        if let Err(e) = tick(&shared).await {
            tracing::warn!(error = %e, "cron pass failed; will retry");
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

/// One pass over the enabled schedules.
async fn tick(shared: &Shared) -> sqlx::Result<()> {
    let schedules = cron_schedules_enabled(&shared.pool).await?;
    if schedules.is_empty() {
        return Ok(());
    }
    let now = db_now(&shared.pool).await?;
    for schedule in schedules {
        let expression = match CronExpression::parse(&schedule.expression, &schedule.timezone) {
            Ok(expression) => expression,
            Err(e) => {
                if schedule.last_error.as_deref() != Some(&e.to_string()) {
                    tracing::warn!(schedule = %schedule.name, error = %e, "cron schedule is invalid; skipping it");
                    cron_schedules_set_error(&shared.pool, &schedule.name, &e.to_string()).await?;
                }
                continue;
            }
        };
        if let Some(slot) = expression.due_slot(schedule.last_slot_at, now) {
            run_slot(shared, &schedule, slot, now).await?;
        }
    }
    Ok(())
}

async fn run_slot(
    shared: &Shared,
    schedule: &CronRow,
    slot: DateTime<Utc>,
    now: DateTime<Utc>,
) -> sqlx::Result<()> {
    let late = (now - slot).to_std().unwrap_or_default();
    if schedule.missed == "skip" && late > CRON_LATE_TOLERANCE {
        tracing::info!(schedule = %schedule.name, %slot, "skipping a missed cron slot");
        return cron_schedules_skip_to(&shared.pool, &schedule.name, slot).await;
    }
    if let Some(job_id) = cron_schedules_enqueue_slot(&shared.pool, &schedule.name, slot).await? {
        tracing::debug!(schedule = %schedule.name, %slot, job_id, "enqueued cron job");
    }
    Ok(())
}
