//! A private Postgres server that a test may restart (needs the `embedded` feature).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use sqlx::PgPool;

/// A throwaway Postgres server of this test alone (never the shared one on port 5432),
/// which the test may restart.
pub struct PrivateServer {
    server: skiplock::embedded::EmbeddedPostgres,
    pg_ctl: PathBuf,
    as_postgres: bool,
}

/// How `pg_ctl` stops the server before starting it again.
#[derive(Debug, Clone, Copy)]
pub enum Restart {
    /// Every backend is killed at once, without a checkpoint: a crash as far as clients
    /// and the WAL are concerned.
    Immediate,
    /// Backends are terminated and a checkpoint is written.
    Fast,
}

impl PrivateServer {
    /// Starts a server from the installed binaries; `None` when there are none, after
    /// [`crate::common::missing_tool`] said so (it fails the test under `CI=true`, where
    /// `.ci/run` installs them).
    pub async fn start() -> Option<PrivateServer> {
        tokio::task::spawn_blocking(|| {
            let Some(binaries) = skiplock::embedded::PgBinaries::find() else {
                crate::common::missing_tool(
                    "a test with a private PostgreSQL server",
                    "the server binaries initdb and pg_ctl (on PATH or under /usr/lib/postgresql/*/bin)",
                    "apt-get install postgresql",
                );
                return None;
            };
            let server = skiplock::embedded::EmbeddedPostgres::start_with(binaries.clone())
                .expect("start a private PostgreSQL server");
            let uid = std::fs::metadata(server.dir())
                .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
                .unwrap_or(0);
            let me = std::fs::metadata("/proc/self")
                .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
                .unwrap_or(0);
            Some(PrivateServer {
                server,
                pg_ctl: binaries.pg_ctl,
                as_postgres: me == 0 && uid != 0,
            })
        })
        .await
        .expect("start the server")
    }

    /// The URL of database `name` on this server, through its Unix socket in the
    /// server's private directory (`?host=DIR`; the port only names the socket file
    /// there). Not over TCP: while [`restart`](Self::restart) has the server down, any
    /// process on the machine may take its TCP port (another test's server, the local
    /// port of some connection), and the server could not come back on it; the socket's
    /// name in a directory of this server alone cannot be taken. The URL stays the same
    /// across restarts, so the workers given it reconnect by themselves.
    pub fn url(&self, name: &str) -> String {
        format!(
            "postgres://postgres@localhost/{name}?host={}&port={}",
            url_encode_path(&self.server.dir().to_string_lossy()),
            self.server.port()
        )
    }

    /// Creates database `name`, migrates it, turns `synchronous_commit` back on (the
    /// throwaway server runs with it off, which can lose acknowledged commits in a
    /// crash; the tests here must not confuse that with skiplock losing jobs), and
    /// returns a pool on it.
    pub async fn database(&self, name: &str, max_connections: u32) -> PgPool {
        let admin = PgPool::connect(&self.url("postgres"))
            .await
            .expect("connect");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&admin)
            .await
            .expect("create database");
        sqlx::query("ALTER SYSTEM SET synchronous_commit = on")
            .execute(&admin)
            .await
            .expect("synchronous_commit");
        sqlx::query("SELECT pg_reload_conf()")
            .execute(&admin)
            .await
            .expect("reload");
        admin.close().await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(60))
            .connect(&self.url(name))
            .await
            .expect("connect to the private database");
        skiplock::migrate(&pool).await.expect("migrate");
        pool
    }

    /// Restarts the server with `pg_ctl restart -m MODE`, waiting until it accepts
    /// connections again. It comes back listening on its Unix socket only (the one
    /// [`url`](Self::url) names), on the same socket name: its TCP port may have been
    /// taken while it was down.
    pub async fn restart(&self, mode: Restart) {
        let mode = match mode {
            Restart::Immediate => "immediate",
            Restart::Fast => "fast",
        };
        let data = self.server.dir().join("data");
        let log = self.server.dir().join("postgres.log");
        let mut command = if self.as_postgres {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&self.pg_ctl);
            c
        } else {
            std::process::Command::new(&self.pg_ctl)
        };
        command
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(&log)
            .args(["-m", mode, "-w", "-t", "60", "restart"])
            // Replaces the options of the first start (`-p PORT`, read back from
            // postmaster.opts when no -o is given): the same port names the socket file,
            // and no TCP listener, whose port someone else may hold by now.
            .arg("-o")
            .arg(format!("-p {} -c listen_addresses=''", self.server.port()))
            .current_dir(self.server.dir())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let output = tokio::task::spawn_blocking(move || command.output())
            .await
            .expect("run pg_ctl")
            .expect("run pg_ctl");
        assert!(
            output.status.success(),
            "pg_ctl restart -m {mode} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// `path` for a URL's query string: every byte but unreserved ones and `/` percent-encoded.
fn url_encode_path(path: &str) -> String {
    path.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
