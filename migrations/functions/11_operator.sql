-- migrations/functions/11_operator.sql: Operator actions: cancel, retry, pause and resume,
-- limits, why a job is not running, and the triggers on queues.
--
-- Defines:
--   internal_cancel_job_once, internal_retry_job_once, internal_run_job_action, cancel_job
--   retry_job, retry_dead_jobs
--   internal_check_queue_name, internal_set_queue_paused, internal_check_running_limit
--   internal_check_rate_limit, set_queue_limits, pause_queue
--   why_not_running, resume_queue, internal_queues_after_write, trigger queues_after_write
--   internal_queues_after_handoff_rules_change, trigger queues_after_handoff_rules_change
--   internal_queues_after_max_running_change, trigger queues_after_max_running_change
--   trigger queues_after_max_running_insert
--   internal_queues_after_limits_set, trigger queues_after_limits_set_insert
--   trigger queues_after_limits_set_update
--   internal_queues_after_fairness_change, trigger queues_after_fairness_change
--   trigger queues_after_fairness_delete
--   internal_queues_after_key_limit, trigger queues_after_key_limit_change
--   trigger queues_after_key_limit_delete

-- ---- Operator actions --------------------------------------------------------------------

-- One attempt at cancelling a job that has not finished; skiplock.cancel_job wraps it. A
-- queued or waiting job never runs; a running job is marked cancelled, its claim is void
-- (the holder's completion changes nothing) and the worker holding it is told at once, so
-- it stops the handler. Dependants are settled and the job's lane moves on.
CREATE OR REPLACE FUNCTION skiplock.internal_cancel_job_once(job_id bigint) RETURNS boolean
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    previous skiplock.job_state;
    job_queue text;
    job_key text;
    lane text;
BEGIN
    -- The lane's lock before the row's, in the order an enqueue and retry_job take them:
    -- the lane's step below takes it, and waiting for it while holding the row closed a
    -- cycle with a retry_job of the same job, which holds the lane's lock and waits for
    -- the row (the model test, seed 3).
    -- Only a job that has not finished is cancelled: it is looked up in jobs_live alone, so
    -- the cost does not follow the days of finished jobs kept (through skiplock.jobs, each
    -- lookup probed and locked every day's table: 500 cancels took 0.6 s beside 11 tables
    -- and 3.7 s beside 101). A finished job is not there, as it is not cancelled.
    SELECT ordering_key INTO lane FROM skiplock.jobs_live WHERE id = job_id;
    IF lane IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(skiplock.internal_lane_lock_id(lane));
    END IF;
    SELECT state, queue, concurrency_key INTO previous, job_queue, job_key
    FROM skiplock.jobs_live WHERE id = job_id FOR UPDATE;
    IF previous IS NULL OR previous NOT IN ('waiting', 'queued', 'running') THEN
        RETURN false;
    END IF;
    -- Through skiplock.jobs, which moves the row to jobs_done; the state pins the plan to
    -- jobs_live.
    UPDATE skiplock.jobs
    SET state = 'cancelled', finished_at = now(), claim_token = NULL, heartbeat_at = NULL,
        held_for = NULL, last_error = coalesce(last_error, 'cancelled by operator')
    WHERE id = job_id AND state IN ('waiting', 'queued', 'running');
    IF previous = 'running' THEN
        PERFORM pg_notify('skiplock_cancel', job_id::text);
    END IF;
    -- A running job's slot, or a queued job's place among its key's admitted jobs (and,
    -- with key_claimable, its key's turn).
    IF previous = 'running' OR (previous = 'queued' AND job_key IS NOT NULL) THEN
        PERFORM skiplock.internal_notify_freed(ARRAY[job_queue], ARRAY[job_key]);
    END IF;
    IF previous = 'queued' AND job_key IS NOT NULL THEN
        PERFORM skiplock.internal_recheck_keys(ARRAY[job_queue], ARRAY[job_key]);
    END IF;
    PERFORM skiplock.internal_settle_dependants(ARRAY[job_id],
                                                 ARRAY(SELECT lane WHERE lane IS NOT NULL));
    RETURN true;
END;
$$;
COMMENT ON FUNCTION skiplock.internal_cancel_job_once(bigint) IS
    'One attempt of skiplock.cancel_job, without its retry on a deadlock or a moved row; call cancel_job instead.';

-- One attempt at putting a finished job back in line; skiplock.retry_job wraps it.
CREATE OR REPLACE FUNCTION skiplock.internal_retry_job_once(job_id bigint) RETURNS boolean
LANGUAGE plpgsql
SET jit = off
-- One plan per session: its UPDATE names the job's state and finished_at, so that it
-- probes only the table that holds the job (a plan for the values given at each call
-- spent more in planning than a probe of every day's table).
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    q text;
    p smallint;
    s timestamptz;
    now_state skiplock.job_state;
    lane text;
    key text;
    current skiplock.job_state;
    holder bigint;
    ended_at timestamptz;
    new_state skiplock.job_state;
    superseded text;
BEGIN
    -- The lane's and the unique key's locks before the row's, in the order an enqueue
    -- takes them: an enqueue holding the key's lock locks the key's pending job next, so
    -- a retry of that job that locked its row first and then waited for the key deadlocked.
    -- A live job (queued) first, then the finished ones from the day its id was handed out
    -- on (see "A job looked up by id" in 15_partitions.sql; one that moved back meanwhile,
    -- retried, is found there too).
    SELECT l.ordering_key, l.unique_key INTO lane, key FROM skiplock.jobs_live l
    WHERE l.id = job_id;
    IF NOT FOUND THEN
        SELECT f.ordering_key, f.unique_key INTO lane, key
        FROM skiplock.internal_finished_job(job_id) f;
    END IF;
    IF lane IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(skiplock.internal_lane_lock_id(lane));
    END IF;
    IF key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(skiplock.internal_unique_key_lock_id(key));
    END IF;
    SELECT j.state, j.unique_key, j.finished_at INTO current, key, ended_at
    FROM skiplock.jobs j
    WHERE j.id = job_id AND j.state IN ('waiting', 'queued', 'running') FOR UPDATE;
    IF NOT FOUND THEN
        SELECT f.state, f.unique_key, f.finished_at INTO current, key, ended_at
        FROM skiplock.internal_finished_job(job_id, 'FOR UPDATE') f;
    END IF;
    IF current IS NULL OR current NOT IN ('queued', 'dead', 'cancelled', 'succeeded') THEN
        RETURN false;
    END IF;
    -- A job with a unique key (as the row holds it, locked) may be superseded; one
    -- without costs no second lookup by id (each reads every day kept).
    holder := CASE WHEN key IS NOT NULL
                   THEN skiplock.internal_fold_into_key_holder(job_id) END;
    -- What the job becomes: superseded by its key's holder, behind its lane's turn or its
    -- parents, or queued (the lane's lock and the row's held).
    new_state := CASE
        WHEN holder IS NOT NULL THEN 'cancelled'
        WHEN lane IS NOT NULL AND EXISTS (
            SELECT 1 FROM skiplock.jobs o
            WHERE o.ordering_key = lane AND o.id <> job_id
              AND o.state IN ('waiting', 'queued', 'running'))
        THEN 'waiting'
        WHEN skiplock.internal_has_unmet_parent(job_id) THEN 'waiting'
        ELSE 'queued' END;
    superseded := CASE WHEN holder IS NOT NULL
                       THEN skiplock.internal_superseded_message(holder, key) END;
    -- The row locked above, where it is: its state and finished_at name its table (one
    -- day's, probed alone). Without a finished_at (a live job, or a finished one written by
    -- hand without it), its state alone.
    IF ended_at IS NULL THEN
        UPDATE skiplock.jobs j
        SET state = new_state, scheduled_at = now(),
            last_error = coalesce(superseded, j.last_error),
            finished_at = CASE WHEN superseded IS NOT NULL THEN now() END,
            max_attempts = greatest(j.max_attempts, j.attempt + 1)
        WHERE j.id = job_id AND j.state = current
        RETURNING j.queue, j.priority, j.scheduled_at, j.state INTO q, p, s, now_state;
    ELSE
        UPDATE skiplock.jobs j
        SET state = new_state, scheduled_at = now(),
            last_error = coalesce(superseded, j.last_error),
            finished_at = CASE WHEN superseded IS NOT NULL THEN now() END,
            max_attempts = greatest(j.max_attempts, j.attempt + 1)
        WHERE j.id = job_id AND j.state = current AND j.finished_at = ended_at
        RETURNING j.queue, j.priority, j.scheduled_at, j.state INTO q, p, s, now_state;
    END IF;
    IF q IS NULL THEN
        RETURN false;
    END IF;
    -- A child of a dead, cancelled or deleted parent is cancelled again at once, with the
    -- reason; then the lane's step (the job's turn, if it is its lane's head).
    PERFORM skiplock.internal_settle_dependants(ARRAY(
        SELECT d.parent_id FROM skiplock.job_dependencies d
        WHERE d.job_id = internal_retry_job_once.job_id),
        ARRAY(SELECT lane WHERE lane IS NOT NULL));
    IF now_state = 'queued' THEN
        PERFORM skiplock.internal_announce(ARRAY[ROW(q, p, s)::skiplock.runnable_key]);
    END IF;
    RETURN true;
END;
$$;

COMMENT ON FUNCTION skiplock.internal_retry_job_once(bigint) IS
    'One attempt of skiplock.retry_job, without its retry on a deadlock or a moved row; call retry_job instead.';

-- An operator's call on one job (action 'cancel': internal_cancel_job_once, 'retry':
-- internal_retry_job_once), run again when it meets a moved row or a deadlock: the one loop
-- of cancel_job and retry_job.
--
-- Each locks its job, then (through advance_lanes and settle_dependants) the next job of its
-- lane and its waiting children; a retry takes its lane's lock first. A transaction that
-- already holds one of those and then waits for the job (a complete or fail of it, in one
-- transaction with its lane's step) closes a cycle, and Postgres aborts one side after
-- deadlock_timeout. When that side is the call, it rolls back only its own work (each
-- attempt runs in a subtransaction, so its row locks go too), which lets the other side
-- finish, and tries again. This works inside the caller's transaction as well, which a
-- client-side retry cannot.
--
-- A retry at once would not do: a row whose locker has just rolled back is free to
-- whoever asks first, and the other side, woken, still has to be scheduled to take it,
-- while the retry is already running in this backend; it would take the job's row again,
-- wait again for the row the other side holds and close the same cycle (seen as an
-- intermittent failure of control::a_cancel_chosen_as_deadlock_victim_retries_and_succeeds).
-- So each retry after a deadlock first sleeps a short, growing, jittered while (10 to 20 ms,
-- then twice that each time, below a second in all) so the other side takes its lock and
-- finishes; after six attempts the error reaches the caller. A row moved to the other
-- partition under the call (40001) is read again at once (see
-- skiplock.internal_may_retry_moved).
CREATE OR REPLACE FUNCTION skiplock.internal_run_job_action(action text, job_id bigint)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    moved int := 0;
    deadlocks int := 0;
BEGIN
    LOOP
        BEGIN
            IF action = 'cancel' THEN
                RETURN skiplock.internal_cancel_job_once(job_id);
            END IF;
            RETURN skiplock.internal_retry_job_once(job_id);
        EXCEPTION
            WHEN serialization_failure THEN
                moved := moved + 1;
                IF NOT skiplock.internal_may_retry_moved(moved) THEN
                    RAISE;
                END IF;
                CONTINUE;
            WHEN deadlock_detected THEN
                deadlocks := deadlocks + 1;
                IF deadlocks >= 6 THEN
                    RAISE;
                END IF;
        END;
        -- Outside the subtransaction: its locks are gone while this sleeps.
        PERFORM pg_sleep(0.01 * power(2, deadlocks - 1) * (1 + random()));
    END LOOP;
END;
$$;

-- Cancel a job that has not finished (internal_cancel_job_once), surviving being chosen as
-- a deadlock victim (internal_run_job_action).
CREATE OR REPLACE FUNCTION skiplock.cancel_job(job_id bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    RETURN skiplock.internal_run_job_action('cancel', job_id);
END;
$$;
COMMENT ON FUNCTION skiplock.cancel_job(bigint) IS
    'Cancels a job that has not finished: `cancelled` at once, or, if it runs, its claim voided and its worker told to stop it (skiplock_cancel); its waiting dependants are cancelled and its lane moves on. A deadlock with another transaction is retried after a short jittered wait, up to six attempts in all. Returns false if the job had finished or does not exist. Example: SELECT skiplock.cancel_job(42);';

-- Put a finished job back in line (internal_retry_job_once), surviving being chosen as a
-- deadlock victim (internal_run_job_action).
CREATE OR REPLACE FUNCTION skiplock.retry_job(job_id bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    RETURN skiplock.internal_run_job_action('retry', job_id);
END;
$$;
COMMENT ON FUNCTION skiplock.retry_job(bigint) IS
    'Puts a finished job (dead, cancelled or succeeded) back in line, due now, with an attempt to spare (a queued job is made due now): `queued`, or `waiting` behind an unfinished job of its lane or a parent that has not succeeded. A job whose `unique_key` another pending job holds is superseded by it (it ends `cancelled` naming that job; under the policy `merge` its payloads are merged in first). Returns true if it was put back in line, false for a running or waiting job or no such job. Example: SELECT skiplock.retry_job(42);';

-- Put every dead job (of one queue, or of all when queue_name is NULL) back in line, as
-- skiplock.retry_job does for one. Returns the ids retried. A dead job whose unique_key is
-- taken is superseded by retry_job, not refused; the exception handler is for anything
-- else a single row may raise: that job is left dead with a warning, so one row never
-- fails the whole call. Example: SELECT count(*) FROM skiplock.retry_dead_jobs('mail');
CREATE OR REPLACE FUNCTION skiplock.retry_dead_jobs(queue_name text DEFAULT NULL) RETURNS SETOF bigint
LANGUAGE plpgsql
SET jit = off
AS $$
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
COMMENT ON FUNCTION skiplock.retry_dead_jobs(text) IS
    '`retry_job` for every dead job of a queue (NULL: of every queue); returns the ids retried. A dead job whose `unique_key` another pending job holds is superseded by it and counts as retried. A job that cannot be retried at all (a trigger of yours refuses it) is left dead with a warning, and the others go on. Example: SELECT count(*) FROM skiplock.retry_dead_jobs(''mail'');';

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

-- A limit of running jobs (max_running, key_max_running) as set_queue_limits takes it:
-- NULL or at least 1, else an error naming the column and what to write.
CREATE OR REPLACE FUNCTION skiplock.internal_check_running_limit(name text, value int)
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF value < 1 THEN
        RAISE EXCEPTION '% is %, it must be at least 1', name, value
            USING ERRCODE = 'check_violation',
                  HINT = 'NULL removes the limit; to stop claiming, pause the queue (skiplock.pause_queue)';
    END IF;
END;
$$;

-- A rate limit (rate_limit per rate_period, key_rate_limit per key_rate_period) as
-- set_queue_limits takes it: both or neither, 1 to `most` starts, a period longer than
-- zero; else an error naming the column and what to write (`example`: starts to show).
CREATE OR REPLACE FUNCTION skiplock.internal_check_rate_limit(limit_name text, period_name text,
                                                              starts int, period interval,
                                                              most int, example int)
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF starts < 1 OR starts > most THEN
        RAISE EXCEPTION '% is %, it must be between 1 and %', limit_name, starts, most
            USING ERRCODE = 'check_violation',
                  HINT = format('for more starts per period, use a shorter period: %s a minute is %s a second',
                                most, ceil(most / 60.0));
    END IF;
    IF (starts IS NULL) <> (period IS NULL) THEN
        RAISE EXCEPTION '% and % go together: both or neither', limit_name, period_name
            USING ERRCODE = 'check_violation',
                  HINT = format('e.g. %s => %s, %s => ''1 second''', limit_name, example, period_name);
    END IF;
    IF period <= interval '0' THEN
        RAISE EXCEPTION '% is %, it must be longer than zero', period_name, period
            USING ERRCODE = 'check_violation';
    END IF;
END;
$$;

-- Sets a queue's global limits, each NULL for none: at most max_running jobs running at
-- once, and at most rate_limit starts in any window of rate_period; per concurrency key, at
-- most key_max_running running at once and key_rate_limit starts per key_rate_period, and
-- fair queueing by key with key_claimable. The same as writing the columns of its
-- skiplock.queues row, which plain SQL may do; this checks the values with errors that say
-- what to pass.
CREATE OR REPLACE FUNCTION skiplock.set_queue_limits(queue_name text, max_running int,
                                                     rate_limit int DEFAULT NULL,
                                                     rate_period interval DEFAULT NULL,
                                                     key_max_running int DEFAULT NULL,
                                                     key_rate_limit int DEFAULT NULL,
                                                     key_rate_period interval DEFAULT NULL,
                                                     key_claimable int DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM skiplock.internal_check_queue_name(queue_name);
    PERFORM skiplock.internal_check_running_limit('max_running', max_running);
    PERFORM skiplock.internal_check_running_limit('key_max_running', key_max_running);
    PERFORM skiplock.internal_check_running_limit('key_claimable', key_claimable);
    PERFORM skiplock.internal_check_rate_limit('rate_limit', 'rate_period', rate_limit,
                                               rate_period, 100000, 100);
    PERFORM skiplock.internal_check_rate_limit('key_rate_limit', 'key_rate_period',
                                               key_rate_limit, key_rate_period, 100000, 10);
    INSERT INTO skiplock.queues AS q (name, max_running, rate_limit, rate_period,
                                      key_max_running, key_rate_limit, key_rate_period,
                                      key_claimable)
    VALUES (queue_name, set_queue_limits.max_running, set_queue_limits.rate_limit,
            set_queue_limits.rate_period, set_queue_limits.key_max_running,
            set_queue_limits.key_rate_limit, set_queue_limits.key_rate_period,
            set_queue_limits.key_claimable)
    ON CONFLICT (name) DO UPDATE
    SET max_running = excluded.max_running, rate_limit = excluded.rate_limit,
        rate_period = excluded.rate_period, key_max_running = excluded.key_max_running,
        key_rate_limit = excluded.key_rate_limit, key_rate_period = excluded.key_rate_period,
        key_claimable = excluded.key_claimable, updated_at = now();
END;
$$;
COMMENT ON FUNCTION skiplock.set_queue_limits(text, int, int, interval, int, int, interval, int) IS
    'Sets a queue''s global limits across every worker (NULL: none): max_running jobs at once, rate_limit starts per rate_period, per concurrency_key key_max_running jobs at once and key_rate_limit starts per key_rate_period, and fair queueing by key: at most key_claimable due jobs of one key queued at once, the keys taking turns. Example: SELECT skiplock.set_queue_limits(''exports'', max_running => 5); SELECT skiplock.set_queue_limits(''mail'', NULL, 100, ''1 second''); SELECT skiplock.set_queue_limits(''reports'', NULL, key_max_running => 2, key_rate_limit => 10, key_rate_period => ''1 minute''); SELECT skiplock.set_queue_limits(''tenants'', NULL, key_claimable => 32);';

CREATE OR REPLACE FUNCTION skiplock.pause_queue(queue_name text) RETURNS void
LANGUAGE sql AS $$
    SELECT skiplock.internal_set_queue_paused(queue_name, true);
$$;
COMMENT ON FUNCTION skiplock.pause_queue(text) IS
    'Stops every worker from claiming from the queue (the row in `skiplock.queues`, made if missing); running jobs finish. Example: SELECT skiplock.pause_queue(''mail'');';

-- Why a job that has not finished is not running now, in words (NULL for a running or
-- finished job, or none by that id): what `skiplock show` prints as `why`. One job's
-- lookups: its lane's head, its parents, its queue's row and (under a limit) the queue's
-- running jobs, at most max_running of them.
CREATE OR REPLACE FUNCTION skiplock.why_not_running(job_id bigint) RETURNS text
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    job skiplock.jobs;
    queue_row skiplock.queues;
    ahead bigint;
    parents text;
    running bigint;
    rate_next timestamptz;
    key_rate_next timestamptz;
BEGIN
    SELECT * INTO job FROM skiplock.jobs_live j WHERE j.id = job_id;
    IF job.id IS NULL OR job.state = 'running' THEN
        RETURN NULL;
    END IF;
    SELECT * INTO queue_row FROM skiplock.queues q WHERE q.name = job.queue;
    IF job.concurrency_key IS NOT NULL AND queue_row.key_rate_limit IS NOT NULL THEN
        -- When the key's rate window has room again, if it is full now.
        key_rate_next := skiplock.internal_rate_full_until(
            job.queue, job.concurrency_key, queue_row.key_rate_limit,
            queue_row.key_rate_period, now());
    END IF;
    IF job.state = 'waiting' THEN
        IF job.ordering_key IS NOT NULL THEN
            SELECT min(h.id) INTO ahead FROM skiplock.jobs_live h
            WHERE h.ordering_key = job.ordering_key AND h.id < job.id;
            IF ahead IS NOT NULL THEN
                RETURN format('waits behind job %s of its lane %L: a lane runs its jobs one at a time, in order',
                              ahead, job.ordering_key);
            END IF;
            -- The lane's turn held by a job behind it (one retried by hand while this waited).
            SELECT h.id INTO ahead FROM skiplock.jobs_live h
            WHERE h.ordering_key = job.ordering_key AND h.state IN ('queued', 'running');
            IF ahead IS NOT NULL THEN
                RETURN format('waits for the turn of its lane %L, which job %s has until it ends: a lane runs its jobs one at a time',
                              job.ordering_key, ahead);
            END IF;
        END IF;
        SELECT string_agg(d.parent_id::text, ', ' ORDER BY d.parent_id) INTO parents
        FROM skiplock.job_dependencies d
        CROSS JOIN LATERAL (SELECT skiplock.internal_job_state(d.parent_id) AS state OFFSET 0) p
        WHERE d.job_id = job.id AND p.state <> 'succeeded' AND d.parent_state IS NULL;
        IF parents IS NOT NULL THEN
            RETURN format('waits for its parent jobs to succeed: %s', parents);
        END IF;
        IF job.held_for = 'fair' AND queue_row.key_claimable IS NOT NULL THEN
            RETURN format('waits its turn among the jobs of key %L: the queue''s key_claimable lets %s of a key''s jobs be queued at once (%s are now); it is queued behind the others when one of them is claimed',
                          job.concurrency_key, queue_row.key_claimable,
                          skiplock.internal_key_queued(job.queue, job.concurrency_key,
                                                       queue_row.key_claimable));
        END IF;
        IF job.held_for IS NOT NULL THEN
            IF queue_row.key_max_running IS NOT NULL THEN
                running := skiplock.internal_key_running(job.queue, job.concurrency_key,
                                                         queue_row.key_max_running);
            END IF;
            IF key_rate_next IS NOT NULL
               AND (queue_row.key_max_running IS NULL OR running < queue_row.key_max_running) THEN
                RETURN format('held back by the queue''s key_rate_limit of %s per %s for key %L; it is queued when the key''s window has room, at %s',
                              queue_row.key_rate_limit, queue_row.key_rate_period,
                              job.concurrency_key, key_rate_next);
            END IF;
            IF queue_row.key_max_running IS NOT NULL THEN
                RETURN format('held back by the queue''s key_max_running of %s for key %L (%s of its jobs run now); it is queued when a slot of the key frees',
                              queue_row.key_max_running, job.concurrency_key, running);
            END IF;
            IF queue_row.key_rate_limit IS NOT NULL THEN
                RETURN format('held back by the queue''s key_rate_limit of %s per %s for key %L, whose window has room again; the next claim of queue %L queues it',
                              queue_row.key_rate_limit, queue_row.key_rate_period,
                              job.concurrency_key, job.queue);
            END IF;
        END IF;
        RETURN 'waiting; the next pass of a worker''s sweep (or skiplock.maintain) queues it';
    END IF;
    IF job.scheduled_at > now() THEN
        RETURN format('scheduled: runnable from %s', job.scheduled_at);
    END IF;
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
    IF queue_row.key_max_running IS NOT NULL AND job.concurrency_key IS NOT NULL THEN
        running := skiplock.internal_key_running(job.queue, job.concurrency_key,
                                                 queue_row.key_max_running);
        IF running >= queue_row.key_max_running THEN
            RETURN format('held back by the queue''s key_max_running: %s of key %L''s jobs run, its limit',
                          running, job.concurrency_key);
        END IF;
    END IF;
    IF key_rate_next IS NOT NULL THEN
        RETURN format('held back by the queue''s key_rate_limit: %s starts of key %L in %s; the next may start at %s',
                      queue_row.key_rate_limit, job.concurrency_key, queue_row.key_rate_period,
                      key_rate_next);
    END IF;
    IF queue_row.rate_limit IS NOT NULL THEN
        rate_next := skiplock.internal_rate_full_until(job.queue, '', queue_row.rate_limit,
                                                       queue_row.rate_period, now());
        IF rate_next IS NOT NULL THEN
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
COMMENT ON FUNCTION skiplock.resume_queue(text) IS
    'Lets workers claim from the queue again, and wakes them. Example: SELECT skiplock.resume_queue(''mail'');';

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

CREATE OR REPLACE TRIGGER queues_after_write
    AFTER INSERT OR UPDATE ON skiplock.queues
    FOR EACH ROW
    WHEN (NOT NEW.paused)
    EXECUTE FUNCTION skiplock.internal_queues_after_write();

-- A write of the limits or the pause of a queue with key_max_running (or its row deleted)
-- waits for the handoffs of its keys' freed slots in flight (internal_free_slots, which
-- tries this lock shared before it reads the row): each read the row as it was, so no
-- handoff made by the old limits commits after the new ones.
CREATE OR REPLACE FUNCTION skiplock.internal_queues_after_handoff_rules_change()
RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(skiplock.internal_handoff_lock_id(OLD.name));
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER queues_after_handoff_rules_change
    AFTER UPDATE OR DELETE ON skiplock.queues
    FOR EACH ROW
    WHEN (OLD.key_max_running IS NOT NULL)
    EXECUTE FUNCTION skiplock.internal_queues_after_handoff_rules_change();

-- A queue's limits changed where a max_running is or was, or a row with one written: the
-- claims in flight each counted by the limits they read, a share of the old max_running
-- for those holding claim shares (06_global_limits.sql, "Claim shares"), the old limits
-- for those holding the turn. The change waits for them all (the queue's turn and every
-- share), so a claim after it counts what they took, and a turn never meets a claim that
-- shares by limits it no longer has. The claims of the writing transaction itself, which
-- its own locks do not hold back, end the share they took: its next claim of the queue
-- counts again (it once took what was left of a share of the old max_running: 62 ran of a
-- max_running of 32 it had set). A row deleted needs no wait: no limit is left to hold.
CREATE OR REPLACE FUNCTION skiplock.internal_queues_after_max_running_change() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    shares jsonb := nullif(current_setting('skiplock.claim_shares', true), '')::jsonb;
BEGIN
    PERFORM pg_advisory_xact_lock(skiplock.internal_queue_limit_lock_id(NEW.name));
    PERFORM skiplock.internal_take_every_claim_share(NEW.name);
    IF shares ? NEW.name THEN
        PERFORM set_config('skiplock.claim_shares', (shares - NEW.name)::text, true);
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER queues_after_max_running_change
    AFTER UPDATE ON skiplock.queues
    FOR EACH ROW
    WHEN ((OLD.max_running IS NOT NULL OR NEW.max_running IS NOT NULL)
          AND (NEW.max_running IS DISTINCT FROM OLD.max_running
               OR NEW.rate_limit IS DISTINCT FROM OLD.rate_limit
               OR NEW.key_max_running IS DISTINCT FROM OLD.key_max_running
               OR NEW.key_rate_limit IS DISTINCT FROM OLD.key_rate_limit
               OR NEW.name IS DISTINCT FROM OLD.name))
    EXECUTE FUNCTION skiplock.internal_queues_after_max_running_change();

CREATE OR REPLACE TRIGGER queues_after_max_running_insert
    AFTER INSERT ON skiplock.queues
    FOR EACH ROW
    WHEN (NEW.max_running IS NOT NULL)
    EXECUTE FUNCTION skiplock.internal_queues_after_max_running_change();

-- A queue given limits where it had none (max_running, rate_limit, key_max_running or
-- key_rate_limit: a new row with one, a row without any given one, a row with one renamed
-- onto the queue): the claims in flight took jobs by no limit and hold no turn nor share,
-- only the queue's claims lock (internal_queue_claims_lock_id), shared; the write waits
-- for them by taking it, so that a claim after it counts their jobs (without it, 15 ran of
-- a max_running of 5 written over claims in flight), and the claims that read no limits
-- before it committed read the row again once it has. After the row is written, as every
-- other lock of a write of skiplock.queues: a plain UPDATE and set_queue_limits take the
-- row and then this lock, in that order. A change between limits needs none of it: every
-- claim of a limited queue holds its turn or a share, which the other triggers wait for.
CREATE OR REPLACE FUNCTION skiplock.internal_queues_after_limits_set() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(skiplock.internal_queue_claims_lock_id(NEW.name));
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER queues_after_limits_set_insert
    AFTER INSERT ON skiplock.queues
    FOR EACH ROW
    WHEN (NEW.max_running IS NOT NULL OR NEW.rate_limit IS NOT NULL
          OR NEW.key_max_running IS NOT NULL OR NEW.key_rate_limit IS NOT NULL)
    EXECUTE FUNCTION skiplock.internal_queues_after_limits_set();

CREATE OR REPLACE TRIGGER queues_after_limits_set_update
    AFTER UPDATE ON skiplock.queues
    FOR EACH ROW
    WHEN ((NEW.max_running IS NOT NULL OR NEW.rate_limit IS NOT NULL
           OR NEW.key_max_running IS NOT NULL OR NEW.key_rate_limit IS NOT NULL)
          AND ((OLD.max_running IS NULL AND OLD.rate_limit IS NULL
                AND OLD.key_max_running IS NULL AND OLD.key_rate_limit IS NULL)
               OR NEW.name IS DISTINCT FROM OLD.name))
    EXECUTE FUNCTION skiplock.internal_queues_after_limits_set();

-- Where a fair queue's keys' held jobs start (skiplock.key_held_from) holds only while the
-- queue's one per-key limit is key_claimable, from its releases on: any change of its
-- per-key limits, either way, drops the rows (the next releases record them again), and
-- so does deleting its row. Holds for key_max_running or key_rate_limit leave no marks, so
-- rows kept from before such a limit came and went could pass over their jobs. Under the
-- queue's lock, which a release holds (shared) while the row it made is not committed: the
-- DELETE sees no such row, and would leave it.
CREATE OR REPLACE FUNCTION skiplock.internal_queues_after_fairness_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(skiplock.internal_queue_limit_lock_id(OLD.name));
    DELETE FROM skiplock.key_held_from f WHERE f.queue = OLD.name;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER queues_after_fairness_change
    AFTER UPDATE ON skiplock.queues
    FOR EACH ROW
    WHEN (NEW.key_claimable IS DISTINCT FROM OLD.key_claimable
          OR NEW.key_max_running IS DISTINCT FROM OLD.key_max_running
          OR NEW.key_rate_limit IS DISTINCT FROM OLD.key_rate_limit)
    EXECUTE FUNCTION skiplock.internal_queues_after_fairness_change();

CREATE OR REPLACE TRIGGER queues_after_fairness_delete
    AFTER DELETE ON skiplock.queues
    FOR EACH ROW
    WHEN (OLD.key_claimable IS NOT NULL)
    EXECUTE FUNCTION skiplock.internal_queues_after_fairness_change();

-- A queue's per-key limit (key_max_running, key_rate_limit or key_rate_period) or its
-- key_claimable changed or removed, or its row deleted: the jobs they held back whose keys
-- have room now (all of them, without any) are let go, announced, in the statement that
-- changed it.
-- The rate windows (skiplock.rate_windows) go with the row, and each with its limit (the
-- queue's with rate_limit, the keys' with key_rate_limit);
-- a window kept counts the starts it kept under its limit and period as they are now (so
-- a period changed, the queue's rate_period too, moves when the window is forgotten), and
-- what it held back is looked at again at the next claim. Costs the jobs held back and the
-- windows, once.
CREATE OR REPLACE FUNCTION skiplock.internal_queues_after_key_limit() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    keys_changed boolean := TG_OP = 'DELETE' OR NEW.name <> OLD.name
        OR NEW.key_max_running IS DISTINCT FROM OLD.key_max_running
        OR NEW.key_claimable IS DISTINCT FROM OLD.key_claimable
        OR NEW.key_rate_limit IS DISTINCT FROM OLD.key_rate_limit
        OR NEW.key_rate_period IS DISTINCT FROM OLD.key_rate_period;
BEGIN
    -- The queue's lock first, as a claim takes it before it writes the windows.
    PERFORM pg_advisory_xact_lock(skiplock.internal_queue_limit_lock_id(OLD.name));
    IF TG_OP = 'DELETE' OR NEW.name <> OLD.name THEN
        -- The row's limits are gone from OLD.name's jobs: what they kept goes (a renamed
        -- row's limits hold for the jobs of its new name, from new windows).
        DELETE FROM skiplock.rate_windows w WHERE w.queue = OLD.name;
        DELETE FROM skiplock.key_slots_freed f WHERE f.queue = OLD.name;
    ELSE
        IF NEW.key_max_running IS NULL AND NEW.key_claimable IS NULL THEN
            DELETE FROM skiplock.key_slots_freed f WHERE f.queue = NEW.name;
        END IF;
        IF NEW.key_rate_limit IS NULL THEN
            DELETE FROM skiplock.rate_windows w
            WHERE w.queue = NEW.name AND w.concurrency_key <> '';
        END IF;
        IF NEW.rate_limit IS NULL THEN
            -- As the keys': a rate_limit set again later counts from its own starts (a
            -- window kept would expire by the period it had, and count against a longer
            -- new one only until then).
            DELETE FROM skiplock.rate_windows w
            WHERE w.queue = NEW.name AND w.concurrency_key = '';
        END IF;
        UPDATE skiplock.rate_windows w
        SET expires_at = coalesce(
                (SELECT s.started_at FROM skiplock.rate_window_starts s
                 WHERE s.queue = w.queue AND s.concurrency_key = w.concurrency_key
                   AND s.slot = (w.next_slot + w.size - 1) % w.size)
                + CASE WHEN w.concurrency_key = '' THEN NEW.rate_period
                       ELSE NEW.key_rate_period END,
                w.expires_at),
            -- A key's limit changed: what its window held back goes when the window has
            -- room by the new limit, now (let go below) or when it refills (the queue's
            -- rate_period alone changes no key's room). Reset to now, a window still full
            -- had its mark cleared by the next claim with nothing let go, and its jobs
            -- waited for the sweep.
            held_until = CASE WHEN keys_changed AND w.held_until IS NOT NULL
                              THEN coalesce(skiplock.internal_rate_full_until(
                                                w.queue, w.concurrency_key, NEW.key_rate_limit,
                                                NEW.key_rate_period, now())
                                            + interval '1 microsecond', now())
                              ELSE w.held_until END
        WHERE w.queue = NEW.name;
        -- The workers are told when the first of them refills.
        PERFORM skiplock.internal_notify_refill(
            NEW.name, (SELECT min(w.held_until) FROM skiplock.rate_windows w
                       WHERE w.queue = NEW.name AND w.held_until > now()));
    END IF;
    IF keys_changed THEN
        PERFORM skiplock.internal_release_held(OLD.name, NULL);
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER queues_after_key_limit_change
    AFTER UPDATE ON skiplock.queues
    FOR EACH ROW
    WHEN ((OLD.key_max_running IS NOT NULL
           AND NEW.key_max_running IS DISTINCT FROM OLD.key_max_running)
          OR (OLD.key_claimable IS NOT NULL
              AND NEW.key_claimable IS DISTINCT FROM OLD.key_claimable)
          OR (OLD.key_rate_limit IS NOT NULL
              AND (NEW.key_rate_limit IS DISTINCT FROM OLD.key_rate_limit
                   OR NEW.key_rate_period IS DISTINCT FROM OLD.key_rate_period))
          OR (OLD.rate_limit IS NOT NULL
              AND (NEW.rate_limit IS NULL OR NEW.rate_period IS DISTINCT FROM OLD.rate_period))
          OR (NEW.name <> OLD.name
              AND (OLD.rate_limit IS NOT NULL OR OLD.key_max_running IS NOT NULL
                   OR OLD.key_rate_limit IS NOT NULL OR OLD.key_claimable IS NOT NULL)))
    EXECUTE FUNCTION skiplock.internal_queues_after_key_limit();

CREATE OR REPLACE TRIGGER queues_after_key_limit_delete
    AFTER DELETE ON skiplock.queues
    FOR EACH ROW
    WHEN (OLD.key_max_running IS NOT NULL OR OLD.key_rate_limit IS NOT NULL
          OR OLD.key_claimable IS NOT NULL OR OLD.rate_limit IS NOT NULL)
    EXECUTE FUNCTION skiplock.internal_queues_after_key_limit();
