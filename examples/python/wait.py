#!/usr/bin/env python3
"""Enqueue a job and wait for its outcome, from Python (docs/sql.md, "Wait for a job's outcome").

    .venv/bin/python wait.py --kind sleep --args '{"ms": 200}' --timeout 30

Prints the outcome as one line of JSON and exits 0 when the job succeeded, 1 when it ended
dead or cancelled, 2 when it did not finish in time (it is left as it is) or is not there.
Any worker runs the job: `skiplock work`, worker.py beside this file, a Rust worker.

How it waits: LISTEN skiplock_finished first, then skiplock.watch_job(id), which marks the
job awaited and says where it stands; a job that finishes afterwards notifies its id, at
the commit that finished it, and watch_job is asked again. No polling, but a look every
10 s in case a notification was lost (a job deleted while live notifies nothing).
DATABASE_URL defaults to postgres://postgres@127.0.0.1:5432/postgres, as `skiplock` does;
LISTEN needs a direct connection (not PgBouncer in transaction mode).

The job continues the caller's trace: TRACEPARENT and TRACESTATE from the environment
(OpenTelemetry's carriers for a process; an HTTP service passes its request's headers
instead) go to skiplock.enqueue, and every attempt gets them.
"""

import argparse
import json
import os
import sys
import time

import psycopg
from psycopg.types.json import Jsonb

DATABASE_URL_DEFAULT = "postgres://postgres@127.0.0.1:5432/postgres"
# A look at the job this often even without a notification: only a lost one makes it matter.
FALLBACK_LOOK_SECS = 10.0


def watch(conn, job_id):
    """skiplock.watch_job: the job's (state, attempt, output, last_error, finished_at), or None.

    Run again on a serialization failure: under a database whose default isolation is not
    READ COMMITTED, a job finishing at that instant fails the statement instead of being
    read finished (under READ COMMITTED the function runs itself again).
    """
    for attempt in range(10):
        try:
            return conn.execute(
                # The time as text: a row written by hand may say '-infinity'.
                "SELECT state::text, attempt, output, last_error, finished_at::text"
                " FROM skiplock.watch_job(%s)",
                (job_id,),
                prepare=False,
            ).fetchone()
        except psycopg.errors.SerializationFailure:
            time.sleep(0.01 * (attempt + 1))
    raise RuntimeError(f"job {job_id}: watch_job kept failing with serialization failures")


def wait_for(conn, job_id, timeout_secs):
    """Waits until the job finished; its row, or None (not there), or "timeout"."""
    deadline = time.monotonic() + timeout_secs
    conn.execute("LISTEN skiplock_finished")  # before the first look: nothing is missed
    while True:
        row = watch(conn, job_id)
        if row is None or row[4] is not None:
            return row
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout"
        # Until a notification of this id, the fallback, or the deadline.
        for notify in conn.notifies(timeout=min(left, FALLBACK_LOOK_SECS)):
            if notify.payload == str(job_id):
                break


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="noop")
    parser.add_argument("--args", default="{}", help="the job's args, JSON")
    parser.add_argument("--queue", default="default")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait")
    options = parser.parse_args()
    url = os.environ.get("DATABASE_URL", DATABASE_URL_DEFAULT)
    # Autocommit: each statement commits at once (the enqueue must commit before a worker
    # can see the job), and notifications arrive between statements.
    with psycopg.connect(url, autocommit=True) as conn:
        (job_id,) = conn.execute(
            "SELECT skiplock.enqueue(%s, %s, queue => %s, traceparent => %s, tracestate => %s)",
            (options.kind, Jsonb(json.loads(options.args)), options.queue,
             os.environ.get("TRACEPARENT") or None, os.environ.get("TRACESTATE") or None),
            prepare=False,
        ).fetchone()
        print(f"job {job_id} enqueued; waiting up to {options.timeout:g} s", file=sys.stderr)
        row = wait_for(conn, job_id, options.timeout)
    if row is None:
        print(f"job {job_id} is not there: deleted or pruned", file=sys.stderr)
        return 2
    if row == "timeout":
        print(f"job {job_id} had not finished after {options.timeout:g} s; left as it is",
              file=sys.stderr)
        return 2
    state, attempt, output, last_error, finished_at = row
    print(json.dumps({"id": job_id, "state": state, "attempt": attempt, "output": output,
                      "last_error": last_error, "finished_at": finished_at}))
    return 0 if state == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
