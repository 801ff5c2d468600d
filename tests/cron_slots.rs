//! Cron expressions as the database reads and evaluates them (`skiplock.internal_cron_*` in
//! migrations/functions/09_cron.sql), the one implementation behind the worker's cron pass,
//! `skiplock.maintain` and the check of a schedule as it is written.

mod common;

use chrono::{DateTime, Duration, Utc};
use common::test_db;
use sqlx::PgPool;

/// The latest slot of `expression` in `timezone` at or before `now` and after `done`.
async fn due_slot(
    pool: &PgPool,
    expression: &str,
    timezone: &str,
    done: &str,
    now: &str,
) -> Option<DateTime<Utc>> {
    sqlx::query_scalar(
        "SELECT skiplock.internal_cron_due_slot($1, $2, $3::timestamptz, $4::timestamptz)",
    )
    .bind(expression)
    .bind(timezone)
    .bind(done)
    .bind(now)
    .fetch_one(pool)
    .await
    .unwrap()
}

fn utc(text: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(text).unwrap().to_utc()
}

/// The values each field allows, as `internal_cron_parse` reads them.
type Fields = (
    Vec<i32>,
    Vec<i32>,
    Vec<i32>,
    Vec<i32>,
    Vec<i32>,
    Vec<i32>,
    bool,
    bool,
    bool,
);

async fn parse(pool: &PgPool, expression: &str) -> Fields {
    sqlx::query_as("SELECT * FROM skiplock.internal_cron_parse($1)")
        .bind(expression)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn each_form_of_a_field_reads_as_its_values() {
    let db = test_db().await;
    let pool = &db.pool;
    let all_days: Vec<i32> = (1..=31).collect();
    let all_months: Vec<i32> = (1..=12).collect();
    let (seconds, minutes, hours, days, months, weekdays, days_any, weekdays_any, interval) =
        parse(pool, "30 */20 9-17/4 ? * mon-FRI").await;
    assert_eq!(seconds, [30]);
    assert_eq!(minutes, [0, 20, 40]);
    assert_eq!(hours, [9, 13, 17]);
    assert_eq!(days, all_days);
    assert_eq!(months, all_months);
    assert_eq!(weekdays, [1, 2, 3, 4, 5]);
    assert!(days_any && !weekdays_any && interval);

    // `L` is the last day (32); 7 is Sunday like 0; names in any case; `a/n` runs to the end.
    let (seconds, minutes, hours, days, months, weekdays, days_any, weekdays_any, interval) =
        parse(pool, "5/20 1,3 L,15 feb-Apr,DEC sun,7,SAT").await;
    assert_eq!(seconds, [0], "5 fields: whole minutes");
    assert_eq!(minutes, [5, 25, 45]);
    assert_eq!(hours, [1, 3]);
    assert_eq!(days, [15, 32]);
    assert_eq!(months, [2, 3, 4, 12]);
    assert_eq!(weekdays, [0, 6]);
    assert!(!days_any && !weekdays_any && !interval);
}

/// Bad expressions are refused with the field, its text and its characters named, whoever
/// asks: the same words the Rust API and the CLI show.
#[tokio::test]
async fn a_bad_field_is_named_with_its_characters() {
    let db = test_db().await;
    let cases = [
        (
            "0 25 * * *",
            "invalid cron expression `0 25 * * *`: hour field `25` (characters 3-4) is wrong: use 0-23, a list (9,17), a range (9-17), a step (*/2) or *",
        ),
        (
            "*/5 * 32 * *",
            "invalid cron expression `*/5 * 32 * *`: day-of-month field `32` (characters 7-8) is wrong: use 1-31, L, a list (1,15), a range (1-7), a step (*/2) or *",
        ),
        (
            "0 0 1,, * *",
            "invalid cron expression `0 0 1,, * *`: day-of-month field `1,,` (characters 5-7) is wrong: use 1-31, L, a list (1,15), a range (1-7), a step (*/2) or *",
        ),
        (
            ",5 * * * *",
            "invalid cron expression `,5 * * * *`: minute field `,5` (characters 1-2) is wrong: use 0-59, a list (0,30), a range (10-20), a step (*/15) or *",
        ),
        (
            "0 0 * * FRI-MON",
            "invalid cron expression `0 0 * * FRI-MON`: day-of-week field `FRI-MON` (characters 9-15) is wrong: use 0-7 (0 and 7 are Sunday) or SUN-SAT, a list, a range, a step or *",
        ),
        (
            "0 0 * JAN/0 *",
            "invalid cron expression `0 0 * JAN/0 *`: month field `JAN/0` (characters 7-11) is wrong: use 1-12 or JAN-DEC, a list, a range, a step or *",
        ),
        (
            "61 * * * * *",
            "invalid cron expression `61 * * * * *`: second field `61` (characters 1-2) is wrong: use 0-59, a list (0,30), a range (10-20), a step (*/15) or *",
        ),
        (
            "? * * * *",
            "invalid cron expression `? * * * *`: minute field `?` (characters 1-1) is wrong: use 0-59, a list (0,30), a range (10-20), a step (*/15) or *",
        ),
        (
            "* * *",
            "invalid cron expression `* * *`: expected 5 fields (minute hour day-of-month month day-of-week) or 6 (with seconds first), found 3",
        ),
    ];
    for (expression, message) in cases {
        let error = sqlx::query("SELECT skiplock.internal_cron_parse($1)")
            .bind(expression)
            .execute(&db.pool)
            .await
            .unwrap_err();
        let error = error.as_database_error().unwrap();
        assert_eq!(error.code().as_deref(), Some("22023"), "{expression}");
        assert_eq!(error.message(), message);
    }
}

/// Across America/New_York's clock changes of 2026 (8 March 02:00 → 03:00, 1 November
/// 02:00 → 01:00): a skipped local time runs moved forward by the gap; a repeated one runs
/// once, at its first instant, unless the schedule is an interval (`*` leads the minute or
/// hour field), which runs through both passes of the repeated hour.
#[tokio::test]
async fn slots_across_clock_changes() {
    let db = test_db().await;
    let pool = &db.pool;
    let new_york = "America/New_York";
    // (expression, done until, now, the due slot)
    let cases = [
        // 02:30 does not exist on 8 March: it runs at 03:30 EDT (07:30 UTC), not before.
        (
            "30 2 * * *",
            "2026-03-07T07:30:00Z",
            "2026-03-08T07:29:00Z",
            None,
        ),
        (
            "30 2 * * *",
            "2026-03-07T07:30:00Z",
            "2026-03-08T07:30:00Z",
            Some("2026-03-08T07:30:00Z"),
        ),
        // An interval goes on after the gap.
        (
            "*/15 * * * *",
            "2026-03-08T06:45:00Z",
            "2026-03-08T07:05:00Z",
            Some("2026-03-08T07:00:00Z"),
        ),
        // 01:30 happens twice on 1 November (05:30 and 06:30 UTC): once, at the first.
        (
            "30 1 * * *",
            "2026-10-31T05:30:00Z",
            "2026-11-01T05:30:00Z",
            Some("2026-11-01T05:30:00Z"),
        ),
        (
            "30 1 * * *",
            "2026-11-01T05:30:00Z",
            "2026-11-01T06:40:00Z",
            None,
        ),
        // A worker that was down during the first 01:45 and is back at 01:40 EST runs it.
        (
            "45 1 * * *",
            "2026-10-31T05:45:00Z",
            "2026-11-01T06:40:00Z",
            Some("2026-11-01T05:45:00Z"),
        ),
        // An interval runs through both hours.
        (
            "*/30 * * * *",
            "2026-11-01T05:00:00Z",
            "2026-11-01T05:59:00Z",
            Some("2026-11-01T05:30:00Z"),
        ),
        (
            "*/30 * * * *",
            "2026-11-01T05:30:00Z",
            "2026-11-01T06:00:00Z",
            Some("2026-11-01T06:00:00Z"),
        ),
        (
            "*/30 * * * *",
            "2026-11-01T06:00:00Z",
            "2026-11-01T06:35:00Z",
            Some("2026-11-01T06:30:00Z"),
        ),
        (
            "0 * * * *",
            "2026-11-01T05:00:00Z",
            "2026-11-01T06:10:00Z",
            Some("2026-11-01T06:00:00Z"),
        ),
        // 02:00 comes once, in standard time (07:00 UTC).
        (
            "0 2 * * *",
            "2026-10-31T06:00:00Z",
            "2026-11-01T06:59:00Z",
            None,
        ),
        (
            "0 2 * * *",
            "2026-10-31T06:00:00Z",
            "2026-11-01T07:00:00Z",
            Some("2026-11-01T07:00:00Z"),
        ),
        // 09:00 follows the offset on either side of the change.
        (
            "0 9 * * *",
            "2026-01-01T00:00:00Z",
            "2026-03-08T13:30:00Z",
            Some("2026-03-08T13:00:00Z"),
        ),
        (
            "0 9 * * *",
            "2026-01-01T00:00:00Z",
            "2026-01-15T20:00:00Z",
            Some("2026-01-15T14:00:00Z"),
        ),
    ];
    for (expression, done, now, slot) in cases {
        assert_eq!(
            due_slot(pool, expression, new_york, done, now).await,
            slot.map(utc),
            "`{expression}` done until {done}, now {now}"
        );
    }
}

/// Calendar cases far apart: the latest slot after a long outage, the last day of the
/// month, leap days, day-of-month or day-of-week, a date that never comes.
#[tokio::test]
async fn the_latest_slot_after_an_outage() {
    let db = test_db().await;
    let pool = &db.pool;
    let cases = [
        (
            "*/5 * * * *",
            "2026-02-01T00:00:00Z",
            "2026-03-01T10:17:30Z",
            Some("2026-03-01T10:15:00Z"),
        ),
        (
            "*/5 * * * *",
            "2026-03-01T10:15:00Z",
            "2026-03-01T10:17:30Z",
            None,
        ),
        (
            "0 0 1 1 *",
            "2023-06-01T00:00:00Z",
            "2026-11-27T08:00:00Z",
            Some("2026-01-01T00:00:00Z"),
        ),
        (
            "0 0 29 2 *",
            "2020-01-01T00:00:00Z",
            "2026-11-27T00:00:00Z",
            Some("2024-02-29T00:00:00Z"),
        ),
        (
            "0 12 L * *",
            "2026-01-01T00:00:00Z",
            "2026-11-27T00:00:00Z",
            Some("2026-10-31T12:00:00Z"),
        ),
        (
            "0 12 L 2 *",
            "2020-01-01T00:00:00Z",
            "2026-11-27T00:00:00Z",
            Some("2026-02-28T12:00:00Z"),
        ),
        // The 13th or a Friday (both restricted: either); Friday the 20th is the latest.
        (
            "0 12 13 * FRI",
            "2026-11-01T00:00:00Z",
            "2026-11-27T00:00:00Z",
            Some("2026-11-20T12:00:00Z"),
        ),
        (
            "0 12 13 * FRI",
            "2026-11-01T00:00:00Z",
            "2026-11-27T18:00:00Z",
            Some("2026-11-27T12:00:00Z"),
        ),
        // A day-of-week with `?` in day-of-month: only that weekday.
        (
            "0 12 ? * MON",
            "2026-11-01T00:00:00Z",
            "2026-11-27T18:00:00Z",
            Some("2026-11-23T12:00:00Z"),
        ),
        (
            "0 0 31 2 *",
            "2016-01-01T00:00:00Z",
            "2026-11-27T00:00:00Z",
            None,
        ),
        (
            "15,45 * * * * *",
            "2026-11-27T07:59:00Z",
            "2026-11-27T08:00:44Z",
            Some("2026-11-27T08:00:15Z"),
        ),
    ];
    for (expression, done, now, slot) in cases {
        assert_eq!(
            due_slot(pool, expression, "UTC", done, now).await,
            slot.map(utc),
            "`{expression}` done until {done}, now {now}"
        );
    }
}

/// One random field: `*`, a value, a range, a step over any of them, or a list of two.
fn random_field(rng: &mut fastrand::Rng, low: i32, high: i32, depth: u32) -> String {
    let value = |rng: &mut fastrand::Rng| rng.i32(low..=high);
    match rng.u32(0..if depth == 0 { 7 } else { 6 }) {
        0 | 1 => "*".to_owned(),
        2 => value(rng).to_string(),
        3 => {
            let (a, b) = (value(rng), value(rng));
            format!("{}-{}", a.min(b), a.max(b))
        }
        4 => format!("*/{}", rng.i32(1..=(high - low + 1).min(20))),
        5 => {
            let (a, b) = (value(rng), value(rng));
            format!("{}-{}/{}", a.min(b), a.max(b), rng.i32(1..=5))
        }
        _ => format!(
            "{},{}",
            random_field(rng, low, high, depth + 1),
            random_field(rng, low, high, depth + 1)
        ),
    }
}

/// Against a plain search of every minute between the last slot done and now: for
/// random expressions, in UTC and in a zone without clock changes, the due slot is the
/// latest minute whose local time matches the fields (`internal_cron_parse`'s values, whose
/// reading the tests above pin down).
#[tokio::test]
async fn the_due_slot_is_the_latest_matching_minute() {
    let db = test_db().await;
    let pool = &db.pool;
    let seed = fastrand::u64(..);
    let mut rng = fastrand::Rng::with_seed(seed);
    let base = utc("2026-01-01T00:00:00Z");
    for case in 0..150 {
        let expression = [
            random_field(&mut rng, 0, 59, 0),
            random_field(&mut rng, 0, 23, 0),
            random_field(&mut rng, 1, 31, 0),
            random_field(&mut rng, 1, 12, 0),
            random_field(&mut rng, 0, 7, 0),
        ]
        .join(" ");
        let timezone = if case % 2 == 0 { "UTC" } else { "Asia/Tokyo" };
        let now = base + Duration::seconds(rng.i64(0..365 * 86_400));
        let done = now - Duration::minutes(rng.i64(1..10 * 1_440));
        let slot = due_slot(
            pool,
            &expression,
            timezone,
            &done.to_rfc3339(),
            &now.to_rfc3339(),
        )
        .await;
        let searched: Option<DateTime<Utc>> = sqlx::query_scalar(
            "WITH f AS (SELECT * FROM skiplock.internal_cron_parse($1)),
                  minutes AS (
                      SELECT m, m AT TIME ZONE $2 AS wall
                      FROM generate_series(date_trunc('minute', $4::timestamptz),
                                           $3::timestamptz, interval '1 minute') m
                      WHERE m > $3::timestamptz - interval '10 days' AND m > $4::timestamptz)
             SELECT max(m) FROM minutes, f
             WHERE extract(minute FROM wall)::int = ANY(f.minutes)
               AND extract(hour FROM wall)::int = ANY(f.hours)
               AND extract(month FROM wall)::int = ANY(f.months)
               AND CASE WHEN f.days_any OR f.weekdays_any
                        THEN (extract(day FROM wall)::int = ANY(f.days)
                              AND extract(dow FROM wall)::int = ANY(f.weekdays))
                        ELSE (extract(day FROM wall)::int = ANY(f.days)
                              OR extract(dow FROM wall)::int = ANY(f.weekdays)) END",
        )
        .bind(&expression)
        .bind(timezone)
        .bind(now)
        .bind(done)
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(
            slot, searched,
            "`{expression}` in {timezone}, done until {done}, now {now} (seed {seed})"
        );
    }
}
