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

use std::collections::HashSet;
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

/// Jobs of the synchronous failover drain; a quarter of them in 40 lanes.
const JOBS: usize = 5_000;

/// Jobs of the standby wait and the asynchronous failover (fewer: CI's machine is small).
const ASYNC_JOBS: usize = 2_000;

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

/// The tasks of a worker whose writes a standby refuses, and a piece of the statement each
/// sends (as the server logs it). Cron writes nothing without a schedule, and the pruner
/// runs every 30 s.
const REFUSED_TASKS: [(&str, &str); 4] = [
    ("the claim loop", "skiplock.internal_claim_batch("),
    ("the listener", "LISTEN \"skiplock_runnable\""),
    ("the reaper", "skiplock.internal_reap_stale("),
    ("the dependency sweep", "skiplock.internal_settle_waiting("),
];

/// How many statements containing `statement` a server's `log` shows refused: entries
/// (a line with the log's timestamp prefix and the lines that continue it) that are the
/// `STATEMENT:` of an error.
fn refused(log: &str, statement: &str) -> usize {
    let mut entries: Vec<String> = Vec::new();
    for line in log.lines() {
        if line.starts_with(|c: char| c.is_ascii_digit()) || entries.is_empty() {
            entries.push(line.to_owned());
        } else if let Some(entry) = entries.last_mut() {
            entry.push('\n');
            entry.push_str(line);
        }
    }
    entries
        .iter()
        .filter(|e| e.contains(" STATEMENT:  ") && e.contains(statement))
        .count()
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
    let said = wait_for_line(
        &mut lines,
        "the worker to say the server is a standby",
        |l| l.contains("standby"),
    )
    .await;
    // Every task that writes tries again, quietly: wait until the standby's log shows
    // each one's write refused twice more since the line was said. A task retries in turn,
    // so its second refusal means it has handled the first (and logged whatever it would
    // log about it); a fixed wait proved nothing when a task had not run again by then.
    let said_at = standby.log().len();
    wait_for(
        "each task of the worker to be refused twice more",
        PATIENCE,
        || async {
            let log = standby.log();
            let since = String::from_utf8_lossy(&log.as_bytes()[said_at..]);
            REFUSED_TASKS
                .iter()
                .all(|(_, statement)| refused(&since, statement) >= 2)
        },
    )
    .await;
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
        .args([
            "--database-url",
            &standby.url("app"),
            "enqueue",
            "counted",
            "{}",
        ])
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
    let ids = failover::enqueue(&standby_pool, ASYNC_JOBS).await;
    let enqueued = promoted.elapsed();
    wait_succeeded(&standby_pool, 1).await;
    let first = promoted.elapsed();
    wait_drained(&standby_pool, ASYNC_JOBS as i64).await;
    println!(
        "standby promoted: {ASYNC_JOBS} jobs enqueued after {enqueued:?}, the first succeeded after \
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_synchronous_standby_mid_drain_loses_nothing_and_runs_nothing_twice() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(bin) = binaries() else { return };
    logs::install();
    let primary = blocking(|| Cluster::primary(&bin, ""));
    let standby = blocking(|| Cluster::standby_of(&primary));
    // Synchronous from now on: a commit returns once the standby has applied it.
    let admin = failover::pool(&primary.url("postgres"), 1);
    for statement in [
        "ALTER SYSTEM SET synchronous_standby_names = '*'",
        "ALTER SYSTEM SET synchronous_commit = 'remote_apply'",
        "SELECT pg_reload_conf()",
    ] {
        sqlx::query(statement)
            .execute(&admin)
            .await
            .expect(statement);
    }
    wait_for("the standby to be synchronous", PATIENCE, || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
        )
        .fetch_one(&admin)
        .await
        .is_ok_and(|n| n == 1)
    })
    .await;
    admin.close().await;
    let primary_pool = failover::app_database(&primary).await;
    let ids = failover::enqueue(&primary_pool, JOBS).await;
    let standby_pool = failover::pool(&standby.url("app"), 5);

    // Two workers through the failover endpoint, each with its own pool.
    let proxy = Proxy::start(primary.port()).await;
    let runs = Runs::new(Duration::from_millis(5));
    logs::take();
    // Stale after a minute: the kill, the promotion and the workers' reconnection leave
    // their claims without a heartbeat for seconds (about 9 were seen on a loaded
    // machine), and with 10 s their own reaper took some back from live handlers, which
    // then ran twice. No claim is lost here, so nothing needs reaping.
    let workers: Vec<Running> = (0..2)
        .map(|_| {
            let pool = failover::pool(&proxy.url("app"), 10);
            spawn(failover::worker(
                &pool,
                &runs,
                Duration::from_secs(1),
                Duration::from_secs(60),
            ))
        })
        .collect();
    let started = Instant::now();
    wait_succeeded(&primary_pool, JOBS as i64 / 5).await;
    let before = started.elapsed();

    // The failover, mid-drain: the primary dies, the standby is promoted, the endpoint
    // moves to it.
    blocking(|| primary.kill());
    let done_before = failover::count(&standby_pool, "succeeded").await;
    blocking(|| standby.promote());
    let promoted = Instant::now();
    proxy.repoint(standby.port());
    assert!(done_before < JOBS as i64, "the failover came mid-drain");
    wait_succeeded(&standby_pool, done_before + 1).await;
    let first = promoted.elapsed();
    // As many jobs as the workers did from their start to the kill: the difference of the
    // two times is what the failover cost the drain.
    wait_succeeded(&standby_pool, done_before + JOBS as i64 / 5).await;
    let window = promoted.elapsed();
    wait_drained(&standby_pool, JOBS as i64).await;
    println!(
        "synchronous failover: {done_before} of {JOBS} jobs done at the kill; the first \
         {} took {before:?} from the workers' start, the next {} {window:?} from the \
         promotion (first success after {first:?}); all done {:?} after the promotion",
        JOBS / 5,
        JOBS / 5,
        promoted.elapsed()
    );

    // Exactly once: one run of each handler, one transition to succeeded of each row.
    let counts = runs.counts();
    let successes = failover::successes(&failover::changes(&standby_pool).await);
    for id in &ids {
        assert_eq!(counts.get(id), Some(&1), "job {id} ran once");
        assert_eq!(successes.get(id), Some(&1), "job {id} succeeded once");
    }
    stop_all(workers).await;
    let lines = logs::take();
    assert!(
        !lines.iter().any(|l| logs::is_defect(l)),
        "no statement failed on data: {lines:#?}"
    );
    println!(
        "the workers' warnings through the failover: {:#?}",
        warnings(&lines)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_an_asynchronous_standby_loses_what_it_never_received_and_stays_correct() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(bin) = binaries() else { return };
    logs::install();
    let primary = blocking(|| Cluster::primary(&bin, ""));
    let primary_pool = failover::app_database(&primary).await;
    let ids = failover::enqueue(&primary_pool, ASYNC_JOBS).await;
    // Asynchronous: a commit returns before the standby has it.
    let standby = blocking(|| Cluster::standby_of(&primary));
    let standby_pool = failover::pool(&standby.url("app"), 5);
    failover::wait_caught_up(&primary_pool, &standby_pool).await;

    let proxy = Proxy::start(primary.port()).await;
    let runs = Runs::new(Duration::from_millis(5));
    logs::take();
    let claims_lost = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let workers: Vec<Running> = (0..2)
        .map(|_| {
            let pool = failover::pool(&format!("{}?application_name=worker", proxy.url("app")), 10);
            let worker = failover::worker(
                &pool,
                &runs,
                Duration::from_secs(1),
                Duration::from_secs(10),
            );
            let mut events = worker.subscribe();
            let claims_lost = claims_lost.clone();
            tokio::spawn(async move {
                while let Some(event) = events.recv().await {
                    if matches!(event.outcome, JobEventOutcome::Lost) {
                        claims_lost.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                }
            });
            spawn(worker)
        })
        .collect();
    wait_succeeded(&primary_pool, ASYNC_JOBS as i64 / 10).await;

    // Replication stops (a network partition, a standby that fell behind): from here on,
    // what the primary commits never reaches the standby.
    let standby_admin = failover::pool(&standby.url("postgres"), 1);
    sqlx::query("ALTER SYSTEM SET primary_conninfo = ''")
        .execute(&standby_admin)
        .await
        .expect("cut replication");
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&standby_admin)
        .await
        .expect("reload");
    wait_for("the standby to stop receiving", PATIENCE, || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_stat_wal_receiver")
            .fetch_one(&standby_admin)
            .await
            .is_ok_and(|n| n == 0)
    })
    .await;
    // Enqueues, completions and claims the new primary will never see.
    let lost_enqueues = failover::enqueue(&primary_pool, 100).await;
    let at_cut = failover::count(&primary_pool, "succeeded").await;
    wait_succeeded(&primary_pool, at_cut + ASYNC_JOBS as i64 / 10).await;
    runs.close();
    wait_for("handlers to hold claims", PATIENCE, || async {
        runs.held() >= 4
    })
    .await;
    // The endpoint goes first (the workers lose the old primary), so that the old
    // primary's history read here is complete when it dies.
    proxy.disconnect();
    wait_for(
        "the workers' sessions on the old primary to end",
        PATIENCE,
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND application_name = 'worker'",
            )
            .fetch_one(&primary_pool)
            .await
            .is_ok_and(|n| n == 0)
        },
    )
    .await;
    let old_changes = failover::changes(&primary_pool).await;

    blocking(|| primary.kill());
    // Claims the standby saw (made before the cut): their heartbeats since, and maybe
    // their outcomes, are lost, so the new primary may reap them.
    let claimed_at_cut: HashSet<i64> =
        sqlx::query_scalar("SELECT id FROM skiplock.jobs WHERE state = 'running'")
            .fetch_all(&standby_pool)
            .await
            .expect("running jobs on the standby")
            .into_iter()
            .collect();
    blocking(|| standby.promote());
    let promoted = Instant::now();
    proxy.repoint(standby.port());
    runs.open();
    wait_drained(&standby_pool, ASYNC_JOBS as i64).await;
    println!(
        "asynchronous failover: the queue drained {:?} after the promotion",
        promoted.elapsed()
    );

    // What the standby never received is lost: the enqueues after the cut.
    let found: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE id = ANY($1)")
        .bind(&lost_enqueues)
        .fetch_one(&standby_pool)
        .await
        .expect("count lost enqueues");
    assert_eq!(found, 0, "enqueues the standby never received are gone");

    // The changes the old primary made that the new one never saw, and the claim tokens
    // only the old primary issued.
    let new_changes = failover::changes(&standby_pool).await;
    let seen: HashSet<&failover::Change> = new_changes.iter().collect();
    let diverged: Vec<&failover::Change> =
        old_changes.iter().filter(|c| !seen.contains(c)).collect();
    let new_tokens = failover::tokens(&new_changes);
    let lost_tokens: HashSet<uuid::Uuid> = diverged
        .iter()
        .filter_map(|c| c.new_token)
        .filter(|t| !new_tokens.contains(t))
        .collect();
    assert!(!lost_tokens.is_empty(), "claims were lost in the failover");
    // Fenced: no write under a lost claim changed a row of the new primary.
    for change in &new_changes {
        assert!(
            change.old_token.is_none_or(|t| !lost_tokens.contains(&t)),
            "a lost claim wrote on the new primary: {change:?}"
        );
    }
    // Every job the new primary has succeeded exactly once as a row. Its handler ran once,
    // or twice when the old primary's record of its claim, heartbeats or completion was
    // lost (the job was claimed on the old primary after the cut, or still claimed at the
    // cut).
    let successes = failover::successes(&new_changes);
    let in_doubt: HashSet<i64> = diverged
        .iter()
        .map(|c| c.job_id)
        .chain(claimed_at_cut.iter().copied())
        .collect();
    let counts = runs.counts();
    let mut ran_again = 0;
    for id in &ids {
        assert_eq!(successes.get(id), Some(&1), "job {id} succeeded once");
        let ran = counts.get(id).copied().unwrap_or(0);
        if in_doubt.contains(id) {
            assert!((1..=2).contains(&ran), "job {id} ran {ran} times");
            ran_again += usize::from(ran == 2);
        } else {
            assert_eq!(
                ran, 1,
                "job {id}, not claimed on the old primary after the cut, ran once"
            );
        }
    }
    assert!(
        ran_again > 0,
        "completions the standby never received ran again"
    );
    let claims_lost = claims_lost.load(std::sync::atomic::Ordering::SeqCst);
    println!(
        "asynchronous failover: {} claim tokens and {} changes lost, {ran_again} jobs ran \
         again, {claims_lost} outcomes fenced off",
        lost_tokens.len(),
        diverged.len()
    );
    stop_all(workers).await;
    let lines = logs::take();
    assert!(
        !lines.iter().any(|l| logs::is_defect(l)),
        "no statement failed on data: {lines:#?}"
    );
}
