//! Records the git commit the binary is built from, for `credpool_build_info{git_commit}` and
//! `credpool --version`: `CREDPOOL_GIT_COMMIT` when the build sets it (a release pipeline, a
//! source tarball, a container build without `.git`), else `git rev-parse HEAD` when git and a
//! repository are there, else `unknown`. Never fails the build.
//!
//! A few lines of std instead of a build-info crate: the git command line is all it needs, and a
//! clean clone, a git worktree and a machine without git all work the same way.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8(output.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

fn main() {
    println!("cargo:rerun-if-env-changed=CREDPOOL_GIT_COMMIT");
    let commit = std::env::var("CREDPOOL_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .map(|c| c.trim().to_owned())
        .or_else(|| git(&["rev-parse", "HEAD"]))
        .filter(|c| {
            c.chars()
                .all(|ch| ch.is_ascii_alphanumeric() || ch == '-' || ch == '.')
        })
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=CREDPOOL_GIT_COMMIT={commit}");

    // Build again when HEAD moves: HEAD itself (a checkout), the branch it names (a commit) and
    // packed-refs (where a packed branch lives), in the repository's git directory (in a
    // worktree, HEAD lives in the worktree's own directory and refs in the common one). Without
    // git there is nothing to watch but this script.
    println!("cargo:rerun-if-changed=build.rs");
    let watched = ["HEAD".to_owned()]
        .into_iter()
        .chain(git(&["symbolic-ref", "-q", "HEAD"]))
        .chain(["packed-refs".to_owned()]);
    for name in watched {
        if let Some(path) = git_path(&name) {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}

/// Where git keeps `name` (`HEAD`, `refs/heads/main`, ...), if that file exists: cargo would
/// build again every time for a path that does not.
fn git_path(name: &str) -> Option<PathBuf> {
    git(&["rev-parse", "--path-format=absolute", "--git-path", name])
        .map(PathBuf::from)
        .filter(|path| path.exists())
}
