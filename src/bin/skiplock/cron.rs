//! `skiplock cron`: define, list and remove cron schedules.

use clap::{Args, Subcommand};
use skiplock::cron::{CronSchedule, MissedSlots};
use skiplock::unstable_cli::DbPool;

use crate::output::{parse_count, parse_non_empty, parse_priority, parse_queue_name};

pub const EXAMPLES: &str = "Examples:
  skiplock cron add nightly-report '0 3 * * *' http '{\"url\": \"http://reports/run\"}' --timezone Europe/Paris
  skiplock cron add heartbeat '*/10 * * * * *' noop            # 6 fields: seconds first
  skiplock cron list --json
  skiplock cron remove nightly-report";

#[derive(Args)]
pub struct CronArgs {
    #[command(subcommand)]
    action: CronAction,
}

#[derive(Subcommand)]
enum CronAction {
    /// Create or update a schedule. Workers enqueue exactly one job per slot.
    Add(AddArgs),
    /// List every schedule.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Delete a schedule; jobs it already produced stay.
    Remove {
        /// Schedule name.
        name: String,
    },
}

#[derive(Args)]
struct AddArgs {
    /// Unique schedule name.
    #[arg(value_parser = |text: &str| parse_non_empty(text, "a schedule name cannot be empty; name it, like nightly-report"))]
    name: String,
    /// Cron expression: 5 fields (minute hour day-of-month month day-of-week) or 6 (seconds first).
    expression: String,
    /// Kind of the jobs it produces.
    #[arg(value_parser = |text: &str| parse_non_empty(text, "the job kind cannot be empty; name the handler that runs the jobs, like noop"))]
    kind: String,
    /// Args of the jobs it produces (JSON).
    #[arg(default_value = "{}", value_parser = crate::enqueue::parse_json)]
    args: serde_json::Value,
    /// IANA time zone the expression is read in.
    #[arg(long, default_value = "UTC")]
    timezone: String,
    /// Queue of the jobs it produces [default: default].
    #[arg(long, value_parser = parse_queue_name)]
    queue: Option<String>,
    /// Priority of the jobs it produces (lower runs first).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = parse_priority)]
    priority: i16,
    /// Attempt budget of the jobs it produces [default: 25].
    #[arg(
        long,
        allow_negative_numbers = true,
        value_parser = |text: &str| parse_count::<i32>(text, "attempts")
    )]
    max_attempts: Option<i32>,
    /// Slots missed while no worker ran: `latest` runs the most recent once, `skip` none.
    #[arg(long, default_value = "latest", value_parser = parse_missed)]
    missed: MissedSlots,
}

fn parse_missed(value: &str) -> Result<MissedSlots, String> {
    value.parse()
}

pub async fn run(pool: &DbPool, args: CronArgs) -> anyhow::Result<()> {
    match args.action {
        CronAction::Add(add) => {
            // Queue and attempts not given: the library's defaults, as `CronSchedule::new` sets them.
            let mut schedule = CronSchedule::new(&add.name, &add.expression, &add.kind)
                .args(add.args)
                .timezone(&add.timezone)
                .missed(add.missed);
            if let Some(queue) = add.queue {
                schedule = schedule.queue(queue);
            }
            schedule.priority = add.priority;
            if let Some(max_attempts) = add.max_attempts {
                schedule.max_attempts = max_attempts;
            }
            // A schedule the library or the database refuses (a malformed expression, an
            // unknown time zone) is a bad argument: exit 2.
            match skiplock::cron::upsert(pool, &schedule).await {
                Err(why @ skiplock::Error::InvalidCron(_)) => {
                    crate::usage_error(&["cron", "add"], why)
                }
                result => result?,
            }
            outln!("cron schedule `{}` saved", add.name);
        }
        CronAction::List { json } => {
            let rows = skiplock::cron::list(pool).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&rows)?);
            } else if rows.is_empty() {
                outln!("no cron schedules");
            } else {
                outln!(
                    "{:<20} {:<18} {:<16} {:<12} {:<10} {:<7} {:<25} ERROR",
                    "NAME",
                    "EXPRESSION",
                    "TIMEZONE",
                    "KIND",
                    "QUEUE",
                    "MISSED",
                    "LAST SLOT"
                );
                for row in rows {
                    outln!(
                        "{:<20} {:<18} {:<16} {:<12} {:<10} {:<7} {:<25} {}",
                        row.name,
                        row.expression,
                        row.timezone,
                        row.kind,
                        row.queue,
                        row.missed,
                        row.last_slot_at.format("%Y-%m-%d %H:%M:%S UTC"),
                        row.last_error.unwrap_or_default()
                    );
                }
            }
        }
        CronAction::Remove { name } => {
            if !skiplock::cron::remove(pool, &name).await? {
                anyhow::bail!(
                    "no cron schedule named `{name}`; list them with `skiplock cron list`"
                );
            }
            outln!("cron schedule `{name}` removed");
        }
    }
    Ok(())
}
