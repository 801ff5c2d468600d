//! The handler contract: what a handler may return and what becomes of its job.

mod common;

use std::time::Duration;

use common::fixtures::{Recorder, fast_worker, state_of, wait_for};
use common::test_db;
use serde::{Deserialize, Serialize};
use skiplock::{EnqueueOptions, Job, JobContext, JobError, JobState};

/// Longest wait for a worker to settle what the database holds.
const PATIENCE: Duration = Duration::from_secs(30);

/// An error with a cause, as a library would return it.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the invoice")]
struct ReadInvoice(#[source] std::io::Error);

/// Fails with `?` on the error type named by `with`.
#[derive(Serialize, Deserialize)]
struct FailsWith {
    with: String,
}

fn read_invoice() -> Result<(), ReadInvoice> {
    Err(ReadInvoice(std::io::Error::other("disk on fire")))
}

fn with_anyhow() -> anyhow::Result<()> {
    use anyhow::Context;
    read_invoice().context("billing run 7 failed")
}

fn with_box() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    read_invoice()?;
    Ok(())
}

impl Job for FailsWith {
    const KIND: &'static str = "fails_with";

    async fn run(self, _ctx: JobContext) -> Result<(), JobError> {
        match self.with.as_str() {
            "anyhow" => with_anyhow()?,
            "box" => with_box()?,
            "std" => read_invoice()?,
            "str" => Err("no invoice number")?,
            _ => Err(format!("unknown case {}", self.with))?,
        }
        Ok(())
    }
}

/// `?` works on `anyhow::Error`, `Box<dyn Error + Send + Sync>`, a `std::error::Error` and
/// a `&str` in a handler, and `last_error` and `errors` keep the whole cause chain.
#[tokio::test]
async fn question_mark_works_on_every_error_and_keeps_the_causes() {
    let db = test_db().await;
    let pool = &db.pool;
    let cases = [
        (
            "anyhow",
            "billing run 7 failed: cannot read the invoice: disk on fire",
        ),
        ("box", "cannot read the invoice: disk on fire"),
        ("std", "cannot read the invoice: disk on fire"),
        ("str", "no invoice number"),
    ];
    let mut ids = Vec::new();
    for (with, _) in cases {
        let job = FailsWith {
            with: with.to_owned(),
        };
        let id = skiplock::enqueue(pool, &job, EnqueueOptions::new().max_attempts(1))
            .await
            .unwrap()
            .id;
        ids.push(id.0);
    }
    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder)
        .register::<FailsWith>()
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    for &id in &ids {
        wait_for(&format!("job {id} to die"), PATIENCE, || async move {
            state_of(pool, id).await == JobState::Dead
        })
        .await;
    }
    stop.shutdown();
    run.await.unwrap().unwrap();
    for (&id, (with, expected)) in ids.iter().zip(cases) {
        let (last_error, first): (String, String) = sqlx::query_as(
            "SELECT last_error, errors -> 0 ->> 'message' FROM skiplock.jobs WHERE id = $1",
        )
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(last_error, expected, "{with}");
        assert_eq!(first, expected, "{with}");
    }
}

/// Snoozes its first `times` runs for 50 ms, then succeeds; records each run's ticks.
#[derive(Serialize, Deserialize)]
struct Snoozes {
    times: usize,
}

impl Job for Snoozes {
    const KIND: &'static str = "snoozes";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let recorder = ctx.data::<Recorder>().unwrap();
        recorder.record(&ctx);
        let start = recorder.tick();
        tokio::task::yield_now().await;
        recorder.end(ctx.id().0, start);
        if recorder.runs()[&ctx.id().0].len() <= self.times {
            return Err(JobError::snooze(Duration::from_millis(50)));
        }
        Ok(())
    }
}

/// A snoozed job runs again after its delay without spending an attempt and without an
/// error: three runs, each attempt 1, nothing in `errors`; a snooze event per snooze; and
/// the next job of its lane waits until it succeeded.
#[tokio::test]
async fn a_snooze_runs_the_job_again_without_spending_an_attempt() {
    let db = test_db().await;
    let pool = &db.pool;
    let lane = EnqueueOptions::new().ordering_key("l").max_attempts(1);
    let snoozer = skiplock::enqueue(pool, &Snoozes { times: 2 }, lane.clone())
        .await
        .unwrap()
        .id;
    let next = skiplock::enqueue(pool, &common::fixtures::Record { n: 1 }, lane)
        .await
        .unwrap()
        .id;
    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder)
        .register::<Snoozes>()
        .build()
        .unwrap();
    let mut events = worker.subscribe();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the lane to finish", PATIENCE, || async {
        state_of(pool, next.0).await == JobState::Succeeded
    })
    .await;
    stop.shutdown();
    let summary = run.await.unwrap().unwrap();
    assert_eq!(
        (summary.snoozed, summary.succeeded, summary.failed),
        (2, 2, 0),
        "{summary:?}"
    );

    assert_eq!(
        recorder.runs()[&snoozer.0],
        vec![1, 1, 1],
        "attempt 1 each time"
    );
    let (state, attempt, errors, last_error): (String, i32, serde_json::Value, Option<String>) =
        sqlx::query_as(
            "SELECT state::text, attempt, errors, last_error FROM skiplock.jobs WHERE id = $1",
        )
        .bind(snoozer.0)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!((state.as_str(), attempt), ("succeeded", 1));
    assert_eq!(errors, serde_json::json!([]));
    assert_eq!(last_error, None);
    let spans = recorder.spans();
    let snoozer_end = spans[&snoozer.0].iter().map(|s| s.1).max().unwrap();
    assert!(
        snoozer_end < spans[&next.0][0].0,
        "the lane's next job waited: {spans:?}"
    );
    let mut snoozes = 0;
    // The worker stopped: the subscription yields what was published, then ends.
    while let Some(event) = tokio::time::timeout(PATIENCE, events.recv()).await.unwrap() {
        if let skiplock::JobEventOutcome::Snoozed { snooze_for } = event.outcome
            && event.id == snoozer
        {
            assert_eq!(snooze_for, Duration::from_millis(50));
            snoozes += 1;
        }
    }
    assert_eq!(snoozes, 2);
}

/// The application's table that `complete_in` handlers write to.
async fn create_ledger(pool: &sqlx::PgPool) {
    sqlx::query("CREATE TABLE ledger (job_id bigint NOT NULL, attempt int NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

/// The handler's own write: one ledger row for this attempt.
async fn write_ledger(tx: &mut sqlx::PgConnection, ctx: &JobContext) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES ($1, $2)")
        .bind(ctx.id().0)
        .bind(ctx.attempt())
        .execute(tx)
        .await?;
    Ok(())
}

/// How a [`Credits`] handler ends, after writing its ledger row and completing its job in
/// the same transaction.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
enum CreditEnd {
    /// Commits and returns `Ok`.
    Commit,
    /// On attempt 1, returns an error without committing (the transaction rolls back);
    /// then commits.
    FailBeforeCommitOnce,
    /// Commits, then returns an error.
    FailAfterCommit,
    /// Commits, then waits for a heartbeat of the worker (another job's `heartbeat_at`
    /// moving past the commit) before it returns `Ok`.
    OutliveAHeartbeat,
}

/// Writes a ledger row and completes its job in one transaction, then ends as told.
#[derive(Serialize, Deserialize)]
struct Credits {
    end: CreditEnd,
}

/// What [`Credits`] handlers saw: whether each was stopped while it ran.
#[derive(Default, Clone)]
struct CreditLog(std::sync::Arc<std::sync::Mutex<Vec<(i64, bool)>>>);

impl Job for Credits {
    const KIND: &'static str = "credits";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let mut tx = ctx.pool().begin().await?;
        write_ledger(&mut tx, &ctx).await?;
        ctx.complete_in(&mut tx).await?;
        if self.end == CreditEnd::FailBeforeCommitOnce && ctx.attempt() == 1 {
            return Err(JobError::retry("failed before the commit"));
        }
        let committed: chrono::DateTime<chrono::Utc> =
            sqlx::query_scalar("SELECT clock_timestamp()")
                .fetch_one(&mut *tx)
                .await?;
        tx.commit().await?;
        if self.end == CreditEnd::OutliveAHeartbeat {
            wait_for("a heartbeat after the commit", PATIENCE, || async {
                let beat: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
                    "SELECT max(heartbeat_at) FROM skiplock.jobs WHERE kind = 'holds'",
                )
                .fetch_one(ctx.pool())
                .await
                .unwrap();
                beat.is_some_and(|beat| beat > committed)
            })
            .await;
        }
        let log = ctx.data::<CreditLog>().unwrap();
        log.0.lock().unwrap().push((ctx.id().0, ctx.is_stopped()));
        if self.end == CreditEnd::FailAfterCommit {
            return Err(JobError::retry("failed after the commit"));
        }
        Ok(())
    }

    fn retry_delay(_attempt: i32) -> Duration {
        Duration::from_millis(10)
    }
}

/// Runs until every `credits` handler has returned (each logs itself in [`CreditLog`]), so
/// that the worker heartbeats a claim while a [`Credits`] handler outlives its own. (It
/// waited for the `credits` rows to succeed, which the outliving handler's own commit
/// makes true: it could end, and its heartbeat with it, before that handler saw a beat.)
#[derive(Serialize, Deserialize)]
struct Holds;

impl Job for Holds {
    const KIND: &'static str = "holds";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let log = ctx.data::<CreditLog>().unwrap();
        wait_for("the credits handlers to return", PATIENCE, || async {
            let credits: i64 =
                sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE kind = 'credits'")
                    .fetch_one(ctx.pool())
                    .await
                    .unwrap();
            log.0.lock().unwrap().len() as i64 == credits
        })
        .await;
        Ok(())
    }
}

/// `JobContext::complete_in`: the handler's writes and its job's completion commit
/// together or roll back together. A rollback leaves the claim held and the handler's
/// result decides (here a retry, whose second attempt commits); after a commit the job
/// stays succeeded whatever the handler returns, the heartbeat that finds the claim gone
/// does not stop the handler, and nothing is reported lost.
#[tokio::test]
async fn a_completion_in_the_handlers_transaction_commits_and_rolls_back_with_it() {
    let db = test_db().await;
    let pool = &db.pool;
    create_ledger(pool).await;
    let ends = [
        CreditEnd::Commit,
        CreditEnd::FailBeforeCommitOnce,
        CreditEnd::FailAfterCommit,
        CreditEnd::OutliveAHeartbeat,
    ];
    let mut ids = Vec::new();
    for end in ends {
        ids.push(
            skiplock::enqueue(pool, &Credits { end }, EnqueueOptions::default())
                .await
                .unwrap()
                .id
                .0,
        );
    }
    skiplock::enqueue(pool, &Holds, EnqueueOptions::default())
        .await
        .unwrap();
    let recorder = Recorder::default();
    let log = CreditLog::default();
    let worker = fast_worker(pool, &recorder)
        .register::<Credits>()
        .register::<Holds>()
        .data(log.clone())
        .concurrency(8)
        .build()
        .unwrap();
    let mut events = worker.subscribe();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("every job to succeed", PATIENCE, || async {
        common::fixtures::count_in_state(pool, JobState::Succeeded).await == 5
    })
    .await;
    stop.shutdown();
    let summary = run.await.unwrap().unwrap();
    assert_eq!(
        (summary.succeeded, summary.failed, summary.lost),
        (5, 1, 0),
        "{summary:?}"
    );

    let ledger: Vec<(i64, i32)> =
        sqlx::query_as("SELECT job_id, attempt FROM ledger ORDER BY job_id")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(
        ledger,
        vec![(ids[0], 1), (ids[1], 2), (ids[2], 1), (ids[3], 1)],
        "one row per job: the first attempt of the second rolled back"
    );
    for (&id, end) in ids.iter().zip(ends) {
        let (attempt, errors): (i32, serde_json::Value) =
            sqlx::query_as("SELECT attempt, errors FROM skiplock.jobs WHERE id = $1")
                .bind(id)
                .fetch_one(pool)
                .await
                .unwrap();
        let failures = errors.as_array().unwrap().len();
        let expected = if end == CreditEnd::FailBeforeCommitOnce {
            (2, 1)
        } else {
            (1, 0)
        };
        assert_eq!((attempt, failures), expected, "{end:?}");
    }
    let mut log = log.0.lock().unwrap().clone();
    log.sort_unstable();
    assert_eq!(
        log,
        ids.iter().map(|&id| (id, false)).collect::<Vec<_>>(),
        "every committed handler ran to its end, unstopped"
    );
    let mut completed = Vec::new();
    while let Some(event) = tokio::time::timeout(PATIENCE, events.recv()).await.unwrap() {
        match event.outcome {
            skiplock::JobEventOutcome::Completed { .. } => completed.push(event.id.0),
            skiplock::JobEventOutcome::Retried { .. } => {
                assert_eq!(event.id.0, ids[1], "only the rolled-back attempt retried");
            }
            other => panic!("unexpected event {other:?} for job {}", event.id),
        }
    }
    completed.sort_unstable();
    assert!(ids.iter().all(|id| completed.contains(id)), "{completed:?}");
}

/// Waits in its handler until told to go on, then writes a ledger row and completes its
/// job in one transaction.
#[derive(Serialize, Deserialize)]
struct CreditsWhenTold;

/// Tells [`CreditsWhenTold`] handlers to go on, and keeps what their `complete_in` said.
#[derive(Default, Clone)]
struct Go {
    go: std::sync::Arc<tokio::sync::Notify>,
    said: std::sync::Arc<std::sync::Mutex<Option<String>>>,
}

impl Job for CreditsWhenTold {
    const KIND: &'static str = "credits_when_told";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let go = ctx.data::<Go>().unwrap();
        go.go.notified().await;
        let mut tx = ctx.pool().begin().await?;
        write_ledger(&mut tx, &ctx).await?;
        let completed = ctx.complete_in(&mut tx).await;
        *go.said.lock().unwrap() = Some(match &completed {
            Ok(()) => "completed".to_owned(),
            Err(e) => e.to_string(),
        });
        completed?;
        tx.commit().await?;
        Ok(())
    }
}

/// `complete_in` is fenced: once the claim is gone (here taken by hand, as a reap and a
/// new claim elsewhere would), it refuses with `Error::ClaimLost`, and the handler's
/// writes roll back with its transaction.
#[tokio::test]
async fn a_completion_in_the_handlers_transaction_is_refused_once_the_claim_is_gone() {
    let db = test_db().await;
    let pool = &db.pool;
    create_ledger(pool).await;
    let id = skiplock::enqueue(pool, &CreditsWhenTold, EnqueueOptions::default())
        .await
        .unwrap()
        .id
        .0;
    let go = Go::default();
    // No heartbeat during the test: it would find the claim gone and stop the handler
    // before it could try.
    let worker = skiplock::Worker::builder(pool.clone())
        .register::<CreditsWhenTold>()
        .data(go.clone())
        .heartbeat(Duration::from_secs(600), Duration::from_secs(1800))
        .prune_interval(None)
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the job to run", PATIENCE, || async {
        state_of(pool, id).await == JobState::Running
    })
    .await;
    sqlx::query("UPDATE skiplock.jobs SET claim_token = gen_random_uuid() WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
    go.go.notify_one();
    wait_for("the handler to try", PATIENCE, || async {
        go.said.lock().unwrap().is_some()
    })
    .await;
    stop.shutdown();
    let summary = run.await.unwrap().unwrap();
    assert_eq!(
        go.said.lock().unwrap().as_deref(),
        Some(
            format!(
                "the claim on job {id} is no longer held (reaped, cancelled or deleted); roll back the transaction"
            )
            .as_str()
        )
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "the handler's write rolled back");
    assert_eq!(
        state_of(pool, id).await,
        JobState::Running,
        "not ours to finish"
    );
    assert_eq!((summary.succeeded, summary.lost), (0, 1), "{summary:?}");
}

/// `complete_in` meets a job that left `running` while it waited for the row (cancelled
/// by an operator, whose transaction held the row): Postgres moved the row to the finished
/// jobs' partition and reports 40001, "already moved to another partition", where one
/// table would have let the statement see the token gone. That is the claim lost, and says
/// so (`Error::ClaimLost`), not a database error (issue 37).
#[tokio::test]
async fn a_completion_in_the_handlers_transaction_meets_a_job_cancelled_under_it() {
    let db = test_db().await;
    let pool = &db.pool;
    create_ledger(pool).await;
    let id = skiplock::enqueue(pool, &CreditsWhenTold, EnqueueOptions::default())
        .await
        .unwrap()
        .id
        .0;
    let go = Go::default();
    let worker = skiplock::Worker::builder(pool.clone())
        .register::<CreditsWhenTold>()
        .data(go.clone())
        .heartbeat(Duration::from_secs(600), Duration::from_secs(1800))
        .prune_interval(None)
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the job to run", PATIENCE, || async {
        state_of(pool, id).await == JobState::Running
    })
    .await;
    // The operator's cancel, held open: the row is locked and moving.
    let mut operator = pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE skiplock.jobs SET state = 'cancelled', claim_token = NULL, finished_at = now()
         WHERE id = $1",
    )
    .bind(id)
    .execute(&mut *operator)
    .await
    .unwrap();
    go.go.notify_one();
    common::fixtures::wait_for_a_lock_wait(pool, "the handler's completion to wait for the row")
        .await;
    operator.commit().await.unwrap();
    wait_for("the handler to hear back", PATIENCE, || async {
        go.said.lock().unwrap().is_some()
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
    assert_eq!(
        go.said.lock().unwrap().as_deref(),
        Some(
            format!(
                "the claim on job {id} is no longer held (reaped, cancelled or deleted); roll back the transaction"
            )
            .as_str()
        )
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "the handler's write rolled back");
    assert_eq!(state_of(pool, id).await, JobState::Cancelled);
}
