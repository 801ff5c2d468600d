//! `skiplock migrate` of a newer schema while workers of this version drain: a compatible
//! migration changes nothing for them; an incompatible one makes them stop claiming, let
//! their running jobs finish and exit with the error that says to upgrade, and no job is
//! lost or left running. The next version is synthetic: a migration row one past this
//! build's, with a change written by hand.

mod common;

use std::time::Duration;

use common::fixtures::{
    AtGate, Gate, Recorder, Slow, count_in_state, fast_worker, steady_worker, wait_for,
};
use common::test_db;
use skiplock::db::migrations::SCHEMA_VERSION_LATEST;
use skiplock::{EnqueueOptions, Error, JobState};
use sqlx::PgPool;

/// Longest wait for a worker to settle what the database holds.
const PATIENCE: Duration = Duration::from_secs(60);

/// Applies a synthetic next migration: `change`, and the ledger row of version
/// `SCHEMA_VERSION_LATEST + 1`, in one transaction as `skiplock migrate` does, and, as it
/// does, again when Postgres chose it as a deadlock's victim (DDL on skiplock.jobs locks
/// the parent first; a claim writing jobs_live may lock the parent after it).
async fn migrate_to_next_version(pool: &PgPool, change: &'static str) {
    for attempt in 1.. {
        let mut tx = pool.begin().await.unwrap();
        let applied = async {
            sqlx::raw_sql(change).execute(&mut *tx).await?;
            sqlx::query(
                "INSERT INTO skiplock.schema_migrations (version, name) VALUES ($1, 'next.sql')",
            )
            .bind(SCHEMA_VERSION_LATEST + 1)
            .execute(&mut *tx)
            .await
        }
        .await;
        match applied {
            Ok(_) => return tx.commit().await.unwrap(),
            Err(sqlx::Error::Database(e))
                if e.code().as_deref() == Some("40P01") && attempt < 5 =>
            {
                eprintln!("the synthetic migration was a deadlock's victim; again");
            }
            Err(e) => panic!("the synthetic migration failed: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compatible_migration_leaves_running_workers_working() {
    let db = test_db().await;
    let pool = &db.pool;
    skiplock::enqueue_many(pool, &vec![Slow { ms: 20 }; 20], EnqueueOptions::default())
        .await
        .unwrap();
    let recorder = Recorder::default();
    // Not `exit_when_idle`: the worker could finish the first jobs and exit before the
    // second batch is enqueued.
    let worker = steady_worker(pool, &recorder)
        .concurrency(4)
        .build()
        .unwrap();
    let shutdown = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("a few jobs to succeed", PATIENCE, || async {
        count_in_state(pool, JobState::Succeeded).await >= 4
    })
    .await;
    migrate_to_next_version(pool, "ALTER TABLE skiplock.jobs ADD COLUMN note text").await;
    skiplock::enqueue_many(pool, &vec![Slow { ms: 20 }; 20], EnqueueOptions::default())
        .await
        .unwrap();
    wait_for("every job to succeed", PATIENCE, || async {
        count_in_state(pool, JobState::Succeeded).await == 40
    })
    .await;
    shutdown.shutdown();
    let summary = tokio::time::timeout(PATIENCE, run)
        .await
        .expect("the worker stops")
        .unwrap()
        .expect("a compatible migration does not stop the worker");
    assert_eq!(summary.succeeded, 40);
    assert!(recorder.runs().values().all(|runs| runs == &vec![1]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incompatible_migration_stops_workers_cleanly_and_loses_nothing() {
    // Regression: the worker logged "claim failed; retrying" forever.
    let db = test_db().await;
    let pool = &db.pool;
    skiplock::enqueue_many(pool, &vec![AtGate {}; 40], EnqueueOptions::default())
        .await
        .unwrap();
    let recorder = Recorder::default();
    let gate = Gate::closed();
    // A buffer of 4: with 4 running and 4 claimed ahead, most jobs are still queued when
    // the migration commits, however fast the machine.
    let worker = steady_worker(pool, &recorder)
        .register::<AtGate>()
        .data(gate.clone())
        .concurrency(4)
        .prefetch(4)
        .build()
        .unwrap();
    let run = tokio::spawn(worker.run());
    // Four jobs end, four more start and wait: the worker is draining.
    wait_for("the first four jobs to start", PATIENCE, || async {
        recorder.total() == 4
    })
    .await;
    gate.0.add_permits(4);
    wait_for(
        "four jobs to succeed and four more to run",
        PATIENCE,
        || async { count_in_state(pool, JobState::Succeeded).await == 4 && recorder.total() == 8 },
    )
    .await;
    // The next version renamed the claim function.
    migrate_to_next_version(
        pool,
        "ALTER FUNCTION skiplock.internal_claim_batch RENAME TO claim_batch_next",
    )
    .await;
    // The running jobs end after the migration: the worker lets them finish.
    gate.open();
    let result = tokio::time::timeout(PATIENCE, run)
        .await
        .expect("the worker stops by itself")
        .unwrap();
    match result {
        Err(Error::SchemaTooNew { found, supported }) => {
            assert_eq!(
                (found, supported),
                (SCHEMA_VERSION_LATEST + 1, SCHEMA_VERSION_LATEST)
            );
        }
        other => panic!("expected SchemaTooNew, got {other:?}"),
    }
    assert_eq!(
        count_in_state(pool, JobState::Running).await,
        0,
        "nothing is left running"
    );
    let unstarted: Vec<(i64, i32)> =
        sqlx::query_as("SELECT id, attempt FROM skiplock.jobs WHERE state = 'queued' ORDER BY id")
            .fetch_all(pool)
            .await
            .unwrap();
    assert!(!unstarted.is_empty(), "the worker stopped before the end");
    assert!(
        unstarted.iter().all(|(_, attempt)| *attempt == 0),
        "released jobs got their attempt back: {unstarted:?}"
    );

    // Upgraded (here: the change undone), a worker runs the rest.
    sqlx::raw_sql(
        "ALTER FUNCTION skiplock.claim_batch_next RENAME TO internal_claim_batch;
         DELETE FROM skiplock.schema_migrations WHERE version > (
             SELECT max(version) - 1 FROM skiplock.schema_migrations)",
    )
    .execute(pool)
    .await
    .unwrap();
    let worker = steady_worker(pool, &recorder)
        .register::<AtGate>()
        .data(gate)
        .concurrency(4)
        .exit_when_idle(true)
        .build()
        .unwrap();
    worker.run().await.unwrap();
    assert_eq!(count_in_state(pool, JobState::Succeeded).await, 40);
    let runs = recorder.runs();
    assert_eq!(runs.len(), 40);
    assert!(runs.values().all(|runs| runs == &vec![1]), "{runs:?}");
}

/// A database migrated by a development build from before the migrations were folded into
/// 0.1.0's (its ledger at version 13, version 1 named otherwise) is refused with what to
/// do, by `migrate` and by the start-up check: before, "newer than this skiplock
/// understands; upgrade skiplock" pointed the wrong way.
#[tokio::test]
async fn a_schema_from_before_the_fold_is_refused_with_what_to_do() {
    let db = test_db().await;
    sqlx::raw_sql(
        "DELETE FROM skiplock.schema_migrations;
         INSERT INTO skiplock.schema_migrations (version, name)
         SELECT v, format('%s_old.sql', lpad(v::text, 4, '0')) FROM generate_series(2, 13) v;
         INSERT INTO skiplock.schema_migrations (version, name) VALUES (1, '0001_jobs.sql');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut errors = vec![
        skiplock::migrate(&db.pool).await.unwrap_err(),
        skiplock::check_schema(&db.pool).await.unwrap_err(),
    ];
    // The numbering of the development builds between the two folds: version 1 named
    // `0001_schema.sql`, up to version 11 (here 13, to share the assertions).
    sqlx::raw_sql(
        "UPDATE skiplock.schema_migrations SET name = '0001_schema.sql' WHERE version = 1",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    errors.push(skiplock::migrate(&db.pool).await.unwrap_err());
    for error in [
        errors.pop().unwrap(),
        errors.pop().unwrap(),
        errors.pop().unwrap(),
    ] {
        assert!(
            matches!(error, Error::SchemaFromBeforeFold { found: 13 }),
            "{error:?}"
        );
        assert!(
            error.to_string().contains(
                "use a new database, or drop the schema (`DROP SCHEMA skiplock CASCADE`, which deletes its jobs) and run `skiplock migrate`"
            ),
            "{error}"
        );
    }
}

/// A database a development build migrated before 0001_initial.sql gained its newest
/// column (the ledger at version 1, named as today, the column missing) is refused with
/// what to do, by `migrate` and by the start-up check, and left as it was: upgraded in
/// place, it got functions that name a column it lacks, and every enqueue and claim failed.
#[tokio::test]
async fn a_schema_from_before_the_initial_migrations_last_column_is_refused() {
    let db = test_db().await;
    sqlx::raw_sql(
        "ALTER TABLE skiplock.jobs DROP COLUMN tracestate;
         UPDATE skiplock.schema_functions SET md5 = 'older'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    for error in [
        skiplock::migrate(&db.pool).await.unwrap_err(),
        skiplock::check_schema(&db.pool).await.unwrap_err(),
    ] {
        assert!(
            matches!(error, Error::SchemaFromBeforeFold { found: 1 }),
            "{error:?}"
        );
        assert!(error.to_string().contains("drop the schema"), "{error}");
    }
    let md5: String = sqlx::query_scalar("SELECT md5 FROM skiplock.schema_functions")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(md5, "older", "the functions were not applied");
}

/// The body of `skiplock.backoff` as the database holds it.
async fn backoff_body(pool: &PgPool) -> String {
    sqlx::query_scalar("SELECT prosrc FROM pg_proc WHERE oid = 'skiplock.backoff'::regproc")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A changed function body reaches a database through `migrate` alone (no migration file):
/// `migrations/functions/` is applied again when its text differs from the one last
/// applied, while workers drain, keeping the functions' owners and grants; an unchanged
/// text, or one recorded by a newer build, is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_function_bodies_are_applied_by_migrate_and_keep_grants() {
    let db = test_db().await;
    let pool = &db.pool;
    let role = format!("{}_caller", db.name);
    let current = backoff_body(pool).await;
    // As an older build left it: another body of one function, another text recorded,
    // and grants an operator gave.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE OR REPLACE FUNCTION skiplock.backoff(attempt int) RETURNS interval
         LANGUAGE sql AS $$ SELECT interval '1 second' $$;
         UPDATE skiplock.schema_functions SET md5 = 'older', skiplock_version = '0.0.1';
         CREATE ROLE {role};
         REVOKE ALL ON FUNCTION skiplock.internal_claim_batch FROM PUBLIC;
         GRANT EXECUTE ON FUNCTION skiplock.internal_claim_batch TO {role};"
    )))
    .execute(pool)
    .await
    .unwrap();
    let acl =
        "SELECT proacl::text FROM pg_proc WHERE oid = 'skiplock.internal_claim_batch'::regproc";
    let before: String = sqlx::query_scalar(acl).fetch_one(pool).await.unwrap();
    assert!(before.contains(&role), "{before}");

    skiplock::enqueue_many(pool, &vec![Slow { ms: 20 }; 40], EnqueueOptions::default())
        .await
        .unwrap();
    let recorder = Recorder::default();
    let worker = steady_worker(pool, &recorder)
        .concurrency(4)
        .build()
        .unwrap();
    let shutdown = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("a few jobs to succeed", PATIENCE, || async {
        count_in_state(pool, JobState::Succeeded).await >= 4
    })
    .await;
    skiplock::migrate(pool).await.unwrap();
    assert_eq!(backoff_body(pool).await, current, "the file's body is back");
    let after: Option<String> = sqlx::query_scalar(acl).fetch_one(pool).await.unwrap();
    assert_eq!(after.as_deref(), Some(before.as_str()), "grants kept");
    wait_for("every job to succeed", PATIENCE, || async {
        count_in_state(pool, JobState::Succeeded).await == 40
    })
    .await;
    shutdown.shutdown();
    tokio::time::timeout(PATIENCE, run)
        .await
        .expect("the worker stops")
        .unwrap()
        .expect("the functions' new text does not stop the worker");
    assert!(recorder.runs().values().all(|runs| runs == &vec![1]));

    // Recorded by a newer build: an older build's migrate leaves the functions alone.
    sqlx::raw_sql(
        "CREATE OR REPLACE FUNCTION skiplock.backoff(attempt int) RETURNS interval
         LANGUAGE sql AS $$ SELECT interval '2 seconds' $$;
         UPDATE skiplock.schema_functions SET md5 = 'newer', skiplock_version = '999.0.0';",
    )
    .execute(pool)
    .await
    .unwrap();
    skiplock::migrate(pool).await.unwrap();
    assert!(backoff_body(pool).await.contains("2 seconds"));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "REVOKE ALL ON FUNCTION skiplock.internal_claim_batch FROM {role}; DROP ROLE {role};"
    )))
    .execute(pool)
    .await
    .unwrap();
}

/// An outcome a worker cannot write on an upgraded schema is not lost and not marked dead:
/// the old worker leaves the job held and exits with the error that says to upgrade, and a
/// worker of the new version reaps the stale claim and runs the job again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_the_old_worker_cannot_write_is_reaped_and_run_by_a_new_one() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = skiplock::enqueue(pool, &AtGate {}, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let recorder = Recorder::default();
    let gate = Gate::closed();
    // Its claim never goes stale while it runs: the job must still be held, attempt 1, when
    // the migration commits.
    let worker = steady_worker(pool, &recorder)
        .register::<AtGate>()
        .data(gate.clone())
        .concurrency(1)
        .build()
        .unwrap();
    let run = tokio::spawn(worker.run());
    wait_for("the job to start", PATIENCE, || async {
        recorder.runs().contains_key(&id.0)
    })
    .await;
    // The next version renamed the completion: the running job's outcome cannot be written.
    migrate_to_next_version(
        pool,
        "ALTER FUNCTION skiplock.internal_complete_claims RENAME TO complete_claims_next",
    )
    .await;
    // Only now does the job end, its outcome to be written on the new schema.
    gate.open();
    let result = tokio::time::timeout(PATIENCE, run)
        .await
        .expect("the old worker stops by itself")
        .unwrap();
    assert!(
        matches!(result, Err(Error::SchemaTooNew { .. })),
        "{result:?}"
    );
    let held: (String, i32) =
        sqlx::query_as("SELECT state::text, attempt FROM skiplock.jobs WHERE id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        held,
        ("running".to_owned(), 1),
        "left held for the reaper, not dead"
    );

    // Upgraded (here: the change undone): a new worker reaps the stale claim and runs it.
    sqlx::raw_sql(
        "ALTER FUNCTION skiplock.complete_claims_next RENAME TO internal_complete_claims;
         DELETE FROM skiplock.schema_migrations WHERE version > (
             SELECT max(version) - 1 FROM skiplock.schema_migrations)",
    )
    .execute(pool)
    .await
    .unwrap();
    // Its reaper takes the old worker's claim back after 3 s without a heartbeat.
    let worker = fast_worker(pool, &recorder)
        .register::<AtGate>()
        .data(gate)
        .concurrency(1)
        .build()
        .unwrap();
    let shutdown = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the job to succeed", PATIENCE, || async {
        count_in_state(pool, JobState::Succeeded).await == 1
    })
    .await;
    shutdown.shutdown();
    run.await.unwrap().unwrap();
    assert_eq!(recorder.runs()[&id.0], vec![1, 2]);
    let last_error: Option<String> =
        sqlx::query_scalar("SELECT errors -> -1 ->> 'message' FROM skiplock.jobs WHERE id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(
        last_error.is_some_and(|e| e.contains("claim taken back")),
        "reaped, not failed"
    );
}
