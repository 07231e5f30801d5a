#!/usr/bin/env bash
# Creates (once) a virtualenv holding published Jumpstarter packages of one version from PyPI and
# prints its path on stdout. Used by hack/conformance/run.sh for the suite's `jmp` (0.9.0) and the
# old-client lane's (0.7.4).
#
#   hack/conformance/venv.sh 0.9.0        # e.g. /root/.cache/ucm/venv-conformance-0.9.0-<hash>
#
# Built (and cached, locked, stamped) by hack/jumpstarter/venv.sh with these pins.
set -euo pipefail
version=${1:?usage: $0 <jumpstarter version>}
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
exec "$(dirname "$0")/../jumpstarter/venv.sh" "conformance-$version" "${pins[@]}"
