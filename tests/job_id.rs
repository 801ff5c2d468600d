//! `JobId` in sqlx is an `i64` under another name: it binds as `bigint`, decodes from one,
//! and a slice or `Vec` of ids binds as `bigint[]`, so a user's own queries on
//! `skiplock.jobs` take the ids skiplock hands out without unwrapping them.

mod common;

use common::test_db;
use skiplock::JobId;
use sqlx::PgPool;

/// Inserts `n` jobs of kind `kind` with plain SQL and returns their ids, as `i64`.
async fn insert_jobs(pool: &PgPool, kind: &str, n: i64) -> Vec<i64> {
    sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args) \
         SELECT $1, jsonb_build_object('n', n) FROM generate_series(1, $2) AS n \
         RETURNING id",
    )
    .bind(kind)
    .bind(n)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[test]
fn converts_to_and_from_i64() {
    assert_eq!(JobId::from(42), JobId(42));
    assert_eq!(i64::from(JobId(42)), 42);
    let id: JobId = 7_i64.into();
    let back: i64 = id.into();
    assert_eq!((id.0, back), (7, 7));
}

/// A `JobId` binds as a `bigint` parameter and decodes from the `bigint` column `id`.
#[tokio::test]
async fn binds_and_decodes_as_bigint() {
    let db = test_db().await;
    let pool = &db.pool;
    let ids = insert_jobs(pool, "job_id_bind", 3).await;

    let id: JobId = sqlx::query_scalar("SELECT id FROM skiplock.jobs WHERE args = '{\"n\": 2}'")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(id, JobId(ids[1]));

    let (kind, args): (String, serde_json::Value) =
        sqlx::query_as("SELECT kind, args FROM skiplock.jobs WHERE id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        (kind.as_str(), args),
        ("job_id_bind", serde_json::json!({"n": 2}))
    );

    // The parameter's type is `bigint` itself, not text or numeric that Postgres casts.
    let bound_as: String = sqlx::query_scalar("SELECT pg_typeof($1)::text")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(bound_as, "bigint");

    // In a row with other columns, and as a NULL.
    let (row_id, state): (JobId, String) =
        sqlx::query_as("SELECT id, state::text FROM skiplock.jobs WHERE id = $1")
            .bind(JobId(ids[0]))
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!((row_id, state.as_str()), (JobId(ids[0]), "queued"));
    let none: Option<JobId> = sqlx::query_scalar("SELECT NULL::bigint")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(none, None);
}

/// A `Vec<JobId>` and a `&[JobId]` bind as `bigint[]` (for `id = ANY($1)`), and a
/// `bigint[]` decodes into a `Vec<JobId>`.
#[tokio::test]
async fn arrays_bind_and_decode_as_bigint_arrays() {
    let db = test_db().await;
    let pool = &db.pool;
    let ids: Vec<JobId> = insert_jobs(pool, "job_id_array", 5)
        .await
        .into_iter()
        .map(JobId::from)
        .collect();
    let chosen = vec![ids[0], ids[3], ids[4]];

    let bound_as: String = sqlx::query_scalar("SELECT pg_typeof($1)::text")
        .bind(&chosen)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(bound_as, "bigint[]");

    let found: Vec<JobId> =
        sqlx::query_scalar("SELECT id FROM skiplock.jobs WHERE id = ANY($1) ORDER BY id")
            .bind(&chosen[..])
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(found, chosen);

    let deleted = sqlx::query("DELETE FROM skiplock.jobs WHERE id = ANY($1)")
        .bind(chosen.clone())
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(deleted.rows_affected(), 3);

    let left: Vec<JobId> = sqlx::query_scalar(
        "SELECT array_agg(id ORDER BY id) FROM skiplock.jobs WHERE kind = 'job_id_array'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(left, vec![ids[1], ids[2]]);
}
