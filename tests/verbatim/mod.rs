//! Checks that a document shows a compiled source's text verbatim: the README's Rust
//! example (`examples/signup.rs`) and the testing guide's (`tests/testing_guide.rs`).

/// Asserts that the first ```` ```rust ```` block after `heading` in `doc` (named
/// `doc_name`) is, to the byte, the text of `source` (named `source_name`) between the
/// lines `{marker}from here ----` and the next `{marker}`.
#[track_caller]
pub fn assert_shows(doc_name: &str, doc: &str, heading: &str, source_name: &str, source: &str) {
    let marker = format!("// ---- {doc_name}, \"{heading}\", ");
    let example = between(source, &format!("{marker}from here ----\n"), &marker);
    let section = doc
        .split_once(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("{doc_name} has no section \"{heading}\""))
        .1;
    let shown = between(section, "```rust\n", "```\n");
    for (n, (shown_line, example_line)) in shown.lines().zip(example.lines()).enumerate() {
        assert_eq!(
            shown_line,
            example_line,
            "line {} of the example in {doc_name} differs from {source_name}",
            n + 1
        );
    }
    assert_eq!(
        shown.lines().count(),
        example.lines().count(),
        "the example in {doc_name} and {source_name} differ in length"
    );
    assert_eq!(shown, example);
}

/// The text of `text` after the first `start` and before the next `end`.
fn between<'t>(text: &'t str, start: &str, end: &str) -> &'t str {
    let after = text
        .split_once(start)
        .unwrap_or_else(|| panic!("no {start:?}"))
        .1;
    after
        .split_once(end)
        .unwrap_or_else(|| panic!("no {end:?} after {start:?}"))
        .0
}
