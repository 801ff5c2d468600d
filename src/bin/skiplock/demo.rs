//! `skiplock demo`: enqueue a few kinds of jobs, run a worker until idle, show the states.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;
use skiplock::builtin::{Noop, Sleep};
use skiplock::embedded::{DatabaseSource, resolve_database_url};
use skiplock::{EnqueueOptions, JobState, NewJob, Worker};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// Database the demo creates (and recreates) on a local server.
const DEMO_DATABASE: &str = "skiplock_demo";

pub async fn run(explicit_url: Option<&str>) -> anyhow::Result<()> {
    let explicit = explicit_url.map(str::to_owned);
    let source = tokio::task::spawn_blocking(move || resolve_database_url(explicit.as_deref()))
        .await?
        .context("no database for the demo")?;
    let url = match &source {
        DatabaseSource::Given(url) => {
            println!("Using the database you gave.");
            url.clone()
        }
        DatabaseSource::Local(url) => {
            println!(
                "Using the local Postgres on 127.0.0.1:5432, database `{DEMO_DATABASE}` (recreated)."
            );
            recreate_database(url).await?
        }
        DatabaseSource::Embedded(server) => {
            println!(
                "No Postgres answered on 127.0.0.1:5432: started a throwaway one on port {} (removed on exit).",
                server.port()
            );
            server.url().to_owned()
        }
    };
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await
        .context("cannot connect to the demo database")?;
    let version = skiplock::migrate(&pool).await.context("migration failed")?;
    println!("Schema migrated to version {version}.\n");

    enqueue_examples(&pool).await?;

    println!(
        "\nRunning a worker (kinds noop and sleep, concurrency 16) until nothing is left to do…"
    );
    let started = Instant::now();
    let summary = Worker::builder(pool.clone())
        .register::<Noop>()
        .register::<Sleep>()
        .concurrency(16)
        .exit_when_idle(true)
        .build()?
        .run()
        .await?;
    println!(
        "Worker finished in {:.2?}: {} claimed, {} succeeded, {} failed.\n",
        started.elapsed(),
        summary.claimed,
        summary.succeeded,
        summary.failed
    );

    print_states(&pool).await?;
    println!("\nskiplock stats (SELECT * FROM skiplock.stats):");
    println!(
        "{}",
        crate::stats::render(&skiplock::stats::stats(&pool).await?)
    );
    pool.close().await;
    drop(source);
    Ok(())
}

async fn enqueue_examples(pool: &PgPool) -> anyhow::Result<()> {
    // 1. A batch of typed jobs in one statement.
    let noops = vec![Noop {}; 500];
    skiplock::enqueue_many(pool, &noops, EnqueueOptions::default()).await?;
    println!("Enqueued 500 `noop` jobs in one statement.");

    // 2. Jobs that take a while, run concurrently.
    let sleeps: Vec<Sleep> = (0..20).map(|_| Sleep { ms: 200 }).collect();
    skiplock::enqueue_many(pool, &sleeps, EnqueueOptions::default()).await?;
    println!("Enqueued 20 `sleep` jobs of 200 ms each.");

    // 3. Transactional enqueue: a rolled-back transaction leaves no job behind.
    let mut tx = pool.begin().await?;
    let ghost = skiplock::enqueue(&mut *tx, &Noop {}).await?;
    tx.rollback().await?;
    let exists = skiplock::job(pool, ghost).await?.is_some();
    println!("Enqueued job {ghost} inside a transaction, then rolled back: job exists = {exists}.");

    // 4. Plain SQL, as any language would.
    let id: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('sleep', '{\"ms\": 50}')")
        .fetch_one(pool)
        .await?;
    println!(
        "Enqueued job {id} with plain SQL: SELECT skiplock.enqueue('sleep', '{{\"ms\": 50}}')."
    );

    // 5. Bad args: the job goes `dead` with a clear error instead of retrying forever.
    let bad = skiplock::enqueue_raw(pool, &[NewJob::new("sleep", json!({"ms": "soon"}))]).await?[0];
    println!(
        "Enqueued job {bad} of kind `sleep` with args {{\"ms\": \"soon\"}} (they cannot decode)."
    );

    // 6. A kind no worker here knows: it waits, untouched.
    let unknown =
        skiplock::enqueue_raw(pool, &[NewJob::new("resize_image", json!({"w": 64}))]).await?[0];
    println!("Enqueued job {unknown} of kind `resize_image`, which this worker does not run.");

    // 7. A job scheduled for later.
    let later = skiplock::enqueue_raw(
        pool,
        &[NewJob::new("noop", json!({}))
            .with_options(EnqueueOptions::new().run_after(Duration::from_secs(3600)))],
    )
    .await?[0];
    println!("Enqueued job {later} to run in one hour.");
    Ok(())
}

async fn print_states(pool: &PgPool) -> anyhow::Result<()> {
    println!("Jobs by state (SELECT state, count(*) FROM skiplock.jobs GROUP BY state):");
    for (state, count) in skiplock::db::jobs::jobs_count_by_state(pool).await? {
        println!("  {state:<10} {count:>6}");
    }
    let dead: Vec<(i64, String, Option<String>)> = sqlx::query_as(
        "SELECT id, kind, last_error FROM skiplock.jobs WHERE state = $1 ORDER BY id",
    )
    .bind(JobState::Dead)
    .fetch_all(pool)
    .await?;
    for (id, kind, error) in dead {
        println!("  dead job {id} ({kind}): {}", error.unwrap_or_default());
    }
    Ok(())
}

/// Drops and recreates the demo database on the server behind `server_url`; returns its URL.
async fn recreate_database(server_url: &str) -> anyhow::Result<String> {
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(server_url)
        .await
        .context("cannot connect to the local Postgres")?;
    // Two statements: DROP DATABASE cannot share an implicit transaction.
    for statement in [
        "DROP DATABASE IF EXISTS skiplock_demo WITH (FORCE)",
        "CREATE DATABASE skiplock_demo",
    ] {
        sqlx::raw_sql(statement)
            .execute(&admin)
            .await
            .context("cannot recreate the demo database")?;
    }
    admin.close().await;
    let base = server_url
        .rsplit_once('/')
        .map_or(server_url, |(base, _)| base);
    Ok(format!("{base}/{DEMO_DATABASE}"))
}
