//! The `skiplock` command: a thin layer of argument parsing over the library.

mod demo;
mod migrate;
mod work;

use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Postgres-backed job queue: enqueue in your transaction, run workers anywhere.
#[derive(Parser)]
#[command(name = "skiplock", version, about, propagate_version = true)]
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
    ///
    /// Example: skiplock migrate --database-url postgres://postgres@127.0.0.1/app
    Migrate,
    /// Run a worker: claim jobs of the built-in kinds and run them until stopped.
    ///
    /// SIGINT/SIGTERM stops claiming and lets running jobs finish within the grace period;
    /// a second signal releases everything at once.
    ///
    /// Example: skiplock work --queue default --queue mail --concurrency 64
    Work(work::WorkArgs),
    /// Show skiplock on a throwaway or given database: enqueue jobs, run them, show their states.
    ///
    /// Without DATABASE_URL it uses the local server (database `skiplock_demo`) or, if none
    /// answers on 127.0.0.1:5432, starts a temporary one from the installed Postgres binaries.
    ///
    /// Example: skiplock demo
    Demo,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Migrate => {
            let pool = connect(cli.database_url.as_deref(), 2).await?;
            migrate::run(&pool).await
        }
        Command::Work(args) => {
            let connections = args.pool_size();
            let pool = connect(cli.database_url.as_deref(), connections).await?;
            work::run(pool, args).await
        }
        Command::Demo => demo::run(cli.database_url.as_deref()).await,
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Connects a pool to the given URL, or to the local server when none is given.
async fn connect(url: Option<&str>, max_connections: u32) -> anyhow::Result<sqlx::PgPool> {
    let url = url.unwrap_or(skiplock::embedded::LOCAL_URL);
    let options: PgConnectOptions = url
        .parse()
        .with_context(|| "the database URL is malformed; expected postgres://user@host:port/db")?;
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .connect_with(options)
        .await
        .with_context(|| {
            format!(
                "cannot connect to the database at {}; check --database-url / DATABASE_URL and that Postgres is running",
                redact(url)
            )
        })
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
