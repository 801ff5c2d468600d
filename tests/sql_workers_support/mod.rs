//! Support for tests/sql_workers.rs: the example workers' tools (found, or installed outside
//! CI), their processes and logs, and the audit of every job's state changes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;
use tokio::task::JoinHandle;

use crate::common::fixtures::wait_for;
use crate::common::job_triggers::{JobWrites, after_job_statements};
use crate::common::{self, TestDb};

pub const QUEUE: &str = "polyglot";

pub fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
}

/// Where the Python example's virtualenv lives: `.ci/run` makes it, and outside CI the
/// tests make it when it is missing (examples/python/requirements.txt, from PyPI).
fn python_venv() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/python-example-venv")
}

/// The language of an example worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lang {
    Python,
    Node,
}

impl Lang {
    pub const BOTH: [Lang; 2] = [Lang::Python, Lang::Node];

    pub fn name(self) -> &'static str {
        match self {
            Lang::Python => "python",
            Lang::Node => "node",
        }
    }
}

/// Whether `program` runs `args` in `dir` successfully.
fn runs(program: &Path, args: &[&str], dir: &Path) -> bool {
    std::process::Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs a setup command, or says what failed (with its output).
fn setup(program: &str, args: &[&str], dir: &Path) -> Result<(), String> {
    let output = std::process::Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{program} {}` failed:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// The Python interpreter of the example's virtualenv, made outside CI when missing.
fn python() -> Result<PathBuf, String> {
    let venv = python_venv();
    let python = venv.join("bin/python");
    let dir = examples().join("python");
    if runs(&python, &["-c", "import psycopg"], &dir) {
        return Ok(python);
    }
    let install = format!(
        "python3 -m venv {0} && {0}/bin/pip install -r examples/python/requirements.txt (.ci/run does)",
        venv.display()
    );
    if in_ci() {
        return Err(format!("the Python example's virtualenv: {install}"));
    }
    eprintln!("making the Python example's virtualenv: {install}");
    setup("python3", &["-m", "venv", &venv.to_string_lossy()], &dir)
        .and_then(|()| {
            let pip = venv.join("bin/pip");
            setup(
                &pip.to_string_lossy(),
                &[
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "-r",
                    "requirements.txt",
                ],
                &dir,
            )
        })
        .map_err(|e| format!("{e}\nthe Python example's virtualenv: {install}"))?;
    Ok(python)
}

/// Node with the example's packages, installed (`npm ci`) outside CI when missing.
fn node() -> Result<(), String> {
    let dir = examples().join("node");
    if runs(Path::new("node"), &["-e", "require('pg')"], &dir) {
        return Ok(());
    }
    let install = "node 18 or later, and `npm ci` in examples/node (.ci/run does)";
    if in_ci() {
        return Err(install.to_owned());
    }
    eprintln!("installing the Node example's packages: npm ci in examples/node");
    setup("npm", &["ci", "--no-audit", "--no-fund"], &dir).map_err(|e| format!("{e}\n{install}"))
}

/// The tools both examples need: found once per test process. A missing one fails the
/// test (under CI=true through `common::missing_tool`, elsewhere after trying to install it):
/// no test of the examples passes without running them.
pub fn python_bin() -> PathBuf {
    static TOOLS: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let tools = TOOLS.get_or_init(|| {
        let python = python()?;
        node()?;
        Ok(python)
    });
    match tools {
        Ok(python) => python.clone(),
        Err(missing) => {
            common::missing_tool("each test of the example workers", "a tool", missing);
            panic!("the example workers' tests need their tools: {missing}");
        }
    }
}

/// A running worker process and its log (stderr), collected line by line as it comes.
pub struct Worker {
    pub name: String,
    child: Child,
    pub log: Arc<Mutex<String>>,
    reader: JoinHandle<()>,
}

impl Worker {
    pub fn spawn(name: &str, mut command: tokio::process::Command) -> Self {
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
            name: name.to_owned(),
            child,
            log,
            reader,
        }
    }

    /// An example worker of `lang` on `url`, named `name`, on [`QUEUE`], claiming `batch`
    /// jobs at a time, with `env` on top.
    pub fn example(lang: Lang, url: &str, name: &str, batch: u32, env: &[(&str, &str)]) -> Self {
        Self::spawn(name, example_command(lang, url, name, batch, env))
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// How many lines of the log contain `text`.
    pub fn count(&self, text: &str) -> usize {
        self.log.lock().unwrap().matches(text).count()
    }

    /// Waits until the worker has logged `times` lines containing `text`.
    pub async fn wait_for_lines(&self, text: &str, times: usize) {
        wait_for(
            &format!("{} to log {text:?} {times} times", self.name),
            Duration::from_secs(60),
            || async { self.count(text) >= times },
        )
        .await;
    }

    /// Waits until the worker has logged a line containing `text`.
    pub async fn wait_for_log(&self, text: &str) {
        self.wait_for_lines(text, 1).await;
    }

    /// Sends SIGKILL (no chance to release or finish anything) and waits for the exit;
    /// returns the log.
    pub async fn kill(mut self) -> String {
        self.child.start_kill().unwrap();
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{} did not exit within 60 s of SIGKILL", self.name))
            .unwrap();
        assert_eq!(status.code(), None, "{} was killed by a signal", self.name);
        self.reader.await.unwrap();
        self.log.lock().unwrap().clone()
    }

    /// Waits for the worker to exit by itself (within a minute); returns the exit code and
    /// the whole log.
    pub async fn exited(mut self) -> (Option<i32>, String) {
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{} did not exit within 60 s; its log:\n{}",
                    self.name,
                    self.log.lock().unwrap()
                )
            })
            .unwrap();
        self.reader.await.unwrap();
        let log = self.log.lock().unwrap().clone();
        (status.code(), log)
    }

    /// Sends SIGTERM and waits for the exit; returns the exit code and the whole log.
    pub async fn terminate(mut self) -> (Option<i32>, String) {
        let pid = self.child.id().expect("still running").to_string();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -TERM {pid}");
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{} did not exit within 60 s of SIGTERM", self.name))
            .unwrap();
        self.reader.await.unwrap();
        let log = self.log.lock().unwrap().clone();
        (status.code(), log)
    }
}

/// The command that runs an example worker (see [`Worker::example`]).
pub fn example_command(
    lang: Lang,
    url: &str,
    name: &str,
    batch: u32,
    env: &[(&str, &str)],
) -> tokio::process::Command {
    let (mut command, dir) = match lang {
        Lang::Python => {
            let mut command = tokio::process::Command::new(python_bin());
            command.arg("worker.py");
            (command, "python")
        }
        Lang::Node => {
            python_bin(); // Checks node and its packages too.
            let mut command = tokio::process::Command::new("node");
            command.arg("worker.js");
            (command, "node")
        }
    };
    command
        .current_dir(examples().join(dir))
        .env("DATABASE_URL", url)
        .env("SKIPLOCK_QUEUE", QUEUE)
        .env("SKIPLOCK_WORKER", name)
        .env("SKIPLOCK_BATCH", batch.to_string())
        .envs(env.iter().copied());
    command
}

/// Records every change of a job's state in `state_changes`, numbered in the order the
/// database made them, with the worker that held the claim, the attempt before and after,
/// and how old the claim's heartbeat was by the clock as the change was made: what every
/// worker did, without trusting timestamps taken at each transaction's start. Also
/// records, in `job_writes`, the session (`application_name`) and the isolation level of
/// every statement that writes `skiplock.jobs`, whether or not it changes a row: the
/// workers' READ COMMITTED pin is then checked on each of their transactions
/// ([`assert_workers_wrote_at_read_committed`]), not inferred from a serialization failure
/// that may or may not happen. Both by statement triggers ([`after_job_statements`]).
pub async fn install_audit(db: &TestDb) {
    for statement in [
        "CREATE TABLE public.state_changes (
             seq bigserial PRIMARY KEY, job_id bigint NOT NULL, ordering_key text,
             from_state text NOT NULL, to_state text NOT NULL, claimed_by text,
             old_attempt int NOT NULL, new_attempt int NOT NULL, heartbeat_age_ms float8)",
        "CREATE FUNCTION public.record_state_change() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO public.state_changes (job_id, ordering_key, from_state, to_state, claimed_by,
                                               old_attempt, new_attempt, heartbeat_age_ms)
             SELECT n.id, n.ordering_key, o.state, n.state, n.claimed_by, o.attempt, n.attempt,
                    extract(epoch FROM clock_timestamp() - o.heartbeat_at) * 1000
             FROM old_rows o JOIN new_rows n ON n.id = o.id
             WHERE o.state IS DISTINCT FROM n.state
             ORDER BY n.id;
             RETURN NULL;
         END $$",
        // The defaults are taken in the writing transaction: its own isolation level, not
        // the session's default (a pooled worker pins the level in BEGIN).
        "CREATE TABLE public.job_writes (
             seq bigserial PRIMARY KEY,
             app text NOT NULL DEFAULT current_setting('application_name'),
             isolation text NOT NULL DEFAULT current_setting('transaction_isolation'))",
        "CREATE FUNCTION public.record_job_write() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO public.job_writes DEFAULT VALUES;
             RETURN NULL;
         END $$",
    ] {
        sqlx::query(statement).execute(&db.pool).await.unwrap();
    }
    for (name, writes, function) in [
        (
            "record_state_change",
            JobWrites::Update,
            "public.record_state_change",
        ),
        (
            "record_job_write",
            JobWrites::Any,
            "public.record_job_write",
        ),
    ] {
        after_job_statements(&db.pool, name, writes, function).await;
    }
}

/// One row of `state_changes`.
#[derive(Debug, sqlx::FromRow)]
pub struct Change {
    pub job_id: i64,
    pub ordering_key: Option<String>,
    pub from_state: String,
    pub to_state: String,
    pub claimed_by: Option<String>,
    pub old_attempt: i32,
    pub new_attempt: i32,
    /// How old the claim's heartbeat was as the change was made (a running job's).
    pub heartbeat_age_ms: Option<f64>,
}

pub async fn changes(db: &TestDb) -> Vec<Change> {
    sqlx::query_as(
        "SELECT job_id, ordering_key, from_state, to_state, claimed_by, old_attempt,
                new_attempt, heartbeat_age_ms
         FROM public.state_changes ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Every statement that the example workers `names` (their sessions are named `name` and
/// `name (…)`: completer, heartbeat) ran on `skiplock.jobs` ran at READ COMMITTED, whatever
/// the database's default or the pooler in between; and each worker wrote, so that the check
/// saw its sessions (their `application_name` reaches the server through PgBouncer too).
pub async fn assert_workers_wrote_at_read_committed(db: &TestDb, names: &[&str]) {
    let writes: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT app, isolation, count(*) FROM public.job_writes GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for name in names {
        let of_worker: Vec<&(String, String, i64)> = writes
            .iter()
            .filter(|(app, _, _)| app == name || app.starts_with(&format!("{name} (")))
            .collect();
        assert!(
            !of_worker.is_empty(),
            "{name} wrote skiplock.jobs; (session, isolation, statements): {writes:?}"
        );
        for (app, isolation, statements) in of_worker {
            assert_eq!(
                isolation, "read committed",
                "{app} wrote skiplock.jobs in {statements} statements at {isolation}; \
                 (session, isolation, statements): {writes:?}"
            );
        }
    }
}

/// How many jobs are in one of `states`.
pub async fn jobs_in_states(db: &TestDb, states: &[&str]) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state::text = ANY($1)")
        .bind(states)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Waits until a session whose `application_name` is LIKE `application_name` is connected
/// to the test's database.
pub async fn wait_connected(db: &TestDb, application_name: &str) {
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

/// The ids an example worker's log says it completed ("job N (kind) succeeded ..."), in order.
pub fn completed_in_log(log: &str) -> Vec<i64> {
    log.lines()
        .filter(|line| line.contains(") succeeded in "))
        .filter_map(|line| line.split("job ").nth(1)?.split(' ').next()?.parse().ok())
        .collect()
}

/// Every job was done exactly once, whatever the workers went through: its state changes
/// are a claim and a success, or before them claims taken back (running -> queued); no job
/// succeeded twice; and the lanes ran in order: a lane's job is claimed only when every job
/// before it in the lane has succeeded and none of the lane runs.
///
/// A claim is taken back only by a release of its holder (its attempt given back) or by a
/// reap of a claim whose heartbeat was older than `stale_after` as it was taken back: a
/// killed worker's, and also a live worker's whose heartbeats stopped getting through
/// (its session ended by a timeout, or a stall of a loaded machine), which stops its job
/// and so may rightly see it run again. Which workers that befalls depends on timing; that
/// no live claim is taken back does not.
pub fn assert_each_job_done_once_and_lanes_in_order(changes: &[Change], stale_after: Duration) {
    let mut per_job: HashMap<i64, Vec<&Change>> = HashMap::new();
    for change in changes.iter().filter(|c| c.from_state != "waiting") {
        per_job.entry(change.job_id).or_default().push(change);
    }
    for (id, of_job) in &per_job {
        let steps: Vec<(&str, &str)> = of_job
            .iter()
            .map(|c| (c.from_state.as_str(), c.to_state.as_str()))
            .collect();
        let (taken_back, done) = steps.split_at(steps.len().saturating_sub(2));
        assert_eq!(
            done,
            [("queued", "running"), ("running", "succeeded")],
            "job {id} ends with one claim and one success: {steps:?}"
        );
        for pair in taken_back.chunks(2) {
            assert_eq!(
                pair,
                [("queued", "running"), ("running", "queued")],
                "job {id}: only claims taken back before its run: {steps:?}"
            );
        }
        for change in of_job.iter().filter(|c| c.to_state == "queued") {
            let by = change.claimed_by.as_deref().unwrap_or("?");
            let released = change.new_attempt == change.old_attempt - 1;
            let stale = change
                .heartbeat_age_ms
                .is_some_and(|age| age >= stale_after.as_secs_f64() * 1000.0);
            assert!(
                released || stale,
                "job {id} taken back from {by} neither by a release nor as stale (its \
                 heartbeat {:?} ms old, attempt {} -> {}): {steps:?}",
                change.heartbeat_age_ms,
                change.old_attempt,
                change.new_attempt
            );
        }
    }

    let mut lanes: HashMap<&str, Vec<i64>> = HashMap::new();
    for change in changes {
        if let Some(lane) = change.ordering_key.as_deref() {
            let ids = lanes.entry(lane).or_default();
            if !ids.contains(&change.job_id) {
                ids.push(change.job_id);
            }
        }
    }
    for ids in lanes.values_mut() {
        ids.sort_unstable();
    }
    let mut succeeded: Vec<i64> = Vec::new();
    let mut running: HashMap<&str, i64> = HashMap::new();
    for change in changes {
        let Some(lane) = change.ordering_key.as_deref() else {
            continue;
        };
        let id = change.job_id;
        match change.to_state.as_str() {
            "running" => {
                assert_eq!(
                    running.get(lane),
                    None,
                    "lane {lane}: job {id} claimed while another job of the lane runs"
                );
                let before: Vec<i64> = lanes[lane].iter().copied().filter(|j| *j < id).collect();
                assert!(
                    before.iter().all(|j| succeeded.contains(j)),
                    "lane {lane}: job {id} claimed before all of {before:?} succeeded"
                );
                running.insert(lane, id);
            }
            "succeeded" | "queued" if change.from_state == "running" => {
                assert_eq!(running.remove(lane), Some(id), "lane {lane}: job {id}");
                if change.to_state == "succeeded" {
                    succeeded.push(id);
                }
            }
            _ => {}
        }
    }
}
