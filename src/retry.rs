//! Retry backoff.
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

use std::time::Duration;

/// Upper bound of the default backoff before jitter, in seconds (one hour).
pub const BACKOFF_CAP_SECS: u64 = 3600;

/// Relative jitter of the default backoff: the delay is scaled by a factor drawn from
/// `[1 - JITTER, 1 + JITTER)`.
pub const BACKOFF_JITTER: f64 = 0.25;

/// The un-jittered default delay after failed attempt `attempt` (1-based).
pub fn backoff_base(attempt: i32) -> Duration {
    let exponent = attempt.clamp(0, 30) as u32;
    Duration::from_secs((1u64 << exponent).min(BACKOFF_CAP_SECS))
}

/// The default delay after failed attempt `attempt`: [`backoff_base`] with jitter.
pub fn backoff_default(attempt: i32) -> Duration {
    jitter(backoff_base(attempt), fastrand::f64())
}

/// Scales `base` by `1 - JITTER + 2 × JITTER × unit`, where `unit` is in `[0, 1)`.
fn jitter(base: Duration, unit: f64) -> Duration {
    base.mul_f64(1.0 - BACKOFF_JITTER + 2.0 * BACKOFF_JITTER * unit.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_doubles_then_caps() {
        assert_eq!(backoff_base(1), Duration::from_secs(2));
        assert_eq!(backoff_base(2), Duration::from_secs(4));
        assert_eq!(backoff_base(10), Duration::from_secs(1024));
        assert_eq!(backoff_base(12), Duration::from_secs(BACKOFF_CAP_SECS));
        assert_eq!(backoff_base(1_000), Duration::from_secs(BACKOFF_CAP_SECS));
        assert_eq!(backoff_base(-3), Duration::from_secs(1));
    }

    #[test]
    fn jitter_stays_within_bounds() {
        let base = Duration::from_secs(100);
        assert_eq!(jitter(base, 0.0), Duration::from_secs(75));
        assert_eq!(jitter(base, 0.5), Duration::from_secs(100));
        assert!(jitter(base, 0.999_999) < Duration::from_secs(125));
        for attempt in 1..30 {
            let delay = backoff_default(attempt);
            let base = backoff_base(attempt);
            assert!(delay >= base.mul_f64(0.75) && delay < base.mul_f64(1.25));
        }
    }

    #[test]
    fn delays_grow_until_the_cap() {
        let lows: Vec<_> = (1..=11).map(|n| backoff_base(n).mul_f64(0.75)).collect();
        let highs: Vec<_> = (1..=11).map(|n| backoff_base(n).mul_f64(1.25)).collect();
        // Even the unluckiest jitter keeps the next delay above the previous one's floor.
        for n in 1..lows.len() {
            assert!(lows[n] > lows[n - 1]);
            assert!(highs[n] > highs[n - 1]);
        }
    }
}
