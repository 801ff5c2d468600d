//! The soak: mixed faults for as long as `SKIPLOCK_SOAK_SECS` says, on a steady stream of
//! jobs. It is `#[ignore]`d, so the normal test run stays fast; run with `--ignored` it
//! fails without the variable. CI (`.ci/run`) runs a short one
//! (`SKIPLOCK_SOAK_SECS=40 … --test faults_soak -- --ignored`); long ones are run by hand.
//! See docs/testing.md.
#![cfg(feature = "testbed")]

mod common;
mod fault_support;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fault_support::{
    PATIENCE, Testbed, TestbedArgs, audit, audited_db, check_claim_discipline, lock_jobs_table,
    runs_by_job, soak_secs, states, wait_until,
};
use serde_json::json;
use skiplock::{EnqueueOptions, NewJob};
use sqlx::PgPool;

/// Enqueues a mix of jobs until `stop`: mostly `record` jobs of 0–500 ms, some that panic
/// (3 attempts) and some that never return (2 attempts, stopped by the 1 s timeout).
async fn feed(pool: PgPool, stop: Arc<AtomicBool>, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    while !stop.load(Ordering::Relaxed) {
        let jobs: Vec<NewJob> = (0..rng.usize(1..40))
            .map(|_| match rng.u8(0..100) {
                0..=2 => NewJob::new("panic", json!({}))
                    .with_options(EnqueueOptions::new().max_attempts(3)),
                3..=4 => NewJob::new("never_return", json!({}))
                    .with_options(EnqueueOptions::new().max_attempts(2)),
                _ => NewJob::new("record", json!({"ms": rng.u64(0..500)})),
            })
            .collect();
        skiplock::enqueue_raw(&pool, &jobs).await.expect("enqueue");
        tokio::time::sleep(Duration::from_millis(rng.u64(20..200))).await;
    }
}

/// The kinds of fault the soak injects (see [`soak_mixed_faults`]).
const FAULTS: [&str; 5] = ["kill", "stop", "term", "listener", "lock"];

/// Workload: three testbed workers (8 slots, stale after 6 s) on a steady stream of mixed
/// jobs, for `SKIPLOCK_SOAK_SECS` seconds.
///
/// Fault: every 2–6 s one at random: `kill -9` of a worker (replaced), SIGSTOP for 9 s
/// (past the stale timeout) then SIGCONT, SIGTERM (replaced), the LISTEN connections
/// killed, or the jobs table locked for 1 s (far less than the stale timeout: a lock
/// longer than `stale_after` rightly gets live claims reaped, and with 2 s a loaded
/// machine's delays on either side of the lock left too little for the heartbeats
/// queued behind it).
///
/// Invariant, once the stream stops and the queue drains: nothing is left queued or
/// running; every `record` job succeeded and ran again only after a run by a killed or
/// frozen worker; every `panic` and `never_return` job is `dead` after exactly its
/// `max_attempts`; only killed or frozen workers' claims were reaped; the claim
/// discipline holds over the whole audit log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: SKIPLOCK_SOAK_SECS=N cargo test --all-features --test faults_soak -- --ignored"]
async fn soak_mixed_faults() {
    let Some(secs) = soak_secs() else {
        panic!("set SKIPLOCK_SOAK_SECS=N to run the soak for N seconds");
    };
    let db = audited_db().await;
    let pool = &db.pool;
    let args = TestbedArgs::new()
        .set("kinds", "record,panic,never-return")
        .set("concurrency", 8)
        .set("stale-ms", 6_000)
        .set("timeout-ms", 1_000)
        .set("shutdown-grace-ms", 1_000);
    let mut generation = 0;
    let mut next_id = |slot: usize| {
        generation += 1;
        format!("tb-soak-{slot}-{generation}")
    };
    let mut workers = Vec::new();
    for slot in 0..3 {
        workers.push(Testbed::start(&db.url, &next_id(slot), &args).await);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let feeder = tokio::spawn(feed(pool.clone(), stop.clone(), secs));
    let mut rng = fastrand::Rng::with_seed(secs);
    let mut rerun_ok: HashSet<String> = HashSet::new();
    let mut faults: HashMap<&str, usize> = HashMap::new();
    // The faults come in rounds, each of all five kinds in a random order, and the soak
    // runs at least one whole round however short it is: a short soak (CI's) still
    // injects every kind.
    let mut round: Vec<&str> = Vec::new();
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end || faults.len() < FAULTS.len() {
        // Pacing the faults, not waiting for anything.
        tokio::time::sleep(Duration::from_millis(rng.u64(2_000..6_000))).await;
        let slot = rng.usize(0..workers.len());
        if round.is_empty() {
            round = FAULTS.to_vec();
            rng.shuffle(&mut round);
        }
        let fault = round.pop().expect("a round is never empty here");
        *faults.entry(fault).or_default() += 1;
        match fault {
            "kill" => {
                rerun_ok.insert(workers[slot].worker_id.clone());
                workers[slot].kill9().await;
                workers[slot] = Testbed::start(&db.url, &next_id(slot), &args).await;
            }
            "stop" => {
                rerun_ok.insert(workers[slot].worker_id.clone());
                workers[slot].signal("STOP");
                // The fault itself: frozen past the stale timeout (6 s).
                tokio::time::sleep(Duration::from_secs(9)).await;
                workers[slot].signal("CONT");
            }
            "term" => {
                workers[slot].signal("TERM");
                let status = workers[slot].wait_exit(PATIENCE).await;
                assert!(status.success(), "{}", workers[slot].log_text());
                workers[slot] = Testbed::start(&db.url, &next_id(slot), &args).await;
            }
            "listener" => {
                sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
                )
                .execute(pool)
                .await
                .unwrap();
            }
            _ => {
                let tx = lock_jobs_table(pool).await;
                tokio::time::sleep(Duration::from_secs(1)).await;
                tx.commit().await.unwrap();
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    feeder.await.unwrap();
    wait_until("the queue to drain", PATIENCE * 4, || async {
        let states = states(pool).await;
        (!states.contains_key("queued") && !states.contains_key("running")).then_some(())
    })
    .await;
    for worker in &mut workers {
        worker.signal("TERM");
        assert!(worker.wait_exit(PATIENCE).await.success());
    }

    let rows: Vec<(i64, String, String, i32, i32)> =
        sqlx::query_as("SELECT id, kind, state::text, attempt, max_attempts FROM skiplock.jobs")
            .fetch_all(pool)
            .await
            .unwrap();
    let runs = runs_by_job(pool).await;
    for (id, kind, state, attempt, max_attempts) in &rows {
        match kind.as_str() {
            "record" => {
                assert_eq!(state, "succeeded", "record job {id}");
                let runs = &runs[id];
                for run in &runs[..runs.len() - 1] {
                    assert!(
                        rerun_ok.contains(&run.worker_id),
                        "job {id} ran again after a run by healthy {}",
                        run.worker_id
                    );
                }
            }
            _ => {
                assert_eq!(state, "dead", "{kind} job {id}");
                assert_eq!(attempt, max_attempts, "{kind} job {id}");
            }
        }
    }
    let log = audit(pool).await;
    check_claim_discipline(&log, false);
    for row in log.iter().filter(|r| r.is_reap()) {
        let holder = row.old_holder.as_deref().unwrap();
        assert!(
            rerun_ok.contains(holder),
            "a healthy worker was reaped: {row:?}"
        );
    }
    // The soak did its work: jobs of every kind ran, and every fault was injected.
    for kind in ["record", "panic", "never_return"] {
        assert!(
            rows.iter().any(|(_, k, ..)| k == kind),
            "the soak enqueued no {kind} job in {secs} s"
        );
    }
    assert!(
        FAULTS.iter().all(|f| faults.get(f).is_some_and(|&n| n > 0)),
        "every kind of fault is injected: {faults:?}"
    );
    eprintln!("soak: {} jobs over {secs} s, faults {faults:?}", rows.len());
}
