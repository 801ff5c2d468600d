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
-- from there; walks from the left edge become a slow backstop while a snapshot is held.
--
-- The writers: the insert trigger; the functions that promote or requeue jobs
-- (advance_lanes, also for a lane head already queued, whose turn comes when the job
-- before it ends; settle_dependants; retry_job); the worker's release statement; and the
-- functions that hold a queued job locked until their transaction ends while claims skip
-- it (unique_key_holder, for an enqueue that folds into a pending job;
-- job_dependencies_after_insert, for a child of a queued parent). Not a row trigger on
-- UPDATE: it would fetch every updated row again, claims and completions included, even
-- when its WHEN clause is false (see fold_into_key_holder in 0001). An operator's plain
-- UPDATE that makes a job runnable behind a worker's position is found by the worker's
-- next walk from the left edge: at once in a clean database, within about a minute while
-- a snapshot is held.
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

-- A job's place in claim order, as settle_dependants collects those it promotes.
CREATE TYPE skiplock.runnable_key AS (queue text, priority smallint, scheduled_at timestamptz);

-- Notifies where a job (or jobs from this key on) became runnable, if it is due.
CREATE FUNCTION skiplock.notify_runnable(queue text, priority smallint,
                                         scheduled_at timestamptz) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_notify('skiplock_runnable', skiplock.runnable_payload(queue, priority, scheduled_at))
    WHERE scheduled_at <= now();
$$;

COMMENT ON FUNCTION skiplock.notify_runnable(text, smallint, timestamptz) IS
    'Tells workers that jobs of this queue became runnable from this priority and time on '
    '(at commit, if due): call it after requeuing jobs with a plain UPDATE.';

-- A paused queue's jobs were not claimed, and late commits noticed meanwhile may lie
-- behind the worker's position: a resumed queue is looked at from the start.
CREATE OR REPLACE FUNCTION skiplock.resume_queue(queue_name text) RETURNS void
LANGUAGE sql AS $$
    SELECT skiplock.set_queue_paused(queue_name, false);
    SELECT pg_notify('skiplock_runnable', E'-\t-\t' || queue_name);
    SELECT pg_notify('skiplock_jobs', queue_name);
$$;

-- The functions below are those of 0001_schema.sql with their notifications added; each
-- is replaced whole, as Postgres has no other way to change a function's body.

CREATE OR REPLACE FUNCTION skiplock.advance_lanes(keys text[]) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    promoted_queues text[];
    promoted int;
BEGIN
    WITH heads AS (
        SELECT DISTINCT ON (ordering_key) id, state
        FROM skiplock.jobs
        WHERE ordering_key = ANY (keys) AND state IN ('waiting', 'queued', 'running')
        ORDER BY ordering_key, id
    ), ready AS (
        UPDATE skiplock.jobs j SET state = 'queued'
        FROM heads
        WHERE j.id = heads.id AND heads.state = 'waiting' AND j.state = 'waiting'
          AND NOT EXISTS (
              SELECT 1 FROM skiplock.jobs o
              WHERE o.ordering_key = j.ordering_key AND o.state = 'running'
          )
          AND NOT skiplock.has_unmet_parent(j.id)
        RETURNING j.queue
    )
    SELECT array_agg(DISTINCT queue), count(*) INTO promoted_queues, promoted FROM ready;
    PERFORM pg_notify('skiplock_jobs', q) FROM unnest(promoted_queues) AS q;
    -- Each lane's head, promoted now or queued before (its turn came when the job before
    -- it ended; claims skipped it while that job was unfinished).
    PERFORM skiplock.notify_runnable(h.queue, h.priority, h.scheduled_at)
    FROM (SELECT DISTINCT ON (ordering_key) state, queue, priority, scheduled_at
          FROM skiplock.jobs
          WHERE ordering_key = ANY (keys) AND state IN ('waiting', 'queued', 'running')
          ORDER BY ordering_key, id) h
    WHERE h.state = 'queued';
    RETURN promoted;
END;
$$;


CREATE OR REPLACE FUNCTION skiplock.settle_dependants(parent_ids bigint[]) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    promoted_queues text[];
    promoted_keys skiplock.runnable_key[];
    promoted int := 0;
    cancelled int := 0;
BEGIN
    WITH RECURSIVE doomed (id, reason) AS (
        SELECT d.job_id,
               CASE WHEN p.id IS NULL
                    THEN format('parent job %s was deleted while %s', d.parent_id, d.parent_state)
                    ELSE format('parent job %s ended %s', p.id, p.state) END
        FROM skiplock.job_dependencies d
        LEFT JOIN skiplock.jobs p ON p.id = d.parent_id
        JOIN skiplock.jobs c ON c.id = d.job_id
        WHERE d.parent_id = ANY (parent_ids)
          AND (p.state IN ('dead', 'cancelled') OR (p.id IS NULL AND d.parent_state IS NOT NULL))
          AND c.state = 'waiting'
        UNION
        SELECT d.job_id, format('parent job %s was cancelled', d.parent_id)
        FROM skiplock.job_dependencies d
        JOIN doomed ON d.parent_id = doomed.id
        JOIN skiplock.jobs c ON c.id = d.job_id
        WHERE c.state = 'waiting'
    )
    UPDATE skiplock.jobs j
    SET state = 'cancelled', finished_at = now(), last_error = doomed.reason
    FROM doomed
    WHERE j.id = doomed.id AND j.state = 'waiting';
    GET DIAGNOSTICS cancelled = ROW_COUNT;

    WITH ready AS (
        UPDATE skiplock.jobs c
        SET state = 'queued'
        WHERE c.state = 'waiting'
          AND c.id IN (SELECT job_id FROM skiplock.job_dependencies WHERE parent_id = ANY (parent_ids))
          AND NOT skiplock.has_unmet_parent(c.id)
        RETURNING c.queue, c.priority, c.scheduled_at
    )
    SELECT array_agg(DISTINCT queue), count(*),
           array_agg(DISTINCT ROW(queue, priority, scheduled_at)::skiplock.runnable_key)
    INTO promoted_queues, promoted, promoted_keys FROM ready;
    PERFORM pg_notify('skiplock_jobs', q) FROM unnest(promoted_queues) AS q;
    -- The lowest key per queue and priority: one message, not one per child.
    PERFORM skiplock.notify_runnable(k.queue, k.priority, min(k.scheduled_at))
    FROM unnest(promoted_keys) AS k
    GROUP BY k.queue, k.priority;
    RETURN promoted + cancelled;
END;
$$;


CREATE OR REPLACE FUNCTION skiplock.retry_job(job_id bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    q text;
    p smallint;
    s timestamptz;
    now_state skiplock.job_state;
    lane text;
    current skiplock.job_state;
    holder bigint;
BEGIN
    SELECT ordering_key INTO lane FROM skiplock.jobs WHERE id = job_id;
    IF lane IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('skiplock.lane:' || lane, 0));
    END IF;
    SELECT state INTO current FROM skiplock.jobs WHERE id = job_id FOR UPDATE;
    IF current IS NULL OR current NOT IN ('queued', 'dead', 'cancelled', 'succeeded') THEN
        RETURN false;
    END IF;
    holder := skiplock.fold_into_key_holder(job_id);
    UPDATE skiplock.jobs j
    SET state = CASE
            WHEN holder IS NOT NULL THEN 'cancelled'
            WHEN lane IS NOT NULL AND EXISTS (
                SELECT 1 FROM skiplock.jobs o
                WHERE o.ordering_key = lane AND o.id <> job_id
                  AND o.state IN ('waiting', 'queued', 'running'))
            THEN 'waiting'
            WHEN skiplock.has_unmet_parent(j.id) THEN 'waiting'
            ELSE 'queued' END::skiplock.job_state,
        scheduled_at = now(),
        max_attempts = greatest(max_attempts, attempt + 1),
        finished_at = CASE WHEN holder IS NOT NULL THEN now() END,
        last_error = CASE WHEN holder IS NOT NULL
            THEN skiplock.superseded_message(holder, unique_key) ELSE last_error END
    WHERE id = job_id AND state IN ('queued', 'dead', 'cancelled', 'succeeded')
    RETURNING queue, priority, scheduled_at, state INTO q, p, s, now_state;
    IF q IS NULL THEN
        RETURN false;
    END IF;
    IF lane IS NOT NULL THEN
        PERFORM skiplock.advance_lanes(ARRAY[lane]);
    END IF;
    -- A child of a dead, cancelled or deleted parent is cancelled again at once, with the
    -- reason.
    PERFORM skiplock.settle_dependants(ARRAY(
        SELECT d.parent_id FROM skiplock.job_dependencies d WHERE d.job_id = retry_job.job_id));
    PERFORM pg_notify('skiplock_jobs', q);
    IF now_state = 'queued' THEN
        PERFORM skiplock.notify_runnable(q, p, s);
    END IF;
    RETURN true;
END;
$$;


CREATE OR REPLACE FUNCTION skiplock.unique_key_holder(key text, self bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    holder bigint;
    holder_state skiplock.job_state;
    holder_queue text;
    holder_priority smallint;
    holder_scheduled_at timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('skiplock.unique:' || key, 0));
    SELECT o.id, o.state, o.queue, o.priority, o.scheduled_at
    INTO holder, holder_state, holder_queue, holder_priority, holder_scheduled_at
    FROM skiplock.jobs o
    WHERE o.unique_key = key AND o.state IN ('waiting', 'queued') AND o.id <> self
    ORDER BY o.id LIMIT 1
    FOR UPDATE;
    -- Claims skip the holder while this transaction holds it locked.
    IF holder_state = 'queued' THEN
        PERFORM skiplock.notify_runnable(holder_queue, holder_priority, holder_scheduled_at);
    END IF;
    RETURN holder;
END;
$$;


CREATE OR REPLACE FUNCTION skiplock.job_dependencies_after_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    parent_now skiplock.job_state;
    parent_queue text;
    parent_priority smallint;
    parent_scheduled_at timestamptz;
    child_queue text;
    child_priority smallint;
    child_scheduled_at timestamptz;
    child_now skiplock.job_state;
BEGIN
    IF NEW.parent_state IS NOT NULL THEN
        RAISE EXCEPTION 'job_dependencies.parent_state is written by skiplock when a parent is deleted; insert the edge with parent_state NULL'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT state, queue, priority, scheduled_at
    INTO parent_now, parent_queue, parent_priority, parent_scheduled_at
    FROM skiplock.jobs WHERE id = NEW.parent_id FOR KEY SHARE;
    -- Claims skip the parent while this transaction holds it locked.
    IF parent_now = 'queued' THEN
        PERFORM skiplock.notify_runnable(parent_queue, parent_priority, parent_scheduled_at);
    END IF;
    IF parent_now IS NULL THEN
        RAISE EXCEPTION 'parent job % does not exist', NEW.parent_id
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    SELECT state, queue, priority, scheduled_at
    INTO child_now, child_queue, child_priority, child_scheduled_at
    FROM skiplock.jobs WHERE id = NEW.job_id FOR UPDATE;
    IF parent_now = 'succeeded' THEN
        -- The child stays as it was; claims skipped it while it was locked.
        IF child_now = 'queued' THEN
            PERFORM skiplock.notify_runnable(child_queue, child_priority, child_scheduled_at);
        END IF;
        RETURN NULL;
    END IF;
    IF child_now IN ('running', 'succeeded', 'dead') THEN
        RAISE EXCEPTION 'job % already started; a dependency on job % must be added before it runs',
            NEW.job_id, NEW.parent_id
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF child_now = 'queued' THEN
        IF parent_now IN ('dead', 'cancelled') THEN
            UPDATE skiplock.jobs
            SET state = 'cancelled', finished_at = now(),
                last_error = format('parent job %s ended %s', NEW.parent_id, parent_now)
            WHERE id = NEW.job_id;
        ELSE
            UPDATE skiplock.jobs SET state = 'waiting' WHERE id = NEW.job_id;
        END IF;
    END IF;
    RETURN NULL;
END;
$$;

