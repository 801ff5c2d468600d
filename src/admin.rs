//! The operator's other reads: a job's state and dependencies, counts by state, and the
//! per-hour and per-day history that survives pruning (what `skiplock show`, `stats` and
//! the dashboard read), for tools of your own. None of them can take or settle a claim:
//! what only a worker may do (claim, heartbeat, complete, reap) is not public. Fetching,
//! listing, retrying and cancelling jobs and pausing queues are at the crate root
//! ([`job`](crate::job()), [`jobs`](crate::jobs), [`retry`](crate::retry),
//! [`cancel`](crate::cancel), [`pause_queue`](crate::pause_queue), …) and in the schema as
//! SQL functions.

pub use crate::db::admin::{job_dependencies_of, jobs_get_state};
pub use crate::db::history::{
    Granularity, HistoryFilter, HistoryRow, HistoryTotals, job_history_list, job_history_totals,
};
pub use crate::db::jobs::jobs_count_by_state;

// What only the binary needs (the dashboard's pages, `skiplock show --json`, `skiplock
// prune`): compiled with the `cli` feature alone, and not part of the library's API.
#[cfg(feature = "cli")]
#[doc(hidden)]
pub use crate::db::{
    admin::jobs_get_json,
    dashboard::{
        Cursor, EndedCounts, JobsPageFilter, TEXT_SEARCH_SCAN, Throughput, WorkerRow,
        dashboard_ended_counts, dashboard_jobs_page, dashboard_lane, dashboard_throughput,
        dashboard_workers,
    },
    history::{
        HISTORY_RETENTION_DEFAULT, job_history_run_bounds, jobs_delete_rolled_up,
        jobs_prune_finished_rolled_up,
    },
};

/// The statements of `skiplock demo` (feature `cli`): the plain-SQL enqueue it shows, and
/// the demo's own database, which it drops only when the demo created it.
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod demo {
    pub use crate::db::demo::{
        DEMO_DATABASE, DEMO_MARK, ENQUEUE_BY_SQL_FUNCTION, database_tables_outside_skiplock,
        demo_database_comment, demo_database_create, demo_database_drop,
        jobs_enqueue_by_sql_function,
    };
}
