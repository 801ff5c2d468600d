//! The listener: LISTEN on `skiplock_runnable` and tell the producer of a queue where, in
//! claim order, jobs became runnable (which wakes it); LISTEN on `skiplock_due_later` and
//! hand the keys of jobs that become due later to the due timers
//! ([`super::due_timers`]), which tell the producer when they do. Notifications make
//! pickup fast and let the producer claim from its position without losing the jobs that
//! land behind it (see [`super::claim_cursor`]); they are not needed for correctness. The
//! producer also polls, and while the listener is not subscribed it finds jobs behind its
//! position with frequent full walks. After each (re)subscription every producer looks at
//! its queue from the start once, to catch up on anything written while the listener was
//! down.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio_util::sync::CancellationToken;

use super::Shared;
use super::claim_cursor::LookFrom;
use crate::pacing::db_retry_delay;

/// The channel every write that makes jobs runnable notifies: the insert trigger, the
/// functions that promote or requeue jobs, the release statement, each through
/// `skiplock.internal_announce` (`migrations/functions/02_notifications.sql`). Payload: see [`parse_runnable`].
pub(crate) const RUNNABLE_CHANNEL: &str = "skiplock_runnable";

/// The channel every write that makes jobs due later notifies (the insert trigger, the
/// failure, release and reap statements, lane and dependency promotions;
/// `skiplock.internal_notify_due_later` sends it), the worker's own: not a stable API.
/// Payload: see [`parse_due_later`].
pub(crate) const DUE_LATER_CHANNEL: &str = "skiplock_due_later";

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
    // Pinned like every session skiplock opens (the pool's options already are).
    let options = match (&shared.listen_options, shared.pool.is_pgbouncer()) {
        (Some(options), _) => crate::pool::pin_session(options.clone()),
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
                .listen_all([RUNNABLE_CHANNEL, DUE_LATER_CHANNEL, CANCEL_CHANNEL])
                .await?;
            shared.listening.store(true, Ordering::Relaxed);
            // Anything written before LISTEN took effect was not announced.
            shared.look_from_start_all();
            failures = 0;
            loop {
                // `None`: the connection was lost. The session ends here rather than
                // letting `try_recv` reconnect, so that the catch-up above runs only once
                // LISTEN is in effect again.
                let Some(notification) = listener.try_recv().await? else {
                    return Ok(());
                };
                if notification.channel() == CANCEL_CHANNEL {
                    // The database already voided the claim; stop the handler now.
                    if let Ok(id) = notification.payload().parse::<i64>() {
                        for id in shared.claims.stop_job(id) {
                            tracing::info!(job_id = id, "job cancelled; stopping its handler");
                        }
                    }
                } else if notification.channel() == DUE_LATER_CHANNEL {
                    // Nothing to catch up on when it cannot be read: the job is not due
                    // yet, and the full walks find it when it is.
                    match parse_due_later(notification.payload()) {
                        Some((due_in_us, queue, from)) => {
                            shared.due_later(queue, from, due_in_us, Instant::now());
                        }
                        None => tracing::warn!(
                            payload = notification.payload(),
                            "unreadable {DUE_LATER_CHANNEL} notification; ignored"
                        ),
                    }
                } else if let Some((queue, from)) = parse_runnable(notification.payload()) {
                    shared.runnable(queue, from);
                } else {
                    tracing::warn!(
                        payload = notification.payload(),
                        "unreadable {RUNNABLE_CHANNEL} notification; looking at every queue \
                         from the start"
                    );
                    shared.look_from_start_all();
                }
            }
        };
        let ended: Option<Result<(), sqlx::Error>> = tokio::select! {
            () = stop.cancelled() => None,
            result = session => Some(result),
        };
        shared.listening.store(false, Ordering::Relaxed);
        match ended {
            None => return,
            Some(Ok(())) => tracing::warn!("listener connection lost; reconnecting"),
            Some(Err(e)) => {
                failures += 1;
                if crate::read_only::worth_a_warning(&e) {
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

/// Reads a `skiplock_runnable` payload: `priority<TAB>scheduled_at_us<TAB>queue`, the
/// lowest claim key made runnable in the queue (`scheduled_at` in microseconds since the
/// Unix epoch, `i64::MIN` for `-infinity`), or `-<TAB>-<TAB>queue`: look from the start.
/// The queue comes last and may hold any character, tabs included. `None` for anything
/// else.
fn parse_runnable(payload: &str) -> Option<(&str, LookFrom)> {
    let mut fields = payload.splitn(3, '\t');
    let (priority, scheduled_at_us, queue) = (fields.next()?, fields.next()?, fields.next()?);
    if (priority, scheduled_at_us) == ("-", "-") {
        return Some((queue, LookFrom::Start));
    }
    Some((
        queue,
        LookFrom::at(priority.parse().ok()?, scheduled_at_us.parse().ok()?),
    ))
}

/// Reads a `skiplock_due_later` payload: `first_in_us<TAB>last_in_us<TAB>` and then a
/// claim key as [`parse_runnable`] reads it (not "from the start"): in how many
/// microseconds, from the write, the first and the last of the jobs come due (zero or less:
/// already), and the claim key of the first. `None` for anything else.
fn parse_due_later(payload: &str) -> Option<([i64; 2], &str, LookFrom)> {
    let mut fields = payload.splitn(3, '\t');
    let (first_in_us, last_in_us, key) = (fields.next()?, fields.next()?, fields.next()?);
    let due_in_us = [first_in_us.parse().ok()?, last_in_us.parse().ok()?];
    match parse_runnable(key)? {
        (_, LookFrom::Start) => None,
        (queue, from) => Some((due_in_us, queue, from)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runnable_payloads_are_read_with_the_queue_last() {
        assert_eq!(
            parse_runnable("-3\t1795607926369988\tmail"),
            Some(("mail", LookFrom::at(-3, 1_795_607_926_369_988)))
        );
        assert_eq!(
            parse_runnable("0\t-9223372036854775808\tq\twith\ttabs"),
            Some(("q\twith\ttabs", LookFrom::at(0, i64::MIN)))
        );
        assert_eq!(
            parse_runnable("-\t-\tdefault"),
            Some(("default", LookFrom::Start))
        );
        for bad in ["default", "0\t12", "x\t1\tq", "0\t1.5\tq", "40000\t1\tq"] {
            assert_eq!(parse_runnable(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn due_later_payloads_are_read_with_their_delays_first() {
        assert_eq!(
            parse_due_later("2000000\t2500000\t-5\t1795607926369988\tq\twith\ttabs"),
            Some((
                [2_000_000, 2_500_000],
                "q\twith\ttabs",
                LookFrom::at(-5, 1_795_607_926_369_988)
            ))
        );
        assert_eq!(
            parse_due_later("-3\t0\t0\t12\tmail"),
            Some(([-3, 0], "mail", LookFrom::at(0, 12)))
        );
        for bad in [
            "-\t-\tq",
            "1\t2\t-\t-\tq",
            "1\t2\t0\t12",
            "1.5\t2\t0\t12\tq",
            "x",
        ] {
            assert_eq!(parse_due_later(bad), None, "{bad:?}");
        }
    }
}
