//! `GET /jobs` (filtered list, keyset paging) and `GET /jobs/{id}` (everything about one
//! job, with its actions).

use axum::extract::{Path, Query, State as StateExtractor};
use maud::{Markup, html};
use serde_json::Value;
use skiplock::admin::job_dependencies;
use skiplock::unstable_cli::{
    Cursor, JobsPageFilter, TEXT_SEARCH_SCAN, dashboard_jobs_page, dashboard_lane,
};
use skiplock::{JobId, JobRow, JobState};

use super::layout::{self, Nav, encode, given, maybe_timestamp, state_badge, timestamp};
use super::{AppError, AppResult, AppState, State};

/// Jobs per page by default, and at most.
const PAGE_SIZE_DEFAULT: i64 = 50;
const PAGE_SIZE_MAX: i64 = 500;

/// Lane jobs shown on a job's page.
const LANE_SHOWN: i64 = 10;

#[derive(serde::Deserialize, Default)]
pub struct ListQuery {
    state: Option<String>,
    queue: Option<String>,
    kind: Option<String>,
    q: Option<String>,
    before: Option<i64>,
    after: Option<i64>,
    limit: Option<i64>,
    notice: Option<String>,
}

fn parse_state(value: Option<String>) -> AppResult<Option<JobState>> {
    value
        .map(|name| {
            JobState::ALL
                .into_iter()
                .find(|s| s.as_str() == name)
                .ok_or_else(|| AppError::BadRequest(format!("unknown state {name:?}")))
        })
        .transpose()
}

pub async fn list(
    StateExtractor(state): StateExtractor<State>,
    Query(query): Query<ListQuery>,
) -> AppResult<Markup> {
    let limit = query
        .limit
        .unwrap_or(PAGE_SIZE_DEFAULT)
        .clamp(1, PAGE_SIZE_MAX);
    let cursor = match (query.before, query.after) {
        (Some(id), _) => Cursor::Before(id),
        (None, Some(id)) => Cursor::After(id),
        (None, None) => Cursor::First,
    };
    let filter = JobsPageFilter {
        state: parse_state(given(&query.state))?,
        queue: given(&query.queue),
        kind: given(&query.kind),
        text: given(&query.q),
        cursor,
        // One more than shown tells whether another page follows.
        limit: limit + 1,
    };
    let page = dashboard_jobs_page(&state.pool, &filter).await?;
    let mut jobs = page.jobs;
    let more = jobs.len() as i64 > limit;
    if more {
        match cursor {
            Cursor::After(_) => {
                jobs.remove(0);
            }
            _ => {
                jobs.pop();
            }
        }
    }
    // A text search that stopped reading before the page was full continues from where
    // it stopped; otherwise pages continue from the jobs shown.
    let searched_to = page.searched_to.filter(|_| !more);
    let mut base = String::new();
    for (name, value) in [
        (
            "state",
            filter.state.map(JobState::as_str).map(str::to_owned),
        ),
        ("queue", filter.queue.clone()),
        ("kind", filter.kind.clone()),
        ("q", filter.text.clone()),
    ] {
        if let Some(value) = value {
            base.push_str(&format!("{name}={}&", encode(&value)));
        }
    }
    if limit != PAGE_SIZE_DEFAULT {
        base.push_str(&format!("limit={limit}&"));
    }
    let link = |param: &str, id: i64| format!("/jobs?{base}{param}={id}");
    let (newer, older) = match cursor {
        Cursor::First | Cursor::Before(_) => {
            let older = match searched_to {
                Some(to) => Some(link("before", to)),
                None if more => jobs.last().map(|j| link("before", j.id)),
                None => None,
            };
            let newer = (cursor != Cursor::First).then(|| {
                jobs.first()
                    .map_or_else(|| format!("/jobs?{base}"), |j| link("after", j.id))
            });
            (newer, older)
        }
        Cursor::After(id) => {
            let newer = match searched_to {
                Some(to) => Some(link("after", to)),
                None if more => jobs.first().map(|j| link("after", j.id)),
                None => None,
            };
            let older = jobs.last().map_or(id + 1, |j| j.id);
            (newer, Some(link("before", older)))
        }
    };
    let body = html! {
        h1 { "Jobs" }
        form.filters method="get" action="/jobs" {
            label { "State "
                select name="state" {
                    option value="" { "any" }
                    @for s in JobState::ALL {
                        option value=(s.as_str()) selected[filter.state == Some(s)] { (s.as_str()) }
                    }
                }
            }
            label { "Queue " input type="text" name="queue" value=[filter.queue.as_deref()] placeholder="any"; }
            label { "Kind " input type="text" name="kind" value=[filter.kind.as_deref()] placeholder="any"; }
            label { "Text " input type="search" name="q" value=[filter.text.as_deref()] placeholder="in args or errors"; }
            button type="submit" { "Filter" }
            a href="/jobs" { "Clear" }
        }
        @if jobs.is_empty() {
            p.muted { "No job matches." }
        } @else {
            table.data.jobs {
                thead { tr {
                    th.num { "id" } th { "queue" } th { "kind" } th { "state" } th.num { "attempt" }
                    th { "created" } th { "scheduled / finished" } th { "args" } th { "last error" }
                } }
                tbody {
                    @for job in &jobs {
                        tr data-job-id=(job.id) {
                            td.num { a href={ "/jobs/" (job.id) } { (job.id) } }
                            td { (job.queue) }
                            td { (job.kind) }
                            td { (state_badge(job.state)) }
                            td.num { (job.attempt) "/" (job.max_attempts) }
                            td { (timestamp(job.created_at)) }
                            td { @match job.finished_at { Some(at) => (timestamp(at)), None => (timestamp(job.scheduled_at)) } }
                            td.mono.preview { (job.args_preview) }
                            td.preview.error { (job.error_preview.as_deref().unwrap_or("")) }
                        }
                    }
                }
            }
        }
        @if searched_to.is_some() {
            p.muted { "The text search read " (layout::count(TEXT_SEARCH_SCAN)) " jobs without filling the page; the next link searches on." }
        }
        nav.pager {
            @if let Some(newer) = &newer {
                a rel="prev" href=(newer) { @if searched_to.is_some() && matches!(cursor, Cursor::After(_)) { "← Search newer" } @else { "← Newer" } }
            }
            @if let Some(older) = &older {
                a rel="next" href=(older) { @if searched_to.is_some() && !matches!(cursor, Cursor::After(_)) { "Search older →" } @else { "Older →" } }
            }
        }
        p.muted.small { "Newest first. Pages follow ids, so paging stays fast on any table size." }
    };
    Ok(layout::page(
        &state,
        Nav::Jobs,
        "Jobs",
        query.notice.as_deref(),
        body,
    ))
}

#[derive(serde::Deserialize)]
pub struct DetailQuery {
    notice: Option<String>,
}

pub async fn detail(
    StateExtractor(state): StateExtractor<State>,
    Path(id): Path<String>,
    Query(query): Query<DetailQuery>,
) -> AppResult<Markup> {
    let id = super::job_id_in_path(&id)?;
    let job = skiplock::job(&state.pool, JobId(id))
        .await?
        .ok_or_else(|| AppError::NotFound(format!("job {id} does not exist (or was pruned)")))?;
    let dependencies = job_dependencies(&state.pool, JobId(id)).await?;
    let lane = match &job.ordering_key {
        Some(key) => Some(dashboard_lane(&state.pool, key, LANE_SHOWN).await?),
        None => None,
    };
    let here = format!("/jobs/{id}");
    let body = html! {
        div.title-row {
            h1 { "Job " (job.id) " " (state_badge(job.state)) }
            div.actions { (actions(&state, &job, &here)) }
        }
        div.columns {
            section {
                h2 { "Summary" }
                dl.facts {
                    dt { "queue" } dd { a href=(layout::jobs_link(None, Some(&job.queue), None)) { (job.queue) } }
                    dt { "kind" } dd { a href=(layout::jobs_link(None, None, Some(&job.kind))) { (job.kind) } }
                    dt { "priority" } dd { (job.priority) }
                    dt { "attempt" } dd { (job.attempt) " of " (job.max_attempts) }
                    @if let Some(by) = &job.claimed_by { dt { "claimed by" } dd.mono { (by) } }
                    @if let Some(key) = &job.unique_key {
                        dt { "unique key" } dd.mono { (key) " (" (job.unique_policy.unwrap_or_default().as_str()) ")" }
                    }
                    @if let Some(error) = &job.last_error { dt { "last error" } dd.error { (error) } }
                }
            }
            section {
                h2 { "Timing (UTC)" }
                dl.facts {
                    dt { "created" } dd { (timestamp(job.created_at)) }
                    dt { "scheduled" } dd { (timestamp(job.scheduled_at)) }
                    dt { "claimed" } dd { (maybe_timestamp(job.claimed_at)) }
                    dt { "heartbeat" } dd { (maybe_timestamp(job.heartbeat_at)) }
                    dt { "finished" } dd { (maybe_timestamp(job.finished_at)) }
                    @if let (Some(claimed), Some(finished)) = (job.claimed_at, job.finished_at) {
                        @if finished >= claimed {
                            dt { "run time" } dd { (layout::duration((finished - claimed).as_seconds_f64())) }
                        }
                    }
                    @if let Some(claimed) = job.claimed_at {
                        @if claimed >= job.scheduled_at {
                            dt { "waited" } dd { (layout::duration((claimed - job.scheduled_at).as_seconds_f64())) }
                        }
                    }
                }
            }
        }
        h2 { "Args" }
        pre.json { (pretty(&job.args.0)) }
        @if let Some(progress) = &job.progress { h2 { "Progress" } pre.json { (pretty(&progress.0)) } }
        @if let Some(output) = &job.output { h2 { "Output" } pre.json { (pretty(&output.0)) } }
        h2 { "Errors" }
        (errors_table(&job.errors.0))
        h2 { "Dependencies" }
        @if dependencies.is_empty() {
            p.muted { "None: it waits for no job, and no job waits for it." }
        } @else {
            table.data {
                thead { tr { th { "relation" } th.num { "job" } th { "state" } } }
                tbody {
                    @for dep in &dependencies {
                        tr {
                            td { @if dep.relation == "parent" { "waits for" } @else { "is waited on by" } }
                            td.num { a href={ "/jobs/" (dep.id) } { (dep.id) } }
                            td {
                                (state_badge(dep.state))
                                @if dep.deleted { " deleted" }
                            }
                        }
                    }
                }
            }
        }
        h2 { "Ordering lane" }
        @match (&job.ordering_key, &lane) {
            (Some(key), Some((total, jobs))) => {
                p { "Lane " code { (key) } ": " (total) " unfinished job" @if *total != 1 { "s" } ", run one at a time by id."
                    @if let Some(position) = jobs.iter().position(|j| j.id == job.id) {
                        " This job is number " (position + 1) " in line."
                    }
                }
                @if !jobs.is_empty() {
                    ol.lane {
                        @for lane_job in jobs {
                            li class=[(lane_job.id == job.id).then_some("current")] {
                                a href={ "/jobs/" (lane_job.id) } { (lane_job.id) } " " (state_badge(lane_job.state))
                            }
                        }
                    }
                }
            }
            _ => { p.muted { "None." } }
        }
    };
    Ok(layout::page(
        &state,
        Nav::Jobs,
        &format!("Job {id}"),
        query.notice.as_deref(),
        body,
    ))
}

fn actions(state: &AppState, job: &JobRow, here: &str) -> Markup {
    let id = job.id;
    let can_retry = matches!(
        job.state,
        JobState::Queued | JobState::Dead | JobState::Cancelled | JobState::Succeeded
    );
    let can_cancel = matches!(
        job.state,
        JobState::Waiting | JobState::Queued | JobState::Running
    );
    let can_delete = job.state != JobState::Running;
    html! {
        @if can_retry {
            (layout::action_button(state, &format!("/jobs/{id}/retry"), "Retry",
                &format!("Retry job {id} now?"), &[], here, false))
        }
        @if can_cancel {
            (layout::action_button(state, &format!("/jobs/{id}/cancel"), "Cancel",
                &format!("Cancel job {id}? Jobs that wait for it are cancelled too."), &[], here, true))
        }
        @if can_delete {
            (layout::action_button(state, &format!("/jobs/{id}/delete"), "Delete",
                &format!("Delete job {id} for good? History keeps its count."), &[], "/jobs", true))
        }
    }
}

/// An error's `at` as a timestamp, or as the text it is when it does not parse.
fn error_time(at: Option<&Value>) -> Markup {
    let text = at.and_then(Value::as_str).unwrap_or("");
    match chrono::DateTime::parse_from_rfc3339(text) {
        Ok(at) => timestamp(at.with_timezone(&chrono::Utc)),
        Err(_) => html! { (text) },
    }
}

fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
}

fn errors_table(errors: &Value) -> Markup {
    let errors: &[Value] = errors.as_array().map(Vec::as_slice).unwrap_or_default();
    if errors.is_empty() {
        return html! { p.muted { "No failed attempt." } };
    }
    html! {
        table.data.errors {
            thead { tr { th.num { "attempt" } th { "at (UTC)" } th { "message" } } }
            tbody {
                // Newest first: the latest failure is the one people look for.
                @for error in errors.iter().rev() {
                    tr {
                        td.num { (error.get("attempt").map(Value::to_string).unwrap_or_default()) }
                        td.when { (error_time(error.get("at"))) }
                        td { pre.message { (error.get("message").and_then(Value::as_str).unwrap_or("")) } }
                    }
                }
            }
        }
        p.muted.small { "The 20 most recent failures are kept." }
    }
}
