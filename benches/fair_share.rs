//! Fair-share benchmark (issue 13): one worker (default settings) serving queue `a`, which
//! holds a backlog of `noop` jobs, and queue `b`, which receives 20 probe jobs a second.
//!
//! - `b` alone: `a` is empty; `b`'s pickup latency (enqueue commit to handler start, both
//!   `Instant`s of this process, as in the latency bench);
//! - `a` alone: `a`'s drain rate over a fixed window with `b` quiet;
//! - both: the same backlog in `a` while `b` receives its probes: `b`'s pickup latency and
//!   `a`'s rate over the same window.
//!
//! The targets: `b`'s p99 with the flood stays within a few claim round trips of its p99
//! alone, and `a` keeps ≥ 90 % of its solo rate. The backlog is 1,500,000 jobs (800,000
//! with `--quick`) and the window 10 s (6 s), short enough that `a` never runs dry (the
//! bench fails if it does: `a`'s rate would then be capped by its backlog).
//!
//! `cargo bench --bench fair_share -- --quick` (or `SKIPLOCK_BENCH_QUICK=1`).

mod support;

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use skiplock::builtin::Noop;
use skiplock::{EnqueueOptions, Job, JobContext, JobError, Worker};
use support::{BenchDb, Opts, Table, WorkerThread, progress, quantile, rate, thousands};
use tokio::sync::mpsc;

/// Probes enqueued per second into queue `b`.
const PROBES_PER_SEC: u64 = 20;

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

/// One phase's numbers.
struct Phase {
    /// Probe pickup latencies in ms, sorted (empty when no probes ran).
    pickup: Vec<f64>,
    /// Probes that had not started when the phase ended.
    missing: usize,
    /// `a` jobs finished per second over the window.
    a_rate: f64,
}

#[tokio::main]
async fn main() {
    let opts = Opts::parse();
    let db = BenchDb::create("fair_share").await;
    support::print_header(
        "Fair share: a backlog in one queue, a trickle in another",
        &db,
        &opts,
    )
    .await;
    let (backlog, window) = if opts.quick {
        (800_000, Duration::from_secs(6))
    } else {
        (1_500_000, Duration::from_secs(10))
    };

    let b_alone = phase(&db, 0, window, true).await;
    let a_alone = phase(&db, backlog, window, false).await;
    let both = phase(&db, backlog, window, true).await;

    let mut table = Table::new(&[
        "phase",
        "a backlog",
        "a jobs/s",
        "b probes",
        "b p50 ms",
        "b p90 ms",
        "b p99 ms",
        "b max ms",
        "b not started",
    ]);
    for (name, n, p) in [
        ("b alone", 0, &b_alone),
        ("a alone", backlog, &a_alone),
        ("a flood + b", backlog, &both),
    ] {
        let has_probes = !p.pickup.is_empty();
        let q = |x: f64| {
            if has_probes {
                format!("{:.2}", quantile(&p.pickup, x))
            } else {
                "–".to_owned()
            }
        };
        table.row(vec![
            name.to_owned(),
            thousands(n),
            if n > 0 {
                rate(p.a_rate)
            } else {
                "–".to_owned()
            },
            p.pickup.len().to_string(),
            q(0.5),
            q(0.9),
            q(0.99),
            q(1.0),
            p.missing.to_string(),
        ]);
    }
    table.print();
    println!(
        "a's rate with the trickle: {:.0} % of its solo rate (target ≥ 90 %). b's p99: {:.2} ms \
         with the flood, {:.2} ms alone. Window {:?}, {PROBES_PER_SEC} probes/s.",
        100.0 * both.a_rate / a_alone.a_rate,
        quantile(&both.pickup, 0.99),
        quantile(&b_alone.pickup, 0.99),
        window
    );
    println!();
    db.drop_database().await;
}

/// Runs one phase on a fresh table: `backlog` jobs in `a`, a worker serving `a` and `b`
/// for `window`, and probes into `b` when `probes` is set.
async fn phase(db: &BenchDb, backlog: i64, window: Duration, probes: bool) -> Phase {
    db.reset().await;
    if backlog > 0 {
        let mut done = 0;
        while done < backlog {
            let chunk = (backlog - done).min(100_000);
            db.exec(&format!(
                "INSERT INTO skiplock.jobs (kind, args, queue)
                 SELECT 'noop', '{{}}', 'a' FROM generate_series(1, {chunk})"
            ))
            .await;
            done += chunk;
        }
        db.exec("VACUUM ANALYZE skiplock.jobs").await;
        progress(format!(
            "  preloaded {} jobs into queue a",
            thousands(backlog)
        ));
    }
    progress(format!(
        "phase: a backlog {}, probes into b: {probes}",
        thousands(backlog)
    ));
    let (starts_tx, mut starts_rx) = mpsc::unbounded_channel();
    let mut worker = WorkerThread::spawn(db, move |pool| {
        Worker::builder(pool)
            .register::<Noop>()
            .register::<Probe>()
            .data(Starts(starts_tx))
            .queues(["a", "b"])
            .build()
            .expect("worker")
    });
    let client = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .expect("client pool");
    // Warm up: the listener is connected and the statements are prepared.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let done_before = a_done(db).await;
    let t0 = Instant::now();
    let mut committed_at = std::collections::HashMap::new();
    let mut pickup = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / PROBES_PER_SEC));
    while t0.elapsed() < window {
        tick.tick().await;
        if probes {
            let id = skiplock::enqueue(&client, &Probe {}, EnqueueOptions::new().queue("b"))
                .await
                .expect("enqueue")
                .id
                .0;
            committed_at.insert(id, Instant::now());
        }
        while let Ok((id, started)) = starts_rx.try_recv() {
            if let Some(committed) = committed_at.remove(&id) {
                pickup.push(signed_ms(committed, started));
            }
        }
    }
    let a_rate = (a_done(db).await - done_before) as f64 / t0.elapsed().as_secs_f64();
    if backlog > 0 {
        let left = db
            .scalar_i64("SELECT count(*) FROM skiplock.jobs WHERE queue = 'a' AND state = 'queued'")
            .await;
        assert!(
            left > 0,
            "queue a ran dry inside the window: its rate is capped by the backlog; \
             use a shorter window or a larger backlog"
        );
    }
    // Probes still on their way get a second to start.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    while !committed_at.is_empty() {
        match tokio::time::timeout_at(deadline, starts_rx.recv()).await {
            Ok(Some((id, started))) => {
                if let Some(committed) = committed_at.remove(&id) {
                    pickup.push(signed_ms(committed, started));
                }
            }
            Ok(None) | Err(_) => break,
        }
    }
    let summary = worker.stop().await;
    progress(format!("  worker stopped: {summary:?}"));
    client.close().await;
    db.wait_workers_gone().await;
    pickup.sort_by(f64::total_cmp);
    let phase = Phase {
        missing: committed_at.len(),
        pickup,
        a_rate,
    };
    if probes {
        progress(format!(
            "  b: p50 {:.2} ms, p99 {:.2} ms, {} not started",
            quantile(&phase.pickup, 0.5),
            quantile(&phase.pickup, 0.99),
            phase.missing
        ));
    }
    if backlog > 0 {
        progress(format!("  a: {}", rate(phase.a_rate)));
    }
    phase
}

/// Jobs of queue `a` finished so far.
async fn a_done(db: &BenchDb) -> i64 {
    db.scalar_i64("SELECT count(*) FROM skiplock.jobs WHERE queue = 'a' AND state = 'succeeded'")
        .await
}

/// `later - earlier` in milliseconds, negative if `later` came first.
fn signed_ms(earlier: Instant, later: Instant) -> f64 {
    match later.checked_duration_since(earlier) {
        Some(d) => d.as_secs_f64() * 1000.0,
        None => -(earlier.duration_since(later).as_secs_f64() * 1000.0),
    }
}
