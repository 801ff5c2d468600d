//! The in-process workers' logs (a tracing subscriber that keeps `skiplock` events at
//! WARN and above in memory) and the rule that says which log line reports a defect.

use std::io::Write;
use std::sync::{Mutex, Once};

static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());
static INSTALL: Once = Once::new();

/// Installs the capturing subscriber once per test process, and a panic hook that keeps
/// the handlers' planned panics (caught by the worker) out of the test's output.
pub fn install() {
    INSTALL.call_once(|| {
        let default_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let message = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or_default();
            if !message.starts_with("model: planned panic") {
                default_hook(info);
            }
        }));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("skiplock=warn"))
            .with_ansi(false)
            .with_writer(LineWriter::default)
            .try_init();
    });
}

/// Takes every line captured so far.
pub fn take() -> Vec<String> {
    std::mem::take(&mut *LINES.lock().unwrap())
}

/// Buffers one event; its text goes to [`LINES`] when the subscriber drops the writer.
#[derive(Default)]
struct LineWriter(Vec<u8>);

impl Write for LineWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.0);
        let mut lines = LINES.lock().unwrap();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            lines.push(line.to_owned());
        }
    }
}

/// What a worker or maintenance task logs when one of its statements failed.
const STATEMENT_FAILED: [&str; 16] = [
    "duplicate key",
    "invalid byte sequence",
    "violates",
    "could not save",
    "saving job outcomes failed",
    "reaper pass failed",
    "cron pass failed",
    "claim failed",
    "sweep failed",
    "pruner pass failed",
    "could not settle",
    "could not advance",
    "heartbeat failed",
    "outcomes panicked",
    "ended abnormally",
    "local buffer refused",
];

/// Errors that a killed connection (or a killed or stopped worker) explains, or a slow
/// machine: a heartbeat that got no reply within its own timeout (half the stale timeout;
/// src/worker/heartbeat.rs) failed on time, not on data, and is retried next interval.
const TRANSIENT: [&str; 16] = [
    "terminating connection",
    "administrator command",
    "connection reset",
    "broken pipe",
    "unexpected end of file",
    "unexpectedeof",
    "pool timed out",
    "error communicating with database",
    "connection closed",
    "connection refused",
    "server closed the connection",
    "attempted to acquire a connection on a closed pool",
    "pool closed",
    "57p01",
    // Deadlocks (two outcome batches locking unique keys in different orders) are retried.
    "deadlock detected",
    "no reply within",
];

/// Two requeues of one unique key in one batch (an outcome batch, or a reaper pass): the
/// statement cannot see the first requeue when it decides the second, the unique index
/// refuses, and the batch is split; written one at a time, the second is superseded by
/// the first. A designed recovery, not a failure on data (README, Guarantees).
fn is_same_key_requeue_split(lower: &str) -> bool {
    lower.contains("jobs_unique_key_pending_idx")
        && (lower.contains("saving its halves separately")
            || lower.contains("reaping its jobs one at a time"))
}

/// Removes ANSI colour sequences (testbed logs may carry them).
pub fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// Whether `line` reports a statement that failed on data (not on a killed connection).
pub fn is_defect(line: &str) -> bool {
    let lower = strip_ansi(line).to_lowercase();
    STATEMENT_FAILED.iter().any(|p| lower.contains(p))
        && !TRANSIENT.iter().any(|t| lower.contains(t))
        && !is_same_key_requeue_split(&lower)
}
