//! Cron schedules, queue pause and per-queue concurrency, timeouts, cancellation, progress
//! and output.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::fixtures::{Record, Recorder, Slow, count_in_state, fast_worker, state_of, wait_for};
use common::test_db;
use serde::{Deserialize, Serialize};
use serde_json::json;
use skiplock::cron::{CronSchedule, MissedSlots};
use skiplock::{EnqueueOptions, Error, Job, JobContext, JobError, JobState};
use sqlx::PgPool;

async fn cron_jobs(pool: &PgPool) -> Vec<(i64, chrono::DateTime<chrono::Utc>)> {
    sqlx::query_as("SELECT id, scheduled_at FROM skiplock.jobs WHERE kind = 'record' ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cron_slot_produces_exactly_one_job_with_several_workers() {
    let db = test_db().await;
    let pool = &db.pool;
    let every_second = CronSchedule::new("tick", "* * * * * *", "record").args(json!({"n": 1}));
    let mut stops = Vec::new();
    let mut runs = Vec::new();
    for i in 0..3 {
        let worker = fast_worker(pool, &Recorder::default())
            .worker_id(format!("cron-{i}"))
            .cron(every_second.clone())
            .cron_interval(Some(Duration::from_millis(50)))
            .build()
            .unwrap();
        stops.push(worker.shutdown_handle());
        runs.push(tokio::spawn(worker.run()));
    }
    wait_for("four cron jobs", Duration::from_secs(60), || async {
        cron_jobs(pool).await.len() >= 4
    })
    .await;
    for stop in stops {
        stop.shutdown();
    }
    for run in runs {
        run.await.unwrap().unwrap();
    }
    let jobs = cron_jobs(pool).await;
    // No slot twice, wherever its jobs sit in id order. Not that no slot is missing: a
    // pass that comes more than a second after the last one (a loaded machine) makes the
    // latest due slot's job only, as `MissedSlots::Latest` says. Which slot is due when is
    // the database's computation, checked without a clock in tests/cron_slots.rs.
    let distinct: std::collections::BTreeSet<_> = jobs.iter().map(|(_, slot)| *slot).collect();
    assert_eq!(distinct.len(), jobs.len(), "one job per slot: {jobs:?}");
    for (_, slot) in &jobs {
        assert_eq!(
            slot.timestamp_subsec_nanos(),
            0,
            "slots fall on whole seconds"
        );
    }
    let last_job: Option<i64> =
        sqlx::query_scalar("SELECT last_job_id FROM skiplock.cron_schedules WHERE name = 'tick'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(last_job, jobs.iter().map(|(id, _)| *id).max());
}

#[tokio::test]
async fn missed_slots_follow_the_schedule_policy() {
    let db = test_db().await;
    let pool = &db.pool;
    // Midnight on January 1st; the last slot done was years ago, so many slots were missed.
    for (name, missed) in [("latest", MissedSlots::Latest), ("skip", MissedSlots::Skip)] {
        let schedule = CronSchedule::new(name, "0 0 1 1 *", "record")
            .args(json!({"n": 1}))
            .missed(missed);
        skiplock::cron::upsert(pool, &schedule).await.unwrap();
    }
    sqlx::query("UPDATE skiplock.cron_schedules SET last_slot_at = now() - interval '3 years'")
        .execute(pool)
        .await
        .unwrap();
    let worker = fast_worker(pool, &Recorder::default())
        .cron_interval(Some(Duration::from_millis(50)))
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("both schedules to catch up", Duration::from_secs(60), || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT bool_and(last_slot_at > now() - interval '1 year') FROM skiplock.cron_schedules",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();

    let rows: Vec<(String, Option<i64>, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT name, last_job_id, last_slot_at FROM skiplock.cron_schedules ORDER BY name",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let jobs = cron_jobs(pool).await;
    assert_eq!(
        jobs.len(),
        1,
        "only the latest missed slot ran, and only for `latest`"
    );
    assert_eq!(rows[0].0, "latest");
    assert_eq!(rows[0].1, Some(jobs[0].0));
    assert_eq!(jobs[0].1, rows[0].2, "the job carries its slot");
    assert_eq!(rows[1].0, "skip");
    assert_eq!(rows[1].1, None);
    assert_eq!(
        rows[1].2, rows[0].2,
        "skip marked the same slot done without a job"
    );
}

/// A malformed schedule is refused as it is written, whoever writes it, with the field and
/// its characters named: through the API, by a worker that defines it (its `run` ends with
/// the error before it claims anything), and by plain SQL.
#[tokio::test]
async fn bad_cron_expressions_are_rejected_with_their_position() {
    let db = test_db().await;
    let error = skiplock::cron::upsert(&db.pool, &CronSchedule::new("bad", "0 25 * * *", "record"))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::InvalidCron(_)));
    assert!(
        error.to_string().starts_with(
            "invalid cron expression `0 25 * * *`: hour field `25` (characters 3-4) is wrong"
        ),
        "{error}"
    );
    let error = fast_worker(&db.pool, &Recorder::default())
        .cron(CronSchedule::new("bad", "*/5 * * *", "record"))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap_err();
    assert!(matches!(error, Error::InvalidCron(_)), "{error:?}");
    assert!(error.to_string().contains("expected 5 fields"), "{error}");

    let refused = |statement: &'static str, message: &'static str| {
        let pool = db.pool.clone();
        async move {
            let error = sqlx::query(statement).execute(&pool).await.unwrap_err();
            assert!(error.to_string().contains(message), "{error}");
        }
    };
    refused(
        "INSERT INTO skiplock.cron_schedules (name, expression, kind) VALUES ('sql-bad', '61 * * * *', 'record')",
        "minute field `61` (characters 1-2) is wrong",
    )
    .await;
    sqlx::query("INSERT INTO skiplock.cron_schedules (name, expression, kind) VALUES ('good', '0 * * * *', 'record')")
        .execute(&db.pool)
        .await
        .unwrap();
    refused(
        "UPDATE skiplock.cron_schedules SET timezone = 'Mars/Olympus_Mons'",
        "unknown time zone `Mars/Olympus_Mons`",
    )
    .await;
    // What could never make a job (issue 38): an expression no date matches, a job the
    // jobs table would refuse.
    refused(
        "INSERT INTO skiplock.cron_schedules (name, expression, kind) VALUES ('never', '* * 31 2 *', 'record')",
        "cron expression `* * 31 2 *` never fires",
    )
    .await;
    refused(
        "UPDATE skiplock.cron_schedules SET expression = '0 0 31 4,6,9,11 *'",
        "never fires",
    )
    .await;
    refused(
        "INSERT INTO skiplock.cron_schedules (name, expression, kind, max_attempts) VALUES ('zero', '0 * * * *', 'record', 0)",
        "cron_schedules_max_attempts_positive",
    )
    .await;
    refused(
        "INSERT INTO skiplock.cron_schedules (name, expression, kind, queue) VALUES ('noqueue', '0 * * * *', 'record', '')",
        "cron_schedules_queue_not_empty",
    )
    .await;
    // A leap day, or a day 31 in a month that has one, fires.
    sqlx::query("UPDATE skiplock.cron_schedules SET expression = '0 0 29 2 *'")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE skiplock.cron_schedules SET expression = '0 * * * *'")
        .execute(&db.pool)
        .await
        .unwrap();
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT name || ' ' || expression || ' ' || timezone FROM skiplock.cron_schedules",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(names, ["good 0 * * * * UTC"], "nothing bad was written");
}

/// Calls of the claim functions (`skiplock.internal_claim…`) in this database so far, from
/// `pg_stat_user_functions` (needs `track_functions = all` on the calling sessions).
async fn claim_calls(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_user_functions
         WHERE schemaname = 'skiplock' AND funcname LIKE 'internal_claim%'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_paused_queue_claims_nothing_until_resumed() {
    let db = test_db().await;
    let pool = &db.pool;
    let held = skiplock::enqueue(pool, &Record { n: 1 }, EnqueueOptions::new().queue("mail"))
        .await
        .unwrap()
        .id;
    skiplock::pause_queue(pool, "mail").await.unwrap();
    // The worker's sessions count their function calls, so the test knows its claimer
    // polled the paused queue (not merely that it has not got to it yet).
    db.set_for_new_sessions("track_functions = 'all'").await;
    let worker_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(5)
        .connect(&db.url)
        .await
        .unwrap();
    let recorder = Recorder::default();
    let worker = fast_worker(&worker_pool, &recorder)
        .queues(["mail"])
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    // Every claim of this worker ran after the pause, with the job in its queue.
    wait_for(
        "the worker's claimer to poll the paused queue three times",
        Duration::from_secs(60),
        || async { claim_calls(pool).await >= 3 },
    )
    .await;
    let row = skiplock::job(pool, held).await.unwrap().unwrap();
    assert_eq!((row.state, row.attempt), (JobState::Queued, 0));

    sqlx::query("SELECT skiplock.resume_queue('mail')")
        .execute(pool)
        .await
        .unwrap();
    wait_for(
        "the resumed queue's job",
        Duration::from_secs(60),
        || async { state_of(pool, held.0).await == JobState::Succeeded },
    )
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
}

/// Counts how many run at once.
#[derive(Serialize, Deserialize, Clone)]
struct Gauge {}

#[derive(Default)]
struct Concurrency {
    now: AtomicUsize,
    max: AtomicUsize,
    /// Woken when two jobs run at once.
    two_at_once: tokio::sync::Notify,
    /// A job waited 60 s for a second one in vain; the others do not wait.
    gave_up: std::sync::atomic::AtomicBool,
}

impl Job for Gauge {
    const KIND: &'static str = "gauge";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let c = ctx.data::<Arc<Concurrency>>().unwrap();
        let now = c.now.fetch_add(1, Ordering::SeqCst) + 1;
        c.max.fetch_max(now, Ordering::SeqCst);
        if now >= 2 {
            c.two_at_once.notify_waiters();
        }
        // Until two ran at once, a job waits for a second one (at most 60 s, once: a worker
        // that runs them one by one never gets there, and the test says so).
        if !c.gave_up.load(Ordering::SeqCst) {
            let two = async {
                loop {
                    let notified = c.two_at_once.notified();
                    if c.max.load(Ordering::SeqCst) >= 2 {
                        return;
                    }
                    notified.await;
                }
            };
            if tokio::time::timeout(Duration::from_secs(60), two)
                .await
                .is_err()
            {
                c.gave_up.store(true, Ordering::SeqCst);
            }
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        c.now.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }
}

#[tokio::test]
async fn per_queue_concurrency_caps_a_queue() {
    let db = test_db().await;
    let pool = &db.pool;
    skiplock::enqueue_many(
        pool,
        &vec![Gauge {}; 30],
        EnqueueOptions::new().queue("narrow"),
    )
    .await
    .unwrap();
    let concurrency = Arc::new(Concurrency::default());
    fast_worker(pool, &Recorder::default())
        .data(concurrency.clone())
        .register::<Gauge>()
        .concurrency(32)
        .queue_concurrency("narrow", 2)
        .exit_when_idle(true)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!(count_in_state(pool, JobState::Succeeded).await, 30);
    assert_eq!(
        concurrency.max.load(Ordering::SeqCst),
        2,
        "two at once, never more"
    );
}

/// Never finishes on its own; limited by its kind's timeout.
#[derive(Serialize, Deserialize, Clone)]
struct Stuck {}

impl Job for Stuck {
    const KIND: &'static str = "stuck";

    async fn run(self, _ctx: JobContext) -> Result<(), JobError> {
        std::future::pending::<()>().await;
        Ok(())
    }

    fn timeout() -> Option<Duration> {
        Some(Duration::from_millis(200))
    }

    fn retry_delay(_attempt: i32) -> Duration {
        Duration::from_millis(10)
    }
}

#[tokio::test]
async fn a_kind_timeout_stops_the_handler_and_fails_the_attempt() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = skiplock::enqueue(pool, &Stuck {}, EnqueueOptions::new().max_attempts(2))
        .await
        .unwrap()
        .id;
    // Claims that never go stale: only the kind's timeout may end an attempt.
    let worker = fast_worker(pool, &Recorder::default())
        .register::<Stuck>()
        .heartbeat(Duration::from_millis(100), Duration::from_secs(3600))
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the job to die", Duration::from_secs(60), || async {
        state_of(pool, id.0).await == JobState::Dead
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
    let row = skiplock::job(pool, id).await.unwrap().unwrap();
    assert_eq!(row.attempt, 2, "retried once, then dead");
    assert_eq!(
        row.last_error.as_deref(),
        Some("timed out after 200ms (kind `stuck`)")
    );
}

#[tokio::test]
async fn cancelling_a_queued_job_means_it_never_runs() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = skiplock::enqueue(pool, &Record { n: 1 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    assert!(skiplock::cancel(pool, id).await.unwrap());
    assert!(
        !skiplock::cancel(pool, id).await.unwrap(),
        "already cancelled"
    );
    let recorder = Recorder::default();
    fast_worker(pool, &recorder)
        .exit_when_idle(true)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!(recorder.total(), 0);
    assert_eq!(state_of(pool, id.0).await, JobState::Cancelled);
}

/// Fault: a transaction holds the next job of a lane, then waits for the lane's head,
/// while an operator cancels that head (the cancel locks the head, then wants the next job
/// to promote it): a deadlock, and Postgres picks the cancel as its victim (its
/// `deadlock_timeout` is the shorter one).
///
/// Invariant: the cancel gives way (its locks go, so the other transaction finishes) and
/// then succeeds on its own: it returns true, the head is cancelled and the next job is
/// promoted. No caller sees "deadlock detected".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_chosen_as_deadlock_victim_retries_and_succeeds() {
    let db = test_db().await;
    let pool = &db.pool;
    let lane = EnqueueOptions::new().ordering_key("lane");
    let ids = common::ids(
        skiplock::enqueue_many(pool, &[Record { n: 1 }, Record { n: 2 }], lane)
            .await
            .unwrap(),
    );
    let (head, next) = (ids[0], ids[1]);
    assert_eq!(state_of(pool, next.0).await, JobState::Waiting);

    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL deadlock_timeout = '60s'")
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::query("SELECT 1 FROM skiplock.jobs WHERE id = $1 FOR UPDATE")
        .bind(next.0)
        .execute(&mut *holder)
        .await
        .unwrap();

    let mut canceller = pool.acquire().await.unwrap().detach();
    sqlx::query("SET deadlock_timeout = '300ms'")
        .execute(&mut canceller)
        .await
        .unwrap();
    let canceller_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut canceller)
        .await
        .unwrap();
    let cancel = tokio::spawn(async move { skiplock::cancel(&mut canceller, head).await });
    wait_for(
        "the cancel to wait for the next job's lock",
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, bool>(
            "SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1",
        )
        .bind(canceller_pid)
        .fetch_one(pool)
        .await
        .unwrap()
        },
    )
    .await;

    // Closes the cycle; returns once the cancel gave its lock on the head up.
    sqlx::query("SELECT 1 FROM skiplock.jobs WHERE id = $1 FOR UPDATE")
        .bind(head.0)
        .execute(&mut *holder)
        .await
        .unwrap();
    holder.commit().await.unwrap();

    let cancelled = cancel.await.unwrap();
    assert!(cancelled.unwrap(), "the cancel found the job unfinished");
    assert_eq!(state_of(pool, head.0).await, JobState::Cancelled);
    assert_eq!(state_of(pool, next.0).await, JobState::Queued);
}

#[tokio::test]
async fn cancelling_a_running_job_stops_its_handler_at_once() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = skiplock::enqueue(pool, &Slow { ms: 600_000 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let recorder = Recorder::default();
    // Heartbeats once an hour (one as the worker starts): a beat after the cancel would also
    // find the claim gone and stop the handler, and none is due while the test waits (60 s
    // at most), so only the cancel notification can stop it. The job sleeps ten minutes.
    let worker = fast_worker(pool, &recorder)
        .heartbeat(Duration::from_secs(3600), Duration::from_secs(3 * 3600))
        .concurrency(1)
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the job to start", Duration::from_secs(60), || async {
        recorder.total() == 1
    })
    .await;
    let cancelled: bool = sqlx::query_scalar("SELECT skiplock.cancel_job($1)")
        .bind(id.0)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(cancelled);
    let next = skiplock::enqueue(pool, &Record { n: 2 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    wait_for(
        "the freed slot to run the next job",
        Duration::from_secs(60),
        || async { recorder.runs().contains_key(&next.0) },
    )
    .await;
    stop.shutdown();
    let summary = run.await.unwrap().unwrap();
    assert_eq!(summary.lost, 1);
    assert_eq!(state_of(pool, id.0).await, JobState::Cancelled);
}

/// Reports progress and output.
#[derive(Serialize, Deserialize, Clone)]
struct Report {}

impl Job for Report {
    const KIND: &'static str = "report";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        ctx.set_progress(json!({"done": 1, "of": 2})).await?;
        ctx.set_output(json!({"rows": 42})).await?;
        Ok(())
    }
}

#[tokio::test]
async fn handlers_record_progress_and_output_for_operators() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = skiplock::enqueue(pool, &Report {}, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    fast_worker(pool, &Recorder::default())
        .register::<Report>()
        .exit_when_idle(true)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let (state, progress, output): (JobState, serde_json::Value, serde_json::Value) =
        sqlx::query_as("SELECT state, progress, output FROM skiplock.jobs WHERE id = $1")
            .bind(id.0)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(state, JobState::Succeeded);
    assert_eq!(progress, json!({"done": 1, "of": 2}));
    assert_eq!(output, json!({"rows": 42}));
}

/// An empty queue name is refused by `pause_queue` and `resume_queue` with a message that
/// says so, and by `skiplock.queues` itself (before, `pause_queue('')` paused a queue no
/// job can be in and the dashboard showed a blank queue).
#[tokio::test]
async fn an_empty_queue_name_is_refused_in_sql() {
    let db = test_db().await;
    for statement in [
        "SELECT skiplock.pause_queue('')",
        "SELECT skiplock.resume_queue('')",
        "SELECT skiplock.pause_queue(NULL)",
    ] {
        let error = sqlx::query(statement)
            .execute(&db.pool)
            .await
            .expect_err(statement);
        let db_error = error.as_database_error().expect("a database error");
        assert_eq!(
            db_error.message(),
            "a queue name cannot be empty",
            "{statement}"
        );
        assert_eq!(db_error.code().as_deref(), Some("23514"), "{statement}");
    }
    let error = sqlx::query("INSERT INTO skiplock.queues (name, paused) VALUES ('', true)")
        .execute(&db.pool)
        .await
        .expect_err("a plain insert");
    assert_eq!(
        error.as_database_error().and_then(|e| e.constraint()),
        Some("queues_name_not_empty")
    );
    let paused: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.queues")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(paused, 0);
}
