//! Who may see the dashboard and who may change things through it.
//!
//! - **Authentication** (`--token` or `--basic-auth`): every route but `/login` and the
//!   static assets needs the credentials. A token comes as `Authorization: Bearer TOKEN`
//!   or, for browsers, as an `HttpOnly`, `SameSite=Strict` cookie set by the login form.
//! - **Host check** without credentials (loopback binds only): the `Host` header must name
//!   a loopback host, so a public page that rebinds its DNS name to 127.0.0.1 cannot read
//!   the dashboard through the visitor's browser.
//! - **CSRF**: every action is a POST whose form carries a random per-process token that
//!   only pages of this origin can read; a POST whose `Origin` or `Sec-Fetch-Site` names
//!   another site is refused too. Browsers send Basic credentials along with cross-site
//!   requests, so the token is what stops a forged form.
//! - **Headers**: a strict Content-Security-Policy (no inline script or style, no framing),
//!   `nosniff`, `no-store`.

use std::collections::HashMap;

use axum::extract::{Form, Query, Request, State as StateExtractor};
use axum::http::StatusCode;
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use base64::Engine;
use maud::html;

use super::{AppError, State, layout};

/// Name of the cookie that carries the token for browsers.
const TOKEN_COOKIE: &str = "skiplock_dashboard_token";

/// The credentials the dashboard requires.
pub enum Auth {
    /// None: only for loopback binds.
    None,
    /// `Authorization: Bearer TOKEN` or the login cookie.
    Token(String),
    /// The value `Authorization: Basic …` must carry (base64 of `user:pass`).
    Basic(String),
}

impl Auth {
    /// Checks `--token` and `--basic-auth`; the error says what is wrong with them.
    pub fn from_args(token: Option<&str>, basic: Option<&str>) -> Result<Auth, String> {
        match (token, basic) {
            (Some(token), _) => {
                if token.trim().len() < 8 {
                    return Err("--token must be at least 8 characters long".into());
                }
                Ok(Auth::Token(token.to_owned()))
            }
            (None, Some(basic)) => match basic.split_once(':') {
                Some((user, pass)) if !user.is_empty() && !pass.is_empty() => Ok(Auth::Basic(
                    base64::engine::general_purpose::STANDARD.encode(basic),
                )),
                _ => Err("--basic-auth must be USER:PASS, both non-empty".into()),
            },
            (None, None) => Ok(Auth::None),
        }
    }

    fn accepts(&self, headers: &HeaderMap) -> bool {
        let authorization = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        match self {
            Auth::None => true,
            Auth::Token(token) => {
                let bearer = authorization
                    .strip_prefix("Bearer ")
                    .is_some_and(|given| constant_time_eq(given.trim(), token));
                bearer || cookie(headers, TOKEN_COOKIE).is_some_and(|c| constant_time_eq(&c, token))
            }
            Auth::Basic(expected) => authorization
                .strip_prefix("Basic ")
                .is_some_and(|given| constant_time_eq(given.trim(), expected)),
        }
    }
}

/// 32 random bytes from the operating system (two v4 UUIDs), as hex.
pub fn random_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Compares without stopping at the first difference, so timing tells nothing of where
/// a guess went wrong (only the length, which is not secret enough to matter here).
pub fn constant_time_eq(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value.to_owned())
}

/// Middleware on every route: host check, authentication, security headers.
pub async fn guard(
    StateExtractor(state): StateExtractor<State>,
    request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path();
    let public = path == "/login" || path.starts_with("/static/");
    let mut response = if state.loopback_hosts_only && !loopback_host(request.headers()) {
        (
            StatusCode::MISDIRECTED_REQUEST,
            "this dashboard answers only to localhost, 127.0.0.1 and [::1]; to serve other \
             names, start it with --token or --basic-auth\n",
        )
            .into_response()
    } else if public || state.auth.accepts(request.headers()) {
        next.run(request).await
    } else {
        unauthorized(&state, path)
    };
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

fn unauthorized(state: &State, path: &str) -> Response {
    match &state.auth {
        Auth::Basic(_) => (
            StatusCode::UNAUTHORIZED,
            [(
                header::WWW_AUTHENTICATE,
                "Basic realm=\"skiplock dashboard\", charset=\"UTF-8\"",
            )],
            "authentication required\n",
        )
            .into_response(),
        _ if path.starts_with("/api/") || path == "/metrics" => (
            StatusCode::UNAUTHORIZED,
            [(
                header::WWW_AUTHENTICATE,
                "Bearer realm=\"skiplock dashboard\"",
            )],
            "authentication required: send Authorization: Bearer TOKEN\n",
        )
            .into_response(),
        _ => (StatusCode::UNAUTHORIZED, login_form(path, None)).into_response(),
    }
}

/// Whether `Host` names localhost or a loopback address (any port).
fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) else {
        return false;
    };
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(name, _)| name)
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Refuses an action unless the dashboard may change things, the request comes from one
/// of its own pages and the form carries the CSRF token.
pub fn check_action(state: &State, headers: &HeaderMap, csrf: &str) -> Result<(), AppError> {
    if state.read_only {
        return Err(AppError::Forbidden(
            "this dashboard is read-only (--read-only); nothing was changed".into(),
        ));
    }
    let site = headers
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("same-origin");
    if site == "cross-site" || site == "same-site" {
        return Err(AppError::Forbidden(
            "cross-site request refused; nothing was changed".into(),
        ));
    }
    if let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        // Behind a reverse proxy the browser's host may arrive as X-Forwarded-Host.
        let origin_host = origin.split_once("://").map_or("", |(_, rest)| rest);
        let ours = [header::HOST.as_str(), "x-forwarded-host"]
            .iter()
            .filter_map(|name| headers.get(*name).and_then(|v| v.to_str().ok()))
            .any(|host| host == origin_host);
        if origin != "null" && !ours {
            return Err(AppError::Forbidden(format!(
                "request from origin {origin} refused; nothing was changed"
            )));
        }
    }
    if !constant_time_eq(csrf, &state.csrf_token) {
        return Err(AppError::Forbidden(
            "missing or stale form token (CSRF); reload the page and try again".into(),
        ));
    }
    Ok(())
}

/// `GET /login`: the token form (token mode), else back to the overview.
pub async fn login_page(
    StateExtractor(state): StateExtractor<State>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    match state.auth {
        Auth::Token(_) => {
            let next = query.get("next").map_or("/", String::as_str);
            login_form(next, None).into_response()
        }
        _ => Redirect::to("/").into_response(),
    }
}

#[derive(serde::Deserialize)]
pub struct LoginForm {
    token: String,
    #[serde(default)]
    next: String,
}

/// `POST /login`: sets the token cookie when the token is right.
pub async fn login(
    StateExtractor(state): StateExtractor<State>,
    Form(form): Form<LoginForm>,
) -> Response {
    let Auth::Token(token) = &state.auth else {
        return Redirect::to("/").into_response();
    };
    if !constant_time_eq(form.token.trim(), token) {
        return (
            StatusCode::UNAUTHORIZED,
            login_form(&form.next, Some("wrong token")),
        )
            .into_response();
    }
    let cookie =
        format!("{TOKEN_COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict; Max-Age=2592000");
    (
        [(header::SET_COOKIE, cookie)],
        Redirect::to(local_path(&form.next)),
    )
        .into_response()
}

fn login_form(next: &str, problem: Option<&str>) -> maud::Markup {
    layout::bare_page(
        "Log in",
        html! {
            form.login method="post" action="/login" {
                h1 { "skiplock dashboard" }
                @if let Some(problem) = problem { p.flash.error { (problem) } }
                label { "Token " input type="password" name="token" autofocus required; }
                input type="hidden" name="next" value=(local_path(next));
                button type="submit" { "Log in" }
            }
        },
    )
}

/// `path` if it is a path on this site, else `/`: redirects never leave the dashboard.
pub fn local_path(path: &str) -> &str {
    if path.starts_with('/') && !path.starts_with("//") && !path.contains('\\') {
        path
    } else {
        "/"
    }
}
