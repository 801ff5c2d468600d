//! A worker whose system clock is 10 minutes off (libfaketime): every time decision (due,
//! stale, backoff) must use the database clock, so the skew changes nothing.
//!
//! Needs libfaketime (`apt-get install faketime`); without it the test prints a note and
//! passes without checking anything.
#![cfg(feature = "testbed")]

mod common;
mod fault_support;

use std::path::PathBuf;
use std::time::Duration;

use fault_support::{
    PATIENCE, Testbed, TestbedArgs, audit, audited_db, check_claim_discipline, db_now, enqueue_n,
    runs, states, wait_until,
};
use serde_json::json;
use skiplock::EnqueueOptions;

/// The preloadable libfaketime, wherever the distribution put it.
fn libfaketime() -> Option<PathBuf> {
    let mut candidates = vec![PathBuf::from("/usr/lib/faketime/libfaketime.so.1")];
    if let Ok(entries) = std::fs::read_dir("/usr/lib") {
        for entry in entries.flatten() {
            candidates.push(entry.path().join("faketime/libfaketime.so.1"));
        }
    }
    candidates.into_iter().find(|p| p.is_file())
}

/// Workload: an honest worker runs a job that outlasts the test; then a worker 10 minutes
/// ahead and one 10 minutes behind join it (all with a 30 s stale timeout and a reaper
/// every 200 ms), each on a queue of its own holding 10 jobs due in 3 s, one due in 9
/// minutes, and one that fails its first attempt and asks for a 3 s retry delay.
///
/// Fault: the skewed system clocks (libfaketime, `FAKETIME=±10m`).
///
/// Invariant: the skew is real (each skewed worker's own clock, recorded with its runs,
/// is 10 minutes off the database's); no job is claimed before it is due by the database
/// clock; the jobs due in 9 minutes are never claimed; retries wait their full delay; the
/// honest worker's long job is never reaped: once everything else settled (the skewed
/// workers' reapers ran for seconds meanwhile) it still runs, on attempt 1.
///
/// The stale timeout is 150 heartbeat intervals, so that no pause of a loaded machine
/// gets the honest worker's live claim reaped (with 2 s it could, failing the test on the
/// machine's speed), and still 20 times shorter than the skew: a reaper that judged
/// staleness by its own clock 10 minutes ahead would take the claim back at once. The
/// long job runs until the end, so that it surely runs while the skewed reapers do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_clock_is_10_minutes_off_claims_and_reaps_by_the_database_clock() {
    let Some(lib) = libfaketime() else {
        common::missing_tool(
            "the clock-skew fault test",
            "libfaketime",
            "apt-get install -y faketime",
        );
        return;
    };
    let db = audited_db().await;
    let pool = &db.pool;
    let args = TestbedArgs::new()
        .set("concurrency", 4)
        .set("heartbeat-ms", 200)
        .set("stale-ms", 30_000);
    let honest = Testbed::start(&db.url, "tb-honest", &args.clone().set("kinds", "record")).await;
    let long = enqueue_n(
        pool,
        "record",
        json!({"ms": 3_600_000}),
        1,
        EnqueueOptions::new(),
    )
    .await[0];
    wait_until(
        "the honest worker to run the long job",
        PATIENCE,
        || async {
            runs(pool)
                .await
                .iter()
                .any(|r| r.job_id == long)
                .then_some(())
        },
    )
    .await;

    // Each skewed worker has a queue of its own, so each surely does its share.
    let skewed = |offset: &str, queue: &str| {
        args.clone()
            .set("kinds", "record,panic")
            .set("queue", queue)
            .set("retry-ms", 3_000)
            .env("LD_PRELOAD", lib.display())
            .env("FAKETIME", offset)
            .env("FAKETIME_DONT_FAKE_MONOTONIC", 1)
    };
    let ahead = Testbed::start(&db.url, "tb-ahead", &skewed("+10m", "ahead")).await;
    let behind = Testbed::start(&db.url, "tb-behind", &skewed("-10m", "behind")).await;
    let (mut soon, mut later, mut flaky) = (Vec::new(), Vec::new(), Vec::new());
    for queue in ["ahead", "behind"] {
        let options = EnqueueOptions::new().queue(queue);
        soon.extend(
            enqueue_n(
                pool,
                "record",
                json!({}),
                10,
                options.clone().run_after(Duration::from_secs(3)),
            )
            .await,
        );
        later.extend(
            enqueue_n(
                pool,
                "record",
                json!({}),
                1,
                options.clone().run_after(Duration::from_secs(540)),
            )
            .await,
        );
        flaky.extend(enqueue_n(pool, "panic", json!({}), 1, options.max_attempts(2)).await);
    }

    wait_until("everything due to settle", PATIENCE, || async {
        let states = states(pool).await;
        (states.get("succeeded") == Some(&20) && states.get("dead") == Some(&2)).then_some(())
    })
    .await;
    let row = skiplock::job(pool, skiplock::JobId(long))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (row.state, row.attempt, row.claimed_by.as_deref()),
        (skiplock::JobState::Running, 1, Some("tb-honest")),
        "the honest worker's long job still runs on its first claim"
    );
    let now = db_now(pool).await;
    drop((honest, ahead, behind));

    // The skew was real: each worker recorded its own clock beside the database's.
    let runs = runs(pool).await;
    for run in &runs {
        let skew = (run.local_clock - run.db_clock).num_seconds();
        let expected = match run.worker_id.as_str() {
            "tb-ahead" => 600,
            "tb-behind" => -600,
            _ => 0,
        };
        assert!(
            (skew - expected).abs() < 60,
            "{} ran with a clock {skew} s off the database's: {run:?}",
            run.worker_id
        );
    }
    for worker in ["tb-ahead", "tb-behind"] {
        assert!(
            runs.iter().any(|r| r.worker_id == worker),
            "{worker} did some of the work"
        );
    }
    let log = audit(pool).await;
    check_claim_discipline(&log, false);
    assert!(log.iter().all(|r| !r.is_reap()), "nothing was reaped");
    let scheduled: Vec<(
        i64,
        chrono::DateTime<chrono::Utc>,
        chrono::DateTime<chrono::Utc>,
    )> =
        sqlx::query_as("SELECT id, scheduled_at, claimed_at FROM skiplock.jobs WHERE id = ANY($1)")
            .bind(&soon)
            .fetch_all(pool)
            .await
            .unwrap();
    for (id, due, claimed) in scheduled {
        assert!(
            claimed >= due,
            "job {id} claimed at {claimed}, before it was due at {due}"
        );
    }
    for id in later {
        let row = skiplock::job(pool, skiplock::JobId(id))
            .await
            .unwrap()
            .unwrap();
        assert_eq!((row.state, row.attempt), (skiplock::JobState::Queued, 0));
        assert!(row.scheduled_at > now, "job {id} is still not due");
    }
    // Each retry waited the 3 s it asked for, by the database clock.
    for id in flaky {
        let claims: Vec<_> = log
            .iter()
            .filter(|r| r.job_id == id && r.is_claim())
            .collect();
        let failure = log
            .iter()
            .find(|r| r.job_id == id && r.failure)
            .expect("the first attempt failed");
        assert_eq!(claims.len(), 2);
        let waited = claims[1].claimed_at.unwrap() - failure.at;
        assert!(
            waited >= chrono::Duration::milliseconds(2_900),
            "job {id}: the retry came after {waited}, before its 3 s delay"
        );
    }
}
