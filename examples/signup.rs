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
//! only to create it.

use std::error::Error;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use skiplock::{
    EnqueueOptions, Job, JobContext, JobError, JobEventOutcome, JobEvents, JobId, Worker,
};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

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
            return Err(JobError::permanent("no Mailer on this worker"));
        };
        // Any std error converts into a retryable failure: the job runs again after a backoff.
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

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let pool = connect().await?;
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

    // The sign-up: the user row and its welcome job commit together, or neither exists.
    let email = "ada@example.com".to_owned();
    let mut tx = pool.begin().await?;
    let user_id: i64 = sqlx::query_scalar("INSERT INTO users (email) VALUES ($1) RETURNING id")
        .bind(&email)
        .fetch_one(&mut *tx)
        .await?;
    let job_id = skiplock::enqueue(
        &mut *tx,
        &SendWelcome { user_id, email },
        EnqueueOptions::new().queue("mail"),
    )
    .await?
    .id;
    tx.commit().await?;
    println!("user {user_id} signed up; job {job_id} enqueued in the same transaction");

    // A worker for the `mail` queue. A service would run it until SIGTERM; this example
    // stops it once its job has an outcome (or on Ctrl-C).
    let worker = Worker::builder(pool.clone())
        .register::<SendWelcome>()
        .queues(["mail"])
        .concurrency(8)
        .data(Mailer {
            from: "hello@example.com".to_owned(),
        })
        .build()?;
    let mut events = worker.subscribe();
    let stop = worker.shutdown_handle();
    let running = tokio::spawn(worker.run());
    let outcome = tokio::select! {
        outcome = wait_for_outcome(&mut events, job_id) => outcome,
        _ = tokio::signal::ctrl_c() => Err(format!("interrupted before job {job_id} succeeded")),
    };
    // Stop claiming, let running jobs finish within the grace period, release the rest.
    stop.shutdown();
    let summary = running.await??;
    println!(
        "worker stopped: {} claimed, {} succeeded, {} failed",
        summary.claimed, summary.succeeded, summary.failed
    );
    pool.close().await;
    // A job that did not succeed makes the example fail (exit 1), as a script would want.
    Ok(outcome?)
}

/// Waits until job `id` succeeds (`Ok`), dies or is cancelled (`Err` saying how it ended),
/// printing its retries on the way.
async fn wait_for_outcome(events: &mut JobEvents, id: JobId) -> Result<(), String> {
    while let Some(event) = events.recv().await {
        if event.id != id {
            continue;
        }
        match event.outcome {
            JobEventOutcome::Completed { took } => {
                println!("job {id} succeeded in {took:?}");
                return Ok(());
            }
            JobEventOutcome::Retried { error, retry_in } => {
                println!("job {id} failed ({error}); runs again in {retry_in:?}");
            }
            outcome => return Err(format!("job {id} did not succeed: {outcome:?}")),
        }
    }
    Err(format!("the worker stopped before job {id} had an outcome"))
}

/// The database this example may write to.
const EXAMPLE_DATABASE: &str = "skiplock_example";

/// A pool on `skiplock_example`, on the server `DATABASE_URL` points at (default: the local
/// server), created afresh first.
async fn connect() -> Result<PgPool, Box<dyn Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let server: PgConnectOptions = url.parse()?;
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(server.clone())
        .await?;
    // The example's own database, recreated at each run.
    sqlx::raw_sql("DROP DATABASE IF EXISTS skiplock_example WITH (FORCE)")
        .execute(&admin)
        .await?;
    sqlx::raw_sql("CREATE DATABASE skiplock_example")
        .execute(&admin)
        .await?;
    admin.close().await;
    Ok(PgPoolOptions::new()
        .max_connections(4)
        .connect_with(server.database(EXAMPLE_DATABASE))
        .await?)
}
