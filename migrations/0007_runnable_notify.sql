-- skiplock schema, version 7: every write that makes a job runnable says where, in claim
-- order, on the channel `skiplock_runnable`.
--
-- A worker claims from just after the last job it claimed (its position), so that a held
-- snapshot (a long report, pg_dump, a forgotten BEGIN) does not make every claim walk the
-- index entries of every job claimed since. Jobs can become runnable behind that
-- position: a higher priority, a job released or promoted (a lane, a parent) with its old
-- scheduled_at, an insert whose transaction committed late, a row written by hand. Until
-- now only the worker's paced walks from the left edge of the index found them, so under
-- a held snapshot those walks had to stay frequent, and each took a growing share of the
-- claim time (the held pickup p99 in docs/benchmarks.md). Now the write itself tells the
-- workers the lowest claim key it made runnable, and a worker behind which it lies walks
-- from there; walks from the left edge become a slow backstop.
--
-- Payload: `priority<TAB>scheduled_at_us<TAB>queue`, the lowest (priority, scheduled_at)
-- made runnable in that queue, scheduled_at in microseconds since the Unix epoch
-- (-9223372036854775808 for '-infinity'); or `-<TAB>-<TAB>queue`: look from the start of
-- claim order (resume_queue). The queue comes last, so a name may hold any character.
-- Postgres folds identical payloads within a transaction: rows stamped with the same
-- now() make one notification.
--
-- `skiplock_jobs` (payload: the queue name) is still sent by inserts and by the functions
-- that sent it before, so workers of schema version 6 keep waking during an upgrade.

CREATE FUNCTION skiplock.runnable_payload(queue text, priority smallint,
                                          scheduled_at timestamptz) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT priority::text || E'\t'
        || CASE WHEN isfinite(scheduled_at)
                THEN ((extract(epoch FROM scheduled_at) * 1000000)::bigint)::text
                ELSE '-9223372036854775808' END
        || E'\t' || queue;
$$;

COMMENT ON FUNCTION skiplock.runnable_payload(text, smallint, timestamptz) IS
    'Payload of a skiplock_runnable notification: where in claim order a job became runnable.';

-- Inserts: one notification per statement, queue and priority, at the earliest due time.
CREATE OR REPLACE FUNCTION skiplock.notify_jobs_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    q text;
    p smallint;
    s timestamptz;
BEGIN
    FOR q, p, s IN
        SELECT queue, priority, min(scheduled_at) FROM inserted
        WHERE state = 'queued' AND scheduled_at <= now()
        GROUP BY queue, priority
    LOOP
        PERFORM pg_notify('skiplock_runnable', skiplock.runnable_payload(q, p, s));
        PERFORM pg_notify('skiplock_jobs', q);
    END LOOP;
    RETURN NULL;
END;
$$;

-- Updates: a row that becomes queued and due, or moves earlier in claim order (a higher
-- priority, an earlier time, another queue or kind). Whoever writes it: release, retry,
-- lanes, parents, the reaper, an operator's UPDATE.
CREATE FUNCTION skiplock.notify_job_runnable() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('skiplock_runnable',
                      skiplock.runnable_payload(NEW.queue, NEW.priority, NEW.scheduled_at));
    RETURN NULL;
END;
$$;

-- The WHEN clause is evaluated without entering PL/pgSQL: a claim, a heartbeat or a
-- completion (no row becomes queued) pays for a few comparisons per row, nothing more.
CREATE TRIGGER jobs_notify_runnable
    AFTER UPDATE ON skiplock.jobs
    FOR EACH ROW
    WHEN (NEW.state = 'queued' AND NEW.scheduled_at <= now()
          AND (OLD.state <> 'queued' OR NEW.priority < OLD.priority
               OR NEW.scheduled_at < OLD.scheduled_at OR OLD.scheduled_at > now()
               OR NEW.queue <> OLD.queue OR NEW.kind <> OLD.kind))
    EXECUTE FUNCTION skiplock.notify_job_runnable();

-- A paused queue's jobs were not claimed, and late commits noticed meanwhile may lie
-- behind the worker's position: a resumed queue is looked at from the start.
CREATE OR REPLACE FUNCTION skiplock.resume_queue(queue_name text) RETURNS void
LANGUAGE sql AS $$
    SELECT skiplock.set_queue_paused(queue_name, false);
    SELECT pg_notify('skiplock_runnable', E'-\t-\t' || queue_name);
    SELECT pg_notify('skiplock_jobs', queue_name);
$$;
