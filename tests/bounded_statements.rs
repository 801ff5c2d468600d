//! The follow-up statements (a lane step, a dependency settle, the sweep of waiting jobs)
//! cost what their work costs, whatever the planner's statistics say.
//!
//! Each test takes statistics at a moment a real table is often caught in (empty, or
//! dominated by finished jobs), keeps them (autovacuum off on the test's tables), then
//! measures one step in the buffers it touches (the statements the SQL functions run
//! included) twice: beside a few waiting jobs, and beside 33 times more. A step whose plan
//! walks the waiting jobs reads more the second time; a bounded one reads the same.
//! Buffers of skiplock's own relations, not time: the count does not depend on the
//! machine's speed or load, nor on the catalog reads of planning (see `buffers_of`).
//!
//! Every step is measured on one session that has already run a step of the same kind, so
//! that both measures see the same plans.

mod common;

use common::fixtures::{sql_claim, sql_claim_one};
use common::{TestDb, test_db};
use sqlx::{PgConnection, PgPool};

/// Waiting jobs beside the measured step, then 33 times more.
const FEW_WAITING: i64 = 300;
const MANY_WAITING: i64 = 10_000;

/// Finished jobs in the table when the statistics are taken "dominated by history".
const HISTORY: i64 = 20_000;

/// When the statistics of `skiplock.jobs` were taken.
#[derive(Clone, Copy, Debug)]
enum Statistics {
    /// On the freshly migrated, empty table.
    Empty,
    /// On a table of finished jobs only, before any of the test's jobs existed.
    History,
}

/// A test database whose `skiplock.jobs` statistics were taken as `statistics` says and
/// are kept there: autovacuum (and with it autoanalyze) is off on the table, and on every
/// other table of skiplock's ([`skiplock_autovacuum_off`]).
async fn with_statistics(statistics: Statistics) -> TestDb {
    let db = test_db().await;
    skiplock_autovacuum_off(&db.pool).await;
    if let Statistics::History = statistics {
        sqlx::query(
            "INSERT INTO skiplock.jobs (kind, state, finished_at)
             SELECT 'noop', 'succeeded', now() FROM generate_series(1, $1)",
        )
        .bind(HISTORY)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    sqlx::query("ANALYZE skiplock.jobs")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("ANALYZE skiplock.job_dependencies")
        .execute(&db.pool)
        .await
        .unwrap();
    db
}

/// Turns autovacuum and autoanalyze off on every table of the `skiplock` schema (each
/// partition of `skiplock.jobs`, and `job_dependencies`, `queues`, the rate and key
/// tables, …) and their TOAST tables, and checks it. Off on `skiplock.jobs` alone, an
/// autoanalyze of another of them (which the test's writes invite) changed the plans
/// between the two measures, and its snapshot kept [`vacuum_jobs_live`] from removing
/// what it must.
async fn skiplock_autovacuum_off(pool: &PgPool) {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT c.oid::regclass::text FROM pg_class c
         JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'skiplock' AND c.relkind = 'r'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(
        tables.iter().any(|t| t == "skiplock.jobs_live"),
        "{tables:?}"
    );
    for table in &tables {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE {table}
             SET (autovacuum_enabled = false, toast.autovacuum_enabled = false)"
        )))
        .execute(pool)
        .await
        .unwrap();
    }
    let on: Vec<String> = sqlx::query_scalar(
        "SELECT c.oid::regclass::text FROM pg_class c
         JOIN pg_namespace n ON n.oid = c.relnamespace
         LEFT JOIN pg_class t ON t.oid = c.reltoastrelid
         WHERE n.nspname = 'skiplock' AND c.relkind = 'r'
           AND NOT ('autovacuum_enabled=false' = ANY (coalesce(c.reloptions, '{}'))
                    AND (t.oid IS NULL
                         OR 'autovacuum_enabled=false' = ANY (coalesce(t.reloptions, '{}'))))",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(on.is_empty(), "autovacuum still on for {on:?}");
}

/// Vacuums `skiplock.jobs_live` as autovacuum would, once no other session of the test's
/// database holds a snapshot or a transaction id: one taken before the claims committed
/// (an autoanalyze of a catalog after the migration, say) keeps the vacuum from removing
/// the entries their updates left, and the next claim walks them (held open on purpose,
/// one made a claim read 988 buffers against 61). A snapshot taken after this check sees
/// those updates committed and keeps nothing. The wait only guards a hang.
async fn vacuum_jobs_live(pool: &PgPool) {
    common::fixtures::wait_for(
        "no other session of the database to hold a snapshot",
        std::time::Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT NOT EXISTS (
                     SELECT FROM pg_stat_activity
                     WHERE datname = current_database() AND pid <> pg_backend_pid()
                       AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL))",
            )
            .fetch_one(pool)
            .await
            .unwrap()
        },
    )
    .await;
    sqlx::query("VACUUM skiplock.jobs_live")
        .execute(pool)
        .await
        .unwrap();
}

/// Buffers (hit + read) of skiplock's own tables and indexes that `statement` touched,
/// the statements run by the functions it called included.
///
/// Counted by this backend's statistics of each skiplock relation: the catalog reads of
/// planning are left out.
/// Those say nothing about the table and jump when the backend's caches are reset (a CI
/// run, its neighbours busy with migrations, counted 1,581 buffers for a dependency settle
/// that reads 324 in every other run, all of the difference catalog reads). No deferred
/// trigger exists, so nothing of the statement's work is left for the commit.
async fn buffers_of(session: &mut PgConnection, statement: &str) -> i64 {
    // The backend's counts since it last reported its statistics, which it does only
    // between transactions: the difference across the statement, inside one transaction,
    // is the statement's.
    const SKIPLOCK_BUFFERS: &str =
        "SELECT coalesce(sum(pg_stat_get_xact_blocks_fetched(c.oid)), 0)::bigint
         FROM pg_class c
         WHERE c.relnamespace = 'skiplock'::regnamespace
            OR c.oid IN (SELECT reltoastrelid FROM pg_class
                         WHERE relnamespace = 'skiplock'::regnamespace)";
    let mut tx = sqlx::Connection::begin(&mut *session).await.unwrap();
    let before: i64 = sqlx::query_scalar(SKIPLOCK_BUFFERS)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    // The statements are the test's own, with ids and tokens read from the database.
    sqlx::query(sqlx::AssertSqlSafe(statement.to_owned()))
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{statement}: {e}"));
    let after: i64 = sqlx::query_scalar(SKIPLOCK_BUFFERS)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    after - before
}

/// `SELECT skiplock.complete(id, token)` of the next job of `queue`, measured.
async fn buffers_of_completing_next(session: &mut PgConnection, queue: &str) -> i64 {
    let (id, token) = sql_claim_one(&mut *session, queue, "bounded-test").await;
    buffers_of(
        session,
        &format!("SELECT skiplock.complete({id}, '{token}')"),
    )
    .await
}

/// `SELECT skiplock.discard(id, token, …)` of the next job of `queue`, measured.
async fn buffers_of_discarding_next(session: &mut PgConnection, queue: &str) -> i64 {
    let (id, token) = sql_claim_one(&mut *session, queue, "bounded-test").await;
    buffers_of(
        session,
        &format!("SELECT skiplock.discard({id}, '{token}', 'test')"),
    )
    .await
}

/// Adds `count` waiting jobs in one lane of their own (`queue` 'bulk').
async fn add_waiting_lane(pool: &PgPool, lane: &str, count: i64) {
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, queue, ordering_key)
         SELECT 'noop', 'bulk', $1 FROM generate_series(1, $2)",
    )
    .bind(lane)
    .bind(count)
    .execute(pool)
    .await
    .unwrap();
}

/// Asserts that the step read about as much beside 33 times more waiting jobs: at most 100
/// buffers more. The bounded steps read 5 to 51 more (an index level deeper here and
/// there); a count of the waiting jobs added to a dependency settle, one walk of their
/// index, read 190 to 210 more.
fn assert_bounded(what: &str, statistics: Statistics, few: i64, many: i64) {
    assert!(
        many <= few + 100,
        "{what} (statistics {statistics:?}): {few} buffers beside {FEW_WAITING} waiting jobs, \
         {many} beside {MANY_WAITING}: its cost grows with the waiting jobs"
    );
}

async fn lane_step_is_bounded(statistics: Statistics) {
    let db = with_statistics(statistics).await;
    let mut session = db.pool.acquire().await.unwrap();
    // The measured lane: a head and jobs behind it, in a queue of its own.
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, queue, ordering_key)
         SELECT 'noop', 'lane', 'measured' FROM generate_series(1, 10)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    add_waiting_lane(&db.pool, "beside", FEW_WAITING).await;
    buffers_of_completing_next(&mut session, "lane").await;
    let few = buffers_of_completing_next(&mut session, "lane").await;
    add_waiting_lane(&db.pool, "beside", MANY_WAITING - FEW_WAITING).await;
    let many = buffers_of_completing_next(&mut session, "lane").await;
    assert_bounded("a lane step", statistics, few, many);
    // The steps did their work: the next job of the measured lane is its queued head.
    let queued: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs WHERE ordering_key = 'measured' AND state = 'queued'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(queued, 1, "the measured lane's next job is queued");
}

#[tokio::test]
async fn a_lane_step_costs_the_same_beside_many_waiting_jobs_under_empty_statistics() {
    lane_step_is_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn a_lane_step_costs_the_same_beside_many_waiting_jobs_under_history_statistics() {
    lane_step_is_bounded(Statistics::History).await;
}

/// An enqueue into a lane with jobs: the insert trigger reads the lane's last unfinished job
/// (its tail) under the lane's lock. Beside 33 times more waiting jobs of the same lane and,
/// enqueued after them, of another, it reads the same: the tail is one backward probe of the
/// lane's index, not a walk of the newest jobs by id nor of the lane.
async fn lane_enqueue_is_bounded(statistics: Statistics) {
    let db = with_statistics(statistics).await;
    let mut session = db.pool.acquire().await.unwrap();
    const ENQUEUE: &str = "INSERT INTO skiplock.jobs (kind, queue, ordering_key) \
                           VALUES ('noop', 'lane', 'measured')";
    add_waiting_lane(&db.pool, "measured", FEW_WAITING).await;
    add_waiting_lane(&db.pool, "beside", FEW_WAITING).await;
    // Warm: the trigger's plans.
    buffers_of(&mut session, ENQUEUE).await;
    let few = buffers_of(&mut session, ENQUEUE).await;
    add_waiting_lane(&db.pool, "measured", MANY_WAITING - FEW_WAITING).await;
    add_waiting_lane(&db.pool, "beside", MANY_WAITING - FEW_WAITING).await;
    let many = buffers_of(&mut session, ENQUEUE).await;
    assert_bounded("an enqueue into a lane", statistics, few, many);
    // The enqueues did their work: every job of the measured lane but its head waits.
    let queued: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs WHERE ordering_key = 'measured' AND state = 'queued'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(queued, 1, "the measured lane has one queued job, its head");
}

#[tokio::test]
async fn an_enqueue_into_a_lane_costs_the_same_beside_many_waiting_jobs_under_empty_statistics() {
    lane_enqueue_is_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn an_enqueue_into_a_lane_costs_the_same_beside_many_waiting_jobs_under_history_statistics() {
    lane_enqueue_is_bounded(Statistics::History).await;
}

/// Adds a parent in queue `queue` with `children` waiting dependants; returns its id.
async fn add_parent_with_children(pool: &PgPool, queue: &str, children: i64) -> i64 {
    let parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop', queue => $1)")
        .bind(queue)
        .fetch_one(pool)
        .await
        .unwrap();
    sqlx::query(
        "SELECT skiplock.enqueue('noop', queue => 'children', depends_on => ARRAY[$1::bigint])
         FROM generate_series(1, $2)",
    )
    .bind(parent)
    .bind(children)
    .execute(pool)
    .await
    .unwrap();
    parent
}

/// A parent's completion or discard and what it does to its dependants: its statement reads
/// which of its jobs have dependants (`internal_parents_with_dependants`, a probe of the
/// edges' parent index per job) and the settle queues or cancels them; beside 33 times more
/// edges and waiting dependants of another parent, both read the same.
async fn dependency_settle_is_bounded(statistics: Statistics) {
    let db = with_statistics(statistics).await;
    let mut session = db.pool.acquire().await.unwrap();
    // Three parents to complete and three to fail, five dependants each: the first of each
    // warms the session, the others are measured.
    let mut failing = Vec::new();
    for _ in 0..3 {
        add_parent_with_children(&db.pool, "parents", 5).await;
        failing.push(add_parent_with_children(&db.pool, "failing", 5).await);
    }
    // Dependants of a parent that never finishes, beside the measured ones.
    add_parent_with_children(&db.pool, "idle", FEW_WAITING).await;
    buffers_of_completing_next(&mut session, "parents").await;
    buffers_of_discarding_next(&mut session, "failing").await;
    let few_settle = buffers_of_completing_next(&mut session, "parents").await;
    let few_cancel = buffers_of_discarding_next(&mut session, "failing").await;
    add_parent_with_children(&db.pool, "idle", MANY_WAITING - FEW_WAITING).await;
    let many_settle = buffers_of_completing_next(&mut session, "parents").await;
    let many_cancel = buffers_of_discarding_next(&mut session, "failing").await;
    assert_bounded("a dependency settle", statistics, few_settle, many_settle);
    assert_bounded("cancelling dependants", statistics, few_cancel, many_cancel);
    // The steps did their work: every completed parent's children queued, every failed
    // parent's children cancelled.
    let queued: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs WHERE queue = 'children' AND state = 'queued'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(queued, 15, "the completed parents' children are queued");
    let cancelled: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs j JOIN skiplock.job_dependencies d ON d.job_id = j.id
         WHERE d.parent_id = ANY($1) AND j.state = 'cancelled'",
    )
    .bind(&failing)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(cancelled, 15, "the failed parents' children are cancelled");
}

#[tokio::test]
async fn a_dependency_settle_costs_the_same_beside_many_waiting_jobs_under_empty_statistics() {
    dependency_settle_is_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn a_dependency_settle_costs_the_same_beside_many_waiting_jobs_under_history_statistics() {
    dependency_settle_is_bounded(Statistics::History).await;
}

/// Lanes one insert of [`maintain_is_bounded`] adds.
const LANES_PER_INSERT: usize = 1_000;

async fn maintain_is_bounded(statistics: Statistics) {
    let db = with_statistics(statistics).await;
    // Lanes of two jobs each: every head queued, every second job waiting. A thousand
    // lanes a statement: an insert takes each new lane's lock until it commits, and the
    // server's lock table, shared by every session (64 locks per connection slot by
    // default), ran out when two tests inserted their ten thousand lanes at once.
    let add_lanes = |from: i64, to: i64| {
        let pool = db.pool.clone();
        async move {
            for start in (from..=to).step_by(LANES_PER_INSERT) {
                sqlx::query(
                    "INSERT INTO skiplock.jobs (kind, queue, ordering_key)
                     SELECT 'noop', 'lanes', 'lane-' || g FROM generate_series($1, $2) g,
                            generate_series(1, 2)",
                )
                .bind(start)
                .bind(to.min(start + LANES_PER_INSERT as i64 - 1))
                .execute(&pool)
                .await
                .unwrap();
            }
        }
    };
    let mut session = db.pool.acquire().await.unwrap();
    add_lanes(1, FEW_WAITING).await;
    buffers_of(&mut session, "SELECT * FROM skiplock.maintain()").await;
    let few = buffers_of(&mut session, "SELECT * FROM skiplock.maintain()").await;
    add_lanes(FEW_WAITING + 1, MANY_WAITING).await;
    let many = buffers_of(&mut session, "SELECT * FROM skiplock.maintain()").await;
    assert_bounded("skiplock.maintain()", statistics, few, many);
}

#[tokio::test]
async fn maintain_costs_the_same_beside_many_waiting_jobs_under_empty_statistics() {
    maintain_is_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn maintain_costs_the_same_beside_many_waiting_jobs_under_history_statistics() {
    maintain_is_bounded(Statistics::History).await;
}

/// The sweep goes through the waiting jobs a batch at a time and starts again after the
/// last: every waiting job it can move is moved within one lap, however many wait.
#[tokio::test]
async fn the_waiting_sweep_reaches_every_waiting_job_within_a_lap() {
    let db = test_db().await;
    // Waiting for nothing (as a hand-written row can be): the sweep queues each.
    let orphans: i64 = 1_200;
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, state) SELECT 'noop', 'waiting' FROM generate_series(1, $1)",
    )
    .bind(orphans)
    .execute(&db.pool)
    .await
    .unwrap();
    let waiting = || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state = 'waiting'")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        n
    };
    let mut passes = 0;
    let mut moved_in_first = None;
    while waiting().await > 0 {
        passes += 1;
        assert!(
            passes <= 10,
            "{} jobs still wait after 10 passes",
            waiting().await
        );
        let moved: i32 = sqlx::query_scalar("SELECT skiplock.internal_settle_waiting()")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        moved_in_first.get_or_insert(moved);
    }
    let first = i64::from(moved_in_first.unwrap());
    assert!(
        first > 0 && first < orphans,
        "a pass moves one batch, not every waiting job: the first moved {first} of {orphans}"
    );
    assert!(passes >= 2, "several passes: {passes}");
}

/// A claim of a queue with both global limits: beside 33 times more queued jobs of another
/// queue (and, under history statistics, the finished jobs), it reads the same: the
/// count of running jobs reads running ones only, and the rate limit reads the ring slots
/// it takes (not the limit's 10,000).
async fn limited_claim_is_bounded(statistics: Statistics) {
    let db = with_statistics(statistics).await;
    let mut session = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT skiplock.set_queue_limits('limited', 1000, 10000, '1 hour')")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO skiplock.jobs (kind, queue) SELECT 'noop', 'limited' FROM generate_series(1, 10)")
        .execute(&db.pool)
        .await
        .unwrap();
    let queue_bulk = |count: i64| {
        sqlx::query("INSERT INTO skiplock.jobs (kind, queue) SELECT 'noop', 'bulk' FROM generate_series(1, $1)")
            .bind(count)
            .execute(&db.pool)
    };
    queue_bulk(FEW_WAITING).await.unwrap();
    let claim = "SELECT * FROM skiplock.claim('limited', 1, 'bounded-test')";
    // Warm: plans, and the ring made at the first claim.
    buffers_of(&mut session, claim).await;
    let few = buffers_of(&mut session, claim).await;
    queue_bulk(MANY_WAITING - FEW_WAITING).await.unwrap();
    let many = buffers_of(&mut session, claim).await;
    assert_bounded("a claim of a limited queue", statistics, few, many);
    let started: i64 = sqlx::query_scalar(
        "SELECT started_in_period FROM skiplock.queue_limits WHERE queue = 'limited'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(started, 3, "each measured claim started a job");
}

#[tokio::test]
async fn a_claim_of_a_limited_queue_costs_the_same_beside_many_queued_jobs_under_empty_statistics()
{
    limited_claim_is_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn a_claim_of_a_limited_queue_costs_the_same_beside_many_queued_jobs_under_history_statistics()
 {
    limited_claim_is_bounded(Statistics::History).await;
}

/// A claim of a queue with a rate limit and a per-key one, both of 100,000 an hour: beside
/// windows holding 50,000 starts each it reads what it read beside 2, the slots it may
/// take and nothing of the rest of the windows (a join of the slots with their positions
/// read them all, a hash of every start of the window at every claim).
async fn rate_windows_claim_is_bounded(statistics: Statistics) {
    let db = with_statistics(statistics).await;
    let mut session = db.pool.acquire().await.unwrap();
    sqlx::query(
        "SELECT skiplock.set_queue_limits('limited', NULL, 100000, '1 hour',
                                          key_rate_limit => 100000, key_rate_period => '1 hour')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
         SELECT 'noop', 'limited', 'k' FROM generate_series(1, 10)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let claim = "SELECT * FROM skiplock.claim('limited', 1, 'bounded-test')";
    // Warm: plans, and both windows made at the first claim.
    buffers_of(&mut session, claim).await;
    let few = buffers_of(&mut session, claim).await;
    // 50,000 more starts in each window, the newest now, written as claims write them.
    sqlx::query(
        "WITH w AS (SELECT queue, concurrency_key, next_slot FROM skiplock.rate_windows
                    WHERE queue = 'limited')
         INSERT INTO skiplock.rate_window_starts (queue, concurrency_key, slot, started_at)
         SELECT w.queue, w.concurrency_key, w.next_slot + g, now()
         FROM w, generate_series(0, 49999) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("UPDATE skiplock.rate_windows SET next_slot = next_slot + 50000")
        .execute(&db.pool)
        .await
        .unwrap();
    let many = buffers_of(&mut session, claim).await;
    assert!(
        many <= few + 100,
        "a claim of a rate-limited queue (statistics {statistics:?}): {few} buffers beside \
         windows of 2 starts, {many} beside 50,002: its cost grows with the window"
    );
    let running: i64 =
        sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state = 'running'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(running, 3, "each measured claim took a job");
}

#[tokio::test]
async fn a_claim_of_a_rate_limited_queue_costs_the_same_beside_full_windows_under_empty_statistics()
{
    rate_windows_claim_is_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn a_claim_of_a_rate_limited_queue_costs_the_same_beside_full_windows_under_history_statistics()
 {
    rate_windows_claim_is_bounded(Statistics::History).await;
}

/// The id of the job with the highest id in `lane`.
async fn last_of_lane(pool: &PgPool, lane: &str) -> i64 {
    sqlx::query_scalar("SELECT max(id) FROM skiplock.jobs WHERE ordering_key = $1")
        .bind(lane)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// `skiplock.why_not_running` of the last job of a long lane and of a job its queue's
/// max_running holds back: beside 33 times more jobs behind the same lane and held back in
/// the same queue (and, under history statistics, the finished jobs), it reads the same:
/// the lane's head is one index entry, the count of running jobs stops at max_running.
async fn why_not_running_is_bounded(statistics: Statistics) {
    let db = with_statistics(statistics).await;
    let pool = &db.pool;
    let mut session = pool.acquire().await.unwrap();
    sqlx::query("SELECT skiplock.set_queue_limits('limited', 2)")
        .execute(pool)
        .await
        .unwrap();
    let queue_limited = |count: i64| {
        sqlx::query(
            "INSERT INTO skiplock.jobs (kind, queue) SELECT 'noop', 'limited' FROM generate_series(1, $1)",
        )
        .bind(count)
        .execute(pool)
    };
    queue_limited(3).await.unwrap();
    sql_claim_one(&mut *session, "limited", "bounded-test").await;
    sql_claim_one(&mut *session, "limited", "bounded-test").await;
    let held: i64 = sqlx::query_scalar(
        "SELECT id FROM skiplock.jobs WHERE queue = 'limited' AND state = 'queued'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    add_waiting_lane(pool, "long", FEW_WAITING).await;
    let why = |lane_job: i64| {
        format!("SELECT skiplock.why_not_running({held}), skiplock.why_not_running({lane_job})")
    };
    let reasons: (String, String) =
        sqlx::query_as(sqlx::AssertSqlSafe(why(last_of_lane(pool, "long").await)))
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(reasons.0.contains("max_running"), "{reasons:?}");
    assert!(reasons.1.contains("waits behind job"), "{reasons:?}");
    // Warm: plans.
    buffers_of(&mut session, &why(last_of_lane(pool, "long").await)).await;
    let few = buffers_of(&mut session, &why(last_of_lane(pool, "long").await)).await;
    add_waiting_lane(pool, "long", MANY_WAITING - FEW_WAITING).await;
    queue_limited(MANY_WAITING).await.unwrap();
    let many = buffers_of(&mut session, &why(last_of_lane(pool, "long").await)).await;
    // A couple of dozen buffers either way (22 to 26), so the general bound would let a walk
    // of the lane through: a lookup that read the lane's 9,700 more entries read 184.
    assert!(
        many <= few + 10,
        "skiplock.why_not_running (statistics {statistics:?}): {few} buffers beside \
         {FEW_WAITING} jobs, {many} beside {MANY_WAITING}: its cost grows with the jobs"
    );
}

#[tokio::test]
async fn why_not_running_costs_the_same_beside_many_jobs_under_empty_statistics() {
    why_not_running_is_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn why_not_running_costs_the_same_beside_many_jobs_under_history_statistics() {
    why_not_running_is_bounded(Statistics::History).await;
}

/// A claim of a queue with key_max_running: beside 33 times more jobs of a full key (one
/// tenant's backlog ahead of the others'), it reads the same. The claim that first meets
/// the backlog holds it back, each job once; the claims after it never walk it. With
/// `later`, the backlog (but its first job) is scheduled a day ahead, as retries waiting
/// for their backoff are.
async fn key_limited_claim_is_bounded(statistics: Statistics, later: bool) {
    let db = with_statistics(statistics).await;
    let pool = &db.pool;
    let mut session = pool.acquire().await.unwrap();
    sqlx::query("SELECT skiplock.set_queue_limits('keyed', NULL, key_max_running => 1)")
        .execute(pool)
        .await
        .unwrap();
    // `count` hot jobs; with `later`, all but the first of the first batch a day ahead.
    let add_hot = |count: i64, first_batch: bool| {
        sqlx::query(
            "INSERT INTO skiplock.jobs (kind, queue, concurrency_key, scheduled_at)
             SELECT 'noop', 'keyed', 'hot',
                    CASE WHEN $2 AND NOT ($3 AND g = 1) THEN now() + interval '1 day'
                         ELSE now() END
             FROM generate_series(1, $1) g",
        )
        .bind(count)
        .bind(later)
        .bind(first_batch)
        .execute(pool)
    };
    let add_small = |from: i64| {
        sqlx::query(
            "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
             SELECT 'noop', 'keyed', 'small-' || g FROM generate_series($1, $1 + 2) g",
        )
        .bind(from)
        .execute(pool)
    };
    add_hot(FEW_WAITING, true).await.unwrap();
    add_small(0).await.unwrap();
    let claim = "SELECT * FROM skiplock.claim('keyed', 1, 'bounded-test')";
    // The first claims take a hot job and hold the rest of the hot backlog back; then
    // warm: plans.
    buffers_of(&mut session, claim).await;
    buffers_of(&mut session, claim).await;
    let few = buffers_of(&mut session, claim).await;
    add_hot(MANY_WAITING - FEW_WAITING, false).await.unwrap();
    add_small(10).await.unwrap();
    // This claim holds the new hot jobs back (what they cost, once)…
    buffers_of(&mut session, claim).await;
    // …leaving the index entries of their queued versions, as every claimed job does,
    // until vacuum removes them: the test has autovacuum off, so it vacuums as
    // autovacuum would after 2 % of jobs_live changed (a claim walking 9,700 dead entries
    // read 545 buffers against 48)…
    vacuum_jobs_live(pool).await;
    // …and the next reads what the one beside the few read.
    let many = buffers_of(&mut session, claim).await;
    assert_bounded("a claim of a key-limited queue", statistics, few, many);
    let running: Vec<(String, i64)> = sqlx::query_as(
        "SELECT concurrency_key, count(*) FROM skiplock.jobs WHERE state = 'running'
         GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        running,
        vec![
            ("hot".to_owned(), 1),
            ("small-0".to_owned(), 1),
            ("small-1".to_owned(), 1),
            ("small-10".to_owned(), 1),
            ("small-2".to_owned(), 1)
        ],
        "each claim took one job of a key with room"
    );
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs WHERE concurrency_key = 'hot' AND state = 'waiting'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(held, MANY_WAITING - 1, "the hot key's backlog is held back");
}

#[tokio::test]
async fn a_claim_of_a_key_limited_queue_costs_the_same_beside_a_full_keys_backlog_under_empty_statistics()
 {
    key_limited_claim_is_bounded(Statistics::Empty, false).await;
}

#[tokio::test]
async fn a_claim_of_a_key_limited_queue_costs_the_same_beside_a_full_keys_later_backlog_under_empty_statistics()
 {
    key_limited_claim_is_bounded(Statistics::Empty, true).await;
}

#[tokio::test]
async fn a_claim_of_a_key_limited_queue_costs_the_same_beside_a_full_keys_backlog_under_history_statistics()
 {
    key_limited_claim_is_bounded(Statistics::History, false).await;
}

/// A claim of a queue with a per-key rate limit: beside 33 times more jobs of a key whose
/// window is full (one tenant's backlog ahead of the others'), it reads the same. The claim
/// that meets the backlog holds it back, each job once; the claims after it never walk it.
async fn key_rate_limited_claim_is_bounded(statistics: Statistics) {
    let db = with_statistics(statistics).await;
    let pool = &db.pool;
    let mut session = pool.acquire().await.unwrap();
    sqlx::query(
        "SELECT skiplock.set_queue_limits('keyed', NULL, key_rate_limit => 1,
                                          key_rate_period => '1 hour')",
    )
    .execute(pool)
    .await
    .unwrap();
    let add = |key: &'static str, count: i64| {
        sqlx::query(
            "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
             SELECT 'noop', 'keyed', $1 || CASE WHEN $1 = 'hot' THEN '' ELSE g::text END
             FROM generate_series(1, $2) g",
        )
        .bind(key)
        .bind(count)
        .execute(pool)
    };
    let queued_hot = || {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM skiplock.jobs WHERE concurrency_key = 'hot' AND state = 'queued'",
        )
        .fetch_one(pool)
    };
    add("hot", FEW_WAITING).await.unwrap();
    add("small-a", 3).await.unwrap();
    let claim = "SELECT * FROM skiplock.claim('keyed', 1, 'bounded-test')";
    // The first claim takes a hot job, fills the hot window and holds the rest back; then
    // warm: plans.
    buffers_of(&mut session, claim).await;
    assert_eq!(
        queued_hot().await.unwrap(),
        0,
        "the first claim held the hot backlog"
    );
    buffers_of(&mut session, claim).await;
    let few = buffers_of(&mut session, claim).await;
    add("hot", MANY_WAITING - FEW_WAITING).await.unwrap();
    add("small-b", 3).await.unwrap();
    // The claims until one meets the new hot jobs and holds them back (what they cost,
    // once); then vacuum, as in key_limited_claim_is_bounded…
    for _ in 0..5 {
        if queued_hot().await.unwrap() == 0 {
            break;
        }
        buffers_of(&mut session, claim).await;
    }
    vacuum_jobs_live(pool).await;
    // …and the next reads what the one beside the few read.
    let many = buffers_of(&mut session, claim).await;
    assert_bounded(
        "a claim of a queue with a per-key rate limit",
        statistics,
        few,
        many,
    );
    let hot: Vec<(String, i64)> = sqlx::query_as(
        "SELECT state::text, count(*) FROM skiplock.jobs WHERE concurrency_key = 'hot'
         GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        hot,
        vec![
            ("running".to_owned(), 1),
            ("waiting".to_owned(), MANY_WAITING - 1)
        ],
        "one hot job started in the hour; its backlog is held back"
    );
    let small_running: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs WHERE concurrency_key LIKE 'small-%'
         AND state = 'running'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(
        small_running >= 4,
        "the claims took the small keys' jobs: {small_running}"
    );
}

#[tokio::test]
async fn a_claim_of_a_key_rate_limited_queue_costs_the_same_beside_a_full_keys_backlog_under_empty_statistics()
 {
    key_rate_limited_claim_is_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn a_claim_of_a_key_rate_limited_queue_costs_the_same_beside_a_full_keys_backlog_under_history_statistics()
 {
    key_rate_limited_claim_is_bounded(Statistics::History).await;
}

/// A test database (statistics as `statistics` says) with the queue `keyed`, whose
/// `key_max_running` is 1, and a parent in the queue `parents` that never finishes.
async fn keyed_queue_and_parent(statistics: Statistics) -> (TestDb, i64) {
    let db = with_statistics(statistics).await;
    sqlx::query("SELECT skiplock.set_queue_limits('keyed', NULL, key_max_running => 1)")
        .execute(&db.pool)
        .await
        .unwrap();
    let parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop', queue => 'parents')")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    (db, parent)
}

/// Letting a key's held jobs go when a slot of the key frees: the claim after a completion
/// of the key reads the same beside 33 times more of the key's jobs waiting for a parent
/// (a tenant's fan-out enqueued ahead of its parent's end, before the held jobs in claim
/// order). Held jobs are told apart from
/// those by `held_for`, so the release walks the held ones alone; it walked every waiting
/// job of the key, each parent checked, before (issue 48: 71k buffers a release beside
/// 10,000 such children).
async fn key_release_is_bounded(statistics: Statistics) {
    let (db, parent) = keyed_queue_and_parent(statistics).await;
    let pool = &db.pool;
    let mut session = pool.acquire().await.unwrap();
    let add_children = |count: i64| {
        sqlx::query(
            "SELECT skiplock.enqueue('noop', queue => 'keyed', concurrency_key => 'hot',
                                     priority => -1, depends_on => ARRAY[$1::bigint])
             FROM generate_series(1, $2)",
        )
        .bind(parent)
        .bind(count)
        .execute(pool)
    };
    add_children(FEW_WAITING).await.unwrap();
    // Jobs of the key that may run: the first claim takes one and holds the others back.
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
         SELECT 'noop', 'keyed', 'hot' FROM generate_series(1, 8)",
    )
    .execute(pool)
    .await
    .unwrap();
    // A batch of several: a claim that picked more of the key than it may take holds the
    // rest back.
    let claim = "SELECT * FROM skiplock.claim('keyed', 5, 'bounded-test')";
    buffers_of(&mut session, claim).await;
    // Completes the key's running job, then measures the claim that lets the next held job
    // go and takes it.
    let mut completed = 0;
    let mut next_of_key = async |session: &mut PgConnection| {
        let (id, token): (i64, uuid::Uuid) = sqlx::query_as(
            "SELECT id, claim_token FROM skiplock.jobs
             WHERE concurrency_key = 'hot' AND state = 'running'",
        )
        .fetch_one(&mut *session)
        .await
        .expect("one running job of the key");
        sqlx::query("SELECT skiplock.complete($1, $2)")
            .bind(id)
            .bind(token)
            .execute(&mut *session)
            .await
            .unwrap();
        completed += 1;
        buffers_of(session, claim).await
    };
    next_of_key(&mut session).await;
    next_of_key(&mut session).await;
    let few = next_of_key(&mut session).await;
    add_children(MANY_WAITING - FEW_WAITING).await.unwrap();
    next_of_key(&mut session).await;
    let many = next_of_key(&mut session).await;
    assert_bounded(
        "a claim that lets a key's held jobs go",
        statistics,
        few,
        many,
    );
    let states: Vec<(String, Option<String>, i64)> = sqlx::query_as(
        "SELECT state::text, held_for, count(*) FROM skiplock.jobs
         WHERE concurrency_key = 'hot' GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        states,
        vec![
            ("running".to_owned(), None, 1),
            ("succeeded".to_owned(), None, completed),
            (
                "waiting".to_owned(),
                Some("key".to_owned()),
                8 - 1 - completed
            ),
            ("waiting".to_owned(), None, MANY_WAITING),
        ],
        "each claim took the next held job of the key; its children still wait for their parent"
    );
}

#[tokio::test]
async fn a_release_of_a_keys_held_jobs_costs_the_same_beside_its_waiting_children_under_empty_statistics()
 {
    key_release_is_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn a_release_of_a_keys_held_jobs_costs_the_same_beside_its_waiting_children_under_history_statistics()
 {
    key_release_is_bounded(Statistics::History).await;
}

/// A worker's completion that hands its key's freed slot on to the key's next job
/// (`internal_complete_handing_on`): beside 33 times more queued and running jobs of other
/// keys behind the key's next job in claim order, and of the key's own children waiting for
/// a parent, it reads the same. Under empty statistics the probe for another key's job
/// ahead ran as an anti-join that read every queued job of the queue (140 buffers beside
/// the many against 51), and the key's queued jobs were looked for in the queue's claim
/// index with the key as a filter (166 against 52).
async fn handoff_is_bounded(statistics: Statistics) {
    let (db, parent) = keyed_queue_and_parent(statistics).await;
    let pool = &db.pool;
    let mut session = pool.acquire().await.unwrap();
    // The key's jobs, ahead of every other key's in claim order: the first claim takes one
    // and holds the others back; each measured completion hands on the next.
    let hot: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key, scheduled_at)
         SELECT 'noop', 'keyed', 'hot', now() - interval '1 hour' FROM generate_series(1, 6)
         RETURNING id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    // `count` jobs of keys of their own behind the key's, half of them claimed (running),
    // and `count` children of the key waiting for a parent that never finishes.
    let add_beside = async |count: i64, from: i64| {
        sqlx::query(
            "INSERT INTO skiplock.jobs (kind, queue, concurrency_key, scheduled_at)
             SELECT 'noop', 'keyed', 'other-' || g, now() - interval '1 minute'
             FROM generate_series($1, $1 + $2 - 1) g",
        )
        .bind(from)
        .bind(count)
        .execute(pool)
        .await
        .unwrap();
        sqlx::query("SELECT count(*) FROM skiplock.claim('keyed', $1, 'bounded-test')")
            .bind(i32::try_from(count / 2).unwrap())
            .execute(pool)
            .await
            .unwrap();
        sqlx::query(
            "SELECT skiplock.enqueue('noop', queue => 'keyed', concurrency_key => 'hot',
                                     priority => -1, depends_on => ARRAY[$1::bigint])
             FROM generate_series(1, $2)",
        )
        .bind(parent)
        .bind(count)
        .execute(pool)
        .await
        .unwrap();
    };
    add_beside(FEW_WAITING, 0).await;
    // Completes the key's running job (`hot[n]`), handing its slot on to `hot[n + 1]`.
    let hand_on = async |session: &mut PgConnection, n: usize| {
        let token: uuid::Uuid = sqlx::query_scalar(
            "SELECT claim_token FROM skiplock.jobs WHERE id = $1 AND state = 'running'",
        )
        .bind(hot[n])
        .fetch_one(&mut *session)
        .await
        .expect("the key's job running");
        let buffers = buffers_of(
            session,
            &format!(
                "SELECT * FROM skiplock.internal_complete_handing_on(
                     ARRAY[{}::bigint], ARRAY['{token}'::uuid], 'bounded-test', NULL,
                     gen_random_uuid())",
                hot[n]
            ),
        )
        .await;
        let handed: String = sqlx::query_scalar(
            "SELECT state::text || ' by ' || coalesce(claimed_by, '-')
             FROM skiplock.jobs WHERE id = $1",
        )
        .bind(hot[n + 1])
        .fetch_one(&mut *session)
        .await
        .unwrap();
        assert_eq!(
            handed, "running by bounded-test",
            "the key's next job handed on"
        );
        buffers
    };
    sqlx::query("SELECT count(*) FROM skiplock.claim('keyed', 1, 'bounded-test')")
        .execute(&mut *session)
        .await
        .unwrap();
    hand_on(&mut session, 0).await;
    hand_on(&mut session, 1).await;
    let few = hand_on(&mut session, 2).await;
    add_beside(MANY_WAITING - FEW_WAITING, FEW_WAITING).await;
    vacuum_jobs_live(pool).await;
    hand_on(&mut session, 3).await;
    let many = hand_on(&mut session, 4).await;
    assert_bounded(
        "a completion handing its key's slot on",
        statistics,
        few,
        many,
    );
}

#[tokio::test]
async fn a_completion_handing_on_costs_the_same_beside_other_keys_and_its_keys_children_under_empty_statistics()
 {
    handoff_is_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn a_completion_handing_on_costs_the_same_beside_other_keys_and_its_keys_children_under_history_statistics()
 {
    handoff_is_bounded(Statistics::History).await;
}

/// A test database (statistics as `statistics` says) with the queue `fair`, whose
/// `key_claimable` is 2.
async fn fair_queue(statistics: Statistics) -> TestDb {
    let db = with_statistics(statistics).await;
    sqlx::query("SELECT skiplock.set_queue_limits('fair', NULL, key_claimable => 2)")
        .execute(&db.pool)
        .await
        .unwrap();
    db
}

/// Fair queueing (`key_claimable` 2): beside 33 times more jobs of one key waiting their
/// turn (one tenant's backlog), an insert of one more job of that key (held at once) and a
/// claim read the same. The claim lets the key's next jobs go (its turn, given by the
/// claim before), walks the queued jobs (the key's two and three small keys' one each),
/// comes back short and takes the rest of its batch from the key's held jobs.
async fn fair_queue_is_bounded(statistics: Statistics) {
    const CLAIMED: i64 = 10;
    let db = fair_queue(statistics).await;
    let pool = &db.pool;
    let mut session = pool.acquire().await.unwrap();
    let add_hot = |count: i64| {
        sqlx::query(
            "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
             SELECT 'noop', 'fair', 'hot' FROM generate_series(1, $1)",
        )
        .bind(count)
        .execute(pool)
    };
    let insert_one =
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key) VALUES ('noop', 'fair', 'hot')";
    let claim = format!("SELECT * FROM skiplock.claim('fair', {CLAIMED}, 'bounded-test')");
    let mut small_keys = 0;
    // Three small keys' jobs, then the claim, measured; checks what it took.
    let mut claim_beside_small_keys = async |session: &mut PgConnection| {
        sqlx::query(
            "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
             SELECT 'noop', 'fair', 'small-' || g FROM generate_series($1, $1 + 2) g",
        )
        .bind(small_keys)
        .execute(pool)
        .await
        .unwrap();
        small_keys += 3;
        let buffers = buffers_of(session, &claim).await;
        let (queued, running): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state = 'queued'),
                    count(*) FILTER (WHERE state = 'running' AND concurrency_key LIKE 'small-%')
             FROM skiplock.jobs WHERE queue = 'fair'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(running, small_keys, "the claim took every small key's job");
        assert!(
            queued <= 2,
            "the hot key keeps at most two jobs queued: {queued}"
        );
        buffers
    };
    // One more job of the hot key, measured; it waits its turn behind the key's two queued.
    let insert_held = async |session: &mut PgConnection| {
        let buffers = buffers_of(session, insert_one).await;
        let newest: (String, Option<String>) = sqlx::query_as(
            "SELECT state::text, held_for FROM skiplock.jobs ORDER BY id DESC LIMIT 1",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(newest, ("waiting".to_owned(), Some("fair".to_owned())));
        buffers
    };
    add_hot(FEW_WAITING).await.unwrap();
    // Warm: plans (and the hot key's turn, given by the first claim).
    insert_held(&mut session).await;
    let few_insert = insert_held(&mut session).await;
    claim_beside_small_keys(&mut session).await;
    claim_beside_small_keys(&mut session).await;
    let few_claim = claim_beside_small_keys(&mut session).await;
    add_hot(MANY_WAITING - FEW_WAITING).await.unwrap();
    // The held jobs' queued versions left dead entries in jobs_claim_idx (held after their
    // insert, by the statement's trigger): vacuum as autovacuum would (see
    // key_limited_claim_is_bounded).
    vacuum_jobs_live(pool).await;
    let many_insert = insert_held(&mut session).await;
    let many_claim = claim_beside_small_keys(&mut session).await;
    assert_bounded(
        "an insert of a job into a fair queue's key with a backlog",
        statistics,
        few_insert,
        many_insert,
    );
    assert_bounded(
        "a claim of a fair queue beside a key's backlog",
        statistics,
        few_claim,
        many_claim,
    );
    let hot: Vec<(String, Option<String>, i64)> = sqlx::query_as(
        "SELECT state::text, held_for, count(*) FROM skiplock.jobs
         WHERE concurrency_key = 'hot' GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    // Each claim took 3 small keys' jobs, the hot key's 2 queued and 5 of its held.
    let running = 4 * (CLAIMED - 3);
    assert_eq!(
        hot,
        vec![
            ("running".to_owned(), None, running),
            (
                "waiting".to_owned(),
                Some("fair".to_owned()),
                MANY_WAITING + 3 - running
            ),
        ],
        "each claim took the rest of its batch from the hot key; the rest waits its turn"
    );
}

#[tokio::test]
async fn a_fair_queue_costs_the_same_beside_a_keys_backlog_under_empty_statistics() {
    fair_queue_is_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn a_fair_queue_costs_the_same_beside_a_keys_backlog_under_history_statistics() {
    fair_queue_is_bounded(Statistics::History).await;
}

/// Fair queueing: a count of one key's queued jobs (what each release of the key and the
/// claim's turn for it ask) reads the key's range alone, as much beside 10,000 other keys'
/// queued jobs as beside 300. With the state as a range (`state < 'running'`) the count
/// walked the queued jobs of every key of the queue.
async fn key_count_is_bounded(statistics: Statistics) {
    let db = fair_queue(statistics).await;
    let pool = &db.pool;
    let mut session = pool.acquire().await.unwrap();
    let add_keys = |from: i64, to: i64| {
        sqlx::query(
            "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
             SELECT 'noop', 'fair', 'key-' || g FROM generate_series($1, $2) g",
        )
        .bind(from)
        .bind(to)
        .execute(pool)
    };
    // The key counted sorts after every other one.
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
         SELECT 'noop', 'fair', 'zzz' FROM generate_series(1, 2)",
    )
    .execute(pool)
    .await
    .unwrap();
    let count = "SELECT skiplock.internal_key_queued('fair', 'zzz', 3)";
    add_keys(1, FEW_WAITING).await.unwrap();
    buffers_of(&mut session, count).await; // warm: plans
    let few = buffers_of(&mut session, count).await;
    add_keys(FEW_WAITING + 1, MANY_WAITING).await.unwrap();
    let many = buffers_of(&mut session, count).await;
    let counted: i32 = sqlx::query_scalar(count).fetch_one(pool).await.unwrap();
    assert_eq!(counted, 2, "the key's two queued jobs");
    assert_bounded(
        "a count of a fair key's queued jobs beside other keys' queued jobs",
        statistics,
        few,
        many,
    );
}

#[tokio::test]
async fn a_count_of_a_fair_keys_queued_jobs_costs_the_same_beside_other_keys_under_empty_statistics()
 {
    key_count_is_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn a_count_of_a_fair_keys_queued_jobs_costs_the_same_beside_other_keys_under_history_statistics()
 {
    key_count_is_bounded(Statistics::History).await;
}

/// 20,000 jobs of the key `hot` in the queue `fair` (two queued, the rest held), vacuumed.
async fn hot_key_backlog(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
         SELECT 'noop', 'fair', 'hot' FROM generate_series(1, $1)",
    )
    .bind(2 * MANY_WAITING)
    .execute(pool)
    .await
    .unwrap();
    vacuum_jobs_live(pool).await;
}

/// Takes `count` more of the hot key's jobs in one claim: its queued ones, then (the claim
/// came back short) the rest from its held ones.
async fn take_hot(pool: &PgPool, count: i64) {
    let taken: i64 =
        sqlx::query_scalar("SELECT count(*) FROM skiplock.claim('fair', $1::int, 'bounded-test')")
            .bind(count)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(taken, count, "the claim took its batch from the hot key");
}

/// Fair queueing (`key_claimable` 2): the count of a key's queued jobs, which every
/// release of its jobs makes (`internal_key_queued`), and an insert of one more job of the
/// key (held at once) read the same after 33 times more of the key's held jobs were taken.
/// Each taken job leaves a dead entry at the front of the key's range in `jobs_held_idx`
/// until a vacuum (none here): whether the key has held jobs, and at which priority, is read
/// from the back of the range. From the front, the count read 401 buffers after 64,000
/// taken, against 21.
async fn fair_probes_are_bounded(statistics: Statistics) {
    let db = fair_queue(statistics).await;
    let pool = &db.pool;
    let mut session = pool.acquire().await.unwrap();
    hot_key_backlog(pool).await;
    let take = async |count: i64| take_hot(pool, count).await;
    let count_queued = "SELECT skiplock.internal_key_queued('fair', 'hot', 2)";
    let insert_one =
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key) VALUES ('noop', 'fair', 'hot')";
    // Warm: plans, and the key's turn given.
    take(2).await;
    take(FEW_WAITING).await;
    buffers_of(&mut session, count_queued).await;
    buffers_of(&mut session, insert_one).await;
    let few_count = buffers_of(&mut session, count_queued).await;
    let few_insert = buffers_of(&mut session, insert_one).await;
    take(MANY_WAITING).await;
    let many_count = buffers_of(&mut session, count_queued).await;
    let many_insert = buffers_of(&mut session, insert_one).await;
    assert_bounded(
        "the count of a fair queue's key's queued jobs beside its taken held jobs",
        statistics,
        few_count,
        many_count,
    );
    assert_bounded(
        "an insert into a fair queue's key beside its taken held jobs",
        statistics,
        few_insert,
        many_insert,
    );
    let newest: (String, Option<String>) =
        sqlx::query_as("SELECT state::text, held_for FROM skiplock.jobs ORDER BY id DESC LIMIT 1")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(newest, ("waiting".to_owned(), Some("fair".to_owned())));
}

/// Fair queueing (`key_claimable` 2): the release of a key's next jobs (its turn) reads the
/// same after 33 times more of the key's held jobs went, their dead entries at the
/// front of the key's range in `jobs_held_idx` (no vacuum): it walks from where the key's
/// held jobs start (`skiplock.key_held_from`), which the releases before it recorded.
async fn fair_release_is_bounded(statistics: Statistics) {
    let db = fair_queue(statistics).await;
    let pool = &db.pool;
    let mut session = pool.acquire().await.unwrap();
    hot_key_backlog(pool).await;
    let take = async |count: i64| take_hot(pool, count).await;
    // The key's turn: its next two let go (measured), then claimed.
    let mut release = async || {
        let buffers = buffers_of(
            &mut session,
            "SELECT skiplock.internal_release_held('fair', ARRAY['hot'])",
        )
        .await;
        take(2).await;
        buffers
    };
    // The key's first `count` held jobs cancelled by hand (moved to jobs_done: their
    // entries at the front of the key's range dead), then one turn (not measured) that
    // walks past them and moves where the key's walks start. Nothing else differs between
    // the two measures: no job goes through the key's queued range (whose count, in each
    // release, steps over the entries of the jobs claimed from it, as unkillable as these
    // while a snapshot is held anywhere in the database, an autoanalyze say).
    let cancel_front = async |count: i64| {
        sqlx::query(
            "UPDATE skiplock.jobs SET state = 'cancelled', held_for = NULL, finished_at = now()
             WHERE id IN (SELECT id FROM skiplock.jobs
                          WHERE queue = 'fair' AND held_for = 'fair'
                          ORDER BY priority, scheduled_at, id LIMIT $1)",
        )
        .bind(count)
        .execute(pool)
        .await
        .unwrap();
    };
    take(2).await;
    release().await;
    cancel_front(FEW_WAITING).await;
    release().await;
    let few = release().await;
    cancel_front(MANY_WAITING).await;
    release().await;
    let many = release().await;
    assert_bounded(
        "the release of a fair queue's key's next jobs beside its taken held jobs",
        statistics,
        few,
        many,
    );
}

#[tokio::test]
async fn a_fair_keys_release_costs_the_same_beside_its_taken_held_jobs_under_empty_statistics() {
    fair_release_is_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn a_fair_keys_release_costs_the_same_beside_its_taken_held_jobs_under_history_statistics() {
    fair_release_is_bounded(Statistics::History).await;
}

#[tokio::test]
async fn a_fair_keys_probes_cost_the_same_beside_its_taken_held_jobs_under_empty_statistics() {
    fair_probes_are_bounded(Statistics::Empty).await;
}

#[tokio::test]
async fn a_fair_keys_probes_cost_the_same_beside_its_taken_held_jobs_under_history_statistics() {
    fair_probes_are_bounded(Statistics::History).await;
}

/// How many of `tables` this session holds a lock on.
async fn tables_locked(session: &mut PgConnection, tables: &[sqlx::postgres::types::Oid]) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND relation = ANY ($1)",
    )
    .bind(tables)
    .fetch_one(&mut *session)
    .await
    .unwrap()
}

/// A lookup by id of a job that has not finished costs the same whatever days of finished
/// jobs are kept: with 31 days made (94 tables of finished jobs), a cancel of a queued job
/// and an enqueue whose parent has not finished lock only the tables their rows move into,
/// not every day's (through `skiplock.jobs`,
/// each such lookup planned, probed and locked them all: an enqueue with a parent held 202
/// locks on them and took 5.3-7.5 ms against 1.9-2.7 ms with one day kept;
/// benches/days-kept.sh, docs/benchmarks.md). Counted in locks, not time: the count does
/// not depend on the machine.
#[tokio::test]
async fn lookups_of_jobs_not_finished_lock_no_day_of_finished_jobs() {
    let db = test_db().await;
    let pool = &db.pool;
    sqlx::query(
        "SELECT skiplock.internal_prepare_done_partitions((now() AT TIME ZONE 'UTC')::date - 30, 31)",
    )
    .execute(pool)
    .await
    .unwrap();
    // Read outside the measured transactions: pg_partition_tree locks what it lists.
    let done_tables: Vec<sqlx::postgres::types::Oid> =
        sqlx::query_scalar("SELECT relid::oid FROM pg_partition_tree('skiplock.jobs_done')")
            .fetch_all(pool)
            .await
            .unwrap();
    assert!(
        done_tables.len() > 90,
        "{} tables of finished jobs",
        done_tables.len()
    );
    let parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop', queue => 'held')")
        .fetch_one(pool)
        .await
        .unwrap();
    let queued: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop')")
        .fetch_one(pool)
        .await
        .unwrap();
    let mut session = pool.acquire().await.unwrap();
    // Each step twice, in a transaction rolled back, so that the second runs the plans the
    // session keeps (the steady state of a worker's or an application's session).
    for (what, step, allowed) in [
        (
            "an enqueue whose parent has not finished",
            format!("SELECT skiplock.enqueue('noop', depends_on => ARRAY[{parent}::bigint])"),
            0,
        ),
        (
            // Its row moves into jobs_done and today's table of cancelled jobs.
            "a cancel of a queued job",
            format!("SELECT skiplock.cancel_job({queued})"),
            2,
        ),
    ] {
        for _ in 0..2 {
            sqlx::query("BEGIN").execute(&mut *session).await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(step.clone()))
                .execute(&mut *session)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let locked = tables_locked(&mut session, &done_tables).await;
            sqlx::query("ROLLBACK")
                .execute(&mut *session)
                .await
                .unwrap();
            assert!(
                locked <= allowed,
                "{what} locked {locked} tables of finished jobs (at most {allowed})"
            );
        }
    }
}

/// The buffers of skiplock's relations that each lookup of a finished job by id reads, in
/// a database keeping `days` days of finished jobs, each measured on a session that made
/// the same step once already: an enqueue whose parent succeeded, a watch of that parent, a
/// read of it by id, and a retry by hand of a dead job.
async fn finished_lookups_buffers(days: i32) -> Vec<(&'static str, i64)> {
    let db = test_db().await;
    let pool = &db.pool;
    sqlx::query(
        "SELECT skiplock.internal_prepare_done_partitions(
             (now() AT TIME ZONE 'UTC')::date - ($1 - 1), $1)",
    )
    .bind(days)
    .execute(pool)
    .await
    .unwrap();
    // A job that succeeded and two that went dead, each through the SQL protocol.
    let mut finished = Vec::new();
    for outcome in ["succeeded", "dead", "dead"] {
        let id: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop', queue => $1)")
            .bind(outcome)
            .fetch_one(pool)
            .await
            .unwrap();
        let (claimed, token) = sql_claim_one(pool, outcome, "test").await;
        assert_eq!(claimed, id);
        let call = if outcome == "succeeded" {
            "SELECT skiplock.complete($1, $2)"
        } else {
            "SELECT skiplock.discard($1, $2, 'boom')"
        };
        sqlx::query(call)
            .bind(id)
            .bind(token)
            .execute(pool)
            .await
            .unwrap();
        finished.push(id);
    }
    // Children with a parent that succeeded (finished[0]) beside another: two whose other
    // parent completes, two whose other parent is discarded (they are cancelled), two whose
    // other parent stays queued, read by the sweep.
    let enqueue = |queue: &str| format!("SELECT skiplock.enqueue('noop', queue => '{queue}')");
    for queue in ["parents", "parents", "doomed", "doomed", "held", "held"] {
        let parent: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(enqueue(queue)))
            .fetch_one(pool)
            .await
            .unwrap();
        sqlx::query(
            "SELECT skiplock.enqueue('noop', queue => 'children',
                                     depends_on => ARRAY[$1::bigint, $2::bigint])",
        )
        .bind(finished[0])
        .bind(parent)
        .execute(pool)
        .await
        .unwrap();
    }
    let completions: Vec<String> = sql_claim(pool, "parents", 2, "test")
        .await
        .into_iter()
        .map(|(id, token)| format!("SELECT skiplock.complete({id}, '{token}')"))
        .collect();
    let discards: Vec<String> = sql_claim(pool, "doomed", 2, "test")
        .await
        .into_iter()
        .map(|(id, token)| format!("SELECT skiplock.discard({id}, '{token}', 'boom')"))
        .collect();
    let mut session = pool.acquire().await.unwrap();
    let mut measured = Vec::new();
    for (what, steps) in [
        (
            "a completion of a parent whose child waits on a parent that succeeded",
            completions,
        ),
        ("a parent discarded, its child cancelled", discards),
        (
            "a pass of the sweep over children waiting on a parent that succeeded",
            vec!["SELECT skiplock.internal_settle_waiting()".to_owned(); 2],
        ),
        (
            "skiplock::job_state of a job that succeeded",
            vec![format!("SELECT skiplock.internal_job_state({})", finished[0]); 2],
        ),
        (
            "an enqueue whose parent succeeded",
            vec![
                format!(
                    "SELECT skiplock.enqueue('noop', depends_on => ARRAY[{}::bigint])",
                    finished[0]
                );
                2
            ],
        ),
        (
            "a watch of a job that succeeded",
            vec![format!("SELECT * FROM skiplock.watch_job({})", finished[0]); 2],
        ),
        (
            // skiplock::job, `skiplock show`, skiplock::job_state.
            "a read of a job that succeeded by its id",
            vec![format!("SELECT * FROM skiplock.internal_job_by_id({})", finished[0]); 2],
        ),
        (
            "a retry by hand of a dead job",
            vec![
                format!("SELECT skiplock.retry_job({})", finished[1]),
                format!("SELECT skiplock.retry_job({})", finished[2]),
            ],
        ),
    ] {
        buffers_of(&mut session, &steps[0]).await;
        measured.push((what, buffers_of(&mut session, &steps[1]).await));
    }
    let retried: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs WHERE queue = 'dead' AND state = 'queued'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(retried, 2, "each retry by hand took its dead job");
    let children: Vec<(String, i64)> = sqlx::query_as(
        "SELECT state::text, count(*) FROM skiplock.jobs WHERE queue = 'children'
         GROUP BY state ORDER BY state::text",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        children,
        [
            ("cancelled".to_owned(), 2),
            ("queued".to_owned(), 2),
            ("waiting".to_owned(), 2)
        ],
        "the children of the completed parents are queued, those of the discarded ones \
         cancelled, those of the queued ones wait"
    );
    measured
}

/// A lookup by id of a job that finished costs the same whatever days of finished jobs are
/// kept: with 31 days made (94 tables of finished jobs) it reads what it reads with one
/// day, the tables of its state from the day its id was handed out on
/// (`skiplock.internal_finished_job`), at most 20 buffers more. Each such lookup through
/// `skiplock.jobs` probed every day's table: with 31 days (8008bd9) an enqueue with a
/// parent that succeeded read 345 buffers against 45 with one day, a watch 201 against 21,
/// a retry by hand 1,073 against 113, and `SELECT * FROM skiplock.jobs WHERE id = …` (what
/// skiplock::job ran) 206 in its plan's 101 index probes.
#[tokio::test]
async fn lookups_of_finished_jobs_read_the_same_whatever_days_are_kept() {
    let one_day = finished_lookups_buffers(1).await;
    let month = finished_lookups_buffers(31).await;
    for ((what, few), (_, many)) in one_day.iter().zip(&month) {
        assert!(
            *many <= few + 20,
            "{what}: {few} buffers with one day kept, {many} with 31: its cost follows the days"
        );
    }
}

/// A finished job whose finished_at was written by hand before its id was handed out (a
/// row inserted finished, with a past day) is still found by id: as a parent, by a watch
/// and by a retry by hand, each after the days from its id's on came up empty.
#[tokio::test]
async fn a_finished_job_dated_before_its_id_is_found_by_id() {
    let db = test_db().await;
    let pool = &db.pool;
    sqlx::query(
        "SELECT skiplock.internal_prepare_done_partitions((now() AT TIME ZONE 'UTC')::date - 10, 11)",
    )
    .execute(pool)
    .await
    .unwrap();
    let old: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, state, attempt, claimed_at, finished_at, last_error)
         SELECT 'noop', s::skiplock.job_state, 1, now() - interval '10 days',
                now() - interval '9 days', 'by hand'
         FROM unnest(ARRAY['succeeded', 'dead']) s
         RETURNING id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let from: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT skiplock.internal_finished_from($1)")
            .bind(old[0])
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(
        from.is_some_and(|from| from > chrono::Utc::now() - chrono::Duration::days(1)),
        "the ids' day is today ({from:?}): the rows are looked for in the other days after"
    );
    let child: i64 =
        sqlx::query_scalar("SELECT skiplock.enqueue('noop', depends_on => ARRAY[$1::bigint])")
            .bind(old[0])
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        common::fixtures::state_of(pool, child).await,
        skiplock::JobState::Queued,
        "the child of a parent that succeeded runs"
    );
    let watched: (String,) = sqlx::query_as("SELECT state::text FROM skiplock.watch_job($1)")
        .bind(old[0])
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(watched.0, "succeeded");
    let retried: bool = sqlx::query_scalar("SELECT skiplock.retry_job($1)")
        .bind(old[1])
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(retried, "the dead job is retried");
    assert_eq!(
        common::fixtures::state_of(pool, old[1]).await,
        skiplock::JobState::Queued
    );
    // A lock asked for by a NULL is refused, not taken as FOR UPDATE.
    let refused = sqlx::query("SELECT * FROM skiplock.internal_finished_job($1, NULL)")
        .bind(old[0])
        .execute(pool)
        .await
        .expect_err("lock_rows NULL");
    assert_eq!(
        refused
            .as_database_error()
            .and_then(|e| e.code())
            .as_deref(),
        Some("22023")
    );
}
