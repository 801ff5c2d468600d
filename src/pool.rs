//! [`DbPool`]: the pool skiplock runs its statements on, and whether it reaches Postgres
//! directly or through PgBouncer in transaction-pooling mode. In PgBouncer mode every
//! statement runs as the public [`PgBouncer`] executor runs it (src/pgbouncer.rs says why):
//! unnamed, in a transaction of its own. The direct mode runs each statement as sqlx does:
//! nothing is added to its path.
//!
//! # Pinned sessions
//!
//! Whatever the database's or role's defaults say (`ALTER DATABASE … SET`, `ALTER ROLE …
//! SET`), skiplock's own statements run with the settings of [`SESSION_PINNED`]: sent as
//! startup options on a direct connection ([`pin_session`]: no extra round trip), and in
//! PgBouncer mode (where PgBouncer refuses or drops startup options) by the `BEGIN` that
//! opens each statement's transaction. A pooler found in front of a pool said to be direct
//! (it refuses or drops those startup options) switches the pool to PgBouncer mode
//! ([`DbPool::pin_sessions`]).

use std::ops::DerefMut;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use sqlx::postgres::{PgConnectOptions, PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{
    ConnectOptions, Connection, Either, Execute, Executor, PgConnection, PgPool, Postgres, Row,
};

pub(crate) use crate::pgbouncer::BEGIN_PINNED;
use crate::pgbouncer::PgBouncer;

/// The session settings skiplock's correctness relies on, pinned on every session it opens
/// whatever the database's or role's defaults say. Each one, and why:
///
/// - `default_transaction_isolation = 'read committed'`: the claim is `FOR UPDATE SKIP
///   LOCKED`, and outcome writes and heartbeats update rows other workers' claims walk
///   past. Under `serializable` (a database default some teams set) they fail with
///   serialization failures: two workers drained 20,000 no-op jobs 10.9 times slower, with
///   failed claims, outcome writes and heartbeats (and heartbeats failing long enough let
///   live jobs be reaped); `repeatable read` fails the same way on concurrent updates.
///   Every statement's correctness argument (fencing by `claim_token`, lanes by a unique
///   index) is made at READ COMMITTED.
///
/// Deliberately not pinned (docs/operating.md, "Production Postgres"):
///
/// - `statement_timeout`, `lock_timeout`, `idle_in_transaction_session_timeout`: the bounds
///   a DBA sets protect the database, and skiplock works within them: its hot statements are
///   short, its transactions never wait on the client, and the statements that legitimately
///   run long (migrations, bulk pruning) set their own bound.
/// - `default_transaction_read_only`: a database made read-only by its owner (or a hot
///   standby) must refuse skiplock's writes; the worker waits and retries instead of
///   writing against the owner's intent.
/// - `synchronous_commit`: how durable a commit is stays the owner's choice.
pub(crate) const SESSION_PINNED: [(&str, &str); 1] =
    [("default_transaction_isolation", "read committed")];

/// A startup option of no meaning to Postgres that [`pin_session`] sends with the others:
/// a session that cannot read it back did not get its startup options (a pooler in front
/// dropped them).
const PINNED_MARKER: (&str, &str) = ("skiplock.session_pinned", "on");

/// `options` with [`SESSION_PINNED`] as startup options (sent in the startup packet, so no
/// extra round trip). Options already in `options` stay; the pinned ones come after them
/// and win. Pinning twice adds nothing.
///
/// Direct connections only: PgBouncer refuses startup options it does not know (`options`
/// among them) unless its `ignore_startup_parameters` lists them, and then drops them. In
/// PgBouncer mode skiplock pins the isolation per transaction instead.
pub(crate) fn pin_session(options: PgConnectOptions) -> PgConnectOptions {
    let marker = format!("{}={}", PINNED_MARKER.0, PINNED_MARKER.1);
    if options
        .get_options()
        .is_some_and(|given| given.contains(&marker))
    {
        return options;
    }
    options.options(SESSION_PINNED.into_iter().chain([PINNED_MARKER]))
}

/// What a connection with [`pin_session`]'s options found between skiplock and Postgres.
#[derive(Debug)]
pub(crate) enum Reach {
    /// Postgres itself: the startup options took effect.
    Direct,
    /// A pooler (PgBouncer) that refused or dropped the startup options; what it did.
    Pooler(String),
    /// The connection failed for another reason (the server down, a bad password).
    Unknown(sqlx::Error),
}

/// Opens one connection with [`pin_session`]'s options and reads back [`PINNED_MARKER`]:
/// Postgres applies startup options; PgBouncer refuses them (`unsupported startup
/// parameter: options`, SQLSTATE 08P01) or, when `ignore_startup_parameters` lists
/// `options`, drops them. Deterministic, one connection, closed at once. Poolers that
/// forward startup options (so that a session really has them) are not told apart from
/// Postgres; behind those in transaction mode the worker needs PgBouncer mode said
/// explicitly.
pub(crate) async fn probe_reach(options: &PgConnectOptions) -> Reach {
    let pinned = pin_session(options.clone());
    let mut connection = match pinned.connect().await {
        Ok(connection) => connection,
        Err(sqlx::Error::Database(e))
            if e.code().as_deref() == Some("08P01")
                && e.message().contains("unsupported startup parameter") =>
        {
            return Reach::Pooler(format!("it refused the startup options: {}", e.message()));
        }
        Err(e) => return Reach::Unknown(e),
    };
    // The simple query protocol: no prepared statement, whatever is in between.
    let marker = sqlx::raw_sql("SELECT current_setting('skiplock.session_pinned', true)")
        .fetch_one(&mut connection)
        .await
        .and_then(|row| row.try_get::<Option<String>, _>(0));
    let _ = connection.close().await;
    match marker {
        Ok(Some(value)) if value == PINNED_MARKER.1 => Reach::Direct,
        Ok(_) => Reach::Pooler("it dropped the startup options".to_owned()),
        Err(e) => Reach::Unknown(e),
    }
}

/// A Postgres pool and how it reaches the server: `&DbPool` is an executor for every
/// statement the runtime (and the `skiplock` binary) runs. Not part of the API: an
/// application gives [`Worker::builder`](crate::Worker::builder) a `PgPool` and says
/// [`pgbouncer(true)`](crate::WorkerBuilder::pgbouncer).
///
/// Made from a [`PgPool`] with [`DbPool::direct`] (or `From<PgPool>`), or with
/// [`DbPool::pgbouncer`] when the pool's URL points at PgBouncer in transaction-pooling
/// mode: then each statement runs as through [`PgBouncer`], in a transaction of its own,
/// unnamed, which costs two more round trips (BEGIN and COMMIT) per statement. Session pooling needs no special
/// mode. Cloning is cheap (the pool is reference-counted).

#[derive(Clone, Debug)]
pub struct DbPool {
    pool: PgPool,
    /// Shared by the clones: [`DbPool::pin_sessions`] may switch a direct pool to
    /// PgBouncer mode once, before the worker's tasks start.
    pgbouncer: Arc<AtomicBool>,
}

impl DbPool {
    /// A pool connected straight to Postgres (or through PgBouncer in session mode).
    pub fn direct(pool: PgPool) -> Self {
        Self {
            pool,
            pgbouncer: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A pool whose connections go through PgBouncer in transaction-pooling mode.
    pub fn pgbouncer(pool: PgPool) -> Self {
        Self {
            pool,
            pgbouncer: Arc::new(AtomicBool::new(true)),
        }
    }

    /// The sqlx pool underneath. Statements run on it directly (not through `&DbPool`)
    /// are not protected behind PgBouncer: run them through [`PgBouncer`], or inside a
    /// transaction with `.persistent(false)`.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether statements are wrapped for PgBouncer's transaction pooling.
    pub fn is_pgbouncer(&self) -> bool {
        self.pgbouncer.load(Ordering::Relaxed)
    }

    /// Makes the sessions the worker opens on this pool run with [`SESSION_PINNED`], and
    /// switches a direct pool that turns out to reach Postgres through a pooler to
    /// PgBouncer mode, with one warning that says how to make it explicit. A worker calls
    /// it when it starts, before its tasks do; the `skiplock` binary for every command.
    ///
    /// Direct: the pool's connect options get [`pin_session`]'s startup options (so do the
    /// heartbeat's and the listener's sessions, opened with them), and the connections the
    /// pool already holds idle are closed so that none runs unpinned. A connection that
    /// the application holds at this moment returns to the pool unpinned; it is rare (the
    /// worker has not started) and harmless to correctness beyond a retried statement.
    /// PgBouncer mode needs nothing: each statement's `BEGIN` pins the isolation.
    ///
    /// The options are those of the pool the application gave, so its own statements on
    /// that pool (`ctx.pool()` in handlers) run READ COMMITTED too; a transaction that
    /// needs more says so (`BEGIN ISOLATION LEVEL SERIALIZABLE`), or the worker gets a
    /// pool of its own.
    ///
    /// Costs one connection, opened and closed at once.
    pub async fn pin_sessions(&self) {
        if self.is_pgbouncer() {
            return;
        }
        let options = self.pool.connect_options();
        match probe_reach(&options).await {
            Reach::Pooler(what) => {
                self.pgbouncer.store(true, Ordering::Relaxed);
                tracing::warn!(
                    "the database is reached through a connection pooler ({what}); running in \
                     PgBouncer mode (each statement in a transaction of its own, unnamed; no \
                     LISTEN without a direct URL). Say so to silence this: `skiplock work \
                     --pgbouncer` (SKIPLOCK_PGBOUNCER=true), or `WorkerBuilder::pgbouncer(true)`"
                );
            }
            reach => {
                // Unknown: the server did not answer; pinned options are right for
                // Postgres, and the first statement on the pool reports the failure.
                if let Reach::Unknown(error) = reach {
                    tracing::debug!(%error, "cannot look for a pooler in front of the database");
                }
                self.pool
                    .set_connect_options(pin_session((*options).clone()));
                while let Some(idle) = self.pool.try_acquire() {
                    let _ = idle.close().await;
                }
            }
        }
    }

    /// Takes one connection from the pool, which runs statements in the same mode.
    pub(crate) async fn acquire(
        &self,
    ) -> sqlx::Result<DbConnection<sqlx::pool::PoolConnection<Postgres>>> {
        Ok(DbConnection {
            connection: self.pool.acquire().await?,
            pgbouncer: self.is_pgbouncer(),
        })
    }
}

impl From<PgPool> for DbPool {
    fn from(pool: PgPool) -> Self {
        Self::direct(pool)
    }
}

/// One connection (pooled or owned) that runs statements in its pool's mode: `&mut
/// DbConnection` is an executor.
#[derive(Debug)]
pub(crate) struct DbConnection<C> {
    connection: C,
    pgbouncer: bool,
}

impl<C> DbConnection<C> {
    /// Wraps an owned connection (the heartbeat's) in the given mode.
    pub(crate) fn new(connection: C, pgbouncer: bool) -> Self {
        Self {
            connection,
            pgbouncer,
        }
    }

    /// The connection itself.
    pub(crate) fn into_inner(self) -> C {
        self.connection
    }
}

type Step = Either<PgQueryResult, PgRow>;

impl<'c> Executor<'c> for &'c DbPool {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, sqlx::Result<Step>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if !self.is_pgbouncer() {
            return self.pool.fetch_many(query);
        }
        PgBouncer(&self.pool).fetch_many(query)
    }

    fn fetch_optional<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, sqlx::Result<Option<PgRow>>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if !self.is_pgbouncer() {
            return self.pool.fetch_optional(query);
        }
        PgBouncer(&self.pool).fetch_optional(query)
    }

    fn prepare_with<'e>(
        self,
        sql: sqlx::SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, sqlx::Result<PgStatement>>
    where
        'c: 'e,
    {
        if !self.is_pgbouncer() {
            return self.pool.prepare_with(sql, parameters);
        }
        PgBouncer(&self.pool).prepare_with(sql, parameters)
    }

    fn describe<'e>(
        self,
        sql: sqlx::SqlStr,
    ) -> BoxFuture<'e, sqlx::Result<sqlx::Describe<Postgres>>>
    where
        'c: 'e,
    {
        if !self.is_pgbouncer() {
            return self.pool.describe(sql);
        }
        PgBouncer(&self.pool).describe(sql)
    }
}

impl<'c, C> Executor<'c> for &'c mut DbConnection<C>
where
    C: DerefMut<Target = PgConnection> + Send + std::fmt::Debug,
{
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, sqlx::Result<Step>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if !self.pgbouncer {
            return (&mut *self.connection).fetch_many(query);
        }
        PgBouncer(&mut *self.connection).fetch_many(query)
    }

    fn fetch_optional<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, sqlx::Result<Option<PgRow>>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if !self.pgbouncer {
            return (&mut *self.connection).fetch_optional(query);
        }
        PgBouncer(&mut *self.connection).fetch_optional(query)
    }

    fn prepare_with<'e>(
        self,
        sql: sqlx::SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, sqlx::Result<PgStatement>>
    where
        'c: 'e,
    {
        if !self.pgbouncer {
            return (&mut *self.connection).prepare_with(sql, parameters);
        }
        PgBouncer(&mut *self.connection).prepare_with(sql, parameters)
    }

    fn describe<'e>(
        self,
        sql: sqlx::SqlStr,
    ) -> BoxFuture<'e, sqlx::Result<sqlx::Describe<Postgres>>>
    where
        'c: 'e,
    {
        if !self.pgbouncer {
            return (&mut *self.connection).describe(sql);
        }
        PgBouncer(&mut *self.connection).describe(sql)
    }
}
