#!/usr/bin/env bash
# `make soak`: starts a local control plane, runs the soak test (e2e/tests/soak.rs) against it
# for SOAK_MINUTES (default 10), prints its summary (also written to SOAK_SUMMARY, default
# target/soak-summary.txt), stops the control plane.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=hack/lib/controlplane.sh
source "$root/hack/lib/controlplane.sh"
controlplane_up ucm-soak
export SOAK_MINUTES=${SOAK_MINUTES:-10}
export SOAK_SUMMARY=${SOAK_SUMMARY:-${CARGO_TARGET_DIR:-$root/target}/soak-summary.txt}
cd "$root"
echo "soak: ${SOAK_MINUTES} min against the control plane started in $(( $(date +%s) - controlplane_started ))s"
cargo test --locked --test soak -- --ignored --nocapture soak
echo "summary written to $SOAK_SUMMARY (logs of the manager and agents beside it)"
