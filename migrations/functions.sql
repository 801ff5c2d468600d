-- ---- Backoff, errors and the args limit --------------------------------------------------

-- Default retry delay, shared by the reaper and documented beside the Rust policy
-- (src/retry.rs): min(2^attempt, 3600) seconds, times a random factor in [0.75, 1.25).
CREATE OR REPLACE FUNCTION skiplock.backoff(attempt int) RETURNS interval
LANGUAGE sql VOLATILE AS $$
    SELECT make_interval(secs => least(power(2, least(attempt, 30)), 3600) * (0.75 + random() * 0.5));
$$;

-- Append a failure to a job's error list, keeping the most recent 20.
CREATE OR REPLACE FUNCTION skiplock.internal_append_error(errors jsonb, attempt int, message text) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(jsonb_agg(e ORDER BY n), '[]'::jsonb)
    FROM (
        SELECT e, n
        FROM jsonb_array_elements(
            errors || jsonb_build_array(jsonb_build_object(
                'attempt', attempt, 'at', now(), 'message', message))
        ) WITH ORDINALITY AS t(e, n)
        ORDER BY n DESC
        LIMIT 20
    ) recent;
$$;

CREATE OR REPLACE FUNCTION skiplock.internal_error_time(entry jsonb) RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    at text := CASE WHEN jsonb_typeof(entry) = 'object' THEN entry ->> 'at' END;
    t timestamptz;
BEGIN
    IF at IS NULL THEN
        RETURN NULL;
    END IF;
    BEGIN
        t := at::timestamptz;
    EXCEPTION WHEN data_exception THEN
        -- invalid_datetime_format, datetime_field_overflow and the rest of class 22.
        RETURN NULL;
    END;
    RETURN CASE WHEN isfinite(t) THEN t END;
END;
$$;
COMMENT ON FUNCTION skiplock.internal_error_time(jsonb) IS
    'The time (`at`) of an entry of skiplock.jobs.errors, or NULL when it has no valid, finite one: statements over many rows read it with this so that one entry written by hand cannot fail them.';

-- The largest args accepted on every path, in bytes of the jsonb text (octet_length of
-- args::text). 1 MiB unless the setting skiplock.args_max_bytes says otherwise
-- (ALTER DATABASE … SET skiplock.args_max_bytes = 4194304). The Rust API checks its own
-- limit (SKIPLOCK_ARGS_MAX_BYTES) before sending, on compact JSON.
CREATE OR REPLACE FUNCTION skiplock.args_max_bytes() RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT coalesce(nullif(current_setting('skiplock.args_max_bytes', true), '')::bigint, 1048576);
$$;

CREATE OR REPLACE FUNCTION skiplock.internal_check_args_size(args jsonb) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    size bigint := octet_length(args::text);
    limit_bytes bigint := skiplock.args_max_bytes();
BEGIN
    IF size > limit_bytes THEN
        RAISE EXCEPTION 'args are % bytes, over the limit of % bytes', size, limit_bytes
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'store large data elsewhere and pass a reference, or raise the setting skiplock.args_max_bytes';
    END IF;
END;
$$;

-- `args`, once checked against the limit: for an expression that makes args (the merge
-- of an enqueue's ON CONFLICT DO UPDATE, which no insert trigger sees).
CREATE OR REPLACE FUNCTION skiplock.internal_args_within_limit(args jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
BEGIN
    IF pg_column_size(args) > 4096 THEN
        PERFORM skiplock.internal_check_args_size(args);
    END IF;
    RETURN args;
END;
$$;

-- The next job id, for a row inserted into skiplock.jobs_live directly (the partition's
-- default; skiplock.enqueue_job inserts there): the identity's sequence, as an insert into
-- skiplock.jobs draws it, and as its owner, so that an enqueuer needs no privilege on the
-- sequence (an insert into skiplock.jobs needs none either).
CREATE OR REPLACE FUNCTION skiplock.internal_next_job_id() RETURNS bigint
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT nextval(pg_get_serial_sequence('skiplock.jobs', 'id'));
$$;

ALTER TABLE skiplock.jobs_live ALTER COLUMN id SET DEFAULT skiplock.internal_next_job_id();

-- ---- Notifications -----------------------------------------------------------------------

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
LANGUAGE sql AS $$
    SELECT pg_notify('skiplock_due_later', skiplock.internal_due_later_payload(queue, priority,
               first_at, least(last_at, clock_timestamp() + interval '1 day')))
    WHERE first_at > now() AND first_at <= clock_timestamp() + interval '1 day';
$$;

-- Notifies where a job (or jobs from this key on) became runnable, if it is due.
CREATE OR REPLACE FUNCTION skiplock.internal_notify_runnable(queue text, priority smallint,
                                         scheduled_at timestamptz) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_notify('skiplock_runnable', skiplock.internal_runnable_payload(queue, priority, scheduled_at))
    WHERE scheduled_at <= now();
$$;
COMMENT ON FUNCTION skiplock.internal_notify_runnable(text, smallint, timestamptz) IS
    'Tells workers that jobs of this queue became runnable from this priority and time on '
    '(at commit, if due): call it after requeuing jobs with a plain UPDATE.';

-- Tells workers to look at a queue from its start (at commit): the form of
-- skiplock_runnable for "what may be claimed changed", not "these jobs became runnable": a
-- queue resumed or given room by a changed limit, a slot of a queue with max_running freed.
CREATE OR REPLACE FUNCTION skiplock.internal_notify_queue_start(queue text) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_notify('skiplock_runnable', E'-\t-\t' || queue);
$$;

-- Running jobs of these queues ended (succeeded, failed, released, reaped, cancelled): the
-- queues among them that have max_running are looked at from the start, where the jobs
-- the limit held back wait, so a freed slot is taken at the next claim of any worker and
-- not at its next poll. Every statement that ends claims calls it with their queues; a job
-- ended by a hand-written UPDATE is noticed at the workers' next poll. One probe of
-- skiplock.queues per queue for queues without the limit.
CREATE OR REPLACE FUNCTION skiplock.internal_notify_freed(queues text[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF cardinality(queues) > 0 THEN
        PERFORM skiplock.internal_notify_queue_start(q.name)
        FROM skiplock.queues q
        WHERE q.name = ANY (queues) AND q.max_running IS NOT NULL;
    END IF;
END;
$$;

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
LANGUAGE plpgsql AS $$
DECLARE
    holder bigint;
    holder_state skiplock.job_state;
    holder_queue text;
    holder_priority smallint;
    holder_scheduled_at timestamptz;
    attempts int := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(skiplock.internal_unique_key_lock_id(key));
    -- The holder, locked. First without waiting: a new key (none), or a holder no other
    -- transaction holds (this one's own earlier rows of a bulk enqueue included), takes no
    -- subtransaction.
    SELECT o.id, o.state, o.queue, o.priority, o.scheduled_at
    INTO holder, holder_state, holder_queue, holder_priority, holder_scheduled_at
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
                SELECT o.id, o.state, o.queue, o.priority, o.scheduled_at
                INTO holder, holder_state, holder_queue, holder_priority, holder_scheduled_at
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
    -- Claims skip the holder while this transaction holds it locked.
    IF holder_state = 'queued' THEN
        PERFORM skiplock.internal_notify_runnable(holder_queue, holder_priority, holder_scheduled_at);
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
LANGUAGE plpgsql AS $$
DECLARE
    job skiplock.jobs%ROWTYPE;
    holder bigint;
    payload jsonb;
    merged jsonb;
BEGIN
    SELECT * INTO job FROM skiplock.jobs WHERE id = job_id;
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

-- ---- Dependencies and lanes --------------------------------------------------------------

-- Whether a job still has a parent that has not succeeded: a parent row in any other state,
-- or a tombstone. An edge whose parent row is gone with parent_state NULL is satisfied.
-- Simple enough for the planner to inline into the statements that call it.
CREATE OR REPLACE FUNCTION skiplock.internal_has_unmet_parent(job bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM skiplock.job_dependencies d
        LEFT JOIN skiplock.jobs p ON p.id = d.parent_id
        WHERE d.job_id = job
          AND p.state IS DISTINCT FROM 'succeeded'
          AND (p.id IS NOT NULL OR d.parent_state IS NOT NULL)
    );
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
    SELECT skiplock.internal_notify_runnable(j.queue, j.priority, min(j.scheduled_at)),
           skiplock.internal_notify_due_later(j.queue, j.priority,
               min(j.scheduled_at) FILTER (WHERE j.scheduled_at > now()), max(j.scheduled_at))
    FROM skiplock.jobs j
    WHERE j.id = ANY (ids) AND j.state = 'queued'
    GROUP BY j.queue, j.priority;
$$;

-- Of the given jobs, those that wait on dependencies that have all succeeded become
-- queued, announced; returns how many. By id: its cost follows the list.
CREATE OR REPLACE FUNCTION skiplock.internal_queue_ready_dependants(ids bigint[]) RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    seen_waiting bigint[];
    promoted int;
    promoted_ids bigint[];
    promoted_keys skiplock.runnable_key[];
BEGIN
    seen_waiting := ARRAY(SELECT c.id FROM skiplock.jobs c
                          WHERE c.id = ANY (ids) AND c.state = 'waiting');
    IF cardinality(seen_waiting) = 0 THEN
        RETURN 0;
    END IF;
    WITH ready AS (
        UPDATE skiplock.jobs c
        SET state = 'queued'
        WHERE c.id = ANY (seen_waiting) AND c.state = 'waiting'
          AND EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.job_id = c.id)
          AND NOT skiplock.internal_has_unmet_parent(c.id)
        RETURNING c.id, c.queue, c.priority, c.scheduled_at
    )
    SELECT count(*), array_agg(id),
           array_agg(DISTINCT ROW(queue, priority, scheduled_at)::skiplock.runnable_key)
    INTO promoted, promoted_ids, promoted_keys FROM ready;
    IF promoted < cardinality(seen_waiting) THEN
        PERFORM skiplock.internal_announce_queued_by_others(ARRAY(
            SELECT unnest(seen_waiting) EXCEPT SELECT unnest(promoted_ids)));
    END IF;
    -- The lowest key per queue and priority: one message, not one per job (and one for
    -- the jobs not due yet).
    PERFORM skiplock.internal_notify_runnable(k.queue, k.priority, min(k.scheduled_at)),
            skiplock.internal_notify_due_later(k.queue, k.priority,
                min(k.scheduled_at) FILTER (WHERE k.scheduled_at > now()), max(k.scheduled_at))
    FROM unnest(promoted_keys) AS k
    GROUP BY k.queue, k.priority;
    RETURN promoted;
END;
$$;

-- The waiting dependants of jobs that finished (or were deleted): those with a parent that
-- can never succeed are cancelled, transitively, with the reason; those whose parents all
-- succeeded become queued, announced.
--
-- Costs the edges of the given parents and of the cancelled jobs, whatever the statistics
-- say: every step is driven by the parents' edges (job_dependencies_parent_idx) and finds
-- jobs by id, never joined where the planner could choose to walk the waiting jobs first
-- (it did, told by statistics taken before a burst of dependants that one job waits).
CREATE OR REPLACE FUNCTION skiplock.internal_settle_dependants(parent_ids bigint[]) RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    promoted int := 0;
    cancelled int := 0;
    victim record;
BEGIN
    FOR victim IN
        -- Each lookup is a LATERAL subquery with LIMIT (or OFFSET 0), which the planner
        -- neither flattens nor reorders: the edges of the parents drive, the jobs are
        -- found by id.
        WITH RECURSIVE doomed (id, reason) AS (
            SELECT e.job_id,
                   CASE WHEN p.id IS NULL
                        THEN format('parent job %s was deleted while %s', e.parent_id, e.parent_state)
                        ELSE format('parent job %s ended %s', p.id, p.state) END
            FROM skiplock.job_dependencies e
            LEFT JOIN LATERAL (SELECT p.id, p.state FROM skiplock.jobs p
                               WHERE p.id = e.parent_id LIMIT 1) p ON true
            CROSS JOIN LATERAL (SELECT FROM skiplock.jobs c
                                WHERE c.id = e.job_id AND c.state = 'waiting' LIMIT 1) c
            WHERE e.parent_id = ANY (parent_ids)
              AND (p.state IN ('dead', 'cancelled') OR (p.id IS NULL AND e.parent_state IS NOT NULL))
            UNION
            SELECT e.job_id, format('parent job %s was cancelled', doomed.id)
            FROM doomed
            CROSS JOIN LATERAL (SELECT d.job_id FROM skiplock.job_dependencies d
                                WHERE d.parent_id = doomed.id OFFSET 0) e
            CROSS JOIN LATERAL (SELECT FROM skiplock.jobs c
                                WHERE c.id = e.job_id AND c.state = 'waiting' LIMIT 1) c
        )
        SELECT DISTINCT ON (d.id) d.id, d.reason FROM doomed d ORDER BY d.id, d.reason
    LOOP
        -- One row at a time, by id (cancellations are rare; a join of the list with the
        -- table is what the planner can turn into a walk of every waiting job).
        UPDATE skiplock.jobs j
        SET state = 'cancelled', finished_at = now(), last_error = victim.reason
        WHERE j.id = victim.id AND j.state = 'waiting';
        IF FOUND THEN
            cancelled := cancelled + 1;
        END IF;
    END LOOP;

    promoted := skiplock.internal_queue_ready_dependants(ARRAY(
        SELECT DISTINCT d.job_id FROM skiplock.job_dependencies d
        WHERE d.parent_id = ANY (parent_ids)));
    RETURN promoted + cancelled;
END;
$$;

-- The next job of each lane: a lane's head (its unfinished job with the lowest id) becomes
-- queued when it waits, no job of the lane runs and it has no unmet parent; every queued
-- head is announced, promoted now or queued before (its turn came when the job before it
-- ended; claims skipped it while that job was unfinished), or when it comes due.
--
-- Costs one entry of jobs_ordering_key_lane_idx per lane, however long the lane and
-- whatever the statistics say: each head is found by its own LIMIT 1 in the lane index's
-- order, and the plan is pinned to index lookups and nested loops. Left to the planner,
-- statistics taken before a burst of lane jobs (the usual state of a table of retained
-- finished jobs) gave a plan that read the whole lane once per waiting job: 2.3 s per step
-- of a 3,000-job lane beside 100,000 finished rows, 1 ms after (docs/benchmarks.md,
-- "Statements under stale statistics").
CREATE OR REPLACE FUNCTION skiplock.internal_advance_lanes(keys text[]) RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    promoted int;
    waiting_heads bigint[];
    promoted_heads bigint[];
    runnable skiplock.runnable_key[];
BEGIN
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
        UPDATE skiplock.jobs j SET state = 'queued'
        WHERE j.id = ANY (waiting_heads) AND j.state = 'waiting'
          AND NOT EXISTS (
              SELECT 1 FROM skiplock.jobs o
              WHERE o.ordering_key = j.ordering_key AND o.state = 'running'
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
    -- The lowest key per queue and priority for those due (one message, not one per
    -- lane), and each one due later.
    PERFORM skiplock.internal_notify_runnable(k.queue, k.priority, min(k.scheduled_at))
    FROM unnest(runnable) AS k
    WHERE k.scheduled_at <= now()
    GROUP BY k.queue, k.priority;
    PERFORM skiplock.internal_notify_due_later(k.queue, k.priority, k.scheduled_at, k.scheduled_at)
    FROM unnest(runnable) AS k
    WHERE k.scheduled_at > now();
    RETURN promoted;
END;
$$;

-- ---- Enqueue -----------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION skiplock.enqueue_job(
    kind          text,
    args          jsonb       DEFAULT '{}',
    queue         text        DEFAULT 'default',
    priority      int         DEFAULT 0,
    scheduled_at  timestamptz DEFAULT now(),
    max_attempts  int         DEFAULT 25,
    ordering_key  text        DEFAULT NULL,
    unique_key    text        DEFAULT NULL,
    on_conflict   text        DEFAULT 'skip',
    depends_on    bigint[]    DEFAULT '{}'
) RETURNS TABLE (id bigint, outcome text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    new_id bigint;
    inserted boolean;
    initial skiplock.job_state := 'queued';
    reason text;
    missing bigint;
BEGIN
    IF priority NOT BETWEEN -32768 AND 32767 THEN
        RAISE EXCEPTION 'priority must be between -32768 and 32767 (lower runs first), not %',
            priority USING ERRCODE = 'numeric_value_out_of_range';
    END IF;
    IF unique_key IS NOT NULL AND on_conflict NOT IN ('skip', 'replace', 'merge') THEN
        RAISE EXCEPTION 'on_conflict must be skip, replace or merge, not %', on_conflict
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF unique_key IS NOT NULL AND cardinality(depends_on) > 0 THEN
        RAISE EXCEPTION 'a job cannot have both a unique_key and dependencies'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF ordering_key IS NOT NULL AND cardinality(depends_on) > 0 THEN
        RAISE EXCEPTION 'a job cannot have both an ordering_key and dependencies'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF cardinality(depends_on) > 0 THEN
        SELECT d INTO missing FROM unnest(depends_on) AS d
        WHERE NOT EXISTS (SELECT 1 FROM skiplock.jobs p WHERE p.id = d) LIMIT 1;
        IF missing IS NOT NULL THEN
            RAISE EXCEPTION 'parent job % does not exist', missing
                USING ERRCODE = 'foreign_key_violation';
        END IF;
        SELECT format('parent job %s ended %s', p.id, p.state) INTO reason
        FROM skiplock.jobs p
        WHERE p.id = ANY (depends_on) AND p.state IN ('dead', 'cancelled') LIMIT 1;
        IF reason IS NOT NULL THEN
            initial := 'cancelled';
        ELSIF EXISTS (SELECT 1 FROM skiplock.jobs p
                      WHERE p.id = ANY (depends_on) AND p.state <> 'succeeded') THEN
            initial := 'waiting';
        END IF;
    END IF;
    PERFORM set_config('skiplock.unique_holder', '', true);
    IF initial = 'cancelled' THEN
        -- Finished on arrival: into jobs_done, through the parent. Its args are checked
        -- here, as the insert trigger of jobs_live checks the others'.
        PERFORM skiplock.internal_check_args_size(enqueue_job.args);
        INSERT INTO skiplock.jobs (kind, args, queue, priority, scheduled_at, max_attempts,
                                   ordering_key, unique_key, unique_policy, state,
                                   finished_at, last_error)
        VALUES (enqueue_job.kind, enqueue_job.args, enqueue_job.queue,
                enqueue_job.priority::smallint, enqueue_job.scheduled_at,
                enqueue_job.max_attempts, enqueue_job.ordering_key, enqueue_job.unique_key,
                CASE WHEN enqueue_job.unique_key IS NOT NULL THEN on_conflict END, initial,
                now(), reason)
        RETURNING skiplock.jobs.id, true INTO new_id, inserted;
    ELSE
        -- Into jobs_live itself: ON CONFLICT needs a unique index of the table it names,
        -- and the pending unique keys' index is the live partition's.
        INSERT INTO skiplock.jobs_live AS j (kind, args, queue, priority, scheduled_at,
                                             max_attempts, ordering_key, unique_key,
                                             unique_policy, state)
        VALUES (enqueue_job.kind, enqueue_job.args, enqueue_job.queue,
                enqueue_job.priority::smallint, enqueue_job.scheduled_at,
                enqueue_job.max_attempts, enqueue_job.ordering_key, enqueue_job.unique_key,
                CASE WHEN enqueue_job.unique_key IS NOT NULL THEN on_conflict END, initial)
        ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND state IN ('waiting', 'queued')
        -- Reached when the insert trigger could not see the key's holder (a snapshot
        -- older than it: REPEATABLE READ, where the update then fails to serialize); the
        -- merge is held to the args limit here as the trigger's is.
        DO UPDATE SET args = skiplock.internal_args_within_limit(CASE excluded.unique_policy
            WHEN 'replace' THEN excluded.args
            WHEN 'merge' THEN j.args || excluded.args
            ELSE j.args END),
            unique_policy = CASE WHEN excluded.unique_policy = 'merge' THEN 'merge'
                                 ELSE j.unique_policy END
        RETURNING j.id, j.xmax = 0 INTO new_id, inserted;
    END IF;
    IF new_id IS NULL THEN
        -- The insert trigger applied the key's policy to the pending job instead.
        new_id := nullif(current_setting('skiplock.unique_holder', true), '')::bigint;
    END IF;
    IF cardinality(depends_on) > 0 THEN
        INSERT INTO skiplock.job_dependencies (job_id, parent_id)
        SELECT new_id, d FROM unnest(depends_on) AS d ON CONFLICT DO NOTHING;
    END IF;
    id := new_id;
    -- A new row, or the pending job of the key, folded by the key's policy (through ON
    -- CONFLICT, or by the insert trigger, which leaves no row to return).
    outcome := CASE WHEN inserted THEN 'inserted'
                    WHEN on_conflict = 'replace' THEN 'replaced'
                    WHEN on_conflict = 'merge' THEN 'merged'
                    ELSE 'skipped' END;
    RETURN NEXT;
END;
$$;
COMMENT ON FUNCTION skiplock.enqueue_job(text, jsonb, text, int, timestamptz, int, text, text, text, bigint[]) IS
    'As skiplock.enqueue, and says what it did: the job''s id with inserted, or, for a unique_key already pending, that job''s id with skipped, replaced or merged. Example: SELECT * FROM skiplock.enqueue_job(''send_email'', ''{"to": "a@example.com"}'', unique_key => ''welcome-42'');';

CREATE OR REPLACE FUNCTION skiplock.enqueue(
    kind          text,
    args          jsonb       DEFAULT '{}',
    queue         text        DEFAULT 'default',
    priority      int         DEFAULT 0,
    scheduled_at  timestamptz DEFAULT now(),
    max_attempts  int         DEFAULT 25,
    ordering_key  text        DEFAULT NULL,
    unique_key    text        DEFAULT NULL,
    on_conflict   text        DEFAULT 'skip',
    depends_on    bigint[]    DEFAULT '{}'
) RETURNS bigint
LANGUAGE sql AS $$
    SELECT e.id FROM skiplock.enqueue_job(kind, args, queue, priority, scheduled_at,
                                          max_attempts, ordering_key, unique_key,
                                          on_conflict, depends_on) e;
$$;
COMMENT ON FUNCTION skiplock.enqueue(text, jsonb, text, int, timestamptz, int, text, text, text, bigint[]) IS
    'Enqueues a job from any language and returns its id (or, for a unique_key already pending, that job''s id). Example: SELECT skiplock.enqueue(''send_email'', ''{"to": "a@example.com"}'', priority => -1);';

-- ---- Global limits (skiplock.queues: max_running, rate_limit per rate_period) -----------
--
-- Held by the claim itself (internal_claim_batch), so every claimer obeys them: the Rust
-- worker, `skiplock work`, skiplock.claim. A claim of a limited queue takes the queue's
-- advisory lock until commit, so the claims of one limited queue take turns; then, in
-- statements that see every claim committed before (READ COMMITTED, which such a claim
-- requires), it counts what the queue runs and reads the starts the rate limit keeps, and
-- claims at most what both leave. A killed worker's claims stay running, and so count,
-- until they are reaped. Running jobs past a lowered limit finish; the claims wait until
-- the queue is under it.

-- The advisory lock id under which a limited queue's claims take turns.
CREATE OR REPLACE FUNCTION skiplock.internal_queue_limit_lock_id(queue_name text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('skiplock.queue_limit:' || queue_name, 0);
$$;

-- Makes a queue's ring of start times for `size` starts: the starts it held, oldest
-- first, at its end, and slots whose start is '-infinity' (free: a whole period old)
-- before them. Runs at the first claim after the limit is set above every limit the ring
-- served before (a ring never shrinks: the starts a lowered limit does not need still
-- count if it is raised again within the period), under the queue's lock; its cost
-- follows the limit.
CREATE OR REPLACE FUNCTION skiplock.internal_make_rate_ring(queue_name text, size int)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    kept timestamptz[];
BEGIN
    kept := ARRAY(SELECT k.t FROM (SELECT s.started_at AS t FROM skiplock.queue_rate_starts s
                                   WHERE s.queue = queue_name AND s.started_at > '-infinity'
                                   ORDER BY s.started_at DESC LIMIT size) k
                  ORDER BY k.t);
    DELETE FROM skiplock.queue_rate_starts s WHERE s.queue = queue_name;
    INSERT INTO skiplock.queue_rate_rings AS r (queue, size, next_slot)
    VALUES (queue_name, internal_make_rate_ring.size, 0)
    ON CONFLICT (queue) DO UPDATE SET size = excluded.size, next_slot = 0;
    INSERT INTO skiplock.queue_rate_starts (queue, slot, started_at)
    SELECT queue_name, i,
           coalesce(kept[i - (internal_make_rate_ring.size - cardinality(kept)) + 1], '-infinity')
    FROM generate_series(0, internal_make_rate_ring.size - 1) AS i;
END;
$$;

-- How many jobs of a rate-limited queue may start at `at` (up to `wanted`): a start may
-- go only once the rate_limit-th start before it is more than rate_period old, so no
-- window of rate_period holds more than rate_limit starts (by the times the claims
-- record, each taken under the queue's lock, after the previous claim committed): exact,
-- not on average. The ring holds the queue's last `size` starts (size >= rate_limit),
-- oldest first from next_slot, so the rate_limit-th before the i-th new start is the
-- (size - rate_limit + i)-th from next_slot. Reads `wanted` slots at most.
CREATE OR REPLACE FUNCTION skiplock.internal_rate_room(queue_name text, rate_limit int,
                                                       rate_period interval, at timestamptz,
                                                       wanted bigint) RETURNS bigint
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    ring skiplock.queue_rate_rings;
    look bigint := least(wanted, rate_limit);
    first_busy bigint;
BEGIN
    SELECT * INTO ring FROM skiplock.queue_rate_rings r WHERE r.queue = queue_name;
    IF ring.queue IS NULL OR ring.size < rate_limit THEN
        PERFORM skiplock.internal_make_rate_ring(queue_name, rate_limit);
        SELECT * INTO ring FROM skiplock.queue_rate_rings r WHERE r.queue = queue_name;
    END IF;
    IF look <= 0 THEN
        RETURN 0;
    END IF;
    SELECT min(i) INTO first_busy
    FROM generate_series(0, look - 1) AS i
    JOIN skiplock.queue_rate_starts s
      ON s.queue = queue_name
     AND s.slot = (ring.next_slot + ring.size - rate_limit + i) % ring.size
    WHERE s.started_at >= at - rate_period;
    RETURN coalesce(first_busy, look);
END;
$$;

-- Records `taken` starts at `at` in the queue's ring, in place of its oldest. When the
-- limit held jobs back, tells the workers when the next start may go (the rate_limit-th
-- start before it a whole period old; skiplock_due_later, from the queue's start): a
-- refilled window is claimed then, not at the next poll.
CREATE OR REPLACE FUNCTION skiplock.internal_rate_record(queue_name text, taken bigint,
                                                         at timestamptz, rate_limit int,
                                                         rate_period interval,
                                                         held_back boolean) RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    ring skiplock.queue_rate_rings;
    refill_in_us bigint;
BEGIN
    SELECT * INTO ring FROM skiplock.queue_rate_rings r WHERE r.queue = queue_name;
    IF taken > 0 THEN
        UPDATE skiplock.queue_rate_starts s SET started_at = at
        WHERE s.queue = queue_name
          AND s.slot = ANY (ARRAY(SELECT (ring.next_slot + i) % ring.size
                                  FROM generate_series(0, least(taken, ring.size) - 1) AS i));
        UPDATE skiplock.queue_rate_rings r
        SET next_slot = ((ring.next_slot + taken) % ring.size)::int
        WHERE r.queue = queue_name;
    END IF;
    IF held_back THEN
        SELECT (extract(epoch FROM s.started_at + rate_period - clock_timestamp()) * 1000000)::bigint + 1
        INTO refill_in_us
        FROM skiplock.queue_rate_starts s
        WHERE s.queue = queue_name
          AND s.slot = (ring.next_slot + taken + ring.size - rate_limit) % ring.size;
        PERFORM pg_notify('skiplock_due_later',
            refill_in_us::text || E'\t' || refill_in_us::text || E'\t'
            || skiplock.internal_runnable_payload(queue_name, (-32768)::smallint, '-infinity'))
        WHERE refill_in_us IS NOT NULL;
    END IF;
END;
$$;

-- ---- Claim and completion (the worker's own statements) ----------------------------------

-- The worker's claim: up to max_jobs runnable jobs of the given queues and kinds (NULL
-- kinds: every kind), in claim order (priority, scheduled_at, id), after the given claim
-- key if any, each stamped with a fresh claim_token (claim_with when given, so a caller
-- whose reply was lost can find what it took), claimed_by, clock_timestamp() as first
-- heartbeat (now(), the transaction's start, would commit a claim that waited behind a
-- lock already stale) and attempt + 1. Internal: its arguments follow the Rust worker's
-- machinery (src/worker/claim_cursor.rs) and change with it; skiplock.claim is the stable
-- form. docs/architecture.md, "The claim path", has the reasons and the measurements.
--
-- * It walks jobs_claim_idx, one range per queue, in claim order, and locks with FOR
--   UPDATE SKIP LOCKED: claimers never wait on each other and never take the same row. A
--   claim of several queues walks each queue's range (up to max_jobs from each) and keeps
--   the first max_jobs of them all; a paused queue is not walked.
-- * The plan is fixed to that ordered walk (no sort, no bitmap or sequential scan) and
--   made once per connection: a plan made while the table was empty once sorted every
--   queued row on each claim, and re-planning cost half an idle claim.
-- * Lanes: it takes a lane's job only when it is the lane's oldest unfinished job and
--   nothing of the lane runs, whatever the rows were written with. Two claims can still
--   take two jobs of one lane that neither sees the other take; the second fails on
--   jobs_ordering_key_running_idx. With retry_lane_conflict the claim runs inside a
--   subtransaction and, on that conflict, runs again without lane jobs; without it the
--   conflict reaches the caller (the worker retries itself, outside a subtransaction,
--   which the in-flight filter needs).
-- * skip_in_flight passes over rows whose xmax is a transaction running when the claim
--   began (pg_current_snapshot()) or begun since, before FOR UPDATE SKIP LOCKED takes
--   each to the lock manager: with several worker processes on one queue, most of what a
--   claim meets is rows other claims are taking. Not "xmax = 0": a queued row keeps the id
--   of a locker that has finished until it is next updated. A MultiXactId in xmax read as
--   a transaction id can make a row look taken while that lasts, so the filter is the
--   caller's choice, and the worker walks without it from the start at least every 30 s.
--   It is off in a transaction that already has an id and outside READ COMMITTED.
-- * Rows are locked first and updated by ctid (no second index descent); the result is
--   sorted after the update has finished, so an update that fails has returned nothing.
-- * Global limits (see "Global limits" above): a claim that names a limited queue takes
--   at most the room the queue's max_running and rate_limit leave, under the queue's lock,
--   and only in READ COMMITTED. Named with other queues, each is claimed from in turn (in
--   name order, up to max_jobs in all). The jobs it claims carry the time the limits were
--   checked at as claimed_at (now() otherwise).
CREATE OR REPLACE FUNCTION skiplock.internal_claim_batch(queues text[], kinds text[], max_jobs bigint, worker text,
                                     after_priority smallint DEFAULT NULL,
                                     after_scheduled_at_us bigint DEFAULT NULL,
                                     after_id bigint DEFAULT NULL,
                                     claim_with uuid DEFAULT NULL,
                                     skip_in_flight boolean DEFAULT false,
                                     take_lanes boolean DEFAULT true,
                                     retry_lane_conflict boolean DEFAULT true)
RETURNS TABLE (id bigint, queue text, kind text, args jsonb, attempt int, max_attempts int,
               claim_token uuid, priority smallint, scheduled_at_us bigint)
LANGUAGE plpgsql
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    from_priority smallint := -32768;
    from_scheduled_at timestamptz := '-infinity';
    from_id bigint := -9223372036854775808;
    snapshot pg_snapshot;
    -- Transactions running when the claim began, and the next id then (as the low 32
    -- bits that xmax holds).
    in_flight xid[] := '{}';
    next_xid bigint := 0;
    filtering boolean := skip_in_flight AND pg_current_xact_id_if_assigned() IS NULL
        AND current_setting('transaction_isolation') = 'read committed';
    -- The limited queue claimed from, its limits, and what they leave.
    limited_queue text;
    lim_max_running int;
    lim_rate_limit int;
    lim_rate_period interval;
    room bigint := max_jobs;
    wanted bigint;
    rate_room bigint;
    claim_time timestamptz;
    one_queue text;
    taken bigint;
    got bigint := 0;
BEGIN
    IF retry_lane_conflict AND take_lanes THEN
        -- The claim inside a subtransaction: a lane conflict it could not see rolls back
        -- only that, and the claim runs again without lane jobs.
        BEGIN
            RETURN QUERY SELECT * FROM skiplock.internal_claim_batch(queues, kinds, max_jobs, worker,
                after_priority, after_scheduled_at_us, after_id, claim_with, skip_in_flight,
                true, false);
            RETURN;
        EXCEPTION
            WHEN unique_violation THEN
                RETURN QUERY SELECT * FROM skiplock.internal_claim_batch(queues, kinds, max_jobs,
                    worker, after_priority, after_scheduled_at_us, after_id, claim_with,
                    skip_in_flight, false, false);
                RETURN;
            WHEN serialization_failure THEN
                -- A queued row moved to jobs_done (cancelled) after this statement's
                -- snapshot: Postgres cannot follow it. Outside READ COMMITTED the snapshot
                -- stays and so would the error: the caller retries.
                IF current_setting('transaction_isolation') <> 'read committed' THEN
                    RAISE;
                END IF;
                RETURN QUERY SELECT * FROM skiplock.internal_claim_batch(queues, kinds, max_jobs,
                    worker, after_priority, after_scheduled_at_us, after_id, claim_with,
                    skip_in_flight, true, false);
                RETURN;
        END;
    END IF;
    -- Global limits: a queue without any costs this one probe.
    SELECT q.name, q.max_running, q.rate_limit, q.rate_period
    INTO limited_queue, lim_max_running, lim_rate_limit, lim_rate_period
    FROM skiplock.queues q
    WHERE q.name = ANY (queues) AND NOT q.paused
      AND (q.max_running IS NOT NULL OR q.rate_limit IS NOT NULL)
    ORDER BY q.name
    LIMIT 1;
    IF limited_queue IS NOT NULL THEN
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            -- An older snapshot would miss claims committed after it, and claim past the
            -- limit.
            RAISE EXCEPTION 'queue % has a global limit (max_running or rate_limit), which a claim holds only in READ COMMITTED; this transaction is %',
                limited_queue, upper(current_setting('transaction_isolation'))
                USING ERRCODE = 'invalid_transaction_state',
                      HINT = 'claim in a READ COMMITTED transaction: BEGIN ISOLATION LEVEL READ COMMITTED, or SET default_transaction_isolation for the session';
        END IF;
        IF EXISTS (SELECT 1 FROM unnest(queues) AS q WHERE q IS DISTINCT FROM limited_queue) THEN
            FOR one_queue IN SELECT DISTINCT q FROM unnest(queues) AS q WHERE q IS NOT NULL ORDER BY 1
            LOOP
                RETURN QUERY SELECT * FROM skiplock.internal_claim_batch(ARRAY[one_queue], kinds,
                    max_jobs - got, worker, after_priority, after_scheduled_at_us, after_id,
                    claim_with, skip_in_flight, take_lanes, false);
                GET DIAGNOSTICS taken = ROW_COUNT;
                got := got + taken;
                EXIT WHEN got >= max_jobs;
            END LOOP;
            RETURN;
        END IF;
        PERFORM pg_advisory_xact_lock(skiplock.internal_queue_limit_lock_id(limited_queue));
        IF lim_max_running IS NOT NULL THEN
            -- Through jobs_running_idx: every running job's entry, the queue's found among
            -- them (see the index's comment in 0001_initial.sql).
            room := least(room, greatest(0, lim_max_running - (
                SELECT count(*) FROM (SELECT FROM skiplock.jobs_live j
                                      WHERE j.queue = limited_queue AND j.state = 'running'
                                      LIMIT lim_max_running) r)));
        END IF;
        -- After the lock and the count: later than every claim of the queue committed
        -- before, so the starts the rate limit records follow each other, and later than
        -- the end of every job the count found ended, so the jobs' claimed_at and
        -- finished_at never show more running at once than the count allowed.
        claim_time := clock_timestamp();
        IF lim_rate_limit IS NOT NULL THEN
            wanted := room;
            rate_room := skiplock.internal_rate_room(limited_queue, lim_rate_limit,
                                                     lim_rate_period, claim_time, wanted);
            room := least(room, rate_room);
        END IF;
        IF room <= 0 THEN
            IF rate_room IS NOT NULL THEN
                PERFORM skiplock.internal_rate_record(limited_queue, 0, claim_time,
                                                      lim_rate_limit, lim_rate_period,
                                                      rate_room < wanted);
            END IF;
            RETURN;
        END IF;
    END IF;
    -- Without a position, a key before every row: the full walk.
    IF after_priority IS NOT NULL AND after_scheduled_at_us IS NOT NULL
       AND after_id IS NOT NULL THEN
        from_priority := after_priority;
        from_scheduled_at := CASE WHEN after_scheduled_at_us = -9223372036854775808
            THEN '-infinity'::timestamptz
            ELSE 'epoch'::timestamptz + after_scheduled_at_us * interval '1 microsecond' END;
        from_id := after_id;
    END IF;
    IF filtering THEN
        snapshot := pg_current_snapshot();
        in_flight := ARRAY(SELECT x::xid FROM pg_snapshot_xip(snapshot) AS x);
        next_xid := pg_snapshot_xmax(snapshot)::text::bigint % 4294967296;
    END IF;
    -- From the position on, with the caller's token when it gives one. The result is
    -- sorted (claim order) after the update has finished, so an update that fails has
    -- returned no row yet.
    RETURN QUERY
    WITH picked AS (
        SELECT p.ctid
        FROM (SELECT DISTINCT q FROM unnest(queues) AS q) AS qn(name)
        CROSS JOIN LATERAL (
            SELECT j.ctid, j.priority, j.scheduled_at, j.id FROM skiplock.jobs_live j
            WHERE j.queue = qn.name AND j.state = 'queued' AND j.scheduled_at <= now()
              AND (j.priority, j.scheduled_at, j.id) > (from_priority, from_scheduled_at, from_id)
              AND (kinds IS NULL OR j.kind = ANY (kinds))
              AND (NOT filtering OR j.xmax = '0'::xid OR (
                  NOT j.xmax = ANY (in_flight)
                  AND (j.xmax::text::bigint - next_xid + 4294967296) % 4294967296 >= 1048576))
              AND (j.ordering_key IS NULL OR (
                  take_lanes
                  AND NOT EXISTS (
                      SELECT 1 FROM skiplock.jobs h
                      WHERE h.ordering_key = j.ordering_key AND h.state = 'running')
                  AND NOT EXISTS (
                      SELECT 1 FROM skiplock.jobs h
                      WHERE h.ordering_key = j.ordering_key AND h.id < j.id
                        AND h.state IN ('waiting', 'queued', 'running'))
              ))
            ORDER BY j.priority, j.scheduled_at, j.id
            LIMIT room
            FOR UPDATE OF j SKIP LOCKED
        ) p
        WHERE NOT EXISTS (
            SELECT 1 FROM skiplock.queues q WHERE q.name = qn.name AND q.paused)
        ORDER BY p.priority, p.scheduled_at, p.id
        LIMIT room
    ), claimed AS (
        UPDATE skiplock.jobs_live j
        SET state = 'running', claim_token = coalesce(claim_with, gen_random_uuid()), claimed_by = worker,
            claimed_at = coalesce(claim_time, now()), heartbeat_at = clock_timestamp(),
            attempt = least(j.attempt, 2147483646) + 1
        WHERE j.ctid = ANY (ARRAY(SELECT p.ctid FROM picked p))
        RETURNING j.id, j.queue, j.kind, j.args, j.attempt, j.max_attempts,
                  j.claim_token, j.priority, j.scheduled_at
    )
    SELECT c.id, c.queue, c.kind, c.args, c.attempt, c.max_attempts, c.claim_token,
           c.priority,
           -- A claimed row is due, so its scheduled_at is finite or '-infinity'.
           CASE WHEN isfinite(c.scheduled_at)
                THEN (extract(epoch FROM c.scheduled_at) * 1000000)::bigint
                ELSE -9223372036854775808 END
    FROM claimed c
    ORDER BY c.priority, c.scheduled_at, c.id;
    IF rate_room IS NOT NULL THEN
        GET DIAGNOSTICS taken = ROW_COUNT;
        PERFORM skiplock.internal_rate_record(limited_queue, taken, claim_time, lim_rate_limit,
                                              lim_rate_period,
                                              rate_room < wanted AND taken >= rate_room);
    END IF;
END;
$$;

-- Of the given queues, those in which a claimer other than `worker` holds running jobs: a
-- worker keeps fewer claims and writes in flight on a queue it shares, so that the
-- processes' claims step over fewer of each other's rows (src/worker/sharing.rs). One call
-- for all of a worker's queues; each reads the running jobs' partial index and stops at the
-- first other claimer found.
CREATE OR REPLACE FUNCTION skiplock.internal_others_claiming(queues text[], worker text)
RETURNS text[]
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
    SELECT coalesce(array_agg(q.name), '{}')
    FROM unnest(queues) AS q(name)
    WHERE EXISTS (
        SELECT 1 FROM skiplock.jobs j
        WHERE j.state = 'running' AND j.queue = q.name
          AND j.claimed_by IS DISTINCT FROM worker);
$$;
COMMENT ON FUNCTION skiplock.internal_others_claiming(text[], text) IS
    'Of the given queues, those in which a claimer other than the given one holds running jobs. What a worker calls to choose how many claims and writes it keeps in flight; internal, not stable.';

CREATE OR REPLACE FUNCTION skiplock.internal_complete_claims(ids bigint[], tokens uuid[])
RETURNS TABLE (id bigint, state text, has_dependants boolean, ordering_key text)
LANGUAGE sql
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
    WITH done AS (
        UPDATE skiplock.jobs j
        SET state = 'succeeded', finished_at = now(), claim_token = NULL, heartbeat_at = NULL
        FROM unnest(ids, tokens) AS c(id, token)
        WHERE j.id = c.id AND j.claim_token = c.token AND j.state IN ('waiting', 'queued', 'running')
        RETURNING j.id, j.state::text AS state,
                  EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = j.id)
                      AS has_dependants,
                  j.ordering_key, j.queue
    ), freed AS (
        SELECT skiplock.internal_notify_freed(array_agg(DISTINCT queue)) FROM done
    )
    SELECT id, state, has_dependants, ordering_key
    FROM done, (SELECT count(*) FROM freed) f;
$$;
COMMENT ON FUNCTION skiplock.internal_complete_claims(bigint[], uuid[]) IS
    'Marks the given running jobs succeeded, each only if it still holds the given claim token, locking them in the order given (pass them sorted by id, as a worker does); returns those it changed, with what the worker does next for each (its dependants, its lane). What a worker calls.';

-- ---- A row moved to the other partition under a statement ------------------------------
--
-- A statement that locks or updates a row that another transaction moved between jobs_live
-- and jobs_done after the statement's snapshot was taken fails with 40001 ("tuple to be
-- locked was already moved to another partition due to concurrent update"): Postgres
-- cannot follow a row into another partition, where in one table it would have found the
-- row changed and passed it over. In READ COMMITTED each statement takes a new snapshot,
-- in which the row is where it went, so the statement run again treats it as it treats any
-- job someone else finished first. The functions that can meet it on their own rows (the
-- heartbeat, the reaper, the SQL protocol's calls, the claim, cancel_job, maintain) run
-- again; under REPEATABLE READ or SERIALIZABLE the snapshot stays and the error goes to
-- the caller, whose transaction must be retried, as for any serialization failure.

-- Whether a statement that failed with 40001 may run again in this transaction: in READ
-- COMMITTED, up to 10 times.
CREATE OR REPLACE FUNCTION skiplock.internal_may_retry_moved(attempts int) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT attempts < 10 AND current_setting('transaction_isolation') = 'read committed';
$$;

-- ---- Outcomes of a claim (shared by the worker and the SQL worker protocol) --------------
--
-- Each statement finishes, fails, releases or extends claims given as arrays of job ids
-- and claim tokens; a row changes only while it still holds the token presented (a stale
-- holder's write changes nothing and its claim is missing from the result). Rows are
-- locked in the order of the list (callers sort it by id), so two statements over
-- overlapping claims queue behind each other instead of deadlocking; those that may requeue
-- a job with a unique_key take the keys' locks before the rows'
-- (internal_lock_unique_keys_of). LANGUAGE sql and not inlinable, so Postgres plans each at
-- every call with the table as it is then.
--
-- The statements that move a claim out of jobs_live update skiplock.jobs filtered on the
-- live states, `state IN ('waiting', 'queued', 'running')`: enough for Postgres to plan
-- and lock jobs_live alone (the claim token already implies running), and, unlike
-- `state = 'running'`, no match for jobs_running_idx's predicate. With `state = 'running'`
-- the planner walked every running job through that index and tested each against every
-- claim of the batch: 6 s for 1,500 completions beside 8,000 running jobs.

-- Failed attempts: each job back to `queued` after its delay, or `dead` (attempts spent, or
-- action 'dead'), or `cancelled` (action 'cancel'); its error appended. A retry whose
-- unique_key another pending job took meanwhile is superseded by it and ends cancelled.
-- Returns the jobs whose claim was still held, with what their follow-up needs.
CREATE OR REPLACE FUNCTION skiplock.internal_fail_claims(ids bigint[], tokens uuid[],
                                                         messages text[], delays_ms bigint[],
                                                         actions text[])
RETURNS TABLE (id bigint, state text, has_dependants boolean, ordering_key text)
LANGUAGE sql AS $$
    SELECT skiplock.internal_lock_unique_keys_of($1);
    WITH failed AS (
        SELECT f.*, j.unique_key, CASE
                WHEN f.action = 'cancel' THEN 'cancelled'
                WHEN f.action = 'dead' OR j.attempt >= j.max_attempts THEN 'dead'
                ELSE 'queued'
            END::skiplock.job_state AS next_state
        FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::bigint[], $5::text[])
             AS f(id, token, message, delay_ms, action),
        LATERAL (SELECT id, attempt, max_attempts, unique_key FROM skiplock.jobs_live j
                 WHERE j.id = f.id AND j.claim_token = f.token
                 FOR UPDATE) j
    ), folded AS (
        SELECT f.*, CASE WHEN f.next_state = 'queued' AND f.unique_key IS NOT NULL
                         THEN skiplock.internal_fold_into_key_holder(f.id) END AS holder
        FROM failed f
    ), saved AS (
    UPDATE skiplock.jobs j
    SET state = CASE WHEN f.holder IS NULL THEN f.next_state ELSE 'cancelled' END,
        scheduled_at = CASE WHEN f.next_state = 'queued' AND f.holder IS NULL
            THEN now() + f.delay_ms * interval '1 millisecond' ELSE j.scheduled_at END,
        finished_at = CASE WHEN f.next_state = 'queued' AND f.holder IS NULL
            THEN NULL ELSE now() END,
        claim_token = NULL, heartbeat_at = NULL,
        last_error = CASE WHEN f.holder IS NULL THEN f.message
            ELSE skiplock.internal_superseded_message(f.holder, f.unique_key) END,
        errors = skiplock.internal_append_error(j.errors, j.attempt, f.message)
    FROM folded f
    WHERE j.id = ANY(ARRAY(SELECT id FROM folded)) AND j.id = f.id AND j.state IN ('waiting', 'queued', 'running')
    RETURNING j.id, j.state::text AS state,
              EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = j.id)
                  AS has_dependants,
              j.ordering_key, j.queue, j.priority, j.scheduled_at
    ), runnable AS (
        -- A retry with no delay is runnable at once, and may be behind a position; one
        -- after its delay may come due behind one.
        SELECT skiplock.internal_notify_runnable(queue, priority, min(scheduled_at)),
               skiplock.internal_notify_due_later(queue, priority,
                   min(scheduled_at) FILTER (WHERE scheduled_at > now()), max(scheduled_at))
        FROM saved WHERE state = 'queued'
        GROUP BY queue, priority
    ), freed AS (
        SELECT skiplock.internal_notify_freed(array_agg(DISTINCT queue)) FROM saved
    )
    SELECT id, state, has_dependants, ordering_key
    FROM saved, (SELECT count(*) FROM runnable) r, (SELECT count(*) FROM freed) f;
$$;

-- Claims given back without counting the attempt: a graceful shutdown (delay 0: the job
-- keeps its scheduled_at, and so its place in line) or a snooze (due again after the
-- delay). A job whose unique_key another pending job took meanwhile is superseded by it and
-- ends cancelled. Returns the ids whose claim was still held.
CREATE OR REPLACE FUNCTION skiplock.internal_release_claims(ids bigint[], tokens uuid[],
                                                            delays_ms bigint[])
RETURNS SETOF bigint
LANGUAGE sql AS $$
    SELECT skiplock.internal_lock_unique_keys_of($1);
    WITH held AS (
        SELECT j.id, j.unique_key, c.delay_ms
        FROM unnest($1::bigint[], $2::uuid[], $3::bigint[]) AS c(id, token, delay_ms),
        LATERAL (SELECT id, unique_key FROM skiplock.jobs_live j
                 WHERE j.id = c.id AND j.claim_token = c.token
                 FOR UPDATE) j
    ), folded AS (
        SELECT h.*, CASE WHEN h.unique_key IS NOT NULL
                         THEN skiplock.internal_fold_into_key_holder(h.id) END AS holder
        FROM held h
    ), released AS (
        UPDATE skiplock.jobs j
        SET state = CASE WHEN f.holder IS NULL THEN 'queued' ELSE 'cancelled' END
                ::skiplock.job_state,
            attempt = greatest(j.attempt - 1, 0),
            scheduled_at = CASE WHEN f.holder IS NULL AND f.delay_ms > 0
                THEN now() + f.delay_ms * interval '1 millisecond'
                ELSE j.scheduled_at END,
            claim_token = NULL, heartbeat_at = NULL,
            finished_at = CASE WHEN f.holder IS NULL THEN NULL ELSE now() END,
            last_error = CASE WHEN f.holder IS NULL THEN j.last_error
                ELSE skiplock.internal_superseded_message(f.holder, f.unique_key) END
        FROM folded f
        WHERE j.id = ANY(ARRAY(SELECT id FROM folded)) AND j.id = f.id AND j.state IN ('waiting', 'queued', 'running')
        RETURNING j.id, j.queue, j.state, f.delay_ms, j.priority, j.scheduled_at
    ), runnable AS (
        -- Released jobs keep their scheduled_at: behind the workers' positions. Snoozed
        -- ones (scheduled_at after now()) may come due behind them.
        SELECT skiplock.internal_notify_runnable(queue, priority, min(scheduled_at)),
               skiplock.internal_notify_due_later(queue, priority,
                   min(scheduled_at) FILTER (WHERE scheduled_at > now()), max(scheduled_at))
        FROM released
        WHERE state = 'queued'
        GROUP BY queue, priority
    ), freed AS (
        SELECT skiplock.internal_notify_freed(array_agg(DISTINCT queue)) FROM released
    )
    SELECT id FROM released, (SELECT count(*) FROM runnable) r, (SELECT count(*) FROM freed) f;
$$;

-- Extends the claims still held with the database clock, and returns those gone (reaped,
-- cancelled, finished by someone else, deleted). Rows locked by another statement (most
-- often the holder's own completion, being saved right now) are skipped rather than
-- waited on: a heartbeat must never queue behind a slow commit, or it would itself go
-- stale; such a claim counts as held while the row still shows the token. clock_timestamp()
-- is taken as the row is written, so a heartbeat that waited for a lock records the end of
-- the wait. in_flight are the tokens of claim statements whose reply the Rust worker has
-- not read yet: the jobs holding one are extended too (usually none, and then the extra
-- scan does not run). The claims gone are found by one primary-key probe per claim
-- (LIMIT 1 keeps the probe from being flattened into a join that may scan the table).
CREATE OR REPLACE FUNCTION skiplock.internal_heartbeat_claims(ids bigint[], tokens uuid[],
                                                              in_flight uuid[] DEFAULT '{}')
RETURNS TABLE (id bigint, claim_token uuid)
LANGUAGE plpgsql
-- PL/pgSQL keeps the plan it made the first times: pinned to index lookups, so that one
-- made while the table was small does not scan it once it has grown (tests/plans.rs).
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    attempts int := 0;
    gone_ids bigint[];
    gone_tokens uuid[];
BEGIN
    -- Collected first and returned after: a statement that fails has returned nothing.
    LOOP
        BEGIN
            WITH held AS (
                SELECT j.id FROM unnest(ids, tokens) AS c(id, token),
                LATERAL (SELECT j.id FROM skiplock.jobs_live j
                         WHERE j.id = c.id AND j.claim_token = c.token
                         FOR UPDATE SKIP LOCKED) j
            ), beat AS (
                UPDATE skiplock.jobs_live j SET heartbeat_at = clock_timestamp()
                WHERE j.id = ANY(ARRAY(SELECT h.id FROM held h))
            ), unread AS (
                SELECT j.id FROM skiplock.jobs_live j
                WHERE cardinality(in_flight) > 0
                  AND j.state = 'running' AND j.claim_token = ANY(in_flight)
                  AND j.id <> ALL(ARRAY(SELECT h.id FROM held h))
                FOR UPDATE SKIP LOCKED
            ), beat_unread AS (
                UPDATE skiplock.jobs_live j SET heartbeat_at = clock_timestamp()
                WHERE j.id = ANY(ARRAY(SELECT u.id FROM unread u))
            )
            SELECT array_agg(c.id), array_agg(c.token) INTO gone_ids, gone_tokens
            FROM unnest(ids, tokens) AS c(id, token)
            LEFT JOIN LATERAL (SELECT true AS holds FROM skiplock.jobs_live j
                               WHERE j.id = c.id AND j.claim_token = c.token
                               LIMIT 1) h ON true
            WHERE h.holds IS NULL;
            EXIT;
        EXCEPTION WHEN serialization_failure THEN
            attempts := attempts + 1;
            IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                RAISE;
            END IF;
        END;
    END LOOP;
    RETURN QUERY SELECT g.id, g.token FROM unnest(gone_ids, gone_tokens) AS g(id, token);
END;
$$;

-- Takes back up to max_jobs running jobs whose heartbeat is older than stale_after_ms (by
-- the database clock), or as far in the future (only a hand-written heartbeat_at can be
-- there, and such a job would otherwise stay running for good): back to `queued` with
-- skiplock.backoff, or `dead` once attempts are spent, with the reason in last_error. A job
-- whose unique_key another pending job took meanwhile is superseded by it (cancelled).
-- SKIP LOCKED lets any number of reapers run at once: a row being completed right now is
-- locked by its completer and skipped, and one completed after the snapshot fails the
-- re-check of state = 'running', so a finished job is never reset. A stale job whose
-- unique_key is locked (an enqueue of the key is under way) is passed over in the same way,
-- for a later pass: the reaper holds the rows it has taken and must not wait for a key
-- (see "Lock order" under Unique keys). only_id limits it to one job; since to the
-- heartbeats from then on (the Rust reaper's passes between its full passes, which under
-- a held snapshot would walk every entry of jobs_running_idx).
-- "In the future" is by the clock as the row is looked at (clock_timestamp()), not by
-- now(), the start of the caller's transaction: a heartbeat written since a transaction
-- began (maintain called in an old transaction, a reaper statement that waited) is ahead
-- of its now() and is not hand-written; now() only bounds the index range.
-- The statement runs through EXECUTE so that it is planned with the values: a NULL since
-- folds away, a given one bounds the index range.
CREATE OR REPLACE FUNCTION skiplock.internal_reap_stale(stale_after_ms bigint, max_jobs bigint,
                                                        only_id bigint DEFAULT NULL,
                                                        since timestamptz DEFAULT NULL)
RETURNS TABLE (id bigint, state text, claimed_by text, ordering_key text)
LANGUAGE plpgsql AS $$
DECLARE
    attempts int := 0;
    taken skiplock.internal_reaped[];
BEGIN
    -- Collected first and returned after: a statement that fails has returned nothing.
    LOOP
        BEGIN
            EXECUTE $reap$
        WITH stale AS (
           SELECT id FROM skiplock.jobs_live
           WHERE state = 'running'
             AND ((heartbeat_at < now() - $1 * interval '1 millisecond'
                   AND ($4::timestamptz IS NULL OR heartbeat_at >= $4))
                  OR (heartbeat_at > now() + $1 * interval '1 millisecond'
                      AND heartbeat_at > clock_timestamp() + $1 * interval '1 millisecond'))
             AND ($3::bigint IS NULL OR id = $3)
             AND (unique_key IS NULL OR skiplock.internal_try_lock_unique_key(unique_key))
           ORDER BY heartbeat_at
           LIMIT $2
           FOR UPDATE SKIP LOCKED
       ), due AS (
           SELECT j.id, j.attempt, j.unique_key,
                  CASE WHEN j.heartbeat_at > now()
                      THEN format('heartbeat_at %s of %s is in the future by the database clock (written by hand?); claim taken back',
                                  j.heartbeat_at, coalesce(j.claimed_by, 'unknown worker'))
                      ELSE format('no heartbeat from %s for over %s ms; claim taken back',
                                  coalesce(j.claimed_by, 'unknown worker'), $1)
                  END AS message,
                  CASE WHEN j.attempt >= j.max_attempts THEN 'dead' ELSE 'queued' END
                      ::skiplock.job_state AS next_state
           FROM skiplock.jobs_live j JOIN stale USING (id)
       ), reaped AS (
           SELECT d.*, CASE WHEN d.next_state = 'queued' AND d.unique_key IS NOT NULL
                            THEN skiplock.internal_fold_into_key_holder(d.id) END AS holder
           FROM due d
       ), taken_back AS (
       UPDATE skiplock.jobs j
       SET state = CASE WHEN r.holder IS NULL THEN r.next_state ELSE 'cancelled' END,
           scheduled_at = CASE WHEN r.next_state = 'queued' AND r.holder IS NULL
               THEN now() + skiplock.backoff(r.attempt) ELSE j.scheduled_at END,
           finished_at = CASE WHEN r.next_state = 'queued' AND r.holder IS NULL
               THEN NULL ELSE now() END,
           claim_token = NULL, heartbeat_at = NULL,
           last_error = CASE WHEN r.holder IS NULL THEN r.message
               ELSE skiplock.internal_superseded_message(r.holder, r.unique_key) END,
           errors = skiplock.internal_append_error(j.errors, j.attempt, r.message)
       FROM reaped r
       WHERE j.id = r.id AND j.state IN ('waiting', 'queued', 'running')
       RETURNING j.id, j.state::text AS state, j.claimed_by, j.ordering_key,
                 j.queue, j.priority, j.scheduled_at
       ), due_later AS (
           -- Back after the backoff: it may come due behind a worker's position.
           SELECT skiplock.internal_notify_due_later(queue, priority, min(scheduled_at),
                                                     max(scheduled_at))
           FROM taken_back WHERE state = 'queued'
           GROUP BY queue, priority
       ), freed AS (
           SELECT skiplock.internal_notify_freed(array_agg(DISTINCT queue)) FROM taken_back
       )
       SELECT array_agg(ROW(id, state, claimed_by, ordering_key)::skiplock.internal_reaped)
       FROM taken_back, (SELECT count(*) FROM due_later) d, (SELECT count(*) FROM freed) f
    $reap$ INTO taken USING stale_after_ms, max_jobs, only_id, since;
            EXIT;
        EXCEPTION WHEN serialization_failure THEN
            attempts := attempts + 1;
            IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                RAISE;
            END IF;
        END;
    END LOOP;
    RETURN QUERY SELECT t.id, t.state, t.claimed_by, t.ordering_key FROM unnest(taken) AS t;
END;
$$;

-- The claims internal_reap_stale would take back (up to max_jobs, oldest heartbeat first),
-- without taking them or locking anything: the list a reaper works through one job at a
-- time when one row made its batch fail.
CREATE OR REPLACE FUNCTION skiplock.internal_stale_claims(stale_after_ms bigint, max_jobs bigint)
RETURNS TABLE (id bigint, claim_token uuid)
LANGUAGE sql AS $$
    SELECT j.id, j.claim_token FROM skiplock.jobs_live j
    WHERE j.state = 'running'
      AND (j.heartbeat_at < now() - stale_after_ms * interval '1 millisecond'
           OR (j.heartbeat_at > now() + stale_after_ms * interval '1 millisecond'
               AND j.heartbeat_at > clock_timestamp() + stale_after_ms * interval '1 millisecond'))
    ORDER BY j.heartbeat_at
    LIMIT max_jobs;
$$;

-- The last resort for claims whose outcome cannot be written as it is (the statement
-- fails for this row alone, for a reason no retry will change): each job still holding its
-- token goes `dead` with message as its last error, and its claim ends. The caller moves
-- its lane and dependants on, as for any dead job. errors that is not a list (written by
-- hand) is replaced by a list of this failure, since appending to it may be what failed.
CREATE OR REPLACE FUNCTION skiplock.internal_abandon_claims(ids bigint[], tokens uuid[], message text)
RETURNS TABLE (id bigint, state text, has_dependants boolean, ordering_key text)
LANGUAGE sql AS $$
    WITH held AS (
        SELECT j.id FROM unnest($1::bigint[], $2::uuid[]) AS c(id, token),
        LATERAL (SELECT id FROM skiplock.jobs_live j
                 WHERE j.id = c.id AND j.claim_token = c.token
                 FOR UPDATE) j
    ), abandoned AS (
    UPDATE skiplock.jobs j
    SET state = 'dead', finished_at = now(), claim_token = NULL, heartbeat_at = NULL,
        last_error = $3,
        errors = CASE WHEN jsonb_typeof(j.errors) = 'array'
            THEN skiplock.internal_append_error(j.errors, j.attempt, $3)
            ELSE jsonb_build_array(jsonb_build_object('attempt', j.attempt, 'at', now(), 'message', $3))
            END
    WHERE j.id = ANY(ARRAY(SELECT id FROM held)) AND j.state IN ('waiting', 'queued', 'running')
    RETURNING j.id, j.state::text AS state,
              EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = j.id)
                  AS has_dependants,
              j.ordering_key, j.queue
    ), freed AS (
        SELECT skiplock.internal_notify_freed(array_agg(DISTINCT queue)) FROM abandoned
    )
    SELECT id, state, has_dependants, ordering_key
    FROM abandoned, (SELECT count(*) FROM freed) f;
$$;

-- The periodic repair of what a race may have left: waiting jobs whose parents have all
-- finished (a parent finished while the child's enqueue was uncommitted, or was deleted:
-- pruned after it succeeded, or deleted by hand before, leaving a tombstone) are settled,
-- waiting jobs left without any dependency row (deleted by hand) are queued, and lanes
-- whose head finished while a new lane job was being enqueued move on. Returns how many
-- jobs moved.
--
-- Incremental: a pass checks the next batch_size (500) waiting jobs after the
-- position kept in skiplock.waiting_sweep, in id order, and starts from the first again
-- after the last, so its cost follows the batch, not how many jobs wait (a whole-table
-- sweep took 0.5-1.4 s per call beside 150,000 waiting jobs). A race is repaired within
-- one lap: (waiting jobs / 500) passes, each worker passing every reap interval (5 s by
-- default). Passes of several sessions share the position; a pass that finds it locked
-- does nothing.
CREATE OR REPLACE FUNCTION skiplock.internal_settle_waiting() RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    attempts int := 0;
    batch_size constant int := 500;
    position bigint;
    last_id bigint;
    seen int;
    orphans bigint[];
    lanes text[];
    dependants bigint[];
    moved int := 0;
    queued_orphans int;
    orphan_keys skiplock.runnable_key[];
BEGIN
    LOOP
        BEGIN
            moved := 0;
            SELECT after_id INTO position FROM skiplock.waiting_sweep FOR UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                RETURN 0;
            END IF;
            -- The batch, read once: what each waiting job waits for.
            SELECT count(*), max(b.id),
                   array_agg(b.id) FILTER (WHERE b.ordering_key IS NULL AND NOT b.has_edges),
                   array_agg(DISTINCT b.ordering_key) FILTER (WHERE b.ordering_key IS NOT NULL),
                   array_agg(b.id) FILTER (WHERE b.has_edges)
            INTO seen, last_id, orphans, lanes, dependants
            FROM (SELECT c.id, c.ordering_key,
                         EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.job_id = c.id) AS has_edges
                  FROM skiplock.jobs c
                  WHERE c.state = 'waiting' AND c.id > position
                  ORDER BY c.id
                  LIMIT batch_size) b;
            UPDATE skiplock.waiting_sweep
            SET after_id = CASE WHEN seen < batch_size THEN 0 ELSE last_id END;

            -- Waiting for nothing: no lane, no dependency row.
            IF orphans IS NOT NULL THEN
                WITH queued AS (
                    UPDATE skiplock.jobs c SET state = 'queued'
                    WHERE c.id = ANY (orphans) AND c.state = 'waiting' AND c.ordering_key IS NULL
                      AND NOT EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.job_id = c.id)
                    RETURNING c.queue, c.priority, c.scheduled_at
                )
                SELECT count(*), array_agg(ROW(queue, priority, scheduled_at)::skiplock.runnable_key)
                INTO queued_orphans, orphan_keys FROM queued;
                PERFORM skiplock.internal_notify_runnable(k.queue, k.priority, k.scheduled_at),
                        skiplock.internal_notify_due_later(k.queue, k.priority, k.scheduled_at,
                                                           k.scheduled_at)
                FROM unnest(orphan_keys) AS k;
                moved := queued_orphans;
            END IF;
            -- The batch's lanes: each head is one index entry, and the queued ones are announced
            -- in one message per queue and priority.
            IF lanes IS NOT NULL THEN
                moved := moved + skiplock.internal_advance_lanes(lanes);
            END IF;
            -- Jobs of the batch whose parents all succeeded (or were pruned after) are queued;
            -- those with a parent that can never succeed are cancelled with that parent's other
            -- waiting dependants (their cost: the failed parents' edges, each cancelling a job).
            IF dependants IS NOT NULL THEN
                moved := moved + skiplock.internal_queue_ready_dependants(dependants);
                moved := moved + skiplock.internal_settle_dependants(ARRAY(
                    SELECT DISTINCT d.parent_id
                    FROM skiplock.job_dependencies d
                    LEFT JOIN LATERAL (SELECT p.state FROM skiplock.jobs p
                                       WHERE p.id = d.parent_id LIMIT 1) p ON true
                    WHERE d.job_id = ANY (dependants)
                      AND (p.state IN ('dead', 'cancelled')
                           OR (p.state IS NULL AND d.parent_state IS NOT NULL))));
            END IF;
            RETURN moved;
        EXCEPTION WHEN serialization_failure THEN
            -- A waiting job moved to jobs_done under the pass (cancelled meanwhile): run
            -- again (see skiplock.internal_may_retry_moved).
            attempts := attempts + 1;
            IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                RAISE;
            END IF;
        END;
    END LOOP;
END;
$$;

-- The follow-up of jobs that finished (succeeded, dead or cancelled): their waiting
-- dependants are settled and the next job of their lanes becomes queued, both announced.
-- A waiting job moved to jobs_done under it (cancelled meanwhile) makes it run again (see
-- skiplock.internal_may_retry_moved): its callers need no retry of their own.
CREATE OR REPLACE FUNCTION skiplock.internal_move_on(parent_ids bigint[], lanes text[])
RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    moved int;
    attempts int := 0;
BEGIN
    IF coalesce(cardinality(parent_ids), 0) = 0 AND coalesce(cardinality(lanes), 0) = 0 THEN
        RETURN 0;
    END IF;
    LOOP
        BEGIN
            moved := 0;
            IF cardinality(parent_ids) > 0 THEN
                moved := moved + skiplock.internal_settle_dependants(parent_ids);
            END IF;
            IF cardinality(lanes) > 0 THEN
                moved := moved + skiplock.internal_advance_lanes(lanes);
            END IF;
            RETURN moved;
        EXCEPTION WHEN serialization_failure THEN
            attempts := attempts + 1;
            IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                RAISE;
            END IF;
        END;
    END LOOP;
END;
$$;

-- An error message as a job keeps it: at most 8 KiB (cut at a character boundary and
-- marked), as the Rust worker cuts its own (src/db/jobs/outcome.rs, sanitize_message).
CREATE OR REPLACE FUNCTION skiplock.internal_error_message(message text) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    mark constant text := '… (truncated)';
    bytes bytea;
    cut int := 8192 - octet_length(mark);
BEGIN
    IF message IS NULL OR message = '' THEN
        RETURN 'failed (no message)';
    ELSIF octet_length(message) <= 8192 THEN
        RETURN message;
    END IF;
    bytes := convert_to(left(message, 8192), 'UTF8');
    -- Back to the start of a character: get_byte counts from 0, so this is the first byte
    -- left out, and a continuation byte (10xxxxxx) means the cut splits a character.
    WHILE cut > 0 AND (get_byte(bytes, cut) & 192) = 128 LOOP
        cut := cut - 1;
    END LOOP;
    RETURN convert_from(substring(bytes FROM 1 FOR cut), 'UTF8') || mark;
END;
$$;

-- ---- Cron --------------------------------------------------------------------------------
--
-- Cron expressions are read and evaluated here, in one place, for every caller: the Rust
-- worker's scheduler and skiplock.maintain both enqueue due slots with
-- skiplock.internal_enqueue_cron_slots, and a schedule is checked as it is written
-- (skiplock.internal_cron_schedules_before_write), whoever writes it.
--
-- Syntax: 5 fields (minute hour day-of-month month day-of-week) or 6 with seconds first.
-- Each field is `*`, a value, a range `a-b`, a step `*/n`, `a-b/n` or `a/n` (from a to the
-- field's end), or a comma list of those. Months take JAN-DEC, weekdays SUN-SAT (0 and 7
-- are Sunday), any case. Day-of-month takes `L` (the month's last day); day-of-month and
-- day-of-week take `?` as `*`. When both day fields are restricted, a day matches either
-- (as in Vixie cron); when one is `*` or `?`, the other decides.

-- The values one field allows, in order; the day-of-month's `L` is 32. Raises
-- invalid_parameter_value naming the field, its text and its character positions.
CREATE OR REPLACE FUNCTION skiplock.internal_cron_field(expression text, field text,
                                                        field_name text, field_start int,
                                                        low int, high int,
                                                        names text[] DEFAULT NULL,
                                                        first_named int DEFAULT 0)
RETURNS int[]
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    item text;
    parts text[];
    ends text[];
    bounds int[];
    step int;
    a int;
    b int;
    last_day boolean;
    found int[] := '{}';
BEGIN
    FOREACH item IN ARRAY string_to_array(field, ',') LOOP
        parts := string_to_array(item, '/');
        a := NULL;
        b := NULL;
        step := 1;
        last_day := false;
        IF cardinality(parts) = 2 AND parts[2] ~ '^[0-9]{1,4}$' AND parts[2]::int > 0 THEN
            step := parts[2]::int;
        ELSIF cardinality(parts) <> 1 THEN
            parts := NULL;
        END IF;
        IF item = 'L' AND field_name = 'day-of-month' THEN
            a := 32;
            b := 32;
            last_day := true;
        ELSIF parts[1] = '*' OR (parts[1] = '?' AND field_name LIKE 'day-of-%') THEN
            a := low;
            b := high;
        ELSIF parts[1] IS NOT NULL THEN
            ends := string_to_array(parts[1], '-');
            IF cardinality(ends) IN (1, 2) THEN
                SELECT array_agg(CASE WHEN e ~ '^[0-9]{1,4}$' THEN e::int
                                      ELSE array_position(names, upper(e)) - 1 + first_named END
                                 ORDER BY n)
                INTO bounds FROM unnest(ends) WITH ORDINALITY AS t(e, n);
                a := bounds[1];
                b := CASE WHEN cardinality(bounds) = 2 THEN bounds[2]
                          WHEN cardinality(parts) = 2 THEN high
                          ELSE a END;
            END IF;
        END IF;
        IF a IS NULL OR b IS NULL OR (NOT last_day AND (a < low OR b > high OR a > b)) THEN
            RAISE EXCEPTION 'invalid cron expression `%`: % field `%` (characters %-%) is wrong: %',
                expression, field_name, field, field_start, field_start + length(field) - 1,
                CASE field_name
                    WHEN 'hour' THEN 'use 0-23, a list (9,17), a range (9-17), a step (*/2) or *'
                    WHEN 'day-of-month' THEN 'use 1-31, L, a list (1,15), a range (1-7), a step (*/2) or *'
                    WHEN 'month' THEN 'use 1-12 or JAN-DEC, a list, a range, a step or *'
                    WHEN 'day-of-week' THEN 'use 0-7 (0 and 7 are Sunday) or SUN-SAT, a list, a range, a step or *'
                    ELSE 'use 0-59, a list (0,30), a range (10-20), a step (*/15) or *' END
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        found := found || ARRAY(SELECT generate_series(a, b, step));
    END LOOP;
    RETURN ARRAY(SELECT DISTINCT v FROM unnest(found) v ORDER BY v);
END;
$$;

-- A cron expression read into the values each field allows (seconds {0} for 5 fields).
-- interval_job: the seconds (if given), minute or hour field starts with `*`, so the
-- schedule repeats within the hour or every few hours (how a repeated local hour is
-- handled depends on it, see skiplock.internal_cron_due_slot).
CREATE OR REPLACE FUNCTION skiplock.internal_cron_parse(expression text,
    OUT seconds int[], OUT minutes int[], OUT hours int[], OUT days int[], OUT months int[],
    OUT weekdays int[], OUT days_any boolean, OUT weekdays_any boolean,
    OUT interval_job boolean)
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    texts text[] := '{}';
    starts int[] := '{}';
    start int;
    o int;
BEGIN
    IF expression IS NULL OR length(expression) > 1000 THEN
        RAISE EXCEPTION 'invalid cron expression: %',
            CASE WHEN expression IS NULL THEN 'it is NULL' ELSE 'it is over 1000 characters' END
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR i IN 1 .. length(expression) + 1 LOOP
        IF i > length(expression) OR substr(expression, i, 1) ~ '\s' THEN
            IF start IS NOT NULL THEN
                texts := texts || substr(expression, start, i - start);
                starts := starts || start;
                start := NULL;
            END IF;
        ELSIF start IS NULL THEN
            start := i;
        END IF;
    END LOOP;
    IF cardinality(texts) NOT IN (5, 6) THEN
        RAISE EXCEPTION 'invalid cron expression `%`: expected 5 fields (minute hour day-of-month month day-of-week) or 6 (with seconds first), found %',
            expression, cardinality(texts)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    o := cardinality(texts) - 5;
    seconds := CASE WHEN o = 1
        THEN skiplock.internal_cron_field(expression, texts[1], 'second', starts[1], 0, 59)
        ELSE '{0}' END;
    minutes := skiplock.internal_cron_field(expression, texts[o + 1], 'minute', starts[o + 1], 0, 59);
    hours := skiplock.internal_cron_field(expression, texts[o + 2], 'hour', starts[o + 2], 0, 23);
    days := skiplock.internal_cron_field(expression, texts[o + 3], 'day-of-month', starts[o + 3], 1, 31);
    months := skiplock.internal_cron_field(expression, texts[o + 4], 'month', starts[o + 4], 1, 12,
        '{JAN,FEB,MAR,APR,MAY,JUN,JUL,AUG,SEP,OCT,NOV,DEC}', 1);
    weekdays := ARRAY(SELECT DISTINCT v % 7 FROM unnest(
        skiplock.internal_cron_field(expression, texts[o + 5], 'day-of-week', starts[o + 5], 0, 7,
            '{SUN,MON,TUE,WED,THU,FRI,SAT}', 0)) v ORDER BY 1);
    days_any := texts[o + 3] IN ('*', '?');
    weekdays_any := texts[o + 5] IN ('*', '?');
    interval_job := (o = 1 AND texts[1] LIKE '*%') OR texts[o + 1] LIKE '*%' OR texts[o + 2] LIKE '*%';
END;
$$;

-- The latest local time at or before `bound` that the fields match, looking back no
-- further than the day of `earliest`; NULL if there is none.
CREATE OR REPLACE FUNCTION skiplock.internal_cron_previous_local(
    seconds int[], minutes int[], hours int[], days int[], months int[], weekdays int[],
    days_any boolean, weekdays_any boolean, bound timestamp, earliest timestamp)
RETURNS timestamp
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    d date := bound::date;
    clock time := bound::time;
    minute_last int := minutes[cardinality(minutes)];
    second_last int := seconds[cardinality(seconds)];
    day_of_month int;
    day_fits boolean;
    week_fits boolean;
    h int;
    m int;
    s int;
BEGIN
    WHILE d >= earliest::date LOOP
        IF NOT extract(month FROM d)::int = ANY(months) THEN
            -- To the last day of the month before.
            d := date_trunc('month', d)::date - 1;
            clock := time '23:59:59';
            CONTINUE;
        END IF;
        day_of_month := extract(day FROM d)::int;
        day_fits := day_of_month = ANY(days)
            OR (32 = ANY(days) AND extract(day FROM d + 1) = 1);
        week_fits := extract(dow FROM d)::int = ANY(weekdays);
        IF (CASE WHEN days_any OR weekdays_any THEN day_fits AND week_fits
                 ELSE day_fits OR week_fits END) THEN
            FOR h IN SELECT v FROM unnest(hours) v WHERE v <= extract(hour FROM clock) ORDER BY v DESC LOOP
                IF h < extract(hour FROM clock) THEN
                    RETURN d + make_interval(hours => h, mins => minute_last, secs => second_last);
                END IF;
                FOR m IN SELECT v FROM unnest(minutes) v WHERE v <= extract(minute FROM clock) ORDER BY v DESC LOOP
                    IF m < extract(minute FROM clock) THEN
                        RETURN d + make_interval(hours => h, mins => m, secs => second_last);
                    END IF;
                    SELECT max(v) INTO s FROM unnest(seconds) v WHERE v <= floor(extract(second FROM clock));
                    IF s IS NOT NULL THEN
                        RETURN d + make_interval(hours => h, mins => m, secs => s);
                    END IF;
                END LOOP;
            END LOOP;
        END IF;
        d := d - 1;
        clock := time '23:59:59';
    END LOOP;
    RETURN NULL;
END;
$$;

-- The instant a slot named by the local time `wall` runs at, as of `now_at`:
-- - a local time a clock change skips (02:30 when 02:00 jumps to 03:00) runs as Postgres
--   reads it, moved forward by the gap (03:30);
-- - a local time that happens twice (01:30 when 02:00 goes back to 01:00) runs once, at
--   its first instant, unless the schedule is an interval job (see
--   skiplock.internal_cron_parse): then at both, as `* * * * *` runs every minute of both
--   hours, and this returns the later one once it has come.
CREATE OR REPLACE FUNCTION skiplock.internal_cron_slot_instant(wall timestamp, timezone text,
                                                               interval_job boolean,
                                                               now_at timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    later timestamptz := wall AT TIME ZONE timezone;
    -- The offset in force 3 hours before `later`: before any clock change near it (none
    -- is over 3 hours), so `earlier` is the first instant when the time happens twice.
    before timestamptz := later - interval '3 hours';
    earlier timestamptz := (wall - ((before AT TIME ZONE timezone) - (before AT TIME ZONE 'UTC')))
        AT TIME ZONE 'UTC';
BEGIN
    IF earlier < later AND (earlier AT TIME ZONE timezone) = wall
       AND (NOT interval_job OR later > now_at) THEN
        RETURN earlier;
    END IF;
    RETURN later;
END;
$$;

-- The latest slot at or before `now_at` among the local times at or before `from_wall`
-- (and not before `earliest`), looking at local times going back: with `look_below` NULL the
-- first one that has come; otherwise the latest of all down to `look_below` below the local
-- time of the best found (near a clock change, an earlier local time can be a later
-- instant).
CREATE OR REPLACE FUNCTION skiplock.internal_cron_latest_slot(expression text, timezone text,
                                                              from_wall timestamp,
                                                              earliest timestamp,
                                                              now_at timestamptz,
                                                              look_below interval)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    f record;
    wall timestamp := from_wall;
    instant timestamptz;
    best timestamptz;
BEGIN
    SELECT * INTO f FROM skiplock.internal_cron_parse(expression);
    LOOP
        wall := skiplock.internal_cron_previous_local(f.seconds, f.minutes, f.hours, f.days,
            f.months, f.weekdays, f.days_any, f.weekdays_any, wall, earliest);
        EXIT WHEN wall IS NULL OR wall < earliest;
        instant := skiplock.internal_cron_slot_instant(wall, timezone, f.interval_job, now_at);
        IF instant <= now_at AND (best IS NULL OR instant > best) THEN
            best := instant;
        END IF;
        EXIT WHEN best IS NOT NULL
            AND (look_below IS NULL OR wall < (best AT TIME ZONE timezone) - look_below);
        wall := wall - interval '1 second';
    END LOOP;
    RETURN best;
END;
$$;

-- The latest slot of `expression` in `timezone` at or before `now_at` and after
-- `done_until`, or NULL: a local time the expression matches, run at the instant
-- skiplock.internal_cron_slot_instant says.
--
-- Away from clock changes local times and instants keep the same order, so the first slot
-- found looking back from now's local time is the latest. That holds when the UTC offset
-- at that slot is the one in force now, and at every week between (any two clock changes
-- are further apart); such a slot also beats every slot of local times ahead of now's,
-- which after a clock went back may have passed, but before the change. Otherwise (a
-- clock change since the slot, or no slot and a clock that went back within the last 3
-- hours), every local time from 3 hours ahead of now's down to 3 hours below the best
-- slot is looked at.
CREATE OR REPLACE FUNCTION skiplock.internal_cron_due_slot(expression text, timezone text,
                                                           done_until timestamptz,
                                                           now_at timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    earliest timestamp := (done_until AT TIME ZONE timezone) - interval '3 hours';
    wall timestamp := date_trunc('second', now_at AT TIME ZONE timezone);
    ahead timestamp := date_trunc('second',
        ((now_at - interval '3 hours') AT TIME ZONE timezone) + interval '3 hours');
    offset_now interval := (now_at AT TIME ZONE timezone) - (now_at AT TIME ZONE 'UTC');
    best timestamptz;
BEGIN
    best := skiplock.internal_cron_latest_slot(expression, timezone, wall, earliest, now_at, NULL);
    IF (best IS NULL AND ahead > wall) OR EXISTS (
        SELECT 1 FROM generate_series(best, now_at, interval '7 days') AS g(at)
        WHERE (g.at AT TIME ZONE timezone) - (g.at AT TIME ZONE 'UTC') <> offset_now
    ) THEN
        best := skiplock.internal_cron_latest_slot(expression, timezone, greatest(ahead, wall),
                                                   earliest, now_at, interval '3 hours');
    END IF;
    RETURN CASE WHEN best > done_until THEN best END;
END;
$$;

-- Enqueues the job of each enabled schedule's due slot, and returns how many it enqueued:
-- what the Rust worker's cron pass and skiplock.maintain run. A slot produces exactly one
-- job however many sessions run this at once: a schedule with a due slot is taken with FOR
-- UPDATE SKIP LOCKED (a session that finds it taken leaves it to the one that has it) and
-- only while its last_slot_at is still before the slot, which moves forward in the
-- statement that inserts the job. Schedules with nothing due are read, not locked. With
-- missed = 'skip', a slot more than 60 seconds late is marked done without a job.
--
-- One schedule never stops the others: one that cannot produce its job (a row written by
-- hand that the jobs table refuses, say with max_attempts = 0, or a time zone Postgres no
-- longer knows) records why in its last_error, and the pass goes on. A failure that says
-- nothing about the row (a deadlock, a serialization failure, a server running out of
-- something) is left for the next pass, unrecorded.
CREATE OR REPLACE FUNCTION skiplock.internal_enqueue_cron_slots() RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    s record;
    slot timestamptz;
    enqueued int := 0;
    reason text;
BEGIN
    FOR s IN SELECT c.name, c.expression, c.timezone, c.missed, c.last_slot_at
             FROM skiplock.cron_schedules c WHERE c.enabled ORDER BY c.name LOOP
        BEGIN
            slot := skiplock.internal_cron_due_slot(s.expression, s.timezone, s.last_slot_at, now());
            CONTINUE WHEN slot IS NULL;
            -- Only a due schedule is locked (a lock is a write): taken, unless another
            -- session has it, and still not done up to this slot.
            PERFORM 1 FROM skiplock.cron_schedules c
            WHERE c.name = s.name AND c.enabled AND c.last_slot_at < slot
            FOR UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;
            IF s.missed = 'skip' AND now() - slot > interval '60 seconds' THEN
                UPDATE skiplock.cron_schedules SET last_slot_at = slot, updated_at = now()
                WHERE name = s.name;
            ELSE
                -- The job id is drawn first so the schedule records it in the same update.
                WITH advanced AS (
                    UPDATE skiplock.cron_schedules
                    SET last_slot_at = slot, updated_at = now(), last_error = NULL,
                        last_job_id = nextval(pg_get_serial_sequence('skiplock.jobs', 'id'))
                    WHERE name = s.name
                    RETURNING last_job_id, kind, args, queue, priority, max_attempts
                )
                INSERT INTO skiplock.jobs (id, kind, args, queue, priority, max_attempts, scheduled_at)
                OVERRIDING SYSTEM VALUE
                SELECT last_job_id, kind, args, queue, priority, max_attempts, slot FROM advanced;
                enqueued := enqueued + 1;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            IF left(SQLSTATE, 2) IN ('40', '53', '57', '58') OR SQLSTATE = '55P03' THEN
                CONTINUE;
            END IF;
            reason := skiplock.internal_error_message(SQLERRM);
            UPDATE skiplock.cron_schedules SET last_error = reason, updated_at = now()
            WHERE name = s.name AND last_error IS DISTINCT FROM reason;
        END;
    END LOOP;
    RETURN enqueued;
END;
$$;

-- A schedule is checked as it is written, by whoever writes it (the CLI, the Rust API,
-- plain SQL): a malformed expression or an unknown time zone is refused with the error
-- naming the bad part, so no schedule sits in the table that no worker can fire.
CREATE OR REPLACE FUNCTION skiplock.internal_cron_schedules_before_write() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR (NEW.expression, NEW.timezone) IS DISTINCT FROM (OLD.expression, OLD.timezone) THEN
        IF NEW.timezone IS NULL OR NOT EXISTS (SELECT 1 FROM pg_timezone_names WHERE name = NEW.timezone) THEN
            RAISE EXCEPTION 'unknown time zone `%`; use an IANA name such as UTC or Europe/Paris',
                NEW.timezone
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- An expression no local time matches (day 31 of February, of April and June) is
        -- refused: it would never make a job. 29 years of local times cover every calendar
        -- (days of the month, months, weekdays and leap days come round in 28).
        IF (SELECT skiplock.internal_cron_previous_local(f.seconds, f.minutes, f.hours, f.days,
                   f.months, f.weekdays, f.days_any, f.weekdays_any,
                   localtimestamp + interval '29 years', localtimestamp::timestamp)
            FROM skiplock.internal_cron_parse(NEW.expression) f) IS NULL THEN
            RAISE EXCEPTION 'cron expression `%` never fires: no date matches it (a day of the month that month never has?)',
                NEW.expression
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    RETURN NEW;
END;
$$;

-- ---- The SQL worker protocol (stable) ----------------------------------------------------
--
-- What a worker written in any language needs, each in the caller's transaction: claim,
-- heartbeat, complete, fail, discard, release, snooze, and maintain for deployments with
-- no skiplock process. Each calls the statement the Rust worker runs for the same change
-- (above), and does the follow-up (lanes, dependants, notifications) in the same
-- transaction. Fencing holds throughout: a write whose claim token is not the job's
-- current one changes nothing, and says so (false or NULL). docs/sql.md, "Write a worker
-- in any language", has the loop.

-- Claims up to max_jobs runnable jobs of one queue (every kind when kinds is NULL), in
-- claim order, respecting pause, lanes, dependencies, priority and scheduled_at. Each
-- comes back with its claim_token, which every later call about the job must present.
CREATE OR REPLACE FUNCTION skiplock.claim(queue text, max_jobs integer, worker text,
                                          kinds text[] DEFAULT NULL)
RETURNS SETOF skiplock.claimed_job
LANGUAGE plpgsql AS $$
BEGIN
    IF queue IS NULL OR queue = '' THEN
        RAISE EXCEPTION 'skiplock.claim: queue is NULL or empty; pass the queue to claim from'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF worker IS NULL OR worker = '' THEN
        RAISE EXCEPTION 'skiplock.claim: worker is NULL or empty; pass a name for this worker (host, pid)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF max_jobs IS NULL OR max_jobs < 0 OR max_jobs > 10000 THEN
        RAISE EXCEPTION 'skiplock.claim: max_jobs is %, it must be between 0 and 10000',
            coalesce(max_jobs::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF max_jobs = 0 THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT c.id, c.queue, c.kind, c.args, c.attempt, c.max_attempts, c.claim_token
    FROM skiplock.internal_claim_batch(ARRAY[claim.queue], kinds, max_jobs, worker) c;
END;
$$;

-- Extends the claims the caller still holds (heartbeat_at = the database clock) and says,
-- for each claim given, whether it is still held: false means the job was reaped,
-- cancelled, finished or deleted, and the caller must stop its work and write nothing.
CREATE OR REPLACE FUNCTION skiplock.heartbeat(ids bigint[], tokens uuid[])
RETURNS TABLE (id bigint, held boolean)
LANGUAGE plpgsql AS $$
DECLARE
    sorted_ids bigint[];
    sorted_tokens uuid[];
BEGIN
    IF ids IS NULL OR tokens IS NULL OR cardinality(ids) <> cardinality(tokens) THEN
        RAISE EXCEPTION 'skiplock.heartbeat: ids and tokens must be arrays of the same length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT array_agg(c.i ORDER BY c.i, c.t), array_agg(c.t ORDER BY c.i, c.t)
    INTO sorted_ids, sorted_tokens
    FROM unnest(ids, tokens) AS c(i, t)
    WHERE c.i IS NOT NULL AND c.t IS NOT NULL;
    RETURN QUERY
    SELECT c.i, c.i IS NOT NULL AND c.t IS NOT NULL AND gone.id IS NULL
    FROM unnest(ids, tokens) WITH ORDINALITY AS c(i, t, n)
    LEFT JOIN skiplock.internal_heartbeat_claims(coalesce(sorted_ids, '{}'),
                                                 coalesce(sorted_tokens, '{}')) gone
           ON gone.id = c.i AND gone.claim_token = c.t
    ORDER BY c.n;
END;
$$;

-- Marks a held job succeeded (with output, when given); true when the caller held the
-- claim. The next job of its lane and its waiting dependants move on in the same
-- transaction, and workers are told.
CREATE OR REPLACE FUNCTION skiplock.complete(id bigint, token uuid, output jsonb DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    attempts int := 0;
    saved record;
BEGIN
    LOOP
        BEGIN
            IF complete.output IS NOT NULL THEN
                UPDATE skiplock.jobs_live j SET output = complete.output
                WHERE j.id = complete.id AND j.claim_token = complete.token;
            END IF;
            SELECT * INTO saved
            FROM skiplock.internal_complete_claims(ARRAY[complete.id], ARRAY[complete.token]);
            IF NOT FOUND THEN
                RETURN false;
            END IF;
            PERFORM skiplock.internal_move_on(
                CASE WHEN saved.has_dependants THEN ARRAY[saved.id] ELSE '{}' END,
                CASE WHEN saved.ordering_key IS NOT NULL THEN ARRAY[saved.ordering_key] ELSE '{}' END);
            RETURN true;
        EXCEPTION WHEN serialization_failure THEN
            -- Its row moved to the other partition meanwhile: run again (see
            -- skiplock.internal_may_retry_moved).
            attempts := attempts + 1;
            IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                RAISE;
            END IF;
        END;
    END LOOP;
END;
$$;

-- One failed attempt of a held job, with the action the Rust worker's errors map to:
-- 'retry' (queued again after the delay, or dead once attempts are spent), 'dead'.
-- Returns the job's new state, NULL when the caller did not hold the claim.
CREATE OR REPLACE FUNCTION skiplock.internal_fail_one(job_id bigint, token uuid, message text,
                                                      retry_in interval, action text)
RETURNS skiplock.job_state
LANGUAGE plpgsql AS $$
DECLARE
    attempts int := 0;
    held_attempt int;
    saved record;
BEGIN
    LOOP
        BEGIN
            IF retry_in < interval '0' THEN
                RAISE EXCEPTION 'retry_in is %, it must not be negative', retry_in
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            SELECT j.attempt INTO held_attempt
            FROM skiplock.jobs_live j WHERE j.id = job_id AND j.claim_token = token;
            IF NOT FOUND THEN
                RETURN NULL;
            END IF;
            SELECT * INTO saved
            FROM skiplock.internal_fail_claims(
                ARRAY[job_id], ARRAY[token], ARRAY[skiplock.internal_error_message(message)],
                ARRAY[(extract(epoch FROM coalesce(retry_in, skiplock.backoff(held_attempt))) * 1000)::bigint],
                ARRAY[action]);
            IF NOT FOUND THEN
                RETURN NULL;
            END IF;
            IF saved.state <> 'queued' THEN
                PERFORM skiplock.internal_move_on(
                    CASE WHEN saved.has_dependants THEN ARRAY[saved.id] ELSE '{}' END,
                    CASE WHEN saved.ordering_key IS NOT NULL THEN ARRAY[saved.ordering_key] ELSE '{}' END);
            END IF;
            RETURN saved.state::skiplock.job_state;
        EXCEPTION WHEN serialization_failure THEN
            -- Its row moved to the other partition meanwhile: run again (see
            -- skiplock.internal_may_retry_moved).
            attempts := attempts + 1;
            IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                RAISE;
            END IF;
        END;
    END LOOP;
END;
$$;

-- A failed attempt: the error recorded, the job queued again after skiplock.backoff(attempt)
-- (or retry_in), or dead once its attempts are spent (its lane moves on and its waiting
-- dependants are cancelled). Returns the new state; NULL when the caller did not hold the
-- claim (nothing changed).
CREATE OR REPLACE FUNCTION skiplock.fail(id bigint, token uuid, error text,
                                         retry_in interval DEFAULT NULL)
RETURNS skiplock.job_state
LANGUAGE sql AS $$
    SELECT skiplock.internal_fail_one(id, token, error, retry_in, 'retry');
$$;

-- A failure no retry will mend: the job is dead now, whatever attempts it has left.
CREATE OR REPLACE FUNCTION skiplock.discard(id bigint, token uuid, error text)
RETURNS skiplock.job_state
LANGUAGE sql AS $$
    SELECT skiplock.internal_fail_one(id, token, error, NULL, 'dead');
$$;

-- Gives a held job back without counting the attempt (a worker that stops before running
-- it): queued again at once, in its place in line. True when the caller held the claim.
CREATE OR REPLACE FUNCTION skiplock.release(id bigint, token uuid) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    attempts int := 0;
BEGIN
    LOOP
        BEGIN
            RETURN EXISTS (SELECT FROM skiplock.internal_release_claims(
                ARRAY[release.id], ARRAY[release.token], ARRAY[0::bigint]));
        EXCEPTION WHEN serialization_failure THEN
            -- Its row moved to the other partition meanwhile: run again (see
            -- skiplock.internal_may_retry_moved).
            attempts := attempts + 1;
            IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                RAISE;
            END IF;
        END;
    END LOOP;
END;
$$;

-- Puts a held job back to run again after delay, without counting the attempt (a handler
-- waiting for something). True when the caller held the claim.
CREATE OR REPLACE FUNCTION skiplock.snooze(id bigint, token uuid, delay interval)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    attempts int := 0;
BEGIN
    LOOP
        BEGIN
            IF delay IS NULL OR delay < interval '0' THEN
                RAISE EXCEPTION 'skiplock.snooze: delay is %, it must be an interval of zero or more',
                    coalesce(delay::text, 'NULL')
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            RETURN EXISTS (SELECT FROM skiplock.internal_release_claims(
                ARRAY[snooze.id], ARRAY[snooze.token],
                ARRAY[greatest((extract(epoch FROM delay) * 1000)::bigint, 1)]));
        EXCEPTION WHEN serialization_failure THEN
            -- Its row moved to the other partition meanwhile: run again (see
            -- skiplock.internal_may_retry_moved).
            attempts := attempts + 1;
            IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                RAISE;
            END IF;
        END;
    END LOOP;
END;
$$;

-- ---- Batch outcomes of the SQL worker protocol: complete_many, fail_many ----------------
--
-- The outcomes of many claims in one call and one transaction, as the Rust worker's
-- completer saves them, so that a worker in another language pays one round trip per batch
-- instead of one per job. Each state change goes through the statement its single-job form
-- uses (internal_complete_claims for complete, internal_fail_claims for fail) with the claims
-- sorted by id, so that rows are locked in the order every other writer locks them; the
-- lanes and dependants of the jobs that finished move on once for the batch
-- (internal_move_on). A stale claim changes nothing for its job and the others go through.
--
-- One row never stops the others: when the batch fails for a reason of its rows (a trigger
-- of yours refuses one, say), the claims are saved one at a time, each in a subtransaction,
-- and one that still fails goes `dead` with the reason (internal_abandon_claims), as the
-- Rust worker does (src/worker/split_write.rs). A job moved to the other partition under
-- the pass (40001) runs the pass again (see skiplock.internal_may_retry_moved). Another
-- error of the server or the transaction rather than of a row (serialization failure,
-- deadlock, lock_timeout, a read-only server, a lost prepared statement: those the Rust
-- worker retries, src/error.rs) fails the call, which then changed nothing, for the caller
-- to retry.

-- One pass of an outcome ('complete', or 'retry' for a failed attempt) over claims sorted by
-- id, as the single-job forms save it; returns the claims it changed, as the statements
-- under it return them. For 'retry', a NULL retry_in is skiplock.backoff(attempt).
CREATE OR REPLACE FUNCTION skiplock.internal_save_outcomes(outcome text, ids bigint[], tokens uuid[],
                                                           outputs jsonb[], messages text[],
                                                           retry_ins interval[])
RETURNS TABLE (id bigint, state text, has_dependants boolean, ordering_key text)
LANGUAGE plpgsql AS $$
BEGIN
    IF outcome = 'complete' THEN
        IF EXISTS (SELECT FROM unnest(outputs) AS o(output) WHERE o.output IS NOT NULL) THEN
            -- Every held row locked first, in id order: updating the rows with an output,
            -- then all of them, would lock them out of order.
            PERFORM 1 FROM unnest(ids, tokens) AS c(id, token),
                LATERAL (SELECT FROM skiplock.jobs_live j
                         WHERE j.id = c.id AND j.claim_token = c.token
                         FOR UPDATE) l;
            UPDATE skiplock.jobs_live j SET output = c.output
            FROM unnest(ids, tokens, outputs) AS c(id, token, output)
            WHERE c.output IS NOT NULL AND j.id = c.id AND j.claim_token = c.token;
        END IF;
        RETURN QUERY SELECT * FROM skiplock.internal_complete_claims(ids, tokens);
    ELSE
        -- The attempt of each held claim, for its backoff: it cannot change while the token
        -- holds (a new claim brings a new token). One primary-key probe per claim.
        RETURN QUERY SELECT * FROM skiplock.internal_fail_claims(
            ids, tokens,
            ARRAY(SELECT skiplock.internal_error_message(f.message)
                  FROM unnest(messages) WITH ORDINALITY AS f(message, n) ORDER BY f.n),
            ARRAY(SELECT (extract(epoch FROM coalesce(f.retry_in, skiplock.backoff(h.attempt)))
                          * 1000)::bigint
                  FROM unnest(ids, tokens, retry_ins) WITH ORDINALITY AS f(id, token, retry_in, n)
                  LEFT JOIN LATERAL (SELECT j.attempt FROM skiplock.jobs_live j
                                     WHERE j.id = f.id AND j.claim_token = f.token
                                     LIMIT 1) h ON true
                  ORDER BY f.n),
            array_fill('retry'::text, ARRAY[cardinality(ids)]));
    END IF;
END;
$$;

-- The batch form behind complete_many and fail_many: checks the arguments, sorts the claims
-- by id, saves them in one pass (or one at a time when the pass fails for a row: see above),
-- moves on what finished, and returns one row per claim given, in the order given: the
-- job's state now, NULL when the claim was not held (nothing changed).
CREATE OR REPLACE FUNCTION skiplock.internal_save_outcomes_many(caller text, outcome text,
                                                                ids bigint[], tokens uuid[],
                                                                outputs jsonb[], messages text[],
                                                                retry_ins interval[])
RETURNS TABLE (id bigint, state skiplock.job_state)
LANGUAGE plpgsql AS $$
DECLARE
    s_ids bigint[];
    s_tokens uuid[];
    s_outputs jsonb[];
    s_messages text[];
    s_retry_ins interval[];
    saved_ids bigint[] := '{}';
    saved_states text[] := '{}';
    finished bigint[] := '{}';
    lanes text[] := '{}';
    one record;
    reason text;
    i int;
    attempts int := 0;
BEGIN
    IF ids IS NULL OR tokens IS NULL OR cardinality(ids) <> cardinality(tokens)
       OR cardinality(outputs) <> cardinality(ids) OR cardinality(retry_ins) <> cardinality(ids)
       OR (outcome = 'retry' AND (messages IS NULL OR cardinality(messages) <> cardinality(ids))) THEN
        RAISE EXCEPTION 'skiplock.%: the arrays must have one element per claim (ids has %)',
            caller, coalesce(cardinality(ids)::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF (SELECT count(c.i) <> count(DISTINCT c.i) FROM unnest(ids) AS c(i)) THEN
        RAISE EXCEPTION 'skiplock.%: a job id appears twice in ids; give each claim once', caller
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT FROM unnest(retry_ins) AS r(delay) WHERE r.delay < interval '0') THEN
        RAISE EXCEPTION 'skiplock.%: a retry_in is negative; give NULL (the backoff) or zero or more', caller
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- A claim with a NULL id or token is not held: left out, and its result is NULL.
    SELECT array_agg(c.i ORDER BY c.i), array_agg(c.t ORDER BY c.i), array_agg(c.o ORDER BY c.i),
           array_agg(c.m ORDER BY c.i), array_agg(c.r ORDER BY c.i)
    INTO s_ids, s_tokens, s_outputs, s_messages, s_retry_ins
    FROM unnest(ids, tokens, outputs, messages, retry_ins) AS c(i, t, o, m, r)
    WHERE c.i IS NOT NULL AND c.t IS NOT NULL;
    WHILE s_ids IS NOT NULL LOOP
        BEGIN
            SELECT coalesce(array_agg(o.id), '{}'), coalesce(array_agg(o.state), '{}'),
                   coalesce(array_agg(o.id) FILTER (WHERE o.state <> 'queued' AND o.has_dependants),
                            '{}'),
                   coalesce(array_agg(o.ordering_key)
                                FILTER (WHERE o.state <> 'queued' AND o.ordering_key IS NOT NULL),
                            '{}')
            INTO saved_ids, saved_states, finished, lanes
            FROM skiplock.internal_save_outcomes(outcome, s_ids, s_tokens, s_outputs, s_messages,
                                                 s_retry_ins) o;
            EXIT;
        EXCEPTION
            WHEN serialization_failure THEN
                -- A row moved to the other partition of skiplock.jobs meanwhile: the pass
                -- runs again (see skiplock.internal_may_retry_moved).
                attempts := attempts + 1;
                IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                    RAISE;
                END IF;
            WHEN transaction_rollback OR lock_not_available OR read_only_sql_transaction
                 OR insufficient_resources OR operator_intervention OR connection_exception
                 OR invalid_sql_statement_name THEN
                RAISE;
            WHEN OTHERS THEN
                FOR i IN 1 .. cardinality(s_ids) LOOP
                    BEGIN
                        SELECT * INTO one
                        FROM skiplock.internal_save_outcomes(
                            outcome, ARRAY[s_ids[i]], ARRAY[s_tokens[i]], ARRAY[s_outputs[i]],
                            ARRAY[s_messages[i]], ARRAY[s_retry_ins[i]]);
                    EXCEPTION
                        WHEN transaction_rollback OR lock_not_available OR read_only_sql_transaction
                             OR insufficient_resources OR operator_intervention
                             OR connection_exception OR invalid_sql_statement_name THEN
                            RAISE;
                        WHEN OTHERS THEN
                            reason := SQLERRM;
                            BEGIN
                                SELECT * INTO one
                                FROM skiplock.internal_abandon_claims(
                                    ARRAY[s_ids[i]], ARRAY[s_tokens[i]],
                                    skiplock.internal_error_message(
                                        'the outcome of this attempt could not be saved: ' || reason));
                            EXCEPTION
                                WHEN transaction_rollback OR lock_not_available
                                     OR read_only_sql_transaction OR insufficient_resources
                                     OR operator_intervention OR connection_exception
                                     OR invalid_sql_statement_name THEN
                                    RAISE;
                                WHEN OTHERS THEN
                                    RAISE WARNING 'skiplock.%: job % could not be saved (%) nor marked dead (%); it stays running until maintain takes it back',
                                        caller, s_ids[i], reason, SQLERRM;
                                    saved_ids := saved_ids || s_ids[i];
                                    saved_states := saved_states || 'running'::text;
                                    CONTINUE;
                            END;
                    END;
                    IF FOUND THEN
                        saved_ids := saved_ids || one.id;
                        saved_states := saved_states || one.state;
                        IF one.state <> 'queued' AND one.has_dependants THEN
                            finished := finished || one.id;
                        END IF;
                        IF one.state <> 'queued' AND one.ordering_key IS NOT NULL THEN
                            lanes := lanes || one.ordering_key;
                        END IF;
                    END IF;
                END LOOP;
                EXIT;
        END;
    END LOOP;
    PERFORM skiplock.internal_move_on(finished, lanes);
    RETURN QUERY
    SELECT c.i, s.state::skiplock.job_state
    FROM unnest(ids) WITH ORDINALITY AS c(i, n)
    LEFT JOIN unnest(saved_ids, saved_states) AS s(id, state) ON s.id = c.i
    ORDER BY c.n;
END;
$$;

-- Marks held jobs succeeded (each with its output, when outputs gives one), in one
-- transaction; the next job of each lane and the waiting dependants move on in it, and
-- workers are told. One row per claim given, in the order given: 'succeeded'; 'dead' when
-- the row refused the change (the reason in last_error); NULL when the claim was not held.
CREATE OR REPLACE FUNCTION skiplock.complete_many(ids bigint[], tokens uuid[],
                                                  outputs jsonb[] DEFAULT NULL)
RETURNS TABLE (id bigint, state skiplock.job_state)
LANGUAGE sql AS $$
    SELECT * FROM skiplock.internal_save_outcomes_many('complete_many', 'complete', ids, tokens,
                                                       outputs, NULL, NULL);
$$;

-- Failed attempts of held jobs, in one transaction: each error recorded, each job queued
-- again after skiplock.backoff(attempt) (or its retry_in), or dead once its attempts are
-- spent (its lane moves on and its waiting dependants are cancelled). One row per claim
-- given, in the order given: the job's new state; NULL when the claim was not held.
CREATE OR REPLACE FUNCTION skiplock.fail_many(ids bigint[], tokens uuid[], errors text[],
                                              retry_in interval[] DEFAULT NULL)
RETURNS TABLE (id bigint, state skiplock.job_state)
LANGUAGE sql AS $$
    SELECT * FROM skiplock.internal_save_outcomes_many('fail_many', 'retry', ids, tokens, NULL,
                                                       errors, retry_in);
$$;

-- maintain's reap: takes back the stale claims (up to max_jobs, or only_id alone) and
-- returns how many, with the jobs among them that finished (dead, or superseded by the
-- holder of their unique_key) and those jobs' lanes, for the follow-up.
CREATE OR REPLACE FUNCTION skiplock.internal_reap_stale_tally(stale_after_ms bigint, max_jobs bigint,
                                                              only_id bigint DEFAULT NULL,
                                                              OUT reaped bigint, OUT finished bigint[],
                                                              OUT lanes text[])
LANGUAGE sql AS $$
    SELECT count(*),
           coalesce(array_agg(r.id) FILTER (WHERE r.state <> 'queued'), '{}'),
           coalesce(array_agg(r.ordering_key)
                        FILTER (WHERE r.state <> 'queued' AND r.ordering_key IS NOT NULL), '{}')
    FROM skiplock.internal_reap_stale(stale_after_ms, max_jobs, only_id) r;
$$;

-- One pass of what a running worker's maintenance does, for deployments with no skiplock
-- process (call it from pg_cron, or from the workers' own loop every few seconds): running
-- jobs whose heartbeat is older than stale_after are taken back (queued with backoff, or
-- dead once their attempts are spent, the reason in last_error), at most 1,000 a call; then
-- the dependants and lanes of what finished are settled, with the sweep that repairs races.
-- Last, the job of each cron schedule's due slot is enqueued
-- (skiplock.internal_enqueue_cron_slots). Safe from many sessions at once (SKIP LOCKED,
-- conditional updates): each stale job is taken back once, each slot enqueued once.
--
-- One row never stops the others, as in the Rust reaper (src/maintenance/reaper.rs): when a
-- row fails the batch (a trigger of the user's, say), the batch rolls back and the stale
-- claims are taken back one at a time, each in a subtransaction; a job that still fails
-- goes dead with the reason in last_error, and if even that fails, a warning names it.
CREATE OR REPLACE FUNCTION skiplock.maintain(stale_after interval DEFAULT '30 seconds')
RETURNS TABLE (reaped bigint, moved_on bigint, cron_enqueued bigint)
LANGUAGE plpgsql AS $$
DECLARE
    stale_ms bigint;
    stale record;
    one record;
    total bigint := 0;
    finished bigint[] := '{}';
    lanes text[] := '{}';
    reason text;
BEGIN
    IF stale_after IS NULL OR stale_after <= interval '0' THEN
        RAISE EXCEPTION 'skiplock.maintain: stale_after is %, it must be a positive interval',
            coalesce(stale_after::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    stale_ms := (extract(epoch FROM stale_after) * 1000)::bigint;
    BEGIN
        SELECT * INTO STRICT one FROM skiplock.internal_reap_stale_tally(stale_ms, 1000);
        total := one.reaped;
        finished := one.finished;
        lanes := one.lanes;
    EXCEPTION WHEN OTHERS THEN
        FOR stale IN SELECT * FROM skiplock.internal_stale_claims(stale_ms, 1000) LOOP
            BEGIN
                SELECT * INTO STRICT one
                FROM skiplock.internal_reap_stale_tally(stale_ms, 1, stale.id);
            EXCEPTION
                WHEN serialization_failure OR deadlock_detected OR lock_not_available THEN
                    -- Transient (the row moved or was locked meanwhile): the next pass
                    -- takes it back, as the Rust reaper does.
                    CONTINUE;
                WHEN OTHERS THEN
                    reason := SQLERRM;
                    BEGIN
                        SELECT count(*) AS reaped, coalesce(array_agg(a.id), '{}') AS finished,
                               coalesce(array_agg(a.ordering_key)
                                            FILTER (WHERE a.ordering_key IS NOT NULL), '{}') AS lanes
                        INTO STRICT one
                        FROM skiplock.internal_abandon_claims(
                            ARRAY[stale.id], ARRAY[stale.claim_token],
                            skiplock.internal_error_message(
                                'taken back from a stale claim, but could not be requeued: ' || reason)) a;
                    EXCEPTION WHEN OTHERS THEN
                        RAISE WARNING 'skiplock.maintain: job % could not be taken back (%) nor marked dead (%)',
                            stale.id, reason, SQLERRM;
                        CONTINUE;
                    END;
            END;
            total := total + one.reaped;
            finished := finished || one.finished;
            lanes := lanes || one.lanes;
        END LOOP;
    END;
    -- The days ahead of finished jobs, for deployments where no Rust worker's pruner runs.
    PERFORM skiplock.internal_prepare_done_partitions();
    RETURN QUERY SELECT total,
        (skiplock.internal_move_on(finished, lanes) + skiplock.internal_settle_waiting())::bigint,
        skiplock.internal_enqueue_cron_slots()::bigint;
END;
$$;

-- ---- Operator actions --------------------------------------------------------------------

-- One attempt at cancelling a job that has not finished; skiplock.cancel_job wraps it. A
-- queued or waiting job never runs; a running job is marked cancelled, its claim is void
-- (the holder's completion changes nothing) and the worker holding it is told at once, so
-- it stops the handler. Dependants are settled and the job's lane moves on.
CREATE OR REPLACE FUNCTION skiplock.internal_cancel_job_once(job_id bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    previous skiplock.job_state;
    job_queue text;
BEGIN
    SELECT state, queue INTO previous, job_queue FROM skiplock.jobs WHERE id = job_id FOR UPDATE;
    IF previous IS NULL OR previous NOT IN ('waiting', 'queued', 'running') THEN
        RETURN false;
    END IF;
    UPDATE skiplock.jobs
    SET state = 'cancelled', finished_at = now(), claim_token = NULL, heartbeat_at = NULL,
        last_error = coalesce(last_error, 'cancelled by operator')
    WHERE id = job_id;
    IF previous = 'running' THEN
        PERFORM pg_notify('skiplock_cancel', job_id::text);
        PERFORM skiplock.internal_notify_freed(ARRAY[job_queue]);
    END IF;
    PERFORM skiplock.internal_settle_dependants(ARRAY[job_id]);
    PERFORM skiplock.internal_advance_lanes(ARRAY(
        SELECT ordering_key FROM skiplock.jobs WHERE id = job_id AND ordering_key IS NOT NULL));
    RETURN true;
END;
$$;
COMMENT ON FUNCTION skiplock.internal_cancel_job_once(bigint) IS
    'One attempt of skiplock.cancel_job, without the deadlock retry; call cancel_job instead.';

-- Cancel a job that has not finished, surviving being chosen as a deadlock victim.
--
-- cancel_job_once locks its job, then (through advance_lanes and settle_dependants) the
-- next job of its lane and its waiting children. A transaction that already holds one of
-- those and then waits for the cancelled job closes a cycle, and Postgres aborts one side
-- after deadlock_timeout. When that side is the cancel, it rolls back only its own work
-- (each attempt runs in a subtransaction, so its row locks go too), which lets the other
-- side finish, and tries again. This works inside the caller's transaction as well, which
-- a client-side retry cannot.
--
-- A retry at once would not do: a row whose locker has just rolled back is free to
-- whoever asks first, and the other side, woken, still has to be scheduled to take it,
-- while the retry is already running in this backend; it would take the cancelled job's
-- row again, wait again for the row the other side holds and close the same cycle (seen
-- as an intermittent failure of
-- control::a_cancel_chosen_as_deadlock_victim_retries_and_succeeds). So each retry first
-- sleeps a short, growing, jittered while (10 to 20 ms, then twice that each time, below
-- a second in all) so the other side takes its lock and finishes; after six attempts the
-- error reaches the caller.
CREATE OR REPLACE FUNCTION skiplock.cancel_job(job_id bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    attempts int := 0;
BEGIN
    LOOP
        BEGIN
            RETURN skiplock.internal_cancel_job_once(job_id);
        EXCEPTION WHEN deadlock_detected OR serialization_failure THEN
            attempts := attempts + 1;
            IF attempts >= 6 THEN
                RAISE;
            END IF;
        END;
        -- Outside the subtransaction: its locks are gone while this sleeps.
        PERFORM pg_sleep(0.01 * power(2, attempts - 1) * (1 + random()));
    END LOOP;
END;
$$;
COMMENT ON FUNCTION skiplock.cancel_job(bigint) IS
    'Cancels a job that has not finished; retries a deadlock after a short jittered wait. Returns false if the job had finished or does not exist.';

CREATE OR REPLACE FUNCTION skiplock.retry_job(job_id bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    attempts int := 0;
    q text;
    p smallint;
    s timestamptz;
    now_state skiplock.job_state;
    lane text;
    key text;
    current skiplock.job_state;
    holder bigint;
BEGIN
    LOOP
        BEGIN
            -- The lane's and the unique key's locks before the row's, in the order an enqueue
            -- takes them: an enqueue holding the key's lock locks the key's pending job next, so
            -- a retry of that job that locked its row first and then waited for the key deadlocked.
            SELECT ordering_key, unique_key INTO lane, key FROM skiplock.jobs WHERE id = job_id;
            IF lane IS NOT NULL THEN
                PERFORM pg_advisory_xact_lock(hashtextextended('skiplock.lane:' || lane, 0));
            END IF;
            IF key IS NOT NULL THEN
                PERFORM pg_advisory_xact_lock(skiplock.internal_unique_key_lock_id(key));
            END IF;
            SELECT state INTO current FROM skiplock.jobs WHERE id = job_id FOR UPDATE;
            IF current IS NULL OR current NOT IN ('queued', 'dead', 'cancelled', 'succeeded') THEN
                RETURN false;
            END IF;
            holder := skiplock.internal_fold_into_key_holder(job_id);
            UPDATE skiplock.jobs j
            SET state = CASE
                    WHEN holder IS NOT NULL THEN 'cancelled'
                    WHEN lane IS NOT NULL AND EXISTS (
                        SELECT 1 FROM skiplock.jobs o
                        WHERE o.ordering_key = lane AND o.id <> job_id
                          AND o.state IN ('waiting', 'queued', 'running'))
                    THEN 'waiting'
                    WHEN skiplock.internal_has_unmet_parent(j.id) THEN 'waiting'
                    ELSE 'queued' END::skiplock.job_state,
                scheduled_at = now(),
                max_attempts = greatest(max_attempts, attempt + 1),
                finished_at = CASE WHEN holder IS NOT NULL THEN now() END,
                last_error = CASE WHEN holder IS NOT NULL
                    THEN skiplock.internal_superseded_message(holder, unique_key) ELSE last_error END
            WHERE id = job_id AND state IN ('queued', 'dead', 'cancelled', 'succeeded')
            RETURNING queue, priority, scheduled_at, state INTO q, p, s, now_state;
            IF q IS NULL THEN
                RETURN false;
            END IF;
            IF lane IS NOT NULL THEN
                PERFORM skiplock.internal_advance_lanes(ARRAY[lane]);
            END IF;
            -- A child of a dead, cancelled or deleted parent is cancelled again at once, with the
            -- reason.
            PERFORM skiplock.internal_settle_dependants(ARRAY(
                SELECT d.parent_id FROM skiplock.job_dependencies d WHERE d.job_id = retry_job.job_id));
            IF now_state = 'queued' THEN
                PERFORM skiplock.internal_notify_runnable(q, p, s);
            END IF;
            RETURN true;
        EXCEPTION WHEN serialization_failure THEN
            -- Its row moved to the other partition meanwhile: run again (see
            -- skiplock.internal_may_retry_moved).
            attempts := attempts + 1;
            IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                RAISE;
            END IF;
        END;
    END LOOP;
END;
$$;

-- Put every dead job (of one queue, or of all when queue_name is NULL) back in line, as
-- skiplock.retry_job does for one. Returns the ids retried. A dead job whose unique_key is
-- taken is superseded by retry_job, not refused; the exception handler is for anything
-- else a single row may raise: that job is left dead with a warning, so one row never
-- fails the whole call. Example: SELECT count(*) FROM skiplock.retry_dead_jobs('mail');
CREATE OR REPLACE FUNCTION skiplock.retry_dead_jobs(queue_name text DEFAULT NULL) RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
DECLARE
    dead_id bigint;
BEGIN
    FOR dead_id IN
        SELECT id FROM skiplock.jobs
        WHERE state = 'dead' AND (queue_name IS NULL OR queue = queue_name)
        ORDER BY id
    LOOP
        BEGIN
            IF skiplock.retry_job(dead_id) THEN
                RETURN NEXT dead_id;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'skiplock.retry_dead_jobs: job % left dead: %', dead_id, SQLERRM;
        END;
    END LOOP;
END;
$$;

-- Refuses a NULL or empty queue name, for the functions that write a queue's row.
CREATE OR REPLACE FUNCTION skiplock.internal_check_queue_name(queue_name text) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF queue_name IS NULL OR queue_name = '' THEN
        RAISE EXCEPTION 'a queue name cannot be empty'
            USING ERRCODE = 'check_violation',
                  HINT = 'pass the queue''s name as its jobs have it in skiplock.jobs.queue';
    END IF;
END;
$$;

-- Pausing and resuming write the same row; one function checks the name and writes it.
CREATE OR REPLACE FUNCTION skiplock.internal_set_queue_paused(queue_name text, paused boolean) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM skiplock.internal_check_queue_name(queue_name);
    INSERT INTO skiplock.queues AS q (name, paused) VALUES (queue_name, internal_set_queue_paused.paused)
    ON CONFLICT (name) DO UPDATE SET paused = excluded.paused, updated_at = now();
END;
$$;

-- Sets a queue's global limits, each NULL for none: at most max_running jobs running at
-- once, and at most rate_limit starts in any window of rate_period. The same as writing the
-- columns of its skiplock.queues row, which plain SQL may do; this checks the values with
-- errors that say what to pass.
CREATE OR REPLACE FUNCTION skiplock.set_queue_limits(queue_name text, max_running int,
                                                     rate_limit int DEFAULT NULL,
                                                     rate_period interval DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM skiplock.internal_check_queue_name(queue_name);
    IF max_running < 1 THEN
        RAISE EXCEPTION 'max_running is %, it must be at least 1', max_running
            USING ERRCODE = 'check_violation',
                  HINT = 'NULL removes the limit; to stop claiming, pause the queue (skiplock.pause_queue)';
    END IF;
    IF rate_limit < 1 OR rate_limit > 100000 THEN
        RAISE EXCEPTION 'rate_limit is %, it must be between 1 and 100000', rate_limit
            USING ERRCODE = 'check_violation',
                  HINT = 'for more starts per period, use a shorter period: 100000 a minute is 1667 a second';
    END IF;
    IF (rate_limit IS NULL) <> (rate_period IS NULL) THEN
        RAISE EXCEPTION 'rate_limit and rate_period go together: both or neither'
            USING ERRCODE = 'check_violation',
                  HINT = 'e.g. rate_limit => 100, rate_period => ''1 second''';
    END IF;
    IF rate_period <= interval '0' THEN
        RAISE EXCEPTION 'rate_period is %, it must be longer than zero', rate_period
            USING ERRCODE = 'check_violation';
    END IF;
    INSERT INTO skiplock.queues AS q (name, max_running, rate_limit, rate_period)
    VALUES (queue_name, set_queue_limits.max_running, set_queue_limits.rate_limit,
            set_queue_limits.rate_period)
    ON CONFLICT (name) DO UPDATE
    SET max_running = excluded.max_running, rate_limit = excluded.rate_limit,
        rate_period = excluded.rate_period, updated_at = now();
END;
$$;
COMMENT ON FUNCTION skiplock.set_queue_limits(text, int, int, interval) IS
    'Sets a queue''s global limits across every worker (NULL: none): max_running jobs at once, rate_limit starts per rate_period. Example: SELECT skiplock.set_queue_limits(''exports'', max_running => 5); SELECT skiplock.set_queue_limits(''mail'', NULL, 100, ''1 second'');';

CREATE OR REPLACE FUNCTION skiplock.pause_queue(queue_name text) RETURNS void
LANGUAGE sql AS $$
    SELECT skiplock.internal_set_queue_paused(queue_name, true);
$$;

-- Why a job that has not finished is not running now, in words (NULL for a running or
-- finished job, or none by that id): what `skiplock show` prints as `why`. One job's
-- lookups: its lane's head, its parents, its queue's row and (under a limit) the queue's
-- running jobs, at most max_running of them.
CREATE OR REPLACE FUNCTION skiplock.why_not_running(job_id bigint) RETURNS text
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    job skiplock.jobs;
    queue_row skiplock.queues;
    ahead bigint;
    parents text;
    running bigint;
    rate_next timestamptz;
BEGIN
    SELECT * INTO job FROM skiplock.jobs_live j WHERE j.id = job_id;
    IF job.id IS NULL OR job.state = 'running' THEN
        RETURN NULL;
    END IF;
    IF job.state = 'waiting' THEN
        IF job.ordering_key IS NOT NULL THEN
            SELECT min(h.id) INTO ahead FROM skiplock.jobs_live h
            WHERE h.ordering_key = job.ordering_key AND h.id < job.id;
            IF ahead IS NOT NULL THEN
                RETURN format('waits behind job %s of its lane %L: a lane runs its jobs one at a time, in order',
                              ahead, job.ordering_key);
            END IF;
        END IF;
        SELECT string_agg(d.parent_id::text, ', ' ORDER BY d.parent_id) INTO parents
        FROM skiplock.job_dependencies d
        LEFT JOIN LATERAL (SELECT p.state FROM skiplock.jobs p WHERE p.id = d.parent_id LIMIT 1) p ON true
        WHERE d.job_id = job.id AND p.state IS DISTINCT FROM 'succeeded' AND d.parent_state IS NULL;
        IF parents IS NOT NULL THEN
            RETURN format('waits for its parent jobs to succeed: %s', parents);
        END IF;
        RETURN 'waiting; the next pass of a worker''s sweep (or skiplock.maintain) queues it';
    END IF;
    IF job.scheduled_at > now() THEN
        RETURN format('scheduled: runnable from %s', job.scheduled_at);
    END IF;
    SELECT * INTO queue_row FROM skiplock.queues q WHERE q.name = job.queue;
    IF queue_row.paused THEN
        RETURN format('queue %L is paused (skiplock queue resume %s)', job.queue, job.queue);
    END IF;
    IF queue_row.max_running IS NOT NULL THEN
        SELECT count(*) INTO running
        FROM (SELECT FROM skiplock.jobs_live j
              WHERE j.queue = job.queue AND j.state = 'running'
              LIMIT queue_row.max_running) r;
        IF running >= queue_row.max_running THEN
            RETURN format('held back by the queue''s max_running: %s of queue %L''s jobs run, its limit',
                          running, job.queue);
        END IF;
    END IF;
    IF queue_row.rate_limit IS NOT NULL THEN
        SELECT s.started_at + queue_row.rate_period INTO rate_next
        FROM skiplock.queue_rate_rings g
        JOIN skiplock.queue_rate_starts s
          ON s.queue = g.queue
         AND s.slot = (g.next_slot + g.size - queue_row.rate_limit) % g.size
        WHERE g.queue = job.queue AND g.size >= queue_row.rate_limit;
        IF rate_next > now() THEN
            RETURN format('held back by the queue''s rate limit: %s starts of queue %L in %s; the next may start at %s',
                          queue_row.rate_limit, job.queue, queue_row.rate_period, rate_next);
        END IF;
    END IF;
    RETURN format('runnable: the next free worker of queue %L takes it in claim order (priority, scheduled_at, id)',
                  job.queue);
END;
$$;
COMMENT ON FUNCTION skiplock.why_not_running(bigint) IS
    'Why a job that has not finished is not running now, in words: its lane, its parents, its schedule, a paused queue, a global limit, or waiting for a worker (NULL for a running or finished job). Example: SELECT skiplock.why_not_running(42);';

-- Workers look at a resumed queue from the start (the trigger on skiplock.queues).
CREATE OR REPLACE FUNCTION skiplock.resume_queue(queue_name text) RETURNS void
LANGUAGE sql AS $$
    SELECT skiplock.internal_set_queue_paused(queue_name, false);
$$;

-- ---- History rollup ----------------------------------------------------------------------

-- Upper bounds, in seconds, of the run-time histogram buckets. Their number (16) is fixed:
-- src/db/history.rs counts 17 intervals.
CREATE OR REPLACE FUNCTION skiplock.internal_job_history_run_bounds() RETURNS float8[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT '{0.005,0.01,0.025,0.05,0.1,0.25,0.5,1,2.5,5,10,30,60,300,900,3600}'::float8[];
$$;

-- Element-wise sum; the shorter array counts as padded with zeros.
CREATE OR REPLACE FUNCTION skiplock.internal_job_history_array_add(a bigint[], b bigint[]) RETURNS bigint[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(array_agg(coalesce(x, 0) + coalesce(y, 0) ORDER BY n), '{}')
    FROM unnest(coalesce(a, '{}'), coalesce(b, '{}')) WITH ORDINALITY AS t(x, y, n);
$$;

CREATE OR REPLACE AGGREGATE skiplock.internal_job_history_array_sum(bigint[]) (
    SFUNC = skiplock.internal_job_history_array_add,
    STYPE = bigint[],
    INITCOND = '{}'
);

-- ---- Finished jobs by day: partitions and retention --------------------------------------
--
-- skiplock.jobs_done is partitioned by (state, finished_at): one partition per finished
-- state and UTC day, jobs_done_<state>_<yyyymmdd>, and jobs_done_default for the rest (see
-- migrations/0001_initial.sql). Retention drops a day whole once every row in it is past
-- its state's retention (src/maintenance/pruner.rs): it rolls the day up into
-- skiplock.job_history, settles what other jobs knew of it, and drops the table, deleting
-- no row.
--
-- Creating or dropping a partition takes an ACCESS EXCLUSIVE lock on jobs_done for an
-- instant, and completions (they move rows into it) queue behind the request: every
-- function here waits at most lock_timeout (100 ms) for a lock and leaves the work to its
-- next call when it is busy. Each runs as its owner (SECURITY DEFINER), which owns the
-- partitions: a worker role needs no DDL privilege.

-- The day partitions of jobs_done: name, state and the instants they hold, [starts, ends).
-- Read from the catalog by name, which only internal_prepare_done_partitions gives.
CREATE OR REPLACE FUNCTION skiplock.internal_done_partitions()
RETURNS TABLE (leaf text, state skiplock.job_state, starts timestamptz, ends timestamptz)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT c.relname::text, m[1]::skiplock.job_state,
           to_date(m[2], 'YYYYMMDD')::timestamp AT TIME ZONE 'UTC',
           (to_date(m[2], 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC'
    FROM pg_inherits i
    JOIN pg_class c ON c.oid = i.inhrelid
    CROSS JOIN LATERAL regexp_match(c.relname, '^jobs_done_(succeeded|dead|cancelled)_([0-9]{8})$') m
    WHERE i.inhparent = 'skiplock.jobs_done'::regclass AND m IS NOT NULL
    ORDER BY 3, 1;
$$;

-- Rows of state `finished` finished at or before this instant are the pruner's to delete
-- one statement at a time, under a retention of retention_ms milliseconds:
--   * a retention shorter than a day (a day partition holds rows older and younger than
--     it): every row past it;
--   * a day or more: only rows past it and older than the oldest day partition of that
--     state, which are in jobs_done_default (a day nobody prepared, or finished_at written
--     by hand). The rest go with their day, dropped whole once it is all past retention: a
--     job is kept at least its retention and at most a day longer.
-- NULL (no retention given) deletes nothing.
CREATE OR REPLACE FUNCTION skiplock.internal_prune_cutoff(finished skiplock.job_state, retention_ms bigint)
RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN retention_ms < 86400000 THEN now() - retention_ms * interval '1 millisecond'
        ELSE least(now() - retention_ms * interval '1 millisecond',
                   (SELECT min(p.starts) FROM skiplock.internal_done_partitions() p
                    WHERE p.state = finished) - interval '1 microsecond')
    END;
$$;

-- The day partitions of jobs_done all of whose rows are past their state's retention
-- (milliseconds; NULL keeps the state), oldest first: what the pruner drops.
CREATE OR REPLACE FUNCTION skiplock.internal_expired_done_partitions(
    succeeded_ms bigint, cancelled_ms bigint, dead_ms bigint)
RETURNS TABLE (leaf text, state skiplock.job_state, starts timestamptz, ends timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT p.leaf, p.state, p.starts, p.ends
    FROM skiplock.internal_done_partitions() p
    WHERE p.ends <= now() - CASE p.state
                                WHEN 'succeeded' THEN succeeded_ms
                                WHEN 'cancelled' THEN cancelled_ms
                                WHEN 'dead' THEN dead_ms
                            END * interval '1 millisecond'
    ORDER BY p.starts, p.leaf;
$$;

-- Creates the day partitions of jobs_done from first_day (UTC; today when NULL) for `days`
-- days, those missing; returns how many it created. Called by every worker's pruner,
-- skiplock prune, skiplock.maintain and skiplock migrate, with the default two days ahead,
-- so that each day exists before a job finishes in it. A day busy now is created at the
-- next call. A day for which jobs_done_default already holds rows stays there (Postgres
-- would refuse the partition); the pruner deletes those rows as they expire.
CREATE OR REPLACE FUNCTION skiplock.internal_prepare_done_partitions(
    first_day date DEFAULT NULL, days int DEFAULT 3)
RETURNS int
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
SET TimeZone = 'UTC'
SET DateStyle = 'ISO, YMD'
AS $$
DECLARE
    day date;
    finished skiplock.job_state;
    leaf text;
    starts timestamptz;
    ends timestamptz;
    created int := 0;
BEGIN
    first_day := coalesce(first_day, (now() AT TIME ZONE 'UTC')::date);
    IF first_day NOT BETWEEN date '2000-01-01' AND date '9999-12-01' OR days NOT BETWEEN 0 AND 31 THEN
        RAISE EXCEPTION 'skiplock.internal_prepare_done_partitions: % days from %: make at most 31 days at a time, from year 2000 to 9999',
            days, first_day
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR i IN 0 .. coalesce(days, 0) - 1 LOOP
        day := first_day + i;
        starts := day::timestamp AT TIME ZONE 'UTC';
        ends := (day + 1)::timestamp AT TIME ZONE 'UTC';
        FOREACH finished IN ARRAY ARRAY['succeeded', 'dead', 'cancelled']::skiplock.job_state[] LOOP
            leaf := format('jobs_done_%s_%s', finished, to_char(day, 'YYYYMMDD'));
            CONTINUE WHEN to_regclass(format('skiplock.%I', leaf)) IS NOT NULL;
            CONTINUE WHEN EXISTS (
                SELECT 1 FROM skiplock.jobs_done_default d
                WHERE d.state = finished AND d.finished_at >= starts AND d.finished_at < ends);
            BEGIN
                EXECUTE format(
                    'CREATE TABLE skiplock.%I PARTITION OF skiplock.jobs_done
                     FOR VALUES FROM (%L, %L) TO (%L, %L)',
                    leaf, finished, starts, finished, ends);
                -- A statement trigger fires for the table a DELETE names (see jobs_after_delete).
                EXECUTE format(
                    'CREATE TRIGGER jobs_after_delete AFTER DELETE ON skiplock.%I
                     REFERENCING OLD TABLE AS deleted
                     FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete()',
                    leaf);
                created := created + 1;
            EXCEPTION WHEN lock_not_available OR duplicate_table OR check_violation THEN
                -- Busy, made by another caller meanwhile, or a row of that day reached
                -- jobs_done_default meanwhile: the next call looks again.
                NULL;
            END;
        END LOOP;
    END LOOP;
    RETURN created;
END;
$$;

-- The day partition `leaf`, checked: a day partition of jobs_done, by name and by parent.
CREATE OR REPLACE FUNCTION skiplock.internal_done_partition(leaf text) RETURNS regclass
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    found regclass;
BEGIN
    SELECT format('skiplock.%I', p.leaf)::regclass INTO found
    FROM skiplock.internal_done_partitions() p WHERE p.leaf = internal_done_partition.leaf;
    IF found IS NULL THEN
        RAISE EXCEPTION '% is not a day partition of skiplock.jobs_done', leaf
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN found;
END;
$$;

-- Locks the day partition `leaf` against writes (a retry or a DELETE by hand, another
-- pruner's drop of the same day) until the transaction ends, so that the history the
-- pruner rolls up from it next is exactly what internal_drop_done_partition removes after.
-- SHARE ROW EXCLUSIVE: reads and row locks (FOR SHARE, the dependency trigger's) go on.
-- Returns false, locking nothing, when the day is gone already (another pruner dropped
-- it); refuses a day that is not over.
CREATE OR REPLACE FUNCTION skiplock.internal_lock_done_partition(leaf text) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
AS $$
DECLARE
    day_table regclass;
BEGIN
    IF to_regclass(format('skiplock.%I', leaf)) IS NULL THEN
        RETURN false;
    END IF;
    day_table := skiplock.internal_done_partition(leaf);
    EXECUTE format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', day_table);
    RETURN true;
END;
$$;

-- Drops the day partition `leaf`, after what a DELETE of its rows would have done to the
-- jobs that knew them (skiplock.internal_jobs_after_delete): its jobs that did not succeed
-- leave tombstones on their children's edges (and a child still waiting is cancelled), and
-- its jobs' own edges go. Both are found through the edges in the partition's id range (an
-- index range of job_dependencies), so the cost follows the edges of that day's jobs, not
-- the day's rows nor every edge kept. The caller rolled the day up into job_history in the
-- same transaction, under internal_lock_done_partition.
CREATE OR REPLACE FUNCTION skiplock.internal_drop_done_partition(leaf text) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    day_table regclass := skiplock.internal_done_partition(leaf);
    ends timestamptz;
    first_id bigint;
    last_id bigint;
    parents bigint[];
    states skiplock.job_state[];
BEGIN
    SELECT p.ends INTO ends FROM skiplock.internal_done_partitions() p
    WHERE p.leaf = internal_drop_done_partition.leaf;
    IF ends > now() THEN
        RAISE EXCEPTION 'skiplock.%: the day is not over; only a past day is dropped', leaf
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    EXECUTE format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', day_table);
    EXECUTE format('SELECT min(id), max(id) FROM %s', day_table) INTO first_id, last_id;
    IF first_id IS NOT NULL THEN
        EXECUTE format(
            'SELECT array_agg(p.id), array_agg(p.state)
             FROM (SELECT DISTINCT d.parent_id FROM skiplock.job_dependencies d
                   WHERE d.parent_id BETWEEN $1 AND $2 AND d.parent_state IS NULL) e
             JOIN %s p ON p.id = e.parent_id
             WHERE p.state <> ''succeeded''', day_table)
            INTO parents, states USING first_id, last_id;
        PERFORM skiplock.internal_tombstone_parents(parents, states);
        EXECUTE format(
            'DELETE FROM skiplock.job_dependencies d
             WHERE d.job_id BETWEEN $1 AND $2
               AND EXISTS (SELECT 1 FROM %s p WHERE p.id = d.job_id)', day_table)
            USING first_id, last_id;
    END IF;
    EXECUTE format('DROP TABLE %s', day_table);
END;
$$;

-- Making, locking and dropping days run as the owner: only the roles that prune (a worker,
-- an operator; docs/roles.sql) may call them, not every role that may read a job.
REVOKE EXECUTE ON FUNCTION skiplock.internal_prepare_done_partitions(date, int),
                           skiplock.internal_lock_done_partition(text),
                           skiplock.internal_drop_done_partition(text)
    FROM PUBLIC;

-- ---- Triggers ----------------------------------------------------------------------------

-- Inserts: one notification per statement, queue and priority for the jobs due now, at the
-- earliest time, and one for those due later, with when the first and the last come due.
-- A queue written while not paused (resumed, a limit raised or removed, or new) may let
-- claims take jobs they could not: workers look at it from the start. Pausing needs no
-- message: claims stop finding it.
CREATE OR REPLACE FUNCTION skiplock.internal_queues_after_write() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM skiplock.internal_notify_queue_start(NEW.name);
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION skiplock.internal_notify_jobs_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    q text;
    p smallint;
    s timestamptz;
    later_first timestamptz;
    later_last timestamptz;
BEGIN
    FOR q, p, s, later_first, later_last IN
        SELECT queue, priority, min(scheduled_at) FILTER (WHERE scheduled_at <= now()),
               min(scheduled_at) FILTER (WHERE scheduled_at > now()), max(scheduled_at)
        FROM inserted
        WHERE state = 'queued'
        GROUP BY queue, priority
    LOOP
        IF s IS NOT NULL THEN
            PERFORM pg_notify('skiplock_runnable', skiplock.internal_runnable_payload(q, p, s));
        END IF;
        IF later_first IS NOT NULL THEN
            PERFORM skiplock.internal_notify_due_later(q, p, later_first, later_last);
        END IF;
    END LOOP;
    RETURN NULL;
END;
$$;

-- Before a row is inserted into jobs_live, whoever inserts it: the args limit, lane order,
-- unique keys. A finished job moved back (a retry: UPDATE of a jobs_done row to a live
-- state) is an insert into jobs_live too; it is not an enqueue, and passes as it is
-- (internal_jobs_done_before_requeue marked it): returning NULL here would drop the job.
CREATE OR REPLACE FUNCTION skiplock.internal_jobs_before_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    holder bigint;
    policy text := coalesce(NEW.unique_policy, 'skip');
    merged jsonb;
BEGIN
    IF current_setting('skiplock.requeue_moving', true) = NEW.id::text THEN
        PERFORM set_config('skiplock.requeue_moving', '', true);
        RETURN NEW;
    END IF;
    IF pg_column_size(NEW.args) > 4096 THEN
        PERFORM skiplock.internal_check_args_size(NEW.args);
    END IF;
    IF NEW.ordering_key IS NOT NULL AND NEW.state = 'queued' THEN
        -- Lane order: a job behind an unfinished job of its lane waits for its turn.
        -- Enqueues into one lane take turns until commit, so each sees the one before it.
        PERFORM pg_advisory_xact_lock(hashtextextended('skiplock.lane:' || NEW.ordering_key, 0));
        IF EXISTS (SELECT 1 FROM skiplock.jobs o
                   WHERE o.ordering_key = NEW.ordering_key
                     AND o.state IN ('waiting', 'queued', 'running')) THEN
            NEW.state := 'waiting';
        END IF;
    END IF;
    IF NEW.unique_key IS NOT NULL AND NEW.state IN ('waiting', 'queued') THEN
        IF policy = 'merge' AND jsonb_typeof(NEW.args) <> 'array' THEN
            NEW.args := jsonb_build_array(NEW.args);
        END IF;
        holder := skiplock.internal_unique_key_holder(NEW.unique_key, NEW.id);
        IF holder IS NOT NULL THEN
            -- The key's policy, as skiplock.enqueue documents it; no new row. The holder is
            -- pending and locked (internal_unique_key_holder): the state filter keeps the
            -- update on jobs_live, away from the days of finished jobs.
            IF policy = 'replace' THEN
                UPDATE skiplock.jobs SET args = NEW.args
                WHERE id = holder AND state IN ('waiting', 'queued');
            ELSIF policy = 'merge' THEN
                -- The holder now carries merged payloads: policy merge from here on, so
                -- that a requeue of it into a taken key folds them in instead of
                -- dropping them (a holder enqueued with skip, say, then reaped while a
                -- newer job of the key waited).
                UPDATE skiplock.jobs SET args = args || NEW.args, unique_policy = 'merge'
                WHERE id = holder AND state IN ('waiting', 'queued')
                RETURNING args INTO merged;
                IF pg_column_size(merged) > 4096 THEN
                    PERFORM skiplock.internal_check_args_size(merged);
                END IF;
            END IF;
            -- skiplock.enqueue returns the holder's id.
            PERFORM set_config('skiplock.unique_holder', holder::text, true);
            RETURN NULL;
        END IF;
    END IF;
    RETURN NEW;
END;
$$;

-- A finished job going back to a live state (retry_job, or an UPDATE by hand) moves from
-- jobs_done to jobs_live: Postgres runs this BEFORE UPDATE trigger on jobs_done, then the
-- insert trigger of jobs_live, which this marks so that it lets the row pass. (Finished
-- rows are seldom updated: the completion path never pays for it.)
CREATE OR REPLACE FUNCTION skiplock.internal_jobs_done_before_requeue() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('skiplock.requeue_moving', NEW.id::text, true);
    RETURN NEW;
END;
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
AS $$
DECLARE
    children bigint[] := '{}';
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
        UPDATE skiplock.jobs c
        SET state = 'cancelled', finished_at = now(),
            last_error = format('parent job %s was deleted while %s', victim.parent_id, victim.state)
        WHERE c.id = victim.job_id AND c.state = 'waiting';
        IF FOUND THEN
            children := children || victim.job_id;
        END IF;
    END LOOP;
    IF cardinality(children) > 0 THEN
        PERFORM skiplock.internal_settle_dependants(children);
    END IF;
END;
$$;

-- After a DELETE statement on skiplock.jobs (by hand, or the pruner), once for all its
-- rows: the deleted jobs that had not succeeded leave tombstones and their waiting
-- children are cancelled (internal_tombstone_parents), and the deleted jobs' own edges go
-- with them (what a foreign key's cascade did). A statement trigger: a row moved between
-- jobs_live and jobs_done by an UPDATE is not a DELETE statement and does not fire it, and
-- a DELETE of a parent and its waiting children in one statement (DELETE … WHERE queue =
-- 'x') sees them all gone.
--
-- It runs as its owner (SECURITY DEFINER), as a foreign key's cascade did: whoever may
-- delete jobs needs no privilege on job_dependencies.
CREATE OR REPLACE FUNCTION skiplock.internal_jobs_after_delete() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    parents bigint[];
    states skiplock.job_state[];
BEGIN
    SELECT array_agg(o.id), array_agg(o.state) INTO parents, states
    FROM deleted o WHERE o.state <> 'succeeded';
    PERFORM skiplock.internal_tombstone_parents(parents, states);
    DELETE FROM skiplock.job_dependencies d USING deleted o WHERE d.job_id = o.id;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION skiplock.internal_job_dependencies_after_insert() RETURNS trigger
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
            SELECT state, queue, priority, scheduled_at
            INTO parent_now, parent_queue, parent_priority, parent_scheduled_at
            FROM skiplock.jobs WHERE id = NEW.parent_id FOR SHARE;
            -- Claims skip the parent while this transaction holds it locked.
            IF parent_now = 'queued' THEN
                PERFORM skiplock.internal_notify_runnable(parent_queue, parent_priority, parent_scheduled_at);
            END IF;
            IF parent_now IS NULL THEN
                RAISE EXCEPTION 'parent job % does not exist', NEW.parent_id
                    USING ERRCODE = 'foreign_key_violation';
            END IF;
            SELECT state, queue, priority, scheduled_at
            INTO child_now, child_queue, child_priority, child_scheduled_at
            FROM skiplock.jobs WHERE id = NEW.job_id FOR UPDATE;
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
        -- The child stays as it was; claims skipped it while it was locked.
        IF child_now = 'queued' THEN
            PERFORM skiplock.internal_notify_runnable(child_queue, child_priority, child_scheduled_at);
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

-- On the parent (INSERT INTO skiplock.jobs) and on jobs_live (enqueue_job inserts there
-- directly): a statement trigger fires for the table the statement names.
CREATE OR REPLACE TRIGGER jobs_notify_inserted
    AFTER INSERT ON skiplock.jobs
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_notify_jobs_inserted();
CREATE OR REPLACE TRIGGER jobs_notify_inserted
    AFTER INSERT ON skiplock.jobs_live
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_notify_jobs_inserted();

-- Only rows that use lanes or unique keys (or carry large args) pay for the call: the
-- trigger's WHEN clause is evaluated without entering PL/pgSQL. On jobs_live only: a row
-- moved into jobs_done (a completion) is no enqueue, and must not be refused for its args.
CREATE OR REPLACE TRIGGER jobs_before_insert
    BEFORE INSERT ON skiplock.jobs_live
    FOR EACH ROW
    WHEN (NEW.ordering_key IS NOT NULL OR NEW.unique_key IS NOT NULL
          OR pg_column_size(NEW.args) > 4096)
    EXECUTE FUNCTION skiplock.internal_jobs_before_insert();

CREATE OR REPLACE TRIGGER jobs_done_before_requeue
    BEFORE UPDATE ON skiplock.jobs_done
    FOR EACH ROW
    WHEN (NEW.state IN ('waiting', 'queued', 'running'))
    EXECUTE FUNCTION skiplock.internal_jobs_done_before_requeue();

-- On the table and on each partition: a statement trigger fires for the table a statement
-- names, and a DELETE FROM skiplock.jobs_live must tombstone and cascade as well. (Each
-- day partition of jobs_done gets its own as it is made.)
CREATE OR REPLACE TRIGGER jobs_after_delete
    AFTER DELETE ON skiplock.jobs
    REFERENCING OLD TABLE AS deleted
    FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete();
CREATE OR REPLACE TRIGGER jobs_after_delete
    AFTER DELETE ON skiplock.jobs_live
    REFERENCING OLD TABLE AS deleted
    FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete();
CREATE OR REPLACE TRIGGER jobs_after_delete
    AFTER DELETE ON skiplock.jobs_done
    REFERENCING OLD TABLE AS deleted
    FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete();
CREATE OR REPLACE TRIGGER jobs_after_delete
    AFTER DELETE ON skiplock.jobs_done_default
    REFERENCING OLD TABLE AS deleted
    FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete();

CREATE OR REPLACE TRIGGER job_dependencies_after_insert
    AFTER INSERT ON skiplock.job_dependencies
    FOR EACH ROW EXECUTE FUNCTION skiplock.internal_job_dependencies_after_insert();

CREATE OR REPLACE TRIGGER queues_after_write
    AFTER INSERT OR UPDATE ON skiplock.queues
    FOR EACH ROW
    WHEN (NOT NEW.paused)
    EXECUTE FUNCTION skiplock.internal_queues_after_write();

CREATE OR REPLACE TRIGGER cron_schedules_before_write
    BEFORE INSERT OR UPDATE ON skiplock.cron_schedules
    FOR EACH ROW EXECUTE FUNCTION skiplock.internal_cron_schedules_before_write();

-- ---- Views for operators -----------------------------------------------------------------

-- stats is read as four parts that each match a partial index (jobs_claim_idx,
-- jobs_waiting_idx, jobs_running_idx, jobs_finished_idx), so its cost follows the backlog
-- and the last hour, not the retained history.
CREATE OR REPLACE VIEW skiplock.stats AS
WITH recent AS (
    SELECT queue, kind, state, scheduled_at, finished_at
    FROM skiplock.jobs WHERE state = 'queued'
    UNION ALL
    SELECT queue, kind, state, scheduled_at, finished_at
    FROM skiplock.jobs WHERE state = 'waiting'
    UNION ALL
    SELECT queue, kind, state, scheduled_at, finished_at
    FROM skiplock.jobs WHERE state = 'running'
    UNION ALL
    SELECT queue, kind, state, scheduled_at, finished_at
    FROM skiplock.jobs
    WHERE state IN ('succeeded', 'dead') AND finished_at > now() - interval '1 hour'
)
SELECT j.queue,
       j.kind,
       coalesce(q.paused, false) AS paused,
       count(*) FILTER (WHERE j.state = 'queued' AND j.scheduled_at <= now()) AS runnable,
       count(*) FILTER (WHERE j.state = 'queued' AND j.scheduled_at > now())  AS scheduled,
       count(*) FILTER (WHERE j.state = 'waiting')                            AS waiting,
       count(*) FILTER (WHERE j.state = 'running')                            AS running,
       count(*) FILTER (WHERE j.state = 'succeeded'
                          AND j.finished_at > now() - interval '1 hour')      AS succeeded_last_hour,
       count(*) FILTER (WHERE j.state = 'dead'
                          AND j.finished_at > now() - interval '1 hour')      AS dead_last_hour,
       count(*) FILTER (WHERE j.state = 'succeeded'
                          AND j.finished_at > now() - interval '1 minute')    AS succeeded_last_minute,
       coalesce(extract(epoch FROM now() - min(j.scheduled_at) FILTER (
           WHERE j.state = 'queued' AND j.scheduled_at <= now()
             AND isfinite(j.scheduled_at))), 0)::float8                       AS lag_seconds,
       (count(*) FILTER (WHERE j.state = 'succeeded'
                           AND j.finished_at > now() - interval '1 minute') / 60.0)::float8
                                                                              AS per_second
FROM recent j
LEFT JOIN skiplock.queues q ON q.name = j.queue
GROUP BY j.queue, j.kind, q.paused;
COMMENT ON VIEW skiplock.stats IS
    'Per queue and kind: runnable (queued, due), scheduled (queued, not yet due), waiting, running, succeeded and dead in the last hour, lag_seconds (age of the oldest runnable job) and per_second (successes over the last minute / 60). Example: SELECT * FROM skiplock.stats ORDER BY lag_seconds DESC;';

CREATE OR REPLACE VIEW skiplock.queue_counts AS
SELECT j.queue,
       coalesce(q.paused, false) AS paused,
       count(*) FILTER (WHERE j.state = 'waiting')   AS waiting,
       count(*) FILTER (WHERE j.state = 'queued')    AS queued,
       count(*) FILTER (WHERE j.state = 'running')   AS running,
       count(*) FILTER (WHERE j.state = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE j.state = 'dead')      AS dead,
       count(*) FILTER (WHERE j.state = 'cancelled') AS cancelled,
       count(*)                                      AS total
FROM skiplock.jobs j
LEFT JOIN skiplock.queues q ON q.name = j.queue
GROUP BY j.queue, q.paused;
COMMENT ON VIEW skiplock.queue_counts IS
    'Per queue: how many retained jobs are in each state. Example: SELECT queue, queued, dead FROM skiplock.queue_counts WHERE dead > 0;';

-- Queues with a global limit: each limit, its use now, and the runnable jobs it holds
-- back. started_in_period counts the starts the rate limit keeps (those of the last
-- rate_period); holding_back names the limit that keeps runnable jobs from starting now.
CREATE OR REPLACE VIEW skiplock.queue_limits AS
SELECT q.name AS queue,
       q.paused,
       q.max_running,
       r.running,
       q.rate_limit,
       q.rate_period,
       s.started AS started_in_period,
       CASE WHEN q.max_running IS NOT NULL AND r.running >= q.max_running THEN 'max_running'
            WHEN q.rate_limit IS NOT NULL AND s.started >= q.rate_limit THEN 'rate_limit'
       END AS holding_back,
       w.runnable,
       CASE WHEN (q.max_running IS NOT NULL AND r.running >= q.max_running)
                 OR (q.rate_limit IS NOT NULL AND s.started >= q.rate_limit)
            THEN w.runnable ELSE 0 END AS held_back
FROM skiplock.queues q
CROSS JOIN LATERAL (SELECT count(*) AS running FROM skiplock.jobs_live j
                    WHERE j.queue = q.name AND j.state = 'running') r
CROSS JOIN LATERAL (SELECT count(*) AS started FROM skiplock.queue_rate_starts x
                    WHERE x.queue = q.name AND x.started_at > now() - q.rate_period) s
CROSS JOIN LATERAL (SELECT count(*) AS runnable FROM skiplock.jobs_live j
                    WHERE j.queue = q.name AND j.state = 'queued'
                      AND j.scheduled_at <= now()) w
WHERE q.max_running IS NOT NULL OR q.rate_limit IS NOT NULL;
COMMENT ON VIEW skiplock.queue_limits IS
    'Per queue with a global limit: max_running and the jobs running, rate_limit per rate_period and the starts in the last period, which limit holds runnable jobs back now (holding_back) and how many (held_back). Example: SELECT queue, running, max_running, held_back FROM skiplock.queue_limits;';

CREATE OR REPLACE VIEW skiplock.queue_lag AS
SELECT queue,
       min(scheduled_at) FILTER (WHERE scheduled_at <= now()) AS oldest_runnable_at,
       coalesce(now() - min(scheduled_at) FILTER (
           WHERE scheduled_at <= now() AND isfinite(scheduled_at)),
                interval '0') AS lag,
       coalesce(extract(epoch FROM now() - min(scheduled_at) FILTER (
           WHERE scheduled_at <= now() AND isfinite(scheduled_at))), 0)::float8 AS lag_seconds
FROM skiplock.jobs
WHERE state = 'queued'
GROUP BY queue;
COMMENT ON VIEW skiplock.queue_lag IS
    'Per queue with queued jobs: how long the oldest runnable job has been due (zero when none is due). Example: SELECT queue, lag FROM skiplock.queue_lag WHERE lag > interval ''1 minute'';';

CREATE OR REPLACE VIEW skiplock.throughput AS
SELECT queue,
       kind,
       count(*) FILTER (WHERE state = 'succeeded'
                          AND finished_at > now() - interval '1 minute') AS succeeded_last_minute,
       count(*) FILTER (WHERE state = 'succeeded')                       AS succeeded_last_hour,
       count(*) FILTER (WHERE state = 'dead'
                          AND finished_at > now() - interval '1 minute') AS dead_last_minute,
       count(*) FILTER (WHERE state = 'dead')                            AS dead_last_hour,
       (count(*) FILTER (WHERE state = 'succeeded'
                           AND finished_at > now() - interval '1 minute') / 60.0)::float8
                                                                         AS per_second_last_minute,
       (count(*) FILTER (WHERE state = 'succeeded') / 3600.0)::float8    AS per_second_last_hour
FROM skiplock.jobs
WHERE state IN ('succeeded', 'dead') AND finished_at > now() - interval '1 hour'
GROUP BY queue, kind;
COMMENT ON VIEW skiplock.throughput IS
    'Per queue and kind: jobs that succeeded or died in the last minute and hour, and successes per second. Example: SELECT * FROM skiplock.throughput WHERE queue = ''mail'';';

CREATE OR REPLACE VIEW skiplock.dead_jobs AS
SELECT id, queue, kind, args, attempt, max_attempts, last_error, errors, created_at,
       finished_at
FROM skiplock.jobs
WHERE state = 'dead'
ORDER BY finished_at DESC, id DESC;
COMMENT ON VIEW skiplock.dead_jobs IS
    'Dead jobs with their last error, newest first. Example: SELECT id, kind, last_error FROM skiplock.dead_jobs LIMIT 20;';

-- The days ahead of finished jobs exist from the migration on (the pruner and
-- skiplock.maintain make the next ones).
SELECT skiplock.internal_prepare_done_partitions();
