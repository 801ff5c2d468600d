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
/// 100 ms doubling up to 5 s.
pub(crate) fn db_retry_delay(failures: u32) -> Duration {
    Duration::from_millis(100u64.saturating_mul(1 << failures.min(6)).min(5_000))
}
