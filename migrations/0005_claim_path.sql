-- skiplock schema, version 5: the invariant the claim-holder statements rely on, and a
-- lighter index set for the hot path.
--
-- A claim token exists only while its job runs. Every transition out of `running`
-- already clears it (complete, fail, release, reap, cancel); the constraint makes it a
-- guarantee, so "the row carries my token" alone proves "my claim is live", and the
-- completion, failure, release and heartbeat statements can find their rows by primary
-- key without a `state = 'running'` filter (see src/db/jobs.rs for why that matters).
ALTER TABLE skiplock.jobs
    ADD CONSTRAINT jobs_claim_token_only_running CHECK (claim_token IS NULL OR state = 'running');

-- Every claim and every completion writes a new row version, and (as `state` is in the
-- predicates of the partial indexes) never a HOT one: each index on all rows takes one
-- more entry per transition. jobs_queue_state_idx served only operator counts by queue,
-- and cost the drain about 15 % (floor of claim + complete, batch 1000 on two
-- connections: 40,400 -> 49,400 jobs/s; WAL per job 1,063 -> 912 bytes). The operator
-- queries use the partial indexes instead (stats, below) or the primary key (listings,
-- newest first). skiplock.queue_counts counts every retained row, now by a sequential
-- scan; skiplock.stats is the cheap view to poll.
DROP INDEX skiplock.jobs_queue_state_idx;

-- skiplock.stats, the same columns, read as four parts that each match a partial index
-- (jobs_claim_idx, jobs_waiting_idx, jobs_running_idx, jobs_finished_idx), so its cost
-- follows the backlog and the last hour, not the retained history.
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
           WHERE j.state = 'queued' AND j.scheduled_at <= now())), 0)::float8 AS lag_seconds,
       (count(*) FILTER (WHERE j.state = 'succeeded'
                           AND j.finished_at > now() - interval '1 minute') / 60.0)::float8
                                                                              AS per_second
FROM recent j
LEFT JOIN skiplock.queues q ON q.name = j.queue
GROUP BY j.queue, j.kind, q.paused;

-- A queue table turns rows over fast: every job leaves two dead row versions behind, and
-- the claim index keeps entries for claimed rows until VACUUM removes them, entries each
-- claim then walks past. Vacuum and analyze this table after 2 % of it changed instead of
-- the server-wide 20 % / 10 %; ANALYZE also refreshes the statistics that cached plans
-- were made from. (Not measured with autovacuum on: the development server runs with
-- autovacuum = off; see docs/benchmarks.md.)
ALTER TABLE skiplock.jobs SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);
