//! The fault tests' own table, `public.testbed_runs`, where the `skiplock-testbed` worker
//! records every execution of a job (feature `testbed`). Not part of skiplock's schema.

use chrono::{DateTime, Utc};
use sqlx::{PgExecutor, PgPool};

/// Creates `public.testbed_runs` unless it exists. Several testbeds may start at once: an
/// advisory lock serialises them (`CREATE TABLE IF NOT EXISTS` alone can fail on a
/// concurrent creator's catalog row).
pub async fn testbed_runs_create(pool: &PgPool) -> sqlx::Result<()> {
    let mut tx = pool.begin().await?;
    // "testbed" in ASCII: serialises concurrent creators.
    sqlx::query("SELECT pg_advisory_xact_lock(x'74657374626564'::bigint)")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS public.testbed_runs (
             seq         bigserial PRIMARY KEY,
             job_id      bigint      NOT NULL,
             attempt     int         NOT NULL,
             pid         int         NOT NULL,
             worker_id   text        NOT NULL,
             local_clock timestamptz NOT NULL,
             db_clock    timestamptz NOT NULL DEFAULT clock_timestamp()
         )",
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// Records one execution of job `job_id` (its attempt `attempt`) by the testbed process
/// `pid` / `worker_id`, with that process's clock reading `local_clock` (the database adds
/// its own, `db_clock`, for the clock-skew tests).
pub async fn testbed_runs_insert(
    db: impl PgExecutor<'_>,
    job_id: i64,
    attempt: i32,
    pid: i32,
    worker_id: &str,
    local_clock: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO public.testbed_runs (job_id, attempt, pid, worker_id, local_clock)
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(job_id)
    .bind(attempt)
    .bind(pid)
    .bind(worker_id)
    .bind(local_clock)
    .execute(db)
    .await?;
    Ok(())
}
