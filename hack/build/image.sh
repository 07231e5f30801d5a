#!/usr/bin/env bash
# `hack/build/image.sh [ucm]` (`make image`): the ucm container image as an OCI archive, built from
# ./Dockerfile by buildah (daemonless, rootful here) without a registry. The Dockerfile's `build`
# stage (rust:alpine, from a registry) is replaced by a local directory holding a static glibc build and the host's CA
# bundle (see the Dockerfile's header); the final FROM scratch stage is built as written.
# Output: $UCM_IMAGE_ARCHIVE (default <target dir>/ucm-image.oci.tar), image
# docker.io/library/ucm:<tag>, which is what config/default's `image: ucm` + newTag resolves to.
# `hack/build/image.sh node` (`make node`): the local node's other images, as archives under
# $UCM_CACHE/image: the Pod sandbox (localhost/ucm-pause:1, e2e/cmd/pause), CoreDNS, the
# local-path provisioner and busybox (for the provisioner's helper Pods and the demos).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
target_dir=${CARGO_TARGET_DIR:-$root/target}
out=${UCM_IMAGE_ARCHIVE:-$target_dir/ucm-image.oci.tar}
cache=${UCM_CACHE:-$HOME/.cache/ucm}
tag=$(awk '$1=="newTag:"{print $2; exit}' config/default/kustomization.yaml)
ref=docker.io/library/ucm:$tag
hack/build/host-deps.sh image
# Own storage under the cache: nothing shared with other buildah/podman users of the machine.
buildah=(buildah --root "$cache/image/storage" --runroot "$cache/image/run")

# small NAME REF USER ENTRYPOINT SRC:DST...: an image of static programs (no base image), as an
# OCI archive at $cache/image/NAME.oci.tar. Same inputs, same digest (--timestamp 0).
small() {
  local n=$1 ref=$2 user=$3 entrypoint=$4 c f key
  shift 4
  # Same inputs as the archive on disk: nothing to build (a warm `make run` in seconds).
  # (Contents and destinations only: a source may sit in a fresh temporary directory.)
  key=$({
    echo "$ref $user $entrypoint"
    for f in "$@"; do
      echo "${f#*:}"
      tar -cf - --sort=name --mtime=@0 --owner=0 --group=0 -C "$(dirname "${f%%:*}")" "$(basename "${f%%:*}")"
    done
  } | sha256sum)
  if [ -f "$cache/image/$n.oci.tar" ] && [ "$(cat "$cache/image/$n.key" 2>/dev/null)" = "$key" ]; then
    echo "image $ref unchanged -> $cache/image/$n.oci.tar"
    return
  fi
  c=$("${buildah[@]}" from scratch)
  for f in "$@"; do "${buildah[@]}" copy --chmod 0755 "$c" "${f%%:*}" "${f#*:}" >/dev/null; done
  "${buildah[@]}" config --entrypoint "$entrypoint" --user "$user" "$c"
  "${buildah[@]}" commit --quiet --timestamp 0 --rm "$c" "$ref" >/dev/null
  mkdir -p "$cache/image"
  rm -f "$cache/image/$n.oci.tar"
  "${buildah[@]}" push --quiet "$ref" "oci-archive:$cache/image/$n.oci.tar:$ref"
  echo "$key" >"$cache/image/$n.key"
  echo "image $ref -> $cache/image/$n.oci.tar"
}
gomod() { awk -v m="$2" '$1==m{print $2; exit}' "e2e/tools/$1/go.mod"; }

if [ "${1:-ucm}" = node ]; then
  hack/build/host-deps.sh busybox
  # The Pod sandbox.
  small pause localhost/ucm-pause:1 65535:65535 '["/pause"]' e2e/bin/pause:/pause
  # CoreDNS and the local-path provisioner, from their Go modules (hack/node/addons.yaml).
  small coredns "localhost/coredns:$(gomod coredns github.com/coredns/coredns)" 65532:65532 \
    '["/coredns"]' e2e/bin/coredns:/coredns
  small local-path "localhost/local-path-provisioner:$(gomod local-path github.com/rancher/local-path-provisioner)" \
    65532:65532 '["/local-path-provisioner"]' e2e/bin/local-path-provisioner:/local-path-provisioner
  # The provisioner's helper Pods run `sh` scripts (mkdir, rm) as root: Debian's static busybox
  # with a link per applet, the image the node's demos also use.
  bb=$(mktemp -d)
  trap 'rm -rf "$bb"' EXIT
  mkdir -p "$bb/bin"
  cp /bin/busybox "$bb/bin/busybox"
  for a in $(/bin/busybox --list); do [ "$a" = busybox ] || ln -s busybox "$bb/bin/$a"; done
  small busybox "localhost/busybox:$(/bin/busybox | awk 'NR==1{print $2}')" 0:0 '["/bin/sh"]' "$bb/bin:/bin"
  exit 0
fi

# The same release settings as the Dockerfile's build stage. An explicit --target keeps
# crt-static off build scripts and proc macros, which cannot be static.
# UCM_IMAGE_PROFILE=dev (make test's node area) builds the binary with the dev profile instead:
# the same source and image, but a changed source rebuilds in about a minute, where the release
# settings (thin LTO, one codegen unit) take 7–19 min on 2 cores.
triple=$(rustc -vV | awk '$1=="host:"{print $2}')
case ${UCM_IMAGE_PROFILE:-release} in
release)
  RUSTFLAGS="-C target-feature=+crt-static" CARGO_PROFILE_RELEASE_STRIP=symbols \
    CARGO_PROFILE_RELEASE_LTO=thin CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 \
    cargo build --release --locked --bin ucm --target "$triple"
  bin=$target_dir/$triple/release/ucm
  ;;
dev)
  RUSTFLAGS="-C target-feature=+crt-static" CARGO_PROFILE_DEV_STRIP=debuginfo \
    cargo build --locked --bin ucm --target "$triple"
  bin=$target_dir/$triple/debug/ucm
  ;;
*) echo "UCM_IMAGE_PROFILE is release or dev" >&2; exit 2 ;;
esac
# No program interpreter: nothing in the image could serve as one.
if readelf -lW "$bin" | grep -q INTERP; then echo "$bin is not static" >&2; exit 1; fi

# Same binary, Dockerfile and root files as the archive on disk: nothing to build (the archive
# passed the checks below when it was made).
key=$(cat "$bin" Dockerfile deploy/image/etc/passwd deploy/image/etc/group /etc/ssl/certs/ca-certificates.crt |
  sha256sum | sed "s|-\$|$ref|")
if [ -f "$out" ] && [ "$(cat "$out.key" 2>/dev/null)" = "$key" ]; then
  echo "image $ref unchanged -> $out"
  exit 0
fi

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
rm -f "$out.key"
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
echo "$key" >"$out.key"
echo "image $ref ($version, $(du -h "$out" | cut -f1)) -> $out"
