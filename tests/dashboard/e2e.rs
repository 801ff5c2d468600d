//! End to end in headless Chromium: the overview shows a seeded database, and a click on
//! a dead job's Retry button (with its confirmation accepted) queues the job.
//!
//! Without Chromium the test prints a note and passes: install it with
//! `apt-get install -y chromium` (Debian's package; nothing is downloaded at run time).
//! With `SKIPLOCK_SCREENSHOTS=DIR` it also writes PNGs of the pages into DIR, as in
//! docs/screenshots/.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;
use sqlx::PgPool;

use skiplock::JobState;

use crate::cdp::{Browser, chromium_path};
use crate::common::fixtures::state_if_any;
use crate::common::fixtures::wait_for;
use crate::common::test_db;
use crate::support::{Dashboard, seed};

#[tokio::test]
async fn overview_counts_and_retrying_a_dead_job_by_clicking() {
    let Some(chromium) = chromium_path() else {
        crate::common::missing_tool(
            "the dashboard browser test",
            "Chromium (/usr/bin/chromium or SKIPLOCK_CHROMIUM)",
            "apt-get install -y chromium",
        );
        return;
    };
    let screenshots = std::env::var_os("SKIPLOCK_SCREENSHOTS").map(PathBuf::from);
    let db = test_db().await;
    let seeded = seed(&db.pool).await;
    if screenshots.is_some() {
        seed_busy_hour_and_month(&db.pool).await;
    }
    let dashboard = Dashboard::start(&db, &[]).await;
    let browser = Browser::start(&chromium).await;

    browser.goto(&dashboard.url("/")).await;
    let card =
        |key: &str| format!("document.querySelector('[data-count={key}] .value').textContent");
    for (key, expected) in [
        ("runnable", "3"),
        ("running", "2"),
        ("dead", "2"),
        ("workers", "1"),
    ] {
        assert_eq!(
            browser.eval(&card(key)).await,
            json!(expected),
            "card {key}"
        );
    }
    browser
        .wait_for(
            "the live chart",
            "document.getElementById('throughput-chart').dataset.ready === 'true'",
        )
        .await;
    let shot = |name: &'static str| {
        let dir = screenshots.clone();
        let browser = &browser;
        async move {
            if let Some(dir) = dir {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(dir.join(name), browser.screenshot().await).unwrap();
            }
        }
    };
    shot("overview.png").await;

    // Overview → dead jobs → the newest dead job → Retry, confirmed.
    browser.click("a[data-count=dead]").await;
    browser
        .wait_for(
            "the dead jobs",
            "location.search === '?state=dead' && document.readyState === 'complete'",
        )
        .await;
    shot("jobs.png").await;
    let id = seeded.dead[1];
    browser.click(&format!("tr[data-job-id='{id}'] a")).await;
    browser
        .wait_for(
            "the job page",
            &format!("location.pathname === '/jobs/{id}' && document.readyState === 'complete'"),
        )
        .await;
    shot("job.png").await;
    browser
        .click(&format!("form[action='/jobs/{id}/retry'] button"))
        .await;
    browser
        .wait_for(
            "the notice after the retry",
            "(document.querySelector('.flash') || {}).textContent.includes('queued to run now')",
        )
        .await;
    assert_eq!(
        browser.dialogs.lock().unwrap().clone(),
        vec![format!("Retry job {id} now?")],
        "the click asked for confirmation"
    );
    wait_for("the job to be queued", Duration::from_secs(60), || async {
        state_if_any(&db.pool, id).await == Some(JobState::Queued)
    })
    .await;
    assert_eq!(
        state_if_any(&db.pool, seeded.dead[0]).await,
        Some(JobState::Dead)
    );

    if screenshots.is_some() {
        browser.goto(&dashboard.url("/history")).await;
        shot("history.png").await;
    }
}

/// Traffic over the last hour and a month of rolled-up history, so that screenshots show
/// full charts. Adds only succeeded jobs (failures among their errors) and rollup rows.
async fn seed_busy_hour_and_month(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO skiplock.jobs (queue, kind, args, state, attempt, claimed_by, scheduled_at,
                                    claimed_at, finished_at, errors)
         SELECT CASE WHEN i % 3 = 0 THEN 'mail' ELSE 'default' END,
                CASE WHEN i % 3 = 0 THEN 'send_email' ELSE 'resize' END,
                jsonb_build_object('n', i), 'succeeded', 1, 'worker-a',
                t - interval '1.2 seconds', t - interval '0.9 seconds', t,
                CASE WHEN i % 17 = 0 THEN jsonb_build_array(jsonb_build_object(
                    'attempt', 1, 'at', t - interval '2 seconds', 'message', 'timeout'))
                ELSE '[]' END
         FROM generate_series(1, 6000) i,
              LATERAL (SELECT now() - make_interval(secs => 3590 * (i / 6000.0)
                                                      + 20 * sin(i / 300.0) + 25)) AS x(t)",
    )
    .execute(pool)
    .await
    .expect("seed an hour of traffic");
    sqlx::query(
        "INSERT INTO skiplock.job_history (bucket, queue, kind, succeeded, failed, dead, cancelled,
                                           run_count, run_seconds, wait_count, wait_seconds)
         SELECT date_trunc('hour', now() - make_interval(hours => h), 'UTC'), q, k,
                (400 + 250 * sin(h / 20.0))::int, (15 + 10 * cos(h / 7.0))::int, h % 3, h % 5 / 4,
                300, 300 * 0.9, 300, 300 * 1.7
         FROM generate_series(1, 29 * 24) h,
              (VALUES ('default', 'resize'), ('mail', 'send_email')) AS v(q, k)",
    )
    .execute(pool)
    .await
    .expect("seed a month of history");
}
