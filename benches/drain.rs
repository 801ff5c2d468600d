//! Drain benchmark: how fast a worker empties a table of preloaded `noop` jobs.
//!
//! - the matrix: 100,000 and 1,000,000 jobs (100,000 only with `--quick`) at concurrency
//!   1, 16, 64 and 256, each run capped in time (the rate is then over what finished);
//! - the headline: 200,000 jobs with default settings (the target: 60,000 jobs/s),
//!   and the same with a larger prefetch (256, 1000);
//! - scale: the same with 1,000,000 finished rows in the table, with a 1,000,000-job
//!   backlog (drained for a fixed time), and as a burst into a worker that idled on an
//!   empty table (its claim plan was cached for an empty table; no ANALYZE since); the
//!   small table runs again at the end, and comparisons use the mean of both runs;
//! - history: the headline drain beside 7 days of finished jobs (1,000,000 a day, each day
//!   its own table as retention keeps them; 200,000 a day with `--quick`), between two
//!   runs beside none (issue 37's target: within 5 %);
//! - held snapshot: a backlog (1,000,000 jobs; 300,000 with `--quick`) drained clean, then
//!   again while another session holds a REPEATABLE READ snapshot with an xid for the
//!   whole drain, with the rate over time in 5-second windows;
//! - the floor: the same claim and complete statements (`jobs_claim_batch`,
//!   `jobs_complete_many`) in bare loops on 1, 2 or 4 connections, no worker runtime.
//!
//! Rates are counted in the database: jobs that succeeded divided by the time from the first
//! `claimed_at` to the last `finished_at`. Each statement has its own `now()`, so the
//! number of distinct timestamps is the number of claim and complete statements. Commits
//! come from `pg_stat_database` of the bench's own database; WAL bytes from
//! `pg_current_wal_lsn()`, which is server-wide (other databases' writes count too), as are
//! full-page images (`pg_stat_wal`) and backend evictions (`pg_stat_bgwriter`). CPU per job
//! is read from `/proc`: every Postgres process (exited backends through the postmaster's
//! reaped-children times) and this process, where the worker runs. On a machine with steal
//! time, CPU per job is steadier than a rate.
//!
//! `cargo bench --bench drain -- --quick` (or `SKIPLOCK_BENCH_QUICK=1`); `--only
//! headline,floor` runs some sections: `matrix`, `headline` (with the prefetch tuning),
//! `scale` (runs the headline too), `history`, `held` and `floor`. `--observed` runs every worker
//! with an event subscriber and a Prometheus recorder installed (compare with a run
//! without it; the recorder is process-wide, so the two are separate invocations).
//! `--max-running N` gives the default queue a global limit of N running jobs.

mod support;

use std::time::{Duration, Instant};

use skiplock::Worker;
use skiplock::builtin::Noop;
use skiplock::db::jobs::{jobs_claim_batch, jobs_complete_many};
use sqlx::Connection;
use support::{
    BenchDb, Costs, DrainCfg, DrainRun, Drained, Opts, Table, WORKER_APP_NAME, WorkerThread,
    drain_noop, progress, rate, thousands,
};

/// Concurrency the library uses when none is set.
fn default_concurrency() -> usize {
    skiplock::WorkerConfig::default().concurrency
}

#[tokio::main]
async fn main() {
    let opts = Opts::parse();
    let metrics = opts.flag("observed").then(support::observe);
    let db = BenchDb::create("drain").await;
    support::print_header("Drain: noop jobs", &db, &opts).await;
    // `--max-running N`: the default queue gets a global limit (issue 40's target: set
    // far above the slots in use, the drain keeps 90 % of its rate without).
    if let Some(n) = opts.value("max-running") {
        let n: i32 = n.parse().expect("--max-running takes a number");
        sqlx::query("SELECT skiplock.set_queue_limits('default', $1)")
            .bind(n)
            .execute(&db.pool)
            .await
            .expect("set the default queue's max_running");
        println!("The default queue has max_running = {n}.");
    }

    let sizes: &[i64] = if opts.quick {
        &[100_000]
    } else {
        &[100_000, 1_000_000]
    };
    let cap = Duration::from_secs(if opts.quick { 10 } else { 60 });
    let mut matrix = Table::new(&[
        "jobs",
        "conc.",
        "drained",
        "db secs",
        "jobs/s",
        "wall s",
        "jobs/claim",
        "jobs/complete",
        "max running",
        "commits/job",
        "WAL B/job",
        "FPI/1k jobs",
        "reads/1k jobs",
        "evictions/1k jobs",
        "PG CPU µs/job",
        "worker CPU µs/job",
    ]);
    let mut best_runtime = 0.0f64;
    let only = opts
        .value("only")
        .map(|o| o.split(',').map(str::to_owned).collect::<Vec<_>>());
    let wants = |section: &str| only.as_ref().is_none_or(|o| o.iter().any(|s| s == section));
    let sizes = if wants("matrix") { sizes } else { &[] };
    for &n in sizes {
        for c in [1, 16, 64, 256] {
            progress(format!("drain {n} jobs at concurrency {c}"));
            let run = drain_fresh(
                &db,
                n,
                DrainCfg {
                    concurrency: Some(c),
                    ..DrainCfg::capped(cap)
                },
            )
            .await;
            best_runtime = best_runtime.max(run.drained.rate());
            matrix.row(row(&thousands(n), &c.to_string(), &run));
        }
    }

    // The headline: 200,000 jobs, default settings.
    let headline_n = 200_000;
    let headline = if wants("headline") || wants("scale") {
        progress(format!(
            "headline: drain {headline_n} jobs with default settings (concurrency {})",
            default_concurrency()
        ));
        let headline =
            drain_fresh(&db, headline_n, DrainCfg::capped(Duration::from_secs(120))).await;
        best_runtime = best_runtime.max(headline.drained.rate());
        Some(headline)
    } else {
        None
    };
    let scale_section = match headline.as_ref().filter(|_| wants("scale")) {
        None => None,
        Some(headline) => {
            // Scale scenarios, each against the small-table rate; the small table runs again at
            // the end and the comparison uses the mean of both runs, so a neighbour's load that
            // comes or goes during the section shows as a gap between the two.
            let mut scale_runs: Vec<(String, DrainRun)> = vec![(
                format!("{} queued (small table)", thousands(headline_n)),
                (*headline).clone(),
            )];

            // 1,000,000 finished rows under the same 200,000 queued jobs.
            progress(format!(
                "scale: {headline_n} queued jobs over 1,000,000 finished rows"
            ));
            db.reset().await;
            db.preload_finished(1_000_000).await;
            let history_end = db.max_id().await;
            db.preload_noop(headline_n).await;
            let finished = drain_noop(
                &db,
                DrainCfg {
                    after_id: history_end,
                    ..DrainCfg::capped(Duration::from_secs(120))
                },
            )
            .await;
            report(&finished);
            scale_runs.push((
                format!("{} queued + 1,000,000 finished", thousands(headline_n)),
                finished.clone(),
            ));

            // A 1,000,000-job backlog, drained for a fixed time.
            let backlog_cap = Duration::from_secs(if opts.quick { 10 } else { 40 });
            progress(format!(
                "scale: 1,000,000-job backlog, drained for {backlog_cap:?}"
            ));
            let backlog = drain_fresh(&db, 1_000_000, DrainCfg::capped(backlog_cap)).await;
            scale_runs.push((
                format!("1,000,000 backlog (first {backlog_cap:?})"),
                backlog.clone(),
            ));

            // A worker that idled on an empty table, then a burst it has to drain.
            let burst_cap = Duration::from_secs(if opts.quick { 30 } else { 60 });
            progress(format!(
                "scale: worker idle 8 s on an empty table, then {headline_n} jobs at once (no ANALYZE)"
            ));
            let burst = burst_after_idle(&db, headline_n, Duration::from_secs(8), burst_cap).await;
            report(&burst);
            scale_runs.push((
                format!(
                    "{} inserted at once into a worker idle on an empty table",
                    thousands(headline_n)
                ),
                burst.clone(),
            ));

            progress(format!("scale: {headline_n} queued (small table), again"));
            let again =
                drain_fresh(&db, headline_n, DrainCfg::capped(Duration::from_secs(120))).await;
            best_runtime = best_runtime.max(again.drained.rate());
            scale_runs.push((
                format!("{} queued (small table), again", thousands(headline_n)),
                again.clone(),
            ));
            let base = (headline.drained.rate() + again.drained.rate()) / 2.0;
            let mut scale = Table::new(&[
                "scenario",
                "conc.",
                "drained",
                "db secs",
                "jobs/s",
                "vs. small table (mean of 2)",
                "jobs/claim",
                "jobs/complete",
                "max running",
                "commits/job",
                "WAL B/job",
                "FPI/1k jobs",
                "reads/1k jobs",
                "evictions/1k jobs",
                "PG CPU µs/job",
                "worker CPU µs/job",
            ]);
            for (name, run) in &scale_runs {
                let r = row("", &default_concurrency().to_string(), run);
                let mut cells = vec![name.clone()];
                cells.extend_from_slice(&r[1..5]);
                cells.push(format!("{:+.1} %", pct(run.drained.rate(), base)));
                cells.extend_from_slice(&r[6..]);
                scale.row(cells);
            }
            let targets = format!(
                "Targets (issue 6): 200,000 noop jobs with default settings ≥ 60,000/s (measured {} \
                 and {}); 1M backlog / 1M finished within 10 % of the small table (measured {:+.1} % / \
                 {:+.1} % against the mean of both small-table runs).",
                rate(headline.drained.rate()),
                rate(again.drained.rate()),
                pct(backlog.drained.rate(), base),
                pct(finished.drained.rate(), base),
            );
            Some((scale, targets))
        }
    };

    let history_section = if wants("history") {
        let per_day: i64 = if opts.quick { 200_000 } else { 1_000_000 };
        let days = 7;
        let cap = DrainCfg::capped(Duration::from_secs(120));
        progress(format!("history: {headline_n} queued, no history"));
        let before = drain_fresh(&db, headline_n, cap).await;
        progress(format!(
            "history: {headline_n} queued beside {days} days of {} finished jobs",
            thousands(per_day)
        ));
        db.reset().await;
        db.preload_finished_days(days, per_day).await;
        let history_end = db.max_id().await;
        db.preload_noop(headline_n).await;
        let beside = drain_noop(
            &db,
            DrainCfg {
                after_id: history_end,
                ..cap
            },
        )
        .await;
        report(&beside);
        progress(format!("history: {headline_n} queued, no history, again"));
        let after = drain_fresh(&db, headline_n, cap).await;
        let base = (before.drained.rate() + after.drained.rate()) / 2.0;
        let mut table = Table::new(&[
            "scenario",
            "conc.",
            "drained",
            "db secs",
            "jobs/s",
            "vs. no history (mean of 2)",
            "jobs/claim",
            "jobs/complete",
            "max running",
            "commits/job",
            "WAL B/job",
            "FPI/1k jobs",
            "reads/1k jobs",
            "evictions/1k jobs",
            "PG CPU µs/job",
            "worker CPU µs/job",
        ]);
        for (name, run) in [
            (
                format!("{} queued, no history", thousands(headline_n)),
                &before,
            ),
            (
                format!(
                    "{} queued + {days} days × {} finished",
                    thousands(headline_n),
                    thousands(per_day)
                ),
                &beside,
            ),
            (
                format!("{} queued, no history, again", thousands(headline_n)),
                &after,
            ),
        ] {
            let r = row("", &default_concurrency().to_string(), run);
            let mut cells = vec![name];
            cells.extend_from_slice(&r[1..5]);
            cells.push(format!("{:+.1} %", pct(run.drained.rate(), base)));
            cells.extend_from_slice(&r[6..]);
            table.row(cells);
        }
        Some(table)
    } else {
        None
    };

    let held_section = if wants("held") {
        Some(held_snapshot_section(&db, if opts.quick { 300_000 } else { 1_000_000 }).await)
    } else {
        None
    };

    let mut tuning = None;
    if let Some(headline) = headline.as_ref().filter(|_| wants("headline")) {
        // Tuning that needs no code change: a larger local buffer, so claims are batches.
        let mut table = Table::new(&[
            "settings",
            "conc.",
            "drained",
            "db secs",
            "jobs/s",
            "wall s",
            "jobs/claim",
            "jobs/complete",
            "max running",
            "commits/job",
            "WAL B/job",
            "FPI/1k jobs",
            "reads/1k jobs",
            "evictions/1k jobs",
            "PG CPU µs/job",
            "worker CPU µs/job",
        ]);
        table.row(row(
            &format!("defaults ({} jobs, above)", thousands(headline_n)),
            &default_concurrency().to_string(),
            headline,
        ));
        let prefetches: &[usize] = if opts.quick { &[1000] } else { &[256, 1000] };
        for &prefetch in prefetches {
            progress(format!(
                "tuning: drain {headline_n} jobs, concurrency {}, prefetch {prefetch}",
                default_concurrency()
            ));
            let run = drain_fresh(
                &db,
                headline_n,
                DrainCfg {
                    prefetch: Some(prefetch),
                    ..DrainCfg::capped(Duration::from_secs(if opts.quick { 60 } else { 120 }))
                },
            )
            .await;
            best_runtime = best_runtime.max(run.drained.rate());
            table.row(row(
                &format!("prefetch {prefetch}"),
                &default_concurrency().to_string(),
                &run,
            ));
        }
        tuning = Some(table);
    }

    let mut best_floor = 0.0f64;
    let mut floor_table = None;
    if wants("floor") {
        // The floor: the claim and complete statements in bare loops.
        let floor_n: i64 = if opts.quick { 50_000 } else { 200_000 };
        let floor_loops: &[usize] = if opts.quick { &[1, 2] } else { &[1, 2, 4] };
        let mut table = Table::new(&[
            "batch",
            "connections",
            "jobs",
            "db secs",
            "jobs/s",
            "claim ms/stmt",
            "complete ms/stmt",
            "commits/job",
            "WAL B/job",
            "FPI/1k jobs",
            "reads/1k jobs",
            "evictions/1k jobs",
            "PG CPU µs/job",
            "client CPU µs/job",
        ]);
        for batch in [100i64, 1000] {
            for &loops in floor_loops {
                progress(format!(
                    "floor: batch {batch} on {loops} connection(s), {floor_n} jobs"
                ));
                db.reset().await;
                db.preload_noop(floor_n).await;
                let f = floor(&db, batch, loops).await;
                progress(format!(
                    "  {} jobs/s; claim {:.2} ms, complete {:.2} ms per statement",
                    thousands(f.drained.rate() as i64),
                    f.claim_ms,
                    f.complete_ms
                ));
                best_floor = best_floor.max(f.drained.rate());
                table.row(
                    vec![
                        batch.to_string(),
                        loops.to_string(),
                        thousands(f.drained.jobs),
                        format!("{:.2}", f.drained.secs),
                        rate(f.drained.rate()),
                        format!("{:.2}", f.claim_ms),
                        format!("{:.2}", f.complete_ms),
                    ]
                    .into_iter()
                    .chain(cost_cells(&f.costs, f.drained.jobs))
                    .collect(),
                );
            }
        }
        floor_table = Some(table);
    }

    if wants("matrix") {
        println!("### Matrix (time cap {cap:?} per run)");
        println!();
        matrix.print();
    }
    if let Some((scale, _)) = &scale_section {
        println!("### Scale: finished rows and backlog (default settings)");
        println!();
        scale.print();
    }
    if let Some(history) = &history_section {
        println!("### History: the headline drain beside days of finished jobs kept");
        println!();
        history.print();
    }
    if let Some(held) = &held_section {
        println!("### Held snapshot: a backlog drained while another session holds a snapshot");
        println!();
        held.print();
    }
    if let Some(tuning) = &tuning {
        println!("### Tuning without code changes: prefetch (default settings otherwise)");
        println!();
        tuning.print();
    }
    if let Some(floor_table) = &floor_table {
        println!("### Floor: claim + complete statements in bare loops, no worker runtime");
        println!();
        floor_table.print();
        println!(
            "Best worker rate {} is {:.0} % of the best floor rate {}.",
            rate(best_runtime),
            if best_floor > 0.0 {
                best_runtime / best_floor * 100.0
            } else {
                0.0
            },
            rate(best_floor)
        );
    }
    if let Some((_, targets)) = &scale_section {
        println!("{targets}");
    }
    if let Some(metrics) = metrics {
        // Proof that the recorder saw the jobs: the succeeded counters it holds.
        let rendered = metrics.render();
        let counted: f64 = rendered
            .lines()
            .filter(|line| line.starts_with("skiplock_jobs_total{") && line.contains("succeeded"))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        println!("Observed: the recorder counted {counted} succeeded jobs; every event was read.");
    }
    println!();
    db.drop_database().await;
}

fn pct(x: f64, base: f64) -> f64 {
    if base > 0.0 {
        (x / base - 1.0) * 100.0
    } else {
        0.0
    }
}

fn report(run: &DrainRun) {
    progress(format!(
        "  {} jobs in {:.2} s (db) = {}; wall {:.2} s{}; {:.1} jobs/claim, {:.1} jobs/complete, \
         at most {} running, {:.3} commits/job, {:.0} WAL B/job, Postgres CPU {:.1} µs/job, \
         worker CPU {:.1} µs/job; summary {:?}",
        thousands(run.drained.jobs),
        run.drained.secs,
        rate(run.drained.rate()),
        run.wall_secs,
        run.note(),
        run.drained.jobs as f64 / run.drained.claim_statements.max(1) as f64,
        run.drained.jobs as f64 / run.drained.complete_statements.max(1) as f64,
        thousands(run.max_running),
        run.per_job(run.costs.commits),
        run.per_job(run.costs.wal_bytes),
        run.costs.postgres_cpu_secs * 1e6 / run.drained.jobs.max(1) as f64,
        run.costs.own_cpu_secs * 1e6 / run.drained.jobs.max(1) as f64,
        run.summary
    ));
}

fn row(n: &str, c: &str, run: &DrainRun) -> Vec<String> {
    [n.to_owned(), c.to_owned()]
        .into_iter()
        .chain(support::drained_cells(run))
        .chain([thousands(run.max_running)])
        .chain(cost_cells(&run.costs, run.drained.jobs))
        .collect()
}

/// The cost columns of a table row: commits, WAL bytes, full-page images, blocks read,
/// evictions by backends, CPU of Postgres and of the worker (or bare loop), per job.
fn cost_cells(costs: &Costs, jobs: i64) -> Vec<String> {
    let per = |x: f64| x / jobs.max(1) as f64;
    vec![
        format!("{:.3}", per(costs.commits as f64)),
        format!("{:.0}", per(costs.wal_bytes as f64)),
        format!("{:.0}", per(costs.fpi as f64) * 1000.0),
        format!("{:.0}", per(costs.blocks_read as f64) * 1000.0),
        format!("{:.0}", per(costs.backend_writes as f64) * 1000.0),
        format!("{:.1}", per(costs.postgres_cpu_secs) * 1e6),
        format!("{:.1}", per(costs.own_cpu_secs) * 1e6),
    ]
}

/// Drains a backlog of `n` jobs clean and then with a snapshot held through the drain
/// (default settings, capped at 5 minutes each); the table gives each rate, the held
/// run's share of the clean one, and the rate in 5-second windows.
async fn held_snapshot_section(db: &BenchDb, n: i64) -> Table {
    let cap = Duration::from_secs(300);
    let mut table = Table::new(&[
        "scenario",
        "drained",
        "db secs",
        "jobs/s",
        "of clean",
        "jobs/s in 5 s windows",
        "WAL B/job",
        "PG CPU µs/job",
    ]);
    let mut clean_rate = None;
    for hold in [false, true] {
        let what = if hold { "snapshot held" } else { "clean" };
        progress(format!("held: drain {} jobs, {what}", thousands(n)));
        let run = drain_fresh(
            db,
            n,
            DrainCfg {
                hold_snapshot: hold,
                ..DrainCfg::capped(cap)
            },
        )
        .await;
        let windows = support::rate_over_time(db, 0, 5.0).await;
        let rate_now = run.drained.rate();
        let base = *clean_rate.get_or_insert(rate_now);
        let cells = cost_cells(&run.costs, run.drained.jobs);
        table.row(vec![
            format!("{} jobs, {what}{}", thousands(n), run.note()),
            thousands(run.drained.jobs),
            format!("{:.2}", run.drained.secs),
            rate(rate_now),
            format!("{:.0} %", 100.0 * rate_now / base),
            windows
                .iter()
                .map(|r| format!("{:.0}k", r / 1000.0))
                .collect::<Vec<_>>()
                .join(" "),
            cells[1].clone(),
            cells[5].clone(),
        ]);
    }
    table
}

/// Empties the table, preloads `jobs` queued `noop` jobs, drains them with `cfg` and
/// prints the run.
async fn drain_fresh(db: &BenchDb, jobs: i64, cfg: DrainCfg) -> DrainRun {
    db.reset().await;
    db.preload_noop(jobs).await;
    let run = drain_noop(db, cfg).await;
    report(&run);
    run
}

/// A worker with default settings starts on an empty table (statistics of an empty table,
/// as after a fresh migration) and idles for `idle`, so its claim statement is planned,
/// and after five executions cached as a generic plan, for an empty table. Then `n` jobs
/// arrive in one statement; the worker drains them (until none is left or `cap`).
async fn burst_after_idle(db: &BenchDb, n: i64, idle: Duration, cap: Duration) -> DrainRun {
    db.reset().await;
    let before = db.counters().await;
    let mut worker = WorkerThread::spawn(db, |pool| {
        Worker::builder(pool)
            .register::<Noop>()
            .build()
            .expect("worker")
    });
    tokio::time::sleep(idle).await;
    db.preload_noop_unanalyzed(n).await;
    let started = Instant::now();
    let mut max_running = 0i64;
    let mut last_report = Instant::now();
    let mut capped = false;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (queued, running): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state = 'queued'),
                    count(*) FILTER (WHERE state = 'running')
             FROM skiplock.jobs WHERE state IN ('queued', 'running')",
        )
        .fetch_one(&db.pool)
        .await
        .expect("progress");
        max_running = max_running.max(running);
        if queued + running == 0 {
            break;
        }
        if started.elapsed() >= cap {
            progress(format!(
                "  time cap of {cap:?} reached; stopping the worker"
            ));
            capped = true;
            break;
        }
        if last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            progress(format!(
                "  {:.0} s: {queued} queued, {running} running",
                started.elapsed().as_secs_f64()
            ));
        }
    }
    let wall_secs = started.elapsed().as_secs_f64();
    let summary = worker.stop().await;
    if summary.is_none() {
        db.terminate_worker_backends().await;
    }
    db.wait_workers_gone().await;
    let after = db.counters().await;
    DrainRun {
        drained: db.drained_since(0).await,
        wall_secs,
        capped,
        killed: summary.is_none(),
        max_running,
        costs: Costs::between(db, &before, &after).await,
        summary,
    }
}

/// A floor run's numbers.
struct Floor {
    drained: Drained,
    claim_ms: f64,
    complete_ms: f64,
    costs: Costs,
}

/// Claims `batch` jobs and completes them, in a loop, on `loops` connections at once,
/// until nothing is left.
async fn floor(db: &BenchDb, batch: i64, loops: usize) -> Floor {
    let before = db.counters().await;
    let mut tasks = Vec::new();
    for _ in 0..loops {
        let options = db.connect_options().application_name(WORKER_APP_NAME);
        tasks.push(tokio::spawn(async move {
            let mut conn = sqlx::PgConnection::connect_with(&options)
                .await
                .expect("connect");
            let kinds = vec!["noop".to_owned()];
            let (mut claim, mut complete, mut statements) = (Duration::ZERO, Duration::ZERO, 0u32);
            loop {
                let t = Instant::now();
                let jobs = jobs_claim_batch(&mut conn, "default", &kinds, batch, "floor")
                    .await
                    .expect("claim");
                claim += t.elapsed();
                if jobs.is_empty() {
                    break;
                }
                let (ids, tokens): (Vec<i64>, Vec<uuid::Uuid>) =
                    jobs.iter().map(|j| (j.id, j.claim_token)).unzip();
                let t = Instant::now();
                jobs_complete_many(&mut conn, &ids, &tokens)
                    .await
                    .expect("complete");
                complete += t.elapsed();
                statements += 1;
            }
            let _ = conn.close().await;
            (claim, complete, statements)
        }));
    }
    let (mut claim, mut complete, mut statements) = (Duration::ZERO, Duration::ZERO, 0u32);
    for task in tasks {
        let (a, b, n) = task.await.expect("floor task");
        claim += a;
        complete += b;
        statements += n;
    }
    db.wait_workers_gone().await;
    let after = db.counters().await;
    let costs = Costs::between(db, &before, &after).await;
    let n = f64::from(statements.max(1));
    Floor {
        drained: db.drained_since(0).await,
        claim_ms: claim.as_secs_f64() * 1000.0 / n,
        complete_ms: complete.as_secs_f64() * 1000.0 / n,
        costs,
    }
}
