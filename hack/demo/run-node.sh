#!/usr/bin/env bash
# `make run`: ucm as a user deploys it. The local node (hack/node/node.sh, root: kube-proxy,
# CoreDNS, the local-path provisioner), the image from `make image`, and config/default applied
# exactly as shipped; then demo objects the in-cluster manager reconciles: the Jumpstarter demo,
# a VirtualMachineExport of a provisioned PVC whose disk is downloaded through the export
# Service and checked, and a MiroirSnapshot of a loopfile volume, cut by the snapshot agent
# DaemonSet once it is pointed at a loopfile pool. Follows the manager's log; Ctrl-C brings the
# node down. `make run LOCAL=1` (a local manager process) has the Jumpstarter demo.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
state=${UCM_NODE_DIR:-$root/.run/node}
kubeconfig=$state/cluster/kubeconfig
kubectl=(e2e/bin/kubectl --kubeconfig "$kubeconfig")
t0=$SECONDS

hack/node/node.sh up
down() {
  trap - INT TERM EXIT
  echo
  hack/node/node.sh down
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

"${kubectl[@]}" apply --server-side --field-manager=ucm-run -f "$root/hack/demo/jumpstarter.yaml" >/dev/null
# The in-cluster manager hands out both credentials: the demo is reconciled.
for s in dev-client demo-exporter; do
  end=$((SECONDS + 60))
  until "${kubectl[@]}" -n default get secret "$s" >/dev/null 2>&1; do
    ((SECONDS < end)) || { echo "the manager did not create Secret default/$s" >&2; exit 1; }
    sleep 0.5
  done
done

# VirtualMachineExport: a disk written on a PVC the local-path provisioner binds; the export
# waits (InUse) until the writer is done, then its export-server Pod serves the disk.
sed "s|@BUSYBOX_IMAGE@|$(hack/node/node.sh image-ref busybox)|" hack/demo/vmexport.yaml |
  "${kubectl[@]}" apply --server-side --field-manager=ucm-run -f - >/dev/null
"${kubectl[@]}" -n default wait --for=jsonpath='{.status.phase}'=Succeeded pod/demo-disk-writer --timeout=120s >/dev/null ||
  { "${kubectl[@]}" -n default describe pod demo-disk-writer pvc demo-disk >&2; exit 1; }
"${kubectl[@]}" -n default wait --for=jsonpath='{.status.phase}'=Ready vmexport/demo-disk --timeout=120s >/dev/null ||
  { "${kubectl[@]}" -n default get vmexport demo-disk -o yaml >&2; exit 1; }
vdir=$state/demo
mkdir -p "$vdir"
"${kubectl[@]}" -n default get vmexport demo-disk -o jsonpath='{.status.links.internal.cert}' >"$vdir/export-ca.crt"
"${kubectl[@]}" -n default get secret "$("${kubectl[@]}" -n default get vmexport demo-disk -o jsonpath='{.status.tokenSecretRef}')" \
  -o jsonpath='{.data.token}' | base64 -d >"$vdir/export-token"
url=$("${kubectl[@]}" -n default get vmexport demo-disk \
  -o jsonpath='{.status.links.internal.volumes[0].formats[?(@.format=="raw")].url}')
svc_host=${url#https://}
svc_host=${svc_host%%/*}
svc_ip=$("${kubectl[@]}" -n default get service "${svc_host%%.*}" -o jsonpath='{.spec.clusterIP}')
curl_cmd="curl -sSf --cacert $vdir/export-ca.crt --resolve $svc_host:443:$svc_ip -H \"x-kubevirt-export-token: \$(cat $vdir/export-token)\" $url"
want=$("${kubectl[@]}" -n default logs demo-disk-writer | awk '{print $1}')
got=$(eval "$curl_cmd" | md5sum | awk '{print $1}')
[ "$got" = "$want" ] || { echo "the exported disk's md5 is $got, the writer wrote $want" >&2; exit 1; }

# MiroirSnapshot: the DaemonSet pointed at a loopfile pool (as a user configures it), a volume
# file in that pool, and a snapshot the agent cuts without a barrier (one leg, no DRBD peer).
"${kubectl[@]}" apply --server-side --field-manager=ucm-run -f hack/node/snapshot-pools.yaml >/dev/null
"${kubectl[@]}" -n ucm-system patch daemonset/ucm-snapshot-agent --type=json \
  --patch-file hack/node/snapshot-pools.json >/dev/null
"${kubectl[@]}" -n ucm-system rollout status daemonset/ucm-snapshot-agent --timeout=120s >/dev/null
pool=/var/lib/miroir/loop
mkdir -p "$pool/volumes"
head -c 16777216 /dev/urandom >"$pool/volumes/demo-vol.img"
"${kubectl[@]}" apply --server-side --field-manager=ucm-run -f hack/demo/snapshot.yaml >/dev/null
"${kubectl[@]}" patch miroirvolume demo-vol --subresource=status --type=merge -p \
  '{"status": {"formatted": true, "perNode": {"ucm-node": {"deviceCreated": true, "diskState": "UpToDate", "splitBrain": false}}}}' >/dev/null
"${kubectl[@]}" wait --for=jsonpath='{.status.readyToUse}'=true miroirsnapshot/demo-snap --timeout=120s >/dev/null ||
  { "${kubectl[@]}" get miroirsnapshot demo-snap -o yaml >&2; exit 1; }
cmp "$pool/volumes/demo-vol.img" "$pool/snapshots/demo-snap.img" ||
  { echo "the agent's cut differs from the volume" >&2; exit 1; }

ip=$("${kubectl[@]}" -n ucm-system get pod -l app.kubernetes.io/component=manager \
  -o jsonpath='{.items[0].status.podIP}')
"${kubectl[@]}" get pods -A -o wide
cat <<TXT

config/default is running on node ucm-node, every demo object ready ($((SECONDS - t0))s). Try:
  export KUBECONFIG=$kubeconfig
  e2e/bin/kubectl get exporters,clients,vmexports -A
  e2e/bin/kubectl -n ucm-system logs deploy/ucm-controller-manager
  curl -s http://$ip:8081/readyz?verbose; curl -s http://$ip:8080/metrics | grep ^ucm_
The exported disk (its md5 checked against what the writer Pod wrote), through its Service:
  $curl_cmd | md5sum
Snapshot demo-snap of volume demo-vol, cut by the agent on the node (compared with the volume):
  e2e/bin/kubectl get miroirvolumes,miroirsnapshots; ls -ls $pool/volumes $pool/snapshots
Pod and Service IPs are routed from this host; names resolve in Pods (CoreDNS).
Following the manager's log; Ctrl-C stops ucm, the node and the control plane.
TXT
"${kubectl[@]}" -n ucm-system logs -f deploy/ucm-controller-manager --since=1s &
wait $! || true
