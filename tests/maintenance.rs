//! Maintenance: the pruner's retention, the listener's reconnection, the SQL backoff.

mod common;

use std::time::Duration;

use common::fixtures::{
    Captured, Record, Recorder, count_in_state, fast_worker, sql_claim_one, state_of, wait_for,
    wait_for_a_lock_wait,
};
use common::test_db;
use skiplock::{EnqueueOptions, JobState, Retention};
use sqlx::postgres::PgListener;
use sqlx::{Connection, PgConnection, PgPool};

/// Longest wait for a worker to settle what the database holds.
const PATIENCE: Duration = Duration::from_secs(60);

/// The sessions of this test's database whose LISTEN has completed (while it runs, the
/// session shows it as its query already, and a notification sent then is lost).
async fn listening_backends(pool: &PgPool) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity
         WHERE datname = current_database() AND query ILIKE 'LISTEN%' AND state = 'idle'",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A worker saves a parent's success, then, in a second transaction, queues its waiting
/// child. The periodic sweep of waiting jobs, beside it, sees the parent succeeded and the
/// child still waiting: its UPDATE waits for the child's row, finds it queued once the
/// move-on commits and leaves it, but Postgres keeps the row locked by the sweep until the
/// sweep commits. Claims pass over a locked row, and the move-on's announcement has come
/// meanwhile: a worker that walked back to the child then found nothing, and the child
/// waited for a walk from the start of its queue (up to a minute; a flaky timeout in
/// tests/claim_cursor.rs). The sweep now announces such a job again, at its own commit.
#[tokio::test]
async fn a_sweep_that_waited_on_a_child_queued_meanwhile_announces_it_at_commit() {
    let db = test_db().await;
    let pool = &db.pool;
    let parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop')")
        .fetch_one(pool)
        .await
        .unwrap();
    let child: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop', depends_on => $1)")
        .bind(vec![parent])
        .fetch_one(pool)
        .await
        .unwrap();
    let (_, token) = sql_claim_one(pool, "default", "w").await;
    // The worker's first transaction: the parent's success.
    sqlx::query("SELECT * FROM skiplock.internal_complete_claims($1, $2)")
        .bind(vec![parent])
        .bind(vec![token])
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(state_of(pool, child).await, JobState::Waiting);
    let child_payload: String = sqlx::query_scalar(
        "SELECT skiplock.internal_runnable_payload(queue, priority, scheduled_at)
         FROM skiplock.jobs WHERE id = $1",
    )
    .bind(child)
    .fetch_one(pool)
    .await
    .unwrap();
    let mut listener = PgListener::connect(db.url()).await.unwrap();
    listener.listen("skiplock_runnable").await.unwrap();

    // Its second: the child queued, its row held until commit.
    let mut move_on = PgConnection::connect(db.url()).await.unwrap();
    sqlx::query("BEGIN").execute(&mut move_on).await.unwrap();
    sqlx::query("SELECT skiplock.internal_move_on($1, '{}')")
        .bind(vec![parent])
        .execute(&mut move_on)
        .await
        .unwrap();

    // The sweep, in a transaction of its own, waits for the child's row.
    let mut sweep = PgConnection::connect(db.url()).await.unwrap();
    sqlx::query("BEGIN").execute(&mut sweep).await.unwrap();
    let sweeping = tokio::spawn(async move {
        sqlx::query("SELECT skiplock.internal_settle_waiting()")
            .execute(&mut sweep)
            .await
            .unwrap();
        sweep
    });
    wait_for_a_lock_wait(pool, "the sweep to wait for the child's row").await;
    sqlx::query("COMMIT").execute(&mut move_on).await.unwrap();
    let mut sweep = sweeping.await.unwrap();
    let free: Option<i64> = sqlx::query_scalar(
        "SELECT id FROM skiplock.jobs WHERE id = $1 AND state = 'queued' FOR UPDATE SKIP LOCKED",
    )
    .bind(child)
    .fetch_optional(pool)
    .await
    .unwrap();
    assert_eq!(
        free, None,
        "the sweep holds the queued child until it commits"
    );
    sqlx::query("COMMIT").execute(&mut sweep).await.unwrap();

    // The move-on's announcement, then the sweep's.
    let mut announced = 0;
    let heard = tokio::time::timeout(PATIENCE, async {
        while announced < 2 {
            if listener.recv().await.unwrap().payload() == child_payload {
                announced += 1;
            }
        }
    })
    .await;
    assert!(
        heard.is_ok(),
        "the child was announced {announced} time(s), not by the move-on and the sweep"
    );
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
    wait_for("old succeeded jobs to go", PATIENCE, || async {
        count_in_state(pool, JobState::Succeeded).await == 1
    })
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
    // Claims that never go stale: a live job taken back and run twice would count twice.
    let worker = fast_worker(pool, &Recorder::default())
        .heartbeat(Duration::from_millis(100), Duration::from_secs(3600))
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
    wait_for("every job to run and be pruned", PATIENCE, || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM skiplock.jobs")
            .fetch_one(pool)
            .await
            .unwrap()
            == 0
    })
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
    wait_for("the worker to LISTEN", PATIENCE, || async {
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
    wait_for("the job inserted during the outage", PATIENCE, || async {
        state_of(pool, during.0).await == JobState::Succeeded
    })
    .await;
    wait_for("a new LISTEN connection", PATIENCE, || async {
        listening_backends(pool).await.iter().any(|pid| *pid != old)
    })
    .await;
    // And notifications work again.
    let after = skiplock::enqueue(pool, &Record { n: 2 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    wait_for("the job inserted after the reconnect", PATIENCE, || async {
        state_of(pool, after.0).await == JobState::Succeeded
    })
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

/// The UTC day `days_ago` days before today, as `skiplock.internal_prepare_done_partitions`
/// takes it, and noon of it.
const UTC_DAY: &str = "((now() AT TIME ZONE 'UTC')::date - $1::int)";

async fn prepare_days_ago(pool: &PgPool, from_days_ago: i32, days: i32) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT skiplock.internal_prepare_done_partitions({UTC_DAY}, $2)"
    )))
    .bind(from_days_ago)
    .bind(days)
    .execute(pool)
    .await
    .unwrap();
}

/// `count` jobs finished in `state` at noon (UTC) `days_ago` days ago; their ids.
async fn finished_days_ago(pool: &PgPool, state: &str, days_ago: i32, count: i64) -> Vec<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "INSERT INTO skiplock.jobs (kind, state, attempt, claimed_at, finished_at)
         SELECT 'noop', $2::skiplock.job_state, 1, f - interval '1 second', f
         FROM (SELECT ({UTC_DAY}::timestamp + interval '12 hours') AT TIME ZONE 'UTC' AS f) t,
              generate_series(1, $3)
         RETURNING id"
    )))
    .bind(days_ago)
    .bind(state)
    .bind(count)
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn table_exists(pool: &PgPool, name: &str) -> bool {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn day_partition(pool: &PgPool, state: &str, days_ago: i32) -> String {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT 'skiplock.jobs_done_' || $2 || '_' || to_char({UTC_DAY}, 'YYYYMMDD')"
    )))
    .bind(days_ago)
    .bind(state)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Retries the finished job `id` by hand (`skiplock.retry_job`, which must take it) and
/// returns the state it is in after.
async fn retried_state(pool: &PgPool, id: i64) -> JobState {
    let retried: bool = sqlx::query_scalar("SELECT skiplock.retry_job($1)")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(retried, "retry_job took job {id}");
    state_of(pool, id).await
}

/// A pass of the pruner under the default retention, in a task of its own.
fn spawn_prune(pool: &PgPool) -> tokio::task::JoinHandle<skiplock::admin::Pruned> {
    let pool = pool.clone();
    tokio::spawn(async move {
        skiplock::admin::prune(&pool, Retention::default())
            .await
            .unwrap()
    })
}

async fn history_succeeded(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT coalesce(sum(succeeded), 0)::bigint FROM skiplock.job_history")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Under a retention of a day or more, a day of finished jobs all past it goes whole: its
/// partition is dropped (no row deleted), its jobs are in the history, what other jobs knew
/// of them is settled (a cancelled parent leaves a tombstone, so its retried child is
/// cancelled again; a dropped child's edge goes), and what no day holds is deleted.
#[tokio::test]
async fn retention_drops_whole_days_and_keeps_their_history() {
    let db = test_db().await;
    let pool = &db.pool;
    prepare_days_ago(pool, 5, 5).await;
    // A cancelled parent and its child, and a child whose dead parent is kept (14 days):
    // written live with their edges, then finished by hand.
    let parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop')")
        .fetch_one(pool)
        .await
        .unwrap();
    let child: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop', depends_on => ARRAY[$1])")
        .bind(parent)
        .fetch_one(pool)
        .await
        .unwrap();
    let dead_parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop')")
        .fetch_one(pool)
        .await
        .unwrap();
    let old_child: i64 =
        sqlx::query_scalar("SELECT skiplock.enqueue('noop', depends_on => ARRAY[$1])")
            .bind(dead_parent)
            .fetch_one(pool)
            .await
            .unwrap();
    sqlx::query(
        "UPDATE skiplock.jobs SET state = s.state::skiplock.job_state, finished_at = s.at
         FROM (VALUES ($1::bigint, 'cancelled', now() - interval '4 days'),
                      ($2, 'cancelled', now()),
                      ($3, 'dead', now() - interval '4 days'),
                      ($4, 'succeeded', now() - interval '4 days')) AS s(id, state, at)
         WHERE jobs.id = s.id",
    )
    .bind(parent)
    .bind(child)
    .bind(dead_parent)
    .bind(old_child)
    .execute(pool)
    .await
    .unwrap();
    let old = finished_days_ago(pool, "succeeded", 4, 500).await;
    let recent = finished_days_ago(pool, "succeeded", 0, 3).await;
    let yesterday = finished_days_ago(pool, "succeeded", 1, 3).await;
    // Outside every day partition: ten days ago, before the first prepared day.
    let stray = finished_days_ago(pool, "succeeded", 10, 2).await;
    let old_day = day_partition(pool, "succeeded", 4).await;
    assert!(table_exists(pool, &old_day).await);

    let pruned = skiplock::admin::prune(pool, Retention::default())
        .await
        .unwrap();

    // Days 5..2 ago of succeeded and cancelled jobs: 8 partitions; 501 succeeded jobs
    // and the cancelled parent in them, 2 rows deleted from jobs_done_default.
    assert_eq!((pruned.days, pruned.days_left), (8, 0), "{pruned:?}");
    assert_eq!(pruned.jobs, 500 + 1 + 1 + 2, "{pruned:?}");
    assert!(
        !table_exists(pool, &old_day).await,
        "the old day is dropped"
    );
    assert!(
        table_exists(pool, &day_partition(pool, "dead", 4).await).await,
        "dead jobs are kept 14 days"
    );
    let left = |ids: Vec<i64>| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM skiplock.jobs WHERE id = ANY($1)")
            .bind(ids)
            .fetch_one(pool)
            .await
            .unwrap()
    };
    assert_eq!(left(old.clone()).await, 0);
    assert_eq!(left(stray).await, 0);
    assert_eq!(left(recent).await, 3, "today stays");
    assert_eq!(left(yesterday).await, 3, "yesterday stays");
    assert_eq!(left(vec![child, dead_parent]).await, 2);
    assert_eq!(
        history_succeeded(pool).await,
        503,
        "every removed job is in the history"
    );
    // The dropped child's edge went with it; the dropped parent left a tombstone.
    let edges: Vec<(i64, i64, Option<String>)> = sqlx::query_as(
        "SELECT job_id, parent_id, parent_state::text FROM skiplock.job_dependencies ORDER BY job_id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(edges, vec![(child, parent, Some("cancelled".to_owned()))]);
    assert_eq!(retried_state(pool, child).await, JobState::Cancelled);

    // Nothing more is due: a second pass drops and deletes nothing.
    let again = skiplock::admin::prune(pool, Retention::default())
        .await
        .unwrap();
    assert_eq!((again.jobs, again.days), (0, 0), "{again:?}");
}

/// A day whose drop cannot get its lock within 100 ms (a transaction reads it) is left
/// for a later pass, with nothing rolled up: the later pass counts its jobs once.
#[tokio::test]
async fn a_busy_day_is_dropped_at_a_later_pass_and_counted_once() {
    let db = test_db().await;
    let pool = &db.pool;
    prepare_days_ago(pool, 3, 1).await;
    finished_days_ago(pool, "succeeded", 3, 20).await;
    let old_day = day_partition(pool, "succeeded", 3).await;
    let mut reader = pool.begin().await.unwrap();
    let read: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {old_day}"
    )))
    .fetch_one(&mut *reader)
    .await
    .unwrap();
    assert_eq!(read, 20);

    let busy = skiplock::admin::prune(pool, Retention::default())
        .await
        .unwrap();
    // The day's cancelled partition (empty, not read) goes; the succeeded one stays.
    assert_eq!(
        (busy.jobs, busy.days, busy.days_left),
        (0, 1, 1),
        "{busy:?}"
    );
    assert!(table_exists(pool, &old_day).await);
    assert_eq!(
        history_succeeded(pool).await,
        0,
        "nothing rolled up for a day kept"
    );

    reader.rollback().await.unwrap();
    let pruned = skiplock::admin::prune(pool, Retention::default())
        .await
        .unwrap();
    assert_eq!(
        (pruned.jobs, pruned.days, pruned.days_left),
        (20, 1, 0),
        "{pruned:?}"
    );
    assert!(!table_exists(pool, &old_day).await);
    assert_eq!(history_succeeded(pool).await, 20);
}

/// Days are made ahead by `skiplock.maintain` too (deployments with SQL workers only), and
/// a day whose jobs already sit in `jobs_done_default` is made all the same, its jobs moved
/// into it with their dependency edges: a day made late (nobody made it in time) and a day
/// ahead that holds a `finished_at` written by hand. Both stayed in the default before, and
/// so did every job that finished on such a day afterwards (a whole day pruned row by row).
#[tokio::test]
async fn days_are_made_ahead_and_a_late_day_takes_its_jobs_from_the_default_partition() {
    let db = test_db().await;
    let pool = &db.pool;
    let tomorrow = day_partition(pool, "succeeded", -1).await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {tomorrow}")))
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("SELECT * FROM skiplock.maintain()")
        .execute(pool)
        .await
        .unwrap();
    assert!(
        table_exists(pool, &tomorrow).await,
        "maintain makes the days ahead"
    );

    // Two days ago was never made: its jobs went to jobs_done_default. One of them is a
    // child whose edge to its (succeeded) parent is still there.
    let late = finished_days_ago(pool, "succeeded", 2, 4).await;
    // Five days ahead, by hand.
    let ahead = finished_days_ago(pool, "succeeded", -5, 1).await;
    let parent = finished_days_ago(pool, "succeeded", 0, 1).await[0];
    sqlx::query("INSERT INTO skiplock.job_dependencies (job_id, parent_id) VALUES ($1, $2)")
        .bind(late[0])
        .bind(parent)
        .execute(pool)
        .await
        .unwrap();
    let where_they_are = async |ids: &[i64]| -> Vec<String> {
        sqlx::query_scalar(
            "SELECT DISTINCT tableoid::regclass::text FROM skiplock.jobs WHERE id = ANY($1)",
        )
        .bind(ids)
        .fetch_all(pool)
        .await
        .unwrap()
    };
    assert_eq!(where_they_are(&late).await, ["skiplock.jobs_done_default"]);
    assert_eq!(where_they_are(&ahead).await, ["skiplock.jobs_done_default"]);

    for days_ago in [2, -5] {
        let made: i32 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT skiplock.internal_prepare_done_partitions({UTC_DAY}, 1)"
        )))
        .bind(days_ago)
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(
            made, 3,
            "every state's table of the day {days_ago} days ago"
        );
    }
    let late_day = day_partition(pool, "succeeded", 2).await;
    assert_eq!(where_they_are(&late).await, std::slice::from_ref(&late_day));
    assert_eq!(
        where_they_are(&ahead).await,
        [day_partition(pool, "succeeded", -5).await]
    );
    let edges: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.job_dependencies WHERE job_id = $1 AND parent_id = $2",
    )
    .bind(late[0])
    .bind(parent)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(edges, 1, "the moved child keeps its edge");
    // The day is a day like the others: dropped whole once past retention.
    let pruned = skiplock::admin::prune(pool, Retention::default())
        .await
        .unwrap();
    // Its succeeded and (empty) cancelled tables; dead jobs are kept 14 days.
    assert_eq!((pruned.jobs, pruned.days), (4, 2), "{pruned:?}");
    assert!(!table_exists(pool, &late_day).await);
    assert_eq!(history_succeeded(pool).await, 4);
    assert_eq!(where_they_are(&ahead).await.len(), 1, "the day ahead stays");
}

/// The pruner's delete is never JIT-compiled: its plan's estimate follows the rows the
/// days kept hold, not the batch it deletes, and beside a large history it passed
/// `jit_above_cost` at every pass (1.2-2.9 s of CPU where it takes 0.03-0.05 s without).
/// Here the database compiles every plan that costs anything (`jit_above_cost = 0`, which
/// is what a large history does to that statement), auto_explain sends each plan to its
/// session as a NOTICE, and sqlx logs each notice (target `sqlx::postgres::notice`), which
/// the test captures. Another statement of the same pass is compiled: the capture works.
#[tokio::test]
async fn the_pruners_delete_is_never_jit_compiled() {
    let db = test_db().await;
    let jit: bool = sqlx::query_scalar("SELECT pg_jit_available()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        jit,
        "this Postgres cannot JIT-compile (no LLVM): install the server's JIT package"
    );
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, args, state, attempt, claimed_at, finished_at)
         SELECT 'record', '{\"n\": 0}', 'succeeded', 1, now() - interval '3 hours',
                now() - interval '2 hours'
         FROM generate_series(1, 10)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    for setting in [
        "session_preload_libraries = 'auto_explain'",
        "auto_explain.log_min_duration = 0",
        "auto_explain.log_level = 'notice'",
        "jit_above_cost = 0",
    ] {
        db.set_for_new_sessions(setting).await;
    }
    let explained = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .unwrap();
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_ansi(false)
        .with_env_filter("sqlx::postgres::notice=info")
        .finish();
    // The process's subscriber, not one scoped to this thread: beside the other tests of
    // this binary, tracing's per-callsite cache of interest let a scoped one miss every
    // notice now and then. The other tests' notices are captured too; only this test's
    // database explains its plans.
    tracing::subscriber::set_global_default(subscriber)
        .expect("no other test of this binary sets the process's subscriber");
    let hour = Duration::from_secs(3600);
    let pruned = skiplock::admin::prune(
        &explained,
        Retention {
            succeeded: hour,
            cancelled: hour,
            dead: hour,
        },
    )
    .await
    .unwrap();
    assert_eq!(pruned.jobs, 10);
    let log = captured.lines().join("\n");
    let plans: Vec<&str> = log.split("plan:").skip(1).collect();
    let delete: Vec<&&str> = plans
        .iter()
        .filter(|plan| plan.contains("WITH doomed AS"))
        .collect();
    assert_eq!(delete.len(), 1, "one plan of the delete in:\n{log}");
    assert!(
        !delete[0].contains("JIT:"),
        "the pruner's delete was JIT-compiled:\n{}",
        delete[0]
    );
    assert!(
        plans.iter().any(|plan| plan.contains("JIT:")),
        "no plan of the pass was JIT-compiled, so the capture proves nothing:\n{log}"
    );
}

/// Seconds from the start of the UTC day `days_ago` days before today to now, by the
/// database's clock, and today's UTC date.
async fn since_day_start(pool: &PgPool, days_ago: i32) -> (f64, chrono::NaiveDate) {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT extract(epoch FROM now() - {UTC_DAY}::timestamp AT TIME ZONE 'UTC')::float8,
                (now() AT TIME ZONE 'UTC')::date"
    )))
    .bind(days_ago)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn count_of(pool: &PgPool, ids: &[i64]) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE id = ANY($1)")
        .bind(ids)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Retention at its edges (issue 49, item 3; docs/operating.md, "Retention: whole days
/// dropped": a job stays at least its retention and at most a day longer). With the
/// retention a minute longer than the time since the end of the day two days ago, that
/// day stays whole (its rows are past retention, but not every row of its table could be
/// dropped by then); a minute shorter, its table of succeeded jobs goes, while its table of
/// dead jobs (kept 14 days) and yesterday stay. A `finished_at` written by hand before
/// every day kept is deleted as a row once past retention; one in a day ahead stays. Run
/// again once if a UTC midnight passes while it runs (the days it names would shift).
#[tokio::test]
async fn retention_holds_at_the_edges_of_a_day() {
    for _ in 0..2 {
        let db = test_db().await;
        let pool = &db.pool;
        prepare_days_ago(pool, 4, 5).await;
        let (to_end_of_two_days_ago, today) = since_day_start(pool, 1).await;
        let two_days_ago = finished_days_ago(pool, "succeeded", 2, 3).await;
        let dead_two_days_ago = finished_days_ago(pool, "dead", 2, 2).await;
        let yesterday = finished_days_ago(pool, "succeeded", 1, 3).await;
        let long_ago = finished_days_ago(pool, "succeeded", 10, 1).await;
        let ahead = finished_days_ago(pool, "succeeded", -3, 1).await;
        let succeeded_kept = |seconds: f64| Retention {
            succeeded: Duration::from_secs_f64(seconds),
            cancelled: Duration::from_secs_f64(seconds),
            dead: Duration::from_secs(14 * 24 * 3600),
        };

        // A minute longer than since the day ended: the day stays whole.
        let first = skiplock::admin::prune(pool, succeeded_kept(to_end_of_two_days_ago + 60.0))
            .await
            .unwrap();
        let after_first = (
            count_of(pool, &two_days_ago).await,
            count_of(pool, &long_ago).await,
            count_of(pool, &ahead).await,
        );
        // A minute shorter: its table of succeeded jobs goes, with all three.
        let second = skiplock::admin::prune(pool, succeeded_kept(to_end_of_two_days_ago - 60.0))
            .await
            .unwrap();
        if since_day_start(pool, 1).await.1 != today {
            continue;
        }
        assert_eq!(after_first, (3, 0, 1), "{first:?}");
        assert_eq!(
            first.jobs, 1,
            "the row from before every day kept: {first:?}"
        );
        assert_eq!(
            (second.jobs, second.days),
            (3, 2),
            "succeeded and cancelled tables of two days ago: {second:?}"
        );
        assert_eq!(count_of(pool, &two_days_ago).await, 0);
        assert_eq!(
            count_of(pool, &dead_two_days_ago).await,
            2,
            "dead jobs are kept 14 days"
        );
        assert_eq!(count_of(pool, &yesterday).await, 3, "yesterday stays");
        assert_eq!(count_of(pool, &ahead).await, 1, "a day ahead stays");
        assert!(table_exists(pool, &day_partition(pool, "dead", 2).await).await);
        assert!(!table_exists(pool, &day_partition(pool, "succeeded", 2).await).await);
        return;
    }
    panic!("two UTC midnights passed while the test ran");
}

/// Making a day never waits for the completions under way: the day's table is made on its
/// own and attached (SHARE UPDATE EXCLUSIVE on `skiplock.jobs_done`, which a completion's
/// ROW EXCLUSIVE does not conflict with), not made as a partition (ACCESS EXCLUSIVE on
/// `skiplock.jobs_done`, which waited for every open transaction that had finished a job,
/// and held up every completion behind it: 168 ms beside 500,000 rows in the default
/// partition, issue 49). Here a transaction that completed a job stays open while the
/// days ahead are made: all three tables of the day come, at once.
#[tokio::test]
async fn a_day_is_made_beside_an_open_transaction_that_finished_a_job() {
    let db = test_db().await;
    let pool = &db.pool;
    sqlx::query("SELECT skiplock.enqueue('noop')")
        .execute(pool)
        .await
        .unwrap();
    let (id, token) = sql_claim_one(pool, "default", "test").await;
    let mut open = pool.begin().await.unwrap();
    let completed = common::fixtures::sql_complete(&mut *open, id, token).await;
    assert!(completed);
    let made: i32 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT skiplock.internal_prepare_done_partitions({UTC_DAY}, 1)"
    )))
    .bind(-5)
    .fetch_one(pool)
    .await
    .unwrap();
    open.commit().await.unwrap();
    assert_eq!(
        made, 3,
        "the day's three tables, beside the open completion"
    );
    assert!(table_exists(pool, &day_partition(pool, "succeeded", -5).await).await);
}

/// The day's mark of the ids handed out (`skiplock.job_id_days`) written by a transaction
/// still open never fails another caller making the days: `skiplock.maintain` goes on
/// (before, its insert of the same mark waited for that transaction and failed at the 100 ms
/// lock timeout, taking the whole maintain call with it).
#[tokio::test]
async fn a_days_mark_written_by_an_open_transaction_never_fails_maintain() {
    let db = test_db().await;
    let pool = &db.pool;
    sqlx::query("DELETE FROM skiplock.job_id_days")
        .execute(pool)
        .await
        .unwrap();
    let mut open = pool.begin().await.unwrap();
    sqlx::query("SELECT skiplock.internal_prepare_done_partitions()")
        .execute(&mut *open)
        .await
        .unwrap();
    let maintained = sqlx::query("SELECT * FROM skiplock.maintain()")
        .execute(pool)
        .await;
    open.commit().await.unwrap();
    maintained.expect("maintain beside a day's mark being written");
    let marks: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.job_id_days")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(marks, 1, "today's mark, written once");
}

/// A day is never dropped while a transaction that read the finished jobs sits idle: the
/// drop's request for ACCESS EXCLUSIVE on `skiplock.jobs_done` would wait its 100 ms behind
/// that transaction at every pass, and every completion would queue behind the request (12
/// stalls in 20 s beside one idle reader, issue 49). The pruner leaves such a day without
/// asking for the lock: while it runs, no session ever waits for ACCESS EXCLUSIVE on
/// `skiplock.jobs_done` (watched the whole time; on the code before, the request waited
/// 100 ms). Once the reader ends, the day goes.
#[tokio::test]
async fn a_day_is_left_without_a_lock_request_while_a_reader_of_the_jobs_sits_idle() {
    let db = test_db().await;
    let pool = &db.pool;
    prepare_days_ago(pool, 3, 1).await;
    finished_days_ago(pool, "succeeded", 3, 20).await;
    let mut reader = pool.begin().await.unwrap();
    let read: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs")
        .fetch_one(&mut *reader)
        .await
        .unwrap();
    assert_eq!(read, 20);

    let prune = spawn_prune(pool);
    // Watched from a session of its own: the reader stays idle in its transaction.
    let mut watcher = pool.acquire().await.unwrap();
    let mut requests_seen = 0;
    while !prune.is_finished() {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks
             WHERE NOT granted AND mode = 'AccessExclusiveLock'
               AND relation = 'skiplock.jobs_done'::regclass
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(&mut *watcher)
        .await
        .unwrap();
        requests_seen += waiting;
    }
    let busy = prune.await.unwrap();
    assert_eq!(
        requests_seen, 0,
        "the drop asked for the lock behind the idle reader"
    );
    assert_eq!((busy.days, busy.days_left), (0, 2), "{busy:?}");

    reader.rollback().await.unwrap();
    let pruned = skiplock::admin::prune(pool, Retention::default())
        .await
        .unwrap();
    assert_eq!(
        (pruned.jobs, pruned.days, pruned.days_left),
        (20, 2, 0),
        "{pruned:?}"
    );
}

/// A child enqueued on a cancelled parent while the parent's day is being dropped: the
/// child starts cancelled, and its edge must leave a tombstone when the parent's row goes,
/// or `retry_job` of the child finds the edge satisfied (a parent pruned after it
/// succeeded) and runs it. The enqueue's edge trigger reads the parent `FOR SHARE`; the
/// day's lock used to let that through (SHARE ROW EXCLUSIVE), so the drop could read the
/// edges before the enqueue committed and drop the day after (issue 49). Each round keeps
/// the enqueue's transaction busy (waiting for a lock the test holds, so the pruner does
/// not leave the day for an idle reader) until the pruner waits for it, then lets it
/// commit: the day is dropped in that pass (the round is tried again when the pruner gave
/// up first) and the child stays cancelled when retried.
#[tokio::test]
async fn a_child_enqueued_while_its_parents_day_is_dropped_is_never_run() {
    const HOLD: i64 = 4_049_001;
    let db = test_db().await;
    let pool = &db.pool;
    for round in 1..=5 {
        prepare_days_ago(pool, 3, 1).await;
        let parent = finished_days_ago(pool, "cancelled", 3, 1).await[0];
        let parents_day = day_partition(pool, "cancelled", 3).await;
        let mut holder = pool.begin().await.unwrap();
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(HOLD)
            .execute(&mut *holder)
            .await
            .unwrap();
        let (enqueued, child) = tokio::sync::oneshot::channel();
        let enqueue = tokio::spawn({
            let pool = pool.clone();
            async move {
                let mut tx = pool.begin().await.unwrap();
                let child: i64 =
                    sqlx::query_scalar("SELECT skiplock.enqueue('noop', depends_on => ARRAY[$1])")
                        .bind(parent)
                        .fetch_one(&mut *tx)
                        .await
                        .unwrap();
                enqueued.send(child).unwrap();
                sqlx::query("SELECT pg_advisory_xact_lock_shared($1)")
                    .bind(HOLD)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            }
        });
        let child = child.await.unwrap();
        wait_for_a_lock_wait(pool, "the enqueue to wait for the test").await;
        let prune = spawn_prune(pool);
        wait_for("the pruner to wait for the enqueue", PATIENCE, || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
                                WHERE NOT l.granted AND c.relname LIKE 'jobs_done%'
                                  AND l.database = (SELECT oid FROM pg_database
                                                    WHERE datname = current_database()))",
            )
            .fetch_one(pool)
            .await
            .unwrap()
        })
        .await;
        holder.rollback().await.unwrap();
        enqueue.await.unwrap();
        prune.await.unwrap();
        if table_exists(pool, &parents_day).await {
            // The pruner's 100 ms ran out before the commit: the day is kept, as it must.
            assert!(
                round < 5,
                "the pruner never waited through the enqueue's commit"
            );
            continue;
        }
        let edge: Option<String> = sqlx::query_scalar(
            "SELECT parent_state::text FROM skiplock.job_dependencies
             WHERE job_id = $1 AND parent_id = $2",
        )
        .bind(child)
        .bind(parent)
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(edge.as_deref(), Some("cancelled"), "the parent's tombstone");
        assert_eq!(retried_state(pool, child).await, JobState::Cancelled);
        return;
    }
}
