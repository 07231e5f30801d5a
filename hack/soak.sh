#!/usr/bin/env bash
# `make soak`: starts a local control plane, runs the soak test (e2e/tests/soak.rs) against it
# for SOAK_MINUTES (default 10), prints its summary (also written to SOAK_SUMMARY, default
# target/soak-summary.txt), stops the control plane.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/ucm-soak-XXXXXX)
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
export UCM_E2E_KUBECONFIG=$(sed -n 's/^READY //p' "$work/ready")
export SOAK_MINUTES=${SOAK_MINUTES:-10}
export SOAK_SUMMARY=${SOAK_SUMMARY:-${CARGO_TARGET_DIR:-$root/target}/soak-summary.txt}
cd "$root"
echo "soak: ${SOAK_MINUTES} min against the control plane started in $(( $(date +%s) - start ))s"
cargo test --locked --test soak -- --ignored --nocapture soak
echo "summary written to $SOAK_SUMMARY (logs of the manager and agents beside it)"
