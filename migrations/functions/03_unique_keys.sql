-- migrations/functions/03_unique_keys.sql: Unique keys: their lock order, the pending
-- holder of a key, folding a requeue into it.
--
-- Defines:
--   internal_unique_key_lock_id, internal_lock_unique_keys_of, internal_try_lock_unique_key
--   internal_unique_key_holder, internal_fold_into_key_holder, internal_superseded_message

-- ---- Unique keys -------------------------------------------------------------------------
--
-- Lock order. Whoever looks for a key's pending job holds the key's advisory lock until
-- commit and, under it, locks the job it finds: an enqueue of the key (the insert
-- trigger), and a requeue that another job of the key may supersede
-- (internal_fold_into_key_holder). A statement that locks a job's row and may then need
-- the row's key therefore takes the key's lock first, or never waits for it:
--   * retry_job takes its lane's and its key's locks before its row's;
--   * the failure batch and the release take the locks of their jobs' keys before the
--     rows' (internal_lock_unique_keys_of);
--   * the reaper, which finds its rows by locking them (SKIP LOCKED), only tries the lock
--     of a stale job's key and leaves the job to a later pass when the key is taken.
-- Otherwise a look-up whose snapshot predates a claim of the key's pending job waits for
-- that job's row (FOR UPDATE locks the row's newest version, running by then, before it
-- finds the row no longer pending), while a requeue of the now running job holds the row
-- and waits for the key: a deadlock (found by the model test, seed 12).
--
-- The other way out, a look-up that does not wait for rows a newer snapshot shows are no
-- longer pending, is not simpler: the newer snapshot is old again by the time the look-up
-- waits (the claim can commit in between), so it would have to poll with NOWAIT; and SKIP
-- LOCKED alone passes over a job that stays pending (held for a moment by a lane step, or
-- by a claim that rolls back), so the enqueue would insert a second pending job of the key.

-- The advisory lock id of a unique key.
CREATE OR REPLACE FUNCTION skiplock.internal_unique_key_lock_id(key text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('skiplock.unique:' || key, 0);
$$;

-- Takes the advisory locks of the unique keys of these jobs (those that have one) until
-- commit, before a statement that may requeue them locks their rows (the lock order
-- above). In the order of the lock ids, so that two batches with keys in common take
-- turns instead of deadlocking (the ids', not the keys' order: two keys whose ids collide
-- share a lock). Costs a batch without keys one read of each row by primary key. The rows
-- are read unlocked: a unique_key changed by hand in between is locked later, after the
-- row, by internal_fold_into_key_holder, as before. Sequential scans are off, as for
-- internal_complete_claims: the plan is cached per session, and one made while the table
-- was small would scan the whole table once it has grown (tests/plans.rs).
CREATE OR REPLACE FUNCTION skiplock.internal_lock_unique_keys_of(ids bigint[]) RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    lock_id bigint;
BEGIN
    FOR lock_id IN
        SELECT DISTINCT skiplock.internal_unique_key_lock_id(j.unique_key)
        FROM skiplock.jobs_live j
        WHERE j.id = ANY (ids) AND j.unique_key IS NOT NULL
        ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(lock_id);
    END LOOP;
END;
$$;

-- Takes a unique key's advisory lock if it is free (or already this transaction's), for a
-- statement that must not wait for it. COST puts it after the statement's other conditions
-- (Postgres tests the cheaper ones first), so that it is tried only for rows that pass
-- them; another order would hold more keys until commit, and could not deadlock either,
-- since a try never waits.
CREATE OR REPLACE FUNCTION skiplock.internal_try_lock_unique_key(key text) RETURNS boolean
LANGUAGE plpgsql COST 10000 AS $$
BEGIN
    RETURN pg_try_advisory_xact_lock(skiplock.internal_unique_key_lock_id(key));
END;
$$;

CREATE OR REPLACE FUNCTION skiplock.internal_unique_key_holder(key text, self bigint) RETURNS bigint
LANGUAGE plpgsql
SET jit = off
AS $$
DECLARE
    holder bigint;
    holder_state skiplock.job_state;
    holder_queue text;
    holder_priority smallint;
    holder_scheduled_at timestamptz;
    holder_held_for text;
    holder_key text;
    attempts int := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(skiplock.internal_unique_key_lock_id(key));
    -- The holder, locked. First without waiting: a new key (none), or a holder no other
    -- transaction holds (this one's own earlier rows of a bulk enqueue included), takes no
    -- subtransaction.
    SELECT o.id, o.state, o.queue, o.priority, o.scheduled_at, o.held_for, o.concurrency_key
    INTO holder, holder_state, holder_queue, holder_priority, holder_scheduled_at,
         holder_held_for, holder_key
    FROM skiplock.jobs o
    WHERE o.unique_key = key AND o.state IN ('waiting', 'queued') AND o.id <> self
    ORDER BY o.id LIMIT 1
    FOR UPDATE SKIP LOCKED;
    IF holder IS NULL AND EXISTS (
        SELECT 1 FROM skiplock.jobs o
        WHERE o.unique_key = key AND o.state IN ('waiting', 'queued') AND o.id <> self) THEN
        -- Another transaction holds the holder (a claim, a cancel, a retry): wait for it.
        -- If that moved the row to jobs_done (a cancel), Postgres cannot follow it and
        -- raises 40001 where one table would have found the row no longer pending: look
        -- again (skiplock.internal_may_retry_moved).
        LOOP
            BEGIN
                SELECT o.id, o.state, o.queue, o.priority, o.scheduled_at, o.held_for,
                       o.concurrency_key
                INTO holder, holder_state, holder_queue, holder_priority, holder_scheduled_at,
                     holder_held_for, holder_key
                FROM skiplock.jobs o
                WHERE o.unique_key = key AND o.state IN ('waiting', 'queued') AND o.id <> self
                ORDER BY o.id LIMIT 1
                FOR UPDATE;
                EXIT;
            EXCEPTION WHEN serialization_failure THEN
                attempts := attempts + 1;
                IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                    RAISE;
                END IF;
            END;
        END LOOP;
    END IF;
    -- Claims skip the holder while this transaction holds it locked, and so do the releases
    -- of a held one's key.
    IF holder_state = 'queued' THEN
        PERFORM skiplock.internal_announce(ARRAY[ROW(holder_queue, holder_priority,
                                                     holder_scheduled_at)::skiplock.runnable_key]);
    ELSIF holder_held_for IS NOT NULL THEN
        PERFORM skiplock.internal_release_passed_over(holder_queue, holder_key, holder_held_for,
                                                      false);
    END IF;
    RETURN holder;
END;
$$;

-- A job with a unique_key going back to pending (waiting or queued) from anywhere else: a
-- retry after a failure, the reaper, a graceful release, skiplock.retry_job. While it ran
-- (or lay dead) the key was free, and a new job may have taken it. The requeue is then
-- superseded instead of failing on jobs_unique_key_pending_idx (which would fail the whole
-- batch it is part of): the pending job runs instead, with this job's payloads merged in
-- first under the policy `merge` (so none is lost), and the caller ends this job
-- `cancelled` with a last_error naming the pending job. Returns that job's id, or NULL
-- when the key is free (the requeue goes ahead). Holds the key's advisory lock until
-- commit, like an enqueue of the key.
--
-- The requeueing statements call it only for rows that have a unique_key and are about to
-- go back to pending; not a trigger, because a row trigger on UPDATE costs every claim and
-- every completion a second fetch and lock of the row (about 7 % of Postgres CPU per job
-- in the drain benchmark) even when its WHEN clause is false. A plain UPDATE written by
-- hand that requeues into a taken key is refused by jobs_unique_key_pending_idx.
CREATE OR REPLACE FUNCTION skiplock.internal_fold_into_key_holder(job_id bigint) RETURNS bigint
LANGUAGE plpgsql
SET jit = off
AS $$
DECLARE
    job skiplock.jobs%ROWTYPE;
    holder bigint;
    payload jsonb;
    merged jsonb;
BEGIN
    -- Live, or finished (a retry by hand) from its id's day on: see "A job looked up by id"
    -- in 15_partitions.sql.
    SELECT * INTO job FROM skiplock.internal_job_by_id(job_id);
    IF job.unique_key IS NULL THEN
        RETURN NULL;
    END IF;
    holder := skiplock.internal_unique_key_holder(job.unique_key, job_id);
    IF holder IS NOT NULL AND job.unique_policy = 'merge' THEN
        payload := CASE WHEN jsonb_typeof(job.args) = 'array' THEN job.args
                        ELSE jsonb_build_array(job.args) END;
        -- The holder now carries merged payloads: policy merge, so that it is folded in
        -- turn, not superseded, if it is ever requeued into a taken key.
        UPDATE skiplock.jobs SET args = payload || args, unique_policy = 'merge'
        WHERE id = holder AND state IN ('waiting', 'queued')
        RETURNING args INTO merged;
        -- The args limit holds here as on an enqueue's merge: over it, the requeue fails
        -- for this job alone (the batches save it by itself, dead with the reason, its
        -- payloads kept in it) and the holder keeps its args.
        IF pg_column_size(merged) > 4096 THEN
            PERFORM skiplock.internal_check_args_size(merged);
        END IF;
    END IF;
    RETURN holder;
END;
$$;

-- The last_error of a requeue superseded by the pending job `holder`.
CREATE OR REPLACE FUNCTION skiplock.internal_superseded_message(holder bigint, key text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT format('superseded: pending job %s holds unique_key %s and runs instead', holder, key);
$$;
