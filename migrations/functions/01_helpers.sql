-- migrations/functions/01_helpers.sql: Helpers: backoff, error lists, the args limit, job
-- ids.
--
-- Defines:
--   backoff, internal_append_error, internal_error_time, args_max_bytes
--   internal_check_args_size, internal_args_within_limit, internal_next_job_id

-- ---- Backoff, errors and the args limit --------------------------------------------------

-- Default retry delay, shared by the reaper and documented beside the Rust policy
-- (src/retry.rs): min(2^attempt, 3600) seconds, times a random factor in [0.75, 1.25).
CREATE OR REPLACE FUNCTION skiplock.backoff(attempt int) RETURNS interval
LANGUAGE sql VOLATILE AS $$
    SELECT make_interval(secs => least(power(2, least(attempt, 30)), 3600) * (0.75 + random() * 0.5));
$$;
COMMENT ON FUNCTION skiplock.backoff(integer) IS
    'The default delay before a failed attempt runs again: min(2^attempt, 3600) seconds, times a random factor in [0.75, 1.25). What `fail` and the reaper use when no delay is given. Example: SELECT skiplock.backoff(3);';

-- Append a failure to a job's error list, keeping the most recent 20.
CREATE OR REPLACE FUNCTION skiplock.internal_append_error(errors jsonb, attempt int, message text) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(jsonb_agg(e ORDER BY n), '[]'::jsonb)
    FROM (
        SELECT e, n
        FROM jsonb_array_elements(
            errors || jsonb_build_array(jsonb_build_object(
                'attempt', attempt, 'at', now(), 'message', message))
        ) WITH ORDINALITY AS t(e, n)
        ORDER BY n DESC
        LIMIT 20
    ) recent;
$$;

CREATE OR REPLACE FUNCTION skiplock.internal_error_time(entry jsonb) RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    at text := CASE WHEN jsonb_typeof(entry) = 'object' THEN entry ->> 'at' END;
    t timestamptz;
BEGIN
    IF at IS NULL THEN
        RETURN NULL;
    END IF;
    BEGIN
        t := at::timestamptz;
    EXCEPTION WHEN data_exception THEN
        -- invalid_datetime_format, datetime_field_overflow and the rest of class 22.
        RETURN NULL;
    END;
    RETURN CASE WHEN isfinite(t) THEN t END;
END;
$$;
COMMENT ON FUNCTION skiplock.internal_error_time(jsonb) IS
    'The time (`at`) of an entry of skiplock.jobs.errors, or NULL when it has no valid, finite one: statements over many rows read it with this so that one entry written by hand cannot fail them.';

-- The largest args accepted on every path, in bytes of the jsonb text (octet_length of
-- args::text). 1 MiB unless the setting skiplock.args_max_bytes says otherwise
-- (ALTER DATABASE … SET skiplock.args_max_bytes = 4194304). The Rust API checks its own
-- limit (SKIPLOCK_ARGS_MAX_BYTES) before sending, on compact JSON.
CREATE OR REPLACE FUNCTION skiplock.args_max_bytes() RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT coalesce(nullif(current_setting('skiplock.args_max_bytes', true), '')::bigint, 1048576);
$$;
COMMENT ON FUNCTION skiplock.args_max_bytes() IS
    'The largest `args` accepted on every path, in bytes of `args::text`: 1 MiB unless the setting `skiplock.args_max_bytes` says otherwise (ALTER DATABASE … SET skiplock.args_max_bytes = 4194304).';

CREATE OR REPLACE FUNCTION skiplock.internal_check_args_size(args jsonb) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    size bigint := octet_length(args::text);
    limit_bytes bigint := skiplock.args_max_bytes();
BEGIN
    IF size > limit_bytes THEN
        RAISE EXCEPTION 'args are % bytes, over the limit of % bytes', size, limit_bytes
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'store large data elsewhere and pass a reference, or raise the setting skiplock.args_max_bytes';
    END IF;
END;
$$;

-- `args`, once checked against the limit: for an expression that makes args (the merge
-- of an enqueue's ON CONFLICT DO UPDATE, which no insert trigger sees).
CREATE OR REPLACE FUNCTION skiplock.internal_args_within_limit(args jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
BEGIN
    IF pg_column_size(args) > 4096 THEN
        PERFORM skiplock.internal_check_args_size(args);
    END IF;
    RETURN args;
END;
$$;

-- The next job id, for a row inserted into skiplock.jobs_live directly (the partition's
-- default; skiplock.enqueue_job inserts there): the identity's sequence, as an insert into
-- skiplock.jobs draws it, and as its owner, so that an enqueuer needs no privilege on the
-- sequence (an insert into skiplock.jobs needs none either).
CREATE OR REPLACE FUNCTION skiplock.internal_next_job_id() RETURNS bigint
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT nextval(pg_get_serial_sequence('skiplock.jobs', 'id'));
$$;

ALTER TABLE skiplock.jobs_live ALTER COLUMN id SET DEFAULT skiplock.internal_next_job_id();
