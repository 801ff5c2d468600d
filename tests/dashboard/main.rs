//! The web dashboard (`skiplock dashboard`), driven over HTTP and in headless Chromium,
//! and the history rollup behind it.
#![cfg(feature = "cli")]

#[path = "../common/mod.rs"]
mod common;

mod cdp;
mod e2e;
mod history;
mod http;
mod security;
mod support;
