//! The POST actions: retry, cancel or delete a job; retry every dead job of a queue; pause
//! or resume a queue.
//!
//! Each one is checked by [`security::check_action`] (read-only mode, origin, CSRF token)
//! and must say `confirmed=yes`: the page's script asks with `confirm()` and sets it;
//! without the script, the server answers with a confirmation page instead. On success it
//! redirects (303) back to the page it came from with a one-line notice.

use axum::extract::{Form, Path, State as StateExtractor};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;
use skiplock::JobId;
use skiplock::unstable_cli::jobs_delete_rolled_up;

use super::layout::{self, Nav, encode};
use super::security::{self, local_path};
use super::{AppError, AppResult, State};

#[derive(serde::Deserialize)]
pub struct ActionForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    return_to: String,
    #[serde(default)]
    confirmed: String,
    queue: Option<String>,
}

/// `POST /jobs/{id}/{retry|cancel|delete}`.
pub async fn job(
    StateExtractor(state): StateExtractor<State>,
    Path((id, action)): Path<(String, String)>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> AppResult<Response> {
    let id = super::job_id_in_path(&id)?;
    let question = match action.as_str() {
        "retry" => format!("Retry job {id} now?"),
        "cancel" => format!("Cancel job {id}? Jobs that wait for it are cancelled too."),
        "delete" => format!("Delete job {id} for good? History keeps its count."),
        _ => return Err(AppError::NotFound(format!("no action {action:?} on jobs"))),
    };
    security::check_action(&state, &headers, &form.csrf)?;
    if form.confirmed != "yes" {
        return Ok(confirmation(
            &state,
            &format!("/jobs/{id}/{action}"),
            &question,
            &form,
        ));
    }
    let pool = &state.pool;
    let notice = match action.as_str() {
        // A job whose unique key a pending job took meanwhile is superseded by it (the
        // job page shows which); a job behind its lane or parents waits its turn.
        "retry" => match skiplock::retry(pool, JobId(id)).await? {
            true => format!("Job {id} is queued to run now (or waits for its lane or parents)."),
            false => format!("Job {id} was not retried: it is running, waiting or gone."),
        },
        "cancel" => match skiplock::cancel(pool, JobId(id)).await? {
            true => format!("Job {id} is cancelled."),
            false => format!("Job {id} was not cancelled: it had finished or is gone."),
        },
        _ => match jobs_delete_rolled_up(pool, JobId(id)).await? {
            true => format!("Job {id} is deleted."),
            false => format!(
                "Job {id} was not deleted: it is running, jobs wait for it (cancel it instead), \
                 or it is gone."
            ),
        },
    };
    tracing::info!(job = id, action = %action, %notice, "dashboard action");
    Ok(back(&form.return_to, &notice))
}

/// `POST /queues/{retry-dead|pause|resume}` with the queue in the form.
pub async fn queue(
    StateExtractor(state): StateExtractor<State>,
    Path(action): Path<String>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> AppResult<Response> {
    let queue = form
        .queue
        .clone()
        .filter(|q| !q.is_empty())
        .ok_or_else(|| AppError::BadRequest("the form names no queue".into()))?;
    let question = match action.as_str() {
        "retry-dead" => format!("Retry every dead job of queue {queue}?"),
        "pause" => {
            format!("Pause queue {queue}? Workers stop claiming its jobs; running jobs finish.")
        }
        "resume" => format!("Resume queue {queue}? Workers will claim its jobs again."),
        _ => {
            return Err(AppError::NotFound(format!(
                "no action {action:?} on queues"
            )));
        }
    };
    security::check_action(&state, &headers, &form.csrf)?;
    if form.confirmed != "yes" {
        return Ok(confirmation(
            &state,
            &format!("/queues/{action}"),
            &question,
            &form,
        ));
    }
    let pool = &state.pool;
    let notice = match action.as_str() {
        "retry-dead" => {
            let ids = skiplock::retry_dead(pool, Some(&queue)).await?;
            format!(
                "{} dead job(s) of queue {queue} are queued to run now.",
                ids.len()
            )
        }
        "pause" => {
            skiplock::pause_queue(pool, &queue).await?;
            format!("Queue {queue} is paused.")
        }
        _ => {
            skiplock::resume_queue(pool, &queue).await?;
            format!("Queue {queue} is resumed.")
        }
    };
    tracing::info!(%queue, action = %action, %notice, "dashboard action");
    Ok(back(&form.return_to, &notice))
}

/// 303 to `return_to` (a path of this site) with the notice in the query.
fn back(return_to: &str, notice: &str) -> Response {
    let path = local_path(return_to);
    let base = match path.split_once('?') {
        Some((path, query)) => {
            let kept: Vec<&str> = query
                .split('&')
                .filter(|p| !p.is_empty() && !p.starts_with("notice="))
                .collect();
            if kept.is_empty() {
                format!("{path}?")
            } else {
                format!("{path}?{}&", kept.join("&"))
            }
        }
        None => format!("{path}?"),
    };
    Redirect::to(&format!("{base}notice={}", encode(notice))).into_response()
}

/// The page that asks when the form came without `confirmed=yes` (no script).
fn confirmation(state: &State, action: &str, question: &str, form: &ActionForm) -> Response {
    let body = html! {
        h1 { "Please confirm" }
        p.question { (question) }
        form.action method="post" action=(action) {
            input type="hidden" name="csrf" value=(state.csrf_token);
            input type="hidden" name="return_to" value=(local_path(&form.return_to));
            input type="hidden" name="confirmed" value="yes";
            @if let Some(queue) = &form.queue { input type="hidden" name="queue" value=(queue); }
            button type="submit" { "Yes, do it" }
            " "
            a href=(local_path(&form.return_to)) { "No, go back" }
        }
    };
    layout::page(state, Nav::Overview, "Confirm", None, body).into_response()
}
