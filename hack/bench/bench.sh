#!/usr/bin/env bash
# `make bench` (docs/benchmarks.md): installs the reference tools from Debian when missing
# (nginx, pigz, curl; as root, like hack/build/test-deps.sh), builds the release ucm binary and the bench
# driver (`cargo bench` profile), runs the driver, and reports the wall times. The driver writes
# bench/results.md and bench/results.json. Pass UCM_BENCH_ONLY=<phase>[,...] to rerun phases.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)

need=()
command -v nginx >/dev/null || need+=(nginx)
command -v pigz >/dev/null || need+=(pigz)
command -v curl >/dev/null || need+=(curl)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "missing benchmark tools (Debian packages): ${need[*]}" >&2
    exit 1
  fi
  echo "installing benchmark tools: ${need[*]}"
  # Keep the nginx package from starting its system service on port 80.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

cargo bench --locked --bench ucm --no-run
built=$(date +%s)
build_time="$(( (built - start) / 60 ))m$(( (built - start) % 60 ))s"
echo "build (with tool install): $build_time"
UCM_BENCH_BUILD_TIME="$build_time" cargo bench --locked --bench ucm
end=$(date +%s)
echo "make bench: $(( (end - start) / 60 ))m$(( (end - start) % 60 ))s in all (build $build_time)"
