//! Who may look and who may act: bind safety, token and Basic auth, the loopback host
//! check, CSRF, read-only mode.

use reqwest::header::{HeaderMap, HeaderValue};

use skiplock::JobState;

use crate::common::fixtures::state_if_any;
use crate::common::test_db;
use crate::support::{Dashboard, command, csrf_in, seed};

const TOKEN: &str = "t0ken-for-tests";

/// Asserts that each path answers 401 with a `WWW-Authenticate` challenge of `scheme`.
async fn challenged(dashboard: &Dashboard, paths: &[&str], scheme: &str) {
    for path in paths {
        let response = dashboard.get(path).await;
        assert_eq!(response.status(), 401, "{path}");
        let challenge = response.headers()["www-authenticate"].to_str().unwrap();
        assert!(challenge.starts_with(scheme), "{path}: {challenge}");
    }
}

#[tokio::test]
async fn refuses_a_public_bind_without_credentials() {
    let db = test_db().await;
    let output = command(&db, &["--bind", "0.0.0.0:0"])
        .output()
        .await
        .expect("run skiplock dashboard");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("refusing to listen on 0.0.0.0:0 without authentication")
            && stderr.contains("--token")
            && stderr.contains("--basic-auth"),
        "{stderr}"
    );
    let weak = command(&db, &["--bind", "0.0.0.0:0", "--token", "short"])
        .output()
        .await
        .unwrap();
    assert_eq!(weak.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&weak.stderr).contains("at least 8 characters"));
    let bad = command(&db, &["--basic-auth", "nocolon"])
        .output()
        .await
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("USER:PASS"));
}

#[tokio::test]
async fn a_public_bind_with_a_token_starts() {
    let db = test_db().await;
    let dashboard = Dashboard::start(&db, &["--bind", "0.0.0.0:0", "--token", TOKEN]).await;
    // Listening on every interface; reached here through loopback.
    let port = dashboard.base.rsplit(':').next().unwrap().to_owned();
    let response = dashboard
        .client
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}

#[tokio::test]
async fn token_mode_rejects_without_the_token_and_logs_browsers_in() {
    let db = test_db().await;
    let seeded = seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &["--token", TOKEN]).await;

    for path in [
        "/",
        "/jobs",
        "/history",
        "/overview/live",
        &format!("/jobs/{}", seeded.dead[0]),
    ] {
        let response = dashboard.get(path).await;
        assert_eq!(response.status(), 401, "{path}");
        assert!(
            response.text().await.unwrap().contains("action=\"/login\""),
            "{path}: a login form"
        );
    }
    challenged(
        &dashboard,
        &["/api/v1/stats", "/api/v1/throughput", "/metrics"],
        "Bearer",
    )
    .await;
    let wrong = dashboard
        .client
        .get(dashboard.url("/metrics"))
        .bearer_auth("wrong-token")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);

    // A POST without the token changes nothing, whatever else it carries.
    let page = dashboard
        .client
        .get(dashboard.url("/"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let csrf = csrf_in(&page.text().await.unwrap()).unwrap();
    let path = format!("/jobs/{}/retry", seeded.dead[0]);
    let fields = [("csrf", csrf.as_str()), ("confirmed", "yes")];
    let response = dashboard.post(&path, &fields, HeaderMap::new()).await;
    assert_eq!(response.status(), 401);
    assert_eq!(
        state_if_any(&db.pool, seeded.dead[0]).await,
        Some(JobState::Dead)
    );

    // The login form: a wrong token is refused, the right one sets a cookie.
    assert_eq!(dashboard.get("/login").await.status(), 200);
    assert_eq!(dashboard.get("/static/app.css").await.status(), 200);
    let refused = dashboard
        .post(
            "/login",
            &[("token", "nope-nope-nope"), ("next", "/jobs")],
            HeaderMap::new(),
        )
        .await;
    assert_eq!(refused.status(), 401);
    let login = dashboard
        .post(
            "/login",
            &[("token", TOKEN), ("next", "/jobs")],
            HeaderMap::new(),
        )
        .await;
    assert_eq!(login.status(), 303);
    assert_eq!(login.headers()["location"], "/jobs");
    let cookie = login.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let pair = cookie.split(';').next().unwrap().to_owned();
    let mut headers = HeaderMap::new();
    headers.insert("cookie", HeaderValue::from_str(&pair).unwrap());
    let with_cookie = dashboard
        .client
        .get(dashboard.url("/jobs"))
        .headers(headers.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(with_cookie.status(), 200);
    // An open redirect is not possible through `next`.
    let away = dashboard
        .post(
            "/login",
            &[("token", TOKEN), ("next", "//evil.example/")],
            HeaderMap::new(),
        )
        .await;
    assert_eq!(away.headers()["location"], "/");

    // With the cookie and the CSRF token, the action goes through.
    let response = dashboard.post(&path, &fields, headers).await;
    assert_eq!(response.status(), 303);
    assert_eq!(
        state_if_any(&db.pool, seeded.dead[0]).await,
        Some(JobState::Queued)
    );
}

#[tokio::test]
async fn basic_auth_mode_rejects_without_credentials() {
    let db = test_db().await;
    let seeded = seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &["--basic-auth", "ops:correct-horse"]).await;
    challenged(
        &dashboard,
        &["/", "/jobs", "/history", "/api/v1/stats", "/metrics"],
        "Basic realm=",
    )
    .await;
    let wrong = dashboard
        .client
        .get(dashboard.url("/"))
        .basic_auth("ops", Some("wrong"))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let page = dashboard
        .client
        .get(dashboard.url("/"))
        .basic_auth("ops", Some("correct-horse"))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let csrf = csrf_in(&page.text().await.unwrap()).unwrap();

    let path = "/queues/retry-dead";
    let fields = [
        ("csrf", csrf.as_str()),
        ("confirmed", "yes"),
        ("queue", "mail"),
    ];
    let anonymous = dashboard.post(path, &fields, HeaderMap::new()).await;
    assert_eq!(anonymous.status(), 401);
    assert_eq!(
        state_if_any(&db.pool, seeded.dead[0]).await,
        Some(JobState::Dead)
    );
    let mut headers = HeaderMap::new();
    headers.insert(
        "authorization",
        HeaderValue::from_static("Basic b3BzOmNvcnJlY3QtaG9yc2U="),
    );
    let allowed = dashboard.post(path, &fields, headers).await;
    assert_eq!(allowed.status(), 303);
    assert_eq!(
        state_if_any(&db.pool, seeded.dead[0]).await,
        Some(JobState::Queued)
    );
}

#[tokio::test]
async fn actions_need_the_csrf_token_and_a_same_origin_request() {
    let db = test_db().await;
    let seeded = seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &[]).await;
    let csrf = dashboard.csrf().await;
    let path = format!("/jobs/{}/retry", seeded.dead[0]);

    let missing = dashboard
        .post(&path, &[("confirmed", "yes")], HeaderMap::new())
        .await;
    assert_eq!(missing.status(), 403);
    assert!(missing.text().await.unwrap().contains("CSRF"));
    let wrong = dashboard
        .post(
            &path,
            &[
                (
                    "csrf",
                    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                ),
                ("confirmed", "yes"),
            ],
            HeaderMap::new(),
        )
        .await;
    assert_eq!(wrong.status(), 403);

    let fields = [("csrf", csrf.as_str()), ("confirmed", "yes")];
    let mut cross_origin = HeaderMap::new();
    cross_origin.insert("origin", HeaderValue::from_static("https://evil.example"));
    assert_eq!(
        dashboard.post(&path, &fields, cross_origin).await.status(),
        403
    );
    let mut cross_site = HeaderMap::new();
    cross_site.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
    assert_eq!(
        dashboard.post(&path, &fields, cross_site).await.status(),
        403
    );
    // Queue actions are guarded alike.
    let queue = dashboard
        .post(
            "/queues/pause",
            &[("queue", "mail"), ("confirmed", "yes")],
            HeaderMap::new(),
        )
        .await;
    assert_eq!(queue.status(), 403);
    assert_eq!(
        state_if_any(&db.pool, seeded.dead[0]).await,
        Some(JobState::Dead)
    );

    // Behind a proxy that rewrites Host, the browser's host arrives as X-Forwarded-Host.
    let mut proxied = HeaderMap::new();
    proxied.insert("origin", HeaderValue::from_static("https://dash.example"));
    proxied.insert("x-forwarded-host", HeaderValue::from_static("dash.example"));
    let other = format!("/jobs/{}/retry", seeded.dead[1]);
    assert_eq!(dashboard.post(&other, &fields, proxied).await.status(), 303);

    // Same origin with the token: done.
    let mut same_origin = HeaderMap::new();
    let origin = HeaderValue::from_str(&dashboard.base).unwrap();
    same_origin.insert("origin", origin);
    same_origin.insert("sec-fetch-site", HeaderValue::from_static("same-origin"));
    assert_eq!(
        dashboard.post(&path, &fields, same_origin).await.status(),
        303
    );
    assert_eq!(
        state_if_any(&db.pool, seeded.dead[0]).await,
        Some(JobState::Queued)
    );
}

#[tokio::test]
async fn without_credentials_only_loopback_host_names_are_served() {
    let db = test_db().await;
    let dashboard = Dashboard::start(&db, &[]).await;
    let rebound = dashboard
        .client
        .get(dashboard.url("/api/v1/stats"))
        .header("host", "attacker.example:7433")
        .send()
        .await
        .unwrap();
    assert_eq!(rebound.status(), 421);
    for host in ["localhost:7433", "127.0.0.1", "[::1]:80"] {
        let response = dashboard
            .client
            .get(dashboard.url("/api/v1/stats"))
            .header("host", host)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{host}");
    }
}

#[tokio::test]
async fn read_only_mode_shows_no_actions_and_refuses_them() {
    let db = test_db().await;
    let seeded = seed(&db.pool).await;
    let dashboard = Dashboard::start(&db, &["--read-only"]).await;
    let overview = dashboard.page("/").await;
    assert!(overview.contains("read-only"));
    assert!(!overview.contains("method=\"post\""), "no action forms");
    let job = dashboard.page(&format!("/jobs/{}", seeded.dead[0])).await;
    assert!(!job.contains("method=\"post\""));
    for (path, extra) in [
        (format!("/jobs/{}/retry", seeded.dead[0]), None),
        (format!("/jobs/{}/delete", seeded.dead[0]), None),
        ("/queues/pause".to_owned(), Some(("queue", "mail"))),
    ] {
        let mut fields = vec![("csrf", "anything"), ("confirmed", "yes")];
        fields.extend(extra);
        let response = dashboard.post(&path, &fields, HeaderMap::new()).await;
        assert_eq!(response.status(), 403, "{path}");
        assert!(response.text().await.unwrap().contains("read-only"));
    }
    assert_eq!(
        state_if_any(&db.pool, seeded.dead[0]).await,
        Some(JobState::Dead)
    );
}
