//! Rules of `migrations/functions/` that no single behaviour test would notice broken:
//! each file opens with the list of what it defines, and every function that queues jobs
//! announces them through `skiplock.internal_announce` (the one way statements tell
//! workers of runnable work; a statement that forgets leaves its jobs to the workers' next
//! walk from the start, up to a minute later), every function that reads a lane to
//! move it takes the lane's lock, every function that ends a claim tells of the slot it
//! frees, every function on job rows runs without JIT, every function that holds jobs for
//! their key's turn leaves the marks the walks of held jobs start from, and every function
//! that writes or locks a job another transaction may move between partitions handles 40001
//! or names the callers that do, and every function that writes a rate window holds its
//! queue's turn or names the callers that do. And one rule of the SQL the tests write: a query of the sessions view
//! under tests/ names the test's own sessions only. Reads the files only: no database.

use std::path::PathBuf;

/// One `CREATE OR REPLACE FUNCTION | TRIGGER | VIEW | AGGREGATE` of a file.
struct Definition {
    /// As the file's header lists it: `name`, `trigger name`, `view name`, `aggregate name`.
    label: String,
    /// A function's body (between its `$$`), empty for the others.
    body: String,
    /// A function's arguments, result and settings (before its first `$$`), empty for the
    /// others.
    header: String,
}

fn functions_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("migrations/functions")
}

/// The files in the order they are applied (their names), with their text.
fn files() -> Vec<(String, String)> {
    let mut files: Vec<(String, String)> = std::fs::read_dir(functions_dir())
        .unwrap()
        .map(|entry| {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap().to_owned();
            (name, std::fs::read_to_string(&path).unwrap())
        })
        .collect();
    files.sort();
    assert!(
        files.len() > 5,
        "migrations/functions/ holds the schema's functions"
    );
    files
}

fn definitions(text: &str) -> Vec<Definition> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("CREATE OR REPLACE ") {
        rest = &rest[at + "CREATE OR REPLACE ".len()..];
        let (kind, after) = rest.split_once(' ').unwrap();
        let name: String = after
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '.')
            .collect();
        let name = name.trim_start_matches("skiplock.").to_owned();
        let (label, body, header) = match kind {
            "FUNCTION" => {
                let start = rest.find("$$").unwrap() + 2;
                let end = start + rest[start..].find("$$").unwrap();
                let header = rest[..start - 2].to_owned();
                let body = rest[start..end].to_owned();
                rest = &rest[end + 2..];
                (name, body, header)
            }
            "TRIGGER" => (format!("trigger {name}"), String::new(), String::new()),
            "VIEW" => (format!("view {name}"), String::new(), String::new()),
            "AGGREGATE" => (format!("aggregate {name}"), String::new(), String::new()),
            other => panic!("unexpected CREATE OR REPLACE {other}"),
        };
        found.push(Definition {
            label,
            body,
            header,
        });
    }
    found
}

/// The names a file's opening comment lists after `-- Defines:`.
fn header_list(text: &str) -> Vec<String> {
    text.lines()
        .skip_while(|line| *line != "-- Defines:")
        .skip(1)
        .take_while(|line| line.starts_with("--   "))
        .flat_map(|line| line.trim_start_matches("--   ").split(", "))
        .map(|item| item.trim().to_owned())
        .collect()
}

#[test]
fn each_file_opens_with_the_list_of_what_it_defines() {
    for (name, text) in files() {
        let mut defined: Vec<String> = Vec::new();
        for definition in definitions(&text) {
            // A trigger made on several tables is listed once.
            if !defined.contains(&definition.label) {
                defined.push(definition.label);
            }
        }
        assert_eq!(
            header_list(&text),
            defined,
            "migrations/functions/{name}: the `-- Defines:` list at its top must name what \
             it defines, in order"
        );
    }
}

/// Whether a function body writes rows of `skiplock.jobs`.
fn writes_jobs(body: &str) -> bool {
    ["UPDATE skiplock.jobs", "INSERT INTO skiplock.jobs"]
        .iter()
        .any(|write| body.contains(write))
}

/// The functions that break a rule, as `name (file)`: those for which `breaks` holds, less
/// the ones `exempt` names (each with its reason). Panics, naming it, when `exempt` names a
/// function that no longer breaks it, so a stale exemption goes.
fn breaking(
    exempt: &[(&str, &str)],
    exempt_list: &str,
    applies: impl Fn(&Definition) -> bool,
    breaks: impl Fn(&Definition) -> bool,
) -> Vec<String> {
    let mut found = Vec::new();
    let mut seen_exempt = Vec::new();
    for (file, text) in files() {
        for definition in definitions(&text) {
            if !applies(&definition) || !breaks(&definition) {
                continue;
            }
            if exempt.iter().any(|(name, _)| *name == definition.label) {
                seen_exempt.push(definition.label);
            } else {
                found.push(format!("{} ({file})", definition.label));
            }
        }
    }
    for (name, _) in exempt {
        assert!(
            seen_exempt.iter().any(|seen| seen == name),
            "{exempt_list} names {name}, which no longer needs the exemption: remove it"
        );
    }
    found
}

/// Functions that write jobs and name the `queued` state without making jobs runnable
/// themselves, each with the reason it announces nothing.
const QUEUES_NOTHING: &[(&str, &str)] = &[
    (
        "internal_free_slots",
        "takes a key's held or queued job straight to running for the worker that freed the slot",
    ),
    (
        "internal_hold_for_turns",
        "moves jobs its statement just inserted from queued to waiting (their turn); the statement's trigger announced them",
    ),
    (
        "internal_fold_into_key_holder",
        "changes a pending holder's args; internal_unique_key_holder announced the holder it locked",
    ),
    (
        "enqueue_job",
        "inserts into jobs_live; the insert statement's trigger announces",
    ),
    (
        "internal_jobs_before_insert",
        "a BEFORE INSERT trigger; the statement's AFTER trigger announces what was inserted",
    ),
    (
        "internal_claim_batch",
        "takes queued jobs and makes none runnable",
    ),
    (
        "internal_hold_keys",
        "moves queued jobs of full keys to waiting; internal_release_held announces them when they go",
    ),
    (
        "internal_hold_overflow",
        "moves queued jobs past their key's turn to waiting; internal_release_held announces them when they go",
    ),
    (
        "internal_complete_claims",
        "ends claims (succeeded); the caller moves lanes and dependants on",
    ),
    (
        "internal_abandon_claims",
        "ends claims (dead); the caller moves lanes and dependants on",
    ),
    ("internal_cancel_job_once", "ends a job (cancelled)"),
];

#[test]
fn every_function_that_queues_jobs_announces_them() {
    let silent = breaking(
        QUEUES_NOTHING,
        "QUEUES_NOTHING",
        |f| writes_jobs(&f.body) && f.body.contains("'queued'"),
        |f| {
            !f.body.contains("skiplock.internal_announce(")
                && !f
                    .body
                    .contains("skiplock.internal_announce_queued_by_others(")
        },
    );
    assert!(
        silent.is_empty(),
        "functions that write jobs in the queued state without calling \
         skiplock.internal_announce (workers would hear of their jobs only at their next walk \
         from the start): {silent:?}; call it with the jobs' keys, or add the function to \
         QUEUES_NOTHING with the reason it queues nothing"
    );
}

/// Functions that end claims (`claim_token = NULL`: every transition out of `running`
/// clears the token, `jobs_claim_token_only_running`) without calling
/// `internal_notify_freed`, each with the reason no slot of a limit is freed unseen.
const ENDS_CLAIMS_SILENTLY: &[(&str, &str)] = &[];

/// A running job that ends frees a slot of its queue's `max_running` and of its key's
/// `key_max_running`: the statement that ends it calls `skiplock.internal_notify_freed`,
/// which points the workers at the queue's start and leaves the key for the next claim to
/// let its held jobs go (02_notifications.sql). A statement that forgot leaves the key's
/// held jobs to the periodic sweep of waiting jobs (200 ms to a minute later) and the freed
/// slot to the workers' next poll.
#[test]
fn every_function_that_ends_a_claim_tells_of_the_freed_slot() {
    let silent = breaking(
        ENDS_CLAIMS_SILENTLY,
        "ENDS_CLAIMS_SILENTLY",
        |f| writes_jobs(&f.body) && f.body.contains("claim_token = NULL"),
        |f| !f.body.contains("skiplock.internal_notify_freed("),
    );
    assert!(
        silent.is_empty(),
        "functions that end claims (claim_token = NULL) without calling \
         skiplock.internal_notify_freed (a key's held jobs then wait for the sweep): \
         {silent:?}; call it with the ended jobs' queues and concurrency keys, or add the \
         function to ENDS_CLAIMS_SILENTLY with the reason no slot is freed"
    );
}

/// Whether a function body holds jobs for their key's turn: an `UPDATE` whose `SET` writes
/// `held_for = 'fair'` (not a comparison in a `WHERE` or an `IF`).
fn holds_for_turns(body: &str) -> bool {
    body.match_indices("held_for = 'fair'").any(|(at, _)| {
        let statement = &body[body[..at].rfind(';').map_or(0, |end| end + 1)..at];
        statement.contains("UPDATE skiplock.jobs")
            && statement
                .rfind(" SET ")
                .is_some_and(|set| !statement[set..].contains("WHERE"))
    })
}

/// In a fair queue a walk of a key's held jobs starts where they start
/// (`skiplock.key_held_from`, 0001_initial.sql), which only holds while every job held for
/// its turn sorts at or after the row or after a mark its hold left: the function that holds
/// jobs for their turn hands each key's first job held to `skiplock.internal_recheck_keys`
/// as a mark (its third argument), or returns its mark (`RETURNS skiplock.key_slots_freed`,
/// or `OUT mark skiplock.key_slots_freed`) to its caller, which keeps it (`internal_hold_overflow`, whose caller walks from it and
/// records it). A holder without marks would leave jobs before the row,
/// which the walks pass by until the sweep of waiting jobs finds them (tests/fair_keys.rs
/// `a_job_held_by_hand_behind_where_the_keys_walks_start_goes_after_a_sweep`).
#[test]
fn every_function_that_holds_jobs_for_their_turn_leaves_its_marks() {
    let unmarked = breaking(
        &[],
        "no exemption list",
        |f| holds_for_turns(&f.body),
        |f| {
            !f.header.contains("RETURNS skiplock.key_slots_freed")
                && !f.header.contains("OUT mark skiplock.key_slots_freed")
                && !f
                    .body
                    .match_indices("skiplock.internal_recheck_keys(")
                    .any(|(at, call)| {
                        let rest = &f.body[at + call.len()..];
                        rest[..rest.find(')').unwrap_or(rest.len())]
                            .matches(',')
                            .count()
                            == 2
                    })
        },
    );
    assert!(
        unmarked.is_empty(),
        "functions that hold jobs for their key's turn (held_for = 'fair') without handing \
         each key's first job held to skiplock.internal_recheck_keys as a mark, nor returning \
         it to their caller (the walks of held jobs start at key_held_from and would pass the \
         jobs by): {unmarked:?}"
    );
    assert!(
        files()
            .iter()
            .any(|(_, text)| definitions(text).iter().any(|f| holds_for_turns(&f.body))),
        "no function holds jobs for their turn: the check above looks at nothing"
    );
}

/// Functions that find a job by id through `skiplock.jobs` without naming the live states it
/// reads, each with the reason its cost does not follow the days kept.
const BY_ID_OVER_EVERY_DAY: &[(&str, &str)] = &[(
    "internal_retry_job_once",
    "its writes name the state and the finished_at of the row it locked, given at run time \
     to a generic plan (force_generic_plan), which probes that one table",
)];

/// The statements of a body (comments removed) that find a row of `skiplock.jobs` or
/// `skiplock.jobs_done` by its id without naming live states: the text of each from the
/// table's name to its end (`;`).
fn lookups_by_id_over_every_day(body: &str) -> Vec<String> {
    const KEYWORDS: &[&str] = &[
        "WHERE",
        "SET",
        "ON",
        "AS",
        "FOR",
        "LIMIT",
        "ORDER",
        "GROUP",
        "USING",
        "RETURNING",
        "JOIN",
        "LEFT",
        "CROSS",
        "INNER",
        "WITH",
    ];
    const LIVE: &[&str] = &["'waiting'", "'queued'", "'running'"];
    let code: String = body
        .lines()
        .map(|line| line.split("--").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = Vec::new();
    for verb in ["FROM ", "JOIN ", "UPDATE "] {
        for table in ["skiplock.jobs", "skiplock.jobs_done"] {
            let needle = format!("{verb}{table}");
            for (at, _) in code.match_indices(&needle) {
                let after = &code[at + needle.len()..];
                if !after.starts_with(|c: char| c.is_whitespace() || c == ';') {
                    continue; // another table: jobs_live, jobs_done_default
                }
                let statement = &after[..after.find(';').unwrap_or(after.len())];
                let alias: String = statement
                    .trim_start()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let qualified = |column: &str| -> Vec<usize> {
                    let name = if alias.is_empty() || KEYWORDS.contains(&alias.as_str()) {
                        column.to_owned()
                    } else {
                        format!("{alias}.{column}")
                    };
                    statement
                        .match_indices(&name)
                        .filter(|(i, _)| {
                            !statement[..*i]
                                .ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == '.')
                        })
                        .map(|(i, _)| i + name.len())
                        .collect()
                };
                // The conditions: from the first WHERE or ON (an UPDATE's SET names states
                // it writes).
                let conditions = ["WHERE", " ON "]
                    .iter()
                    .filter_map(|word| statement.find(word))
                    .min()
                    .unwrap_or(0);
                let by_id = qualified("id").into_iter().any(|end| {
                    end > conditions && {
                        let rest = statement[end..].trim_start();
                        rest.starts_with('=') || rest.starts_with("IN ")
                    }
                });
                let names_live_states = qualified("state").into_iter().any(|end| {
                    let rest = statement[end..].trim_start();
                    if let Some(value) = rest.strip_prefix('=') {
                        LIVE.iter()
                            .any(|state| value.trim_start().starts_with(state))
                    } else if let Some(list) = rest.strip_prefix("IN (") {
                        let list = &list[..list.find(')').unwrap_or(list.len())];
                        list.split(',').all(|state| LIVE.contains(&state.trim()))
                    } else {
                        false
                    }
                });
                if by_id && !names_live_states {
                    found.push(format!("{needle}{}", statement.replace('\n', " ")));
                }
            }
        }
    }
    found
}

/// A job that may have finished is found by id through the partition layer
/// (`internal_job_state`, `internal_finished_job`, `internal_job_by_id` in 15_partitions.sql),
/// which probes the days from the job's id's day on. A statement that finds it by id through
/// `skiplock.jobs` (or `jobs_done`) is planned, locked and probed over every day kept: its
/// cost follows the days kept (an enqueue with a parent 1.26 → 4.44 ms from 9 to 99 tables,
/// issue 49). Outside that file, every lookup by id through `skiplock.jobs` names the live
/// states it reads (`state IN ('waiting', 'queued', 'running')`, planned over jobs_live
/// alone), or BY_ID_OVER_EVERY_DAY names its function with the reason.
#[test]
fn every_lookup_of_a_job_that_may_have_finished_goes_through_the_partition_layer() {
    let looked_up = std::cell::Cell::new(0);
    let unbounded = breaking(
        BY_ID_OVER_EVERY_DAY,
        "BY_ID_OVER_EVERY_DAY",
        |f| {
            let applies = f.body.contains("skiplock.jobs");
            looked_up.set(looked_up.get() + usize::from(applies));
            applies
        },
        |f| !lookups_by_id_over_every_day(&f.body).is_empty(),
    );
    // The partition layer itself reads every day where it must (its last look).
    let unbounded: Vec<&String> = unbounded
        .iter()
        .filter(|found| !found.ends_with("(15_partitions.sql)"))
        .collect();
    assert!(
        looked_up.get() > 20,
        "the check looked at no function reading jobs"
    );
    assert!(
        unbounded.is_empty(),
        "functions that find a job by id through skiplock.jobs without naming live states, \
         so over every day of finished jobs kept: {unbounded:?}; read it through \
         skiplock.internal_job_state, internal_finished_job or internal_job_by_id, or name \
         the live states it reads, or add the function to BY_ID_OVER_EVERY_DAY with the \
         reason"
    );
    // The check finds what it should: a lookup written as it was before.
    assert_eq!(
        lookups_by_id_over_every_day(
            "SELECT p.state FROM skiplock.jobs p WHERE p.id = d.parent_id LIMIT 1;"
        )
        .len(),
        1
    );
    assert!(lookups_by_id_over_every_day(
        "UPDATE skiplock.jobs SET state = 'cancelled' WHERE id = x AND state IN ('waiting', 'queued');"
    )
    .is_empty());
}

/// Functions that read or write job rows and may be JIT-compiled, each with the reason.
const JOB_ROWS_WITH_JIT: &[(&str, &str)] = &[
    (
        "internal_jobs_before_insert",
        "runs once per row inserted, where a SET clause would cost every enqueued job; its \
         reads are probes of unique indexes (tests/bounded_statements.rs)",
    ),
    (
        "internal_job_dependencies_after_insert",
        "runs once per edge inserted, as above; its reads are primary-key probes",
    ),
];

/// Whether a function body reads or writes job rows.
fn touches_jobs(body: &str) -> bool {
    ["FROM", "JOIN", "UPDATE", "INSERT INTO"]
        .iter()
        .any(|verb| body.contains(&format!("{verb} skiplock.jobs")))
}

/// JIT compilation costs tens to thousands of milliseconds a statement and saves nothing on
/// statements that read a few rows by index, as every statement on job rows should. Postgres
/// compiles a plan whose estimated cost passes `jit_above_cost` (100,000 by default), which
/// a large or badly estimated history reaches, and which a plan type turned off reaches
/// at once: a statement with no other path carries `disable_cost` (10^10). The pruner's
/// delete spent 1.2–2.9 s a pass compiling for 0.03 s of work (issue 49). So every
/// function that reads or writes job rows, and every function that turns a plan type off
/// (`SET enable_… = off`), runs with `jit = off` (its settings hold for the functions it
/// calls), or JOB_ROWS_WITH_JIT names it with the reason.
#[test]
fn every_function_on_job_rows_runs_without_jit() {
    let compiled = breaking(
        JOB_ROWS_WITH_JIT,
        "JOB_ROWS_WITH_JIT",
        |f| touches_jobs(&f.body) || f.header.contains("SET enable_"),
        |f| !f.header.contains("SET jit = off"),
    );
    assert!(
        compiled.is_empty(),
        "functions that read or write job rows, or turn a plan type off, without \
         `SET jit = off`: {compiled:?}; add it to the function's settings, or add the \
         function to JOB_ROWS_WITH_JIT with the reason"
    );
}

/// Functions that read a lane (`ordering_key =`) and write jobs without its lock, each with
/// the reason no enqueue or step of the lane can be missed by it.
const READS_LANES_UNLOCKED: &[(&str, &str)] = &[];

/// Whatever decides from a lane's rows that a job waits or may go (the insert trigger, a
/// lane's step, `retry_job`, …) takes the lane's lock (`internal_lane_lock_id`) before it
/// first reads the lane (`ordering_key =`): without it, an enqueue
/// whose transaction commits after the lane's last job finished is seen by neither side,
/// and the job waits for the sweep (issue 48, tests/admission_races.rs).
#[test]
fn every_function_that_reads_a_lane_to_move_it_takes_the_lane_lock() {
    let unlocked = breaking(
        READS_LANES_UNLOCKED,
        "READS_LANES_UNLOCKED",
        |f| writes_jobs(&f.body) && first_lane_read(&f.body).is_some(),
        |f| {
            let read = first_lane_read(&f.body).unwrap();
            f.body
                .find("skiplock.internal_lane_lock_id(")
                .is_none_or(|lock| lock >= read)
        },
    );
    assert!(
        unlocked.is_empty(),
        "functions that read a lane and write jobs without taking the lane's lock first (an \
         enqueue committing beside them is missed and its job waits for the sweep): \
         {unlocked:?}; take pg_advisory_xact_lock(skiplock.internal_lane_lock_id(lane)) before \
         the first read of the lane, or add the function to READS_LANES_UNLOCKED with the \
         reason it cannot miss one"
    );
}

/// Functions that write the rate windows without taking the queue's turn themselves, each
/// with the functions that call it holding the turn (checked: each of them takes it, or is
/// listed here too).
const WRITES_WINDOWS_UNDER_ITS_CALLERS_TURN: &[(&str, &[&str])] = &[
    ("internal_make_rate_ring", &["internal_rate_take"]),
    ("internal_rate_take", &["internal_claim_batch"]),
    ("internal_hold_rate_keys", &["internal_claim_batch"]),
    ("internal_release_refilled_keys", &["internal_claim_batch"]),
];

/// Whether a function body writes a rate window (`skiplock.rate_windows` or its slots).
fn writes_rate_windows(body: &str) -> bool {
    ["rate_windows", "rate_window_starts"].iter().any(|table| {
        [
            format!("UPDATE skiplock.{table} "),
            format!("DELETE FROM skiplock.{table} "),
            format!("INSERT INTO skiplock.{table} "),
        ]
        .iter()
        .any(|write| body.contains(write.as_str()))
    })
}

/// Whether a function body takes its queue's turn (the lock every claim of a limited queue
/// holds while it reads and writes the windows), or makes sure no claim holds it.
fn holds_the_queues_turn(body: &str) -> bool {
    body.contains("pg_advisory_xact_lock(skiplock.internal_queue_limit_lock_id(")
        || body.contains("skiplock.internal_queue_turn_free(")
}

/// A rate window is read and written by a claim under its queue's turn: the claim reads the
/// room, walks, then records its starts, and counts on the window staying as it read it.
/// A writer outside the turn (the sweep forgetting a window while a claim counted on it, a
/// limit change rewriting its expiry) let two starts through 0.999 s apart under a limit
/// of one per second (session 62, `limits::the_sweep_keeps_the_windows_of_a_queue_whose_
/// turn_a_claim_holds`). So every function that writes a window takes the turn, checks
/// that no claim holds it, or is called only by functions that hold it.
#[test]
fn every_function_that_writes_a_rate_window_holds_its_queues_turn() {
    let mut definitions_by_name = std::collections::HashMap::new();
    for (file, text) in files() {
        for definition in definitions(&text) {
            definitions_by_name.insert(definition.label.clone(), (file.clone(), definition));
        }
    }
    let mut unlocked = Vec::new();
    for (name, (file, definition)) in &definitions_by_name {
        if !writes_rate_windows(&definition.body) || holds_the_queues_turn(&definition.body) {
            continue;
        }
        if !WRITES_WINDOWS_UNDER_ITS_CALLERS_TURN
            .iter()
            .any(|(listed, _)| listed == name)
        {
            unlocked.push(format!("{name} ({file})"));
        }
    }
    unlocked.sort();
    assert!(
        unlocked.is_empty(),
        "functions that write skiplock.rate_windows or rate_window_starts without their \
         queue's turn: {unlocked:?}; take pg_advisory_xact_lock(skiplock.\
         internal_queue_limit_lock_id(queue)) first, write only where \
         skiplock.internal_queue_turn_free(queue), or add the function to \
         WRITES_WINDOWS_UNDER_ITS_CALLERS_TURN with the callers that hold the turn"
    );
    for (name, callers) in WRITES_WINDOWS_UNDER_ITS_CALLERS_TURN {
        let (_, definition) = definitions_by_name
            .get(*name)
            .unwrap_or_else(|| panic!("WRITES_WINDOWS_UNDER_ITS_CALLERS_TURN names {name}, which no function is: remove it"));
        assert!(
            writes_rate_windows(&definition.body) && !holds_the_queues_turn(&definition.body),
            "WRITES_WINDOWS_UNDER_ITS_CALLERS_TURN names {name}, which no longer needs it: \
             remove it"
        );
        let called_by: Vec<&String> = definitions_by_name
            .iter()
            .filter(|(_, (_, caller))| caller.body.contains(&format!("skiplock.{name}(")))
            .map(|(caller, _)| caller)
            .collect();
        let mut unlisted: Vec<&String> = called_by
            .iter()
            .filter(|caller| !callers.contains(&caller.as_str()))
            .copied()
            .collect();
        unlisted.sort();
        assert!(
            unlisted.is_empty(),
            "{name} writes rate windows under its caller's turn, but {unlisted:?} call it \
             too; make sure they hold the queue's turn and list them"
        );
        for caller in *callers {
            let (_, definition) = definitions_by_name.get(*caller).unwrap_or_else(|| {
                panic!("{name}'s caller {caller} is no function: fix WRITES_WINDOWS_UNDER_ITS_CALLERS_TURN")
            });
            assert!(
                called_by.iter().any(|c| c.as_str() == *caller),
                "WRITES_WINDOWS_UNDER_ITS_CALLERS_TURN says {caller} calls {name}; it no \
                 longer does: remove it"
            );
            assert!(
                holds_the_queues_turn(&definition.body)
                    || WRITES_WINDOWS_UNDER_ITS_CALLERS_TURN
                        .iter()
                        .any(|(listed, _)| listed == caller),
                "{caller} calls {name}, which writes rate windows, without holding the \
                 queue's turn"
            );
        }
    }
}

/// Where a function body first compares a lane (`ordering_key =`), if it does.
fn first_lane_read(body: &str) -> Option<usize> {
    let mut at = 0;
    for (nth, piece) in body.split("ordering_key").enumerate() {
        if nth > 0 && piece.trim_start().starts_with('=') {
            return Some(at - "ordering_key".len());
        }
        at += piece.len() + "ordering_key".len();
    }
    None
}

/// Functions that write or lock job rows (which another transaction may move between
/// jobs_live and jobs_done under them, failing the statement with 40001, see
/// `internal_may_retry_moved` in 15_partitions.sql) and do not catch `serialization_failure`
/// themselves, each with the callers that run them again.
const MOVED_ROWS_RETRIED_BY_CALLERS: &[(&str, &str)] = &[
    (
        "internal_hold_for_turns",
        "none needed: it writes only the rows its caller's statement inserted, uncommitted, which no other transaction can move",
    ),
    (
        "internal_fold_into_key_holder",
        "retry_job and the outcome statements' callers (the SQL protocol's calls, the worker)",
    ),
    (
        "internal_queue_ready_dependants",
        "internal_settle_dependants, the edge trigger, internal_settle_waiting: each under a caller that retries",
    ),
    (
        "internal_settle_dependants",
        "internal_move_on, cancel_job, retry_job, internal_settle_waiting (maintain), the tombstones",
    ),
    (
        "internal_advance_lanes",
        "internal_settle_dependants and the lane steps of callers that retry",
    ),
    (
        "internal_tombstone_parents",
        "the delete trigger and the drop of a day: a DELETE or the pruner, which runs again",
    ),
    (
        "internal_hold_keys",
        "internal_claim_batch's callers: skiplock.claim's loop, the worker (40001 is transient)",
    ),
    (
        "internal_release_held",
        "the claim's and the outcomes' callers, internal_settle_waiting",
    ),
    (
        "internal_release_fair_key",
        "internal_release_held's callers",
    ),
    (
        "internal_hold_overflow",
        "internal_release_fair_key and internal_release_held, as theirs",
    ),
    (
        "internal_claim_batch",
        "skiplock.claim's loop; the worker claims again on 40001 (producer.rs, is_row_moved)",
    ),
    (
        "internal_complete_claims",
        "internal_save_outcomes_many's loop (every outcome of the SQL protocol); the worker's \
         completer retries 40001 (is_transient_sqlx)",
    ),
    (
        "internal_fail_claims",
        "internal_save_outcomes_many's loop; the worker's completer",
    ),
    (
        "internal_release_claims",
        "internal_save_outcomes_many's loop (release, snooze); the worker's completer and \
         shutdown",
    ),
    (
        "internal_abandon_claims",
        "the worker's completer, the last resort of a batch it could not save",
    ),
    (
        "internal_save_outcomes",
        "internal_save_outcomes_many's loop (every outcome of the SQL protocol)",
    ),
    (
        "internal_cancel_job_once",
        "internal_run_job_action's loop (cancel_job)",
    ),
    (
        "internal_retry_job_once",
        "internal_run_job_action's loop (retry_job)",
    ),
    (
        "internal_finished_job",
        "the loops of internal_job_dependencies_after_insert (FOR SHARE, FOR UPDATE) and \
         internal_run_job_action (retry_job, FOR UPDATE); enqueue_job, watch_job and \
         internal_retry_job_once's first look lock nothing",
    ),
];

/// Functions of MOVED_ROWS_RETRIED_BY_CALLERS that lock (and so may meet 40001) only when a
/// call asks them to, in a second argument (`'FOR SHARE'`, `'FOR UPDATE'`): a call with the
/// job's id alone reads, and needs no retry. Any call with a second argument counts as
/// locking, whatever it passes (a variable, a NULL).
const LOCKING_WHEN_ASKED: &[&str] = &["internal_finished_job"];

/// How many arguments a call has, read from its text (the function's name on): its commas
/// outside nested parentheses and string literals, plus one.
fn arguments_of_call(call: &str) -> usize {
    let (mut depth, mut quoted, mut commas) = (0, false, 0);
    for c in call.chars() {
        match c {
            '\'' => quoted = !quoted,
            _ if quoted => {}
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            ',' if depth == 1 => commas += 1,
            _ => {}
        }
    }
    commas + 1
}

/// Functions that call one of MOVED_ROWS_RETRIED_BY_CALLERS and leave 40001 to their own
/// callers, each with those callers.
const MOVED_ROWS_PASSED_TO_CALLERS: &[(&str, &str)] = &[
    (
        "internal_jobs_after_delete",
        "the trigger of a DELETE: the pruner runs again at its next pass; a DELETE written by \
         hand meets 40001 as any serialization failure",
    ),
    ("internal_hold_full_keys", "internal_claim_batch's callers"),
    (
        "internal_complete_handing_on",
        "the worker's completer, which retries 40001 (is_transient_sqlx)",
    ),
    (
        "internal_notify_jobs_inserted",
        "the trigger of an INSERT; internal_hold_for_turns writes only that statement's own rows, \
         which nothing else can move",
    ),
    ("internal_hold_rate_keys", "internal_claim_batch's callers"),
    (
        "internal_release_freed_keys",
        "internal_claim_batch's callers",
    ),
    (
        "internal_release_refilled_keys",
        "internal_claim_batch's callers",
    ),
    (
        "internal_queues_after_key_limit",
        "the trigger of an UPDATE of skiplock.queues: that statement meets 40001 as any \
         serialization failure",
    ),
    (
        "internal_drop_done_partition",
        "the pruner, which leaves the day for its next pass",
    ),
];

/// Whether a function body writes job rows, or locks them and waits (`FOR UPDATE` or `FOR
/// SHARE` without `SKIP LOCKED`).
fn writes_or_waits_for_jobs(body: &str) -> bool {
    if body.contains("UPDATE skiplock.jobs") || body.contains("DELETE FROM skiplock.jobs") {
        return true;
    }
    body.contains("skiplock.jobs")
        && ["FOR UPDATE", "FOR SHARE"].iter().any(|clause| {
            body.match_indices(clause).any(|(at, _)| {
                !body[at + clause.len()..]
                    .trim_start()
                    .starts_with("SKIP LOCKED")
            })
        })
}

/// A row another transaction moved between jobs_live and jobs_done under a statement fails
/// it with 40001; in READ COMMITTED the statement run again finds the row where it went.
/// Each function that writes or waits for job rows runs itself again on it, or is run
/// again by every caller (MOVED_ROWS_RETRIED_BY_CALLERS names them): a function that did
/// neither returned an error for a job that had merely finished, or, mutated to answer
/// true, reported success for a job left cancelled (tests/sql_protocol.rs
/// each_call_on_a_job_whose_row_moves_under_it_answers_not_held).
#[test]
fn every_function_that_writes_or_waits_for_jobs_meets_a_moved_row() {
    let unhandled = breaking(
        MOVED_ROWS_RETRIED_BY_CALLERS,
        "MOVED_ROWS_RETRIED_BY_CALLERS",
        |f| writes_or_waits_for_jobs(&f.body),
        |f| !f.body.contains("serialization_failure"),
    );
    assert!(
        unhandled.is_empty(),
        "functions that write or wait for job rows without handling 40001 (a row moved \
         between jobs_live and jobs_done under them): {unhandled:?}; run the statement again \
         on serialization_failure while skiplock.internal_may_retry_moved(attempts) says so, \
         or add the function to MOVED_ROWS_RETRIED_BY_CALLERS with the callers that do"
    );
    // And the callers do: a SQL function that calls one of them handles 40001 itself or is
    // listed (its own callers then do). Callers in Rust retry 40001 as transient.
    let passing: Vec<&str> = MOVED_ROWS_RETRIED_BY_CALLERS
        .iter()
        .chain(MOVED_ROWS_PASSED_TO_CALLERS)
        .map(|(name, _)| *name)
        .collect();
    let mut unretried = Vec::new();
    let mut passed_seen = Vec::new();
    for (file, text) in files() {
        for definition in definitions(&text) {
            let calls: Vec<&str> = passing
                .iter()
                .filter(|name| {
                    definition
                        .body
                        .match_indices(&format!("skiplock.{name}("))
                        .any(|(at, _)| {
                            !LOCKING_WHEN_ASKED.contains(name)
                                || arguments_of_call(&definition.body[at..]) > 1
                        })
                })
                .copied()
                .collect();
            if calls.is_empty() || definition.body.contains("serialization_failure") {
                continue;
            }
            if MOVED_ROWS_PASSED_TO_CALLERS
                .iter()
                .any(|(name, _)| *name == definition.label)
            {
                passed_seen.push(definition.label.clone());
            } else if !passing.contains(&definition.label.as_str()) {
                unretried.push(format!("{} ({file}) calls {calls:?}", definition.label));
            }
        }
    }
    assert!(
        unretried.is_empty(),
        "functions that call a function of MOVED_ROWS_RETRIED_BY_CALLERS and neither handle \
         40001 nor are listed: {unretried:?}; handle it, or add the function to \
         MOVED_ROWS_PASSED_TO_CALLERS with the callers that do"
    );
    for (name, _) in MOVED_ROWS_PASSED_TO_CALLERS {
        assert!(
            passed_seen.iter().any(|seen| seen == name),
            "MOVED_ROWS_PASSED_TO_CALLERS names {name}, which no longer needs it: remove it"
        );
    }
}

/// The server's views of every database's sessions and of their locks, each spelled in two
/// pieces here so that this file's own text does not name it.
const SERVER_WIDE_VIEWS: &[&str] = &[concat!("pg_stat_", "activity"), concat!("pg_", "locks")];

/// Queries of those views under tests/ that may see other databases' sessions, each as
/// (file under tests/, a piece of the query's text, why it may).
const SESSIONS_OF_EVERY_DATABASE: &[(&str, &str, &str)] = &[(
    "cli_connections.rs",
    "WHERE usename = '{name}'",
    "ends every session of the test's own role (named after the test's database, so each \
     of its sessions is this test's, in whatever database) before the role is dropped; it \
     waits for and counts nothing, so it cannot pass on another test's sessions",
)];

/// A wait for, or a count of, sessions in the sessions view (`pg_stat_activity`), or of
/// locks in the locks view (`pg_locks`), that does not restrict itself to the test's own
/// sessions can be satisfied by a neighbouring test's (the test binaries run at once, each
/// test in its own database on one server), and so pass without the behaviour it names, or
/// fail on another test's lock (issue 49, item 4; a relation's OID is only unique within
/// its database). So every string literal of a Rust file under tests/ that names either
/// view also restricts it, in the same literal, to `datname = current_database()` (on a
/// connection to the test's own database; for the locks view, through `database = (SELECT
/// oid FROM pg_database WHERE datname = current_database())`), or to sessions the test owns
/// by process id: `pid = $n`, `pid = ANY (…)`, `pid IN (…)` or `pid = pg_backend_pid()`,
/// bound to ids the test read with `pg_backend_pid()` on connections it holds. The check
/// reads text only: it cannot see which database a pool is on, nor whose pids are bound.
/// A query that must see every database says why in SESSIONS_OF_EVERY_DATABASE.
#[test]
fn every_query_of_the_sessions_view_in_the_tests_is_restricted_to_the_tests_own() {
    let tests = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests");
    let mut files = Vec::new();
    all_files(&tests, &mut files);
    files.sort();
    let mut unrestricted = Vec::new();
    let mut exempt_seen = Vec::new();
    let mut queries = 0;
    for path in &files {
        let name = path.strip_prefix(&tests).unwrap().display().to_string();
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let names_a_view = |text: &str| {
            let text = text.to_lowercase();
            SERVER_WIDE_VIEWS.iter().any(|view| text.contains(view))
        };
        if path.extension().is_none_or(|ext| ext != "rs") {
            assert!(
                !names_a_view(&text),
                "tests/{name} names one of {SERVER_WIDE_VIEWS:?}: this check reads Rust string \
                 literals only; query it from Rust, or teach the check this kind of file"
            );
            continue;
        }
        for (line, literal) in string_literals(&text) {
            if !names_a_view(literal) {
                continue;
            }
            queries += 1;
            if restricted_to_own_sessions(literal) {
                continue;
            }
            match SESSIONS_OF_EVERY_DATABASE
                .iter()
                .find(|(file, piece, _)| *file == name && literal.contains(piece))
            {
                Some((file, piece, _)) => exempt_seen.push((*file, *piece)),
                None => unrestricted.push(format!("tests/{name}:{line}")),
            }
        }
    }
    assert!(
        queries > 20,
        "found only {queries} queries of {SERVER_WIDE_VIEWS:?}"
    );
    assert!(
        unrestricted.is_empty(),
        "queries of {SERVER_WIDE_VIEWS:?} that other tests' sessions can satisfy: \
         {unrestricted:?}; add `datname = current_database()` (or `pid = $n` for a session \
         the test holds) to the query, or add it to SESSIONS_OF_EVERY_DATABASE with the reason \
         it must see every database"
    );
    for (file, piece, _) in SESSIONS_OF_EVERY_DATABASE {
        assert!(
            exempt_seen.contains(&(*file, *piece)),
            "SESSIONS_OF_EVERY_DATABASE names {piece:?} in tests/{file}, which no longer \
             needs it: remove it"
        );
    }
}

/// Whether a query names only the test's own sessions: `datname = current_database()`, or
/// `pid = $n`, `pid = ANY (…)`, `pid IN (…)`, `pid = pg_backend_pid()` (case and white
/// space aside).
fn restricted_to_own_sessions(query: &str) -> bool {
    let query = query
        .to_lowercase()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    if query.contains("datname = current_database()") {
        return true;
    }
    query.match_indices("pid ").any(|(at, _)| {
        let whole_word = query[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
        let rest = &query[at + "pid ".len()..];
        whole_word
            && ["= $", "= any(", "= any (", "in (", "= pg_backend_pid()"]
                .iter()
                .any(|form| rest.starts_with(form))
    })
}

fn all_files(dir: &std::path::Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            all_files(&path, found);
        } else {
            found.push(path);
        }
    }
}

/// The string literals of Rust source `text` (plain, byte and raw ones), each with the line
/// it starts on and its text between the quotes as written. Comments, character literals
/// and lifetimes are passed over.
fn string_literals(text: &str) -> Vec<(usize, &str)> {
    let bytes = text.as_bytes();
    let line_at = |at: usize| text[..at].matches('\n').count() + 1;
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let rest = &text[i..];
        let after_word = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            // Block comments nest.
            let mut depth = 0;
            while i < bytes.len() {
                if text[i..].starts_with("/*") {
                    depth += 1;
                    i += 2;
                } else if text[i..].starts_with("*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if after_word
            && (rest.starts_with("r\"")
                || rest.starts_with("r#")
                || rest.starts_with("br\"")
                || rest.starts_with("br#"))
        {
            let start = i + rest.find('r').unwrap() + 1;
            let hashes = text[start..].len() - text[start..].trim_start_matches('#').len();
            if bytes.get(start + hashes) != Some(&b'"') {
                i += 1;
                continue;
            }
            let open = start + hashes + 1;
            let close = format!("\"{}", "#".repeat(hashes));
            let end = open + text[open..].find(&close).expect("a raw string ends");
            found.push((line_at(open), &text[open..end]));
            i = end + close.len();
        } else if bytes[i] == b'"' {
            let open = i + 1;
            let mut j = open;
            while bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            found.push((line_at(open), &text[open..j]));
            i = j + 1;
        } else if bytes[i] == b'\'' {
            // A character literal ('x', '\n', '\''), or a lifetime or label ('a).
            if bytes.get(i + 1) == Some(&b'\\') {
                i += 2 + text[i + 2..].find('\'').map_or(0, |end| end.max(1)) + 1;
            } else {
                let c = text[i + 1..].chars().next().map_or(1, char::len_utf8);
                i += if bytes.get(i + 1 + c) == Some(&b'\'') {
                    c + 2
                } else {
                    1
                };
            }
        } else {
            i += 1;
        }
    }
    found
}
