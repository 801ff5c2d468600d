-- migrations/functions/12_history_and_retention.sql: History rollup: what is kept of
-- finished jobs once retention removes them (the days themselves: 15_partitions.sql).
--
-- Defines:
--   internal_job_history_run_bounds, internal_job_history_array_add
--   aggregate internal_job_history_array_sum

-- ---- History rollup ----------------------------------------------------------------------

-- Upper bounds, in seconds, of the run-time histogram buckets. Their number (16) is fixed:
-- src/db/history.rs counts 17 intervals.
CREATE OR REPLACE FUNCTION skiplock.internal_job_history_run_bounds() RETURNS float8[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT '{0.005,0.01,0.025,0.05,0.1,0.25,0.5,1,2.5,5,10,30,60,300,900,3600}'::float8[];
$$;

-- Element-wise sum; the shorter array counts as padded with zeros.
CREATE OR REPLACE FUNCTION skiplock.internal_job_history_array_add(a bigint[], b bigint[]) RETURNS bigint[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(array_agg(coalesce(x, 0) + coalesce(y, 0) ORDER BY n), '{}')
    FROM unnest(coalesce(a, '{}'), coalesce(b, '{}')) WITH ORDINALITY AS t(x, y, n);
$$;

CREATE OR REPLACE AGGREGATE skiplock.internal_job_history_array_sum(bigint[]) (
    SFUNC = skiplock.internal_job_history_array_add,
    STYPE = bigint[],
    INITCOND = '{}'
);
