//! What a worker logs about its jobs: every job runs in a span naming it (so a handler's
//! own lines carry its id, kind, queue and attempt), and every outcome but a success is
//! logged once at the level an operator expects.

mod common;

use std::time::Duration;

use common::fixtures::{Captured, Flaky, Panics, Recorder, fast_worker, state_of, wait_for};
use common::test_db;
use skiplock::{EnqueueOptions, Job, JobContext, JobError, JobState};

/// Logs one line of its own, then succeeds.
#[derive(serde::Serialize, serde::Deserialize)]
struct Greets {}

impl Job for Greets {
    const KIND: &'static str = "greets";

    async fn run(self, _ctx: JobContext) -> Result<(), JobError> {
        tracing::info!("hello from the handler");
        Ok(())
    }
}

#[tokio::test]
async fn jobs_log_in_their_span_and_each_failure_once_at_its_level() {
    let db = test_db().await;
    let pool = &db.pool;
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    // A current-thread runtime: every task of the worker logs through this subscriber.
    let _default = tracing::subscriber::set_default(subscriber);

    let greets = skiplock::enqueue(pool, &Greets {}, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let flaky = skiplock::enqueue(
        pool,
        &Flaky { fail_until: 100 },
        EnqueueOptions::new().max_attempts(2),
    )
    .await
    .unwrap()
    .id;
    let panics = skiplock::enqueue(pool, &Panics {}, EnqueueOptions::new().max_attempts(1))
        .await
        .unwrap()
        .id;
    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder)
        .register::<Greets>()
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    // Not exit_when_idle: the flaky job's retry is scheduled, not runnable, in between.
    wait_for("every job to end", Duration::from_secs(30), || async {
        state_of(pool, flaky.0).await == JobState::Dead
            && state_of(pool, panics.0).await == JobState::Dead
            && state_of(pool, greets.0).await == JobState::Succeeded
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();

    let lines = captured.lines();
    let of = |id: skiplock::JobId, kind: &str, attempt: i32| {
        let span = format!("job{{job_id={id} kind={kind} queue=default attempt={attempt}}}");
        lines
            .iter()
            .filter(|line| line.contains(&span))
            .cloned()
            .collect::<Vec<_>>()
    };
    let greeting = of(greets, "greets", 1);
    assert_eq!(greeting.len(), 1, "{lines:#?}");
    assert!(greeting[0].contains("hello from the handler"));

    let first = of(flaky, "flaky", 1);
    assert_eq!(first.len(), 1, "{lines:#?}");
    assert!(
        first[0].contains(" WARN ")
            && first[0].contains("job failed; will retry")
            && first[0].contains("planned failure on attempt 1")
            && first[0].contains("retry_in_ms="),
        "{first:?}"
    );
    let last = of(flaky, "flaky", 2);
    assert_eq!(last.len(), 1, "{lines:#?}");
    assert!(
        last[0].contains(" ERROR ") && last[0].contains("job failed and is dead: no attempt left"),
        "{last:?}"
    );
    let panicked = of(panics, "panics", 1);
    assert_eq!(panicked.len(), 1, "{lines:#?}");
    assert!(
        panicked[0].contains(" ERROR ")
            && panicked[0].contains("handler panicked: boom from a test handler"),
        "{panicked:?}"
    );
}
