//! Fair share between the queues of one worker: a flood in one queue never holds another
//! back, and queues that all have work share the slots by weight.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fixtures::{Recorder, fast_worker, wait_for};
use common::test_db;
use serde::{Deserialize, Serialize};
use skiplock::{EnqueueOptions, Job, JobContext, JobError, NewJob};
use sqlx::PgPool;

/// Longest wait for a worker to settle what the database holds.
const PATIENCE: Duration = Duration::from_secs(60);

/// The queue of every job that started, in start order.
#[derive(Clone, Default)]
struct Starts(Arc<Mutex<Vec<String>>>);

/// Takes `ms` milliseconds, recording its queue when it starts.
#[derive(Serialize, Deserialize)]
struct Tracked {
    ms: u64,
}

impl Job for Tracked {
    const KIND: &'static str = "tracked";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let starts = ctx.data::<Starts>().unwrap();
        starts.0.lock().unwrap().push(ctx.queue().to_owned());
        tokio::time::sleep(Duration::from_millis(self.ms)).await;
        Ok(())
    }
}

async fn enqueue_tracked(pool: &PgPool, queues: &[&str], each: usize, ms: u64) {
    // Interleaved, so that claim order alone (priority, due time, id) would alternate.
    let jobs: Vec<NewJob> = (0..each)
        .flat_map(|_| queues.iter())
        .map(|queue| {
            NewJob::new("tracked", serde_json::json!({ "ms": ms }))
                .with_options(EnqueueOptions::new().queue(*queue))
        })
        .collect();
    skiplock::enqueue_raw(pool, &jobs).await.unwrap();
}

/// Slots of the worker in [`a_flood_in_one_queue_does_not_hold_back_another`].
const FLOOD_SLOTS: usize = 4;

/// Workload: 100 jobs of 200 ms in queue `flood` (5 s of work for 4 slots), then 5 jobs in
/// queue `trickle`, one worker serving both.
///
/// Invariant: the trickle's first job starts about one job's run time after it was
/// enqueued, i.e. when the first slot frees (before, one claim ordered both queues by due
/// time, and the trickle waited for the whole flood). Measured in the jobs' own time, not
/// the machine's speed: each round of 200 ms starts at most 4 flood jobs, and the trickle
/// may see at most 3 rounds of them (the first slot to free, plus two rounds for the
/// trickle's wake-up and claim on a loaded machine) against 96 when starved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_in_one_queue_does_not_hold_back_another() {
    let db = test_db().await;
    let pool = &db.pool;
    enqueue_tracked(pool, &["flood"], 100, 200).await;
    let recorder = Recorder::default();
    let starts = Starts::default();
    let worker = fast_worker(pool, &recorder)
        .register::<Tracked>()
        .data(starts.clone())
        .queues(["flood", "trickle"])
        .concurrency(FLOOD_SLOTS)
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("every slot to run a flood job", PATIENCE, || async {
        starts.0.lock().unwrap().len() >= FLOOD_SLOTS
    })
    .await;
    // Flood jobs that started before the trickle was enqueued (read before the enqueue: a
    // start counted here is one the trickle could not have had).
    let flood_before = starts.0.lock().unwrap().len();
    enqueue_tracked(pool, &["trickle"], 5, 20).await;
    let trickled = |starts: &[String]| starts.iter().filter(|q| *q == "trickle").count();
    wait_for("the trickle to start", PATIENCE, || async {
        trickled(&starts.0.lock().unwrap()) == 5
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
    let starts = starts.0.lock().unwrap().clone();
    let first_trickle = starts.iter().position(|q| q == "trickle").unwrap();
    let flood_meanwhile = first_trickle - flood_before;
    assert!(
        flood_meanwhile <= 3 * FLOOD_SLOTS,
        "{flood_meanwhile} flood jobs started between the trickle's enqueue and its first \
         start (more than 3 rounds of the flood's 200 ms jobs); starts: {starts:?}"
    );
    assert!(
        starts.len() < 100 + 5,
        "the trickle ran only after every job of the flood started"
    );
}

/// Workload: 200 jobs of 20 ms in each of queues `a` (weight 3) and `b` (weight 1), one
/// worker of 4 slots.
///
/// Invariant: while both have work, about three of every four jobs that start are `a`'s
/// (before, the worker ran them in claim order: alternately).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_queues_share_the_slots_by_weight() {
    let db = test_db().await;
    let pool = &db.pool;
    enqueue_tracked(pool, &["a", "b"], 200, 20).await;
    let recorder = Recorder::default();
    let starts = Starts::default();
    let worker = fast_worker(pool, &recorder)
        .register::<Tracked>()
        .data(starts.clone())
        .queues(["a", "b"])
        .queue_weight("a", 3)
        .concurrency(4)
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    // 120 starts: `a` has 200 jobs, so both queues have work throughout.
    wait_for("120 jobs to start", PATIENCE, || async {
        starts.0.lock().unwrap().len() >= 120
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
    let first: Vec<String> = starts.0.lock().unwrap()[..120].to_vec();
    let of_b = first.iter().filter(|q| *q == "b").count();
    assert!(
        (18..=42).contains(&of_b),
        "b started {of_b} of the first 120 jobs; its share is 30: {first:?}"
    );
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
