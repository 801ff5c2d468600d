//! PgBouncer in transaction-pooling mode in front of a worker or a command that was not
//! told (no `--pgbouncer`, no `WorkerBuilder::pgbouncer(true)`): skiplock finds it (it
//! refuses the startup options Postgres takes) and runs in PgBouncer mode, saying once how
//! to make it explicit. Without that, the worker flailed with "prepared statement sqlx_s_N
//! does not exist / already exists" and never said why.
//!
//! The distribution's PgBouncer (1.18 on Debian 12), a server pool (3 connections) far
//! smaller than the clients, so that server connections pass from client to client.

mod common;
#[allow(dead_code)] // the defect rule is for the model tests
#[path = "model_support/logs.rs"]
mod logs;
#[path = "common/pgbouncer.rs"]
mod pgbouncer;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use skiplock::{EnqueueOptions, Job, JobContext, JobError, NewJob, Worker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use common::{TestDb, test_db};
use pgbouncer::PgBouncer;

/// Server connections PgBouncer keeps per database and user: far fewer than the clients.
const SERVER_POOL_SIZE: u32 = 3;

/// How long a drain through PgBouncer may take before the test calls it stuck (a flailing
/// worker never finishes).
const DRAIN_LIMIT: Duration = Duration::from_secs(120);

/// PgBouncer in front of `db`'s server; `None` (after [`common::missing_tool`]) when it is
/// not installed.
async fn bouncer(db: &TestDb) -> Option<(PgBouncer, PgConnectOptions)> {
    if !PgBouncer::installed() {
        common::missing_tool(
            "the PgBouncer detection test",
            "pgbouncer",
            "apt-get install pgbouncer (.ci/run does)",
        );
        return None;
    }
    let direct: PgConnectOptions = db.url().parse().expect("test database URL");
    let pgbouncer = PgBouncer::start(&direct, SERVER_POOL_SIZE).await;
    let options = pgbouncer.options(&direct);
    Some((pgbouncer, options))
}

/// Counts its runs per job id.
#[derive(Serialize, Deserialize)]
struct Counted {}

type Runs = Arc<Mutex<HashMap<i64, u32>>>;

impl Job for Counted {
    const KIND: &'static str = "counted";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let runs = ctx.data::<Runs>().expect("runs map");
        *runs.lock().unwrap().entry(ctx.id().0).or_default() += 1;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_not_told_of_pgbouncer_finds_it_and_drains() {
    logs::install();
    let db = test_db().await;
    let Some((_pgbouncer, through)) = bouncer(&db).await else {
        return;
    };
    const JOBS: usize = 2000;
    let jobs: Vec<NewJob> = (0..JOBS)
        .map(|_| NewJob::from_job(&Counted {}, EnqueueOptions::new()).unwrap())
        .collect();
    let ids: Vec<i64> = skiplock::enqueue_raw(&db.pool, &jobs)
        .await
        .expect("enqueue")
        .into_iter()
        .map(|job| job.id.0)
        .collect();
    let _ = logs::take();

    // The application's pool through PgBouncer, and no word about it to the worker.
    let pool = PgPoolOptions::new()
        .max_connections(20)
        .connect_lazy_with(through);
    let runs: Runs = Arc::default();
    let worker = Worker::builder(pool)
        .register::<Counted>()
        .concurrency(32)
        .heartbeat(Duration::from_millis(50), Duration::from_secs(30))
        .poll_interval(Duration::from_millis(100))
        .data(runs.clone())
        .exit_when_idle(true)
        .build()
        .unwrap();
    let summary = tokio::time::timeout(DRAIN_LIMIT, worker.run())
        .await
        .unwrap_or_else(|_| panic!("no drain within {DRAIN_LIMIT:?}: {:#?}", logs::take()))
        .expect("the worker runs through PgBouncer");

    assert_eq!(summary.succeeded as usize, JOBS, "{summary:?}");
    let runs = runs.lock().unwrap().clone();
    for id in &ids {
        assert_eq!(
            runs.get(id),
            Some(&1),
            "job {id} ran {:?} times",
            runs.get(id)
        );
    }
    let lines = logs::take();
    let told: Vec<&String> = lines
        .iter()
        .filter(|line| line.contains("--pgbouncer"))
        .collect();
    assert_eq!(told.len(), 1, "one line naming --pgbouncer: {lines:#?}");
    assert!(
        told[0].contains("connection pooler") && told[0].contains("PgBouncer mode"),
        "{}",
        told[0]
    );
    assert_eq!(lines.len(), 1, "nothing else logged: {lines:#?}");
}

/// The binary's commands, through PgBouncer with no `--pgbouncer`: `enqueue` and `work
/// --exit-when-idle` succeed, each saying once that it found a pooler and how to say so.
#[cfg(feature = "cli")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_not_told_of_pgbouncer_finds_it() {
    let db = test_db().await;
    let Some((pgbouncer, _)) = bouncer(&db).await else {
        return;
    };
    let direct: PgConnectOptions = db.url().parse().unwrap();
    let url = format!(
        "postgres://{}@127.0.0.1:{}/{}",
        direct.get_username(),
        pgbouncer.port,
        db.name
    );
    for args in [
        &["enqueue", "noop"][..],
        &["enqueue", "noop", "--ordering-key", "k"],
        &["work", "--exit-when-idle", "--concurrency", "8"],
    ] {
        let out = common::skiplock_at(&url, args, "warn", &[]).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "skiplock {args:?}: {stderr}");
        assert_eq!(
            stderr.matches("--pgbouncer").count(),
            1,
            "skiplock {args:?} names --pgbouncer once: {stderr}"
        );
        assert!(
            !stderr.contains("prepared statement"),
            "skiplock {args:?}: {stderr}"
        );
    }
    let succeeded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state = 'succeeded'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(succeeded, 2);
}
