//! Regression tests for the defects listed in issue 12. Each test pins the fixed
//! behaviour; on the code before the fix each one fails (an assertion, or a bounded wait
//! that runs out because a worker never finishes).
//!
//! Issue 12, item 4 (a worker's held claims keyed by job id only) has no test here: making
//! a worker re-claim a job it still holds under an older token, before the older outcome
//! is processed, depends on task scheduling inside the worker and cannot be forced from
//! outside; the fix covers it with a unit test of the worker's claim map instead.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fixtures::{
    Record, Recorder, count_in_state, fast_worker, sql_claim_one, state_if_any, state_of, wait_for,
};
use common::test_db;
use serde::{Deserialize, Serialize};
use serde_json::json;
use skiplock::{
    EnqueueOptions, Job, JobContext, JobError, JobState, NewJob, Retention, UniquePolicy, Worker,
    WorkerBuilder, WorkerSummary,
};
use sqlx::{AssertSqlSafe, PgPool};

/// Longest a worker run may take in these tests. With the fixes each run settles within a
/// few seconds; before them, several workers never finish (a claim or an outcome write
/// fails on every try), and this bound turns that into a test failure.
const RUN_LIMIT: Duration = Duration::from_secs(30);

/// Longest any database condition is awaited.
const WAIT_LIMIT: Duration = Duration::from_secs(30);

/// Start and end ticks of each run, by job id.
type Runs = HashMap<i64, Vec<(u64, u64)>>;

/// A global event counter and the (start, end) ticks of each run, by job id.
#[derive(Default, Clone)]
struct Timeline {
    clock: Arc<AtomicU64>,
    runs: Arc<Mutex<Runs>>,
}

impl Timeline {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst)
    }

    fn runs(&self) -> Runs {
        self.runs.lock().unwrap().clone()
    }

    fn ran(&self, id: i64) -> bool {
        self.runs.lock().unwrap().contains_key(&id)
    }
}

/// Kind `k`, the kind the plain-SQL rows of these tests use. Records its start and end
/// ticks; it stays busy for 50 ms in between so that two runs that overlap show it (the
/// pause widens a window, it synchronises nothing).
#[derive(Serialize, Deserialize, Clone)]
struct K {}

impl Job for K {
    const KIND: &'static str = "k";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let timeline = ctx.data::<Timeline>().expect("worker was given a Timeline");
        let start = timeline.tick();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let end = timeline.tick();
        timeline
            .runs
            .lock()
            .unwrap()
            .entry(ctx.id().0)
            .or_default()
            .push((start, end));
        Ok(())
    }
}

/// A worker on `pool` running kind `k` with short intervals.
fn k_worker(pool: &PgPool, timeline: &Timeline) -> WorkerBuilder {
    Worker::builder(pool.clone())
        .data(timeline.clone())
        .register::<K>()
        .poll_interval(Duration::from_millis(100))
        .heartbeat(Duration::from_millis(100), Duration::from_secs(3))
        .reap_interval(Duration::from_millis(100))
        .prune_interval(None)
        .cron_interval(None)
}

/// Runs an `exit_when_idle` worker on `pool` to its end, failing the test if it takes
/// longer than [`RUN_LIMIT`] (what a worker stuck on a failing claim or outcome write
/// does); the failure lists the unfinished jobs.
async fn run_to_idle(pool: &PgPool, builder: WorkerBuilder, what: &str) -> WorkerSummary {
    let worker = builder.exit_when_idle(true).build().unwrap();
    match tokio::time::timeout(RUN_LIMIT, worker.run()).await {
        Ok(summary) => summary.unwrap(),
        Err(_) => {
            let unfinished: Vec<(i64, String, JobState)> = sqlx::query_as(
                "SELECT id, kind, state FROM skiplock.jobs
                 WHERE state IN ('waiting', 'queued', 'running') ORDER BY id",
            )
            .fetch_all(pool)
            .await
            .unwrap();
            panic!(
                "{what}: the worker did not finish within {RUN_LIMIT:?}; unfinished jobs \
                 (id, kind, state): {unfinished:?}"
            )
        }
    }
}

/// Runs a worker in the background until `done` holds (or [`WAIT_LIMIT`] runs out), then
/// shuts it down and waits for it.
async fn run_until<F, Fut>(builder: WorkerBuilder, what: &str, done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let worker = builder.build().unwrap();
    let stop = worker.shutdown_handle();
    let running = tokio::spawn(worker.run());
    wait_for(what, WAIT_LIMIT, done).await;
    stop.shutdown();
    tokio::time::timeout(RUN_LIMIT, running)
        .await
        .expect("the worker stops after shutdown")
        .unwrap()
        .unwrap();
}

async fn scalar_i64(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn last_error_of(pool: &PgPool, id: i64) -> Option<String> {
    sqlx::query_scalar("SELECT last_error FROM skiplock.jobs WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn running_count(pool: &PgPool) -> i64 {
    count_in_state(pool, JobState::Running).await
}

/// The ids `skiplock.internal_claim_batch` hands out for kind `k` in queue `default`, sorted.
async fn claim_k(pool: &PgPool, max: i64) -> sqlx::Result<Vec<i64>> {
    let mut ids: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM skiplock.internal_claim_batch('default', ARRAY['k'], $1, 'test-claimer')",
    )
    .bind(max)
    .fetch_all(pool)
    .await?;
    ids.sort_unstable();
    Ok(ids)
}

/// Finishes a claimed job as a worker's completer would, and moves its lane on.
async fn complete_by_sql(pool: &PgPool, id: i64) {
    let lane: Option<String> = sqlx::query_scalar(
        "UPDATE skiplock.jobs SET state = 'succeeded', finished_at = now(), claim_token = NULL,
                                  heartbeat_at = NULL
         WHERE id = $1 AND state = 'running' RETURNING ordering_key",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap();
    if let Some(lane) = lane {
        sqlx::query("SELECT skiplock.internal_advance_lanes(ARRAY[$1])")
            .bind(lane)
            .execute(pool)
            .await
            .unwrap();
    }
}

/// Inserts the plain-SQL lane rows of issue 12 item 1: two jobs of lane `a`, both
/// `queued` (plain SQL knows nothing of `waiting`), and one job without a lane. Returns
/// (first lane job, second lane job, lane-less job).
async fn insert_plain_sql_lane(pool: &PgPool) -> (i64, i64, i64) {
    let lane: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, ordering_key)
         VALUES ('k', '{}', 'a'), ('k', '{}', 'a') RETURNING id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let plain: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args) VALUES ('k', '{}') RETURNING id",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let (first, second) = (lane[0].min(lane[1]), lane[0].max(lane[1]));
    (first, second, plain)
}

// ---------------------------------------------------------------------------------------
// Item 1: lanes written by plain SQL.

/// Issue 12 item 1: two jobs of one lane inserted by plain SQL are both `queued`; the
/// claim took both and failed on the running jobs' unique index, so nothing ever ran.
/// Fixed: all three jobs succeed, and the lane's jobs run one at a time, in id order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_sql_lane_jobs_run_one_at_a_time_in_id_order() {
    let db = test_db().await;
    let (first, second, plain) = insert_plain_sql_lane(&db.pool).await;
    let timeline = Timeline::default();

    run_to_idle(&db.pool, k_worker(&db.pool, &timeline), "plain-SQL lane").await;

    let runs = timeline.runs();
    for id in [first, second, plain] {
        assert_eq!(
            runs.get(&id).map(Vec::len),
            Some(1),
            "job {id} ran exactly once: {runs:?}"
        );
        assert_eq!(
            state_of(&db.pool, id).await,
            JobState::Succeeded,
            "job {id}"
        );
    }
    let (a, b) = (runs[&first][0], runs[&second][0]);
    assert!(
        a.1 < b.0,
        "lane a: job {first} (ticks {a:?}) must end before job {second} (ticks {b:?}) starts"
    );
}

/// Issue 12 item 1, at the SQL level: `claim_batch` on two `queued` jobs of one lane
/// raised a duplicate key error on the running jobs' unique index. Fixed: the insert
/// stores the second lane job `waiting`, a hand-written UPDATE that makes it `queued`
/// while the head is queued is refused (`jobs_lane_turn_idx`: a lane has one turn), and
/// the claim returns the lane's head and the lane-less job, leaving the second waiting.
#[tokio::test]
async fn claim_batch_takes_only_the_lowest_id_job_of_a_plain_sql_lane() {
    let db = test_db().await;
    let (first, second, plain) = insert_plain_sql_lane(&db.pool).await;
    assert_eq!(state_of(&db.pool, second).await, JobState::Waiting);
    let error = sqlx::query("UPDATE skiplock.jobs SET state = 'queued' WHERE id = $1")
        .bind(second)
        .execute(&db.pool)
        .await
        .expect_err("a second turn in the lane");
    assert!(error.to_string().contains("jobs_lane_turn_idx"), "{error}");

    let claimed = claim_k(&db.pool, 10)
        .await
        .unwrap_or_else(|e| panic!("claim_batch failed: {e}"));

    let mut expected = vec![first, plain];
    expected.sort_unstable();
    assert_eq!(
        claimed, expected,
        "claimed the lane head and the lane-less job"
    );
    assert_eq!(state_of(&db.pool, second).await, JobState::Waiting);
}

/// Issue 12 item 1, the race: two REPEATABLE READ transactions whose snapshots predate
/// each other's enqueue both see lane `b` empty, so both jobs go in `queued`; a claim then
/// took both and failed. Fixed: successive claims (completing each job in between) never
/// hand out two jobs of lane `b` at once, hand them out in id order, and never fail.
///
/// A fix may instead refuse the second enqueue with a serialization failure (SQLSTATE
/// 40001, the usual answer of REPEATABLE READ); that is accepted, and the claims are then
/// checked on the one job that went in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeatable_read_enqueues_into_one_lane_are_claimed_one_at_a_time() {
    let db = test_db().await;
    let mut first = db.pool.begin().await.unwrap();
    let mut second = db.pool.begin().await.unwrap();
    for tx in [&mut first, &mut second] {
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut **tx)
            .await
            .unwrap();
    }
    // The first statement of each transaction fixes its snapshot.
    let _: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *first)
        .await
        .unwrap();
    let second_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *second)
        .await
        .unwrap();

    let enqueue = "SELECT skiplock.enqueue('k', '{}', ordering_key => 'b')";
    let first_id: i64 = sqlx::query_scalar(enqueue)
        .fetch_one(&mut *first)
        .await
        .unwrap();
    let second_enqueue = tokio::spawn(async move {
        let result: sqlx::Result<i64> = sqlx::query_scalar(enqueue).fetch_one(&mut *second).await;
        (second, result)
    });
    // The second enqueue waits for the first's lane lock (or, with a fix, may not wait at
    // all): go on once it is blocked on a lock or has finished.
    wait_for(
        "the second enqueue to block on the lane lock or finish",
        WAIT_LIMIT,
        || async {
            second_enqueue.is_finished()
                || sqlx::query_scalar::<_, bool>(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                                    WHERE pid = $1 AND wait_event_type = 'Lock')",
                )
                .bind(second_pid)
                .fetch_one(&db.pool)
                .await
                .unwrap()
        },
    )
    .await;
    first.commit().await.unwrap();
    let (second, result) = second_enqueue.await.unwrap();
    let mut lane_ids = vec![first_id];
    match result {
        Ok(id) => {
            second.commit().await.unwrap();
            lane_ids.push(id);
        }
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("40001") => {
            second.rollback().await.unwrap();
        }
        Err(e) => panic!("the second enqueue failed: {e}"),
    }
    lane_ids.sort_unstable();

    let mut claim_order = Vec::new();
    for round in 0..10 {
        let claimed = claim_k(&db.pool, 10)
            .await
            .unwrap_or_else(|e| panic!("claim {round} failed: {e}"));
        assert!(
            claimed.len() <= 1,
            "claim {round} handed out {claimed:?}, more than one job of lane b"
        );
        let Some(&id) = claimed.first() else { break };
        claim_order.push(id);
        complete_by_sql(&db.pool, id).await;
    }
    assert_eq!(
        claim_order, lane_ids,
        "every lane job claimed once, in id order"
    );
}

// ---------------------------------------------------------------------------------------
// Item 2: an outcome write that fails for one row must not leave the batch running.

/// Ids of the successors that `Supersede` handlers enqueued.
#[derive(Default, Clone)]
struct Successors(Arc<Mutex<Vec<i64>>>);

/// Kind `supersede`: enqueues a `successor` job with its own unique key `u` (allowed: the
/// unique index covers only pending jobs, and this one runs), then fails retryably.
#[derive(Serialize, Deserialize, Clone)]
struct Supersede {}

impl Job for Supersede {
    const KIND: &'static str = "supersede";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let successor = NewJob::new(Successor::KIND, json!({}))
            .with_options(EnqueueOptions::new().unique_key("u", UniquePolicy::Skip));
        enqueue_then_fail(&ctx, successor).await
    }
}

/// Kind `supersede_merge`: as `supersede`, under the policy `merge` on the key `m` (its
/// args are whatever merged payloads it holds).
#[derive(Serialize, Deserialize, Clone)]
#[serde(transparent)]
struct SupersedeMerge(serde_json::Value);

impl Job for SupersedeMerge {
    const KIND: &'static str = "supersede_merge";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let successor = NewJob::new(Successor::KIND, json!({"from": "successor"}))
            .with_options(EnqueueOptions::new().unique_key("m", UniquePolicy::Merge));
        enqueue_then_fail(&ctx, successor).await
    }
}

/// Enqueues `successor` (noting its id in [`Successors`]), then fails retryably.
async fn enqueue_then_fail(ctx: &JobContext, successor: NewJob) -> Result<(), JobError> {
    let ids = skiplock::enqueue_raw(ctx.pool(), &[successor])
        .await
        .map_err(|e| JobError::permanent(format!("test setup: enqueue failed: {e}")))?;
    ctx.data::<Successors>()
        .unwrap()
        .0
        .lock()
        .unwrap()
        .push(ids[0].id.0);
    Err(JobError::retry(
        "planned failure after enqueueing a successor",
    ))
}

/// Kind `successor`: succeeds.
#[derive(Serialize, Deserialize, Clone)]
struct Successor {}

impl Job for Successor {
    const KIND: &'static str = "successor";

    async fn run(self, _ctx: JobContext) -> Result<(), JobError> {
        Ok(())
    }
}

/// Kind `fails_once`: fails its first attempt, asking to be retried at once (so a worker
/// with `exit_when_idle` still sees it as runnable), then succeeds.
#[derive(Serialize, Deserialize, Clone)]
struct FailsOnce {}

impl Job for FailsOnce {
    const KIND: &'static str = "fails_once";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        if ctx.attempt() == 1 {
            return Err(JobError::retry_after(
                Duration::ZERO,
                "planned first failure",
            ));
        }
        Ok(())
    }
}

/// A worker running the fixtures' kinds and `FailsOnce` with short intervals.
fn batch_worker(pool: &PgPool) -> WorkerBuilder {
    fast_worker(pool, &Recorder::default()).register::<FailsOnce>()
}

/// Enqueues `n` `Record` jobs and `n` `FailsOnce` jobs, the "other jobs" of the batch
/// tests, whose outcomes share the completer's batches with the job under test; returns
/// their ids.
async fn enqueue_bystanders(pool: &PgPool, n: u32) -> Vec<i64> {
    let mut ids = Vec::new();
    for i in 0..n {
        ids.push(
            skiplock::enqueue(pool, &Record { n: i }, EnqueueOptions::default())
                .await
                .unwrap()
                .id
                .0,
        );
        ids.push(
            skiplock::enqueue(pool, &FailsOnce {}, EnqueueOptions::default())
                .await
                .unwrap()
                .id
                .0,
        );
    }
    ids
}

async fn assert_all_succeeded(pool: &PgPool, ids: &[i64]) {
    for &id in ids {
        assert_eq!(state_of(pool, id).await, JobState::Succeeded, "job {id}");
    }
}

/// Issue 12 item 2(a): a job whose handler enqueued a pending job with its own unique key,
/// then failed retryably, could not go back to `queued` (the retry hit
/// `jobs_unique_key_pending_idx`); the whole failure batch errored and the job stayed
/// `running` (the worker never went idle). Fixed: the failing job ends `cancelled`,
/// superseded by the pending holder of the key, which runs instead; the other jobs of the
/// run are unaffected and nothing stays running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_blocked_by_a_pending_unique_key_is_superseded_not_left_running() {
    let db = test_db().await;
    let a = skiplock::enqueue(
        &db.pool,
        &Supersede {},
        EnqueueOptions::new().unique_key("u", UniquePolicy::Skip),
    )
    .await
    .unwrap()
    .id
    .0;
    let others = enqueue_bystanders(&db.pool, 5).await;
    let b = run_until_superseded::<Supersede>(&db.pool, a).await;
    assert_all_succeeded(&db.pool, &others).await;

    run_to_idle(
        &db.pool,
        fast_worker(&db.pool, &Recorder::default()).register::<Successor>(),
        "worker running B",
    )
    .await;
    assert_eq!(state_of(&db.pool, b).await, JobState::Succeeded, "job B");
    assert_eq!(running_count(&db.pool).await, 0, "nothing stays running");
}

/// Runs job `a` (of kind `J`, which enqueues a successor B into its own unique key and
/// then fails retryably) on a worker that does not run `successor`, so B is still pending
/// when A's failure is written, whatever the timing; checks that A ended cancelled,
/// superseded by B, and returns B's id.
async fn run_until_superseded<J: Job>(pool: &PgPool, a: i64) -> i64 {
    let successors = Successors::default();
    run_to_idle(
        pool,
        batch_worker(pool).data(successors.clone()).register::<J>(),
        "worker running A",
    )
    .await;
    let b = *successors
        .0
        .lock()
        .unwrap()
        .first()
        .expect("A's handler enqueued B");
    assert_eq!(state_of(pool, a).await, JobState::Cancelled, "job A");
    let message = last_error_of(pool, a).await.unwrap_or_default();
    assert!(
        message.contains("superseded") && message.contains(&b.to_string()),
        "A's last_error names the job that superseded it ({b}): {message:?}"
    );
    b
}

/// A superseded retry under the policy `merge` loses no payload: its own payloads are
/// folded into the pending holder of the key, ahead of the holder's (issue 31: only the
/// model reached this path, 0–2 times per seed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseded_merge_retry_folds_its_payloads_into_the_key_holder() {
    let db = test_db().await;
    let a = skiplock::enqueue_raw(
        &db.pool,
        &[NewJob::new(SupersedeMerge::KIND, json!({"from": "first"}))
            .with_options(EnqueueOptions::new().unique_key("m", UniquePolicy::Merge))],
    )
    .await
    .unwrap()[0]
        .id
        .0;
    let b = run_until_superseded::<SupersedeMerge>(&db.pool, a).await;
    let b_args: serde_json::Value =
        sqlx::query_scalar("SELECT args FROM skiplock.jobs WHERE id = $1")
            .bind(b)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        b_args,
        json!([{"from": "first"}, {"from": "successor"}]),
        "B holds A's payload first, then its own"
    );
}

/// Kind `nul_error`: fails with a message holding a NUL byte, which Postgres text cannot
/// store.
#[derive(Serialize, Deserialize, Clone)]
struct NulError {}

impl Job for NulError {
    const KIND: &'static str = "nul_error";
    const MAX_ATTEMPTS: i32 = 1;

    async fn run(self, _ctx: JobContext) -> Result<(), JobError> {
        Err(JobError::retry("bad\0byte"))
    }
}

/// Issue 12 item 2(b): a handler error containing a NUL byte made the failure write fail
/// with "invalid byte sequence for encoding UTF8: 0x00", leaving the job (and every other
/// job of that batch) `running`. Fixed: the job ends `dead` with a readable last_error
/// (the NUL replaced), and the other jobs are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_byte_in_an_error_message_is_replaced_and_the_job_dies() {
    let db = test_db().await;
    let job = skiplock::enqueue(&db.pool, &NulError {}, EnqueueOptions::default())
        .await
        .unwrap()
        .id
        .0;
    let others = enqueue_bystanders(&db.pool, 5).await;

    run_to_idle(
        &db.pool,
        batch_worker(&db.pool).register::<NulError>(),
        "NUL in an error message",
    )
    .await;

    assert_eq!(state_of(&db.pool, job).await, JobState::Dead);
    let message = last_error_of(&db.pool, job)
        .await
        .expect("last_error is recorded");
    assert_eq!(
        message, "bad\u{FFFD}byte",
        "the handler's message with the NUL replaced"
    );
    assert_all_succeeded(&db.pool, &others).await;
    assert_eq!(running_count(&db.pool).await, 0, "nothing stays running");
}

/// Issue 12 item 2(c): SQLSTATE 53100 (disk full, class 53 "insufficient resources") on a
/// completion was not retried: the completer gave up and the jobs stayed `running`.
/// Fixed: the completer treats class 53 as transient, retries, and the jobs succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_off_disk_full_error_on_completion_is_retried() {
    a_one_off_error_on_completion_is_retried("53100", "disk full (injected)").await;
}

/// Issue 31: a read-only server (SQLSTATE 25006, read_only_sql_transaction: a standby, or a
/// primary in the middle of a failover) is a condition of the server, retried like a lost
/// connection, not a failure of the jobs. Fails when 25006 is not among the transient
/// codes (`src/error.rs`, `is_transient_sqlx`): the completions are given up and the jobs
/// stay `running`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_off_read_only_error_on_completion_is_retried() {
    a_one_off_error_on_completion_is_retried(
        "25006",
        "cannot execute UPDATE in a read-only transaction (injected)",
    )
    .await;
    // And the error a read-only transaction really raises is classified so.
    let db = test_db().await;
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION READ ONLY")
        .execute(&mut *tx)
        .await
        .unwrap();
    let error = skiplock::enqueue(&mut *tx, &Record { n: 1 }, EnqueueOptions::default())
        .await
        .expect_err("an enqueue in a read-only transaction fails");
    assert!(error.is_transient(), "{error}");
    assert!(error.to_string().contains("read-only"), "{error}");
}

/// The first completion write raises SQLSTATE `code` with `message` (a trigger, counting
/// its calls with a sequence, which is not rolled back with the failed statement); the
/// worker must retry it and every job succeed.
async fn a_one_off_error_on_completion_is_retried(code: &str, message: &str) {
    let db = test_db().await;
    let trigger = format!(
        "CREATE FUNCTION public.inject_error() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.state = 'succeeded' AND OLD.state = 'running' THEN
                 IF nextval('public.injected_calls') = 1 THEN
                     RAISE EXCEPTION '{message}' USING ERRCODE = '{code}';
                 END IF;
             END IF;
             RETURN NEW;
         END;
         $$"
    );
    for statement in [
        "CREATE SEQUENCE public.injected_calls".to_owned(),
        trigger,
        "CREATE TRIGGER inject_error BEFORE UPDATE ON skiplock.jobs
         FOR EACH ROW EXECUTE FUNCTION public.inject_error()"
            .to_owned(),
    ] {
        sqlx::query(AssertSqlSafe(statement))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let mut ids = Vec::new();
    for n in 0..5 {
        ids.push(
            skiplock::enqueue(&db.pool, &Record { n }, EnqueueOptions::default())
                .await
                .unwrap()
                .id
                .0,
        );
    }

    run_to_idle(
        &db.pool,
        fast_worker(&db.pool, &Recorder::default()),
        &format!("SQLSTATE {code} on completion"),
    )
    .await;

    let injected: bool = sqlx::query_scalar("SELECT is_called FROM public.injected_calls")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(injected, "the trigger raised the injected error");
    assert_all_succeeded(&db.pool, &ids).await;
    assert_eq!(running_count(&db.pool).await, 0, "nothing stays running");
    let errors: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs WHERE jsonb_array_length(errors) > 0",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        errors, 0,
        "no job recorded the server's condition as its failure"
    );
}

// ---------------------------------------------------------------------------------------
// Item 3: the reaper with a unique-key conflict.

/// A `running` row of kind `k` written by hand, held by a worker gone an hour ago, with the
/// unique key `$1` (skip policy) if not null.
const INSERT_STALE: &str = "INSERT INTO skiplock.jobs
         (kind, args, state, claim_token, claimed_by, claimed_at, heartbeat_at, attempt,
          unique_key, unique_policy)
     VALUES ('k', '{}', 'running', gen_random_uuid(), 'gone', now() - interval '1 hour',
             now() - interval '1 hour', 1, $1, CASE WHEN $1 IS NOT NULL THEN 'skip' END)
     RETURNING id";

/// Writes a `running` row by hand whose heartbeat is an hour old (its worker is gone),
/// with `unique_key` if given; returns its id.
async fn insert_stale(pool: &PgPool, unique_key: Option<&str>) -> i64 {
    sqlx::query_scalar(INSERT_STALE)
        .bind(unique_key)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Issue 12 item 3: the reaper returns stale jobs to `queued` in one statement; a stale
/// job whose unique key is held by a pending job made that statement fail for every row,
/// so no stale job was ever reaped. Fixed: the unrelated stale job is reaped and runs,
/// and the conflicting one ends `cancelled`, superseded by the pending holder of its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_supersedes_a_stale_job_whose_unique_key_is_pending() {
    let db = test_db().await;
    let a = insert_stale(&db.pool, Some("r")).await;
    let b: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, scheduled_at, unique_key, unique_policy)
         VALUES ('k', '{}', now() + interval '1 day', 'r', 'skip') RETURNING id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let c = insert_stale(&db.pool, None).await;

    let timeline = Timeline::default();
    let pool = db.pool.clone();
    run_until(
        k_worker(&db.pool, &timeline)
            .heartbeat(Duration::from_millis(100), Duration::from_millis(500))
            .reap_interval(Duration::from_millis(100)),
        "stale job C to be reaped and succeed",
        || {
            let pool = pool.clone();
            async move { state_of(&pool, c).await == JobState::Succeeded }
        },
    )
    .await;

    assert_eq!(state_of(&db.pool, a).await, JobState::Cancelled, "job A");
    let message = last_error_of(&db.pool, a).await.unwrap_or_default();
    assert!(
        message.contains("superseded"),
        "A's last_error says it was superseded: {message:?}"
    );
    assert_eq!(
        state_of(&db.pool, b).await,
        JobState::Queued,
        "job B still pending"
    );
}

/// Between its full passes the reaper looks only at heartbeats since its previous pass
/// (so a held snapshot does not make every pass walk every job processed meanwhile). A
/// `running` row written by hand with an hour-old heartbeat after the reaper started lies
/// below every window: a full pass, which comes at least every 12 reap intervals, takes
/// it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_row_written_below_the_reapers_window_is_reaped_by_a_full_pass() {
    let db = test_db().await;
    let first = insert_stale(&db.pool, None).await;
    let timeline = Timeline::default();
    let pool = db.pool.clone();
    run_until(
        k_worker(&db.pool, &timeline)
            .heartbeat(Duration::from_millis(100), Duration::from_millis(500))
            .reap_interval(Duration::from_millis(100)),
        "both hand-written stale rows to be reaped and succeed",
        || {
            let pool = pool.clone();
            async move {
                if state_of(&pool, first).await != JobState::Succeeded {
                    return false;
                }
                // The first full pass is done: the reaper works in windows now.
                static SECOND: tokio::sync::OnceCell<i64> = tokio::sync::OnceCell::const_new();
                let second = *SECOND.get_or_init(|| insert_stale(&pool, None)).await;
                state_of(&pool, second).await == JobState::Succeeded
            }
        },
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// Item 5: dependencies.

/// A job of kind `k` enqueued with `skiplock.enqueue`, runnable now.
async fn enqueue_now(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT skiplock.enqueue('k', '{}')")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A job of kind `k` enqueued with `skiplock.enqueue`, due only tomorrow.
async fn enqueue_tomorrow(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT skiplock.enqueue('k', '{}', scheduled_at => now() + interval '1 day')",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A job of kind `k` enqueued with `skiplock.enqueue(…, depends_on => parents)`.
async fn enqueue_child(pool: &PgPool, parents: &[i64]) -> i64 {
    sqlx::query_scalar("SELECT skiplock.enqueue('k', '{}', depends_on => $1)")
        .bind(parents)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Issue 12 item 5(a): cancelling a parent cancelled its grandchildren through a child
/// that had already succeeded (the recursion followed every edge, whatever the child's
/// state). Fixed: the grandchild G, whose parents are the succeeded C and the pending Y,
/// stays `waiting`.
#[tokio::test]
async fn cancelling_a_retried_parent_spares_grandchildren_of_a_succeeded_child() {
    let db = test_db().await;
    let pool = &db.pool;
    let x = enqueue_now(pool).await;
    let c = enqueue_child(pool, &[x]).await;
    let y = enqueue_tomorrow(pool).await;
    let g = enqueue_child(pool, &[c, y]).await;

    for id in [x, c] {
        sqlx::query(
            "UPDATE skiplock.jobs SET state = 'succeeded', finished_at = now() WHERE id = $1",
        )
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
        sqlx::query("SELECT skiplock.internal_settle_dependants(ARRAY[$1::bigint])")
            .bind(id)
            .execute(pool)
            .await
            .unwrap();
        if id == x {
            assert_eq!(
                state_of(pool, c).await,
                JobState::Queued,
                "C queued after X"
            );
        }
    }
    assert_eq!(state_of(pool, g).await, JobState::Waiting, "G waits for Y");

    let retried: bool = sqlx::query_scalar("SELECT skiplock.retry_job($1)")
        .bind(x)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(retried, "X retried");
    let cancelled: bool = sqlx::query_scalar("SELECT skiplock.cancel_job($1)")
        .bind(x)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(cancelled, "X cancelled");

    assert_eq!(
        state_of(pool, c).await,
        JobState::Succeeded,
        "C keeps its success"
    );
    assert_eq!(
        state_of(pool, g).await,
        JobState::Waiting,
        "G still waits (C succeeded, Y pending); last_error: {:?}",
        last_error_of(pool, g).await
    );
}

/// Issue 12 item 5(b): deleting a parent removed the dependency row (ON DELETE CASCADE),
/// and the sweep then queued the orphaned child as if every parent had succeeded, so it
/// ran. Fixed: the child never runs and ends `cancelled`, its last_error naming the
/// deleted parent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_of_a_deleted_parent_is_cancelled_not_run() {
    let db = test_db().await;
    let pool = &db.pool;
    let p = enqueue_tomorrow(pool).await;
    let c = enqueue_child(pool, &[p]).await;
    assert_eq!(state_of(pool, c).await, JobState::Waiting);
    sqlx::query("DELETE FROM skiplock.jobs WHERE id = $1")
        .bind(p)
        .execute(pool)
        .await
        .unwrap();

    let timeline = Timeline::default();
    let watched = pool.clone();
    run_until(
        k_worker(pool, &timeline),
        "the child of the deleted parent to be settled",
        || {
            let pool = watched.clone();
            async move {
                !matches!(
                    state_of(&pool, c).await,
                    JobState::Waiting | JobState::Queued | JobState::Running
                )
            }
        },
    )
    .await;

    assert!(
        !timeline.ran(c),
        "C must never run: its parent {p} was deleted"
    );
    assert_eq!(state_of(pool, c).await, JobState::Cancelled, "job C");
    let message = last_error_of(pool, c).await.unwrap_or_default();
    assert!(
        message.contains(&p.to_string()),
        "C's last_error names the deleted parent {p}: {message:?}"
    );
}

/// Issue 12, found by the third 30-minute model run: after an unfinished parent was
/// deleted by hand and its waiting child cancelled, `retry_job` of the child found no
/// dependency row (the foreign key's cascade had deleted it with the parent) and queued the
/// child, which ran. Fixed: the row stays as a tombstone of the parent,
/// the retried child is cancelled again with the reason, and `job_dependencies_of` lists
/// the deleted parent.
#[tokio::test]
async fn retrying_a_child_of_a_deleted_unfinished_parent_cancels_it_again() {
    let db = test_db().await;
    let pool = &db.pool;
    let p = enqueue_tomorrow(pool).await;
    let c = enqueue_child(pool, &[p]).await;
    sqlx::query("DELETE FROM skiplock.jobs WHERE id = $1")
        .bind(p)
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(
        state_of(pool, c).await,
        JobState::Cancelled,
        "C after the delete"
    );

    let retried: bool = sqlx::query_scalar("SELECT skiplock.retry_job($1)")
        .bind(c)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(retried, "retry_job accepts the cancelled child");
    assert_eq!(
        state_of(pool, c).await,
        JobState::Cancelled,
        "C after its retry: its parent can never succeed"
    );
    let message = last_error_of(pool, c).await.unwrap_or_default();
    assert_eq!(
        message,
        format!("parent job {p} was deleted while queued"),
        "C's last_error"
    );
    let parents = skiplock::db::admin::job_dependencies_of(pool, skiplock::JobId(c))
        .await
        .unwrap();
    assert_eq!(parents.len(), 1, "C's dependencies: {parents:?}");
    assert!(parents[0].deleted, "the parent is listed as deleted");
    assert_eq!(
        parents[0].state,
        JobState::Queued,
        "the parent's state when deleted"
    );
}

/// The other side of the tombstones: a parent deleted after it succeeded (as the pruner
/// deletes it) leaves a satisfied edge, so its child, retried later, runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_retried_after_its_succeeded_parent_was_pruned_runs() {
    let db = test_db().await;
    let pool = &db.pool;
    let p = enqueue_now(pool).await;
    let c = enqueue_child(pool, &[p]).await;
    let timeline = Timeline::default();
    run_to_idle(pool, k_worker(pool, &timeline), "parent and child").await;
    assert_eq!(state_of(pool, c).await, JobState::Succeeded, "C");
    sqlx::query("DELETE FROM skiplock.jobs WHERE id = $1")
        .bind(p)
        .execute(pool)
        .await
        .unwrap();
    let retried: bool = sqlx::query_scalar("SELECT skiplock.retry_job($1)")
        .bind(c)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(retried, "retry_job accepts the succeeded child");
    assert_eq!(
        state_of(pool, c).await,
        JobState::Queued,
        "C after its retry"
    );
    run_to_idle(pool, k_worker(pool, &timeline), "the retried child").await;
    assert_eq!(state_of(pool, c).await, JobState::Succeeded, "C ran again");
}

/// Issue 12 item 5(c): the pruner deleted a dead parent while a child still waited on it
/// (its settle had not happened yet); the dependency row went with it and the sweep then
/// queued the child, which ran. Fixed: the child does not run and ends `cancelled`.
///
/// The pruner runs every 50 ms and the dependency sweep only every 2 s, so before the fix
/// the parent is pruned before any sweep could settle the child.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pruning_a_dead_parent_cancels_its_waiting_child() {
    let db = test_db().await;
    let pool = &db.pool;
    let p: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, state, attempt, max_attempts, finished_at,
                                    last_error)
         VALUES ('k', '{}', 'dead', 1, 1, now() - interval '1 day', 'planned death')
         RETURNING id",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let c: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, state) VALUES ('k', '{}', 'waiting') RETURNING id",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO skiplock.job_dependencies (job_id, parent_id) VALUES ($1, $2)")
        .bind(c)
        .bind(p)
        .execute(pool)
        .await
        .unwrap();

    let timeline = Timeline::default();
    let watched = pool.clone();
    run_until(
        k_worker(pool, &timeline)
            .reap_interval(Duration::from_secs(2))
            .prune_interval(Some(Duration::from_millis(50)))
            // Cancelled jobs are kept so the test can read C's final state.
            .retention(Retention {
                succeeded: Duration::ZERO,
                cancelled: Duration::from_secs(24 * 3600),
                dead: Duration::ZERO,
            }),
        "the child of the pruned parent to be settled",
        || {
            let pool = watched.clone();
            async move {
                !matches!(
                    state_if_any(&pool, c).await,
                    Some(JobState::Waiting | JobState::Queued | JobState::Running)
                )
            }
        },
    )
    .await;

    assert!(!timeline.ran(c), "C must never run: its parent {p} died");
    assert_eq!(
        state_if_any(pool, c).await,
        Some(JobState::Cancelled),
        "job C"
    );
}

/// Issue 12 item 5(d): `retry_job` put a cancelled child straight back in `queued`
/// although its parent had not finished, so it would run before the parent. Fixed: it
/// goes back to `waiting`.
#[tokio::test]
async fn retrying_a_cancelled_child_of_an_unfinished_parent_makes_it_wait() {
    let db = test_db().await;
    let pool = &db.pool;
    let p = enqueue_tomorrow(pool).await;
    let c = enqueue_child(pool, &[p]).await;
    let cancelled: bool = sqlx::query_scalar("SELECT skiplock.cancel_job($1)")
        .bind(c)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(cancelled);
    let retried: bool = sqlx::query_scalar("SELECT skiplock.retry_job($1)")
        .bind(c)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(retried, "C is back in line");

    assert_eq!(state_of(pool, p).await, JobState::Queued, "P not finished");
    assert_eq!(
        state_of(pool, c).await,
        JobState::Waiting,
        "C waits for P again"
    );
}

// ---------------------------------------------------------------------------------------
// Item 6: cron.

/// Issue 12 item 6: a schedule row written by SQL that cannot produce a valid job made the
/// whole cron pass fail, so schedules after it (by name) never fired and the bad row got no
/// last_error. Fixed: the good schedule fires, and the bad row records why it cannot. (The
/// bad row was `max_attempts` 0, which the table now refuses as written; args over the
/// limit are the case a schedule can still carry.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_cron_row_does_not_stop_the_other_schedules() {
    let db = test_db().await;
    let pool = &db.pool;
    sqlx::raw_sql(
        "INSERT INTO skiplock.cron_schedules (name, expression, kind, max_attempts, last_slot_at)
         VALUES ('bad', '* * * * * *', 'k', 1, now() - interval '1 hour'),
                ('good', '* * * * * *', 'k', 1, now() - interval '1 hour');
         UPDATE skiplock.cron_schedules
         SET args = jsonb_build_object('p', repeat('x', 1100000)) WHERE name = 'bad'",
    )
    .execute(pool)
    .await
    .unwrap();

    let timeline = Timeline::default();
    let watched = pool.clone();
    run_until(
        k_worker(pool, &timeline).cron_interval(Some(Duration::from_millis(100))),
        "the good schedule to enqueue a job and the bad one to record an error",
        || {
            let pool = watched.clone();
            async move {
                sqlx::query_scalar::<_, bool>(
                    "SELECT EXISTS (SELECT 1 FROM skiplock.jobs WHERE kind = 'k')
                        AND (SELECT last_error IS NOT NULL FROM skiplock.cron_schedules
                             WHERE name = 'bad')",
                )
                .fetch_one(&pool)
                .await
                .unwrap()
            }
        },
    )
    .await;

    let good_job: Option<i64> =
        sqlx::query_scalar("SELECT last_job_id FROM skiplock.cron_schedules WHERE name = 'good'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(good_job.is_some(), "the good schedule recorded its job");
    let bad_error: String =
        sqlx::query_scalar("SELECT last_error FROM skiplock.cron_schedules WHERE name = 'bad'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(
        bad_error.contains("over the limit"),
        "the bad schedule's last_error says why it cannot fire: {bad_error:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Item 7: the args limit on the SQL paths.

/// Issue 12 item 7: the 1 MiB limit on `args` (octet_length(args::text)) was enforced only
/// by the Rust enqueue; `skiplock.enqueue` and a plain INSERT stored 3 MiB payloads.
/// Fixed: both refuse one byte over the limit with SQLSTATE 54000 (program_limit_exceeded)
/// and the sizes in the message, leave no row, and accept args of exactly the limit.
#[tokio::test]
async fn sql_enqueue_and_plain_insert_refuse_args_over_one_mebibyte() {
    const LIMIT: i64 = 1024 * 1024;
    let db = test_db().await;
    let pool = &db.pool;
    // `{"blob": "xx…x"}`: 12 bytes around the string.
    let args_of = |bytes: i64| format!("jsonb_build_object('blob', repeat('x', {bytes} - 12))");
    let size: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT octet_length(({})::text)::bigint",
        args_of(LIMIT)
    )))
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(size, LIMIT, "the payload measures as the limit does");
    let paths = [
        ("skiplock.enqueue", "SELECT skiplock.enqueue('k', {args})"),
        (
            "a plain INSERT",
            "INSERT INTO skiplock.jobs (kind, args) VALUES ('k', {args})",
        ),
    ];
    for (path, statement) in paths {
        let over = sqlx::query(AssertSqlSafe(
            statement.replace("{args}", &args_of(LIMIT + 1)),
        ))
        .execute(pool)
        .await;
        let Err(sqlx::Error::Database(error)) = &over else {
            panic!("{path} accepted args one byte over the limit: {over:?}");
        };
        assert_eq!(error.code().as_deref(), Some("54000"), "{path}: {error}");
        assert_eq!(
            error.message(),
            format!(
                "args are {} bytes, over the limit of {LIMIT} bytes",
                LIMIT + 1
            ),
            "{path}"
        );
        assert_eq!(
            scalar_i64(pool, "SELECT count(*) FROM skiplock.jobs").await,
            0,
            "{path} left a row"
        );

        sqlx::query(AssertSqlSafe(statement.replace("{args}", &args_of(LIMIT))))
            .execute(pool)
            .await
            .unwrap_or_else(|e| panic!("{path} refused args of exactly the limit: {e}"));
        assert_eq!(
            scalar_i64(pool, "SELECT count(*) FROM skiplock.jobs").await,
            1,
            "{path} stored the job at the limit"
        );
        sqlx::query("DELETE FROM skiplock.jobs")
            .execute(pool)
            .await
            .unwrap();
    }
}

/// A dependency added while its parent's completion is in flight. The completion
/// (`skiplock.internal_complete_claims`, schema version 9) locks the parent as an update does,
/// `FOR NO KEY UPDATE`, which the edge trigger's `FOR KEY SHARE` read of the parent did not
/// wait for: the trigger saw the parent still running and made the child wait, and the
/// completion, whose snapshot predates the edge, did not release it (only the sweep did,
/// seconds later). Fixed: the trigger reads the parent `FOR SHARE`, waits for the
/// completion, sees it succeeded, and leaves the child queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dependency_added_during_its_parents_completion_leaves_the_child_runnable() {
    let db = test_db().await;
    let pool = &db.pool;
    let parent = enqueue_now(pool).await;
    let (claimed, token): (i64, uuid::Uuid) = sqlx::query_as(
        "SELECT id, claim_token
         FROM skiplock.internal_claim_batch('default', ARRAY['k'], 1, 'test-claimer')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(claimed, parent);
    let child = enqueue_now(pool).await;

    let mut completion = pool.begin().await.unwrap();
    let completed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.internal_complete_claims(ARRAY[$1], ARRAY[$2])",
    )
    .bind(parent)
    .bind(token)
    .fetch_one(&mut *completion)
    .await
    .unwrap();
    assert_eq!(completed, 1);
    let edge = tokio::spawn({
        let pool = pool.clone();
        async move {
            sqlx::query("INSERT INTO skiplock.job_dependencies (job_id, parent_id) VALUES ($1, $2)")
                .bind(child)
                .bind(parent)
                .execute(&pool)
                .await
        }
    });
    wait_for(
        "the edge insert to wait for the completion, or to end",
        Duration::from_secs(20),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'
                   AND query LIKE 'INSERT INTO skiplock.job_dependencies%'",
            )
            .fetch_one(pool)
            .await
            .unwrap();
            waiting == 1 || edge.is_finished()
        },
    )
    .await;
    completion.commit().await.unwrap();
    edge.await.unwrap().unwrap();
    assert_eq!(state_of(pool, child).await, JobState::Queued);
}

// ---------------------------------------------------------------------------------------
// Issue 31: guarantees that had no test that would fail.

/// Kind `long_error`: fails for good with a message of 20,000 two-byte characters
/// (40,000 bytes; the cut at 8 KiB falls inside a character unless it is aligned).
#[derive(Serialize, Deserialize, Clone)]
struct LongError {}

/// The message [`LongError`] fails with: `"é"` 20,000 times after a one-byte `"x"`, so a
/// cut at an even byte count falls inside a character.
fn long_error_message() -> String {
    format!("x{}", "é".repeat(20_000))
}

impl Job for LongError {
    const KIND: &'static str = "long_error";
    const MAX_ATTEMPTS: i32 = 1;

    async fn run(self, _ctx: JobContext) -> Result<(), JobError> {
        Err(JobError::permanent(long_error_message()))
    }
}

/// A job's error message is cut to 8 KiB (`ERROR_MESSAGE_MAX_BYTES`), at a character
/// boundary, and marked; `last_error` and the `errors` entry say the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_error_message_is_cut_to_8_kib_at_a_character_boundary() {
    const MARK: &str = "… (truncated)";
    let db = test_db().await;
    let job = skiplock::enqueue(&db.pool, &LongError {}, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    run_to_idle(
        &db.pool,
        fast_worker(&db.pool, &Recorder::default()).register::<LongError>(),
        "a long error message",
    )
    .await;
    let row = skiplock::job(&db.pool, job).await.unwrap().unwrap();
    assert_eq!(row.state, JobState::Dead);
    let saved = row.last_error.expect("last_error is recorded");
    assert!(saved.len() <= 8 * 1024, "{} bytes saved", saved.len());
    assert!(
        saved.len() > 8 * 1024 - MARK.len() - 4,
        "the cut keeps as much as fits: {} bytes",
        saved.len()
    );
    let kept = saved
        .strip_suffix(MARK)
        .unwrap_or_else(|| panic!("the cut is marked: …{:?}", &saved[saved.len() - 20..]));
    assert!(
        long_error_message().starts_with(kept),
        "the saved message is the start of the handler's"
    );
    let errors = row.errors.0.as_array().unwrap();
    assert_eq!(errors.len(), 1);
    assert_eq!(
        errors[0]["message"],
        json!(saved),
        "errors keeps the same cut"
    );
}

/// Enqueues `{"n": n}` for each n in `ns` concurrently, each in its own transaction,
/// with unique key `key` under `policy`; returns each enqueue's result.
async fn enqueue_concurrently(
    pool: &PgPool,
    key: &str,
    policy: UniquePolicy,
    payloads: Vec<serde_json::Value>,
) -> Vec<Result<i64, skiplock::Error>> {
    let barrier = Arc::new(tokio::sync::Barrier::new(payloads.len()));
    let tasks: Vec<_> = payloads
        .into_iter()
        .map(|args| {
            let (pool, barrier, key) = (pool.clone(), barrier.clone(), key.to_owned());
            tokio::spawn(async move {
                let mut tx = pool.begin().await.unwrap();
                barrier.wait().await;
                let ids = skiplock::enqueue_raw(
                    &mut *tx,
                    &[NewJob::new("k", args)
                        .with_options(EnqueueOptions::new().unique_key(key, policy))],
                )
                .await?;
                tx.commit().await?;
                Ok(ids[0].id.0)
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.unwrap());
    }
    results
}

/// Concurrent enqueues with one unique key under `replace` leave one pending job, which
/// every enqueue names, holding the args of one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_replaces_of_one_unique_key_leave_one_job_with_one_payload() {
    let db = test_db().await;
    let payloads: Vec<_> = (0..8).map(|n| json!({ "n": n })).collect();
    let results =
        enqueue_concurrently(&db.pool, "r", UniquePolicy::Replace, payloads.clone()).await;
    let ids: Vec<i64> = results.into_iter().map(|r| r.expect("enqueue")).collect();
    let pending: Vec<(i64, serde_json::Value)> = sqlx::query_as(
        "SELECT id, args FROM skiplock.jobs WHERE unique_key = 'r' AND state IN ('waiting', 'queued')",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(pending.len(), 1, "one pending job: {pending:?}");
    assert_eq!(db.job_count().await, 1, "no other row");
    assert!(
        ids.iter().all(|&id| id == pending[0].0),
        "{ids:?} {pending:?}"
    );
    assert!(payloads.contains(&pending[0].1), "{pending:?}");
}

/// Concurrent enqueues with one unique key under `merge` leave one pending job holding
/// every payload, once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_merges_of_one_unique_key_keep_every_payload() {
    let db = test_db().await;
    let payloads: Vec<_> = (0..8).map(|n| json!({ "n": n })).collect();
    let results = enqueue_concurrently(&db.pool, "m", UniquePolicy::Merge, payloads.clone()).await;
    let ids: Vec<i64> = results.into_iter().map(|r| r.expect("enqueue")).collect();
    let pending: Vec<(i64, serde_json::Value)> = sqlx::query_as(
        "SELECT id, args FROM skiplock.jobs WHERE unique_key = 'm' AND state IN ('waiting', 'queued')",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(pending.len(), 1, "one pending job: {pending:?}");
    assert_eq!(db.job_count().await, 1, "no other row");
    assert!(
        ids.iter().all(|&id| id == pending[0].0),
        "{ids:?} {pending:?}"
    );
    let mut merged = pending[0]
        .1
        .as_array()
        .expect("merged args are a list")
        .clone();
    merged.sort_by_key(|v| v["n"].as_i64());
    assert_eq!(merged, payloads, "every payload once");
}

/// Merges of one unique key never make the pending job's args larger than the limit
/// (`skiplock.args_max_bytes`, 1 MiB): concurrent merges of 300 KiB each, where four fit
/// and the fifth does not. Each enqueue either lands (its payload in the args) or fails
/// with SQLSTATE 54000; the args stay within the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_merges_of_one_unique_key_never_exceed_the_args_limit() {
    const LIMIT: usize = 1024 * 1024;
    let db = test_db().await;
    let payloads: Vec<_> = (0..6)
        .map(|n| json!({ "n": n, "blob": "x".repeat(300 * 1024) }))
        .collect();
    let results = enqueue_concurrently(&db.pool, "big", UniquePolicy::Merge, payloads).await;
    let mut landed = 0;
    for result in &results {
        match result {
            Ok(_) => landed += 1,
            // The library reports the database's SQLSTATE 54000 as an invalid job.
            Err(skiplock::Error::InvalidJob(message)) => assert!(
                message.contains(&format!("over the limit of {LIMIT} bytes")),
                "{message}"
            ),
            Err(e) => panic!("an enqueue failed otherwise than on the args limit: {e:?}"),
        }
    }
    let (size, count): (i64, i64) = sqlx::query_as(
        "SELECT octet_length(args::text)::bigint, jsonb_array_length(args)::bigint FROM skiplock.jobs
         WHERE unique_key = 'big' AND state IN ('waiting', 'queued')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        size as usize <= LIMIT,
        "the merged args are {size} bytes, over the {LIMIT}-byte limit ({count} payloads; \
         {landed} enqueues reported success)"
    );
    assert_eq!(
        count, landed as i64,
        "every enqueue that succeeded is in the args"
    );
    assert!(
        (1..6).contains(&landed),
        "{landed} of 6 landed: {results:?}"
    );

    // A REPEATABLE READ transaction whose snapshot predates the holder of the key: the
    // insert trigger cannot see the holder, so the key's policy is left to the statement's
    // ON CONFLICT DO UPDATE. Its merge must fail (on the limit, or to serialize) rather
    // than store args over the limit.
    let big = |n: i64| json!({ "n": n, "blob": "x".repeat(600 * 1024) });
    let mut late = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *late)
        .await
        .unwrap();
    sqlx::query("SELECT 1").execute(&mut *late).await.unwrap();
    let on_key = || EnqueueOptions::new().unique_key("rr", UniquePolicy::Merge);
    skiplock::enqueue_raw(&db.pool, &[NewJob::new("k", big(1)).with_options(on_key())])
        .await
        .unwrap();
    let merged = skiplock::enqueue_raw(
        &mut *late,
        &[NewJob::new("k", big(2)).with_options(on_key())],
    )
    .await;
    match merged {
        Err(skiplock::Error::InvalidJob(message)) => {
            assert!(message.contains("over the limit of"), "{message}")
        }
        Err(e) if e.is_transient() => {}
        Err(e) => panic!("the late merge failed otherwise than on the limit: {e:?}"),
        Ok(_) => {
            let committed = late.commit().await;
            let size: i64 = sqlx::query_scalar(
                "SELECT max(octet_length(args::text))::bigint FROM skiplock.jobs
                 WHERE unique_key = 'rr'",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            assert!(
                committed.is_err() || size as usize <= LIMIT,
                "a merge through ON CONFLICT DO UPDATE stored {size} bytes of args, over \
                 the {LIMIT}-byte limit"
            );
        }
    }
}

/// The merge of `skiplock.enqueue`'s `ON CONFLICT DO UPDATE` is held to the args limit
/// too. The insert trigger applies a key's policy itself whenever it sees the holder, so
/// the test takes the trigger out of the way (as a snapshot older than the holder does)
/// to reach that path for sure: before (issue 38) it stored the merged args unchecked.
#[tokio::test]
async fn the_on_conflict_merge_of_enqueue_is_held_to_the_args_limit() {
    let db = test_db().await;
    sqlx::query("ALTER TABLE skiplock.jobs_live DISABLE TRIGGER jobs_before_insert")
        .execute(&db.pool)
        .await
        .unwrap();
    let enqueue = |n: i64| {
        sqlx::query_as::<_, (i64, String)>(
            "SELECT * FROM skiplock.enqueue_job('k', jsonb_build_array(jsonb_build_object(
                 'n', $1::bigint, 'blob', repeat('x', 600 * 1024))),
                 unique_key => 'big', on_conflict => 'merge')",
        )
        .bind(n)
    };
    let (first, outcome) = enqueue(1).fetch_one(&db.pool).await.unwrap();
    assert_eq!(outcome, "inserted");
    let refused = enqueue(2)
        .fetch_one(&db.pool)
        .await
        .expect_err("a merge over the limit is refused");
    let message = refused.to_string();
    assert!(message.contains("over the limit of"), "{message}");
    // The path is the ON CONFLICT one, and it works under the limit.
    let small: (i64, String) = sqlx::query_as(
        "SELECT * FROM skiplock.enqueue_job('k', '[3]', unique_key => 'big', on_conflict => 'merge')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(small, (first, "merged".to_owned()));
    let (count, size): (i64, i64) = sqlx::query_as(
        "SELECT count(*), max(octet_length(args::text))::bigint FROM skiplock.jobs
         WHERE unique_key = 'big'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(count, 1);
    assert!(size < 1024 * 1024, "{size} bytes of args");
}

/// Payloads merged into a key's pending job are never dropped by a later policy: a job
/// enqueued with `skip` that then took merged payloads, claimed, and taken back by the
/// reaper while a newer job of the key (`replace`) waited, is folded into that one with
/// every payload, not superseded without them. Before (issue 38) the requeue looked at the
/// policy the job was enqueued with (`skip`) and the merged payloads were gone.
#[tokio::test]
async fn payloads_merged_into_a_skip_holder_survive_its_requeue_into_a_taken_key() {
    let db = test_db().await;
    let pool = &db.pool;
    let enqueue = |args: &'static str, policy: &'static str| {
        sqlx::query_as::<_, (i64, String)>(
            "SELECT * FROM skiplock.enqueue_job('k', $1::jsonb, unique_key => 'key',
                                                on_conflict => $2)",
        )
        .bind(args)
        .bind(policy)
    };
    let (holder, _) = enqueue(r#"{"a": 1}"#, "skip")
        .fetch_one(pool)
        .await
        .unwrap();
    let merged = enqueue(r#"{"b": 2}"#, "merge")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(merged, (holder, "merged".to_owned()));
    assert_eq!(sql_claim_one(pool, "default", "w").await.0, holder);
    let (newer, outcome) = enqueue(r#"{"c": 3}"#, "replace")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(outcome, "inserted", "the key is free while its holder runs");
    // The holder's worker went quiet: the reaper takes it back into the taken key.
    sqlx::query("UPDATE skiplock.jobs SET heartbeat_at = now() - interval '1 hour' WHERE id = $1")
        .bind(holder)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("SELECT * FROM skiplock.maintain()")
        .execute(pool)
        .await
        .unwrap();
    let pending: Vec<(i64, serde_json::Value)> = sqlx::query_as(
        "SELECT id, args FROM skiplock.jobs
         WHERE unique_key = 'key' AND state IN ('waiting', 'queued') ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(pending[0].0, newer);
    let args = pending[0].1.to_string();
    for item in [r#""a":1"#, r#""b":2"#, r#""c":3"#] {
        assert!(
            args.contains(item),
            "{item} is in the pending job's args: {args}"
        );
    }
}

/// A plain INSERT of a unique key whose pending job an operator cancels meanwhile (the
/// cancel holds the row while the insert waits for it): the cancel moves the row to the
/// finished partition, Postgres raises 40001 "moved to another partition" to the waiting
/// lookup, and the insert looks again, finds the key free and enqueues. Found by the
/// 30-minute model run of seed 15 on the day partitions (issue 37): the INSERT failed.
#[tokio::test]
async fn an_insert_of_a_key_whose_holder_is_cancelled_meanwhile_enqueues() {
    let db = test_db().await;
    let pool = &db.pool;
    let holder: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, unique_key, unique_policy) VALUES ('k', 'uk', 'merge')
         RETURNING id",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let mut operator = pool.begin().await.unwrap();
    sqlx::query("UPDATE skiplock.jobs SET state = 'cancelled', finished_at = now() WHERE id = $1")
        .bind(holder)
        .execute(&mut *operator)
        .await
        .unwrap();
    let insert = tokio::spawn({
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO skiplock.jobs (kind, args, unique_key, unique_policy)
                 VALUES ('k', '{\"n\": 2}', 'uk', 'merge')",
            )
            .execute(&pool)
            .await
        }
    });
    common::fixtures::wait_for_a_lock_wait(pool, "the insert to wait for the holder's row").await;
    operator.commit().await.unwrap();
    insert
        .await
        .unwrap()
        .expect("the insert enqueues once the key is free");
    let pending: Vec<(i64, serde_json::Value)> = sqlx::query_as(
        "SELECT id, args FROM skiplock.jobs WHERE unique_key = 'uk' AND state = 'queued'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_ne!(pending[0].0, holder);
}

/// An enqueue of `payload` (as `{"n": payload}`) under unique key `k` with the policy
/// `merge`: the id of the new job, or of the pending job it was merged into.
fn merge_into_k(
    payload: i64,
) -> sqlx::query::QueryScalar<'static, sqlx::Postgres, i64, sqlx::postgres::PgArguments> {
    sqlx::query_scalar(
        "SELECT skiplock.enqueue('merge_me', jsonb_build_object('n', $1::bigint),
                                 unique_key => 'k', on_conflict => 'merge')",
    )
    .bind(payload)
}

/// Enqueues the first payload under key `k`, then opens session A and takes the key's
/// advisory lock there, as an enqueue of the key does first. Returns the job and A.
async fn a_job_of_k_and_a_session_holding_k(
    pool: &PgPool,
) -> (i64, sqlx::Transaction<'static, sqlx::Postgres>) {
    let job = merge_into_k(1).fetch_one(pool).await.unwrap();
    let mut a = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('skiplock.unique:k', 0))")
        .execute(&mut *a)
        .await
        .unwrap();
    (job, a)
}

/// Waits until a session of this test's database waits for an advisory lock, or `done`
/// says the statement that might wait has finished.
async fn wait_for_an_advisory_lock_wait(what: &str, pool: &PgPool, done: impl Fn() -> bool) {
    common::fixtures::wait_until(what, WAIT_LIMIT, || async {
        let waiting: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_locks
                            WHERE locktype = 'advisory' AND NOT granted
                              AND database = (SELECT oid FROM pg_database
                                              WHERE datname = current_database()))",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        (waiting || done()).then_some(())
    })
    .await;
}

/// Checks that job `id` is queued with both payloads of [`merge_into_k`], the first one first.
async fn assert_queued_with_both_payloads(pool: &PgPool, id: i64) {
    let args: serde_json::Value =
        sqlx::query_scalar("SELECT args FROM skiplock.jobs WHERE id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(args, json!([{"n": 1}, {"n": 2}]), "both payloads kept");
    assert_eq!(state_of(pool, id).await, JobState::Queued);
}

/// Found by the model test (seed 9, 60 s): an enqueue of a unique key deadlocked with
/// `retry_job` of the key's pending holder. The enqueue takes the key's advisory lock and
/// then locks the holder's row (to skip, replace or merge into it); `retry_job` locked its
/// job's row and then took the key's advisory lock (to look for another holder). Fixed:
/// `retry_job` takes the key's lock before the row's, in the enqueue's order.
///
/// The interleaving is arranged: session A holds the key's advisory lock as an enqueue
/// does first, `retry_job` of the holder starts and waits for that lock (with the row
/// locked, before the fix), then A enqueues into the key. Invariant: neither fails; the
/// merge reaches the holder and the holder is queued again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_and_a_retry_of_the_key_holder_do_not_deadlock() {
    let db = test_db().await;
    let pool = &db.pool;
    let (holder, mut a) = a_job_of_k_and_a_session_holding_k(pool).await;
    let retry = tokio::spawn({
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>("SELECT skiplock.retry_job($1)")
                .bind(holder)
                .fetch_one(&pool)
                .await
        }
    });
    wait_for_an_advisory_lock_wait("retry_job to wait for the key's lock", pool, || false).await;
    let merged_into = merge_into_k(2).fetch_one(&mut *a).await;
    let committed = match merged_into {
        Ok(id) => a.commit().await.map(|()| id),
        Err(e) => Err(e),
    };
    let retried = retry.await.unwrap();
    assert_eq!(
        committed.expect("the enqueue does not fail"),
        holder,
        "the enqueue merged into the holder"
    );
    assert!(
        retried.expect("retry_job does not fail"),
        "the holder was retried"
    );
    assert_queued_with_both_payloads(pool, holder).await;
}

/// A statement that takes a claimed job back to `queued` and so, when the job has a
/// unique key, looks for the key's pending job (`skiplock.internal_fold_into_key_holder`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Requeue {
    /// A failed attempt with attempts left: `skiplock.fail`, which runs the failure batch
    /// of a worker's completer (`internal_fail_claims`).
    Fail,
    /// A claim given back: `skiplock.release` (`internal_release_claims`).
    Release,
    /// The reaper's statement on a stale claim (`internal_reap_stale`).
    Reap,
}

impl Requeue {
    async fn run(self, pool: PgPool, id: i64, token: uuid::Uuid) -> sqlx::Result<()> {
        let query = match self {
            Requeue::Fail => sqlx::query("SELECT skiplock.fail($1, $2, 'boom', interval '0')")
                .bind(id)
                .bind(token),
            Requeue::Release => sqlx::query("SELECT skiplock.release($1, $2)")
                .bind(id)
                .bind(token),
            Requeue::Reap => sqlx::query("SELECT * FROM skiplock.internal_reap_stale(1000, 100)"),
        };
        query.execute(&pool).await.map(drop)
    }
}

/// Found by the model test (seed 12, 60 s): an enqueue of a unique key deadlocked with a
/// failure batch. The enqueue held the key's advisory lock, and its look-up of the key's
/// pending job, with a snapshot from before that job's claim committed, waited for the
/// job's row (Postgres locks the row's newest version, running by then, before it finds
/// the row no longer pending); the failure batch had locked the running job's row and
/// waited for the key's lock to look for a pending job of the key. The release and the
/// reaper took their locks in the same order. Fixed: they take the keys' locks before the
/// rows' (the reaper passes over a job whose key it cannot take at once, until its next
/// pass).
///
/// The look-up's window (a snapshot taken, the row not yet locked) lasts microseconds, so
/// session A stands in for it: it holds the key's lock as an enqueue does first, then
/// declares the look-up's query as a cursor, which keeps the snapshot of its DECLARE and
/// locks at FETCH. The job is claimed (and, for the reaper, goes stale), the requeue
/// starts and waits for the key's lock (with the row locked, before the fix), A fetches
/// and then enqueues into the key for real. Invariant: neither fails; the requeued job is
/// superseded by A's new job, which holds both payloads.
async fn an_enqueue_and_a_requeue_of_the_keys_claimed_job_do_not_deadlock(requeue: Requeue) {
    let db = test_db().await;
    let pool = &db.pool;
    let (job, mut a) = a_job_of_k_and_a_session_holding_k(pool).await;
    sqlx::query(
        "DECLARE lookup CURSOR FOR
         SELECT id FROM skiplock.jobs
         WHERE unique_key = 'k' AND state IN ('waiting', 'queued')
         ORDER BY id LIMIT 1 FOR UPDATE",
    )
    .execute(&mut *a)
    .await
    .unwrap();
    let (claimed, token) = sql_claim_one(pool, "default", "test").await;
    assert_eq!(claimed, job);
    if requeue == Requeue::Reap {
        sqlx::query(
            "UPDATE skiplock.jobs SET heartbeat_at = now() - interval '1 hour' WHERE id = $1",
        )
        .bind(job)
        .execute(pool)
        .await
        .unwrap();
    }
    let requeued = tokio::spawn(requeue.run(pool.clone(), job, token));
    wait_for_an_advisory_lock_wait(
        &format!("{requeue:?} to wait for the key's lock, or to finish"),
        pool,
        || requeued.is_finished(),
    )
    .await;
    let enqueued: sqlx::Result<i64> = async {
        let found: Option<i64> = sqlx::query_scalar("FETCH lookup")
            .fetch_optional(&mut *a)
            .await?;
        assert_eq!(
            found, None,
            "the look-up finds no pending job: the claimed one runs"
        );
        let id = merge_into_k(2).fetch_one(&mut *a).await?;
        a.commit().await?;
        Ok(id)
    }
    .await;
    let requeued = requeued.await.unwrap();
    let enqueued = enqueued.expect("the enqueue does not fail");
    requeued.unwrap_or_else(|e| panic!("the requeue ({requeue:?}) does not fail: {e}"));
    assert_ne!(
        enqueued, job,
        "the enqueue made a new job: the key had no pending one"
    );
    if requeue == Requeue::Reap {
        assert_eq!(
            state_of(pool, job).await,
            JobState::Running,
            "the reaper passed over the job while its key was locked"
        );
        requeue.run(pool.clone(), job, token).await.unwrap();
    }

    let (state, last_error): (JobState, Option<String>) =
        sqlx::query_as("SELECT state, last_error FROM skiplock.jobs WHERE id = $1")
            .bind(job)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        state,
        JobState::Cancelled,
        "{requeue:?}: the requeue was superseded"
    );
    assert_eq!(
        last_error.as_deref(),
        Some(&*format!(
            "superseded: pending job {enqueued} holds unique_key k and runs instead"
        ))
    );
    assert_queued_with_both_payloads(pool, enqueued).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_and_a_failed_attempt_of_the_keys_claimed_job_do_not_deadlock() {
    an_enqueue_and_a_requeue_of_the_keys_claimed_job_do_not_deadlock(Requeue::Fail).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_and_a_release_of_the_keys_claimed_job_do_not_deadlock() {
    an_enqueue_and_a_requeue_of_the_keys_claimed_job_do_not_deadlock(Requeue::Release).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_and_a_reap_of_the_keys_claimed_job_do_not_deadlock() {
    an_enqueue_and_a_requeue_of_the_keys_claimed_job_do_not_deadlock(Requeue::Reap).await;
}

/// A dead job moved back to `queued` by a hand-written UPDATE, while another pending job
/// holds its unique key: the move is refused by the key's unique index, and the dead job is
/// still there. (The move is an insert into the live partition, and the enqueue trigger,
/// which gives a taken key's enqueue no row of its own, must let a moved row pass: it once
/// made the row vanish.)
#[tokio::test]
async fn a_hand_retry_of_a_dead_job_whose_key_is_taken_is_refused_and_loses_nothing() {
    let db = test_db().await;
    let pool = &db.pool;
    let dead: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, unique_key, state, finished_at)
         VALUES ('k', 'taken', 'dead', now()) RETURNING id",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let pending: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('k', unique_key => 'taken')")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_ne!(pending, dead);
    let refused = sqlx::query("UPDATE skiplock.jobs SET state = 'queued' WHERE id = $1")
        .bind(dead)
        .execute(pool)
        .await
        .expect_err("a second pending job of the key is refused");
    let code = refused
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned());
    assert_eq!(code.as_deref(), Some("23505"), "{refused}");
    assert_eq!(
        state_of(pool, dead).await,
        JobState::Dead,
        "the dead job is kept"
    );

    // With the key free, the same statement moves it back.
    sqlx::query("SELECT skiplock.cancel_job($1)")
        .bind(pending)
        .execute(pool)
        .await
        .unwrap();
    let moved = sqlx::query("UPDATE skiplock.jobs SET state = 'queued' WHERE id = $1")
        .bind(dead)
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(moved.rows_affected(), 1);
    assert_eq!(state_of(pool, dead).await, JobState::Queued);
}

/// A merge job requeued while another pending job holds its unique key is folded into that
/// job; when the merged args would pass the args limit, the fold is refused like an
/// enqueue's merge: the job goes dead with the reason, its payloads kept in it, and the
/// holder keeps its args. (It once stored 1,228,828 bytes against the 1,048,576 limit.)
#[tokio::test]
async fn a_fold_into_the_key_holder_over_the_args_limit_is_refused_and_keeps_the_payloads() {
    let db = test_db().await;
    let mut conn = db.pool.acquire().await.unwrap();
    // A limit the test can pass cheaply (the checks run from 4 KiB of args on).
    sqlx::query("SET skiplock.args_max_bytes = 5000")
        .execute(&mut *conn)
        .await
        .unwrap();
    let enqueue_merge =
        "SELECT id FROM skiplock.enqueue_job('m', jsonb_build_object('p', repeat($1, 1300)),
                                                       unique_key => 'k', on_conflict => 'merge')";
    let first: i64 = sqlx::query_scalar(enqueue_merge)
        .bind("ab")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let (claimed, token) = sql_claim_one(&mut *conn, "default", "w").await;
    assert_eq!(claimed, first);
    // The key is free while the first runs: a second pending job takes it.
    let holder: i64 = sqlx::query_scalar(enqueue_merge)
        .bind("cd")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_ne!(holder, first);
    let holder_args = "SELECT args FROM skiplock.jobs WHERE id = $1";
    let before: serde_json::Value = sqlx::query_scalar(holder_args)
        .bind(holder)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    // The first fails and would run again: its requeue folds into the holder, over the limit.
    let (state,): (Option<String>,) = sqlx::query_as(
        "SELECT state::text FROM skiplock.fail_many(ARRAY[$1::bigint], ARRAY[$2::uuid], ARRAY['boom'])",
    )
    .bind(first)
    .bind(token)
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert_eq!(state.as_deref(), Some("dead"), "the job goes dead, alone");
    let (last_error, args): (Option<String>, serde_json::Value) =
        sqlx::query_as("SELECT last_error, args FROM skiplock.jobs WHERE id = $1")
            .bind(first)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    assert!(
        last_error
            .as_deref()
            .is_some_and(|e| e.contains("over the limit")),
        "{last_error:?}"
    );
    assert_eq!(
        args.as_array().map(Vec::len),
        Some(1),
        "its payload is kept in it"
    );
    let after: serde_json::Value = sqlx::query_scalar(holder_args)
        .bind(holder)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(after, before, "the holder keeps its args");
}

/// Deleting an unfinished parent straight from the live partition tombstones its edge and
/// cancels its waiting child, as a DELETE through `skiplock.jobs` does: the statement
/// trigger that replaced the foreign key's cascade is on each partition too. (Without it,
/// the edge kept no tombstone and the sweep queued the child, which ran although its
/// parent never succeeded.)
#[tokio::test]
async fn deleting_an_unfinished_parent_from_the_live_partition_cancels_its_waiting_child() {
    let db = test_db().await;
    let pool = &db.pool;
    let parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('k')")
        .fetch_one(pool)
        .await
        .unwrap();
    let child: i64 =
        sqlx::query_scalar("SELECT skiplock.enqueue('k', depends_on => ARRAY[$1::bigint])")
            .bind(parent)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(state_of(pool, child).await, JobState::Waiting);
    sqlx::query("DELETE FROM skiplock.jobs_live WHERE id = $1")
        .bind(parent)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("SELECT * FROM skiplock.maintain()")
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(state_of(pool, child).await, JobState::Cancelled);
    assert_eq!(
        last_error_of(pool, child).await.as_deref(),
        Some(format!("parent job {parent} was deleted while queued").as_str())
    );
}

/// A job whose args are JSON serde_json cannot hold (`1e400`, which a plain INSERT
/// accepts) failed every claim of its queue ("number out of range" decoding the claim's
/// rows), so the queue stopped, and `skiplock::jobs` and `job` failed on it. Now the job
/// fails alone (its args, given as their text, do not decode: dead at once), the others
/// run, and the listings show it.
#[tokio::test]
async fn args_serde_json_cannot_hold_fail_their_job_not_the_queue() {
    let db = test_db().await;
    let ids: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, max_attempts)
         VALUES ('k', '1e400', 1), ('k', '{}', 1), ('k', (repeat('[', 204) || repeat(']', 204))::jsonb, 1)
         RETURNING id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let timeline = Timeline::default();
    let summary = run_to_idle(&db.pool, k_worker(&db.pool, &timeline), "unholdable args").await;
    assert_eq!((summary.succeeded, summary.failed), (1, 2), "{summary:?}");
    assert_eq!(state_of(&db.pool, ids[0]).await, JobState::Dead);
    assert_eq!(state_of(&db.pool, ids[1]).await, JobState::Succeeded);
    assert_eq!(state_of(&db.pool, ids[2]).await, JobState::Dead);
    let listed = skiplock::jobs(&db.pool, &skiplock::JobFilter::default())
        .await
        .expect("the listing with the unholdable args");
    assert_eq!(listed.len(), 3);
    let job = skiplock::job(&db.pool, skiplock::JobId(ids[0]))
        .await
        .unwrap()
        .unwrap();
    assert!(
        job.args
            .0
            .as_str()
            .is_some_and(|text| text.starts_with("1000")),
        "{:?}",
        job.args
    );
}
