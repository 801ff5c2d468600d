-- skiplock schema, version 3: views for operators and a bulk retry of dead jobs.
--
-- Every view reads the one logical table skiplock.jobs by the database clock (now()), so
-- the numbers agree whichever machine asks. They are plain views, computed when queried:
--   skiplock.stats          per queue and kind: runnable, scheduled, waiting, running,
--                           succeeded and dead in the last hour, lag, jobs per second
--   skiplock.queue_counts   per queue: jobs in each state, whether the queue is paused
--   skiplock.queue_lag      per queue: age of the oldest runnable job
--   skiplock.throughput     per queue and kind: jobs finished in the last minute and hour
--   skiplock.dead_jobs      dead jobs with their last error, newest first
--
-- Only unfinished jobs and jobs finished within the last hour feed stats, queue_lag and
-- throughput, so their cost follows the backlog and the last hour's traffic, not the
-- retained history. queue_counts counts every retained row (an index-only scan of
-- jobs_queue_state_idx when the visibility map allows).
--
-- Jobs finished more than an hour ago may already be pruned (see the worker's retention),
-- so "last hour" numbers are exact only while retention is an hour or more.

CREATE VIEW skiplock.stats AS
SELECT j.queue,
       j.kind,
       coalesce(q.paused, false) AS paused,
       count(*) FILTER (WHERE j.state = 'queued' AND j.scheduled_at <= now()) AS runnable,
       count(*) FILTER (WHERE j.state = 'queued' AND j.scheduled_at > now())  AS scheduled,
       count(*) FILTER (WHERE j.state = 'waiting')                            AS waiting,
       count(*) FILTER (WHERE j.state = 'running')                            AS running,
       count(*) FILTER (WHERE j.state = 'succeeded'
                          AND j.finished_at > now() - interval '1 hour')      AS succeeded_last_hour,
       count(*) FILTER (WHERE j.state = 'dead'
                          AND j.finished_at > now() - interval '1 hour')      AS dead_last_hour,
       count(*) FILTER (WHERE j.state = 'succeeded'
                          AND j.finished_at > now() - interval '1 minute')    AS succeeded_last_minute,
       coalesce(extract(epoch FROM now() - min(j.scheduled_at) FILTER (
           WHERE j.state = 'queued' AND j.scheduled_at <= now())), 0)::float8 AS lag_seconds,
       (count(*) FILTER (WHERE j.state = 'succeeded'
                           AND j.finished_at > now() - interval '1 minute') / 60.0)::float8
                                                                              AS per_second
FROM skiplock.jobs j
LEFT JOIN skiplock.queues q ON q.name = j.queue
WHERE j.state IN ('waiting', 'queued', 'running')
   OR (j.state IN ('succeeded', 'dead') AND j.finished_at > now() - interval '1 hour')
GROUP BY j.queue, j.kind, q.paused;

COMMENT ON VIEW skiplock.stats IS
    'Per queue and kind: runnable (queued, due), scheduled (queued, not yet due), waiting, running, succeeded and dead in the last hour, lag_seconds (age of the oldest runnable job) and per_second (successes over the last minute / 60). Example: SELECT * FROM skiplock.stats ORDER BY lag_seconds DESC;';

CREATE VIEW skiplock.queue_counts AS
SELECT j.queue,
       coalesce(q.paused, false) AS paused,
       count(*) FILTER (WHERE j.state = 'waiting')   AS waiting,
       count(*) FILTER (WHERE j.state = 'queued')    AS queued,
       count(*) FILTER (WHERE j.state = 'running')   AS running,
       count(*) FILTER (WHERE j.state = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE j.state = 'dead')      AS dead,
       count(*) FILTER (WHERE j.state = 'cancelled') AS cancelled,
       count(*)                                      AS total
FROM skiplock.jobs j
LEFT JOIN skiplock.queues q ON q.name = j.queue
GROUP BY j.queue, q.paused;

COMMENT ON VIEW skiplock.queue_counts IS
    'Per queue: how many retained jobs are in each state. Example: SELECT queue, queued, dead FROM skiplock.queue_counts WHERE dead > 0;';

CREATE VIEW skiplock.queue_lag AS
SELECT queue,
       min(scheduled_at) FILTER (WHERE scheduled_at <= now()) AS oldest_runnable_at,
       coalesce(now() - min(scheduled_at) FILTER (WHERE scheduled_at <= now()),
                interval '0') AS lag,
       coalesce(extract(epoch FROM now() - min(scheduled_at) FILTER (
           WHERE scheduled_at <= now())), 0)::float8 AS lag_seconds
FROM skiplock.jobs
WHERE state = 'queued'
GROUP BY queue;

COMMENT ON VIEW skiplock.queue_lag IS
    'Per queue with queued jobs: how long the oldest runnable job has been due (zero when none is due). Example: SELECT queue, lag FROM skiplock.queue_lag WHERE lag > interval ''1 minute'';';

CREATE VIEW skiplock.throughput AS
SELECT queue,
       kind,
       count(*) FILTER (WHERE state = 'succeeded'
                          AND finished_at > now() - interval '1 minute') AS succeeded_last_minute,
       count(*) FILTER (WHERE state = 'succeeded')                       AS succeeded_last_hour,
       count(*) FILTER (WHERE state = 'dead'
                          AND finished_at > now() - interval '1 minute') AS dead_last_minute,
       count(*) FILTER (WHERE state = 'dead')                            AS dead_last_hour,
       (count(*) FILTER (WHERE state = 'succeeded'
                           AND finished_at > now() - interval '1 minute') / 60.0)::float8
                                                                         AS per_second_last_minute,
       (count(*) FILTER (WHERE state = 'succeeded') / 3600.0)::float8    AS per_second_last_hour
FROM skiplock.jobs
WHERE state IN ('succeeded', 'dead') AND finished_at > now() - interval '1 hour'
GROUP BY queue, kind;

COMMENT ON VIEW skiplock.throughput IS
    'Per queue and kind: jobs that succeeded or died in the last minute and hour, and successes per second. Example: SELECT * FROM skiplock.throughput WHERE queue = ''mail'';';

CREATE VIEW skiplock.dead_jobs AS
SELECT id, queue, kind, args, attempt, max_attempts, last_error, errors, created_at,
       finished_at
FROM skiplock.jobs
WHERE state = 'dead'
ORDER BY finished_at DESC, id DESC;

COMMENT ON VIEW skiplock.dead_jobs IS
    'Dead jobs with their last error, newest first. Example: SELECT id, kind, last_error FROM skiplock.dead_jobs LIMIT 20;';

-- Put every dead job (of one queue, or of all when queue_name is NULL) back in line, as
-- skiplock.retry_job does for one. Returns the ids retried. A dead job whose unique_key is
-- held by another pending job is left dead (retry_job refuses it) instead of failing the
-- whole call. Example: SELECT count(*) FROM skiplock.retry_dead_jobs('mail');
CREATE FUNCTION skiplock.retry_dead_jobs(queue_name text DEFAULT NULL) RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
DECLARE
    dead_id bigint;
BEGIN
    FOR dead_id IN
        SELECT id FROM skiplock.jobs
        WHERE state = 'dead' AND (queue_name IS NULL OR queue = queue_name)
        ORDER BY id
    LOOP
        BEGIN
            IF skiplock.retry_job(dead_id) THEN
                RETURN NEXT dead_id;
            END IF;
        EXCEPTION WHEN unique_violation THEN
            -- Another pending job holds its unique key; leave this one dead.
        END;
    END LOOP;
END;
$$;
