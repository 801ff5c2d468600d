//! Triggers a test puts on `skiplock.jobs` to record what changed its jobs (the audits of
//! the fault, failover and SQL-worker tests): created in one place, so that each is made
//! right for the partitioned table.

use sqlx::PgPool;

/// The statements a trigger on `skiplock.jobs` fires after, and the transition tables its
/// function reads.
#[derive(Clone, Copy, Debug)]
pub enum JobWrites {
    /// `INSERT`: the new rows as `new_rows`.
    Insert,
    /// `UPDATE`: the rows before as `old_rows`, after as `new_rows`.
    Update,
    /// `DELETE`: the rows deleted as `old_rows`.
    Delete,
    /// `INSERT OR UPDATE OR DELETE`, with no transition tables (Postgres gives them to a
    /// trigger of one event only).
    Any,
}

impl JobWrites {
    /// The trigger's event and its `REFERENCING` clause.
    fn clause(self) -> &'static str {
        match self {
            Self::Insert => "INSERT ON {table} REFERENCING NEW TABLE AS new_rows",
            Self::Update => {
                "UPDATE ON {table} REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows"
            }
            Self::Delete => "DELETE ON {table} REFERENCING OLD TABLE AS old_rows",
            Self::Any => "INSERT OR UPDATE OR DELETE ON {table}",
        }
    }
}

/// Creates trigger `name`, which runs `function` (a `RETURNS trigger` function, by its
/// qualified name) once after each statement that `writes` jobs: on `skiplock.jobs`
/// and on its live partition `skiplock.jobs_live`. A statement trigger fires for the
/// table a statement names: a test's statements name `skiplock.jobs`, skiplock's own
/// name the live partition. A row trigger for UPDATE would miss a job moved between the partitions, which Postgres
/// runs as a delete and an insert, while the statement's transition tables hold it.
/// Panics naming the trigger when it cannot be created.
pub async fn after_job_statements(pool: &PgPool, name: &str, writes: JobWrites, function: &str) {
    for table in ["skiplock.jobs", "skiplock.jobs_live"] {
        let on = writes.clause().replace("{table}", table);
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TRIGGER {name} AFTER {on}
                 FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
        )))
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("create trigger {name} on {table}: {e}"));
    }
}
