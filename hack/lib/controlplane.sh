# Sourced, not run: the local control plane the e2e suite (hack/test/e2e.sh) and the soak
# (hack/test/soak.sh) run against.
#
# controlplane_up NAME starts `e2e/bin/kharness serve --with-kcm --rm-dir` in a fresh
# /tmp/NAME-XXXXXX directory, stops it and removes the directory when the calling script exits
# (an EXIT trap), waits up to 180 s for READY and exports UCM_E2E_KUBECONFIG. It sets
# controlplane_started (epoch seconds, before the start) for the caller's timing line.

controlplane_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

controlplane_up() {
  controlplane_work=$(mktemp -d "/tmp/$1-XXXXXX")
  "$controlplane_root/e2e/bin/kharness" serve --dir "$controlplane_work/cluster" --with-kcm --rm-dir \
    >"$controlplane_work/ready" 2>"$controlplane_work/harness.log" &
  controlplane_pid=$!
  trap controlplane_down EXIT
  controlplane_started=$(date +%s)
  until grep -q '^READY ' "$controlplane_work/ready"; do
    if ! kill -0 "$controlplane_pid" 2>/dev/null || (($(date +%s) - controlplane_started > 180)); then
      echo "the local control plane did not start; last harness log lines:" >&2
      tail -n 60 "$controlplane_work/harness.log" >&2
      exit 1
    fi
    sleep 0.2
  done
  UCM_E2E_KUBECONFIG=$(sed -n 's/^READY //p' "$controlplane_work/ready")
  export UCM_E2E_KUBECONFIG
}

controlplane_down() {
  kill -TERM "$controlplane_pid" 2>/dev/null || true
  wait "$controlplane_pid" 2>/dev/null || true
  rm -rf "$controlplane_work"
}
