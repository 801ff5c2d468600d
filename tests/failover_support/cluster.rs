//! Private Postgres clusters for the failover tests: a primary from `initdb`, a streaming
//! standby of it from `pg_basebackup -R`, `pg_ctl promote`, and the primary killed with
//! `pg_ctl stop -m immediate`. Never the shared server on port 5432.
//!
//! When the tests run as root (CI containers), every tool runs as the `postgres` OS user,
//! which owns the clusters' directory, as `skiplock::embedded` does.

use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The installed server binaries' directory, or `None` when no `initdb`/`pg_ctl` exists.
pub fn bin_dir() -> Option<PathBuf> {
    // `pg_ctl` may be a link on PATH (`/usr/local/bin`) to the installation's directory,
    // which holds `pg_basebackup` too.
    let binaries = skiplock::embedded::PgBinaries::find()?;
    let pg_ctl = std::fs::canonicalize(&binaries.pg_ctl).ok()?;
    let dir = pg_ctl.parent()?.to_path_buf();
    ["initdb", "pg_basebackup"]
        .iter()
        .all(|tool| dir.join(tool).exists())
        .then_some(dir)
}

/// One private cluster (its data directory, port and log) in a temporary directory that
/// is removed, with the server stopped, when this value is dropped.
pub struct Cluster {
    bin: PathBuf,
    run_as: Option<(u32, u32)>,
    port: u16,
    data: PathBuf,
    dir: tempfile::TempDir,
}

impl Cluster {
    /// A new primary, started, with `settings` (lines of `postgresql.conf`) on top of the
    /// throwaway ones. Replication connections from 127.0.0.1 are trusted (`initdb -A
    /// trust`), so a standby may be made from it at once.
    pub fn primary(bin: &Path, settings: &str) -> Cluster {
        let mut cluster = Cluster::new(bin);
        let out = cluster
            .tool("initdb")
            .arg("-D")
            .arg(&cluster.data)
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
            .arg("--no-locale")
            .output()
            .expect("run initdb");
        assert!(out.status.success(), "initdb: {}", text(&out));
        cluster.configure(&format!(
            "wal_level = replica\nmax_wal_senders = 5\nwal_keep_size = '256MB'\n{settings}"
        ));
        cluster.start();
        cluster
    }

    /// A hot standby of `primary`, streaming from it (`pg_basebackup -R` wrote its
    /// `primary_conninfo` and `standby.signal`), started.
    pub fn standby_of(primary: &Cluster) -> Cluster {
        let mut cluster = Cluster::new(&primary.bin);
        let out = cluster
            .tool("pg_basebackup")
            .arg("-D")
            .arg(&cluster.data)
            .args(["-h", "127.0.0.1", "-U", "postgres", "-X", "stream", "-R"])
            .args(["-c", "fast", "--no-sync"])
            .args(["-p", &primary.port.to_string()])
            .output()
            .expect("run pg_basebackup");
        assert!(out.status.success(), "pg_basebackup: {}", text(&out));
        // The copied configuration holds the primary's settings; a standby needs none of
        // the primary's synchronous ones, and its own socket directory.
        cluster.configure("synchronous_standby_names = ''\nhot_standby = on\n");
        cluster.start();
        cluster
    }

    fn new(bin: &Path) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix("skiplock-failover-")
            .tempdir()
            .expect("temporary directory");
        let run_as = if is_root() {
            let ids = postgres_ids().expect("a `postgres` OS user to run the servers as root");
            std::os::unix::fs::chown(dir.path(), Some(ids.0), Some(ids.1)).expect("chown");
            Some(ids)
        } else {
            None
        };
        let data = dir.path().join("data");
        Cluster {
            bin: bin.to_path_buf(),
            run_as,
            port: free_port(),
            data,
            dir,
        }
    }

    /// The TCP port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of database `name` on this cluster.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// Appends `settings` and this cluster's own socket directory to `postgresql.conf`.
    fn configure(&self, settings: &str) {
        let conf = self.data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).expect("read postgresql.conf");
        text.push_str(&format!(
            "\n# skiplock failover test\nlisten_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{}'\nfsync = off\nfull_page_writes = off\n\
             max_connections = 100\nlog_min_error_statement = error\n{settings}\n",
            self.dir.path().display()
        ));
        std::fs::write(&conf, text).expect("write postgresql.conf");
    }

    /// Starts the server; when its port was taken since it was found free (another
    /// test's server, or the local port of some connection), on another one.
    fn start(&mut self) {
        for attempt in 1..=START_ATTEMPTS {
            let out = self
                .tool("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .arg("-l")
                .arg(self.dir.path().join("postgres.log"))
                .args([
                    "-w",
                    "-t",
                    "60",
                    "-o",
                    &format!("-p {}", self.port),
                    "start",
                ])
                .output()
                .expect("run pg_ctl start");
            if out.status.success() {
                return;
            }
            let log = self.log_tail();
            let port_taken = log.contains("could not bind") || log.contains("already in use");
            assert!(
                port_taken && attempt < START_ATTEMPTS,
                "pg_ctl start: {}\n{log}",
                text(&out),
            );
            self.port = free_port();
        }
    }

    /// `pg_ctl stop -m immediate`: every backend killed at once, no checkpoint. As far as
    /// clients can tell, the server crashed.
    pub fn kill(&self) {
        let out = self
            .tool("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "-w", "stop"])
            .output()
            .expect("run pg_ctl stop");
        assert!(out.status.success(), "pg_ctl stop: {}", text(&out));
    }

    /// `pg_ctl promote -w`: the standby ends recovery and accepts writes when this returns.
    pub fn promote(&self) {
        let out = self
            .tool("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-w", "-t", "60", "promote"])
            .output()
            .expect("run pg_ctl promote");
        assert!(out.status.success(), "pg_ctl promote: {}", text(&out));
    }

    /// The server's whole log (with every failed statement: `log_min_error_statement`).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }

    /// The last lines of the server's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// One of the server tools, as the `postgres` user when this process is root.
    fn tool(&self, name: &str) -> Command {
        let mut command = Command::new(self.bin.join(name));
        command
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .env_remove("PGDATA")
            .env_remove("PGPORT")
            .env_remove("PGHOST")
            .env_remove("PGOPTIONS")
            .env("LC_ALL", "C");
        if let Some((uid, gid)) = self.run_as {
            command.uid(uid).gid(gid);
        }
        command
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.data.join("postmaster.pid").exists() {
            let _ = self
                .tool("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .args(["-m", "immediate", "-w", "stop"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Ports a server is started on before its test gives up, each found free a moment before.
const START_ATTEMPTS: usize = 5;

fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a free port");
    listener.local_addr().expect("local address").port()
}

/// Whether this process is root (a new directory's owner is our effective uid).
fn is_root() -> bool {
    let probe = tempfile::tempdir().expect("temporary directory");
    std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(probe.path()).expect("metadata")) == 0
}

/// The `postgres` OS user's uid and gid, from `/etc/passwd`.
fn postgres_ids() -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        (fields.first() == Some(&"postgres") && fields.len() > 3)
            .then(|| Some((fields[2].parse().ok()?, fields[3].parse().ok()?)))
            .flatten()
    })
}
