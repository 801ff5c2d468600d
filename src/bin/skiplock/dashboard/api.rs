//! Machine-readable routes: `GET /api/v1/stats` and `GET /api/v1/throughput` (JSON) and
//! `GET /metrics` (Prometheus text format 0.0.4).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{Query, State as StateExtractor};
use axum::http::header;
use axum::response::IntoResponse;
use serde_json::{Value, json};
use skiplock::admin::{HistoryTotals, history_totals};
use skiplock::unstable_cli::job_history_run_bounds;
use skiplock::unstable_cli::{Throughput, dashboard_throughput};

use super::overview::Overview;
use super::{AppError, AppResult, State};

/// How long `/metrics` reuses the lifetime totals it read. Reading them visits every
/// retained finished job, and counters a little stale do not hurt `rate()`.
const TOTALS_TTL: Duration = Duration::from_secs(30);

/// Lifetime totals as `/metrics` read them last.
pub struct CachedTotals {
    read_at: Instant,
    totals: Vec<HistoryTotals>,
}

/// Seconds of history the live chart asks for when it starts.
const THROUGHPUT_WINDOW_SECONDS: i64 = 3600;

/// `GET /api/v1/stats`: the overview's numbers. `total`, `queues`, `kinds` and `rows` are
/// those of `skiplock stats --json`; `ended` adds retained dead and cancelled jobs per
/// queue and kind, `workers` the workers holding jobs.
pub async fn stats(StateExtractor(state): StateExtractor<State>) -> AppResult<Json<Value>> {
    let overview = Overview::load(&state).await?;
    let stats = &overview.stats;
    Ok(Json(json!({
        "at": stats.at,
        "total": stats.total(),
        "queues": stats.by_queue(),
        "kinds": stats.by_kind(),
        "rows": stats.rows,
        "ended": overview.ended,
        "paused_queues": overview.paused,
        "workers": overview.workers,
    })))
}

#[derive(serde::Deserialize)]
pub struct ThroughputQuery {
    /// Unix seconds; only later seconds are returned. Default: an hour ago.
    since: Option<i64>,
}

/// `GET /api/v1/throughput?since=UNIX_SECONDS`: successes and failed attempts per second.
pub async fn throughput(
    StateExtractor(state): StateExtractor<State>,
    Query(query): Query<ThroughputQuery>,
) -> AppResult<Json<Throughput>> {
    let since = match query.since {
        Some(since) => since,
        None => chrono::Utc::now().timestamp() - THROUGHPUT_WINDOW_SECONDS,
    };
    Ok(Json(dashboard_throughput(&state.pool, since).await?))
}

/// `GET /metrics`.
pub async fn metrics(StateExtractor(state): StateExtractor<State>) -> AppResult<impl IntoResponse> {
    let pool = &state.pool;
    let (overview, totals, bounds) =
        tokio::try_join!(Overview::load(&state), totals(&state), async {
            job_history_run_bounds(pool).await.map_err(AppError::from)
        },)?;
    let mut out = String::new();
    let stats = &overview.stats;

    family(
        &mut out,
        "skiplock_jobs",
        "gauge",
        "Jobs by queue, kind and state: waiting, queued (runnable now), scheduled (queued for later), running; dead and cancelled ones not pruned yet.",
    );
    for row in &stats.rows {
        let c = &row.counts;
        for (state_name, n) in [
            ("waiting", c.waiting),
            ("queued", c.runnable),
            ("scheduled", c.scheduled),
            ("running", c.running),
        ] {
            sample(
                &mut out,
                "skiplock_jobs",
                &[
                    ("queue", &row.queue),
                    ("kind", &row.kind),
                    ("state", state_name),
                ],
                n as f64,
            );
        }
    }
    for ended in &overview.ended {
        for (state_name, n) in [("dead", ended.dead), ("cancelled", ended.cancelled)] {
            sample(
                &mut out,
                "skiplock_jobs",
                &[
                    ("queue", &ended.queue),
                    ("kind", &ended.kind),
                    ("state", state_name),
                ],
                n as f64,
            );
        }
    }

    family(
        &mut out,
        "skiplock_queue_lag_seconds",
        "gauge",
        "Seconds since the oldest runnable job of the queue became due (0 when none is).",
    );
    for queue in stats.by_queue() {
        sample(
            &mut out,
            "skiplock_queue_lag_seconds",
            &[("queue", &queue.queue)],
            queue.counts.lag_seconds,
        );
    }
    family(
        &mut out,
        "skiplock_queue_paused",
        "gauge",
        "1 if the queue is paused.",
    );
    let mut queues: Vec<(String, bool)> = stats
        .by_queue()
        .into_iter()
        .map(|q| (q.queue, q.paused))
        .collect();
    for name in &overview.paused {
        if !queues.iter().any(|(q, _)| q == name) {
            queues.push((name.clone(), true));
        }
    }
    for (queue, paused) in &queues {
        sample(
            &mut out,
            "skiplock_queue_paused",
            &[("queue", queue)],
            f64::from(u8::from(*paused)),
        );
    }
    limit_families(&mut out, &overview.limits);
    family(
        &mut out,
        "skiplock_jobs_per_second",
        "gauge",
        "Successes per second over the last minute.",
    );
    for row in &stats.rows {
        sample(
            &mut out,
            "skiplock_jobs_per_second",
            &[("queue", &row.queue), ("kind", &row.kind)],
            row.counts.per_second,
        );
    }
    family(
        &mut out,
        "skiplock_workers",
        "gauge",
        "Workers holding at least one running job.",
    );
    sample(
        &mut out,
        "skiplock_workers",
        &[],
        overview.workers.len() as f64,
    );

    family(
        &mut out,
        "skiplock_jobs_finished_total",
        "counter",
        "Jobs finished, by outcome (the history rollup plus jobs not pruned yet).",
    );
    for t in &totals {
        for (outcome, n) in [
            ("succeeded", t.succeeded),
            ("dead", t.dead),
            ("cancelled", t.cancelled),
        ] {
            sample(
                &mut out,
                "skiplock_jobs_finished_total",
                &[("queue", &t.queue), ("kind", &t.kind), ("outcome", outcome)],
                n as f64,
            );
        }
    }
    family(
        &mut out,
        "skiplock_job_attempts_failed_total",
        "counter",
        "Failed attempts of finished jobs (retried, dead or reaped).",
    );
    for t in &totals {
        sample(
            &mut out,
            "skiplock_job_attempts_failed_total",
            &[("queue", &t.queue), ("kind", &t.kind)],
            t.failed as f64,
        );
    }
    family(
        &mut out,
        "skiplock_job_run_seconds",
        "histogram",
        "Run time of the last attempt (finished - claimed) of succeeded and dead jobs.",
    );
    for t in &totals {
        let labels = [("queue", t.queue.as_str()), ("kind", t.kind.as_str())];
        let mut cumulative = 0i64;
        for (i, bound) in bounds.iter().enumerate() {
            cumulative += t.run_histogram.get(i).copied().unwrap_or(0);
            let le = bound.to_string();
            sample(
                &mut out,
                "skiplock_job_run_seconds_bucket",
                &[labels[0], labels[1], ("le", &le)],
                cumulative as f64,
            );
        }
        sample(
            &mut out,
            "skiplock_job_run_seconds_bucket",
            &[labels[0], labels[1], ("le", "+Inf")],
            t.run_count as f64,
        );
        sample(
            &mut out,
            "skiplock_job_run_seconds_sum",
            &labels,
            t.run_seconds,
        );
        sample(
            &mut out,
            "skiplock_job_run_seconds_count",
            &labels,
            t.run_count as f64,
        );
    }
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    ))
}

/// The lifetime totals, read at most once per [`TOTALS_TTL`]; concurrent scrapes wait for
/// one read.
async fn totals(state: &State) -> AppResult<Vec<HistoryTotals>> {
    let mut cache = state.totals_cache.lock().await;
    if let Some(cached) = cache.as_ref().filter(|c| c.read_at.elapsed() < TOTALS_TTL) {
        return Ok(cached.totals.clone());
    }
    let totals = history_totals(&state.pool).await?;
    *cache = Some(CachedTotals {
        read_at: Instant::now(),
        totals: totals.clone(),
    });
    Ok(totals)
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: f64) {
    out.push_str(name);
    if !labels.is_empty() {
        out.push('{');
        for (i, (key, value)) in labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let _ = write!(out, "{key}=\"{}\"", escape_label(value));
        }
        out.push('}');
    }
    let _ = writeln!(out, " {value}");
}

/// Label values escape backslash, double quote and line feed.
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// What a limit series reads of a queue's limits (`None`: the queue has no such limit).
type LimitValue = fn(&skiplock::QueueLimitStatus) -> Option<f64>;

/// The global limits of the queues that have one (`skiplock.queue_limits`): each limit,
/// its use now, and the runnable jobs it holds back.
fn limit_families(out: &mut String, limits: &[skiplock::QueueLimitStatus]) {
    let series: [(&str, &str, LimitValue); 12] = [
        (
            "skiplock_queue_max_running",
            "The queue's max_running: at most this many of its jobs run at once across every worker.",
            |s| s.limits.max_running.map(|n| f64::from(n.get())),
        ),
        (
            "skiplock_queue_rate_limit_starts",
            "The queue's rate_limit: at most this many starts in any window of rate_period.",
            |s| s.limits.rate.map(|r| f64::from(r.starts.get())),
        ),
        (
            "skiplock_queue_rate_period_seconds",
            "The queue's rate_period.",
            |s| s.limits.rate.map(|r| r.per.as_secs_f64()),
        ),
        (
            "skiplock_queue_started_in_period",
            "Starts of the rate-limited queue within the last rate_period.",
            |s| s.limits.rate.map(|_| s.started_in_period as f64),
        ),
        (
            "skiplock_queue_held_back",
            "Runnable jobs of the queue that a global limit keeps from starting now.",
            |s| Some(s.held_back as f64),
        ),
        (
            "skiplock_queue_key_max_running",
            "The queue's key_max_running: at most this many jobs of one concurrency key run at once across every worker.",
            |s| s.limits.key_max_running.map(|n| f64::from(n.get())),
        ),
        (
            "skiplock_queue_keys_at_limit",
            "Concurrency keys of the queue with key_max_running jobs running now.",
            |s| s.limits.key_max_running.map(|_| s.keys_at_limit as f64),
        ),
        (
            "skiplock_queue_key_rate_limit_starts",
            "The queue's key_rate_limit: at most this many starts of one concurrency key in any window of key_rate_period.",
            |s| s.limits.key_rate.map(|r| f64::from(r.starts.get())),
        ),
        (
            "skiplock_queue_key_rate_period_seconds",
            "The queue's key_rate_period.",
            |s| s.limits.key_rate.map(|r| r.per.as_secs_f64()),
        ),
        (
            "skiplock_queue_keys_rate_limited",
            "Concurrency keys of the queue whose rate window is full now.",
            |s| s.limits.key_rate.map(|_| s.keys_rate_limited as f64),
        ),
        (
            "skiplock_queue_held_by_key",
            "Jobs of the queue waiting until their concurrency key has room again (key_max_running or key_rate_limit) or for its turn (key_claimable).",
            |s| {
                (s.limits.key_max_running.is_some()
                    || s.limits.key_rate.is_some()
                    || s.limits.key_claimable.is_some())
                .then_some(s.held_by_key as f64)
            },
        ),
        (
            "skiplock_queue_key_claimable",
            "The queue's key_claimable (fair queueing by key): at most this many due jobs of one concurrency key queued at once.",
            |s| s.limits.key_claimable.map(|n| f64::from(n.get())),
        ),
    ];
    for (name, help, value) in series {
        family(out, name, "gauge", help);
        for status in limits {
            if let Some(v) = value(status) {
                sample(out, name, &[("queue", &status.queue)], v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_samples_with_escaped_labels() {
        let mut out = String::new();
        sample(&mut out, "m", &[("queue", "a\"b\\c\nd")], 1.5);
        sample(&mut out, "n", &[], 2.0);
        assert_eq!(out, "m{queue=\"a\\\"b\\\\c\\nd\"} 1.5\nn 2\n");
    }
}
