//! Rules of `migrations/functions/` that no single behaviour test would notice broken:
//! each file opens with the list of what it defines, and every function that queues jobs
//! announces them through `skiplock.internal_announce` (the one way statements tell
//! workers of runnable work; a statement that forgets leaves its jobs to the workers' next
//! walk from the start, up to a minute later). Reads the files only: no database.

use std::path::PathBuf;

/// One `CREATE OR REPLACE FUNCTION | TRIGGER | VIEW | AGGREGATE` of a file.
struct Definition {
    /// As the file's header lists it: `name`, `trigger name`, `view name`, `aggregate name`.
    label: String,
    /// A function's body (between its `$$`), empty for the others.
    body: String,
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
        let (label, body) = match kind {
            "FUNCTION" => {
                let start = rest.find("$$").unwrap() + 2;
                let end = start + rest[start..].find("$$").unwrap();
                let body = rest[start..end].to_owned();
                rest = &rest[end + 2..];
                (name, body)
            }
            "TRIGGER" => (format!("trigger {name}"), String::new()),
            "VIEW" => (format!("view {name}"), String::new()),
            "AGGREGATE" => (format!("aggregate {name}"), String::new()),
            other => panic!("unexpected CREATE OR REPLACE {other}"),
        };
        found.push(Definition { label, body });
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

/// Functions that write jobs and name the `queued` state without making jobs runnable
/// themselves, each with the reason it announces nothing.
const QUEUES_NOTHING: &[(&str, &str)] = &[
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
    let mut silent = Vec::new();
    let mut seen_exempt = Vec::new();
    for (file, text) in files() {
        for definition in definitions(&text) {
            let body = &definition.body;
            let writes_jobs = ["UPDATE skiplock.jobs", "INSERT INTO skiplock.jobs"]
                .iter()
                .any(|write| body.contains(write));
            if !writes_jobs || !body.contains("'queued'") {
                continue;
            }
            if body.contains("skiplock.internal_announce(")
                || body.contains("skiplock.internal_announce_queued_by_others(")
            {
                continue;
            }
            if QUEUES_NOTHING
                .iter()
                .any(|(name, _)| *name == definition.label)
            {
                seen_exempt.push(definition.label.clone());
                continue;
            }
            silent.push(format!("{} ({file})", definition.label));
        }
    }
    assert!(
        silent.is_empty(),
        "functions that write jobs in the queued state without calling \
         skiplock.internal_announce (workers would hear of their jobs only at their next walk \
         from the start): {silent:?}; call it with the jobs' keys, or add the function to \
         QUEUES_NOTHING with the reason it queues nothing"
    );
    for (name, _) in QUEUES_NOTHING {
        assert!(
            seen_exempt.iter().any(|seen| seen == name),
            "QUEUES_NOTHING names {name}, which no longer writes queued jobs: remove it"
        );
    }
}
