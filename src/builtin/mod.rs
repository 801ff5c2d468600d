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

/// The start of `text` for an error message, on one line: runs of whitespace (an HTML
/// page's line breaks and indentation) become one space; at most `max_chars` characters,
/// with `…` when cut; `None` when empty. A job's error goes into `last_error`, its errors,
/// the log and `skiplock jobs`, where a page of text would bury everything else.
#[cfg(any(feature = "http-kind", feature = "command-kind"))]
fn excerpt(text: &str, max_chars: usize) -> Option<String> {
    let mut words = text.split_whitespace();
    let first = words.next()?;
    let mut line = String::from(first);
    let mut count = first.chars().count();
    for word in words {
        if count > max_chars {
            break;
        }
        line.push(' ');
        line.push_str(word);
        count += 1 + word.chars().count();
    }
    if count > max_chars {
        line = line.chars().take(max_chars).collect();
        line.push('…');
    }
    Some(line)
}

#[cfg(all(test, any(feature = "http-kind", feature = "command-kind")))]
mod tests {
    use super::excerpt;

    #[test]
    fn an_excerpt_is_one_line_of_at_most_max_chars() {
        assert_eq!(excerpt(" \n\t ", 10), None);
        assert_eq!(excerpt("no  such\n\tthing\n", 20).unwrap(), "no such thing");
        assert_eq!(excerpt("<p>\n  abc</p>\n", 6).unwrap(), "<p> ab…");
        assert_eq!(excerpt("ééé ééé", 7).unwrap(), "ééé ééé");
        assert_eq!(excerpt("ééé ééé", 6).unwrap(), "ééé éé…");
    }
}
