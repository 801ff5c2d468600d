//! Drain benchmark for apalis 1.0.0 with its Postgres storage (apalis-postgres 1.0.0), for a
//! side-by-side number against skiplock's `benches/drain.rs` on the same server and machine.
//!
//! Run (from this directory; PostgreSQL at 127.0.0.1:5432, user postgres, trust auth):
//!
//!     CARGO_TARGET_DIR=/tmp/peer-target cargo run --release [-- JOBS CONCURRENCY [CONFIGS]]
//!
//! CONFIGS is a comma-separated list of configuration numbers (1-based, see below) to run;
//! all of them by default.
//!
//! `DATABASE_URL` overrides the server (default `postgres://postgres@127.0.0.1:5432/postgres`).
//! Defaults: 200,000 jobs, concurrency 32.
//!
//! Each configuration gets a fresh database `skiplock_peer_apalis_<pid>`:
//! `PostgresStorage::setup` (the crate's migrations), then the jobs are preloaded through the
//! crate's bulk insert `apalis_postgres::queries::push_tasks` (one UNNEST insert per 10,000
//! tasks), then `VACUUM ANALYZE apalis.jobs`. One worker in this process (`WorkerBuilder` with
//! `.concurrency(N)`, a handler that does nothing and returns `Ok(())`) drains the queue.
//!
//! apalis keeps finished jobs (status becomes `Done`), so completion is detected like this: the
//! handler bumps an in-process counter, which is checked every 20 ms; once it reaches the job
//! count, `SELECT count(*) ... WHERE status <> 'Done'` is polled every 20 ms until it is zero
//! (so results that the worker flushes asynchronously are counted as done only once they are in
//! the database). The rate is jobs / (time from starting the worker to that point). Polling the
//! 200,000-row table with SQL every 20 ms from the start would itself load the server, which is
//! why the cheap in-process counter is used first. Runs are capped at 180 s; a capped run
//! reports the jobs marked `Done` in the database divided by the elapsed time.
//!
//! Configurations: 1. the crate defaults (`batch_size` 10); 2. and 3. `batch_size` 200 and 1000,
//! raised for throughput (the fetch-side throughput knob `apalis_postgres::Config` documents).
//!
//! Note: each fetch calls the SQL function `apalis.get_jobs`; on PostgreSQL 15 its UPDATE ... FROM
//! (claimed ids) is planned without the LIMIT value and hash-joins the claimed ids against a
//! sequential scan of the whole `apalis.jobs` table, so every fetch costs time proportional to
//! the table size (about 60 ms at 200,000 rows here). A larger `batch_size` amortizes that.
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use apalis::prelude::*;
use apalis_postgres::{Config, PgPool, PostgresStorage};

const CAP: Duration = Duration::from_secs(180);
const QUEUE: &str = "noop";

#[derive(Clone)]
struct Counter(Arc<AtomicUsize>);

async fn noop(_job: u32, counter: Data<Counter>) -> Result<(), BoxDynError> {
    counter.0.0.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

fn with_db(base: &str, db: &str) -> String {
    // Replace the path component (database name) of the URL.
    let (head, tail) = match base.find('?') {
        Some(i) => (&base[..i], &base[i..]),
        None => (base, ""),
    };
    let slash = head.rfind('/').expect("DATABASE_URL without a path");
    format!("{}/{}{}", &head[..slash], db, tail)
}

async fn drain(base: &str, jobs: usize, concurrency: usize, label: &str, config: Config) {
    let admin = PgPool::connect(base).await.expect("connect admin");
    let db = format!("skiplock_peer_apalis_{}", std::process::id());
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db}"))).execute(&admin).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}"))).execute(&admin).await.unwrap();
    let url = with_db(base, &db);
    {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(40)
            .connect(&url)
            .await
            .expect("connect bench db");
        PostgresStorage::setup(&pool).await.expect("apalis migrations");

        // Preload through the crate's bulk insert.
        let mut added = 0usize;
        while added < jobs {
            let n = (jobs - added).min(10_000);
            let tasks: Vec<_> = (added..added + n)
                .map(|i| TaskBuilder::new(serde_json::to_vec(&(i as u32)).unwrap()).build())
                .collect();
            let mut tx = pool.begin().await.unwrap();
            apalis_postgres::queries::push_tasks(&mut *tx, QUEUE, tasks)
                .await
                .expect("push_tasks");
            tx.commit().await.unwrap();
            added += n;
        }
        sqlx::query("VACUUM ANALYZE apalis.jobs").execute(&pool).await.unwrap();
        // push_tasks stores run_at with whole-second precision and get_jobs wants run_at < now().
        tokio::time::sleep(Duration::from_millis(1100)).await;

        let counter = Counter(Arc::new(AtomicUsize::new(0)));
        let storage: PostgresStorage<u32> =
            PostgresStorage::new(&pool).with_config(config.queue(QUEUE));
        let worker = WorkerBuilder::new("skiplock-peer-bench")
            .backend(storage)
            .data(counter.clone())
            .concurrency(concurrency)
            .build(noop);

        let start = Instant::now();
        let handle = tokio::spawn(async move { worker.run().await });

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
        let mut done: i64;
        loop {
            let (d, not_done): (i64, i64) = sqlx::query_as(
                "SELECT count(*) FILTER (WHERE status = 'Done'), count(*) FILTER (WHERE status <> 'Done') FROM apalis.jobs",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            elapsed = start.elapsed();
            done = d;
            if not_done == 0 || capped || elapsed > CAP {
                capped |= not_done != 0;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        handle.abort();
        let _ = handle.await;

        let secs = elapsed.as_secs_f64();
        let rate = done as f64 / secs;
        let statuses: Vec<(String, i64)> =
            sqlx::query_as("SELECT status, count(*) FROM apalis.jobs GROUP BY 1 ORDER BY 1")
                .fetch_all(&pool)
                .await
                .unwrap();
        eprintln!(
            "{label}: {done}/{jobs} Done in DB, handler ran {} times, statuses {statuses:?}{}",
            counter.0.load(Ordering::Relaxed),
            if capped { " (CAPPED at 180 s)" } else { "" }
        );
        println!(
            "| apalis 1.0.0 + apalis-postgres 1.0.0, {label}{} | {concurrency} | {jobs} | {secs:.2} | {rate:.0} |",
            if capped { " (capped at 180 s, rate over finished jobs)" } else { "" }
        );
        pool.close().await;
    }
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

    println!("| peer, configuration | concurrency | jobs | seconds | jobs/s |");
    println!("|---|---|---|---|---|");
    let selected: Vec<usize> = args
        .next()
        .map(|s| s.split(',').map(|n| n.trim().parse().unwrap()).collect())
        .unwrap_or_else(|| vec![1, 2, 3]);
    let configs = [
        ("defaults (batch_size 10)", Config::default()),
        ("batch_size 200", Config::default().batch_size(200)),
        ("batch_size 1000", Config::default().batch_size(1000)),
    ];
    for (i, (label, config)) in configs.into_iter().enumerate() {
        if selected.contains(&(i + 1)) {
            drain(&base, jobs, concurrency, label, config).await;
        }
    }
}
