//! Fair queueing by concurrency key (`skiplock.queues.key_claimable`, issue 50 item 1):
//! at most `key_claimable` due jobs of one key are queued at once at each priority, the
//! rest wait their turn (`held_for = 'fair'`) and are let go behind what is queued when the
//! key's queued ones are claimed or cancelled. The tests claim on the SQL protocol, whose
//! order is the claim order, so the start order they check is exact; one drains with the
//! Rust worker. The insert and the claim that lets a key's jobs go take no lock on each
//! other: both orders of their commits are held open here, with no sweep running.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::fixtures::{
    Record, Recorder, fast_worker, sql_claim, state_of, wait_for, wait_for_a_lock_wait,
};
use common::test_db;
use skiplock::{EnqueueOptions, JobState, QueueLimits};
use sqlx::PgPool;

/// Claims batches of `batch` jobs of `queue` on the SQL protocol until a claim comes back
/// empty twice (the second claim lets go what the first left for it); returns the keys of
/// the jobs in the order they were claimed.
async fn claim_order(pool: &PgPool, queue: &str, batch: i32) -> Vec<String> {
    let mut order = Vec::new();
    let mut empty = 0;
    while empty < 2 {
        let claimed = sql_claim(pool, queue, batch, "fair-test").await;
        if claimed.is_empty() {
            empty += 1;
            continue;
        }
        empty = 0;
        let ids: Vec<i64> = claimed.iter().map(|(id, _)| *id).collect();
        let keys: Vec<String> = sqlx::query_scalar(
            "SELECT j.concurrency_key FROM unnest($1::bigint[]) WITH ORDINALITY AS c(id, n)
             JOIN skiplock.jobs j ON j.id = c.id ORDER BY c.n",
        )
        .bind(&ids)
        .fetch_all(pool)
        .await
        .unwrap();
        order.extend(keys);
    }
    order
}

/// Makes queue `q` fair, with `key_claimable` `turn`.
async fn fair_queue_q(pool: &PgPool, turn: i32) {
    sqlx::query("INSERT INTO skiplock.queues (name, key_claimable) VALUES ('q', $1)")
        .bind(turn)
        .execute(pool)
        .await
        .unwrap();
}

/// How many of `queue`'s jobs are in each state (held ones as `waiting/fair`).
async fn states(pool: &PgPool, queue: &str) -> HashMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>(
        "SELECT state::text || coalesce('/' || held_for, ''), count(*) FROM skiplock.jobs
         WHERE queue = $1 GROUP BY 1",
    )
    .bind(queue)
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

/// One key's backlog of 40, enqueued first, then five keys of three: the small keys'
/// first jobs (and all their jobs) are claimed before the big key's third, with
/// `skiplock.enqueue`, a plain `INSERT` and the Rust API as the writers; the same jobs in a
/// queue without key_claimable start the big key's 40 first. Nothing is left waiting.
#[tokio::test]
async fn keys_take_turns_and_a_backlog_delays_a_new_key_by_at_most_its_turn() {
    let db = test_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(pool, "fair", QueueLimits::default().key_claimable(2))
        .await
        .unwrap();
    for queue in ["fair", "fifo"] {
        sqlx::query(
            "SELECT skiplock.enqueue('noop', queue => $1, concurrency_key => 'big')
             FROM generate_series(1, 20)",
        )
        .bind(queue)
        .execute(pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
             SELECT 'noop', $1, 'big' FROM generate_series(1, 20)",
        )
        .bind(queue)
        .execute(pool)
        .await
        .unwrap();
        for small in 1..=5 {
            for _ in 0..3 {
                skiplock::enqueue(
                    pool,
                    &Record { n: small },
                    EnqueueOptions::new()
                        .queue(queue)
                        .concurrency_key(format!("small-{small}")),
                )
                .await
                .unwrap();
            }
        }
    }
    assert_eq!(
        states(pool, "fair").await,
        HashMap::from([
            ("queued".to_owned(), 2 + 5 * 2),
            ("waiting/fair".to_owned(), 38 + 5)
        ]),
        "two of each key queued, the rest waiting their turn"
    );
    let fair = claim_order(pool, "fair", 4).await;
    let fifo = claim_order(pool, "fifo", 4).await;
    assert_eq!(fair.len(), 55, "every job claimed once: {fair:?}");
    assert_eq!(fifo.len(), 55);
    let third_big = |order: &[String]| {
        order
            .iter()
            .enumerate()
            .filter(|(_, key)| *key == "big")
            .nth(2)
            .map(|(at, _)| at)
            .unwrap()
    };
    let first_small = |order: &[String], small: usize| {
        order
            .iter()
            .position(|key| *key == format!("small-{small}"))
            .unwrap()
    };
    for small in 1..=5 {
        assert!(
            first_small(&fair, small) < third_big(&fair),
            "small-{small} waits at most the big key's turn of 2: {fair:?}"
        );
        assert!(
            first_small(&fifo, small) > 39,
            "without key_claimable the backlog goes first: {fifo:?}"
        );
    }
    assert_eq!(
        states(pool, "fair").await,
        HashMap::from([("running".to_owned(), 55)]),
        "nothing left waiting"
    );
}

/// Claims `queue`'s jobs one at a time on the SQL protocol until `key`'s first job comes,
/// and returns how many claims came before it.
async fn claims_before(pool: &PgPool, queue: &str, key: &str) -> usize {
    for before in 0..100 {
        let claimed = sql_claim(pool, queue, 1, "fair-test").await;
        let (id, _) = claimed
            .first()
            .unwrap_or_else(|| panic!("{key}'s job never claimed; {before} claims before"));
        let claimed_key: String =
            sqlx::query_scalar("SELECT concurrency_key FROM skiplock.jobs WHERE id = $1")
                .bind(id)
                .fetch_one(pool)
                .await
                .unwrap();
        if claimed_key == key {
            return before;
        }
    }
    panic!("{key}'s job not among the first 100 claims")
}

/// Claims queue `q`, holding the key `big`'s 20 jobs queued at once and one of `small`
/// after them in claim order: `small`'s goes after at most one claim (of one job here) and
/// `big`'s turn of 2, not after the 20; then every job is claimed once and none is left
/// waiting.
async fn small_goes_after_one_claim_and_a_turn(pool: &PgPool) {
    let before = claims_before(pool, "q", "small").await;
    assert!(
        before <= 3,
        "small's job waits for at most one claim and big's turn, not for big's 20: \
         {before} claims before it"
    );
    let rest = claim_order(pool, "q", 4).await;
    assert_eq!(rest.len(), 20 - before, "every job claimed once: {rest:?}");
    assert_eq!(
        states(pool, "q").await,
        HashMap::from([("running".to_owned(), 21)]),
        "nothing left waiting"
    );
}

/// Waits until the database's clock is past `at` (jobs scheduled then are due).
async fn until_the_database_clock_passes(pool: &PgPool, at: chrono::DateTime<chrono::Utc>) {
    wait_for(
        "the database clock to pass",
        Duration::from_secs(10),
        || async {
            sqlx::query_scalar::<_, bool>("SELECT clock_timestamp() > $1")
                .bind(at)
                .fetch_one(pool)
                .await
                .unwrap()
        },
    )
    .await;
}

/// A backlog that was not held at its insert but is queued all at once later (here: 20 jobs
/// of one key scheduled ahead, coming due together) is brought back under key_claimable by
/// the claim after the first that takes its jobs: a job of another key due just after them
/// goes after at most that claim and the key's turn (2), not after all 20.
#[tokio::test]
async fn a_backlog_scheduled_ahead_takes_turns_once_it_comes_due() {
    let db = test_db().await;
    let pool = &db.pool;
    fair_queue_q(pool, 2).await;
    let due: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "WITH t AS (SELECT now() + interval '300 milliseconds' AS at),
              big AS (INSERT INTO skiplock.jobs (kind, queue, concurrency_key, scheduled_at)
                      SELECT 'noop', 'q', 'big', t.at FROM t, generate_series(1, 20)),
              small AS (INSERT INTO skiplock.jobs (kind, queue, concurrency_key, scheduled_at)
                        SELECT 'noop', 'q', 'small', t.at + interval '1 millisecond' FROM t)
         SELECT at FROM t",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        states(pool, "q").await,
        HashMap::from([("queued".to_owned(), 21)]),
        "jobs scheduled ahead are not held at their insert"
    );
    until_the_database_clock_passes(pool, due + chrono::Duration::milliseconds(1)).await;
    small_goes_after_one_claim_and_a_turn(pool).await;
}

/// Queue `q` (key_claimable 2) with the 20 children of one parent of queue `parents`, all
/// of key `big`, and then one job of key `small`; the parent claimed and completed, so that
/// its success queues the 20 at once.
async fn children_queued_at_once(pool: &PgPool) {
    fair_queue_q(pool, 2).await;
    let parent: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop', queue => 'parents')")
        .fetch_one(pool)
        .await
        .unwrap();
    sqlx::query(
        "SELECT skiplock.enqueue('noop', queue => 'q', concurrency_key => 'big',
                                 depends_on => ARRAY[$1::bigint])
         FROM generate_series(1, 20)",
    )
    .bind(parent)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("SELECT skiplock.enqueue('noop', queue => 'q', concurrency_key => 'small')")
        .execute(pool)
        .await
        .unwrap();
    let (id, token) = sql_claim(pool, "parents", 1, "fair-test")
        .await
        .first()
        .copied()
        .expect("the parent to claim");
    assert_eq!(id, parent);
    let completed = common::fixtures::sql_complete(pool, id, token).await;
    assert!(completed);
    assert_eq!(
        states(pool, "q").await.get("queued"),
        Some(&21),
        "the parent's success queued its 20 children"
    );
}

/// Children queued together when their parent succeeds take turns with the other keys: a
/// job of another key enqueued after them, before the parent's success, waits for at most
/// one claim and the key's turn.
#[tokio::test]
async fn children_queued_by_their_parent_take_turns() {
    let db = test_db().await;
    let pool = &db.pool;
    children_queued_at_once(pool).await;
    small_goes_after_one_claim_and_a_turn(pool).await;
}

/// Children held past their key's turn (they have dependency rows, all met) are let go by
/// the sweep of waiting jobs in turn, as any held job, not queued all at once as dependants
/// whose parents succeeded.
#[tokio::test]
async fn the_sweep_lets_held_children_go_in_turn() {
    let db = test_db().await;
    let pool = &db.pool;
    children_queued_at_once(pool).await;
    // The first claim leaves the key for the second, which holds its children and lets
    // two go again.
    for _ in 0..2 {
        sql_claim(pool, "q", 1, "fair-test").await;
    }
    let held = states(pool, "q").await.get("waiting/fair").copied();
    assert!(
        held.is_some_and(|held| held > 10),
        "the key's children held: {:?}",
        states(pool, "q").await
    );
    sqlx::query("SELECT * FROM skiplock.maintain()")
        .execute(pool)
        .await
        .unwrap();
    let states = states(pool, "q").await;
    assert!(
        states.get("queued").copied().unwrap_or(0) <= 3,
        "the sweep queued the key's held children at once: {states:?}"
    );
}

/// Children held past their key's turn whose parent an operator retried and then killed by
/// hand can never run: the sweep of waiting jobs cancels them with the rest of the dead
/// parent's dependants. A held child has dependency rows like any dependant; a sweep that
/// passed only the unheld ones to the cancel of a dead parent's dependants (42ea52d) left
/// the held ones waiting for good (the release's probe of their parents kept them).
#[tokio::test]
async fn held_children_of_a_parent_retried_that_then_dies_are_cancelled() {
    let db = test_db().await;
    let pool = &db.pool;
    children_queued_at_once(pool).await;
    for _ in 0..2 {
        sql_claim(pool, "q", 1, "fair-test").await;
    }
    let held: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM skiplock.jobs WHERE queue = 'q' AND held_for = 'fair' ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(
        held.len() > 10,
        "the key's children held: {:?}",
        states(pool, "q").await
    );
    let parent: i64 = sqlx::query_scalar("SELECT id FROM skiplock.jobs WHERE queue = 'parents'")
        .fetch_one(pool)
        .await
        .unwrap();
    let retried: bool = sqlx::query_scalar("SELECT skiplock.retry_job($1)")
        .bind(parent)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(retried, "the operator put the parent back in line");
    // Killed by a hand-written UPDATE, which runs no follow-up: the sweep of waiting jobs
    // (maintain) is what finds the children of a dead parent.
    let killed = sqlx::query(
        "UPDATE skiplock.jobs SET state = 'dead', finished_at = now(), last_error = 'killed by hand'
         WHERE id = $1 AND state = 'queued'",
    )
    .bind(parent)
    .execute(pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(killed, 1, "the parent went dead");
    // Every claim a worker would make now, with sweeps between: none may take a child that
    // was held (those already let go before the retry were runnable and may run).
    for _ in 0..25 {
        for (id, _) in sql_claim(pool, "q", 1, "fair-test").await {
            assert!(
                !held.contains(&id),
                "held child {id} of the dead parent was claimed: {:?}",
                states(pool, "q").await
            );
        }
        sqlx::query("SELECT * FROM skiplock.maintain()")
            .execute(pool)
            .await
            .unwrap();
    }
    for id in &held {
        assert_eq!(
            state_of(pool, *id).await,
            JobState::Cancelled,
            "held child {id}: {:?}",
            states(pool, "q").await
        );
    }
}

/// Jobs that come due more urgent than a key's held jobs, after the key's walks of held jobs
/// start at a row of key_held_from, are held from where they sort and let go first: the
/// walk starts at the first of them, not at the row (then they waited for the sweep).
#[tokio::test]
async fn jobs_come_due_before_where_a_keys_walks_start_go_first() {
    let db = test_db().await;
    let pool = &db.pool;
    fair_queue_q(pool, 2).await;
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key, priority)
         SELECT 'noop', 'q', 'big', 5 FROM generate_series(1, 10)",
    )
    .execute(pool)
    .await
    .unwrap();
    // Two claims: the second lets the key's next go and records where its held jobs start.
    for _ in 0..2 {
        sql_claim(pool, "q", 1, "fair-test").await;
    }
    let row: Option<i16> = sqlx::query_scalar(
        "SELECT priority FROM skiplock.key_held_from WHERE queue = 'q' AND concurrency_key = 'big'",
    )
    .fetch_optional(pool)
    .await
    .unwrap();
    assert_eq!(
        row,
        Some(5),
        "the key's walks start among its priority-5 jobs"
    );
    let due: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "WITH t AS (SELECT now() + interval '300 milliseconds' AS at),
              urgent AS (INSERT INTO skiplock.jobs (kind, queue, concurrency_key, priority,
                                                   scheduled_at)
                         SELECT 'noop', 'q', 'big', 0, t.at FROM t, generate_series(1, 20))
         SELECT at FROM t",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    until_the_database_clock_passes(pool, due).await;
    let priorities: Vec<i16> = {
        // Until two claims in a row come back empty (see claim_order).
        let (mut taken, mut empty) = (Vec::new(), 0);
        while empty < 2 && taken.len() < 40 {
            let claimed = sql_claim(pool, "q", 1, "fair-test").await;
            let Some((id, _)) = claimed.first() else {
                empty += 1;
                continue;
            };
            empty = 0;
            taken.push(
                sqlx::query_scalar("SELECT priority FROM skiplock.jobs WHERE id = $1")
                    .bind(id)
                    .fetch_one(pool)
                    .await
                    .unwrap(),
            );
        }
        taken
    };
    assert_eq!(
        priorities,
        [vec![0; 20], vec![5; 8]].concat(),
        "the urgent jobs first, then the rest, none left waiting: {priorities:?}"
    );
}

/// Within a key, a job more urgent than its queued ones is not held behind them; one as
/// urgent or less waits. Jobs without a key, lane jobs and jobs scheduled ahead are never
/// held. Raising key_claimable lets more go; removing it lets every held job go; a queued
/// job cancelled gives its turn to the next held one at the next claim.
#[tokio::test]
async fn priorities_keys_lanes_schedules_and_changes_of_the_setting_keep_their_meaning() {
    let db = test_db().await;
    let pool = &db.pool;
    fair_queue_q(pool, 2).await;
    let enqueue = |sql: &'static str| async move {
        sqlx::query_scalar::<_, i64>(sql)
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let queued_a = [
        enqueue("SELECT skiplock.enqueue('noop', queue => 'q', concurrency_key => 'a')").await,
        enqueue("SELECT skiplock.enqueue('noop', queue => 'q', concurrency_key => 'a')").await,
    ];
    let urgent = enqueue(
        "SELECT skiplock.enqueue('noop', queue => 'q', concurrency_key => 'a', priority => -1)",
    )
    .await;
    let same =
        enqueue("SELECT skiplock.enqueue('noop', queue => 'q', concurrency_key => 'a')").await;
    let later = enqueue(
        "SELECT skiplock.enqueue('noop', queue => 'q', concurrency_key => 'a', priority => 1)",
    )
    .await;
    let ahead = enqueue(
        "SELECT skiplock.enqueue('noop', queue => 'q', concurrency_key => 'a',
                                 scheduled_at => now() + interval '1 hour')",
    )
    .await;
    let no_key = enqueue("SELECT skiplock.enqueue('noop', queue => 'q')").await;
    // A lane's job of a key whose turn is taken (two of c queued).
    enqueue("SELECT max(skiplock.enqueue('noop', queue => 'q', concurrency_key => 'c')) FROM generate_series(1, 2)").await;
    let lane = enqueue(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key, ordering_key)
         VALUES ('noop', 'q', 'c', 'lane') RETURNING id",
    )
    .await;
    for (id, state, what) in [
        (queued_a[0], JobState::Queued, "the first of a"),
        (queued_a[1], JobState::Queued, "the second of a"),
        (urgent, JobState::Queued, "more urgent than a's queued jobs"),
        (same, JobState::Waiting, "a's third at its priority"),
        (later, JobState::Waiting, "a's job behind its priority"),
        (ahead, JobState::Queued, "scheduled ahead"),
        (no_key, JobState::Queued, "without a key"),
        (lane, JobState::Queued, "a lane's job"),
    ] {
        assert_eq!(state_of(pool, id).await, state, "{what}");
    }
    let why: String = sqlx::query_scalar("SELECT skiplock.why_not_running($1)")
        .bind(same)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(
        why.contains("waits its turn") && why.contains("'a'"),
        "{why}"
    );

    // Queued jobs cancelled: their turns go to the oldest held job at the next claim.
    for id in [queued_a[0], urgent] {
        let cancelled: bool = sqlx::query_scalar("SELECT skiplock.cancel_job($1)")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
        assert!(cancelled);
    }
    sql_claim(pool, "unrelated", 1, "fair-test").await;
    assert_eq!(
        state_of(pool, same).await,
        JobState::Waiting,
        "no claim of q yet"
    );
    let claimed: Vec<i64> = sql_claim(pool, "q", 1, "fair-test")
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(claimed, vec![queued_a[1]], "the oldest first");
    assert_eq!(
        state_of(pool, same).await,
        JobState::Queued,
        "the cancel's turn"
    );
    assert_eq!(state_of(pool, later).await, JobState::Waiting);

    // Raised, then removed.
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
         SELECT 'noop', 'q', 'b' FROM generate_series(1, 6)",
    )
    .execute(pool)
    .await
    .unwrap();
    let held_b = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM skiplock.jobs WHERE concurrency_key = 'b' AND held_for = 'fair'",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    };
    assert_eq!(held_b().await, 4);
    sqlx::query("UPDATE skiplock.queues SET key_claimable = 4 WHERE name = 'q'")
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(held_b().await, 2, "raised to 4: two more of b queued");
    sqlx::query("UPDATE skiplock.queues SET key_claimable = NULL WHERE name = 'q'")
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(held_b().await, 0, "removed: every held job queued");
    assert_eq!(state_of(pool, later).await, JobState::Queued);
    let waiting: i64 =
        sqlx::query_scalar("SELECT count(*) FROM skiplock.jobs WHERE state = 'waiting'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(waiting, 0, "nothing left waiting");
}

/// The insert that holds a job and the claim that takes its key's queued ones overlap,
/// each held open while the other commits: after both, the held job is claimable at the
/// next claim, with no sweep. `insert_first`: the insert holds (it sees the key's queued
/// jobs) before the claim takes them; else the claim takes them first, uncommitted, and
/// the insert still sees them queued.
async fn a_turn_is_never_lost_between_an_insert_and_a_claim(insert_first: bool) {
    let db = test_db().await;
    let pool = &db.pool;
    fair_queue_q(pool, 1).await;
    let first: i64 =
        sqlx::query_scalar("SELECT skiplock.enqueue('noop', queue => 'q', concurrency_key => 'k')")
            .fetch_one(pool)
            .await
            .unwrap();
    let mut inserter = pool.begin().await.unwrap();
    let mut claimer = pool.begin().await.unwrap();
    let insert = "SELECT skiplock.enqueue('noop', queue => 'q', concurrency_key => 'k')";
    let claim = "SELECT id FROM skiplock.claim('q', 10, 'fair-test')";
    let (held, claimed): (i64, Vec<i64>) = if insert_first {
        let held = sqlx::query_scalar(insert)
            .fetch_one(&mut *inserter)
            .await
            .unwrap();
        let claimed = sqlx::query_scalar(claim)
            .fetch_all(&mut *claimer)
            .await
            .unwrap();
        (held, claimed)
    } else {
        let claimed = sqlx::query_scalar(claim)
            .fetch_all(&mut *claimer)
            .await
            .unwrap();
        let held = sqlx::query_scalar(insert)
            .fetch_one(&mut *inserter)
            .await
            .unwrap();
        (held, claimed)
    };
    assert_eq!(claimed, vec![first]);
    let held_for: Option<String> =
        sqlx::query_scalar("SELECT held_for FROM skiplock.jobs WHERE id = $1")
            .bind(held)
            .fetch_one(&mut *inserter)
            .await
            .unwrap();
    assert_eq!(
        held_for.as_deref(),
        Some("fair"),
        "the key's turn looked taken"
    );
    claimer.commit().await.unwrap();
    // A claim between the two commits finds nothing it may take.
    assert!(sql_claim(pool, "q", 10, "fair-test").await.is_empty());
    inserter.commit().await.unwrap();
    let next: Vec<i64> = sql_claim(pool, "q", 10, "fair-test")
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(
        next,
        vec![held],
        "the held job's turn came at the next claim"
    );
}

#[tokio::test]
async fn a_turn_is_never_lost_when_the_insert_holds_before_the_claim_takes() {
    a_turn_is_never_lost_between_an_insert_and_a_claim(true).await;
}

#[tokio::test]
async fn a_turn_is_never_lost_when_the_claim_takes_before_the_insert_holds() {
    a_turn_is_never_lost_between_an_insert_and_a_claim(false).await;
}

/// Two claims of a fair queue at once: the second, beside the first still in flight (the
/// key's queued jobs locked, the row that gave the key its turn being deleted), takes the
/// key's held jobs instead of coming back empty. Before, a claim that found nothing queued
/// never looked at the held jobs, so two processes on one key's backlog took turns, each
/// waiting for the other's commit.
#[tokio::test]
async fn a_claim_beside_another_in_flight_takes_the_keys_held_jobs() {
    let db = test_db().await;
    let pool = &db.pool;
    fair_queue_q(pool, 2).await;
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
         SELECT 'noop', 'q', 'k' FROM generate_series(1, 10)",
    )
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(
        states(pool, "q").await,
        HashMap::from([("queued".to_owned(), 2), ("waiting/fair".to_owned(), 8)])
    );
    let mut first = pool.begin().await.unwrap();
    let claim = "SELECT id FROM skiplock.claim('q', 3, 'fair-test')";
    let taken_first: Vec<i64> = sqlx::query_scalar(claim)
        .fetch_all(&mut *first)
        .await
        .unwrap();
    assert_eq!(
        taken_first.len(),
        3,
        "the key's two queued jobs and one held"
    );
    let taken_second: Vec<i64> = sqlx::query_scalar(claim).fetch_all(pool).await.unwrap();
    first.commit().await.unwrap();
    assert_eq!(
        taken_second.len(),
        3,
        "the claim beside the one in flight took the key's held jobs"
    );
    assert!(taken_second.iter().all(|id| !taken_first.contains(id)));
    assert_eq!(
        states(pool, "q").await,
        HashMap::from([("running".to_owned(), 6), ("waiting/fair".to_owned(), 4)])
    );
}

/// The Rust worker drains a fair queue of one large key and many small ones, prefetching
/// more than a key's turn, and leaves nothing waiting; `skiplock queue limits` shows the
/// setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_drains_a_fair_queue_and_leaves_nothing_waiting() {
    let db = test_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(pool, "default", QueueLimits::default().key_claimable(3))
        .await
        .unwrap();
    let limits = skiplock::queue_limits(pool).await.unwrap();
    assert_eq!(
        limits[0].limits.key_claimable.map(|n| n.get()),
        Some(3),
        "{limits:?}"
    );
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, args, concurrency_key)
         SELECT 'record', jsonb_build_object('n', i), CASE WHEN i <= 300 THEN 'big' ELSE 'k' || i % 30 END
         FROM generate_series(1, 400) i",
    )
    .execute(pool)
    .await
    .unwrap();
    let recorder = Recorder::default();
    let worker = fast_worker(pool, &recorder)
        .concurrency(8)
        .prefetch(16)
        .build()
        .unwrap();
    let stop = worker.shutdown_handle();
    let run = tokio::spawn(worker.run());
    wait_for("every job done", Duration::from_secs(60), || async {
        recorder.total() >= 400
    })
    .await;
    stop.shutdown();
    run.await.unwrap().unwrap();
    assert_eq!(
        states(pool, "default").await,
        HashMap::from([("succeeded".to_owned(), 400)])
    );
}

/// The queue `fair` with `key_claimable` as given, and `jobs` jobs of the key `k` inserted
/// (the first `claimable` queued, the rest held).
async fn fair_key_with_jobs(pool: &PgPool, claimable: u32, jobs: i64) {
    skiplock::set_queue_limits(
        pool,
        "fair",
        QueueLimits::default().key_claimable(claimable),
    )
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key)
         SELECT 'noop', 'fair', 'k' FROM generate_series(1, $1)",
    )
    .bind(jobs)
    .execute(pool)
    .await
    .unwrap();
}

/// The queue `fair` (`key_claimable` 2) with 20 jobs of the key `k`, three claims of two
/// made: the key's queued jobs, then (its turn given) its next ones let go from its held
/// jobs, which records where they start. Returns the job id at that position.
async fn a_key_whose_walks_moved_on(pool: &PgPool) -> i64 {
    fair_key_with_jobs(pool, 2, 20).await;
    for _ in 0..3 {
        assert_eq!(sql_claim(pool, "fair", 2, "fair-test").await.len(), 2);
    }
    sqlx::query_scalar(
        "SELECT id FROM skiplock.key_held_from WHERE queue = 'fair' AND concurrency_key = 'k'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A key's walks of its held jobs start where they start (`skiplock.key_held_from`), not
/// at the front of the key's range: a job held after they moved on, earlier in claim
/// order (a `scheduled_at` in the past), leaves where it is with its hold (a row of
/// `key_slots_freed`), and the key's next turn takes it before the key's other held jobs.
/// Without that mark the walks passed over it until every other held job of the key had
/// gone.
#[tokio::test]
async fn a_job_held_behind_where_the_keys_walks_start_goes_first() {
    let db = test_db().await;
    let pool = &db.pool;
    let walks_from = a_key_whose_walks_moved_on(pool).await;
    let early: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key, scheduled_at)
         VALUES ('noop', 'fair', 'k', now() - interval '1 hour') RETURNING id",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(state_of(pool, early).await, JobState::Waiting, "held");
    let first_held: i64 = sqlx::query_scalar(
        "SELECT min(id) FROM skiplock.jobs WHERE concurrency_key = 'k' AND held_for = 'fair'
                                              AND id <> $1",
    )
    .bind(early)
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(
        first_held >= walks_from,
        "the key's held jobs start at or after its row ({first_held} >= {walks_from})"
    );
    // The key's next turn (two jobs let go, in claim order from where its held jobs start,
    // both behind what is queued now) takes the early job with the key's first held one.
    let mut claimed = Vec::new();
    for _ in 0..2 {
        let batch = sql_claim(pool, "fair", 1, "fair-test").await;
        assert_eq!(batch.len(), 1, "claimed so far: {claimed:?}");
        claimed.push(batch[0].0);
    }
    claimed.sort_unstable();
    assert_eq!(
        claimed,
        [first_held, early],
        "the key's next turn let the early job go with its first held one"
    );
}

/// A job held by a write of no hold of skiplock's (a row inserted `waiting` with `held_for`
/// by hand) leaves no mark of where it is: the sweep of `skiplock.maintain` finds it within
/// a lap and moves where its key's walks start back to it, so the key's next turn takes
/// it, not only once every other held job of the key has gone.
#[tokio::test]
async fn a_job_held_by_hand_behind_where_the_keys_walks_start_goes_after_a_sweep() {
    let db = test_db().await;
    let pool = &db.pool;
    let walks_from = a_key_whose_walks_moved_on(pool).await;
    let by_hand: i64 = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key, state, held_for, scheduled_at)
         VALUES ('noop', 'fair', 'k', 'waiting', 'fair', now() - interval '1 hour')
         RETURNING id",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(
        by_hand > walks_from,
        "its id is after where the key's walks start, its claim key before"
    );
    sqlx::query("SELECT * FROM skiplock.maintain()")
        .execute(pool)
        .await
        .unwrap();
    // The key's queued jobs, then its next turn of two.
    let mut claimed = Vec::new();
    for _ in 0..4 {
        claimed.extend(
            sql_claim(pool, "fair", 1, "fair-test")
                .await
                .into_iter()
                .map(|(id, _)| id),
        );
    }
    assert!(
        claimed.contains(&by_hand),
        "the job held by hand ({by_hand}) went with the key's next turn: {claimed:?}"
    );
}

/// Two releases of one key whose reads of `key_held_from` cross: the first (left open) lets
/// the key's first held job go and moves the row to the next; a job is then held between
/// the two, earlier in claim order than that next one; a second release takes that hold's
/// mark, reads the row as it was (the first has not committed), finds the key's first held
/// job unchanged and commits; then the first commits. The row is written only under the
/// key's advisory lock, which the second does not get: it leaves its position as a mark,
/// and the job held in between goes before the later one. Before the lock the second kept
/// the row as it read it, the first moved it past the job, and the mark was gone (found by
/// review; `b` went before `j`).
#[tokio::test]
async fn two_releases_whose_reads_of_where_a_keys_held_jobs_start_cross_lose_no_job() {
    let db = test_db().await;
    let pool = &db.pool;
    skiplock::set_queue_limits(pool, "fair", QueueLimits::default().key_claimable(1))
        .await
        .unwrap();
    let insert = async |args: &str, priority: i16| -> i64 {
        sqlx::query_scalar(
            "INSERT INTO skiplock.jobs (kind, queue, concurrency_key, args, priority)
             VALUES ('noop', 'fair', 'k', $1::jsonb, $2) RETURNING id",
        )
        .bind(args)
        .bind(priority)
        .fetch_one(pool)
        .await
        .unwrap()
    };
    let release = "SELECT skiplock.internal_release_freed_keys('fair')";
    // x1 queued (the key's one place), a and b held; the row recorded at a (nothing to let
    // go yet); x1 claimed, which gives the key its turn.
    insert(r#"{"n": "x1"}"#, 1).await;
    let a = insert(r#"{"n": "a"}"#, 1).await;
    insert(r#"{"n": "b"}"#, 3).await;
    sqlx::query("SELECT skiplock.internal_release_held('fair', ARRAY['k'])")
        .execute(pool)
        .await
        .unwrap();
    let row_at =
        "SELECT id FROM skiplock.key_held_from WHERE queue = 'fair' AND concurrency_key = 'k'";
    let at: i64 = sqlx::query_scalar(row_at).fetch_one(pool).await.unwrap();
    assert_eq!(at, a);
    assert_eq!(sql_claim(pool, "fair", 1, "fair-test").await.len(), 1);
    // The first release, left open: lets a go, moves the row to b.
    let mut first = pool.begin().await.unwrap();
    sqlx::query(release).execute(&mut *first).await.unwrap();
    // q0 queued, j held (a still looks held): j's hold leaves its mark.
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, queue, concurrency_key, args, priority)
         VALUES ('noop', 'fair', 'k', '{\"n\": \"q0\"}', 0),
                ('noop', 'fair', 'k', '{\"n\": \"j\"}', 2)",
    )
    .execute(pool)
    .await
    .unwrap();
    // The second release takes j's mark and commits.
    let mut second = pool.begin().await.unwrap();
    sqlx::query(release).execute(&mut *second).await.unwrap();
    second.commit().await.unwrap();
    first.commit().await.unwrap();
    let mut order = Vec::new();
    loop {
        let claimed = sql_claim(pool, "fair", 1, "fair-test").await;
        let Some((id, _)) = claimed.first() else {
            break;
        };
        let name: String = sqlx::query_scalar("SELECT args->>'n' FROM skiplock.jobs WHERE id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
        order.push(name);
    }
    assert_eq!(order, ["q0", "a", "j", "b"], "claim order");
}

/// Two releases of a key without a row of `key_held_from`, at once: the first records the
/// row and stays open; the second leaves the row to it instead of waiting for its insert
/// of the row (which a claim, or the sweep, would have waited on until the first
/// committed). Its wait would fail it here under `lock_timeout`.
#[tokio::test]
async fn a_release_never_waits_for_another_to_record_where_a_keys_held_jobs_start() {
    let db = test_db().await;
    let pool = &db.pool;
    fair_key_with_jobs(pool, 1, 5).await;
    let release = "SELECT skiplock.internal_release_held('fair', ARRAY['k'])";
    let mut first = pool.begin().await.unwrap();
    sqlx::query(release).execute(&mut *first).await.unwrap();
    let mut second = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '2s'")
        .execute(&mut *second)
        .await
        .unwrap();
    sqlx::query(release)
        .execute(&mut *second)
        .await
        .expect("the second release went on without waiting for the first");
    second.commit().await.unwrap();
    first.commit().await.unwrap();
    // The first's row: the key's first held job (the key's one place is queued, so
    // neither let any go).
    let (at, first_held): (Option<i64>, Option<i64>) = sqlx::query_as(
        "SELECT (SELECT id FROM skiplock.key_held_from
                 WHERE queue = 'fair' AND concurrency_key = 'k'),
                (SELECT min(id) FROM skiplock.jobs
                 WHERE concurrency_key = 'k' AND held_for = 'fair')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(at, first_held);
}

/// A change of a fair queue's per-key limits drops where its keys' held jobs start, also a
/// row a release has made and not committed (an application's claim on the SQL protocol,
/// left open): the change waits for it, and the row is gone after both. Before, the
/// change's DELETE did not see the row, which outlived it: once a `key_max_running` came
/// and went meanwhile, jobs held without a mark could sit before it (found by review).
#[tokio::test]
async fn a_change_of_the_limits_drops_a_row_made_by_a_release_not_yet_committed() {
    let db = test_db().await;
    let pool = &db.pool;
    fair_key_with_jobs(pool, 1, 5).await;
    let mut release = pool.begin().await.unwrap();
    sqlx::query("SELECT skiplock.internal_release_held('fair', ARRAY['k'])")
        .execute(&mut *release)
        .await
        .unwrap();
    let change = tokio::spawn({
        let pool = pool.clone();
        async move {
            sqlx::query("UPDATE skiplock.queues SET key_max_running = 5 WHERE name = 'fair'")
                .execute(&pool)
                .await
        }
    });
    wait_for_a_lock_wait(pool, "the change waits for the release").await;
    release.commit().await.unwrap();
    change.await.unwrap().unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM skiplock.key_held_from")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "the change dropped the row the release made");
}
