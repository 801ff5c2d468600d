#!/usr/bin/env bash
# Alternating rounds of several builds through benches/worker-processes.sh on one server,
# for A/B comparisons of the drain with 1 or more worker processes: round 1 runs each build
# in turn, then round 2, and so on, so that a drift of the machine hits every build alike.
#
# Usage: benches/worker-processes-ab.sh ROUNDS JOBS "PROCESSES..." BINARY...
#   for example, the two builds on a private server with Postgres on core 0 and the
#   workers on core 1:
#   WORKER_CPUS=1 benches/with-private-server.sh --cpus 0 -- \
#       benches/worker-processes-ab.sh 5 200000 "1 2 4 8" /tmp/skiplock-a /tmp/skiplock-b
# Each block of output starts with `## round R build BINARY`; the environment
# (DATABASE_URL, WORKER_CPUS, WORKER_ARGS, JOB_KIND, JOB_ARGS) passes through.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

[ $# -ge 4 ] || { echo "usage: $0 ROUNDS JOBS \"PROCESSES...\" BINARY..." >&2; exit 2; }
rounds=$1
jobs=$2
read -r -a counts <<<"$3"
shift 3
for round in $(seq 1 "$rounds"); do
    for bin in "$@"; do
        echo "## round $round build $bin"
        SKIPLOCK_BIN=$bin benches/worker-processes.sh "$jobs" "${counts[@]}"
    done
done
