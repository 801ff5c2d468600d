//! The complete example of `docs/testing-your-jobs.md`, run as it is printed there, and
//! checks of `skiplock::testing` that the guide promises. The guide shows the text between
//! the two marker lines below, verbatim; `the_guide_shows_this_example` fails when the two
//! differ, so a change to one is a change to both.
#![cfg(feature = "testing")]

// ---- docs/testing-your-jobs.md, "A complete example", from here ----
use serde::{Deserialize, Serialize};
use serde_json::json;
use skiplock::testing::{Enqueued, assert_enqueued, drain_queue, perform_job, refute_enqueued};
use skiplock::{EnqueueOptions, Job, JobContext, JobError, JobEventOutcome, JobState, Worker};
use sqlx::{Connection, PgConnection, PgPool};
use std::time::Duration;

/// Sends a welcome mail; fails while the mailer is down.
#[derive(Serialize, Deserialize)]
struct SendWelcome {
    user_id: i64,
}

/// What the handlers share: here, whether the mail server is up.
#[derive(Clone)]
struct Mailer {
    up: bool,
}

impl Job for SendWelcome {
    const KIND: &'static str = "send_welcome";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let mailer = ctx.data::<Mailer>().expect("a Mailer");
        if !mailer.up {
            return Err(JobError::retry("mail server unreachable"));
        }
        Ok(())
    }

    /// A mail server that is down stays down a while: try again in ten minutes.
    fn retry_delay(_attempt: i32) -> Duration {
        Duration::from_secs(600)
    }
}

/// The application code under test: a user row and its welcome mail, in one transaction.
async fn sign_up(pool: &PgPool, name: &str) -> Result<i64, Box<dyn std::error::Error>> {
    let mut tx = pool.begin().await?;
    let user_id: i64 = sqlx::query_scalar("INSERT INTO users (name) VALUES ($1) RETURNING id")
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
    let options = EnqueueOptions::new().queue("mail");
    skiplock::enqueue(&mut *tx, &SendWelcome { user_id }, options).await?;
    tx.commit().await?;
    Ok(user_id)
}

#[tokio::test]
async fn signing_up_sends_one_welcome_mail() -> Result<(), Box<dyn std::error::Error>> {
    // A database of this test's own.
    let server = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let name = format!("skiplock_guide_{:08x}", std::process::id());
    let mut admin = PgConnection::connect(&server).await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await?;
    let options: sqlx::postgres::PgConnectOptions = server.parse()?;
    let pool = PgPool::connect_with(options.database(&name)).await?;
    skiplock::migrate(&pool).await?;
    sqlx::query("CREATE TABLE users (id bigserial PRIMARY KEY, name text NOT NULL)")
        .execute(&pool)
        .await?;

    // Signing up enqueues exactly one welcome mail, for that user, in the mail queue.
    let user_id = sign_up(&pool, "ada").await?;
    let welcome = Enqueued::of::<SendWelcome>()
        .args(json!({ "user_id": user_id }))
        .queue("mail");
    let jobs = assert_enqueued(&pool, &welcome).await;
    assert_eq!(jobs.len(), 1);
    refute_enqueued(&pool, &Enqueued::of::<SendWelcome>().queue("default")).await;

    // With the mail server down, the attempt fails and the job is retried later.
    let down = Worker::builder(pool.clone())
        .register::<SendWelcome>()
        .data(Mailer { up: false });
    let event = perform_job(down, jobs[0].id).await?;
    assert!(
        matches!(event.outcome, JobEventOutcome::Retried { .. }),
        "{event:?}"
    );

    // A second sign-up, then the queue drained with the mail server up: the new job runs;
    // the retried one waits out its ten minutes, so it is not runnable yet.
    sign_up(&pool, "grace").await?;
    let up = Worker::builder(pool.clone())
        .register::<SendWelcome>()
        .data(Mailer { up: true });
    let events = drain_queue(up, "mail").await?;
    assert_eq!(events.len(), 1);
    assert!(matches!(
        events[0].outcome,
        JobEventOutcome::Completed { .. }
    ));
    let done = Enqueued::of::<SendWelcome>().in_states(&[JobState::Succeeded]);
    assert_eq!(assert_enqueued(&pool, &done).await.len(), 1);

    pool.close().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {name}")))
        .execute(&mut admin)
        .await?;
    Ok(())
}
// ---- docs/testing-your-jobs.md, "A complete example", to here ----

mod common;
mod verbatim;

/// The guide's example is this file's text between the marker lines, to the byte.
#[test]
fn the_guide_shows_this_example() {
    verbatim::assert_shows(
        "docs/testing-your-jobs.md",
        include_str!("../docs/testing-your-jobs.md"),
        "A complete example",
        "tests/testing_guide.rs",
        include_str!("testing_guide.rs"),
    );
}

/// The message of a panic raised inside `future`, run on a task of its own.
async fn panic_message(future: impl Future<Output = ()> + Send + 'static) -> String {
    let panic = tokio::spawn(future)
        .await
        .expect_err("the assertion fails")
        .into_panic();
    match panic.downcast::<String>() {
        Ok(message) => *message,
        Err(panic) => panic
            .downcast::<&str>()
            .map(|message| (*message).to_owned())
            .unwrap_or_default(),
    }
}

/// A failed `assert_enqueued` or `refute_enqueued` names the line of the test that called
/// it, not a line of skiplock's own `testing.rs`.
#[tokio::test]
async fn a_failed_assert_names_the_line_of_the_test() {
    let db = common::test_db().await;
    sqlx::query("INSERT INTO skiplock.jobs (kind, args) VALUES ('guide_present', '{}')")
        .execute(&db.pool)
        .await
        .unwrap();

    let pool = db.pool.clone();
    let line = line!() + 2;
    let message = panic_message(async move {
        assert_enqueued(&pool, &Enqueued::kind("guide_absent")).await;
    })
    .await;
    let here = format!("{}:{line}:", file!());
    assert!(message.starts_with(&here), "{here} in {message}");
    assert!(message.contains("expected a job matching"), "{message}");

    let pool = db.pool.clone();
    let line = line!() + 2;
    let message = panic_message(async move {
        refute_enqueued(&pool, &Enqueued::kind("guide_present")).await;
    })
    .await;
    let here = format!("{}:{line}:", file!());
    assert!(message.starts_with(&here), "{here} in {message}");
    assert!(message.contains("expected no job matching"), "{message}");
}
