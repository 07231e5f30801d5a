#!/usr/bin/env bash
# Installs the Debian packages `make image` (image) and `make node` (node) need, when missing.
#   image: buildah builds the Dockerfile daemonless and writes an OCI archive (no registry).
#   busybox: Debian's static busybox, for the node's helper and demo image (hack/build/image.sh node).
#   node:  containerd 1.6 + runc (crun 1.8 fails on hybrid cgroup v1 hosts), the bridge/host-local/
#          loopback/portmap CNI plugins, iptables for the in-namespace DNAT to the API server.
#   conformance: the upstream suite's own tools (nc for direct-listener; nft, dnsmasq and ping
#          for dut-network), unshare/nsenter and ip for the private namespaces, openssl for the
#          certificates, curl for the login lane (hack/conformance/run.sh).
# Without root, it only names what is missing.
set -euo pipefail
need=()
for role in "$@"; do
  case $role in
  image)
    command -v buildah >/dev/null || need+=(buildah)
    command -v jq >/dev/null || need+=(jq)
    ;;
  busybox)
    # busybox-static replaces the dynamic busybox package if that is installed.
    if [ ! -x /bin/busybox ] || readelf -lW /bin/busybox 2>/dev/null | grep -q INTERP; then need+=(busybox-static); fi
    ;;
  node)
    command -v containerd >/dev/null || need+=(containerd)
    command -v runc >/dev/null || need+=(runc)
    [ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
    command -v iptables >/dev/null || need+=(iptables)
    command -v nsenter >/dev/null || need+=(util-linux)
    ;;
  conformance)
    command -v nc >/dev/null && nc -h 2>&1 | grep -q -- '-z' || need+=(netcat-openbsd)
    command -v nft >/dev/null || need+=(nftables)
    command -v dnsmasq >/dev/null || need+=(dnsmasq-base)
    command -v ping >/dev/null || need+=(iputils-ping)
    command -v ip >/dev/null || need+=(iproute2)
    command -v unshare >/dev/null || need+=(util-linux)
    command -v openssl >/dev/null || need+=(openssl)
    command -v curl >/dev/null || need+=(curl)
    command -v flock >/dev/null || need+=(util-linux)
    ;;
  *) echo "usage: $0 image|busybox|node|conformance..." >&2; exit 2 ;;
  esac
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "installing: ${need[*]}"
  apt-get update -qq >/dev/null
  # No recommends: containerd would pull in a service manager's units and nothing we use.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
  echo "missing (Debian packages, install as root): ${need[*]}" >&2
  exit 1
fi
