#!/usr/bin/env bash
# Lookups by id beside the days of finished jobs kept (issue 49, item 1): the same three
# operations with one day of finished jobs made and with 31 (101 tables under skiplock.jobs,
# 2,000 finished jobs a day), each a statement of its own in one psql session:
#   - cancel: skiplock.cancel_job of a queued job, 250 times;
#   - enqueue with a parent: skiplock.enqueue(depends_on => a queued parent), 250 times;
#   - enqueue with a finished parent: the same with a parent that succeeded today;
#   - complete a parent of 40: skiplock.complete of a claimed parent with 40 waiting
#     children (all queued after), 50 times;
#   - show: the lookup skiplock::job and `skiplock show` make (SELECT * FROM
#     skiplock.internal_job_by_id(…); before 2026-12-01, SELECT * FROM skiplock.jobs WHERE
#     id = …: SHOW_BY_ID='SELECT * FROM skiplock.jobs WHERE id = $1') of a job that
#     finished today, 250 times, prepared as sqlx prepares it (after five plans for the
#     values given, one generic plan for the session);
#   - retry: skiplock.retry_job of a job that went dead today, 250 times;
#   - state: the lookup skiplock::job_state makes (skiplock.internal_job_state(…); before
#     2026-12-01, STATE_BY_ID='SELECT state FROM skiplock.jobs WHERE id = $1'), of the same
#     jobs, 250 times, prepared;
#   - sweep of 400 children: a pass of the sweep of waiting jobs (one batch)
#     (skiplock.internal_settle_waiting) over 400 children each waiting on a parent that
#     succeeded today and one still queued, 20 times.
# Prints the mean milliseconds per operation for each. A lookup whose cost follows the
# days kept shows as a gap between the two lines.
#
#   SKIPLOCK_BIN=target/debug/skiplock benches/days-kept.sh
#
# Needs psql and a `skiplock` binary (SKIPLOCK_BIN, default target/release/skiplock). The
# server: DATABASE_URL (its own databases beside the one named there), default
# postgres://postgres@127.0.0.1:5432/postgres. HOOK=file.sql runs a file on each database
# after the migration (an experiment's ALTER FUNCTION, say).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bin="${SKIPLOCK_BIN:-target/release/skiplock}"
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

ms_per() { # start end count
    echo "($2 - $1) * 1000 / $3" | bc -l
}

for days in 1 31; do
    db="skiplock_bench_days_$days"
    url="${server%/*}/$db"
    psql "$server" -qc "SET client_min_messages = warning" -c "DROP DATABASE IF EXISTS $db" \
        -c "CREATE DATABASE $db" >/dev/null
    DATABASE_URL="$url" "$bin" migrate >/dev/null
    P=(psql "$url" -qAt)
    if [ -n "${HOOK:-}" ]; then "${P[@]}" -f "$HOOK" >/dev/null; fi
    "${P[@]}" -c "SELECT skiplock.internal_prepare_done_partitions((now() AT TIME ZONE 'UTC')::date - ($days - 1), $days)" >/dev/null
    "${P[@]}" -c "INSERT INTO skiplock.jobs (kind, state, attempt, claimed_at, finished_at)
                  SELECT 'noop', 'succeeded', 1, f - interval '1 second', f
                  FROM (SELECT now() - (g % $days) * interval '1 day' - interval '1 minute' AS f
                        FROM generate_series(1, 2000 * $days) g) t" >/dev/null
    "${P[@]}" -c "ANALYZE" >/dev/null
    tables=$("${P[@]}" -c "SELECT count(*) FROM pg_partition_tree('skiplock.jobs') WHERE isleaf")

    for id in $("${P[@]}" -c "SELECT skiplock.enqueue('noop') FROM generate_series(1, 250)"); do
        echo "SELECT skiplock.cancel_job($id);"
    done >"$work/cancel.sql"
    s=$(date +%s.%N); "${P[@]}" -f "$work/cancel.sql" >/dev/null; e=$(date +%s.%N)
    cancel=$(ms_per "$s" "$e" 250)

    parent=$("${P[@]}" -c "SELECT skiplock.enqueue('noop', queue => 'held')")
    for _ in $(seq 250); do
        echo "SELECT skiplock.enqueue('noop', queue => 'kids', depends_on => ARRAY[$parent::bigint]);"
    done >"$work/enqueue.sql"
    s=$(date +%s.%N); "${P[@]}" -f "$work/enqueue.sql" >/dev/null; e=$(date +%s.%N)
    enqueue=$(ms_per "$s" "$e" 250)

    done_parent=$("${P[@]}" -c "SELECT id FROM skiplock.jobs
                                WHERE state = 'succeeded' AND finished_at > now() - interval '1 day'
                                ORDER BY id DESC LIMIT 1")
    for _ in $(seq 250); do
        echo "SELECT skiplock.enqueue('noop', queue => 'kids2', depends_on => ARRAY[$done_parent::bigint]);"
    done >"$work/enqueue-done.sql"
    s=$(date +%s.%N); "${P[@]}" -f "$work/enqueue-done.sql" >/dev/null; e=$(date +%s.%N)
    enqueue_done=$(ms_per "$s" "$e" 250)

    "${P[@]}" -c "DO \$\$ DECLARE p bigint; BEGIN FOR i IN 1..50 LOOP
                      p := skiplock.enqueue('noop', queue => 'parents');
                      PERFORM skiplock.enqueue('noop', queue => 'children', depends_on => ARRAY[p])
                      FROM generate_series(1, 40);
                  END LOOP; END \$\$" >/dev/null
    "${P[@]}" -F' ' -c "SELECT id, claim_token FROM skiplock.claim('parents', 50, 'bench')" |
        while read -r id token; do echo "SELECT skiplock.complete($id, '$token');"; done >"$work/complete.sql"
    s=$(date +%s.%N); "${P[@]}" -f "$work/complete.sql" >/dev/null; e=$(date +%s.%N)
    complete=$(ms_per "$s" "$e" 50)
    queued=$("${P[@]}" -c "SELECT count(*) FROM skiplock.jobs_live WHERE queue = 'children' AND state = 'queued'")
    [ "$queued" = 2000 ] || { echo "error: $queued of 2000 children queued" >&2; exit 1; }

    # Jobs that end today.
    ids=$("${P[@]}" -c "SELECT skiplock.enqueue('noop', queue => 'ends') FROM generate_series(1, 250)")
    "${P[@]}" -c "UPDATE skiplock.jobs SET state = 'dead', finished_at = now()
                  WHERE queue = 'ends' AND state = 'queued'" >/dev/null
    { echo "PREPARE show(bigint) AS ${SHOW_BY_ID:-SELECT * FROM skiplock.internal_job_by_id(\$1)};"
      for id in $ids; do echo "EXECUTE show($id);"; done; } >"$work/show.sql"
    s=$(date +%s.%N); "${P[@]}" -f "$work/show.sql" >/dev/null; e=$(date +%s.%N)
    show=$(ms_per "$s" "$e" 250)
    for id in $ids; do echo "SELECT skiplock.retry_job($id);"; done >"$work/retry.sql"
    s=$(date +%s.%N); "${P[@]}" -f "$work/retry.sql" >/dev/null; e=$(date +%s.%N)
    retry=$(ms_per "$s" "$e" 250)
    retried=$("${P[@]}" -c "SELECT count(*) FROM skiplock.jobs_live WHERE queue = 'ends' AND state = 'queued'")
    [ "$retried" = 250 ] || { echo "error: $retried of 250 retried" >&2; exit 1; }
    { echo "PREPARE state(bigint) AS ${STATE_BY_ID:-SELECT skiplock.internal_job_state(\$1)};"
      for id in $ids; do echo "EXECUTE state($id);"; done; } >"$work/state.sql"
    s=$(date +%s.%N); "${P[@]}" -f "$work/state.sql" >/dev/null; e=$(date +%s.%N)
    state=$(ms_per "$s" "$e" 250)

    # 400 children waiting on a parent that succeeded today and on one that stays queued:
    # a pass of the sweep reads each one's parents.
    held=$("${P[@]}" -c "SELECT skiplock.enqueue('noop', queue => 'held2')")
    "${P[@]}" -c "SELECT skiplock.enqueue('noop', queue => 'kids3',
                                          depends_on => ARRAY[$done_parent::bigint, $held::bigint])
                  FROM generate_series(1, 400)" >/dev/null
    "${P[@]}" -c "DELETE FROM skiplock.jobs WHERE queue IN ('kids', 'kids2') AND state = 'waiting'" >/dev/null
    waiting=$("${P[@]}" -c "SELECT count(*) FROM skiplock.jobs_live WHERE state = 'waiting'")
    [ "$waiting" = 400 ] || { echo "error: $waiting jobs waiting, not 400" >&2; exit 1; }
    for _ in $(seq 20); do echo "SELECT skiplock.internal_settle_waiting();"; done >"$work/sweep.sql"
    s=$(date +%s.%N); "${P[@]}" -f "$work/sweep.sql" >/dev/null; e=$(date +%s.%N)
    sweep=$(ms_per "$s" "$e" 20)

    printf "days=%-2s tables=%-3s cancel=%.2f ms  enqueue with a parent=%.2f ms  with a finished parent=%.2f ms  complete a parent of 40=%.2f ms  show=%.2f ms  retry=%.2f ms  state=%.2f ms  sweep of 400 children=%.2f ms\n" \
        "$days" "$tables" "$cancel" "$enqueue" "$enqueue_done" "$complete" "$show" "$retry" "$state" "$sweep"
    psql "$server" -qc "DROP DATABASE $db" >/dev/null
done
