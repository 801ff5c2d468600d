-- migrations/functions/15_partitions.sql: The partition layer of skiplock.jobs: which table
-- holds a job's row and how it gets there. What knows the layout is here; the rest of the
-- schema and the pruner (src/maintenance/pruner.rs, through src/db/partitions.rs) call it.
--
-- It owns:
-- * the days of finished jobs (the tables themselves are made by 0001_initial.sql: jobs_live
--   for waiting, queued and running jobs, jobs_done with a table per finished state and UTC
--   day, jobs_done_default for what no day takes): making them ahead, with a late day's
--   rows moved out of the default; listing them; locking and dropping one past retention;
-- * deletes: the statement trigger that leaves tombstones of deleted parents and removes a
--   deleted job's own edges, on the table, on jobs_live, jobs_done and the default, and on
--   each day as it is made;
-- * moves: a finished job going back to a live state (the requeue flag, read by the insert
--   trigger of jobs_live in 05_enqueue.sql), and the rule for a row moved under a statement
--   (internal_may_retry_moved);
-- * lookups by id: how a job that may have finished is read without reading every day.
-- Applied last of the function files: it makes the days ahead as it ends.
--
-- Defines:
--   internal_done_partitions, internal_prune_cutoff, internal_expired_done_partitions
--   internal_prepare_done_partitions, internal_done_partition, internal_lock_done_partition
--   internal_drop_done_partition, internal_jobs_after_delete, trigger jobs_after_delete
--   internal_jobs_done_before_requeue, trigger jobs_done_before_requeue
--   internal_finished_from, internal_finished_job, internal_job_state, internal_job_by_id
--   internal_may_retry_moved

-- ---- Finished jobs by day: partitions and retention --------------------------------------
--
-- skiplock.jobs_done is partitioned by (state, finished_at): one partition per finished
-- state and UTC day, jobs_done_<state>_<yyyymmdd>, and jobs_done_default for the rest (see
-- migrations/0001_initial.sql). Retention drops a day whole once every row in it is past
-- its state's retention (src/maintenance/pruner.rs): it rolls the day up into
-- skiplock.job_history, settles what other jobs knew of it, and drops the table, deleting
-- no row.
--
-- Creating or dropping a partition takes an ACCESS EXCLUSIVE lock on jobs_done for an
-- instant, and completions (they move rows into it) queue behind the request: every
-- function here waits at most lock_timeout (100 ms) for a lock and leaves the work to its
-- next call when it is busy. Each runs as its owner (SECURITY DEFINER), which owns the
-- partitions: a worker role needs no DDL privilege.

-- The day partitions of jobs_done: name, state and the instants they hold, [starts, ends).
-- Read from the catalog by name, which only internal_prepare_done_partitions gives.
CREATE OR REPLACE FUNCTION skiplock.internal_done_partitions()
RETURNS TABLE (leaf text, state skiplock.job_state, starts timestamptz, ends timestamptz)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT c.relname::text, m[1]::skiplock.job_state,
           to_date(m[2], 'YYYYMMDD')::timestamp AT TIME ZONE 'UTC',
           (to_date(m[2], 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC'
    FROM pg_inherits i
    JOIN pg_class c ON c.oid = i.inhrelid
    CROSS JOIN LATERAL regexp_match(c.relname, '^jobs_done_(succeeded|dead|cancelled)_([0-9]{8})$') m
    WHERE i.inhparent = 'skiplock.jobs_done'::regclass AND m IS NOT NULL
    ORDER BY 3, 1;
$$;

-- Rows of state `finished` finished at or before this instant are the pruner's to delete
-- one statement at a time, under a retention of retention_ms milliseconds:
--   * a retention shorter than a day (a day partition holds rows older and younger than
--     it): every row past it;
--   * a day or more: only rows past it and older than the oldest day partition of that
--     state, which are in jobs_done_default (a day nobody prepared, or finished_at written
--     by hand). The rest go with their day, dropped whole once it is all past retention: a
--     job is kept at least its retention and at most a day longer.
-- NULL (no retention given) deletes nothing.
CREATE OR REPLACE FUNCTION skiplock.internal_prune_cutoff(finished skiplock.job_state, retention_ms bigint)
RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN retention_ms < 86400000 THEN now() - retention_ms * interval '1 millisecond'
        ELSE least(now() - retention_ms * interval '1 millisecond',
                   (SELECT min(p.starts) FROM skiplock.internal_done_partitions() p
                    WHERE p.state = finished) - interval '1 microsecond')
    END;
$$;

-- The day partitions of jobs_done all of whose rows are past their state's retention
-- (milliseconds; NULL keeps the state), oldest first: what the pruner drops.
CREATE OR REPLACE FUNCTION skiplock.internal_expired_done_partitions(
    succeeded_ms bigint, cancelled_ms bigint, dead_ms bigint)
RETURNS TABLE (leaf text, state skiplock.job_state, starts timestamptz, ends timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT p.leaf, p.state, p.starts, p.ends
    FROM skiplock.internal_done_partitions() p
    WHERE p.ends <= now() - CASE p.state
                                WHEN 'succeeded' THEN succeeded_ms
                                WHEN 'cancelled' THEN cancelled_ms
                                WHEN 'dead' THEN dead_ms
                            END * interval '1 millisecond'
    ORDER BY p.starts, p.leaf;
$$;

-- Creates the day partitions of jobs_done from first_day (UTC; today when NULL) for `days`
-- days, those missing; returns how many it created. Called by every worker's pruner,
-- skiplock prune, skiplock.maintain and skiplock migrate, with the default two days ahead,
-- so that each day exists before a job finishes in it. A day busy now is created at the
-- next call.
--
-- Each day's table is made on its own and then attached: ATTACH PARTITION takes SHARE
-- UPDATE EXCLUSIVE on jobs_done, which the completions moving rows into it (ROW
-- EXCLUSIVE) do not conflict with, where CREATE TABLE … PARTITION OF took ACCESS
-- EXCLUSIVE, waited for every open transaction that had finished a job and held every
-- completion behind it (168 ms beside 500,000 rows in jobs_done_default, whose scan it
-- waited through). The attach still scans jobs_done_default, under a lock on that table
-- alone (tests/maintenance.rs a_day_is_made_beside_an_open_transaction_that_finished_a_job).
--
-- A day for which jobs_done_default already holds rows (a day made late: its first jobs
-- finished before any pruner ran; or a finished_at written by hand in a future day) is
-- made all the same, or a whole day of completions would go to the default: Postgres
-- refuses a partition whose rows the default holds, so those rows move into the day's
-- table before it is attached (one DELETE … RETURNING feeding the INSERT; the delete
-- trigger leaves their edges, see internal_jobs_after_delete), all in one subtransaction.
-- A row of theirs locked by another transaction (a retry by hand) makes the day wait for
-- the next call.
CREATE OR REPLACE FUNCTION skiplock.internal_prepare_done_partitions(
    first_day date DEFAULT NULL, days int DEFAULT 3)
RETURNS int
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
SET TimeZone = 'UTC'
SET DateStyle = 'ISO, YMD'
SET jit = off
AS $$
DECLARE
    day date;
    finished skiplock.job_state;
    leaf text;
    starts timestamptz;
    ends timestamptz;
    created int := 0;
    marked int;
BEGIN
    -- Today's mark of the ids handed out (see skiplock.job_id_days), kept from the day's
    -- first call, which also lets the marks of days no longer kept go. A mark another
    -- caller is writing is left to it: the insert would wait for that caller's commit (a
    -- maintain() in a transaction), and fail this call at lock_timeout.
    IF NOT EXISTS (SELECT 1 FROM skiplock.job_id_days m
                   WHERE m.day = (now() AT TIME ZONE 'UTC')::date) THEN
        BEGIN
            INSERT INTO skiplock.job_id_days (day, id_reached)
            VALUES ((now() AT TIME ZONE 'UTC')::date,
                    coalesce(pg_sequence_last_value(
                                 pg_get_serial_sequence('skiplock.jobs', 'id')::regclass), 0))
            ON CONFLICT ON CONSTRAINT job_id_days_pkey DO NOTHING;
            GET DIAGNOSTICS marked = ROW_COUNT;
            IF marked > 0 THEN
                DELETE FROM skiplock.job_id_days m
                WHERE m.day < (SELECT min(p.starts AT TIME ZONE 'UTC')::date
                               FROM skiplock.internal_done_partitions() p);
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
    END IF;
    first_day := coalesce(first_day, (now() AT TIME ZONE 'UTC')::date);
    IF first_day NOT BETWEEN date '2000-01-01' AND date '9999-12-01' OR days NOT BETWEEN 0 AND 31 THEN
        RAISE EXCEPTION 'skiplock.internal_prepare_done_partitions: % days from %: make at most 31 days at a time, from year 2000 to 9999',
            days, first_day
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR i IN 0 .. coalesce(days, 0) - 1 LOOP
        day := first_day + i;
        starts := day::timestamp AT TIME ZONE 'UTC';
        ends := (day + 1)::timestamp AT TIME ZONE 'UTC';
        FOREACH finished IN ARRAY ARRAY['succeeded', 'dead', 'cancelled']::skiplock.job_state[] LOOP
            leaf := format('jobs_done_%s_%s', finished, to_char(day, 'YYYYMMDD'));
            CONTINUE WHEN to_regclass(format('skiplock.%I', leaf)) IS NOT NULL;
            BEGIN
                EXECUTE format(
                    'CREATE TABLE skiplock.%I
                         (LIKE skiplock.jobs_done INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                    leaf);
                IF EXISTS (SELECT 1 FROM skiplock.jobs_done_default d
                           WHERE d.state = finished AND d.finished_at >= starts
                             AND d.finished_at < ends) THEN
                    PERFORM set_config('skiplock.moving_day', 'jobs_done_default', true);
                    EXECUTE format(
                        'WITH moved AS (
                             DELETE FROM skiplock.jobs_done_default d
                             WHERE d.state = $1 AND d.finished_at >= $2 AND d.finished_at < $3
                             RETURNING d.*)
                         INSERT INTO skiplock.%I SELECT * FROM moved', leaf)
                        USING finished, starts, ends;
                    PERFORM set_config('skiplock.moving_day', '', true);
                END IF;
                EXECUTE format(
                    'ALTER TABLE skiplock.jobs_done ATTACH PARTITION skiplock.%I
                     FOR VALUES FROM (%L, %L) TO (%L, %L)',
                    leaf, finished, starts, finished, ends);
                -- A statement trigger fires for the table a DELETE names (see jobs_after_delete).
                EXECUTE format(
                    'CREATE TRIGGER jobs_after_delete AFTER DELETE ON skiplock.%I
                     REFERENCING OLD TABLE AS deleted
                     FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete()',
                    leaf);
                created := created + 1;
            EXCEPTION WHEN lock_not_available OR duplicate_table OR check_violation
                           OR serialization_failure THEN
                -- Busy (a table or a moving row locked), made by another caller meanwhile,
                -- a row of that day reached jobs_done_default meanwhile, or a row to move
                -- was moved out of it by another transaction (40001): the next call looks
                -- again.
                NULL;
            END;
        END LOOP;
    END LOOP;
    RETURN created;
END;
$$;

-- The day partition `leaf`, checked: a day partition of jobs_done, by name and by parent.
CREATE OR REPLACE FUNCTION skiplock.internal_done_partition(leaf text) RETURNS regclass
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    found regclass;
BEGIN
    SELECT format('skiplock.%I', p.leaf)::regclass INTO found
    FROM skiplock.internal_done_partitions() p WHERE p.leaf = internal_done_partition.leaf;
    IF found IS NULL THEN
        RAISE EXCEPTION '% is not a day partition of skiplock.jobs_done', leaf
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN found;
END;
$$;

-- Locks the day partition `leaf` against writes (a retry or a DELETE by hand, another
-- pruner's drop of the same day) until the transaction ends, so that the history the
-- pruner rolls up from it next is exactly what internal_drop_done_partition removes after.
-- EXCLUSIVE: plain reads go on; row locks wait, the FOR SHARE of a parent by the dependency
-- trigger among them. Under SHARE ROW EXCLUSIVE that trigger went through: an edge to a
-- parent of the day, committed after the drop read the day's edges and before it dropped
-- the day, was left with no tombstone, and a retry ran its child (issue 49, tests/
-- maintenance.rs a_child_enqueued_while_its_parents_day_is_dropped_is_never_run). Now
-- the edge's enqueue commits before the lock is granted, or waits for the drop and finds
-- its parent gone.
-- Returns false, locking nothing, when the day is gone already (another pruner dropped
-- it); refuses a day that is not over.
CREATE OR REPLACE FUNCTION skiplock.internal_lock_done_partition(leaf text) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
AS $$
DECLARE
    day_table regclass;
BEGIN
    IF to_regclass(format('skiplock.%I', leaf)) IS NULL THEN
        RETURN false;
    END IF;
    -- The drop takes ACCESS EXCLUSIVE on jobs_done, and while its request waits every
    -- completion queues behind it. A transaction that holds jobs_done and is idle in it, or
    -- has run for a second (a report, a session a client forgot), would hold the request
    -- for its whole 100 ms at every pass: 12 stalls of every completion in 20 s beside one
    -- idle reader of skiplock.jobs. Such a day is left for a later pass without asking.
    -- Another role's sessions show their state only to a role with pg_read_all_stats;
    -- without it, the drop asks and waits its 100 ms as before.
    IF EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
               WHERE l.locktype = 'relation' AND l.relation = 'skiplock.jobs_done'::regclass
                 AND l.granted AND l.pid <> pg_backend_pid()
                 AND (a.state = 'idle in transaction'
                      OR a.xact_start < clock_timestamp() - interval '1 second')) THEN
        RAISE EXCEPTION 'skiplock.%: a transaction that read the finished jobs is open; the day is dropped at a later pass', leaf
            USING ERRCODE = 'lock_not_available';
    END IF;
    day_table := skiplock.internal_done_partition(leaf);
    EXECUTE format('LOCK TABLE %s IN EXCLUSIVE MODE', day_table);
    RETURN true;
END;
$$;

-- Drops the day partition `leaf`, after what a DELETE of its rows would have done to the
-- jobs that knew them (skiplock.internal_jobs_after_delete): its jobs that did not succeed
-- leave tombstones on their children's edges (and a child still waiting is cancelled), and
-- its jobs' own edges go. Both are found through the edges in the partition's id range (an
-- index range of job_dependencies), so the cost follows the edges of that day's jobs, not
-- the day's rows nor every edge kept. The caller rolled the day up into job_history in the
-- same transaction, under internal_lock_done_partition.
CREATE OR REPLACE FUNCTION skiplock.internal_drop_done_partition(leaf text) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    day_table regclass := skiplock.internal_done_partition(leaf);
    ends timestamptz;
    first_id bigint;
    last_id bigint;
    parents bigint[];
    states skiplock.job_state[];
BEGIN
    SELECT p.ends INTO ends FROM skiplock.internal_done_partitions() p
    WHERE p.leaf = internal_drop_done_partition.leaf;
    IF ends > now() THEN
        RAISE EXCEPTION 'skiplock.%: the day is not over; only a past day is dropped', leaf
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    EXECUTE format('LOCK TABLE %s IN EXCLUSIVE MODE', day_table);
    EXECUTE format('SELECT min(id), max(id) FROM %s', day_table) INTO first_id, last_id;
    IF first_id IS NOT NULL THEN
        EXECUTE format(
            'SELECT array_agg(p.id), array_agg(p.state)
             FROM (SELECT DISTINCT d.parent_id FROM skiplock.job_dependencies d
                   WHERE d.parent_id BETWEEN $1 AND $2 AND d.parent_state IS NULL) e
             JOIN %s p ON p.id = e.parent_id
             WHERE p.state <> ''succeeded''', day_table)
            INTO parents, states USING first_id, last_id;
        PERFORM skiplock.internal_tombstone_parents(parents, states);
        EXECUTE format(
            'DELETE FROM skiplock.job_dependencies d
             WHERE d.job_id BETWEEN $1 AND $2
               AND EXISTS (SELECT 1 FROM %s p WHERE p.id = d.job_id)', day_table)
            USING first_id, last_id;
    END IF;
    EXECUTE format('DROP TABLE %s', day_table);
END;
$$;

-- Making, locking and dropping days run as the owner: only the roles that prune (a worker,
-- an operator; docs/roles.sql) may call them, not every role that may read a job.
REVOKE EXECUTE ON FUNCTION skiplock.internal_prepare_done_partitions(date, int),
                           skiplock.internal_lock_done_partition(text),
                           skiplock.internal_drop_done_partition(text)
    FROM PUBLIC;

-- ---- Deletes: tombstones and edges ------------------------------------------------------

-- After a DELETE statement on skiplock.jobs (by hand, or the pruner), once for all its
-- rows: the deleted jobs that had not succeeded leave tombstones and their waiting
-- children are cancelled (internal_tombstone_parents), and the deleted jobs' own edges go
-- with them (what a foreign key's cascade did). A statement trigger: a row moved between
-- jobs_live and jobs_done by an UPDATE is not a DELETE statement and does not fire it, and
-- a DELETE of a parent and its waiting children in one statement (DELETE … WHERE queue =
-- 'x') sees them all gone.
--
-- It runs as its owner (SECURITY DEFINER), as a foreign key's cascade did: whoever may
-- delete jobs needs no privilege on job_dependencies.
--
-- Rows that internal_prepare_done_partitions moves out of jobs_done_default into their
-- day's new table are not gone: that DELETE sets skiplock.moving_day to the table it
-- deletes from for its own statement, and this trigger leaves their edges as they are.
CREATE OR REPLACE FUNCTION skiplock.internal_jobs_after_delete() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    parents bigint[];
    states skiplock.job_state[];
BEGIN
    IF current_setting('skiplock.moving_day', true) = TG_TABLE_NAME THEN
        RETURN NULL;
    END IF;
    SELECT array_agg(o.id), array_agg(o.state) INTO parents, states
    FROM deleted o WHERE o.state <> 'succeeded';
    PERFORM skiplock.internal_tombstone_parents(parents, states);
    DELETE FROM skiplock.job_dependencies d USING deleted o WHERE d.job_id = o.id;
    RETURN NULL;
END;
$$;

-- On the table and on each partition: a statement trigger fires for the table a statement
-- names, and a DELETE FROM skiplock.jobs_live must tombstone and cascade as well. (Each
-- day partition of jobs_done gets its own as it is made.)
CREATE OR REPLACE TRIGGER jobs_after_delete
    AFTER DELETE ON skiplock.jobs
    REFERENCING OLD TABLE AS deleted
    FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete();

CREATE OR REPLACE TRIGGER jobs_after_delete
    AFTER DELETE ON skiplock.jobs_live
    REFERENCING OLD TABLE AS deleted
    FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete();

CREATE OR REPLACE TRIGGER jobs_after_delete
    AFTER DELETE ON skiplock.jobs_done
    REFERENCING OLD TABLE AS deleted
    FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete();

CREATE OR REPLACE TRIGGER jobs_after_delete
    AFTER DELETE ON skiplock.jobs_done_default
    REFERENCING OLD TABLE AS deleted
    FOR EACH STATEMENT EXECUTE FUNCTION skiplock.internal_jobs_after_delete();

-- ---- A finished job moved back to a live state -----------------------------------------

-- A finished job going back to a live state (retry_job, or an UPDATE by hand) moves from
-- jobs_done to jobs_live: Postgres runs this BEFORE UPDATE trigger on jobs_done, then the
-- insert trigger of jobs_live, which this marks so that it lets the row pass. (Finished
-- rows are seldom updated: the completion path never pays for it.)
CREATE OR REPLACE FUNCTION skiplock.internal_jobs_done_before_requeue() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('skiplock.requeue_moving', NEW.id::text, true);
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER jobs_done_before_requeue
    BEFORE UPDATE ON skiplock.jobs_done
    FOR EACH ROW
    WHEN (NEW.state IN ('waiting', 'queued', 'running'))
    EXECUTE FUNCTION skiplock.internal_jobs_done_before_requeue();

-- ---- A job looked up by id through skiplock.jobs ---------------------------------------
--
-- skiplock.jobs holds jobs_live and a table per finished state and day: a lookup by id
-- that cannot say the job is live (a parent that may have finished) is planned, probed and
-- locked over every table, so its cost follows the days kept (with 31 days, 101 tables:
-- a cancel_job took 3.7-4.7 ms against 1.4-1.5 ms with one day, an enqueue with a parent
-- 5.3-7.5 ms against 1.9-2.7, completing a parent of 40 waiting children 29-42 ms against
-- 8-9; benches/days-kept.sh, docs/benchmarks.md). So:
-- - a job that must be live (a cancel, a child, a parent that has not finished) is read
--   from jobs_live first (or through skiplock.jobs with `state IN ('waiting', 'queued',
--   'running')`, planned over jobs_live alone), and from jobs_done only when not there;
-- - a finished job (a finished parent, a retry by hand, a watch) is read through
--   internal_finished_job: from the day its id was handed out on (skiplock.job_id_days),
--   one state at a time, so that only the tables of those days are probed; every day only
--   when it is not there (a finished_at written by hand before the id was handed out, or
--   no such job);
-- - a job that may be either (a parent, on the dependency paths and in the sweep; a job's
--   state asked for by id) through internal_job_state: jobs_live, then
--   internal_finished_job; a parent whose dependants are settled is looked up once, not
--   once per edge; tests/sql_conventions.rs fails on a lookup by id through skiplock.jobs
--   elsewhere that names no live state;
-- - the functions on the dependency and cancel paths say `SET plan_cache_mode =
--   force_generic_plan`: PL/pgSQL planned their statements again at each call while a
--   plan made for the values given looked cheaper; now once per session, with the index
--   lookups their other settings pin.
-- tests/bounded_statements.rs lookups_of_jobs_not_finished_lock_no_day_of_finished_jobs
-- counts the tables of finished jobs a cancel and an enqueue with a parent lock, and
-- lookups_of_finished_jobs_read_the_same_whatever_days_are_kept the buffers a lookup of a
-- finished job reads.

-- The instant from which a job of this id can have been finished by skiplock: the start of
-- the last day whose mark (skiplock.job_id_days) is below the id; '-infinity' before every
-- mark.
CREATE OR REPLACE FUNCTION skiplock.internal_finished_from(job_id bigint) RETURNS timestamptz
LANGUAGE sql STABLE
SET jit = off
AS $$
    SELECT coalesce((SELECT m.day FROM skiplock.job_id_days m WHERE m.id_reached < job_id
                     ORDER BY m.day DESC LIMIT 1)::timestamp AT TIME ZONE 'UTC',
                    '-infinity');
$$;

-- The finished job `job_id`, for a caller that did not find it live (no row when no job has
-- that id), locked as `lock_rows` says ('', 'FOR SHARE' or 'FOR UPDATE'): what its callers
-- read of it, the columns an enqueuer may read (docs/roles.sql), through skiplock.jobs, whose
-- privileges a caller has. Each state's tables from the day internal_finished_from gives
-- first: one plan per session, which opens every day's table but, with the state and the
-- day given only at run time, probes those days' alone (0.05 ms a lookup with 31 days
-- kept, against 0.4 ms for a probe of every day's; a statement over the states together is
-- not pruned by day, jobs_done being partitioned by the pair). The three lock modes are
-- three copies of that probe: a lock clause cannot be a parameter of a static statement,
-- and one planned at each call (EXECUTE) spends 0.5-0.7 ms planning. Then, only when it is
-- not there (a finished_at written by hand before the id was handed out, a job that went
-- back to a live state since the caller looked, or no such job), every table in one
-- statement, planned at the call: the caller's look and the probes each see a snapshot of
-- their own, so a row that moved into what was already read (a retry by hand, a date
-- written by hand) while they ran is found there, in whatever state it has.
-- A row moved under the lock (40001) is the caller's to handle, as for any statement.
CREATE OR REPLACE FUNCTION skiplock.internal_finished_job(job_id bigint, lock_rows text DEFAULT '')
RETURNS TABLE (id bigint, state skiplock.job_state, queue text, priority smallint,
               scheduled_at timestamptz, ordering_key text, unique_key text, attempt int,
               output jsonb, last_error text, finished_at timestamptz)
LANGUAGE plpgsql
-- A lookup by id: each table's index on id, whatever its statistics say.
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    finished_from timestamptz := skiplock.internal_finished_from(job_id);
    finished skiplock.job_state;
BEGIN
    IF lock_rows IS NULL OR lock_rows NOT IN ('', 'FOR SHARE', 'FOR UPDATE') THEN
        RAISE EXCEPTION 'skiplock.internal_finished_job: lock_rows is empty, FOR SHARE or FOR UPDATE, not %', lock_rows
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOREACH finished IN ARRAY ARRAY['succeeded', 'dead', 'cancelled']::skiplock.job_state[] LOOP
        IF lock_rows = '' THEN
            RETURN QUERY
            SELECT d.id, d.state, d.queue, d.priority, d.scheduled_at, d.ordering_key,
                   d.unique_key, d.attempt, d.output, d.last_error, d.finished_at
            FROM skiplock.jobs d
            WHERE d.id = job_id AND d.state = finished AND d.finished_at >= finished_from;
        ELSIF lock_rows = 'FOR SHARE' THEN
            RETURN QUERY
            SELECT d.id, d.state, d.queue, d.priority, d.scheduled_at, d.ordering_key,
                   d.unique_key, d.attempt, d.output, d.last_error, d.finished_at
            FROM skiplock.jobs d
            WHERE d.id = job_id AND d.state = finished AND d.finished_at >= finished_from
            FOR SHARE;
        ELSE
            RETURN QUERY
            SELECT d.id, d.state, d.queue, d.priority, d.scheduled_at, d.ordering_key,
                   d.unique_key, d.attempt, d.output, d.last_error, d.finished_at
            FROM skiplock.jobs d
            WHERE d.id = job_id AND d.state = finished AND d.finished_at >= finished_from
            FOR UPDATE;
        END IF;
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
    RETURN QUERY EXECUTE
        'SELECT d.id, d.state, d.queue, d.priority, d.scheduled_at, d.ordering_key,
                d.unique_key, d.attempt, d.output, d.last_error, d.finished_at
         FROM skiplock.jobs d
         WHERE d.id = $1 ' || lock_rows
        USING job_id;
END;
$$;

-- A job's state by id, wherever its row is: in jobs_live, or where internal_finished_job
-- finds it (from its id's day on); NULL when no job has the id (deleted, pruned). What the
-- dependency paths read of a parent (internal_has_unmet_parent, internal_settle_dependants,
-- the sweep), skiplock::job_state and why_waiting: with the live look through
-- skiplock.jobs planned over jobs_live alone, no day of finished jobs is probed for a job
-- that has not finished, and only its id's days for one that has. A job that went back to
-- a live state between the two looks is found by internal_finished_job's last statement.
CREATE OR REPLACE FUNCTION skiplock.internal_job_state(job_id bigint)
RETURNS skiplock.job_state
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    found_state skiplock.job_state;
BEGIN
    SELECT j.state INTO found_state FROM skiplock.jobs j
    WHERE j.id = job_id AND j.state IN ('waiting', 'queued', 'running');
    IF NOT FOUND THEN
        SELECT f.state INTO found_state FROM skiplock.internal_finished_job(job_id) f;
    END IF;
    RETURN found_state;
END;
$$;

-- A job's row by id, wherever it is: in jobs_live, or where internal_finished_job finds it
-- (from its id's day on), read again there whole. What skiplock::job, `skiplock show` and
-- a job's state read (through skiplock.jobs by id alone, each probed every day's table).
-- Its statements each take a snapshot of their own, so a job moving between the two
-- tables meanwhile can be missed by both looks: then, and for an id no job has, the one
-- statement over every table answers.
CREATE OR REPLACE FUNCTION skiplock.internal_job_by_id(job_id bigint)
RETURNS SETOF skiplock.jobs
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    found_state skiplock.job_state;
    ended_at timestamptz;
BEGIN
    RETURN QUERY SELECT * FROM skiplock.jobs j
                 WHERE j.id = job_id AND j.state IN ('waiting', 'queued', 'running');
    IF FOUND THEN
        RETURN;
    END IF;
    SELECT f.state, f.finished_at INTO found_state, ended_at
    FROM skiplock.internal_finished_job(job_id) f;
    IF ended_at IS NOT NULL THEN
        RETURN QUERY SELECT * FROM skiplock.jobs j
                     WHERE j.id = job_id AND j.state = found_state
                       AND j.finished_at = ended_at;
    END IF;
    IF NOT FOUND OR ended_at IS NULL THEN
        RETURN QUERY SELECT * FROM skiplock.jobs j WHERE j.id = job_id;
    END IF;
END;
$$;

-- ---- A row moved to the other partition under a statement ------------------------------
--
-- A statement that locks or updates a row that another transaction moved between jobs_live
-- and jobs_done after the statement's snapshot was taken fails with 40001 ("tuple to be
-- locked was already moved to another partition due to concurrent update"): Postgres
-- cannot follow a row into another partition, where in one table it would have found the
-- row changed and passed it over. In READ COMMITTED each statement takes a new snapshot,
-- in which the row is where it went, so the statement run again treats it as it treats any
-- job someone else finished first. The functions that can meet it on their own rows (the
-- heartbeat, the reaper, the SQL protocol's calls, the claim, cancel_job, maintain) run
-- again; under REPEATABLE READ or SERIALIZABLE the snapshot stays and the error goes to
-- the caller, whose transaction must be retried, as for any serialization failure.

-- Whether a statement that failed with 40001 may run again in this transaction: in READ
-- COMMITTED, up to 10 times.
CREATE OR REPLACE FUNCTION skiplock.internal_may_retry_moved(attempts int) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT attempts < 10 AND current_setting('transaction_isolation') = 'read committed';
$$;

-- ---- The days ahead ----------------------------------------------------------------------

-- The days ahead of finished jobs exist from the migration on (the pruner and
-- skiplock.maintain make the next ones).
SELECT skiplock.internal_prepare_done_partitions();
