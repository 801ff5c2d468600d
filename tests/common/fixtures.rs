//! Job types, a run recorder and polling helpers shared by the integration tests.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use skiplock::{Job, JobContext, JobError, JobState, Worker, WorkerBuilder};
use sqlx::PgPool;

/// Owned copies of string literals: the queue and kind lists claim statements take.
pub fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// Records which jobs ran, with which attempt numbers, and when `record` jobs started and
/// ended on one counter shared by all handlers. Shared with handlers through
/// `WorkerBuilder::data`.
#[derive(Default, Clone)]
pub struct Recorder {
    runs: Arc<Mutex<HashMap<i64, Vec<i32>>>>,
    ticks: Arc<Mutex<Ticks>>,
}

/// The shared counter and each job's (start, end) ticks.
type Ticks = (u64, HashMap<i64, Vec<(u64, u64)>>);

impl Recorder {
    pub fn record(&self, ctx: &JobContext) {
        self.runs
            .lock()
            .unwrap()
            .entry(ctx.id().0)
            .or_default()
            .push(ctx.attempt());
    }

    /// The next tick of the shared counter.
    pub fn tick(&self) -> u64 {
        let mut ticks = self.ticks.lock().unwrap();
        ticks.0 += 1;
        ticks.0
    }

    /// Ends the run of job `id` that started at tick `start`.
    pub fn end(&self, id: i64, start: u64) {
        let end = self.tick();
        let mut ticks = self.ticks.lock().unwrap();
        ticks.1.entry(id).or_default().push((start, end));
    }

    /// The (start, end) ticks of each `record` job's runs: in-process, so two runs that
    /// overlapped show it whatever the database's clock says.
    pub fn spans(&self) -> HashMap<i64, Vec<(u64, u64)>> {
        self.ticks.lock().unwrap().1.clone()
    }

    /// Attempt numbers seen for each job id.
    pub fn runs(&self) -> HashMap<i64, Vec<i32>> {
        self.runs.lock().unwrap().clone()
    }

    pub fn total(&self) -> usize {
        self.runs.lock().unwrap().values().map(Vec::len).sum()
    }
}

/// The worker's [`Recorder`] (given with `.data`).
pub fn recorder(ctx: &JobContext) -> &Recorder {
    ctx.data::<Recorder>().expect("worker was given a Recorder")
}

/// Succeeds at once (after a few yields), recording the run and its ticks.
#[derive(Serialize, Deserialize, Clone)]
pub struct Record {
    pub n: u32,
}

impl Job for Record {
    const KIND: &'static str = "record";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let recorder = recorder(&ctx);
        recorder.record(&ctx);
        let start = recorder.tick();
        // Yield so that a run overlapping this one would take a tick in between.
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        recorder.end(ctx.id().0, start);
        Ok(())
    }
}

/// Fails every attempt whose number is at most `fail_until`, then succeeds. Retries after
/// 100 ms × 2^attempt, so delays grow but tests stay short.
#[derive(Serialize, Deserialize, Clone)]
pub struct Flaky {
    pub fail_until: i32,
}

impl Job for Flaky {
    const KIND: &'static str = "flaky";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        recorder(&ctx).record(&ctx);
        if ctx.attempt() <= self.fail_until {
            return Err(JobError::retry(format!(
                "planned failure on attempt {}",
                ctx.attempt()
            )));
        }
        Ok(())
    }

    fn retry_delay(attempt: i32) -> Duration {
        flaky_delay(attempt)
    }
}

/// The retry delay `Flaky` asks for after failed attempt `attempt`.
pub fn flaky_delay(attempt: i32) -> Duration {
    Duration::from_millis(100 << attempt.clamp(0, 10))
}

/// Sleeps `ms`, recording the start; stops early only when the runtime drops it.
#[derive(Serialize, Deserialize, Clone)]
pub struct Slow {
    pub ms: u64,
}

impl Job for Slow {
    const KIND: &'static str = "slow";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        recorder(&ctx).record(&ctx);
        tokio::time::sleep(Duration::from_millis(self.ms)).await;
        Ok(())
    }
}

/// Panics.
#[derive(Serialize, Deserialize, Clone)]
pub struct Panics {}

impl Job for Panics {
    const KIND: &'static str = "panics";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        recorder(&ctx).record(&ctx);
        panic!("boom from a test handler");
    }

    fn retry_delay(_attempt: i32) -> Duration {
        Duration::from_millis(10)
    }
}

/// A worker builder with short intervals so tests settle in well under a second: claims
/// heartbeat every 100 ms and go stale after 3 s (generous, so a loaded machine never reaps a live claim); the fallback poll is 100 ms.
pub fn fast_worker(pool: &PgPool, recorder: &Recorder) -> WorkerBuilder {
    Worker::builder(pool.clone())
        .data(recorder.clone())
        .register::<Record>()
        .register::<Flaky>()
        .register::<Slow>()
        .register::<Panics>()
        .poll_interval(Duration::from_millis(100))
        .heartbeat(Duration::from_millis(100), Duration::from_secs(3))
        .reap_interval(Duration::from_millis(100))
        .prune_interval(None)
}

/// Polls `check` every 20 ms until it returns true; panics naming `what` after `limit`.
pub async fn wait_for<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_until(what, limit, || {
        let done = check();
        async move { done.await.then_some(()) }
    })
    .await
}

/// The tests' one polling loop: polls `check` every 20 ms until it returns `Some`, and
/// returns that value; panics naming `what` after `limit`. For what has no event to wait
/// on (a row's state written by another process, a log line, a port).
pub async fn wait_until<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Number of jobs in `state`.
pub async fn count_in_state(pool: &PgPool, state: JobState) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state = $1")
        .bind(state)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// State of one job, which must exist.
pub async fn state_of(pool: &PgPool, id: i64) -> JobState {
    state_if_any(pool, id)
        .await
        .unwrap_or_else(|| panic!("no job {id}"))
}

/// State of one job, `None` when there is no such job (deleted, or never enqueued).
pub async fn state_if_any(pool: &PgPool, id: i64) -> Option<JobState> {
    sqlx::query_scalar("SELECT state FROM skiplock.jobs WHERE id = $1")
        .bind(id)
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// Claims up to `max_jobs` jobs of `queue` on the SQL protocol (`skiplock.claim`) as worker
/// `worker`; returns each job's id and claim token, in the order the claim gives them.
pub async fn sql_claim(
    db: impl sqlx::PgExecutor<'_>,
    queue: &str,
    max_jobs: i32,
    worker: &str,
) -> Vec<(i64, uuid::Uuid)> {
    sqlx::query_as("SELECT id, claim_token FROM skiplock.claim($1, $2, $3)")
        .bind(queue)
        .bind(max_jobs)
        .bind(worker)
        .fetch_all(db)
        .await
        .unwrap_or_else(|e| panic!("claim on the SQL protocol, queue {queue}: {e}"))
}

/// `skiplock.complete(id, token)` on the SQL protocol: whether the claim was still held
/// (and the job is saved succeeded).
pub async fn sql_complete(db: impl sqlx::PgExecutor<'_>, id: i64, token: uuid::Uuid) -> bool {
    sqlx::query_scalar("SELECT skiplock.complete($1, $2)")
        .bind(id)
        .bind(token)
        .fetch_one(db)
        .await
        .unwrap_or_else(|e| panic!("complete job {id} on the SQL protocol: {e}"))
}

/// [`sql_claim`] of one job of `queue`, which must have one to claim.
pub async fn sql_claim_one(
    db: impl sqlx::PgExecutor<'_>,
    queue: &str,
    worker: &str,
) -> (i64, uuid::Uuid) {
    let claimed = sql_claim(db, queue, 1, worker).await;
    *claimed
        .first()
        .unwrap_or_else(|| panic!("a job of queue {queue} to claim"))
}

/// Inserts `n` `noop` jobs of `queue` (with concurrency key `key` when given) by plain SQL;
/// returns their ids, in order.
pub async fn insert_noop_jobs(pool: &PgPool, queue: &str, key: Option<&str>, n: i32) -> Vec<i64> {
    sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (queue, kind, args, concurrency_key)
         SELECT $1, 'noop', '{}', $2 FROM generate_series(1, $3) RETURNING id",
    )
    .bind(queue)
    .bind(key)
    .bind(n)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A job's current claim token (`JobRow` does not expose it).
pub async fn claim_token_of(pool: &PgPool, id: skiplock::JobId) -> Option<uuid::Uuid> {
    sqlx::query_scalar("SELECT claim_token FROM skiplock.jobs WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Waits until some session of this test's database waits for a lock (a statement the
/// test started blocked behind a row another session holds); panics naming `what` after
/// 30 s.
pub async fn wait_for_a_lock_wait(pool: &PgPool, what: &str) {
    wait_for(what, Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                            WHERE datname = current_database() AND wait_event_type = 'Lock')",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    })
    .await;
}

/// `fast_worker` with claims that never go stale while it runs (an hour), for the tests
/// that count each job's runs: a live claim taken back under load would run its job twice,
/// and reaping is not their subject.
pub fn steady_worker(pool: &PgPool, recorder: &Recorder) -> WorkerBuilder {
    fast_worker(pool, recorder).heartbeat(Duration::from_millis(100), Duration::from_secs(3600))
}

/// Runs until the test opens its [`Gate`] or adds a permit, recording its start: a job the
/// test knows is still running, or lets end one at a time.
#[derive(Serialize, Deserialize, Clone)]
pub struct AtGate {}

/// Each permit added lets one job through; opened (closed, as a semaphore), it lets every
/// job through for good.
#[derive(Clone)]
pub struct Gate(pub Arc<tokio::sync::Semaphore>);

impl Gate {
    pub fn closed() -> Self {
        Self(Arc::new(tokio::sync::Semaphore::new(0)))
    }

    pub fn open(&self) {
        self.0.close();
    }
}

impl Job for AtGate {
    const KIND: &'static str = "at_gate";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        recorder(&ctx).record(&ctx);
        // A permit lets one job end; an error is the gate opening for all.
        if let Ok(permit) = ctx
            .data::<Gate>()
            .expect("a Gate on the worker")
            .0
            .acquire()
            .await
        {
            permit.forget();
        }
        Ok(())
    }
}

/// Log output captured in memory: a `tracing_subscriber::fmt` writer.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    pub fn lines(&self) -> Vec<String> {
        let bytes = self.0.lock().unwrap().clone();
        String::from_utf8_lossy(&bytes)
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}
