#!/usr/bin/env bash
# How a finished job leaves jobs_live (issue 49, item 2): the completion as it is, an UPDATE
# through skiplock.jobs that Postgres turns into a move between partitions, against the
# move written out as a DELETE from jobs_live and an INSERT into jobs_done in one statement
# (what awa does, so that a writer waiting for the row finds it gone instead of failing
# with 40001). N running jobs, completed 100 per statement in one transaction, in three
# alternating rounds:
#   - update:           UPDATE skiplock.jobs SET state = 'succeeded', … (today's statement);
#   - delete+insert:    the explicit move, with skiplock.moving_from set so that the
#                       statement trigger of jobs_live (a transition table of every row
#                       deleted, for tombstones) returns at once;
#   - without trigger:  the same move on a database whose jobs_live has no DELETE trigger
#                       at all: the floor a row trigger passing over the moves would reach.
# Prints microseconds and WAL bytes per job for each.
#
#   SKIPLOCK_BIN=target/debug/skiplock benches/move-out-of-live.sh [N]
#
# Needs psql and a `skiplock` binary (SKIPLOCK_BIN, default target/release/skiplock). The
# server: DATABASE_URL (two databases of its own beside the one named there), default
# postgres://postgres@127.0.0.1:5432/postgres.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

n="${1:-50000}"
bin="${SKIPLOCK_BIN:-target/release/skiplock}"
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
psql_on() { psql "${server%/*}/$1" -X -q -v ON_ERROR_STOP=1 "${@:2}"; }

columns="id, queue, kind, args, state, priority, scheduled_at, attempt, max_attempts,
         claim_token, claimed_by, claimed_at, heartbeat_at, ordering_key, unique_key,
         last_error, errors, created_at, finished_at, unique_policy, progress, output,
         concurrency_key, held_for, awaited, traceparent, tracestate"
moved="g.id, g.queue, g.kind, g.args, 'succeeded', g.priority, g.scheduled_at, g.attempt,
       g.max_attempts, NULL, g.claimed_by, g.claimed_at, NULL, g.ordering_key, g.unique_key,
       g.last_error, g.errors, g.created_at, now(), g.unique_policy, g.progress, g.output,
       g.concurrency_key, NULL, g.awaited, g.traceparent, g.tracestate"

setup() { # database
    psql "$server" -X -q -c "DROP DATABASE IF EXISTS $1" -c "CREATE DATABASE $1"
    "$bin" --database-url "${server%/*}/$1" migrate >/dev/null
    psql_on "$1" <<SQL
CREATE FUNCTION public.fill(n int) RETURNS void LANGUAGE sql AS \$\$
    INSERT INTO skiplock.jobs (kind, args, state, claim_token, claimed_by, claimed_at,
                               heartbeat_at, attempt)
    SELECT 'noop', '{"n": 1, "note": "the args of a typical job"}', 'running',
           gen_random_uuid(), 'w', now(), now(), 1
    FROM generate_series(1, n);
\$\$;
CREATE FUNCTION public.by_update(ids bigint[], tokens uuid[]) RETURNS bigint
LANGUAGE sql AS \$\$
    WITH done AS (
        UPDATE skiplock.jobs j
        SET state = 'succeeded', finished_at = now(), claim_token = NULL, heartbeat_at = NULL
        FROM unnest(ids, tokens) AS c(id, token)
        WHERE j.id = c.id AND j.claim_token = c.token
          AND j.state IN ('waiting', 'queued', 'running')
        RETURNING j.id)
    SELECT count(*) FROM done;
\$\$;
CREATE FUNCTION public.by_delete(ids bigint[], tokens uuid[]) RETURNS bigint
LANGUAGE sql SET skiplock.moving_from = 'jobs_live' AS \$\$
    WITH gone AS (
        DELETE FROM skiplock.jobs_live j USING unnest(ids, tokens) AS c(id, token)
        WHERE j.id = c.id AND j.claim_token = c.token
        RETURNING j.*
    ), done AS (
        INSERT INTO skiplock.jobs_done ($columns)
        SELECT $moved FROM gone g
        RETURNING id)
    SELECT count(*) FROM done;
\$\$;
CREATE FUNCTION public.run(how text, n int) RETURNS text LANGUAGE plpgsql AS \$\$
DECLARE
    t0 timestamptz;
    w0 pg_lsn;
    ids bigint[];
    tokens uuid[];
    first bigint;
    moved bigint := 0;
BEGIN
    SELECT min(id) INTO first FROM skiplock.jobs_live WHERE state = 'running';
    t0 := clock_timestamp();
    w0 := pg_current_wal_insert_lsn();
    FOR b IN 0 .. (n / 100) - 1 LOOP
        SELECT array_agg(id ORDER BY id), array_agg(claim_token ORDER BY id)
        INTO ids, tokens
        FROM skiplock.jobs_live WHERE id >= first + b * 100 AND id < first + (b + 1) * 100;
        moved := moved + CASE how WHEN 'update' THEN public.by_update(ids, tokens)
                                  ELSE public.by_delete(ids, tokens) END;
    END LOOP;
    RETURN format('%s µs/job, %s WAL bytes/job (%s jobs)',
                  round(extract(epoch FROM clock_timestamp() - t0) * 1000000 / moved, 2),
                  round((pg_current_wal_insert_lsn() - w0) / moved), moved);
END
\$\$;
SQL
}

setup skiplock_bench_move
setup skiplock_bench_move_bare
psql_on skiplock_bench_move_bare -c "DROP TRIGGER jobs_after_delete ON skiplock.jobs_live"

for round in 1 2 3; do
    for variant in "update skiplock_bench_move" "delete+insert skiplock_bench_move" \
                   "without-trigger skiplock_bench_move_bare"; do
        read -r how db <<<"$variant"
        psql_on "$db" -c "SELECT public.fill($n)" -c "VACUUM ANALYZE skiplock.jobs_live" >/dev/null
        printf 'round %s  %-16s %s\n' "$round" "$how" \
            "$(psql_on "$db" -At -c "SELECT public.run('$how', $n)")"
        psql_on "$db" -c "TRUNCATE skiplock.jobs" >/dev/null
    done
done
psql "$server" -X -q -c "DROP DATABASE skiplock_bench_move" -c "DROP DATABASE skiplock_bench_move_bare"
