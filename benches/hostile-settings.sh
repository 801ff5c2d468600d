#!/usr/bin/env bash
# Database settings a DBA or a platform chooses, measured with the release binary (issue 29's
# targets):
#
#  1. serializable: the database's default_transaction_isolation set to serializable
#     (ALTER DATABASE … SET), two `skiplock work --kinds noop --exit-when-idle` processes
#     drain JOBS no-op jobs; the same drain with the default (read committed) alternates with it, ROUNDS
#     times. Rates are counted in the database (succeeded jobs over first claim to last
#     finish); WARN/ERROR lines of the workers are counted too. Target: within 1.2x of read
#     committed, no failed heartbeats.
#  2. PgBouncer without the flag: PgBouncer (the distribution's, transaction pooling) in
#     front, one `skiplock work --kinds noop --exit-when-idle` started WITHOUT --pgbouncer;
#     seconds from its start to the first job finished and to its exit, and what it logged about
#     PgBouncer. Target: working, or stopped with the remedy, within 10 s.
#
# Usage: benches/hostile-settings.sh [JOBS] [ROUNDS]     (default 20000 3)
#   DATABASE_URL: the server (a database `skiplock_bench_hostile` is recreated on it).
#   SKIPLOCK_BIN: the binary (default target/release/skiplock, built if missing).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

jobs="${1:-20000}"
rounds="${2:-3}"
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
db_name=skiplock_bench_hostile
db="${server%/*}/$db_name"
bin=${SKIPLOCK_BIN:-target/release/skiplock}
if [ ! -x "$bin" ]; then
    cargo build --release --features cli --bin skiplock
fi
logs="$(mktemp -d)"
trap 'rm -rf "$logs"; [ -n "${bouncer_pid:-}" ] && kill "$bouncer_pid" 2>/dev/null || true' EXIT

psql_server() { psql "$server" -X -q -v ON_ERROR_STOP=1 -At "$@"; }
psql_db() { psql "$db" -X -q -v ON_ERROR_STOP=1 -At "$@"; }

# A fresh database with JOBS queued no-op jobs, its default isolation set to $1.
prepare() {
    psql_server -c "DROP DATABASE IF EXISTS $db_name WITH (FORCE)"
    psql_server -c "CREATE DATABASE $db_name"
    psql_server -c "ALTER DATABASE $db_name SET default_transaction_isolation = '$1'"
    DATABASE_URL="$db" "$bin" migrate >/dev/null
    psql_db -c "INSERT INTO skiplock.jobs (kind, args) SELECT 'noop', '{}' FROM generate_series(1, $jobs)"
    psql_db -c "VACUUM ANALYZE skiplock.jobs"
}

# Rate counted in the database, and jobs not succeeded.
outcome() {
    psql_db -c "SELECT round(count(*) FILTER (WHERE state = 'succeeded')
                         / extract(epoch FROM max(finished_at) - min(claimed_at)))::bigint
                       || ' jobs/s, ' || count(*) FILTER (WHERE state <> 'succeeded')
                       || ' not succeeded'
                FROM skiplock.jobs"
}

echo "## Serializable database default: $jobs no-op jobs, two worker processes, $rounds rounds"
echo
echo "| round | isolation | drained | WARN lines | ERROR lines | failed heartbeats |"
echo "|---|---|---|---|---|---|"
for ((round = 1; round <= rounds; round++)); do
    for iso in "read committed" serializable; do
        prepare "$iso"
        DATABASE_URL="$db" "$bin" work --kinds noop --exit-when-idle >"$logs/a.log" 2>&1 &
        a=$!
        DATABASE_URL="$db" "$bin" work --kinds noop --exit-when-idle >"$logs/b.log" 2>&1 &
        b=$!
        wait "$a" "$b"
        warn=$(cat "$logs/a.log" "$logs/b.log" | grep -c WARN || true)
        error=$(cat "$logs/a.log" "$logs/b.log" | grep -c ERROR || true)
        beats=$(cat "$logs/a.log" "$logs/b.log" | grep -E 'WARN|ERROR' | grep -ci heartbeat || true)
        echo "| $round | $iso | $(outcome) | $warn | $error | $beats |"
    done
done
echo

if [ ! -x /usr/sbin/pgbouncer ]; then
    echo "PgBouncer is not installed (apt-get install pgbouncer): part 2 skipped" >&2
    exit 1
fi
echo "## PgBouncer (transaction pooling) in front, \`skiplock work\` without --pgbouncer"
echo
prepare "read committed"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
host=$(python3 -c "import urllib.parse,sys; u=urllib.parse.urlparse(sys.argv[1]); print(u.hostname or '127.0.0.1', u.port or 5432, u.username or 'postgres')" "$server")
read -r pg_host pg_port pg_user <<<"$host"
cat >"$logs/pgbouncer.ini" <<EOF
[databases]
* = host=$pg_host port=$pg_port user=$pg_user
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = any
pool_mode = transaction
default_pool_size = 20
max_client_conn = 1000
EOF
chmod -R a+rX "$logs"
as_user=()
[ "$(id -u)" = 0 ] && as_user=(-u postgres)
/usr/sbin/pgbouncer "${as_user[@]}" "$logs/pgbouncer.ini" >"$logs/pgbouncer.log" 2>&1 &
bouncer_pid=$!
for _ in $(seq 100); do
    grep -q "listening on 127.0.0.1:$port" "$logs/pgbouncer.log" 2>/dev/null && break
    sleep 0.1
done
bounced="postgresql://$pg_user@127.0.0.1:$port/$db_name"
started=$(date +%s.%N)
DATABASE_URL="$bounced" "$bin" work --kinds noop --exit-when-idle >"$logs/bounced.log" 2>&1 &
worker=$!
first=""
while kill -0 "$worker" 2>/dev/null; do
    if [ -z "$first" ] && [ "$(psql_db -c "SELECT count(*) > 0 FROM skiplock.jobs WHERE state = 'succeeded'")" = t ]; then
        first=$(date +%s.%N)
    fi
    sleep 0.05
done
wait "$worker" && rc=0 || rc=$?
ended=$(date +%s.%N)
[ -n "$first" ] || first=$ended
printf -- '- first job finished %.2f s after the start; the worker exited %.2f s after the start with code %s\n' \
    "$(echo "$first - $started" | bc)" "$(echo "$ended - $started" | bc)" "$rc"
echo "- drained: $(outcome)"
echo "- what it said about PgBouncer:"
echo
grep -i -m 3 pgbouncer "$logs/bounced.log" | sed 's/^/    /' || echo "    (nothing)"
psql_server -c "DROP DATABASE IF EXISTS $db_name WITH (FORCE)"
