//! A sign-up that sends a welcome mail: the user row and its job commit in one transaction,
//! and a worker in the same process runs the job, then stops.
//!
//! ```sh
//! cargo run --example signup
//! ```
//!
//! It needs a Postgres server: the one `DATABASE_URL` points at, or else the local one on
//! 127.0.0.1:5432 as user `postgres`. It works in a database of its own,
//! `skiplock_example`, which it creates afresh at each run (so a schema left there by an
//! older skiplock never stands in its way); the database named in `DATABASE_URL` is used
//! only to create it. It exits 1 unless its job succeeded.
//!
//! README.md shows the text between the two marker lines below, verbatim: the whole
//! program, so what a reader copies from the README compiles (`tests/readme.rs` fails when
//! the two differ).

// ---- README.md, "Use it from Rust", from here ----
use std::error::Error;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use skiplock::{EnqueueOptions, Job, JobContext, JobError, JobId, JobState, Worker};
use sqlx::postgres::{PgConnectOptions, PgPool};

/// The job. Its serde encoding is the job's `args` column: `{"user_id": 1, "email": "…"}`.
#[derive(Serialize, Deserialize)]
struct SendWelcome {
    user_id: i64,
    email: String,
}

impl Job for SendWelcome {
    /// What `skiplock.jobs.kind` says; a worker claims only kinds it registered.
    const KIND: &'static str = "send_welcome";
    /// Attempts before the job goes `dead` (default 25).
    const MAX_ATTEMPTS: i32 = 10;

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        // Shared state given to the worker with `.data(…)`.
        let Some(mailer) = ctx.data::<Mailer>() else {
            return Err(JobError::permanent("no Mailer on this worker")); // `dead` at once
        };
        // Any std error is a retryable failure: the job runs again after a backoff.
        mailer.send(&self.email, "Welcome!").await?;
        println!("welcomed user {} (attempt {})", self.user_id, ctx.attempt());
        Ok(())
    }

    /// Past this an attempt is stopped and fails as retryable (default: no limit).
    fn timeout() -> Option<Duration> {
        Some(Duration::from_secs(30))
    }
}

/// Stands in for the application's mail client.
struct Mailer {
    from: String,
}

impl Mailer {
    async fn send(&self, to: &str, subject: &str) -> std::io::Result<()> {
        println!("mail from {} to {to}: {subject}", self.from);
        Ok(())
    }
}

/// The sign-up: the user row and its welcome job commit together, or neither exists.
async fn sign_up(pool: &PgPool, email: &str) -> Result<JobId, Box<dyn Error>> {
    let mut tx = pool.begin().await?;
    let user_id: i64 = sqlx::query_scalar("INSERT INTO users (email) VALUES ($1) RETURNING id")
        .bind(email)
        .fetch_one(&mut *tx)
        .await?;
    let job = SendWelcome {
        user_id,
        email: email.to_owned(),
    };
    let enqueued = skiplock::enqueue(&mut *tx, &job, EnqueueOptions::new().queue("mail")).await?;
    tx.commit().await?;
    Ok(enqueued.id)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let pool = connect().await?; // a database of this example's own (below)
    // Creates or upgrades the `skiplock` schema; idempotent, safe from many processes.
    skiplock::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS users (
             id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             email text NOT NULL
         )",
    )
    .execute(&pool)
    .await?;

    let job_id = sign_up(&pool, "ada@example.com").await?;
    println!("job {job_id} enqueued in the sign-up's transaction");

    // A worker for the `mail` queue. A service runs it until SIGTERM (call `shutdown()` on
    // `worker.shutdown_handle()`); this one returns once nothing is left to do.
    let worker = Worker::builder(pool.clone())
        .register::<SendWelcome>()
        .queues(["mail"])
        .concurrency(8)
        .data(Mailer {
            from: "hello@example.com".to_owned(),
        })
        .exit_when_idle(true)
        .build()?;
    let running = tokio::spawn(worker.run());

    // A caller that answers with the result waits for it, woken when the outcome commits.
    let outcome = skiplock::wait_for(&pool, job_id, Duration::from_secs(30)).await?;
    let summary = running.await??;
    println!(
        "worker stopped: {} claimed, {} succeeded, {} failed",
        summary.claimed, summary.succeeded, summary.failed
    );
    pool.close().await;
    if outcome.state != JobState::Succeeded {
        return Err(format!("job {job_id} did not succeed: {outcome:?}").into());
    }
    Ok(())
}

/// A pool on `skiplock_example`, a database of this example's own, created afresh on the
/// server `DATABASE_URL` points at (default: the local one, as user `postgres`); the
/// database named in `DATABASE_URL` is used only to create it.
async fn connect() -> Result<PgPool, Box<dyn Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let server: PgConnectOptions = url.parse()?;
    let admin = PgPool::connect_with(server.clone()).await?;
    for statement in [
        "DROP DATABASE IF EXISTS skiplock_example WITH (FORCE)",
        "CREATE DATABASE skiplock_example",
    ] {
        sqlx::raw_sql(statement).execute(&admin).await?;
    }
    admin.close().await;
    Ok(PgPool::connect_with(server.database("skiplock_example")).await?)
}
// ---- README.md, "Use it from Rust", to here ----
