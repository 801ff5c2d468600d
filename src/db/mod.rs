//! Every SQL statement skiplock runs, one function per statement, named table first and
//! verb second. Nothing outside this module builds SQL, and every value is bound, never
//! formatted into the statement text.
//!
//! Functions take `impl PgExecutor` so they run on a pool, a connection or inside the
//! caller's transaction alike.

pub mod admin;
pub mod cron;
#[cfg(any(feature = "cli", feature = "internals"))]
pub mod dashboard;
#[cfg(feature = "cli")]
pub mod demo;
pub mod enqueue;
pub mod history;
pub mod jobs;
pub mod maintenance;
pub mod migrations;
pub mod queues;
#[cfg(feature = "testbed")]
pub mod testbed;
pub mod timestamp;
