//! Shared tools of the fault-injection tests (`tests/faults_*.rs`): the audit trigger that
//! records every change of `skiplock.jobs`, the invariants checked on it, testbed worker
//! processes (`src/bin/skiplock-testbed.rs`) with signals, and a private Postgres server
//! that a test may restart.
#![allow(dead_code)]

#[cfg(feature = "embedded")]
mod server;
#[cfg(feature = "embedded")]
#[allow(unused_imports)]
pub use server::*;
mod reply_cutter;
#[allow(unused_imports)]
pub use reply_cutter::*;
#[cfg(feature = "testbed")]
mod testbed;
#[cfg(feature = "testbed")]
#[allow(unused_imports)]
pub use testbed::*;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use crate::common::job_triggers::{JobWrites, after_job_statements};

/// Generous limit for anything a test waits on: the machine is small and shared.
pub const PATIENCE: Duration = Duration::from_secs(90);

/// Begins a transaction on `pool` holding `LOCK TABLE skiplock.jobs IN ACCESS EXCLUSIVE
/// MODE` (the fault of a table locked by hand): the caller keeps it as long as the fault
/// lasts, then commits.
///
/// The lock is asked with NOWAIT, again until it is granted. It takes skiplock.jobs, then
/// each of its tables, while skiplock's statements write jobs_live directly, and Postgres,
/// checking a written row against the partition's bounds, reads them through the parent
/// and takes its lock then (once per session, after the partition's): a lock that waited
/// for jobs_live behind such a statement would close a cycle with it, and Postgres would
/// abort one side, the worker's statement or this one (seen in CI: a heartbeat chosen). A
/// lock that never waits is never part of a cycle, so a deadlock in a worker's log is
/// then the worker's own. Panics when it is not granted within [`PATIENCE`].
pub async fn lock_jobs_table(pool: &PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let asked_at = std::time::Instant::now();
    loop {
        let mut locker = pool.begin().await.unwrap();
        match sqlx::query("LOCK TABLE skiplock.jobs IN ACCESS EXCLUSIVE MODE NOWAIT")
            .execute(&mut *locker)
            .await
        {
            Ok(_) => return locker,
            Err(sqlx::Error::Database(e))
                if e.code().as_deref() == Some("55P03") && asked_at.elapsed() < PATIENCE =>
            {
                locker.rollback().await.unwrap();
                // The pace of the asking, not a synchronization: the workers' statements
                // end on their own within milliseconds.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Err(e) => panic!("LOCK TABLE skiplock.jobs NOWAIT: {e}"),
        }
    }
}

/// Seconds a long soak runs, from `SKIPLOCK_SOAK_SECS`; `None` for the fast default.
pub fn soak_secs() -> Option<u64> {
    std::env::var("SKIPLOCK_SOAK_SECS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&s| s > 0)
}

// ---------------------------------------------------------------------------------------
// Audit trigger

/// Creates `public.job_audit` and triggers that record every insert, update and delete
/// of `skiplock.jobs` in it ([`after_job_statements`]): the state, attempt and claim token
/// before and after, the holder, whether the change was only a heartbeat, and
/// `application_name` of the writing connection (testbed workers set it to their worker
/// id).
pub async fn install_audit(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE TABLE public.job_audit (
             seq          bigserial PRIMARY KEY,
             job_id       bigint      NOT NULL,
             op           text        NOT NULL,
             old_state    skiplock.job_state,
             new_state    skiplock.job_state,
             old_attempt  int,
             new_attempt  int,
             max_attempts int,
             old_token    uuid,
             new_token    uuid,
             old_holder   text,
             new_holder   text,
             heartbeat    boolean     NOT NULL,
             failure      boolean     NOT NULL DEFAULT false,
             last_error   text,
             app          text        NOT NULL DEFAULT current_setting('application_name'),
             claimed_at   timestamptz,
             txid         bigint      NOT NULL DEFAULT txid_current(),
             at           timestamptz NOT NULL DEFAULT clock_timestamp()
         );",
    )
    .execute(pool)
    .await
    .expect("create the audit table");
    sqlx::raw_sql(sqlx::AssertSqlSafe(audit_function_sql(&[])))
        .execute(pool)
        .await
        .expect("create the audit's function");
    for (name, writes) in [
        ("jobs_audit_insert", JobWrites::Insert),
        ("jobs_audit_update", JobWrites::Update),
        ("jobs_audit_delete", JobWrites::Delete),
    ] {
        after_job_statements(pool, name, writes, "public.job_audit_record").await;
    }
}

/// The function behind the audit's triggers (`public.job_audit_record()`, created or
/// replaced): one row per job an insert, update or delete statement touched. `extra` names
/// columns of `skiplock.jobs` it copies too, each into the column of `public.job_audit`
/// by that name (the model's audit adds its own: `model_support::extend_audit`).
pub fn audit_function_sql(extra: &[&str]) -> String {
    let names: String = extra.iter().map(|column| format!(", {column}")).collect();
    let of = |row: &str| -> String {
        extra
            .iter()
            .map(|column| format!(", {row}.{column}"))
            .collect()
    };
    let (new, old) = (of("n"), of("o"));
    format!(
        "CREATE OR REPLACE FUNCTION public.job_audit_record() RETURNS trigger
         LANGUAGE plpgsql AS $$
         BEGIN
             IF TG_OP = 'INSERT' THEN
                 INSERT INTO public.job_audit (job_id, op, new_state, new_attempt, max_attempts,
                                               new_token, new_holder, heartbeat, claimed_at,
                                               last_error{names})
                 SELECT n.id, 'insert', n.state, n.attempt, n.max_attempts,
                        n.claim_token, n.claimed_by, false, n.claimed_at, n.last_error{new}
                 FROM new_rows n ORDER BY n.id;
             ELSIF TG_OP = 'UPDATE' THEN
                 INSERT INTO public.job_audit (job_id, op, old_state, new_state, old_attempt,
                                               new_attempt, max_attempts, old_token, new_token,
                                               old_holder, new_holder, heartbeat, failure,
                                               last_error, claimed_at{names})
                 SELECT n.id, 'update', o.state, n.state, o.attempt, n.attempt,
                        n.max_attempts, o.claim_token, n.claim_token, o.claimed_by,
                        n.claimed_by,
                        o.state = n.state
                            AND o.claim_token IS NOT DISTINCT FROM n.claim_token
                            AND o.heartbeat_at IS DISTINCT FROM n.heartbeat_at,
                        o.errors IS DISTINCT FROM n.errors,
                        n.last_error, n.claimed_at{new}
                 FROM old_rows o JOIN new_rows n ON n.id = o.id ORDER BY n.id;
             ELSE
                 INSERT INTO public.job_audit (job_id, op, old_state, old_attempt, old_token,
                                               old_holder, heartbeat, last_error{names})
                 SELECT o.id, 'delete', o.state, o.attempt, o.claim_token, o.claimed_by, false,
                        o.last_error{old}
                 FROM old_rows o ORDER BY o.id;
             END IF;
             RETURN NULL;
         END;
         $$;"
    )
}

/// One row of `public.job_audit`.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct AuditRow {
    pub seq: i64,
    pub job_id: i64,
    pub op: String,
    pub old_state: Option<String>,
    pub new_state: Option<String>,
    pub old_attempt: Option<i32>,
    pub new_attempt: Option<i32>,
    pub max_attempts: Option<i32>,
    pub old_token: Option<Uuid>,
    pub new_token: Option<Uuid>,
    pub old_holder: Option<String>,
    pub new_holder: Option<String>,
    pub heartbeat: bool,
    /// The change recorded a failure (appended to `errors`); `last_error` is its message.
    pub failure: bool,
    pub last_error: Option<String>,
    pub app: String,
    pub claimed_at: Option<chrono::DateTime<chrono::Utc>>,
    /// The writing transaction (`txid_current()`).
    pub txid: i64,
    pub at: chrono::DateTime<chrono::Utc>,
}

impl AsRef<AuditRow> for AuditRow {
    fn as_ref(&self) -> &AuditRow {
        self
    }
}

/// The rows of `log` (in `seq` order) by transaction, each transaction where it committed
/// as far as the log can tell: at its last row. A transaction commits after every row it
/// wrote, and one that waited for its rows wrote after that. What others see of a
/// transaction is its result, never its rows one by one: a worker's completion that hands
/// its key's next job on ends one job and starts the next in one transaction, and the rows
/// say start first (the handoff's statement fires its triggers before the completion's).
/// So a count of what runs at once is taken between transactions, not between rows.
pub fn transactions<T: AsRef<AuditRow>>(log: &[T]) -> Vec<Vec<&T>> {
    let mut last: HashMap<i64, usize> = HashMap::new();
    for (i, row) in log.iter().enumerate() {
        last.insert(row.as_ref().txid, i);
    }
    let mut groups: std::collections::BTreeMap<usize, Vec<&T>> = std::collections::BTreeMap::new();
    for row in log {
        groups
            .entry(last[&row.as_ref().txid])
            .or_default()
            .push(row);
    }
    groups.into_values().collect()
}

impl AuditRow {
    /// A claim: queued to running.
    pub fn is_claim(&self) -> bool {
        self.old_state.as_deref() == Some("queued") && self.new_state.as_deref() == Some("running")
    }

    /// A claim of any kind: queued or waiting (a held job a completion handed on, or a fair
    /// key's held job taken in its turn) to running.
    pub fn is_start(&self) -> bool {
        matches!(self.old_state.as_deref(), Some("queued" | "waiting"))
            && self.new_state.as_deref() == Some("running")
    }

    /// The reaper took the claim back.
    pub fn is_reap(&self) -> bool {
        self.old_state.as_deref() == Some("running")
            && self.new_state.as_deref() != Some("running")
            && self.failure
            && self
                .last_error
                .as_deref()
                .is_some_and(|e| e.starts_with("no heartbeat from "))
    }

    /// A graceful release: running to queued with the attempt given back.
    pub fn is_release(&self) -> bool {
        self.old_state.as_deref() == Some("running")
            && self.new_state.as_deref() == Some("queued")
            && self.new_attempt == self.old_attempt.map(|a| a - 1)
    }
}

/// Every audit row, in commit-independent insertion order (`seq`).
pub async fn audit(pool: &PgPool) -> Vec<AuditRow> {
    sqlx::query_as(
        "SELECT seq, job_id, op, old_state::text, new_state::text, old_attempt, new_attempt,
                max_attempts, old_token, new_token, old_holder, new_holder, heartbeat,
                failure, last_error, app, claimed_at, txid, at
         FROM public.job_audit ORDER BY seq",
    )
    .fetch_all(pool)
    .await
    .expect("read the audit log")
}

/// Checks the claim discipline over the whole audit log, job by job:
///
/// - a claim (queued to running) adds exactly one attempt, never beyond `max_attempts`,
///   and brings a claim token never seen before on that job;
/// - a running job changes only by a heartbeat (state and token kept) or by leaving
///   `running`, and every such change finds on the row the token of the job's latest claim
///   in the log (no write replaced the token outside a claim);
/// - a change to a running job written by a testbed worker (its `application_name`)
///   comes from the worker named as holder, unless it is the reaper taking a stale claim
///   back;
/// - a finished job (succeeded, dead, cancelled) never changes again (`allow_reopen`
///   permits operator retries).
///
/// What the log cannot show: the token a write *presented*. A write fenced out by its
/// token changes nothing and leaves no row, and a trigger cannot read a statement's bound
/// parameters; so a stale write that got through from an earlier attempt by the *same*
/// worker process would look like the holder's own. Those writes are tested directly, with
/// tokens the test holds, in `tests/fencing.rs` (completion, failure, heartbeat, progress,
/// output, cancel by a stale token). `faults_process::the_claim_discipline_check_…` pins
/// what this function catches on a log written by hand.
///
/// Panics with the offending rows.
pub fn check_claim_discipline(rows: &[AuditRow], allow_reopen: bool) {
    let mut by_job: HashMap<i64, Vec<&AuditRow>> = HashMap::new();
    for row in rows {
        by_job.entry(row.job_id).or_default().push(row);
    }
    for (job, rows) in by_job {
        let mut tokens: HashSet<Uuid> = HashSet::new();
        // The token of the job's latest claim while it runs.
        let mut current: Option<Uuid> = None;
        for row in &rows {
            if row.op != "update" {
                if row.op == "insert" && row.new_state.as_deref() == Some("running") {
                    current = row.new_token;
                }
                continue;
            }
            let old = row.old_state.as_deref().unwrap_or_default();
            let new = row.new_state.as_deref().unwrap_or_default();
            if old == "running" {
                assert_eq!(
                    row.old_token, current,
                    "job {job}: a change of a running job found a token its latest claim did \
                     not set: {row:?}"
                );
            }
            if row.is_start() {
                let (before, after) = (row.old_attempt.unwrap(), row.new_attempt.unwrap());
                assert_eq!(
                    after,
                    before + 1,
                    "job {job}: a claim adds one attempt: {row:?}"
                );
                assert!(
                    after <= row.max_attempts.unwrap(),
                    "job {job}: attempt {after} is beyond max_attempts: {row:?}"
                );
                let token = row.new_token.expect("a claim sets a token");
                assert!(
                    tokens.insert(token),
                    "job {job}: claim token reused: {row:?}"
                );
            }
            if old == "running" && new == "running" && !row.heartbeat {
                panic!("job {job}: a running job changed without a heartbeat: {row:?}");
            }
            if old == "running" && row.app.starts_with("tb-") && !row.is_reap() {
                assert_eq!(
                    Some(row.app.as_str()),
                    row.old_holder.as_deref(),
                    "job {job}: a worker that does not hold the claim changed it: {row:?}"
                );
            }
            current = if new == "running" {
                row.new_token
            } else {
                None
            };
            if matches!(old, "succeeded" | "dead" | "cancelled") && !allow_reopen {
                panic!("job {job}: a finished job changed: {row:?}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Runs recorded by the testbed kinds

/// One execution recorded in `public.testbed_runs`.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct RunRow {
    pub job_id: i64,
    pub attempt: i32,
    pub pid: i32,
    pub worker_id: String,
    pub local_clock: chrono::DateTime<chrono::Utc>,
    pub db_clock: chrono::DateTime<chrono::Utc>,
}

/// Every recorded execution, oldest first.
pub async fn runs(pool: &PgPool) -> Vec<RunRow> {
    sqlx::query_as(
        "SELECT job_id, attempt, pid, worker_id, local_clock, db_clock
         FROM public.testbed_runs ORDER BY seq",
    )
    .fetch_all(pool)
    .await
    .expect("read testbed_runs")
}

/// Executions per job id.
pub async fn runs_by_job(pool: &PgPool) -> HashMap<i64, Vec<RunRow>> {
    let mut map: HashMap<i64, Vec<RunRow>> = HashMap::new();
    for run in runs(pool).await {
        map.entry(run.job_id).or_default().push(run);
    }
    map
}

/// Number of recorded executions.
pub async fn run_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM public.testbed_runs")
        .fetch_one(pool)
        .await
        .expect("count testbed_runs")
}

/// Number of jobs in each state, by name.
pub async fn states(pool: &PgPool) -> HashMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>(
        "SELECT state::text, count(*) FROM skiplock.jobs GROUP BY state",
    )
    .fetch_all(pool)
    .await
    .expect("count states")
    .into_iter()
    .collect()
}

/// Jobs that `worker_id` holds (`running` with it as `claimed_by`).
pub async fn running_held_by(pool: &PgPool, worker_id: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM skiplock.jobs WHERE state = 'running' AND claimed_by = $1",
    )
    .bind(worker_id)
    .fetch_one(pool)
    .await
    .expect("count held jobs")
}

/// Waits until no session of worker `id` (its `application_name`) is running a statement.
/// Once the worker is stopped (SIGSTOP), this means that nothing it sent is still in flight:
/// what it holds stays as it is until it is continued or killed (only another worker's
/// reaper can change it meanwhile), and a heartbeat it sent before the stop cannot land
/// after a test's own write. Every statement of a worker is one round trip in autocommit
/// (none waits on a lock its own idle sessions hold), so a stopped worker gets there.
pub async fn wait_no_statement_of(pool: &PgPool, id: &str) {
    wait_until(
        "the worker's statements in flight to end",
        PATIENCE,
        || async {
            let active: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = $1
               AND state = 'active'",
            )
            .bind(id)
            .fetch_one(pool)
            .await
            .expect("count the worker's statements in flight");
            (active == 0).then_some(())
        },
    )
    .await;
}

/// Makes the claims that worker `id` holds just stale (by 200 ms) for a reaper whose stale
/// timeout is `stale_after`, as if the worker had stopped beating that long ago; returns
/// how many claims it aged. The next pass of any worker's reaper takes them back: a
/// heartbeat just past its threshold is inside the window a pass between full passes looks
/// at (which starts a second before the previous pass's threshold), while one aged far
/// into the past would wait for the next full pass (src/maintenance/reaper.rs).
///
/// This lets a test reap a killed or frozen worker at once and deterministically while
/// the live workers keep a stale timeout far longer than any pause a loaded machine causes
/// (with a short one, a live worker's late heartbeat gets its claims reaped and its jobs
/// run twice, which such tests rightly count as a failure). Call it only once the worker
/// writes nothing more: its sessions gone ([`sessions_of`] is 0) after a kill, or stopped
/// with nothing in flight ([`wait_no_statement_of`]); otherwise a heartbeat already sent
/// could land after it and freshen the claims again.
pub async fn age_claims_of(pool: &PgPool, id: &str, stale_after: Duration) -> u64 {
    sqlx::query(
        "UPDATE skiplock.jobs
         SET heartbeat_at = clock_timestamp() - ($2 + 200) * interval '1 millisecond'
         WHERE state = 'running' AND claimed_by = $1",
    )
    .bind(id)
    .bind(stale_after.as_millis() as i64)
    .execute(pool)
    .await
    .expect("age the worker's heartbeats")
    .rows_affected()
}

/// Connections of worker `id` (its `application_name`) still open on the server.
pub async fn sessions_of(pool: &PgPool, id: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .expect("count the worker's sessions")
}

/// Enqueues `count` jobs of `kind` with the same args in one statement; returns the ids.
pub async fn enqueue_n(
    db: impl sqlx::PgExecutor<'_>,
    kind: &str,
    args: serde_json::Value,
    count: usize,
    options: skiplock::EnqueueOptions,
) -> Vec<i64> {
    let jobs: Vec<skiplock::NewJob> = (0..count)
        .map(|_| skiplock::NewJob::new(kind, args.clone()).with_options(options.clone()))
        .collect();
    skiplock::enqueue_raw(db, &jobs)
        .await
        .expect("enqueue")
        .into_iter()
        .map(|job| job.id.0)
        .collect()
}

#[allow(unused_imports)]
pub use crate::common::fixtures::wait_until;

/// The database clock now.
pub async fn db_now(pool: &PgPool) -> chrono::DateTime<chrono::Utc> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
        .expect("read the database clock")
}
