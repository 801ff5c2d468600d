//! The worker's metrics, recorded through the [`metrics`](https://docs.rs/metrics) facade:
//! nothing is exported unless the application installs a recorder (`skiplock work
//! --metrics-addr` installs a Prometheus one). These are the series' names;
//! docs/metrics.md lists them with their type, labels and unit.

pub use crate::metrics::{
    CLAIM_BATCH, CLAIM_DURATION, CLAIM_ERRORS, CLAIMS_BUFFERED, HEARTBEAT_ERRORS, JOB_DURATION,
    JOBS, JOBS_REAPED, JOBS_RUNNING, MAINTENANCE_ERRORS,
};
