#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for FUZZ_SECONDS (default 60) each and prints the
# executions per target. The committed seeds in fuzz/corpus/<target>/ are read, never written:
# libFuzzer's new inputs go to a scratch corpus. A crash stops the run with the reproducer's
# path (`cargo fuzz run -s none <target> <file>` replays it).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root/fuzz"
mkdir -p artifacts
seconds=${FUZZ_SECONDS:-60}
# Stable Rust: no sanitizer (the only -Z flag cargo fuzz would need), coverage via -C flags.
flags=(--sanitizer none --target-dir "$root/fuzz/target")
targets=$(cargo fuzz list)
cargo fuzz build "${flags[@]}"
scratch=$(mktemp -d /tmp/ucm-fuzz-XXXXXX)
trap 'rm -rf "$scratch"' EXIT
printf '%-16s %14s %10s %8s\n' target executions exec/s corpus > "$scratch/summary"
for t in $targets; do
  mkdir -p "$scratch/$t" "corpus/$t"
  echo "== $t (${seconds}s)"
  if ! cargo fuzz run "${flags[@]}" "$t" "$scratch/$t" "corpus/$t" -- \
      -max_total_time="$seconds" -print_final_stats=1 -artifact_prefix="$root/fuzz/artifacts/$t-" \
      >"$scratch/$t.log" 2>&1; then
    tail -n 40 "$scratch/$t.log"
    echo "fuzz target $t failed; reproducer under fuzz/artifacts/" >&2
    exit 1
  fi
  runs=$(sed -n 's/^Done \([0-9]*\) runs in \([0-9]*\) second.*/\1 \2/p' "$scratch/$t.log" | tail -n1)
  n=${runs% *}
  s=${runs#* }
  printf '%-16s %14s %10s %8s\n' "$t" "$n" "$(( n / (s > 0 ? s : 1) ))" "$(ls "$scratch/$t" | wc -l)" >> "$scratch/summary"
done
cat "$scratch/summary"
