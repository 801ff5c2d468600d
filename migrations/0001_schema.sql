-- skiplock schema, version 1: every object skiplock keeps in the Postgres schema `skiplock`.
--
-- Read top to bottom: the type, the tables, the indexes, the functions, the triggers, the
-- views, then the comments that Postgres stores with the objects (\d+ and \df+ show them).
-- schema/skiplock.sql is the same schema as pg_dump prints it; CI checks that the two agree.
-- From here on migrations only move forward: a change to this schema is a new file
-- (0002_….sql), never an edit of this one, which databases have already applied.
--
-- Who moves a job out of each state:
--   waiting   -> queued     when every parent succeeded (dependencies), or its ordering lane
--                           reaches it (advance_lanes)
--   queued    -> running    a worker's claim (claim_batch: SKIP LOCKED, new claim_token, attempt + 1)
--   running   -> succeeded  the claim holder's completer
--   running   -> queued     the claim holder's completer (retry with backoff), the reaper
--                           (stale heartbeat) or a graceful shutdown (release, attempt not counted)
--   running   -> dead       the claim holder's completer or the reaper, once attempts are exhausted
--   dead      -> queued     an operator: skiplock.retry_job(id) or `skiplock retry`
--   any unfinished -> cancelled  an operator: skiplock.cancel_job(id) or `skiplock cancel`
--
-- Rows written by hand (INSERT/UPDATE), by skiplock.enqueue, by the CLI and by the Rust API
-- go through the same rules, in the database:
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

CREATE SCHEMA IF NOT EXISTS skiplock;

CREATE TYPE skiplock.job_state AS ENUM (
    'waiting', 'queued', 'running', 'succeeded', 'dead', 'cancelled'
);

-- =========================================================================================
-- Tables
-- =========================================================================================

-- Every job, finished ones included until the pruner removes them.
--
-- A claim token exists only while its job runs (jobs_claim_token_only_running). Every
-- transition out of `running` clears it (complete, fail, release, reap, cancel); the
-- constraint makes it a guarantee, so "the row carries my token" alone proves "my claim is
-- live", and the completion, failure, release and heartbeat statements can find their rows
-- by primary key without a `state = 'running'` filter (see src/db/jobs.rs for why that
-- matters).
--
-- A queue table turns rows over fast: every job leaves two dead row versions behind, and
-- the claim index keeps entries for claimed rows until VACUUM removes them, entries each
-- claim then walks past. So autovacuum vacuums and analyzes this table after 2 % of it
-- changed instead of the server-wide 20 % / 10 %; ANALYZE also refreshes the statistics
-- that cached plans were made from. (Not measured with autovacuum on: the development
-- server runs with autovacuum = off; see docs/benchmarks.md.)
CREATE TABLE skiplock.jobs (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue         text               NOT NULL DEFAULT 'default',
    kind          text               NOT NULL,
    args          jsonb              NOT NULL DEFAULT '{}',
    state         skiplock.job_state NOT NULL DEFAULT 'queued',
    priority      smallint           NOT NULL DEFAULT 0,
    scheduled_at  timestamptz        NOT NULL DEFAULT now(),
    attempt       int                NOT NULL DEFAULT 0,
    max_attempts  int                NOT NULL DEFAULT 25,
    claim_token   uuid,
    claimed_by    text,
    claimed_at    timestamptz,
    heartbeat_at  timestamptz,
    ordering_key  text,
    unique_key    text,
    last_error    text,
    errors        jsonb              NOT NULL DEFAULT '[]',
    created_at    timestamptz        NOT NULL DEFAULT now(),
    finished_at   timestamptz,
    unique_policy text,
    progress      jsonb,
    output        jsonb,
    CONSTRAINT jobs_kind_not_empty CHECK (kind <> ''),
    CONSTRAINT jobs_queue_not_empty CHECK (queue <> ''),
    CONSTRAINT jobs_max_attempts_positive CHECK (max_attempts >= 1),
    CONSTRAINT jobs_attempt_not_negative CHECK (attempt >= 0),
    CONSTRAINT jobs_running_has_claim CHECK (
        state <> 'running' OR (claim_token IS NOT NULL AND heartbeat_at IS NOT NULL)
    ),
    CONSTRAINT jobs_unique_policy_known CHECK (unique_policy IN ('skip', 'replace', 'merge')),
    CONSTRAINT jobs_claim_token_only_running CHECK (claim_token IS NULL OR state = 'running')
) WITH (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);

-- Dependencies: a job waits until every parent succeeded.
--
-- An edge outlives its parent, and says what became of it:
--   * parent row present: the parent's own state decides;
--   * parent row gone, parent_state NULL: the parent succeeded and was pruned (or deleted
--     after it succeeded); the edge is satisfied;
--   * parent row gone, parent_state set: the parent was deleted before it succeeded, while
--     in that state (a tombstone); the edge can never be satisfied, and the child is
--     cancelled whenever it would otherwise wait for it. Without the tombstone, a child
--     retried by hand after its unfinished parent was deleted would be queued and run
--     although its parent never succeeded.
-- So parent_id has no foreign key: edges are deleted with their child (the job_id foreign
-- key cascades), never with their parent, and deleting a succeeded job costs no cascade
-- probe of job_dependencies per row. The lock a foreign key would take on the parent while
-- an edge is inserted, so that the parent cannot disappear under a new edge, the insert
-- trigger (job_dependencies_after_insert) takes itself.
CREATE TABLE skiplock.job_dependencies (
    job_id       bigint NOT NULL REFERENCES skiplock.jobs (id) ON DELETE CASCADE,
    parent_id    bigint NOT NULL,
    parent_state skiplock.job_state,
    PRIMARY KEY (job_id, parent_id),
    CONSTRAINT job_dependencies_not_self CHECK (job_id <> parent_id),
    CONSTRAINT job_dependencies_tombstone_unfinished
        CHECK (parent_state IS DISTINCT FROM 'succeeded')
);

-- Queues: paused queues are never claimed from; running jobs finish.
CREATE TABLE skiplock.queues (
    name       text PRIMARY KEY,
    paused     boolean NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now()
);

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

-- Job history that survives pruning.
--
-- Finished jobs are deleted by the pruner, so their numbers move into this small rollup
-- table in the very statement that deletes them (see src/db/history.rs:
-- jobs_prune_finished_rolled_up). The completion path is untouched: a finished job is
-- counted live in skiplock.jobs until it is pruned, and in the rollup afterwards, never in
-- both and never in neither. History queries (src/db/history.rs) add the two up, counting
-- live rows with the same SQL that rolls them up.
--
-- Time buckets are whole hours in UTC. What one finished job contributes:
--   succeeded / dead / cancelled  1 in the hour of finished_at, by final state
--   failed                        1 per entry of errors (each failed attempt), in the hour of
--                                 that entry's `at`; errors keeps the 20 most recent failures,
--                                 so a job that failed more often counts 20
--   run time                      finished_at - claimed_at (the last attempt), succeeded and
--                                 dead jobs only, with a histogram over job_history_run_bounds()
--   wait time                     claimed_at - scheduled_at (due until claimed), same jobs
--
-- Retention: job_history_prune_expired folds hours older than the retention (a year by
-- default) into one row per queue and kind at bucket '-infinity', so lifetime totals (the
-- Prometheus counters) never go down while the hourly detail ages out.
CREATE TABLE skiplock.job_history (
    bucket        timestamptz NOT NULL,
    queue         text        NOT NULL,
    kind          text        NOT NULL,
    succeeded     bigint      NOT NULL DEFAULT 0,
    failed        bigint      NOT NULL DEFAULT 0,
    dead          bigint      NOT NULL DEFAULT 0,
    cancelled     bigint      NOT NULL DEFAULT 0,
    run_count     bigint      NOT NULL DEFAULT 0,
    run_seconds   float8      NOT NULL DEFAULT 0,
    wait_count    bigint      NOT NULL DEFAULT 0,
    wait_seconds  float8      NOT NULL DEFAULT 0,
    run_histogram bigint[]    NOT NULL DEFAULT '{}',
    PRIMARY KEY (bucket, queue, kind)
);

-- =========================================================================================
-- Indexes
-- =========================================================================================

-- The claim path. Partial, so its size follows the runnable backlog, not the history:
-- finished rows (succeeded, dead, cancelled) never enter it and cost the claim nothing.
CREATE INDEX jobs_claim_idx ON skiplock.jobs (priority, scheduled_at, id)
    WHERE state = 'queued';

-- The reaper and the heartbeat look only at running rows.
CREATE INDEX jobs_running_idx ON skiplock.jobs (heartbeat_at)
    WHERE state = 'running';

-- The pruner walks finished rows by age.
CREATE INDEX jobs_finished_idx ON skiplock.jobs (state, finished_at)
    WHERE finished_at IS NOT NULL;

-- Dependencies: the waiting jobs, and the children of a parent.
CREATE INDEX jobs_waiting_idx ON skiplock.jobs (id) WHERE state = 'waiting';
CREATE INDEX job_dependencies_parent_idx ON skiplock.job_dependencies (parent_id);

-- Ordering lanes. Only the head of a lane (its unfinished job with the lowest id) is
-- `queued`; the jobs behind it wait in `waiting` and are promoted one at a time by
-- skiplock.advance_lanes when the head finishes. So the claim never scans a lane's
-- backlog, and the database itself refuses a second running job per key.
CREATE UNIQUE INDEX jobs_ordering_key_running_idx ON skiplock.jobs (ordering_key)
    WHERE state = 'running' AND ordering_key IS NOT NULL;
CREATE INDEX jobs_ordering_key_lane_idx ON skiplock.jobs (ordering_key, id)
    WHERE ordering_key IS NOT NULL AND state IN ('waiting', 'queued', 'running');

-- Unique keys: at most one pending (not yet running) job per key.
CREATE UNIQUE INDEX jobs_unique_key_pending_idx ON skiplock.jobs (unique_key)
    WHERE unique_key IS NOT NULL AND state IN ('waiting', 'queued');

-- Deliberately no index on all rows by (queue, state). Every claim and every completion
-- writes a new row version, and (as `state` is in the predicates of the partial indexes)
-- never a HOT one: each index on all rows takes one more entry per transition. Such an
-- index would serve only operator counts by queue, and cost the drain about 15 % (floor of
-- claim + complete, batch 1000 on two connections: 49,400 jobs/s without it, 40,400 with
-- it; WAL per job 912 bytes without, 1,063 with). The operator queries use the partial
-- indexes instead (skiplock.stats) or the primary key (listings, newest first);
-- skiplock.queue_counts counts every retained row by a sequential scan, and skiplock.stats
-- is the cheap view to poll.

-- =========================================================================================
-- Functions
-- =========================================================================================

-- Default retry delay, shared by the reaper and documented beside the Rust policy
-- (src/retry.rs): min(2^attempt, 3600) seconds, times a random factor in [0.75, 1.25).
CREATE FUNCTION skiplock.backoff(attempt int) RETURNS interval
LANGUAGE sql VOLATILE AS $$
    SELECT make_interval(secs => least(power(2, least(attempt, 30)), 3600) * (0.75 + random() * 0.5));
$$;

-- Append a failure to a job's error list, keeping the most recent 20.
CREATE FUNCTION skiplock.append_error(errors jsonb, attempt int, message text) RETURNS jsonb
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

-- ---- Unique keys ------------------------------------------------------------------------

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

-- ---- Dependencies and lanes -------------------------------------------------------------

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

-- Moves the waiting children of the given parents on: to `queued` once every parent
-- succeeded, or to `cancelled` (transitively, with the reason) once a parent is dead,
-- cancelled or deleted before it succeeded (a tombstone). Called by workers after they
-- finish jobs that have dependants, by cancel_job, and by the periodic sweep that repairs
-- races with concurrent enqueues.
--
-- Cancellation reaches only jobs still waiting: the recursion follows a child only if it
-- is being cancelled now, never through children that already succeeded or are running
-- (which would cancel their own waiting children). An edge with a tombstone keeps a child
-- waiting like an unfinished parent.
CREATE FUNCTION skiplock.settle_dependants(parent_ids bigint[]) RETURNS int
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

-- Promotes the head of each given lane (the lane's oldest unfinished job) to `queued` when
-- it waits and nothing of the lane runs, even if a later job of the lane is `queued`
-- (written so by hand, or by a race; requiring no queued job there would leave such a lane
-- standing still for good). A head that still waits for a parent, or has a tombstoned one
-- (settle_dependants cancels it), stays waiting. Called after lane jobs finish (by
-- workers, the reaper, cancel_job) and by the periodic sweep.
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

-- ---- Enqueue and claim ------------------------------------------------------------------

-- Enqueue from any language, with every option:
--   SELECT skiplock.enqueue('email', '{"to": "a@b.c"}', queue => 'mail');
-- Lane order, unique keys and the args limit are the insert trigger's (jobs_before_insert,
-- so plain INSERTs get them too); this function adds the options a plain insert has no
-- column for (on_conflict, depends_on) and returns the id: the new job's, or the pending
-- job's that holds the unique key.
--
-- priority is an int, not the column's smallint: Postgres does not turn an integer literal
-- into a smallint for a function argument, so `priority => 5` would fail with "function
-- skiplock.enqueue(...) does not exist" unless written `5::smallint`. A priority outside
-- the smallint range is refused with a message that says so.
--
-- Inside a REPEATABLE READ or SERIALIZABLE transaction the lane and key checks cannot see
-- jobs committed after the transaction's snapshot: a lane then may get two `queued` jobs,
-- which the claim still runs one at a time in id order, and a unique key held by a job
-- the snapshot cannot see fails with serialization_failure (SQLSTATE 40001), which the
-- caller retries like any serialization failure.
CREATE FUNCTION skiplock.enqueue(
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
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    new_id bigint;
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
    INSERT INTO skiplock.jobs AS j (kind, args, queue, priority, scheduled_at, max_attempts,
                                    ordering_key, unique_key, unique_policy, state,
                                    finished_at, last_error)
    VALUES (enqueue.kind, enqueue.args, enqueue.queue, enqueue.priority::smallint,
            enqueue.scheduled_at,
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

-- The claim, as the worker runs it: up to max_jobs runnable jobs of the given queues and
-- kinds, in claim order (priority, then scheduled_at, then id), each stamped running with
-- a claim_token, the claimant and the database's now() as first heartbeat.
--
-- Why a function: its plan must be "walk jobs_claim_idx in order, stop after max_jobs"
-- whatever the statistics say. Statistics taken while the table was empty (a fresh
-- migration, or ANALYZE between two bursts, and never refreshed when autovacuum is off or
-- has not come round yet) made the planner expect one row, and the plain statement then
-- sorted every queued row on each claim: 165 ms instead of 10 ms for 1,000 jobs out of
-- 200,000 queued, with the sort spilling to disk. The same statistics let a cached plan
-- check a lane head's running sibling with a sequential scan of the whole table. Inside
-- the function sorts, bitmap scans and sequential scans are priced out, so the pick walks
-- the claim index (the only ordered path left) and the lane checks probe the lane indexes;
-- JIT is off, as the cost those settings add would otherwise trigger it on every call.
-- PL/pgSQL caches the plan per connection, so a call costs no planning.
--
-- How it picks: FOR UPDATE SKIP LOCKED, so concurrent claimers never wait on each other
-- and never pick the same row. A paused queue is skipped with NOT IN (a hashed subplan,
-- built once per call).
--
-- Lane order: a lane job is claimed only when nothing of its lane runs and no older job of
-- its lane is unfinished, so at most one job per lane runs, always the lane's oldest,
-- whatever states the lane's rows were written with (two `queued` jobs in one lane,
-- inserted by hand, must not make every claim fail on jobs_ordering_key_running_idx). The
-- two checks are separate probes: the running one hits the unique index once, the
-- older-job one stops at the first index entry. Between this statement's snapshot and its
-- write, another claim may still commit a running job of the same lane (a race the
-- snapshot cannot see). The unique index then refuses our write; the claim is retried at
-- once without lane jobs, so the lane-less jobs of the batch are claimed anyway and the
-- lane's job waits for the next claim, which sees the running one. The block costs one
-- subtransaction per claim statement (not per job). attempt is capped so that a row with
-- attempt at the int maximum cannot fail the claim on an overflow.
--
-- The update finds the locked rows by ctid (a TID scan, no second index descent per row:
-- 2.5x faster on a table of 1,000,000 rows), so the result is sorted again into claim
-- order. A row changed after the snapshot but before the lock (claimed, released and
-- queued again meanwhile) has a new version the snapshot cannot see by ctid; it is then
-- not claimed and stays queued for the next claim, which is harmless.
--
-- Where it starts: from the left edge of jobs_claim_idx (a full walk), or, given the claim
-- key (after_priority, after_scheduled_at_us, after_id) of the last job the caller claimed,
-- from just after it. A claimed job leaves its entry in the claim index (the new row
-- version is `running`, outside the partial index, and the old one stays until no snapshot
-- can see it). Normally Postgres soon marks such entries dead and later claims skip them
-- for free; while any transaction holds an older snapshot (a long report, pg_dump, a
-- forgotten BEGIN in psql) it cannot, and every full walk steps over the entries of every
-- job claimed since that snapshot began, fetching each heap row to check it: measured, 20
-- ms per claim of 1,000 after 100,000 claims under a held snapshot, against 0.5 ms from
-- the position of the last claim. The worker keeps that position per producer, and still
-- walks from the left edge whenever that costs no more than a walk from the position,
-- which is always in a clean database, and otherwise paced by what it costs beyond one:
-- for the jobs that land behind the position (a higher priority, a job that waited for
-- its parents or its lane and became queued with its old scheduled_at, an insert whose
-- transaction committed late, a paused queue resumed), and to keep the left edge tidy.
-- See src/worker/claim_cursor.rs. The position's scheduled_at travels as microseconds
-- since the Unix epoch (bigint), so that a row scheduled at '-infinity' (the table accepts
-- it) is claimed like any other: it is sent as the bigint minimum, which means '-infinity'
-- here.
--
-- The token: when the connection dies between the claim's commit and its reply (a server
-- restart, a failover, a network cut), the worker never learns which jobs it claimed; they
-- would stay `running` with nobody heartbeating them until the reaper took them back, a
-- stale timeout later (30 s by default) with an attempt spent. So the worker passes a
-- fresh token with every claim (claim_with); every job that claim takes holds it as its
-- claim_token, and after a lost reply the worker finds exactly those jobs by the token and
-- releases them at once, without spending the attempt. A token is still the fence of each
-- job's claim: every claim-holder write matches (id, claim_token), and a new claim gets a
-- new token. Without claim_with each job gets a random token of its own.
CREATE FUNCTION skiplock.claim_batch(queues text[], kinds text[], max_jobs bigint, worker text,
                                     after_priority smallint DEFAULT NULL,
                                     after_scheduled_at_us bigint DEFAULT NULL,
                                     after_id bigint DEFAULT NULL,
                                     claim_with uuid DEFAULT NULL)
RETURNS TABLE (id bigint, queue text, kind text, args jsonb, attempt int, max_attempts int,
               claim_token uuid, priority smallint, scheduled_at_us bigint)
LANGUAGE plpgsql
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    with_lanes boolean := true;
    from_priority smallint := -32768;
    from_scheduled_at timestamptz := '-infinity';
    from_id bigint := -9223372036854775808;
BEGIN
    -- Without a position, a key before every row: the full walk.
    IF after_priority IS NOT NULL AND after_scheduled_at_us IS NOT NULL
       AND after_id IS NOT NULL THEN
        from_priority := after_priority;
        from_scheduled_at := CASE WHEN after_scheduled_at_us = -9223372036854775808
            THEN '-infinity'::timestamptz
            ELSE 'epoch'::timestamptz + after_scheduled_at_us * interval '1 microsecond' END;
        from_id := after_id;
    END IF;
    LOOP
        BEGIN
            -- From the position on, with the caller's token when it gives one. The result
            -- is sorted (claim order) after the update has finished, so an update that
            -- fails has returned no row yet.
            RETURN QUERY
            WITH picked AS (
                SELECT j.ctid FROM skiplock.jobs j
                WHERE j.state = 'queued' AND j.scheduled_at <= now()
                  AND (j.priority, j.scheduled_at, j.id) > (from_priority, from_scheduled_at, from_id)
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
                SET state = 'running', claim_token = coalesce(claim_with, gen_random_uuid()), claimed_by = worker,
                    claimed_at = now(), heartbeat_at = now(),
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

-- ---- Operator actions -------------------------------------------------------------------

-- One attempt at cancelling a job that has not finished; skiplock.cancel_job wraps it. A
-- queued or waiting job never runs; a running job is marked cancelled, its claim is void
-- (the holder's completion changes nothing) and the worker holding it is told at once, so
-- it stops the handler. Dependants are settled and the job's lane moves on.
CREATE FUNCTION skiplock.cancel_job_once(job_id bigint) RETURNS boolean
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
CREATE FUNCTION skiplock.cancel_job(job_id bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    attempts int := 0;
BEGIN
    LOOP
        BEGIN
            RETURN skiplock.cancel_job_once(job_id);
        EXCEPTION WHEN deadlock_detected THEN
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

-- Put a dead, cancelled, succeeded or scheduled job back in line to run now, with one more
-- attempt when it had none left. Returns false only if the job is running, waiting or
-- missing. A job in an ordering lane goes back behind the lane's head (as `waiting`) when
-- its lane is busy, and is promoted in id order. A child whose parents have not all
-- succeeded goes back to `waiting` (not `queued` beside its unfinished parent), and one
-- with a dead, cancelled or tombstoned parent is cancelled again at once by the
-- settle_dependants at the end, with the reason, instead of running. A job whose
-- unique_key was taken meanwhile is superseded (skiplock.fold_into_key_holder) instead of
-- raising.
CREATE FUNCTION skiplock.retry_job(job_id bigint) RETURNS boolean
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

-- Put every dead job (of one queue, or of all when queue_name is NULL) back in line, as
-- skiplock.retry_job does for one. Returns the ids retried. A dead job whose unique_key is
-- taken is superseded by retry_job, not refused; the exception handler is for anything
-- else a single row may raise: that job is left dead with a warning, so one row never
-- fails the whole call. Example: SELECT count(*) FROM skiplock.retry_dead_jobs('mail');
CREATE FUNCTION skiplock.retry_dead_jobs(queue_name text DEFAULT NULL) RETURNS SETOF bigint
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

-- ---- History ----------------------------------------------------------------------------

-- Upper bounds, in seconds, of the run-time histogram buckets. Their number (16) is fixed:
-- src/db/history.rs counts 17 intervals.
CREATE FUNCTION skiplock.job_history_run_bounds() RETURNS float8[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT '{0.005,0.01,0.025,0.05,0.1,0.25,0.5,1,2.5,5,10,30,60,300,900,3600}'::float8[];
$$;

-- Element-wise sum; the shorter array counts as padded with zeros.
CREATE FUNCTION skiplock.job_history_array_add(a bigint[], b bigint[]) RETURNS bigint[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(array_agg(coalesce(x, 0) + coalesce(y, 0) ORDER BY n), '{}')
    FROM unnest(coalesce(a, '{}'), coalesce(b, '{}')) WITH ORDINALITY AS t(x, y, n);
$$;

CREATE AGGREGATE skiplock.job_history_array_sum(bigint[]) (
    SFUNC = skiplock.job_history_array_add,
    STYPE = bigint[],
    INITCOND = '{}'
);

-- ---- Trigger functions ------------------------------------------------------------------

-- Wake idle workers when runnable jobs arrive, whoever inserts them (the Rust API, plain
-- SQL, another language). One notification per statement and queue: a 10,000-row insert
-- sends one message, and Postgres folds identical payloads within a transaction.
CREATE FUNCTION skiplock.notify_jobs_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    q text;
BEGIN
    FOR q IN
        SELECT DISTINCT queue FROM inserted
        WHERE state = 'queued' AND scheduled_at <= now()
    LOOP
        PERFORM pg_notify('skiplock_jobs', q);
    END LOOP;
    RETURN NULL;
END;
$$;

-- Before a row is inserted, whoever inserts it: the args limit, lane order, unique keys.
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

-- Deleting a job that had not succeeded (by hand, or the pruner removing a dead or
-- cancelled one) must not release its waiting children: its edges keep its state as a
-- tombstone (see skiplock.job_dependencies), and its waiting children are cancelled,
-- transitively, with the reason.
CREATE FUNCTION skiplock.jobs_after_delete() RETURNS trigger
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

-- A dependency row written by hand means what enqueue's depends_on means: a child that has
-- not started waits for a parent that has not succeeded, and is cancelled at once when the
-- parent is already dead or cancelled. Adding a parent to a job that already started is
-- refused: the job may have run before the parent. The parent must exist (locked FOR KEY
-- SHARE, as a foreign key would, so that it cannot be deleted before this edge commits and
-- the delete trigger sees it); parent_state is skiplock's own.
CREATE FUNCTION skiplock.job_dependencies_after_insert() RETURNS trigger
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

-- =========================================================================================
-- Triggers
-- =========================================================================================

CREATE TRIGGER jobs_notify_inserted
    AFTER INSERT ON skiplock.jobs
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION skiplock.notify_jobs_inserted();

-- Only rows that use lanes or unique keys (or carry large args) pay for the call: the
-- trigger's WHEN clause is evaluated without entering PL/pgSQL.
CREATE TRIGGER jobs_before_insert
    BEFORE INSERT ON skiplock.jobs
    FOR EACH ROW
    WHEN (NEW.ordering_key IS NOT NULL OR NEW.unique_key IS NOT NULL
          OR pg_column_size(NEW.args) > 4096)
    EXECUTE FUNCTION skiplock.jobs_before_insert();

-- Succeeded rows (what the pruner mostly deletes) skip the call.
--
-- An AFTER trigger, so that a statement deleting a parent together with its waiting
-- children (DELETE … WHERE queue = 'x') works: a BEFORE trigger's update of a child that
-- the same statement then deletes is an error. It must still see the dependency rows that
-- a foreign key's cascade in the same statement deletes (an internal AFTER trigger named
-- RI_ConstraintTrigger_…): triggers of one event fire in the byte order of their names, so
-- this one's name starts with a capital letter before R.
CREATE TRIGGER "Jobs_after_delete_cancel_waiting_children"
    AFTER DELETE ON skiplock.jobs
    FOR EACH ROW
    WHEN (OLD.state <> 'succeeded')
    EXECUTE FUNCTION skiplock.jobs_after_delete();

CREATE TRIGGER job_dependencies_after_insert
    AFTER INSERT ON skiplock.job_dependencies
    FOR EACH ROW EXECUTE FUNCTION skiplock.job_dependencies_after_insert();

-- =========================================================================================
-- Views for operators
-- =========================================================================================
--
-- Every view reads the one logical table skiplock.jobs by the database clock (now()), so
-- the numbers agree whichever machine asks. They are plain views, computed when queried:
--   skiplock.stats          per queue and kind: runnable, scheduled, waiting, running,
--                           succeeded and dead in the last hour, lag, jobs per second
--   skiplock.queue_counts   per queue: jobs in each state, whether the queue is paused
--   skiplock.queue_lag      per queue: age of the oldest runnable job
--   skiplock.throughput     per queue and kind: jobs finished in the last minute and hour
--   skiplock.dead_jobs      dead jobs with their last error, newest first
--
-- Only unfinished jobs and jobs finished within the last hour feed stats, queue_lag and
-- throughput, so their cost follows the backlog and the last hour's traffic, not the
-- retained history. queue_counts counts every retained row (a sequential scan).
--
-- Jobs finished more than an hour ago may already be pruned (see the worker's retention),
-- so "last hour" numbers are exact only while retention is an hour or more.
--
-- The table accepts scheduled_at = '-infinity' (the job runs first) and 'infinity' (it
-- never comes due). `now() - '-infinity'` is an error ("cannot subtract infinite
-- timestamps"), so the lags count only jobs due at a finite time (such a row still counts
-- as runnable): one row written by hand must not make the views fail for every queue.

-- stats is read as four parts that each match a partial index (jobs_claim_idx,
-- jobs_waiting_idx, jobs_running_idx, jobs_finished_idx), so its cost follows the backlog
-- and the last hour, not the retained history.
CREATE VIEW skiplock.stats AS
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

CREATE VIEW skiplock.queue_counts AS
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

CREATE VIEW skiplock.queue_lag AS
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

CREATE VIEW skiplock.throughput AS
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

CREATE VIEW skiplock.dead_jobs AS
SELECT id, queue, kind, args, attempt, max_attempts, last_error, errors, created_at,
       finished_at
FROM skiplock.jobs
WHERE state = 'dead'
ORDER BY finished_at DESC, id DESC;

-- =========================================================================================
-- Comments stored with the objects
-- =========================================================================================

COMMENT ON TABLE skiplock.jobs IS
    'Every skiplock job, finished ones included until the pruner removes them.';
COMMENT ON COLUMN skiplock.jobs.claim_token IS
    'Fencing token of the current claim: only a write that presents it may heartbeat, complete or fail the job.';
COMMENT ON COLUMN skiplock.jobs.errors IS
    'The most recent failures (at most 20), oldest first: {attempt, at, message}.';
COMMENT ON COLUMN skiplock.jobs.unique_policy IS
    'What a second enqueue with the same unique_key does while this job is pending: skip, replace (new args) or merge (append args).';
COMMENT ON COLUMN skiplock.jobs.progress IS 'Latest progress reported by the handler (any JSON).';
COMMENT ON COLUMN skiplock.jobs.output IS 'Output recorded by the handler (any JSON).';

COMMENT ON TABLE skiplock.job_dependencies IS
    'Edges of the dependency graph: job_id runs only after parent_id succeeded. An edge whose '
    'parent row is gone is satisfied when parent_state is NULL (the parent succeeded and was '
    'pruned) and never satisfied when parent_state is set (the parent was deleted in that '
    'state before it succeeded).';
COMMENT ON COLUMN skiplock.job_dependencies.parent_state IS
    'NULL while the parent exists or after it was deleted as succeeded; the parent''s state '
    'when it was deleted before it succeeded (written by skiplock, never by hand).';

COMMENT ON COLUMN skiplock.cron_schedules.missed IS
    'Slots missed while no worker ran: latest = run the most recent missed slot once; skip = run none of them.';

COMMENT ON TABLE skiplock.job_history IS
    'Hourly (UTC) numbers of pruned jobs per queue and kind; bucket -infinity holds everything older than the retention. Live (not yet pruned) jobs are not in it.';
COMMENT ON COLUMN skiplock.job_history.failed IS
    'Failed attempts (entries of the jobs'' errors lists), in the hour each failure happened.';
COMMENT ON COLUMN skiplock.job_history.run_histogram IS
    'Run times counted per interval of skiplock.job_history_run_bounds() (16 bounds, 17 elements): element 1 counts run times under bounds[1], element i+1 those from bounds[i] up to bounds[i+1], element 17 those from bounds[16] on.';

COMMENT ON FUNCTION skiplock.enqueue(text, jsonb, text, int, timestamptz, int, text, text, text, bigint[]) IS
    'Enqueues a job from any language and returns its id (or, for a unique_key already pending, that job''s id). Example: SELECT skiplock.enqueue(''send_email'', ''{"to": "a@example.com"}'', priority => -1);';
COMMENT ON FUNCTION skiplock.claim_batch(text[], text[], bigint, text, smallint, bigint, bigint, uuid) IS
    'Claims up to max_jobs runnable jobs (what a worker runs), after the given claim key if any; each comes back with its fencing claim_token (claim_with when given).';
COMMENT ON FUNCTION skiplock.cancel_job_once(bigint) IS
    'One attempt of skiplock.cancel_job, without the deadlock retry; call cancel_job instead.';
COMMENT ON FUNCTION skiplock.cancel_job(bigint) IS
    'Cancels a job that has not finished; retries a deadlock after a short jittered wait. Returns false if the job had finished or does not exist.';

COMMENT ON VIEW skiplock.stats IS
    'Per queue and kind: runnable (queued, due), scheduled (queued, not yet due), waiting, running, succeeded and dead in the last hour, lag_seconds (age of the oldest runnable job) and per_second (successes over the last minute / 60). Example: SELECT * FROM skiplock.stats ORDER BY lag_seconds DESC;';
COMMENT ON VIEW skiplock.queue_counts IS
    'Per queue: how many retained jobs are in each state. Example: SELECT queue, queued, dead FROM skiplock.queue_counts WHERE dead > 0;';
COMMENT ON VIEW skiplock.queue_lag IS
    'Per queue with queued jobs: how long the oldest runnable job has been due (zero when none is due). Example: SELECT queue, lag FROM skiplock.queue_lag WHERE lag > interval ''1 minute'';';
COMMENT ON VIEW skiplock.throughput IS
    'Per queue and kind: jobs that succeeded or died in the last minute and hour, and successes per second. Example: SELECT * FROM skiplock.throughput WHERE queue = ''mail'';';
COMMENT ON VIEW skiplock.dead_jobs IS
    'Dead jobs with their last error, newest first. Example: SELECT id, kind, last_error FROM skiplock.dead_jobs LIMIT 20;';
