-- migrations/functions/10_protocol.sql: The SQL worker protocol (stable): claim, heartbeat,
-- complete, fail, discard, release, snooze, complete_many, fail_many, maintain.
--
-- Defines:
--   claim, heartbeat, internal_save_outcomes, internal_fails_the_call
--   internal_save_outcomes_many, complete_many
--   fail_many, complete, fail, discard, release, snooze
--   internal_reap_stale_tally, maintain, has_work, left_behind

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
COMMENT ON FUNCTION skiplock.claim(text, integer, text, text[]) IS
    'Takes up to `max_jobs` runnable jobs of one queue, in claim order (`priority`, lower first, then `scheduled_at`, then `id`), with `FOR UPDATE SKIP LOCKED`: any number of workers claim at once and never take the same job. Returns `id, queue, kind, args, attempt, max_attempts, claim_token, traceparent, tracestate` per job (the last two: the W3C trace context the job was enqueued with, NULL without one; a worker continues that trace in its span). `kinds` NULL means every kind; pass the kinds you have handlers for. Jobs of a paused queue, not yet due, waiting for parents or behind an unfinished job of their lane are not taken, nor more than the queue''s global limits leave (`max_running`, `rate_limit`, and per concurrency key `key_max_running` and `key_rate_limit`; such a claim must run in READ COMMITTED, else SQLSTATE 25000). Each job comes back `running` with `attempt` counted and a fresh `claim_token`. `max_jobs` 0 returns nothing; NULL, negative or over 10,000, or a NULL or empty `queue` or `worker`, is an error (SQLSTATE 22023).';

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
COMMENT ON FUNCTION skiplock.heartbeat(bigint[], uuid[]) IS
    'Extends `heartbeat_at` of the claims still held; returns `id, held` per claim given. `held = false`: the claim is gone (reaped as stale, cancelled by an operator, finished, or the token is not the current one); stop the job and write nothing for it.';

-- ---- Outcomes of the SQL worker protocol ------------------------------------------------
--
-- Every outcome of a claim a worker in another language writes (complete, fail, discard,
-- release, snooze, and complete_many and fail_many for a batch) goes through one path,
-- internal_save_outcomes_many, in the caller's transaction; a batch costs one round trip,
-- as the Rust worker's completer saves its outcomes. Each state change goes through the
-- statement the Rust worker runs for it (internal_complete_claims, internal_fail_claims,
-- internal_release_claims) with the claims sorted by id, so that rows are locked in the
-- order every other writer locks them; the lanes and dependants of the jobs that finished
-- move on once for the batch (internal_move_on). A stale claim changes nothing for its job
-- and the others go through.
--
-- One row never stops the others: when the batch fails for a reason of its rows (a trigger
-- of yours refuses one, say), the claims are saved one at a time, each in a subtransaction,
-- and one that still fails goes `dead` with the reason (internal_abandon_claims), as the
-- Rust worker does (src/worker/split_write.rs). A job moved to the other partition under
-- the pass (40001) runs the pass again (see skiplock.internal_may_retry_moved): the one
-- place the protocol's outcomes handle it. Another error of the server or the transaction
-- rather than of a row (serialization failure, deadlock, lock_timeout, a read-only server,
-- a lost prepared statement: those the Rust worker retries, src/error.rs), or a caller
-- without the privilege to write jobs (SQLSTATE 42501), fails the call, which then changed
-- nothing.

-- One pass of an outcome over claims sorted by id: 'complete' (with each output given),
-- 'retry' (a failed attempt: queued again after its retry_in, NULL meaning
-- skiplock.backoff(attempt), or dead once its attempts are spent), 'dead' (a failure no
-- retry mends), or 'release' (given back, the attempt not counted: queued again after its
-- retry_in, zero keeping its place in line). Returns the claims it changed, as the
-- statements under it return them; a released job superseded by its unique_key's holder
-- has had its lane and dependants moved on already, and comes back without them.
CREATE OR REPLACE FUNCTION skiplock.internal_save_outcomes(outcome text, ids bigint[], tokens uuid[],
                                                           outputs jsonb[], messages text[],
                                                           retry_ins interval[])
RETURNS TABLE (id bigint, state text, has_dependants boolean, ordering_key text)
LANGUAGE plpgsql
SET jit = off
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

-- Whether an error caught while saving outcomes is one of the server or the transaction
-- rather than of a row, which fails the call instead of sending a job dead: a rollback
-- (serialization failure, deadlock), lock_timeout, a read-only server, resources, an
-- operator's cancel or shutdown, a lost connection or prepared statement (those the Rust
-- worker retries, src/error.rs), or a caller without the privilege to write jobs (42501).
-- The one list of them (three handlers of internal_save_outcomes_many ask).
CREATE OR REPLACE FUNCTION skiplock.internal_fails_the_call(code text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT left(code, 2) IN ('40', '53', '57', '08')
        OR code IN ('55P03', '25006', '26000', '42501');
$$;

-- The path behind every outcome of the protocol (see above): checks the arguments, sorts the claims
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
COMMENT ON FUNCTION skiplock.complete_many(bigint[], uuid[], jsonb[]) IS
    '`complete` for a batch, in one call and one transaction, as the Rust worker saves its completions: each held job `succeeded` (with its element of `outputs`, when given and not NULL), the lanes and dependants of all of them moved on and listening workers told. Returns `id, state` per claim given, in the order given. `state` is `''succeeded''`; NULL when the claim was not held (a stale, wrong or NULL token: nothing changed for that job, the others go through); `''dead''` when the row refused the change (a trigger of yours, say): the batch is then saved one claim at a time and that job alone goes dead with `the outcome of this attempt could not be saved: …` in `last_error`, its lane moving on; `''running''` in the last resort, when even that is refused (a warning names it, and `maintain` takes it back after `stale_after`). Rows are locked in id order, whatever the order given. Arrays of different lengths, or an id given twice, are an error (SQLSTATE 22023); empty arrays return nothing.';

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
COMMENT ON FUNCTION skiplock.fail_many(bigint[], uuid[], text[], interval[]) IS
    '`fail` for a batch, in one call and one transaction: each error (cut to 8 KiB) recorded, each job queued again after `skiplock.backoff(attempt)` or its element of `retry_in` (NULL: the backoff). Returns `id, state` per claim given, in the order given. `state` is `''queued''`, `''dead''` (no attempt left: its waiting dependants are cancelled and its lane moves on), `''cancelled''` (a retry whose `unique_key` another pending job took meanwhile), NULL when the claim was not held (nothing changed), and `''dead''` or `''running''` for a row that refused the change, as for `complete_many`. A negative `retry_in`, arrays of different lengths or an id given twice are an error (SQLSTATE 22023).';

-- ---- One claim's outcome: complete, fail, discard, release, snooze -----------------------
--
-- Each is the batch form above for one claim (internal_save_outcomes_many): one path saves
-- every outcome of the SQL protocol, with the one run again on a row moved under it and the
-- one answer to a row that refuses its change (the job goes dead with the reason, its lane
-- and dependants move on), so that a worker calling them one job at a time keeps the same
-- promises as one calling the batch forms, and as the Rust worker.

-- Marks a held job succeeded (with output, when given); true when the caller held the
-- claim. The next job of its lane and its waiting dependants move on in the same
-- transaction, and workers are told.
CREATE OR REPLACE FUNCTION skiplock.complete(id bigint, token uuid, output jsonb DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    RETURN (SELECT s.state IS NOT NULL
            FROM skiplock.internal_save_outcomes_many('complete', 'complete', ARRAY[complete.id],
                                                      ARRAY[complete.token],
                                                      ARRAY[complete.output], NULL, NULL) s);
END;
$$;
COMMENT ON FUNCTION skiplock.complete(bigint, uuid, jsonb) IS
    'Marks the job `succeeded` (keeping `output`). In the same transaction the next job of its lane becomes queued, waiting children whose parents have all succeeded become queued, and listening workers are notified, so they are claimable at once, with no skiplock process running. `false`: the claim was not held, nothing changed. A row that refuses the change (a trigger of yours) goes `dead` instead, with `the outcome of this attempt could not be saved: …` in `last_error`, as in `complete_many` (`true`: the claim was held).';

-- A failed attempt: the error recorded, the job queued again after skiplock.backoff(attempt)
-- (or retry_in), or dead once its attempts are spent (its lane moves on and its waiting
-- dependants are cancelled). Returns the new state; NULL when the caller did not hold the
-- claim (nothing changed).
CREATE OR REPLACE FUNCTION skiplock.fail(id bigint, token uuid, error text,
                                         retry_in interval DEFAULT NULL)
RETURNS skiplock.job_state
LANGUAGE plpgsql AS $$
BEGIN
    RETURN (SELECT s.state
            FROM skiplock.internal_save_outcomes_many('fail', 'retry', ARRAY[fail.id],
                                                      ARRAY[fail.token], NULL, ARRAY[fail.error],
                                                      ARRAY[fail.retry_in]) s);
END;
$$;
COMMENT ON FUNCTION skiplock.fail(bigint, uuid, text, interval) IS
    'Records `error` (cut to 8 KiB) in `last_error` and `errors`. `''queued''`: runs again after `skiplock.backoff(attempt)` (2^attempt seconds, at most an hour, ±25 %) or after `retry_in`. `''dead''`: no attempt left; its waiting dependants are cancelled and its lane moves on. `''cancelled''`: the job would run again, but its `unique_key` was taken meanwhile by another pending job, which runs instead (the job is superseded: `last_error` names that job; under the policy `merge` its payloads are merged into it). NULL: the claim was not held, nothing changed. A row that refuses the change goes `dead` with the reason, as in `fail_many`. A negative `retry_in` is an error (SQLSTATE 22023).';

-- A failure no retry will mend: the job is dead now, whatever attempts it has left.
CREATE OR REPLACE FUNCTION skiplock.discard(id bigint, token uuid, error text)
RETURNS skiplock.job_state
LANGUAGE plpgsql AS $$
BEGIN
    RETURN (SELECT s.state
            FROM skiplock.internal_save_outcomes_many('discard', 'dead', ARRAY[discard.id],
                                                      ARRAY[discard.token], NULL,
                                                      ARRAY[discard.error], ARRAY[NULL::interval]) s);
END;
$$;
COMMENT ON FUNCTION skiplock.discard(bigint, uuid, text) IS
    'As `fail`, but `''dead''` now, whatever attempts are left: for errors no retry will mend (bad arguments).';

-- Gives a held job back without counting the attempt (a worker that stops before running
-- it): queued again at once, in its place in line. True when the caller held the claim.
CREATE OR REPLACE FUNCTION skiplock.release(id bigint, token uuid) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    RETURN (SELECT s.state IS NOT NULL
            FROM skiplock.internal_save_outcomes_many('release', 'release', ARRAY[release.id],
                                                      ARRAY[release.token], NULL, NULL,
                                                      ARRAY[interval '0']) s);
END;
$$;
COMMENT ON FUNCTION skiplock.release(bigint, uuid) IS
    'Gives a claimed job back: `queued` at once, in its place in line, its attempt not counted. For jobs claimed but not started when the worker stops. `false`: the claim was not held, nothing changed. A row that refuses the change goes `dead` with the reason, as in `complete_many`.';

-- Puts a held job back to run again after delay, without counting the attempt (a handler
-- waiting for something). True when the caller held the claim.
CREATE OR REPLACE FUNCTION skiplock.snooze(id bigint, token uuid, delay interval)
RETURNS boolean
LANGUAGE plpgsql AS $$
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
COMMENT ON FUNCTION skiplock.snooze(bigint, uuid, interval) IS
    '`queued` again after `delay`, the attempt not counted: for a handler that must wait for something. `false`: the claim was not held, nothing changed. A row that refuses the change goes `dead` with the reason, as in `complete_many`.';

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
COMMENT ON FUNCTION skiplock.maintain(interval) IS
    'Takes back running jobs whose `heartbeat_at` is older than `stale_after` (their worker crashed or hung): `queued` with backoff, or `dead` when their attempts are spent, the reason (which worker went quiet) in `last_error`. Then settles the dependants and lanes of what finished, makes the next days'' tables of finished jobs when missing, sweeps the next 500 waiting jobs (in id order, from where the last call of any session stopped: a waiting job that a race left behind moves on within one lap of the waiting jobs), and enqueues the job of each due cron slot. Returns how many it took back, moved on and enqueued. Its cost follows that work, not how many jobs wait or how many finished ones the table keeps (docs/benchmarks.md). Safe from many sessions at once: each stale job is taken back once, each cron slot enqueued once. A job that cannot be taken back (a trigger of yours refuses the change) never stops the others: it goes `dead` with the reason in `last_error`, or, when even that is refused, stays as it is and a warning names it.';

-- Whether a worker of these queues and kinds (NULL kinds: every kind) still has work, now
-- or once what runs anywhere ends: a job runnable now or running (in any process: its end
-- may queue the next job of a lane or a child), or held back by a per-key limit (it goes
-- when its key has room, with no write of anyone's). What `skiplock work --exit-when-idle`
-- and the example workers ask before they exit, once their claim came back empty with
-- nothing of theirs running: a worker that exited on its empty claim alone left the lane
-- jobs that another worker's jobs were about to let go. Jobs due later (a retry's backoff,
-- a snooze), jobs of a paused queue (nothing claims them until someone resumes it: a
-- worker waiting for them waited for good) and jobs waiting for parents that have not
-- ended are not work now; skiplock.left_behind says what they are. Planned at each call
-- (a SQL function with settings is not inlined, and Postgres plans its body at every
-- call): a plan cached while the table was empty cost 5 ms instead of 1 ms on 200,000
-- rows.
CREATE OR REPLACE FUNCTION skiplock.has_work(queues text[], kinds text[] DEFAULT NULL)
RETURNS boolean
LANGUAGE sql STABLE
SET jit = off
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
COMMENT ON FUNCTION skiplock.has_work(text[], text[]) IS
    'Whether a worker of these queues and kinds (NULL: every kind) has work now or once what runs anywhere ends: a job due and queued, a job running in any process (its end may let the next job of a lane or a child go), or a job held back by a per-key limit. What a worker asks before it exits when idle, after its own claim came back empty and nothing of its own runs. Jobs due later, jobs of a paused queue and jobs waiting for parents that have not ended are not counted (skiplock.left_behind names them). Example: SELECT skiplock.has_work(ARRAY[''mail''], NULL);';

-- The line a worker that exits when idle (has_work said no) leaves behind, or NULL when it
-- leaves nothing: the jobs of its queues and kinds that nobody may claim now and that will
-- not go by themselves, so that an exit is never silent about them. Jobs of a paused
-- queue (until someone resumes it), jobs waiting out a retry's backoff or a snooze
-- (attempt > 0) and jobs scheduled later, with when the next is due. `skiplock work` and
-- both example workers print it, so that --exit-when-idle says the same everywhere. Its
-- cost follows the jobs it counts, read once, at exit.
CREATE OR REPLACE FUNCTION skiplock.left_behind(queues text[], kinds text[] DEFAULT NULL)
RETURNS text
LANGUAGE sql STABLE
SET jit = off
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
COMMENT ON FUNCTION skiplock.left_behind(text[], text[]) IS
    'The line a worker of these queues and kinds (NULL: every kind) prints when it exits idle, or NULL when nothing is left: jobs of a paused queue, jobs waiting out a retry''s backoff or a snooze, jobs scheduled later, and when the next is due. Example: SELECT skiplock.left_behind(ARRAY[''mail''], NULL);';
