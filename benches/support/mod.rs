//! Shared support for the benchmarks: a fresh database per bench, machine facts, progress
//! lines, server-side counters (WAL, full-page images, commits, blocks read, backend
//! evictions, CPU time of Postgres and of the bench process), the preload statements, a
//! drain runner that measures in the database, and a table printer.
//!
//! The benchmarks print numbers; none of them asserts anything, and none runs as a test.
//! Every bench creates its own database on the server in `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`) and drops it when done.
#![allow(dead_code)]

mod cpu;
#[path = "../../tests/common/scratch_db.rs"]
mod scratch_db;

use std::fmt::Write as _;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use skiplock::builtin::Noop;
use skiplock::{Worker, WorkerSummary};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

pub use cpu::{postgres_cpu_secs, process_cpu_secs};
pub use scratch_db::with_database;
use scratch_db::{connect_pool, create_database, drop_database, drop_database_blocking};

/// The server used when `DATABASE_URL` is not set.
pub const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// `application_name` of the worker pools, so their backends can be told apart.
pub const WORKER_APP_NAME: &str = "skiplock-bench-worker";

/// Connections a benchmarked worker gets: the same as `skiplock work` uses.
pub const WORKER_POOL_SIZE: u32 = 8;

/// Command-line options shared by every bench. `cargo bench` passes `--bench`, which is
/// ignored like any unknown flag.
#[derive(Debug, Clone)]
pub struct Opts {
    /// Smaller sizes and shorter caps (`--quick` or `SKIPLOCK_BENCH_QUICK=1`).
    pub quick: bool,
    /// Everything after the flags, e.g. a child mode.
    pub rest: Vec<String>,
}

impl Opts {
    pub fn parse() -> Self {
        // RUST_LOG=skiplock=info shows the worker's own log lines on stderr.
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_writer(std::io::stderr)
                .try_init();
        }
        let mut quick =
            std::env::var("SKIPLOCK_BENCH_QUICK").is_ok_and(|v| v != "0" && !v.is_empty());
        let mut rest = Vec::new();
        for arg in std::env::args().skip(1) {
            match arg.as_str() {
                "--quick" => quick = true,
                "--full" => quick = false,
                "--bench" => {}
                _ => rest.push(arg),
            }
        }
        Self { quick, rest }
    }

    /// Whether `--name` is among the remaining arguments.
    pub fn flag(&self, name: &str) -> bool {
        let flag = format!("--{name}");
        self.rest.contains(&flag)
    }

    /// The value after `--name` in the remaining arguments.
    pub fn value(&self, name: &str) -> Option<&str> {
        let flag = format!("--{name}");
        self.rest
            .iter()
            .position(|a| *a == flag)
            .and_then(|i| self.rest.get(i + 1))
            .map(String::as_str)
    }

    /// The value after `--name` parsed as a number (or anything `FromStr`), else `default`
    /// (also when it does not parse).
    pub fn number<T: std::str::FromStr>(&self, name: &str, default: T) -> T {
        self.value(name)
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }
}

static START: OnceLock<Instant> = OnceLock::new();

/// Set by `--observed`: every drained worker has an event subscriber that reads every
/// event, and a Prometheus recorder is installed for the process (see [`observe`]).
pub static OBSERVED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Installs a Prometheus recorder for the whole process (a recorder cannot be removed, so
/// the observed and plain runs are separate invocations) and makes [`drain_noop`]'s
/// workers subscribe to their events. Returns the handle that renders the metrics.
pub fn observe() -> metrics_exporter_prometheus::PrometheusHandle {
    OBSERVED.store(true, std::sync::atomic::Ordering::Relaxed);
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("install the Prometheus recorder")
}

/// Prints a progress line to stderr, stamped with seconds since the first call.
pub fn progress(message: impl AsRef<str>) {
    let start = START.get_or_init(Instant::now);
    eprintln!(
        "[{:7.1}s] {}",
        start.elapsed().as_secs_f64(),
        message.as_ref()
    );
}

/// The server URL: `DATABASE_URL` or [`DEFAULT_URL`].
pub fn admin_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned())
}

/// A fresh, migrated database for one bench; dropped by [`BenchDb::drop_database`] or,
/// failing that, when this value is dropped.
pub struct BenchDb {
    /// A small pool for setup and measurement queries (not the worker's).
    pub pool: PgPool,
    /// URL of the bench's own database.
    pub url: String,
    /// Database name, `skiplock_bench_<what>_<hex>`.
    pub name: String,
    admin_url: String,
    dropped: bool,
}

impl BenchDb {
    /// Creates `skiplock_bench_<what>_<random>` and migrates it.
    pub async fn create(what: &str) -> Self {
        let admin_url = admin_url();
        let name = format!("skiplock_bench_{what}_{:08x}", fastrand::u32(..));
        create_database(&admin_url, &name).await;
        let url = with_database(&admin_url, &name);
        let pool = connect_pool(&url, &name, 4).await;
        let db = Self {
            pool,
            url,
            name,
            admin_url,
            dropped: false,
        };
        skiplock::migrate(&db.pool).await.expect("migrate");
        // A/B of a schema variant without another build: statements run after the migration.
        if let Ok(sql) = std::env::var("SKIPLOCK_BENCH_AFTER_MIGRATE") {
            progress(format!("SKIPLOCK_BENCH_AFTER_MIGRATE: {sql}"));
            sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(&db.pool)
                .await
                .expect("SKIPLOCK_BENCH_AFTER_MIGRATE");
        }
        progress(format!("created and migrated database {}", db.name));
        db
    }

    /// Options to connect to the bench database.
    pub fn connect_options(&self) -> PgConnectOptions {
        self.url.parse().expect("database URL")
    }

    /// A pool for a worker: [`WORKER_POOL_SIZE`] connections tagged [`WORKER_APP_NAME`].
    pub async fn worker_pool(&self, size: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(size)
            .connect_with(self.connect_options().application_name(WORKER_APP_NAME))
            .await
            .expect("worker pool")
    }

    /// One plain connection to the bench database.
    pub async fn connection(&self) -> PgConnection {
        PgConnection::connect_with(&self.connect_options())
            .await
            .expect("connect")
    }

    /// Runs a statement on the setup pool, panicking with it on failure.
    pub async fn exec(&self, sql: &str) {
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// One `bigint` (or anything castable to it) from a query.
    pub async fn scalar_i64(&self, sql: &str) -> i64 {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// One `float8` from a query.
    pub async fn scalar_f64(&self, sql: &str) -> f64 {
        sqlx::query_scalar::<_, f64>(AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Empties the jobs table and its identity, so each run starts from the same state.
    /// Backends a killed worker left behind (a statement it started keeps running after
    /// its runtime is dropped) are terminated first, or TRUNCATE would wait for them.
    pub async fn reset(&self) {
        self.terminate_worker_backends().await;
        self.exec("TRUNCATE skiplock.jobs, skiplock.job_dependencies RESTART IDENTITY")
            .await;
        // Vacuum of an empty table is quick and resets the free space map.
        self.exec("VACUUM skiplock.jobs").await;
    }

    /// Terminates the backends of this bench's worker pools (tagged [`WORKER_APP_NAME`], in
    /// this bench's own database), e.g. those a killed worker left running.
    pub async fn terminate_worker_backends(&self) {
        let ended: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = $1
               AND pg_terminate_backend(pid)",
        )
        .bind(WORKER_APP_NAME)
        .fetch_all(&self.pool)
        .await
        .unwrap_or_default();
        if !ended.is_empty() {
            progress(format!(
                "  terminated {} leftover worker backend(s): {ended:?}",
                ended.len()
            ));
        }
    }

    /// Highest job id so far (0 when empty): jobs inserted later have larger ids.
    pub async fn max_id(&self) -> i64 {
        self.scalar_i64("SELECT coalesce(max(id), 0) FROM skiplock.jobs")
            .await
    }

    /// Inserts `n` queued `noop` jobs with plain SQL (chunks of 100,000), then
    /// `VACUUM ANALYZE`, so every run starts with set hint bits and fresh statistics.
    pub async fn preload_noop(&self, n: i64) {
        self.preload("'noop', '{}'::jsonb", "", n).await;
    }

    /// Inserts `n` queued `noop` jobs with plain SQL and nothing else: the planner keeps
    /// whatever statistics it had (after [`reset`](Self::reset): those of an empty table),
    /// as when a backlog builds up faster than autovacuum analyzes.
    pub async fn preload_noop_unanalyzed(&self, n: i64) {
        let t0 = Instant::now();
        self.exec(&format!(
            "INSERT INTO skiplock.jobs (kind, args) SELECT 'noop', '{{}}' FROM generate_series(1, {n})"
        ))
        .await;
        progress(format!(
            "  inserted {n} queued jobs (no VACUUM, no ANALYZE) in {:.1} s",
            t0.elapsed().as_secs_f64()
        ));
    }

    /// Inserts `n` jobs of `kind` with `args` (SQL expressions), queued, then vacuums.
    pub async fn preload_kind(&self, kind: &str, args: &str, n: i64) {
        self.preload(&format!("'{kind}', {args}"), "", n).await;
    }

    /// Inserts `n` `succeeded` noop jobs finished an hour ago (history the claim must not
    /// pay for), then vacuums.
    pub async fn preload_finished(&self, n: i64) {
        self.preload(
            "'noop', '{}'::jsonb",
            ", 'succeeded', 1, now() - interval '1 hour', now() - interval '1 hour'",
            n,
        )
        .await;
    }

    /// Inserts `per_day` succeeded `noop` jobs for each of the `days` days before today
    /// (UTC), spread over each day, into that day's table (made first, as retention keeps
    /// them), then `VACUUM ANALYZE`.
    pub async fn preload_finished_days(&self, days: i32, per_day: i64) {
        let t0 = Instant::now();
        self.exec(&format!(
            "SELECT skiplock.internal_prepare_done_partitions(
                 (now() AT TIME ZONE 'UTC')::date - {days}, {days})"
        ))
        .await;
        for day in 1..=days {
            let mut done = 0;
            while done < per_day {
                let chunk = (per_day - done).min(100_000);
                self.exec(&format!(
                    "INSERT INTO skiplock.jobs (kind, args, state, attempt, claimed_at, finished_at)
                     SELECT 'noop', '{{}}'::jsonb, 'succeeded', 1, f - interval '1 ms', f
                     FROM (SELECT ((now() AT TIME ZONE 'UTC')::date - {day})::timestamp
                                      AT TIME ZONE 'UTC'
                                  + (g + {done}) * (interval '1 day' / {per_day}) AS f
                           FROM generate_series(0, {chunk} - 1) g) t"
                ))
                .await;
                done += chunk;
            }
            progress(format!("  preloaded day -{day}: {per_day} finished jobs"));
        }
        self.exec("VACUUM ANALYZE skiplock.jobs").await;
        progress(format!(
            "  preloaded {days} days of {per_day} finished jobs and vacuumed in {:.1} s",
            t0.elapsed().as_secs_f64()
        ));
    }

    async fn preload(&self, kind_args: &str, finished: &str, n: i64) {
        let t0 = Instant::now();
        let columns = if finished.is_empty() {
            "kind, args"
        } else {
            "kind, args, state, attempt, claimed_at, finished_at"
        };
        let mut done = 0;
        while done < n {
            let chunk = (n - done).min(100_000);
            self.exec(&format!(
                "INSERT INTO skiplock.jobs ({columns}) SELECT {kind_args}{finished} FROM generate_series(1, {chunk})"
            ))
            .await;
            done += chunk;
            if n > 100_000 {
                progress(format!("  preloaded {done}/{n}"));
            }
        }
        self.exec("VACUUM ANALYZE skiplock.jobs").await;
        progress(format!(
            "  preloaded {n} {} jobs and vacuumed in {:.1} s",
            if finished.is_empty() {
                "queued"
            } else {
                "finished"
            },
            t0.elapsed().as_secs_f64()
        ));
    }

    /// Server-wide WAL position, full-page images and buffer traffic, this database's
    /// commits and blocks read, and the CPU time of Postgres and of this process, for
    /// per-job costs.
    pub async fn counters(&self) -> Counters {
        // Stats are flushed by backends at most once a second while busy, and at exit.
        let mut conn = self.connection().await;
        let _ = sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut conn)
            .await;
        let (lsn, commits, blocks_read, fpi, backend_writes): (String, i64, i64, i64, i64) =
            sqlx::query_as(
                "SELECT pg_current_wal_lsn()::text, d.xact_commit, d.blks_read, w.wal_fpi,
                        b.buffers_backend
                 FROM pg_stat_database d, pg_stat_wal w, pg_stat_bgwriter b
                 WHERE d.datname = current_database()",
            )
            .fetch_one(&mut conn)
            .await
            .expect("counters");
        let _ = conn.close().await;
        Counters {
            lsn,
            commits,
            blocks_read,
            fpi,
            backend_writes,
            postgres_cpu_secs: postgres_cpu_secs(),
            own_cpu_secs: process_cpu_secs("self").unwrap_or(0.0),
        }
    }

    /// WAL bytes between two counter snapshots.
    pub async fn wal_between(&self, before: &Counters, after: &Counters) -> i64 {
        sqlx::query_scalar("SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::bigint")
            .bind(&after.lsn)
            .bind(&before.lsn)
            .fetch_one(&self.pool)
            .await
            .expect("wal diff")
    }

    /// Waits until no backend of a worker pool is left (their stats are flushed at exit).
    pub async fn wait_workers_gone(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let left: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND application_name = $1",
            )
            .bind(WORKER_APP_NAME)
            .fetch_one(&self.pool)
            .await
            .unwrap_or(0);
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    /// Rate of the jobs with `id > after_id` that succeeded, measured in the database from
    /// the first claim to the last completion, with the number of claim and complete
    /// statements (each statement has its own `now()`, so distinct timestamps count them).
    pub async fn drained_since(&self, after_id: i64) -> Drained {
        let (jobs, secs, claims, completes): (i64, f64, i64, i64) = sqlx::query_as(
            "SELECT count(*),
                    coalesce(extract(epoch FROM max(finished_at) - min(claimed_at))::float8, 0),
                    count(DISTINCT claimed_at), count(DISTINCT finished_at)
             FROM skiplock.jobs WHERE id > $1 AND state = 'succeeded'",
        )
        .bind(after_id)
        .fetch_one(&self.pool)
        .await
        .expect("drain stats");
        Drained {
            jobs,
            secs,
            claim_statements: claims,
            complete_statements: completes,
        }
    }

    /// Jobs still queued or running.
    pub async fn unfinished(&self) -> i64 {
        self.scalar_i64("SELECT count(*) FROM skiplock.jobs WHERE state IN ('queued', 'running')")
            .await
    }

    /// Drops the database (forcing any leftover connection out).
    pub async fn drop_database(mut self) {
        self.pool.close().await;
        drop_database(&self.admin_url, &self.name).await;
        progress(format!("dropped database {}", self.name));
        self.dropped = true;
    }
}

impl Drop for BenchDb {
    /// Best effort when a bench panics: drop the database from a helper thread.
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        drop_database_blocking(self.admin_url.clone(), self.name.clone());
    }
}

/// A snapshot of server-side counters.
#[derive(Debug, Clone)]
pub struct Counters {
    /// `pg_current_wal_lsn()`, server-wide (other databases' writes count too).
    pub lsn: String,
    /// `pg_stat_database.xact_commit` of the bench database.
    pub commits: i64,
    /// `pg_stat_database.blks_read` of the bench database: blocks not found in
    /// `shared_buffers` (read from the OS page cache or the disk).
    pub blocks_read: i64,
    /// `pg_stat_wal.wal_fpi`, server-wide: full-page images (first change of a page after
    /// a checkpoint).
    pub fpi: i64,
    /// `pg_stat_bgwriter.buffers_backend`, server-wide: dirty buffers a backend had to
    /// write out itself to make room.
    pub backend_writes: i64,
    /// CPU seconds (user + system) of every Postgres process, exited backends included.
    pub postgres_cpu_secs: f64,
    /// CPU seconds of this bench process (the worker runs in it).
    pub own_cpu_secs: f64,
}

/// What happened between two [`Counters`] snapshots, per job.
#[derive(Debug, Clone, Copy, Default)]
pub struct Costs {
    pub commits: i64,
    pub wal_bytes: i64,
    pub blocks_read: i64,
    pub fpi: i64,
    pub backend_writes: i64,
    pub postgres_cpu_secs: f64,
    pub own_cpu_secs: f64,
}

impl Costs {
    /// The difference between two snapshots (WAL bytes are computed by the server).
    pub async fn between(db: &BenchDb, before: &Counters, after: &Counters) -> Self {
        Self {
            commits: after.commits - before.commits,
            wal_bytes: db.wal_between(before, after).await,
            blocks_read: after.blocks_read - before.blocks_read,
            fpi: after.fpi - before.fpi,
            backend_writes: after.backend_writes - before.backend_writes,
            postgres_cpu_secs: after.postgres_cpu_secs - before.postgres_cpu_secs,
            own_cpu_secs: after.own_cpu_secs - before.own_cpu_secs,
        }
    }
}

/// What a drain did, measured in the database.
#[derive(Debug, Clone, Copy, Default)]
pub struct Drained {
    pub jobs: i64,
    /// First claim to last completion, by the database clock.
    pub secs: f64,
    pub claim_statements: i64,
    pub complete_statements: i64,
}

impl Drained {
    pub fn rate(&self) -> f64 {
        if self.secs > 0.0 {
            self.jobs as f64 / self.secs
        } else {
            0.0
        }
    }
}

/// A worker drain of `noop` jobs, as measured by [`drain_noop`].
#[derive(Debug, Clone, Default)]
pub struct DrainRun {
    pub drained: Drained,
    /// From `Worker::run` start to its return (includes start-up and idle detection).
    pub wall_secs: f64,
    /// Stopped by the time cap before the table was empty.
    pub capped: bool,
    /// The worker did not stop within [`STOP_WAIT`] of the shutdown request and its
    /// runtime was dropped (its held claims stay `running`).
    pub killed: bool,
    /// Most rows seen `running` at once (sampled every second): claims the worker held,
    /// buffered, running or waiting for their completion write.
    pub max_running: i64,
    pub costs: Costs,
    /// `None` when the worker was killed.
    pub summary: Option<WorkerSummary>,
}

impl DrainRun {
    pub fn per_job(&self, total: i64) -> f64 {
        if self.drained.jobs > 0 {
            total as f64 / self.drained.jobs as f64
        } else {
            0.0
        }
    }

    /// `(capped)`, `(capped, killed)` or nothing.
    pub fn note(&self) -> &'static str {
        match (self.capped, self.killed) {
            (_, true) => " (capped, killed)",
            (true, false) => " (capped)",
            _ => "",
        }
    }
}

/// How to run a drain.
#[derive(Debug, Clone, Copy)]
pub struct DrainCfg {
    pub concurrency: Option<usize>,
    /// Claimed jobs kept in the worker's local buffer (default: equal to concurrency).
    pub prefetch: Option<usize>,
    /// Stop (gracefully) after this long even if jobs remain.
    pub cap: Duration,
    /// Only jobs with a larger id count.
    pub after_id: i64,
    /// Hold a REPEATABLE READ snapshot with an xid (`BEGIN ISOLATION LEVEL REPEATABLE
    /// READ; SELECT txid_current();`) in another session for the whole drain, as a long
    /// report, `pg_dump` or a forgotten `BEGIN` in psql does.
    pub hold_snapshot: bool,
    /// Connect the worker through the PgBouncer (transaction pooling) listening on this
    /// port of 127.0.0.1, in the worker's PgBouncer mode, instead of directly.
    pub pgbouncer_port: Option<u16>,
}

impl DrainCfg {
    /// Default worker settings, every job counted, stopped after `cap`.
    pub fn capped(cap: Duration) -> Self {
        Self {
            concurrency: None,
            prefetch: None,
            cap,
            after_id: 0,
            hold_snapshot: false,
            pgbouncer_port: None,
        }
    }
}

/// How long a worker may take to stop after the shutdown request before its runtime is
/// dropped.
pub const STOP_WAIT: Duration = Duration::from_secs(10);

/// A worker running on a runtime of its own (default size: one thread per core) in its
/// own thread, like a separate process, so that a worker that does not stop can be
/// dropped whole. Its pool has [`WORKER_POOL_SIZE`] connections tagged [`WORKER_APP_NAME`].
pub struct WorkerThread {
    handle: skiplock::ShutdownHandle,
    kill: Option<tokio::sync::oneshot::Sender<()>>,
    done: tokio::sync::oneshot::Receiver<Option<WorkerSummary>>,
    thread: Option<std::thread::JoinHandle<()>>,
    started: Instant,
    stopping_since: Option<Instant>,
    /// The cap was reached and a shutdown requested.
    pub capped: bool,
}

impl WorkerThread {
    /// Builds the worker with `build` on a fresh pool and runs it.
    pub fn spawn(db: &BenchDb, build: impl FnOnce(PgPool) -> Worker + Send + 'static) -> Self {
        Self::spawn_with(
            db.connect_options().application_name(WORKER_APP_NAME),
            build,
        )
    }

    /// As [`spawn`](Self::spawn), with the pool connecting with `options`.
    pub fn spawn_with(
        options: PgConnectOptions,
        build: impl FnOnce(PgPool) -> Worker + Send + 'static,
    ) -> Self {
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<skiplock::ShutdownHandle>();
        let (kill_tx, kill_rx) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<Option<WorkerSummary>>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().expect("worker runtime");
            let summary = rt.block_on(async move {
                let pool = PgPoolOptions::new()
                    .max_connections(WORKER_POOL_SIZE)
                    .connect_with(options)
                    .await
                    .expect("worker pool");
                let worker = build(pool.clone());
                let _ = stop_tx.send(worker.shutdown_handle());
                let summary = tokio::select! {
                    summary = worker.run() => Some(summary.expect("worker run")),
                    _ = kill_rx => None,
                };
                if summary.is_some() {
                    pool.close().await;
                }
                summary
            });
            // Dropping the runtime cancels every task the worker left behind.
            rt.shutdown_background();
            let _ = done_tx.send(summary);
        });
        let handle = stop_rx.recv().expect("worker handle");
        Self {
            handle,
            kill: Some(kill_tx),
            done: done_rx,
            thread: Some(thread),
            started: Instant::now(),
            stopping_since: None,
            capped: false,
        }
    }

    /// Seconds since the worker started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Waits up to `tick` for the worker to return: `Some(summary)` when it did (`None`
    /// inside when it was killed).
    pub async fn finished(&mut self, tick: Duration) -> Option<Option<WorkerSummary>> {
        match tokio::time::timeout(tick, &mut self.done).await {
            Ok(summary) => {
                if let Some(thread) = self.thread.take() {
                    let _ = thread.join();
                }
                Some(summary.unwrap_or(None))
            }
            Err(_) => None,
        }
    }

    /// Requests a graceful shutdown once `cap` has passed, and drops the worker's runtime
    /// [`STOP_WAIT`] later if it has not returned by then.
    pub fn enforce_cap(&mut self, cap: Duration, running: i64) {
        if self.started.elapsed() >= cap && !self.capped {
            self.capped = true;
            self.stopping_since = Some(Instant::now());
            progress(format!(
                "  time cap of {cap:?} reached; stopping the worker"
            ));
            self.handle.shutdown();
        }
        if let Some(since) = self.stopping_since
            && since.elapsed() >= STOP_WAIT
            && let Some(kill) = self.kill.take()
        {
            progress(format!(
                "  the worker did not stop within {STOP_WAIT:?}; dropping its runtime \
                 ({running} claims still running)"
            ));
            let _ = kill.send(());
        }
    }

    /// Requests a graceful shutdown now and waits for the worker, dropping its runtime
    /// after [`STOP_WAIT`]. `None` when it had to be killed.
    pub async fn stop(&mut self) -> Option<WorkerSummary> {
        if self.stopping_since.is_none() {
            self.stopping_since = Some(Instant::now());
            self.handle.shutdown();
        }
        loop {
            if let Some(summary) = self.finished(Duration::from_millis(250)).await {
                return summary;
            }
            self.enforce_cap(Duration::MAX, -1);
        }
    }
}

/// Runs a `noop` worker with default settings (except `concurrency` when given and
/// `exit_when_idle`) until the table has nothing runnable left, or until the cap; measures
/// the rate in the database, and commits and WAL around it.
pub async fn drain_noop(db: &BenchDb, cfg: DrainCfg) -> DrainRun {
    let held = if cfg.hold_snapshot {
        Some(hold_snapshot(db).await)
    } else {
        None
    };
    let before = db.counters().await;
    let options = match cfg.pgbouncer_port {
        None => db.connect_options().application_name(WORKER_APP_NAME),
        Some(port) => db
            .connect_options()
            .host("127.0.0.1")
            .port(port)
            .extra_float_digits(None)
            .application_name(WORKER_APP_NAME),
    };
    let mut worker = WorkerThread::spawn_with(options, move |pool| {
        let mut builder = Worker::builder(pool)
            .pgbouncer(cfg.pgbouncer_port.is_some())
            .register::<Noop>()
            .exit_when_idle(true);
        if let Some(c) = cfg.concurrency {
            builder = builder.concurrency(c);
        }
        if let Some(p) = cfg.prefetch {
            builder = builder.prefetch(p);
        }
        let worker = builder.build().expect("worker");
        if OBSERVED.load(std::sync::atomic::Ordering::Relaxed) {
            // A subscriber that keeps up, as an application's would.
            let mut events = worker.subscribe();
            tokio::spawn(async move { while events.recv().await.is_some() {} });
        }
        worker
    });
    let mut last_report = Instant::now();
    let mut max_running = 0i64;
    let summary = loop {
        if let Some(summary) = worker.finished(Duration::from_secs(1)).await {
            break summary;
        }
        let running = db
            .scalar_i64("SELECT count(*) FROM skiplock.jobs WHERE state = 'running'")
            .await;
        max_running = max_running.max(running);
        worker.enforce_cap(cfg.cap, running);
        if last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            let queued = db
                .scalar_i64("SELECT count(*) FROM skiplock.jobs WHERE state = 'queued'")
                .await;
            progress(format!(
                "  {:.0} s: {queued} queued, {running} running",
                worker.elapsed().as_secs_f64()
            ));
        }
    };
    let wall_secs = worker.elapsed().as_secs_f64();
    // PgBouncer keeps its server connections (named after the worker, PgBouncer passes
    // application_name on) once the worker is gone; they flush their statistics (the
    // commits counted) only when they end.
    if summary.is_none() || cfg.pgbouncer_port.is_some() {
        db.terminate_worker_backends().await;
    }
    db.wait_workers_gone().await;
    if let Some(held) = held {
        end_snapshot(held).await;
    }
    let after = db.counters().await;
    let costs = Costs::between(db, &before, &after).await;
    let drained = db.drained_since(cfg.after_id).await;
    DrainRun {
        drained,
        wall_secs,
        capped: worker.capped,
        killed: summary.is_none(),
        max_running,
        costs,
        summary,
    }
}

/// A session of its own holding a REPEATABLE READ snapshot with an xid, so that no row
/// version deleted or updated after this point can be removed (by VACUUM or by index scans
/// marking entries dead) until it ends.
pub async fn hold_snapshot(db: &BenchDb) -> PgConnection {
    let mut held = PgConnection::connect(&db.url)
        .await
        .expect("connect the snapshot holder");
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut held)
        .await
        .expect("begin");
    sqlx::query("SELECT txid_current()")
        .execute(&mut held)
        .await
        .expect("take an xid");
    held
}

/// Ends a snapshot taken by [`hold_snapshot`].
pub async fn end_snapshot(mut held: PgConnection) {
    sqlx::query("ROLLBACK")
        .execute(&mut held)
        .await
        .expect("end the held snapshot");
}

/// Inserts `noop` jobs in one statement every 10 ms so that they add up to `per_sec`
/// since the start (a late tick catches up), until `running` clears; counts them in
/// `inserted`.
pub async fn insert_noop_at_rate(
    pool: PgPool,
    per_sec: f64,
    running: std::sync::Arc<std::sync::atomic::AtomicBool>,
    inserted: std::sync::Arc<std::sync::atomic::AtomicI64>,
) {
    use std::sync::atomic::Ordering;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let started = Instant::now();
    while running.load(Ordering::Relaxed) {
        tick.tick().await;
        let owed =
            (started.elapsed().as_secs_f64() * per_sec) as i64 - inserted.load(Ordering::Relaxed);
        if owed <= 0 {
            continue;
        }
        sqlx::query(
            "INSERT INTO skiplock.jobs (kind, args) SELECT 'noop', '{}' FROM generate_series(1, $1)",
        )
        .bind(owed)
        .execute(&pool)
        .await
        .expect("insert");
        inserted.fetch_add(owed, Ordering::Relaxed);
    }
}

/// The drain's rate in consecutive windows of `window` seconds from the first claim: jobs
/// that finished in each window, per second.
pub async fn rate_over_time(db: &BenchDb, after_id: i64, window: f64) -> Vec<f64> {
    // Two statements: joined with the table, the start's aggregate was re-run per row
    // under statistics of an empty table (autovacuum off, no ANALYZE after the load).
    let start: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
        "SELECT min(claimed_at) FROM skiplock.jobs WHERE id > $1 AND state = 'succeeded'",
    )
    .bind(after_id)
    .fetch_one(&db.pool)
    .await
    .expect("first claim");
    let Some(start) = start else {
        return Vec::new();
    };
    sqlx::query_scalar(
        "SELECT (count(*) / $3)::float8
         FROM skiplock.jobs
         WHERE id > $1 AND state = 'succeeded'
         GROUP BY floor(extract(epoch FROM finished_at - $2) / $3)
         ORDER BY floor(extract(epoch FROM finished_at - $2) / $3)",
    )
    .bind(after_id)
    .bind(start)
    .bind(window)
    .fetch_all(&db.pool)
    .await
    .expect("rate over time")
}

/// Whether the server preloads pg_stat_statements; if so, creates the extension in the
/// bench database and returns true, otherwise prints why the statement profile is skipped.
pub async fn pgss_enabled(db: &BenchDb) -> bool {
    let preload: String = sqlx::query_scalar("SELECT current_setting('shared_preload_libraries')")
        .fetch_one(&db.pool)
        .await
        .unwrap_or_default();
    if !preload.contains("pg_stat_statements") {
        println!(
            "pg_stat_statements: skipped, the server does not preload it \
             (shared_preload_libraries = '{preload}'); `benches/run-all.sh --pgss` runs the \
             profile and workloads benches on a private server that does."
        );
        println!();
        return false;
    }
    db.exec("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await;
    true
}

/// Forgets the statistics gathered so far (all databases of the server).
pub async fn pgss_reset(db: &BenchDb) {
    db.exec("SELECT pg_stat_statements_reset()").await;
}

/// One pg_stat_statements row: query, calls, rows, total ms, mean ms, max ms, blocks per
/// call, WAL bytes per call.
type StatementRow = (String, i64, i64, f64, f64, f64, f64, f64);

/// Prints the bench database's statements by total execution time, named after the
/// library function that issues them where recognisable.
pub async fn pgss_print(db: &BenchDb) {
    let rows: Vec<StatementRow> = sqlx::query_as(
        "SELECT query, calls, rows, total_exec_time, mean_exec_time, max_exec_time,
                (shared_blks_hit + shared_blks_read)::float8 / greatest(calls, 1),
                wal_bytes::float8 / greatest(calls, 1)
         FROM pg_stat_statements
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND query NOT ILIKE '%pg_stat_statements%'
         ORDER BY total_exec_time DESC LIMIT 12",
    )
    .fetch_all(&db.pool)
    .await
    .expect("pg_stat_statements");
    let mut table = Table::new(&[
        "statement",
        "calls",
        "rows/call",
        "total ms",
        "mean ms",
        "max ms",
        "blocks/call",
        "WAL B/call",
    ]);
    for (q, calls, rows, total, mean, max, blocks, wal) in rows {
        table.row(vec![
            statement_name(&q),
            thousands(calls),
            format!("{:.1}", rows as f64 / calls.max(1) as f64),
            format!("{total:.0}"),
            format!("{mean:.2}"),
            format!("{max:.1}"),
            format!("{blocks:.0}"),
            format!("{wal:.0}"),
        ]);
    }
    table.print();
}

/// A short name for a statement's text: the library function issuing it where
/// recognisable, else its first words.
fn statement_name(query: &str) -> String {
    let q = query.split_whitespace().collect::<Vec<_>>().join(" ");
    let has = |s: &str| q.contains(s);
    // pg_stat_statements replaces constants with $n, so match on the statements' shape.
    let name = if has("WITH picked AS") {
        "jobs_claim_batch"
    } else if has("WITH held AS") && has("released AS") {
        "jobs_release_many"
    } else if has("WITH held AS") {
        "jobs_complete_many"
    } else if has("WITH failed AS") {
        "jobs_fail_many"
    } else if has("WITH claims AS") {
        "jobs_heartbeat_many"
    } else if has("WITH stale AS") {
        "jobs_reap_stale"
    } else if has("WITH orphans AS") {
        "jobs_settle_waiting"
    } else if has("WITH doomed AS") {
        "jobs_prune_finished"
    } else if has("INSERT INTO skiplock.jobs") && has("unnest") {
        "jobs_insert_many"
    } else if has("SELECT EXISTS") && has("queue = ANY") {
        "jobs_any_active"
    } else {
        ""
    };
    if name.is_empty() {
        let short: String = q.chars().take(60).collect();
        format!("`{}…`", short.replace('|', "/"))
    } else {
        format!("`{name}`")
    }
}

/// Machine and server facts, one per line, for the head of every report.
pub async fn machine_facts(pool: &PgPool) -> String {
    let mut out = String::new();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0 / 1024.0);
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "machine: {cores} cores ({cpu}), {mem_gib:.1} GiB RAM, load average {load}"
    );
    let version: String = sqlx::query_scalar("SELECT version()")
        .fetch_one(pool)
        .await
        .unwrap_or_default();
    let _ = writeln!(out, "postgres: {version}");
    let settings: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, setting || coalesce(' ' || unit, '') FROM pg_settings
         WHERE name IN ('shared_buffers', 'synchronous_commit', 'fsync', 'wal_level',
                        'max_wal_size', 'checkpoint_timeout', 'work_mem', 'jit',
                        'shared_preload_libraries', 'max_connections', 'commit_delay',
                        'wal_compression', 'full_page_writes', 'autovacuum')
         ORDER BY name",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    let _ = writeln!(
        out,
        "settings: {}",
        settings
            .iter()
            .map(|(n, v)| format!("{n}={}", if v.is_empty() { "''" } else { v }))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let profile = if cfg!(debug_assertions) {
        "debug (numbers meaningless: use cargo bench or --release)"
    } else {
        "release"
    };
    let _ = writeln!(out, "build: {profile}");
    out
}

/// Prints the machine facts under a title.
pub async fn print_header(title: &str, db: &BenchDb, opts: &Opts) {
    println!("## {title}{}", if opts.quick { " (quick)" } else { "" });
    println!();
    for line in machine_facts(&db.pool).await.lines() {
        println!("- {line}");
    }
    println!();
}

/// A table printed as Markdown with aligned columns.
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&str]) -> Self {
        Self {
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn print(&self) {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate() {
                if i < widths.len() {
                    widths[i] = widths[i].max(cell.chars().count());
                }
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::from("|");
            for (i, w) in widths.iter().enumerate() {
                let cell = cells.get(i).map_or("", String::as_str);
                let pad = w - cell.chars().count();
                let _ = write!(s, " {cell}{} |", " ".repeat(pad));
            }
            s
        };
        println!("{}", line(&self.headers));
        let mut sep = String::from("|");
        for w in &widths {
            let _ = write!(sep, "{}|", "-".repeat(w + 2));
        }
        println!("{sep}");
        for row in &self.rows {
            println!("{}", line(row));
        }
        println!();
    }
}

/// Formats a rate with thousands separators: `12,345/s`.
pub fn rate(per_sec: f64) -> String {
    format!("{}/s", thousands(per_sec.round() as i64))
}

/// `1234567` as `1,234,567`.
pub fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

/// The `q`-quantile (0..=1) of sorted values, nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Peak and current resident set size of this process, in KiB (`VmHWM`, `VmRSS`).
pub fn rss_kib(pid: Option<u32>) -> Option<(u64, u64)> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/status"),
        None => "/proc/self/status".to_owned(),
    };
    let status = std::fs::read_to_string(path).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

/// The cells every drain table starts its measures with: jobs drained (with the run's
/// note), database seconds, rate, wall seconds, jobs per claim and per completion
/// statement.
pub fn drained_cells(run: &DrainRun) -> Vec<String> {
    let d = &run.drained;
    vec![
        format!("{}{}", thousands(d.jobs), run.note()),
        format!("{:.2}", d.secs),
        rate(d.rate()),
        format!("{:.1}", run.wall_secs),
        format!("{:.1}", d.jobs as f64 / d.claim_statements.max(1) as f64),
        format!("{:.1}", d.jobs as f64 / d.complete_statements.max(1) as f64),
    ]
}
