//! [`PgBouncer`]: statements through PgBouncer's transaction pooling, for an application's
//! own pool, and the mechanism under the worker's PgBouncer mode ([`DbPool`]).
//!
//! Behind PgBouncer's transaction pooling, a client keeps one server connection only for
//! the length of a transaction. sqlx runs a statement with bound values in two protocol
//! round trips (Parse/Describe/Sync, then Bind/Execute/Sync), each ending in a
//! `ReadyForQuery`; outside a transaction PgBouncer may hand the second to another server
//! connection, where the unnamed statement does not exist (SQLSTATE 26000). Named
//! statements, which sqlx caches per client connection, break across transactions: the
//! next transaction may run on a server connection that does not have them (26000), and
//! another client that numbered its statements the same way finds them taken (42P05).
//! PgBouncer 1.18, the version Debian 12 ships, does not track them. So every statement
//! goes inside a transaction (or a savepoint of the caller's) and is unnamed.
//!
//! sqlx's `statement_cache_capacity(0)` is no way out: sqlx 0.9 still names each statement
//! it prepares (`sqlx_s_N`), and with no cache it never closes them.
//!
//! [`DbPool`]: crate::pool::DbPool

use futures_util::future::BoxFuture;
use futures_util::stream::{self, BoxStream, StreamExt, TryStreamExt};
use sqlx::postgres::{PgArguments, PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Connection, Either, Execute, Executor, PgConnection, PgPool, Postgres};

/// The `BEGIN` of each statement's transaction in PgBouncer mode, which pins the
/// isolation that direct connections pin for the session (`pool::SESSION_PINNED`).
pub(crate) const BEGIN_PINNED: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// A pool or a connection whose statements go through PgBouncer in transaction-pooling
/// mode: an executor for skiplock's functions (and for your own statements) there.
///
/// Each statement runs unnamed, in a transaction of its own (on a pool, or a connection
/// outside a transaction) or in a savepoint of the caller's transaction (`&mut *tx`), so it
/// never leaves a prepared statement behind on a server connection that PgBouncer then
/// gives to another client. Without it, skiplock's statements on such a pool fail with
/// `prepared statement "sqlx_s_1" already exists` or `does not exist`, or `unnamed
/// prepared statement does not exist`. The price is two more round trips per statement
/// (`BEGIN ISOLATION LEVEL READ COMMITTED`, the level skiplock's statements are written
/// for, and `COMMIT`; or `SAVEPOINT` and `RELEASE` in your transaction, at its level); a
/// failed statement in your transaction rolls back to its savepoint and leaves the
/// transaction usable.
/// [`Executor::prepare`] and [`Executor::describe`] fail through it: sqlx makes them named
/// statements.
///
/// Needed with PgBouncer before 1.21, or with `max_prepared_statements = 0` (its default
/// before 1.24): from 1.21 on, with `max_prepared_statements` above 0, PgBouncer tracks
/// the named statements sqlx caches, and a plain `PgPool` works as it is. Not needed with
/// session pooling. A worker on such a pool says [`WorkerBuilder::pgbouncer`] instead.
///
/// PgBouncer also refuses the startup parameter `extra_float_digits`, which sqlx sends,
/// unless its `ignore_startup_parameters` lists it: connect with
/// `PgConnectOptions::extra_float_digits(None)`.
///
/// # Examples
///
/// ```no_run
/// use skiplock::{EnqueueOptions, JobId, PgBouncer};
/// use sqlx::postgres::{PgConnectOptions, PgPool};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct SendWelcome { user_id: i64 }
/// # impl skiplock::Job for SendWelcome {
/// #     const KIND: &'static str = "send_welcome";
/// #     async fn run(self, _: skiplock::JobContext) -> Result<(), skiplock::JobError> { Ok(()) }
/// # }
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let options: PgConnectOptions = "postgres://app@pgbouncer:6432/app".parse()?;
/// let pool = PgPool::connect_with(options.extra_float_digits(None)).await?;
///
/// // In your transaction: your statements unnamed, skiplock's through `PgBouncer`.
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO users (id) VALUES ($1)")
///     .bind(42_i64)
///     .persistent(false)
///     .execute(&mut *tx)
///     .await?;
/// let welcome = SendWelcome { user_id: 42 };
/// skiplock::enqueue(PgBouncer(&mut *tx), &welcome, EnqueueOptions::default()).await?;
/// tx.commit().await?;
///
/// // On the pool: each statement in a transaction of its own.
/// skiplock::cancel(PgBouncer(&pool), JobId(7)).await?;
/// # Ok(()) }
/// ```
///
/// [`WorkerBuilder::pgbouncer`]: crate::WorkerBuilder::pgbouncer
#[derive(Clone, Copy, Debug)]
pub struct PgBouncer<E>(pub E);

/// `Executor` for `PgBouncer<$target>`: each statement runs as `$run(target, query)` runs
/// it; `prepare` and `describe` are refused ([`refuse_named`]).
macro_rules! executor_through_pgbouncer {
    ($target:ty, $run:ident) => {
        impl<'c> Executor<'c> for PgBouncer<$target> {
            type Database = Postgres;

            fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, sqlx::Result<Step>>
            where
                'c: 'e,
                E: 'q + Execute<'q, Postgres>,
            {
                steps_stream($run(self.0, query))
            }

            fn fetch_optional<'e, 'q: 'e, E>(
                self,
                query: E,
            ) -> BoxFuture<'e, sqlx::Result<Option<PgRow>>>
            where
                'c: 'e,
                E: 'q + Execute<'q, Postgres>,
            {
                first_row($run(self.0, query))
            }

            fn prepare_with<'e>(
                self,
                sql: sqlx::SqlStr,
                parameters: &'e [PgTypeInfo],
            ) -> BoxFuture<'e, sqlx::Result<PgStatement>>
            where
                'c: 'e,
            {
                let _ = (sql, parameters);
                refuse_named()
            }

            fn describe<'e>(
                self,
                sql: sqlx::SqlStr,
            ) -> BoxFuture<'e, sqlx::Result<sqlx::Describe<Postgres>>>
            where
                'c: 'e,
            {
                let _ = sql;
                refuse_named()
            }
        }
    };
}

executor_through_pgbouncer!(&'c PgPool, in_pooled_transaction);
executor_through_pgbouncer!(&'c mut PgConnection, in_transaction);

/// What `prepare` and `describe` return through [`PgBouncer`]: sqlx makes both a named
/// statement, which stays on a server connection that PgBouncer then gives to other
/// clients. A statement runs unnamed through `PgBouncer` without being prepared first.
fn refuse_named<'e, T: 'e>() -> BoxFuture<'e, sqlx::Result<T>> {
    Box::pin(async {
        Err(sqlx::Error::Configuration(
            "skiplock::PgBouncer runs statements unnamed and does not prepare them: a named \
             statement would stay on a server connection that PgBouncer gives to other clients"
                .into(),
        ))
    })
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

/// Runs `query` unnamed on `connection`, inside a transaction of its own (opened with
/// [`BEGIN_PINNED`]) or, when the connection is in the caller's transaction, inside a
/// savepoint; returns every result step. The rows are collected before COMMIT (or
/// RELEASE): the statements skiplock runs return bounded batches.
///
/// One failure is retried: when a statement's result has a type this connection has not
/// met yet (skiplock's enums), sqlx looks it up with a simple query between Parse and
/// Bind, and a simple query destroys the unnamed statement, so Bind fails with SQLSTATE
/// 26000 before anything ran. The lookup is cached on the connection by then, so the
/// second attempt goes through; the savepoint is what lets it in the caller's
/// transaction, which the failure would otherwise have aborted.
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
        let mut tx = if connection.is_in_transaction() {
            connection.begin().await?
        } else {
            connection.begin_with(BEGIN_PINNED).await?
        };
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
