//! Global limits of a queue (`skiplock.queues`: max_running, rate_limit per rate_period),
//! held by the claim in the database: several `skiplock-testbed` processes and a worker on
//! the SQL protocol share a limited queue, one process is killed and its claims reaped,
//! and the audit trigger's log of every change shows that no instant ran more than
//! max_running jobs and no window of rate_period started more than rate_limit. The
//! workers poll once an hour: a freed slot and a refilled window reach them as
//! notifications, or the drain does not finish.
#![cfg(feature = "testbed")]

mod common;
mod fault_support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::fixtures::{sql_claim, state_of, wait_for_a_lock_wait};
use fault_support::{
    AuditRow, PATIENCE, Testbed, TestbedArgs, age_claims_of, audit, audited_db,
    check_claim_discipline, enqueue_n, running_held_by, states, wait_until,
};
use serde_json::json;
use skiplock::{EnqueueOptions, JobState, QueueLimits};
use sqlx::PgPool;
use uuid::Uuid;

/// The most jobs of `queue` running at one moment in the audit log: claims count from
/// their row until the row that ends them (completion, failure, release, reap, cancel,
/// delete), counted between transactions in the order they committed
/// ([`fault_support::transactions`]). A claim of a limited queue counts the running jobs
/// after every earlier claim of the queue committed, and a job that ended before that
/// count has its transaction earlier in the log, so this order is the one the limit is
/// held in.
fn most_running(log: &[AuditRow], jobs: &[i64]) -> usize {
    let ours: std::collections::HashSet<i64> = jobs.iter().copied().collect();
    let (mut now, mut most) = (0usize, 0usize);
    for transaction in fault_support::transactions(log) {
        for row in transaction.iter().filter(|row| ours.contains(&row.job_id)) {
            let was = row.old_state.as_deref() == Some("running");
            let is = row.new_state.as_deref() == Some("running");
            match (was, is) {
                (false, true) => now += 1,
                (true, false) => now -= 1,
                _ => {}
            }
        }
        most = most.max(now);
    }
    assert_eq!(now, 0, "every claim of the log ended");
    most
}

/// A worker on the SQL protocol, as a Python or Node worker drives it: claims up to 4
/// jobs of `queue`, holds each for `hold`, completes them, and polls every 20 ms when it
/// claimed nothing. Returns how many jobs it completed when `stop` is set.
fn sql_worker(
    pool: PgPool,
    queue: &'static str,
    hold: Duration,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut done = 0;
        while !stop.load(Ordering::Relaxed) {
            let claimed = sql_claim(&pool, queue, 4, "sql-worker").await;
            if claimed.is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            tokio::time::sleep(hold).await;
            for (id, token) in claimed {
                let held: bool = sqlx::query_scalar("SELECT skiplock.complete($1, $2)")
                    .bind(id)
                    .bind(token)
                    .fetch_one(&pool)
                    .await
                    .expect("complete on the SQL protocol");
                assert!(held, "the SQL worker's claim of job {id} was held");
                done += 1;
            }
        }
        done
    })
}

/// Drains `queue` (`total` jobs of kind `record`) with four testbed processes of 8 slots
/// and a SQL-protocol worker, all polling once an hour (so that only notifications wake
/// them); one process is killed (SIGKILL) while it holds jobs and its claims are reaped.
/// The victim is stopped (SIGSTOP) before it is checked for claims and killed, so that a
/// job cannot finish between the check and the kill ([`Testbed::kill9_holding`]); what it
/// held is counted once its sessions are gone, and in the rare case that nothing was left
/// (a completion read by the server after the check), another worker takes its place and
/// is killed in turn. Returns the audit log once every job succeeded and the others
/// stopped, checked for claim discipline and a reap.
///
/// The workers' stale timeout is a minute, and the victim's claims are made stale by hand
/// once it is dead ([`fault_support::age_claims_of`]), so that the live workers' reaper
/// takes them at its next pass. With a short stale timeout (it was 2 s), a pause of a
/// loaded machine got live claims reaped: the SQL worker's (it sends no heartbeat), whose
/// completion then found its claim gone.
///
/// The drain checks upper bounds (a limit never exceeded, across processes, a kill and a
/// reap); whether a limit is reached at all depends on how many jobs the machine runs at
/// once, so the tests show that with [`claim_all_at_once`] before the drain.
async fn drain_with_a_killed_worker(
    db: &common::TestDb,
    queue: &'static str,
    total: usize,
) -> Vec<AuditRow> {
    let pool = &db.pool;
    const STALE: Duration = Duration::from_secs(60);
    let args = |poll_ms: u64| {
        TestbedArgs::new()
            .set("kinds", "record")
            .set("queue", queue)
            .set("concurrency", 8)
            .set("heartbeat-ms", 200)
            .set("stale-ms", STALE.as_millis())
            .set("poll-ms", poll_ms)
    };
    // The victim polls often: alone, it would otherwise wait for a notice (a rate window's
    // refill) that came before it listened. The others poll once an hour.
    let (victim_args, args) = (args(100), args(3_600_000));
    // The victim runs alone until it is killed holding claims: beside the others it may
    // get no job before the queue drains (a loaded run waited 90 s for it to hold one).
    // Its claims count against the limits while the others drain, until they reap them.
    let mut victim = Testbed::start(&db.url, &format!("tb-{queue}-0"), &victim_args).await;
    for attempt in 0.. {
        assert!(attempt < 10, "no killed worker held a claim");
        if victim.kill9_holding(pool).await > 0 {
            age_claims_of(pool, &victim.worker_id, STALE).await;
            break;
        }
        victim = Testbed::start(&db.url, &format!("tb-{queue}-0-{attempt}"), &victim_args).await;
    }
    let mut workers = vec![victim];
    for i in 1..4 {
        workers.push(Testbed::start(&db.url, &format!("tb-{queue}-{i}"), &args).await);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let sql = sql_worker(pool.clone(), queue, Duration::from_millis(40), stop.clone());
    wait_until("every job to succeed", PATIENCE, || async {
        (states(pool).await.get("succeeded").copied() == Some(total as i64)).then_some(())
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let by_sql = sql.await.unwrap();
    for worker in &mut workers[1..] {
        worker.signal("TERM");
        assert!(worker.wait_exit(PATIENCE).await.success());
    }
    assert_eq!(
        states(pool).await,
        HashMap::from([("succeeded".to_owned(), total as i64)])
    );
    let log = audit(pool).await;
    check_claim_discipline(&log, false);
    assert!(
        log.iter().any(AuditRow::is_reap),
        "the killed worker's claims were reaped"
    );
    eprintln!("the SQL worker completed {by_sql} jobs");
    log
}

/// Claims every queued job of `queue` that one claim may take under the queue's limits (a
/// SQL-protocol claim of up to `n`, before any worker runs), completes them, and returns
/// the ids it took. That a limit is reached, and not just never exceeded, is shown here
/// deterministically, whatever the machine's speed: in a drain it depends on how many jobs
/// the workers get to run at once.
async fn claim_all_at_once(pool: &PgPool, queue: &str, n: i32) -> Vec<i64> {
    let claimed = sql_claim(pool, queue, n, "one-claim").await;
    for (id, token) in &claimed {
        let held: bool = sqlx::query_scalar("SELECT skiplock.complete($1, $2)")
            .bind(id)
            .bind(token)
            .fetch_one(pool)
            .await
            .expect("complete");
        assert!(held, "job {id} was completed by its claim");
    }
    claimed.into_iter().map(|(id, _)| id).collect()
}

/// Workload: 120 `record` jobs of 40 ms in a queue with max_running 3: one claim of all
/// of them before any worker runs, then a drain by four testbed processes of 8 slots each
/// and a SQL-protocol worker; one process is killed (SIGKILL) while it holds jobs and its
/// claims are reaped.
///
/// Invariant: the one claim takes exactly 3; every job succeeds; at no point of the audit
/// log do more than 3 jobs run (the killed worker's count until reaped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_running_holds_across_processes_sql_workers_and_a_killed_worker() {
    const JOBS: usize = 120;
    const LIMIT: u32 = 3;
    let db = audited_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(pool, "exports", QueueLimits::default().max_running(LIMIT))
        .await
        .unwrap();
    let jobs = enqueue_n(
        pool,
        "record",
        json!({"ms": 40}),
        JOBS,
        EnqueueOptions::new().queue("exports"),
    )
    .await;

    assert_eq!(
        claim_all_at_once(pool, "exports", JOBS as i32).await.len(),
        LIMIT as usize,
        "one claim takes up to max_running"
    );
    let log = drain_with_a_killed_worker(&db, "exports", JOBS).await;
    assert_eq!(
        most_running(&log, &jobs),
        LIMIT as usize,
        "at most max_running jobs ran at once (and the claim before the drain ran that many)"
    );
}

/// Workload: 60 `record` jobs of 40 ms in a queue with a rate limit of 15 per second: one
/// claim of all of them before any worker runs, then a drain by four testbed processes of
/// 8 slots and a SQL-protocol worker; one process is killed (SIGKILL) while it holds jobs
/// and its claims are reaped (a reaped job's second claim is a start too).
///
/// Invariant: the one claim takes exactly 15; every job succeeds, and no window of one
/// second holds more than 15 starts (the claims' `claimed_at`, the time each claim took
/// its starts at).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_holds_in_every_window_across_processes_sql_workers_and_a_killed_worker() {
    const JOBS: usize = 60;
    const LIMIT: usize = 15;
    let period = chrono::Duration::seconds(1);
    let db = audited_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(
        pool,
        "mail",
        QueueLimits::default().rate(LIMIT as u32, Duration::from_secs(1)),
    )
    .await
    .unwrap();
    enqueue_n(
        pool,
        "record",
        json!({"ms": 40}),
        JOBS,
        EnqueueOptions::new().queue("mail"),
    )
    .await;

    assert_eq!(
        claim_all_at_once(pool, "mail", JOBS as i32).await.len(),
        LIMIT,
        "one claim takes as many starts as the window has"
    );
    let log = drain_with_a_killed_worker(&db, "mail", JOBS).await;
    let mut starts: Vec<_> = log
        .iter()
        .filter(|row| row.is_claim())
        .map(|row| row.claimed_at.expect("a claim has claimed_at"))
        .collect();
    starts.sort();
    assert!(starts.len() > JOBS, "a reaped job started again");
    for (first, later) in starts.iter().zip(&starts[LIMIT..]) {
        assert!(
            *later - *first > period,
            "{} starts within one second: from {first} to {later}",
            LIMIT + 1
        );
    }
    assert!(
        starts
            .iter()
            .zip(&starts[LIMIT - 1..])
            .any(|(first, last)| *last - *first <= period),
        "the limit was reached: {LIMIT} starts within some second (by the claim before the \
         drain)"
    );
}

/// Claims up to `n` jobs of `queue` on the SQL protocol as worker `w`; returns their ids.
async fn claim(pool: &PgPool, queue: &str, n: i32) -> Vec<i64> {
    let claimed = sql_claim(pool, queue, n, "w").await;
    claimed.into_iter().map(|(id, _)| id).collect()
}

async fn queue_jobs(pool: &PgPool, queue: &str, n: usize) -> Vec<i64> {
    enqueue_n(
        pool,
        "noop",
        json!({}),
        n,
        EnqueueOptions::new().queue(queue),
    )
    .await
}

/// A limit written as plain SQL holds like one set through the API; lowering it stops
/// claims until the queue is under it, raising or removing it lets them go on, and
/// nothing enqueued is lost or stranded on the way.
#[tokio::test]
async fn limits_written_as_plain_sql_hold_and_changing_them_strands_nothing() {
    let db = common::test_db().await;
    let pool = &db.pool;
    let jobs = queue_jobs(pool, "q", 12).await;
    sqlx::query(
        "INSERT INTO skiplock.queues (name, max_running) VALUES ('q', 4)
         ON CONFLICT (name) DO UPDATE SET max_running = excluded.max_running",
    )
    .execute(pool)
    .await
    .unwrap();
    let set_max_running = |value: Option<i32>| {
        sqlx::query("UPDATE skiplock.queues SET max_running = $1 WHERE name = 'q'")
            .bind(value)
            .execute(pool)
    };
    assert_eq!(claim(pool, "q", 10).await.len(), 4);
    assert_eq!(claim(pool, "q", 10).await.len(), 0, "the limit is reached");
    for (max_running, claimed, why) in [
        (Some(2), 0, "4 run, over the lowered limit"),
        (Some(6), 2, "raised: room for 2 more"),
        (None, 6, "removed: the rest"),
    ] {
        set_max_running(max_running).await.unwrap();
        assert_eq!(claim(pool, "q", 10).await.len(), claimed, "{why}");
    }
    let running: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs WHERE id = ANY($1) AND state = 'running'",
    )
    .bind(&jobs)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(running, 12, "every job was claimed once, none lost");
}

/// Zero, negative or half-given limits are refused with a message naming the column and
/// what to write; the queue's row keeps what it had.
#[tokio::test]
async fn bad_limits_are_refused_with_what_to_write_and_change_nothing() {
    let db = common::test_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(pool, "q", QueueLimits::default().max_running(2))
        .await
        .unwrap();
    for (call, needle) in [
        (
            "SELECT skiplock.set_queue_limits('q', 0)",
            "max_running is 0, it must be at least 1",
        ),
        (
            "SELECT skiplock.set_queue_limits('q', -3)",
            "max_running is -3",
        ),
        (
            "SELECT skiplock.set_queue_limits('q', NULL, 10)",
            "rate_limit and rate_period go together",
        ),
        (
            "SELECT skiplock.set_queue_limits('q', NULL, 0, '1 second')",
            "rate_limit is 0",
        ),
        (
            "SELECT skiplock.set_queue_limits('q', NULL, 100001, '1 second')",
            "between 1 and 100000",
        ),
        (
            "SELECT skiplock.set_queue_limits('q', NULL, 10, '0 seconds')",
            "rate_period is 00:00:00, it must be longer than zero",
        ),
        (
            "SELECT skiplock.set_queue_limits('', 1)",
            "a queue name cannot be empty",
        ),
        (
            "UPDATE skiplock.queues SET max_running = 0",
            "queues_max_running_at_least_1",
        ),
        (
            "UPDATE skiplock.queues SET rate_limit = 5",
            "queues_rate_limit_and_period_together",
        ),
        (
            "UPDATE skiplock.queues SET rate_limit = 5, rate_period = '-1 s'",
            "queues_rate_period_positive",
        ),
        (
            "SELECT skiplock.set_queue_limits('q', NULL, key_rate_limit => 5)",
            "key_rate_limit and key_rate_period go together",
        ),
        (
            "SELECT skiplock.set_queue_limits('q', NULL, key_rate_limit => 0, key_rate_period => '1 minute')",
            "key_rate_limit is 0, it must be between 1 and 100000",
        ),
        (
            "SELECT skiplock.set_queue_limits('q', NULL, key_rate_limit => 100001, key_rate_period => '1 minute')",
            "between 1 and 100000",
        ),
        (
            "SELECT skiplock.set_queue_limits('q', NULL, key_rate_limit => 5, key_rate_period => '0 seconds')",
            "key_rate_period is 00:00:00, it must be longer than zero",
        ),
        (
            "UPDATE skiplock.queues SET key_rate_limit = 5",
            "queues_key_rate_limit_and_period_together",
        ),
        (
            "UPDATE skiplock.queues SET key_rate_limit = 0, key_rate_period = '1 s'",
            "queues_key_rate_limit_1_to_100000",
        ),
    ] {
        let error = sqlx::query(call)
            .execute(pool)
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains(needle), "{call}: {error}");
    }
    let error =
        skiplock::set_queue_limits(pool, "q", QueueLimits::default().rate(5, Duration::ZERO))
            .await
            .unwrap_err()
            .to_string();
    assert!(error.contains("period must be from 1 µs"), "{error}");
    let error = skiplock::set_queue_limits(
        pool,
        "q",
        QueueLimits::default()
            .key_rate(skiplock::RATE_LIMIT_MAX_STARTS + 1, Duration::from_secs(1)),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("a per-key rate limit of 100001 starts"),
        "{error}"
    );
    let limits = skiplock::queue_limits(pool).await.unwrap();
    assert_eq!(limits.len(), 1);
    assert_eq!(limits[0].limits, QueueLimits::default().max_running(2));
}

/// A claim of a limited queue in REPEATABLE READ or SERIALIZABLE is refused (its snapshot
/// could miss claims committed after it and claim past the limit), with the way out; the
/// same claim of a queue without limits works there.
#[tokio::test]
async fn a_claim_of_a_limited_queue_outside_read_committed_is_refused_with_the_way_out() {
    let db = common::test_db().await;
    let pool = &db.pool;
    queue_jobs(pool, "limited", 2).await;
    queue_jobs(pool, "free", 2).await;
    skiplock::set_queue_limits(pool, "limited", QueueLimits::default().max_running(5))
        .await
        .unwrap();
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SET TRANSACTION ISOLATION LEVEL {level}"
        )))
        .execute(&mut *tx)
        .await
        .unwrap();
        let error = sqlx::query("SELECT * FROM skiplock.claim('limited', 1, 'w')")
            .execute(&mut *tx)
            .await
            .unwrap_err();
        let sqlx::Error::Database(error) = error else {
            panic!("a database error")
        };
        assert_eq!(error.code().as_deref(), Some("25000"));
        assert!(
            error.message().contains("queue limited has a global limit")
                && error.message().contains(level),
            "{}",
            error.message()
        );
        tx.rollback().await.unwrap();
        let mut tx = pool.begin().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SET TRANSACTION ISOLATION LEVEL {level}"
        )))
        .execute(&mut *tx)
        .await
        .unwrap();
        let free: Vec<i64> = sqlx::query_scalar("SELECT id FROM skiplock.claim('free', 1, 'w')")
            .fetch_all(&mut *tx)
            .await
            .unwrap();
        assert_eq!(free.len(), 1);
        tx.rollback().await.unwrap();
    }
}

/// The rate limit keeps the newest starts when it changes: a limit lowered below the
/// starts of the period claims nothing until they age, one raised claims only the
/// difference; claimed_at of a limited claim is the time the limit was checked at.
#[tokio::test]
async fn a_changed_rate_limit_keeps_counting_the_starts_already_made() {
    let db = common::test_db().await;
    let pool = &db.pool;
    queue_jobs(pool, "r", 20).await;
    let hour = Duration::from_secs(3600);
    let set = |n| skiplock::set_queue_limits(pool, "r", QueueLimits::default().rate(n, hour));
    set(5).await.unwrap();
    assert_eq!(claim(pool, "r", 10).await.len(), 5);
    assert_eq!(claim(pool, "r", 10).await.len(), 0, "5 starts in the hour");
    set(3).await.unwrap();
    assert_eq!(
        claim(pool, "r", 10).await.len(),
        0,
        "lowered: 5 starts, more than 3"
    );
    set(8).await.unwrap();
    assert_eq!(claim(pool, "r", 10).await.len(), 3, "raised to 8: 3 more");
    set(8).await.unwrap();
    assert_eq!(claim(pool, "r", 10).await.len(), 0, "8 starts in the hour");
    let status = skiplock::queue_limits(pool).await.unwrap();
    assert_eq!(status[0].started_in_period, 8);
    assert_eq!(status[0].held_back, 12);
    assert_eq!(status[0].holding_back, Some(skiplock::LimitKind::Rate));
    let why: String = sqlx::query_scalar(
        "SELECT skiplock.why_not_running(min(id)) FROM skiplock.jobs WHERE state = 'queued'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(why.contains("held back by the queue's rate limit"), "{why}");
}

/// Sets `queue`'s limits, replacing those it had.
async fn limit(pool: &PgPool, queue: &str, limits: QueueLimits) {
    skiplock::set_queue_limits(pool, queue, limits)
        .await
        .unwrap();
}

/// One pass of the sweep of waiting jobs, which also forgets the rate windows that count
/// nothing any more.
async fn sweep_waiting(pool: &PgPool) {
    sqlx::query("SELECT skiplock.internal_settle_waiting()")
        .execute(pool)
        .await
        .unwrap();
}

/// The rate windows kept, as (queue, concurrency_key), in that order; the queue's own with
/// the key ''.
async fn rate_windows(pool: &PgPool) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT queue, concurrency_key FROM skiplock.rate_windows ORDER BY queue, concurrency_key",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// `n` `noop` jobs of key `a` in queue `k`.
async fn key_a_jobs(pool: &PgPool, n: usize) {
    enqueue_n(
        pool,
        "noop",
        json!({}),
        n,
        EnqueueOptions::new().queue("k").concurrency_key("a"),
    )
    .await;
}

/// When the window of key `a` in queue `k` has room again, while it holds the key's jobs
/// back (NULL otherwise).
async fn held_until_of_a(pool: &PgPool) -> Option<chrono::DateTime<chrono::Utc>> {
    sqlx::query_scalar(
        "SELECT held_until FROM skiplock.rate_windows WHERE queue = 'k' AND concurrency_key = 'a'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// One store and one rule for every rate window: the queue's own and each key's are
/// forgotten by the sweep only a whole period after their newest start, by the period the
/// queue has now. A period lengthened after the starts keeps counting them (a window
/// forgotten by the old period would let a second start go within the hour).
#[tokio::test]
async fn a_rate_window_is_forgotten_a_whole_period_after_its_newest_start_by_its_period_now() {
    let db = common::test_db().await;
    let pool = &db.pool;
    queue_jobs(pool, "r", 3).await;
    key_a_jobs(pool, 3).await;
    let micro = Duration::from_micros(1);
    let hour = Duration::from_secs(3600);
    limit(pool, "r", QueueLimits::default().rate(1, micro)).await;
    limit(pool, "k", QueueLimits::default().key_rate(1, micro)).await;
    assert_eq!(claim(pool, "r", 10).await.len(), 1);
    assert_eq!(claim(pool, "k", 10).await.len(), 1);
    limit(pool, "r", QueueLimits::default().rate(1, hour)).await;
    limit(pool, "k", QueueLimits::default().key_rate(1, hour)).await;
    sweep_waiting(pool).await;
    let windows = rate_windows(pool).await;
    assert_eq!(
        windows,
        [
            ("k".to_owned(), "a".to_owned()),
            ("r".to_owned(), String::new())
        ],
        "both windows kept: their newest start is not an hour old"
    );
    assert_eq!(claim(pool, "r", 10).await.len(), 0, "1 start in the hour");
    assert_eq!(
        claim(pool, "k", 10).await.len(),
        0,
        "1 start of a in the hour"
    );

    // Back to a microsecond: the claims take the rest, one start a microsecond, and once
    // no claim starts a job the sweep forgets both windows.
    limit(pool, "r", QueueLimits::default().rate(1, micro)).await;
    limit(pool, "k", QueueLimits::default().key_rate(1, micro)).await;
    wait_until(
        "the claims to drain and the sweep to forget both windows",
        PATIENCE,
        || async {
            claim(pool, "r", 10).await;
            claim(pool, "k", 10).await;
            sweep_waiting(pool).await;
            rate_windows(pool).await.is_empty().then_some(())
        },
    )
    .await;
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM skiplock.jobs WHERE state <> 'running'")
            .fetch_one(pool)
            .await
            .unwrap(),
        0,
        "every job claimed once"
    );
}

/// A window the sweep deletes (it counts nothing any more) while a claim takes starts of
/// it: the claim waits for the delete and makes the window again, instead of failing on
/// starts that refer to no window.
#[tokio::test]
async fn a_claim_taking_starts_of_a_window_the_sweep_deletes_meanwhile_makes_it_again() {
    let db = common::test_db().await;
    let pool = &db.pool;
    queue_jobs(pool, "r", 5).await;
    limit(
        pool,
        "r",
        QueueLimits::default().rate(3, Duration::from_secs(3600)),
    )
    .await;
    assert_eq!(claim(pool, "r", 1).await.len(), 1);
    // The sweep's delete, held open (as the sweep deletes a window a period old).
    let mut sweep = pool.begin().await.unwrap();
    sqlx::query("DELETE FROM skiplock.rate_windows WHERE queue = 'r'")
        .execute(&mut *sweep)
        .await
        .unwrap();
    let claiming = tokio::spawn({
        let pool = pool.clone();
        async move { claim(&pool, "r", 10).await }
    });
    wait_for_a_lock_wait(pool, "the claim to wait for the delete").await;
    sweep.commit().await.unwrap();
    assert_eq!(
        claiming.await.unwrap().len(),
        2,
        "the room read before the delete"
    );
    let starts: i64 =
        sqlx::query_scalar("SELECT count(*) FROM skiplock.rate_window_starts WHERE queue = 'r'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(starts, 2, "the window made again with the claim's starts");
}

/// The sweep keeps every window of a queue whose turn a claim holds, however old: that
/// claim may have taken its time before the window expired and read the window as it was,
/// so a window forgotten under it would let a second start go within the period.
#[tokio::test]
async fn the_sweep_keeps_the_windows_of_a_queue_whose_turn_a_claim_holds() {
    let db = common::test_db().await;
    let pool = &db.pool;
    queue_jobs(pool, "r", 2).await;
    limit(
        pool,
        "r",
        QueueLimits::default().rate(1, Duration::from_micros(1)),
    )
    .await;
    assert_eq!(claim(pool, "r", 1).await.len(), 1);
    // A claim in flight: the queue's turn held.
    let mut turn = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(skiplock.internal_queue_limit_lock_id('r'))")
        .execute(&mut *turn)
        .await
        .unwrap();
    sweep_waiting(pool).await;
    assert_eq!(
        rate_windows(pool).await.len(),
        1,
        "kept while a claim holds the turn"
    );
    turn.commit().await.unwrap();
    sweep_waiting(pool).await;
    assert!(
        rate_windows(pool).await.is_empty(),
        "forgotten once no claim holds it"
    );
}

/// A change of the queue's own rate_period leaves the keys' windows as they were: a key
/// whose window is full keeps when it has room again (reset to now, its held jobs were let
/// go by no claim, as its window was still full, and waited for the sweep).
#[tokio::test]
async fn a_change_of_the_queues_rate_period_keeps_when_a_keys_window_has_room() {
    let db = common::test_db().await;
    let pool = &db.pool;
    key_a_jobs(pool, 3).await;
    let hour = Duration::from_secs(3600);
    limit(
        pool,
        "k",
        QueueLimits::default().rate(100, hour).key_rate(1, hour),
    )
    .await;
    assert_eq!(claim(pool, "k", 10).await.len(), 1);
    let before = held_until_of_a(pool).await;
    assert!(before.is_some(), "a's window holds its jobs back");
    sqlx::query("UPDATE skiplock.queues SET rate_period = '2 hours' WHERE name = 'k'")
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(held_until_of_a(pool).await, before);
    assert_eq!(key_states(pool, "a").await.get("waiting"), Some(&2));
}

/// A key's rate limit changed while its window holds its jobs back and is still full by the
/// new limit: the window keeps when it refills by the new limit, so the claim after it
/// lets the jobs go. Reset to now, the next claim cleared the mark with nothing let go
/// (the window still full) and the jobs waited for the sweep.
#[tokio::test]
async fn a_key_limit_changed_while_its_window_is_full_keeps_when_it_refills() {
    let db = common::test_db().await;
    let pool = &db.pool;
    key_a_jobs(pool, 3).await;
    let hour = Duration::from_secs(3600);
    limit(pool, "k", QueueLimits::default().key_rate(1, hour)).await;
    assert_eq!(claim(pool, "k", 10).await.len(), 1);
    limit(pool, "k", QueueLimits::default().key_rate(1, 2 * hour)).await;
    assert!(
        claim(pool, "k", 10).await.is_empty(),
        "still full by the new limit"
    );
    let refill: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM w.held_until - j.claimed_at)::float8
         FROM skiplock.rate_windows w, skiplock.jobs j
         WHERE w.queue = 'k' AND w.concurrency_key = 'a' AND j.state = 'running'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let refill = refill.expect("the window keeps when it refills");
    assert!(
        (7199.0..7201.0).contains(&refill),
        "two hours after the start: {refill} s"
    );
    assert_eq!(key_states(pool, "a").await.get("waiting"), Some(&2));
}

/// A key's window that the claim filled while nothing of the key was left to hold keeps no
/// refill time, so that the sweep forgets it once it counts nothing, with no claim coming
/// to clear it (an idle queue kept such a window for good).
#[tokio::test]
async fn a_full_window_that_holds_nothing_back_is_forgotten_without_a_claim() {
    let db = common::test_db().await;
    let pool = &db.pool;
    key_a_jobs(pool, 1).await;
    limit(
        pool,
        "k",
        QueueLimits::default().key_rate(1, Duration::from_millis(1)),
    )
    .await;
    assert_eq!(
        claim(pool, "k", 10).await.len(),
        1,
        "the window is full after it"
    );
    let held_until = held_until_of_a(pool).await;
    assert_eq!(held_until, None, "nothing held back");
    wait_until("the sweep to forget the window", PATIENCE, || async {
        sweep_waiting(pool).await;
        rate_windows(pool).await.is_empty().then_some(())
    })
    .await;
}

/// A queue's row renamed takes its windows' starts from the jobs of its old name: they go
/// (the renamed row's limits hold for the jobs of its new name, from new windows), none
/// left behind under the old name.
#[tokio::test]
async fn a_renamed_queue_row_leaves_no_window_under_its_old_name() {
    let db = common::test_db().await;
    let pool = &db.pool;
    queue_jobs(pool, "r", 3).await;
    limit(
        pool,
        "r",
        QueueLimits::default().rate(1, Duration::from_secs(3600)),
    )
    .await;
    assert_eq!(claim(pool, "r", 10).await.len(), 1);
    sqlx::query("UPDATE skiplock.queues SET name = 'r2' WHERE name = 'r'")
        .execute(pool)
        .await
        .unwrap();
    assert!(
        rate_windows(pool)
            .await
            .iter()
            .all(|(queue, _)| queue != "r"),
        "none under the old name"
    );
    assert_eq!(claim(pool, "r", 10).await.len(), 2, "r has no limit now");
}

/// `skiplock show` says why a queued job waits under max_running, and a freed slot is
/// announced: a listener of skiplock_runnable hears the queue named when a running job
/// of a queue with max_running completes, and nothing for a queue without it.
#[tokio::test]
async fn a_freed_slot_of_a_limited_queue_is_announced() {
    let db = common::test_db().await;
    let pool = &db.pool;
    queue_jobs(pool, "limited", 2).await;
    queue_jobs(pool, "free", 1).await;
    skiplock::set_queue_limits(pool, "limited", QueueLimits::default().max_running(1))
        .await
        .unwrap();
    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener.listen("skiplock_runnable").await.unwrap();
    let claimed = sql_claim(pool, "limited", 5, "w").await;
    assert_eq!(claimed.len(), 1);
    let why: String = sqlx::query_scalar(
        "SELECT skiplock.why_not_running(id) FROM skiplock.jobs
         WHERE queue = 'limited' AND state = 'queued'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(
        why.contains("held back by the queue's max_running: 1 of queue 'limited'"),
        "{why}"
    );
    let free = sql_claim(pool, "free", 5, "w").await;
    for (id, token) in [free[0], claimed[0]] {
        sqlx::query("SELECT skiplock.complete($1, $2)")
            .bind(id)
            .bind(token)
            .execute(pool)
            .await
            .unwrap();
    }
    let heard = tokio::time::timeout(PATIENCE, listener.recv())
        .await
        .expect("a notification")
        .unwrap();
    assert_eq!(
        heard.payload(),
        "-\t-\tlimited",
        "the freed queue, from its start"
    );
}

/// Workload: 3 `record` jobs in a queue with max_running 1; the SQL protocol holds its one
/// slot while a testbed that polls once an hour finds no room and goes idle.
///
/// Invariant: once the SQL worker completes its job (and claims nothing more), the testbed
/// runs the other two: the freed slot reached it as a notification.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freed_slot_is_taken_by_an_idle_worker_of_another_process() {
    let db = audited_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(pool, "one", QueueLimits::default().max_running(1))
        .await
        .unwrap();
    enqueue_n(
        pool,
        "record",
        json!({"ms": 0}),
        3,
        EnqueueOptions::new().queue("one"),
    )
    .await;
    let held = sql_claim(pool, "one", 5, "sql-worker").await[0];
    // Stale after a minute: the SQL worker's claim sends no heartbeat, and with the
    // testbed's default 2 s a loaded machine let its reaper take the claim back and free
    // the slot, passing without the notification under test.
    let args = TestbedArgs::new()
        .set("kinds", "record")
        .set("queue", "one")
        .set("poll-ms", 3_600_000)
        .set("stale-ms", 60_000);
    let mut worker = Testbed::start(&db.url, "tb-idle", &args).await;
    // The testbed claims at start and finds no room: a session of it has run a claim
    // and is idle, and it holds nothing.
    wait_until("the testbed's first claim", PATIENCE, || async {
        let claimed: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT FROM pg_stat_activity
                            WHERE datname = current_database() AND application_name = 'tb-idle'
                              AND state = 'idle'
                              AND query LIKE '%internal_claim_batch%')",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        claimed.then_some(())
    })
    .await;
    assert_eq!(running_held_by(pool, "tb-idle").await, 0);
    sqlx::query("SELECT skiplock.complete($1, $2)")
        .bind(held.0)
        .bind(held.1)
        .execute(pool)
        .await
        .unwrap();
    wait_until("the testbed to run the other two", PATIENCE, || async {
        (states(pool).await.get("succeeded").copied() == Some(3)).then_some(())
    })
    .await;
    worker.signal("TERM");
    assert!(worker.wait_exit(PATIENCE).await.success());
}

/// Workload: 6 `record` jobs in a queue limited to 2 starts per 2 seconds, one testbed
/// that polls once an hour.
///
/// Invariant: all 6 run: each refill of the window reached the idle worker as a
/// notification of when it comes (skiplock_due_later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refilled_rate_window_is_taken_by_an_idle_worker() {
    let db = audited_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(
        pool,
        "paced",
        QueueLimits::default().rate(2, Duration::from_secs(2)),
    )
    .await
    .unwrap();
    enqueue_n(
        pool,
        "record",
        json!({"ms": 0}),
        6,
        EnqueueOptions::new().queue("paced"),
    )
    .await;
    let args = TestbedArgs::new()
        .set("kinds", "record")
        .set("queue", "paced")
        .set("poll-ms", 3_600_000);
    let mut worker = Testbed::start(&db.url, "tb-paced", &args).await;
    wait_until("every job to succeed", PATIENCE, || async {
        (states(pool).await.get("succeeded").copied() == Some(6)).then_some(())
    })
    .await;
    worker.signal("TERM");
    assert!(worker.wait_exit(PATIENCE).await.success());
}

/// The most jobs of each key running at one moment in the audit log (as [`most_running`],
/// per key).
fn most_running_per_key(
    log: &[AuditRow],
    keys: &HashMap<String, Vec<i64>>,
) -> HashMap<String, usize> {
    keys.iter()
        .map(|(key, jobs)| (key.clone(), most_running(log, jobs)))
        .collect()
}

/// Workload: in a queue with key_max_running 2, a hot key's 60 jobs enqueued first, then
/// two small keys' 15 each and 15 jobs without a key, all `record` jobs of 40 ms: one claim
/// of all of them before any worker runs, then a drain by four testbed processes of 8 slots
/// and a SQL-protocol worker; one process is killed while it holds jobs and its claims are
/// reaped.
///
/// Invariant: the one claim takes 2 of each key and every job without a key (the limit is
/// reached and binds per key only), holding the other jobs of the keys back; every job
/// succeeds; at no point of the audit log do more than 2 jobs of one key run (the killed
/// worker's count until reaped). The workers poll once an hour: the jobs a full key held
/// back reach them when a slot of the key frees, or the drain does not finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_max_running_holds_across_processes_sql_workers_and_a_killed_worker() {
    const KEY_LIMIT: u32 = 2;
    let db = audited_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(
        pool,
        "tenants",
        QueueLimits::default().key_max_running(KEY_LIMIT),
    )
    .await
    .unwrap();
    let mut keys: HashMap<String, Vec<i64>> = HashMap::new();
    for (key, count) in [("hot", 60), ("small-a", 15), ("small-b", 15)] {
        let ids = enqueue_n(
            pool,
            "record",
            json!({"ms": 40}),
            count,
            EnqueueOptions::new().queue("tenants").concurrency_key(key),
        )
        .await;
        keys.insert(key.to_owned(), ids);
    }
    let keyless = enqueue_n(
        pool,
        "record",
        json!({"ms": 40}),
        15,
        EnqueueOptions::new().queue("tenants"),
    )
    .await;
    let total = keys.values().map(Vec::len).sum::<usize>() + keyless.len();

    let first = claim_all_at_once(pool, "tenants", total as i32).await;
    let taken = |jobs: &[i64]| first.iter().filter(|id| jobs.contains(id)).count();
    for (key, jobs) in &keys {
        assert_eq!(
            taken(jobs),
            KEY_LIMIT as usize,
            "one claim takes up to key_max_running of key {key}"
        );
    }
    assert_eq!(
        taken(&keyless),
        keyless.len(),
        "one claim takes every job without a key"
    );
    let log = drain_with_a_killed_worker(&db, "tenants", total).await;
    assert!(
        log.iter()
            .any(|row| row.old_state.as_deref() == Some("queued")
                && row.new_state.as_deref() == Some("waiting")),
        "jobs of a full key were held back"
    );
    let most = most_running_per_key(&log, &keys);
    for (key, n) in &most {
        assert!(
            *n <= KEY_LIMIT as usize,
            "key {key}: {n} jobs ran at once, over key_max_running {KEY_LIMIT}"
        );
    }
    assert_eq!(
        most["hot"], KEY_LIMIT as usize,
        "the hot key reached its limit (in the claim before the drain)"
    );
    assert!(
        most_running(&log, &keyless) > KEY_LIMIT as usize,
        "jobs without a key are not held to key_max_running (in the claim before the drain)"
    );
}

/// The states of the jobs of `key` in queue `q`, counted.
async fn key_states(pool: &PgPool, key: &str) -> HashMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>(
        "SELECT state::text, count(*) FROM skiplock.jobs WHERE concurrency_key = $1 GROUP BY 1",
    )
    .bind(key)
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

/// Per-key concurrency on plain SQL alone: rows inserted with a concurrency_key, the limit
/// written on the queue's row. A claim takes no more of a key than its limit leaves and
/// holds the rest back (waiting, with a reason); a completion lets the next one go; a
/// raised limit lets more go, a removed one (or the queue's row deleted) all of them.
/// Nothing is lost or stranded on the way.
#[tokio::test]
async fn key_max_running_written_as_plain_sql_holds_and_changing_it_strands_nothing() {
    let db = common::test_db().await;
    let pool = &db.pool;
    sqlx::query("INSERT INTO skiplock.queues (name, key_max_running) VALUES ('q', 2)")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
         SELECT 'noop', 'q', 'a' FROM generate_series(1, 8)
         UNION ALL SELECT 'noop', 'q', 'b' FROM generate_series(1, 2)",
    )
    .execute(pool)
    .await
    .unwrap();
    let first = claim(pool, "q", 10).await;
    assert_eq!(first.len(), 4, "2 of a, 2 of b, in one claim: {first:?}");
    assert_eq!(
        key_states(pool, "a").await,
        HashMap::from([("running".to_owned(), 2), ("waiting".to_owned(), 6)])
    );
    let held: i64 = sqlx::query_scalar(
        "SELECT min(id) FROM skiplock.jobs WHERE concurrency_key = 'a' AND state = 'waiting'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let why: String = sqlx::query_scalar("SELECT skiplock.why_not_running($1)")
        .bind(held)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(
        why.contains("key_max_running") && why.contains("'a'"),
        "{why}"
    );
    assert!(claim(pool, "q", 10).await.is_empty(), "both keys are full");

    // A completion frees a slot: the next job of the key is queued, and claimed.
    let (id, token): (i64, Uuid) = sqlx::query_as(
        "SELECT id, claim_token FROM skiplock.jobs WHERE concurrency_key = 'a' AND state = 'running' LIMIT 1",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let completed = common::fixtures::sql_complete(pool, id, token).await;
    assert!(completed);
    assert_eq!(
        claim(pool, "q", 10).await,
        vec![held],
        "the oldest held job goes first"
    );

    // A raised limit, a removed one.
    sqlx::query("UPDATE skiplock.queues SET key_max_running = 4 WHERE name = 'q'")
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(
        claim(pool, "q", 10).await.len(),
        2,
        "raised to 4: room for 2 more of a"
    );
    sqlx::query("UPDATE skiplock.queues SET key_max_running = NULL WHERE name = 'q'")
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(
        key_states(pool, "a").await.get("waiting"),
        None,
        "removed: every held job is queued again"
    );
    assert_eq!(claim(pool, "q", 10).await.len(), 3, "the rest of a");
    assert_eq!(
        key_states(pool, "a").await,
        HashMap::from([("running".to_owned(), 7), ("succeeded".to_owned(), 1)]),
        "every job of a claimed once, none lost"
    );
}

/// A running job of a full key cancelled, or the queue's row deleted: held jobs go again.
/// A queued job of the key that no worker takes (a kind nobody handles) does not keep them
/// back: the freed slot goes to the oldest held job, and the claim takes the best of them.
#[tokio::test]
async fn held_jobs_go_when_a_running_job_is_cancelled_or_the_queue_row_is_deleted() {
    let db = common::test_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(pool, "q", QueueLimits::default().key_max_running(1))
        .await
        .unwrap();
    let ids = enqueue_n(
        pool,
        "noop",
        json!({}),
        4,
        EnqueueOptions::new().queue("q").concurrency_key("a"),
    )
    .await;
    assert_eq!(claim(pool, "q", 10).await, vec![ids[0]]);
    assert_eq!(
        key_states(pool, "a").await,
        HashMap::from([("running".to_owned(), 1), ("waiting".to_owned(), 3)])
    );
    // A queued job of the key of a kind no worker claims here.
    let unhandled: i64 = sqlx::query_scalar(
        "SELECT skiplock.enqueue('nobody_handles', queue => 'q', concurrency_key => 'a')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    // The running job cancelled: its slot goes to the next held job, at the next claim.
    let cancelled: bool = sqlx::query_scalar("SELECT skiplock.cancel_job($1)")
        .bind(ids[0])
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(cancelled);
    let noop_claim = |n: i32| {
        sqlx::query_scalar::<_, i64>("SELECT id FROM skiplock.claim('q', $1, 'w', ARRAY['noop'])")
            .bind(n)
            .fetch_all(pool)
    };
    assert_eq!(
        noop_claim(10).await.unwrap(),
        vec![ids[1]],
        "a cancelled running job frees its slot for the oldest held job, \
         whatever the unhandled queued one"
    );
    sqlx::query("DELETE FROM skiplock.queues WHERE name = 'q'")
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(
        noop_claim(10).await.unwrap(),
        vec![ids[2], ids[3]],
        "the queue's row deleted: no limit, the held jobs are queued"
    );
    assert_eq!(state_of(pool, unhandled).await, JobState::Queued);
}

/// The start times (`claimed_at` of the claims in the audit log) of each key's jobs,
/// sorted.
fn starts_per_key(
    log: &[AuditRow],
    keys: &HashMap<String, Vec<i64>>,
) -> HashMap<String, Vec<chrono::DateTime<chrono::Utc>>> {
    keys.iter()
        .map(|(key, jobs)| {
            let mut starts: Vec<_> = log
                .iter()
                .filter(|row| row.is_claim() && jobs.contains(&row.job_id))
                .map(|row| row.claimed_at.expect("a claim has claimed_at"))
                .collect();
            starts.sort();
            (key.clone(), starts)
        })
        .collect()
}

/// Workload: in a queue limited to 4 starts per key in any second, a hot key's 20 jobs
/// enqueued first, then two small keys' 6 each and 12 jobs without a key, all `record` jobs
/// of 40 ms: one claim of all of them before any worker runs, then a drain by four testbed
/// processes of 8 slots and a SQL-protocol worker; one process is killed while it holds
/// jobs and its claims are reaped (a reaped job's second claim is a start too).
///
/// Invariant: the one claim takes 4 of each key and every job without a key (the keys'
/// windows fill, and the rate binds per key only), holding the other jobs of the keys back;
/// every job succeeds; no window of one second holds more than 4 starts of one key. The
/// workers poll once an hour: a refilled window of a key reaches them as a notification of
/// when it comes, or the drain does not finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_key_rate_limit_holds_in_every_window_across_processes_and_a_killed_worker() {
    const KEY_RATE: usize = 4;
    let period = chrono::Duration::seconds(1);
    let db = audited_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(
        pool,
        "tenants",
        QueueLimits::default().key_rate(KEY_RATE as u32, Duration::from_secs(1)),
    )
    .await
    .unwrap();
    let mut keys: HashMap<String, Vec<i64>> = HashMap::new();
    for (key, count) in [("hot", 20), ("small-a", 6), ("small-b", 6)] {
        let ids = enqueue_n(
            pool,
            "record",
            json!({"ms": 40}),
            count,
            EnqueueOptions::new().queue("tenants").concurrency_key(key),
        )
        .await;
        keys.insert(key.to_owned(), ids);
    }
    let keyless = enqueue_n(
        pool,
        "record",
        json!({"ms": 40}),
        12,
        EnqueueOptions::new().queue("tenants"),
    )
    .await;
    let total = keys.values().map(Vec::len).sum::<usize>() + keyless.len();

    let first = claim_all_at_once(pool, "tenants", total as i32).await;
    let taken = |jobs: &[i64]| first.iter().filter(|id| jobs.contains(id)).count();
    for (key, jobs) in &keys {
        assert_eq!(
            taken(jobs),
            KEY_RATE,
            "one claim takes as many starts of key {key} as its window has"
        );
    }
    assert_eq!(
        taken(&keyless),
        keyless.len(),
        "one claim takes every job without a key"
    );
    let log = drain_with_a_killed_worker(&db, "tenants", total).await;
    assert!(
        log.iter()
            .any(|row| row.old_state.as_deref() == Some("queued")
                && row.new_state.as_deref() == Some("waiting")),
        "jobs of a key whose window was full were held back"
    );
    for (key, starts) in starts_per_key(&log, &keys) {
        for (first, later) in starts.iter().zip(&starts[KEY_RATE..]) {
            assert!(
                *later - *first > period,
                "key {key}: {} starts within one second, from {first} to {later}",
                KEY_RATE + 1
            );
        }
        if key == "hot" {
            assert!(
                starts
                    .iter()
                    .zip(&starts[KEY_RATE - 1..])
                    .any(|(first, last)| *last - *first <= period),
                "the hot key reached its limit: {KEY_RATE} starts within some second (in the \
                 claim before the drain)"
            );
        }
    }
    let keyless = starts_per_key(&log, &HashMap::from([("none".to_owned(), keyless)]));
    let keyless = &keyless["none"];
    assert!(
        keyless
            .iter()
            .zip(&keyless[KEY_RATE..])
            .any(|(first, later)| *later - *first <= period),
        "jobs without a key are not held to the per-key rate (in the claim before the drain)"
    );
}

/// A per-key rate limit on plain SQL alone: rows inserted with a concurrency_key, the limit
/// written on the queue's row. A claim takes no more of a key than its window allows and
/// holds the rest back (waiting, with a reason and the time it has room again); the claim
/// after the window refills lets as many go as it allows; a removed limit lets all of them
/// go and forgets the windows; the sweep forgets a window a period old. Nothing is lost or
/// stranded on the way.
#[tokio::test]
async fn a_per_key_rate_limit_written_as_plain_sql_holds_and_removing_it_strands_nothing() {
    let db = common::test_db().await;
    let pool = &db.pool;
    sqlx::query(
        "INSERT INTO skiplock.queues (name, key_rate_limit, key_rate_period)
         VALUES ('q', 2, '1 second')",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
         SELECT 'noop', 'q', 'a' FROM generate_series(1, 7)
         UNION ALL SELECT 'noop', 'q', 'b' FROM generate_series(1, 1)
         UNION ALL SELECT 'noop', 'q', NULL FROM generate_series(1, 3)",
    )
    .execute(pool)
    .await
    .unwrap();
    let first = claim(pool, "q", 20).await;
    assert_eq!(first.len(), 6, "2 of a, 1 of b, 3 without a key: {first:?}");
    assert_eq!(
        key_states(pool, "a").await,
        HashMap::from([("running".to_owned(), 2), ("waiting".to_owned(), 5)])
    );
    let held: i64 = sqlx::query_scalar(
        "SELECT min(id) FROM skiplock.jobs WHERE concurrency_key = 'a' AND state = 'waiting'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let why: String = sqlx::query_scalar("SELECT skiplock.why_not_running($1)")
        .bind(held)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(
        why.contains("key_rate_limit of 2") && why.contains("'a'") && why.contains("room"),
        "{why}"
    );
    let (keys_rate_limited, held_by_key): (Option<i64>, Option<i64>) = sqlx::query_as(
        "SELECT keys_rate_limited, held_by_key FROM skiplock.queue_limits WHERE queue = 'q'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((keys_rate_limited, held_by_key), (Some(1), Some(5)));
    assert!(
        claim(pool, "q", 20).await.is_empty(),
        "a's window is full, b has nothing left"
    );

    // When the window has room again, the next claim lets 2 go and takes them, the oldest
    // held first.
    let refilled = wait_until("a's window to have room again", PATIENCE, || async {
        let ids = claim(pool, "q", 20).await;
        (!ids.is_empty()).then_some(ids)
    })
    .await;
    assert_eq!(refilled.len(), 2, "the window allows 2: {refilled:?}");
    let running_a: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM skiplock.jobs WHERE concurrency_key = 'a' AND state = 'running' ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(running_a.len(), 4, "2 more of a after the refill");
    assert!(running_a.contains(&held), "the oldest held job went first");

    // The limit removed: every held job is queued again and the windows are forgotten.
    sqlx::query("UPDATE skiplock.queues SET key_rate_limit = NULL, key_rate_period = NULL")
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(key_states(pool, "a").await.get("waiting"), None);
    let windows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.rate_windows WHERE concurrency_key <> ''",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(windows, 0, "a removed limit keeps no window");
    assert_eq!(claim(pool, "q", 20).await.len(), 3, "the rest of a");
    assert_eq!(
        key_states(pool, "a").await,
        HashMap::from([("running".to_owned(), 7)]),
        "every job of a claimed once, none lost"
    );

    // A window a whole period old counts nothing: the sweep deletes it.
    sqlx::query("UPDATE skiplock.queues SET key_rate_limit = 5, key_rate_period = '1 second'")
        .execute(pool)
        .await
        .unwrap();
    enqueue_n(
        pool,
        "noop",
        json!({}),
        1,
        EnqueueOptions::new().queue("q").concurrency_key("c"),
    )
    .await;
    assert_eq!(claim(pool, "q", 20).await.len(), 1);
    wait_until("the sweep to forget c's window", PATIENCE, || async {
        sqlx::query("SELECT skiplock.internal_settle_waiting()")
            .execute(pool)
            .await
            .unwrap();
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM skiplock.rate_windows WHERE concurrency_key <> ''",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        (left == 0).then_some(())
    })
    .await;
}

/// Workload: 6 `record` jobs of one key in a queue limited to 2 starts per key in any 2
/// seconds, one testbed that polls, reaps and sweeps once an hour.
///
/// Invariant: all 6 run: the claim that filled the key's window held the rest back and
/// told the workers when it has room again (skiplock_due_later), and the claim then let
/// them go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refilled_key_window_is_taken_by_an_idle_worker() {
    let db = audited_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(
        pool,
        "paced",
        QueueLimits::default().key_rate(2, Duration::from_secs(2)),
    )
    .await
    .unwrap();
    enqueue_n(
        pool,
        "record",
        json!({"ms": 0}),
        6,
        EnqueueOptions::new().queue("paced").concurrency_key("a"),
    )
    .await;
    let args = TestbedArgs::new()
        .set("kinds", "record")
        .set("queue", "paced")
        .set("poll-ms", 3_600_000)
        .set("reap-ms", 3_600_000);
    let mut worker = Testbed::start(&db.url, "tb-paced-key", &args).await;
    wait_until("every job to succeed", PATIENCE, || async {
        (states(pool).await.get("succeeded").copied() == Some(6)).then_some(())
    })
    .await;
    worker.signal("TERM");
    assert!(worker.wait_exit(PATIENCE).await.success());
    let log = audit(pool).await;
    assert!(
        log.iter()
            .any(|row| row.old_state.as_deref() == Some("queued")
                && row.new_state.as_deref() == Some("waiting")),
        "the key's jobs were held back"
    );
}

/// Workload: a queue with key_max_running 1 and three queued jobs of one key; a session
/// removes the limit and, before it commits, a claim of three jobs starts and waits for the
/// queue's lock (which the change's trigger holds).
///
/// Invariant: the claim holds by the limits committed when it has the lock, not those it
/// read before: it takes all three, and holds none back (a claim that held them by the
/// removed limit would leave them waiting with nothing to let them go but the sweep).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waiting_for_the_lock_holds_by_the_limits_committed_meanwhile() {
    let db = common::test_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(pool, "q", QueueLimits::default().key_max_running(1))
        .await
        .unwrap();
    let ids = enqueue_n(
        pool,
        "noop",
        json!({}),
        3,
        EnqueueOptions::new().queue("q").concurrency_key("a"),
    )
    .await;
    let mut change = pool.begin().await.unwrap();
    sqlx::query("UPDATE skiplock.queues SET key_max_running = NULL WHERE name = 'q'")
        .execute(&mut *change)
        .await
        .unwrap();
    let claimer = {
        let pool = pool.clone();
        tokio::spawn(async move {
            sqlx::query_scalar::<_, i64>("SELECT id FROM skiplock.claim('q', 3, 'w') ORDER BY id")
                .fetch_all(&pool)
                .await
                .unwrap()
        })
    };
    wait_until(
        "the claim to wait for the queue's lock",
        PATIENCE,
        || async { (waiting_for_a_turn(pool, "skiplock.claim(").await == 1).then_some(()) },
    )
    .await;
    change.commit().await.unwrap();
    let claimed = claimer.await.unwrap();
    assert_eq!(
        claimed, ids,
        "the limit was gone when the claim had the lock"
    );
    assert_eq!(
        key_states(pool, "a").await,
        HashMap::from([("running".to_owned(), 3)]),
        "nothing held back"
    );
}

/// Workload: 6 `record` jobs of one key in a queue limited to 2 starts per key in any
/// second, one testbed that exits when idle.
///
/// Invariant: it exits only once all 6 succeeded: jobs held back by a per-key limit are
/// not idleness (they run when the key's window has room, with nothing written).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_exits_when_idle_waits_for_jobs_held_back_by_their_key() {
    let db = audited_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(
        pool,
        "paced",
        QueueLimits::default().key_rate(2, Duration::from_secs(1)),
    )
    .await
    .unwrap();
    enqueue_n(
        pool,
        "record",
        json!({"ms": 0}),
        6,
        EnqueueOptions::new().queue("paced").concurrency_key("a"),
    )
    .await;
    let args = TestbedArgs::new()
        .set("kinds", "record")
        .set("queue", "paced")
        .flag("exit-when-idle");
    let mut worker = Testbed::start(&db.url, "tb-idle-key", &args).await;
    assert!(worker.wait_exit(PATIENCE).await.success());
    assert_eq!(
        states(pool).await,
        HashMap::from([("succeeded".to_owned(), 6)]),
        "every job ran before the worker called itself idle"
    );
}

/// A job held back for its key has passed its parents; when the operator retries a parent
/// after the hold, the held job waits for that parent again (a queued sibling would run,
/// but a release is a new start): freeing the key's slot lets it go only once the parent
/// succeeded again, and it is marked held until then, never lost. The model test's sampler
/// met this state (a parent retried by `retry_job`) and must accept it.
#[tokio::test]
async fn a_held_job_whose_parent_is_retried_goes_once_the_parent_succeeds_again() {
    let db = common::test_db().await;
    let pool = &db.pool;
    sqlx::query("SELECT skiplock.set_queue_limits('keyed', NULL, key_max_running => 1)")
        .execute(pool)
        .await
        .unwrap();
    let parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop', queue => 'parents')")
        .fetch_one(pool)
        .await
        .unwrap();
    let child: i64 = sqlx::query_scalar(
        "SELECT skiplock.enqueue('noop', queue => 'keyed', concurrency_key => 'k',
                                 depends_on => ARRAY[$1::bigint])",
    )
    .bind(parent)
    .fetch_one(pool)
    .await
    .unwrap();
    let complete = |queue: &'static str| {
        sqlx::query(
            "SELECT skiplock.complete(id, claim_token) FROM skiplock.jobs
             WHERE queue = $1 AND state = 'running'",
        )
        .bind(queue)
        .execute(pool)
    };
    assert_eq!(claim(pool, "parents", 1).await, vec![parent]);
    complete("parents").await.unwrap();
    // A job of the key ahead of the child (a higher priority) runs; the claim holds the
    // child back.
    let first: i64 = sqlx::query_scalar(
        "SELECT skiplock.enqueue('noop', queue => 'keyed', concurrency_key => 'k', priority => -1)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(claim(pool, "keyed", 5).await, vec![first]);
    let held_for = |id: i64| {
        sqlx::query_as::<_, (String, Option<String>)>(
            "SELECT state::text, held_for FROM skiplock.jobs WHERE id = $1",
        )
        .bind(id)
        .fetch_one(pool)
    };
    assert_eq!(
        held_for(child).await.unwrap(),
        ("waiting".to_owned(), Some("key".to_owned()))
    );
    // The parent retried; the key's slot frees: the child stays held, waiting for it.
    let retried: bool = sqlx::query_scalar("SELECT skiplock.retry_job($1)")
        .bind(parent)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(retried);
    complete("keyed").await.unwrap();
    assert_eq!(claim(pool, "keyed", 5).await, Vec::<i64>::new());
    assert_eq!(
        held_for(child).await.unwrap(),
        ("waiting".to_owned(), Some("key".to_owned()))
    );
    // The parent succeeds again: the child is queued and runs.
    assert_eq!(claim(pool, "parents", 1).await, vec![parent]);
    complete("parents").await.unwrap();
    assert_eq!(claim(pool, "keyed", 5).await, vec![child]);
    assert_eq!(held_for(child).await.unwrap(), ("running".to_owned(), None));
}

/// The sessions of this database waiting for an advisory lock (a queue's turn or a claim
/// share) in a statement whose text contains `statement`.
async fn waiting_for_a_turn(pool: &PgPool, statement: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND wait_event = 'advisory' AND strpos(query, $1) > 0
           AND pid <> pg_backend_pid()",
    )
    .bind(statement)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A claim of up to `n` jobs of `queue` in a task of its own: `Ok` with how many it took
/// when it returned without waiting, `Err` with the task once it is seen waiting for an
/// advisory lock (a turn, or a share).
async fn claim_unless_it_waits(
    pool: &PgPool,
    queue: &'static str,
    n: i32,
) -> Result<usize, tokio::task::JoinHandle<usize>> {
    let task = {
        let pool = pool.clone();
        tokio::spawn(async move { claim(&pool, queue, n).await.len() })
    };
    let returned = wait_until("the claim to return or to wait", PATIENCE, || async {
        if task.is_finished() {
            return Some(true);
        }
        (waiting_for_a_turn(pool, "skiplock.claim(").await > 0).then_some(false)
    })
    .await;
    if returned {
        Ok(task.await.unwrap())
    } else {
        Err(task)
    }
}

/// How many jobs of queue `q` a claim of up to `n` takes in the transaction `tx`.
async fn claim_count_in(tx: &mut sqlx::PgConnection, n: i32) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM skiplock.claim('q', $1, 'open')")
        .bind(n)
        .fetch_one(tx)
        .await
        .unwrap()
}

/// Queue `q` with max_running 160 (a claim share's room: 10) and `jobs` queued jobs, and an
/// open transaction that claimed 10 of them under a claim share.
async fn an_open_claim_of_ten_sharing_160(
    pool: &PgPool,
    jobs: usize,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    skiplock::set_queue_limits(pool, "q", QueueLimits::default().max_running(160))
        .await
        .unwrap();
    queue_jobs(pool, "q", jobs).await;
    let mut open = pool.begin().await.unwrap();
    assert_eq!(claim_count_in(&mut open, 10).await, 10);
    open
}

/// Workload: a queue with max_running 160 (a claim share's room: 160 / 16 = 10) and 200
/// queued jobs; one transaction claims 10 and stays open.
///
/// Invariant: a claim of another session beside it returns at once (the two hold shares,
/// they do not take turns: on the code before claim shares it waited for the open
/// transaction); a claim asking more than a share's room waits for its turn, which
/// the open share holds back; a second claim of the open transaction takes what is left
/// of its share (nothing) instead of waiting for a turn it holds back itself; once more
/// than half the limit runs, a claim takes its turn even for one job; nothing ever runs
/// past 160.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_a_queue_far_from_its_max_running_share_it_without_taking_turns() {
    let db = common::test_db().await;
    let pool = &db.pool;
    let mut open = an_open_claim_of_ten_sharing_160(pool, 200).await;

    assert_eq!(
        claim_unless_it_waits(pool, "q", 10).await.ok(),
        Some(10),
        "a claim beside the open one shares the queue without waiting"
    );
    assert_eq!(
        claim_count_in(&mut open, 5).await,
        0,
        "the open transaction's second claim takes what is left of its share"
    );
    let Err(over_a_share) = claim_unless_it_waits(pool, "q", 11).await else {
        panic!("a claim asking more than a share's room took no turn");
    };
    open.commit().await.unwrap();
    assert_eq!(
        over_a_share.await.unwrap(),
        11,
        "its turn, once the share is given back"
    );

    // 31 running; shares until more than 160 - 8 * 10 = 80 run.
    for _ in 0..5 {
        assert_eq!(claim_unless_it_waits(pool, "q", 10).await.ok(), Some(10));
    }
    let mut turn = pool.begin().await.unwrap();
    assert_eq!(claim_count_in(&mut turn, 1).await, 1);
    let Err(behind) = claim_unless_it_waits(pool, "q", 1).await else {
        panic!("with 82 of 160 running a claim shared the queue");
    };
    turn.commit().await.unwrap();
    assert_eq!(behind.await.unwrap(), 1);
    assert_eq!(
        claim(pool, "q", 200).await.len(),
        160 - 83,
        "its turn takes what the limit leaves"
    );
}

/// Workload: 600 `noop` jobs in a queue with max_running 32 (a share's room: 2), taken by
/// 40 SQL-protocol claimers at once, each claiming 1 to 3 jobs (3: more than a share's
/// room, so some take turns), holding them 0 to 15 ms and completing them.
///
/// Invariant: one claim before them takes exactly 32; every job succeeds; at no point of
/// the audit log do more than 32 run, whatever mix of shares and turns the claims took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_running_holds_across_claims_that_share_it_and_take_turns() {
    const JOBS: usize = 600;
    const LIMIT: u32 = 32;
    let db = audited_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(pool, "shared", QueueLimits::default().max_running(LIMIT))
        .await
        .unwrap();
    let jobs = queue_jobs(pool, "shared", JOBS).await;
    assert_eq!(
        claim_all_at_once(pool, "shared", JOBS as i32).await.len(),
        LIMIT as usize,
        "one claim takes up to max_running"
    );
    let claimers: Vec<_> = (0..40)
        .map(|i| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(i);
                loop {
                    let claimed = sql_claim(&pool, "shared", rng.i32(1..=3), "sharer").await;
                    if claimed.is_empty() {
                        let left: bool = sqlx::query_scalar(
                            "SELECT EXISTS (SELECT FROM skiplock.jobs_live WHERE queue = 'shared')",
                        )
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                        if !left {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        continue;
                    }
                    tokio::time::sleep(Duration::from_millis(rng.u64(0..=15))).await;
                    for (id, token) in claimed {
                        let held: bool = sqlx::query_scalar("SELECT skiplock.complete($1, $2)")
                            .bind(id)
                            .bind(token)
                            .fetch_one(&pool)
                            .await
                            .expect("complete");
                        assert!(held, "job {id} was completed by its claim");
                    }
                }
            })
        })
        .collect();
    for claimer in claimers {
        claimer.await.unwrap();
    }
    assert_eq!(
        states(pool).await,
        HashMap::from([("succeeded".to_owned(), JOBS as i64)])
    );
    let log = audit(pool).await;
    check_claim_discipline(&log, false);
    let most = most_running(&log, &jobs);
    assert!(
        most <= LIMIT as usize,
        "{most} jobs ran at once, past max_running {LIMIT}"
    );
    assert_eq!(
        most, LIMIT as usize,
        "the claim before the drain ran 32 at once"
    );
}

/// Workload: a queue with max_running 160 and 100 queued jobs; one transaction claims 10
/// under a claim share and stays open; another lowers max_running to 16.
///
/// Invariant: the change waits for the open claim (its share was a share of 160, which a
/// claim after the change must not count on) and then holds: the next claim takes the 6
/// that 16 leaves beside the 10 running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_max_running_waits_for_the_claims_that_share_the_old_one() {
    let db = common::test_db().await;
    let pool = &db.pool;
    let open = an_open_claim_of_ten_sharing_160(pool, 100).await;
    let change = {
        let pool = pool.clone();
        tokio::spawn(async move {
            sqlx::query("UPDATE skiplock.queues SET max_running = 16 WHERE name = 'q'")
                .execute(&pool)
                .await
                .unwrap();
        })
    };
    wait_until(
        "the change to wait for the open claim",
        PATIENCE,
        || async {
            if change.is_finished() {
                panic!("max_running changed while a claim held a share of the old one");
            }
            (waiting_for_a_turn(pool, "SET max_running = 16").await == 1).then_some(())
        },
    )
    .await;
    open.commit().await.unwrap();
    change.await.unwrap();
    assert_eq!(
        claim(pool, "q", 100).await.len(),
        6,
        "16 less the 10 running"
    );
}

/// Waits until a session of this database waits for a queue's turn or a claim share in a
/// statement containing `statement`; fails if `task` ends first (it did not wait).
async fn wait_for_a_turn_of<T>(pool: &PgPool, statement: &str, task: &tokio::task::JoinHandle<T>) {
    wait_until(
        &format!("`{statement}` to wait for a turn"),
        PATIENCE,
        || async {
            assert!(
                !task.is_finished(),
                "`{statement}` did not wait for the claims in flight"
            );
            (waiting_for_a_turn(pool, statement).await == 1).then_some(())
        },
    )
    .await;
}

/// Runs `sql` on the pool in a task of its own.
fn execute_in_task(pool: &PgPool, sql: &'static str) -> tokio::task::JoinHandle<()> {
    let pool = pool.clone();
    tokio::spawn(async move {
        sqlx::query(sql).execute(&pool).await.unwrap();
    })
}

/// Workload: (1) a queue with only a rate limit, one transaction holding its turn with 100
/// jobs claimed, and a session that replaces the rate limit with max_running 160; (2) a
/// queue with max_running 160 and an open claim of 10 under a share, its row deleted and
/// written again with max_running 16.
///
/// Invariant: each write waits for the claim in flight (a claim after it that shared the
/// queue without counting the 100 or the 10 would run past the new limit: 181 of 160 and
/// 19 of 16 in a race review), and the limit then holds exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_written_over_claims_in_flight_waits_for_them() {
    let db = common::test_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(
        pool,
        "r",
        QueueLimits::default().rate(1000, Duration::from_secs(1)),
    )
    .await
    .unwrap();
    queue_jobs(pool, "r", 300).await;
    let mut turn = pool.begin().await.unwrap();
    let taken: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.claim('r', 100, 'turn')")
        .fetch_one(&mut *turn)
        .await
        .unwrap();
    assert_eq!(taken, 100);
    let change = execute_in_task(
        pool,
        "UPDATE skiplock.queues SET rate_limit = NULL, rate_period = NULL, max_running = 160
         WHERE name = 'r'",
    );
    wait_for_a_turn_of(pool, "max_running = 160", &change).await;
    turn.commit().await.unwrap();
    change.await.unwrap();
    assert_eq!(claim(pool, "r", 10).await.len(), 10, "a share");
    assert_eq!(
        claim(pool, "r", 300).await.len(),
        50,
        "160 less the 110 running"
    );

    let open = an_open_claim_of_ten_sharing_160(pool, 100).await;
    sqlx::query("DELETE FROM skiplock.queues WHERE name = 'q'")
        .execute(pool)
        .await
        .unwrap();
    let written = execute_in_task(
        pool,
        "INSERT INTO skiplock.queues (name, max_running) VALUES ('q', 16)",
    );
    wait_for_a_turn_of(pool, "max_running) VALUES ('q', 16)", &written).await;
    open.commit().await.unwrap();
    written.await.unwrap();
    assert_eq!(
        claim(pool, "q", 100).await.len(),
        6,
        "16 less the 10 running"
    );
}

/// Workload: a queue with max_running 160 (a share's room: 10) whose eight claim shares are
/// held by open claims; a ninth claim, in a transaction of its own, waits for a share; the
/// queue is paused, then the eight commit.
///
/// Invariant: the ninth finds the queue paused under its share, claims nothing and keeps no
/// lock (a share kept and not recorded made a later claim of its transaction wait for a
/// turn that waited for it: a deadlock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_finds_its_queue_paused_under_a_share_keeps_no_lock() {
    let db = common::test_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(pool, "q", QueueLimits::default().max_running(160))
        .await
        .unwrap();
    queue_jobs(pool, "q", 100).await;
    let mut holders = Vec::new();
    for _ in 0..8 {
        let mut holder = pool.begin().await.unwrap();
        assert_eq!(claim_count_in(&mut holder, 1).await, 1);
        holders.push(holder);
    }
    let mut ninth = pool.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *ninth)
        .await
        .unwrap();
    let ninth = tokio::spawn(async move {
        let taken = claim_count_in(&mut ninth, 1).await;
        (ninth, taken)
    });
    wait_for_a_turn_of(pool, "skiplock.claim(", &ninth).await;
    skiplock::pause_queue(pool, "q").await.unwrap();
    for holder in holders {
        holder.commit().await.unwrap();
    }
    let (ninth, taken) = ninth.await.unwrap();
    assert_eq!(taken, 0, "the queue is paused");
    // Shares and turns are taken exclusive; the lock every claim holds shared until it
    // commits (internal_queue_claims_lock_id) is not one of them.
    let locks: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks
         WHERE pid = $1 AND locktype = 'advisory' AND mode = 'ExclusiveLock'",
    )
    .bind(pid)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(locks, 0, "the share went back with the paused claim");
    ninth.rollback().await.unwrap();
}
