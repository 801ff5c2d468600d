//! `skiplock work`: a worker for the built-in kinds.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use skiplock::builtin::{Noop, Sleep};
use skiplock::{ShutdownHandle, Worker};

#[derive(Args)]
pub struct WorkArgs {
    /// Queue to claim from; repeat for several (default: default).
    #[arg(long = "queue", value_name = "Q")]
    queues: Vec<String>,

    /// Jobs run at once.
    #[arg(long, default_value_t = skiplock::worker::CONCURRENCY_DEFAULT)]
    concurrency: usize,

    /// Exit (status 0) once no job of this worker's kinds and queues is runnable or running.
    #[arg(long)]
    exit_when_idle: bool,

    /// Seconds a graceful shutdown waits for running jobs before releasing them.
    #[arg(long, value_name = "SECONDS", default_value_t = skiplock::worker::SHUTDOWN_GRACE_DEFAULT.as_secs())]
    shutdown_grace: u64,
}

impl WorkArgs {
    /// Connections the worker needs: claims, heartbeats, completions, the listener,
    /// maintenance, with headroom.
    pub fn pool_size(&self) -> u32 {
        8
    }
}

pub async fn run(pool: sqlx::PgPool, args: WorkArgs) -> anyhow::Result<()> {
    let mut builder = Worker::builder(pool)
        .register::<Noop>()
        .register::<Sleep>()
        .concurrency(args.concurrency)
        .exit_when_idle(args.exit_when_idle)
        .shutdown_grace(Duration::from_secs(args.shutdown_grace));
    if !args.queues.is_empty() {
        builder = builder.queues(args.queues);
    }
    let worker = builder.build().context("invalid worker settings")?;
    tokio::spawn(forward_signals(worker.shutdown_handle()));
    let summary = worker.run().await.context("worker failed")?;
    eprintln!(
        "worker done: {} claimed, {} succeeded, {} failed, {} released",
        summary.claimed, summary.succeeded, summary.failed, summary.released
    );
    Ok(())
}

/// First SIGINT/SIGTERM: graceful shutdown. Second: release everything now.
async fn forward_signals(handle: ShutdownHandle) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut interrupt), Ok(mut terminate)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        tracing::error!("cannot install signal handlers; stop the worker with SIGKILL");
        return;
    };
    for round in 0..2 {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        if round == 0 {
            tracing::info!("signal received: finishing running jobs (signal again to stop now)");
            handle.shutdown();
        } else {
            tracing::warn!("second signal: releasing all jobs now");
            handle.shutdown_now();
        }
    }
}
