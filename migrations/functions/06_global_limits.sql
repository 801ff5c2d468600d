-- migrations/functions/06_global_limits.sql: Global limits: max_running and rate limits per
-- queue, and key_max_running and rate limits per concurrency key, read and recorded by the
-- claim.
--
-- Defines:
--   internal_queue_claims_lock_id
--   internal_queue_limit_lock_id, internal_queue_turn_free, internal_key_held_from_lock_id
--   internal_claim_shares
--   internal_claim_share_lock_id
--   internal_claim_share_room, internal_take_claim_share, internal_take_every_claim_share
--   internal_rate_first_busy, internal_make_rate_ring, internal_rate_room
--   internal_rate_full_until, internal_rate_take, internal_notify_refill
--   internal_key_running
--   internal_hold_keys, internal_hold_full_keys, internal_release_held
--   internal_release_passed_over
--   internal_held_from, internal_release_fair_key, internal_release_freed_keys
--   internal_handoff_lock_id, internal_free_slots
--   internal_hold_rate_keys
--   internal_release_refilled_keys, internal_forget_key_limit_rows
--   internal_key_first_held, internal_key_queued, internal_hold_overflow
--   internal_hold_for_turns
--   internal_recheck_keys

-- ---- Global limits (skiplock.queues: max_running, rate_limit per rate_period) -----------
--
-- Held by the claim itself (internal_claim_batch), so every claimer obeys them: the Rust
-- worker, `skiplock work`, skiplock.claim. A claim of a limited queue takes the queue's
-- turn (its advisory lock until commit, so the claims of one limited queue take turns, and
-- its claim shares, below); then, in statements that see every claim committed before
-- (READ COMMITTED, which such a claim requires), it counts what the queue runs and reads
-- the starts the rate limit keeps, and claims at most what both leave. A killed worker's
-- claims stay running, and so count, until they are reaped. Running jobs past a lowered
-- limit finish; the claims wait until the queue is under it.
--
-- Claim shares: a max_running far from binding takes no turns. A claim of a queue whose
-- only limit is max_running, asking at most a share's room (max_running / 16), takes one
-- of the queue's eight claim shares instead of the turn (an advisory lock each; the first
-- free one, or it waits for one when all are held), counts the running jobs, and claims
-- without a turn if the running jobs and eight shares' room fit under max_running (at most
-- half of it runs). Exact at every instant: at most eight claims hold shares at once, each
-- takes at most a share's room, and each checked, after every claim committed before it
-- took its share, that what runs plus the room of every share fits; the turn of such a
-- queue holds every share (internal_take_every_claim_share), so it never overlaps a claim
-- that holds one. A claim that finds the queue more than half full, or paused, gives its
-- share back (taken in a subtransaction, rolled back) before it waits for the turn: it
-- never waits holding one. The claims of one transaction share the share it took (the
-- transaction-local setting skiplock.claim_shares keeps what they took of it), so a
-- transaction never waits for a turn while it holds a share. A change of the limits of a
-- queue that has or had a max_running, and a new row with one, wait for the claims in
-- flight, the turn and every share (internal_queues_after_max_running_change): each of
-- them counted by the limits it read, so no claim after the change overlaps one that
-- shares or takes turns by the old ones; the change ends its own transaction's share,
-- whose next claim counts again. Limits given to a queue that had none wait for its
-- claims in flight too (internal_queue_claims_lock_id).
-- Measured: docs/benchmarks.md, "What each mechanism costs or buys".

-- The lock a claim of a queue without limits (max_running, rate_limit, key_max_running,
-- key_rate_limit) holds shared, from after it read the queue's row to its commit; it then
-- reads the row again. A write that gives the queue limits takes it exclusive
-- (internal_queues_after_limits_set), so it waits for the claims in flight, which took
-- jobs by no limit and hold no turn nor share, and a claim that read no limits before
-- the write committed reads them after (in READ COMMITTED: a claim in REPEATABLE READ
-- reads the row of its snapshot). Without it, a claim after the write counted none of
-- their jobs, not yet committed: 15 ran of a max_running of 5 (a race review). Shared:
-- claims never wait for each other on it; a claim of a limited queue does not take it
-- (it holds the turn or a share, which a change between limits waits for).
CREATE OR REPLACE FUNCTION skiplock.internal_queue_claims_lock_id(queue_name text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('skiplock.queue_claims:' || queue_name, 0);
$$;

-- The advisory lock id under which a limited queue's claims take turns.
CREATE OR REPLACE FUNCTION skiplock.internal_queue_limit_lock_id(queue_name text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('skiplock.queue_limit:' || queue_name, 0);
$$;

-- Whether no claim of a limited queue holds the queue's turn at this instant (its lock
-- taken shared and given back at once, waiting for nothing): every claim that holds the
-- turn after this call took its claim time after it. What lets the sweep forget a rate
-- window a whole period old (internal_forget_key_limit_rows): a claim in flight may have
-- taken its time before the window's expiry, and count on it.
CREATE OR REPLACE FUNCTION skiplock.internal_queue_turn_free(queue_name text) RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    SELECT pg_try_advisory_lock_shared(skiplock.internal_queue_limit_lock_id(queue_name))
           AND pg_advisory_unlock_shared(skiplock.internal_queue_limit_lock_id(queue_name));
$$;

-- The advisory lock under which a key's row of skiplock.key_held_from is written (see
-- internal_release_fair_key); the queue's length first, as a name may hold any character.
CREATE OR REPLACE FUNCTION skiplock.internal_key_held_from_lock_id(queue_name text, key text)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('skiplock.key_held_from:' || length(queue_name) || ':'
                            || queue_name || '/' || key, 0);
$$;

-- How many claims of a queue may hold a claim share at once.
CREATE OR REPLACE FUNCTION skiplock.internal_claim_shares() RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT 8;
$$;

-- The advisory lock id of a queue's claim share `share` (0 to internal_claim_shares() - 1).
CREATE OR REPLACE FUNCTION skiplock.internal_claim_share_lock_id(queue_name text, share int)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('skiplock.claim_share:' || share || ':' || queue_name, 0);
$$;

-- A share's room: the most the claims holding one share of a queue with this max_running
-- take, so that every share's room is half the limit (0: too small a limit to share).
CREATE OR REPLACE FUNCTION skiplock.internal_claim_share_room(max_running int) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT max_running / (2 * skiplock.internal_claim_shares());
$$;

-- Takes one of a queue's claim shares until the transaction ends: the first free one from
-- a place the session chooses (so that claims spread), or, when every share is held, waits
-- for that first one. Waits holding no share and no turn.
CREATE OR REPLACE FUNCTION skiplock.internal_take_claim_share(queue_name text) RETURNS void
LANGUAGE plpgsql AS $$
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

-- Takes every claim share of a queue until the transaction ends, in order, waiting for the
-- claims that hold them: taken after the queue's lock, so that no claim holds a share while
-- the queue's turn lasts (see above). A turn whose max_running is too small to share
-- (internal_claim_share_room 0) takes none: no claim can hold one then.
CREATE OR REPLACE FUNCTION skiplock.internal_take_every_claim_share(queue_name text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 0 .. skiplock.internal_claim_shares() - 1 LOOP
        PERFORM pg_advisory_xact_lock(skiplock.internal_claim_share_lock_id(queue_name, i));
    END LOOP;
END;
$$;

-- ---- Rate windows (rate_limit per rate_period, key_rate_limit per key_rate_period) ------
--
-- One store for the queue's window and each key's (skiplock.rate_windows: the queue's own
-- under the key ''), one rule: a start goes only once the limit-th start of the window
-- before it is more than the period old, so no window of the period holds more than the
-- limit's starts (by the times the claims record, each under the queue's lock, after the
-- previous claim committed): exact, not on average. A claim reads only as many slots as it
-- may take and writes only those it takes, so its cost follows the jobs it claims, not
-- the limit.

-- The first of a window's next new starts, at positions from_i to to_i (from 0), that may
-- not go at `at` under rate_limit per rate_period, and the start that holds it back: the
-- i-th new start must follow the start rate_limit before it, which the ring (next_slot,
-- size, oldest first) holds at the (size - rate_limit + i)-th slot from next_slot, by more
-- than the period (a slot never written, or before a ring smaller than the limit, holds
-- none). No row: every one of them may go. The one rule of every window, inlined into its
-- callers' statements (a SQL function in FROM): a LATERAL probe per position, as a join
-- let the planner read every slot of the window (a hash of them), so that a claim cost
-- what the limit allows instead of what it takes.
CREATE OR REPLACE FUNCTION skiplock.internal_rate_first_busy(queue_name text, key text,
                                                             next_slot int, size int,
                                                             rate_limit int,
                                                             rate_period interval,
                                                             at timestamptz, from_i bigint,
                                                             to_i bigint)
RETURNS TABLE (i bigint, started_at timestamptz)
LANGUAGE sql STABLE AS $$
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

-- Makes a window's ring for `size` starts: the starts it held, oldest first, at its end,
-- and slots never written (counted as '-infinity') before them. Runs when a window takes
-- its first start, and after its limit is raised above every limit the ring served before
-- (a ring never shrinks: the starts a lowered limit does not need still count if it is
-- raised again within the period), under the queue's lock; its cost follows the starts
-- kept.
CREATE OR REPLACE FUNCTION skiplock.internal_make_rate_ring(queue_name text, key text, size int)
RETURNS void
LANGUAGE plpgsql AS $$
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

-- How many jobs of a window (the queue's: key '') may start at `at`, up to `wanted`, under
-- a limit of rate_limit per rate_period (NULL without a limit): the new starts up to the
-- first whose rate_limit-th start before it is not a whole period old. Reads
-- min(wanted, rate_limit) slots at most; writes nothing.
CREATE OR REPLACE FUNCTION skiplock.internal_rate_room(queue_name text, key text,
                                                       rate_limit int, rate_period interval,
                                                       at timestamptz, wanted bigint)
RETURNS bigint
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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

-- When a window (the queue's: key '') full at `at` has room for a start again: its
-- rate_limit-th newest start a whole period old; NULL when it has room.
CREATE OR REPLACE FUNCTION skiplock.internal_rate_full_until(queue_name text, key text,
                                                             rate_limit int,
                                                             rate_period interval,
                                                             at timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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

-- Takes up to wanted[n] starts of the window of keys[n] (the queue's: key '') at `at`, for
-- each n, and records them in place of their oldest, making or growing a ring first when
-- it holds fewer than rate_limit; returns per key `took`, how many, and `full_until`, when
-- the window has room again if it is full after them (NULL when it has room). A key's
-- window full after them is marked for internal_hold_rate_keys and keeps when it has room
-- again: the key's jobs queued later, and those held before, wait for that. Called by the
-- claim under the queue's lock: for the queue's window with the jobs it took (its room
-- read before, internal_rate_room), and for the keys among the jobs it picked. Three
-- statements, whatever the keys and the limit: the windows' rows locked (the sweep deletes
-- a window once it counts nothing and skips one a claim holds; one it deleted meanwhile
-- is made again, as a start of it would refer to no window), those missing, and one that
-- reads, for each window, the first busy slot up to the one after those it may take (it
-- ends the take, and once they are taken it is the rate_limit-th start before the next),
-- writes the slots taken and the window's row.
CREATE OR REPLACE FUNCTION skiplock.internal_rate_take(queue_name text, keys text[],
                                                       wanted bigint[], at timestamptz,
                                                       rate_limit int, rate_period interval)
RETURNS TABLE (key text, took bigint, full_until timestamptz)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
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

-- Tells the workers that a queue's claims may take more at `refill_at` (a rate window with
-- room again): skiplock_due_later, due then, from the queue's start, where what the limit
-- held back waits. A microsecond later than the time given: a start is allowed only once
-- the start it follows by rate_limit is more than the period old.
CREATE OR REPLACE FUNCTION skiplock.internal_notify_refill(queue_name text, refill_at timestamptz)
RETURNS void
LANGUAGE sql AS $$
    SELECT pg_notify('skiplock_due_later', in_us::text || E'\t' || in_us::text || E'\t'
                     || skiplock.internal_runnable_payload(queue_name, (-32768)::smallint, '-infinity'))
    FROM (SELECT (extract(epoch FROM refill_at - clock_timestamp()) * 1000000)::bigint + 1 AS in_us) t
    WHERE refill_at IS NOT NULL;
$$;

-- ---- Per-key concurrency (skiplock.queues.key_max_running) -------------------------------
--
-- At most key_max_running of a queue's jobs with one concurrency_key run at once, across
-- every worker. Held by the claim, under the queue's lock like the queue's own limits: for
-- each job with a key it counts the key's running jobs and takes no more than they leave.
--
-- So that a claim never walks the backlog of a full key (one tenant's million jobs ahead
-- of a thousand small tenants' few), the claim first holds back the queued jobs of
-- every key that is full: they go to `waiting` with held_for 'key', out of the claim's
-- index and into jobs_held_idx (internal_hold_full_keys), apart from the key's jobs
-- waiting for their parents, which letting them go never walks. They come back, in claim order and as many as the key has
-- room for, when a job of the key ends or a queued one is cancelled (internal_notify_freed
-- leaves the key for the queue's next claim: internal_release_freed_keys),
-- when the limit is raised or removed (the queues' triggers), and at the periodic sweep of
-- waiting jobs (internal_release_held). Holding and letting go both take the queue's lock,
-- so a slot that frees while a claim holds a job back is seen by one of the two. A job
-- becomes held only by a claim, never by its enqueue: an enqueue takes no lock. The cost
-- of holding follows the keys that are full (found among the running jobs) and the jobs
-- held, each once; a claim's own cost follows the jobs it takes.
--
-- Lane jobs (ordering_key) are never held: their lane already keeps one of them queued. A
-- job with a key and parents is held like any other once its parents succeeded.

-- The running jobs of a queue's key, counted up to `cap`. PL/pgSQL, as the hold and
-- release functions below: the claim calls them at every claim of a key-limited queue, and
-- Postgres 15 plans a SQL function's body at every call (see 02_notifications.sql).
CREATE OR REPLACE FUNCTION skiplock.internal_key_running(queue_name text, key text, cap int)
RETURNS int
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
BEGIN
    RETURN (SELECT count(*)::int FROM (
        SELECT FROM skiplock.jobs_live j
        WHERE j.queue = queue_name AND j.state = 'running' AND j.concurrency_key = key
        LIMIT cap) r);
END;
$$;

-- Holds back the queued jobs of the given keys of a queue, due or not: they become
-- `waiting`, held_for `reason` ('key' or 'rate'), until internal_release_held lets them go. Each key's queued jobs are a range of
-- jobs_concurrency_key_idx, held whole: holding only the due ones walked the key's jobs
-- scheduled for later (retries waiting for their backoff) at every claim, as the index is
-- in claim order, not by time. Lane jobs stay (their lane queues one at a time), and rows
-- other transactions hold are left. Called by the claim under the queue's lock. Returns
-- how many it held back.
CREATE OR REPLACE FUNCTION skiplock.internal_hold_keys(queue_name text, keys text[], reason text)
RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
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

-- Holds back the queued jobs of the queue's keys that are full (key_max_running of
-- their jobs running), found among the queue's running jobs with a key (at most the slots
-- in use). Called by the claim under the queue's lock. Returns how many it held back.
CREATE OR REPLACE FUNCTION skiplock.internal_hold_full_keys(queue_name text, key_max_running int)
RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
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

-- Lets held jobs of a queue go, in claim order, as many per key as the key has room for:
-- key_max_running less its running jobs, the starts its rate window allows now, and
-- key_claimable less its due queued jobs (internal_key_queued); all of them when the queue
-- has none of these any more. In a queue with key_claimable, each goes behind what is
-- queued now (scheduled_at moved to now() if earlier). `keys`: the keys to look at; NULL:
-- every key with held jobs in the queue (a limit raised or removed), each found once (a
-- skip over jobs_held_idx, so its cost follows the keys, not their jobs). Held jobs are
-- the waiting ones with held_for set: the key's jobs waiting for their parents or their
-- lane are not walked (a held job is one that could run but for its key; one whose parent
-- was retried by hand since, or that was given a parent by hand, is passed over until that
-- parent succeeds). Takes the queue's lock when the queue has a per-key limit (see above);
-- announces what it queued; returns how many.
CREATE OR REPLACE FUNCTION skiplock.internal_release_held(
    queue_name text, keys text[], marks skiplock.key_slots_freed[] DEFAULT NULL)
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

-- For a writer that holds locked a job held back for its key (held_for 'key', 'rate' or
-- 'fair'): the releases that let the key's held jobs go pass over locked rows (SKIP
-- LOCKED, a claim must never wait for an application's transaction), so the release that
-- may pass over this one meanwhile is asked for again. 'key': the key's slot is left freed
-- for the next claim, which lets the key's held jobs go (or holds them again); 'fair': the
-- key's turn is looked at again; 'rate', only where the caller's transaction ends at once
-- (lock_rate_window: skiplock.watch_job, a waiter's mark), the key's window row is locked
-- too, so that a claim letting the key go waits for this transaction and then finds the
-- row unlocked. An enqueue (the edge trigger for a child's parent,
-- internal_unique_key_holder for its unique key's holder) runs in an application's
-- transaction, which a claim must not wait for: a job held for its key's window that an
-- enqueue holds locked when the window refills waits for the sweep. Without this a release
-- that passed over the row left it held, with its key's slot free, until the sweep (a race
-- review). As the owner (SECURITY DEFINER): a waiter or an enqueuer has no privilege on
-- the limits' tables, and this can do nothing but have a key's held jobs let go, which a
-- claim holds back again while the key is full.
CREATE OR REPLACE FUNCTION skiplock.internal_release_passed_over(queue text, key text,
                                                                 held_for text,
                                                                 lock_rate_window boolean)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
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

-- Where a walk of a fair queue's key's held jobs starts, as (priority, scheduled_at, id):
-- the key's row of key_held_from, or the earliest of the given marks (rows of
-- key_slots_freed left by holds) of the key when one is earlier; the front of the key's
-- range, (-32768, '-infinity', the least bigint), for a key without a row (see the table).
CREATE OR REPLACE FUNCTION skiplock.internal_held_from(queue_name text, key text,
                                                       marks skiplock.key_slots_freed[],
                                                       OUT priority smallint,
                                                       OUT scheduled_at timestamptz,
                                                       OUT id bigint)
LANGUAGE sql STABLE
SET jit = off
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

-- Lets go one key's held jobs in a queue with key_claimable and no other per-key limit, as
-- internal_release_held does (as many as key_claimable leaves; with more than twice that
-- queued, it holds them first: internal_hold_overflow), walking from where they
-- start (internal_held_from: the key's row of key_held_from and the marks given, the rows
-- of key_slots_freed the caller took), then records where they start now: the first job
-- still held from that point on, read after the release (what others hold locked counts as
-- held). The row is written only under the key's advisory lock
-- (internal_key_held_from_lock_id), taken without waiting and before the row is read, so
-- that each writer reads what the one before it committed: two releases that read the row
-- before either committed could otherwise both keep it (one finding the key's first held
-- job unchanged wrote nothing, the other moved it past a job held in between, whose mark
-- the first had taken), and an insert of the row waited for another's. A release that does
-- not get the lock and took marks of the key, or that finds the row locked (a change of the
-- queue's limits deleting it), leaves its position as a row of key_slots_freed instead (a
-- turn of the key too, which only lets go what its room allows); one that took none needs
-- to write nothing (a mark for each release that lost the lock cost 5 to 10 % of a lone
-- key's drain), unless it held jobs itself. A key with nothing held from the walk's start on
-- loses its row (walked from the front next time): jobs held before it are after some
-- other mark. Returns how many it let go.
CREATE OR REPLACE FUNCTION skiplock.internal_release_fair_key(queue_name text, key text,
                                                              claimable int,
                                                              marks skiplock.key_slots_freed[])
RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
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

-- Lets go the held jobs of the keys left in skiplock.key_slots_freed for the queue since
-- its last claim (by internal_notify_freed: slots freed; by a fair queue's claims, inserts
-- and cancels: turns given up), through internal_release_held. Called by the claim, under
-- the queue's lock before it holds full keys back in a queue with key_max_running; a row
-- left by a statement that commits after this one is for the next claim, which the
-- statement's own notification brings. At most 1,000 rows a claim, skipping those another
-- claim is taking (each key's room is counted afresh by whichever claim takes its row):
-- with more, the workers are told to claim again. Returns how many it let go.
CREATE OR REPLACE FUNCTION skiplock.internal_release_freed_keys(queue_name text)
RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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

-- ---- A key's freed slot handed on (the Rust worker's completions) ----------------------
--
-- A worker's completion of a key's job takes the key's next job for the same worker in the
-- same transaction (internal_complete_handing_on, 07_claim.sql), instead of leaving the key
-- for the queue's next claim (internal_notify_freed): the freed slot is taken again when
-- the completion commits, with no notification, no claim and no release between. Exact
-- without the queue's lock: a completion hands on at most as many jobs of a key as it
-- finished, and no more than key_max_running less the key's other running jobs, so the
-- running jobs of a key never grow; every count a claim makes, in a snapshot before or
-- after the completion's commit, sees the same number. Only in a queue whose one limit is
-- key_max_running (no max_running, which a lowered limit would need counted; no rate limit,
-- which would need the start recorded; no fair queueing, whose keys take turns through
-- claims), not paused; only a job due now that the claim would take before any other
-- key's due queued job (claim order across keys: a worker with fewer slots than keys never
-- keeps its keys for good), of the worker's kinds, and, if held, with no unmet parent. It
-- locks only the rows it takes, so a claim's release never finds a key's held job locked
-- by a handoff that did not take it; a row another transaction holds or moved is left, and
-- what is not handed on goes the usual way. A write of the queue's limits or pause waits
-- for the handoffs in flight, and a handoff beside one is not made
-- (internal_handoff_lock_id, the queues' trigger queues_after_handoff_rules_change).
-- Measured: docs/benchmarks.md, "Global limits".

-- The advisory lock a handoff of a queue tries (shared) before it reads the queue's row,
-- and a write of the row's limits or pause takes (exclusive): a handoff reads the limits
-- such a write commits, or commits before it.
CREATE OR REPLACE FUNCTION skiplock.internal_handoff_lock_id(queue_name text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('skiplock.handoff:' || queue_name, 0);
$$;

-- What a worker's completion does with the slots the jobs `done_ids` freed (their queues
-- and keys; internal_complete_handing_on): with hand_to, each key's slots in a queue the
-- rule above allows go to that worker's next jobs of the key, claimed with `token` as the
-- claim does; every slot not handed on is left for the next claim (internal_notify_freed).
-- A candidate moved to jobs_done under the handoff (cancelled, 40001), or one whose row
-- refuses the write, makes it hand on nothing in that queue: the completion never fails
-- for a handoff. Returns the jobs handed
-- on, as the claim returns its jobs.
CREATE OR REPLACE FUNCTION skiplock.internal_free_slots(done_ids bigint[], queues text[],
                                                        keys text[], hand_to text,
                                                        kinds text[], token uuid)
RETURNS TABLE (id bigint, queue text, kind text, args jsonb, attempt int, max_attempts int,
               claim_token uuid, priority smallint, scheduled_at_us bigint, traceparent text,
               tracestate text)
LANGUAGE plpgsql
-- Each walk an ordered range of its index (jobs_held_idx, jobs_concurrency_key_idx,
-- jobs_claim_idx), never a sort of the key's held jobs.
SET enable_sort = off
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
SET plan_cache_mode = force_generic_plan
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

-- ---- Per-key rate limits (skiplock.queues.key_rate_limit per key_rate_period) -----------
--
-- At most key_rate_limit of a queue's jobs with one concurrency_key start in any window of
-- key_rate_period, across every worker: exact in every window, like the queue's rate
-- limit, and kept the same way (a window of skiplock.rate_windows per key, written by the
-- claim under the queue's lock: internal_rate_take).
--
-- As with key_max_running, a key whose window is full has its queued jobs held back
-- (to `waiting`) so that no claim walks its backlog: the claim that fills the window marks
-- it (hold_pending) and holds them before it returns (internal_hold_rate_keys). The window
-- says when it has room again (held_until), and the workers are told (skiplock_due_later):
-- the first claim at or after that time lets the held jobs go, as many as the window and
-- key_max_running leave (internal_release_refilled_keys), and the sweep of waiting jobs
-- does too. A window whose newest start is a period old counts nothing and is deleted
-- (internal_forget_key_limit_rows, from the sweep).

-- Holds back the queued jobs of the keys whose windows the claim filled (marked by
-- internal_rate_take), unmarks them, and tells the workers when the first of those
-- windows that holds jobs back (just held or held before) has room again. Rows other
-- transactions hold are left. Called by the claim under the queue's lock before it
-- returns; its cost follows those keys' jobs, each held once. Returns how many it held
-- back.
CREATE OR REPLACE FUNCTION skiplock.internal_hold_rate_keys(queue_name text)
RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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

-- Lets go the held jobs of the queue's keys whose windows have room again at `at`
-- (held_until passed), through internal_release_held. Called by the claim under the
-- queue's lock before it walks. Returns how many it let go.
CREATE OR REPLACE FUNCTION skiplock.internal_release_refilled_keys(queue_name text, at timestamptz)
RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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

-- Deletes up to 500 windows that count nothing any more (their newest start a whole period
-- old, holding nothing back), oldest first, and up to 500 freed key slots left for a queue
-- that no longer has key_max_running nor key_claimable (its row deleted or changed
-- meanwhile): called by
-- every pass of the waiting sweep, so the windows are those of the queues and keys that
-- started a job within their period. Never waits: a row a claim holds is skipped (the
-- claim holds its queue's lock, which the sweep's caller may want next), a window a claim
-- rewrote is kept (the condition is checked again on the row's newest version), and so is
-- every window of a queue whose turn a claim holds (internal_queue_turn_free): that claim
-- may have taken its time before the window expired, and read the window as it was.
CREATE OR REPLACE FUNCTION skiplock.internal_forget_key_limit_rows() RETURNS int
LANGUAGE sql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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

-- ---- Fair queueing by key (skiplock.queues.key_claimable) --------------------------------
--
-- In a queue with key_claimable, at most that many due jobs of one concurrency_key are
-- queued at once at each priority: a job inserted while its key has that many queued ahead
-- of it (or has jobs held at its priority or better) waits, held_for 'fair' (set by the
-- insert's statement trigger, once per statement), and is let go when
-- one of the key's queued jobs is claimed or cancelled, with scheduled_at moved to then, so
-- it queues behind every job queued before: the keys take turns, and one key's backlog
-- delays another key's next job by at most key_claimable of its jobs per priority. Jobs
-- without a key and lane jobs are never held; what lets a job go is internal_release_held,
-- as for the per-key limits, with the fair room as one more bound. Jobs queued without the
-- insert's hold (scheduled ahead and come due, children, retries) are held once a claim
-- that took some of them finds more than twice key_claimable queued
-- (internal_hold_overflow), and let go again in turn.
-- Nothing here takes a lock: the insert decides on what it sees, the claim lets go on what
-- it sees, and each leaves the key in skiplock.key_slots_freed for the queue's next claim
-- (the insert only for the jobs it held, the claim only for keys with held jobs or more
-- than twice key_claimable queued), which
-- looks at the key again with both committed, so neither order of their commits leaves a
-- key with held jobs and nothing queued. Two claims that let go the same key's jobs at once
-- may queue up to twice key_claimable (more, and the next release of the key holds them
-- again); none is left behind. The cost follows the jobs
-- of keys in such queues: an insert's probes of its key, a held job's two more writes (held
-- after its insert, queued when let go); other inserts pay a probe of skiplock.queues per
-- statement.

-- The priority of a queue's key's most urgent held job; NULL when none is held: that of its
-- last held job, read from the back of the key's range in jobs_held_idx, then any more
-- urgent one. Not from the front: every held job of the key taken since the last vacuum
-- leaves a dead entry there, which a walk from the front steps over (390 pages after 64,000
-- taken, against 4 from the back).
CREATE OR REPLACE FUNCTION skiplock.internal_key_first_held(queue_name text, key text)
RETURNS smallint
LANGUAGE plpgsql STABLE
-- Without a sort, only jobs_held_idx gives the order: through jobs_waiting_idx and a sort
-- (chosen while the statistics said nothing waits) it read every waiting job.
SET enable_sort = off
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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

-- The due queued jobs of a queue's key at its most urgent held job's priority or better
-- (every due queued job when none is held), counted up to `cap`; NULL without a cap.
CREATE OR REPLACE FUNCTION skiplock.internal_key_queued(queue_name text, key text, cap int)
RETURNS int
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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

-- For a key of a fair queue with more than twice `claimable` (its key_claimable) due jobs
-- queued at its most urgent held job's priority or better (as internal_key_queued counts
-- them): what came due or was queued without passing the insert's hold (jobs scheduled
-- ahead, children whose parents succeeded, retries, an operator's retry). Holds every one
-- of them, as `waiting` with held_for 'fair', so that its caller, a release of the key's
-- held jobs (internal_release_fair_key, internal_release_held), lets the first `claimable`
-- go again, in claim order, from jobs_held_idx, behind what is queued. Not at more than
-- `claimable`: two releases of a key at once may leave up to twice that queued, which
-- would then be held and let go again at every such pair. All of them, not those past the
-- first `claimable`: that needs the key's queued jobs in claim order, which jobs_claim_idx
-- gives too, and a plan through it walked every key's queued jobs when the statistics said
-- the queue held one key; this walk is served by the key's range of
-- jobs_concurrency_key_idx alone (see internal_key_queued). Lane jobs count but stay
-- queued, and rows other transactions hold are left (a claim is taking them).
--
-- Only in READ COMMITTED (an older snapshot fails with 40001 on the rows other claims took
-- since), and under the queue's lock, shared and not waited for (the caller's own lock
-- passes), as a row of key_held_from is made: a change of the queue's limits waits for the
-- jobs held here and lets them go. Then the key is looked at again by the claim after this
-- one commits (a row of key_slots_freed) when this held jobs (another claim in flight,
-- taking jobs counted here as queued, and whose snapshot does not see these held, may
-- leave no turn for the key) or could not hold them (the limits are changing); not when it
-- held nothing: the jobs counted are lane heads, which are never held, and another look
-- would find them again at every claim. A claim that took the key's jobs and saw that many
-- left queued leaves the key for this too. It writes as many jobs as came due: one claim
-- holds a burst of them, as their insert would have.
--
-- Returns the first job it held as `mark` (where the key's walks of held jobs must start
-- at the latest; its fields NULL when it held none) and the key's due queued jobs as
-- internal_key_queued counts them, after the hold (at least up to `claimable`).
CREATE OR REPLACE FUNCTION skiplock.internal_hold_overflow(queue_name text, key text,
                                                           claimable int,
                                                           OUT mark skiplock.key_slots_freed,
                                                           OUT queued int)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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

-- Of the given jobs (just inserted), holds those that wait their turn, as `waiting` with
-- held_for 'fair', leaves their keys for their queues' next claims, and returns their ids.
-- A job waits its turn when its key has jobs held at its priority or better, or when the
-- key's due queued jobs at its priority or better, other than the given ones, and the given
-- ones of its key ahead of it in claim order are key_claimable or more (a given job scheduled
-- in the past counts the others as ahead of it). Only a queued, due
-- job with a key and no lane, in a queue with key_claimable, is held, whoever passes it.
-- Set-based: each (queue, key, priority) of the given jobs is probed once, so a statement
-- of a million jobs of one key costs a walk of them, not a count per job. As the owner
-- (SECURITY DEFINER): an enqueuer may not write a job's state.
CREATE OR REPLACE FUNCTION skiplock.internal_hold_for_turns(ids bigint[])
RETURNS bigint[]
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_mergejoin = off
SET jit = off
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

-- Leaves the given keys (parallel arrays of queues and keys, repeats allowed) of queues
-- with key_claimable in skiplock.key_slots_freed for their queues' next claims, and tells
-- the workers to claim (at commit). Called by the insert's statement trigger for the jobs it
-- held and by a cancel of a queued job with a key. marks: for the holds, each key's first
-- job held (as a row of key_slots_freed), whose position its row keeps (see key_held_from).
-- As the owner (SECURITY DEFINER): an enqueuer has no privilege on the table, and this can
-- do nothing but have a key's held jobs looked at again.
CREATE OR REPLACE FUNCTION skiplock.internal_recheck_keys(queues text[], keys text[],
                                                          marks skiplock.key_slots_freed[] DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
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
