//! `skiplock enqueue --file`: the jobs of an NDJSON file (or stdin), checked line by line
//! and inserted in batches, all in one transaction, with a progress bar and a summary.

use std::io::BufRead;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;
use serde_json::{Value, json};
use skiplock::unstable_cli::DbPool;
use skiplock::{
    EnqueueOptions, EnqueueOutcome, EnqueueResult, JobId, NewJob, Schedule, TraceContext,
    UniquePolicy,
};
use sqlx::{Acquire, PgConnection};

use super::{EnqueueArgs, FILE_BATCH, check_builtin_args};

/// One line of an NDJSON file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    kind: String,
    #[serde(default)]
    args: Option<Value>,
    queue: Option<String>,
    priority: Option<i16>,
    scheduled_at: Option<DateTime<Utc>>,
    max_attempts: Option<i32>,
    ordering_key: Option<String>,
    concurrency_key: Option<String>,
    unique_key: Option<String>,
    on_conflict: Option<UniquePolicy>,
    #[serde(default)]
    depends_on: Vec<JobId>,
    traceparent: Option<String>,
    tracestate: Option<String>,
}

impl Line {
    fn into_job(self, defaults: &EnqueueOptions) -> Result<NewJob, String> {
        if self.kind.is_empty() {
            return Err("`kind` is empty".into());
        }
        if self.queue.as_deref() == Some("") {
            return Err("`queue` is empty; leave it out to use the default".into());
        }
        if let Some(max) = self.max_attempts
            && max < 1
        {
            return Err(format!("`max_attempts` is {max}; it must be at least 1"));
        }
        if self.unique_key.is_some() && !self.depends_on.is_empty() {
            return Err("a job cannot have both `unique_key` and `depends_on`".into());
        }
        if self.on_conflict.is_some() && self.unique_key.is_none() {
            return Err("`on_conflict` needs a `unique_key`".into());
        }
        let trace_context = match &self.traceparent {
            Some(traceparent) => Some(
                TraceContext::from_headers(traceparent, self.tracestate.as_deref()).ok_or_else(
                    || format!("`traceparent` {traceparent:?} is not a W3C traceparent"),
                )?,
            ),
            None if self.tracestate.is_some() => {
                return Err("`tracestate` needs a `traceparent`".into());
            }
            None => None,
        };
        let args = self.args.unwrap_or_else(|| json!({}));
        check_builtin_args(&self.kind, &args)?;
        let mut options = defaults.clone();
        options.queue = self.queue.or(options.queue);
        options.priority = self.priority.or(options.priority);
        if let Some(at) = self.scheduled_at {
            options.schedule = Some(Schedule::At(at));
        }
        options.max_attempts = self.max_attempts.or(options.max_attempts);
        options.ordering_key = self.ordering_key;
        options.concurrency_key = self.concurrency_key.or(options.concurrency_key);
        options.unique_key = self.unique_key;
        options.on_conflict = self.on_conflict.unwrap_or_default();
        options.depends_on = self.depends_on;
        options.trace_context = trace_context.or(options.trace_context);
        Ok(NewJob::new(self.kind, args).with_options(options))
    }
}

/// A line that was enqueued, and what its enqueue did.
struct Enqueued {
    line: usize,
    result: EnqueueResult,
}

/// What became of a file's lines so far.
#[derive(Default)]
struct Lines {
    enqueued: Vec<Enqueued>,
    invalid: Vec<Invalid>,
}

/// A line that could not be enqueued.
struct Invalid {
    line: usize,
    error: String,
}

/// The file's name as the user gave it, for messages.
fn shown(path: &std::path::Path) -> String {
    if path.as_os_str() == "-" {
        "stdin".to_owned()
    } else {
        path.display().to_string()
    }
}

pub(super) async fn enqueue_file(
    pool: &DbPool,
    args: &EnqueueArgs,
    path: &std::path::Path,
) -> anyhow::Result<()> {
    let name = shown(path);
    let (reader, size): (Box<dyn BufRead>, Option<u64>) = if path.as_os_str() == "-" {
        (Box::new(std::io::stdin().lock()), None)
    } else {
        let file = std::fs::File::open(path).with_context(|| format!("cannot open {name}"))?;
        let size = file.metadata().ok().map(|m| m.len());
        (Box::new(std::io::BufReader::new(file)), size)
    };
    let progress = progress_bar(size);
    let started = Instant::now();
    let defaults = args.options();

    let insert = Insert {
        pgbouncer: pool.is_pgbouncer(),
        skip_invalid: args.skip_invalid,
    };
    let mut conn = pool.pool().acquire().await?;
    let mut tx = conn.begin().await?;
    let mut batch: Vec<(usize, NewJob)> = Vec::with_capacity(FILE_BATCH);
    let mut lines = Lines::default();
    for (index, line) in reader.lines().enumerate() {
        let number = index + 1;
        let text = line.with_context(|| format!("cannot read {name} at line {number}"))?;
        progress.inc(text.len() as u64 + 1);
        if text.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str::<Line>(&text)
            .map_err(describe_json_error)
            .and_then(|line| line.into_job(&defaults));
        match parsed {
            Ok(job) => batch.push((number, job)),
            Err(error) => {
                let bad = Invalid {
                    line: number,
                    error,
                };
                if !args.skip_invalid {
                    progress.finish_and_clear();
                    return Err(nothing_enqueued(&name, &bad));
                }
                lines.invalid.push(bad);
            }
        }
        if batch.len() == FILE_BATCH {
            insert_batch(&mut tx, insert, &mut batch, &mut lines)
                .await
                .map_err(|bad| nothing_enqueued(&name, &bad))?;
            progress.set_message(format!("{} jobs", lines.enqueued.len()));
        }
    }
    insert_batch(&mut tx, insert, &mut batch, &mut lines)
        .await
        .map_err(|bad| nothing_enqueued(&name, &bad))?;
    tx.commit()
        .await
        .context("cannot commit the enqueued jobs")?;
    progress.finish_and_clear();

    let elapsed = started.elapsed();
    if args.json {
        print_outcomes(&lines);
        return Ok(());
    }
    for bad in &lines.invalid {
        eprintln!("skipped {name} line {}: {}", bad.line, bad.error);
    }
    outln!("{}", summary(&lines, &name, elapsed));
    Ok(())
}

/// The last line of `enqueue --file`: the new jobs, then each line a unique key folded
/// into a pending job (which is not a new job), then the invalid lines skipped.
fn summary(lines: &Lines, name: &str, elapsed: Duration) -> String {
    let count = |outcome: EnqueueOutcome| {
        lines
            .enqueued
            .iter()
            .filter(|e| e.result.outcome == outcome)
            .count()
    };
    let inserted = count(EnqueueOutcome::Inserted);
    let rate = inserted as f64 / elapsed.as_secs_f64().max(1e-3);
    let mut line = format!(
        "enqueued {inserted} jobs from {name} in {:.2}s ({rate:.0} jobs/s)",
        elapsed.as_secs_f64()
    );
    for (outcome, what) in [
        (
            EnqueueOutcome::Skipped,
            "skipped: a pending job has the same unique key",
        ),
        (
            EnqueueOutcome::Replaced,
            "replaced the args of the pending job of their unique key",
        ),
        (
            EnqueueOutcome::Merged,
            "merged into the pending job of their unique key",
        ),
    ] {
        let n = count(outcome);
        if n > 0 {
            line.push_str(&format!("; {n} {what}"));
        }
    }
    if !lines.invalid.is_empty() {
        line.push_str(&format!("; skipped {} invalid lines", lines.invalid.len()));
    }
    line
}

/// `--file --json`: one JSON object per line of the file that held a job, in the file's
/// order: `{"line", "id", "outcome"}` for an enqueued one, `{"line", "error"}` for one
/// that `--skip-invalid` skipped.
fn print_outcomes(lines: &Lines) {
    let mut outcomes: Vec<(usize, Value)> = lines
        .enqueued
        .iter()
        .map(|done| {
            let outcome = json!({
                "line": done.line,
                "id": done.result.id,
                "outcome": done.result.outcome.as_str(),
            });
            (done.line, outcome)
        })
        .chain(
            lines
                .invalid
                .iter()
                .map(|bad| (bad.line, json!({ "line": bad.line, "error": bad.error }))),
        )
        .collect();
    outcomes.sort_unstable_by_key(|(line, _)| *line);
    for (_, outcome) in outcomes {
        outln!("{outcome}");
    }
}

fn nothing_enqueued(name: &str, bad: &Invalid) -> anyhow::Error {
    anyhow::anyhow!(
        "{name} line {}: {}; nothing was enqueued (fix the line, or pass --skip-invalid to enqueue the valid lines)",
        bad.line,
        bad.error
    )
}

/// serde_json's message without its position, which counts within the line, not the file.
fn describe_json_error(error: serde_json::Error) -> String {
    let text = error.to_string();
    let message = text
        .rfind(" at line ")
        .map_or(text.as_str(), |at| &text[..at]);
    if error.is_syntax() || error.is_eof() {
        format!("invalid JSON at column {}: {message}", error.column())
    } else {
        message.to_owned()
    }
}

/// How [`insert_batch`] inserts a file's lines.
#[derive(Clone, Copy)]
struct Insert {
    /// The connection goes through PgBouncer (see [`try_insert`]).
    pgbouncer: bool,
    /// A line the database refuses is reported and skipped (`--skip-invalid`).
    skip_invalid: bool,
}

/// Inserts `batch` in one statement under a savepoint and empties it, adding each line's
/// outcome to `lines`. When the database refuses the batch (say a `depends_on` id that
/// does not exist), it retries the lines one by one to name the bad one: with
/// `skip_invalid` the bad lines are recorded and skipped, otherwise the first is returned
/// as the error.
async fn insert_batch(
    tx: &mut PgConnection,
    Insert {
        pgbouncer,
        skip_invalid,
    }: Insert,
    batch: &mut Vec<(usize, NewJob)>,
    lines: &mut Lines,
) -> Result<(), Invalid> {
    if batch.is_empty() {
        return Ok(());
    }
    let numbers: Vec<usize> = batch.iter().map(|(line, _)| *line).collect();
    let jobs: Vec<NewJob> = batch.drain(..).map(|(_, job)| job).collect();
    if let Ok(results) = try_insert(tx, pgbouncer, &jobs).await {
        lines.enqueued.extend(
            numbers
                .into_iter()
                .zip(results)
                .map(|(line, result)| Enqueued { line, result }),
        );
        return Ok(());
    }
    for (line, job) in numbers.into_iter().zip(jobs) {
        match try_insert(tx, pgbouncer, std::slice::from_ref(&job)).await {
            Ok(results) => lines
                .enqueued
                .extend(results.into_iter().map(|result| Enqueued { line, result })),
            Err(error) => {
                let bad = Invalid { line, error };
                if !skip_invalid {
                    return Err(bad);
                }
                lines.invalid.push(bad);
            }
        }
    }
    Ok(())
}

/// Inserts jobs under a savepoint, so a refusal leaves the transaction usable; returns
/// what each enqueue did, in input order. Behind PgBouncer, [`skiplock::PgBouncer`] makes
/// the savepoint and runs the insert unnamed, so that the transaction leaves no prepared
/// statement on the server connection for the next client to meet.
async fn try_insert(
    tx: &mut PgConnection,
    pgbouncer: bool,
    jobs: &[NewJob],
) -> Result<Vec<EnqueueResult>, String> {
    if pgbouncer {
        return skiplock::enqueue_raw(skiplock::PgBouncer(tx), jobs)
            .await
            .map_err(|e| e.to_string());
    }
    let mut savepoint = tx.begin().await.map_err(|e| e.to_string())?;
    match skiplock::enqueue_raw(&mut *savepoint, jobs).await {
        Ok(results) => {
            savepoint.commit().await.map_err(|e| e.to_string())?;
            Ok(results)
        }
        Err(e) => {
            let _ = savepoint.rollback().await;
            Err(e.to_string())
        }
    }
}

/// A bar over the file's bytes when its size is known, else a spinner; drawn on stderr
/// only when it is a terminal.
fn progress_bar(size: Option<u64>) -> ProgressBar {
    match size {
        Some(size) => {
            let bar = ProgressBar::new(size);
            if let Ok(style) = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% {msg}",
            ) {
                bar.set_style(style);
            }
            bar
        }
        None => {
            let spinner = ProgressBar::new_spinner();
            spinner.enable_steady_tick(Duration::from_millis(120));
            spinner
        }
    }
}
