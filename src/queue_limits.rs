//! Global limits of a queue, held by the claim in the database for every worker on every
//! host (the Rust worker, `skiplock work`, the SQL worker protocol): at most
//! `max_running` of the queue's jobs running at once, at most `starts` jobs starting
//! in any window of `per`, and, per concurrency key
//! ([`EnqueueOptions::concurrency_key`](crate::EnqueueOptions::concurrency_key)), at most
//! `key_max_running` of its jobs running at once and `key_rate` starts in any window. They
//! are columns of the queue's `skiplock.queues` row, so plain SQL sets them as well; a
//! change holds from the next claim. Jobs over a limit are not touched otherwise (no
//! attempt spent): those over a queue's limit stay queued; those of a key at a per-key
//! limit wait in `waiting` until the key has room again. A killed worker's claims count
//! until reaped. `key_claimable` is not a limit but fair queueing by key: at most that
//! many due jobs of one key are queued at once, and the keys take turns.
//! docs/guarantees.md says what each limit promises and under which faults.

use std::num::NonZeroU32;
use std::time::Duration;

use crate::db;
use crate::db::queues::LimitColumns;
use crate::error::{Error, Result};

/// The most starts a rate limit, the queue's or a key's, may count per period: the claim
/// keeps up to that many start times of each window (`skiplock.rate_window_starts`). For
/// more, use a shorter period.
pub const RATE_LIMIT_MAX_STARTS: u32 = 100_000;

/// A queue's global limits; [`QueueLimits::default`] is none.
///
/// ```
/// use std::time::Duration;
/// use skiplock::QueueLimits;
///
/// let exports = QueueLimits::default().max_running(5);
/// let mail = QueueLimits::default().rate(100, Duration::from_secs(1));
/// let reports = QueueLimits::default().key_max_running(2);
/// let tenants = QueueLimits::default().key_rate(10, Duration::from_secs(60));
/// let fair = QueueLimits::default().key_claimable(32);
/// # let _ = (exports, mail, reports, tenants, fair);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueLimits {
    /// At most this many of the queue's jobs running at once, across every worker.
    pub max_running: Option<NonZeroU32>,
    /// At most this many starts in any window of its period, across every worker.
    pub rate: Option<RateLimit>,
    /// At most this many jobs of one concurrency key running at once, across every worker.
    pub key_max_running: Option<NonZeroU32>,
    /// At most this many starts of one concurrency key in any window of its period, across
    /// every worker.
    pub key_rate: Option<RateLimit>,
    /// Fair queueing by concurrency key: at most this many due jobs of one key queued at
    /// once at each priority; the key's others wait their turn and are queued, behind
    /// what is queued then, as its queued ones are claimed. `None`: claim order alone.
    pub key_claimable: Option<NonZeroU32>,
}

/// At most `starts` jobs of a queue (or of one concurrency key of it) starting in any
/// window of `per`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Starts allowed per period: 1 to [`RATE_LIMIT_MAX_STARTS`].
    pub starts: NonZeroU32,
    /// The window, in microseconds at the finest; longer than zero.
    pub per: Duration,
}

impl QueueLimits {
    /// These limits with at most `n` jobs running at once (0: no such limit).
    #[must_use]
    pub fn max_running(mut self, n: u32) -> Self {
        self.max_running = NonZeroU32::new(n);
        self
    }

    /// These limits with at most `n` jobs of one concurrency key running at once (0: no
    /// such limit). Jobs without a key are not limited by it.
    #[must_use]
    pub fn key_max_running(mut self, n: u32) -> Self {
        self.key_max_running = NonZeroU32::new(n);
        self
    }

    /// These limits with fair queueing by concurrency key (0: none): at most `n` due jobs
    /// of one key queued (claimable) at once at each priority, the rest waiting their turn
    /// (`held_for = 'fair'`), so one key's backlog delays another key's next job by at most
    /// `n` of its jobs. About a claim's batch (a worker's `prefetch`) keeps a lone key's
    /// drain as fast as without; jobs without a key are taken in claim order as before.
    #[must_use]
    pub fn key_claimable(mut self, n: u32) -> Self {
        self.key_claimable = NonZeroU32::new(n);
        self
    }

    /// These limits with at most `starts` starts in any window of `per` (0 starts: no
    /// such limit).
    #[must_use]
    pub fn rate(mut self, starts: u32, per: Duration) -> Self {
        self.rate = NonZeroU32::new(starts).map(|starts| RateLimit { starts, per });
        self
    }

    /// These limits with at most `starts` starts of one concurrency key in any window of
    /// `per` (0 starts: no such limit). Jobs without a key are not limited by it.
    #[must_use]
    pub fn key_rate(mut self, starts: u32, per: Duration) -> Self {
        self.key_rate = NonZeroU32::new(starts).map(|starts| RateLimit { starts, per });
        self
    }

    /// The columns as `skiplock.queues` holds them, or why they cannot be.
    fn columns(&self) -> Result<LimitColumns> {
        let column = |name: &str, n: Option<NonZeroU32>| {
            n.map(|n| {
                i32::try_from(n.get()).map_err(|_| {
                    Error::Config(format!("{name} {n} is too large; at most {}", i32::MAX))
                })
            })
            .transpose()
        };
        let max_running = column("max_running", self.max_running)?;
        let key_max_running = column("key_max_running", self.key_max_running)?;
        let key_claimable = column("key_claimable", self.key_claimable)?;
        let rate = |what: &str, max: u32, limit: Option<RateLimit>| {
            limit
                .map(|RateLimit { starts, per }| {
                    if starts.get() > max {
                        return Err(Error::Config(format!(
                            "{what} of {starts} starts per period is more than {max}; \
                             use a shorter period"
                        )));
                    }
                    let period_us = i64::try_from(per.as_micros())
                        .ok()
                        .filter(|&us| us > 0)
                        .ok_or_else(|| {
                            Error::Config(format!(
                                "{what}'s period must be from 1 µs to about 292,000 years, \
                                 not {per:?}"
                            ))
                        })?;
                    // At most RATE_LIMIT_MAX_STARTS, so within i32.
                    Ok((starts.get() as i32, period_us))
                })
                .transpose()
        };
        let queue_rate = rate("a rate limit", RATE_LIMIT_MAX_STARTS, self.rate)?;
        let key_rate = rate("a per-key rate limit", RATE_LIMIT_MAX_STARTS, self.key_rate)?;
        Ok(LimitColumns {
            max_running,
            rate_limit: queue_rate.map(|(starts, _)| starts),
            rate_period_us: queue_rate.map(|(_, period_us)| period_us),
            key_max_running,
            key_rate_limit: key_rate.map(|(starts, _)| starts),
            key_rate_period_us: key_rate.map(|(_, period_us)| period_us),
            key_claimable,
        })
    }
}

/// A rate limit as the columns of `skiplock.queues` hold it: starts and the period in
/// microseconds, both or neither.
fn rate_from_columns(starts: Option<i32>, period_us: Option<i64>) -> Option<RateLimit> {
    let (starts, period_us) = starts.zip(period_us)?;
    Some(RateLimit {
        starts: NonZeroU32::new(u32::try_from(starts).ok()?)?,
        per: Duration::from_micros(u64::try_from(period_us).ok()?),
    })
}

/// Sets a queue's global limits, replacing those it had (a queue with no jobs yet may be
/// given limits; they hold for the jobs that come). Same as
/// `SELECT skiplock.set_queue_limits(queue, max_running, rate_limit, rate_period,
/// key_max_running, key_rate_limit, key_rate_period, key_claimable)`.
///
/// # Errors
///
/// [`Error::Config`] for a rate, the queue's or a key's, over [`RATE_LIMIT_MAX_STARTS`]
/// starts, or a period of zero;
/// [`Error::Database`] if the statement fails.
///
/// # Examples
///
/// ```no_run
/// use skiplock::QueueLimits;
/// # async fn example(pool: sqlx::PgPool) -> Result<(), skiplock::Error> {
/// skiplock::set_queue_limits(&pool, "exports", QueueLimits::default().max_running(5)).await?;
/// # Ok(()) }
/// ```
pub async fn set_queue_limits<'e>(
    db: impl sqlx::PgExecutor<'e>,
    queue: &str,
    limits: QueueLimits,
) -> Result<()> {
    let columns = limits.columns()?;
    Ok(db::queues::queues_set_limits(db, queue, &columns).await?)
}

/// A queue with a global limit, as `skiplock.queue_limits` shows it now.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueLimitStatus {
    /// The queue.
    pub queue: String,
    /// Whether it is paused.
    pub paused: bool,
    /// Its limits.
    pub limits: QueueLimits,
    /// Its jobs running now, a killed worker's included until they are reaped.
    pub running: u64,
    /// Starts within the rate limit's last period.
    pub started_in_period: u64,
    /// Its runnable jobs (queued and due).
    pub runnable: u64,
    /// The limit that keeps runnable jobs from starting now, if one does.
    pub holding_back: Option<LimitKind>,
    /// The runnable jobs that limit holds back now (0 when none does).
    pub held_back: u64,
    /// Concurrency keys with `key_max_running` jobs running now (0 without the limit).
    pub keys_at_limit: u64,
    /// Concurrency keys whose rate window is full now (0 without a per-key rate limit).
    pub keys_rate_limited: u64,
    /// Jobs waiting until their concurrency key has room again, or (with `key_claimable`)
    /// for their key's turn (0 without a per-key limit or `key_claimable`).
    pub held_by_key: u64,
}

/// Which global limit holds a queue's jobs back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LimitKind {
    /// `max_running` jobs run already.
    MaxRunning,
    /// `rate_limit` jobs started within the last `rate_period`.
    Rate,
}

/// Every queue with a global limit, by name, with its use now.
///
/// # Errors
///
/// [`Error::Database`] if the query fails.
pub async fn queue_limits<'e>(db: impl sqlx::PgExecutor<'e>) -> Result<Vec<QueueLimitStatus>> {
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    Ok(db::queues::queues_limits(db)
        .await?
        .into_iter()
        .map(|row| QueueLimitStatus {
            limits: QueueLimits {
                max_running: row
                    .max_running
                    .and_then(|n| NonZeroU32::new(u32::try_from(n).unwrap_or(0))),
                rate: rate_from_columns(row.rate_limit, row.rate_period_us),
                key_max_running: row
                    .key_max_running
                    .and_then(|n| NonZeroU32::new(u32::try_from(n).unwrap_or(0))),
                key_rate: rate_from_columns(row.key_rate_limit, row.key_rate_period_us),
                key_claimable: row
                    .key_claimable
                    .and_then(|n| NonZeroU32::new(u32::try_from(n).unwrap_or(0))),
            },
            queue: row.queue,
            paused: row.paused,
            running: count(row.running),
            started_in_period: count(row.started_in_period),
            runnable: count(row.runnable),
            held_back: count(row.held_back),
            keys_at_limit: count(row.keys_at_limit.unwrap_or(0)),
            keys_rate_limited: count(row.keys_rate_limited.unwrap_or(0)),
            held_by_key: count(row.held_by_key.unwrap_or(0)),
            holding_back: match row.holding_back.as_deref() {
                Some("max_running") => Some(LimitKind::MaxRunning),
                Some("rate_limit") => Some(LimitKind::Rate),
                _ => None,
            },
        })
        .collect())
}
