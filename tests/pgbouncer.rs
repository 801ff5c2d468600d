//! skiplock behind PgBouncer in transaction-pooling mode, as managed Postgres runs it.
//!
//! Each test starts the distribution's PgBouncer (1.18 on Debian 12, which does not track
//! named prepared statements across server connections) on a free port, in front of its
//! own test database, with a server pool (3 connections) far smaller than the number of
//! clients, so that server connections really are passed from client to client between
//! transactions. Without PgBouncer mode the same runs fail with "prepared statement
//! sqlx_s_N does not exist / already exists" and "unnamed prepared statement does not
//! exist" (SQLSTATE 26000, 42P05).

#![cfg(feature = "cli")]

mod common;
#[path = "model_support/logs.rs"]
mod logs;
#[allow(dead_code)]
#[path = "dashboard/support.rs"]
mod support;

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use skiplock::{DbPool, Job, JobContext, JobError, NewJob, Worker};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use common::{TestDb, test_db};
use support::Dashboard;

const PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// Server connections PgBouncer keeps per database and user: far fewer than the clients.
const SERVER_POOL_SIZE: u32 = 3;

/// How long PgBouncer or the dashboard may take to start listening.
const START_LIMIT: Duration = Duration::from_secs(20);

/// A PgBouncer in transaction-pooling mode in front of the test server; killed when
/// dropped.
struct Bouncer {
    port: u16,
    _child: Child,
    _dir: tempfile::TempDir,
}

impl Bouncer {
    /// Starts PgBouncer on a free port and waits until it says it listens; `None` (after
    /// [`common::missing_tool`]) when it is not installed.
    async fn start(db: &TestDb) -> Option<Bouncer> {
        if !std::path::Path::new(PGBOUNCER).exists() {
            common::missing_tool(
                "the PgBouncer test",
                "pgbouncer",
                "apt-get install pgbouncer (.ci/run does)",
            );
            return None;
        }
        let server: PgConnectOptions = db.url().parse().expect("test database URL");
        let dir = tempfile::tempdir().expect("temporary directory");
        // The free port is found by binding it and letting it go; nothing else on this
        // machine takes ports from the ephemeral range on purpose.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let ini = format!(
            "[databases]\n\
             * = host={host} port={server_port} user={user}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = any\n\
             pool_mode = transaction\n\
             default_pool_size = {SERVER_POOL_SIZE}\n\
             max_client_conn = 1000\n",
            host = server.get_host(),
            server_port = server.get_port(),
            user = server.get_username(),
        );
        let path = dir.path().join("pgbouncer.ini");
        std::fs::write(&path, ini).expect("write pgbouncer.ini");
        let mut command = Command::new(PGBOUNCER);
        // PgBouncer refuses to run as root; as root it is told to become `postgres`.
        if running_as_root() {
            command.args(["-u", "postgres"]);
        }
        let mut child = command
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start pgbouncer");
        let stderr = child.stderr.take().expect("piped stderr");
        let mut lines = BufReader::new(stderr).lines();
        let listening = format!("listening on 127.0.0.1:{port}");
        let mut said = Vec::new();
        let started = tokio::time::timeout(START_LIMIT, async {
            while let Some(line) = lines.next_line().await.expect("read pgbouncer's log") {
                if line.contains(&listening) {
                    return true;
                }
                said.push(line);
            }
            false
        })
        .await;
        assert!(
            started == Ok(true),
            "pgbouncer did not start listening: {}",
            said.join("\n")
        );
        // Keep reading its log so that it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Some(Bouncer {
            port,
            _child: child,
            _dir: dir,
        })
    }

    /// The URL of `db` through this PgBouncer.
    fn url(&self, db: &TestDb) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{}", self.port, db.name)
    }

    /// A pool of `max` connections to `db` through this PgBouncer. PgBouncer refuses the
    /// startup parameter `extra_float_digits` that sqlx sends by default unless its
    /// `ignore_startup_parameters` names it, so it is not sent.
    fn pool(&self, db: &TestDb, max: u32) -> PgPool {
        let options: PgConnectOptions = self.url(db).parse().expect("PgBouncer URL");
        PgPoolOptions::new()
            .max_connections(max)
            .connect_lazy_with(options.extra_float_digits(None))
    }
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("Uid:"))?.to_owned();
            Some(line.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
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
    let Some(bouncer) = Bouncer::start(&db).await else {
        return;
    };
    let pool = bouncer.pool(&db, 40);
    let through = DbPool::pgbouncer(pool.clone());

    // Rust enqueue through PgBouncer: one batch, and single jobs from many clients at once.
    const BATCH: u32 = 3000;
    const SINGLE: u32 = 200;
    let batch: Vec<Counted> = (0..BATCH).map(|n| Counted { n }).collect();
    let mut ids = skiplock::enqueue_many(&through, &batch, Default::default())
        .await
        .expect("enqueue a batch through PgBouncer");
    let singles = (0..SINGLE).map(|n| {
        let through = through.clone();
        tokio::spawn(async move { skiplock::enqueue(&through, &Counted { n: BATCH + n }).await })
    });
    for single in singles {
        ids.push(
            single
                .await
                .unwrap()
                .expect("enqueue one job through PgBouncer"),
        );
    }
    let total = (BATCH + SINGLE) as usize;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_behind_pgbouncer_listens_on_its_direct_url() {
    let db = test_db().await;
    let Some(bouncer) = Bouncer::start(&db).await else {
        return;
    };
    let pool = bouncer.pool(&db, 8);
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
    let id = skiplock::enqueue(&DbPool::pgbouncer(pool), &Counted { n: 1 })
        .await
        .unwrap();
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

async fn state_of(db: &TestDb, id: &str) -> String {
    sqlx::query_scalar("SELECT state::text FROM skiplock.jobs WHERE id = $1")
        .bind(id.trim().parse::<i64>().unwrap())
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_cli_runs_through_pgbouncer() {
    let db = test_db().await;
    let Some(bouncer) = Bouncer::start(&db).await else {
        return;
    };
    let url = bouncer.url(&db);
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
    assert_eq!(state_of(&db, &later).await, "cancelled");
    cli(&url, &["retry", later.trim()]).await;
    assert_eq!(state_of(&db, &later).await, "queued");
    cli(&url, &["retry", other.trim()]).await;
    let stats: serde_json::Value =
        serde_json::from_str(&cli(&url, &["stats", "--json"]).await).unwrap();
    assert_eq!(stats["queues"][0]["succeeded_last_hour"], 4010, "{stats}");
    cli(&url, &["jobs", "--state", "queued"]).await;
}

#[tokio::test]
async fn the_dashboard_answers_through_pgbouncer() {
    let db = test_db().await;
    let Some(bouncer) = Bouncer::start(&db).await else {
        return;
    };
    skiplock::enqueue_raw(
        &DbPool::pgbouncer(bouncer.pool(&db, 2)),
        &[NewJob::new("noop", serde_json::json!({}))],
    )
    .await
    .unwrap();
    let dashboard = Dashboard::start_at(&bouncer.url(&db), &["--pgbouncer"]).await;
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
