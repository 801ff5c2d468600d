//! Tools of tests/failover.rs: private primary and standby clusters, a re-pointable TCP
//! proxy, a handler that counts its runs and can be held, and an audit of every change of
//! `skiplock.jobs` that replicates with the jobs themselves.

mod cluster;
mod proxy;

pub use cluster::{Cluster, bin_dir};
pub use proxy::Proxy;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use skiplock::{EnqueueOptions, Job, JobContext, JobError, NewJob, Worker};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::watch;
use uuid::Uuid;

use crate::common::job_triggers::{JobWrites, after_job_statements};

/// What the handler shares with the test: its runs per job id, and a gate it waits at.
#[derive(Clone)]
pub struct Runs {
    counts: Arc<Mutex<HashMap<i64, u32>>>,
    gate: watch::Sender<bool>,
    held: Arc<AtomicUsize>,
    work: Duration,
}

impl Runs {
    /// Runs that take `work` each, with the gate open.
    pub fn new(work: Duration) -> Runs {
        Runs {
            counts: Arc::default(),
            gate: watch::Sender::new(true),
            held: Arc::default(),
            work,
        }
    }

    /// Handlers that start from now on wait until [`open`](Runs::open).
    pub fn close(&self) {
        self.gate.send_replace(false);
    }

    /// Lets every waiting handler go on.
    pub fn open(&self) {
        self.gate.send_replace(true);
    }

    /// Handlers waiting at the closed gate.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// How many times each job's handler started.
    pub fn counts(&self) -> HashMap<i64, u32> {
        self.counts.lock().unwrap().clone()
    }
}

/// Counts its start, waits at the gate, works for a moment, succeeds.
#[derive(Serialize, Deserialize)]
pub struct Counted {}

impl Job for Counted {
    const KIND: &'static str = "counted";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let runs = ctx.data::<Runs>().expect("runs");
        *runs.counts.lock().unwrap().entry(ctx.id().0).or_default() += 1;
        let mut gate = runs.gate.subscribe();
        if !*gate.borrow_and_update() {
            runs.held.fetch_add(1, Ordering::SeqCst);
            let _ = gate.wait_for(|open| *open).await;
            runs.held.fetch_sub(1, Ordering::SeqCst);
        }
        tokio::time::sleep(runs.work).await;
        Ok(())
    }
}

/// A lazy pool of `max` connections on `url`, as an application would make.
pub fn pool(url: &str, max: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .connect_lazy(url)
        .expect("a valid URL")
}

/// Creates database `app` on `cluster`, migrates it, installs the audit, returns a pool.
pub async fn app_database(cluster: &Cluster) -> PgPool {
    let admin = pool(&cluster.url("postgres"), 1);
    sqlx::query("CREATE DATABASE app")
        .execute(&admin)
        .await
        .expect("create database");
    admin.close().await;
    let app = pool(&cluster.url("app"), 10);
    skiplock::migrate(&app).await.expect("migrate");
    install_audit(&app).await;
    app
}

/// Enqueues `jobs` `Counted` jobs in batches, every fourth in one of 40 lanes; their ids.
pub async fn enqueue(pool: &PgPool, jobs: usize) -> Vec<i64> {
    let batch: Vec<NewJob> = (0..jobs)
        .map(|n| {
            let mut options = EnqueueOptions::new();
            if n % 4 == 0 {
                options = options.ordering_key(format!("lane-{}", n % 40));
            }
            NewJob::from_job(&Counted {}, options).expect("job")
        })
        .collect();
    let mut ids = Vec::with_capacity(jobs);
    for chunk in batch.chunks(1000) {
        let enqueued = skiplock::enqueue_raw(pool, chunk).await.expect("enqueue");
        ids.extend(enqueued.into_iter().map(|job| job.id.0));
    }
    ids
}

/// A worker of `Counted` jobs on `pool`: 8 slots, polling every 100 ms, beating every
/// `heartbeat`, its claims stale after `stale_after` and reaped every 500 ms.
pub fn worker(pool: &PgPool, runs: &Runs, heartbeat: Duration, stale_after: Duration) -> Worker {
    Worker::builder(pool.clone())
        .register::<Counted>()
        .concurrency(8)
        .poll_interval(Duration::from_millis(100))
        .heartbeat(heartbeat, stale_after)
        .reap_interval(Duration::from_millis(500))
        .data(runs.clone())
        .build()
        .expect("build the worker")
}

/// How many jobs are in `state`.
pub async fn count(pool: &PgPool, state: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state::text = $1")
        .bind(state)
        .fetch_one(pool)
        .await
        .expect("count jobs")
}

/// Counts of jobs by state on `pool`, or `None` while the server does not answer.
pub async fn states(pool: &PgPool) -> Option<HashMap<String, i64>> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT state::text, count(*) FROM skiplock.jobs GROUP BY state")
            .fetch_all(pool)
            .await
            .ok()?;
    Some(rows.into_iter().collect())
}

/// Waits until `standby` has replayed everything `primary` has written so far.
pub async fn wait_caught_up(primary: &PgPool, standby: &PgPool) {
    let target: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(primary)
        .await
        .expect("primary LSN");
    crate::common::fixtures::wait_for(
        "the standby to replay the primary's WAL",
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, bool>("SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn")
                .bind(&target)
                .fetch_one(standby)
                .await
                .unwrap_or(false)
        },
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// Audit

/// Creates `public.job_audit` and a trigger recording every insert and update of
/// `skiplock.jobs` (heartbeats left out): the state and claim token before and after. It
/// lives in the same database as the jobs, so it replicates with them: a standby's audit
/// is the history the standby saw.
pub async fn install_audit(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE TABLE public.job_audit (
             job_id     bigint      NOT NULL,
             old_state  text,
             new_state  text        NOT NULL,
             old_token  uuid,
             new_token  uuid,
             at         timestamptz NOT NULL DEFAULT clock_timestamp()
         );
         CREATE FUNCTION public.job_audit_record() RETURNS trigger
         LANGUAGE plpgsql AS $$
         BEGIN
             IF TG_OP = 'INSERT' THEN
                 INSERT INTO public.job_audit (job_id, new_state, new_token)
                 SELECT n.id, n.state::text, n.claim_token FROM new_rows n ORDER BY n.id;
             ELSE
                 INSERT INTO public.job_audit (job_id, old_state, new_state, old_token, new_token)
                 SELECT n.id, o.state::text, n.state::text, o.claim_token, n.claim_token
                 FROM old_rows o JOIN new_rows n ON n.id = o.id
                 WHERE o.state IS DISTINCT FROM n.state
                    OR o.claim_token IS DISTINCT FROM n.claim_token
                 ORDER BY n.id;
             END IF;
             RETURN NULL;
         END $$;",
    )
    .execute(pool)
    .await
    .expect("create the audit table and its function");
    for (name, writes) in [
        ("job_audit_insert", JobWrites::Insert),
        ("job_audit_update", JobWrites::Update),
    ] {
        after_job_statements(pool, name, writes, "public.job_audit_record").await;
    }
}

/// One audited change of a job.
#[derive(Debug, Clone, PartialEq, Eq, Hash, sqlx::FromRow)]
pub struct Change {
    pub job_id: i64,
    pub old_state: Option<String>,
    pub new_state: String,
    pub old_token: Option<Uuid>,
    pub new_token: Option<Uuid>,
    pub at: chrono::DateTime<chrono::Utc>,
}

/// Every audited change on `pool`'s server.
pub async fn changes(pool: &PgPool) -> Vec<Change> {
    sqlx::query_as(
        "SELECT job_id, old_state, new_state, old_token, new_token, at FROM public.job_audit",
    )
    .fetch_all(pool)
    .await
    .expect("read the audit")
}

/// The claim tokens `changes` issued.
pub fn tokens(changes: &[Change]) -> HashSet<Uuid> {
    changes.iter().filter_map(|c| c.new_token).collect()
}

/// Per job, how many times it became `succeeded`.
pub fn successes(changes: &[Change]) -> HashMap<i64, u32> {
    let mut counts = HashMap::new();
    for change in changes.iter().filter(|c| c.new_state == "succeeded") {
        *counts.entry(change.job_id).or_default() += 1;
    }
    counts
}
