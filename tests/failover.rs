//! skiplock through the life of a replicated Postgres: a worker pointed at a hot standby
//! waits (saying once why) and drains once the standby is promoted; a failover to a
//! synchronous standby mid-drain loses nothing and runs nothing twice; a failover to an
//! asynchronous standby loses the commits it never received but leaves the queue correct.
//!
//! Real components only: private clusters (a primary from `initdb`, a streaming standby
//! from `pg_basebackup -R`, `pg_ctl stop -m immediate` and `pg_ctl promote`) and a TCP proxy
//! standing in for the failover endpoint, re-pointed at the new primary.

mod common;
#[path = "failover_support/mod.rs"]
mod failover;
#[allow(dead_code)] // the defect rule is for the model tests
#[path = "model_support/logs.rs"]
mod logs;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::fixtures::wait_for;
use failover::{Cluster, Proxy, Runs};
use skiplock::{JobEventOutcome, ShutdownHandle, Worker, WorkerSummary};
use sqlx::PgPool;
use tokio::task::JoinHandle;

/// The log capture is one per process: the tests of this file run one at a time, so that
/// each reads only its own lines (and a small CI machine runs two servers at a time).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How long anything here may take before the test calls it stuck.
const PATIENCE: Duration = Duration::from_secs(90);

/// Jobs of the failover drains; a quarter of them in 40 lanes.
const JOBS: usize = 5_000;

/// The server binaries' directory, or `None` after [`common::missing_tool`] (a failure
/// in CI).
fn binaries() -> Option<std::path::PathBuf> {
    let bin = failover::bin_dir();
    if bin.is_none() {
        common::missing_tool(
            "the failover tests",
            "the PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup)",
            "apt-get install postgresql",
        );
    }
    bin
}

/// Runs a server tool (seconds at most) without stalling the other tasks.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

type Running = (ShutdownHandle, JoinHandle<skiplock::Result<WorkerSummary>>);

/// Starts `worker` in a task of its own.
fn spawn(worker: Worker) -> Running {
    let stop = worker.shutdown_handle();
    (stop, tokio::spawn(worker.run()))
}

/// Asserts that no worker has exited.
fn assert_all_running(workers: &[Running]) {
    for (_, task) in workers {
        assert!(!task.is_finished(), "a worker exited: {task:?}");
    }
}

/// Stops the workers, asserting that none had exited before and that each ends cleanly.
async fn stop_all(workers: Vec<Running>) {
    assert_all_running(&workers);
    for (stop, task) in workers {
        stop.shutdown();
        tokio::time::timeout(PATIENCE, task)
            .await
            .expect("the worker stops")
            .expect("the worker task")
            .expect("the worker ends without an error");
    }
}

/// Waits until `pool`'s server holds exactly `expected` jobs, all succeeded; returns how
/// long that took.
async fn wait_drained(pool: &PgPool, expected: i64) -> Duration {
    let started = Instant::now();
    wait_for("the queue to drain", PATIENCE, || async {
        failover::states(pool)
            .await
            .is_some_and(|s| s.get("succeeded") == Some(&expected) && s.len() == 1)
    })
    .await;
    started.elapsed()
}

/// Waits until at least `done` jobs succeeded on `pool`'s server.
async fn wait_succeeded(pool: &PgPool, done: i64) {
    wait_for("jobs to succeed", PATIENCE, || async {
        failover::count(pool, "succeeded").await >= done
    })
    .await;
}

/// The captured lines that are warnings or errors.
fn warnings(lines: &[String]) -> Vec<&String> {
    lines
        .iter()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_on_a_standby_waits_and_drains_once_it_is_promoted() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(bin) = binaries() else { return };
    logs::install();
    let primary = blocking(|| Cluster::primary(&bin, ""));
    let primary_pool = failover::app_database(&primary).await;
    let standby = blocking(|| Cluster::standby_of(&primary));
    let standby_pool = failover::pool(&standby.url("app"), 10);
    failover::wait_caught_up(&primary_pool, &standby_pool).await;
    logs::take();

    // A worker whose endpoint reaches the standby: a wrong URL, or a failover endpoint
    // that has not moved yet.
    let runs = Runs::new(Duration::ZERO);
    let workers = vec![spawn(failover::worker(
        &standby_pool,
        &runs,
        Duration::from_secs(1),
        Duration::from_secs(5),
    ))];
    let mut lines = Vec::new();
    let said = wait_for_line(&mut lines, "the worker to say the server is a standby", |l| {
        l.contains("standby")
    })
    .await;
    // Long enough for the claim loop, the reaper, cron and the pruner to try again.
    tokio::time::sleep(Duration::from_secs(4)).await;
    lines.extend(logs::take());
    let warned = warnings(&lines);
    assert_eq!(
        warned.len(),
        1,
        "one line says the server is a standby, and nothing else warns: {lines:#?}"
    );
    println!("the worker on the standby said: {said}");
    assert_all_running(&workers);

    // A command that writes says the same, in one line, and fails.
    let enqueue = tokio::process::Command::new(env!("CARGO_BIN_EXE_skiplock"))
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .args(["--database-url", &standby.url("app"), "enqueue", "counted", "{}"])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("run skiplock enqueue");
    let stderr = String::from_utf8_lossy(&enqueue.stderr);
    assert_eq!(enqueue.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains("standby") && stderr.contains("primary"),
        "names a standby and what to do: {stderr}"
    );
    println!("skiplock enqueue on the standby said: {}", stderr.trim());

    // The failover: the primary goes away, the standby is promoted, jobs arrive there.
    blocking(|| primary.kill());
    blocking(|| standby.promote());
    let promoted = Instant::now();
    let ids = failover::enqueue(&standby_pool, JOBS).await;
    let enqueued = promoted.elapsed();
    wait_succeeded(&standby_pool, 1).await;
    let first = promoted.elapsed();
    wait_drained(&standby_pool, JOBS as i64).await;
    println!(
        "standby promoted: {JOBS} jobs enqueued after {enqueued:?}, the first succeeded after \
         {first:?}, all after {:?}",
        promoted.elapsed()
    );
    let counts = runs.counts();
    for id in &ids {
        assert_eq!(counts.get(id), Some(&1), "job {id} ran once");
    }
    stop_all(workers).await;
    let lines = logs::take();
    assert!(
        !lines.iter().any(|l| logs::is_defect(l)),
        "no statement failed on data: {lines:#?}"
    );
}

/// Waits until a captured log line satisfies `wanted`; returns it. Every line captured
/// meanwhile is appended to `lines`.
async fn wait_for_line(
    lines: &mut Vec<String>,
    what: &str,
    wanted: impl Fn(&str) -> bool,
) -> String {
    let deadline = Instant::now() + PATIENCE;
    loop {
        lines.extend(logs::take());
        if let Some(found) = lines.iter().find(|l| wanted(l)) {
            return found.clone();
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; the log: {lines:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
