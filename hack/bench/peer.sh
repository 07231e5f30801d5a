#!/usr/bin/env bash
# The peer of `make bench`'s `peer` phase (README, "Benchmarks"): builds the upstream Jumpstarter
# Go controller v0.9.0 from ../shared/reference/jumpstarter-controller-v0.9.0 (read-only there,
# dependencies from the Go module proxy) into ~/.cache/ucm/peer/<key>/, keyed by a hash of its
# source and the Go version, and prints the binary's path. A second call with the same source
# prints the cached binary at once. Fails loudly when the source or Go is missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
src=${UCM_BENCH_PEER_SRC:-$(cd "$root/.." && pwd)/shared/reference/jumpstarter-controller-v0.9.0}
[ -f "$src/controller/cmd/main.go" ] || { echo "peer: no Go controller source at $src/controller" >&2; exit 1; }
command -v go >/dev/null || { echo "peer: 'go' not on PATH (the Go toolchain builds the peer controller)" >&2; exit 1; }
cache=${UCM_BENCH_PEER_CACHE:-$HOME/.cache/ucm/peer}
key=$( (cd "$src" && find . -type f ! -path './.git/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum; go version) \
  | sha256sum | cut -c1-16)
bin=$cache/$key/jumpstarter-controller
if [ ! -x "$bin" ]; then
  mkdir -p "$cache/$key"
  echo "peer: building the Go controller from $src (key $key; about 3 min cold)" >&2
  (cd "$src/controller" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false \
    go build -o "$bin.tmp" ./cmd/main.go) >&2
  mv "$bin.tmp" "$bin"
fi
echo "$bin"
