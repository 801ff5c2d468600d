-- skiplock schema, version 6: a claim's first heartbeat is the time it took the rows, not
-- the time its transaction began.
--
-- claim_batch stamped heartbeat_at with now(), which Postgres fixes when the transaction
-- starts. A claim that waited behind a lock (an operator's LOCK TABLE, a migration's
-- ACCESS EXCLUSIVE lock, a stalled server) for longer than the stale timeout committed its
-- jobs already stale, and the next reaper pass took them back while their worker was
-- starting them: they ran twice, the first run fenced out. The first heartbeat is now
-- clock_timestamp() at the update, as every later heartbeat already is. claimed_at stays
-- the claim transaction's start (now()), which is when the worker asked.
--
-- Only the SET list of the update differs from version 2; the function is replaced whole
-- because Postgres has no other way to change a function's body.

CREATE OR REPLACE FUNCTION skiplock.claim_batch(queues text[], kinds text[], max_jobs bigint, worker text,
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
SET plan_cache_mode = force_generic_plan
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
                SELECT p.ctid
                FROM unnest(queues) AS qn(name)
                CROSS JOIN LATERAL (
                    SELECT j.ctid, j.priority, j.scheduled_at, j.id FROM skiplock.jobs j
                    WHERE j.queue = qn.name AND j.state = 'queued' AND j.scheduled_at <= now()
                      AND (j.priority, j.scheduled_at, j.id) > (from_priority, from_scheduled_at, from_id)
                      AND j.kind = ANY (kinds)
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
