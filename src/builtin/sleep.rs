//! `sleep`: waits `{"ms": N}` milliseconds, then succeeds. Stands in for I/O-bound work.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::job::{Job, JobContext, JobError};

/// Sleeps for `ms` milliseconds.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sleep {
    /// How long to sleep, in milliseconds.
    pub ms: u64,
}

impl Job for Sleep {
    const KIND: &'static str = "sleep";

    async fn run(self, _ctx: JobContext) -> Result<(), JobError> {
        tokio::time::sleep(Duration::from_millis(self.ms)).await;
        Ok(())
    }
}
