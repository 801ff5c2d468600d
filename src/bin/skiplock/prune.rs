//! `skiplock prune`: delete finished jobs now instead of waiting for a worker's pruner.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde_json::json;
use skiplock::DbPool;
use skiplock::Retention;
use skiplock::admin::jobs_prune_finished_rolled_up;

use crate::output::{parse_duration, print_json};

pub const EXAMPLES: &str = "\
Examples:
  skiplock prune                       # the default retention: succeeded and cancelled
                                       # after 1d, dead after 14d
  skiplock prune --older-than 30m      # every job that finished over 30 minutes ago
  skiplock prune --older-than 0s       # every finished job

Waiting, queued and running jobs are never pruned.";

/// Rows deleted per statement, so each delete is a short transaction.
const PRUNE_BATCH: i64 = 1000;

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
    let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    let mut pruned = 0u64;
    loop {
        let deleted = jobs_prune_finished_rolled_up(
            pool,
            ms(retention.succeeded),
            ms(retention.cancelled),
            ms(retention.dead),
            PRUNE_BATCH,
        )
        .await
        .context("cannot prune finished jobs")?;
        pruned += deleted;
        if deleted < PRUNE_BATCH as u64 {
            break;
        }
    }
    if args.json {
        return print_json(&json!({ "pruned": pruned }));
    }
    let age = match args.older_than {
        Some(age) => format!("more than {} ago", humantime::format_duration(age)),
        None => "past the default retention".to_owned(),
    };
    outln!("pruned {pruned} jobs that finished {age}");
    Ok(())
}
