//! `skiplock work`: a worker for the built-in kinds.

use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use skiplock::builtin::{Command, CommandConfig, Http, HttpConfig, Noop, Sleep};
use skiplock::{ShutdownHandle, Worker};

pub const EXAMPLES: &str = "\
Examples:
  skiplock work --queue default --queue mail --concurrency 64
  skiplock work --kinds http --allow-http-host hooks.example.com --allow-http-host '*.internal'
  skiplock work --kinds command --allow-command pg_dump --allow-command /usr/local/bin/resize
  skiplock work --exit-when-idle        # drain what is runnable now, then exit 0

A worker started without --allow-command refuses `command` jobs: each goes `dead` with a
message saying so. Run such workers with --kinds noop,sleep,http in a fleet where other
workers are allowed to run commands.";

/// A built-in kind `work` can run.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Kind {
    Noop,
    Sleep,
    Http,
    Command,
}

#[derive(Args)]
pub struct WorkArgs {
    /// Queue to claim from; repeat for several (default: default).
    #[arg(long = "queue", value_name = "Q")]
    queues: Vec<String>,

    /// Kinds to run, comma-separated (default: all built-in kinds).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        value_name = "KINDS",
        default_value = "noop,sleep,http,command"
    )]
    kinds: Vec<Kind>,

    /// Host `http` jobs may reach; repeat for several. Forms: host, host:port, *.domain,
    /// [ipv6]:port. Without any, `http` jobs may reach every host.
    #[arg(long = "allow-http-host", value_name = "HOST")]
    allow_http_hosts: Vec<String>,

    /// Program `command` jobs may run, as the job writes it; repeat for several. `sh`
    /// allows `"shell": true` jobs, `*` allows anything. Without any, `command` jobs are
    /// refused.
    #[arg(long = "allow-command", value_name = "PROGRAM")]
    allow_commands: Vec<String>,

    /// Jobs run at once.
    #[arg(long, default_value_t = skiplock::worker::CONCURRENCY_DEFAULT)]
    concurrency: usize,

    /// Exit (status 0) once no job of this worker's kinds and queues is runnable or running.
    #[arg(long)]
    exit_when_idle: bool,

    /// Seconds a graceful shutdown waits for running jobs before releasing them.
    #[arg(long, value_name = "SECONDS", default_value_t = skiplock::worker::SHUTDOWN_GRACE_DEFAULT.as_secs())]
    shutdown_grace: u64,

    /// Most pooled connections this worker opens (default: 4 plus one per 4 job slots, at
    /// most 32). The worker holds two sessions more: its LISTEN connection and its
    /// heartbeat's. Idle pooled connections are closed after 30 s.
    #[arg(
        long,
        env = "SKIPLOCK_MAX_CONNECTIONS",
        value_name = "N",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    max_connections: Option<u32>,

    /// Serve this worker's metrics as Prometheus text on ADDR (e.g. 127.0.0.1:9464; any
    /// path). The series are listed in docs/metrics.md.
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
}

impl WorkArgs {
    /// Whether the worker drains and exits rather than runs until stopped.
    pub fn exits_when_idle(&self) -> bool {
        self.exit_when_idle
    }

    /// Pooled connections the worker may open: `--max-connections`, or 4 for claims (two
    /// in flight), completions and maintenance, plus one per 4 job slots for handlers
    /// that record their output (`http`, `command`: one short UPDATE each), at most 32.
    /// The listener and the heartbeat have a connection each outside the pool.
    pub fn pool_size(&self) -> u32 {
        self.max_connections.unwrap_or_else(|| {
            let slots = u32::try_from(self.concurrency).unwrap_or(u32::MAX);
            4u32.saturating_add(slots.div_ceil(4)).min(32)
        })
    }
}

pub async fn run(pool: sqlx::PgPool, args: WorkArgs) -> anyhow::Result<()> {
    if let Some(addr) = args.metrics_addr {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .with_context(|| format!("cannot serve metrics on {addr}"))?;
        tracing::info!(%addr, "serving metrics (Prometheus text)");
    }
    let mut builder = Worker::builder(pool)
        .concurrency(args.concurrency)
        .exit_when_idle(args.exit_when_idle)
        .shutdown_grace(Duration::from_secs(args.shutdown_grace));
    if !args.kinds.contains(&Kind::Command) && !args.allow_commands.is_empty() {
        crate::usage_error("--allow-command needs the `command` kind; add it to --kinds");
    }
    if !args.kinds.contains(&Kind::Http) && !args.allow_http_hosts.is_empty() {
        crate::usage_error("--allow-http-host needs the `http` kind; add it to --kinds");
    }
    let mut kinds: Vec<Kind> = Vec::new();
    for kind in &args.kinds {
        if !kinds.contains(kind) {
            kinds.push(*kind);
        }
    }
    for kind in &kinds {
        builder = match kind {
            Kind::Noop => builder.register::<Noop>(),
            Kind::Sleep => builder.register::<Sleep>(),
            Kind::Http => {
                let config = if args.allow_http_hosts.is_empty() {
                    HttpConfig::any_host()
                } else {
                    HttpConfig::allow_hosts(&args.allow_http_hosts)
                };
                builder
                    .register::<Http>()
                    .data(config.context("invalid --allow-http-host")?)
            }
            Kind::Command => {
                if args.allow_commands.is_empty() {
                    tracing::warn!(
                        "no --allow-command given: this worker refuses `command` jobs (each goes \
                         `dead` saying so); pass --allow-command PROGRAM to run them, or \
                         --kinds without `command` to leave them to other workers"
                    );
                    builder.register::<Command>()
                } else {
                    builder
                        .register::<Command>()
                        .data(CommandConfig::allow_programs(args.allow_commands.clone()))
                }
            }
        };
    }
    if !args.queues.is_empty() {
        builder = builder.queues(args.queues);
    }
    let worker = builder.build().context("invalid worker settings")?;
    tokio::spawn(forward_signals(worker.shutdown_handle()));
    let summary = worker.run().await.context("worker failed")?;
    eprintln!(
        "worker done: {} claimed, {} succeeded, {} failed, {} released",
        summary.claimed, summary.succeeded, summary.failed, summary.released
    );
    Ok(())
}

/// First SIGINT/SIGTERM: graceful shutdown. Second: release everything now.
async fn forward_signals(handle: ShutdownHandle) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut interrupt), Ok(mut terminate)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        tracing::error!("cannot install signal handlers; stop the worker with SIGKILL");
        return;
    };
    for round in 0..2 {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        if round == 0 {
            tracing::info!("signal received: finishing running jobs (signal again to stop now)");
            handle.shutdown();
        } else {
            tracing::warn!("second signal: releasing all jobs now");
            handle.shutdown_now();
        }
    }
}
