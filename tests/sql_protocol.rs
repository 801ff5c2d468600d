//! The SQL worker protocol (docs/sql.md, "Write a worker in any language"), driven in plain
//! SQL as a Python or Node worker drives it: `skiplock.claim`, `heartbeat`, `complete`,
//! `fail`, `discard`, `release`, `snooze` and `maintain`. No skiplock process runs in these
//! tests: whatever a finished job sets in motion (its lane, its dependants) must happen in
//! the function's own transaction.

mod common;

use std::time::Duration;

use chrono::{DateTime, Utc};

use common::fixtures::{state_of, strings, wait_for_a_lock_wait};
use common::test_db;
use serde_json::{Value, json};
use skiplock::JobState;
use sqlx::postgres::PgListener;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

const QUEUE: &str = "sql";
const WORKER: &str = "sql-worker-1";

/// One row of `skiplock.claim`, every column of the contract.
#[derive(Debug, sqlx::FromRow)]
struct Claimed {
    id: i64,
    queue: String,
    kind: String,
    args: Value,
    attempt: i32,
    max_attempts: i32,
    claim_token: Uuid,
}

/// What `skiplock.enqueue` is given; `Default` is a due `noop` job of [`QUEUE`].
struct Job<'a> {
    kind: &'a str,
    queue: &'a str,
    priority: i32,
    /// Seconds from now (negative: in the past).
    due_in_secs: f64,
    max_attempts: i32,
    ordering_key: Option<&'a str>,
    depends_on: Vec<i64>,
}

impl Default for Job<'_> {
    fn default() -> Self {
        Self {
            kind: "noop",
            queue: QUEUE,
            priority: 0,
            due_in_secs: 0.0,
            max_attempts: 25,
            ordering_key: None,
            depends_on: Vec::new(),
        }
    }
}

async fn enqueue(pool: &PgPool, job: Job<'_>) -> i64 {
    sqlx::query_scalar(
        "SELECT skiplock.enqueue($1, '{}', $2, $3, now() + make_interval(secs => $4), $5, $6,
                                 depends_on => $7)",
    )
    .bind(job.kind)
    .bind(job.queue)
    .bind(job.priority)
    .bind(job.due_in_secs)
    .bind(job.max_attempts)
    .bind(job.ordering_key)
    .bind(&job.depends_on)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn enqueue_noop(pool: &PgPool) -> i64 {
    enqueue(pool, Job::default()).await
}

/// A due `noop` job of [`QUEUE`] in the lane `key`.
async fn enqueue_in_lane(pool: &PgPool, key: &str) -> i64 {
    enqueue(
        pool,
        Job {
            ordering_key: Some(key),
            ..Job::default()
        },
    )
    .await
}

async fn claim_from(
    db: impl sqlx::PgExecutor<'_>,
    queue: &str,
    max_jobs: i32,
    kinds: Option<&[&str]>,
) -> Vec<Claimed> {
    sqlx::query_as("SELECT * FROM skiplock.claim($1, $2, $3, $4)")
        .bind(queue)
        .bind(max_jobs)
        .bind(WORKER)
        .bind(kinds.map(strings))
        .fetch_all(db)
        .await
        .unwrap()
}

async fn claim(db: impl sqlx::PgExecutor<'_>, max_jobs: i32) -> Vec<Claimed> {
    claim_from(db, QUEUE, max_jobs, None).await
}

/// Claims exactly one job and returns it.
async fn claim_one(pool: &PgPool) -> Claimed {
    let mut claimed = claim(pool, 1).await;
    assert_eq!(claimed.len(), 1, "one job to claim: {claimed:?}");
    claimed.remove(0)
}

fn ids(claimed: &[Claimed]) -> Vec<i64> {
    let mut ids: Vec<i64> = claimed.iter().map(|c| c.id).collect();
    ids.sort_unstable();
    ids
}

async fn complete(pool: &PgPool, id: i64, token: Option<Uuid>) -> bool {
    sqlx::query_scalar("SELECT skiplock.complete($1, $2)")
        .bind(id)
        .bind(token)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn fail(
    db: impl sqlx::PgExecutor<'_>,
    id: i64,
    token: Option<Uuid>,
    error: &str,
) -> Option<String> {
    sqlx::query_scalar("SELECT skiplock.fail($1, $2, $3)::text")
        .bind(id)
        .bind(token)
        .bind(error)
        .fetch_one(db)
        .await
        .unwrap()
}

async fn discard(pool: &PgPool, id: i64, token: Option<Uuid>, error: &str) -> Option<String> {
    sqlx::query_scalar("SELECT skiplock.discard($1, $2, $3)::text")
        .bind(id)
        .bind(token)
        .bind(error)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn release(pool: &PgPool, id: i64, token: Option<Uuid>) -> bool {
    sqlx::query_scalar("SELECT skiplock.release($1, $2)")
        .bind(id)
        .bind(token)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn snooze(pool: &PgPool, id: i64, token: Option<Uuid>, delay_secs: f64) -> bool {
    sqlx::query_scalar("SELECT skiplock.snooze($1, $2, make_interval(secs => $3))")
        .bind(id)
        .bind(token)
        .bind(delay_secs)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// `skiplock.heartbeat` for these claims: (id, held) in the order given.
async fn heartbeat(pool: &PgPool, claims: &[(i64, Option<Uuid>)]) -> Vec<(i64, bool)> {
    let ids: Vec<i64> = claims.iter().map(|c| c.0).collect();
    let tokens: Vec<Option<Uuid>> = claims.iter().map(|c| c.1).collect();
    let mut held: Vec<(i64, bool)> =
        sqlx::query_as("SELECT id, held FROM skiplock.heartbeat($1, $2)")
            .bind(&ids)
            .bind(&tokens)
            .fetch_all(pool)
            .await
            .unwrap();
    held.sort_unstable();
    held
}

/// `skiplock.maintain(stale_after)`: (reaped, moved_on).
async fn maintain(db: &mut PgConnection, stale_after_secs: f64) -> (i64, i64) {
    sqlx::query_as("SELECT reaped, moved_on FROM skiplock.maintain(make_interval(secs => $1))")
        .bind(stale_after_secs)
        .fetch_one(db)
        .await
        .unwrap()
}

/// The whole row, to compare before and after a call that must change nothing.
async fn row(db: impl sqlx::PgExecutor<'_>, id: i64) -> Value {
    sqlx::query_scalar("SELECT to_jsonb(j) FROM skiplock.jobs j WHERE id = $1")
        .bind(id)
        .fetch_one(db)
        .await
        .unwrap()
}

/// Seconds from now until the job is due (negative: overdue). `now()` is the transaction's
/// start: read in the transaction that set `scheduled_at`, it is exactly the delay that
/// write gave, however long its statements took.
async fn due_in_secs(db: impl sqlx::PgExecutor<'_>, id: i64) -> f64 {
    sqlx::query_scalar(
        "SELECT extract(epoch FROM scheduled_at - now())::float8 FROM skiplock.jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(db)
    .await
    .unwrap()
}

/// Makes a queued job due now, skipping its backoff.
async fn make_due(pool: &PgPool, id: i64) {
    sqlx::query("UPDATE skiplock.jobs SET scheduled_at = now() WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
}

/// Ages a claim's heartbeat by hand, as a worker that stopped heartbeating leaves it.
async fn age_heartbeat(pool: &PgPool, ids: &[i64], secs: f64) {
    sqlx::query(
        "UPDATE skiplock.jobs SET heartbeat_at = now() - make_interval(secs => $2)
         WHERE id = ANY ($1)",
    )
    .bind(ids)
    .bind(secs)
    .execute(pool)
    .await
    .unwrap();
}

/// The SQLSTATE of a statement that must fail.
async fn sqlstate_of(pool: &PgPool, sql: &str) -> String {
    let err = sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(pool)
        .await
        .expect_err(sql);
    err.as_database_error()
        .and_then(|e| e.code().map(|c| c.into_owned()))
        .unwrap_or_else(|| panic!("{sql}: not a database error: {err}"))
}

// ---- claim ---------------------------------------------------------------------------------

#[tokio::test]
async fn claim_returns_the_contract_columns_and_stamps_the_claim() {
    let db = test_db().await;
    let pool = &db.pool;
    let id: i64 = sqlx::query_scalar(
        "SELECT skiplock.enqueue('email', '{\"to\": \"a@example.com\"}', 'sql', max_attempts => 3)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let job = claim_one(pool).await;
    assert_eq!(
        (
            job.id,
            job.queue.as_str(),
            job.kind.as_str(),
            &job.args,
            job.attempt,
            job.max_attempts
        ),
        (id, QUEUE, "email", &json!({"to": "a@example.com"}), 1, 3)
    );
    let row = row(pool, id).await;
    assert_eq!(row["state"], json!("running"));
    assert_eq!(row["claimed_by"], json!(WORKER));
    assert_eq!(row["claim_token"], json!(job.claim_token.to_string()));
    assert!(row["heartbeat_at"].is_string(), "{row}");
    assert!(
        claim(pool, 10).await.is_empty(),
        "a claimed job is not claimed again"
    );
}

#[tokio::test]
async fn claim_takes_only_the_given_kinds_and_null_kinds_means_every_kind() {
    let db = test_db().await;
    let pool = &db.pool;
    let a = enqueue(
        pool,
        Job {
            kind: "a",
            ..Job::default()
        },
    )
    .await;
    let b = enqueue(
        pool,
        Job {
            kind: "b",
            ..Job::default()
        },
    )
    .await;
    let c = enqueue(
        pool,
        Job {
            kind: "c",
            ..Job::default()
        },
    )
    .await;
    assert_eq!(
        ids(&claim_from(pool, QUEUE, 10, Some(&["a", "x"])).await),
        [a]
    );
    assert!(claim_from(pool, QUEUE, 10, Some(&["x"])).await.is_empty());
    assert_eq!(ids(&claim_from(pool, QUEUE, 10, None).await), [b, c]);
}

#[tokio::test]
async fn claim_takes_one_queue_only_and_an_unknown_queue_is_empty() {
    let db = test_db().await;
    let pool = &db.pool;
    let other = enqueue(
        pool,
        Job {
            queue: "other",
            ..Job::default()
        },
    )
    .await;
    let mine = enqueue_noop(pool).await;
    assert_eq!(ids(&claim(pool, 10).await), [mine]);
    assert!(claim_from(pool, "no-such-queue", 10, None).await.is_empty());
    assert_eq!(ids(&claim_from(pool, "other", 10, None).await), [other]);
}

#[tokio::test]
async fn claim_skips_a_paused_queue_until_it_is_resumed() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue_noop(pool).await;
    let other = enqueue(
        pool,
        Job {
            queue: "other",
            ..Job::default()
        },
    )
    .await;
    sqlx::query("SELECT skiplock.pause_queue($1)")
        .bind(QUEUE)
        .execute(pool)
        .await
        .unwrap();
    assert!(
        claim(pool, 10).await.is_empty(),
        "a paused queue gives nothing"
    );
    assert_eq!(state_of(pool, id).await, JobState::Queued);
    assert_eq!(
        ids(&claim_from(pool, "other", 10, None).await),
        [other],
        "others go on"
    );
    sqlx::query("SELECT skiplock.resume_queue($1)")
        .bind(QUEUE)
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(ids(&claim(pool, 10).await), [id]);
}

#[tokio::test]
async fn claim_follows_priority_then_scheduled_at_and_leaves_future_jobs() {
    let db = test_db().await;
    let pool = &db.pool;
    let late = enqueue(
        pool,
        Job {
            due_in_secs: -60.0,
            ..Job::default()
        },
    )
    .await;
    let urgent = enqueue(
        pool,
        Job {
            priority: -1,
            ..Job::default()
        },
    )
    .await;
    let early = enqueue(
        pool,
        Job {
            due_in_secs: -120.0,
            ..Job::default()
        },
    )
    .await;
    let future = enqueue(
        pool,
        Job {
            priority: -5,
            due_in_secs: 3600.0,
            ..Job::default()
        },
    )
    .await;
    let mut order = Vec::new();
    for _ in 0..3 {
        order.push(claim_one(pool).await.id);
    }
    assert_eq!(order, [urgent, early, late]);
    assert!(
        claim(pool, 10).await.is_empty(),
        "job {future} is due in an hour"
    );
    // A batch takes the first max_jobs in that order.
    let db2 = test_db().await;
    let pool = &db2.pool;
    let low = enqueue(
        pool,
        Job {
            priority: 5,
            ..Job::default()
        },
    )
    .await;
    let high = enqueue(
        pool,
        Job {
            priority: -5,
            ..Job::default()
        },
    )
    .await;
    let mid = enqueue_noop(pool).await;
    assert_eq!(ids(&claim(pool, 2).await), [high, mid]);
    assert_eq!(ids(&claim(pool, 2).await), [low]);
}

#[tokio::test]
async fn claim_runs_a_lane_in_order_and_its_next_job_is_claimable_right_after_complete() {
    let db = test_db().await;
    let pool = &db.pool;
    let first = enqueue_in_lane(pool, "acct-1").await;
    let second = enqueue_in_lane(pool, "acct-1").await;
    let third = enqueue_in_lane(pool, "acct-1").await;
    let head = claim(pool, 10).await;
    assert_eq!(ids(&head), [first], "only the lane's head is runnable");
    assert!(
        claim(pool, 10).await.is_empty(),
        "nothing of the lane while its head runs"
    );
    assert!(complete(pool, first, Some(head[0].claim_token)).await);
    // At once, in complete's own transaction: no skiplock process runs here.
    let next = claim(pool, 10).await;
    assert_eq!(ids(&next), [second]);
    // A dead head moves its lane on too.
    assert_eq!(
        discard(pool, second, Some(next[0].claim_token), "bad")
            .await
            .as_deref(),
        Some("dead")
    );
    assert_eq!(ids(&claim(pool, 10).await), [third]);
}

#[tokio::test]
async fn a_child_is_claimable_right_after_its_parents_complete() {
    let db = test_db().await;
    let pool = &db.pool;
    let p1 = enqueue_noop(pool).await;
    let p2 = enqueue_noop(pool).await;
    let child = enqueue(
        pool,
        Job {
            depends_on: vec![p1, p2],
            ..Job::default()
        },
    )
    .await;
    assert_eq!(state_of(pool, child).await, JobState::Waiting);
    let parents = claim(pool, 10).await;
    assert_eq!(ids(&parents), [p1, p2]);
    let token = |id: i64| parents.iter().find(|c| c.id == id).unwrap().claim_token;
    assert!(complete(pool, p1, Some(token(p1))).await);
    assert_eq!(
        state_of(pool, child).await,
        JobState::Waiting,
        "one parent is still running"
    );
    assert!(claim(pool, 10).await.is_empty());
    assert!(complete(pool, p2, Some(token(p2))).await);
    assert_eq!(ids(&claim(pool, 10).await), [child]);
}

#[tokio::test]
async fn a_parent_dead_after_its_last_attempt_cancels_its_waiting_child() {
    let db = test_db().await;
    let pool = &db.pool;
    let parent = enqueue(
        pool,
        Job {
            max_attempts: 1,
            ..Job::default()
        },
    )
    .await;
    let child = enqueue(
        pool,
        Job {
            depends_on: vec![parent],
            ..Job::default()
        },
    )
    .await;
    let job = claim_one(pool).await;
    assert_eq!(
        fail(pool, parent, Some(job.claim_token), "boom")
            .await
            .as_deref(),
        Some("dead")
    );
    assert_eq!(state_of(pool, child).await, JobState::Cancelled);
    assert!(claim(pool, 10).await.is_empty());
}

#[tokio::test]
async fn a_discarded_parent_cancels_its_waiting_child() {
    let db = test_db().await;
    let pool = &db.pool;
    let parent = enqueue_noop(pool).await;
    let child = enqueue(
        pool,
        Job {
            depends_on: vec![parent],
            ..Job::default()
        },
    )
    .await;
    let job = claim_one(pool).await;
    assert_eq!(
        discard(pool, parent, Some(job.claim_token), "no")
            .await
            .as_deref(),
        Some("dead")
    );
    assert_eq!(state_of(pool, child).await, JobState::Cancelled);
    let row = row(pool, parent).await;
    assert_eq!(
        (&row["last_error"], &row["attempt"]),
        (&json!("no"), &json!(1))
    );
    assert!(row["finished_at"].is_string(), "{row}");
}

// ---- complete, fail, release, snooze ---------------------------------------------------------

#[tokio::test]
async fn complete_saves_the_output_and_finishes_the_job_once() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue_noop(pool).await;
    let job = claim_one(pool).await;
    let done: bool = sqlx::query_scalar("SELECT skiplock.complete($1, $2, '{\"rows\": 3}')")
        .bind(id)
        .bind(job.claim_token)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(done);
    let after = row(pool, id).await;
    assert_eq!(
        (&after["state"], &after["output"], &after["claim_token"]),
        (&json!("succeeded"), &json!({"rows": 3}), &Value::Null)
    );
    assert!(after["finished_at"].is_string(), "{after}");
    assert!(
        !complete(pool, id, Some(job.claim_token)).await,
        "a second complete"
    );
    assert_eq!(row(pool, id).await, after);
}

#[tokio::test]
async fn complete_tells_listening_workers_of_the_next_job_of_its_lane() {
    let db = test_db().await;
    let pool = &db.pool;
    let first = enqueue_in_lane(pool, "l").await;
    enqueue_in_lane(pool, "l").await;
    let job = claim_one(pool).await;
    let mut listener = PgListener::connect(db.url()).await.unwrap();
    listener.listen("skiplock_runnable").await.unwrap();
    assert!(complete(pool, first, Some(job.claim_token)).await);
    // Only guards a hang: the notification comes with the commit.
    let note = tokio::time::timeout(Duration::from_secs(60), listener.recv())
        .await
        .expect("a skiplock_runnable notification")
        .unwrap();
    assert!(
        note.payload().ends_with(&format!("\t{QUEUE}")),
        "{}",
        note.payload()
    );
}

#[tokio::test]
async fn fail_queues_the_job_again_after_the_backoff_or_retry_in() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue(
        pool,
        Job {
            max_attempts: 5,
            ..Job::default()
        },
    )
    .await;
    let job = claim_one(pool).await;
    // The fail, the read of its delay and the claim in one transaction: they share its
    // now(), so the delay is the backoff itself and the claim looks at the same moment,
    // however long each statement takes on a loaded machine.
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        fail(&mut *tx, id, Some(job.claim_token), "timeout")
            .await
            .as_deref(),
        Some("queued")
    );
    // skiplock.backoff(1): 2 s × [0.75, 1.25).
    let wait = due_in_secs(&mut *tx, id).await;
    assert!((1.5..=2.5).contains(&wait), "due in {wait} s");
    assert!(
        claim(&mut *tx, 10).await.is_empty(),
        "not before its backoff"
    );
    tx.commit().await.unwrap();
    let after = row(pool, id).await;
    assert_eq!(
        (
            &after["state"],
            &after["attempt"],
            &after["last_error"],
            &after["claim_token"]
        ),
        (&json!("queued"), &json!(1), &json!("timeout"), &Value::Null)
    );
    assert_eq!(after["errors"].as_array().map(Vec::len), Some(1), "{after}");
    assert_eq!(after["errors"][0]["message"], json!("timeout"));

    make_due(pool, id).await;
    let job = claim_one(pool).await;
    assert_eq!(job.attempt, 2);
    let mut tx = pool.begin().await.unwrap();
    let state: Option<String> =
        sqlx::query_scalar("SELECT skiplock.fail($1, $2, 'later', interval '1 hour')::text")
            .bind(id)
            .bind(job.claim_token)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    assert_eq!(state.as_deref(), Some("queued"));
    let wait = due_in_secs(&mut *tx, id).await;
    assert!((wait - 3600.0).abs() < 0.001, "due in {wait} s");
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn fail_on_the_last_attempt_is_dead_and_moves_the_lane_on() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue(
        pool,
        Job {
            max_attempts: 2,
            ordering_key: Some("l"),
            ..Job::default()
        },
    )
    .await;
    let next = enqueue_in_lane(pool, "l").await;
    let job = claim_one(pool).await;
    assert_eq!(
        fail(pool, id, Some(job.claim_token), "one")
            .await
            .as_deref(),
        Some("queued")
    );
    assert!(
        claim(pool, 10).await.is_empty(),
        "the lane waits for its retried head"
    );
    make_due(pool, id).await;
    let job = claim_one(pool).await;
    assert_eq!((job.id, job.attempt), (id, 2));
    assert_eq!(
        fail(pool, id, Some(job.claim_token), "two")
            .await
            .as_deref(),
        Some("dead")
    );
    let after = row(pool, id).await;
    assert_eq!(
        (&after["state"], &after["last_error"]),
        (&json!("dead"), &json!("two"))
    );
    assert_eq!(after["errors"].as_array().map(Vec::len), Some(2), "{after}");
    assert!(after["finished_at"].is_string(), "{after}");
    assert_eq!(ids(&claim(pool, 10).await), [next]);
}

#[tokio::test]
async fn release_queues_the_job_at_once_without_counting_the_attempt() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue(
        pool,
        Job {
            max_attempts: 1,
            ..Job::default()
        },
    )
    .await;
    let job = claim_one(pool).await;
    assert!(release(pool, id, Some(job.claim_token)).await);
    let after = row(pool, id).await;
    assert_eq!(
        (&after["state"], &after["claim_token"], &after["last_error"]),
        (&json!("queued"), &Value::Null, &Value::Null)
    );
    assert!(due_in_secs(pool, id).await <= 0.0, "due at once");
    // The attempt did not count: the only attempt of a max_attempts 1 job is still to come.
    let again = claim_one(pool).await;
    assert_eq!((again.id, again.attempt), (id, 1));
    assert!(
        !release(pool, id, Some(job.claim_token)).await,
        "the old claim is gone"
    );
}

#[tokio::test]
async fn snooze_queues_the_job_after_the_delay_without_counting_the_attempt() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue_noop(pool).await;
    let job = claim_one(pool).await;
    assert!(snooze(pool, id, Some(job.claim_token), 3600.0).await);
    assert_eq!(state_of(pool, id).await, JobState::Queued);
    let wait = due_in_secs(pool, id).await;
    assert!((3590.0..=3610.0).contains(&wait), "due in {wait} s");
    assert!(claim(pool, 10).await.is_empty());
    make_due(pool, id).await;
    assert_eq!(
        claim_one(pool).await.attempt,
        1,
        "the snoozed attempt did not count"
    );
}

#[tokio::test]
async fn each_function_runs_in_the_callers_transaction() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue_in_lane(pool, "l").await;
    let next = enqueue_in_lane(pool, "l").await;
    let before = row(pool, id).await;
    let mut tx = pool.begin().await.unwrap();
    let claimed: Vec<Claimed> = sqlx::query_as("SELECT * FROM skiplock.claim($1, 10, $2)")
        .bind(QUEUE)
        .bind(WORKER)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    assert_eq!(ids(&claimed), [id]);
    tx.rollback().await.unwrap();
    assert_eq!(
        row(pool, id).await,
        before,
        "a rolled-back claim leaves no trace"
    );

    let job = claim_one(pool).await;
    let running = row(pool, id).await;
    let mut tx = pool.begin().await.unwrap();
    let done = common::fixtures::sql_complete(&mut *tx, id, job.claim_token).await;
    assert!(done);
    tx.rollback().await.unwrap();
    assert_eq!(
        row(pool, id).await,
        running,
        "a rolled-back complete leaves the claim"
    );
    assert_eq!(
        state_of(pool, next).await,
        JobState::Waiting,
        "and the lane where it was"
    );
    assert!(complete(pool, id, Some(job.claim_token)).await);
}

// ---- heartbeat and fencing -------------------------------------------------------------------

#[tokio::test]
async fn heartbeat_extends_the_claims_held_and_reports_the_others() {
    let db = test_db().await;
    let pool = &db.pool;
    let a = enqueue_noop(pool).await;
    let b = enqueue_noop(pool).await;
    let claimed = claim(pool, 10).await;
    let token = |id: i64| claimed.iter().find(|c| c.id == id).unwrap().claim_token;
    age_heartbeat(pool, &[a, b], 60.0).await;
    let b_before = row(pool, b).await;
    let held = heartbeat(pool, &[(a, Some(token(a))), (b, Some(Uuid::new_v4()))]).await;
    assert_eq!(held, [(a, true), (b, false)]);
    let age: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - heartbeat_at)::float8 FROM skiplock.jobs WHERE id = $1",
    )
    .bind(a)
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(age < 10.0, "a's heartbeat is {age} s old");
    assert_eq!(
        row(pool, b).await,
        b_before,
        "a wrong token extends nothing"
    );
    // An extended claim survives maintain; the other does not.
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(maintain(&mut conn, 30.0).await.0, 1);
    assert_eq!(
        (state_of(pool, a).await, state_of(pool, b).await),
        (JobState::Running, JobState::Queued)
    );
    assert_eq!(
        heartbeat(pool, &[(a, Some(token(a))), (b, Some(token(b)))]).await,
        [(a, true), (b, false)]
    );
    assert!(heartbeat(pool, &[]).await.is_empty());
}

/// Every write of the protocol with a token that is not the job's current claim: nothing
/// changes, and the function says so.
async fn assert_fenced(pool: &PgPool, id: i64, token: Option<Uuid>) {
    let before = row(pool, id).await;
    assert!(!complete(pool, id, token).await, "complete");
    // With an output too: the output is written only under the claim's token.
    let with_output: bool =
        sqlx::query_scalar("SELECT skiplock.complete($1, $2, '{\"stale\": true}')")
            .bind(id)
            .bind(token)
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(!with_output, "complete with an output");
    assert_eq!(fail(pool, id, token, "x").await, None, "fail");
    assert_eq!(discard(pool, id, token, "x").await, None, "discard");
    assert!(!release(pool, id, token).await, "release");
    assert!(!snooze(pool, id, token, 10.0).await, "snooze");
    assert_eq!(
        heartbeat(pool, &[(id, token)]).await,
        [(id, false)],
        "heartbeat"
    );
    assert_eq!(
        row(pool, id).await,
        before,
        "token {token:?} changed the row"
    );
}

#[tokio::test]
async fn a_wrong_stale_or_null_token_changes_nothing() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue_in_lane(pool, "l").await;
    let next = enqueue_in_lane(pool, "l").await;
    let first = claim_one(pool).await;
    assert_fenced(pool, id, Some(Uuid::new_v4())).await;
    assert_fenced(pool, id, None).await;

    // The holder goes quiet; maintain takes the claim back and another worker claims it.
    age_heartbeat(pool, &[id], 60.0).await;
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(maintain(&mut conn, 30.0).await.0, 1);
    assert_fenced(pool, id, Some(first.claim_token)).await;
    make_due(pool, id).await;
    let second = claim_one(pool).await;
    assert_eq!((second.id, second.attempt), (id, 2));
    assert_fenced(pool, id, Some(first.claim_token)).await;
    assert_eq!(
        state_of(pool, next).await,
        JobState::Waiting,
        "the stale token moved no lane"
    );

    // A finished job: its own last token is stale too.
    assert!(complete(pool, id, Some(second.claim_token)).await);
    assert_fenced(pool, id, Some(second.claim_token)).await;
}

#[tokio::test]
async fn a_cancelled_job_tells_its_worker_through_heartbeat_and_complete() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue_noop(pool).await;
    let job = claim_one(pool).await;
    let cancelled: bool = sqlx::query_scalar("SELECT skiplock.cancel_job($1)")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(cancelled);
    assert_eq!(
        heartbeat(pool, &[(id, Some(job.claim_token))]).await,
        [(id, false)]
    );
    assert_fenced(pool, id, Some(job.claim_token)).await;
    assert_eq!(state_of(pool, id).await, JobState::Cancelled);
}

// ---- maintain ------------------------------------------------------------------------------

#[tokio::test]
async fn maintain_takes_back_a_stale_claim_with_the_reason_recorded() {
    let db = test_db().await;
    let pool = &db.pool;
    let stale = enqueue(
        pool,
        Job {
            max_attempts: 5,
            ..Job::default()
        },
    )
    .await;
    let live = enqueue_noop(pool).await;
    let spent = enqueue(
        pool,
        Job {
            max_attempts: 1,
            ..Job::default()
        },
    )
    .await;
    let claimed = claim(pool, 10).await;
    assert_eq!(ids(&claimed), [stale, live, spent]);
    age_heartbeat(pool, &[stale, spent], 60.0).await;
    let live_before = row(pool, live).await;

    let mut conn = pool.acquire().await.unwrap();
    // The reap and the read of the requeued job's delay in one transaction: they share its
    // now(), so the delay read is the backoff the reap gave, however long the statements
    // take.
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    assert_eq!(maintain(&mut tx, 30.0).await.0, 2);
    let wait = due_in_secs(&mut *tx, stale).await;
    tx.commit().await.unwrap();
    let after = row(pool, stale).await;
    assert_eq!(
        (&after["state"], &after["claim_token"], &after["attempt"]),
        (&json!("queued"), &Value::Null, &json!(1))
    );
    let reason = after["last_error"].as_str().unwrap_or_default();
    assert!(
        reason.contains(WORKER),
        "last_error names the holder: {after}"
    );
    // skiplock.backoff(1): 2 s × [0.75, 1.25).
    assert!(
        (1.5..=2.5).contains(&wait),
        "requeued with a backoff, due in {wait} s: {after}"
    );
    assert_eq!(
        state_of(pool, spent).await,
        JobState::Dead,
        "no attempt left"
    );
    assert!(row(pool, spent).await["last_error"].is_string());
    assert_eq!(
        row(pool, live).await,
        live_before,
        "a live claim is left alone"
    );
    assert_eq!(
        maintain(&mut conn, 30.0).await,
        (0, 0),
        "nothing left to do"
    );
}

#[tokio::test]
async fn maintain_moves_on_the_lane_and_dependants_of_a_job_it_reaped_dead() {
    let db = test_db().await;
    let pool = &db.pool;
    let head = enqueue(
        pool,
        Job {
            max_attempts: 1,
            ordering_key: Some("l"),
            ..Job::default()
        },
    )
    .await;
    let behind = enqueue_in_lane(pool, "l").await;
    let parent = enqueue(
        pool,
        Job {
            max_attempts: 1,
            ..Job::default()
        },
    )
    .await;
    let child = enqueue(
        pool,
        Job {
            depends_on: vec![parent],
            ..Job::default()
        },
    )
    .await;
    assert_eq!(ids(&claim(pool, 10).await), [head, parent]);
    age_heartbeat(pool, &[head, parent], 60.0).await;
    let mut conn = pool.acquire().await.unwrap();
    let (reaped, moved_on) = maintain(&mut conn, 30.0).await;
    assert_eq!(reaped, 2);
    assert!(moved_on >= 2, "moved_on {moved_on}");
    assert_eq!(
        (state_of(pool, head).await, state_of(pool, parent).await),
        (JobState::Dead, JobState::Dead)
    );
    assert_eq!(state_of(pool, child).await, JobState::Cancelled);
    assert_eq!(ids(&claim(pool, 10).await), [behind]);
}

/// One row that fails the reap never stops the others, as in the Rust reaper: a trigger of
/// the user's refuses to requeue one stale job (`refused`) and refuses any change at all to
/// another (`stuck`). maintain takes the others back; `refused` goes dead with the reason in
/// last_error and its lane moves on; `stuck` stays as it is, named in a warning.
#[tokio::test]
async fn a_row_that_fails_maintains_batch_is_set_aside_and_the_others_are_taken_back() {
    let db = test_db().await;
    let pool = &db.pool;
    let refused = enqueue_in_lane(pool, "l").await;
    let behind = enqueue_in_lane(pool, "l").await;
    let stuck = enqueue_noop(pool).await;
    let others = [enqueue_noop(pool).await, enqueue_noop(pool).await];
    let claimed = ids(&claim(pool, 10).await);
    assert_eq!(claimed, [refused, stuck, others[0], others[1]]);
    age_heartbeat(pool, &claimed, 60.0).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.id = {refused} AND NEW.state = 'queued' THEN
                 RAISE EXCEPTION 'job {refused} must not be requeued';
             ELSIF NEW.id = {stuck} THEN
                 RAISE EXCEPTION 'job {stuck} must not change';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse BEFORE UPDATE ON skiplock.jobs
             FOR EACH ROW EXECUTE FUNCTION public.refuse();"
    )))
    .execute(pool)
    .await
    .unwrap();

    let mut conn = pool.acquire().await.unwrap();
    let (reaped, moved_on) = maintain(&mut conn, 30.0).await;
    assert_eq!(reaped, 3, "the two others and `refused`, which went dead");
    assert!(
        moved_on >= 1,
        "the lane behind `refused` moved on: {moved_on}"
    );
    for id in others {
        let after = row(pool, id).await;
        assert_eq!(
            (&after["state"], &after["attempt"]),
            (&json!("queued"), &json!(1))
        );
        assert!(
            after["last_error"].as_str().unwrap().contains(WORKER),
            "{after}"
        );
    }
    let after = row(pool, refused).await;
    assert_eq!(after["state"], "dead");
    assert_eq!(
        after["last_error"],
        format!(
            "taken back from a stale claim, but could not be requeued: job {refused} must not be requeued"
        )
    );
    assert_eq!(state_of(pool, behind).await, JobState::Queued);
    assert_eq!(
        state_of(pool, stuck).await,
        JobState::Running,
        "left as it was"
    );
    // The next pass meets the same row again and still takes nothing else by mistake.
    assert_eq!(maintain(&mut conn, 30.0).await.0, 0);
}

/// `maintain` called in a transaction that began long ago (its `now()` is old) leaves a
/// live claim alone: its heartbeat, written by the clock after the transaction began, is
/// neither stale nor "in the future" (a hand-written heartbeat_at, which `maintain` takes
/// back). The check for the future compared with the transaction's start and took the
/// live claim back.
#[tokio::test]
async fn maintain_in_a_transaction_begun_long_ago_leaves_a_live_claim_alone() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue_noop(pool).await;
    let claimed = claim_one(pool).await;
    let mut old = PgConnection::connect(db.url()).await.unwrap();
    sqlx::query("BEGIN").execute(&mut old).await.unwrap();
    let began: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut old)
        .await
        .unwrap();
    common::fixtures::wait_for(
        "the database clock to pass a second after the transaction began",
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, bool>("SELECT clock_timestamp() > $1 + interval '1 second'")
                .bind(began)
                .fetch_one(pool)
                .await
                .unwrap()
        },
    )
    .await;
    assert_eq!(
        heartbeat(pool, &[(id, Some(claimed.claim_token))]).await,
        [(id, true)]
    );
    assert_eq!(
        maintain(&mut old, 0.5).await.0,
        0,
        "the live claim is not taken back"
    );
    sqlx::query("COMMIT").execute(&mut old).await.unwrap();
    let after = row(pool, id).await;
    assert_eq!(
        (&after["state"], &after["claim_token"]),
        (&json!("running"), &json!(claimed.claim_token.to_string()))
    );
}

/// With no skiplock process, `maintain` enqueues the job of each due cron slot of a
/// schedule written by plain SQL, once however many sessions call it: a second session
/// calling it while the first holds its transaction open skips the schedule (it does not
/// wait for it) and enqueues nothing; a later call finds the slot done.
#[tokio::test]
async fn maintain_enqueues_each_due_cron_slot_once() {
    let db = test_db().await;
    let pool = &db.pool;
    sqlx::query(
        "INSERT INTO skiplock.cron_schedules (name, expression, kind, args, queue, last_slot_at)
         VALUES ('hourly', '0 * * * *', 'report', '{\"n\": 1}', $1, now() - interval '3 hours'),
                ('yearly', '0 0 1 1 *', 'report', '{}', $1, now())",
    )
    .bind(QUEUE)
    .execute(pool)
    .await
    .unwrap();
    let cron_enqueued = |mut conn: PgConnection| async move {
        let (enqueued,): (i64,) = sqlx::query_as("SELECT cron_enqueued FROM skiplock.maintain()")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        (enqueued, conn)
    };
    let mut a = PgConnection::connect(db.url()).await.unwrap();
    let mut b = PgConnection::connect(db.url()).await.unwrap();
    sqlx::query("BEGIN").execute(&mut a).await.unwrap();
    let (by_a, mut a) = cron_enqueued(a).await;
    sqlx::query("BEGIN").execute(&mut b).await.unwrap();
    let (by_b, mut b) = tokio::time::timeout(Duration::from_secs(60), cron_enqueued(b))
        .await
        .expect("the second session skips the schedule the first holds");
    sqlx::query("COMMIT").execute(&mut b).await.unwrap();
    sqlx::query("COMMIT").execute(&mut a).await.unwrap();
    assert_eq!((by_a, by_b), (1, 0));

    let jobs: Vec<(i64, String, Value, DateTime<Utc>)> = sqlx::query_as(
        "SELECT id, queue, args, scheduled_at FROM skiplock.jobs WHERE kind = 'report'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        jobs.len(),
        1,
        "one job for the latest missed slot: {jobs:?}"
    );
    let (id, queue, args, slot) = &jobs[0];
    assert_eq!((queue.as_str(), args), (QUEUE, &json!({"n": 1})));
    assert_eq!(
        slot.timestamp() % 3600,
        0,
        "the slot is a whole hour: {slot}"
    );
    let (last_job_id, last_slot_at): (Option<i64>, DateTime<Utc>) = sqlx::query_as(
        "SELECT last_job_id, last_slot_at FROM skiplock.cron_schedules WHERE name = 'hourly'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((last_job_id, last_slot_at), (Some(*id), *slot));

    let (again, _) = cron_enqueued(PgConnection::connect(db.url()).await.unwrap()).await;
    assert_eq!(again, 0, "the slot is done");
}

/// Two sessions run maintain at once, each in its own transaction, over the same stale
/// claims: each is taken back exactly once (one failure entry, attempt unchanged) and
/// neither session gets an error.
#[tokio::test]
async fn maintain_from_two_sessions_at_once_takes_each_stale_claim_once() {
    const JOBS: usize = 300;
    let db = test_db().await;
    let pool = &db.pool;
    sqlx::query(
        "SELECT skiplock.enqueue('noop', '{}', $1, max_attempts => 5) FROM generate_series(1, $2)",
    )
    .bind(QUEUE)
    .bind(JOBS as i32)
    .execute(pool)
    .await
    .unwrap();

    // Round 1: one session holds its reaping transaction open while the other calls
    // maintain over the same rows; round 2: both at once.
    for round in 0..2 {
        sqlx::query("UPDATE skiplock.jobs SET scheduled_at = now() WHERE state = 'queued'")
            .execute(pool)
            .await
            .unwrap();
        let claimed = claim(pool, JOBS as i32).await;
        assert_eq!(claimed.len(), JOBS);
        age_heartbeat(pool, &ids(&claimed), 60.0).await;

        let mut a = PgConnection::connect(db.url()).await.unwrap();
        let mut b = PgConnection::connect(db.url()).await.unwrap();
        let total = if round == 0 {
            sqlx::query("BEGIN").execute(&mut a).await.unwrap();
            let (reaped_a, _) = maintain(&mut a, 30.0).await;
            let b_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut b)
                .await
                .unwrap();
            let other = tokio::spawn(async move {
                sqlx::query("BEGIN").execute(&mut b).await.unwrap();
                let reaped = maintain(&mut b, 30.0).await;
                sqlx::query("COMMIT").execute(&mut b).await.unwrap();
                reaped
            });
            // b meets a's locks (it skips them, and ends, or waits for them) before a
            // commits: a wait on either, not on time.
            common::fixtures::wait_for(
                "the second maintain to end or to wait for the first's locks",
                Duration::from_secs(60),
                || async {
                    other.is_finished()
                        || sqlx::query_scalar::<_, bool>(
                            "SELECT EXISTS (SELECT FROM pg_stat_activity
                                            WHERE pid = $1 AND wait_event_type = 'Lock')",
                        )
                        .bind(b_pid)
                        .fetch_one(pool)
                        .await
                        .unwrap()
                },
            )
            .await;
            sqlx::query("COMMIT").execute(&mut a).await.unwrap();
            let (reaped_b, _) = tokio::time::timeout(Duration::from_secs(60), other)
                .await
                .expect("the second maintain ends once the first commits")
                .unwrap();
            reaped_a + reaped_b
        } else {
            let run = |mut conn: PgConnection| async move {
                sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
                let reaped = maintain(&mut conn, 30.0).await;
                sqlx::query("COMMIT").execute(&mut conn).await.unwrap();
                reaped.0
            };
            let (ra, rb) = tokio::join!(tokio::spawn(run(a)), tokio::spawn(run(b)));
            ra.unwrap() + rb.unwrap()
        };
        assert_eq!(total, JOBS as i64, "round {round}: reaped in all");
        let audit: Vec<(String, i32, i64, i64)> = sqlx::query_as(
            "SELECT state::text, attempt, jsonb_array_length(errors)::int8, count(*)
             FROM skiplock.jobs GROUP BY 1, 2, 3",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        let expected_attempt = round + 1;
        assert_eq!(
            audit,
            [(
                "queued".to_owned(),
                expected_attempt,
                i64::from(expected_attempt),
                JOBS as i64
            )],
            "round {round}: every job taken back exactly once"
        );
    }
}

// ---- bad input -----------------------------------------------------------------------------

#[tokio::test]
async fn claim_refuses_bad_arguments_with_sqlstate_22023() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue_noop(pool).await;
    for sql in [
        "SELECT * FROM skiplock.claim(NULL, 10, 'w')",
        "SELECT * FROM skiplock.claim('', 10, 'w')",
        "SELECT * FROM skiplock.claim('sql', 10, NULL)",
        "SELECT * FROM skiplock.claim('sql', 10, '')",
        "SELECT * FROM skiplock.claim('sql', NULL, 'w')",
        "SELECT * FROM skiplock.claim('sql', -1, 'w')",
        "SELECT * FROM skiplock.claim('sql', 1000000, 'w')",
    ] {
        assert_eq!(sqlstate_of(pool, sql).await, "22023", "{sql}");
    }
    assert_eq!(state_of(pool, id).await, JobState::Queued);
    assert!(claim(pool, 0).await.is_empty(), "max_jobs 0 claims nothing");
    assert_eq!(state_of(pool, id).await, JobState::Queued);
    assert_eq!(ids(&claim(pool, 10_000).await), [id], "10,000 is allowed");
}

#[tokio::test]
async fn an_error_text_of_megabytes_is_cut_to_8_kib() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue(
        pool,
        Job {
            max_attempts: 1,
            ..Job::default()
        },
    )
    .await;
    let job = claim_one(pool).await;
    // Two-byte characters, so a cut in the middle of one would show.
    let huge = "é".repeat(3 * 1024 * 1024 / 2);
    assert_eq!(
        fail(pool, id, Some(job.claim_token), &huge)
            .await
            .as_deref(),
        Some("dead")
    );
    let (last_error, in_errors): (String, String) = sqlx::query_as(
        "SELECT last_error, errors -> -1 ->> 'message' FROM skiplock.jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(
        (4096..=8192).contains(&last_error.len()),
        "last_error is {} bytes",
        last_error.len()
    );
    assert!(last_error.starts_with("éé"));
    assert_eq!(in_errors, last_error);
}

#[tokio::test]
async fn an_error_text_with_a_nul_byte_is_refused_and_the_claim_stays_held() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue_noop(pool).await;
    let job = claim_one(pool).await;
    let before = row(pool, id).await;
    // Postgres text cannot hold NUL: the call fails before the function runs.
    let refused = sqlx::query("SELECT skiplock.fail($1, $2, $3)")
        .bind(id)
        .bind(job.claim_token)
        .bind("before\0after")
        .execute(pool)
        .await;
    assert!(refused.is_err(), "{refused:?}");
    assert_eq!(row(pool, id).await, before);
    assert!(complete(pool, id, Some(job.claim_token)).await);
}

#[tokio::test]
async fn an_unknown_job_id_is_a_fenced_no_op() {
    let db = test_db().await;
    let pool = &db.pool;
    let token = Some(Uuid::new_v4());
    assert!(!complete(pool, 999_999, token).await);
    assert_eq!(fail(pool, 999_999, token, "x").await, None);
    assert_eq!(discard(pool, 999_999, token, "x").await, None);
    assert!(!release(pool, 999_999, token).await);
    assert!(!snooze(pool, 999_999, token, 1.0).await);
    assert_eq!(
        heartbeat(pool, &[(999_999, token)]).await,
        [(999_999, false)]
    );
    assert_eq!(db.job_count().await, 0);
}

// ---- batch outcomes: complete_many and fail_many ---------------------------------------------

/// `skiplock.complete_many(ids, tokens, outputs)`: (id, state) per claim, in the order given.
async fn complete_many(
    db: impl sqlx::PgExecutor<'_>,
    claims: &[(i64, Option<Uuid>)],
    outputs: Option<Vec<Option<Value>>>,
) -> Vec<(i64, Option<String>)> {
    let ids: Vec<i64> = claims.iter().map(|c| c.0).collect();
    let tokens: Vec<Option<Uuid>> = claims.iter().map(|c| c.1).collect();
    sqlx::query_as("SELECT id, state::text FROM skiplock.complete_many($1, $2, $3)")
        .bind(&ids)
        .bind(&tokens)
        .bind(outputs)
        .fetch_all(db)
        .await
        .unwrap()
}

/// `skiplock.fail_many(ids, tokens, errors, retry_in)`, each retry_in in seconds (None: the
/// backoff): (id, state) per claim, in the order given.
async fn fail_many(
    db: impl sqlx::PgExecutor<'_>,
    claims: &[(i64, Option<Uuid>)],
    errors: &[&str],
    retry_in_secs: Option<Vec<Option<f64>>>,
) -> Vec<(i64, Option<String>)> {
    let ids: Vec<i64> = claims.iter().map(|c| c.0).collect();
    let tokens: Vec<Option<Uuid>> = claims.iter().map(|c| c.1).collect();
    sqlx::query_as(
        "SELECT id, state::text FROM skiplock.fail_many(
             $1, $2, $3,
             (SELECT array_agg(make_interval(secs => s) ORDER BY n)
              FROM unnest($4::float8[]) WITH ORDINALITY AS r(s, n)))",
    )
    .bind(&ids)
    .bind(&tokens)
    .bind(errors)
    .bind(retry_in_secs)
    .fetch_all(db)
    .await
    .unwrap()
}

/// The claim of job `id` among `claimed`.
fn token_of(claimed: &[Claimed], id: i64) -> Option<Uuid> {
    Some(claimed.iter().find(|c| c.id == id).unwrap().claim_token)
}

/// A batch completed in one call, given out of id order with a stale token among them: the
/// stale claim's job is unchanged (and NULL says so), every other job succeeded (with its
/// output, when given), and what waited on them moved on in the same call: the next job of
/// the lane and the child of the parent are claimable at once.
#[tokio::test]
async fn complete_many_saves_each_held_claim_fences_a_stale_one_and_moves_lanes_and_dependants_on()
{
    let db = test_db().await;
    let pool = &db.pool;
    let head = enqueue_in_lane(pool, "lane").await;
    let behind = enqueue_in_lane(pool, "lane").await;
    let parent = enqueue_noop(pool).await;
    let child = enqueue(
        pool,
        Job {
            depends_on: vec![parent],
            ..Job::default()
        },
    )
    .await;
    let with_output = enqueue_noop(pool).await;
    let stale = enqueue_noop(pool).await;
    let claimed = claim(pool, 10).await;
    assert_eq!(ids(&claimed), [head, parent, with_output, stale]);
    let stale_before = row(pool, stale).await;

    let results = complete_many(
        pool,
        &[
            (with_output, token_of(&claimed, with_output)),
            (stale, Some(Uuid::new_v4())),
            (parent, token_of(&claimed, parent)),
            (head, token_of(&claimed, head)),
        ],
        Some(vec![Some(json!({"sent": 3})), None, None, None]),
    )
    .await;
    let succeeded = Some("succeeded".to_owned());
    assert_eq!(
        results,
        [
            (with_output, succeeded.clone()),
            (stale, None),
            (parent, succeeded.clone()),
            (head, succeeded.clone()),
        ],
        "one result per claim, in the order given"
    );
    assert_eq!(
        row(pool, stale).await,
        stale_before,
        "a stale claim changes nothing"
    );
    assert_eq!(row(pool, with_output).await["output"], json!({"sent": 3}));
    assert_eq!(row(pool, head).await["output"], Value::Null);
    for id in [head, parent, with_output] {
        assert_eq!(row(pool, id).await["claim_token"], Value::Null, "job {id}");
    }
    assert_eq!(
        ids(&claim(pool, 10).await),
        [behind, child],
        "the lane and the dependant moved on in the same call"
    );

    // The stale claim's holder learns nothing new; its real token still completes it.
    assert_eq!(
        complete_many(pool, &[(stale, token_of(&claimed, stale))], None).await,
        [(stale, succeeded.clone())]
    );
    assert_eq!(
        complete_many(pool, &[(stale, token_of(&claimed, stale))], None).await,
        [(stale, None)],
        "a second completion of the same claim changes nothing"
    );
}

/// A batch of failed attempts in one call: each error is the job's last error and its
/// errors entry; a job with attempts left is queued after its backoff (or its retry_in,
/// zero included); one on its last attempt is dead, its lane moves on and its waiting
/// child is cancelled; a stale claim changes nothing.
#[tokio::test]
async fn fail_many_records_each_error_backs_off_and_moves_on_what_died() {
    let db = test_db().await;
    let pool = &db.pool;
    let last = |ordering_key| Job {
        max_attempts: 1,
        ordering_key,
        ..Job::default()
    };
    let lane_head = enqueue(pool, last(Some("lane"))).await;
    let behind = enqueue_in_lane(pool, "lane").await;
    let parent = enqueue(pool, last(None)).await;
    let child = enqueue(
        pool,
        Job {
            depends_on: vec![parent],
            ..Job::default()
        },
    )
    .await;
    let backs_off = enqueue_noop(pool).await;
    let retry_now = enqueue_noop(pool).await;
    let stale = enqueue_noop(pool).await;
    let claimed = claim(pool, 10).await;
    assert_eq!(
        ids(&claimed),
        [lane_head, parent, backs_off, retry_now, stale]
    );
    let stale_before = row(pool, stale).await;

    // The failures, the read of the backoff and the claim in one transaction: they share
    // its now(), so the delay read is the backoff itself and the claim looks at the moment
    // of the failures, however long each statement takes on a loaded machine.
    let mut tx = pool.begin().await.unwrap();
    let results = fail_many(
        &mut *tx,
        &[
            (retry_now, token_of(&claimed, retry_now)),
            (stale, Some(Uuid::new_v4())),
            (backs_off, token_of(&claimed, backs_off)),
            (parent, token_of(&claimed, parent)),
            (lane_head, token_of(&claimed, lane_head)),
        ],
        &["now", "stale", "later", "parent failed", "head failed"],
        Some(vec![Some(0.0), None, None, None, None]),
    )
    .await;
    let queued = Some("queued".to_owned());
    let dead = Some("dead".to_owned());
    assert_eq!(
        results,
        [
            (retry_now, queued.clone()),
            (stale, None),
            (backs_off, queued.clone()),
            (parent, dead.clone()),
            (lane_head, dead.clone()),
        ]
    );
    assert_eq!(
        row(&mut *tx, stale).await,
        stale_before,
        "a stale claim changes nothing"
    );
    for (id, message) in [
        (retry_now, "now"),
        (backs_off, "later"),
        (parent, "parent failed"),
        (lane_head, "head failed"),
    ] {
        let after = row(&mut *tx, id).await;
        assert_eq!(after["last_error"], json!(message), "job {id}: {after}");
        assert_eq!(after["errors"][0]["message"], json!(message), "job {id}");
        assert_eq!(after["claim_token"], Value::Null, "job {id}");
    }
    // skiplock.backoff(1): 2 s × [0.75, 1.25).
    let wait = due_in_secs(&mut *tx, backs_off).await;
    assert!((1.5..=2.5).contains(&wait), "due in {wait} s");
    assert_eq!(
        ids(&claim(&mut *tx, 10).await),
        [behind, retry_now],
        "the lane moved on; a retry_in of zero is due at once; the backoff is not over"
    );
    tx.commit().await.unwrap();
    assert_eq!(
        state_of(pool, child).await,
        JobState::Cancelled,
        "its parent died"
    );
}

/// A trigger of the user's on `skiplock.jobs` that refuses to make a job whose args have a
/// `refuse` key succeeded or queued: `job <id> refused`.
async fn refuse_success_and_requeue(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.args ? 'refuse' AND NEW.state IN ('succeeded', 'queued') THEN
                 RAISE EXCEPTION 'job % refused', NEW.id;
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse BEFORE UPDATE ON skiplock.jobs
             FOR EACH ROW EXECUTE FUNCTION public.refuse();",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// One row that refuses its outcome (a trigger of the user's) never stops the others: the
/// batch is saved one claim at a time, the refused job goes dead with the reason (so that
/// nothing stays running behind a finished handler) and its lane moves on. The same for a
/// batch of failures.
#[tokio::test]
async fn a_row_that_refuses_its_outcome_goes_dead_with_the_reason_and_the_batch_is_saved() {
    let db = test_db().await;
    let pool = &db.pool;
    let refused = enqueue_in_lane(pool, "l").await;
    let behind = enqueue_in_lane(pool, "l").await;
    let others = [enqueue_noop(pool).await, enqueue_noop(pool).await];
    let fail_refused = enqueue_noop(pool).await;
    let fail_ok = enqueue_noop(pool).await;
    sqlx::query("UPDATE skiplock.jobs SET args = '{\"refuse\": true}' WHERE id = ANY($1)")
        .bind([refused, fail_refused])
        .execute(pool)
        .await
        .unwrap();
    let claimed = claim(pool, 10).await;
    assert_eq!(
        ids(&claimed),
        [refused, others[0], others[1], fail_refused, fail_ok]
    );
    refuse_success_and_requeue(pool).await;

    let claims: Vec<(i64, Option<Uuid>)> = [others[0], refused, others[1]]
        .into_iter()
        .map(|id| (id, token_of(&claimed, id)))
        .collect();
    let succeeded = Some("succeeded".to_owned());
    let dead = Some("dead".to_owned());
    assert_eq!(
        complete_many(pool, &claims, None).await,
        [
            (others[0], succeeded.clone()),
            (refused, dead.clone()),
            (others[1], succeeded.clone()),
        ]
    );
    assert_eq!(
        row(pool, refused).await["last_error"],
        json!(format!(
            "the outcome of this attempt could not be saved: job {refused} refused"
        ))
    );

    let claims: Vec<(i64, Option<Uuid>)> = [fail_refused, fail_ok]
        .into_iter()
        .map(|id| (id, token_of(&claimed, id)))
        .collect();
    assert_eq!(
        fail_many(pool, &claims, &["boom", "bang"], None).await,
        [
            (fail_refused, dead.clone()),
            (fail_ok, Some("queued".to_owned()))
        ]
    );
    assert_eq!(
        row(pool, fail_refused).await["last_error"],
        json!(format!(
            "the outcome of this attempt could not be saved: job {fail_refused} refused"
        ))
    );
    assert_eq!(row(pool, fail_ok).await["last_error"], json!("bang"));
    assert_eq!(ids(&claim(pool, 10).await), [behind], "the lane moved on");
}

/// The calls for one claim keep the batch forms' promise: a row that refuses its outcome (a
/// trigger of the user's) goes dead with the reason and its lane moves on, and the call
/// says the claim was held, instead of failing the caller's transaction and leaving the job
/// running until the reaper takes it back and runs it again.
#[tokio::test]
async fn each_call_for_one_claim_on_a_row_that_refuses_its_outcome_leaves_it_dead_with_the_reason()
{
    let db = test_db().await;
    let pool = &db.pool;
    let calls = [
        ("SELECT skiplock.complete($1, $2)::text", "true"),
        (
            "SELECT skiplock.complete($1, $2, '{\"n\": 1}')::text",
            "true",
        ),
        ("SELECT skiplock.fail($1, $2, 'boom')::text", "dead"),
        ("SELECT skiplock.release($1, $2)::text", "true"),
        (
            "SELECT skiplock.snooze($1, $2, interval '1 minute')::text",
            "true",
        ),
    ];
    // A lane per call: the job that refuses its outcome, and one behind it.
    let mut lanes = Vec::new();
    for n in 0..calls.len() {
        let lane = format!("l{n}");
        lanes.push((
            enqueue_in_lane(pool, &lane).await,
            enqueue_in_lane(pool, &lane).await,
        ));
    }
    let refusing: Vec<i64> = lanes.iter().map(|(refused, _)| *refused).collect();
    sqlx::query("UPDATE skiplock.jobs SET args = '{\"refuse\": true}' WHERE id = ANY($1)")
        .bind(&refusing)
        .execute(pool)
        .await
        .unwrap();
    refuse_success_and_requeue(pool).await;
    for ((call, held), (refused, behind)) in calls.into_iter().zip(lanes) {
        let claimed = claim_one(pool).await;
        assert_eq!(claimed.id, refused, "{call}");
        let answer: String = sqlx::query_scalar(call)
            .bind(refused)
            .bind(claimed.claim_token)
            .fetch_one(pool)
            .await
            .unwrap_or_else(|e| panic!("{call}: {e}"));
        assert_eq!(answer, held, "{call}");
        let after = row(pool, refused).await;
        assert_eq!(after["state"], json!("dead"), "{call}: {after}");
        assert_eq!(
            after["last_error"],
            json!(format!(
                "the outcome of this attempt could not be saved: job {refused} refused"
            )),
            "{call}"
        );
        let next = claim_one(pool).await;
        assert_eq!(next.id, behind, "{call}: the lane moved on");
        assert!(
            complete(pool, next.id, Some(next.claim_token)).await,
            "{call}"
        );
    }
}

/// Bad arguments are refused with SQLSTATE 22023 before anything changes; empty arrays
/// return nothing.
#[tokio::test]
async fn complete_many_and_fail_many_refuse_bad_arguments_with_sqlstate_22023() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = enqueue_noop(pool).await;
    let job = claim_one(pool).await;
    let before = row(pool, id).await;
    let t = job.claim_token;
    for sql in [
        format!("SELECT * FROM skiplock.complete_many(NULL, ARRAY['{t}'::uuid])"),
        format!("SELECT * FROM skiplock.complete_many(ARRAY[{id}], NULL)"),
        format!("SELECT * FROM skiplock.complete_many(ARRAY[{id}, {id} + 1], ARRAY['{t}'::uuid])"),
        format!(
            "SELECT * FROM skiplock.complete_many(ARRAY[{id}], ARRAY['{t}'::uuid], ARRAY['1', '2']::jsonb[])"
        ),
        format!(
            "SELECT * FROM skiplock.complete_many(ARRAY[{id}, {id}], ARRAY['{t}', '{t}']::uuid[])"
        ),
        format!("SELECT * FROM skiplock.fail_many(ARRAY[{id}], ARRAY['{t}'::uuid], NULL)"),
        format!(
            "SELECT * FROM skiplock.fail_many(ARRAY[{id}], ARRAY['{t}'::uuid], ARRAY['a', 'b'])"
        ),
        format!(
            "SELECT * FROM skiplock.fail_many(ARRAY[{id}], ARRAY['{t}'::uuid], ARRAY['a'], ARRAY[interval '-1 second'])"
        ),
    ] {
        assert_eq!(sqlstate_of(pool, &sql).await, "22023", "{sql}");
    }
    assert_eq!(row(pool, id).await, before, "nothing changed");
    assert!(complete_many(pool, &[], None).await.is_empty());
    assert!(fail_many(pool, &[], &[], None).await.is_empty());
    // A NULL token is a claim not held.
    assert_eq!(complete_many(pool, &[(id, None)], None).await, [(id, None)]);
    assert_eq!(row(pool, id).await, before);
}

/// A batch saved inside the caller's transaction commits or rolls back with it, lanes
/// included.
#[tokio::test]
async fn complete_many_runs_in_the_callers_transaction() {
    let db = test_db().await;
    let pool = &db.pool;
    let head = enqueue_in_lane(pool, "lane").await;
    let behind = enqueue_in_lane(pool, "lane").await;
    let claimed = claim(pool, 10).await;
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        complete_many(&mut *tx, &[(head, token_of(&claimed, head))], None).await,
        [(head, Some("succeeded".to_owned()))]
    );
    tx.rollback().await.unwrap();
    assert_eq!(state_of(pool, head).await, JobState::Running);
    assert_eq!(
        state_of(pool, behind).await,
        JobState::Waiting,
        "behind its lane's head"
    );
    assert!(claim(pool, 10).await.is_empty(), "the lane is still held");
}

/// Each call that writes a held job, made while another transaction moves the job's row to
/// the other partition (an operator's cancel written by hand, which the call waits for):
/// the call meets SQLSTATE 40001 (the row moved under it), runs again in a new snapshot and
/// answers "not held", changing nothing. A `complete` mutated to return true on 40001
/// instead of running again passed every test before this one; a call that let the error
/// out fails here too. (The heartbeat never waits for a row, it skips locked ones, so no
/// move can be forced under it this way.)
#[tokio::test]
async fn each_call_on_a_job_whose_row_moves_under_it_answers_not_held() {
    let db = test_db().await;
    let pool = &db.pool;
    for (call, not_held) in [
        ("SELECT skiplock.complete($1, $2)::text", Some("false")),
        (
            "SELECT skiplock.complete($1, $2, '{\"n\": 1}')::text",
            Some("false"),
        ),
        ("SELECT skiplock.fail($1, $2, 'boom')::text", None),
        ("SELECT skiplock.discard($1, $2, 'boom')::text", None),
        ("SELECT skiplock.release($1, $2)::text", Some("false")),
        (
            "SELECT skiplock.snooze($1, $2, interval '1 minute')::text",
            Some("false"),
        ),
    ] {
        let id = enqueue_noop(pool).await;
        let claimed = claim_one(pool).await;
        assert_eq!(claimed.id, id);
        let mut mover = pool.begin().await.unwrap();
        sqlx::query(
            "UPDATE skiplock.jobs SET state = 'cancelled', finished_at = now(),
                                      claim_token = NULL, heartbeat_at = NULL
             WHERE id = $1",
        )
        .bind(id)
        .execute(&mut *mover)
        .await
        .unwrap();
        let waiting = tokio::spawn({
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, Option<String>>(call)
                    .bind(id)
                    .bind(claimed.claim_token)
                    .fetch_one(&pool)
                    .await
            }
        });
        wait_for_a_lock_wait(pool, call).await;
        mover.commit().await.unwrap();
        let answer = waiting
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{call}: {e}"));
        assert_eq!(answer.as_deref(), not_held, "{call}");
        let after = row(pool, id).await;
        assert_eq!(after["state"], json!("cancelled"), "{call}: {after}");
        assert_eq!(after["output"], Value::Null, "{call}: {after}");
        assert_eq!(after["last_error"], Value::Null, "{call}: {after}");
    }
}

/// The operator's calls on a job whose row another transaction moves between partitions
/// while the call waits for it: `cancel_job` of a running job completed meanwhile (moved
/// to jobs_done) answers false and leaves it succeeded; `retry_job` of a dead job moved to
/// another day meanwhile puts it back in line. Each meets 40001 and runs again. (The
/// reaper skips locked rows, so no move can be forced under it this way.)
#[tokio::test]
async fn operator_calls_on_a_job_whose_row_moves_under_them_run_again() {
    let db = test_db().await;
    let pool = &db.pool;
    let running = enqueue_noop(pool).await;
    assert_eq!(claim_one(pool).await.id, running);
    let dead = enqueue_noop(pool).await;
    sqlx::query(
        "UPDATE skiplock.jobs SET state = 'dead', finished_at = now(), last_error = 'boom'
         WHERE id = $1",
    )
    .bind(dead)
    .execute(pool)
    .await
    .unwrap();
    for (id, moves, call, answer, state_after) in [
        (
            running,
            "UPDATE skiplock.jobs SET state = 'succeeded', finished_at = now(),
                                      claim_token = NULL, heartbeat_at = NULL
             WHERE id = $1",
            "SELECT skiplock.cancel_job($1)",
            false,
            JobState::Succeeded,
        ),
        (
            dead,
            "UPDATE skiplock.jobs SET finished_at = finished_at - interval '30 days'
             WHERE id = $1",
            "SELECT skiplock.retry_job($1)",
            true,
            JobState::Queued,
        ),
    ] {
        let mut mover = pool.begin().await.unwrap();
        sqlx::query(moves)
            .bind(id)
            .execute(&mut *mover)
            .await
            .unwrap();
        let waiting = tokio::spawn({
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, bool>(call)
                    .bind(id)
                    .fetch_one(&pool)
                    .await
            }
        });
        wait_for_a_lock_wait(pool, call).await;
        mover.commit().await.unwrap();
        let got = waiting
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{call}: {e}"));
        assert_eq!(got, answer, "{call}");
        assert_eq!(state_of(pool, id).await, state_after, "{call}");
    }
}
