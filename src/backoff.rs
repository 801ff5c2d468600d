//! The default retry backoff, and its parts for a [`Job::retry_delay`](crate::Job::retry_delay)
//! of your own.
//!
//! The default delay before retrying after failed attempt `n` (1-based) is
//!
//! ```text
//! delay(n) = min(2^n, 3600) seconds × U[0.75, 1.25)
//! ```
//!
//! so 2 s, 4 s, 8 s, … capped at one hour, each spread by ±25 % so that jobs failing
//! together do not retry together. With the default 25 attempts a job keeps retrying for
//! roughly 14 hours before it goes `dead`. The reaper uses the same formula in SQL
//! (`skiplock.backoff(attempt)`). A job kind overrides it with
//! [`Job::retry_delay`](crate::Job::retry_delay); a handler can ask for an exact delay with
//! [`JobError::retry_after`](crate::JobError::retry_after).
//!
//! # Examples
//!
//! A job that retries sooner than the default, with the same jitter:
//!
//! ```
//! use std::time::Duration;
//! use skiplock::{Job, JobContext, JobError, backoff};
//! # #[derive(serde::Serialize, serde::Deserialize)] struct Ping;
//! impl Job for Ping {
//!     const KIND: &'static str = "ping";
//!     async fn run(self, _ctx: JobContext) -> Result<(), JobError> { Ok(()) }
//!
//!     /// A tenth of the default delay: 0.2 s, 0.4 s, 0.8 s, … up to 6 minutes.
//!     fn retry_delay(attempt: i32) -> Duration {
//!         backoff::default_delay(attempt) / 10
//!     }
//! }
//! assert_eq!(backoff::base_delay(3), Duration::from_secs(8));
//! ```

use std::time::Duration;

/// Upper bound of the default backoff before jitter, in seconds (one hour).
pub const CAP_SECS: u64 = 3600;

/// Relative jitter of the default backoff: the delay is scaled by a factor drawn from
/// `[1 - JITTER, 1 + JITTER)`.
pub const JITTER: f64 = 0.25;

/// The un-jittered default delay after failed attempt `attempt` (1-based).
pub fn base_delay(attempt: i32) -> Duration {
    let exponent = attempt.clamp(0, 30) as u32;
    Duration::from_secs((1u64 << exponent).min(CAP_SECS))
}

/// The default delay after failed attempt `attempt`: [`base_delay`] with jitter.
pub fn default_delay(attempt: i32) -> Duration {
    jitter(base_delay(attempt), fastrand::f64())
}

/// Scales `base` by `1 - JITTER + 2 × JITTER × unit`, where `unit` is in `[0, 1)`.
fn jitter(base: Duration, unit: f64) -> Duration {
    base.mul_f64(1.0 - JITTER + 2.0 * JITTER * unit.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_doubles_then_caps() {
        assert_eq!(base_delay(1), Duration::from_secs(2));
        assert_eq!(base_delay(2), Duration::from_secs(4));
        assert_eq!(base_delay(10), Duration::from_secs(1024));
        assert_eq!(base_delay(12), Duration::from_secs(CAP_SECS));
        assert_eq!(base_delay(1_000), Duration::from_secs(CAP_SECS));
        assert_eq!(base_delay(-3), Duration::from_secs(1));
    }

    #[test]
    fn jitter_stays_within_bounds() {
        let base = Duration::from_secs(100);
        assert_eq!(jitter(base, 0.0), Duration::from_secs(75));
        assert_eq!(jitter(base, 0.5), Duration::from_secs(100));
        assert!(jitter(base, 0.999_999) < Duration::from_secs(125));
        for attempt in 1..30 {
            let delay = default_delay(attempt);
            let base = base_delay(attempt);
            assert!(delay >= base.mul_f64(0.75) && delay < base.mul_f64(1.25));
        }
    }

    #[test]
    fn delays_grow_until_the_cap() {
        let lows: Vec<_> = (1..=11).map(|n| base_delay(n).mul_f64(0.75)).collect();
        let highs: Vec<_> = (1..=11).map(|n| base_delay(n).mul_f64(1.25)).collect();
        // Even the unluckiest jitter keeps the next delay above the previous one's floor.
        for n in 1..lows.len() {
            assert!(lows[n] > lows[n - 1]);
            assert!(highs[n] > highs[n - 1]);
        }
    }
}
