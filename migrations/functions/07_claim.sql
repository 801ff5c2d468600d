-- migrations/functions/07_claim.sql: Claim and completion: the worker's own statements.
--
-- Defines:
--   internal_taken_in_flight, internal_claim_batch, internal_others_claiming
--   internal_complete_claims, internal_complete_handing_on

-- ---- Claim and completion (the worker's own statements) ----------------------------------

-- The worker's claim: up to max_jobs runnable jobs of one queue and the given kinds (NULL
-- kinds: every kind), in claim order (priority, scheduled_at, id), after the given claim
-- key if any (`after`: {priority, scheduled_at in microseconds since the epoch with the
-- least bigint for '-infinity', id}, as the claim returns them), each stamped with a fresh claim_token (claim_with when given, so a caller
-- whose reply was lost can find what it took), claimed_by, clock_timestamp() as first
-- heartbeat (now(), the transaction's start, would commit a claim that waited behind a
-- lock already stale) and attempt + 1. Internal: its arguments follow the Rust worker's
-- machinery (src/worker/claim_cursor.rs) and change with it; skiplock.claim is the stable
-- form. docs/architecture.md, "The claim path", has the reasons and the measurements.
--
-- * It reads the queue's row of skiplock.queues once (paused: nothing; limits), then walks
--   the queue's range of jobs_claim_idx in claim order and locks with FOR UPDATE SKIP
--   LOCKED: claimers never wait on each other and never take the same row.
-- * The plan is fixed to that ordered walk (no sort, no bitmap or sequential scan) and
--   made once per connection: a plan made while the table was empty once sorted every
--   queued row on each claim, and re-planning cost half an idle claim.
-- * Lanes are not its concern: a lane's queued job is the one whose turn it is
--   (jobs_lane_turn_idx), admitted by the writers that give turns, so it is taken like
--   any other job and no two claims can take two jobs of one lane.
-- * A queued row moved to jobs_done (cancelled) after the statement's snapshot cannot be
--   followed by FOR UPDATE: the statement fails with serialization_failure (40001) having
--   claimed nothing, and the caller claims again (the worker does; skiplock.claim does
--   it in a subtransaction). Outside a subtransaction, so the in-flight filter sees what
--   other claims hold.
-- * skip_in_flight passes over rows whose xmax is a transaction running when the claim
--   began (pg_current_snapshot()) or begun since, before FOR UPDATE SKIP LOCKED takes
--   each to the lock manager: with several worker processes on one queue, most of what a
--   claim meets is rows other claims are taking. Not "xmax = 0": a queued row keeps the id
--   of a locker that has finished until it is next updated. A MultiXactId in xmax read as
--   a transaction id can make a row look taken while that lasts, so the filter is the
--   caller's choice, and the worker walks without it from the start at least every 30 s.
--   It is off in a transaction that already has an id and outside READ COMMITTED.
-- * Rows are locked first and updated by ctid (no second index descent); the result is
--   sorted after the update has finished, so an update that fails has returned nothing.
-- * Global limits (see 06_global_limits.sql): a claim of a limited queue takes at most
--   the room the queue's max_running and rate_limit leave, and of each concurrency key no
--   more than key_max_running less the key's running jobs and than its rate window
--   (key_rate_limit) allows, in the queue's turn (a claim share instead, for a queue
--   whose only limit is max_running while at most half of it runs), and only in READ
--   COMMITTED. With
--   key_max_running it first holds back the jobs of the keys that are full, with
--   key_rate_limit it first lets go the jobs of keys whose windows have room again, and
--   it holds back the jobs of the keys whose windows it fills. The jobs it claims carry
--   the time the limits were checked at as claimed_at (now() otherwise).
-- * Fair queueing (key_claimable, 06_global_limits.sql): admission, not a check of the
--   walk. The claim first lets go the held jobs of the keys left for it, and leaves the
--   keys it took that have held jobs for the next claim; when it comes back short (or
--   empty, beside another claim in flight), it takes the held jobs of the keys whose turns
--   came itself (nothing else was there to take), through the in-flight filter too.

-- Whether a row's xmax is a transaction running when the claim began (in_flight, from its
-- snapshot) or begun since (an id within 2^20 past next_xid, modulo the 32 bits xmax holds):
-- the in-flight filter of both walks of internal_claim_batch (see above). A plain SQL
-- expression, inlined into the walks: no call per row.
CREATE OR REPLACE FUNCTION skiplock.internal_taken_in_flight(row_xmax xid, in_flight xid[],
                                                             next_xid bigint)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT row_xmax <> '0'::xid
       AND (row_xmax = ANY (in_flight)
            OR (row_xmax::text::bigint - next_xid + 4294967296) % 4294967296 < 1048576);
$$;

CREATE OR REPLACE FUNCTION skiplock.internal_claim_batch(queue_name text, kinds text[],
                                                         max_jobs bigint, worker text,
                                                         after bigint[] DEFAULT NULL,
                                                         claim_with uuid DEFAULT NULL,
                                                         skip_in_flight boolean DEFAULT false)
RETURNS TABLE (id bigint, queue text, kind text, args jsonb, attempt int, max_attempts int,
               claim_token uuid, priority smallint, scheduled_at_us bigint, traceparent text,
               tracestate text, key_limited boolean)
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

-- Of the given queues, those in which a claimer other than `worker` holds running jobs: a
-- worker keeps fewer claims and writes in flight on a queue it shares, so that the
-- processes' claims step over fewer of each other's rows (src/worker/sharing.rs). One call
-- for all of a worker's queues; each reads the running jobs' partial index and stops at the
-- first other claimer found.
CREATE OR REPLACE FUNCTION skiplock.internal_others_claiming(queues text[], worker text)
RETURNS text[]
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
    SELECT coalesce(array_agg(q.name), '{}')
    FROM unnest(queues) AS q(name)
    WHERE EXISTS (
        SELECT 1 FROM skiplock.jobs j
        WHERE j.state = 'running' AND j.queue = q.name
          AND j.claimed_by IS DISTINCT FROM worker);
$$;
COMMENT ON FUNCTION skiplock.internal_others_claiming(text[], text) IS
    'Of the given queues, those in which a claimer other than the given one holds running jobs. What a worker calls to choose how many claims and writes it keeps in flight; internal, not stable.';

-- The worker's completion: the jobs still holding the given tokens succeed. The slots they
-- free are left for the next claim (internal_notify_freed), unless free_slots is false:
-- then the caller frees them (internal_complete_handing_on).
CREATE OR REPLACE FUNCTION skiplock.internal_complete_claims(ids bigint[], tokens uuid[],
                                                             free_slots boolean DEFAULT true)
RETURNS TABLE (id bigint, state text, has_dependants boolean, ordering_key text,
               queue text, concurrency_key text)
LANGUAGE sql
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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
COMMENT ON FUNCTION skiplock.internal_complete_claims(bigint[], uuid[], boolean) IS
    'Marks the given running jobs succeeded, each only if it still holds the given claim token, locking them in the order given (pass them sorted by id, as a worker does); returns those it changed, with what the worker does next for each (its dependants, its lane). What a worker calls.';

-- internal_complete_claims for a worker that takes its keys' freed slots (hand_to): the
-- completion first, in a statement of its own (its triggers fire before the handoff's),
-- then the slots its jobs freed (internal_free_slots, 06_global_limits.sql), handed on to
-- hand_to with hand_token where the rule allows. Returns the completed jobs, then the jobs
-- handed on (`running`, with the claim's columns). A statement of its own for the worker's
-- batches with a job whose key has a running limit: the plain completion, planned at every
-- call, stays as small as it was (this one's plan made it 30 % dearer for one job).
CREATE OR REPLACE FUNCTION skiplock.internal_complete_handing_on(ids bigint[], tokens uuid[],
                                                                 hand_to text,
                                                                 hand_kinds text[],
                                                                 hand_token uuid)
RETURNS TABLE (id bigint, state text, has_dependants boolean, ordering_key text,
               queue text, kind text, args jsonb, attempt int, max_attempts int,
               claim_token uuid, priority smallint, scheduled_at_us bigint, traceparent text,
               tracestate text)
LANGUAGE plpgsql
SET jit = off
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
COMMENT ON FUNCTION skiplock.internal_complete_handing_on(bigint[], uuid[], text, text[], uuid) IS
    'As internal_complete_claims, then hands each key''s freed slot of a queue whose one limit is key_max_running on to hand_to: the key''s next due job, claimed with hand_token, when no other key''s due job is ahead of it (returned after the completed ones, state running, with the claim''s columns). What a worker calls; internal, not stable.';
