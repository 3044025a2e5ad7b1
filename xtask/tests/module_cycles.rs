//! No import cycles between modules, in every crate of the workspace.
//!
//! A module's file is read for the paths it names through `crate::` and `super::` (in `use`
//! trees, grouped ones expanded, and inline in code; comments left out), each resolved to
//! the deepest module of the crate it reaches. A parent and its own descendants may use each
//! other (a `mod.rs` re-exporting its children, a child using its parent's types): that is
//! one unit. Any other use is an edge between the two siblings, under their nearest common
//! ancestor, that contain the user and the used module. Under every parent the siblings must
//! form a DAG: `a` using `b` while `b` (or anything inside it) uses `a` is a cycle, named
//! with the files and lines that make it.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

type Module = Vec<String>;

/// One use of another module: where it is written.
#[derive(Clone, Debug)]
struct Use {
    file: PathBuf,
    line: usize,
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every module file under `src`, by module path (`a/b.rs` and `a/b/mod.rs` are `a::b`).
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap();
            let mut parts: Module = rel
                .iter()
                .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
                .collect();
            if matches!(
                parts.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                parts.pop();
            }
            // `src/bin/*.rs` are crates of their own, as are their folders.
            if parts.first().is_some_and(|p| p == "bin") {
                continue;
            }
            out.entry(parts).or_insert(path);
        }
    }
    out
}

/// The text with `//` comments and `#[cfg(test)]` modules blanked out (strings containing
/// `//` are rare in paths and only ever widen what is blanked). Tests may use whatever
/// they test; the cycles that matter are those of the code that ships.
fn code_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let (mut after_cfg_test, mut skip_depth) = (false, None::<i32>);
    for l in text.lines() {
        let code = match l.find("//") {
            Some(at) => &l[..at],
            None => l,
        };
        let trimmed = code.trim();
        if let Some(depth) = skip_depth.as_mut() {
            *depth += code.matches('{').count() as i32 - code.matches('}').count() as i32;
            if *depth <= 0 {
                skip_depth = None;
            }
            out.push(String::new());
            continue;
        }
        if trimmed == "#[cfg(test)]" {
            after_cfg_test = true;
        } else if after_cfg_test && trimmed.starts_with("mod ") && trimmed.ends_with('{') {
            skip_depth = Some(1);
            out.push(String::new());
            continue;
        } else if !trimmed.starts_with("#[") {
            after_cfg_test = false;
        }
        out.push(code.to_string());
    }
    out
}

/// Test-only module files (`tests.rs`, `*_tests.rs`, anything under a `*_tests` folder).
fn is_test_module(module: &Module) -> bool {
    module.iter().any(|p| p == "tests" || p.ends_with("_tests"))
}

/// Expands a use tree such as `a::{b, c::{d, e}}` into its paths.
fn expand(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        return vec![tree.to_string()];
    };
    let prefix = tree[..open].trim_end_matches("::").trim();
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .flat_map(expand)
        .map(|p| {
            if p == "self" {
                prefix.to_string()
            } else if prefix.is_empty() {
                p
            } else {
                format!("{prefix}::{p}")
            }
        })
        .collect()
}

/// The `crate::`/`super::` paths a file names, with their line numbers.
fn named_paths(text: &str) -> Vec<(usize, String)> {
    let lines = code_lines(text);
    let mut out = Vec::new();
    // `use` statements, which may span lines and group paths.
    let mut i = 0;
    while i < lines.len() {
        let trimmed = lines[i].trim_start();
        let stmt_start = trimmed
            .strip_prefix("pub(crate) use ")
            .or_else(|| trimmed.strip_prefix("pub use "))
            .or_else(|| trimmed.strip_prefix("use "));
        if let Some(first) = stmt_start {
            let mut stmt = first.to_string();
            let line = i + 1;
            while !stmt.contains(';') && i + 1 < lines.len() {
                i += 1;
                stmt.push_str(&lines[i]);
            }
            let stmt = stmt.split(';').next().unwrap_or_default();
            for p in expand(stmt) {
                let p = p.split(" as ").next().unwrap().trim().to_string();
                if p.starts_with("crate::") || p.starts_with("super::") {
                    out.push((line, p));
                }
            }
        } else {
            // Inline paths in code.
            for start in ["crate::", "super::"] {
                let mut rest = lines[i].as_str();
                while let Some(at) = rest.find(start) {
                    let before = rest[..at].chars().last();
                    let tail = &rest[at..];
                    let end = tail
                        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                        .unwrap_or(tail.len());
                    if !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                        out.push((i + 1, tail[..end].trim_end_matches(':').to_string()));
                    }
                    rest = &tail[end..];
                }
            }
        }
        i += 1;
    }
    out
}

/// The deepest known module a path from module `from` reaches.
fn resolve(from: &Module, path: &str, known: &BTreeMap<Module, PathBuf>) -> Option<Module> {
    let mut segments = path.split("::").peekable();
    let mut base: Module = match segments.next()? {
        "crate" => Vec::new(),
        "super" => {
            let mut b = from.clone();
            b.pop()?;
            while segments.peek() == Some(&"super") {
                segments.next();
                b.pop()?;
            }
            b
        }
        _ => return None,
    };
    let mut best = known.contains_key(&base).then(|| base.clone());
    for s in segments {
        base.push(s.to_string());
        if known.contains_key(&base) {
            best = Some(base.clone());
        }
    }
    best
}

/// The sibling edges of one crate: parent -> (user's side, used side) -> where.
type Edges = BTreeMap<Module, BTreeMap<(String, String), Use>>;

fn sibling_edges(src: &Path) -> Edges {
    let known = modules(src);
    let mut edges: Edges = BTreeMap::new();
    for (module, file) in &known {
        if is_test_module(module) {
            continue;
        }
        let text = std::fs::read_to_string(file).unwrap();
        for (line, path) in named_paths(&text) {
            let Some(target) = resolve(module, &path, &known) else {
                continue;
            };
            let common = module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            // A module and its ancestors or descendants are one unit.
            if common == module.len() || common == target.len() {
                continue;
            }
            let parent = module[..common].to_vec();
            let pair = (module[common].clone(), target[common].clone());
            edges.entry(parent).or_default().entry(pair).or_insert(Use {
                file: file.strip_prefix(workspace()).unwrap_or(file).to_path_buf(),
                line,
            });
        }
    }
    edges
}

/// Every cycle among the siblings under each parent, one per strongly connected group.
fn cycles(edges: &Edges) -> Vec<String> {
    let mut found = Vec::new();
    for (parent, pairs) in edges {
        let mut next: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for (a, b) in pairs.keys() {
            next.entry(a).or_default().insert(b);
        }
        let mut reported: BTreeSet<&str> = BTreeSet::new();
        for &start in next.keys() {
            if reported.contains(start) {
                continue;
            }
            // The shortest way back to `start`, breadth first.
            let mut prev: BTreeMap<&str, &str> = BTreeMap::new();
            let mut queue = std::collections::VecDeque::from([start]);
            let mut closing = None;
            while let Some(at) = queue.pop_front() {
                for &n in next.get(at).into_iter().flatten() {
                    if n == start {
                        closing = Some(at);
                        break;
                    }
                    if !prev.contains_key(n) {
                        prev.insert(n, at);
                        queue.push_back(n);
                    }
                }
                if closing.is_some() {
                    break;
                }
            }
            let Some(mut at) = closing else { continue };
            let mut ring = vec![at];
            while at != start {
                at = prev[at];
                ring.push(at);
            }
            ring.reverse();
            reported.extend(ring.iter().copied());
            let scope = if parent.is_empty() {
                "crate".to_string()
            } else {
                parent.join("::")
            };
            let mut text = format!("in {scope}: {}", ring.join(" -> ")) + &format!(" -> {start}");
            for w in ring
                .windows(2)
                .chain([[*ring.last().unwrap(), start].as_slice()])
            {
                let u = &pairs[&(w[0].to_string(), w[1].to_string())];
                text += &format!(
                    "\n    {} uses {}: {}:{}",
                    w[0],
                    w[1],
                    u.file.display(),
                    u.line
                );
            }
            found.push(text);
        }
    }
    found
}

#[test]
fn no_module_of_any_crate_is_in_an_import_cycle() {
    let mut found = Vec::new();
    for krate in ["proxy-common", "proxy-ebpf", "proxy-userland", "xtask"] {
        let src = workspace().join(krate).join("src");
        for c in cycles(&sibling_edges(&src)) {
            found.push(format!("{krate}: {c}"));
        }
    }
    assert!(found.is_empty(), "import cycles:\n{}", found.join("\n"));
}

#[test]
fn the_checker_sees_a_cycle_through_a_grouped_use_and_an_inline_path() {
    let dir = std::env::temp_dir().join(format!("fp-cycles-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("b")).unwrap();
    std::fs::write(dir.join("lib.rs"), "mod a;\nmod b;\nmod c;\n").unwrap();
    std::fs::write(
        dir.join("a.rs"),
        "use crate::{b::{inner::X}, self as _};\nuse crate::c;\n",
    )
    .unwrap();
    std::fs::write(dir.join("b/mod.rs"), "mod inner;\npub use inner::X;\n").unwrap();
    std::fs::write(
        dir.join("b/inner.rs"),
        "// crate::c::Y in a comment is no use\nfn f() { crate::a::g(); }\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("c.rs"),
        "pub fn h() {}\n#[cfg(test)]\nmod tests {\n    use crate::a::g;\n}\n",
    )
    .unwrap();
    let edges = sibling_edges(&dir);
    let found = cycles(&edges);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("in crate: a -> b -> a"), "{found:?}");
    // b's parent-child re-export is no edge; a -> c is one, but c's test module's use of a
    // is not: nothing that ships goes back to c.
    assert!(!found[0].contains("c uses"), "{found:?}");
}
