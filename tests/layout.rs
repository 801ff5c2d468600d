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

/// docs/architecture.md's "Module layout" block: each entry's path (first word of a line
/// that starts with a path) and the text of its description (its own line and the indented
/// ones below).
fn layout_entries() -> Vec<(String, String)> {
    let doc = include_str!("../docs/architecture.md");
    let section = doc
        .split_once("\n## Module layout\n")
        .expect("docs/architecture.md has a \"## Module layout\" section")
        .1;
    let block = section
        .split_once("```\n")
        .expect("the section has a code block")
        .1
        .split_once("```")
        .expect("the block ends")
        .0;
    let mut entries: Vec<(String, String)> = Vec::new();
    for line in block.lines() {
        if line.starts_with(' ') {
            if let Some((_, text)) = entries.last_mut() {
                text.push(' ');
                text.push_str(line.trim());
            }
        } else if let Some((path, text)) = line.split_once(' ') {
            entries.push((path.to_owned(), text.trim().to_owned()));
        }
    }
    entries
}

/// The module layout in docs/architecture.md cannot drift from `src/` (issue 49, item 5):
/// every file and directory of `src/` is an entry (a directory's files each named in its
/// entry, `mod.rs` or its stem), and every entry exists.
#[test]
fn the_module_layout_names_every_file_of_src_and_nothing_else() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let entries = layout_entries();
    assert!(entries.len() > 20, "found only {entries:?}");
    for (path, _) in &entries {
        assert!(
            root.join(path).exists(),
            "docs/architecture.md's module layout names {path}, which does not exist"
        );
    }
    let named = |path: &str| entries.iter().find(|(entry, _)| entry == path);
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(root.join("src")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        if path.is_file() {
            if named(&format!("src/{name}")).is_none() {
                missing.push(format!("src/{name}"));
            }
            continue;
        }
        if name == "bin" {
            continue;
        }
        let dir = format!("src/{name}/");
        let Some((_, text)) = named(&dir) else {
            missing.push(dir);
            continue;
        };
        for file in std::fs::read_dir(&path).unwrap() {
            let file = file.unwrap().path();
            let file_name = file.file_name().unwrap().to_str().unwrap();
            let stem = file_name.trim_end_matches(".rs");
            let said = text
                .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.'))
                .any(|word| word == stem || word == file_name || word == format!("{stem}/"));
            if !said && !text.contains(&format!("{stem}/")) {
                missing.push(format!("{dir}{file_name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "files of src/ that docs/architecture.md's module layout does not name: {missing:?}"
    );
}
