//! `GET /`: the overview. Its numbers live in a fragment (`GET /overview/live`) that the
//! page's script fetches again every few seconds; the chart fetches
//! `/api/v1/throughput`.

use std::collections::BTreeMap;

use axum::extract::{Query, State as StateExtractor};
use maud::{Markup, html};
use skiplock::stats::{Counts, Stats};
use skiplock::unstable_cli::{EndedCounts, WorkerRow, dashboard_ended_counts, dashboard_workers};

use super::layout::{self, Nav, count, duration, jobs_link};
use super::{AppError, AppResult, AppState, State};

/// Everything the overview shows, read at once.
pub struct Overview {
    pub stats: Stats,
    pub ended: Vec<EndedCounts>,
    pub workers: Vec<WorkerRow>,
    pub paused: Vec<String>,
    pub limits: Vec<skiplock::QueueLimitStatus>,
}

/// One line of the queue or kind table.
struct Line {
    name: String,
    paused: bool,
    counts: Counts,
    dead: i64,
    cancelled: i64,
}

impl Overview {
    pub async fn load(state: &AppState) -> AppResult<Overview> {
        let pool = &state.pool;
        let (stats, ended, workers, paused, limits) = tokio::try_join!(
            async { skiplock::stats::stats(pool).await.map_err(AppError::from) },
            async { dashboard_ended_counts(pool).await.map_err(AppError::from) },
            async { dashboard_workers(pool).await.map_err(AppError::from) },
            async { skiplock::paused_queues(pool).await.map_err(AppError::from) },
            async { skiplock::queue_limits(pool).await.map_err(AppError::from) },
        )?;
        Ok(Overview {
            stats,
            ended,
            workers,
            paused,
            limits,
        })
    }

    fn queues(&self) -> Vec<Line> {
        let mut lines: BTreeMap<String, Line> = BTreeMap::new();
        for queue in self.stats.by_queue() {
            lines.insert(
                queue.queue.clone(),
                Line {
                    paused: queue.paused,
                    name: queue.queue,
                    counts: queue.counts,
                    dead: 0,
                    cancelled: 0,
                },
            );
        }
        for ended in &self.ended {
            let entry = lines.entry(ended.queue.clone()).or_insert_with(|| Line {
                name: ended.queue.clone(),
                paused: self.paused.contains(&ended.queue),
                counts: Counts::default(),
                dead: 0,
                cancelled: 0,
            });
            entry.dead += ended.dead;
            entry.cancelled += ended.cancelled;
        }
        for name in &self.paused {
            lines.entry(name.clone()).or_insert_with(|| Line {
                name: name.clone(),
                paused: true,
                counts: Counts::default(),
                dead: 0,
                cancelled: 0,
            });
        }
        lines.into_values().collect()
    }

    fn kinds(&self) -> Vec<Line> {
        let mut lines: BTreeMap<String, Line> = self
            .stats
            .by_kind()
            .into_iter()
            .map(|kind| {
                let line = Line {
                    name: kind.kind.clone(),
                    paused: false,
                    counts: kind.counts,
                    dead: 0,
                    cancelled: 0,
                };
                (kind.kind, line)
            })
            .collect();
        for ended in &self.ended {
            let entry = lines.entry(ended.kind.clone()).or_insert_with(|| Line {
                name: ended.kind.clone(),
                paused: false,
                counts: Counts::default(),
                dead: 0,
                cancelled: 0,
            });
            entry.dead += ended.dead;
            entry.cancelled += ended.cancelled;
        }
        lines.into_values().collect()
    }
}

#[derive(serde::Deserialize)]
pub struct NoticeQuery {
    notice: Option<String>,
}

pub async fn page(
    StateExtractor(state): StateExtractor<State>,
    Query(query): Query<NoticeQuery>,
) -> AppResult<Markup> {
    let overview = Overview::load(&state).await?;
    let body = html! {
        h1 { "Overview" }
        div.live data-src="/overview/live?part=cards" { (cards(&overview)) }
        section.chart-box {
            h2 { "Succeeded and failed per second, last hour" }
            div #throughput-chart.chart data-src="/api/v1/throughput" {
                p.muted { "The live chart needs JavaScript." }
            }
            p.legend {
                span.swatch.succeeded {} "succeeded " span #succeeded-total {}
                span.swatch.failed {} "failed attempts " span #failed-total {}
            }
        }
        div.live data-src="/overview/live?part=tables" { (tables(&state, &overview)) }
    };
    Ok(layout::page(
        &state,
        Nav::Overview,
        "Overview",
        query.notice.as_deref(),
        body,
    ))
}

#[derive(serde::Deserialize)]
pub struct LiveQuery {
    part: Option<String>,
}

/// `GET /overview/live?part=cards|tables`: a part of the overview, as an HTML fragment.
pub async fn live(
    StateExtractor(state): StateExtractor<State>,
    Query(query): Query<LiveQuery>,
) -> AppResult<Markup> {
    let overview = Overview::load(&state).await?;
    match query.part.as_deref() {
        Some("cards") => Ok(cards(&overview)),
        Some("tables") | None => Ok(tables(&state, &overview)),
        Some(other) => Err(AppError::NotFound(format!("no overview part {other:?}"))),
    }
}

fn cards(overview: &Overview) -> Markup {
    let total = overview.stats.total();
    let dead: i64 = overview.ended.iter().map(|e| e.dead).sum();
    let link = |state_name: &str| Some(jobs_link(Some(state_name), None, None));
    let cards: [(&str, &str, String, Option<String>); 10] = [
        (
            "runnable",
            "Runnable",
            count(total.runnable),
            link("queued"),
        ),
        (
            "scheduled",
            "Scheduled",
            count(total.scheduled),
            link("queued"),
        ),
        ("waiting", "Waiting", count(total.waiting), link("waiting")),
        ("running", "Running", count(total.running), link("running")),
        (
            "succeeded_last_hour",
            "Succeeded (1h)",
            count(total.succeeded_last_hour),
            link("succeeded"),
        ),
        (
            "dead_last_hour",
            "Dead (1h)",
            count(total.dead_last_hour),
            link("dead"),
        ),
        ("dead", "Dead (retained)", count(dead), link("dead")),
        ("lag", "Lag", duration(total.lag_seconds), None),
        (
            "per_second",
            "Jobs/s (1m)",
            format!("{:.1}", total.per_second),
            None,
        ),
        (
            "workers",
            "Workers",
            count(overview.workers.len() as i64),
            None,
        ),
    ];
    html! {
        div.cards {
            @for (key, label, value, href) in &cards {
                @if let Some(href) = href {
                    a.card href=(href) data-count=(key) { span.value { (value) } span.label { (label) } }
                } @else {
                    div.card data-count=(key) { span.value { (value) } span.label { (label) } }
                }
            }
        }
        p.muted.small { "As of " (layout::timestamp(overview.stats.at)) " UTC (database clock); refreshes every few seconds." }
    }
}

fn tables(state: &AppState, overview: &Overview) -> Markup {
    html! {
        h2 { "Queues" }
        (table(state, "queue", &overview.queues()))
        @if !overview.limits.is_empty() {
            h2 { "Global limits" }
            (limits_table(&overview.limits))
        }
        h2 { "Kinds" }
        (table(state, "kind", &overview.kinds()))
        h2 { "Workers" }
        (workers_table(&overview.workers))
    }
}

fn table(state: &AppState, what: &str, lines: &[Line]) -> Markup {
    let by_queue = what == "queue";
    if lines.is_empty() {
        return html! { p.muted { "No unfinished jobs, and none finished in the last hour." } };
    }
    html! {
        table.data {
            thead { tr {
                th { (what) }
                @if by_queue { th { "paused" } }
                th.num { "runnable" } th.num { "scheduled" } th.num { "waiting" } th.num { "running" }
                th.num { "ok (1h)" } th.num { "dead (1h)" } th.num { "dead" } th.num { "cancelled" }
                th.num { "lag" } th.num { "jobs/s" }
                @if by_queue && !state.read_only { th { "actions" } }
            } }
            tbody {
                @for line in lines {
                    @let (queue, kind) = if by_queue { (Some(line.name.as_str()), None) } else { (None, Some(line.name.as_str())) };
                    @let link = |state_name: &str| jobs_link(Some(state_name), queue, kind);
                    tr data-name=(line.name) {
                        td { a href=(jobs_link(None, queue, kind)) { (line.name) } }
                        @if by_queue { td { @if line.paused { span.badge.paused { "paused" } } @else { span.muted { "no" } } } }
                        td.num data-state="runnable" { a href=(link("queued")) { (count(line.counts.runnable)) } }
                        td.num data-state="scheduled" { a href=(link("queued")) { (count(line.counts.scheduled)) } }
                        td.num data-state="waiting" { a href=(link("waiting")) { (count(line.counts.waiting)) } }
                        td.num data-state="running" { a href=(link("running")) { (count(line.counts.running)) } }
                        td.num data-state="succeeded_last_hour" { a href=(link("succeeded")) { (count(line.counts.succeeded_last_hour)) } }
                        td.num data-state="dead_last_hour" { (count(line.counts.dead_last_hour)) }
                        td.num data-state="dead" { a href=(link("dead")) class=[(line.dead > 0).then_some("alert")] { (count(line.dead)) } }
                        td.num data-state="cancelled" { a href=(link("cancelled")) { (count(line.cancelled)) } }
                        td.num { (duration(line.counts.lag_seconds)) }
                        td.num { (format!("{:.1}", line.counts.per_second)) }
                        @if by_queue && !state.read_only {
                            td.actions {
                                @if line.paused {
                                    (layout::action_button(state, "/queues/resume", "Resume",
                                        &format!("Resume queue {}? Workers will claim its jobs again.", line.name),
                                        &[("queue", &line.name)], "/", false))
                                } @else {
                                    (layout::action_button(state, "/queues/pause", "Pause",
                                        &format!("Pause queue {}? Workers stop claiming its jobs; running jobs finish.", line.name),
                                        &[("queue", &line.name)], "/", false))
                                }
                                @if line.dead > 0 {
                                    (layout::action_button(state, "/queues/retry-dead", &format!("Retry {} dead", line.dead),
                                        &format!("Retry all {} dead jobs of queue {}?", line.dead, line.name),
                                        &[("queue", &line.name)], "/", false))
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn workers_table(workers: &[WorkerRow]) -> Markup {
    if workers.is_empty() {
        return html! { p.muted { "No worker holds a job right now. (Workers are seen through the jobs they run.)" } };
    }
    html! {
        table.data {
            thead { tr { th { "worker" } th.num { "jobs held" } th { "queues" } th { "kinds" } th { "last heartbeat" } } }
            tbody {
                @for worker in workers {
                    tr {
                        td.mono { (worker.identity) }
                        td.num { a href={ "/jobs?state=running" } { (count(worker.jobs)) } }
                        td { (worker.queues.join(", ")) }
                        td { (worker.kinds.join(", ")) }
                        td {
                            (layout::timestamp(worker.last_heartbeat_at))
                            " "
                            span class=[(worker.heartbeat_age_seconds > 30.0).then_some("alert")] {
                                "(" (duration(worker.heartbeat_age_seconds)) " ago)"
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Queues with a global limit: each limit beside its use now, and the runnable jobs it
/// holds back (`skiplock.queue_limits`).
fn limits_table(limits: &[skiplock::QueueLimitStatus]) -> Markup {
    html! {
        table.data.limits {
            thead { tr {
                th { "queue" } th.num { "running" } th.num { "max running" }
                th.num { "started in period" } th.num { "rate limit" }
                th { "holding back" } th.num { "held back" }
                th.num { "key max running" } th.num { "keys full" }
                th.num { "key rate limit" } th.num { "keys at rate" } th.num { "held by key" } th.num { "key turn" }
            } }
            tbody {
                @for status in limits {
                    tr data-name=(status.queue) {
                        td { a href=(jobs_link(None, Some(&status.queue), None)) { (status.queue) } }
                        td.num data-limit="running" { (status.running) }
                        td.num data-limit="max_running" {
                            @match status.limits.max_running { Some(n) => (n), None => span.muted { "none" } }
                        }
                        td.num data-limit="started_in_period" { (status.started_in_period) }
                        td.num data-limit="rate" {
                            @match status.limits.rate {
                                Some(rate) => (format!("{} per {}", rate.starts, humantime::format_duration(rate.per))),
                                None => span.muted { "none" },
                            }
                        }
                        td data-limit="holding_back" {
                            @match (status.paused, status.holding_back) {
                                (true, _) => span.badge.paused { "paused" },
                                (false, Some(skiplock::LimitKind::MaxRunning)) => span.badge { "max running" },
                                (false, Some(_)) => span.badge { "rate limit" },
                                (false, None) => span.muted { "no" },
                            }
                        }
                        td.num data-limit="held_back" { (status.held_back) }
                        td.num data-limit="key_max_running" {
                            @match status.limits.key_max_running { Some(n) => (n), None => span.muted { "none" } }
                        }
                        td.num data-limit="keys_at_limit" { (status.keys_at_limit) }
                        td.num data-limit="key_rate" {
                            @match status.limits.key_rate {
                                Some(rate) => (format!("{} per {}", rate.starts, humantime::format_duration(rate.per))),
                                None => span.muted { "none" },
                            }
                        }
                        td.num data-limit="keys_rate_limited" { (status.keys_rate_limited) }
                        td.num data-limit="held_by_key" { (status.held_by_key) }
                        td.num data-limit="key_claimable" {
                            @match status.limits.key_claimable { Some(n) => (n), None => span.muted { "none" } }
                        }
                    }
                }
            }
        }
    }
}
