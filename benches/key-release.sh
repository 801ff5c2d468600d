#!/usr/bin/env bash
# A claim of a key-limited queue beside many jobs of the key waiting for a parent (issue 48's
# target: within 2 ms of the same claim without them, with 30 days of history kept).
#
# Queue `keyed`, key_max_running 1; key `hot` has HELD jobs that may run (the first claim
# holds all but one back). Each round completes the key's running job (its slot frees) and
# claims: the claim lets the next held job of the key go and takes it. Run twice: with no
# other job of the key, then beside CHILDREN jobs of the key waiting for a parent that has
# not run. Before, letting a key's held jobs go walked every waiting job of the key, each
# parent checked.
#
#   SKIPLOCK_BIN=target/release/skiplock benches/key-release.sh
#   CHILDREN=20000 DAYS=30 PER_DAY=20000 ROUNDS=300 benches/key-release.sh
#
# Prints, for each run, the claim's mean latency over ROUNDS rounds (pgbench -r, one
# client). Needs psql, pgbench and a `skiplock` binary for the migration (SKIPLOCK_BIN,
# default target/release/skiplock). The server: DATABASE_URL (the script makes its own
# database beside the one named there), default postgres://postgres@127.0.0.1:5432/postgres.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bin="${SKIPLOCK_BIN:-target/release/skiplock}"
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
db="skiplock_bench_key_release"
url="${server%/*}/$db"
children="${CHILDREN:-20000}"
days="${DAYS:-30}"
per_day="${PER_DAY:-20000}"
rounds="${ROUNDS:-300}"
script="$(mktemp)"

cleanup() {
    rm -f "$script"
    psql -q "$server" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

[ -x "$bin" ] || { echo "no $bin: cargo build --release --bin skiplock, or set SKIPLOCK_BIN" >&2; exit 1; }

cat >"$script" <<'SQL'
SELECT skiplock.complete(id, claim_token) FROM skiplock.jobs_live
WHERE queue = 'keyed' AND state = 'running';
SELECT count(*) FROM skiplock.claim('keyed', 1, 'bench');
SQL

run() {
    local beside="$1"
    psql -qX "$server" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db" >/dev/null
    DATABASE_URL="$url" "$bin" migrate >/dev/null
    psql -qX -v ON_ERROR_STOP=1 "$url" >/dev/null <<SQL
SELECT skiplock.internal_prepare_done_partitions((now() AT TIME ZONE 'UTC')::date - $days, $days + 1);
INSERT INTO skiplock.jobs (kind, queue, state, attempt, claimed_at, finished_at)
SELECT 'noop', 'keyed', 'succeeded', 1, t, t
FROM generate_series(1, $days * $per_day) g,
     LATERAL (SELECT now() - (g % $days) * interval '1 day' - interval '1 minute' AS t) f;
SELECT skiplock.set_queue_limits('keyed', NULL, key_max_running => 1);
SELECT skiplock.enqueue('noop', queue => 'parents');
SELECT skiplock.enqueue('noop', queue => 'keyed', concurrency_key => 'hot',
                        depends_on => ARRAY[(SELECT id FROM skiplock.jobs WHERE queue = 'parents')])
FROM generate_series(1, $beside);
INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
SELECT 'noop', 'keyed', 'hot' FROM generate_series(1, $rounds + 10);
SELECT count(*) FROM skiplock.claim('keyed', 1, 'bench');
VACUUM ANALYZE;
SQL
    local mean
    mean="$(pgbench -n -r -t "$rounds" -f "$script" "$url" 2>/dev/null \
        | awk '/skiplock.claim/ { print $1 }')"
    local left
    left="$(psql -qXAt "$url" -c "SELECT count(*) FROM skiplock.jobs WHERE concurrency_key = 'hot' AND state = 'succeeded'")"
    printf '%-28s claim mean %s ms (%s rounds, %s of the key succeeded)\n' \
        "beside $beside children:" "$mean" "$rounds" "$left"
}

run 0
run "$children"
