//! The history rollup: pruning moves finished jobs into it in one statement, so every
//! finished job is counted once, live or rolled up; retention folds old hours into totals.

use chrono::{Duration, Utc};
use skiplock::db::history::{
    Granularity, HistoryFilter, HistoryRow, job_history_list, job_history_prune_expired,
    job_history_totals, jobs_delete_rolled_up, jobs_prune_finished_rolled_up,
};
use skiplock::db::maintenance::jobs_prune_finished;
use skiplock::{JobId, JobState};
use sqlx::PgPool;

use crate::common::fixtures::state_if_any;
use crate::common::test_db;
use crate::support::seed;

async fn hours(pool: &PgPool) -> Vec<HistoryRow> {
    let filter = HistoryFilter {
        granularity: Granularity::Hour,
        since: Utc::now() - Duration::days(2),
        queue: None,
        kind: None,
    };
    job_history_list(pool, &filter).await.unwrap()
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[tokio::test]
async fn pruning_rolls_up_what_it_deletes_so_history_stays_the_same() {
    let db = test_db().await;
    seed(&db.pool).await;
    let before = hours(&db.pool).await;
    let totals_before = job_history_totals(&db.pool).await.unwrap();
    assert!(!before.is_empty());
    let succeeded: i64 = before.iter().map(|r| r.succeeded).sum();
    let failed: i64 = before.iter().map(|r| r.failed).sum();
    assert_eq!((succeeded, failed), (5, 8));

    // Small batches, as the pruner runs them; 0 ms retention takes every finished job.
    let mut pruned = 0;
    loop {
        let n = jobs_prune_finished_rolled_up(&db.pool, 0, 0, 0, 3)
            .await
            .unwrap();
        pruned += n;
        if n < 3 {
            break;
        }
    }
    assert_eq!(pruned, 5 + 2 + 1, "succeeded, dead and cancelled jobs");
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM skiplock.jobs WHERE finished_at IS NOT NULL"
        )
        .await,
        0
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM skiplock.jobs").await,
        3 + 2 + 2 + 4
    );
    assert!(count(&db.pool, "SELECT count(*) FROM skiplock.job_history").await > 0);

    assert_eq!(
        hours(&db.pool).await,
        before,
        "history unchanged by pruning"
    );
    assert_eq!(job_history_totals(&db.pool).await.unwrap(), totals_before);
}

#[tokio::test]
async fn rolled_up_pruning_deletes_the_same_rows_as_the_plain_pruner() {
    // Retentions that split the seed: successes older than 25 s (3 of 5, finished 10 s
    // apart), dead older than an hour (none), cancelled older than 30 s (the one). Each
    // database is pruned right after its seed, so the ages are as seeded.
    let retention = (25_000, 30_000, 3_600_000);
    let remaining = |pool: PgPool| async move {
        sqlx::query_as::<_, (String, String, String)>(
            "SELECT queue, kind, state::text FROM skiplock.jobs ORDER BY id",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let db = test_db().await;
    let other = test_db().await;
    seed(&db.pool).await;
    let rolled =
        jobs_prune_finished_rolled_up(&db.pool, retention.0, retention.1, retention.2, 1000)
            .await
            .unwrap();
    seed(&other.pool).await;
    let plain = jobs_prune_finished(&other.pool, retention.0, retention.1, retention.2, 1000)
        .await
        .unwrap();
    assert_eq!(rolled, 4);
    assert_eq!(rolled, plain);
    assert_eq!(
        remaining(db.pool.clone()).await,
        remaining(other.pool.clone()).await
    );
}

#[tokio::test]
async fn deleting_a_job_keeps_its_history_and_refuses_running_jobs_and_parents() {
    let db = test_db().await;
    let seeded = seed(&db.pool).await;
    let before = hours(&db.pool).await;
    assert!(
        jobs_delete_rolled_up(&db.pool, JobId(seeded.dead[0]))
            .await
            .unwrap()
    );
    assert_eq!(state_if_any(&db.pool, seeded.dead[0]).await, None);
    assert_eq!(hours(&db.pool).await, before);
    // An unfinished job leaves no trace in the history.
    assert!(
        jobs_delete_rolled_up(&db.pool, JobId(seeded.runnable[0]))
            .await
            .unwrap()
    );
    assert_eq!(hours(&db.pool).await, before);

    assert!(
        !jobs_delete_rolled_up(&db.pool, JobId(seeded.running[0]))
            .await
            .unwrap()
    );
    assert!(
        !jobs_delete_rolled_up(&db.pool, JobId(seeded.parent))
            .await
            .unwrap()
    );
    assert!(
        !jobs_delete_rolled_up(&db.pool, JobId(i64::MAX))
            .await
            .unwrap()
    );
    assert_eq!(
        state_if_any(&db.pool, seeded.parent).await,
        Some(JobState::Queued)
    );
}

#[tokio::test]
async fn retention_folds_old_hours_into_lifetime_totals() {
    let db = test_db().await;
    sqlx::query(
        "INSERT INTO skiplock.job_history (bucket, queue, kind, succeeded, failed, dead,
                                           run_count, run_seconds, run_histogram)
         SELECT date_trunc('hour', now() - make_interval(days => d), 'UTC'), 'default', 'old',
                10, 1, 1, 10, 5.0, '{0,0,0,0,0,0,0,10}'::bigint[]
         FROM unnest(ARRAY[400, 500, 2]) d",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let totals = job_history_totals(&db.pool).await.unwrap();
    let year_ms = 365 * 24 * 3600 * 1000;
    assert_eq!(
        job_history_prune_expired(&db.pool, year_ms).await.unwrap(),
        2
    );
    assert_eq!(
        job_history_prune_expired(&db.pool, year_ms).await.unwrap(),
        0
    );
    assert_eq!(
        job_history_totals(&db.pool).await.unwrap(),
        totals,
        "totals kept"
    );
    assert_eq!(totals[0].succeeded, 30);
    let rows: Vec<(f64, i64)> = sqlx::query_as(
        "SELECT extract(epoch FROM now() - bucket)::float8, succeeded FROM skiplock.job_history
         WHERE bucket <> '-infinity'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 1, "only the recent hour keeps its detail");
    assert_eq!(
        count(
            &db.pool,
            "SELECT succeeded FROM skiplock.job_history WHERE bucket = '-infinity'"
        )
        .await,
        20
    );
}

#[tokio::test]
async fn concurrent_pruners_count_every_job_exactly_once() {
    let db = test_db().await;
    sqlx::query(
        "INSERT INTO skiplock.jobs (queue, kind, state, attempt, claimed_at, scheduled_at,
                                    finished_at)
         SELECT CASE WHEN i % 2 = 0 THEN 'a' ELSE 'b' END, 'k', 'succeeded', 1,
                now() - interval '2 seconds', now() - interval '3 seconds', now()
         FROM generate_series(1, 2000) i",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let pruners: Vec<_> = (0..4)
        .map(|_| {
            let pool = db.pool.clone();
            tokio::spawn(async move {
                let mut pruned = 0;
                loop {
                    let n = jobs_prune_finished_rolled_up(&pool, 0, 0, 0, 100)
                        .await
                        .unwrap();
                    pruned += n;
                    if n == 0 {
                        return pruned;
                    }
                }
            })
        })
        .collect();
    let mut pruned = 0;
    for pruner in pruners {
        pruned += pruner.await.unwrap();
    }
    assert_eq!(pruned, 2000);
    assert_eq!(
        count(
            &db.pool,
            "SELECT sum(succeeded)::bigint FROM skiplock.job_history"
        )
        .await,
        2000
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM skiplock.jobs").await,
        0
    );
}
