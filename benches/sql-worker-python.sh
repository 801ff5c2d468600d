#!/usr/bin/env bash
# Drain N no-op jobs with the Python example worker (examples/python/worker.py, on the SQL
# worker protocol) at each batch size, then with `skiplock work` for comparison, and print
# the rate of each: issue 28's benchmark (100,000 jobs at batch sizes 1, 100 and 1,000).
#
# Each run starts from the same table: TRUNCATE, N jobs inserted by plain SQL, VACUUM
# ANALYZE. The rate is counted in the database, from the first claim to the last completion
# (min(claimed_at) to max(finished_at)), so the worker's start and exit are left out; the
# wall time of the whole process is printed beside it. One worker process at a time, each
# with its defaults otherwise (the Python worker logs only warnings, a line per job being
# what it would otherwise measure).
#
# The Python example ends each job in a transaction of its own (skiplock.complete in
# autocommit), and at batch size 1 claims in one too: its rate is bounded by the server's
# durable-commit latency (pg_test_fsync tells it), which `skiplock work`, saving outcomes
# in batches, pays once per batch.
#
# Usage: benches/sql-worker-python.sh [JOBS] [BATCH...]
#   JOBS defaults to 100000, the batch sizes to 1 100 1000.
#   DATABASE_URL: the server (a database `skiplock_bench_sql_worker` is recreated on it and
#                 dropped at the end).
#   PYTHON:       the interpreter (default python3; needs psycopg 3:
#                 pip install 'psycopg[binary]').
#   SKIPLOCK_BIN: the binary that migrates and runs `skiplock work` (default
#                 target/release/skiplock, built by `cargo build --release --features cli`
#                 if missing).
#   RUST_WORKER_ARGS: more `skiplock work` arguments (default none: its defaults).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

jobs="${1:-100000}"
shift || true
batches=("$@")
[ "${#batches[@]}" -gt 0 ] || batches=(1 100 1000)
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
name=skiplock_bench_sql_worker
db="${server%/*}/$name"
python=${PYTHON:-python3}
bin=${SKIPLOCK_BIN:-target/release/skiplock}
[ -n "${SKIPLOCK_BIN:-}" ] || [ -x "$bin" ] || cargo build --release --features cli --bin skiplock >&2
"$python" -c 'import psycopg' || { echo "error: $python has no psycopg 3: pip install 'psycopg[binary]'" >&2; exit 1; }

psql "$server" -qc "SET client_min_messages = warning" -c "DROP DATABASE IF EXISTS $name WITH (FORCE)" \
    -c "CREATE DATABASE $name" >/dev/null
# The workers' own logs (warnings and the Rust worker's summary), shown when a run fails.
logs=$(mktemp)
trap 'psql "$server" -qc "DROP DATABASE IF EXISTS $name WITH (FORCE)" >/dev/null; rm -f "$logs"' EXIT
"$bin" --database-url "$db" migrate >/dev/null

fill() {
    psql "$db" -q -v ON_ERROR_STOP=1 >/dev/null <<SQL
TRUNCATE skiplock.jobs CASCADE;
INSERT INTO skiplock.jobs (kind, args) SELECT 'noop', '{}' FROM generate_series(1, $jobs);
VACUUM ANALYZE skiplock.jobs;
SQL
}

# Runs the command given (a worker that exits once the queue is empty) over a fresh table
# and prints its row.
drain() {
    local worker=$1 batch=$2
    shift 2
    fill
    local start end
    start=$(date +%s.%N)
    : >"$logs"
    "$@" >/dev/null 2>"$logs" || { cat "$logs" >&2; echo "error: $worker (batch $batch) failed" >&2; exit 1; }
    end=$(date +%s.%N)
    local left drained
    left=$(psql "$db" -Atc "SELECT count(*) FROM skiplock.jobs WHERE state <> 'succeeded'")
    if [ "$left" != 0 ]; then
        cat "$logs" >&2
        echo "error: $worker (batch $batch) left $left jobs not succeeded" >&2
        exit 1
    fi
    drained=$(psql "$db" -Atc "SELECT extract(epoch FROM max(finished_at) - min(claimed_at))
                               FROM skiplock.jobs")
    awk -v w="$worker" -v b="$batch" -v j="$jobs" -v s="$start" -v e="$end" -v dr="$drained" \
        'BEGIN { printf "| %s | %s | %d | %.2f | %.2f | %.0f |\n", w, b, j, e - s, dr, j / dr }'
}

echo "- $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $("$python" --version 2>&1), psycopg $("$python" -c 'import psycopg; print(psycopg.__version__)'), $(psql "$server" -Atc 'SHOW server_version'), $(nproc) cores"
echo
printf '| worker | batch | jobs | wall s | drain s (first claim → last completion) | jobs/s |\n'
printf '|---|---|---|---|---|---|\n'
for batch in "${batches[@]}"; do
    drain "examples/python/worker.py" "$batch" \
        env DATABASE_URL="$db" "$python" examples/python/worker.py --kinds noop --batch "$batch" \
        --exit-when-idle --log-level WARNING
done
# shellcheck disable=SC2086 # RUST_WORKER_ARGS is a list of arguments.
drain "skiplock work" "(its prefetch)" \
    env RUST_LOG=warn "$bin" --database-url "$db" work --kinds noop --exit-when-idle ${RUST_WORKER_ARGS:-}
