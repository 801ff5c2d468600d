//! Faults of worker processes: `kill -9` during a drain, a worker frozen past its stale
//! timeout, and a rolling SIGTERM restart under load. Each test runs real
//! `skiplock-testbed` processes against its own database and checks its invariant from
//! the database: the audit trigger's log of every change and the testbed's record of
//! every execution.
#![cfg(feature = "testbed")]

mod common;
mod fault_support;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use fault_support::{
    PATIENCE, Testbed, TestbedArgs, age_claims_of, audit, audited_db, check_claim_discipline,
    db_now, enqueue_n, run_count, running_held_by, runs_by_job, states, wait_no_statement_of,
    wait_until,
};

/// Stale timeout of the live workers: far longer than any pause of a loaded machine, so
/// that no live worker's claim is reaped (these tests count that as a failure). A killed
/// or frozen worker's claims are made stale by hand ([`age_claims_of`]) once it can write
/// nothing more, and the live workers' reaper takes them back at its next pass.
const STALE: Duration = Duration::from_secs(60);
use serde_json::json;
use skiplock::EnqueueOptions;

/// Workload: 10,000 `record` jobs (each records its execution, then sleeps 2 ms) drained
/// by three testbed workers of 16 slots each.
///
/// Fault: five times during the drain (at 10 %, 25 %, 40 %, 55 % and 70 % of the runs) one
/// worker is killed with SIGKILL, mid-flight, holding jobs (stopped first, so that none
/// finishes between the check and the kill), and a fresh one takes its place. Its claims
/// are reaped at once (made stale by hand; see [`STALE`]).
///
/// Invariant: no job is lost (all 10,000 succeed); a job ran more than once only if a
/// killed worker held it: every execution but a job's last, every claim but its last, and
/// every reap were a killed worker's; the claim discipline holds; nothing stays running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_drain_loses_nothing_and_reruns_only_the_killed_workers_jobs() {
    const JOBS: usize = 10_000;
    let db = audited_db().await;
    let pool = &db.pool;
    enqueue_n(
        pool,
        "record",
        json!({"ms": 2}),
        JOBS,
        EnqueueOptions::new(),
    )
    .await;

    let args = TestbedArgs::new()
        .set("kinds", "record")
        .set("concurrency", 16)
        .set("heartbeat-ms", 200)
        .set("stale-ms", STALE.as_millis());
    let mut workers = Vec::new();
    for i in 0..3 {
        workers.push(Testbed::start(&db.url, &format!("tb-drain-{i}"), &args).await);
    }
    let mut killed: HashSet<String> = HashSet::new();
    let mut held_at_death: HashMap<String, i64> = HashMap::new();
    for (k, percent) in [10, 25, 40, 55, 70].into_iter().enumerate() {
        let threshold = (JOBS * percent / 100) as i64;
        wait_until("the drain to progress", PATIENCE, || async {
            (run_count(pool).await >= threshold).then_some(())
        })
        .await;
        let slot = k % workers.len();
        let victim = &mut workers[slot];
        let id = victim.worker_id.clone();
        // What it held when it died: counted once its sessions are gone, so that no
        // commit it sent before the kill lands after the count.
        let held = victim.kill9_holding(pool).await;
        assert_eq!(
            age_claims_of(pool, &id, STALE).await,
            held as u64,
            "the dead worker's claims, made stale for the reaper"
        );
        eprintln!("killed {id} holding {held} jobs");
        held_at_death.insert(id.clone(), held);
        killed.insert(id);
        workers[slot] = Testbed::start(&db.url, &format!("tb-drain-{slot}-{k}"), &args).await;
    }
    wait_until("every job to succeed", PATIENCE * 2, || async {
        (states(pool).await.get("succeeded").copied() == Some(JOBS as i64)).then_some(())
    })
    .await;
    for worker in &mut workers {
        worker.signal("TERM");
        assert!(worker.wait_exit(PATIENCE).await.success());
    }

    assert_eq!(
        states(pool).await,
        HashMap::from([("succeeded".to_owned(), JOBS as i64)]),
        "no job lost, none left running"
    );
    let runs = runs_by_job(pool).await;
    assert_eq!(runs.len(), JOBS, "every job ran");
    let mut reran = 0;
    for (job, runs) in &runs {
        for run in &runs[..runs.len() - 1] {
            assert!(
                killed.contains(&run.worker_id),
                "job {job} ran again after a run by live worker {}: {runs:?}",
                run.worker_id
            );
        }
        reran += usize::from(runs.len() > 1);
    }
    let log = audit(pool).await;
    check_claim_discipline(&log, false);
    let mut last_claim: HashMap<i64, &fault_support::AuditRow> = HashMap::new();
    let mut reaped_from: HashMap<&str, i64> = HashMap::new();
    for row in &log {
        if row.is_reap() {
            let holder = row.old_holder.as_deref().unwrap();
            assert!(
                killed.contains(holder),
                "a live worker's claim was reaped: {row:?}"
            );
            *reaped_from.entry(holder).or_default() += 1;
        }
        assert!(!row.is_release(), "nobody released anything: {row:?}");
        if row.is_claim()
            && let Some(previous) = last_claim.insert(row.job_id, row)
        {
            assert!(
                killed.contains(previous.new_holder.as_deref().unwrap()),
                "job {} was claimed again after a live worker's claim {previous:?}",
                row.job_id
            );
        }
    }
    // Every job a killed worker held when it died was reaped (the reaper may also have
    // taken some before they were counted, never fewer). A victim may die holding
    // nothing (a completion the server read after the check); not all of them.
    for (worker, &held) in &held_at_death {
        let reaped = reaped_from.get(worker.as_str()).copied().unwrap_or(0);
        assert!(
            reaped >= held,
            "{worker} died holding {held} jobs, {reaped} were reaped: {reaped_from:?}"
        );
    }
    assert!(
        held_at_death.values().sum::<i64>() > 0,
        "no killed worker held a job when it died: the kills tested nothing"
    );
    eprintln!("{reran} of {JOBS} jobs ran more than once, all after a kill");
}

/// Workload: two `record` jobs (20 s and 21 s) claimed by worker A.
///
/// Fault: A is frozen with SIGSTOP while it runs them; worker B's reaper takes the claims
/// back once A's heartbeats are stale, and B runs both jobs again. While B runs them, A is
/// resumed: its timers have expired, its heartbeat and completer write at once.
///
/// A's heartbeats are made stale by hand once it is frozen with nothing in flight
/// ([`age_claims_of`]): B keeps a stale timeout of a minute, so that no pause of a loaded
/// machine gets B's own claims reaped (one reap per job is checked). The jobs are long so
/// that B surely still runs them when A is resumed and has noticed its loss.
///
/// Invariant: A's late writes change nothing (A notices it lost the claims; the jobs stay
/// B's while B runs them); both jobs end `succeeded` by B on attempt 2, after exactly one
/// reap each; no audit row after the reaps was written by A.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_resumed_after_its_claims_were_reaped_changes_nothing() {
    let db = audited_db().await;
    let pool = &db.pool;
    let args = TestbedArgs::new()
        .set("kinds", "record")
        .set("concurrency", 2)
        .set("heartbeat-ms", 200)
        .set("stale-ms", STALE.as_millis());
    let a = Testbed::start(&db.url, "tb-frozen", &args).await;
    let j1 = enqueue_n(
        pool,
        "record",
        json!({"ms": 20_000}),
        1,
        EnqueueOptions::new(),
    )
    .await[0];
    let j2 = enqueue_n(
        pool,
        "record",
        json!({"ms": 21_000}),
        1,
        EnqueueOptions::new(),
    )
    .await[0];
    wait_until("A to run both jobs", PATIENCE, || async {
        (run_count(pool).await == 2).then_some(())
    })
    .await;
    a.signal("STOP");
    wait_no_statement_of(pool, "tb-frozen").await;
    assert_eq!(
        age_claims_of(pool, "tb-frozen", STALE).await,
        2,
        "the frozen A holds both claims, made stale for B's reaper"
    );
    let b = Testbed::start(&db.url, "tb-rescuer", &args).await;
    wait_until("B to run both jobs again", PATIENCE, || async {
        (run_count(pool).await == 4).then_some(())
    })
    .await;
    let held_by_b: Vec<(i64, uuid::Uuid)> = sqlx::query_as(
        "SELECT id, claim_token FROM skiplock.jobs
         WHERE state = 'running' AND claimed_by = 'tb-rescuer' ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        held_by_b.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        vec![j1, j2]
    );

    a.signal("CONT");
    wait_until("A to notice it lost its claims", PATIENCE, || async {
        (a.log_count("claim lost") + a.log_count("outcome discarded") > 0).then_some(())
    })
    .await;
    // While B still runs them (for 20 s from moments ago), the jobs are B's, with B's
    // claims.
    let now_held: Vec<(i64, uuid::Uuid)> = sqlx::query_as(
        "SELECT id, claim_token FROM skiplock.jobs
         WHERE state = 'running' AND claimed_by = 'tb-rescuer' ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(now_held, held_by_b, "A's late writes changed nothing");

    wait_until("B to finish both jobs", PATIENCE, || async {
        (states(pool).await.get("succeeded") == Some(&2)).then_some(())
    })
    .await;
    for id in [j1, j2] {
        let row = skiplock::job(pool, skiplock::JobId(id))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (row.claimed_by.as_deref(), row.attempt),
            (Some("tb-rescuer"), 2),
            "job {id} finished by the new holder"
        );
    }
    let log = audit(pool).await;
    check_claim_discipline(&log, false);
    let reaps: Vec<_> = log.iter().filter(|r| r.is_reap()).collect();
    assert_eq!(reaps.len(), 2, "one reap per job: {reaps:?}");
    assert!(
        reaps
            .iter()
            .all(|r| r.old_holder.as_deref() == Some("tb-frozen"))
    );
    let last_reap = reaps.iter().map(|r| r.seq).max().unwrap();
    let by_a: Vec<_> = log
        .iter()
        .filter(|r| r.seq > last_reap && r.app == "tb-frozen")
        .collect();
    assert!(by_a.is_empty(), "A wrote after losing its claims: {by_a:?}");
    drop(b);
}

/// Workload: 150 `record` jobs of 100 ms to 3 s, run by three workers of 8 slots, each with
/// a 1 s shutdown grace.
///
/// Fault: a rolling restart: each worker in turn gets SIGTERM (the last one twice, which
/// releases at once) and is replaced by a fresh one while the others keep working.
///
/// Invariant: after a worker has acknowledged the signal it claims nothing new (only the
/// claims it had in flight may still start their statement); when it exits it holds
/// nothing (every job it held finished or was released); a release gives the attempt back,
/// so every job ends `succeeded` on attempt 1 and nothing was reaped.
///
/// The acknowledgement is the worker's own "shutting down: no new claims", logged once its
/// shutdown began (the testbed's "signal received" comes before it asks the worker to
/// stop, so claims made in between are no fault). A claim the producer had in flight then
/// (at most 2: `CLAIMS_IN_FLIGHT_ALONE` in src/worker/sharing.rs) can still start its
/// statement later, when a loaded machine gives it a connection; one claim statement
/// takes all its jobs with one claim token, so at most 2 tokens may follow the line.
/// (The stale timeout is a minute: with the default 2 s, a pause of a loaded machine got
/// a live worker's claim reaped, which says nothing about a graceful stop. A worker that
/// left a claim behind at exit is caught when it exits, and its claim would be reaped a
/// minute later, within the test's patience, and fail "nothing was reaped".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_sigterm_restart_claims_nothing_after_the_signal_and_loses_no_attempt() {
    const JOBS: usize = 150;
    let db = audited_db().await;
    let pool = &db.pool;
    let mut rng = fastrand::Rng::with_seed(11);
    let jobs: Vec<skiplock::NewJob> = (0..JOBS)
        .map(|_| skiplock::NewJob::new("record", json!({"ms": rng.u64(100..3000)})))
        .collect();
    skiplock::enqueue_raw(pool, &jobs).await.unwrap();

    let args = TestbedArgs::new()
        .set("kinds", "record")
        .set("concurrency", 8)
        .set("stale-ms", STALE.as_millis())
        .set("shutdown-grace-ms", 1_000)
        // The worker's "shutting down: no new claims" (info) on stderr.
        .env("RUST_LOG", "warn,skiplock::worker=info");
    let mut workers = Vec::new();
    for i in 0..3 {
        workers.push(Testbed::start(&db.url, &format!("tb-roll-{i}"), &args).await);
    }
    let mut acknowledged = HashMap::new();
    for (slot, worker) in workers.iter_mut().enumerate() {
        wait_until("the workers to be busy", PATIENCE, || async {
            (running_held_by(pool, &worker.worker_id).await > 0).then_some(())
        })
        .await;
        worker.signal("TERM");
        worker
            .wait_for_log("shutting down: no new claims", PATIENCE)
            .await;
        acknowledged.insert(worker.worker_id.clone(), db_now(pool).await);
        if slot == 2 {
            worker.signal("TERM");
        }
        let status = worker.wait_exit(PATIENCE).await;
        assert!(status.success(), "{}", worker.log_text());
        assert_eq!(
            running_held_by(pool, &worker.worker_id).await,
            0,
            "{} left jobs running",
            worker.worker_id
        );
        *worker = Testbed::start(&db.url, &format!("tb-roll-{slot}b"), &args).await;
    }
    wait_until("every job to succeed", PATIENCE, || async {
        (states(pool).await.get("succeeded").copied() == Some(JOBS as i64)).then_some(())
    })
    .await;

    let log = audit(pool).await;
    check_claim_discipline(&log, false);
    let mut releases = 0;
    // Per stopped worker, the claim statements (tokens) that began after it acknowledged.
    let mut late: HashMap<&str, HashMap<uuid::Uuid, Vec<i64>>> = HashMap::new();
    for row in &log {
        assert!(!row.is_reap(), "nothing was reaped: {row:?}");
        if row.is_claim() {
            let holder = row.new_holder.as_deref().unwrap();
            if let Some(signalled) = acknowledged.get(holder)
                && row.claimed_at.unwrap() > *signalled
            {
                late.entry(holder)
                    .or_default()
                    .entry(row.new_token.unwrap())
                    .or_default()
                    .push(row.job_id);
            }
        }
        if row.is_release() {
            releases += 1;
            assert!(
                acknowledged.contains_key(&row.app),
                "only a stopping worker releases: {row:?}"
            );
        }
    }
    eprintln!("claims begun after the acknowledgement, by worker: {late:?}");
    for (holder, claims) in &late {
        assert!(
            claims.len() <= 2,
            "{holder} started {} claims after acknowledging SIGTERM, more than it can have in \
             flight (jobs by claim: {claims:?})",
            claims.len()
        );
    }
    assert!(
        releases > 0,
        "some jobs outlived the grace and were released"
    );
    let attempts: Vec<i32> = sqlx::query_scalar("SELECT DISTINCT attempt FROM skiplock.jobs")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(attempts, vec![1], "releases gave every attempt back");
}

/// An audit row of job 1 going from `old` to `new` (state, token, holder), written by
/// `app`.
fn audit_row(
    seq: i64,
    (old_state, old_token, old_holder): (&str, Option<uuid::Uuid>, Option<&str>),
    (new_state, new_token, new_holder): (&str, Option<uuid::Uuid>, Option<&str>),
    app: &str,
) -> fault_support::AuditRow {
    let attempt = i32::from(old_state == "running");
    fault_support::AuditRow {
        seq,
        job_id: 1,
        op: "update".to_owned(),
        old_state: Some(old_state.to_owned()),
        new_state: Some(new_state.to_owned()),
        old_attempt: Some(attempt),
        new_attempt: Some(attempt + i32::from(old_state == "queued" && new_state == "running")),
        max_attempts: Some(5),
        old_token,
        new_token,
        old_holder: old_holder.map(str::to_owned),
        new_holder: new_holder.map(str::to_owned),
        heartbeat: false,
        failure: false,
        last_error: None,
        app: app.to_owned(),
        claimed_at: None,
        txid: seq,
        at: chrono::Utc::now(),
    }
}

/// What `check_claim_discipline` catches, on logs written by hand: a testbed worker that
/// does not hold the claim finishing the job, and a running job whose token changed
/// outside a claim; and what it cannot see (documented on the function): a write with a
/// stale token by the holder's own process looks like the holder's write, so it would pass
/// here and is tested with the tokens themselves in tests/fencing.rs.
#[test]
fn the_claim_discipline_check_catches_foreign_and_unclaimed_token_writes() {
    let (t1, t2) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let claim = audit_row(
        1,
        ("queued", None, None),
        ("running", Some(t1), Some("tb-a")),
        "tb-a",
    );
    let completed_by = |app: &str, token: uuid::Uuid| {
        audit_row(
            2,
            ("running", Some(token), Some("tb-a")),
            ("succeeded", None, Some("tb-a")),
            app,
        )
    };
    check_claim_discipline(&[claim.clone(), completed_by("tb-a", t1)], false);
    let caught = |log: Vec<fault_support::AuditRow>| {
        std::panic::catch_unwind(|| check_claim_discipline(&log, false)).is_err()
    };
    assert!(
        caught(vec![claim.clone(), completed_by("tb-b", t1)]),
        "a write by a worker that does not hold the claim"
    );
    assert!(
        caught(vec![claim.clone(), completed_by("tb-a", t2)]),
        "a write to a running job that carries a token no claim set"
    );
}
