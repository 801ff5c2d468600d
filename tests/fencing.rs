//! Claims are fenced: only the current holder changes a running job. Stale claims are
//! taken back by the reaper, and vanished workers' jobs run again.

mod common;

use std::time::Duration;

use common::fixtures::{
    AtGate, Gate, Record, Recorder, Slow, count_in_state, fast_worker, state_of, steady_worker,
    strings, wait_for, wait_for_a_lock_wait,
};
use common::test_db;
use skiplock::db::jobs::{
    FailAction, FailBatch, RunningNote, jobs_claim_batch, jobs_complete_many, jobs_fail_many,
    jobs_heartbeat_many, jobs_release_many, jobs_set_note,
};
use skiplock::db::maintenance::jobs_reap_stale;
use skiplock::{EnqueueOptions, JobState};

#[tokio::test]
async fn a_reaped_and_reclaimed_job_ignores_its_former_holder() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = skiplock::enqueue(pool, &Record { n: 1 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let (queue, kinds) = ("default", strings(&["record"]));

    let first = jobs_claim_batch(pool, queue, &kinds, 10, "worker-a")
        .await
        .unwrap();
    assert_eq!(first.len(), 1);
    let old = first[0].claim_token;

    // Worker A goes quiet: its heartbeat ages past the stale timeout and the reaper runs.
    sqlx::query(
        "UPDATE skiplock.jobs SET heartbeat_at = now() - interval '1 minute' WHERE id = $1",
    )
    .bind(id.0)
    .execute(pool)
    .await
    .unwrap();
    let reaped = jobs_reap_stale(pool, 30_000, 100).await.unwrap();
    assert_eq!(reaped.len(), 1);
    assert_eq!(reaped[0].state, JobState::Queued);
    assert_eq!(reaped[0].claimed_by.as_deref(), Some("worker-a"));
    // Skip the backoff so worker B can claim it now.
    sqlx::query("UPDATE skiplock.jobs SET scheduled_at = now() WHERE id = $1")
        .bind(id.0)
        .execute(pool)
        .await
        .unwrap();
    let second = jobs_claim_batch(pool, queue, &kinds, 10, "worker-b")
        .await
        .unwrap();
    assert_eq!(second.len(), 1);
    let new = second[0].claim_token;
    assert_ne!(old, new);
    assert_eq!(second[0].attempt, 2);

    // Worker A wakes up: its heartbeat learns the claim is gone, and none of its writes lands.
    let lost = jobs_heartbeat_many(pool, &[id.0], &[old], &[])
        .await
        .unwrap();
    assert_eq!(lost, vec![(id.0, old)]);
    assert!(
        jobs_complete_many(pool, &[id.0], &[old])
            .await
            .unwrap()
            .is_empty()
    );
    let mut failure = FailBatch::default();
    failure.push(id.0, old, "late failure".into(), 0, FailAction::Dead);
    assert!(jobs_fail_many(pool, &failure).await.unwrap().is_empty());
    assert!(
        jobs_release_many(pool, &[id.0], &[old], &[0])
            .await
            .unwrap()
            .is_empty()
    );
    let row = skiplock::job(pool, id).await.unwrap().unwrap();
    assert_eq!(row.state, JobState::Running);
    assert_eq!(common::fixtures::claim_token_of(pool, id).await, Some(new));
    assert_eq!(row.claimed_by.as_deref(), Some("worker-b"));

    // Worker B holds the real claim.
    let heartbeat_at = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
            "SELECT heartbeat_at FROM skiplock.jobs WHERE id = $1",
        )
        .bind(id.0)
        .fetch_one(pool)
        .await
        .unwrap()
    };
    let before = heartbeat_at().await;
    let lost = jobs_heartbeat_many(pool, &[id.0], &[new], &[])
        .await
        .unwrap();
    assert!(lost.is_empty(), "B's claim holds");
    assert!(heartbeat_at().await > before, "B's heartbeat extended it");
    let saved = jobs_complete_many(pool, &[id.0], &[new]).await.unwrap();
    assert_eq!(saved.iter().map(|s| s.id).collect::<Vec<_>>(), vec![id.0]);
    let row = skiplock::job(pool, id).await.unwrap().unwrap();
    assert_eq!(row.state, JobState::Succeeded);
    // And A's late completion still changes nothing on the finished job.
    assert!(
        jobs_complete_many(pool, &[id.0], &[old])
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        jobs_complete_many(pool, &[id.0], &[new])
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn the_reaper_never_resets_a_finished_job() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = skiplock::enqueue(pool, &Record { n: 1 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let claimed = jobs_claim_batch(pool, "default", &strings(&["record"]), 1, "w")
        .await
        .unwrap();
    sqlx::query("UPDATE skiplock.jobs SET heartbeat_at = now() - interval '1 hour'")
        .execute(pool)
        .await
        .unwrap();
    // The holder completes just before the reaper looks: the reaper finds nothing.
    jobs_complete_many(pool, &[id.0], &[claimed[0].claim_token])
        .await
        .unwrap();
    assert!(jobs_reap_stale(pool, 1_000, 100).await.unwrap().is_empty());
    assert_eq!(state_of(pool, id.0).await, JobState::Succeeded);
}

#[tokio::test]
async fn an_exhausted_stale_job_goes_dead_with_the_reason() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = skiplock::enqueue(
        pool,
        &Record { n: 1 },
        EnqueueOptions::new().max_attempts(1),
    )
    .await
    .unwrap()
    .id;
    jobs_claim_batch(pool, "default", &strings(&["record"]), 1, "gone-worker")
        .await
        .unwrap();
    sqlx::query("UPDATE skiplock.jobs SET heartbeat_at = now() - interval '1 hour'")
        .execute(pool)
        .await
        .unwrap();
    let reaped = jobs_reap_stale(pool, 1_000, 100).await.unwrap();
    assert_eq!(reaped[0].state, JobState::Dead);
    let row = skiplock::job(pool, id).await.unwrap().unwrap();
    assert_eq!(row.state, JobState::Dead);
    assert!(
        row.finished_at.is_some() && common::fixtures::claim_token_of(pool, id).await.is_none()
    );
    assert_eq!(
        row.last_error.as_deref(),
        Some("no heartbeat from gone-worker for over 1000 ms; claim taken back")
    );
}

#[tokio::test]
async fn jobs_of_a_vanished_worker_run_again_after_the_stale_timeout() {
    let db = test_db().await;
    let pool = &db.pool;
    let ids = common::ids(
        skiplock::enqueue_many(pool, &vec![Record { n: 0 }; 3], EnqueueOptions::default())
            .await
            .unwrap(),
    );
    // A worker claims them and vanishes without a trace: no heartbeat, no release.
    let claimed = jobs_claim_batch(pool, "default", &strings(&["record"]), 10, "vanished")
        .await
        .unwrap();
    assert_eq!(claimed.len(), 3);

    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder).build().unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the jobs to run again", Duration::from_secs(60), || async {
        count_in_state(pool, JobState::Succeeded).await == 3
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
    for id in ids {
        assert_eq!(
            recorder.runs()[&id.0],
            vec![2],
            "second attempt, on the live worker"
        );
        let row = skiplock::job(pool, id).await.unwrap().unwrap();
        assert!(
            row.errors.0[0]["message"]
                .as_str()
                .unwrap()
                .starts_with("no heartbeat from vanished")
        );
    }
}

#[tokio::test]
async fn a_worker_whose_claim_is_taken_stops_the_handler_and_discards_its_outcome() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = skiplock::enqueue(pool, &Slow { ms: 600_000 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let recorder = Recorder::default();
    // One slot: a second job can only run once the first handler has been stopped.
    let worker = fast_worker(pool, &recorder).concurrency(1).build().unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("the job to start", Duration::from_secs(60), || async {
        recorder.total() == 1
    })
    .await;

    // An operator cancels the running job: its claim is void at once.
    assert!(skiplock::cancel(pool, id).await.unwrap());
    let next = skiplock::enqueue(pool, &Record { n: 2 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    // The next heartbeat finds the claim gone and stops the handler, freeing the slot.
    wait_for(
        "the next job to run in the freed slot",
        Duration::from_secs(60),
        || async { recorder.runs().contains_key(&next.0) },
    )
    .await;
    stop.shutdown();
    let summary = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("shutdown is not held up")
        .unwrap()
        .unwrap();
    assert_eq!(summary.lost, 1);
    assert_eq!(summary.released, 0);
    assert_eq!(state_of(pool, id.0).await, JobState::Cancelled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claimers_never_share_a_job() {
    let db = test_db().await;
    let pool = &db.pool;
    skiplock::enqueue_many(
        pool,
        &(0..2000).map(|n| Record { n }).collect::<Vec<_>>(),
        EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let claimers: Vec<_> = (0..8)
        .map(|i| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut mine = Vec::new();
                loop {
                    let batch = jobs_claim_batch(
                        &pool,
                        "default",
                        &strings(&["record"]),
                        37,
                        &format!("c{i}"),
                    )
                    .await
                    .unwrap();
                    assert!(batch.len() <= 37, "a batch never exceeds its limit");
                    if batch.is_empty() {
                        return mine;
                    }
                    mine.extend(batch.into_iter().map(|job| job.id));
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for claimer in claimers {
        all.extend(claimer.await.unwrap());
    }
    let total = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!((total, all.len()), (2000, 2000), "every job claimed once");
}

/// The heartbeat extends the jobs of a claim whose reply the worker has not read yet by the
/// claim's token, and only those; like the beat of held claims, it skips a row another
/// session holds locked (an operator's `SELECT … FOR UPDATE`, a commit in flight) instead
/// of queueing behind it, where the whole beat would wait and every claim go stale.
#[tokio::test]
async fn a_heartbeat_of_a_claim_in_flight_extends_its_jobs_and_skips_locked_rows() {
    let db = test_db().await;
    let pool = &db.pool;
    for n in 0..3 {
        skiplock::enqueue(pool, &Record { n }, EnqueueOptions::default())
            .await
            .unwrap();
    }
    let (queue, kinds) = ("default", strings(&["record"]));
    let token = uuid::Uuid::new_v4();
    let claimed = skiplock::db::jobs::jobs_claim_batch_after(
        pool,
        queue,
        &kinds,
        2,
        "worker-a",
        None,
        Some(token),
    )
    .await
    .unwrap();
    let other = jobs_claim_batch(pool, queue, &kinds, 1, "worker-b")
        .await
        .unwrap();
    let (locked, beaten, others) = (claimed[0].id, claimed[1].id, other[0].id);
    sqlx::query("UPDATE skiplock.jobs SET heartbeat_at = now() - interval '1 minute'")
        .execute(pool)
        .await
        .unwrap();
    let mut operator = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM skiplock.jobs WHERE id = $1 FOR UPDATE")
        .bind(locked)
        .execute(&mut *operator)
        .await
        .unwrap();

    let mut conn = pool.acquire().await.unwrap();
    // A beat that waited for the lock would fail here instead of hanging.
    sqlx::query("SET lock_timeout = '2s'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let lost = jobs_heartbeat_many(&mut *conn, &[], &[], &[token])
        .await
        .unwrap();
    assert!(lost.is_empty());
    operator.rollback().await.unwrap();

    let fresh: Vec<(i64, bool)> = sqlx::query_as(
        "SELECT id, heartbeat_at > now() - interval '30 seconds' FROM skiplock.jobs
         WHERE state = 'running' ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut expected = vec![(locked, false), (beaten, true), (others, false)];
    expected.sort_unstable();
    assert_eq!(fresh, expected);
}

/// A claim that waited behind a lock (an operator's `LOCK TABLE`, a migration) for longer
/// than the stale timeout must not commit its jobs already stale: their first heartbeat is
/// the time the claim took them, not the time its transaction began. Before the fix the
/// claim stamped `now()`, its transaction's start, and the next reaper pass took the jobs
/// back while their worker was starting them, so they ran twice.
#[tokio::test]
async fn a_claim_that_waited_on_a_lock_does_not_commit_its_jobs_stale() {
    const STALE_MS: i64 = 1_000;
    let db = test_db().await;
    let pool = &db.pool;
    for n in 0..2 {
        skiplock::enqueue(pool, &Record { n }, EnqueueOptions::default())
            .await
            .unwrap();
    }
    let mut operator = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE skiplock.queues IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *operator)
        .await
        .unwrap();
    let claim = tokio::spawn({
        let pool = pool.clone();
        async move {
            let (queue, kinds) = ("default", strings(&["record"]));
            jobs_claim_batch(&pool, queue, &kinds, 10, "worker-a")
                .await
                .unwrap()
        }
    });
    // The claim waits for the lock until its transaction is older than the stale timeout.
    wait_for(
        "the claim to wait past the stale timeout",
        Duration::from_secs(60),
        || async {
            let waited: Option<bool> = sqlx::query_scalar(
                "SELECT now() - xact_start > $1 * interval '1 millisecond' + interval '200 ms'
             FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query LIKE '%claim_batch%'
               AND pid <> pg_backend_pid()",
            )
            .bind(STALE_MS as f64)
            .fetch_optional(pool)
            .await
            .unwrap();
            waited == Some(true)
        },
    )
    .await;
    // The database clock before the lock goes: the claim, which waits for it, takes its
    // jobs after this.
    let released: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&mut *operator)
        .await
        .unwrap();
    operator.commit().await.unwrap();
    let claimed = claim.await.unwrap();
    assert_eq!(claimed.len(), 2);

    // Their first heartbeat is when the claim took them, after the lock went (its
    // transaction began more than the stale timeout before): not stale. Compared with the
    // clock read above rather than by a reaper pass with the stale timeout, which would
    // also take them back if it came that long after the claim (a loaded machine).
    let heartbeats: Vec<(i64, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT id, heartbeat_at FROM skiplock.jobs WHERE state = 'running' ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(heartbeats.len(), 2, "{heartbeats:?}");
    for (id, heartbeat_at) in &heartbeats {
        assert!(
            *heartbeat_at >= released,
            "job {id} was claimed with a heartbeat ({heartbeat_at}) from before the lock went \
             ({released}), stale as soon as committed"
        );
    }
}

/// Claims job `id` as `worker-a`, takes the claim back as the reaper does, claims it
/// again as `worker-b`; returns (a's stale token, b's live token).
async fn reclaimed(pool: &sqlx::PgPool, id: i64) -> (uuid::Uuid, uuid::Uuid) {
    let (queue, kinds) = ("default", strings(&["record"]));
    let first = jobs_claim_batch(pool, queue, &kinds, 10, "worker-a")
        .await
        .unwrap();
    assert_eq!(first.len(), 1);
    sqlx::query(
        "UPDATE skiplock.jobs SET heartbeat_at = now() - interval '1 minute' WHERE id = $1",
    )
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(jobs_reap_stale(pool, 30_000, 100).await.unwrap().len(), 1);
    sqlx::query("UPDATE skiplock.jobs SET scheduled_at = now() WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
    let second = jobs_claim_batch(pool, queue, &kinds, 10, "worker-b")
        .await
        .unwrap();
    assert_eq!(second.len(), 1);
    (first[0].claim_token, second[0].claim_token)
}

/// Progress and output (`JobContext::set_progress`, `set_output`) are fenced like every
/// write: the former holder's notes change nothing, the live holder's land.
#[tokio::test]
async fn a_former_holder_writes_no_progress_or_output() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = skiplock::enqueue(pool, &Record { n: 1 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let (old, new) = reclaimed(pool, id.0).await;
    let notes = || async {
        sqlx::query_as::<_, (Option<serde_json::Value>, Option<serde_json::Value>)>(
            "SELECT progress, output FROM skiplock.jobs WHERE id = $1",
        )
        .bind(id.0)
        .fetch_one(pool)
        .await
        .unwrap()
    };
    for note in [RunningNote::Progress, RunningNote::Output] {
        let written = jobs_set_note(pool, id.0, old, note, &serde_json::json!({"from": "a"}))
            .await
            .unwrap();
        assert!(!written, "a stale {note:?} write reports that it landed");
    }
    assert_eq!(
        notes().await,
        (None, None),
        "a's stale notes changed nothing"
    );
    for note in [RunningNote::Progress, RunningNote::Output] {
        let written = jobs_set_note(pool, id.0, new, note, &serde_json::json!({"from": "b"}))
            .await
            .unwrap();
        assert!(written, "b's {note:?} lands");
    }
    let b = Some(serde_json::json!({"from": "b"}));
    assert_eq!(notes().await, (b.clone(), b));
}

/// A handler's `JobError::cancel` is saved through the failure batch with the action
/// `Cancel`; from a former holder it changes nothing, and the live claim keeps running.
#[tokio::test]
async fn a_former_holder_cannot_cancel_the_job() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = skiplock::enqueue(pool, &Record { n: 1 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let (old, new) = reclaimed(pool, id.0).await;
    let mut cancel = FailBatch::default();
    cancel.push(id.0, old, "late cancel".into(), 0, FailAction::Cancel);
    assert!(jobs_fail_many(pool, &cancel).await.unwrap().is_empty());
    let row = skiplock::job(pool, id).await.unwrap().unwrap();
    assert_eq!(
        (
            row.state,
            common::fixtures::claim_token_of(pool, id).await,
            row.claimed_by.as_deref()
        ),
        (JobState::Running, Some(new), Some("worker-b"))
    );
    assert_ne!(row.last_error.as_deref(), Some("late cancel"));
    // The live holder's cancel is saved.
    let mut cancel = FailBatch::default();
    cancel.push(id.0, new, "cancelled by b".into(), 0, FailAction::Cancel);
    assert_eq!(jobs_fail_many(pool, &cancel).await.unwrap().len(), 1);
    let row = skiplock::job(pool, id).await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.last_error.as_deref()),
        (JobState::Cancelled, Some("cancelled by b"))
    );
}

/// A progress or output note that waits for its job's row while an operator cancels the
/// job (the row moves to the finished partition, and Postgres reports 40001 "moved to
/// another partition") writes nothing and says so, as for a stale token, instead of
/// failing the handler with a database error (issue 37).
#[tokio::test]
async fn a_note_that_meets_its_job_cancelled_under_it_writes_nothing() {
    let db = test_db().await;
    let pool = &db.pool;
    let id = skiplock::enqueue(pool, &Record { n: 1 }, EnqueueOptions::default())
        .await
        .unwrap()
        .id;
    let (queue, kinds) = ("default", strings(&["record"]));
    let claimed = jobs_claim_batch(pool, queue, &kinds, 10, "worker-a")
        .await
        .unwrap();
    let token = claimed[0].claim_token;
    let mut operator = pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE skiplock.jobs SET state = 'cancelled', claim_token = NULL, finished_at = now()
         WHERE id = $1",
    )
    .bind(id.0)
    .execute(&mut *operator)
    .await
    .unwrap();
    let note = tokio::spawn({
        let pool = pool.clone();
        async move {
            jobs_set_note(
                &pool,
                id.0,
                token,
                RunningNote::Progress,
                &serde_json::json!({"p": 1}),
            )
            .await
        }
    });
    common::fixtures::wait_for_a_lock_wait(pool, "the note to wait for the row").await;
    operator.commit().await.unwrap();
    let written = note.await.unwrap().expect("the note reports, not fails");
    assert!(!written, "nothing is written for a job no longer running");
    assert_eq!(state_of(pool, id.0).await, JobState::Cancelled);
    let progress: Option<serde_json::Value> =
        sqlx::query_scalar("SELECT progress FROM skiplock.jobs WHERE id = $1")
            .bind(id.0)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(progress, None);
}

/// Waits at the worker's [`Gate`], then ends its attempt as `ends` says.
#[derive(serde::Serialize, serde::Deserialize)]
struct EndsAtGate {
    ends: String,
}

impl skiplock::Job for EndsAtGate {
    const KIND: &'static str = "ends_at_gate";

    async fn run(self, ctx: skiplock::JobContext) -> Result<(), skiplock::JobError> {
        common::fixtures::recorder(&ctx).record(&ctx);
        let gate = ctx.data::<Gate>().expect("a Gate on the worker");
        if let Ok(permit) = gate.0.acquire().await {
            permit.forget();
        }
        match self.ends.as_str() {
            "complete" => Ok(()),
            "retry" => Err(skiplock::JobError::retry("planned failure")),
            "permanent" => Err(skiplock::JobError::permanent("planned failure")),
            "snooze" => Err(skiplock::JobError::snooze(Duration::from_secs(60))),
            other => panic!("no ending {other}"),
        }
    }
}

/// Each outcome the worker writes (a completion, a failure to retry, a permanent one, a
/// snooze) while another transaction moves the job's row to the finished partition (an
/// operator's cancel written by hand, which the write waits for): the write meets
/// SQLSTATE 40001, runs again, finds the claim gone and saves nothing; the job stays
/// cancelled and the worker reports the claim lost. Nothing is saved twice and nothing
/// errors out of the worker.
#[tokio::test]
async fn an_outcome_written_while_the_jobs_row_moves_is_not_saved() {
    for ends in ["complete", "retry", "permanent", "snooze"] {
        let db = test_db().await;
        let pool = &db.pool;
        let id = skiplock::enqueue(
            pool,
            &EndsAtGate {
                ends: ends.to_owned(),
            },
            EnqueueOptions::default(),
        )
        .await
        .unwrap()
        .id;
        let recorder = Recorder::default();
        let gate = Gate::closed();
        let worker = steady_worker(pool, &recorder)
            .register::<EndsAtGate>()
            .data(gate.clone())
            .build()
            .unwrap();
        let stop = worker.shutdown_handle();
        let run = tokio::spawn(worker.run());
        wait_for("the job to start", Duration::from_secs(60), || async {
            recorder.total() == 1
        })
        .await;
        let mut mover = pool.begin().await.unwrap();
        sqlx::query(
            "UPDATE skiplock.jobs SET state = 'cancelled', finished_at = now(),
                                      claim_token = NULL, heartbeat_at = NULL
             WHERE id = $1",
        )
        .bind(id.0)
        .execute(&mut *mover)
        .await
        .unwrap();
        gate.0.add_permits(1);
        wait_for_a_lock_wait(pool, &format!("the worker's write of {ends} to wait")).await;
        mover.commit().await.unwrap();
        stop.shutdown();
        let summary = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .expect("shutdown is not held up")
            .unwrap()
            .unwrap();
        assert_eq!(
            (
                summary.succeeded,
                summary.failed,
                summary.snoozed,
                summary.lost
            ),
            (0, 0, 0, 1),
            "{ends}: {summary:?}"
        );
        let row: (String, Option<String>, Option<serde_json::Value>) = sqlx::query_as(
            "SELECT state::text, last_error, output FROM skiplock.jobs WHERE id = $1",
        )
        .bind(id.0)
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(row, ("cancelled".to_owned(), None, None), "{ends}");
    }
}

/// A job claimed by a worker whose slots are all taken waits there at most the stale
/// timeout: then the heartbeat gives its claim back to the queue (released, the attempt not
/// counted) and whichever worker claims it next runs it. Before, it stayed claimed and
/// heartbeated for as long as the job in its way ran, while other workers sat idle, and a
/// dispatcher that never got its slot kept it for as long as the process lived (the
/// randomized model once saw two lane heads claimed and never started). Here one slot, two
/// jobs: one runs at a closed gate, the other waits in the worker; the queue is paused once
/// both are claimed, so that nobody claims the second again, and it must come back queued
/// with its attempt given back while the first still runs. Then both run once.
#[tokio::test]
async fn a_job_that_waits_too_long_for_a_slot_is_given_back_to_the_queue() {
    let db = test_db().await;
    let pool = &db.pool;
    let mut ids = Vec::new();
    for _ in 0..2 {
        ids.push(
            skiplock::enqueue(pool, &AtGate {}, EnqueueOptions::default())
                .await
                .unwrap()
                .id
                .0,
        );
    }
    let recorder = Recorder::default();
    let gate = Gate::closed();
    let worker = fast_worker(pool, &recorder)
        .register::<AtGate>()
        .data(gate.clone())
        .concurrency(1)
        .prefetch(2)
        .heartbeat(Duration::from_millis(100), Duration::from_secs(2))
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for(
        "both jobs claimed, one started",
        Duration::from_secs(60),
        || async { recorder.total() == 1 && count_in_state(pool, JobState::Running).await == 2 },
    )
    .await;
    skiplock::pause_queue(pool, "default").await.unwrap();
    let started = *recorder.runs().keys().next().unwrap();
    let waiting = *ids.iter().find(|id| **id != started).unwrap();
    wait_for(
        "the job waiting for a slot to be given back",
        Duration::from_secs(60),
        || async { state_of(pool, waiting).await == JobState::Queued },
    )
    .await;
    let attempt: i32 = sqlx::query_scalar("SELECT attempt FROM skiplock.jobs WHERE id = $1")
        .bind(waiting)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(attempt, 0, "the attempt is given back");
    assert_eq!(state_of(pool, started).await, JobState::Running);
    assert_eq!(recorder.total(), 1, "the job given back never started here");

    skiplock::resume_queue(pool, "default").await.unwrap();
    gate.open();
    wait_for("both jobs to succeed", Duration::from_secs(60), || async {
        count_in_state(pool, JobState::Succeeded).await == 2
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
    let runs = recorder.runs();
    assert_eq!(
        (runs[&started].clone(), runs[&waiting].clone()),
        (vec![1], vec![1]),
        "each ran once, in its first attempt"
    );
}
