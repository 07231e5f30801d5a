#!/usr/bin/env bash
# Installs the Debian packages the conformance run needs, when missing (root; as hack/host-deps.sh):
# the suite's own tools (nc for the direct-listener lane; nft, dnsmasq and ping for dut-network),
# unshare/nsenter for the private namespaces, openssl for the certificates, curl for the login lane.
set -euo pipefail
need=()
command -v nc >/dev/null && nc -h 2>&1 | grep -q -- '-z' || need+=(netcat-openbsd)
command -v nft >/dev/null || need+=(nftables)
command -v dnsmasq >/dev/null || need+=(dnsmasq-base)
command -v ping >/dev/null || need+=(iputils-ping)
command -v ip >/dev/null || need+=(iproute2)
command -v unshare >/dev/null || need+=(util-linux)
command -v openssl >/dev/null || need+=(openssl)
command -v curl >/dev/null || need+=(curl)
command -v flock >/dev/null || need+=(util-linux)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "installing: ${need[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
  echo "missing (Debian packages, install as root): ${need[*]}" >&2
  exit 1
fi
