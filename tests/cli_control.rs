//! `skiplock cron` and `skiplock queue`, driven through the real binary.
#![cfg(feature = "cli")]

mod cli_support;
mod common;

use cli_support::skiplock;
use common::fixtures::state_of;
use common::test_db;
use skiplock::JobState;

#[tokio::test]
async fn cron_add_list_remove_and_bad_expressions() {
    let db = test_db().await;
    let added = skiplock(
        &db,
        &[
            "cron",
            "add",
            "nightly",
            "0 3 * * *",
            "noop",
            "{\"n\": 1}",
            "--timezone",
            "Europe/Paris",
            "--missed",
            "skip",
        ],
    )
    .await
    .ok();
    assert_eq!(added, "cron schedule `nightly` saved\n");

    let listed = skiplock(&db, &["cron", "list", "--json"]).await.json();
    let schedule = &listed[0];
    assert_eq!(schedule["name"], "nightly");
    assert_eq!(schedule["expression"], "0 3 * * *");
    assert_eq!(schedule["timezone"], "Europe/Paris");
    assert_eq!(schedule["missed"], "skip");
    assert_eq!(schedule["args"], serde_json::json!({"n": 1}));
    let table = skiplock(&db, &["cron", "list"]).await.ok();
    assert!(table.starts_with("NAME"), "{table}");
    assert!(table.contains("nightly"), "{table}");

    // Bad arguments are usage errors: exit 2, the message's own line first.
    let bad = skiplock(&db, &["cron", "add", "bad", "0 25 * * *", "noop"]).await;
    assert_eq!(bad.code, Some(2));
    assert!(
        bad.stderr.starts_with(
            "error: invalid cron expression `0 25 * * *`: hour field `25` (characters 3-4) is wrong"
        ),
        "{}",
        bad.stderr
    );
    let zone = skiplock(
        &db,
        &[
            "cron",
            "add",
            "bad",
            "* * * * *",
            "noop",
            "--timezone",
            "Nowhere/Town",
        ],
    )
    .await;
    assert_eq!(zone.code, Some(2));
    assert!(
        zone.stderr.contains("unknown time zone `Nowhere/Town`"),
        "{}",
        zone.stderr
    );
    let policy = skiplock(
        &db,
        &["cron", "add", "bad", "* * * * *", "noop", "--missed", "all"],
    )
    .await;
    assert_eq!(policy.code, Some(2), "usage error: {}", policy.stderr);

    assert_eq!(
        skiplock(&db, &["cron", "remove", "nightly"]).await.ok(),
        "cron schedule `nightly` removed\n"
    );
    let missing = skiplock(&db, &["cron", "remove", "nightly"]).await;
    assert_eq!(missing.code, Some(1));
    assert_eq!(
        missing.stderr,
        "error: no cron schedule named `nightly`; list them with `skiplock cron list`\n"
    );
}

#[tokio::test]
async fn queue_pause_and_resume() {
    let db = test_db().await;
    assert_eq!(
        skiplock(&db, &["queue", "pause", "mail"]).await.ok(),
        "queue `mail` paused\n"
    );
    assert_eq!(skiplock(&db, &["queue", "paused"]).await.ok(), "mail\n");
    let paused: bool = sqlx::query_scalar("SELECT paused FROM skiplock.queues WHERE name = 'mail'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(paused);
    assert_eq!(
        skiplock(&db, &["queue", "resume", "mail"]).await.ok(),
        "queue `mail` resumed\n"
    );
    assert_eq!(skiplock(&db, &["queue", "paused"]).await.ok(), "");
}

#[tokio::test]
async fn queue_limits_are_set_kept_listed_and_removed() {
    let db = test_db().await;
    assert_eq!(
        skiplock(&db, &["queue", "limit", "exports", "--max-running", "5"])
            .await
            .ok(),
        "queue `exports`: max_running 5, rate none, key_max_running none, key_rate none, key_claimable none\n"
    );
    // A limit not named stays as it is.
    assert_eq!(
        skiplock(&db, &["queue", "limit", "exports", "--rate", "100/1m"])
            .await
            .ok(),
        "queue `exports`: max_running 5, rate 100 per 1m, key_max_running none, key_rate none, key_claimable none\n"
    );
    assert_eq!(
        skiplock(
            &db,
            &["queue", "limit", "exports", "--key-max-running", "2"]
        )
        .await
        .ok(),
        "queue `exports`: max_running 5, rate 100 per 1m, key_max_running 2, key_rate none, key_claimable none\n"
    );
    assert_eq!(
        skiplock(&db, &["queue", "limit", "exports", "--key-rate", "10/1m"])
            .await
            .ok(),
        "queue `exports`: max_running 5, rate 100 per 1m, key_max_running 2, key_rate 10 per 1m, key_claimable none\n"
    );
    assert_eq!(
        skiplock(&db, &["queue", "limit", "exports", "--key-claimable", "4"])
            .await
            .ok(),
        "queue `exports`: max_running 5, rate 100 per 1m, key_max_running 2, key_rate 10 per 1m, key_claimable 4\n"
    );
    let refused = skiplock(&db, &["queue", "limit", "exports", "--key-claimable", "0"]).await;
    assert_eq!(refused.code, Some(2), "{refused:?}");
    assert!(
        refused.stderr.contains("write 1 or more, or `none`"),
        "{}",
        refused.stderr
    );
    assert_eq!(
        skiplock(
            &db,
            &["queue", "limit", "exports", "--key-claimable", "none"]
        )
        .await
        .ok(),
        "queue `exports`: max_running 5, rate 100 per 1m, key_max_running 2, key_rate 10 per 1m, key_claimable none\n"
    );
    for (value, needle) in [
        ("100001/1m", "write 1 to 100000"),
        ("0/1s", "out of range"),
        ("5/0s", "period of zero"),
        ("ten", "is not a rate"),
    ] {
        let refused = skiplock(&db, &["queue", "limit", "exports", "--key-rate", value]).await;
        assert_eq!(refused.code, Some(2), "{value}: {refused:?}");
        assert!(
            refused.stderr.contains(needle),
            "{value}: {}",
            refused.stderr
        );
    }
    let listed = skiplock(&db, &["queue", "limits", "--json"]).await.json();
    assert_eq!(listed[0]["queue"], "exports");
    assert_eq!(listed[0]["max_running"], 5);
    assert_eq!(listed[0]["rate_limit"], 100);
    assert_eq!(listed[0]["rate_period_seconds"], 60.0);
    assert_eq!(listed[0]["key_max_running"], 2);
    assert_eq!(listed[0]["key_rate_limit"], 10);
    assert_eq!(listed[0]["key_rate_period_seconds"], 60.0);
    assert_eq!(listed[0]["keys_rate_limited"], 0);
    let table = skiplock(&db, &["queue", "limits"]).await.ok();
    assert!(
        table.contains("exports") && table.contains("100/1m") && table.contains("10/1m"),
        "{table}"
    );
    let stats = skiplock(&db, &["stats", "--json"]).await.json();
    assert_eq!(stats["limits"][0]["max_running"], 5);
    let id: i64 = sqlx::query_scalar("SELECT skiplock.enqueue('noop', queue => 'exports')")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let shown = skiplock(&db, &["show", &id.to_string()]).await.ok();
    assert!(
        shown.contains("\nwhy: runnable: the next free worker of queue 'exports'"),
        "{shown}"
    );
    // Jobs with a concurrency key from the command line: two of key t7 run, the third is
    // held back and says why.
    for _ in 0..3 {
        skiplock(
            &db,
            &[
                "enqueue",
                "noop",
                "--queue",
                "exports",
                "--concurrency-key",
                "t7",
            ],
        )
        .await
        .ok();
    }
    sqlx::query("SELECT * FROM skiplock.claim('exports', 5, 'w')")
        .execute(&db.pool)
        .await
        .unwrap();
    let held: i64 = sqlx::query_scalar(
        "SELECT id FROM skiplock.jobs WHERE concurrency_key = 't7' AND state = 'waiting'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let shown = skiplock(&db, &["show", &held.to_string()]).await.ok();
    assert!(
        shown.contains("held back by the queue's key_max_running of 2 for key 't7'"),
        "{shown}"
    );
    assert_eq!(
        skiplock(
            &db,
            &[
                "queue",
                "limit",
                "exports",
                "--max-running",
                "none",
                "--rate",
                "none",
                "--key-max-running",
                "none",
                "--key-rate",
                "none"
            ]
        )
        .await
        .ok(),
        "queue `exports`: max_running none, rate none, key_max_running none, key_rate none, key_claimable none\n"
    );
    assert_eq!(
        state_of(&db.pool, held).await,
        JobState::Queued,
        "the limit removed, the held job is queued"
    );
    assert_eq!(
        skiplock(&db, &["queue", "limits"]).await.ok(),
        "no queue has a global limit; set one with skiplock queue limit\n"
    );
    let usage = skiplock(&db, &["queue", "limit", "exports"]).await;
    assert_eq!(usage.code, Some(2), "{usage:?}");
}

#[tokio::test]
async fn a_kind_one_letter_from_a_builtin_is_enqueued_with_a_warning() {
    let db = test_db().await;
    let run = skiplock(&db, &["enqueue", "noopp"]).await;
    assert_eq!(
        run.stderr,
        "warning: kind `noopp` is not a built-in kind, but one letter from `noop`; enqueued as \
         `noopp`, which only a worker with a handler of that name runs\n"
    );
    let id: i64 = run.ok().trim().parse().unwrap();
    let kind: String = sqlx::query_scalar("SELECT kind FROM skiplock.jobs WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(kind, "noopp");
    let quiet = skiplock(&db, &["enqueue", "noop"]).await;
    assert_eq!(quiet.stderr, "", "a built-in kind gets no warning");
}
