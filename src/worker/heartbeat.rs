//! The heartbeat: one statement per interval extends every claim the worker holds (and the
//! jobs of claims still in flight, see [`ClaimInFlight`](super::claims::ClaimInFlight)),
//! and stops the handlers of claims the database no longer honours (reaped or cancelled).
//!
//! It runs on a thread of its own, with its own single-threaded runtime and its own
//! connection. On the application's runtime it could be starved: a handler that blocks its
//! runtime thread (synchronous I/O, a long computation) strands whatever task was woken on
//! that thread just before (tokio's LIFO slot, which no other thread may steal), and a
//! handler that does database work and then blocks wakes the next waiter for a pool
//! connection on its own thread, often the heartbeat. Claims then went stale and live jobs
//! were reaped and run twice. A busy pool (handlers using `ctx.pool()`) delayed beats the
//! same way. Its own connection costs one more session per worker; when it cannot be
//! opened, the beat goes through the worker's pool on the application's runtime until it
//! can. Behind PgBouncer in transaction mode the session goes through PgBouncer like the
//! pool, and each beat runs in a transaction of its own ([`DbConnection`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{ConnectOptions, Connection, PgConnection};
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::Shared;
use super::claims::ClaimKey;
use crate::db::jobs::{jobs_cancelled_among, jobs_heartbeat_many, jobs_release_many};
use crate::pool::DbConnection;

/// How long the heartbeat keeps its connection open with no claim to extend.
const CONNECTION_IDLE_MAX: Duration = Duration::from_secs(30);

/// Beats until `stop`. Keeps going through the graceful shutdown: running jobs still need
/// their claims extended while they finish.
pub(super) async fn beat(shared: Arc<Shared>, stop: CancellationToken) {
    let (done_tx, done_rx) = oneshot::channel::<()>();
    let application = Handle::current();
    let thread = {
        let (shared, stop) = (shared.clone(), stop.clone());
        std::thread::Builder::new()
            .name("skiplock-heartbeat".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                match runtime {
                    Ok(runtime) => runtime.block_on(beat_loop(shared, stop, Some(application))),
                    Err(e) => tracing::warn!(
                        error = %e,
                        "cannot start the heartbeat's runtime; beating on the worker's runtime"
                    ),
                }
                drop(done_tx);
            })
    };
    match thread {
        // The sender is dropped when the thread's loop ends (or could not start).
        Ok(_) => {
            let _ = done_rx.await;
            if !stop.is_cancelled() {
                beat_loop(shared, stop, None).await;
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the heartbeat thread; beating on the worker's runtime");
            beat_loop(shared, stop, None).await;
        }
    }
}

/// Runs `$body` (an expression using `$db`, a `PgExecutor`) where the heartbeat runs its
/// statements: on its own connection when it has one, else through the worker's pool, on
/// the application's runtime from the heartbeat's thread (a connection the pool opened
/// on this thread's runtime would break once it ends). Evaluates to the body's
/// `sqlx::Result`.
macro_rules! on_beat_session {
    ($shared:expr, $connection:expr, $application:expr, |$db:ident| $body:expr) => {
        match ($connection.as_mut(), $application) {
            (Some($db), _) => $body,
            (None, Some(application)) => {
                let $db = $shared.pool.clone();
                application
                    .spawn(async move {
                        let $db = &$db;
                        $body
                    })
                    .await
                    .unwrap_or_else(|e| Err(sqlx::Error::Protocol(e.to_string())))
            }
            (None, None) => {
                let $db = &$shared.pool;
                $body
            }
        }
    };
}

/// Gives back to the queue the claims whose job waited for a slot for longer than the
/// stale timeout (see [`HeldClaims::beat_list`](super::claims::HeldClaims::beat_list)):
/// released as at a graceful shutdown, the attempt not counted, the job in its place in
/// line. If the release fails the claim is no longer extended all the same, and the
/// reaper takes it back after the stale timeout.
async fn give_back(
    shared: &Shared,
    connection: &mut Option<DbConnection<Box<PgConnection>>>,
    application: &Option<Handle>,
    claims: Vec<ClaimKey>,
) {
    let (ids, tokens): (Vec<i64>, Vec<Uuid>) = claims.into_iter().unzip();
    let count = ids.len();
    let delays = vec![0; count];
    let released = on_beat_session!(shared, connection, application, |db| {
        jobs_release_many(db, &ids, &tokens, &delays).await
    });
    match released {
        Ok(released) => tracing::warn!(
            jobs = released.len(),
            waited_over = ?shared.config.stale_after,
            "claimed jobs waited too long for a slot in this worker; given back to the queue"
        ),
        Err(e) => tracing::warn!(
            error = %e,
            jobs = count,
            "could not give back jobs that waited too long for a slot; the reaper will take them back"
        ),
    }
}

/// The heartbeat's loop. On its own thread (`application` is the worker's runtime) it
/// beats on its own connection, opened again when needed, and through the worker's pool
/// on `application` while it cannot; without a thread (`None`) it beats through the pool.
async fn beat_loop(shared: Arc<Shared>, stop: CancellationToken, application: Option<Handle>) {
    let interval = shared.config.heartbeat_interval;
    // A beat that takes this long is abandoned with its connection (a server gone
    // without closing it, a failover): the next beat opens a fresh one in time to keep
    // claims from going stale.
    let beat_timeout = shared.config.stale_after / 2;
    // The pool's options, pinned when the worker started (`DbPool::pin_sessions`); in
    // PgBouncer mode each beat's BEGIN pins its isolation instead.
    let options = shared.pool.pool().connect_options();
    let pgbouncer = shared.pool.is_pgbouncer();
    let mut connection: Option<DbConnection<Box<PgConnection>>> = None;
    let mut last_beat = Instant::now();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = ticker.tick() => {}
        }
        // Claims in flight for a whole interval: their producer is late reading the reply
        // (stranded on a blocked thread, or the statement is slow); extend their jobs by
        // token meanwhile, for at most twice the stale timeout. Read before the held
        // claims: a claim that lands in between is then in one list or both, never in
        // neither.
        let in_flight = shared
            .claims
            .in_flight_for(interval, shared.config.stale_after.saturating_mul(2));
        let (ids, tokens, given_back) = shared.claims.beat_list(shared.config.stale_after);
        if !given_back.is_empty() {
            give_back(&shared, &mut connection, &application, given_back).await;
        }
        if ids.is_empty() && in_flight.is_empty() {
            // A quiet worker gives the session back; the next claim opens it again.
            if last_beat.elapsed() >= CONNECTION_IDLE_MAX
                && let Some(own) = connection.take()
            {
                let _ = (*own.into_inner()).close().await;
            }
            continue;
        }
        last_beat = Instant::now();
        if application.is_some() && connection.is_none() {
            match tokio::time::timeout(beat_timeout, options.connect()).await {
                Ok(Ok(opened)) => connection = Some(DbConnection::new(Box::new(opened), pgbouncer)),
                Ok(Err(e)) => tracing::warn!(
                    error = %e,
                    "cannot open the heartbeat's connection; beating through the worker's pool"
                ),
                Err(_) => tracing::warn!(
                    timeout = ?beat_timeout,
                    "opening the heartbeat's connection timed out; beating through the worker's pool"
                ),
            }
        }
        let outcome = match (connection.as_mut(), &application) {
            (Some(own), _) => {
                let beat = tokio::time::timeout(
                    beat_timeout,
                    jobs_heartbeat_many(own, &ids, &tokens, &in_flight),
                );
                match beat.await {
                    Ok(Ok(lost)) => Ok(lost),
                    Ok(Err(e)) => {
                        connection = None;
                        Err(e.to_string())
                    }
                    Err(_) => {
                        connection = None;
                        Err(format!("no reply within {beat_timeout:?}"))
                    }
                }
            }
            (None, Some(application)) => {
                let pool = shared.pool.clone();
                let (ids, tokens) = (ids.clone(), tokens.clone());
                let beat = application.spawn(async move {
                    jobs_heartbeat_many(&pool, &ids, &tokens, &in_flight).await
                });
                match beat.await {
                    Ok(result) => result.map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            }
            (None, None) => jobs_heartbeat_many(&shared.pool, &ids, &tokens, &in_flight)
                .await
                .map_err(|e| e.to_string()),
        };
        if let Ok(lost) = &outcome
            && !lost.is_empty()
        {
            let ids: Vec<i64> = lost.iter().map(|claim| claim.0).collect();
            // On the heartbeat's thread the pool is never used directly: a connection the
            // pool opened here would belong to this runtime and break once it ends.
            let cancelled = on_beat_session!(&shared, &mut connection, &application, |db| {
                jobs_cancelled_among(db, &ids).await
            });
            mark_cancelled(&shared, cancelled);
        }
        settle_beat(&shared, outcome, ids.len(), interval);
    }
    if let Some(own) = connection {
        let _ = (*own.into_inner()).close().await;
    }
}

/// Of the lost claims, those whose job was cancelled (`cancelled`) are stopped as the
/// cancel's notification would have stopped them (their outcome is `cancelled`, not lost):
/// the beat can find the claim gone before the notification arrives. If the database
/// could not say, they are reported lost.
fn mark_cancelled(shared: &Shared, cancelled: sqlx::Result<Vec<i64>>) {
    match cancelled {
        Ok(cancelled) => {
            for id in cancelled {
                for id in shared.claims.stop_job(id) {
                    tracing::info!(job_id = id, "job cancelled; stopping its handler");
                }
            }
        }
        Err(e) => tracing::debug!(error = %e, "could not tell cancelled claims from lost ones"),
    }
}

/// Stops the handlers of lost claims, or logs a failed beat (retried next interval).
fn settle_beat(
    shared: &Shared,
    outcome: Result<Vec<ClaimKey>, String>,
    jobs: usize,
    interval: Duration,
) {
    match outcome {
        Ok(lost) => {
            for id in shared.claims.stop_lost(&lost) {
                tracing::warn!(
                    job_id = id,
                    "claim lost (reaped or cancelled); stopping its handler"
                );
            }
        }
        Err(error) => {
            crate::metrics::heartbeat_failed();
            tracing::warn!(
                %error,
                jobs,
                retry_in = ?interval,
                "heartbeat failed; will retry next interval"
            );
        }
    }
}
