//! The code's layout rules that a reader relies on and a new change can break without any
//! other test noticing (docs/architecture.md, "Module layout").

use std::path::{Path, PathBuf};

/// Longest a source file may be before its unit tests: past that, it holds more than one
/// stage and is split (issue 49: src/bin/skiplock/enqueue.rs had grown to 666).
const MAX_LINES_BEFORE_TESTS: usize = 600;

fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            found.push(path);
        }
    }
}

#[test]
fn every_source_file_is_at_most_600_lines_before_its_tests() {
    let mut files = Vec::new();
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    assert!(files.len() > 20, "found only {files:?}");
    let mut long = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let before_tests = text
            .lines()
            .take_while(|line| !line.starts_with("#[cfg(test)]"))
            .count();
        if before_tests > MAX_LINES_BEFORE_TESTS {
            long.push(format!("{} ({before_tests} lines)", file.display()));
        }
    }
    assert!(
        long.is_empty(),
        "over {MAX_LINES_BEFORE_TESTS} lines before their tests; split them by stage: {long:?}"
    );
}
