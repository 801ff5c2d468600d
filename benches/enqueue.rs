//! Enqueue benchmark: jobs per second into `skiplock.jobs`.
//!
//! - `enqueue` of one job per transaction (autocommit), from 1 and from 16 clients, with and
//!   without the insert trigger's `pg_notify` (which takes a database-wide lock until the
//!   commit is flushed);
//! - 100 `enqueue` calls per explicit transaction;
//! - `enqueue_many` in batches of 1,000 and 10,000 (one statement and one commit each), from
//!   1 client and from 4;
//! - the statement alone (`jobs_insert_many` with a prebuilt batch), without the trigger,
//!   plain SQL `INSERT … SELECT generate_series` and `COPY` for reference.
//!
//! Rates are client-side (first call to last return). Commits per job come from
//! `pg_stat_database` of the bench's own database, WAL bytes per job from
//! `pg_current_wal_lsn()` (server-wide, so other databases' writes count too).
//!
//! `cargo bench --bench enqueue -- --quick` (or `SKIPLOCK_BENCH_QUICK=1`).

mod support;

use std::future::Future;
use std::time::Instant;

use skiplock::EnqueueOptions;
use skiplock::builtin::Noop;
use skiplock::db::enqueue::{InsertBatch, jobs_insert_many};
use sqlx::PgPool;
use sqlx::types::Json;
use support::{BenchDb, Opts, Table, progress, rate, thousands};

#[tokio::main]
async fn main() {
    let opts = Opts::parse();
    let db = BenchDb::create("enqueue").await;
    support::print_header("Enqueue", &db, &opts).await;
    let single: usize = if opts.quick { 2_000 } else { 5_000 };
    let single_16: usize = if opts.quick { 8_000 } else { 32_000 };
    let bulk: usize = if opts.quick { 100_000 } else { 300_000 };

    let mut table = Table::new(&[
        "mode",
        "clients",
        "jobs",
        "secs",
        "jobs/s",
        "commits/job",
        "WAL B/job",
    ]);

    measure(
        &db,
        &mut table,
        "enqueue, 1 job/transaction",
        1,
        single,
        |pool, _, n| async move {
            for _ in 0..n {
                skiplock::enqueue(&pool, &Noop {}, EnqueueOptions::default())
                    .await
                    .expect("enqueue");
            }
        },
    )
    .await;
    measure(
        &db,
        &mut table,
        "enqueue, 1 job/transaction",
        16,
        single_16,
        |pool, _, n| async move {
            for _ in 0..n {
                skiplock::enqueue(&pool, &Noop {}, EnqueueOptions::default())
                    .await
                    .expect("enqueue");
            }
        },
    )
    .await;
    db.exec("ALTER TABLE skiplock.jobs DISABLE TRIGGER jobs_notify_inserted")
        .await;
    measure(
        &db,
        &mut table,
        "enqueue, 1 job/transaction, insert trigger off",
        16,
        single_16,
        |pool, _, n| async move {
            for _ in 0..n {
                skiplock::enqueue(&pool, &Noop {}, EnqueueOptions::default())
                    .await
                    .expect("enqueue");
            }
        },
    )
    .await;
    db.exec("ALTER TABLE skiplock.jobs ENABLE TRIGGER jobs_notify_inserted")
        .await;
    measure(
        &db,
        &mut table,
        "enqueue, 100 jobs/transaction",
        1,
        single * 5,
        |pool, _, n| async move {
            for _ in 0..n / 100 {
                let mut tx = pool.begin().await.expect("begin");
                for _ in 0..100 {
                    skiplock::enqueue(&mut *tx, &Noop {}, EnqueueOptions::default())
                        .await
                        .expect("enqueue");
                }
                tx.commit().await.expect("commit");
            }
        },
    )
    .await;
    for batch in [1_000usize, 10_000] {
        measure(
            &db,
            &mut table,
            &format!("enqueue_many, batches of {}", thousands(batch as i64)),
            1,
            bulk,
            move |pool, _, n| async move { enqueue_batches(&pool, n, batch).await },
        )
        .await;
    }
    measure(
        &db,
        &mut table,
        "enqueue_many, batches of 1,000",
        4,
        bulk,
        |pool, _, n| async move { enqueue_batches(&pool, n, 1_000).await },
    )
    .await;
    measure(
        &db,
        &mut table,
        "jobs_insert_many (statement only, prebuilt), 10,000",
        1,
        bulk,
        |pool, _, n| async move {
            let batch = insert_batch(10_000);
            for _ in 0..n / 10_000 {
                jobs_insert_many(&pool, &batch).await.expect("insert");
            }
        },
    )
    .await;
    db.exec("ALTER TABLE skiplock.jobs DISABLE TRIGGER jobs_notify_inserted")
        .await;
    measure(
        &db,
        &mut table,
        "enqueue_many, batches of 10,000, insert trigger off",
        1,
        bulk,
        |pool, _, n| async move { enqueue_batches(&pool, n, 10_000).await },
    )
    .await;
    db.exec("ALTER TABLE skiplock.jobs ENABLE TRIGGER jobs_notify_inserted")
        .await;
    measure(
        &db,
        &mut table,
        "SQL INSERT … SELECT generate_series, 10,000",
        1,
        bulk,
        |pool, _, n| async move {
            for _ in 0..n / 10_000 {
                sqlx::query(
                    "INSERT INTO skiplock.jobs (kind, args)
                     SELECT 'noop', '{}' FROM generate_series(1, 10000)",
                )
                .execute(&pool)
                .await
                .expect("insert");
            }
        },
    )
    .await;
    measure(
        &db,
        &mut table,
        "SQL COPY, 10,000 rows",
        1,
        bulk,
        |pool, _, n| async move {
            let rows = "noop\t{}\n".repeat(10_000);
            for _ in 0..n / 10_000 {
                let mut conn = pool.acquire().await.expect("acquire");
                let mut copy = conn
                    .copy_in_raw("COPY skiplock.jobs (kind, args) FROM STDIN")
                    .await
                    .expect("copy");
                copy.send(rows.as_bytes()).await.expect("copy send");
                copy.finish().await.expect("copy finish");
            }
        },
    )
    .await;

    println!("### Enqueue rates (client-side, first call to last return)");
    println!();
    table.print();
    println!(
        "Target (issue 6): batch enqueue through the API ≥ 150,000 jobs/s (see the enqueue_many rows)."
    );
    println!();
    db.drop_database().await;
}

/// Runs `body(pool, client, jobs_per_client)` on `clients` tasks at once against an empty
/// table, and adds a row with the rate, commits and WAL per job.
async fn measure<F, Fut>(
    db: &BenchDb,
    table: &mut Table,
    mode: &str,
    clients: usize,
    jobs: usize,
    body: F,
) where
    F: Fn(PgPool, usize, usize) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    progress(format!("{mode}: {jobs} jobs from {clients} client(s)"));
    db.reset().await;
    let pool = db.worker_pool(clients as u32).await;
    // Open every connection before the clock starts.
    let mut warm = Vec::new();
    for _ in 0..clients {
        warm.push(pool.acquire().await.expect("acquire"));
    }
    drop(warm);
    let before = db.counters().await;
    let per_client = jobs / clients;
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|client| tokio::spawn(body(pool.clone(), client, per_client)))
        .collect();
    for task in tasks {
        task.await.expect("client task");
    }
    let secs = t0.elapsed().as_secs_f64();
    pool.close().await;
    db.wait_workers_gone().await;
    let after = db.counters().await;
    let wal = db.wal_between(&before, &after).await;
    let inserted = db.scalar_i64("SELECT count(*) FROM skiplock.jobs").await;
    let per_job = |x: i64| x as f64 / inserted.max(1) as f64;
    progress(format!(
        "  {} jobs in {secs:.2} s = {}; {:.3} commits/job, {:.0} WAL B/job",
        thousands(inserted),
        rate(inserted as f64 / secs),
        per_job(after.commits - before.commits),
        per_job(wal)
    ));
    table.row(vec![
        mode.to_owned(),
        clients.to_string(),
        thousands(inserted),
        format!("{secs:.2}"),
        rate(inserted as f64 / secs),
        format!("{:.3}", per_job(after.commits - before.commits)),
        format!("{:.0}", per_job(wal)),
    ]);
}

/// `n` noop jobs through `enqueue_many` in batches of `batch`.
async fn enqueue_batches(pool: &PgPool, n: usize, batch: usize) {
    let jobs = vec![Noop {}; batch];
    for _ in 0..n / batch {
        skiplock::enqueue_many(pool, &jobs, EnqueueOptions::default())
            .await
            .expect("enqueue_many");
    }
}

/// A prebuilt column-wise batch of `n` noop jobs, as `enqueue_many` would build it.
fn insert_batch(n: usize) -> InsertBatch {
    let mut batch = InsertBatch::default();
    for _ in 0..n {
        batch.kinds.push("noop".to_owned());
        batch.args.push(Json(serde_json::json!({})));
        batch.queues.push("default".to_owned());
        batch.priorities.push(0);
        batch.run_at.push(None);
        batch.delays_ms.push(0);
        batch.max_attempts.push(25);
        batch.ordering_keys.push(None);
        batch.unique_keys.push(None);
        batch.unique_policies.push("skip");
        batch.depends_on.push(Json(Vec::new()));
    }
    batch
}
