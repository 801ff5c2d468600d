//! Faults around the database: the reaper racing completions, the LISTEN connection
//! killed, randomized concurrent claimers, and enqueuing transactions that roll back, are
//! killed or fail to serialize. Each test asserts its invariant from the database.

mod common;
mod fault_support;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fixtures::{Record, Recorder, fast_worker, strings, wait_for};
use common::test_db;
use fault_support::{PATIENCE, audit, check_claim_discipline, install_audit, states, wait_until};
use futures_util::FutureExt;
use skiplock::db::jobs::{
    FailAction, FailBatch, jobs_claim_batch, jobs_complete_many, jobs_fail_many,
    jobs_heartbeat_many, jobs_release_many,
};
use skiplock::db::maintenance::jobs_reap_stale;
use skiplock::{EnqueueOptions, NewJob};
use sqlx::{Connection, PgPool};
use uuid::Uuid;

/// Workload: 30 rounds of 40 jobs; each round claims them all and ages their heartbeats
/// past the stale timeout.
///
/// Fault: at the same instant, from separate connections, the holder saves the outcomes
/// (completions in some rounds, failures in others, in random chunks) while two reapers
/// reap in small batches.
///
/// Invariant: every job is settled by exactly one side: the ids the holder's statements
/// returned and the ids the reapers returned are disjoint and cover the round; a job the
/// holder saved keeps its outcome (a finished job is never reset, a failure is not
/// overwritten by a reap) and a reaped one is `queued` with the reaper's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_and_a_completion_racing_settle_each_job_exactly_once() {
    let db = test_db().await;
    let pool = &db.pool;
    install_audit(pool).await;
    let (queue, kinds) = ("default", strings(&["race"]));
    let mut rng = fastrand::Rng::with_seed(3);
    let (mut saved_total, mut reaped_total) = (0, 0);
    for round in 0..30 {
        let jobs: Vec<NewJob> = (0..40)
            .map(|_| NewJob::new("race", serde_json::json!({})))
            .collect();
        skiplock::enqueue_raw(pool, &jobs).await.unwrap();
        let claimed = jobs_claim_batch(pool, queue, &kinds, 40, "holder")
            .await
            .unwrap();
        assert_eq!(claimed.len(), 40);
        sqlx::query(
            "UPDATE skiplock.jobs SET heartbeat_at = now() - interval '1 minute'
             WHERE state = 'running'",
        )
        .execute(pool)
        .await
        .unwrap();
        let mut held: Vec<(i64, Uuid)> = claimed.iter().map(|j| (j.id, j.claim_token)).collect();
        rng.shuffle(&mut held);
        let fail = round % 2 == 1;
        let chunk = rng.usize(1..=10);
        let barrier = Arc::new(tokio::sync::Barrier::new(3));

        let holder = {
            let (pool, barrier) = (pool.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let mut saved = Vec::new();
                for part in held.chunks(chunk) {
                    let (ids, tokens): (Vec<i64>, Vec<Uuid>) = part.iter().copied().unzip();
                    if fail {
                        let mut batch = FailBatch::default();
                        for (id, token) in part {
                            batch.push(*id, *token, "planned".into(), 60_000, FailAction::Retry);
                        }
                        saved.extend(jobs_fail_many(&pool, &batch).await.unwrap());
                    } else {
                        saved.extend(jobs_complete_many(&pool, &ids, &tokens).await.unwrap());
                    }
                }
                saved.into_iter().map(|s| s.id).collect::<Vec<_>>()
            })
        };
        let reaper = |limit: i64| {
            let (pool, barrier) = (pool.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let mut reaped = Vec::new();
                loop {
                    let batch = jobs_reap_stale(&pool, 1_000, limit).await.unwrap();
                    if batch.is_empty() {
                        return reaped;
                    }
                    reaped.extend(batch.into_iter().map(|r| r.id));
                }
            })
        };
        let (r1, r2) = (reaper(rng.i64(1..8)), reaper(rng.i64(1..8)));
        let saved = holder.await.unwrap();
        let mut reaped = r1.await.unwrap();
        reaped.extend(r2.await.unwrap());

        let saved_set: HashSet<i64> = saved.iter().copied().collect();
        let reaped_set: HashSet<i64> = reaped.iter().copied().collect();
        assert_eq!(saved_set.len() + reaped_set.len(), 40, "round {round}");
        assert!(saved_set.is_disjoint(&reaped_set), "round {round}");
        assert_eq!(reaped.len(), reaped_set.len(), "reaped once: round {round}");
        let rows: Vec<(i64, String, Option<String>)> = sqlx::query_as(
            "SELECT id, state::text, last_error FROM skiplock.jobs WHERE id = ANY($1)",
        )
        .bind(claimed.iter().map(|j| j.id).collect::<Vec<_>>())
        .fetch_all(pool)
        .await
        .unwrap();
        for (id, state, error) in rows {
            if saved_set.contains(&id) {
                let expected = if fail { "queued" } else { "succeeded" };
                assert_eq!(state, expected, "round {round}: job {id} kept its outcome");
                if fail {
                    assert_eq!(error.as_deref(), Some("planned"));
                }
            } else {
                assert_eq!(state, "queued", "round {round}: job {id}");
                assert!(error.unwrap().starts_with("no heartbeat from holder"));
            }
        }
        // Settle this round's retries so the next round starts clean.
        sqlx::query("UPDATE skiplock.jobs SET state = 'cancelled', finished_at = now() WHERE state = 'queued'")
            .execute(pool)
            .await
            .unwrap();
        saved_total += saved_set.len();
        reaped_total += reaped_set.len();
    }
    eprintln!("saved by the holder: {saved_total}, reaped: {reaped_total}");
    // Operator cancels above reopen nothing; every claim moved forward.
    check_claim_discipline(&audit(pool).await, false);
}

/// Where the worker's LISTEN connection is, if it has one.
async fn listener_pid(pool: &PgPool) -> Option<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity
         WHERE datname = current_database() AND query ILIKE 'LISTEN%'
           AND pid <> pg_backend_pid()
         ORDER BY backend_start DESC LIMIT 1",
    )
    .fetch_optional(pool)
    .await
    .unwrap()
}

async fn insert_record(pool: &PgPool, n: u32) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args) VALUES ('record', jsonb_build_object('n', $1::int))
         RETURNING id",
    )
    .bind(n as i32)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Workload: a worker polling every 100 ms, fed 100 jobs with plain SQL inserts.
///
/// Fault: for the whole run a second task kills every LISTEN connection of the database
/// as soon as it appears.
///
/// Invariant: work continues (by polling) and every job runs exactly once; once the
/// killing stops, the listener is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_continues_by_polling_while_the_listener_keeps_dying() {
    let db = test_db().await;
    let pool = &db.pool;
    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder).build().unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_until("the worker to LISTEN", PATIENCE, || listener_pid(pool)).await;
    let killing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let kills = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let killer = {
        let (pool, killing, kills) = (pool.clone(), killing.clone(), kills.clone());
        tokio::spawn(async move {
            while killing.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(pid) = listener_pid(&pool).await {
                    let _ = sqlx::query("SELECT pg_terminate_backend($1)")
                        .bind(pid)
                        .execute(&pool)
                        .await;
                    kills.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let mut ids = Vec::new();
    for n in 0..100 {
        ids.push(insert_record(pool, n).await);
        tokio::task::yield_now().await;
    }
    wait_for("every job to run", PATIENCE, || async {
        recorder.total() >= ids.len()
    })
    .await;
    killing.store(false, std::sync::atomic::Ordering::Relaxed);
    killer.await.unwrap();
    let kills = kills.load(std::sync::atomic::Ordering::Relaxed);
    assert!(kills > 0, "the listener was killed");
    wait_until("the listener to come back", PATIENCE, || listener_pid(pool)).await;
    stop.shutdown();
    run.await.unwrap().unwrap();
    let runs = recorder.runs();
    for id in &ids {
        assert_eq!(runs[id], vec![1], "job {id} ran once");
    }
    eprintln!("killed the listener {kills} times");
}

/// Workload: one job, enqueued once the worker is past its start-up schema check.
///
/// Fault: the worker's session is killed (`pg_terminate_backend`, SQLSTATE 57P01) during
/// that check: the test holds `skiplock.schema_migrations` locked, waits until the
/// worker's check waits for that lock, kills its backend, then lets the lock go.
///
/// Invariant: the worker treats the killed session as any transient connection loss: its
/// `run` does not return; it checks again, starts and runs the job. (It returned the
/// 57P01 error before: the model test saw a worker end this way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_killed_during_the_start_up_check_does_not_end_the_worker() {
    let db = test_db().await;
    let pool = &db.pool;
    let app = "start-check-victim";
    let options: sqlx::postgres::PgConnectOptions = db.url.parse().unwrap();
    let worker_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with(options.application_name(app));
    let recorder = Recorder::default();
    let worker = fast_worker(&worker_pool, &recorder).build().unwrap();
    let stop = worker.shutdown_handle();

    let mut lock = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE skiplock.schema_migrations IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let mut run = tokio::spawn(worker.run());
    let victim: i32 = wait_until("the worker's check to wait for the lock", PATIENCE, || {
        sqlx::query_scalar::<_, i32>(
            "SELECT pid FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = $1
               AND wait_event_type = 'Lock'",
        )
        .bind(app)
        .fetch_optional(pool)
        .map(Result::unwrap)
    })
    .await;
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(victim)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(killed, "the worker's backend was terminated");
    lock.rollback().await.unwrap();

    let id = insert_record(pool, 1).await;
    tokio::select! {
        ended = &mut run => panic!(
            "the worker ended on a session killed during its start-up check: {:?}",
            ended.unwrap()
        ),
        () = wait_for("the job to run", PATIENCE, || async { recorder.total() >= 1 }) => {}
    }
    stop.shutdown();
    run.await.unwrap().unwrap();
    assert_eq!(recorder.runs()[&id], vec![1], "job {id} ran once");
}

/// What a claimer did that the database must agree with.
#[derive(Default)]
struct Ledger {
    /// Every claim token handed out, with its job.
    claims: Vec<(i64, Uuid)>,
    /// Outcomes the database accepted: (operation, job, token presented).
    accepted: Vec<(&'static str, i64, Uuid)>,
    /// Claims a heartbeat reported gone.
    reported_lost: Vec<(i64, Uuid)>,
}

/// Runs `op` again when Postgres chose it as a deadlock victim, or a row it locks moved to the
/// other partition of `skiplock.jobs` meanwhile (40001). An operator's cancel locks
/// its job and then the job's lane, while a batch locks its jobs in id order, so the two
/// can deadlock; Postgres aborts one of them. A cancel retries by itself
/// (`skiplock.cancel_job`); a batch is retried here, as the worker's
/// completer does for every transient error. Nothing was written by the aborted attempt.
async fn retry_deadlock<T, E, F, Fut>(mut op: F) -> Result<T, E>
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut attempts = 0;
    loop {
        match op().await {
            // What the runtime retries: a deadlock, and a row moved to the other partition
            // of skiplock.jobs under the statement (40001).
            Err(e)
                if attempts < 5
                    && (e.to_string().contains("deadlock detected")
                        || e.to_string().contains("moved to another partition")) =>
            {
                attempts += 1
            }
            other => return other,
        }
    }
}

/// One randomized run of `claimers` concurrent claimers over `jobs` jobs; panics on any
/// violated invariant, naming the seed.
async fn claimers_run(pool: &PgPool, seed: u64, claimers: usize, steps: usize) {
    sqlx::query("TRUNCATE skiplock.jobs, public.job_audit CASCADE")
        .execute(pool)
        .await
        .unwrap();
    let mut rng = fastrand::Rng::with_seed(seed);
    let jobs: Vec<NewJob> = (0..rng.usize(100..400))
        .map(|_| {
            let mut options = EnqueueOptions::new()
                .priority(rng.i16(0..3))
                .max_attempts(rng.i32(1..5));
            if rng.u8(0..4) == 0 {
                options = options.ordering_key(format!("lane-{}", rng.u8(0..5)));
            }
            if rng.bool() {
                options = options.run_after(Duration::from_millis(rng.u64(0..300)));
            }
            NewJob::new(["a", "b"][rng.usize(0..2)], serde_json::json!({}))
                .with_options(options.queue(["q1", "q2"][rng.usize(0..2)]))
        })
        .collect();
    let ids = skiplock::enqueue_raw(pool, &jobs).await.unwrap();
    let (first, last) = (ids[0].id.0, ids[ids.len() - 1].id.0);
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let tasks: Vec<_> = (0..claimers)
        .map(|c| {
            let pool = pool.clone();
            let ledger = ledger.clone();
            let mut rng = fastrand::Rng::with_seed(seed.wrapping_mul(31).wrapping_add(c as u64));
            tokio::spawn(async move {
                let me = format!("claimer-{c}");
                let mut held: Vec<(i64, Uuid)> = Vec::new();
                let context = |what: &str| format!("seed {seed}, {me}: {what}");
                for _ in 0..steps {
                    let pick = |rng: &mut fastrand::Rng, held: &mut Vec<(i64, Uuid)>| {
                        let n = rng.usize(0..=held.len());
                        rng.shuffle(held);
                        held.drain(..n).collect::<Vec<_>>()
                    };
                    match rng.u8(0..100) {
                        0..=34 => {
                            let limit = rng.i64(1..=16);
                            let queue = if rng.bool() { "q1" } else { "q2" };
                            let kinds = match rng.u8(0..3) {
                                0 => strings(&["a"]),
                                1 => strings(&["b"]),
                                _ => strings(&["a", "b"]),
                            };
                            // A job cancelled under the claim (its row moved to jobs_done
                            // after the claim's snapshot) fails it having claimed nothing:
                            // claim again, as the worker does.
                            let batch = loop {
                                match jobs_claim_batch(&pool, queue, &kinds, limit, &me).await {
                                    Err(sqlx::Error::Database(e))
                                        if e.code().as_deref() == Some("40001") =>
                                    {
                                        continue;
                                    }
                                    claimed => {
                                        break claimed.unwrap_or_else(|e| {
                                            panic!("{}", context(&format!("claim: {e}")))
                                        });
                                    }
                                }
                            };
                            assert!(
                                batch.len() as i64 <= limit,
                                "{}",
                                context("batch over limit")
                            );
                            let mut ledger = ledger.lock().unwrap();
                            for job in batch {
                                ledger.claims.push((job.id, job.claim_token));
                                held.push((job.id, job.claim_token));
                            }
                        }
                        35..=49 => {
                            let (ids, tokens): (Vec<i64>, Vec<Uuid>) = held.iter().copied().unzip();
                            let lost = jobs_heartbeat_many(&pool, &ids, &tokens, &[])
                                .await
                                .unwrap_or_else(|e| {
                                    panic!("{}", context(&format!("heartbeat: {e}")))
                                });
                            let lost: HashSet<(i64, Uuid)> = lost.into_iter().collect();
                            let mut ledger = ledger.lock().unwrap();
                            for claim in &held {
                                if lost.contains(claim) {
                                    ledger.reported_lost.push(*claim);
                                }
                            }
                            // A lost claim is gone for good: stop presenting it.
                            held.retain(|claim| !lost.contains(claim));
                        }
                        50..=64 => {
                            let part = pick(&mut rng, &mut held);
                            let (ids, tokens): (Vec<i64>, Vec<Uuid>) = part.iter().copied().unzip();
                            let saved = retry_deadlock(|| jobs_complete_many(&pool, &ids, &tokens))
                                .await
                                .unwrap_or_else(|e| {
                                    panic!("{}", context(&format!("complete: {e}")))
                                });
                            record_accepted(&ledger, "complete", &part, saved.iter().map(|s| s.id));
                        }
                        65..=74 => {
                            let part = pick(&mut rng, &mut held);
                            let mut batch = FailBatch::default();
                            for (id, token) in &part {
                                let action = if rng.u8(0..4) == 0 {
                                    FailAction::Dead
                                } else {
                                    FailAction::Retry
                                };
                                batch.push(*id, *token, "planned".into(), rng.i64(0..100), action);
                            }
                            let saved = retry_deadlock(|| jobs_fail_many(&pool, &batch))
                                .await
                                .unwrap_or_else(|e| panic!("{}", context(&format!("fail: {e}"))));
                            record_accepted(&ledger, "fail", &part, saved.iter().map(|s| s.id));
                        }
                        75..=82 => {
                            let part = pick(&mut rng, &mut held);
                            let (ids, tokens): (Vec<i64>, Vec<Uuid>) = part.iter().copied().unzip();
                            let delays_ms = vec![0; ids.len()];
                            let released = retry_deadlock(|| {
                                jobs_release_many(&pool, &ids, &tokens, &delays_ms)
                            })
                            .await
                            .unwrap_or_else(|e| panic!("{}", context(&format!("release: {e}"))));
                            record_accepted(&ledger, "release", &part, released.into_iter());
                        }
                        83..=90 => {
                            jobs_reap_stale(&pool, rng.i64(0..200), rng.i64(1..50))
                                .await
                                .unwrap_or_else(|e| panic!("{}", context(&format!("reap: {e}"))));
                        }
                        91..=95 => {
                            // Vanish: forget the claims without a word; the reaper cleans up.
                            held.clear();
                        }
                        _ => {
                            let id = rng.i64(first..=last);
                            retry_deadlock(|| skiplock::cancel(&pool, skiplock::JobId(id)))
                                .await
                                .unwrap_or_else(|e| panic!("{}", context(&format!("cancel: {e}"))));
                        }
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }

    let ledger = Arc::try_unwrap(ledger).ok().unwrap().into_inner().unwrap();
    let tokens: HashSet<Uuid> = ledger.claims.iter().map(|(_, t)| *t).collect();
    assert_eq!(
        tokens.len(),
        ledger.claims.len(),
        "seed {seed}: a claim token was handed out twice"
    );
    let log = audit(pool).await;
    check_claim_discipline(&log, false);
    // The audit must show exactly the claims and accepted writes the claimers saw: a
    // claim is a row queued -> running with its token; an accepted write is a row that
    // changed a running job holding the presented token.
    let mut audit_claims: Vec<(i64, Uuid)> = log
        .iter()
        .filter(|r| r.is_claim())
        .map(|r| (r.job_id, r.new_token.unwrap()))
        .collect();
    let mut seen_claims = ledger.claims.clone();
    audit_claims.sort();
    seen_claims.sort();
    assert_eq!(
        audit_claims, seen_claims,
        "seed {seed}: claims seen = claims made"
    );
    let mut audit_writes: Vec<(i64, Uuid)> = log
        .iter()
        .filter(|r| r.old_state.as_deref() == Some("running") && r.app.is_empty())
        // Reaps and operator cancels are not the claimers' writes (no claimer fails a job
        // as cancelled here); heartbeats may skip locked rows, so only outcomes count.
        .filter(|r| !r.is_reap() && !r.heartbeat && r.new_state.as_deref() != Some("cancelled"))
        .map(|r| (r.job_id, r.old_token.unwrap()))
        .collect();
    let mut seen_writes: Vec<(i64, Uuid)> = ledger
        .accepted
        .iter()
        .map(|(_, id, token)| (*id, *token))
        .collect();
    audit_writes.sort();
    seen_writes.sort();
    assert_eq!(
        audit_writes, seen_writes,
        "seed {seed}: accepted writes = changes made"
    );
    // A heartbeat never reports a live claim as lost (the worker would stop a job it
    // still holds): a token once reported lost never holds a running job afterwards.
    let (lost_ids, lost_tokens): (Vec<i64>, Vec<Uuid>) =
        ledger.reported_lost.iter().copied().unzip();
    let still_held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs j
         JOIN unnest($1::bigint[], $2::uuid[]) AS l(id, token)
           ON j.id = l.id AND j.claim_token = l.token
         WHERE j.state = 'running'",
    )
    .bind(&lost_ids)
    .bind(&lost_tokens)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        still_held, 0,
        "seed {seed}: a heartbeat reported a live claim as lost"
    );
    let lanes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT ordering_key FROM skiplock.jobs
                               WHERE state = 'running' AND ordering_key IS NOT NULL
                               GROUP BY ordering_key HAVING count(*) > 1) l",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(lanes, 0, "seed {seed}: one running job per lane");
}

fn record_accepted(
    ledger: &Mutex<Ledger>,
    what: &'static str,
    presented: &[(i64, Uuid)],
    saved: impl Iterator<Item = i64>,
) {
    let saved: HashSet<i64> = saved.collect();
    let mut ledger = ledger.lock().unwrap();
    for (id, token) in presented {
        if saved.contains(id) {
            ledger.accepted.push((what, *id, *token));
        }
    }
}

/// Workload: for each of 8 seeds, 100–400 jobs in two queues, two kinds, some in
/// ordering lanes, some scheduled a little later, with 1–4 attempts; 8 claimers each take
/// 60 random steps straight on the database functions: claim (random limit, queues and
/// kinds), heartbeat, complete, fail (retry or dead), release, reap with a tiny stale
/// timeout, vanish (forget their claims), cancel a random job.
///
/// Fault: the interleavings themselves, including writes by holders whose claims were
/// reaped, cancelled or re-claimed.
///
/// Invariant: no statement errors (no deadlock, no unique violation); no batch exceeds its
/// limit; no claim token is handed out twice; the claim discipline holds on the audit log;
/// the database made exactly the claims and outcome writes the claimers were told it
/// accepted (so no job was ever held by two valid claims); a heartbeat never reports a
/// live claim as lost; at most one job runs per lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_concurrent_claimers_keep_every_claim_fenced() {
    let db = test_db().await;
    install_audit(&db.pool).await;
    let seeds: Vec<u64> = match std::env::var("SKIPLOCK_PROPERTY_SEED") {
        Ok(seed) => vec![seed.parse().expect("SKIPLOCK_PROPERTY_SEED is a number")],
        Err(_) => {
            let runs = if fault_support::soak_secs().is_some() {
                200
            } else {
                8
            };
            (1..=runs).collect()
        }
    };
    for seed in seeds {
        claimers_run(&db.pool, seed, 8, 60).await;
    }
}

/// How one enqueuing transaction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Commit,
    Rollback,
    Dropped,
    Killed,
    SerializationFailure,
}

/// Workload: 4 tasks run 40 enqueuing transactions each, each also writing a row of the
/// application's own table, while a worker drains the queue.
///
/// Fault: each transaction ends one of five ways, chosen at random: commit; rollback;
/// dropped without commit; its backend killed (`pg_terminate_backend`) before commit; or
/// a serialization failure against a concurrent serializable transaction.
///
/// Invariant: a job runs if and only if its transaction's commit succeeded, exactly once;
/// the jobs table holds exactly the committed jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_if_and_only_if_its_enqueuing_transaction_committed() {
    let db = test_db().await;
    let pool = &db.pool;
    sqlx::query("CREATE TABLE public.ledger (tag int PRIMARY KEY, slot int NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder).build().unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());

    let tasks: Vec<_> = (0..4u32)
        .map(|t| {
            let (pool, url) = (pool.clone(), db.url.clone());
            tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(100 + u64::from(t));
                let mut endings = Vec::new();
                for i in 0..40u32 {
                    let tag = t * 1000 + i;
                    let ending = match rng.u8(0..5) {
                        0 => Ending::Commit,
                        1 => Ending::Rollback,
                        2 => Ending::Dropped,
                        3 => Ending::Killed,
                        _ => Ending::SerializationFailure,
                    };
                    let committed = enqueue_ending(&pool, &url, tag, ending).await;
                    endings.push((tag, ending, committed));
                }
                endings
            })
        })
        .collect();
    let mut endings = Vec::new();
    for task in tasks {
        endings.extend(task.await.unwrap());
    }
    let committed: HashSet<u32> = endings.iter().filter(|e| e.2).map(|e| e.0).collect();
    for (tag, ending, ok) in &endings {
        assert_eq!(*ok, *ending == Ending::Commit, "tag {tag} ended {ending:?}");
    }

    wait_until("the committed jobs to run", PATIENCE, || async {
        (states(pool).await.get("succeeded").copied() == Some(committed.len() as i64)).then_some(())
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();

    let rows: Vec<(i64, i64)> =
        sqlx::query_as("SELECT id, (args->>'n')::bigint FROM skiplock.jobs")
            .fetch_all(pool)
            .await
            .unwrap();
    let in_table: HashSet<u32> = rows.iter().map(|(_, n)| *n as u32).collect();
    assert_eq!(
        in_table, committed,
        "the jobs table holds exactly the committed jobs"
    );
    assert_eq!(rows.len(), committed.len());
    let runs = recorder.runs();
    assert_eq!(runs.len(), committed.len(), "only committed jobs ran");
    for (id, n) in rows {
        assert_eq!(runs.get(&id), Some(&vec![1]), "job {id} (tag {n}) ran once");
    }
    let ledger: i64 = sqlx::query_scalar("SELECT count(*) FROM public.ledger")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(
        ledger,
        committed.len() as i64,
        "the application's rows went the same way"
    );
    let by_ending = endings.iter().fold(HashMap::new(), |mut m, e| {
        *m.entry(format!("{:?}", e.1)).or_insert(0) += 1;
        m
    });
    eprintln!("transaction endings: {by_ending:?}");
}

/// Runs one enqueuing transaction for `tag` that ends as `ending`; returns whether its
/// commit succeeded.
async fn enqueue_ending(pool: &PgPool, url: &str, tag: u32, ending: Ending) -> bool {
    let job = Record { n: tag };
    match ending {
        Ending::Commit | Ending::Rollback | Ending::Dropped | Ending::Killed => {
            let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
            let mut tx = conn.begin().await.unwrap();
            sqlx::query("INSERT INTO public.ledger (tag, slot) VALUES ($1, 0)")
                .bind(tag as i32)
                .execute(&mut *tx)
                .await
                .unwrap();
            skiplock::enqueue(&mut *tx, &job, EnqueueOptions::default())
                .await
                .unwrap();
            match ending {
                Ending::Commit => tx.commit().await.is_ok(),
                Ending::Rollback => {
                    tx.rollback().await.unwrap();
                    false
                }
                Ending::Dropped => {
                    drop(tx);
                    false
                }
                _ => {
                    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                        .fetch_one(&mut *tx)
                        .await
                        .unwrap();
                    // Waits (up to 10 s) until the backend is gone.
                    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 10000)")
                        .bind(pid)
                        .fetch_one(pool)
                        .await
                        .unwrap();
                    assert!(killed);
                    tx.commit().await.is_ok()
                }
            }
        }
        Ending::SerializationFailure => {
            // One skew at a time: two of them at once could conflict with each other.
            static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
            let _turn = ONE_AT_A_TIME.lock().await;
            // Two serializable transactions each read the other's slot and write their
            // own: a write skew Postgres must refuse. The loser carries the job.
            let mut winner = sqlx::PgConnection::connect(url).await.unwrap();
            let mut loser = sqlx::PgConnection::connect(url).await.unwrap();
            let mut w = winner
                .begin_with("BEGIN ISOLATION LEVEL SERIALIZABLE")
                .await
                .unwrap();
            let mut l = loser
                .begin_with("BEGIN ISOLATION LEVEL SERIALIZABLE")
                .await
                .unwrap();
            let (w_tag, l_tag) = (tag as i32 + 500_000, tag as i32);
            for (tx, other) in [(&mut w, l_tag), (&mut l, w_tag)] {
                sqlx::query("SELECT count(*) FROM public.ledger WHERE tag = $1")
                    .bind(other)
                    .execute(&mut **tx)
                    .await
                    .unwrap();
            }
            sqlx::query("INSERT INTO public.ledger (tag, slot) VALUES ($1, 1)")
                .bind(w_tag)
                .execute(&mut *w)
                .await
                .unwrap();
            let loser_wrote = async {
                sqlx::query("INSERT INTO public.ledger (tag, slot) VALUES ($1, 1)")
                    .bind(l_tag)
                    .execute(&mut *l)
                    .await?;
                skiplock::enqueue(&mut *l, &job, EnqueueOptions::default())
                    .await
                    .map_err(|e| match e {
                        skiplock::Error::Database(e) => e,
                        other => panic!("{other}"),
                    })?;
                Ok::<_, sqlx::Error>(())
            }
            .await;
            // The winner's row must not count as an enqueued tag: remove it after commit.
            w.commit().await.unwrap();
            let committed = match loser_wrote {
                Ok(()) => l.commit().await,
                Err(e) => Err(e),
            };
            let error = committed.expect_err("the second of two skewed serializable commits fails");
            let code = error
                .as_database_error()
                .and_then(|d| d.code())
                .map(|c| c.into_owned());
            assert_eq!(code.as_deref(), Some("40001"), "{error}");
            sqlx::query("DELETE FROM public.ledger WHERE tag = $1")
                .bind(w_tag)
                .execute(pool)
                .await
                .unwrap();
            false
        }
    }
}
