#!/usr/bin/env bash
# `make run NODE=1`: ucm as a user deploys it. The local node (hack/node.sh, root), the image from
# `make image`, and config/default applied exactly as shipped; then the Jumpstarter demo objects,
# which the in-cluster manager reconciles. Follows the manager's log; Ctrl-C brings the node down.
# Not yet here (issue 20): kube-proxy and CoreDNS (Services do not route, so `jmp` cannot reach
# the in-cluster gRPC endpoint ucm-grpc.ucm-system.svc), a volume provisioner, the vmexport and
# snapshot demos. The default `make run` (a local manager process) has the Jumpstarter demo.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
state=${UCM_NODE_DIR:-$root/.run/node}
kubeconfig=$state/cluster/kubeconfig
kubectl=(e2e/bin/kubectl --kubeconfig "$kubeconfig")
t0=$SECONDS

hack/node.sh up
down() {
  trap - INT TERM EXIT
  echo
  hack/node.sh down
}
trap down INT TERM EXIT

# (The snapshot agent is privileged by design: its PodSecurity warning is expected.)
out=$("${kubectl[@]}" apply --server-side --field-manager=ucm-run -k config/default 2>&1) || {
  echo "$out" >&2
  exit 1
}
"${kubectl[@]}" -n ucm-system rollout status deployment/ucm-controller-manager --timeout=180s >/dev/null
"${kubectl[@]}" -n ucm-system rollout status deployment/ucm-router --timeout=120s >/dev/null
"${kubectl[@]}" -n ucm-system rollout status daemonset/ucm-snapshot-agent --timeout=120s >/dev/null

"${kubectl[@]}" apply --server-side --field-manager=ucm-run -f "$root/hack/demo-jumpstarter.yaml" >/dev/null
# The in-cluster manager hands out both credentials: the demo is reconciled.
for s in dev-client demo-exporter; do
  end=$((SECONDS + 60))
  until "${kubectl[@]}" -n default get secret "$s" >/dev/null 2>&1; do
    ((SECONDS < end)) || { echo "the manager did not create Secret default/$s" >&2; exit 1; }
    sleep 0.5
  done
done
ip=$("${kubectl[@]}" -n ucm-system get pod -l app.kubernetes.io/component=manager \
  -o jsonpath='{.items[0].status.podIP}')
"${kubectl[@]}" get pods -A -o wide
cat <<TXT

config/default is running on node ucm-node ($((SECONDS - t0))s). Try:
  export KUBECONFIG=$kubeconfig
  e2e/bin/kubectl get exporters,clients -A
  e2e/bin/kubectl -n ucm-system logs deploy/ucm-controller-manager
  curl -s http://$ip:8081/readyz?verbose; curl -s http://$ip:8080/metrics | grep ^ucm_
Pod IPs are routed from this host; Services are not (no kube-proxy yet).
Following the manager's log; Ctrl-C stops ucm, the node and the control plane.
TXT
"${kubectl[@]}" -n ucm-system logs -f deploy/ucm-controller-manager --since=1s &
wait $! || true
