#!/usr/bin/env bash
# `make lint`'s freshness check (docs/architecture.md, "Build stamp"): with nothing changed, a
# second `cargo build` compiles nothing, even after a `git status` has rewritten .git/index (as
# editors, prompts and build scripts do). Run after a build of the same profile.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --locked --bin ucm --quiet
# What editors, prompts and git commands do between builds: read the status, rewrite the index.
git status --porcelain >/dev/null
touch "$(git rev-parse --git-path index)"
out=$(cargo build --locked --bin ucm -v 2>&1)
if grep -E '^\s*(Compiling|Running) ' <<<"$out" | cut -c1-100; then
  echo "check-fresh: a build with nothing changed compiled the lines above (build.rs's stamp?)" >&2
  exit 1
fi
echo "check-fresh: OK, the second build was fresh ($(grep -c '^\s*Fresh ' <<<"$out") units Fresh)"
