#!/usr/bin/env bash
# Runs the whole benchmark suite in release mode and writes the combined report (Markdown)
# to stdout; progress lines go to stderr.
#
#   benches/run-all.sh [--quick] [--pgss] > report.md
#
#   --quick  smaller sizes and shorter time caps: about 10 minutes on 2 cores
#            (the full suite, with the 1,000,000-job matrix, takes about twice that)
#   --pgss   also run the profile and workloads benches on a private, throwaway Postgres
#            server with pg_stat_statements preloaded (benches/with-private-server.sh:
#            initdb's defaults, the shared server is never restarted)
#
# The server is DATABASE_URL (default postgres://postgres@127.0.0.1:5432/postgres); each
# bench creates its own database there and drops it afterwards. Builds go to
# target/bench (CARGO_TARGET_DIR) so they do not wait on other builds' lock.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/bench}"

args=()
pgss=0
for arg in "$@"; do
    case "$arg" in
        --quick) args+=(--quick) ;;
        --full) ;;
        --pgss) pgss=1 ;;
        *) echo "usage: $0 [--quick] [--pgss]" >&2; exit 2 ;;
    esac
done

echo "building the benches (release)…" >&2
cargo bench --no-run >&2

started=$(date +%s)
echo "# skiplock benchmark report"
echo
echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
echo "- command: benches/run-all.sh $*"
echo
for bench in enqueue drain latency steady workloads footprint profile; do
    echo "running bench $bench…" >&2
    cargo bench --quiet --bench "$bench" -- "${args[@]}"
done

if [ "$pgss" = 1 ]; then
    echo "# Private server (pg_stat_statements preloaded)"
    echo
    for bench in profile workloads; do
        echo "running bench $bench on a private server…" >&2
        benches/with-private-server.sh -c shared_preload_libraries=pg_stat_statements -- \
            cargo bench --quiet --bench "$bench" -- "${args[@]}"
    done
fi
echo "suite finished in $(( $(date +%s) - started )) s" >&2
