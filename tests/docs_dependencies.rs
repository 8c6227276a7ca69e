//! The dependency blocks the docs show (a ```toml block in README.md or docs/*.md) match what
//! their Rust examples need: each crate a visible line of an example names (`burn_core::...`,
//! `ferry_burn::...`, `tokio::...`) is listed in the page's block, and each crate listed is a
//! dependency of this package, which compiles and runs the examples as doc tests (`src/lib.rs`).
// Test code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::Path;

/// The lines of every fenced block of `language` in `markdown`.
fn blocks<'a>(markdown: &'a str, language: &str) -> Vec<&'a str> {
    let mut lines = Vec::new();
    let mut inside = false;
    for line in markdown.lines() {
        let fence = line.trim_start().strip_prefix("```");
        match (inside, fence) {
            (false, Some(info)) => inside = info.split(',').next() == Some(language),
            (true, Some(_)) => inside = false,
            (true, None) => lines.push(line),
            (false, None) => {}
        }
    }
    lines
}

/// The names a toml block gives under its `[dependencies]`-like tables.
fn listed(toml: &[&str]) -> BTreeSet<String> {
    toml.iter()
        .map(|line| line.split('#').next().unwrap().trim())
        .filter(|line| !line.starts_with('[') && line.contains('='))
        .map(|line| {
            let key = line.split('=').next().unwrap().trim();
            key.split('.').next().unwrap().to_string()
        })
        .collect()
}

/// The dependencies and dev-dependencies of the package whose manifest is `manifest`.
fn dependencies(manifest: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut in_dependencies = false;
    for line in manifest.lines() {
        let line = line.split('#').next().unwrap().trim();
        if line.starts_with('[') {
            in_dependencies = matches!(line, "[dependencies]" | "[dev-dependencies]");
        } else if in_dependencies && line.contains('=') {
            let key = line.split('=').next().unwrap().trim();
            names.insert(key.split('.').next().unwrap().to_string());
        }
    }
    names
}

/// The crates the visible lines of Rust examples name: a path's first segment that is
/// ferry's, Burn's or tokio's (`ferry_testkit`, the doc tests' own harness, appears on hidden
/// lines only).
fn named(rust: &[&str]) -> BTreeSet<String> {
    let mut crates = BTreeSet::new();
    for line in rust.iter().filter(|l| !l.trim_start().starts_with('#')) {
        let code = line.split("//").next().unwrap();
        let mut rest = code;
        while let Some(at) = rest.find("::") {
            let before = &rest[..at];
            let start = before
                .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .map_or(0, |i| i + 1);
            let segment = &before[start..];
            let preceded_by_path = before[..start].ends_with(':');
            let external =
                segment.starts_with("burn_") || segment.starts_with("ferry_") || segment == "tokio";
            if external && !preceded_by_path {
                crates.insert(segment.replace('_', "-"));
            }
            rest = &rest[at + 2..];
        }
    }
    crates
}

#[test]
fn every_crate_the_docs_examples_need_is_listed_and_a_dependency_here() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let ours = dependencies(&std::fs::read_to_string(root.join("Cargo.toml")).unwrap());
    let mut pages = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    let mut checked = 0;
    for page in pages {
        let text = std::fs::read_to_string(&page).unwrap();
        let toml = blocks(&text, "toml");
        if toml.is_empty() {
            continue;
        }
        let shown = listed(&toml);
        let page = page.display();
        let not_ours: Vec<_> = shown.difference(&ours).collect();
        assert!(
            not_ours.is_empty(),
            "{page} lists {not_ours:?}, which the doc tests do not depend on"
        );
        let needed = named(&blocks(&text, "rust"));
        let unlisted: Vec<_> = needed.difference(&shown).collect();
        assert!(
            unlisted.is_empty(),
            "{page}'s examples use {unlisted:?}, which its dependency block does not list"
        );
        checked += 1;
    }
    assert!(checked >= 1, "docs/library.md shows a dependency block");
}

#[test]
fn the_parsers_read_what_they_are_meant_to() {
    let page = "text\n```toml\n[dependencies]\nburn-nn = { version = \"1\" } # layers\n\
                ferry-client.workspace = true\n```\n```rust\nuse burn_core::module::Module;\n\
                # let _ = ferry_testkit::x();\nlet d = burn_tensor::Device::flex(); // std::x\n\
                ```\n";
    assert_eq!(
        listed(&blocks(page, "toml")),
        BTreeSet::from(["burn-nn".to_string(), "ferry-client".to_string()])
    );
    assert_eq!(
        named(&blocks(page, "rust")),
        BTreeSet::from(["burn-core".to_string(), "burn-tensor".to_string()])
    );
    assert!(dependencies("[package]\nname = \"x\"\n[dependencies]\na = \"1\"\n").contains("a"));
}
