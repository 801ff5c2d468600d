-- skiplock schema, version 9: a worker's completions are one update, in claim-list order.
--
-- The worker marked a batch of its jobs `succeeded` in two steps: it locked each row by a
-- primary-key lookup per claim (a LATERAL join driven by the claim list, sorted by id),
-- then updated the locked ids. The lateral lock fixed the order in which rows are locked,
-- so that two statements finishing overlapping claims (a completion retried after its
-- reply was lost, while the first is still running on the server) queue behind each
-- other instead of deadlocking; but each row was looked up twice and locked before its
-- update, which writes a WAL record of its own (57 bytes per job).
--
-- complete_claims does it in one update joined to the claim list. An update locks the
-- rows it changes as its scan reaches them, so the order is the join's: the planner
-- settings below leave it a nested loop driven by the list (a hash or merge join, or a
-- sequential or bitmap scan, would lock in the table's physical order), or on a table of
-- a row or two a walk of jobs_pkey, in id order. The worker's list is sorted by id, so
-- either way rows are locked in id order, as by the statements that fail and release
-- claims. Like every
-- statement that finishes a claim, it matches the id and the claim token, and re-checks
-- the token on the newest row version after any wait (READ COMMITTED), so a claim lost
-- meanwhile drops out; it returns the jobs whose claim was still valid. Its plan is made
-- at each call, with the table's size as it is then.

CREATE FUNCTION skiplock.complete_claims(ids bigint[], tokens uuid[])
RETURNS TABLE (id bigint, state text, has_dependants boolean, ordering_key text)
LANGUAGE sql
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
    UPDATE skiplock.jobs j
    SET state = 'succeeded', finished_at = now(), claim_token = NULL, heartbeat_at = NULL
    FROM unnest(ids, tokens) AS c(id, token)
    WHERE j.id = c.id AND j.claim_token = c.token
    RETURNING j.id, j.state::text,
              EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = j.id),
              j.ordering_key;
$$;

COMMENT ON FUNCTION skiplock.complete_claims(bigint[], uuid[]) IS
    'Marks the given running jobs succeeded, each only if it still holds the given claim token, locking them in the order given (pass them sorted by id, as a worker does); returns those it changed, with what the worker does next for each (its dependants, its lane). What a worker calls.';

-- A dependency added while its parent's completion is in flight. The edge trigger read
-- the parent FOR KEY SHARE, which conflicted with the lateral FOR UPDATE of the old
-- completion: it waited, then saw the parent succeeded and left the child queued. The
-- update of complete_claims changes no key column and so takes the weaker FOR NO KEY
-- UPDATE lock, which FOR KEY SHARE does not wait for: the trigger read the parent as
-- still running and made the child wait, and the completion, whose snapshot predates the
-- edge, did not release it (the sweep did, seconds later). The trigger now reads the
-- parent FOR SHARE, which waits for any update of the parent in flight (a completion, a
-- failure, a cancel, an UPDATE by hand) and then reads what it wrote. Only that lock
-- differs from version 7; the function is replaced whole.

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
    FROM skiplock.jobs WHERE id = NEW.parent_id FOR SHARE;
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
