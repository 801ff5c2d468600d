//! Job kinds built into the `skiplock` binary, usable by library users too.

mod noop;
mod sleep;

pub use noop::Noop;
pub use sleep::Sleep;
