//! The "embedded default": a throwaway PostgreSQL server for demos and tests.
//!
//! When no database URL is given and nothing answers on `127.0.0.1:5432`,
//! `resolve_database_url` starts a private server from the PostgreSQL
//! binaries installed on the machine (`initdb` and `pg_ctl`, found on `PATH`
//! or under `/usr/lib/postgresql/*/bin`, highest version first) in a
//! temporary directory, on a free port, and removes it again afterwards.
//!
//! Cleanup happens twice over:
//!
//! * dropping `EmbeddedPostgres` stops the server (`pg_ctl stop -m
//!   immediate`) and deletes its directory;
//! * every server also has a small watchdog process (`sh`) whose standard
//!   input is a pipe held by this process. When this process exits for any
//!   reason (normal exit with the server still alive in a `static`, panic
//!   with `panic = "abort"`, `SIGKILL`, Ctrl-C), the kernel closes the pipe,
//!   and the watchdog sends the postmaster `SIGQUIT` (an immediate shutdown)
//!   and deletes the directory. Keeping an `EmbeddedPostgres` in a `static`
//!   that is never dropped is therefore fine.
//!
//! The functions here block (they run `initdb` and wait for the server);
//! call them before building an async runtime or from
//! `tokio::task::spawn_blocking`.
//!
//! When the process runs as root (euid 0), PostgreSQL refuses to run, so
//! `initdb`, `pg_ctl` and the server run as the `postgres` OS user and the
//! temporary directory is handed to that user.

mod discovery;
mod server;

use std::fs;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

pub use discovery::PgBinaries;
pub use server::EmbeddedPostgres;

/// The URL of a server on the default local port, as used by
/// [`DatabaseSource::Local`].
pub const LOCAL_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// How long [`resolve_database_url`] waits for `127.0.0.1:5432` to accept a
/// TCP connection before it starts an embedded server.
const LOCAL_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// At most this many characters of a tool's output go into an error message.
const MAX_DETAIL_CHARS: usize = 1500;

/// Why an embedded PostgreSQL server could not be started.
///
/// Every message is one line that says what happened and what to do about
/// it; any output of `initdb` or `pg_ctl` is folded into that line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EmbeddedError {
    /// Neither `PATH` nor `/usr/lib/postgresql/*/bin` has both `initdb` and
    /// `pg_ctl`.
    #[error(
        "no PostgreSQL server binaries (initdb, pg_ctl) found on PATH or under \
         /usr/lib/postgresql/*/bin; install PostgreSQL or run `docker compose up -d` \
         and set DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres"
    )]
    BinariesNotFound,

    /// The process runs as root, PostgreSQL refuses to, and there is no
    /// `postgres` OS user to run it as instead.
    #[error(
        "running as root, which PostgreSQL refuses, and no `postgres` OS user exists to run \
         the throwaway server as; create one (`useradd --system postgres`), run as a normal \
         user, or set DATABASE_URL"
    )]
    NoPostgresUser,

    /// A file-system or process operation failed.
    #[error(
        "could not {action} for the throwaway PostgreSQL server: {error}; check that the \
         temporary directory is writable, or set DATABASE_URL"
    )]
    Io {
        /// What was being done, e.g. "create a temporary directory".
        action: String,
        /// The underlying error.
        error: io::Error,
    },

    /// `initdb` exited unsuccessfully.
    #[error(
        "initdb ({program}) failed: {detail}; fix the problem it reports, or set \
         DATABASE_URL to an existing server"
    )]
    Initdb {
        /// The `initdb` that was run.
        program: PathBuf,
        /// Its output, folded into one line.
        detail: String,
    },

    /// `pg_ctl start` did not bring the server up.
    #[error(
        "pg_ctl ({program}) could not start the throwaway server: {detail}; fix the problem \
         it reports, or set DATABASE_URL to an existing server"
    )]
    Start {
        /// The `pg_ctl` that was run.
        program: PathBuf,
        /// Its output and the end of the server log, folded into one line.
        detail: String,
    },
}

impl EmbeddedError {
    fn io(action: impl Into<String>, error: io::Error) -> Self {
        EmbeddedError::Io {
            action: action.into(),
            error,
        }
    }
}

/// Folds tool output into one trimmed line, keeping the end if it is long.
fn one_line(text: &str) -> String {
    let joined = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" | ");
    let count = joined.chars().count();
    if count <= MAX_DETAIL_CHARS {
        joined
    } else {
        let tail: String = joined.chars().skip(count - MAX_DETAIL_CHARS).collect();
        format!("...{tail}")
    }
}

fn output_text(out: &Output) -> String {
    let mut text = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout);
    if text.trim().is_empty() {
        text = stdout.into_owned();
    }
    if text.trim().is_empty() {
        text = format!("exited with {}", out.status);
    }
    text
}

/// Last `n` lines of a file, or nothing if it cannot be read.
fn tail_lines(path: &Path, n: usize) -> String {
    let Ok(text) = fs::read_to_string(path) else {
        return String::new();
    };
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Where the database URL a demo or test command uses came from.
#[derive(Debug)]
pub enum DatabaseSource {
    /// Given explicitly (`--database-url` or `DATABASE_URL`).
    Given(String),
    /// A server already answering on `127.0.0.1:5432`, used as
    /// `postgres://postgres@127.0.0.1:5432/postgres` (trust authentication
    /// assumed).
    Local(String),
    /// A throwaway server started for this process; it is stopped and
    /// removed when this value is dropped or the process exits.
    Embedded(EmbeddedPostgres),
}

impl DatabaseSource {
    /// The database URL to connect to.
    pub fn url(&self) -> &str {
        match self {
            DatabaseSource::Given(url) | DatabaseSource::Local(url) => url,
            DatabaseSource::Embedded(server) => server.url(),
        }
    }
}

/// Decides which database to use, in this order:
///
/// 1. `explicit`, when given and not empty (the caller passes
///    `--database-url` or `DATABASE_URL`);
/// 2. a server on `127.0.0.1:5432`, if a TCP connection succeeds within
///    about a second ([`DatabaseSource::Local`] with [`LOCAL_URL`]);
/// 3. a new [`EmbeddedPostgres`].
///
/// Blocks for up to a second probing the port, and for a few seconds more
/// when it starts an embedded server.
pub fn resolve_database_url(explicit: Option<&str>) -> Result<DatabaseSource, EmbeddedError> {
    if let Some(url) = explicit.map(str::trim).filter(|u| !u.is_empty()) {
        return Ok(DatabaseSource::Given(url.to_owned()));
    }
    let local = SocketAddr::from((Ipv4Addr::LOCALHOST, 5432));
    if TcpStream::connect_timeout(&local, LOCAL_PROBE_TIMEOUT).is_ok() {
        return Ok(DatabaseSource::Local(LOCAL_URL.to_owned()));
    }
    EmbeddedPostgres::start().map(DatabaseSource::Embedded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_folds_and_truncates() {
        assert_eq!(one_line("  a\n\n b \n"), "a | b");
        let long = "x".repeat(MAX_DETAIL_CHARS * 2);
        assert_eq!(one_line(&long).chars().count(), MAX_DETAIL_CHARS + 3);
    }

    #[test]
    fn explicit_url_wins() {
        let source = resolve_database_url(Some("postgres://example/db")).unwrap();
        assert!(matches!(source, DatabaseSource::Given(_)));
        assert_eq!(source.url(), "postgres://example/db");
    }
}
