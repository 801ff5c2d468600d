//! The cron scheduler: turns due slots of `skiplock.cron_schedules` into jobs.
//!
//! Every worker runs it; [`cron_schedules_enqueue_slot`] lets exactly one of them enqueue
//! each slot. Slots are computed from the database clock, in each schedule's time zone.

use std::sync::Arc;
use std::time::Duration;

use crate::cron::{CRON_LATE_TOLERANCE, CronExpression, CronSchedule};
use crate::db::cron::{
    CronRow, cron_schedules_enabled, cron_schedules_enqueue_slot, cron_schedules_set_error,
    cron_schedules_skip_to, cron_schedules_upsert, db_now,
};
use crate::error::{describe_sqlx, is_transient_sqlx};
use crate::maintenance::Maintenance;
use chrono::{DateTime, Utc};

/// Writes the schedules defined in code, then checks for due slots every `interval`.
pub(crate) async fn schedule(
    context: Arc<Maintenance>,
    defined: Vec<CronSchedule>,
    interval: Duration,
) {
    for schedule in &defined {
        // Validated when the worker was built.
        if let Err(e) = cron_schedules_upsert(&context.pool, &schedule.columns()).await {
            tracing::warn!(schedule = %schedule.name, error = %e, "could not save cron schedule");
        }
    }
    loop {
        if let Err(e) = tick(&context).await {
            crate::metrics::maintenance_failed("cron");
            if !crate::read_only::quiet(&e) {
                tracing::warn!(error = %e, "cron pass failed; will retry");
            }
        }
        tokio::select! {
            () = context.stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

/// One pass over the enabled schedules. Each schedule is handled on its own: one that
/// cannot produce its job (a row written by hand that the jobs table refuses, say with
/// `max_attempts = 0` or an empty queue) records why in its `last_error` and the pass goes
/// on with the others.
async fn tick(context: &Maintenance) -> sqlx::Result<()> {
    let schedules = cron_schedules_enabled(&context.pool).await?;
    if schedules.is_empty() {
        return Ok(());
    }
    let now = db_now(&context.pool).await?;
    for schedule in schedules {
        if let Err(e) = run_schedule(context, &schedule, now).await {
            if is_transient_sqlx(&e) {
                if !crate::read_only::quiet(&e) {
                    tracing::warn!(schedule = %schedule.name, error = %e, "cron schedule failed; will retry");
                }
                continue;
            }
            record_error(context, &schedule, &describe_sqlx(&e)).await;
        }
    }
    Ok(())
}

/// Enqueues the schedule's due slot, if any.
async fn run_schedule(
    context: &Maintenance,
    schedule: &CronRow,
    now: DateTime<Utc>,
) -> sqlx::Result<()> {
    let expression = match CronExpression::parse(&schedule.expression, &schedule.timezone) {
        Ok(expression) => expression,
        Err(e) => {
            record_error(context, schedule, &e.to_string()).await;
            return Ok(());
        }
    };
    if let Some(slot) = expression.due_slot(schedule.last_slot_at, now) {
        run_slot(context, schedule, slot, now).await?;
    }
    Ok(())
}

/// Records on the schedule's row why workers cannot use it (logged once per new reason).
async fn record_error(context: &Maintenance, schedule: &CronRow, error: &str) {
    if schedule.last_error.as_deref() == Some(error) {
        return;
    }
    tracing::warn!(schedule = %schedule.name, error, "cron schedule cannot produce its job; skipping it");
    if let Err(e) = cron_schedules_set_error(&context.pool, &schedule.name, error).await {
        tracing::warn!(schedule = %schedule.name, error = %e, "could not record the cron schedule's error");
    }
}

async fn run_slot(
    context: &Maintenance,
    schedule: &CronRow,
    slot: DateTime<Utc>,
    now: DateTime<Utc>,
) -> sqlx::Result<()> {
    let late = (now - slot).to_std().unwrap_or_default();
    if schedule.missed == "skip" && late > CRON_LATE_TOLERANCE {
        tracing::info!(schedule = %schedule.name, %slot, "skipping a missed cron slot");
        return cron_schedules_skip_to(&context.pool, &schedule.name, slot).await;
    }
    if let Some(job_id) = cron_schedules_enqueue_slot(&context.pool, &schedule.name, slot).await? {
        tracing::debug!(schedule = %schedule.name, %slot, job_id, "enqueued cron job");
    }
    Ok(())
}
