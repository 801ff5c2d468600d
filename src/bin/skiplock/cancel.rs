//! `skiplock cancel`: cancel jobs that have not finished.

use clap::Args;
use skiplock::unstable_cli::DbPool;

use crate::output::{Done, for_each_job};

pub const EXAMPLES: &str = "\
Examples:
  skiplock cancel 42
  skiplock cancel 42 43 44

A waiting or queued job never runs; a running job's handler is stopped and its outcome
discarded. Jobs that depend on a cancelled job are cancelled too. Same as
SELECT skiplock.cancel_job(42).";

#[derive(Args)]
pub struct CancelArgs {
    /// Ids of the jobs to cancel.
    #[arg(
        value_name = "ID",
        required = true,
        allow_negative_numbers = true,
        value_parser = crate::output::parse_job_id
    )]
    ids: Vec<i64>,
}

pub async fn run(pool: &DbPool, args: CancelArgs) -> anyhow::Result<()> {
    for_each_job(
        pool,
        &args.ids,
        Done::Fixed("cancelled"),
        |id| cancel_retrying(pool, id),
        |id, state| format!("job {id} already finished ({state}); nothing to cancel"),
    )
    .await
}

/// Cancels one job, retrying a transient failure (a dropped connection, a server restart)
/// a few times. `skiplock.cancel_job` already retries on its own when Postgres picks it as
/// a deadlock victim; nothing was written by a failed attempt, and trying again is safe (a
/// retry after a lost reply finds the job cancelled already and says so).
async fn cancel_retrying(pool: &DbPool, id: skiplock::JobId) -> skiplock::Result<bool> {
    let mut failures = 0u32;
    loop {
        match skiplock::cancel(pool, id).await {
            Err(e) if e.is_transient() && failures < 3 => {
                failures += 1;
                tokio::time::sleep(std::time::Duration::from_millis(50 << failures)).await;
            }
            outcome => return outcome,
        }
    }
}
