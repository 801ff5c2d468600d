//! The invariants, checked after the queue drained, from the audit log (every insert,
//! update and delete of `skiplock.jobs`, numbered by `seq`), the dependency edges
//! (`public.model_deps`), the handlers' run log and the workers' logs.
//!
//! The audit is replayed in `seq` order. A transaction takes its `seq` values when it
//! writes, not when it commits, but every decision checked here (a claim, a promotion)
//! is taken by a statement that saw the decisive rows committed, so their order holds.
//!
//! Definitions used below:
//! - *unfinished*: waiting, queued or running; *finished*: succeeded, dead, cancelled;
//! - a job *enters* its lane when it is inserted, and again when a manual retry moves it
//!   from a finished state back to unfinished (its entry `seq`);
//! - **lane order**: when lane job J is claimed, no job K of its lane with a smaller id
//!   is unfinished *and* entered the lane before J did. (A finished job retried by hand
//!   re-enters behind the jobs already in line; it is not "older" than them.)
//! - **dependencies**: when J is claimed, each parent's latest finished state before the
//!   claim is `succeeded`, and the parent was not deleted while unfinished, or that held
//!   when J was last released (inserted `queued`, promoted from `waiting` or retried by
//!   hand; its own retries keep the release): a child released once its parents
//!   succeeded stays released when an operator retries a parent afterwards;
//! - **unique keys**: at no point two pending (waiting or queued) jobs share a key;
//! - **drained**: every job is finished or was deleted; a cancelled or dead job has a
//!   `last_error`; only the operator deletes unfinished jobs;
//! - **claim discipline**: a claim adds one attempt, within `max_attempts`, with a fresh
//!   token; a running job changes only by heartbeat, by its holder, by the reaper (or a
//!   requeue that supersedes it) or by an operator's cancel; no worker ever changes a
//!   finished job (a stale token changes nothing);
//! - **lane runs**: two `model` handler runs of one lane never overlap in time, unless
//!   the earlier run's claim was taken from it (reaped, or cancelled by the operator);
//! - **global limits**: the limited queue never has more than its `max_running` jobs
//!   running after any audit row, and no start of it (a claim's `claimed_at`) comes sooner
//!   than its rate limit's period after the start `rate_limit` before it; no concurrency
//!   key has more than the queue's `key_max_running` of its jobs running, nor a start
//!   sooner than its `key_rate_period` after the key's start `key_rate_limit` before it;
//! - **logs**: no worker or maintenance statement failed except on a killed connection.

use std::collections::{BTreeSet, HashMap, HashSet};

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

use crate::fault_support::AuditRow;

use super::kind::Run;
use super::logs::{is_defect, strip_ansi};
use super::{
    KEYED_QUEUE, LIMITED_QUEUE, LIMITED_QUEUE_KEY_MAX, LIMITED_QUEUE_KEY_RATE, LIMITED_QUEUE_RATE,
};

/// One row of the extended audit: the faults' audit row (`fault_support::AuditRow`, whose
/// fields and tests it derefs to) and the columns the model's audit adds
/// (`extend_audit`).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Ev {
    #[sqlx(flatten)]
    pub row: AuditRow,
    pub ordering_key: Option<String>,
    pub unique_key: Option<String>,
    pub queue: Option<String>,
    pub concurrency_key: Option<String>,
    /// Why a `waiting` job waits when a per-key limit holds it back ('key' or 'rate').
    pub held_for: Option<String>,
    /// When the job may run (clamped to finite times: '-infinity' reads as year 1).
    pub scheduled_at: Option<DateTime<Utc>>,
}

impl AsRef<AuditRow> for Ev {
    fn as_ref(&self) -> &AuditRow {
        &self.row
    }
}

impl std::ops::Deref for Ev {
    type Target = AuditRow;

    fn deref(&self) -> &AuditRow {
        &self.row
    }
}

impl Ev {
    /// The reaper's write, or a requeue that found its unique key taken (written by
    /// whoever requeued it: possibly another worker's reaper).
    fn is_reap_or_superseded(&self) -> bool {
        self.last_error.as_deref().is_some_and(|e| {
            (self.failure && e.starts_with("no heartbeat from ")) || e.contains("superseded")
        })
    }

    fn line(&self) -> String {
        let state = |s: &Option<String>| s.clone().unwrap_or_else(|| "-".into());
        let mut line = format!(
            "#{} {} {}->{} att {:?}->{:?}/{:?} app={} holder={:?}->{:?}",
            self.seq,
            self.op,
            state(&self.old_state),
            state(&self.new_state),
            self.old_attempt,
            self.new_attempt,
            self.max_attempts,
            self.app,
            self.old_holder,
            self.new_holder
        );
        if let Some(e) = &self.last_error {
            line.push_str(&format!(" err={:?}", truncate(e, 120)));
        }
        line
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        s.to_owned()
    } else {
        let mut end = n;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}…", &s[..end])
    }
}

fn finished(state: &str) -> bool {
    matches!(state, "succeeded" | "dead" | "cancelled")
}

fn pending(state: &str) -> bool {
    matches!(state, "waiting" | "queued")
}

/// What the replay knows about one job at the current `seq`.
#[derive(Debug, Clone, Default)]
struct Track {
    lane: Option<String>,
    queue: Option<String>,
    concurrency_key: Option<String>,
    unique: Option<String>,
    /// `None` once deleted.
    state: Option<String>,
    entry_seq: i64,
    last_finished: Option<String>,
    deleted_unfinished: bool,
    deleted_by: Option<String>,
    last_error: Option<String>,
    /// When the job last became `queued` (was released), every parent had succeeded.
    released_after_parents: bool,
}

/// The limited queue's own limits as the database holds them (the model sets them before
/// the run and never changes them): what the coverage measures their binding against, so
/// that a limit not set never binds. `None` where it is not set. (The per-key limits show
/// their binding by the jobs they hold back, `held_for`.)
#[derive(Debug, Clone, Copy, Default, sqlx::FromRow)]
pub struct LimitsInForce {
    pub max_running: Option<i32>,
    pub rate_limit: Option<i32>,
    pub rate_period_ms: Option<i64>,
}

/// Everything the checks read.
pub struct Evidence {
    pub events: Vec<Ev>,
    /// The limited queue's limits in force.
    pub limits: LimitsInForce,
    /// (seq, child, parent)
    pub deps: Vec<(i64, i64, i64)>,
    pub runs: Vec<Run>,
    /// (source, line)
    pub logs: Vec<(String, String)>,
    /// Jobs whose rows are gone with no `DELETE` recorded: their day's table dropped by the
    /// pruner (which deletes no row), or a violation when they had not finished.
    pub gone_with_their_day: Vec<i64>,
}

impl Evidence {
    pub async fn load(pool: &PgPool, runs: Vec<Run>, logs: Vec<(String, String)>) -> Evidence {
        let events = sqlx::query_as(
            "SELECT seq, job_id, op, old_state::text, new_state::text, old_attempt,
                    new_attempt, max_attempts, old_token, new_token, old_holder, new_holder,
                    heartbeat, failure, last_error, app, ordering_key, unique_key, queue,
                    concurrency_key, at, claimed_at, txid, held_for,
                    greatest(least(scheduled_at, '9999-12-31'), '0001-01-01') AS scheduled_at
             FROM public.job_audit ORDER BY seq",
        )
        .fetch_all(pool)
        .await
        .expect("read the audit");
        let deps =
            sqlx::query_as("SELECT seq, job_id, parent_id FROM public.model_deps ORDER BY seq")
                .fetch_all(pool)
                .await
                .expect("read the dependency edges");
        let limits = sqlx::query_as(
            "SELECT max_running, rate_limit,
                    (extract(epoch FROM rate_period) * 1000)::bigint AS rate_period_ms
             FROM skiplock.queues WHERE name = $1",
        )
        .bind(LIMITED_QUEUE.0)
        .fetch_optional(pool)
        .await
        .expect("read the limited queue's limits")
        .unwrap_or_default();
        let gone_with_their_day = sqlx::query_scalar(
            "SELECT DISTINCT a.job_id FROM public.job_audit a
             WHERE NOT EXISTS (SELECT 1 FROM public.job_audit d
                               WHERE d.job_id = a.job_id AND d.op = 'delete')
               AND NOT EXISTS (SELECT 1 FROM skiplock.jobs j WHERE j.id = a.job_id)
             ORDER BY 1",
        )
        .fetch_all(pool)
        .await
        .expect("read the jobs gone with their day");
        Evidence {
            events,
            limits,
            deps,
            runs,
            logs,
            gone_with_their_day,
        }
    }

    /// The audit rows of one job (heartbeats left out), for a violation's report.
    fn history(&self, job: i64) -> String {
        let rows: Vec<String> = self
            .events
            .iter()
            .filter(|e| e.job_id == job && !e.heartbeat)
            .map(|e| format!("      {}", e.line()))
            .collect();
        let shown = rows.len().min(14);
        let mut text = rows[rows.len() - shown..].join("\n");
        if rows.len() > shown {
            text = format!("      ({} earlier rows)\n{text}", rows.len() - shown);
        }
        format!("    audit of job {job}:\n{text}")
    }
}

/// A row goes by a `DELETE` (recorded) or with its day's table, which the pruner drops only
/// once every row in it finished past its retention: a job gone with no `DELETE` recorded
/// had finished when it went.
fn check_gone_with_their_day(
    evidence: &Evidence,
    tracks: &HashMap<i64, Track>,
    found: &mut Vec<String>,
) {
    for job in &evidence.gone_with_their_day {
        let state = tracks.get(job).and_then(|t| t.state.as_deref());
        if !state.is_some_and(finished) {
            found.push(format!(
                "[days] job {job} is gone with no DELETE while {state:?}: a day's drop took a \
                 job that had not finished\n{}",
                evidence.history(*job)
            ));
        }
    }
}

/// Runs every check; returns the violations, each starting with its `[category]`.
pub fn check_all(evidence: &Evidence) -> Vec<String> {
    let mut found = Vec::new();
    let tracks = replay(evidence, &mut found);
    check_drained(evidence, &tracks, &mut found);
    check_gone_with_their_day(evidence, &tracks, &mut found);
    check_claim_discipline(evidence, &mut found);
    check_superseded(evidence, &tracks, &mut found);
    check_lane_runs(evidence, &tracks, &mut found);
    check_running_limits(evidence, &mut found);
    check_rate_limit(evidence, &mut found);
    check_key_rate_limit(evidence, &mut found);
    check_logs(evidence, &mut found);
    found
}

/// The starts (claims) of the limited queue, by `claimed_at`, oldest first: what its rate
/// limit counts (a claim stamps every job it takes with the time it checked the limit).
pub fn limited_starts(evidence: &Evidence) -> Vec<(DateTime<Utc>, i64)> {
    let mut starts: Vec<(DateTime<Utc>, i64)> = evidence
        .events
        .iter()
        .filter(|e| e.is_claim() && e.queue.as_deref() == Some(LIMITED_QUEUE.0))
        .filter_map(|e| Some((e.claimed_at?, e.seq)))
        .collect();
    starts.sort();
    starts
}

/// The starts of the limited queue's jobs with a concurrency key, per key, as
/// [`limited_starts`].
pub fn limited_starts_per_key(evidence: &Evidence) -> HashMap<String, Vec<(DateTime<Utc>, i64)>> {
    let mut starts: HashMap<String, Vec<(DateTime<Utc>, i64)>> = HashMap::new();
    for e in evidence
        .events
        .iter()
        .filter(|e| e.is_claim() && e.queue.as_deref() == Some(LIMITED_QUEUE.0))
    {
        if let (Some(key), Some(at)) = (&e.concurrency_key, e.claimed_at) {
            starts.entry(key.clone()).or_default().push((at, e.seq));
        }
    }
    for key_starts in starts.values_mut() {
        key_starts.sort();
    }
    starts
}

/// The limited queue's running jobs, and those of each concurrency key of the limited and
/// the keyed queue, between transactions in commit order (`fault_support::transactions`:
/// a completion that hands its key's next job on writes the start's row before the
/// end's): never more than max_running, nor key_max_running of one key.
fn check_running_limits(evidence: &Evidence, found: &mut Vec<String>) {
    let mut limited_running: BTreeSet<i64> = BTreeSet::new();
    // By queue and key.
    let mut key_running: HashMap<(&str, String), BTreeSet<i64>> = HashMap::new();
    let key_max = |queue: &str| {
        if queue == LIMITED_QUEUE.0 {
            LIMITED_QUEUE_KEY_MAX
        } else {
            KEYED_QUEUE.1
        }
    };
    for transaction in crate::fault_support::transactions(&evidence.events) {
        for ev in transaction.iter().filter(|e| !e.heartbeat) {
            let job = ev.job_id;
            limited_running.remove(&job);
            for set in key_running.values_mut() {
                set.remove(&job);
            }
            if ev.new_state.as_deref() != Some("running") {
                continue;
            }
            let queue = [LIMITED_QUEUE.0, KEYED_QUEUE.0]
                .into_iter()
                .find(|q| ev.queue.as_deref() == Some(*q));
            if ev.queue.as_deref() == Some(LIMITED_QUEUE.0) {
                limited_running.insert(job);
            }
            if let (Some(queue), Some(key)) = (queue, &ev.concurrency_key) {
                key_running
                    .entry((queue, key.clone()))
                    .or_default()
                    .insert(job);
            }
        }
        let Some(last) = transaction.last() else {
            continue;
        };
        for ((queue, key), running) in &key_running {
            let max = key_max(queue);
            if running.len() > max {
                found.push(format!(
                    "[limit: over key_max_running] key {key} of queue {queue} has jobs {running:?} running at once, over its key_max_running {max} (audit seq {})",
                    last.seq
                ));
            }
        }
        if limited_running.len() > LIMITED_QUEUE.1 {
            found.push(format!(
                "[limit: over max_running] queue {} has jobs {limited_running:?} running at once, over its max_running {} (audit seq {})",
                LIMITED_QUEUE.0, LIMITED_QUEUE.1, last.seq
            ));
        }
    }
}

/// The per-key rate limit of the limited queue, exact in every window: a start of a key
/// comes no sooner than a whole period after the key's start `key_rate_limit` before it.
fn check_key_rate_limit(evidence: &Evidence, found: &mut Vec<String>) {
    let (limit, period_ms) = LIMITED_QUEUE_KEY_RATE;
    let period = chrono::Duration::milliseconds(period_ms);
    for (key, starts) in limited_starts_per_key(evidence) {
        for i in limit..starts.len() {
            let (at, seq) = starts[i];
            let (earlier, earlier_seq) = starts[i - limit];
            if at - earlier < period {
                found.push(format!(
                    "[limit: over key_rate_limit] key {key} of queue {} started {} jobs within {} ms ({earlier} to {at}; audit seq {earlier_seq} to {seq}), over its key rate limit of {limit} per {period_ms} ms",
                    LIMITED_QUEUE.0,
                    limit + 1,
                    (at - earlier).num_milliseconds()
                ));
            }
        }
    }
}

/// The rate limit of the limited queue, exact in every window: a start comes no sooner
/// than a whole period after the start `rate_limit` before it.
fn check_rate_limit(evidence: &Evidence, found: &mut Vec<String>) {
    let (limit, period_ms) = LIMITED_QUEUE_RATE;
    let period = chrono::Duration::milliseconds(period_ms);
    let starts = limited_starts(evidence);
    for i in limit..starts.len() {
        let (at, seq) = starts[i];
        let (earlier, earlier_seq) = starts[i - limit];
        if at - earlier < period {
            found.push(format!(
                "[limit: over rate_limit] queue {} started {} jobs within {} ms ({earlier} to {at}; audit seq {earlier_seq} to {seq}), over its rate limit of {limit} per {period_ms} ms",
                LIMITED_QUEUE.0,
                limit + 1,
                (at - earlier).num_milliseconds()
            ));
        }
    }
}

/// Replays the audit: lane order, dependencies at claim time, one running job per lane,
/// one pending job per unique key. Returns the final view of every job.
fn replay(evidence: &Evidence, found: &mut Vec<String>) -> HashMap<i64, Track> {
    let mut tracks: HashMap<i64, Track> = HashMap::new();
    let mut lane_unfinished: HashMap<String, BTreeSet<i64>> = HashMap::new();
    let mut lane_running: HashMap<String, BTreeSet<i64>> = HashMap::new();
    let mut unique_pending: HashMap<String, BTreeSet<i64>> = HashMap::new();
    let mut parents: HashMap<i64, Vec<(i64, i64)>> = HashMap::new();
    for &(seq, child, parent) in &evidence.deps {
        parents.entry(child).or_default().push((seq, parent));
    }
    let mut reported: HashSet<(String, i64)> = HashSet::new();
    for ev in evidence.events.iter().filter(|e| !e.heartbeat) {
        let job = ev.job_id;
        let before = tracks.get(&job).cloned().unwrap_or_default();
        let old = before.state.clone();
        let new = ev.new_state.clone();
        if ev.is_claim() {
            check_claim_order(
                evidence,
                &tracks,
                &lane_unfinished,
                ev,
                &before,
                found,
                &mut reported,
            );
            check_claim_parents(evidence, &tracks, parents.get(&job), ev, &before, found);
        }
        // Released: inserted queued, promoted from waiting, or retried by hand from a
        // finished state. Its own retries (running -> queued) keep the release.
        let released = new.as_deref() == Some("queued")
            && !matches!(old.as_deref(), Some("queued" | "running"));
        let released_after_parents = released && parents_done(&tracks, parents.get(&job), ev.seq);
        let track = tracks.entry(job).or_default();
        if ev.op != "delete" {
            track.lane = ev.ordering_key.clone();
            track.unique = ev.unique_key.clone();
            track.queue = ev.queue.clone();
            track.concurrency_key = ev.concurrency_key.clone();
        }
        match ev.op.as_str() {
            "insert" => track.entry_seq = ev.seq,
            "update"
                if old.as_deref().is_some_and(finished)
                    && new.as_deref().is_some_and(|s| !finished(s)) =>
            {
                track.entry_seq = ev.seq;
            }
            "delete" => {
                track.deleted_unfinished = old.as_deref().is_some_and(|s| !finished(s));
                track.deleted_by = Some(ev.app.clone());
            }
            _ => {}
        }
        if let Some(state) = new.as_deref().filter(|s| finished(s)) {
            track.last_finished = Some(state.to_owned());
        }
        track.state = new.clone();
        track.last_error = ev.last_error.clone();
        if released {
            track.released_after_parents = released_after_parents;
        }
        // Membership of lane and unique-key sets after this row.
        let unfinished = new.as_deref().is_some_and(|s| !finished(s));
        for lane in [&before.lane, &track.lane].into_iter().flatten() {
            lane_unfinished
                .entry(lane.clone())
                .or_default()
                .remove(&job);
            lane_running.entry(lane.clone()).or_default().remove(&job);
        }
        for key in [&before.unique, &track.unique].into_iter().flatten() {
            unique_pending.entry(key.clone()).or_default().remove(&job);
        }
        if let Some(lane) = &track.lane {
            if unfinished {
                lane_unfinished.entry(lane.clone()).or_default().insert(job);
            }
            if new.as_deref() == Some("running") {
                let running = lane_running.entry(lane.clone()).or_default();
                running.insert(job);
                if running.len() > 1 {
                    found.push(format!(
                        "[lane: two running] lane {lane} has jobs {running:?} running at once (audit seq {})\n{}",
                        ev.seq,
                        running.iter().map(|&j| evidence.history(j)).collect::<Vec<_>>().join("\n")
                    ));
                }
            }
        }
        if let Some(key) = &track.unique
            && new.as_deref().is_some_and(pending)
        {
            let pending = unique_pending.entry(key.clone()).or_default();
            pending.insert(job);
            if pending.len() > 1 {
                found.push(format!(
                    "[unique: two pending] unique key {key} has pending jobs {pending:?} (audit seq {})",
                    ev.seq
                ));
            }
        }
    }
    tracks
}

/// Lane order at a claim (see the module docs).
fn check_claim_order(
    evidence: &Evidence,
    tracks: &HashMap<i64, Track>,
    lane_unfinished: &HashMap<String, BTreeSet<i64>>,
    ev: &Ev,
    claimed: &Track,
    found: &mut Vec<String>,
    reported: &mut HashSet<(String, i64)>,
) {
    let Some(lane) = &claimed.lane else { return };
    let Some(members) = lane_unfinished.get(lane) else {
        return;
    };
    let job = ev.job_id;
    for &older in members.range(..job) {
        let other = &tracks[&older];
        if other.entry_seq < claimed.entry_seq && reported.insert((lane.clone(), job)) {
            found.push(format!(
                "[lane: order] lane {lane}: job {job} (entered at seq {}) was claimed at seq {} \
                 by {:?} while older job {older} (entered at seq {}) was {}\n{}\n{}",
                claimed.entry_seq,
                ev.seq,
                ev.new_holder,
                other.entry_seq,
                other.state.as_deref().unwrap_or("?"),
                evidence.history(older),
                evidence.history(job)
            ));
        }
    }
}

/// Whether every parent (edges written up to `seq`) has `succeeded` as its latest finished
/// state and was not deleted unfinished.
fn parents_done(tracks: &HashMap<i64, Track>, parents: Option<&Vec<(i64, i64)>>, seq: i64) -> bool {
    parents.into_iter().flatten().all(|&(edge_seq, parent)| {
        edge_seq > seq
            || tracks.get(&parent).is_some_and(|track| {
                track.last_finished.as_deref() == Some("succeeded") && !track.deleted_unfinished
            })
    })
}

/// Dependencies at a claim (see the module docs).
fn check_claim_parents(
    evidence: &Evidence,
    tracks: &HashMap<i64, Track>,
    parents: Option<&Vec<(i64, i64)>>,
    ev: &Ev,
    claimed: &Track,
    found: &mut Vec<String>,
) {
    if claimed.released_after_parents {
        // Released once every parent had succeeded; an operator retrying a parent later
        // does not recall a child already released.
        return;
    }
    for &(edge_seq, parent) in parents.into_iter().flatten() {
        if edge_seq > ev.seq {
            continue;
        }
        let track = tracks.get(&parent).cloned().unwrap_or_default();
        let born = evidence
            .events
            .iter()
            .find(|e| e.job_id == ev.job_id && e.op == "insert")
            .map(|e| format!("{} by {}", e.new_state.as_deref().unwrap_or("?"), e.app))
            .unwrap_or_default();
        let ok = track.last_finished.as_deref() == Some("succeeded") && !track.deleted_unfinished;
        if !ok {
            let deleted = if track.state.is_none() {
                format!(", deleted by {:?}", track.deleted_by)
            } else {
                String::new()
            };
            found.push(format!(
                "[deps: claimed early] job {} (inserted {born}) was claimed at seq {} by {:?} while its \
                 parent {parent} was {} (last finished state {:?}{deleted})\n{}\n{}",
                ev.job_id,
                ev.seq,
                ev.new_holder,
                track.state.as_deref().unwrap_or("deleted"),
                track.last_finished,
                evidence.history(parent),
                evidence.history(ev.job_id)
            ));
        }
    }
}

/// After the drain: everything finished or deleted, with reasons where due.
fn check_drained(evidence: &Evidence, tracks: &HashMap<i64, Track>, found: &mut Vec<String>) {
    let mut parents_of: HashMap<i64, Vec<i64>> = HashMap::new();
    for &(_, child, parent) in &evidence.deps {
        parents_of.entry(child).or_default().push(parent);
    }
    let mut ids: Vec<&i64> = tracks.keys().collect();
    ids.sort();
    for &job in ids {
        let track = &tracks[&job];
        match track.state.as_deref() {
            None if track.deleted_unfinished
                && track.deleted_by.as_deref() != Some("model-ops") =>
            {
                found.push(format!(
                    "[drain: deleted unfinished] job {job} was deleted unfinished by {:?}\n{}",
                    track.deleted_by,
                    evidence.history(job)
                ));
            }
            None => {}
            Some(state) if !finished(state) => {
                let parents: Vec<String> = parents_of
                    .get(&job)
                    .into_iter()
                    .flatten()
                    .map(|p| {
                        let t = tracks.get(p).cloned().unwrap_or_default();
                        format!("{p}:{}", t.state.as_deref().unwrap_or("deleted"))
                    })
                    .collect();
                let lane_mates: Vec<String> = tracks
                    .iter()
                    .filter(|(other, t)| **other != job && t.lane.is_some() && t.lane == track.lane)
                    .filter(|(_, t)| t.state.as_deref().is_some_and(|s| !finished(s)))
                    .map(|(other, t)| format!("{other}:{}", t.state.as_deref().unwrap_or("?")))
                    .collect();
                found.push(format!(
                    "[drain: unfinished] job {job} is still {state} after the drain (queue {:?}, \
                     concurrency key {:?}, lane {:?} with unfinished [{}], unique key {:?}, \
                     parents [{}])\n{}",
                    track.queue,
                    track.concurrency_key,
                    track.lane,
                    lane_mates.join(", "),
                    track.unique,
                    parents.join(", "),
                    evidence.history(job)
                ));
            }
            Some(state @ ("cancelled" | "dead")) if track.last_error.is_none() => {
                found.push(format!(
                    "[drain: no reason] job {job} is {state} without a last_error\n{}",
                    evidence.history(job)
                ));
            }
            Some(_) => {}
        }
    }
}

/// The claim discipline, as `fault_support::check_claim_discipline` defines it, reported
/// instead of panicking, with two additions: a requeue that supersedes a job (unique key
/// taken) may be written by another worker, and no worker may change a finished job.
fn check_claim_discipline(evidence: &Evidence, found: &mut Vec<String>) {
    let mut tokens: HashMap<i64, HashSet<Uuid>> = HashMap::new();
    for ev in evidence.events.iter().filter(|e| e.op == "update") {
        let job = ev.job_id;
        let old = ev.old_state.as_deref().unwrap_or_default();
        let new = ev.new_state.as_deref().unwrap_or_default();
        let mut problem = None;
        if ev.is_start() {
            let (before, after) = (ev.old_attempt.unwrap_or(0), ev.new_attempt.unwrap_or(0));
            if after != before + 1 {
                problem = Some("a claim did not add exactly one attempt");
            } else if after > ev.max_attempts.unwrap_or(0) {
                problem = Some("a claim went beyond max_attempts");
            } else if !ev
                .new_token
                .is_some_and(|t| tokens.entry(job).or_default().insert(t))
            {
                problem = Some("a claim reused a token (or set none)");
            }
        } else if old == "running" && new == "running" && !ev.heartbeat {
            problem = Some("a running job changed without a heartbeat");
        } else if old == "running"
            && ev.app.starts_with("tb-")
            && Some(ev.app.as_str()) != ev.old_holder.as_deref()
            && !ev.is_reap_or_superseded()
        {
            problem = Some("a worker that does not hold the claim changed it");
        } else if old == "running" && !ev.app.starts_with("tb-") && new != "cancelled" {
            problem = Some("a non-worker moved a running job other than by cancelling it");
        } else if finished(old) && ev.app.starts_with("tb-") {
            problem = Some("a worker changed a finished job");
        }
        if let Some(problem) = problem {
            found.push(format!(
                "[claims] job {job}: {problem}: {}\n{}",
                ev.line(),
                evidence.history(job)
            ));
        }
    }
}

/// A job cancelled as superseded names the pending job that holds its unique key.
fn check_superseded(evidence: &Evidence, tracks: &HashMap<i64, Track>, found: &mut Vec<String>) {
    for ev in &evidence.events {
        let Some(error) = ev.last_error.as_deref() else {
            continue;
        };
        if ev.new_state.as_deref() != Some("cancelled") || !error.contains("superseded") {
            continue;
        }
        let key = tracks.get(&ev.job_id).and_then(|t| t.unique.clone());
        let named = error
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|n| n.parse::<i64>().ok())
            .any(|id| {
                id != ev.job_id
                    && key.is_some()
                    && tracks.get(&id).and_then(|t| t.unique.clone()) == key
            });
        if !named {
            found.push(format!(
                "[unique: superseded] job {} was cancelled as superseded without naming a job of its \
                 unique key {key:?}: {}\n{}",
                ev.job_id,
                ev.line(),
                evidence.history(ev.job_id)
            ));
        }
    }
}

/// Handler runs of one lane never overlap, unless the earlier claim was taken away.
fn check_lane_runs(evidence: &Evidence, tracks: &HashMap<i64, Track>, found: &mut Vec<String>) {
    // Claims by (job, attempt, holder) whose claim ended by someone else's hand.
    let mut claim_token: HashMap<(i64, i32, String), Vec<Uuid>> = HashMap::new();
    let mut lost: HashSet<Uuid> = HashSet::new();
    for ev in &evidence.events {
        if ev.is_claim()
            && let (Some(attempt), Some(holder), Some(token)) =
                (ev.new_attempt, &ev.new_holder, ev.new_token)
        {
            claim_token
                .entry((ev.job_id, attempt, holder.clone()))
                .or_default()
                .push(token);
        }
        if ev.old_state.as_deref() == Some("running")
            && ev.new_state.as_deref() != Some("running")
            && let Some(token) = ev.old_token
            && (ev.op == "delete"
                || Some(ev.app.as_str()) != ev.old_holder.as_deref()
                || ev.is_reap_or_superseded())
        {
            lost.insert(token);
        }
    }
    let mut by_lane: HashMap<String, Vec<&Run>> = HashMap::new();
    for run in &evidence.runs {
        let Some(lane) = tracks.get(&run.job_id).and_then(|t| t.lane.clone()) else {
            continue;
        };
        let tokens = claim_token.get(&(run.job_id, run.attempt, run.worker.clone()));
        if tokens.is_none_or(|ts| ts.iter().any(|t| lost.contains(t))) {
            continue;
        }
        by_lane.entry(lane).or_default().push(run);
    }
    for (lane, mut runs) in by_lane {
        runs.sort_by_key(|r| r.start_ns);
        let mut latest: Option<&Run> = None;
        for run in runs {
            if let Some(prev) = latest
                && prev.end_ns.unwrap_or(u64::MAX) > run.start_ns
                && prev.job_id != run.job_id
            {
                found.push(format!(
                    "[lane: runs overlap] lane {lane}: job {} attempt {} ran on {} from {:.3}s to {:?} \
                     while job {} attempt {} started on {} at {:.3}s\n{}\n{}",
                    prev.job_id,
                    prev.attempt,
                    prev.worker,
                    prev.start_ns as f64 / 1e9,
                    prev.end_ns.map(|e| e as f64 / 1e9),
                    run.job_id,
                    run.attempt,
                    run.worker,
                    run.start_ns as f64 / 1e9,
                    evidence.history(prev.job_id),
                    evidence.history(run.job_id)
                ));
            }
            if latest.is_none_or(|p| p.end_ns.unwrap_or(u64::MAX) < run.end_ns.unwrap_or(u64::MAX))
            {
                latest = Some(run);
            }
        }
    }
}

/// No worker or maintenance statement failed on data.
fn check_logs(evidence: &Evidence, found: &mut Vec<String>) {
    let mut seen: HashSet<String> = HashSet::new();
    let defects: Vec<&(String, String)> = evidence
        .logs
        .iter()
        .filter(|(_, line)| is_defect(line))
        .collect();
    for (source, line) in &defects {
        let line = strip_ansi(line);
        // One report per distinct message (timestamps and ids differ).
        let shape: String = line
            .split_whitespace()
            .skip(2)
            .collect::<Vec<_>>()
            .join(" ")
            .chars()
            .filter(|c| !c.is_ascii_digit())
            .collect();
        if seen.insert(shape) {
            found.push(format!("[logs] {source}: {}", truncate(&line, 600)));
        }
    }
    if !defects.is_empty() {
        found.push(format!(
            "[logs] {} log lines in all report a failed statement",
            defects.len()
        ));
    }
}

/// A job superseded under policy `merge` had its args folded into the job that holds
/// its unique key, in the same transaction. Read from the audit (which records args), not
/// from `skiplock.jobs`: the pruner at zero retention may have removed both jobs. Returns
/// the violations and how many superseded merges were checked.
pub async fn check_merged(pool: &PgPool) -> (Vec<String>, usize) {
    let rows: Vec<(i64, Option<String>, Option<i64>, bool)> = sqlx::query_as(
        "SELECT s.job_id, s.last_error, m.holder,
                EXISTS (SELECT FROM public.job_audit h
                        WHERE h.job_id = m.holder AND h.txid = s.txid AND h.op = 'update'
                          AND h.args @> CASE WHEN jsonb_typeof(s.args) = 'array' THEN s.args
                                             ELSE jsonb_build_array(s.args) END)
         FROM public.job_audit s
         CROSS JOIN LATERAL (
             SELECT (regexp_match(s.last_error, 'pending job ([0-9]+)'))[1]::bigint
         ) AS m(holder)
         WHERE s.op IN ('insert', 'update') AND s.new_state = 'cancelled'
           AND s.old_state IS DISTINCT FROM 'cancelled'
           AND s.unique_policy = 'merge' AND s.last_error LIKE 'superseded:%'",
    )
    .fetch_all(pool)
    .await
    .expect("read superseded merge jobs from the audit");
    let checked = rows.len();
    let violations = rows
        .into_iter()
        .filter(|(_, _, _, folded)| !folded)
        .map(|(job, error, holder, _)| {
            format!(
                "[unique: merge not folded] job {job} ({error:?}) was superseded under policy merge \
                 but its args were not added to job {holder:?}'s in the same transaction"
            )
        })
        .collect();
    (violations, checked)
}
