//! The statements that work on a batch of claims stay O(batch) as the table grows.
//!
//! A worker's connections live long, and a plan cached while `skiplock.jobs` was nearly
//! empty (a worker started on a fresh database, on a server where no ANALYZE invalidates
//! it) scanned the whole table for every completion: a
//! steady 5,000 jobs/s fell behind as the table grew. Each test caches what it can on one
//! connection while the table holds a few jobs, grows the table, and checks in
//! the backend's own counts of the statement's transaction (`pg_stat_get_xact_numscans`)
//! that the statement did not scan `skiplock.jobs` sequentially.
//! Each test turns autovacuum off on the test's own table first ([`no_autovacuum`]),
//! whatever the server's setting: an autoanalyze after the table grew would invalidate
//! the cached plan and let a statement that scans pass. The
//! first statement on the fresh connection also covers sqlx 0.9 losing an unnamed
//! statement when it looks up a custom type (transact-rs/sqlx#4305): it used to fail there.

mod common;

use common::fixtures::strings;
use common::test_db;
use skiplock::db::jobs::{
    ClaimedJob, FailAction, FailBatch, jobs_claim_batch, jobs_complete_many, jobs_fail_many,
    jobs_heartbeat_many, jobs_release_many,
};
use skiplock::db::maintenance::{jobs_reap_stale, jobs_reap_stale_since, jobs_stale_threshold};
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres};
use uuid::Uuid;

/// Jobs in the table when the batch statement runs for real.
const GROWN_TO: i64 = 20_000;

/// Claims per warm-up run: more than the 10 rows the planner assumes for `unnest` of a
/// parameter, so the generic plan looks no costlier than the custom ones and is kept.
const WARM_UP_BATCH: i64 = 20;

/// Executions of a statement before Postgres may switch a named statement to its generic
/// plan (the plan cache tries five custom plans first).
const WARM_UP_RUNS: usize = 6;

async fn insert_jobs(pool: &PgPool, count: i64) {
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, args)
         SELECT 'noop', '{}' FROM generate_series(1, $1)",
    )
    .bind(count)
    .execute(pool)
    .await
    .unwrap();
}

async fn claim(conn: &mut PoolConnection<Postgres>, limit: i64) -> (Vec<i64>, Vec<Uuid>) {
    let jobs: Vec<ClaimedJob> = jobs_claim_batch(
        &mut **conn,
        "default",
        &strings(&["noop"]),
        limit,
        "plans-test",
    )
    .await
    .unwrap();
    assert_eq!(jobs.len() as i64, limit, "claimable jobs");
    jobs.into_iter().map(|j| (j.id, j.claim_token)).unzip()
}

/// Sequential scans of `skiplock.jobs` (its leaf partitions) by this backend in its
/// current transaction: the backend's own counts, which it reports only when a transaction
/// ends, so no other session, and no connection flushing its counts as it closes, moves
/// them (a cumulative count from `pg_stat_user_tables` once took 37 scans of a migration's
/// connection, reported late on a loaded machine, for the heartbeat's).
async fn own_seq_scans(conn: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        // On a table, `numscans` counts its sequential scans (`pg_stat_xact_user_tables`
        // shows it as `seq_scan`); index scans count on the indexes.
        "SELECT coalesce(sum(pg_stat_get_xact_numscans(relid)), 0)::bigint
         FROM pg_partition_tree('skiplock.jobs') WHERE isleaf",
    )
    .fetch_one(conn)
    .await
    .unwrap()
}

/// Runs `statement` on claims of one connection: [`WARM_UP_RUNS`] times with a few jobs
/// in the table, then once on 100 claims with [`GROWN_TO`] jobs in it, and returns how many
/// sequential scans of the jobs table that last run made and how many claims it matched.
async fn scans_of_batch_statement<F, Fut>(statement: F) -> (i64, usize)
where
    F: Fn(PoolConnection<Postgres>, Vec<i64>, Vec<Uuid>) -> Fut,
    Fut: std::future::Future<Output = (PoolConnection<Postgres>, usize)>,
{
    let db = test_db().await;
    common::jobs_autovacuum_off(&db.pool).await;
    let one = PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .unwrap();
    let mut conn = one.acquire().await.unwrap();
    for _ in 0..WARM_UP_RUNS {
        insert_jobs(&db.pool, WARM_UP_BATCH).await;
        let (ids, tokens) = claim(&mut conn, WARM_UP_BATCH).await;
        let (back, matched) = statement(conn, ids, tokens).await;
        conn = back;
        assert_eq!(
            matched as i64, WARM_UP_BATCH,
            "the warm-up claims are matched"
        );
    }
    insert_jobs(&db.pool, GROWN_TO).await;
    let (ids, tokens) = claim(&mut conn, 100).await;
    // The statement runs inside a transaction of the test's, so the backend's counts of
    // that transaction, read before and after, are the statement's alone.
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    let before = own_seq_scans(&mut conn).await;
    let (mut conn, matched) = statement(conn, ids, tokens).await;
    let after = own_seq_scans(&mut conn).await;
    sqlx::query("COMMIT").execute(&mut *conn).await.unwrap();
    (after - before, matched)
}

#[tokio::test]
async fn completing_a_batch_does_not_scan_the_table() {
    let (scans, matched) = scans_of_batch_statement(|mut conn, ids, tokens| async move {
        let saved = jobs_complete_many(&mut *conn, &ids, &tokens).await.unwrap();
        (conn, saved.len())
    })
    .await;
    assert_eq!(matched, 100);
    assert_eq!(
        scans, 0,
        "sequential scans of skiplock.jobs by one completion"
    );
}

#[tokio::test]
async fn failing_a_batch_does_not_scan_the_table() {
    let (scans, matched) = scans_of_batch_statement(|mut conn, ids, tokens| async move {
        let mut batch = FailBatch::default();
        for (id, token) in ids.iter().zip(&tokens) {
            batch.push(*id, *token, "boom".to_owned(), 1_000, FailAction::Retry);
        }
        let saved = jobs_fail_many(&mut *conn, &batch).await.unwrap();
        (conn, saved.len())
    })
    .await;
    assert_eq!(matched, 100);
    assert_eq!(
        scans, 0,
        "sequential scans of skiplock.jobs by one failure batch"
    );
}

#[tokio::test]
async fn releasing_a_batch_does_not_scan_the_table() {
    let (scans, matched) = scans_of_batch_statement(|mut conn, ids, tokens| async move {
        let released = jobs_release_many(&mut *conn, &ids, &tokens, &vec![0; ids.len()])
            .await
            .unwrap();
        (conn, released.len())
    })
    .await;
    assert_eq!(matched, 100);
    assert_eq!(scans, 0, "sequential scans of skiplock.jobs by one release");
}

#[tokio::test]
async fn a_heartbeat_does_not_scan_the_table() {
    let (scans, matched) = scans_of_batch_statement(|mut conn, ids, tokens| async move {
        let gone = jobs_heartbeat_many(&mut *conn, &ids, &tokens, &[])
            .await
            .unwrap();
        assert!(gone.is_empty(), "claims reported gone: {gone:?}");
        // Leave nothing running for the next warm-up claim to trip over.
        let saved = jobs_complete_many(&mut *conn, &ids, &tokens).await.unwrap();
        (conn, saved.len())
    })
    .await;
    assert_eq!(matched, 100);
    assert_eq!(
        scans, 0,
        "sequential scans of skiplock.jobs by one heartbeat"
    );
}

/// Index entries of `jobs_running_idx` this backend read in its current transaction (its
/// own counts, as [`own_seq_scans`]).
async fn own_running_index_reads(conn: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT pg_stat_get_xact_tuples_returned('skiplock.jobs_running_idx'::regclass)",
    )
    .fetch_one(conn)
    .await
    .unwrap()
}

/// While another session holds a snapshot with an xid, every job that ran since keeps its
/// entry in `jobs_running_idx`, and a full reaper pass reads every one of them (a pass
/// grew without bound through a held snapshot: 21 ms after 300,000 jobs). The reaper's
/// window, from the previous pass's threshold on, reads none of them.
#[tokio::test]
async fn a_reaper_window_steps_over_none_of_the_entries_a_held_snapshot_keeps() {
    const JOBS: i64 = 2_000;
    let db = test_db().await;
    let pool = &db.pool;
    common::jobs_autovacuum_off(pool).await;
    let mut held = pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *held)
        .await
        .unwrap();
    sqlx::query("SELECT txid_current()")
        .execute(&mut *held)
        .await
        .unwrap();
    insert_jobs(pool, JOBS).await;
    let mut conn = pool.acquire().await.unwrap();
    let (ids, tokens) = claim(&mut conn, JOBS).await;
    let done = jobs_complete_many(&mut *conn, &ids, &tokens).await.unwrap();
    assert_eq!(done.len() as i64, JOBS);
    // Stale after 0 ms: every heartbeat so far is before the threshold.
    let since = jobs_stale_threshold(&mut *conn, 0).await.unwrap();

    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let before = own_running_index_reads(&mut tx).await;
    let reaped = jobs_reap_stale_since(&mut *tx, 0, 1_000, since)
        .await
        .unwrap();
    assert!(reaped.is_empty());
    let window = own_running_index_reads(&mut tx).await - before;
    tx.commit().await.unwrap();

    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let before = own_running_index_reads(&mut tx).await;
    let reaped = jobs_reap_stale(&mut *tx, 0, 1_000).await.unwrap();
    assert!(reaped.is_empty());
    let full = own_running_index_reads(&mut tx).await - before;
    tx.commit().await.unwrap();
    held.rollback().await.unwrap();

    assert!(
        full >= JOBS,
        "a full pass reads every kept entry: {full} of {JOBS}"
    );
    assert!(window < 10, "the window read {window} entries");
}
