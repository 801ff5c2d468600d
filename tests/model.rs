//! The randomized model test (issue 12): several concurrent actors drive the real system
//! through every entry point while workers are stopped, killed and cut off, then the
//! queue drains and the invariants are checked over the whole audit log.
//!
//! Actors (tests/model_support/actors.rs, workers.rs): enqueuers through the Rust API
//! (`enqueue`, `enqueue_many`, `enqueue_raw` with lanes, unique keys under each
//! policy, dependencies), the SQL function `skiplock.enqueue` and plain `INSERT`s (with
//! `job_dependencies` rows); an operator calling `retry_job`, `retry_dead_jobs`,
//! `cancel_job`, deleting jobs and dating finished ones two days back (their day's table
//! made again if dropped); an operator running `skiplock retry ID` and
//! `skiplock cancel ID`; two in-process workers (kind `model`: succeed, fail retryably or
//! permanently, give up, time out, panic) and one `skiplock-testbed` process (kinds
//! `record`, `panic`, `never_return`), restarted gracefully, at once, by SIGTERM or after
//! `kill -9`; a pruning worker (zero retention, a day for cancelled jobs: it deletes rows and
//! drops the days dated back whole); a killer of worker connections; and a
//! sampler checking the "at most one" rules while the run goes on. The second queue has
//! global limits (`max_running`, a rate limit, and `key_max_running` and a per-key rate
//! limit over three concurrency keys) for the whole run. The invariants are listed in
//! tests/model_support/checks.rs; every seed must take each path of [`PATHS_REQUIRED`]
//! (counted by tests/model_support/coverage.rs), its fault phase extended until it has.
//!
//! ```sh
//! cargo test --all-features --test model -- --nocapture            # the default seeds
//! SKIPLOCK_SIM_SEED=7 cargo test --all-features --test model -- --nocapture  # one seed
//! SKIPLOCK_SIM_SECS=120 cargo test --all-features --test model -- --nocapture  # longer
//! ```
#![cfg(feature = "testbed")]

mod common;
mod fault_support;
mod model_support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use model_support::checks::{Evidence, check_all, check_merged};
use model_support::coverage::coverage;
use model_support::workers::{Crew, start_pruner};
use model_support::{
    KEY_CLAIMABLE, KEYED_QUEUE, LIMITED_QUEUE, LIMITED_QUEUE_KEY_MAX, LIMITED_QUEUE_KEY_RATE,
    LIMITED_QUEUE_RATE, Sim, actors, extend_audit, logs,
};

/// Seeds run by default: the whole test stays within about two minutes on 2 cores.
const SEEDS_DEFAULT: [u64; 4] = [1, 2, 3, 4];
/// Seconds of fault phase per seed by default.
const SECS_DEFAULT: u64 = 14;
/// How much longer than planned a seed's fault phase may go on while it has not taken
/// every path of [`PATHS_REQUIRED`]. The phase has a fixed length, so a slow machine does
/// fewer operations in it and a path can come out at zero; going on until every path was
/// taken makes the coverage independent of the machine's speed. The limit is far beyond
/// what a loaded machine needs, so reaching it means the model no longer takes the path.
const EXTENSION_LIMIT: Duration = Duration::from_secs(120);
/// How often the extended fault phase reads the audit for the paths still missing.
const EXTENSION_CHECK_EVERY: Duration = Duration::from_secs(3);
/// Longest the drain may take, while jobs still move, before the leftovers are reported.
/// Long lanes through the limited queue drain one job at a time under its rate and key
/// limits, retries included: seed 16's 900 s runs left two lanes of about 130 jobs each
/// still moving when a limit of 180 s passed (4 of 9 runs reported as stalls, each with a
/// lane head claimed a moment before the report).
const DRAIN_LIMIT: Duration = Duration::from_secs(600);
/// The drain gives up once nothing changed (no job moved) for this long: longer than a
/// runnable job may wait by contract. A job whose announcement a worker did not hear (a
/// retry whose delay ends while the position of a worker started after the retry's write
/// is in a lower priority: behind it) is found by a full walk,
/// and full walks that cost more than twice a cursor walk are paced up to 60 s apart
/// (`PACING_BACKSTOP` in src/worker/claim_cursor.rs). The model's churn makes them so on a
/// loaded machine: gaps of 6-14 s were measured, and a drain that gave up after 8 s
/// reported a due lane head as stuck (seed 4).
const STALL_LIMIT: Duration = Duration::from_secs(70);

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_model_of_the_whole_system() {
    logs::install();
    let seeds: Vec<u64> = match env_u64("SKIPLOCK_SIM_SEED") {
        Some(seed) => vec![seed],
        None => SEEDS_DEFAULT.to_vec(),
    };
    let secs = env_u64("SKIPLOCK_SIM_SECS").unwrap_or(SECS_DEFAULT);
    let mut failed = Vec::new();
    let mut missed = Vec::new();
    let mut reached: BTreeMap<&'static str, usize> = BTreeMap::new();
    for &seed in &seeds {
        let (violations, paths) = run_seed(seed, secs).await;
        // A path a seed did not take was not tested by it: the run fails rather than pass on
        // what the seed did not exercise, even when other seeds took the path. The seed's
        // fault phase went on for it, up to [`EXTENSION_LIMIT`].
        let not_taken: Vec<&str> = PATHS_REQUIRED
            .iter()
            .copied()
            .filter(|path| paths.get(path).copied().unwrap_or(0) == 0)
            .collect();
        if !not_taken.is_empty() {
            eprintln!("model: seed {seed}: did not take the paths {not_taken:?}");
            missed.push((seed, not_taken));
        }
        for (path, n) in paths {
            *reached.entry(path).or_default() += n;
        }
        if !violations.is_empty() {
            failed.push((seed, violations));
        }
    }
    eprintln!("model: paths over seeds {seeds:?}: {reached:?}");
    for path in PATHS_RARE {
        if reached.get(path).copied().unwrap_or(0) == 0 {
            eprintln!("model: note: no seed took the rare path {path:?}; its check ran on nothing");
        }
    }
    let mut summary = String::new();
    for (seed, violations) in &failed {
        let mut by_category: BTreeMap<&str, usize> = BTreeMap::new();
        for v in violations {
            let category = v.split(']').next().unwrap_or("").trim_start_matches('[');
            *by_category.entry(category).or_default() += 1;
        }
        summary.push_str(&format!(
            "\n  seed {seed} (replay: SKIPLOCK_SIM_SEED={seed}): violations {by_category:?}"
        ));
    }
    for (seed, not_taken) in &missed {
        summary.push_str(&format!(
            "\n  seed {seed} (replay: SKIPLOCK_SIM_SEED={seed}): never took the paths \
             {not_taken:?} in {secs} s of faults extended by up to {EXTENSION_LIMIT:?}, so their \
             invariants went unchecked"
        ));
    }
    assert!(
        summary.is_empty(),
        "the model failed (details above):{summary}"
    );
}

/// The log rule of the checks: a statement that failed on data is a defect, one that a
/// killed connection or the machine's speed explains is not.
#[test]
fn a_heartbeat_that_timed_out_is_transient_and_one_that_failed_on_data_is_a_defect() {
    let beat = "2025-01-01T00:00:00Z  WARN skiplock::worker::heartbeat: heartbeat failed; will \
                retry next interval";
    assert!(!logs::is_defect(&format!(
        "{beat} error=no reply within 1s jobs=3 retry_in=200ms"
    )));
    assert!(!logs::is_defect(&format!(
        "{beat} error=error communicating with database: connection reset by peer jobs=1"
    )));
    assert!(logs::is_defect(&format!(
        "{beat} error=error returned from database: invalid input syntax for type uuid jobs=1"
    )));
}

/// Paths of [`coverage`] that every seed must take (its fault phase goes on until it has,
/// up to [`EXTENSION_LIMIT`]): each is taken several times by each default seed in its
/// planned 14 s on a loaded 2-core machine, so a seed that takes one of them zero times
/// even with the extension means the model stopped exercising it. The limits' paths count
/// a limit holding a due job back (tests/model_support/coverage.rs), not a start under it.
const PATHS_REQUIRED: [&str; 19] = [
    "claim of a lane job",
    "a key's freed slot handed on",
    "key_claimable held a job at its insert",
    "a job waiting its turn got it",
    "max_running held a due job back",
    "rate_limit held a due job back",
    "key_max_running held a due job back",
    "key_rate_limit held a due job back",
    "claim of a child",
    "reap",
    "release",
    "retry after failure",
    "dead",
    "superseded",
    "cancelled for a parent",
    "reopened by hand",
    "pruned",
    "dropped with its day",
    "deleted unfinished",
];

/// Paths the default seeds take only a few times in all (0 to 2 per seed): reported when
/// missed, not failed on. "superseded merge checked" counts the superseded merges
/// [`check_merged`] verified: a merge job requeued (a retry, a reap, a release) while a
/// later enqueue of its key became the pending holder, a coincidence of a handler's
/// failure and an enqueue that the actors' random choices make but cannot force.
const PATHS_RARE: [&str; 1] = ["superseded merge checked"];

/// One seed: set up, fault phase, drain, checks. Returns the violations and the paths
/// taken (with how often). The fault phase lasts `secs`, then goes on while a path of
/// [`PATHS_REQUIRED`] has not been taken in it, up to [`EXTENSION_LIMIT`] longer.
async fn run_seed(seed: u64, secs: u64) -> (Vec<String>, BTreeMap<&'static str, usize>) {
    eprintln!("model: seed {seed}, fault phase {secs} s (replay: SKIPLOCK_SIM_SEED={seed})");
    let begun = Instant::now();
    let _ = logs::take();
    let db = fault_support::audited_db().await;
    extend_audit(&db.pool).await;
    sqlx::query(
        "SELECT skiplock.set_queue_limits($1, $2, $3, make_interval(secs => $4::float8 / 1000),
                                          $5, $6, make_interval(secs => $7::float8 / 1000),
                                          $8)",
    )
    .bind(LIMITED_QUEUE.0)
    .bind(LIMITED_QUEUE.1 as i32)
    .bind(LIMITED_QUEUE_RATE.0 as i32)
    .bind(LIMITED_QUEUE_RATE.1)
    .bind(LIMITED_QUEUE_KEY_MAX as i32)
    .bind(LIMITED_QUEUE_KEY_RATE.0 as i32)
    .bind(LIMITED_QUEUE_KEY_RATE.1)
    .bind(KEY_CLAIMABLE as i32)
    .execute(&db.pool)
    .await
    .expect("limit the model's second queue");
    // A per-key running limit alone: completions hand the keys' freed slots on.
    sqlx::query("SELECT skiplock.set_queue_limits($1, NULL, key_max_running => $2)")
        .bind(KEYED_QUEUE.0)
        .bind(KEYED_QUEUE.1 as i32)
        .execute(&db.pool)
        .await
        .expect("limit the keys of the model's third queue");
    // Fair queueing by key on the other queue too, where no lock is taken for it.
    sqlx::query("SELECT skiplock.set_queue_limits('default', NULL, key_claimable => $1)")
        .bind(KEY_CLAIMABLE as i32)
        .execute(&db.pool)
        .await
        .expect("fair queueing on the model's first queue");
    let sim = Arc::new(Sim::new(seed, db.url.clone()));

    let mut crew = Crew::start(&sim, 2, 1).await;
    let pruner = start_pruner(&sim, &crew.runs).await;
    let sampler = tokio::spawn({
        let (sim, pool) = (sim.clone(), sim.pool("model-sampler", 2).await);
        async move { actors::sample(&sim, pool).await }
    });
    let mut actors = Vec::new();
    macro_rules! actor {
        ($app:expr, $f:path) => {{
            let (sim, pool) = (sim.clone(), sim.pool($app, 3).await);
            actors.push(tokio::spawn(async move { $f(&sim, pool).await }));
        }};
    }
    actor!("model-enqueue-rust", actors::enqueue_rust);
    actor!("model-enqueue-sql", actors::enqueue_sql);
    actor!("model-enqueue-insert", actors::enqueue_insert);
    actor!("model-ops", actors::operate_sql);
    actor!("model-killer", actors::kill_connections);
    actors.push(tokio::spawn({
        let sim = sim.clone();
        async move { actors::operate_cli(&sim).await }
    }));

    // The fault phase: the manager churns workers on this task until the time is up and
    // every required path was taken (or the extension's limit passed).
    let stopper = tokio::spawn({
        let (sim, pool) = (sim.clone(), db.pool.clone());
        async move {
            // The phase's planned length (a workload's duration, not a wait for an event).
            tokio::time::sleep(Duration::from_secs(secs)).await;
            let mut wanted = PATHS_REQUIRED.to_vec();
            let extended = Instant::now();
            while !wanted.is_empty() {
                // What the audit shows so far; the drain and the final evidence only add
                // to it.
                let taken = coverage(&Evidence::load(&pool, Vec::new(), Vec::new()).await);
                wanted.retain(|path| taken.get(path).copied().unwrap_or(0) == 0);
                if wanted.is_empty() || extended.elapsed() >= EXTENSION_LIMIT {
                    break;
                }
                eprintln!(
                    "model: seed {seed}: fault phase extended ({:.0} s so far): not taken yet: \
                     {wanted:?}",
                    extended.elapsed().as_secs_f64()
                );
                tokio::time::sleep(EXTENSION_CHECK_EVERY).await;
            }
            sim.faults_over.cancel();
        }
    });
    crew.churn(&sim).await;
    stopper.await.unwrap();
    for actor in actors {
        if let Err(e) = actor.await {
            sim.violation(format!("[actor] an actor panicked: {e}"));
        }
    }
    pruner.stop(&sim, false).await;
    eprintln!("model: seed {seed}: fault phase over, draining");

    let drained = drain(&sim, &db.pool).await;
    if !drained {
        // The running jobs' holders are named above; what each live testbed said last.
        for testbed in &crew.testbeds {
            let log = testbed.log_text();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "model: testbed {}, the end of its log:\n{}",
                testbed.worker_id,
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        }
    }
    sim.sampling_over.cancel();
    sampler.await.unwrap();
    crew.stop_all(&sim).await;

    let mut log_lines: Vec<(String, String)> = logs::take()
        .into_iter()
        .map(|line| ("in-process".to_owned(), line))
        .collect();
    for (id, text) in &crew.gone_logs {
        log_lines.extend(text.lines().map(|l| (id.clone(), l.to_owned())));
    }
    let runs = crew.runs.lock().unwrap().clone();
    let evidence = Evidence::load(&db.pool, runs, log_lines).await;
    let mut violations = sim.violations();
    if !drained {
        violations.push("[drain] the queue did not drain within the limit".into());
    }
    violations.extend(check_all(&evidence));
    let (merge_violations, merges_checked) = check_merged(&db.pool).await;
    violations.extend(merge_violations);
    let mut paths = coverage(&evidence);
    paths.insert("superseded merge checked", merges_checked);

    let jobs = evidence.events.iter().filter(|e| e.op == "insert").count();
    eprintln!(
        "model: seed {seed}: {jobs} jobs, {} audit rows, {} model runs, {:.1} s\n  operations {:?}\n  paths {:?}",
        evidence.events.len(),
        evidence.runs.len(),
        begun.elapsed().as_secs_f64(),
        sim.counts(),
        paths
    );
    report(seed, &violations);
    (violations, paths)
}

/// Lets the workers finish everything (retries waiting out a backoff are brought
/// forward, as an operator would); true once no job is waiting, queued or running.
async fn drain(sim: &Sim, pool: &sqlx::PgPool) -> bool {
    let deadline = Instant::now() + DRAIN_LIMIT;
    let ops = sim.pool("model-drain", 1).await;
    // (jobs left, last non-heartbeat audit row) and since when it has not moved.
    let mut progress = (0i64, 0i64);
    let mut still_since = Instant::now();
    loop {
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM skiplock.jobs WHERE state IN ('waiting', 'queued', 'running')",
        )
        .fetch_one(pool)
        .await
        .expect("count unfinished jobs");
        if left == 0 {
            return true;
        }
        let last_change: Option<i64> =
            sqlx::query_scalar("SELECT max(seq) FROM public.job_audit WHERE NOT heartbeat")
                .fetch_one(pool)
                .await
                .expect("read the audit's progress");
        if (left, last_change.unwrap_or(0)) != progress {
            progress = (left, last_change.unwrap_or(0));
            still_since = Instant::now();
        }
        if Instant::now() > deadline || still_since.elapsed() > STALL_LIMIT {
            // What a stalled drain left, for the report: the queues' settings and the
            // unfinished jobs by queue, state and hold.
            let queues: Vec<String> =
                sqlx::query_scalar("SELECT to_jsonb(q)::text FROM skiplock.queues q")
                    .fetch_all(pool)
                    .await
                    .unwrap_or_default();
            let left: Vec<String> = sqlx::query_scalar(
                "SELECT format('%s %s held_for=%s due=%s: %s', queue, state, held_for,
                               scheduled_at <= now(), count(*))
                 FROM skiplock.jobs_live GROUP BY queue, state, held_for, scheduled_at <= now()",
            )
            .fetch_all(pool)
            .await
            .unwrap_or_default();
            // Who holds the running jobs, and what each session of the database is doing:
            // a stalled drain seen twice (seed 16) had two jobs running for a whole minute,
            // heartbeated by a live testbed, with no outcome written.
            let running: Vec<String> = sqlx::query_scalar(
                "SELECT format('job %s (%s, %s) claimed by %s %s ago, heartbeat %s ago, attempt %s, \
                                row %s %s xmin %s xmax %s',
                               id, queue, kind, claimed_by, now() - claimed_at,
                               now() - heartbeat_at, attempt, tableoid::regclass, ctid, xmin,
                               xmax)
                 FROM skiplock.jobs_live WHERE state = 'running' ORDER BY id",
            )
            .fetch_all(pool)
            .await
            .unwrap_or_default();
            let sessions: Vec<String> = sqlx::query_scalar(
                "SELECT format('%s: %s for %s, wait %s/%s, xact %s: %s', application_name,
                               state, now() - state_change, wait_event_type, wait_event,
                               now() - xact_start, left(query, 200))
                 FROM pg_stat_activity
                 WHERE datname = current_database() AND pid <> pg_backend_pid()
                 ORDER BY application_name",
            )
            .fetch_all(pool)
            .await
            .unwrap_or_default();
            // How the running and the due queued jobs got there, heartbeats included (the
            // third sighting, on a6632be: a lane head running, claimed 0.26 s before the
            // report, whose audit ended with its first attempt's timeout, queued again).
            let recent: Vec<String> = sqlx::query_scalar(
                "SELECT format('job %s #%s %s %s->%s att %s->%s holder %s->%s hb=%s app=%s txid=%s at %s',
                               a.job_id, a.seq, a.op, a.old_state, a.new_state, a.old_attempt,
                               a.new_attempt, a.old_holder, a.new_holder, a.heartbeat, a.app,
                               a.txid, a.at)
                 FROM (SELECT j.id FROM skiplock.jobs_live j
                       WHERE j.state = 'running'
                          OR (j.state = 'queued' AND j.scheduled_at <= now())
                       ORDER BY j.id LIMIT 12) j
                 CROSS JOIN LATERAL (SELECT * FROM public.job_audit a WHERE a.job_id = j.id
                                     ORDER BY a.seq DESC LIMIT 8) a
                 ORDER BY a.job_id, a.seq",
            )
            .fetch_all(pool)
            .await
            .unwrap_or_default();
            let how = if still_since.elapsed() > STALL_LIMIT {
                format!("stalled (nothing moved for {STALL_LIMIT:?})")
            } else {
                format!("did not finish within {DRAIN_LIMIT:?}, still moving")
            };
            eprintln!(
                "model: the drain {how}; queues {queues:?}; unfinished {left:?}\n  running: \
                 {running:#?}\n  their last audit rows: {recent:#?}\n  sessions: {sessions:#?}"
            );
            return false;
        }
        // Announced as docs/operating.md tells operators to, so that workers whose
        // position is past these keys walk back to them at once.
        sqlx::query(
            "WITH due AS (
                 UPDATE skiplock.jobs SET scheduled_at = now()
                 WHERE state = 'queued' AND scheduled_at > now()
                 RETURNING queue, priority, scheduled_at
             )
             SELECT skiplock.internal_notify_runnable(queue, priority, min(scheduled_at))
             FROM due GROUP BY queue, priority",
        )
        .execute(&ops)
        .await
        .expect("bring retries forward");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Prints each category's count and its first few violations.
fn report(seed: u64, violations: &[String]) {
    if violations.is_empty() {
        eprintln!("model: seed {seed}: no violation");
        return;
    }
    let mut by_category: BTreeMap<String, Vec<&String>> = BTreeMap::new();
    for v in violations {
        let category = v
            .split(']')
            .next()
            .unwrap_or("")
            .trim_start_matches('[')
            .to_owned();
        by_category.entry(category).or_default().push(v);
    }
    eprintln!("model: seed {seed}: {} violations", violations.len());
    for (category, list) in by_category {
        eprintln!("=== seed {seed}: [{category}] x{}", list.len());
        for v in list.iter().take(4) {
            eprintln!("{v}\n");
        }
        for v in list.iter().skip(4).take(40) {
            eprintln!("  {}", v.lines().next().unwrap_or_default());
        }
    }
}
