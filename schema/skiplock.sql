--
-- PostgreSQL database dump
--

--
-- Name: skiplock; Type: SCHEMA; Schema: -; Owner: -
--

CREATE SCHEMA skiplock;

--
-- Name: claimed_job; Type: TYPE; Schema: skiplock; Owner: -
--

CREATE TYPE skiplock.claimed_job AS (
	id bigint,
	queue text,
	kind text,
	args jsonb,
	attempt integer,
	max_attempts integer,
	claim_token uuid,
	traceparent text,
	tracestate text
);

--
-- Name: internal_reaped; Type: TYPE; Schema: skiplock; Owner: -
--

CREATE TYPE skiplock.internal_reaped AS (
	id bigint,
	state text,
	claimed_by text,
	ordering_key text
);

--
-- Name: job_state; Type: TYPE; Schema: skiplock; Owner: -
--

CREATE TYPE skiplock.job_state AS ENUM (
    'waiting',
    'queued',
    'running',
    'succeeded',
    'dead',
    'cancelled'
);

--
-- Name: runnable_key; Type: TYPE; Schema: skiplock; Owner: -
--

CREATE TYPE skiplock.runnable_key AS (
	queue text,
	priority smallint,
	scheduled_at timestamp with time zone
);

--
-- Name: args_max_bytes(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.args_max_bytes() RETURNS bigint
    LANGUAGE sql STABLE
    AS $$
    SELECT coalesce(nullif(current_setting('skiplock.args_max_bytes', true), '')::bigint, 1048576);
$$;

--
-- Name: FUNCTION args_max_bytes(); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.args_max_bytes() IS 'The largest `args` accepted on every path, in bytes of `args::text`: 1 MiB unless the setting `skiplock.args_max_bytes` says otherwise (ALTER DATABASE … SET skiplock.args_max_bytes = 4194304).';

--
-- Name: backoff(integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.backoff(attempt integer) RETURNS interval
    LANGUAGE sql
    AS $$
    SELECT make_interval(secs => least(power(2, least(attempt, 30)), 3600) * (0.75 + random() * 0.5));
$$;

--
-- Name: FUNCTION backoff(attempt integer); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.backoff(attempt integer) IS 'The default delay before a failed attempt runs again: min(2^attempt, 3600) seconds, times a random factor in [0.75, 1.25). What `fail` and the reaper use when no delay is given. Example: SELECT skiplock.backoff(3);';

--
-- Name: cancel_job(bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.cancel_job(job_id bigint) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
BEGIN
    RETURN skiplock.internal_run_job_action('cancel', job_id);
END;
$$;

--
-- Name: FUNCTION cancel_job(job_id bigint); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.cancel_job(job_id bigint) IS 'Cancels a job that has not finished: `cancelled` at once, or, if it runs, its claim voided and its worker told to stop it (skiplock_cancel); its waiting dependants are cancelled and its lane moves on. A deadlock with another transaction is retried after a short jittered wait, up to six attempts in all. Returns false if the job had finished or does not exist. Example: SELECT skiplock.cancel_job(42);';

--
-- Name: claim(text, integer, text, text[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.claim(queue text, max_jobs integer, worker text, kinds text[] DEFAULT NULL::text[]) RETURNS SETOF skiplock.claimed_job
    LANGUAGE plpgsql
    AS $$
DECLARE
    attempts int := 0;
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
    LOOP
        -- In a subtransaction: a queued row moved to jobs_done (cancelled) under the claim
        -- fails it having claimed nothing (40001, see internal_claim_batch), and the claim
        -- runs again with a new snapshot.
        BEGIN
            RETURN QUERY
            SELECT c.id, c.queue, c.kind, c.args, c.attempt, c.max_attempts, c.claim_token,
                   c.traceparent, c.tracestate
            FROM skiplock.internal_claim_batch(claim.queue, kinds, max_jobs, worker) c;
            RETURN;
        EXCEPTION WHEN serialization_failure THEN
            attempts := attempts + 1;
            IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                RAISE;
            END IF;
        END;
    END LOOP;
END;
$$;

--
-- Name: FUNCTION claim(queue text, max_jobs integer, worker text, kinds text[]); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.claim(queue text, max_jobs integer, worker text, kinds text[]) IS 'Takes up to `max_jobs` runnable jobs of one queue, in claim order (`priority`, lower first, then `scheduled_at`, then `id`), with `FOR UPDATE SKIP LOCKED`: any number of workers claim at once and never take the same job. Returns `id, queue, kind, args, attempt, max_attempts, claim_token, traceparent, tracestate` per job (the last two: the W3C trace context the job was enqueued with, NULL without one; a worker continues that trace in its span). `kinds` NULL means every kind; pass the kinds you have handlers for. Jobs of a paused queue, not yet due, waiting for parents or behind an unfinished job of their lane are not taken, nor more than the queue''s global limits leave (`max_running`, `rate_limit`, and per concurrency key `key_max_running` and `key_rate_limit`; such a claim must run in READ COMMITTED, else SQLSTATE 25000). Each job comes back `running` with `attempt` counted and a fresh `claim_token`. `max_jobs` 0 returns nothing; NULL, negative or over 10,000, or a NULL or empty `queue` or `worker`, is an error (SQLSTATE 22023).';

--
-- Name: complete(bigint, uuid, jsonb); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.complete(id bigint, token uuid, output jsonb DEFAULT NULL::jsonb) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
BEGIN
    RETURN (SELECT s.state IS NOT NULL
            FROM skiplock.internal_save_outcomes_many('complete', 'complete', ARRAY[complete.id],
                                                      ARRAY[complete.token],
                                                      ARRAY[complete.output], NULL, NULL) s);
END;
$$;

--
-- Name: FUNCTION complete(id bigint, token uuid, output jsonb); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.complete(id bigint, token uuid, output jsonb) IS 'Marks the job `succeeded` (keeping `output`). In the same transaction the next job of its lane becomes queued, waiting children whose parents have all succeeded become queued, and listening workers are notified, so they are claimable at once, with no skiplock process running. `false`: the claim was not held, nothing changed. A row that refuses the change (a trigger of yours) goes `dead` instead, with `the outcome of this attempt could not be saved: …` in `last_error`, as in `complete_many` (`true`: the claim was held).';

--
-- Name: complete_many(bigint[], uuid[], jsonb[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.complete_many(ids bigint[], tokens uuid[], outputs jsonb[] DEFAULT NULL::jsonb[]) RETURNS TABLE(id bigint, state skiplock.job_state)
    LANGUAGE sql
    AS $$
    SELECT * FROM skiplock.internal_save_outcomes_many('complete_many', 'complete', ids, tokens,
                                                       outputs, NULL, NULL);
$$;

--
-- Name: FUNCTION complete_many(ids bigint[], tokens uuid[], outputs jsonb[]); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.complete_many(ids bigint[], tokens uuid[], outputs jsonb[]) IS '`complete` for a batch, in one call and one transaction, as the Rust worker saves its completions: each held job `succeeded` (with its element of `outputs`, when given and not NULL), the lanes and dependants of all of them moved on and listening workers told. Returns `id, state` per claim given, in the order given. `state` is `''succeeded''`; NULL when the claim was not held (a stale, wrong or NULL token: nothing changed for that job, the others go through); `''dead''` when the row refused the change (a trigger of yours, say): the batch is then saved one claim at a time and that job alone goes dead with `the outcome of this attempt could not be saved: …` in `last_error`, its lane moving on; `''running''` in the last resort, when even that is refused (a warning names it, and `maintain` takes it back after `stale_after`). Rows are locked in id order, whatever the order given. Arrays of different lengths, or an id given twice, are an error (SQLSTATE 22023); empty arrays return nothing.';

--
-- Name: discard(bigint, uuid, text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.discard(id bigint, token uuid, error text) RETURNS skiplock.job_state
    LANGUAGE plpgsql
    AS $$
BEGIN
    RETURN (SELECT s.state
            FROM skiplock.internal_save_outcomes_many('discard', 'dead', ARRAY[discard.id],
                                                      ARRAY[discard.token], NULL,
                                                      ARRAY[discard.error], ARRAY[NULL::interval]) s);
END;
$$;

--
-- Name: FUNCTION discard(id bigint, token uuid, error text); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.discard(id bigint, token uuid, error text) IS 'As `fail`, but `''dead''` now, whatever attempts are left: for errors no retry will mend (bad arguments).';

--
-- Name: enqueue(text, jsonb, text, integer, timestamp with time zone, integer, text, text, text, bigint[], text, text, text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.enqueue(kind text, args jsonb DEFAULT '{}'::jsonb, queue text DEFAULT 'default'::text, priority integer DEFAULT 0, scheduled_at timestamp with time zone DEFAULT now(), max_attempts integer DEFAULT 25, ordering_key text DEFAULT NULL::text, unique_key text DEFAULT NULL::text, on_conflict text DEFAULT 'skip'::text, depends_on bigint[] DEFAULT '{}'::bigint[], concurrency_key text DEFAULT NULL::text, traceparent text DEFAULT NULL::text, tracestate text DEFAULT NULL::text) RETURNS bigint
    LANGUAGE sql
    AS $$
    SELECT e.id FROM skiplock.enqueue_job(kind, args, queue, priority, scheduled_at,
                                          max_attempts, ordering_key, unique_key,
                                          on_conflict, depends_on, concurrency_key,
                                          traceparent, tracestate) e;
$$;

--
-- Name: FUNCTION enqueue(kind text, args jsonb, queue text, priority integer, scheduled_at timestamp with time zone, max_attempts integer, ordering_key text, unique_key text, on_conflict text, depends_on bigint[], concurrency_key text, traceparent text, tracestate text); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.enqueue(kind text, args jsonb, queue text, priority integer, scheduled_at timestamp with time zone, max_attempts integer, ordering_key text, unique_key text, on_conflict text, depends_on bigint[], concurrency_key text, traceparent text, tracestate text) IS 'Enqueues a job from any language and returns its id (or, for a unique_key already pending, that job''s id). traceparent and tracestate (W3C Trace Context, as an incoming request carried them) make each attempt''s span continue that trace. Example: SELECT skiplock.enqueue(''send_email'', ''{"to": "a@example.com"}'', priority => -1);';

--
-- Name: enqueue_job(text, jsonb, text, integer, timestamp with time zone, integer, text, text, text, bigint[], text, text, text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.enqueue_job(kind text, args jsonb DEFAULT '{}'::jsonb, queue text DEFAULT 'default'::text, priority integer DEFAULT 0, scheduled_at timestamp with time zone DEFAULT now(), max_attempts integer DEFAULT 25, ordering_key text DEFAULT NULL::text, unique_key text DEFAULT NULL::text, on_conflict text DEFAULT 'skip'::text, depends_on bigint[] DEFAULT '{}'::bigint[], concurrency_key text DEFAULT NULL::text, traceparent text DEFAULT NULL::text, tracestate text DEFAULT NULL::text) RETURNS TABLE(id bigint, outcome text)
    LANGUAGE plpgsql
    SET jit TO 'off'
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

--
-- Name: FUNCTION enqueue_job(kind text, args jsonb, queue text, priority integer, scheduled_at timestamp with time zone, max_attempts integer, ordering_key text, unique_key text, on_conflict text, depends_on bigint[], concurrency_key text, traceparent text, tracestate text); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.enqueue_job(kind text, args jsonb, queue text, priority integer, scheduled_at timestamp with time zone, max_attempts integer, ordering_key text, unique_key text, on_conflict text, depends_on bigint[], concurrency_key text, traceparent text, tracestate text) IS 'As skiplock.enqueue, and says what it did: the job''s id with inserted, or, for a unique_key already pending, that job''s id with skipped, replaced or merged. Example: SELECT * FROM skiplock.enqueue_job(''send_email'', ''{"to": "a@example.com"}'', unique_key => ''welcome-42'');';

--
-- Name: fail(bigint, uuid, text, interval); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.fail(id bigint, token uuid, error text, retry_in interval DEFAULT NULL::interval) RETURNS skiplock.job_state
    LANGUAGE plpgsql
    AS $$
BEGIN
    RETURN (SELECT s.state
            FROM skiplock.internal_save_outcomes_many('fail', 'retry', ARRAY[fail.id],
                                                      ARRAY[fail.token], NULL, ARRAY[fail.error],
                                                      ARRAY[fail.retry_in]) s);
END;
$$;

--
-- Name: FUNCTION fail(id bigint, token uuid, error text, retry_in interval); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.fail(id bigint, token uuid, error text, retry_in interval) IS 'Records `error` (cut to 8 KiB) in `last_error` and `errors`. `''queued''`: runs again after `skiplock.backoff(attempt)` (2^attempt seconds, at most an hour, ±25 %) or after `retry_in`. `''dead''`: no attempt left; its waiting dependants are cancelled and its lane moves on. `''cancelled''`: the job would run again, but its `unique_key` was taken meanwhile by another pending job, which runs instead (the job is superseded: `last_error` names that job; under the policy `merge` its payloads are merged into it). NULL: the claim was not held, nothing changed. A row that refuses the change goes `dead` with the reason, as in `fail_many`. A negative `retry_in` is an error (SQLSTATE 22023).';

--
-- Name: fail_many(bigint[], uuid[], text[], interval[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.fail_many(ids bigint[], tokens uuid[], errors text[], retry_in interval[] DEFAULT NULL::interval[]) RETURNS TABLE(id bigint, state skiplock.job_state)
    LANGUAGE sql
    AS $$
    SELECT * FROM skiplock.internal_save_outcomes_many('fail_many', 'retry', ids, tokens, NULL,
                                                       errors, retry_in);
$$;

--
-- Name: FUNCTION fail_many(ids bigint[], tokens uuid[], errors text[], retry_in interval[]); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.fail_many(ids bigint[], tokens uuid[], errors text[], retry_in interval[]) IS '`fail` for a batch, in one call and one transaction: each error (cut to 8 KiB) recorded, each job queued again after `skiplock.backoff(attempt)` or its element of `retry_in` (NULL: the backoff). Returns `id, state` per claim given, in the order given. `state` is `''queued''`, `''dead''` (no attempt left: its waiting dependants are cancelled and its lane moves on), `''cancelled''` (a retry whose `unique_key` another pending job took meanwhile), NULL when the claim was not held (nothing changed), and `''dead''` or `''running''` for a row that refused the change, as for `complete_many`. A negative `retry_in`, arrays of different lengths or an id given twice are an error (SQLSTATE 22023).';

--
-- Name: has_work(text[], text[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.has_work(queues text[], kinds text[] DEFAULT NULL::text[]) RETURNS boolean
    LANGUAGE sql STABLE
    SET jit TO 'off'
    AS $$
    SELECT EXISTS (
        SELECT 1 FROM skiplock.jobs_live j
        WHERE j.queue = ANY (queues) AND (kinds IS NULL OR j.kind = ANY (kinds))
          AND j.state = 'running'
    ) OR EXISTS (
        SELECT 1 FROM skiplock.jobs_live j
        WHERE j.queue = ANY (ARRAY(SELECT q FROM unnest(queues) AS q
                                   WHERE NOT EXISTS (SELECT 1 FROM skiplock.queues p
                                                     WHERE p.name = q AND p.paused)))
          AND (kinds IS NULL OR j.kind = ANY (kinds))
          AND ((j.state = 'queued' AND j.scheduled_at <= now())
               OR (j.state = 'waiting' AND j.held_for IS NOT NULL))
    );
$$;

--
-- Name: FUNCTION has_work(queues text[], kinds text[]); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.has_work(queues text[], kinds text[]) IS 'Whether a worker of these queues and kinds (NULL: every kind) has work now or once what runs anywhere ends: a job due and queued, a job running in any process (its end may let the next job of a lane or a child go), or a job held back by a per-key limit. What a worker asks before it exits when idle, after its own claim came back empty and nothing of its own runs. Jobs due later, jobs of a paused queue and jobs waiting for parents that have not ended are not counted (skiplock.left_behind names them). Example: SELECT skiplock.has_work(ARRAY[''mail''], NULL);';

--
-- Name: heartbeat(bigint[], uuid[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.heartbeat(ids bigint[], tokens uuid[]) RETURNS TABLE(id bigint, held boolean)
    LANGUAGE plpgsql
    AS $$
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

--
-- Name: FUNCTION heartbeat(ids bigint[], tokens uuid[]); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.heartbeat(ids bigint[], tokens uuid[]) IS 'Extends `heartbeat_at` of the claims still held; returns `id, held` per claim given. `held = false`: the claim is gone (reaped as stale, cancelled by an operator, finished, or the token is not the current one); stop the job and write nothing for it.';

--
-- Name: internal_abandon_claims(bigint[], uuid[], text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_abandon_claims(ids bigint[], tokens uuid[], message text) RETURNS TABLE(id bigint, state text, has_dependants boolean, ordering_key text)
    LANGUAGE sql
    SET jit TO 'off'
    AS $_$
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
    RETURNING j.id, j.state::text AS state, j.ordering_key, j.queue, j.concurrency_key
    ), freed AS (
        SELECT skiplock.internal_notify_freed(array_agg(queue), array_agg(concurrency_key)) FROM abandoned
    ), parents AS (
        -- In a snapshot of its own, after the rows' locks (see internal_complete_claims).
        SELECT skiplock.internal_parents_with_dependants(array_agg(id)) AS ids FROM abandoned
    )
    SELECT a.id, a.state, a.id = ANY (p.ids) AS has_dependants, a.ordering_key
    FROM abandoned a, parents p, (SELECT count(*) FROM freed) f;
$_$;

--
-- Name: internal_advance_lanes(text[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_advance_lanes(keys text[]) RETURNS integer
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
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

--
-- Name: internal_announce(skiplock.runnable_key[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_announce(keys skiplock.runnable_key[]) RETURNS void
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF cardinality(keys) > 0 THEN
        PERFORM skiplock.internal_notify_runnable(k.queue, k.priority,
                    min(k.scheduled_at) FILTER (WHERE k.scheduled_at <= now())),
                skiplock.internal_notify_due_later(k.queue, k.priority,
                    min(k.scheduled_at) FILTER (WHERE k.scheduled_at > now()), max(k.scheduled_at))
        FROM unnest(keys) AS k
        GROUP BY k.queue, k.priority;
    END IF;
END;
$$;

--
-- Name: internal_announce_queued_by_others(bigint[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_announce_queued_by_others(ids bigint[]) RETURNS void
    LANGUAGE sql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
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

--
-- Name: internal_append_error(jsonb, integer, text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_append_error(errors jsonb, attempt integer, message text) RETURNS jsonb
    LANGUAGE sql IMMUTABLE
    AS $$
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

--
-- Name: internal_args_within_limit(jsonb); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_args_within_limit(args jsonb) RETURNS jsonb
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF pg_column_size(args) > 4096 THEN
        PERFORM skiplock.internal_check_args_size(args);
    END IF;
    RETURN args;
END;
$$;

--
-- Name: internal_cancel_job_once(bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_cancel_job_once(job_id bigint) RETURNS boolean
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
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

--
-- Name: FUNCTION internal_cancel_job_once(job_id bigint); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.internal_cancel_job_once(job_id bigint) IS 'One attempt of skiplock.cancel_job, without its retry on a deadlock or a moved row; call cancel_job instead.';

--
-- Name: internal_check_args_size(jsonb); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_check_args_size(args jsonb) RETURNS void
    LANGUAGE plpgsql
    AS $$
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

--
-- Name: internal_check_queue_name(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_check_queue_name(queue_name text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    AS $$
BEGIN
    IF queue_name IS NULL OR queue_name = '' THEN
        RAISE EXCEPTION 'a queue name cannot be empty'
            USING ERRCODE = 'check_violation',
                  HINT = 'pass the queue''s name as its jobs have it in skiplock.jobs.queue';
    END IF;
END;
$$;

--
-- Name: internal_check_rate_limit(text, text, integer, interval, integer, integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_check_rate_limit(limit_name text, period_name text, starts integer, period interval, most integer, example integer) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    AS $$
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

--
-- Name: internal_check_running_limit(text, integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_check_running_limit(name text, value integer) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    AS $$
BEGIN
    IF value < 1 THEN
        RAISE EXCEPTION '% is %, it must be at least 1', name, value
            USING ERRCODE = 'check_violation',
                  HINT = 'NULL removes the limit; to stop claiming, pause the queue (skiplock.pause_queue)';
    END IF;
END;
$$;

--
-- Name: internal_claim_batch(text, text[], bigint, text, bigint[], uuid, boolean); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_claim_batch(queue_name text, kinds text[], max_jobs bigint, worker text, after bigint[] DEFAULT NULL::bigint[], claim_with uuid DEFAULT NULL::uuid, skip_in_flight boolean DEFAULT false) RETURNS TABLE(id bigint, queue text, kind text, args jsonb, attempt integer, max_attempts integer, claim_token uuid, priority smallint, scheduled_at_us bigint, traceparent text, tracestate text, key_limited boolean)
    LANGUAGE plpgsql
    SET enable_sort TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
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
    -- The queue's row: whether it is paused, its limits, and what they leave.
    is_paused boolean;
    lim_max_running int;
    lim_rate_limit int;
    lim_rate_period interval;
    lim_key_max_running int;
    lim_key_rate_limit int;
    lim_key_rate_period interval;
    lim_key_claimable int;
    -- Fair queueing: the keys whose held jobs a pass takes (NULL: the walk of queued jobs).
    held_keys text[];
    -- Fair queueing alone (no other per-key limit): a walk of a key's held jobs starts
    -- where they start (key_held_from).
    fair_only boolean;
    room bigint := max_jobs;
    wanted bigint;
    rate_room bigint;
    refill_at timestamptz;
    claim_time timestamptz;
    taken bigint;
    taken_now bigint;
    held_now int;
    -- Claim shares (see above): a share's room, whether this claim holds one, what the
    -- claims of this transaction took of the shares they hold, by queue.
    share_room int;
    shares_room bigint;
    sharing boolean := false;
    shares_held jsonb;
    taken_before bigint;
BEGIN
    IF max_jobs <= 0 THEN
        -- Nothing to take, and no share or turn to take for it (one taken and not recorded
        -- made a later claim of the transaction wait for itself).
        RETURN;
    END IF;
    -- The queue's row, if any; of a queue without limits, again under its claims lock: a
    -- write that gives the queue limits waits for this claim, and one that committed since
    -- the first read is what the second reads (see internal_queue_claims_lock_id).
    FOR row_read IN 1 .. 2 LOOP
        SELECT q.paused, q.max_running, q.rate_limit, q.rate_period, q.key_max_running,
               q.key_rate_limit, q.key_rate_period, q.key_claimable
        INTO is_paused, lim_max_running, lim_rate_limit, lim_rate_period,
             lim_key_max_running, lim_key_rate_limit, lim_key_rate_period, lim_key_claimable
        FROM skiplock.queues q
        WHERE q.name = queue_name;
        EXIT WHEN row_read = 2 OR lim_max_running IS NOT NULL OR lim_rate_limit IS NOT NULL
                  OR lim_key_max_running IS NOT NULL OR lim_key_rate_limit IS NOT NULL;
        PERFORM pg_advisory_xact_lock_shared(skiplock.internal_queue_claims_lock_id(queue_name));
    END LOOP;
    IF is_paused THEN
        RETURN;
    END IF;
    IF lim_max_running IS NOT NULL OR lim_rate_limit IS NOT NULL
       OR lim_key_max_running IS NOT NULL OR lim_key_rate_limit IS NOT NULL THEN
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            -- An older snapshot would miss claims committed after it, and claim past the
            -- limit.
            RAISE EXCEPTION 'queue % has a global limit (max_running, rate_limit, key_max_running or key_rate_limit), which a claim holds only in READ COMMITTED; this transaction is %',
                queue_name, upper(current_setting('transaction_isolation'))
                USING ERRCODE = 'invalid_transaction_state',
                      HINT = 'claim in a READ COMMITTED transaction: BEGIN ISOLATION LEVEL READ COMMITTED, or SET default_transaction_isolation for the session';
        END IF;
        -- A claim share, when the queue's only limit is max_running and the claim asks at
        -- most a share's room; else, or when the queue is more than half full, the
        -- queue's turn (06_global_limits.sql, "Claim shares").
        share_room := CASE WHEN lim_rate_limit IS NULL AND lim_key_max_running IS NULL
                                AND lim_key_rate_limit IS NULL
                           THEN skiplock.internal_claim_share_room(lim_max_running) ELSE 0 END;
        shares_held := nullif(current_setting('skiplock.claim_shares', true), '')::jsonb;
        taken_before := (shares_held ->> queue_name)::bigint;
        IF taken_before IS NOT NULL THEN
            -- This transaction holds a share of the queue: its claims take what is left of
            -- the share's room, and never wait for the turn holding it.
            sharing := true;
            room := least(room, greatest(0, share_room - taken_before));
        ELSIF share_room >= max_jobs THEN
            BEGIN
                PERFORM skiplock.internal_take_claim_share(queue_name);
                -- The limits again, holding the share: a change of max_running waited for
                -- the claims holding shares, and holds for this one.
                SELECT q.paused, q.max_running, q.rate_limit, q.key_max_running,
                       q.key_rate_limit
                INTO is_paused, lim_max_running, lim_rate_limit, lim_key_max_running,
                     lim_key_rate_limit
                FROM skiplock.queues q
                WHERE q.name = queue_name;
                IF is_paused THEN
                    -- Nothing to claim: the share goes back too (returned after the block).
                    RAISE EXCEPTION 'the queue is paused' USING ERRCODE = 'SL001';
                END IF;
                share_room := CASE WHEN lim_rate_limit IS NULL AND lim_key_max_running IS NULL
                                        AND lim_key_rate_limit IS NULL
                                   THEN skiplock.internal_claim_share_room(lim_max_running)
                                   ELSE 0 END;
                -- The running jobs, counted up to what leaves every share's room (through
                -- jobs_running_idx, as below).
                shares_room := skiplock.internal_claim_shares() * share_room::bigint;
                -- No limit left (removed while this claim waited for the share): the turn,
                -- not a share. A claim that took jobs by no limit holding only a share was
                -- waited for by no write giving the queue limits again, nor by a claim of a
                -- per-key limit (11 ran of a key_max_running of 1, a race review); under
                -- the turn, both wait for it.
                IF coalesce(share_room, 0) < max_jobs
                   OR (lim_max_running IS NOT NULL AND shares_room + (
                       SELECT count(*) FROM (SELECT FROM skiplock.jobs_live j
                                             WHERE j.queue = queue_name AND j.state = 'running'
                                             LIMIT greatest(lim_max_running - shares_room + 1, 1)) r)
                       > lim_max_running) THEN
                    -- Gives the share back (the subtransaction's locks go with it).
                    RAISE EXCEPTION 'the queue needs its turn' USING ERRCODE = 'SL001';
                END IF;
                sharing := true;
            EXCEPTION WHEN SQLSTATE 'SL001' THEN
                sharing := false;
            END;
            IF is_paused THEN
                RETURN;
            END IF;
        END IF;
        IF sharing THEN
            -- After the share and the count: the jobs' claimed_at and finished_at never show
            -- more running at once than the shares allow (see claim_time below).
            claim_time := clock_timestamp();
        END IF;
        IF NOT sharing THEN
            PERFORM pg_advisory_xact_lock(skiplock.internal_queue_limit_lock_id(queue_name));
            -- The limits again, under the lock: a change committed while this claim waited
            -- for it (its trigger let the held jobs go under the same lock) holds for it.
            SELECT q.paused, q.max_running, q.rate_limit, q.rate_period, q.key_max_running,
                   q.key_rate_limit, q.key_rate_period
            INTO is_paused, lim_max_running, lim_rate_limit, lim_rate_period, lim_key_max_running,
                 lim_key_rate_limit, lim_key_rate_period
            FROM skiplock.queues q
            WHERE q.name = queue_name;
            IF is_paused THEN
                RETURN;
            END IF;
            IF lim_rate_limit IS NULL AND lim_key_max_running IS NULL AND lim_key_rate_limit IS NULL
               AND skiplock.internal_claim_share_room(lim_max_running) > 0 THEN
                -- The rest of the turn of a queue whose claims may share it: no claim holds
                -- a share while it lasts. (Other limits, or a max_running too small to
                -- share: no claim holds one, as a change to that waited for them.)
                PERFORM skiplock.internal_take_every_claim_share(queue_name);
            END IF;
            IF lim_key_max_running IS NOT NULL THEN
                -- Keys whose slots were freed since: their held jobs go back first.
                PERFORM skiplock.internal_release_freed_keys(queue_name);
                PERFORM skiplock.internal_hold_full_keys(queue_name, lim_key_max_running);
            END IF;
            IF lim_max_running IS NOT NULL THEN
                -- Through jobs_running_idx: every running job's entry, the queue's found among
                -- them (see the index's comment in 0001_initial.sql).
                room := least(room, greatest(0, lim_max_running - (
                    SELECT count(*) FROM (SELECT FROM skiplock.jobs_live j
                                          WHERE j.queue = queue_name AND j.state = 'running'
                                          LIMIT lim_max_running) r)));
            END IF;
            -- After the lock and the count: later than every claim of the queue committed
            -- before, so the starts the rate limit records follow each other, and later than
            -- the end of every job the count found ended, so the jobs' claimed_at and
            -- finished_at never show more running at once than the count allowed.
            claim_time := clock_timestamp();
            IF lim_key_rate_limit IS NOT NULL THEN
                -- Keys whose windows have room again: their held jobs go back first.
                PERFORM skiplock.internal_release_refilled_keys(queue_name, claim_time);
            END IF;
            IF lim_rate_limit IS NOT NULL THEN
                wanted := room;
                rate_room := skiplock.internal_rate_room(queue_name, '', lim_rate_limit,
                                                         lim_rate_period, claim_time, wanted);
                room := least(room, rate_room);
            END IF;
            IF room <= 0 THEN
                IF rate_room < wanted THEN
                    -- Held back: the workers are told when the window has room again.
                    PERFORM skiplock.internal_notify_refill(
                        queue_name, skiplock.internal_rate_full_until(
                            queue_name, '', lim_rate_limit, lim_rate_period, claim_time));
                END IF;
                RETURN;
            END IF;
        END IF;
        IF room <= 0 THEN
            RETURN;
        END IF;
    END IF;
    IF lim_key_claimable IS NOT NULL AND lim_key_max_running IS NULL THEN
        -- Fair queueing: the keys whose turns were given up since are let go first (with
        -- key_max_running, under the queue's lock above).
        PERFORM skiplock.internal_release_freed_keys(queue_name);
    END IF;
    fair_only := lim_key_claimable IS NOT NULL AND lim_key_max_running IS NULL
                 AND lim_key_rate_limit IS NULL;
    -- Without a position, a key before every row: the full walk.
    IF after IS NOT NULL THEN
        IF cardinality(after) <> 3 OR array_position(after, NULL) IS NOT NULL
           OR after[1] NOT BETWEEN -32768 AND 32767 THEN
            RAISE EXCEPTION 'the claim position % is not {priority, scheduled_at_us, id}', after
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'pass the priority, scheduled_at_us and id of the last job claimed, or NULL for a walk from the front';
        END IF;
        from_priority := after[1];
        from_scheduled_at := CASE WHEN after[2] = -9223372036854775808
            THEN '-infinity'::timestamptz
            ELSE 'epoch'::timestamptz + after[2] * interval '1 microsecond' END;
        from_id := after[3];
    END IF;
    IF filtering THEN
        snapshot := pg_current_snapshot();
        in_flight := ARRAY(SELECT x::xid FROM pg_snapshot_xip(snapshot) AS x);
        next_xid := pg_snapshot_xmax(snapshot)::text::bigint % 4294967296;
    END IF;
    -- From the position on, with the caller's token when it gives one. The result is
    -- sorted (claim order) after the update has finished, so an update that fails has
    -- returned no row yet. With key_max_running, jobs picked beyond their key's room stay
    -- queued; they are held back then and the claim goes on for the room left, so that
    -- it comes back short only when nothing more may be taken (a worker takes a short
    -- claim for a drained queue).
    taken := 0;
    LOOP
        RETURN QUERY
        WITH picked_queued AS (
            SELECT j.ctid, j.concurrency_key, j.priority, j.scheduled_at, j.id
            FROM skiplock.jobs_live j
            WHERE held_keys IS NULL
              AND j.queue = queue_name AND j.state = 'queued' AND j.scheduled_at <= now()
              AND (j.priority, j.scheduled_at, j.id) > (from_priority, from_scheduled_at, from_id)
              AND (kinds IS NULL OR j.kind = ANY (kinds))
              AND NOT (filtering AND skiplock.internal_taken_in_flight(j.xmax, in_flight, next_xid))
              AND (lim_key_max_running IS NULL OR j.concurrency_key IS NULL
                   OR skiplock.internal_key_running(queue_name, j.concurrency_key,
                                                    lim_key_max_running) < lim_key_max_running)
            ORDER BY j.priority, j.scheduled_at, j.id
            LIMIT room
            FOR UPDATE OF j SKIP LOCKED
        ), picked_held AS (
            -- Fair queueing, after a pass that came back short: the jobs of the keys whose
            -- turns came (key_slots_freed) that wait for one, straight from jobs_held_idx
            -- (nothing else was there to take; one write each, not a release and then a
            -- claim). Such a job could run but for its turn, and, as a queued job, is not
            -- looked at again for parents (a parent retried by hand since does not hold it
            -- back).
            SELECT h.ctid, h.concurrency_key, h.priority, h.scheduled_at, h.id
            FROM unnest(held_keys) AS k(key)
            -- From where the key's held jobs start (its row of key_held_from, or a mark of
            -- a hold in key_slots_freed before it); with other per-key limits, the front.
            CROSS JOIN LATERAL (
                SELECT CASE WHEN fair_only THEN s.priority ELSE -32768 END AS priority,
                       CASE WHEN fair_only THEN s.scheduled_at ELSE '-infinity' END
                           AS scheduled_at,
                       CASE WHEN fair_only THEN s.id ELSE -9223372036854775808 END AS id
                FROM skiplock.internal_held_from(
                         queue_name, k.key,
                         ARRAY(SELECT f FROM skiplock.key_slots_freed f
                               WHERE f.queue = queue_name AND f.concurrency_key = k.key
                                 AND f.from_id IS NOT NULL)) s) w
            CROSS JOIN LATERAL (
                SELECT j.ctid, j.concurrency_key, j.priority, j.scheduled_at, j.id
                FROM skiplock.jobs_live j
                WHERE j.queue = queue_name AND j.state = 'waiting' AND j.held_for = 'fair'
                  AND j.concurrency_key = k.key AND j.scheduled_at <= now()
                  AND (j.priority, j.scheduled_at, j.id) >= (w.priority, w.scheduled_at, w.id)
                  AND (kinds IS NULL OR j.kind = ANY (kinds))
                  -- The in-flight filter too: a row another claim took and committed
                  -- since this statement's snapshot would be locked (its newest version,
                  -- running) before the recheck passes it over, and that job's completion
                  -- would wait for this claim's commit.
                  AND NOT (filtering
                           AND skiplock.internal_taken_in_flight(j.xmax, in_flight, next_xid))
                ORDER BY j.priority, j.scheduled_at, j.id
                LIMIT room
                FOR UPDATE OF j SKIP LOCKED) h
            LIMIT room
        ), picked AS (
            SELECT * FROM picked_queued
            UNION ALL
            SELECT * FROM picked_held
        ), key_wanted AS (
            -- With per-key limits, how many of each key picked may start by its running
            -- jobs: no more than key_max_running less them.
            SELECT p.concurrency_key AS key,
                   CASE WHEN lim_key_max_running IS NULL THEN count(*)
                        ELSE least(count(*), lim_key_max_running - skiplock.internal_key_running(
                                 queue_name, p.concurrency_key, lim_key_max_running))
                   END AS room
            FROM picked p
            WHERE p.concurrency_key IS NOT NULL
            GROUP BY p.concurrency_key
        ), key_room AS (
            -- And of those no more than each key's rate window allows (taken and recorded
            -- there, every key in one call). Evaluated only with such a limit (see taken).
            SELECT g.key,
                   CASE WHEN lim_key_rate_limit IS NULL THEN g.room
                        ELSE coalesce(t.took, 0) END AS room
            FROM key_wanted g
            LEFT JOIN skiplock.internal_rate_take(
                queue_name,
                ARRAY(SELECT w.key FROM key_wanted w
                      WHERE lim_key_rate_limit IS NOT NULL ORDER BY w.key),
                ARRAY(SELECT w.room FROM key_wanted w
                      WHERE lim_key_rate_limit IS NOT NULL ORDER BY w.key),
                claim_time, lim_key_rate_limit, lim_key_rate_period) t ON t.key = g.key
        ), taken AS (
            -- Of each key only as many as key_room says; the others picked stay queued,
            -- held back below.
            SELECT CASE WHEN lim_key_max_running IS NULL AND lim_key_rate_limit IS NULL
                THEN ARRAY(SELECT p.ctid FROM picked p)
                ELSE ARRAY(
                    SELECT k.ctid
                    FROM (SELECT p.ctid, p.concurrency_key,
                                 row_number() OVER (PARTITION BY p.concurrency_key
                                                    ORDER BY p.priority, p.scheduled_at, p.id) AS nth
                          FROM picked p) k
                    LEFT JOIN key_room r ON r.key = k.concurrency_key
                    WHERE k.concurrency_key IS NULL OR k.nth <= r.room)
                END AS ctids
        ), claimed AS (
            UPDATE skiplock.jobs_live j
            SET state = 'running', held_for = NULL,
                claim_token = coalesce(claim_with, gen_random_uuid()), claimed_by = worker,
                claimed_at = coalesce(claim_time, now()), heartbeat_at = clock_timestamp(),
                attempt = least(j.attempt, 2147483646) + 1
            WHERE j.ctid = ANY ((SELECT t.ctids FROM taken t)::tid[])
            RETURNING j.id, j.queue, j.kind, j.args, j.attempt, j.max_attempts,
                      j.claim_token, j.priority, j.scheduled_at, j.traceparent, j.tracestate,
                      j.concurrency_key
        ), turns_given AS (
            -- Fair queueing: the keys taken that have jobs held for their turn, or more than
            -- twice key_claimable due jobs queued besides those taken (come due, or queued
            -- past the insert's hold: the next claim's release holds them), for the queue's
            -- next claim (run whether or not the result is read).
            -- A LATERAL probe with LIMIT, not EXISTS: a hashed semi join read every held job.
            -- From the back of the key's range (see internal_key_first_held). The count
            -- reads this statement's snapshot, in which the jobs taken are still queued.
            INSERT INTO skiplock.key_slots_freed (queue, concurrency_key)
            SELECT queue_name, k.key
            FROM (SELECT c.concurrency_key AS key, count(*)::int AS taken FROM claimed c
                  WHERE lim_key_claimable IS NOT NULL AND c.concurrency_key IS NOT NULL
                  GROUP BY c.concurrency_key) k
            LEFT JOIN LATERAL (SELECT true AS found FROM skiplock.jobs_live h
                               WHERE h.queue = queue_name AND h.state = 'waiting'
                                 AND h.held_for IS NOT NULL AND h.concurrency_key = k.key
                               ORDER BY h.priority DESC, h.scheduled_at DESC, h.id DESC
                               LIMIT 1) held ON true
            WHERE held.found
               OR skiplock.internal_key_queued(
                      queue_name, k.key,
                      least(2 * lim_key_claimable::bigint + k.taken + 1, 2147483647)::int)
                  > 2 * lim_key_claimable::bigint + k.taken
        )
        SELECT c.id, c.queue, c.kind, c.args, c.attempt, c.max_attempts, c.claim_token,
               c.priority,
               -- A claimed row is due, so its scheduled_at is finite or '-infinity'.
               CASE WHEN isfinite(c.scheduled_at)
                    THEN (extract(epoch FROM c.scheduled_at) * 1000000)::bigint
                    ELSE -9223372036854775808 END,
               c.traceparent, c.tracestate,
               lim_key_max_running IS NOT NULL AND c.concurrency_key IS NOT NULL
        FROM claimed c
        ORDER BY c.priority, c.scheduled_at, c.id;
        GET DIAGNOSTICS taken_now = ROW_COUNT;
        taken := taken + taken_now;
        -- The keys whose windows this claim filled are held back whatever it took; when
        -- it came back short, the keys that are full now too, and it goes on for the room
        -- left if it held any. In a fair queue, short means nothing else may be taken now:
        -- it goes on with the held jobs of the keys whose turns came (left in
        -- key_slots_freed: by this claim above, or by others), so a lone key drains a
        -- claim's batch at a time.
        held_now := 0;
        IF lim_key_rate_limit IS NOT NULL THEN
            held_now := skiplock.internal_hold_rate_keys(queue_name);
        END IF;
        EXIT WHEN taken_now >= room
            OR (lim_key_max_running IS NULL AND lim_key_rate_limit IS NULL
                AND lim_key_claimable IS NULL);
        IF lim_key_max_running IS NOT NULL THEN
            held_now := held_now + skiplock.internal_hold_full_keys(queue_name, lim_key_max_running);
        END IF;
        IF lim_key_claimable IS NOT NULL THEN
            -- One pass over held jobs at most, also after one that took nothing: beside
            -- another claim in flight, whose locks it skipped (the key's queued jobs, the
            -- rows of key_slots_freed it lets go), it takes the keys' held jobs instead of
            -- coming back empty and waiting for that claim's commit (two processes on one
            -- key's backlog took turns).
            EXIT WHEN held_keys IS NOT NULL;
            held_keys := ARRAY(SELECT DISTINCT f.concurrency_key FROM skiplock.key_slots_freed f
                               WHERE f.queue = queue_name);
            IF cardinality(held_keys) > 0 THEN
                held_now := held_now + 1;
            ELSE
                held_keys := NULL;
            END IF;
        END IF;
        EXIT WHEN held_now = 0;
        room := room - taken_now;
    END LOOP;
    IF lim_key_claimable IS NOT NULL AND taken > 0 THEN
        -- The next claim lets go the keys' next jobs: after this one commits, a worker
        -- makes it.
        PERFORM skiplock.internal_notify_queue_start(queue_name)
        WHERE EXISTS (SELECT 1 FROM skiplock.key_slots_freed f WHERE f.queue = queue_name);
    END IF;
    IF rate_room IS NOT NULL THEN
        -- The starts taken; when the limit held jobs back, the workers are told when the
        -- window has room again (a refilled window is claimed then, not at the next poll).
        SELECT r.full_until INTO refill_at
        FROM skiplock.internal_rate_take(queue_name, '{""}', ARRAY[taken], claim_time,
                                         lim_rate_limit, lim_rate_period) r;
        IF rate_room < wanted AND taken >= rate_room THEN
            PERFORM skiplock.internal_notify_refill(queue_name, refill_at);
        END IF;
    END IF;
    IF sharing THEN
        PERFORM set_config('skiplock.claim_shares',
                           jsonb_set(coalesce(shares_held, '{}'), ARRAY[queue_name],
                                     to_jsonb(coalesce(taken_before, 0) + taken))::text,
                           true);
    END IF;
END;
$$;

--
-- Name: internal_claim_share_lock_id(text, integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_claim_share_lock_id(queue_name text, share integer) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT hashtextextended('skiplock.claim_share:' || share || ':' || queue_name, 0);
$$;

--
-- Name: internal_claim_share_room(integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_claim_share_room(max_running integer) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT max_running / (2 * skiplock.internal_claim_shares());
$$;

--
-- Name: internal_claim_shares(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_claim_shares() RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT 8;
$$;

--
-- Name: internal_complete_claims(bigint[], uuid[], boolean); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_complete_claims(ids bigint[], tokens uuid[], free_slots boolean DEFAULT true) RETURNS TABLE(id bigint, state text, has_dependants boolean, ordering_key text, queue text, concurrency_key text)
    LANGUAGE sql
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
    WITH done AS (
        UPDATE skiplock.jobs j
        SET state = 'succeeded', finished_at = now(), claim_token = NULL, heartbeat_at = NULL
        FROM unnest(ids, tokens) AS c(id, token)
        WHERE j.id = c.id AND j.claim_token = c.token AND j.state IN ('waiting', 'queued', 'running')
        RETURNING j.id, j.state::text AS state, j.ordering_key, j.queue, j.concurrency_key
    ), freed AS (
        SELECT skiplock.internal_notify_freed(array_agg(queue), array_agg(concurrency_key))
        FROM done HAVING free_slots
    ), parents AS (
        -- After the update, in a snapshot of its own: an edge whose enqueue held a job's
        -- row (FOR SHARE) while the update waited for it is seen (see the function).
        SELECT skiplock.internal_parents_with_dependants(array_agg(id)) AS ids FROM done
    )
    SELECT d.id, d.state, d.id = ANY (p.ids) AS has_dependants, d.ordering_key, d.queue,
           d.concurrency_key
    FROM done d, parents p, (SELECT count(*) FROM freed) f;
$$;

--
-- Name: FUNCTION internal_complete_claims(ids bigint[], tokens uuid[], free_slots boolean); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.internal_complete_claims(ids bigint[], tokens uuid[], free_slots boolean) IS 'Marks the given running jobs succeeded, each only if it still holds the given claim token, locking them in the order given (pass them sorted by id, as a worker does); returns those it changed, with what the worker does next for each (its dependants, its lane). What a worker calls.';

--
-- Name: internal_complete_handing_on(bigint[], uuid[], text, text[], uuid); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_complete_handing_on(ids bigint[], tokens uuid[], hand_to text, hand_kinds text[], hand_token uuid) RETURNS TABLE(id bigint, state text, has_dependants boolean, ordering_key text, queue text, kind text, args jsonb, attempt integer, max_attempts integer, claim_token uuid, priority smallint, scheduled_at_us bigint, traceparent text, tracestate text)
    LANGUAGE plpgsql
    SET jit TO 'off'
    AS $$
DECLARE
    done_ids bigint[];
    done_states text[];
    done_dependants boolean[];
    done_lanes text[];
    done_queues text[];
    done_keys text[];
BEGIN
    SELECT array_agg(c.id), array_agg(c.state), array_agg(c.has_dependants),
           array_agg(c.ordering_key), array_agg(c.queue), array_agg(c.concurrency_key)
    INTO done_ids, done_states, done_dependants, done_lanes, done_queues, done_keys
    FROM skiplock.internal_complete_claims(ids, tokens, false) c;
    RETURN QUERY
    SELECT d.id, d.state, d.dependants, d.lane, NULL::text, NULL::text, NULL::jsonb,
           NULL::int, NULL::int, NULL::uuid, NULL::smallint, NULL::bigint, NULL::text,
           NULL::text
    FROM unnest(done_ids, done_states, done_dependants, done_lanes)
         AS d(id, state, dependants, lane);
    RETURN QUERY
    SELECT h.id, 'running'::text, false, NULL::text, h.queue, h.kind, h.args, h.attempt,
           h.max_attempts, h.claim_token, h.priority, h.scheduled_at_us, h.traceparent,
           h.tracestate
    FROM skiplock.internal_free_slots(done_ids, done_queues, done_keys, hand_to, hand_kinds,
                                      hand_token) h;
END;
$$;

--
-- Name: FUNCTION internal_complete_handing_on(ids bigint[], tokens uuid[], hand_to text, hand_kinds text[], hand_token uuid); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.internal_complete_handing_on(ids bigint[], tokens uuid[], hand_to text, hand_kinds text[], hand_token uuid) IS 'As internal_complete_claims, then hands each key''s freed slot of a queue whose one limit is key_max_running on to hand_to: the key''s next due job, claimed with hand_token, when no other key''s due job is ahead of it (returned after the completed ones, state running, with the claim''s columns). What a worker calls; internal, not stable.';

--
-- Name: internal_cron_due_slot(text, text, timestamp with time zone, timestamp with time zone); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_cron_due_slot(expression text, timezone text, done_until timestamp with time zone, now_at timestamp with time zone) RETURNS timestamp with time zone
    LANGUAGE plpgsql STABLE
    AS $$
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

--
-- Name: internal_cron_field(text, text, text, integer, integer, integer, text[], integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_cron_field(expression text, field text, field_name text, field_start integer, low integer, high integer, names text[] DEFAULT NULL::text[], first_named integer DEFAULT 0) RETURNS integer[]
    LANGUAGE plpgsql IMMUTABLE
    AS $_$
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
$_$;

--
-- Name: internal_cron_latest_slot(text, text, timestamp without time zone, timestamp without time zone, timestamp with time zone, interval); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_cron_latest_slot(expression text, timezone text, from_wall timestamp without time zone, earliest timestamp without time zone, now_at timestamp with time zone, look_below interval) RETURNS timestamp with time zone
    LANGUAGE plpgsql STABLE
    AS $$
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

--
-- Name: internal_cron_parse(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_cron_parse(expression text, OUT seconds integer[], OUT minutes integer[], OUT hours integer[], OUT days integer[], OUT months integer[], OUT weekdays integer[], OUT days_any boolean, OUT weekdays_any boolean, OUT interval_job boolean) RETURNS record
    LANGUAGE plpgsql IMMUTABLE
    AS $$
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

--
-- Name: internal_cron_previous_local(integer[], integer[], integer[], integer[], integer[], integer[], boolean, boolean, timestamp without time zone, timestamp without time zone); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_cron_previous_local(seconds integer[], minutes integer[], hours integer[], days integer[], months integer[], weekdays integer[], days_any boolean, weekdays_any boolean, bound timestamp without time zone, earliest timestamp without time zone) RETURNS timestamp without time zone
    LANGUAGE plpgsql IMMUTABLE
    AS $$
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

--
-- Name: internal_cron_schedules_before_write(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_cron_schedules_before_write() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
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

--
-- Name: internal_cron_slot_instant(timestamp without time zone, text, boolean, timestamp with time zone); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_cron_slot_instant(wall timestamp without time zone, timezone text, interval_job boolean, now_at timestamp with time zone) RETURNS timestamp with time zone
    LANGUAGE plpgsql STABLE
    AS $$
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

--
-- Name: internal_done_partition(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_done_partition(leaf text) RETURNS regclass
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
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

--
-- Name: internal_done_partitions(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_done_partitions() RETURNS TABLE(leaf text, state skiplock.job_state, starts timestamp with time zone, ends timestamp with time zone)
    LANGUAGE sql STABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $_$
    SELECT c.relname::text, m[1]::skiplock.job_state,
           to_date(m[2], 'YYYYMMDD')::timestamp AT TIME ZONE 'UTC',
           (to_date(m[2], 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC'
    FROM pg_inherits i
    JOIN pg_class c ON c.oid = i.inhrelid
    CROSS JOIN LATERAL regexp_match(c.relname, '^jobs_done_(succeeded|dead|cancelled)_([0-9]{8})$') m
    WHERE i.inhparent = 'skiplock.jobs_done'::regclass AND m IS NOT NULL
    ORDER BY 3, 1;
$_$;

--
-- Name: internal_drop_done_partition(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_drop_done_partition(leaf text) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    SET lock_timeout TO '100ms'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
    AS $_$
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
    EXECUTE format('LOCK TABLE %s IN EXCLUSIVE MODE', day_table);
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
$_$;

--
-- Name: internal_due_later_payload(text, smallint, timestamp with time zone, timestamp with time zone); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_due_later_payload(queue text, priority smallint, first_at timestamp with time zone, last_at timestamp with time zone) RETURNS text
    LANGUAGE sql
    AS $$
    SELECT ((extract(epoch FROM first_at - clock_timestamp()) * 1000000)::bigint)::text || E'\t'
        || ((extract(epoch FROM last_at - clock_timestamp()) * 1000000)::bigint)::text || E'\t'
        || skiplock.internal_runnable_payload(queue, priority, first_at);
$$;

--
-- Name: internal_enqueue_cron_slots(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_enqueue_cron_slots() RETURNS integer
    LANGUAGE plpgsql
    SET jit TO 'off'
    AS $$
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

--
-- Name: internal_error_message(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_error_message(message text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE
    AS $$
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

--
-- Name: internal_error_time(jsonb); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_error_time(entry jsonb) RETURNS timestamp with time zone
    LANGUAGE plpgsql STABLE
    AS $$
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

--
-- Name: FUNCTION internal_error_time(entry jsonb); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.internal_error_time(entry jsonb) IS 'The time (`at`) of an entry of skiplock.jobs.errors, or NULL when it has no valid, finite one: statements over many rows read it with this so that one entry written by hand cannot fail them.';

--
-- Name: internal_expired_done_partitions(bigint, bigint, bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_expired_done_partitions(succeeded_ms bigint, cancelled_ms bigint, dead_ms bigint) RETURNS TABLE(leaf text, state skiplock.job_state, starts timestamp with time zone, ends timestamp with time zone)
    LANGUAGE sql STABLE
    AS $$
    SELECT p.leaf, p.state, p.starts, p.ends
    FROM skiplock.internal_done_partitions() p
    WHERE p.ends <= now() - CASE p.state
                                WHEN 'succeeded' THEN succeeded_ms
                                WHEN 'cancelled' THEN cancelled_ms
                                WHEN 'dead' THEN dead_ms
                            END * interval '1 millisecond'
    ORDER BY p.starts, p.leaf;
$$;

--
-- Name: internal_fail_claims(bigint[], uuid[], text[], bigint[], text[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_fail_claims(ids bigint[], tokens uuid[], messages text[], delays_ms bigint[], actions text[]) RETURNS TABLE(id bigint, state text, has_dependants boolean, ordering_key text)
    LANGUAGE sql
    SET jit TO 'off'
    AS $_$
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
              j.ordering_key, j.queue, j.priority, j.scheduled_at, j.concurrency_key
    ), runnable AS (
        -- A retry with no delay is runnable at once, and may be behind a position; one
        -- after its delay may come due behind one.
        SELECT skiplock.internal_announce(array_agg(
                   ROW(queue, priority, scheduled_at)::skiplock.runnable_key)
                   FILTER (WHERE state = 'queued'))
        FROM saved
    ), freed AS (
        SELECT skiplock.internal_notify_freed(array_agg(queue), array_agg(concurrency_key)) FROM saved
    ), parents AS (
        -- In a snapshot of its own, after the rows' locks (see internal_complete_claims).
        SELECT skiplock.internal_parents_with_dependants(array_agg(id)) AS ids FROM saved
    )
    SELECT s.id, s.state, s.id = ANY (p.ids) AS has_dependants, s.ordering_key
    FROM saved s, parents p, (SELECT count(*) FROM runnable) r, (SELECT count(*) FROM freed) f;
$_$;

--
-- Name: internal_fails_the_call(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_fails_the_call(code text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT left(code, 2) IN ('40', '53', '57', '08')
        OR code IN ('55P03', '25006', '26000', '42501');
$$;

--
-- Name: internal_finished_from(bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_finished_from(job_id bigint) RETURNS timestamp with time zone
    LANGUAGE sql STABLE
    SET jit TO 'off'
    AS $$
    SELECT coalesce((SELECT m.day FROM skiplock.job_id_days m WHERE m.id_reached < job_id
                     ORDER BY m.day DESC LIMIT 1)::timestamp AT TIME ZONE 'UTC',
                    '-infinity');
$$;

--
-- Name: internal_finished_job(bigint, text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_finished_job(job_id bigint, lock_rows text DEFAULT ''::text) RETURNS TABLE(id bigint, state skiplock.job_state, queue text, priority smallint, scheduled_at timestamp with time zone, ordering_key text, unique_key text, attempt integer, output jsonb, last_error text, finished_at timestamp with time zone)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
    AS $_$
DECLARE
    finished_from timestamptz := skiplock.internal_finished_from(job_id);
    finished skiplock.job_state;
BEGIN
    IF lock_rows IS NULL OR lock_rows NOT IN ('', 'FOR SHARE', 'FOR UPDATE') THEN
        RAISE EXCEPTION 'skiplock.internal_finished_job: lock_rows is empty, FOR SHARE or FOR UPDATE, not %', lock_rows
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOREACH finished IN ARRAY ARRAY['succeeded', 'dead', 'cancelled']::skiplock.job_state[] LOOP
        IF lock_rows = '' THEN
            RETURN QUERY
            SELECT d.id, d.state, d.queue, d.priority, d.scheduled_at, d.ordering_key,
                   d.unique_key, d.attempt, d.output, d.last_error, d.finished_at
            FROM skiplock.jobs d
            WHERE d.id = job_id AND d.state = finished AND d.finished_at >= finished_from;
        ELSIF lock_rows = 'FOR SHARE' THEN
            RETURN QUERY
            SELECT d.id, d.state, d.queue, d.priority, d.scheduled_at, d.ordering_key,
                   d.unique_key, d.attempt, d.output, d.last_error, d.finished_at
            FROM skiplock.jobs d
            WHERE d.id = job_id AND d.state = finished AND d.finished_at >= finished_from
            FOR SHARE;
        ELSE
            RETURN QUERY
            SELECT d.id, d.state, d.queue, d.priority, d.scheduled_at, d.ordering_key,
                   d.unique_key, d.attempt, d.output, d.last_error, d.finished_at
            FROM skiplock.jobs d
            WHERE d.id = job_id AND d.state = finished AND d.finished_at >= finished_from
            FOR UPDATE;
        END IF;
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
    RETURN QUERY EXECUTE
        'SELECT d.id, d.state, d.queue, d.priority, d.scheduled_at, d.ordering_key,
                d.unique_key, d.attempt, d.output, d.last_error, d.finished_at
         FROM skiplock.jobs d
         WHERE d.id = $1 ' || lock_rows
        USING job_id;
END;
$_$;

--
-- Name: internal_fold_into_key_holder(bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_fold_into_key_holder(job_id bigint) RETURNS bigint
    LANGUAGE plpgsql
    SET jit TO 'off'
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

--
-- Name: internal_forget_key_limit_rows(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_forget_key_limit_rows() RETURNS integer
    LANGUAGE sql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
    WITH windows AS (
        DELETE FROM skiplock.rate_windows w
        WHERE (w.queue, w.concurrency_key) IN (
                SELECT o.queue, o.concurrency_key FROM skiplock.rate_windows o
                WHERE o.expires_at < now() AND o.held_until IS NULL AND NOT o.hold_pending
                  -- Before the row is locked too: a window kept stays locked to the end of
                  -- the transaction, and a claim taking its starts would wait for it.
                  AND skiplock.internal_queue_turn_free(o.queue)
                ORDER BY o.expires_at
                LIMIT 500
                FOR UPDATE SKIP LOCKED)
          AND w.expires_at < now() AND w.held_until IS NULL AND NOT w.hold_pending
          AND skiplock.internal_queue_turn_free(w.queue)
        RETURNING 1
    ), slots AS (
        DELETE FROM skiplock.key_slots_freed f
        WHERE f.ctid = ANY (ARRAY(
                SELECT o.ctid FROM skiplock.key_slots_freed o
                WHERE NOT EXISTS (SELECT 1 FROM skiplock.queues q
                                  WHERE q.name = o.queue
                                    AND (q.key_max_running IS NOT NULL
                                         OR q.key_claimable IS NOT NULL))
                LIMIT 500
                FOR UPDATE SKIP LOCKED))
        RETURNING 1
    )
    SELECT ((SELECT count(*) FROM windows) + (SELECT count(*) FROM slots))::int;
$$;

--
-- Name: internal_free_slots(bigint[], text[], text[], text, text[], uuid); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_free_slots(done_ids bigint[], queues text[], keys text[], hand_to text, kinds text[], token uuid) RETURNS TABLE(id bigint, queue text, kind text, args jsonb, attempt integer, max_attempts integer, claim_token uuid, priority smallint, scheduled_at_us bigint, traceparent text, tracestate text)
    LANGUAGE plpgsql
    SET enable_sort TO 'off'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
DECLARE
    queue_name text;
    key_limit int;
    -- The queues whose keys' slots were looked at for handoffs (left for claims there).
    looked_at text[] := '{}';
    -- What the handoff of one queue took, and of all of them.
    taken_ids bigint[];
    taken_keys text[];
    handed bigint[] := '{}';
BEGIN
    IF hand_to IS NULL OR coalesce(cardinality(array_remove(keys, NULL)), 0) = 0 THEN
        PERFORM skiplock.internal_notify_freed(queues, keys);
        RETURN;
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- The queue's row and the key's running jobs would be read as of the snapshot, older
        -- than the lock below: a key_max_running lowered since would not hold. Left to
        -- the next claim, as the claim itself requires READ COMMITTED for a limited queue.
        PERFORM skiplock.internal_notify_freed(queues, keys);
        RETURN;
    END IF;
    FOR queue_name IN SELECT DISTINCT f.queue FROM unnest(queues, keys) AS f(queue, key)
                      WHERE f.key IS NOT NULL ORDER BY 1 LOOP
        CONTINUE WHEN NOT pg_try_advisory_xact_lock_shared(
            skiplock.internal_handoff_lock_id(queue_name));
        SELECT q.key_max_running INTO key_limit
        FROM skiplock.queues q
        WHERE q.name = queue_name AND NOT q.paused AND q.max_running IS NULL
          AND q.rate_limit IS NULL AND q.key_rate_limit IS NULL AND q.key_claimable IS NULL;
        CONTINUE WHEN key_limit IS NULL;
        looked_at := looked_at || queue_name;
        taken_ids := NULL;
        taken_keys := NULL;
        BEGIN
            WITH room AS MATERIALIZED (
                SELECT f.key,
                       greatest(0, least(count(*), key_limit - (
                           SELECT count(*) FROM (
                               SELECT FROM skiplock.jobs_live r
                               WHERE r.queue = queue_name AND r.state = 'running'
                                 AND r.concurrency_key = f.key AND r.id <> ALL (done_ids)
                               LIMIT key_limit) o))) AS room
                FROM unnest(queues, keys) AS f(queue, key)
                WHERE f.queue = queue_name AND f.key IS NOT NULL
                GROUP BY f.key
            ), candidates AS (
                -- Chosen without a lock; only those taken are locked below.
                SELECT c.ctid
                FROM (SELECT * FROM room r WHERE r.room > 0) r
                CROSS JOIN LATERAL (
                    SELECT c.ctid, c.priority, c.scheduled_at, c.id
                    FROM (SELECT * FROM (
                              SELECT h.ctid, h.priority, h.scheduled_at, h.id
                              FROM skiplock.jobs_live h
                              WHERE h.queue = queue_name AND h.state = 'waiting'
                                AND h.held_for IS NOT NULL AND h.concurrency_key = r.key
                                AND h.scheduled_at <= now()
                                AND (kinds IS NULL OR h.kind = ANY (kinds))
                                AND NOT skiplock.internal_has_unmet_parent(h.id)
                              ORDER BY h.priority, h.scheduled_at, h.id
                              LIMIT r.room) held
                          UNION ALL
                          -- The key's range of jobs_concurrency_key_idx (the state
                          -- compared twice: see internal_key_queued), never the queue's
                          -- claim index filtered by key.
                          SELECT * FROM (
                              SELECT s.ctid, s.priority, s.scheduled_at, s.id
                              FROM skiplock.jobs_live s
                              WHERE s.queue = queue_name AND s.state IN ('queued', 'running')
                                AND s.state = (SELECT 'queued'::skiplock.job_state)
                                AND s.concurrency_key = r.key AND s.scheduled_at <= now()
                                AND (kinds IS NULL OR s.kind = ANY (kinds))
                              ORDER BY s.priority, s.scheduled_at, s.id
                              LIMIT r.room) queued) c
                    -- No due queued job of another key (or none) ahead of it in claim
                    -- order: the queue's claim range up to the candidate, stopped at the
                    -- first (a probe, LIMIT 1: as a NOT EXISTS under empty statistics it
                    -- ran as an anti-join that read every queued job of the queue).
                    CROSS JOIN LATERAL (
                        SELECT count(*) AS ahead FROM (
                            SELECT FROM skiplock.jobs_live o
                            WHERE o.queue = queue_name AND o.state = 'queued'
                              AND (o.priority, o.scheduled_at, o.id)
                                  < (c.priority, c.scheduled_at, c.id)
                              AND o.scheduled_at <= now()
                              AND o.concurrency_key IS DISTINCT FROM r.key
                            ORDER BY o.priority, o.scheduled_at, o.id
                            LIMIT 1) o) a
                    WHERE a.ahead = 0
                    ORDER BY c.priority, c.scheduled_at, c.id
                    LIMIT r.room) c
            ), picked AS (
                -- A row changed since (taken, released, held again) has moved from its
                -- ctid and is left.
                SELECT j.ctid FROM skiplock.jobs_live j
                WHERE j.ctid = ANY (ARRAY(SELECT c.ctid FROM candidates c))
                  AND (j.state = 'queued' OR (j.state = 'waiting' AND j.held_for IS NOT NULL))
                FOR UPDATE SKIP LOCKED
            ), claimed AS (
                UPDATE skiplock.jobs_live j
                SET state = 'running', held_for = NULL, claim_token = token,
                    claimed_by = hand_to,
                    -- After the finished job's finished_at (the transaction's start).
                    claimed_at = clock_timestamp(), heartbeat_at = clock_timestamp(),
                    attempt = least(j.attempt, 2147483646) + 1
                WHERE j.ctid = ANY (ARRAY(SELECT p.ctid FROM picked p))
                RETURNING j.id, j.concurrency_key
            )
            SELECT array_agg(c.id), array_agg(c.concurrency_key) INTO taken_ids, taken_keys
            FROM claimed c;
        -- Nothing handed on here (taken_ids stays NULL), never a completion that fails
        -- for another job's row: a candidate moved to jobs_done under the statement, or a
        -- row that refuses to start (a trigger of the user's).
        EXCEPTION
            WHEN serialization_failure THEN NULL;
            WHEN OTHERS THEN NULL;
        END;
        handed := handed || coalesce(taken_ids, '{}');
        -- Each slot handed on is taken again: the others are left for the next claim.
        PERFORM skiplock.internal_notify_freed(array_agg(queue_name), array_agg(l.key))
        FROM (SELECT f.key FROM unnest(queues, keys) AS f(queue, key)
              WHERE f.queue = queue_name AND f.key IS NOT NULL
              EXCEPT ALL
              SELECT t.key FROM unnest(taken_keys) AS t(key)) l
        HAVING count(*) > 0;
    END LOOP;
    -- The slots of every other queue, and of jobs without a key: for the next claim.
    PERFORM skiplock.internal_notify_freed(array_agg(f.queue), array_agg(f.key))
    FROM unnest(queues, keys) AS f(queue, key)
    WHERE f.key IS NULL OR f.queue <> ALL (looked_at);
    RETURN QUERY
    SELECT j.id, j.queue, j.kind, j.args, j.attempt, j.max_attempts, j.claim_token,
           j.priority,
           CASE WHEN isfinite(j.scheduled_at)
                THEN (extract(epoch FROM j.scheduled_at) * 1000000)::bigint
                ELSE -9223372036854775808 END,
           j.traceparent, j.tracestate
    FROM unnest(handed) AS h(id)
    CROSS JOIN LATERAL (SELECT * FROM skiplock.jobs_live l WHERE l.id = h.id LIMIT 1) j;
END;
$$;

--
-- Name: internal_handoff_lock_id(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_handoff_lock_id(queue_name text) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT hashtextextended('skiplock.handoff:' || queue_name, 0);
$$;

--
-- Name: internal_has_unmet_parent(bigint, bigint[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_has_unmet_parent(job bigint, succeeded bigint[] DEFAULT '{}'::bigint[]) RETURNS boolean
    LANGUAGE plpgsql STABLE
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
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

--
-- Name: internal_heartbeat_claims(bigint[], uuid[], uuid[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_heartbeat_claims(ids bigint[], tokens uuid[], in_flight uuid[] DEFAULT '{}'::uuid[]) RETURNS TABLE(id bigint, claim_token uuid)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
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
                SELECT j.ctid, j.id FROM unnest(ids, tokens) AS c(id, token),
                LATERAL (SELECT j.ctid, j.id FROM skiplock.jobs_live j
                         WHERE j.id = c.id AND j.claim_token = c.token
                         FOR UPDATE SKIP LOCKED) j
            ), beat AS (
                -- By the locked rows' ctid: no second descent of the primary key.
                UPDATE skiplock.jobs_live j SET heartbeat_at = clock_timestamp()
                WHERE j.ctid = ANY(ARRAY(SELECT h.ctid FROM held h))
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

--
-- Name: key_slots_freed; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.key_slots_freed (
    queue text NOT NULL,
    concurrency_key text NOT NULL,
    from_priority smallint,
    from_scheduled_at timestamp with time zone,
    from_id bigint,
    CONSTRAINT key_slots_freed_from_whole CHECK ((((from_priority IS NULL) = (from_scheduled_at IS NULL)) AND ((from_priority IS NULL) = (from_id IS NULL))))
);

--
-- Name: TABLE key_slots_freed; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON TABLE skiplock.key_slots_freed IS 'Internal (key_max_running, key_claimable): a row per key and statement that freed a slot of the key or changed what of it is queued, for the queue''s next claim to let the key''s held jobs go; deleted by that claim.';

--
-- Name: COLUMN key_slots_freed.queue; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.key_slots_freed.queue IS 'The queue with key_max_running or key_claimable.';

--
-- Name: COLUMN key_slots_freed.concurrency_key; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.key_slots_freed.concurrency_key IS 'The key one of whose jobs ended, was claimed, was cancelled while queued, or was held by its insert.';

--
-- Name: COLUMN key_slots_freed.from_priority; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.key_slots_freed.from_priority IS 'Left by a hold in a fair queue: the priority of the first job it held (with from_scheduled_at and from_id, its claim key); NULL otherwise.';

--
-- Name: COLUMN key_slots_freed.from_scheduled_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.key_slots_freed.from_scheduled_at IS 'The scheduled_at of the first job the hold held; NULL otherwise.';

--
-- Name: COLUMN key_slots_freed.from_id; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.key_slots_freed.from_id IS 'The id of the first job the hold held; NULL otherwise.';

--
-- Name: internal_held_from(text, text, skiplock.key_slots_freed[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_held_from(queue_name text, key text, marks skiplock.key_slots_freed[], OUT priority smallint, OUT scheduled_at timestamp with time zone, OUT id bigint) RETURNS record
    LANGUAGE sql STABLE
    SET jit TO 'off'
    AS $$
    SELECT coalesce(c.p, -32768), coalesce(c.s, '-infinity'), coalesce(c.i, -9223372036854775808)
    FROM (SELECT 1) one
    LEFT JOIN LATERAL (
        SELECT starts.p, starts.s, starts.i
        FROM (SELECT f.priority AS p, f.scheduled_at AS s, f.id AS i
              FROM skiplock.key_held_from f
              WHERE f.queue = queue_name AND f.concurrency_key = key
              UNION ALL
              SELECT m.from_priority, m.from_scheduled_at, m.from_id
              FROM unnest(marks) AS m
              WHERE m.queue = queue_name AND m.concurrency_key = key AND m.from_id IS NOT NULL
                AND EXISTS (SELECT 1 FROM skiplock.key_held_from f
                            WHERE f.queue = queue_name AND f.concurrency_key = key)) starts
        ORDER BY starts.p, starts.s, starts.i
        LIMIT 1) c ON true;
$$;

--
-- Name: internal_hold_for_turns(bigint[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_hold_for_turns(ids bigint[]) RETURNS bigint[]
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    held bigint[];
    held_queues text[];
    held_keys text[];
    held_marks skiplock.key_slots_freed[];
BEGIN
    IF cardinality(ids) = 0 THEN
        RETURN '{}';
    END IF;
    held := ARRAY(
        WITH given AS (
            SELECT j.id, j.queue, j.concurrency_key AS key, j.priority, q.key_claimable AS cap,
                   row_number() OVER (PARTITION BY j.queue, j.concurrency_key
                                      ORDER BY j.priority, j.scheduled_at, j.id) - 1 AS ahead,
                   count(*) OVER (PARTITION BY j.queue, j.concurrency_key
                                  ORDER BY j.priority
                                  RANGE BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS up_to
            -- Each id probed (LATERAL with LIMIT, which the planner keeps), not
            -- `j.id = ANY (ids)` nor a join it may turn around: a walk testing each row
            -- against the whole list was quadratic in the statement's jobs.
            FROM unnest(ids) AS i(id)
            CROSS JOIN LATERAL (SELECT * FROM skiplock.jobs_live l WHERE l.id = i.id LIMIT 1) j
            CROSS JOIN LATERAL (SELECT q.key_claimable FROM skiplock.queues q
                                WHERE q.name = j.queue AND q.key_claimable IS NOT NULL) q
            WHERE j.state = 'queued' AND j.concurrency_key IS NOT NULL
              AND j.ordering_key IS NULL AND j.scheduled_at <= now()
        ), levels AS MATERIALIZED (
            -- Once per level (MATERIALIZED: inlined, its probes ran once per job).
            SELECT g.queue, g.key, g.priority, g.cap, g.up_to,
                   coalesce(skiplock.internal_key_first_held(g.queue, g.key) <= g.priority,
                            false) AS has_held,
                   -- The others: all of them counted up to cap beyond the given ones, less
                   -- the given ones (up_to; no test of each against the list). (The state
                   -- compared twice: see internal_key_queued.)
                   greatest(0, (SELECT count(*) FROM (
                        SELECT FROM skiplock.jobs_live o
                        WHERE o.queue = g.queue AND o.state IN ('queued', 'running')
                          AND o.state = (SELECT 'queued'::skiplock.job_state)
                          AND o.concurrency_key = g.key AND o.priority <= g.priority
                          AND o.scheduled_at <= now()
                        LIMIT g.cap + g.up_to) r) - g.up_to) AS queued
            FROM (SELECT DISTINCT g.queue, g.key, g.priority, g.cap, g.up_to FROM given g) g
        )
        -- A hash join of the two (hash joins allowed here for it): as a nested loop over
        -- the levels, an insert of 8,000 jobs of 800 keys compared 6,400,000 pairs.
        SELECT g.id
        FROM given g
        JOIN levels l ON l.queue = g.queue AND l.key = g.key AND l.priority = g.priority
        WHERE l.has_held OR l.queued + g.ahead >= g.cap);
    IF cardinality(held) > 0 THEN
        WITH waiting AS (
            UPDATE skiplock.jobs_live j SET state = 'waiting', held_for = 'fair'
            WHERE j.ctid = ANY (ARRAY(
                SELECT l.ctid FROM unnest(held) AS h(id)
                CROSS JOIN LATERAL (SELECT l.ctid FROM skiplock.jobs_live l
                                    WHERE l.id = h.id AND l.state = 'queued' LIMIT 1) l))
            RETURNING j.queue, j.concurrency_key, j.priority, j.scheduled_at, j.id
        ), firsts AS (
            -- Each key's first job held, in claim order: where its walks must start
            -- (key_held_from).
            SELECT DISTINCT ON (w.queue, w.concurrency_key) w.*
            FROM waiting w
            ORDER BY w.queue, w.concurrency_key, w.priority, w.scheduled_at, w.id
        )
        SELECT array_agg(f.queue), array_agg(f.concurrency_key),
               array_agg(ROW(f.queue, f.concurrency_key, f.priority, f.scheduled_at, f.id)
                             ::skiplock.key_slots_freed)
        INTO held_queues, held_keys, held_marks
        FROM firsts f;
        PERFORM skiplock.internal_recheck_keys(held_queues, held_keys, held_marks);
    END IF;
    RETURN held;
END;
$$;

--
-- Name: internal_hold_full_keys(text, integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_hold_full_keys(queue_name text, key_max_running integer) RETURNS integer
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    RETURN skiplock.internal_hold_keys(queue_name, ARRAY(
        SELECT r.concurrency_key
        FROM skiplock.jobs_live r
        WHERE r.queue = queue_name AND r.state = 'running' AND r.concurrency_key IS NOT NULL
        GROUP BY r.concurrency_key
        HAVING count(*) >= internal_hold_full_keys.key_max_running), 'key');
END;
$$;

--
-- Name: internal_hold_keys(text, text[], text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_hold_keys(queue_name text, keys text[], reason text) RETURNS integer
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    held_now int;
BEGIN
    IF cardinality(keys) = 0 THEN
        RETURN 0;
    END IF;
    WITH held AS (
        UPDATE skiplock.jobs_live j SET state = 'waiting', held_for = reason
        WHERE j.ctid = ANY (ARRAY(
            SELECT h.ctid
            FROM unnest(keys) AS k(key)
            CROSS JOIN LATERAL (
                SELECT h.ctid FROM skiplock.jobs_live h
                WHERE h.queue = queue_name AND h.state = 'queued'
                  AND h.concurrency_key = k.key AND h.ordering_key IS NULL
                FOR UPDATE SKIP LOCKED) h))
        RETURNING 1
    )
    SELECT count(*)::int INTO held_now FROM held;
    RETURN held_now;
END;
$$;

--
-- Name: internal_hold_overflow(text, text, integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_hold_overflow(queue_name text, key text, claimable integer, OUT mark skiplock.key_slots_freed, OUT queued integer) RETURNS record
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    twice bigint := 2 * claimable::bigint;
    bound smallint;
BEGIN
    queued := skiplock.internal_key_queued(queue_name, key, least(twice + 1, 2147483647)::int);
    IF queued <= twice OR current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN;
    END IF;
    IF NOT pg_try_advisory_xact_lock_shared(skiplock.internal_queue_limit_lock_id(queue_name)) THEN
        INSERT INTO skiplock.key_slots_freed (queue, concurrency_key) VALUES (queue_name, key);
        RETURN;
    END IF;
    bound := coalesce(skiplock.internal_key_first_held(queue_name, key), 32767);
    WITH held AS (
        UPDATE skiplock.jobs_live j SET state = 'waiting', held_for = 'fair'
        WHERE j.ctid = ANY (ARRAY(
            SELECT h.ctid FROM skiplock.jobs_live h
            WHERE h.queue = queue_name AND h.state IN ('queued', 'running')
              AND h.state = (SELECT 'queued'::skiplock.job_state) AND h.concurrency_key = key
              AND h.priority <= bound AND h.scheduled_at <= now() AND h.ordering_key IS NULL
            FOR UPDATE SKIP LOCKED))
        RETURNING j.priority, j.scheduled_at, j.id
    )
    -- The five fields, not one ROW(...): PL/pgSQL assigns a composite variable field by
    -- field, and a row constructor would land whole in the first field.
    SELECT queue_name, key, h.priority, h.scheduled_at, h.id
    INTO mark
    FROM held h
    ORDER BY h.priority, h.scheduled_at, h.id
    LIMIT 1;
    IF mark.from_id IS NOT NULL THEN
        INSERT INTO skiplock.key_slots_freed (queue, concurrency_key) VALUES (queue_name, key);
        queued := skiplock.internal_key_queued(queue_name, key, claimable);
    END IF;
END;
$$;

--
-- Name: internal_hold_rate_keys(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_hold_rate_keys(queue_name text) RETURNS integer
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    filled text[];
    held int;
    refill timestamptz;
BEGIN
    WITH pending AS (
        UPDATE skiplock.rate_windows w SET hold_pending = false
        WHERE w.queue = queue_name AND w.hold_pending
        RETURNING w.concurrency_key
    )
    SELECT array_agg(p.concurrency_key) INTO filled FROM pending p;
    IF filled IS NULL THEN
        RETURN 0;
    END IF;
    held := skiplock.internal_hold_keys(queue_name, filled, 'rate');
    -- A window that holds nothing back keeps no refill time: nothing waits for it, and the
    -- sweep forgets only a window without one (a key's jobs that come later are held by
    -- the claim that picks them, which marks the window again). A probe with LIMIT per
    -- window, not NOT EXISTS: a semi join walked every waiting job of the queue for each
    -- window (132 buffers beside 10,000 held jobs, against 4).
    UPDATE skiplock.rate_windows w SET held_until = NULL
    WHERE w.queue = queue_name AND w.concurrency_key = ANY (filled)
      AND w.held_until IS NOT NULL
      AND (SELECT true FROM skiplock.jobs_live j
           WHERE j.queue = queue_name AND j.state = 'waiting' AND j.held_for IS NOT NULL
             AND j.concurrency_key = w.concurrency_key
           LIMIT 1) IS NULL;
    SELECT min(w.held_until) INTO refill
    FROM skiplock.rate_windows w
    WHERE w.queue = queue_name AND w.concurrency_key = ANY (filled);
    PERFORM skiplock.internal_notify_refill(queue_name, refill);
    RETURN held;
END;
$$;

--
-- Name: jobs; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.jobs (
    id bigint NOT NULL,
    queue text DEFAULT 'default'::text NOT NULL,
    kind text NOT NULL,
    args jsonb DEFAULT '{}'::jsonb NOT NULL,
    state skiplock.job_state DEFAULT 'queued'::skiplock.job_state NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    scheduled_at timestamp with time zone DEFAULT now() NOT NULL,
    attempt integer DEFAULT 0 NOT NULL,
    max_attempts integer DEFAULT 25 NOT NULL,
    claim_token uuid,
    claimed_by text,
    claimed_at timestamp with time zone,
    heartbeat_at timestamp with time zone,
    ordering_key text,
    unique_key text,
    last_error text,
    errors jsonb DEFAULT '[]'::jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    unique_policy text,
    progress jsonb,
    output jsonb,
    concurrency_key text,
    held_for text,
    awaited boolean,
    traceparent text,
    tracestate text,
    CONSTRAINT jobs_attempt_not_negative CHECK ((attempt >= 0)),
    CONSTRAINT jobs_claim_token_only_running CHECK (((claim_token IS NULL) OR (state = 'running'::skiplock.job_state))),
    CONSTRAINT jobs_concurrency_key_not_empty CHECK ((concurrency_key <> ''::text)),
    CONSTRAINT jobs_held_for_known CHECK ((held_for = ANY (ARRAY['key'::text, 'rate'::text, 'fair'::text]))),
    CONSTRAINT jobs_held_for_only_waiting CHECK (((held_for IS NULL) OR (state = 'waiting'::skiplock.job_state))),
    CONSTRAINT jobs_kind_not_empty CHECK ((kind <> ''::text)),
    CONSTRAINT jobs_max_attempts_positive CHECK ((max_attempts >= 1)),
    CONSTRAINT jobs_queue_name_length CHECK ((octet_length(queue) <= 1000)),
    CONSTRAINT jobs_queue_not_empty CHECK ((queue <> ''::text)),
    CONSTRAINT jobs_running_has_claim CHECK (((state <> 'running'::skiplock.job_state) OR ((claim_token IS NOT NULL) AND (heartbeat_at IS NOT NULL)))),
    CONSTRAINT jobs_traceparent_length CHECK ((octet_length(traceparent) <= 512)),
    CONSTRAINT jobs_tracestate_length CHECK ((octet_length(tracestate) <= 8192)),
    CONSTRAINT jobs_unique_policy_known CHECK ((unique_policy = ANY (ARRAY['skip'::text, 'replace'::text, 'merge'::text])))
)
PARTITION BY LIST (state);

--
-- Name: TABLE jobs; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON TABLE skiplock.jobs IS 'Every skiplock job, finished ones included until the pruner removes them. Partitioned by state: jobs_live (waiting, queued, running) and jobs_done (succeeded, dead, cancelled).';

--
-- Name: COLUMN jobs.id; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.id IS 'The job''s id, from an identity shared by every partition: unique across live and finished jobs.';

--
-- Name: COLUMN jobs.queue; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.queue IS 'The queue it waits in; workers claim only the queues they serve. Not empty, at most 1,000 bytes.';

--
-- Name: COLUMN jobs.kind; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.kind IS 'The handler that runs it (a job type''s KIND, a built-in kind such as http or command). Not empty.';

--
-- Name: COLUMN jobs.args; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.args IS 'The handler''s input (any JSON), at most skiplock.args_max_bytes (1 MiB by default) as text.';

--
-- Name: COLUMN jobs.state; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.state IS 'waiting (for its parents, its lane, or held_for), queued (may run from scheduled_at), running (claimed), succeeded, dead (attempts exhausted or failed permanently), cancelled. Decides the partition.';

--
-- Name: COLUMN jobs.priority; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.priority IS 'Lower runs first (-32768 to 32767); with scheduled_at and id, the claim order.';

--
-- Name: COLUMN jobs.scheduled_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.scheduled_at IS 'When the job may run first; a retry or a snooze moves it forward. -infinity runs before anything due.';

--
-- Name: COLUMN jobs.attempt; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.attempt IS 'Attempts started so far; each claim counts one, a release or a snooze gives it back.';

--
-- Name: COLUMN jobs.max_attempts; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.max_attempts IS 'Attempts before a failing job goes dead (at least 1).';

--
-- Name: COLUMN jobs.claim_token; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.claim_token IS 'Fencing token of the current claim: only a write that presents it may heartbeat, complete or fail the job.';

--
-- Name: COLUMN jobs.claimed_by; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.claimed_by IS 'The worker that holds or last held the claim (its name: host, pid).';

--
-- Name: COLUMN jobs.claimed_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.claimed_at IS 'When the current or last claim was made.';

--
-- Name: COLUMN jobs.heartbeat_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.heartbeat_at IS 'The claim''s last heartbeat (database clock); a running job whose heartbeat is older than stale_after is reaped.';

--
-- Name: COLUMN jobs.ordering_key; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.ordering_key IS 'The job''s lane: the jobs of one key run one at a time, in enqueue (id) order.';

--
-- Name: COLUMN jobs.unique_key; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.unique_key IS 'At most one pending (waiting or queued) job per key; unique_policy says what a second enqueue does.';

--
-- Name: COLUMN jobs.last_error; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.last_error IS 'The last failure''s message (or why the job was cancelled or is dead).';

--
-- Name: COLUMN jobs.errors; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.errors IS 'The most recent failures (at most 20), oldest first: {attempt, at, message}.';

--
-- Name: COLUMN jobs.created_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.created_at IS 'When the job was enqueued.';

--
-- Name: COLUMN jobs.finished_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.finished_at IS 'When the job reached succeeded, dead or cancelled; with state, decides its day partition.';

--
-- Name: COLUMN jobs.unique_policy; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.unique_policy IS 'What a second enqueue with the same unique_key does while this job is pending: skip, replace (new args) or merge (append args).';

--
-- Name: COLUMN jobs.progress; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.progress IS 'Latest progress reported by the handler (any JSON).';

--
-- Name: COLUMN jobs.output; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.output IS 'Output recorded by the handler (any JSON).';

--
-- Name: COLUMN jobs.concurrency_key; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.concurrency_key IS 'A tenant or an account: in a queue with key_max_running or key_rate_limit, the limit holds per key. Not empty.';

--
-- Name: COLUMN jobs.held_for; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.held_for IS 'Why a waiting job is held back although its parents and its lane let it run: key (its concurrency_key is at key_max_running), rate (its key''s rate window is full) or fair (its key has key_claimable jobs queued; it waits its turn). NULL for a job waiting for its parents or its lane, and for every job not waiting: an UPDATE that takes a held job out of waiting sets it NULL too.';

--
-- Name: COLUMN jobs.awaited; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.awaited IS 'true once someone waits for the job''s outcome (skiplock.watch_job, skiplock::wait_for): when it finishes (succeeded, dead or cancelled) its id is notified on skiplock_finished. NULL otherwise.';

--
-- Name: COLUMN jobs.traceparent; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.traceparent IS 'W3C traceparent of the span that enqueued the job (skiplock.enqueue''s traceparent, the Rust API''s trace context): each attempt''s span continues that trace. At most 512 bytes; a value no worker can parse starts a new trace. NULL: no trace.';

--
-- Name: COLUMN jobs.tracestate; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.jobs.tracestate IS 'W3C tracestate that goes with traceparent (vendors'' entries), at most 8,192 bytes. NULL: none.';

--
-- Name: CONSTRAINT jobs_queue_name_length ON jobs; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON CONSTRAINT jobs_queue_name_length ON skiplock.jobs IS 'A queue name is at most 1,000 bytes: workers are told of runnable jobs by notifications that carry it, and Postgres caps their payload at 8,000 bytes.';

--
-- Name: internal_job_by_id(bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_job_by_id(job_id bigint) RETURNS SETOF skiplock.jobs
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
    AS $$
DECLARE
    found_state skiplock.job_state;
    ended_at timestamptz;
BEGIN
    RETURN QUERY SELECT * FROM skiplock.jobs j
                 WHERE j.id = job_id AND j.state IN ('waiting', 'queued', 'running');
    IF FOUND THEN
        RETURN;
    END IF;
    SELECT f.state, f.finished_at INTO found_state, ended_at
    FROM skiplock.internal_finished_job(job_id) f;
    IF ended_at IS NOT NULL THEN
        RETURN QUERY SELECT * FROM skiplock.jobs j
                     WHERE j.id = job_id AND j.state = found_state
                       AND j.finished_at = ended_at;
    END IF;
    IF NOT FOUND OR ended_at IS NULL THEN
        RETURN QUERY SELECT * FROM skiplock.jobs j WHERE j.id = job_id;
    END IF;
END;
$$;

--
-- Name: internal_job_dependencies_after_insert(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_job_dependencies_after_insert() RETURNS trigger
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
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

--
-- Name: internal_job_history_array_add(bigint[], bigint[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_job_history_array_add(a bigint[], b bigint[]) RETURNS bigint[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT coalesce(array_agg(coalesce(x, 0) + coalesce(y, 0) ORDER BY n), '{}')
    FROM unnest(coalesce(a, '{}'), coalesce(b, '{}')) WITH ORDINALITY AS t(x, y, n);
$$;

--
-- Name: internal_job_history_run_bounds(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_job_history_run_bounds() RETURNS double precision[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT '{0.005,0.01,0.025,0.05,0.1,0.25,0.5,1,2.5,5,10,30,60,300,900,3600}'::float8[];
$$;

--
-- Name: internal_job_state(bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_job_state(job_id bigint) RETURNS skiplock.job_state
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
    AS $$
DECLARE
    found_state skiplock.job_state;
BEGIN
    SELECT j.state INTO found_state FROM skiplock.jobs j
    WHERE j.id = job_id AND j.state IN ('waiting', 'queued', 'running');
    IF NOT FOUND THEN
        SELECT f.state INTO found_state FROM skiplock.internal_finished_job(job_id) f;
    END IF;
    RETURN found_state;
END;
$$;

--
-- Name: internal_jobs_after_delete(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_jobs_after_delete() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    SET enable_seqscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    parents bigint[];
    states skiplock.job_state[];
BEGIN
    IF current_setting('skiplock.moving_day', true) = TG_TABLE_NAME THEN
        RETURN NULL;
    END IF;
    SELECT array_agg(o.id), array_agg(o.state) INTO parents, states
    FROM deleted o WHERE o.state <> 'succeeded';
    PERFORM skiplock.internal_tombstone_parents(parents, states);
    DELETE FROM skiplock.job_dependencies d USING deleted o WHERE d.job_id = o.id;
    RETURN NULL;
END;
$$;

--
-- Name: internal_jobs_before_insert(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_jobs_before_insert() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
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

--
-- Name: internal_jobs_done_before_requeue(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_jobs_done_before_requeue() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM set_config('skiplock.requeue_moving', NEW.id::text, true);
    RETURN NEW;
END;
$$;

--
-- Name: internal_key_first_held(text, text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_key_first_held(queue_name text, key text) RETURNS smallint
    LANGUAGE plpgsql STABLE
    SET enable_sort TO 'off'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    first_held smallint;
BEGIN
    SELECT h.priority INTO first_held FROM skiplock.jobs_live h
    WHERE h.queue = queue_name AND h.state = 'waiting' AND h.held_for IS NOT NULL
      AND h.concurrency_key = key
    ORDER BY h.priority DESC, h.scheduled_at DESC, h.id DESC LIMIT 1;
    IF first_held IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN coalesce(
        (SELECT h.priority FROM skiplock.jobs_live h
         WHERE h.queue = queue_name AND h.state = 'waiting' AND h.held_for IS NOT NULL
           AND h.concurrency_key = key AND h.priority < first_held
         ORDER BY h.priority LIMIT 1),
        first_held);
END;
$$;

--
-- Name: internal_key_held_from_lock_id(text, text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_key_held_from_lock_id(queue_name text, key text) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT hashtextextended('skiplock.key_held_from:' || length(queue_name) || ':'
                            || queue_name || '/' || key, 0);
$$;

--
-- Name: internal_key_queued(text, text, integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_key_queued(queue_name text, key text, cap integer) RETURNS integer
    LANGUAGE plpgsql STABLE
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    bound smallint;
BEGIN
    IF cap IS NULL THEN
        RETURN NULL;
    END IF;
    bound := coalesce(skiplock.internal_key_first_held(queue_name, key), 32767);
    -- The key's queued range of jobs_concurrency_key_idx alone, whatever the statistics
    -- say: `state IN ('queued', 'running')` proves that index's predicate, and the state
    -- compared with `(SELECT 'queued')`, a value known only when the scan starts, proves
    -- nothing else, so jobs_claim_idx (`WHERE state = 'queued'`) cannot serve it (through
    -- it the count walked every key's queued jobs when the statistics said the queue held
    -- one key), and, being an equality, bounds the scan to the key's range. Written as
    -- `state < 'running'` instead, a range, the scan walked the queued jobs of every key
    -- of the queue (93 pages for any key beside 800 keys of 10 jobs, against 12), and an
    -- insert's hold of 300,000 jobs of 30,000 keys ran for more than 7 minutes. The same
    -- form serves every walk of a key's queued jobs (internal_hold_overflow,
    -- internal_hold_for_turns).
    RETURN (SELECT count(*)::int FROM (
        SELECT FROM skiplock.jobs_live j
        WHERE j.queue = queue_name AND j.state IN ('queued', 'running')
          AND j.state = (SELECT 'queued'::skiplock.job_state) AND j.concurrency_key = key
          AND j.priority <= bound AND j.scheduled_at <= now()
        LIMIT cap) r);
END;
$$;

--
-- Name: internal_key_running(text, text, integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_key_running(queue_name text, key text, cap integer) RETURNS integer
    LANGUAGE plpgsql STABLE
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    RETURN (SELECT count(*)::int FROM (
        SELECT FROM skiplock.jobs_live j
        WHERE j.queue = queue_name AND j.state = 'running' AND j.concurrency_key = key
        LIMIT cap) r);
END;
$$;

--
-- Name: internal_lane_lock_id(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_lane_lock_id(lane text) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT hashtextextended('skiplock.lane:' || lane, 0);
$$;

--
-- Name: internal_lock_done_partition(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_lock_done_partition(leaf text) RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    SET lock_timeout TO '100ms'
    AS $$
DECLARE
    day_table regclass;
BEGIN
    IF to_regclass(format('skiplock.%I', leaf)) IS NULL THEN
        RETURN false;
    END IF;
    -- The drop takes ACCESS EXCLUSIVE on jobs_done, and while its request waits every
    -- completion queues behind it. A transaction that holds jobs_done and is idle in it, or
    -- has run for a second (a report, a session a client forgot), would hold the request
    -- for its whole 100 ms at every pass: 12 stalls of every completion in 20 s beside one
    -- idle reader of skiplock.jobs. Such a day is left for a later pass without asking.
    -- Another role's sessions show their state only to a role with pg_read_all_stats;
    -- without it, the drop asks and waits its 100 ms as before.
    IF EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
               WHERE l.locktype = 'relation' AND l.relation = 'skiplock.jobs_done'::regclass
                 AND l.granted AND l.pid <> pg_backend_pid()
                 AND (a.state = 'idle in transaction'
                      OR a.xact_start < clock_timestamp() - interval '1 second')) THEN
        RAISE EXCEPTION 'skiplock.%: a transaction that read the finished jobs is open; the day is dropped at a later pass', leaf
            USING ERRCODE = 'lock_not_available';
    END IF;
    day_table := skiplock.internal_done_partition(leaf);
    EXECUTE format('LOCK TABLE %s IN EXCLUSIVE MODE', day_table);
    RETURN true;
END;
$$;

--
-- Name: internal_lock_unique_keys_of(bigint[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_lock_unique_keys_of(ids bigint[]) RETURNS void
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
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

--
-- Name: internal_make_rate_ring(text, text, integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_make_rate_ring(queue_name text, key text, size integer) RETURNS void
    LANGUAGE plpgsql
    AS $$
DECLARE
    kept timestamptz[];
BEGIN
    kept := ARRAY(SELECT s.started_at FROM skiplock.rate_window_starts s
                  WHERE s.queue = queue_name AND s.concurrency_key = key
                  ORDER BY s.started_at);
    DELETE FROM skiplock.rate_window_starts s
    WHERE s.queue = queue_name AND s.concurrency_key = key;
    INSERT INTO skiplock.rate_windows AS w (queue, concurrency_key, size, next_slot, expires_at)
    VALUES (queue_name, key, internal_make_rate_ring.size, 0, 'infinity')
    ON CONFLICT (queue, concurrency_key) DO UPDATE SET size = excluded.size, next_slot = 0;
    INSERT INTO skiplock.rate_window_starts (queue, concurrency_key, slot, started_at)
    SELECT queue_name, key, internal_make_rate_ring.size - cardinality(kept) + i - 1, kept[i]
    FROM generate_subscripts(kept, 1) AS i;
END;
$$;

--
-- Name: internal_may_retry_moved(integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_may_retry_moved(attempts integer) RETURNS boolean
    LANGUAGE sql STABLE
    AS $$
    SELECT attempts < 10 AND current_setting('transaction_isolation') = 'read committed';
$$;

--
-- Name: internal_move_on(bigint[], text[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_move_on(parent_ids bigint[], lanes text[]) RETURNS integer
    LANGUAGE plpgsql
    AS $$
DECLARE
    moved int;
    attempts int := 0;
BEGIN
    IF coalesce(cardinality(parent_ids), 0) = 0 AND coalesce(cardinality(lanes), 0) = 0 THEN
        RETURN 0;
    END IF;
    LOOP
        BEGIN
            -- One call: the dependants and every lane to step, in one lane step.
            moved := skiplock.internal_settle_dependants(coalesce(parent_ids, '{}'),
                                                         coalesce(lanes, '{}'));
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

--
-- Name: internal_next_job_id(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_next_job_id() RETURNS bigint
    LANGUAGE sql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
    SELECT nextval(pg_get_serial_sequence('skiplock.jobs', 'id'));
$$;

--
-- Name: internal_notify_due_later(text, smallint, timestamp with time zone, timestamp with time zone); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_notify_due_later(queue text, priority smallint, first_at timestamp with time zone, last_at timestamp with time zone) RETURNS void
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF first_at > now() AND first_at <= clock_timestamp() + interval '1 day' THEN
        PERFORM pg_notify('skiplock_due_later', skiplock.internal_due_later_payload(queue,
                    priority, first_at, least(last_at, clock_timestamp() + interval '1 day')));
    END IF;
END;
$$;

--
-- Name: internal_notify_finished(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_notify_finished() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM pg_notify('skiplock_finished', NEW.id::text);
    RETURN NULL;
END;
$$;

--
-- Name: internal_notify_freed(text[], text[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_notify_freed(queues text[], keys text[]) RETURNS void
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF cardinality(queues) > 0 THEN
        PERFORM skiplock.internal_notify_queue_start(q.name)
        FROM skiplock.queues q
        WHERE q.name = ANY (queues)
          AND (q.max_running IS NOT NULL OR q.key_max_running IS NOT NULL);
        INSERT INTO skiplock.key_slots_freed (queue, concurrency_key)
        SELECT DISTINCT f.queue, f.key
        FROM unnest(queues, keys) AS f(queue, key)
        WHERE f.key IS NOT NULL
          AND EXISTS (SELECT 1 FROM skiplock.queues q
                      WHERE q.name = f.queue AND q.key_max_running IS NOT NULL);
    END IF;
END;
$$;

--
-- Name: internal_notify_jobs_inserted(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_notify_jobs_inserted() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
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

--
-- Name: internal_notify_queue_start(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_notify_queue_start(queue text) RETURNS void
    LANGUAGE sql
    AS $$
    SELECT pg_notify('skiplock_runnable', E'-\t-\t' || queue);
$$;

--
-- Name: internal_notify_refill(text, timestamp with time zone); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_notify_refill(queue_name text, refill_at timestamp with time zone) RETURNS void
    LANGUAGE sql
    AS $$
    SELECT pg_notify('skiplock_due_later', in_us::text || E'\t' || in_us::text || E'\t'
                     || skiplock.internal_runnable_payload(queue_name, (-32768)::smallint, '-infinity'))
    FROM (SELECT (extract(epoch FROM refill_at - clock_timestamp()) * 1000000)::bigint + 1 AS in_us) t
    WHERE refill_at IS NOT NULL;
$$;

--
-- Name: internal_notify_runnable(text, smallint, timestamp with time zone); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_notify_runnable(queue text, priority smallint, scheduled_at timestamp with time zone) RETURNS void
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF scheduled_at <= now() THEN
        PERFORM pg_notify('skiplock_runnable',
                          skiplock.internal_runnable_payload(queue, priority, scheduled_at));
    END IF;
END;
$$;

--
-- Name: FUNCTION internal_notify_runnable(queue text, priority smallint, scheduled_at timestamp with time zone); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.internal_notify_runnable(queue text, priority smallint, scheduled_at timestamp with time zone) IS 'Tells workers that jobs of this queue became runnable from this priority and time on (at commit, if due): call it after requeuing jobs with a plain UPDATE.';

--
-- Name: internal_others_claiming(text[], text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_others_claiming(queues text[], worker text) RETURNS text[]
    LANGUAGE sql STABLE
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
    SELECT coalesce(array_agg(q.name), '{}')
    FROM unnest(queues) AS q(name)
    WHERE EXISTS (
        SELECT 1 FROM skiplock.jobs j
        WHERE j.state = 'running' AND j.queue = q.name
          AND j.claimed_by IS DISTINCT FROM worker);
$$;

--
-- Name: FUNCTION internal_others_claiming(queues text[], worker text); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.internal_others_claiming(queues text[], worker text) IS 'Of the given queues, those in which a claimer other than the given one holds running jobs. What a worker calls to choose how many claims and writes it keeps in flight; internal, not stable.';

--
-- Name: internal_parents_with_dependants(bigint[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_parents_with_dependants(ids bigint[]) RETURNS bigint[]
    LANGUAGE sql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
    SELECT coalesce(array_agg(i.id), '{}')
    FROM unnest(ids) AS i(id)
    WHERE EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = i.id);
$$;

--
-- Name: internal_prepare_done_partitions(date, integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_prepare_done_partitions(first_day date DEFAULT NULL::date, days integer DEFAULT 3) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    SET lock_timeout TO '100ms'
    SET "TimeZone" TO 'UTC'
    SET "DateStyle" TO 'ISO, YMD'
    SET jit TO 'off'
    AS $_$
DECLARE
    day date;
    finished skiplock.job_state;
    leaf text;
    starts timestamptz;
    ends timestamptz;
    created int := 0;
    marked int;
BEGIN
    -- Today's mark of the ids handed out (see skiplock.job_id_days), kept from the day's
    -- first call, which also lets the marks of days no longer kept go. A mark another
    -- caller is writing is left to it: the insert would wait for that caller's commit (a
    -- maintain() in a transaction), and fail this call at lock_timeout.
    IF NOT EXISTS (SELECT 1 FROM skiplock.job_id_days m
                   WHERE m.day = (now() AT TIME ZONE 'UTC')::date) THEN
        BEGIN
            INSERT INTO skiplock.job_id_days (day, id_reached)
            VALUES ((now() AT TIME ZONE 'UTC')::date,
                    coalesce(pg_sequence_last_value(
                                 pg_get_serial_sequence('skiplock.jobs', 'id')::regclass), 0))
            ON CONFLICT ON CONSTRAINT job_id_days_pkey DO NOTHING;
            GET DIAGNOSTICS marked = ROW_COUNT;
            IF marked > 0 THEN
                DELETE FROM skiplock.job_id_days m
                WHERE m.day < (SELECT min(p.starts AT TIME ZONE 'UTC')::date
                               FROM skiplock.internal_done_partitions() p);
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
    END IF;
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
            BEGIN
                EXECUTE format(
                    'CREATE TABLE skiplock.%I
                         (LIKE skiplock.jobs_done INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                    leaf);
                IF EXISTS (SELECT 1 FROM skiplock.jobs_done_default d
                           WHERE d.state = finished AND d.finished_at >= starts
                             AND d.finished_at < ends) THEN
                    PERFORM set_config('skiplock.moving_day', 'jobs_done_default', true);
                    EXECUTE format(
                        'WITH moved AS (
                             DELETE FROM skiplock.jobs_done_default d
                             WHERE d.state = $1 AND d.finished_at >= $2 AND d.finished_at < $3
                             RETURNING d.*)
                         INSERT INTO skiplock.%I SELECT * FROM moved', leaf)
                        USING finished, starts, ends;
                    PERFORM set_config('skiplock.moving_day', '', true);
                END IF;
                EXECUTE format(
                    'ALTER TABLE skiplock.jobs_done ATTACH PARTITION skiplock.%I
                     FOR VALUES FROM (%L, %L) TO (%L, %L)',
                    leaf, finished, starts, finished, ends);
                -- A statement trigger fires for the table a DELETE names (see jobs_after_delete).
                EXECUTE format(
                    'CREATE TRIGGER jobs_after_delete AFTER DELETE ON skiplock.%I
                     REFERENCING OLD TABLE AS deleted
                     FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete()',
                    leaf);
                created := created + 1;
            EXCEPTION WHEN lock_not_available OR duplicate_table OR check_violation
                           OR serialization_failure THEN
                -- Busy (a table or a moving row locked), made by another caller meanwhile,
                -- a row of that day reached jobs_done_default meanwhile, or a row to move
                -- was moved out of it by another transaction (40001): the next call looks
                -- again.
                NULL;
            END;
        END LOOP;
    END LOOP;
    RETURN created;
END;
$_$;

--
-- Name: internal_prune_cutoff(skiplock.job_state, bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_prune_cutoff(finished skiplock.job_state, retention_ms bigint) RETURNS timestamp with time zone
    LANGUAGE sql STABLE
    AS $$
    SELECT CASE
        WHEN retention_ms < 86400000 THEN now() - retention_ms * interval '1 millisecond'
        ELSE least(now() - retention_ms * interval '1 millisecond',
                   (SELECT min(p.starts) FROM skiplock.internal_done_partitions() p
                    WHERE p.state = finished) - interval '1 microsecond')
    END;
$$;

--
-- Name: internal_queue_claims_lock_id(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_queue_claims_lock_id(queue_name text) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT hashtextextended('skiplock.queue_claims:' || queue_name, 0);
$$;

--
-- Name: internal_queue_limit_lock_id(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_queue_limit_lock_id(queue_name text) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT hashtextextended('skiplock.queue_limit:' || queue_name, 0);
$$;

--
-- Name: internal_queue_ready_dependants(bigint[], bigint[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_queue_ready_dependants(ids bigint[], succeeded bigint[], OUT promoted integer, OUT lanes text[]) RETURNS record
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
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

--
-- Name: internal_queue_turn_free(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_queue_turn_free(queue_name text) RETURNS boolean
    LANGUAGE sql
    AS $$
    SELECT pg_try_advisory_lock_shared(skiplock.internal_queue_limit_lock_id(queue_name))
           AND pg_advisory_unlock_shared(skiplock.internal_queue_limit_lock_id(queue_name));
$$;

--
-- Name: internal_queues_after_fairness_change(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_queues_after_fairness_change() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(skiplock.internal_queue_limit_lock_id(OLD.name));
    DELETE FROM skiplock.key_held_from f WHERE f.queue = OLD.name;
    RETURN NULL;
END;
$$;

--
-- Name: internal_queues_after_handoff_rules_change(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_queues_after_handoff_rules_change() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(skiplock.internal_handoff_lock_id(OLD.name));
    RETURN NULL;
END;
$$;

--
-- Name: internal_queues_after_key_limit(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_queues_after_key_limit() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
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

--
-- Name: internal_queues_after_limits_set(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_queues_after_limits_set() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(skiplock.internal_queue_claims_lock_id(NEW.name));
    RETURN NULL;
END;
$$;

--
-- Name: internal_queues_after_max_running_change(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_queues_after_max_running_change() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
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

--
-- Name: internal_queues_after_write(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_queues_after_write() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM skiplock.internal_notify_queue_start(NEW.name);
    RETURN NULL;
END;
$$;

--
-- Name: internal_rate_first_busy(text, text, integer, integer, integer, interval, timestamp with time zone, bigint, bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_rate_first_busy(queue_name text, key text, next_slot integer, size integer, rate_limit integer, rate_period interval, at timestamp with time zone, from_i bigint, to_i bigint) RETURNS TABLE(i bigint, started_at timestamp with time zone)
    LANGUAGE sql STABLE
    AS $$
    SELECT g.i, s.started_at
    FROM generate_series(from_i, to_i) AS g(i)
    CROSS JOIN LATERAL (
        SELECT s.started_at FROM skiplock.rate_window_starts s
        WHERE s.queue = queue_name AND s.concurrency_key = key
          AND s.slot = (next_slot + size - rate_limit + g.i) % size
          AND s.started_at >= at - rate_period
        LIMIT 1) s
    ORDER BY g.i
    LIMIT 1;
$$;

--
-- Name: internal_rate_full_until(text, text, integer, interval, timestamp with time zone); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_rate_full_until(queue_name text, key text, rate_limit integer, rate_period interval, at timestamp with time zone) RETURNS timestamp with time zone
    LANGUAGE plpgsql STABLE
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    RETURN (SELECT b.started_at + rate_period
            FROM skiplock.rate_windows w
            CROSS JOIN LATERAL skiplock.internal_rate_first_busy(
                w.queue, w.concurrency_key, w.next_slot, w.size, rate_limit, rate_period, at,
                0, 0) b
            WHERE w.queue = queue_name AND w.concurrency_key = key AND w.size >= rate_limit);
END;
$$;

--
-- Name: internal_rate_room(text, text, integer, interval, timestamp with time zone, bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_rate_room(queue_name text, key text, rate_limit integer, rate_period interval, at timestamp with time zone, wanted bigint) RETURNS bigint
    LANGUAGE plpgsql STABLE
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    ring skiplock.rate_windows;
    look bigint := greatest(least(wanted, rate_limit), 0);
    first_busy bigint;
BEGIN
    IF rate_limit IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT * INTO ring FROM skiplock.rate_windows w
    WHERE w.queue = queue_name AND w.concurrency_key = key;
    IF ring.queue IS NULL OR look = 0 THEN
        RETURN look;
    END IF;
    SELECT b.i INTO first_busy
    FROM skiplock.internal_rate_first_busy(queue_name, key, ring.next_slot, ring.size,
                                           rate_limit, rate_period, at,
                                           greatest(rate_limit - ring.size, 0), look - 1) b;
    RETURN coalesce(first_busy, look);
END;
$$;

--
-- Name: internal_rate_take(text, text[], bigint[], timestamp with time zone, integer, interval); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_rate_take(queue_name text, keys text[], wanted bigint[], at timestamp with time zone, rate_limit integer, rate_period interval) RETURNS TABLE(key text, took bigint, full_until timestamp with time zone)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    missing text;
BEGIN
    IF coalesce(cardinality(keys), 0) = 0 THEN
        RETURN;
    END IF;
    PERFORM FROM skiplock.rate_windows w
    WHERE w.queue = queue_name AND w.concurrency_key = ANY (keys)
    FOR UPDATE;
    FOR missing IN
        SELECT k.key FROM unnest(keys, wanted) AS k(key, wanted)
        WHERE k.wanted > 0
          AND NOT EXISTS (SELECT 1 FROM skiplock.rate_windows w
                          WHERE w.queue = queue_name AND w.concurrency_key = k.key
                            AND w.size >= rate_limit)
    LOOP
        PERFORM skiplock.internal_make_rate_ring(queue_name, missing, rate_limit);
    END LOOP;
    RETURN QUERY
    WITH window_taken AS (
        SELECT r.key, r.next_slot, r.size,
               least(coalesce(b.i, r.look), r.look) AS took,
               CASE WHEN least(coalesce(b.i, r.look), r.look) >= rate_limit
                    THEN at + rate_period
                    WHEN b.i = least(coalesce(b.i, r.look), r.look)
                    THEN b.started_at + rate_period END AS full_until
        FROM (SELECT k.key, least(k.wanted, rate_limit) AS look, w.next_slot, w.size
              FROM unnest(keys, wanted) AS k(key, wanted)
              CROSS JOIN LATERAL (SELECT w.next_slot, w.size FROM skiplock.rate_windows w
                                  WHERE w.queue = queue_name AND w.concurrency_key = k.key
                                  LIMIT 1) w
              WHERE k.wanted > 0) r
        LEFT JOIN LATERAL skiplock.internal_rate_first_busy(
            queue_name, r.key, r.next_slot, r.size, rate_limit, rate_period, at, 0,
            least(r.look, rate_limit - 1)) b ON true
    ), slots AS (
        INSERT INTO skiplock.rate_window_starts AS s (queue, concurrency_key, slot, started_at)
        SELECT queue_name, t.key, (t.next_slot + g) % t.size, at
        FROM window_taken t
        CROSS JOIN LATERAL generate_series(0, t.took - 1) AS g
        ON CONFLICT (queue, concurrency_key, slot) DO UPDATE SET started_at = excluded.started_at
    ), windows AS (
        UPDATE skiplock.rate_windows w
        SET next_slot = ((t.next_slot + t.took) % t.size)::int,
            expires_at = CASE WHEN t.took > 0 THEN at + rate_period ELSE w.expires_at END,
            held_until = CASE WHEN t.key <> '' AND t.full_until IS NOT NULL
                              THEN t.full_until + interval '1 microsecond'
                              ELSE w.held_until END,
            hold_pending = w.hold_pending OR (t.key <> '' AND t.full_until IS NOT NULL)
        FROM window_taken t
        WHERE w.queue = queue_name AND w.concurrency_key = t.key
          AND (t.took > 0 OR t.full_until IS NOT NULL)
    )
    SELECT t.key, t.took, t.full_until FROM window_taken t;
END;
$$;

--
-- Name: internal_reap_stale(bigint, bigint, bigint, timestamp with time zone); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_reap_stale(stale_after_ms bigint, max_jobs bigint, only_id bigint DEFAULT NULL::bigint, since timestamp with time zone DEFAULT NULL::timestamp with time zone) RETURNS TABLE(id bigint, state text, claimed_by text, ordering_key text)
    LANGUAGE plpgsql
    SET jit TO 'off'
    AS $_$
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
                 j.queue, j.priority, j.scheduled_at, j.concurrency_key
       ), due_later AS (
           -- Back after the backoff: it may come due behind a worker's position.
           SELECT skiplock.internal_announce(array_agg(
                      ROW(queue, priority, scheduled_at)::skiplock.runnable_key)
                      FILTER (WHERE state = 'queued'))
           FROM taken_back
       ), freed AS (
           SELECT skiplock.internal_notify_freed(array_agg(queue), array_agg(concurrency_key)) FROM taken_back
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
$_$;

--
-- Name: internal_reap_stale_tally(bigint, bigint, bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_reap_stale_tally(stale_after_ms bigint, max_jobs bigint, only_id bigint DEFAULT NULL::bigint, OUT reaped bigint, OUT finished bigint[], OUT lanes text[]) RETURNS record
    LANGUAGE sql
    AS $$
    SELECT count(*),
           coalesce(array_agg(r.id) FILTER (WHERE r.state <> 'queued'), '{}'),
           coalesce(array_agg(r.ordering_key)
                        FILTER (WHERE r.state <> 'queued' AND r.ordering_key IS NOT NULL), '{}')
    FROM skiplock.internal_reap_stale(stale_after_ms, max_jobs, only_id) r;
$$;

--
-- Name: internal_recheck_keys(text[], text[], skiplock.key_slots_freed[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_recheck_keys(queues text[], keys text[], marks skiplock.key_slots_freed[] DEFAULT NULL::skiplock.key_slots_freed[]) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    SET jit TO 'off'
    AS $$
BEGIN
    INSERT INTO skiplock.key_slots_freed (queue, concurrency_key, from_priority,
                                          from_scheduled_at, from_id)
    SELECT k.queue, k.key, m.from_priority, m.from_scheduled_at, m.from_id
    FROM (SELECT DISTINCT f.queue, f.key
          FROM unnest(queues, keys) AS f(queue, key)
          WHERE f.key IS NOT NULL
            AND EXISTS (SELECT 1 FROM skiplock.queues q
                        WHERE q.name = f.queue AND q.key_claimable IS NOT NULL)) k
    LEFT JOIN LATERAL (SELECT m.from_priority, m.from_scheduled_at, m.from_id
                       FROM unnest(marks) AS m
                       WHERE m.queue = k.queue AND m.concurrency_key = k.key
                       ORDER BY m.from_priority, m.from_scheduled_at, m.from_id
                       LIMIT 1) m ON true;
    PERFORM skiplock.internal_notify_queue_start(q.name)
    FROM skiplock.queues q
    WHERE q.name = ANY (queues) AND q.key_claimable IS NOT NULL;
END;
$$;

--
-- Name: internal_release_claims(bigint[], uuid[], bigint[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_release_claims(ids bigint[], tokens uuid[], delays_ms bigint[]) RETURNS TABLE(id bigint, state text)
    LANGUAGE sql
    SET jit TO 'off'
    AS $_$
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
        RETURNING j.id, j.queue, j.state, f.delay_ms, j.priority, j.scheduled_at,
                  j.concurrency_key, j.ordering_key
    ), superseded AS (
        -- A superseded job ended (cancelled): its lane's turn passes on and its waiting
        -- dependants are settled, as for any job that ends (no call when none did).
        SELECT skiplock.internal_move_on(array_agg(id),
                                         array_agg(ordering_key) FILTER (WHERE ordering_key IS NOT NULL))
        FROM released WHERE state = 'cancelled'
        HAVING count(*) > 0
    ), runnable AS (
        -- Released jobs keep their scheduled_at: behind the workers' positions. Snoozed
        -- ones (scheduled_at after now()) may come due behind them.
        SELECT skiplock.internal_announce(array_agg(
                   ROW(queue, priority, scheduled_at)::skiplock.runnable_key)
                   FILTER (WHERE state = 'queued'))
        FROM released
    ), freed AS (
        SELECT skiplock.internal_notify_freed(array_agg(queue), array_agg(concurrency_key)) FROM released
    )
    SELECT id, state::text FROM released, (SELECT count(*) FROM runnable) r,
                                          (SELECT count(*) FROM freed) f,
                                          (SELECT count(*) FROM superseded) m;
$_$;

--
-- Name: internal_release_fair_key(text, text, integer, skiplock.key_slots_freed[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_release_fair_key(queue_name text, key text, claimable integer, marks skiplock.key_slots_freed[]) RETURNS integer
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    writes_row boolean;
    row_at record;
    walk_from record;
    queued int;
    held record;
    overflow skiplock.key_slots_freed;
    room int;
    released int;
    released_keys skiplock.runnable_key[];
    still_held record;
    recorded boolean := false;
BEGIN
    writes_row := pg_try_advisory_xact_lock(
        skiplock.internal_key_held_from_lock_id(queue_name, key));
    SELECT f.priority, f.scheduled_at, f.id INTO row_at
    FROM skiplock.key_held_from f
    WHERE f.queue = queue_name AND f.concurrency_key = key;
    SELECT * INTO walk_from FROM skiplock.internal_held_from(queue_name, key, marks);
    SELECT * INTO held FROM skiplock.internal_hold_overflow(queue_name, key, claimable);
    overflow := held.mark;
    queued := held.queued;
    IF (overflow.from_priority, overflow.from_scheduled_at, overflow.from_id)
       < (walk_from.priority, walk_from.scheduled_at, walk_from.id) THEN
        -- This walk, which lets the first of them go again, starts no later than the first.
        walk_from.priority := overflow.from_priority;
        walk_from.scheduled_at := overflow.from_scheduled_at;
        walk_from.id := overflow.from_id;
    END IF;
    room := greatest(claimable - least(queued, claimable), 0);
    WITH released AS (
        UPDATE skiplock.jobs_live j SET state = 'queued', held_for = NULL,
            -- Behind what is queued now, so that the keys take turns.
            scheduled_at = greatest(j.scheduled_at, now())
        WHERE j.ctid = ANY (ARRAY(
            SELECT h.ctid FROM skiplock.jobs_live h
            WHERE h.queue = queue_name AND h.state = 'waiting' AND h.held_for IS NOT NULL
              AND h.concurrency_key = key
              AND (h.priority, h.scheduled_at, h.id)
                  >= (walk_from.priority, walk_from.scheduled_at, walk_from.id)
              -- See internal_release_held.
              AND NOT skiplock.internal_has_unmet_parent(h.id)
            ORDER BY h.priority, h.scheduled_at, h.id
            LIMIT room
            FOR UPDATE SKIP LOCKED))
        RETURNING j.queue, j.priority, j.scheduled_at
    )
    SELECT count(*), array_agg(ROW(r.queue, r.priority, r.scheduled_at)::skiplock.runnable_key)
    INTO released, released_keys FROM released r;
    PERFORM skiplock.internal_announce(released_keys);
    SELECT h.priority, h.scheduled_at, h.id INTO still_held
    FROM skiplock.jobs_live h
    WHERE h.queue = queue_name AND h.state = 'waiting' AND h.held_for IS NOT NULL
      AND h.concurrency_key = key
      AND (h.priority, h.scheduled_at, h.id)
          >= (walk_from.priority, walk_from.scheduled_at, walk_from.id)
    ORDER BY h.priority, h.scheduled_at, h.id
    LIMIT 1;
    IF still_held.id IS NULL THEN
        IF writes_row AND row_at.id IS NOT NULL THEN
            DELETE FROM skiplock.key_held_from f
            WHERE f.ctid = (SELECT o.ctid FROM skiplock.key_held_from o
                            WHERE o.queue = queue_name AND o.concurrency_key = key
                            FOR UPDATE SKIP LOCKED)
              AND (f.priority, f.scheduled_at, f.id) = (row_at.priority, row_at.scheduled_at, row_at.id);
        END IF;
        RETURN released;
    END IF;
    IF NOT writes_row THEN
        -- The row is left to the release holding the lock: this one walked from the row
        -- (as committed, which that release reads too, or moves past only what it saw
        -- held), and needs to keep only the marks it took and the jobs it held, as one mark.
        recorded := overflow.from_id IS NULL
                    AND NOT EXISTS (SELECT 1 FROM unnest(marks) AS m
                                    WHERE m.queue = queue_name AND m.concurrency_key = key
                                      AND m.from_id IS NOT NULL);
    ELSIF row_at.id IS NULL THEN
        -- Made only under the queue's lock, shared and not waited for: a change of the
        -- queue's limits, which takes it to drop the queue's rows, cannot miss a row made
        -- and not yet committed (it waits for it, as for a row another has updated).
        IF pg_try_advisory_xact_lock_shared(skiplock.internal_queue_limit_lock_id(queue_name)) THEN
            INSERT INTO skiplock.key_held_from (queue, concurrency_key, priority, scheduled_at,
                                                id)
            VALUES (queue_name, key, still_held.priority, still_held.scheduled_at, still_held.id)
            ON CONFLICT DO NOTHING;
            recorded := FOUND;
        END IF;
    ELSIF (still_held.priority, still_held.scheduled_at, still_held.id)
          = (row_at.priority, row_at.scheduled_at, row_at.id) THEN
        recorded := true;
    ELSE
        UPDATE skiplock.key_held_from f
        SET priority = still_held.priority, scheduled_at = still_held.scheduled_at,
            id = still_held.id
        WHERE f.ctid = (SELECT o.ctid FROM skiplock.key_held_from o
                        WHERE o.queue = queue_name AND o.concurrency_key = key
                        FOR UPDATE SKIP LOCKED)
          AND (f.priority, f.scheduled_at, f.id) = (row_at.priority, row_at.scheduled_at, row_at.id);
        recorded := FOUND;
    END IF;
    IF NOT recorded THEN
        INSERT INTO skiplock.key_slots_freed (queue, concurrency_key, from_priority,
                                              from_scheduled_at, from_id)
        VALUES (queue_name, key, still_held.priority, still_held.scheduled_at, still_held.id);
    END IF;
    RETURN released;
END;
$$;

--
-- Name: internal_release_freed_keys(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_release_freed_keys(queue_name text) RETURNS integer
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    freed text[];
    rows_taken int;
    marks skiplock.key_slots_freed[];
BEGIN
    WITH taken AS (
        DELETE FROM skiplock.key_slots_freed f
        WHERE f.ctid = ANY (ARRAY(SELECT o.ctid FROM skiplock.key_slots_freed o
                                  WHERE o.queue = queue_name
                                  LIMIT 1000
                                  FOR UPDATE SKIP LOCKED))
        RETURNING f.*
    )
    SELECT array_agg(DISTINCT t.concurrency_key), count(*),
           array_agg(t) FILTER (WHERE t.from_id IS NOT NULL)
    INTO freed, rows_taken, marks FROM taken t;
    IF freed IS NULL THEN
        RETURN 0;
    END IF;
    IF rows_taken >= 1000 THEN
        PERFORM skiplock.internal_notify_queue_start(queue_name);
    END IF;
    -- The rows' positions go with them (see key_held_from).
    RETURN skiplock.internal_release_held(queue_name, freed, marks);
END;
$$;

--
-- Name: internal_release_held(text, text[], skiplock.key_slots_freed[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_release_held(queue_name text, keys text[], marks skiplock.key_slots_freed[] DEFAULT NULL::skiplock.key_slots_freed[]) RETURNS integer
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    key_limit int;
    key_rate int;
    key_period interval;
    claimable int;
    released int;
    released_keys skiplock.runnable_key[];
    key text;
BEGIN
    SELECT q.key_max_running, q.key_rate_limit, q.key_rate_period
    INTO key_limit, key_rate, key_period
    FROM skiplock.queues q WHERE q.name = queue_name;
    IF key_limit IS NOT NULL OR key_rate IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(skiplock.internal_queue_limit_lock_id(queue_name));
    END IF;
    -- Again after the lock: a change committed while this waited for it holds.
    SELECT q.key_max_running, q.key_rate_limit, q.key_rate_period, q.key_claimable
    INTO key_limit, key_rate, key_period, claimable
    FROM skiplock.queues q WHERE q.name = queue_name;
    IF claimable IS NOT NULL AND key_limit IS NULL AND key_rate IS NULL AND keys IS NOT NULL THEN
        -- Fair queueing alone: each key from where its held jobs start (key_held_from).
        released := 0;
        FOR key IN SELECT DISTINCT k.key FROM unnest(keys) AS k(key)
                   WHERE k.key IS NOT NULL ORDER BY 1 LOOP
            released := released
                + skiplock.internal_release_fair_key(queue_name, key, claimable, marks);
        END LOOP;
        RETURN released;
    END IF;
    IF claimable IS NOT NULL AND keys IS NOT NULL THEN
        -- As internal_release_fair_key: a key with more than twice key_claimable queued has
        -- them held, and lets the first go again below (walked from the front here: no marks
        -- needed).
        PERFORM (skiplock.internal_hold_overflow(queue_name, k.key, claimable)).mark
        FROM (SELECT DISTINCT k.key FROM unnest(keys) AS k(key) WHERE k.key IS NOT NULL) k;
    END IF;
    WITH RECURSIVE held_keys(key) AS (
        -- With keys NULL: the first held key, then the next after each.
        (SELECT w.concurrency_key FROM skiplock.jobs_live w
         WHERE keys IS NULL AND w.queue = queue_name AND w.state = 'waiting'
           AND w.held_for IS NOT NULL
         ORDER BY w.concurrency_key LIMIT 1)
        UNION ALL
        SELECT (SELECT w.concurrency_key FROM skiplock.jobs_live w
                WHERE w.queue = queue_name AND w.state = 'waiting' AND w.held_for IS NOT NULL
                  AND w.concurrency_key > h.key
                ORDER BY w.concurrency_key LIMIT 1)
        FROM held_keys h WHERE h.key IS NOT NULL
    ), looked_at AS (
        SELECT DISTINCT k.key FROM unnest(keys) AS k(key) WHERE k.key IS NOT NULL
        UNION
        SELECT h.key FROM held_keys h WHERE h.key IS NOT NULL
    ), room AS (
        -- The lesser of what each limit leaves (NULL: no limit holds the key). Queued jobs
        -- of the key are not subtracted for the per-key limits: one no worker takes (a kind
        -- nobody handles) would keep the held ones back for good, and one of a lower
        -- priority would go before them. A claim takes the best of them all; what it cannot
        -- take it holds again. key_claimable bounds the queued jobs themselves: those at
        -- the priority of the key's most urgent held job or better.
        SELECT l.key, least(
            CASE WHEN key_limit IS NOT NULL THEN key_limit - (
                SELECT count(*) FROM (
                    SELECT FROM skiplock.jobs_live r
                    WHERE r.queue = queue_name AND r.state = 'running'
                      AND r.concurrency_key = l.key
                    LIMIT key_limit) t) END,
            skiplock.internal_rate_room(queue_name, l.key, key_rate, key_period,
                                        clock_timestamp(), key_rate),
            claimable - skiplock.internal_key_queued(queue_name, l.key, claimable)) AS room
        FROM looked_at l
    ), released AS (
        UPDATE skiplock.jobs_live j SET state = 'queued', held_for = NULL,
            -- Fair queueing: behind what is queued now, so that the keys take turns.
            scheduled_at = CASE WHEN claimable IS NOT NULL
                                THEN greatest(j.scheduled_at, now()) ELSE j.scheduled_at END
        WHERE j.ctid = ANY (ARRAY(
            SELECT h.ctid
            FROM room r
            CROSS JOIN LATERAL (
                SELECT h.ctid FROM skiplock.jobs_live h
                WHERE h.queue = queue_name AND h.state = 'waiting' AND h.held_for IS NOT NULL
                  AND h.concurrency_key = r.key
                  -- A parent retried by hand after the job was held, or an edge added by
                  -- hand: it waits for that parent, whose success queues it (a probe of
                  -- the job's edges, none for most).
                  AND NOT skiplock.internal_has_unmet_parent(h.id)
                ORDER BY h.priority, h.scheduled_at, h.id
                LIMIT r.room
                FOR UPDATE SKIP LOCKED) h
            WHERE r.room IS NULL OR r.room > 0))
        RETURNING j.queue, j.priority, j.scheduled_at
    )
    SELECT count(*), array_agg(ROW(queue, priority, scheduled_at)::skiplock.runnable_key)
    INTO released, released_keys FROM released;
    PERFORM skiplock.internal_announce(released_keys);
    RETURN released;
END;
$$;

--
-- Name: internal_release_passed_over(text, text, text, boolean); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_release_passed_over(queue text, key text, held_for text, lock_rate_window boolean) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    IF held_for = 'key' THEN
        PERFORM skiplock.internal_notify_freed(ARRAY[queue], ARRAY[key]);
    ELSIF held_for = 'fair' THEN
        PERFORM skiplock.internal_recheck_keys(ARRAY[queue], ARRAY[key]);
    ELSIF held_for = 'rate' AND lock_rate_window THEN
        PERFORM 1 FROM skiplock.rate_windows w
        WHERE w.queue = internal_release_passed_over.queue AND w.concurrency_key = key
        FOR UPDATE;
    END IF;
END;
$$;

--
-- Name: internal_release_refilled_keys(text, timestamp with time zone); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_release_refilled_keys(queue_name text, at timestamp with time zone) RETURNS integer
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    refilled text[];
BEGIN
    WITH due AS (
        UPDATE skiplock.rate_windows w SET held_until = NULL
        WHERE w.queue = queue_name AND w.held_until <= at
        RETURNING w.concurrency_key
    )
    SELECT array_agg(d.concurrency_key) INTO refilled FROM due d;
    IF refilled IS NULL THEN
        RETURN 0;
    END IF;
    RETURN skiplock.internal_release_held(queue_name, refilled);
END;
$$;

--
-- Name: internal_retry_job_once(bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_retry_job_once(job_id bigint) RETURNS boolean
    LANGUAGE plpgsql
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
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

--
-- Name: FUNCTION internal_retry_job_once(job_id bigint); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.internal_retry_job_once(job_id bigint) IS 'One attempt of skiplock.retry_job, without its retry on a deadlock or a moved row; call retry_job instead.';

--
-- Name: internal_run_job_action(text, bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_run_job_action(action text, job_id bigint) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
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

--
-- Name: internal_runnable_payload(text, smallint, timestamp with time zone); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_runnable_payload(queue text, priority smallint, scheduled_at timestamp with time zone) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT priority::text || E'\t'
        || CASE WHEN isfinite(scheduled_at)
                THEN ((extract(epoch FROM scheduled_at) * 1000000)::bigint)::text
                ELSE '-9223372036854775808' END
        || E'\t' || queue;
$$;

--
-- Name: FUNCTION internal_runnable_payload(queue text, priority smallint, scheduled_at timestamp with time zone); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.internal_runnable_payload(queue text, priority smallint, scheduled_at timestamp with time zone) IS 'Payload of a skiplock_runnable notification: where in claim order a job became runnable.';

--
-- Name: internal_save_outcomes(text, bigint[], uuid[], jsonb[], text[], interval[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_save_outcomes(outcome text, ids bigint[], tokens uuid[], outputs jsonb[], messages text[], retry_ins interval[]) RETURNS TABLE(id bigint, state text, has_dependants boolean, ordering_key text)
    LANGUAGE plpgsql
    SET jit TO 'off'
    AS $$
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
        RETURN QUERY SELECT c.id, c.state, c.has_dependants, c.ordering_key
        FROM skiplock.internal_complete_claims(ids, tokens) c;
    ELSIF outcome = 'release' THEN
        RETURN QUERY SELECT r.id, r.state, false, NULL::text
        FROM skiplock.internal_release_claims(
            ids, tokens,
            ARRAY(SELECT (extract(epoch FROM coalesce(f.delay, interval '0')) * 1000)::bigint
                  FROM unnest(ids, retry_ins) WITH ORDINALITY AS f(id, delay, n) ORDER BY f.n)) r;
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
            array_fill(outcome, ARRAY[cardinality(ids)]));
    END IF;
END;
$$;

--
-- Name: internal_save_outcomes_many(text, text, bigint[], uuid[], jsonb[], text[], interval[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_save_outcomes_many(caller text, outcome text, ids bigint[], tokens uuid[], outputs jsonb[], messages text[], retry_ins interval[]) RETURNS TABLE(id bigint, state skiplock.job_state)
    LANGUAGE plpgsql
    AS $$
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
       OR (outcome IN ('retry', 'dead')
           AND (messages IS NULL OR cardinality(messages) <> cardinality(ids))) THEN
        RAISE EXCEPTION 'skiplock.%: the arrays must have one element per claim (ids has %)',
            caller, coalesce(cardinality(ids)::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF cardinality(ids) > 1
       AND (SELECT count(c.i) <> count(DISTINCT c.i) FROM unnest(ids) AS c(i)) THEN
        RAISE EXCEPTION 'skiplock.%: a job id appears twice in ids; give each claim once', caller
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF retry_ins IS NOT NULL
       AND EXISTS (SELECT FROM unnest(retry_ins) AS r(delay) WHERE r.delay < interval '0') THEN
        RAISE EXCEPTION 'skiplock.%: a retry_in is negative; give NULL (the backoff) or zero or more', caller
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- A claim with a NULL id or token is not held: left out, and its result is NULL. One
    -- claim (complete, fail, discard, release, snooze) needs no sorting, which took about
    -- 5 % of a complete's time.
    IF cardinality(ids) > 1 THEN
        SELECT array_agg(c.i ORDER BY c.i), array_agg(c.t ORDER BY c.i), array_agg(c.o ORDER BY c.i),
               array_agg(c.m ORDER BY c.i), array_agg(c.r ORDER BY c.i)
        INTO s_ids, s_tokens, s_outputs, s_messages, s_retry_ins
        FROM unnest(ids, tokens, outputs, messages, retry_ins) AS c(i, t, o, m, r)
        WHERE c.i IS NOT NULL AND c.t IS NOT NULL;
    ELSIF ids[1] IS NOT NULL AND tokens[1] IS NOT NULL THEN
        s_ids := ids;
        s_tokens := tokens;
        s_outputs := outputs;
        s_messages := messages;
        s_retry_ins := retry_ins;
    END IF;
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
            WHEN OTHERS THEN
                IF skiplock.internal_fails_the_call(SQLSTATE) THEN
                    RAISE;
                END IF;
                FOR i IN 1 .. cardinality(s_ids) LOOP
                    BEGIN
                        SELECT * INTO one
                        FROM skiplock.internal_save_outcomes(
                            outcome, ARRAY[s_ids[i]], ARRAY[s_tokens[i]], ARRAY[s_outputs[i]],
                            ARRAY[s_messages[i]], ARRAY[s_retry_ins[i]]);
                    EXCEPTION WHEN OTHERS THEN
                        IF skiplock.internal_fails_the_call(SQLSTATE) THEN
                            RAISE;
                        END IF;
                        reason := SQLERRM;
                        BEGIN
                            SELECT * INTO one
                            FROM skiplock.internal_abandon_claims(
                                ARRAY[s_ids[i]], ARRAY[s_tokens[i]],
                                skiplock.internal_error_message(
                                    'the outcome of this attempt could not be saved: ' || reason));
                        EXCEPTION WHEN OTHERS THEN
                            IF skiplock.internal_fails_the_call(SQLSTATE) THEN
                                RAISE;
                            END IF;
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

--
-- Name: internal_set_queue_paused(text, boolean); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_set_queue_paused(queue_name text, paused boolean) RETURNS void
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM skiplock.internal_check_queue_name(queue_name);
    INSERT INTO skiplock.queues AS q (name, paused) VALUES (queue_name, internal_set_queue_paused.paused)
    ON CONFLICT (name) DO UPDATE SET paused = excluded.paused, updated_at = now();
END;
$$;

--
-- Name: internal_settle_dependants(bigint[], text[], boolean); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_settle_dependants(parent_ids bigint[], lanes text[] DEFAULT '{}'::text[], wait boolean DEFAULT true) RETURNS integer
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
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

--
-- Name: internal_settle_waiting(); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_settle_waiting() RETURNS integer
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET jit TO 'off'
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
    unheld_dependants bigint[];
    moved int := 0;
    queued_orphans int;
    orphan_keys skiplock.runnable_key[];
    held record;
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
                   array_agg(b.id) FILTER (WHERE b.ordering_key IS NULL
                                             AND (NOT b.has_edges OR b.held_for IS NOT NULL)),
                   array_agg(DISTINCT b.ordering_key) FILTER (WHERE b.ordering_key IS NOT NULL),
                   array_agg(b.id) FILTER (WHERE b.has_edges),
                   array_agg(b.id) FILTER (WHERE b.has_edges AND b.held_for IS NULL)
            INTO seen, last_id, orphans, lanes, dependants, unheld_dependants
            FROM (SELECT c.id, c.ordering_key, c.held_for,
                         EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.job_id = c.id) AS has_edges
                  FROM skiplock.jobs c
                  WHERE c.state = 'waiting' AND c.id > position
                  ORDER BY c.id
                  LIMIT batch_size) b;
            UPDATE skiplock.waiting_sweep
            SET after_id = CASE WHEN seen < batch_size THEN 0 ELSE last_id END;

            -- Waiting for nothing: no lane, no dependency row. Those held back for their
            -- keys (held_for) go only as their keys have room, through
            -- internal_release_held, also when they have dependency rows (children held
            -- after their parents succeeded: queued as dependants, a key's held children
            -- all went at once); the others (written waiting by hand) are queued, where
            -- the claim holds them back if their key is full.
            IF orphans IS NOT NULL THEN
                WITH queued AS (
                    UPDATE skiplock.jobs c SET state = 'queued'
                    WHERE c.id = ANY (orphans) AND c.state = 'waiting' AND c.ordering_key IS NULL
                      AND c.held_for IS NULL
                      AND NOT EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.job_id = c.id)
                    RETURNING c.queue, c.priority, c.scheduled_at
                )
                SELECT count(*), array_agg(ROW(queue, priority, scheduled_at)::skiplock.runnable_key)
                INTO queued_orphans, orphan_keys FROM queued;
                PERFORM skiplock.internal_announce(orphan_keys);
                moved := queued_orphans;
                -- Each held one is also a mark of where its key's held jobs start (see
                -- key_held_from): a job held by a write of no hold of skiplock's (by hand)
                -- is walked to within a lap of the sweep.
                FOR held IN
                    SELECT c.queue, array_agg(DISTINCT c.concurrency_key) AS keys,
                           array_agg(ROW(c.queue, c.concurrency_key, c.priority, c.scheduled_at,
                                         c.id)::skiplock.key_slots_freed) AS marks
                    FROM skiplock.jobs_live c
                    WHERE c.id = ANY (orphans) AND c.state = 'waiting'
                      AND c.held_for IS NOT NULL
                    GROUP BY c.queue
                    ORDER BY skiplock.internal_queue_limit_lock_id(c.queue)
                LOOP
                    moved := moved + skiplock.internal_release_held(held.queue, held.keys,
                                                                    held.marks);
                END LOOP;
            END IF;
            -- Jobs of the batch whose parents all succeeded (or were pruned after) are queued;
            -- those with a parent that can never succeed are cancelled with that parent's other
            -- waiting dependants (their cost: the failed parents' edges, each cancelling a job).
            -- Not the held ones: they went through the release of held jobs above. (They
            -- stay among the dependants whose failed parents cancel them, below.)
            IF unheld_dependants IS NOT NULL THEN
                moved := moved
                    + (skiplock.internal_queue_ready_dependants(unheld_dependants, '{}')).promoted;
            END IF;
            -- Then the batch's lanes (each head is one index entry, and the queued ones
            -- are announced in one message per queue and priority) and those of the jobs
            -- cancelled, in one step: only those whose lock is free (wait false), as a
            -- lane an enqueue holds is moved on by the step of its last job (which waits
            -- for that enqueue), else by the next lap; the sweep never waits for an
            -- application's open transaction.
            -- Each parent of the batch looked up once, however many of its children wait.
            moved := moved + skiplock.internal_settle_dependants(ARRAY(
                SELECT e.parent_id
                FROM (SELECT d.parent_id, bool_or(d.parent_state IS NOT NULL) AS tombstoned
                      FROM skiplock.job_dependencies d
                      WHERE d.job_id = ANY (coalesce(dependants, '{}'))
                      GROUP BY d.parent_id) e
                CROSS JOIN LATERAL (SELECT skiplock.internal_job_state(e.parent_id) AS state
                                    OFFSET 0) p
                WHERE p.state IN ('dead', 'cancelled') OR (p.state IS NULL AND e.tombstoned)),
                coalesce(lanes, '{}'), false);
            -- Per-key rate windows that count nothing any more go, and freed key slots no
            -- claim will read (a bounded batch). Last, and skipping the rows a claim holds:
            -- such a claim holds its queue's lock, which this pass may hold by now.
            PERFORM skiplock.internal_forget_key_limit_rows();
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

--
-- Name: internal_stale_claims(bigint, bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_stale_claims(stale_after_ms bigint, max_jobs bigint) RETURNS TABLE(id bigint, claim_token uuid)
    LANGUAGE sql
    SET jit TO 'off'
    AS $$
    SELECT j.id, j.claim_token FROM skiplock.jobs_live j
    WHERE j.state = 'running'
      AND (j.heartbeat_at < now() - stale_after_ms * interval '1 millisecond'
           OR (j.heartbeat_at > now() + stale_after_ms * interval '1 millisecond'
               AND j.heartbeat_at > clock_timestamp() + stale_after_ms * interval '1 millisecond'))
    ORDER BY j.heartbeat_at
    LIMIT max_jobs;
$$;

--
-- Name: internal_superseded_message(bigint, text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_superseded_message(holder bigint, key text) RETURNS text
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT format('superseded: pending job %s holds unique_key %s and runs instead', holder, key);
$$;

--
-- Name: internal_take_claim_share(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_take_claim_share(queue_name text) RETURNS void
    LANGUAGE plpgsql
    AS $$
DECLARE
    shares int := skiplock.internal_claim_shares();
    first int := pg_backend_pid() % skiplock.internal_claim_shares();
BEGIN
    FOR i IN 0 .. shares - 1 LOOP
        IF pg_try_advisory_xact_lock(
               skiplock.internal_claim_share_lock_id(queue_name, (first + i) % shares)) THEN
            RETURN;
        END IF;
    END LOOP;
    PERFORM pg_advisory_xact_lock(skiplock.internal_claim_share_lock_id(queue_name, first));
END;
$$;

--
-- Name: internal_take_every_claim_share(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_take_every_claim_share(queue_name text) RETURNS void
    LANGUAGE plpgsql
    AS $$
BEGIN
    FOR i IN 0 .. skiplock.internal_claim_shares() - 1 LOOP
        PERFORM pg_advisory_xact_lock(skiplock.internal_claim_share_lock_id(queue_name, i));
    END LOOP;
END;
$$;

--
-- Name: internal_taken_in_flight(xid, xid[], bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_taken_in_flight(row_xmax xid, in_flight xid[], next_xid bigint) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT row_xmax <> '0'::xid
       AND (row_xmax = ANY (in_flight)
            OR (row_xmax::text::bigint - next_xid + 4294967296) % 4294967296 < 1048576);
$$;

--
-- Name: internal_tombstone_now(bigint, bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_tombstone_now(job bigint, parent bigint) RETURNS skiplock.job_state
    LANGUAGE sql
    SET jit TO 'off'
    AS $$
    SELECT d.parent_state FROM skiplock.job_dependencies d
    WHERE d.job_id = job AND d.parent_id = parent;
$$;

--
-- Name: internal_tombstone_parents(bigint[], skiplock.job_state[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_tombstone_parents(parents bigint[], states skiplock.job_state[]) RETURNS void
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
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

--
-- Name: internal_try_lock_unique_key(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_try_lock_unique_key(key text) RETURNS boolean
    LANGUAGE plpgsql COST 10000
    AS $$
BEGIN
    RETURN pg_try_advisory_xact_lock(skiplock.internal_unique_key_lock_id(key));
END;
$$;

--
-- Name: internal_unique_key_holder(text, bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_unique_key_holder(key text, self bigint) RETURNS bigint
    LANGUAGE plpgsql
    SET jit TO 'off'
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

--
-- Name: internal_unique_key_lock_id(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.internal_unique_key_lock_id(key text) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT hashtextextended('skiplock.unique:' || key, 0);
$$;

--
-- Name: left_behind(text[], text[]); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.left_behind(queues text[], kinds text[] DEFAULT NULL::text[]) RETURNS text
    LANGUAGE sql STABLE
    SET jit TO 'off'
    AS $$
    WITH paused AS (
        SELECT coalesce(array_agg(p.name ORDER BY p.name), '{}') AS names
        FROM skiplock.queues p WHERE p.name = ANY (queues) AND p.paused
    ), counted AS (
        SELECT p.names,
               count(j.id) FILTER (WHERE j.queue = ANY (p.names)) AS in_paused,
               count(j.id) FILTER (WHERE j.queue <> ALL (p.names) AND j.attempt > 0
                                     AND j.state = 'queued' AND j.scheduled_at > now()) AS retrying,
               count(j.id) FILTER (WHERE j.queue <> ALL (p.names) AND j.attempt = 0
                                     AND j.state = 'queued' AND j.scheduled_at > now()) AS later,
               min(j.scheduled_at) FILTER (WHERE j.queue <> ALL (p.names)
                                             AND j.state = 'queued') AS next_due
        FROM paused p
        LEFT JOIN skiplock.jobs_live j
          ON j.queue = ANY (queues) AND (kinds IS NULL OR j.kind = ANY (kinds))
         AND (j.state = 'queued' OR (j.state = 'waiting' AND j.held_for IS NOT NULL))
        GROUP BY p.names
    )
    SELECT 'left behind: ' || concat_ws('; ',
        CASE WHEN in_paused > 0 THEN
            format('%s job%s in paused queue%s %s (resume: %s)',
                   in_paused, CASE WHEN in_paused = 1 THEN '' ELSE 's' END,
                   CASE WHEN cardinality(names) = 1 THEN '' ELSE 's' END,
                   array_to_string(names, ', '),
                   CASE WHEN cardinality(names) = 1
                        THEN format('skiplock queue resume %s, or SELECT skiplock.resume_queue(%L)',
                                    names[1], names[1])
                        ELSE 'skiplock queue resume NAME, or SELECT skiplock.resume_queue(NAME)'
                   END)
        END,
        CASE WHEN retrying > 0 THEN
            format('%s job%s waiting out a retry''s backoff or a snooze', retrying,
                   CASE WHEN retrying = 1 THEN '' ELSE 's' END)
        END,
        CASE WHEN later > 0 THEN
            format('%s job%s scheduled later', later, CASE WHEN later = 1 THEN '' ELSE 's' END)
        END,
        CASE WHEN retrying + later > 0 THEN
            format('the next due in %s', date_trunc('second', next_due - now()))
        END)
    FROM counted
    WHERE in_paused + retrying + later > 0;
$$;

--
-- Name: FUNCTION left_behind(queues text[], kinds text[]); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.left_behind(queues text[], kinds text[]) IS 'The line a worker of these queues and kinds (NULL: every kind) prints when it exits idle, or NULL when nothing is left: jobs of a paused queue, jobs waiting out a retry''s backoff or a snooze, jobs scheduled later, and when the next is due. Example: SELECT skiplock.left_behind(ARRAY[''mail''], NULL);';

--
-- Name: maintain(interval); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.maintain(stale_after interval DEFAULT '00:00:30'::interval) RETURNS TABLE(reaped bigint, moved_on bigint, cron_enqueued bigint)
    LANGUAGE plpgsql
    AS $$
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

--
-- Name: FUNCTION maintain(stale_after interval); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.maintain(stale_after interval) IS 'Takes back running jobs whose `heartbeat_at` is older than `stale_after` (their worker crashed or hung): `queued` with backoff, or `dead` when their attempts are spent, the reason (which worker went quiet) in `last_error`. Then settles the dependants and lanes of what finished, makes the next days'' tables of finished jobs when missing, sweeps the next 500 waiting jobs (in id order, from where the last call of any session stopped: a waiting job that a race left behind moves on within one lap of the waiting jobs), and enqueues the job of each due cron slot. Returns how many it took back, moved on and enqueued. Its cost follows that work, not how many jobs wait or how many finished ones the table keeps (docs/benchmarks.md). Safe from many sessions at once: each stale job is taken back once, each cron slot enqueued once. A job that cannot be taken back (a trigger of yours refuses the change) never stops the others: it goes `dead` with the reason in `last_error`, or, when even that is refused, stays as it is and a warning names it.';

--
-- Name: pause_queue(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.pause_queue(queue_name text) RETURNS void
    LANGUAGE sql
    AS $$
    SELECT skiplock.internal_set_queue_paused(queue_name, true);
$$;

--
-- Name: FUNCTION pause_queue(queue_name text); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.pause_queue(queue_name text) IS 'Stops every worker from claiming from the queue (the row in `skiplock.queues`, made if missing); running jobs finish. Example: SELECT skiplock.pause_queue(''mail'');';

--
-- Name: release(bigint, uuid); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.release(id bigint, token uuid) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
BEGIN
    RETURN (SELECT s.state IS NOT NULL
            FROM skiplock.internal_save_outcomes_many('release', 'release', ARRAY[release.id],
                                                      ARRAY[release.token], NULL, NULL,
                                                      ARRAY[interval '0']) s);
END;
$$;

--
-- Name: FUNCTION release(id bigint, token uuid); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.release(id bigint, token uuid) IS 'Gives a claimed job back: `queued` at once, in its place in line, its attempt not counted. For jobs claimed but not started when the worker stops. `false`: the claim was not held, nothing changed. A row that refuses the change goes `dead` with the reason, as in `complete_many`.';

--
-- Name: resume_queue(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.resume_queue(queue_name text) RETURNS void
    LANGUAGE sql
    AS $$
    SELECT skiplock.internal_set_queue_paused(queue_name, false);
$$;

--
-- Name: FUNCTION resume_queue(queue_name text); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.resume_queue(queue_name text) IS 'Lets workers claim from the queue again, and wakes them. Example: SELECT skiplock.resume_queue(''mail'');';

--
-- Name: retry_dead_jobs(text); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.retry_dead_jobs(queue_name text DEFAULT NULL::text) RETURNS SETOF bigint
    LANGUAGE plpgsql
    SET jit TO 'off'
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

--
-- Name: FUNCTION retry_dead_jobs(queue_name text); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.retry_dead_jobs(queue_name text) IS '`retry_job` for every dead job of a queue (NULL: of every queue); returns the ids retried. A dead job whose `unique_key` another pending job holds is superseded by it and counts as retried. A job that cannot be retried at all (a trigger of yours refuses it) is left dead with a warning, and the others go on. Example: SELECT count(*) FROM skiplock.retry_dead_jobs(''mail'');';

--
-- Name: retry_job(bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.retry_job(job_id bigint) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
BEGIN
    RETURN skiplock.internal_run_job_action('retry', job_id);
END;
$$;

--
-- Name: FUNCTION retry_job(job_id bigint); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.retry_job(job_id bigint) IS 'Puts a finished job (dead, cancelled or succeeded) back in line, due now, with an attempt to spare (a queued job is made due now): `queued`, or `waiting` behind an unfinished job of its lane or a parent that has not succeeded. A job whose `unique_key` another pending job holds is superseded by it (it ends `cancelled` naming that job; under the policy `merge` its payloads are merged in first). Returns true if it was put back in line, false for a running or waiting job or no such job. Example: SELECT skiplock.retry_job(42);';

--
-- Name: set_queue_limits(text, integer, integer, interval, integer, integer, interval, integer); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.set_queue_limits(queue_name text, max_running integer, rate_limit integer DEFAULT NULL::integer, rate_period interval DEFAULT NULL::interval, key_max_running integer DEFAULT NULL::integer, key_rate_limit integer DEFAULT NULL::integer, key_rate_period interval DEFAULT NULL::interval, key_claimable integer DEFAULT NULL::integer) RETURNS void
    LANGUAGE plpgsql
    AS $$
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

--
-- Name: FUNCTION set_queue_limits(queue_name text, max_running integer, rate_limit integer, rate_period interval, key_max_running integer, key_rate_limit integer, key_rate_period interval, key_claimable integer); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.set_queue_limits(queue_name text, max_running integer, rate_limit integer, rate_period interval, key_max_running integer, key_rate_limit integer, key_rate_period interval, key_claimable integer) IS 'Sets a queue''s global limits across every worker (NULL: none): max_running jobs at once, rate_limit starts per rate_period, per concurrency_key key_max_running jobs at once and key_rate_limit starts per key_rate_period, and fair queueing by key: at most key_claimable due jobs of one key queued at once, the keys taking turns. Example: SELECT skiplock.set_queue_limits(''exports'', max_running => 5); SELECT skiplock.set_queue_limits(''mail'', NULL, 100, ''1 second''); SELECT skiplock.set_queue_limits(''reports'', NULL, key_max_running => 2, key_rate_limit => 10, key_rate_period => ''1 minute''); SELECT skiplock.set_queue_limits(''tenants'', NULL, key_claimable => 32);';

--
-- Name: snooze(bigint, uuid, interval); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.snooze(id bigint, token uuid, delay interval) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF delay IS NULL OR delay < interval '0' THEN
        RAISE EXCEPTION 'skiplock.snooze: delay is %, it must be an interval of zero or more',
            coalesce(delay::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- At least a millisecond: a delay of zero would keep the job's place in line, as a
    -- release does, instead of putting it at the back of what is due now.
    RETURN (SELECT s.state IS NOT NULL
            FROM skiplock.internal_save_outcomes_many(
                'snooze', 'release', ARRAY[snooze.id], ARRAY[snooze.token], NULL, NULL,
                ARRAY[greatest(delay, interval '1 millisecond')]) s);
END;
$$;

--
-- Name: FUNCTION snooze(id bigint, token uuid, delay interval); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.snooze(id bigint, token uuid, delay interval) IS '`queued` again after `delay`, the attempt not counted: for a handler that must wait for something. `false`: the claim was not held, nothing changed. A row that refuses the change goes `dead` with the reason, as in `complete_many`.';

--
-- Name: watch_job(bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.watch_job(job_id bigint) RETURNS TABLE(id bigint, state skiplock.job_state, attempt integer, output jsonb, last_error text, finished_at timestamp with time zone)
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    attempts int := 0;
    live record;
    ended record;
BEGIN
    LOOP
        BEGIN
            UPDATE skiplock.jobs_live j SET awaited = true
            WHERE j.id = watch_job.job_id AND j.awaited IS NOT TRUE
            RETURNING j.id, j.state, j.attempt, j.queue, j.priority, j.scheduled_at,
                      j.held_for, j.concurrency_key
            INTO live;
            IF NOT FOUND THEN
                -- Awaited already, or not live: live jobs first (see "A job looked up by
                -- id through skiplock.jobs" in 15_partitions.sql), then the finished ones.
                SELECT j.id, j.state, j.attempt, j.queue, j.priority, j.scheduled_at,
                       j.held_for, j.concurrency_key
                INTO live
                FROM skiplock.jobs_live j WHERE j.id = watch_job.job_id;
            END IF;
            IF live.id IS NOT NULL THEN
                IF live.state = 'queued' THEN
                    PERFORM skiplock.internal_announce(ARRAY[
                        (live.queue, live.priority, live.scheduled_at)::skiplock.runnable_key]);
                ELSIF live.held_for IS NOT NULL THEN
                    PERFORM skiplock.internal_release_passed_over(live.queue,
                                                                  live.concurrency_key,
                                                                  live.held_for, true);
                END IF;
                RETURN QUERY SELECT live.id, live.state, live.attempt, NULL::jsonb,
                                    NULL::text, NULL::timestamptz;
                RETURN;
            END IF;
            SELECT j.id, j.state, j.attempt, j.output, j.last_error, j.finished_at INTO ended
            FROM skiplock.internal_finished_job(watch_job.job_id) j;
            IF ended.state IN ('waiting', 'queued', 'running') THEN
                -- Back to a live state since the look above (retried): marked there.
                CONTINUE;
            END IF;
            IF ended.id IS NOT NULL THEN
                -- A finished row written by hand may lack its time; finished all the same.
                RETURN QUERY SELECT ended.id, ended.state, ended.attempt, ended.output,
                                    ended.last_error, coalesce(ended.finished_at, '-infinity');
            END IF;
            RETURN;
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

--
-- Name: FUNCTION watch_job(job_id bigint); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.watch_job(job_id bigint) IS 'Marks the job awaited, so that it notifies skiplock_finished with its id when it finishes, and returns where it stands: finished_at set once it finished (succeeded with output, dead with last_error, cancelled); no row when it does not exist. LISTEN skiplock_finished before calling it, and call it again at each notification of the id.';

--
-- Name: why_not_running(bigint); Type: FUNCTION; Schema: skiplock; Owner: -
--

CREATE FUNCTION skiplock.why_not_running(job_id bigint) RETURNS text
    LANGUAGE plpgsql STABLE
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
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

--
-- Name: FUNCTION why_not_running(job_id bigint); Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON FUNCTION skiplock.why_not_running(job_id bigint) IS 'Why a job that has not finished is not running now, in words: its lane, its parents, its schedule, a paused queue, a global limit, or waiting for a worker (NULL for a running or finished job). Example: SELECT skiplock.why_not_running(42);';

--
-- Name: internal_job_history_array_sum(bigint[]); Type: AGGREGATE; Schema: skiplock; Owner: -
--

CREATE AGGREGATE skiplock.internal_job_history_array_sum(bigint[]) (
    SFUNC = skiplock.internal_job_history_array_add,
    STYPE = bigint[],
    INITCOND = '{}'
);

--
-- Name: cron_schedules; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.cron_schedules (
    name text NOT NULL,
    expression text NOT NULL,
    timezone text DEFAULT 'UTC'::text NOT NULL,
    kind text NOT NULL,
    args jsonb DEFAULT '{}'::jsonb NOT NULL,
    queue text DEFAULT 'default'::text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    max_attempts integer DEFAULT 25 NOT NULL,
    missed text DEFAULT 'latest'::text NOT NULL,
    enabled boolean DEFAULT true NOT NULL,
    last_slot_at timestamp with time zone DEFAULT now() NOT NULL,
    last_job_id bigint,
    last_error text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT cron_schedules_kind_not_empty CHECK ((kind <> ''::text)),
    CONSTRAINT cron_schedules_max_attempts_positive CHECK ((max_attempts >= 1)),
    CONSTRAINT cron_schedules_missed_known CHECK ((missed = ANY (ARRAY['latest'::text, 'skip'::text]))),
    CONSTRAINT cron_schedules_queue_name_length CHECK ((octet_length(queue) <= 1000)),
    CONSTRAINT cron_schedules_queue_not_empty CHECK ((queue <> ''::text))
);

--
-- Name: TABLE cron_schedules; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON TABLE skiplock.cron_schedules IS 'Named cron schedules: each slot of a schedule enqueues exactly one job, whoever fires it first.';

--
-- Name: COLUMN cron_schedules.name; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.name IS 'The schedule''s name.';

--
-- Name: COLUMN cron_schedules.expression; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.expression IS 'Cron expression: five fields (minute hour day-of-month month day-of-week), or six with seconds first (the syntax: src/cron.rs).';

--
-- Name: COLUMN cron_schedules.timezone; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.timezone IS 'IANA time zone the expression is read in.';

--
-- Name: COLUMN cron_schedules.kind; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.kind IS 'The kind of each slot''s job.';

--
-- Name: COLUMN cron_schedules.args; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.args IS 'The args of each slot''s job.';

--
-- Name: COLUMN cron_schedules.queue; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.queue IS 'The queue of each slot''s job.';

--
-- Name: COLUMN cron_schedules.priority; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.priority IS 'The priority of each slot''s job.';

--
-- Name: COLUMN cron_schedules.max_attempts; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.max_attempts IS 'The attempt budget of each slot''s job.';

--
-- Name: COLUMN cron_schedules.missed; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.missed IS 'Slots missed while no worker ran: latest = run the most recent missed slot once; skip = run none of them.';

--
-- Name: COLUMN cron_schedules.enabled; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.enabled IS 'false: the schedule enqueues nothing.';

--
-- Name: COLUMN cron_schedules.last_slot_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.last_slot_at IS 'Slots up to and including this instant are done (enqueued or deliberately skipped).';

--
-- Name: COLUMN cron_schedules.last_job_id; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.last_job_id IS 'The job the last slot enqueued.';

--
-- Name: COLUMN cron_schedules.last_error; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.last_error IS 'Why the last slot could not enqueue its job, until one does.';

--
-- Name: COLUMN cron_schedules.created_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.created_at IS 'When the schedule was made.';

--
-- Name: COLUMN cron_schedules.updated_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.cron_schedules.updated_at IS 'When the schedule was last changed.';

--
-- Name: dead_jobs; Type: VIEW; Schema: skiplock; Owner: -
--

CREATE VIEW skiplock.dead_jobs AS
 SELECT jobs.id,
    jobs.queue,
    jobs.kind,
    jobs.args,
    jobs.attempt,
    jobs.max_attempts,
    jobs.last_error,
    jobs.errors,
    jobs.created_at,
    jobs.finished_at
   FROM skiplock.jobs
  WHERE (jobs.state = 'dead'::skiplock.job_state)
  ORDER BY jobs.finished_at DESC, jobs.id DESC;

--
-- Name: VIEW dead_jobs; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON VIEW skiplock.dead_jobs IS 'Dead jobs with their last error, newest first. Example: SELECT id, kind, last_error FROM skiplock.dead_jobs LIMIT 20;';

--
-- Name: job_dependencies; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.job_dependencies (
    job_id bigint NOT NULL,
    parent_id bigint NOT NULL,
    parent_state skiplock.job_state,
    CONSTRAINT job_dependencies_not_self CHECK ((job_id <> parent_id)),
    CONSTRAINT job_dependencies_tombstone_unfinished CHECK ((parent_state IS DISTINCT FROM 'succeeded'::skiplock.job_state))
);

--
-- Name: TABLE job_dependencies; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON TABLE skiplock.job_dependencies IS 'Edges of the dependency graph: job_id runs only after parent_id succeeded. An edge whose parent row is gone is satisfied when parent_state is NULL (the parent succeeded and was pruned) and never satisfied when parent_state is set (the parent was deleted in that state before it succeeded).';

--
-- Name: COLUMN job_dependencies.job_id; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_dependencies.job_id IS 'The child: it waits until every parent succeeded.';

--
-- Name: COLUMN job_dependencies.parent_id; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_dependencies.parent_id IS 'A parent of job_id.';

--
-- Name: COLUMN job_dependencies.parent_state; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_dependencies.parent_state IS 'NULL while the parent exists or after it was deleted as succeeded; the parent''s state when it was deleted before it succeeded (written by skiplock, never by hand).';

--
-- Name: job_history; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.job_history (
    bucket timestamp with time zone NOT NULL,
    queue text NOT NULL,
    kind text NOT NULL,
    succeeded bigint DEFAULT 0 NOT NULL,
    failed bigint DEFAULT 0 NOT NULL,
    dead bigint DEFAULT 0 NOT NULL,
    cancelled bigint DEFAULT 0 NOT NULL,
    run_count bigint DEFAULT 0 NOT NULL,
    run_seconds double precision DEFAULT 0 NOT NULL,
    wait_count bigint DEFAULT 0 NOT NULL,
    wait_seconds double precision DEFAULT 0 NOT NULL,
    run_histogram bigint[] DEFAULT '{}'::bigint[] NOT NULL
);

--
-- Name: TABLE job_history; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON TABLE skiplock.job_history IS 'Hourly (UTC) numbers of pruned jobs per queue and kind; bucket -infinity holds everything older than the retention. Live (not yet pruned) jobs are not in it.';

--
-- Name: COLUMN job_history.bucket; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_history.bucket IS 'The hour (UTC) the numbers are for; -infinity folds everything older than the retention.';

--
-- Name: COLUMN job_history.queue; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_history.queue IS 'The jobs'' queue.';

--
-- Name: COLUMN job_history.kind; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_history.kind IS 'The jobs'' kind.';

--
-- Name: COLUMN job_history.succeeded; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_history.succeeded IS 'Jobs that succeeded in the hour (by finished_at).';

--
-- Name: COLUMN job_history.failed; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_history.failed IS 'Failed attempts (entries of the jobs'' errors lists), in the hour each failure happened.';

--
-- Name: COLUMN job_history.dead; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_history.dead IS 'Jobs that went dead in the hour.';

--
-- Name: COLUMN job_history.cancelled; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_history.cancelled IS 'Jobs cancelled in the hour.';

--
-- Name: COLUMN job_history.run_count; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_history.run_count IS 'Succeeded and dead jobs whose run time (finished_at - claimed_at, the last attempt) is counted.';

--
-- Name: COLUMN job_history.run_seconds; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_history.run_seconds IS 'Their run times summed, in seconds.';

--
-- Name: COLUMN job_history.wait_count; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_history.wait_count IS 'Succeeded and dead jobs whose wait (claimed_at - scheduled_at: due until claimed) is counted.';

--
-- Name: COLUMN job_history.wait_seconds; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_history.wait_seconds IS 'Their waits summed, in seconds.';

--
-- Name: COLUMN job_history.run_histogram; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_history.run_histogram IS 'Run times counted per interval of skiplock.internal_job_history_run_bounds() (16 bounds, 17 elements): element 1 counts run times under bounds[1], element i+1 those from bounds[i] up to bounds[i+1], element 17 those from bounds[16] on.';

--
-- Name: job_id_days; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.job_id_days (
    day date NOT NULL,
    id_reached bigint NOT NULL
);

--
-- Name: TABLE job_id_days; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON TABLE skiplock.job_id_days IS 'Internal (finished jobs by day): the greatest job id handed out when skiplock first saw each UTC day, from which a lookup of a finished job by id reads the days.';

--
-- Name: COLUMN job_id_days.day; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_id_days.day IS 'A UTC day.';

--
-- Name: COLUMN job_id_days.id_reached; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.job_id_days.id_reached IS 'The greatest job id handed out when skiplock first saw the day (0: none yet): a job with a greater id finished that day or after, unless its finished_at was written by hand.';

--
-- Name: jobs_done; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.jobs_done (
    id bigint NOT NULL,
    queue text DEFAULT 'default'::text NOT NULL,
    kind text NOT NULL,
    args jsonb DEFAULT '{}'::jsonb NOT NULL,
    state skiplock.job_state DEFAULT 'queued'::skiplock.job_state NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    scheduled_at timestamp with time zone DEFAULT now() NOT NULL,
    attempt integer DEFAULT 0 NOT NULL,
    max_attempts integer DEFAULT 25 NOT NULL,
    claim_token uuid,
    claimed_by text,
    claimed_at timestamp with time zone,
    heartbeat_at timestamp with time zone,
    ordering_key text,
    unique_key text,
    last_error text,
    errors jsonb DEFAULT '[]'::jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    unique_policy text,
    progress jsonb,
    output jsonb,
    concurrency_key text,
    held_for text,
    awaited boolean,
    traceparent text,
    tracestate text,
    CONSTRAINT jobs_attempt_not_negative CHECK ((attempt >= 0)),
    CONSTRAINT jobs_claim_token_only_running CHECK (((claim_token IS NULL) OR (state = 'running'::skiplock.job_state))),
    CONSTRAINT jobs_concurrency_key_not_empty CHECK ((concurrency_key <> ''::text)),
    CONSTRAINT jobs_held_for_known CHECK ((held_for = ANY (ARRAY['key'::text, 'rate'::text, 'fair'::text]))),
    CONSTRAINT jobs_held_for_only_waiting CHECK (((held_for IS NULL) OR (state = 'waiting'::skiplock.job_state))),
    CONSTRAINT jobs_kind_not_empty CHECK ((kind <> ''::text)),
    CONSTRAINT jobs_max_attempts_positive CHECK ((max_attempts >= 1)),
    CONSTRAINT jobs_queue_name_length CHECK ((octet_length(queue) <= 1000)),
    CONSTRAINT jobs_queue_not_empty CHECK ((queue <> ''::text)),
    CONSTRAINT jobs_running_has_claim CHECK (((state <> 'running'::skiplock.job_state) OR ((claim_token IS NOT NULL) AND (heartbeat_at IS NOT NULL)))),
    CONSTRAINT jobs_traceparent_length CHECK ((octet_length(traceparent) <= 512)),
    CONSTRAINT jobs_tracestate_length CHECK ((octet_length(tracestate) <= 8192)),
    CONSTRAINT jobs_unique_policy_known CHECK ((unique_policy = ANY (ARRAY['skip'::text, 'replace'::text, 'merge'::text])))
)
PARTITION BY RANGE (state, finished_at);

--
-- Name: jobs_done_default; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.jobs_done_default (
    id bigint NOT NULL,
    queue text DEFAULT 'default'::text NOT NULL,
    kind text NOT NULL,
    args jsonb DEFAULT '{}'::jsonb NOT NULL,
    state skiplock.job_state DEFAULT 'queued'::skiplock.job_state NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    scheduled_at timestamp with time zone DEFAULT now() NOT NULL,
    attempt integer DEFAULT 0 NOT NULL,
    max_attempts integer DEFAULT 25 NOT NULL,
    claim_token uuid,
    claimed_by text,
    claimed_at timestamp with time zone,
    heartbeat_at timestamp with time zone,
    ordering_key text,
    unique_key text,
    last_error text,
    errors jsonb DEFAULT '[]'::jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    unique_policy text,
    progress jsonb,
    output jsonb,
    concurrency_key text,
    held_for text,
    awaited boolean,
    traceparent text,
    tracestate text,
    CONSTRAINT jobs_attempt_not_negative CHECK ((attempt >= 0)),
    CONSTRAINT jobs_claim_token_only_running CHECK (((claim_token IS NULL) OR (state = 'running'::skiplock.job_state))),
    CONSTRAINT jobs_concurrency_key_not_empty CHECK ((concurrency_key <> ''::text)),
    CONSTRAINT jobs_held_for_known CHECK ((held_for = ANY (ARRAY['key'::text, 'rate'::text, 'fair'::text]))),
    CONSTRAINT jobs_held_for_only_waiting CHECK (((held_for IS NULL) OR (state = 'waiting'::skiplock.job_state))),
    CONSTRAINT jobs_kind_not_empty CHECK ((kind <> ''::text)),
    CONSTRAINT jobs_max_attempts_positive CHECK ((max_attempts >= 1)),
    CONSTRAINT jobs_queue_name_length CHECK ((octet_length(queue) <= 1000)),
    CONSTRAINT jobs_queue_not_empty CHECK ((queue <> ''::text)),
    CONSTRAINT jobs_running_has_claim CHECK (((state <> 'running'::skiplock.job_state) OR ((claim_token IS NOT NULL) AND (heartbeat_at IS NOT NULL)))),
    CONSTRAINT jobs_traceparent_length CHECK ((octet_length(traceparent) <= 512)),
    CONSTRAINT jobs_tracestate_length CHECK ((octet_length(tracestate) <= 8192)),
    CONSTRAINT jobs_unique_policy_known CHECK ((unique_policy = ANY (ARRAY['skip'::text, 'replace'::text, 'merge'::text])))
);

--
-- Name: jobs_id_seq; Type: SEQUENCE; Schema: skiplock; Owner: -
--

ALTER TABLE skiplock.jobs ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME skiplock.jobs_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

--
-- Name: jobs_live; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.jobs_live (
    id bigint DEFAULT skiplock.internal_next_job_id() NOT NULL,
    queue text DEFAULT 'default'::text NOT NULL,
    kind text NOT NULL,
    args jsonb DEFAULT '{}'::jsonb NOT NULL,
    state skiplock.job_state DEFAULT 'queued'::skiplock.job_state NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    scheduled_at timestamp with time zone DEFAULT now() NOT NULL,
    attempt integer DEFAULT 0 NOT NULL,
    max_attempts integer DEFAULT 25 NOT NULL,
    claim_token uuid,
    claimed_by text,
    claimed_at timestamp with time zone,
    heartbeat_at timestamp with time zone,
    ordering_key text,
    unique_key text,
    last_error text,
    errors jsonb DEFAULT '[]'::jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    unique_policy text,
    progress jsonb,
    output jsonb,
    concurrency_key text,
    held_for text,
    awaited boolean,
    traceparent text,
    tracestate text,
    CONSTRAINT jobs_attempt_not_negative CHECK ((attempt >= 0)),
    CONSTRAINT jobs_claim_token_only_running CHECK (((claim_token IS NULL) OR (state = 'running'::skiplock.job_state))),
    CONSTRAINT jobs_concurrency_key_not_empty CHECK ((concurrency_key <> ''::text)),
    CONSTRAINT jobs_held_for_known CHECK ((held_for = ANY (ARRAY['key'::text, 'rate'::text, 'fair'::text]))),
    CONSTRAINT jobs_held_for_only_waiting CHECK (((held_for IS NULL) OR (state = 'waiting'::skiplock.job_state))),
    CONSTRAINT jobs_kind_not_empty CHECK ((kind <> ''::text)),
    CONSTRAINT jobs_max_attempts_positive CHECK ((max_attempts >= 1)),
    CONSTRAINT jobs_queue_name_length CHECK ((octet_length(queue) <= 1000)),
    CONSTRAINT jobs_queue_not_empty CHECK ((queue <> ''::text)),
    CONSTRAINT jobs_running_has_claim CHECK (((state <> 'running'::skiplock.job_state) OR ((claim_token IS NOT NULL) AND (heartbeat_at IS NOT NULL)))),
    CONSTRAINT jobs_traceparent_length CHECK ((octet_length(traceparent) <= 512)),
    CONSTRAINT jobs_tracestate_length CHECK ((octet_length(tracestate) <= 8192)),
    CONSTRAINT jobs_unique_policy_known CHECK ((unique_policy = ANY (ARRAY['skip'::text, 'replace'::text, 'merge'::text])))
)
WITH (autovacuum_vacuum_scale_factor='0.02', autovacuum_analyze_scale_factor='0.02');

--
-- Name: key_held_from; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.key_held_from (
    queue text NOT NULL,
    concurrency_key text NOT NULL,
    priority smallint NOT NULL,
    scheduled_at timestamp with time zone NOT NULL,
    id bigint NOT NULL
)
WITH (fillfactor='50');

--
-- Name: TABLE key_held_from; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON TABLE skiplock.key_held_from IS 'Internal (key_claimable): where a key''s held jobs start in claim order, at the earliest, for the walks that let them go.';

--
-- Name: COLUMN key_held_from.queue; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.key_held_from.queue IS 'The queue with key_claimable.';

--
-- Name: COLUMN key_held_from.concurrency_key; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.key_held_from.concurrency_key IS 'The key.';

--
-- Name: COLUMN key_held_from.priority; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.key_held_from.priority IS 'With scheduled_at and id: a claim key no held job of the key sorts before, unless a row of key_slots_freed says where.';

--
-- Name: COLUMN key_held_from.scheduled_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.key_held_from.scheduled_at IS 'See priority.';

--
-- Name: COLUMN key_held_from.id; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.key_held_from.id IS 'See priority.';

--
-- Name: queues; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.queues (
    name text NOT NULL,
    paused boolean DEFAULT false NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    max_running integer,
    rate_limit integer,
    rate_period interval,
    key_max_running integer,
    key_rate_limit integer,
    key_rate_period interval,
    key_claimable integer,
    CONSTRAINT queues_key_claimable_at_least_1 CHECK ((key_claimable >= 1)),
    CONSTRAINT queues_key_max_running_at_least_1 CHECK ((key_max_running >= 1)),
    CONSTRAINT queues_key_rate_limit_1_to_100000 CHECK (((key_rate_limit >= 1) AND (key_rate_limit <= 100000))),
    CONSTRAINT queues_key_rate_limit_and_period_together CHECK (((key_rate_limit IS NULL) = (key_rate_period IS NULL))),
    CONSTRAINT queues_key_rate_period_positive CHECK ((key_rate_period > '00:00:00'::interval)),
    CONSTRAINT queues_max_running_at_least_1 CHECK ((max_running >= 1)),
    CONSTRAINT queues_name_length CHECK ((octet_length(name) <= 1000)),
    CONSTRAINT queues_name_not_empty CHECK ((name <> ''::text)),
    CONSTRAINT queues_rate_limit_1_to_100000 CHECK (((rate_limit >= 1) AND (rate_limit <= 100000))),
    CONSTRAINT queues_rate_limit_and_period_together CHECK (((rate_limit IS NULL) = (rate_period IS NULL))),
    CONSTRAINT queues_rate_period_positive CHECK ((rate_period > '00:00:00'::interval))
);

--
-- Name: TABLE queues; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON TABLE skiplock.queues IS 'A queue''s settings: paused, and its global and per-key limits, held by every claim on every host. A queue needs no row until one of them is set; changed at any time, they hold from the next claim.';

--
-- Name: COLUMN queues.name; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.queues.name IS 'The queue''s name, as jobs.queue names it; a row may come before any job of the queue.';

--
-- Name: COLUMN queues.paused; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.queues.paused IS 'true: no claim takes the queue''s jobs; running ones finish.';

--
-- Name: COLUMN queues.updated_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.queues.updated_at IS 'When the row was last changed.';

--
-- Name: COLUMN queues.max_running; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.queues.max_running IS 'At most this many of the queue''s jobs running at once, across every worker. NULL: no limit.';

--
-- Name: COLUMN queues.rate_limit; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.queues.rate_limit IS 'At most this many of the queue''s jobs started in any window of rate_period (1 to 100,000). NULL: no limit.';

--
-- Name: COLUMN queues.rate_period; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.queues.rate_period IS 'The window of rate_limit.';

--
-- Name: COLUMN queues.key_max_running; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.queues.key_max_running IS 'At most this many jobs of one concurrency_key running at once. NULL: no limit.';

--
-- Name: COLUMN queues.key_rate_limit; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.queues.key_rate_limit IS 'At most this many jobs of one concurrency_key started in any window of key_rate_period (1 to 100,000). NULL: no limit.';

--
-- Name: COLUMN queues.key_rate_period; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.queues.key_rate_period IS 'The window of key_rate_limit.';

--
-- Name: COLUMN queues.key_claimable; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.queues.key_claimable IS 'Fair queueing by concurrency_key: at most this many due jobs of one key queued at once at each priority; the key''s others wait (held_for fair) and each is let go, behind what is queued then, when one of the key''s is claimed, so keys take turns. NULL: jobs are taken in claim order whatever their key.';

--
-- Name: queue_counts; Type: VIEW; Schema: skiplock; Owner: -
--

CREATE VIEW skiplock.queue_counts AS
 SELECT j.queue,
    COALESCE(q.paused, false) AS paused,
    count(*) FILTER (WHERE (j.state = 'waiting'::skiplock.job_state)) AS waiting,
    count(*) FILTER (WHERE (j.state = 'queued'::skiplock.job_state)) AS queued,
    count(*) FILTER (WHERE (j.state = 'running'::skiplock.job_state)) AS running,
    count(*) FILTER (WHERE (j.state = 'succeeded'::skiplock.job_state)) AS succeeded,
    count(*) FILTER (WHERE (j.state = 'dead'::skiplock.job_state)) AS dead,
    count(*) FILTER (WHERE (j.state = 'cancelled'::skiplock.job_state)) AS cancelled,
    count(*) AS total
   FROM (skiplock.jobs j
     LEFT JOIN skiplock.queues q ON ((q.name = j.queue)))
  GROUP BY j.queue, q.paused;

--
-- Name: VIEW queue_counts; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON VIEW skiplock.queue_counts IS 'Per queue: how many retained jobs are in each state. Example: SELECT queue, queued, dead FROM skiplock.queue_counts WHERE dead > 0;';

--
-- Name: queue_lag; Type: VIEW; Schema: skiplock; Owner: -
--

CREATE VIEW skiplock.queue_lag AS
 SELECT jobs.queue,
    min(jobs.scheduled_at) FILTER (WHERE (jobs.scheduled_at <= now())) AS oldest_runnable_at,
    COALESCE((now() - min(jobs.scheduled_at) FILTER (WHERE ((jobs.scheduled_at <= now()) AND isfinite(jobs.scheduled_at)))), '00:00:00'::interval) AS lag,
    (COALESCE(EXTRACT(epoch FROM (now() - min(jobs.scheduled_at) FILTER (WHERE ((jobs.scheduled_at <= now()) AND isfinite(jobs.scheduled_at))))), (0)::numeric))::double precision AS lag_seconds
   FROM skiplock.jobs
  WHERE (jobs.state = 'queued'::skiplock.job_state)
  GROUP BY jobs.queue;

--
-- Name: VIEW queue_lag; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON VIEW skiplock.queue_lag IS 'Per queue with queued jobs: how long the oldest runnable job has been due (zero when none is due). Example: SELECT queue, lag FROM skiplock.queue_lag WHERE lag > interval ''1 minute'';';

--
-- Name: rate_window_starts; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.rate_window_starts (
    queue text NOT NULL,
    concurrency_key text NOT NULL,
    slot integer NOT NULL,
    started_at timestamp with time zone NOT NULL
);

--
-- Name: TABLE rate_window_starts; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON TABLE skiplock.rate_window_starts IS 'Internal (rate_limit, key_rate_limit): a window''s ring slots, each the start time of one claimed job; a slot never written counts as -infinity.';

--
-- Name: COLUMN rate_window_starts.queue; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.rate_window_starts.queue IS 'The window''s queue.';

--
-- Name: COLUMN rate_window_starts.concurrency_key; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.rate_window_starts.concurrency_key IS 'The window''s key; empty for the queue''s own.';

--
-- Name: COLUMN rate_window_starts.slot; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.rate_window_starts.slot IS 'The slot, 0 to size - 1.';

--
-- Name: COLUMN rate_window_starts.started_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.rate_window_starts.started_at IS 'When the job that took the slot was claimed.';

--
-- Name: rate_windows; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.rate_windows (
    queue text NOT NULL,
    concurrency_key text NOT NULL,
    size integer NOT NULL,
    next_slot integer NOT NULL,
    expires_at timestamp with time zone NOT NULL,
    held_until timestamp with time zone,
    hold_pending boolean DEFAULT false NOT NULL,
    CONSTRAINT rate_windows_slot_in_ring CHECK (((next_slot >= 0) AND (next_slot < size)))
);

--
-- Name: TABLE rate_windows; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON TABLE skiplock.rate_windows IS 'Internal (rate_limit, key_rate_limit): a rate window, the queue''s own or a concurrency key''s: its ring of last starts, its size and where it is written next, and whether it holds the key''s jobs back.';

--
-- Name: COLUMN rate_windows.queue; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.rate_windows.queue IS 'The queue with rate_limit or key_rate_limit.';

--
-- Name: COLUMN rate_windows.concurrency_key; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.rate_windows.concurrency_key IS 'The key whose window this is; empty for the queue''s own (rate_limit).';

--
-- Name: COLUMN rate_windows.size; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.rate_windows.size IS 'Slots in the ring: the highest limit it served.';

--
-- Name: COLUMN rate_windows.next_slot; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.rate_windows.next_slot IS 'The slot that holds the oldest start, written next.';

--
-- Name: COLUMN rate_windows.expires_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.rate_windows.expires_at IS 'When the newest start is a whole period old: the window counts nothing from then on and the sweep deletes it.';

--
-- Name: COLUMN rate_windows.held_until; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.rate_windows.held_until IS 'While a key''s full window holds the key''s jobs back, when it has room again.';

--
-- Name: COLUMN rate_windows.hold_pending; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.rate_windows.hold_pending IS 'Set by the claim that filled a key''s window, for it to hold back the key''s queued jobs before it returns.';

--
-- Name: queue_limits; Type: VIEW; Schema: skiplock; Owner: -
--

CREATE VIEW skiplock.queue_limits AS
 SELECT q.name AS queue,
    q.paused,
    q.max_running,
    r.running,
    q.rate_limit,
    q.rate_period,
    s.started AS started_in_period,
        CASE
            WHEN ((q.max_running IS NOT NULL) AND (r.running >= q.max_running)) THEN 'max_running'::text
            WHEN ((q.rate_limit IS NOT NULL) AND (s.started >= q.rate_limit)) THEN 'rate_limit'::text
            ELSE NULL::text
        END AS holding_back,
    w.runnable,
        CASE
            WHEN (((q.max_running IS NOT NULL) AND (r.running >= q.max_running)) OR ((q.rate_limit IS NOT NULL) AND (s.started >= q.rate_limit))) THEN w.runnable
            ELSE (0)::bigint
        END AS held_back,
    q.key_max_running,
    k.keys_at_limit,
    k.held_by_key,
    q.key_rate_limit,
    q.key_rate_period,
    k.keys_rate_limited,
    q.key_claimable
   FROM ((((skiplock.queues q
     CROSS JOIN LATERAL ( SELECT count(*) AS running
           FROM skiplock.jobs_live j
          WHERE ((j.queue = q.name) AND (j.state = 'running'::skiplock.job_state))) r)
     CROSS JOIN LATERAL ( SELECT count(*) AS started
           FROM skiplock.rate_window_starts x
          WHERE ((x.queue = q.name) AND (x.concurrency_key = ''::text) AND (x.started_at > (now() - q.rate_period)))) s)
     CROSS JOIN LATERAL ( SELECT count(*) AS runnable
           FROM skiplock.jobs_live j
          WHERE ((j.queue = q.name) AND (j.state = 'queued'::skiplock.job_state) AND (j.scheduled_at <= now()))) w)
     LEFT JOIN LATERAL ( SELECT
                CASE
                    WHEN (q.key_max_running IS NOT NULL) THEN ( SELECT count(*) AS count
                       FROM ( SELECT
                               FROM skiplock.jobs_live r_1
                              WHERE ((r_1.queue = q.name) AND (r_1.state = 'running'::skiplock.job_state) AND (r_1.concurrency_key IS NOT NULL))
                              GROUP BY r_1.concurrency_key
                             HAVING (count(*) >= q.key_max_running)) f)
                    ELSE NULL::bigint
                END AS keys_at_limit,
                CASE
                    WHEN (q.key_rate_limit IS NOT NULL) THEN ( SELECT count(*) AS count
                       FROM skiplock.rate_windows w_1
                      WHERE ((w_1.queue = q.name) AND (w_1.concurrency_key <> ''::text) AND (skiplock.internal_rate_full_until(w_1.queue, w_1.concurrency_key, q.key_rate_limit, q.key_rate_period, now()) IS NOT NULL)))
                    ELSE NULL::bigint
                END AS keys_rate_limited,
            ( SELECT count(*) AS count
                   FROM skiplock.jobs_live h
                  WHERE ((h.queue = q.name) AND (h.state = 'waiting'::skiplock.job_state) AND (h.held_for IS NOT NULL))) AS held_by_key
          WHERE ((q.key_max_running IS NOT NULL) OR (q.key_rate_limit IS NOT NULL) OR (q.key_claimable IS NOT NULL))) k ON (true))
  WHERE ((q.max_running IS NOT NULL) OR (q.rate_limit IS NOT NULL) OR (q.key_max_running IS NOT NULL) OR (q.key_rate_limit IS NOT NULL) OR (q.key_claimable IS NOT NULL));

--
-- Name: VIEW queue_limits; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON VIEW skiplock.queue_limits IS 'Per queue with a global limit: max_running and the jobs running, rate_limit per rate_period and the starts in the last period, which limit holds runnable jobs back now (holding_back) and how many (held_back); key_max_running and the keys at it (keys_at_limit), key_rate_limit per key_rate_period and the keys whose window is full (keys_rate_limited), the jobs held back for their keys (held_by_key), and key_claimable (fair queueing by key: the jobs waiting their turn are among held_by_key). Example: SELECT queue, running, max_running, held_back FROM skiplock.queue_limits;';

--
-- Name: schema_functions; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.schema_functions (
    singleton boolean DEFAULT true NOT NULL,
    md5 text NOT NULL,
    skiplock_version text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT schema_functions_singleton_check CHECK (singleton)
);

--
-- Name: TABLE schema_functions; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON TABLE skiplock.schema_functions IS 'Internal: the text of migrations/functions/ last applied, so that migrate applies it again only when it changed.';

--
-- Name: COLUMN schema_functions.singleton; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.schema_functions.singleton IS 'Always true: one row.';

--
-- Name: COLUMN schema_functions.md5; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.schema_functions.md5 IS 'md5 of the text of migrations/functions/ last applied.';

--
-- Name: COLUMN schema_functions.skiplock_version; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.schema_functions.skiplock_version IS 'The skiplock version that applied it; an older build leaves it alone.';

--
-- Name: COLUMN schema_functions.applied_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.schema_functions.applied_at IS 'When it was applied.';

--
-- Name: schema_migrations; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.schema_migrations (
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL
);

--
-- Name: TABLE schema_migrations; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON TABLE skiplock.schema_migrations IS 'The migrations applied (migrations/NNNN_*.sql), a row each; skiplock never uses sqlx''s _sqlx_migrations.';

--
-- Name: COLUMN schema_migrations.version; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.schema_migrations.version IS 'The migration''s number (migrations/NNNN_*.sql).';

--
-- Name: COLUMN schema_migrations.name; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.schema_migrations.name IS 'Its file name.';

--
-- Name: COLUMN schema_migrations.applied_at; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.schema_migrations.applied_at IS 'When it was applied.';

--
-- Name: stats; Type: VIEW; Schema: skiplock; Owner: -
--

CREATE VIEW skiplock.stats AS
 WITH recent AS (
         SELECT jobs.queue,
            jobs.kind,
            jobs.state,
            jobs.scheduled_at,
            jobs.finished_at
           FROM skiplock.jobs
          WHERE (jobs.state = 'queued'::skiplock.job_state)
        UNION ALL
         SELECT jobs.queue,
            jobs.kind,
            jobs.state,
            jobs.scheduled_at,
            jobs.finished_at
           FROM skiplock.jobs
          WHERE (jobs.state = 'waiting'::skiplock.job_state)
        UNION ALL
         SELECT jobs.queue,
            jobs.kind,
            jobs.state,
            jobs.scheduled_at,
            jobs.finished_at
           FROM skiplock.jobs
          WHERE (jobs.state = 'running'::skiplock.job_state)
        UNION ALL
         SELECT jobs.queue,
            jobs.kind,
            jobs.state,
            jobs.scheduled_at,
            jobs.finished_at
           FROM skiplock.jobs
          WHERE ((jobs.state = ANY (ARRAY['succeeded'::skiplock.job_state, 'dead'::skiplock.job_state])) AND (jobs.finished_at > (now() - '01:00:00'::interval)))
        )
 SELECT j.queue,
    j.kind,
    COALESCE(q.paused, false) AS paused,
    count(*) FILTER (WHERE ((j.state = 'queued'::skiplock.job_state) AND (j.scheduled_at <= now()))) AS runnable,
    count(*) FILTER (WHERE ((j.state = 'queued'::skiplock.job_state) AND (j.scheduled_at > now()))) AS scheduled,
    count(*) FILTER (WHERE (j.state = 'waiting'::skiplock.job_state)) AS waiting,
    count(*) FILTER (WHERE (j.state = 'running'::skiplock.job_state)) AS running,
    count(*) FILTER (WHERE ((j.state = 'succeeded'::skiplock.job_state) AND (j.finished_at > (now() - '01:00:00'::interval)))) AS succeeded_last_hour,
    count(*) FILTER (WHERE ((j.state = 'dead'::skiplock.job_state) AND (j.finished_at > (now() - '01:00:00'::interval)))) AS dead_last_hour,
    count(*) FILTER (WHERE ((j.state = 'succeeded'::skiplock.job_state) AND (j.finished_at > (now() - '00:01:00'::interval)))) AS succeeded_last_minute,
    (COALESCE(EXTRACT(epoch FROM (now() - min(j.scheduled_at) FILTER (WHERE ((j.state = 'queued'::skiplock.job_state) AND (j.scheduled_at <= now()) AND isfinite(j.scheduled_at))))), (0)::numeric))::double precision AS lag_seconds,
    (((count(*) FILTER (WHERE ((j.state = 'succeeded'::skiplock.job_state) AND (j.finished_at > (now() - '00:01:00'::interval)))))::numeric / 60.0))::double precision AS per_second
   FROM (recent j
     LEFT JOIN skiplock.queues q ON ((q.name = j.queue)))
  GROUP BY j.queue, j.kind, q.paused;

--
-- Name: VIEW stats; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON VIEW skiplock.stats IS 'Per queue and kind: runnable (queued, due), scheduled (queued, not yet due), waiting, running, succeeded and dead in the last hour, lag_seconds (age of the oldest runnable job) and per_second (successes over the last minute / 60). Example: SELECT * FROM skiplock.stats ORDER BY lag_seconds DESC;';

--
-- Name: throughput; Type: VIEW; Schema: skiplock; Owner: -
--

CREATE VIEW skiplock.throughput AS
 SELECT jobs.queue,
    jobs.kind,
    count(*) FILTER (WHERE ((jobs.state = 'succeeded'::skiplock.job_state) AND (jobs.finished_at > (now() - '00:01:00'::interval)))) AS succeeded_last_minute,
    count(*) FILTER (WHERE (jobs.state = 'succeeded'::skiplock.job_state)) AS succeeded_last_hour,
    count(*) FILTER (WHERE ((jobs.state = 'dead'::skiplock.job_state) AND (jobs.finished_at > (now() - '00:01:00'::interval)))) AS dead_last_minute,
    count(*) FILTER (WHERE (jobs.state = 'dead'::skiplock.job_state)) AS dead_last_hour,
    (((count(*) FILTER (WHERE ((jobs.state = 'succeeded'::skiplock.job_state) AND (jobs.finished_at > (now() - '00:01:00'::interval)))))::numeric / 60.0))::double precision AS per_second_last_minute,
    (((count(*) FILTER (WHERE (jobs.state = 'succeeded'::skiplock.job_state)))::numeric / 3600.0))::double precision AS per_second_last_hour
   FROM skiplock.jobs
  WHERE ((jobs.state = ANY (ARRAY['succeeded'::skiplock.job_state, 'dead'::skiplock.job_state])) AND (jobs.finished_at > (now() - '01:00:00'::interval)))
  GROUP BY jobs.queue, jobs.kind;

--
-- Name: VIEW throughput; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON VIEW skiplock.throughput IS 'Per queue and kind: jobs that succeeded or died in the last minute and hour, and successes per second. Example: SELECT * FROM skiplock.throughput WHERE queue = ''mail'';';

--
-- Name: waiting_sweep; Type: TABLE; Schema: skiplock; Owner: -
--

CREATE TABLE skiplock.waiting_sweep (
    singleton boolean DEFAULT true NOT NULL,
    after_id bigint DEFAULT 0 NOT NULL,
    CONSTRAINT waiting_sweep_singleton_check CHECK (singleton)
);

--
-- Name: TABLE waiting_sweep; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON TABLE skiplock.waiting_sweep IS 'Internal: where the periodic sweep of waiting jobs (internal_settle_waiting) goes on.';

--
-- Name: COLUMN waiting_sweep.singleton; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.waiting_sweep.singleton IS 'Always true: one row.';

--
-- Name: COLUMN waiting_sweep.after_id; Type: COMMENT; Schema: skiplock; Owner: -
--

COMMENT ON COLUMN skiplock.waiting_sweep.after_id IS 'The sweep of waiting jobs goes on after this id, and from the first again after the last.';

--
-- Name: jobs_done; Type: TABLE ATTACH; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.jobs ATTACH PARTITION skiplock.jobs_done FOR VALUES IN ('succeeded', 'dead', 'cancelled');

--
-- Name: jobs_done_default; Type: TABLE ATTACH; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.jobs_done ATTACH PARTITION skiplock.jobs_done_default DEFAULT;

--
-- Name: jobs_live; Type: TABLE ATTACH; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.jobs ATTACH PARTITION skiplock.jobs_live FOR VALUES IN ('waiting', 'queued', 'running');

--
-- Name: cron_schedules cron_schedules_pkey; Type: CONSTRAINT; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.cron_schedules
    ADD CONSTRAINT cron_schedules_pkey PRIMARY KEY (name);

--
-- Name: job_dependencies job_dependencies_pkey; Type: CONSTRAINT; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.job_dependencies
    ADD CONSTRAINT job_dependencies_pkey PRIMARY KEY (job_id, parent_id);

--
-- Name: job_history job_history_pkey; Type: CONSTRAINT; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.job_history
    ADD CONSTRAINT job_history_pkey PRIMARY KEY (bucket, queue, kind);

--
-- Name: job_id_days job_id_days_pkey; Type: CONSTRAINT; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.job_id_days
    ADD CONSTRAINT job_id_days_pkey PRIMARY KEY (day);

--
-- Name: jobs_live jobs_live_pkey; Type: CONSTRAINT; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.jobs_live
    ADD CONSTRAINT jobs_live_pkey PRIMARY KEY (id);

--
-- Name: key_held_from key_held_from_pkey; Type: CONSTRAINT; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.key_held_from
    ADD CONSTRAINT key_held_from_pkey PRIMARY KEY (queue, concurrency_key);

--
-- Name: queues queues_pkey; Type: CONSTRAINT; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.queues
    ADD CONSTRAINT queues_pkey PRIMARY KEY (name);

--
-- Name: rate_window_starts rate_window_starts_pkey; Type: CONSTRAINT; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.rate_window_starts
    ADD CONSTRAINT rate_window_starts_pkey PRIMARY KEY (queue, concurrency_key, slot);

--
-- Name: rate_windows rate_windows_pkey; Type: CONSTRAINT; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.rate_windows
    ADD CONSTRAINT rate_windows_pkey PRIMARY KEY (queue, concurrency_key);

--
-- Name: schema_functions schema_functions_pkey; Type: CONSTRAINT; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.schema_functions
    ADD CONSTRAINT schema_functions_pkey PRIMARY KEY (singleton);

--
-- Name: schema_migrations schema_migrations_pkey; Type: CONSTRAINT; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.schema_migrations
    ADD CONSTRAINT schema_migrations_pkey PRIMARY KEY (version);

--
-- Name: waiting_sweep waiting_sweep_pkey; Type: CONSTRAINT; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.waiting_sweep
    ADD CONSTRAINT waiting_sweep_pkey PRIMARY KEY (singleton);

--
-- Name: job_dependencies_parent_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX job_dependencies_parent_idx ON skiplock.job_dependencies USING btree (parent_id);

--
-- Name: jobs_claim_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX jobs_claim_idx ON skiplock.jobs_live USING btree (queue, priority, scheduled_at, id) WHERE (state = 'queued'::skiplock.job_state);

--
-- Name: jobs_concurrency_key_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX jobs_concurrency_key_idx ON skiplock.jobs_live USING btree (queue, state, concurrency_key, priority, scheduled_at, id) WHERE ((concurrency_key IS NOT NULL) AND (state = ANY (ARRAY['queued'::skiplock.job_state, 'running'::skiplock.job_state])));

--
-- Name: jobs_done_id_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX jobs_done_id_idx ON ONLY skiplock.jobs_done USING btree (id);

--
-- Name: jobs_done_default_id_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX jobs_done_default_id_idx ON skiplock.jobs_done_default USING btree (id);

--
-- Name: jobs_finished_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX jobs_finished_idx ON ONLY skiplock.jobs_done USING btree (state, finished_at);

--
-- Name: jobs_done_default_state_finished_at_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX jobs_done_default_state_finished_at_idx ON skiplock.jobs_done_default USING btree (state, finished_at);

--
-- Name: jobs_held_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX jobs_held_idx ON skiplock.jobs_live USING btree (queue, concurrency_key, priority, scheduled_at, id) WHERE ((state = 'waiting'::skiplock.job_state) AND (held_for IS NOT NULL));

--
-- Name: jobs_lane_turn_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE UNIQUE INDEX jobs_lane_turn_idx ON skiplock.jobs_live USING btree (ordering_key) WHERE ((ordering_key IS NOT NULL) AND (state = ANY (ARRAY['queued'::skiplock.job_state, 'running'::skiplock.job_state])));

--
-- Name: jobs_ordering_key_lane_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX jobs_ordering_key_lane_idx ON skiplock.jobs_live USING btree (ordering_key, id) WHERE ((ordering_key IS NOT NULL) AND (state = ANY (ARRAY['waiting'::skiplock.job_state, 'queued'::skiplock.job_state, 'running'::skiplock.job_state])));

--
-- Name: jobs_running_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX jobs_running_idx ON skiplock.jobs_live USING btree (heartbeat_at) WHERE (state = 'running'::skiplock.job_state);

--
-- Name: jobs_unique_key_pending_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE UNIQUE INDEX jobs_unique_key_pending_idx ON skiplock.jobs_live USING btree (unique_key) WHERE ((unique_key IS NOT NULL) AND (state = ANY (ARRAY['waiting'::skiplock.job_state, 'queued'::skiplock.job_state])));

--
-- Name: jobs_waiting_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX jobs_waiting_idx ON skiplock.jobs_live USING btree (id) WHERE (state = 'waiting'::skiplock.job_state);

--
-- Name: key_slots_freed_queue_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX key_slots_freed_queue_idx ON skiplock.key_slots_freed USING btree (queue);

--
-- Name: rate_windows_expires_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX rate_windows_expires_idx ON skiplock.rate_windows USING btree (expires_at);

--
-- Name: rate_windows_held_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX rate_windows_held_idx ON skiplock.rate_windows USING btree (queue, held_until) WHERE (held_until IS NOT NULL);

--
-- Name: rate_windows_hold_pending_idx; Type: INDEX; Schema: skiplock; Owner: -
--

CREATE INDEX rate_windows_hold_pending_idx ON skiplock.rate_windows USING btree (queue) WHERE hold_pending;

--
-- Name: jobs_done_default_id_idx; Type: INDEX ATTACH; Schema: skiplock; Owner: -
--

ALTER INDEX skiplock.jobs_done_id_idx ATTACH PARTITION skiplock.jobs_done_default_id_idx;

--
-- Name: jobs_done_default_state_finished_at_idx; Type: INDEX ATTACH; Schema: skiplock; Owner: -
--

ALTER INDEX skiplock.jobs_finished_idx ATTACH PARTITION skiplock.jobs_done_default_state_finished_at_idx;

--
-- Name: cron_schedules cron_schedules_before_write; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER cron_schedules_before_write BEFORE INSERT OR UPDATE ON skiplock.cron_schedules FOR EACH ROW EXECUTE FUNCTION skiplock.internal_cron_schedules_before_write();

--
-- Name: job_dependencies job_dependencies_after_insert; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER job_dependencies_after_insert AFTER INSERT ON skiplock.job_dependencies FOR EACH ROW EXECUTE FUNCTION skiplock.internal_job_dependencies_after_insert();

--
-- Name: jobs jobs_after_delete; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER jobs_after_delete AFTER DELETE ON skiplock.jobs REFERENCING OLD TABLE AS deleted FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete();

--
-- Name: jobs_done jobs_after_delete; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER jobs_after_delete AFTER DELETE ON skiplock.jobs_done REFERENCING OLD TABLE AS deleted FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete();

--
-- Name: jobs_done_default jobs_after_delete; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER jobs_after_delete AFTER DELETE ON skiplock.jobs_done_default REFERENCING OLD TABLE AS deleted FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete();

--
-- Name: jobs_live jobs_after_delete; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER jobs_after_delete AFTER DELETE ON skiplock.jobs_live REFERENCING OLD TABLE AS deleted FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete();

--
-- Name: jobs_live jobs_before_insert; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER jobs_before_insert BEFORE INSERT ON skiplock.jobs_live FOR EACH ROW WHEN (((new.ordering_key IS NOT NULL) OR (new.unique_key IS NOT NULL) OR (pg_column_size(new.args) > 4096))) EXECUTE FUNCTION skiplock.internal_jobs_before_insert();

--
-- Name: jobs_done jobs_done_before_requeue; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER jobs_done_before_requeue BEFORE UPDATE ON skiplock.jobs_done FOR EACH ROW WHEN ((new.state = ANY (ARRAY['waiting'::skiplock.job_state, 'queued'::skiplock.job_state, 'running'::skiplock.job_state]))) EXECUTE FUNCTION skiplock.internal_jobs_done_before_requeue();

--
-- Name: jobs_done jobs_notify_finished; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER jobs_notify_finished AFTER INSERT ON skiplock.jobs_done FOR EACH ROW WHEN (new.awaited) EXECUTE FUNCTION skiplock.internal_notify_finished();

--
-- Name: jobs jobs_notify_inserted; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER jobs_notify_inserted AFTER INSERT ON skiplock.jobs REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_notify_jobs_inserted();

--
-- Name: jobs_live jobs_notify_inserted; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER jobs_notify_inserted AFTER INSERT ON skiplock.jobs_live REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_notify_jobs_inserted();

--
-- Name: queues queues_after_fairness_change; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER queues_after_fairness_change AFTER UPDATE ON skiplock.queues FOR EACH ROW WHEN (((new.key_claimable IS DISTINCT FROM old.key_claimable) OR (new.key_max_running IS DISTINCT FROM old.key_max_running) OR (new.key_rate_limit IS DISTINCT FROM old.key_rate_limit))) EXECUTE FUNCTION skiplock.internal_queues_after_fairness_change();

--
-- Name: queues queues_after_fairness_delete; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER queues_after_fairness_delete AFTER DELETE ON skiplock.queues FOR EACH ROW WHEN ((old.key_claimable IS NOT NULL)) EXECUTE FUNCTION skiplock.internal_queues_after_fairness_change();

--
-- Name: queues queues_after_handoff_rules_change; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER queues_after_handoff_rules_change AFTER DELETE OR UPDATE ON skiplock.queues FOR EACH ROW WHEN ((old.key_max_running IS NOT NULL)) EXECUTE FUNCTION skiplock.internal_queues_after_handoff_rules_change();

--
-- Name: queues queues_after_key_limit_change; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER queues_after_key_limit_change AFTER UPDATE ON skiplock.queues FOR EACH ROW WHEN ((((old.key_max_running IS NOT NULL) AND (new.key_max_running IS DISTINCT FROM old.key_max_running)) OR ((old.key_claimable IS NOT NULL) AND (new.key_claimable IS DISTINCT FROM old.key_claimable)) OR ((old.key_rate_limit IS NOT NULL) AND ((new.key_rate_limit IS DISTINCT FROM old.key_rate_limit) OR (new.key_rate_period IS DISTINCT FROM old.key_rate_period))) OR ((old.rate_limit IS NOT NULL) AND ((new.rate_limit IS NULL) OR (new.rate_period IS DISTINCT FROM old.rate_period))) OR ((new.name <> old.name) AND ((old.rate_limit IS NOT NULL) OR (old.key_max_running IS NOT NULL) OR (old.key_rate_limit IS NOT NULL) OR (old.key_claimable IS NOT NULL))))) EXECUTE FUNCTION skiplock.internal_queues_after_key_limit();

--
-- Name: queues queues_after_key_limit_delete; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER queues_after_key_limit_delete AFTER DELETE ON skiplock.queues FOR EACH ROW WHEN (((old.key_max_running IS NOT NULL) OR (old.key_rate_limit IS NOT NULL) OR (old.key_claimable IS NOT NULL) OR (old.rate_limit IS NOT NULL))) EXECUTE FUNCTION skiplock.internal_queues_after_key_limit();

--
-- Name: queues queues_after_limits_set_insert; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER queues_after_limits_set_insert AFTER INSERT ON skiplock.queues FOR EACH ROW WHEN (((new.max_running IS NOT NULL) OR (new.rate_limit IS NOT NULL) OR (new.key_max_running IS NOT NULL) OR (new.key_rate_limit IS NOT NULL))) EXECUTE FUNCTION skiplock.internal_queues_after_limits_set();

--
-- Name: queues queues_after_limits_set_update; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER queues_after_limits_set_update AFTER UPDATE ON skiplock.queues FOR EACH ROW WHEN ((((new.max_running IS NOT NULL) OR (new.rate_limit IS NOT NULL) OR (new.key_max_running IS NOT NULL) OR (new.key_rate_limit IS NOT NULL)) AND (((old.max_running IS NULL) AND (old.rate_limit IS NULL) AND (old.key_max_running IS NULL) AND (old.key_rate_limit IS NULL)) OR (new.name IS DISTINCT FROM old.name)))) EXECUTE FUNCTION skiplock.internal_queues_after_limits_set();

--
-- Name: queues queues_after_max_running_change; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER queues_after_max_running_change AFTER UPDATE ON skiplock.queues FOR EACH ROW WHEN ((((old.max_running IS NOT NULL) OR (new.max_running IS NOT NULL)) AND ((new.max_running IS DISTINCT FROM old.max_running) OR (new.rate_limit IS DISTINCT FROM old.rate_limit) OR (new.key_max_running IS DISTINCT FROM old.key_max_running) OR (new.key_rate_limit IS DISTINCT FROM old.key_rate_limit) OR (new.name IS DISTINCT FROM old.name)))) EXECUTE FUNCTION skiplock.internal_queues_after_max_running_change();

--
-- Name: queues queues_after_max_running_insert; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER queues_after_max_running_insert AFTER INSERT ON skiplock.queues FOR EACH ROW WHEN ((new.max_running IS NOT NULL)) EXECUTE FUNCTION skiplock.internal_queues_after_max_running_change();

--
-- Name: queues queues_after_write; Type: TRIGGER; Schema: skiplock; Owner: -
--

CREATE TRIGGER queues_after_write AFTER INSERT OR UPDATE ON skiplock.queues FOR EACH ROW WHEN ((NOT new.paused)) EXECUTE FUNCTION skiplock.internal_queues_after_write();

--
-- Name: rate_window_starts rate_window_starts_queue_concurrency_key_fkey; Type: FK CONSTRAINT; Schema: skiplock; Owner: -
--

ALTER TABLE ONLY skiplock.rate_window_starts
    ADD CONSTRAINT rate_window_starts_queue_concurrency_key_fkey FOREIGN KEY (queue, concurrency_key) REFERENCES skiplock.rate_windows(queue, concurrency_key) ON UPDATE CASCADE ON DELETE CASCADE;

--
-- PostgreSQL database dump complete
--
