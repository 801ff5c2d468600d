//! Least privilege (docs/operating.md, "Least privilege"): the roles and grants the docs
//! give, made from the docs themselves (the administrator's block in docs/operating.md and
//! docs/roles.sql, with the role names replaced), with real logins and connections. Each
//! role does its job, and each thing outside it fails with SQLSTATE 42501.
//!
//! Roles are cluster-wide, so each test names its roles after its own database
//! (`<database>_worker`, …) and drops them when it ends, also when it panics.
//!
//! A forbidden statement is also run by the schema's owner, in a transaction rolled back,
//! and must succeed there: the 42501 comes from the role's privileges, not from a
//! statement that could not work anyway.

mod common;

use std::str::FromStr;
use std::time::Duration;

use common::fixtures::{Record, Recorder, state_of, wait_for};
use common::{TestDb, server_url, test_db};
use serde_json::json;
use skiplock::cron::CronSchedule;
use skiplock::{EnqueueOptions, JobId, JobState, QueueLimits, Retention, UniquePolicy, Worker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};

/// The group roles, as docs/roles.sql names them (without the `skiplock_` prefix).
const GROUPS: [&str; 5] = ["migrator", "worker", "enqueuer", "reader", "operator"];

/// docs/roles.sql, the grants the migrator runs after every migration.
const ROLES_SQL: &str = include_str!("../docs/roles.sql");

/// docs/operating.md, whose "Least privilege" section holds the administrator's block.
const OPERATING_MD: &str = include_str!("../docs/operating.md");

/// The first ```sql block of docs/operating.md's "### Least privilege": what an
/// administrator runs once.
fn admin_block() -> &'static str {
    let section = OPERATING_MD
        .split_once("\n### Least privilege\n")
        .expect("docs/operating.md has a \"### Least privilege\" section")
        .1;
    let block = section
        .split_once("```sql\n")
        .expect("the section has a sql block")
        .1;
    block.split_once("```").expect("the sql block ends").0
}

/// `sql` with the role names of the docs made this test's own, and the database `app`
/// made this test's database.
fn substitute(sql: &str, db: &str) -> String {
    let unknown = GROUPS.iter().fold(sql.to_owned(), |rest, group| {
        rest.replace(&format!("skiplock_{group}"), "")
    });
    assert!(
        !unknown.contains("skiplock_"),
        "a role name the test does not replace:\n{sql}"
    );
    let mut out = sql.replace(" DATABASE app ", &format!(" DATABASE \"{db}\" "));
    for group in GROUPS {
        out = out.replace(&format!("skiplock_{group}"), &format!("{db}_{group}"));
    }
    out
}

/// A test's database with the roles of the docs, a login in each, and a pool per login.
struct Roles {
    /// Dropped before the roles are (a role that holds privileges cannot be dropped).
    db: Option<TestDb>,
    name: String,
    /// The database's owner (the server's superuser): fixtures and checks.
    owner: PgPool,
    migrator: PgPool,
    worker: PgPool,
    enqueuer: PgPool,
    reader: PgPool,
    operator: PgPool,
}

impl Roles {
    /// A fresh database whose `skiplock` schema is made as the docs say: the administrator's
    /// block, `skiplock::migrate` by the migrator's login, the functions applied once more
    /// as a release that changes them would, then docs/roles.sql by the same login.
    async fn new() -> Roles {
        let db = test_db().await;
        let name = db.name.clone();
        let owner = db.pool.clone();
        // test_db() migrated as the superuser; the docs' setup starts from no schema.
        owner
            .execute("DROP SCHEMA skiplock CASCADE")
            .await
            .expect("drop the superuser's schema");
        let mut roles = Roles {
            name: name.clone(),
            owner: owner.clone(),
            migrator: owner.clone(),
            worker: owner.clone(),
            enqueuer: owner.clone(),
            reader: owner.clone(),
            operator: owner.clone(),
            db: Some(db),
        };
        sqlx::raw_sql(AssertSqlSafe(substitute(admin_block(), &name)))
            .execute(&owner)
            .await
            .expect("the administrator's block of docs/operating.md");
        // The logins, as the docs make them.
        for group in GROUPS {
            let login = format!("{name}_{group}_login");
            owner
                .execute(AssertSqlSafe(format!(
                    "CREATE ROLE \"{login}\" LOGIN IN ROLE \"{name}_{group}\""
                )))
                .await
                .unwrap();
        }
        owner
            .execute(AssertSqlSafe(format!(
                "ALTER ROLE \"{name}_migrator_login\" SET role = '{name}_migrator'"
            )))
            .await
            .unwrap();
        let url = roles.db.as_ref().unwrap().url.clone();
        let login = |group: &str| {
            let options = PgConnectOptions::from_str(&url)
                .unwrap()
                .username(&format!("{name}_{group}_login"));
            PgPoolOptions::new()
                .max_connections(8)
                .connect_lazy_with(options)
        };
        roles.migrator = login("migrator");
        roles.worker = login("worker");
        roles.enqueuer = login("enqueuer");
        roles.reader = login("reader");
        roles.operator = login("operator");

        skiplock::migrate(&roles.migrator)
            .await
            .expect("the migrator migrates a fresh schema it owns");
        // A release whose functions changed: migrate applies migrations/functions/ again, replacing
        // every function, trigger and view the migrator owns.
        owner
            .execute("UPDATE skiplock.schema_functions SET md5 = 'an older release'")
            .await
            .unwrap();
        skiplock::migrate(&roles.migrator)
            .await
            .expect("the migrator applies changed functions");
        let md5_applied: bool =
            sqlx::query_scalar("SELECT md5 <> 'an older release' FROM skiplock.schema_functions")
                .fetch_one(&owner)
                .await
                .unwrap();
        assert!(
            md5_applied,
            "the second migrate applied the functions again"
        );
        sqlx::raw_sql(AssertSqlSafe(substitute(ROLES_SQL, &name)))
            .execute(&roles.migrator)
            .await
            .expect("docs/roles.sql, run by the migrator");
        roles
    }

    /// Runs `sql` as `pool` and expects 42501; then runs it as the owner in a transaction
    /// rolled back and expects it to work.
    async fn denied(&self, pool: &PgPool, who: &str, sql: &str) {
        let mut conn = pool.acquire().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        let result = sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&mut *tx)
            .await;
        tx.rollback().await.unwrap();
        assert_denied(result.map(|_| ()).map_err(skiplock::Error::from), who, sql);
        let mut conn = self.owner.acquire().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("the owner cannot run `{sql}` either: {e}"));
        tx.rollback().await.unwrap();
    }

    /// Runs `sql` as `pool` and expects it to work.
    async fn allowed(&self, pool: &PgPool, who: &str, sql: &str) {
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(pool)
            .await
            .unwrap_or_else(|e| panic!("{who} cannot run `{sql}`: {e}"));
    }

    /// A queued job of kind `record`, written by the owner.
    async fn queued(&self, queue: &str) -> i64 {
        sqlx::query_scalar(
            "INSERT INTO skiplock.jobs (kind, args, queue) VALUES ('record', '{\"n\": 0}', $1)
             RETURNING id",
        )
        .bind(queue)
        .fetch_one(&self.owner)
        .await
        .unwrap()
    }

    /// A job in `state` (finished long ago if finished), written by the owner.
    async fn job_in(&self, state: &str) -> i64 {
        sqlx::query_scalar(
            "INSERT INTO skiplock.jobs (kind, args, state, attempt, max_attempts, claim_token,
                                        claimed_by, heartbeat_at, finished_at)
             SELECT 'record', '{\"n\": 0}', s, 1, 1,
                    CASE WHEN s = 'running' THEN gen_random_uuid() END,
                    CASE WHEN s = 'running' THEN 'elsewhere' END,
                    CASE WHEN s = 'running' THEN now() END,
                    CASE WHEN s IN ('succeeded', 'dead', 'cancelled')
                         THEN now() - interval '30 days' END
             FROM (SELECT $1::skiplock.job_state AS s) x
             RETURNING id",
        )
        .bind(state)
        .fetch_one(&self.owner)
        .await
        .unwrap()
    }

    async fn exists(&self, id: i64) -> bool {
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM skiplock.jobs WHERE id = $1)")
            .bind(id)
            .fetch_one(&self.owner)
            .await
            .unwrap()
    }

    /// The claim token of a running job.
    async fn token_of(&self, id: i64) -> uuid::Uuid {
        sqlx::query_scalar("SELECT claim_token FROM skiplock.jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&self.owner)
            .await
            .unwrap()
    }
}

impl Drop for Roles {
    /// Drops the database, then the roles (logins first), on a thread of its own like
    /// [`TestDb`]'s drop. Errors are ignored: this is cleanup.
    fn drop(&mut self) {
        drop(self.db.take());
        let name = self.name.clone();
        let admin_url = server_url().to_owned();
        let dropped = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                let Ok(mut admin) = PgConnection::connect(&admin_url).await else {
                    return;
                };
                for group in GROUPS {
                    for role in [format!("{name}_{group}_login"), format!("{name}_{group}")] {
                        let sql = format!("DROP ROLE IF EXISTS \"{role}\"");
                        if let Err(e) = admin.execute(AssertSqlSafe(sql)).await {
                            eprintln!("roles.rs: could not drop role {role}: {e}");
                        }
                    }
                }
                let _ = admin.close().await;
            });
        });
        let _ = dropped.join();
    }
}

/// Expects `result` to be a refusal with SQLSTATE 42501.
fn assert_denied<T: std::fmt::Debug>(result: skiplock::Result<T>, who: &str, what: &str) {
    match result {
        Err(skiplock::Error::Database(sqlx::Error::Database(e)))
            if e.code().as_deref() == Some("42501") => {}
        other => panic!("{who} was not refused `{what}` with 42501: {other:?}"),
    }
}

#[tokio::test]
async fn the_migrator_owns_every_object_and_its_default_privileges_cover_later_ones() {
    let roles = Roles::new().await;
    let name = &roles.name;
    // Everything the two migrations made belongs to the group, not to the login that ran
    // them (ALTER ROLE … SET role): another deploy login can migrate next time.
    let foreign: Vec<String> = sqlx::query_scalar(
        "SELECT format('%s %s owned by %s', kind, obj, owner) FROM (
             SELECT 'relation' AS kind, c.relname::text AS obj, c.relowner::regrole::text AS owner
             FROM pg_class c WHERE c.relnamespace = 'skiplock'::regnamespace
             UNION ALL
             SELECT 'function', p.oid::regprocedure::text, p.proowner::regrole::text
             FROM pg_proc p WHERE p.pronamespace = 'skiplock'::regnamespace
             UNION ALL
             SELECT 'type', t.typname::text, t.typowner::regrole::text
             FROM pg_type t WHERE t.typnamespace = 'skiplock'::regnamespace
             UNION ALL
             SELECT 'schema', n.nspname::text, n.nspowner::regrole::text
             FROM pg_namespace n WHERE n.nspname = 'skiplock'
         ) o WHERE owner <> $1",
    )
    .bind(format!("{name}_migrator"))
    .fetch_all(&roles.owner)
    .await
    .unwrap();
    assert!(foreign.is_empty(), "not owned by the migrator: {foreign:?}");

    // A later release's new table and function: readable and callable before roles.sql
    // runs again, by the roles the default privileges name, and by no other.
    roles
        .allowed(
            &roles.migrator,
            "the migrator",
            "CREATE TABLE skiplock.later (x int);
             CREATE FUNCTION skiplock.later_fn() RETURNS int LANGUAGE sql AS 'SELECT 1';",
        )
        .await;
    for (pool, who) in [(&roles.reader, "reader"), (&roles.operator, "operator")] {
        roles
            .allowed(pool, who, "SELECT x FROM skiplock.later")
            .await;
    }
    for (pool, who) in [
        (&roles.worker, "worker"),
        (&roles.enqueuer, "enqueuer"),
        (&roles.reader, "reader"),
    ] {
        roles.allowed(pool, who, "SELECT skiplock.later_fn()").await;
    }
    roles
        .denied(&roles.enqueuer, "enqueuer", "SELECT x FROM skiplock.later")
        .await;
    roles
        .denied(
            &roles.reader,
            "reader",
            "INSERT INTO skiplock.later VALUES (1)",
        )
        .await;
    // With EXECUTE revoked from PUBLIC (a hardened database), the explicit grants keep
    // the roles working; the role that has neither is refused.
    roles
        .allowed(
            &roles.migrator,
            "the migrator",
            "REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA skiplock FROM PUBLIC",
        )
        .await;
    roles
        .allowed(
            &roles.enqueuer,
            "enqueuer",
            "SELECT skiplock.enqueue('record')",
        )
        .await;
    let public_execute: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_proc p,
                aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
         WHERE p.pronamespace = 'skiplock'::regnamespace
           AND a.grantee = 0 AND a.privilege_type = 'EXECUTE'",
    )
    .fetch_one(&roles.owner)
    .await
    .unwrap();
    assert_eq!(
        public_execute, 0,
        "PUBLIC may no longer execute skiplock's functions"
    );
    roles
        .allowed(
            &roles.worker,
            "worker",
            "SELECT * FROM skiplock.claim('default', 10, 'w'); SELECT * FROM skiplock.maintain()",
        )
        .await;
    roles
        .allowed(&roles.reader, "reader", "SELECT * FROM skiplock.stats")
        .await;
    assert!(skiplock::retry(&roles.operator, JobId(1)).await.is_ok());

    // Outside its schema the migrator is nobody: no roles, no other schema's tables.
    roles
        .allowed(
            &roles.owner,
            "the owner",
            "CREATE TABLE public.app_secrets (secret text)",
        )
        .await;
    for (pool, who) in [
        (&roles.migrator, "migrator"),
        (&roles.worker, "worker"),
        (&roles.enqueuer, "enqueuer"),
        (&roles.reader, "reader"),
        (&roles.operator, "operator"),
    ] {
        roles
            .denied(pool, who, "SELECT secret FROM public.app_secrets")
            .await;
    }
    roles
        .denied(&roles.migrator, "migrator", "CREATE ROLE someone_else")
        .await;
}

#[tokio::test]
async fn a_worker_drains_lanes_and_dependants_reaps_prunes_and_runs_cron() {
    let roles = Roles::new().await;
    // The application enqueues (as the enqueuer): a lane of three, a parent and its child.
    let lane = EnqueueOptions::new().ordering_key("lane-1");
    let mut expected = common::ids(
        skiplock::enqueue_many(&roles.enqueuer, &vec![Record { n: 1 }; 3], lane)
            .await
            .unwrap(),
    );
    let parent = skiplock::enqueue(&roles.enqueuer, &Record { n: 2 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let child = skiplock::enqueue(
        &roles.enqueuer,
        &Record { n: 3 },
        EnqueueOptions::new().depends_on([parent]),
    )
    .await
    .unwrap()
    .id;
    assert_eq!(state_of(&roles.owner, child.0).await, JobState::Waiting);
    expected.extend([parent, child]);
    // A claim whose holder vanished (for the reaper) and finished jobs past their
    // retention, a dead one among them (for the pruner, whose delete of a job that had not
    // succeeded marks its dependency edges).
    let ghost = roles.job_in("running").await;
    sqlx::query(
        "UPDATE skiplock.jobs SET heartbeat_at = now() - interval '1 hour', max_attempts = 5
         WHERE id = $1",
    )
    .bind(ghost)
    .execute(&roles.owner)
    .await
    .unwrap();
    let dead = roles.job_in("dead").await;
    let old_succeeded = roles.job_in("succeeded").await;

    let recorder = Recorder::default();
    let worker = Worker::builder(roles.worker.clone())
        .data(recorder.clone())
        .register::<Record>()
        .poll_interval(Duration::from_millis(100))
        // Stale after a minute: the ghost's heartbeat is an hour old, while no pause of a
        // loaded machine makes this worker's own live claims stale (with 2 s, a live claim
        // reaped would run twice, and a lane job run twice breaks the lane order checked
        // below).
        .heartbeat(Duration::from_millis(100), Duration::from_secs(60))
        .reap_interval(Duration::from_millis(100))
        .prune_interval(Some(Duration::from_millis(100)))
        .retention(Retention {
            succeeded: Duration::ZERO,
            cancelled: Duration::from_secs(24 * 3600),
            dead: Duration::from_secs(24 * 3600),
        })
        .cron(CronSchedule::new("every-second", "* * * * * *", "record").args(json!({"n": 9})))
        .cron_interval(Some(Duration::from_millis(100)))
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());

    wait_for(
        "the enqueued jobs to run",
        Duration::from_secs(60),
        || async {
            let runs = recorder.runs();
            expected.iter().all(|id| runs.contains_key(&id.0))
        },
    )
    .await;
    // The reaper took the ghost's claim back (attempt 1 spent), and after the backoff the
    // worker ran it.
    wait_for(
        "the reaper to take the ghost back",
        Duration::from_secs(60),
        || async { recorder.runs().get(&ghost) == Some(&vec![2]) },
    )
    .await;
    // The pruner deleted every succeeded job (retention zero; the child's dependency edge
    // goes with it) and the old dead one, into the rollup.
    let mut pruned: Vec<i64> = expected.iter().map(|id| id.0).collect();
    pruned.extend([ghost, dead, old_succeeded]);
    wait_for(
        "the pruner to roll the jobs up",
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT NOT EXISTS (SELECT 1 FROM skiplock.jobs WHERE id = ANY($1))
                AND NOT EXISTS (SELECT 1 FROM skiplock.job_dependencies)
                AND (SELECT sum(dead) = 1 AND sum(succeeded) >= $2 FROM skiplock.job_history)",
            )
            .bind(&pruned)
            .bind(pruned.len() as i64 - 1)
            .fetch_one(&roles.owner)
            .await
            .unwrap()
        },
    )
    .await;
    wait_for("a cron job to run", Duration::from_secs(60), || async {
        let cron_job: Option<i64> = sqlx::query_scalar(
            "SELECT last_job_id FROM skiplock.cron_schedules WHERE name = 'every-second'",
        )
        .fetch_one(&roles.owner)
        .await
        .unwrap();
        cron_job.is_some_and(|id| recorder.runs().contains_key(&id))
    })
    .await;
    stop.shutdown();
    let summary = run.await.unwrap().expect("the worker ran to the end");
    assert_eq!(summary.failed, 0, "{summary:?}");
    // Lane order held: each lane job started after the one before it ended.
    let spans = recorder.spans();
    let lane_spans: Vec<(u64, u64)> = expected[..3].iter().map(|id| spans[&id.0][0]).collect();
    assert!(
        lane_spans.windows(2).all(|w| w[0].1 <= w[1].0),
        "lane order: {lane_spans:?}"
    );

    // Nothing more: the operator's and the owner's business.
    let queued = roles.queued("default").await;
    for sql in [
        "SELECT skiplock.pause_queue('default')".to_owned(),
        "INSERT INTO skiplock.queues (name, paused) VALUES ('q', true)".to_owned(),
        "DELETE FROM skiplock.cron_schedules".to_owned(),
        "DELETE FROM skiplock.job_dependencies".to_owned(),
        "INSERT INTO skiplock.schema_migrations (version, name) VALUES (99, 'x')".to_owned(),
        "UPDATE skiplock.schema_functions SET md5 = 'x'".to_owned(),
        "TRUNCATE skiplock.jobs CASCADE".to_owned(),
        "ALTER TABLE skiplock.jobs ADD COLUMN x int".to_owned(),
        "DROP VIEW skiplock.stats".to_owned(),
        "CREATE TABLE skiplock.x (x int)".to_owned(),
        format!("UPDATE skiplock.job_dependencies SET job_id = job_id WHERE job_id = {queued}"),
    ] {
        roles.denied(&roles.worker, "worker", &sql).await;
    }
}

#[tokio::test]
async fn a_sql_protocol_worker_claims_heartbeats_completes_fails_and_maintains() {
    let roles = Roles::new().await;
    let w = &roles.worker;
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT skiplock.enqueue('record', queue => 'sql', ordering_key => k)
         FROM unnest(ARRAY[NULL, NULL, 'lane', 'lane']) AS k",
    )
    .fetch_all(&roles.enqueuer)
    .await
    .unwrap();
    // The operator limits the queue (running at once and starts per hour): the worker's
    // claim counts running jobs and keeps the queue's start times.
    skiplock::set_queue_limits(
        &roles.operator,
        "sql",
        skiplock::QueueLimits::default()
            .max_running(10)
            .rate(100, std::time::Duration::from_secs(3600)),
    )
    .await
    .unwrap();
    let claimed: Vec<(i64, uuid::Uuid)> = sqlx::query_as(
        "SELECT id, claim_token FROM skiplock.claim('sql', 10, 'sql-worker') ORDER BY id",
    )
    .fetch_all(w)
    .await
    .unwrap();
    assert_eq!(
        claimed.iter().map(|c| c.0).collect::<Vec<_>>(),
        ids[..3],
        "both plain jobs and the lane's head"
    );
    let (held_ids, tokens): (Vec<i64>, Vec<uuid::Uuid>) = claimed.iter().copied().unzip();
    let held: Vec<bool> = sqlx::query_scalar("SELECT held FROM skiplock.heartbeat($1, $2)")
        .bind(&held_ids)
        .bind(&tokens)
        .fetch_all(w)
        .await
        .unwrap();
    assert_eq!(held, [true, true, true]);
    let completed: bool = sqlx::query_scalar("SELECT skiplock.complete($1, $2, '{\"ok\": 1}')")
        .bind(claimed[2].0)
        .bind(claimed[2].1)
        .fetch_one(w)
        .await
        .unwrap();
    assert!(completed);
    assert_eq!(
        state_of(&roles.owner, ids[3]).await,
        JobState::Queued,
        "the lane moved on"
    );
    let failed: String = sqlx::query_scalar("SELECT skiplock.fail($1, $2, 'boom')::text")
        .bind(claimed[0].0)
        .bind(claimed[0].1)
        .fetch_one(w)
        .await
        .unwrap();
    assert_eq!(failed, "queued");
    let released: bool = sqlx::query_scalar("SELECT skiplock.release($1, $2)")
        .bind(claimed[1].0)
        .bind(claimed[1].1)
        .fetch_one(w)
        .await
        .unwrap();
    assert!(released);
    let ghost = roles.job_in("running").await;
    sqlx::query("UPDATE skiplock.jobs SET heartbeat_at = now() - interval '1 hour' WHERE id = $1")
        .bind(ghost)
        .execute(&roles.owner)
        .await
        .unwrap();
    let reaped: i64 = sqlx::query_scalar("SELECT reaped FROM skiplock.maintain('1 second')")
        .fetch_one(w)
        .await
        .unwrap();
    assert_eq!(reaped, 1);
    assert_eq!(
        state_of(&roles.owner, ghost).await,
        JobState::Dead,
        "its one attempt was spent"
    );
}

#[tokio::test]
async fn an_enqueuer_enqueues_every_way_and_does_nothing_else() {
    let roles = Roles::new().await;
    let e = &roles.enqueuer;
    // The Rust API, plain and on the per-job path (lanes, unique keys, dependencies), in
    // the application's own transaction.
    let mut tx = e.begin().await.unwrap();
    let plain = skiplock::enqueue(&mut *tx, &Record { n: 1 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    tx.commit().await.unwrap();
    let in_lane = skiplock::enqueue_many(
        e,
        &vec![Record { n: 2 }; 2],
        EnqueueOptions::new().ordering_key("lane"),
    )
    .await
    .unwrap();
    assert_eq!(
        state_of(&roles.owner, in_lane[1].id.0).await,
        JobState::Waiting
    );
    for policy in [
        UniquePolicy::Skip,
        UniquePolicy::Replace,
        UniquePolicy::Merge,
    ] {
        let key = format!("key-{}", policy.as_str());
        let options = EnqueueOptions::new().unique_key(key.clone(), policy);
        let first = skiplock::enqueue(e, &Record { n: 3 }, options.clone())
            .await
            .unwrap()
            .id;
        let second = skiplock::enqueue(e, &Record { n: 4 }, options)
            .await
            .unwrap()
            .id;
        assert_eq!(first, second, "{key}: one pending job");
    }
    let child = skiplock::enqueue(
        e,
        &Record { n: 5 },
        EnqueueOptions::new().depends_on([plain]),
    )
    .await
    .unwrap()
    .id;
    assert_eq!(state_of(&roles.owner, child.0).await, JobState::Waiting);
    // A parent that finished (looked up among the finished jobs by id), dated by hand
    // before its id was handed out: the days from its id's day, then the others.
    for (parent_state, child_state) in [
        ("succeeded", JobState::Queued),
        ("dead", JobState::Cancelled),
    ] {
        let parent = roles.job_in(parent_state).await;
        let child = skiplock::enqueue(
            e,
            &Record { n: 6 },
            EnqueueOptions::new().depends_on([JobId(parent)]),
        )
        .await
        .unwrap_or_else(|err| panic!("a child of a parent that ended {parent_state}: {err}"))
        .id;
        assert_eq!(state_of(&roles.owner, child.0).await, child_state);
    }
    // Jobs with a concurrency key, in a queue with fair queueing (the second waits its
    // turn) and without.
    skiplock::set_queue_limits(
        &roles.owner,
        "fair",
        QueueLimits::default().key_claimable(1),
    )
    .await
    .unwrap();
    for queue in ["fair", "default"] {
        let keyed = skiplock::enqueue_many(
            e,
            &vec![Record { n: 8 }; 2],
            EnqueueOptions::new().queue(queue).concurrency_key("tenant"),
        )
        .await
        .unwrap();
        assert_eq!(
            state_of(&roles.owner, keyed[1].id.0).await,
            if queue == "fair" {
                JobState::Waiting
            } else {
                JobState::Queued
            },
            "{queue}"
        );
    }
    // SQL: the function, a plain INSERT (with a lane and a unique key: the trigger's path).
    for sql in [
        "SELECT skiplock.enqueue('record', '{\"n\": 6}')",
        "SELECT skiplock.enqueue('record', unique_key => 'k', on_conflict => 'merge')",
        "SELECT * FROM skiplock.enqueue_job('record', unique_key => 'k', on_conflict => 'merge')",
        "INSERT INTO skiplock.jobs (kind, args) VALUES ('record', '{\"n\": 7}')",
        "INSERT INTO skiplock.jobs (kind, ordering_key) VALUES ('record', 'lane'), ('record', 'lane')",
        "INSERT INTO skiplock.jobs (kind, unique_key, unique_policy) VALUES ('record', 'k', 'replace')",
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key) VALUES ('record', 'fair', 't')",
        "INSERT INTO skiplock.jobs (kind) VALUES ('record') RETURNING id, state",
        // What it may read: the columns enqueue needs.
        "SELECT id, queue, priority, scheduled_at, state, ordering_key, unique_key,
                unique_policy, args FROM skiplock.jobs",
        "SELECT version FROM skiplock.schema_migrations",
    ] {
        roles.allowed(e, "enqueuer", sql).await;
    }
    skiplock::check_schema(e)
        .await
        .expect("the enqueuer checks the schema version");
    // It waits for the outcome of what it enqueued (the job marked, then woken).
    let awaited = skiplock::enqueue(e, &Record { n: 8 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let waiter = {
        let e = e.clone();
        tokio::spawn(async move { skiplock::wait_for(&e, awaited, Duration::from_secs(60)).await })
    };
    wait_for(
        "the enqueuer's wait to mark its job",
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, Option<bool>>("SELECT awaited FROM skiplock.jobs WHERE id = $1")
                .bind(awaited.0)
                .fetch_one(&roles.owner)
                .await
                .unwrap()
                == Some(true)
        },
    )
    .await;
    assert!(skiplock::cancel(&roles.operator, awaited).await.unwrap());
    let outcome = waiter
        .await
        .unwrap()
        .expect("the enqueuer waits for an outcome");
    assert_eq!(outcome.state, JobState::Cancelled);
    assert_eq!(outcome.last_error.as_deref(), Some("cancelled by operator"));

    // Nothing more.
    let queued = roles.queued("default").await;
    let running = roles.job_in("running").await;
    let token = roles.token_of(running).await;
    let dead = roles.job_in("dead").await;
    assert_denied(
        skiplock::cancel(e, JobId(queued)).await,
        "enqueuer",
        "skiplock::cancel",
    );
    assert_denied(
        skiplock::retry(e, JobId(dead)).await,
        "enqueuer",
        "skiplock::retry",
    );
    for sql in [
        // claim and outcomes
        "SELECT * FROM skiplock.claim('default', 1, 'intruder')".to_owned(),
        format!("SELECT skiplock.complete({running}, '{token}')"),
        format!("SELECT skiplock.fail({running}, '{token}', 'x')"),
        "SELECT * FROM skiplock.maintain('1 second')".to_owned(),
        // state, other columns, deletes
        format!("UPDATE skiplock.jobs SET state = 'succeeded' WHERE id = {queued}"),
        format!("UPDATE skiplock.jobs SET priority = -100 WHERE id = {queued}"),
        format!("UPDATE skiplock.jobs SET scheduled_at = now() WHERE id = {queued}"),
        format!("DELETE FROM skiplock.jobs WHERE id = {dead}"),
        format!("SELECT skiplock.cancel_job({queued})"),
        format!("SELECT skiplock.retry_job({dead})"),
        "SELECT skiplock.pause_queue('default')".to_owned(),
        // reads beyond what enqueue needs
        "SELECT kind FROM skiplock.jobs".to_owned(),
        "SELECT claim_token FROM skiplock.jobs".to_owned(),
        "SELECT errors FROM skiplock.jobs".to_owned(),
        "SELECT progress FROM skiplock.jobs".to_owned(),
        format!("UPDATE skiplock.jobs SET output = '1' WHERE id = {queued}"),
        "SELECT * FROM skiplock.jobs".to_owned(),
        "SELECT * FROM skiplock.stats".to_owned(),
        "SELECT * FROM skiplock.dead_jobs".to_owned(),
        "SELECT * FROM skiplock.job_dependencies".to_owned(),
        "SELECT * FROM skiplock.cron_schedules".to_owned(),
        "SELECT * FROM skiplock.job_history".to_owned(),
        "SELECT * FROM skiplock.queues".to_owned(),
        "SELECT nextval('skiplock.jobs_id_seq')".to_owned(),
        "INSERT INTO skiplock.cron_schedules (name, expression, kind) VALUES ('x', '* * * * *', 'record')"
            .to_owned(),
    ] {
        roles.denied(e, "enqueuer", &sql).await;
    }
}

#[tokio::test]
async fn a_reader_reads_everything_and_writes_nothing() {
    let roles = Roles::new().await;
    let r = &roles.reader;
    let queued = roles.queued("default").await;
    let dead = roles.job_in("dead").await;
    let running = roles.job_in("running").await;
    let token = roles.token_of(running).await;
    for sql in [
        "SELECT * FROM skiplock.jobs",
        "SELECT * FROM skiplock.job_dependencies",
        "SELECT * FROM skiplock.queues",
        "SELECT * FROM skiplock.cron_schedules",
        "SELECT * FROM skiplock.job_history",
        "SELECT * FROM skiplock.schema_functions",
        "SELECT * FROM skiplock.stats",
        "SELECT * FROM skiplock.queue_counts",
        "SELECT * FROM skiplock.queue_lag",
        "SELECT * FROM skiplock.throughput",
        "SELECT * FROM skiplock.dead_jobs",
    ] {
        roles.allowed(r, "reader", sql).await;
    }
    // What the dashboard and `skiplock jobs/show/stats` call.
    skiplock::check_schema(r).await.unwrap();
    let job = skiplock::job(r, JobId(dead))
        .await
        .unwrap()
        .expect("the job");
    assert_eq!(job.id, dead);
    skiplock::stats::stats(r).await.unwrap();
    skiplock::admin::counts_by_state(r).await.unwrap();
    skiplock::unstable_cli::dashboard_workers(r).await.unwrap();
    skiplock::unstable_cli::dashboard_ended_counts(r)
        .await
        .unwrap();
    skiplock::admin::job_dependencies(r, JobId(dead))
        .await
        .unwrap();

    assert_denied(
        skiplock::enqueue(r, &Record { n: 1 }, EnqueueOptions::default()).await,
        "reader",
        "skiplock::enqueue",
    );
    assert_denied(
        skiplock::cancel(r, JobId(queued)).await,
        "reader",
        "skiplock::cancel",
    );
    assert_denied(
        skiplock::retry(r, JobId(dead)).await,
        "reader",
        "skiplock::retry",
    );
    assert_denied(
        skiplock::pause_queue(r, "default").await,
        "reader",
        "skiplock::pause_queue",
    );
    for sql in [
        "SELECT * FROM skiplock.claim('default', 1, 'intruder')".to_owned(),
        format!("SELECT skiplock.complete({running}, '{token}')"),
        format!("SELECT skiplock.heartbeat(ARRAY[{running}::bigint], ARRAY['{token}'::uuid])"),
        "SELECT skiplock.enqueue('record')".to_owned(),
        "INSERT INTO skiplock.jobs (kind) VALUES ('record')".to_owned(),
        format!("UPDATE skiplock.jobs SET args = '{{}}' WHERE id = {queued}"),
        format!("DELETE FROM skiplock.jobs WHERE id = {dead}"),
        "SELECT * FROM skiplock.maintain('1 second')".to_owned(),
        // A row lock would hold claims back.
        format!("SELECT 1 FROM skiplock.jobs WHERE id = {queued} FOR UPDATE"),
        "LOCK TABLE skiplock.jobs IN EXCLUSIVE MODE".to_owned(),
        "UPDATE skiplock.queues SET paused = true".to_owned(),
        "DELETE FROM skiplock.job_history".to_owned(),
        "UPDATE skiplock.cron_schedules SET enabled = false".to_owned(),
        "SELECT nextval('skiplock.jobs_id_seq')".to_owned(),
    ] {
        roles.denied(r, "reader", &sql).await;
    }
}

#[tokio::test]
async fn an_operator_retries_cancels_pauses_and_prunes_but_never_claims() {
    let roles = Roles::new().await;
    let o = &roles.operator;
    let dead = roles.job_in("dead").await;
    let dead_too = roles.job_in("dead").await;
    let queued = roles.queued("default").await;
    let running = roles.job_in("running").await;
    let lane: Vec<i64> = sqlx::query_scalar(
        "SELECT skiplock.enqueue('record', ordering_key => 'lane') FROM generate_series(1, 2)",
    )
    .fetch_all(&roles.owner)
    .await
    .unwrap();

    assert!(skiplock::retry(o, JobId(dead)).await.unwrap());
    assert_eq!(state_of(&roles.owner, dead).await, JobState::Queued);
    let retried = skiplock::retry_dead(o, None).await.unwrap();
    assert_eq!(retried, [JobId(dead_too)]);
    assert!(skiplock::cancel(o, JobId(queued)).await.unwrap());
    assert_eq!(state_of(&roles.owner, queued).await, JobState::Cancelled);
    assert!(skiplock::cancel(o, JobId(running)).await.unwrap());
    assert_eq!(state_of(&roles.owner, running).await, JobState::Cancelled);
    assert!(skiplock::cancel(o, JobId(lane[0])).await.unwrap());
    assert_eq!(
        state_of(&roles.owner, lane[1]).await,
        JobState::Queued,
        "the lane moved on"
    );
    skiplock::pause_queue(o, "default").await.unwrap();
    skiplock::resume_queue(o, "default").await.unwrap();
    skiplock::set_queue_limits(
        o,
        "default",
        skiplock::QueueLimits::default().max_running(3),
    )
    .await
    .unwrap();
    assert_eq!(skiplock::queue_limits(o).await.unwrap().len(), 1);
    // A per-key limit raised over held jobs lets them go (the queues' trigger, as the
    // operator): one of the key runs, two are held, then all three may run.
    sqlx::raw_sql(
        "SELECT skiplock.set_queue_limits('keyed', NULL, key_max_running => 1);
         SELECT skiplock.enqueue('record', queue => 'keyed', concurrency_key => 'k')
         FROM generate_series(1, 3);",
    )
    .execute(&roles.owner)
    .await
    .unwrap();
    sqlx::query("SELECT * FROM skiplock.claim('keyed', 5, 'w')")
        .execute(&roles.owner)
        .await
        .unwrap();
    skiplock::set_queue_limits(
        o,
        "keyed",
        skiplock::QueueLimits::default().key_max_running(3),
    )
    .await
    .unwrap();
    let keyed: Vec<String> = sqlx::query_scalar(
        "SELECT state::text FROM skiplock.jobs WHERE queue = 'keyed' ORDER BY id",
    )
    .fetch_all(&roles.owner)
    .await
    .unwrap();
    assert_eq!(keyed, ["running", "queued", "queued"], "the held jobs went");
    assert_eq!(
        skiplock::admin::why_not_running(o, JobId(lane[1]))
            .await
            .unwrap()
            .as_deref(),
        Some(
            "runnable: the next free worker of queue 'default' takes it in claim order (priority, scheduled_at, id)"
        )
    );
    roles
        .allowed(o, "operator", "SELECT skiplock.pause_queue('mail')")
        .await;
    skiplock::cron::upsert(o, &CronSchedule::new("nightly", "0 3 * * *", "record"))
        .await
        .unwrap();
    assert!(skiplock::cron::remove(o, "nightly").await.unwrap());
    // Prune (as `skiplock prune` does, with the rollup) and delete one job.
    let old = roles.job_in("succeeded").await;
    let hour_ms = 3_600_000;
    let pruned =
        skiplock::unstable_cli::jobs_prune_finished_rolled_up(o, hour_ms, hour_ms, hour_ms, 1000)
            .await
            .unwrap();
    assert_eq!(pruned, 1, "the old succeeded job");
    assert!(!roles.exists(old).await);
    assert!(
        skiplock::unstable_cli::jobs_delete_rolled_up(o, JobId(queued))
            .await
            .unwrap()
    );
    skiplock::check_schema(o).await.unwrap();

    let queued = roles.queued("default").await;
    let running = roles.job_in("running").await;
    let token = roles.token_of(running).await;
    assert_denied(
        skiplock::enqueue(o, &Record { n: 1 }, EnqueueOptions::default()).await,
        "operator",
        "skiplock::enqueue",
    );
    for sql in [
        "SELECT * FROM skiplock.claim('default', 1, 'intruder')".to_owned(),
        "SELECT * FROM skiplock.internal_claim_batch('default', NULL, 1, 'intruder')".to_owned(),
        format!("UPDATE skiplock.jobs SET attempt = attempt + 1 WHERE id = {queued}"),
        format!("UPDATE skiplock.jobs SET claimed_by = 'me' WHERE id = {running}"),
        format!("UPDATE skiplock.jobs SET kind = 'other' WHERE id = {queued}"),
        format!("UPDATE skiplock.jobs SET queue = 'other' WHERE id = {queued}"),
        format!("UPDATE skiplock.jobs SET priority = -100 WHERE id = {queued}"),
        format!("UPDATE skiplock.jobs SET ordering_key = 'x' WHERE id = {queued}"),
        format!("SELECT skiplock.complete({running}, '{token}', '{{\"forged\": true}}')"),
        "SELECT skiplock.enqueue('record')".to_owned(),
        "INSERT INTO skiplock.jobs (kind) VALUES ('record')".to_owned(),
        format!(
            "INSERT INTO skiplock.job_dependencies (job_id, parent_id) VALUES ({queued}, {running})"
        ),
        "SELECT nextval('skiplock.jobs_id_seq')".to_owned(),
        "TRUNCATE skiplock.jobs CASCADE".to_owned(),
        "UPDATE skiplock.schema_functions SET md5 = 'x'".to_owned(),
    ] {
        roles.denied(o, "operator", &sql).await;
    }
}
