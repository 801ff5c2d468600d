//! Runs the real `skiplock` binary against a test database, for tests/cli.rs and
//! tests/builtin_kinds.rs.
#![allow(dead_code)]

use std::process::Stdio;

use serde_json::Value;
use sqlx::PgPool;

use crate::common::TestDb;

/// What one run of the binary produced.
#[derive(Debug)]
pub struct Run {
    /// Exit status code (`None` if killed by a signal).
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Asserts exit 0 and returns stdout.
    pub fn ok(self) -> String {
        assert_eq!(self.code, Some(0), "skiplock failed: {self:#?}");
        self.stdout
    }

    /// Asserts exit 0 and parses stdout as JSON.
    pub fn json(self) -> Value {
        let stdout = self.ok();
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
    }
}

/// The binary with `--database-url` pointing at `db` (before the subcommand, as a global
/// option) and no `DATABASE_URL` inherited.
pub fn command(db: &TestDb) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_skiplock"));
    command
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .arg("--database-url")
        .arg(db.url())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    command
}

/// Runs `skiplock --database-url URL ARGS…` to completion.
pub async fn skiplock(db: &TestDb, args: &[&str]) -> Run {
    let output = command(db)
        .args(args)
        .output()
        .await
        .expect("run the skiplock binary");
    Run {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Runs `skiplock work --exit-when-idle ARGS…` and asserts it exits 0: every job of its
/// kinds that was runnable is finished or waiting for a later retry.
pub async fn work_until_idle(db: &TestDb, args: &[&str]) -> Run {
    let mut all = vec!["work", "--exit-when-idle"];
    all.extend_from_slice(args);
    let run = skiplock(db, &all).await;
    assert_eq!(run.code, Some(0), "worker failed: {run:#?}");
    run
}

/// Enqueues one job through the binary; returns its id.
pub async fn enqueue(db: &TestDb, kind: &str, args: &Value, options: &[&str]) -> i64 {
    let args = args.to_string();
    let mut all = vec!["enqueue", kind, args.as_str()];
    all.extend_from_slice(options);
    let stdout = skiplock(db, &all).await.ok();
    stdout
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("enqueue printed no id: {stdout}"))
}

/// One job's row as JSON (every column).
pub async fn job_json(pool: &PgPool, id: i64) -> Value {
    sqlx::query_scalar("SELECT to_jsonb(j) FROM skiplock.jobs j WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}
