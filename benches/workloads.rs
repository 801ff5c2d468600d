//! Workload benchmark: I/O-bound and CPU-bound jobs, and whether they starve the worker's
//! own heartbeats and claims.
//!
//! - I/O-bound: `sleep` jobs of 50 ms at concurrency 500 (ideal: 10,000 jobs/s);
//! - CPU-bound: jobs hashing for about 5 ms (calibrated at start) at concurrency equal to
//!   the number of cores, run right on the async runtime's threads as a naive handler would.
//!
//! Both workers heartbeat every second and count a claim stale after 5 s (default: 2 s and
//! 30 s), so starvation would show quickly. A few long `sleep` jobs in a queue of their own
//! (queue concurrency 4) run alongside; their claims must be extended throughout. A monitor
//! samples the oldest heartbeat among running rows every 100 ms. Reported: throughput
//! against the ideal, the oldest heartbeat seen, the longest gap between two claim
//! statements while work remained, and jobs that ran more than once (reaped).
//!
//! `cargo bench --bench workloads -- --quick` (or `SKIPLOCK_BENCH_QUICK=1`).

mod support;

use std::hash::{DefaultHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use skiplock::builtin::Sleep;
use skiplock::{Job, JobContext, JobError, Worker};
use support::{BenchDb, Opts, Table, WorkerThread, progress, rate, thousands};

const HEARTBEAT: Duration = Duration::from_secs(1);
const STALE_AFTER: Duration = Duration::from_secs(5);
const SENTINEL_QUEUE: &str = "bench_sentinel";
/// Longest a workload may run before its worker is stopped.
const CAP: Duration = Duration::from_secs(90);

/// Hashes 1 KiB `rounds` times: CPU work that never yields.
#[derive(Serialize, Deserialize)]
struct Hash {
    rounds: u64,
}

/// Time spent in hashing handlers, for the mean job duration.
#[derive(Default)]
struct CpuSpent {
    nanos: AtomicU64,
    jobs: AtomicU64,
}

impl Job for Hash {
    const KIND: &'static str = "bench_hash";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let t = Instant::now();
        std::hint::black_box(hash_rounds(self.rounds));
        if let Some(spent) = ctx.data::<Arc<CpuSpent>>() {
            spent
                .nanos
                .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            spent.jobs.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

fn hash_rounds(rounds: u64) -> u64 {
    let block = [0x5au8; 1024];
    let mut hasher = DefaultHasher::new();
    for i in 0..rounds {
        hasher.write_u64(i);
        hasher.write(std::hint::black_box(&block));
    }
    hasher.finish()
}

/// Rounds that take about `target` on this machine (best of several tries, so a busy
/// machine does not shrink the job).
fn calibrate(target: Duration) -> u64 {
    let probe = 2_000u64;
    let best = (0..7)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(hash_rounds(probe));
            t.elapsed()
        })
        .min()
        .unwrap_or(Duration::from_millis(1));
    ((target.as_secs_f64() / best.as_secs_f64()) * probe as f64).max(1.0) as u64
}

/// What one workload run showed.
struct Outcome {
    jobs: i64,
    secs: f64,
    max_heartbeat_age_ms: f64,
    max_claim_gap_ms: f64,
    jobs_per_claim: f64,
    reaped: i64,
    lost: u64,
}

#[tokio::main]
async fn main() {
    let opts = Opts::parse();
    let db = BenchDb::create("workloads").await;
    support::print_header("Workloads: I/O-bound and CPU-bound jobs", &db, &opts).await;
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut table = Table::new(&[
        "workload",
        "conc.",
        "jobs",
        "secs",
        "jobs/s",
        "ideal jobs/s",
        "of ideal",
        "max heartbeat age ms",
        "max claim gap ms",
        "jobs/claim",
        "reaped",
    ]);

    // I/O-bound.
    let n_sleep: i64 = if opts.quick { 20_000 } else { 50_000 };
    let conc_sleep = 500;
    progress(format!(
        "I/O-bound: {n_sleep} sleep jobs of 50 ms at concurrency {conc_sleep}"
    ));
    let sentinel_ms = if opts.quick { 6_000 } else { 10_000 };
    let pgss = support::pgss_enabled(&db).await;
    let first = sentinels(&db, sentinel_ms).await;
    if pgss {
        support::pgss_reset(&db).await;
    }
    db.preload_kind("sleep", "'{\"ms\": 50}'::jsonb", n_sleep)
        .await;
    let worker = WorkerThread::spawn(&db, move |pool| {
        Worker::builder(pool)
            .register::<Sleep>()
            .concurrency(conc_sleep)
            .queues(["default"])
            .queue_concurrency(SENTINEL_QUEUE, 4)
            .heartbeat(HEARTBEAT, STALE_AFTER)
            .exit_when_idle(true)
            .build()
            .expect("worker")
    });
    let io = observe(&db, worker, first).await;
    if pgss {
        println!("#### Statements during the I/O-bound workload");
        println!();
        support::pgss_print(&db).await;
    }
    let ideal = conc_sleep as f64 / 0.05;
    table.row(row("sleep 50 ms", conc_sleep, &io, ideal));

    // CPU-bound.
    db.reset().await;
    let rounds = calibrate(Duration::from_millis(5));
    let n_cpu: i64 = if opts.quick { 1_000 } else { 3_000 };
    progress(format!(
        "CPU-bound: {n_cpu} hashing jobs of ~5 ms ({rounds} rounds of 1 KiB) at concurrency {cores}"
    ));
    let first = sentinels(&db, sentinel_ms).await;
    if pgss {
        support::pgss_reset(&db).await;
    }
    db.preload_kind(
        "bench_hash",
        &format!("jsonb_build_object('rounds', {rounds})"),
        n_cpu,
    )
    .await;
    let spent = Arc::new(CpuSpent::default());
    let data = spent.clone();
    let worker = WorkerThread::spawn(&db, move |pool| {
        Worker::builder(pool)
            .register::<Hash>()
            .register::<Sleep>()
            .concurrency(cores)
            .queues(["default"])
            .queue_concurrency(SENTINEL_QUEUE, 4)
            .heartbeat(HEARTBEAT, STALE_AFTER)
            .data(data)
            .exit_when_idle(true)
            .build()
            .expect("worker")
    });
    let cpu = observe(&db, worker, first).await;
    if pgss {
        println!("#### Statements during the CPU-bound workload");
        println!();
        support::pgss_print(&db).await;
    }
    let mean_ms = spent.nanos.load(Ordering::Relaxed) as f64
        / spent.jobs.load(Ordering::Relaxed).max(1) as f64
        / 1e6;
    let ideal = cores as f64 / 0.005;
    table.row(row(
        &format!("hash ~5 ms (mean in handler {mean_ms:.1} ms)"),
        cores,
        &cpu,
        ideal,
    ));

    println!("### Workloads (heartbeat every {HEARTBEAT:?}, stale after {STALE_AFTER:?})");
    println!();
    table.print();
    println!(
        "\"max heartbeat age\": oldest `now() - heartbeat_at` among running rows (buffered, \
         running and sentinel claims), sampled every 100 ms; it stays below the interval plus \
         a statement when heartbeats are not starved. \"max claim gap\": longest time between \
         two claim statements of the workload's jobs. \"reaped\": jobs that ran more than once \
         or carry an error. Lost claims reported by the workers: I/O {}, CPU {}.",
        io.lost, cpu.lost
    );
    println!();
    db.drop_database().await;
}

/// Four long sleep jobs in the sentinel queue; returns the last id before the workload.
async fn sentinels(db: &BenchDb, ms: u64) -> i64 {
    db.exec(&format!(
        "INSERT INTO skiplock.jobs (kind, args, queue)
         SELECT 'sleep', jsonb_build_object('ms', {ms}), '{SENTINEL_QUEUE}'
         FROM generate_series(1, 4)"
    ))
    .await;
    db.max_id().await
}

/// Runs `worker` until idle (at most [`CAP`]) while sampling the oldest heartbeat;
/// measures the workload (jobs with `id > after_id`) in the database.
async fn observe(db: &BenchDb, mut worker: WorkerThread, after_id: i64) -> Outcome {
    let mut max_age = 0.0f64;
    let mut last_report = Instant::now();
    let summary = loop {
        if let Some(summary) = worker.finished(Duration::from_millis(100)).await {
            break summary;
        }
        let age = db
            .scalar_f64(
                "SELECT coalesce(extract(epoch FROM max(now() - heartbeat_at))::float8, 0) * 1000
                 FROM skiplock.jobs WHERE state = 'running'",
            )
            .await;
        max_age = max_age.max(age);
        worker.enforce_cap(CAP, -1);
        if last_report.elapsed() >= Duration::from_secs(2) {
            last_report = Instant::now();
            let left = db
                .scalar_i64(
                    "SELECT count(*) FROM skiplock.jobs WHERE state IN ('queued', 'running')",
                )
                .await;
            progress(format!(
                "  {:.0} s: {left} jobs unfinished, oldest heartbeat so far {max_age:.0} ms",
                worker.elapsed().as_secs_f64()
            ));
        }
    };
    db.wait_workers_gone().await;
    let d = db.drained_since(after_id).await;
    let gap = db
        .scalar_f64(&format!(
            "SELECT coalesce(max(gap), 0) FROM (
                 SELECT extract(epoch FROM c - lag(c) OVER (ORDER BY c))::float8 * 1000 AS gap
                 FROM (SELECT DISTINCT claimed_at AS c FROM skiplock.jobs WHERE id > {after_id}) s
             ) g"
        ))
        .await;
    let reaped = db
        .scalar_i64(
            "SELECT count(*) FROM skiplock.jobs WHERE attempt > 1 OR last_error IS NOT NULL",
        )
        .await;
    let out = Outcome {
        jobs: d.jobs,
        secs: d.secs,
        max_heartbeat_age_ms: max_age,
        max_claim_gap_ms: gap,
        jobs_per_claim: d.jobs as f64 / d.claim_statements.max(1) as f64,
        reaped,
        lost: summary.map_or(0, |s| s.lost),
    };
    progress(format!(
        "  {} jobs in {:.2} s = {}; oldest heartbeat {max_age:.0} ms; longest claim gap {gap:.0} ms; {reaped} reaped; {summary:?}",
        thousands(out.jobs),
        out.secs,
        rate(d.rate()),
    ));
    out
}

fn row(name: &str, conc: usize, o: &Outcome, ideal: f64) -> Vec<String> {
    let achieved = if o.secs > 0.0 {
        o.jobs as f64 / o.secs
    } else {
        0.0
    };
    vec![
        name.to_owned(),
        conc.to_string(),
        thousands(o.jobs),
        format!("{:.2}", o.secs),
        rate(achieved),
        rate(ideal),
        format!("{:.0} %", achieved / ideal * 100.0),
        format!("{:.0}", o.max_heartbeat_age_ms),
        format!("{:.0}", o.max_claim_gap_ms),
        format!("{:.1}", o.jobs_per_claim),
        o.reaped.to_string(),
    ]
}
