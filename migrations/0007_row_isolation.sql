-- skiplock schema, version 7: no single row stops the queue, and plain SQL means what the
-- API means.
--
-- Rows written by hand (INSERT/UPDATE), by skiplock.enqueue, by the CLI and by the Rust API
-- go through the same rules here, in the database:
--   * the claim enforces lane order itself (at most one running job per lane, always the
--     lane's oldest unfinished job), whatever states the rows of a lane were written with,
--     and never fails for a lane conflict;
--   * an insert with an ordering_key behind an unfinished job of its lane waits; an insert
--     with a pending unique_key applies the key's policy; args over the limit are refused;
--   * a requeue (retry after a failure, reap, release, manual retry) of a job whose
--     unique_key another pending job took meanwhile never fails: the requeued job is
--     superseded by the pending one (see skiplock.fold_into_key_holder);
--   * dependants are cancelled only while they still wait, and deleting or pruning a parent
--     that had not succeeded cancels its waiting children instead of releasing them;
--   * dependency rows written by hand make their child wait, as enqueue's depends_on does.

-- The largest args accepted on every path, in bytes of the jsonb text (octet_length of
-- args::text). 1 MiB unless the setting skiplock.args_max_bytes says otherwise
-- (ALTER DATABASE … SET skiplock.args_max_bytes = 4194304). The Rust API checks its own
-- limit (SKIPLOCK_ARGS_MAX_BYTES) before sending, on compact JSON.
CREATE FUNCTION skiplock.args_max_bytes() RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT coalesce(nullif(current_setting('skiplock.args_max_bytes', true), '')::bigint, 1048576);
$$;

CREATE FUNCTION skiplock.check_args_size(args jsonb) RETURNS void
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

-- The pending job (waiting or queued) other than `self` that holds `key`, locked; NULL if
-- none. Callers hold the key's advisory lock, so concurrent writers of one key take turns
-- and each sees the one before it (READ COMMITTED: every statement takes a new snapshot).
CREATE FUNCTION skiplock.unique_key_holder(key text, self bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    holder bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('skiplock.unique:' || key, 0));
    SELECT o.id INTO holder FROM skiplock.jobs o
    WHERE o.unique_key = key AND o.state IN ('waiting', 'queued') AND o.id <> self
    ORDER BY o.id LIMIT 1
    FOR UPDATE;
    RETURN holder;
END;
$$;

-- Before a row is inserted, whoever inserts it: the args limit, lane order, unique keys.
-- Only rows that use one of those features (or carry large args) pay for the call: the
-- trigger's WHEN clause is evaluated without entering PL/pgSQL.
CREATE FUNCTION skiplock.jobs_before_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    holder bigint;
    policy text := coalesce(NEW.unique_policy, 'skip');
    merged jsonb;
BEGIN
    IF pg_column_size(NEW.args) > 4096 THEN
        PERFORM skiplock.check_args_size(NEW.args);
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
        holder := skiplock.unique_key_holder(NEW.unique_key, NEW.id);
        IF holder IS NOT NULL THEN
            -- The key's policy, as skiplock.enqueue documents it; no new row.
            IF policy = 'replace' THEN
                UPDATE skiplock.jobs SET args = NEW.args WHERE id = holder;
            ELSIF policy = 'merge' THEN
                UPDATE skiplock.jobs SET args = args || NEW.args WHERE id = holder
                RETURNING args INTO merged;
                IF pg_column_size(merged) > 4096 THEN
                    PERFORM skiplock.check_args_size(merged);
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

CREATE TRIGGER jobs_before_insert
    BEFORE INSERT ON skiplock.jobs
    FOR EACH ROW
    WHEN (NEW.ordering_key IS NOT NULL OR NEW.unique_key IS NOT NULL
          OR pg_column_size(NEW.args) > 4096)
    EXECUTE FUNCTION skiplock.jobs_before_insert();

-- A job with a unique_key going back to pending (waiting or queued) from anywhere else: a
-- retry after a failure, the reaper, a graceful release, skiplock.retry_job. While it ran
-- (or lay dead) the key was free, and a new job may have taken it. The requeue is then
-- superseded instead of failing on jobs_unique_key_pending_idx (which used to fail the
-- whole batch it was part of): the pending job runs instead, with this job's payloads
-- merged in first under the policy `merge` (so none is lost), and the caller ends this job
-- `cancelled` with a last_error naming the pending job. Returns that job's id, or NULL
-- when the key is free (the requeue goes ahead). Holds the key's advisory lock until
-- commit, like an enqueue of the key.
--
-- The requeueing statements call it only for rows that have a unique_key and are about to
-- go back to pending; not a trigger, because a row trigger on UPDATE costs every claim and
-- every completion a second fetch and lock of the row (about 7 % of Postgres CPU per job
-- in the drain benchmark) even when its WHEN clause is false. A plain UPDATE written by
-- hand that requeues into a taken key is refused by jobs_unique_key_pending_idx.
CREATE FUNCTION skiplock.fold_into_key_holder(job_id bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    job skiplock.jobs%ROWTYPE;
    holder bigint;
    payload jsonb;
BEGIN
    SELECT * INTO job FROM skiplock.jobs WHERE id = job_id;
    IF job.unique_key IS NULL THEN
        RETURN NULL;
    END IF;
    holder := skiplock.unique_key_holder(job.unique_key, job_id);
    IF holder IS NOT NULL AND job.unique_policy = 'merge' THEN
        payload := CASE WHEN jsonb_typeof(job.args) = 'array' THEN job.args
                        ELSE jsonb_build_array(job.args) END;
        UPDATE skiplock.jobs SET args = payload || args WHERE id = holder;
    END IF;
    RETURN holder;
END;
$$;

-- The last_error of a requeue superseded by the pending job `holder`.
CREATE FUNCTION skiplock.superseded_message(holder bigint, key text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT format('superseded: pending job %s holds unique_key %s and runs instead', holder, key);
$$;

-- Deleting a job that had not succeeded (by hand, or the pruner removing a dead or
-- cancelled one) must not release its waiting children: without this the dependency rows
-- cascade away and the children would look free to run. They are cancelled, transitively,
-- with the reason. Succeeded rows (what the pruner mostly deletes) skip the call.
--
-- An AFTER trigger, so that a statement deleting a parent together with its waiting
-- children (DELETE … WHERE queue = 'x') works: a BEFORE trigger's update of a child that
-- the same statement then deletes is an error. It must still see the dependency rows,
-- which the foreign key's cascade (an internal AFTER trigger named RI_ConstraintTrigger_…)
-- deletes: triggers of one event fire in the byte order of their names, so this one's
-- name starts with a capital letter before R.
CREATE FUNCTION skiplock.jobs_after_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    children bigint[];
BEGIN
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

CREATE TRIGGER "Jobs_after_delete_cancel_waiting_children"
    AFTER DELETE ON skiplock.jobs
    FOR EACH ROW
    WHEN (OLD.state <> 'succeeded')
    EXECUTE FUNCTION skiplock.jobs_after_delete();

-- A dependency row written by hand means what enqueue's depends_on means: a child that has
-- not started waits for a parent that has not succeeded, and is cancelled at once when the
-- parent is already dead or cancelled. Adding a parent to a job that already started is
-- refused: the job may have run before the parent.
CREATE FUNCTION skiplock.job_dependencies_after_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    parent_state skiplock.job_state;
    child_state skiplock.job_state;
BEGIN
    SELECT state INTO parent_state FROM skiplock.jobs WHERE id = NEW.parent_id;
    SELECT state INTO child_state FROM skiplock.jobs WHERE id = NEW.job_id FOR UPDATE;
    IF parent_state = 'succeeded' THEN
        RETURN NULL;
    END IF;
    IF child_state IN ('running', 'succeeded', 'dead') THEN
        RAISE EXCEPTION 'job % already started; a dependency on job % must be added before it runs',
            NEW.job_id, NEW.parent_id
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF child_state = 'queued' THEN
        IF parent_state IN ('dead', 'cancelled') THEN
            UPDATE skiplock.jobs
            SET state = 'cancelled', finished_at = now(),
                last_error = format('parent job %s ended %s', NEW.parent_id, parent_state)
            WHERE id = NEW.job_id;
        ELSE
            UPDATE skiplock.jobs SET state = 'waiting' WHERE id = NEW.job_id;
        END IF;
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER job_dependencies_after_insert
    AFTER INSERT ON skiplock.job_dependencies
    FOR EACH ROW EXECUTE FUNCTION skiplock.job_dependencies_after_insert();

-- Cancellation reaches only jobs still waiting: the recursion follows a child only if it
-- is being cancelled now (0002's version went on through children that had already
-- succeeded or were running, and cancelled their own waiting children).
CREATE OR REPLACE FUNCTION skiplock.settle_dependants(parent_ids bigint[]) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    promoted_queues text[];
    promoted int := 0;
    cancelled int := 0;
BEGIN
    WITH RECURSIVE doomed (id, reason) AS (
        SELECT d.job_id, format('parent job %s ended %s', p.id, p.state)
        FROM skiplock.job_dependencies d
        JOIN skiplock.jobs p ON p.id = d.parent_id
        JOIN skiplock.jobs c ON c.id = d.job_id
        WHERE d.parent_id = ANY (parent_ids) AND p.state IN ('dead', 'cancelled')
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
          AND NOT EXISTS (
              SELECT 1 FROM skiplock.job_dependencies d
              JOIN skiplock.jobs p ON p.id = d.parent_id
              WHERE d.job_id = c.id AND p.state <> 'succeeded'
          )
        RETURNING c.queue
    )
    SELECT array_agg(DISTINCT queue), count(*) INTO promoted_queues, promoted FROM ready;
    PERFORM pg_notify('skiplock_jobs', q) FROM unnest(promoted_queues) AS q;
    RETURN promoted + cancelled;
END;
$$;

-- Lanes: the head (the lane's oldest unfinished job) is promoted when it waits and nothing
-- of the lane runs, even if a later job of the lane is `queued` (written so by hand, or by
-- a race): 0002's version then promoted nothing, and the lane stood still for good. A head
-- that still waits for a parent stays waiting.
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
          AND NOT EXISTS (
              SELECT 1 FROM skiplock.job_dependencies d
              JOIN skiplock.jobs p ON p.id = d.parent_id
              WHERE d.job_id = j.id AND p.state <> 'succeeded'
          )
        RETURNING j.queue
    )
    SELECT array_agg(DISTINCT queue), count(*) INTO promoted_queues, promoted FROM ready;
    PERFORM pg_notify('skiplock_jobs', q) FROM unnest(promoted_queues) AS q;
    RETURN promoted;
END;
$$;

-- The claim, now enforcing lane order itself. A lane job is claimed only when nothing of
-- its lane runs and no older job of its lane is unfinished, so at most one job per lane
-- runs, always the lane's oldest, whatever states the lane's rows were written with (two
-- `queued` jobs in one lane, inserted by hand, used to make every claim fail on
-- jobs_ordering_key_running_idx). The two checks are separate probes: the running one
-- hits the unique index once, the older-job one stops at the first index entry.
--
-- Between this statement's snapshot and its write, another claim may still commit a
-- running job of the same lane (a race the snapshot cannot see). The unique index then
-- refuses our write; the claim is retried at once without lane jobs, so the lane-less
-- jobs of the batch are claimed anyway and the lane's job waits for the next claim, which
-- sees the running one. The block costs one subtransaction per claim statement (not per
-- job). attempt is capped so that a row with attempt at the int maximum cannot fail the
-- claim on an overflow.
CREATE OR REPLACE FUNCTION skiplock.claim_batch(queues text[], kinds text[], max_jobs bigint, worker text)
RETURNS TABLE (id bigint, queue text, kind text, args jsonb, attempt int, max_attempts int,
               claim_token uuid)
LANGUAGE plpgsql
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    with_lanes boolean := true;
BEGIN
    LOOP
        BEGIN
            -- The result is sorted (claim order) after the update has finished, so an
            -- update that fails has returned no row yet.
            RETURN QUERY
            WITH picked AS (
                SELECT j.ctid FROM skiplock.jobs j
                WHERE j.state = 'queued' AND j.scheduled_at <= now()
                  AND j.queue = ANY (queues) AND j.kind = ANY (kinds)
                  AND j.queue NOT IN (SELECT q.name FROM skiplock.queues q WHERE q.paused)
                  AND (j.ordering_key IS NULL OR (
                      with_lanes
                      AND NOT EXISTS (
                          SELECT 1 FROM skiplock.jobs h
                          WHERE h.ordering_key = j.ordering_key AND h.state = 'running')
                      AND NOT EXISTS (
                          SELECT 1 FROM skiplock.jobs h
                          WHERE h.ordering_key = j.ordering_key AND h.id < j.id
                            AND h.state IN ('waiting', 'queued', 'running'))
                  ))
                ORDER BY j.priority, j.scheduled_at, j.id
                LIMIT max_jobs
                FOR UPDATE SKIP LOCKED
            ), claimed AS (
                UPDATE skiplock.jobs j
                SET state = 'running', claim_token = gen_random_uuid(), claimed_by = worker,
                    claimed_at = now(), heartbeat_at = now(),
                    attempt = least(j.attempt, 2147483646) + 1
                WHERE j.ctid = ANY (ARRAY(SELECT p.ctid FROM picked p))
                RETURNING j.id, j.queue, j.kind, j.args, j.attempt, j.max_attempts,
                          j.claim_token, j.priority, j.scheduled_at
            )
            SELECT c.id, c.queue, c.kind, c.args, c.attempt, c.max_attempts, c.claim_token
            FROM claimed c
            ORDER BY c.priority, c.scheduled_at, c.id;
            RETURN;
        EXCEPTION WHEN unique_violation THEN
            IF NOT with_lanes THEN
                RAISE;
            END IF;
            with_lanes := false;
        END;
    END LOOP;
END;
$$;

-- Manual retry: a child whose parents have not all succeeded goes back to `waiting` (not
-- `queued` beside its unfinished parent); a job whose unique_key was taken meanwhile is
-- superseded (skiplock.fold_into_key_holder) instead of raising. Returns false only if
-- the job is running, waiting or missing.
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
            WHEN EXISTS (
                SELECT 1 FROM skiplock.job_dependencies d
                JOIN skiplock.jobs p ON p.id = d.parent_id
                WHERE d.job_id = j.id AND p.state <> 'succeeded')
            THEN 'waiting'
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
    -- A child of a dead or cancelled parent is cancelled again at once, with the reason.
    PERFORM skiplock.settle_dependants(ARRAY(
        SELECT d.parent_id FROM skiplock.job_dependencies d WHERE d.job_id = retry_job.job_id));
    PERFORM pg_notify('skiplock_jobs', q);
    RETURN true;
END;
$$;

-- Enqueue from any language. Lane order, unique keys and the args limit are now the insert
-- trigger's (so plain INSERTs get them too); this function adds the options a plain insert
-- has no column for (on_conflict, depends_on) and returns the id: the new job's, or the
-- pending job's that holds the unique key.
--
-- Inside a REPEATABLE READ or SERIALIZABLE transaction the lane and key checks cannot see
-- jobs committed after the transaction's snapshot: a lane then may get two `queued` jobs,
-- which the claim still runs one at a time in id order, and a unique key held by a job
-- the snapshot cannot see fails with serialization_failure (SQLSTATE 40001), which the
-- caller retries like any serialization failure.
CREATE OR REPLACE FUNCTION skiplock.enqueue(
    kind          text,
    args          jsonb       DEFAULT '{}',
    queue         text        DEFAULT 'default',
    priority      smallint    DEFAULT 0,
    scheduled_at  timestamptz DEFAULT now(),
    max_attempts  int         DEFAULT 25,
    ordering_key  text        DEFAULT NULL,
    unique_key    text        DEFAULT NULL,
    on_conflict   text        DEFAULT 'skip',
    depends_on    bigint[]    DEFAULT '{}'
) RETURNS bigint
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    new_id bigint;
    initial skiplock.job_state := 'queued';
    reason text;
    missing bigint;
BEGIN
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
    INSERT INTO skiplock.jobs AS j (kind, args, queue, priority, scheduled_at, max_attempts,
                                    ordering_key, unique_key, unique_policy, state,
                                    finished_at, last_error)
    VALUES (enqueue.kind, enqueue.args, enqueue.queue, enqueue.priority, enqueue.scheduled_at,
            enqueue.max_attempts, enqueue.ordering_key, enqueue.unique_key,
            CASE WHEN enqueue.unique_key IS NOT NULL THEN on_conflict END, initial,
            CASE WHEN initial = 'cancelled' THEN now() END, reason)
    ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND state IN ('waiting', 'queued')
    DO UPDATE SET args = CASE excluded.unique_policy
        WHEN 'replace' THEN excluded.args
        WHEN 'merge' THEN j.args || excluded.args
        ELSE j.args END
    RETURNING j.id INTO new_id;
    IF new_id IS NULL THEN
        -- The insert trigger applied the key's policy to the pending job instead.
        new_id := nullif(current_setting('skiplock.unique_holder', true), '')::bigint;
    END IF;
    IF cardinality(depends_on) > 0 THEN
        INSERT INTO skiplock.job_dependencies (job_id, parent_id)
        SELECT new_id, d FROM unnest(depends_on) AS d ON CONFLICT DO NOTHING;
    END IF;
    RETURN new_id;
END;
$$;

-- A dead job whose unique_key is taken is now superseded by retry_job rather than refused,
-- so the bulk retry needs no exception handler; it keeps one for anything else a single
-- row may raise, so one row never fails the whole call.
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
