//! `skiplock stats`: per queue and kind, what waits, runs, finished and how fast.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde_json::json;
use skiplock::stats::{Counts, Stats};
use skiplock::unstable_cli::DbPool;

use crate::output::{Table, compact_seconds, parse_refresh_interval};

pub const EXAMPLES: &str = "\
Examples:
  skiplock stats
  skiplock stats --watch --interval 5s
  skiplock stats --json | jq '.queues[] | select(.lag_seconds > 60)'

Columns: RUNNABLE queued and due; SCHEDULED queued for later (retries in backoff included);
WAITING for parent jobs; RUNNING; OK/1H and DEAD/1H finished in the last hour; LAG age of
the oldest runnable job; JOBS/S successes per second over the last minute. --json prints
{at, total, queues, kinds, rows, limits} with these numbers by their snake_case names; with
--watch, one such object per line. Same numbers: SELECT * FROM skiplock.stats. Queues with a
global limit get a table of their own (skiplock queue limits).";

#[derive(Args)]
pub struct StatsArgs {
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,

    /// Refresh until interrupted.
    #[arg(long)]
    watch: bool,

    /// With --watch: time between refreshes, e.g. 1s, 10s.
    #[arg(long, value_name = "DURATION", default_value = "2s", allow_hyphen_values = true, value_parser = parse_refresh_interval, requires = "watch")]
    interval: Duration,
}

pub async fn run(pool: &DbPool, args: StatsArgs) -> anyhow::Result<()> {
    let redraw = args.watch && !args.json && std::io::stdout().is_terminal();
    loop {
        let stats = skiplock::stats::stats(pool)
            .await
            .context("cannot read the stats")?;
        let limits = skiplock::queue_limits(pool)
            .await
            .context("cannot read the queues' limits")?;
        let text = if args.json {
            let document = json!({
                "at": stats.at,
                "total": stats.total(),
                "queues": stats.by_queue(),
                "kinds": stats.by_kind(),
                "rows": stats.rows,
                "limits": limits.iter().map(crate::queue::limits_json).collect::<Vec<_>>(),
            });
            if args.watch {
                serde_json::to_string(&document)?
            } else {
                serde_json::to_string_pretty(&document)?
            }
        } else if limits.is_empty() {
            render(&stats)
        } else {
            format!(
                "{}\n\nGlobal limits\n{}",
                render(&stats),
                crate::queue::limits_table(&limits)
            )
        };
        let mut stdout = std::io::stdout().lock();
        if redraw {
            // Home the cursor and clear the screen, so the tables refresh in place.
            write!(stdout, "\x1b[H\x1b[2J")?;
        }
        writeln!(stdout, "{text}")?;
        stdout.flush()?;
        drop(stdout);
        if !args.watch {
            return Ok(());
        }
        tokio::select! {
            () = tokio::time::sleep(args.interval) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}

/// The stats as two tables, by queue and by kind, under the time they were taken.
pub fn render(stats: &Stats) -> String {
    let at = stats.at.format("%Y-%m-%d %H:%M:%S UTC");
    if stats.rows.is_empty() {
        return format!("{at}: no unfinished jobs and none finished in the last hour");
    }
    let mut queues = Table::new(&[&["QUEUE", "PAUSED"][..], &COUNT_COLUMNS].concat());
    for queue in stats.by_queue() {
        let mut row = vec![
            queue.queue.clone(),
            if queue.paused { "yes" } else { "no" }.to_owned(),
        ];
        row.extend(numbers(&queue.counts));
        queues.row(row);
    }
    let mut kinds = Table::new(&[&["KIND"][..], &COUNT_COLUMNS].concat());
    for kind in stats.by_kind() {
        let mut row = vec![kind.kind.clone()];
        row.extend(numbers(&kind.counts));
        kinds.row(row);
    }
    format!("{at}\n\n{queues}\n{kinds}")
}

/// Headers of the columns [`numbers`] fills, right-aligned.
const COUNT_COLUMNS: [&str; 8] = [
    ">RUNNABLE",
    ">SCHEDULED",
    ">WAITING",
    ">RUNNING",
    ">OK/1H",
    ">DEAD/1H",
    ">LAG",
    ">JOBS/S",
];

fn numbers(counts: &Counts) -> Vec<String> {
    vec![
        counts.runnable.to_string(),
        counts.scheduled.to_string(),
        counts.waiting.to_string(),
        counts.running.to_string(),
        counts.succeeded_last_hour.to_string(),
        counts.dead_last_hour.to_string(),
        compact_seconds(counts.lag_seconds as u64),
        format!("{:.1}", counts.per_second),
    ]
}
