//! A PgBouncer in transaction-pooling mode, started from the distribution's package for a
//! test or a bench (tests/pgbouncer.rs, benches/pgbouncer.rs) and killed when dropped.

use std::process::Stdio;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Where Debian's `pgbouncer` package installs it (1.18 on Debian 12).
pub const PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// How long PgBouncer may take to start listening.
const START_LIMIT: Duration = Duration::from_secs(20);

/// Ports tried before giving up, each found free a moment before.
const START_ATTEMPTS: usize = 5;

/// A running PgBouncer; killed when dropped.
pub struct PgBouncer {
    /// The port it listens on, on 127.0.0.1.
    pub port: u16,
    _child: Child,
    _dir: tempfile::TempDir,
}

impl PgBouncer {
    /// Whether PgBouncer is installed.
    pub fn installed() -> bool {
        std::path::Path::new(PGBOUNCER).exists()
    }

    /// Starts PgBouncer on a free port of 127.0.0.1 in front of `server` (any database of
    /// it, as its user, `auth_type = any`), with `pool_mode = transaction` and
    /// `server_pool_size` server connections per database, and waits for the line that
    /// says it listens. Panics with its output when it does not start.
    pub async fn start(server: &PgConnectOptions, server_pool_size: u32) -> PgBouncer {
        let dir = tempfile::tempdir().expect("temporary directory");
        let mut said = Vec::new();
        for _ in 0..START_ATTEMPTS {
            // A port free a moment ago may be taken before PgBouncer binds it (by another
            // test's server, or as the local port of some connection): PgBouncer then
            // exits saying so, and it is started again on another port.
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            match Self::start_on(server, server_pool_size, &dir, port).await {
                Ok(child) => {
                    return PgBouncer {
                        port,
                        _child: child,
                        _dir: dir,
                    };
                }
                Err(lines) => {
                    let port_taken = lines.iter().any(|l| l.contains("Address already in use"));
                    said = lines;
                    if !port_taken {
                        break;
                    }
                }
            }
        }
        panic!("pgbouncer did not start listening: {}", said.join("\n"));
    }

    /// Starts PgBouncer on `port` and waits for the line that says it listens; returns
    /// what it printed instead when it exits or does not listen within [`START_LIMIT`].
    async fn start_on(
        server: &PgConnectOptions,
        server_pool_size: u32,
        dir: &tempfile::TempDir,
        port: u16,
    ) -> Result<Child, Vec<String>> {
        let ini = format!(
            "[databases]\n\
             * = host={host} port={server_port} user={user}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = any\n\
             pool_mode = transaction\n\
             default_pool_size = {server_pool_size}\n\
             max_client_conn = 1000\n",
            host = server.get_host(),
            server_port = server.get_port(),
            user = server.get_username(),
        );
        let path = dir.path().join("pgbouncer.ini");
        std::fs::write(&path, ini).expect("write pgbouncer.ini");
        let mut command = Command::new(PGBOUNCER);
        // PgBouncer refuses to run as root; as root it is told to become `postgres`.
        if running_as_root() {
            command.args(["-u", "postgres"]);
        }
        let mut child = command
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start pgbouncer");
        let stderr = child.stderr.take().expect("piped stderr");
        let mut lines = BufReader::new(stderr).lines();
        let listening = format!("listening on 127.0.0.1:{port}");
        let mut said = Vec::new();
        let started = tokio::time::timeout(START_LIMIT, async {
            while let Some(line) = lines.next_line().await.expect("read pgbouncer's log") {
                if line.contains(&listening) {
                    return true;
                }
                said.push(line);
            }
            false
        })
        .await;
        if started != Ok(true) {
            return Err(said);
        }
        // Keep reading its log so that it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(child)
    }

    /// `server` as reached through this PgBouncer. PgBouncer refuses the startup
    /// parameter `extra_float_digits`, which sqlx sends by default, unless its
    /// `ignore_startup_parameters` names it, so it is not sent.
    pub fn options(&self, server: &PgConnectOptions) -> PgConnectOptions {
        server
            .clone()
            .host("127.0.0.1")
            .port(self.port)
            .extra_float_digits(None)
    }
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("Uid:"))?.to_owned();
            Some(line.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}
