//! Faults of job handlers: handlers that never return, block their thread, spin the CPU,
//! panic, or abort the whole process. Real `skiplock-testbed` processes run them next to
//! well-behaved jobs; the invariants are read from the database.
#![cfg(feature = "testbed")]

mod common;
mod fault_support;

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use fault_support::{
    PATIENCE, Testbed, TestbedArgs, age_claims_of, audit, audited_db, check_claim_discipline,
    enqueue_n, runs_by_job, sessions_of, states, wait_until,
};
use serde_json::json;
use skiplock::{EnqueueOptions, JobId, JobState};

/// Workload: one worker (8 slots, 4 runtime threads, kinds' timeout 1 s, heartbeat every
/// 200 ms, stale after 8 s) runs, each with `max_attempts = 3`: a handler that never
/// returns, one that spins the CPU, one that panics, one that blocks its thread for 10 s
/// (past the stale timeout), a well-behaved 10 s job, and 200 short jobs.
///
/// The stale timeout is 40 heartbeat intervals: with a short one (it was 2 s) a loaded
/// 2-core machine, with the spinning handler on it, could delay a heartbeat past it and
/// the worker's own reaper took a live claim back, failing "nothing reaped" on the
/// machine's speed. A heartbeat starved by the blocked thread would still leave the
/// blocked and the long job 10 s without a beat, past it.
///
/// Fault: the misbehaving handlers themselves.
///
/// Invariant: the never-returning and spinning jobs are stopped by their timeout (3 claims,
/// 3 failures that say so) and the panicking one fails, each exactly 3 times, then goes
/// `dead` with the exact reason; the blocked thread starves nobody: no claim is ever
/// reaped, so the blocking job and the 4 s job ran exactly once; the 200 short jobs all
/// succeed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_handlers_are_tried_max_attempts_times_while_the_queue_flows() {
    let db = audited_db().await;
    let pool = &db.pool;
    let three = EnqueueOptions::new().max_attempts(3);
    let never = enqueue_n(pool, "never_return", json!({}), 1, three.clone()).await[0];
    let spin = enqueue_n(pool, "spin", json!({}), 1, three.clone()).await[0];
    let panic = enqueue_n(pool, "panic", json!({}), 1, three.clone()).await[0];
    let block = enqueue_n(pool, "block", json!({"ms": 10_000}), 1, three.clone()).await[0];
    let long = enqueue_n(pool, "record", json!({"ms": 10_000}), 1, three.clone()).await[0];
    let short = enqueue_n(pool, "record", json!({"ms": 5}), 200, three.clone()).await;

    let worker = Testbed::start(
        &db.url,
        "tb-handlers",
        &TestbedArgs::new()
            .set("concurrency", 8)
            .set("worker-threads", 4)
            .set("timeout-ms", 1_000)
            .set("heartbeat-ms", 200)
            .set("stale-ms", 8_000),
    )
    .await;
    wait_until("every job to settle", PATIENCE, || async {
        let states = states(pool).await;
        (states.get("dead") == Some(&3) && states.get("succeeded") == Some(&202)).then_some(())
    })
    .await;
    drop(worker);

    let runs = runs_by_job(pool).await;
    let log = audit(pool).await;
    for (id, kind) in [(never, "never_return"), (spin, "spin")] {
        let row = skiplock::job(pool, JobId(id)).await.unwrap().unwrap();
        assert_eq!((row.state, row.attempt), (JobState::Dead, 3), "{kind}");
        let timed_out = format!("timed out after 1s (kind `{kind}`)");
        assert_eq!(row.last_error.as_deref(), Some(timed_out.as_str()));
        // Attempts are counted from the database's own record: each claim started one,
        // and each ended in a failure saying the timeout stopped it. (The handler's
        // record of its run is its first statement, which a loaded machine may not finish
        // inside the 1 s timeout, so it bounds the attempts from below only.)
        let claims = log
            .iter()
            .filter(|r| r.job_id == id && r.is_claim())
            .count();
        assert_eq!(claims, 3, "{kind} was claimed exactly max_attempts times");
        let stopped: Vec<_> = log
            .iter()
            .filter(|r| r.job_id == id && r.failure)
            .map(|r| r.last_error.as_deref())
            .collect();
        assert_eq!(
            stopped,
            vec![Some(timed_out.as_str()); 3],
            "each attempt of {kind} was stopped by its timeout"
        );
        let recorded = runs.get(&id).map_or(0, Vec::len);
        assert!(
            (1..=3).contains(&recorded),
            "{kind} recorded {recorded} runs"
        );
    }
    let row = skiplock::job(pool, JobId(panic)).await.unwrap().unwrap();
    assert_eq!((row.state, row.attempt), (JobState::Dead, 3));
    assert_eq!(runs[&panic].len(), 3);
    assert_eq!(
        row.last_error.as_deref(),
        Some("handler panicked: testbed panic on attempt 3")
    );
    // A thread blocked past the stale timeout cannot be preempted by the timeout, but the
    // other threads keep heartbeating: the job is not reaped and runs once.
    for id in [block, long] {
        let row = skiplock::job(pool, JobId(id)).await.unwrap().unwrap();
        assert_eq!((row.state, row.attempt), (JobState::Succeeded, 1));
        assert_eq!(runs[&id].len(), 1);
    }
    for id in &short {
        let history: Vec<_> = log.iter().filter(|r| r.job_id == *id).collect();
        assert_eq!(
            runs[id].len(),
            1,
            "short job {id} ran once; its history: {history:#?}"
        );
    }
    check_claim_discipline(&log, false);
    let reaped: Vec<_> = log.iter().filter(|r| r.is_reap()).collect();
    assert!(reaped.is_empty(), "heartbeats kept going: {reaped:?}");
}

/// Workload: a stable worker S (kind `record`) and a worker X that also runs `abort`, which
/// aborts the process; a job of it with `max_attempts = 3` and 100 short `record` jobs.
///
/// Fault: every attempt of the abort job kills X (SIGABRT); the test starts a fresh X each
/// time, as a supervisor would.
///
/// Invariant: the abort job is tried exactly 3 times (3 executions, 3 claims, 3 reaps, by
/// three X processes), then goes `dead` with the reaper's reason; X dies exactly 3 times;
/// every short job succeeds, and one that ran twice had first run in a process that died.
///
/// The workers' stale timeout is a minute, so that no pause of a loaded machine gets a
/// live worker's claim reaped (its job would run twice after a live worker's run, which
/// fails the test); a dead X's claims are made stale by hand once its sessions are gone
/// ([`fault_support::age_claims_of`]), and the live workers' reaper takes them back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_aborts_its_process_is_tried_max_attempts_times() {
    const STALE: Duration = Duration::from_secs(60);
    let db = audited_db().await;
    let pool = &db.pool;
    let args = TestbedArgs::new()
        .set("concurrency", 4)
        .set("heartbeat-ms", 200)
        .set("stale-ms", STALE.as_millis());
    let stable = Testbed::start(&db.url, "tb-stable", &args.clone().set("kinds", "record")).await;
    let abort = enqueue_n(
        pool,
        "abort",
        json!({}),
        1,
        EnqueueOptions::new().max_attempts(3),
    )
    .await[0];
    let short = enqueue_n(
        pool,
        "record",
        json!({"ms": 20}),
        100,
        EnqueueOptions::new(),
    )
    .await;

    let x_args = args.set("kinds", "abort,record");
    let mut crashes = Vec::new();
    let mut x = Testbed::start(&db.url, "tb-abort-0", &x_args).await;
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        let row = skiplock::job(pool, JobId(abort)).await.unwrap().unwrap();
        if row.state == JobState::Dead {
            break;
        }
        if x.has_exited() {
            let status = x.wait_exit(PATIENCE).await;
            assert!(!status.success(), "X died of the abort: {status:?}");
            crashes.push(x.worker_id.clone());
            // Its claims as the reaper finds a dead worker's after the stale timeout; only
            // once its sessions are gone, so that nothing it sent lands after.
            wait_until("the dead X's sessions to end", PATIENCE, || async {
                (sessions_of(pool, &x.worker_id).await == 0).then_some(())
            })
            .await;
            age_claims_of(pool, &x.worker_id, STALE).await;
            x = Testbed::start(&db.url, &format!("tb-abort-{}", crashes.len()), &x_args).await;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the abort job did not die in time: {row:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    wait_until("the short jobs to succeed", PATIENCE, || async {
        (states(pool).await.get("succeeded") == Some(&100)).then_some(())
    })
    .await;
    // The X started after the third crash has nothing to abort: it stops cleanly.
    if x.has_exited() {
        assert!(!x.wait_exit(PATIENCE).await.success());
        crashes.push(x.worker_id.clone());
    } else {
        x.signal("TERM");
        assert!(x.wait_exit(PATIENCE).await.success(), "{}", x.log_text());
    }
    drop(stable);

    assert_eq!(crashes.len(), 3, "X died once per attempt: {crashes:?}");
    let row = skiplock::job(pool, JobId(abort)).await.unwrap().unwrap();
    assert_eq!((row.state, row.attempt), (JobState::Dead, 3));
    assert_eq!(
        row.last_error.as_deref(),
        Some("no heartbeat from tb-abort-2 for over 60000 ms; claim taken back")
    );
    let runs = runs_by_job(pool).await;
    let ran_in: Vec<&str> = runs[&abort].iter().map(|r| r.worker_id.as_str()).collect();
    assert_eq!(ran_in, vec!["tb-abort-0", "tb-abort-1", "tb-abort-2"]);
    let log = audit(pool).await;
    check_claim_discipline(&log, false);
    let per_job = |f: fn(&fault_support::AuditRow) -> bool| {
        log.iter().filter(|r| r.job_id == abort && f(r)).count()
    };
    assert_eq!(
        (per_job(|r| r.is_claim()), per_job(|r| r.is_reap())),
        (3, 3)
    );
    let mut reran: HashMap<usize, usize> = HashMap::new();
    for id in &short {
        let runs = &runs[id];
        for run in &runs[..runs.len() - 1] {
            assert!(
                crashes.contains(&run.worker_id),
                "short job {id} ran again after a run by a live worker: {runs:?}"
            );
        }
        *reran.entry(runs.len()).or_default() += 1;
    }
    eprintln!("short jobs by number of runs: {reran:?}");
}

/// Workload: one worker with a single runtime thread (heartbeat 100 ms, stale after
/// 6 s; its own reaper kept out of the way so the test decides when to reap) runs one
/// `block` job that blocks that thread for 30 s, and 20 short jobs.
///
/// Fault: the block strands every task of the runtime, the producer included, right after
/// it sent the claim of the short jobs: that claim commits, so its jobs are `running`, but
/// the worker has not read the reply and does not hold them yet. The test arranges it with
/// two table locks: one holds the block job's first statement until the claim is waiting;
/// the other holds the claim until the thread is blocked.
///
/// Invariant: the heartbeat, on its own thread, extends the stranded claim's jobs by the
/// claim's token while the reply waits: a reaper run after the stale timeout, while the
/// thread is still blocked, takes nothing back, and every job runs once. Before, those
/// jobs kept their claim-time heartbeat and the reaper took them back, so they ran twice
/// (the test above failed so about one run in ten).
///
/// Timing: the block must outlast the claim's commit, the stale timeout and the reaper's
/// pass (a pass after the thread was let go proves nothing): with a 5 s block and a 2 s
/// stale timeout that margin was under 3 s, which a loaded machine eats; now it is over
/// 20 s, and the stale timeout is 60 heartbeat intervals of the heartbeat's own thread, so
/// that only a heartbeat that does not extend the stranded claim lets it go stale. And
/// the claim held at the lock must be one that can take the short jobs (see `poll-ms`):
/// otherwise it claimed nothing, the short jobs waited for the block to end, and the
/// reaper ran after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_reply_is_stranded_by_a_blocked_thread_is_not_reaped() {
    const WORKER: &str = "tb-stranded";
    const STALE_MS: i64 = 6_000;
    let db = audited_db().await;
    let pool = &db.pool;
    // A statement of the worker (or, with `of_worker` false, of any session) waiting for
    // a lock, in a transaction begun at `begun_after` or later if given.
    let waiting_on_lock =
        |of_worker: bool, statement: &'static str, begun_after: Option<DateTime<Utc>>| async move {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND ($1::text IS NULL OR application_name = $1)
               AND wait_event_type = 'Lock'
               AND query LIKE '%' || $2 || '%'
               AND ($3::timestamptz IS NULL OR xact_start >= $3)",
            )
            .bind(of_worker.then_some(WORKER))
            .bind(statement)
            .bind(begun_after)
            .fetch_one(pool)
            .await
            .unwrap();
            (waiting > 0).then_some(())
        };

    // The block job records its run first: hold that until the claim is waiting.
    let mut runs_lock = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE public.testbed_runs IN EXCLUSIVE MODE")
        .execute(&mut *runs_lock)
        .await
        .unwrap();
    let once = EnqueueOptions::new().max_attempts(1);
    let block = enqueue_n(pool, "block", json!({"ms": 30_000}), 1, once.clone()).await[0];
    let worker = Testbed::start(
        &db.url,
        WORKER,
        &TestbedArgs::new()
            .set("concurrency", 8)
            .set("worker-threads", 1)
            .set("heartbeat-ms", 100)
            .set("stale-ms", STALE_MS)
            // Claims come only at the start and when jobs are announced, never by the
            // clock: a claim sent by a poll before the short jobs were enqueued, held at
            // the lock below, would find them not yet due once let go (a claim takes jobs
            // scheduled up to its transaction's start) and claim nothing, and the blocked
            // thread could send no other until the block ended.
            .set("poll-ms", 3_600_000)
            .set("reap-ms", 3_600_000)
            .set("timeout-ms", 60_000),
    )
    .await;
    wait_until("the block job to wait for its record", PATIENCE, || {
        waiting_on_lock(true, "testbed_runs", None)
    })
    .await;
    // Hold the next claim: it reads `skiplock.queues` (paused queues) before it picks its
    // jobs, so it waits there and picks them once let go. The enqueue reads that table
    // too (whether a queue is fair): enqueue first in a transaction left open, queue the
    // lock behind it, then commit. The lock is granted at that commit, before the
    // announcement wakes the worker, and a claim asking after it waits behind it anyway.
    let mut enqueuing = pool.begin().await.unwrap();
    let short = enqueue_n(&mut *enqueuing, "record", json!({}), 20, once).await;
    let mut claim_lock = pool.begin().await.unwrap();
    let lock = sqlx::query("LOCK TABLE skiplock.queues IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *claim_lock);
    let enqueue_commits = async {
        wait_until(
            "the claim lock to queue behind the enqueue",
            PATIENCE,
            || waiting_on_lock(false, "LOCK TABLE skiplock.queues", None),
        )
        .await;
        enqueuing.commit().await.unwrap();
    };
    let (locked, ()) = tokio::join!(lock, enqueue_commits);
    locked.unwrap();
    let enqueued: DateTime<Utc> =
        sqlx::query_scalar("SELECT max(scheduled_at) FROM skiplock.jobs WHERE id = ANY($1)")
            .bind(&short)
            .fetch_one(pool)
            .await
            .unwrap();
    // The claim that will take them: one begun after they were due.
    wait_until("the short jobs' claim to wait", PATIENCE, || {
        waiting_on_lock(true, "claim_batch", Some(enqueued))
    })
    .await;
    // The block job records its run and blocks the runtime's only thread.
    runs_lock.commit().await.unwrap();
    wait_until("the block job to record its run", PATIENCE, || async {
        runs_by_job(pool).await.contains_key(&block).then_some(())
    })
    .await;
    wait_until("the block job to block its thread", PATIENCE, || async {
        a_thread_sleeps(worker.pid()).then_some(())
    })
    .await;
    claim_lock.commit().await.unwrap();
    // The claim stamps its first heartbeat when it takes the rows, after the lock is let
    // go: from this moment on, only the heartbeat of claims in flight keeps them fresh.
    let let_go: f64 = sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(pool)
        .await
        .unwrap();
    wait_until("the short jobs' claim to commit", PATIENCE, || async {
        let running: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM skiplock.jobs WHERE id = ANY($1) AND state = 'running'",
        )
        .bind(&short)
        .fetch_one(pool)
        .await
        .unwrap();
        (running > 0).then_some(())
    })
    .await;
    // Past the stale timeout since that claim, with the thread still blocked.
    wait_until("the stale timeout to pass", PATIENCE, || async {
        let (since_ms, running): (f64, i64) = sqlx::query_as(
            "SELECT ((extract(epoch FROM clock_timestamp()) - $2) * 1000)::float8,
                    (SELECT count(*) FROM skiplock.jobs WHERE id = ANY($1) AND state = 'running')",
        )
        .bind(&short)
        .bind(let_go)
        .fetch_one(pool)
        .await
        .unwrap();
        assert!(
            running > 0,
            "the short jobs ran while the thread was blocked"
        );
        (since_ms > (STALE_MS + 200) as f64).then_some(())
    })
    .await;
    let reaped = skiplock::db::maintenance::jobs_reap_stale(pool, STALE_MS, 1_000)
        .await
        .unwrap();
    let block_row = skiplock::job(pool, JobId(block)).await.unwrap().unwrap();
    assert!(
        block_row.finished_at.is_none(),
        "the thread was still blocked when the reaper ran: {block_row:?}"
    );
    assert!(
        reaped.is_empty(),
        "the stranded claim's jobs were reaped: {reaped:?}\nthe worker's log:\n{}",
        worker.log_text()
    );

    // On a timeout, what was left and what the worker said (a CI run on 68833ce timed out
    // here once, with no more to go on).
    let all_succeeded = tokio::time::timeout(PATIENCE, async {
        while states(pool).await.get("succeeded") != Some(&21) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    if all_succeeded.is_err() {
        let left: Vec<(i64, String, i32, Option<String>)> = sqlx::query_as(
            "SELECT id, state::text, attempt, claimed_by FROM skiplock.jobs
             WHERE state <> 'succeeded' ORDER BY id",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        let trail: Vec<String> = audit(pool)
            .await
            .iter()
            .filter(|row| left.iter().any(|(id, ..)| *id == row.job_id))
            .map(|row| format!("{row:?}"))
            .collect();
        panic!(
            "timed out after {PATIENCE:?} waiting for every job to succeed; left (id, state, \
             attempt, claimed_by): {left:?}\ntheir audit:\n{}\nthe worker's log:\n{}",
            trail.join("\n"),
            worker.log_text()
        );
    }
    drop(worker);
    let runs = runs_by_job(pool).await;
    for id in short.iter().chain([&block]) {
        assert_eq!(runs[id].len(), 1, "job {id} ran once");
    }
    check_claim_discipline(&audit(pool).await, false);
}

/// Whether a thread of process `pid` sleeps in `nanosleep`, as the `block` handler's
/// `std::thread::sleep` does (Linux's `/proc`; tokio's idle threads wait in `epoll` or on a
/// futex, never there).
fn a_thread_sleeps(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|task| {
        std::fs::read_to_string(task.path().join("wchan")).is_ok_and(|w| w.contains("nanosleep"))
    })
}
