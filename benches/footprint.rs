//! Footprint benchmark: peak resident memory of a worker at concurrency 256.
//!
//! Each measurement runs in a fresh process, so nothing earlier inflates the peak:
//!
//! - library: this bench re-runs itself as a child that builds a worker (default settings,
//!   concurrency 256, `exit_when_idle`) on the library API and drains the preloaded jobs;
//!   the child reports `VmHWM` (peak RSS) from `/proc/self/status`, and its RSS just before
//!   the worker started;
//! - binary: `skiplock work --concurrency 256 --exit-when-idle`, sampled from
//!   `/proc/<pid>/status` every 10 ms (only when the bench was built with the `cli` feature,
//!   which `cargo bench` does by default).
//!
//! Two loads: 100,000 `noop` jobs (a fast drain: the buffer and the completer's batches are
//! full) and 20,000 `sleep` jobs of 50 ms (256 handlers alive at once); half of each with
//! `--quick`. A worker still running after 60 s (20 s with `--quick`) is stopped.
//!
//! `cargo bench --bench footprint -- --quick` (or `SKIPLOCK_BENCH_QUICK=1`).

mod support;

use std::process::Stdio;
use std::time::Duration;

use skiplock::Worker;
use skiplock::builtin::{Noop, Sleep};
use support::{BenchDb, Opts, STOP_WAIT, Table, WORKER_POOL_SIZE, progress, rss_kib};

const CONCURRENCY: usize = 256;

/// Longest a measured worker may run before it is stopped (and killed [`STOP_WAIT`] later).
fn cap(quick: bool) -> Duration {
    Duration::from_secs(if quick { 20 } else { 60 })
}

fn main() {
    let opts = Opts::parse();
    if let Some(url) = opts.value("child") {
        child(url, cap(opts.quick));
        return;
    }
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(parent(opts));
}

/// The measured worker process: prints `RSS <before worker KiB> <peak KiB>`.
fn child(url: &str, cap: Duration) {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(WORKER_POOL_SIZE)
            .connect(url)
            .await
            .expect("child pool");
        let before = rss_kib(None).map_or(0, |(_, rss)| rss);
        let worker = Worker::builder(pool.clone())
            .register::<Noop>()
            .register::<Sleep>()
            .concurrency(CONCURRENCY)
            .exit_when_idle(true)
            .build()
            .expect("worker");
        let stop = worker.shutdown_handle();
        let mut run = tokio::spawn(worker.run());
        let summary = tokio::select! {
            joined = &mut run => Some(joined.expect("worker task").expect("worker run")),
            () = tokio::time::sleep(cap) => {
                eprintln!("child worker: time cap of {cap:?} reached; stopping it");
                stop.shutdown();
                tokio::select! {
                    joined = &mut run => Some(joined.expect("worker task").expect("worker run")),
                    () = tokio::time::sleep(STOP_WAIT) => None,
                }
            }
        };
        let peak = rss_kib(None).map_or(0, |(hwm, _)| hwm);
        eprintln!("child worker: {summary:?}");
        println!("RSS {before} {peak}");
        // A worker that did not stop is left to the process exit.
        std::process::exit(0);
    });
}

async fn parent(opts: Opts) {
    let db = BenchDb::create("footprint").await;
    support::print_header("Footprint: worker memory at concurrency 256", &db, &opts).await;
    let loads: [(&str, &str, i64); 2] = [
        (
            if opts.quick {
                "50,000 noop"
            } else {
                "100,000 noop"
            },
            "noop",
            if opts.quick { 50_000 } else { 100_000 },
        ),
        (
            "20,000 sleep 50 ms",
            "sleep",
            if opts.quick { 10_000 } else { 20_000 },
        ),
    ];
    let mut table = Table::new(&["process", "load", "RSS before worker MB", "peak RSS MB"]);
    for (name, kind, n) in loads {
        let args = if kind == "sleep" {
            "'{\"ms\": 50}'::jsonb"
        } else {
            "'{}'::jsonb"
        };

        progress(format!("library worker in a child process: {name}"));
        db.reset().await;
        db.preload_kind(kind, args, n).await;
        let exe = std::env::current_exe().expect("current exe");
        let mut child_args = vec!["--child", db.url.as_str()];
        if opts.quick {
            child_args.push("--quick");
        }
        let output = tokio::process::Command::new(exe)
            .args(child_args)
            .stderr(Stdio::inherit())
            .output()
            .await
            .expect("run child");
        let text = String::from_utf8_lossy(&output.stdout);
        let numbers: Vec<u64> = text
            .lines()
            .find_map(|l| l.strip_prefix("RSS "))
            .map(|l| {
                l.split_whitespace()
                    .filter_map(|v| v.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        let (before, peak) = (
            numbers.first().copied().unwrap_or(0),
            numbers.get(1).copied().unwrap_or(0),
        );
        progress(format!(
            "  before worker {:.1} MB, peak {:.1} MB; {} jobs left",
            mb(before),
            mb(peak),
            db.unfinished().await
        ));
        table.row(vec![
            "library worker (bench child)".into(),
            name.into(),
            format!("{:.1}", mb(before)),
            format!("{:.1}", mb(peak)),
        ]);

        match option_env!("CARGO_BIN_EXE_skiplock") {
            Some(bin) => {
                progress(format!("`skiplock work` binary: {name}"));
                db.reset().await;
                db.preload_kind(kind, args, n).await;
                let peak = sample_binary(bin, &db.url, cap(opts.quick)).await;
                progress(format!(
                    "  peak {:.1} MB; {} jobs left",
                    mb(peak),
                    db.unfinished().await
                ));
                table.row(vec![
                    "`skiplock work` binary".into(),
                    name.into(),
                    "-".into(),
                    format!("{:.1}", mb(peak)),
                ]);
            }
            None => progress("the skiplock binary was not built (no `cli` feature); skipped"),
        }
    }
    println!("### Peak RSS at concurrency {CONCURRENCY}");
    println!();
    table.print();
    println!("Target (issue 6): worker RSS at concurrency 256 ≤ 50 MB.");
    println!();
    db.drop_database().await;
}

/// Runs `skiplock work` until it exits and returns its peak RSS (KiB) as last sampled.
async fn sample_binary(bin: &str, url: &str, cap: Duration) -> u64 {
    let mut child = tokio::process::Command::new(bin)
        .args([
            "work",
            "--kinds",
            "noop,sleep",
            "--concurrency",
            &CONCURRENCY.to_string(),
            "--exit-when-idle",
        ])
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn skiplock work");
    let pid = child.id();
    let mut peak = 0;
    let started = std::time::Instant::now();
    loop {
        if started.elapsed() > cap + STOP_WAIT {
            progress(format!(
                "  skiplock work still running after {:?}; killing it",
                cap + STOP_WAIT
            ));
            let _ = child.kill().await;
            break;
        }
        if let Some((hwm, _)) = pid.and_then(|p| rss_kib(Some(p))) {
            peak = peak.max(hwm);
        }
        tokio::select! {
            status = child.wait() => {
                let status = status.expect("wait");
                if !status.success() {
                    progress(format!("  skiplock work exited with {status}"));
                }
                break;
            }
            () = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
    }
    peak
}

fn mb(kib: u64) -> f64 {
    kib as f64 / 1024.0
}
