-- skiplock schema, version 11: the worker processes of one group share where their claims
-- got to, so that one does not step over what the others claimed.
--
-- Each worker process walks the claim index from just after the last job it claimed. With
-- several processes on one queue, everything the others claimed since lies between that
-- position and the queued rows, and those entries cannot be marked dead while statements
-- that began before those claims still run: each claim read them again, index entry and
-- heap tuple (docs/benchmarks.md, "Many worker processes on one queue").
--
-- With share_position => true, claim_batch writes where it got to (a hint) as soon as it has
-- locked its rows, before it updates them, and a claim from a position (after_*) starts
-- from the hint instead when the hint is further on. A hint is the id of the last job the claim
-- took with a check of the claim and of its group, in one bigint kept in a sequence:
-- sequences change in place, outside transactions, so hints written many times a second
-- for hours leave no dead row versions behind under a held snapshot. Claimers are grouped
-- by their queues and kinds: a claim may only start from a hint its own group wrote, as a
-- claimer that runs other kinds passes over rows this one must take. The group's hash
-- picks one of sixteen sequences (claim_hint_0 .. claim_hint_15) and ten more of its bits
-- are checked (two groups on one queue, one running kinds the other does not, share hints
-- by mistake once in 16,384 such pairs); the value is
--
--     group check (10 bits) << 53 | claim check (8 bits) << 45 | job id (45 bits)
--
-- where the claim check (skiplock.claim_hint_check) hashes the attempt the claim gave the
-- job (every claim counts one more) with the job's claim key. Jobs with an id outside
-- 1 .. 2^45 - 1 are not written. A claim follows a hint only if the job is still where that
-- claim took it, at the key it was claimed at (a claim does not change the key; a retry, a
-- snooze or an UPDATE by hand may):
--   * it is queued, its xmax is a transaction running when this claim began or begun
--     since, and its attempt (one more) and key match the check: the claim that wrote the
--     hint has locked it and not committed yet; or
--   * it is neither queued nor waiting and its attempt and key match the check: that claim
--     committed and the job has not been claimed again or moved since (it may have
--     finished). A job moved and claimed again passes the check by chance once in 256.
-- A claim that rolled back (a lane conflict, a lost connection) leaves its jobs queued with
-- an xmax no longer running, and a job retried since is queued, or was claimed again with
-- a higher attempt: neither is followed. (A claim that followed the hint while that claim
-- was still in flight has passed over its jobs; whoever made it claims again, as the
-- worker does at once after a lane conflict.) Reading a hint needs the snapshot skip_in_flight
-- uses (READ COMMITTED, no transaction id yet); elsewhere a claim walks from its own
-- position.
--
-- What lies between a claim's own position and a hint it follows was walked by the claim
-- that wrote the hint, of the same group: jobs it took, rows other claims had locked (they
-- take them), lane jobs whose lane was running, jobs that became runnable behind it while
-- it ran (announced on skiplock_runnable, which the writer hears too and walks back for).
-- The worker asks for it on cursor walks, and on full walks, which have no position to
-- start from but walk everything before where they get to; not on the walks it owes from
-- behind its position, which start where they must look and walk nothing before that.
--
-- Claims of several queues at once neither read nor write hints: each queue's walk locks up
-- to max_jobs rows and the claim keeps max_jobs of them all, so rows it locked lie past the
-- last row it takes. A claimer without privileges on the hint sequences (SELECT to read,
-- UPDATE to write) claims without hints, and so does one whose sequence is missing: nothing
-- about a hint fails a claim. The migration grants both to every role that may update skiplock.jobs.
--
-- The signature grows by one parameter with a default, so the function is dropped and
-- created again, keeping its owner and EXECUTE grants as version 10 did; calls with the old
-- arguments resolve to it unchanged.

DO $$
BEGIN
    FOR slot IN 0..15 LOOP
        EXECUTE format('CREATE SEQUENCE IF NOT EXISTS skiplock.claim_hint_%s '
            'MINVALUE 0 MAXVALUE 9223372036854775807 NO CYCLE', slot);
        EXECUTE format('COMMENT ON SEQUENCE skiplock.claim_hint_%s IS %L', slot,
            'Where the last claim of a group of worker processes got to: a hint for the '
            'group''s next claims, never state (skiplock.claim_batch with share_position; '
            'migrations/0011_claim_hint.sql).');
    END LOOP;
END;
$$;

-- Whoever may update jobs (a worker's role) may read and write the hints.
DO $$
DECLARE
    grantee record;
BEGIN
    FOR grantee IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS name
        FROM pg_class c
        CROSS JOIN LATERAL aclexplode(c.relacl) a
        LEFT JOIN pg_roles r ON r.oid = a.grantee
        WHERE c.oid = 'skiplock.jobs'::regclass AND a.privilege_type = 'UPDATE'
          AND a.grantee <> c.relowner
    LOOP
        FOR slot IN 0..15 LOOP
            EXECUTE format('GRANT SELECT, UPDATE ON SEQUENCE skiplock.claim_hint_%s TO %s',
                slot, grantee.name);
        END LOOP;
    END LOOP;
END;
$$;

-- The claim check of a hint: the attempt a claim gave the job and the job's claim key.
CREATE OR REPLACE FUNCTION skiplock.claim_hint_check(attempt int, priority smallint,
                                                    scheduled_at timestamptz)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN hashtextextended(attempt::text || ' ' || priority::text || ' '
                        || extract(epoch FROM scheduled_at)::text, 0) & 255;

COMMENT ON FUNCTION skiplock.claim_hint_check(int, smallint, timestamptz) IS
    'Eight bits of a claim hint: a hash of the attempt a claim gave a job and the job''s claim key (migrations/0011_claim_hint.sql).';

-- The old function's privileges and owner, to give the new one (a dropped function takes
-- its grants with it).
CREATE TEMPORARY TABLE claim_batch_before_11 ON COMMIT DROP AS
    SELECT proacl, proowner::regrole AS owner FROM pg_proc
    WHERE oid = to_regprocedure(
        'skiplock.claim_batch(text[], text[], bigint, text, smallint, bigint, bigint, uuid, boolean, boolean, boolean)');

DROP FUNCTION IF EXISTS skiplock.claim_batch(text[], text[], bigint, text, smallint, bigint, bigint, uuid, boolean, boolean, boolean);

CREATE OR REPLACE FUNCTION skiplock.claim_batch(queues text[], kinds text[], max_jobs bigint, worker text,
                                     after_priority smallint DEFAULT NULL,
                                     after_scheduled_at_us bigint DEFAULT NULL,
                                     after_id bigint DEFAULT NULL,
                                     claim_with uuid DEFAULT NULL,
                                     skip_in_flight boolean DEFAULT false,
                                     take_lanes boolean DEFAULT true,
                                     retry_lane_conflict boolean DEFAULT true,
                                     share_position boolean DEFAULT false)
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
    -- Whether this claim's snapshot can tell the rows claims in flight hold: what the
    -- filter and the reading of a hint need.
    snapshot_usable boolean := pg_current_xact_id_if_assigned() IS NULL
        AND current_setting('transaction_isolation') = 'read committed';
    filtering boolean := skip_in_flight AND snapshot_usable;
    -- The group (queues and kinds, each sorted) by its hash: its hint sequence and check.
    group_hash bigint;
    hint_sequence regclass;
    group_check bigint;
    hint bigint;
    hint_priority smallint;
    hint_scheduled_at timestamptz;
    hint_id bigint;
    -- The rows this claim locked, in claim order.
    picked_rows tid[];
    picked_ids bigint[];
    last_attempt int;
    last_priority smallint;
    last_scheduled_at timestamptz;
    picked_count int;
BEGIN
    IF retry_lane_conflict AND take_lanes THEN
        -- The claim inside a subtransaction: a lane conflict it could not see rolls back
        -- only that, and the claim runs again without lane jobs.
        BEGIN
            RETURN QUERY SELECT * FROM skiplock.claim_batch(queues, kinds, max_jobs, worker,
                after_priority, after_scheduled_at_us, after_id, claim_with, skip_in_flight,
                true, false, share_position);
            RETURN;
        EXCEPTION WHEN unique_violation THEN
            RETURN QUERY SELECT * FROM skiplock.claim_batch(queues, kinds, max_jobs, worker,
                after_priority, after_scheduled_at_us, after_id, claim_with, skip_in_flight,
                false, false, share_position);
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
    -- Claims of several queues at once keep no hints (see the top of the file).
    share_position := share_position AND cardinality(queues) = 1;
    IF filtering OR (share_position AND snapshot_usable AND after_id IS NOT NULL) THEN
        snapshot := pg_current_snapshot();
        in_flight := ARRAY(SELECT x::xid FROM pg_snapshot_xip(snapshot) AS x);
        next_xid := pg_snapshot_xmax(snapshot)::text::bigint % 4294967296;
    END IF;
    IF share_position THEN
        group_hash := hashtextextended(
            ARRAY(SELECT DISTINCT q FROM unnest(queues) AS q ORDER BY 1)::text || ' '
            || ARRAY(SELECT DISTINCT k FROM unnest(kinds) AS k ORDER BY 1)::text, 0);
        hint_sequence := to_regclass('skiplock.claim_hint_' || (group_hash & 15));
        group_check := (group_hash >> 4) & 1023;
    END IF;
    -- From the hint the group's last claim wrote, when it is further on and still names the
    -- job that claim took (see the top of migrations/0011_claim_hint.sql).
    IF share_position AND snapshot_usable AND after_id IS NOT NULL
       AND hint_sequence IS NOT NULL AND has_sequence_privilege(hint_sequence, 'SELECT') THEN
        hint := pg_sequence_last_value(hint_sequence);
        IF hint >> 53 = group_check THEN
            SELECT h.priority, h.scheduled_at, h.id
            INTO hint_priority, hint_scheduled_at, hint_id
            FROM skiplock.jobs h
            WHERE h.id = hint & 35184372088831
              AND h.queue = ANY (queues) AND h.kind = ANY (kinds)
              AND CASE h.state
                  WHEN 'queued' THEN h.xmax <> '0'::xid AND (h.xmax = ANY (in_flight)
                      OR (h.xmax::text::bigint - next_xid + 4294967296) % 4294967296 < 1048576)
                      AND skiplock.claim_hint_check(least(h.attempt, 2147483646) + 1,
                                                    h.priority, h.scheduled_at)
                          = (hint >> 45) & 255
                  WHEN 'waiting' THEN false
                  ELSE skiplock.claim_hint_check(h.attempt, h.priority, h.scheduled_at)
                       = (hint >> 45) & 255
                  END;
            IF FOUND AND (hint_priority, hint_scheduled_at, hint_id)
                         > (from_priority, from_scheduled_at, from_id) THEN
                from_priority := hint_priority;
                from_scheduled_at := hint_scheduled_at;
                from_id := hint_id;
            END IF;
        END IF;
    END IF;
    -- From the position on: lock the rows (in claim order, so the last is where the claim
    -- gets to), say where it got to, then take them with the caller's token when it gives
    -- one. The hint is written once the rows are locked rather than after the update, so
    -- claims starting beside this one spend less time stepping over its rows; should the
    -- update fail (a lane conflict), a claim that followed the hint meanwhile has passed
    -- over rows that are queued again, which the caller's retry takes (the worker's does).
    SELECT array_agg(p.ctid), array_agg(p.id)
    INTO picked_rows, picked_ids
    FROM (
        SELECT p.ctid, p.id
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
    ) p;
    picked_count := coalesce(cardinality(picked_ids), 0);
    IF picked_count = 0 THEN
        RETURN;
    END IF;
    -- (Postgres gives <<, >>, & and | one precedence, left to right: hence the parentheses.)
    IF share_position AND hint_sequence IS NOT NULL
       AND picked_ids[picked_count] BETWEEN 1 AND 35184372088831
       AND has_sequence_privilege(hint_sequence, 'UPDATE') THEN
        SELECT j.attempt, j.priority, j.scheduled_at
        INTO last_attempt, last_priority, last_scheduled_at
        FROM skiplock.jobs j WHERE j.ctid = picked_rows[picked_count];
        PERFORM setval(hint_sequence, (group_check << 53)
            | (skiplock.claim_hint_check(least(last_attempt, 2147483646) + 1, last_priority,
                                         last_scheduled_at) << 45)
            | picked_ids[picked_count]);
    END IF;
    -- The result is sorted (claim order) after the update has finished, so an update that
    -- fails has returned no row yet.
    RETURN QUERY
    WITH claimed AS (
        UPDATE skiplock.jobs j
        SET state = 'running', claim_token = coalesce(claim_with, gen_random_uuid()), claimed_by = worker,
            claimed_at = now(), heartbeat_at = clock_timestamp(),
            attempt = least(j.attempt, 2147483646) + 1
        WHERE j.ctid = ANY (picked_rows)
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

COMMENT ON FUNCTION skiplock.claim_batch(text[], text[], bigint, text, smallint, bigint, bigint, uuid, boolean, boolean, boolean, boolean) IS
    'Claims up to max_jobs runnable jobs (what a worker runs), after the given claim key if any; each comes back with its fencing claim_token (claim_with when given). skip_in_flight passes over rows other claims are taking without the lock manager (off by default: see migrations/0010); with retry_lane_conflict => false a lane conflict raises unique_violation instead of being retried with take_lanes => false; with share_position => true a claim from a position starts where the last claim of its group (same queues and kinds) got to, when that is further on, and writes where it got to (see migrations/0011).';

DO $$
DECLARE
    before record;
    grant_to record;
BEGIN
    SELECT * INTO before FROM claim_batch_before_11;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    EXECUTE format('ALTER FUNCTION skiplock.claim_batch(text[], text[], bigint, text, smallint, '
        'bigint, bigint, uuid, boolean, boolean, boolean, boolean) OWNER TO %s', before.owner);
    IF before.proacl IS NULL THEN
        RETURN;  -- the defaults, as the new function has
    END IF;
    REVOKE ALL ON FUNCTION skiplock.claim_batch(text[], text[], bigint, text, smallint, bigint,
        bigint, uuid, boolean, boolean, boolean, boolean) FROM PUBLIC;
    FOR grant_to IN
        SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS name,
               a.is_grantable
        FROM aclexplode(before.proacl) a LEFT JOIN pg_roles r ON r.oid = a.grantee
        WHERE a.privilege_type = 'EXECUTE'
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION skiplock.claim_batch(text[], text[], bigint, '
            'text, smallint, bigint, bigint, uuid, boolean, boolean, boolean, boolean) TO %s%s',
            grant_to.name, CASE WHEN grant_to.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END;
$$;
