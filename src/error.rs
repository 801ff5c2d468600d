//! Library error types.
//!
//! [`Error`] is what skiplock's own operations (enqueue, migrate, run a worker) return.
//! What a *job handler* returns is [`JobError`](crate::JobError): it decides the job's
//! fate rather than reporting a fault of the queue.

/// Everything that can go wrong in a skiplock operation.
///
/// Each message says what happened and, where there is one, what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database refused or could not run a statement (connection lost, constraint, …).
    #[error("database error: {}", describe_sqlx(.0))]
    Database(#[from] sqlx::Error),

    /// A job's arguments could not be turned into JSON.
    #[error("cannot encode the args of a `{kind}` job as JSON: {source}")]
    EncodeArgs {
        /// The job kind.
        kind: String,
        /// Why serde refused.
        source: serde_json::Error,
    },

    /// A job to enqueue breaks a rule checked before it reaches the database.
    #[error("invalid job: {0}")]
    InvalidJob(String),

    /// A cron schedule is malformed; the message says which part and where.
    #[error("{0}")]
    InvalidCron(String),

    /// A migration file failed to apply; nothing of it was kept. The message carries the
    /// server's detail and hint, which say what to fix (a migration that refuses the data
    /// it finds says how to mend it).
    #[error(
        "migration {version} ({name}) failed: {}; the schema is unchanged from version {previous}",
        describe_sqlx(source)
    )]
    Migration {
        /// Version of the failing migration.
        version: i32,
        /// File name of the failing migration.
        name: &'static str,
        /// Last version that was applied successfully.
        previous: i32,
        /// The database error.
        source: sqlx::Error,
    },

    /// The database holds a schema written by a newer skiplock.
    #[error(
        "the database schema is at version {found}, newer than this skiplock understands ({supported}); upgrade skiplock"
    )]
    SchemaTooNew {
        /// Version found in `skiplock.schema_migrations`.
        found: i32,
        /// Highest version this build knows.
        supported: i32,
    },

    /// The database schema is older than this skiplock needs.
    #[error(
        "the database schema is at version {found}, this skiplock needs version {expected}; run `skiplock migrate` (or `skiplock::migrate(&pool)`)"
    )]
    SchemaOutdated {
        /// Version found (0: skiplock was never migrated in this database).
        found: i32,
        /// Version this build needs.
        expected: i32,
    },

    /// The database's skiplock schema was made by a development build of 0.1.0 from before
    /// its schema was final: from before the migrations were folded into one (its ledger
    /// names `0001_jobs.sql`), or without a column 0001_initial.sql has since gained; it
    /// cannot be upgraded in place.
    #[error(
        "the database's skiplock schema (version {found}) was made by a development build of skiplock from before its schema was final, and cannot be upgraded; use a new database, or drop the schema (`DROP SCHEMA skiplock CASCADE`, which deletes its jobs) and run `skiplock migrate`"
    )]
    SchemaFromBeforeFold {
        /// Version found in `skiplock.schema_migrations` (of the old numbering).
        found: i32,
    },

    /// A write of a running job's claim holder found the claim gone: the job was reaped
    /// (its heartbeat went stale), cancelled or deleted, and may run elsewhere now.
    #[error(
        "the claim on job {id} is no longer held (reaped, cancelled or deleted); roll back the transaction"
    )]
    ClaimLost {
        /// The job.
        id: crate::JobId,
    },

    /// A worker, enqueue or queue setting is out of range or contradictory.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// [`wait_for`](crate::wait_for) found no job with this id: it was never enqueued (or
    /// its enqueue has not committed yet), or it was deleted or pruned.
    #[error(
        "job {id} does not exist: never enqueued, not committed yet, or deleted or pruned since"
    )]
    JobNotFound {
        /// The job.
        id: crate::JobId,
    },

    /// [`wait_for`](crate::wait_for) gave up: the job had not finished when its timeout
    /// ran out. The job itself is untouched; wait again, or look at it with
    /// [`job`](crate::job).
    #[error(
        "job {id} had not finished after {waited:?}{}; it is untouched, wait again or look at it",
        .state.map(|state| format!(" (it is {state})")).unwrap_or_default()
    )]
    WaitTimedOut {
        /// The job.
        id: crate::JobId,
        /// The timeout given.
        waited: std::time::Duration,
        /// Its state when the wait last looked; `None` when no look came back in time
        /// (its row locked by another transaction all along).
        state: Option<crate::JobState>,
    },
}

/// Shorthand for results of skiplock operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Whether retrying the same operation later may succeed: lost connections, pool
    /// timeouts, serialization failures, deadlocks, a read-only server and a server short
    /// of resources (SQLSTATE class 53).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Database(e) => is_transient_sqlx(e),
            _ => false,
        }
    }
}

/// Whether a failed statement met a job that another transaction moved between the live
/// and finished partitions of `skiplock.jobs` after the statement began (SQLSTATE 40001,
/// "tuple to be locked was already moved to another partition"): the ordinary race of two
/// writers of one job (a completion and a cancel, a reap and a completion). Transient, and
/// retried like any 40001; not worth a warning.
pub(crate) fn is_row_moved(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if db.code().as_deref() == Some("40001") && db.message().contains("moved to another partition"))
}

/// A database error as one line: Postgres's message, detail and hint, without the source
/// line of Postgres's own C code that sqlx's `Display` appends.
pub(crate) fn describe_sqlx(error: &sqlx::Error) -> String {
    let sqlx::Error::Database(db) = error else {
        return error.to_string();
    };
    let mut line = db.message().to_owned();
    if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        if let Some(detail) = pg.detail() {
            // One line: a deadlock's detail has a line per process.
            line.push_str("; ");
            line.push_str(&detail.replace('\n', " "));
        }
        if let Some(hint) = pg.hint() {
            line.push_str("; hint: ");
            line.push_str(hint);
        }
    }
    // Bounds the database's owner set: name the setting and what to do.
    match db.code().as_deref() {
        Some("57014") if db.message().contains("statement timeout") => line.push_str(
            "; the server's statement_timeout stopped it: raise it for the role that runs this \
             (ALTER ROLE … SET statement_timeout = …) or run it again when the database is \
             less busy",
        ),
        Some("55P03") if db.message().contains("lock timeout") => line.push_str(
            "; the server's lock_timeout stopped it while it waited for a lock other sessions \
             held: run it again, or raise lock_timeout for the role that runs this",
        ),
        _ => {}
    }
    line
}

/// Whether a database error is worth retrying: the runtime retries these instead of
/// failing jobs.
pub(crate) fn is_transient_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => {
            let code = db.code();
            let code = code.as_deref().unwrap_or("");
            matches!(
                code,
                // serialization_failure, deadlock_detected, admin/crash shutdown,
                // cannot_connect_now, lock_not_available, query_canceled,
                // read_only_sql_transaction (a standby, or a primary mid-failover).
                "40001" | "40P01" | "57P01" | "57P02" | "57P03" | "55P03" | "57014" | "25006"
            )
            // connection_exception, and insufficient_resources (disk full, out of memory,
            // too many connections): conditions of the server, not of the data.
            || code.starts_with("08")
                || code.starts_with("53")
                // invalid_sql_statement_name: a prepared statement the connection lost (a
                // pooler between us and the server, DISCARD ALL, transact-rs/sqlx#4305);
                // sending the statement again prepares it again.
                || code == "26000"
        }
        _ => false,
    }
}
