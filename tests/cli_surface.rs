//! The first hour with the `skiplock` binary (issue 30): args of the built-in kinds checked
//! at enqueue, list filters, one-line errors, what `work --exit-when-idle` leaves behind,
//! a host that does not resolve, and the demo run from anywhere.
#![cfg(feature = "cli")]

mod cli_support;
mod common;

use cli_support::{command, enqueue, job_json, skiplock, work_until_idle};
use common::test_db;
use serde_json::json;

/// The ids `jobs --json ARGS…` lists, newest first.
async fn listed(db: &common::TestDb, args: &[&str]) -> Vec<i64> {
    let mut all = vec!["jobs", "--json"];
    all.extend_from_slice(args);
    skiplock(db, &all)
        .await
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|job| job["id"].as_i64().unwrap())
        .collect()
}

/// The first line of a usage error (clap adds its pointer to `--help` below it).
fn first_line(stderr: &str) -> &str {
    stderr.lines().next().unwrap_or_default()
}

#[tokio::test]
async fn args_of_a_built_in_kind_are_checked_at_enqueue() {
    let db = test_db().await;
    let refused = [
        (
            "noop",
            "[1,2]",
            "error: args do not match the built-in kind `noop`: invalid length 2, expected fewer elements in array; write them like {}",
        ),
        (
            "sleep",
            r#"{"ms": "soon"}"#,
            r#"error: args do not match the built-in kind `sleep`: invalid type: string "soon", expected u64; write them like {"ms": 500}"#,
        ),
        (
            "http",
            r#"{"uri": "http://x/"}"#,
            r#"error: args do not match the built-in kind `http`: unknown field `uri`, expected one of `method`, `url`, `headers`, `body`, `timeout_ms`; write them like {"url": "https://hooks.example.com/x", "method": "POST", "body": {"a": 1}}"#,
        ),
        (
            "command",
            r#"{"args": ["-l"]}"#,
            r#"error: args do not match the built-in kind `command`: missing field `program`; write them like {"program": "pg_dump", "args": ["--format=custom", "app"]}"#,
        ),
    ];
    for (kind, args, line) in refused {
        let run = skiplock(&db, &["enqueue", kind, args]).await;
        assert_eq!(run.code, Some(2), "{kind} {args}: {run:#?}");
        assert_eq!(first_line(&run.stderr), line, "{run:#?}");
    }
    assert_eq!(db.job_count().await, 0);

    // Kinds the binary does not know may be run by other workers: their args are theirs.
    enqueue(&db, "resize_image", &json!([1, 2]), &[]).await;
    enqueue(&db, "sleep", &json!({"ms": 5}), &[]).await;
    assert_eq!(db.job_count().await, 2);
}

#[tokio::test]
async fn a_file_line_with_bad_args_of_a_built_in_kind_is_an_invalid_line() {
    let db = test_db().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.ndjson");
    std::fs::write(
        &path,
        "{\"kind\": \"noop\"}\n{\"kind\": \"sleep\", \"args\": {\"ms\": -1}}\n{\"kind\": \"other\", \"args\": [1]}\n",
    )
    .unwrap();
    let file = path.to_str().unwrap();

    // As with any invalid line: nothing is enqueued, the line is named.
    let run = skiplock(&db, &["enqueue", "--file", file]).await;
    assert_eq!(run.code, Some(1), "{run:#?}");
    assert_eq!(
        run.stderr,
        format!(
            "error: {file} line 2: args do not match the built-in kind `sleep`: invalid value: integer `-1`, expected u64; write them like {{\"ms\": 500}}; nothing was enqueued (fix the line, or pass --skip-invalid to enqueue the valid lines)\n"
        )
    );
    assert_eq!(db.job_count().await, 0);

    let run = skiplock(&db, &["enqueue", "--file", file, "--skip-invalid"]).await;
    assert_eq!(run.code, Some(0), "{run:#?}");
    assert!(
        run.stderr.starts_with(&format!(
            "skipped {file} line 2: args do not match the built-in kind `sleep`"
        )),
        "{run:#?}"
    );
    assert_eq!(db.job_count().await, 2);
}

#[tokio::test]
async fn jobs_filters_take_lists_of_kinds_and_queues() {
    let db = test_db().await;
    let a_x = enqueue(&db, "x", &json!({}), &["--queue", "a"]).await;
    let a_y = enqueue(&db, "y", &json!({}), &["--queue", "a"]).await;
    let b_x = enqueue(&db, "x", &json!({}), &["--queue", "b"]).await;
    let c_z = enqueue(&db, "z", &json!({}), &["--queue", "c"]).await;

    assert_eq!(listed(&db, &["--kind", "x,y"]).await, vec![b_x, a_y, a_x]);
    assert_eq!(
        listed(&db, &["--kind", "x", "--kind", "z"]).await,
        vec![c_z, b_x, a_x]
    );
    assert_eq!(listed(&db, &["--queue", "b,c"]).await, vec![c_z, b_x]);
    assert_eq!(
        listed(&db, &["--queue", "a,b", "--kind", "x,z"]).await,
        vec![b_x, a_x]
    );
    // The limit counts the jobs listed, newest first, whatever filter matched them.
    assert_eq!(
        listed(&db, &["--kind", "x,y,z", "--limit", "2"]).await,
        vec![c_z, b_x]
    );
    assert_eq!(
        listed(&db, &["--kind", "x", "--state", "queued,dead"]).await,
        vec![b_x, a_x]
    );
}

#[tokio::test]
async fn an_http_error_page_becomes_one_line() {
    use axum::http::StatusCode;
    use axum::response::Html;

    let page = format!(
        "<!DOCTYPE html>\n<html>\n  <head>\n    <title>404 Not Found</title>\n  </head>\n  <body>\n    <h1>Not   Found</h1>\n\t<p>{}</p>\n  </body>\n</html>\n",
        "nothing here ".repeat(40)
    );
    let body = page.clone();
    let app = axum::Router::new().fallback(move || {
        let body = body.clone();
        async move { (StatusCode::NOT_FOUND, Html(body)) }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/missing", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let db = test_db().await;
    let id = enqueue(&db, "http", &json!({ "url": url }), &[]).await;
    let run = work_until_idle(&db, &["--kinds", "http"]).await;

    let job = job_json(&db.pool, id).await;
    assert_eq!(job["state"], json!("dead"));
    let collapsed: String = page.split_whitespace().collect::<Vec<_>>().join(" ");
    let quoted: String = collapsed.chars().take(200).collect();
    let expected = format!("GET {url} answered 404 Not Found: {quoted}…");
    assert_eq!(job["last_error"], json!(expected));
    assert_eq!(job["errors"][0]["message"], json!(expected));
    let dead: (String,) = sqlx::query_as("SELECT last_error FROM skiplock.dead_jobs WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(dead.0, expected);
    // The log says it on one line too; the page itself is in the job's output.
    assert!(
        run.stderr
            .lines()
            .all(|line| !line.trim_start().starts_with("<")),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains(&expected), "{}", run.stderr);
    assert_eq!(job["output"]["body_prefix"], json!(page));
}

#[tokio::test]
async fn a_worker_that_exits_when_idle_names_the_jobs_it_leaves_to_others() {
    let db = test_db().await;
    enqueue(&db, "noop", &json!({}), &[]).await;
    enqueue(&db, "resize_image", &json!({}), &[]).await;
    enqueue(&db, "resize_image", &json!({}), &[]).await;
    enqueue(&db, "send_mail", &json!({}), &["--queue", "mail"]).await;
    enqueue(&db, "sleep", &json!({"ms": 1}), &["--queue", "mail"]).await;
    // Not runnable yet, or in a queue this worker does not claim from: not its business.
    enqueue(&db, "resize_image", &json!({}), &["--in", "1h"]).await;
    enqueue(&db, "resize_image", &json!({}), &["--queue", "elsewhere"]).await;

    let run = work_until_idle(&db, &["--kinds", "noop", "--queue", "default,mail"]).await;
    assert!(
        run.stderr.lines().any(|line| line
            == "left to other workers: 4 runnable jobs of kinds this worker does not run: \
                resize_image 2, send_mail 1, sleep 1"),
        "{}",
        run.stderr
    );

    // Nothing left behind: nothing said.
    let db = test_db().await;
    enqueue(&db, "noop", &json!({}), &[]).await;
    let run = work_until_idle(&db, &[]).await;
    assert!(
        !run.stderr.contains("left to other workers"),
        "{}",
        run.stderr
    );
}

/// A worker that exits when idle does not wait for a paused queue's jobs (it waited for
/// good: `skiplock.has_work` counted them as work) and says what it leaves behind: the
/// paused queue's jobs and how to resume it, the jobs waiting out a retry's backoff, the
/// jobs scheduled later, and when the next is due. It touches none of them.
#[tokio::test]
async fn a_worker_that_exits_when_idle_leaves_a_paused_queue_and_says_what_it_leaves() {
    let db = test_db().await;
    let paused = enqueue(&db, "noop", &json!({}), &["--queue", "mail"]).await;
    assert_eq!(
        skiplock(&db, &["queue", "pause", "mail"]).await.code,
        Some(0)
    );
    let retrying = enqueue(&db, "noop", &json!({}), &[]).await;
    sqlx::query(
        "UPDATE skiplock.jobs SET attempt = 1, scheduled_at = now() + interval '1 hour'
         WHERE id = $1",
    )
    .bind(retrying)
    .execute(&db.pool)
    .await
    .unwrap();
    let later = enqueue(&db, "noop", &json!({}), &["--in", "2h"]).await;

    // The line is the worker's log at INFO, the binary's default level.
    let run = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        command(&db)
            .env("RUST_LOG", "info")
            .args(["work", "--exit-when-idle", "--queue", "default,mail"])
            .output(),
    )
    .await
    .expect("the worker exits although a paused queue holds a job")
    .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(
            "exiting as asked (left behind: 1 job in paused queue mail (resume: skiplock queue \
             resume mail, or SELECT skiplock.resume_queue('mail')); 1 job waiting out a \
             retry's backoff or a snooze; 1 job scheduled later; the next due in "
        ),
        "{stderr}"
    );
    for id in [paused, retrying, later] {
        assert_eq!(
            job_json(&db.pool, id).await["state"],
            json!("queued"),
            "{id}"
        );
    }
}

/// A one-shot command whose host does not resolve fails on its first attempt, with one line
/// that names the host: it does not wait out `--connect-retry` (10 s by default) as for a
/// server that does not answer yet, which would log "trying again" lines first. Judged by
/// what it prints, not by how long it took.
#[tokio::test]
async fn a_host_that_does_not_resolve_fails_at_once_on_one_line() {
    let url = "postgres://postgres@no-such-host.invalid/x";
    for args in [&["jobs"][..], &["demo"]] {
        let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_skiplock"))
            .env_remove("DATABASE_URL")
            .env_remove("SKIPLOCK_CONNECT_RETRY")
            .env_remove("RUST_LOG")
            .arg("--database-url")
            .arg(url)
            .args(args)
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("trying again"),
            "{args:?} tried again instead of failing at once: {stderr}"
        );
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(
            stderr.starts_with(
                "error: cannot find the host `no-such-host.invalid` of the database URL \
                 postgres://postgres@no-such-host.invalid/x (failed to lookup address information: "
            ),
            "{args:?}: {stderr}"
        );
    }
}

#[tokio::test]
async fn the_demo_says_error_like_every_other_command() {
    // A URL that is not Postgres's, and a server that refuses the login: the demo's
    // messages are the other commands' own, on one line after `error:`.
    let db = test_db().await;
    let refused_login = db
        .url()
        .replacen("postgres://postgres@", "postgres://nobody_at_all@", 1);
    for url in ["mysql://root@127.0.0.1/app", refused_login.as_str()] {
        let jobs = tokio::process::Command::new(env!("CARGO_BIN_EXE_skiplock"))
            .env_remove("DATABASE_URL")
            .args(["--database-url", url, "jobs"])
            .output()
            .await
            .unwrap();
        let demo = tokio::process::Command::new(env!("CARGO_BIN_EXE_skiplock"))
            .env_remove("DATABASE_URL")
            .args(["--database-url", url, "demo"])
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&demo.stderr);
        assert_eq!(demo.status.code(), Some(1), "{url}: {stderr}");
        assert!(stderr.starts_with("error: "), "{url}: {stderr}");
        assert!(!stderr.contains("Error"), "{url}: {stderr}");
        assert_eq!(stderr, String::from_utf8_lossy(&jobs.stderr), "{url}");
    }
}

#[tokio::test]
async fn the_demo_runs_from_any_directory() {
    // After `cargo install`, `skiplock demo` runs wherever the user is: nothing it reads
    // lives in the checkout. In a demo database of the test's own: `skiplock_demo` may hold
    // the quick start's data.
    let db = test_db().await;
    let demo_name = format!("{}_demo", db.name);
    let elsewhere = tempfile::tempdir().unwrap();
    let output = cli_support::command(&db)
        .current_dir(elsewhere.path())
        .args(["demo", "--database", &demo_name])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert!(stdout.contains("Worker finished in"), "{stdout}");
    assert!(stdout.contains("dead job"), "{stdout}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE \"{demo_name}\" WITH (FORCE)"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn the_args_limit_error_is_the_message_and_hint_without_the_statement() {
    let db = test_db().await;
    let args = json!({ "blob": "x".repeat(6000) }).to_string();
    let run = skiplock(
        &db,
        &["--args-max-bytes", "4096", "enqueue", "noop", args.as_str()],
    )
    .await;
    assert_eq!(run.code, Some(1), "{run:#?}");
    assert_eq!(
        run.stderr,
        "error: cannot enqueue the job: invalid job: args are 6012 bytes, over the limit of \
         4096 bytes; hint: store large data elsewhere and pass a reference, or raise the \
         setting skiplock.args_max_bytes\n"
    );
}
