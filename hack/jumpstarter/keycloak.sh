#!/usr/bin/env bash
# Fetches (once) the Keycloak server the OIDC e2e tests sign in against, pre-builds it for an
# in-memory database and prints the distribution's path on stdout.
#
#   hack/jumpstarter/keycloak.sh            # prints e.g. /root/.cache/ucm/keycloak-26.7.3
#
# The zip comes from Maven Central (org.keycloak:keycloak-quarkus-dist) and must match the pinned
# SHA-512. `kc.sh build` runs here once, so each test start is `kc.sh start --optimized` (seconds,
# not the half-minute re-augmentation of dev mode). Keycloak 26 needs Java 21+: JAVA_HOME, else the
# machine's Temurin 25. A lock serialises concurrent callers; any failure exits non-zero.
set -euo pipefail
version=26.7.3
sha512=15c764765576eef267cf15cc5225a5826b5394a25a83d9bfa5b8544e4bbba690cb743c9d384200b93bb71ee4c4a328e1dd8c0a00f822fd3e6e154f14b1e47216
url=https://repo1.maven.org/maven2/org/keycloak/keycloak-quarkus-dist/$version/keycloak-quarkus-dist-$version.zip
cache=${XDG_CACHE_HOME:-$HOME/.cache}/ucm
dist=$cache/keycloak-$version
stamp=$version-dev-mem-1

java_home() {
  local j
  for j in "${JAVA_HOME:-}" /usr/lib/jvm/temurin-25-jdk-amd64 /usr/lib/jvm/temurin-21-jdk-amd64 /usr/lib/jvm/java-21-openjdk-amd64; do
    if [[ -n "$j" && -x "$j/bin/java" ]] && "$j/bin/java" -version 2>&1 | grep -qE 'version "(2[1-9]|[3-9][0-9])'; then
      echo "$j"
      return 0
    fi
  done
  echo "hack/jumpstarter/keycloak.sh: Keycloak $version needs Java 21 or later; set JAVA_HOME" >&2
  return 1
}

if [[ -f "$dist/.ucm-stamp" && "$(cat "$dist/.ucm-stamp")" == "$stamp" ]]; then
  echo "$dist"
  exit 0
fi
mkdir -p "$cache"
exec 9>"$dist.lock"
flock 9
if [[ ! -f "$dist/.ucm-stamp" || "$(cat "$dist/.ucm-stamp")" != "$stamp" ]]; then
  jh=$(java_home)
  zip=$cache/keycloak-$version.zip
  if [[ ! -f "$zip" ]] || ! echo "$sha512  $zip" | sha512sum --check --status; then
    echo "hack/jumpstarter/keycloak.sh: downloading $url" >&2
    curl --fail --location --silent --show-error --retry 3 -o "$zip.part" "$url"
    if ! echo "$sha512  $zip.part" | sha512sum --check --status; then
      echo "hack/jumpstarter/keycloak.sh: $url does not match the pinned SHA-512" >&2
      rm -f "$zip.part"
      exit 1
    fi
    mv "$zip.part" "$zip"
  fi
  rm -rf "$dist" "$dist.unpack"
  mkdir -p "$dist.unpack"
  (cd "$dist.unpack" && python3 -m zipfile -e "$zip" .)
  mv "$dist.unpack/keycloak-$version" "$dist"
  rm -rf "$dist.unpack"
  chmod +x "$dist"/bin/*.sh
  JAVA_HOME=$jh "$dist/bin/kc.sh" build --db=dev-mem --health-enabled=true >&2
  echo "$jh" >"$dist/.ucm-java-home"
  echo "$stamp" >"$dist/.ucm-stamp"
fi
echo "$dist"
