//! The built-in `http` and `command` kinds, run by the real `skiplock work` against a
//! local HTTP server and real programs.
#![cfg(feature = "cli")]

mod cli_support;
mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cli_support::{enqueue, job_json, work_until_idle};
use common::fixtures::wait_for;
use common::test_db;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A request the test server received.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    /// Lowercase names.
    headers: HashMap<String, String>,
    body: String,
}

/// What the test server does with a request.
enum Reply {
    Respond {
        status: u16,
        headers: &'static [(&'static str, &'static str)],
        body: String,
    },
    /// Read the request, never answer.
    Hang,
}

/// A tiny HTTP/1.1 server on 127.0.0.1: one request per connection, answered by `route`
/// from the path and how many requests that path had before.
struct Server {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    async fn start(route: fn(&str, usize) -> Reply) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(answer(stream, route, log.clone()));
            }
        });
        Self { addr, seen }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

async fn answer(
    mut stream: TcpStream,
    route: fn(&str, usize) -> Reply,
    log: Arc<Mutex<Vec<Seen>>>,
) {
    let mut buffer = Vec::new();
    let head_end = loop {
        if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next().unwrap_or_default().split(' ');
    let method = request_line.next().unwrap_or_default().to_owned();
    let path = request_line.next().unwrap_or_default().to_owned();
    let headers: HashMap<String, String> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        .collect();
    let length: usize = headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = buffer[head_end + 4..].to_vec();
    while body.len() < length {
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    let before = {
        let mut log = log.lock().unwrap();
        let before = log.iter().filter(|s| s.path == path).count();
        log.push(Seen {
            method,
            path: path.clone(),
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        });
        before
    };
    match route(&path, before) {
        Reply::Hang => std::future::pending::<()>().await,
        Reply::Respond {
            status,
            headers,
            body,
        } => {
            let mut response = format!(
                "HTTP/1.1 {status} Whatever\r\nContent-Length: {}\r\nConnection: close\r\n",
                body.len()
            );
            for (name, value) in headers {
                response.push_str(&format!("{name}: {value}\r\n"));
            }
            response.push_str("\r\n");
            response.push_str(&body);
            let _ = stream.write_all(response.as_bytes()).await;
            let _ = stream.shutdown().await;
        }
    }
}

fn reply(status: u16, body: &str) -> Reply {
    Reply::Respond {
        status,
        headers: &[("Content-Type", "text/plain")],
        body: body.to_owned(),
    }
}

fn routes(path: &str, before: usize) -> Reply {
    match (path, before) {
        ("/ok", _) => reply(200, "hello"),
        ("/big", _) => reply(200, &"x".repeat(10_000)),
        ("/flaky", 0) => Reply::Respond {
            status: 500,
            headers: &[("Retry-After", "0")],
            body: "try again".into(),
        },
        ("/flaky", _) => reply(204, ""),
        ("/limited", _) => Reply::Respond {
            status: 429,
            headers: &[("Retry-After", "3600")],
            body: String::new(),
        },
        ("/hang", _) => Reply::Hang,
        _ => reply(404, "no such thing"),
    }
}

/// Asserts job `id` went `dead` on its first attempt with `message`; returns its row.
async fn dead_on_first_attempt(db: &common::TestDb, id: i64, message: Value) -> Value {
    let job = job_json(&db.pool, id).await;
    assert_eq!(
        (&job["state"], &job["attempt"], &job["last_error"]),
        (&json!("dead"), &json!(1), &message),
        "job {id}"
    );
    job
}

async fn state(db: &common::TestDb, id: i64) -> (Value, Value) {
    let job = job_json(&db.pool, id).await;
    (job["state"].clone(), job["attempt"].clone())
}

#[tokio::test]
async fn http_success_sends_the_request_and_records_a_bounded_response() {
    let db = test_db().await;
    let server = Server::start(routes).await;
    let post = enqueue(
        &db,
        "http",
        &json!({"method": "post", "url": server.url("/ok"), "headers": {"X-Token": "t1"},
                "body": {"event": "signup"}}),
        &[],
    )
    .await;
    let big = enqueue(&db, "http", &json!({"url": server.url("/big")}), &[]).await;
    work_until_idle(&db, &["--kinds", "http"]).await;

    let job = job_json(&db.pool, post).await;
    assert_eq!(job["state"], json!("succeeded"));
    assert_eq!(
        job["output"],
        json!({"status": 200, "content_type": "text/plain", "body_prefix": "hello",
               "body_truncated": false})
    );
    let seen = server.seen();
    let request = seen.iter().find(|s| s.path == "/ok").unwrap();
    assert_eq!(request.method, "POST");
    assert_eq!(request.headers["x-token"], "t1");
    assert_eq!(request.headers["content-type"], "application/json");
    assert_eq!(
        serde_json::from_str::<Value>(&request.body).unwrap(),
        json!({"event": "signup"})
    );

    let output = &job_json(&db.pool, big).await["output"];
    assert_eq!(output["body_prefix"].as_str().unwrap().len(), 4096);
    assert_eq!(output["body_truncated"], json!(true));
}

#[tokio::test]
async fn http_retries_500_then_succeeds_and_404_goes_dead_at_once() {
    let db = test_db().await;
    let server = Server::start(routes).await;
    let flaky = enqueue(&db, "http", &json!({"url": server.url("/flaky")}), &[]).await;
    let missing = enqueue(
        &db,
        "http",
        &json!({"url": server.url("/missing")}),
        &["--max-attempts", "5"],
    )
    .await;
    work_until_idle(&db, &["--kinds", "http"]).await;

    let job = job_json(&db.pool, flaky).await;
    assert_eq!(
        (&job["state"], &job["attempt"]),
        (&json!("succeeded"), &json!(2))
    );
    assert_eq!(
        job["errors"][0]["message"],
        json!(format!(
            "GET {} answered 500 Internal Server Error: try again",
            server.url("/flaky")
        ))
    );
    assert_eq!(job["output"]["status"], json!(204));

    let job = dead_on_first_attempt(
        &db,
        missing,
        json!(format!(
            "GET {} answered 404 Not Found: no such thing",
            server.url("/missing")
        )),
    )
    .await;
    assert_eq!(job["output"]["status"], json!(404));
}

#[tokio::test]
async fn http_timeouts_retry_and_retry_after_is_honoured() {
    let db = test_db().await;
    let server = Server::start(routes).await;
    let hang = enqueue(
        &db,
        "http",
        &json!({"url": server.url("/hang"), "timeout_ms": 300}),
        &["--max-attempts", "1"],
    )
    .await;
    let limited = enqueue(&db, "http", &json!({"url": server.url("/limited")}), &[]).await;
    work_until_idle(&db, &["--kinds", "http"]).await;

    let job = job_json(&db.pool, hang).await;
    assert_eq!(
        job["state"],
        json!("dead"),
        "a timeout with no attempt left"
    );
    assert_eq!(
        job["last_error"],
        json!(format!("GET {} timed out", server.url("/hang")))
    );

    assert_eq!(state(&db, limited).await, (json!("queued"), json!(1)));
    let honoured: bool = sqlx::query_scalar(
        "SELECT scheduled_at > now() + interval '50 minutes' FROM skiplock.jobs WHERE id = $1",
    )
    .bind(limited)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(honoured, "Retry-After: 3600 puts the retry an hour out");
}

#[tokio::test]
async fn http_hosts_off_the_allow_list_are_refused() {
    let db = test_db().await;
    let server = Server::start(routes).await;
    let id = enqueue(&db, "http", &json!({"url": server.url("/ok")}), &[]).await;
    work_until_idle(
        &db,
        &[
            "--kinds",
            "http",
            "--allow-http-host",
            "example.com",
            "--allow-http-host",
            "*.test:8443",
        ],
    )
    .await;
    dead_on_first_attempt(
        &db,
        id,
        json!(
            "host `127.0.0.1` is not on this worker's http allow-list (example.com, *.test:8443); \
             start a worker with --allow-http-host 127.0.0.1 to run this job, then retry it"
        ),
    )
    .await;
    assert!(server.seen().is_empty(), "no request was sent");
}

#[tokio::test]
async fn command_runs_programs_without_a_shell_and_records_their_output() {
    let db = test_db().await;
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path().canonicalize().unwrap();
    let cwd = cwd.to_str().unwrap();
    let echo = enqueue(
        &db,
        "command",
        &json!({"program": "echo", "args": ["hello", "$HOME; rm -rf /"]}),
        &[],
    )
    .await;
    let cat = enqueue(
        &db,
        "command",
        &json!({"program": "cat", "stdin": "from stdin"}),
        &[],
    )
    .await;
    let script = enqueue(
        &db,
        "command",
        &json!({"program": "printf '%s in %s, url %s' \"$GREETING\" \"$(pwd)\" \"${DATABASE_URL-withheld}\"",
                "shell": true, "env": {"GREETING": "hi"}, "cwd": cwd}),
        &[],
    )
    .await;
    let mut worker = cli_support::command(&db);
    worker
        .env("DATABASE_URL", db.url())
        .args(["work", "--exit-when-idle", "--kinds", "command"])
        .args([
            "--allow-command",
            "echo",
            "--allow-command",
            "cat",
            "--allow-command",
            "sh",
        ]);
    let run = worker.output().await.unwrap();
    assert!(run.status.success(), "worker failed: {run:?}");

    let pool = &db.pool;
    let output = |id| async move { job_json(pool, id).await["output"].clone() };
    assert_eq!(
        output(echo).await,
        json!({"exit_code": 0, "signal": null, "timed_out": false,
               "stdout_prefix": "hello $HOME; rm -rf /\n", "stdout_truncated": false,
               "stderr_prefix": "", "stderr_truncated": false})
    );
    assert_eq!(output(cat).await["stdout_prefix"], json!("from stdin"));
    assert_eq!(
        output(script).await["stdout_prefix"],
        json!(format!("hi in {cwd}, url withheld"))
    );
    for id in [echo, cat, script] {
        assert_eq!(state(&db, id).await, (json!("succeeded"), json!(1)));
    }
}

#[tokio::test]
async fn command_failures_retry_and_unstartable_programs_go_dead() {
    let db = test_db().await;
    let failing = json!({"program": "echo oops >&2; exit 3", "shell": true});
    let last_try = enqueue(&db, "command", &failing, &["--max-attempts", "1"]).await;
    let will_retry = enqueue(&db, "command", &failing, &["--max-attempts", "2"]).await;
    let missing = enqueue(
        &db,
        "command",
        &json!({"program": "/nonexistent/program"}),
        &["--max-attempts", "5"],
    )
    .await;
    work_until_idle(&db, &["--kinds", "command", "--allow-command", "*"]).await;

    let message = "`echo oops >&2; exit 3` exited with status 3; stderr: oops";
    let job = job_json(&db.pool, last_try).await;
    assert_eq!(
        (&job["state"], &job["last_error"]),
        (&json!("dead"), &json!(message))
    );
    assert_eq!(job["output"]["exit_code"], json!(3));
    // A non-zero exit is retried. The retry is due about 2 s later (the default backoff),
    // and the worker exits once nothing is runnable: as a rule before then, the job
    // queued for its second attempt; on a loaded machine after, the second attempt run
    // too, and the job dead with it. Both are the retry; the evidence of each is checked.
    let job = job_json(&db.pool, will_retry).await;
    let errors = job["errors"].as_array().expect("the attempts' errors");
    let messages: Vec<&Value> = errors.iter().map(|error| &error["message"]).collect();
    match (&job["state"], &job["attempt"]) {
        (state, attempt) if *state == json!("queued") && *attempt == json!(1) => {
            assert_eq!(messages, [&json!(message)], "{job:#}");
            assert_eq!(job["last_error"], json!(message), "{job:#}");
        }
        (state, attempt) if *state == json!("dead") && *attempt == json!(2) => {
            assert_eq!(messages, [&json!(message); 2], "{job:#}");
            assert_eq!(job["last_error"], json!(message), "{job:#}");
        }
        _ => panic!("a non-zero exit is retried: {job:#}"),
    }
    dead_on_first_attempt(
        &db,
        missing,
        json!("cannot start `/nonexistent/program`: No such file or directory (os error 2)"),
    )
    .await;
}

/// Whether process `pid` has ended (gone, or a zombie nobody reaped yet).
fn ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => {
            // The state follows the parenthesised command name.
            let state = stat.rsplit_once(") ").map(|(_, rest)| rest.chars().next());
            matches!(state, Some(Some('Z' | 'X')))
        }
    }
}

#[tokio::test]
async fn command_timeout_kills_the_whole_process_group() {
    let db = test_db().await;
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    let id = enqueue(
        &db,
        "command",
        &json!({"program": "sleep 600 & echo $$ $! > \"$PIDS\"; wait", "shell": true,
                "env": {"PIDS": pids}, "timeout_ms": 5000}),
        &["--max-attempts", "1"],
    )
    .await;
    work_until_idle(&db, &["--kinds", "command", "--allow-command", "sh"]).await;

    let job = job_json(&db.pool, id).await;
    assert_eq!(job["state"], json!("dead"));
    assert_eq!(
        job["last_error"],
        json!(
            "`sleep 600 & echo $$ $! > \"$PIDS\"; wait` timed out after 5000 ms; its process group was killed"
        )
    );
    assert_eq!(job["output"]["timed_out"], json!(true));
    let written = std::fs::read_to_string(&pids).expect("the script started");
    let pids: Vec<u32> = written
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2, "shell and sleep pids: {written}");
    for pid in pids {
        wait_for(
            &format!("process {pid} to end"),
            Duration::from_secs(60),
            || async move { ended(pid) },
        )
        .await;
    }
}

#[tokio::test]
async fn command_jobs_are_refused_without_an_allow_list_or_off_it() {
    let db = test_db().await;
    let echo = enqueue(&db, "command", &json!({"program": "echo"}), &[]).await;
    let run = work_until_idle(&db, &["--kinds", "command"]).await;
    assert!(
        run.stderr
            .contains("no --allow-command given: this worker refuses `command` jobs"),
        "the worker warns at start: {}",
        run.stderr
    );
    dead_on_first_attempt(
        &db,
        echo,
        json!(
            "this worker runs no `command` jobs: it was started without an allow-list; \
             start a worker with --allow-command echo, then retry the job"
        ),
    )
    .await;

    let off_list = enqueue(&db, "command", &json!({"program": "echo"}), &[]).await;
    let script = enqueue(
        &db,
        "command",
        &json!({"program": "echo", "shell": true}),
        &[],
    )
    .await;
    work_until_idle(&db, &["--kinds", "command", "--allow-command", "cat"]).await;
    assert_eq!(
        job_json(&db.pool, off_list).await["last_error"],
        json!(
            "program `echo` is not on this worker's allow-list (cat); \
             start a worker with --allow-command echo, then retry the job"
        )
    );
    assert_eq!(
        job_json(&db.pool, script).await["last_error"],
        json!(
            "shell scripts need `sh` on the allow-list (cat); \
             start a worker with --allow-command sh, then retry the job"
        )
    );
}

#[tokio::test]
async fn cancelling_a_running_command_kills_its_process_group() {
    let db = test_db().await;
    let dir = tempfile::tempdir().unwrap();
    let pids_path = dir.path().join("pids");
    let id = enqueue(
        &db,
        "command",
        &json!({"program": "sleep 600 & echo $$ $! > \"$PIDS\"; wait", "shell": true,
                "env": {"PIDS": pids_path}}),
        &[],
    )
    .await;
    let mut worker = cli_support::command(&db)
        .args(["work", "--kinds", "command", "--allow-command", "sh"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let read_pids = || {
        std::fs::read_to_string(&pids_path)
            .ok()
            .filter(|text| text.ends_with('\n'))
            .map(|text| {
                text.split_whitespace()
                    .map(|p| p.parse::<u32>().unwrap())
                    .collect::<Vec<_>>()
            })
    };
    wait_for("the script to start", Duration::from_secs(60), || async {
        read_pids().is_some()
    })
    .await;
    assert_eq!(
        cli_support::skiplock(&db, &["cancel", &id.to_string()])
            .await
            .ok(),
        format!("job {id} cancelled\n")
    );
    for pid in read_pids().unwrap() {
        wait_for(
            &format!("process {pid} to end"),
            Duration::from_secs(60),
            || async move { ended(pid) },
        )
        .await;
    }
    worker.kill().await.unwrap();
    assert_eq!(job_json(&db.pool, id).await["state"], json!("cancelled"));
}

/// A job enqueued in a trace passes it on: the http kind as `traceparent` and `tracestate`
/// headers (neither when the job's own headers name one), the command kind as the
/// `TRACEPARENT` and `TRACESTATE` environment of its program; a job outside any trace
/// sends neither, whatever trace the worker itself was started in.
#[tokio::test]
async fn http_and_command_jobs_pass_their_trace_on() {
    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let db = test_db().await;
    let server = Server::start(routes).await;
    let traced = |kind: &'static str, args: Value| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT skiplock.enqueue($1, $2, traceparent => $3, tracestate => 'congo=t61')",
            )
            .bind(kind)
            .bind(args)
            .bind(TRACEPARENT)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    traced(
        "http",
        json!({"url": server.url("/ok"), "headers": {"X-Which": "traced"}}),
    )
    .await;
    traced(
        "http",
        json!({"url": server.url("/ok"), "headers": {"X-Which": "own", "traceparent": own}}),
    )
    .await;
    traced(
        "http",
        json!({"url": server.url("/ok"), "headers": {"X-Which": "own-state", "tracestate": "mine=1"}}),
    )
    .await;
    enqueue(
        &db,
        "http",
        &json!({"url": server.url("/ok"), "headers": {"X-Which": "untraced"}}),
        &[],
    )
    .await;
    let script = "printf '%s|%s' \"$TRACEPARENT\" \"$TRACESTATE\"";
    let command = traced("command", json!({"program": script, "shell": true})).await;
    let untraced_command = enqueue(
        &db,
        "command",
        &json!({"program": script, "shell": true}),
        &[],
    )
    .await;
    // A worker started inside a trace of its own (a traced deploy script) passes on the
    // job's trace, or none: never its own.
    let worked = cli_support::command(&db)
        .args(["work", "--exit-when-idle", "--kinds", "http,command"])
        .args(["--allow-command", "sh"])
        .env("TRACEPARENT", own)
        .env("TRACESTATE", "worker=1")
        .output()
        .await
        .unwrap();
    assert_eq!(worked.status.code(), Some(0), "{worked:?}");

    let seen = server.seen();
    let header = |which: &str, name: &str| {
        let request = seen
            .iter()
            .find(|s| s.headers.get("x-which").map(String::as_str) == Some(which))
            .unwrap_or_else(|| panic!("no {which} request in {seen:?}"));
        request.headers.get(name).cloned()
    };
    assert_eq!(
        header("traced", "traceparent").as_deref(),
        Some(TRACEPARENT)
    );
    assert_eq!(header("traced", "tracestate").as_deref(), Some("congo=t61"));
    assert_eq!(header("own", "traceparent").as_deref(), Some(own));
    assert_eq!(header("own", "tracestate"), None);
    assert_eq!(header("own-state", "tracestate").as_deref(), Some("mine=1"));
    assert_eq!(header("own-state", "traceparent"), None);
    assert_eq!(header("untraced", "traceparent"), None);
    assert_eq!(header("untraced", "tracestate"), None);
    let stdout = |id| {
        let pool = db.pool.clone();
        async move { job_json(&pool, id).await["output"]["stdout_prefix"].clone() }
    };
    assert_eq!(
        stdout(command).await,
        json!(format!("{TRACEPARENT}|congo=t61"))
    );
    assert_eq!(stdout(untraced_command).await, json!("|"));
}
