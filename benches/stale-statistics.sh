#!/usr/bin/env bash
# The follow-up statements under statistics taken before the work existed (issue 38):
# a lane step, a dependency settle, a cascade of cancellations and skiplock.maintain(),
# each beside 100,000 finished jobs whose ANALYZE came before the waiting jobs did.
# Autovacuum is off on the table, so the statistics stay as they were.
#
#   benches/stale-statistics.sh                     # this checkout's functions
#   FUNCTIONS=/tmp/old-functions.sql benches/stale-statistics.sh   # another version's
#     (its migrations/functions/*.sql concatenated in name order, or an older checkout's
#     migrations/functions.sql)
#
# Needs psql and a `skiplock` binary (SKIPLOCK_BIN, default target/debug/skiplock). The
# server: DATABASE_URL (the script creates its own database beside the one named there),
# default postgres://postgres@127.0.0.1:5432/postgres. Prints each statement's time as
# psql's \timing reports it (ms); the first call of a session includes planning.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bin="${SKIPLOCK_BIN:-target/debug/skiplock}"
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
db="skiplock_bench_stale_stats"
url="${server%/*}/$db"
history="${HISTORY:-100000}"

psql -q "$server" -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db"
trap 'psql -q "$server" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"' EXIT
"$bin" migrate --database-url "$url" >/dev/null
if [ -n "${FUNCTIONS:-}" ]; then
    psql -q "$url" -v ON_ERROR_STOP=1 -f "$FUNCTIONS" >/dev/null
fi

run() {
    psql -q "$url" -v ON_ERROR_STOP=1 "$@"
}

run <<SQL
ALTER TABLE skiplock.jobs SET (autovacuum_enabled = false);
INSERT INTO skiplock.jobs (kind, state, finished_at)
SELECT 'noop', 'succeeded', now() FROM generate_series(1, $history);
ANALYZE skiplock.jobs;
ANALYZE skiplock.job_dependencies;
-- A lane of 3,000 jobs.
INSERT INTO skiplock.jobs (kind, queue, ordering_key)
SELECT 'noop', 'lane', 'one-lane' FROM generate_series(1, 3000);
-- Six parents with 1,000 waiting children each.
INSERT INTO skiplock.jobs (kind, queue) SELECT 'parent', 'parents' FROM generate_series(1, 6);
SELECT skiplock.enqueue('child', queue => 'children',
                        depends_on => ARRAY[(SELECT min(id) FROM skiplock.jobs
                                             WHERE kind = 'parent') + g % 6])
FROM generate_series(1, 6000) g \g /dev/null
SQL

step() {
    # $1: what, $2: queue, $3: the outcome statement ('complete' or 'discard')
    local what="$1" queue="$2" outcome="$3"
    local call="skiplock.complete(:id, :'claim_token')"
    [ "$outcome" = discard ] && call="skiplock.discard(:id, :'claim_token', 'bench')"
    for round in 1 2 3; do
        printf '%-48s round %s: ' "$what" "$round"
        run <<SQL | grep -o 'Time: [0-9.]* ms'
SELECT id, claim_token FROM skiplock.claim('$queue', 1, 'bench') \gset
\timing on
SELECT $call \g /dev/null
SQL
    done
}

step "lane step (3,000-job lane)" lane complete
step "dependency settle (1,000 children queued)" parents complete
step "cancel cascade (1,000 children cancelled)" parents discard

# 150,000 waiting jobs: 1,500 lanes of 100.
run <<SQL
INSERT INTO skiplock.jobs (kind, queue, ordering_key)
SELECT 'noop', 'lanes', 'lane-' || (g % 1500) FROM generate_series(1, 150000) g;
SQL
for round in 1 2 3 4 5; do
    printf '%-48s round %s: ' "maintain() beside 150,000 waiting jobs" "$round"
    run <<SQL | grep -o 'Time: [0-9.]* ms'
\timing on
SELECT * FROM skiplock.maintain() \g /dev/null
SQL
done
