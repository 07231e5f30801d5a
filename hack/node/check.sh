#!/usr/bin/env bash
# `make node-check`: brings the local node up, runs real Pods from the ucm image (a Pod running
# `ucm --version` to completion, and config/default's manager Deployment until it is Available),
# checks the add-ons as a Pod and the host use them (a Service name resolves and routes, a PVC
# binds and is cleaned up), runs the e2e suite's platform::node tests (e2e/tests/platform/node.rs),
# brings it down, and fails unless the host is as before: no process, mount, network namespace,
# link, cgroup or sysctl of the node left behind. Needs root, like hack/node/node.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
name=${UCM_NODE_NAME:-ucm-node}
state=${UCM_NODE_DIR:-$root/.run/node}
snap=$(mktemp -d)
trap 'rm -rf "$snap"' EXIT
kubectl=("$root/e2e/bin/kubectl" --kubeconfig "$state/cluster/kubeconfig")
fail() {
  echo "node-check: FAIL: $*" >&2
  hack/node/node.sh down || true
  exit 1
}

. hack/node/hoststate.sh

host_snapshot "$snap/before"
t0=$(date +%s.%N)
hack/node/node.sh up
t_up=$(date +%s.%N)

# 1. A Pod from the ucm image, run to completion under PSA restricted. runAsNonRoot without a
# runAsUser makes kubelet check the image's own USER: it must be numeric and not 0.
ns=node-check
"${kubectl[@]}" create namespace "$ns" >/dev/null
"${kubectl[@]}" label namespace "$ns" pod-security.kubernetes.io/enforce=restricted >/dev/null
until "${kubectl[@]}" -n "$ns" get serviceaccount default >/dev/null 2>&1; do sleep 0.2; done
tag=$(awk '$1=="newTag:"{print $2; exit}' config/default/kustomization.yaml)
"${kubectl[@]}" -n "$ns" apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata: {name: ucm-version}
spec:
  restartPolicy: Never
  securityContext: {runAsNonRoot: true, seccompProfile: {type: RuntimeDefault}}
  containers:
  - name: ucm
    image: ucm:$tag
    imagePullPolicy: Never
    args: [--version]
    securityContext: {allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: {drop: [ALL]}}
YAML
"${kubectl[@]}" -n "$ns" wait --for=jsonpath='{.status.phase}'=Succeeded pod/ucm-version --timeout=120s >/dev/null ||
  fail "pod ucm-version did not succeed: $("${kubectl[@]}" -n "$ns" get pod ucm-version -o jsonpath='{.status}')"
out=$("${kubectl[@]}" -n "$ns" logs ucm-version)
echo "node-check: pod ucm-version printed '$out'"
[[ $out == ucm* ]] || fail "unexpected output from ucm --version: $out"
t_pod=$(date +%s.%N)

# 2. config/default exactly as shipped: the manager Deployment becomes Available (its readiness
# probe answers in the Pod, and it reaches the API server with the shipped RBAC and CRDs).
"${kubectl[@]}" apply --server-side --field-manager=node-check -k config/default >/dev/null
"${kubectl[@]}" -n ucm-system wait --for=condition=Available deployment/ucm-controller-manager --timeout=180s >/dev/null ||
  fail "manager not Available: $("${kubectl[@]}" -n ucm-system get pods -o wide 2>&1)"
t_mgr=$(date +%s.%N)
forbidden=$("${kubectl[@]}" -n ucm-system logs deployment/ucm-controller-manager | grep -ci forbidden || true)
echo "node-check: config/default manager Available; 'forbidden' in its log: $forbidden lines"

# 3. Services and names, from a Pod under PSA restricted: CoreDNS resolves the manager's metrics
# Service and kube-proxy routes to it; from the host, its ClusterIP routes too. A PVC of the
# default StorageClass binds (the local-path provisioner, its helper Pod) and holds what the Pod
# wrote; deleting it removes the volume's directory.
svc=ucm-controller-manager-metrics.ucm-system.svc.cluster.local
busybox=$(hack/node/node.sh image-ref busybox)
"${kubectl[@]}" -n "$ns" apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 8Mi}}}
---
apiVersion: v1
kind: Pod
metadata: {name: client}
spec:
  restartPolicy: Never
  securityContext: {runAsNonRoot: true, runAsUser: 65534, seccompProfile: {type: RuntimeDefault}}
  containers:
  - name: client
    image: $busybox
    imagePullPolicy: Never
    command: [sh, -c, 'nslookup $svc && wget -qO- http://$svc:8080/metrics | grep -c ^ucm_ && echo written >/data/file']
    securityContext: {allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: {drop: [ALL]}}
    volumeMounts: [{name: data, mountPath: /data}]
  volumes:
  - name: data
    persistentVolumeClaim: {claimName: data}
YAML
"${kubectl[@]}" -n "$ns" wait --for=jsonpath='{.status.phase}'=Succeeded pod/client --timeout=120s >/dev/null ||
  fail "pod client did not succeed: $("${kubectl[@]}" -n "$ns" logs client 2>&1; "${kubectl[@]}" -n "$ns" describe pod client pvc data 2>&1 | tail -20)"
out=$("${kubectl[@]}" -n "$ns" logs client)
lines=$(echo "$out" | tail -1)
[[ $lines =~ ^[0-9]+$ && $lines -gt 0 ]] || fail "no ucm_ metrics through the Service from a Pod: $out"
echo "node-check: a Pod resolved $svc and read $lines ucm_ metric lines through it"
ip=$("${kubectl[@]}" -n ucm-system get service ucm-controller-manager-metrics -o jsonpath='{.spec.clusterIP}')
host_lines=$(curl -sSf --max-time 10 "http://$ip:8080/metrics" | grep -c '^ucm_') ||
  fail "the host cannot reach Service IP $ip"
echo "node-check: the host read $host_lines ucm_ metric lines from Service IP $ip"
pv=$("${kubectl[@]}" -n "$ns" get pvc data -o jsonpath='{.status.phase} {.spec.volumeName}')
[[ $pv == "Bound "* ]] || fail "PVC data is not Bound: $pv"
dir=$("${kubectl[@]}" get pv "${pv#Bound }" -o jsonpath='{.spec.hostPath.path}{.spec.local.path}')
[ "$(cat "$dir/file" 2>/dev/null)" = written ] || fail "PV ${pv#Bound } ($dir) does not hold what the Pod wrote"
"${kubectl[@]}" -n "$ns" delete pod client --wait >/dev/null
"${kubectl[@]}" -n "$ns" delete pvc data --wait >/dev/null
end=$((SECONDS + 60))
while [ -e "$dir" ] || "${kubectl[@]}" get pv "${pv#Bound }" >/dev/null 2>&1; do
  ((SECONDS < end)) || fail "PV ${pv#Bound } or its directory $dir still there 60 s after its PVC was deleted"
  sleep 0.5
done
echo "node-check: PVC data bound to ${pv#Bound } ($dir), held the Pod's file, and was removed with its claim"
t_addons=$(date +%s.%N)

# 4. The e2e suite's platform::node tests (e2e/tests/platform/node.rs): ucm's features with real Pods.
UCM_NODE_KUBECONFIG=$state/cluster/kubeconfig cargo test --locked --test e2e -- --ignored --test-threads=1 platform::node:: ||
  fail "the e2e suite's platform::node tests failed"
t_tests=$(date +%s.%N)
"${kubectl[@]}" get pods -A -o wide

hack/node/node.sh down
t_down=$(date +%s.%N)
host_snapshot "$snap/after"
status=0
host_compare "$snap/before" "$snap/after" node-check || status=1
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f", b - a}'; }
echo "node-check: up $(elapsed "$t0" "$t_up")s, pod done +$(elapsed "$t_up" "$t_pod")s, manager Available +$(elapsed "$t_pod" "$t_mgr")s, add-ons checked +$(elapsed "$t_mgr" "$t_addons")s, node tests +$(elapsed "$t_addons" "$t_tests")s, down $(elapsed "$t_tests" "$t_down")s"
[ $status -eq 0 ] && echo "node-check: OK, nothing left behind"
exit $status
