# Sourced by the bench scripts that time an idle `skiplock work` from commits
# (benches/pickup-binary.sh, benches/lane-feed.sh).

# require_commit_timestamps SERVER_URL: exits 2 unless the server tracks commit timestamps.
require_commit_timestamps() {
    if [ "$(psql "$1" -Atc "SHOW track_commit_timestamp")" != on ]; then
        echo "track_commit_timestamp is off: run under benches/with-private-server.sh -c track_commit_timestamp=on" >&2
        exit 2
    fi
}

# fresh_database SERVER_URL NAME BIN: drops and creates database NAME on the server and
# migrates it with the skiplock binary BIN.
fresh_database() {
    PGOPTIONS="-c client_min_messages=warning" psql "$1" -q \
        -c "DROP DATABASE IF EXISTS $2 WITH (FORCE)" -c "CREATE DATABASE $2" >/dev/null
    "$3" --database-url "${1%/*}/$2" migrate >/dev/null
}
#
# wait_for_listener URL: returns once a session of URL's database has run LISTEN (an idle
# worker's listener shows its LISTEN as its last query), or after 10 s; then a second more,
# for the worker's first walk to end.
wait_for_listener() {
    local url="$1"
    for _ in $(seq 100); do
        [ "$(psql "$url" -Atc "SELECT count(*) FROM pg_stat_activity
                               WHERE datname = current_database() AND query ILIKE 'LISTEN%'")" -gt 0 ] && break
        sleep 0.1
    done
    sleep 1
}
