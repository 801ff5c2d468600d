//! Enqueue: transactions, batches, options, plain SQL, validation, migrations.

mod common;

use std::time::Duration;

use common::fixtures::{Record, Recorder, fast_worker};
use common::test_db;
use serde_json::json;
use skiplock::db::migrations::SCHEMA_VERSION_LATEST;
use skiplock::{EnqueueOptions, Error, JobId, JobState, NewJob};

#[tokio::test]
async fn rolled_back_enqueue_leaves_no_job_and_committed_one_runs() {
    let db = test_db().await;

    let mut tx = db.pool.begin().await.unwrap();
    let ghost = skiplock::enqueue(&mut *tx, &Record { n: 1 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    // Visible inside the transaction...
    assert!(skiplock::job(&mut *tx, ghost).await.unwrap().is_some());
    tx.rollback().await.unwrap();
    // ...and gone with it.
    assert!(skiplock::job(&db.pool, ghost).await.unwrap().is_none());

    let mut tx = db.pool.begin().await.unwrap();
    let kept = skiplock::enqueue(&mut *tx, &Record { n: 2 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    tx.commit().await.unwrap();

    let recorder = Recorder::default();
    fast_worker(&db.pool, &recorder)
        .exit_when_idle(true)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let runs = recorder.runs();
    assert_eq!(runs.len(), 1, "only the committed job ran: {runs:?}");
    assert_eq!(runs[&kept.0], vec![1]);
    let row = skiplock::job(&db.pool, kept).await.unwrap().unwrap();
    assert_eq!(row.state, JobState::Succeeded);
}

#[tokio::test]
async fn batch_enqueue_returns_ids_in_order_and_applies_options() {
    let db = test_db().await;
    let jobs: Vec<Record> = (0..5000).map(|n| Record { n }).collect();
    let options = EnqueueOptions::new()
        .queue("bulk")
        .priority(-3)
        .max_attempts(7)
        .run_after(Duration::from_secs(3600));
    let ids = common::ids(
        skiplock::enqueue_many(&db.pool, &jobs, options)
            .await
            .unwrap(),
    );
    assert_eq!(ids.len(), 5000);
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids ascend");

    // Input order is preserved: job i carries n = i.
    let rows: Vec<(i64, i64, String, i16, i32, bool)> = sqlx::query_as(
        "SELECT id, (args->>'n')::bigint, queue, priority, max_attempts,
                scheduled_at BETWEEN now() + interval '59 minutes' AND now() + interval '61 minutes'
         FROM skiplock.jobs ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for (i, (id, n, queue, priority, max_attempts, in_an_hour)) in rows.into_iter().enumerate() {
        assert_eq!(JobId(id), ids[i]);
        assert_eq!(n, i as i64);
        assert_eq!((queue.as_str(), priority, max_attempts), ("bulk", -3, 7));
        assert!(in_an_hour, "run_after is counted from the database clock");
    }
}

#[tokio::test]
async fn plain_sql_insert_and_enqueue_function_fill_defaults() {
    let db = test_db().await;
    let inserted: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args) VALUES ('noop', '{}') RETURNING id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let via_function: i64 = sqlx::query_scalar(
        "SELECT skiplock.enqueue('email', '{\"to\": \"a@example.com\"}', queue => 'mail', max_attempts => 3)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();

    let row = skiplock::job(&db.pool, JobId(inserted))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.state, JobState::Queued);
    assert_eq!(
        (
            row.queue.as_str(),
            row.priority,
            row.attempt,
            row.max_attempts
        ),
        ("default", 0, 0, 25)
    );
    assert_eq!(row.errors.0, json!([]));
    assert!(
        common::fixtures::claim_token_of(&db.pool, row.id)
            .await
            .is_none()
    );

    let row = skiplock::job(&db.pool, JobId(via_function))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (row.kind.as_str(), row.queue.as_str(), row.max_attempts),
        ("email", "mail", 3)
    );
    assert_eq!(row.args.0, json!({"to": "a@example.com"}));
}

#[tokio::test]
async fn invalid_jobs_are_refused_and_nothing_of_the_batch_is_written() {
    let db = test_db().await;
    let batch = [
        NewJob::new("noop", json!({})),
        NewJob::new("noop", json!({})).with_options(EnqueueOptions::new().max_attempts(0)),
    ];
    let error = skiplock::enqueue_raw(&db.pool, &batch).await.unwrap_err();
    assert!(matches!(error, Error::InvalidJob(_)));
    assert_eq!(
        error.to_string(),
        "invalid job: job 2 of the batch: max_attempts is 0; it must be at least 1"
    );

    let error = skiplock::enqueue_raw(&db.pool, &[NewJob::new("", json!({}))])
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "invalid job: the kind is empty; name the handler that runs this job"
    );

    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(count, 0);
}

#[tokio::test]
async fn migrate_is_idempotent_concurrent_and_refuses_newer_schemas() {
    let db = test_db().await;
    // test_db already migrated once; again, several at a time.
    let (a, b, c) = tokio::join!(
        skiplock::migrate(&db.pool),
        skiplock::migrate(&db.pool),
        skiplock::migrate(&db.pool)
    );
    let latest = SCHEMA_VERSION_LATEST;
    assert_eq!(
        (a.unwrap(), b.unwrap(), c.unwrap()),
        (latest, latest, latest)
    );
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.schema_migrations")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(applied, i64::from(latest));

    sqlx::query("INSERT INTO skiplock.schema_migrations (version, name) VALUES (99, 'future.sql')")
        .execute(&db.pool)
        .await
        .unwrap();
    let error = skiplock::migrate(&db.pool).await.unwrap_err();
    assert!(
        matches!(
            error,
            Error::SchemaTooNew { found: 99, supported } if supported == latest
        ),
        "{error}"
    );
    let recorder = Recorder::default();
    let error = fast_worker(&db.pool, &recorder)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap_err();
    assert!(
        matches!(error, Error::SchemaTooNew { found: 99, .. }),
        "{error}"
    );
}

#[tokio::test]
async fn a_worker_refuses_an_unmigrated_database() {
    let db = test_db().await;
    sqlx::query("DROP SCHEMA skiplock CASCADE")
        .execute(&db.pool)
        .await
        .unwrap();
    let recorder = Recorder::default();
    let error = fast_worker(&db.pool, &recorder)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "the database schema is at version 0, this skiplock needs version {SCHEMA_VERSION_LATEST}; run `skiplock migrate` (or `skiplock::migrate(&pool)`)"
        )
    );
}

/// The limit is the database's, per pool when the pool's sessions set
/// `skiplock.args_max_bytes` (no process-wide setting in the library): a pool limited to
/// 5000 bytes refuses 5001 while the default pool, on the same database, takes it.
#[tokio::test]
async fn oversized_args_are_refused_with_the_limit_of_the_pools_sessions() {
    let db = test_db().await;
    // The default of the database's setting `skiplock.args_max_bytes`: 1 MiB.
    let limit = 1024 * 1024;
    let big = json!({ "blob": "x".repeat(limit) });
    let error = skiplock::enqueue_raw(&db.pool, &[NewJob::new("noop", big)])
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "invalid job: args are {} bytes, over the limit of {limit} bytes; hint: store large data elsewhere and pass a reference, or raise the setting skiplock.args_max_bytes",
            limit + 12
        )
    );

    let options: sqlx::postgres::PgConnectOptions = db.url().parse().unwrap();
    let small = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.options([("skiplock.args_max_bytes", "5000")]))
        .await
        .unwrap();
    // {"blob": "…"} is 12 bytes around the string.
    let over = json!({ "blob": "x".repeat(4989) });
    let error = skiplock::enqueue_raw(&small, &[NewJob::new("noop", over.clone())])
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "invalid job: args are 5001 bytes, over the limit of 5000 bytes; hint: store large data elsewhere and pass a reference, or raise the setting skiplock.args_max_bytes"
    );
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(count, 0);
    skiplock::enqueue_raw(&db.pool, &[NewJob::new("noop", over)])
        .await
        .expect("the default pool takes it");
}

#[tokio::test]
async fn sql_enqueue_takes_a_plain_integer_priority_and_refuses_one_out_of_range() {
    // Regression: `priority => 5` failed ("function skiplock.enqueue(...) does not exist")
    // unless written `5::smallint`.
    let db = test_db().await;
    let id: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('k', '{}', priority => 5)")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let priority: i16 = sqlx::query_scalar("SELECT priority FROM skiplock.jobs WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(priority, 5);
    let refused =
        sqlx::query_scalar::<_, i64>("SELECT skiplock.enqueue('k', '{}', priority => 40000)")
            .fetch_one(&db.pool)
            .await
            .unwrap_err();
    let message = refused.as_database_error().unwrap().message().to_owned();
    assert_eq!(
        message,
        "priority must be between -32768 and 32767 (lower runs first), not 40000"
    );
}

/// An enqueue says what it did, in Rust and in SQL: a new job, or one its unique key folded
/// into the pending job of that key by the key's policy (before, both returned an id alone
/// and a duplicate looked like a new job).
#[tokio::test]
async fn an_enqueue_tells_a_new_job_from_a_unique_key_duplicate() {
    use skiplock::{EnqueueOutcome, UniquePolicy};
    let db = test_db().await;
    let pool = &db.pool;
    let keyed = |policy| EnqueueOptions::new().unique_key("k", policy);
    let first = skiplock::enqueue(pool, &Record { n: 1 }, keyed(UniquePolicy::Skip))
        .await
        .unwrap();
    assert_eq!(first.outcome, EnqueueOutcome::Inserted);
    for (policy, expected) in [
        (UniquePolicy::Skip, EnqueueOutcome::Skipped),
        (UniquePolicy::Replace, EnqueueOutcome::Replaced),
        (UniquePolicy::Merge, EnqueueOutcome::Merged),
    ] {
        let again = skiplock::enqueue(pool, &Record { n: 2 }, keyed(policy))
            .await
            .unwrap();
        assert_eq!((again.id, again.outcome), (first.id, expected));
    }
    let plain = skiplock::enqueue(pool, &Record { n: 3 }, EnqueueOptions::new())
        .await
        .unwrap();
    assert_eq!(plain.outcome, EnqueueOutcome::Inserted);
    assert_ne!(plain.id, first.id);
    // A batch: the second job of the batch meets the first one's key.
    let batch = [json!({"n": 4}), json!({"n": 5})].map(|args| {
        NewJob::new("record", args)
            .with_options(EnqueueOptions::new().unique_key("b", UniquePolicy::Skip))
    });
    let results = skiplock::enqueue_raw(pool, &batch).await.unwrap();
    assert_eq!(
        results.iter().map(|r| r.outcome).collect::<Vec<_>>(),
        vec![EnqueueOutcome::Inserted, EnqueueOutcome::Skipped]
    );
    assert_eq!(results[0].id, results[1].id);

    // In SQL: skiplock.enqueue_job returns the id and the outcome; skiplock.enqueue the id.
    let (id, outcome): (i64, String) = sqlx::query_as(
        "SELECT * FROM skiplock.enqueue_job('record', '{\"n\": 6}', unique_key => 'k')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((id, outcome.as_str()), (first.id.0, "skipped"));
    let (_, outcome): (i64, String) =
        sqlx::query_as("SELECT * FROM skiplock.enqueue_job('record', '{\"n\": 7}')")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(outcome, "inserted");
    let id: i64 =
        sqlx::query_scalar("SELECT skiplock.enqueue('record', '{\"n\": 8}', unique_key => 'k')")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(id, first.id.0);
}
