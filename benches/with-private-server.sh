#!/usr/bin/env bash
# Runs a command against a private, throwaway Postgres server started from the installed
# binaries with initdb's defaults (autovacuum on, fsync on, shared_buffers 128MB), as users
# run it; the shared server on 5432 is never touched or restarted. The command gets
# DATABASE_URL pointing at the private server, which is stopped and deleted afterwards, and
# PRIVATE_PGDATA, PRIVATE_PGBIN and PRIVATE_PGOPTIONS (its data directory, binaries and
# `pg_ctl -o` options), for a command that restarts it (benches/restart-recovery.sh).
#
#   benches/with-private-server.sh [-c name=value]... [--cpus LIST] -- COMMAND [ARG]...
#
#   -c name=value   a server setting on top of the defaults (repeatable), for example
#                   -c shared_preload_libraries=pg_stat_statements
#   --cpus LIST     run the server on these CPUs only (taskset), for example 0: with the
#                   clients on the others, as workers on other hosts would be
#
#   benches/with-private-server.sh -- cargo bench --bench drain -- --only held
set -euo pipefail

settings=()
pin=()
usage="usage: $0 [-c name=value]... [--cpus LIST] -- COMMAND [ARG]..."
while [ $# -gt 0 ]; do
    case "$1" in
        -c) settings+=(-c "$2"); shift 2 ;;
        --cpus) pin=(taskset -c "$2"); shift 2 ;;
        --) shift; break ;;
        *) echo "$usage" >&2; exit 2 ;;
    esac
done
if [ $# -eq 0 ]; then
    echo "$usage" >&2
    exit 2
fi

pgbin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
if [ -z "$pgbin" ] || [ ! -x "$pgbin/initdb" ]; then
    echo "no Postgres server binaries under /usr/lib/postgresql: install postgresql" >&2
    exit 1
fi
dir=$(mktemp -d /tmp/skiplock-private.XXXXXX)
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
[ "$(id -u)" = 0 ] && chown postgres: "$dir"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
stop_private() {
    as_pg "$pgbin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
    rm -rf "$dir"
}
trap stop_private EXIT
echo "starting a private server ($pgbin, initdb defaults${settings[*]:+, ${settings[*]}}) on port $port…" >&2
as_pg "$pgbin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 >/dev/null
options="-c port=$port -c listen_addresses=127.0.0.1 -c unix_socket_directories=$dir ${settings[*]}"
as_pg "${pin[@]}" "$pgbin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -o "$options" \
    start >/dev/null
DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres" PRIVATE_PGDATA="$dir/data" \
    PRIVATE_PGBIN="$pgbin" PRIVATE_PGOPTIONS="$options" "$@"
