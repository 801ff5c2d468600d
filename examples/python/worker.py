#!/usr/bin/env python3
"""A skiplock worker in Python, on the SQL worker protocol (docs/sql.md).

    pip install 'psycopg[binary]'
    DATABASE_URL=postgres://... python3 worker.py --queue default --batch 10

The loop: claim a batch with skiplock.claim, run each job in turn, and end each claim with
skiplock.complete or skiplock.fail. A background thread heartbeats the claims held (a job
whose claim is gone is told to stop) and calls skiplock.maintain now and then, so stale
claims of crashed workers are taken back even with no skiplock process running. SIGTERM or
SIGINT: the running job finishes, the claimed jobs not yet started are released, exit 0.
With --exit-when-idle it also exits 0 once a claim finds nothing to take.
"""

import argparse
import logging
import os
import signal
import socket
import threading
import time
import traceback

import psycopg
from psycopg.types.json import Jsonb

log = logging.getLogger("worker")

# A claim whose heartbeat is older than stale_after is taken back by skiplock.maintain and
# the job runs again elsewhere. --stale-after sets it (the same on every worker of the
# database); this worker heartbeats six times and calls maintain twice within it.
STALE_AFTER_SECS_DEFAULT = 30.0
HEARTBEATS_PER_STALE_AFTER = 6
MAINTAINS_PER_STALE_AFTER = 2
# With no job to run, wait this long for a skiplock_runnable notification before claiming
# again (jobs that become due by their scheduled_at announce nothing).
IDLE_POLL_SECS = 1.0


class Stopped(Exception):
    """The job's claim is gone (reaped, cancelled): whatever it did must not be saved."""


# Handlers: kind -> function(args, job) returning the output (any JSON) or raising.
# job["stop"] is a threading.Event set when the claim is lost; long handlers check it.
def noop(args, job):
    return None


def sleep(args, job):
    if job["stop"].wait(args["ms"] / 1000):
        raise Stopped()
    return None


def fail_once(args, job):
    if job["attempt"] == 1:
        raise RuntimeError("planned failure on the first attempt")
    return None


def hang_once(args, job):
    """The first attempt hangs until its claim is lost (its worker was killed and the job
    taken back, say); later attempts succeed. For tests of the reaper."""
    if job["attempt"] == 1:
        job["stop"].wait()
        raise Stopped()
    return None


HANDLERS = {"noop": noop, "sleep": sleep, "fail_once": fail_once, "hang_once": hang_once}


class Claims:
    """The claims this worker holds: id -> job. Shared with the heartbeat thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs = {}

    def add(self, job):
        with self._lock:
            self._jobs[job["id"]] = job

    def drop(self, job_id):
        with self._lock:
            return self._jobs.pop(job_id, None)

    def snapshot(self):
        with self._lock:
            return list(self._jobs.values())


def keep_claims(url, name, stale_after, claims, stopping):
    """Heartbeats the held claims and runs skiplock.maintain(stale_after), several times
    within stale_after, on a connection of its own, until `stopping` is set."""
    next_maintain = time.monotonic()
    with psycopg.connect(url, autocommit=True, application_name=f"{name} (heartbeat)") as conn:
        while not stopping.wait(stale_after / HEARTBEATS_PER_STALE_AFTER):
            held = claims.snapshot()
            if held:
                rows = conn.execute(
                    "SELECT id, held FROM skiplock.heartbeat(%s::bigint[], %s::uuid[])",
                    ([j["id"] for j in held], [j["claim_token"] for j in held]),
                ).fetchall()
                for job_id, still_held in rows:
                    if not still_held:
                        job = claims.drop(job_id)
                        if job:
                            log.warning("job %s: claim lost (reaped or cancelled); stopping it", job_id)
                            job["stop"].set()
            if time.monotonic() >= next_maintain:
                reaped, moved_on, cron_enqueued = conn.execute(
                    "SELECT reaped, moved_on, cron_enqueued"
                    " FROM skiplock.maintain(make_interval(secs => %s))",
                    (stale_after,),
                ).fetchone()
                if reaped:
                    log.info("maintain: took back %s stale claims, moved on %s jobs", reaped, moved_on)
                if cron_enqueued:
                    log.info("maintain: enqueued %s cron jobs", cron_enqueued)
                next_maintain = time.monotonic() + stale_after / MAINTAINS_PER_STALE_AFTER


def run_job(conn, claims, job):
    log.info("job %s (%s) attempt %s started", job["id"], job["kind"], job["attempt"])
    started = time.monotonic()
    try:
        output = HANDLERS[job["kind"]](job["args"], job)
    except Stopped:
        return  # The claim is gone: another worker owns the job now, write nothing.
    except Exception as error:  # noqa: BLE001 - any handler error fails the attempt
        claims.drop(job["id"])
        state = conn.execute(
            "SELECT skiplock.fail(%s, %s, %s)", (job["id"], job["claim_token"], traceback.format_exc())
        ).fetchone()[0]
        log.warning("job %s (%s) attempt %s failed: %r; now %s",
                    job["id"], job["kind"], job["attempt"], error, state or "not ours")
        return
    claims.drop(job["id"])
    saved = conn.execute(
        "SELECT skiplock.complete(%s, %s, %s)",
        (job["id"], job["claim_token"], None if output is None else Jsonb(output)),
    ).fetchone()[0]
    if saved:
        log.info("job %s (%s) succeeded in %.0f ms",
                 job["id"], job["kind"], (time.monotonic() - started) * 1000)
    else:
        log.warning("job %s (%s): claim lost before complete; result dropped", job["id"], job["kind"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", default=os.environ.get("SKIPLOCK_QUEUE", "default"))
    parser.add_argument("--kinds", default=os.environ.get("SKIPLOCK_KINDS", ",".join(HANDLERS)),
                        help="comma-separated kinds to claim (default: every kind handled here)")
    parser.add_argument("--batch", type=int, default=int(os.environ.get("SKIPLOCK_BATCH", "10")),
                        help="jobs claimed at once")
    parser.add_argument("--name", default=os.environ.get(
        "SKIPLOCK_WORKER", f"python-{socket.gethostname()}-{os.getpid()}"))
    parser.add_argument("--stale-after", type=float,
                        default=float(os.environ.get("SKIPLOCK_STALE_AFTER", STALE_AFTER_SECS_DEFAULT)),
                        help="seconds without a heartbeat after which maintain takes a claim back")
    parser.add_argument("--exit-when-idle", action="store_true",
                        default=os.environ.get("SKIPLOCK_EXIT_WHEN_IDLE", "") not in ("", "0", "false"),
                        help="exit 0 once a claim finds nothing to take")
    parser.add_argument("--log-level", default=os.environ.get("SKIPLOCK_LOG_LEVEL", "INFO"),
                        help="DEBUG, INFO (a line per job), WARNING or ERROR")
    opts = parser.parse_args()
    if opts.stale_after <= 0:
        parser.error("--stale-after must be positive")
    kinds = [k for k in opts.kinds.split(",") if k]
    unknown = set(kinds) - set(HANDLERS)
    if unknown:
        parser.error(f"no handler for kinds {sorted(unknown)}")
    logging.basicConfig(level=opts.log_level.upper(), format=f"%(asctime)s {opts.name} %(levelname)s %(message)s")

    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())

    url = os.environ["DATABASE_URL"]
    claims = Claims()
    keeper = threading.Thread(target=keep_claims, args=(url, opts.name, opts.stale_after, claims, stopping))
    with psycopg.connect(url, autocommit=True, application_name=opts.name) as conn:
        keeper.start()
        conn.execute("LISTEN skiplock_runnable")
        log.info("worker started: queue %s, kinds %s, batch %s, stale after %s s",
                 opts.queue, kinds, opts.batch, opts.stale_after)
        while not stopping.is_set():
            batch = conn.execute(
                "SELECT id, kind, args, attempt, claim_token FROM skiplock.claim(%s, %s::int, %s, %s::text[])",
                (opts.queue, opts.batch, opts.name, kinds),
            ).fetchall()
            jobs = [dict(id=i, kind=k, args=a, attempt=n, claim_token=t, stop=threading.Event())
                    for i, k, a, n, t in batch]
            for job in jobs:
                claims.add(job)
            for job in jobs:
                if stopping.is_set():
                    # Not started: give it back at once, its attempt not counted.
                    if claims.drop(job["id"]):
                        conn.execute("SELECT skiplock.release(%s, %s)", (job["id"], job["claim_token"]))
                elif not job["stop"].is_set():
                    run_job(conn, claims, job)
            if not jobs and opts.exit_when_idle:
                stopping.set()
            elif not jobs:
                # Wait for a job to become runnable (or the next poll, or a signal).
                for _ in conn.notifies(timeout=IDLE_POLL_SECS, stop_after=1):
                    pass
        keeper.join()
    log.info("worker stopped")


if __name__ == "__main__":
    main()
