//! Queue statistics: the numbers `skiplock stats` shows, for programs.
//!
//! They come from the `skiplock.stats` view (one row per queue and kind), computed by the
//! database clock, and are summed here per queue, per kind and overall.
//!
//! # Examples
//!
//! ```no_run
//! # async fn example(pool: sqlx::PgPool) -> skiplock::Result<()> {
//! let stats = skiplock::stats::stats(&pool).await?;
//! for queue in stats.by_queue() {
//!     println!(
//!         "{}: {} runnable, lag {:.1}s, {:.1} jobs/s",
//!         queue.queue, queue.counts.runnable, queue.counts.lag_seconds, queue.counts.per_second
//!     );
//! }
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgExecutor;

use crate::db::admin::{StatsRow, stats_by_queue_kind};
use crate::error::Result;

/// The numbers of one queue, kind, or queue and kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Counts {
    /// Queued jobs that are due now.
    pub runnable: i64,
    /// Queued jobs due later, including retries waiting out their backoff.
    pub scheduled: i64,
    /// Jobs waiting for parent jobs to succeed.
    pub waiting: i64,
    /// Jobs claimed by a worker.
    pub running: i64,
    /// Jobs that succeeded within the last hour.
    pub succeeded_last_hour: i64,
    /// Jobs that went `dead` within the last hour.
    pub dead_last_hour: i64,
    /// Seconds since the oldest runnable job became due; 0 when none is due. Summed
    /// lines take the largest lag of their parts.
    pub lag_seconds: f64,
    /// Successes per second, averaged over the last minute.
    pub per_second: f64,
}

impl Counts {
    fn add(&mut self, other: &Counts) {
        self.runnable += other.runnable;
        self.scheduled += other.scheduled;
        self.waiting += other.waiting;
        self.running += other.running;
        self.succeeded_last_hour += other.succeeded_last_hour;
        self.dead_last_hour += other.dead_last_hour;
        self.lag_seconds = self.lag_seconds.max(other.lag_seconds);
        self.per_second += other.per_second;
    }
}

/// The numbers of one queue and kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct QueueKindStats {
    /// Queue name.
    pub queue: String,
    /// Job kind.
    pub kind: String,
    /// Whether the queue is paused.
    pub paused: bool,
    /// The numbers.
    #[serde(flatten)]
    pub counts: Counts,
}

/// The numbers of one queue, all kinds summed.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct QueueStats {
    /// Queue name.
    pub queue: String,
    /// Whether the queue is paused.
    pub paused: bool,
    /// The numbers.
    #[serde(flatten)]
    pub counts: Counts,
}

/// The numbers of one kind, all queues summed.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct KindStats {
    /// Job kind.
    pub kind: String,
    /// The numbers.
    #[serde(flatten)]
    pub counts: Counts,
}

/// A snapshot of every queue and kind with unfinished jobs or jobs finished in the last
/// hour.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Stats {
    /// The database's clock when the snapshot was taken.
    pub at: DateTime<Utc>,
    /// One line per queue and kind, by queue then kind.
    pub rows: Vec<QueueKindStats>,
}

impl Stats {
    /// One line per queue, by name.
    pub fn by_queue(&self) -> Vec<QueueStats> {
        let mut queues: BTreeMap<&str, QueueStats> = BTreeMap::new();
        for row in &self.rows {
            let line = queues
                .entry(row.queue.as_str())
                .or_insert_with(|| QueueStats {
                    queue: row.queue.clone(),
                    paused: row.paused,
                    counts: Counts::default(),
                });
            line.counts.add(&row.counts);
        }
        queues.into_values().collect()
    }

    /// One line per kind, by name.
    pub fn by_kind(&self) -> Vec<KindStats> {
        let mut kinds: BTreeMap<&str, KindStats> = BTreeMap::new();
        for row in &self.rows {
            kinds
                .entry(row.kind.as_str())
                .or_insert_with(|| KindStats {
                    kind: row.kind.clone(),
                    counts: Counts::default(),
                })
                .counts
                .add(&row.counts);
        }
        kinds.into_values().collect()
    }

    /// Everything summed.
    pub fn total(&self) -> Counts {
        let mut total = Counts::default();
        for row in &self.rows {
            total.add(&row.counts);
        }
        total
    }
}

/// Takes a [`Stats`] snapshot in one statement.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) if the query fails (for example on a
/// database skiplock never migrated: run `skiplock migrate`).
pub async fn stats<'e>(db: impl PgExecutor<'e>) -> Result<Stats> {
    let (at, rows) = stats_by_queue_kind(db).await?;
    Ok(Stats {
        at,
        rows: rows.into_iter().map(QueueKindStats::from).collect(),
    })
}

impl From<StatsRow> for QueueKindStats {
    fn from(row: StatsRow) -> Self {
        Self {
            queue: row.queue,
            kind: row.kind,
            paused: row.paused,
            counts: Counts {
                runnable: row.runnable,
                scheduled: row.scheduled,
                waiting: row.waiting,
                running: row.running,
                succeeded_last_hour: row.succeeded_last_hour,
                dead_last_hour: row.dead_last_hour,
                lag_seconds: row.lag_seconds,
                per_second: row.per_second,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(queue: &str, kind: &str, runnable: i64, lag_seconds: f64) -> QueueKindStats {
        QueueKindStats {
            queue: queue.into(),
            kind: kind.into(),
            paused: false,
            counts: Counts {
                runnable,
                lag_seconds,
                per_second: 1.0,
                ..Counts::default()
            },
        }
    }

    #[test]
    fn sums_counts_and_takes_the_largest_lag() {
        let stats = Stats {
            at: Utc::now(),
            rows: vec![
                row("a", "x", 1, 5.0),
                row("a", "y", 2, 1.0),
                row("b", "x", 4, 9.0),
            ],
        };
        let queues = stats.by_queue();
        assert_eq!(queues.len(), 2);
        assert_eq!(
            (queues[0].counts.runnable, queues[0].counts.lag_seconds),
            (3, 5.0)
        );
        assert_eq!(queues[0].counts.per_second, 2.0);
        let kinds = stats.by_kind();
        assert_eq!(kinds[0].kind, "x");
        assert_eq!(
            (kinds[0].counts.runnable, kinds[0].counts.lag_seconds),
            (5, 9.0)
        );
        assert_eq!(stats.total().runnable, 7);
    }
}
