#!/usr/bin/env bash
# Runs the whole benchmark suite in release mode and writes the combined report (Markdown)
# to stdout; progress lines go to stderr.
#
#   benches/run-all.sh [--quick] [--pgss] > report.md
#
#   --quick  smaller sizes and shorter time caps: about 10 minutes on 2 cores
#            (the full suite, with the 1,000,000-job matrix, takes about twice that)
#   --pgss   also run the profile and workloads benches on a private, throwaway Postgres
#            server started from the installed binaries with pg_stat_statements preloaded
#            (the shared server is never restarted); initdb's defaults, fsync on
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
    pgbin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    if [ -z "$pgbin" ] || [ ! -x "$pgbin/initdb" ]; then
        echo "## pg_stat_statements: skipped (no Postgres binaries under /usr/lib/postgresql)"
    else
        dir=$(mktemp -d /tmp/skiplock-pgss.XXXXXX)
        as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
        [ "$(id -u)" = 0 ] && chown postgres: "$dir"
        port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        stop_private() {
            as_pg "$pgbin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
            rm -rf "$dir"
        }
        trap stop_private EXIT
        echo "starting a private server on port $port with pg_stat_statements…" >&2
        as_pg "$pgbin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 >/dev/null
        as_pg "$pgbin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -o \
            "-c port=$port -c listen_addresses=127.0.0.1 -c unix_socket_directories=$dir -c shared_preload_libraries=pg_stat_statements" \
            start >/dev/null
        echo "# Private server (pg_stat_statements preloaded)"
        echo
        for bench in profile workloads; do
            echo "running bench $bench on the private server…" >&2
            DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres" \
                cargo bench --quiet --bench "$bench" -- "${args[@]}"
        done
        stop_private
        trap - EXIT
    fi
fi
echo "suite finished in $(( $(date +%s) - started )) s" >&2
