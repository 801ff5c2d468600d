-- migrations/functions/14_awaited_outcomes.sql: Waiting for a job's outcome: a waiter marks
-- the job awaited (skiplock.watch_job), and an awaited job that finishes notifies
-- skiplock_finished with its id.
--
-- Defines:
--   internal_notify_finished, trigger jobs_notify_finished
--   watch_job
--
-- The protocol, for any language (docs/sql.md, "Waiting for a job's outcome"; the Rust
-- form is skiplock::wait_for): LISTEN skiplock_finished on a connection of its own, then
-- SELECT * FROM skiplock.watch_job(id). A row whose finished_at is set is the outcome;
-- otherwise wait for a notification whose payload is the id (or for a slow fallback
-- timeout) and call watch_job again. No row: the job does not exist (never did, deleted,
-- or pruned). The LISTEN comes first so that a job finishing between the call and the wait
-- is heard; the flag is written on the job's own row, under its row lock, so the
-- statement that finishes it either sees the flag (and notifies) or finished it before
-- (and watch_job returns the outcome): no order of the two loses the wake-up.

-- The notification of an awaited job that finished, at its writer's commit. Its payload is
-- the id alone (a waiter reads the outcome itself: a payload is capped at 8,000 bytes, an
-- output is not).
CREATE OR REPLACE FUNCTION skiplock.internal_notify_finished() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('skiplock_finished', NEW.id::text);
    RETURN NULL;
END;
$$;

-- A job finishes by entering jobs_done (every writer: a completion, a failure that leaves
-- it dead, a cancel, the reaper, an UPDATE by hand; each moves the row between partitions,
-- which fires the destination's INSERT row triggers). Declared on jobs_done, so that every
-- day's table has it, those made later too (ATTACH clones it). Its WHEN reads the new row
-- only: a job nobody waits for costs no call.
CREATE OR REPLACE TRIGGER jobs_notify_finished
    AFTER INSERT ON skiplock.jobs_done
    FOR EACH ROW WHEN (NEW.awaited)
    EXECUTE FUNCTION skiplock.internal_notify_finished();

-- Development builds before internal_release_passed_over (06_global_limits.sql) had this.
DROP FUNCTION IF EXISTS skiplock.internal_release_watched(text, text, text);

-- Marks the job awaited, and returns where it stands: finished_at set once it finished
-- (state succeeded with its output, dead with its last error, or cancelled), NULL while it
-- is live; no row when it does not exist. A live job's row is written once (the first
-- waiter; the ones after find the flag and write nothing), under its row lock: a
-- completion writing it meanwhile is waited for, and the row it moved to jobs_done is read
-- instead (the 40001 of a row moved under the statement: run again).
--
-- The row lock also makes the statements that pass over locked rows pass over this one
-- until the waiter commits, so what they would have done is asked for again:
-- * a queued row is announced, as any writer that holds a queued row does (claims walked
--   past it), also by a later waiter that found the flag set (it held the row while it
--   waited for the first waiter's write);
-- * a row held for its key ('key') leaves the key's slot freed for the next claim, which
--   lets the key's held jobs go (or holds them again); one held for its key's rate window
--   ('rate') locks the key's window row, so that a claim letting the key go waits for this
--   transaction and then finds the row unlocked. Without these a release that skipped the
--   row left it held until the sweep.
--
-- Lookups by id, pinned to the indexes: a plan made under empty statistics scanned
-- jobs_live and every day's table whole (EXPLAIN of its generic plans on a fresh schema).
CREATE OR REPLACE FUNCTION skiplock.watch_job(job_id bigint)
RETURNS TABLE (id bigint, state skiplock.job_state, attempt int, output jsonb,
               last_error text, finished_at timestamptz)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    attempts int := 0;
    live record;
    ended record;
BEGIN
    LOOP
        BEGIN
            UPDATE skiplock.jobs_live j SET awaited = true
            WHERE j.id = watch_job.job_id AND j.awaited IS NOT TRUE
            RETURNING j.id, j.state, j.attempt, j.queue, j.priority, j.scheduled_at,
                      j.held_for, j.concurrency_key
            INTO live;
            IF NOT FOUND THEN
                -- Awaited already, or not live: live jobs first (see "A job looked up by
                -- id through skiplock.jobs" in 15_partitions.sql), then the finished ones.
                SELECT j.id, j.state, j.attempt, j.queue, j.priority, j.scheduled_at,
                       j.held_for, j.concurrency_key
                INTO live
                FROM skiplock.jobs_live j WHERE j.id = watch_job.job_id;
            END IF;
            IF live.id IS NOT NULL THEN
                IF live.state = 'queued' THEN
                    PERFORM skiplock.internal_announce(ARRAY[
                        (live.queue, live.priority, live.scheduled_at)::skiplock.runnable_key]);
                ELSIF live.held_for IS NOT NULL THEN
                    PERFORM skiplock.internal_release_passed_over(live.queue,
                                                                  live.concurrency_key,
                                                                  live.held_for, true);
                END IF;
                RETURN QUERY SELECT live.id, live.state, live.attempt, NULL::jsonb,
                                    NULL::text, NULL::timestamptz;
                RETURN;
            END IF;
            SELECT j.id, j.state, j.attempt, j.output, j.last_error, j.finished_at INTO ended
            FROM skiplock.internal_finished_job(watch_job.job_id) j;
            IF ended.state IN ('waiting', 'queued', 'running') THEN
                -- Back to a live state since the look above (retried): marked there.
                CONTINUE;
            END IF;
            IF ended.id IS NOT NULL THEN
                -- A finished row written by hand may lack its time; finished all the same.
                RETURN QUERY SELECT ended.id, ended.state, ended.attempt, ended.output,
                                    ended.last_error, coalesce(ended.finished_at, '-infinity');
            END IF;
            RETURN;
        EXCEPTION WHEN serialization_failure THEN
            -- Its row moved to the other partition meanwhile: run again (see
            -- skiplock.internal_may_retry_moved).
            attempts := attempts + 1;
            IF NOT skiplock.internal_may_retry_moved(attempts) THEN
                RAISE;
            END IF;
        END;
    END LOOP;
END;
$$;
COMMENT ON FUNCTION skiplock.watch_job(bigint) IS
    'Marks the job awaited, so that it notifies skiplock_finished with its id when it finishes, and returns where it stands: finished_at set once it finished (succeeded with output, dead with last_error, cancelled); no row when it does not exist. LISTEN skiplock_finished before calling it, and call it again at each notification of the id.';
