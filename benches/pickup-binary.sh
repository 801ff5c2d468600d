#!/usr/bin/env bash
# Idle pickup through the binary: jobs inserted by plain SQL, one at a time, into an idle
# `skiplock work`, timed on the database clock from the insert's commit to the claim's
# update of the row. This is issue 27's measure (the latency bench instead times
# `enqueue` returning to the handler's start, both in one Rust process).
#
#   benches/with-private-server.sh -c track_commit_timestamp=on -- benches/pickup-binary.sh [PROBES]
#
# - The insert's commit: `pg_xact_commit_timestamp` of its transaction (the server needs
#   track_commit_timestamp = on; the script stops if it is off). The inserting session runs
#   with synchronous_commit off, so its own WAL flush is not counted.
# - The claim: a BEFORE UPDATE row trigger, added to the bench's own database only, copies
#   the row's new `heartbeat_at` (the claim's `clock_timestamp()` at its update) and `now()`
#   (the claim transaction's start) when a row goes from queued to running. The copy runs
#   after the value was taken, so it adds nothing to the time measured.
# - PROBES probes (default 500) after 20 for warm-up, 10 ms apart (each is claimed in
#   about a millisecond, so they do not overlap), into an empty table.
#
#   DATABASE_URL: the server (a database `skiplock_bench_pickup` is recreated on it).
#   SKIPLOCK_BIN: the binary (default target/release/skiplock, built if missing).
#   WORKER_CPUS:  a CPU list (taskset) for the worker, as in benches/worker-processes.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=benches/support/timed-worker.sh
. benches/support/timed-worker.sh

probes="${1:-500}"
warmup=20
server="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
db="${server%/*}/skiplock_bench_pickup"
bin=${SKIPLOCK_BIN:-target/release/skiplock}
[ -n "${SKIPLOCK_BIN:-}" ] || [ -x "$bin" ] || cargo build --release --features cli --bin skiplock >&2
pin=()
[ -z "${WORKER_CPUS:-}" ] || pin=(taskset -c "$WORKER_CPUS")

require_commit_timestamps "$server"
fresh_database "$server" skiplock_bench_pickup "$bin"
psql "$db" -q -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
SET client_min_messages = warning;
CREATE TABLE public.bench_pickup_probe (job_id bigint PRIMARY KEY, xid bigint NOT NULL);
CREATE TABLE public.bench_pickup_claim (job_id bigint PRIMARY KEY, updated timestamptz, claim_start timestamptz);
CREATE FUNCTION public.bench_pickup_claimed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.bench_pickup_claim VALUES (NEW.id, NEW.heartbeat_at, now());
    RETURN NEW;
END $$;
CREATE TRIGGER bench_pickup_claimed BEFORE UPDATE ON skiplock.jobs FOR EACH ROW
    WHEN (OLD.state = 'queued' AND NEW.state = 'running')
    EXECUTE FUNCTION public.bench_pickup_claimed();
SQL

RUST_LOG=warn "${pin[@]}" "$bin" --database-url "$db" work --kinds noop >/dev/null 2>&1 &
worker=$!
trap 'kill "$worker" 2>/dev/null || true; wait "$worker" 2>/dev/null || true' EXIT
wait_for_listener "$db"

{
    echo "SET synchronous_commit = off;"
    for ((i = 0; i < warmup + probes; i++)); do
        echo "WITH j AS (INSERT INTO skiplock.jobs (kind, args) VALUES ('noop', '{}') RETURNING id)
              INSERT INTO public.bench_pickup_probe SELECT id, txid_current() FROM j;"
        echo "SELECT pg_sleep(0.01);"
    done
} | psql "$db" -q -v ON_ERROR_STOP=1 >/dev/null
sleep 1
kill -INT "$worker"
wait "$worker" || true
trap - EXIT

left=$(psql "$db" -Atc "SELECT count(*) FROM skiplock.jobs WHERE state <> 'succeeded'")
[ "$left" = 0 ] || echo "warning: $left probes not succeeded" >&2
printf '| probes | commit → claim update p50 ms | p90 | p99 | max | commit → claim statement start p50 ms | p99 |\n'
printf '|---|---|---|---|---|---|---|\n'
psql "$db" -At -F ' | ' <<SQL | sed 's/^/| /; s/$/ |/'
WITH m AS (
    SELECT extract(epoch FROM c.updated - pg_xact_commit_timestamp((p.xid % 4294967296)::text::xid)) * 1000 AS upd,
           extract(epoch FROM c.claim_start - pg_xact_commit_timestamp((p.xid % 4294967296)::text::xid)) * 1000 AS st
    FROM public.bench_pickup_probe p JOIN public.bench_pickup_claim c USING (job_id)
    WHERE p.job_id > (SELECT min(job_id) + $warmup - 1 FROM public.bench_pickup_probe)
)
SELECT count(*),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY upd)::numeric, 2),
       round(percentile_cont(0.9) WITHIN GROUP (ORDER BY upd)::numeric, 2),
       round(percentile_cont(0.99) WITHIN GROUP (ORDER BY upd)::numeric, 2),
       round(max(upd)::numeric, 2),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY st)::numeric, 2),
       round(percentile_cont(0.99) WITHIN GROUP (ORDER BY st)::numeric, 2)
FROM m;
SQL
psql "$server" -qc "DROP DATABASE skiplock_bench_pickup WITH (FORCE)" >/dev/null
