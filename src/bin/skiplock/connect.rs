//! Connecting to the database: the pool every command uses, and what to do when the
//! server refuses or does not answer.
//!
//! A refusal that may pass (too many clients, the server starting up or shutting down,
//! nothing answering yet) is retried with backoff, each retry logged with its cause:
//! one-shot commands (and `work --exit-when-idle`) for `--connect-retry` (10 s by
//! default), `work` and `dashboard` until stopped. A refusal that will not pass (a bad
//! password, a missing database) fails at once, and so does a host name that does not
//! resolve, except for `work` and `dashboard`, which wait for it. The final message quotes the server when it answered and says what to do; only
//! when nothing answered does it suggest that Postgres may not be running.

use std::time::{Duration, Instant};

use skiplock::unstable_cli::DbPool;
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};

/// How long one connection attempt may take before it counts as unanswered.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a pool connection may sit idle before the pool closes it: a quiet worker or
/// dashboard gives its sessions back to the server.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// First delay between connection attempts; it doubles up to [`RETRY_DELAY_MAX`].
const RETRY_DELAY_FIRST: Duration = Duration::from_millis(250);
const RETRY_DELAY_MAX: Duration = Duration::from_secs(5);

/// Where and how patiently to connect, from the global options.
pub struct Database {
    /// The URL given, or `None` for the local server.
    pub url: Option<String>,
    /// How long one-shot commands retry a refused or unanswered connection.
    pub connect_retry: Duration,
    /// `--args-max-bytes`: the session setting `skiplock.args_max_bytes` of every
    /// connection, if given.
    pub args_max_bytes: Option<u64>,
    /// The URL goes through PgBouncer in transaction-pooling mode (`--pgbouncer`).
    pub pgbouncer: bool,
}

/// How long to keep trying.
#[derive(Clone, Copy)]
pub enum Patience {
    /// A one-shot command (or a worker that exits when idle): `--connect-retry`.
    OneShot,
    /// A long-running command (`work`, `dashboard`): until stopped.
    UntilStopped,
}

/// Why one connection attempt failed.
enum Failure {
    /// Retrying may help; the message for when the retries run out.
    Passing(anyhow::Error),
    /// Retrying will not help.
    Lasting(anyhow::Error),
}

impl Database {
    /// The URL given, or the local server's.
    fn url(&self) -> &str {
        self.url.as_deref().unwrap_or(skiplock::embedded::LOCAL_URL)
    }

    /// The URL as connect options, refused with what to write when it is not a Postgres
    /// URL.
    fn connect_options(&self) -> anyhow::Result<PgConnectOptions> {
        self.connect_options_in(self.pgbouncer)
    }

    /// [`Self::connect_options`] for a direct connection or one through PgBouncer in
    /// transaction mode (`pgbouncer`).
    fn connect_options_in(&self, pgbouncer: bool) -> anyhow::Result<PgConnectOptions> {
        let url = self.url();
        if let Some((scheme, _)) = url.split_once("://")
            && !matches!(scheme, "postgres" | "postgresql")
        {
            anyhow::bail!(
                "the database URL {} is not a Postgres URL; skiplock needs postgres://user@host:port/db",
                redact(url)
            );
        }
        if url.trim().is_empty() {
            anyhow::bail!(
                "the database URL is empty; set --database-url / DATABASE_URL to postgres://user@host:port/db, or leave both out for the local server"
            );
        }
        // Not echoed: a key=value connection string may hold a password.
        if !url.contains("://") {
            anyhow::bail!(
                "the database URL is not a URL; write it like postgres://user@host:port/db (key=value connection strings are not supported)"
            );
        }
        let mut options: PgConnectOptions = url.parse().map_err(|e: sqlx::Error| {
            // sqlx says "error with configuration: " once per layer.
            let text = e.to_string();
            let mut why = text.as_str();
            while let Some(rest) = why.strip_prefix("error with configuration: ") {
                why = rest;
            }
            anyhow::anyhow!(
                "the database URL is malformed ({why}); write it like postgres://user@host:port/db"
            )
        })?;
        // An IPv6 address keeps the URL's brackets in its host name, which no resolver
        // knows: postgres://user@[::1]:5432/db.
        if let Some(address) = options
            .get_host()
            .strip_prefix('[')
            .and_then(|host| host.strip_suffix(']'))
        {
            let address = address.to_owned();
            options = options.host(&address);
        }
        if pgbouncer {
            // PgBouncer refuses startup parameters it does not track unless told to
            // ignore them (`ignore_startup_parameters`); sqlx's extra_float_digits is one,
            // and so are the session settings of `options`.
            options = options.extra_float_digits(None);
            if self.args_max_bytes.is_some() {
                anyhow::bail!(
                    "--args-max-bytes cannot reach the server through PgBouncer (it refuses session options); set it per database or role instead: ALTER DATABASE … SET skiplock.args_max_bytes = …"
                );
            }
        }
        if let Some(limit) = self.args_max_bytes {
            options = options.options([("skiplock.args_max_bytes", limit.to_string())]);
        }
        Ok(options)
    }

    /// `error`, which says that a skiplock table, function or schema is missing (or that
    /// the schema is older than this build), told as what it means for this database: it
    /// has no skiplock schema, or an older one, and `skiplock migrate` is the fix. Any
    /// other case, or a failure to look, keeps `error`.
    pub async fn explain_schema(&self, error: anyhow::Error) -> anyhow::Error {
        let Ok(options) = self.connect_options() else {
            return error;
        };
        let name = database_name(&options).to_owned();
        let Ok(pool) = self.pool("schema check", 1, Patience::OneShot).await else {
            return error;
        };
        let found = skiplock::check_schema(pool.pool()).await;
        pool.pool().close().await;
        match found {
            Err(skiplock::Error::SchemaOutdated { found: 0, .. }) => anyhow::anyhow!(
                "the database `{name}` has no skiplock schema; run `skiplock migrate` on it first"
            ),
            Err(skiplock::Error::SchemaOutdated { found, expected }) => anyhow::anyhow!(
                "the skiplock schema of the database `{name}` is at version {found}, this skiplock needs version {expected}; run `skiplock migrate` to upgrade it"
            ),
            _ => error,
        }
    }

    /// A pool of at most `max_connections`, once one connection to the server works. Its
    /// sessions show as `skiplock <command>` in `pg_stat_activity`.
    ///
    /// One connection is opened first, on its own, so that a refusal is reported with its
    /// own cause instead of as a pool timeout.
    ///
    /// Its sessions run with [`skiplock::SESSION_PINNED`] whatever the database's defaults
    /// say ([`DbPool::pin_sessions`]). Without `--pgbouncer`, a pooler in front is found
    /// (it refuses or drops startup parameters Postgres takes) and PgBouncer mode is used,
    /// with a warning that says how to make it explicit.
    pub async fn pool(
        &self,
        command: &str,
        max_connections: u32,
        patience: Patience,
    ) -> anyhow::Result<DbPool> {
        self.pool_in(None, command, max_connections, patience).await
    }

    /// [`Self::pool`] on the database `database` of the URL's server, with the same
    /// checks, retries and messages: the demo works in a database of its own.
    pub async fn pool_on(
        &self,
        database: &str,
        command: &str,
        max_connections: u32,
        patience: Patience,
    ) -> anyhow::Result<DbPool> {
        self.pool_in(Some(database), command, max_connections, patience)
            .await
    }

    async fn pool_in(
        &self,
        database: Option<&str>,
        command: &str,
        max_connections: u32,
        patience: Patience,
    ) -> anyhow::Result<DbPool> {
        let url = self.url();
        let mut pgbouncer = self.pgbouncer;
        let application_name = format!("skiplock {command}");
        let options_in = |pgbouncer: bool| -> anyhow::Result<PgConnectOptions> {
            let options = self
                .connect_options_in(pgbouncer)?
                .application_name(&application_name);
            Ok(match database {
                Some(name) => options.database(name),
                None => options,
            })
        };
        let mut options = options_in(pgbouncer)?;
        let started = Instant::now();
        let mut delay = RETRY_DELAY_FIRST;
        loop {
            let attempt =
                tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options)).await;
            let failure = match attempt {
                Ok(Ok(first)) => {
                    let _ = first.close().await;
                    break;
                }
                Ok(Err(e)) if !pgbouncer && refused_by_pooler(&e) => {
                    // PgBouncer refuses sqlx's `extra_float_digits` (or the URL's session
                    // options) unless told to ignore them: it is in front, and its
                    // transaction mode is the one that needs care. Switch now.
                    tracing::warn!(
                        "the database URL {} reaches a connection pooler ({e}); running in \
                         PgBouncer mode (each statement in a transaction of its own, unnamed; \
                         no LISTEN without --listen-url). Say so to silence this: --pgbouncer \
                         (SKIPLOCK_PGBOUNCER=true)",
                        redact(url)
                    );
                    pgbouncer = true;
                    options = options_in(pgbouncer)?;
                    continue;
                }
                Ok(Err(e)) => classify(e, url, &options, patience),
                Err(_) => Failure::Passing(
                    anyhow::anyhow!("no answer within {CONNECT_TIMEOUT:?}")
                        .context(unreachable(url)),
                ),
            };
            let error = match failure {
                Failure::Lasting(error) => return Err(error),
                Failure::Passing(error) => error,
            };
            let out_of_patience = match patience {
                Patience::OneShot => started.elapsed() + delay > self.connect_retry,
                Patience::UntilStopped => false,
            };
            if out_of_patience {
                return Err(error);
            }
            match patience {
                // One line while a one-shot command waits, not one per attempt: its own
                // error line follows if the server never answers.
                Patience::OneShot if delay > RETRY_DELAY_FIRST => {
                    tracing::debug!("{}; trying again", crate::message(&error));
                }
                Patience::OneShot => tracing::warn!(
                    "{}; trying again in {}, for up to {} in all",
                    crate::message(&error),
                    humantime::format_duration(delay),
                    humantime::format_duration(self.connect_retry)
                ),
                Patience::UntilStopped => tracing::warn!(
                    "{}; trying again in {}",
                    crate::message(&error),
                    humantime::format_duration(delay)
                ),
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(RETRY_DELAY_MAX);
        }
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .idle_timeout(IDLE_TIMEOUT)
            .acquire_timeout(CONNECT_TIMEOUT)
            .connect_lazy_with(options);
        let pool = if pgbouncer {
            DbPool::pgbouncer(pool)
        } else {
            DbPool::direct(pool)
        };
        pool.pin_sessions().await;
        Ok(pool)
    }
}

/// The message for a server that did not answer.
fn unreachable(url: &str) -> String {
    format!(
        "cannot connect to the database at {}; check --database-url / DATABASE_URL and that Postgres is running",
        redact(url)
    )
}

/// Whether a connection was refused as a pooler refuses it: PgBouncer answers startup
/// parameters it does not track (`extra_float_digits`, which sqlx sends, or `options`)
/// with `unsupported startup parameter` (SQLSTATE 08P01); Postgres takes them.
fn refused_by_pooler(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if db.code().as_deref() == Some("08P01")
            && db.message().contains("unsupported startup parameter"))
}

/// Sorts a failed connection attempt, with the message to give if it is the last.
fn classify(
    error: sqlx::Error,
    url: &str,
    options: &PgConnectOptions,
    patience: Patience,
) -> Failure {
    let sqlx::Error::Database(db) = &error else {
        // A name no resolver knows is not a server that is down, and almost always a typo:
        // a one-shot command says so at once. A worker or dashboard, which keeps trying
        // until stopped, waits for it as for a server that does not answer yet (a
        // container's name before its network is up).
        if let sqlx::Error::Io(io) = &error
            && io.to_string().contains("failed to lookup address")
        {
            let error = anyhow::anyhow!(
                "cannot find the host `{}` of the database URL {} ({io}); check the host name in --database-url / DATABASE_URL",
                options.get_host(),
                redact(url)
            );
            return match patience {
                Patience::OneShot => Failure::Lasting(error),
                Patience::UntilStopped => Failure::Passing(error),
            };
        }
        // No answer, or not one we could read (refused, reset, TLS): the server may be
        // down or restarting.
        return Failure::Passing(anyhow::Error::new(error).context(unreachable(url)));
    };
    let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
    let said = format!("{} (SQLSTATE {code})", db.message());
    let server = redact(url);
    match code.as_str() {
        "3D000" => {
            let name = database_name(options);
            Failure::Lasting(anyhow::anyhow!(
                "the database `{name}` does not exist on the server at {server}; create it (createdb {name}) and run `skiplock migrate`"
            ))
        }
        // too_many_connections, and the rest of class 53 (out of memory, disk full…).
        c if c.starts_with("53") => Failure::Passing(anyhow::anyhow!(
            "the server at {server} refused the connection: {said}; close idle clients, cap the workers' pools (skiplock work --max-connections) or raise the server's max_connections"
        )),
        // cannot_connect_now (starting up, in recovery), admin or crash shutdown.
        "57P03" | "57P01" | "57P02" => Failure::Passing(anyhow::anyhow!(
            "the server at {server} is not accepting connections yet: {said}; wait until it has started"
        )),
        // invalid_password, invalid_authorization_specification.
        "28P01" | "28000" => Failure::Lasting(anyhow::anyhow!(
            "the server at {server} refused the login: {said}; check the user and password in --database-url / DATABASE_URL"
        )),
        _ => Failure::Lasting(anyhow::anyhow!(
            "the server at {server} refused the connection: {said}"
        )),
    }
}

/// The database the options name; without one, Postgres takes the user's name.
pub fn database_name(options: &PgConnectOptions) -> &str {
    options
        .get_database()
        .unwrap_or_else(|| options.get_username())
}

/// The URL without its password, for messages.
pub fn redact(url: &str) -> String {
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
