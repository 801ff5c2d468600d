#!/usr/bin/env bash
# Server-side cost of the SQL protocol's outcome for one claim: N claimed no-op jobs, each
# completed by its own `skiplock.complete(id, token)` in a loop inside one DO block (no round
# trips, no commits: the function's own CPU and WAL), in ROUNDS rounds. With BEFORE=<git rev>,
# that revision's `skiplock.complete` is loaded beside it as `skiplock.complete_before` and the
# two alternate, each round on fresh jobs.
#
# Usage: [N=5000] [ROUNDS=4] [BEFORE=<rev>] benches/sql-one-claim-outcomes.sh
#   DATABASE_URL: the server (a database `skiplock_bench_one_claim` is recreated on it).
#   SKIPLOCK_BIN: the binary that migrates (default target/debug/skiplock).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
n=${N:-5000}
rounds=${ROUNDS:-4}
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
db="${server%/*}/skiplock_bench_one_claim"
bin=${SKIPLOCK_BIN:-target/debug/skiplock}
[ -n "${SKIPLOCK_BIN:-}" ] || [ -x "$bin" ] || cargo build --features cli --bin skiplock >&2
psql -qX "$server" -c "DROP DATABASE IF EXISTS skiplock_bench_one_claim" \
    -c "CREATE DATABASE skiplock_bench_one_claim"
"$bin" --database-url "$db" migrate >/dev/null
functions=(complete)
if [ -n "${BEFORE:-}" ]; then
    git show "$BEFORE:migrations/functions/10_protocol.sql" \
        | awk '/^CREATE OR REPLACE FUNCTION skiplock.complete\(/,/^\$\$;/' \
        | sed 's/skiplock\.complete(/skiplock.complete_before(/; s/\bcomplete\.\(id\|token\|output\)/complete_before.\1/g' \
        | psql -qX "$db"
    functions=(complete_before complete)
fi
for round in $(seq "$rounds"); do
    for f in "${functions[@]}"; do
        psql -qAtX "$db" <<SQL
TRUNCATE skiplock.jobs_live;
INSERT INTO skiplock.jobs (queue, kind, args) SELECT 'default', 'noop', '{}' FROM generate_series(1, $n);
VACUUM ANALYZE skiplock.jobs_live;
CREATE TEMP TABLE c AS SELECT id, claim_token FROM skiplock.claim('default', $n, 'bench');
SELECT pg_current_wal_lsn() AS l0, clock_timestamp() AS t0 \gset
DO \$\$ DECLARE r record; BEGIN
    FOR r IN SELECT * FROM c ORDER BY id LOOP PERFORM skiplock.$f(r.id, r.claim_token); END LOOP;
END \$\$;
SELECT format('round $round %-16s %6s µs/call, %s WAL bytes/call', '$f',
              round(extract(epoch FROM clock_timestamp() - :'t0'::timestamptz) * 1e6 / $n),
              round((pg_current_wal_lsn() - :'l0'::pg_lsn) / $n));
SQL
    done
done
psql -qX "$server" -c "DROP DATABASE skiplock_bench_one_claim"
