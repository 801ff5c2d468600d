//! `noop`: does nothing and succeeds. Useful for smoke tests and benchmarks.

use serde::{Deserialize, Serialize};

use crate::job::{Job, JobContext, JobError};

/// Does nothing. Any args object is accepted and ignored.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Noop {}

impl Job for Noop {
    const KIND: &'static str = "noop";

    async fn run(self, _ctx: JobContext) -> Result<(), JobError> {
        Ok(())
    }
}
