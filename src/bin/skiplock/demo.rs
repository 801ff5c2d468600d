//! `skiplock demo`: enqueue a few kinds of jobs, run a worker until idle, show the states.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;
use skiplock::JobFilter;
use skiplock::builtin::{Noop, Sleep};
use skiplock::embedded::{DatabaseSource, resolve_database_url};
use skiplock::unstable_cli::demo::{self, DEMO_DATABASE, DEMO_MARK};
use skiplock::{EnqueueOptions, JobId, JobState, NewJob, Worker};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::connect::{Database, Patience};

#[derive(clap::Args)]
pub struct DemoArgs {
    /// The database the demo creates on the server (dropping the one an earlier demo made
    /// there; never one it did not create).
    #[arg(long, value_name = "NAME", default_value = DEMO_DATABASE, value_parser = parse_database_name)]
    database: String,
}

/// A database name Postgres keeps whole: not empty, at most 63 bytes.
fn parse_database_name(text: &str) -> Result<String, String> {
    if text.is_empty() || text.len() > 63 {
        return Err(format!(
            "`{text}` cannot name a database; write 1 to 63 bytes, like skiplock_demo"
        ));
    }
    Ok(text.to_owned())
}

pub async fn run(db: &Database, args: DemoArgs) -> anyhow::Result<()> {
    let name = args.database.as_str();
    let explicit = db.url.clone();
    let source = tokio::task::spawn_blocking(move || resolve_database_url(explicit.as_deref()))
        .await?
        .context("no database for the demo")?;
    let options = match &source {
        DatabaseSource::Given(url) => {
            let given: PgConnectOptions = url
                .parse()
                .context("the database URL is malformed; expected postgres://user@host:port/db")?;
            // The server given is checked as every command checks it, with the same
            // messages (a URL that is not Postgres's, a host that does not resolve, a
            // refused login), from the database the demo will work from.
            let admin = admin_database(&given, name);
            db.pool_on(admin, "demo", 1, Patience::OneShot)
                .await?
                .pool()
                .close()
                .await;
            // Never the database given: it may hold an application's jobs and data (unless
            // it is the demo's own, which the demo recreates as ever).
            match given.get_database().unwrap_or("postgres") {
                other if other == name => {
                    outln!("Using the server you gave, database `{name}` (recreated).")
                }
                other => outln!(
                    "Using the server you gave, database `{name}` (recreated); database `{other}` is not touched."
                ),
            }
            recreate_database(&given, name).await?
        }
        DatabaseSource::Local(url) => {
            outln!("Using the local Postgres on 127.0.0.1:5432, database `{name}` (recreated).");
            recreate_database(&url.parse()?, name).await?
        }
        DatabaseSource::Embedded(server) => {
            outln!(
                "No Postgres answered on 127.0.0.1:5432: started a throwaway one on port {} (removed on exit).",
                server.port()
            );
            server.url().parse()?
        }
    };
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .context("cannot connect to the demo database")?;
    let version = skiplock::migrate(&pool).await.context("migration failed")?;
    outln!("Schema migrated to version {version}.\n");

    let expected = enqueue_examples(&pool).await?;

    outln!(
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
    outln!(
        "Worker finished in {:.2?}: {} claimed, {} succeeded, {} failed.\n",
        started.elapsed(),
        summary.claimed,
        summary.succeeded,
        summary.failed
    );

    print_states(&pool).await?;
    outln!("\nskiplock stats (SELECT * FROM skiplock.stats):");
    outln!(
        "{}",
        crate::stats::render(&skiplock::stats::stats(&pool).await?)
    );
    // The demo is also CI's run of the README's quick start: it exits 1 when its jobs did
    // not end as it says they would.
    let outcome = check_outcome(&pool, &expected).await;
    pool.close().await;
    drop(source);
    outcome
}

/// The jobs the demo enqueued and where each must end.
struct Expected {
    /// `noop` and `sleep` jobs that must succeed.
    succeed: u64,
    /// The `sleep` job whose args cannot decode: `dead`.
    bad: JobId,
    /// The job of a kind this worker does not run, and the one due in an hour: `queued`.
    waiting: [JobId; 2],
}

/// Fails unless every job ended as [`Expected`] says.
async fn check_outcome(pool: &PgPool, expected: &Expected) -> anyhow::Result<()> {
    let counts = skiplock::admin::counts_by_state(pool).await?;
    let count = |state: JobState| {
        counts
            .iter()
            .find(|(s, _)| *s == state)
            .map_or(0, |(_, n)| *n)
    };
    let want = [
        (JobState::Succeeded, i64::try_from(expected.succeed)?),
        (JobState::Dead, 1),
        (JobState::Queued, 2),
    ];
    for (state, n) in want {
        anyhow::ensure!(
            count(state) == n,
            "the demo expected {n} {state} jobs, found {} (jobs by state: {counts:?})",
            count(state)
        );
    }
    let total: i64 = counts.iter().map(|(_, n)| n).sum();
    anyhow::ensure!(
        total == want.iter().map(|(_, n)| n).sum::<i64>(),
        "the demo expected no jobs in other states (jobs by state: {counts:?})"
    );
    for (id, state) in [
        (expected.bad, JobState::Dead),
        (expected.waiting[0], JobState::Queued),
        (expected.waiting[1], JobState::Queued),
    ] {
        let found = skiplock::job(pool, id).await?.map(|job| job.state);
        anyhow::ensure!(
            found == Some(state),
            "the demo expected job {id} to be {state}, found {found:?}"
        );
    }
    Ok(())
}

async fn enqueue_examples(pool: &PgPool) -> anyhow::Result<Expected> {
    // 1. A batch of typed jobs in one statement.
    let noops = vec![Noop {}; 500];
    skiplock::enqueue_many(pool, &noops, EnqueueOptions::default()).await?;
    outln!("Enqueued 500 `noop` jobs in one statement.");

    // 2. Jobs that take a while, run concurrently.
    let sleeps: Vec<Sleep> = (0..20).map(|_| Sleep { ms: 200 }).collect();
    skiplock::enqueue_many(pool, &sleeps, EnqueueOptions::default()).await?;
    outln!("Enqueued 20 `sleep` jobs of 200 ms each.");

    // 3. Transactional enqueue: a rolled-back transaction leaves no job behind.
    let mut tx = pool.begin().await?;
    let ghost = skiplock::enqueue(&mut *tx, &Noop {}, EnqueueOptions::default())
        .await?
        .id;
    tx.rollback().await?;
    let exists = skiplock::job(pool, ghost).await?.is_some();
    outln!("Enqueued job {ghost} inside a transaction, then rolled back: job exists = {exists}.");

    // 4. Plain SQL, as any language would.
    let id = demo::jobs_enqueue_by_sql_function(pool).await?;
    outln!(
        "Enqueued job {id} with plain SQL: {}.",
        demo::ENQUEUE_BY_SQL_FUNCTION
    );

    // 5. Bad args: the job goes `dead` with a clear error instead of retrying forever.
    let bad =
        skiplock::enqueue_raw(pool, &[NewJob::new("sleep", json!({"ms": "soon"}))]).await?[0].id;
    outln!(
        "Enqueued job {bad} of kind `sleep` with args {{\"ms\": \"soon\"}} (they cannot decode)."
    );

    // 6. A kind no worker here knows: it waits, untouched.
    let unknown =
        skiplock::enqueue_raw(pool, &[NewJob::new("resize_image", json!({"w": 64}))]).await?[0].id;
    outln!("Enqueued job {unknown} of kind `resize_image`, which this worker does not run.");

    // 7. A job scheduled for later.
    let later = skiplock::enqueue_raw(
        pool,
        &[NewJob::new("noop", json!({}))
            .with_options(EnqueueOptions::new().run_after(Duration::from_secs(3600)))],
    )
    .await?[0]
        .id;
    outln!("Enqueued job {later} to run in one hour.");
    Ok(Expected {
        succeed: noops.len() as u64 + sleeps.len() as u64 + 1,
        bad,
        waiting: [unknown, later],
    })
}

async fn print_states(pool: &PgPool) -> anyhow::Result<()> {
    outln!("Jobs by state (SELECT state, count(*) FROM skiplock.jobs GROUP BY state):");
    for (state, count) in skiplock::admin::counts_by_state(pool).await? {
        outln!("  {state:<10} {count:>6}");
    }
    let dead = JobFilter {
        states: vec![JobState::Dead],
        limit: i64::MAX,
        ..JobFilter::default()
    };
    // Oldest first: the list comes newest first.
    for job in skiplock::jobs(pool, &dead).await?.into_iter().rev() {
        outln!(
            "  dead job {} ({}): {}",
            job.id,
            job.kind,
            job.last_error.unwrap_or_default()
        );
    }
    Ok(())
}

/// The database the demo works from on a server given to it: the one the URL names (or
/// the user's), except the demo's own (`demo`): a session in it would keep it from being
/// dropped, so `postgres` then.
fn admin_database<'a>(server: &'a PgConnectOptions, demo: &str) -> &'a str {
    match crate::connect::database_name(server) {
        name if name == demo => "postgres",
        name => name,
    }
}

/// Creates the demo's database `name` on the server `server` points at (after dropping the
/// one an earlier demo left) and returns the options that reach it. A database of that
/// name that the demo did not create is left alone, and the demo stops.
async fn recreate_database(
    server: &PgConnectOptions,
    name: &str,
) -> anyhow::Result<PgConnectOptions> {
    let admin_options = server.clone().database(admin_database(server, name));
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(admin_options)
        .await
        .context("cannot connect to the server for the demo")?;
    let mark = demo::demo_database_comment(&admin, name).await?;
    if let Some(found) = mark {
        let ours = found.as_deref() == Some(DEMO_MARK)
            || (found.is_none() && holds_only_skiplock(&server.clone().database(name)).await?);
        if !ours {
            anyhow::bail!(
                "the server already has a database `{name}` that skiplock demo did not create; \
                 the demo leaves it alone: drop or rename it, or give another with --database"
            );
        }
        demo::demo_database_drop(&admin, name)
            .await
            .context("cannot drop the previous demo database")?;
    }
    demo::demo_database_create(&admin, name)
        .await
        .context("cannot create the demo database; give a server where you may create databases")?;
    admin.close().await;
    Ok(server.clone().database(name))
}

/// Whether a database holds no table outside the `skiplock` schema: what a demo of an
/// earlier version (which left no mark) created.
async fn holds_only_skiplock(database: &PgConnectOptions) -> anyhow::Result<bool> {
    let mut connection = <sqlx::PgConnection as sqlx::Connection>::connect_with(database)
        .await
        .context("cannot look into the existing demo database")?;
    let others = demo::database_tables_outside_skiplock(&mut connection).await?;
    let _ = sqlx::Connection::close(connection).await;
    Ok(others == 0)
}
