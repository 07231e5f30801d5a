#!/usr/bin/env bash
# `make run`: a local control plane, ucm's CRDs and the manager with every feature on.
# The cluster directory .run/cluster survives, so the next run reuses its data, ports and kubeconfig.
# Ctrl-C stops the manager and the control plane.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
ucm="${CARGO_TARGET_DIR:-target}/debug/ucm"
mkdir -p .run
: >.run/ready
e2e/bin/kharness serve --dir .run/cluster --with-kcm >.run/ready 2>.run/harness.log &
kh=$!
mgr=""
stop() {
  trap - INT TERM EXIT
  set +e
  [ -n "$mgr" ] && kill -TERM "$mgr" 2>/dev/null && wait "$mgr" 2>/dev/null
  kill -TERM "$kh" 2>/dev/null && wait "$kh" 2>/dev/null
  echo "stopped"
  exit 0
}
trap stop INT TERM EXIT
start=$(date +%s)
until grep -q '^READY ' .run/ready; do
  if ! kill -0 "$kh" 2>/dev/null || (( $(date +%s) - start > 180 )); then
    echo "the local control plane did not start; see .run/harness.log" >&2
    tail -n 40 .run/harness.log >&2
    exit 1
  fi
  sleep 0.2
done
kubeconfig=$(sed -n 's/^READY //p' .run/ready)
kubectl=(e2e/bin/kubectl --kubeconfig "$kubeconfig")
"${kubectl[@]}" apply --server-side --field-manager=ucm-run -f crds/ >/dev/null
"${kubectl[@]}" wait --for condition=established --timeout=60s -f crds/ >/dev/null
if [ -d config/samples ] && ls config/samples/*.yaml >/dev/null 2>&1; then
  "${kubectl[@]}" apply --server-side --field-manager=ucm-run -f config/samples/ || true
fi
cat <<TXT

Local control plane ready. Try:
  export KUBECONFIG=$kubeconfig
  e2e/bin/kubectl get crd
  e2e/bin/kubectl get exporters,leases.jumpstarter.dev,miroirsnapshots -A
  curl -s localhost:8081/readyz?verbose; curl -s localhost:8080/metrics | grep controller_runtime

Starting ucm manager with every feature on (Ctrl-C stops everything).
TXT
"$ucm" manager --kubeconfig "$kubeconfig" --namespace default --leader-elect=false --log-format=text &
mgr=$!
wait "$mgr"
