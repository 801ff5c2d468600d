//! skiplock on a database whose owner set defaults of their own, as DBAs and managed
//! platforms do: `ALTER DATABASE … SET` a serializable default isolation, or tight
//! statement, lock and idle-in-transaction timeouts. The worker must pin what its
//! correctness needs on its own sessions and work within the timeouts.

mod common;
#[allow(dead_code)] // the defect rule is for the model tests
#[path = "model_support/logs.rs"]
mod logs;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use skiplock::{EnqueueOptions, Job, JobContext, JobError, NewJob, Worker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

use common::{TestDb, test_db};

/// The log capture is one per process: the drains of this file run one at a time, so
/// that each reads only its own lines.
static ONE_DRAIN_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Counts its runs per job id.
#[derive(Serialize, Deserialize)]
struct Counted {}

type Runs = Arc<Mutex<HashMap<i64, u32>>>;

impl Job for Counted {
    const KIND: &'static str = "counted";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let runs = ctx.data::<Runs>().expect("runs map");
        *runs.lock().unwrap().entry(ctx.id().0).or_default() += 1;
        Ok(())
    }
}

/// Runs `ALTER DATABASE <db> SET <setting>` for each setting, as the database's owner
/// would. Only sessions opened afterwards see them.
async fn set_database_defaults(db: &TestDb, settings: &[&str]) {
    for setting in settings {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE {} SET {setting}",
            db.name
        )))
        .execute(&db.pool)
        .await
        .unwrap_or_else(|e| panic!("ALTER DATABASE … SET {setting}: {e}"));
    }
}

/// A pool of `max` connections opened after the database defaults were set, as an
/// application's pool would be.
fn fresh_pool(db: &TestDb, max: u32) -> PgPool {
    let options: PgConnectOptions = db.url().parse().expect("test database URL");
    PgPoolOptions::new()
        .max_connections(max)
        .connect_lazy_with(options)
}

/// What a plain new session of the test database (not skiplock's) says for `setting`.
async fn database_default(db: &TestDb, setting: &str) -> String {
    let options: PgConnectOptions = db.url().parse().expect("test database URL");
    let mut plain = options.connect().await.expect("a plain session");
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {setting}")))
        .fetch_one(&mut plain)
        .await
        .expect("SHOW")
}

/// Enqueues `jobs` `Counted` jobs; every `lane_every`-th (if any) goes into one of
/// `lanes` ordering keys.
async fn enqueue(pool: &PgPool, jobs: usize, lanes: Option<(usize, usize)>) -> Vec<i64> {
    let batch: Vec<NewJob> = (0..jobs)
        .map(|n| {
            let mut options = EnqueueOptions::new();
            if let Some((every, lanes)) = lanes
                && n % every == 0
            {
                options = options.ordering_key(format!("lane-{}", n % lanes));
            }
            NewJob::from_job(&Counted {}, options).expect("job")
        })
        .collect();
    let mut ids = Vec::with_capacity(jobs);
    for chunk in batch.chunks(1000) {
        ids.extend(
            skiplock::enqueue_raw(pool, chunk)
                .await
                .expect("enqueue")
                .into_iter()
                .map(|job| job.id.0),
        );
    }
    ids
}

/// Drains the queue with `workers` workers, each on its own pool, concurrently, beating
/// every `heartbeat`; panics on any worker error, failed or lost job.
async fn drain(db: &TestDb, workers: usize, heartbeat: Duration, runs: &Runs) -> Vec<PgPool> {
    let pools: Vec<PgPool> = (0..workers).map(|_| fresh_pool(db, 10)).collect();
    let running: Vec<_> = pools
        .iter()
        .map(|pool| {
            let worker = Worker::builder(pool.clone())
                .register::<Counted>()
                .concurrency(8)
                .heartbeat(heartbeat, Duration::from_secs(30))
                .poll_interval(Duration::from_millis(100))
                .data(runs.clone())
                .exit_when_idle(true)
                .build()
                .expect("build the worker");
            tokio::spawn(worker.run())
        })
        .collect();
    for worker in running {
        let summary = worker.await.unwrap().expect("the worker runs");
        assert_eq!(
            summary.failed + summary.lost + summary.released,
            0,
            "{summary:?}"
        );
    }
    pools
}

/// Every job in `ids` ran exactly once and succeeded.
async fn assert_each_ran_once(db: &TestDb, ids: &[i64], runs: &Runs) {
    let runs = runs.lock().unwrap().clone();
    let not_once: Vec<(i64, String, Option<String>)> = sqlx::query_as(
        "SELECT id, state::text, ordering_key FROM skiplock.jobs \
         WHERE id = ANY($1) AND state <> 'succeeded' ORDER BY id LIMIT 20",
    )
    .bind(ids)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(not_once.is_empty(), "jobs left unfinished: {not_once:?}");
    for id in ids {
        assert_eq!(
            runs.get(id),
            Some(&1),
            "job {id} ran {:?} times",
            runs.get(id)
        );
    }
    assert_eq!(runs.len(), ids.len());
    let succeeded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state = 'succeeded'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(succeeded as usize, ids.len());
}

/// `ALTER DATABASE … SET default_transaction_isolation = 'serializable'`: without pinned
/// sessions, two workers' claims, outcome writes and heartbeats fail with serialization
/// failures (and the pool's sessions say `serializable`). The worker's sessions must run
/// READ COMMITTED, and the drain must log no failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_serializable_database_default_does_not_reach_the_workers_sessions() {
    let _alone = ONE_DRAIN_AT_A_TIME.lock().await;
    logs::install();
    let db = test_db().await;
    set_database_defaults(&db, &["default_transaction_isolation = 'serializable'"]).await;
    assert_eq!(
        database_default(&db, "transaction_isolation").await,
        "serializable",
        "the database default took effect"
    );
    let ids = enqueue(&db.pool, 3000, None).await;
    let _ = logs::take();

    let runs: Runs = Arc::default();
    // Beats run all through the drain.
    let pools = drain(&db, 2, Duration::from_millis(50), &runs).await;

    assert_each_ran_once(&db, &ids, &runs).await;
    let warnings = logs::take();
    assert!(warnings.is_empty(), "the drain logged: {warnings:#?}");
    for pool in &pools {
        let isolation: String = sqlx::query_scalar("SHOW transaction_isolation")
            .fetch_one(pool)
            .await
            .unwrap();
        assert_eq!(isolation, "read committed", "a worker pool's session");
    }
}

/// What already holds, kept: tight timeouts set by the database's owner
/// (`statement_timeout = 200ms`, `lock_timeout = 50ms`,
/// `idle_in_transaction_session_timeout = 2s`) stop none of the worker's statements for
/// good: a drain with a quarter of its jobs in 40 lanes runs every job once, and no
/// statement fails for another reason or loses its session.
///
/// What it may log: on a loaded machine one of skiplock's statements (a claim, a
/// completion batch, a heartbeat, the dependency sweep) can run longer than 200 ms, or wait
/// more than 50 ms for a row lock another of its statements holds; `statement_timeout` or
/// `lock_timeout` cancels it and it is retried, with a line that says both. skiplock does
/// not lift the owner's timeouts for its short statements (docs/operating.md, "Production
/// Postgres"). How many such lines a drain logs depends on the machine's load, so the
/// verdict is what each line says, not how many there are.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drain_works_within_tight_database_timeouts() {
    let _alone = ONE_DRAIN_AT_A_TIME.lock().await;
    logs::install();
    let db = test_db().await;
    // Enqueued first: a batch of 1,000 jobs is the application's statement, not the
    // worker's, and may take longer than 200 ms on a loaded machine.
    let ids = enqueue(&db.pool, 3000, Some((4, 40))).await;
    set_database_defaults(
        &db,
        &[
            "statement_timeout = '200ms'",
            "lock_timeout = '50ms'",
            "idle_in_transaction_session_timeout = '2s'",
        ],
    )
    .await;
    assert_eq!(database_default(&db, "lock_timeout").await, "50ms");
    let _ = logs::take();

    let runs: Runs = Arc::default();
    drain(
        &db,
        2,
        skiplock::WorkerConfig::default().heartbeat_interval,
        &runs,
    )
    .await;

    assert_each_ran_once(&db, &ids, &runs).await;
    let unexplained: Vec<String> = logs::take()
        .into_iter()
        .filter(|line| !is_a_retried_timeout(line))
        .collect();
    assert!(unexplained.is_empty(), "the drain logged: {unexplained:#?}");
}

/// Whether `line` says that one of the owner's timeouts cancelled a statement and that the
/// statement will run again: Postgres's message for the cancel, and the worker's word for
/// the retry ("retrying", "will retry", a follow-up left to the dependency sweep, the idle
/// check that assumes work remains).
fn is_a_retried_timeout(line: &str) -> bool {
    let timed_out = line.contains("canceling statement due to statement timeout")
        || line.contains("canceling statement due to lock timeout");
    let retried = [
        "; retrying",
        "; will retry",
        "; the dependency sweep will",
        "assuming work remains",
    ]
    .iter()
    .any(|retry| line.contains(retry));
    timed_out && retried
}

/// The server's `statement_timeout` in [`a_migration_sets_its_own_statement_bound`]: far
/// more than the migration's first statements take on a loaded machine (they run under it,
/// before the migration sets its own bound), and short enough for the test to outlast.
const SERVER_STATEMENT_TIMEOUT_SECS: u64 = 5;

/// A migration runs longer than a `statement_timeout` set for short queries: it sets its
/// own bound for its transaction and completes. Here the migration's statement that
/// creates the schema is made to run past the server's bound whatever the machine's speed:
/// a transaction of the test's has created the schema and not committed, so the
/// migration's `CREATE SCHEMA` waits for it, and the test ends that transaction only once
/// the wait has lasted longer than the server's bound. Under the server's bound the
/// statement would have been cancelled by then. (The migration's first statement, the one
/// that sets the bound, runs under the server's: at 1 ms, then 25 ms, a loaded machine
/// took longer than that for it, which said nothing about the migration, issues 38 and
/// 47.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_sets_its_own_statement_bound() {
    let db = test_db().await;
    sqlx::raw_sql("DROP SCHEMA skiplock CASCADE")
        .execute(&db.pool)
        .await
        .unwrap();
    // Opened before the database default is set: the test's own sessions have no bound.
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::raw_sql("CREATE SCHEMA skiplock")
        .execute(&mut *holder)
        .await
        .unwrap();
    let bound = format!("statement_timeout = '{SERVER_STATEMENT_TIMEOUT_SECS}s'");
    set_database_defaults(&db, &[bound.as_str()]).await;
    let pool = fresh_pool(&db, 2);
    let migration = tokio::spawn({
        let pool = pool.clone();
        async move { skiplock::migrate(&pool).await }
    });
    // Until the migration's wait for the schema has outlasted the server's bound (or the
    // migration ended: cancelled by that bound, it fails below).
    common::fixtures::wait_for(
        "the migration to wait for the schema longer than the server's statement_timeout",
        Duration::from_secs(60),
        || async {
            migration.is_finished()
                || sqlx::query_scalar::<_, bool>(
                    "SELECT EXISTS (
                         SELECT 1 FROM pg_stat_activity
                         WHERE datname = current_database() AND pid <> pg_backend_pid()
                           AND wait_event_type = 'Lock' AND state = 'active'
                           AND clock_timestamp() - query_start > $1 * interval '1 second')",
                )
                .bind(SERVER_STATEMENT_TIMEOUT_SECS as f64 + 1.0)
                .fetch_one(&db.pool)
                .await
                .unwrap()
        },
    )
    .await;
    holder.rollback().await.unwrap();
    migration
        .await
        .unwrap()
        .expect("migrate past the server's statement_timeout");
    let version: i32 = sqlx::query_scalar("SELECT max(version) FROM skiplock.schema_migrations")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(version > 0);
}

/// When the server's `statement_timeout` stops a statement, skiplock's message names the
/// setting and what to do.
#[tokio::test]
async fn a_statement_timeout_is_named_in_the_message() {
    let db = test_db().await;
    set_database_defaults(&db, &["statement_timeout = '1ms'"]).await;
    let pool = fresh_pool(&db, 1);
    let error = skiplock::Error::from(
        sqlx::query("SELECT pg_sleep(1)")
            .execute(&pool)
            .await
            .expect_err("stopped by statement_timeout"),
    );
    let message = error.to_string();
    assert!(
        message.contains("statement_timeout") && message.contains("ALTER ROLE"),
        "{message}"
    );
}
