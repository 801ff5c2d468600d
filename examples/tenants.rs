//! Fair queueing between tenants: one tenant enqueues a backlog of 200 reports, another
//! tenant one report just after, and the second tenant's report starts among the first few
//! instead of after the 200.
//!
//! ```sh
//! cargo run --example tenants
//! ```
//!
//! The queue's `key_claimable` (here 4) lets at most that many due jobs of one
//! `concurrency_key` be claimable at once; the rest wait their turn (`held_for = 'fair'`),
//! and each goes behind what is queued when the key's queued jobs are taken. The same
//! setting from SQL: `INSERT INTO skiplock.queues (name, key_claimable) VALUES ('reports', 4)`;
//! from the CLI: `skiplock queue limit reports --key-claimable 4`.
//!
//! It needs a Postgres server: the one `DATABASE_URL` points at, or else the local one on
//! 127.0.0.1:5432 as user `postgres`, and works in a database of its own,
//! `skiplock_example_tenants`, created afresh at each run. It exits 1 unless the second
//! tenant's report started among the first 16 (four turns of the first tenant).

use std::error::Error;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use skiplock::{EnqueueOptions, Job, JobContext, JobError, QueueLimits, Worker};
use sqlx::postgres::{PgConnectOptions, PgPool};

/// How many of one tenant's reports may be claimable at once.
const TURN: u32 = 4;

#[derive(Serialize, Deserialize)]
struct Report {
    tenant: String,
    n: u32,
}

/// The tenants whose reports started, in the order they started.
#[derive(Default)]
struct Starts(Mutex<Vec<String>>);

impl Job for Report {
    const KIND: &'static str = "report";

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        if let Some(starts) = ctx.data::<Arc<Starts>>() {
            starts.0.lock().unwrap().push(self.tenant.clone());
        }
        tokio::time::sleep(Duration::from_millis(2)).await; // the report's work
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let pool = database("skiplock_example_tenants").await?;
    skiplock::migrate(&pool).await?;
    skiplock::set_queue_limits(&pool, "reports", QueueLimits::default().key_claimable(TURN))
        .await?;

    // The tenant is the job's concurrency key.
    let backlog: Vec<Report> = (1..=200)
        .map(|n| Report {
            tenant: "acme".to_owned(),
            n,
        })
        .collect();
    let for_acme = EnqueueOptions::new()
        .queue("reports")
        .concurrency_key("acme");
    skiplock::enqueue_many(&pool, &backlog, for_acme).await?;
    let small = Report {
        tenant: "globex".to_owned(),
        n: 1,
    };
    let for_globex = EnqueueOptions::new()
        .queue("reports")
        .concurrency_key("globex");
    skiplock::enqueue(&pool, &small, for_globex).await?;

    let starts = Arc::new(Starts::default());
    let worker = Worker::builder(pool.clone())
        .register::<Report>()
        .queues(["reports"])
        .concurrency(4)
        .data(starts.clone())
        .exit_when_idle(true)
        .build()?;
    let summary = worker.run().await?;
    pool.close().await;

    let order = starts.0.lock().unwrap().clone();
    let position = order.iter().position(|tenant| tenant == "globex");
    println!(
        "{} reports run; globex's report started {} (claim order alone: 201st)",
        summary.succeeded,
        position.map_or("never".to_owned(), |at| format!("#{}", at + 1))
    );
    // Within acme's turn (twice that while two claims let its reports go at once) and what
    // the claims in flight took besides; handlers start in parallel, so the order of the
    // first few varies from run to run (#5 to #8 seen).
    match position {
        Some(at) if at < 4 * TURN as usize && summary.succeeded == 201 => Ok(()),
        _ => Err("globex's report did not take its turn".into()),
    }
}

/// A pool on `name`, a database of this example's own, created afresh on the server
/// `DATABASE_URL` points at (default: the local one, as user `postgres`).
async fn database(name: &str) -> Result<PgPool, Box<dyn Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let server: PgConnectOptions = url.parse()?;
    let admin = PgPool::connect_with(server.clone()).await?;
    // `name` is this file's own constant, not input.
    for statement in [
        format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        format!("CREATE DATABASE {name}"),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&admin)
            .await?;
    }
    admin.close().await;
    Ok(PgPool::connect_with(server.database(name)).await?)
}
