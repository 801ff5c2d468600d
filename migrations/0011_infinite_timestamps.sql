-- skiplock schema, version 11: the operator views hold up when a row's timestamps are
-- infinite.
--
-- The table accepts scheduled_at = '-infinity' (the job runs first; the claim handles it
-- since 0009) and 'infinity' (it never comes due). `now() - '-infinity'` is an error
-- ("cannot subtract infinite timestamps"), so one such row, written by hand, made
-- `SELECT * FROM skiplock.stats` and `skiplock stats` fail for every queue. The lag now
-- counts only jobs due at a finite time; the row still counts as runnable.
CREATE OR REPLACE VIEW skiplock.stats AS
WITH recent AS (
    SELECT queue, kind, state, scheduled_at, finished_at
    FROM skiplock.jobs WHERE state = 'queued'
    UNION ALL
    SELECT queue, kind, state, scheduled_at, finished_at
    FROM skiplock.jobs WHERE state = 'waiting'
    UNION ALL
    SELECT queue, kind, state, scheduled_at, finished_at
    FROM skiplock.jobs WHERE state = 'running'
    UNION ALL
    SELECT queue, kind, state, scheduled_at, finished_at
    FROM skiplock.jobs
    WHERE state IN ('succeeded', 'dead') AND finished_at > now() - interval '1 hour'
)
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
           WHERE j.state = 'queued' AND j.scheduled_at <= now()
             AND isfinite(j.scheduled_at))), 0)::float8                       AS lag_seconds,
       (count(*) FILTER (WHERE j.state = 'succeeded'
                           AND j.finished_at > now() - interval '1 minute') / 60.0)::float8
                                                                              AS per_second
FROM recent j
LEFT JOIN skiplock.queues q ON q.name = j.queue
GROUP BY j.queue, j.kind, q.paused;

CREATE OR REPLACE VIEW skiplock.queue_lag AS
SELECT queue,
       min(scheduled_at) FILTER (WHERE scheduled_at <= now()) AS oldest_runnable_at,
       coalesce(now() - min(scheduled_at) FILTER (
           WHERE scheduled_at <= now() AND isfinite(scheduled_at)),
                interval '0') AS lag,
       coalesce(extract(epoch FROM now() - min(scheduled_at) FILTER (
           WHERE scheduled_at <= now() AND isfinite(scheduled_at))), 0)::float8 AS lag_seconds
FROM skiplock.jobs
WHERE state = 'queued'
GROUP BY queue;
