//! `GET /history`: per day or hour, per queue and kind, how many jobs succeeded, failed
//! attempts, died and were cancelled, with average run and wait times; and a chart of the
//! last 30 days. The numbers come from the rollup plus the jobs not pruned yet
//! ([`skiplock::admin`]), so pruning finished jobs does not change them.

use std::collections::BTreeMap;

use axum::extract::{Query, State as StateExtractor};
use chrono::{DateTime, Duration, DurationRound, Utc};
use maud::{Markup, html};
use skiplock::admin::{Granularity, HistoryFilter, HistoryRow, history};

use super::layout::{self, Nav, count, duration, encode, given};
use super::{AppError, AppResult, State};

/// Days the chart covers.
const CHART_DAYS: i64 = 30;

#[derive(serde::Deserialize, Default)]
pub struct HistoryQuery {
    granularity: Option<String>,
    days: Option<i64>,
    queue: Option<String>,
    kind: Option<String>,
}

/// One bucket's numbers, summed over whatever the rows cover.
#[derive(Default, Clone, Copy)]
struct Sums {
    succeeded: i64,
    failed: i64,
    dead: i64,
    cancelled: i64,
}

impl Sums {
    fn add(&mut self, row: &HistoryRow) {
        self.succeeded += row.succeeded;
        self.failed += row.failed;
        self.dead += row.dead;
        self.cancelled += row.cancelled;
    }
}

pub async fn page(
    StateExtractor(state): StateExtractor<State>,
    Query(query): Query<HistoryQuery>,
) -> AppResult<Markup> {
    let granularity = match query.granularity.as_deref() {
        None | Some("") | Some("day") => Granularity::Day,
        Some("hour") => Granularity::Hour,
        Some(other) => {
            return Err(AppError::BadRequest(format!(
                "granularity must be day or hour, not {other:?}"
            )));
        }
    };
    let days_default = match granularity {
        Granularity::Day => CHART_DAYS,
        Granularity::Hour => 2,
    };
    let days = query.days.unwrap_or(days_default).clamp(1, 366);
    let queue = given(&query.queue);
    let kind = given(&query.kind);
    let now = Utc::now();
    let today = now
        .duration_trunc(Duration::days(1))
        .map_err(|e| AppError::Internal(e.into()))?;
    let chart_since = today - Duration::days(CHART_DAYS - 1);
    let table_since = now - Duration::days(days) + Duration::seconds(1);
    let table_start = match granularity {
        Granularity::Day => table_since.duration_trunc(Duration::days(1)),
        Granularity::Hour => table_since.duration_trunc(Duration::hours(1)),
    }
    .map_err(|e| AppError::Internal(e.into()))?;
    // One query, by hour, for both the chart and the table: the live half of the history
    // reads every retained finished job, so it should run once per page.
    let filter = HistoryFilter {
        granularity: Granularity::Hour,
        since: chart_since.min(table_start),
        queue: queue.clone(),
        kind: kind.clone(),
    };
    let hours = history(&state.pool, &filter).await?;
    let mut per_day: BTreeMap<DateTime<Utc>, Sums> = (0..CHART_DAYS)
        .map(|d| (chart_since + Duration::days(d), Sums::default()))
        .collect();
    for row in by_day(&hours, chart_since) {
        per_day.entry(row.bucket).or_default().add(&row);
    }
    let mut rows = match granularity {
        Granularity::Day => by_day(&hours, table_start),
        Granularity::Hour => hours
            .iter()
            .filter(|row| row.bucket >= table_start)
            .cloned()
            .collect(),
    };
    rows.reverse();

    let mut totals = Sums::default();
    for row in &rows {
        totals.add(row);
    }
    let filters = {
        let mut parts = Vec::new();
        if let Some(queue) = &queue {
            parts.push(format!("queue={}", encode(queue)));
        }
        if let Some(kind) = &kind {
            parts.push(format!("kind={}", encode(kind)));
        }
        parts.join("&")
    };
    let window = match granularity {
        Granularity::Day => format!("per day, last {days} days"),
        Granularity::Hour => format!("per hour, last {} hours", days * 24),
    };
    let body = html! {
        h1 { "History" }
        form.filters method="get" action="/history" {
            label { "Per "
                select name="granularity" {
                    option value="day" selected[granularity == Granularity::Day] { "day" }
                    option value="hour" selected[granularity == Granularity::Hour] { "hour" }
                }
            }
            label { "Days " input type="number" name="days" min="1" max="366" value=(days); }
            label { "Queue " input type="text" name="queue" value=[queue.as_deref()] placeholder="any"; }
            label { "Kind " input type="text" name="kind" value=[kind.as_deref()] placeholder="any"; }
            button type="submit" { "Show" }
        }
        section.chart-box {
            h2 { "Last 30 days (UTC)" }
            (chart(&per_day))
            p.legend {
                span.swatch.succeeded {} "succeeded "
                span.swatch.dead {} "dead "
                span.swatch.failed {} "failed attempts"
            }
        }
        h2 { (window) }
        p {
            (count(totals.succeeded)) " succeeded, " (count(totals.failed)) " failed attempts, "
            (count(totals.dead)) " dead, " (count(totals.cancelled)) " cancelled."
            @if !filters.is_empty() { " " a href="/history" { "Clear the filters" } }
        }
        @if rows.is_empty() {
            p.muted { "Nothing finished in this window." }
        } @else {
            table.data.history {
                thead { tr {
                    th { (granularity.as_str()) " (UTC)" } th { "queue" } th { "kind" }
                    th.num { "succeeded" } th.num { "failed" } th.num { "dead" } th.num { "cancelled" }
                    th.num { "avg run" } th.num { "avg wait" }
                } }
                tbody {
                    @for row in &rows {
                        tr {
                            td { @match granularity {
                                Granularity::Day => (row.bucket.format("%Y-%m-%d")),
                                Granularity::Hour => (row.bucket.format("%Y-%m-%d %H:00")),
                            } }
                            td { (row.queue) }
                            td { (row.kind) }
                            td.num { (count(row.succeeded)) }
                            td.num { (count(row.failed)) }
                            td.num { (count(row.dead)) }
                            td.num { (count(row.cancelled)) }
                            td.num { (average(row.run_seconds, row.run_count)) }
                            td.num { (average(row.wait_seconds, row.wait_count)) }
                        }
                    }
                }
            }
        }
        p.muted.small {
            "Failed counts failed attempts (a job retried three times counts three); run time is "
            "finished − claimed of the last attempt, wait time claimed − scheduled. Hours older "
            "than the history retention (a year by default) are folded into lifetime totals."
        }
    };
    Ok(layout::page(&state, Nav::History, "History", None, body))
}

/// Hourly rows from `from` on, summed per day (UTC), queue and kind, oldest first.
fn by_day(hours: &[HistoryRow], from: DateTime<Utc>) -> Vec<HistoryRow> {
    let mut days: BTreeMap<(DateTime<Utc>, &str, &str), HistoryRow> = BTreeMap::new();
    for hour in hours.iter().filter(|row| row.bucket >= from) {
        let day = hour
            .bucket
            .duration_trunc(Duration::days(1))
            .unwrap_or(hour.bucket);
        let sum = days
            .entry((day, hour.queue.as_str(), hour.kind.as_str()))
            .or_insert_with(|| HistoryRow {
                bucket: day,
                succeeded: 0,
                failed: 0,
                dead: 0,
                cancelled: 0,
                run_count: 0,
                run_seconds: 0.0,
                wait_count: 0,
                wait_seconds: 0.0,
                ..hour.clone()
            });
        sum.succeeded += hour.succeeded;
        sum.failed += hour.failed;
        sum.dead += hour.dead;
        sum.cancelled += hour.cancelled;
        sum.run_count += hour.run_count;
        sum.run_seconds += hour.run_seconds;
        sum.wait_count += hour.wait_count;
        sum.wait_seconds += hour.wait_seconds;
    }
    days.into_values().collect()
}

fn average(sum: f64, n: i64) -> String {
    if n == 0 {
        "–".into()
    } else {
        duration(sum / n as f64)
    }
}

/// Stacked daily bars (succeeded, dead) with failed attempts as a line, as inline SVG.
fn chart(per_day: &BTreeMap<DateTime<Utc>, Sums>) -> Markup {
    const WIDTH: f64 = 900.0;
    const HEIGHT: f64 = 220.0;
    const LEFT: f64 = 48.0;
    const BOTTOM: f64 = 22.0;
    let max = per_day
        .values()
        .map(|s| (s.succeeded + s.dead).max(s.failed))
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let plot_h = HEIGHT - BOTTOM - 8.0;
    let slot = (WIDTH - LEFT) / per_day.len().max(1) as f64;
    let y = |v: i64| HEIGHT - BOTTOM - (v as f64 / max) * plot_h;
    let failed_points: Vec<String> = per_day
        .values()
        .enumerate()
        .map(|(i, s)| format!("{:.1},{:.1}", LEFT + slot * (i as f64 + 0.5), y(s.failed)))
        .collect();
    html! {
        svg.history-chart viewBox={ "0 0 " (WIDTH) " " (HEIGHT) } role="img" aria-label="Jobs per day, last 30 days" {
            line.axis x1=(LEFT) y1=(HEIGHT - BOTTOM) x2=(WIDTH) y2=(HEIGHT - BOTTOM) {}
            text.tick x=(LEFT - 6.0) y=(y(max as i64) + 4.0) text-anchor="end" { (count(max as i64)) }
            text.tick x=(LEFT - 6.0) y=(HEIGHT - BOTTOM) text-anchor="end" { "0" }
            @for (i, (day, sums)) in per_day.iter().enumerate() {
                @let x = LEFT + slot * i as f64 + slot * 0.15;
                @let w = slot * 0.7;
                g {
                    title { (day.format("%Y-%m-%d")) ": " (sums.succeeded) " succeeded, " (sums.dead) " dead, " (sums.failed) " failed attempts, " (sums.cancelled) " cancelled" }
                    rect.succeeded x=(format!("{x:.1}")) y=(format!("{:.1}", y(sums.succeeded))) width=(format!("{w:.1}")) height=(format!("{:.1}", HEIGHT - BOTTOM - y(sums.succeeded))) {}
                    rect.dead x=(format!("{x:.1}")) y=(format!("{:.1}", y(sums.succeeded + sums.dead))) width=(format!("{w:.1}")) height=(format!("{:.1}", y(sums.succeeded) - y(sums.succeeded + sums.dead))) {}
                }
                @if i % 5 == 0 || i + 1 == per_day.len() {
                    text.tick x=(format!("{:.1}", LEFT + slot * (i as f64 + 0.5))) y=(HEIGHT - 6.0) text-anchor="middle" { (day.format("%m-%d")) }
                }
            }
            polyline.failed points=(failed_points.join(" ")) {}
        }
    }
}
