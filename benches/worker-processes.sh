#!/usr/bin/env bash
# Drain N noop jobs with 1, 2 and 4 `skiplock work` processes against one Postgres, and
# print the rate for each: does throughput hold or grow as worker processes are added
# (claims, heartbeats and maintenance running in every process), or collapse?
#
# Usage: benches/worker-processes.sh [JOBS] [PROCESSES...]
#   DATABASE_URL: the server (a database `skiplock_bench_procs` is recreated on it).
#   Uses target/release/skiplock (built by `cargo build --release --features cli` if missing).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

jobs="${1:-200000}"
shift || true
counts=("$@")
[ "${#counts[@]}" -gt 0 ] || counts=(1 2 4)
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
db="${server%/*}/skiplock_bench_procs"
bin=target/release/skiplock
[ -x "$bin" ] || cargo build --release --features cli --bin skiplock >&2

psql "$server" -qc "DROP DATABASE IF EXISTS skiplock_bench_procs WITH (FORCE)" \
    -c "CREATE DATABASE skiplock_bench_procs" >/dev/null
"$bin" --database-url "$db" migrate >/dev/null

printf '| worker processes | jobs | seconds | jobs/s |\n|---|---|---|---|\n'
for n in "${counts[@]}"; do
    psql "$db" -qc "SET client_min_messages = warning" -c "TRUNCATE skiplock.jobs CASCADE" \
        -c "INSERT INTO skiplock.jobs (kind, args) SELECT 'noop', '{}' FROM generate_series(1, $jobs)" \
        -c "VACUUM ANALYZE skiplock.jobs" >/dev/null
    start=$(date +%s.%N)
    pids=()
    for ((i = 0; i < n; i++)); do
        RUST_LOG=warn "$bin" --database-url "$db" work --kinds noop --exit-when-idle >/dev/null &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    end=$(date +%s.%N)
    left=$(psql "$db" -Atc "SELECT count(*) FROM skiplock.jobs WHERE state <> 'succeeded'")
    [ "$left" = 0 ] || { echo "error: $left jobs not succeeded with $n processes" >&2; exit 1; }
    awk -v n="$n" -v j="$jobs" -v s="$start" -v e="$end" \
        'BEGIN { d = e - s; printf "| %d | %d | %.2f | %.0f |\n", n, j, d, j / d }'
done
psql "$server" -qc "DROP DATABASE skiplock_bench_procs WITH (FORCE)" >/dev/null
