//! `skiplock::testing`: what an application's tests use to check the jobs they enqueue and
//! run them through a real worker.
#![cfg(feature = "testing")]

mod common;

use std::time::Duration;

use common::fixtures::{Flaky, Record, Recorder, Slow, fast_worker};
use common::test_db;
use serde_json::json;
use skiplock::testing::{
    Enqueued, assert_enqueued, drain_queue, enqueued, perform_job, refute_enqueued,
};
use skiplock::{EnqueueOptions, Error, JobEventOutcome, JobState};

/// `assert_enqueued` finds jobs by kind, args (containment), queue and priority, inside an
/// uncommitted transaction too; `refute_enqueued` and a failed assertion say what is there.
#[tokio::test]
async fn assertions_find_enqueued_jobs_by_kind_args_queue_and_priority() {
    let db = test_db().await;
    let pool = &db.pool;
    let mut tx = pool.begin().await.unwrap();
    let options = EnqueueOptions::new().queue("mail").priority(3);
    skiplock::enqueue(&mut *tx, &Record { n: 7 }, options)
        .await
        .unwrap();
    let in_tx = assert_enqueued(
        &mut *tx,
        &Enqueued::of::<Record>()
            .args(json!({"n": 7}))
            .queue("mail")
            .priority(3),
    )
    .await;
    assert_eq!(in_tx.len(), 1);
    // Not committed: the pool sees nothing.
    refute_enqueued(pool, &Enqueued::of::<Record>()).await;
    tx.commit().await.unwrap();

    assert_eq!(
        enqueued(pool, &Enqueued::of::<Record>())
            .await
            .unwrap()
            .len(),
        1
    );
    for other in [
        Enqueued::of::<Record>().args(json!({"n": 8})),
        Enqueued::of::<Record>().queue("default"),
        Enqueued::of::<Record>().priority(0),
        Enqueued::of::<Record>().in_states(&[JobState::Succeeded]),
        Enqueued::of::<Flaky>(),
    ] {
        refute_enqueued(pool, &other).await;
    }
    let pool_clone = pool.clone();
    let failed = tokio::spawn(async move {
        assert_enqueued(&pool_clone, &Enqueued::of::<Record>().args(json!({"n": 8}))).await;
    })
    .await
    .expect_err("the assertion fails");
    let message = failed
        .into_panic()
        .downcast::<String>()
        .map(|m| *m)
        .unwrap_or_default();
    assert!(
        message.contains(
            "jobs of kind `record` in those states: #1 queued queue mail priority 3 args {\"n\":7}"
        ),
        "{message}"
    );
}

/// `perform_job` runs one chosen job through a real worker and says what became of it;
/// the other jobs stay queued.
#[tokio::test]
async fn perform_job_runs_one_job_and_reports_its_outcome() {
    let db = test_db().await;
    let pool = &db.pool;
    let recorder = Recorder::default();
    let later = EnqueueOptions::new().run_after(Duration::from_secs(3600));
    let record = skiplock::enqueue(pool, &Record { n: 1 }, later)
        .await
        .unwrap()
        .id;
    let bystander = skiplock::enqueue(pool, &Record { n: 2 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let flaky = skiplock::enqueue(pool, &Flaky { fail_until: 1 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;

    // Scheduled an hour from now, and performed now.
    let event = perform_job(fast_worker(pool, &recorder), record.0)
        .await
        .unwrap();
    assert!(
        matches!(event.outcome, JobEventOutcome::Completed { .. }),
        "{event:?}"
    );
    let event = perform_job(fast_worker(pool, &recorder), flaky.0)
        .await
        .unwrap();
    assert!(
        matches!(event.outcome, JobEventOutcome::Retried { .. }),
        "{event:?}"
    );
    let runs = recorder.runs();
    assert_eq!(runs.get(&record.0), Some(&vec![1]));
    assert_eq!(runs.get(&flaky.0), Some(&vec![1]));
    assert_eq!(runs.get(&bystander.0), None, "the other job was left alone");
    let state = |id: i64| async move {
        skiplock::job(pool, skiplock::JobId(id))
            .await
            .unwrap()
            .unwrap()
            .state
    };
    assert_eq!(state(record.0).await, JobState::Succeeded);
    assert_eq!(state(flaky.0).await, JobState::Queued);
    assert_eq!(state(bystander.0).await, JobState::Queued);

    // A job that is not queued, or of a kind the worker does not register, is refused.
    for (id, builder, expected) in [
        (
            record.0,
            fast_worker(pool, &recorder),
            "is succeeded, not queued",
        ),
        (999_999, fast_worker(pool, &recorder), "does not exist"),
        (
            bystander.0,
            skiplock::Worker::builder(pool.clone()).register::<Slow>(),
            "which the worker does not register",
        ),
    ] {
        let error = perform_job(builder, id).await.unwrap_err();
        assert!(
            matches!(&error, Error::InvalidJob(m) if m.contains(expected)),
            "{error}"
        );
    }
}

/// `perform_job` runs the job it is given past the claim's rules (a pause, here, as the
/// global and key limits), as its documentation says; `drain_queue` claims as production
/// does and runs nothing of a paused queue.
#[tokio::test]
async fn perform_job_runs_its_job_in_a_paused_queue_where_drain_queue_runs_none() {
    let db = test_db().await;
    let pool = &db.pool;
    let paused = EnqueueOptions::new().queue("paused");
    let named = skiplock::enqueue(pool, &Record { n: 1 }, paused.clone())
        .await
        .unwrap()
        .id;
    let other = skiplock::enqueue(pool, &Record { n: 2 }, paused)
        .await
        .unwrap()
        .id;
    sqlx::query("SELECT skiplock.pause_queue('paused')")
        .execute(pool)
        .await
        .unwrap();
    let recorder = Recorder::default();
    let events = drain_queue(fast_worker(pool, &recorder), "paused")
        .await
        .unwrap();
    assert!(events.is_empty(), "a paused queue drained: {events:?}");
    let event = perform_job(fast_worker(pool, &recorder), named.0)
        .await
        .unwrap();
    assert!(
        matches!(event.outcome, JobEventOutcome::Completed { .. }),
        "{event:?}"
    );
    let runs = recorder.runs();
    assert_eq!(runs.get(&named.0), Some(&vec![1]));
    assert_eq!(runs.get(&other.0), None, "the other job was left alone");
}

/// `drain_queue` runs what is runnable in one queue and returns every outcome; other
/// queues and later jobs stay.
#[tokio::test]
async fn drain_queue_runs_what_is_runnable_in_one_queue() {
    let db = test_db().await;
    let pool = &db.pool;
    let mail = EnqueueOptions::new().queue("mail");
    let first = skiplock::enqueue(pool, &Record { n: 1 }, mail.clone())
        .await
        .unwrap()
        .id;
    let second = skiplock::enqueue(pool, &Record { n: 2 }, mail.clone())
        .await
        .unwrap()
        .id;
    let later = skiplock::enqueue(
        pool,
        &Record { n: 3 },
        mail.run_after(Duration::from_secs(3600)),
    )
    .await
    .unwrap()
    .id;
    let elsewhere = skiplock::enqueue(pool, &Record { n: 4 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let recorder = Recorder::default();
    let events = drain_queue(fast_worker(pool, &recorder), "mail")
        .await
        .unwrap();
    let mut ran: Vec<i64> = events.iter().map(|e| e.id.0).collect();
    ran.sort_unstable();
    assert_eq!(ran, vec![first.0, second.0]);
    assert!(
        events
            .iter()
            .all(|e| matches!(e.outcome, JobEventOutcome::Completed { .. }))
    );
    let runs = recorder.runs();
    assert!(!runs.contains_key(&later.0) && !runs.contains_key(&elsewhere.0));
}
