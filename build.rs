//! Generates the Jumpstarter gRPC code from the committed FileDescriptorSet (no protoc): the set
//! was extracted from the published `jumpstarter-protocol` 0.9.0 package (see
//! `src/exporter/proto/README.md`), so the wire schema is never written by hand.
//! Also stamps the git revision into the binary (`ucm_build_info{revision}`, `ucm --version`).

use prost::Message;

const FDS: &str = "src/exporter/proto/jumpstarter-protocol-0.9.0.fds";

/// A git command's trimmed output, `None` when git is missing or fails.
fn git(args: &[&str]) -> Option<String> {
    std::process::Command::new("git")
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// The inputs of the binary: `-dirty` speaks of these only (docs or tests edited do not change
/// what was built), and this script re-runs when one of them changes.
const INPUTS: &[&str] = &["src", "Cargo.toml", "Cargo.lock", "build.rs"];

/// `git rev-parse --short HEAD`, with `-dirty` when tracked inputs differ from it; `None` outside a
/// checkout (a Docker build context holds no `.git`: the Dockerfile passes the revision in).
/// `--no-optional-locks`: a plain `git status` refreshes and rewrites `.git/index`, which made
/// every build invalidate the next (docs/architecture.md, "Build stamp").
fn git_revision() -> Option<String> {
    let head = git(&["rev-parse", "--short", "HEAD"]).filter(|h| !h.is_empty())?;
    let mut status = vec![
        "--no-optional-locks",
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
    ];
    status.extend(INPUTS);
    let dirty = git(&status).is_some_and(|s| !s.is_empty());
    Some(if dirty { format!("{head}-dirty") } else { head })
}

fn main() -> std::io::Result<()> {
    println!("cargo:rerun-if-changed={FDS}");
    // A commit moves HEAD (or the branch it names, loose or packed, and appends to HEAD's reflog:
    // that catches a first commit on a branch that was only packed); an edit of an input changes
    // the dirty mark (and rebuilds the crate anyway). `.git/index` is not watched: any git command
    // may rewrite it without changing anything built. Only paths that exist are watched (a
    // missing one would re-run this script on every build); git names them, so a worktree (whose
    // .git is a file) works too.
    println!("cargo:rerun-if-env-changed=UCM_GIT_REVISION");
    for input in INPUTS {
        println!("cargo:rerun-if-changed={input}");
    }
    let branch = git(&["symbolic-ref", "-q", "HEAD"]);
    let mut watched = vec!["HEAD".to_string(), "packed-refs".into(), "logs/HEAD".into()];
    watched.extend(branch);
    for name in watched {
        if let Some(path) = git(&["rev-parse", "--git-path", &name])
            && std::path::Path::new(&path).exists()
        {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    let revision = std::env::var("UCM_GIT_REVISION")
        .ok()
        .filter(|r| !r.is_empty())
        .or_else(git_revision)
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=UCM_GIT_REVISION={revision}");
    let bytes = std::fs::read(FDS)?;
    let fds = prost_types::FileDescriptorSet::decode(bytes.as_slice())
        .map_err(|e| std::io::Error::other(format!("{FDS}: {e}")))?;
    // Only the jumpstarter files are generated; google/* types come from prost-types or are
    // generated too when they have no Rust counterpart (annotations are options only).
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // RPCs ucm does not serve answer Unimplemented.
        .generate_default_stubs(true)
        .compile_fds(fds)
}
