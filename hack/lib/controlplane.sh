# Sourced, not run: the one way scripts start the local control plane (`e2e/bin/kharness serve
# --with-kcm`) and wait for its READY line. Used by the e2e suite (hack/test/e2e.sh), the soak
# (hack/test/soak.sh), `make run LOCAL=1` (hack/demo/run.sh) and the conformance run
# (hack/conformance/run.sh).
#
# controlplane_start DIR READY LOG [FLAG...] starts `kharness serve --dir DIR --with-kcm FLAG...`
# in the background, its stdout (the READY line) in READY and its log in LOG. It sets
# controlplane_pid, for the caller's teardown, and controlplane_started (epoch seconds).
#
# controlplane_wait waits up to 180 s for READY and sets controlplane_kubeconfig; if the control
# plane exits or is not ready in time it prints the log's tail on stderr and returns 1. Once
# READY it returns at once, so a caller that waited in a subshell calls it again for the
# kubeconfig.
#
# controlplane_stop stops it (SIGTERM, then waits).
#
# controlplane_up NAME is all three for a throwaway cluster: a fresh /tmp/NAME-XXXXXX directory,
# `--rm-dir`, stopped and removed when the calling script exits (an EXIT trap), the kubeconfig
# exported as UCM_E2E_KUBECONFIG; a control plane that does not start ends the script.

controlplane_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

controlplane_start() {
  local dir=$1
  controlplane_ready=$2
  controlplane_log=$3
  shift 3
  : >"$controlplane_ready"
  controlplane_started=$(date +%s)
  "$controlplane_root/e2e/bin/kharness" serve --dir "$dir" --with-kcm "$@" \
    >"$controlplane_ready" 2>"$controlplane_log" &
  controlplane_pid=$!
}

controlplane_wait() {
  until grep -q '^READY ' "$controlplane_ready"; do
    if ! kill -0 "$controlplane_pid" 2>/dev/null || (($(date +%s) - controlplane_started > 180)); then
      echo "the local control plane did not start; the last lines of $controlplane_log:" >&2
      tail -n 60 "$controlplane_log" >&2
      return 1
    fi
    sleep 0.2
  done
  controlplane_kubeconfig=$(sed -n 's/^READY //p' "$controlplane_ready")
}

controlplane_stop() {
  kill -TERM "$controlplane_pid" 2>/dev/null || true
  wait "$controlplane_pid" 2>/dev/null || true
}

controlplane_up() {
  controlplane_work=$(mktemp -d "/tmp/$1-XXXXXX")
  controlplane_start "$controlplane_work/cluster" "$controlplane_work/ready" "$controlplane_work/harness.log" --rm-dir
  trap controlplane_down EXIT
  controlplane_wait || exit 1
  UCM_E2E_KUBECONFIG=$controlplane_kubeconfig
  export UCM_E2E_KUBECONFIG
}

controlplane_down() {
  controlplane_stop
  rm -rf "$controlplane_work"
}
