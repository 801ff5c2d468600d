//! Waiting for an outcome: from a job's end to `skiplock::wait_for` returning it.
//!
//! A worker with default settings runs in this process on its own runtime and thread. For
//! each probe the client enqueues a job (its own transaction) and starts `wait_for` on it;
//! the job's handler starts, and ends only once the client saw the job marked awaited (so
//! the wake-up is the notification's, not a first look that found the job finished). The
//! handler notes the instant it returned; the client notes the instant `wait_for` returned.
//! Both are `std::time::Instant`s of this process. What lies between: the completer's
//! write and commit, the notification, and the waiter's one look at the row. With
//! `track_commit_timestamp` on (`benches/with-private-server.sh -c
//! track_commit_timestamp=on -- …`), the bench also reads when each completion committed
//! (`pg_xact_commit_timestamp` of the finished row) and gives the time from that commit to
//! the return, both on the machine's wall clock (the bench runs beside the server).
//!
//! `cargo bench --bench wait_for -- --quick` (or `SKIPLOCK_BENCH_QUICK=1`).

mod support;

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use skiplock::{Job, JobContext, JobError, JobState, Worker};
use support::{BenchDb, Opts, Table, WorkerThread, progress, quantile};
use tokio::sync::{Semaphore, mpsc};

/// A job that reports its start, waits for the client's permit, and reports its end.
#[derive(Serialize, Deserialize)]
struct Held {}

/// The channels between the probes' handlers and the client.
struct Gate {
    started: mpsc::UnboundedSender<i64>,
    permits: std::sync::Arc<Semaphore>,
    ended: mpsc::UnboundedSender<(i64, Instant)>,
}

impl Job for Held {
    const KIND: &'static str = "bench_held";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let gate = ctx.data::<Gate>().expect("gate");
        let _ = gate.started.send(ctx.id().0);
        gate.permits.acquire().await.expect("permit").forget();
        let _ = gate.ended.send((ctx.id().0, Instant::now()));
        Ok(())
    }
}

#[tokio::main]
async fn main() {
    let opts = Opts::parse();
    let db = BenchDb::create("wait_for").await;
    support::print_header(
        "Waiting for an outcome: job end to wait_for's return",
        &db,
        &opts,
    )
    .await;
    let probes: usize = if opts.quick { 200 } else { 1_000 };
    db.reset().await;

    let (started_tx, mut started) = mpsc::unbounded_channel();
    let (ended_tx, mut ended) = mpsc::unbounded_channel();
    let permits = std::sync::Arc::new(Semaphore::new(0));
    let gate_permits = permits.clone();
    let mut worker = WorkerThread::spawn(&db, move |pool| {
        Worker::builder(pool)
            .register::<Held>()
            .data(Gate {
                started: started_tx,
                permits: gate_permits,
                ended: ended_tx,
            })
            .build()
            .expect("worker")
    });
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&db.url)
        .await
        .expect("client pool");

    let mut woken = Vec::with_capacity(probes);
    let mut returns = Vec::with_capacity(probes);
    progress(format!("{probes} probes, after 20 to warm up"));
    for n in 0..probes + 20 {
        let id = skiplock::enqueue(&pool, &Held {}, skiplock::EnqueueOptions::default())
            .await
            .expect("enqueue")
            .id;
        let waiter = {
            let pool = pool.clone();
            tokio::spawn(async move {
                let outcome = skiplock::wait_for(&pool, id, Duration::from_secs(30)).await;
                (outcome, Instant::now(), std::time::SystemTime::now())
            })
        };
        assert_eq!(started.recv().await, Some(id.0), "the probe's start");
        loop {
            let awaited: Option<bool> =
                sqlx::query_scalar("SELECT awaited FROM skiplock.jobs WHERE id = $1")
                    .bind(id.0)
                    .fetch_one(&pool)
                    .await
                    .expect("awaited");
            if awaited == Some(true) {
                break;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        permits.add_permits(1);
        let (got, handler_end) = ended.recv().await.expect("the probe's end");
        assert_eq!(got, id.0);
        let (outcome, returned, returned_at) = waiter.await.expect("waiter");
        assert_eq!(outcome.expect("outcome").state, JobState::Succeeded);
        if n >= 20 {
            woken.push(returned.duration_since(handler_end).as_secs_f64() * 1000.0);
            let unix = returned_at
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_secs_f64();
            returns.push((id.0, unix));
        }
    }
    let summary = worker.stop().await;
    progress(format!("worker stopped: {summary:?}"));
    let tracked: bool =
        sqlx::query_scalar("SELECT current_setting('track_commit_timestamp')::bool")
            .fetch_one(&pool)
            .await
            .expect("track_commit_timestamp");
    let mut after_commit = Vec::with_capacity(returns.len());
    if tracked {
        for (id, returned_at) in &returns {
            let committed: f64 = sqlx::query_scalar(
                "SELECT extract(epoch FROM pg_xact_commit_timestamp(xmin))::float8
                 FROM skiplock.jobs WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .expect("commit timestamp");
            after_commit.push((returned_at - committed) * 1000.0);
        }
    }
    pool.close().await;
    woken.sort_by(f64::total_cmp);
    after_commit.sort_by(f64::total_cmp);

    let mut table = Table::new(&[
        "from", "probes", "p50 ms", "p90 ms", "p99 ms", "max ms", "min ms",
    ]);
    for (from, times) in [
        ("the handler's end", &woken),
        ("the completion's commit", &after_commit),
    ] {
        if times.is_empty() {
            continue;
        }
        table.row(vec![
            from.to_owned(),
            times.len().to_string(),
            format!("{:.2}", quantile(times, 0.5)),
            format!("{:.2}", quantile(times, 0.9)),
            format!("{:.2}", quantile(times, 0.99)),
            format!("{:.2}", quantile(times, 1.0)),
            format!("{:.2}", quantile(times, 0.0)),
        ]);
    }
    println!("### To wait_for's return of the outcome (idle worker, one waiter at a time)");
    println!();
    table.print();
    if !tracked {
        println!("(track_commit_timestamp is off: no row from the completion's commit.)");
    }
    println!("Target (issue 50): p50 ≤ 2 ms after the job's commit.");
    println!();
    db.drop_database().await;
}
