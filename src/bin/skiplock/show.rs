//! `skiplock show ID`: everything about one job.

use anyhow::Context;
use clap::Args;
use serde_json::{Map, Value};
use skiplock::admin::{job_dependencies, why_not_running};
use skiplock::unstable_cli::DbPool;
use skiplock::unstable_cli::jobs_get_json;
use skiplock::{JobId, JobState};

use crate::output::print_json;

pub const EXAMPLES: &str = "\
Examples:
  skiplock show 42
  skiplock show 42 --json | jq .errors

For a job that has not finished, `why` says what keeps it from running (its lane, its
parents, its schedule, a paused queue, a global limit). --json prints every column of
skiplock.jobs, plus `why_not_running` and `dependencies`: [{relation, id, state, deleted}]
where relation is `parent` (this job waits for it) or `dependant` (it waits for this job),
and `deleted` says the parent was deleted (while `state`).";

/// Columns shown first, in this order; the rest follow alphabetically.
const LEADING_FIELDS: &[&str] = &[
    "id",
    "state",
    "queue",
    "kind",
    "priority",
    "attempt",
    "max_attempts",
    "scheduled_at",
    "created_at",
    "claimed_at",
    "claimed_by",
    "heartbeat_at",
    "finished_at",
    "ordering_key",
    "unique_key",
    "unique_policy",
    "claim_token",
    "last_error",
];

/// Fields printed as indented JSON blocks after the scalar fields.
const JSON_FIELDS: &[&str] = &["args", "progress", "output"];

#[derive(Args)]
pub struct ShowArgs {
    /// Job id.
    #[arg(allow_negative_numbers = true, value_parser = crate::output::parse_job_id)]
    id: i64,

    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub async fn run(pool: &DbPool, args: ShowArgs) -> anyhow::Result<()> {
    let id = JobId(args.id);
    let Some(job) = jobs_get_json(pool, id)
        .await
        .context("cannot read the job")?
    else {
        anyhow::bail!("job {id} does not exist; list jobs with `skiplock jobs`");
    };
    let dependencies = job_dependencies(pool, id)
        .await
        .context("cannot read the job's dependencies")?;
    let why = why_not_running(pool, id)
        .await
        .context("cannot tell why the job is not running")?;
    let Value::Object(mut fields) = job else {
        anyhow::bail!("job {id} came back in an unexpected shape");
    };
    if args.json {
        fields.insert("dependencies".into(), serde_json::to_value(&dependencies)?);
        fields.insert("why_not_running".into(), serde_json::to_value(&why)?);
        return print_json(&fields);
    }

    let errors = fields.remove("errors");
    let mut lines = Vec::new();
    for name in LEADING_FIELDS {
        if let Some(value) = fields.remove(*name) {
            push_scalar(&mut lines, name, &value);
        }
        if *name == "state"
            && let Some(why) = &why
        {
            lines.push(format!("why: {why}"));
        }
    }
    let mut blocks = Map::new();
    for name in JSON_FIELDS {
        if let Some(value) = fields.remove(*name) {
            blocks.insert((*name).to_owned(), value);
        }
    }
    // Columns added by later schema versions: shown rather than hidden.
    for (name, value) in &fields {
        push_scalar(&mut lines, name, value);
    }
    for (name, value) in &blocks {
        if value.is_null() {
            continue;
        }
        let pretty = serde_json::to_string_pretty(value)?;
        lines.push(format!("{name}:"));
        lines.extend(pretty.lines().map(|line| format!("  {line}")));
    }
    push_errors(&mut lines, errors.as_ref());
    for relation in ["parent", "dependant"] {
        let related: Vec<String> = dependencies
            .iter()
            .filter(|d| d.relation == relation)
            .map(|d| match (d.deleted, d.state) {
                (false, state) => format!("{} ({state})", d.id),
                (true, JobState::Succeeded) => format!("{} (succeeded, deleted)", d.id),
                (true, state) => format!("{} (deleted while {state}: never succeeds)", d.id),
            })
            .collect();
        if !related.is_empty() {
            let label = if relation == "parent" {
                "waits for"
            } else {
                "needed by"
            };
            lines.push(format!("{label}: {}", related.join(", ")));
        }
    }
    outln!("{}", lines.join("\n"));
    Ok(())
}

fn push_scalar(lines: &mut Vec<String>, name: &str, value: &Value) {
    let text = match value {
        Value::Null => return,
        Value::String(text) => text.clone(),
        other => other.to_string(),
    };
    lines.push(format!("{name:<14}{text}"));
}

/// The error history, oldest first: `attempt N at TIME: message`.
fn push_errors(lines: &mut Vec<String>, errors: Option<&Value>) {
    let Some(Value::Array(errors)) = errors else {
        return;
    };
    if errors.is_empty() {
        return;
    }
    lines.push(format!("errors ({}, oldest first):", errors.len()));
    for error in errors {
        let attempt = error
            .get("attempt")
            .map(Value::to_string)
            .unwrap_or_default();
        let at = error.get("at").and_then(Value::as_str).unwrap_or_default();
        let message = error
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or_default();
        lines.push(format!("  attempt {attempt} at {at}: {message}"));
    }
}
