//! Steady-load benchmark: a producer inserting `noop` jobs at a fixed rate into a worker
//! with default settings, clean and then while another session holds a REPEATABLE READ
//! snapshot with an xid for the whole phase (a long report, `pg_dump`, a forgotten `BEGIN`).
//!
//! Each phase runs for the same time (600 s; 60 s with `--quick`; `--secs N`) at 5,000
//! jobs/s (`--rate N`), in insert statements every 10 ms. Reported per phase: the rate
//! inserted and drained, the backlog at the end (does the worker keep up?), each job's
//! pickup wait in the database (`claimed_at` minus `created_at`, both the database's
//! transaction start times) as p50/p99/max overall and p99 per minute, claim statements,
//! the claim index's size and the table's dead tuples at the end.
//!
//! A second table gives each phase's footprint per 1,000,000 jobs processed: the table's
//! and its indexes' size, live and dead tuples, and the autovacuum passes, read at the end
//! of the phase. Every job succeeded and stays until the pruner's retention (1 day by
//! default) has passed, so the live rows are what the finished-row retention keeps; with
//! autovacuum on (a private server with defaults, `benches/with-private-server.sh`), the
//! dead tuples are what vacuum has not reclaimed yet.
//!
//! `cargo bench --bench steady -- --quick` (`--only clean` or `--only held` for one phase).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use skiplock::Worker;
use skiplock::builtin::Noop;
use support::{BenchDb, Opts, Table, WorkerThread, progress, rate, thousands};

#[tokio::main]
async fn main() {
    let opts = Opts::parse();
    let db = BenchDb::create("steady").await;
    support::print_header("Steady load, clean and with a held snapshot", &db, &opts).await;
    let secs: u64 = opts.number("secs", if opts.quick { 60 } else { 600 });
    let per_sec: f64 = opts.number("rate", 5_000.0);

    let mut table = Table::new(&[
        "phase",
        "secs",
        "inserted/s",
        "claimed/s",
        "queued at end",
        "wait p50 ms",
        "wait p99 ms",
        "wait max ms",
        "wait p99 ms by minute",
        "claims",
        "claim index at end",
        "dead tuples at end",
    ]);
    let phases: &[bool] = match opts.value("only") {
        Some("clean") => &[false],
        Some("held") => &[true],
        Some(other) => panic!("--only {other}: expected clean or held"),
        None => &[false, true],
    };
    let mut footprint = Table::new(&[
        "phase",
        "jobs processed",
        "table MB",
        "indexes MB",
        "live tuples",
        "dead tuples",
        "autovacuums",
        "per 1M jobs: table + indexes MB",
        "per 1M jobs: dead tuples",
    ]);
    for &hold in phases {
        let phase = if hold { "snapshot held" } else { "clean" };
        progress(format!(
            "{phase}: {} jobs/s for {secs} s",
            thousands(per_sec as i64)
        ));
        db.reset().await;
        let (row, sizes) = run_phase(&db, phase, hold, per_sec, Duration::from_secs(secs)).await;
        table.row(row);
        footprint.row(sizes);
    }
    println!("### Steady producer into one worker (default settings)");
    println!();
    table.print();
    println!("### Footprint at the end of each phase, and per 1,000,000 jobs processed");
    println!();
    footprint.print();
    println!(
        "Targets (issue 13): with a snapshot held, the worker keeps up and claim p99 stays \
         within 2x of the clean run's (here: the pickup wait, which contains the claim)."
    );
    println!();
    db.drop_database().await;
}

/// One phase: worker and producer for `length`, then the numbers of its jobs.
async fn run_phase(
    db: &BenchDb,
    phase: &str,
    hold: bool,
    per_sec: f64,
    length: Duration,
) -> (Vec<String>, Vec<String>) {
    let held = if hold {
        Some(support::hold_snapshot(db).await)
    } else {
        None
    };
    let mut worker = WorkerThread::spawn(db, |pool| {
        Worker::builder(pool)
            .register::<Noop>()
            .build()
            .expect("worker")
    });
    let running = Arc::new(AtomicBool::new(true));
    let inserted = Arc::new(AtomicI64::new(0));
    let producer_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .expect("producer pool");
    let producer = tokio::spawn(support::insert_noop_at_rate(
        producer_pool.clone(),
        per_sec,
        running.clone(),
        inserted.clone(),
    ));
    let started = Instant::now();
    while started.elapsed() < length {
        tokio::time::sleep(Duration::from_secs(10)).await;
        let queued = db
            .scalar_i64("SELECT count(*) FROM skiplock.jobs WHERE state = 'queued'")
            .await;
        progress(format!(
            "  {:.0} s: {} inserted, {queued} queued",
            started.elapsed().as_secs_f64(),
            thousands(inserted.load(Ordering::Relaxed))
        ));
    }
    running.store(false, Ordering::Relaxed);
    let _ = producer.await;
    let elapsed = started.elapsed().as_secs_f64();
    let queued_at_end = db
        .scalar_i64("SELECT count(*) FROM skiplock.jobs WHERE state = 'queued'")
        .await;
    let index_bytes = db
        .scalar_i64("SELECT pg_relation_size('skiplock.jobs_claim_idx')")
        .await;
    let (table_bytes, index_bytes_all, live, dead, autovacuums): (i64, i64, i64, i64, i64) =
        sqlx::query_as(
            // Summed over the tables of skiplock.jobs (its live partition and the days of
            // finished jobs): the partitioned parent itself stores nothing.
            "SELECT sum(pg_table_size(p.relid))::bigint, sum(pg_indexes_size(p.relid))::bigint,
                    sum(s.n_live_tup)::bigint, sum(s.n_dead_tup)::bigint,
                    sum(s.autovacuum_count)::bigint
             FROM pg_partition_tree('skiplock.jobs') p
             JOIN pg_stat_user_tables s ON s.relid = p.relid
             WHERE p.isleaf",
        )
        .fetch_one(&db.pool)
        .await
        .expect("footprint");
    worker.stop().await;
    db.wait_workers_gone().await;
    if let Some(held) = held {
        support::end_snapshot(held).await;
    }
    producer_pool.close().await;

    let (p50, p99, max, drained, claims): (f64, f64, f64, i64, i64) = sqlx::query_as(
        "SELECT coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), 0),
                coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), 0),
                coalesce(max(ms), 0), count(*), count(DISTINCT claimed_at)
         FROM (SELECT extract(epoch FROM claimed_at - created_at)::float8 * 1000 AS ms,
                      claimed_at
               FROM skiplock.jobs WHERE claimed_at IS NOT NULL) w",
    )
    .fetch_one(&db.pool)
    .await
    .expect("waits");
    let by_minute: Vec<f64> = sqlx::query_scalar(
        "SELECT percentile_cont(0.99) WITHIN GROUP (
                    ORDER BY extract(epoch FROM claimed_at - created_at)::float8 * 1000)
         FROM skiplock.jobs WHERE claimed_at IS NOT NULL
         GROUP BY date_trunc('minute', created_at) ORDER BY date_trunc('minute', created_at)",
    )
    .fetch_all(&db.pool)
    .await
    .expect("waits by minute");
    let inserted = inserted.load(Ordering::Relaxed);
    let per_million = |n: f64| n * 1e6 / (drained.max(1) as f64);
    let sizes = vec![
        phase.to_owned(),
        thousands(drained),
        format!("{:.1}", table_bytes as f64 / 1e6),
        format!("{:.1}", index_bytes_all as f64 / 1e6),
        thousands(live),
        thousands(dead),
        autovacuums.to_string(),
        format!(
            "{:.0}",
            per_million((table_bytes + index_bytes_all) as f64) / 1e6
        ),
        thousands(per_million(dead as f64) as i64),
    ];
    let row = vec![
        phase.to_owned(),
        format!("{elapsed:.0}"),
        rate(inserted as f64 / elapsed),
        rate(drained as f64 / elapsed),
        thousands(queued_at_end),
        format!("{p50:.1}"),
        format!("{p99:.1}"),
        format!("{max:.1}"),
        by_minute
            .iter()
            .map(|ms| format!("{ms:.0}"))
            .collect::<Vec<_>>()
            .join(" "),
        thousands(claims),
        format!("{:.1} MB", index_bytes as f64 / 1e6),
        thousands(dead),
    ];
    (row, sizes)
}
