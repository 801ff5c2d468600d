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
        let id = skiplock::enqueue_with(pool, &job, EnqueueOptions::new().max_attempts(1))
            .await
            .unwrap();
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
    let snoozer = skiplock::enqueue_with(pool, &Snoozes { times: 2 }, lane.clone())
        .await
        .unwrap();
    let next = skiplock::enqueue_with(pool, &common::fixtures::Record { n: 1 }, lane)
        .await
        .unwrap();
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
