//! `skiplock prune`: delete finished jobs now instead of waiting for a worker's pruner.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde_json::json;
use skiplock::Retention;
use skiplock::unstable_cli::DbPool;

use crate::output::{parse_duration, print_json};

pub const EXAMPLES: &str = "\
Examples:
  skiplock prune                       # the default retention: succeeded and cancelled
                                       # after 1d, dead after 14d
  skiplock prune --older-than 30m      # every job that finished over 30 minutes ago
  skiplock prune --older-than 0s       # every finished job

Waiting, queued and running jobs are never pruned. Under a retention of a day or more,
whole days of finished jobs (UTC) are dropped once every job in them is past it, so a
job may stay up to a day longer; a shorter one deletes each job past it.";

#[derive(Args)]
pub struct PruneArgs {
    /// Delete jobs that finished (succeeded, cancelled or dead) longer ago than this,
    /// e.g. 30m, 12h, 7d.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, allow_hyphen_values = true)]
    older_than: Option<Duration>,

    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn run(pool: &DbPool, args: PruneArgs) -> anyhow::Result<()> {
    let retention = match args.older_than {
        Some(age) => Retention {
            succeeded: age,
            cancelled: age,
            dead: age,
        },
        None => Retention::default(),
    };
    let pruned = skiplock::admin::prune(pool.pool(), retention)
        .await
        .context("cannot prune finished jobs")?;
    if args.json {
        return print_json(&json!({
            "pruned": pruned.jobs,
            "partitions_dropped": pruned.days,
            "partitions_left": pruned.days_left,
        }));
    }
    let age = match args.older_than {
        Some(age) => format!("more than {} ago", humantime::format_duration(age)),
        None => "past the default retention".to_owned(),
    };
    outln!("pruned {} jobs that finished {age}", pruned.jobs);
    if pruned.days > 0 {
        outln!(
            "  {} of them in whole days (one partition per day and state) dropped at once",
            pruned.days
        );
    }
    if pruned.days_left > 0 {
        outln!(
            "  {} day partitions past retention are busy (a long transaction reads them): run prune again later",
            pruned.days_left
        );
    }
    Ok(())
}
