-- migrations/functions/08_outcomes.sql: Outcomes of a claim: fail, release, heartbeat,
-- reap, abandon, and the moving on of lanes and dependants.
--
-- Defines:
--   internal_fail_claims, internal_move_on, internal_release_claims, internal_heartbeat_claims
--   internal_reap_stale, internal_stale_claims, internal_abandon_claims
--   internal_settle_waiting, internal_error_message

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
LANGUAGE sql
SET jit = off
AS $$
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

-- Claims given back without counting the attempt: a graceful shutdown (delay 0: the job
-- keeps its scheduled_at, and so its place in line) or a snooze (due again after the
-- delay). A job whose unique_key another pending job took meanwhile is superseded by it and
-- ends cancelled. Returns the claims still held, with the state each job has now.
CREATE OR REPLACE FUNCTION skiplock.internal_release_claims(ids bigint[], tokens uuid[], delays_ms bigint[])
RETURNS TABLE (id bigint, state text)
LANGUAGE sql
SET jit = off
AS $$
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
$$;

-- Extends the claims still held with the database clock, and returns those gone (reaped,
-- cancelled, finished by someone else, deleted). Rows locked by another statement (most
-- often the holder's own completion, being saved right now) are skipped rather than
-- waited on: a heartbeat must never queue behind a slow commit, or it would itself go
-- stale; such a claim counts as held while the row still shows the token. clock_timestamp()
-- is taken as the row is written, so a heartbeat that waited for a lock records the end of
-- the wait. in_flight are the tokens of claim statements whose reply the Rust worker has
-- not read yet: the jobs holding one are extended too (usually none, and then the extra
-- scan does not run). The rows locked are updated by their ctid; the claims gone are found
-- by one primary-key probe per claim (LIMIT 1 keeps the probe from being flattened into a
-- join that may scan the table).
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
LANGUAGE plpgsql
SET jit = off
AS $$
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
$$;

-- The claims internal_reap_stale would take back (up to max_jobs, oldest heartbeat first),
-- without taking them or locking anything: the list a reaper works through one job at a
-- time when one row made its batch fail.
CREATE OR REPLACE FUNCTION skiplock.internal_stale_claims(stale_after_ms bigint, max_jobs bigint)
RETURNS TABLE (id bigint, claim_token uuid)
LANGUAGE sql
SET jit = off
AS $$
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
LANGUAGE sql
SET jit = off
AS $$
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
$$;

-- The periodic repair of what a race may have left: waiting jobs whose parents have all
-- finished (a parent finished while the child's enqueue was uncommitted, or was deleted:
-- pruned after it succeeded, or deleted by hand before, leaving a tombstone) are settled,
-- waiting jobs left without any dependency row (deleted by hand) are queued, and lanes
-- whose head finished while a new lane job was being enqueued move on; jobs held back by
-- a per-key limit go as their keys have room; per-key rate windows that count nothing any
-- more, and freed key slots left for a queue without key_max_running, are deleted. Returns how many jobs moved.
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
