-- skiplock schema, version 9: a worker's completions are one update, in claim-list order.
--
-- The worker marked a batch of its jobs `succeeded` in two steps: it locked each row by a
-- primary-key lookup per claim (a LATERAL join driven by the claim list, sorted by id),
-- then updated the locked ids. The lateral lock fixed the order in which rows are locked,
-- so that two statements finishing overlapping claims (a completion retried after its
-- reply was lost, while the first is still running on the server) queue behind each
-- other instead of deadlocking; but each row was looked up twice and locked before its
-- update, which writes a WAL record of its own (57 bytes per job).
--
-- complete_claims does it in one update joined to the claim list. An update locks the
-- rows it changes as its scan reaches them, so the order is the join's: the planner
-- settings below leave it no plan but a nested loop driven by the list (a hash or merge
-- join, or a scan of the table, would lock in the table's physical order). Like every
-- statement that finishes a claim, it matches the id and the claim token, and re-checks
-- the token on the newest row version after any wait (READ COMMITTED), so a claim lost
-- meanwhile drops out; it returns the jobs whose claim was still valid. Its plan is made
-- at each call, with the table's size as it is then.

CREATE FUNCTION skiplock.complete_claims(ids bigint[], tokens uuid[])
RETURNS TABLE (id bigint, state text, has_dependants boolean, ordering_key text)
LANGUAGE sql
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
    UPDATE skiplock.jobs j
    SET state = 'succeeded', finished_at = now(), claim_token = NULL, heartbeat_at = NULL
    FROM unnest(ids, tokens) AS c(id, token)
    WHERE j.id = c.id AND j.claim_token = c.token
    RETURNING j.id, j.state::text,
              EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = j.id),
              j.ordering_key;
$$;

COMMENT ON FUNCTION skiplock.complete_claims(bigint[], uuid[]) IS
    'Marks the given running jobs succeeded, each only if it still holds the given claim token, locking them in the order given (a worker sorts them by id); returns those it changed, with what the worker does next for each (its dependants, its lane). What a worker calls.';
