//! Drain through PgBouncer: the same preloaded `noop` backlog drained by a worker with
//! default settings connected directly, and through PgBouncer 1.18 in transaction-pooling
//! mode (the worker in its PgBouncer mode: every statement in BEGIN … COMMIT, unnamed,
//! LISTEN replaced by polling) with as many server connections as the worker's pool, and
//! with two. The runs alternate (direct, PgBouncer, PgBouncer with two, and again) so
//! that a busy machine weighs on all of them alike.
//!
//! Rates are counted in the database as in `benches/drain.rs`: jobs that succeeded over
//! the time from the first claim to the last completion. Commits per job come from
//! `pg_stat_database` (a wrapped statement is its own transaction).
//!
//! `cargo bench --bench pgbouncer` (100,000 jobs per run, two rounds); `--quick`: 20,000
//! jobs, one round. Needs `/usr/sbin/pgbouncer` (`apt-get install pgbouncer`).

#[allow(dead_code)] // `options`: the drain builds its own from the port
#[path = "../tests/common/pgbouncer.rs"]
mod pgbouncer;
mod support;

use std::time::Duration;

use pgbouncer::PgBouncer;
use support::{
    BenchDb, DrainCfg, Opts, Table, WORKER_POOL_SIZE, drain_noop, progress, rate, thousands,
};

#[tokio::main]
async fn main() {
    let opts = Opts::parse();
    if !PgBouncer::installed() {
        eprintln!(
            "{} is missing: apt-get install pgbouncer",
            pgbouncer::PGBOUNCER
        );
        std::process::exit(1);
    }
    let db = BenchDb::create("pgbouncer").await;
    support::print_header("Drain through PgBouncer (transaction pooling)", &db, &opts).await;
    let (jobs, rounds): (i64, usize) = if opts.quick {
        (20_000, 1)
    } else {
        (100_000, 2)
    };
    let cap = Duration::from_secs(300);
    let server = db.connect_options();
    // (path, server connections, the PgBouncer in between)
    let paths = [
        ("direct", WORKER_POOL_SIZE, None),
        (
            "PgBouncer",
            WORKER_POOL_SIZE,
            Some(PgBouncer::start(&server, WORKER_POOL_SIZE).await),
        ),
        ("PgBouncer", 2, Some(PgBouncer::start(&server, 2).await)),
    ];
    let mut table = Table::new(&[
        "path",
        "server conns",
        "round",
        "drained",
        "db secs",
        "jobs/s",
        "wall s",
        "jobs/claim",
        "jobs/complete",
        "commits/job",
        "PG CPU µs/job",
        "worker CPU µs/job",
    ]);
    for round in 1..=rounds {
        for (path, server_conns, bouncer) in &paths {
            progress(format!(
                "round {round}: drain {jobs} jobs {path}, {server_conns} server connections"
            ));
            db.reset().await;
            db.preload_noop(jobs).await;
            let run = drain_noop(
                &db,
                DrainCfg {
                    pgbouncer_port: bouncer.as_ref().map(|b| b.port),
                    ..DrainCfg::capped(cap)
                },
            )
            .await;
            let d = &run.drained;
            let per_job = |x: f64| x / d.jobs.max(1) as f64;
            progress(format!("  {} = {}", thousands(d.jobs), rate(d.rate())));
            table.row(
                [
                    (*path).to_owned(),
                    server_conns.to_string(),
                    round.to_string(),
                ]
                .into_iter()
                .chain(support::drained_cells(&run))
                .chain([
                    format!("{:.3}", per_job(run.costs.commits as f64)),
                    format!("{:.1}", per_job(run.costs.postgres_cpu_secs) * 1e6),
                    format!("{:.1}", per_job(run.costs.own_cpu_secs) * 1e6),
                ])
                .collect(),
            );
        }
    }
    table.print();
    drop(paths);
    db.drop_database().await;
}
