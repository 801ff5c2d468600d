-- skiplock: the grants of each role (docs/operating.md, "Least privilege").
--
-- Run by skiplock_migrator, which owns the schema and every object in it, right after
-- every `skiplock migrate` (the same deploy step, same login):
--
--     skiplock migrate && psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f docs/roles.sql
--
-- Idempotent. It needs no superuser: an object's owner grants on it. The roles themselves,
-- the schema and the CREATE on the database are made once by an administrator (the first
-- block of "Least privilege"). tests/roles.rs runs this very file, with the role names
-- replaced, and checks that each role can do its job and nothing more.
--
-- Functions are SECURITY INVOKER: a function runs with the privileges of whoever calls it,
-- so what a role may do is decided by its privileges on the tables below. EXECUTE stays
-- granted to PUBLIC (Postgres's default): calling skiplock.claim without UPDATE on
-- skiplock.jobs fails (42501) as a plain UPDATE would, so revoking EXECUTE would protect
-- nothing and would break every role whenever a release adds a function a trigger calls.
-- The roles get EXECUTE explicitly as well, so that a database whose owner revoked it from
-- PUBLIC (ALTER DEFAULT PRIVILEGES … REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC) works too.
-- The exceptions run as their owner (SECURITY DEFINER): the id of a new job, the delete
-- trigger's cascade, a held job's release asked again when a writer holds it locked
-- (skiplock.internal_release_passed_over: it can only have a key's held jobs let go), and the
-- days of finished jobs (made, locked and dropped as the owner
-- of their tables). The last three are the pruner's: migrations/functions/ revokes them from
-- PUBLIC, and below they go to the roles that prune only.

-- ---- The schema -------------------------------------------------------------------------

REVOKE ALL ON SCHEMA skiplock FROM PUBLIC;
GRANT USAGE ON SCHEMA skiplock
    TO skiplock_worker, skiplock_enqueuer, skiplock_reader, skiplock_operator;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA skiplock
    TO skiplock_worker, skiplock_enqueuer, skiplock_reader, skiplock_operator;
REVOKE EXECUTE ON FUNCTION skiplock.internal_prepare_done_partitions(date, int),
                           skiplock.internal_lock_done_partition(text),
                           skiplock.internal_drop_done_partition(text)
    FROM skiplock_enqueuer, skiplock_reader;

-- Every process checks the schema version when it starts (`skiplock::check_schema`).
GRANT SELECT ON skiplock.schema_migrations
    TO skiplock_worker, skiplock_enqueuer, skiplock_reader, skiplock_operator;
-- A finished job looked up by id (a finished parent, a watch, a retry by hand) is read
-- from the day its id was handed out on (skiplock.internal_finished_job).
GRANT SELECT ON skiplock.job_id_days
    TO skiplock_worker, skiplock_enqueuer, skiplock_reader, skiplock_operator;

-- ---- skiplock_worker: `skiplock work`, a skiplock::Worker, a SQL-protocol worker --------
-- Claims, heartbeats, outcomes, the reaper, the dependency sweep and lanes (UPDATE jobs);
-- the pruner (DELETE jobs; its rollup writes job_history, and deleting a job that had not
-- succeeded marks its dependency edges); cron (upserts its schedules, advances their slots
-- and inserts their jobs with ids it takes from the identity sequence first).
GRANT SELECT, INSERT, UPDATE, DELETE ON skiplock.jobs TO skiplock_worker;
-- The claim, heartbeats, the reaper and the outcomes' row locks work on the live partition
-- by name (a statement naming skiplock.jobs is checked against its privileges alone).
GRANT SELECT, UPDATE ON skiplock.jobs_live TO skiplock_worker;
GRANT USAGE ON SEQUENCE skiplock.jobs_id_seq TO skiplock_worker;
GRANT SELECT, UPDATE (parent_state) ON skiplock.job_dependencies TO skiplock_worker;
GRANT SELECT, UPDATE ON skiplock.waiting_sweep TO skiplock_worker;
GRANT SELECT ON skiplock.queues TO skiplock_worker;
-- A claim of a rate-limited queue keeps the start times of the queue's window and, with a
-- per-key rate limit, of each key's (and makes a window's ring again after its limit was
-- raised); the sweep deletes the windows whose starts are all a period old.
GRANT SELECT, INSERT, UPDATE, DELETE ON skiplock.rate_windows, skiplock.rate_window_starts
    TO skiplock_worker;
-- Ending a job of a queue with key_max_running leaves its key's freed slot for the queue's
-- next claim, which reads and deletes it (the sweep deletes those no claim will read,
-- skipping the rows locked: FOR UPDATE).
GRANT SELECT, INSERT, UPDATE, DELETE ON skiplock.key_slots_freed TO skiplock_worker;
-- A claim of a fair queue (key_claimable) keeps where each key's held jobs start.
GRANT SELECT, INSERT, UPDATE, DELETE ON skiplock.key_held_from TO skiplock_worker;
GRANT SELECT, INSERT, UPDATE ON skiplock.cron_schedules TO skiplock_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON skiplock.job_history TO skiplock_worker;

-- ---- skiplock_enqueuer: skiplock.enqueue, skiplock::enqueue, a plain INSERT -------------
-- INSERT, and what the enqueue path reads and writes as the caller. Every column read is
-- needed (without any one of them, one of the enqueue paths tests/roles.rs takes is
-- refused): skiplock.enqueue_job's
-- INSERT … ON CONFLICT (unique_key) DO UPDATE SET args … RETURNING id, xmax = 0 reads
-- id, state, unique_key, unique_policy, args and xmax and may rewrite args; lane order and
-- a pending unique key look at other jobs' queue, priority, scheduled_at, state and
-- ordering_key (and lock the key's pending job, which needs an UPDATE privilege, and read
-- why it is held back and its concurrency key, to ask a held one's release again); a unique
-- key's replace and merge rewrite the pending job's args (a merge also marks its policy
-- merge, so that its merged payloads are never dropped). depends_on inserts edges and
-- reads the parents' id and state. Nothing else: not kind, attempts, claims, errors,
-- progress or output, and no write but INSERT, args and unique_policy.
GRANT INSERT ON skiplock.jobs TO skiplock_enqueuer;
GRANT SELECT (id, queue, priority, scheduled_at, state, ordering_key, unique_key,
              unique_policy, args, xmax, held_for, concurrency_key),
      UPDATE (args, unique_policy)
    ON skiplock.jobs TO skiplock_enqueuer;
GRANT INSERT ON skiplock.job_dependencies TO skiplock_enqueuer;
-- skiplock.enqueue_job inserts into the live partition itself (its ON CONFLICT needs the
-- partition's unique index); the same columns there.
GRANT INSERT ON skiplock.jobs_live TO skiplock_enqueuer;
GRANT SELECT (id, queue, priority, scheduled_at, state, ordering_key, unique_key,
              unique_policy, args, xmax),
      UPDATE (args, unique_policy)
    ON skiplock.jobs_live TO skiplock_enqueuer;
-- Waiting for the outcome of a job (skiplock::wait_for, skiplock.watch_job) marks it
-- awaited on the live partition and reads how it ended: its attempts, output, last error
-- and time (and, to ask a held job's release again, why it is held and its key); not its
-- errors list, claims or progress.
GRANT SELECT (attempt, output, last_error, finished_at, awaited)
    ON skiplock.jobs TO skiplock_enqueuer;
GRANT SELECT (attempt, awaited, held_for, concurrency_key), UPDATE (awaited)
    ON skiplock.jobs_live TO skiplock_enqueuer;
-- A job with a concurrency key is held for its turn in a queue with key_claimable (fair
-- queueing): its insert reads the queue's key_claimable, and its key's queued and held
-- jobs (their queue, state, held_for, concurrency_key, priority and scheduled_at).
GRANT SELECT (name, key_claimable) ON skiplock.queues TO skiplock_enqueuer;

-- ---- skiplock_reader: the dashboard read-only, `skiplock jobs/show/stats`, SQL reports --
GRANT SELECT ON ALL TABLES IN SCHEMA skiplock TO skiplock_reader;

-- ---- skiplock_operator: the dashboard read-write, `skiplock retry/cancel/queue/prune/cron`
-- Reads everything; retries, cancels and deletes jobs through skiplock's functions (which
-- write state, times and errors, clear a cancelled job's claim and the reason it was
-- held, and fold a unique key's payloads); pauses and resumes queues and sets their limits; prunes (as the pruner); edits cron schedules. Not
-- claimed_by, claimed_at or attempt: an operator cannot claim a job.
GRANT SELECT ON ALL TABLES IN SCHEMA skiplock TO skiplock_operator;
GRANT UPDATE (state, scheduled_at, max_attempts, finished_at, last_error, claim_token,
              heartbeat_at, args, unique_policy, held_for),
      DELETE
    ON skiplock.jobs TO skiplock_operator;
GRANT UPDATE (parent_state) ON skiplock.job_dependencies TO skiplock_operator;
GRANT INSERT, UPDATE ON skiplock.queues TO skiplock_operator;
-- A rate limit changed or removed resets or deletes the windows (a trigger); the rows of
-- their starts go with a window (a foreign key).
GRANT SELECT, UPDATE, DELETE ON skiplock.rate_windows, skiplock.rate_window_starts
    TO skiplock_operator;
-- A cancel frees a key's slot (as a worker's outcome does); a per-key limit removed or the
-- queue's row deleted drops the slots left for it.
GRANT INSERT, DELETE ON skiplock.key_slots_freed TO skiplock_operator;
-- A per-key limit or key_claimable changed, or the queue's row deleted, drops where the
-- keys' held jobs start; letting them go (a cancel's follow-up) moves it.
GRANT INSERT, UPDATE, DELETE ON skiplock.key_held_from TO skiplock_operator;
-- ... and a per-key limit or key_claimable raised or removed lets the held jobs go (in a
-- fair queue, behind what is queued: scheduled_at), from the live partition by name (a
-- statement naming skiplock.jobs_live is checked against its privileges alone).
GRANT UPDATE (state, held_for, scheduled_at) ON skiplock.jobs_live TO skiplock_operator;
-- ... and waits for outcomes as an enqueuer does (skiplock.watch_job marks the job).
GRANT UPDATE (awaited) ON skiplock.jobs_live TO skiplock_operator;
GRANT INSERT, UPDATE, DELETE ON skiplock.cron_schedules TO skiplock_operator;
GRANT INSERT, UPDATE, DELETE ON skiplock.job_history TO skiplock_operator;

-- ---- Objects a later `skiplock migrate` creates ------------------------------------------
-- Until this file runs again: new functions can be called (as above), and new tables and
-- views can be read by the roles that read everything. Writes are granted here only.
ALTER DEFAULT PRIVILEGES IN SCHEMA skiplock
    GRANT EXECUTE ON FUNCTIONS
    TO skiplock_worker, skiplock_enqueuer, skiplock_reader, skiplock_operator;
ALTER DEFAULT PRIVILEGES IN SCHEMA skiplock
    GRANT SELECT ON TABLES TO skiplock_reader, skiplock_operator;
