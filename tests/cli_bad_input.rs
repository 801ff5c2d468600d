//! Bad input a new user types (issue 16): each gets one line on stderr naming the problem
//! and what to do, and the documented exit code: 1 for a failure, 2 for a usage error.
//!
//! One table of cases, each checked for its exact line. A failure (exit 1) prints that line
//! and nothing else. A usage error (exit 2) prints that line, then clap's pointer to
//! `--help` (and, for some errors, the usage line), which is not part of the message.
//!
//! Cases with an exact test elsewhere are not repeated here: a `mysql://` URL and a
//! malformed cron expression (tests/cli.rs `bad_input_gets_one_clear_line_…`), a closed
//! port, a missing database and a URL that is not one (tests/faults_input.rs
//! `unreachable_and_wrong_database_urls_…`), a schema older or newer than the binary
//! (tests/faults_input.rs `schemas_older_or_newer_…`), unknown job ids (tests/cli.rs), and
//! the dashboard's `/jobs/abc` (tests/dashboard/http.rs `a_job_path_that_is_not_an_id_…`).
#![cfg(feature = "cli")]

mod common;

use std::process::Stdio;

use common::test_db;

/// Which database a case runs against.
enum Target {
    /// The test's own migrated database.
    Migrated,
    /// A database with no skiplock schema.
    NoSchema,
    /// The test's own database, as a role that does not exist.
    UnknownRole,
    /// The test's own database, as a role that may log in and nothing more.
    PowerlessRole,
    /// This URL.
    Url(&'static str),
}

/// One bad input and what it must print.
struct Case {
    args: &'static [&'static str],
    target: Target,
    code: i32,
    /// The exact line; `{db}` stands for the database's name, `{url}` for its URL, and
    /// `{os}` for the operating system's own words (a resolver's or a socket's error, which
    /// differ between machines).
    line: &'static str,
}

const fn usage(args: &'static [&'static str], line: &'static str) -> Case {
    Case {
        args,
        target: Target::Migrated,
        code: 2,
        line,
    }
}

const fn failure(args: &'static [&'static str], target: Target, line: &'static str) -> Case {
    Case {
        args,
        target,
        code: 1,
        line,
    }
}

const CASES: &[Case] = &[
    // Global limits.
    usage(
        &["queue", "limit", "exports", "--max-running", "0"],
        "error: invalid value '0' for '--max-running <N|none>': a limit of 0 running jobs would stop the queue; pause it instead (skiplock queue pause), or write `none` to remove the limit",
    ),
    // A negative number reaches the option's own check, not clap's `-- -1` tip.
    usage(
        &["queue", "limit", "exports", "--max-running", "-1"],
        "error: invalid value '-1' for '--max-running <N|none>': `-1` is not a number of jobs; write one from 1 to 2147483647, or `none`",
    ),
    usage(
        &["queue", "limit", "mail", "--rate", "-5/1s"],
        "error: invalid value '-5/1s' for '--rate <N/PERIOD|none>': `-5/1s` is not a rate; write starts/period, like 100/1s or 5000/1m, or `none`",
    ),
    usage(
        &["queue", "limit", "mail", "--rate", "100"],
        "error: invalid value '100' for '--rate <N/PERIOD|none>': `100` is not a rate; write starts/period, like 100/1s or 5000/1m, or `none`",
    ),
    usage(
        &["queue", "limit", "mail", "--rate", "0/1s"],
        "error: invalid value '0/1s' for '--rate <N/PERIOD|none>': a rate of 0 starts per period is out of range; write 1 to 100000 (for more, use a shorter period), or `none`",
    ),
    // Connections.
    failure(
        &["jobs"],
        Target::UnknownRole,
        "error: the server at {url} refused the login: role \"nobody_{db}\" does not exist (SQLSTATE 28000); check the user and password in --database-url / DATABASE_URL",
    ),
    // An IPv6 address is connected to, not looked up; nothing listens on port 1.
    failure(
        &["jobs"],
        Target::Url("postgres://postgres@[::1]:1/app"),
        "error: cannot connect to the database at postgres://postgres@[::1]:1/app; check --database-url / DATABASE_URL and that Postgres is running: error communicating with database: {os}",
    ),
    // A host no resolver knows: nothing says that Postgres is down.
    failure(
        &["jobs"],
        Target::Url("postgres://postgres@no-such-host.invalid:5432/app"),
        "error: cannot find the host `no-such-host.invalid` of the database URL postgres://postgres@no-such-host.invalid:5432/app (failed to lookup address information: {os}); check the host name in --database-url / DATABASE_URL",
    ),
    failure(
        &["jobs"],
        Target::Url(""),
        "error: the database URL is empty; set --database-url / DATABASE_URL to postgres://user@host:port/db, or leave both out for the local server",
    ),
    failure(
        &["jobs"],
        Target::Url("postgres://postgres@127.0.0.1:5432/app?sslmode=bogus"),
        "error: the database URL is malformed (unknown value \"bogus\" for `ssl_mode`); write it like postgres://user@host:port/db",
    ),
    failure(
        &["jobs"],
        Target::Url("postgres://postgres@127.0.0.1:port/app"),
        "error: the database URL is malformed (invalid port number); write it like postgres://user@host:port/db",
    ),
    usage(
        &["--connect-retry", "soon", "jobs"],
        "error: invalid value 'soon' for '--connect-retry <DURATION>': `soon` is not a duration; write a number and a unit, like 30s, 5m, 2h or 1d",
    ),
    // A database without the schema, whatever the command.
    failure(
        &["jobs"],
        Target::NoSchema,
        "error: the database `{db}` has no skiplock schema; run `skiplock migrate` on it first",
    ),
    failure(
        &["enqueue", "noop"],
        Target::NoSchema,
        "error: the database `{db}` has no skiplock schema; run `skiplock migrate` on it first",
    ),
    failure(
        &["cancel", "1"],
        Target::NoSchema,
        "error: the database `{db}` has no skiplock schema; run `skiplock migrate` on it first",
    ),
    failure(
        &["cron", "list"],
        Target::NoSchema,
        "error: the database `{db}` has no skiplock schema; run `skiplock migrate` on it first",
    ),
    failure(
        &["work", "--exit-when-idle"],
        Target::NoSchema,
        "error: the database `{db}` has no skiplock schema; run `skiplock migrate` on it first",
    ),
    failure(
        &["dashboard", "--bind", "127.0.0.1:0"],
        Target::NoSchema,
        "error: the database `{db}` has no skiplock schema; run `skiplock migrate` on it first",
    ),
    // A role without the privileges.
    failure(
        &["jobs"],
        Target::PowerlessRole,
        "error: permission denied for schema skiplock; the role in --database-url / DATABASE_URL may not do this: connect as one that may (such as the one that ran `skiplock migrate`), or GRANT it the privilege",
    ),
    failure(
        &["cancel", "1", "2"],
        Target::PowerlessRole,
        "error: permission denied for schema skiplock; the role in --database-url / DATABASE_URL may not do this: connect as one that may (such as the one that ran `skiplock migrate`), or GRANT it the privilege",
    ),
    // Queues.
    usage(
        &["queue", "pause", ""],
        "error: invalid value '' for '<QUEUE>': a queue name cannot be empty; name one, like mail",
    ),
    // Cron: every malformed argument is a usage error.
    usage(
        &["cron", "add", "nightly", "0 3 * * *", "noop", "{bad"],
        "error: invalid value '{bad' for '[ARGS]': not valid JSON: key must be a string at line 1 column 2; write JSON in single quotes, like '{\"ms\": 500}'",
    ),
    usage(
        &["cron", "add", "", "0 3 * * *", "noop"],
        "error: invalid value '' for '<NAME>': a schedule name cannot be empty; name it, like nightly-report",
    ),
    usage(
        &["cron", "add", "nightly", "0 3 * * *", "noop", "--queue", ""],
        "error: invalid value '' for '--queue <QUEUE>': a queue name cannot be empty; name one, like mail",
    ),
    usage(
        &[
            "cron",
            "add",
            "nightly",
            "0 3 * * *",
            "noop",
            "--max-attempts",
            "0",
        ],
        "error: invalid value '0' for '--max-attempts <MAX_ATTEMPTS>': `0` is not a number of attempts; use a whole number from 1 up",
    ),
    // Stats.
    usage(
        &["stats", "--watch", "--interval", "0s"],
        "error: invalid value '0s' for '--interval <DURATION>': `0s` is too short to refresh at; use 100ms or more, like 2s",
    ),
    // Listing and single jobs.
    usage(
        &["jobs", "--state", "finished"],
        "error: invalid value 'finished' for '--state <S>': unknown job state `finished`; expected one of: waiting, queued, running, succeeded, dead, cancelled",
    ),
    usage(
        &["jobs", "--limit", "-3"],
        "error: invalid value '-3' for '--limit <N>': `-3` is not a number of jobs to list; use a whole number from 1 up",
    ),
    usage(
        &["show", "abc"],
        "error: invalid value 'abc' for '<ID>': `abc` is not a job id; job ids are whole numbers from 1 up, like 42 (list them with `skiplock jobs`)",
    ),
    usage(
        &["cancel", "-1"],
        "error: invalid value '-1' for '<ID>...': `-1` is not a job id; job ids are whole numbers from 1 up, like 42 (list them with `skiplock jobs`)",
    ),
    usage(
        &["jobs", "--queue", ""],
        "error: invalid value '' for '--queue <Q>': a queue name cannot be empty; name one, like mail",
    ),
    usage(
        &["prune", "--older-than", "20000y"],
        "error: invalid value '20000y' for '--older-than <DURATION>': `20000y` is longer than skiplock can schedule or keep; use at most 1000y",
    ),
    usage(
        &["prune", "--older-than", "-5m"],
        "error: invalid value '-5m' for '--older-than <DURATION>': `-5m` is not a duration; write a number and a unit, like 30s, 5m, 2h or 1d",
    ),
    // Worker settings.
    usage(
        &["work", "--concurrency", "0"],
        "error: invalid value '0' for '--concurrency <CONCURRENCY>': `0` is not a number of job slots; use a whole number from 1 up",
    ),
    usage(
        &["work", "--concurrency", "-2"],
        "error: invalid value '-2' for '--concurrency <CONCURRENCY>': `-2` is not a number of job slots; use a whole number from 1 up",
    ),
    usage(
        &["work", "--queue-weight", "mail"],
        "error: invalid value 'mail' for '--queue-weight <Q=W>': `mail` has no `=`; write QUEUE=WEIGHT, like mail=3",
    ),
    usage(
        &["work", "--queue-weight", "mail=x"],
        "error: invalid value 'mail=x' for '--queue-weight <Q=W>': `x` is not a weight (1 to 1000); write QUEUE=WEIGHT, like mail=3",
    ),
    usage(
        &["work", "--queue-concurrency", "mail=0"],
        "error: invalid value 'mail=0' for '--queue-concurrency <Q=N>': `0` is not a number of slots (1 or more); write QUEUE=SLOTS, like mail=4",
    ),
    usage(
        &["work", "--heartbeat", "2"],
        "error: invalid value '2' for '--heartbeat <DURATION>': `2` is not a duration; write a number and a unit, like 30s, 5m, 2h or 1d",
    ),
    usage(
        &["work", "--shutdown-grace", "abc"],
        "error: invalid value 'abc' for '--shutdown-grace <SECONDS>': `abc` is not a number of seconds; write a whole number, like 30",
    ),
    usage(
        &["work", "--allow-http-host", ""],
        "error: invalid --allow-http-host: invalid configuration: http allow-list entry `` is not a host name; expected host, host:port, *.domain or [ipv6]:port",
    ),
    usage(
        &["dashboard", "--bind", "127.0.0.1"],
        "error: --bind 127.0.0.1: expected host:port, e.g. 127.0.0.1:7433",
    ),
    usage(
        &["work", "--metrics-addr", "localhost"],
        "error: invalid value 'localhost' for '--metrics-addr <ADDR>': `localhost` is not an address to listen on; write IP:PORT, like 127.0.0.1:9464",
    ),
    // Enqueue.
    usage(
        &["enqueue", "noop", "[1,"],
        "error: invalid value '[1,' for '[ARGS_JSON]': not valid JSON: EOF while parsing a value at line 1 column 3; write JSON in single quotes, like '{\"ms\": 500}'",
    ),
    usage(
        &["enqueue", ""],
        "error: invalid value '' for '[KIND]': the job kind cannot be empty; name the handler that runs the job, like noop",
    ),
    usage(
        &["enqueue", "noop", "--queue", ""],
        "error: invalid value '' for '--queue <Q>': a queue name cannot be empty; name one, like mail",
    ),
    usage(
        &["enqueue", "noop", "--unique-key", ""],
        "error: invalid value '' for '--unique-key <K>': a unique key cannot be empty; leave --unique-key out instead",
    ),
    usage(
        &["enqueue", "noop", "--priority", "40000"],
        "error: invalid value '40000' for '--priority <P>': `40000` is not a priority; use a whole number from -32768 to 32767 (lower runs first)",
    ),
    usage(
        &["enqueue", "noop", "--priority", "high"],
        "error: invalid value 'high' for '--priority <P>': `high` is not a priority; use a whole number from -32768 to 32767 (lower runs first)",
    ),
    usage(
        &["enqueue", "noop", "--max-attempts", "0"],
        "error: invalid value '0' for '--max-attempts <N>': `0` is not a number of attempts; use a whole number from 1 up",
    ),
    usage(
        &["enqueue", "noop", "--in", "soon"],
        "error: invalid value 'soon' for '--in <DURATION>': `soon` is not a duration; write a number and a unit, like 30s, 5m, 2h or 1d",
    ),
    usage(
        &["enqueue", "noop", "--in", "-5m"],
        "error: invalid value '-5m' for '--in <DURATION>': `-5m` is not a duration; write a number and a unit, like 30s, 5m, 2h or 1d",
    ),
    usage(
        &["work", "--exit-when-idle", "--heartbeat", "-1s"],
        "error: invalid value '-1s' for '--heartbeat <DURATION>': `-1s` is not a duration; write a number and a unit, like 30s, 5m, 2h or 1d",
    ),
    // Args a built-in kind cannot decode: the line, and the usage of `enqueue` (not of
    // `skiplock` itself).
    usage(
        &["enqueue", "sleep", r#"{"ms": "soon"}"#],
        r#"error: args do not match the built-in kind `sleep`: invalid type: string "soon", expected u64; write them like {"ms": 500}"#,
    ),
    usage(
        &["enqueue", "noop", "--in", "100000000y"],
        "error: invalid value '100000000y' for '--in <DURATION>': `100000000y` is longer than skiplock can schedule or keep; use at most 1000y",
    ),
    usage(
        &["enqueue", "noop", "--depends-on", "7,x"],
        "error: invalid value 'x' for '--depends-on <IDS>': `x` is not a job id; job ids are whole numbers from 1 up, like 42 (list them with `skiplock jobs`)",
    ),
    usage(
        &["enqueue", "noop", "--unique-key", "k", "--depends-on", "7"],
        "error: the argument '--unique-key <K>' cannot be used with '--depends-on <IDS>'",
    ),
];

/// The lines clap prints after a usage error's message: a blank line, the usage, a tip,
/// the possible values, the pointer to `--help`.
fn is_clap_trailer(line: &str) -> bool {
    line.is_empty()
        || line.starts_with("Usage: ")
        || line.starts_with("  tip: ")
        || line.starts_with("  [possible values: ")
        || line == "For more information, try '--help'."
}

/// Runs `skiplock --database-url URL ARGS…` without `DATABASE_URL`, with only error logs
/// and no retrying of connections (`SKIPLOCK_CONNECT_RETRY=0s`, which `--connect-retry`
/// overrides); returns the exit code and stderr. A command still running after a minute
/// (a dashboard that started serving) is killed and counts as wrong.
async fn run(url: &str, args: &[&str]) -> (Option<i32>, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_skiplock"))
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "error")
        .env("SKIPLOCK_CONNECT_RETRY", "0s")
        .args(["--database-url", url])
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let Ok(output) = tokio::time::timeout(std::time::Duration::from_secs(60), output).await else {
        return (None, "still running after 60 s".to_owned());
    };
    let output = output.expect("run skiplock");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn every_bad_input_gets_one_line_naming_the_problem_and_the_fix() {
    let db = test_db().await;
    let bare = test_db().await;
    sqlx::query("DROP SCHEMA skiplock CASCADE")
        .execute(&bare.pool)
        .await
        .unwrap();
    let powerless = format!("powerless_{}", db.name);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP ROLE IF EXISTS {powerless}; CREATE ROLE {powerless} LOGIN"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let as_role = |role: &str| {
        let url = db.url().replacen("postgres@", &format!("{role}@"), 1);
        assert_ne!(url, db.url(), "the test URL names the user postgres");
        url
    };
    let mut wrong = Vec::new();
    for case in CASES {
        let (url, name) = match case.target {
            Target::Migrated => (db.url().to_owned(), db.name.as_str()),
            Target::NoSchema => (bare.url().to_owned(), bare.name.as_str()),
            Target::UnknownRole => (as_role(&format!("nobody_{}", db.name)), db.name.as_str()),
            Target::PowerlessRole => (as_role(&powerless), db.name.as_str()),
            Target::Url(url) => (url.to_owned(), ""),
        };
        let expected = case.line.replace("{db}", name).replace("{url}", &url);
        let (code, stderr) = run(&url, case.args).await;
        let mut lines = stderr.trim_end().lines();
        let line = lines.next().unwrap_or_default();
        let rest: Vec<&str> = lines.collect();
        // A usage shown is the one of the command typed.
        let command_usage = format!("Usage: skiplock {}", case.args[0]);
        let rest_is_fine = match case.code {
            1 => rest.is_empty(),
            _ => rest.iter().all(|line| {
                is_clap_trailer(line)
                    && (!line.starts_with("Usage: ")
                        || case.args[0].starts_with('-')
                        || line.starts_with(&command_usage))
            }),
        };
        let line_is_right = match expected.split_once("{os}") {
            Some((before, after)) => {
                line.len() > before.len() + after.len()
                    && line.starts_with(before)
                    && line.ends_with(after)
            }
            None => line == expected,
        };
        if code != Some(case.code) || !line_is_right || !rest_is_fine {
            wrong.push(format!(
                "skiplock {:?}\n  expected exit {} and: {expected}\n  got exit {code:?} and:\n{stderr}",
                case.args, case.code
            ));
        }
    }
    // The role's sessions ended with the commands; nothing else holds it.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP ROLE {powerless}")))
        .execute(&db.pool)
        .await
        .unwrap();
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
    assert_eq!(db.job_count().await, 0, "no bad input enqueued anything");
    let schedules: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.cron_schedules")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(schedules, 0, "no bad input saved a schedule");
}
