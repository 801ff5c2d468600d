//! Statements that insert jobs (the Rust API's `enqueue` family).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgExecutor;
use sqlx::types::Json;

use crate::state::JobId;

/// Column-wise batch of jobs for [`jobs_insert_many`]; index `i` of every vector is job `i`.
#[derive(Debug, Default)]
pub struct InsertBatch {
    /// Kinds.
    pub kinds: Vec<String>,
    /// Payloads.
    pub args: Vec<Json<Value>>,
    /// Queues.
    pub queues: Vec<String>,
    /// Priorities.
    pub priorities: Vec<i16>,
    /// Absolute run times; `None` means "now plus `delays_ms`" by the database clock.
    pub run_at: Vec<Option<DateTime<Utc>>>,
    /// Delays in milliseconds from the database's `now()`, used when `run_at` is `None`.
    pub delays_ms: Vec<i64>,
    /// Attempt budgets.
    pub max_attempts: Vec<i32>,
    /// Ordering lanes.
    pub ordering_keys: Vec<Option<String>>,
    /// Concurrency keys.
    pub concurrency_keys: Vec<Option<String>>,
    /// Unique keys.
    pub unique_keys: Vec<Option<String>>,
    /// Conflict policy per job (`skip`, `replace`, `merge`), used with a unique key.
    pub unique_policies: Vec<&'static str>,
    /// Parent job ids per job, as a JSON array.
    pub depends_on: Vec<Json<Vec<i64>>>,
    /// W3C `traceparent` per job.
    pub traceparents: Vec<Option<String>>,
    /// W3C `tracestate` per job.
    pub tracestates: Vec<Option<String>>,
}

impl InsertBatch {
    /// Number of jobs in the batch.
    #[cfg(feature = "internals")]
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// Whether the batch holds no job.
    #[cfg(feature = "internals")]
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// Whether any job needs the per-job path (unique keys or dependencies).
    pub fn needs_per_job_path(&self) -> bool {
        self.unique_keys.iter().any(Option::is_some)
            || self.ordering_keys.iter().any(Option::is_some)
            || self.depends_on.iter().any(|parents| !parents.0.is_empty())
    }
}

#[cfg(feature = "internals")]
/// Inserts a batch and returns the ids in input order.
///
/// Plain jobs go in with one `INSERT … SELECT FROM unnest(…)`: rows are produced in input
/// order, so the identity column hands out increasing ids and sorting them restores the
/// input order. Batches with unique keys, ordering keys or dependencies call
/// `skiplock.enqueue_job(…)` once per job, still in one statement and in input order, so a
/// later job of the batch sees an earlier one with the same key.
pub async fn jobs_insert_many(
    db: impl PgExecutor<'_>,
    batch: &InsertBatch,
) -> sqlx::Result<Vec<JobId>> {
    Ok(jobs_insert_reporting(db, batch).await?.ids)
}

/// Ids of an inserted batch, in input order, and what each enqueue did.
#[derive(Debug)]
pub struct InsertedJobs {
    /// Ids in input order: new jobs, or the pending jobs a unique key folded them into.
    pub ids: Vec<JobId>,
    /// What each enqueue did, as `skiplock.enqueue_job` says it (`inserted`, `skipped`,
    /// `replaced`, `merged`); `None` when the batch took the plain path, where every job
    /// is inserted.
    pub outcomes: Option<Vec<String>>,
}

/// As [`jobs_insert_many`], and says what each enqueue did.
pub async fn jobs_insert_reporting(
    db: impl PgExecutor<'_>,
    batch: &InsertBatch,
) -> sqlx::Result<InsertedJobs> {
    if batch.needs_per_job_path() {
        return jobs_insert_each(db, batch).await;
    }
    let mut ids: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, queue, priority, scheduled_at, max_attempts,
                                    ordering_key, concurrency_key, traceparent, tracestate)
         SELECT kind, args, queue, priority,
                coalesce(run_at, now() + delay_ms * interval '1 millisecond'), max_attempts,
                ordering_key, concurrency_key, traceparent, tracestate
         FROM unnest($1::text[], $2::jsonb[], $3::text[], $4::smallint[], $5::timestamptz[],
                     $6::bigint[], $7::int[], $8::text[], $9::text[], $10::text[], $11::text[])
              WITH ORDINALITY
              AS j(kind, args, queue, priority, run_at, delay_ms, max_attempts, ordering_key,
                   concurrency_key, traceparent, tracestate, ord)
         ORDER BY ord
         RETURNING id",
    )
    .bind(&batch.kinds)
    .bind(&batch.args)
    .bind(&batch.queues)
    .bind(&batch.priorities)
    .bind(&batch.run_at)
    .bind(&batch.delays_ms)
    .bind(&batch.max_attempts)
    .bind(&batch.ordering_keys)
    .bind(&batch.concurrency_keys)
    .bind(&batch.traceparents)
    .bind(&batch.tracestates)
    .fetch_all(db)
    .await?;
    ids.sort_unstable();
    Ok(InsertedJobs {
        ids: ids.into_iter().map(JobId).collect(),
        outcomes: None,
    })
}

async fn jobs_insert_each(
    db: impl PgExecutor<'_>,
    batch: &InsertBatch,
) -> sqlx::Result<InsertedJobs> {
    // The function scan yields rows in array order and the lateral call runs per row as
    // it comes, so the calls happen in input order; `ord` maps results back.
    let mut rows: Vec<(i64, i64, String)> = sqlx::query_as(
        "SELECT ord, e.id, e.outcome
         FROM unnest($1::text[], $2::jsonb[], $3::text[], $4::smallint[], $5::timestamptz[],
                     $6::bigint[], $7::int[], $8::text[], $9::text[], $10::text[], $11::jsonb[],
                     $12::text[], $13::text[], $14::text[])
              WITH ORDINALITY
              AS j(kind, args, queue, priority, run_at, delay_ms, max_attempts, ordering_key,
                   unique_key, policy, parents, concurrency_key, traceparent, tracestate, ord),
              LATERAL skiplock.enqueue_job(
                    kind, args, queue, priority,
                    coalesce(run_at, now() + delay_ms * interval '1 millisecond'), max_attempts,
                    ordering_key, unique_key, coalesce(policy, 'skip'),
                    ARRAY(SELECT jsonb_array_elements_text(parents)::bigint),
                    concurrency_key, traceparent, tracestate) e",
    )
    .bind(&batch.kinds)
    .bind(&batch.args)
    .bind(&batch.queues)
    .bind(&batch.priorities)
    .bind(&batch.run_at)
    .bind(&batch.delays_ms)
    .bind(&batch.max_attempts)
    .bind(&batch.ordering_keys)
    .bind(&batch.unique_keys)
    .bind(&batch.unique_policies)
    .bind(&batch.depends_on)
    .bind(&batch.concurrency_keys)
    .bind(&batch.traceparents)
    .bind(&batch.tracestates)
    .fetch_all(db)
    .await?;
    rows.sort_unstable_by_key(|(ord, _, _)| *ord);
    let (ids, outcomes) = rows
        .into_iter()
        .map(|(_, id, outcome)| (JobId(id), outcome))
        .unzip();
    Ok(InsertedJobs {
        ids,
        outcomes: Some(outcomes),
    })
}
