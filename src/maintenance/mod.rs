//! Maintenance services every worker runs alongside its jobs. They use `SKIP LOCKED` and
//! the database clock, so any number of workers can run them at once without a leader.

pub(crate) mod cron;
pub(crate) mod dependencies;
pub(crate) mod pruner;
pub(crate) mod reaper;
