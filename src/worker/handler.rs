//! Type erasure for handlers: the worker keeps one [`Handler`] per registered kind and
//! calls it with the job's raw JSON args.

use std::marker::PhantomData;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use serde_json::Value;

use crate::job::{Job, JobContext, JobError};

/// A registered kind, with its args type erased.
pub(crate) trait Handler: Send + Sync + 'static {
    /// Decodes `args` and runs the job. Args that do not decode are a permanent failure.
    fn call(&self, args: Value, ctx: JobContext) -> BoxFuture<'static, Result<(), JobError>>;

    /// Delay before the retry that follows failed attempt `attempt`.
    fn retry_delay(&self, attempt: i32) -> Duration;

    /// Longest one attempt may run.
    fn timeout(&self) -> Option<Duration>;
}

/// The [`Handler`] of a typed [`Job`].
pub(crate) struct TypedHandler<J>(PhantomData<fn() -> J>);

impl<J> TypedHandler<J> {
    pub(crate) fn new() -> Self {
        Self(PhantomData)
    }
}

impl<J: Job> Handler for TypedHandler<J> {
    fn call(&self, args: Value, ctx: JobContext) -> BoxFuture<'static, Result<(), JobError>> {
        match serde_json::from_value::<J>(args) {
            Ok(job) => job.run(ctx).boxed(),
            Err(e) => {
                let message = format!(
                    "args do not match kind `{}`: {e}; fix the payload and retry the job",
                    J::KIND
                );
                async move { Err(JobError::permanent(message)) }.boxed()
            }
        }
    }

    fn retry_delay(&self, attempt: i32) -> Duration {
        J::retry_delay(attempt)
    }

    fn timeout(&self) -> Option<Duration> {
        J::timeout()
    }
}
