//! Fair share between the queues of one worker: a flood in one queue never holds another
//! back, and queues that all have work share the slots by weight.
//!
//! The jobs here run until the test lets one of them end, so the test decides when a slot
//! frees and reads which queue took it from the order of the starts: no verdict depends on
//! how fast the machine runs the jobs. Each queue's first claim takes all its jobs (the
//! prefetch exceeds the backlog), and a queue's dispatcher takes its next job in hand as it
//! starts one: from a queue's first start on, it waits for every freed slot with a job in
//! hand. (The slot pool's rule alone is unit-tested in src/worker/slots.rs.)

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fixtures::{Recorder, count_in_state, fast_worker, wait_for, wait_until};
use common::test_db;
use serde::{Deserialize, Serialize};
use skiplock::{EnqueueOptions, Job, JobContext, JobError, JobState, NewJob, WorkerBuilder};
use sqlx::PgPool;
use tokio::sync::Semaphore;

/// Longest wait for a worker to settle what the database holds.
const PATIENCE: Duration = Duration::from_secs(60);

/// The queue of every job that started, in start order, and one gate per queue that each
/// of its jobs passes before it ends (closed at the end of a test: every job ends then).
#[derive(Clone)]
struct Lab {
    starts: Arc<Mutex<Vec<String>>>,
    gates: Arc<HashMap<String, Semaphore>>,
}

impl Lab {
    fn new(queues: &[&str]) -> Self {
        Self {
            starts: Arc::default(),
            gates: Arc::new(
                queues
                    .iter()
                    .map(|queue| ((*queue).to_owned(), Semaphore::new(0)))
                    .collect(),
            ),
        }
    }

    fn starts(&self) -> Vec<String> {
        self.starts.lock().unwrap().clone()
    }

    /// Lets one running job of `queue` end, waits for the job that takes its slot to start
    /// (every other slot holds a job at its gate) and for the ended job's outcome to be
    /// saved; returns the queue of the job that took the slot.
    async fn free_one_slot_of(&self, pool: &PgPool, queue: &str) -> String {
        let before = self.starts().len();
        let ended = count_in_state(pool, JobState::Succeeded).await;
        self.gates[queue].add_permits(1);
        let taker = wait_until("the freed slot to start a job", PATIENCE, || async {
            self.starts().get(before).cloned()
        })
        .await;
        wait_for("the ended job's outcome", PATIENCE, || async {
            count_in_state(pool, JobState::Succeeded).await == ended + 1
        })
        .await;
        taker
    }

    /// Lets every job end.
    fn open_every_gate(&self) {
        for gate in self.gates.values() {
            gate.close();
        }
    }
}

/// Records its queue when it starts, then waits at its queue's gate.
#[derive(Serialize, Deserialize)]
struct Gated {}

impl Job for Gated {
    const KIND: &'static str = "gated";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let lab = ctx.data::<Lab>().unwrap();
        lab.starts.lock().unwrap().push(ctx.queue().to_owned());
        // An error means the gate was closed: the test is over.
        if let Ok(permit) = lab.gates[ctx.queue()].acquire().await {
            permit.forget();
        }
        Ok(())
    }
}

async fn enqueue_gated(pool: &PgPool, queues: &[&str], each: usize) {
    // Interleaved, so that claim order alone (priority, due time, id) would alternate.
    let jobs: Vec<NewJob> = (0..each)
        .flat_map(|_| queues.iter())
        .map(|queue| {
            NewJob::new("gated", serde_json::json!({}))
                .with_options(EnqueueOptions::new().queue(*queue))
        })
        .collect();
    skiplock::enqueue_raw(pool, &jobs).await.unwrap();
}

/// A worker of `slots` slots on `queues`, whose first claim of a queue takes all its jobs;
/// its claims never go stale while the jobs wait at their gates (reaping is not the
/// subject here).
fn gated_worker(pool: &PgPool, lab: &Lab, queues: &[&str], slots: usize) -> WorkerBuilder {
    fast_worker(pool, &Recorder::default())
        .register::<Gated>()
        .data(lab.clone())
        .queues(queues.iter().copied())
        .concurrency(slots)
        .prefetch(400)
        .heartbeat(Duration::from_millis(100), Duration::from_secs(3600))
}

/// The claim tokens of the running jobs of `queue`, and how many jobs each holds.
async fn claims_of(pool: &PgPool, queue: &str) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs WHERE state = 'running' AND queue = $1
         GROUP BY claim_token",
    )
    .bind(queue)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Slots of the worker in [`a_flood_in_one_queue_does_not_hold_back_another`].
const FLOOD_SLOTS: usize = 4;

/// Jobs in the flood: more than it can start while the test runs, so it always has one in
/// hand.
const FLOOD: usize = 100;

/// Workload: 100 jobs in queue `flood` take the worker's 4 slots and wait; then 2 jobs in
/// queue `trickle`. The test lets one job end at a time.
///
/// Invariant: the trickle is claimed while the flood holds every slot, and a freed slot goes
/// to the queue that runs fewer jobs (equal weights), so the trickle's jobs start before
/// the flood's backlog (before, one claim ordered both queues by due time, and the trickle
/// waited for the whole flood). Decided by the order of the starts: once the trickle's
/// first job runs and its second waits in hand, the next slot a flood job frees (flood 2
/// running, trickle 1) goes to the trickle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_in_one_queue_does_not_hold_back_another() {
    let db = test_db().await;
    let pool = &db.pool;
    enqueue_gated(pool, &["flood"], FLOOD).await;
    let lab = Lab::new(&["flood", "trickle"]);
    let worker = gated_worker(pool, &lab, &["flood", "trickle"], FLOOD_SLOTS)
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("every slot to run a flood job", PATIENCE, || async {
        lab.starts().len() == FLOOD_SLOTS
    })
    .await;
    assert_eq!(claims_of(pool, "flood").await, [FLOOD as i64], "one claim");

    enqueue_gated(pool, &["trickle"], 2).await;
    wait_for(
        "the trickle's jobs to be claimed while the flood holds every slot",
        PATIENCE,
        || async { claims_of(pool, "trickle").await == [2] },
    )
    .await;

    // The trickle's first job waits in hand for a slot from when its claim's reply is read;
    // until then a freed slot goes to the flood, which always has one in hand. A flood
    // that held the trickle back would take every freed slot until it ran out.
    let mut flood_meanwhile = 0;
    while lab.free_one_slot_of(pool, "flood").await == "flood" {
        flood_meanwhile += 1;
        assert!(
            flood_meanwhile < FLOOD - FLOOD_SLOTS,
            "the flood took every slot freed after the trickle was claimed: {:?}",
            lab.starts()
        );
    }

    // Trickle 1 running, its second job in hand; flood 3 running, its next in hand. One
    // flood job ends: the trickle runs fewer, so it takes the slot.
    let taker = lab.free_one_slot_of(pool, "flood").await;
    assert_eq!(
        taker,
        "trickle",
        "with the flood running 2 jobs and the trickle 1, the freed slot went to the \
         flood; starts: {:?}",
        lab.starts()
    );
    lab.open_every_gate();
    stop.shutdown();
    run.await.unwrap().unwrap();
}

/// Workload: 40 jobs in each of queues `a` (weight 3) and `b` (weight 1), one worker of 4
/// slots; every job waits until the test lets it end, one at a time.
///
/// Invariant: while both have work, a freed slot goes to the queue furthest below its
/// weighted share: the running jobs settle at 3 of `a` to 1 of `b`, and stay there
/// whichever queue's job ends (before, the worker ran them in claim order: alternately).
/// Decided by the order of the starts, not their number in a span of time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_queues_share_the_slots_by_weight() {
    let db = test_db().await;
    let pool = &db.pool;
    enqueue_gated(pool, &["a", "b"], 40).await;
    let lab = Lab::new(&["a", "b"]);
    let worker = gated_worker(pool, &lab, &["a", "b"], 4)
        .queue_weight("a", 3)
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("every slot to run a job", PATIENCE, || async {
        lab.starts().len() == 4
    })
    .await;
    wait_for("each queue's jobs to be claimed", PATIENCE, || async {
        claims_of(pool, "a").await == [40] && claims_of(pool, "b").await == [40]
    })
    .await;

    // The running jobs of each queue: started, less those the test let end.
    let mut ended: HashMap<&str, usize> = HashMap::new();
    let running = |lab: &Lab, ended: &HashMap<&str, usize>, queue: &str| {
        let started = lab.starts().iter().filter(|q| *q == queue).count();
        started - ended.get(queue).copied().unwrap_or(0)
    };
    // The first 4 slots went to whichever queue's claim was read first. Jobs of the queue
    // over its share end one at a time until the split is 3:1; a queue whose first job is
    // not yet in hand lets the other take a slot meanwhile, so this takes a few turns.
    let mut turns = 0;
    loop {
        let (a, b) = (running(&lab, &ended, "a"), running(&lab, &ended, "b"));
        if (a, b) == (3, 1) {
            break;
        }
        turns += 1;
        assert!(
            turns <= 20,
            "the running jobs never settled at 3 of a to 1 of b: {a} to {b}; starts: {:?}",
            lab.starts()
        );
        let over = if a > 3 { "a" } else { "b" };
        *ended.entry(over).or_default() += 1;
        lab.free_one_slot_of(pool, over).await;
    }

    // Both queues have started a job, so each waits with its next in hand: a freed slot
    // goes back to the queue whose job ended (a 2 of 3 runs below b's 1 of 1; b 0 of 1
    // below a's 3 of 3).
    for queue in ["a", "b"].into_iter().cycle().take(20) {
        *ended.entry(queue).or_default() += 1;
        let taker = lab.free_one_slot_of(pool, queue).await;
        assert_eq!(
            taker,
            queue,
            "a job of {queue} ended with 3 of a to 1 of b running, and its slot went to \
             {taker}; starts: {:?}",
            lab.starts()
        );
    }
    assert_eq!(
        (running(&lab, &ended, "a"), running(&lab, &ended, "b")),
        (3, 1)
    );
    lab.open_every_gate();
    stop.shutdown();
    run.await.unwrap().unwrap();
}

/// A weight that cannot apply is refused when the worker is built.
#[tokio::test]
async fn a_weight_that_cannot_apply_is_refused() {
    let db = test_db().await;
    let recorder = Recorder::default();
    for (builder, expected) in [
        (
            fast_worker(&db.pool, &recorder).queue_weight("default", 0),
            "weights go from 1 to 1000",
        ),
        (
            fast_worker(&db.pool, &recorder).queue_weight("elsewhere", 2),
            "does not claim from it",
        ),
        (
            fast_worker(&db.pool, &recorder)
                .queue_concurrency("mail", 2)
                .queue_weight("mail", 2),
            "has slots of its own",
        ),
    ] {
        let error = builder.build().err().expect("refused").to_string();
        assert!(error.contains(expected), "{error}");
    }
}
