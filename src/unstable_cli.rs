//! What the `skiplock` binary needs beyond the library's API: the pool every command runs
//! on, the dashboard's pages, `skiplock show --json`, `skiplock prune`'s statements and
//! `skiplock demo`'s database. Compiled with the `cli` feature alone and **not part of the
//! API**: any release may change or remove these names. The library's API is what
//! docs/public-api.txt lists.

pub use crate::db::admin::jobs_get_json;
pub use crate::db::dashboard::{
    Cursor, EndedCounts, JobsPageFilter, TEXT_SEARCH_SCAN, Throughput, WorkerRow,
    dashboard_ended_counts, dashboard_jobs_page, dashboard_lane, dashboard_throughput,
    dashboard_workers,
};
pub use crate::db::history::{
    HISTORY_RETENTION_DEFAULT, job_history_run_bounds, jobs_delete_rolled_up,
    jobs_prune_finished_rolled_up,
};
// The pool the runtime runs its statements on, direct or through PgBouncer's transaction
// pooling: an application gives `Worker::builder` a `PgPool` and says `.pgbouncer(true)`,
// and runs its own calls through `PgBouncer`.
pub use crate::pool::DbPool;

/// The statements of `skiplock demo`: the plain-SQL enqueue it shows, and the demo's own
/// database, which it drops only when the demo created it.
pub mod demo {
    pub use crate::db::demo::{
        DEMO_DATABASE, DEMO_MARK, ENQUEUE_BY_SQL_FUNCTION, database_tables_outside_skiplock,
        demo_database_comment, demo_database_create, demo_database_drop,
        jobs_enqueue_by_sql_function,
    };
}
