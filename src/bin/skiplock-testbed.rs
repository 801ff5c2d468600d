//! `skiplock-testbed`: a worker process for the fault-injection tests (`tests/faults_*.rs`)
//! and the soak (`docs/testing.md`). Built only with the `testbed` feature.
//!
//! It is a thin binary over the library: every knob of the worker is a flag, and it
//! registers kinds that misbehave on purpose. Every kind except `noop` and `sleep` first
//! records its execution in `public.testbed_runs` (job id, attempt, process id, worker id,
//! the process's own clock), so a test counts executions from the database, even for a
//! process that is killed a moment later.
//!
//! Every connection carries the worker id as its `application_name`, so a test's audit
//! trigger can tell which process wrote each change of `skiplock.jobs`.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, ValueEnum};
use serde::{Deserialize, Serialize};
use skiplock::builtin::{Noop, Sleep};
use skiplock::db::testbed::{testbed_runs_create, testbed_runs_insert};
use skiplock::{Job, JobContext, JobError, ShutdownHandle, Worker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Worker process with misbehaving job kinds, for fault-injection tests.
#[derive(Parser)]
#[command(name = "skiplock-testbed", version)]
struct Args {
    /// Postgres URL of the test database.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,

    /// Worker identity, written to `claimed_by` and `application_name` (at most 63 bytes).
    /// Default: `testbed-<pid>`.
    #[arg(long)]
    worker_id: Option<String>,

    /// Kinds to register, comma-separated (default: all).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "noop,sleep,record,never-return,block,spin,panic,abort"
    )]
    kinds: Vec<Kind>,

    /// Queue to claim from; repeat for several (default: default).
    #[arg(long = "queue", value_name = "Q")]
    queues: Vec<String>,

    /// Jobs run at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,

    /// Claimed jobs kept in the local buffer (default: the concurrency).
    #[arg(long)]
    prefetch: Option<usize>,

    /// Connections in the pool, shared by the worker and the handlers.
    #[arg(long, default_value_t = 8)]
    pool_size: u32,

    /// How long a statement waits for a pool connection before it fails (and is retried).
    #[arg(long, default_value_t = 30_000)]
    acquire_timeout_ms: u64,

    /// Heartbeat interval.
    #[arg(long, default_value_t = 200)]
    heartbeat_ms: u64,

    /// Heartbeat age after which a claim is reaped.
    #[arg(long, default_value_t = 2_000)]
    stale_ms: u64,

    /// Fallback poll interval.
    #[arg(long, default_value_t = 200)]
    poll_ms: u64,

    /// Reaper interval.
    #[arg(long, default_value_t = 200)]
    reap_ms: u64,

    /// Timeout of the `never-return`, `block` and `spin` kinds.
    #[arg(long, default_value_t = 1_000)]
    timeout_ms: u64,

    /// Retry delay of every testbed kind after a failed attempt.
    #[arg(long, default_value_t = 10)]
    retry_ms: u64,

    /// Grace period of a graceful shutdown (first SIGTERM/SIGINT).
    #[arg(long, default_value_t = 5_000)]
    shutdown_grace_ms: u64,

    /// Exit once nothing of this worker's kinds and queues is runnable, running or held
    /// back by a per-key limit.
    #[arg(long)]
    exit_when_idle: bool,

    /// Tokio worker threads (the handlers, the heartbeat and the completer share them).
    #[arg(long, default_value_t = 4)]
    worker_threads: usize,

    /// Only create `public.testbed_runs` (if missing), then exit.
    #[arg(long)]
    prepare_only: bool,
}

/// A kind the testbed can run.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Kind {
    /// `noop`: succeeds at once, records nothing.
    Noop,
    /// `sleep` (`{"ms": N}`): the built-in sleep.
    Sleep,
    /// `record` (`{"ms": N}`): records its run, sleeps N ms, succeeds.
    Record,
    /// `never_return`: records its run and never returns; the kind's timeout stops it.
    NeverReturn,
    /// `block` (`{"ms": N}`): records its run, blocks its thread for N ms
    /// (`std::thread::sleep`), succeeds.
    Block,
    /// `spin`: records its run and burns CPU, yielding every few milliseconds, until
    /// stopped by the kind's timeout.
    Spin,
    /// `panic`: records its run and panics.
    Panic,
    /// `abort`: records its run and aborts the process (SIGABRT).
    Abort,
}

/// Timeout of the kinds that never finish by themselves.
static TIMEOUT: OnceLock<Duration> = OnceLock::new();
/// Retry delay of every testbed kind.
static RETRY: OnceLock<Duration> = OnceLock::new();

fn timeout() -> Option<Duration> {
    TIMEOUT.get().copied()
}

fn retry_delay() -> Duration {
    RETRY.get().copied().unwrap_or(Duration::from_millis(10))
}

/// Who this process is, for `testbed_runs`.
struct Identity {
    worker_id: String,
    pid: i32,
}

/// Records one execution of the job in `public.testbed_runs`; commits before returning.
async fn record(ctx: &JobContext) -> Result<(), JobError> {
    let identity = ctx
        .data::<Identity>()
        .ok_or_else(|| JobError::permanent("testbed identity missing"))?;
    testbed_runs_insert(
        ctx.pool(),
        ctx.id().0,
        ctx.attempt(),
        identity.pid,
        &identity.worker_id,
        chrono::Utc::now(),
    )
    .await
    .map_err(|e| JobError::retry(format!("could not record the run: {e}")))
}

/// Records its run, sleeps `ms`, succeeds.
#[derive(Serialize, Deserialize)]
struct Record {
    #[serde(default)]
    ms: u64,
}

impl Job for Record {
    const KIND: &'static str = "record";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        record(&ctx).await?;
        if self.ms > 0 {
            tokio::time::sleep(Duration::from_millis(self.ms)).await;
        }
        Ok(())
    }

    fn retry_delay(_attempt: i32) -> Duration {
        retry_delay()
    }
}

/// Records its run and never returns.
#[derive(Serialize, Deserialize)]
struct NeverReturn {}

impl Job for NeverReturn {
    const KIND: &'static str = "never_return";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        record(&ctx).await?;
        std::future::pending::<()>().await;
        Ok(())
    }

    fn timeout() -> Option<Duration> {
        timeout()
    }

    fn retry_delay(_attempt: i32) -> Duration {
        retry_delay()
    }
}

/// Records its run, then blocks its runtime thread for `ms`.
#[derive(Serialize, Deserialize)]
struct Block {
    ms: u64,
}

impl Job for Block {
    const KIND: &'static str = "block";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        record(&ctx).await?;
        // Deliberately blocking: the fault under test.
        std::thread::sleep(Duration::from_millis(self.ms));
        Ok(())
    }

    fn timeout() -> Option<Duration> {
        timeout()
    }

    fn retry_delay(_attempt: i32) -> Duration {
        retry_delay()
    }
}

/// Records its run and burns CPU until stopped, yielding every 5 ms so it can be.
#[derive(Serialize, Deserialize)]
struct Spin {}

impl Job for Spin {
    const KIND: &'static str = "spin";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        record(&ctx).await?;
        let mut x: u64 = 1;
        loop {
            let slice = Instant::now();
            while slice.elapsed() < Duration::from_millis(5) {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
            tokio::task::yield_now().await;
        }
    }

    fn timeout() -> Option<Duration> {
        timeout()
    }

    fn retry_delay(_attempt: i32) -> Duration {
        retry_delay()
    }
}

/// Records its run and panics.
#[derive(Serialize, Deserialize)]
struct Panic {}

impl Job for Panic {
    const KIND: &'static str = "panic";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        record(&ctx).await?;
        panic!("testbed panic on attempt {}", ctx.attempt());
    }

    fn retry_delay(_attempt: i32) -> Duration {
        retry_delay()
    }
}

/// Records its run and aborts the whole process.
#[derive(Serialize, Deserialize)]
struct Abort {}

impl Job for Abort {
    const KIND: &'static str = "abort";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        record(&ctx).await?;
        eprintln!("testbed: aborting the process (job {})", ctx.id());
        std::process::abort();
    }

    fn retry_delay(_attempt: i32) -> Duration {
        retry_delay()
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.worker_threads.max(1))
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let pid = std::process::id();
    let worker_id = args
        .worker_id
        .clone()
        .unwrap_or_else(|| format!("testbed-{pid}"));
    let _ = TIMEOUT.set(Duration::from_millis(args.timeout_ms));
    let _ = RETRY.set(Duration::from_millis(args.retry_ms));

    let options: PgConnectOptions = args
        .database_url
        .parse()
        .context("the database URL is malformed")?;
    let pool = PgPoolOptions::new()
        .max_connections(args.pool_size)
        .acquire_timeout(Duration::from_millis(args.acquire_timeout_ms))
        .connect_with(options.application_name(&worker_id))
        .await
        .context("cannot connect to the database")?;
    create_runs_table_retrying(&pool).await?;
    if args.prepare_only {
        return Ok(());
    }

    let mut builder = Worker::builder(pool)
        .worker_id(worker_id.clone())
        .data(Identity {
            worker_id: worker_id.clone(),
            pid: pid as i32,
        })
        .concurrency(args.concurrency)
        .poll_interval(Duration::from_millis(args.poll_ms))
        .heartbeat(
            Duration::from_millis(args.heartbeat_ms),
            Duration::from_millis(args.stale_ms),
        )
        .reap_interval(Duration::from_millis(args.reap_ms))
        .shutdown_grace(Duration::from_millis(args.shutdown_grace_ms))
        .exit_when_idle(args.exit_when_idle)
        .prune_interval(None);
    if let Some(prefetch) = args.prefetch {
        builder = builder.prefetch(prefetch);
    }
    if !args.queues.is_empty() {
        builder = builder.queues(args.queues.clone());
    }
    let mut registered = Vec::new();
    for kind in args.kinds {
        if registered.contains(&kind) {
            continue;
        }
        registered.push(kind);
        builder = match kind {
            Kind::Noop => builder.register::<Noop>(),
            Kind::Sleep => builder.register::<Sleep>(),
            Kind::Record => builder.register::<Record>(),
            Kind::NeverReturn => builder.register::<NeverReturn>(),
            Kind::Block => builder.register::<Block>(),
            Kind::Spin => builder.register::<Spin>(),
            Kind::Panic => builder.register::<Panic>(),
            Kind::Abort => builder.register::<Abort>(),
        };
    }
    let worker = builder.build().context("invalid worker settings")?;
    tokio::spawn(forward_signals(worker.shutdown_handle()));
    // Tests wait for this line; the clock lets them check a faked clock took effect.
    eprintln!(
        "testbed ready: worker_id={worker_id} pid={pid} local_clock={}",
        chrono::Utc::now().to_rfc3339()
    );
    let summary = worker.run().await.context("worker failed")?;
    eprintln!(
        "testbed done: {} claimed, {} succeeded, {} failed, {} released, {} lost",
        summary.claimed, summary.succeeded, summary.failed, summary.released, summary.lost
    );
    Ok(())
}

/// [`testbed_runs_create`], tried again (20 times, 100 ms apart) when it fails: fault tests
/// kill testbed connections at random, a starting testbed's included.
async fn create_runs_table_retrying(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    let mut tries = 0;
    loop {
        match testbed_runs_create(pool).await {
            Ok(()) => return Ok(()),
            Err(e) if tries < 20 => {
                tries += 1;
                eprintln!("testbed: creating testbed_runs failed ({e}); trying again");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e).context("cannot create public.testbed_runs"),
        }
    }
}

/// First SIGINT/SIGTERM: graceful shutdown. Second: release everything now.
async fn forward_signals(handle: ShutdownHandle) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut interrupt), Ok(mut terminate)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        eprintln!("testbed: cannot install signal handlers");
        return;
    };
    for round in 0..2 {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        if round == 0 {
            eprintln!("testbed: signal received, shutting down gracefully");
            handle.shutdown();
        } else {
            eprintln!("testbed: second signal, releasing everything now");
            handle.shutdown_now();
        }
    }
}
