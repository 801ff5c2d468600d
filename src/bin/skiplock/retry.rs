//! `skiplock retry`: put jobs back in line to run now.

use anyhow::Context;
use clap::Args;
use serde_json::json;
use skiplock::unstable_cli::DbPool;
use skiplock::{JobId, JobRow, JobState};

use crate::output::{Done, for_each_job, print_json};

pub const EXAMPLES: &str = "\
Examples:
  skiplock retry 42 43
  skiplock retry --dead                 # every dead job
  skiplock retry --dead --queue mail    # every dead job of queue mail

A retried job runs as soon as a worker is free, with one more attempt if it had used all of
its attempts. Running and waiting jobs cannot be retried. Same as SELECT skiplock.retry_job(42)
and SELECT * FROM skiplock.retry_dead_jobs('mail').";

#[derive(Args)]
pub struct RetryArgs {
    /// Ids of the jobs to retry.
    #[arg(
        value_name = "ID",
        required_unless_present = "dead",
        conflicts_with = "dead",
        allow_negative_numbers = true,
        value_parser = crate::output::parse_job_id
    )]
    ids: Vec<i64>,

    /// Retry every dead job (of --queue, if given).
    #[arg(long)]
    dead: bool,

    /// With --dead: only this queue.
    #[arg(long, value_name = "Q", requires = "dead", value_parser = crate::output::parse_queue_name)]
    queue: Option<String>,

    /// With --dead: print the retried ids as JSON.
    #[arg(long, requires = "dead")]
    json: bool,
}

pub async fn run(pool: &DbPool, args: RetryArgs) -> anyhow::Result<()> {
    if !args.dead {
        return for_each_job(
            pool,
            &args.ids,
            Done::ByRow(retried),
            |id| skiplock::retry(pool, id),
            refusal,
        )
        .await;
    }
    let ids = skiplock::retry_dead(pool, args.queue.as_deref())
        .await
        .context("cannot retry the dead jobs")?;
    if args.json {
        return print_json(&json!({ "retried": ids }));
    }
    let scope = args
        .queue
        .map_or_else(String::new, |queue| format!(" in queue {queue}"));
    match ids.len() {
        0 => outln!("no dead jobs{scope} to retry"),
        n => {
            let list: Vec<String> = ids.iter().map(ToString::to_string).collect();
            outln!("retried {n} dead jobs{scope}: {}", list.join(", "));
        }
    }
    Ok(())
}

/// What became of a retried job: queued, back behind its lane or parents, or superseded
/// by a pending job that took its unique key meanwhile.
fn retried(row: &JobRow) -> String {
    match row.state {
        JobState::Queued => "queued to run now".to_owned(),
        JobState::Waiting => {
            "waits for its turn (its lane's older jobs, or its parent jobs, come first)".to_owned()
        }
        _ => format!(
            "not requeued: {}",
            row.last_error
                .as_deref()
                .unwrap_or("it changed state meanwhile")
        ),
    }
}

fn refusal(id: JobId, state: JobState) -> String {
    match state {
        JobState::Running => {
            format!("job {id} is running; wait for it to finish, or cancel it first")
        }
        JobState::Waiting => {
            format!("job {id} is waiting for its parent jobs; it runs once they succeed")
        }
        _ => format!("job {id} is {state} and cannot be retried now"),
    }
}
