#!/usr/bin/env bash
# One lane drained by two `skiplock work` processes beside a history, with the statistics
# taken before the lane existed, against the same drain after an ANALYZE (issue 38's
# target: within 20 %). A lane runs one job at a time, so the drain is a chain of lane
# steps: each completion makes the next job the lane's head (skiplock.internal_advance_lanes)
# and every step's cost shows in the total.
#
#   benches/with-private-server.sh -- benches/lane-drain.sh    # autovacuum on, as users run
#   LANE=2000 HISTORY=100000 benches/lane-drain.sh
#
# Prints, for each of `stale` and `analyzed`, the wall time from the workers' start to the
# lane's last job finished, and the steps per second. Needs psql and a `skiplock` binary
# (SKIPLOCK_BIN, default target/release/skiplock). The server: DATABASE_URL (the script
# creates its own database beside the one named there), default
# postgres://postgres@127.0.0.1:5432/postgres.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bin="${SKIPLOCK_BIN:-target/release/skiplock}"
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
db="skiplock_bench_lane_drain"
url="${server%/*}/$db"
lane="${LANE:-2000}"
history="${HISTORY:-100000}"
pids=()

cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    psql -q "$server" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

run() {
    psql -q "$url" -v ON_ERROR_STOP=1 -At "$@"
}

one() {
    local mode="$1"
    psql -q "$server" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db" >/dev/null
    "$bin" migrate --database-url "$url" >/dev/null
    # The history, analyzed; then the lane, which the statistics have not seen.
    run <<SQL >/dev/null
INSERT INTO skiplock.jobs (kind, state, attempt, finished_at)
SELECT 'noop', 'succeeded', 1, now() FROM generate_series(1, $history);
ANALYZE skiplock.jobs;
INSERT INTO skiplock.jobs (kind, ordering_key) SELECT 'noop', 'the-lane' FROM generate_series(1, $lane);
SQL
    if [ "$mode" = analyzed ]; then
        run -c "ANALYZE skiplock.jobs" >/dev/null
    fi
    local started
    started=$(date +%s.%N)
    pids=()
    for _ in 1 2; do
        "$bin" work --database-url "$url" >/dev/null 2>&1 &
        pids+=($!)
    done
    while [ "$(run -c "SELECT count(*) FROM skiplock.jobs WHERE ordering_key = 'the-lane' AND state <> 'succeeded'")" != 0 ]; do
        sleep 0.2
        if [ "$(echo "$(date +%s.%N) - $started > 600" | bc)" = 1 ]; then
            echo "$mode: the lane did not drain within 600 s" >&2
            break
        fi
    done
    local secs
    secs="$(run -c "SELECT extract(epoch FROM max(finished_at) - min(claimed_at))
                    FROM skiplock.jobs WHERE ordering_key = 'the-lane'")"
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    pids=()
    printf '%-9s %5d-job lane beside %7d finished: %7.2f s (db, first claim to last finish), %7.1f steps/s\n' \
        "$mode" "$lane" "$history" "$secs" "$(echo "$lane / $secs" | bc -l)"
}

one stale
one analyzed
