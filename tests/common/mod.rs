//! Shared support for the integration tests: every test gets its own fresh,
//! migrated database, much like `#[sqlx::test]`.
//!
//! The server is found once per test process: `DATABASE_URL` if set, else
//! whatever `skiplock::embedded::resolve_database_url` picks (a server on
//! `127.0.0.1:5432`, or a throwaway embedded one).
//!
//! Cleanup:
//! * each [`TestDb`] drops its database (`DROP DATABASE ... WITH (FORCE)`)
//!   when it goes out of scope, also when the test panics;
//! * an embedded server lives in a `static`, which Rust never drops. It is
//!   stopped and its directory removed by the watchdog process that
//!   `skiplock::embedded::EmbeddedPostgres` starts with every server: the
//!   watchdog waits for end-of-file on a pipe held by this process, so it
//!   runs as soon as the test process exits, however it exits (even on
//!   `SIGKILL`), and removing the whole server also removes any test
//!   databases a killed test left behind.
#![allow(dead_code)]

pub mod fixtures;
pub mod job_triggers;
pub mod scratch_db;

use std::sync::OnceLock;

use sqlx::PgPool;

pub use scratch_db::with_database;
use scratch_db::{connect_pool, create_database, drop_database_blocking};

/// The server every test in this process uses, resolved once.
static SERVER: OnceLock<Result<Server, String>> = OnceLock::new();

/// The test server, kept for the whole process.
struct Server {
    url: String,
    /// Keeps an embedded server alive until the process exits (statics
    /// are never dropped; its watchdog cleans up then).
    #[cfg(feature = "embedded")]
    _source: skiplock::embedded::DatabaseSource,
}

/// A fresh, migrated database for one test; dropped when this value is.
pub struct TestDb {
    /// A pool (at most 20 connections) on the test's own database.
    pub pool: PgPool,
    /// The URL of the test's own database, for binaries the test spawns.
    pub url: String,
    /// The database's name (`skiplock_test_<16 hex digits>`).
    pub name: String,
    /// The URL used to create and drop the database.
    admin_url: String,
}

impl TestDb {
    /// The URL of the test's own database.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Sets `setting` (`name = value`) for every session opened on this database from now
    /// on (`ALTER DATABASE … SET`).
    pub async fn set_for_new_sessions(&self, setting: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE \"{}\" SET {setting}",
            self.name
        )))
        .execute(&self.pool)
        .await
        .unwrap_or_else(|e| panic!("ALTER DATABASE … SET {setting}: {e}"));
    }

    /// How many rows `skiplock.jobs` holds, finished ones included.
    pub async fn job_count(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

#[cfg(feature = "embedded")]
fn resolve_server() -> Result<Server, String> {
    use skiplock::embedded::{DatabaseSource, resolve_database_url};

    let explicit = std::env::var("DATABASE_URL").ok();
    let source = resolve_database_url(explicit.as_deref()).map_err(|e| e.to_string())?;
    match &source {
        DatabaseSource::Given(_) => eprintln!("skiplock tests: using DATABASE_URL"),
        DatabaseSource::Local(url) => eprintln!("skiplock tests: using local server {url}"),
        DatabaseSource::Embedded(server) => eprintln!(
            "skiplock tests: started embedded PostgreSQL at {} in {}",
            server.url(),
            server.dir().display()
        ),
    }
    Ok(Server {
        url: source.url().to_owned(),
        _source: source,
    })
}

#[cfg(not(feature = "embedded"))]
fn resolve_server() -> Result<Server, String> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    Ok(Server { url })
}

/// The URL of the server's administrative database, resolving the server on
/// first use: `DATABASE_URL` if set, else (with the `embedded` feature) a
/// server on 127.0.0.1:5432 or a newly started embedded one, which blocks
/// for a few seconds.
///
/// Panics with the resolver's one-line message when no server can be had.
pub fn server_url() -> &'static str {
    match SERVER.get_or_init(resolve_server) {
        Ok(server) => &server.url,
        Err(e) => panic!("no PostgreSQL server for the tests: {e}"),
    }
}

/// Creates a fresh database `skiplock_test_<random hex>`, connects a pool to
/// it and runs `skiplock::migrate` on it.
pub async fn test_db() -> TestDb {
    let admin_url = tokio::task::spawn_blocking(server_url)
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
        .to_owned();
    let name = format!("skiplock_test_{:016x}", fastrand::u64(..));

    create_database(&admin_url, &name).await;

    // From here on, a panic drops `db` and with it the database.
    let url = with_database(&admin_url, &name);
    let pool = connect_pool(&url, &name, 20).await;
    let db = TestDb {
        pool,
        url,
        name,
        admin_url,
    };
    skiplock::migrate(&db.pool).await.expect("migrate");
    db
}

impl Drop for TestDb {
    /// Best effort: drops the database, waiting at most 15 s (see
    /// [`drop_database_blocking`]). `WITH (FORCE)` ends the pool's and any spawned
    /// binaries' connections. Errors are ignored.
    fn drop(&mut self) {
        drop_database_blocking(self.admin_url.clone(), self.name.clone());
    }
}

#[test]
fn with_database_replaces_only_the_path() {
    assert_eq!(
        with_database("postgres://postgres@127.0.0.1:5432/postgres", "t1"),
        "postgres://postgres@127.0.0.1:5432/t1"
    );
    assert_eq!(
        with_database("postgresql://u:p@h/db?sslmode=disable", "t1"),
        "postgresql://u:p@h/t1?sslmode=disable"
    );
    assert_eq!(with_database("postgres://h:1", "t1"), "postgres://h:1/t1");
    assert_eq!(
        with_database("postgres:///db?host=/run/postgresql", "t1"),
        "postgres:///t1?host=/run/postgresql"
    );
}

/// Runs `skiplock ARGS…` with `--database-url URL`, no inherited `DATABASE_URL`,
/// `RUST_LOG=log` and the extra environment `env`, and waits for it to exit.
#[cfg(feature = "cli")]
pub async fn skiplock_at(
    url: &str,
    args: &[&str],
    log: &str,
    env: &[(&str, &str)],
) -> std::process::Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_skiplock"))
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", log)
        .envs(env.iter().copied())
        .arg("--database-url")
        .arg(url)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("run skiplock")
}

/// A test whose tool is missing: in CI (`CI=true`, which `.ci/run` sets) it fails, so a
/// test that checked nothing never passes there; elsewhere it says on stderr that it
/// skipped, one line per test, in `cargo test`'s own output: written to the process's
/// stderr, not through `eprintln!`, which the test harness captures and shows only for a
/// failed test (the test itself reports `ok`). Each line counts the tests this `cargo test`
/// has skipped so far (see [`count_skip`]), so the last one gives the run's total.
pub fn missing_tool(what_is_skipped: &str, tool: &str, install: &str) {
    use std::io::Write;
    let message = format!("{what_is_skipped} needs {tool}, which is missing: {install}");
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        panic!("{message}");
    }
    let counted = count_skip(&message)
        .map(|n| format!(" ({n} skipped so far by this cargo test)"))
        .unwrap_or_default();
    let _ = writeln!(std::io::stderr(), "skipped: {message}{counted}");
}

/// Adds a skip to the tally of the `cargo test` that runs this test binary, and returns the
/// tally: every test binary of one `cargo test` is a child of the same cargo process, so
/// the tally is a file of `target/tmp` named after that process's id, one line a skip
/// (appended whole, so binaries running at once never mix lines). `None` when the file
/// cannot be written.
fn count_skip(message: &str) -> Option<usize> {
    use std::io::Write;
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "skipped-tests-of-{}",
        std::os::unix::process::parent_id()
    ));
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .ok()?;
    file.write_all(format!("{}\n", message.replace('\n', " ")).as_bytes())
        .ok()?;
    Some(std::fs::read_to_string(&path).ok()?.lines().count())
}

/// The job ids of an enqueue's results, in input order.
pub fn ids(results: Vec<skiplock::EnqueueResult>) -> Vec<skiplock::JobId> {
    results.into_iter().map(|result| result.id).collect()
}

/// Turns autovacuum and autoanalyze off on every table of `skiplock.jobs` (jobs_live,
/// jobs_done_default and each day partition of jobs_done that exists now) and their TOAST
/// tables, and checks they are off: for tests whose statistics or cached plans must stay
/// as they were taken.
pub async fn jobs_autovacuum_off(pool: &PgPool) {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT relid::regclass::text FROM pg_partition_tree('skiplock.jobs') WHERE isleaf",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    for table in &tables {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE {table}
             SET (autovacuum_enabled = false, toast.autovacuum_enabled = false)"
        )))
        .execute(pool)
        .await
        .unwrap();
    }
    let off: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_partition_tree('skiplock.jobs') p
         JOIN pg_class c ON c.oid = p.relid
         LEFT JOIN pg_class t ON t.oid = c.reltoastrelid
         CROSS JOIN LATERAL unnest(c.reloptions || coalesce(t.reloptions, '{}')) o
         WHERE p.isleaf AND o = 'autovacuum_enabled=false'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        off,
        2 * tables.len() as i64,
        "autovacuum off on {tables:?} and their TOAST tables"
    );
}
