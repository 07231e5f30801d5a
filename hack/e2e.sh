#!/usr/bin/env bash
# Starts one local control plane, runs the e2e tests (the #[ignore]d ones) against it, stops it.
# `--test <binary>` (repeatable) picks test binaries (default: all); other arguments go to the test
# binaries (e.g. a test name filter):  hack/e2e.sh --test jumpstarter [filter]
set -euo pipefail
targets=()
filters=()
while (($#)); do
  if [[ $1 == --test && $# -ge 2 ]]; then
    targets+=(--test "$2")
    shift 2
  else
    filters+=("$1")
    shift
  fi
done
((${#targets[@]})) || targets=(--tests)
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/ucm-e2e-XXXXXX)
"$root/e2e/bin/kharness" serve --dir "$work/cluster" --with-kcm --rm-dir >"$work/ready" 2>"$work/harness.log" &
pid=$!
cleanup() {
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
start=$(date +%s)
until grep -q '^READY ' "$work/ready"; do
  if ! kill -0 "$pid" 2>/dev/null || (( $(date +%s) - start > 180 )); then
    echo "the local control plane did not start; last harness log lines:" >&2
    tail -n 60 "$work/harness.log" >&2
    exit 1
  fi
  sleep 0.2
done
echo "control plane ready in $(( $(date +%s) - start ))s"
export UCM_E2E_KUBECONFIG=$(sed -n 's/^READY //p' "$work/ready")
cd "$root"
cargo test --locked --no-fail-fast "${targets[@]}" -- --ignored --test-threads="${E2E_THREADS:-4}" "${filters[@]}"
