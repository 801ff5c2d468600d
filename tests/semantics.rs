//! Ordering lanes, unique keys and dependencies.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fixtures::{Recorder, count_in_state, fast_worker, state_of, steady_worker, wait_for};
use common::test_db;
use serde::{Deserialize, Serialize};
use serde_json::json;
use skiplock::{
    EnqueueOptions, Error, Job, JobContext, JobError, JobId, JobState, NewJob, UniquePolicy,
};
use sqlx::PgPool;

/// Start and end ticks of each run, by job id.
type Runs = HashMap<i64, Vec<(u64, u64)>>;

/// Payload lists received by `Digest` handlers.
type Received = Arc<Mutex<Vec<Vec<serde_json::Value>>>>;

/// A global event counter and what happened at each event, shared with handlers.
#[derive(Default, Clone)]
struct Timeline {
    clock: Arc<AtomicU64>,
    /// job id -> (start tick, end tick) of each run.
    runs: Arc<Mutex<Runs>>,
}

impl Timeline {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst)
    }

    fn record(&self, id: i64, start: u64, end: u64) {
        self.runs
            .lock()
            .unwrap()
            .entry(id)
            .or_default()
            .push((start, end));
    }

    fn runs(&self) -> Runs {
        self.runs.lock().unwrap().clone()
    }
}

/// Records its start and end ticks, yielding in between so overlapping runs would show.
/// Fails while `attempt <= fail_until`.
#[derive(Serialize, Deserialize, Clone)]
struct Step {
    fail_until: i32,
}

impl Job for Step {
    const KIND: &'static str = "step";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let timeline = ctx.data::<Timeline>().unwrap();
        let start = timeline.tick();
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        let end = timeline.tick();
        timeline.record(ctx.id().0, start, end);
        if ctx.attempt() <= self.fail_until {
            return Err(JobError::retry("planned failure"));
        }
        Ok(())
    }

    fn retry_delay(_attempt: i32) -> Duration {
        Duration::from_millis(200)
    }
}

/// Receives the merged payloads of a unique key.
#[derive(Serialize, Deserialize, Clone)]
#[serde(transparent)]
struct Digest(Vec<serde_json::Value>);

impl Job for Digest {
    const KIND: &'static str = "digest";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let received = ctx
            .data::<Arc<Mutex<Vec<Vec<serde_json::Value>>>>>()
            .unwrap();
        received.lock().unwrap().push(self.0);
        Ok(())
    }
}

/// Runs `workers` workers until no job is waiting, queued or running (retries included).
async fn run_until_settled(pool: &PgPool, timeline: &Timeline, workers: usize) {
    let mut stops = Vec::new();
    let handles: Vec<_> = (0..workers)
        .map(|i| {
            // The sweep of waiting jobs (and the reaper) out of the way: lanes and
            // dependants must move on by the worker's own settling of what it finished;
            // with the usual 100 ms sweep, removing that settling went unnoticed (issue 38).
            let worker = fast_worker(pool, &Recorder::default())
                .reap_interval(Duration::from_secs(3600))
                .data(timeline.clone())
                .register::<Step>()
                .worker_id(format!("w{i}"))
                .build()
                .unwrap();
            stops.push(worker.shutdown_handle());
            tokio::spawn(worker.run())
        })
        .collect();
    wait_for("every job to settle", Duration::from_secs(60), || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT NOT EXISTS (SELECT 1 FROM skiplock.jobs
                                WHERE state IN ('waiting', 'queued', 'running'))",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    })
    .await;
    for stop in stops {
        stop.shutdown();
    }
    for handle in handles {
        handle.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ordering_lanes_run_one_at_a_time_in_enqueue_order() {
    let db = test_db().await;
    // 5,000 jobs over 50 lanes, interleaved.
    let jobs: Vec<NewJob> = (0..5000)
        .map(|i| {
            NewJob::new("step", json!({"fail_until": 0}))
                .with_options(EnqueueOptions::new().ordering_key(format!("lane-{}", i % 50)))
        })
        .collect();
    let ids = common::ids(skiplock::enqueue_raw(&db.pool, &jobs).await.unwrap());
    let timeline = Timeline::default();
    run_until_settled(&db.pool, &timeline, 3).await;

    let runs = timeline.runs();
    assert_eq!(runs.len(), 5000);
    let retried: Vec<(i64, i32, Option<String>)> = sqlx::query_as(
        "SELECT id, attempt, last_error FROM skiplock.jobs WHERE attempt <> 1 ORDER BY id LIMIT 5",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        retried.is_empty(),
        "every job ran as attempt 1: {retried:?}"
    );
    for lane in 0..50 {
        let lane_runs: Vec<(u64, u64)> = ids
            .iter()
            .skip(lane)
            .step_by(50)
            .map(|id| {
                assert_eq!(runs[&id.0].len(), 1, "job {id} ran once");
                runs[&id.0][0]
            })
            .collect();
        // In enqueue order, and each ended before the next started.
        for pair in lane_runs.windows(2) {
            assert!(
                pair[0].1 < pair[1].0,
                "lane-{lane}: overlap or reorder {pair:?}"
            );
        }
    }
    assert_eq!(count_in_state(&db.pool, JobState::Succeeded).await, 5000);
}

/// Fails until the test opens its gate.
#[derive(Serialize, Deserialize, Clone)]
struct Gated {}

#[derive(Default)]
struct Gate(std::sync::atomic::AtomicBool);

impl Job for Gated {
    const KIND: &'static str = "gated";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let timeline = ctx.data::<Timeline>().unwrap();
        let start = timeline.tick();
        let open = ctx.data::<Arc<Gate>>().unwrap().0.load(Ordering::SeqCst);
        timeline.record(ctx.id().0, start, timeline.tick());
        if open {
            Ok(())
        } else {
            Err(JobError::retry("gate closed"))
        }
    }

    fn retry_delay(_attempt: i32) -> Duration {
        Duration::from_millis(50)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_head_blocks_its_lane_while_other_lanes_flow() {
    let db = test_db().await;
    let pool = &db.pool;
    let blocked = EnqueueOptions::new().ordering_key("blocked");
    // Retried every 50 ms while the gate is closed, for as long as the test takes: it must
    // not die of its attempts first (the default 25 go in a couple of seconds).
    let head = skiplock::enqueue(pool, &Gated {}, blocked.clone().max_attempts(i32::MAX))
        .await
        .unwrap()
        .id;
    let behind = skiplock::enqueue(pool, &Step { fail_until: 0 }, blocked)
        .await
        .unwrap()
        .id;
    let others = skiplock::enqueue_many(
        pool,
        &vec![Step { fail_until: 0 }; 20],
        EnqueueOptions::new().ordering_key("free"),
    )
    .await
    .unwrap();
    let timeline = Timeline::default();
    let gate = Arc::new(Gate::default());
    let mut stops = Vec::new();
    let mut runs = Vec::new();
    for i in 0..2 {
        let worker = steady_worker(pool, &Recorder::default())
            .data(timeline.clone())
            .data(gate.clone())
            .register::<Step>()
            .register::<Gated>()
            .worker_id(format!("w{i}"))
            .build()
            .unwrap();
        stops.push(worker.shutdown_handle());
        runs.push(tokio::spawn(worker.run()));
    }
    // With the gate closed the head keeps failing; the free lane drains all the same.
    wait_for(
        "the free lane to drain while the head fails",
        Duration::from_secs(60),
        || async {
            count_in_state(pool, JobState::Succeeded).await == 20
                && timeline.runs().get(&head.0).is_some_and(|r| r.len() >= 2)
        },
    )
    .await;
    assert_eq!(
        state_of(pool, behind.0).await,
        JobState::Waiting,
        "blocked behind the head"
    );
    assert!(!timeline.runs().contains_key(&behind.0));

    gate.0.store(true, Ordering::SeqCst);
    wait_for(
        "the blocked lane to finish",
        Duration::from_secs(60),
        || async { state_of(pool, behind.0).await == JobState::Succeeded },
    )
    .await;
    for stop in stops {
        stop.shutdown();
    }
    for run in runs {
        run.await.unwrap().unwrap();
    }
    let runs = timeline.runs();
    let head_done = runs[&head.0].last().unwrap().1;
    assert!(
        runs[&behind.0][0].0 > head_done,
        "the next job waited for the head to succeed"
    );
    assert!(others.iter().all(|id| runs[&id.id.0].len() == 1));
}

#[tokio::test]
async fn the_database_refuses_two_running_jobs_in_one_lane() {
    let db = test_db().await;
    let lane = EnqueueOptions::new().ordering_key("k");
    skiplock::enqueue_many(&db.pool, &vec![Step { fail_until: 0 }; 2], lane)
        .await
        .unwrap();
    let error = sqlx::query(
        "UPDATE skiplock.jobs SET state = 'running', claim_token = gen_random_uuid(),
                                  heartbeat_at = now()",
    )
    .execute(&db.pool)
    .await
    .unwrap_err();
    assert!(error.to_string().contains("jobs_lane_turn_idx"), "{error}");
}

async fn enqueue_unique(
    pool: &PgPool,
    key: &str,
    args: serde_json::Value,
    policy: UniquePolicy,
) -> JobId {
    let job =
        NewJob::new("digest", args).with_options(EnqueueOptions::new().unique_key(key, policy));
    skiplock::enqueue_raw(pool, &[job]).await.unwrap()[0].id
}

#[tokio::test]
async fn unique_keys_skip_replace_and_merge() {
    let db = test_db().await;
    let pool = &db.pool;
    let first = enqueue_unique(pool, "k", json!({"v": 1}), UniquePolicy::Skip).await;
    let again = enqueue_unique(pool, "k", json!({"v": 2}), UniquePolicy::Skip).await;
    assert_eq!(first, again);
    let row = skiplock::job(pool, first).await.unwrap().unwrap();
    assert_eq!(row.args.0, json!({"v": 1}), "skip keeps the pending job");

    enqueue_unique(pool, "k", json!({"v": 3}), UniquePolicy::Replace).await;
    let row = skiplock::job(pool, first).await.unwrap().unwrap();
    assert_eq!(row.args.0, json!({"v": 3}), "replace gives it the new args");

    // Another key is another job; merge accumulates every payload in an array.
    let merged = enqueue_unique(pool, "m", json!({"v": 1}), UniquePolicy::Merge).await;
    assert_ne!(merged, first);
    enqueue_unique(pool, "m", json!({"v": 2}), UniquePolicy::Merge).await;
    // Bulk enqueue honours unique keys too, in input order.
    let bulk: Vec<NewJob> = (3..=5)
        .map(|v| {
            NewJob::new("digest", json!({"v": v}))
                .with_options(EnqueueOptions::new().unique_key("m", UniquePolicy::Merge))
        })
        .collect();
    let bulk_ids = common::ids(skiplock::enqueue_raw(pool, &bulk).await.unwrap());
    assert_eq!(bulk_ids, vec![merged; 3]);
    let row = skiplock::job(pool, merged).await.unwrap().unwrap();
    assert_eq!(
        row.args.0,
        json!([{"v": 1}, {"v": 2}, {"v": 3}, {"v": 4}, {"v": 5}])
    );
    assert_eq!(count_in_state(pool, JobState::Queued).await, 2);
}

#[tokio::test]
async fn merged_payloads_reach_the_handler_once_in_order() {
    let db = test_db().await;
    let pool = &db.pool;
    for v in 1..=4 {
        let job = NewJob::new("digest", json!({"v": v}))
            .with_options(EnqueueOptions::new().unique_key("daily", UniquePolicy::Merge));
        skiplock::enqueue_raw(pool, &[job]).await.unwrap();
    }
    let received: Received = Arc::default();
    steady_worker(pool, &Recorder::default())
        .data(received.clone())
        .register::<Digest>()
        .exit_when_idle(true)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let received = received.lock().unwrap().clone();
    assert_eq!(
        received,
        vec![vec![
            json!({"v": 1}),
            json!({"v": 2}),
            json!({"v": 3}),
            json!({"v": 4})
        ]]
    );
    // Once it ran, the key is free again: a new enqueue makes a new job.
    let job = NewJob::new("digest", json!({"v": 5}))
        .with_options(EnqueueOptions::new().unique_key("daily", UniquePolicy::Merge));
    skiplock::enqueue_raw(pool, &[job]).await.unwrap();
    assert_eq!(count_in_state(pool, JobState::Queued).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_transactions_with_one_unique_key_leave_one_job() {
    let db = test_db().await;
    let pool = db.pool.clone();
    let job = || {
        NewJob::new("digest", json!({"v": 1}))
            .with_options(EnqueueOptions::new().unique_key("race", UniquePolicy::Skip))
    };
    let mut first = pool.begin().await.unwrap();
    let first_id = skiplock::enqueue_raw(&mut *first, &[job()]).await.unwrap()[0].id;
    // The second transaction blocks on the unique index until the first one commits.
    let second = tokio::spawn({
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let id = skiplock::enqueue_raw(&mut *tx, &[job()]).await.unwrap()[0].id;
            tx.commit().await.unwrap();
            id
        }
    });
    wait_for(
        "the second enqueue to wait on the first",
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                            WHERE datname = current_database() AND wait_event_type = 'Lock')",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        },
    )
    .await;
    first.commit().await.unwrap();
    let second_id = second.await.unwrap();
    assert_eq!(first_id, second_id);
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 1);
}

async fn enqueue_step_after(
    pool: &PgPool,
    fail_until: i32,
    parents: &[JobId],
    max_attempts: i32,
) -> JobId {
    skiplock::enqueue(
        pool,
        &Step { fail_until },
        EnqueueOptions::new()
            .depends_on(parents.iter().copied())
            .max_attempts(max_attempts),
    )
    .await
    .unwrap()
    .id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dependants_run_only_after_all_parents_succeed() {
    let db = test_db().await;
    let pool = &db.pool;
    // A chain a -> b -> c, and a fan-in of three parents into d.
    let a = enqueue_step_after(pool, 1, &[], 5).await;
    let b = enqueue_step_after(pool, 0, &[a], 5).await;
    let c = enqueue_step_after(pool, 0, &[b], 5).await;
    let fan: Vec<JobId> = [0, 1, 0]
        .iter()
        .map(|fail| enqueue_step_after(pool, *fail, &[], 5))
        .collect::<futures_util::future::JoinAll<_>>()
        .await;
    let d = enqueue_step_after(pool, 0, &fan, 5).await;
    for id in [b, c, d] {
        assert_eq!(state_of(pool, id.0).await, JobState::Waiting);
    }
    let timeline = Timeline::default();
    run_until_settled(pool, &timeline, 2).await;

    let runs = timeline.runs();
    let last_end = |id: JobId| runs[&id.0].last().unwrap().1;
    let first_start = |id: JobId| runs[&id.0][0].0;
    assert!(first_start(b) > last_end(a));
    assert!(first_start(c) > last_end(b));
    for parent in &fan {
        assert!(first_start(d) > last_end(*parent));
    }
    assert_eq!(count_in_state(pool, JobState::Succeeded).await, 7);
}

#[tokio::test]
async fn a_dead_parent_cancels_its_dependants_transitively() {
    let db = test_db().await;
    let pool = &db.pool;
    let parent = enqueue_step_after(pool, 99, &[], 1).await;
    let child = enqueue_step_after(pool, 0, &[parent], 5).await;
    let grandchild = enqueue_step_after(pool, 0, &[child], 5).await;
    let timeline = Timeline::default();
    run_until_settled(pool, &timeline, 1).await;

    assert_eq!(state_of(pool, parent.0).await, JobState::Dead);
    let child_row = skiplock::job(pool, child).await.unwrap().unwrap();
    assert_eq!(child_row.state, JobState::Cancelled);
    assert_eq!(
        child_row.last_error,
        Some(format!("parent job {parent} ended dead"))
    );
    let grandchild_row = skiplock::job(pool, grandchild).await.unwrap().unwrap();
    assert_eq!(grandchild_row.state, JobState::Cancelled);
    assert_eq!(
        grandchild_row.last_error,
        Some(format!("parent job {child} was cancelled"))
    );
    assert!(!timeline.runs().contains_key(&child.0));

    // A job enqueued after its parent died is cancelled at once; a missing parent is refused.
    let late = enqueue_step_after(pool, 0, &[parent], 5).await;
    assert_eq!(state_of(pool, late.0).await, JobState::Cancelled);
    let error = skiplock::enqueue(
        pool,
        &Step { fail_until: 0 },
        EnqueueOptions::new().depends_on([JobId(987_654)]),
    )
    .await
    .unwrap_err();
    assert!(matches!(error, Error::InvalidJob(_)));
    assert_eq!(
        error.to_string(),
        "invalid job: parent job 987654 does not exist"
    );
}

#[tokio::test]
async fn cancelling_a_waiting_parent_cancels_children_and_sql_enqueue_takes_dependencies() {
    let db = test_db().await;
    let pool = &db.pool;
    let parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('step', '{\"fail_until\": 0}', scheduled_at => now() + interval '1 hour')")
        .fetch_one(pool)
        .await
        .unwrap();
    let child: i64 = sqlx::query_scalar(
        "SELECT skiplock.enqueue('step', '{\"fail_until\": 0}', depends_on => ARRAY[$1])",
    )
    .bind(parent)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(state_of(pool, child).await, JobState::Waiting);
    assert!(skiplock::cancel(pool, JobId(parent)).await.unwrap());
    let row = skiplock::job(pool, JobId(child)).await.unwrap().unwrap();
    assert_eq!(row.state, JobState::Cancelled);
    assert_eq!(
        row.last_error,
        Some(format!("parent job {parent} ended cancelled"))
    );
}
