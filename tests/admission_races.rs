//! No job waits for a sweep when the transaction that enqueues it and the one that ends
//! what it waits for (its lane's running job, its parent) overlap, whichever commits first
//! (issue 48, item 0). Each test holds both transactions open on two sessions, with no
//! worker and no sweep running, so only the statements under test can queue the job.
//!
//! Before the fix each of these left the job `waiting` until a periodic sweep: the enqueue
//! saw the lane's job (or the parent) unfinished, and the completion could not see the
//! uncommitted job (or edge). One more case closes the lane's: an enqueue whose id was drawn
//! before a later one of its lane took the lane's lock.

mod common;

use std::time::Duration;

use common::fixtures::{sql_claim_one, state_of, strings};
use common::test_db;
use skiplock::JobState;
use skiplock::db::jobs::jobs_complete_many;
use skiplock::db::maintenance::{jobs_advance_lanes, jobs_settle_dependants};
use sqlx::Arguments;
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgArguments;
use sqlx::{PgPool, Postgres};
use tokio::task::JoinHandle;
use uuid::Uuid;

/// The job is queued and a claim of its queue takes it.
async fn assert_claimable(pool: &PgPool, id: i64, queue: &str, what: &str) {
    assert_eq!(state_of(pool, id).await, JobState::Queued, "{what}");
    let (claimed, _) = sql_claim_one(pool, queue, "race-test").await;
    assert_eq!(claimed, id, "{what}: the claim takes it");
}

/// Waits until `task` has ended or some session of the test's database waits for a lock
/// (the statement the task runs blocked behind the other open transaction); panics after
/// 60 s.
async fn until_blocked_or_done<T>(pool: &PgPool, task: &JoinHandle<T>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if task.is_finished() {
            return;
        }
        let waiting: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                            WHERE datname = current_database() AND wait_event_type = 'Lock')",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the statement neither ended nor waited for a lock within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs `sql` (returning one bigint, or NULL) with `args` on `conn` in a task, so the
/// test can go on while it waits for a lock; the task gives the connection back with the
/// value.
fn spawn_scalar(
    mut conn: PoolConnection<Postgres>,
    sql: &'static str,
    args: PgArguments,
) -> JoinHandle<(PoolConnection<Postgres>, sqlx::Result<Option<i64>>)> {
    tokio::spawn(async move {
        let value = sqlx::query_scalar_with::<_, Option<i64>, _>(sql, args)
            .fetch_one(&mut *conn)
            .await;
        (conn, value)
    })
}

/// Arguments of a statement: a job id, and its claim token when given.
fn args(id: i64, token: Option<Uuid>) -> PgArguments {
    let mut args = PgArguments::default();
    args.add(id).unwrap();
    if let Some(token) = token {
        args.add(token).unwrap();
    }
    args
}

/// Enqueues with `sql` in a transaction of its own on a new session while `held` (a
/// transaction that ended what the job waits for) is still open: the enqueue waits for
/// it, `held` commits, then the enqueue commits. Returns the job's id.
async fn enqueue_beside_held(
    pool: &PgPool,
    held: sqlx::Transaction<'_, Postgres>,
    sql: &'static str,
    args: PgArguments,
) -> i64 {
    let mut enqueuer = pool.acquire().await.unwrap();
    sqlx::query("BEGIN").execute(&mut *enqueuer).await.unwrap();
    let enqueue = spawn_scalar(enqueuer, sql, args);
    until_blocked_or_done(pool, &enqueue).await;
    held.commit().await.unwrap();
    let (mut enqueuer, id) = enqueue.await.unwrap();
    let id = id.unwrap().expect("the enqueued job's id");
    sqlx::query("COMMIT").execute(&mut *enqueuer).await.unwrap();
    id
}

async fn enqueue_in_lane(pool: &PgPool, queue: &str, lane: &str) -> i64 {
    sqlx::query_scalar("SELECT skiplock.enqueue('noop', queue => $1, ordering_key => $2)")
        .bind(queue)
        .bind(lane)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_lane_job_committed_after_its_head_finished_and_the_lane_stepped_is_queued() {
    // The Rust worker's path: the completion commits, then the lane's step runs in a
    // transaction of its own, while the enqueue of the lane's next job is still open.
    let db = test_db().await;
    let pool = &db.pool;
    let head = enqueue_in_lane(pool, "q", "lane").await;
    let (claimed, token) = sql_claim_one(pool, "q", "race-test").await;
    assert_eq!(claimed, head);

    let mut enqueue = pool.begin().await.unwrap();
    let next: i64 =
        sqlx::query_scalar("SELECT skiplock.enqueue('noop', queue => 'q', ordering_key => 'lane')")
            .fetch_one(&mut *enqueue)
            .await
            .unwrap();
    let saved = jobs_complete_many(pool, &[head], &[token]).await.unwrap();
    assert_eq!(saved.len(), 1);
    let lanes = strings(&["lane"]);
    let step_pool = pool.clone();
    let step = tokio::spawn(async move { jobs_advance_lanes(&step_pool, &lanes).await });
    until_blocked_or_done(pool, &step).await;
    enqueue.commit().await.unwrap();
    step.await.unwrap().unwrap();
    assert_claimable(
        pool,
        next,
        "q",
        "the lane job whose enqueue committed after its lane's step",
    )
    .await;
}

#[tokio::test]
async fn a_lane_job_enqueued_beside_a_protocol_completion_is_queued_whichever_goes_first() {
    let db = test_db().await;
    let pool = &db.pool;

    // The enqueue first (a plain INSERT), then skiplock.complete in a transaction of its
    // own; the enqueue commits first.
    let head = enqueue_in_lane(pool, "q", "a").await;
    let (_, token) = sql_claim_one(pool, "q", "race-test").await;
    let mut enqueue = pool.begin().await.unwrap();
    let next: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, queue, ordering_key) VALUES ('noop', 'q', 'a')
         RETURNING id",
    )
    .fetch_one(&mut *enqueue)
    .await
    .unwrap();
    let mut completer = pool.acquire().await.unwrap();
    sqlx::query("BEGIN").execute(&mut *completer).await.unwrap();
    let complete = spawn_scalar(
        completer,
        "SELECT skiplock.complete($1, $2)::int::bigint",
        args(head, Some(token)),
    );
    until_blocked_or_done(pool, &complete).await;
    enqueue.commit().await.unwrap();
    let (mut completer, done) = complete.await.unwrap();
    assert_eq!(done.unwrap(), Some(1), "the head completed");
    sqlx::query("COMMIT")
        .execute(&mut *completer)
        .await
        .unwrap();
    assert_claimable(pool, next, "q", "enqueued first, committed first").await;

    // The completion first, held open; then skiplock.enqueue; the completion commits first.
    let head = enqueue_in_lane(pool, "q", "b").await;
    let (_, token) = sql_claim_one(pool, "q", "race-test").await;
    let mut completion = pool.begin().await.unwrap();
    let done = common::fixtures::sql_complete(&mut *completion, head, token).await;
    assert!(done);
    let next = enqueue_beside_held(
        pool,
        completion,
        "SELECT skiplock.enqueue('noop', queue => 'q', ordering_key => 'b')",
        PgArguments::default(),
    )
    .await;
    assert_claimable(pool, next, "q", "completed first, committed first").await;
}

#[tokio::test]
async fn a_child_enqueued_while_its_parent_completes_is_queued_whichever_goes_first() {
    let db = test_db().await;
    let pool = &db.pool;

    // The child's enqueue first, held open; the Rust worker's completion waits for it and
    // its follow-up (run only when the completion reports dependants) queues the child.
    let parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop', queue => 'p')")
        .fetch_one(pool)
        .await
        .unwrap();
    let (_, token) = sql_claim_one(pool, "p", "race-test").await;
    let mut enqueue = pool.begin().await.unwrap();
    let child: i64 = sqlx::query_scalar(
        "SELECT skiplock.enqueue('noop', queue => 'c', depends_on => ARRAY[$1]::bigint[])",
    )
    .bind(parent)
    .fetch_one(&mut *enqueue)
    .await
    .unwrap();
    let complete_pool = pool.clone();
    let complete =
        tokio::spawn(async move { jobs_complete_many(&complete_pool, &[parent], &[token]).await });
    until_blocked_or_done(pool, &complete).await;
    enqueue.commit().await.unwrap();
    let saved = complete.await.unwrap().unwrap();
    assert_eq!(saved.len(), 1);
    assert!(
        saved[0].has_dependants,
        "the completion sees the child whose enqueue it waited for"
    );
    jobs_settle_dependants(pool, &[parent]).await.unwrap();
    assert_claimable(pool, child, "c", "the child enqueued first").await;

    // The completion first (skiplock.complete, held open), then the child's enqueue, which
    // waits for it; the completion commits first.
    let parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop', queue => 'p')")
        .fetch_one(pool)
        .await
        .unwrap();
    let (_, token) = sql_claim_one(pool, "p", "race-test").await;
    let mut completion = pool.begin().await.unwrap();
    let done = common::fixtures::sql_complete(&mut *completion, parent, token).await;
    assert!(done);
    let child = enqueue_beside_held(
        pool,
        completion,
        "SELECT skiplock.enqueue('noop', queue => 'c', depends_on => ARRAY[$1]::bigint[])",
        args(parent, None),
    )
    .await;
    assert_claimable(pool, child, "c", "the child enqueued after").await;
}

#[tokio::test]
async fn a_child_enqueued_while_its_parent_dies_is_cancelled() {
    let db = test_db().await;
    let pool = &db.pool;
    let parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop', max_attempts => 1)")
        .fetch_one(pool)
        .await
        .unwrap();
    let (_, token) = sql_claim_one(pool, "default", "race-test").await;
    let mut failure = pool.begin().await.unwrap();
    let now: String = sqlx::query_scalar("SELECT skiplock.fail($1, $2, 'boom')::text")
        .bind(parent)
        .bind(token)
        .fetch_one(&mut *failure)
        .await
        .unwrap();
    assert_eq!(now, "dead");
    let child = enqueue_beside_held(
        pool,
        failure,
        "SELECT skiplock.enqueue('noop', queue => 'c', depends_on => ARRAY[$1]::bigint[])",
        args(parent, None),
    )
    .await;
    assert_eq!(
        state_of(pool, child).await,
        JobState::Cancelled,
        "the child of a parent that died while it was enqueued"
    );
}

#[tokio::test]
async fn a_repeatable_read_enqueue_behind_a_lane_job_finished_since_its_snapshot_is_retried() {
    // Its snapshot predates the lane's last job's end and step: it would see that job
    // unfinished and wait behind it for good. It fails with a serialization failure
    // instead, for the caller to retry with a fresh snapshot.
    let db = test_db().await;
    let pool = &db.pool;
    let head = enqueue_in_lane(pool, "q", "rr").await;
    let (_, token) = sql_claim_one(pool, "q", "race-test").await;
    let mut enqueue = pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *enqueue)
        .await
        .unwrap();
    sqlx::query("SELECT 1")
        .execute(&mut *enqueue)
        .await
        .unwrap();
    let done = common::fixtures::sql_complete(pool, head, token).await;
    assert!(done);
    let err = sqlx::query("SELECT skiplock.enqueue('noop', queue => 'q', ordering_key => 'rr')")
        .execute(&mut *enqueue)
        .await
        .expect_err("an enqueue that cannot see its lane's end");
    let code = err
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned());
    assert_eq!(code.as_deref(), Some("40001"), "{err}");
    enqueue.rollback().await.unwrap();
    let next = enqueue_in_lane(pool, "q", "rr").await;
    assert_claimable(pool, next, "q", "the retried enqueue").await;
}

#[tokio::test]
async fn a_lane_job_whose_id_was_drawn_before_a_later_enqueue_of_its_lane_goes_behind_it() {
    // An insert draws its id before its trigger takes the lane's lock, so an enqueue that
    // drew a greater id can take the lock and commit first. Standing for that: an id drawn
    // first, a job enqueued into the lane, then a plain insert with the id drawn first.
    let db = test_db().await;
    let pool = &db.pool;
    let drawn_first: i64 = sqlx::query_scalar("SELECT skiplock.internal_next_job_id()")
        .fetch_one(pool)
        .await
        .unwrap();
    let first = enqueue_in_lane(pool, "q", "drawn").await;
    let second: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (id, kind, queue, ordering_key) OVERRIDING SYSTEM VALUE
         VALUES ($1, 'noop', 'q', 'drawn') RETURNING id",
    )
    .bind(drawn_first)
    .fetch_one(pool)
    .await
    .unwrap();
    // Behind the job enqueued before it, so that one is the lane's head and runs: with its
    // own id, this job was the head, waiting behind a job that may not run before it, and
    // the lane stood still until the sweep.
    assert!(
        second > first,
        "the later insert's job ({second}) goes behind the lane's job ({first})"
    );
    assert_eq!(state_of(pool, second).await, JobState::Waiting);
    assert_claimable(pool, first, "q", "the lane's first job").await;
}
