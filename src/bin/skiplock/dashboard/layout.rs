//! The page frame, the static assets and the small formatting helpers every page uses.

use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};
use skiplock::JobState;

use super::AppState;

const SCRIPT: &str = include_str!("assets/app.js");
const STYLESHEET: &str = include_str!("assets/app.css");

/// Which menu entry is current.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Nav {
    Overview,
    Jobs,
    History,
}

/// A full page with the menu; `notice` is a one-line message from the action before.
pub fn page(state: &AppState, nav: Nav, title: &str, notice: Option<&str>, body: Markup) -> Markup {
    let item = |target: Nav, href: &str, label: &str| {
        html! { a href=(href) class=[(nav == target).then_some("current")] { (label) } }
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title, true))
            body {
                header.top {
                    a.brand href="/" { "skiplock" }
                    nav {
                        (item(Nav::Overview, "/", "Overview"))
                        (item(Nav::Jobs, "/jobs", "Jobs"))
                        (item(Nav::History, "/history", "History"))
                    }
                    @if state.read_only { span.badge.readonly title="started with --read-only" { "read-only" } }
                }
                main {
                    @if let Some(notice) = notice { p.flash role="status" { (notice) } }
                    (body)
                }
            }
        }
    }
}

/// A page without the menu (login, errors).
pub fn bare_page(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title, false))
            body { main.narrow { (body) } }
        }
    }
}

fn head(title: &str, script: bool) -> Markup {
    html! {
        head {
            meta charset="utf-8";
            meta name="viewport" content="width=device-width, initial-scale=1";
            title { (title) " · skiplock" }
            link rel="stylesheet" href="/static/app.css";
            @if script { script src="/static/app.js" defer {} }
        }
    }
}

pub fn error_page(status: StatusCode, message: &str) -> Markup {
    bare_page(
        status.canonical_reason().unwrap_or("Error"),
        html! {
            h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("")) }
            p.error-message { (message) }
            p { a href="/" { "Back to the overview" } }
        },
    )
}

pub async fn script() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        SCRIPT,
    )
}

pub async fn stylesheet() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        STYLESHEET,
    )
}

/// A POST form of one button. The server asks again unless the form says
/// `confirmed=yes`; the script asks with `confirm()` first and sets it, so a click and an
/// OK do it, and without the script a confirmation page does.
pub fn action_button(
    state: &AppState,
    action: &str,
    label: &str,
    question: &str,
    fields: &[(&str, &str)],
    return_to: &str,
    danger: bool,
) -> Markup {
    if state.read_only {
        return html! {};
    }
    html! {
        form.action method="post" action=(action) data-confirm=(question) {
            input type="hidden" name="csrf" value=(state.csrf_token);
            input type="hidden" name="return_to" value=(return_to);
            input type="hidden" name="confirmed" value="";
            @for (name, value) in fields { input type="hidden" name=(name) value=(value); }
            button type="submit" class=[danger.then_some("danger")] { (label) }
        }
    }
}

pub fn state_badge(state: JobState) -> Markup {
    html! { span class={ "state " (state.as_str()) } { (state.as_str()) } }
}

pub fn timestamp(at: DateTime<Utc>) -> Markup {
    // The library reads 'infinity' and '-infinity' (rows written by hand) as these.
    if at == DateTime::<Utc>::MAX_UTC {
        return html! { span { "infinity" } };
    }
    if at == DateTime::<Utc>::MIN_UTC {
        return html! { span { "-infinity" } };
    }
    html! { time datetime=(at.to_rfc3339()) title=(at.to_rfc3339()) { (at.format("%Y-%m-%d %H:%M:%S")) } }
}

pub fn maybe_timestamp(at: Option<DateTime<Utc>>) -> Markup {
    match at {
        Some(at) => timestamp(at),
        None => html! { span.muted { "–" } },
    }
}

/// Seconds as a short human duration: 850ms, 12.5s, 4m 10s, 3h 5m, 2d 4h.
pub fn duration(seconds: f64) -> String {
    if !seconds.is_finite() {
        return "–".into();
    }
    let s = seconds.max(0.0);
    if s < 1.0 {
        format!("{:.0}ms", s * 1000.0)
    } else if s < 60.0 {
        format!("{s:.1}s")
    } else if s < 3600.0 {
        format!("{}m {}s", (s / 60.0) as u64, (s % 60.0) as u64)
    } else if s < 86400.0 {
        format!("{}h {}m", (s / 3600.0) as u64, ((s % 3600.0) / 60.0) as u64)
    } else {
        format!(
            "{}d {}h",
            (s / 86400.0) as u64,
            ((s % 86400.0) / 3600.0) as u64
        )
    }
}

/// A number with thin groupings: 1 234 567.
pub fn count(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 + 1);
    if n < 0 {
        out.push('-');
    }
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push('\u{202f}');
        }
        out.push(c);
    }
    out
}

/// A form or query value, trimmed, `None` when empty.
pub fn given(value: &Option<String>) -> Option<String> {
    value
        .as_deref()
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
}

/// Percent-encodes a query value.
pub fn encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `/jobs?…` for the given filters.
pub fn jobs_link(state: Option<&str>, queue: Option<&str>, kind: Option<&str>) -> String {
    let mut parts = Vec::new();
    for (name, value) in [("state", state), ("queue", queue), ("kind", kind)] {
        if let Some(value) = value {
            parts.push(format!("{name}={}", encode(value)));
        }
    }
    if parts.is_empty() {
        "/jobs".into()
    } else {
        format!("/jobs?{}", parts.join("&"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_durations_and_counts() {
        assert_eq!(duration(0.25), "250ms");
        assert_eq!(duration(12.5), "12.5s");
        assert_eq!(duration(250.0), "4m 10s");
        assert_eq!(duration(3.0 * 86400.0 + 7200.0), "3d 2h");
        assert_eq!(count(1_234_567), "1\u{202f}234\u{202f}567");
        assert_eq!(count(-12), "-12");
        assert_eq!(encode("a b/é"), "a%20b%2F%C3%A9");
    }
}
