//! [`DbPool`]: the pool skiplock runs its statements on, and whether it reaches Postgres
//! directly or through PgBouncer in transaction-pooling mode.
//!
//! Behind PgBouncer's transaction pooling, a client keeps one server connection only for
//! the length of a transaction. sqlx runs a statement with bound values in two protocol
//! round trips (Parse/Describe/Sync, then Bind/Execute/Sync), each ending in a
//! `ReadyForQuery`; outside a transaction PgBouncer may hand the second to another server
//! connection, where the unnamed statement does not exist (SQLSTATE 26000). Named
//! statements, which sqlx caches per client connection, break the same way across
//! transactions, and PgBouncer 1.18 does not track them. So in PgBouncer mode every
//! statement skiplock runs on its own goes inside `BEGIN … COMMIT` (which pins one server
//! connection) and is unnamed. The direct mode runs each statement as sqlx does: nothing
//! is added to its path.

use std::future::Future;
use std::ops::DerefMut;

use futures_util::future::BoxFuture;
use futures_util::stream::{self, BoxStream, StreamExt, TryStreamExt};
use sqlx::postgres::{PgArguments, PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Connection, Either, Execute, Executor, PgConnection, PgPool, Postgres};

/// A Postgres pool and how it reaches the server. Pass `&db` wherever skiplock (or sqlx)
/// takes an executor: `skiplock::enqueue(&db, &job)`.
///
/// Made from a [`PgPool`] with [`DbPool::direct`] (or `From<PgPool>`), or with
/// [`DbPool::pgbouncer`] when the pool's URL points at PgBouncer in transaction-pooling
/// mode: then each statement runs in a transaction of its own, unnamed, which costs two
/// more round trips (BEGIN and COMMIT) per statement. Session pooling needs no special
/// mode. Cloning is cheap (the pool is reference-counted).
///
/// # Examples
///
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://app@pgbouncer:6432/app").await?;
/// let db = skiplock::DbPool::pgbouncer(pool);
/// skiplock::enqueue_raw(&db, &[skiplock::NewJob::new("noop", serde_json::json!({}))]).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct DbPool {
    pool: PgPool,
    pgbouncer: bool,
}

impl DbPool {
    /// A pool connected straight to Postgres (or through PgBouncer in session mode).
    pub fn direct(pool: PgPool) -> Self {
        Self {
            pool,
            pgbouncer: false,
        }
    }

    /// A pool whose connections go through PgBouncer in transaction-pooling mode.
    pub fn pgbouncer(pool: PgPool) -> Self {
        Self {
            pool,
            pgbouncer: true,
        }
    }

    /// The sqlx pool underneath. Statements run on it directly (not through `&DbPool`)
    /// are not protected behind PgBouncer: run them inside a transaction, with
    /// `.persistent(false)`.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether statements are wrapped for PgBouncer's transaction pooling.
    pub fn is_pgbouncer(&self) -> bool {
        self.pgbouncer
    }

    /// Takes one connection from the pool, which runs statements in the same mode.
    pub(crate) async fn acquire(
        &self,
    ) -> sqlx::Result<DbConnection<sqlx::pool::PoolConnection<Postgres>>> {
        Ok(DbConnection {
            connection: self.pool.acquire().await?,
            pgbouncer: self.pgbouncer,
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

/// A query taken apart so that it can run again: its text and bound values, run unnamed.
/// An unnamed statement lives only until the next Parse on its server connection, so it
/// cannot clash with (or depend on) statements of other clients PgBouncer gave that
/// connection to. `arguments: None` is the simple query protocol, as for `raw_sql`.
struct Unnamed {
    sql: sqlx::SqlStr,
    arguments: Option<PgArguments>,
}

impl<'q> Execute<'q, Postgres> for Unnamed {
    fn sql(self) -> sqlx::SqlStr {
        self.sql
    }

    fn statement(&self) -> Option<&PgStatement> {
        None
    }

    fn take_arguments(&mut self) -> Result<Option<PgArguments>, sqlx::error::BoxDynError> {
        Ok(self.arguments.take())
    }

    fn persistent(&self) -> bool {
        false
    }
}

type Step = Either<PgQueryResult, PgRow>;

/// Runs `query` unnamed inside a transaction of its own on `connection` and returns every
/// result step. The rows are collected before COMMIT: the statements skiplock runs this
/// way return bounded batches.
///
/// One failure is retried: when a statement's result has a type this connection has not
/// met yet (skiplock's enums), sqlx looks it up with a simple query between Parse and
/// Bind, and a simple query destroys the unnamed statement, so Bind fails with SQLSTATE
/// 26000 before anything ran. The lookup is cached on the connection by then, so the
/// second attempt goes through.
async fn in_transaction<'q, E>(
    connection: &mut PgConnection,
    mut query: E,
) -> sqlx::Result<Vec<Step>>
where
    E: 'q + Execute<'q, Postgres>,
{
    let arguments = query.take_arguments().map_err(sqlx::Error::Encode)?;
    let sql = query.sql();
    let mut retried = false;
    loop {
        let mut tx = connection.begin().await?;
        let unnamed = Unnamed {
            sql: sql.clone(),
            arguments: arguments.clone(),
        };
        match tx.fetch_many(unnamed).try_collect().await {
            Ok(steps) => {
                tx.commit().await?;
                return Ok(steps);
            }
            Err(sqlx::Error::Database(e)) if !retried && e.code().as_deref() == Some("26000") => {
                retried = true;
            }
            Err(e) => return Err(e),
        }
    }
}

/// [`in_transaction`] on a connection taken from `pool` for the statement.
async fn in_pooled_transaction<'q, E>(pool: &PgPool, query: E) -> sqlx::Result<Vec<Step>>
where
    E: 'q + Execute<'q, Postgres>,
{
    in_transaction(&mut *pool.acquire().await?, query).await
}

/// The steps of a statement run by [`in_transaction`], as the stream `fetch_many` returns.
fn steps_stream<'e>(
    steps: impl Future<Output = sqlx::Result<Vec<Step>>> + Send + 'e,
) -> BoxStream<'e, sqlx::Result<Step>> {
    stream::once(steps)
        .map_ok(|steps| stream::iter(steps.into_iter().map(Ok)))
        .try_flatten()
        .boxed()
}

/// The first row of a statement run by [`in_transaction`], if any.
fn first_row<'e>(
    steps: impl Future<Output = sqlx::Result<Vec<Step>>> + Send + 'e,
) -> BoxFuture<'e, sqlx::Result<Option<PgRow>>> {
    Box::pin(async move { Ok(steps.await?.into_iter().find_map(|step| step.right())) })
}

impl<'c> Executor<'c> for &'c DbPool {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, sqlx::Result<Step>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if !self.pgbouncer {
            return self.pool.fetch_many(query);
        }
        steps_stream(in_pooled_transaction(&self.pool, query))
    }

    fn fetch_optional<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, sqlx::Result<Option<PgRow>>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if !self.pgbouncer {
            return self.pool.fetch_optional(query);
        }
        first_row(in_pooled_transaction(&self.pool, query))
    }

    fn prepare_with<'e>(
        self,
        sql: sqlx::SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, sqlx::Result<PgStatement>>
    where
        'c: 'e,
    {
        self.pool.prepare_with(sql, parameters)
    }

    fn describe<'e>(
        self,
        sql: sqlx::SqlStr,
    ) -> BoxFuture<'e, sqlx::Result<sqlx::Describe<Postgres>>>
    where
        'c: 'e,
    {
        self.pool.describe(sql)
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
        steps_stream(in_transaction(&mut self.connection, query))
    }

    fn fetch_optional<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, sqlx::Result<Option<PgRow>>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if !self.pgbouncer {
            return (&mut *self.connection).fetch_optional(query);
        }
        first_row(in_transaction(&mut self.connection, query))
    }

    fn prepare_with<'e>(
        self,
        sql: sqlx::SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, sqlx::Result<PgStatement>>
    where
        'c: 'e,
    {
        (&mut *self.connection).prepare_with(sql, parameters)
    }

    fn describe<'e>(
        self,
        sql: sqlx::SqlStr,
    ) -> BoxFuture<'e, sqlx::Result<sqlx::Describe<Postgres>>>
    where
        'c: 'e,
    {
        (&mut *self.connection).describe(sql)
    }
}
