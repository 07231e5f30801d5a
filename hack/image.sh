#!/usr/bin/env bash
# `hack/image.sh [ucm]` (`make image`): the ucm container image as an OCI archive, built from
# ./Dockerfile by buildah (daemonless, rootful here) without a registry. The Dockerfile's `build`
# stage (rust:alpine, from a registry) is replaced by a local directory holding a static glibc build and the host's CA
# bundle (see the Dockerfile's header); the final FROM scratch stage is built as written.
# Output: $UCM_IMAGE_ARCHIVE (default <target dir>/ucm-image.oci.tar), image
# docker.io/library/ucm:<tag>, which is what config/default's `image: ucm` + newTag resolves to.
# `hack/image.sh pause` (`make node`): the local node's Pod sandbox image, localhost/ucm-pause:1,
# from e2e/bin/pause (e2e/cmd/pause, static), at $UCM_CACHE/image/pause.oci.tar.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
target_dir=${CARGO_TARGET_DIR:-$root/target}
out=${UCM_IMAGE_ARCHIVE:-$target_dir/ucm-image.oci.tar}
cache=${UCM_CACHE:-$HOME/.cache/ucm}
tag=$(awk '$1=="newTag:"{print $2; exit}' config/default/kustomization.yaml)
ref=docker.io/library/ucm:$tag
hack/host-deps.sh image
# Own storage under the cache: nothing shared with other buildah/podman users of the machine.
buildah=(buildah --root "$cache/image/storage" --runroot "$cache/image/run")

if [ "${1:-ucm}" = pause ]; then
  c=$("${buildah[@]}" from scratch)
  "${buildah[@]}" copy --chmod 0755 "$c" e2e/bin/pause /pause >/dev/null
  "${buildah[@]}" config --entrypoint '["/pause"]' --user 65535:65535 "$c"
  "${buildah[@]}" commit --quiet --timestamp 0 --rm "$c" localhost/ucm-pause:1 >/dev/null
  mkdir -p "$cache/image"
  rm -f "$cache/image/pause.oci.tar"
  "${buildah[@]}" push --quiet localhost/ucm-pause:1 "oci-archive:$cache/image/pause.oci.tar:localhost/ucm-pause:1"
  echo "image localhost/ucm-pause:1 -> $cache/image/pause.oci.tar"
  exit 0
fi

# The same release settings as the Dockerfile's build stage. An explicit --target keeps
# crt-static off build scripts and proc macros, which cannot be static.
triple=$(rustc -vV | awk '$1=="host:"{print $2}')
RUSTFLAGS="-C target-feature=+crt-static" CARGO_PROFILE_RELEASE_STRIP=symbols \
  CARGO_PROFILE_RELEASE_LTO=thin CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 \
  cargo build --release --locked --bin ucm --target "$triple"
bin=$target_dir/$triple/release/ucm
# No program interpreter: nothing in the image could serve as one.
if readelf -lW "$bin" | grep -q INTERP; then echo "$bin is not static" >&2; exit 1; fi

ctx=$cache/image/build-stage
rm -rf "$ctx" && mkdir -p "$ctx/etc/ssl/certs"
cp "$bin" "$ctx/ucm"
cp -L /etc/ssl/certs/ca-certificates.crt "$ctx/etc/ssl/certs/ca-certificates.crt"

# --timestamp 0: same inputs, same image digest.
"${buildah[@]}" bud --quiet --timestamp 0 --build-context build="$ctx" -f Dockerfile -t "$ref" . >/dev/null
mkdir -p "$(dirname "$out")"
rm -f "$out.tmp"
"${buildah[@]}" push --quiet "$ref" "oci-archive:$out.tmp:$ref"
mv "$out.tmp" "$out"
"${buildah[@]}" rmi --prune >/dev/null 2>&1 || true

# Check what a user of the image relies on: non-root, the entrypoint, a binary that runs.
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
tar -xf "$out" -C "$check"
blob() { echo "$check/blobs/${1/://}"; }
manifest=$(blob "$(jq -r '.manifests[0].digest' "$check/index.json")")
config=$(blob "$(jq -r '.config.digest' "$manifest")")
[ "$(jq -r '.config.User' "$config")" = 65532:65532 ] || { echo "image user is not 65532:65532" >&2; exit 1; }
[ "$(jq -c '.config.Entrypoint' "$config")" = '["/usr/local/bin/ucm"]' ] || { echo "unexpected entrypoint" >&2; exit 1; }
mkdir "$check/rootfs"
for layer in $(jq -r '.layers[].digest' "$manifest"); do tar -xf "$(blob "$layer")" -C "$check/rootfs"; done
version=$("$check/rootfs/usr/local/bin/ucm" --version)
grep -q '^nonroot:x:65532:65532:' "$check/rootfs/etc/passwd" || { echo "no nonroot user in /etc/passwd" >&2; exit 1; }
[ ! -e "$check/rootfs/bin/sh" ] || { echo "the image has a shell" >&2; exit 1; }
echo "image $ref ($version, $(du -h "$out" | cut -f1)) -> $out"
