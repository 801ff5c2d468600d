-- skiplock schema, version 10: cancel_job waits before it tries again after a deadlock.
--
-- 0006 made cancel_job retry its body when Postgres chose it as a deadlock victim: its
-- subtransaction rolls back, its row locks go, and the other side can finish. But it
-- retried at once, and a row whose locker has just rolled back is free to whoever asks
-- first: the other side, woken, still has to be scheduled to take it, while the retry is
-- already running in this backend. The retry took the cancelled job's row again, waited
-- again for the row the other side holds, closed the same cycle, and after three rounds
-- the deadlock reached the caller (seen as an intermittent failure of
-- control::a_cancel_chosen_as_deadlock_victim_retries_and_succeeds). Now each retry first
-- sleeps a short, growing, jittered while (10 to 20 ms, then twice that each time, below
-- a second in all) so the other side takes its lock and finishes, and it tries up to six
-- times.
CREATE OR REPLACE FUNCTION skiplock.cancel_job(job_id bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    attempts int := 0;
BEGIN
    LOOP
        BEGIN
            RETURN skiplock.cancel_job_once(job_id);
        EXCEPTION WHEN deadlock_detected THEN
            attempts := attempts + 1;
            IF attempts >= 6 THEN
                RAISE;
            END IF;
        END;
        -- Outside the subtransaction: its locks are gone while this sleeps.
        PERFORM pg_sleep(0.01 * power(2, attempts - 1) * (1 + random()));
    END LOOP;
END;
$$;

COMMENT ON FUNCTION skiplock.cancel_job(bigint) IS
    'Cancels a job that has not finished; retries a deadlock after a short jittered wait. Returns false if the job had finished or does not exist.';
