#!/usr/bin/env bash
# Creates (once) a virtualenv holding published Jumpstarter packages of one version from PyPI and
# prints its path on stdout. Used by hack/conformance/run.sh for the suite's `jmp` (0.9.0) and the
# old-client lane's (0.7.4).
#
#   hack/conformance/venv.sh 0.9.0        # e.g. /root/.cache/ucm/venv-conformance-0.9.0-<hash>
#
# The directory name carries a hash of the pins; a lock serialises concurrent callers and a venv
# counts as built only once its stamp is written (as hack/jumpstarter-venv.sh does).
set -euo pipefail
version=${1:?usage: $0 <jumpstarter version>}
python=${PYTHON:-python3}
case $version in
  0.9.0)
    pins=(jumpstarter jumpstarter-cli jumpstarter-cli-admin jumpstarter-driver-power
      jumpstarter-driver-composite jumpstarter-driver-opendal jumpstarter-driver-dut-network) ;;
  *)
    # compat/setup.sh's list for the old client
    pins=(jumpstarter jumpstarter-cli jumpstarter-driver-composite jumpstarter-driver-power
      jumpstarter-driver-opendal) ;;
esac
pins=("${pins[@]/%/==$version}")
# jumpstarter-driver-opendal 0.7.4 asks for opendal>=0.45.8 without an upper bound, and opendal
# 0.47 removed the AsyncFile it imports (every 0.7.4 exporter with the suite's MockStorageMux fails
# with an ImportError). Later releases of the driver bound it (0.9.0: opendal>=0.45.8,<0.46);
# the same bound here.
[ "$version" = 0.9.0 ] || pins+=("opendal>=0.45.8,<0.46")
stamp=$(printf '%s\n' "${pins[@]}" | sha256sum | cut -c1-16)
venv=${XDG_CACHE_HOME:-$HOME/.cache}/ucm/venv-conformance-$version-$stamp
if [[ -f "$venv/.ucm-stamp" && "$(cat "$venv/.ucm-stamp")" == "$stamp" ]]; then
  echo "$venv"
  exit 0
fi
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [[ ! -f "$venv/.ucm-stamp" || "$(cat "$venv/.ucm-stamp")" != "$stamp" ]]; then
  rm -rf "$venv"
  echo "creating $venv: ${pins[*]}" >&2
  "$python" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}" >&2
  echo "$stamp" >"$venv/.ucm-stamp"
fi
echo "$venv"
