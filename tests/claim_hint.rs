//! The position the claimers of one group share (`share_position`, schema version 11): a
//! claim from a position starts where the group's last claim got to, without reading the
//! entries of what that claim took; and it follows a hint only while the hint names a job
//! that claim still holds, so a hint never makes a claim pass over a job it must take.

mod common;

use common::fixtures::{state_of, strings};
use common::test_db;
use skiplock::JobState;
use skiplock::db::jobs::{
    ClaimArgs, ClaimMode, ClaimPosition, ClaimedJob, FailAction, FailBatch, jobs_claim,
    jobs_claim_one, jobs_fail_many,
};
use sqlx::{Connection, PgConnection, PgPool};

/// How the worker claims on a cursor walk.
const SHARED: ClaimMode = ClaimMode {
    skip_in_flight: true,
    take_lanes: true,
    retry_lane_conflict: false,
    share_position: true,
};

/// Inserts `count` jobs of `kind` on `default`, all due at one time (so claim order is id
/// order), and returns their ids.
async fn insert(pool: &PgPool, kind: &str, count: i64) -> Vec<i64> {
    sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, scheduled_at)
         SELECT $1, '{}', '2026-01-01 00:00:00+00' FROM generate_series(1, $2)
         RETURNING id",
    )
    .bind(kind)
    .bind(count)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Claims up to `limit` jobs of `kinds` after `after` in `mode`.
async fn claim(
    db: &mut PgConnection,
    kinds: &[&str],
    limit: i64,
    after: Option<ClaimPosition>,
    mode: ClaimMode,
) -> Vec<ClaimedJob> {
    jobs_claim(
        db,
        &ClaimArgs {
            queues: &strings(&["default"]),
            kinds: &strings(kinds),
            limit,
            claimed_by: "w",
            after,
            claim_with: None,
            mode,
        },
    )
    .await
    .unwrap()
}

fn ids(jobs: &[ClaimedJob]) -> Vec<i64> {
    jobs.iter().map(|job| job.id).collect()
}

/// Claims in a transaction of its own and returns the jobs with the entries of
/// `jobs_claim_idx` the claim read.
async fn claim_counting_entries(
    conn: &mut PgConnection,
    after: ClaimPosition,
    mode: ClaimMode,
) -> (Vec<i64>, i64) {
    let mut tx = conn.begin().await.unwrap();
    let jobs = claim(&mut tx, &["k"], 10, Some(after), mode).await;
    let read: i64 = sqlx::query_scalar(
        "SELECT pg_stat_get_xact_tuples_returned('skiplock.jobs_claim_idx'::regclass)",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    (ids(&jobs), read)
}

/// One worker process claimed 500 jobs; another, whose own position is before them, starts
/// its next claim where that claim got to and reads a handful of index entries, where a
/// claim from its own position reads every entry of the 500 first.
#[tokio::test]
async fn a_cursor_walk_starts_where_its_groups_last_claim_got_to() {
    let db = test_db().await;
    let jobs = insert(&db.pool, "k", 600).await;
    let mut other = db.pool.acquire().await.unwrap();
    let mut this = db.pool.acquire().await.unwrap();

    let first = claim(&mut this, &["k"], 1, None, SHARED).await;
    assert_eq!(ids(&first), [jobs[0]]);
    let taken = claim(&mut other, &["k"], 500, Some(first[0].position()), SHARED).await;
    assert_eq!(ids(&taken), jobs[1..501]);

    let (claimed, read) = claim_counting_entries(&mut this, first[0].position(), SHARED).await;
    assert_eq!(
        claimed,
        jobs[501..511],
        "the next jobs after the other claim's"
    );
    assert!(read <= 20, "{read} index entries read");

    let own_position = ClaimMode {
        share_position: false,
        ..SHARED
    };
    let (claimed, read) =
        claim_counting_entries(&mut this, first[0].position(), own_position).await;
    assert_eq!(claimed, jobs[511..521]);
    assert!(
        read >= 510,
        "from its own position: {read} index entries read"
    );
}

/// A claim in flight (not committed) has written its hint, and a claim beside it starts
/// there rather than stepping over the rows it holds.
#[tokio::test]
async fn a_hint_of_a_claim_in_flight_is_followed() {
    let db = test_db().await;
    let jobs = insert(&db.pool, "k", 600).await;
    let mut writer = db.pool.acquire().await.unwrap();
    let mut this = db.pool.acquire().await.unwrap();
    let first = claim(&mut this, &["k"], 1, None, SHARED).await;

    let mut in_flight = writer.begin().await.unwrap();
    let taken = claim(
        &mut in_flight,
        &["k"],
        500,
        Some(first[0].position()),
        SHARED,
    )
    .await;
    assert_eq!(ids(&taken), jobs[1..501]);
    let (claimed, read) = claim_counting_entries(&mut this, first[0].position(), SHARED).await;
    assert_eq!(claimed, jobs[501..511]);
    assert!(read <= 20, "{read} index entries read");
    in_flight.commit().await.unwrap();
}

/// A claim that rolled back after writing its hint left its jobs queued: the next claim
/// takes them instead of starting where that claim got to.
#[tokio::test]
async fn a_hint_of_a_rolled_back_claim_is_not_followed() {
    let db = test_db().await;
    let jobs = insert(&db.pool, "k", 10).await;
    let mut writer = db.pool.acquire().await.unwrap();
    let mut this = db.pool.acquire().await.unwrap();
    let first = claim(&mut this, &["k"], 1, None, SHARED).await;

    let mut tx = writer.begin().await.unwrap();
    let rolled_back = claim(&mut tx, &["k"], 5, Some(first[0].position()), SHARED).await;
    assert_eq!(ids(&rolled_back), jobs[1..6]);
    tx.rollback().await.unwrap();
    let claimed = claim(&mut this, &["k"], 5, Some(first[0].position()), SHARED).await;
    assert_eq!(ids(&claimed), jobs[1..6]);
}

/// The hint names the last job of a claim, which is then retried to a time after every
/// other job (and, in the second round, claimed again there): at its new key it no longer
/// says where that claim got to, and the jobs between stay in reach.
#[tokio::test]
async fn a_hint_to_a_job_retried_since_is_not_followed() {
    for claimed_again in [false, true] {
        let db = test_db().await;
        let pool = &db.pool;
        let jobs = insert(pool, "k", 20).await;
        let mut writer = pool.acquire().await.unwrap();
        let mut this = pool.acquire().await.unwrap();
        let first = claim(&mut this, &["k"], 1, None, SHARED).await;

        let taken = claim(&mut writer, &["k"], 5, Some(first[0].position()), SHARED).await;
        assert_eq!(ids(&taken), jobs[1..6]);
        let last = &taken[4];
        let mut retry = FailBatch::default();
        retry.push(
            last.id,
            last.claim_token,
            "again".into(),
            0,
            FailAction::Retry,
        );
        jobs_fail_many(pool, &retry).await.unwrap();
        assert_eq!(state_of(pool, last.id).await, JobState::Queued);
        if claimed_again {
            let again = jobs_claim_one(pool, last.id, "w", uuid::Uuid::new_v4())
                .await
                .unwrap();
            assert_eq!(again[0].attempt, 2);
        }

        let claimed = claim(&mut this, &["k"], 2, Some(first[0].position()), SHARED).await;
        assert_eq!(ids(&claimed), jobs[6..8], "claimed again: {claimed_again}");
    }
}

/// A job moved by hand after its claim (here a running job made less urgent): its key is
/// no longer where that claim got to, and the next claim does not start there.
#[tokio::test]
async fn a_hint_to_a_job_moved_by_hand_is_not_followed() {
    let db = test_db().await;
    let pool = &db.pool;
    let jobs = insert(pool, "k", 10).await;
    let mut writer = pool.acquire().await.unwrap();
    let mut this = pool.acquire().await.unwrap();
    let first = claim(&mut this, &["k"], 1, None, SHARED).await;
    let taken = claim(&mut writer, &["k"], 3, Some(first[0].position()), SHARED).await;
    assert_eq!(ids(&taken), jobs[1..4]);
    sqlx::query("UPDATE skiplock.jobs SET priority = 100 WHERE id = $1")
        .bind(taken[2].id)
        .execute(pool)
        .await
        .unwrap();
    let claimed = claim(&mut this, &["k"], 3, Some(first[0].position()), SHARED).await;
    assert_eq!(ids(&claimed), jobs[4..7]);
}

/// A claim of several queues locks rows of each that it may not keep, past the last it
/// takes: it neither writes nor follows hints.
#[tokio::test]
async fn claims_of_several_queues_keep_no_hints() {
    let db = test_db().await;
    let pool = &db.pool;
    sqlx::query(
        "INSERT INTO skiplock.jobs (queue, kind, args, scheduled_at)
         SELECT q, 'k', '{}', '2026-01-01' FROM generate_series(1, 5), unnest(ARRAY['a', 'b']) q",
    )
    .execute(pool)
    .await
    .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let claimed = jobs_claim(
        &mut *conn,
        &ClaimArgs {
            queues: &strings(&["a", "b"]),
            kinds: &strings(&["k"]),
            limit: 4,
            claimed_by: "w",
            after: None,
            claim_with: None,
            mode: SHARED,
        },
    )
    .await
    .unwrap();
    assert_eq!(claimed.len(), 4);
    let written: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM generate_series(0, 15) AS slot
         WHERE pg_sequence_last_value(('skiplock.claim_hint_' || slot)::regclass) IS NOT NULL",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(written, 0);
}

/// Claimers of other kinds are another group: a claimer of `k` alone passes over the
/// `other` jobs among its own, and a claimer of both kinds does not start where it got to.
#[tokio::test]
async fn a_hint_of_another_group_is_not_followed() {
    let db = test_db().await;
    let pool = &db.pool;
    let mut mixed = Vec::new();
    for _ in 0..4 {
        mixed.extend(insert(pool, "k", 1).await);
        mixed.extend(insert(pool, "other", 1).await);
    }
    let mut k_only = pool.acquire().await.unwrap();
    let mut both = pool.acquire().await.unwrap();
    let first = claim(&mut both, &["k", "other"], 1, None, SHARED).await;
    assert_eq!(ids(&first), [mixed[0]]);

    let taken = claim(&mut k_only, &["k"], 10, Some(first[0].position()), SHARED).await;
    assert_eq!(ids(&taken), [mixed[2], mixed[4], mixed[6]]);
    let claimed = claim(
        &mut both,
        &["k", "other"],
        10,
        Some(first[0].position()),
        SHARED,
    )
    .await;
    assert_eq!(ids(&claimed), [mixed[1], mixed[3], mixed[5], mixed[7]]);
}

/// A role that may claim but not touch the hint sequences claims as before: nothing about
/// a hint fails a claim.
#[tokio::test]
async fn a_claimer_without_rights_on_the_hints_claims_without_them() {
    let db = test_db().await;
    let pool = &db.pool;
    let jobs = insert(pool, "k", 3).await;
    let role = format!("{}_worker", db.name);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {role};
         GRANT USAGE ON SCHEMA skiplock TO {role};
         GRANT SELECT, UPDATE ON ALL TABLES IN SCHEMA skiplock TO {role};"
    )))
    .execute(pool)
    .await
    .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SET ROLE {role}")))
        .execute(&mut *conn)
        .await
        .unwrap();
    let first = claim(&mut conn, &["k"], 1, None, SHARED).await;
    let rest = claim(&mut conn, &["k"], 5, Some(first[0].position()), SHARED).await;
    assert_eq!([ids(&first), ids(&rest)].concat(), jobs);
    sqlx::raw_sql("RESET ROLE")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP OWNED BY {role}; DROP ROLE {role};"
    )))
    .execute(pool)
    .await
    .unwrap();
}

/// The migration grants the hints to every role that may update `skiplock.jobs`.
#[tokio::test]
async fn the_migration_grants_the_hints_to_roles_that_update_jobs() {
    let db = test_db().await;
    let pool = &db.pool;
    let role = format!("{}_grantee", db.name);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {role};
         GRANT UPDATE ON skiplock.jobs TO {role};
         DROP SEQUENCE {};
         DELETE FROM skiplock.schema_migrations WHERE version = 11;",
        (0..16)
            .map(|slot| format!("skiplock.claim_hint_{slot}"))
            .collect::<Vec<_>>()
            .join(", ")
    )))
    .execute(pool)
    .await
    .unwrap();
    skiplock::migrate(pool).await.unwrap();
    let granted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM generate_series(0, 15) AS slot
         WHERE has_sequence_privilege($1, 'skiplock.claim_hint_' || slot, 'SELECT, UPDATE')",
    )
    .bind(&role)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(granted, 16);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP OWNED BY {role}; DROP ROLE {role};"
    )))
    .execute(pool)
    .await
    .unwrap();
}
