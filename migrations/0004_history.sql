-- skiplock schema, version 4: job history that survives pruning.
--
-- Finished jobs are deleted by the pruner, so their numbers move into a small rollup table,
-- skiplock.job_history, in the very statement that deletes them (see
-- src/db/history.rs: jobs_prune_finished_rolled_up). The completion path is untouched: a
-- finished job is counted live in skiplock.jobs until it is pruned, and in the rollup
-- afterwards, never in both and never in neither. History queries (src/db/history.rs) add
-- the two up, counting live rows with the same SQL that rolls them up.
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
    'Hourly (UTC) numbers of pruned jobs per queue and kind; bucket -infinity holds everything older than the retention. Live (not yet pruned) jobs are not in it.';
COMMENT ON COLUMN skiplock.job_history.failed IS
    'Failed attempts (entries of the jobs'' errors lists), in the hour each failure happened.';
COMMENT ON COLUMN skiplock.job_history.run_histogram IS
    'Run times counted per interval of skiplock.job_history_run_bounds() (16 bounds, 17 elements): element 1 counts run times under bounds[1], element i+1 those from bounds[i] up to bounds[i+1], element 17 those from bounds[16] on.';

-- Upper bounds, in seconds, of the run-time histogram buckets. Their number (16) is fixed:
-- src/db/history.rs counts 17 intervals.
CREATE FUNCTION skiplock.job_history_run_bounds() RETURNS float8[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT '{0.005,0.01,0.025,0.05,0.1,0.25,0.5,1,2.5,5,10,30,60,300,900,3600}'::float8[];
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
