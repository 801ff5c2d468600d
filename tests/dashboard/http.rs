//! Every page and machine-readable route, and every action, over plain HTTP.

use reqwest::header::HeaderMap;

use skiplock::JobState;

use crate::common::fixtures::state_if_any;
use crate::common::test_db;
use crate::support::{Dashboard, card, seed};

#[tokio::test]
async fn overview_shows_the_counts_by_state_queue_and_kind() {
    let db = test_db().await;
    let seeded = seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &[]).await;
    let page = dashboard.page("/").await;
    for (key, expected) in [
        ("runnable", "3"),
        ("scheduled", "4"),
        ("waiting", "2"),
        ("running", "2"),
        ("succeeded_last_hour", "5"),
        ("dead_last_hour", "2"),
        ("dead", "2"),
        ("workers", "1"),
    ] {
        assert_eq!(card(&page, key), expected, "card {key}");
    }
    // Queue and kind tables, with the retry-dead and pause actions of the queues.
    assert!(page.contains("<tr data-name=\"mail\">"), "{page}");
    assert!(page.contains("<tr data-name=\"resize\">"));
    assert!(page.contains("Retry 2 dead"));
    assert!(page.contains("action=\"/queues/pause\""));
    // The worker, seen through the jobs it holds.
    assert!(page.contains("worker-a"));
    assert!(page.contains("id=\"throughput-chart\""));
    assert!(!seeded.running.is_empty());

    let cards = dashboard.page("/overview/live?part=cards").await;
    assert_eq!(card(&cards, "runnable"), "3");
    assert!(!cards.contains("<html"), "a fragment, not a page");
    let tables = dashboard.page("/overview/live?part=tables").await;
    assert!(tables.contains("worker-a"));
    assert_eq!(
        dashboard.get("/overview/live?part=nope").await.status(),
        404
    );
}

#[tokio::test]
async fn overview_shows_each_global_limit_its_use_and_the_jobs_it_holds_back() {
    let db = test_db().await;
    let pool = &db.pool;
    sqlx::query("SELECT skiplock.enqueue('export', queue => 'exports') FROM generate_series(1, 3)")
        .execute(pool)
        .await
        .unwrap();
    skiplock::set_queue_limits(
        pool,
        "exports",
        skiplock::QueueLimits::default().max_running(1),
    )
    .await
    .unwrap();
    sqlx::query("SELECT * FROM skiplock.claim('exports', 5, 'worker-x')")
        .execute(pool)
        .await
        .unwrap();
    // A queue with key_max_running 1: a key's second job is held back by the claim.
    sqlx::query(
        "SELECT skiplock.enqueue('report', queue => 'reports', concurrency_key => 'tenant-7')
         FROM generate_series(1, 2)",
    )
    .execute(pool)
    .await
    .unwrap();
    skiplock::set_queue_limits(
        pool,
        "reports",
        skiplock::QueueLimits::default().key_max_running(1),
    )
    .await
    .unwrap();
    sqlx::query("SELECT * FROM skiplock.claim('reports', 5, 'worker-x')")
        .execute(pool)
        .await
        .unwrap();
    let dashboard = Dashboard::start(&db, &[]).await;
    let page = dashboard.page("/").await;
    let limits = &page[page.find("Global limits").expect("a limits table")..];
    let row = &limits[limits.find("<tr data-name=\"exports\">").unwrap()..];
    let row = &row[..row.find("</tr>").unwrap()];
    for (cell, expected) in [
        ("running", ">1"),
        ("max_running", ">1"),
        ("holding_back", "max running"),
        ("held_back", ">2"),
    ] {
        let at = row.find(&format!("data-limit=\"{cell}\"")).unwrap();
        let cell_html = &row[at..at + row[at..].find("</td>").unwrap()];
        assert!(
            cell_html.ends_with(expected) || cell_html.contains(&format!("{expected}<")),
            "{cell}: {cell_html}"
        );
    }
    let row = &limits[limits.find("<tr data-name=\"reports\">").unwrap()..];
    let row = &row[..row.find("</tr>").unwrap()];
    for (cell, expected) in [
        ("key_max_running", ">1"),
        ("keys_at_limit", ">1"),
        ("held_by_key", ">1"),
    ] {
        let at = row.find(&format!("data-limit=\"{cell}\"")).unwrap();
        let cell_html = &row[at..at + row[at..].find("</td>").unwrap()];
        assert!(cell_html.ends_with(expected), "{cell}: {cell_html}");
    }
    let metrics = dashboard.page("/metrics").await;
    for line in [
        "skiplock_queue_max_running{queue=\"exports\"} 1",
        "skiplock_queue_held_back{queue=\"exports\"} 2",
        "skiplock_queue_key_max_running{queue=\"reports\"} 1",
        "skiplock_queue_keys_at_limit{queue=\"reports\"} 1",
        "skiplock_queue_held_by_key{queue=\"reports\"} 1",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in {metrics}");
    }
}

#[tokio::test]
async fn jobs_list_filters_by_state_queue_kind_and_text() {
    let db = test_db().await;
    let seeded = seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &[]).await;

    let rows = |page: &str| -> Vec<i64> {
        page.match_indices("data-job-id=\"")
            .map(|(at, m)| {
                let rest = &page[at + m.len()..];
                rest[..rest.find('"').unwrap()].parse().unwrap()
            })
            .collect()
    };
    let dead = rows(&dashboard.page("/jobs?state=dead").await);
    let mut expected = seeded.dead.clone();
    expected.reverse();
    assert_eq!(dead, expected, "newest first");

    assert_eq!(
        rows(&dashboard.page("/jobs?state=cancelled").await),
        seeded.cancelled
    );
    let queued = rows(&dashboard.page("/jobs?state=queued&kind=send_email").await);
    for id in seeded.runnable.iter().chain(&seeded.scheduled) {
        assert!(queued.contains(id), "queued job {id} listed");
    }
    let mail = rows(&dashboard.page("/jobs?queue=mail&kind=send_email").await);
    assert_eq!(mail.len(), 4, "2 running and 2 dead");

    // Text in args, and in errors (case-insensitive), and LIKE wildcards taken literally.
    assert_eq!(
        rows(&dashboard.page("/jobs?q=ALICE%40example").await),
        vec![seeded.runnable[0]]
    );
    let in_errors = rows(&dashboard.page("/jobs?q=timeout+after").await);
    assert_eq!(in_errors.len(), 2);
    assert!(rows(&dashboard.page("/jobs?q=%25").await).is_empty());
    assert!(rows(&dashboard.page("/jobs?state=running&queue=default").await).is_empty());

    assert_eq!(dashboard.get("/jobs?state=bogus").await.status(), 400);
}

#[tokio::test]
async fn a_text_search_reads_a_bounded_number_of_jobs_per_page_and_goes_on() {
    let db = test_db().await;
    let seeded = seed(&db.pool).await;
    // More newer jobs than one search page reads, none of them matching.
    sqlx::query(
        "INSERT INTO skiplock.jobs (kind, args, scheduled_at)
         SELECT 'noise', jsonb_build_object('n', i), now() + interval '1 day'
         FROM generate_series(1, $1) i",
    )
    .bind(skiplock::db::dashboard::TEXT_SEARCH_SCAN + 10)
    .execute(&db.pool)
    .await
    .unwrap();
    let dashboard = Dashboard::start(&db, &[]).await;
    let first = dashboard.page("/jobs?q=alice").await;
    assert!(first.contains("No job matches."));
    assert!(first.contains("without filling the page"));
    let marker = "rel=\"next\" href=\"";
    let at = first.find(marker).expect("a link to search on") + marker.len();
    let next = first[at..at + first[at..].find('"').unwrap()].replace("&amp;", "&");
    assert!(next.starts_with("/jobs?q=alice&before="), "{next}");
    let found = dashboard.page(&next).await;
    assert!(found.contains(&format!("data-job-id=\"{}\"", seeded.runnable[0])));
}

#[tokio::test]
async fn jobs_list_pages_by_keyset_both_ways() {
    let db = test_db().await;
    seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &[]).await;
    let all: Vec<i64> = sqlx::query_scalar("SELECT id FROM skiplock.jobs ORDER BY id DESC")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let first = dashboard.page("/jobs?limit=4").await;
    assert!(
        !first.contains("rel=\"prev\""),
        "no newer page before the first"
    );
    let next = format!("/jobs?limit=4&before={}", all[3]);
    assert!(first.contains(&next.replace('&', "&amp;")), "{first}");
    let second = dashboard.page(&next).await;
    for id in &all[4..8] {
        assert!(second.contains(&format!("data-job-id=\"{id}\"")));
    }
    assert!(!second.contains(&format!("data-job-id=\"{}\"", all[3])));
    let back = format!("/jobs?limit=4&after={}", all[4]);
    assert!(second.contains(&back.replace('&', "&amp;")));
    let again = dashboard.page(&back).await;
    for id in &all[..4] {
        assert!(again.contains(&format!("data-job-id=\"{id}\"")));
    }
    let last = dashboard
        .page(&format!("/jobs?limit=4&before={}", all[all.len() - 2]))
        .await;
    assert!(
        !last.contains("rel=\"next\""),
        "no older page after the last"
    );
}

#[tokio::test]
async fn job_page_shows_args_errors_timing_dependencies_and_lane() {
    let db = test_db().await;
    let seeded = seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &[]).await;

    let dead = dashboard.page(&format!("/jobs/{}", seeded.dead[0])).await;
    assert!(dead.contains("bounce1@example.com"), "args");
    for message in [
        "connection reset",
        "timeout after 30s",
        "SMTP 550 mailbox 1 unavailable",
    ] {
        assert!(dead.contains(message), "error {message}");
    }
    assert!(
        dead.contains("run time") && dead.contains("waited"),
        "timing"
    );
    assert!(dead.contains(&format!("action=\"/jobs/{}/retry\"", seeded.dead[0])));
    assert!(
        !dead.contains("/cancel\""),
        "a dead job cannot be cancelled"
    );

    let child = dashboard.page(&format!("/jobs/{}", seeded.child)).await;
    assert!(child.contains("waits for"));
    assert!(child.contains(&format!("href=\"/jobs/{}\"", seeded.parent)));
    let parent = dashboard.page(&format!("/jobs/{}", seeded.parent)).await;
    assert!(parent.contains("is waited on by"));

    let next = dashboard.page(&format!("/jobs/{}", seeded.lane[1])).await;
    assert!(next.contains("account-7"));
    assert!(next.contains("This job is number 2 in line."), "{next}");

    let running = dashboard
        .page(&format!("/jobs/{}", seeded.running[0]))
        .await;
    assert!(running.contains("/cancel\""));
    assert!(
        !running.contains("/delete\""),
        "a running job cannot be deleted"
    );

    assert_eq!(dashboard.get("/jobs/999999999").await.status(), 404);
    assert_eq!(dashboard.get("/jobs/abc").await.status(), 400);
}

#[tokio::test]
async fn job_actions_retry_cancel_and_delete() {
    let db = test_db().await;
    let seeded = seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &[]).await;

    dashboard
        .act(&format!("/jobs/{}/retry", seeded.dead[0]), &[])
        .await;
    assert_eq!(
        state_if_any(&db.pool, seeded.dead[0]).await,
        Some(JobState::Queued)
    );

    dashboard
        .act(&format!("/jobs/{}/cancel", seeded.runnable[0]), &[])
        .await;
    assert_eq!(
        state_if_any(&db.pool, seeded.runnable[0]).await,
        Some(JobState::Cancelled)
    );
    // Cancelling a parent cancels the child waiting for it.
    dashboard
        .act(&format!("/jobs/{}/cancel", seeded.parent), &[])
        .await;
    assert_eq!(
        state_if_any(&db.pool, seeded.child).await,
        Some(JobState::Cancelled)
    );

    let location = dashboard
        .act(&format!("/jobs/{}/delete", seeded.succeeded[0]), &[])
        .await;
    assert!(location.contains("is%20deleted"), "{location}");
    assert_eq!(state_if_any(&db.pool, seeded.succeeded[0]).await, None);
    // A deleted finished job still counts in the history: 5 succeeded, 2 failed attempts.
    let history = dashboard.page("/history").await;
    assert!(
        history.contains("5\u{202f}succeeded") || history.contains("5 succeeded"),
        "{history}"
    );

    // Refusals are notices, not errors.
    let location = dashboard
        .act(&format!("/jobs/{}/delete", seeded.running[0]), &[])
        .await;
    assert!(location.contains("not%20deleted"), "{location}");
    assert_eq!(
        state_if_any(&db.pool, seeded.running[0]).await,
        Some(JobState::Running)
    );
    let location = dashboard
        .act(&format!("/jobs/{}/cancel", seeded.dead[1]), &[])
        .await;
    assert!(location.contains("not%20cancelled"));

    let csrf = dashboard.csrf().await;
    let fields = [("csrf", csrf.as_str()), ("confirmed", "yes")];
    let unknown = dashboard
        .post("/jobs/1/explode", &fields, HeaderMap::new())
        .await;
    assert_eq!(unknown.status(), 404);
}

#[tokio::test]
async fn queue_actions_retry_dead_pause_and_resume() {
    let db = test_db().await;
    let seeded = seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &[]).await;

    let location = dashboard
        .act("/queues/retry-dead", &[("queue", "mail")])
        .await;
    assert!(location.contains("2%20dead"), "{location}");
    for id in &seeded.dead {
        assert_eq!(state_if_any(&db.pool, *id).await, Some(JobState::Queued));
    }

    let paused = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT coalesce((SELECT paused FROM skiplock.queues WHERE name = 'mail'), false)",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    dashboard.act("/queues/pause", &[("queue", "mail")]).await;
    assert!(paused().await);
    let page = dashboard.page("/").await;
    assert!(page.contains("action=\"/queues/resume\""));
    assert!(page.contains("class=\"badge paused\""));
    dashboard.act("/queues/resume", &[("queue", "mail")]).await;
    assert!(!paused().await);

    let csrf = dashboard.csrf().await;
    let no_queue = dashboard
        .post(
            "/queues/pause",
            &[("csrf", &csrf), ("confirmed", "yes")],
            HeaderMap::new(),
        )
        .await;
    assert_eq!(no_queue.status(), 400);
}

#[tokio::test]
async fn an_unconfirmed_action_asks_first_and_changes_nothing() {
    let db = test_db().await;
    let seeded = seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &[]).await;
    let csrf = dashboard.csrf().await;
    let path = format!("/jobs/{}/retry", seeded.dead[0]);
    let response = dashboard
        .post(
            &path,
            &[("csrf", &csrf), ("return_to", "/jobs")],
            HeaderMap::new(),
        )
        .await;
    assert_eq!(response.status(), 200);
    let page = response.text().await.unwrap();
    assert!(page.contains("Please confirm"));
    assert!(page.contains("name=\"confirmed\" value=\"yes\""));
    assert_eq!(
        state_if_any(&db.pool, seeded.dead[0]).await,
        Some(JobState::Dead)
    );
}

#[tokio::test]
async fn history_page_shows_days_and_hours() {
    let db = test_db().await;
    seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &[]).await;
    let page = dashboard.page("/history").await;
    assert!(page.contains("Last 30 days"));
    assert!(page.contains("<svg class=\"history-chart\""));
    // 5 succeeded; 2 + 3 + 3 failed attempts; 2 dead; 1 cancelled.
    assert!(
        page.contains("5 succeeded, 8 failed attempts, 2 dead, 1 cancelled."),
        "{page}"
    );
    let hours = dashboard
        .page("/history?granularity=hour&days=1&queue=mail")
        .await;
    assert!(
        hours.contains("0 succeeded, 6 failed attempts, 2 dead, 0 cancelled."),
        "{hours}"
    );
    assert!(hours.contains("per hour, last 24 hours"));
    assert_eq!(
        dashboard.get("/history?granularity=week").await.status(),
        400
    );
}

#[tokio::test]
async fn stats_and_throughput_api_return_json() {
    let db = test_db().await;
    seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &[]).await;
    let stats = dashboard.json("/api/v1/stats").await;
    assert_eq!(stats["total"]["runnable"], 3);
    assert_eq!(stats["total"]["running"], 2);
    assert_eq!(stats["total"]["succeeded_last_hour"], 5);
    assert_eq!(stats["workers"][0]["identity"], "worker-a");
    assert_eq!(stats["workers"][0]["jobs"], 2);
    let dead: i64 = stats["ended"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["dead"].as_i64().unwrap())
        .sum();
    assert_eq!(dead, 2);

    let throughput = dashboard.json("/api/v1/throughput").await;
    let sum = |key: &str| -> i64 {
        throughput[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p[1].as_i64().unwrap())
            .sum()
    };
    assert_eq!(sum("succeeded"), 5);
    assert_eq!(sum("failed"), 8);
    let now = throughput["now"].as_i64().unwrap();
    let later = dashboard
        .json(&format!("/api/v1/throughput?since={now}"))
        .await;
    assert_eq!(later["succeeded"], serde_json::json!([]));
}

#[tokio::test]
async fn metrics_speak_prometheus_text() {
    let db = test_db().await;
    seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &[]).await;
    let response = dashboard.get("/metrics").await;
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4")
    );
    let text = response.text().await.unwrap();
    for line in [
        "# TYPE skiplock_jobs gauge",
        "skiplock_jobs{queue=\"default\",kind=\"send_email\",state=\"queued\"} 3",
        "skiplock_jobs{queue=\"mail\",kind=\"send_email\",state=\"running\"} 2",
        "skiplock_jobs{queue=\"mail\",kind=\"send_email\",state=\"dead\"} 2",
        "skiplock_queue_paused{queue=\"default\"} 0",
        "skiplock_workers 1",
        "# TYPE skiplock_jobs_finished_total counter",
        "skiplock_jobs_finished_total{queue=\"default\",kind=\"resize\",outcome=\"succeeded\"} 5",
        "skiplock_jobs_finished_total{queue=\"mail\",kind=\"send_email\",outcome=\"dead\"} 2",
        "skiplock_job_attempts_failed_total{queue=\"mail\",kind=\"send_email\"} 6",
        "# TYPE skiplock_job_run_seconds histogram",
        // Each seeded success ran 2 s: under the 2.5 s bound, over the 1 s bound.
        "skiplock_job_run_seconds_bucket{queue=\"default\",kind=\"resize\",le=\"1\"} 0",
        "skiplock_job_run_seconds_bucket{queue=\"default\",kind=\"resize\",le=\"2.5\"} 5",
        "skiplock_job_run_seconds_bucket{queue=\"default\",kind=\"resize\",le=\"+Inf\"} 5",
        "skiplock_job_run_seconds_sum{queue=\"default\",kind=\"resize\"} 10",
        "skiplock_job_run_seconds_count{queue=\"default\",kind=\"resize\"} 5",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
    assert!(text.contains("skiplock_queue_lag_seconds{queue=\"default\"} "));
}

#[tokio::test]
async fn assets_headers_and_unknown_routes() {
    let db = test_db().await;
    let dashboard = Dashboard::start(&db, &[]).await;
    let js = dashboard.get("/static/app.js").await;
    assert_eq!(js.status(), 200);
    assert!(
        js.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/javascript")
    );
    assert!(js.text().await.unwrap().contains("data-confirm"));
    let css = dashboard.get("/static/app.css").await;
    assert!(
        css.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/css")
    );

    let page = dashboard.get("/").await;
    let csp = page.headers()["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"));
    assert_eq!(page.headers()["x-frame-options"], "DENY");
    let body = page.text().await.unwrap();
    assert!(
        !body.contains("http://") && !body.contains("https://"),
        "no external asset"
    );
    assert!(body.contains("No unfinished jobs"));

    assert_eq!(dashboard.get("/nope").await.status(), 404);
    let get_action = dashboard.get("/jobs/1/retry").await;
    assert_eq!(get_action.status(), 405, "actions are POST only");
}

#[tokio::test]
async fn every_page_answers_with_rows_holding_infinite_timestamps() {
    // Regression: such rows (accepted by the table, written by hand) made the pages that
    // list them panic in the decoder, and the overview's statements fail.
    let db = test_db().await;
    let ids: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO skiplock.jobs (kind, args, scheduled_at) VALUES
             ('noop', '{}', '-infinity'), ('noop', '{}', 'infinity')
         RETURNING id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for insert in [
        "INSERT INTO skiplock.jobs (kind, args, state, attempt, claimed_by, claimed_at,
                                    heartbeat_at, claim_token)
         VALUES ('noop', '{}', 'running', 1, 'by-hand', '-infinity', 'infinity',
                 gen_random_uuid())",
        "INSERT INTO skiplock.jobs (kind, args, state, attempt, claimed_at, finished_at)
         VALUES ('noop', '{}', 'succeeded', 1, '-infinity', 'infinity')",
    ] {
        sqlx::query(insert).execute(&db.pool).await.unwrap();
    }
    let dashboard = Dashboard::start(&db, &[]).await;
    let mut paths = vec![
        "/".to_owned(),
        "/overview/live?part=cards".to_owned(),
        "/overview/live?part=tables".to_owned(),
        "/jobs".to_owned(),
        "/history".to_owned(),
        "/api/v1/stats".to_owned(),
        "/api/v1/throughput".to_owned(),
        "/metrics".to_owned(),
    ];
    paths.extend(ids.iter().map(|id| format!("/jobs/{id}")));
    for path in &paths {
        let response = dashboard.get(path).await;
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        assert_eq!(status, 200, "{path}: {body}");
    }
    let list = dashboard.page("/jobs").await;
    assert!(list.contains("-infinity"), "{list}");
}

#[tokio::test]
async fn a_job_path_that_is_not_an_id_is_a_clear_400() {
    let db = test_db().await;
    let dashboard = Dashboard::start(&db, &[]).await;
    let response = dashboard.get("/jobs/abc").await;
    assert_eq!(response.status(), 400);
    let body = response.text().await.unwrap();
    assert!(
        body.contains("`abc` is not a job id; job ids are whole numbers, like /jobs/42"),
        "{body}"
    );
}
