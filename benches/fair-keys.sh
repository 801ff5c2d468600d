#!/usr/bin/env bash
# Fair queueing by key (issue 50's targets): one key's backlog of BIG `sleep` jobs of 1 ms
# (spread over BIG_KEYS keys when given, for what fairness costs where it does not bind),
# and KEYS keys of PER_KEY such jobs each, enqueued (a statement per key) AFTER seconds into
# the backlog's drain by PROCS `skiplock work` processes of concurrency CONC. Run twice on
# databases of their own: the queue with key_claimable CLAIMABLE, then without it.
#
# Prints for each run: each small key's first job's start after its enqueue
# (claimed_at - created_at: p50, p99, max), the last small job's finish after the small
# keys' enqueue began, and the whole drain's jobs/s (first claim to last finish, by the
# database clock).
#
#   SKIPLOCK_BIN=target/release/skiplock benches/fair-keys.sh
#   BIG=1000000 KEYS=1000 PER_KEY=10 CLAIMABLE=32 benches/fair-keys.sh
#
# Needs psql and a release `skiplock` (cargo build --release --features cli --bin
# skiplock). The server: DATABASE_URL (default postgres://postgres@127.0.0.1:5432/postgres).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bin="${SKIPLOCK_BIN:-target/release/skiplock}"
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
big="${BIG:-200000}"
big_keys="${BIG_KEYS:-1}"
keys="${KEYS:-1000}"
per_key="${PER_KEY:-10}"
claimable="${CLAIMABLE:-32}"
after="${AFTER:-3}"
procs="${PROCS:-2}"
conc="${CONC:-32}"
[ -x "$bin" ] || { echo "no $bin: cargo build --release --features cli --bin skiplock" >&2; exit 1; }

run() { # NAME KEY_CLAIMABLE(or NULL)
    local db="skiplock_bench_fair_$1" url="${server%/*}/skiplock_bench_fair_$1"
    psql -qX "$server" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db"
    DATABASE_URL=$url "$bin" migrate >/dev/null
    sql() { psql "$url" -qXAt -v ON_ERROR_STOP=1 -c "$1"; }
    sql "INSERT INTO skiplock.queues (name, key_claimable) VALUES ('default', $2)"
    sql "INSERT INTO skiplock.jobs (kind, args, concurrency_key)
         SELECT 'sleep', '{\"ms\": 1}', CASE WHEN $big_keys = 1 THEN 'big' ELSE 'big-' || g % $big_keys END
         FROM generate_series(1, $big) g"
    sql "VACUUM ANALYZE skiplock.jobs_live"
    local pids=()
    for i in $(seq "$procs"); do
        DATABASE_URL=$url RUST_LOG=warn "$bin" work --concurrency "$conc" \
            >/dev/null 2>"/tmp/skiplock-fair-$1-$i.log" &
        pids+=($!)
    done
    sleep "$after"
    local script
    script=$(mktemp)
    echo "SELECT clock_timestamp() AS small_from \\gset" >"$script"
    for k in $(seq "$keys"); do
        echo "INSERT INTO skiplock.jobs (kind, args, concurrency_key) SELECT 'sleep', '{\"ms\": 1}', 'k$k' FROM generate_series(1, $per_key);"
    done >>"$script"
    echo "INSERT INTO small_from VALUES (:'small_from');" >>"$script"
    sql "CREATE TABLE small_from (at timestamptz)"
    psql "$url" -qXAt -v ON_ERROR_STOP=1 -f "$script" >/dev/null
    rm -f "$script"
    # Not --exit-when-idle: a worker that drained the backlog between two of the small
    # keys' statements would exit with the rest of them still to come. Stopped once every
    # job has finished (the figures below are read from the jobs' own times).
    until [ "$(sql "SELECT count(*) FROM skiplock.jobs
                     WHERE state NOT IN ('succeeded', 'dead', 'cancelled')")" = 0 ]; do
        sleep 0.2
    done
    for pid in "${pids[@]}"; do kill -TERM "$pid"; wait "$pid" || true; done
    echo "## key_claimable $2: $big jobs of $big_keys key(s), then $keys keys of $per_key after ${after}s; $procs processes x $conc"
    sql "SELECT 'small keys'' first job, start after enqueue, ms: p50 '
                || round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 1)
                || ', p99 ' || round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 1)
                || ', max ' || round(max(ms)::numeric, 1)
         FROM (SELECT DISTINCT ON (concurrency_key)
                      extract(epoch FROM claimed_at - created_at) * 1000 AS ms
               FROM skiplock.jobs WHERE concurrency_key NOT LIKE 'big%'
               ORDER BY concurrency_key, claimed_at) f"
    sql "SELECT 'last small job done after their enqueue began, s: '
                || round(extract(epoch FROM max(j.finished_at) - min(s.at))::numeric, 2)
         FROM skiplock.jobs j, small_from s WHERE j.concurrency_key NOT LIKE 'big%'"
    sql "SELECT 'drain, jobs/s (first claim to last finish): '
                || round(count(*) / extract(epoch FROM max(finished_at) - min(claimed_at)))
                || '; succeeded ' || count(*) FILTER (WHERE state = 'succeeded') || ' of ' || count(*)
         FROM skiplock.jobs"
    psql -qX "$server" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"
}

run fair "$claimable"
run fifo NULL
