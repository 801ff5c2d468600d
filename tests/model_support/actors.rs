//! The actors of the fault phase, one function each. They run until
//! [`Sim::faults_over`](super::Sim) (the sampler until `sampling_over`). Every error an
//! actor gets that the contract does not allow is recorded as a violation; errors the
//! contract allows (a plain INSERT refused on a unique key, a parent pruned meanwhile)
//! are counted.

use std::time::Duration;

use serde_json::{Value, json};
use skiplock::{EnqueueOptions, JobId, NewJob, UniquePolicy};
use sqlx::PgPool;

use super::kind::Model;
use super::{CONCURRENCY_KEYS, LANES, QUEUES, Sim, UNIQUE_KEYS};

/// One job to enqueue, whatever the entry point.
#[derive(Debug, Clone)]
pub struct Spec {
    pub kind: &'static str,
    pub args: Value,
    pub queue: &'static str,
    pub priority: i16,
    pub max_attempts: i32,
    pub delay_ms: u64,
    pub lane: Option<&'static str>,
    pub unique: Option<(&'static str, UniquePolicy)>,
    pub parents: Vec<i64>,
    pub concurrency_key: Option<&'static str>,
}

/// A random job: mostly the in-process `model` kind, some testbed kinds; in a lane, or
/// with a unique key, or with parents among recent jobs (the API refuses combinations).
pub fn random_spec(sim: &Sim, rng: &mut fastrand::Rng, via: &str) -> Spec {
    let kind = match rng.u8(0..100) {
        0..75 => "model",
        75..87 => "record",
        87..94 => "panic",
        _ => "never_return",
    };
    let args = match kind {
        "model" => json!({"via": via, "n": rng.u32(..)}),
        "record" => json!({"ms": rng.u64(0..300)}),
        _ => json!({}),
    };
    let mut spec = Spec {
        kind,
        args,
        queue: QUEUES[rng.usize(..QUEUES.len())],
        priority: [0, 0, 0, -1, 1][rng.usize(..5)],
        max_attempts: rng.i32(1..=4),
        delay_ms: if rng.u8(0..10) == 0 {
            rng.u64(0..400)
        } else {
            0
        },
        lane: None,
        unique: None,
        parents: Vec::new(),
        // Combinable with everything else.
        concurrency_key: (rng.u8(0..100) < 40)
            .then(|| CONCURRENCY_KEYS[rng.usize(..CONCURRENCY_KEYS.len())]),
    };
    match rng.u8(0..100) {
        0..35 => spec.lane = Some(LANES[rng.usize(..LANES.len())]),
        // Merged args are arrays, which only `model` decodes.
        35..60 if kind == "model" => {
            let policy = [
                UniquePolicy::Skip,
                UniquePolicy::Replace,
                UniquePolicy::Merge,
            ][rng.usize(..3)];
            spec.unique = Some((UNIQUE_KEYS[rng.usize(..UNIQUE_KEYS.len())], policy));
            spec.args["flaky"] = json!(true);
        }
        60..78 => {
            let n = rng.usize(1..=2);
            spec.parents = sim.pick_known(rng, 30, n);
        }
        _ => {}
    }
    spec
}

fn options(spec: &Spec) -> EnqueueOptions {
    let mut options = EnqueueOptions::new()
        .queue(spec.queue)
        .priority(spec.priority)
        .max_attempts(spec.max_attempts)
        .depends_on(spec.parents.iter().map(|&id| JobId(id)));
    if spec.delay_ms > 0 {
        options = options.run_after(Duration::from_millis(spec.delay_ms));
    }
    if let Some(lane) = spec.lane {
        options = options.ordering_key(lane);
    }
    if let Some((key, policy)) = spec.unique {
        options = options.unique_key(key, policy);
    }
    if let Some(key) = spec.concurrency_key {
        options = options.concurrency_key(key);
    }
    options
}

/// Whether an enqueue error is one the contract allows: a parent that was pruned (or
/// deleted) before the child was enqueued.
fn parent_gone(error: &str) -> bool {
    error.contains("does not exist")
}

/// Enqueues through the Rust API: `enqueue` for one job, `enqueue_many` for a few
/// `model` jobs sharing options (a lane's burst, a unique key hit several times), and
/// `enqueue_raw` for the testbed kinds.
pub async fn enqueue_rust(sim: &Sim, pool: PgPool) {
    let mut rng = sim.rng("enqueue-rust");
    while sim.pace(rng.u64(30..150)).await {
        let spec = random_spec(sim, &mut rng, "rust");
        let result = if spec.kind != "model" {
            let job = NewJob::new(spec.kind, spec.args.clone()).with_options(options(&spec));
            skiplock::enqueue_raw(&pool, &[job]).await
        } else if rng.u8(0..3) == 0 {
            let jobs: Vec<Model> = (0..rng.usize(2..=4))
                .map(|i| Model(json!({"via": "rust-many", "n": rng.u32(..), "i": i})))
                .collect();
            skiplock::enqueue_many(&pool, &jobs, options(&spec)).await
        } else {
            skiplock::enqueue(&pool, &Model(spec.args.clone()), options(&spec))
                .await
                .map(|job| vec![job])
        };
        match result {
            Ok(ids) => {
                sim.count("enqueue rust");
                sim.remember(ids.into_iter().map(|job| job.id.0));
            }
            Err(e) if parent_gone(&e.to_string()) => sim.count("enqueue rust: parent gone"),
            Err(e) => sim.violation(format!("[enqueue] Rust enqueue of {spec:?} failed: {e}")),
        }
    }
}

/// Enqueues with the SQL function `skiplock.enqueue(...)`, named arguments.
pub async fn enqueue_sql(sim: &Sim, pool: PgPool) {
    let mut rng = sim.rng("enqueue-sql");
    while sim.pace(rng.u64(40..160)).await {
        let spec = random_spec(sim, &mut rng, "sql");
        let result: sqlx::Result<i64> = sqlx::query_scalar(
            "SELECT skiplock.enqueue($1, $2, queue => $3, priority => $4::smallint,
                                     scheduled_at => now() + $5 * interval '1 millisecond',
                                     max_attempts => $6, ordering_key => $7,
                                     unique_key => $8, on_conflict => $9,
                                     depends_on => $10::bigint[], concurrency_key => $11)",
        )
        .bind(spec.kind)
        .bind(&spec.args)
        .bind(spec.queue)
        .bind(spec.priority)
        .bind(spec.delay_ms as i64)
        .bind(spec.max_attempts)
        .bind(spec.lane)
        .bind(spec.unique.map(|(key, _)| key))
        .bind(spec.unique.map_or("skip", |(_, policy)| policy.as_str()))
        .bind(&spec.parents)
        .bind(spec.concurrency_key)
        .fetch_one(&pool)
        .await;
        match result {
            Ok(id) => {
                sim.count("enqueue sql");
                sim.remember([id]);
            }
            Err(e) if parent_gone(&e.to_string()) => sim.count("enqueue sql: parent gone"),
            Err(e) => sim.violation(format!(
                "[enqueue] SQL skiplock.enqueue of {spec:?} failed: {e}"
            )),
        }
    }
}

/// Enqueues with a plain `INSERT INTO skiplock.jobs`: with or without ordering and
/// unique keys, and jobs with parents as an insert plus `job_dependencies` rows in one
/// transaction (stored `waiting`, or left at the default state: the contract says a
/// child runs only after its parents succeeded either way).
pub async fn enqueue_insert(sim: &Sim, pool: PgPool) {
    let mut rng = sim.rng("enqueue-insert");
    while sim.pace(rng.u64(50..180)).await {
        let spec = random_spec(sim, &mut rng, "insert");
        let explicit_waiting = rng.bool();
        let result = insert_plain(&pool, &spec, explicit_waiting).await;
        match result {
            Ok(Some(id)) => {
                sim.count("enqueue insert");
                sim.remember([id]);
            }
            // The insert trigger folded the row into the pending job holding its unique
            // key (skip, replace or merge), as `skiplock.enqueue` would: no new row.
            Ok(None) if spec.unique.is_some() => {
                sim.count("enqueue insert: folded into pending job")
            }
            Ok(None) => sim.violation(format!(
                "[enqueue] plain INSERT of {spec:?} inserted no row"
            )),
            Err(e) if parent_gone(&e.to_string()) => sim.count("enqueue insert: parent gone"),
            // A plain INSERT that hits a pending job's unique key may be refused (the
            // contract allows "a clear error").
            Err(e)
                if spec.unique.is_some()
                    && e.to_string().contains("jobs_unique_key_pending_idx") =>
            {
                sim.count("enqueue insert: unique key refused")
            }
            Err(e) => sim.violation(format!("[enqueue] plain INSERT of {spec:?} failed: {e}")),
        }
    }
}

/// The new job's id; `None` when the insert stored no row (a unique key's conflict).
async fn insert_plain(
    pool: &PgPool,
    spec: &Spec,
    explicit_waiting: bool,
) -> sqlx::Result<Option<i64>> {
    let mut tx = pool.begin().await?;
    let waiting = !spec.parents.is_empty() && explicit_waiting;
    let id: Option<i64> = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, queue, priority, scheduled_at, max_attempts,
                                    ordering_key, unique_key, unique_policy, state,
                                    concurrency_key)
         VALUES ($1, $2, $3, $4, now() + $5 * interval '1 millisecond', $6, $7, $8, $9,
                 CASE WHEN $10 THEN 'waiting' ELSE 'queued' END::skiplock.job_state, $11)
         RETURNING id",
    )
    .bind(spec.kind)
    .bind(&spec.args)
    .bind(spec.queue)
    .bind(spec.priority)
    .bind(spec.delay_ms as i64)
    .bind(spec.max_attempts)
    .bind(spec.lane)
    .bind(spec.unique.map(|(key, _)| key))
    .bind(spec.unique.map(|(_, policy)| policy.as_str()))
    .bind(waiting)
    .bind(spec.concurrency_key)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(id) = id else {
        tx.commit().await?;
        return Ok(None);
    };
    if !spec.parents.is_empty() {
        sqlx::query(
            "INSERT INTO skiplock.job_dependencies (job_id, parent_id)
             SELECT $1, p FROM unnest($2::bigint[]) AS p",
        )
        .bind(id)
        .bind(&spec.parents)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(Some(id))
}

/// The operator over SQL: `retry_job`, `cancel_job`, now and then `retry_dead_jobs`, a
/// `DELETE` of a job that has not run yet, and a finished job dated two days back by hand.
/// None of them may fail (the writes by hand run again when their job moved between the
/// partitions under them, as the docs say).
pub async fn operate_sql(sim: &Sim, pool: PgPool) {
    let mut rng = sim.rng("operator-sql");
    while sim.pace(rng.u64(40..200)).await {
        let Some(&id) = sim.pick_known(&mut rng, 80, 1).first() else {
            continue;
        };
        let (what, result) = match rng.u8(0..100) {
            0..45 => (
                "retry_job",
                sqlx::query_scalar::<_, bool>("SELECT skiplock.retry_job($1)")
                    .bind(id)
                    .fetch_one(&pool)
                    .await
                    .map(|changed| changed as i64),
            ),
            45..77 => (
                "cancel_job",
                sqlx::query_scalar::<_, bool>("SELECT skiplock.cancel_job($1)")
                    .bind(id)
                    .fetch_one(&pool)
                    .await
                    .map(|changed| changed as i64),
            ),
            77..85 => ("date back", date_back_finished_from(sim, &pool, id).await),
            85..93 => (
                "retry_dead_jobs",
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM skiplock.retry_dead_jobs($1)")
                    .bind([None, Some("default"), Some("q2"), Some("q3")][rng.usize(..4)])
                    .fetch_one(&pool)
                    .await,
            ),
            _ => ("delete", delete_unfinished_from(sim, &pool, id).await),
        };
        match result {
            Ok(changed) => sim.count(&format!(
                "{what} ({})",
                if changed > 0 { "changed" } else { "no-op" }
            )),
            Err(e) => sim.violation(format!("[operator] {what}({id}) failed: {e}")),
        }
    }
}

/// A hand-written `DELETE` of the first unfinished job from `id` on (a picked job has usually
/// run by now, and a delete that finds nothing checks nothing).
async fn delete_unfinished_from(sim: &Sim, pool: &PgPool, id: i64) -> sqlx::Result<i64> {
    run_again_when_moved(
        sim,
        pool,
        "delete",
        "DELETE FROM skiplock.jobs
         WHERE id = (SELECT id FROM skiplock.jobs
                     WHERE id >= $1 AND state IN ('waiting', 'queued')
                     ORDER BY id LIMIT 1)
           AND state IN ('waiting', 'queued')",
        id,
    )
    .await
}

/// A hand-written `UPDATE` that dates the first job from `id` on that finished today two
/// days back: its row moves to that day's table, which the pruner then drops whole (its
/// retention is at most a day), and its id says it finished today, so every lookup of it by
/// id (a parent's, a watch's, a retry's) finds it only in the days before its id's. The
/// days two and three days back are made first, again after the pruner dropped them
/// (taking out of the default table the rows dated back while they were missing).
async fn date_back_finished_from(sim: &Sim, pool: &PgPool, id: i64) -> sqlx::Result<i64> {
    sqlx::query(
        "SELECT skiplock.internal_prepare_done_partitions((now() AT TIME ZONE 'UTC')::date - 3, 2)",
    )
    .execute(pool)
    .await?;
    run_again_when_moved(
        sim,
        pool,
        "date back",
        "UPDATE skiplock.jobs SET finished_at = finished_at - interval '2 days'
         WHERE id = (SELECT id FROM skiplock.jobs
                     WHERE id >= $1 AND state IN ('succeeded', 'dead', 'cancelled')
                       AND finished_at > now() - interval '1 day'
                     ORDER BY id LIMIT 1)
           AND state IN ('succeeded', 'dead', 'cancelled')
           AND finished_at > now() - interval '1 day'",
        id,
    )
    .await
}

/// Runs a write by hand of the job `id` (`what`, the statement), again when the job moved
/// between the live and finished partitions under it (40001), as docs/operating.md tells
/// whoever writes by hand: Postgres cannot follow a moved row. Returns the rows written.
async fn run_again_when_moved(
    sim: &Sim,
    pool: &PgPool,
    what: &str,
    statement: &'static str,
    id: i64,
) -> sqlx::Result<i64> {
    let mut attempts = 0;
    loop {
        match sqlx::query(statement).bind(id).execute(pool).await {
            Err(e) if attempts < 5 && e.to_string().contains("moved to another partition") => {
                attempts += 1;
                sim.count(&format!("{what} (run again: the job moved meanwhile)"));
            }
            other => return other.map(|r| r.rows_affected() as i64),
        }
    }
}

/// The operator on the command line: `skiplock retry ID` and `skiplock cancel ID`.
/// Exit 0 (done) or 1 with a refusal (`error: job N is running…`) is fine; anything else
/// (a database error, a usage error) is a violation.
pub async fn operate_cli(sim: &Sim) {
    let mut rng = sim.rng("operator-cli");
    while sim.pace(rng.u64(250..700)).await {
        let Some(&id) = sim.pick_known(&mut rng, 80, 1).first() else {
            continue;
        };
        let command = if rng.bool() { "retry" } else { "cancel" };
        let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_skiplock"))
            .args([command, &id.to_string()])
            .env("DATABASE_URL", &sim.url)
            // libpq's variable, which sqlx honours too: the audit's `app` says "model-cli".
            .env("PGAPPNAME", "model-cli")
            .env("NO_COLOR", "1")
            .env_remove("RUST_LOG")
            .output()
            .await
            .expect("run the skiplock binary");
        let stderr = String::from_utf8_lossy(&output.stderr);
        let refusals = [
            "is running",
            "is waiting for its parent",
            "cannot be retried now",
            "already finished",
            "does not exist",
        ];
        let refused = stderr
            .lines()
            .filter(|l| !l.trim().is_empty())
            // sqlx's warning about a slow statement is a log line, not an outcome: on a
            // loaded machine `retry_job` may wait seconds for its locks.
            .filter(|l| !l.contains("slow statement"))
            // Nor is the warning of a connection it retried: the shared server can be out
            // of connections for a moment (SQLSTATE 53300, seed 17 at 60 s).
            .filter(|l| !(l.contains(" WARN ") && l.contains("trying again in")))
            .all(|l| refusals.iter().any(|r| l.contains(r)) || l.contains("jobs unchanged"));
        match output.status.code() {
            Some(0) => sim.count(&format!("cli {command} (changed)")),
            Some(1) if refused => sim.count(&format!("cli {command} (refused)")),
            code => sim.violation(format!(
                "[cli] `skiplock {command} {id}` exited {code:?}: {}",
                stderr.trim()
            )),
        }
    }
}

/// Kills worker connections: one at random, every connection of one worker, or every
/// LISTEN connection. Only `tb-…` connections (workers) are touched.
pub async fn kill_connections(sim: &Sim, pool: PgPool) {
    let mut rng = sim.rng("killer");
    while sim.pace(rng.u64(250..1_000)).await {
        let backends: Vec<(i32, String, String)> = sqlx::query_as(
            "SELECT pid, application_name, coalesce(query, '') FROM pg_stat_activity
             WHERE datname = current_database() AND application_name LIKE 'tb-%'
               AND pid <> pg_backend_pid()
             ORDER BY pid",
        )
        .fetch_all(&pool)
        .await
        .expect("list worker connections");
        if backends.is_empty() {
            continue;
        }
        let victims: Vec<i32> = match rng.u8(0..10) {
            0..6 => vec![backends[rng.usize(..backends.len())].0],
            6..8 => {
                let app = &backends[rng.usize(..backends.len())].1;
                backends
                    .iter()
                    .filter(|b| &b.1 == app)
                    .map(|b| b.0)
                    .collect()
            }
            _ => backends
                .iter()
                .filter(|b| b.2.to_uppercase().starts_with("LISTEN"))
                .map(|b| b.0)
                .collect(),
        };
        sim.count("connections killed");
        for pid in victims {
            let _ = sqlx::query("SELECT pg_terminate_backend($1)")
                .bind(pid)
                .execute(&pool)
                .await;
        }
    }
}

/// Checks the rules the database state must obey at every instant: one pending (waiting
/// or queued) job per unique key, one running job per lane, and a job held back for its key
/// (`held_for`) only with a key and no lane (a lane keeps its jobs in order, never a key's
/// hold). A held job may have a parent that has not succeeded: one the operator retried
/// after the hold; the release passes over it until that parent succeeds.
pub async fn sample(sim: &Sim, pool: PgPool) {
    loop {
        tokio::select! {
            () = sim.sampling_over.cancelled() => return,
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        let pending: Vec<(String, Vec<i64>)> = sqlx::query_as(
            "SELECT unique_key, array_agg(id ORDER BY id) FROM skiplock.jobs
             WHERE unique_key IS NOT NULL AND state IN ('waiting', 'queued')
             GROUP BY unique_key HAVING count(*) > 1",
        )
        .fetch_all(&pool)
        .await
        .expect("sample unique keys");
        for (key, ids) in pending {
            sim.violation(format!(
                "[sampler] unique key {key} has several pending jobs {ids:?}"
            ));
        }
        let running: Vec<(String, Vec<i64>)> = sqlx::query_as(
            "SELECT ordering_key, array_agg(id ORDER BY id) FROM skiplock.jobs
             WHERE ordering_key IS NOT NULL AND state = 'running'
             GROUP BY ordering_key HAVING count(*) > 1",
        )
        .fetch_all(&pool)
        .await
        .expect("sample lanes");
        for (lane, ids) in running {
            sim.violation(format!(
                "[sampler] lane {lane} has several running jobs {ids:?}"
            ));
        }
        let misheld: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM skiplock.jobs_live
             WHERE state = 'waiting' AND held_for IS NOT NULL
               AND (concurrency_key IS NULL OR ordering_key IS NOT NULL)",
        )
        .fetch_all(&pool)
        .await
        .expect("sample held jobs");
        if !misheld.is_empty() {
            sim.violation(format!(
                "[sampler] jobs {misheld:?} are held for a key they do not have, or in a lane"
            ));
        }
        sim.count("samples");
    }
}
