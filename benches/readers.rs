//! Active readers: claim latency while sessions poll the jobs table the way an operator's
//! script or a dashboard does (issue 27).
//!
//! A producer inserts `--rate` jobs per second (default 800, in one statement every 10 ms)
//! of a kind whose handler notes how long after its insert it started and then works for
//! 1 ms; one worker runs them with 32 slots and default settings otherwise. The latency is
//! from the producer's clock just before the insert to the handler's start (both this
//! process's clock), so it holds the insert's own commit too.
//!
//! The table holds `--finished` succeeded jobs (default 500,000: what a day's retention
//! keeps at a few jobs per second) with fresh statistics; with `--history-days D`, that
//! many a day for each of the D days before today, each day in its own table as retention
//! keeps them (issue 37's target: 7 days of 1,000,000). Three phases of `--secs` each
//! (default 60; 20 with `--quick`):
//!
//! - `clean`: no readers;
//! - `readers on jobs`: four sessions, each a REPEATABLE READ transaction running
//!   `SELECT count(*) FROM skiplock.jobs` every 100 ms (a new transaction each time);
//! - `readers on a copy`: the same four readers on `public.jobs_copy`, a table of the same
//!   rows that skiplock never touches. Its cost is the readers' own (CPU and I/O on two
//!   cores); what the phase before costs beyond it is what the readers do to the claim
//!   (the horizon they hold back, the index entries the claim then steps over);
//! - `readers of pending jobs`: the same four REPEATABLE READ readers counting only what is
//!   pending, one `state = …` count per state so that each reads its small partial index
//!   (as `skiplock.stats` does; `state IN (…)` matches none of them and reads the table):
//!   they hold the horizon back as often as the readers of the whole table, without their
//!   CPU.
//!
//! Reported per phase: the rate inserted and run, the backlog at the end, the latency's
//! p50, p99 and max, the readers' counts done, and the CPU seconds of Postgres and of this
//! process per second of the phase.
//!
//! `cargo bench --bench readers -- --quick` (`--only clean|jobs|copy|pending` for one phase).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use skiplock::{Job, JobContext, JobError, Worker};
use sqlx::Connection;
use support::{BenchDb, Opts, Table, WorkerThread, progress, quantile, rate, thousands};
use tokio::sync::mpsc;

/// Slots of the worker, as in the harness the issue cites.
const CONCURRENCY: usize = 32;
/// Reader sessions, and how often each counts.
const READERS: usize = 4;
const READ_EVERY: Duration = Duration::from_millis(100);
/// How long each job works once started.
const WORK: Duration = Duration::from_millis(1);

/// Microseconds since the Unix epoch on this process's clock.
fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// A job that reports how long after the producer's timestamp its handler started.
#[derive(Serialize, Deserialize)]
struct Timed {
    sent_at_us: i64,
}

/// Where jobs report their latency, in microseconds.
struct Latencies(mpsc::UnboundedSender<i64>);

impl Job for Timed {
    const KIND: &'static str = "bench_timed";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let latency_us = now_us() - self.sent_at_us;
        if let Some(latencies) = ctx.data::<Latencies>() {
            let _ = latencies.0.send(latency_us);
        }
        tokio::time::sleep(WORK).await;
        Ok(())
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Readers {
    None,
    OnJobs,
    OnCopy,
    OfPending,
}

impl Readers {
    fn name(self) -> &'static str {
        match self {
            Readers::None => "clean",
            Readers::OnJobs => "readers on jobs",
            Readers::OnCopy => "readers on a copy",
            Readers::OfPending => "readers of pending jobs",
        }
    }
}

#[tokio::main]
async fn main() {
    let opts = Opts::parse();
    let db = BenchDb::create("readers").await;
    support::print_header("Active readers of the jobs table", &db, &opts).await;
    let secs: u64 = opts.number("secs", if opts.quick { 20 } else { 60 });
    let per_sec: f64 = opts.number("rate", 800.0);
    let finished: i64 = opts.number("finished", 500_000);
    let history_days: i32 = opts.number("history-days", 0);
    let kept = if history_days > 0 {
        format!("{history_days} days × {}", thousands(finished))
    } else {
        thousands(finished)
    };
    let phases: Vec<Readers> = match opts.value("only") {
        Some("clean") => vec![Readers::None],
        Some("jobs") => vec![Readers::OnJobs],
        Some("copy") => vec![Readers::OnCopy],
        Some("pending") => vec![Readers::OfPending],
        Some(other) => panic!("--only {other}: expected clean, jobs, copy or pending"),
        None => vec![
            Readers::None,
            Readers::OnJobs,
            Readers::OnCopy,
            Readers::OfPending,
        ],
    };

    let mut table = Table::new(&[
        "phase",
        "inserted/s",
        "run/s",
        "queued at end",
        "latency p50 ms",
        "latency p99 ms",
        "latency max ms",
        "counts done",
        "Postgres CPU s/s",
        "bench CPU s/s",
    ]);
    for phase in phases {
        db.reset().await;
        if history_days > 0 {
            db.preload_finished_days(history_days, finished).await;
        } else {
            db.preload_finished(finished).await;
        }
        if phase == Readers::OnCopy {
            db.exec("DROP TABLE IF EXISTS public.jobs_copy").await;
            db.exec("CREATE TABLE public.jobs_copy AS SELECT * FROM skiplock.jobs")
                .await;
            db.exec("VACUUM ANALYZE public.jobs_copy").await;
        }
        progress(format!(
            "{}: {} jobs/s for {secs} s beside {kept} finished jobs",
            phase.name(),
            thousands(per_sec as i64),
        ));
        table.row(run_phase(&db, phase, per_sec, Duration::from_secs(secs)).await);
    }
    println!(
        "### Claim latency with sessions counting the table ({} jobs/s of 1 ms jobs, {CONCURRENCY} slots, {kept} finished jobs kept)",
        thousands(per_sec as i64),
    );
    println!();
    table.print();
    println!(
        "Target (issue 27): with four REPEATABLE READ readers on the jobs table, latency p99 \
         <= 15 ms. The copy phase is the readers' own cost on this machine; the pending \
         phase is the same readers, as often, without that cost."
    );
    println!();
    db.drop_database().await;
}

/// One phase: readers, worker and producer for `length`; returns the table row.
async fn run_phase(db: &BenchDb, phase: Readers, per_sec: f64, length: Duration) -> Vec<String> {
    let running = Arc::new(AtomicBool::new(true));
    let counts = Arc::new(AtomicI64::new(0));
    let mut readers = Vec::new();
    if phase != Readers::None {
        let sql = match phase {
            Readers::OnCopy => "SELECT count(*) FROM public.jobs_copy",
            Readers::OfPending => {
                "SELECT (SELECT count(*) FROM skiplock.jobs WHERE state = 'waiting')
                      + (SELECT count(*) FROM skiplock.jobs WHERE state = 'queued')
                      + (SELECT count(*) FROM skiplock.jobs WHERE state = 'running')"
            }
            _ => "SELECT count(*) FROM skiplock.jobs",
        };
        for _ in 0..READERS {
            let mut conn = db.connection().await;
            let running = running.clone();
            let counts = counts.clone();
            readers.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(READ_EVERY);
                while running.load(Ordering::Relaxed) {
                    tick.tick().await;
                    let mut tx = conn.begin().await.expect("reader begin");
                    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                        .execute(&mut *tx)
                        .await
                        .expect("reader isolation");
                    let _: i64 = sqlx::query_scalar(sql)
                        .fetch_one(&mut *tx)
                        .await
                        .expect("reader count");
                    tx.commit().await.expect("reader commit");
                    counts.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
    }

    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut worker = WorkerThread::spawn(db, move |pool| {
        Worker::builder(pool)
            .register::<Timed>()
            .concurrency(CONCURRENCY)
            .data(Latencies(tx))
            .build()
            .expect("worker")
    });
    let inserted = Arc::new(AtomicI64::new(0));
    let producer_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .expect("producer pool");
    let producer = {
        let pool = producer_pool.clone();
        let running = running.clone();
        let inserted = inserted.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            let started = Instant::now();
            while running.load(Ordering::Relaxed) {
                tick.tick().await;
                let due = (started.elapsed().as_secs_f64() * per_sec) as i64;
                let n = due - inserted.load(Ordering::Relaxed);
                if n <= 0 {
                    continue;
                }
                sqlx::query(
                    "INSERT INTO skiplock.jobs (kind, args)
                     SELECT 'bench_timed', jsonb_build_object('sent_at_us', $1::bigint)
                     FROM generate_series(1, $2)",
                )
                .bind(now_us())
                .bind(n)
                .execute(&pool)
                .await
                .expect("producer insert");
                inserted.fetch_add(n, Ordering::Relaxed);
            }
        })
    };

    let cpu_pg = support::postgres_cpu_secs();
    let cpu_self = support::process_cpu_secs("self").unwrap_or(0.0);
    let started = Instant::now();
    tokio::time::sleep(length).await;
    running.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_pg = support::postgres_cpu_secs() - cpu_pg;
    let cpu_self = support::process_cpu_secs("self").unwrap_or(0.0) - cpu_self;
    let _ = producer.await;
    for reader in readers {
        let _ = reader.await;
    }
    let queued_at_end = db
        .scalar_i64("SELECT count(*) FROM skiplock.jobs WHERE state IN ('queued', 'running')")
        .await;
    worker.stop().await;
    db.wait_workers_gone().await;
    producer_pool.close().await;

    let mut latencies_ms = Vec::new();
    while let Ok(us) = rx.try_recv() {
        latencies_ms.push(us as f64 / 1000.0);
    }
    latencies_ms.sort_by(f64::total_cmp);
    let run = latencies_ms.len();
    vec![
        phase.name().to_owned(),
        rate(inserted.load(Ordering::Relaxed) as f64 / elapsed),
        rate(run as f64 / elapsed),
        thousands(queued_at_end),
        format!("{:.1}", quantile(&latencies_ms, 0.5)),
        format!("{:.1}", quantile(&latencies_ms, 0.99)),
        format!("{:.1}", latencies_ms.last().copied().unwrap_or(0.0)),
        thousands(counts.load(Ordering::Relaxed)),
        format!("{:.2}", cpu_pg / elapsed),
        format!("{:.2}", cpu_self / elapsed),
    ]
}
