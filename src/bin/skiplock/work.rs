//! `skiplock work`: a worker for the built-in kinds.

use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use skiplock::builtin::{Command, CommandConfig, Http, HttpConfig, Noop, Sleep};
use skiplock::worker::Retention;
use skiplock::{ShutdownHandle, Worker, WorkerConfig};

use crate::output::{parse_count, parse_duration};

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

impl Kind {
    /// The kind's name in `skiplock.jobs.kind`.
    fn name(self) -> &'static str {
        use skiplock::Job;
        match self {
            Kind::Noop => Noop::KIND,
            Kind::Sleep => Sleep::KIND,
            Kind::Http => Http::KIND,
            Kind::Command => Command::KIND,
        }
    }
}

#[derive(Args)]
pub struct WorkArgs {
    /// Queue to claim from; repeat for several (default: default). The environment
    /// variable takes a comma-separated list.
    #[arg(long = "queue", value_name = "Q", env = "SKIPLOCK_QUEUES", value_delimiter = ',', value_parser = crate::output::parse_queue_name)]
    queues: Vec<String>,

    /// Gives queue Q its own N job slots, beside --concurrency (repeat for several): a
    /// flood in another queue cannot take them, and Q never runs more than N at once.
    /// Q is claimed from whether or not --queue names it.
    #[arg(long = "queue-concurrency", value_name = "Q=N", value_parser = parse_queue_slots)]
    queue_concurrency: Vec<(String, usize)>,

    /// Weight W (1 to 1000; default 1) of queue Q among the queues sharing --concurrency
    /// (repeat for several): while they all have work, their running jobs follow their
    /// weights; a queue with nothing to do lends its share to the others.
    #[arg(long = "queue-weight", value_name = "Q=W", env = "SKIPLOCK_QUEUE_WEIGHTS", value_delimiter = ',', value_parser = parse_queue_weight)]
    queue_weights: Vec<(String, u32)>,

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
    /// an IPv6 address with a port as [::1]:8080. Without any, `http` jobs may reach every host.
    #[arg(long = "allow-http-host", value_name = "HOST")]
    allow_http_hosts: Vec<String>,

    /// Program `command` jobs may run, as the job writes it; repeat for several. `sh`
    /// allows `"shell": true` jobs, `*` allows anything. Without any, `command` jobs are
    /// refused.
    #[arg(long = "allow-command", value_name = "PROGRAM")]
    allow_commands: Vec<String>,

    /// Jobs run at once (across the queues without slots of their own).
    #[arg(
        long,
        env = "SKIPLOCK_CONCURRENCY",
        default_value_t = WorkerConfig::default().concurrency,
        allow_negative_numbers = true,
        value_parser = |text: &str| parse_count::<usize>(text, "job slots")
    )]
    concurrency: usize,

    /// Claimed jobs kept ready beside the running ones, fixed (default: follows the start
    /// rate, between --concurrency and 4000).
    #[arg(
        long,
        env = "SKIPLOCK_PREFETCH",
        value_name = "N",
        allow_negative_numbers = true,
        value_parser = |text: &str| parse_count::<usize>(text, "jobs to keep ready")
    )]
    prefetch: Option<usize>,

    /// How often the worker extends its claims [default: 2s].
    #[arg(long, env = "SKIPLOCK_HEARTBEAT", value_name = "DURATION", allow_hyphen_values = true, value_parser = parse_duration)]
    heartbeat: Option<Duration>,

    /// Heartbeat age after which any worker's reaper takes a claim back and the job runs
    /// again; more than twice --heartbeat [default: 30s].
    #[arg(long, env = "SKIPLOCK_STALE_AFTER", value_name = "DURATION", allow_hyphen_values = true, value_parser = parse_duration)]
    stale_after: Option<Duration>,

    /// How often the worker looks for jobs when no notification came [default: 1s].
    #[arg(long, env = "SKIPLOCK_POLL_INTERVAL", value_name = "DURATION", allow_hyphen_values = true, value_parser = parse_duration)]
    poll_interval: Option<Duration>,

    /// How often this worker deletes finished jobs past their retention; 0s leaves pruning
    /// to other workers [default: 30s].
    #[arg(long, env = "SKIPLOCK_PRUNE_INTERVAL", value_name = "DURATION", allow_hyphen_values = true, value_parser = parse_duration)]
    prune_interval: Option<Duration>,

    /// How long `succeeded` jobs are kept [default: 1d].
    #[arg(long, env = "SKIPLOCK_RETAIN_SUCCEEDED", value_name = "DURATION", allow_hyphen_values = true, value_parser = parse_duration)]
    retain_succeeded: Option<Duration>,

    /// How long `cancelled` jobs are kept [default: 1d].
    #[arg(long, env = "SKIPLOCK_RETAIN_CANCELLED", value_name = "DURATION", allow_hyphen_values = true, value_parser = parse_duration)]
    retain_cancelled: Option<Duration>,

    /// How long `dead` jobs are kept [default: 14d].
    #[arg(long, env = "SKIPLOCK_RETAIN_DEAD", value_name = "DURATION", allow_hyphen_values = true, value_parser = parse_duration)]
    retain_dead: Option<Duration>,

    /// Exit (status 0) once no job of this worker's kinds and queues is runnable or running
    /// (a paused queue's jobs are not waited for), saying what is left behind.
    #[arg(long)]
    exit_when_idle: bool,

    /// Postgres URL for the worker's LISTEN session, which wakes it when jobs arrive: a
    /// direct connection (not through PgBouncer in transaction mode, where LISTEN cannot
    /// work). Default: the database URL, or none with --pgbouncer (the worker then polls
    /// every --poll-interval and sees cancellations at its next heartbeat).
    #[arg(
        long,
        env = "SKIPLOCK_LISTEN_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    listen_url: Option<String>,

    /// Seconds a graceful shutdown waits for running jobs before releasing them.
    #[arg(long, env = "SKIPLOCK_SHUTDOWN_GRACE", value_name = "SECONDS", allow_hyphen_values = true, default_value_t = WorkerConfig::default().shutdown_grace.as_secs(), value_parser = parse_seconds)]
    shutdown_grace: u64,

    /// Most pooled connections this worker opens (default: 4 plus one per 4 job slots, at
    /// most 32). The worker holds two sessions more: its LISTEN connection and its
    /// heartbeat's. Idle pooled connections are closed after 30 s.
    #[arg(
        long,
        env = "SKIPLOCK_MAX_CONNECTIONS",
        value_name = "N",
        allow_negative_numbers = true,
        value_parser = |text: &str| parse_count::<u32>(text, "connections")
    )]
    max_connections: Option<u32>,

    /// Serve this worker's metrics as Prometheus text on ADDR (e.g. 127.0.0.1:9464; any
    /// path). The series are listed in docs/metrics.md.
    #[arg(long, env = "SKIPLOCK_METRICS_ADDR", value_name = "ADDR", value_parser = parse_listen_addr)]
    metrics_addr: Option<std::net::SocketAddr>,
}

/// Parses `Q=N` (`--queue-concurrency`).
fn parse_queue_slots(text: &str) -> Result<(String, usize), String> {
    parse_queue_number(
        text,
        "QUEUE=SLOTS, like mail=4",
        "a number of slots (1 or more)",
        1..=usize::MAX,
    )
}

/// Parses a whole number of seconds (`--shutdown-grace`).
fn parse_seconds(text: &str) -> Result<u64, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a number of seconds; write a whole number, like 30"))
}

/// Parses the address to serve metrics on (`--metrics-addr`).
fn parse_listen_addr(text: &str) -> Result<std::net::SocketAddr, String> {
    text.trim().parse().map_err(|_| {
        format!("`{text}` is not an address to listen on; write IP:PORT, like 127.0.0.1:9464")
    })
}

/// Parses `Q=W` (`--queue-weight`).
fn parse_queue_weight(text: &str) -> Result<(String, u32), String> {
    parse_queue_number(
        text,
        "QUEUE=WEIGHT, like mail=3",
        "a weight (1 to 1000)",
        1..=skiplock::worker::QUEUE_WEIGHT_MAX,
    )
}

/// Parses `QUEUE=NUMBER` with the number in `range`.
fn parse_queue_number<N>(
    text: &str,
    form: &str,
    what: &str,
    range: std::ops::RangeInclusive<N>,
) -> Result<(String, N), String>
where
    N: std::str::FromStr + PartialOrd,
{
    let (queue, number) = text
        .split_once('=')
        .ok_or_else(|| format!("`{text}` has no `=`; write {form}"))?;
    let queue = crate::output::parse_queue_name(queue)?;
    let number = number
        .trim()
        .parse::<N>()
        .ok()
        .filter(|n| range.contains(n))
        .ok_or_else(|| format!("`{number}` is not {what}; write {form}"))?;
    Ok((queue, number))
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

pub async fn run(pool: skiplock::unstable_cli::DbPool, args: WorkArgs) -> anyhow::Result<()> {
    if let Some(addr) = args.metrics_addr {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .with_context(|| format!("cannot serve metrics on {addr}"))?;
        tracing::info!(%addr, "serving metrics (Prometheus text)");
    }
    let mut builder = Worker::builder(pool.pool().clone())
        .pgbouncer(pool.is_pgbouncer())
        .concurrency(args.concurrency)
        .exit_when_idle(args.exit_when_idle)
        .shutdown_grace(Duration::from_secs(args.shutdown_grace));
    if !args.kinds.contains(&Kind::Command) && !args.allow_commands.is_empty() {
        crate::usage_error(
            &["work"],
            "--allow-command needs the `command` kind; add it to --kinds",
        );
    }
    if !args.kinds.contains(&Kind::Http) && !args.allow_http_hosts.is_empty() {
        crate::usage_error(
            &["work"],
            "--allow-http-host needs the `http` kind; add it to --kinds",
        );
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
                builder.register::<Http>().data(config.unwrap_or_else(|e| {
                    crate::usage_error(&["work"], format!("invalid --allow-http-host: {e}"))
                }))
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
    // The queues it claims from: --queue's (or the default) and those with slots of their own.
    let defaults = WorkerConfig::default();
    let mut queues = if args.queues.is_empty() {
        defaults.queues.clone()
    } else {
        args.queues.clone()
    };
    queues.extend(args.queue_concurrency.iter().map(|(q, _)| q.clone()));
    if !args.queues.is_empty() {
        builder = builder.queues(args.queues);
    }
    for (queue, slots) in args.queue_concurrency {
        builder = builder.queue_concurrency(queue, slots);
    }
    for (queue, weight) in args.queue_weights {
        builder = builder.queue_weight(queue, weight);
    }
    if let Some(prefetch) = args.prefetch {
        builder = builder.prefetch(prefetch);
    }
    if let Some(url) = &args.listen_url {
        let options: sqlx::postgres::PgConnectOptions = url
            .parse()
            .context("--listen-url is malformed; expected postgres://user@host:port/db")?;
        builder = builder.listen_options(options.application_name("skiplock work (listen)"));
    }
    let retention = defaults.retention;
    builder = builder
        .heartbeat(
            args.heartbeat.unwrap_or(defaults.heartbeat_interval),
            args.stale_after.unwrap_or(defaults.stale_after),
        )
        .poll_interval(args.poll_interval.unwrap_or(defaults.poll_interval))
        .retention(Retention {
            succeeded: args.retain_succeeded.unwrap_or(retention.succeeded),
            cancelled: args.retain_cancelled.unwrap_or(retention.cancelled),
            dead: args.retain_dead.unwrap_or(retention.dead),
        });
    if let Some(interval) = args.prune_interval {
        builder = builder.prune_interval((!interval.is_zero()).then_some(interval));
    }
    let worker = match builder.build() {
        Ok(worker) => worker,
        Err(skiplock::Error::Config(why)) => {
            crate::usage_error(&["work"], format!("invalid worker settings: {why}"))
        }
        Err(e) => return Err(e).context("invalid worker settings"),
    };
    tokio::spawn(forward_signals(worker.shutdown_handle()));
    let summary = worker.run().await.context("worker failed")?;
    eprintln!(
        "worker done: {} claimed, {} succeeded, {} failed, {} snoozed, {} released, {} lost",
        summary.claimed,
        summary.succeeded,
        summary.failed,
        summary.snoozed,
        summary.released,
        summary.lost
    );
    if args.exit_when_idle {
        let kinds: Vec<&str> = kinds.iter().map(|kind| kind.name()).collect();
        match left_to_others(&pool, &queues, &kinds).await {
            Ok(Some(line)) => eprintln!("{line}"),
            Ok(None) => {}
            Err(e) => tracing::warn!(
                "cannot count the jobs left to other workers: {}",
                crate::message(&e.into())
            ),
        }
    }
    Ok(())
}

/// The line a worker that exits when idle leaves behind when its queues still hold
/// runnable jobs of kinds it does not run (a kind of the application's, or one left out of
/// --kinds): "idle" meant idle for this worker only. `None` when there are none.
async fn left_to_others(
    pool: &skiplock::unstable_cli::DbPool,
    queues: &[String],
    kinds: &[&str],
) -> skiplock::Result<Option<String>> {
    let stats = skiplock::stats::stats(pool).await?;
    let mut left: std::collections::BTreeMap<&str, i64> = std::collections::BTreeMap::new();
    for row in &stats.rows {
        if row.counts.runnable > 0
            && queues.contains(&row.queue)
            && !kinds.contains(&row.kind.as_str())
        {
            *left.entry(row.kind.as_str()).or_default() += row.counts.runnable;
        }
    }
    if left.is_empty() {
        return Ok(None);
    }
    let total: i64 = left.values().sum();
    let each: Vec<String> = left
        .iter()
        .map(|(kind, count)| format!("{kind} {count}"))
        .collect();
    let jobs = if total == 1 { "job" } else { "jobs" };
    Ok(Some(format!(
        "left to other workers: {total} runnable {jobs} of kinds this worker does not run: {}",
        each.join(", ")
    )))
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
