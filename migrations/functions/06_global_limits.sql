-- migrations/functions/06_global_limits.sql: Global limits: max_running and rate limits per
-- queue, and key_max_running per concurrency key, read and recorded by the claim.
--
-- Defines:
--   internal_queue_limit_lock_id, internal_make_rate_ring, internal_rate_room
--   internal_rate_record, internal_key_running, internal_hold_full_keys
--   internal_release_held

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

-- ---- Per-key concurrency (skiplock.queues.key_max_running) -------------------------------
--
-- At most key_max_running of a queue's jobs with one concurrency_key run at once, across
-- every worker. Held by the claim, under the queue's lock like the queue's own limits: for
-- each job with a key it counts the key's running jobs and takes no more than they leave.
--
-- So that a claim never walks the backlog of a full key (one tenant's million jobs ahead
-- of a thousand small tenants' few), the claim first holds back the queued, due jobs of
-- every key that is full: they go to `waiting`, out of the claim's index
-- (internal_hold_full_keys). They come back, in claim order and as many as the key has
-- room for, when a job of the key ends or a queued one is cancelled (internal_notify_freed),
-- when the limit is raised or removed (the queues' triggers), and at the periodic sweep of
-- waiting jobs (internal_release_held). Holding and letting go both take the queue's lock,
-- so a slot that frees while a claim holds a job back is seen by one of the two. A job
-- becomes held only by a claim, never by its enqueue: an enqueue takes no lock. The cost
-- of holding follows the keys that are full (found among the running jobs) and the jobs
-- held, each once; a claim's own cost follows the jobs it takes.
--
-- Lane jobs (ordering_key) are never held: their lane already keeps one of them queued. A
-- job with a key and parents is held like any other once its parents succeeded.

-- The running jobs of a queue's key, counted up to `cap`.
CREATE OR REPLACE FUNCTION skiplock.internal_key_running(queue_name text, key text, cap int)
RETURNS int
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
    SELECT count(*)::int FROM (
        SELECT FROM skiplock.jobs_live j
        WHERE j.queue = queue_name AND j.state = 'running' AND j.concurrency_key = key
        LIMIT cap) r;
$$;

-- Holds back the queued, due jobs of the queue's keys that are full (key_max_running of
-- their jobs running): they become `waiting` until internal_release_held lets them go. The
-- full keys are found among the queue's running jobs with a key (at most the slots in
-- use), the held jobs in each key's range; rows other transactions hold are left. Called
-- by the claim under the queue's lock. Returns how many it held back.
CREATE OR REPLACE FUNCTION skiplock.internal_hold_full_keys(queue_name text, key_max_running int)
RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    held int;
BEGIN
    WITH full_keys AS (
        SELECT r.concurrency_key AS key
        FROM skiplock.jobs_live r
        WHERE r.queue = queue_name AND r.state = 'running' AND r.concurrency_key IS NOT NULL
        GROUP BY r.concurrency_key
        HAVING count(*) >= key_max_running
    ), held AS (
        UPDATE skiplock.jobs_live j SET state = 'waiting'
        WHERE j.ctid = ANY (ARRAY(
            SELECT h.ctid
            FROM full_keys f
            CROSS JOIN LATERAL (
                SELECT h.ctid FROM skiplock.jobs_live h
                WHERE h.queue = queue_name AND h.state = 'queued'
                  AND h.concurrency_key = f.key AND h.scheduled_at <= now()
                  AND h.ordering_key IS NULL
                FOR UPDATE SKIP LOCKED) h))
        RETURNING 1
    )
    SELECT count(*) INTO held FROM held;
    RETURN held;
END;
$$;

-- Lets held jobs of a queue go, in claim order, as many per key as the key has room for:
-- key_max_running less its running and queued due jobs (all of them when the queue has no
-- key_max_running any more). `keys`: the keys to look at; NULL: every key with waiting
-- jobs in the queue (a limit raised or removed). A held job is a waiting job with a key,
-- no lane and no parent that has not succeeded. Takes the queue's lock (see above);
-- announces what it queued; returns how many.
CREATE OR REPLACE FUNCTION skiplock.internal_release_held(queue_name text, keys text[])
RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    key_limit int;
    released int;
    released_keys skiplock.runnable_key[];
BEGIN
    PERFORM pg_advisory_xact_lock(skiplock.internal_queue_limit_lock_id(queue_name));
    SELECT q.key_max_running INTO key_limit FROM skiplock.queues q WHERE q.name = queue_name;
    WITH looked_at AS (
        SELECT DISTINCT k.key FROM unnest(keys) AS k(key) WHERE k.key IS NOT NULL
        UNION
        SELECT DISTINCT w.concurrency_key FROM skiplock.jobs_live w
        WHERE keys IS NULL AND w.queue = queue_name AND w.state = 'waiting'
          AND w.concurrency_key IS NOT NULL
    ), room AS (
        SELECT l.key, key_limit - (
            SELECT count(*) FROM (
                SELECT FROM skiplock.jobs_live r
                WHERE r.queue = queue_name AND r.state IN ('running', 'queued')
                  AND r.concurrency_key = l.key
                  AND (r.state = 'running' OR r.scheduled_at <= now())
                LIMIT key_limit) t) AS room
        FROM looked_at l
    ), released AS (
        UPDATE skiplock.jobs_live j SET state = 'queued'
        WHERE j.ctid = ANY (ARRAY(
            SELECT h.ctid
            FROM room r
            CROSS JOIN LATERAL (
                SELECT h.ctid FROM skiplock.jobs_live h
                WHERE h.queue = queue_name AND h.state = 'waiting'
                  AND h.concurrency_key = r.key AND h.ordering_key IS NULL
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
