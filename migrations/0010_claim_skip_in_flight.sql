-- skiplock schema, version 10: a claim can pass over rows that claims in flight hold
-- without asking the lock manager, and can leave a lane conflict to its caller.
--
-- With several worker processes on one queue, a claim meets the rows other claims are
-- taking at that moment. FOR UPDATE SKIP LOCKED skips each only after the lock manager
-- has looked at it (heap_lock_tuple), which was half of what a claim costs beyond a
-- lone worker's (docs/benchmarks.md, "Skipping rows that claims in flight hold"). A row
-- that a transaction locks or updates holds its id in xmax, so with skip_in_flight a
-- claim drops, before locking, the rows whose xmax is a transaction that was running
-- when the claim began (pg_current_snapshot()) or one that began since (an id at most
-- 2^20 ahead of the snapshot's xmax). A plain "xmax = 0" would be wrong: a queued row
-- keeps the id of a locker that has finished (a dependency edge's foreign-key check, an
-- enqueue that inserted a parent and its children, a rolled-back lock) until it is next
-- updated, and every claim would pass it over until then.
--
-- The filter can be fooled only by a MultiXactId in xmax (two transactions that locked
-- the row together), whose number is read as if it were a transaction id: if it equals a
-- running transaction's, or lies just ahead of the next one, the row is passed over
-- until that changes, which on a quiet database can take days. That is why the filter is
-- the caller's choice and off by default; the worker uses it on most walks and walks
-- from the left edge to its position without it at least every 30 s
-- (src/worker/claim_cursor.rs). The filter is also off, whatever the caller asks, in a
-- transaction that already has an id (its own locks would look like a claim begun since)
-- and outside READ COMMITTED (a transaction snapshot would keep listing lockers that have
-- finished).
--
-- Row locks taken inside a subtransaction carry the subtransaction's id, which
-- pg_current_snapshot() does not list, so the filter only sees what claims hold that
-- lock outside one. The claim used to run inside one always (the EXCEPTION block that
-- retries a lane conflict without lane jobs): with retry_lane_conflict => false it runs
-- without it, and a lane conflict (a unique_violation on jobs_ordering_key_running_idx,
-- two claims taking jobs of one lane at once, rare) fails the statement, having claimed
-- nothing; the caller retries with take_lanes => false. The worker does. Called as
-- before, the function retries inside as it always did and never fails on what the rows
-- hold.
--
-- The signature grows by three parameters with defaults, so the function is dropped and
-- created again; calls with the old arguments resolve to it unchanged. (Both statements
-- may run again on a schema that has them, as a ledger repaired by hand would ask.)

-- The old function's privileges and owner, to give the new one (a dropped function takes
-- its grants with it).
CREATE TEMPORARY TABLE claim_batch_before ON COMMIT DROP AS
    SELECT proacl, proowner::regrole AS owner FROM pg_proc
    WHERE oid = to_regprocedure(
        'skiplock.claim_batch(text[], text[], bigint, text, smallint, bigint, bigint, uuid)');

DROP FUNCTION IF EXISTS skiplock.claim_batch(text[], text[], bigint, text, smallint, bigint, bigint, uuid);

CREATE OR REPLACE FUNCTION skiplock.claim_batch(queues text[], kinds text[], max_jobs bigint, worker text,
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
BEGIN
    IF retry_lane_conflict AND take_lanes THEN
        -- The claim inside a subtransaction: a lane conflict it could not see rolls back
        -- only that, and the claim runs again without lane jobs.
        BEGIN
            RETURN QUERY SELECT * FROM skiplock.claim_batch(queues, kinds, max_jobs, worker,
                after_priority, after_scheduled_at_us, after_id, claim_with, skip_in_flight,
                true, false);
            RETURN;
        EXCEPTION WHEN unique_violation THEN
            RETURN QUERY SELECT * FROM skiplock.claim_batch(queues, kinds, max_jobs, worker,
                after_priority, after_scheduled_at_us, after_id, claim_with, skip_in_flight,
                false, false);
            RETURN;
        END;
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
        FROM unnest(queues) AS qn(name)
        CROSS JOIN LATERAL (
            SELECT j.ctid, j.priority, j.scheduled_at, j.id FROM skiplock.jobs j
            WHERE j.queue = qn.name AND j.state = 'queued' AND j.scheduled_at <= now()
              AND (j.priority, j.scheduled_at, j.id) > (from_priority, from_scheduled_at, from_id)
              AND j.kind = ANY (kinds)
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
            LIMIT max_jobs
            FOR UPDATE OF j SKIP LOCKED
        ) p
        WHERE NOT EXISTS (
            SELECT 1 FROM skiplock.queues q WHERE q.name = qn.name AND q.paused)
        ORDER BY p.priority, p.scheduled_at, p.id
        LIMIT max_jobs
    ), claimed AS (
        UPDATE skiplock.jobs j
        SET state = 'running', claim_token = coalesce(claim_with, gen_random_uuid()), claimed_by = worker,
            claimed_at = now(), heartbeat_at = clock_timestamp(),
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
END;
$$;

COMMENT ON FUNCTION skiplock.claim_batch(text[], text[], bigint, text, smallint, bigint, bigint, uuid, boolean, boolean, boolean) IS
    'Claims up to max_jobs runnable jobs (what a worker runs), after the given claim key if any; each comes back with its fencing claim_token (claim_with when given). skip_in_flight passes over rows other claims are taking without the lock manager (off by default: see migrations/0010); with retry_lane_conflict => false a lane conflict raises unique_violation instead of being retried with take_lanes => false.';

DO $$
DECLARE
    before record;
    grant_to record;
BEGIN
    SELECT * INTO before FROM claim_batch_before;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    EXECUTE format('ALTER FUNCTION skiplock.claim_batch(text[], text[], bigint, text, smallint, '
        'bigint, bigint, uuid, boolean, boolean, boolean) OWNER TO %s', before.owner);
    IF before.proacl IS NULL THEN
        RETURN;  -- the defaults, as the new function has
    END IF;
    REVOKE ALL ON FUNCTION skiplock.claim_batch(text[], text[], bigint, text, smallint, bigint,
        bigint, uuid, boolean, boolean, boolean) FROM PUBLIC;
    FOR grant_to IN
        SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS name,
               a.is_grantable
        FROM aclexplode(before.proacl) a LEFT JOIN pg_roles r ON r.oid = a.grantee
        WHERE a.privilege_type = 'EXECUTE'
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION skiplock.claim_batch(text[], text[], bigint, '
            'text, smallint, bigint, bigint, uuid, boolean, boolean, boolean) TO %s%s',
            grant_to.name, CASE WHEN grant_to.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END;
$$;
