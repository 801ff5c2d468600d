//! The example workers of examples/python (psycopg) and examples/node (pg), run as a user
//! runs them, side by side with a `skiplock work` process on one queue: every job runs
//! exactly once, lanes keep their order, SIGTERM stops each cleanly, and with no skiplock
//! process at all one example worker takes back and runs the claims of a killed one.
//!
//! Needs python3 with psycopg and node with examples/node's packages (`.ci/run` installs
//! them); under `CI=true` a missing one fails the test.
#![cfg(feature = "cli")]

mod cli_support;
mod common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fixtures::wait_for;
use common::{TestDb, test_db};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;
use tokio::task::JoinHandle;

const QUEUE: &str = "polyglot";
const PYTHON: &str = "python-1";
const NODE: &str = "node-1";

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
}

/// Whether `program`, found on PATH, runs `args` in `dir` successfully.
fn runs(program: &str, args: &[&str], dir: &Path) -> bool {
    std::process::Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether both example workers can run here; reports what is missing (a failure under CI).
fn tools_present(test: &str) -> bool {
    if !runs(
        "python3",
        &["-c", "import psycopg"],
        &examples().join("python"),
    ) {
        common::missing_tool(
            test,
            "python3 with psycopg 3",
            "pip install 'psycopg[binary]' (.ci/run does)",
        );
        return false;
    }
    if !runs("node", &["-e", "require('pg')"], &examples().join("node")) {
        common::missing_tool(
            test,
            "node with pg",
            "run `npm ci` in examples/node (.ci/run does)",
        );
        return false;
    }
    true
}

/// A running worker process and its log (stderr), collected line by line as it comes.
struct Worker {
    name: &'static str,
    child: Child,
    log: Arc<Mutex<String>>,
    reader: JoinHandle<()>,
}

impl Worker {
    fn spawn(name: &'static str, mut command: tokio::process::Command) -> Self {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let log = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&log);
        let reader = tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        Self {
            name,
            child,
            log,
            reader,
        }
    }

    /// Waits until the worker has logged a line containing `text`.
    async fn wait_for_log(&self, text: &str) {
        wait_for(
            &format!("{} to log {text:?}", self.name),
            Duration::from_secs(60),
            || async { self.log.lock().unwrap().contains(text) },
        )
        .await;
    }

    /// An example worker: `program worker.<ext>` in its examples folder.
    fn example(db: &TestDb, name: &'static str, program: &str, dir: &str, batch: u32) -> Self {
        Self::spawn(name, example_command(db, name, program, dir, batch))
    }

    /// Sends SIGKILL (no chance to release or finish anything) and waits for the exit;
    /// returns the log.
    async fn kill(mut self) -> String {
        self.child.start_kill().unwrap();
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{} did not exit within 30 s of SIGKILL", self.name))
            .unwrap();
        assert_eq!(status.code(), None, "{} was killed by a signal", self.name);
        self.reader.await.unwrap();
        self.log.lock().unwrap().clone()
    }

    /// Sends SIGTERM and waits for the exit; returns the exit code and the whole log.
    async fn terminate(mut self) -> (Option<i32>, String) {
        let pid = self.child.id().expect("still running").to_string();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -TERM {pid}");
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{} did not exit within 30 s of SIGTERM", self.name))
            .unwrap();
        self.reader.await.unwrap();
        let log = self.log.lock().unwrap().clone();
        (status.code(), log)
    }
}

/// The command that runs an example worker (`program worker.<ext>` in its examples folder)
/// on the test's queue, as `name`, claiming `batch` jobs at a time.
fn example_command(
    db: &TestDb,
    name: &str,
    program: &str,
    dir: &str,
    batch: u32,
) -> tokio::process::Command {
    let script = if program == "node" {
        "worker.js"
    } else {
        "worker.py"
    };
    let mut command = tokio::process::Command::new(program);
    command
        .arg(script)
        .current_dir(examples().join(dir))
        .env("DATABASE_URL", db.url())
        .env("SKIPLOCK_QUEUE", QUEUE)
        .env("SKIPLOCK_WORKER", name)
        .env("SKIPLOCK_BATCH", batch.to_string());
    command
}

/// Waits until a session whose `application_name` is LIKE `application_name` is connected
/// to the test's database.
async fn wait_connected(db: &TestDb, application_name: &str) {
    wait_for(
        &format!("{application_name} to connect"),
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT FROM pg_stat_activity
                                WHERE datname = current_database() AND application_name LIKE $1)",
            )
            .bind(application_name)
            .fetch_one(&db.pool)
            .await
            .unwrap()
        },
    )
    .await;
}

/// How many jobs are in one of `states`.
async fn jobs_in_states(db: &TestDb, states: &[&str]) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state::text = ANY($1)")
        .bind(states)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Records every change of a job's state in `state_changes`, numbered in the order the
/// database made them: what every worker did, the Rust one included, without trusting
/// timestamps taken at each transaction's start.
async fn install_audit(db: &TestDb) {
    for statement in [
        "CREATE TABLE state_changes (
             seq bigserial PRIMARY KEY, job_id bigint NOT NULL, ordering_key text,
             from_state text NOT NULL, to_state text NOT NULL)",
        // Statement triggers with transition tables, on the table and its live partition
        // (which skiplock's statements name): a row trigger for UPDATE misses a job moved
        // between the partitions, which Postgres runs as a delete and an insert.
        "CREATE FUNCTION record_state_change() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO state_changes (job_id, ordering_key, from_state, to_state)
             SELECT n.id, n.ordering_key, o.state, n.state
             FROM old_rows o JOIN new_rows n ON n.id = o.id
             WHERE o.state IS DISTINCT FROM n.state
             ORDER BY n.id;
             RETURN NULL;
         END $$",
        "CREATE TRIGGER record_state_change AFTER UPDATE ON skiplock.jobs
         REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
         FOR EACH STATEMENT EXECUTE FUNCTION record_state_change()",
        "CREATE TRIGGER record_state_change AFTER UPDATE ON skiplock.jobs_live
         REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
         FOR EACH STATEMENT EXECUTE FUNCTION record_state_change()",
    ] {
        sqlx::query(statement).execute(&db.pool).await.unwrap();
    }
}

/// The ids an example worker's log says it completed ("job N (kind) succeeded ..."), in order.
fn completed_in_log(log: &str) -> Vec<i64> {
    log.lines()
        .filter(|line| line.contains(") succeeded in "))
        .filter_map(|line| line.split("job ").nth(1)?.split(' ').next()?.parse().ok())
        .collect()
}

#[tokio::test]
async fn python_node_and_rust_workers_share_a_queue_each_job_once_and_lanes_in_order() {
    const LANES: i32 = 5;
    const PER_LANE: i32 = 20;
    const FREE: i32 = 100;
    if !tools_present("the side-by-side run of the example workers") {
        return;
    }
    let db = test_db().await;
    install_audit(&db).await;
    let python = Worker::example(&db, PYTHON, "python3", "python", 5);
    let node = Worker::example(&db, NODE, "node", "node", 5);
    let mut rust_command = cli_support::command(&db);
    rust_command.args([
        "work",
        "--queue",
        QUEUE,
        "--concurrency",
        "4",
        "--prefetch",
        "2",
    ]);
    let rust = Worker::spawn("skiplock work", rust_command);
    for name in [PYTHON, NODE, "skiplock work%"] {
        wait_connected(&db, name).await;
    }

    // Every worker is up before the jobs come: each should get its share.
    sqlx::query(
        "SELECT skiplock.enqueue('sleep', '{\"ms\": 20}', $1, ordering_key => 'lane-' || (g % $2))
         FROM generate_series(1, $2 * $3) g",
    )
    .bind(QUEUE)
    .bind(LANES)
    .bind(PER_LANE)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "SELECT skiplock.enqueue(CASE WHEN g % 2 = 0 THEN 'noop' ELSE 'sleep' END,
                                 CASE WHEN g % 2 = 0 THEN '{}' ELSE '{\"ms\": 20}' END::jsonb, $1)
         FROM generate_series(1, $2) g",
    )
    .bind(QUEUE)
    .bind(FREE)
    .execute(&db.pool)
    .await
    .unwrap();
    let total = i64::from(LANES * PER_LANE + FREE);

    wait_for("every job to finish", Duration::from_secs(180), || async {
        jobs_in_states(&db, &["succeeded", "dead", "cancelled"]).await == total
    })
    .await;

    let mut logs = HashMap::new();
    for worker in [python, node, rust] {
        let name = worker.name;
        let (code, log) = worker.terminate().await;
        assert_eq!(
            code,
            Some(0),
            "{name} exits 0 after SIGTERM; its log:\n{log}"
        );
        logs.insert(name, log);
    }

    // Exactly once: each job succeeded on its first attempt, with no failure recorded.
    let jobs: Vec<(i64, String, i32, String, Option<String>)> = sqlx::query_as(
        "SELECT id, state::text, attempt, errors::text, claimed_by FROM skiplock.jobs ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(jobs.len() as i64, total);
    for (id, state, attempt, errors, claimed_by) in &jobs {
        assert_eq!(
            (state.as_str(), *attempt, errors.as_str()),
            ("succeeded", 1, "[]"),
            "job {id}, claimed by {claimed_by:?}"
        );
    }
    // The example workers' own run logs: each job they claimed ran and completed once, in
    // that worker alone.
    let mut seen = HashSet::new();
    for name in [PYTHON, NODE] {
        let completed = completed_in_log(&logs[name]);
        for id in &completed {
            assert!(
                seen.insert(*id),
                "job {id} completed twice (again by {name})"
            );
        }
        let mut claimed: Vec<i64> = jobs
            .iter()
            .filter(|j| j.4.as_deref() == Some(name))
            .map(|j| j.0)
            .collect();
        let mut completed = completed;
        completed.sort_unstable();
        claimed.sort_unstable();
        assert_eq!(
            completed, claimed,
            "{name}: completed in its log vs claimed_by"
        );
    }
    let mut share: HashMap<&str, usize> = HashMap::new();
    for job in &jobs {
        let by = match job.4.as_deref() {
            Some(PYTHON) => PYTHON,
            Some(NODE) => NODE,
            _ => "skiplock work",
        };
        *share.entry(by).or_default() += 1;
    }
    eprintln!("jobs per worker: {share:?}");
    for name in [PYTHON, NODE, "skiplock work"] {
        assert!(
            share.get(name).copied().unwrap_or(0) > 0,
            "{name} ran no job: {share:?}"
        );
    }

    // Every state change, in the order the database made them: each job went to running
    // once and from running to succeeded once, whichever worker claimed it.
    let changes: Vec<(i64, Option<String>, String, String, i64)> = sqlx::query_as(
        "SELECT job_id, ordering_key, from_state, to_state, seq FROM state_changes ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for (id, ..) in &jobs {
        let of_job: Vec<(&str, &str)> = changes
            .iter()
            .filter(|c| c.0 == *id && c.2 != "waiting")
            .map(|c| (c.2.as_str(), c.3.as_str()))
            .collect();
        assert_eq!(
            of_job,
            [("queued", "running"), ("running", "succeeded")],
            "job {id}'s state changes"
        );
    }
    // Lanes in order: each job of a lane was claimed after the one before it succeeded.
    let mut last_of_lane: HashMap<&str, (i64, &str)> = HashMap::new();
    for (id, lane, _, to, _) in &changes {
        let Some(lane) = lane.as_deref() else {
            continue;
        };
        let last = last_of_lane.entry(lane).or_insert((0, "succeeded"));
        if to == "running" {
            assert!(
                *id > last.0 && last.1 == "succeeded",
                "lane {lane}: job {id} claimed while job {} was {}",
                last.0,
                last.1
            );
            *last = (*id, "running");
        } else if to == "succeeded" {
            assert_eq!(
                last.0, *id,
                "lane {lane}: job {id} finished, not the one running"
            );
            last.1 = "succeeded";
        }
    }
    assert_eq!(last_of_lane.len(), LANES as usize);
}

/// SIGTERM while a job runs: the running job finishes and is completed, the claimed jobs
/// not yet started go back to the queue with their attempt not counted, exit 0.
#[tokio::test]
async fn sigterm_lets_the_running_job_finish_and_releases_the_rest_of_the_batch() {
    if !tools_present("the example workers' shutdown") {
        return;
    }
    for (name, program, dir) in [(PYTHON, "python3", "python"), (NODE, "node", "node")] {
        let db = test_db().await;
        sqlx::query(
            "SELECT skiplock.enqueue('sleep', '{\"ms\": 3000}', $1) FROM generate_series(1, 8)",
        )
        .bind(QUEUE)
        .execute(&db.pool)
        .await
        .unwrap();
        let worker = Worker::example(&db, name, program, dir, 4);
        // The first job of its batch of 4 has started (it sleeps 3 s): stop the worker now.
        worker.wait_for_log(") attempt 1 started").await;
        let (code, log) = worker.terminate().await;
        assert_eq!(
            code,
            Some(0),
            "{name} exits 0 after SIGTERM; its log:\n{log}"
        );

        // 8 jobs: the one that ran, 3 released (their attempt not counted), 4 never claimed.
        let outcome: Vec<(String, i32, i64)> = sqlx::query_as(
            "SELECT state::text, attempt, count(*) FROM skiplock.jobs
             WHERE claim_token IS NULL GROUP BY 1, 2 ORDER BY 1, 2",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            outcome,
            [("queued".to_owned(), 0, 7), ("succeeded".to_owned(), 1, 1)],
            "{name}: (state, attempt, jobs); its log:\n{log}"
        );
        assert_eq!(completed_in_log(&log).len(), 1, "{name}:\n{log}");
    }
}

/// A Python worker is killed (SIGKILL) while it holds four claims: one job running (it
/// hangs until its claim is lost) and three claimed, not started. With no skiplock process
/// anywhere, another example worker, Python or Node, takes the stale claims back through
/// `skiplock.maintain` in its own loop (`SKIPLOCK_STALE_AFTER` made short) and runs them:
/// every job succeeds exactly once, on its second attempt, and the reap is recorded with
/// its reason (which worker went quiet).
#[tokio::test]
async fn an_example_worker_takes_back_and_runs_the_claims_of_a_killed_one() {
    const JOBS: i64 = 4;
    const STALE_AFTER_SECS: u32 = 2;
    const KILLED: &str = "python-killed";
    if !tools_present("the example workers' reaping of a killed one") {
        return;
    }
    for (reaper, program, dir) in [
        ("python-reaper", "python3", "python"),
        ("node-reaper", "node", "node"),
    ] {
        let db = test_db().await;
        install_audit(&db).await;
        let ids: Vec<i64> = sqlx::query_scalar(
            "SELECT skiplock.enqueue('hang_once', '{}', $1) FROM generate_series(1, $2)",
        )
        .bind(QUEUE)
        .bind(JOBS)
        .fetch_all(&db.pool)
        .await
        .unwrap();

        let mut command = example_command(&db, KILLED, "python3", "python", JOBS as u32);
        command.env("SKIPLOCK_STALE_AFTER", STALE_AFTER_SECS.to_string());
        let killed = Worker::spawn(KILLED, command);
        killed.wait_for_log(") attempt 1 started").await;
        let running_by_killed = || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM skiplock.jobs WHERE state = 'running' AND claimed_by = $1",
            )
            .bind(KILLED)
            .fetch_one(&db.pool)
            .await
            .unwrap()
        };
        assert_eq!(
            running_by_killed().await,
            JOBS,
            "one batch claimed them all"
        );
        let killed_log = killed.kill().await;
        assert_eq!(
            running_by_killed().await,
            JOBS,
            "a killed worker gives nothing back; its log:\n{killed_log}"
        );

        let mut command = example_command(&db, reaper, program, dir, JOBS as u32);
        command.env("SKIPLOCK_STALE_AFTER", STALE_AFTER_SECS.to_string());
        let worker = Worker::spawn(reaper, command);
        wait_for(
            &format!("{reaper} to take back and run every job"),
            Duration::from_secs(90),
            || async { jobs_in_states(&db, &["succeeded"]).await == JOBS },
        )
        .await;
        let (code, log) = worker.terminate().await;
        assert_eq!(
            code,
            Some(0),
            "{reaper} exits 0 after SIGTERM; its log:\n{log}"
        );
        assert!(
            log.contains("maintain: took back"),
            "{reaper} took the claims back itself; its log:\n{log}"
        );

        // Each job: reaped once with the reason, then run and saved once, by the reaper.
        // The messages of `errors`, one a line.
        let jobs: Vec<(i64, String, i32, Option<String>, String)> = sqlx::query_as(
            "SELECT id, state::text, attempt, claimed_by,
                    array_to_string(ARRAY(SELECT e ->> 'message'
                                          FROM jsonb_array_elements(errors) e), E'\\n')
             FROM skiplock.jobs ORDER BY id",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        let reason = format!(
            "no heartbeat from {KILLED} for over {} ms; claim taken back",
            STALE_AFTER_SECS * 1000
        );
        for (id, state, attempt, claimed_by, errors) in &jobs {
            assert_eq!(
                (state.as_str(), *attempt, claimed_by.as_deref()),
                ("succeeded", 2, Some(reaper)),
                "job {id}; {reaper}'s log:\n{log}"
            );
            assert_eq!(errors, &reason, "job {id}'s recorded failures");
        }
        let changes: Vec<(i64, String, String)> =
            sqlx::query_as("SELECT job_id, from_state, to_state FROM state_changes ORDER BY seq")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        for id in &ids {
            let of_job: Vec<(&str, &str)> = changes
                .iter()
                .filter(|c| c.0 == *id)
                .map(|c| (c.1.as_str(), c.2.as_str()))
                .collect();
            assert_eq!(
                of_job,
                [
                    ("queued", "running"),
                    ("running", "queued"),
                    ("queued", "running"),
                    ("running", "succeeded")
                ],
                "job {id}'s state changes"
            );
        }
        let mut completed = completed_in_log(&log);
        completed.sort_unstable();
        assert_eq!(completed, ids, "{reaper} completed each job once");
        assert!(completed_in_log(&killed_log).is_empty(), "{killed_log}");
    }
}
