-- skiplock schema, version 12: a claim can carry a token the caller chose.
--
-- When the connection dies between the claim's commit and its reply (a server restart, a
-- failover, a network cut), the worker never learned which jobs it claimed. They stayed
-- `running` with nobody heartbeating them until the reaper took them back, a stale
-- timeout later (30 s by default) with an attempt spent, and a worker run with
-- --exit-when-idle could exit before they ran. Now the worker passes a fresh token with
-- every claim (claim_with); every job that claim takes holds it as its claim_token, so
-- after a lost reply the worker finds exactly those jobs by the token and releases them
-- at once, without spending the attempt. A token is still the fence of each job's claim:
-- every claim-holder write matches (id, claim_token), and a new claim gets a new token.
-- Without claim_with each job gets a random token of its own, as before.
DROP FUNCTION skiplock.claim_batch(text[], text[], bigint, text, smallint, bigint, bigint);

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
            -- As 0009's claim, with the caller's token when it gives one.
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

COMMENT ON FUNCTION skiplock.claim_batch(text[], text[], bigint, text, smallint, bigint, bigint, uuid) IS
    'Claims up to max_jobs runnable jobs (what a worker runs), after the given claim key if any; each comes back with its fencing claim_token (claim_with when given).';
