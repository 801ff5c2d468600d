-- skiplock schema, version 5: the time of an entry of `errors`, read so that one entry
-- written by hand never fails a statement over many rows.
--
-- `errors` is plain jsonb: people and other languages write it. The dashboard's throughput
-- and the pruner's history rollup cast each entry's `at` to a timestamp, and one entry
-- whose `at` is not one ('soon', '2026-02-30') failed the whole statement: the dashboard's
-- chart went blank and the pruner stopped pruning. They now read it with this function,
-- which gives NULL for an entry without a valid, finite `at` (and for an entry that is not
-- an object), and count only the entries it can place in time.

CREATE FUNCTION skiplock.error_time(entry jsonb) RETURNS timestamptz
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

COMMENT ON FUNCTION skiplock.error_time(jsonb) IS
    'The time (`at`) of an entry of skiplock.jobs.errors, or NULL when it has no valid, finite one: statements over many rows read it with this so that one entry written by hand cannot fail them.';
