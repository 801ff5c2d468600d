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
