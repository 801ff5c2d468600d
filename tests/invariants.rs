//! The invariants of "no single row stops the queue" (README, Guarantees), each checked on
//! rows written by hand as an operator or another language would write them.

mod cli_support;
mod common;

use std::time::Duration;

use cli_support::skiplock;
use common::fixtures::{Recorder, fast_worker, state_of, wait_for, wait_for_a_lock_wait};
use common::test_db;
use serde_json::json;
use skiplock::{EnqueueOptions, JobState, NewJob, UniquePolicy};
use sqlx::PgPool;

/// Longest wait for a worker to settle what the database holds.
const PATIENCE: Duration = Duration::from_secs(30);

/// A `record` job with unique key `k` (policy skip).
fn keyed(n: u32) -> NewJob {
    NewJob::new("record", json!({ "n": n }))
        .with_options(EnqueueOptions::default().unique_key("k", UniquePolicy::Skip))
}

async fn insert(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Rows no API would write, side by side: an attempt at the `int` maximum, an `errors`
/// value that is not a list, a lane whose three jobs someone tried to set `queued` by hand, a job
/// `waiting` for nothing, args that do not decode, a kind no worker knows. Every runnable
/// job runs (the lane's in id order, one at a time), and none of them stops the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_by_hand_never_stop_the_others() {
    let db = test_db().await;
    let pool = &db.pool;
    let overflow = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind, args, attempt, max_attempts)
         VALUES ('record', '{\"n\": 1}', 2147483647, 2147483647) RETURNING id",
    )
    .await;
    let odd_errors = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind, args, errors)
         VALUES ('flaky', '{\"fail_until\": 1}', '{\"not\": \"a list\"}') RETURNING id",
    )
    .await;
    let lane: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, ordering_key)
         SELECT 'record', jsonb_build_object('n', i), 'h' FROM generate_series(1, 3) i
         RETURNING id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    // A lane has one turn (`jobs_lane_turn_idx`): queuing all three by hand is refused,
    // and changes nothing.
    let refused = sqlx::query("UPDATE skiplock.jobs SET state = 'queued' WHERE ordering_key = 'h'")
        .execute(pool)
        .await
        .expect_err("three turns in one lane");
    assert!(
        refused.to_string().contains("jobs_lane_turn_idx"),
        "{refused}"
    );
    let waiting_for_nothing = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind, args, state)
         VALUES ('record', '{\"n\": 2}', 'waiting') RETURNING id",
    )
    .await;
    let undecodable = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind, args) VALUES ('record', '{\"n\": \"x\"}') RETURNING id",
    )
    .await;
    let unknown = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind, args) VALUES ('nobody', '{}') RETURNING id",
    )
    .await;

    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder).build().unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    let mut succeeded = vec![overflow, odd_errors, waiting_for_nothing];
    succeeded.extend(&lane);
    for &id in &succeeded {
        wait_for(&format!("job {id} to succeed"), PATIENCE, || async move {
            state_of(pool, id).await == JobState::Succeeded
        })
        .await;
    }
    wait_for("the undecodable job to die", PATIENCE, || async {
        state_of(pool, undecodable).await == JobState::Dead
    })
    .await;
    stop.shutdown();
    let summary = tokio::time::timeout(PATIENCE, run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(summary.lost, 0, "{summary:?}");
    assert_eq!(state_of(pool, unknown).await, JobState::Queued);
    let runs = recorder.runs();
    assert_eq!(
        runs[&overflow],
        vec![i32::MAX],
        "the attempt stays at the maximum"
    );
    assert_eq!(runs[&odd_errors], vec![1, 2]);
    let errors: serde_json::Value =
        sqlx::query_scalar("SELECT errors FROM skiplock.jobs WHERE id = $1")
            .bind(odd_errors)
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(
        errors.as_array().is_some_and(|e| e.len() == 2),
        "the odd value is kept and the failure appended: {errors}"
    );
    // The lane ran one job at a time, in id order. The handlers' own ticks say so; the
    // rows' claimed_at and finished_at are each the start of their statement's transaction,
    // so a claim that began before the previous completion committed may be stamped before it.
    let spans = recorder.spans();
    let lane_spans: Vec<(u64, u64)> = lane
        .iter()
        .map(|id| {
            assert_eq!(spans[id].len(), 1, "job {id} ran once: {spans:?}");
            spans[id][0]
        })
        .collect();
    for pair in lane_spans.windows(2) {
        assert!(pair[0].1 < pair[1].0, "lane h overlapped: {lane_spans:?}");
    }
}

/// A plain `INSERT` with a pending job's unique key follows the key's policy, as
/// `skiplock.enqueue` does: skip leaves the pending job alone, replace gives it the new
/// args, merge appends them; no second pending row appears.
#[tokio::test]
async fn a_plain_insert_with_a_pending_unique_key_follows_its_policy() {
    let db = test_db().await;
    let pool = &db.pool;
    let first = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind, args, unique_key, unique_policy)
         VALUES ('record', '{\"n\": 1}', 'u', 'merge') RETURNING id",
    )
    .await;
    for (args, policy) in [
        (r#"{"n": 2}"#, "skip"),
        (r#"{"n": 3}"#, "merge"),
        (r#"{"n": 4}"#, "merge"),
    ] {
        let inserted = sqlx::query(
            "INSERT INTO skiplock.jobs (kind, args, unique_key, unique_policy)
             VALUES ('record', $1::jsonb, 'u', $2)",
        )
        .bind(args)
        .bind(policy)
        .execute(pool)
        .await
        .unwrap();
        assert_eq!(inserted.rows_affected(), 0, "no second pending job");
    }
    let args: serde_json::Value =
        sqlx::query_scalar("SELECT args FROM skiplock.jobs WHERE unique_key = 'u'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(args, json!([{"n": 1}, {"n": 3}, {"n": 4}]));
    let via_function: i64 =
        sqlx::query_scalar("SELECT skiplock.enqueue('record', '{\"n\": 5}', unique_key => 'u')")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(via_function, first, "enqueue returns the pending job's id");
}

/// Inside REPEATABLE READ, a unique key taken by a job the snapshot cannot see is refused
/// with a serialization failure (SQLSTATE 40001), which skiplock counts as transient: the
/// caller retries the transaction, and the retry finds the pending job.
#[tokio::test]
async fn a_unique_key_taken_after_a_repeatable_read_snapshot_is_a_serialization_failure() {
    let db = test_db().await;
    let mut late = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *late)
        .await
        .unwrap();
    let _: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs")
        .fetch_one(&mut *late)
        .await
        .unwrap();
    let first = skiplock::enqueue_raw(&db.pool, &[keyed(1)]).await.unwrap()[0].id;
    let error = skiplock::enqueue_raw(&mut *late, &[keyed(2)])
        .await
        .unwrap_err();
    assert!(error.is_transient(), "{error}");
    late.rollback().await.unwrap();
    let again = skiplock::enqueue_raw(&db.pool, &[keyed(2)]).await.unwrap()[0].id;
    assert_eq!(again, first);
}

/// A dependency row written by hand means what `depends_on` means: the child waits for a
/// parent that has not succeeded, is cancelled at once for a parent that died, and a
/// parent cannot be added to a job that already started.
#[tokio::test]
async fn a_dependency_row_written_by_hand_makes_the_child_wait() {
    let db = test_db().await;
    let pool = &db.pool;
    let parent = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind, scheduled_at) VALUES ('record', now() + interval '1 day')
         RETURNING id",
    )
    .await;
    let dead = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind, state, finished_at) VALUES ('record', 'dead', now())
         RETURNING id",
    )
    .await;
    let child = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind) VALUES ('record') RETURNING id",
    )
    .await;
    let doomed = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind) VALUES ('record') RETURNING id",
    )
    .await;
    let started = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind, state, finished_at) VALUES ('record', 'succeeded', now())
         RETURNING id",
    )
    .await;
    let edge = "INSERT INTO skiplock.job_dependencies (job_id, parent_id) VALUES ($1, $2)";
    for (job, parent) in [(child, parent), (doomed, dead)] {
        sqlx::query(edge)
            .bind(job)
            .bind(parent)
            .execute(pool)
            .await
            .unwrap();
    }
    assert_eq!(state_of(pool, child).await, JobState::Waiting);
    assert_eq!(state_of(pool, doomed).await, JobState::Cancelled);
    let refused = sqlx::query(edge)
        .bind(started)
        .bind(parent)
        .execute(pool)
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains(&format!(
            "job {started} already started; a dependency on job {parent} must be added before it runs"
        )),
        "{refused}"
    );
}

/// Claims job `id` by hand (it must be queued) and completes it through the SQL protocol.
async fn run_by_sql(pool: &PgPool, id: i64) {
    let token = claim_by_sql(pool, id).await;
    let done = common::fixtures::sql_complete(pool, id, token).await;
    assert!(done, "job {id} completed");
}

/// A lane job given a parent by plain SQL (`skiplock.enqueue` refuses both) runs in its
/// lane's turn: when its parent succeeds while another job of the lane has the turn, it
/// stays `waiting` (queuing it would give the lane a second turn, which
/// `jobs_lane_turn_idx` refuses: the parent's completion failed), and it is queued when
/// that job ends.
#[tokio::test]
async fn a_lane_job_whose_parent_succeeds_waits_for_its_lanes_turn() {
    let db = test_db().await;
    let pool = &db.pool;
    let lane = "INSERT INTO skiplock.jobs (kind, ordering_key) VALUES ('record', 'l') RETURNING id";
    let head = insert(pool, lane).await;
    let behind = insert(pool, lane).await;
    let parent = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind) VALUES ('record') RETURNING id",
    )
    .await;
    sqlx::query("INSERT INTO skiplock.job_dependencies (job_id, parent_id) VALUES ($1, $2)")
        .bind(behind)
        .bind(parent)
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(state_of(pool, head).await, JobState::Queued);
    assert_eq!(state_of(pool, behind).await, JobState::Waiting);

    run_by_sql(pool, parent).await;
    assert_eq!(
        state_of(pool, behind).await,
        JobState::Waiting,
        "the head has the lane's turn"
    );
    run_by_sql(pool, head).await;
    assert_eq!(state_of(pool, behind).await, JobState::Queued);
    run_by_sql(pool, behind).await;
}

/// Claims job `id` by hand (it must be queued) and returns its claim token.
async fn claim_by_sql(pool: &PgPool, id: i64) -> uuid::Uuid {
    sqlx::query_scalar(
        "UPDATE skiplock.jobs SET state = 'running', claim_token = gen_random_uuid(),
                                  heartbeat_at = now()
         WHERE id = $1 AND state = 'queued' RETURNING claim_token",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A completion whose follow-up steps two lanes takes their locks in one step, never
/// waiting for one lane's lock while holding the other's. Job `h` of lane B runs; job `c`
/// of lane A waits on `h` (an edge written by plain SQL). An application transaction
/// enqueues into lane B (holding B's lock), `skiplock.complete(h)` starts, then the
/// transaction enqueues into lane A. Stepping lane A (for `c`) and lane B (for `h`) in two
/// calls, the completion held A while it waited for B and the transaction waited for A:
/// a deadlock, one side rolled back (SQLSTATE 40P01). Both go through now, and `c` runs
/// in lane A's turn after the transaction's job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_steps_its_lanes_without_closing_a_cycle_with_an_enqueue() {
    let db = test_db().await;
    let pool = &db.pool;
    let in_b = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind, ordering_key) VALUES ('record', 'B') RETURNING id",
    )
    .await;
    let in_a = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind, ordering_key) VALUES ('record', 'A') RETURNING id",
    )
    .await;
    sqlx::query("INSERT INTO skiplock.job_dependencies (job_id, parent_id) VALUES ($1, $2)")
        .bind(in_a)
        .bind(in_b)
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(state_of(pool, in_a).await, JobState::Waiting);
    let token = claim_by_sql(pool, in_b).await;

    let mut app = pool.begin().await.unwrap();
    let enqueue = "SELECT skiplock.enqueue('record', ordering_key => $1)";
    let _: i64 = sqlx::query_scalar(enqueue)
        .bind("B")
        .fetch_one(&mut *app)
        .await
        .unwrap();
    let completer = pool.clone();
    let completion = tokio::spawn(async move {
        sqlx::query_scalar::<_, bool>("SELECT skiplock.complete($1, $2)")
            .bind(in_b)
            .bind(token)
            .fetch_one(&completer)
            .await
    });
    wait_for_a_lock_wait(pool, "the completion to wait for lane B").await;
    let behind_a: i64 = sqlx::query_scalar(enqueue)
        .bind("A")
        .fetch_one(&mut *app)
        .await
        .expect("the enqueue into lane A is not rolled back by a deadlock");
    app.commit().await.unwrap();
    assert!(
        completion
            .await
            .unwrap()
            .expect("the completion is not rolled back by a deadlock"),
        "the claim was held"
    );
    assert_eq!(state_of(pool, in_b).await, JobState::Succeeded);
    assert_eq!(
        state_of(pool, in_a).await,
        JobState::Queued,
        "lane A's head"
    );
    assert_eq!(state_of(pool, behind_a).await, JobState::Waiting);
}

/// A lane's head cancelled because its parent died hands the lane's turn on at once: the
/// job behind it is queued by the same statement, not left for a sweep (it was: nothing
/// stepped the lane of a job cancelled for its parent).
#[tokio::test]
async fn a_lane_head_cancelled_for_its_parent_hands_on_the_turn() {
    let db = test_db().await;
    let pool = &db.pool;
    let parent = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind) VALUES ('record') RETURNING id",
    )
    .await;
    let lane = "INSERT INTO skiplock.jobs (kind, ordering_key) VALUES ('record', 'l') RETURNING id";
    let head = insert(pool, lane).await;
    let behind = insert(pool, lane).await;
    sqlx::query("INSERT INTO skiplock.job_dependencies (job_id, parent_id) VALUES ($1, $2)")
        .bind(head)
        .bind(parent)
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(state_of(pool, head).await, JobState::Waiting);
    assert_eq!(state_of(pool, behind).await, JobState::Waiting);
    let cancelled: bool = sqlx::query_scalar("SELECT skiplock.cancel_job($1)")
        .bind(parent)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(cancelled);
    assert_eq!(state_of(pool, head).await, JobState::Cancelled);
    assert_eq!(state_of(pool, behind).await, JobState::Queued);
}

/// A lane job released by its worker while a newer job of its unique key waits behind it
/// in the lane is superseded (it ends cancelled, the newer job runs instead), and the
/// lane's turn passes to that job in the same statement: it was left for a sweep (the
/// release returned ids only, and nothing stepped the lane).
#[tokio::test]
async fn a_released_lane_job_superseded_by_its_key_hands_on_the_turn() {
    let db = test_db().await;
    let pool = &db.pool;
    let enqueue = "SELECT skiplock.enqueue('record', ordering_key => 'l', unique_key => 'k')";
    let first: i64 = sqlx::query_scalar(enqueue).fetch_one(pool).await.unwrap();
    let token = claim_by_sql(pool, first).await;
    let second: i64 = sqlx::query_scalar(enqueue).fetch_one(pool).await.unwrap();
    assert_ne!(first, second, "the running job holds no pending key");
    assert_eq!(state_of(pool, second).await, JobState::Waiting);
    let released: bool = sqlx::query_scalar("SELECT skiplock.release($1, $2)")
        .bind(first)
        .bind(token)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(released);
    assert_eq!(
        state_of(pool, first).await,
        JobState::Cancelled,
        "superseded"
    );
    assert_eq!(state_of(pool, second).await, JobState::Queued);
}

/// `skiplock retry` of a dead job whose unique key a pending job took says that the job
/// was superseded, and by which job, instead of failing or claiming it was queued.
#[tokio::test]
async fn the_cli_says_when_a_retry_is_superseded() {
    let db = test_db().await;
    let pool = &db.pool;
    let dead = insert(
        pool,
        "INSERT INTO skiplock.jobs (kind, state, finished_at, unique_key)
         VALUES ('record', 'dead', now(), 'k') RETURNING id",
    )
    .await;
    let pending = skiplock::enqueue_raw(pool, &[keyed(1)]).await.unwrap()[0].id;
    assert_eq!(
        skiplock(&db, &["retry", &dead.to_string()]).await.ok(),
        format!(
            "job {dead} not requeued: superseded: pending job {pending} holds unique_key k and runs instead\n"
        )
    );
    assert_eq!(state_of(pool, dead).await, JobState::Cancelled);
    assert_eq!(state_of(pool, pending.0).await, JobState::Queued);
}

/// One `DELETE` that removes a parent together with its waiting child works (the child's
/// cancellation must not collide with its own deletion), and deleting a parent alone
/// cancels its waiting child and, through it, the grandchild.
#[tokio::test]
async fn deleting_parents_cancels_waiting_children_and_deletes_them_together() {
    let db = test_db().await;
    let pool = &db.pool;
    let enqueue = "SELECT skiplock.enqueue('record', queue => $1,
                          scheduled_at => now() + interval '1 day', depends_on => $2)";
    let mut ids = Vec::new();
    for queue in ["x", "y"] {
        let parent: i64 = sqlx::query_scalar(enqueue)
            .bind(queue)
            .bind(Vec::<i64>::new())
            .fetch_one(pool)
            .await
            .unwrap();
        let child: i64 = sqlx::query_scalar(enqueue)
            .bind(queue)
            .bind(vec![parent])
            .fetch_one(pool)
            .await
            .unwrap();
        let grandchild: i64 = sqlx::query_scalar(enqueue)
            .bind(queue)
            .bind(vec![child])
            .fetch_one(pool)
            .await
            .unwrap();
        ids.push((parent, child, grandchild));
    }
    let deleted = sqlx::query("DELETE FROM skiplock.jobs WHERE queue = 'x'")
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(deleted.rows_affected(), 3);
    let (parent, child, grandchild) = ids[1];
    sqlx::query("DELETE FROM skiplock.jobs WHERE id = $1")
        .bind(parent)
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(state_of(pool, child).await, JobState::Cancelled);
    assert_eq!(state_of(pool, grandchild).await, JobState::Cancelled);
    let reason: String = sqlx::query_scalar("SELECT last_error FROM skiplock.jobs WHERE id = $1")
        .bind(child)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(
        reason,
        format!("parent job {parent} was deleted while queued")
    );
}

/// A `record` job waiting on a parent written dead by hand (finished a day ago): (parent,
/// child). The child is not settled yet.
async fn child_of_a_dead_parent(pool: &PgPool) -> (i64, i64) {
    let parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('record')")
        .fetch_one(pool)
        .await
        .unwrap();
    let child: i64 =
        sqlx::query_scalar("SELECT skiplock.enqueue('record', depends_on => ARRAY[$1]::bigint[])")
            .bind(parent)
            .fetch_one(pool)
            .await
            .unwrap();
    sqlx::query(
        "UPDATE skiplock.jobs SET state = 'dead', finished_at = now() - interval '1 day'
         WHERE id = $1",
    )
    .bind(parent)
    .execute(pool)
    .await
    .unwrap();
    (parent, child)
}

/// Found by the 30-minute model run: a dead parent was pruned after its child had been
/// cancelled for it, the child was then retried by hand, found no parent left, and ran.
/// Now the pruned parent leaves a tombstone on the edge (as a day dropped whole does), and
/// the retried child is cancelled again for the parent that failed.
#[tokio::test]
async fn a_retried_child_of_a_pruned_dead_parent_does_not_run() {
    let db = test_db().await;
    let pool = &db.pool;
    let (parent, child) = child_of_a_dead_parent(pool).await;
    sqlx::query("SELECT skiplock.internal_settle_dependants(ARRAY[$1]::bigint[])")
        .bind(parent)
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(state_of(pool, child).await, JobState::Cancelled);
    // Dead jobs at zero retention; the cancelled child is kept a day.
    let pruned = skiplock::db::maintenance::jobs_prune_finished(pool, 0, 86_400_000, 0, 100)
        .await
        .unwrap();
    assert_eq!(pruned, 1, "the dead parent is pruned");
    let retried: bool = sqlx::query_scalar("SELECT skiplock.retry_job($1)")
        .bind(child)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(retried);
    assert_eq!(state_of(pool, child).await, JobState::Cancelled);
    let reason: String = sqlx::query_scalar("SELECT last_error FROM skiplock.jobs WHERE id = $1")
        .bind(child)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(
        reason,
        format!("parent job {parent} was deleted while dead")
    );
}

/// Found by a race review of the lookups by id: a statement reads a child's edges in its
/// own snapshot and looks each parent up in a newer one. A dead parent deleted between the
/// two (the pruner's row deletes, or by hand) was gone from the lookup while its tombstone,
/// written by the same delete, was not yet in the edge that statement read, so the edge
/// counted as met and `retry_job` could queue the cancelled child. The reader here takes
/// its snapshot, then waits on a lock the deleter holds until its delete has committed.
#[tokio::test]
async fn a_dead_parent_deleted_while_its_edge_is_read_still_holds_its_child() {
    let db = test_db().await;
    let pool = &db.pool;
    let (parent, child) = child_of_a_dead_parent(pool).await;
    let mut deleter = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(4901)")
        .execute(&mut *deleter)
        .await
        .unwrap();
    let reader = tokio::spawn({
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "WITH turn AS MATERIALIZED (SELECT pg_advisory_xact_lock(4901))
                 SELECT skiplock.internal_has_unmet_parent($1) FROM turn",
            )
            .bind(child)
            .fetch_one(&pool)
            .await
        }
    });
    wait_for_a_lock_wait(pool, "the reader to wait for the deleter's lock").await;
    sqlx::query("DELETE FROM skiplock.jobs WHERE id = $1")
        .bind(parent)
        .execute(&mut *deleter)
        .await
        .unwrap();
    deleter.commit().await.unwrap();
    let unmet = reader.await.unwrap().unwrap();
    assert!(
        unmet,
        "the child's parent died and was deleted: its edge is unmet (its tombstone)"
    );
}

/// A `running` row whose `heartbeat_at` was written by hand far in the future (a year on)
/// is taken back like a stale one, with a reason saying so, and runs: heartbeats use the
/// database clock, so no live claim can be there, and waiting for it would keep the job
/// `running` for a year.
#[tokio::test]
async fn a_heartbeat_written_in_the_future_is_taken_back() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = skiplock::enqueue_raw(pool, &[NewJob::new("record", json!({ "n": 1 }))])
        .await
        .unwrap()[0]
        .id
        .0;
    sqlx::query(
        "UPDATE skiplock.jobs
         SET state = 'running', attempt = 1, claim_token = gen_random_uuid(),
             claimed_by = 'ghost', claimed_at = now(),
             heartbeat_at = now() + interval '1 year'
         WHERE id = $1",
    )
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder).build().unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the job to be taken back and run", PATIENCE, || async {
        state_of(pool, id).await == JobState::Succeeded
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
    let first_error: String =
        sqlx::query_scalar("SELECT errors -> 0 ->> 'message' FROM skiplock.jobs WHERE id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(
        first_error.contains(
            "of ghost is in the future by the database clock (written by hand?); claim taken back"
        ),
        "{first_error}"
    );
    assert_eq!(recorder.runs()[&id], vec![2]);
}

/// `errors` entries written by hand whose `at` is not a time ('soon', February 30th, a
/// number, an entry that is not an object), and an `errors` that is not a list, stop
/// neither the dashboard's throughput (its chart) nor the pruner's history rollup: both
/// count the entries they can place in time and skip the rest.
#[tokio::test]
async fn bad_error_entries_stop_neither_the_throughput_nor_the_pruner() {
    let db = test_db().await;
    let pool = &db.pool;
    let ids = skiplock::enqueue_raw(
        pool,
        &[
            NewJob::new("record", json!({ "n": 1 })),
            NewJob::new("record", json!({ "n": 2 })),
        ],
    )
    .await
    .unwrap();
    sqlx::query(
        "UPDATE skiplock.jobs
         SET state = 'dead', attempt = 4, finished_at = now(), last_error = 'by hand',
             errors = CASE WHEN id = $1
                 THEN jsonb_build_array(
                     jsonb_build_object('attempt', 1, 'at', now(), 'message', 'a real one'),
                     '{\"attempt\": 2, \"at\": \"soon\", \"message\": \"x\"}'::jsonb,
                     '{\"attempt\": 3, \"at\": \"2026-02-30T00:00:00Z\", \"message\": \"x\"}'::jsonb,
                     '5'::jsonb)
                 ELSE '{\"not\": \"a list\"}'::jsonb END
         WHERE id = ANY($2)",
    )
    .bind(ids[0].id.0)
    .bind(ids.iter().map(|job| job.id.0).collect::<Vec<_>>())
    .execute(pool)
    .await
    .unwrap();
    let since = chrono::Utc::now().timestamp() - 3600;
    let throughput = skiplock::unstable_cli::dashboard_throughput(pool, since)
        .await
        .expect("the throughput reads past the bad entries");
    let failed: i64 = throughput.failed.0.iter().map(|(_, n)| n).sum();
    assert_eq!(failed, 1, "only the entry with a real time counts");

    let pruned = skiplock::unstable_cli::jobs_prune_finished_rolled_up(pool, 0, 0, 0, 100)
        .await
        .expect("the pruner rolls up past the bad entries");
    assert_eq!(pruned, 2);
    let (dead, failures): (i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum(dead), 0)::bigint, coalesce(sum(failed), 0)::bigint
         FROM skiplock.job_history",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((dead, failures), (2, 1));
}
