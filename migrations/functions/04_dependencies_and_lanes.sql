-- migrations/functions/04_dependencies_and_lanes.sql: Dependencies and lanes: queuing
-- waiting jobs when their parents or their turn come, the periodic sweep (in 08),
-- tombstones of deleted parents (left by the delete trigger, 15_partitions.sql), and the
-- trigger on new edges.
--
-- Defines:
--   internal_tombstone_now, internal_has_unmet_parent, internal_announce_queued_by_others
--   internal_queue_ready_dependants, internal_settle_dependants, internal_advance_lanes
--   internal_lane_lock_id, internal_parents_with_dependants
--   internal_tombstone_parents
--   internal_job_dependencies_after_insert, trigger job_dependencies_after_insert

-- ---- Dependencies and lanes --------------------------------------------------------------

-- The tombstone on a job's edge to a parent, read in a snapshot of its own (a volatile
-- function's statement takes one): for a caller whose snapshot is older than its lookup of
-- the parent. A delete of the parent writes the tombstone in its own transaction, so a
-- parent the lookup no longer finds has its tombstone here, if it had to leave one. NULL
-- when the edge is gone or carries none.
CREATE OR REPLACE FUNCTION skiplock.internal_tombstone_now(job bigint, parent bigint)
RETURNS skiplock.job_state
LANGUAGE sql VOLATILE
SET jit = off
AS $$
    SELECT d.parent_state FROM skiplock.job_dependencies d
    WHERE d.job_id = job AND d.parent_id = parent;
$$;

-- Whether a job still has a parent that has not succeeded: a parent row in any other state,
-- or a tombstone. An edge whose parent row is gone with parent_state NULL is satisfied, and
-- so is an edge to a parent the caller knows succeeded (succeeded: the parents whose
-- dependants it is settling), with no lookup. A parent that has not finished is found in
-- jobs_live alone, all the edges in one statement; only the other edges look a parent up
-- where it went (internal_job_state: from its id's day on, see "A job looked up by id" in
-- 15_partitions.sql), and a parent that went back to a live state meanwhile is found there
-- too. The edges are read in the caller's snapshot, each lookup in a newer one: a parent
-- found nowhere is looked for on its edge once more (internal_tombstone_now), as its delete
-- may have committed between the two, tombstone and all. PL/pgSQL, planned once per
-- session: as a SQL function it was never inlined (its body holds a subquery) and was
-- planned over every table of skiplock.jobs at each call, once per dependant.
CREATE OR REPLACE FUNCTION skiplock.internal_has_unmet_parent(job bigint,
                                                              succeeded bigint[] DEFAULT '{}')
RETURNS boolean
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM skiplock.job_dependencies d
                   WHERE d.job_id = job AND d.parent_id <> ALL (succeeded)) THEN
        RETURN false;
    END IF;
    IF EXISTS (SELECT 1 FROM skiplock.job_dependencies d
               JOIN skiplock.jobs_live p ON p.id = d.parent_id
               WHERE d.job_id = job AND d.parent_id <> ALL (succeeded)) THEN
        RETURN true;
    END IF;
    -- A parent row in a state other than succeeded, or none (deleted) with a tombstone.
    RETURN EXISTS (
        SELECT 1 FROM skiplock.job_dependencies d
        CROSS JOIN LATERAL (SELECT skiplock.internal_job_state(d.parent_id) AS state
                            OFFSET 0) p
        WHERE d.job_id = job AND d.parent_id <> ALL (succeeded)
          AND p.state IS DISTINCT FROM 'succeeded'
          AND (p.state IS NOT NULL OR d.parent_state IS NOT NULL
               OR skiplock.internal_tombstone_now(d.job_id, d.parent_id) IS NOT NULL)
    );
END;
$$;

-- Jobs this transaction saw waiting and did not queue itself, announced if they are queued
-- now: another transaction queued them while this one's UPDATE waited for its row lock.
-- Postgres re-checks such a row in its newest version after locking it, and keeps the lock
-- until commit even when the UPDATE then leaves the row alone (the row is no longer
-- waiting). Claims pass over a locked row, and the other transaction's announcement may
-- have been acted on meanwhile: the job would wait for a walk from the start of its queue
-- (seen in tests/claim_cursor.rs, a child queued by its parent's completion and re-checked
-- by the periodic sweep of waiting jobs). Announced again here, the jobs are looked at once
-- this transaction commits and the lock is gone. Called by the statements that queue
-- waiting jobs other transactions may queue too (dependants, lane heads), only when they
-- queued fewer than they saw waiting; a job queued before it was seen is announced twice,
-- which costs a walk and nothing else.
CREATE OR REPLACE FUNCTION skiplock.internal_announce_queued_by_others(ids bigint[]) RETURNS void
LANGUAGE sql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
    -- One probe by id per job, the state compared outside it (see
    -- internal_queue_ready_dependants).
    SELECT skiplock.internal_announce(ARRAY(
        SELECT ROW(j.queue, j.priority, j.scheduled_at)::skiplock.runnable_key
        FROM unnest(ids) AS i(id)
        CROSS JOIN LATERAL (SELECT c.queue, c.priority, c.scheduled_at, c.state
                            FROM skiplock.jobs_live c WHERE c.id = i.id LIMIT 1) j
        WHERE j.state = 'queued'));
$$;

-- Of the given jobs, those that wait on dependencies that have all succeeded become
-- queued, announced; returns how many (promoted). succeeded: parents the caller knows
-- succeeded (internal_has_unmet_parent looks none of them up). By id: its cost follows the list. A
-- waiting lane job (given parents by plain SQL: skiplock.enqueue refuses both) is left to
-- its lane's step, which queues it in its lane's turn once its parents have succeeded:
-- their lanes are returned (lanes) for the caller's one step of all its lanes
-- (internal_settle_dependants, the edge trigger; the sweep steps every waiting lane job's
-- lane).
CREATE OR REPLACE FUNCTION skiplock.internal_queue_ready_dependants(ids bigint[],
                                                                    succeeded bigint[],
                                                                    OUT promoted int,
                                                                    OUT lanes text[])
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    seen_waiting bigint[];
    promoted_ids bigint[];
    promoted_keys skiplock.runnable_key[];
BEGIN
    -- One probe by id per job: the state is compared outside the probe (LIMIT 1 keeps it
    -- from being flattened), so no plan can walk the waiting jobs' index instead.
    SELECT coalesce(array_agg(w.id) FILTER (WHERE w.ordering_key IS NULL), '{}'),
           coalesce(array_agg(DISTINCT w.ordering_key) FILTER (WHERE w.ordering_key IS NOT NULL), '{}')
    INTO seen_waiting, lanes
    FROM unnest(ids) AS i(id)
    CROSS JOIN LATERAL (SELECT c.id, c.state, c.ordering_key FROM skiplock.jobs_live c
                        WHERE c.id = i.id LIMIT 1) w
    WHERE w.state = 'waiting';
    promoted := 0;
    IF cardinality(seen_waiting) = 0 THEN
        RETURN;
    END IF;
    WITH ready AS (
        UPDATE skiplock.jobs c
        SET state = 'queued', held_for = NULL
        WHERE c.id = ANY (seen_waiting) AND c.state = 'waiting' AND c.ordering_key IS NULL
          AND EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.job_id = c.id)
          AND NOT skiplock.internal_has_unmet_parent(c.id, succeeded)
        RETURNING c.id, c.queue, c.priority, c.scheduled_at
    )
    SELECT count(*), array_agg(id),
           array_agg(DISTINCT ROW(queue, priority, scheduled_at)::skiplock.runnable_key)
    INTO promoted, promoted_ids, promoted_keys FROM ready;
    IF promoted < cardinality(seen_waiting) THEN
        PERFORM skiplock.internal_announce_queued_by_others(ARRAY(
            SELECT unnest(seen_waiting) EXCEPT SELECT unnest(promoted_ids)));
    END IF;
    PERFORM skiplock.internal_announce(promoted_keys);
END;
$$;

-- The waiting dependants of jobs that finished (or were deleted): those with a parent that
-- can never succeed are cancelled, transitively, with the reason; those whose parents all
-- succeeded become queued, announced. Then one lane step (internal_advance_lanes) for the
-- given lanes (the finished jobs' own), the lanes of the waiting lane jobs among the
-- dependants and those of the jobs it cancelled: one call, so that it never waits for one
-- lane's lock while holding another's (two calls did, and closed a cycle with an enqueue
-- into both lanes). With wait false, only the lanes whose locks are free now (the sweep,
-- which never waits for an application's transaction; the next lap takes the others).
--
-- Costs the edges of the given parents and of the cancelled jobs, whatever the statistics
-- say: every step is driven by the parents' edges (job_dependencies_parent_idx) and finds
-- jobs by id, never joined where the planner could choose to walk the waiting jobs first
-- (it did, told by statistics taken before a burst of dependants that one job waits).
CREATE OR REPLACE FUNCTION skiplock.internal_settle_dependants(parent_ids bigint[],
                                                               lanes text[] DEFAULT '{}',
                                                               wait boolean DEFAULT true)
RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    promoted int := 0;
    cancelled int := 0;
    victim record;
    lane text;
    steps text[] := coalesce(lanes, '{}');
    ended_ids bigint[];
    ended_states skiplock.job_state[];
    succeeded_ids bigint[];
BEGIN
    -- Parents without dependants (most jobs) settle nothing: the statements below, which
    -- look parents up among the finished jobs, are not even started.
    IF NOT EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = ANY (parent_ids))
    THEN
        promoted := 0;
    ELSE
        -- Each parent with dependants looked up once, where its row is (internal_job_state:
        -- from its id's day on, not every day kept; see "A job looked up by id" in
        -- 15_partitions.sql).
        SELECT coalesce(array_agg(p.id) FILTER (WHERE p.state IN ('dead', 'cancelled')), '{}'),
               coalesce(array_agg(p.state) FILTER (WHERE p.state IN ('dead', 'cancelled')), '{}'),
               coalesce(array_agg(p.id) FILTER (WHERE p.state = 'succeeded'), '{}')
        INTO ended_ids, ended_states, succeeded_ids
        FROM (SELECT i.id, skiplock.internal_job_state(i.id) AS state
              FROM unnest(parent_ids) AS i(id)
              WHERE EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = i.id)
              OFFSET 0) p;
        FOR victim IN
            -- Each lookup is a LATERAL subquery with LIMIT (or OFFSET 0), which the planner
            -- neither flattens nor reorders: the edges of the parents drive, the jobs are
            -- found by id. A tombstone's parent is looked up only on the edges that carry one.
            WITH RECURSIVE doomed (id, reason) AS (
                (SELECT e.job_id, format('parent job %s ended %s', b.id, b.state)
                 FROM unnest(ended_ids, ended_states) AS b(id, state)
                 CROSS JOIN LATERAL (SELECT d.job_id FROM skiplock.job_dependencies d
                                     WHERE d.parent_id = b.id OFFSET 0) e
                 CROSS JOIN LATERAL (SELECT FROM skiplock.jobs_live c
                                     WHERE c.id = e.job_id AND c.state = 'waiting' LIMIT 1) c
                 UNION
                 SELECT e.job_id,
                        format('parent job %s was deleted while %s', e.parent_id, e.parent_state)
                 FROM skiplock.job_dependencies e
                 CROSS JOIN LATERAL (SELECT FROM skiplock.jobs_live c
                                     WHERE c.id = e.job_id AND c.state = 'waiting' LIMIT 1) c
                 WHERE e.parent_id = ANY (parent_ids) AND e.parent_state IS NOT NULL
                   AND skiplock.internal_job_state(e.parent_id) IS NULL)
                UNION
                SELECT e.job_id, format('parent job %s was cancelled', doomed.id)
                FROM doomed
                CROSS JOIN LATERAL (SELECT d.job_id FROM skiplock.job_dependencies d
                                    WHERE d.parent_id = doomed.id OFFSET 0) e
                CROSS JOIN LATERAL (SELECT FROM skiplock.jobs_live c
                                    WHERE c.id = e.job_id AND c.state = 'waiting' LIMIT 1) c
            )
            SELECT DISTINCT ON (d.id) d.id, d.reason FROM doomed d ORDER BY d.id, d.reason
        LOOP
            -- One row at a time, by id (cancellations are rare; a join of the list with the
            -- table is what the planner can turn into a walk of every waiting job).
            lane := NULL;
            UPDATE skiplock.jobs j
            SET state = 'cancelled', finished_at = now(), held_for = NULL, last_error = victim.reason
            WHERE j.id = victim.id AND j.state = 'waiting'
            RETURNING j.ordering_key INTO lane;
            IF FOUND THEN
                cancelled := cancelled + 1;
                IF lane IS NOT NULL THEN
                    -- A lane's head cancelled: the job behind it gets the turn.
                    steps := steps || lane;
                END IF;
            END IF;
        END LOOP;

        -- Waiting lane jobs among the dependants: their lane's step queues each in its turn.
        -- The parents that succeeded, looked up above, spare each dependant a lookup of its
        -- edge to them.
        SELECT r.promoted, steps || r.lanes INTO promoted, steps
        FROM skiplock.internal_queue_ready_dependants(
            ARRAY(SELECT DISTINCT d.job_id FROM skiplock.job_dependencies d
                  WHERE d.parent_id = ANY (parent_ids)),
            succeeded_ids) r;
    END IF;
    IF NOT wait THEN
        steps := ARRAY(SELECT DISTINCT k FROM unnest(steps) AS k
                       WHERE pg_try_advisory_xact_lock(skiplock.internal_lane_lock_id(k)));
    END IF;
    IF cardinality(steps) > 0 THEN
        promoted := promoted + skiplock.internal_advance_lanes(steps);
    END IF;
    RETURN promoted + cancelled;
END;
$$;

-- The next job of each lane: a lane's head (its unfinished job with the lowest id) gets the
-- lane's turn, queued, when it waits, no job of the lane has the turn (queued or running,
-- jobs_lane_turn_idx) and it has no unmet parent; every queued head is announced, promoted
-- now or queued before, or when it comes due. The only writer that gives a lane's turn
-- to a job already in the lane (the insert trigger gives it to a job of an empty lane,
-- retry_job calls this).
--
-- Costs one entry of jobs_ordering_key_lane_idx per lane, however long the lane and
-- whatever the statistics say: each head is found by its own LIMIT 1 in the lane index's
-- order, and the plan is pinned to index lookups and nested loops. Left to the planner,
-- statistics taken before a burst of lane jobs (the usual state of a table of retained
-- finished jobs) gave a plan that read the whole lane once per waiting job: 2.3 s per step
-- of a 3,000-job lane beside 100,000 finished rows, 1 ms after (docs/benchmarks.md,
-- "Statements under stale statistics").
--
-- Each lane's lock (internal_lane_lock_id) first, held until commit: an
-- enqueue into the lane holds it from its insert trigger to its commit, so a lane job
-- enqueued in a transaction still open when its lane's last job finished is waited for,
-- and seen by the reads below (each takes a new snapshot in READ COMMITTED, after the
-- wait); an enqueue that comes after waits for this step and sees the job finished. The
-- wait lasts as long as that transaction (the enqueue's side is in internal_jobs_before_insert).
CREATE OR REPLACE FUNCTION skiplock.internal_advance_lanes(keys text[]) RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    promoted int;
    waiting_heads bigint[];
    promoted_heads bigint[];
    runnable skiplock.runnable_key[];
    lanes text[] := ARRAY(SELECT DISTINCT k FROM unnest(keys) AS k WHERE k IS NOT NULL ORDER BY 1);
    lane text;
    busy text;
BEGIN
    -- Every lane's lock, never waiting while holding one: a transaction that enqueues into
    -- several lanes takes their locks in its own order, so waiting for one lock while
    -- holding another could close a cycle with it (a deadlock, one side rolled back). All
    -- are tried; when one is held elsewhere, those taken go with the subtransaction, this
    -- waits for that one alone (and lets it go), and tries again. Usually no lock is
    -- held elsewhere: one pass, one subtransaction that commits (no xid: advisory locks
    -- need none).
    LOOP
        busy := NULL;
        BEGIN
            FOREACH lane IN ARRAY lanes LOOP
                IF NOT pg_try_advisory_xact_lock(skiplock.internal_lane_lock_id(lane)) THEN
                    busy := lane;
                    RAISE SQLSTATE 'SKL02';
                END IF;
            END LOOP;
        EXCEPTION WHEN SQLSTATE 'SKL02' THEN
            NULL;
        END;
        EXIT WHEN busy IS NULL;
        BEGIN
            PERFORM pg_advisory_xact_lock(skiplock.internal_lane_lock_id(busy));
            RAISE SQLSTATE 'SKL02';
        EXCEPTION WHEN SQLSTATE 'SKL02' THEN
            NULL;
        END;
    END LOOP;
    SELECT array_agg(h.id) FILTER (WHERE h.state = 'waiting'),
           coalesce(array_agg(ROW(h.queue, h.priority, h.scheduled_at)::skiplock.runnable_key)
                        FILTER (WHERE h.state = 'queued'), '{}')
    INTO waiting_heads, runnable
    FROM (SELECT DISTINCT k FROM unnest(keys) AS k WHERE k IS NOT NULL) AS lane(key)
    CROSS JOIN LATERAL (
        SELECT j.id, j.state, j.queue, j.priority, j.scheduled_at
        FROM skiplock.jobs j
        WHERE j.ordering_key = lane.key AND j.state IN ('waiting', 'queued', 'running')
        ORDER BY j.id
        LIMIT 1
    ) h;
    -- By id, not joined with the heads: a join let the planner, told by stale statistics
    -- that one job waits, walk every waiting job and test each.
    WITH ready AS (
        UPDATE skiplock.jobs j SET state = 'queued', held_for = NULL
        WHERE j.id = ANY (waiting_heads) AND j.state = 'waiting'
          AND NOT EXISTS (
              -- The lane's turn is not taken (jobs_lane_turn_idx): by a job retried by
              -- hand behind the head, say, which keeps its turn until it ends.
              SELECT 1 FROM skiplock.jobs_live o
              WHERE o.ordering_key = j.ordering_key AND o.state IN ('queued', 'running')
          )
          AND NOT skiplock.internal_has_unmet_parent(j.id)
        RETURNING j.id, j.queue, j.priority, j.scheduled_at
    )
    SELECT count(*), array_agg(id),
           runnable || coalesce(array_agg(ROW(queue, priority, scheduled_at)::skiplock.runnable_key), '{}')
    INTO promoted, promoted_heads, runnable
    FROM ready;
    IF promoted < coalesce(cardinality(waiting_heads), 0) THEN
        PERFORM skiplock.internal_announce_queued_by_others(ARRAY(
            SELECT unnest(waiting_heads) EXCEPT SELECT unnest(promoted_heads)));
    END IF;
    PERFORM skiplock.internal_announce(runnable);
    RETURN promoted;
END;
$$;

-- The transaction-scoped advisory lock of an ordering lane, taken by whatever decides
-- whether a lane job waits (the insert trigger, retry_job) and by whatever moves a lane on
-- (internal_advance_lanes), so that one waits for the other's commit.
CREATE OR REPLACE FUNCTION skiplock.internal_lane_lock_id(lane text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('skiplock.lane:' || lane, 0);
$$;

-- Of the given jobs, those with a row in job_dependencies as a parent, read with a snapshot
-- of its own: VOLATILE, so in READ COMMITTED it sees the edges committed while the
-- statement that calls it waited for a row lock. A completion's UPDATE waits for the FOR
-- SHARE lock an edge's insert trigger holds on the parent until the child's enqueue
-- commits; read in the UPDATE's own snapshot (taken before that wait), the new edge was
-- missed and the child was left waiting. Called once per statement with the ids of the
-- rows it changed; one probe of job_dependencies_parent_idx per id, as before.
CREATE OR REPLACE FUNCTION skiplock.internal_parents_with_dependants(ids bigint[])
RETURNS bigint[]
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
    SELECT coalesce(array_agg(i.id), '{}')
    FROM unnest(ids) AS i(id)
    WHERE EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = i.id);
$$;

-- Jobs `parents` (with their `states`) are gone without having succeeded (deleted, or
-- their day of history dropped): their edges keep the state as a tombstone (see
-- skiplock.job_dependencies) and their waiting children are cancelled, transitively, with
-- the reason. NULL or empty arrays do nothing.
CREATE OR REPLACE FUNCTION skiplock.internal_tombstone_parents(
    parents bigint[], states skiplock.job_state[])
RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    children bigint[] := '{}';
    lanes text[] := '{}';
    lane text;
    victim record;
BEGIN
    IF coalesce(cardinality(parents), 0) = 0 THEN
        RETURN;
    END IF;
    -- Tombstones, then the waiting children to cancel, one at a time by id (a join of the
    -- list with the table is what the planner can turn into a walk of every waiting job).
    FOR victim IN
        WITH unfinished AS MATERIALIZED (
            SELECT u.id, u.state FROM unnest(parents, states) AS u(id, state)
            WHERE u.state <> 'succeeded'
        ), marked AS (
            UPDATE skiplock.job_dependencies d SET parent_state = u.state
            FROM unfinished u
            WHERE d.parent_id = u.id
            RETURNING d.job_id, d.parent_id, u.state
        )
        SELECT DISTINCT ON (m.job_id) m.job_id, m.parent_id, m.state
        FROM marked m ORDER BY m.job_id, m.parent_id
    LOOP
        lane := NULL;
        UPDATE skiplock.jobs c
        SET state = 'cancelled', finished_at = now(), held_for = NULL,
            last_error = format('parent job %s was deleted while %s', victim.parent_id, victim.state)
        WHERE c.id = victim.job_id AND c.state = 'waiting'
        RETURNING c.ordering_key INTO lane;
        IF FOUND THEN
            children := children || victim.job_id;
            IF lane IS NOT NULL THEN
                lanes := lanes || lane;
            END IF;
        END IF;
    END LOOP;
    IF cardinality(children) > 0 THEN
        PERFORM skiplock.internal_settle_dependants(children, lanes);
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION skiplock.internal_job_dependencies_after_insert() RETURNS trigger
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    parent_now skiplock.job_state;
    parent_queue text;
    parent_priority smallint;
    parent_scheduled_at timestamptz;
    parent_held_for text;
    parent_key text;
    child_queue text;
    child_priority smallint;
    child_scheduled_at timestamptz;
    child_now skiplock.job_state;
    child_lane text;
    child_lanes text[];
    attempts int := 0;
BEGIN
    IF NEW.parent_state IS NOT NULL THEN
        RAISE EXCEPTION 'job_dependencies.parent_state is written by skiplock when a parent is deleted; insert the edge with parent_state NULL'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Both rows locked; a row moved to the other partition while the lock waited (a parent
    -- completed, a child cancelled) is read again where it went (40001, see
    -- skiplock.internal_may_retry_moved).
    LOOP
        BEGIN
            -- In jobs_live first, in the finished jobs only when it is not there (see "A job
            -- looked up by id" in 15_partitions.sql).
            SELECT state, queue, priority, scheduled_at, held_for, concurrency_key
            INTO parent_now, parent_queue, parent_priority, parent_scheduled_at,
                 parent_held_for, parent_key
            FROM skiplock.jobs_live WHERE id = NEW.parent_id FOR SHARE;
            IF NOT FOUND THEN
                SELECT f.state, f.queue, f.priority, f.scheduled_at
                INTO parent_now, parent_queue, parent_priority, parent_scheduled_at
                FROM skiplock.internal_finished_job(NEW.parent_id, 'FOR SHARE') f;
            END IF;
            -- Claims skip the parent while this transaction holds it locked, and so do the
            -- releases of a held one's key.
            IF parent_now = 'queued' THEN
                PERFORM skiplock.internal_announce(ARRAY[ROW(parent_queue, parent_priority,
                                                             parent_scheduled_at)::skiplock.runnable_key]);
            ELSIF parent_held_for IS NOT NULL THEN
                PERFORM skiplock.internal_release_passed_over(parent_queue, parent_key,
                                                              parent_held_for, false);
            END IF;
            IF parent_now IS NULL THEN
                RAISE EXCEPTION 'parent job % does not exist', NEW.parent_id
                    USING ERRCODE = 'foreign_key_violation';
            END IF;
            SELECT state, queue, priority, scheduled_at, ordering_key
            INTO child_now, child_queue, child_priority, child_scheduled_at, child_lane
            FROM skiplock.jobs_live WHERE id = NEW.job_id FOR UPDATE;
            IF NOT FOUND THEN
                SELECT f.state, f.queue, f.priority, f.scheduled_at, f.ordering_key
                INTO child_now, child_queue, child_priority, child_scheduled_at, child_lane
                FROM skiplock.internal_finished_job(NEW.job_id, 'FOR UPDATE') f;
            END IF;
            EXIT;
        EXCEPTION WHEN serialization_failure THEN
            attempts := attempts + 1;
            IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                RAISE;
            END IF;
        END;
    END LOOP;
    IF child_now IS NULL THEN
        RAISE EXCEPTION 'job % does not exist', NEW.job_id
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    IF parent_now = 'succeeded' THEN
        IF child_now = 'waiting' THEN
            -- Written waiting while the parent ran (skiplock.enqueue looked before this
            -- lock), and the parent succeeded since: its completion could not see this
            -- edge, so the child is queued here once no other parent keeps it (the last
            -- edge's trigger to find its parent done decides; a parent still unfinished is
            -- locked by its own edge's trigger, and its completion sees the edge).
            SELECT r.lanes INTO child_lanes
            FROM skiplock.internal_queue_ready_dependants(ARRAY[NEW.job_id],
                                                          ARRAY[NEW.parent_id]) r;
            IF cardinality(child_lanes) > 0 THEN
                -- In its lane's turn (see internal_queue_ready_dependants).
                PERFORM skiplock.internal_advance_lanes(child_lanes);
            END IF;
        ELSIF child_now = 'queued' THEN
            -- The child stays as it was; claims skipped it while it was locked.
            PERFORM skiplock.internal_announce(ARRAY[ROW(child_queue, child_priority,
                                                         child_scheduled_at)::skiplock.runnable_key]);
        END IF;
        RETURN NULL;
    END IF;
    IF child_now IN ('running', 'succeeded', 'dead') THEN
        RAISE EXCEPTION 'job % already started; a dependency on job % must be added before it runs',
            NEW.job_id, NEW.parent_id
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF child_now IN ('queued', 'waiting') AND parent_now IN ('dead', 'cancelled') THEN
        -- A waiting child too: its parent ended while the enqueue was under way.
        UPDATE skiplock.jobs
        SET state = 'cancelled', finished_at = now(), held_for = NULL,
            last_error = format('parent job %s ended %s', NEW.parent_id, parent_now)
        WHERE id = NEW.job_id AND state IN ('waiting', 'queued');
        IF child_lane IS NOT NULL THEN
            -- The job behind it in its lane gets the turn.
            PERFORM skiplock.internal_advance_lanes(ARRAY[child_lane]);
        END IF;
    ELSIF child_now = 'queued' THEN
        UPDATE skiplock.jobs SET state = 'waiting' WHERE id = NEW.job_id AND state = 'queued';
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER job_dependencies_after_insert
    AFTER INSERT ON skiplock.job_dependencies
    FOR EACH ROW EXECUTE FUNCTION skiplock.internal_job_dependencies_after_insert();
