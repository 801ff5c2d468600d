//! `skiplock dashboard`: a web page for operators, served by this binary.
//!
//! Server-rendered HTML ([maud], escaped by default) with one small script for
//! confirmations and live refresh; no external asset, so it works offline. The pages:
//!
//! | route | what |
//! |---|---|
//! | `GET /` | overview: counts per queue and kind, lag, jobs/s, live chart, workers |
//! | `GET /jobs`, `GET /jobs/{id}` | filtered jobs list (keyset paging) and job detail |
//! | `POST /jobs/{id}/{retry,cancel,delete}` | job actions |
//! | `POST /queues/{retry-dead,pause,resume}` | queue actions (queue in the form) |
//! | `GET /history` | per day or hour, per queue and kind; a 30-day chart |
//! | `GET /api/v1/stats`, `GET /api/v1/throughput` | JSON |
//! | `GET /metrics` | Prometheus text format |
//!
//! Safety ([`security`]): loopback only unless a token or Basic credentials are set; every
//! POST carries a CSRF token and is refused in `--read-only` mode.

mod actions;
mod api;
mod history;
mod jobs;
mod layout;
mod overview;
mod security;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use clap::Args;
use skiplock::unstable_cli::DbPool;

use self::security::Auth;

/// Where the dashboard listens unless told otherwise: loopback only.
pub const BIND_DEFAULT: &str = "127.0.0.1:7433";

/// Connections the dashboard keeps: the overview runs its few queries at once.
const POOL_SIZE: u32 = 4;

pub const EXAMPLES: &str = "\
Examples:
  skiplock dashboard                                    # http://127.0.0.1:7433/
  skiplock dashboard --bind 127.0.0.1:9000 --read-only
  SKIPLOCK_DASHBOARD_TOKEN=s3cret skiplock dashboard --bind 0.0.0.0:7433
  skiplock dashboard --bind 10.0.0.5:7433 --basic-auth ops:correct-horse

Any address but a loopback one needs --token or --basic-auth: the dashboard shows job
arguments and errors, and can retry, cancel and delete jobs. Prometheus scrapes /metrics
(with `authorization: {credentials: TOKEN}` or `basic_auth` when set).";

#[derive(Args)]
pub struct DashboardArgs {
    /// Address to listen on, host:port. Anything but a loopback address requires --token
    /// or --basic-auth.
    #[arg(long, value_name = "ADDR", default_value = BIND_DEFAULT)]
    bind: String,

    /// Require this token: `Authorization: Bearer TOKEN` from programs; browsers log in
    /// once with a form and keep a cookie.
    #[arg(
        long,
        value_name = "TOKEN",
        env = "SKIPLOCK_DASHBOARD_TOKEN",
        hide_env_values = true,
        conflicts_with = "basic_auth"
    )]
    token: Option<String>,

    /// Require HTTP Basic credentials.
    #[arg(
        long,
        value_name = "USER:PASS",
        env = "SKIPLOCK_DASHBOARD_BASIC_AUTH",
        hide_env_values = true
    )]
    basic_auth: Option<String>,

    /// Show everything, change nothing: no action buttons, and every action is refused.
    #[arg(long)]
    read_only: bool,
}

/// What every handler shares.
pub struct AppState {
    pub pool: DbPool,
    pub auth: Auth,
    /// Token every form carries back on POST; random per process.
    pub csrf_token: String,
    pub read_only: bool,
    /// No credentials are required, so only loopback `Host` names are served (a DNS
    /// rebinding page cannot borrow the browser's access).
    pub loopback_hosts_only: bool,
    /// Lifetime totals for `/metrics` and when they were read (see [`api::metrics`]).
    pub totals_cache: tokio::sync::Mutex<Option<api::CachedTotals>>,
}

pub type State = Arc<AppState>;

/// Checks the arguments, connects, and serves until SIGINT or SIGTERM.
pub async fn run(db: &crate::Database, args: DashboardArgs) -> anyhow::Result<()> {
    let auth = Auth::from_args(args.token.as_deref(), args.basic_auth.as_deref())
        .unwrap_or_else(|message| crate::usage_error(&["dashboard"], message));
    let addr = resolve_bind(&args.bind).await?;
    if !addr.ip().is_loopback() && matches!(auth, Auth::None) {
        crate::usage_error(
            &["dashboard"],
            format!(
                "refusing to listen on {addr} without authentication: anyone who can reach that \
             address could read job arguments and errors and retry, cancel or delete jobs. \
             Pass --token TOKEN or --basic-auth USER:PASS, or bind to 127.0.0.1"
            ),
        );
    }
    let pool = db
        .pool("dashboard", POOL_SIZE, crate::Patience::UntilStopped)
        .await?;
    // Every page reads the schema: without it (or with another version) each would be
    // an error page, so the dashboard says what to do before it starts.
    if let Err(error) = skiplock::check_schema(pool.pool()).await {
        return Err(db.explain_schema(error.into()).await);
    }
    let state = Arc::new(AppState {
        pool,
        loopback_hosts_only: matches!(auth, Auth::None),
        auth,
        csrf_token: security::random_token(),
        read_only: args.read_only,
        totals_cache: tokio::sync::Mutex::default(),
    });
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    // Tests and scripts read this line to learn the port of `--bind 127.0.0.1:0`.
    println!("skiplock dashboard listening on http://{local}/");
    tracing::info!(address = %local, read_only = args.read_only, "dashboard started");
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("the dashboard server failed")
}

/// The first address `bind` names (an IP:port, or a host name to look up).
async fn resolve_bind(bind: &str) -> anyhow::Result<SocketAddr> {
    if let Ok(addr) = bind.parse() {
        return Ok(addr);
    }
    // No port, or not one: the address is malformed, whatever the name.
    if bind
        .rsplit_once(':')
        .is_none_or(|(_, port)| port.parse::<u16>().is_err())
    {
        crate::usage_error(
            &["dashboard"],
            format!("--bind {bind}: expected host:port, e.g. 127.0.0.1:7433"),
        );
    }
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(bind)
        .await
        .with_context(|| {
            format!(
                "--bind {bind}: cannot resolve the host name; use an IP address, like 127.0.0.1:7433, or a name this machine resolves"
            )
        })?
        .collect();
    // A name counts as loopback only if every address it has is.
    match addrs.iter().find(|a| !a.ip().is_loopback()) {
        Some(public) => Ok(*public),
        None => addrs
            .first()
            .copied()
            .with_context(|| format!("--bind {bind}: the name has no address")),
    }
}

fn router(state: State) -> Router {
    Router::new()
        .route("/", get(overview::page))
        .route("/overview/live", get(overview::live))
        .route("/jobs", get(jobs::list))
        .route("/jobs/{id}", get(jobs::detail))
        .route("/jobs/{id}/{action}", post(actions::job))
        .route("/queues/{action}", post(actions::queue))
        .route("/history", get(history::page))
        .route("/api/v1/stats", get(api::stats))
        .route("/api/v1/throughput", get(api::throughput))
        .route("/metrics", get(api::metrics))
        .route("/login", get(security::login_page).post(security::login))
        .route("/static/app.js", get(layout::script))
        .route("/static/app.css", get(layout::stylesheet))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            security::guard,
        ))
        .with_state(state)
}

async fn not_found() -> Response {
    AppError::NotFound("no such page".into()).into_response()
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut interrupt), Ok(mut terminate)) => {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
        }
        _ => {
            tracing::error!("cannot install signal handlers; stop the dashboard with SIGKILL");
            std::future::pending::<()>().await;
        }
    }
    tracing::info!("dashboard stopping");
}

/// What a handler can fail with; rendered as a small page with the status.
#[derive(Debug)]
pub enum AppError {
    NotFound(String),
    BadRequest(String),
    Forbidden(String),
    Internal(anyhow::Error),
}

/// A job id from a URL path: `abc` or `1.5` gets a 400 that says what a job id is, not a
/// parser message.
pub fn job_id_in_path(text: &str) -> Result<i64, AppError> {
    text.parse().map_err(|_| {
        AppError::BadRequest(format!(
            "`{text}` is not a job id; job ids are whole numbers, like /jobs/42"
        ))
    })
}

impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        AppError::Internal(e.into())
    }
}

impl From<skiplock::Error> for AppError {
    fn from(e: skiplock::Error) -> Self {
        AppError::Internal(e.into())
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let (status, message) = match self {
            AppError::NotFound(m) => (StatusCode::NOT_FOUND, m),
            AppError::BadRequest(m) => (StatusCode::BAD_REQUEST, m),
            AppError::Forbidden(m) => (StatusCode::FORBIDDEN, m),
            AppError::Internal(e) => {
                // One line, without the server's C source line numbers.
                let message = crate::message(&e);
                tracing::error!(error = message, "dashboard request failed");
                (StatusCode::INTERNAL_SERVER_ERROR, message)
            }
        };
        (status, layout::error_page(status, &message)).into_response()
    }
}

pub type AppResult<T> = Result<T, AppError>;
