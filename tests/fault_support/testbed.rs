//! Testbed worker processes (`src/bin/skiplock-testbed.rs`): start, signal, watch their
//! logs. Needs the `testbed` feature, which builds the binary.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::PATIENCE;

/// A fresh test database (see tests/common) with the audit trigger installed and
/// `public.testbed_runs` created: the setup of every test that runs testbed workers.
pub async fn audited_db() -> crate::common::TestDb {
    let db = crate::common::test_db().await;
    super::install_audit(&db.pool).await;
    create_runs_table(&db.url).await;
    db
}

/// Creates `public.testbed_runs` (with `skiplock-testbed --prepare-only`, which owns its
/// definition), so a test can count executions before any testbed started.
pub async fn create_runs_table(url: &str) {
    let status = Command::new(TESTBED)
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .args(["--prepare-only", "--database-url", url])
        .stdin(Stdio::null())
        .status()
        .await
        .expect("run skiplock-testbed --prepare-only");
    assert!(status.success(), "skiplock-testbed --prepare-only failed");
}

/// Path of the testbed binary.
pub const TESTBED: &str = env!("CARGO_BIN_EXE_skiplock-testbed");

/// A running `skiplock-testbed` process; killed when dropped.
pub struct Testbed {
    pub worker_id: String,
    child: Child,
    pid: u32,
    log: Arc<Mutex<Vec<String>>>,
    /// The task that reads the process's stderr into `log`; it ends at EOF, once the
    /// process exited and every line it wrote was collected. `None` once awaited.
    reader: Option<tokio::task::JoinHandle<()>>,
}

/// Options of a testbed process: `--flag value` pairs appended to the command line.
#[derive(Clone, Default)]
pub struct TestbedArgs {
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl TestbedArgs {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `--name value`.
    pub fn set(mut self, name: &str, value: impl ToString) -> Self {
        self.args.push(format!("--{name}"));
        self.args.push(value.to_string());
        self
    }

    /// Adds a bare `--name`.
    pub fn flag(mut self, name: &str) -> Self {
        self.args.push(format!("--{name}"));
        self
    }

    /// Sets an environment variable of the process.
    pub fn env(mut self, name: &str, value: impl ToString) -> Self {
        self.env.push((name.to_owned(), value.to_string()));
        self
    }
}

impl Testbed {
    /// Starts a testbed named `worker_id` (keep it short: it is also the connection's
    /// `application_name`, at most 63 bytes, and starts with `tb-` so the audit checks
    /// know it) on `url`, and waits until it is ready to work.
    pub async fn start(url: &str, worker_id: &str, args: &TestbedArgs) -> Testbed {
        assert!(worker_id.starts_with("tb-") && worker_id.len() < 64);
        let mut command = Command::new(TESTBED);
        command
            .env_remove("DATABASE_URL")
            .env("RUST_LOG", "warn")
            .arg("--database-url")
            .arg(url)
            .arg("--worker-id")
            .arg(worker_id)
            .args(&args.args)
            .envs(args.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command.spawn().expect("start skiplock-testbed");
        let pid = child.id().expect("a running child has a pid");
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("stderr is piped");
        let lines = log.clone();
        let reader = tokio::spawn(async move {
            let mut reader = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                lines.lock().unwrap().push(line);
            }
        });
        let mut testbed = Testbed {
            worker_id: worker_id.to_owned(),
            child,
            pid,
            log,
            reader: Some(reader),
        };
        testbed.wait_for_log("testbed ready", PATIENCE).await;
        testbed
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends a signal (`KILL`, `STOP`, `CONT`, `TERM`, …) with kill(1).
    pub fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid.to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} {} failed", self.pid);
    }

    /// Waits for the process to exit; returns its exit status. Its whole log is collected
    /// by then (for [`log_text`](Self::log_text) and [`log_count`](Self::log_count)).
    pub async fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let status = match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(status) => status.expect("wait for the testbed"),
            Err(_) => panic!(
                "testbed {} did not exit within {limit:?}; log:\n{}",
                self.worker_id,
                self.log_text()
            ),
        };
        self.collect_log().await;
        status
    }

    /// Once the process has exited: waits until the reader has collected every line it
    /// wrote (its stderr's EOF). Only the process held the pipe's write end, so EOF comes
    /// with its exit.
    async fn collect_log(&mut self) {
        if let Some(reader) = self.reader.take() {
            tokio::time::timeout(PATIENCE, reader)
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "the stderr of testbed {} did not end within {PATIENCE:?} of its exit",
                        self.worker_id
                    )
                })
                .expect("the testbed's log reader");
        }
    }

    /// Whether the process has exited.
    pub fn has_exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// SIGKILL, then reap the process.
    pub async fn kill9(&mut self) {
        self.signal("KILL");
        self.wait_exit(PATIENCE).await;
    }

    /// Kills the process (SIGKILL) at a moment it holds at least one claim; returns how
    /// many claims it held once its sessions were gone (so that nothing it sent before the
    /// kill can land after the count). Waiting to see it hold a job and then killing it
    /// races with the job: a short one finishes in between. So it is stopped first
    /// (SIGSTOP: a stopped process completes nothing), checked once nothing it sent is in
    /// flight, and killed if it holds a claim; if not, continued and tried again.
    ///
    /// The count can still come out 0 when the other workers' reaper took the claims while
    /// it was stopped, or (rarely) when a completion it had written just before the stop
    /// was read by the server only after the check; a caller that needs a victim holding
    /// claims starts another.
    pub async fn kill9_holding(&mut self, pool: &sqlx::PgPool) -> i64 {
        let id = self.worker_id.clone();
        let deadline = Instant::now() + PATIENCE;
        loop {
            super::wait_until(
                "the victim to hold a job",
                deadline.saturating_duration_since(Instant::now()),
                || async { (super::running_held_by(pool, &id).await > 0).then_some(()) },
            )
            .await;
            self.signal("STOP");
            super::wait_no_statement_of(pool, &id).await;
            if super::running_held_by(pool, &id).await > 0 {
                break;
            }
            self.signal("CONT");
        }
        self.kill9().await;
        super::wait_until("the killed worker's sessions to end", PATIENCE, || async {
            (super::sessions_of(pool, &id).await == 0).then_some(())
        })
        .await;
        super::running_held_by(pool, &id).await
    }

    /// Waits until a line of the process's stderr contains `needle`; returns the line.
    pub async fn wait_for_log(&mut self, needle: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(line) = self.log.lock().unwrap().iter().find(|l| l.contains(needle)) {
                return line.clone();
            }
            if self.has_exited() {
                // Every line it wrote is collected once its stderr ends: only then is a
                // line known to be missing.
                self.collect_log().await;
                if let Some(line) = self.log.lock().unwrap().iter().find(|l| l.contains(needle)) {
                    return line.clone();
                }
                panic!(
                    "testbed {} exited before logging `{needle}`; log:\n{}",
                    self.worker_id,
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "testbed {} logged no `{needle}` within {limit:?}; log:\n{}",
                self.worker_id,
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Number of stderr lines containing `needle` so far.
    pub fn log_count(&self, needle: &str) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Everything the process wrote on stderr so far.
    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        // A stopped process must be continued for anything but SIGKILL; SIGKILL works on
        // it as it is, and kill_on_drop sends exactly that.
        let _ = self.child.start_kill();
    }
}
