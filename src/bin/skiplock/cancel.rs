//! `skiplock cancel`: cancel jobs that have not finished.

use clap::Args;
use sqlx::PgPool;

use crate::output::for_each_job;

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
    #[arg(value_name = "ID", required = true)]
    ids: Vec<i64>,
}

pub async fn run(pool: &PgPool, args: CancelArgs) -> anyhow::Result<()> {
    for_each_job(
        pool,
        &args.ids,
        "cancelled",
        |id| skiplock::cancel(pool, id),
        |id, state| format!("job {id} already finished ({state}); nothing to cancel"),
    )
    .await
}
