-- migrations/functions/05_enqueue.sql: Enqueue: skiplock.enqueue and enqueue_job, and the
-- insert triggers (args limit, lane order, unique keys, fair turns, the announcement of
-- inserted jobs).
--
-- Defines:
--   enqueue_job, enqueue, internal_notify_jobs_inserted, trigger jobs_notify_inserted
--   internal_jobs_before_insert, trigger jobs_before_insert

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
    depends_on    bigint[]    DEFAULT '{}',
    concurrency_key text      DEFAULT NULL,
    traceparent   text        DEFAULT NULL,
    tracestate    text        DEFAULT NULL
) RETURNS TABLE (id bigint, outcome text)
LANGUAGE plpgsql
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    new_id bigint;
    inserted boolean;
    initial skiplock.job_state := 'queued';
    reason text;
    parent bigint;
    parent_state skiplock.job_state;
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
    -- Each parent in jobs_live first, and in the finished jobs only when it is not there:
    -- the cost of a parent that has not finished does not follow the days kept (see "A job
    -- looked up by id" in 15_partitions.sql). The first dead or cancelled one cancels the job.
    FOREACH parent IN ARRAY coalesce(depends_on, '{}') LOOP
        SELECT p.state INTO parent_state FROM skiplock.jobs_live p WHERE p.id = parent;
        IF NOT FOUND THEN
            SELECT f.state INTO parent_state FROM skiplock.internal_finished_job(parent) f;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'parent job % does not exist', parent
                    USING ERRCODE = 'foreign_key_violation';
            END IF;
        END IF;
        IF parent_state IN ('dead', 'cancelled') THEN
            reason := coalesce(reason, format('parent job %s ended %s', parent, parent_state));
            initial := 'cancelled';
        ELSIF parent_state <> 'succeeded' AND initial = 'queued' THEN
            initial := 'waiting';
        END IF;
    END LOOP;
    PERFORM set_config('skiplock.unique_holder', '', true);
    IF initial = 'cancelled' THEN
        -- Finished on arrival: into jobs_done, through the parent. Its args are checked
        -- here, as the insert trigger of jobs_live checks the others'.
        PERFORM skiplock.internal_check_args_size(enqueue_job.args);
        INSERT INTO skiplock.jobs (kind, args, queue, priority, scheduled_at, max_attempts,
                                   ordering_key, unique_key, unique_policy, state,
                                   finished_at, last_error, concurrency_key, traceparent,
                                   tracestate)
        VALUES (enqueue_job.kind, enqueue_job.args, enqueue_job.queue,
                enqueue_job.priority::smallint, enqueue_job.scheduled_at,
                enqueue_job.max_attempts, enqueue_job.ordering_key, enqueue_job.unique_key,
                CASE WHEN enqueue_job.unique_key IS NOT NULL THEN on_conflict END, initial,
                now(), reason, enqueue_job.concurrency_key, enqueue_job.traceparent,
                enqueue_job.tracestate)
        RETURNING skiplock.jobs.id, true INTO new_id, inserted;
    ELSE
        -- Into jobs_live itself: ON CONFLICT needs a unique index of the table it names,
        -- and the pending unique keys' index is the live partition's.
        INSERT INTO skiplock.jobs_live AS j (kind, args, queue, priority, scheduled_at,
                                             max_attempts, ordering_key, unique_key,
                                             unique_policy, state, concurrency_key,
                                             traceparent, tracestate)
        VALUES (enqueue_job.kind, enqueue_job.args, enqueue_job.queue,
                enqueue_job.priority::smallint, enqueue_job.scheduled_at,
                enqueue_job.max_attempts, enqueue_job.ordering_key, enqueue_job.unique_key,
                CASE WHEN enqueue_job.unique_key IS NOT NULL THEN on_conflict END, initial,
                enqueue_job.concurrency_key, enqueue_job.traceparent, enqueue_job.tracestate)
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
COMMENT ON FUNCTION skiplock.enqueue_job(text, jsonb, text, int, timestamptz, int, text, text, text, bigint[], text, text, text) IS
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
    depends_on    bigint[]    DEFAULT '{}',
    concurrency_key text      DEFAULT NULL,
    traceparent   text        DEFAULT NULL,
    tracestate    text        DEFAULT NULL
) RETURNS bigint
LANGUAGE sql AS $$
    SELECT e.id FROM skiplock.enqueue_job(kind, args, queue, priority, scheduled_at,
                                          max_attempts, ordering_key, unique_key,
                                          on_conflict, depends_on, concurrency_key,
                                          traceparent, tracestate) e;
$$;
COMMENT ON FUNCTION skiplock.enqueue(text, jsonb, text, int, timestamptz, int, text, text, text, bigint[], text, text, text) IS
    'Enqueues a job from any language and returns its id (or, for a unique_key already pending, that job''s id). traceparent and tracestate (W3C Trace Context, as an incoming request carried them) make each attempt''s span continue that trace. Example: SELECT skiplock.enqueue(''send_email'', ''{"to": "a@example.com"}'', priority => -1);';

-- Inserts: in queues with key_claimable, the jobs whose keys have their turns taken wait
-- for one; then one notification per statement, queue and priority for the jobs due now,
-- at the earliest time, and one for those due later, with when the first and the last
-- come due.
CREATE OR REPLACE FUNCTION skiplock.internal_notify_jobs_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM skiplock.queues q WHERE q.key_claimable IS NOT NULL) THEN
        -- Fair queueing (06_global_limits.sql): the due jobs of this statement whose keys
        -- have their turns taken wait for one, and their keys are left for the next claim.
        -- Decided here, once per statement, so that inserts into other queues pay one
        -- probe of skiplock.queues per statement, not a call per row.
        -- (The announcement below counts them too: a worker told of them finds the
        -- others, or nothing.)
        PERFORM skiplock.internal_hold_for_turns(ARRAY(
            SELECT i.id
            FROM inserted i
            JOIN skiplock.queues q ON q.name = i.queue AND q.key_claimable IS NOT NULL
            WHERE i.state = 'queued' AND i.concurrency_key IS NOT NULL
              AND i.ordering_key IS NULL AND i.scheduled_at <= now()));
    END IF;
    -- Reduced first to three keys per queue and priority at most (the first due, the first
    -- and the last due later): a bulk insert of thousands of jobs makes no array of them.
    PERFORM skiplock.internal_announce(ARRAY(
        SELECT ROW(g.queue, g.priority, k.at)::skiplock.runnable_key
        FROM (SELECT i.queue, i.priority,
                     min(i.scheduled_at) FILTER (WHERE i.scheduled_at <= now()) AS due,
                     min(i.scheduled_at) FILTER (WHERE i.scheduled_at > now()) AS later_first,
                     max(i.scheduled_at) FILTER (WHERE i.scheduled_at > now()) AS later_last
              FROM inserted i
              WHERE i.state = 'queued'
              GROUP BY i.queue, i.priority) g
        CROSS JOIN LATERAL unnest(ARRAY[g.due, g.later_first, g.later_last]) AS k(at)
        WHERE k.at IS NOT NULL));
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
    lane_tail bigint;
    lane_contended boolean;
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
        -- The lane's lock is held until commit: enqueues into one lane take turns, so each
        -- sees the one before it, and the step that moves the lane on when its last job
        -- finishes (internal_advance_lanes takes the same lock) waits for this commit and
        -- then sees this job; a step that took the lock first has committed when this
        -- read runs (a new snapshot after the wait, in READ COMMITTED) and its job is seen
        -- finished.
        lane_contended := NOT pg_try_advisory_xact_lock(skiplock.internal_lane_lock_id(NEW.ordering_key));
        IF lane_contended THEN
            PERFORM pg_advisory_xact_lock(skiplock.internal_lane_lock_id(NEW.ordering_key));
        END IF;
        SELECT o.id INTO lane_tail FROM skiplock.jobs o
        WHERE o.ordering_key = NEW.ordering_key AND o.state IN ('waiting', 'queued', 'running')
        ORDER BY o.id DESC LIMIT 1;
        IF lane_tail IS NULL AND lane_contended
           AND current_setting('transaction_isolation') <> 'read committed' THEN
            -- The lane looks empty to a snapshot older than the lock: the transaction
            -- that held it may have given the lane's turn to a job this one cannot see,
            -- and a second turn would fail on jobs_lane_turn_idx (23505, which callers do
            -- not retry). Retry with a new snapshot. (A lane written and committed
            -- between this snapshot and the lock, without a wait, still meets the index.)
            RAISE EXCEPTION 'lane % was written by a transaction that committed after this transaction''s snapshot',
                NEW.ordering_key
                USING ERRCODE = 'serialization_failure',
                      HINT = 'retry the transaction';
        END IF;
        IF lane_tail IS NOT NULL THEN
            NEW.state := 'waiting';
            IF lane_tail > NEW.id THEN
                -- The id was drawn before the lock, and a job enqueued since, after it in
                -- the lane, took a greater one: a lane runs in id order, so this job gets
                -- a new id, behind that one. Otherwise it would be the lane's head, waiting
                -- behind a job that may not run before it (the claim takes a lane's job
                -- only when no unfinished job of the lane has a lower id), with no step to
                -- queue it: nothing would, until the sweep. The statement returns the new id.
                NEW.id := skiplock.internal_next_job_id();
            END IF;
            IF current_setting('transaction_isolation') <> 'read committed' THEN
                -- The transaction's snapshot may be older than the lock: the lane's last
                -- job may have finished, and its step run, after it. Finished since (moved
                -- to jobs_done by a transaction committed after the snapshot), that job
                -- cannot be locked: serialization failure (40001), to retry with a new
                -- snapshot. An update that left it unfinished (a heartbeat, a claim) is no
                -- conflict for FOR KEY SHARE, and one under way is skipped (its step will
                -- wait for this commit). The lock goes with the subtransaction at once: it
                -- would hold back that job's claim, heartbeat and completion.
                BEGIN
                    PERFORM 1 FROM skiplock.jobs_live o WHERE o.id = lane_tail
                    FOR KEY SHARE SKIP LOCKED;
                    RAISE SQLSTATE 'SKL01';
                EXCEPTION WHEN SQLSTATE 'SKL01' THEN
                    NULL;
                END;
            END IF;
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

-- Only rows that use lanes or unique keys (or carry large args) pay for the call: the
-- trigger's WHEN clause is evaluated without entering PL/pgSQL. On jobs_live only: a row
-- moved into jobs_done (a completion) is no enqueue, and must not be refused for its args.
CREATE OR REPLACE TRIGGER jobs_before_insert
    BEFORE INSERT ON skiplock.jobs_live
    FOR EACH ROW
    WHEN (NEW.ordering_key IS NOT NULL OR NEW.unique_key IS NOT NULL
          OR pg_column_size(NEW.args) > 4096)
    EXECUTE FUNCTION skiplock.internal_jobs_before_insert();
