//! The `skiplock` command: a thin layer of argument parsing over the library.
//!
//! Exit codes: 0 success, 1 failure (the message on stderr says what and what to do),
//! 2 usage error (clap's message and usage).

/// `println!` for the command's output: a reader that went away (`skiplock jobs | head`)
/// ends the command quietly instead of panicking (see [`output::write_stdout`]).
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` for the command's output; see [`outln!`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!($($arg)*))
    };
}

mod cancel;
mod connect;
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
mod wait;
mod work;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};

use connect::{Database, Patience};

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

    /// How long a command keeps trying when the server refuses a connection for a reason
    /// that may pass (too many clients, starting up) or does not answer, e.g. 30s or 0s.
    /// `work` (without --exit-when-idle) and `dashboard` keep trying until stopped.
    #[arg(
        long,
        env = "SKIPLOCK_CONNECT_RETRY",
        global = true,
        value_name = "DURATION",
        default_value = "10s",
        allow_hyphen_values = true,
        value_parser = output::parse_duration
    )]
    connect_retry: std::time::Duration,

    /// Largest job args this command's sessions accept, in bytes (measured as Postgres
    /// prints jsonb), for the jobs it writes: enqueue, cron, and what a worker's handlers
    /// enqueue. Sets the session setting skiplock.args_max_bytes; at least 4096 (the
    /// database checks only args over 4 KiB). Default: the database's (1 MiB unless ALTER
    /// DATABASE … SET skiplock.args_max_bytes). Behind PgBouncer, set it per database or
    /// role instead.
    #[arg(
        long,
        env = "SKIPLOCK_ARGS_MAX_BYTES",
        global = true,
        value_name = "BYTES",
        allow_hyphen_values = true,
        value_parser = output::parse_args_max_bytes
    )]
    args_max_bytes: Option<u64>,

    /// The database URL goes through PgBouncer in transaction-pooling mode: each
    /// statement runs in a transaction of its own, unnamed, so PgBouncer keeps it on one
    /// server connection. `work` then LISTENs on --listen-url or polls. Not needed for
    /// session pooling. SKIPLOCK_PGBOUNCER=1 (or true) sets it too.
    #[arg(
        long,
        env = "SKIPLOCK_PGBOUNCER",
        global = true,
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::SetTrue
    )]
    pgbouncer: bool,

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
    /// Wait until jobs have finished and print their outcomes (exit 0: all succeeded).
    #[command(after_help = wait::EXAMPLES)]
    Wait(wait::WaitArgs),
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
    Demo(demo::DemoArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo narrates on stdout; its logs would only interleave with the story.
    let default_level = match cli.command {
        // The demo fails some jobs on purpose and says so itself.
        Command::Demo(_) => "warn,sqlx=error,skiplock::worker::executor=off",
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
        // The reader of our output went away (`| head`): nothing is wrong.
        Err(e) if output::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}{}", message(&e), hint(&e));
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let db = Database {
        url: cli.database_url,
        connect_retry: cli.connect_retry,
        args_max_bytes: cli.args_max_bytes,
        pgbouncer: cli.pgbouncer,
    };
    // `migrate` makes the schema, the demo uses a database of its own, and the dashboard
    // shows its errors on its pages.
    let needs_schema = !matches!(
        cli.command,
        Command::Migrate | Command::Demo(_) | Command::Dashboard(_)
    );
    match run_command(&db, cli.command).await {
        Err(error) if needs_schema && lacks_schema(&error) => Err(db.explain_schema(error).await),
        result => result,
    }
}

/// Whether `error` says that a skiplock table, function or schema is missing, or that the
/// schema is older than this build: a database that `skiplock migrate` would fix.
fn lacks_schema(error: &anyhow::Error) -> bool {
    // An older schema's message says so already; version 0 is no schema at all.
    let never_migrated = error.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<skiplock::Error>(),
            Some(skiplock::Error::SchemaOutdated { found: 0, .. })
        )
    });
    // undefined_table, undefined_function, invalid_schema_name
    never_migrated
        || matches!(
            sqlstate(error).as_deref(),
            Some("42P01" | "42883" | "3F000")
        )
}

/// Whether `error` is about the database rather than the one job a command was acting on
/// (a missing schema, a missing privilege), so that going on with the next job is futile.
fn about_the_database(error: &anyhow::Error) -> bool {
    lacks_schema(error) || sqlstate(error).as_deref() == Some("42501")
}

/// The SQLSTATE of the first database error in `error`'s chain.
fn sqlstate(error: &anyhow::Error) -> Option<String> {
    error.chain().find_map(|cause| {
        let db = match cause.downcast_ref::<skiplock::Error>() {
            Some(skiplock::Error::Database(sqlx::Error::Database(db))) => db,
            _ => match cause.downcast_ref::<sqlx::Error>() {
                Some(sqlx::Error::Database(db)) => db,
                _ => return None,
            },
        };
        db.code().map(|c| c.into_owned())
    })
}

async fn run_command(db: &Database, command: Command) -> anyhow::Result<()> {
    // One-shot commands need no more than one session (statements that could run side by
    // side take turns), so they still work on a server with one slot left.
    let one_shot = |command: &'static str| db.pool(command, 1, Patience::OneShot);
    match command {
        Command::Migrate => migrate::run(&one_shot("migrate").await?).await,
        Command::Work(args) => {
            // A worker that drains and exits is a one-shot command too.
            let patience = if args.exits_when_idle() {
                Patience::OneShot
            } else {
                Patience::UntilStopped
            };
            let pool = db.pool("work", args.pool_size(), patience).await?;
            work::run(pool, args).await
        }
        Command::Enqueue(args) => {
            args.check();
            enqueue::run(&one_shot("enqueue").await?, args).await
        }
        Command::Jobs(args) => jobs::run(&one_shot("jobs").await?, args).await,
        Command::Show(args) => show::run(&one_shot("show").await?, args).await,
        Command::Retry(args) => retry::run(&one_shot("retry").await?, args).await,
        Command::Cancel(args) => cancel::run(&one_shot("cancel").await?, args).await,
        Command::Wait(args) => wait::run(&one_shot("wait").await?, args).await,
        Command::Stats(args) => stats::run(&one_shot("stats").await?, args).await,
        Command::Prune(args) => prune::run(&one_shot("prune").await?, args).await,
        Command::Dashboard(args) => dashboard::run(db, args).await,
        Command::Cron(args) => cron::run(&one_shot("cron").await?, args).await,
        Command::Queue(args) => queue::run(&one_shot("queue").await?, args).await,
        Command::Demo(args) => demo::run(db, args).await,
    }
}

/// The error and its causes on one line, leaving out causes whose text the line already
/// holds (library errors often repeat their source's message).
fn message(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        let text = without_server_source_line(&text);
        // sqlx and skiplock::Error::Database wrap the server's message, which says well
        // enough that it comes from the database.
        let text = text
            .strip_prefix("error returned from database: ")
            .or_else(|| text.strip_prefix("database error: "))
            .unwrap_or(text)
            .to_owned();
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

/// `text` without the " at line N" that sqlx appends to a Postgres error: N is a line of
/// the server's C source, not of anything the user wrote.
fn without_server_source_line(text: &str) -> &str {
    match text.rfind(" at line ") {
        Some(at) if text.len() > at + 9 && text[at + 9..].chars().all(|c| c.is_ascii_digit()) => {
            &text[..at]
        }
        _ => text,
    }
}

/// Exits with status 2 and clap's usage message of the subcommand `path` names (like
/// `["cron", "add"]`), for argument values and combinations clap's declarations cannot
/// check: the usage shown is the one of the command the user typed.
pub fn usage_error(path: &[&str], message: impl std::fmt::Display) -> ! {
    let mut command = Cli::command();
    // Built, the subcommands know their full names ("skiplock cron add") for the usage.
    command.build();
    let mut at = &mut command;
    for name in path {
        at = at
            .find_subcommand_mut(name)
            .unwrap_or_else(|| panic!("`{name}` is not a subcommand of `{path:?}`"));
    }
    at.error(clap::error::ErrorKind::ValueValidation, message)
        .exit()
}

/// What to do about errors that mean "this database has no (current) skiplock schema".
fn hint(error: &anyhow::Error) -> &'static str {
    let code = sqlstate(error);
    let pool_timed_out = error.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<skiplock::Error>(),
            Some(skiplock::Error::Database(sqlx::Error::PoolTimedOut))
        ) || matches!(
            cause.downcast_ref::<sqlx::Error>(),
            Some(sqlx::Error::PoolTimedOut)
        )
    });
    if pool_timed_out {
        return "; no connection could be opened in time: the server may be at its connection \
                limit (see `skiplock work --max-connections`) or unreachable";
    }
    match code.as_deref() {
        // undefined_table, undefined_function, invalid_schema_name
        Some("42P01" | "42883" | "3F000") => {
            "; is the skiplock schema missing or old? run `skiplock migrate`"
        }
        // read_only_sql_transaction: a hot standby (or a database made read-only) refused
        // the write.
        Some("25006") => {
            "; the server is read-only: a hot standby (or default_transaction_read_only is on); point --database-url / DATABASE_URL at the primary, or run it again once the failover has promoted a new primary"
        }
        // insufficient_privilege
        Some("42501") => {
            "; the role in --database-url / DATABASE_URL may not do this: connect as one that may (such as the one that ran `skiplock migrate`), or GRANT it the privilege"
        }
        _ => "",
    }
}

/// Logs to stderr in `format`, at the level RUST_LOG names or else `default_level`.
fn init_logging(format: LogFormat, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    // No colour codes where nobody reads them as colour (a file, a pipe, a log collector).
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
