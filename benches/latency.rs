//! Latency benchmark: from enqueue commit to handler start.
//!
//! A worker with default settings runs in this process on its own runtime and thread. A
//! client on the bench's runtime enqueues probe jobs one at a time, each in its own
//! transaction, and notes the instant `enqueue` returned (the commit is acknowledged); the
//! probe's handler notes the instant it starts. Both are `std::time::Instant`s of this
//! process, so they share one clock. A probe can start before the client has read the
//! commit acknowledgement, so a latency can be slightly negative.
//!
//! - idle: 1,000 probes into an idle worker, 2–5 ms apart (each after the previous started);
//! - loaded: the same while another client inserts `noop` jobs at half the peak drain rate
//!   (measured first, as in the drain bench, or given with `--peak-rate N`).
//!
//! Both phases run on a table holding 100,000 finished jobs with fresh statistics; a phase
//! gives up after 5 probes that did not start within 5 s.
//!
//! `cargo bench --bench latency -- --quick` (or `SKIPLOCK_BENCH_QUICK=1`).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use skiplock::builtin::Noop;
use skiplock::{Job, JobContext, JobError, Worker};
use support::{
    BenchDb, DrainCfg, Opts, Table, WorkerThread, drain_noop, progress, quantile, rate, thousands,
};
use tokio::sync::mpsc;

/// Probes that may time out (5 s each) before a phase gives up.
const MAX_TIMEOUTS: usize = 5;

/// A job that reports the instant its handler started.
#[derive(Serialize, Deserialize)]
struct Probe {}

/// Where probes report `(job id, handler start)`.
struct Starts(mpsc::UnboundedSender<(i64, Instant)>);

impl Job for Probe {
    const KIND: &'static str = "bench_probe";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let started = Instant::now();
        if let Some(starts) = ctx.data::<Starts>() {
            let _ = starts.0.send((ctx.id().0, started));
        }
        Ok(())
    }
}

/// One phase's numbers, in milliseconds.
struct Latencies {
    /// Enqueue commit to handler start, sorted.
    start: Vec<f64>,
    /// Duration of the `enqueue` call itself (insert + commit round trip), sorted.
    enqueue: Vec<f64>,
    timeouts: usize,
}

#[tokio::main]
async fn main() {
    let opts = Opts::parse();
    let db = BenchDb::create("latency").await;
    support::print_header("Latency: enqueue commit to handler start", &db, &opts).await;
    let probes: usize = if opts.quick { 500 } else { 1_000 };

    let peak = match opts.value("peak-rate").and_then(|v| v.parse::<f64>().ok()) {
        Some(peak) => peak,
        None => {
            let n = if opts.quick { 100_000 } else { 200_000 };
            progress(format!("peak drain rate: {n} noop jobs, default settings"));
            db.preload_noop(n).await;
            let run = drain_noop(&db, DrainCfg::capped(Duration::from_secs(60))).await;
            progress(format!("  peak {}", rate(run.drained.rate())));
            run.drained.rate()
        }
    };
    // A table with history and fresh statistics. Without them (a table analyzed while
    // empty, as after `reset`) the claim's plan sorts the whole backlog on every claim; the
    // drain bench shows that case.
    db.reset().await;
    db.preload_finished(100_000).await;
    let history_end = db.max_id().await;

    let (starts_tx, starts_rx) = mpsc::unbounded_channel();
    let mut worker = WorkerThread::spawn(&db, move |pool| {
        Worker::builder(pool)
            .register::<Noop>()
            .register::<Probe>()
            .data(Starts(starts_tx))
            .build()
            .expect("worker")
    });
    let (idle, loaded, load) = client(db.url.clone(), starts_rx, probes, peak / 2.0).await;
    let summary = worker.stop().await;
    progress(format!("worker stopped: {summary:?}"));
    db.wait_workers_gone().await;

    // Database-side wait of the background jobs: claim transaction start minus insert
    // transaction start, both by the database clock.
    let waits: (f64, f64, f64) = sqlx::query_as(
        "SELECT coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), 0),
                coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), 0),
                coalesce(max(ms), 0)
         FROM (SELECT extract(epoch FROM claimed_at - created_at)::float8 * 1000 AS ms
               FROM skiplock.jobs
               WHERE kind = 'noop' AND claimed_at IS NOT NULL AND id > $1) w",
    )
    .bind(history_end)
    .fetch_one(&db.pool)
    .await
    .expect("waits");

    let mut table = Table::new(&[
        "phase",
        "probes",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "max ms",
        "min ms",
        "enqueue call p50 ms",
        "timeouts",
    ]);
    for (name, l) in [("idle worker", &idle), ("under load", &loaded)] {
        table.row(vec![
            name.to_owned(),
            l.start.len().to_string(),
            format!("{:.2}", quantile(&l.start, 0.5)),
            format!("{:.2}", quantile(&l.start, 0.9)),
            format!("{:.2}", quantile(&l.start, 0.99)),
            format!("{:.2}", quantile(&l.start, 1.0)),
            format!("{:.2}", quantile(&l.start, 0.0)),
            format!("{:.2}", quantile(&l.enqueue, 0.5)),
            l.timeouts.to_string(),
        ]);
    }
    println!("### Enqueue commit → handler start");
    println!();
    table.print();
    println!(
        "Load: peak drain rate {} (default settings), background inserts at {} \
         (target {}), in statements every 10 ms. Background jobs' wait in the database \
         (claim minus insert transaction start): p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms.",
        rate(peak),
        rate(load),
        rate(peak / 2.0),
        waits.0,
        waits.1,
        waits.2
    );
    println!("Targets (issue 6): idle p50 ≤ 1 ms, p99 ≤ 5 ms.");
    println!();
    db.drop_database().await;
}

/// The probing client: idle probes, then probes under a background load of `load_rate`
/// jobs/s. Returns both phases and the load rate achieved.
async fn client(
    url: String,
    mut starts: mpsc::UnboundedReceiver<(i64, Instant)>,
    probes: usize,
    load_rate: f64,
) -> (Latencies, Latencies, f64) {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("client pool");
    // Warm up: the listener is connected and the statements are prepared.
    progress("warming up (20 probes)");
    probe(&pool, &mut starts, 20).await;
    progress(format!("idle: {probes} probes"));
    let idle = probe(&pool, &mut starts, probes).await;
    report("idle", &idle);

    progress(format!(
        "loaded: background inserts at {} for 2 s, then {probes} probes",
        rate(load_rate)
    ));
    let load_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("load pool");
    let running = Arc::new(AtomicBool::new(true));
    let inserted = Arc::new(AtomicI64::new(0));
    let load = tokio::spawn(support::insert_noop_at_rate(
        load_pool.clone(),
        load_rate,
        running.clone(),
        inserted.clone(),
    ));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t0 = Instant::now();
    let before = inserted.load(Ordering::Relaxed);
    let loaded = probe(&pool, &mut starts, probes).await;
    let achieved = (inserted.load(Ordering::Relaxed) - before) as f64 / t0.elapsed().as_secs_f64();
    running.store(false, Ordering::Relaxed);
    let _ = load.await;
    report("loaded", &loaded);
    let backlog: i64 =
        sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state = 'queued'")
            .fetch_one(&pool)
            .await
            .unwrap_or(-1);
    progress(format!(
        "  background load achieved {}; {} jobs queued when it stopped",
        rate(achieved),
        thousands(backlog)
    ));
    pool.close().await;
    load_pool.close().await;
    (idle, loaded, achieved)
}

/// Enqueues `n` probes one at a time, each after the previous one started plus 2–5 ms.
async fn probe(
    pool: &sqlx::PgPool,
    starts: &mut mpsc::UnboundedReceiver<(i64, Instant)>,
    n: usize,
) -> Latencies {
    let mut start = Vec::with_capacity(n);
    let mut enqueue = Vec::with_capacity(n);
    let mut timeouts = 0;
    for _ in 0..n {
        let t = Instant::now();
        let id = skiplock::enqueue(pool, &Probe {}, skiplock::EnqueueOptions::default())
            .await
            .expect("enqueue")
            .id
            .0;
        let committed = Instant::now();
        enqueue.push(ms(committed.duration_since(t)));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            match tokio::time::timeout_at(deadline, starts.recv()).await {
                Ok(Some((got, started))) if got == id => {
                    start.push(signed_ms(committed, started));
                    break;
                }
                Ok(Some(_)) => continue, // a late probe from an earlier timeout
                Ok(None) | Err(_) => {
                    timeouts += 1;
                    break;
                }
            }
        }
        if timeouts >= MAX_TIMEOUTS {
            progress(format!(
                "  {timeouts} probes did not start within 5 s; the worker is not keeping up, \
                 giving up this phase"
            ));
            break;
        }
        tokio::time::sleep(Duration::from_micros(2_000 + fastrand::u64(..3_000))).await;
    }
    start.sort_by(f64::total_cmp);
    enqueue.sort_by(f64::total_cmp);
    Latencies {
        start,
        enqueue,
        timeouts,
    }
}

fn report(phase: &str, l: &Latencies) {
    progress(format!(
        "  {phase}: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; enqueue call p50 {:.2} ms; {} timeouts",
        quantile(&l.start, 0.5),
        quantile(&l.start, 0.99),
        quantile(&l.start, 1.0),
        quantile(&l.enqueue, 0.5),
        l.timeouts
    ));
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// `later - earlier` in milliseconds, negative if `later` came first.
fn signed_ms(earlier: Instant, later: Instant) -> f64 {
    match later.checked_duration_since(earlier) {
        Some(d) => ms(d),
        None => -ms(earlier.duration_since(later)),
    }
}
