//! The worker runtime: exactly-once draining, retries, panics, bad args, unknown kinds,
//! wake-ups and shutdown.

mod common;

use std::time::Duration;

use common::fixtures::{
    AtGate, Flaky, Gate, Panics, Record, Recorder, Slow, count_in_state, flaky_delay, state_of,
    steady_worker, wait_for,
};
use common::test_db;
use serde_json::json;
use skiplock::{EnqueueOptions, JobId, JobState, NewJob};

/// Longest wait for a worker to settle what the database holds.
const PATIENCE: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_workers_drain_ten_thousand_jobs_exactly_once() {
    let db = test_db().await;
    let jobs: Vec<Record> = (0..10_000).map(|n| Record { n }).collect();
    let ids = common::ids(
        skiplock::enqueue_many(&db.pool, &jobs, EnqueueOptions::default())
            .await
            .unwrap(),
    );

    let recorder = Recorder::default();
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let worker = steady_worker(&db.pool, &recorder)
                .worker_id(format!("drain-{i}"))
                .concurrency(16)
                .exit_when_idle(true)
                .build()
                .unwrap();
            tokio::spawn(worker.run())
        })
        .collect();
    let mut claimed = Vec::new();
    for worker in workers {
        claimed.push(worker.await.unwrap().unwrap().claimed);
    }

    let runs = recorder.runs();
    assert_eq!(runs.len(), 10_000, "every job ran");
    for id in &ids {
        if runs[&id.0] != vec![1] {
            let row = skiplock::job(&db.pool, *id).await.unwrap().unwrap();
            panic!(
                "job {id} ran {:?}, not once as attempt 1: {row:?}",
                runs[&id.0]
            );
        }
    }
    assert_eq!(
        claimed.iter().sum::<u64>(),
        10_000,
        "no job was claimed twice"
    );
    let (succeeded, attempt_one, distinct_workers): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 'succeeded'),
                count(*) FILTER (WHERE attempt = 1),
                count(DISTINCT claimed_by)
         FROM skiplock.jobs",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((succeeded, attempt_one), (10_000, 10_000));
    assert!(
        distinct_workers >= 2,
        "the work was shared ({distinct_workers} worker(s))"
    );
}

#[tokio::test]
async fn failing_job_backs_off_dies_and_runs_again_after_manual_retry() {
    let db = test_db().await;
    let id = skiplock::enqueue(
        &db.pool,
        &Flaky { fail_until: 100 },
        EnqueueOptions::new().max_attempts(4),
    )
    .await
    .unwrap()
    .id;

    let recorder = Recorder::default();
    let worker = steady_worker(&db.pool, &recorder).build().unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the job to die", PATIENCE, || async {
        state_of(&db.pool, id.0).await == JobState::Dead
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();

    assert_eq!(
        recorder.runs()[&id.0],
        vec![1, 2, 3, 4],
        "exactly max_attempts attempts"
    );
    let row = skiplock::job(&db.pool, id).await.unwrap().unwrap();
    assert_eq!(row.attempt, 4);
    assert_eq!(
        row.last_error.as_deref(),
        Some("planned failure on attempt 4")
    );
    let errors = row.errors.0.as_array().unwrap().clone();
    assert_eq!(errors.len(), 4);
    let times: Vec<chrono::DateTime<chrono::Utc>> = errors
        .iter()
        .enumerate()
        .map(|(i, e)| {
            assert_eq!(e["attempt"], json!(i + 1));
            assert_eq!(
                e["message"],
                json!(format!("planned failure on attempt {}", i + 1))
            );
            serde_json::from_value(e["at"].clone()).unwrap()
        })
        .collect();
    // Each retry waited at least the delay the kind asked for for that attempt (200, 400,
    // 800 ms: the third gap's floor is twice the second's, so a worker that reused the
    // first delay fails here). No upper bound or comparison of gaps: those measure the
    // machine's speed.
    let gaps: Vec<Duration> = times
        .windows(2)
        .map(|w| (w[1] - w[0]).to_std().unwrap())
        .collect();
    for (i, gap) in gaps.iter().enumerate() {
        let asked = flaky_delay(i as i32 + 1);
        assert!(
            *gap >= asked,
            "retry {} came after {gap:?}, before its delay {asked:?}",
            i + 1
        );
    }

    // A manual retry (API) gives it one more attempt...
    assert!(skiplock::retry(&db.pool, id).await.unwrap());
    let recorder = Recorder::default();
    steady_worker(&db.pool, &recorder)
        .exit_when_idle(true)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!(recorder.runs()[&id.0], vec![5]);
    assert_eq!(state_of(&db.pool, id.0).await, JobState::Dead);

    // ...and so does plain SQL.
    let retried: bool = sqlx::query_scalar("SELECT skiplock.retry_job($1)")
        .bind(id.0)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(retried);
    assert_eq!(state_of(&db.pool, id.0).await, JobState::Queued);
}

#[tokio::test]
async fn flaky_job_succeeds_on_a_later_attempt() {
    let db = test_db().await;
    let id = skiplock::enqueue(
        &db.pool,
        &Flaky { fail_until: 2 },
        EnqueueOptions::default(),
    )
    .await
    .unwrap()
    .id;
    let recorder = Recorder::default();
    let worker = steady_worker(&db.pool, &recorder).build().unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the job to succeed", PATIENCE, || async {
        state_of(&db.pool, id.0).await == JobState::Succeeded
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
    assert_eq!(recorder.runs()[&id.0], vec![1, 2, 3]);
    let row = skiplock::job(&db.pool, id).await.unwrap().unwrap();
    assert_eq!(row.errors.0.as_array().unwrap().len(), 2);
    assert!(
        row.finished_at.is_some()
            && common::fixtures::claim_token_of(&db.pool, row.id)
                .await
                .is_none()
    );
}

#[tokio::test]
async fn a_panicking_handler_fails_only_its_own_job() {
    let db = test_db().await;
    let bad = skiplock::enqueue(&db.pool, &Panics {}, EnqueueOptions::new().max_attempts(2))
        .await
        .unwrap()
        .id;
    let good: Vec<Record> = (0..50).map(|n| Record { n }).collect();
    skiplock::enqueue_many(&db.pool, &good, EnqueueOptions::default())
        .await
        .unwrap();

    let recorder = Recorder::default();
    let worker = steady_worker(&db.pool, &recorder).build().unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the panicking job to die", PATIENCE, || async {
        state_of(&db.pool, bad.0).await == JobState::Dead
    })
    .await;
    wait_for("the others to succeed", PATIENCE, || async {
        count_in_state(&db.pool, JobState::Succeeded).await == 50
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
    let row = skiplock::job(&db.pool, bad).await.unwrap().unwrap();
    assert_eq!(
        row.last_error.as_deref(),
        Some("handler panicked: boom from a test handler")
    );
    assert_eq!(recorder.runs()[&bad.0], vec![1, 2]);
}

#[tokio::test]
async fn undecodable_args_are_a_permanent_failure_with_a_clear_error() {
    let db = test_db().await;
    let id = skiplock::enqueue_raw(
        &db.pool,
        &[NewJob::new("record", json!({"n": "not a number"}))],
    )
    .await
    .unwrap()[0]
        .id;
    let recorder = Recorder::default();
    steady_worker(&db.pool, &recorder)
        .exit_when_idle(true)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let row = skiplock::job(&db.pool, id).await.unwrap().unwrap();
    assert_eq!(row.state, JobState::Dead);
    assert_eq!(row.attempt, 1, "no retry for args that can never decode");
    let error = row.last_error.unwrap();
    assert!(
        error.starts_with(
            "args do not match kind `record`: invalid type: string \"not a number\", expected u32"
        ),
        "{error}"
    );
    assert_eq!(recorder.total(), 0, "the handler never ran");
}

#[tokio::test]
async fn a_job_of_an_unknown_kind_stays_queued_untouched() {
    let db = test_db().await;
    let mystery = skiplock::enqueue_raw(&db.pool, &[NewJob::new("mystery", json!({"x": 1}))])
        .await
        .unwrap()[0]
        .id;
    let known = skiplock::enqueue(&db.pool, &Record { n: 1 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let recorder = Recorder::default();
    steady_worker(&db.pool, &recorder)
        .exit_when_idle(true)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();

    assert_eq!(state_of(&db.pool, known.0).await, JobState::Succeeded);
    let row = skiplock::job(&db.pool, mystery).await.unwrap().unwrap();
    assert_eq!(row.state, JobState::Queued);
    assert_eq!(row.attempt, 0);
    assert!(
        common::fixtures::claim_token_of(&db.pool, row.id)
            .await
            .is_none()
            && row.claimed_by.is_none()
            && row.last_error.is_none()
    );
}

#[tokio::test]
async fn a_plain_sql_insert_wakes_an_idle_worker() {
    let db = test_db().await;
    let recorder = Recorder::default();
    // Polling once an hour: only the notification can bring the job in time.
    let worker = steady_worker(&db.pool, &recorder)
        .poll_interval(Duration::from_secs(3600))
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    // `state = 'idle'`: the LISTEN has completed (while it runs, the session shows it as
    // its query already, and a notification sent then is lost).
    wait_for("the worker to LISTEN", PATIENCE, || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                            WHERE datname = current_database() AND query ILIKE 'LISTEN%'
                              AND state = 'idle')",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    })
    .await;
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args) VALUES ('record', '{\"n\": 7}') RETURNING id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    wait_for("the inserted job to run", PATIENCE, || async {
        state_of(&db.pool, id).await == JobState::Succeeded
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
    assert_eq!(recorder.runs()[&id], vec![1]);
}

/// How long the graceful shutdown in
/// [`graceful_shutdown_finishes_short_jobs_and_releases_long_ones`] waits for running jobs:
/// the short ones end as soon as the test sees the shutdown under way, far sooner on any
/// machine; the long ones hold the test this long.
const GRACE: Duration = Duration::from_secs(10);

/// A graceful shutdown lets running jobs that end within the grace period succeed, and
/// releases those still running at its end, and those claimed but never started at once,
/// without spending their attempt. The short jobs end when the test lets them, once the
/// shutdown is under way (the unstarted jobs are back in the queue): a shutdown that
/// stopped running jobs at once would release them.
#[tokio::test]
async fn graceful_shutdown_finishes_short_jobs_and_releases_long_ones() {
    let db = test_db().await;
    let short: Vec<JobId> = common::ids(
        skiplock::enqueue_many(&db.pool, &vec![AtGate {}; 4], EnqueueOptions::default())
            .await
            .unwrap(),
    );
    let long: Vec<JobId> = common::ids(
        skiplock::enqueue_many(
            &db.pool,
            &vec![Slow { ms: 600_000 }; 4],
            EnqueueOptions::default(),
        )
        .await
        .unwrap(),
    );

    let recorder = Recorder::default();
    let gate = Gate::closed();
    let worker = steady_worker(&db.pool, &recorder)
        .register::<AtGate>()
        .data(gate.clone())
        .concurrency(8)
        .shutdown_grace(GRACE)
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("all eight jobs to start", PATIENCE, || async {
        recorder.total() == 8
    })
    .await;
    // Every slot is taken: these two are claimed into the local buffer and wait there.
    let unstarted: Vec<JobId> = common::ids(
        skiplock::enqueue_many(
            &db.pool,
            &vec![Slow { ms: 600_000 }; 2],
            EnqueueOptions::default(),
        )
        .await
        .unwrap(),
    );
    wait_for("the last two jobs to be claimed", PATIENCE, || async {
        count_in_state(&db.pool, JobState::Running).await == 10
    })
    .await;
    stop.shutdown();
    wait_for("the unstarted jobs to be released", PATIENCE, || async {
        count_in_state(&db.pool, JobState::Queued).await == 2
    })
    .await;
    gate.open();
    let summary = run.await.unwrap().unwrap();

    assert_eq!(
        count_in_state(&db.pool, JobState::Running).await,
        0,
        "nothing left running"
    );
    for id in &short {
        assert_eq!(
            state_of(&db.pool, id.0).await,
            JobState::Succeeded,
            "short job {id} finished"
        );
    }
    for id in long.iter().chain(&unstarted) {
        let row = skiplock::job(&db.pool, *id).await.unwrap().unwrap();
        assert_eq!(row.state, JobState::Queued, "long job {id} released");
        assert_eq!(row.attempt, 0, "release does not spend an attempt");
        assert!(
            common::fixtures::claim_token_of(&db.pool, row.id)
                .await
                .is_none()
                && row.last_error.is_none()
        );
    }
    assert!(
        unstarted
            .iter()
            .all(|id| !recorder.runs().contains_key(&id.0)),
        "the last two never started"
    );
    assert_eq!((summary.succeeded, summary.released), (4, 6));
}

#[tokio::test]
async fn shutdown_releases_jobs_still_in_the_local_buffer() {
    let db = test_db().await;
    skiplock::enqueue_many(
        &db.pool,
        &vec![Slow { ms: 600_000 }; 6],
        EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let recorder = Recorder::default();
    // Two slots, four more claimed into the buffer.
    let worker = steady_worker(&db.pool, &recorder)
        .concurrency(2)
        .prefetch(4)
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("six claims", PATIENCE, || async {
        count_in_state(&db.pool, JobState::Running).await == 6 && recorder.total() == 2
    })
    .await;
    stop.shutdown_now();
    let summary = run.await.unwrap().unwrap();
    assert_eq!(summary.released, 6);
    assert_eq!(count_in_state(&db.pool, JobState::Queued).await, 6);
    let spent: i64 = sqlx::query_scalar("SELECT sum(attempt) FROM skiplock.jobs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(spent, 0);
}

#[tokio::test]
async fn long_jobs_are_not_hoarded_by_the_adaptive_buffer() {
    // The buffer grows with the rate jobs start, sampled over windows of at least 50 ms:
    // 300 ms jobs on two slots start at most two in any such window, so the rate never
    // reads above 40 a second and the buffer never aims above 4 jobs (100 ms of work at
    // that rate), whatever the backlog and however the threads are scheduled. Claimed but
    // not started are then at most those 4, one job the dispatcher holds while it waits
    // for a slot, and two whose slots are taken but whose handler has not begun: 7 of 40,
    // and another worker can take the rest. A buffer that followed the backlog would hold
    // all 38 it can. What a worker holds in all (finished jobs whose outcome is still
    // being written stay `running` for as long as the completer takes) depends on the
    // machine's speed, so it is not the measure.
    const NOT_STARTED_MOST: usize = 4 + 1 + 2;
    let db = test_db().await;
    skiplock::enqueue_many(
        &db.pool,
        &vec![Slow { ms: 300 }; 40],
        EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let recorder = Recorder::default();
    let worker = steady_worker(&db.pool, &recorder)
        .concurrency(2)
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    let mut most_not_started = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while count_in_state(&db.pool, JobState::Succeeded).await < 6 {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for six jobs"
        );
        // The claims first, then the starts: a job that starts in between counts as
        // started, so the count never exceeds what was held unstarted at the first read.
        let running: Vec<i64> =
            sqlx::query_scalar("SELECT id FROM skiplock.jobs WHERE state = 'running'")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        let started = recorder.runs();
        let not_started = running
            .iter()
            .filter(|id| !started.contains_key(id))
            .count();
        most_not_started = most_not_started.max(not_started);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.shutdown();
    run.await.unwrap().unwrap();
    assert!(
        most_not_started <= NOT_STARTED_MOST,
        "held {most_not_started} of 40 claims unstarted at once; a buffer of at most 4, a \
         job waiting for a slot and two slots whose handlers are starting allow \
         {NOT_STARTED_MOST}"
    );
}

/// Uses the worker's pool (holding its only connection past a heartbeat tick, so the
/// heartbeat waits for it), then blocks its runtime thread for `ms`, as a synchronous call
/// in a handler does. It records the database clock just before and just after the block
/// in its [`BlockWindow`].
#[derive(serde::Serialize, serde::Deserialize)]
struct QueryThenBlock {
    ms: u64,
}

/// The database clock at the start and the end of [`QueryThenBlock`]'s block.
#[derive(Clone, Default)]
struct BlockWindow(std::sync::Arc<std::sync::Mutex<Vec<chrono::DateTime<chrono::Utc>>>>);

impl skiplock::Job for QueryThenBlock {
    const KIND: &'static str = "query_then_block";

    async fn run(self, ctx: skiplock::JobContext) -> Result<(), skiplock::JobError> {
        let window = ctx
            .data::<BlockWindow>()
            .expect("a BlockWindow on the worker");
        let mut connection = ctx.pool().acquire().await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let start: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&mut *connection)
            .await?;
        drop(connection);
        // Deliberately blocking: the fault under test.
        std::thread::sleep(Duration::from_millis(self.ms));
        let end: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(ctx.pool())
            .await?;
        window.0.lock().unwrap().extend([start, end]);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_blocks_its_thread_after_using_the_pool_keeps_its_claim() {
    // Regression: the heartbeat ran on the application's runtime and beat through the
    // pool. Returning the handler's connection woke the heartbeat (waiting for it) on the
    // handler's own thread, in the slot no other thread may take, and the handler then
    // blocked that thread: no beat for the whole block, and the claim went stale.
    let db = test_db().await;
    // Every heartbeat of the job, by the database clock.
    sqlx::raw_sql(
        "CREATE TABLE public.beats (at timestamptz NOT NULL);
         CREATE FUNCTION public.record_beat() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO public.beats VALUES (clock_timestamp());
             RETURN NULL;
         END;
         $$;
         CREATE TRIGGER record_beat AFTER UPDATE ON skiplock.jobs FOR EACH ROW
         WHEN (OLD.state = 'running' AND NEW.state = 'running'
               AND OLD.heartbeat_at IS DISTINCT FROM NEW.heartbeat_at)
         EXECUTE FUNCTION public.record_beat();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let one_connection = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(db.url())
        .await
        .unwrap();
    let id = skiplock::enqueue(
        &db.pool,
        &QueryThenBlock { ms: 3_000 },
        EnqueueOptions::default(),
    )
    .await
    .unwrap()
    .id;
    let window = BlockWindow::default();
    let worker = skiplock::Worker::builder(one_connection)
        .register::<QueryThenBlock>()
        .data(window.clone())
        .poll_interval(Duration::from_millis(100))
        .heartbeat(Duration::from_millis(100), Duration::from_secs(30))
        .prune_interval(None)
        .exit_when_idle(true)
        .build()
        .unwrap();
    let summary = tokio::time::timeout(Duration::from_secs(60), worker.run())
        .await
        .expect("the worker finishes")
        .unwrap();
    assert_eq!(summary.claimed, 1);
    assert_eq!(state_of(&db.pool, id.0).await, JobState::Succeeded);
    let window = window.0.lock().unwrap().clone();
    let [start, end] = window[..] else {
        panic!("the handler recorded its block: {window:?}");
    };
    // The 3 s block spans 30 heartbeat intervals; with the regression not one beat landed
    // in it. No bound on a beat's age: that would measure the machine's speed.
    let beats: i64 =
        sqlx::query_scalar("SELECT count(*) FROM public.beats WHERE at > $1 AND at < $2")
            .bind(start)
            .bind(end)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(
        beats >= 2,
        "{beats} heartbeats landed while the handler blocked its thread for 3 s"
    );
}
