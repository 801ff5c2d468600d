//! Statements on `skiplock.cron_schedules`.

use super::timestamp::Timestamp;
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{FromRow, PgExecutor};

/// A row of `skiplock.cron_schedules`.
#[derive(Debug, Clone, FromRow, serde::Serialize)]
#[non_exhaustive]
pub struct CronRow {
    /// Unique name.
    pub name: String,
    /// Cron expression.
    pub expression: String,
    /// IANA time zone.
    pub timezone: String,
    /// Kind of the jobs it produces.
    pub kind: String,
    /// Args of the jobs it produces.
    pub args: Json<Value>,
    /// Queue of the jobs it produces.
    pub queue: String,
    /// Priority of the jobs it produces.
    pub priority: i16,
    /// Attempt budget of the jobs it produces.
    pub max_attempts: i32,
    /// Missed-slot policy: `latest` or `skip`.
    pub missed: String,
    /// Whether workers act on it.
    pub enabled: bool,
    /// Slots up to here are done.
    #[sqlx(try_from = "Timestamp")]
    pub last_slot_at: DateTime<Utc>,
    /// The job its latest slot produced.
    pub last_job_id: Option<i64>,
    /// Why its last due slot could not produce a job (a row the jobs table refuses, such as
    /// `max_attempts = 0`, or a time zone Postgres no longer knows), if so.
    pub last_error: Option<String>,
}

/// The columns a schedule is written with (see `crate::cron::CronSchedule`, which
/// validates them first).
pub struct ScheduleColumns<'a> {
    pub name: &'a str,
    pub expression: &'a str,
    pub timezone: &'a str,
    pub kind: &'a str,
    pub args: &'a Value,
    pub queue: &'a str,
    pub priority: i16,
    pub max_attempts: i32,
    /// `latest` or `skip`.
    pub missed: &'a str,
}

/// Creates or updates a schedule.
pub async fn cron_schedules_upsert(
    db: impl PgExecutor<'_>,
    s: &ScheduleColumns<'_>,
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO skiplock.cron_schedules AS c
             (name, expression, timezone, kind, args, queue, priority, max_attempts, missed)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
         ON CONFLICT (name) DO UPDATE SET
             expression = excluded.expression, timezone = excluded.timezone,
             kind = excluded.kind, args = excluded.args, queue = excluded.queue,
             priority = excluded.priority, max_attempts = excluded.max_attempts,
             missed = excluded.missed, enabled = true, last_error = NULL, updated_at = now(),
             last_slot_at = CASE
                 WHEN (c.expression, c.timezone) IS DISTINCT FROM (excluded.expression, excluded.timezone)
                 THEN now() ELSE c.last_slot_at END",
    )
    .bind(s.name)
    .bind(s.expression)
    .bind(s.timezone)
    .bind(s.kind)
    .bind(Json(s.args))
    .bind(s.queue)
    .bind(s.priority)
    .bind(s.max_attempts)
    .bind(s.missed)
    .execute(db)
    .await?;
    Ok(())
}

/// Deletes a schedule; true if it existed.
pub async fn cron_schedules_delete(db: impl PgExecutor<'_>, name: &str) -> sqlx::Result<bool> {
    let deleted = sqlx::query("DELETE FROM skiplock.cron_schedules WHERE name = $1")
        .bind(name)
        .execute(db)
        .await?;
    Ok(deleted.rows_affected() == 1)
}

/// Every schedule, by name.
pub async fn cron_schedules_list(db: impl PgExecutor<'_>) -> sqlx::Result<Vec<CronRow>> {
    sqlx::query_as(
        "SELECT name, expression, timezone, kind, args, queue, priority, max_attempts, missed,
                enabled, last_slot_at, last_job_id, last_error
         FROM skiplock.cron_schedules ORDER BY name",
    )
    .fetch_all(db)
    .await
}

/// Enqueues the job of every due slot (`skiplock.internal_enqueue_cron_slots`); returns
/// how many.
pub async fn cron_enqueue_due_slots(db: impl PgExecutor<'_>) -> sqlx::Result<i32> {
    sqlx::query_scalar("SELECT skiplock.internal_enqueue_cron_slots()")
        .fetch_one(db)
        .await
}
