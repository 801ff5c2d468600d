//! The claim from a position (`claim_batch`, `worker::claim_cursor`): what a claim after
//! a position takes, and that jobs landing behind a worker's position still run.

mod common;

use std::time::Duration;

use common::fixtures::{Recorder, fast_worker};
use common::test_db;
use serde::{Deserialize, Serialize};
use skiplock::db::jobs::{ClaimPosition, jobs_claim_batch, jobs_claim_batch_after};
use skiplock::{Job, JobContext, JobError};
use sqlx::{Connection, PgPool};

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// Inserts a `record` job with the given priority and `scheduled_at` (an SQL expression's
/// text, cast to timestamptz).
async fn insert(pool: &PgPool, priority: i16, scheduled_at: &str) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, priority, scheduled_at)
         VALUES ('record', '{\"n\": 0}', $1, $2::timestamptz) RETURNING id",
    )
    .bind(priority)
    .bind(scheduled_at)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_claim_from_a_position_takes_only_the_jobs_after_it_in_claim_order() {
    let db = test_db().await;
    let pool = &db.pool;
    let early = "2026-01-01 00:00:00+00";
    let later = "2026-01-02 00:00:00+00";
    let a = insert(pool, 0, early).await;
    let b = insert(pool, 0, later).await;
    let c = insert(pool, 0, early).await;
    let d = insert(pool, 1, early).await;
    let e = insert(pool, -1, later).await;
    let (queues, kinds) = (strings(&["default"]), strings(&["record"]));

    // Claim order: e (priority -1), a, c (early, by id), b (later), d (priority 1).
    let first = jobs_claim_batch(pool, &queues, &kinds, 2, "w")
        .await
        .unwrap();
    let ids: Vec<i64> = first.iter().map(|j| j.id).collect();
    assert_eq!(ids, [e, a]);
    let at_a = first[1].position();
    assert_eq!(at_a.priority, 0);
    assert_eq!(at_a.id, a);

    let rest = jobs_claim_batch_after(pool, &queues, &kinds, 10, "w", Some(at_a), None)
        .await
        .unwrap();
    let ids: Vec<i64> = rest.iter().map(|j| j.id).collect();
    assert_eq!(ids, [c, b, d]);

    // A job landing behind the position is not taken from it, only by a full walk.
    let behind = insert(pool, 0, early).await;
    let from_end = jobs_claim_batch_after(
        pool,
        &queues,
        &kinds,
        10,
        "w",
        Some(rest[2].position()),
        None,
    )
    .await
    .unwrap();
    assert!(from_end.is_empty(), "nothing after d: {from_end:?}");
    let full = jobs_claim_batch(pool, &queues, &kinds, 10, "w")
        .await
        .unwrap();
    assert_eq!(full.iter().map(|j| j.id).collect::<Vec<_>>(), [behind]);
}

/// The table accepts `scheduled_at = '-infinity'`; such a job is claimed like any other and
/// its position (the bigint minimum) brings the claim back to the right place.
#[tokio::test]
async fn jobs_scheduled_at_minus_infinity_are_claimed_and_their_position_round_trips() {
    let db = test_db().await;
    let pool = &db.pool;
    let first = insert(pool, 0, "-infinity").await;
    let second = insert(pool, 0, "-infinity").await;
    let normal = insert(pool, 0, "2026-01-01 00:00:00+00").await;
    let (queues, kinds) = (strings(&["default"]), strings(&["record"]));

    let claimed = jobs_claim_batch(pool, &queues, &kinds, 1, "w")
        .await
        .unwrap();
    assert_eq!(claimed[0].id, first);
    assert_eq!(
        claimed[0].position(),
        ClaimPosition {
            priority: 0,
            scheduled_at_us: i64::MIN,
            id: first
        }
    );
    let rest = jobs_claim_batch_after(
        pool,
        &queues,
        &kinds,
        10,
        "w",
        Some(claimed[0].position()),
        None,
    )
    .await
    .unwrap();
    assert_eq!(
        rest.iter().map(|j| j.id).collect::<Vec<_>>(),
        [second, normal]
    );
    assert_eq!(
        rest[1].scheduled_at_us, 1_767_225_600_000_000,
        "2026-01-01 in microseconds since the epoch"
    );
}

/// When it runs, enqueues a `record` job ahead of every other in claim order (priority
/// -1, scheduled in the past): behind the position of the worker that runs it.
#[derive(Serialize, Deserialize, Clone)]
struct JumpsTheLine {}

impl Job for JumpsTheLine {
    const KIND: &'static str = "jumps_the_line";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let pool = ctx.data::<PgPool>().expect("worker was given the pool");
        sqlx::query(
            "INSERT INTO skiplock.jobs (kind, args, priority, scheduled_at)
             VALUES ('record', '{\"n\": 1}', -1, '2000-01-01')",
        )
        .execute(pool)
        .await
        .map_err(|e| JobError::retry(e.to_string()))?;
        Ok(())
    }
}

/// A worker draining a backlog claims from its last position; a job that lands behind it
/// while it drains, under a snapshot held open the whole time, still runs: the full walks
/// (paced, and one after every short claim) find it, and the worker exits idle only after.
/// Were the worker to claim only from its position, the job would stay queued and the
/// worker would never exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_landing_behind_the_workers_position_still_runs() {
    let db = test_db().await;
    let pool = &db.pool;
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, args)
         SELECT 'record', jsonb_build_object('n', 0) FROM generate_series(1, 2000)",
    )
    .execute(pool)
    .await
    .unwrap();
    // Claimed first (priority -5), so the job it adds lands behind the worker's position.
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, args, priority) VALUES ('jumps_the_line', '{}', -5)",
    )
    .execute(pool)
    .await
    .unwrap();
    let mut held = sqlx::PgConnection::connect(db.url()).await.unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut held)
        .await
        .unwrap();
    sqlx::query("SELECT txid_current()")
        .execute(&mut held)
        .await
        .unwrap();

    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder)
        .data(pool.clone())
        .register::<JumpsTheLine>()
        .exit_when_idle(true)
        .build()
        .unwrap();
    let summary = tokio::time::timeout(Duration::from_secs(60), worker.run())
        .await
        .expect("the worker drains everything and exits")
        .unwrap();
    sqlx::query("ROLLBACK").execute(&mut held).await.unwrap();

    let jumped: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs WHERE priority = -1 AND state = 'succeeded'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(jumped, 1, "the job behind the position ran");
    let unfinished: i64 =
        sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state <> 'succeeded'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(unfinished, 0);
    assert_eq!(recorder.total(), 2001, "{summary:?}");
}
