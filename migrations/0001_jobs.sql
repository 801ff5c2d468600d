-- skiplock schema, version 1: the jobs table, its states, the claim-path indexes,
-- the wake-up notification and the SQL enqueue function.
--
-- Who moves a job out of each state:
--   waiting   -> queued     when every parent succeeded (dependencies)
--   queued    -> running    a worker's claim (claim_batch: SKIP LOCKED, new claim_token, attempt + 1)
--   running   -> succeeded  the claim holder's completer
--   running   -> queued     the claim holder's completer (retry with backoff), the reaper
--                           (stale heartbeat) or a graceful shutdown (release, attempt not counted)
--   running   -> dead       the claim holder's completer or the reaper, once attempts are exhausted
--   dead      -> queued     an operator: skiplock.retry_job(id) or `skiplock retry`
--   any unfinished -> cancelled  an operator: skiplock.cancel_job(id) or `skiplock cancel`

CREATE SCHEMA IF NOT EXISTS skiplock;

CREATE TYPE skiplock.job_state AS ENUM (
    'waiting', 'queued', 'running', 'succeeded', 'dead', 'cancelled'
);

CREATE TABLE skiplock.jobs (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue         text               NOT NULL DEFAULT 'default',
    kind          text               NOT NULL,
    args          jsonb              NOT NULL DEFAULT '{}',
    state         skiplock.job_state NOT NULL DEFAULT 'queued',
    priority      smallint           NOT NULL DEFAULT 0,
    scheduled_at  timestamptz        NOT NULL DEFAULT now(),
    attempt       int                NOT NULL DEFAULT 0,
    max_attempts  int                NOT NULL DEFAULT 25,
    claim_token   uuid,
    claimed_by    text,
    claimed_at    timestamptz,
    heartbeat_at  timestamptz,
    ordering_key  text,
    unique_key    text,
    last_error    text,
    errors        jsonb              NOT NULL DEFAULT '[]',
    created_at    timestamptz        NOT NULL DEFAULT now(),
    finished_at   timestamptz,
    CONSTRAINT jobs_kind_not_empty CHECK (kind <> ''),
    CONSTRAINT jobs_queue_not_empty CHECK (queue <> ''),
    CONSTRAINT jobs_max_attempts_positive CHECK (max_attempts >= 1),
    CONSTRAINT jobs_attempt_not_negative CHECK (attempt >= 0),
    CONSTRAINT jobs_running_has_claim CHECK (
        state <> 'running' OR (claim_token IS NOT NULL AND heartbeat_at IS NOT NULL)
    )
);

COMMENT ON TABLE skiplock.jobs IS
    'Every skiplock job, finished ones included until the pruner removes them.';
COMMENT ON COLUMN skiplock.jobs.claim_token IS
    'Fencing token of the current claim: only a write that presents it may heartbeat, complete or fail the job.';
COMMENT ON COLUMN skiplock.jobs.errors IS
    'The most recent failures (at most 20), oldest first: {attempt, at, message}.';

-- The claim path. Partial, so its size follows the runnable backlog, not the history:
-- finished rows (succeeded, dead, cancelled) never enter it and cost the claim nothing.
CREATE INDEX jobs_claim_idx ON skiplock.jobs (priority, scheduled_at, id)
    WHERE state = 'queued';

-- The reaper and the heartbeat look only at running rows.
CREATE INDEX jobs_running_idx ON skiplock.jobs (heartbeat_at)
    WHERE state = 'running';

-- The pruner walks finished rows by age.
CREATE INDEX jobs_finished_idx ON skiplock.jobs (state, finished_at)
    WHERE finished_at IS NOT NULL;

-- Operators filter by queue and kind.
CREATE INDEX jobs_queue_state_idx ON skiplock.jobs (queue, state);

-- Wake idle workers when runnable jobs arrive, whoever inserts them (the Rust API, plain
-- SQL, another language). One notification per statement and queue: a 10,000-row insert
-- sends one message, and Postgres folds identical payloads within a transaction.
CREATE FUNCTION skiplock.notify_jobs_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    q text;
BEGIN
    FOR q IN
        SELECT DISTINCT queue FROM inserted
        WHERE state = 'queued' AND scheduled_at <= now()
    LOOP
        PERFORM pg_notify('skiplock_jobs', q);
    END LOOP;
    RETURN NULL;
END;
$$;

CREATE TRIGGER jobs_notify_inserted
    AFTER INSERT ON skiplock.jobs
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION skiplock.notify_jobs_inserted();

-- Default retry delay, shared by the reaper and documented beside the Rust policy
-- (src/retry.rs): min(2^attempt, 3600) seconds, times a random factor in [0.75, 1.25).
CREATE FUNCTION skiplock.backoff(attempt int) RETURNS interval
LANGUAGE sql VOLATILE AS $$
    SELECT make_interval(secs => least(power(2, least(attempt, 30)), 3600) * (0.75 + random() * 0.5));
$$;

-- Append a failure to a job's error list, keeping the most recent 20.
CREATE FUNCTION skiplock.append_error(errors jsonb, attempt int, message text) RETURNS jsonb
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

-- skiplock.enqueue, retry_job and cancel_job are defined in 0002_semantics.sql, which
-- always applies together with this file.
