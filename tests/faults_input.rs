//! Bad input, each refused with its exact message: args that do not match the kind,
//! oversized payloads, hostile queue and kind names, malformed cron schedules, unreachable
//! or wrong database URLs, and schemas older or newer than the binary. Complements
//! tests/enqueue.rs, tests/worker.rs and tests/control.rs, which check the library side
//! of several of these.
#![cfg(feature = "cli")]

mod common;

use common::fixtures::{Recorder, fast_worker, wait_for};
use common::test_db;
use serde::{Deserialize, Serialize};
use skiplock::db::migrations::SCHEMA_VERSION_LATEST;
use skiplock::{Job, JobContext, JobError, JobId, JobState, NewJob};

/// What one run of the `skiplock` binary produced.
#[derive(Debug)]
struct Run {
    code: Option<i32>,
    stdout: String,
    /// The error lines of stderr (log lines of the worker left out).
    errors: String,
}

/// Runs `skiplock ARGS…` with `--database-url URL`, no `DATABASE_URL` inherited and the
/// given extra environment.
async fn skiplock(url: &str, args: &[&str], env: &[(&str, &str)]) -> Run {
    let output = common::skiplock_at(url, args, "error", env).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    Run {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        errors: stderr
            .lines()
            .filter(|l| l.starts_with("error"))
            .collect::<Vec<_>>()
            .join("\n"),
    }
}

/// Input: jobs of the built-in `sleep` kind whose args have the wrong type, an unknown
/// field, or are not JSON at all.
///
/// Invariant: JSON that does not parse is a usage error (exit 2) and enqueues nothing;
/// so are args that parse but do not match a built-in kind (tests/cli_surface.rs). Such
/// args enqueued another way (SQL, another client: the queue cannot know every kind) the
/// worker fails at once as `dead` on attempt 1 with the exact decode error, never running
/// the handler.
#[tokio::test]
async fn args_that_do_not_match_the_kind_die_at_once_with_the_decode_error() {
    let db = test_db().await;
    let run = skiplock(&db.url, &["enqueue", "sleep", r#"{"ms":"#], &[]).await;
    assert_eq!(run.code, Some(2));
    assert_eq!(
        run.errors,
        r#"error: invalid value '{"ms":' for '[ARGS_JSON]': not valid JSON: EOF while parsing a value at line 1 column 6; write JSON in single quotes, like '{"ms": 500}'"#
    );
    assert_eq!(db.job_count().await, 0);

    let mut ids = Vec::new();
    for args in [r#"{"ms": "soon"}"#, r#"{"ms": 1, "extra": true}"#, "[]"] {
        let run = skiplock(&db.url, &["enqueue", "sleep", args], &[]).await;
        assert_eq!(run.code, Some(2), "{run:?}");
        let id: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('sleep', $1::jsonb)")
            .bind(args)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        ids.push(id);
    }
    let run = skiplock(
        &db.url,
        &["work", "--exit-when-idle", "--kinds", "sleep"],
        &[],
    )
    .await;
    assert_eq!(run.code, Some(0), "{run:?}");
    let expected = [
        "args do not match kind `sleep`: invalid type: string \"soon\", expected u64; fix the payload and retry the job",
        "args do not match kind `sleep`: unknown field `extra`, expected `ms`; fix the payload and retry the job",
        "args do not match kind `sleep`: invalid length 0, expected struct Sleep with 1 element; fix the payload and retry the job",
    ];
    for (id, message) in ids.into_iter().zip(expected) {
        let row = skiplock::job(&db.pool, JobId(id)).await.unwrap().unwrap();
        assert_eq!((row.state, row.attempt), (JobState::Dead, 1), "job {id}");
        assert_eq!(row.last_error.as_deref(), Some(message));
    }
}

/// Input: payloads over the size limit, through the library, the SQL-facing batch path
/// and the binary (where the limit is lowered with `SKIPLOCK_ARGS_MAX_BYTES`).
///
/// Invariant: the limit is the default of `skiplock.args_max_bytes` (1 MiB) unless configured;
/// a payload exactly at the limit is accepted, one byte over is refused with the exact
/// message naming both sizes and the setting; a refused batch writes nothing.
#[tokio::test]
async fn payloads_over_the_size_limit_are_refused_exactly_at_the_limit() {
    let db = test_db().await;
    // The default of the database's setting `skiplock.args_max_bytes`: 1 MiB.
    let limit = 1024 * 1024;
    // {"blob": "…"} (as Postgres prints jsonb, the measure of every path) is 12 bytes
    // around the string.
    let at_limit = serde_json::json!({ "blob": "x".repeat(limit - 12) });
    let over = serde_json::json!({ "blob": "x".repeat(limit - 11) });
    skiplock::enqueue_raw(&db.pool, &[NewJob::new("noop", at_limit)])
        .await
        .expect("a payload at the limit is accepted");
    let error = skiplock::enqueue_raw(
        &db.pool,
        &[
            NewJob::new("noop", serde_json::json!({})),
            NewJob::new("noop", over),
        ],
    )
    .await
    .unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "invalid job: args are {} bytes, over the limit of {limit} bytes; hint: store large data elsewhere and pass a reference, or raise the setting skiplock.args_max_bytes",
            limit + 1
        )
    );
    assert_eq!(db.job_count().await, 1, "nothing of the refused batch");

    let env = [("SKIPLOCK_ARGS_MAX_BYTES", "5000")];
    let fits = format!(r#"{{"blob":"{}"}}"#, "x".repeat(4988));
    let too_big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(4989));
    let run = skiplock(&db.url, &["enqueue", "noop", &fits], &env).await;
    assert_eq!(run.code, Some(0), "{run:?}");
    let run = skiplock(&db.url, &["enqueue", "noop", &too_big], &env).await;
    assert_eq!(run.code, Some(1), "{run:?}");
    assert_eq!(
        run.errors,
        "error: cannot enqueue the job: invalid job: args are 5001 bytes, over the limit of 5000 bytes; hint: store large data elsewhere and pass a reference, or raise the setting skiplock.args_max_bytes"
    );
    assert_eq!(db.job_count().await, 2);
    let run = skiplock(
        &db.url,
        &["--args-max-bytes", "100", "enqueue", "noop", &fits],
        &[],
    )
    .await;
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.errors.contains("--args-max-bytes"),
        "the usage error names the flag: {run:?}"
    );
}

/// Input: a queue name over [`skiplock::QUEUE_NAME_MAX_BYTES`] (1,000 bytes), by every
/// path: the Rust API, a plain `INSERT`, `skiplock.enqueue`, an `UPDATE` of a queued job,
/// `skiplock.pause_queue`, a cron schedule written by hand or by the library, a worker
/// built to serve such a queue, and the binary's `enqueue`.
///
/// Invariant: a name exactly at the limit is accepted; one byte over is refused on each
/// path with the limit or the constraint named, and writes nothing. (Before schema version
/// 8 the `INSERT` failed on a notification's payload, naming nothing, at 8,000 bytes; and
/// the `UPDATE` was let in, after which every write announcing that job failed.)
#[tokio::test]
async fn queue_names_over_the_limit_are_refused_on_every_path() {
    let db = test_db().await;
    let pool = &db.pool;
    assert_eq!(skiplock::QUEUE_NAME_MAX_BYTES, 1000);
    // Four-byte characters: the limit is in bytes.
    let at_limit = "🦀".repeat(250);
    let over = format!("{at_limit}q");
    let job = |queue: &str| {
        NewJob::new("noop", serde_json::json!({}))
            .with_options(skiplock::EnqueueOptions::new().queue(queue))
    };
    skiplock::enqueue_raw(pool, &[job(&at_limit)])
        .await
        .expect("a name at the limit is accepted");
    let error = skiplock::enqueue_raw(pool, &[job("default"), job(&over)])
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "invalid job: job 2 of the batch: the queue name is 1001 bytes; it must be at most 1000"
    );

    let refused = |result: Result<sqlx::postgres::PgQueryResult, sqlx::Error>, constraint: &str| {
        let error = result.expect_err("refused");
        let db_error = error.as_database_error().expect("a database error");
        assert_eq!(db_error.code().as_deref(), Some("23514"), "{db_error}");
        assert_eq!(db_error.constraint(), Some(constraint), "{db_error}");
    };
    refused(
        sqlx::query("INSERT INTO skiplock.jobs (kind, queue) VALUES ('noop', $1)")
            .bind(&over)
            .execute(pool)
            .await,
        "jobs_queue_name_length",
    );
    refused(
        sqlx::query("SELECT skiplock.enqueue('noop', queue => $1)")
            .bind(&over)
            .execute(pool)
            .await,
        "jobs_queue_name_length",
    );
    refused(
        sqlx::query("UPDATE skiplock.jobs SET queue = $1")
            .bind(&over)
            .execute(pool)
            .await,
        "jobs_queue_name_length",
    );
    refused(
        sqlx::query("SELECT skiplock.pause_queue($1)")
            .bind(&over)
            .execute(pool)
            .await,
        "queues_name_length",
    );
    refused(
        sqlx::query(
            "INSERT INTO skiplock.cron_schedules (name, expression, kind, queue)
             VALUES ('long', '* * * * *', 'noop', $1)",
        )
        .bind(&over)
        .execute(pool)
        .await,
        "cron_schedules_queue_name_length",
    );

    let error = skiplock::cron::upsert(
        pool,
        &skiplock::cron::CronSchedule::new("long", "* * * * *", "noop").queue(over.clone()),
    )
    .await
    .expect_err("refused");
    assert!(
        matches!(error, skiplock::Error::InvalidCron(_)),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        "schedule `long`: the queue name is 1001 bytes; it must be at most 1000"
    );

    let error = skiplock::Worker::builder(pool.clone())
        .register::<Hostile>()
        .queues([over.as_str()])
        .build()
        .err()
        .expect("refused");
    assert!(
        matches!(&error, skiplock::Error::Config(why)
            if why == "a queue name is 1001 bytes; it must be at most 1000"),
        "{error:?}"
    );

    let run = skiplock(&db.url, &["enqueue", "noop", "{}", "--queue", &over], &[]).await;
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.errors
            .contains("the queue name is 1001 bytes; it must be at most 1000"),
        "{run:?}"
    );
    let queues: Vec<String> = sqlx::query_scalar("SELECT queue FROM skiplock.jobs")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(
        queues,
        vec![at_limit],
        "only the job at the limit was written"
    );
    let schedules: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.cron_schedules")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(schedules, 0);

    // A hand-written UPDATE cannot give a job a longer name either.
    refused(
        sqlx::query("UPDATE skiplock.jobs SET queue = $1")
            .bind(&over)
            .execute(pool)
            .await,
        "jobs_queue_name_length",
    );
}

/// A kind whose name is hostile SQL: quotes, a semicolon, a comment, unicode.
#[derive(Serialize, Deserialize)]
struct Hostile {
    text: String,
}

const HOSTILE_KIND: &str = "x'); DROP TABLE skiplock.jobs; -- \"ünï🦀\"";
const HOSTILE_QUEUE: &str = "q' OR '1'='1; DELETE FROM skiplock.jobs; --日本";

impl Job for Hostile {
    const KIND: &'static str = HOSTILE_KIND;
    const QUEUE: &'static str = HOSTILE_QUEUE;

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        ctx.data::<Recorder>().unwrap().record(&ctx);
        ctx.set_output(serde_json::json!({ "echo": self.text }))
            .await?;
        Ok(())
    }
}

/// Input: a kind and a queue made of quotes, semicolons, SQL comments and unicode, in the
/// library, the binary's `enqueue`, `jobs` filters and queue pause/resume.
///
/// Invariant: no SQL is ever built from them: the names round-trip byte for byte, a
/// worker registered for them runs the job once, the filters match exactly, pausing that
/// queue pauses only it, and the jobs table is intact.
#[tokio::test]
async fn hostile_kind_and_queue_names_round_trip_and_never_become_sql() {
    let db = test_db().await;
    let pool = &db.pool;
    let payload = "'; SELECT pg_sleep(10); --";
    let id = skiplock::enqueue(
        pool,
        &Hostile {
            text: payload.into(),
        },
        skiplock::EnqueueOptions::default(),
    )
    .await
    .unwrap()
    .id;
    let run = skiplock(
        &db.url,
        &[
            "enqueue",
            HOSTILE_KIND,
            r#"{"text": "from the CLI"}"#,
            "--queue",
            HOSTILE_QUEUE,
        ],
        &[],
    )
    .await;
    assert_eq!(run.code, Some(0), "{run:?}");
    let from_cli: i64 = run.stdout.trim().parse().unwrap();
    let run = skiplock(
        &db.url,
        &[
            "jobs",
            "--queue",
            HOSTILE_QUEUE,
            "--kind",
            HOSTILE_KIND,
            "--json",
        ],
        &[],
    )
    .await;
    assert_eq!(run.code, Some(0), "{run:?}");
    let listed: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    let listed_ids: Vec<i64> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_i64().unwrap())
        .collect();
    assert_eq!(listed_ids.len(), 2, "{listed}");
    assert!(listed_ids.contains(&id.0) && listed_ids.contains(&from_cli));

    skiplock::pause_queue(pool, HOSTILE_QUEUE).await.unwrap();
    let other = skiplock::enqueue_raw(
        pool,
        &[NewJob::new(
            HOSTILE_KIND,
            serde_json::json!({"text": "default queue"}),
        )],
    )
    .await
    .unwrap()[0]
        .id;
    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder)
        .register::<Hostile>()
        .queues(["default", HOSTILE_QUEUE])
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run_worker = tokio::spawn(worker.run());
    wait_for(
        "the job in the other queue to run",
        std::time::Duration::from_secs(30),
        || async { recorder.runs().contains_key(&other.0) },
    )
    .await;
    assert_eq!(
        recorder.total(),
        1,
        "the paused hostile queue stayed paused"
    );
    skiplock::resume_queue(pool, HOSTILE_QUEUE).await.unwrap();
    wait_for(
        "the hostile queue's jobs to run",
        std::time::Duration::from_secs(30),
        || async { recorder.total() == 3 },
    )
    .await;
    stop.shutdown();
    run_worker.await.unwrap().unwrap();

    let row = skiplock::job(pool, id).await.unwrap().unwrap();
    assert_eq!(
        (row.kind.as_str(), row.queue.as_str(), row.state),
        (HOSTILE_KIND, HOSTILE_QUEUE, JobState::Succeeded)
    );
    assert_eq!(
        row.output.unwrap().0,
        serde_json::json!({ "echo": payload })
    );
    assert_eq!(db.job_count().await, 3, "the jobs table is intact");
    let runs = recorder.runs();
    for job in [id.0, from_cli, other.0] {
        assert_eq!(runs[&job], vec![1], "job {job} ran once");
    }
}

/// Input: cron schedules with an unknown time zone and with malformed expressions.
///
/// Invariant: each is refused before anything is written, with the exact message naming
/// the bad part.
#[tokio::test]
async fn malformed_cron_schedules_are_refused_with_the_bad_part_named() {
    use skiplock::cron::CronSchedule;
    let db = test_db().await;
    let cases = [
        (
            CronSchedule::new("tz", "0 * * * *", "noop").timezone("Mars/Olympus_Mons"),
            "unknown time zone `Mars/Olympus_Mons`; use an IANA name such as UTC or Europe/Paris",
        ),
        (
            CronSchedule::new("fields", "* * *", "noop"),
            "invalid cron expression `* * *`: expected 5 fields (minute hour day-of-month month day-of-week) or 6 (with seconds first), found 3",
        ),
        (
            CronSchedule::new("sql", "0 0 * * 1; DROP TABLE skiplock.jobs", "noop"),
            "invalid cron expression `0 0 * * 1; DROP TABLE skiplock.jobs`: expected 5 fields (minute hour day-of-month month day-of-week) or 6 (with seconds first), found 8",
        ),
    ];
    for (schedule, message) in cases {
        let error = skiplock::cron::upsert(&db.pool, &schedule)
            .await
            .expect_err("refused");
        assert!(
            matches!(error, skiplock::Error::InvalidCron(_)),
            "{error:?}"
        );
        assert_eq!(error.to_string(), message, "schedule {}", schedule.name);
    }
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.cron_schedules")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(count, 0);
    assert_eq!(db.job_count().await, 0);
}

/// Input: database URLs that point at a closed port, at a database that does not exist,
/// and that are not URLs at all.
///
/// Invariant: every command fails with exit status 1 and one line naming the URL and
/// the cause, without hanging (`work --exit-when-idle` gives up like a one-shot command).
#[tokio::test]
async fn unreachable_and_wrong_database_urls_fail_with_one_clear_line() {
    let server = common::server_url();
    let missing = common::with_database(server, "skiplock_no_such_database");
    let cases = [
        (
            "postgres://postgres@127.0.0.1:1/postgres".to_owned(),
            "error: cannot connect to the database at postgres://postgres@127.0.0.1:1/postgres; check --database-url / DATABASE_URL and that Postgres is running: error communicating with database: Connection refused (os error 111)".to_owned(),
        ),
        (
            missing.clone(),
            format!(
                "error: the database `skiplock_no_such_database` does not exist on the server at {missing}; create it (createdb skiplock_no_such_database) and run `skiplock migrate`"
            ),
        ),
        (
            "not a url".to_owned(),
            "error: the database URL is not a URL; write it like postgres://user@host:port/db (key=value connection strings are not supported)".to_owned(),
        ),
    ];
    for (url, expected) in cases {
        for command in [
            &["migrate"][..],
            &["work", "--exit-when-idle"],
            &["enqueue", "noop"],
        ] {
            // Refusals that may pass are retried for --connect-retry (10 s by default).
            let run = tokio::time::timeout(
                std::time::Duration::from_secs(60),
                skiplock(&url, command, &[("SKIPLOCK_CONNECT_RETRY", "1s")]),
            )
            .await
            .expect("fails without hanging");
            assert_eq!(run.code, Some(1), "{command:?} on {url}: {run:?}");
            assert_eq!(run.errors, expected, "{command:?} on {url}");
        }
    }
}

/// Input: a database whose skiplock schema is one version older than the binary, then
/// one that a newer skiplock migrated.
///
/// Invariant: the worker and `enqueue` refuse both with the exact versions and what to do
/// (the refused enqueue writes no job); `migrate` upgrades the older one and refuses the
/// newer one, changing nothing.
#[tokio::test]
async fn schemas_older_or_newer_than_the_binary_are_refused_with_the_fix() {
    let db = test_db().await;
    let latest = SCHEMA_VERSION_LATEST;
    sqlx::query("DELETE FROM skiplock.schema_migrations WHERE version = $1")
        .bind(latest)
        .execute(&db.pool)
        .await
        .unwrap();
    let run = skiplock(&db.url, &["work", "--exit-when-idle"], &[]).await;
    assert_eq!(run.code, Some(1), "{run:?}");
    assert_eq!(
        run.errors,
        // With one migration (0.1.0), one version older is none at all.
        format!(
            "error: the database `{}` has no skiplock schema; run `skiplock migrate` on it first",
            db.name
        )
    );
    let jobs = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM skiplock.jobs")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    let run = skiplock(&db.url, &["enqueue", "noop"], &[]).await;
    assert_eq!(run.code, Some(1), "{run:?}");
    assert_eq!(
        run.errors,
        // With one migration (0.1.0), one version older is none at all.
        format!(
            "error: the database `{}` has no skiplock schema; run `skiplock migrate` on it first",
            db.name
        )
    );
    assert_eq!(jobs().await, 0, "the refused enqueue wrote nothing");
    sqlx::query("INSERT INTO skiplock.schema_migrations (version, name) VALUES (99, 'future.sql')")
        .execute(&db.pool)
        .await
        .unwrap();
    let expected = format!(
        "the database schema is at version 99, newer than this skiplock understands ({latest}); upgrade skiplock"
    );
    let versions = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM skiplock.schema_migrations")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    let before = versions().await;
    let run = skiplock(&db.url, &["migrate"], &[]).await;
    assert_eq!(run.code, Some(1), "{run:?}");
    assert_eq!(run.errors, format!("error: migration failed: {expected}"));
    assert_eq!(
        versions().await,
        before,
        "the refused migrate changed nothing"
    );
    let run = skiplock(&db.url, &["work", "--exit-when-idle"], &[]).await;
    assert_eq!(run.code, Some(1), "{run:?}");
    assert_eq!(run.errors, format!("error: worker failed: {expected}"));
    let run = skiplock(&db.url, &["enqueue", "noop"], &[]).await;
    assert_eq!(run.code, Some(1), "{run:?}");
    assert_eq!(run.errors, format!("error: {expected}"));
    assert_eq!(jobs().await, 0, "the refused enqueue wrote nothing");
}
