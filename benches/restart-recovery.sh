#!/usr/bin/env bash
# How soon `skiplock work` runs jobs again after its Postgres restarts (issue 38: the first
# job succeeded 4.88 s after `pg_ctl restart -m immediate` began, against 0.6-0.95 s the
# week before). Run inside benches/with-private-server.sh, which gives the server to
# restart:
#
#   benches/with-private-server.sh -- benches/restart-recovery.sh
#   OUTAGE=2 benches/with-private-server.sh -- benches/restart-recovery.sh   # down 2 s more
#
# Jobs come due every 10 ms for 30 s; one `skiplock work` runs them; 10 s in, the server
# is restarted with `-m immediate` (a crash: backends killed, recovery at start). Prints
# how long after the restart began the server was back, the first job succeeded once it
# was, and the jobs due by then were all done. Needs psql and a `skiplock` binary (SKIPLOCK_BIN, default
# target/release/skiplock).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

: "${PRIVATE_PGDATA:?run inside benches/with-private-server.sh}"
bin="${SKIPLOCK_BIN:-target/release/skiplock}"
url="$DATABASE_URL"
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

"$bin" migrate --database-url "$url" >/dev/null
psql -q "$url" -v ON_ERROR_STOP=1 -c \
    "INSERT INTO skiplock.jobs (kind, scheduled_at)
     SELECT 'noop', now() + interval '2 seconds' + g * interval '10 ms'
     FROM generate_series(0, 2999) g" >/dev/null
"$bin" work --database-url "$url" >/tmp/restart-recovery-worker.log 2>&1 &
worker=$!
trap 'kill $worker 2>/dev/null || true' EXIT
sleep 12
began=$(date +%s.%N)
if [ "${OUTAGE:-0}" = 0 ]; then
    as_pg "$PRIVATE_PGBIN/pg_ctl" -D "$PRIVATE_PGDATA" -m immediate -w restart >/dev/null
else
    # Down longer, as a restart on a loaded machine or a slow recovery is.
    as_pg "$PRIVATE_PGBIN/pg_ctl" -D "$PRIVATE_PGDATA" -m immediate -w stop >/dev/null
    sleep "$OUTAGE"
    as_pg "$PRIVATE_PGBIN/pg_ctl" -D "$PRIVATE_PGDATA" -l "$PRIVATE_PGDATA/../server.log" \
        -o "$PRIVATE_PGOPTIONS" -w start >/dev/null
fi
up=$(date +%s.%N)
sleep 25
read -r first all <<<"$(psql -At -F ' ' "$url" -c \
    "SELECT extract(epoch FROM min(finished_at)) - $began,
            extract(epoch FROM max(finished_at) FILTER (WHERE scheduled_at <= to_timestamp($up))) - $began
     FROM skiplock.jobs WHERE finished_at > to_timestamp($up)")"
left=$(psql -At "$url" -c "SELECT count(*) FROM skiplock.jobs WHERE state <> 'succeeded'")
printf 'server back %.2f s after the restart began; first job succeeded %.2f s after it; the jobs due by then done %.2f s after it; %s not succeeded at the end\n' \
    "$(echo "$up - $began" | bc)" "$first" "$all" "$left"
