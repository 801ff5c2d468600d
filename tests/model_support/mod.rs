//! Support of the randomized model test (`tests/model.rs`): the simulation's shared state,
//! the extended audit, and one module per concern.
//!
//! - [`kind`]: the in-process job kind `model`, whose every attempt picks its outcome from
//!   its args and attempt number, and records its run (start and end on a monotonic
//!   clock) in memory;
//! - [`workers`]: in-process library workers and `skiplock-testbed` processes, started,
//!   stopped, killed and replaced by the worker manager;
//! - [`actors`]: everything else that acts on the queue while the fault phase lasts:
//!   enqueuers (Rust API, SQL function, plain INSERT), operators (SQL and CLI retry,
//!   cancel, delete), the connection killer and the sampler;
//! - [`logs`]: the in-process workers' tracing output, and which lines are defects;
//! - [`checks`]: the invariants, read from the audit log after the queue drained;
//! - [`coverage`]: the paths a run took (the events the invariants are about), from the
//!   same audit.
#![allow(dead_code)]

pub mod actors;
pub mod checks;
pub mod coverage;
pub mod kind;
pub mod logs;
pub mod workers;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

/// Lanes (ordering keys) and unique keys are drawn from small sets so that they collide.
pub const LANES: [&str; 4] = ["lane-a", "lane-b", "lane-c", "lane-d"];
pub const UNIQUE_KEYS: [&str; 4] = ["uk-a", "uk-b", "uk-c", "uk-d"];
/// Queues every worker claims from.
pub const QUEUES: [&str; 3] = ["default", "q2", "q3"];
/// The queue whose one limit is a `key_max_running` of this many: a Rust worker's
/// completion of one of its keyed jobs hands the key's freed slot on to itself, claiming
/// the key's next job in the same transaction; the replay fails a transaction that leaves
/// more of one key's jobs of that queue running.
pub const KEYED_QUEUE: (&str, usize) = ("q3", 1);
/// The queue given a global limit for the whole run, and its `max_running`: the replay
/// fails a claim that makes more of its jobs run at once (tests/model_support/checks.rs).
pub const LIMITED_QUEUE: (&str, usize) = ("q2", 3);
/// The same queue's rate limit for the whole run: at most this many starts in any window of
/// this many milliseconds; the replay fails a start that comes sooner after the start this
/// many before it (tests/model_support/checks.rs).
pub const LIMITED_QUEUE_RATE: (usize, i64) = (10, 500);
/// The same queue's key_max_running for the whole run, and the concurrency keys jobs are
/// given (on every queue, so that the limit binds only where it is set): the replay fails
/// a claim that makes more of one key's jobs of that queue run at once.
pub const LIMITED_QUEUE_KEY_MAX: usize = 1;
/// The same queue's per-key rate limit for the whole run: at most this many starts of one
/// concurrency key in any window of this many milliseconds; the replay fails a start of a
/// key that comes sooner after the key's start this many before it.
pub const LIMITED_QUEUE_KEY_RATE: (usize, i64) = (2, 300);
pub const CONCURRENCY_KEYS: [&str; 3] = ["tenant-a", "tenant-b", "tenant-c"];
/// Both queues' key_claimable for the whole run (fair queueing by key): a key's jobs past
/// it wait their turn (`held_for = 'fair'`); the drain shows none is stranded.
pub const KEY_CLAIMABLE: usize = 2;

/// What every actor shares during one seed's run.
pub struct Sim {
    pub seed: u64,
    /// The test database's URL (for the CLI and the testbeds).
    pub url: String,
    /// Ends the fault phase: enqueuers, operators, chaos and the pruner stop.
    pub faults_over: CancellationToken,
    /// Ends the sampler (after the drain).
    pub sampling_over: CancellationToken,
    /// Ids of the jobs enqueued so far, oldest first: parents, retry and cancel targets.
    known: Mutex<Vec<i64>>,
    /// Violations seen while the run went on (actor errors, sampler), in order.
    violations: Mutex<Vec<String>>,
    /// How often each operation happened, for the run's summary.
    counts: Mutex<BTreeMap<String, u64>>,
    /// Origin of the in-process monotonic clock (handler runs).
    pub started: Instant,
}

impl Sim {
    pub fn new(seed: u64, url: String) -> Self {
        Self {
            seed,
            url,
            faults_over: CancellationToken::new(),
            sampling_over: CancellationToken::new(),
            known: Mutex::new(Vec::new()),
            violations: Mutex::new(Vec::new()),
            counts: Mutex::new(BTreeMap::new()),
            started: Instant::now(),
        }
    }

    /// A random generator for one actor, derived from the seed and the actor's name.
    pub fn rng(&self, actor: &str) -> fastrand::Rng {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in actor.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        fastrand::Rng::with_seed(self.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ h)
    }

    /// A small pool whose connections carry `app` as `application_name` (the audit's
    /// `app` column; the connection killer spares everything not named `tb-…`).
    pub async fn pool(&self, app: &str, size: u32) -> PgPool {
        let options: PgConnectOptions = self.url.parse().expect("test database URL");
        PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options.application_name(app))
            .await
            .unwrap_or_else(|e| panic!("connect pool {app}: {e}"))
    }

    pub fn remember(&self, ids: impl IntoIterator<Item = i64>) {
        // A unique key's `skip` returns an existing id again: a repeat is harmless.
        self.known.lock().unwrap().extend(ids);
    }

    /// Up to `n` distinct ids among the `window` most recently enqueued jobs.
    pub fn pick_known(&self, rng: &mut fastrand::Rng, window: usize, n: usize) -> Vec<i64> {
        let known = self.known.lock().unwrap();
        let recent = &known[known.len().saturating_sub(window)..];
        let mut picked = Vec::new();
        for _ in 0..n {
            if recent.is_empty() {
                break;
            }
            let id = recent[rng.usize(..recent.len())];
            if !picked.contains(&id) {
                picked.push(id);
            }
        }
        picked
    }

    pub fn violation(&self, what: impl Into<String>) {
        let what = what.into();
        eprintln!("model seed {}: VIOLATION {what}", self.seed);
        self.violations.lock().unwrap().push(what);
    }

    pub fn violations(&self) -> Vec<String> {
        self.violations.lock().unwrap().clone()
    }

    pub fn count(&self, what: &str) {
        *self
            .counts
            .lock()
            .unwrap()
            .entry(what.to_owned())
            .or_default() += 1;
    }

    pub fn counts(&self) -> BTreeMap<String, u64> {
        self.counts.lock().unwrap().clone()
    }

    /// Nanoseconds on the simulation's monotonic clock.
    pub fn now_ns(&self) -> u64 {
        self.started.elapsed().as_nanos() as u64
    }

    /// Sleeps `ms`, or less if the fault phase ends meanwhile; false once it has ended.
    pub async fn pace(&self, ms: u64) -> bool {
        tokio::select! {
            () = self.faults_over.cancelled() => false,
            () = tokio::time::sleep(Duration::from_millis(ms)) => !self.faults_over.is_cancelled(),
        }
    }
}

/// The columns of `skiplock.jobs` the model's audit copies beyond the fault tests' own,
/// with their types.
const MODEL_AUDIT_COLUMNS: &[(&str, &str)] = &[
    ("ordering_key", "text"),
    ("unique_key", "text"),
    ("unique_policy", "text"),
    ("args", "jsonb"),
    ("queue", "text"),
    ("concurrency_key", "text"),
    ("held_for", "text"),
    ("scheduled_at", "timestamptz"),
];

/// Extends the audit of `tests/fault_support` (already installed): every row also records
/// the job's ordering and unique keys, unique policy and args (so a merge is checked after
/// the pruner removed both jobs), its queue, concurrency key, `held_for` and
/// `scheduled_at` (so the coverage sees a limit hold back a due job), through the same
/// function as the fault tests' audit (`fault_support::audit_function_sql`), and the edges of the dependency graph are
/// recorded in `public.model_deps` numbered from the audit's own sequence, so a claim
/// and an edge can be ordered, and edges survive the cascade when a parent is pruned.
pub async fn extend_audit(pool: &PgPool) {
    let added: Vec<String> = MODEL_AUDIT_COLUMNS
        .iter()
        .map(|(column, kind)| format!("ADD COLUMN {column} {kind}"))
        .collect();
    let columns: Vec<&str> = MODEL_AUDIT_COLUMNS
        .iter()
        .map(|(column, _)| *column)
        .collect();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE public.job_audit {};
         {}",
        added.join(", "),
        crate::fault_support::audit_function_sql(&columns)
    )))
    .execute(pool)
    .await
    .expect("extend the audit's table and function");
    sqlx::raw_sql(
        "CREATE TABLE public.model_deps (
             seq       bigint NOT NULL DEFAULT nextval('public.job_audit_seq_seq'),
             job_id    bigint NOT NULL,
             parent_id bigint NOT NULL,
             app       text   NOT NULL DEFAULT current_setting('application_name')
         );
         CREATE FUNCTION public.model_deps_record() RETURNS trigger
         LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO public.model_deps (job_id, parent_id) VALUES (NEW.job_id, NEW.parent_id);
             RETURN NULL;
         END;
         $$;
         CREATE TRIGGER job_dependencies_audit AFTER INSERT ON skiplock.job_dependencies
             FOR EACH ROW EXECUTE FUNCTION public.model_deps_record();",
    )
    .execute(pool)
    .await
    .expect("extend the audit");
}
