//! `skiplock queue`: pause and resume queues, set and show their global limits.

use std::time::Duration;

use clap::{ArgGroup, Args, Subcommand};
use serde_json::json;
use skiplock::unstable_cli::DbPool;
use skiplock::{LimitKind, QueueLimits};

use crate::output::{Table, parse_duration};

pub const EXAMPLES: &str = "Examples:
  skiplock queue pause mail     # workers claim nothing from `mail`; running jobs finish
  skiplock queue resume mail
  skiplock queue paused
  skiplock queue limit exports --max-running 5      # at most 5 running, across every worker
  skiplock queue limit mail --rate 100/1s           # at most 100 starts in any second
  skiplock queue limit mail --rate none             # remove the rate limit
  skiplock queue limit reports --key-max-running 2  # at most 2 running per concurrency key
  skiplock queue limit reports --key-rate 10/1m     # at most 10 starts of a key in any minute
  skiplock queue limits                             # each limit, its use, the jobs held back";

#[derive(Args)]
pub struct QueueArgs {
    #[command(subcommand)]
    action: QueueAction,
}

#[derive(Subcommand)]
enum QueueAction {
    /// Stop claiming from a queue; running jobs finish.
    Pause {
        /// Queue name.
        #[arg(value_parser = crate::output::parse_queue_name)]
        queue: String,
    },
    /// Resume a paused queue and wake its workers.
    Resume {
        /// Queue name.
        #[arg(value_parser = crate::output::parse_queue_name)]
        queue: String,
    },
    /// List paused queues.
    Paused,
    /// Set a queue's global limits, held by every worker on every host; a limit not
    /// named stays as it is.
    #[command(group(ArgGroup::new("limits").required(true).multiple(true).args(["max_running", "rate", "key_max_running", "key_rate", "key_claimable"])))]
    Limit {
        /// Queue name (it need not have jobs yet).
        #[arg(value_parser = crate::output::parse_queue_name)]
        queue: String,
        /// At most N of the queue's jobs running at once; `none` removes the limit.
        #[arg(long, value_name = "N|none", allow_hyphen_values = true, value_parser = parse_max_running)]
        max_running: Option<Limit<u32>>,
        /// At most N jobs starting in any window of PERIOD, like 100/1s or 5000/1m;
        /// `none` removes the limit.
        #[arg(long, value_name = "N/PERIOD|none", allow_hyphen_values = true, value_parser = parse_rate)]
        rate: Option<Limit<(u32, Duration)>>,
        /// At most N jobs of one concurrency key (`skiplock enqueue --concurrency-key`)
        /// running at once; `none` removes the limit.
        #[arg(long, value_name = "N|none", allow_hyphen_values = true, value_parser = parse_max_running)]
        key_max_running: Option<Limit<u32>>,
        /// At most N jobs of one concurrency key starting in any window of PERIOD, like
        /// 10/1m; `none` removes the limit.
        #[arg(long, value_name = "N/PERIOD|none", allow_hyphen_values = true, value_parser = parse_rate)]
        key_rate: Option<Limit<(u32, Duration)>>,
        /// Fair queueing by concurrency key: at most N due jobs of one key queued at once
        /// (per priority), the keys taking turns; `none` turns it off. About a worker's
        /// prefetch (32) keeps a lone key's drain as fast.
        #[arg(long, value_name = "N|none", allow_hyphen_values = true, value_parser = parse_key_claimable)]
        key_claimable: Option<Limit<u32>>,
    },
    /// List the queues with global limits: each limit, its use, the jobs it holds back.
    Limits {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// A limit to set, or `none`.
#[derive(Clone, Copy, Debug)]
enum Limit<T> {
    Set(T),
    Remove,
}

fn parse_max_running(text: &str) -> Result<Limit<u32>, String> {
    if text == "none" {
        return Ok(Limit::Remove);
    }
    match text.parse::<u32>() {
        Ok(n) if n >= 1 && i32::try_from(n).is_ok() => Ok(Limit::Set(n)),
        Ok(0) => Err(
            "a limit of 0 running jobs would stop the queue; pause it instead \
                      (skiplock queue pause), or write `none` to remove the limit"
                .to_owned(),
        ),
        _ => Err(format!(
            "`{text}` is not a number of jobs; write one from 1 to {}, or `none`",
            i32::MAX
        )),
    }
}

fn parse_key_claimable(text: &str) -> Result<Limit<u32>, String> {
    match text.parse::<u32>() {
        Ok(0) => Err("a key's turn of 0 jobs would hold every job with a key; \
                      write 1 or more, or `none` to turn fair queueing off"
            .to_owned()),
        _ => parse_max_running(text),
    }
}

/// `starts/period` with 1 to `skiplock::RATE_LIMIT_MAX_STARTS` starts, or `none`: the
/// queue's rate limit and a key's alike.
fn parse_rate(text: &str) -> Result<Limit<(u32, Duration)>, String> {
    let max_starts = skiplock::RATE_LIMIT_MAX_STARTS;
    if text == "none" {
        return Ok(Limit::Remove);
    }
    let refusal = || {
        format!("`{text}` is not a rate; write starts/period, like 100/1s or 5000/1m, or `none`")
    };
    let (starts, period) = text.split_once('/').ok_or_else(refusal)?;
    let starts: u32 = starts.trim().parse().map_err(|_| refusal())?;
    if starts == 0 || starts > max_starts {
        return Err(format!(
            "a rate of {starts} starts per period is out of range; write 1 to {max_starts} \
             (for more, use a shorter period), or `none`"
        ));
    }
    let period = parse_duration(period.trim())?;
    if period < Duration::from_micros(1) {
        return Err(format!("`{text}` has a period of zero; write one like 1s"));
    }
    Ok(Limit::Set((starts, period)))
}

pub async fn run(pool: &DbPool, args: QueueArgs) -> anyhow::Result<()> {
    match args.action {
        QueueAction::Pause { queue } => {
            skiplock::pause_queue(pool, &queue).await?;
            outln!("queue `{queue}` paused");
        }
        QueueAction::Resume { queue } => {
            skiplock::resume_queue(pool, &queue).await?;
            outln!("queue `{queue}` resumed");
        }
        QueueAction::Paused => {
            for queue in skiplock::paused_queues(pool).await? {
                outln!("{queue}");
            }
        }
        QueueAction::Limit {
            queue,
            max_running,
            rate,
            key_max_running,
            key_rate,
            key_claimable,
        } => {
            let mut limits = skiplock::queue_limits(pool)
                .await?
                .into_iter()
                .find(|status| status.queue == queue)
                .map(|status| status.limits)
                .unwrap_or_default();
            match max_running {
                Some(Limit::Set(n)) => limits = limits.max_running(n),
                Some(Limit::Remove) => limits = limits.max_running(0),
                None => {}
            }
            match rate {
                Some(Limit::Set((starts, per))) => limits = limits.rate(starts, per),
                Some(Limit::Remove) => limits = limits.rate(0, Duration::ZERO),
                None => {}
            }
            match key_max_running {
                Some(Limit::Set(n)) => limits = limits.key_max_running(n),
                Some(Limit::Remove) => limits = limits.key_max_running(0),
                None => {}
            }
            match key_rate {
                Some(Limit::Set((starts, per))) => limits = limits.key_rate(starts, per),
                Some(Limit::Remove) => limits = limits.key_rate(0, Duration::ZERO),
                None => {}
            }
            match key_claimable {
                Some(Limit::Set(n)) => limits = limits.key_claimable(n),
                Some(Limit::Remove) => limits = limits.key_claimable(0),
                None => {}
            }
            skiplock::set_queue_limits(pool, &queue, limits).await?;
            outln!("queue `{queue}`: {}", describe(&limits));
        }
        QueueAction::Limits { json } => {
            let queues = skiplock::queue_limits(pool).await?;
            if json {
                let rows: Vec<_> = queues.iter().map(limits_json).collect();
                outln!("{}", serde_json::to_string_pretty(&rows)?);
            } else if queues.is_empty() {
                outln!("no queue has a global limit; set one with skiplock queue limit");
            } else {
                outln!("{}", limits_table(&queues));
            }
        }
    }
    Ok(())
}

/// The limits in words: `max_running 5, rate 100 per 1s, …`.
fn describe(limits: &QueueLimits) -> String {
    let count =
        |n: Option<std::num::NonZeroU32>| n.map_or_else(|| "none".to_owned(), |n| n.to_string());
    let rate = |rate: Option<skiplock::RateLimit>| {
        rate.map_or_else(
            || "none".to_owned(),
            |rate| {
                format!(
                    "{} per {}",
                    rate.starts,
                    humantime::format_duration(rate.per)
                )
            },
        )
    };
    format!(
        "max_running {}, rate {}, key_max_running {}, key_rate {}, key_claimable {}",
        count(limits.max_running),
        rate(limits.rate),
        count(limits.key_max_running),
        rate(limits.key_rate),
        count(limits.key_claimable)
    )
}

/// A rate as a table cell: `100/1s`, or `-`.
fn rate_cell(rate: Option<skiplock::RateLimit>) -> String {
    rate.map_or_else(
        || "-".to_owned(),
        |rate| format!("{}/{}", rate.starts, humantime::format_duration(rate.per)),
    )
}

/// One queue of `skiplock queue limits --json`; the same names as skiplock.queue_limits.
pub fn limits_json(status: &skiplock::QueueLimitStatus) -> serde_json::Value {
    json!({
        "queue": status.queue,
        "paused": status.paused,
        "max_running": status.limits.max_running.map(|n| n.get()),
        "running": status.running,
        "rate_limit": status.limits.rate.map(|rate| rate.starts.get()),
        "rate_period_seconds": status.limits.rate.map(|rate| rate.per.as_secs_f64()),
        "started_in_period": status.started_in_period,
        "holding_back": status.holding_back.map(limit_name),
        "runnable": status.runnable,
        "held_back": status.held_back,
        "key_max_running": status.limits.key_max_running.map(|n| n.get()),
        "keys_at_limit": status.keys_at_limit,
        "key_rate_limit": status.limits.key_rate.map(|rate| rate.starts.get()),
        "key_rate_period_seconds": status.limits.key_rate.map(|rate| rate.per.as_secs_f64()),
        "keys_rate_limited": status.keys_rate_limited,
        "held_by_key": status.held_by_key,
        "key_claimable": status.limits.key_claimable.map(|n| n.get()),
    })
}

fn limit_name(kind: LimitKind) -> &'static str {
    match kind {
        LimitKind::MaxRunning => "max_running",
        LimitKind::Rate => "rate_limit",
        _ => "other",
    }
}

/// The queues with limits as a table: RUNNING/MAX and STARTED/RATE side by side.
pub fn limits_table(queues: &[skiplock::QueueLimitStatus]) -> Table {
    let mut table = Table::new(&[
        "QUEUE",
        ">RUNNING",
        ">MAX",
        ">STARTED",
        ">RATE",
        "HOLDING BACK",
        ">HELD",
        ">KEY MAX",
        ">KEYS FULL",
        ">KEY RATE",
        ">KEYS AT RATE",
        ">HELD BY KEY",
        ">KEY TURN",
    ]);
    for status in queues {
        table.row(vec![
            status.queue.clone(),
            status.running.to_string(),
            status
                .limits
                .max_running
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            status.started_in_period.to_string(),
            rate_cell(status.limits.rate),
            match (status.paused, status.holding_back) {
                (true, _) => "paused".to_owned(),
                (false, Some(kind)) => limit_name(kind).to_owned(),
                (false, None) => "-".to_owned(),
            },
            status.held_back.to_string(),
            status
                .limits
                .key_max_running
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            status.keys_at_limit.to_string(),
            rate_cell(status.limits.key_rate),
            status.keys_rate_limited.to_string(),
            status.held_by_key.to_string(),
            status
                .limits
                .key_claimable
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
        ]);
    }
    table
}
