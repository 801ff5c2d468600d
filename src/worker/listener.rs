//! The listener: LISTEN on `skiplock_jobs` and wake the producer when a job for one of our
//! queues arrives. Notifications are a latency optimisation only; the producer also polls,
//! so a lost listener delays work by at most one poll interval. After a reconnect the
//! producer is woken once to catch up on anything inserted while the listener was down.

use std::sync::Arc;

use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio_util::sync::CancellationToken;

use super::Shared;
use crate::pacing::db_retry_delay;

/// The channel the insert trigger and the release statement notify, with the queue name
/// as payload.
pub(crate) const NOTIFY_CHANNEL: &str = "skiplock_jobs";

/// The channel `skiplock.cancel_job` notifies when it cancels a running job, with the job
/// id as payload: the worker holding it stops the handler at once instead of at its next
/// heartbeat.
pub(crate) const CANCEL_CHANNEL: &str = "skiplock_cancel";

/// Listens until `stop`, reconnecting with backoff whenever the connection drops.
///
/// The listener holds its connection for as long as it listens, so it gets one of its own
/// (same connect options as the worker's pool) rather than taking one of the pool's: a
/// small pool must stay free for claims, heartbeats and completions.
///
/// Behind PgBouncer in transaction mode, LISTEN cannot work (the session it needs ends
/// with each transaction): the listener connects with the worker's listen options (a
/// direct URL) or does not run, and the producer finds new jobs by polling.
pub(super) async fn listen(shared: Arc<Shared>, stop: CancellationToken) {
    let options = match (&shared.listen_options, shared.pool.is_pgbouncer()) {
        (Some(options), _) => options.clone(),
        (None, false) => (*shared.pool.pool().connect_options()).clone(),
        (None, true) => {
            tracing::info!(
                poll_interval_ms = shared.config.poll_interval.as_millis() as u64,
                "behind PgBouncer with no direct URL to LISTEN on: polling for new jobs, \
                 cancellations reach running jobs at the next heartbeat"
            );
            return;
        }
    };
    let own_connection = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .connect_lazy_with(options);
    let mut failures = 0u32;
    loop {
        let session = async {
            let mut listener = PgListener::connect_with(&own_connection).await?;
            listener
                .listen_all([NOTIFY_CHANNEL, CANCEL_CHANNEL])
                .await?;
            // Anything inserted before LISTEN took effect would otherwise wait for a poll.
            shared.wake_all();
            failures = 0;
            loop {
                match listener.try_recv().await? {
                    Some(notification) if notification.channel() == CANCEL_CHANNEL => {
                        // The database already voided the claim; stop the handler now.
                        if let Ok(id) = notification.payload().parse::<i64>() {
                            for id in shared.claims.stop_job(id) {
                                tracing::info!(job_id = id, "job cancelled; stopping its handler");
                            }
                        }
                    }
                    Some(notification) => shared.wake_queue(notification.payload()),
                    // Connection lost: catch up, then `try_recv` reconnects.
                    None => shared.wake_all(),
                }
            }
            #[allow(unreachable_code)]
            Ok::<(), sqlx::Error>(())
        };
        tokio::select! {
            () = stop.cancelled() => return,
            result = session => {
                if let Err(e) = result {
                    failures += 1;
                    tracing::warn!(error = %e, "listener connection failed; polling until it reconnects");
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(db_retry_delay(failures)) => {}
        }
    }
}
