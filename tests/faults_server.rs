//! Faults of the Postgres server: restarts (immediate and fast) during enqueue and work,
//! and the jobs table locked for 15 s under a worker whose pool is too small for its
//! concurrency. Restarts happen on a private server of the test's own, never on the
//! shared one.
#![cfg(feature = "testbed")]

mod common;
mod fault_support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::test_db;
use fault_support::{
    PATIENCE, PrivateServer, Restart, Testbed, TestbedArgs, audit, audited_db,
    check_claim_discipline, create_runs_table, db_now, enqueue_n, install_audit, lock_jobs_table,
    run_count, runs_by_job, states, wait_until,
};
use serde_json::json;
use skiplock::{EnqueueOptions, NewJob};
use sqlx::{AssertSqlSafe, PgPool};

/// What the enqueuer saw of one transaction.
struct Outcome {
    tx: i32,
    committed: bool,
}

/// Enqueues transactions until `stop`: each writes an `orders` row and 20 jobs tagged
/// with its number, then commits; errors (the server is down) are noted and the loop goes
/// on.
async fn enqueue_until(pool: PgPool, stop: Arc<AtomicBool>) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let mut tx_number = 0;
    while !stop.load(Ordering::Relaxed) {
        tx_number += 1;
        let attempt = async {
            let mut tx = pool.begin().await?;
            sqlx::query("INSERT INTO public.orders (tx) VALUES ($1)")
                .bind(tx_number)
                .execute(&mut *tx)
                .await?;
            let jobs: Vec<NewJob> = (0..20)
                .map(|_| NewJob::new("record", json!({"ms": 20, "tx": tx_number})))
                .collect();
            skiplock::enqueue_raw(&mut *tx, &jobs)
                .await
                .map_err(|e| match e {
                    skiplock::Error::Database(e) => e,
                    other => panic!("enqueue refused: {other}"),
                })?;
            tx.commit().await
        };
        let committed = attempt.await.is_ok();
        outcomes.push(Outcome {
            tx: tx_number,
            committed,
        });
        if !committed {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    outcomes
}

/// Workload: a task enqueues transactions of 20 jobs plus an application row, back to
/// back, while two testbed workers (8 slots, stale after 3 s) drain them.
///
/// Fault: the private Postgres server is restarted twice under this load, first with
/// `pg_ctl restart -m immediate` (a crash: backends killed, no checkpoint), then with
/// `-m fast`.
///
/// Invariant: every transaction is atomic both ways (its row and its 20 jobs exist
/// together or not at all); every transaction whose commit succeeded is kept; the
/// workers recover without being restarted (the same processes drain everything); no
/// job is left queued or running; the claim discipline holds across the restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarts_during_enqueue_and_work_lose_nothing_and_strand_nothing() {
    let Some(server) = PrivateServer::start().await else {
        return;
    };
    let pool = server.database("faults", 10).await;
    let url = server.url("faults");
    install_audit(&pool).await;
    sqlx::query("CREATE TABLE public.orders (tx int PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    create_runs_table(&url).await;
    let args = TestbedArgs::new()
        .set("kinds", "record")
        .set("concurrency", 8)
        .set("stale-ms", 3_000);
    let mut workers = vec![
        Testbed::start(&url, "tb-pg-0", &args).await,
        Testbed::start(&url, "tb-pg-1", &args).await,
    ];
    let stop = Arc::new(AtomicBool::new(false));
    let enqueuer = tokio::spawn(enqueue_until(pool.clone(), stop.clone()));

    // Besides whatever the enqueuer has in flight, each restart strikes one transaction
    // known to be open across it (numbered -1, -2), so the fault surely hits one.
    let mut straddlers = Vec::new();
    for (n, mode) in [(-1, Restart::Immediate), (-2, Restart::Fast)] {
        let before = run_count(&pool).await;
        wait_until("the workers to make progress", PATIENCE, || async {
            (run_count(&pool).await >= before + 100).then_some(())
        })
        .await;
        let mut straddler = pool.begin().await.unwrap();
        sqlx::query("INSERT INTO public.orders (tx) VALUES ($1)")
            .bind(n)
            .execute(&mut *straddler)
            .await
            .unwrap();
        let jobs: Vec<NewJob> = (0..20)
            .map(|_| NewJob::new("record", json!({"ms": 20, "tx": n})))
            .collect();
        skiplock::enqueue_raw(&mut *straddler, &jobs).await.unwrap();
        server.restart(mode).await;
        eprintln!("restarted the server ({mode:?})");
        assert!(
            straddler.commit().await.is_err(),
            "a transaction open across the restart cannot commit"
        );
        straddlers.push(Outcome {
            tx: n,
            committed: false,
        });
    }
    let before = run_count(&pool).await;
    wait_until("work to go on after the restarts", PATIENCE, || async {
        (run_count(&pool).await >= before + 100).then_some(())
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let mut outcomes = enqueuer.await.unwrap();
    outcomes.extend(straddlers);
    wait_until("every job to succeed", PATIENCE, || async {
        let states = states(&pool).await;
        (states.len() == 1 && states.contains_key("succeeded")).then_some(())
    })
    .await;
    for worker in &mut workers {
        assert!(!worker.has_exited(), "{} kept running", worker.worker_id);
        worker.signal("TERM");
        assert!(worker.wait_exit(PATIENCE).await.success());
    }

    let jobs_per_tx: HashMap<i64, i64> =
        sqlx::query_as("SELECT (args->>'tx')::bigint, count(*) FROM skiplock.jobs GROUP BY 1")
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let orders: Vec<i32> = sqlx::query_scalar("SELECT tx FROM public.orders")
        .fetch_all(&pool)
        .await
        .unwrap();
    let failed = outcomes.iter().filter(|o| !o.committed).count();
    assert!(failed > 0, "the restarts hit some transactions");
    for outcome in &outcomes {
        let jobs = jobs_per_tx
            .get(&i64::from(outcome.tx))
            .copied()
            .unwrap_or(0);
        let row = orders.contains(&outcome.tx);
        assert_eq!(
            jobs,
            if row { 20 } else { 0 },
            "transaction {} is all or nothing",
            outcome.tx
        );
        if outcome.committed {
            assert!(row, "committed transaction {} was kept", outcome.tx);
        }
    }
    let runs = runs_by_job(&pool).await;
    let total: i64 = jobs_per_tx.values().sum();
    assert_eq!(runs.len() as i64, total, "every job ran");
    check_claim_discipline(&audit(&pool).await, false);
    eprintln!(
        "{} transactions, {failed} failed around the restarts, {total} jobs",
        outcomes.len()
    );
}

/// Workload: one worker with 16 slots but a pool of only 2 connections (its LISTEN
/// connection keeps one), heartbeating every second with a 30 s stale timeout; its
/// handlers write through the same pool. 16 jobs of 40 s start first; 200 short jobs
/// queue behind them. The long jobs outlast the lock by about 25 s, so their heartbeats
/// after it have time to get through the jammed pool on a loaded machine (with 17 s jobs
/// they had 2 s at most); the stale timeout leaves 15 s beyond the lock for the first of
/// them.
///
/// Fault: once the long jobs run, another session holds `LOCK TABLE skiplock.jobs IN
/// ACCESS EXCLUSIVE MODE` for 15 s (asked with NOWAIT until granted: `lock_jobs_table`):
/// every claim, heartbeat, completion and reaper pass blocks, each holding one of the two
/// connections, and the rest wait for a connection.
///
/// Invariant: no deadlock and no hang: after the lock every job succeeds exactly once on
/// attempt 1; heartbeats resume for every long job after the lock and none is reaped; the
/// worker still stops promptly on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_locked_for_15_s_under_a_starved_pool_deadlocks_nothing_and_reaps_nothing() {
    let db = audited_db().await;
    let pool = &db.pool;
    let long = enqueue_n(
        pool,
        "record",
        json!({"ms": 40_000}),
        16,
        EnqueueOptions::new(),
    )
    .await;
    enqueue_n(
        pool,
        "record",
        json!({"ms": 10}),
        200,
        EnqueueOptions::new().priority(1),
    )
    .await;
    let mut worker = Testbed::start(
        &db.url,
        "tb-starved",
        &TestbedArgs::new()
            .set("kinds", "record")
            .set("concurrency", 16)
            .set("pool-size", 2)
            .set("heartbeat-ms", 1_000)
            .set("stale-ms", 30_000),
    )
    .await;
    wait_until("the long jobs to start", PATIENCE, || async {
        (run_count(pool).await >= 16).then_some(())
    })
    .await;

    let locker = lock_jobs_table(pool).await;
    let locked_at = Instant::now();
    // Holding the lock is the fault itself, not a synchronization: keep it 15 s.
    tokio::time::sleep(Duration::from_secs(15)).await;
    locker.commit().await.unwrap();
    let released = db_now(pool).await;
    eprintln!("held the lock for {:?}", locked_at.elapsed());

    wait_until("every job to succeed", PATIENCE, || async {
        (states(pool).await.get("succeeded") == Some(&216)).then_some(())
    })
    .await;
    worker.signal("TERM");
    assert!(worker.wait_exit(PATIENCE).await.success());
    let log_text = worker.log_text();
    assert!(!log_text.contains("deadlock"), "{log_text}");

    let attempts: Vec<i32> = sqlx::query_scalar("SELECT DISTINCT attempt FROM skiplock.jobs")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(attempts, vec![1]);
    let runs = runs_by_job(pool).await;
    assert!(runs.values().all(|r| r.len() == 1), "every job ran once");
    let log = audit(pool).await;
    check_claim_discipline(&log, false);
    assert!(log.iter().all(|r| !r.is_reap()), "nothing was reaped");
    for id in &long {
        assert!(
            log.iter()
                .any(|r| r.job_id == *id && r.heartbeat && r.at > released),
            "job {id} heartbeat again after the lock"
        );
    }
}

/// Workload: a testbed worker given a pool of a single connection, and 5 `noop` jobs.
///
/// Fault: the pool is smaller than the worker's fixed needs (its LISTEN connection plus
/// one for statements).
///
/// Invariant: no hang: within a minute the worker either drains the jobs or refuses to
/// start, exiting non-zero with a message about the pool size.
///
/// This failed until the listener got a connection of its own: it held the pool's only
/// connection for good, so every claim, heartbeat and reaper pass timed out, forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_a_one_connection_pool_drains_or_refuses_to_start() {
    let db = test_db().await;
    let pool = &db.pool;
    enqueue_n(pool, "noop", json!({}), 5, EnqueueOptions::new()).await;
    let mut child = tokio::process::Command::new(fault_support::TESTBED)
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .args(["--database-url", &db.url, "--worker-id", "tb-one-conn"])
        .args([
            "--kinds",
            "noop",
            "--pool-size",
            "1",
            "--acquire-timeout-ms",
            "2000",
        ])
        .arg("--exit-when-idle")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(60), child.wait()).await;
    let succeeded = states(pool).await.get("succeeded").copied().unwrap_or(0);
    match outcome {
        Ok(status) if status.as_ref().is_ok_and(|s| s.success()) => {
            assert_eq!(succeeded, 5, "exited idle only after draining")
        }
        Ok(status) => {
            let mut stderr = String::new();
            use tokio::io::AsyncReadExt;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut stderr)
                .await
                .unwrap();
            assert!(
                stderr.contains("pool") && stderr.contains("connection"),
                "refused with a message about the pool ({status:?}): {stderr}"
            );
        }
        Err(_) => panic!(
            "the worker hung for a minute with a one-connection pool ({succeeded} of 5 jobs done)"
        ),
    }
}

/// Does nothing; for the lost-reply test's worker.
#[derive(serde::Serialize, serde::Deserialize)]
struct Nothing {}

impl skiplock::Job for Nothing {
    const KIND: &'static str = "nothing";

    async fn run(self, _ctx: skiplock::JobContext) -> Result<(), skiplock::JobError> {
        Ok(())
    }
}

/// Fails its first attempt; the retry comes 2 s later, after a worker run with
/// `exit_when_idle` has stopped.
#[derive(serde::Serialize, serde::Deserialize)]
struct FailsOnce {}

impl skiplock::Job for FailsOnce {
    const KIND: &'static str = "fails_once";

    async fn run(self, ctx: skiplock::JobContext) -> Result<(), skiplock::JobError> {
        if ctx.attempt() == 1 {
            return Err(skiplock::JobError::retry("planned first failure"));
        }
        Ok(())
    }

    fn retry_delay(_attempt: i32) -> Duration {
        Duration::from_secs(2)
    }
}

/// Opened by the test: jobs of [`WaitsForTheGate`] wait until then.
type Gate = tokio::sync::watch::Receiver<bool>;

/// Runs until the test opens the [`Gate`] the worker was given, so that a worker of
/// concurrency 1 surely holds claims it has not started (its one slot is taken) for as
/// long as the test needs.
#[derive(serde::Serialize, serde::Deserialize)]
struct WaitsForTheGate {}

impl skiplock::Job for WaitsForTheGate {
    const KIND: &'static str = "waits_for_the_gate";

    async fn run(self, ctx: skiplock::JobContext) -> Result<(), skiplock::JobError> {
        let mut gate = ctx
            .data::<Gate>()
            .ok_or_else(|| skiplock::JobError::permanent("no gate given"))?
            .clone();
        gate.wait_for(|open| *open)
            .await
            .map_err(|_| skiplock::JobError::permanent("the gate was dropped"))?;
        Ok(())
    }
}

/// A worker (stale timeout 3 s) connected through a [`ReplyCutter`] that loses the reply
/// of the first statement containing `needle`.
async fn worker_through_reply_cutter(
    url: &str,
    needle: &'static [u8],
) -> (fault_support::ReplyCutter, skiplock::WorkerBuilder) {
    let direct: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let server = tokio::net::lookup_host((direct.get_host(), direct.get_port()))
        .await
        .unwrap()
        .next()
        .unwrap();
    let cutter = fault_support::ReplyCutter::start(server, needle).await;
    let through_proxy = direct
        .host("127.0.0.1")
        .port(cutter.addr.port())
        .ssl_mode(sqlx::postgres::PgSslMode::Disable);
    let worker_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(through_proxy)
        .await
        .unwrap();
    let worker = skiplock::Worker::builder(worker_pool)
        .register::<Nothing>()
        .register::<FailsOnce>()
        .register::<WaitsForTheGate>()
        .concurrency(8)
        .poll_interval(Duration::from_millis(100))
        .heartbeat(Duration::from_millis(100), Duration::from_secs(3))
        .reap_interval(Duration::from_millis(100))
        .prune_interval(None);
    (cutter, worker)
}

/// Runs [`worker_through_reply_cutter`] until it is idle.
async fn drain_through_reply_cutter(
    url: &str,
    needle: &'static [u8],
) -> (fault_support::ReplyCutter, skiplock::WorkerSummary) {
    let (cutter, worker) = worker_through_reply_cutter(url, needle).await;
    let worker = worker.exit_when_idle(true).build().unwrap();
    let summary = tokio::time::timeout(PATIENCE, worker.run())
        .await
        .expect("the worker drains and exits")
        .unwrap();
    (cutter, summary)
}

/// Every job of the database succeeded, on its first attempt; there are `count` of them.
async fn every_job_succeeded_on_attempt_one(pool: &PgPool, count: usize) {
    let attempts: Vec<(i64, String, i32)> =
        sqlx::query_as("SELECT id, state::text, attempt FROM skiplock.jobs ORDER BY id")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(attempts.len(), count);
    for (id, state, attempt) in &attempts {
        assert_eq!((state.as_str(), *attempt), ("succeeded", 1), "job {id}");
    }
}

/// Workload: 30 jobs, one worker connected through a proxy (stale timeout 3 s).
///
/// Fault: the reply to the worker's first claim is lost after the claim committed (the
/// proxy swallows it and closes the connection once the server is ready for the next
/// query), as when Postgres restarts or the network cuts between a commit and its reply.
///
/// Invariant: the worker, which chose the claim's token, finds the jobs that claim took
/// and releases them at once: nothing is reaped, every job succeeds once on attempt 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_reply_is_lost_is_released_at_once_without_spending_an_attempt() {
    let db = audited_db().await;
    let pool = &db.pool;
    let ids = enqueue_n(pool, "nothing", json!({}), 30, EnqueueOptions::new()).await;
    let (cutter, summary) = drain_through_reply_cutter(&db.url, b"claim_batch").await;
    assert!(cutter.has_cut(), "the proxy lost a claim's reply");

    let log = audit(pool).await;
    let reaped: Vec<_> = log.iter().filter(|r| r.is_reap()).collect();
    assert!(
        reaped.is_empty(),
        "jobs were left to the reaper: {reaped:?}"
    );
    assert!(
        log.iter().any(|r| r.is_release()),
        "the lost claim's jobs were released"
    );
    every_job_succeeded_on_attempt_one(pool, ids.len()).await;
    assert_eq!(summary.succeeded, 30);
}

/// Workload: 30 jobs, one worker connected through a proxy.
///
/// Fault: the reply to a completion write is lost after it committed; the completer
/// retries the write, which finds those claims already settled.
///
/// Invariant: the worker recognises its own saved completions: every job succeeded once
/// and the worker counts 30 successes and no lost claim (before, they were reported as
/// "outcome discarded: the claim is no longer ours").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_whose_reply_is_lost_is_known_as_saved() {
    let db = audited_db().await;
    let pool = &db.pool;
    enqueue_n(pool, "nothing", json!({}), 30, EnqueueOptions::new()).await;
    let (cutter, summary) =
        drain_through_reply_cutter(&db.url, b"skiplock.internal_complete_claims").await;
    assert!(cutter.has_cut(), "the proxy lost a completion's reply");
    assert_eq!((summary.succeeded, summary.lost), (30, 0), "{summary:?}");
    let states = states(pool).await;
    assert_eq!(states.get("succeeded"), Some(&30), "{states:?}");
    let log = audit(pool).await;
    assert!(!log.iter().any(|r| r.is_reap()), "nothing was reaped");
}

/// Workload: 30 jobs of one key in a queue with `key_max_running` 1, one worker connected
/// through a proxy (stale timeout 3 s): each completion hands the key's slot on to the
/// worker, claiming the key's next job in its transaction.
///
/// Fault: the reply to such a completion is lost after it committed; the job it handed on
/// is running under a token the worker chose but never heard back.
///
/// Invariant: the worker finds that job by its token and releases it at once, as it does a
/// lost claim's: nothing is reaped, every job succeeds once on attempt 1, and the worker
/// counts 30 successes and no lost claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_handed_on_by_a_completion_whose_reply_is_lost_is_released_at_once() {
    let db = audited_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(
        pool,
        "default",
        skiplock::QueueLimits::default().key_max_running(1),
    )
    .await
    .unwrap();
    let ids = enqueue_n(
        pool,
        "nothing",
        json!({}),
        30,
        EnqueueOptions::new().concurrency_key("k"),
    )
    .await;
    let (cutter, summary) =
        drain_through_reply_cutter(&db.url, b"skiplock.internal_complete_handing_on").await;
    assert!(
        cutter.has_cut(),
        "the proxy lost a handing completion's reply"
    );
    assert_eq!((summary.succeeded, summary.lost), (30, 0), "{summary:?}");
    let log = audit(pool).await;
    assert!(!log.iter().any(|r| r.is_reap()), "nothing was reaped");
    assert!(
        log.iter()
            .any(|r| r.old_state.as_deref() == Some("waiting") && r.is_start()),
        "completions handed the key's held jobs on"
    );
    assert!(
        log.iter().any(|r| r.is_release()),
        "the job handed on by the lost completion was released"
    );
    every_job_succeeded_on_attempt_one(pool, ids.len()).await;
}

/// Workload: 30 jobs, one worker connected through a proxy (stale timeout 3 s); a trigger
/// of the user's refuses to give back the first job's attempt, which is its only one.
///
/// Fault: the reply to the worker's first claim is lost after the claim committed.
///
/// Invariant: the lost claim's release is split as every batch write is: the row that
/// refuses it is left to the reaper, and every other job of the claim is released at once
/// and runs on attempt 1 (before, the whole release failed and every job of the claim
/// waited for the reaper). The refusing job has no attempt left, so the reaper makes it
/// dead: with a retry, whether the worker ran it before exiting idle would depend on how
/// its backoff raced the exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claims_release_refused_by_one_row_releases_the_others() {
    let db = audited_db().await;
    let pool = &db.pool;
    let ids = enqueue_n(pool, "nothing", json!({}), 30, EnqueueOptions::new()).await;
    let stubborn = ids[0];
    sqlx::raw_sql(AssertSqlSafe(format!(
        "UPDATE skiplock.jobs SET max_attempts = 1 WHERE id = {stubborn};
         CREATE FUNCTION public.keep_attempt() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.id = {stubborn} AND NEW.attempt < OLD.attempt THEN
                 RAISE EXCEPTION 'job {stubborn} keeps its attempt';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER keep_attempt BEFORE UPDATE ON skiplock.jobs
             FOR EACH ROW EXECUTE FUNCTION public.keep_attempt();"
    )))
    .execute(pool)
    .await
    .unwrap();
    let (cutter, summary) = drain_through_reply_cutter(&db.url, b"claim_batch").await;
    assert!(cutter.has_cut(), "the proxy lost a claim's reply");

    let log = audit(pool).await;
    let reaped: Vec<i64> = log
        .iter()
        .filter(|r| r.is_reap())
        .map(|r| r.job_id)
        .collect();
    assert_eq!(
        reaped,
        vec![stubborn],
        "only the refusing row waited for the reaper"
    );
    let released: Vec<i64> = log
        .iter()
        .filter(|r| r.is_release())
        .map(|r| r.job_id)
        .collect();
    assert!(!released.is_empty(), "the others were released");
    let attempts: Vec<(i64, String, i32)> =
        sqlx::query_as("SELECT id, state::text, attempt FROM skiplock.jobs ORDER BY id")
            .fetch_all(pool)
            .await
            .unwrap();
    for (id, state, attempt) in &attempts {
        // The reaped job had no attempt left.
        let expected = if *id == stubborn { "dead" } else { "succeeded" };
        assert_eq!((state.as_str(), *attempt), (expected, 1), "job {id}");
    }
    assert_eq!(summary.succeeded, 29);
}

/// Workload: 30 jobs that fail their first attempt, one worker connected through a proxy.
///
/// Fault: the reply to a failure write is lost after it committed; the completer retries
/// the write, which finds those claims already settled.
///
/// Invariant: the worker recognises its own saved failures: it counts 30 failures and no
/// lost claim (before, the lost write's jobs were reported as "outcome discarded: the
/// claim is no longer ours"), and every job waits for its retry with one attempt spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_whose_reply_is_lost_is_known_as_saved() {
    let db = audited_db().await;
    let pool = &db.pool;
    enqueue_n(pool, "fails_once", json!({}), 30, EnqueueOptions::new()).await;
    let (cutter, summary) = drain_through_reply_cutter(&db.url, b"internal_fail_claims").await;
    assert!(cutter.has_cut(), "the proxy lost a failure's reply");
    assert_eq!(
        (summary.failed, summary.succeeded, summary.lost),
        (30, 0, 0),
        "{summary:?}"
    );
    let attempts: Vec<(i64, String, i32)> =
        sqlx::query_as("SELECT id, state::text, attempt FROM skiplock.jobs ORDER BY id")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(attempts.len(), 30);
    for (id, state, attempt) in &attempts {
        assert_eq!((state.as_str(), *attempt), ("queued", 1), "job {id}");
    }
    assert!(
        !audit(pool).await.iter().any(|r| r.is_reap()),
        "nothing was reaped"
    );
}

/// Workload: 20 jobs that run until the test opens a gate, one worker of concurrency 1
/// connected through a proxy, shut down while it holds claims it has not started (its
/// one slot runs a job held at the gate); the gate opens once the release was sent.
///
/// Fault: the reply to the shutdown's release is lost after it committed.
///
/// Invariant: the worker recognises its own saved releases: no lost claim (before, the
/// released jobs were reported as "outcome discarded"), every job it did not run is
/// `queued` with no attempt spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_reply_is_lost_is_known_as_saved() {
    let db = audited_db().await;
    let pool = &db.pool;
    enqueue_n(
        pool,
        "waits_for_the_gate",
        json!({}),
        20,
        EnqueueOptions::new(),
    )
    .await;
    let (cutter, worker) = worker_through_reply_cutter(&db.url, b"internal_release_claims").await;
    let (open_gate, gate) = tokio::sync::watch::channel(false);
    // Claims go stale after a minute, not 3 s: they are held until the shutdown, and
    // nothing here is for the reaper.
    let worker = worker
        .concurrency(1)
        .data::<Gate>(gate)
        .heartbeat(Duration::from_millis(100), Duration::from_secs(60))
        .shutdown_grace(PATIENCE)
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    // One job runs (held at the gate) and others are claimed behind it: they cannot start
    // before the shutdown, whatever the timing.
    wait_until(
        "the worker to hold claims it has not started",
        PATIENCE,
        || async {
            let running: i64 =
                sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state = 'running'")
                    .fetch_one(pool)
                    .await
                    .unwrap();
            (running >= 2).then_some(())
        },
    )
    .await;
    stop.shutdown();
    // The shutdown releases the claims not started at once; the running job finishes
    // after that (within the grace period), when the gate opens.
    wait_until("the release's reply to be lost", PATIENCE, || async {
        cutter.has_cut().then_some(())
    })
    .await;
    open_gate.send(true).unwrap();
    let summary = tokio::time::timeout(PATIENCE, run)
        .await
        .expect("the worker stops")
        .unwrap()
        .unwrap();
    assert!(cutter.has_cut(), "the proxy lost a release's reply");
    assert!(summary.released >= 1, "{summary:?}");
    assert_eq!(summary.lost, 0, "{summary:?}");
    let states = states(pool).await;
    assert_eq!(states.get("running"), None, "{states:?}");
    let unspent: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs WHERE state = 'queued' AND attempt = 0",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        unspent as u64,
        20 - summary.succeeded,
        "released and unclaimed jobs have no attempt spent"
    );
    assert!(
        !audit(pool).await.iter().any(|r| r.is_reap()),
        "nothing was reaped"
    );
}
