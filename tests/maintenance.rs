//! Maintenance: the pruner's retention, the listener's reconnection, the SQL backoff.

mod common;

use std::time::Duration;

use common::fixtures::{Record, Recorder, count_in_state, fast_worker, state_of, wait_for};
use common::test_db;
use skiplock::{EnqueueOptions, JobState, Retention};
use sqlx::PgPool;

async fn listening_backends(pool: &PgPool) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity
         WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn the_pruner_deletes_finished_jobs_past_their_retention_only() {
    let db = test_db().await;
    let pool = &db.pool;
    let ids = skiplock::enqueue_many(pool, &vec![Record { n: 0 }; 5], EnqueueOptions::default())
        .await
        .unwrap();
    // Two succeeded long ago, one recently; one dead long ago; one still queued.
    sqlx::query(
        "UPDATE skiplock.jobs SET state = 'succeeded', finished_at = now() - interval '2 days'
         WHERE id = ANY($1)",
    )
    .bind(vec![ids[0].id.0, ids[1].id.0])
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("UPDATE skiplock.jobs SET state = 'succeeded', finished_at = now() WHERE id = $1")
        .bind(ids[2].id.0)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE skiplock.jobs SET state = 'dead', finished_at = now() - interval '2 days'
         WHERE id = $1",
    )
    .bind(ids[3].id.0)
    .execute(pool)
    .await
    .unwrap();

    let worker = fast_worker(pool, &Recorder::default())
        .queues(["elsewhere"])
        .retention(Retention {
            succeeded: Duration::from_secs(24 * 3600),
            cancelled: Duration::from_secs(24 * 3600),
            dead: Duration::from_secs(14 * 24 * 3600),
        })
        .prune_interval(Some(Duration::from_millis(50)))
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for(
        "old succeeded jobs to go",
        Duration::from_secs(10),
        || async { count_in_state(pool, JobState::Succeeded).await == 1 },
    )
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM skiplock.jobs ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(
        left,
        vec![ids[2].id.0, ids[3].id.0, ids[4].id.0],
        "recent, dead-within-14-days and queued stay"
    );
}

#[tokio::test]
async fn zero_retention_deletes_at_the_next_pass() {
    let db = test_db().await;
    let pool = &db.pool;
    skiplock::enqueue_many(pool, &vec![Record { n: 0 }; 20], EnqueueOptions::default())
        .await
        .unwrap();
    let worker = fast_worker(pool, &Recorder::default())
        .retention(Retention {
            succeeded: Duration::ZERO,
            cancelled: Duration::ZERO,
            dead: Duration::ZERO,
        })
        .prune_interval(Some(Duration::from_millis(50)))
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for(
        "every job to run and be pruned",
        Duration::from_secs(10),
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM skiplock.jobs")
                .fetch_one(pool)
                .await
                .unwrap()
                == 0
        },
    )
    .await;
    stop.shutdown();
    let summary = run.await.unwrap().unwrap();
    assert_eq!(summary.succeeded, 20);
    // Pruning kept their history.
    let rolled_up: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(succeeded), 0)::bigint FROM skiplock.job_history")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(rolled_up, 20);
}

#[tokio::test]
async fn a_killed_listener_reconnects_and_catches_up() {
    let db = test_db().await;
    let pool = &db.pool;
    let recorder = Recorder::default();
    // Polling once an hour: only notifications and the reconnect catch-up bring jobs in.
    let worker = fast_worker(pool, &recorder)
        .poll_interval(Duration::from_secs(3600))
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the worker to LISTEN", Duration::from_secs(10), || async {
        listening_backends(pool).await.len() == 1
    })
    .await;
    let old = listening_backends(pool).await[0];

    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(old)
        .execute(pool)
        .await
        .unwrap();
    // Inserted while the listener is down (or reconnecting): its notification may be lost.
    let during = skiplock::enqueue(pool, &Record { n: 1 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    wait_for(
        "the job inserted during the outage",
        Duration::from_secs(20),
        || async { state_of(pool, during.0).await == JobState::Succeeded },
    )
    .await;
    wait_for(
        "a new LISTEN connection",
        Duration::from_secs(20),
        || async { listening_backends(pool).await.iter().any(|pid| *pid != old) },
    )
    .await;
    // And notifications work again.
    let after = skiplock::enqueue(pool, &Record { n: 2 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    wait_for(
        "the job inserted after the reconnect",
        Duration::from_secs(20),
        || async { state_of(pool, after.0).await == JobState::Succeeded },
    )
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
}

#[tokio::test]
async fn the_sql_backoff_matches_the_documented_formula() {
    let db = test_db().await;
    for attempt in [1, 2, 5, 11, 12, 40] {
        let seconds: Vec<f64> = sqlx::query_scalar(
            "SELECT extract(epoch FROM skiplock.backoff($1))::float8 FROM generate_series(1, 200)",
        )
        .bind(attempt)
        .fetch_all(&db.pool)
        .await
        .unwrap();
        let base = skiplock::backoff::base_delay(attempt).as_secs_f64();
        for s in seconds {
            assert!(
                s >= base * 0.75 && s < base * 1.25,
                "attempt {attempt}: {s} s vs base {base} s"
            );
        }
    }
}
