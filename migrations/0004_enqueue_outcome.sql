-- skiplock schema, version 4: an enqueue says what it did.
--
-- skiplock.enqueue returned the job's id whether it inserted a job or a unique key folded
-- the new one into the pending job of that key (skip, replace or merge): a caller could
-- not tell a new job from a duplicate. skiplock.enqueue_job takes the same arguments and
-- returns the id with the outcome: 'inserted', 'skipped', 'replaced' or 'merged'
-- (SELECT * FROM skiplock.enqueue_job('send_email', '{"to": "a@example.com"}',
-- unique_key => 'welcome-42')). skiplock.enqueue keeps returning the id alone, so every
-- caller of it goes on working; it calls enqueue_job.

CREATE FUNCTION skiplock.enqueue_job(
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
) RETURNS TABLE (id bigint, outcome text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    new_id bigint;
    inserted boolean;
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
    VALUES (enqueue_job.kind, enqueue_job.args, enqueue_job.queue, enqueue_job.priority::smallint,
            enqueue_job.scheduled_at,
            enqueue_job.max_attempts, enqueue_job.ordering_key, enqueue_job.unique_key,
            CASE WHEN enqueue_job.unique_key IS NOT NULL THEN on_conflict END, initial,
            CASE WHEN initial = 'cancelled' THEN now() END, reason)
    ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND state IN ('waiting', 'queued')
    DO UPDATE SET args = CASE excluded.unique_policy
        WHEN 'replace' THEN excluded.args
        WHEN 'merge' THEN j.args || excluded.args
        ELSE j.args END
    RETURNING j.id, j.xmax = 0 INTO new_id, inserted;
    IF new_id IS NULL THEN
        -- The insert trigger applied the key's policy to the pending job instead.
        new_id := nullif(current_setting('skiplock.unique_holder', true), '')::bigint;
    END IF;
    IF cardinality(depends_on) > 0 THEN
        INSERT INTO skiplock.job_dependencies (job_id, parent_id)
        SELECT new_id, d FROM unnest(depends_on) AS d ON CONFLICT DO NOTHING;
    END IF;
    id := new_id;
    -- A new row, or the pending job of the key, folded by the key's policy (through ON
    -- CONFLICT, or by the insert trigger, which leaves no row to return).
    outcome := CASE WHEN inserted THEN 'inserted'
                    WHEN on_conflict = 'replace' THEN 'replaced'
                    WHEN on_conflict = 'merge' THEN 'merged'
                    ELSE 'skipped' END;
    RETURN NEXT;
END;
$$;


CREATE OR REPLACE FUNCTION skiplock.enqueue(
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
LANGUAGE sql AS $$
    SELECT e.id FROM skiplock.enqueue_job(kind, args, queue, priority, scheduled_at,
                                          max_attempts, ordering_key, unique_key,
                                          on_conflict, depends_on) e;
$$;

COMMENT ON FUNCTION skiplock.enqueue_job(text, jsonb, text, int, timestamptz, int, text, text, text, bigint[]) IS
    'As skiplock.enqueue, and says what it did: the job''s id with inserted, or, for a unique_key already pending, that job''s id with skipped, replaced or merged. Example: SELECT * FROM skiplock.enqueue_job(''send_email'', ''{"to": "a@example.com"}'', unique_key => ''welcome-42'');';
