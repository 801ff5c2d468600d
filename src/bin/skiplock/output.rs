//! Shared output and argument helpers: aligned tables, relative times, durations, and the
//! error that tells `main` its message was already printed.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use skiplock::admin::job_state;
use skiplock::unstable_cli::DbPool;
use skiplock::{JobId, JobRow, JobState};

/// Writes the command's output to stdout. When the reader went away (a closed pipe, as in
/// `skiplock jobs | head -1`) the command has nothing left to do: it exits 0 at once, as
/// a program killed by SIGPIPE would stop (Rust ignores SIGPIPE, and `println!` panics
/// instead). Another write error (a full disk behind a redirect) exits 1 with its message.
pub fn write_stdout(text: fmt::Arguments<'_>) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(text).and_then(|()| stdout.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: cannot write the output: {e}");
        std::process::exit(1);
    }
}

/// Whether `error` comes from writing to a reader that went away (see [`write_stdout`]).
pub fn is_broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// A failure whose details were already written to stderr; `main` exits 1 without
/// printing it again.
#[derive(Debug)]
pub struct Reported(pub String);

impl fmt::Display for Reported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Reported {}

/// What `skiplock retry` or `skiplock cancel` prints after a job changed.
pub enum Done {
    /// The same words for every job: `job ID {words}`.
    Fixed(&'static str),
    /// Words chosen from the job as the change left it (its row, read afterwards).
    ByRow(fn(&JobRow) -> String),
}

/// Applies `act` to each job in turn (`skiplock retry`, `skiplock cancel`), printing
/// `job ID {done}` for each that changed and an `error:` line for each that did not: a
/// missing job, or one whose state `refusal` explains. Fails, after trying them all, if
/// any did not change.
pub async fn for_each_job<F, Fut>(
    pool: &DbPool,
    ids: &[i64],
    done: Done,
    act: F,
    refusal: fn(JobId, JobState) -> String,
) -> anyhow::Result<()>
where
    F: Fn(JobId) -> Fut,
    Fut: Future<Output = skiplock::Result<bool>>,
{
    let mut failed = 0;
    for &id in ids {
        let id = JobId(id);
        let problem = match act(id).await {
            Ok(true) => {
                let words = match &done {
                    Done::Fixed(words) => (*words).to_owned(),
                    Done::ByRow(describe) => match skiplock::job(pool, id).await? {
                        Some(row) => describe(&row),
                        None => "changed, and is gone since".to_owned(),
                    },
                };
                outln!("job {id} {words}");
                continue;
            }
            Ok(false) => match job_state(pool, id).await? {
                None => format!("job {id} does not exist; list jobs with `skiplock jobs`"),
                Some(state) => refusal(id, state),
            },
            Err(e) => {
                let e = anyhow::Error::from(e);
                // Not this job's problem but the database's: `main` explains it once.
                if crate::about_the_database(&e) {
                    return Err(e);
                }
                format!("job {id}: {e}")
            }
        };
        eprintln!("error: {problem}");
        failed += 1;
    }
    if failed > 0 {
        return Err(Reported(format!("{failed} of {} jobs unchanged", ids.len())).into());
    }
    Ok(())
}

/// A plain-text table with columns padded to their widest cell.
pub struct Table {
    headers: Vec<&'static str>,
    right_aligned: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers; a header starting with `>` is right-aligned
    /// (the `>` is not shown).
    pub fn new(headers: &[&'static str]) -> Self {
        Self {
            headers: headers.iter().map(|h| h.trim_start_matches('>')).collect(),
            right_aligned: headers.iter().map(|h| h.starts_with('>')).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.headers.len());
        self.rows.push(cells);
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let header: Vec<String> = self.headers.iter().map(|h| (*h).to_owned()).collect();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                let pad = widths[i].saturating_sub(cell.chars().count());
                let last = i + 1 == row.len();
                if self.right_aligned[i] {
                    line.extend(std::iter::repeat_n(' ', pad));
                    line.push_str(cell);
                } else {
                    line.push_str(cell);
                    if !last {
                        line.extend(std::iter::repeat_n(' ', pad));
                    }
                }
            }
            writeln!(f, "{}", line.trim_end())?;
        }
        Ok(())
    }
}

/// `t` relative to `now`, compactly: `12s ago`, `in 5m`, `3d ago`; `infinity` and
/// `-infinity` for the saturated values the library reads those timestamps as.
pub fn relative(t: DateTime<Utc>, now: DateTime<Utc>) -> String {
    if t == DateTime::<Utc>::MAX_UTC {
        return "infinity".to_owned();
    }
    if t == DateTime::<Utc>::MIN_UTC {
        return "-infinity".to_owned();
    }
    let seconds = (t - now).num_seconds();
    let span = compact_seconds(seconds.unsigned_abs());
    if seconds > 0 {
        format!("in {span}")
    } else if seconds == 0 {
        "now".to_owned()
    } else {
        format!("{span} ago")
    }
}

/// Whole seconds in one unit: `42s`, `5m`, `3h`, `2d`.
pub fn compact_seconds(seconds: u64) -> String {
    match seconds {
        0..60 => format!("{seconds}s"),
        60..3600 => format!("{}m", seconds / 60),
        3600..86400 => format!("{}h", seconds / 3600),
        _ => format!("{}d", seconds / 86400),
    }
}

/// At most `max` characters of the first line of `text`, with `…` when cut.
pub fn clip(text: &str, max: usize) -> String {
    let first = text.lines().next().unwrap_or_default();
    let mut clipped: String = first.chars().take(max).collect();
    if clipped.len() < text.len() {
        clipped.push('…');
    }
    clipped
}

/// Longest duration accepted: 1,000 years (of 365.25 days, as humantime counts them).
/// Postgres timestamps end long before the durations humantime can write (`now() - 9000y`
/// is before 4713 BC, their first day).
pub const DURATION_MAX: Duration = Duration::from_secs(1_000 * 31_557_600);

/// Parses `30s`, `5m`, `2h`, `1d`, `1h 30m`, at most [`DURATION_MAX`] (clap value parser).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(text).map_err(|_| {
        format!("`{text}` is not a duration; write a number and a unit, like 30s, 5m, 2h or 1d")
    })?;
    if duration > DURATION_MAX {
        return Err(format!(
            "`{text}` is longer than skiplock can schedule or keep; use at most 1000y"
        ));
    }
    Ok(duration)
}

/// Shortest `--interval` of `stats --watch`: faster refreshes only load the database.
pub const REFRESH_INTERVAL_MIN: Duration = Duration::from_millis(100);

/// Parses a refresh interval like [`parse_duration`], at least [`REFRESH_INTERVAL_MIN`].
pub fn parse_refresh_interval(text: &str) -> Result<Duration, String> {
    let interval = parse_duration(text)?;
    if interval < REFRESH_INTERVAL_MIN {
        return Err(format!(
            "`{text}` is too short to refresh at; use 100ms or more, like 2s"
        ));
    }
    Ok(interval)
}

/// Parses a queue name: not empty, no space around it, at most
/// [`skiplock::QUEUE_NAME_MAX_BYTES`] bytes (clap value parser).
pub fn parse_queue_name(text: &str) -> Result<String, String> {
    if text.trim().is_empty() {
        return Err("a queue name cannot be empty; name one, like mail".to_owned());
    }
    if text.trim() != text {
        return Err(format!(
            "`{text}` has spaces around it; write the queue name without them"
        ));
    }
    if text.len() > skiplock::QUEUE_NAME_MAX_BYTES {
        return Err(format!(
            "the queue name is {} bytes; it must be at most {}",
            text.len(),
            skiplock::QUEUE_NAME_MAX_BYTES
        ));
    }
    Ok(text.to_owned())
}

/// Parses a name that must not be empty, such as a job kind or a unique key (clap value
/// parser); `refusal` is the message for an empty one.
pub fn parse_non_empty(text: &str, refusal: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err(refusal.to_owned());
    }
    Ok(text.to_owned())
}

/// Parses a job id: a whole number of at least 1 (clap value parser).
pub fn parse_job_id(text: &str) -> Result<i64, String> {
    match text.trim().parse::<i64>() {
        Ok(id) if id >= 1 => Ok(id),
        _ => Err(format!(
            "`{text}` is not a job id; job ids are whole numbers from 1 up, like 42 (list them with `skiplock jobs`)"
        )),
    }
}

/// Parses a priority: a whole number from -32768 to 32767, lower first (clap value parser).
pub fn parse_priority(text: &str) -> Result<i16, String> {
    text.trim().parse().map_err(|_| {
        format!(
            "`{text}` is not a priority; use a whole number from -32768 to 32767 (lower runs first)"
        )
    })
}

/// Parses a count of at least 1, such as `--concurrency` (clap value parser); `what`
/// names what is counted, e.g. "job slots".
pub fn parse_count<N>(text: &str, what: &str) -> Result<N, String>
where
    N: std::str::FromStr + PartialOrd + From<u8>,
{
    match text.trim().parse::<N>() {
        Ok(n) if n >= N::from(1) => Ok(n),
        _ => Err(format!(
            "`{text}` is not a number of {what}; use a whole number from 1 up"
        )),
    }
}

/// Smallest `--args-max-bytes`: the database checks the size of args over 4 KiB only (a
/// cheap `pg_column_size` test first), so a smaller limit would not hold for small args.
const ARGS_MAX_BYTES_FLOOR: u64 = 4096;

/// Parses `--args-max-bytes` (clap value parser).
pub fn parse_args_max_bytes(text: &str) -> Result<u64, String> {
    match text.trim().parse::<u64>() {
        Ok(n) if n >= ARGS_MAX_BYTES_FLOOR => Ok(n),
        _ => Err(format!(
            "`{text}` is not a limit on args the database can hold to; use a number of bytes from {ARGS_MAX_BYTES_FLOOR} up"
        )),
    }
}

/// Parses an RFC 3339 time such as `2026-01-31T09:00:00Z` or `2026-01-31T10:00:00+01:00`.
pub fn parse_time(text: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| {
            format!("`{text}` is not an RFC 3339 time ({e}); write it like 2026-01-31T09:00:00Z")
        })
}

/// Prints `value` as pretty JSON on stdout.
pub fn print_json(value: &impl Serialize) -> anyhow::Result<()> {
    outln!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// The stable JSON shape of a job in `skiplock jobs --json`.
#[derive(Serialize)]
pub struct JobJson<'a> {
    pub id: i64,
    pub state: skiplock::JobState,
    pub queue: &'a str,
    pub kind: &'a str,
    pub args: &'a serde_json::Value,
    pub priority: i16,
    pub attempt: i32,
    pub max_attempts: i32,
    pub scheduled_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub claimed_by: Option<&'a str>,
    pub ordering_key: Option<&'a str>,
    pub unique_key: Option<&'a str>,
    pub last_error: Option<&'a str>,
}

impl<'a> From<&'a JobRow> for JobJson<'a> {
    fn from(job: &'a JobRow) -> Self {
        Self {
            id: job.id.into(),
            state: job.state,
            queue: &job.queue,
            kind: &job.kind,
            args: &job.args.0,
            priority: job.priority,
            attempt: job.attempt,
            max_attempts: job.max_attempts,
            scheduled_at: job.scheduled_at,
            created_at: job.created_at,
            finished_at: job.finished_at,
            claimed_by: job.claimed_by.as_deref(),
            ordering_key: job.ordering_key.as_deref(),
            unique_key: job.unique_key.as_deref(),
            last_error: job.last_error.as_deref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_trim() {
        let mut table = Table::new(&[">ID", "STATE", "ERROR"]);
        table.row(vec!["7".into(), "dead".into(), String::new()]);
        table.row(vec!["12".into(), "queued".into(), "x".into()]);
        assert_eq!(
            table.to_string(),
            "ID  STATE   ERROR\n 7  dead\n12  queued  x\n"
        );
    }

    #[test]
    fn durations_and_relative_times() {
        assert_eq!(parse_duration("1d").unwrap(), Duration::from_secs(86400));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert!(parse_duration("soon").unwrap_err().contains("like 30s"));
        let now = Utc::now();
        assert_eq!(relative(now + chrono::Duration::seconds(300), now), "in 5m");
        assert_eq!(
            relative(now - chrono::Duration::seconds(7200), now),
            "2h ago"
        );
        assert_eq!(clip("abcdef\nxyz", 3), "abc…");
        assert_eq!(clip("ab", 3), "ab");
    }
}
