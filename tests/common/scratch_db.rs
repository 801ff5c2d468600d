//! Scratch databases on the test or bench server: create one, point a URL at it, drop it.
//! Shared by the integration tests (`tests/common`) and the benchmarks (`benches/support`
//! includes this file with `#[path]`).

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};

/// How long dropping a database from a `Drop` impl may take before it is left behind.
const DROP_WAIT: Duration = Duration::from_secs(15);

/// Creates database `name` on the server at `admin_url`. Panics with what failed.
pub async fn create_database(admin_url: &str, name: &str) {
    let mut admin = PgConnection::connect(admin_url)
        .await
        .unwrap_or_else(|e| panic!("connect to {admin_url}: {e} (set DATABASE_URL)"));
    admin
        .execute(AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
        .await
        .unwrap_or_else(|e| panic!("create database {name}: {e}"));
    let _ = admin.close().await;
}

/// A pool of at most `max_connections` on database `name` at `url`. Panics with what failed.
pub async fn connect_pool(url: &str, name: &str, max_connections: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect to database {name}: {e}"))
}

/// Drops database `name`, forcing its connections out (the pool's, and any spawned
/// binary's). Errors are ignored: this is cleanup.
pub async fn drop_database(admin_url: &str, name: &str) {
    if let Ok(mut admin) = PgConnection::connect(admin_url).await {
        let sql = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
        let _ = admin.execute(AssertSqlSafe(sql)).await;
        let _ = admin.close().await;
    }
}

/// [`drop_database`] for a `Drop` impl: on a thread of its own with its own runtime (the
/// caller's runtime may be single-threaded and busy dropping the caller), waiting at most
/// [`DROP_WAIT`].
pub fn drop_database_blocking(admin_url: String, name: String) {
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("drop-scratch-db".into())
        .spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                rt.block_on(drop_database(&admin_url, &name));
            }
            let _ = done_tx.send(());
        });
    if spawned.is_ok() {
        let _ = done_rx.recv_timeout(DROP_WAIT);
    }
}

/// `url` with its database (the path) replaced by `database`, keeping the scheme,
/// credentials, host, port and query parameters.
pub fn with_database(url: &str, database: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url),
    };
    let (before_query, query) = match rest.find('?') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    let authority = match before_query.find('/') {
        Some(i) => &before_query[..i],
        None => before_query,
    };
    format!("{scheme}{authority}/{database}{query}")
}
