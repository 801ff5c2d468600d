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

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::time::Duration;

/// Where PostgreSQL server packages install their binaries on Debian-like
/// systems, one directory per major version (`/usr/lib/postgresql/15/bin`).
const VERSIONED_ROOT: &str = "/usr/lib/postgresql";

/// The URL of a server on the default local port, as used by
/// [`DatabaseSource::Local`].
pub const LOCAL_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// How long [`resolve_database_url`] waits for `127.0.0.1:5432` to accept a
/// TCP connection before it starts an embedded server.
const LOCAL_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// How long `pg_ctl -w` may wait for the server to start, in seconds.
const START_TIMEOUT_SECS: u32 = 60;

/// How many free ports to try when another process grabs the chosen port
/// between probing it and the server binding it.
const START_ATTEMPTS: usize = 3;

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

/// A pair of PostgreSQL server tools from one installation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgBinaries {
    /// Path of `initdb`.
    pub initdb: PathBuf,
    /// Path of `pg_ctl` (from the same directory as `initdb`).
    pub pg_ctl: PathBuf,
}

impl PgBinaries {
    /// Finds `initdb` and `pg_ctl` in one directory: first on `PATH`, in
    /// `PATH` order, then under `/usr/lib/postgresql/*/bin`, highest major
    /// version first. Returns `None` when no directory has both.
    pub fn find() -> Option<Self> {
        find_binaries(
            std::env::var_os("PATH").as_deref(),
            Path::new(VERSIONED_ROOT),
        )
    }
}

/// Searches `path_var` (a `PATH`-style list) and then `versioned_root/*/bin`
/// in descending version order for a directory holding both tools.
fn find_binaries(path_var: Option<&OsStr>, versioned_root: &Path) -> Option<PgBinaries> {
    let on_path = path_var
        .map(|p| std::env::split_paths(p).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain(versioned_bin_dirs(versioned_root))
        .find_map(|dir| {
            let initdb = dir.join("initdb");
            let pg_ctl = dir.join("pg_ctl");
            (is_executable(&initdb) && is_executable(&pg_ctl))
                .then_some(PgBinaries { initdb, pg_ctl })
        })
}

/// `root/*/bin`, sorted by the numeric version in `*`, highest first.
fn versioned_bin_dirs(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut versions: Vec<(Vec<u64>, OsString)> = entries
        .filter_map(Result::ok)
        .map(|e| {
            let name = e.file_name();
            (version_key(&name.to_string_lossy()), name)
        })
        .collect();
    versions.sort_by(|a, b| b.cmp(a));
    versions
        .into_iter()
        .map(|(_, name)| root.join(name).join("bin"))
        .collect()
}

/// "9.6" -> [9, 6], "15" -> [15]; anything non-numeric sorts lowest.
fn version_key(name: &str) -> Vec<u64> {
    name.split('.')
        .map(|part| part.parse::<u64>())
        .collect::<Result<Vec<_>, _>>()
        .unwrap_or_default()
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The OS user the server runs as when this process is root.
#[derive(Debug, Clone, Copy)]
struct RunAs {
    uid: u32,
    gid: u32,
}

/// Looks up the `postgres` OS user in `/etc/passwd`, falling back to `id`
/// (which also sees users from NSS sources such as LDAP).
fn postgres_user() -> Option<RunAs> {
    if let Ok(passwd) = fs::read_to_string("/etc/passwd")
        && let Some(user) = parse_passwd(&passwd, "postgres")
    {
        return Some(user);
    }
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()?;
        if !out.status.success() {
            return None;
        }
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    Some(RunAs {
        uid: id("-u")?,
        gid: id("-g")?,
    })
}

fn parse_passwd(passwd: &str, user: &str) -> Option<RunAs> {
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        if fields.next()? != user {
            return None;
        }
        let _password = fields.next()?;
        let uid = fields.next()?.trim().parse().ok()?;
        let gid = fields.next()?.trim().parse().ok()?;
        Some(RunAs { uid, gid })
    })
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

/// A port on 127.0.0.1 that was free a moment ago.
fn free_port() -> io::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(listener.local_addr()?.port())
}

/// Quotes a value for `postgresql.conf`.
fn conf_quote(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "''"))
}

/// The watchdog script; `$1` is the data directory, `$2` the directory to
/// remove. It ignores terminal signals, waits for end-of-file on its
/// standard input (this process exiting), then shuts the server down
/// immediately (SIGQUIT to the postmaster, SIGKILL after 30 s) and removes
/// the directory. It works as root too, where `pg_ctl` would refuse to run.
const WATCHDOG_SCRIPT: &str = r#"trap '' INT HUP QUIT
while read -r _; do :; done
pid=$(head -n 1 "$1/postmaster.pid" 2>/dev/null)
case "$pid" in
  ''|*[!0-9]*) ;;
  *)
    kill -QUIT "$pid" 2>/dev/null
    i=0
    while kill -0 "$pid" 2>/dev/null && [ "$i" -lt 30 ]; do sleep 1; i=$((i+1)); done
    kill -KILL "$pid" 2>/dev/null
    ;;
esac
rm -rf "$2"
"#;

/// A running throwaway PostgreSQL server in a temporary directory.
///
/// Dropping it stops the server and deletes the directory. If it is never
/// dropped (say it lives in a `static`), a watchdog process does the same
/// when this process exits; see the [module docs](self).
pub struct EmbeddedPostgres {
    url: String,
    port: u16,
    binaries: PgBinaries,
    run_as: Option<RunAs>,
    data_dir: PathBuf,
    watchdog: Option<(Child, ChildStdin)>,
    // Last field: dropped (and so deleted) after everything above.
    dir: tempfile::TempDir,
}

impl fmt::Debug for EmbeddedPostgres {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmbeddedPostgres")
            .field("url", &self.url)
            .field("dir", &self.dir.path())
            .field("binaries", &self.binaries)
            .finish_non_exhaustive()
    }
}

impl EmbeddedPostgres {
    /// Starts a throwaway server with the binaries found by
    /// [`PgBinaries::find`].
    ///
    /// Runs `initdb -A trust -U postgres --no-sync -E UTF8 --no-locale` in a
    /// new temporary directory, then `pg_ctl -w start` on a free port that
    /// listens only on 127.0.0.1, with its Unix socket inside the
    /// directory and `fsync` off. Blocks until the server accepts
    /// connections (a few seconds).
    pub fn start() -> Result<Self, EmbeddedError> {
        let binaries = PgBinaries::find().ok_or(EmbeddedError::BinariesNotFound)?;
        Self::start_with(binaries)
    }

    /// Like [`start`](Self::start), with the given binaries.
    pub fn start_with(binaries: PgBinaries) -> Result<Self, EmbeddedError> {
        let dir = tempfile::Builder::new()
            .prefix("skiplock-pg-")
            .tempdir()
            .map_err(|e| EmbeddedError::io("create a temporary directory", e))?;

        // The directory is created with our effective uid, so its owner
        // tells whether we are root without any libc call.
        let euid = fs::metadata(dir.path())
            .map_err(|e| EmbeddedError::io(format!("inspect {}", dir.path().display()), e))?
            .uid();
        let run_as = if euid == 0 {
            let user = postgres_user().ok_or(EmbeddedError::NoPostgresUser)?;
            std::os::unix::fs::chown(dir.path(), Some(user.uid), Some(user.gid)).map_err(|e| {
                EmbeddedError::io(
                    format!("hand {} to the postgres user", dir.path().display()),
                    e,
                )
            })?;
            Some(user)
        } else {
            None
        };

        let data_dir = dir.path().join("data");
        let mut server = EmbeddedPostgres {
            url: String::new(),
            port: 0,
            binaries,
            run_as,
            data_dir,
            watchdog: None,
            dir,
        };
        // From here on, an early return drops `server`, which cleans up.
        server.spawn_watchdog()?;
        server.initdb()?;
        server.configure()?;
        server.start_server()?;
        Ok(server)
    }

    /// The URL of the server's `postgres` database as the `postgres`
    /// superuser (trust authentication, no password):
    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The TCP port the server listens on (on 127.0.0.1 only).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The temporary directory holding the data directory, the Unix socket
    /// and the server log (`postgres.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A command for one of the PostgreSQL tools, run as the `postgres` user
    /// when this process is root, in the temporary directory, with
    /// variables that could redirect the tools removed.
    fn tool(&self, program: &Path) -> Command {
        let mut cmd = Command::new(program);
        cmd.current_dir(self.dir.path())
            .stdin(Stdio::null())
            .env_remove("PGDATA")
            .env_remove("PGPORT")
            .env_remove("PGHOST")
            .env_remove("PGOPTIONS")
            .env("LC_ALL", "C");
        if let Some(user) = self.run_as {
            cmd.uid(user.uid).gid(user.gid);
        }
        cmd
    }

    fn spawn_watchdog(&mut self) -> Result<(), EmbeddedError> {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(WATCHDOG_SCRIPT)
            .arg("skiplock-pg-watchdog")
            .arg(&self.data_dir)
            .arg(self.dir.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Own process group: Ctrl-C in a terminal must not kill it.
            .process_group(0)
            .spawn()
            .map_err(|e| EmbeddedError::io("start the cleanup watchdog (sh)", e))?;
        let stdin = child.stdin.take().expect("stdin is piped");
        self.watchdog = Some((child, stdin));
        Ok(())
    }

    fn initdb(&self) -> Result<(), EmbeddedError> {
        let program = &self.binaries.initdb;
        let out = self
            .tool(program)
            .arg("-D")
            .arg(&self.data_dir)
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
            .arg("--no-locale")
            .output()
            .map_err(|e| EmbeddedError::io(format!("run {}", program.display()), e))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(EmbeddedError::Initdb {
                program: program.clone(),
                detail: one_line(&output_text(&out)),
            })
        }
    }

    /// Appends the throwaway settings to `postgresql.conf`; the port is
    /// passed on the command line so a retry can pick another one.
    fn configure(&self) -> Result<(), EmbeddedError> {
        let conf = self.data_dir.join("postgresql.conf");
        let socket_dir = self.dir.path().to_string_lossy();
        let settings = format!(
            "\n# skiplock embedded server (throwaway)\n\
             listen_addresses = '127.0.0.1'\n\
             unix_socket_directories = {}\n\
             fsync = off\n\
             synchronous_commit = off\n\
             full_page_writes = off\n\
             max_connections = 200\n",
            conf_quote(&socket_dir)
        );
        let mut text = fs::read_to_string(&conf)
            .map_err(|e| EmbeddedError::io(format!("read {}", conf.display()), e))?;
        text.push_str(&settings);
        fs::write(&conf, text)
            .map_err(|e| EmbeddedError::io(format!("write {}", conf.display()), e))
    }

    fn start_server(&mut self) -> Result<(), EmbeddedError> {
        let program = self.binaries.pg_ctl.clone();
        let log = self.dir.path().join("postgres.log");
        let mut last_err = None;
        for _ in 0..START_ATTEMPTS {
            let port = free_port().map_err(|e| EmbeddedError::io("find a free TCP port", e))?;
            let out = self
                .tool(&program)
                .arg("-D")
                .arg(&self.data_dir)
                .arg("-l")
                .arg(&log)
                .args(["-w", "-t", &START_TIMEOUT_SECS.to_string()])
                .args(["-o", &format!("-p {port}")])
                .arg("start")
                .output()
                .map_err(|e| EmbeddedError::io(format!("run {}", program.display()), e))?;
            if out.status.success() {
                self.port = port;
                self.url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
                return Ok(());
            }
            let log_tail = tail_lines(&log, 10);
            let port_taken =
                log_tail.contains("could not bind") || log_tail.contains("already in use");
            last_err = Some(EmbeddedError::Start {
                program: program.clone(),
                detail: one_line(&format!("{}\n{}", output_text(&out), log_tail)),
            });
            if !port_taken {
                break;
            }
            // Make sure a half-started server is gone before retrying.
            self.stop_server();
        }
        Err(last_err.expect("at least one attempt"))
    }

    /// Best-effort immediate shutdown.
    fn stop_server(&self) {
        if !self.data_dir.join("postmaster.pid").exists() {
            return;
        }
        let stopped = self
            .tool(&self.binaries.pg_ctl)
            .arg("-D")
            .arg(&self.data_dir)
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !stopped {
            // pg_ctl unusable: signal the postmaster directly.
            let pid = fs::read_to_string(self.data_dir.join("postmaster.pid"))
                .ok()
                .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<u32>().ok()));
            if let Some(pid) = pid {
                let _ = Command::new("kill")
                    .args(["-QUIT", &pid.to_string()])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
}

impl Drop for EmbeddedPostgres {
    fn drop(&mut self) {
        // Stop the watchdog first so it does not race with the cleanup
        // below; its own process group means the kill reaches only it.
        if let Some((mut child, stdin)) = self.watchdog.take() {
            let _ = child.kill();
            drop(stdin);
            let _ = child.wait();
        }
        self.stop_server();
        // `self.dir` (a TempDir) is removed when the fields drop.
    }
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

    fn make_tool(dir: &Path, name: &str, mode: u32) {
        fs::create_dir_all(dir).unwrap();
        let path = dir.join(name);
        fs::write(&path, "#!/bin/sh\n").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn version_keys_sort_numerically() {
        assert!(version_key("10") > version_key("9.6"));
        assert!(version_key("16") > version_key("15"));
        assert!(version_key("9.6") > version_key("9.5"));
        assert!(version_key("15") > version_key("beta"));
    }

    #[test]
    fn finds_highest_version_with_both_tools() {
        let root = tempfile::tempdir().unwrap();
        let versions = root.path().join("postgresql");
        for v in ["9.6", "10", "15"] {
            make_tool(&versions.join(v).join("bin"), "initdb", 0o755);
            make_tool(&versions.join(v).join("bin"), "pg_ctl", 0o755);
        }
        // 16 is incomplete (no pg_ctl), 17 has a non-executable pg_ctl.
        make_tool(&versions.join("16").join("bin"), "initdb", 0o755);
        make_tool(&versions.join("17").join("bin"), "initdb", 0o755);
        make_tool(&versions.join("17").join("bin"), "pg_ctl", 0o644);

        let found = find_binaries(None, &versions).expect("found");
        assert_eq!(found.initdb, versions.join("15/bin/initdb"));
        assert_eq!(found.pg_ctl, versions.join("15/bin/pg_ctl"));
    }

    #[test]
    fn path_wins_over_versioned_dirs() {
        let root = tempfile::tempdir().unwrap();
        let versions = root.path().join("postgresql");
        make_tool(&versions.join("15/bin"), "initdb", 0o755);
        make_tool(&versions.join("15/bin"), "pg_ctl", 0o755);
        let empty = root.path().join("empty");
        fs::create_dir_all(&empty).unwrap();
        let custom = root.path().join("custom");
        make_tool(&custom, "initdb", 0o755);
        make_tool(&custom, "pg_ctl", 0o755);

        let path = std::env::join_paths([&empty, &custom]).unwrap();
        let found = find_binaries(Some(&path), &versions).expect("found");
        assert_eq!(found.initdb, custom.join("initdb"));

        let path = std::env::join_paths([&empty]).unwrap();
        let found = find_binaries(Some(&path), &versions).expect("found");
        assert_eq!(found.pg_ctl, versions.join("15/bin/pg_ctl"));
    }

    #[test]
    fn nothing_found_gives_the_docker_hint() {
        let root = tempfile::tempdir().unwrap();
        let path = std::env::join_paths([root.path()]).unwrap();
        assert_eq!(
            find_binaries(Some(&path), &root.path().join("missing")),
            None
        );
        let msg = EmbeddedError::BinariesNotFound.to_string();
        assert!(msg.contains("docker compose up -d"), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }

    #[test]
    fn parses_passwd() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\n\
                      postgres:x:101:104:PostgreSQL administrator,,,:/var/lib/postgresql:/bin/bash\n";
        let user = parse_passwd(passwd, "postgres").expect("postgres");
        assert_eq!((user.uid, user.gid), (101, 104));
        assert!(parse_passwd(passwd, "nobody").is_none());
    }

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

    #[test]
    fn starts_and_cleans_up_embedded_server() {
        let Some(binaries) = PgBinaries::find() else {
            eprintln!("skipping: no PostgreSQL server binaries on this machine");
            return;
        };
        let server = EmbeddedPostgres::start_with(binaries).expect("start embedded server");
        let port = server.port();
        assert_eq!(
            server.url(),
            format!("postgres://postgres@127.0.0.1:{port}/postgres")
        );
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .expect("server accepts TCP connections");
        let dir = server.dir().to_path_buf();
        assert!(dir.join("data/PG_VERSION").exists());

        drop(server);
        assert!(!dir.exists(), "{} should be removed", dir.display());
        assert!(
            TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err(),
            "server should be stopped"
        );
    }

    #[test]
    fn watchdog_cleans_up_when_owner_goes_away() {
        let Some(binaries) = PgBinaries::find() else {
            eprintln!("skipping: no PostgreSQL server binaries on this machine");
            return;
        };
        let mut server = EmbeddedPostgres::start_with(binaries).expect("start embedded server");
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, server.port()));
        let dir = server.dir().to_path_buf();
        // Simulate this process exiting: close the watchdog's pipe and
        // take the watchdog out so Drop leaves it alone.
        let (mut child, stdin) = server.watchdog.take().expect("watchdog");
        drop(stdin);
        let status = child.wait().expect("watchdog exits");
        assert!(status.success(), "watchdog: {status}");
        assert!(!dir.exists(), "{} should be removed", dir.display());
        assert!(TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err());
        // Dropping now finds nothing left to stop or remove.
        drop(server);
    }
}
