#!/usr/bin/env bash
# Global limits across processes (issue 40's targets), with `skiplock work` processes on a
# database of their own:
#
#   binding: max_running 10 on a queue of JOBS `sleep` jobs of 100 ms, drained by 4
#            processes of concurrency 32: the throughput against 10 jobs / 100 ms, the most
#            jobs running at once (from each job's claimed_at and finished_at), and the
#            pickup after a slot frees (the n-th start after the first 10 against the
#            (n-10)-th finish, by the database clock);
#   rate:    rate_limit 200 per second on a queue of RATE_JOBS `noop` jobs, drained by 4
#            processes: the most starts in any 1 s window (from claimed_at) and the starts in
#            each whole second from the first;
#   keys:    key_max_running KEY_MAX (2) on a queue of JOBS `sleep` jobs of JOB_MS (100) ms
#            spread over KEYS (20) concurrency keys, drained by PROCS (4) processes of
#            concurrency 32 (128 slots for the 40 the keys allow): the throughput against
#            KEYS x KEY_MAX jobs / JOB_MS, the most jobs of one key running at once, and the
#            pickup after a key's slot frees (a start against the finish KEY_MAX before it
#            of the same key); with track_commit_timestamp on, that pickup in two (the
#            freeing completion's transaction, and from its commit on). Issue 48's
#            scenario: KEY_MAX=1 KEYS=40 JOB_MS=50 PROCS=2;
#   key-rate: key_rate_limit 20 per second on a queue of RATE_JOBS `noop` jobs spread over
#            10 concurrency keys, drained by 4 processes: the most starts of one key in any
#            1 s window and the starts of each key in each whole second from its first.
#
# Usage: benches/limits.sh [JOBS] [RATE_JOBS]   (defaults 3000 and 4000)
#        PARTS="keys key-rate" benches/limits.sh   (default: every part)
# Needs a release build: cargo build --release --features cli --bin skiplock (or SKIPLOCK_BIN=...).
set -euo pipefail

JOBS=${1:-3000}
RATE_JOBS=${2:-4000}
PARTS=${PARTS:-binding rate keys key-rate}
part() { [[ " $PARTS " == *" $1 "* ]]; }
BIN=${SKIPLOCK_BIN:-target/release/skiplock}
SERVER=${SKIPLOCK_BENCH_SERVER:-postgres://postgres@127.0.0.1:5432}
DB=skiplock_bench_limits
URL="$SERVER/$DB"

[ -x "$BIN" ] || { echo "no $BIN: cargo build --release --features cli --bin skiplock" >&2; exit 1; }
psql "$SERVER/postgres" -qX -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB"
DATABASE_URL=$URL "$BIN" migrate >/dev/null
sql() { psql "$URL" -qXAt -v ON_ERROR_STOP=1 -c "$1"; }

drain() { # QUEUE [PROCESSES]: processes (4) of concurrency 32 until the queue is empty
    local pids=()
    for i in $(seq 1 "${2:-4}"); do
        DATABASE_URL=$URL RUST_LOG=warn "$BIN" work --queue "$1" --concurrency 32 \
            --exit-when-idle >/dev/null 2>"/tmp/skiplock-limits-$1-$i.log" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
}

if part binding; then
echo "## binding: max_running 10, $JOBS sleep jobs of 100 ms, 4 processes x 32"
sql "SELECT skiplock.set_queue_limits('bound', 10)"
sql "INSERT INTO skiplock.jobs (kind, args, queue)
     SELECT 'sleep', '{\"ms\": 100}', 'bound' FROM generate_series(1, $JOBS)"
sql "VACUUM ANALYZE skiplock.jobs_live"
start=$(date +%s.%N)
drain bound
end=$(date +%s.%N)
echo "wall seconds: $(echo "$end - $start" | bc)"
sql "SELECT 'jobs/s (db clock, first claim to last finish): '
            || round(count(*) / extract(epoch FROM max(finished_at) - min(claimed_at)), 1)
            || ' = ' || round(100 * count(*) / extract(epoch FROM max(finished_at) - min(claimed_at)) / 100, 1)
            || ' % of 10 jobs / 100 ms; succeeded ' || count(*) FILTER (WHERE state = 'succeeded')
     FROM skiplock.jobs WHERE queue = 'bound'"
sql "WITH ev AS (SELECT claimed_at AS t, 1 AS d FROM skiplock.jobs WHERE queue = 'bound'
                UNION ALL SELECT finished_at, -1 FROM skiplock.jobs WHERE queue = 'bound')
     SELECT 'most running at once (claimed_at to finished_at): ' || max(s)
     FROM (SELECT sum(d) OVER (ORDER BY t, d ROWS UNBOUNDED PRECEDING) AS s FROM ev) x"
sql "WITH s AS (SELECT claimed_at AS t, row_number() OVER (ORDER BY claimed_at) AS n
               FROM skiplock.jobs WHERE queue = 'bound'),
          f AS (SELECT finished_at AS t, row_number() OVER (ORDER BY finished_at) AS n
               FROM skiplock.jobs WHERE queue = 'bound'),
          gap AS (SELECT extract(epoch FROM s.t - f.t) * 1000 AS ms
                  FROM s JOIN f ON s.n = f.n + 10)
     SELECT 'pickup after a slot frees, ms: p50 ' || round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 2)
            || ', p90 ' || round(percentile_cont(0.9) WITHIN GROUP (ORDER BY ms)::numeric, 2)
            || ', p99 ' || round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 2)
     FROM gap"
fi

if part rate; then
echo
echo "## rate: 200 per second, $RATE_JOBS noop jobs, 4 processes x 32"
sql "SELECT skiplock.set_queue_limits('rated', NULL, 200, '1 second')"
sql "INSERT INTO skiplock.jobs (kind, queue) SELECT 'noop', 'rated' FROM generate_series(1, $RATE_JOBS)"
sql "VACUUM ANALYZE skiplock.jobs_live"
drain rated
sql "SELECT 'most starts in any 1 s window: ' || max(c) FROM (
         SELECT (SELECT count(*) FROM skiplock.jobs b WHERE b.queue = 'rated'
                   AND b.claimed_at >= a.claimed_at
                   AND b.claimed_at < a.claimed_at + interval '1 second') AS c
         FROM skiplock.jobs a WHERE a.queue = 'rated') x"
sql "WITH first AS (SELECT min(claimed_at) AS t0, max(claimed_at) AS t1
                   FROM skiplock.jobs WHERE queue = 'rated'),
          bins AS (SELECT floor(extract(epoch FROM j.claimed_at - f.t0))::int AS second, count(*) AS n
                   FROM skiplock.jobs j, first f WHERE j.queue = 'rated'
                     AND j.claimed_at < f.t0 + floor(extract(epoch FROM f.t1 - f.t0)) * interval '1 second'
                   GROUP BY 1)
     SELECT 'starts in each whole second from the first: min ' || min(n) || ', median '
            || percentile_cont(0.5) WITHIN GROUP (ORDER BY n) || ', max ' || max(n)
            || ' over ' || count(*) || ' seconds'
     FROM bins"
fi

if part keys; then
echo
KEY_MAX=${KEY_MAX:-2} KEYS=${KEYS:-20} JOB_MS=${JOB_MS:-100} PROCS=${PROCS:-4}
echo "## keys: key_max_running $KEY_MAX, $JOBS sleep jobs of $JOB_MS ms over $KEYS keys, $PROCS processes x 32"
sql "SELECT skiplock.set_queue_limits('keyed', NULL, key_max_running => $KEY_MAX)"
sql "INSERT INTO skiplock.jobs (kind, args, queue, concurrency_key)
     SELECT 'sleep', '{\"ms\": $JOB_MS}', 'keyed', 'key-' || (g % $KEYS) FROM generate_series(1, $JOBS) g"
sql "VACUUM ANALYZE skiplock.jobs_live"
drain keyed "$PROCS"
sql "SELECT 'jobs/s (db clock, first claim to last finish): '
            || round(count(*) / extract(epoch FROM max(finished_at) - min(claimed_at)), 1)
            || ' = ' || round(100 * count(*) / extract(epoch FROM max(finished_at) - min(claimed_at))
                              / ($KEYS * $KEY_MAX * 1000.0 / $JOB_MS), 1)
            || ' % of $((KEYS * KEY_MAX)) jobs / $JOB_MS ms; succeeded ' || count(*) FILTER (WHERE state = 'succeeded')
     FROM skiplock.jobs WHERE queue = 'keyed'"
sql "WITH ev AS (SELECT concurrency_key AS k, claimed_at AS t, 1 AS d FROM skiplock.jobs WHERE queue = 'keyed'
                UNION ALL SELECT concurrency_key, finished_at, -1 FROM skiplock.jobs WHERE queue = 'keyed')
     SELECT 'most of one key running at once (claimed_at to finished_at): ' || max(s)
     FROM (SELECT sum(d) OVER (PARTITION BY k ORDER BY t, d ROWS UNBOUNDED PRECEDING) AS s FROM ev) x"
sql "WITH s AS (SELECT concurrency_key AS k, claimed_at AS t,
                      row_number() OVER (PARTITION BY concurrency_key ORDER BY claimed_at) AS n
               FROM skiplock.jobs WHERE queue = 'keyed'),
          f AS (SELECT concurrency_key AS k, finished_at AS t,
                      row_number() OVER (PARTITION BY concurrency_key ORDER BY finished_at) AS n
               FROM skiplock.jobs WHERE queue = 'keyed'),
          gap AS (SELECT extract(epoch FROM s.t - f.t) * 1000 AS ms
                  FROM s JOIN f ON s.k = f.k AND s.n = f.n + $KEY_MAX)
     SELECT 'pickup after a key''s slot frees, ms: p50 ' || round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 2)
            || ', p90 ' || round(percentile_cont(0.9) WITHIN GROUP (ORDER BY ms)::numeric, 2)
            || ', p99 ' || round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 2)
     FROM gap"
if [ "$(sql "SHOW track_commit_timestamp")" = on ]; then
# The pickup in two: the freeing completion's transaction (its start, finished_at, to its
# commit) and from that commit to the next start of the key (claimed_at).
sql "WITH s AS (SELECT concurrency_key AS k, claimed_at AS t,
                      row_number() OVER (PARTITION BY concurrency_key ORDER BY claimed_at) AS n
               FROM skiplock.jobs WHERE queue = 'keyed'),
          f AS (SELECT concurrency_key AS k, finished_at AS t, pg_xact_commit_timestamp(xmin) AS c,
                      row_number() OVER (PARTITION BY concurrency_key ORDER BY finished_at) AS n
               FROM skiplock.jobs WHERE queue = 'keyed'),
          gap AS (SELECT extract(epoch FROM f.c - f.t) * 1000 AS completion,
                         extract(epoch FROM s.t - f.c) * 1000 AS after_commit
                  FROM s JOIN f ON s.k = f.k AND s.n = f.n + $KEY_MAX)
     SELECT 'of which the completion (finished_at to its commit), ms: p50 '
            || round(percentile_cont(0.5) WITHIN GROUP (ORDER BY completion)::numeric, 2)
            || ', p90 ' || round(percentile_cont(0.9) WITHIN GROUP (ORDER BY completion)::numeric, 2)
            || '; its commit to the next start: p50 '
            || round(percentile_cont(0.5) WITHIN GROUP (ORDER BY after_commit)::numeric, 2)
            || ', p90 ' || round(percentile_cont(0.9) WITHIN GROUP (ORDER BY after_commit)::numeric, 2)
     FROM gap"
fi
fi

if part key-rate; then
echo
echo "## key-rate: 20 per second per key, $RATE_JOBS noop jobs over 10 keys, 4 processes x 32"
sql "SELECT skiplock.set_queue_limits('keyrated', NULL, key_rate_limit => 20, key_rate_period => '1 second')"
sql "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
     SELECT 'noop', 'keyrated', 'key-' || (g % 10) FROM generate_series(1, $RATE_JOBS) g"
sql "VACUUM ANALYZE skiplock.jobs_live"
drain keyrated
sql "SELECT 'most starts of one key in any 1 s window: ' || max(c) || '; succeeded '
            || (SELECT count(*) FROM skiplock.jobs WHERE queue = 'keyrated' AND state = 'succeeded')
     FROM (SELECT (SELECT count(*) FROM skiplock.jobs b WHERE b.queue = 'keyrated'
                     AND b.concurrency_key = a.concurrency_key
                     AND b.claimed_at >= a.claimed_at
                     AND b.claimed_at < a.claimed_at + interval '1 second') AS c
           FROM skiplock.jobs a WHERE a.queue = 'keyrated') x"
sql "WITH first AS (SELECT concurrency_key AS k, min(claimed_at) AS t0, max(claimed_at) AS t1
                   FROM skiplock.jobs WHERE queue = 'keyrated' GROUP BY 1),
          bins AS (SELECT j.concurrency_key, floor(extract(epoch FROM j.claimed_at - f.t0))::int AS second,
                          count(*) AS n
                   FROM skiplock.jobs j JOIN first f ON f.k = j.concurrency_key
                   WHERE j.queue = 'keyrated'
                     AND j.claimed_at < f.t0 + floor(extract(epoch FROM f.t1 - f.t0)) * interval '1 second'
                   GROUP BY 1, 2)
     SELECT 'starts of a key in each whole second from its first: min ' || min(n) || ', median '
            || percentile_cont(0.5) WITHIN GROUP (ORDER BY n) || ', max ' || max(n)
            || ' over ' || count(*) || ' key-seconds'
     FROM bins"
fi
[ -n "${KEEP_DB:-}" ] || psql "$SERVER/postgres" -qX -c "DROP DATABASE $DB"
