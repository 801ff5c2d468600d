//! The `skiplock` binary, driven as a user would: every command, both output formats,
//! bad input with its exact message and exit code.
#![cfg(feature = "cli")]

mod cli_support;
mod common;

use std::time::Duration;

use cli_support::{enqueue, job_json, skiplock, work_until_idle};
use common::test_db;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

const NOT_FOUND: &str = "error: job 999999 does not exist; list jobs with `skiplock jobs`\n";

#[tokio::test]
async fn migrate_is_idempotent() {
    let db = test_db().await;
    let expected = format!(
        "skiplock schema is at version {}\n",
        skiplock::db::migrations::SCHEMA_VERSION_LATEST
    );
    for _ in 0..2 {
        assert_eq!(skiplock(&db, &["migrate"]).await.ok(), expected);
    }
}

#[tokio::test]
async fn every_command_explains_itself_with_an_example() {
    let db = test_db().await;
    for command in [
        "migrate", "work", "enqueue", "jobs", "show", "retry", "cancel", "stats", "prune", "demo",
    ] {
        let help = skiplock(&db, &[command, "--help"]).await.ok();
        assert!(
            help.contains("Example"),
            "`{command} --help` has no example:\n{help}"
        );
    }
}

#[tokio::test]
async fn enqueue_sets_every_option_and_jobs_lists_it_in_both_formats() {
    let db = test_db().await;
    let id = enqueue(
        &db,
        "sleep",
        &json!({"ms": 5}),
        &[
            "--queue",
            "slow",
            "--priority",
            "-3",
            "--in",
            "1h",
            "--max-attempts",
            "4",
            "--ordering-key",
            "lane-1",
        ],
    )
    .await;
    let other = enqueue(&db, "noop", &json!({}), &[]).await;
    let row = job_json(&db.pool, id).await;
    assert_eq!(
        (
            &row["queue"],
            &row["priority"],
            &row["max_attempts"],
            &row["ordering_key"]
        ),
        (&json!("slow"), &json!(-3), &json!(4), &json!("lane-1"))
    );
    let later: bool = sqlx::query_scalar(
        "SELECT scheduled_at > now() + interval '50 minutes' FROM skiplock.jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(later, "--in 1h schedules the job an hour out");

    let table = skiplock(&db, &["jobs"]).await.ok();
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("ID  STATE   QUEUE    KIND   ATTEMPT  RUN AT"),
        "{table}"
    );
    assert!(
        lines[1].starts_with(&format!(" {other}  queued  default  noop      0/25  ")),
        "{table}"
    );
    assert!(
        lines[2].starts_with(&format!(" {id}  queued  slow     sleep      0/4  in ")),
        "{table}"
    );

    let listed = skiplock(&db, &["jobs", "--queue", "slow", "--json"])
        .await
        .json();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 1);
    let job = &listed[0];
    assert_eq!(job["id"], json!(id));
    assert_eq!(job["state"], json!("queued"));
    assert_eq!(job["args"], json!({"ms": 5}));
    let mut fields: Vec<&str> = job
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    fields.sort_unstable();
    assert_eq!(
        fields,
        [
            "args",
            "attempt",
            "claimed_by",
            "created_at",
            "finished_at",
            "id",
            "kind",
            "last_error",
            "max_attempts",
            "ordering_key",
            "priority",
            "queue",
            "scheduled_at",
            "state",
            "unique_key"
        ],
        "the --json shape is stable"
    );
    let none = skiplock(&db, &["jobs", "--state", "dead,running", "--kind", "noop"]).await;
    assert_eq!(none.ok(), "no jobs match\n");
    let filtered = skiplock(
        &db,
        &["jobs", "--state", "queued", "--kind", "noop", "--json"],
    )
    .await;
    assert_eq!(filtered.json()[0]["id"], json!(other));
}

#[tokio::test]
async fn enqueue_with_a_unique_key_skips_or_replaces() {
    let db = test_db().await;
    let first = enqueue(&db, "noop", &json!({"v": 1}), &["--unique-key", "k"]).await;
    let again = enqueue(&db, "noop", &json!({"v": 2}), &["--unique-key", "k"]).await;
    assert_eq!(again, first, "skip returns the pending job's id");
    assert_eq!(job_json(&db.pool, first).await["args"], json!({"v": 1}));
    let replaced = enqueue(
        &db,
        "noop",
        &json!({"v": 3}),
        &["--unique-key", "k", "--on-conflict", "replace"],
    )
    .await;
    assert_eq!(replaced, first);
    assert_eq!(job_json(&db.pool, first).await["args"], json!({"v": 3}));
    let printed = skiplock(&db, &["enqueue", "noop", "--json"]).await.json();
    assert!(printed["id"].as_i64().unwrap() > first);
    assert_eq!(printed["outcome"], json!("inserted"));
    // A duplicate says so: in --json, and on stderr beside the id on stdout.
    let duplicate = skiplock(
        &db,
        &["enqueue", "noop", "{}", "--unique-key", "k", "--json"],
    )
    .await
    .json();
    assert_eq!(duplicate, json!({ "id": first, "outcome": "skipped" }));
    let run = skiplock(&db, &["enqueue", "noop", "{}", "--unique-key", "k"]).await;
    assert_eq!(run.code, Some(0), "{run:#?}");
    assert_eq!(run.stdout, format!("{first}\n"));
    assert!(
        run.stderr.contains(&format!(
            "job {first} with this unique key was pending: skipped (no new job)"
        )),
        "{}",
        run.stderr
    );
}

#[tokio::test]
async fn show_prints_everything_in_both_formats() {
    let db = test_db().await;
    let parent = enqueue(&db, "noop", &json!({}), &[]).await;
    let id = enqueue(
        &db,
        "noop",
        &json!({"n": 1}),
        &["--depends-on", &parent.to_string()],
    )
    .await;
    sqlx::query(
        "UPDATE skiplock.jobs SET last_error = 'boom',
             errors = skiplock.internal_append_error(errors, 1, 'boom') WHERE id = $1",
    )
    .bind(id)
    .execute(&db.pool)
    .await
    .unwrap();

    let text = skiplock(&db, &["show", &id.to_string()]).await.ok();
    for expected in [
        format!("id            {id}\n"),
        "state         waiting\n".to_owned(),
        "kind          noop\n".to_owned(),
        "last_error    boom\n".to_owned(),
        "args:\n  {\n    \"n\": 1\n  }\n".to_owned(),
        "errors (1, oldest first):\n  attempt 1 at ".to_owned(),
        format!("waits for: {parent} (queued)"),
    ] {
        assert!(text.contains(&expected), "missing {expected:?} in:\n{text}");
    }
    let parent_text = skiplock(&db, &["show", &parent.to_string()]).await.ok();
    assert!(
        parent_text.contains(&format!("needed by: {id} (waiting)")),
        "{parent_text}"
    );

    let shown = skiplock(&db, &["show", &id.to_string(), "--json"])
        .await
        .json();
    assert_eq!(shown["id"], json!(id));
    assert_eq!(shown["errors"][0]["message"], json!("boom"));
    assert_eq!(
        shown["dependencies"],
        json!([{"relation": "parent", "id": parent, "state": "queued", "deleted": false}])
    );
    assert!(shown.get("output").is_some(), "every column is shown");
}

#[tokio::test]
async fn unknown_job_ids_fail_with_one_line_naming_the_fix() {
    let db = test_db().await;
    for command in ["show", "retry", "cancel"] {
        let run = skiplock(&db, &[command, "999999"]).await;
        assert_eq!(
            (run.code, run.stderr.as_str()),
            (Some(1), NOT_FOUND),
            "{command}"
        );
        assert_eq!(run.stdout, "");
    }
}

#[tokio::test]
async fn an_unreachable_database_fails_at_once_naming_it() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_skiplock"))
        .env_remove("DATABASE_URL")
        .args([
            "--database-url",
            "postgres://app:secret@127.0.0.1:1/app",
            "--connect-retry",
            "0s",
            "jobs",
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.starts_with(
            "error: cannot connect to the database at postgres://app:***@127.0.0.1:1/app; \
             check --database-url / DATABASE_URL and that Postgres is running: "
        ),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

#[tokio::test]
async fn usage_errors_exit_2_with_clap_messages() {
    let db = test_db().await;
    let malformed = skiplock(&db, &["enqueue", "noop", "{not json"]).await;
    assert_eq!(malformed.code, Some(2));
    assert_eq!(
        malformed.stderr,
        "error: invalid value '{not json' for '[ARGS_JSON]': not valid JSON: key must be a string at line 1 column 2; write JSON in single quotes, like '{\"ms\": 500}'\n\nFor more information, try '--help'.\n"
    );
    let unknown = skiplock(&db, &["jobs", "--bogus"]).await;
    assert_eq!(unknown.code, Some(2));
    assert!(
        unknown
            .stderr
            .starts_with("error: unexpected argument '--bogus' found\n"),
        "{}",
        unknown.stderr
    );
    let duration = skiplock(&db, &["prune", "--older-than", "soon"]).await;
    assert_eq!(duration.code, Some(2));
    assert!(
        duration.stderr.starts_with(
            "error: invalid value 'soon' for '--older-than <DURATION>': `soon` is not a duration; write a number and a unit, like 30s, 5m, 2h or 1d\n"
        ),
        "{}",
        duration.stderr
    );
    let state = skiplock(&db, &["jobs", "--state", "finished"]).await;
    assert_eq!(state.code, Some(2));
    let neither = skiplock(&db, &["retry"]).await;
    assert_eq!(neither.code, Some(2));
    let conflicting = skiplock(&db, &["work", "--kinds", "noop", "--allow-command", "echo"]).await;
    assert_eq!(conflicting.code, Some(2));
    assert!(
        conflicting
            .stderr
            .starts_with("error: --allow-command needs the `command` kind; add it to --kinds\n"),
        "{}",
        conflicting.stderr
    );
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(count, 0, "no usage error enqueued anything");
}

#[tokio::test]
async fn enqueue_file_adds_every_line_in_one_transaction() {
    let db = test_db().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.ndjson");
    let mut lines: Vec<String> = (0..2500)
        .map(|n| json!({"kind": "noop", "args": {"n": n}}).to_string())
        .collect();
    lines.insert(10, String::new());
    lines.push(
        json!({"kind": "sleep", "args": {"ms": 1}, "queue": "q2", "priority": 5,
               "scheduled_at": "2099-01-01T00:00:00Z", "max_attempts": 2,
               "ordering_key": "o", "unique_key": "u", "on_conflict": "merge"})
        .to_string(),
    );
    std::fs::write(&path, lines.join("\n")).unwrap();
    let path = path.to_str().unwrap();

    let out = skiplock(&db, &["enqueue", "--file", path, "--queue", "bulk"])
        .await
        .ok();
    assert!(
        out.starts_with(&format!("enqueued 2501 jobs from {path} in ")),
        "{out}"
    );
    let counts: Vec<(String, i64)> =
        sqlx::query_as("SELECT queue, count(*) FROM skiplock.jobs GROUP BY queue ORDER BY queue")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(counts, [("bulk".to_owned(), 2500), ("q2".to_owned(), 1)]);
    let last: (i16, i32, String, String, bool) = sqlx::query_as(
        "SELECT priority, max_attempts, ordering_key, unique_key,
                scheduled_at = '2099-01-01T00:00:00Z'
         FROM skiplock.jobs WHERE queue = 'q2'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(last, (5, 2, "o".into(), "u".into(), true));
}

#[tokio::test]
async fn enqueue_file_with_a_bad_line_enqueues_nothing_unless_asked() {
    let db = test_db().await;
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, lines: &[&str]| {
        let path = dir.path().join(name);
        std::fs::write(&path, lines.join("\n")).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let good = r#"{"kind": "noop"}"#;
    let cases = [
        (
            write(
                "syntax.ndjson",
                &[good, good, r#"{"kind": "noop", "args": }"#],
            ),
            "line 3: invalid JSON at column 26: expected value",
        ),
        (
            write("field.ndjson", &[good, r#"{"args": {}}"#]),
            "line 2: missing field `kind`",
        ),
        (
            write("unknown.ndjson", &[r#"{"kind": "noop", "colour": "red"}"#]),
            "line 1: unknown field `colour`, expected one of",
        ),
        (
            // Refused by the database, not the parser: the line is still named.
            write(
                "parent.ndjson",
                &[good, r#"{"kind": "noop", "depends_on": [999999]}"#, good],
            ),
            "line 2: ",
        ),
    ];
    for (path, problem) in &cases {
        let run = skiplock(&db, &["enqueue", "--file", path]).await;
        assert_eq!(run.code, Some(1), "{run:#?}");
        let expected = format!("error: {path} {problem}");
        assert!(
            run.stderr.starts_with(&expected),
            "want {expected:?}, got {:?}",
            run.stderr
        );
        assert!(
            run.stderr.ends_with(
                "; nothing was enqueued (fix the line, or pass --skip-invalid to enqueue the valid lines)\n"
            ),
            "{}",
            run.stderr
        );
    }
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM skiplock.jobs")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    assert_eq!(count().await, 0, "nothing from a bad file was enqueued");

    let report = skiplock(
        &db,
        &["enqueue", "--file", &cases[3].0, "--skip-invalid", "--json"],
    )
    .await
    .ok();
    let report: Vec<Value> = report
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(report.len(), 3, "one object per line: {report:?}");
    assert_eq!(report[0]["outcome"], "inserted");
    assert_eq!(report[1]["line"], json!(2));
    assert!(
        report[1]["error"]
            .as_str()
            .unwrap()
            .contains("parent job 999999 does not exist"),
        "{report:?}"
    );
    assert_eq!(report[2]["outcome"], "inserted");
    assert_eq!(count().await, 2);
}

#[tokio::test]
async fn retry_and_cancel_move_jobs_and_refuse_clearly() {
    let db = test_db().await;
    let id = enqueue(&db, "noop", &json!({}), &["--in", "1h"]).await;
    let other = enqueue(&db, "noop", &json!({}), &["--in", "1h"]).await;
    let both = format!("{id} {other}");
    let ids: Vec<&str> = both.split(' ').collect();
    let mut args = vec!["cancel"];
    args.extend(&ids);
    assert_eq!(
        skiplock(&db, &args).await.ok(),
        format!("job {id} cancelled\njob {other} cancelled\n")
    );
    let again = skiplock(&db, &["cancel", &id.to_string(), "999999"]).await;
    assert_eq!(again.code, Some(1));
    assert_eq!(
        again.stderr,
        format!("error: job {id} already finished (cancelled); nothing to cancel\n{NOT_FOUND}")
    );

    assert_eq!(
        skiplock(&db, &["retry", &id.to_string()]).await.ok(),
        format!("job {id} queued to run now\n")
    );
    let row = job_json(&db.pool, id).await;
    assert_eq!(row["state"], json!("queued"));

    // Dead jobs in two queues; --dead --queue retries only one queue's.
    let a = enqueue(&db, "noop", &json!({}), &["--queue", "a"]).await;
    let b = enqueue(&db, "noop", &json!({}), &["--queue", "b"]).await;
    sqlx::query("UPDATE skiplock.jobs SET state = 'dead', finished_at = now() WHERE id = ANY($1)")
        .bind([a, b])
        .execute(&db.pool)
        .await
        .unwrap();
    let retried = skiplock(&db, &["retry", "--dead", "--queue", "a", "--json"])
        .await
        .json();
    assert_eq!(retried, json!({"retried": [a]}));
    assert_eq!(
        skiplock(&db, &["retry", "--dead"]).await.ok(),
        format!("retried 1 dead jobs: {b}\n")
    );
    assert_eq!(
        skiplock(&db, &["retry", "--dead", "--queue", "a"])
            .await
            .ok(),
        "no dead jobs in queue a to retry\n"
    );
}

#[tokio::test]
async fn stats_show_queues_and_kinds_in_both_formats_and_watch() {
    let db = test_db().await;
    for _ in 0..3 {
        enqueue(&db, "noop", &json!({}), &["--queue", "mail"]).await;
    }
    enqueue(&db, "sleep", &json!({"ms": 1}), &["--in", "1h"]).await;
    let dead = enqueue(&db, "noop", &json!({}), &[]).await;
    sqlx::query("UPDATE skiplock.jobs SET state = 'dead', finished_at = now() WHERE id = $1")
        .bind(dead)
        .execute(&db.pool)
        .await
        .unwrap();

    let text = skiplock(&db, &["stats"]).await.ok();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[2],
        "QUEUE    PAUSED  RUNNABLE  SCHEDULED  WAITING  RUNNING  OK/1H  DEAD/1H  LAG  JOBS/S"
    );
    assert!(
        lines[3]
            .starts_with("default  no             0          1        0        0      0        1"),
        "{text}"
    );
    assert!(
        lines[4].starts_with("mail     no             3          0"),
        "{text}"
    );
    assert!(text.contains("\nKIND "), "{text}");

    let stats = skiplock(&db, &["stats", "--json"]).await.json();
    assert_eq!(stats["total"]["runnable"], json!(3));
    assert_eq!(stats["total"]["scheduled"], json!(1));
    assert_eq!(stats["total"]["dead_last_hour"], json!(1));
    let queues: Vec<&Value> = stats["queues"].as_array().unwrap().iter().collect();
    assert_eq!(queues[1]["queue"], json!("mail"));
    assert!(queues[1]["lag_seconds"].as_f64().unwrap() >= 0.0);
    assert_eq!(stats["kinds"][0]["kind"], json!("noop"));

    // --watch --json prints one object per line until stopped; read the first one.
    let mut child = cli_support::command(&db)
        .args(["stats", "--watch", "--json", "--interval", "100ms"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for _ in 0..2 {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("a refresh within 60 s")
            .unwrap()
            .expect("stats --watch kept running");
        let frame: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(frame["total"]["runnable"], json!(3));
    }
    child.kill().await.unwrap();
}

#[tokio::test]
async fn prune_deletes_finished_jobs_older_than_asked() {
    let db = test_db().await;
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(enqueue(&db, "noop", &json!({}), &[]).await);
    }
    // succeeded 2 days ago, dead 2 days ago, succeeded 10 minutes ago, still queued.
    sqlx::query(
        "UPDATE skiplock.jobs SET state = s.state::skiplock.job_state,
             finished_at = now() - s.age
         FROM (VALUES ($1::bigint, 'succeeded', interval '2 days'),
                      ($2, 'dead', interval '2 days'),
                      ($3, 'succeeded', interval '10 minutes')) AS s(id, state, age)
         WHERE jobs.id = s.id",
    )
    .bind(ids[0])
    .bind(ids[1])
    .bind(ids[2])
    .execute(&db.pool)
    .await
    .unwrap();
    let remaining = || async {
        sqlx::query_scalar::<_, i64>("SELECT id FROM skiplock.jobs ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap()
    };
    // Default retention: succeeded after 1 day, dead after 14.
    assert_eq!(
        skiplock(&db, &["prune"]).await.ok(),
        "pruned 1 jobs that finished past the default retention\n"
    );
    assert_eq!(remaining().await, &ids[1..]);
    assert_eq!(
        skiplock(&db, &["prune", "--older-than", "1h", "--json"])
            .await
            .json(),
        json!({"pruned": 1, "partitions_dropped": 0, "partitions_left": 0})
    );
    assert_eq!(
        skiplock(&db, &["prune", "--older-than", "5m"]).await.ok(),
        "pruned 1 jobs that finished more than 5m ago\n"
    );
    assert_eq!(remaining().await, [ids[3]]);
}

#[tokio::test]
async fn work_runs_enqueued_jobs_until_idle() {
    let db = test_db().await;
    let noop = enqueue(&db, "noop", &json!({}), &[]).await;
    let sleep = enqueue(&db, "sleep", &json!({"ms": 10}), &["--queue", "other"]).await;
    let bad = sqlx::query_scalar::<_, i64>(r#"SELECT skiplock.enqueue('sleep', '{"ms": "soon"}')"#)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    work_until_idle(&db, &["--kinds", "noop,sleep"]).await;
    assert_eq!(job_json(&db.pool, noop).await["state"], json!("succeeded"));
    assert_eq!(job_json(&db.pool, bad).await["state"], json!("dead"));
    assert_eq!(
        job_json(&db.pool, sleep).await["state"],
        json!("queued"),
        "the worker claims only its queues"
    );
    work_until_idle(&db, &["--queue", "other", "--kinds", "sleep"]).await;
    assert_eq!(job_json(&db.pool, sleep).await["state"], json!("succeeded"));
}

#[tokio::test]
async fn operator_views_and_sql_functions_answer() {
    let db = test_db().await;
    let pool = &db.pool;
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT skiplock.enqueue('noop', jsonb_build_object('n', n), queue => q)
         FROM (VALUES (1, 'a'), (2, 'a'), (3, 'b')) AS v(n, q)",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE skiplock.jobs SET state = 'dead', finished_at = now(), last_error = 'gone'
         WHERE id = $1",
    )
    .bind(ids[0])
    .execute(pool)
    .await
    .unwrap();
    let counts: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT queue, queued, dead, total FROM skiplock.queue_counts ORDER BY queue",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(counts, [("a".into(), 1, 1, 2), ("b".into(), 1, 0, 1)]);
    let lagging: Vec<String> = sqlx::query_scalar(
        "SELECT queue FROM skiplock.queue_lag WHERE lag >= interval '0' ORDER BY queue",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(lagging, ["a", "b"]);
    let dead_last_hour: i64 =
        sqlx::query_scalar("SELECT dead_last_hour FROM skiplock.throughput WHERE queue = 'a'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(dead_last_hour, 1);
    let dead: Vec<(i64, String)> = sqlx::query_as("SELECT id, last_error FROM skiplock.dead_jobs")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(dead, [(ids[0], "gone".to_owned())]);
    let runnable: i64 = sqlx::query_scalar("SELECT sum(runnable)::bigint FROM skiplock.stats")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(runnable, 2);
    let retried: Vec<i64> = sqlx::query_scalar("SELECT * FROM skiplock.retry_dead_jobs('a')")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(retried, [ids[0]]);
    assert_eq!(job_json(pool, ids[0]).await["state"], json!("queued"));
}

#[tokio::test]
async fn enqueue_file_reads_stdin() {
    use tokio::io::AsyncWriteExt;

    let db = test_db().await;
    let mut child = cli_support::command(&db)
        .args(["enqueue", "--file", "-", "--json"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(b"{\"kind\": \"noop\"}\n{\"kind\": \"sleep\", \"args\": {\"ms\": 1}}\n")
        .await
        .unwrap();
    drop(stdin);
    let output = child.wait_with_output().await.unwrap();
    assert!(output.status.success());
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM skiplock.jobs ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let report = String::from_utf8(output.stdout).unwrap();
    assert_eq!(
        report,
        format!(
            "{{\"id\":{},\"line\":1,\"outcome\":\"inserted\"}}\n{{\"id\":{},\"line\":2,\"outcome\":\"inserted\"}}\n",
            ids[0], ids[1]
        )
    );
    let kinds: Vec<String> = sqlx::query_scalar("SELECT kind FROM skiplock.jobs ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(kinds, ["noop", "sleep"]);
}

/// A file whose lines a unique key folds into pending jobs: a skip, a replace, a merge; one
/// invalid line; three new jobs.
const UNIQUE_KEY_LINES: [&str; 8] = [
    r#"{"kind": "noop", "unique_key": "a", "args": {"n": 1}}"#,
    r#"{"kind": "noop", "unique_key": "a", "args": {"n": 2}}"#,
    "",
    r#"{"kind": "noop", "unique_key": "a", "args": {"n": 3}, "on_conflict": "replace"}"#,
    r#"{"kind": "noop", "unique_key": "b", "args": {"n": 4}, "on_conflict": "merge"}"#,
    r#"{"kind": "noop", "unique_key": "b", "args": {"n": 5}, "on_conflict": "merge"}"#,
    r#"{"kind": "noop", "priority": "high"}"#,
    r#"{"kind": "noop"}"#,
];

/// `enqueue --file` without `--json` counts as enqueued only the new jobs, and says how
/// many lines a unique key folded into pending jobs, by policy (they were counted as
/// enqueued jobs).
#[tokio::test]
async fn enqueue_file_summary_counts_lines_folded_by_a_unique_key_apart() {
    let db = test_db().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.ndjson");
    std::fs::write(&path, UNIQUE_KEY_LINES.join("\n")).unwrap();
    let path = path.to_str().unwrap();
    let out = skiplock(&db, &["enqueue", "--file", path, "--skip-invalid"])
        .await
        .ok();
    let (head, tail) = out.trim_end().split_once(" in ").expect("a summary line");
    assert_eq!(head, format!("enqueued 3 jobs from {path}"));
    let tail = tail.split_once("; ").map(|(_, rest)| rest).unwrap_or("");
    assert_eq!(
        tail,
        "1 skipped: a pending job has the same unique key; \
         1 replaced the args of the pending job of their unique key; \
         1 merged into the pending job of their unique key; skipped 1 invalid lines"
    );
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(jobs, 3);
}

/// `enqueue --file --json` prints one object per line of the file, in the file's order:
/// the job's id and what the enqueue did, told apart for every unique-key policy, and the
/// error of a line that `--skip-invalid` skipped. Blank lines are no jobs and print
/// nothing.
#[tokio::test]
async fn enqueue_file_json_reports_each_lines_outcome() {
    let db = test_db().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.ndjson");
    std::fs::write(&path, UNIQUE_KEY_LINES.join("\n")).unwrap();
    let stdout = skiplock(
        &db,
        &[
            "enqueue",
            "--file",
            path.to_str().unwrap(),
            "--skip-invalid",
            "--json",
        ],
    )
    .await
    .ok();
    let report: Vec<Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM skiplock.jobs ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let [a, b, plain] = ids[..] else {
        panic!("three jobs: {ids:?}")
    };
    assert_eq!(
        report,
        [
            json!({"line": 1, "id": a, "outcome": "inserted"}),
            json!({"line": 2, "id": a, "outcome": "skipped"}),
            json!({"line": 4, "id": a, "outcome": "replaced"}),
            json!({"line": 5, "id": b, "outcome": "inserted"}),
            json!({"line": 6, "id": b, "outcome": "merged"}),
            json!({"line": 7, "error": "invalid type: string \"high\", expected i16"}),
            json!({"line": 8, "id": plain, "outcome": "inserted"}),
        ]
    );
    let args: Vec<Value> =
        sqlx::query_scalar("SELECT args FROM skiplock.jobs WHERE id = ANY($1) ORDER BY id")
            .bind([a, b])
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(args, [json!({"n": 3}), json!([{"n": 4}, {"n": 5}])]);
}

/// Inserts, by plain SQL, rows whose timestamps the table accepts but `chrono` cannot
/// hold or Postgres cannot subtract: `'-infinity'`, `'infinity'` and a year past 262143.
/// Returns their ids: due first, never due, year 290000, finished at `'infinity'`.
async fn insert_rows_with_extreme_timestamps(pool: &sqlx::PgPool) -> [i64; 4] {
    let ids: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, scheduled_at) VALUES
             ('noop', '{}', '-infinity'), ('noop', '{}', 'infinity'),
             ('noop', '{}', '290000-01-01 00:00:00+00')
         RETURNING id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let finished: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, state, attempt, claimed_by, claimed_at, finished_at)
         VALUES ('noop', '{}', 'succeeded', 1, 'by-hand', '-infinity', 'infinity')
         RETURNING id",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    [ids[0], ids[1], ids[2], finished]
}

#[tokio::test]
async fn rows_with_infinite_timestamps_are_listed_shown_and_counted() {
    // Regression: `skiplock jobs` panicked (chrono overflow, exit 101) on such a row, and
    // `skiplock stats` failed for every queue ("cannot subtract infinite timestamps").
    let db = test_db().await;
    let [due, never, far, finished] = insert_rows_with_extreme_timestamps(&db.pool).await;

    let list = skiplock(&db, &["jobs"]).await.ok();
    assert!(
        list.contains("-infinity") && list.contains(" infinity"),
        "{list}"
    );
    let listed = skiplock(&db, &["jobs", "--json"]).await.json();
    assert_eq!(listed.as_array().map(Vec::len), Some(4), "{listed}");
    for id in [due, never, far, finished] {
        let shown = skiplock(&db, &["show", &id.to_string()]).await.ok();
        assert!(shown.contains(&format!("{id}")), "{shown}");
        skiplock(&db, &["show", &id.to_string(), "--json"])
            .await
            .json();
    }
    let stats = skiplock(&db, &["stats", "--json"]).await.json();
    assert_eq!(stats["total"]["runnable"], json!(1), "{stats}");
    assert_eq!(stats["total"]["scheduled"], json!(2), "{stats}");
    skiplock(&db, &["stats"]).await.ok();

    // The library reads them saturated to what chrono holds.
    use chrono::{DateTime, Utc};
    for (id, expected) in [
        (never, DateTime::<Utc>::MAX_UTC),
        (due, DateTime::<Utc>::MIN_UTC),
        (far, DateTime::<Utc>::MAX_UTC),
    ] {
        let row = skiplock::job(&db.pool, skiplock::JobId(id)).await.unwrap();
        assert_eq!(row.map(|row| row.scheduled_at), Some(expected), "job {id}");
    }

    // The operator views answer too.
    let lag: f64 =
        sqlx::query_scalar("SELECT coalesce(max(lag_seconds), 0) FROM skiplock.queue_lag")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(lag.is_finite());
}

#[tokio::test]
async fn bad_input_gets_one_clear_line_and_the_documented_exit_code() {
    let db = test_db().await;
    // Usage errors: exit 2 with clap's message.
    for (args, says) in [
        (&["queue", "pause", ""][..], "a queue name cannot be empty"),
        (&["queue", "resume", " mail"], "has spaces around it"),
        (
            &["stats", "--watch", "--interval", "0s"],
            "is too short to refresh at; use 100ms or more",
        ),
        (
            &["cron", "add", "nightly", "0 3 * * *", "noop", "{bad"],
            "not valid JSON",
        ),
    ] {
        let run = skiplock(&db, args).await;
        assert_eq!(run.code, Some(2), "{args:?}: {run:?}");
        assert!(run.stderr.contains(says), "{args:?}: {}", run.stderr);
    }
    // Failures: exit 1, one line that names the problem and the fix.
    // A malformed expression is a usage error: exit 2, its own line first.
    let run = skiplock(&db, &["cron", "add", "nightly", "0 99 * * *", "noop"]).await;
    assert_eq!(run.code, Some(2));
    assert_eq!(
        run.stderr.lines().next().unwrap_or_default(),
        "error: invalid cron expression `0 99 * * *`: hour field `99` (characters 3-4) is wrong: \
         use 0-23, a list (9,17), a range (9-17), a step (*/2) or *"
    );
    let other_url = |url: &'static str, args: &'static [&'static str]| async move {
        let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_skiplock"))
            .env_remove("DATABASE_URL")
            .args(["--database-url", url, "--connect-retry", "0s"])
            .args(args)
            .output()
            .await
            .unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (code, stderr) = other_url("mysql://root:secret@127.0.0.1/app", &["jobs"]).await;
    assert_eq!(code, Some(1));
    assert_eq!(
        stderr,
        "error: the database URL mysql://root:***@127.0.0.1/app is not a Postgres URL; \
         skiplock needs postgres://user@host:port/db\n"
    );
    // An IPv6 host is an address, not a name to look up (nothing listens on port 1).
    let (code, stderr) = other_url("postgres://postgres@[::1]:1/app", &["jobs"]).await;
    assert_eq!(code, Some(1));
    assert!(
        !stderr.contains("lookup") && stderr.contains("os error"),
        "{stderr}"
    );
    // A database without the schema: named, with the fix (more in tests/cli_bad_input.rs).
    sqlx::query("DROP SCHEMA skiplock CASCADE")
        .execute(&db.pool)
        .await
        .unwrap();
    let run = skiplock(&db, &["stats"]).await;
    assert_eq!(run.code, Some(1));
    assert_eq!(
        run.stderr,
        format!(
            "error: the database `{}` has no skiplock schema; run `skiplock migrate` on it first\n",
            db.name
        )
    );
}

/// Starts `skiplock work --metrics-addr` on a port found free and returns it with the
/// address once the endpoint answers. A port found free may be taken before the worker
/// binds it (by another test's server, or as some connection's local port): the worker
/// then exits at once with its error, and it is started again on another port.
async fn work_serving_metrics(
    db: &common::TestDb,
    client: &reqwest::Client,
) -> (tokio::process::Child, String) {
    for _ in 0..5 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let mut worker = cli_support::command(db)
            .args(["work", "--metrics-addr", &addr])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while std::time::Instant::now() < deadline {
            if worker.try_wait().unwrap().is_some() {
                break;
            }
            if client
                .get(format!("http://{addr}/metrics"))
                .send()
                .await
                .is_ok()
            {
                return (worker, addr);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            worker.try_wait().unwrap().is_some(),
            "the worker neither served its metrics on {addr} nor exited within 60 s"
        );
    }
    panic!("skiplock work could not serve its metrics on five ports found free");
}

#[tokio::test]
async fn work_serves_its_metrics_as_prometheus_text() {
    let db = test_db().await;
    for _ in 0..5 {
        enqueue(&db, "noop", &json!({}), &[]).await;
    }
    // Args of the wrong type: a permanent failure, dead at once.
    let dead =
        sqlx::query_scalar::<_, i64>(r#"SELECT skiplock.enqueue('sleep', '{"ms": "soon"}')"#)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let (mut worker, addr) = work_serving_metrics(&db, &client).await;
    common::fixtures::wait_for("every job to end", Duration::from_secs(60), || async {
        let unfinished: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM skiplock.jobs WHERE state NOT IN ('succeeded', 'dead')",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        unfinished == 0
    })
    .await;
    assert_eq!(
        job_json(&db.pool, dead).await["state"],
        json!("dead"),
        "the sleep job died"
    );
    // The last outcome is counted just after its row is written: poll the endpoint.
    let url = format!("http://{addr}/metrics");
    let mut text = String::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        if let Ok(response) = client.get(&url).send().await {
            text = response.text().await.unwrap_or_default();
            if text.contains("outcome=\"dead\"") && text.contains("outcome=\"succeeded\"") {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worker.kill().await.unwrap();
    let series = |name: &str, labels: &[&str]| -> Option<f64> {
        text.lines()
            .filter(|line| line.starts_with(name) && labels.iter().all(|l| line.contains(l)))
            .find_map(|line| line.rsplit(' ').next()?.parse().ok())
    };
    assert_eq!(
        series(
            "skiplock_jobs_total",
            &[
                "kind=\"noop\"",
                "queue=\"default\"",
                "outcome=\"succeeded\""
            ]
        ),
        Some(5.0),
        "{text}"
    );
    assert_eq!(
        series(
            "skiplock_jobs_total",
            &["kind=\"sleep\"", "outcome=\"dead\""]
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(series("skiplock_jobs_running", &[]), Some(0.0), "{text}");
    assert!(
        series("skiplock_claim_duration_seconds_count", &[]).is_some_and(|n| n >= 1.0),
        "{text}"
    );
    assert!(
        series("skiplock_job_duration_seconds_count", &["kind=\"noop\""]) == Some(5.0),
        "{text}"
    );
}

#[tokio::test]
async fn demo_never_touches_the_database_it_is_given() {
    // Regression: with DATABASE_URL exported (as sqlx users keep it), the demo wrote its
    // jobs into that database and its worker ran the application's own jobs.
    let db = test_db().await;
    let app_job = enqueue(&db, "noop", &json!({}), &[]).await;
    sqlx::query("CREATE TABLE public.orders (id int)")
        .execute(&db.pool)
        .await
        .unwrap();
    // A demo database of the test's own: `skiplock_demo` may hold the quick start's data.
    let demo_name = format!("{}_demo", db.name);
    let output = cli_support::command(&db)
        .args(["demo", "--database", &demo_name])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert!(
        stdout.contains(&format!(
            "database `{demo_name}` (recreated); database `{}` is not touched",
            db.name
        )),
        "{stdout}"
    );
    let jobs: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, state::text FROM skiplock.jobs ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(jobs, vec![(app_job, "queued".to_owned())]);

    // Pointed at the demo's own database (as after a first demo), it recreates it: before,
    // its session in that database kept it from being dropped. One test for both runs:
    // two demos at once would drop each other's database.
    let demo_url = db
        .url()
        .replace(&format!("/{}", db.name), &format!("/{demo_name}"));
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_skiplock"))
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .args([
            "--database-url",
            &demo_url,
            "demo",
            "--database",
            &demo_name,
        ])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert!(
        stdout.contains(&format!("database `{demo_name}` (recreated).\n")),
        "{stdout}"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE \"{demo_name}\" WITH (FORCE)"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn json_logs_carry_the_job_span_fields() {
    let db = test_db().await;
    // Args of the wrong type: the job dies at once, logged at ERROR in its span.
    let id = sqlx::query_scalar::<_, i64>(r#"SELECT skiplock.enqueue('sleep', '{"ms": "soon"}')"#)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let run = skiplock(&db, &["--log-format", "json", "work", "--exit-when-idle"]).await;
    assert_eq!(run.code, Some(0), "{run:#?}");
    let dead: Value = run
        .stderr
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|line| line["level"] == json!("ERROR"))
        .unwrap_or_else(|| panic!("an ERROR line in JSON: {}", run.stderr));
    assert_eq!(dead["span"]["name"], json!("job"), "{dead}");
    assert_eq!(dead["span"]["job_id"], json!(id), "{dead}");
    assert_eq!(dead["span"]["kind"], json!("sleep"), "{dead}");
    assert_eq!(dead["span"]["queue"], json!("default"), "{dead}");
    assert_eq!(dead["span"]["attempt"], json!(1), "{dead}");
    assert!(
        dead["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("job failed and is dead")),
        "{dead}"
    );
}

/// A reader that stops early (`skiplock jobs | head -1`, `skiplock stats --watch | head`)
/// ends the command quietly with exit 0: before, `jobs` panicked (exit 101, "failed
/// printing to stdout: Broken pipe") and `stats` said `error: Broken pipe` and exited 1.
#[tokio::test]
async fn a_reader_that_stops_early_ends_the_command_quietly() {
    let db = test_db().await;
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, args)
         SELECT 'noop', jsonb_build_object('padding', repeat('x', 200))
         FROM generate_series(1, 2000)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // `jobs` writes more than a pipe holds (2,000 rows); `stats --watch` writes again and
    // again.
    for args in [
        &["jobs", "--limit", "2000", "--json"][..],
        &["stats", "--watch", "--interval", "100ms"][..],
    ] {
        let mut child = cli_support::command(&db)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        stdout.read_line(&mut first).await.unwrap();
        assert!(!first.is_empty(), "{args:?} printed something");
        drop(stdout);
        let output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
            .await
            .expect("the command ends once its reader is gone")
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(0), "{args:?}: {stderr}");
        assert_eq!(stderr, "", "{args:?}");
    }
}

/// `skiplock work`'s production settings, from flags and from their environment
/// variables, reach the worker: its start line reports each of them.
#[tokio::test]
async fn work_settings_reach_the_worker() {
    let db = test_db().await;
    let output = cli_support::command(&db)
        .env("SKIPLOCK_RETAIN_SUCCEEDED", "1h")
        .env("SKIPLOCK_QUEUES", "default,mail")
        .env("SKIPLOCK_QUEUE_WEIGHTS", "mail=3")
        .args([
            "--log-format",
            "json",
            "work",
            "--exit-when-idle",
            "--concurrency",
            "5",
            "--queue-concurrency",
            "reports=3",
            "--prefetch",
            "7",
            "--heartbeat",
            "500ms",
            "--stale-after",
            "3s",
            "--poll-interval",
            "250ms",
            "--prune-interval",
            "0s",
            "--retain-dead",
            "2d",
        ])
        .env("RUST_LOG", "info")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let started: Value = stderr
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|line| line["fields"]["message"] == json!("worker started"))
        .unwrap_or_else(|| panic!("a start line: {stderr}"));
    let fields = &started["fields"];
    assert_eq!(
        fields["queues"],
        json!("[\"default\", \"mail\", \"reports\"]"),
        "{fields}"
    );
    assert_eq!(
        fields["queue_concurrency"],
        json!("{\"reports\": 3}"),
        "{fields}"
    );
    assert_eq!(fields["concurrency"], json!(5), "{fields}");
    assert_eq!(fields["queue_weights"], json!("{\"mail\": 3}"), "{fields}");
    assert_eq!(fields["prefetch"], json!(7), "{fields}");
    assert_eq!(fields["prefetch_max"], json!(7), "{fields}");
    assert_eq!(fields["heartbeat_ms"], json!(500), "{fields}");
    assert_eq!(fields["stale_after_ms"], json!(3000), "{fields}");
    assert_eq!(fields["poll_interval_ms"], json!(250), "{fields}");
    assert_eq!(
        fields.get("prune_interval_ms"),
        None,
        "pruning off: {fields}"
    );
    assert_eq!(fields["retain_succeeded_s"], json!(3600), "{fields}");
    assert_eq!(fields["retain_cancelled_s"], json!(86400), "{fields}");
    assert_eq!(fields["retain_dead_s"], json!(2 * 86400), "{fields}");
}

/// Settings that cannot work are usage errors (exit 2) naming the problem.
#[tokio::test]
async fn work_refuses_settings_that_cannot_work() {
    let db = test_db().await;
    for (args, expected) in [
        (
            &["work", "--heartbeat", "2s", "--stale-after", "3s"][..],
            "stale_after (3s) must exceed twice the heartbeat interval (2s)",
        ),
        (
            &["work", "--queue-concurrency", "mail"][..],
            "`mail` has no `=`; write QUEUE=SLOTS, like mail=4",
        ),
        (
            &["work", "--queue-concurrency", "mail=0"][..],
            "`0` is not a number of slots (1 or more)",
        ),
        (
            &["work", "--queue-weight", "mail=2"][..],
            "queue `mail` has a weight but this worker does not claim from it",
        ),
        (
            &["work", "--queue", "mail", "--queue-weight", "mail=1001"][..],
            "`1001` is not a weight (1 to 1000)",
        ),
        (
            &["work", "--heartbeat", "soon"][..],
            "`soon` is not a duration",
        ),
        (
            &["work", "--prefetch", "0"][..],
            "`0` is not a number of jobs to keep ready; use a whole number from 1 up",
        ),
    ] {
        let run = skiplock(&db, args).await;
        assert_eq!(run.code, Some(2), "{args:?}: {run:#?}");
        assert!(run.stderr.contains(expected), "{args:?}: {}", run.stderr);
    }
}

/// `--stale-after` is the reaper's: a claim whose heartbeat stopped 10 s ago is taken back
/// by a worker told 5 s (under the default 30 s it would still be `running`), and its
/// error says so; the job waits for its retry's backoff. The claim is its 12th attempt,
/// so the backoff is an hour (its cap): the worker exits idle long before, however slow
/// the machine (after a first attempt, the 2 s backoff raced the exit).
#[tokio::test]
async fn work_stale_after_sets_when_claims_are_taken_back() {
    let db = test_db().await;
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, state, attempt, claim_token, claimed_by,
                                    claimed_at, heartbeat_at)
         VALUES ('noop', '{}', 'running', 12, gen_random_uuid(), 'gone',
                 now() - interval '10 s', now() - interval '10 s')
         RETURNING id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    work_until_idle(&db, &["--stale-after", "5s", "--heartbeat", "1s"]).await;
    let (state, first_error): (String, String) = sqlx::query_as(
        "SELECT state::text, errors -> 0 ->> 'message' FROM skiplock.jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(state, "queued");
    assert!(
        first_error.contains("no heartbeat from gone for over 5000 ms"),
        "{first_error}"
    );
}

/// `--retain-succeeded` and `--prune-interval` are the pruner's: a job that succeeded 2 h
/// ago is deleted under a 1 h retention, one that succeeded 10 min ago is kept.
#[tokio::test]
async fn work_retention_sets_what_the_pruner_deletes() {
    let db = test_db().await;
    let ids: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, state, attempt, finished_at)
         VALUES ('noop', '{}', 'succeeded', 1, now() - interval '2 h'),
                ('noop', '{}', 'succeeded', 1, now() - interval '10 min')
         RETURNING id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let _worker = cli_support::command(&db)
        .args([
            "work",
            "--retain-succeeded",
            "1h",
            "--prune-interval",
            "100ms",
        ])
        .spawn()
        .unwrap();
    common::fixtures::wait_for(
        "the pruner to delete the old job",
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM skiplock.jobs WHERE id = $1")
                .bind(ids[0])
                .fetch_one(&db.pool)
                .await
                .unwrap()
                == 0
        },
    )
    .await;
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM skiplock.jobs ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, vec![ids[1]]);
}

/// `skiplock wait`: it returns once the jobs' outcomes committed, a line each, exit 0 only
/// when every one succeeded; a job that is not there or not finished in time is its own
/// line, and exit 1.
#[tokio::test]
async fn wait_prints_each_outcome_once_it_committed() {
    let db = test_db().await;
    let done = enqueue(&db, "noop", &json!({}), &[]).await;
    let dead = enqueue(&db, "noop", &json!({}), &[]).await;
    let waiter = {
        let args = [
            "wait".to_owned(),
            done.to_string(),
            dead.to_string(),
            "--json".to_owned(),
        ];
        let command = cli_support::command(&db);
        tokio::spawn(async move {
            let mut command = command;
            command.args(&args).output().await.unwrap()
        })
    };
    common::fixtures::wait_for(
        "the wait to mark both jobs",
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM skiplock.jobs WHERE awaited")
                .fetch_one(&db.pool)
                .await
                .unwrap()
                == 2
        },
    )
    .await;
    // One succeeds by a worker's hand, the other dies by an operator's UPDATE.
    sqlx::query(
        "UPDATE skiplock.jobs SET state = 'dead', finished_at = now(), last_error = 'gave up'
         WHERE id = $1",
    )
    .bind(dead)
    .execute(&db.pool)
    .await
    .unwrap();
    work_until_idle(&db, &[]).await;
    let output = waiter.await.unwrap();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let lines: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(
        (lines[0]["id"].as_i64(), lines[0]["state"].as_str()),
        (Some(done), Some("succeeded"))
    );
    assert_eq!(
        (lines[1]["id"].as_i64(), lines[1]["state"].as_str()),
        (Some(dead), Some("dead"))
    );
    assert_eq!(lines[1]["last_error"], "gave up");
    assert!(String::from_utf8_lossy(&output.stderr).contains("1 of 2 jobs did not succeed"));

    let text = skiplock(&db, &["wait", &done.to_string()]).await.ok();
    assert!(
        text.starts_with(&format!("job {done} succeeded (attempt 1) at ")),
        "{text}"
    );

    let waiting = enqueue(&db, "noop", &json!({}), &["--queue", "nobody-works-here"]).await;
    let late = skiplock(
        &db,
        &["wait", &waiting.to_string(), "424242", "--timeout", "1s"],
    )
    .await;
    assert_eq!(late.code, Some(1));
    assert!(
        late.stdout.contains(&format!(
            "job {waiting} had not finished after 1s (it is queued)"
        )),
        "{late:?}"
    );
    assert!(
        late.stdout.contains("job 424242 does not exist"),
        "{late:?}"
    );
}

/// `skiplock enqueue` records a trace context: `--traceparent` (and `--tracestate`), else
/// the `TRACEPARENT` and `TRACESTATE` of its environment (OpenTelemetry's carriers for a
/// process), one there that does not parse being no trace (the job is enqueued without
/// one), and an NDJSON line's own `traceparent` over the command line's.
#[tokio::test]
async fn enqueue_records_the_trace_context_from_its_flags_its_environment_or_a_line() {
    const FLAG: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    const ENV: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    const LINE: &str = "00-11111111111111111111111111111111-2222222222222222-00";
    let db = test_db().await;
    let enqueue_with = |args: Vec<String>, env: Vec<(&'static str, &'static str)>| {
        let mut command = cli_support::command(&db);
        command
            .env_remove("TRACEPARENT")
            .env_remove("TRACESTATE")
            .arg("enqueue")
            .args(args)
            .envs(env);
        async move {
            let out = command.output().await.unwrap();
            assert_eq!(out.status.code(), Some(0), "{out:?}");
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        }
    };
    let trace_of = |id: String| {
        let pool = db.pool.clone();
        async move {
            let job = job_json(&pool, id.parse().unwrap()).await;
            (job["traceparent"].clone(), job["tracestate"].clone())
        }
    };
    let flagged = enqueue_with(
        vec![
            "noop".into(),
            "--traceparent".into(),
            FLAG.into(),
            "--tracestate".into(),
            "a=1".into(),
        ],
        vec![("TRACEPARENT", ENV)],
    )
    .await;
    assert_eq!(trace_of(flagged).await, (json!(FLAG), json!("a=1")));
    let from_env = enqueue_with(
        vec!["noop".into()],
        vec![("TRACEPARENT", ENV), ("TRACESTATE", "b=2")],
    )
    .await;
    assert_eq!(trace_of(from_env).await, (json!(ENV), json!("b=2")));
    let junk = enqueue_with(vec!["noop".into()], vec![("TRACEPARENT", "junk")]).await;
    assert_eq!(trace_of(junk).await, (Value::Null, Value::Null));

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.ndjson");
    std::fs::write(
        &path,
        format!("{{\"kind\": \"noop\", \"traceparent\": \"{LINE}\"}}\n{{\"kind\": \"noop\"}}\n"),
    )
    .unwrap();
    let out = enqueue_with(
        vec![
            "--file".into(),
            path.to_str().unwrap().into(),
            "--json".into(),
        ],
        vec![("TRACEPARENT", ENV)],
    )
    .await;
    let ids: Vec<String> = out
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).unwrap()["id"].to_string())
        .collect();
    assert_eq!(trace_of(ids[0].clone()).await.0, json!(LINE));
    assert_eq!(trace_of(ids[1].clone()).await.0, json!(ENV));
}
