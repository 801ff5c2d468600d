-- skiplock schema, version 8: a queue's name is at most 1,000 bytes, in skiplock.jobs,
-- skiplock.queues and skiplock.cron_schedules.
--
-- Every write that makes a job runnable notifies its queue's name (skiplock_runnable,
-- skiplock_jobs; see 0007), and Postgres refuses a notification payload of 8,000 bytes or
-- more. A longer name was refused on INSERT only by that notification ("payload string too
-- long", which names no column), and an UPDATE let it in: the row was then claimed and
-- run, but every later write that announces it failed, taking the rest of its statement
-- with it (resume_queue, retry_job, the worker's release batch, the promotion of a
-- parent's children). A cron schedule with such a queue failed at every slot. The tables
-- now refuse such a name themselves, with the constraint's name in the error; 1,000 bytes
-- leaves the payload's other fields room to spare.
--
-- A job or schedule already holding a longer name (written by an UPDATE) makes this
-- migration fail with what to do, before anything changes: the checks are validated, so
-- that no later update of such a row (its claim, its completion) fails on them. Adding
-- them reads each table once under an exclusive lock: claims and enqueues wait for that
-- read (about a second per few million jobs) and then go on. The locks are taken first,
-- in the order the running system takes them (a cron pass locks cron_schedules, then
-- jobs; a claim jobs, then queues), so that the migration queues behind them instead of
-- closing a deadlock with them.

LOCK TABLE skiplock.cron_schedules, skiplock.jobs, skiplock.queues IN ACCESS EXCLUSIVE MODE;

DO $$
DECLARE
    tab text;
    what text;
    too_long bigint;
BEGIN
    FOR tab, what IN VALUES ('jobs', 'job(s)'), ('cron_schedules', 'cron schedule(s)') LOOP
        EXECUTE format('SELECT count(*) FROM skiplock.%I WHERE octet_length(queue) > 1000', tab)
            INTO too_long;
        IF too_long > 0 THEN
            RAISE EXCEPTION '% % have a queue name over 1,000 bytes', too_long, what
                USING ERRCODE = 'check_violation',
                      HINT = format('give them a shorter queue (UPDATE skiplock.%I SET queue = ... '
                          'WHERE octet_length(queue) > 1000), then run skiplock migrate again', tab);
        END IF;
    END LOOP;
    -- A paused name that long pauses nothing a job can be in now.
    DELETE FROM skiplock.queues WHERE octet_length(name) > 1000;
END;
$$;

ALTER TABLE skiplock.jobs ADD CONSTRAINT jobs_queue_name_length
    CHECK (octet_length(queue) <= 1000);
ALTER TABLE skiplock.queues ADD CONSTRAINT queues_name_length
    CHECK (octet_length(name) <= 1000);
ALTER TABLE skiplock.cron_schedules ADD CONSTRAINT cron_schedules_queue_name_length
    CHECK (octet_length(queue) <= 1000);

COMMENT ON CONSTRAINT jobs_queue_name_length ON skiplock.jobs IS
    'A queue name is at most 1,000 bytes: workers are told of runnable jobs by notifications that carry it, and Postgres caps their payload at 8,000 bytes.';
COMMENT ON CONSTRAINT queues_name_length ON skiplock.queues IS
    'A queue name is at most 1,000 bytes, as in skiplock.jobs (jobs_queue_name_length).';
COMMENT ON CONSTRAINT cron_schedules_queue_name_length ON skiplock.cron_schedules IS
    'A queue name is at most 1,000 bytes, as in skiplock.jobs (jobs_queue_name_length).';
