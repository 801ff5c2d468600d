//! `skiplock jobs`: list jobs with filters, as a table or JSON.

use chrono::Utc;
use clap::Args;
use skiplock::JobFilter;
use skiplock::unstable_cli::DbPool;
use skiplock::{JobRow, JobState};

use crate::output::{JobJson, Table, clip, print_json, relative};

pub const EXAMPLES: &str = "\
Examples:
  skiplock jobs                                  # the 50 newest jobs
  skiplock jobs --state dead --queue mail
  skiplock jobs --state queued,running --kind http,command --limit 200
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

    /// Only jobs of these queues (comma-separated or repeated).
    #[arg(long = "queue", value_name = "Q", value_delimiter = ',', value_parser = crate::output::parse_queue_name)]
    queues: Vec<String>,

    /// Only jobs of these kinds (comma-separated or repeated).
    #[arg(
        long = "kind",
        value_name = "K",
        value_delimiter = ',',
        value_parser = |text: &str| crate::output::parse_non_empty(text, "a kind cannot be empty; name one, like http")
    )]
    kinds: Vec<String>,

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
    let jobs = list(pool, &args).await?;
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

/// The newest `--limit` jobs matching the filters: one list per queue and kind named
/// (the library's filter takes one of each), merged newest first.
async fn list(pool: &DbPool, args: &JobsArgs) -> anyhow::Result<Vec<JobRow>> {
    let any = |names: &[String]| -> Vec<Option<String>> {
        if names.is_empty() {
            vec![None]
        } else {
            names.iter().cloned().map(Some).collect()
        }
    };
    let mut jobs = Vec::new();
    for queue in any(&args.queues) {
        for kind in any(&args.kinds) {
            let filter = JobFilter {
                states: args.states.clone(),
                queue: queue.clone(),
                kind,
                limit: args.limit,
            };
            jobs.extend(skiplock::jobs(pool, &filter).await?);
        }
    }
    jobs.sort_unstable_by_key(|job| std::cmp::Reverse(job.id));
    // A queue or kind named twice lists its jobs twice.
    jobs.dedup_by_key(|job| job.id);
    jobs.truncate(usize::try_from(args.limit).unwrap_or(usize::MAX));
    Ok(jobs)
}
