//! The README's Rust example is the first part of `examples/signup.rs`, which every test
//! build compiles and CI runs (`cargo run --example signup`): the README shows the text
//! between the example's two marker lines verbatim, and this test fails when the two
//! differ, so no line a reader copies from the README fails to compile.

mod verbatim;

#[test]
fn the_readme_shows_the_signup_example() {
    verbatim::assert_shows(
        "README.md",
        include_str!("../README.md"),
        "Use it from Rust",
        "examples/signup.rs",
        include_str!("../examples/signup.rs"),
    );
}
