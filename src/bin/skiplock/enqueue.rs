//! `skiplock enqueue`: one job from the command line, or many from an NDJSON file, all
//! in one transaction.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::Args;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use skiplock::Job;
use skiplock::builtin::{Command, Http, Noop, Sleep};
use skiplock::unstable_cli::DbPool;
use skiplock::{EnqueueOptions, JobId, NewJob, Schedule, TraceContext};

use crate::output::{
    parse_count, parse_duration, parse_job_id, parse_non_empty, parse_priority, parse_queue_name,
    parse_time, print_json,
};

pub const EXAMPLES: &str = r#"Examples:
  skiplock enqueue noop
  skiplock enqueue http '{"url": "https://hooks.example.com/x", "method": "POST", "body": {"a": 1}}'
  skiplock enqueue sleep '{"ms": 500}' --queue slow --priority -1 --in 5m
  skiplock enqueue send_digest '{"user": 7}' --unique-key digest:7 --on-conflict replace
  skiplock enqueue --file jobs.ndjson --queue bulk     # one JSON object per line
  cat jobs.ndjson | skiplock enqueue --file -

Args of the built-in kinds (noop, sleep, http, command) are decoded as `skiplock work`
decodes them: args it would refuse are a usage error (exit 2). Other kinds' args are taken
as given.

An NDJSON line is an object with `kind`, optional `args`, and optionally the enqueue options
by their column names: queue, priority, scheduled_at (RFC 3339), max_attempts, ordering_key,
concurrency_key, unique_key, on_conflict (skip|replace|merge), depends_on (array of ids),
traceparent, tracestate. Options given on
the command line apply to lines that do not set them. The whole file is enqueued in one
transaction: if any line is bad (args a built-in kind cannot decode included), nothing is
enqueued (unless --skip-invalid). With --json it prints one object per line:
{"line", "id", "outcome"} (outcome: inserted, skipped, replaced, merged), or
{"line", "error"} for a line --skip-invalid skipped."#;

mod file;

/// Jobs inserted per statement when enqueuing a file.
const FILE_BATCH: usize = 1000;

#[derive(Args)]
pub struct EnqueueArgs {
    /// Job kind: the handler that runs it (e.g. noop, sleep, http, command).
    #[arg(
        required_unless_present = "file",
        conflicts_with = "file",
        value_parser = |text: &str| parse_non_empty(text, "the job kind cannot be empty; name the handler that runs the job, like noop")
    )]
    kind: Option<String>,

    /// Job args as JSON (default: {}).
    #[arg(value_name = "ARGS_JSON", value_parser = parse_json, conflicts_with = "file")]
    args: Option<Value>,

    /// Queue (default: default).
    #[arg(long, value_name = "Q", value_parser = parse_queue_name)]
    queue: Option<String>,

    /// Priority; lower runs first (default: 0).
    #[arg(long, value_name = "P", allow_negative_numbers = true, value_parser = parse_priority)]
    priority: Option<i16>,

    /// Run no earlier than this RFC 3339 time, e.g. 2026-01-31T09:00:00Z.
    #[arg(long, value_name = "TIME", value_parser = parse_time, conflicts_with = "delay")]
    at: Option<DateTime<Utc>>,

    /// Run no earlier than this long from now, e.g. 30s, 5m, 2h, 1d.
    #[arg(long = "in", value_name = "DURATION", allow_hyphen_values = true, value_parser = parse_duration)]
    delay: Option<Duration>,

    /// Attempts before the job goes dead (default: 25).
    #[arg(
        long,
        value_name = "N",
        allow_negative_numbers = true,
        value_parser = |text: &str| parse_count::<i32>(text, "attempts")
    )]
    max_attempts: Option<i32>,

    /// Strict FIFO lane: jobs with the same key run one at a time, in enqueue order.
    #[arg(
        long,
        value_name = "K",
        conflicts_with_all = ["file", "depends_on"],
        value_parser = |text: &str| parse_non_empty(text, "an ordering key cannot be empty; leave --ordering-key out instead")
    )]
    ordering_key: Option<String>,

    /// Concurrency key (a tenant, an account): the queue's key_max_running bounds the jobs
    /// of one key that run at once (see `skiplock queue limits`).
    #[arg(
        long,
        value_name = "K",
        value_parser = |text: &str| parse_non_empty(text, "a concurrency key cannot be empty; leave --concurrency-key out instead")
    )]
    concurrency_key: Option<String>,

    /// Deduplication key: at most one pending job per key.
    #[arg(
        long,
        value_name = "K",
        conflicts_with_all = ["file", "depends_on"],
        value_parser = |text: &str| parse_non_empty(text, "a unique key cannot be empty; leave --unique-key out instead")
    )]
    unique_key: Option<String>,

    /// What a second enqueue with the same unique key does while the first is pending.
    #[arg(long, value_name = "POLICY", value_parser = ["skip", "replace", "merge"], requires = "unique_key")]
    on_conflict: Option<String>,

    /// Run only after these jobs succeeded (comma-separated ids).
    #[arg(
        long,
        value_name = "IDS",
        value_delimiter = ',',
        conflicts_with = "file",
        value_parser = parse_job_id
    )]
    depends_on: Vec<i64>,

    /// The W3C traceparent each attempt's span continues (default: $TRACEPARENT when it
    /// holds one, OpenTelemetry's carrier for a process; one that does not is ignored).
    #[arg(long, value_name = "TRACEPARENT", value_parser = parse_traceparent)]
    traceparent: Option<String>,

    /// The W3C tracestate that goes with --traceparent (default: $TRACESTATE).
    #[arg(long, value_name = "TRACESTATE", requires = "traceparent")]
    tracestate: Option<String>,

    /// Enqueue every line of this NDJSON file (`-` for stdin) in one transaction.
    #[arg(long, value_name = "JOBS.ndjson")]
    file: Option<PathBuf>,

    /// With --file: enqueue the valid lines and report the invalid ones instead of
    /// enqueuing nothing.
    #[arg(long, requires = "file")]
    skip_invalid: bool,

    /// Print the result as JSON: {"id", "outcome"}; with --file, one such object (with its
    /// "line") per line of the file.
    #[arg(long)]
    json: bool,
}

/// A W3C traceparent given on the command line (clap value parser: exit 2 when bad).
fn parse_traceparent(text: &str) -> Result<String, String> {
    TraceContext::from_headers(text, None)
        .map(|context| context.traceparent().to_owned())
        .ok_or_else(|| {
            format!(
                "`{text}` is not a W3C traceparent; write it like \
                 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            )
        })
}

/// Parses args given as JSON on the command line (clap value parser: exit 2 when bad).
pub fn parse_json(text: &str) -> Result<Value, String> {
    serde_json::from_str(text).map_err(|e| {
        format!("not valid JSON: {e}; write JSON in single quotes, like '{{\"ms\": 500}}'")
    })
}

/// Args of a built-in kind decoded as `skiplock work` decodes them, so that args every
/// worker would refuse (the job would go `dead` on its first attempt) are refused at
/// enqueue. Other kinds' args are their workers' business and pass.
fn check_builtin_args(kind: &str, args: &Value) -> Result<(), String> {
    fn decode<J: DeserializeOwned>(args: &Value) -> Result<(), String> {
        J::deserialize(args).map(drop).map_err(|e| e.to_string())
    }
    let (decoded, like) = match kind {
        Noop::KIND => (decode::<Noop>(args), "{}"),
        Sleep::KIND => (decode::<Sleep>(args), r#"{"ms": 500}"#),
        Http::KIND => (
            decode::<Http>(args),
            r#"{"url": "https://hooks.example.com/x", "method": "POST", "body": {"a": 1}}"#,
        ),
        Command::KIND => (
            decode::<Command>(args),
            r#"{"program": "pg_dump", "args": ["--format=custom", "app"]}"#,
        ),
        _ => return Ok(()),
    };
    decoded.map_err(|e| {
        format!("args do not match the built-in kind `{kind}`: {e}; write them like {like}")
    })
}

/// The built-in kind `kind` is one edit away from (a letter added, dropped, changed, or
/// two neighbours swapped), if it is not one itself: most likely a typo, which `skiplock
/// work` would never run (its job waits for a worker that has a handler of that name).
fn near_builtin(kind: &str) -> Option<&'static str> {
    const BUILTINS: [&str; 4] = [Noop::KIND, Sleep::KIND, Http::KIND, Command::KIND];
    if BUILTINS.contains(&kind) {
        return None;
    }
    BUILTINS
        .into_iter()
        .find(|builtin| one_edit_apart(kind, builtin))
}

/// Whether `a` becomes `b` by one insertion, deletion, substitution or swap of neighbours.
fn one_edit_apart(a: &str, b: &str) -> bool {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let prefix = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let (ra, rb) = (&a[prefix..], &b[prefix..]);
    let suffix = ra
        .iter()
        .rev()
        .zip(rb.iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    let (ma, mb) = (
        &ra[..ra.len() - suffix.min(ra.len())],
        &rb[..rb.len() - suffix.min(rb.len())],
    );
    match (ma.len(), mb.len()) {
        (0, 1) | (1, 0) | (1, 1) => true,
        (2, 2) => ma[0] == mb[1] && ma[1] == mb[0],
        _ => false,
    }
}

impl EnqueueArgs {
    /// Refuses, as a usage error (exit 2), command-line args that a built-in kind cannot
    /// decode; before any connection, since no database can make them run. Warns (and
    /// goes on) when the kind is one edit from a built-in one.
    pub fn check(&self) {
        if let Some(kind) = &self.kind {
            let args = self.args.clone().unwrap_or_else(|| json!({}));
            if let Err(why) = check_builtin_args(kind, &args) {
                crate::usage_error(&["enqueue"], why);
            }
            if let Some(builtin) = near_builtin(kind) {
                eprintln!(
                    "warning: kind `{kind}` is not a built-in kind, but one letter from \
                     `{builtin}`; enqueued as `{kind}`, which only a worker with a handler \
                     of that name runs"
                );
            }
        }
    }

    /// The options the command line sets, which file lines may override.
    fn options(&self) -> EnqueueOptions {
        let mut options = EnqueueOptions::new();
        options.queue = self.queue.clone();
        options.priority = self.priority;
        options.schedule = self
            .at
            .map(Schedule::At)
            .or(self.delay.map(Schedule::After));
        options.max_attempts = self.max_attempts;
        options.ordering_key = self.ordering_key.clone();
        options.concurrency_key = self.concurrency_key.clone();
        if let Some(key) = &self.unique_key {
            let policy = self.on_conflict.as_deref().unwrap_or("skip");
            options = options.unique_key(key.clone(), policy.parse().unwrap_or_default());
        }
        options.depends_on = self.depends_on.iter().copied().map(JobId).collect();
        options.trace_context = match &self.traceparent {
            Some(traceparent) => {
                TraceContext::from_headers(traceparent, self.tracestate.as_deref())
            }
            // The environment's, as a traced script passes it down; W3C's rule for a
            // receiver: one that does not parse is no trace.
            None => std::env::var("TRACEPARENT").ok().and_then(|traceparent| {
                TraceContext::from_headers(
                    &traceparent,
                    std::env::var("TRACESTATE").ok().as_deref(),
                )
            }),
        };
        options
    }
}

pub async fn run(pool: &DbPool, args: EnqueueArgs) -> anyhow::Result<()> {
    skiplock::check_schema(pool.pool()).await?;
    if let Some(path) = args.file.clone() {
        return file::enqueue_file(pool, &args, &path).await;
    }
    let kind = args.kind.clone().unwrap_or_default();
    let job = NewJob::new(kind, args.args.clone().unwrap_or_else(|| json!({})))
        .with_options(args.options());
    let result = skiplock::enqueue_raw(pool, &[job])
        .await
        .context("cannot enqueue the job")?[0];
    let id = result.id;
    if args.json {
        return print_json(&json!({ "id": id, "outcome": result.outcome.as_str() }));
    }
    if result.outcome != skiplock::EnqueueOutcome::Inserted {
        // stdout stays the id alone, for scripts; the note goes to stderr.
        eprintln!(
            "job {id} with this unique key was pending: {} (no new job)",
            result.outcome.as_str()
        );
    }
    outln!("{id}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_one_edit_from_a_builtin_are_caught_and_others_are_not() {
        for (kind, builtin) in [
            ("noopp", "noop"),
            ("nop", "noop"),
            ("nopo", "noop"),
            ("slep", "sleep"),
            ("sleeep", "sleep"),
            ("htp", "http"),
            ("https", "http"),
            ("comand", "command"),
            ("commadn", "command"),
        ] {
            assert_eq!(near_builtin(kind), Some(builtin), "{kind}");
        }
        for kind in [
            "noop",
            "sleep",
            "http",
            "command",
            "send_email",
            "no",
            "sleeping",
            "Noop1",
            "",
        ] {
            assert_eq!(near_builtin(kind), None, "{kind}");
        }
    }
}
