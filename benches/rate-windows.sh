#!/usr/bin/env bash
# What a rate window costs a claim while it never binds: `skiplock.claim` of 100 jobs at a
# time, one client (pgbench, each claim its own transaction), on a queue whose window is far
# from full, for each store of windows the build has. Three parts, each on JOBS `noop` jobs
# (default 40,000) of a queue of its own:
#
#   queue:     rate_limit 100,000 per hour (the queue's own window);
#   key-large: key_rate_limit 10,000 per hour over 10 keys (each key's window);
#   key-small: key_rate_limit 100 per millisecond over 10 keys (a window of 100 starts).
#
# Prints claims/s, jobs/s and WAL bytes per claimed job for each part.
#
# Usage: SKIPLOCK_BIN=<build> benches/with-private-server.sh -- benches/rate-windows.sh [JOBS]
# (SKIPLOCK_BIN: the build whose schema is measured; it only migrates.)
set -euo pipefail

JOBS=${1:-40000}
BIN=${SKIPLOCK_BIN:-target/release/skiplock}
SERVER=${DATABASE_URL%/*}
DB=skiplock_bench_rate_windows
URL="$SERVER/$DB"
CLAIMS=$((JOBS / 100))

[ -x "$BIN" ] || { echo "no $BIN: cargo build --release --features cli --bin skiplock" >&2; exit 1; }
sql() { psql "$URL" -qXAt -v ON_ERROR_STOP=1 -c "$1"; }
script=$(mktemp /tmp/skiplock-rate-windows.XXXXXX.sql)
trap 'rm -f "$script"' EXIT

for part in queue key-large key-small; do
    psql "$SERVER/postgres" -qX -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB"
    DATABASE_URL=$URL "$BIN" migrate >/dev/null
    case $part in
        queue) sql "SELECT skiplock.set_queue_limits('w', NULL, 100000, '1 hour')" ;;
        key-large) sql "SELECT skiplock.set_queue_limits('w', NULL, key_rate_limit => 10000,
                                                         key_rate_period => '1 hour')" ;;
        key-small) sql "SELECT skiplock.set_queue_limits('w', NULL, key_rate_limit => 100,
                                                         key_rate_period => '1 millisecond')" ;;
    esac
    sql "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
         SELECT 'noop', 'w', CASE WHEN '$part' = 'queue' THEN NULL ELSE 'key-' || (g % 10) END
         FROM generate_series(1, $JOBS) g"
    sql "VACUUM ANALYZE"
    echo "SELECT count(*) FROM skiplock.claim('w', 100, 'bench');" >"$script"
    wal0=$(sql "SELECT pg_current_wal_lsn()")
    tps=$(pgbench -n -c 1 -t "$CLAIMS" -f "$script" "$URL" 2>/dev/null \
          | sed -n 's/^tps = \([0-9.]*\).*/\1/p')
    wal1=$(sql "SELECT pg_current_wal_lsn()")
    claimed=$(sql "SELECT count(*) FROM skiplock.jobs WHERE state = 'running'")
    wal=$(sql "SELECT round(pg_wal_lsn_diff('$wal1', '$wal0') / greatest($claimed, 1))")
    echo "$part: $tps claims/s, $(echo "$tps * 100" | bc) jobs/s, $claimed claimed, $wal WAL B/job"
done
psql "$SERVER/postgres" -qX -c "DROP DATABASE $DB"
