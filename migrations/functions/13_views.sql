-- migrations/functions/13_views.sql: Views for operators.
--
-- Defines:
--   view stats, view queue_counts, view queue_limits, view queue_lag, view throughput
--   view dead_jobs

-- ---- Views for operators -----------------------------------------------------------------

-- stats is read as four parts that each match a partial index (jobs_claim_idx,
-- jobs_waiting_idx, jobs_running_idx, jobs_finished_idx), so its cost follows the backlog
-- and the last hour, not the retained history.
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
COMMENT ON VIEW skiplock.stats IS
    'Per queue and kind: runnable (queued, due), scheduled (queued, not yet due), waiting, running, succeeded and dead in the last hour, lag_seconds (age of the oldest runnable job) and per_second (successes over the last minute / 60). Example: SELECT * FROM skiplock.stats ORDER BY lag_seconds DESC;';

CREATE OR REPLACE VIEW skiplock.queue_counts AS
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

-- Queues with a global limit: each limit, its use now, and the runnable jobs it holds
-- back. started_in_period counts the starts the rate limit keeps (those of the last
-- rate_period); holding_back names the limit that keeps runnable jobs from starting now.
CREATE OR REPLACE VIEW skiplock.queue_limits AS
SELECT q.name AS queue,
       q.paused,
       q.max_running,
       r.running,
       q.rate_limit,
       q.rate_period,
       s.started AS started_in_period,
       CASE WHEN q.max_running IS NOT NULL AND r.running >= q.max_running THEN 'max_running'
            WHEN q.rate_limit IS NOT NULL AND s.started >= q.rate_limit THEN 'rate_limit'
       END AS holding_back,
       w.runnable,
       CASE WHEN (q.max_running IS NOT NULL AND r.running >= q.max_running)
                 OR (q.rate_limit IS NOT NULL AND s.started >= q.rate_limit)
            THEN w.runnable ELSE 0 END AS held_back,
       q.key_max_running,
       k.keys_at_limit,
       k.held_by_key,
       q.key_rate_limit,
       q.key_rate_period,
       k.keys_rate_limited,
       q.key_claimable
FROM skiplock.queues q
CROSS JOIN LATERAL (SELECT count(*) AS running FROM skiplock.jobs_live j
                    WHERE j.queue = q.name AND j.state = 'running') r
CROSS JOIN LATERAL (SELECT count(*) AS started FROM skiplock.rate_window_starts x
                    WHERE x.queue = q.name AND x.concurrency_key = ''
                      AND x.started_at > now() - q.rate_period) s
CROSS JOIN LATERAL (SELECT count(*) AS runnable FROM skiplock.jobs_live j
                    WHERE j.queue = q.name AND j.state = 'queued'
                      AND j.scheduled_at <= now()) w
-- Keys at their key_max_running (among the running jobs with a key; NULL without it), keys
-- whose rate window is full (NULL without key_rate_limit), and the jobs held back for
-- their keys (waiting with a key, no lane and no parent left to succeed); NULL without a
-- per-key limit.
LEFT JOIN LATERAL (
    SELECT CASE WHEN q.key_max_running IS NOT NULL THEN (SELECT count(*) FROM (
                SELECT FROM skiplock.jobs_live r
                WHERE r.queue = q.name AND r.state = 'running' AND r.concurrency_key IS NOT NULL
                GROUP BY r.concurrency_key HAVING count(*) >= q.key_max_running) f)
           END AS keys_at_limit,
           CASE WHEN q.key_rate_limit IS NOT NULL THEN (SELECT count(*)
                FROM skiplock.rate_windows w
                WHERE w.queue = q.name AND w.concurrency_key <> ''
                  AND skiplock.internal_rate_full_until(w.queue, w.concurrency_key,
                                                        q.key_rate_limit, q.key_rate_period,
                                                        now()) IS NOT NULL)
           END AS keys_rate_limited,
           (SELECT count(*) FROM skiplock.jobs_live h
            WHERE h.queue = q.name AND h.state = 'waiting' AND h.held_for IS NOT NULL) AS held_by_key
    WHERE q.key_max_running IS NOT NULL OR q.key_rate_limit IS NOT NULL
       OR q.key_claimable IS NOT NULL) k ON true
WHERE q.max_running IS NOT NULL OR q.rate_limit IS NOT NULL OR q.key_max_running IS NOT NULL
   OR q.key_rate_limit IS NOT NULL OR q.key_claimable IS NOT NULL;
COMMENT ON VIEW skiplock.queue_limits IS
    'Per queue with a global limit: max_running and the jobs running, rate_limit per rate_period and the starts in the last period, which limit holds runnable jobs back now (holding_back) and how many (held_back); key_max_running and the keys at it (keys_at_limit), key_rate_limit per key_rate_period and the keys whose window is full (keys_rate_limited), the jobs held back for their keys (held_by_key), and key_claimable (fair queueing by key: the jobs waiting their turn are among held_by_key). Example: SELECT queue, running, max_running, held_back FROM skiplock.queue_limits;';

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
COMMENT ON VIEW skiplock.queue_lag IS
    'Per queue with queued jobs: how long the oldest runnable job has been due (zero when none is due). Example: SELECT queue, lag FROM skiplock.queue_lag WHERE lag > interval ''1 minute'';';

CREATE OR REPLACE VIEW skiplock.throughput AS
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

CREATE OR REPLACE VIEW skiplock.dead_jobs AS
SELECT id, queue, kind, args, attempt, max_attempts, last_error, errors, created_at,
       finished_at
FROM skiplock.jobs
WHERE state = 'dead'
ORDER BY finished_at DESC, id DESC;
COMMENT ON VIEW skiplock.dead_jobs IS
    'Dead jobs with their last error, newest first. Example: SELECT id, kind, last_error FROM skiplock.dead_jobs LIMIT 20;';
