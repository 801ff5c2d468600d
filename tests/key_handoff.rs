//! A key's freed slot handed on: a worker's completion of a job whose key has a running
//! limit (`key_max_running`) claims the key's next job for the same worker in the same
//! transaction (`skiplock.internal_complete_handing_on`), instead of leaving the slot for
//! the queue's next claim. It never takes a job the claim would not take next, nor one a
//! rule it does not keep would hold back; what it does not hand on is left for a claim.
//! Exactness across processes, SQL workers and a killed worker: tests/limits.rs
//! (`key_max_running_holds_across_processes_sql_workers_and_a_killed_worker`); a lost
//! reply: tests/faults_server.rs.

mod common;
mod fault_support;

use std::time::Duration;

use common::fixtures::{Recorder, fast_worker, insert_noop_jobs, strings};
use fault_support::{PATIENCE, audit, audited_db};
use skiplock::db::jobs::{Handoff, jobs_claim_batch, jobs_complete_handing_on, jobs_complete_many};
use skiplock::{EnqueueOptions, QueueLimits};
use sqlx::PgPool;
use uuid::Uuid;

/// The keys of `queue` left for its next claim (`skiplock.key_slots_freed`), sorted.
async fn left_for_claims(pool: &PgPool, queue: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT concurrency_key FROM skiplock.key_slots_freed WHERE queue = $1 ORDER BY 1",
    )
    .bind(queue)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Two keys of a queue with key_max_running 1, three jobs each, written by plain SQL: a
/// claim takes the first of each (and says their keys are limited); their completion
/// hands each key's slot on to the worker, claiming the key's next job (held back by the
/// claim) with the worker's token, and leaves nothing for a claim. The plain completion of
/// those hands nothing on and leaves both keys for the next claim.
#[tokio::test]
async fn a_completion_hands_each_keys_freed_slot_on_to_its_worker() {
    let db = audited_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(pool, "q", QueueLimits::default().key_max_running(1))
        .await
        .unwrap();
    let mut a = Vec::new();
    let mut b = Vec::new();
    for _ in 0..3 {
        a.extend(insert_noop_jobs(pool, "q", Some("a"), 1).await);
        b.extend(insert_noop_jobs(pool, "q", Some("b"), 1).await);
    }
    let claimed = jobs_claim_batch(pool, "q", &strings(&["noop"]), 10, "w1")
        .await
        .unwrap();
    let mut first: Vec<i64> = claimed.iter().map(|j| j.id).collect();
    first.sort_unstable();
    assert_eq!(first, [a[0], b[0]], "the claim takes one job of each key");
    assert!(claimed.iter().all(|j| j.key_limited), "{claimed:?}");

    let token = Uuid::new_v4();
    let kinds = strings(&["noop"]);
    let hand = Handoff {
        worker: "w1",
        kinds: &kinds,
        token,
    };
    let ids: Vec<i64> = claimed.iter().map(|j| j.id).collect();
    let tokens: Vec<Uuid> = claimed.iter().map(|j| j.claim_token).collect();
    let done = jobs_complete_handing_on(pool, &ids, &tokens, &hand)
        .await
        .unwrap();
    assert_eq!(done.saved.len(), 2, "{done:?}");
    let mut handed: Vec<i64> = done.handed.iter().map(|j| j.id).collect();
    handed.sort_unstable();
    assert_eq!(handed, [a[1], b[1]], "each key's next job is handed on");
    for job in &done.handed {
        assert_eq!(job.claim_token, token);
        assert_eq!(job.attempt, 1);
        assert!(job.key_limited);
    }
    let rows: Vec<(i64, String, Option<String>, Option<Uuid>)> = sqlx::query_as(
        "SELECT id, state::text, claimed_by, claim_token FROM skiplock.jobs
         WHERE id = ANY($1) ORDER BY id",
    )
    .bind(&handed)
    .fetch_all(pool)
    .await
    .unwrap();
    for (id, state, by, held_with) in &rows {
        assert_eq!(
            (state.as_str(), by.as_deref(), *held_with),
            ("running", Some("w1"), Some(token)),
            "job {id}"
        );
    }
    assert!(
        left_for_claims(pool, "q").await.is_empty(),
        "a slot handed on is not left for a claim"
    );

    let saved = jobs_complete_many(pool, &handed, &[token, token])
        .await
        .unwrap();
    assert_eq!(saved.len(), 2);
    assert_eq!(
        left_for_claims(pool, "q").await,
        ["a", "b"],
        "the plain completion leaves both keys for the next claim"
    );
    let running: i64 =
        sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state = 'running'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(running, 0, "the plain completion hands nothing on");
}

/// What a handoff does not take, each in a queue of its own with key_max_running 1 where
/// a claim took a key's first job: the key's next job behind another key's due job in
/// claim order (the claim takes that one first), of a kind the worker does not run, not
/// due yet, held back by its key and then given a parent by hand, in a queue paused since,
/// with a rate limit (a handoff records no start), with fair queueing (keys take turns
/// through claims) or with a max_running (a lowered one would need the queue's running
/// jobs counted). Each completion hands nothing on and leaves the key for the next claim.
/// Nor does a key whose limit was lowered under its running jobs get a job.
#[tokio::test]
async fn a_handoff_takes_only_what_the_next_claim_would_take() {
    let db = audited_db().await;
    let pool = &db.pool;
    let noop = strings(&["noop"]);
    let write = |sql: &'static str, id: i64| async move {
        sqlx::query(sql).bind(id).execute(pool).await.unwrap();
    };
    for (case, queue) in [
        ("another key's job ahead", "ahead"),
        ("kind not run", "kind"),
        ("not due", "later"),
        ("parent given by hand", "parent"),
        ("paused", "paused"),
        ("rate limit", "rated"),
        ("fair queueing", "fair"),
        ("max_running", "bounded"),
    ] {
        skiplock::set_queue_limits(pool, queue, QueueLimits::default().key_max_running(1))
            .await
            .unwrap();
        let jobs = insert_noop_jobs(pool, queue, Some("a"), 2).await;
        let mut claim_max = 10;
        match queue {
            "ahead" => {
                write(
                    "UPDATE skiplock.jobs SET priority = 5 WHERE id = $1",
                    jobs[1],
                )
                .await;
                let other = insert_noop_jobs(pool, queue, None, 1).await[0];
                write("UPDATE skiplock.jobs SET priority = 1 WHERE id = $1", other).await;
                claim_max = 1;
            }
            "kind" => {
                write(
                    "UPDATE skiplock.jobs SET kind = 'sleep' WHERE id = $1",
                    jobs[1],
                )
                .await
            }
            "later" => write(
                "UPDATE skiplock.jobs SET scheduled_at = now() + interval '1 hour' WHERE id = $1",
                jobs[1],
            )
            .await,
            "rated" => {
                sqlx::query(
                    "UPDATE skiplock.queues SET rate_limit = 1000, rate_period = '1 second'
                     WHERE name = $1",
                )
                .bind(queue)
                .execute(pool)
                .await
                .unwrap();
            }
            "fair" => {
                sqlx::query("UPDATE skiplock.queues SET key_claimable = 1 WHERE name = $1")
                    .bind(queue)
                    .execute(pool)
                    .await
                    .unwrap();
            }
            "bounded" => {
                sqlx::query("UPDATE skiplock.queues SET max_running = 100 WHERE name = $1")
                    .bind(queue)
                    .execute(pool)
                    .await
                    .unwrap();
            }
            _ => {}
        }
        let claimed = jobs_claim_batch(pool, queue, &strings(&["noop", "sleep"]), claim_max, "w1")
            .await
            .unwrap();
        assert_eq!(
            claimed.iter().map(|j| j.id).collect::<Vec<_>>(),
            [jobs[0]],
            "{case}"
        );
        match queue {
            "parent" => {
                let state: String =
                    sqlx::query_scalar("SELECT held_for FROM skiplock.jobs WHERE id = $1")
                        .bind(jobs[1])
                        .fetch_one(pool)
                        .await
                        .unwrap();
                assert_eq!(
                    state, "key",
                    "{case}: the claim held the key's next job back"
                );
                let parent = insert_noop_jobs(pool, "elsewhere", None, 1).await[0];
                sqlx::query(
                    "INSERT INTO skiplock.job_dependencies (job_id, parent_id) VALUES ($1, $2)",
                )
                .bind(jobs[1])
                .bind(parent)
                .execute(pool)
                .await
                .unwrap();
            }
            "paused" => skiplock::pause_queue(pool, queue).await.unwrap(),
            _ => {}
        }
        let hand = Handoff {
            worker: "w1",
            kinds: &noop,
            token: Uuid::new_v4(),
        };
        let done = jobs_complete_handing_on(pool, &[jobs[0]], &[claimed[0].claim_token], &hand)
            .await
            .unwrap();
        assert_eq!(done.saved.len(), 1, "{case}");
        assert!(done.handed.is_empty(), "{case}: {:?}", done.handed);
        let next: String =
            sqlx::query_scalar("SELECT state::text FROM skiplock.jobs WHERE id = $1")
                .bind(jobs[1])
                .fetch_one(pool)
                .await
                .unwrap();
        assert_ne!(next, "running", "{case}");
        assert_eq!(left_for_claims(pool, queue).await, ["a"], "{case}");
    }

    // A limit lowered under the key's running jobs: a freed slot leaves it at the limit.
    skiplock::set_queue_limits(pool, "lowered", QueueLimits::default().key_max_running(2))
        .await
        .unwrap();
    let jobs = insert_noop_jobs(pool, "lowered", Some("a"), 3).await;
    let claimed = jobs_claim_batch(pool, "lowered", &noop, 10, "w1")
        .await
        .unwrap();
    assert_eq!(claimed.len(), 2);
    skiplock::set_queue_limits(pool, "lowered", QueueLimits::default().key_max_running(1))
        .await
        .unwrap();
    let hand = Handoff {
        worker: "w1",
        kinds: &noop,
        token: Uuid::new_v4(),
    };
    let done = jobs_complete_handing_on(pool, &[claimed[0].id], &[claimed[0].claim_token], &hand)
        .await
        .unwrap();
    assert!(done.handed.is_empty(), "{:?}", done.handed);
    let third: String = sqlx::query_scalar("SELECT state::text FROM skiplock.jobs WHERE id = $1")
        .bind(jobs[2])
        .fetch_one(pool)
        .await
        .unwrap();
    assert_ne!(third, "running");
}

/// A handoff locks only the rows it takes: with key_max_running 2, one running job of a key
/// completed by the SQL protocol (its slot left for the next claim) and the other by a
/// worker handing on in a transaction left open, the handoff takes the key's queued job of
/// the higher priority and leaves its held one unlocked; a claim beside it lets that one go
/// and takes it. Before, the handoff also locked the held job it did not take: the claim
/// passed over it and used up the key's slot left for it, and the held job waited for a
/// sweep with a slot of its key free.
#[tokio::test]
async fn a_handoff_leaves_the_rows_it_does_not_take_to_a_claim_beside_it() {
    let db = audited_db().await;
    let pool = &db.pool;
    let noop = strings(&["noop"]);
    skiplock::set_queue_limits(pool, "kq", QueueLimits::default().key_max_running(2))
        .await
        .unwrap();
    let ids = insert_noop_jobs(pool, "kq", Some("k"), 4).await;
    let (a, b, held, queued) = (ids[0], ids[1], ids[2], ids[3]);
    for (id, priority) in [(a, -5), (b, -5), (held, 0), (queued, -1)] {
        sqlx::query("UPDATE skiplock.jobs SET priority = $2 WHERE id = $1")
            .bind(id)
            .bind(priority)
            .execute(pool)
            .await
            .unwrap();
    }
    let claimed = jobs_claim_batch(pool, "kq", &noop, 10, "w1").await.unwrap();
    let mut running: Vec<i64> = claimed.iter().map(|j| j.id).collect();
    running.sort_unstable();
    assert_eq!(running, [a, b]);
    // The claim held the other two back; the higher one is queued again by hand.
    sqlx::query("UPDATE skiplock.jobs SET state = 'queued', held_for = NULL WHERE id = $1")
        .bind(queued)
        .execute(pool)
        .await
        .unwrap();
    let token_of = |id: i64| claimed.iter().find(|j| j.id == id).unwrap().claim_token;
    assert!(common::fixtures::sql_complete(pool, b, token_of(b)).await);
    assert_eq!(left_for_claims(pool, "kq").await, ["k"]);

    let mut open = pool.begin().await.unwrap();
    let hand = Handoff {
        worker: "w1",
        kinds: &noop,
        token: Uuid::new_v4(),
    };
    let done = jobs_complete_handing_on(&mut *open, &[a], &[token_of(a)], &hand)
        .await
        .unwrap();
    assert_eq!(
        done.handed.iter().map(|j| j.id).collect::<Vec<_>>(),
        [queued]
    );
    let beside = jobs_claim_batch(pool, "kq", &noop, 10, "w2").await.unwrap();
    open.commit().await.unwrap();
    assert_eq!(
        beside.iter().map(|j| j.id).collect::<Vec<_>>(),
        [held],
        "the claim beside the handoff took the key's held job"
    );
    let running: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs WHERE concurrency_key = 'k' AND state = 'running'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(running, 2, "never more than key_max_running");
}

/// A key's next job whose row refuses to start (a trigger of the user's) is not handed
/// on, and the completion that would have handed it on is saved all the same: the slot is
/// left for the next claim. Before, the refusal failed the completion, and a completion
/// refused down to its own job makes that job dead.
#[tokio::test]
async fn a_row_that_refuses_to_start_never_fails_the_completion_handing_on() {
    let db = audited_db().await;
    let pool = &db.pool;
    let noop = strings(&["noop"]);
    skiplock::set_queue_limits(pool, "picky", QueueLimits::default().key_max_running(1))
        .await
        .unwrap();
    let jobs = insert_noop_jobs(pool, "picky", Some("a"), 2).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION public.refuse_start() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.id = {} AND NEW.state = 'running' THEN
                 RAISE EXCEPTION 'this job may not start';
             END IF;
             RETURN NEW;
         END;
         $$;
         CREATE TRIGGER refuse_start BEFORE UPDATE ON skiplock.jobs_live
             FOR EACH ROW EXECUTE FUNCTION public.refuse_start();",
        jobs[1]
    )))
    .execute(pool)
    .await
    .unwrap();
    let claimed = jobs_claim_batch(pool, "picky", &noop, 10, "w1")
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let hand = Handoff {
        worker: "w1",
        kinds: &noop,
        token: Uuid::new_v4(),
    };
    let done = jobs_complete_handing_on(pool, &[jobs[0]], &[claimed[0].claim_token], &hand)
        .await
        .expect("the completion is saved whatever the next job's row says");
    assert_eq!(done.saved.len(), 1);
    assert!(done.handed.is_empty(), "{:?}", done.handed);
    assert_eq!(left_for_claims(pool, "picky").await, ["a"]);
}

/// Workload: 20 jobs of one key in a queue with key_max_running 1, run by one worker that
/// never polls (a claim comes only at its start and when a job is announced).
///
/// Invariant: after the first, each job of the key starts in the transaction that
/// completed the job before it (its start and that end share a transaction id in the
/// audit): the freed slot is taken in the completion's commit, by the worker that freed
/// it, with no claim between. Every job succeeds once; the key never runs two at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_runs_a_keys_backlog_through_its_completions() {
    let db = audited_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(pool, "keyed", QueueLimits::default().key_max_running(1))
        .await
        .unwrap();
    let ids = fault_support::enqueue_n(
        pool,
        "record",
        serde_json::json!({"n": 1}),
        20,
        EnqueueOptions::new().queue("keyed").concurrency_key("k"),
    )
    .await;
    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder)
        .queues(["keyed"])
        .poll_interval(Duration::from_secs(3_600))
        .exit_when_idle(true)
        .build()
        .unwrap();
    let summary = tokio::time::timeout(PATIENCE, worker.run())
        .await
        .expect("the worker drains its queue")
        .unwrap();
    assert_eq!(summary.succeeded, 20, "{summary:?}");
    let log = audit(pool).await;
    fault_support::check_claim_discipline(&log, false);
    let end_of = |id: i64| {
        log.iter()
            .find(|r| {
                r.job_id == id
                    && r.old_state.as_deref() == Some("running")
                    && r.new_state.as_deref() == Some("succeeded")
            })
            .unwrap_or_else(|| panic!("job {id} succeeded"))
            .txid
    };
    let start_of = |id: i64| {
        log.iter()
            .find(|r| r.job_id == id && r.is_start())
            .unwrap_or_else(|| panic!("job {id} started"))
            .txid
    };
    let handed = ids
        .windows(2)
        .filter(|pair| start_of(pair[1]) == end_of(pair[0]))
        .count();
    assert_eq!(
        handed, 19,
        "each job after the first starts in its predecessor's completion"
    );
    assert_eq!(recorder.total(), 20);
}
