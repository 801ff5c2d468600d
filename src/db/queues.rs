//! Statements on `skiplock.queues`.

use sqlx::PgExecutor;

/// Pauses a queue: workers claim nothing from it; running jobs finish.
pub async fn queues_pause(db: impl PgExecutor<'_>, name: &str) -> sqlx::Result<()> {
    sqlx::query("SELECT skiplock.pause_queue($1)")
        .bind(name)
        .execute(db)
        .await?;
    Ok(())
}

/// Resumes a queue and wakes its workers.
pub async fn queues_resume(db: impl PgExecutor<'_>, name: &str) -> sqlx::Result<()> {
    sqlx::query("SELECT skiplock.resume_queue($1)")
        .bind(name)
        .execute(db)
        .await?;
    Ok(())
}

/// Names of paused queues.
pub async fn queues_paused(db: impl PgExecutor<'_>) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar("SELECT name FROM skiplock.queues WHERE paused ORDER BY name")
        .fetch_all(db)
        .await
}

/// A queue's limits as the columns of `skiplock.queues` hold them (`None`: no limit), the
/// rates' periods in microseconds; each rate's limit and period are both set or neither.
pub struct LimitColumns {
    pub max_running: Option<i32>,
    pub rate_limit: Option<i32>,
    pub rate_period_us: Option<i64>,
    pub key_max_running: Option<i32>,
    pub key_rate_limit: Option<i32>,
    pub key_rate_period_us: Option<i64>,
    pub key_claimable: Option<i32>,
}

/// Sets a queue's global limits.
pub async fn queues_set_limits(
    db: impl PgExecutor<'_>,
    name: &str,
    limits: &LimitColumns,
) -> sqlx::Result<()> {
    sqlx::query(
        "SELECT skiplock.set_queue_limits($1, $2, $3, $4 * interval '1 microsecond', $5, $6,
                                          $7 * interval '1 microsecond', $8)",
    )
    .bind(name)
    .bind(limits.max_running)
    .bind(limits.rate_limit)
    .bind(limits.rate_period_us)
    .bind(limits.key_max_running)
    .bind(limits.key_rate_limit)
    .bind(limits.key_rate_period_us)
    .bind(limits.key_claimable)
    .execute(db)
    .await?;
    Ok(())
}

/// A row of `skiplock.queue_limits`, the period in microseconds.
#[derive(Debug, sqlx::FromRow)]
pub struct QueueLimitsRow {
    pub queue: String,
    pub paused: bool,
    pub max_running: Option<i32>,
    pub running: i64,
    pub rate_limit: Option<i32>,
    pub rate_period_us: Option<i64>,
    pub started_in_period: i64,
    pub holding_back: Option<String>,
    pub runnable: i64,
    pub held_back: i64,
    pub key_max_running: Option<i32>,
    pub keys_at_limit: Option<i64>,
    pub held_by_key: Option<i64>,
    pub key_rate_limit: Option<i32>,
    pub key_rate_period_us: Option<i64>,
    pub keys_rate_limited: Option<i64>,
    pub key_claimable: Option<i32>,
}

/// The queues with a global limit, by name: `skiplock.queue_limits`.
pub async fn queues_limits(db: impl PgExecutor<'_>) -> sqlx::Result<Vec<QueueLimitsRow>> {
    sqlx::query_as(
        "SELECT queue, paused, max_running, running, rate_limit,
                (extract(epoch FROM rate_period) * 1000000)::bigint AS rate_period_us,
                started_in_period, holding_back, runnable, held_back, key_max_running,
                keys_at_limit, held_by_key, key_rate_limit,
                (extract(epoch FROM key_rate_period) * 1000000)::bigint AS key_rate_period_us,
                keys_rate_limited, key_claimable
         FROM skiplock.queue_limits ORDER BY queue",
    )
    .fetch_all(db)
    .await
}
