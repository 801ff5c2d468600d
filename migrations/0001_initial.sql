-- skiplock schema, version 1 (0.1.0): the tables, types and indexes skiplock keeps in the
-- Postgres schema `skiplock`.
--
-- Two kinds of file make the schema:
--   * migrations/NNNN_*.sql (this one and those after it): tables, types, indexes,
--     constraints, and the DROP of a function or view whose signature changes. Applied once
--     each, in order, and recorded in skiplock.schema_migrations. From 0.1.0 on they only
--     move forward: a change is a new file, never an edit of one a database has applied.
--   * migrations/functions/: every function, trigger and view, each defined once with
--     CREATE OR REPLACE. skiplock migrate applies it after the migrations whenever its text
--     differs from the one last applied, so a changed function body is a one-line diff.
-- schema/skiplock.sql is the result as pg_dump prints it; CI checks that they agree.
--
-- Who moves a job out of each state:
--   waiting   -> queued     when every parent succeeded (dependencies), or its ordering lane
--                           reaches it (internal_advance_lanes)
--   queued    -> running    a claim (skiplock.claim, or the worker's internal_claim_batch:
--                           SKIP LOCKED, new claim_token, attempt + 1)
--   running   -> succeeded  the claim holder (skiplock.complete, the worker's completer)
--   running   -> queued     the claim holder (skiplock.fail / retry with backoff), the reaper
--                           (stale heartbeat) or a graceful shutdown (release, attempt not counted)
--   running   -> dead       the claim holder or the reaper, once attempts are exhausted
--   dead      -> queued     an operator: skiplock.retry_job(id) or `skiplock retry`
--   any unfinished -> cancelled  an operator: skiplock.cancel_job(id) or `skiplock cancel`
--
-- Rows written by hand (INSERT/UPDATE), by skiplock.enqueue, by the CLI and by the Rust API
-- go through the same rules, in the database:
--   * a lane has one turn, its one queued or running job (jobs_lane_turn_idx refuses a
--     second, whoever writes it), so the claim takes a lane's queued job like any other
--     and never meets two jobs of one lane;
--   * an insert with an ordering_key behind an unfinished job of its lane waits; an insert
--     with a pending unique_key applies the key's policy; args over the limit are refused;
--   * a requeue (retry after a failure, reap, release, manual retry) of a job whose
--     unique_key another pending job took meanwhile never fails: the requeued job is
--     superseded by the pending one (see skiplock.internal_fold_into_key_holder);
--   * dependants are cancelled only while they still wait, and deleting or pruning a parent
--     that had not succeeded cancels its waiting children instead of releasing them;
--   * dependency rows written by hand make their child wait, as enqueue's depends_on does.

-- The schema skiplock itself is created by skiplock migrate when it is missing.

CREATE TYPE skiplock.job_state AS ENUM (
    'waiting', 'queued', 'running', 'succeeded', 'dead', 'cancelled'
);

-- A job's place in claim order, as internal_settle_dependants collects those it promotes.
CREATE TYPE skiplock.runnable_key AS (queue text, priority smallint, scheduled_at timestamptz);

-- A claim the reaper took back, as skiplock.internal_reap_stale collects them.
CREATE TYPE skiplock.internal_reaped AS (id bigint, state text, claimed_by text, ordering_key text);

-- A job as skiplock.claim hands it to a worker of any language.
CREATE TYPE skiplock.claimed_job AS (
    id           bigint,
    queue        text,
    kind         text,
    args         jsonb,
    attempt      int,
    max_attempts int,
    claim_token  uuid,
    traceparent  text,
    tracestate   text
);

-- =========================================================================================
-- Tables
-- =========================================================================================

-- Every job, finished ones included until the pruner removes them: one logical table that
-- operators read and write by hand, stored in two partitions by state.
--
--   skiplock.jobs_live   waiting, queued, running: what the claim, the reaper, lanes,
--                        dependencies and maintain work on. Small: it holds the backlog,
--                        not the history, so its statistics, indexes and vacuum follow the
--                        work at hand.
--   skiplock.jobs_done   succeeded, dead, cancelled: the history, until retention drops
--                        it a day at a time (below).
--
-- A change of state across the two (a completion, a failure that kills, a cancel, a retry
-- of a dead job) moves the row: Postgres deletes it from one partition and inserts it into
-- the other in the same statement. `SELECT … FROM skiplock.jobs WHERE id = 42` finds a job
-- in any state, and `UPDATE skiplock.jobs SET state = 'queued' WHERE id = 42` on a dead job
-- moves it back; every rule below holds for both partitions. What partitioning changes
-- (docs/architecture.md, "Live and finished jobs"):
--   * a primary key of a partitioned table must contain the partition key, so `id` is the
--     primary key of jobs_live and indexed in each partition of jobs_done, and unique
--     across them because the identity column hands out every id once (an explicit id,
--     OVERRIDING SYSTEM VALUE, is the writer's own to keep unique);
--   * the unique indexes (one running job per lane, one pending job per unique key) and
--     the claim's indexes are on jobs_live, where those rows live;
--   * a statement that waits for a row another transaction moves meanwhile fails with
--     40001 ("tuple to be locked was already moved to another partition"), where a single
--     table would have followed the row; skiplock's own statements retry it, and so should
--     a script that updates rows by hand;
--   * storage settings are set on each partition.
--
-- A claim token exists only while its job runs (jobs_claim_token_only_running). Every
-- transition out of `running` clears it (complete, fail, release, reap, cancel); the
-- constraint makes it a guarantee, so "the row carries my token" alone proves "my claim is
-- live", and the completion, failure, release and heartbeat statements can find their rows
-- by primary key without a `state = 'running'` filter (see src/db/jobs.rs for why that
-- matters).
CREATE TABLE skiplock.jobs (
    id            bigint GENERATED ALWAYS AS IDENTITY,
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
    unique_policy text,
    progress      jsonb,
    output        jsonb,
    -- Per-key concurrency: in a queue with key_max_running (skiplock.queues), at most that
    -- many jobs of one key run at once, across every worker (a tenant, a customer, an API
    -- account). Unlike ordering_key, no order among a key's jobs.
    concurrency_key text,
    -- Why a waiting job is held back although it could run as far as its parents and its
    -- lane go: 'key' (its concurrency_key is at the queue's key_max_running), 'rate' (its
    -- key's rate window is full) or 'fair' (its key has the queue's key_claimable jobs
    -- queued: it waits its turn). Set by the claim or the insert that holds it, cleared by whatever takes
    -- it out of waiting (jobs_held_for_only_waiting fails a writer that does not); NULL for
    -- a job waiting for its parents or its lane.
    held_for      text,
    -- Whether someone waits for this job's outcome (skiplock.watch_job sets it, a waiter's
    -- own write): when such a job finishes, skiplock_finished is notified with its id (the
    -- trigger jobs_notify_finished). NULL for a job nobody waits for, which the trigger's
    -- WHEN passes over without a call.
    awaited       boolean,
    -- The W3C trace context of the span that enqueued the job (skiplock.enqueue's
    -- traceparent and tracestate, the Rust API's EnqueueOptions::trace_context, captured
    -- from the current span under the opentelemetry feature): each attempt's span continues
    -- that trace. Stored as given; a worker that cannot parse it starts a new trace, as W3C
    -- Trace Context asks of a receiver. NULL for a job enqueued outside any trace.
    traceparent   text,
    tracestate    text,
    -- (A column added here before 0.1.0 is released is named in src/db/migrations.rs's
    -- INITIAL_NEWEST_COLUMN, so that a database migrated before it is refused.)
    CONSTRAINT jobs_kind_not_empty CHECK (kind <> ''),
    CONSTRAINT jobs_concurrency_key_not_empty CHECK (concurrency_key <> ''),
    CONSTRAINT jobs_queue_not_empty CHECK (queue <> ''),
    -- Workers are told of runnable jobs by notifications that carry the queue's name, and
    -- Postgres caps their payload at 8,000 bytes.
    CONSTRAINT jobs_queue_name_length CHECK (octet_length(queue) <= 1000),
    CONSTRAINT jobs_max_attempts_positive CHECK (max_attempts >= 1),
    CONSTRAINT jobs_attempt_not_negative CHECK (attempt >= 0),
    CONSTRAINT jobs_running_has_claim CHECK (
        state <> 'running' OR (claim_token IS NOT NULL AND heartbeat_at IS NOT NULL)
    ),
    CONSTRAINT jobs_unique_policy_known CHECK (unique_policy IN ('skip', 'replace', 'merge')),
    CONSTRAINT jobs_claim_token_only_running CHECK (claim_token IS NULL OR state = 'running'),
    CONSTRAINT jobs_held_for_known CHECK (held_for IN ('key', 'rate', 'fair')),
    CONSTRAINT jobs_held_for_only_waiting CHECK (held_for IS NULL OR state = 'waiting'),
    -- A version-00 traceparent is 55 bytes; later versions may append fields. W3C asks a
    -- tracestate of at most 32 members and lets a carrier drop members past 512 bytes.
    CONSTRAINT jobs_traceparent_length CHECK (octet_length(traceparent) <= 512),
    CONSTRAINT jobs_tracestate_length CHECK (octet_length(tracestate) <= 8192)
) PARTITION BY LIST (state);

-- The live partition turns rows over fast: every job leaves dead row versions behind, and
-- the claim index keeps entries for claimed rows until VACUUM removes them, entries each
-- claim then walks past. So autovacuum vacuums and analyzes it after 2 % of it changed
-- instead of the server-wide 20 % / 10 %; ANALYZE also refreshes the statistics that cached
-- plans were made from. Ids of rows inserted into it directly (enqueue_job, whose ON
-- CONFLICT needs the partition's own unique index) come from the identity's sequence.
CREATE TABLE skiplock.jobs_live PARTITION OF skiplock.jobs (PRIMARY KEY (id))
    FOR VALUES IN ('waiting', 'queued', 'running')
    WITH (
        autovacuum_vacuum_scale_factor = 0.02,
        autovacuum_analyze_scale_factor = 0.02
    );

-- The finished jobs, one partition per finished state and UTC day, so that retention drops
-- a day whole instead of deleting its rows one by one (no dead tuples, no vacuum, and a
-- cost that follows the day's jobs, not the history kept):
--
--   skiplock.jobs_done_<state>_<yyyymmdd>  e.g. jobs_done_succeeded_20261127: the jobs
--                                          that finished in that state on that day (UTC);
--                                          made ahead of time, a few days at once, by
--                                          skiplock.internal_prepare_done_partitions
--                                          (every worker's pruner, skiplock prune,
--                                          skiplock.maintain, skiplock migrate);
--   skiplock.jobs_done_default             what no day takes: finished_at NULL (a row
--                                          written by hand), or a day nobody prepared;
--                                          the pruner deletes its rows as they expire.
--
-- Ids stay unique through the identity, as across jobs_live and jobs_done; the index on id
-- finds a finished job in each partition.
CREATE TABLE skiplock.jobs_done PARTITION OF skiplock.jobs
    FOR VALUES IN ('succeeded', 'dead', 'cancelled')
    PARTITION BY RANGE (state, finished_at);

CREATE TABLE skiplock.jobs_done_default PARTITION OF skiplock.jobs_done DEFAULT;

-- Where a finished job's day starts to be looked for: the greatest id the jobs' identity
-- had handed out when skiplock first saw a UTC day (the day's first call of
-- skiplock.internal_prepare_done_partitions: a pruner's pass, skiplock.maintain,
-- skiplock prune or migrate). A job with a greater id was enqueued later, so skiplock
-- finished it that day or after: a lookup by id of a finished job reads those days' tables
-- first, not every day kept (skiplock.internal_finished_job). A row a day; the days before
-- the oldest kept go.
CREATE TABLE skiplock.job_id_days (
    day        date PRIMARY KEY,
    id_reached bigint NOT NULL
);

-- Dependencies: a job waits until every parent succeeded.
--
-- An edge outlives its parent, and says what became of it:
--   * parent row present: the parent's own state decides;
--   * parent row gone, parent_state NULL: the parent succeeded and was pruned (or deleted
--     after it succeeded); the edge is satisfied;
--   * parent row gone, parent_state set: the parent was deleted before it succeeded, while
--     in that state (a tombstone); the edge can never be satisfied, and the child is
--     cancelled whenever it would otherwise wait for it. Without the tombstone, a child
--     retried by hand after its unfinished parent was deleted would be queued and run
--     although its parent never succeeded.
-- Neither column has a foreign key (one to a partitioned table would need the partition
-- key in it): edges are deleted with their child by the jobs' delete trigger
-- (jobs_after_delete), never with their parent, and the insert trigger
-- (job_dependencies_after_insert) checks that both jobs exist and locks them, so that
-- neither can disappear under a new edge.
CREATE TABLE skiplock.job_dependencies (
    job_id       bigint NOT NULL,
    parent_id    bigint NOT NULL,
    parent_state skiplock.job_state,
    PRIMARY KEY (job_id, parent_id),
    CONSTRAINT job_dependencies_not_self CHECK (job_id <> parent_id),
    CONSTRAINT job_dependencies_tombstone_unfinished
        CHECK (parent_state IS DISTINCT FROM 'succeeded')
);

-- Queues: paused queues are never claimed from; running jobs finish. Global limits, held
-- by every claim on every host (skiplock.internal_claim_batch): at most max_running of the
-- queue's jobs running at once, and at most rate_limit claims starting in any window of
-- rate_period; at most key_max_running of the jobs of one concurrency_key running at once,
-- and at most key_rate_limit of them starting in any window of key_rate_period. NULL: no
-- such limit. A row may name a queue that has no jobs yet; its settings apply to
-- the jobs that come. Changed at any time, they hold from the next claim.
CREATE TABLE skiplock.queues (
    name        text PRIMARY KEY,
    paused      boolean NOT NULL DEFAULT false,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    max_running int,
    rate_limit  int,
    rate_period interval,
    key_max_running int,
    key_rate_limit  int,
    key_rate_period interval,
    key_claimable   int,
    CONSTRAINT queues_name_not_empty CHECK (name <> ''),
    CONSTRAINT queues_name_length CHECK (octet_length(name) <= 1000),
    -- Zero would be a pause; `paused` says that.
    CONSTRAINT queues_max_running_at_least_1 CHECK (max_running >= 1),
    CONSTRAINT queues_key_max_running_at_least_1 CHECK (key_max_running >= 1),
    CONSTRAINT queues_key_claimable_at_least_1 CHECK (key_claimable >= 1),
    -- A window keeps its last rate_limit starts (rate_window_starts), as a key's does.
    CONSTRAINT queues_rate_limit_1_to_100000 CHECK (rate_limit BETWEEN 1 AND 100000),
    CONSTRAINT queues_rate_period_positive CHECK (rate_period > interval '0'),
    CONSTRAINT queues_rate_limit_and_period_together
        CHECK ((rate_limit IS NULL) = (rate_period IS NULL)),
    CONSTRAINT queues_key_rate_limit_1_to_100000 CHECK (key_rate_limit BETWEEN 1 AND 100000),
    CONSTRAINT queues_key_rate_period_positive CHECK (key_rate_period > interval '0'),
    CONSTRAINT queues_key_rate_limit_and_period_together
        CHECK ((key_rate_limit IS NULL) = (key_rate_period IS NULL))
);

-- Rate windows, one store for the queue's rate_limit and the keys' key_rate_limit: a row
-- per window (a queue's own: concurrency_key ''; a key's: the key) with a ring of its last
-- `size` starts in rate_window_starts (size: the highest limit the window served), written
-- in claim order: slot next_slot holds the oldest, a slot never written counts as
-- '-infinity', and a claim reads only as many slots as it may take and writes only those
-- it takes, so its cost follows the jobs it claims, not the limit. Kept by the claim under
-- the queue's lock (skiplock.internal_rate_room, internal_rate_take); a limit raised
-- above size makes the ring again, larger, with the starts it held. A window whose newest
-- start is a whole period old counts nothing and is deleted by the sweep (expires_at).
-- While a key's full window holds the key's jobs back, held_until says when it has room
-- again; hold_pending marks, for the claim that filled it, the keys whose queued jobs it
-- is to hold back before it returns.
-- No foreign key to skiplock.queues: a claim writes these rows under the queue's lock, and
-- a key share lock on the queue's row would wait for a DELETE of that row whose trigger
-- waits for the lock; the triggers on skiplock.queues delete them instead (a row deleted
-- or renamed: a renamed row's limits start new windows under its new name).
CREATE TABLE skiplock.rate_windows (
    queue           text NOT NULL,
    concurrency_key text NOT NULL,
    size            int NOT NULL,
    next_slot       int NOT NULL,
    expires_at      timestamptz NOT NULL,
    held_until      timestamptz,
    hold_pending    boolean NOT NULL DEFAULT false,
    PRIMARY KEY (queue, concurrency_key),
    CONSTRAINT rate_windows_slot_in_ring CHECK (next_slot >= 0 AND next_slot < size)
);
CREATE INDEX rate_windows_held_idx ON skiplock.rate_windows (queue, held_until)
    WHERE held_until IS NOT NULL;
CREATE INDEX rate_windows_hold_pending_idx ON skiplock.rate_windows (queue)
    WHERE hold_pending;
CREATE INDEX rate_windows_expires_idx ON skiplock.rate_windows (expires_at);
CREATE TABLE skiplock.rate_window_starts (
    queue           text NOT NULL,
    concurrency_key text NOT NULL,
    slot            int NOT NULL,
    started_at      timestamptz NOT NULL,
    PRIMARY KEY (queue, concurrency_key, slot),
    FOREIGN KEY (queue, concurrency_key) REFERENCES skiplock.rate_windows (queue, concurrency_key)
        ON DELETE CASCADE ON UPDATE CASCADE
);

-- Keys whose held jobs the queue's next claim looks at again (internal_release_freed_keys):
-- in queues with key_max_running, a slot of the key freed (a job of the key ended, or a
-- queued one was cancelled); in queues with key_claimable, a job of the key claimed or
-- cancelled while others of it were held, or a job of the key held by its insert. A row
-- per key and statement. The
-- statements that end jobs only insert here, so they never wait for the queue's lock nor
-- hold it until their caller commits, whatever the caller's isolation; a row is deleted by
-- the claim that reads it.
-- A row left by a hold in a fair queue also says where the jobs it held start in claim
-- order (from_*): the key's walks of held jobs start no later than that (key_held_from).
CREATE TABLE skiplock.key_slots_freed (
    queue             text NOT NULL,
    concurrency_key   text NOT NULL,
    from_priority     smallint,
    from_scheduled_at timestamptz,
    from_id           bigint,
    CONSTRAINT key_slots_freed_from_whole CHECK (
        (from_priority IS NULL) = (from_scheduled_at IS NULL)
        AND (from_priority IS NULL) = (from_id IS NULL))
);
CREATE INDEX key_slots_freed_queue_idx ON skiplock.key_slots_freed (queue);

-- Fair queueing (key_claimable, with no other per-key limit): where a key's held jobs start
-- in claim order, at the earliest, so that a walk of them (the release of a key's next
-- jobs, a claim's take of held jobs) starts there instead of at the front of the key's
-- range in jobs_held_idx, over the dead entries of every held job taken since the last
-- vacuum (a key's drain was quadratic in its backlog). Every held job of a key is at or
-- after its row, or after the from_* of a row of key_slots_freed left by the hold; a key
-- without a row is walked from the front. A release moves the row to the first job still
-- held after its walk, without waiting for the row (a row locked or changed meanwhile is
-- left as it is, and the position left in key_slots_freed instead), and deletes it when
-- none is; holds never write it. Updated in place (HOT: no index column changes), so its
-- index does not fill with dead entries; rows of a queue go when its limits change.
-- No foreign key to skiplock.queues, as rate_windows (see there).
CREATE TABLE skiplock.key_held_from (
    queue           text NOT NULL,
    concurrency_key text NOT NULL,
    priority        smallint NOT NULL,
    scheduled_at    timestamptz NOT NULL,
    id              bigint NOT NULL,
    PRIMARY KEY (queue, concurrency_key)
) WITH (fillfactor = 50);

-- Cron schedules: each slot produces exactly one job, whoever computes it first.
CREATE TABLE skiplock.cron_schedules (
    name         text PRIMARY KEY,
    expression   text        NOT NULL,
    timezone     text        NOT NULL DEFAULT 'UTC',
    kind         text        NOT NULL,
    args         jsonb       NOT NULL DEFAULT '{}',
    queue        text        NOT NULL DEFAULT 'default',
    priority     smallint    NOT NULL DEFAULT 0,
    max_attempts int         NOT NULL DEFAULT 25,
    missed       text        NOT NULL DEFAULT 'latest',
    enabled      boolean     NOT NULL DEFAULT true,
    -- Slots up to and including this instant are done (enqueued or deliberately skipped).
    last_slot_at timestamptz NOT NULL DEFAULT now(),
    last_job_id  bigint,
    last_error   text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT cron_schedules_missed_known CHECK (missed IN ('latest', 'skip')),
    CONSTRAINT cron_schedules_kind_not_empty CHECK (kind <> ''),
    -- What skiplock.jobs would refuse for each slot's job, refused as the schedule is written:
    -- otherwise every slot fails at fire time into last_error and no job is made.
    CONSTRAINT cron_schedules_queue_not_empty CHECK (queue <> ''),
    CONSTRAINT cron_schedules_queue_name_length CHECK (octet_length(queue) <= 1000),
    CONSTRAINT cron_schedules_max_attempts_positive CHECK (max_attempts >= 1)
);

-- Where the periodic sweep of waiting jobs (skiplock.internal_settle_waiting, run by every
-- worker and by skiplock.maintain) goes on: each pass checks the next batch of waiting
-- jobs after after_id, in id order, and starts from the first again after the last. One
-- row; a pass that finds it locked by another leaves the sweep to that one.
CREATE TABLE skiplock.waiting_sweep (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    after_id  bigint  NOT NULL DEFAULT 0
);
INSERT INTO skiplock.waiting_sweep DEFAULT VALUES;

-- Job history that survives pruning.
--
-- Finished jobs are deleted by the pruner, so their numbers move into this small rollup
-- table in the very statement that deletes them (see src/db/history.rs:
-- jobs_prune_finished_rolled_up). The completion path is untouched: a finished job is
-- counted live in skiplock.jobs until it is pruned, and in the rollup afterwards, never in
-- both and never in neither. History queries (src/db/history.rs) add the two up, counting
-- live rows with the same SQL that rolls them up.
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

-- The text of migrations/functions/ last applied (one row): skiplock migrate applies the
-- file again only when its md5 differs, and never for a build older than the one that
-- applied it.
CREATE TABLE skiplock.schema_functions (
    singleton        boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    md5              text        NOT NULL,
    skiplock_version text        NOT NULL,
    applied_at       timestamptz NOT NULL DEFAULT now()
);

-- =========================================================================================
-- Indexes
-- =========================================================================================

-- The claim path: one range per queue, in claim order, so a claim of a quiet queue never
-- steps over a flooded one's backlog. Partial, so its size follows the runnable backlog,
-- not the history: finished rows (succeeded, dead, cancelled) never enter it and cost the
-- claim nothing.
CREATE INDEX jobs_claim_idx ON skiplock.jobs_live (queue, priority, scheduled_at, id)
    WHERE state = 'queued';

-- The reaper and the heartbeat look only at running rows; a claim of a queue with
-- max_running counts the queue's running jobs through it. An index of the running jobs by
-- queue would make that count follow the queue's running jobs alone, but it cost every
-- claim of every queue an index entry: the drain 12 % slower without any limit set
-- (docs/benchmarks.md, "Global limits").
CREATE INDEX jobs_running_idx ON skiplock.jobs_live (heartbeat_at)
    WHERE state = 'running';

-- Finished jobs by id (`skiplock show`, a retry by hand), and by age (the last hour of
-- skiplock.stats, the history's live half, the pruner's deletes of expiring rows).
CREATE INDEX jobs_done_id_idx ON skiplock.jobs_done (id);
CREATE INDEX jobs_finished_idx ON skiplock.jobs_done (state, finished_at);

-- Dependencies: the waiting jobs, and the children of a parent.
CREATE INDEX jobs_waiting_idx ON skiplock.jobs_live (id) WHERE state = 'waiting';

CREATE INDEX job_dependencies_parent_idx ON skiplock.job_dependencies (parent_id);

-- Ordering lanes: a lane's turn. At most one job of a lane is `queued` or `running` (the
-- job whose turn it is); the jobs behind it wait in `waiting`, and
-- skiplock.internal_advance_lanes gives the turn to the lane's lowest id when it ends. So
-- a queued lane job may run as soon as it is due: the claim takes it like any other job,
-- never looks at the lane, and never meets a second job of it. The database refuses a
-- second turn whoever writes it (a hand UPDATE that queues a job behind its lane's turn
-- fails here: leave it waiting, its turn comes).
CREATE UNIQUE INDEX jobs_lane_turn_idx ON skiplock.jobs_live (ordering_key)
    WHERE ordering_key IS NOT NULL AND state IN ('queued', 'running');

CREATE INDEX jobs_ordering_key_lane_idx ON skiplock.jobs_live (ordering_key, id)
    WHERE ordering_key IS NOT NULL AND state IN ('waiting', 'queued', 'running');

-- Per-key concurrency (skiplock.queues.key_max_running): a key's running jobs counted and
-- its queued jobs held back when it is full, each a range of this index (its held jobs
-- are let go from jobs_held_idx). Partial: only jobs with a concurrency_key pay for it,
-- and not while they wait.
CREATE INDEX jobs_concurrency_key_idx
    ON skiplock.jobs_live (queue, state, concurrency_key, priority, scheduled_at, id)
    WHERE concurrency_key IS NOT NULL AND state IN ('queued', 'running');

-- Jobs held back for their keys (held_for): a key's held jobs are let go in claim order
-- from a range of this index when the key has room, so that a release never walks the
-- key's jobs waiting for their parents or their lane (20,000 children of one parent made
-- every claim of their queue 240 ms). Partial: only held jobs pay for it.
CREATE INDEX jobs_held_idx ON skiplock.jobs_live (queue, concurrency_key, priority, scheduled_at, id)
    WHERE state = 'waiting' AND held_for IS NOT NULL;

-- Unique keys: at most one pending (not yet running) job per key.
CREATE UNIQUE INDEX jobs_unique_key_pending_idx ON skiplock.jobs_live (unique_key)
    WHERE unique_key IS NOT NULL AND state IN ('waiting', 'queued');

-- =========================================================================================
-- Comments stored with the objects
-- =========================================================================================
COMMENT ON TABLE skiplock.jobs IS
    'Every skiplock job, finished ones included until the pruner removes them. Partitioned by state: jobs_live (waiting, queued, running) and jobs_done (succeeded, dead, cancelled).';

COMMENT ON COLUMN skiplock.jobs.claim_token IS
    'Fencing token of the current claim: only a write that presents it may heartbeat, complete or fail the job.';

COMMENT ON COLUMN skiplock.jobs.errors IS
    'The most recent failures (at most 20), oldest first: {attempt, at, message}.';

COMMENT ON COLUMN skiplock.jobs.unique_policy IS
    'What a second enqueue with the same unique_key does while this job is pending: skip, replace (new args) or merge (append args).';

COMMENT ON COLUMN skiplock.jobs.progress IS 'Latest progress reported by the handler (any JSON).';

COMMENT ON COLUMN skiplock.jobs.output IS 'Output recorded by the handler (any JSON).';

COMMENT ON COLUMN skiplock.jobs.held_for IS
    'Why a waiting job is held back although its parents and its lane let it run: key (its concurrency_key is at key_max_running), rate (its key''s rate window is full) or fair (its key has key_claimable jobs queued; it waits its turn). NULL for a job waiting for its parents or its lane, and for every job not waiting: an UPDATE that takes a held job out of waiting sets it NULL too.';

COMMENT ON COLUMN skiplock.jobs.awaited IS
    'true once someone waits for the job''s outcome (skiplock.watch_job, skiplock::wait_for): when it finishes (succeeded, dead or cancelled) its id is notified on skiplock_finished. NULL otherwise.';

COMMENT ON COLUMN skiplock.jobs.traceparent IS
    'W3C traceparent of the span that enqueued the job (skiplock.enqueue''s traceparent, the Rust API''s trace context): each attempt''s span continues that trace. At most 512 bytes; a value no worker can parse starts a new trace. NULL: no trace.';

COMMENT ON COLUMN skiplock.jobs.tracestate IS
    'W3C tracestate that goes with traceparent (vendors'' entries), at most 8,192 bytes. NULL: none.';

COMMENT ON TABLE skiplock.job_dependencies IS
    'Edges of the dependency graph: job_id runs only after parent_id succeeded. An edge whose '
    'parent row is gone is satisfied when parent_state is NULL (the parent succeeded and was '
    'pruned) and never satisfied when parent_state is set (the parent was deleted in that '
    'state before it succeeded).';

COMMENT ON COLUMN skiplock.job_dependencies.parent_state IS
    'NULL while the parent exists or after it was deleted as succeeded; the parent''s state '
    'when it was deleted before it succeeded (written by skiplock, never by hand).';

COMMENT ON COLUMN skiplock.cron_schedules.missed IS
    'Slots missed while no worker ran: latest = run the most recent missed slot once; skip = run none of them.';

COMMENT ON TABLE skiplock.job_history IS
    'Hourly (UTC) numbers of pruned jobs per queue and kind; bucket -infinity holds everything older than the retention. Live (not yet pruned) jobs are not in it.';

COMMENT ON COLUMN skiplock.job_history.failed IS
    'Failed attempts (entries of the jobs'' errors lists), in the hour each failure happened.';

COMMENT ON CONSTRAINT jobs_queue_name_length ON skiplock.jobs IS
    'A queue name is at most 1,000 bytes: workers are told of runnable jobs by notifications that carry it, and Postgres caps their payload at 8,000 bytes.';

COMMENT ON COLUMN skiplock.job_history.run_histogram IS
    'Run times counted per interval of skiplock.internal_job_history_run_bounds() (16 bounds, 17 elements): element 1 counts run times under bounds[1], element i+1 those from bounds[i] up to bounds[i+1], element 17 those from bounds[16] on.';

-- Every table and column says what it holds (\d+ in psql): docs/architecture.md's tables
-- are generated from these comments by tests/sql_reference.rs, which fails on one without.

COMMENT ON TABLE skiplock.queues IS
    'A queue''s settings: paused, and its global and per-key limits, held by every claim on every host. A queue needs no row until one of them is set; changed at any time, they hold from the next claim.';

COMMENT ON TABLE skiplock.rate_windows IS
    'Internal (rate_limit, key_rate_limit): a rate window, the queue''s own or a concurrency key''s: its ring of last starts, its size and where it is written next, and whether it holds the key''s jobs back.';

COMMENT ON TABLE skiplock.rate_window_starts IS
    'Internal (rate_limit, key_rate_limit): a window''s ring slots, each the start time of one claimed job; a slot never written counts as -infinity.';

COMMENT ON TABLE skiplock.key_slots_freed IS
    'Internal (key_max_running, key_claimable): a row per key and statement that freed a slot of the key or changed what of it is queued, for the queue''s next claim to let the key''s held jobs go; deleted by that claim.';

COMMENT ON TABLE skiplock.key_held_from IS
    'Internal (key_claimable): where a key''s held jobs start in claim order, at the earliest, for the walks that let them go.';

COMMENT ON TABLE skiplock.job_id_days IS
    'Internal (finished jobs by day): the greatest job id handed out when skiplock first saw each UTC day, from which a lookup of a finished job by id reads the days.';

COMMENT ON TABLE skiplock.cron_schedules IS
    'Named cron schedules: each slot of a schedule enqueues exactly one job, whoever fires it first.';

COMMENT ON TABLE skiplock.waiting_sweep IS
    'Internal: where the periodic sweep of waiting jobs (internal_settle_waiting) goes on.';

COMMENT ON TABLE skiplock.schema_functions IS
    'Internal: the text of migrations/functions/ last applied, so that migrate applies it again only when it changed.';

COMMENT ON TABLE skiplock.schema_migrations IS
    'The migrations applied (migrations/NNNN_*.sql), a row each; skiplock never uses sqlx''s _sqlx_migrations.';

COMMENT ON COLUMN skiplock.jobs.id IS
    'The job''s id, from an identity shared by every partition: unique across live and finished jobs.';

COMMENT ON COLUMN skiplock.jobs.queue IS
    'The queue it waits in; workers claim only the queues they serve. Not empty, at most 1,000 bytes.';

COMMENT ON COLUMN skiplock.jobs.kind IS
    'The handler that runs it (a job type''s KIND, a built-in kind such as http or command). Not empty.';

COMMENT ON COLUMN skiplock.jobs.args IS
    'The handler''s input (any JSON), at most skiplock.args_max_bytes (1 MiB by default) as text.';

COMMENT ON COLUMN skiplock.jobs.state IS
    'waiting (for its parents, its lane, or held_for), queued (may run from scheduled_at), running (claimed), succeeded, dead (attempts exhausted or failed permanently), cancelled. Decides the partition.';

COMMENT ON COLUMN skiplock.jobs.priority IS
    'Lower runs first (-32768 to 32767); with scheduled_at and id, the claim order.';

COMMENT ON COLUMN skiplock.jobs.scheduled_at IS
    'When the job may run first; a retry or a snooze moves it forward. -infinity runs before anything due.';

COMMENT ON COLUMN skiplock.jobs.attempt IS
    'Attempts started so far; each claim counts one, a release or a snooze gives it back.';

COMMENT ON COLUMN skiplock.jobs.max_attempts IS
    'Attempts before a failing job goes dead (at least 1).';

COMMENT ON COLUMN skiplock.jobs.claimed_by IS
    'The worker that holds or last held the claim (its name: host, pid).';

COMMENT ON COLUMN skiplock.jobs.claimed_at IS
    'When the current or last claim was made.';

COMMENT ON COLUMN skiplock.jobs.heartbeat_at IS
    'The claim''s last heartbeat (database clock); a running job whose heartbeat is older than stale_after is reaped.';

COMMENT ON COLUMN skiplock.jobs.ordering_key IS
    'The job''s lane: the jobs of one key run one at a time, in enqueue (id) order.';

COMMENT ON COLUMN skiplock.jobs.unique_key IS
    'At most one pending (waiting or queued) job per key; unique_policy says what a second enqueue does.';

COMMENT ON COLUMN skiplock.jobs.last_error IS
    'The last failure''s message (or why the job was cancelled or is dead).';

COMMENT ON COLUMN skiplock.jobs.created_at IS
    'When the job was enqueued.';

COMMENT ON COLUMN skiplock.jobs.finished_at IS
    'When the job reached succeeded, dead or cancelled; with state, decides its day partition.';

COMMENT ON COLUMN skiplock.jobs.concurrency_key IS
    'A tenant or an account: in a queue with key_max_running or key_rate_limit, the limit holds per key. Not empty.';

COMMENT ON COLUMN skiplock.job_dependencies.job_id IS
    'The child: it waits until every parent succeeded.';

COMMENT ON COLUMN skiplock.job_dependencies.parent_id IS
    'A parent of job_id.';

COMMENT ON COLUMN skiplock.queues.name IS
    'The queue''s name, as jobs.queue names it; a row may come before any job of the queue.';

COMMENT ON COLUMN skiplock.queues.paused IS
    'true: no claim takes the queue''s jobs; running ones finish.';

COMMENT ON COLUMN skiplock.queues.updated_at IS
    'When the row was last changed.';

COMMENT ON COLUMN skiplock.queues.max_running IS
    'At most this many of the queue''s jobs running at once, across every worker. NULL: no limit.';

COMMENT ON COLUMN skiplock.queues.rate_limit IS
    'At most this many of the queue''s jobs started in any window of rate_period (1 to 100,000). NULL: no limit.';

COMMENT ON COLUMN skiplock.queues.rate_period IS
    'The window of rate_limit.';

COMMENT ON COLUMN skiplock.queues.key_max_running IS
    'At most this many jobs of one concurrency_key running at once. NULL: no limit.';

COMMENT ON COLUMN skiplock.queues.key_rate_limit IS
    'At most this many jobs of one concurrency_key started in any window of key_rate_period (1 to 100,000). NULL: no limit.';

COMMENT ON COLUMN skiplock.queues.key_rate_period IS
    'The window of key_rate_limit.';

COMMENT ON COLUMN skiplock.queues.key_claimable IS
    'Fair queueing by concurrency_key: at most this many due jobs of one key queued at once at each priority; the key''s others wait (held_for fair) and each is let go, behind what is queued then, when one of the key''s is claimed, so keys take turns. NULL: jobs are taken in claim order whatever their key.';

COMMENT ON COLUMN skiplock.rate_windows.queue IS
    'The queue with rate_limit or key_rate_limit.';

COMMENT ON COLUMN skiplock.rate_windows.concurrency_key IS
    'The key whose window this is; empty for the queue''s own (rate_limit).';

COMMENT ON COLUMN skiplock.rate_windows.size IS
    'Slots in the ring: the highest limit it served.';

COMMENT ON COLUMN skiplock.rate_windows.next_slot IS
    'The slot that holds the oldest start, written next.';

COMMENT ON COLUMN skiplock.rate_windows.expires_at IS
    'When the newest start is a whole period old: the window counts nothing from then on and the sweep deletes it.';

COMMENT ON COLUMN skiplock.rate_windows.held_until IS
    'While a key''s full window holds the key''s jobs back, when it has room again.';

COMMENT ON COLUMN skiplock.rate_windows.hold_pending IS
    'Set by the claim that filled a key''s window, for it to hold back the key''s queued jobs before it returns.';

COMMENT ON COLUMN skiplock.rate_window_starts.queue IS
    'The window''s queue.';

COMMENT ON COLUMN skiplock.rate_window_starts.concurrency_key IS
    'The window''s key; empty for the queue''s own.';

COMMENT ON COLUMN skiplock.rate_window_starts.slot IS
    'The slot, 0 to size - 1.';

COMMENT ON COLUMN skiplock.rate_window_starts.started_at IS
    'When the job that took the slot was claimed.';

COMMENT ON COLUMN skiplock.key_slots_freed.queue IS
    'The queue with key_max_running or key_claimable.';

COMMENT ON COLUMN skiplock.key_slots_freed.concurrency_key IS
    'The key one of whose jobs ended, was claimed, was cancelled while queued, or was held by its insert.';

COMMENT ON COLUMN skiplock.key_slots_freed.from_priority IS
    'Left by a hold in a fair queue: the priority of the first job it held (with from_scheduled_at and from_id, its claim key); NULL otherwise.';

COMMENT ON COLUMN skiplock.key_slots_freed.from_scheduled_at IS
    'The scheduled_at of the first job the hold held; NULL otherwise.';

COMMENT ON COLUMN skiplock.key_slots_freed.from_id IS
    'The id of the first job the hold held; NULL otherwise.';

COMMENT ON COLUMN skiplock.key_held_from.queue IS
    'The queue with key_claimable.';

COMMENT ON COLUMN skiplock.key_held_from.concurrency_key IS
    'The key.';

COMMENT ON COLUMN skiplock.key_held_from.priority IS
    'With scheduled_at and id: a claim key no held job of the key sorts before, unless a row of key_slots_freed says where.';

COMMENT ON COLUMN skiplock.key_held_from.scheduled_at IS
    'See priority.';

COMMENT ON COLUMN skiplock.key_held_from.id IS
    'See priority.';

COMMENT ON COLUMN skiplock.job_id_days.day IS
    'A UTC day.';

COMMENT ON COLUMN skiplock.job_id_days.id_reached IS
    'The greatest job id handed out when skiplock first saw the day (0: none yet): a job with a greater id finished that day or after, unless its finished_at was written by hand.';

COMMENT ON COLUMN skiplock.cron_schedules.name IS
    'The schedule''s name.';

COMMENT ON COLUMN skiplock.cron_schedules.expression IS
    'Cron expression: five fields (minute hour day-of-month month day-of-week), or six with seconds first (the syntax: src/cron.rs).';

COMMENT ON COLUMN skiplock.cron_schedules.timezone IS
    'IANA time zone the expression is read in.';

COMMENT ON COLUMN skiplock.cron_schedules.kind IS
    'The kind of each slot''s job.';

COMMENT ON COLUMN skiplock.cron_schedules.args IS
    'The args of each slot''s job.';

COMMENT ON COLUMN skiplock.cron_schedules.queue IS
    'The queue of each slot''s job.';

COMMENT ON COLUMN skiplock.cron_schedules.priority IS
    'The priority of each slot''s job.';

COMMENT ON COLUMN skiplock.cron_schedules.max_attempts IS
    'The attempt budget of each slot''s job.';

COMMENT ON COLUMN skiplock.cron_schedules.enabled IS
    'false: the schedule enqueues nothing.';

COMMENT ON COLUMN skiplock.cron_schedules.last_slot_at IS
    'Slots up to and including this instant are done (enqueued or deliberately skipped).';

COMMENT ON COLUMN skiplock.cron_schedules.last_job_id IS
    'The job the last slot enqueued.';

COMMENT ON COLUMN skiplock.cron_schedules.last_error IS
    'Why the last slot could not enqueue its job, until one does.';

COMMENT ON COLUMN skiplock.cron_schedules.created_at IS
    'When the schedule was made.';

COMMENT ON COLUMN skiplock.cron_schedules.updated_at IS
    'When the schedule was last changed.';

COMMENT ON COLUMN skiplock.waiting_sweep.singleton IS
    'Always true: one row.';

COMMENT ON COLUMN skiplock.waiting_sweep.after_id IS
    'The sweep of waiting jobs goes on after this id, and from the first again after the last.';

COMMENT ON COLUMN skiplock.job_history.bucket IS
    'The hour (UTC) the numbers are for; -infinity folds everything older than the retention.';

COMMENT ON COLUMN skiplock.job_history.queue IS
    'The jobs'' queue.';

COMMENT ON COLUMN skiplock.job_history.kind IS
    'The jobs'' kind.';

COMMENT ON COLUMN skiplock.job_history.succeeded IS
    'Jobs that succeeded in the hour (by finished_at).';

COMMENT ON COLUMN skiplock.job_history.dead IS
    'Jobs that went dead in the hour.';

COMMENT ON COLUMN skiplock.job_history.cancelled IS
    'Jobs cancelled in the hour.';

COMMENT ON COLUMN skiplock.job_history.run_count IS
    'Succeeded and dead jobs whose run time (finished_at - claimed_at, the last attempt) is counted.';

COMMENT ON COLUMN skiplock.job_history.run_seconds IS
    'Their run times summed, in seconds.';

COMMENT ON COLUMN skiplock.job_history.wait_count IS
    'Succeeded and dead jobs whose wait (claimed_at - scheduled_at: due until claimed) is counted.';

COMMENT ON COLUMN skiplock.job_history.wait_seconds IS
    'Their waits summed, in seconds.';

COMMENT ON COLUMN skiplock.schema_functions.singleton IS
    'Always true: one row.';

COMMENT ON COLUMN skiplock.schema_functions.md5 IS
    'md5 of the text of migrations/functions/ last applied.';

COMMENT ON COLUMN skiplock.schema_functions.skiplock_version IS
    'The skiplock version that applied it; an older build leaves it alone.';

COMMENT ON COLUMN skiplock.schema_functions.applied_at IS
    'When it was applied.';

COMMENT ON COLUMN skiplock.schema_migrations.version IS
    'The migration''s number (migrations/NNNN_*.sql).';

COMMENT ON COLUMN skiplock.schema_migrations.name IS
    'Its file name.';

COMMENT ON COLUMN skiplock.schema_migrations.applied_at IS
    'When it was applied.';
