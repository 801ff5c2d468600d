//! Job kinds built into the `skiplock` binary, usable by library users too.
//!
//! - [`Noop`] (`noop`) and [`Sleep`] (`sleep`): for smoke tests and benchmarks.
//! - `Http` (`http`, feature `http-kind`): one HTTP request; configure with `HttpConfig`.
//! - `Command` (`command`, feature `command-kind`): runs a program; it runs nothing
//!   unless the worker is given a `CommandConfig` allow-list.

#[cfg(feature = "command-kind")]
mod command;
#[cfg(feature = "http-kind")]
mod http;
mod noop;
mod sleep;

#[cfg(feature = "command-kind")]
pub use command::{COMMAND_TIMEOUT_DEFAULT, Command, CommandConfig, OUTPUT_PREFIX_MAX_BYTES};
#[cfg(feature = "http-kind")]
pub use http::{BODY_PREFIX_MAX_BYTES, HTTP_TIMEOUT_DEFAULT, Http, HttpConfig, RETRY_AFTER_MAX};
pub use noop::Noop;
pub use sleep::Sleep;

/// The start of `text` for an error message: trimmed, at most `max_chars` characters with
/// `…` when cut, `None` when empty.
#[cfg(any(feature = "http-kind", feature = "command-kind"))]
fn excerpt(text: &str, max_chars: usize) -> Option<String> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    let mut quoted: String = text.chars().take(max_chars).collect();
    if quoted.len() < text.len() {
        quoted.push('…');
    }
    Some(quoted)
}
