#!/usr/bin/env bash
# skiplock's headline drain (200,000 no-op jobs, one worker at its default settings) against
# graphile_worker's documented throughput mode on the same server, alternating: ROUNDS
# rounds (default 6; the first is a warm-up), each a run of both. Each run prints its jobs/s,
# Postgres and worker CPU per job and WAL per job (server-wide, both measured the same way).
# The server is the one DATABASE_URL names (default: the shared one on 5432); under
# benches/with-private-server.sh, a private one with initdb's defaults:
#
#   benches/with-private-server.sh -- benches/peers-side-by-side.sh [ROUNDS]
#
# Needs the drain bench built (cargo bench --bench drain --no-run; the newest
# target/release/deps/drain-<hash> is run) and the peer built:
#   (cd benches/peers/graphile_worker_rs && CARGO_TARGET_DIR=/tmp/peer-target cargo build --release)
# (PEER_BIN names another build of the peer).
set -euo pipefail

ROUNDS=${1:-6}
DRAIN=$(ls -t target/release/deps/drain-* 2>/dev/null | grep -v '\.d$' | head -n 1 || true)
PEER=${PEER_BIN:-/tmp/peer-target/release/skiplock-peer-graphile-worker-rs}
[ -x "$DRAIN" ] || { echo "no drain bench: cargo bench --bench drain --no-run" >&2; exit 1; }
[ -x "$PEER" ] || { echo "no peer at $PEER: see the header of $0" >&2; exit 1; }

for round in $(seq 1 "$ROUNDS"); do
    label="round $round"
    [ "$round" -eq 1 ] && label="round 1 (warm-up)"
    echo "## $label: skiplock"
    "$DRAIN" --bench --quick --only headline 2>&1 | grep -E "jobs in .* \(db\)|^\| *200,000" || true
    echo "## $label: graphile_worker 0.14.1, local queue of 500, completion batch 5 ms"
    PEER_TUNED_ONLY=1 "$PEER" 2>/dev/null | grep "^| graphile_worker"
done
