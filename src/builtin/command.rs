//! `command`: runs a program described by the job's args, without a shell.
//!
//! ```json
//! {"program": "pg_dump", "args": ["--format=custom", "app"], "env": {"TZ": "UTC"},
//!  "stdin": "…", "cwd": "/var/backups", "timeout_ms": 600000}
//! ```
//!
//! - Only `program` is required. `args` are passed as they are, never through a shell;
//!   `"shell": true` runs `program` as a `/bin/sh -c` script instead (with `args` as `$1`…),
//!   which the worker allows only when `sh` is on its allow-list.
//! - The program runs in its own process group. Exit 0 succeeds; any other exit, or death
//!   by a signal, fails the attempt as retryable. A program that cannot be started (not
//!   found, not executable, bad `cwd`) fails permanently.
//! - After `timeout_ms` ([`COMMAND_TIMEOUT_DEFAULT`] when absent) the whole process group
//!   is killed with `SIGKILL` and the attempt fails as retryable. The group is also killed
//!   when the program exits (nothing it started outlives the job) and when the job is
//!   stopped (cancelled, reaped, hard shutdown).
//! - The child inherits the worker's environment minus `DATABASE_URL` and `PGPASSWORD`,
//!   plus the job's trace as `TRACEPARENT` and `TRACESTATE` (OpenTelemetry's environment
//!   carriers; see the http kind) when it has one, plus `env`.
//! - The job's `output` records `{"exit_code", "signal", "timed_out", "stdout_prefix",
//!   "stdout_truncated", "stderr_prefix", "stderr_truncated"}`: the first
//!   [`OUTPUT_PREFIX_MAX_BYTES`] of each stream (the rest is read and discarded).
//! - A worker runs only programs on its allow-list ([`CommandConfig`]); a worker given no
//!   allow-list refuses every `command` job: the job goes `dead` saying so.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::job::{Job, JobContext, JobError};
use crate::trace_context::TraceContext;

/// Timeout of a command whose args give none.
pub const COMMAND_TIMEOUT_DEFAULT: Duration = Duration::from_secs(300);

/// Most bytes of stdout, and of stderr, recorded in the job's output.
pub const OUTPUT_PREFIX_MAX_BYTES: usize = 4096;

/// How long the output pipes may stay open after the program exited and its group was
/// killed (a descendant that left the group can hold them); then reading stops.
const PIPE_DRAIN_AFTER_EXIT: Duration = Duration::from_secs(2);

/// Characters of stderr quoted in an error message.
const ERROR_STDERR_CHARS: usize = 200;

/// Environment variables the child never inherits from the worker: the database
/// credentials skiplock itself runs with.
const ENV_WITHHELD: [&str; 2] = ["DATABASE_URL", "PGPASSWORD"];

/// One program to run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Command {
    /// Program name (looked up on `PATH`) or path; with `shell`, a shell script.
    pub program: String,
    /// Arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Extra environment variables.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Text written to the program's standard input (empty input when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// Timeout in milliseconds ([`COMMAND_TIMEOUT_DEFAULT`] when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Working directory (the worker's when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Run `program` with `/bin/sh -c`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shell: bool,
}

/// Which programs a worker's `command` jobs may run. Give it to the worker with
/// [`WorkerBuilder::data`](crate::WorkerBuilder::data); a worker without one refuses every
/// `command` job.
///
/// ```no_run
/// # fn example(pool: sqlx::PgPool) -> skiplock::Result<()> {
/// use skiplock::builtin::{Command, CommandConfig};
///
/// let worker = skiplock::Worker::builder(pool)
///     .register::<Command>()
///     .data(CommandConfig::allow_programs(["pg_dump", "/usr/local/bin/resize"]))
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandConfig {
    /// `None`: any program.
    allowed: Option<Vec<String>>,
}

impl CommandConfig {
    /// Jobs may run only these programs, compared with the job's `program` exactly as
    /// written (`pg_dump` allows `"program": "pg_dump"`, not `/usr/bin/pg_dump`). The
    /// entry `*` allows any program. `sh` allows jobs with `"shell": true`.
    pub fn allow_programs<I, S>(programs: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let programs: Vec<String> = programs.into_iter().map(Into::into).collect();
        if programs.iter().any(|p| p == "*") {
            return Self::allow_any();
        }
        Self {
            allowed: Some(programs),
        }
    }

    /// Jobs may run any program, shell scripts included.
    pub fn allow_any() -> Self {
        Self { allowed: None }
    }

    /// The allowed programs, `None` when any program is allowed.
    pub fn allowed_programs(&self) -> Option<&[String]> {
        self.allowed.as_deref()
    }

    fn allows(&self, program: &str) -> bool {
        self.allowed
            .as_ref()
            .is_none_or(|allowed| allowed.iter().any(|p| p == program))
    }
}

impl Job for Command {
    const KIND: &'static str = "command";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        self.check_allowed(ctx.data::<CommandConfig>())?;
        let run = self
            .execute(crate::trace_context::to_pass_on(&ctx).as_ref())
            .await?;
        let output = json!({
            "exit_code": run.status.and_then(|s| s.code()),
            "signal": run.status.and_then(|s| s.signal()),
            "timed_out": run.status.is_none(),
            "stdout_prefix": String::from_utf8_lossy(&run.stdout.bytes),
            "stdout_truncated": run.stdout.truncated,
            "stderr_prefix": String::from_utf8_lossy(&run.stderr.bytes),
            "stderr_truncated": run.stderr.truncated,
        });
        if let Err(e) = ctx.set_output(output).await {
            tracing::warn!(job = %ctx.id(), error = %e, "could not record the command's output");
        }
        let name = &self.program;
        match run.status {
            None => Err(JobError::retry(format!(
                "`{name}` timed out after {} ms; its process group was killed",
                self.timeout().as_millis()
            ))),
            Some(status) if status.success() => Ok(()),
            Some(status) => {
                let how = match (status.code(), status.signal()) {
                    (Some(code), _) => format!("exited with status {code}"),
                    (None, Some(signal)) => format!("was killed by signal {signal}"),
                    (None, None) => format!("ended with {status}"),
                };
                Err(JobError::retry(format!(
                    "`{name}` {how}{}",
                    quote_stderr(&run.stderr.bytes)
                )))
            }
        }
    }
}

/// What one run of the program produced.
struct Run {
    /// `None` when the program timed out and was killed.
    status: Option<ExitStatus>,
    stdout: Captured,
    stderr: Captured,
}

/// The start of one output stream.
#[derive(Default)]
struct Captured {
    bytes: Vec<u8>,
    truncated: bool,
}

impl Command {
    fn timeout(&self) -> Duration {
        self.timeout_ms
            .map_or(COMMAND_TIMEOUT_DEFAULT, Duration::from_millis)
    }

    /// The program the allow-list must name: `sh` for shell scripts.
    fn allow_list_name(&self) -> &str {
        if self.shell { "sh" } else { &self.program }
    }

    fn check_allowed(&self, config: Option<&CommandConfig>) -> Result<(), JobError> {
        let name = self.allow_list_name();
        let Some(config) = config else {
            return Err(JobError::permanent(format!(
                "this worker runs no `command` jobs: it was started without an allow-list; \
                 start a worker with --allow-command {name}, then retry the job"
            )));
        };
        if config.allows(name) {
            return Ok(());
        }
        let what = if self.shell {
            "shell scripts need `sh` on the allow-list".to_owned()
        } else {
            format!("program `{name}` is not on this worker's allow-list")
        };
        let allowed = config.allowed_programs().unwrap_or_default().join(", ");
        Err(JobError::permanent(format!(
            "{what} ({allowed}); start a worker with --allow-command {name}, then retry the job"
        )))
    }

    async fn execute(&self, trace: Option<&TraceContext>) -> Result<Run, JobError> {
        let mut process = if self.shell {
            let mut process = tokio::process::Command::new("/bin/sh");
            process.arg("-c").arg(&self.program).arg("sh");
            process
        } else {
            tokio::process::Command::new(&self.program)
        };
        // The job's trace, as OpenTelemetry's environment carriers, and never the worker's
        // own (a traced deploy script's): the job's own `env` comes after, and wins.
        process.env_remove("TRACEPARENT").env_remove("TRACESTATE");
        if let Some(trace) = trace {
            process.env("TRACEPARENT", trace.traceparent());
            if let Some(state) = trace.tracestate() {
                process.env("TRACESTATE", state);
            }
        }
        process
            .args(&self.args)
            .envs(&self.env)
            .stdin(if self.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        for name in ENV_WITHHELD {
            if !self.env.contains_key(name) {
                process.env_remove(name);
            }
        }
        if let Some(cwd) = &self.cwd {
            process.current_dir(cwd);
        }
        let mut child = process.spawn().map_err(|e| {
            let message = match &self.cwd {
                Some(cwd) => format!("cannot start `{}` in `{cwd}`: {e}", self.program),
                None => format!("cannot start `{}`: {e}", self.program),
            };
            match e.kind() {
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => {
                    JobError::permanent(message)
                }
                _ => JobError::retry(message),
            }
        })?;
        // With process_group(0) the child leads a new group whose id is its pid.
        let mut group = GroupKill(
            child
                .id()
                .and_then(|pid| i32::try_from(pid).ok())
                .map(Pid::from_raw),
        );
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let exited = CancellationToken::new();

        let wait = async {
            let status = match tokio::time::timeout(self.timeout(), child.wait()).await {
                Ok(Ok(status)) => Ok(Some(status)),
                Ok(Err(e)) => Err(JobError::retry(format!(
                    "lost track of `{}`: {e}",
                    self.program
                ))),
                Err(_elapsed) => {
                    group.kill();
                    child.wait().await.map(|_| None).map_err(|e| {
                        JobError::retry(format!("lost track of `{}`: {e}", self.program))
                    })
                }
            };
            // Nothing the program started outlives it.
            group.kill();
            group.0 = None;
            exited.cancel();
            status
        };
        let feed = async {
            if let (Some(mut pipe), Some(text)) = (stdin, &self.stdin) {
                // A program that exits without reading its input closes the pipe: fine.
                let _ = pipe.write_all(text.as_bytes()).await;
                let _ = pipe.shutdown().await;
            }
        };
        let (status, (), stdout, stderr) = tokio::join!(
            wait,
            feed,
            capture(stdout, &exited),
            capture(stderr, &exited)
        );
        Ok(Run {
            status: status?,
            stdout,
            stderr,
        })
    }
}

/// Kills a process group with `SIGKILL` when told to and when dropped (the job's future
/// was dropped: cancelled, reaped or hard shutdown), so no program outlives its job.
struct GroupKill(Option<Pid>);

impl GroupKill {
    fn kill(&self) {
        if let Some(group) = self.0 {
            // ESRCH (the group is already gone) is the common, harmless case.
            let _ = killpg(group, Signal::SIGKILL);
        }
    }
}

impl Drop for GroupKill {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Reads a stream to its end, keeping the first [`OUTPUT_PREFIX_MAX_BYTES`]. Stops
/// [`PIPE_DRAIN_AFTER_EXIT`] after `exited` if the pipe is still open.
async fn capture(stream: Option<impl AsyncRead + Unpin>, exited: &CancellationToken) -> Captured {
    let mut captured = Captured::default();
    let Some(mut stream) = stream else {
        return captured;
    };
    let drain_deadline = async {
        exited.cancelled().await;
        tokio::time::sleep(PIPE_DRAIN_AFTER_EXIT).await;
    };
    tokio::pin!(drain_deadline);
    let mut buf = [0u8; 8192];
    loop {
        let read = tokio::select! {
            read = stream.read(&mut buf) => read,
            () = &mut drain_deadline => break,
        };
        match read {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = OUTPUT_PREFIX_MAX_BYTES - captured.bytes.len();
                if n > room {
                    captured.truncated = true;
                }
                captured.bytes.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
    captured
}

fn quote_stderr(stderr: &[u8]) -> String {
    super::excerpt(&String::from_utf8_lossy(stderr), ERROR_STDERR_CHARS)
        .map_or_else(String::new, |text| format!("; stderr: {text}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_list_matches_programs_exactly_and_shell_needs_sh() {
        let config = CommandConfig::allow_programs(["echo", "sh"]);
        let job = |program: &str, shell: bool| Command {
            program: program.into(),
            shell,
            ..Command::default()
        };
        assert!(job("echo", false).check_allowed(Some(&config)).is_ok());
        assert!(
            job("/bin/echo", false)
                .check_allowed(Some(&config))
                .is_err()
        );
        assert!(job("rm -rf /", true).check_allowed(Some(&config)).is_ok());
        let only_echo = CommandConfig::allow_programs(["echo"]);
        let refused = job("echo hi", true)
            .check_allowed(Some(&only_echo))
            .unwrap_err();
        assert!(
            refused.message().contains("shell scripts need `sh`"),
            "{refused}"
        );
        let none = job("echo", false).check_allowed(None).unwrap_err();
        assert_eq!(none.fate(), crate::Fate::Dead);
        assert!(CommandConfig::allow_programs(["*"]).allows("anything"));
    }
}
