-- skiplock schema, version 2: ordering lanes, unique keys, dependencies, queue control,
-- cron schedules, progress and output.

ALTER TABLE skiplock.jobs
    ADD COLUMN unique_policy text,
    ADD COLUMN progress jsonb,
    ADD COLUMN output jsonb,
    ADD CONSTRAINT jobs_unique_policy_known CHECK (unique_policy IN ('skip', 'replace', 'merge'));

COMMENT ON COLUMN skiplock.jobs.unique_policy IS
    'What a second enqueue with the same unique_key does while this job is pending: skip, replace (new args) or merge (append args).';
COMMENT ON COLUMN skiplock.jobs.progress IS 'Latest progress reported by the handler (any JSON).';
COMMENT ON COLUMN skiplock.jobs.output IS 'Output recorded by the handler (any JSON).';

-- Ordering lanes. Only the head of a lane (its unfinished job with the lowest id) is
-- `queued`; the jobs behind it wait in `waiting` and are promoted one at a time by
-- skiplock.advance_lanes when the head finishes. So the claim never scans a lane's
-- backlog, and the database itself refuses a second running job per key.
CREATE UNIQUE INDEX jobs_ordering_key_running_idx ON skiplock.jobs (ordering_key)
    WHERE state = 'running' AND ordering_key IS NOT NULL;
CREATE INDEX jobs_ordering_key_lane_idx ON skiplock.jobs (ordering_key, id)
    WHERE ordering_key IS NOT NULL AND state IN ('waiting', 'queued', 'running');

-- Promotes the head of each given lane to `queued` when it is waiting and nothing else in
-- the lane is queued or running. Called after lane jobs finish (by workers, the reaper,
-- cancel_job) and by the periodic sweep.
CREATE FUNCTION skiplock.advance_lanes(keys text[]) RETURNS int
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
              WHERE o.ordering_key = j.ordering_key AND o.state IN ('queued', 'running')
          )
        RETURNING j.queue
    )
    SELECT array_agg(DISTINCT queue), count(*) INTO promoted_queues, promoted FROM ready;
    PERFORM pg_notify('skiplock_jobs', q) FROM unnest(promoted_queues) AS q;
    RETURN promoted;
END;
$$;

-- Unique keys: at most one pending (not yet running) job per key.
CREATE UNIQUE INDEX jobs_unique_key_pending_idx ON skiplock.jobs (unique_key)
    WHERE unique_key IS NOT NULL AND state IN ('waiting', 'queued');

-- Dependencies: a job waits until every parent succeeded.
CREATE TABLE skiplock.job_dependencies (
    job_id    bigint NOT NULL REFERENCES skiplock.jobs (id) ON DELETE CASCADE,
    parent_id bigint NOT NULL REFERENCES skiplock.jobs (id) ON DELETE CASCADE,
    PRIMARY KEY (job_id, parent_id),
    CONSTRAINT job_dependencies_not_self CHECK (job_id <> parent_id)
);
CREATE INDEX job_dependencies_parent_idx ON skiplock.job_dependencies (parent_id);
CREATE INDEX jobs_waiting_idx ON skiplock.jobs (id) WHERE state = 'waiting';

COMMENT ON TABLE skiplock.job_dependencies IS
    'Edges of the dependency graph: job_id runs only after parent_id succeeded.';

-- Moves the waiting children of the given parents on: to `queued` once every parent
-- succeeded, or to `cancelled` (transitively, with the reason) once a parent is dead or
-- cancelled. Called by workers after they finish jobs that have dependants, by
-- cancel_job, and by the periodic sweep that repairs races with concurrent enqueues.
CREATE FUNCTION skiplock.settle_dependants(parent_ids bigint[]) RETURNS int
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
        WHERE d.parent_id = ANY (parent_ids) AND p.state IN ('dead', 'cancelled')
        UNION
        SELECT d.job_id, format('parent job %s was cancelled', d.parent_id)
        FROM skiplock.job_dependencies d
        JOIN doomed ON d.parent_id = doomed.id
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

-- Queues: paused queues are never claimed from; running jobs finish.
CREATE TABLE skiplock.queues (
    name       text PRIMARY KEY,
    paused     boolean NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION skiplock.pause_queue(queue_name text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO skiplock.queues (name, paused) VALUES (queue_name, true)
    ON CONFLICT (name) DO UPDATE SET paused = true, updated_at = now();
$$;

CREATE FUNCTION skiplock.resume_queue(queue_name text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO skiplock.queues (name, paused) VALUES (queue_name, false)
    ON CONFLICT (name) DO UPDATE SET paused = false, updated_at = now();
    SELECT pg_notify('skiplock_jobs', queue_name);
$$;

-- Cron schedules: each slot produces exactly one job, whoever computes it first.
CREATE TABLE skiplock.cron_schedules (
    name         text PRIMARY KEY,
    expression   text        NOT NULL,
    timezone     text        NOT NULL DEFAULT 'UTC',
    kind         text        NOT NULL,
    args         jsonb       NOT NULL DEFAULT '{}',
    queue        text        NOT NULL DEFAULT 'default',
    priority     smallint    NOT NULL DEFAULT 0,
    max_attempts int         NOT NULL DEFAULT 25,
    missed       text        NOT NULL DEFAULT 'latest',
    enabled      boolean     NOT NULL DEFAULT true,
    -- Slots up to and including this instant are done (enqueued or deliberately skipped).
    last_slot_at timestamptz NOT NULL DEFAULT now(),
    last_job_id  bigint,
    last_error   text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT cron_schedules_missed_known CHECK (missed IN ('latest', 'skip')),
    CONSTRAINT cron_schedules_kind_not_empty CHECK (kind <> '')
);

COMMENT ON COLUMN skiplock.cron_schedules.missed IS
    'Slots missed while no worker ran: latest = run the most recent missed slot once; skip = run none of them.';

-- Cancel a job that has not finished. A queued or waiting job never runs; a running job
-- is marked cancelled, its claim is void (the holder's completion changes nothing) and the
-- worker holding it is told at once, so it stops the handler. Dependants are settled and
-- the job's lane moves on.
CREATE FUNCTION skiplock.cancel_job(job_id bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    previous skiplock.job_state;
BEGIN
    SELECT state INTO previous FROM skiplock.jobs WHERE id = job_id FOR UPDATE;
    IF previous IS NULL OR previous NOT IN ('waiting', 'queued', 'running') THEN
        RETURN false;
    END IF;
    UPDATE skiplock.jobs
    SET state = 'cancelled', finished_at = now(), claim_token = NULL, heartbeat_at = NULL,
        last_error = coalesce(last_error, 'cancelled by operator')
    WHERE id = job_id;
    IF previous = 'running' THEN
        PERFORM pg_notify('skiplock_cancel', job_id::text);
    END IF;
    PERFORM skiplock.settle_dependants(ARRAY[job_id]);
    PERFORM skiplock.advance_lanes(ARRAY(
        SELECT ordering_key FROM skiplock.jobs WHERE id = job_id AND ordering_key IS NOT NULL));
    RETURN true;
END;
$$;

-- Put a dead, cancelled, succeeded or scheduled job back in line to run now, with one more
-- attempt when it had none left. Returns false if the job is running, waiting or missing.
-- A job in an ordering lane goes back behind the lane's head (as `waiting`) when its lane
-- is busy, and is promoted in id order. Refuses clearly when a pending job already holds
-- the same unique key.
CREATE FUNCTION skiplock.retry_job(job_id bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    q text;
    lane text;
BEGIN
    SELECT ordering_key INTO lane FROM skiplock.jobs WHERE id = job_id;
    IF lane IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('skiplock.lane:' || lane, 0));
    END IF;
    UPDATE skiplock.jobs j
    SET state = CASE WHEN lane IS NOT NULL AND EXISTS (
                         SELECT 1 FROM skiplock.jobs o
                         WHERE o.ordering_key = lane AND o.id <> job_id
                           AND o.state IN ('waiting', 'queued', 'running'))
                     THEN 'waiting' ELSE 'queued' END::skiplock.job_state,
        scheduled_at = now(),
        max_attempts = greatest(max_attempts, attempt + 1),
        finished_at = NULL
    WHERE id = job_id AND state IN ('queued', 'dead', 'cancelled', 'succeeded')
    RETURNING queue INTO q;
    IF q IS NULL THEN
        RETURN false;
    END IF;
    IF lane IS NOT NULL THEN
        PERFORM skiplock.advance_lanes(ARRAY[lane]);
    END IF;
    PERFORM pg_notify('skiplock_jobs', q);
    RETURN true;
EXCEPTION WHEN unique_violation THEN
    RAISE EXCEPTION 'job % cannot be retried while another pending job has the same unique_key', job_id
        USING ERRCODE = 'unique_violation';
END;
$$;

-- Enqueue from any language, with every option:
--   SELECT skiplock.enqueue('email', '{"to": "a@b.c"}', queue => 'mail');
-- Returns the job's id (the existing job's id when a unique key conflicts).
CREATE FUNCTION skiplock.enqueue(
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
    payload jsonb := enqueue.args;
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
    IF ordering_key IS NOT NULL THEN
        -- Serialise enqueues into one lane until commit, so each sees the one before it
        -- and exactly one job of the lane is its queued head.
        PERFORM pg_advisory_xact_lock(hashtextextended('skiplock.lane:' || ordering_key, 0));
        IF EXISTS (SELECT 1 FROM skiplock.jobs o
                   WHERE o.ordering_key = enqueue.ordering_key
                     AND o.state IN ('waiting', 'queued', 'running')) THEN
            initial := 'waiting';
        END IF;
    END IF;
    IF unique_key IS NOT NULL AND on_conflict = 'merge' AND jsonb_typeof(payload) <> 'array' THEN
        payload := jsonb_build_array(payload);
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
    INSERT INTO skiplock.jobs AS j (kind, args, queue, priority, scheduled_at, max_attempts,
                                    ordering_key, unique_key, unique_policy, state,
                                    finished_at, last_error)
    VALUES (enqueue.kind, payload, enqueue.queue, enqueue.priority, enqueue.scheduled_at,
            enqueue.max_attempts, enqueue.ordering_key, enqueue.unique_key,
            CASE WHEN enqueue.unique_key IS NOT NULL THEN on_conflict END, initial,
            CASE WHEN initial = 'cancelled' THEN now() END, reason)
    ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND state IN ('waiting', 'queued')
    DO UPDATE SET args = CASE excluded.unique_policy
        WHEN 'replace' THEN excluded.args
        WHEN 'merge' THEN j.args || excluded.args
        ELSE j.args END
    RETURNING j.id INTO new_id;
    IF cardinality(depends_on) > 0 THEN
        INSERT INTO skiplock.job_dependencies (job_id, parent_id)
        SELECT new_id, d FROM unnest(depends_on) AS d ON CONFLICT DO NOTHING;
    END IF;
    RETURN new_id;
END;
$$;
