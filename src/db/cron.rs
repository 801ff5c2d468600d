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
    /// Why workers cannot use it (bad expression written with SQL), if so.
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
    /// `skip` or `run_once`.
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

/// The database clock.
pub async fn db_now(db: impl PgExecutor<'_>) -> sqlx::Result<DateTime<Utc>> {
    sqlx::query_scalar("SELECT now()").fetch_one(db).await
}

/// The enabled schedules.
pub async fn cron_schedules_enabled(db: impl PgExecutor<'_>) -> sqlx::Result<Vec<CronRow>> {
    sqlx::query_as(
        "SELECT name, expression, timezone, kind, args, queue, priority, max_attempts, missed,
                enabled, last_slot_at, last_job_id, last_error
         FROM skiplock.cron_schedules WHERE enabled ORDER BY name",
    )
    .fetch_all(db)
    .await
}

/// Enqueues the job of `slot` if no one did yet: the schedule's `last_slot_at` moves
/// forward only once per slot (the row lock makes a second worker wait, then find the
/// slot done), and the job is inserted in the same statement. Returns the job id, or
/// `None` if the slot was already done.
pub async fn cron_schedules_enqueue_slot(
    db: impl PgExecutor<'_>,
    name: &str,
    slot: DateTime<Utc>,
) -> sqlx::Result<Option<i64>> {
    // The job id is drawn first so the schedule can record it in the same update.
    sqlx::query_scalar(
        "WITH advanced AS (
             UPDATE skiplock.cron_schedules
             SET last_slot_at = $2, updated_at = now(), last_error = NULL,
                 last_job_id = nextval(pg_get_serial_sequence('skiplock.jobs', 'id'))
             WHERE name = $1 AND enabled AND last_slot_at < $2
             RETURNING last_job_id, kind, args, queue, priority, max_attempts
         )
         INSERT INTO skiplock.jobs (id, kind, args, queue, priority, max_attempts, scheduled_at)
         OVERRIDING SYSTEM VALUE
         SELECT last_job_id, kind, args, queue, priority, max_attempts, $2 FROM advanced
         RETURNING id",
    )
    .bind(name)
    .bind(slot)
    .fetch_optional(db)
    .await
}

/// Marks slots up to `slot` done without a job (missed-slot policy `skip`).
pub async fn cron_schedules_skip_to(
    db: impl PgExecutor<'_>,
    name: &str,
    slot: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE skiplock.cron_schedules SET last_slot_at = $2, updated_at = now()
         WHERE name = $1 AND last_slot_at < $2",
    )
    .bind(name)
    .bind(slot)
    .execute(db)
    .await?;
    Ok(())
}

/// Records why workers cannot use a schedule (a bad expression written with SQL).
pub async fn cron_schedules_set_error(
    db: impl PgExecutor<'_>,
    name: &str,
    error: &str,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE skiplock.cron_schedules SET last_error = $2, updated_at = now()
         WHERE name = $1 AND last_error IS DISTINCT FROM $2",
    )
    .bind(name)
    .bind(error)
    .execute(db)
    .await?;
    Ok(())
}
