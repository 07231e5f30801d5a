//! The `dir` format: directory listings and files below a volume root (docs/vmexport.md, "Export
//! server"). Symlinks are resolved and anything escaping the root is "not found"; `lost+found` is
//! hidden at the root.

use std::fs;
use std::path::{Component, Path, PathBuf};

pub enum Resolved {
    File(PathBuf),
    Dir(PathBuf),
    NotFound,
}

/// Resolves the decoded request remainder `rel` (below `/dir/`) inside `root`.
pub fn resolve(root: &Path, rel: &str) -> Resolved {
    let Ok(root) = root.canonicalize() else {
        return Resolved::NotFound;
    };
    let mut p = root.clone();
    let mut first = true;
    for c in Path::new(rel).components() {
        match c {
            Component::Normal(s) => {
                if first && s == "lost+found" {
                    return Resolved::NotFound;
                }
                first = false;
                p.push(s);
            }
            Component::CurDir | Component::RootDir => {}
            // No climbing out by `..`, even before symlink resolution.
            Component::ParentDir | Component::Prefix(_) => return Resolved::NotFound,
        }
    }
    let Ok(real) = p.canonicalize() else {
        return Resolved::NotFound;
    };
    if !real.starts_with(&root)
        || real
            .strip_prefix(&root)
            .is_ok_and(|r| r.starts_with("lost+found"))
    {
        return Resolved::NotFound;
    }
    match fs::metadata(&real) {
        Ok(m) if m.is_dir() => Resolved::Dir(real),
        Ok(m) if m.is_file() => Resolved::File(real),
        _ => Resolved::NotFound,
    }
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn href_escape(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A sorted HTML listing, directories with a trailing `/` (like Go's `http.FileServer`).
pub fn listing(dir: &Path, is_root: bool) -> std::io::Result<String> {
    let mut names: Vec<String> = Vec::new();
    for e in fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if is_root && name == "lost+found" {
            continue;
        }
        let is_dir = fs::metadata(e.path()).map(|m| m.is_dir()).unwrap_or(false);
        names.push(if is_dir { format!("{name}/") } else { name });
    }
    names.sort();
    let mut out = String::from(
        "<!doctype html>\n<meta name=\"viewport\" content=\"width=device-width\">\n<pre>\n",
    );
    for n in names {
        let (base, slash) = match n.strip_suffix('/') {
            Some(b) => (b, "/"),
            None => (n.as_str(), ""),
        };
        out.push_str(&format!(
            "<a href=\"{}{slash}\">{}{slash}</a>\n",
            href_escape(base),
            html_escape(base)
        ));
    }
    out.push_str("</pre>\n");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_inside_and_rejects_escapes() {
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("secret"), "s").unwrap();
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        fs::create_dir_all(r.join("sub")).unwrap();
        fs::create_dir_all(r.join("lost+found")).unwrap();
        fs::write(r.join("sub/f.txt"), "x").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), r.join("escape")).unwrap();
        std::os::unix::fs::symlink("sub/f.txt", r.join("inside")).unwrap();
        assert!(matches!(resolve(r, "sub/f.txt"), Resolved::File(_)));
        assert!(matches!(resolve(r, "inside"), Resolved::File(_)));
        assert!(matches!(resolve(r, "sub"), Resolved::Dir(_)));
        assert!(matches!(resolve(r, ""), Resolved::Dir(_)));
        assert!(matches!(resolve(r, "escape"), Resolved::NotFound));
        assert!(matches!(resolve(r, "../x"), Resolved::NotFound));
        assert!(matches!(resolve(r, "lost+found"), Resolved::NotFound));
        assert!(matches!(resolve(r, "nope"), Resolved::NotFound));
        let l = listing(r, true).unwrap();
        assert!(l.contains("<a href=\"sub/\">sub/</a>"));
        assert!(l.contains("inside"));
        assert!(!l.contains("lost+found"));
    }
}
