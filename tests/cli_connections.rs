//! The binary against a server that refuses connections: a role at its connection limit
//! (`CONNECTION LIMIT`, SQLSTATE 53300, the same refusal as a server out of
//! `max_connections`). One-shot commands retry within `--connect-retry` and then quote the
//! server; `work` keeps trying until it gets in, then stays within `--max-connections`.
#![cfg(feature = "cli")]

mod cli_support;
mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{TestDb, test_db};
use serde_json::json;
use sqlx::{Connection, PgConnection};
use tokio::io::{AsyncBufReadExt, BufReader};

/// A login role limited to `limit` sessions that can do what `postgres` can in the test's
/// database (as a member of it) without being a superuser (whose limit Postgres does not
/// enforce), and `limit` sessions holding all of them (with their backends' process ids).
struct FullRole {
    name: String,
    url: String,
    held: Vec<(PgConnection, i32)>,
}

impl FullRole {
    async fn create(db: &TestDb, limit: u32) -> FullRole {
        let name = format!("full_{}", db.name);
        for statement in [
            format!("DROP ROLE IF EXISTS {name}"),
            format!("CREATE ROLE {name} LOGIN CONNECTION LIMIT {limit}"),
            format!("GRANT postgres TO {name}"),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                .execute(&db.pool)
                .await
                .unwrap();
        }
        let url = db.url().replacen("postgres@", &format!("{name}@"), 1);
        assert_ne!(url, db.url(), "the test URL names the user postgres");
        let mut held = Vec::new();
        for _ in 0..limit {
            let mut connection = PgConnection::connect(&url).await.unwrap();
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut connection)
                .await
                .unwrap();
            held.push((connection, pid));
        }
        FullRole { name, url, held }
    }

    /// Ends the sessions that filled the role's limit, and returns once their backends
    /// are gone. A backend goes on counting toward the limit after its client closed the
    /// connection, until its process has exited (and it leaves pg_stat_activity a moment
    /// before it stops counting): a session opened meanwhile could still be refused, and
    /// `work` would log a refusal after it started. So each is terminated by the server,
    /// which waits (up to a minute, a guard against a hang only) for its process to exit.
    async fn release(&mut self, db: &TestDb) {
        for (connection, pid) in self.held.drain(..) {
            // False: no such backend any more (it counts no longer), or a hang.
            sqlx::query_scalar::<_, bool>("SELECT pg_terminate_backend($1, 60000)")
                .bind(pid)
                .fetch_one(&db.pool)
                .await
                .unwrap();
            // Its server end is gone: nothing to close.
            drop(connection);
        }
    }

    async fn drop_role(mut self, db: &TestDb) {
        self.release(db).await;
        let name = &self.name;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}';
             DROP ROLE {name}"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
    }
}

/// Waits for the child's first stderr line, which must be a retry after the role's
/// refusal; returns the rest of its stderr.
async fn wait_for_refusal(
    child: &mut tokio::process::Child,
) -> tokio::io::Lines<BufReader<tokio::process::ChildStderr>> {
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(60), stderr.next_line())
        .await
        .expect("a retry line within 60 s")
        .unwrap()
        .unwrap_or_default();
    assert!(first.contains("too many connections for role"), "{first}");
    stderr
}

/// The binary as `role`, with stderr piped.
fn command_as(role: &FullRole, args: &[&str]) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_skiplock"));
    command
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .arg("--database-url")
        .arg(&role.url)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    command
}

#[tokio::test]
async fn a_one_shot_command_retries_a_refusal_then_quotes_the_server() {
    let db = test_db().await;
    let role = FullRole::create(&db, 1).await;
    let output = command_as(&role, &["--connect-retry", "1s", "jobs"])
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: the server at ")
            && last.contains("refused the connection: too many connections for role")
            && last.contains("(SQLSTATE 53300)")
            && last.contains("--max-connections"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("Postgres is running"),
        "the server answered; it is not down: {stderr}"
    );
    assert!(stderr.contains("trying again in"), "it retried: {stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "no colour codes in a pipe: {stderr}"
    );
    role.drop_role(&db).await;
}

#[tokio::test]
async fn a_one_shot_command_gets_in_once_a_connection_is_free() {
    let db = test_db().await;
    let id = skiplock::enqueue_raw(&db.pool, &[skiplock::NewJob::new("noop", json!({}))])
        .await
        .unwrap()[0]
        .id;
    let mut role = FullRole::create(&db, 1).await;
    let mut child = command_as(
        &role,
        &["--connect-retry", "60s", "show", &id.0.to_string()],
    )
    .spawn()
    .unwrap();
    let mut stderr = wait_for_refusal(&mut child).await;
    role.release(&db).await;
    let mut rest = Vec::new();
    while let Some(line) = stderr.next_line().await.unwrap() {
        rest.push(line);
    }
    let output = child.wait_with_output().await.unwrap();
    assert!(output.status.success(), "{output:?} {rest:#?}");
    assert!(String::from_utf8_lossy(&output.stdout).contains("noop"));
    role.drop_role(&db).await;
}

#[tokio::test]
async fn work_waits_for_a_connection_then_stays_within_its_cap() {
    // Three sessions: one pooled connection (--max-connections 1), the LISTEN connection
    // and the heartbeat's. A worker that opened more would be refused and say so.
    let db = test_db().await;
    let jobs: Vec<skiplock::NewJob> = (0..50)
        .map(|_| skiplock::NewJob::new("noop", json!({})))
        .collect();
    skiplock::enqueue_raw(&db.pool, &jobs).await.unwrap();
    let mut role = FullRole::create(&db, 3).await;
    let mut child = command_as(
        &role,
        &[
            "work",
            "--exit-when-idle",
            "--concurrency",
            "16",
            "--max-connections",
            "1",
        ],
    )
    .env("RUST_LOG", "info")
    .spawn()
    .unwrap();
    let mut stderr = wait_for_refusal(&mut child).await;
    role.release(&db).await;
    let mut rest = Vec::new();
    while let Some(line) = tokio::time::timeout(Duration::from_secs(90), stderr.next_line())
        .await
        .expect("the worker drains and exits within 90 s")
        .unwrap()
    {
        rest.push(line);
    }
    let status = child.wait().await.unwrap();
    let log = rest.join("\n");
    assert!(status.success(), "{log}");
    let started = rest
        .iter()
        .position(|line| line.contains("worker started"))
        .unwrap_or_else(|| panic!("the worker started: {log}"));
    let refused: Vec<&String> = rest[started..]
        .iter()
        .filter(|line| line.contains("too many connections"))
        .collect();
    assert!(
        refused.is_empty(),
        "the worker exceeded its cap: {refused:?}"
    );
    assert_eq!(
        cli_support::skiplock(&db, &["stats", "--json"])
            .await
            .json()["total"]["succeeded_last_hour"],
        json!(50)
    );
    role.drop_role(&db).await;
}

#[tokio::test]
async fn a_one_shot_command_on_a_closed_port_says_it_waits_once_then_fails() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_skiplock"))
        .env_remove("DATABASE_URL")
        .env("SKIPLOCK_CONNECT_RETRY", "2s")
        .args([
            "--database-url",
            "postgres://postgres@127.0.0.1:1/app",
            "jobs",
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines.len(),
        2,
        "one line while it waits, one when it gives up: {stderr}"
    );
    assert!(
        lines[0].contains(" WARN ")
            && lines[0].contains("trying again in 250ms, for up to 2s in all"),
        "{stderr}"
    );
    assert!(
        lines[1].starts_with(
            "error: cannot connect to the database at postgres://postgres@127.0.0.1:1/app"
        ),
        "{stderr}"
    );
}
