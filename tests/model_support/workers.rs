//! Workers of the simulation, and the manager that stops, kills and replaces them.
//!
//! - in-process library workers (kind `model`), each on its own pool named by its worker
//!   id (`tb-ip…`, so the audit checks and the connection killer know them); stopped
//!   gracefully (running jobs finish or are released) or at once (released);
//! - `skiplock-testbed` processes (kinds `record`, `panic`, `never_return`), killed with
//!   SIGKILL (their claims are reaped) or SIGTERM;
//! - one in-process pruning worker (zero retention, a day for cancelled jobs), stopped with the
//!   fault phase.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use skiplock::{Retention, ShutdownHandle, Worker, WorkerSummary};
use tokio::task::JoinHandle;

use super::kind::{Idle, Model, Run, RunLog};
use super::{QUEUES, Sim};
use crate::fault_support::{Testbed, TestbedArgs};

/// Heartbeat and stale timeout of the in-process workers: short, so claims of stopped or
/// stalled workers come back within the run.
pub const HEARTBEAT: Duration = Duration::from_millis(200);
pub const STALE_AFTER: Duration = Duration::from_millis(1500);

/// An in-process worker and the task running it.
pub struct InProcess {
    pub id: String,
    handle: ShutdownHandle,
    task: JoinHandle<skiplock::Result<WorkerSummary>>,
    pool: sqlx::PgPool,
}

impl InProcess {
    /// Stops the worker (gracefully, or releasing everything at once) and waits for it.
    pub async fn stop(self, sim: &Sim, now: bool) {
        if now {
            self.handle.shutdown_now();
        } else {
            self.handle.shutdown();
        }
        match tokio::time::timeout(Duration::from_secs(60), self.task).await {
            Ok(Ok(Ok(_summary))) => {}
            Ok(Ok(Err(e))) => sim.violation(format!(
                "[workers] worker {} returned an error: {e}",
                self.id
            )),
            Ok(Err(e)) => sim.violation(format!("[workers] worker {} panicked: {e}", self.id)),
            Err(_) => sim.violation(format!(
                "[workers] worker {} did not stop within 60 s",
                self.id
            )),
        }
        self.pool.close().await;
    }
}

/// Starts an in-process `model` worker named `id`.
pub async fn start_in_process(sim: &Sim, id: String, runs: &Arc<Mutex<Vec<Run>>>) -> InProcess {
    let pool = sim.pool(&id, 6).await;
    let worker = Worker::builder(pool.clone())
        .worker_id(id.clone())
        .register::<Model>()
        .data(RunLog {
            worker: id.clone(),
            runs: runs.clone(),
            origin: sim.started,
        })
        .queues(QUEUES)
        .concurrency(4)
        .poll_interval(Duration::from_millis(100))
        .heartbeat(HEARTBEAT, STALE_AFTER)
        .reap_interval(Duration::from_millis(200))
        .shutdown_grace(Duration::from_millis(300))
        .prune_interval(None)
        .cron_interval(None)
        .build()
        .expect("model worker settings");
    let handle = worker.shutdown_handle();
    let task = tokio::spawn(worker.run());
    InProcess {
        id,
        handle,
        task,
        pool,
    }
}

/// Starts the pruning worker: zero retention for succeeded and dead jobs (their rows
/// deleted one by one), a day for cancelled ones (kept through the run, except those the
/// operator dates two days back, whose day tables it drops whole), a pass every 300 ms,
/// and its reaper and dependency sweep like any worker's. Its kind is never enqueued.
///
/// The state kept a day is `cancelled`, not `dead` (as from ea10d72 to 50c4a28): the
/// operator's `retry_dead_jobs` puts back every dead job there is, so with the dead kept
/// each call put back every job that had died in the run, and most died again (the kinds
/// that always fail): 30,456 reopens in seed 61's 30 minutes (1,172 in seed 17's), queues
/// full of them, and four lanes, whose turns the reopened old jobs took first, that ran 32
/// jobs from the 5th minute to the 32nd and left 17,646 to a drain that could not end in
/// its 600 s. Calls of `retry_dead_jobs` at most every 30 s still put back about 1,000 jobs
/// each by the 6th minute (lane claims fell from about 500 a minute to 20-170).
pub async fn start_pruner(sim: &Sim, runs: &Arc<Mutex<Vec<Run>>>) -> InProcess {
    let id = "tb-pruner".to_owned();
    let pool = sim.pool(&id, 3).await;
    let worker = Worker::builder(pool.clone())
        .worker_id(id.clone())
        .register::<Idle>()
        .data(RunLog {
            worker: id.clone(),
            runs: runs.clone(),
            origin: sim.started,
        })
        .queues(["model_idle"])
        .concurrency(1)
        .heartbeat(HEARTBEAT, STALE_AFTER)
        .reap_interval(Duration::from_millis(250))
        .retention(Retention {
            succeeded: Duration::ZERO,
            cancelled: Duration::from_secs(24 * 3600),
            dead: Duration::ZERO,
        })
        .prune_interval(Some(Duration::from_millis(300)))
        .cron_interval(None)
        .build()
        .expect("pruner settings");
    let handle = worker.shutdown_handle();
    let task = tokio::spawn(worker.run());
    InProcess {
        id,
        handle,
        task,
        pool,
    }
}

/// Settings of every testbed process.
fn testbed_args() -> TestbedArgs {
    let mut args = TestbedArgs::new()
        .set("kinds", "record,panic,never-return")
        .set("concurrency", 4)
        .set("pool-size", 6)
        .set("heartbeat-ms", 200)
        .set("stale-ms", 2_000)
        .set("reap-ms", 250)
        .set("poll-ms", 100)
        .set("timeout-ms", 600)
        .set("retry-ms", 30)
        .set("shutdown-grace-ms", 500)
        .set("worker-threads", 2)
        .env("NO_COLOR", "1");
    for queue in QUEUES {
        args = args.set("queue", queue);
    }
    args
}

/// The workers of one run, and every testbed ever started (their logs are checked).
pub struct Crew {
    pub in_process: Vec<InProcess>,
    pub testbeds: Vec<Testbed>,
    /// Logs of testbeds already gone: (worker id, text).
    pub gone_logs: Vec<(String, String)>,
    pub runs: Arc<Mutex<Vec<Run>>>,
    generation: usize,
}

impl Crew {
    pub async fn start(sim: &Sim, in_process: usize, testbeds: usize) -> Crew {
        let mut crew = Crew {
            in_process: Vec::new(),
            testbeds: Vec::new(),
            gone_logs: Vec::new(),
            runs: Arc::new(Mutex::new(Vec::new())),
            generation: 0,
        };
        for slot in 0..in_process {
            let id = crew.next_id("tb-ip", slot);
            let worker = start_in_process(sim, id, &crew.runs).await;
            crew.in_process.push(worker);
        }
        for slot in 0..testbeds {
            let id = crew.next_id("tb-pr", slot);
            crew.testbeds
                .push(Testbed::start(&sim.url, &id, &testbed_args()).await);
        }
        crew
    }

    fn next_id(&mut self, prefix: &str, slot: usize) -> String {
        self.generation += 1;
        format!("{prefix}{slot}-{}", self.generation)
    }

    /// The worker manager's loop for the fault phase: every 1.5–4 s one worker is
    /// stopped gracefully, stopped at once, killed with SIGKILL or sent SIGTERM, and
    /// replaced.
    pub async fn churn(&mut self, sim: &Sim) {
        let mut rng = sim.rng("manager");
        while sim.pace(rng.u64(1_500..4_000)).await {
            let in_process = rng.bool() || self.testbeds.is_empty();
            if in_process && !self.in_process.is_empty() {
                let slot = rng.usize(..self.in_process.len());
                let now = rng.bool();
                sim.count(if now {
                    "worker stop now"
                } else {
                    "worker stop graceful"
                });
                let old = self.in_process.remove(slot);
                old.stop(sim, now).await;
                let id = self.next_id("tb-ip", slot);
                let worker = start_in_process(sim, id, &self.runs).await;
                self.in_process.insert(slot, worker);
            } else if !self.testbeds.is_empty() {
                let slot = rng.usize(..self.testbeds.len());
                let kill = rng.u8(0..3) < 2;
                let mut old = self.testbeds.remove(slot);
                if kill {
                    sim.count("testbed kill -9");
                    old.kill9().await;
                } else {
                    sim.count("testbed SIGTERM");
                    old.signal("TERM");
                    let status = old.wait_exit(Duration::from_secs(60)).await;
                    if !status.success() {
                        sim.violation(format!(
                            "[workers] testbed {} exited with {status} after SIGTERM",
                            old.worker_id
                        ));
                    }
                }
                self.gone_logs.push((old.worker_id.clone(), old.log_text()));
                let id = self.next_id("tb-pr", slot);
                self.testbeds
                    .insert(slot, Testbed::start(&sim.url, &id, &testbed_args()).await);
            }
        }
    }

    /// Stops every worker gracefully (after the drain) and keeps the testbeds' logs.
    pub async fn stop_all(&mut self, sim: &Sim) {
        for worker in self.in_process.drain(..) {
            worker.stop(sim, false).await;
        }
        for mut testbed in self.testbeds.drain(..) {
            testbed.signal("TERM");
            let status = testbed.wait_exit(Duration::from_secs(60)).await;
            if !status.success() {
                sim.violation(format!(
                    "[workers] testbed {} exited with {status} at the end",
                    testbed.worker_id
                ));
            }
            self.gone_logs
                .push((testbed.worker_id.clone(), testbed.log_text()));
        }
    }
}
