-- migrations/functions/02_notifications.sql: Notifications: the payloads of
-- skiplock_runnable and skiplock_due_later, and internal_announce, the one way statements
-- announce work.
--
-- Defines:
--   internal_runnable_payload, internal_due_later_payload, internal_notify_due_later
--   internal_notify_runnable, internal_announce, internal_notify_queue_start
--   internal_notify_freed

-- ---- Notifications -----------------------------------------------------------------------
--
-- The functions a statement calls to notify are PL/pgSQL, not SQL: Postgres 15 plans the
-- body of a SQL function that it cannot inline at every call, and an announce's plans cost
-- a quarter of a millisecond each time (auto_explain in a claim of a key-limited queue);
-- PL/pgSQL keeps them for the session.

CREATE OR REPLACE FUNCTION skiplock.internal_runnable_payload(queue text, priority smallint,
                                          scheduled_at timestamptz) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT priority::text || E'\t'
        || CASE WHEN isfinite(scheduled_at)
                THEN ((extract(epoch FROM scheduled_at) * 1000000)::bigint)::text
                ELSE '-9223372036854775808' END
        || E'\t' || queue;
$$;
COMMENT ON FUNCTION skiplock.internal_runnable_payload(text, smallint, timestamptz) IS
    'Payload of a skiplock_runnable notification: where in claim order a job became runnable.';

-- Payload of a skiplock_due_later notification: in how many microseconds the first and the
-- last of the jobs come due, from this write's clock_timestamp() (a worker hears of it at
-- commit, later, and so never acts before the database clock says they are due), then the
-- claim key of the first as internal_runnable_payload writes it.
CREATE OR REPLACE FUNCTION skiplock.internal_due_later_payload(queue text, priority smallint,
                                                               first_at timestamptz,
                                                               last_at timestamptz) RETURNS text
LANGUAGE sql AS $$
    SELECT ((extract(epoch FROM first_at - clock_timestamp()) * 1000000)::bigint)::text || E'\t'
        || ((extract(epoch FROM last_at - clock_timestamp()) * 1000000)::bigint)::text || E'\t'
        || skiplock.internal_runnable_payload(queue, priority, first_at);
$$;

-- Notifies that jobs of a queue and priority come due later, between first_at and last_at
-- (skiplock_due_later, the Rust worker's own channel): a worker walks back to the first's
-- claim key when it comes due and again when the last does (src/worker/due_timers.rs).
-- Nothing when first_at is NULL, already due, or more than a day ahead: such a job that
-- comes due behind a worker's position waits for a walk from the start of its queue (a
-- minute at most, under 0.1 % of its delay); last_at is taken as a day ahead at most.
CREATE OR REPLACE FUNCTION skiplock.internal_notify_due_later(queue text, priority smallint,
                                                              first_at timestamptz,
                                                              last_at timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF first_at > now() AND first_at <= clock_timestamp() + interval '1 day' THEN
        PERFORM pg_notify('skiplock_due_later', skiplock.internal_due_later_payload(queue,
                    priority, first_at, least(last_at, clock_timestamp() + interval '1 day')));
    END IF;
END;
$$;

-- Notifies where a job (or jobs from this key on) became runnable, if it is due.
CREATE OR REPLACE FUNCTION skiplock.internal_notify_runnable(queue text, priority smallint,
                                         scheduled_at timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF scheduled_at <= now() THEN
        PERFORM pg_notify('skiplock_runnable',
                          skiplock.internal_runnable_payload(queue, priority, scheduled_at));
    END IF;
END;
$$;
COMMENT ON FUNCTION skiplock.internal_notify_runnable(text, smallint, timestamptz) IS
    'Tells workers that jobs of this queue became runnable from this priority and time on '
    '(at commit, if due): call it after requeuing jobs with a plain UPDATE.';

-- Announces jobs that became runnable or will (at commit), given their claim keys: per
-- queue and priority, the lowest key of those due now (skiplock_runnable) and when the
-- first and the last of those due later come due (skiplock_due_later). One message per
-- queue and priority whatever the number of jobs. The one way the statements of this
-- schema announce work: every statement that queues jobs (an enqueue, a retry, a release,
-- a step of a lane or of dependants, an operator's retry) or holds a queued row locked
-- that claims pass over calls it with the keys; tests/sql_conventions.rs fails when one
-- that queues jobs does not.
CREATE OR REPLACE FUNCTION skiplock.internal_announce(keys skiplock.runnable_key[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF cardinality(keys) > 0 THEN
        PERFORM skiplock.internal_notify_runnable(k.queue, k.priority,
                    min(k.scheduled_at) FILTER (WHERE k.scheduled_at <= now())),
                skiplock.internal_notify_due_later(k.queue, k.priority,
                    min(k.scheduled_at) FILTER (WHERE k.scheduled_at > now()), max(k.scheduled_at))
        FROM unnest(keys) AS k
        GROUP BY k.queue, k.priority;
    END IF;
END;
$$;

-- Tells workers to look at a queue from its start (at commit): the form of
-- skiplock_runnable for "what may be claimed changed", not "these jobs became runnable": a
-- queue resumed or given room by a changed limit, a slot of a queue with max_running freed.
CREATE OR REPLACE FUNCTION skiplock.internal_notify_queue_start(queue text) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_notify('skiplock_runnable', E'-\t-\t' || queue);
$$;

-- Jobs ended that held a slot (running jobs succeeded, failed, released, reaped or
-- cancelled; a queued job with a concurrency key cancelled), given as parallel arrays of
-- their queues and concurrency keys (one element per job, repeats allowed): the queues
-- among them that have max_running or key_max_running are looked at from the start, where
-- the jobs the limits held back wait, so a freed slot is taken at the next claim of any
-- worker and not at its next poll; in queues with key_max_running, the freed keys are
-- left in skiplock.key_slots_freed for that claim, which lets their held jobs go under the
-- queue's lock (this statement takes no lock, so it never waits for the queue's claims nor
-- holds them up until its caller commits). Every statement that ends claims calls it; a
-- job ended by a hand-written UPDATE is noticed at the workers' next poll and sweep. One
-- probe of skiplock.queues per queue for queues without limits.
CREATE OR REPLACE FUNCTION skiplock.internal_notify_freed(queues text[], keys text[])
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF cardinality(queues) > 0 THEN
        PERFORM skiplock.internal_notify_queue_start(q.name)
        FROM skiplock.queues q
        WHERE q.name = ANY (queues)
          AND (q.max_running IS NOT NULL OR q.key_max_running IS NOT NULL);
        INSERT INTO skiplock.key_slots_freed (queue, concurrency_key)
        SELECT DISTINCT f.queue, f.key
        FROM unnest(queues, keys) AS f(queue, key)
        WHERE f.key IS NOT NULL
          AND EXISTS (SELECT 1 FROM skiplock.queues q
                      WHERE q.name = f.queue AND q.key_max_running IS NOT NULL);
    END IF;
END;
$$;
