-- skiplock schema, version 13: skiplock.enqueue takes its priority as an integer.
--
-- It was a smallint, and Postgres does not turn an integer literal into a smallint for a
-- function argument, so `priority => 5` failed with "function skiplock.enqueue(...) does
-- not exist" unless written `5::smallint`. The column stays a smallint; a priority outside
-- its range is refused with a message that says so. The body is 0007's otherwise.
DROP FUNCTION skiplock.enqueue(text, jsonb, text, smallint, timestamptz, int, text, text, text,
                               bigint[]);

CREATE FUNCTION skiplock.enqueue(
    kind          text,
    args          jsonb       DEFAULT '{}',
    queue         text        DEFAULT 'default',
    priority      int         DEFAULT 0,
    scheduled_at  timestamptz DEFAULT now(),
    max_attempts  int         DEFAULT 25,
    ordering_key  text        DEFAULT NULL,
    unique_key    text        DEFAULT NULL,
    on_conflict   text        DEFAULT 'skip',
    depends_on    bigint[]    DEFAULT '{}'
) RETURNS bigint
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    new_id bigint;
    initial skiplock.job_state := 'queued';
    reason text;
    missing bigint;
BEGIN
    IF priority NOT BETWEEN -32768 AND 32767 THEN
        RAISE EXCEPTION 'priority must be between -32768 and 32767 (lower runs first), not %',
            priority USING ERRCODE = 'numeric_value_out_of_range';
    END IF;
    IF unique_key IS NOT NULL AND on_conflict NOT IN ('skip', 'replace', 'merge') THEN
        RAISE EXCEPTION 'on_conflict must be skip, replace or merge, not %', on_conflict
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF unique_key IS NOT NULL AND cardinality(depends_on) > 0 THEN
        RAISE EXCEPTION 'a job cannot have both a unique_key and dependencies'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF ordering_key IS NOT NULL AND cardinality(depends_on) > 0 THEN
        RAISE EXCEPTION 'a job cannot have both an ordering_key and dependencies'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF cardinality(depends_on) > 0 THEN
        SELECT d INTO missing FROM unnest(depends_on) AS d
        WHERE NOT EXISTS (SELECT 1 FROM skiplock.jobs p WHERE p.id = d) LIMIT 1;
        IF missing IS NOT NULL THEN
            RAISE EXCEPTION 'parent job % does not exist', missing
                USING ERRCODE = 'foreign_key_violation';
        END IF;
        SELECT format('parent job %s ended %s', p.id, p.state) INTO reason
        FROM skiplock.jobs p
        WHERE p.id = ANY (depends_on) AND p.state IN ('dead', 'cancelled') LIMIT 1;
        IF reason IS NOT NULL THEN
            initial := 'cancelled';
        ELSIF EXISTS (SELECT 1 FROM skiplock.jobs p
                      WHERE p.id = ANY (depends_on) AND p.state <> 'succeeded') THEN
            initial := 'waiting';
        END IF;
    END IF;
    PERFORM set_config('skiplock.unique_holder', '', true);
    INSERT INTO skiplock.jobs AS j (kind, args, queue, priority, scheduled_at, max_attempts,
                                    ordering_key, unique_key, unique_policy, state,
                                    finished_at, last_error)
    VALUES (enqueue.kind, enqueue.args, enqueue.queue, enqueue.priority::smallint,
            enqueue.scheduled_at,
            enqueue.max_attempts, enqueue.ordering_key, enqueue.unique_key,
            CASE WHEN enqueue.unique_key IS NOT NULL THEN on_conflict END, initial,
            CASE WHEN initial = 'cancelled' THEN now() END, reason)
    ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND state IN ('waiting', 'queued')
    DO UPDATE SET args = CASE excluded.unique_policy
        WHEN 'replace' THEN excluded.args
        WHEN 'merge' THEN j.args || excluded.args
        ELSE j.args END
    RETURNING j.id INTO new_id;
    IF new_id IS NULL THEN
        -- The insert trigger applied the key's policy to the pending job instead.
        new_id := nullif(current_setting('skiplock.unique_holder', true), '')::bigint;
    END IF;
    IF cardinality(depends_on) > 0 THEN
        INSERT INTO skiplock.job_dependencies (job_id, parent_id)
        SELECT new_id, d FROM unnest(depends_on) AS d ON CONFLICT DO NOTHING;
    END IF;
    RETURN new_id;
END;
$$;
COMMENT ON FUNCTION skiplock.enqueue(text, jsonb, text, int, timestamptz, int, text, text, text, bigint[]) IS
    'Enqueues a job from any language and returns its id (or, for a unique_key already pending, that job''s id). Example: SELECT skiplock.enqueue(''send_email'', ''{"to": "a@example.com"}'', priority => -1);';
