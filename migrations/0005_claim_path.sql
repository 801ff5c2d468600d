-- skiplock schema, version 5: the invariant the claim-holder statements rely on, and a
-- lighter index set for the hot path.
--
-- A claim token exists only while its job runs. Every transition out of `running`
-- already clears it (complete, fail, release, reap, cancel); the constraint makes it a
-- guarantee, so "the row carries my token" alone proves "my claim is live", and the
-- completion, failure, release and heartbeat statements can find their rows by primary
-- key without a `state = 'running'` filter (see src/db/jobs.rs for why that matters).
ALTER TABLE skiplock.jobs
    ADD CONSTRAINT jobs_claim_token_only_running CHECK (claim_token IS NULL OR state = 'running');
