//! The paths a run took: the kinds of event the invariants of [`super::checks`] are about,
//! counted from the audit, so that a run that never reached one fails rather than pass on
//! what it did not exercise (tests/model.rs says which paths each seed must take).
//!
//! The limits' paths count a limit *binding*, not merely a start in the limited queue: a
//! job that was due was kept from starting by the limit. A per-key limit shows it in the
//! table: a claim that finds a key full (`key_max_running`) or fills its rate window
//! (`key_rate_limit`) moves the key's queued jobs to `waiting` with `held_for` 'key' or
//! 'rate'; a path counts those holds of jobs that were due. The queue's own limits hold
//! nothing back in the table (the claim just takes less), so their binding is read from
//! the replay: right after a start of the queue, the queue ran its `max_running` jobs, or
//! its rate window held `rate_limit` starts, while another of its jobs had been queued and
//! due for [`DUE_AT_LEAST`]: no claim could start that job until a running one ended or the
//! window moved on. Both are measured against the limits the database holds
//! ([`super::checks::LimitsInForce`]): a queue without the limit never binds, however many
//! of its jobs run at once.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Duration, Utc};

use super::checks::{Ev, Evidence, limited_starts};
use super::{KEYED_QUEUE, LIMITED_QUEUE};

/// How long a job must have been queued and due before a start of the limited queue to
/// count as held back at that start. The audit numbers rows when they are written, not
/// when they commit: a job whose insert had not committed yet was not there for the claim
/// to take. The model's transactions commit within milliseconds of their writes; this
/// leaves a margin for a loaded machine.
const DUE_AT_LEAST: Duration = Duration::milliseconds(250);

/// How often the run went through each path the invariants are about.
pub fn coverage(evidence: &Evidence) -> BTreeMap<&'static str, usize> {
    let mut paths = BTreeMap::new();
    if !evidence.gone_with_their_day.is_empty() {
        paths.insert("dropped with its day", evidence.gone_with_their_day.len());
    }
    limits_binding(evidence, &mut paths);
    slots_handed_on(evidence, &mut paths);
    let lanes: HashSet<i64> = evidence
        .events
        .iter()
        .filter(|e| e.ordering_key.is_some())
        .map(|e| e.job_id)
        .collect();
    let children: HashSet<i64> = evidence.deps.iter().map(|&(_, child, _)| child).collect();
    // Jobs waiting their turn (fair queueing), from the write that held them.
    let mut waiting_turn: HashSet<i64> = HashSet::new();
    for e in &evidence.events {
        let (old, new) = (e.old_state.as_deref(), e.new_state.as_deref());
        // Its turn: queued by a claim's release, or claimed straight from the held jobs.
        if old == Some("waiting")
            && waiting_turn.remove(&e.job_id)
            && matches!(new, Some("queued" | "running"))
        {
            *paths.entry("a job waiting its turn got it").or_default() += 1;
        }
        if new == Some("waiting") && e.held_for.as_deref() == Some("fair") {
            // Held by its insert statement's trigger (written queued, then held).
            waiting_turn.insert(e.job_id);
            if old != Some("waiting") {
                *paths
                    .entry("key_claimable held a job at its insert")
                    .or_default() += 1;
            }
        }
        let error = e.last_error.as_deref().unwrap_or_default();
        let path = match (e.op.as_str(), old, new) {
            ("update", Some("queued"), Some("running")) if lanes.contains(&e.job_id) => {
                "claim of a lane job"
            }
            ("update", Some("queued"), Some("running")) if children.contains(&e.job_id) => {
                "claim of a child"
            }
            ("update", Some("running"), Some(_))
                if error.starts_with("no heartbeat") && e.failure =>
            {
                "reap"
            }
            ("update", Some("running"), Some("queued")) if e.old_attempt != e.new_attempt => {
                "release"
            }
            ("update", Some("running"), Some("queued")) => "retry after failure",
            ("update", Some("running"), Some("dead")) => "dead",
            (_, _, Some("cancelled")) if error.contains("superseded") => "superseded",
            (_, _, Some("cancelled")) if error.contains("parent") => "cancelled for a parent",
            ("update", Some("succeeded" | "dead" | "cancelled"), Some("queued" | "waiting")) => {
                "reopened by hand"
            }
            ("delete", Some("succeeded" | "dead" | "cancelled"), _) => "pruned",
            ("delete", _, _) => "deleted unfinished",
            _ => continue,
        };
        *paths.entry(path).or_default() += 1;
    }
    paths
}

/// The limits' paths (see the module docs): each per-key hold of a due job, and each start
/// of the limited queue after which its `max_running` or its rate limit kept a due job
/// from starting.
/// A key's freed slot handed on: in the keyed queue, one transaction ends a job of a key
/// and starts another of the same key (a worker's completion claiming the key's next job).
fn slots_handed_on(evidence: &Evidence, paths: &mut BTreeMap<&'static str, usize>) {
    for transaction in crate::fault_support::transactions(&evidence.events) {
        let keyed =
            |e: &&&Ev| e.queue.as_deref() == Some(KEYED_QUEUE.0) && e.concurrency_key.is_some();
        let ended: HashSet<&str> = transaction
            .iter()
            .filter(keyed)
            .filter(|e| {
                e.old_state.as_deref() == Some("running")
                    && e.new_state.as_deref() == Some("succeeded")
            })
            .filter_map(|e| e.concurrency_key.as_deref())
            .collect();
        let handed = transaction
            .iter()
            .filter(keyed)
            .filter(|e| e.is_start() && ended.contains(e.concurrency_key.as_deref().unwrap_or("")))
            .count();
        if handed > 0 {
            *paths.entry("a key's freed slot handed on").or_default() += handed;
        }
    }
}

fn limits_binding(evidence: &Evidence, paths: &mut BTreeMap<&'static str, usize>) {
    let limits = evidence.limits;
    // The starts after which the rate window was full: the start `rate_limit - 1` before
    // it is less than a period older.
    let mut window_full: HashSet<i64> = HashSet::new();
    if let (Some(limit), Some(period_ms)) = (limits.rate_limit, limits.rate_period_ms) {
        let limit = limit as usize;
        let starts = limited_starts(evidence);
        for i in limit.saturating_sub(1)..starts.len() {
            if starts[i].0 - starts[i + 1 - limit].0 < Duration::milliseconds(period_ms) {
                window_full.insert(starts[i].1);
            }
        }
    }
    let max_running = limits.max_running.map(|n| n as usize);
    let mut running: HashSet<i64> = HashSet::new();
    // The limited queue's queued jobs: since when each was queued and due.
    let mut due_since: HashMap<i64, DateTime<Utc>> = HashMap::new();
    for e in evidence.events.iter().filter(|e| !e.heartbeat) {
        running.remove(&e.job_id);
        due_since.remove(&e.job_id);
        if e.queue.as_deref() != Some(LIMITED_QUEUE.0) {
            continue;
        }
        match e.new_state.as_deref() {
            Some("running") => {
                running.insert(e.job_id);
            }
            Some("queued") => {
                due_since.insert(e.job_id, e.scheduled_at.map_or(e.at, |at| at.max(e.at)));
            }
            Some("waiting") if e.old_state.as_deref() == Some("queued") && is_due(e) => {
                let path = match e.held_for.as_deref() {
                    Some("key") => "key_max_running held a due job back",
                    Some("rate") => "key_rate_limit held a due job back",
                    _ => continue,
                };
                *paths.entry(path).or_default() += 1;
            }
            _ => {}
        }
        if !e.is_claim() {
            continue;
        }
        let held_back = || {
            due_since
                .values()
                .any(|&since| since + DUE_AT_LEAST <= e.at)
        };
        if max_running.is_some_and(|max| running.len() >= max) && held_back() {
            *paths.entry("max_running held a due job back").or_default() += 1;
        }
        if window_full.contains(&e.seq) && held_back() {
            *paths.entry("rate_limit held a due job back").or_default() += 1;
        }
    }
}

/// Whether the row's job was due when the row was written.
fn is_due(e: &Ev) -> bool {
    e.scheduled_at.is_none_or(|at| at <= e.at)
}
