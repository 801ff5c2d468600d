//! `skiplock jobs`: list jobs with filters, as a table or JSON.

use chrono::Utc;
use clap::Args;
use skiplock::DbPool;
use skiplock::JobState;
use skiplock::admin::{JobFilter, jobs_list};

use crate::output::{JobJson, Table, clip, print_json, relative};

pub const EXAMPLES: &str = "\
Examples:
  skiplock jobs                                  # the 50 newest jobs
  skiplock jobs --state dead --queue mail
  skiplock jobs --state queued,running --kind http --limit 200
  skiplock jobs --state dead --json | jq '.[].id'

--json prints an array of objects with the fields id, state, queue, kind, args, priority,
attempt, max_attempts, scheduled_at, created_at, finished_at, claimed_by, ordering_key,
unique_key and last_error.";

/// Characters of `last_error` shown in the table.
const ERROR_COLUMN_CHARS: usize = 60;

#[derive(Args)]
pub struct JobsArgs {
    /// Only jobs in these states (comma-separated or repeated): waiting, queued, running,
    /// succeeded, dead, cancelled.
    #[arg(long = "state", value_name = "S", value_delimiter = ',')]
    states: Vec<JobState>,

    /// Only jobs of this queue.
    #[arg(long, value_name = "Q", value_parser = crate::output::parse_queue_name)]
    queue: Option<String>,

    /// Only jobs of this kind.
    #[arg(long, value_name = "K")]
    kind: Option<String>,

    /// At most this many jobs, newest first.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 50,
        allow_negative_numbers = true,
        value_parser = |text: &str| crate::output::parse_count::<i64>(text, "jobs to list")
    )]
    limit: i64,

    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(pool: &DbPool, args: JobsArgs) -> anyhow::Result<()> {
    let filter = JobFilter {
        states: args.states,
        queue: args.queue,
        kind: args.kind,
        limit: args.limit,
    };
    let jobs = jobs_list(pool, &filter).await?;
    if args.json {
        let shaped: Vec<JobJson<'_>> = jobs.iter().map(JobJson::from).collect();
        return print_json(&shaped);
    }
    if jobs.is_empty() {
        outln!("no jobs match");
        return Ok(());
    }
    let now = Utc::now();
    let mut table = Table::new(&[
        ">ID",
        "STATE",
        "QUEUE",
        "KIND",
        ">ATTEMPT",
        "RUN AT",
        "CREATED",
        "LAST ERROR",
    ]);
    for job in &jobs {
        table.row(vec![
            job.id.to_string(),
            job.state.to_string(),
            job.queue.clone(),
            job.kind.clone(),
            format!("{}/{}", job.attempt, job.max_attempts),
            relative(job.scheduled_at, now),
            relative(job.created_at, now),
            job.last_error
                .as_deref()
                .map(|e| clip(e, ERROR_COLUMN_CHARS))
                .unwrap_or_default(),
        ]);
    }
    out!("{table}");
    Ok(())
}
