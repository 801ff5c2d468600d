//! The throwaway server's lifecycle: a temporary directory, `initdb`, `pg_ctl start` on a
//! free port, the cleanup watchdog, and the stop when it is dropped.

use std::fmt;
use std::fs;
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};

use super::{EmbeddedError, PgBinaries, one_line, output_text, tail_lines};

/// How long `pg_ctl -w` may wait for the server to start, in seconds.
const START_TIMEOUT_SECS: u32 = 60;

/// How many free ports to try when another process grabs the chosen port
/// between probing it and the server binding it.
const START_ATTEMPTS: usize = 3;

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
/// when this process exits; see the [module docs](crate::embedded).
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

#[cfg(test)]
mod tests {
    use std::net::{SocketAddr, TcpStream};
    use std::time::Duration;

    use super::*;

    /// The installed server binaries; `None` with a note on stderr when there are none,
    /// except under CI (`CI=true`, which `.ci/run` sets and where it installs them): there a
    /// test that would check nothing fails.
    fn binaries_or_skip() -> Option<PgBinaries> {
        let found = PgBinaries::find();
        if found.is_none() {
            let message = "no PostgreSQL server binaries (initdb, pg_ctl) on PATH or under \
                           /usr/lib/postgresql/*/bin: apt-get install postgresql";
            if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
                panic!("{message}");
            }
            eprintln!("skipping: {message}");
        }
        found
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
    fn starts_and_cleans_up_embedded_server() {
        let Some(binaries) = binaries_or_skip() else {
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
        let Some(binaries) = binaries_or_skip() else {
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
