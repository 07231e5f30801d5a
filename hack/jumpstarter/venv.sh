#!/usr/bin/env bash
# Creates (once) the virtualenv holding the pinned Jumpstarter 0.9.0 Python packages that the
# wire-schema check and the real-exporter e2e tests use, and prints its path on stdout.
#
#   hack/jumpstarter/venv.sh            # prints e.g. /root/.cache/ucm/venv-jumpstarter-<hash>
#   hack/jumpstarter/venv.sh NAME PIN...  # another set of pins: .../venv-NAME-<hash>
#                                         # (hack/conformance/venv.sh)
#
# UCM_JUMPSTARTER_VENV overrides the location. The directory name carries a hash of the pins, so
# checkouts with different pins never rebuild each other's venv; a lock serialises concurrent
# callers (parallel tests), and a venv counts as built only once its stamp is written. Any failure
# exits non-zero with pip's message: callers fail loudly.
set -euo pipefail
python=${PYTHON:-python3}
name=jumpstarter
pins=(
  jumpstarter==0.9.0
  jumpstarter-protocol==0.9.0
  jumpstarter-driver-power==0.9.0
  jumpstarter-driver-composite==0.9.0
  jumpstarter-cli==0.9.0
  jumpstarter-cli-admin==0.9.0
  googleapis-common-protos==1.76.0
  protobuf==7.36.2
  grpcio==1.85.3
)
if (($#)); then
  name=$1
  shift
  pins=("$@")
  ((${#pins[@]})) || { echo "usage: $0 [NAME PIN...]" >&2; exit 2; }
  unset UCM_JUMPSTARTER_VENV
fi
stamp=$(printf '%s\n' "${pins[@]}" | sha256sum | cut -c1-16)
venv=${UCM_JUMPSTARTER_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ucm/venv-$name-$stamp}
if [[ -f "$venv/.ucm-stamp" && "$(cat "$venv/.ucm-stamp")" == "$stamp" ]]; then
  echo "$venv"
  exit 0
fi
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [[ ! -f "$venv/.ucm-stamp" || "$(cat "$venv/.ucm-stamp")" != "$stamp" ]]; then
  rm -rf "$venv"
  # Built in place under the final path (venv scripts embed it), published by the stamp.
  "$python" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}" >&2
  echo "$stamp" >"$venv/.ucm-stamp"
fi
echo "$venv"
