//! The in-process job kind `model`. Each attempt's outcome is a function of the job's args
//! and the attempt number (so it follows from the seed, whoever runs it): succeed after a
//! short or a long sleep, fail retryably, fail permanently, give up (cancel), time out,
//! or panic. Every run is recorded with its start and end on the simulation's monotonic
//! clock; the end is taken by a drop guard, so a run stopped by its timeout, a panic, a
//! cancel or a hard shutdown records when it really stopped.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use skiplock::{Job, JobContext, JobError};

/// Timeout of the `model` kind.
pub const MODEL_TIMEOUT: Duration = Duration::from_millis(400);

/// A `model` job: any JSON (merged unique jobs get an array of payloads).
#[derive(Serialize, Deserialize)]
#[serde(transparent)]
pub struct Model(pub Value);

/// One execution of a `model` handler.
#[derive(Debug, Clone)]
pub struct Run {
    pub job_id: i64,
    pub attempt: i32,
    pub worker: String,
    pub start_ns: u64,
    pub end_ns: Option<u64>,
}

/// Where handlers record their runs; one per worker (it knows the worker's id).
#[derive(Clone)]
pub struct RunLog {
    pub worker: String,
    pub runs: Arc<Mutex<Vec<Run>>>,
    pub origin: Instant,
}

impl RunLog {
    fn now_ns(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }
}

/// Records the end of a run when dropped, however the handler stopped.
struct RunGuard {
    log: RunLog,
    index: usize,
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        let end = self.log.now_ns();
        self.log.runs.lock().unwrap()[self.index].end_ns = Some(end);
    }
}

/// What one attempt does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    Succeed(u64),
    Retry,
    Permanent,
    Cancel,
    Timeout,
    Panic,
}

/// The attempt's outcome, from the args and the attempt number.
pub fn plan(args: &Value, attempt: i32) -> Plan {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ (attempt as u64).wrapping_mul(0x9e37_79b9);
    for b in args.to_string().bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let mut rng = fastrand::Rng::with_seed(h);
    let roll = rng.u8(0..100);
    // Unique-key jobs fail more often, so requeues meet a pending job holding their key.
    if roll < 45 && args.to_string().contains("\"flaky\"") {
        return Plan::Retry;
    }
    match roll {
        0..55 => Plan::Succeed(rng.u64(0..120)),
        55..68 => Plan::Retry,
        68..75 => Plan::Permanent,
        75..78 => Plan::Cancel,
        78..84 => Plan::Timeout,
        84..90 => Plan::Panic,
        _ => Plan::Succeed(rng.u64(300..700)),
    }
}

impl Job for Model {
    const KIND: &'static str = "model";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let log = ctx
            .data::<RunLog>()
            .expect("model workers get a RunLog")
            .clone();
        let index = {
            let mut runs = log.runs.lock().unwrap();
            runs.push(Run {
                job_id: ctx.id().0,
                attempt: ctx.attempt(),
                worker: log.worker.clone(),
                start_ns: log.now_ns(),
                end_ns: None,
            });
            runs.len() - 1
        };
        let _guard = RunGuard { log, index };
        match plan(&self.0, ctx.attempt()) {
            Plan::Succeed(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(())
            }
            Plan::Retry => Err(JobError::retry(format!(
                "model: planned retryable failure on attempt {}",
                ctx.attempt()
            ))),
            Plan::Permanent => Err(JobError::permanent("model: planned permanent failure")),
            Plan::Cancel => Err(JobError::cancel("model: handler gave up (cancel)")),
            Plan::Timeout => {
                tokio::time::sleep(MODEL_TIMEOUT * 10).await;
                Ok(())
            }
            Plan::Panic => panic!("model: planned panic on attempt {}", ctx.attempt()),
        }
    }

    fn retry_delay(_attempt: i32) -> Duration {
        Duration::from_millis(30)
    }

    fn timeout() -> Option<Duration> {
        Some(MODEL_TIMEOUT)
    }
}

/// The kind of the pruning worker: registered (a worker needs one), never enqueued.
#[derive(Serialize, Deserialize)]
pub struct Idle {}

impl Job for Idle {
    const KIND: &'static str = "model_idle";

    async fn run(self, _ctx: JobContext) -> Result<(), JobError> {
        Ok(())
    }
}
