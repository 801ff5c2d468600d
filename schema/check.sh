#!/usr/bin/env bash
# Checks that schema/skiplock.sql is the schema the migrations produce.
#
# Creates a throwaway database, migrates it through the real code path
# (`cargo run --features cli --bin skiplock -- migrate`, or the binary SKIPLOCK_BIN names:
# .ci/run passes the one its test build made), dumps the `skiplock` schema with pg_dump,
# normalises the dump and compares it with schema/skiplock.sql. Exits 1 with a diff on
# drift; `--update` rewrites schema/skiplock.sql instead. The throwaway database is
# dropped on exit.
#
# The server: DATABASE_URL (any database on it; the script creates its own beside it),
# default postgres://postgres@127.0.0.1:5432/postgres. Needs psql and a pg_dump of the
# server's major version or newer (PG_DUMP overrides which pg_dump runs).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

SCHEMA_FILE=schema/skiplock.sql
HINT="schema/skiplock.sql is out of date: run schema/check.sh --update"

update=0
case "${1:-}" in
    "") ;;
    --update) update=1 ;;
    *)
        echo "usage: schema/check.sh [--update]" >&2
        exit 2
        ;;
esac

die() {
    echo "schema/check.sh: $*" >&2
    exit 1
}

# The newest pg_dump: PG_DUMP, else the one on PATH, else the highest
# /usr/lib/postgresql/*/bin/pg_dump (Debian installs the client there).
find_pg_dump() {
    if [ -n "${PG_DUMP:-}" ]; then
        echo "$PG_DUMP"
    elif command -v pg_dump >/dev/null 2>&1; then
        command -v pg_dump
    else
        ls /usr/lib/postgresql/*/bin/pg_dump 2>/dev/null | sort -V | tail -1
    fi
}

command -v psql >/dev/null 2>&1 ||
    die "psql not found: install the PostgreSQL client (apt-get install postgresql-client)"
pg_dump="$(find_pg_dump)"
[ -n "$pg_dump" ] && [ -x "$pg_dump" ] ||
    die "pg_dump not found: install the PostgreSQL client (apt-get install postgresql-client), or set PG_DUMP"

admin_url="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
psql_admin() {
    psql "$admin_url" -X -q -v ON_ERROR_STOP=1 -At "$@"
}

server_major="$(psql_admin -c 'SHOW server_version_num')" ||
    die "cannot reach PostgreSQL at DATABASE_URL (or 127.0.0.1:5432)"
server_major=$((server_major / 10000))
dump_major="$("$pg_dump" --version | sed -E 's/^[^0-9]*([0-9]+).*/\1/')"
if [ "$dump_major" -lt "$server_major" ]; then
    die "$pg_dump is version $dump_major, older than the server ($server_major): install postgresql-client-$server_major or set PG_DUMP"
fi

# The throwaway database sits beside DATABASE_URL's: same server, user and options.
db="skiplock_schema_check_$$_${RANDOM}"
base="${admin_url%%\?*}"
query=""
[ "$base" = "$admin_url" ] || query="?${admin_url#*\?}"
rest="${base#*://}"
scheme="${base%%://*}"
case "$rest" in
    */*) authority="${rest%%/*}" ;;
    *) authority="$rest" ;;
esac
db_url="${scheme}://${authority}/${db}${query}"

cleanup() {
    psql_admin -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT
psql_admin -c "CREATE DATABASE \"$db\"" >/dev/null

if [ -n "${SKIPLOCK_BIN:-}" ]; then
    DATABASE_URL="$db_url" "$SKIPLOCK_BIN" migrate >/dev/null
else
    DATABASE_URL="$db_url" cargo run --quiet --features cli --bin skiplock -- migrate >/dev/null
fi

# Normalise: leave out the day partitions of jobs_done (named by the date the migration
# ran; made by skiplock.internal_prepare_done_partitions, which the file shows), drop what
# varies between runs and pg_dump versions (the version header, the session settings, the
# \restrict key of pg_dump 15.14 and later) and collapse runs of blank lines.
dump="$(mktemp)"
trap 'rm -f "$dump"; cleanup' EXIT
"$pg_dump" --schema-only --no-owner --no-privileges -n skiplock \
    --exclude-table='skiplock.jobs_done_succeeded_*' \
    --exclude-table='skiplock.jobs_done_dead_*' \
    --exclude-table='skiplock.jobs_done_cancelled_*' "$db_url" |
    grep -Ev '^(-- Dumped (from|by) |SET |SELECT pg_catalog\.set_config\(|\\(un)?restrict )' |
    cat -s | sed '${/^$/d}' >"$dump"

if [ "$update" = 1 ]; then
    cp "$dump" "$SCHEMA_FILE"
    echo "wrote $SCHEMA_FILE (pg_dump $dump_major)"
    exit 0
fi
if ! diff -u "$SCHEMA_FILE" "$dump"; then
    echo "$HINT" >&2
    exit 1
fi
echo "$SCHEMA_FILE matches the migrations (pg_dump $dump_major)"
