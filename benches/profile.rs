//! Profile: where the time of a drain goes, statement by statement.
//!
//! 1. Plans: the library's own claim, complete, heartbeat and insert statements (called
//!    through `skiplock::db::jobs`, not copied) run on a connection with `auto_explain`
//!    loaded (`LOAD` works per session for a superuser, no server restart). Its plans, with
//!    `ANALYZE`, `BUFFERS` and `WAL`, come back as notices, which a small tracing subscriber
//!    collects. Printed: claim and complete at batch 100 and 1000, first execution (custom
//!    plan) and eighth (after the plan cache may have switched to a generic plan); the claim
//!    again after 50,000 claims without a vacuum, and with 1,000,000 finished rows; a
//!    heartbeat of 256 claims; an `enqueue_many` of 1,000.
//!    Then statements prepared while the table was empty (cached as generic plans after
//!    five executions, as in a worker started on a fresh database) run on 200,000 rows,
//!    against the same statements planned on a fresh connection.
//! 2. Table statistics after those: updates, HOT updates, index sizes.
//! 3. `pg_stat_statements` around a worker drain, when the server preloads it (it needs
//!    `shared_preload_libraries`, so on a shared server it is usually skipped;
//!    `benches/run-all.sh --pgss` starts a private server that has it).
//! 4. Experiments: the floor loop (claim + complete on one connection) with the library's
//!    statements, then with one change at a time: custom plans only, a complete keyed by
//!    `id = ANY($1)`, a claim without its guards (bench-only SQL, written here to measure
//!    them, not used by the library), without the `(queue, state)` index, and with
//!    `synchronous_commit = off`.
//!
//! `cargo bench --bench profile -- --quick` (or `SKIPLOCK_BENCH_QUICK=1`).

mod support;

use std::fmt::Debug;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use skiplock::EnqueueOptions;
use skiplock::builtin::Noop;
use skiplock::db::jobs::{jobs_claim_batch, jobs_complete_many, jobs_heartbeat_many};
use skiplock::db::maintenance::{jobs_any_active, jobs_settle_waiting};
use sqlx::{Connection, PgConnection};
use support::{BenchDb, DrainCfg, Opts, Table, drain_noop, progress, rate, thousands};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Notices received from the server (auto_explain's plans).
static NOTICES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// A tracing subscriber that keeps only sqlx's server notices.
struct NoticeSink;

struct MessageVisitor(String);

impl Visit for MessageVisitor {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.push_str(value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        if field.name() == "message" {
            self.0.push_str(&format!("{value:?}"));
        }
    }
}

impl Subscriber for NoticeSink {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target().starts_with("sqlx::postgres::notice")
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut visitor = MessageVisitor(String::new());
        event.record(&mut visitor);
        NOTICES
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(visitor.0);
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

fn take_notices() -> Vec<String> {
    std::mem::take(&mut *NOTICES.lock().unwrap_or_else(|p| p.into_inner()))
}

/// The plan part of an auto_explain message: its duration line and the plan, without the
/// query text.
fn plan_of(notice: &str) -> String {
    let mut lines = notice.lines();
    let head = lines.next().unwrap_or_default().to_owned();
    let rest: Vec<&str> = lines.collect();
    let start = rest
        .iter()
        .position(|l| l.contains("(cost=") || l.contains("(actual"))
        .unwrap_or(0);
    let mut out = head;
    for line in &rest[start..] {
        out.push('\n');
        out.push_str(line);
    }
    out
}

/// Every plan among one statement's notices: those of nested statements first (the query
/// inside `skiplock.internal_claim_batch`), then the statement's own.
fn statement_plans(notices: &[String]) -> String {
    let plans: Vec<String> = notices
        .iter()
        .filter(|n| n.starts_with("duration:"))
        .map(|n| plan_of(n))
        .collect();
    if plans.is_empty() {
        "(no plan captured)".to_owned()
    } else {
        plans.join("\n\n")
    }
}

/// A connection that reports the plan of every statement as a notice.
async fn explaining_connection(db: &BenchDb) -> PgConnection {
    let mut conn = db.connection().await;
    for sql in [
        "LOAD 'auto_explain'",
        "SET auto_explain.log_min_duration = 0",
        "SET auto_explain.log_analyze = on",
        "SET auto_explain.log_buffers = on",
        "SET auto_explain.log_wal = on",
        "SET auto_explain.log_timing = on",
        "SET auto_explain.log_triggers = on",
        "SET auto_explain.log_nested_statements = on",
        "SET auto_explain.log_level = notice",
        "SET auto_explain.log_format = text",
    ] {
        sqlx::raw_sql(sql).execute(&mut conn).await.expect(sql);
    }
    take_notices();
    conn
}

fn queues() -> Vec<String> {
    vec!["default".to_owned()]
}

fn kinds() -> Vec<String> {
    vec!["noop".to_owned()]
}

fn print_plan(title: &str, plan: &str) {
    println!("#### {title}");
    println!();
    println!("```");
    println!("{plan}");
    println!("```");
    println!();
}

#[tokio::main]
async fn main() {
    let opts = Opts::parse();
    tracing::subscriber::set_global_default(NoticeSink).expect("subscriber");
    let db = BenchDb::create("profile").await;
    support::print_header("Profile: claim and complete statements", &db, &opts).await;

    plans(&db).await;
    cached_on_empty(&db).await;
    table_stats(&db).await;
    pg_stat_statements(&db, &opts).await;
    experiments(&db, &opts).await;
    db.drop_database().await;
}

/// Section 1: auto_explain plans of the library's statements.
async fn plans(db: &BenchDb) {
    println!("### Plans (auto_explain: ANALYZE, BUFFERS, WAL) on 200,000 queued jobs");
    println!();
    for batch in [100i64, 1000] {
        progress(format!("plans at batch {batch}"));
        db.reset().await;
        db.preload_noop(200_000).await;
        let mut conn = explaining_connection(db).await;
        let mut claim_ms = Vec::new();
        let mut complete_ms = Vec::new();
        for cycle in 1..=8 {
            let t = Instant::now();
            let jobs = jobs_claim_batch(&mut conn, "default", &kinds(), batch, "profile")
                .await
                .expect("claim");
            claim_ms.push(t.elapsed().as_secs_f64() * 1000.0);
            let claim_plan = statement_plans(&take_notices());
            let (ids, tokens): (Vec<i64>, Vec<uuid::Uuid>) =
                jobs.iter().map(|j| (j.id, j.claim_token)).unzip();
            let t = Instant::now();
            jobs_complete_many(&mut conn, &ids, &tokens)
                .await
                .expect("complete");
            complete_ms.push(t.elapsed().as_secs_f64() * 1000.0);
            let complete_plan = statement_plans(&take_notices());
            if cycle == 1 || cycle == 8 {
                print_plan(
                    &format!("claim_batch, batch {batch}, execution {cycle}"),
                    &claim_plan,
                );
                print_plan(
                    &format!("complete_many, batch {batch}, execution {cycle}"),
                    &complete_plan,
                );
            }
        }
        println!(
            "Client-side times with auto_explain (timing adds overhead), batch {batch}: claim {} ms; complete {} ms.",
            fmt_list(&claim_ms),
            fmt_list(&complete_ms)
        );
        println!();
        let _ = conn.close().await;
    }

    // The claim after many claims and completions without a vacuum: dead index entries.
    progress("claim after 50,000 claims without vacuum");
    db.reset().await;
    db.preload_noop(200_000).await;
    let mut conn = db.connection().await;
    for _ in 0..50 {
        let jobs = jobs_claim_batch(&mut conn, "default", &kinds(), 1000, "profile")
            .await
            .expect("claim");
        let (ids, tokens): (Vec<i64>, Vec<uuid::Uuid>) =
            jobs.iter().map(|j| (j.id, j.claim_token)).unzip();
        jobs_complete_many(&mut conn, &ids, &tokens)
            .await
            .expect("complete");
    }
    let _ = conn.close().await;
    let mut conn = explaining_connection(db).await;
    jobs_claim_batch(&mut conn, "default", &kinds(), 1000, "profile")
        .await
        .expect("claim");
    print_plan(
        "claim_batch, batch 1000, after 50,000 claimed and completed without vacuum",
        &statement_plans(&take_notices()),
    );

    // A heartbeat of 256 held claims (the 1,000 just claimed: the first 256).
    let held: Vec<(i64, uuid::Uuid)> = sqlx::query_as(
        "SELECT id, claim_token FROM skiplock.jobs WHERE state = 'running' ORDER BY id LIMIT 256",
    )
    .fetch_all(&db.pool)
    .await
    .expect("held");
    let (ids, tokens): (Vec<i64>, Vec<uuid::Uuid>) = held.into_iter().unzip();
    take_notices();
    jobs_heartbeat_many(&mut conn, &ids, &tokens, &[])
        .await
        .expect("heartbeat");
    print_plan(
        "heartbeat_many, 256 claims",
        &statement_plans(&take_notices()),
    );
    let _ = conn.close().await;

    // With a million finished rows.
    progress("claim with 1,000,000 finished rows");
    db.reset().await;
    db.preload_finished(1_000_000).await;
    db.preload_noop(200_000).await;
    let mut conn = explaining_connection(db).await;
    jobs_claim_batch(&mut conn, "default", &kinds(), 1000, "profile")
        .await
        .expect("claim");
    print_plan(
        "claim_batch, batch 1000, 200,000 queued over 1,000,000 finished rows",
        &statement_plans(&take_notices()),
    );

    // Insert of 1,000 through the API, with its trigger.
    take_notices();
    let jobs = vec![Noop {}; 1000];
    skiplock::enqueue_many(&mut conn, &jobs, EnqueueOptions::default())
        .await
        .expect("enqueue_many");
    let notices = take_notices();
    for (i, n) in notices
        .iter()
        .filter(|n| n.starts_with("duration:"))
        .enumerate()
    {
        print_plan(
            &format!("enqueue_many of 1,000 (statement {} of its plans)", i + 1),
            &plan_of(n),
        );
    }
    let _ = conn.close().await;
}

/// Section 1b: statements prepared (and after five executions cached as generic plans)
/// while the table was empty, as in a worker started on a fresh database, then run on a
/// table of 200,000 rows of which 180,000 finished; against the same statements on a fresh
/// connection. Each gets at most 10 s.
async fn cached_on_empty(db: &BenchDb) {
    progress("statements cached on an empty table, then run on 200,000 rows");
    println!("### Plans cached while the table was empty");
    println!();
    db.reset().await;
    let mut cached = db.connection().await;
    sqlx::raw_sql("SET statement_timeout = '10s'")
        .execute(&mut cached)
        .await
        .expect("set");
    for _ in 0..6 {
        jobs_settle_waiting(&mut cached).await.expect("sweep");
        jobs_claim_batch(&mut cached, "default", &kinds(), 32, "profile")
            .await
            .expect("claim");
        jobs_any_active(&mut cached, &queues(), &kinds())
            .await
            .expect("idle check");
    }
    db.preload_noop_unanalyzed(200_000).await;
    db.exec(
        "UPDATE skiplock.jobs SET state = 'succeeded', attempt = 1, claimed_at = now(),
                finished_at = now() WHERE id <= 180000",
    )
    .await;
    // The claim index still holds an entry for each of the 180,000 rows just finished,
    // until VACUUM. The first index walk visits their heap rows and marks the entries
    // dead; later walks skip them. Walk it once here, so neither measured claim pays
    // that for the other.
    db.exec(
        "BEGIN;
         SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off;
         SET LOCAL enable_sort = off;
         SELECT count(*) FROM (SELECT 1 FROM skiplock.jobs
                               WHERE state = 'queued' AND scheduled_at <= now()
                               ORDER BY priority, scheduled_at, id) walked;
         COMMIT;",
    )
    .await;
    let mut fresh = db.connection().await;
    sqlx::raw_sql("SET statement_timeout = '10s'")
        .execute(&mut fresh)
        .await
        .expect("set");
    let mut table = Table::new(&[
        "statement",
        "cached on the empty table",
        "fresh connection (planned now)",
    ]);
    async fn timed<T>(f: impl std::future::Future<Output = sqlx::Result<T>>) -> String {
        let t = Instant::now();
        match f.await {
            Ok(_) => format!("{:.1} ms", t.elapsed().as_secs_f64() * 1000.0),
            Err(e) if e.to_string().contains("statement timeout") => {
                "> 10 s (cancelled by statement_timeout)".to_owned()
            }
            Err(e) => format!("error: {e}"),
        }
    }
    table.row(vec![
        "`jobs_settle_waiting` (dependency sweep, every second in every worker)".into(),
        timed(jobs_settle_waiting(&mut cached)).await,
        timed(jobs_settle_waiting(&mut fresh)).await,
    ]);
    table.row(vec![
        "`jobs_claim_batch`, 32".into(),
        timed(jobs_claim_batch(
            &mut cached,
            "default",
            &kinds(),
            32,
            "profile",
        ))
        .await,
        timed(jobs_claim_batch(
            &mut fresh,
            "default",
            &kinds(),
            32,
            "profile",
        ))
        .await,
    ]);
    table.row(vec![
        "`jobs_any_active` (idle check)".into(),
        timed(jobs_any_active(&mut cached, &queues(), &kinds())).await,
        timed(jobs_any_active(&mut fresh, &queues(), &kinds())).await,
    ]);
    table.print();
    let _ = cached.close().await;
    let _ = fresh.close().await;
}

fn fmt_list(values: &[f64]) -> String {
    values
        .iter()
        .map(|v| format!("{v:.1}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Section 2: what the updates did to the table.
async fn table_stats(db: &BenchDb) {
    progress("table statistics after a floor drain of 100,000");
    db.reset().await;
    db.exec(
        "SELECT pg_stat_reset_single_table_counters(relid)
         FROM pg_partition_tree('skiplock.jobs') WHERE isleaf",
    )
    .await;
    db.preload_noop(100_000).await;
    let mut conn = db.connection().await;
    let t = Instant::now();
    loop {
        let jobs = jobs_claim_batch(&mut conn, "default", &kinds(), 1000, "profile")
            .await
            .expect("claim");
        if jobs.is_empty() {
            break;
        }
        let (ids, tokens): (Vec<i64>, Vec<uuid::Uuid>) =
            jobs.iter().map(|j| (j.id, j.claim_token)).unzip();
        jobs_complete_many(&mut conn, &ids, &tokens)
            .await
            .expect("complete");
    }
    let secs = t.elapsed().as_secs_f64();
    let _ = conn.close().await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // Summed over the tables of skiplock.jobs: the partitioned parent stores nothing. A
    // completion moves its row from jobs_live to a day of jobs_done: a delete there and an
    // insert here, not an update.
    let (upd, hot, dead, live): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT sum(s.n_tup_upd)::bigint, sum(s.n_tup_hot_upd)::bigint,
                sum(s.n_dead_tup)::bigint, sum(s.n_live_tup)::bigint
         FROM pg_partition_tree('skiplock.jobs') p
         JOIN pg_stat_user_tables s ON s.relid = p.relid
         WHERE p.isleaf",
    )
    .fetch_one(&db.pool)
    .await
    .expect("table stats");
    println!("### Table after claiming and completing 100,000 jobs (batch 1000, {secs:.1} s)");
    println!();
    println!(
        "updates {}, of which HOT {} ({:.1} %); dead tuples {}; live tuples {}.",
        thousands(upd),
        thousands(hot),
        hot as f64 / upd.max(1) as f64 * 100.0,
        thousands(dead),
        thousands(live)
    );
    println!();
    let sizes: Vec<(String, i64, String)> = sqlx::query_as(
        "SELECT c.relname::text, pg_relation_size(c.oid), pg_get_indexdef(c.oid)
         FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         WHERE i.indrelid IN (SELECT relid FROM pg_partition_tree('skiplock.jobs') WHERE isleaf)
         ORDER BY pg_relation_size(c.oid) DESC",
    )
    .fetch_all(&db.pool)
    .await
    .expect("index sizes");
    let heap: i64 = db
        .scalar_i64(
            "SELECT sum(pg_relation_size(relid))::bigint
             FROM pg_partition_tree('skiplock.jobs') WHERE isleaf",
        )
        .await;
    let mut table = Table::new(&["relation", "size kB", "definition"]);
    table.row(vec![
        "skiplock.jobs (heap, every partition)".into(),
        thousands(heap / 1024),
        String::new(),
    ]);
    for (name, size, def) in sizes {
        let def = def
            .split_once(" USING ")
            .map_or(def.clone(), |(_, d)| d.to_owned());
        table.row(vec![name, thousands(size / 1024), def]);
    }
    table.print();
}

/// Section 3: pg_stat_statements around a worker drain, when available.
async fn pg_stat_statements(db: &BenchDb, opts: &Opts) {
    println!("### pg_stat_statements");
    println!();
    if !support::pgss_enabled(db).await {
        return;
    }
    let n: i64 = if opts.quick { 100_000 } else { 200_000 };
    progress(format!(
        "pg_stat_statements around a default-settings drain of {n}"
    ));
    db.reset().await;
    db.preload_noop(n).await;
    support::pgss_reset(db).await;
    let run = drain_noop(db, DrainCfg::capped(Duration::from_secs(120))).await;
    println!(
        "Drain of {} jobs at default settings: {}, {:.1} jobs/claim, {:.1} jobs/complete.",
        thousands(run.drained.jobs),
        rate(run.drained.rate()),
        run.drained.jobs as f64 / run.drained.claim_statements.max(1) as f64,
        run.drained.jobs as f64 / run.drained.complete_statements.max(1) as f64
    );
    println!();
    support::pgss_print(db).await;
}

/// One change (or a few) to the floor loop, against the library's statements.
#[derive(Clone, Copy, Debug, Default)]
struct Variant {
    /// Jobs per claim (and per complete).
    batch: i64,
    /// Complete with [`KEYED_COMPLETE`] instead of `jobs_complete_many`.
    keyed_complete: bool,
    /// Claim with [`LEAN_CLAIM`] instead of `jobs_claim_batch`.
    lean_claim: bool,
    /// `plan_cache_mode = force_custom_plan` on the connection: what `.persistent(false)`
    /// on the library's queries would do.
    custom_plans: bool,
    /// `synchronous_commit = off` on the connection: commits do not wait for the WAL flush.
    async_commit: bool,
    /// With an index `jobs_queue_state_idx (queue, state)`, which the schema leaves out.
    with_queue_state_idx: bool,
}

/// Bench-only claim without the paused-queue and lane guards (same RETURNING).
const LEAN_CLAIM: &str = "WITH picked AS (
         SELECT id FROM skiplock.jobs
         WHERE state = 'queued' AND scheduled_at <= now()
           AND queue = ANY($1) AND kind = ANY($2)
         ORDER BY priority, scheduled_at, id
         LIMIT $3
         FOR UPDATE SKIP LOCKED
     )
     UPDATE skiplock.jobs j
     SET state = 'running', claim_token = gen_random_uuid(), claimed_by = $4,
         claimed_at = now(), heartbeat_at = now(), attempt = j.attempt + 1
     FROM picked
     WHERE j.id = picked.id
     RETURNING j.id, j.queue, j.kind, j.args, j.attempt, j.max_attempts, j.claim_token,
               j.priority, (extract(epoch FROM j.scheduled_at) * 1000000)::bigint";

/// Bench-only complete: the library's statement with `j.id = ANY($1)` in place of
/// `j.state = 'running'` in the locking scan. The planner then reaches the rows through the
/// primary key whatever it believes about `running` rows; a matching fresh `claim_token`
/// already implies `running` (every statement that ends a claim clears the token).
const KEYED_COMPLETE: &str = "WITH held AS (
         SELECT j.id FROM skiplock.jobs j
         JOIN unnest($1::bigint[], $2::uuid[]) AS c(id, token)
           ON j.id = c.id AND j.claim_token = c.token
         WHERE j.id = ANY($1::bigint[])
         ORDER BY j.id
         FOR UPDATE OF j
     )
     UPDATE skiplock.jobs j
     SET state = 'succeeded', finished_at = now(), claim_token = NULL, heartbeat_at = NULL
     FROM held
     WHERE j.id = held.id
     RETURNING j.id, j.state,
               EXISTS (SELECT 1 FROM skiplock.job_dependencies d WHERE d.parent_id = j.id)
                   AS has_dependants,
               j.ordering_key";

/// One floor drain of `n` jobs with `variant`; jobs/s measured in the database, and the
/// mean complete statement in milliseconds.
async fn floor_variant(db: &BenchDb, n: i64, v: Variant) -> (f64, f64) {
    db.reset().await;
    if v.with_queue_state_idx {
        db.exec("CREATE INDEX jobs_queue_state_idx ON skiplock.jobs (queue, state)")
            .await;
    }
    db.preload_noop(n).await;
    let mut conn = db.connection().await;
    if v.custom_plans {
        sqlx::raw_sql("SET plan_cache_mode = force_custom_plan")
            .execute(&mut conn)
            .await
            .expect("set");
    }
    if v.async_commit {
        sqlx::raw_sql("SET synchronous_commit = off")
            .execute(&mut conn)
            .await
            .expect("set");
    }
    let (mut complete_time, mut completes) = (Duration::ZERO, 0u32);
    loop {
        let jobs: Vec<(i64, uuid::Uuid)> = if v.lean_claim {
            sqlx::query_as::<_, skiplock::db::jobs::ClaimedJob>(LEAN_CLAIM)
                .bind(queues())
                .bind(kinds())
                .bind(v.batch)
                .bind("profile")
                .fetch_all(&mut conn)
                .await
                .expect("lean claim")
                .into_iter()
                .map(|j| (j.id, j.claim_token))
                .collect()
        } else {
            jobs_claim_batch(&mut conn, "default", &kinds(), v.batch, "profile")
                .await
                .expect("claim")
                .into_iter()
                .map(|j| (j.id, j.claim_token))
                .collect()
        };
        if jobs.is_empty() {
            break;
        }
        let (ids, tokens): (Vec<i64>, Vec<uuid::Uuid>) = jobs.into_iter().unzip();
        let t = Instant::now();
        if v.keyed_complete {
            sqlx::query(KEYED_COMPLETE)
                .bind(&ids)
                .bind(&tokens)
                .execute(&mut conn)
                .await
                .expect("keyed complete");
        } else {
            jobs_complete_many(&mut conn, &ids, &tokens)
                .await
                .expect("complete");
        }
        complete_time += t.elapsed();
        completes += 1;
    }
    let _ = conn.close().await;
    if v.with_queue_state_idx {
        db.exec("DROP INDEX skiplock.jobs_queue_state_idx").await;
    }
    (
        db.drained_since(0).await.rate(),
        complete_time.as_secs_f64() * 1000.0 / f64::from(completes.max(1)),
    )
}

/// Section 4: the floor loop with one change at a time.
async fn experiments(db: &BenchDb, opts: &Opts) {
    let n: i64 = if opts.quick { 50_000 } else { 200_000 };
    let rounds = if opts.quick { 1 } else { 3 };
    println!(
        "### Experiments: floor loop (claim + complete on one connection, {} jobs)",
        thousands(n)
    );
    println!();
    let b1000 = Variant {
        batch: 1000,
        ..Variant::default()
    };
    let keyed = Variant {
        keyed_complete: true,
        ..b1000
    };
    let b100 = Variant {
        batch: 100,
        ..Variant::default()
    };
    let cases: Vec<(&str, Variant)> = vec![
        ("batch 1000: library statements", b1000),
        (
            "batch 1000: library, custom plans only (plan_cache_mode = force_custom_plan)",
            Variant {
                custom_plans: true,
                ..b1000
            },
        ),
        (
            "batch 1000: complete keyed by `id = ANY($1)` (bench-only SQL)",
            keyed,
        ),
        (
            "batch 1000: keyed complete + claim without paused-queue/lane guards",
            Variant {
                lean_claim: true,
                ..keyed
            },
        ),
        (
            "batch 1000: keyed complete, with jobs_queue_state_idx (not in the schema)",
            Variant {
                with_queue_state_idx: true,
                ..keyed
            },
        ),
        (
            "batch 1000: keyed complete, synchronous_commit = off",
            Variant {
                async_commit: true,
                ..keyed
            },
        ),
        ("batch 100: library statements", b100),
        (
            "batch 100: library, synchronous_commit = off",
            Variant {
                async_commit: true,
                ..b100
            },
        ),
    ];
    // Rounds interleave the cases, so a noisy neighbour hurts them alike.
    let mut results = vec![Vec::new(); cases.len()];
    for round in 1..=rounds {
        for (i, (name, variant)) in cases.iter().enumerate() {
            progress(format!("experiment round {round}: {name}"));
            let (r, complete_ms) = floor_variant(db, n, *variant).await;
            progress(format!("  {}; complete {complete_ms:.1} ms", rate(r)));
            results[i].push((r, complete_ms));
        }
    }
    let best = |r: &[(f64, f64)]| r.iter().map(|x| x.0).fold(0.0, f64::max);
    let mut table = Table::new(&[
        "variant",
        "jobs/s (each round)",
        "complete ms/stmt (each round)",
        "best",
    ]);
    for ((name, _), r) in cases.iter().zip(&results) {
        table.row(vec![
            (*name).to_owned(),
            r.iter().map(|x| rate(x.0)).collect::<Vec<_>>().join(", "),
            r.iter()
                .map(|x| format!("{:.1}", x.1))
                .collect::<Vec<_>>()
                .join(", "),
            rate(best(r)),
        ]);
    }
    table.print();
}
