#!/usr/bin/env bash
# `make run LOCAL=1` (and `make run` without root): a local control plane, ucm's CRDs and the
# manager with every feature on, plus a `ucm router` and ready-made `jmp` configs
# (.run/jumpstarter/) for a demo Client and Exporter.
# The cluster directory .run/cluster survives, so the next run reuses its data, ports and kubeconfig.
# Ctrl-C stops the router, the manager and the control plane.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
. hack/demo/lib.sh
# shellcheck source=hack/lib/controlplane.sh
. hack/lib/controlplane.sh
ucm="${CARGO_TARGET_DIR:-target}/debug/ucm"
mkdir -p .run
controlplane_start .run/cluster .run/ready .run/harness.log
mgr=""
router=""
stop() {
  trap - INT TERM EXIT
  set +e
  [ -n "$router" ] && kill -TERM "$router" 2>/dev/null && wait "$router" 2>/dev/null
  [ -n "$mgr" ] && kill -TERM "$mgr" 2>/dev/null && wait "$mgr" 2>/dev/null
  controlplane_stop
  echo "stopped"
  exit 0
}
trap stop INT TERM EXIT
control_plane() {
  controlplane_wait
  local kubectl=(e2e/bin/kubectl --kubeconfig "$controlplane_kubeconfig")
  "${kubectl[@]}" apply --server-side --field-manager=ucm-run -f crds/
  "${kubectl[@]}" wait --for condition=established --timeout=60s -f crds/
}
stage "Local control plane (etcd, kube-apiserver, kube-controller-manager) and ucm's CRDs" \
  "about 10 s; log in .run/harness.log" control_plane
controlplane_wait
kubeconfig=$controlplane_kubeconfig
kubectl=(e2e/bin/kubectl --kubeconfig "$kubeconfig")
cat <<TXT

Local control plane ready. Try:
  export KUBECONFIG=$kubeconfig
  e2e/bin/kubectl get crd
  e2e/bin/kubectl get exporters,leases.jumpstarter.dev,miroirsnapshots -A
  curl -s localhost:8081/readyz?verbose; curl -s localhost:8080/metrics | grep controller_runtime

Starting ucm manager with every feature on (Ctrl-C stops everything).
TXT
# The exporter feature's gRPC service listens on :8082 (advertised as localhost:8082) and hands
# out the router at localhost:8083: the defaults, spelled out for the instructions below.
"$ucm" manager --kubeconfig "$kubeconfig" --namespace default --leader-elect=false --log-format=text \
  --exporter-grpc-endpoint=localhost:8082 --exporter-router-endpoint=localhost:8083 &
mgr=$!

# Jumpstarter: a demo Client and Exporter, the router, and jmp configs holding their tokens.
"${kubectl[@]}" apply --server-side --field-manager=ucm-run -f "$root/hack/demo/jumpstarter.yaml" >/dev/null
secret() { "${kubectl[@]}" -n default get secret "$1" -o "jsonpath={.data.$2}" 2>/dev/null | base64 -d; }
for s in ucm-exporter-grpc-tls:tls\\.crt ucm-router-key:key dev-client:token demo-exporter:token; do
  until [ -n "$(secret "${s%%:*}" "${s#*:}")" ]; do
    kill -0 "$mgr" 2>/dev/null || { echo "the manager exited" >&2; exit 1; }
    sleep 0.5
  done
done
cert=$(secret ucm-exporter-grpc-tls 'tls\.crt')
# The router serves the controller's certificate, so the one CA in the configs covers both.
EXTERNAL_CERT_PEM=$cert EXTERNAL_KEY_PEM=$(secret ucm-exporter-grpc-tls 'tls\.key') KUBECONFIG=$kubeconfig \
  "$ucm" router --bind-address=:8083 --endpoint=localhost:8083 --namespace default \
    --health-probe-bind-address=127.0.0.1:8087 >.run/router.log 2>&1 &
router=$!
jdir=.run/jumpstarter
jmp_configs "$jdir" localhost:8082 "$cert" "$(secret dev-client token)" "$(secret demo-exporter token)"
cat <<TXT

Jumpstarter: controller gRPC localhost:8082 (TLS, CA in Secret default/ucm-exporter-grpc-tls),
router localhost:8083 (ucm router, log in .run/router.log). Demo Client "dev" and Exporter "demo"
(label board=demo); their configs with tokens are in $jdir/. Exporter demo shows Message "Never
seen" (kubectl get exporters -o wide) until an exporter connects with its token. In another terminal:
$(jmp_commands "$jdir" | sed 's/^/  /')
A client token for your own Client <name> (create one with kubectl first):
  e2e/bin/kubectl --kubeconfig $kubeconfig get secret <name>-client -o jsonpath='{.data.token}' | base64 -d
TXT
wait "$mgr"
