//! Drain benchmark for graphile_worker 0.14.1 (the Rust port of graphile-worker), for a
//! side-by-side number against skiplock's `benches/drain.rs` on the same server and machine.
//!
//! Run (from this directory; PostgreSQL at 127.0.0.1:5432, user postgres, trust auth):
//!
//!     CARGO_TARGET_DIR=/tmp/peer-target cargo run --release [-- JOBS CONCURRENCY]
//!
//! `DATABASE_URL` overrides the server (default `postgres://postgres@127.0.0.1:5432/postgres`).
//! Defaults: 200,000 jobs, concurrency 32.
//!
//! Each configuration gets a fresh database `skiplock_peer_gwrs_<pid>`. `WorkerOptions::init`
//! runs the crate's migrations and registers the task; the jobs are then preloaded with the
//! crate's batch insert `WorkerUtils::add_jobs` (10,000 jobs per call, one SQL statement each),
//! followed by `VACUUM ANALYZE graphile_worker._private_jobs`. Then the worker (one `Worker`,
//! `.concurrency(N)`, a handler that does nothing and returns `Ok`) is started in this process.
//!
//! graphile_worker deletes a job when it completes. The handler bumps an in-process counter,
//! checked every 20 ms; once it reaches the job count, `SELECT count(*)` on the jobs table is
//! polled every 20 ms until it is zero (so completions the worker batches are counted only once
//! they are in the database). The rate is jobs / (time from starting the worker to that point).
//! Runs are capped at 180 s; a capped run reports (jobs - rows left) / elapsed. Over the same
//! window it reports the CPU time of the local Postgres server and of this process per job
//! (read from `/proc` by skiplock's own bench code, so the columns match `benches/drain.rs`)
//! and the WAL the server wrote per job (`pg_current_wal_lsn()`, server-wide, as there).
//!
//! Configurations: the crate defaults (direct fetch, one job per query, completions one by one),
//! and the throughput settings the crate documents ("Local queue" guide and "Completion and
//! failure batching" in the worker options guide): a local queue of 500 jobs and a 5 ms
//! completion batch delay.
#[path = "../../../support/cpu.rs"]
mod cpu;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use graphile_worker::{
    IntoTaskHandlerResult, JobSpec, LocalQueueConfig, TaskHandler, WorkerContext, WorkerOptions,
};
use serde::{Deserialize, Serialize};

const CAP: Duration = Duration::from_secs(180);

#[derive(Clone, Debug)]
struct Counter(Arc<AtomicUsize>);

#[derive(Clone, Serialize, Deserialize)]
struct Noop {}

impl TaskHandler for Noop {
    const IDENTIFIER: &'static str = "noop";

    async fn run(self, ctx: WorkerContext) -> impl IntoTaskHandlerResult {
        if let Some(c) = ctx.get_ext::<Counter>() {
            c.0.fetch_add(1, Ordering::Relaxed);
        }
        Ok::<(), String>(())
    }
}

fn with_db(base: &str, db: &str) -> String {
    let (head, tail) = match base.find('?') {
        Some(i) => (&base[..i], &base[i..]),
        None => (base, ""),
    };
    let slash = head.rfind('/').expect("DATABASE_URL without a path");
    format!("{}/{}{}", &head[..slash], db, tail)
}

async fn drain(
    base: &str,
    jobs: usize,
    concurrency: usize,
    label: &str,
    tune: impl FnOnce(WorkerOptions) -> WorkerOptions,
) {
    let admin = sqlx::PgPool::connect(base).await.expect("connect admin");
    let db = format!("skiplock_peer_gwrs_{}", std::process::id());
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db}"))).execute(&admin).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}"))).execute(&admin).await.unwrap();
    let url = with_db(base, &db);
    {
        let counter = Counter(Arc::new(AtomicUsize::new(0)));
        let options = WorkerOptions::default()
            .database_url(&url)
            .concurrency(concurrency)
            .schema("graphile_worker")
            .listen_os_shutdown_signals(false)
            .add_extension(counter.clone())
            .define_job::<Noop>();
        let worker = Arc::new(tune(options).init().await.expect("init worker"));

        let utils = worker.create_utils();
        let spec = JobSpec::default();
        let mut added = 0usize;
        while added < jobs {
            let n = (jobs - added).min(10_000);
            let batch: Vec<(Noop, &JobSpec)> = (0..n).map(|_| (Noop {}, &spec)).collect();
            utils.add_jobs::<Noop>(&batch).await.expect("add_jobs");
            added += n;
        }

        let pool = sqlx::PgPool::connect(&url).await.expect("connect bench db");
        sqlx::query("VACUUM ANALYZE graphile_worker._private_jobs")
            .execute(&pool)
            .await
            .unwrap();
        let (loaded,): (i64,) = sqlx::query_as("SELECT count(*) FROM graphile_worker._private_jobs")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(loaded as usize, jobs, "preload count");

        let cpu_start = (cpu::postgres_cpu_secs(), cpu::process_cpu_secs("self").unwrap_or(0.0));
        let wal_start: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&pool)
            .await
            .unwrap();
        let start = Instant::now();
        let runner = Arc::clone(&worker);
        let handle = tokio::spawn(async move { runner.run().await });

        let mut capped = false;
        loop {
            if counter.0.load(Ordering::Relaxed) >= jobs {
                break;
            }
            if start.elapsed() > CAP {
                capped = true;
                break;
            }
            if handle.is_finished() {
                panic!("worker exited early: {:?}", handle.await);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut elapsed;
        let mut left: i64;
        loop {
            let (l,): (i64,) = sqlx::query_as("SELECT count(*) FROM graphile_worker._private_jobs")
                .fetch_one(&pool)
                .await
                .unwrap();
            elapsed = start.elapsed();
            left = l;
            if left == 0 || capped || elapsed > CAP {
                capped |= left != 0;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let pg_cpu = cpu::postgres_cpu_secs() - cpu_start.0;
        let own_cpu = cpu::process_cpu_secs("self").unwrap_or(0.0) - cpu_start.1;
        // Server-wide, as benches/drain.rs measures it: other databases' writes count too.
        let wal_bytes: f64 = sqlx::query_scalar(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::float8",
        )
        .bind(&wal_start)
        .fetch_one(&pool)
        .await
        .unwrap();
        worker.request_shutdown();
        if tokio::time::timeout(Duration::from_secs(20), handle).await.is_err() {
            eprintln!("worker did not shut down within 20 s");
        }

        let done = jobs as i64 - left;
        let secs = elapsed.as_secs_f64();
        let rate = done as f64 / secs;
        eprintln!(
            "{label}: {done}/{jobs} deleted from the jobs table, handler ran {} times{}",
            counter.0.load(Ordering::Relaxed),
            if capped { " (CAPPED at 180 s)" } else { "" }
        );
        let per_job_us = |cpu: f64| cpu * 1e6 / done.max(1) as f64;
        println!(
            "| graphile_worker 0.14.1 (Rust), {label}{} | {concurrency} | {jobs} | {secs:.2} | {rate:.0} | {:.1} | {:.1} | {:.0} |",
            if capped { " (capped at 180 s, rate over finished jobs)" } else { "" },
            per_job_us(pg_cpu),
            per_job_us(own_cpu),
            wal_bytes / done.max(1) as f64,
        );
        pool.close().await;
    }
    // Give the pool the worker owned a moment to go away, then force the drop.
    tokio::time::sleep(Duration::from_millis(200)).await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
}

#[tokio::main]
async fn main() {
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let mut args = std::env::args().skip(1);
    let jobs: usize = args.next().map(|s| s.parse().unwrap()).unwrap_or(200_000);
    let concurrency: usize = args.next().map(|s| s.parse().unwrap()).unwrap_or(32);

    println!(
        "| peer, configuration | concurrency | jobs | seconds | jobs/s | PG CPU µs/job | peer CPU µs/job | WAL B/job |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    // PEER_TUNED_ONLY=1 skips the defaults (capped at 180 s) for side-by-side runs.
    if std::env::var_os("PEER_TUNED_ONLY").is_none() {
        drain(&base, jobs, concurrency, "defaults", |o| o).await;
    }
    drain(
        &base,
        jobs,
        concurrency,
        "local queue of 500, complete_job_batch_delay 5 ms",
        |o| {
            o.local_queue(LocalQueueConfig::default().with_size(500))
                .complete_job_batch_delay(Duration::from_millis(5))
        },
    )
    .await;
}
