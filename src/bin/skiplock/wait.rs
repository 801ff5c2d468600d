//! `skiplock wait ID...`: wait until jobs have finished and print their outcomes.

use std::time::Duration;

use clap::Args;
use serde_json::json;
use skiplock::unstable_cli::DbPool;
use skiplock::{Error, JobId, JobOutcome, JobState};

use crate::output::parse_duration;

pub const EXAMPLES: &str = r#"Examples:
  skiplock wait 42
  skiplock wait 42 43 44 --timeout 5m
  skiplock wait "$(skiplock enqueue sleep '{"ms": 500}')" --json

Returns once every job has finished, each woken by its own notification at the commit that
finished it (skiplock::wait_for; in SQL, skiplock.watch_job with LISTEN skiplock_finished).
Prints a line per job: succeeded (with its output), dead (with its last error) or cancelled.
Exit 0 when every job succeeded; 1 when one ended dead or cancelled, does not exist, or had
not finished within --timeout (it is left as it is). With --json, one object per line:
{"id", "state", "attempt", "output", "last_error", "finished_at"}, or {"id", "error"}."#;

#[derive(Args)]
pub struct WaitArgs {
    /// Ids of the jobs to wait for.
    #[arg(
        value_name = "ID",
        required = true,
        allow_negative_numbers = true,
        value_parser = crate::output::parse_job_id
    )]
    ids: Vec<i64>,

    /// How long to wait for them, like 30s, 5m or 2h.
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    timeout: Duration,

    /// Print one JSON object per job instead of text.
    #[arg(long)]
    json: bool,
}

pub async fn run(pool: &DbPool, args: WaitArgs) -> anyhow::Result<()> {
    let waits = args
        .ids
        .iter()
        .map(|&id| skiplock::wait_for(pool.pool(), JobId(id), args.timeout));
    let outcomes = futures_util::future::join_all(waits).await;
    let mut unsucceeded = 0;
    for (&id, outcome) in args.ids.iter().zip(outcomes) {
        let succeeded = matches!(&outcome, Ok(o) if o.state == JobState::Succeeded);
        if !succeeded {
            unsucceeded += 1;
        }
        match (outcome, args.json) {
            (Ok(outcome), false) => outln!("{}", describe(&outcome)),
            (Ok(outcome), true) => outln!(
                "{}",
                json!({
                    "id": outcome.id.0,
                    "state": outcome.state.as_str(),
                    "attempt": outcome.attempt,
                    "output": outcome.output,
                    "last_error": outcome.last_error,
                    "finished_at": outcome.finished_at,
                })
            ),
            // A job that is not there, not finished in time, or could not be looked at:
            // its own line, and the others are still waited for.
            (Err(e), false) => outln!("{}", describe_error(id, &e)),
            (Err(e), true) => outln!("{}", json!({"id": id, "error": describe_error(id, &e)})),
        }
    }
    if unsucceeded > 0 {
        anyhow::bail!(
            "{unsucceeded} of {} jobs did not succeed (above); `skiplock show ID` says more",
            args.ids.len()
        );
    }
    Ok(())
}

/// One line for a job that could not be waited for.
fn describe_error(id: i64, error: &Error) -> String {
    match error {
        Error::JobNotFound { .. } | Error::WaitTimedOut { .. } => error.to_string(),
        other => format!("cannot wait for job {id}: {other}"),
    }
}

/// One line for a finished job: its state, attempts and time, then its output or error.
fn describe(outcome: &JobOutcome) -> String {
    let head = format!(
        "job {} {} (attempt {}) at {}",
        outcome.id,
        outcome.state,
        outcome.attempt,
        outcome.finished_at.to_rfc3339()
    );
    match (&outcome.output, &outcome.last_error) {
        (Some(output), _) if outcome.state == JobState::Succeeded => format!("{head}: {output}"),
        (_, Some(error)) if outcome.state != JobState::Succeeded => {
            format!("{head}: {}", crate::output::clip(error, 200))
        }
        _ => head,
    }
}
