-- migrations/functions/06_global_limits.sql: Global limits: max_running and rate limits per
-- queue, read and recorded by the claim.
--
-- Defines:
--   internal_queue_limit_lock_id, internal_make_rate_ring, internal_rate_room
--   internal_rate_record

-- ---- Global limits (skiplock.queues: max_running, rate_limit per rate_period) -----------
--
-- Held by the claim itself (internal_claim_batch), so every claimer obeys them: the Rust
-- worker, `skiplock work`, skiplock.claim. A claim of a limited queue takes the queue's
-- advisory lock until commit, so the claims of one limited queue take turns; then, in
-- statements that see every claim committed before (READ COMMITTED, which such a claim
-- requires), it counts what the queue runs and reads the starts the rate limit keeps, and
-- claims at most what both leave. A killed worker's claims stay running, and so count,
-- until they are reaped. Running jobs past a lowered limit finish; the claims wait until
-- the queue is under it.

-- The advisory lock id under which a limited queue's claims take turns.
CREATE OR REPLACE FUNCTION skiplock.internal_queue_limit_lock_id(queue_name text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('skiplock.queue_limit:' || queue_name, 0);
$$;

-- Makes a queue's ring of start times for `size` starts: the starts it held, oldest
-- first, at its end, and slots whose start is '-infinity' (free: a whole period old)
-- before them. Runs at the first claim after the limit is set above every limit the ring
-- served before (a ring never shrinks: the starts a lowered limit does not need still
-- count if it is raised again within the period), under the queue's lock; its cost
-- follows the limit.
CREATE OR REPLACE FUNCTION skiplock.internal_make_rate_ring(queue_name text, size int)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    kept timestamptz[];
BEGIN
    kept := ARRAY(SELECT k.t FROM (SELECT s.started_at AS t FROM skiplock.queue_rate_starts s
                                   WHERE s.queue = queue_name AND s.started_at > '-infinity'
                                   ORDER BY s.started_at DESC LIMIT size) k
                  ORDER BY k.t);
    DELETE FROM skiplock.queue_rate_starts s WHERE s.queue = queue_name;
    INSERT INTO skiplock.queue_rate_rings AS r (queue, size, next_slot)
    VALUES (queue_name, internal_make_rate_ring.size, 0)
    ON CONFLICT (queue) DO UPDATE SET size = excluded.size, next_slot = 0;
    INSERT INTO skiplock.queue_rate_starts (queue, slot, started_at)
    SELECT queue_name, i,
           coalesce(kept[i - (internal_make_rate_ring.size - cardinality(kept)) + 1], '-infinity')
    FROM generate_series(0, internal_make_rate_ring.size - 1) AS i;
END;
$$;

-- How many jobs of a rate-limited queue may start at `at` (up to `wanted`): a start may
-- go only once the rate_limit-th start before it is more than rate_period old, so no
-- window of rate_period holds more than rate_limit starts (by the times the claims
-- record, each taken under the queue's lock, after the previous claim committed): exact,
-- not on average. The ring holds the queue's last `size` starts (size >= rate_limit),
-- oldest first from next_slot, so the rate_limit-th before the i-th new start is the
-- (size - rate_limit + i)-th from next_slot. Reads `wanted` slots at most.
CREATE OR REPLACE FUNCTION skiplock.internal_rate_room(queue_name text, rate_limit int,
                                                       rate_period interval, at timestamptz,
                                                       wanted bigint) RETURNS bigint
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    ring skiplock.queue_rate_rings;
    look bigint := least(wanted, rate_limit);
    first_busy bigint;
BEGIN
    SELECT * INTO ring FROM skiplock.queue_rate_rings r WHERE r.queue = queue_name;
    IF ring.queue IS NULL OR ring.size < rate_limit THEN
        PERFORM skiplock.internal_make_rate_ring(queue_name, rate_limit);
        SELECT * INTO ring FROM skiplock.queue_rate_rings r WHERE r.queue = queue_name;
    END IF;
    IF look <= 0 THEN
        RETURN 0;
    END IF;
    SELECT min(i) INTO first_busy
    FROM generate_series(0, look - 1) AS i
    JOIN skiplock.queue_rate_starts s
      ON s.queue = queue_name
     AND s.slot = (ring.next_slot + ring.size - rate_limit + i) % ring.size
    WHERE s.started_at >= at - rate_period;
    RETURN coalesce(first_busy, look);
END;
$$;

-- Records `taken` starts at `at` in the queue's ring, in place of its oldest. When the
-- limit held jobs back, tells the workers when the next start may go (the rate_limit-th
-- start before it a whole period old; skiplock_due_later, from the queue's start): a
-- refilled window is claimed then, not at the next poll.
CREATE OR REPLACE FUNCTION skiplock.internal_rate_record(queue_name text, taken bigint,
                                                         at timestamptz, rate_limit int,
                                                         rate_period interval,
                                                         held_back boolean) RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    ring skiplock.queue_rate_rings;
    refill_in_us bigint;
BEGIN
    SELECT * INTO ring FROM skiplock.queue_rate_rings r WHERE r.queue = queue_name;
    IF taken > 0 THEN
        UPDATE skiplock.queue_rate_starts s SET started_at = at
        WHERE s.queue = queue_name
          AND s.slot = ANY (ARRAY(SELECT (ring.next_slot + i) % ring.size
                                  FROM generate_series(0, least(taken, ring.size) - 1) AS i));
        UPDATE skiplock.queue_rate_rings r
        SET next_slot = ((ring.next_slot + taken) % ring.size)::int
        WHERE r.queue = queue_name;
    END IF;
    IF held_back THEN
        SELECT (extract(epoch FROM s.started_at + rate_period - clock_timestamp()) * 1000000)::bigint + 1
        INTO refill_in_us
        FROM skiplock.queue_rate_starts s
        WHERE s.queue = queue_name
          AND s.slot = (ring.next_slot + taken + ring.size - rate_limit) % ring.size;
        PERFORM pg_notify('skiplock_due_later',
            refill_in_us::text || E'\t' || refill_in_us::text || E'\t'
            || skiplock.internal_runnable_payload(queue_name, (-32768)::smallint, '-infinity'))
        WHERE refill_in_us IS NOT NULL;
    END IF;
END;
$$;
