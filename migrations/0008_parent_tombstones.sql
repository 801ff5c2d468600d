-- skiplock schema, version 8: a dependency survives the deletion of its parent.
--
-- Until now the parent_id foreign key of skiplock.job_dependencies deleted a child's edge
-- together with its parent. Deleting an unfinished parent by hand cancelled its waiting
-- children (0007), but the edge was gone: a later `skiplock retry` of such a child queued it
-- and it ran, although its parent never succeeded.
--
-- Now the edge stays, and says what became of the parent:
--   * parent row present: the parent's own state decides, as before;
--   * parent row gone, parent_state NULL: the parent succeeded and was pruned (or deleted
--     after it succeeded); the edge is satisfied;
--   * parent row gone, parent_state set: the parent was deleted before it succeeded, while
--     in that state (a tombstone); the edge can never be satisfied, and the child is
--     cancelled whenever it would otherwise wait for it.
-- Edges are deleted with their child (the job_id foreign key still cascades). Deleting a
-- succeeded job no longer costs a cascade probe of job_dependencies per row.
--
-- The foreign key also locked the parent while an edge was inserted, so that a parent could
-- not disappear under a new edge; the insert trigger now takes that lock itself.

ALTER TABLE skiplock.job_dependencies
    DROP CONSTRAINT job_dependencies_parent_id_fkey,
    ADD COLUMN parent_state skiplock.job_state,
    ADD CONSTRAINT job_dependencies_tombstone_unfinished
        CHECK (parent_state IS DISTINCT FROM 'succeeded');

COMMENT ON TABLE skiplock.job_dependencies IS
    'Edges of the dependency graph: job_id runs only after parent_id succeeded. An edge whose '
    'parent row is gone is satisfied when parent_state is NULL (the parent succeeded and was '
    'pruned) and never satisfied when parent_state is set (the parent was deleted in that '
    'state before it succeeded).';
COMMENT ON COLUMN skiplock.job_dependencies.parent_state IS
    'NULL while the parent exists or after it was deleted as succeeded; the parent''s state '
    'when it was deleted before it succeeded (written by skiplock, never by hand).';

-- Whether a job still has a parent that has not succeeded: a parent row in any other state,
-- or a tombstone. An edge whose parent row is gone with parent_state NULL is satisfied.
-- Simple enough for the planner to inline into the statements that call it.
CREATE FUNCTION skiplock.has_unmet_parent(job bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM skiplock.job_dependencies d
        LEFT JOIN skiplock.jobs p ON p.id = d.parent_id
        WHERE d.job_id = job
          AND p.state IS DISTINCT FROM 'succeeded'
          AND (p.id IS NOT NULL OR d.parent_state IS NOT NULL)
    );
$$;

-- Deleting a job that had not succeeded: its edges keep its state as a tombstone, and its
-- waiting children are cancelled with the reason (0007).
CREATE OR REPLACE FUNCTION skiplock.jobs_after_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    children bigint[];
BEGIN
    UPDATE skiplock.job_dependencies SET parent_state = OLD.state WHERE parent_id = OLD.id;
    WITH cancelled AS (
        UPDATE skiplock.jobs c
        SET state = 'cancelled', finished_at = now(),
            last_error = format('parent job %s was deleted while %s', OLD.id, OLD.state)
        WHERE c.state = 'waiting'
          AND c.id IN (SELECT d.job_id FROM skiplock.job_dependencies d WHERE d.parent_id = OLD.id)
        RETURNING c.id
    )
    SELECT array_agg(id) INTO children FROM cancelled;
    IF children IS NOT NULL THEN
        PERFORM skiplock.settle_dependants(children);
    END IF;
    RETURN NULL;
END;
$$;

-- A dependency row written by hand means what enqueue's depends_on means (0007). The parent
-- must exist (locked FOR KEY SHARE, as the foreign key did, so that it cannot be deleted
-- before this edge commits and the delete trigger sees it); parent_state is skiplock's own.
CREATE OR REPLACE FUNCTION skiplock.job_dependencies_after_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    parent_now skiplock.job_state;
    child_now skiplock.job_state;
BEGIN
    IF NEW.parent_state IS NOT NULL THEN
        RAISE EXCEPTION 'job_dependencies.parent_state is written by skiplock when a parent is deleted; insert the edge with parent_state NULL'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT state INTO parent_now FROM skiplock.jobs WHERE id = NEW.parent_id FOR KEY SHARE;
    IF parent_now IS NULL THEN
        RAISE EXCEPTION 'parent job % does not exist', NEW.parent_id
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    SELECT state INTO child_now FROM skiplock.jobs WHERE id = NEW.job_id FOR UPDATE;
    IF parent_now = 'succeeded' THEN
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

-- As 0007's, with tombstones: a waiting child of a parent deleted before it succeeded is
-- cancelled, and such an edge keeps a child waiting like an unfinished parent.
CREATE OR REPLACE FUNCTION skiplock.settle_dependants(parent_ids bigint[]) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    promoted_queues text[];
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
        RETURNING c.queue
    )
    SELECT array_agg(DISTINCT queue), count(*) INTO promoted_queues, promoted FROM ready;
    PERFORM pg_notify('skiplock_jobs', q) FROM unnest(promoted_queues) AS q;
    RETURN promoted + cancelled;
END;
$$;

-- As 0007's; a head with a tombstoned parent stays waiting (settle_dependants cancels it).
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
    RETURN promoted;
END;
$$;

-- As 0007's: a retried child with a tombstoned parent goes back to `waiting`, and the
-- settle_dependants at the end cancels it again with the reason, instead of running it.
CREATE OR REPLACE FUNCTION skiplock.retry_job(job_id bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    q text;
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
    RETURNING queue INTO q;
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
    RETURN true;
END;
$$;
