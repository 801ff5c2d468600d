#!/usr/bin/env bash
# Builds and runs docs/testing-your-jobs.md's complete example as an application's test:
# a crate of its own under target/, depending on skiplock as the guide says
# (`features = ["testing"]`, nothing else) and on the crates the guide names (tokio with
# `macros` and `rt`, sqlx, serde, serde_json), with the example's text taken from the
# guide itself. skiplock's own test of that example (tests/testing_guide.rs) builds with
# every feature and skiplock's dev-dependencies, which can hide a feature the example
# needs and the guide does not ask for. Needs DATABASE_URL's server (the example creates
# and drops a database next to it).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
app="$repo/target/testing-guide-app"
rm -rf "$app"
mkdir -p "$app/src" "$app/tests"

cat >"$app/Cargo.toml" <<TOML
[package]
name = "testing-guide-app"
version = "0.0.0"
edition = "2024"
publish = false

[workspace]

[dependencies]
tokio = { version = "1", features = ["macros", "rt"] }
sqlx = { version = "0.9", default-features = false, features = ["postgres", "runtime-tokio"] }
serde = { version = "1", features = ["derive"] }
serde_json = "1"

[dev-dependencies]
skiplock = { path = "$repo", features = ["testing"] }
TOML
echo '//! The application whose tests use skiplock::testing.' >"$app/src/lib.rs"

# The guide's Rust block under "## A complete example", as printed.
awk '
    /^## A complete example/ { section = 1; next }
    section && /^## / { exit }
    section && /^```rust$/ { inside = 1; next }
    inside && /^```$/ { exit }
    inside { print }
' "$repo/docs/testing-your-jobs.md" >"$app/tests/signup.rs"
if ! grep -q 'skiplock::testing' "$app/tests/signup.rs"; then
    echo "error: no Rust block under '## A complete example' in docs/testing-your-jobs.md" >&2
    exit 1
fi

# skiplock's lock file pins the versions skiplock is tested with; the build shares
# skiplock's target directory, so the crates already built with the same features are reused.
cp "$repo/Cargo.lock" "$app/Cargo.lock"
cd "$app"
CARGO_TARGET_DIR="$repo/target" cargo test --test signup 2>&1 | tee "$app/test.log"
# A step that ran no test (the block lost its #[tokio::test], a filter matched nothing)
# passes cargo; it must not pass here.
if ! grep -Eq '^test result: ok\. [1-9][0-9]* passed' "$app/test.log"; then
    echo "error: the guide's example ran no test (docs/testing-your-jobs.md, '## A complete example')" >&2
    exit 1
fi
