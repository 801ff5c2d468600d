//! Runs `skiplock dashboard` against a seeded test database and talks HTTP to it.

use std::process::Stdio;
use std::time::Duration;

use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderValue};
use reqwest::{Client, Response};
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::common::TestDb;

/// How long the dashboard may take to start listening: only guards a hang, so generous
/// enough for a loaded machine.
const START_LIMIT: Duration = Duration::from_secs(60);

/// A running dashboard; killed when dropped.
pub struct Dashboard {
    /// `http://127.0.0.1:PORT`, without a trailing slash.
    pub base: String,
    pub client: Client,
    _child: Child,
}

/// The binary with `--database-url` for `db` and the given dashboard arguments.
pub fn command(db: &TestDb, args: &[&str]) -> Command {
    command_at(db.url(), args)
}

/// The binary with `--database-url URL` and the given dashboard arguments.
pub fn command_at(url: &str, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_skiplock"));
    command
        .env_remove("DATABASE_URL")
        .env_remove("SKIPLOCK_DASHBOARD_TOKEN")
        .env_remove("SKIPLOCK_DASHBOARD_BASIC_AUTH")
        .env("RUST_LOG", "warn")
        .arg("--database-url")
        .arg(url)
        .arg("dashboard")
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    command
}

impl Dashboard {
    /// Starts `skiplock dashboard ARGS…` (on `--bind 127.0.0.1:0` unless ARGS bind) and
    /// waits for its address.
    pub async fn start(db: &TestDb, args: &[&str]) -> Dashboard {
        Self::start_at(db.url(), args).await
    }

    /// As [`start`](Self::start), on the database at `url`.
    pub async fn start_at(url: &str, args: &[&str]) -> Dashboard {
        let bind: &[&str] = if args.contains(&"--bind") {
            &[]
        } else {
            &["--bind", "127.0.0.1:0"]
        };
        let mut child = command_at(url, bind)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start skiplock dashboard");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let base = tokio::time::timeout(START_LIMIT, async {
            while let Some(line) = lines.next_line().await.expect("read dashboard stdout") {
                if let Some(url) = line.strip_prefix("skiplock dashboard listening on ") {
                    return url.trim_end_matches('/').to_owned();
                }
            }
            panic!("the dashboard exited before listening");
        })
        .await
        .expect("the dashboard did not start listening in time");
        // reqwest is built with rustls and no default provider (the `http` kind picks
        // ring); plain HTTP never uses it, but building a client needs one installed.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("HTTP client");
        Dashboard {
            base,
            client,
            _child: child,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn get(&self, path: &str) -> Response {
        self.client.get(self.url(path)).send().await.expect("GET")
    }

    /// GET, asserting 200, returning the body.
    pub async fn page(&self, path: &str) -> String {
        let response = self.get(path).await;
        assert_eq!(response.status(), 200, "GET {path}");
        response.text().await.expect("body")
    }

    /// GET, asserting 200, parsing the body as JSON.
    pub async fn json(&self, path: &str) -> serde_json::Value {
        let body = self.page(path).await;
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: not JSON ({e}): {body}"))
    }

    /// The CSRF token the pages carry in their forms.
    pub async fn csrf(&self) -> String {
        let page = self.page("/").await;
        csrf_in(&page).expect("a form with a csrf field on the overview")
    }

    /// POSTs a form with the given fields (already including any csrf).
    pub async fn post(&self, path: &str, fields: &[(&str, &str)], headers: HeaderMap) -> Response {
        let body = fields
            .iter()
            .map(|(k, v)| format!("{k}={}", form_encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        self.client
            .post(self.url(path))
            .headers(headers)
            .header(
                CONTENT_TYPE,
                HeaderValue::from_static("application/x-www-form-urlencoded"),
            )
            .body(body)
            .send()
            .await
            .expect("POST")
    }

    /// POSTs a confirmed action with the right CSRF token; asserts the 303 back.
    pub async fn act(&self, path: &str, extra: &[(&str, &str)]) -> String {
        let csrf = self.csrf().await;
        let mut fields = vec![
            ("csrf", csrf.as_str()),
            ("confirmed", "yes"),
            ("return_to", "/"),
        ];
        fields.extend_from_slice(extra);
        let response = self.post(path, &fields, HeaderMap::new()).await;
        assert_eq!(response.status(), 303, "POST {path}");
        let location = response.headers()["location"].to_str().unwrap().to_owned();
        assert!(location.starts_with("/?notice="), "{location}");
        location
    }
}

/// The value of the first `name="csrf"` hidden field in `html`.
pub fn csrf_in(html: &str) -> Option<String> {
    let at = html.find("name=\"csrf\" value=\"")?;
    let rest = &html[at + "name=\"csrf\" value=\"".len()..];
    Some(rest[..rest.find('"')?].to_owned())
}

fn form_encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The text of the card `data-count="KEY"` on the overview.
pub fn card(html: &str, key: &str) -> String {
    let marker = format!("data-count=\"{key}\"><span class=\"value\">");
    let at = html
        .find(&marker)
        .unwrap_or_else(|| panic!("no card {key}"));
    let rest = &html[at + marker.len()..];
    rest[..rest.find('<').unwrap()].to_owned()
}

/// Ids of the jobs the seed made, by what they are.
pub struct Seeded {
    pub runnable: Vec<i64>,
    pub scheduled: Vec<i64>,
    pub running: Vec<i64>,
    pub succeeded: Vec<i64>,
    pub dead: Vec<i64>,
    pub cancelled: Vec<i64>,
    /// A lane of two: the head (queued) and the next (waiting).
    pub lane: Vec<i64>,
    /// A parent (queued) and its child (waiting for it).
    pub parent: i64,
    pub child: i64,
}

async fn insert(pool: &PgPool, n: i64, sql: &str) -> Vec<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(n)
        .fetch_all(pool)
        .await
        .unwrap_or_else(|e| panic!("seed: {e}\n{sql}"))
}

/// A database with jobs in every state, written directly so that the numbers are exact:
/// 3 runnable and 2 scheduled in `default`; 2 running in `mail` held by `worker-a`; 5
/// succeeded in `default` (kind `resize`) within the last minutes, the first after two
/// failed attempts; 2 dead in `mail` with three failures each; 1 cancelled; a lane of 2
/// and a parent with a waiting child (all `default`, kind `chain`).
pub async fn seed(pool: &PgPool) -> Seeded {
    let runnable = insert(
        pool,
        3,
        "INSERT INTO skiplock.jobs (queue, kind, args, scheduled_at)
         SELECT 'default', 'send_email',
                jsonb_build_object('to', CASE WHEN i = 1 THEN 'alice@example.com' ELSE 'user' || i || '@example.com' END),
                now() - interval '5 seconds'
         FROM generate_series(1, $1) i RETURNING id",
    )
    .await;
    let scheduled = insert(
        pool,
        2,
        "INSERT INTO skiplock.jobs (queue, kind, args, scheduled_at)
         SELECT 'default', 'send_email', jsonb_build_object('later', i), now() + interval '1 hour'
         FROM generate_series(1, $1) i RETURNING id",
    )
    .await;
    let running = insert(
        pool,
        2,
        "INSERT INTO skiplock.jobs (queue, kind, state, attempt, claim_token, claimed_by,
                                    claimed_at, heartbeat_at)
         SELECT 'mail', 'send_email', 'running', 1, gen_random_uuid(), 'worker-a',
                now() - interval '2 seconds', now()
         FROM generate_series(1, $1) i RETURNING id",
    )
    .await;
    let succeeded = insert(
        pool,
        5,
        "INSERT INTO skiplock.jobs (queue, kind, args, state, attempt, claimed_by, scheduled_at,
                                    claimed_at, finished_at, errors)
         SELECT 'default', 'resize', jsonb_build_object('image', i), 'succeeded',
                CASE WHEN i = 1 THEN 3 ELSE 1 END, 'worker-a',
                now() - make_interval(secs => 10 * i + 3), now() - make_interval(secs => 10 * i + 2),
                now() - make_interval(secs => 10 * i),
                CASE WHEN i = 1 THEN jsonb_build_array(
                    jsonb_build_object('attempt', 1, 'at', now() - interval '40 seconds', 'message', 'flaky 1'),
                    jsonb_build_object('attempt', 2, 'at', now() - interval '30 seconds', 'message', 'flaky 2'))
                ELSE '[]' END
         FROM generate_series(1, $1) i RETURNING id",
    )
    .await;
    let dead = insert(
        pool,
        2,
        "INSERT INTO skiplock.jobs (queue, kind, args, state, attempt, max_attempts, claimed_by,
                                    scheduled_at, claimed_at, finished_at, last_error, errors)
         SELECT 'mail', 'send_email', jsonb_build_object('to', 'bounce' || i || '@example.com'),
                'dead', 3, 3, 'worker-a', now() - interval '2 minutes', now() - interval '2 minutes',
                now() - interval '1 minute', 'SMTP 550 mailbox ' || i || ' unavailable',
                jsonb_build_array(
                    jsonb_build_object('attempt', 1, 'at', now() - interval '3 minutes', 'message', 'connection reset'),
                    jsonb_build_object('attempt', 2, 'at', now() - interval '2 minutes', 'message', 'timeout after 30s'),
                    jsonb_build_object('attempt', 3, 'at', now() - interval '1 minute', 'message', 'SMTP 550 mailbox ' || i || ' unavailable'))
         FROM generate_series(1, $1) i RETURNING id",
    )
    .await;
    let cancelled = insert(
        pool,
        1,
        "INSERT INTO skiplock.jobs (queue, kind, state, finished_at, last_error)
         SELECT 'default', 'send_email', 'cancelled', now() - interval '1 minute', 'cancelled by operator'
         FROM generate_series(1, $1) i RETURNING id",
    )
    .await;
    let lane = insert(
        pool,
        2,
        "INSERT INTO skiplock.jobs (queue, kind, args, state, ordering_key, scheduled_at)
         SELECT 'default', 'chain', jsonb_build_object('step', i),
                (CASE WHEN i = 1 THEN 'queued' ELSE 'waiting' END)::skiplock.job_state,
                'account-7', now() + interval '1 hour'
         FROM generate_series(1, $1) i ORDER BY i RETURNING id",
    )
    .await;
    let family = insert(
        pool,
        2,
        "INSERT INTO skiplock.jobs (queue, kind, args, state, scheduled_at)
         SELECT 'default', 'chain', jsonb_build_object('family', i),
                (CASE WHEN i = 1 THEN 'queued' ELSE 'waiting' END)::skiplock.job_state,
                now() + interval '1 hour'
         FROM generate_series(1, $1) i ORDER BY i RETURNING id",
    )
    .await;
    sqlx::query("INSERT INTO skiplock.job_dependencies (job_id, parent_id) VALUES ($1, $2)")
        .bind(family[1])
        .bind(family[0])
        .execute(pool)
        .await
        .expect("seed dependency");
    Seeded {
        runnable,
        scheduled,
        running,
        succeeded,
        dead,
        cancelled,
        lane,
        parent: family[0],
        child: family[1],
    }
}
