#!/usr/bin/env bash
# A lane fed one job per transaction beside many jobs waiting elsewhere (issue 48's lane
# target: at 18 jobs/s, each transaction open 50 ms, beside 30,000 waiting jobs, every lane
# job claimed within 100 ms of its commit at p99, none left waiting).
#
#   benches/with-private-server.sh -c track_commit_timestamp=on -- benches/lane-feed.sh [SECONDS]
#
# - The feed: one psql session, SECONDS (default 60) long, RATE (default 18) transactions a
#   second, each inserting one `sleep` job of JOB_MS ms (default 20) into the lane, then
#   held open OPEN_MS ms (default 50) before its commit. A job runs longer than the pause
#   between two transactions, so each enqueue finds the job before it unfinished (it waits
#   behind it) and that job ends while the enqueue's transaction is still open: the race of
#   issue 48, item 0, at every job.
# - Elsewhere: WAITING (default 30,000) children of a parent no worker runs (kind `never`),
#   the jobs a sweep of waiting jobs walks.
# - The measure, as benches/pickup-binary.sh: from the enqueue's commit
#   (`pg_xact_commit_timestamp`; the feeding session runs with synchronous_commit off) to
#   the claim's update of the row (a BEFORE UPDATE trigger of the bench's own database
#   copies the claim's `heartbeat_at` when a row goes from queued to running). A job claimed
#   before its commit could be seen is impossible, so every figure is >= 0.
# - One idle `skiplock work --kinds sleep` at its defaults; 2 s after the feed ends, the lane
#   jobs not yet claimed are counted (the target: none).
#
#   DATABASE_URL: the server (a database `skiplock_bench_lane_feed` is recreated on it).
#   SKIPLOCK_BIN: the binary (default target/release/skiplock, built if missing); another
#                 build's binary measures that build (its own migration runs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=benches/support/timed-worker.sh
. benches/support/timed-worker.sh

seconds="${1:-60}"
rate="${RATE:-18}"
open_ms="${OPEN_MS:-50}"
job_ms="${JOB_MS:-20}"
waiting="${WAITING:-30000}"
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
db="${server%/*}/skiplock_bench_lane_feed"
bin=${SKIPLOCK_BIN:-target/release/skiplock}
[ -n "${SKIPLOCK_BIN:-}" ] || [ -x "$bin" ] || cargo build --release --features cli --bin skiplock >&2

require_commit_timestamps "$server"
fresh_database "$server" skiplock_bench_lane_feed "$bin"
psql "$db" -q -v ON_ERROR_STOP=1 >/dev/null <<SQL
SET client_min_messages = warning;
CREATE TABLE public.bench_lane_probe (job_id bigint PRIMARY KEY, xid bigint NOT NULL);
CREATE TABLE public.bench_lane_claim (job_id bigint PRIMARY KEY, updated timestamptz);
CREATE FUNCTION public.bench_lane_claimed() RETURNS trigger LANGUAGE plpgsql AS \$\$
BEGIN
    INSERT INTO public.bench_lane_claim VALUES (NEW.id, NEW.heartbeat_at);
    RETURN NEW;
END \$\$;
CREATE TRIGGER bench_lane_claimed BEFORE UPDATE ON skiplock.jobs FOR EACH ROW
    WHEN (OLD.state = 'queued' AND NEW.state = 'running' AND OLD.ordering_key = 'the-lane')
    EXECUTE FUNCTION public.bench_lane_claimed();
WITH parent AS (SELECT skiplock.enqueue('never', queue => 'elsewhere') AS id)
SELECT skiplock.enqueue('noop', queue => 'elsewhere', depends_on => ARRAY[parent.id])
FROM parent, generate_series(1, $waiting);
ANALYZE;
SQL

RUST_LOG=warn "$bin" --database-url "$db" work --kinds sleep >/dev/null 2>&1 &
worker=$!
trap 'kill "$worker" 2>/dev/null || true; wait "$worker" 2>/dev/null || true' EXIT
wait_for_listener "$db"

jobs=$((seconds * rate))
pause=$(awk -v r="$rate" -v o="$open_ms" 'BEGIN { p = 1 / r - o / 1000; if (p < 0) p = 0; printf "%.4f", p }')
{
    echo "SET synchronous_commit = off;"
    for ((i = 0; i < jobs; i++)); do
        echo "BEGIN;"
        echo "WITH j AS (INSERT INTO skiplock.jobs (kind, args, ordering_key)
                         VALUES ('sleep', '{\"ms\": $job_ms}', 'the-lane') RETURNING id)
              INSERT INTO public.bench_lane_probe SELECT id, txid_current() FROM j;"
        echo "SELECT pg_sleep($open_ms / 1000.0);"
        echo "COMMIT;"
        echo "SELECT pg_sleep($pause);"
    done
} | psql "$db" -q -v ON_ERROR_STOP=1 >/dev/null
sleep 2
unclaimed=$(psql "$db" -Atc "SELECT count(*) FROM skiplock.jobs
                              WHERE ordering_key = 'the-lane' AND state IN ('waiting', 'queued')")
kill -INT "$worker"
wait "$worker" || true
trap - EXIT

printf '| lane jobs | waiting elsewhere | commit → claim p50 ms | p90 | p99 | max | claimed > 100 ms | not claimed 2 s after the feed |\n'
printf '|---|---|---|---|---|---|---|---|\n'
psql "$db" -At -F ' | ' <<SQL | sed "s/^/| /; s/\$/ | $unclaimed |/"
WITH m AS (
    SELECT extract(epoch FROM c.updated - pg_xact_commit_timestamp((p.xid % 4294967296)::text::xid)) * 1000 AS ms
    FROM public.bench_lane_probe p JOIN public.bench_lane_claim c USING (job_id)
)
SELECT (SELECT count(*) FROM public.bench_lane_probe), $waiting,
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 2),
       round(percentile_cont(0.9) WITHIN GROUP (ORDER BY ms)::numeric, 2),
       round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 2),
       round(max(ms)::numeric, 2),
       count(*) FILTER (WHERE ms > 100)
FROM m;
SQL
psql "$server" -qc "DROP DATABASE skiplock_bench_lane_feed WITH (FORCE)" >/dev/null
