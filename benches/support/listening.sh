# Sourced by the bench scripts that time an idle `skiplock work`.
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
