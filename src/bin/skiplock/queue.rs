//! `skiplock queue`: pause and resume queues.

use clap::{Args, Subcommand};
use skiplock::DbPool;

pub const EXAMPLES: &str = "Examples:
  skiplock queue pause mail     # workers claim nothing from `mail`; running jobs finish
  skiplock queue resume mail
  skiplock queue paused";

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
    }
    Ok(())
}
