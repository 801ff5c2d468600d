-- skiplock schema, version 3: a queue's name is not empty, in skiplock.queues as in
-- skiplock.jobs.
--
-- `SELECT skiplock.pause_queue('')` was accepted: it paused a queue no job can be in
-- (jobs_queue_not_empty), and the dashboard showed a blank queue. The functions now refuse
-- an empty or NULL name with a message saying so, and the table refuses such a row
-- written by hand. A row of that name an earlier version let in pauses nothing, so it is
-- deleted first.

DELETE FROM skiplock.queues WHERE name = '';

ALTER TABLE skiplock.queues ADD CONSTRAINT queues_name_not_empty CHECK (name <> '');

-- Pausing and resuming write the same row; one function checks the name and writes it.
CREATE FUNCTION skiplock.set_queue_paused(queue_name text, paused boolean) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF queue_name IS NULL OR queue_name = '' THEN
        RAISE EXCEPTION 'a queue name cannot be empty'
            USING ERRCODE = 'check_violation',
                  HINT = 'pass the queue''s name as its jobs have it in skiplock.jobs.queue';
    END IF;
    INSERT INTO skiplock.queues AS q (name, paused) VALUES (queue_name, set_queue_paused.paused)
    ON CONFLICT (name) DO UPDATE SET paused = excluded.paused, updated_at = now();
END;
$$;

CREATE OR REPLACE FUNCTION skiplock.pause_queue(queue_name text) RETURNS void
LANGUAGE sql AS $$
    SELECT skiplock.set_queue_paused(queue_name, true);
$$;

CREATE OR REPLACE FUNCTION skiplock.resume_queue(queue_name text) RETURNS void
LANGUAGE sql AS $$
    SELECT skiplock.set_queue_paused(queue_name, false);
    SELECT pg_notify('skiplock_jobs', queue_name);
$$;
