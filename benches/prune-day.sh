#!/usr/bin/env bash
# Pruning a day of finished jobs (issue 37): JOBS succeeded jobs (default 1,000,000) that
# finished three days ago, removed by `skiplock prune` under the default retention, twice:
#
#   drop    the day has its own table (jobs_done_succeeded_<yyyymmdd>): the pruner rolls it
#           up into skiplock.job_history and drops the table;
#   delete  the same rows in jobs_done_default (no table was made for that day): the
#           pruner deletes them in batches of 1,000, each rolled up in the same statement,
#           which is what every finished job cost before days were dropped whole.
#
# Prints each run's wall time (the whole `skiplock prune` process), the jobs it reports,
# the history it rolled up, and the dead tuples then left in skiplock's tables.
#
#   benches/prune-day.sh               # 1,000,000 jobs
#   JOBS=200000 benches/prune-day.sh
#
# Needs psql and a `skiplock` binary (SKIPLOCK_BIN, default target/release/skiplock). The
# server: DATABASE_URL (the script creates its own database beside the one named there),
# default postgres://postgres@127.0.0.1:5432/postgres. Run it on a quiet machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bin="${SKIPLOCK_BIN:-target/release/skiplock}"
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
db="skiplock_bench_prune_day"
url="${server%/*}/$db"
jobs="${JOBS:-1000000}"

trap 'psql -q "$server" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"' EXIT

run() {
    psql -q "$url" -v ON_ERROR_STOP=1 "$@"
}

one() {
    local mode="$1"
    psql -q "$server" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db"
    "$bin" migrate --database-url "$url" >/dev/null
    if [ "$mode" = drop ]; then
        run -c "SELECT skiplock.internal_prepare_done_partitions((now() AT TIME ZONE 'UTC')::date - 3, 1)" >/dev/null
    fi
    # A day of no-op jobs, spread over its hours, as a worker leaves them.
    run <<SQL
INSERT INTO skiplock.jobs (kind, queue, state, attempt, scheduled_at, claimed_at, finished_at)
SELECT 'noop', 'default', 'succeeded', 1, f - interval '2 ms', f - interval '1 ms', f
FROM (SELECT ((now() AT TIME ZONE 'UTC')::date - 3)::timestamp AT TIME ZONE 'UTC'
             + g * (interval '1 day' / $jobs) AS f
      FROM generate_series(0, $jobs - 1) g) t;
VACUUM ANALYZE;
SQL
    local where
    where="$(run -At -c "SELECT DISTINCT tableoid::regclass FROM skiplock.jobs")"
    local started ended
    started=$(date +%s.%N)
    "$bin" prune --database-url "$url" --json >/tmp/prune-day.json
    ended=$(date +%s.%N)
    local dead
    dead="$(run -At -c "SELECT pg_stat_force_next_flush()" -c "SELECT pg_sleep(0.5)" \
        -c "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables WHERE schemaname = 'skiplock'" | tail -1)"
    local rolled
    rolled="$(run -At -c "SELECT coalesce(sum(succeeded), 0) FROM skiplock.job_history")"
    printf '%-6s %8d jobs in %-40s %7.3f s  reported %s  rolled up %s  dead tuples %s\n' \
        "$mode" "$jobs" "$where" "$(echo "$ended - $started" | bc)" "$(tr -d " \n" </tmp/prune-day.json)" \
        "$rolled" "$dead"
}

one drop
one delete
