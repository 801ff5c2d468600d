#!/usr/bin/env python3
"""A skiplock worker in Python, on the SQL worker protocol (docs/sql.md).

    python3 -m venv .venv && .venv/bin/pip install -r requirements.txt
    .venv/bin/python worker.py --queue default

DATABASE_URL defaults to postgres://postgres@127.0.0.1:5432/postgres, as `skiplock` does.
See README.md beside this file for what it does and how to run it in production.

Three threads, each with its own database session:

- the main thread claims batches with skiplock.claim and runs the jobs, one at a time, or
  up to --concurrency at once on threads of their own;
- the completer saves outcomes in batches (skiplock.complete_many, skiplock.fail_many), so
  a claim and a completion are in flight at once and a batch costs two round trips;
- the keeper heartbeats the claims held and calls skiplock.maintain now and then, so the
  claims of crashed workers are taken back even with no skiplock process running. If
  heartbeats fail for half of stale_after, the worker stops its jobs and claims nothing
  until they work again: a job must never run on unseen while its claim may be taken back.

Every session runs READ COMMITTED whatever the database's default (skiplock's functions are
written for it), uses no named prepared statements (so PgBouncer in transaction mode works),
and survives errors of the server (serialization failures, deadlocks, timeouts, restarts)
by retrying with backoff and reconnecting. SIGTERM or SIGINT: the running jobs finish, the
claimed jobs not yet started are released, the outcomes are saved, exit 0; a second signal
also stops the running jobs.
"""

import argparse
import collections
import concurrent.futures
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
import urllib.parse

import psycopg
from psycopg.types.json import Jsonb

log = logging.getLogger("worker")

# The database `skiplock` itself uses when DATABASE_URL is unset.
DATABASE_URL_DEFAULT = "postgres://postgres@127.0.0.1:5432/postgres"
# A claim whose heartbeat is older than stale_after is taken back by skiplock.maintain and
# the job runs again elsewhere. --stale-after sets it (the same on every worker of the
# database); this worker heartbeats six times and calls maintain twice within it.
STALE_AFTER_SECS_DEFAULT = 30.0
HEARTBEATS_PER_STALE_AFTER = 6
MAINTAINS_PER_STALE_AFTER = 2
# Heartbeats failing for this share of stale_after: stop the jobs, claim nothing. Half
# leaves the other half for the jobs to stop before their claims can be taken back.
HEARTBEAT_FAILURE_LIMIT = 0.5
# A handler still running at this share of stale_after without a heartbeat ignored its stop:
# the process exits rather than run the job beside its retry.
HANDLER_STOP_LIMIT = 0.8
# With no job to run, wait this long for a skiplock_runnable notification before claiming
# again (jobs that become due by their scheduled_at announce nothing).
IDLE_POLL_SECS = 1.0
# The most outcomes saved in one statement.
SAVE_BATCH_MAX = 1000
# Backoff between attempts at a statement that failed for a passing reason.
RETRY_DELAY_MIN_SECS = 0.05
RETRY_DELAY_MAX_SECS = 5.0

# Errors of the server or the session, not of the statement: retried. Serialization
# failure, deadlock, lock_timeout, statement_timeout, shutdowns and restarts, a read-only
# server (a standby, a failover), a prepared statement a pooler lost; classes 08
# (connection) and 53 (insufficient resources). The Rust worker retries the same
# (src/error.rs).
TRANSIENT_SQLSTATES = {"40001", "40P01", "55P03", "57014", "57P01", "57P02", "57P03", "57P05",
                       "25006", "25P03", "26000"}
TRANSIENT_CLASSES = ("08", "53")

# Sent in the startup packet of a direct connection: READ COMMITTED for the session whatever
# the database's or role's default, and a marker that says the options arrived (a pooler
# refuses or drops them; then each call runs in a transaction of its own that pins it).
PINNED_OPTIONS = r"-c default_transaction_isolation=read\ committed -c skiplock.session_pinned=on"


class Stopped(Exception):
    """The job's claim is gone or may soon be (reaped, cancelled, heartbeats failing, a
    second signal): whatever it did must not be saved."""


# Handlers: kind -> function(args, job) returning the output (any JSON) or raising.
# job.stop is a threading.Event set when the job must stop; long handlers check it.
def noop(args, job):
    return None


def sleep(args, job):
    if job.stop.wait(args["ms"] / 1000):
        raise Stopped()
    return None


def fail_once(args, job):
    if job.attempt == 1:
        raise RuntimeError("planned failure on the first attempt")
    return None


def hang_once(args, job):
    """The first attempt hangs until it is told to stop (its claim was lost, or heartbeats
    failed); later attempts succeed. For tests of the reaper."""
    if job.attempt == 1:
        job.stop.wait()
        raise Stopped()
    return None


def echo_trace(args, job):
    """Returns the W3C trace context the job was enqueued with: what a handler passes on, as
    the traceparent and tracestate headers of an HTTP call it makes, or as the TRACEPARENT
    and TRACESTATE environment variables of a program it starts (OpenTelemetry's carriers)."""
    return {"traceparent": job.traceparent, "tracestate": job.tracestate}


HANDLERS = {"noop": noop, "sleep": sleep, "fail_once": fail_once, "hang_once": hang_once,
            "echo_trace": echo_trace}


class Job:
    __slots__ = ("id", "kind", "args", "attempt", "token", "traceparent", "tracestate", "_stop",
                 "started", "finished")
    # Guards the making of a job's stop event, which two threads may ask for at once.
    _stop_lock = threading.Lock()

    def __init__(self, row):
        (self.id, self.kind, self.args, self.attempt, self.token, self.traceparent,
         self.tracestate) = row
        self._stop = None
        self.started = None
        self.finished = False

    @property
    def stop(self):
        """A threading.Event set when the job must stop, made when first asked for: most
        short jobs never do, and an Event per job was a tenth of a no-op drain's time."""
        if self._stop is None:
            with Job._stop_lock:
                if self._stop is None:
                    self._stop = threading.Event()
        return self._stop

    def stopped(self):
        return self._stop is not None and self._stop.is_set()


def describe(error):
    sqlstate = getattr(error, "sqlstate", None)
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{text} (SQLSTATE {sqlstate})" if sqlstate else text


class Session:
    """One database session of the worker: connects (and reconnects), pins READ COMMITTED,
    runs each skiplock call unnamed, and retries the errors that pass (TRANSIENT_SQLSTATES,
    a lost connection) with backoff."""

    def __init__(self, url, name, give_up, listen=False):
        self.url, self.name, self.give_up, self.listen = url, name, give_up, listen
        self.conn = None
        self.pooled = False
        # Whether the last call lost a connection after sending a write: a retry that finds
        # the claim gone may be that write's own doing.
        self.reply_lost = False

    def connect(self):
        # prepare_threshold=None: never a named prepared statement (psycopg prepares a
        # query after 5 runs by default; behind PgBouncer in transaction mode the next
        # transaction may find it missing, or taken by another client).
        settings = dict(autocommit=True, prepare_threshold=None, application_name=self.name,
                        connect_timeout=10, keepalives=1, keepalives_idle=10,
                        keepalives_interval=5, keepalives_count=3)
        try:
            conn = psycopg.connect(self.url, options=PINNED_OPTIONS, **settings)
            marker = conn.execute("SELECT current_setting('skiplock.session_pinned', true)")
            pooled = marker.fetchone()[0] != "on"
        except psycopg.OperationalError as error:
            if "unsupported startup parameter" not in str(error):
                raise
            conn, pooled = psycopg.connect(self.url, **settings), True
        if pooled != self.pooled or self.conn is None:
            log.info("%s: %s", self.name, "a pooler in front (startup options refused or dropped): "
                     "each call in a transaction of its own at READ COMMITTED, no LISTEN"
                     if pooled else "direct connection, session pinned to READ COMMITTED")
        self.pooled = pooled
        if self.listen and not pooled:
            conn.execute("LISTEN skiplock_runnable")
        self.conn = conn

    def close(self):
        """Closes the connection; the next call connects again."""
        if self.conn is not None:
            self.conn.close()

    def _run(self, sql, params):
        conn = self.conn
        if not self.pooled:
            return conn.execute(sql, params).fetchall()
        # Behind a pooler the session is not ours from one transaction to the next: pin the
        # isolation in each transaction.
        conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        try:
            rows = conn.execute(sql, params).fetchall()
            conn.execute("COMMIT")
            return rows
        except BaseException:
            if not conn.closed:
                try:
                    conn.execute("ROLLBACK")
                except psycopg.Error:
                    pass
            raise

    def transient(self, error):
        if self.conn is None or self.conn.closed or self.conn.broken:
            return True
        sqlstate = getattr(error, "sqlstate", None) or ""
        return sqlstate in TRANSIENT_SQLSTATES or sqlstate.startswith(TRANSIENT_CLASSES)

    def call(self, what, sql, params=(), retry=True, retry_timeouts=True, give_up=None):
        """The rows of one statement. A transient error is retried with backoff until it
        passes (retry) or raised at once; give_up (an Event; the session's by default) ends
        the retries."""
        give_up = give_up or self.give_up
        delay = RETRY_DELAY_MIN_SECS
        self.reply_lost = False
        while True:
            try:
                if self.conn is None or self.conn.closed:
                    again = self.conn is not None
                    self.connect()
                    if again:
                        log.warning("%s: connected again", self.name)
                return self._run(sql, params)
            except psycopg.Error as error:
                if not self.transient(error):
                    raise
                if getattr(error, "sqlstate", None) == "57014" and not retry_timeouts:
                    raise
                if self.conn is not None and (self.conn.closed or self.conn.broken):
                    self.reply_lost = True
                    self.conn.close()
                if not retry or give_up.is_set():
                    raise
                log.warning("%s: %s; again in %.2f s", what, describe(error), delay)
                if give_up.wait(delay):
                    raise
                delay = min(delay * 2, RETRY_DELAY_MAX_SECS) * random.uniform(0.8, 1.2)


class Worker:
    def __init__(self, opts, url):
        self.opts, self.url = opts, url
        self.stale_after = opts.stale_after
        self.stopping = threading.Event()      # first signal: stop claiming
        self.hard_stop = threading.Event()     # second signal: stop the running jobs too
        self.done = threading.Event()          # the main loop is over: keeper, watchdog end
        self.heartbeats_failing = threading.Event()
        self.saved = threading.Event()         # the completer saved a batch
        self.lock = threading.Lock()
        self.held = {}                         # id -> Job: claimed, outcome not yet saved
        self.running = set()                   # the Jobs whose handler runs now
        # --concurrency above 1: handlers run on threads of their own, at most that many.
        self.runners = (concurrent.futures.ThreadPoolExecutor(opts.concurrency, "job")
                        if opts.concurrency > 1 else None)
        self.slots = threading.Semaphore(opts.concurrency)
        # (Job, ok, output or message), None at the end; a deque's append and popleft are
        # safe between threads. outcome_ready wakes the completer.
        self.outcomes = collections.deque()
        self.outcome_ready = threading.Event()
        self.last_heartbeat = time.monotonic() # when the claims held were last confirmed
        self.claim_size = opts.batch
        self.counts = dict(succeeded=0, failed=0, released=0, lost=0)

    # ---- the main thread: claim, run -------------------------------------------------------

    def run(self):
        session = Session(self.url, self.opts.name, self.hard_stop, listen=True)
        session.connect()
        threads = [threading.Thread(target=self.fatal_on_error, args=(target,), name=target.__name__,
                                    daemon=True)
                   for target in (self.complete_outcomes, self.keep_claims, self.watch_heartbeats)]
        for thread in threads:
            thread.start()
        started = time.monotonic()
        log.info("worker started: queue %s, kinds %s, batch %s, concurrency %s, stale after %s s,"
                 " database %s", self.opts.queue, ",".join(self.opts.kinds), self.opts.batch,
                 self.opts.concurrency, self.stale_after, safe_url(self.url))
        try:
            while not self.stopping.is_set():
                if self.heartbeats_failing.is_set() or self.pending() >= 2 * self.opts.batch:
                    self.saved.wait(0.1)
                    self.saved.clear()
                    continue
                jobs = self.claim(session)
                if jobs:
                    self.run_batch(session, jobs)
                elif self.pending():
                    # Outcomes not yet saved may let more jobs run (the next of a lane).
                    self.saved.wait(0.1)
                    self.saved.clear()
                elif self.opts.exit_when_idle and self.has_work(session):
                    # Another worker's running jobs may let more jobs go (a lane's next job,
                    # a child), or jobs wait for their key's room: not idle yet.
                    self.saved.wait(0.1)
                    self.saved.clear()
                elif self.opts.exit_when_idle:
                    left = self.left_behind(session)
                    log.info("nothing to claim: exiting (--exit-when-idle)%s",
                             f" ({left})" if left else "")
                    self.stopping.set()
                else:
                    self.wait_for_work(session)
        finally:
            if self.runners is not None:
                self.runners.shutdown(wait=True)
            self.put_outcome(None)
            threads[0].join()
            self.done.set()
            for thread in threads[1:]:
                thread.join()
            session.close()
        seconds = time.monotonic() - started
        ended = sum(self.counts[outcome] for outcome in ("succeeded", "failed", "released"))
        log.info("worker stopped: %s succeeded, %s failed, %s released, %s claims lost;"
                 " %s jobs in %.1f s (%.0f jobs/s)",
                 self.counts["succeeded"], self.counts["failed"], self.counts["released"],
                 self.counts["lost"], ended, seconds, ended / seconds if seconds > 0 else 0)

    def fatal_on_error(self, target):
        """Runs a thread's loop; an error it does not handle ends the process, loudly: a
        worker whose completer or keeper died must not go on running jobs."""
        try:
            target()
        except BaseException:  # noqa: BLE001
            log.critical("thread %s died; exiting:\n%s", target.__name__,
                         traceback.format_exc().rstrip())
            logging.shutdown()
            os._exit(1)

    def count(self, outcome):
        with self.lock:
            self.counts[outcome] += 1

    def pending(self):
        with self.lock:
            return len(self.held)

    def has_work(self, session):
        """Whether the queue still has work for this worker's kinds, now or once what runs
        anywhere ends (skiplock.has_work): asked before exiting when idle."""
        rows = session.call("has_work", "SELECT skiplock.has_work(ARRAY[%s], %s::text[])",
                            (self.opts.queue, self.opts.kinds), give_up=self.stopping)
        return bool(rows[0][0])

    def left_behind(self, session):
        """What exiting when idle leaves behind (a paused queue's jobs, retries in their
        backoff, jobs scheduled later), as the line to log, or None: skiplock.left_behind,
        which `skiplock work` and the Node example print too."""
        rows = session.call("left_behind", "SELECT skiplock.left_behind(ARRAY[%s], %s::text[])",
                            (self.opts.queue, self.opts.kinds), give_up=self.stopping)
        return rows[0][0]

    def claim(self, session):
        try:
            rows = session.call("claim", "SELECT id, kind, args, attempt, claim_token,"
                                " traceparent, tracestate"
                                " FROM skiplock.claim(%s, %s::int, %s, %s::text[])",
                                (self.opts.queue, self.claim_size, self.opts.name, self.opts.kinds),
                                retry_timeouts=self.claim_size == 1, give_up=self.stopping)
        except psycopg.errors.QueryCanceled:
            self.claim_size = max(1, self.claim_size // 2)
            log.warning("claim: statement_timeout stopped a claim; claiming %s at once from now on",
                        self.claim_size)
            return []
        except psycopg.Error as error:
            if self.stopping.is_set() and session.transient(error):
                return []
            raise
        jobs = [Job(row) for row in rows]
        with self.lock:
            for job in jobs:
                self.held[job.id] = job
        return jobs

    def wait_for_work(self, session):
        if session.pooled:
            self.stopping.wait(IDLE_POLL_SECS)
            return
        try:
            for _ in session.conn.notifies(timeout=IDLE_POLL_SECS, stop_after=1):
                pass
        except psycopg.Error as error:
            log.warning("waiting for notifications: %s", describe(error))
            session.close()  # the next claim reconnects (and listens again)

    def run_batch(self, session, jobs):
        for i, job in enumerate(jobs):
            if self.stopping.is_set() or self.heartbeats_failing.is_set():
                self.give_back(session, jobs[i:])
                return
            if job.stopped():
                self.forget(job, "claim lost before it started")
            elif self.runners is None:
                self.run_job(job)
            elif self.take_slot():
                self.runners.submit(self.run_in_slot, job)
            else:
                self.give_back(session, jobs[i:])
                return

    def take_slot(self):
        """Waits for a free runner thread; False when the worker stops claiming meanwhile."""
        while not self.slots.acquire(timeout=0.1):
            if self.stopping.is_set() or self.heartbeats_failing.is_set():
                return False
        return True

    def run_in_slot(self, job):
        try:
            self.run_job(job)
        finally:
            self.slots.release()

    def run_job(self, job):
        handler = HANDLERS[job.kind]
        job.started = time.monotonic()
        self.running.add(job)  # One step for the interpreter; readers take a copy().
        # The enqueuer's trace (its traceparent), so that a log line finds the request.
        log.info("job %s (%s) attempt %s started%s", job.id, job.kind, job.attempt,
                 f" in trace {job.traceparent}" if job.traceparent else "")
        try:
            output = handler(job.args, job)
        except Stopped:
            self.forget(job, "stopped; its outcome is not saved")
            return
        except Exception as error:  # noqa: BLE001 - any handler error fails the attempt
            # last_error gets the message; the stack goes to this worker's log.
            message = f"{type(error).__name__}: {error}"
            log.warning("job %s (%s) attempt %s failed: %s\n%s", job.id, job.kind, job.attempt,
                        message, traceback.format_exc().rstrip())
            self.put_outcome((job, False, message))
            return
        finally:
            self.running.discard(job)
            job.finished = True
        self.put_outcome((job, True, output))

    def put_outcome(self, outcome):
        self.outcomes.append(outcome)
        if not self.outcome_ready.is_set():
            self.outcome_ready.set()

    def forget(self, job, why):
        with self.lock:
            self.held.pop(job.id, None)
        self.count("lost")
        log.warning("job %s (%s) attempt %s: %s", job.id, job.kind, job.attempt, why)

    def give_back(self, session, jobs):
        """Releases claimed jobs not started: queued again at once, attempt not counted.
        With heartbeats failing, one attempt: the database is likely out of reach, and
        maintain takes the claims back anyway."""
        retry = not self.heartbeats_failing.is_set()
        for i, job in enumerate(jobs):
            with self.lock:
                if self.held.pop(job.id, None) is None:
                    continue
            try:
                session.call("release", "SELECT skiplock.release(%s, %s)", (job.id, job.token),
                             retry=retry)
                self.count("released")
            except psycopg.Error as error:
                with self.lock:
                    for other in jobs[i + 1:]:
                        self.held.pop(other.id, None)
                log.warning("%s claimed jobs not released (%s): maintain takes them back after"
                            " %s s", len(jobs) - i, describe(error), self.stale_after)
                return

    # ---- the completer: save outcomes in batches -------------------------------------------

    def complete_outcomes(self):
        session = Session(self.url, f"{self.opts.name} (completer)", self.hard_stop)
        ended = False
        while not ended:
            self.outcome_ready.wait()
            self.outcome_ready.clear()
            batch = []
            while not ended and len(batch) < SAVE_BATCH_MAX and self.outcomes:
                item = self.outcomes.popleft()
                if item is None:
                    ended = True
                else:
                    batch.append(item)
            if self.outcomes:
                self.outcome_ready.set()  # More than a batch: go on at once.
            try:
                self.save(session, [o for o in batch if o[1]], True)
                self.save(session, [o for o in batch if not o[1]], False)
            except psycopg.Error as error:
                # Refused for good (or given up on a hard stop): the claims stay running
                # until maintain takes them back.
                log.error("saving %s outcomes failed: %s; maintain takes their jobs back after"
                          " %s s", len(batch), describe(error), self.stale_after)
                with self.lock:
                    for job, _, _ in batch:
                        self.held.pop(job.id, None)
            self.saved.set()
        session.close()

    def save(self, session, items, ok):
        if not items:
            return
        ids = [job.id for job, _, _ in items]
        tokens = [job.token for job, _, _ in items]
        if ok:
            outputs = [None if out is None else Jsonb(out) for _, _, out in items]
            sql = ("SELECT id, state::text FROM skiplock.complete_many(%s::bigint[], %s::uuid[],"
                   " %s::jsonb[])")
            params = (ids, tokens, outputs if any(o is not None for o in outputs) else None)
        else:
            sql = "SELECT id, state::text FROM skiplock.fail_many(%s::bigint[], %s::uuid[], %s::text[])"
            params = (ids, tokens, [message for _, _, message in items])
        try:
            rows = session.call("complete_many" if ok else "fail_many", sql, params,
                                retry_timeouts=len(items) == 1)
        except psycopg.errors.QueryCanceled:
            # statement_timeout: save the halves, each faster.
            log.warning("saving %s outcomes took longer than statement_timeout; in halves",
                        len(items))
            self.save(session, items[: len(items) // 2], ok)
            self.save(session, items[len(items) // 2:], ok)
            return
        with self.lock:
            for job, _, _ in items:
                self.held.pop(job.id, None)
        for (job, _, _), (_, state) in zip(items, rows):
            if ok and state == "succeeded":
                self.count("succeeded")
                if log.isEnabledFor(logging.INFO):
                    log.info("job %s (%s) succeeded in %.0f ms", job.id, job.kind,
                             (time.monotonic() - job.started) * 1000)
            elif not ok and state in ("queued", "dead", "cancelled"):
                self.count("failed")
                log.warning("job %s (%s) attempt %s failed: now %s", job.id, job.kind, job.attempt,
                            "queued to run again" if state == "queued" else state)
            elif state is None and session.reply_lost:
                log.warning("job %s (%s): the connection dropped as its outcome was saved: saved"
                            " then, or its claim was lost", job.id, job.kind)
            elif state is None:
                self.count("lost")
                log.warning("job %s (%s): claim lost before its outcome was saved (reaped or"
                            " cancelled); outcome dropped", job.id, job.kind)
            else:
                log.error("job %s (%s): its outcome could not be saved; now %s (see its"
                          " last_error)", job.id, job.kind, state)

    # ---- the keeper: heartbeats and maintain -----------------------------------------------

    def keep_claims(self):
        session = Session(self.url, f"{self.opts.name} (heartbeat)", self.done)
        interval = self.stale_after / HEARTBEATS_PER_STALE_AFTER
        next_maintain = time.monotonic()
        wait = interval
        while not self.done.wait(wait):
            wait = interval
            with self.lock:
                held = list(self.held.values())
            try:
                # Called with no claim too: then it says whether the database answers, which
                # decides whether to claim again after heartbeats failed.
                rows = session.call(
                    "heartbeat", "SELECT id, held FROM skiplock.heartbeat(%s::bigint[], %s::uuid[])",
                    ([j.id for j in held], [j.token for j in held]), retry=False)
                for job, (_, still_held) in zip(held, rows):
                    if not still_held:
                        self.lose(job)
                self.last_heartbeat = time.monotonic()
                if self.heartbeats_failing.is_set():
                    self.heartbeats_failing.clear()
                    log.warning("heartbeats work again: claiming again")
                if time.monotonic() >= next_maintain:
                    self.maintain(session)
                    next_maintain = time.monotonic() + self.stale_after / MAINTAINS_PER_STALE_AFTER
            except psycopg.Error as error:
                log.warning("heartbeat: %s (the last one %.1f s ago)", describe(error),
                            time.monotonic() - self.last_heartbeat)
                wait = min(interval, 0.5)
        session.close()

    def lose(self, job):
        """The claim is gone (reaped, cancelled): the job stops and saves nothing (a job that
        already finished has its outcome refused by the claim's token)."""
        with self.lock:
            if self.held.get(job.id) is not job or job.stopped():
                return
            job.stop.set()
            finished = job.finished
        if not finished:
            log.warning("job %s: claim lost (reaped or cancelled); stopping it", job.id)

    def maintain(self, session):
        reaped, moved_on, cron_enqueued = session.call(
            "maintain", "SELECT reaped, moved_on, cron_enqueued FROM skiplock.maintain(make_interval(secs => %s))",
            (self.stale_after,), retry=False)[0]
        if reaped:
            log.info("maintain: took back %s stale claims, moved on %s jobs", reaped, moved_on)
        if cron_enqueued:
            log.info("maintain: enqueued %s cron jobs", cron_enqueued)

    # ---- the watchdog: the heartbeat rule --------------------------------------------------

    def watch_heartbeats(self):
        """Heartbeats failing for HEARTBEAT_FAILURE_LIMIT of stale_after: claim nothing, stop
        the running job, give back the others. A handler that ignores its stop until
        HANDLER_STOP_LIMIT ends the process: its claim may be taken back any moment and the
        job run elsewhere. Its own thread, so that a heartbeat stuck on a dead network does
        not hold it."""
        while not self.done.wait(min(0.25, self.stale_after / 20)):
            silent = time.monotonic() - self.last_heartbeat
            if silent > self.stale_after * HEARTBEAT_FAILURE_LIMIT and not self.heartbeats_failing.is_set():
                self.heartbeats_failing.set()
                running = sorted(j.id for j in self.running.copy())
                with self.lock:
                    unsaved = [j for j in self.held.values() if not j.finished]
                log.error("HEARTBEATS FAILING for %.1f s (claims are taken back after %s s"
                          " without one): stopping %s running jobs %s, claiming nothing until"
                          " they work again", silent, self.stale_after, len(running), running)
                for job in unsaved:
                    job.stop.set()
            stuck = [j for j in self.running.copy() if j.stopped()]
            if stuck and self.heartbeats_failing.is_set() and silent > self.stale_after * HANDLER_STOP_LIMIT:
                log.critical("jobs %s ignored their stop for %.1f s without a heartbeat; exiting so"
                             " that they cannot run beside their retry",
                             ", ".join(f"{j.id} ({j.kind})" for j in stuck),
                             silent - self.stale_after * HEARTBEAT_FAILURE_LIMIT)
                logging.shutdown()
                os._exit(3)

    def signal(self, signum, _frame):
        if not self.stopping.is_set():
            log.info("%s: stopping (the running jobs finish; again to stop them too)",
                     signal.Signals(signum).name)
            self.stopping.set()
            return
        log.warning("%s again: stopping the running jobs", signal.Signals(signum).name)
        self.hard_stop.set()
        # No lock: this runs between two statements of the main thread, which may hold it.
        # set.copy() is one step for the interpreter, safe beside the runner threads.
        for job in self.running.copy():
            job.stop.set()


def safe_url(url):
    """The URL without its password, for the log."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def main():
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", default=env("SKIPLOCK_QUEUE", "default"))
    parser.add_argument("--kinds", default=env("SKIPLOCK_KINDS", ",".join(HANDLERS)),
                        help="comma-separated kinds to claim (default: every kind handled here)")
    parser.add_argument("--batch", type=int, default=int(env("SKIPLOCK_BATCH", "100")),
                        help="jobs claimed at once (1 to 10000): small for long jobs, large for short")
    parser.add_argument("--concurrency", type=int, default=int(env("SKIPLOCK_CONCURRENCY", "1")),
                        help="jobs run at once, each on a thread of its own above 1 (default 1:"
                             " one at a time in the main thread)")
    parser.add_argument("--name", default=env("SKIPLOCK_WORKER",
                                              f"python-{socket.gethostname()}-{os.getpid()}"))
    parser.add_argument("--stale-after", type=float,
                        default=float(env("SKIPLOCK_STALE_AFTER", STALE_AFTER_SECS_DEFAULT)),
                        help="seconds without a heartbeat after which maintain takes a claim back")
    parser.add_argument("--exit-when-idle", action="store_true",
                        default=env("SKIPLOCK_EXIT_WHEN_IDLE", "") not in ("", "0", "false"),
                        help="exit 0 once a claim finds nothing to take")
    parser.add_argument("--log-level", default=env("SKIPLOCK_LOG_LEVEL", "INFO"),
                        help="DEBUG, INFO (a line per job), WARNING or ERROR")
    opts = parser.parse_args()
    if opts.stale_after <= 0:
        parser.error("--stale-after must be positive")
    if not 1 <= opts.batch <= 10000:
        parser.error("--batch must be between 1 and 10000")
    if opts.concurrency < 1:
        parser.error("--concurrency must be 1 or more")
    opts.kinds = [k for k in opts.kinds.split(",") if k]
    unknown = set(opts.kinds) - set(HANDLERS)
    if unknown:
        parser.error(f"no handler for kinds {sorted(unknown)}")
    logging.basicConfig(level=opts.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {opts.name} %(levelname)s %(message)s")

    url = env("DATABASE_URL") or DATABASE_URL_DEFAULT
    if not env("DATABASE_URL"):
        log.info("DATABASE_URL is not set: using %s", DATABASE_URL_DEFAULT)
    worker = Worker(opts, url)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, worker.signal)
    try:
        worker.run()
    except psycopg.OperationalError as error:
        log.error("cannot reach the database at %s: %s (set DATABASE_URL)", safe_url(url),
                  describe(error))
        sys.exit(1)
    except psycopg.Error as error:
        hint = " (is the schema migrated? `skiplock migrate`)" if getattr(
            error, "sqlstate", "") in ("42883", "3F000", "42P01") else ""
        log.error("stopped by an error no retry mends: %s%s", describe(error), hint)
        sys.exit(1)


if __name__ == "__main__":
    main()
