//! Waiting for a job's outcome (`skiplock::wait_for`, `skiplock.watch_job`): a waiter is
//! woken by the commit that finishes its job, whatever wrote it and in whichever order the
//! wait and the finish meet; a job that is not there is a clear error; a thousand waiters
//! share one listening connection.
//!
//! The waits here that must be woken by a notification run with the fallback look set to
//! an hour ([`by_notification`]): woken by time, they would hang, and the hang guard (60 s)
//! fails the test.

mod common;

use std::time::Duration;

use common::fixtures::{sql_claim, sql_claim_one, state_of, wait_for, wait_for_a_lock_wait};
use common::test_db;
use serde_json::json;
use skiplock::{Error, JobId, JobOutcome, JobState};
use sqlx::postgres::PgListener;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

/// What only guards a hang.
const HANG_GUARD: Duration = Duration::from_secs(60);

/// A fallback look so far off that only a notification wakes the waiter in a test.
const NEVER: Duration = Duration::from_secs(3600);

/// Waits for `id` woken by notifications only (both fallbacks an hour away).
async fn by_notification(pool: &PgPool, id: JobId) -> skiplock::Result<JobOutcome> {
    skiplock::wait_for_with_fallbacks(pool, id, NEVER, NEVER, NEVER).await
}

async fn enqueue(pool: &PgPool, args: serde_json::Value) -> JobId {
    JobId(
        sqlx::query_scalar("SELECT skiplock.enqueue('noop', $1, max_attempts => 1)")
            .bind(args)
            .fetch_one(pool)
            .await
            .unwrap(),
    )
}

/// Claims the job (the only one queued) as a SQL worker does.
async fn claim(db: &mut PgConnection, id: JobId) -> Uuid {
    let (claimed, token) = sql_claim_one(&mut *db, "default", "test").await;
    assert_eq!(claimed, id.0);
    token
}

/// Until the job's row says someone waits for it.
async fn until_awaited(pool: &PgPool, id: JobId) {
    wait_for("the waiter to mark its job", HANG_GUARD, || async {
        sqlx::query_scalar::<_, Option<bool>>("SELECT awaited FROM skiplock.jobs WHERE id = $1")
            .bind(id.0)
            .fetch_one(pool)
            .await
            .unwrap()
            == Some(true)
    })
    .await;
}

async fn guarded<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(HANG_GUARD, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: no wake-up in {HANG_GUARD:?}"))
}

#[tokio::test]
async fn a_waiter_is_woken_by_the_commit_that_finishes_its_job_and_not_before() {
    let db = test_db().await;
    let id = enqueue(&db.pool, json!({})).await;
    let pool = db.pool.clone();
    let mut waiter = tokio::spawn(async move { by_notification(&pool, id).await });
    until_awaited(&db.pool, id).await;

    let mut worker = PgConnection::connect(db.url()).await.unwrap();
    let token = claim(&mut worker, id).await;
    let mut finishing = worker.begin().await.unwrap();
    let saved: bool = sqlx::query_scalar("SELECT skiplock.complete($1, $2, '{\"rows\": 7}')")
        .bind(id.0)
        .bind(token)
        .fetch_one(&mut *finishing)
        .await
        .unwrap();
    assert!(saved);
    // Finished but not committed: nothing to return yet.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut waiter)
            .await
            .is_err(),
        "the waiter returned before the job's completion committed"
    );
    finishing.commit().await.unwrap();

    let outcome = guarded("the completion's commit", waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outcome.id, id);
    assert_eq!(outcome.state, JobState::Succeeded);
    assert_eq!(outcome.attempt, 1);
    assert_eq!(outcome.output, Some(json!({"rows": 7})));
    assert_eq!(outcome.last_error, None);
}

/// Every way a job finishes notifies its waiter: a failure that leaves it dead, a cancel,
/// and a plain UPDATE by hand.
#[tokio::test]
async fn every_writer_that_finishes_a_job_wakes_its_waiter() {
    let db = test_db().await;
    let mut sql = PgConnection::connect(db.url()).await.unwrap();

    let dead = enqueue(&db.pool, json!({})).await;
    let pool = db.pool.clone();
    let waiter = tokio::spawn(async move { by_notification(&pool, dead).await });
    until_awaited(&db.pool, dead).await;
    let token = claim(&mut sql, dead).await;
    let state: String =
        sqlx::query_scalar("SELECT skiplock.fail($1, $2, 'the disk is full')::text")
            .bind(dead.0)
            .bind(token)
            .fetch_one(&mut sql)
            .await
            .unwrap();
    assert_eq!(state, "dead");
    let outcome = guarded("the failure", waiter).await.unwrap().unwrap();
    assert_eq!(outcome.state, JobState::Dead);
    assert_eq!(outcome.last_error.as_deref(), Some("the disk is full"));

    let cancelled = enqueue(&db.pool, json!({})).await;
    let pool = db.pool.clone();
    let waiter = tokio::spawn(async move { by_notification(&pool, cancelled).await });
    until_awaited(&db.pool, cancelled).await;
    assert!(skiplock::cancel(&db.pool, cancelled).await.unwrap());
    let outcome = guarded("the cancel", waiter).await.unwrap().unwrap();
    assert_eq!(outcome.state, JobState::Cancelled);

    let by_hand = enqueue(&db.pool, json!({})).await;
    let pool = db.pool.clone();
    let waiter = tokio::spawn(async move { by_notification(&pool, by_hand).await });
    until_awaited(&db.pool, by_hand).await;
    sqlx::query(
        "UPDATE skiplock.jobs SET state = 'succeeded', finished_at = now(), output = '42'
         WHERE id = $1",
    )
    .bind(by_hand.0)
    .execute(&mut sql)
    .await
    .unwrap();
    let outcome = guarded("the UPDATE by hand", waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outcome.state, JobState::Succeeded);
    assert_eq!(outcome.output, Some(json!(42)));
}

#[tokio::test]
async fn a_job_finished_already_returns_at_once_and_a_missing_one_is_a_clear_error() {
    let db = test_db().await;
    let id = enqueue(&db.pool, json!({})).await;
    assert!(skiplock::cancel(&db.pool, id).await.unwrap());
    let outcome = by_notification(&db.pool, id).await.unwrap();
    assert_eq!(outcome.state, JobState::Cancelled);
    // Finished before anyone waited: its row was not written again.
    let awaited: Option<bool> =
        sqlx::query_scalar("SELECT awaited FROM skiplock.jobs WHERE id = $1")
            .bind(id.0)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(awaited, None);

    let missing = JobId(id.0 + 1000);
    match by_notification(&db.pool, missing).await {
        Err(Error::JobNotFound { id }) => assert_eq!(id, missing),
        other => panic!("expected JobNotFound, got {other:?}"),
    }
    let message = Error::JobNotFound { id: missing }.to_string();
    assert!(message.contains(&missing.0.to_string()) && message.contains("does not exist"));
}

#[tokio::test]
async fn a_wait_that_runs_out_says_so_and_leaves_the_job_alone() {
    let db = test_db().await;
    let id = enqueue(&db.pool, json!({})).await;
    match skiplock::wait_for(&db.pool, id, Duration::from_millis(200)).await {
        Err(Error::WaitTimedOut {
            id: late, state, ..
        }) => {
            assert_eq!(late, id);
            assert_eq!(state, Some(JobState::Queued));
        }
        other => panic!("expected WaitTimedOut, got {other:?}"),
    }
    assert_eq!(state_of(&db.pool, id.0).await, JobState::Queued);
}

/// A job deleted while waited for ends the wait with JobNotFound at the next look (no
/// notification: a delete of a live job does not notify), not with a hang.
#[tokio::test]
async fn a_job_deleted_while_waited_for_ends_the_wait_with_a_clear_error() {
    let db = test_db().await;
    let id = enqueue(&db.pool, json!({})).await;
    let pool = db.pool.clone();
    let waiter = tokio::spawn(async move {
        skiplock::wait_for_with_fallbacks(&pool, id, NEVER, Duration::from_millis(100), NEVER).await
    });
    until_awaited(&db.pool, id).await;
    sqlx::query("DELETE FROM skiplock.jobs WHERE id = $1")
        .bind(id.0)
        .execute(&db.pool)
        .await
        .unwrap();
    match guarded("the fallback look", waiter).await.unwrap() {
        Err(Error::JobNotFound { id: gone }) => assert_eq!(gone, id),
        other => panic!("expected JobNotFound, got {other:?}"),
    }
}

/// The two orders of a watch and a finish that overlap, in plain SQL: the watch waits for
/// a completion that holds the row and then reads the finished row (the row moved under
/// it: 40001, run again); a completion that waits for a watch holding the row sees the
/// flag and notifies.
#[tokio::test]
async fn a_watch_and_a_finish_that_overlap_lose_no_wake_up_in_either_order() {
    let db = test_db().await;
    let mut worker = PgConnection::connect(db.url()).await.unwrap();

    // The completion first, held open; the watch waits for it.
    let first = enqueue(&db.pool, json!({})).await;
    let token = claim(&mut worker, first).await;
    let mut finishing = worker.begin().await.unwrap();
    sqlx::query("SELECT skiplock.complete($1, $2)")
        .bind(first.0)
        .bind(token)
        .execute(&mut *finishing)
        .await
        .unwrap();
    let pool = db.pool.clone();
    let watch = tokio::spawn(async move {
        sqlx::query_as::<_, (String, Option<chrono::DateTime<chrono::Utc>>)>(
            "SELECT state::text, finished_at FROM skiplock.watch_job($1)",
        )
        .bind(first.0)
        .fetch_one(&pool)
        .await
    });
    wait_for_a_lock_wait(&db.pool, "the watch to wait for the completion's row").await;
    finishing.commit().await.unwrap();
    let (state, finished_at) = guarded("the watch", watch).await.unwrap().unwrap();
    assert_eq!(state, "succeeded");
    assert!(finished_at.is_some());

    // The watch first, held open; the completion waits for it and notifies.
    let second = enqueue(&db.pool, json!({})).await;
    let token = claim(&mut worker, second).await;
    let mut listener = PgListener::connect(db.url()).await.unwrap();
    listener.listen("skiplock_finished").await.unwrap();
    let mut watcher = PgConnection::connect(db.url()).await.unwrap();
    let mut watching = watcher.begin().await.unwrap();
    let (state, finished_at): (String, Option<chrono::DateTime<chrono::Utc>>) =
        sqlx::query_as("SELECT state::text, finished_at FROM skiplock.watch_job($1)")
            .bind(second.0)
            .fetch_one(&mut *watching)
            .await
            .unwrap();
    assert_eq!((state.as_str(), finished_at), ("running", None));
    let pool = db.pool.clone();
    let completion = tokio::spawn(async move {
        sqlx::query_scalar::<_, bool>("SELECT skiplock.complete($1, $2)")
            .bind(second.0)
            .bind(token)
            .fetch_one(&pool)
            .await
    });
    wait_for_a_lock_wait(&db.pool, "the completion to wait for the watched row").await;
    watching.commit().await.unwrap();
    assert!(
        guarded("the completion", completion)
            .await
            .unwrap()
            .unwrap()
    );
    let heard = guarded("the notification", listener.recv()).await.unwrap();
    assert_eq!(heard.payload(), second.0.to_string());
}

/// A thousand waiters on a pool of four connections: one listening connection between
/// them, and each woken with its own job's outcome when a plain UPDATE finishes them all.
#[tokio::test]
async fn a_thousand_waiters_share_one_listening_connection() {
    const WAITERS: i64 = 1000;
    let db = test_db().await;
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT skiplock.enqueue('noop', jsonb_build_object('n', n)) FROM generate_series(1, $1) n",
    )
    .bind(WAITERS)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(db.url())
        .await
        .unwrap();
    let mut waiters = tokio::task::JoinSet::new();
    for &id in &ids {
        let pool = pool.clone();
        waiters.spawn(async move { (id, by_notification(&pool, JobId(id)).await) });
    }
    wait_for("every waiter to mark its job", HANG_GUARD, || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM skiplock.jobs WHERE awaited")
            .fetch_one(&db.pool)
            .await
            .unwrap()
            == WAITERS
    })
    .await;
    let listening: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        listening, 1,
        "waiters of one pool share one listening connection"
    );

    sqlx::query(
        "UPDATE skiplock.jobs SET state = 'succeeded', finished_at = now(), output = args
         WHERE state = 'queued'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut woken = 0;
    while let Some(joined) = guarded("the waiters", waiters.join_next()).await {
        let (id, outcome) = joined.unwrap();
        let outcome = outcome.unwrap();
        assert_eq!(outcome.id, id);
        assert_eq!(outcome.state, JobState::Succeeded);
        assert!(outcome.output.unwrap()["n"].is_number());
        woken += 1;
    }
    assert_eq!(woken, WAITERS);
    // The last waiter closed the hub's connection.
    wait_for("the listening connection to close", HANG_GUARD, || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND query LIKE 'LISTEN%'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
            == 0
    })
    .await;
}

/// Finished rows written by hand with no time, or times chrono cannot hold, are outcomes
/// all the same (saturated times), never a failed decode.
#[tokio::test]
async fn a_finished_row_written_by_hand_with_any_time_is_an_outcome() {
    let db = test_db().await;
    for (finished_at, expected) in [
        ("NULL", chrono::DateTime::<chrono::Utc>::MIN_UTC),
        ("'-infinity'", chrono::DateTime::<chrono::Utc>::MIN_UTC),
        ("'infinity'", chrono::DateTime::<chrono::Utc>::MAX_UTC),
        (
            "'294276-12-31 23:59:59+00'",
            chrono::DateTime::<chrono::Utc>::MAX_UTC,
        ),
    ] {
        let id = enqueue(&db.pool, json!({})).await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE skiplock.jobs SET state = 'dead', finished_at = {finished_at}, last_error = 'x'
             WHERE id = $1"
        )))
        .bind(id.0)
        .execute(&db.pool)
        .await
        .unwrap();
        let outcome = by_notification(&db.pool, id).await.unwrap();
        assert_eq!(outcome.state, JobState::Dead, "{finished_at}");
        assert_eq!(outcome.finished_at, expected, "{finished_at}");
    }
}

/// The listening connection killed while a waiter waits, and its job finished at once:
/// the notification may be lost with the connection, so the listener's return makes every
/// waiter look again (fallbacks an hour away: only that look, or the notification if the
/// listener was back in time, can wake it).
#[tokio::test]
async fn a_waiter_whose_listener_was_killed_still_gets_its_outcome() {
    let db = test_db().await;
    let id = enqueue(&db.pool, json!({})).await;
    let pool = db.pool.clone();
    let waiter = tokio::spawn(async move { by_notification(&pool, id).await });
    until_awaited(&db.pool, id).await;
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(killed, 1, "the hub's listening connection");
    sqlx::query("UPDATE skiplock.jobs SET state = 'succeeded', finished_at = now() WHERE id = $1")
        .bind(id.0)
        .execute(&db.pool)
        .await
        .unwrap();
    let outcome = guarded("the listener's return", waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outcome.state, JobState::Succeeded);
}

/// A look that waits for the job's row (another transaction holds it locked) still ends at
/// the timeout, with no state known.
#[tokio::test]
async fn a_wait_whose_job_row_stays_locked_still_times_out() {
    let db = test_db().await;
    let id = enqueue(&db.pool, json!({})).await;
    let mut holder = PgConnection::connect(db.url()).await.unwrap();
    let mut holding = holder.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM skiplock.jobs_live WHERE id = $1 FOR UPDATE")
        .bind(id.0)
        .execute(&mut *holding)
        .await
        .unwrap();
    let waited = guarded(
        "a wait of 300 ms",
        skiplock::wait_for(&db.pool, id, Duration::from_millis(300)),
    )
    .await;
    match waited {
        Err(Error::WaitTimedOut { state, .. }) => assert_eq!(state, None),
        other => panic!("expected WaitTimedOut, got {other:?}"),
    }
    holding.rollback().await.unwrap();
}

/// On a database whose default isolation is REPEATABLE READ (the caller's pool is not
/// pinned), a look that waited for a finishing transaction fails with 40001 instead of
/// reading the finished row; it looks again and returns the outcome.
#[tokio::test]
async fn a_wait_on_a_repeatable_read_database_returns_a_finish_it_waited_for() {
    let db = test_db().await;
    let id = enqueue(&db.pool, json!({})).await;
    db.set_for_new_sessions("default_transaction_isolation = 'repeatable read'")
        .await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(db.url())
        .await
        .unwrap();
    let mut finisher = PgConnection::connect(db.url()).await.unwrap();
    let mut finishing = finisher.begin().await.unwrap();
    sqlx::query("UPDATE skiplock.jobs SET state = 'cancelled', finished_at = now() WHERE id = $1")
        .bind(id.0)
        .execute(&mut *finishing)
        .await
        .unwrap();
    let waiter = tokio::spawn(async move { by_notification(&pool, id).await });
    wait_for_a_lock_wait(&db.pool, "the look to wait for the finishing row").await;
    finishing.commit().await.unwrap();
    let outcome = guarded("the finish", waiter).await.unwrap().unwrap();
    assert_eq!(outcome.state, JobState::Cancelled);
}

/// A second waiter whose write waited for the first one's holds the queued row until it
/// commits, as the first did: it announces the row too, so a claim that passed over it
/// meanwhile is told to look again.
#[tokio::test]
async fn a_second_watch_of_a_queued_job_announces_it_again() {
    let db = test_db().await;
    let id = enqueue(&db.pool, json!({})).await;
    let mut runnable = PgListener::connect(db.url()).await.unwrap();
    runnable.listen("skiplock_runnable").await.unwrap();
    let mut first = PgConnection::connect(db.url()).await.unwrap();
    let mut first_tx = first.begin().await.unwrap();
    sqlx::query("SELECT * FROM skiplock.watch_job($1)")
        .bind(id.0)
        .execute(&mut *first_tx)
        .await
        .unwrap();
    let url = db.url().to_owned();
    let second = tokio::spawn(async move {
        let mut second = PgConnection::connect(&url).await.unwrap();
        let mut second_tx = second.begin().await.unwrap();
        let (state,): (String,) = sqlx::query_as("SELECT state::text FROM skiplock.watch_job($1)")
            .bind(id.0)
            .fetch_one(&mut *second_tx)
            .await
            .unwrap();
        second_tx.commit().await.unwrap();
        (second, state)
    });
    wait_for_a_lock_wait(&db.pool, "the second watch to wait for the first").await;
    first_tx.commit().await.unwrap();
    let heard = guarded("the first watch's announce", runnable.recv())
        .await
        .unwrap();
    assert!(
        heard.payload().ends_with("\tdefault"),
        "{}",
        heard.payload()
    );
    let (_second, state) = guarded("the second watch", second).await.unwrap();
    assert_eq!(state, "queued");
    let heard = guarded("the second watch's announce", runnable.recv())
        .await
        .unwrap();
    assert!(
        heard.payload().ends_with("\tdefault"),
        "{}",
        heard.payload()
    );
}

/// An output serde_json cannot hold (a number beyond f64) is returned as its text, in a
/// string, instead of failing the wait.
#[tokio::test]
async fn an_output_serde_json_cannot_hold_comes_back_as_its_text() {
    let db = test_db().await;
    let id = enqueue(&db.pool, json!({})).await;
    sqlx::query(
        "UPDATE skiplock.jobs SET state = 'succeeded', finished_at = now(), output = '1e400'
         WHERE id = $1",
    )
    .bind(id.0)
    .execute(&db.pool)
    .await
    .unwrap();
    let outcome = by_notification(&db.pool, id).await.unwrap();
    let text = outcome.output.unwrap();
    assert!(
        text.as_str()
            .is_some_and(|t| t.starts_with('1') && t.len() > 100),
        "{text}"
    );
}

/// A job held for its key, watched (its row locked by the waiter's mark) while its key's
/// slot frees: the release the next claim makes skips the locked row, so the mark asks for
/// it again, and the claim after the waiter's commit takes the job (not the sweep, minutes
/// later beside many waiting jobs).
#[tokio::test]
async fn a_watched_job_held_for_its_key_is_let_go_when_the_key_frees() {
    let db = test_db().await;
    sqlx::query("INSERT INTO skiplock.queues (name, key_max_running) VALUES ('keyed', 1)")
        .execute(&db.pool)
        .await
        .unwrap();
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT skiplock.enqueue('noop', '{}', queue => 'keyed', concurrency_key => 'k')
         FROM generate_series(1, 2)",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let claim = || sql_claim(&db.pool, "keyed", 10, "test");
    let first = claim().await;
    assert_eq!(first.iter().map(|c| c.0).collect::<Vec<_>>(), [ids[0]]);
    let held: Option<String> =
        sqlx::query_scalar("SELECT held_for FROM skiplock.jobs WHERE id = $1")
            .bind(ids[1])
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        held.as_deref(),
        Some("key"),
        "the second job is held for its key"
    );

    let mut watcher = PgConnection::connect(db.url()).await.unwrap();
    let mut watching = watcher.begin().await.unwrap();
    sqlx::query("SELECT * FROM skiplock.watch_job($1)")
        .bind(ids[1])
        .execute(&mut *watching)
        .await
        .unwrap();
    let saved = common::fixtures::sql_complete(&db.pool, first[0].0, first[0].1).await;
    assert!(saved);
    assert!(
        claim().await.is_empty(),
        "the release skipped the watched row"
    );
    watching.commit().await.unwrap();
    let after = claim().await;
    assert_eq!(after.iter().map(|c| c.0).collect::<Vec<_>>(), [ids[1]]);
}
