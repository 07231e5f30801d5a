//! The docs name only what exists (docs/architecture.md, "Guard rails"): every repository path
//! a page of `docs/` names (`src/...`, `hack/...`, `e2e/...` and the other top-level folders)
//! exists, and each "Code map" names every file and folder of the source folder it maps, and
//! nothing else. A rename that forgets its page fails here, in `make test`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The top-level folders a path in the docs starts with.
const ROOTS: &[&str] = &[
    "src/", "hack/", "e2e/", "testkit/", "benches/", "bench/", "deploy/", "config/", "crds/",
    "fuzz/", "docs/",
];

/// Outputs the docs name, which a clean clone does not have (`make` and `make fuzz` make them).
/// A folder is named with or without its trailing slash (`e2e/bin` or `e2e/bin/...`).
const BUILT: &[&str] = &["e2e/bin", "fuzz/artifacts"];

/// `w` is the folder `dir` or a path inside it (not `e2e/binaries`).
fn is_under(w: &str, dir: &str) -> bool {
    w.strip_prefix(dir)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/') || rest == ".")
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A placeholder (`src/<feature>/`, `docs/*.md`), not a path.
fn is_pattern(s: &str) -> bool {
    s.contains(['<', '>', '*', '{', '}']) || s.contains("...")
}

fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "_./<>*{}-".contains(c)
}

/// The repository paths `text` names: words made of path characters that start with a
/// top-level folder (so a URL's `.../src/...` is not one), without a sentence's final dot.
fn named_paths(text: &str) -> Vec<&str> {
    text.split(|c: char| !is_path_char(c))
        .filter(|w| ROOTS.iter().any(|r| w.starts_with(r)))
        .filter(|w| !is_pattern(w) && !BUILT.iter().any(|b| is_under(w, b)))
        .map(|w| w.trim_end_matches(['.', ',']))
        .collect()
}

/// The `code` spans of `text`.
fn code_spans(text: &str) -> impl Iterator<Item = &str> {
    text.split('`').skip(1).step_by(2)
}

/// One page's problems: paths that do not exist, and code-map gaps.
fn check_page(repo: &Path, page: &str, text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut missing = |line: usize, what: &str| {
        problems.push(format!("docs/{page}:{line}: {what} does not exist"));
    };
    let mut in_map = false;
    // The folder the code map's next table lists (the last `src/.../` its prose names), and
    // what each table names in it.
    let mut base: Option<String> = None;
    let mut named: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        if line.starts_with("## ") {
            in_map = line.trim() == "## Code map";
        }
        let mut rest = line;
        if in_map && line.starts_with('|') {
            if let Some(base) = &base {
                let cells: Vec<&str> = line.split('|').collect();
                let first = cells.get(1).copied().unwrap_or_default();
                let entries = named.entry(base.clone()).or_default();
                for span in code_spans(line).filter(|s| !is_pattern(s)) {
                    entries.insert(span.to_string());
                }
                // The first column holds paths relative to the mapped folder.
                for span in code_spans(first).filter(|s| !is_pattern(s)) {
                    if (span.ends_with(".rs") || span.ends_with('/'))
                        && !repo.join(base).join(span).exists()
                    {
                        missing(line_no, &format!("{base}{span}"));
                    }
                }
                rest = line.splitn(3, '|').nth(2).unwrap_or_default();
            }
        } else if in_map
            && let Some(b) = code_spans(line)
                .filter(|s| s.starts_with("src/") && s.ends_with('/'))
                .last()
        {
            base = Some(b.to_string());
        }
        for path in named_paths(rest) {
            if !repo.join(path).exists() {
                missing(line_no, path);
            }
        }
    }
    // Every entry of a mapped folder is named in its map (a folder mapped by a table of its
    // own counts as named).
    for (base, entries) in &named {
        let Ok(dir) = std::fs::read_dir(repo.join(base)) else {
            continue;
        };
        let mut found: Vec<String> = dir
            .flatten()
            .map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                if e.path().is_dir() {
                    format!("{name}/")
                } else {
                    name
                }
            })
            .collect();
        found.sort();
        for entry in found {
            let listed = entries
                .iter()
                .any(|n| n == &entry || n.starts_with(&entry) || n.ends_with(&format!("/{entry}")));
            let own_table = named.contains_key(&format!("{base}{entry}"));
            if !listed && !own_table {
                problems.push(format!(
                    "docs/{page}, \"Code map\": {base}{entry} is not listed"
                ));
            }
        }
    }
    problems
}

#[test]
fn every_path_the_docs_name_exists() {
    let repo = repo();
    let mut problems = Vec::new();
    let mut pages: Vec<_> = std::fs::read_dir(repo.join("docs"))
        .expect("docs/ is readable")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    pages.sort();
    assert!(!pages.is_empty(), "no page in docs/");
    for page in pages {
        let text = std::fs::read_to_string(&page).expect("a docs page is text");
        let name = page.file_name().unwrap().to_string_lossy().into_owned();
        problems.extend(check_page(&repo, &name, &text));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The check finds what it is for: a renamed file, a stale code-map row, an unlisted file.
#[test]
fn the_check_finds_missing_paths_and_unlisted_files() {
    let repo = repo();
    let page = "\
Run `hack/test/e2e.sh` and read src/lib.rs. See https://example.com/src/nothing.rs, docs/<page>.md.
The old src/gone.rs moved.

## Code map

In `src/runtime/`:

| file | what |
|---|---|
| `meta.rs` | `controlled_by` |
| `gone.rs` | nothing |

## Next
Built by make: `e2e/bin`, e2e/bin/kubectl; never: e2e/binaries.
";
    let problems = check_page(&repo, "x.md", page);
    assert!(
        problems
            .iter()
            .any(|p| p == "docs/x.md:14: e2e/binaries does not exist"),
        "{problems:?}"
    );
    assert!(
        !problems
            .iter()
            .any(|p| p.contains("e2e/bin ") || p.contains("e2e/bin/kubectl")),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p == "docs/x.md:2: src/gone.rs does not exist"),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p == "docs/x.md:11: src/runtime/gone.rs does not exist"),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.contains("src/runtime/writer.rs is not listed")),
        "{problems:?}"
    );
    assert!(
        !problems
            .iter()
            .any(|p| p.contains("hack/test/e2e.sh") || p.contains("src/lib.rs"))
    );
    assert!(
        !problems
            .iter()
            .any(|p| p.contains("nothing.rs") || p.contains("page"))
    );
    assert!(
        !problems.iter().any(|p| p.contains("meta.rs")),
        "{problems:?}"
    );
}
