//! skiplock behind PgBouncer in transaction-pooling mode, as managed Postgres runs it.
//!
//! Each test starts the distribution's PgBouncer (1.18 on Debian 12, which does not track
//! named prepared statements across server connections) on a free port, in front of its
//! own test database, with a server pool (3 connections) far smaller than the number of
//! clients, so that server connections really are passed from client to client between
//! transactions. Without PgBouncer mode (`WorkerBuilder::pgbouncer`, `--pgbouncer`, and
//! `skiplock::PgBouncer` for an application's own calls) the same runs fail with "prepared
//! statement sqlx_s_N does not exist / already exists" and "unnamed prepared statement does
//! not exist" (SQLSTATE 26000, 42P05).

#![cfg(feature = "cli")]

mod common;
#[path = "model_support/logs.rs"]
mod logs;
#[path = "common/pgbouncer.rs"]
mod pgbouncer;
#[allow(dead_code)]
#[path = "dashboard/support.rs"]
mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use skiplock::{
    EnqueueOptions, Job, JobContext, JobError, JobFilter, JobId, JobState, NewJob, Worker,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

use common::fixtures::state_of;
use common::{TestDb, test_db};
use pgbouncer::PgBouncer;
use support::Dashboard;

/// Server connections PgBouncer keeps per database and user: far fewer than the clients.
const SERVER_POOL_SIZE: u32 = 3;

/// PgBouncer in front of `db`'s server, with [`SERVER_POOL_SIZE`] server connections;
/// `None` (after [`common::missing_tool`]) when it is not installed.
async fn bouncer(db: &TestDb) -> Option<Bouncer> {
    bouncer_of(db, SERVER_POOL_SIZE).await
}

/// PgBouncer in front of `db`'s server, with `server_pool_size` server connections.
async fn bouncer_of(db: &TestDb, server_pool_size: u32) -> Option<Bouncer> {
    if !PgBouncer::installed() {
        common::missing_tool(
            "the PgBouncer test",
            "pgbouncer",
            "apt-get install pgbouncer (.ci/run does)",
        );
        return None;
    }
    let direct: PgConnectOptions = db.url().parse().expect("test database URL");
    let pgbouncer = PgBouncer::start(&direct, server_pool_size).await;
    Some(Bouncer {
        options: pgbouncer.options(&direct),
        url: format!(
            "postgres://{}@127.0.0.1:{}/{}",
            direct.get_username(),
            pgbouncer.port,
            db.name
        ),
        _pgbouncer: pgbouncer,
    })
}

/// The test database through PgBouncer.
struct Bouncer {
    options: PgConnectOptions,
    url: String,
    _pgbouncer: PgBouncer,
}

impl Bouncer {
    /// A pool of `max` connections to the test database through PgBouncer.
    fn pool(&self, max: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max)
            .connect_lazy_with(self.options.clone())
    }
}

/// Counts its runs per job id.
#[derive(Serialize, Deserialize)]
struct Counted {
    n: u32,
}

type Runs = Arc<Mutex<HashMap<i64, u32>>>;

impl Job for Counted {
    const KIND: &'static str = "counted";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let runs = ctx.data::<Runs>().expect("runs map");
        *runs.lock().unwrap().entry(ctx.id().0).or_default() += 1;
        Ok(())
    }
}

/// Lines the worker logged at WARN or above that report a failed statement.
fn failed_statements() -> Vec<String> {
    logs::take()
        .into_iter()
        .filter(|line| logs::is_defect(line) || line.contains("prepared statement"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_drains_through_pgbouncer_in_transaction_mode() {
    logs::install();
    let db = test_db().await;
    let Some(bouncer) = bouncer(&db).await else {
        return;
    };
    let pool = bouncer.pool(40);
    let through = skiplock::PgBouncer(&pool);

    // Rust enqueue through PgBouncer: one batch, and single jobs from many clients at once.
    const BATCH: u32 = 3000;
    const SINGLE: u32 = 200;
    let batch: Vec<Counted> = (0..BATCH).map(|n| Counted { n }).collect();
    let mut ids = common::ids(
        skiplock::enqueue_many(through, &batch, Default::default())
            .await
            .expect("enqueue a batch through PgBouncer"),
    );
    let singles = (0..SINGLE).map(|n| {
        let pool = pool.clone();
        tokio::spawn(async move {
            skiplock::enqueue(
                skiplock::PgBouncer(&pool),
                &Counted { n: BATCH + n },
                EnqueueOptions::default(),
            )
            .await
        })
    });
    for single in singles {
        ids.push(
            single
                .await
                .unwrap()
                .expect("enqueue one job through PgBouncer")
                .id,
        );
    }
    // Inside the application's own transactions (docs/operating.md).
    const IN_TRANSACTION: u32 = 20;
    let in_transactions = (0..IN_TRANSACTION).map(|n| {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut tx = pool.begin().await.expect("begin through PgBouncer");
            let job = Counted {
                n: BATCH + SINGLE + n,
            };
            let id = skiplock::enqueue(
                skiplock::PgBouncer(&mut *tx),
                &job,
                EnqueueOptions::default(),
            )
            .await
            .expect("enqueue in a transaction through PgBouncer")
            .id;
            tx.commit().await.expect("commit through PgBouncer");
            id
        })
    });
    for job in in_transactions {
        ids.push(job.await.unwrap());
    }
    let total = (BATCH + SINGLE + IN_TRANSACTION) as usize;
    assert_eq!(ids.len(), total);

    // Concurrency far above PgBouncer's server pool; short heartbeats so that beats run
    // through PgBouncer during the drain too.
    let runs: Runs = Arc::default();
    let summary = Worker::builder(pool)
        .pgbouncer(true)
        .register::<Counted>()
        .concurrency(64)
        .heartbeat(Duration::from_millis(50), Duration::from_secs(30))
        .poll_interval(Duration::from_millis(100))
        .data(runs.clone())
        .exit_when_idle(true)
        .build()
        .unwrap()
        .run()
        .await
        .expect("the worker runs through PgBouncer");

    assert_eq!(summary.succeeded as usize, total, "{summary:?}");
    assert_eq!(
        summary.failed + summary.lost + summary.released,
        0,
        "{summary:?}"
    );
    let runs = runs.lock().unwrap().clone();
    for id in &ids {
        assert_eq!(
            runs.get(&id.0),
            Some(&1),
            "job {} ran {:?} times",
            id.0,
            runs.get(&id.0)
        );
    }
    assert_eq!(runs.len(), total);
    let succeeded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state = 'succeeded'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(succeeded as usize, total);
    let failed = failed_statements();
    assert!(
        failed.is_empty(),
        "statements failed through PgBouncer: {failed:#?}"
    );
}

/// What a library user's own pool runs into without [`skiplock::PgBouncer`]: skiplock's
/// statements are named (`sqlx_s_1`, …) and stay on the server connection, where the next
/// client's statement of the same name finds them. sqlx's `statement_cache_capacity(0)` is
/// no way out: it still names each statement, and then never closes it. One server
/// connection, so that the second client meets the first's statement every time.
#[tokio::test]
async fn without_the_wrapper_two_clients_statements_clash_through_pgbouncer() {
    let db = test_db().await;
    for cache_capacity in [None, Some(0)] {
        // A PgBouncer of its own for each case: a fresh server connection.
        let Some(bouncer) = bouncer_of(&db, 1).await else {
            return;
        };
        let options = match cache_capacity {
            Some(capacity) => bouncer.options.clone().statement_cache_capacity(capacity),
            None => bouncer.options.clone(),
        };
        let mut first = PgConnection::connect_with(&options).await.unwrap();
        let mut second = PgConnection::connect_with(&options).await.unwrap();
        skiplock::paused_queues(&mut first)
            .await
            .expect("the first client's statement");
        let clash = skiplock::paused_queues(&mut second)
            .await
            .expect_err("the second client's statement meets the first's");
        assert!(
            clash
                .to_string()
                .contains(r#"prepared statement "sqlx_s_1" already exists"#),
            "statement cache capacity {cache_capacity:?}: {clash}"
        );
    }
}

/// A library user's own pool through PgBouncer, as docs/operating.md ("Behind PgBouncer")
/// shows it: enqueue (typed, many, raw) and the job and queue operations through
/// `skiplock::PgBouncer`, on the pool and inside the application's transactions, from
/// eight clients at once that share one server connection (where a statement left
/// prepared, or an unnamed one split between two clients, fails at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_library_user_enqueues_and_operates_through_pgbouncer() {
    const CLIENTS: i64 = 8;
    let db = test_db().await;
    let Some(bouncer) = bouncer_of(&db, 1).await else {
        return;
    };
    sqlx::query("CREATE TABLE signups (id bigint PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    let pool = bouncer.pool(CLIENTS as u32);
    let clients = (0..CLIENTS).map(|client| {
        let pool = pool.clone();
        let options = bouncer.options.clone();
        tokio::spawn(async move { use_skiplock_through_pgbouncer(&pool, &options, client).await })
    });
    for client in clients {
        client.await.unwrap();
    }
    // A prepared statement would stay named on the server connection: refused.
    let prepared = sqlx::Executor::prepare(
        skiplock::PgBouncer(&pool),
        sqlx::SqlStr::from_static("SELECT 1"),
    )
    .await;
    assert!(prepared.is_err(), "prepare through PgBouncer");
    let (jobs, signups): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM skiplock.jobs), (SELECT count(*) FROM signups)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((jobs, signups), (CLIENTS * 5, CLIENTS));
}

/// One client's share of [`a_library_user_enqueues_and_operates_through_pgbouncer`], in
/// queue `q{client}`.
async fn use_skiplock_through_pgbouncer(pool: &PgPool, options: &PgConnectOptions, client: i64) {
    let through = skiplock::PgBouncer(pool);
    let queue = format!("q{client}");
    let in_queue = || EnqueueOptions::new().queue(queue.clone());
    let state = |id: JobId| async move {
        skiplock::job(through, id)
            .await
            .expect("job")
            .map(|job| job.state)
    };

    // Typed, many and raw, on the pool.
    let typed = skiplock::enqueue(through, &Counted { n: 0 }, in_queue())
        .await
        .expect("enqueue")
        .id;
    let many = common::ids(
        skiplock::enqueue_many(through, &[Counted { n: 1 }, Counted { n: 2 }], in_queue())
            .await
            .expect("enqueue_many"),
    );
    let raw = NewJob::new("counted", serde_json::json!({ "n": 3 })).with_options(in_queue());
    let raw = skiplock::enqueue_raw(through, &[raw])
        .await
        .expect("enqueue_raw")[0]
        .id;

    // In the application's transaction, beside its own row. On a new connection: the
    // first read of a job there looks up skiplock's types, which costs sqlx its unnamed
    // statement (retried in a savepoint, which keeps the transaction usable).
    let mut connection = PgConnection::connect_with(options).await.unwrap();
    let mut tx = connection.begin().await.unwrap();
    sqlx::query("INSERT INTO signups (id) VALUES ($1)")
        .bind(client)
        .persistent(false)
        .execute(&mut *tx)
        .await
        .unwrap();
    let committed = skiplock::enqueue(skiplock::PgBouncer(&mut *tx), &Counted { n: 4 }, in_queue())
        .await
        .expect("enqueue in a transaction")
        .id;
    let seen = skiplock::job(skiplock::PgBouncer(&mut *tx), committed)
        .await
        .expect("job in a transaction");
    assert_eq!(seen.map(|job| job.state), Some(JobState::Queued));
    // A refused enqueue rolls back to its savepoint; the transaction goes on.
    let too_big = NewJob::new("counted", serde_json::json!("x".repeat(1 << 20)));
    let refused = skiplock::enqueue_raw(skiplock::PgBouncer(&mut *tx), &[too_big]).await;
    assert!(
        matches!(refused, Err(skiplock::Error::InvalidJob(_))),
        "{refused:?}"
    );
    tx.commit().await.expect("commit");
    connection.close().await.unwrap();

    // Rolled back: no job.
    let mut tx = pool.begin().await.unwrap();
    let rolled_back =
        skiplock::enqueue(skiplock::PgBouncer(&mut *tx), &Counted { n: 5 }, in_queue())
            .await
            .expect("enqueue in a transaction")
            .id;
    tx.rollback().await.unwrap();
    assert_eq!(state(rolled_back).await, None);

    // The job and queue operations.
    let filter = JobFilter {
        queue: Some(queue.clone()),
        limit: 100,
        ..JobFilter::default()
    };
    let mut listed: Vec<JobId> = skiplock::jobs(through, &filter)
        .await
        .expect("jobs")
        .iter()
        .map(|job| job.id)
        .collect();
    listed.sort();
    assert_eq!(listed, vec![typed, many[0], many[1], raw, committed]);
    assert!(skiplock::cancel(through, typed).await.expect("cancel"));
    assert_eq!(state(typed).await, Some(JobState::Cancelled));
    assert!(skiplock::retry(through, typed).await.expect("retry"));
    assert_eq!(state(typed).await, Some(JobState::Queued));
    skiplock::pause_queue(through, &queue)
        .await
        .expect("pause_queue");
    let paused = skiplock::paused_queues(through)
        .await
        .expect("paused_queues");
    assert!(paused.contains(&queue), "{paused:?}");
    skiplock::resume_queue(through, &queue)
        .await
        .expect("resume_queue");
    let paused = skiplock::paused_queues(through)
        .await
        .expect("paused_queues");
    assert!(!paused.contains(&queue), "{paused:?}");
    // The application's own statement through the same wrapper.
    sqlx::query("UPDATE skiplock.jobs SET state = 'dead', finished_at = now() WHERE id = $1")
        .bind(raw)
        .execute(through)
        .await
        .expect("an UPDATE of the application's");
    assert_eq!(
        skiplock::retry_dead(through, Some(&queue))
            .await
            .expect("retry_dead"),
        vec![raw]
    );
    assert_eq!(
        skiplock::admin::job_state(through, raw)
            .await
            .expect("admin::job_state"),
        Some(JobState::Queued)
    );
    skiplock::admin::counts_by_state(through)
        .await
        .expect("admin::counts_by_state");
    skiplock::stats::stats(through).await.expect("stats");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_behind_pgbouncer_listens_on_its_direct_url() {
    let db = test_db().await;
    let Some(bouncer) = bouncer(&db).await else {
        return;
    };
    let pool = bouncer.pool(8);
    let direct: PgConnectOptions = db.url().parse().unwrap();
    // Polling once an hour: only a notification can start the job in time.
    let worker = Worker::builder(pool.clone())
        .pgbouncer(true)
        .listen_options(direct)
        .register::<Counted>()
        .poll_interval(Duration::from_secs(3600))
        .data(Runs::default())
        .build()
        .unwrap();
    let mut events = worker.subscribe();
    let stop = worker.shutdown_handle();
    let running = tokio::spawn(worker.run());
    let id = skiplock::enqueue(
        skiplock::PgBouncer(&pool),
        &Counted { n: 1 },
        EnqueueOptions::default(),
    )
    .await
    .unwrap()
    .id;
    let event = tokio::time::timeout(Duration::from_secs(30), events.recv())
        .await
        .expect("the job was not run: no notification reached the worker")
        .expect("event stream");
    assert_eq!(event.id, id);
    stop.shutdown();
    running.await.unwrap().expect("worker ends cleanly");
}

/// `skiplock ARGS… --pgbouncer` on `url`, with its stdout; fails the test when it fails.
async fn cli(url: &str, args: &[&str]) -> String {
    let output = common::skiplock_at(url, args, "warn", &[("SKIPLOCK_PGBOUNCER", "1")]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "skiplock {args:?} failed: {stderr}"
    );
    assert!(
        !stderr.contains("prepared statement") && !stderr.contains("WARN"),
        "skiplock {args:?} warned: {stderr}"
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test]
async fn the_cli_runs_through_pgbouncer() {
    let db = test_db().await;
    let Some(bouncer) = bouncer(&db).await else {
        return;
    };
    let url = bouncer.url.clone();
    cli(&url, &["migrate"]).await;

    let file = tempfile::NamedTempFile::new().unwrap();
    let lines: String = (0..2000)
        .map(|n| format!("{{\"kind\":\"noop\",\"args\":{{\"n\":{n}}}}}\n"))
        .collect();
    std::fs::write(file.path(), lines).unwrap();
    // Twice: the second run may land on the server connection of the first.
    for _ in 0..2 {
        cli(&url, &["enqueue", "--file", file.path().to_str().unwrap()]).await;
    }
    for _ in 0..10 {
        cli(&url, &["enqueue", "noop"]).await;
    }
    let later = cli(&url, &["enqueue", "noop", "--in", "1h"]).await;
    let other = cli(&url, &["enqueue", "noop", "--in", "1h"]).await;
    let (later_id, other_id): (i64, i64) =
        (later.trim().parse().unwrap(), other.trim().parse().unwrap());
    cli(
        &url,
        &[
            "work",
            "--kinds",
            "noop",
            "--exit-when-idle",
            "--concurrency",
            "32",
            "--max-connections",
            "8",
        ],
    )
    .await;
    let succeeded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state = 'succeeded'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(succeeded, 4010);

    cli(&url, &["cancel", later.trim()]).await;
    assert_eq!(state_of(&db.pool, later_id).await, JobState::Cancelled);
    cli(&url, &["retry", later.trim()]).await;
    assert_eq!(state_of(&db.pool, later_id).await, JobState::Queued);
    cli(&url, &["retry", other.trim()]).await;
    assert_eq!(state_of(&db.pool, other_id).await, JobState::Queued);
    let due_now: bool =
        sqlx::query_scalar("SELECT scheduled_at <= now() FROM skiplock.jobs WHERE id = $1")
            .bind(other_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(due_now, "retry made the job due now");
    let stats: serde_json::Value =
        serde_json::from_str(&cli(&url, &["stats", "--json"]).await).unwrap();
    assert_eq!(stats["queues"][0]["succeeded_last_hour"], 4010, "{stats}");
    let listed: serde_json::Value =
        serde_json::from_str(&cli(&url, &["jobs", "--state", "queued", "--json"]).await).unwrap();
    let mut ids: Vec<i64> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|job| job["id"].as_i64().unwrap())
        .collect();
    ids.sort();
    assert_eq!(
        ids,
        vec![
            later.trim().parse::<i64>().unwrap(),
            other.trim().parse::<i64>().unwrap()
        ],
        "the queued jobs listed: {listed}"
    );
}

#[tokio::test]
async fn the_dashboard_answers_through_pgbouncer() {
    let db = test_db().await;
    let Some(bouncer) = bouncer(&db).await else {
        return;
    };
    skiplock::enqueue_raw(
        skiplock::PgBouncer(&bouncer.pool(2)),
        &[NewJob::new("noop", serde_json::json!({}))],
    )
    .await
    .unwrap();
    let dashboard = Dashboard::start_at(&bouncer.url.clone(), &["--pgbouncer"]).await;
    for path in ["/", "/jobs?state=queued", "/history", "/api/v1/stats"] {
        let response = dashboard.get(path).await;
        let status = response.status();
        let body = response.text().await.unwrap();
        assert!(status.is_success(), "GET {path}: {status}: {body}");
        if path == "/" {
            assert!(
                body.contains("noop"),
                "the overview shows the queued job: {body}"
            );
        }
    }
}

/// `skiplock::wait_for` on a pool through PgBouncer: no LISTEN holds there, so each waiter
/// looks at its job on a timer; its statements are unnamed, so twenty waiters on three
/// server connections never clash, and each gets its own job's outcome.
#[tokio::test]
async fn wait_for_gets_each_outcome_through_pgbouncer() {
    const WAITERS: i64 = 20;
    let db = test_db().await;
    let Some(bouncer) = bouncer(&db).await else {
        return;
    };
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT skiplock.enqueue('counted', jsonb_build_object('n', n)) FROM generate_series(1, $1) n",
    )
    .bind(WAITERS)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let through = bouncer.pool(10);
    let mut waiters = tokio::task::JoinSet::new();
    for &id in &ids {
        let pool = through.clone();
        waiters.spawn(async move {
            (
                id,
                skiplock::wait_for(&pool, JobId(id), Duration::from_secs(120)).await,
            )
        });
    }
    common::fixtures::wait_for(
        "every waiter to mark its job",
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM skiplock.jobs WHERE awaited")
                .fetch_one(&db.pool)
                .await
                .unwrap()
                == WAITERS
        },
    )
    .await;
    sqlx::query(
        "UPDATE skiplock.jobs SET state = 'succeeded', finished_at = now(), output = args
         WHERE state = 'queued'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    while let Some(joined) = waiters.join_next().await {
        let (id, outcome) = joined.unwrap();
        let outcome = outcome.expect("an outcome through PgBouncer");
        assert_eq!(outcome.id, id);
        assert_eq!(outcome.state, JobState::Succeeded);
        assert!(outcome.output.unwrap()["n"].is_number());
    }
}
