//! How long the background loops of a worker (producer, listener, completer) and of
//! maintenance wait: jittered intervals, and the delay before retrying a failed database
//! call.

use std::time::Duration;

/// Sleeps for `base` scaled by a random factor in [0.8, 1.2), so that many workers started
/// together do not poll in lockstep.
pub(crate) async fn sleep_jittered(base: Duration) {
    tokio::time::sleep(base.mul_f64(0.8 + fastrand::f64() * 0.4)).await;
}

/// Delay before retrying a failed database call for the `failures`-th time in a row:
/// 100 ms doubling up to 1 s.
///
/// The cap is what a restart of the server costs the queue after it is back: with 5 s,
/// the retries of a 1–2 s restart had reached 1.6 s and 3.2 s steps, and the first job
/// succeeded 4.88 s after the restart began (issue 38; 0.6–0.95 s before that cap). A
/// retry against a server that is down is one failed connection attempt: once a second
/// per task costs it nothing.
pub(crate) fn db_retry_delay(failures: u32) -> Duration {
    Duration::from_millis(100u64.saturating_mul(1 << failures.min(6)).min(1_000))
}
