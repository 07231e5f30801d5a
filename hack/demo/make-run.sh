#!/usr/bin/env bash
# `make run [LOCAL=1]`: the builds and installs `make run` needs, one stage line each with its
# expected duration (measured on the 2-core development machine: docs/operations.md, "make
# run"); tool output (apt, go, cargo, buildah) goes to .run/logs/ and is shown only when a stage
# fails. Then hack/demo/run-node.sh (root: config/default on a real local node) or
# hack/demo/run.sh (LOCAL=1, or not root: the manager as a local process on the node-less control
# plane).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
. hack/demo/lib.sh
make=${MAKE:-make}
mode=$1
rm -rf .run/logs
mkdir -p .run/logs
echo "make run: stage logs in .run/logs/"
if [ "$mode" = node ]; then
  stage "Debian packages if missing: buildah jq busybox-static containerd runc containernetworking-plugins iptables" \
    "1–2 min when missing, else instant" hack/build/host-deps.sh image busybox node
  # A stage that fails stops the one running alongside it.
  trap '[ -z "${bg_pid:-}" ] || pkill -P "$bg_pid" 2>/dev/null || true' EXIT
  # The Go programs build alongside Cargo (each leaves cores idle in its link and codegen tails).
  stage_start "Go programs: kharness (control plane), kubectl, helm, promtool, kubelet, kube-scheduler, kube-proxy, CoreDNS, local-path provisioner" \
    "about 10 min with empty Go caches, 2–4 min with warm ones, seconds when built" \
    "$make" --no-print-directory cluster e2e/bin/kubelet e2e/bin/kube-scheduler e2e/bin/kube-proxy \
    e2e/bin/pause e2e/bin/coredns e2e/bin/local-path-provisioner
  # The image `make test` also builds (a dev-profile static binary: minutes cold, not the release
  # settings' 7–19), so either warms the other. UCM_IMAGE_PROFILE=release runs the shipped settings.
  profile=${UCM_IMAGE_PROFILE:-dev}
  if [ "$profile" = dev ]; then
    export UCM_IMAGE_ARCHIVE=${UCM_IMAGE_ARCHIVE:-${CARGO_TARGET_DIR:-$root/target}/ucm-image-dev.oci.tar}
    expect="5–8 min cold on 2 cores, a minute for a changed source; seconds when unchanged"
  else
    expect="7–19 min cold on 2 cores; seconds when unchanged"
  fi
  stage "The ucm image: $profile build and buildah" "$expect" env UCM_IMAGE_PROFILE="$profile" hack/build/image.sh
  stage_wait
  stage "The node's images: pause, CoreDNS, local-path provisioner, busybox" "10–20 s" hack/build/image.sh node
  exec hack/demo/run-node.sh
fi
[ "$mode" = local ] || echo "make run: not root, so no local node (it needs network namespaces, mounts and cgroups); running the manager as a local process, as make run LOCAL=1 does"
stage "Go programs: kharness (control plane), kubectl, helm, promtool" \
  "about 6 min with empty Go caches, 1–2 min with warm ones, seconds when built" \
  "$make" --no-print-directory cluster
stage "ucm: debug build" "5–8 min cold on 2 cores, seconds when unchanged" "$make" --no-print-directory build
exec hack/demo/run.sh
