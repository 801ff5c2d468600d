-- skiplock schema, version 9: a claim that can start where the last one ended.
--
-- Every claim walked jobs_claim_idx from its left edge. A claimed job leaves its entry
-- there (the new row version is `running`, outside the partial index, and the old one
-- stays until no snapshot can see it). Normally Postgres soon marks such entries dead and
-- later claims skip them for free; while any transaction holds an older snapshot (a long
-- report, pg_dump, a forgotten BEGIN in psql) it cannot, and every claim steps over the
-- entries of every job claimed since that snapshot began, fetching each heap row to check
-- it: measured here, 20 ms per claim of 1,000 after 100,000 claims under a held snapshot,
-- against 0.5 ms from the position of the last claim. The drain becomes quadratic.
--
-- So the claim takes an optional position, the claim key (priority, scheduled_at, id) of
-- the last job the caller claimed, and walks from just after it. The worker keeps that
-- position per producer. It still walks from the left edge (a full walk) whenever that
-- costs no more than a walk from the position, which is always in a clean database, and
-- otherwise paced by what it costs beyond one: for the jobs that land behind the
-- position (a higher priority, a job that waited for its parents or its lane and became
-- queued with its old scheduled_at, an insert whose transaction committed late, a paused
-- queue resumed), and to keep the left edge tidy. See src/worker/claim_cursor.rs.
--
-- The position's scheduled_at travels as microseconds since the Unix epoch (bigint), so
-- that a row scheduled at '-infinity' (the table accepts it) is claimed like any other:
-- it is sent as the bigint minimum, which means '-infinity' here.
DROP FUNCTION skiplock.claim_batch(text[], text[], bigint, text);

CREATE FUNCTION skiplock.claim_batch(queues text[], kinds text[], max_jobs bigint, worker text,
                                     after_priority smallint DEFAULT NULL,
                                     after_scheduled_at_us bigint DEFAULT NULL,
                                     after_id bigint DEFAULT NULL)
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
            -- As 0007's claim, from the position on.
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
                SET state = 'running', claim_token = gen_random_uuid(), claimed_by = worker,
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
