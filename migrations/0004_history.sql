-- skiplock schema, version 4: job history that survives pruning.
--
-- Finished jobs are deleted by the pruner, so their numbers move into a small rollup table,
-- skiplock.job_history, in the very statement that deletes them (see
-- src/db/history.rs: jobs_prune_finished_rolled_up). The completion path is untouched: a
-- finished job is counted live in skiplock.jobs until it is pruned, and in the rollup
-- afterwards, never in both and never in neither. History queries add the two up; the view
-- skiplock.job_history_all does so per hour.
--
-- Time buckets are whole hours in UTC. What one finished job contributes:
--   succeeded / dead / cancelled  1 in the hour of finished_at, by final state
--   failed                        1 per entry of errors (each failed attempt), in the hour of
--                                 that entry's `at`; errors keeps the 20 most recent failures,
--                                 so a job that failed more often counts 20
--   run time                      finished_at - claimed_at (the last attempt), succeeded and
--                                 dead jobs only, with a histogram over job_history_run_bounds()
--   wait time                     claimed_at - scheduled_at (due until claimed), same jobs
--
-- Retention: job_history_prune_expired folds hours older than the retention (a year by
-- default) into one row per queue and kind at bucket '-infinity', so lifetime totals (the
-- Prometheus counters) never go down while the hourly detail ages out.

CREATE TABLE skiplock.job_history (
    bucket        timestamptz NOT NULL,
    queue         text        NOT NULL,
    kind          text        NOT NULL,
    succeeded     bigint      NOT NULL DEFAULT 0,
    failed        bigint      NOT NULL DEFAULT 0,
    dead          bigint      NOT NULL DEFAULT 0,
    cancelled     bigint      NOT NULL DEFAULT 0,
    run_count     bigint      NOT NULL DEFAULT 0,
    run_seconds   float8      NOT NULL DEFAULT 0,
    wait_count    bigint      NOT NULL DEFAULT 0,
    wait_seconds  float8      NOT NULL DEFAULT 0,
    run_histogram bigint[]    NOT NULL DEFAULT '{}',
    PRIMARY KEY (bucket, queue, kind)
);

COMMENT ON TABLE skiplock.job_history IS
    'Hourly (UTC) numbers of pruned jobs per queue and kind; bucket -infinity holds everything older than the retention. Live (not yet pruned) jobs are not in it: query skiplock.job_history_all for both.';
COMMENT ON COLUMN skiplock.job_history.failed IS
    'Failed attempts (entries of the jobs'' errors lists), in the hour each failure happened.';
COMMENT ON COLUMN skiplock.job_history.run_histogram IS
    'Run times counted per interval of skiplock.job_history_run_bounds(): element i+1 counts run times r with bounds[i] <= r < bounds[i+1] (bounds[0] = 0, bounds[n+1] = infinity).';

-- Upper bounds, in seconds, of the run-time histogram buckets.
CREATE FUNCTION skiplock.job_history_run_bounds() RETURNS float8[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT '{0.005,0.01,0.025,0.05,0.1,0.25,0.5,1,2.5,5,10,30,60,300,900,3600}'::float8[];
$$;

-- A histogram counting one run time (an empty array, which counts nothing, for NULL).
CREATE FUNCTION skiplock.job_history_run_histogram(run_seconds float8) RETURNS bigint[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN run_seconds IS NULL THEN '{}'::bigint[] ELSE ARRAY(
        SELECT (i = width_bucket(run_seconds, skiplock.job_history_run_bounds()))::int::bigint
        FROM generate_series(0, cardinality(skiplock.job_history_run_bounds())) AS i
        ORDER BY i
    ) END;
$$;

-- Element-wise sum; the shorter array counts as padded with zeros.
CREATE FUNCTION skiplock.job_history_array_add(a bigint[], b bigint[]) RETURNS bigint[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(array_agg(coalesce(x, 0) + coalesce(y, 0) ORDER BY n), '{}')
    FROM unnest(coalesce(a, '{}'), coalesce(b, '{}')) WITH ORDINALITY AS t(x, y, n);
$$;

CREATE AGGREGATE skiplock.job_history_array_sum(bigint[]) (
    SFUNC = skiplock.job_history_array_add,
    STYPE = bigint[],
    INITCOND = '{}'
);

-- What one finished job adds to the history: one row for its outcome and one row per
-- failed attempt, each with the hour it belongs to. Used both by the pruning statement and
-- by the live half of the history, so the two count alike.
CREATE FUNCTION skiplock.job_history_facts(
    state        skiplock.job_state,
    scheduled_at timestamptz,
    claimed_at   timestamptz,
    finished_at  timestamptz,
    errors       jsonb
) RETURNS TABLE (
    bucket        timestamptz,
    succeeded     int,
    failed        int,
    dead          int,
    cancelled     int,
    run_count     int,
    run_seconds   float8,
    wait_count    int,
    wait_seconds  float8,
    run_histogram bigint[]
)
LANGUAGE sql STABLE AS $$
    -- $1 state, $2 scheduled_at, $3 claimed_at, $4 finished_at, $5 errors
    SELECT date_trunc('hour', $4, 'UTC'),
           ($1 = 'succeeded')::int, 0, ($1 = 'dead')::int, ($1 = 'cancelled')::int,
           (t.run IS NOT NULL)::int, coalesce(t.run, 0),
           (t.wait IS NOT NULL)::int, coalesce(t.wait, 0),
           skiplock.job_history_run_histogram(t.run)
    FROM (
        SELECT CASE WHEN $1 IN ('succeeded', 'dead') AND $4 >= $3
                    THEN extract(epoch FROM $4 - $3)::float8 END AS run,
               -- A claim older than the schedule belongs to an earlier run (the job was
               -- retried by hand since): no wait time to tell.
               CASE WHEN $1 IN ('succeeded', 'dead') AND $3 >= $2
                    THEN extract(epoch FROM $3 - $2)::float8 END AS wait
    ) t
    WHERE $4 IS NOT NULL
    UNION ALL
    SELECT date_trunc('hour', (e ->> 'at')::timestamptz, 'UTC'), 0, 1, 0, 0, 0, 0, 0, 0, '{}'
    FROM jsonb_array_elements(coalesce($5, '[]')) AS e
    WHERE $4 IS NOT NULL AND e ? 'at';
$$;

-- History per hour, per queue and kind: the rollup plus jobs not pruned yet. Reading it
-- visits every retained finished job. Example:
--   SELECT bucket, queue, kind, succeeded, dead FROM skiplock.job_history_all
--   WHERE bucket > now() - interval '1 day' ORDER BY bucket;
CREATE VIEW skiplock.job_history_all AS
SELECT bucket, queue, kind,
       sum(succeeded)::bigint AS succeeded,
       sum(failed)::bigint AS failed,
       sum(dead)::bigint AS dead,
       sum(cancelled)::bigint AS cancelled,
       sum(run_count)::bigint AS run_count,
       sum(run_seconds)::float8 AS run_seconds,
       sum(wait_count)::bigint AS wait_count,
       sum(wait_seconds)::float8 AS wait_seconds,
       skiplock.job_history_array_sum(run_histogram) AS run_histogram
FROM (
    SELECT bucket, queue, kind, succeeded, failed, dead, cancelled, run_count, run_seconds,
           wait_count, wait_seconds, run_histogram
    FROM skiplock.job_history
    UNION ALL
    SELECT f.bucket, j.queue, j.kind, f.succeeded, f.failed, f.dead, f.cancelled, f.run_count,
           f.run_seconds, f.wait_count, f.wait_seconds, f.run_histogram
    FROM skiplock.jobs j,
         LATERAL skiplock.job_history_facts(j.state, j.scheduled_at, j.claimed_at,
                                            j.finished_at, j.errors) f
    WHERE j.state IN ('succeeded', 'dead', 'cancelled')
) h
GROUP BY bucket, queue, kind;

COMMENT ON VIEW skiplock.job_history_all IS
    'Per hour (UTC), queue and kind: succeeded, failed attempts, dead, cancelled, run and wait time sums, of pruned and retained jobs alike. Example: SELECT bucket, succeeded, dead FROM skiplock.job_history_all WHERE queue = ''mail'' ORDER BY bucket DESC LIMIT 24;';
