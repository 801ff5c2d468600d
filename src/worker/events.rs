//! In-process job events: what became of each job this worker ran, once its outcome is
//! saved, for an application that reacts to outcomes (notify someone, update a UI, count
//! in its own terms). [`Worker::subscribe`](super::Worker::subscribe) hands out a
//! receiver; any number may listen.
//!
//! Events never slow the worker: each subscriber has a buffer of [`EVENTS_BUFFERED`]
//! events, and one that falls further behind loses the oldest; [`JobEvents::recv`] logs
//! how many and [`JobEvents::dropped`] counts them. Nothing is built while nobody listens.

use std::time::Duration;

use tokio::sync::broadcast;

use crate::job::JobId;

/// Events a subscriber may fall behind by before it loses the oldest.
pub const EVENTS_BUFFERED: usize = 1024;

/// What became of one attempt of a job in this worker.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct JobEvent {
    /// The job.
    pub id: JobId,
    /// Its kind.
    pub kind: String,
    /// Its queue.
    pub queue: String,
    /// The attempt that ended (1 for the first run).
    pub attempt: i32,
    /// What happened.
    pub outcome: JobEventOutcome,
}

/// What happened to a job, as saved in the database.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum JobEventOutcome {
    /// The handler succeeded; the job is `succeeded`. `took`: how long it ran.
    Completed {
        /// Handler run time.
        took: Duration,
    },
    /// The attempt failed and the job runs again `retry_in` after its failure was saved.
    Retried {
        /// The error saved as `last_error`.
        error: String,
        /// The retry delay.
        retry_in: Duration,
    },
    /// The attempt failed and no other will run: the job is `dead`.
    Dead {
        /// The error saved as `last_error`.
        error: String,
    },
    /// Cancelled by its handler, or by `cancel_job` while it ran.
    Cancelled,
    /// Given back to the queue without spending the attempt (a shutdown).
    Released,
    /// The handler snoozed ([`crate::JobError::snooze`]): the job runs again `snooze_for`
    /// after this was saved, with its attempt given back.
    Snoozed {
        /// The snooze delay.
        snooze_for: Duration,
    },
    /// The claim was taken away (reaped after missed heartbeats) before the outcome could
    /// be saved; another worker runs the job.
    Lost,
}

/// A subscription to a worker's [`JobEvent`]s.
pub struct JobEvents {
    receiver: broadcast::Receiver<JobEvent>,
    dropped: u64,
}

impl JobEvents {
    pub(crate) fn new(receiver: broadcast::Receiver<JobEvent>) -> Self {
        Self {
            receiver,
            dropped: 0,
        }
    }

    /// The next event, or `None` once the worker has stopped and every event was read.
    /// Events lost because this subscriber fell behind are skipped, logged and counted.
    pub async fn recv(&mut self) -> Option<JobEvent> {
        loop {
            match self.receiver.recv().await {
                Ok(event) => return Some(event),
                Err(broadcast::error::RecvError::Lagged(lost)) => {
                    self.dropped += lost;
                    tracing::warn!(
                        dropped = lost,
                        "a job event subscriber fell behind; its oldest events were dropped"
                    );
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }

    /// Events this subscriber lost by falling behind.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}
