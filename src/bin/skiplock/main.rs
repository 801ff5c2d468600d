//! The `skiplock` command: a thin layer of argument parsing over the library.
//!
//! Exit codes: 0 success, 1 failure (the message on stderr says what and what to do),
//! 2 usage error (clap's message and usage).

mod cancel;
mod cron;
mod dashboard;
mod demo;
mod enqueue;
mod jobs;
mod migrate;
mod output;
mod prune;
mod queue;
mod retry;
mod show;
mod stats;
mod work;

use std::process::ExitCode;

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};

/// How long connecting to the database may take before the command gives up.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Postgres-backed job queue: enqueue in your transaction, run workers anywhere.
#[derive(Parser)]
#[command(
    name = "skiplock",
    version,
    about,
    propagate_version = true,
    after_help = "Exit codes: 0 success, 1 failure, 2 usage error.\n\n\
                  Example: skiplock --database-url postgres://postgres@127.0.0.1/app jobs --state dead"
)]
struct Cli {
    /// Postgres URL, e.g. postgres://user@host:5432/db (default: local server on 127.0.0.1:5432).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,

    /// Log format on stderr. Verbosity follows RUST_LOG (default: info).
    #[arg(long, value_enum, default_value_t = LogFormat::Human, global = true)]
    log_format: LogFormat,

    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Create or upgrade the skiplock schema (idempotent).
    #[command(
        after_help = "Example:\n  skiplock migrate --database-url postgres://postgres@127.0.0.1/app"
    )]
    Migrate,
    /// Run a worker: claim jobs of the built-in kinds and run them until stopped.
    ///
    /// Built-in kinds: noop, sleep ({"ms": N}), http (one HTTP request) and command (runs
    /// a program; refused unless --allow-command names it). SIGINT/SIGTERM stops claiming
    /// and lets running jobs finish within the grace period; a second signal releases
    /// everything at once.
    #[command(after_help = work::EXAMPLES)]
    Work(work::WorkArgs),
    /// Enqueue one job, or many from an NDJSON file.
    #[command(after_help = enqueue::EXAMPLES)]
    Enqueue(enqueue::EnqueueArgs),
    /// List jobs, newest first, optionally filtered by state, queue and kind.
    #[command(after_help = jobs::EXAMPLES)]
    Jobs(jobs::JobsArgs),
    /// Show everything about one job: args, state, attempts, errors, output, dependencies.
    #[command(after_help = show::EXAMPLES)]
    Show(show::ShowArgs),
    /// Put jobs back in line to run now: the given ids, or every dead job (of a queue).
    #[command(after_help = retry::EXAMPLES)]
    Retry(retry::RetryArgs),
    /// Cancel jobs that have not finished; a running job's handler is stopped.
    #[command(after_help = cancel::EXAMPLES)]
    Cancel(cancel::CancelArgs),
    /// Per queue and kind: runnable, scheduled, running, succeeded and dead in the last hour,
    /// lag and jobs per second.
    #[command(after_help = stats::EXAMPLES)]
    Stats(stats::StatsArgs),
    /// Delete finished jobs (succeeded, cancelled, dead) now.
    #[command(after_help = prune::EXAMPLES)]
    Prune(prune::PruneArgs),
    /// Serve the web dashboard: queues, jobs, history, actions, JSON stats and /metrics.
    ///
    /// Listens on 127.0.0.1 unless told otherwise; any other address needs --token or
    /// --basic-auth.
    #[command(after_help = dashboard::EXAMPLES)]
    Dashboard(dashboard::DashboardArgs),
    /// Define, list and remove cron schedules (one job per slot, however many workers run).
    #[command(after_help = cron::EXAMPLES)]
    Cron(cron::CronArgs),
    /// Pause or resume a queue: paused queues claim nothing; running jobs finish.
    #[command(after_help = queue::EXAMPLES)]
    Queue(queue::QueueArgs),
    /// Show skiplock on a throwaway or given database: enqueue jobs, run them, show their states.
    ///
    /// Without DATABASE_URL it uses the local server (database `skiplock_demo`) or, if none
    /// answers on 127.0.0.1:5432, starts a temporary one from the installed Postgres binaries.
    #[command(after_help = "Example:\n  skiplock demo")]
    Demo,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo narrates on stdout; its logs would only interleave with the story.
    let default_level = match cli.command {
        Command::Demo => "warn,sqlx=error",
        _ => "info,sqlx=warn",
    };
    init_logging(cli.log_format, default_level);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<output::Reported>().is_some() => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {}{}", message(&e), hint(&e));
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let url = cli.database_url.as_deref();
    match cli.command {
        Command::Migrate => migrate::run(&connect(url, 2).await?).await,
        Command::Work(args) => {
            let pool = connect(url, args.pool_size()).await?;
            work::run(pool, args).await
        }
        Command::Enqueue(args) => enqueue::run(&connect(url, 2).await?, args).await,
        Command::Jobs(args) => jobs::run(&connect(url, 2).await?, args).await,
        Command::Show(args) => show::run(&connect(url, 2).await?, args).await,
        Command::Retry(args) => retry::run(&connect(url, 2).await?, args).await,
        Command::Cancel(args) => cancel::run(&connect(url, 2).await?, args).await,
        Command::Stats(args) => stats::run(&connect(url, 2).await?, args).await,
        Command::Prune(args) => prune::run(&connect(url, 2).await?, args).await,
        Command::Dashboard(args) => dashboard::run(url, args).await,
        Command::Cron(args) => cron::run(&connect(url, 2).await?, args).await,
        Command::Queue(args) => queue::run(&connect(url, 2).await?, args).await,
        Command::Demo => demo::run(url).await,
    }
}

/// The error and its causes on one line, leaving out causes whose text the line already
/// holds (library errors often repeat their source's message).
fn message(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Exits with status 2 and clap's usage message, for argument combinations clap's
/// declarations cannot express.
pub fn usage_error(message: impl std::fmt::Display) -> ! {
    Cli::command()
        .error(clap::error::ErrorKind::ArgumentConflict, message)
        .exit()
}

/// What to do about errors that mean "this database has no (current) skiplock schema".
fn hint(error: &anyhow::Error) -> &'static str {
    let code = error.chain().find_map(|cause| {
        let db = match cause.downcast_ref::<skiplock::Error>() {
            Some(skiplock::Error::Database(sqlx::Error::Database(db))) => db,
            _ => match cause.downcast_ref::<sqlx::Error>() {
                Some(sqlx::Error::Database(db)) => db,
                _ => return None,
            },
        };
        db.code().map(|c| c.into_owned())
    });
    match code.as_deref() {
        // undefined_table, undefined_function, invalid_schema_name
        Some("42P01" | "42883" | "3F000") => {
            "; is the skiplock schema missing or old? run `skiplock migrate`"
        }
        _ => "",
    }
}

/// Logs to stderr in `format`, at the level RUST_LOG names or else `default_level`.
fn init_logging(format: LogFormat, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Connects a pool to the given URL, or to the local server when none is given.
///
/// One connection is opened first, on its own, so that a refused connection or a bad
/// password is reported at once with its own message instead of as a pool timeout.
async fn connect(url: Option<&str>, max_connections: u32) -> anyhow::Result<sqlx::PgPool> {
    let url = url.unwrap_or(skiplock::embedded::LOCAL_URL);
    let options: PgConnectOptions = url
        .parse()
        .with_context(|| "the database URL is malformed; expected postgres://user@host:port/db")?;
    let unreachable = || {
        format!(
            "cannot connect to the database at {}; check --database-url / DATABASE_URL and that Postgres is running",
            redact(url)
        )
    };
    let first = tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options))
        .await
        .map_err(|_| anyhow::anyhow!("no answer within {CONNECT_TIMEOUT:?}"))
        .with_context(unreachable)?;
    let first = match first {
        Ok(connection) => connection,
        // The server answered, but the database is not there: say so, not "is it running?".
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("3D000") => {
            let name = options.get_database().unwrap_or("postgres");
            anyhow::bail!(
                "the database `{name}` does not exist on the server at {}; create it (createdb {name}) and run `skiplock migrate`",
                redact(url)
            );
        }
        Err(e) => return Err(e).with_context(unreachable),
    };
    let _ = first.close().await;
    Ok(PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_lazy_with(options))
}

/// The URL without its password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &url[scheme + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}
