//! The documentation a newcomer reads: every relative link in README.md, CHANGELOG.md and
//! docs/*.md points at a file that exists, and every `#anchor` at a heading of that file
//! (as GitHub makes anchors from headings). Moving a section breaks no link silently.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn pages() -> Vec<PathBuf> {
    let root = root();
    let mut pages = vec![root.join("README.md"), root.join("CHANGELOG.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// GitHub's anchor for a heading: lowercased, punctuation other than `-` and `_` dropped,
/// spaces turned into `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a page's headings, outside code blocks.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut in_code = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        } else if !in_code && line.starts_with('#') {
            out.insert(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// The targets of `](target)` links outside code blocks that are not absolute URLs.
fn relative_links(text: &str) -> Vec<String> {
    let mut in_code = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = &after[..end];
            if !target.contains("://") && !target.starts_with("mailto:") {
                out.push(target.to_string());
            }
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_in_the_docs_resolves() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for link in relative_links(&text) {
            let (file, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            if !target.exists() {
                broken.push(format!("{}: {link}: no such file", page.display()));
                continue;
            }
            if !anchor.is_empty() {
                let target_text = std::fs::read_to_string(&target).unwrap_or_default();
                if !anchors(&target_text).contains(anchor) {
                    broken.push(format!("{}: {link}: no such heading", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_readme_stays_a_newcomers_page() {
    // What a newcomer needs first, in this order; the rest lives in docs/.
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let headings: Vec<String> = readme
        .lines()
        .filter(|l| l.starts_with("## "))
        .map(|l| l[3..].to_string())
        .collect();
    for wanted in [
        "Quick start",
        "The demo",
        "Modes",
        "Deploying",
        "Documentation",
    ] {
        assert!(
            headings.iter().any(|h| h.starts_with(wanted)),
            "README has no section {wanted:?}: {headings:?}"
        );
    }
    let lines = readme.lines().count();
    assert!(
        lines <= 400,
        "README.md has {lines} lines: move detail to docs/ and history to CHANGELOG.md"
    );
}

#[test]
fn slugs_follow_githubs_rules() {
    assert_eq!(
        slug(" Where did my packet go: `fastpath inspect` and `fastpath explain`"),
        "where-did-my-packet-go-fastpath-inspect-and-fastpath-explain"
    );
    assert_eq!(
        slug("Taking over from kube-proxy, and handing back"),
        "taking-over-from-kube-proxy-and-handing-back"
    );
}
