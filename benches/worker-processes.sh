#!/usr/bin/env bash
# Drain N jobs (noop unless JOB_KIND says otherwise) with 1, 2 and 4 `skiplock work`
# processes against one Postgres, and print the rate for each: does throughput hold or
# grow as worker processes are added (claims, heartbeats and maintenance running in every
# process), or collapse?
#
# Beside the rate it prints where the CPU went, per job: the workers' own CPU (from
# /usr/bin/time), Postgres's (every process of the server, from /proc: the postmaster,
# the backends it reaped and the ones still alive), and the transactions committed
# (`pg_stat_database`). Postgres's CPU per job is what tells contention (it grows with
# the processes) from two cores shared by more programs (it does not).
#
# Usage: benches/worker-processes.sh [JOBS] [PROCESSES...]
#   DATABASE_URL: the server (a database `skiplock_bench_procs` is recreated on it).
#   WORKER_CPUS:  a CPU list (taskset) to run the worker processes on, for example 1, with
#                 the server pinned elsewhere (benches/with-private-server.sh --cpus 0).
#   WORKER_ARGS:  more `skiplock work` arguments for every process, for example
#                 "--prefetch 2000" or "--concurrency 100".
#   JOB_KIND, JOB_ARGS: the built-in kind the jobs run and its arguments (default `noop`
#                 and `{}`). With `sleep` and `{"ms": 10}` one process is bounded by its
#                 slots, not by the database, so the rate shows whether throughput grows
#                 with processes until the database saturates.
#   MAX_RUNNING:  a max_running for the jobs' queue (`default`), for example 100000 to
#                 measure a limit that never binds against none.
#   SKIPLOCK_BENCH_AFTER_MIGRATE: SQL run once the schema is migrated, for an A/B run of a
#                 setting, for example "ALTER TABLE skiplock.jobs_live SET (fillfactor = 40)"
#                 (the same variable as the Rust benches').
#   SKIPLOCK_BIN: the binary to run (default target/release/skiplock, built by
#                 `cargo build --release --features cli` if missing), for A/B runs of two builds.
#
# The last two columns are the entries of `jobs_claim_idx` the drain's index scans read and
# the heap tuples they fetched, per job (`pg_stat_user_indexes`, reset before each drain):
# what claims step over beside what they take.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

jobs="${1:-200000}"
shift || true
counts=("$@")
[ "${#counts[@]}" -gt 0 ] || counts=(1 2 4)
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
db="${server%/*}/skiplock_bench_procs"
kind="${JOB_KIND:-noop}"
job_args=${JOB_ARGS:-'{}'}
bin=${SKIPLOCK_BIN:-target/release/skiplock}
[ -n "${SKIPLOCK_BIN:-}" ] || [ -x "$bin" ] || cargo build --release --features cli --bin skiplock >&2
pin=()
[ -z "${WORKER_CPUS:-}" ] || pin=(taskset -c "$WORKER_CPUS")

psql "$server" -qc "DROP DATABASE IF EXISTS skiplock_bench_procs WITH (FORCE)" \
    -c "CREATE DATABASE skiplock_bench_procs" >/dev/null
"$bin" --database-url "$db" migrate >/dev/null
[ -z "${SKIPLOCK_BENCH_AFTER_MIGRATE:-}" ] ||
    psql "$db" -qAt -v ON_ERROR_STOP=1 -c "$SKIPLOCK_BENCH_AFTER_MIGRATE" >/dev/null
[ -z "${MAX_RUNNING:-}" ] ||
    psql "$db" -qAt -v ON_ERROR_STOP=1 -c "SELECT skiplock.set_queue_limits('default', $MAX_RUNNING)" >/dev/null

# The postmaster, from its pid file (the server runs on this machine).
postmaster=$(head -n 1 "$(psql "$db" -Atc "SHOW data_directory")/postmaster.pid")
ticks=$(getconf CLK_TCK)
# CPU seconds of the whole server so far: the postmaster's own and its reaped children's
# (fields 14-17), and its live children's own (14-15).
pg_cpu() {
    local total
    total=$(awk '{print $14 + $15 + $16 + $17}' "/proc/$postmaster/stat")
    for child in $(pgrep -P "$postmaster"); do
        total=$((total + $(awk '{print $14 + $15}' "/proc/$child/stat" 2>/dev/null || echo 0)))
    done
    awk -v t="$total" -v hz="$ticks" 'BEGIN { printf "%.3f", t / hz }'
}
commits() {
    psql "$db" -Atc "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
}

printf '| worker processes | jobs | seconds | jobs/s | jobs/s, drain only | worker CPU µs/job | Postgres CPU µs/job | commits/job | claim-index entries read/job | heap fetches/job |\n'
printf '|---|---|---|---|---|---|---|---|---|---|\n'
times=$(mktemp -d)
trap 'rm -rf "$times"' EXIT
for n in "${counts[@]}"; do
    # From standard input, where psql fills in its variables (it does not in -c).
    psql "$db" -q -v ON_ERROR_STOP=1 -v kind="$kind" -v job_args="$job_args" >/dev/null <<SQL
SET client_min_messages = warning;
TRUNCATE skiplock.jobs CASCADE;
INSERT INTO skiplock.jobs (kind, args) SELECT :'kind', :'job_args'::jsonb FROM generate_series(1, $jobs);
VACUUM ANALYZE skiplock.jobs;
SELECT pg_stat_reset();
SQL
    # Statistics reach pg_stat_database when a session ends or every 500 ms or so.
    sleep 1
    commits_before=$(commits)
    pg_before=$(pg_cpu)
    start=$(date +%s.%N)
    pids=()
    for ((i = 0; i < n; i++)); do
        RUST_LOG=warn "${pin[@]}" /usr/bin/time -f '%U %S' -o "$times/$i" \
            "$bin" --database-url "$db" work --kinds "$kind" --exit-when-idle ${WORKER_ARGS:-} >/dev/null 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    end=$(date +%s.%N)
    # The workers' backends end with them; the postmaster counts their CPU once it has
    # reaped them.
    sleep 1
    pg_after=$(pg_cpu)
    commits_after=$(commits)
    worker_cpu=$(cat "$times"/* | awk '{ s += $1 + $2 } END { printf "%.3f", s }')
    rm -f "$times"/*
    # The drain as the database saw it: first claim to last completion, without the
    # processes' start and exit.
    drained=$(psql "$db" -Atc "SELECT extract(epoch FROM max(finished_at) - min(claimed_at))
                               FROM skiplock.jobs")
    read ix_read ix_fetch < <(psql "$db" -AtF ' ' -c "SELECT idx_tup_read, idx_tup_fetch
        FROM pg_stat_user_indexes WHERE indexrelname = 'jobs_claim_idx'")
    left=$(psql "$db" -Atc "SELECT count(*) FROM skiplock.jobs WHERE state <> 'succeeded'")
    [ "$left" = 0 ] || { echo "error: $left jobs not succeeded with $n processes" >&2; exit 1; }
    awk -v n="$n" -v j="$jobs" -v s="$start" -v e="$end" -v w="$worker_cpu" -v dr="$drained" \
        -v pb="$pg_before" -v pa="$pg_after" -v cb="$commits_before" -v ca="$commits_after" \
        -v ir="$ix_read" -v ifch="$ix_fetch" \
        'BEGIN { d = e - s; printf "| %d | %d | %.2f | %.0f | %.0f | %.1f | %.1f | %.3f | %.2f | %.2f |\n",
                 n, j, d, j / d, j / dr, w * 1e6 / j, (pa - pb) * 1e6 / j, (ca - cb - 1) / j,
                 ir / j, ifch / j }'
done
psql "$server" -qc "DROP DATABASE skiplock_bench_procs WITH (FORCE)" >/dev/null
