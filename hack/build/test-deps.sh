#!/usr/bin/env bash
# Installs the command-line peers the tests use (Debian packages) when they are missing:
# bsdtar (libarchive-tools) reads the export server's tar streams, zstd the layers of its `oci`
# archive, mkfs.btrfs/mkfs.xfs give the snapshot reflink test a filesystem to loop-mount. Without
# root, it only names what is missing.
set -euo pipefail
need=()
command -v bsdtar >/dev/null || need+=(libarchive-tools)
command -v mkfs.btrfs >/dev/null || need+=(btrfs-progs)
command -v curl >/dev/null || need+=(curl)
command -v zstd >/dev/null || need+=(zstd)
command -v losetup >/dev/null || need+=(mount)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "installing test prerequisites: ${need[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
else
  echo "missing test prerequisites (Debian packages): ${need[*]}" >&2
  exit 1
fi
