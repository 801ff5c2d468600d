//! In-process job events (`Worker::subscribe`): one per attempt that ended in the worker,
//! published once its outcome is saved, and a subscriber that falls behind loses the oldest
//! without slowing the worker.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fixtures::{Flaky, Record, Recorder, Slow, fast_worker, flaky_delay, wait_for};
use common::test_db;
use skiplock::{EnqueueOptions, JobEvent, JobEventOutcome, JobId};
use sqlx::postgres::PgPoolOptions;

#[tokio::test]
async fn each_saved_outcome_is_published_once() {
    let db = test_db().await;
    let pool = &db.pool;
    let record = skiplock::enqueue(pool, &Record { n: 1 }, EnqueueOptions::default())
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
    let slow = skiplock::enqueue(pool, &Slow { ms: 600_000 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder).build().unwrap();
    let mut events = worker.subscribe();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());

    let mut seen: Vec<JobEvent> = Vec::new();
    let mut cancelled = false;
    while seen.len() < 4 {
        let event = tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .unwrap_or_else(|_| panic!("four events within 30 s; got {seen:#?}"))
            .expect("the worker is running");
        seen.push(event);
        // Cancel the slow job once it runs (the other three are quick).
        if !cancelled && seen.len() == 3 {
            wait_for("the slow job to run", Duration::from_secs(30), || async {
                recorder.runs().contains_key(&slow.0)
            })
            .await;
            assert!(skiplock::cancel(pool, slow).await.unwrap());
            cancelled = true;
        }
    }
    stop.shutdown();
    run.await.unwrap().unwrap();

    let of = |id: JobId| seen.iter().filter(|e| e.id == id).collect::<Vec<_>>();
    let done = of(record);
    assert_eq!(done.len(), 1, "{seen:#?}");
    assert!(matches!(done[0].outcome, JobEventOutcome::Completed { .. }));
    assert_eq!(
        (done[0].kind.as_str(), done[0].queue.as_str()),
        ("record", "default")
    );
    let flaky_events = of(flaky);
    assert_eq!(flaky_events.len(), 2, "{seen:#?}");
    assert_eq!(
        flaky_events[0].outcome,
        JobEventOutcome::Retried {
            error: "planned failure on attempt 1".into(),
            retry_in: flaky_delay(1)
        }
    );
    assert_eq!(
        (flaky_events[1].attempt, &flaky_events[1].outcome),
        (
            2,
            &JobEventOutcome::Dead {
                error: "planned failure on attempt 2".into()
            }
        )
    );
    let slow_events = of(slow);
    assert_eq!(slow_events.len(), 1, "{seen:#?}");
    assert_eq!(slow_events[0].outcome, JobEventOutcome::Cancelled);
    assert_eq!(events.dropped(), 0);
}

/// A running job cancelled by an UPDATE by hand (no `skiplock_cancel` notification: only
/// the heartbeat finds its claim gone) is published `Cancelled`, as when the notification
/// comes first: the heartbeat asks which of the claims it lost were cancelled. It was
/// published `Lost`, and the cancel of `each_saved_outcome_is_published_once` was too
/// whenever a loaded machine let the heartbeat see the claim gone before the notification.
///
/// The heartbeat runs on a thread and runtime of its own, which ends with the worker: it
/// must never use the worker's pool there (a connection the pool opened on that runtime is
/// broken once the worker stops, "A Tokio 1.x context was found, but it is being
/// shutdown", as tests/roles.rs met it in CI). The worker's pool records the thread of
/// every connection it opens or hands out.
#[tokio::test]
async fn a_job_cancelled_under_its_heartbeat_is_published_cancelled() {
    let db = test_db().await;
    let threads: Arc<Mutex<Vec<String>>> = Arc::default();
    let record = |threads: &Arc<Mutex<Vec<String>>>| {
        let threads = threads.clone();
        move || {
            let name = std::thread::current().name().unwrap_or("").to_owned();
            threads.lock().unwrap().push(name);
        }
    };
    let (on_connect, on_acquire) = (record(&threads), record(&threads));
    let worker_pool = PgPoolOptions::new()
        .max_connections(4)
        .after_connect(move |_, _| {
            on_connect();
            Box::pin(async { Ok(()) })
        })
        .before_acquire(move |_, _| {
            on_acquire();
            Box::pin(async { Ok(true) })
        })
        .connect(&db.url)
        .await
        .unwrap();
    let pool = &worker_pool;
    let slow = skiplock::enqueue(pool, &Slow { ms: 600_000 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder).build().unwrap();
    let mut events = worker.subscribe();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the slow job to run", Duration::from_secs(30), || async {
        recorder.runs().contains_key(&slow.0)
    })
    .await;
    sqlx::query(
        "UPDATE skiplock.jobs SET state = 'cancelled', finished_at = now(), claim_token = NULL,
                                  heartbeat_at = NULL
         WHERE id = $1",
    )
    .bind(slow.0)
    .execute(pool)
    .await
    .unwrap();
    let event = tokio::time::timeout(Duration::from_secs(30), events.recv())
        .await
        .expect("an event within 30 s")
        .expect("the worker is running");
    stop.shutdown();
    run.await.unwrap().unwrap();
    assert_eq!(event.id, slow);
    assert_eq!(event.outcome, JobEventOutcome::Cancelled);
    let threads = threads.lock().unwrap().clone();
    assert!(!threads.is_empty(), "the pool recorded its connections");
    assert!(
        threads.iter().all(|name| name != "skiplock-heartbeat"),
        "the heartbeat's thread used the worker's pool: {threads:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_never_reads_loses_the_oldest_and_the_worker_goes_on() {
    let db = test_db().await;
    let pool = &db.pool;
    let jobs: Vec<Record> = (0..1_500).map(|n| Record { n }).collect();
    skiplock::enqueue_many(pool, &jobs, EnqueueOptions::default())
        .await
        .unwrap();
    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder)
        .exit_when_idle(true)
        .build()
        .unwrap();
    let mut idle = worker.subscribe();
    let summary = tokio::time::timeout(Duration::from_secs(120), worker.run())
        .await
        .expect("the worker drains although nobody reads its events")
        .unwrap();
    assert_eq!(summary.succeeded, 1_500);
    let mut read = 0;
    while idle.recv().await.is_some() {
        read += 1;
    }
    assert_eq!(read, skiplock::worker::events::EVENTS_BUFFERED);
    assert_eq!(
        idle.dropped(),
        1_500 - skiplock::worker::events::EVENTS_BUFFERED as u64
    );
}
