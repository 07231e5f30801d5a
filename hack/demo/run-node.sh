#!/usr/bin/env bash
# `make run`: ucm as a user deploys it. The local node (hack/node/node.sh, root: kube-proxy,
# CoreDNS, the local-path provisioner), the image from `make image`, and config/default as
# shipped plus what a user adds to reach Jumpstarter from outside the cluster (hack/demo/node:
# NodePorts on the node's address, one certificate for the controller and the router); then
# demo objects the in-cluster manager reconciles: the Jumpstarter demo with `jmp` configs that
# work from this host, a VirtualMachineExport of a provisioned PVC whose disk is downloaded
# through the export Service and checked, and a MiroirSnapshot of a loopfile volume, cut by the
# snapshot agent DaemonSet once it is pointed at a loopfile pool. Prints what to try, then
# follows the manager's log (readable lines; the JSON in .run/manager.log.json); Ctrl-C (or
# SIGTERM, SIGHUP, a dead reader of its output) brings the node down. `make node-e2e` checks
# all of it as a user runs it (hack/demo/check.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
. hack/demo/lib.sh
state=${UCM_NODE_DIR:-$root/.run/node}
kubeconfig=$state/cluster/kubeconfig
kubectl=(e2e/bin/kubectl --kubeconfig "$kubeconfig")
# The node's address (hack/node/node.sh) and the NodePorts of hack/demo/node.
node_ip=10.213.0.2
grpc_endpoint=$node_ip:30082
router_endpoint=$node_ip:30083
jdir=.run/jumpstarter
vdir=$state/demo
pool=/var/lib/miroir/loop
t0=$SECONDS
follower=""

down() {
  trap - INT TERM HUP PIPE EXIT
  # The teardown must finish whatever became of our output: `make run | tee run.log` loses its
  # reader on Ctrl-C (tee gets the SIGINT too) and a closed terminal fails every write, so a
  # write here neither kills this shell (SIGPIPE ignored) nor stops it (no `set -e`).
  trap '' PIPE
  set +e
  if [ -n "$follower" ]; then
    pkill -P "$follower" 2>/dev/null # its kubectl logs
    kill "$follower" 2>/dev/null
  fi
  { echo; echo "==> bringing the node down (about 15 s; log in .run/logs/node-down.log)"; } 2>/dev/null
  if ! hack/node/node.sh down >.run/logs/node-down.log 2>&1; then
    tail -n 20 .run/logs/node-down.log 2>/dev/null
    exit 1
  fi
}
# Ctrl-C (SIGINT), SIGTERM and a closed terminal (SIGHUP) end a run: a clean exit. A write to a
# reader that died (SIGPIPE) ends it too. A failure keeps its status.
trap 'down; exit 0' INT TERM HUP PIPE
trap down EXIT
mkdir -p .run/logs

# A node a previous run left up (its teardown killed, or `make node`) is taken down first: a run
# starts from a fresh cluster, and says so.
if [ -e "/run/netns/${UCM_NODE_NAME:-ucm-node}" ] || [ -d "$state" ]; then
  echo "==> a node from a previous run is still up: taking it down first (log in .run/logs/node-down-previous.log)"
  hack/node/node.sh down >.run/logs/node-down-previous.log 2>&1 ||
    { tail -n 20 .run/logs/node-down-previous.log; exit 1; }
fi
stage "Node up: control plane, containerd, kubelet, kube-proxy, CoreDNS, volume provisioner" "about 30 s" \
  hack/node/node.sh up

install_ucm() {
  # The controller's and router's certificate, with the names jmp dials from this host and from
  # Pods; the manager serves Secret ucm-exporter-grpc-tls when it exists (docs/exporter.md,
  # "Certificates"), so this one is created before the manager starts.
  "${kubectl[@]}" create namespace ucm-system --dry-run=client -o yaml |
    "${kubectl[@]}" apply --server-side --field-manager=ucm-run -f -
  local tmp
  tmp=$(mktemp -d)
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 \
    -subj /CN=ucm-jumpstarter-demo -keyout "$tmp/tls.key" -out "$tmp/tls.crt" \
    -addext "subjectAltName=IP:$node_ip,DNS:ucm-grpc.ucm-system.svc,DNS:ucm-router.ucm-system.svc,DNS:localhost,IP:127.0.0.1"
  "${kubectl[@]}" -n ucm-system create secret tls ucm-exporter-grpc-tls --cert "$tmp/tls.crt" --key "$tmp/tls.key" \
    --dry-run=client -o yaml | "${kubectl[@]}" apply --server-side --force-conflicts --field-manager=ucm-run -f -
  rm -rf "$tmp"
  # The snapshot agent is privileged by design; the namespace enforces "privileged" but warns at
  # "restricted", so this prints a PodSecurity warning for its DaemonSet (kept in this log).
  "${kubectl[@]}" apply --server-side --field-manager=ucm-run -k hack/demo/node
  "${kubectl[@]}" -n ucm-system rollout status deployment/ucm-controller-manager --timeout=180s
  "${kubectl[@]}" -n ucm-system rollout status deployment/ucm-router --timeout=120s
  "${kubectl[@]}" -n ucm-system rollout status daemonset/ucm-snapshot-agent --timeout=120s
}
stage "ucm: config/default as shipped + hack/demo/node (Jumpstarter reachable from this host)" "about 30 s" \
  install_ucm

demo_jumpstarter() {
  "${kubectl[@]}" apply --server-side --field-manager=ucm-run -f hack/demo/jumpstarter.yaml
  # The in-cluster manager hands out both credentials: the demo is reconciled.
  local s end
  for s in dev-client demo-exporter; do
    end=$((SECONDS + 60))
    until "${kubectl[@]}" -n default get secret "$s" >/dev/null 2>&1; do
      ((SECONDS < end)) || { echo "the manager did not create Secret default/$s"; exit 1; }
      sleep 0.5
    done
  done
}

# VirtualMachineExport: a disk written on a PVC the local-path provisioner binds; the export
# waits (InUse) until the writer is done, then its export-server Pod serves the disk.
demo_vmexport() {
  sed "s|@BUSYBOX_IMAGE@|$(hack/node/node.sh image-ref busybox)|" hack/demo/vmexport.yaml |
    "${kubectl[@]}" apply --server-side --field-manager=ucm-run -f -
  "${kubectl[@]}" -n default wait --for=jsonpath='{.status.phase}'=Succeeded pod/demo-disk-writer --timeout=120s ||
    { "${kubectl[@]}" -n default describe pod demo-disk-writer pvc demo-disk; exit 1; }
  "${kubectl[@]}" -n default wait --for=jsonpath='{.status.phase}'=Ready vmexport/demo-disk --timeout=120s ||
    { "${kubectl[@]}" -n default get vmexport demo-disk -o yaml; exit 1; }
  mkdir -p "$vdir"
  "${kubectl[@]}" -n default get vmexport demo-disk -o jsonpath='{.status.links.internal.cert}' >"$vdir/export-ca.crt"
  "${kubectl[@]}" -n default get secret "$("${kubectl[@]}" -n default get vmexport demo-disk -o jsonpath='{.status.tokenSecretRef}')" \
    -o jsonpath='{.data.token}' | base64 -d >"$vdir/export-token"
  local want got
  want=$("${kubectl[@]}" -n default logs demo-disk-writer | awk '{print $1}')
  got=$(eval "$(curl_cmd)" | md5sum | awk '{print $1}')
  [ "$got" = "$want" ] || { echo "the exported disk's md5 is $got, the writer wrote $want"; exit 1; }
}
# The curl that downloads the exported disk from this host, through the export Service's IP.
curl_cmd() {
  local url svc_host svc_ip
  url=$("${kubectl[@]}" -n default get vmexport demo-disk \
    -o jsonpath='{.status.links.internal.volumes[0].formats[?(@.format=="raw")].url}')
  svc_host=${url#https://}
  svc_host=${svc_host%%/*}
  svc_ip=$("${kubectl[@]}" -n default get service "${svc_host%%.*}" -o jsonpath='{.spec.clusterIP}')
  echo "curl -sSf --cacert $vdir/export-ca.crt --resolve $svc_host:443:$svc_ip -H \"x-kubevirt-export-token: \$(cat $vdir/export-token)\" $url"
}

# MiroirSnapshot: the DaemonSet pointed at a loopfile pool (as a user configures it), a volume
# file in that pool, and a snapshot the agent cuts without a barrier (one leg, no DRBD peer).
demo_snapshot() {
  "${kubectl[@]}" apply --server-side --field-manager=ucm-run -f hack/node/snapshot-pools.yaml
  "${kubectl[@]}" -n ucm-system patch daemonset/ucm-snapshot-agent --type=json \
    --patch-file hack/node/snapshot-pools.json
  "${kubectl[@]}" -n ucm-system rollout status daemonset/ucm-snapshot-agent --timeout=120s
  mkdir -p "$pool/volumes"
  head -c 16777216 /dev/urandom >"$pool/volumes/demo-vol.img"
  "${kubectl[@]}" apply --server-side --field-manager=ucm-run -f hack/demo/snapshot.yaml
  "${kubectl[@]}" patch miroirvolume demo-vol --subresource=status --type=merge -p \
    '{"status": {"formatted": true, "perNode": {"ucm-node": {"deviceCreated": true, "diskState": "UpToDate", "splitBrain": false}}}}'
  "${kubectl[@]}" wait --for=jsonpath='{.status.readyToUse}'=true miroirsnapshot/demo-snap --timeout=120s ||
    { "${kubectl[@]}" get miroirsnapshot demo-snap -o yaml; exit 1; }
  cmp "$pool/volumes/demo-vol.img" "$pool/snapshots/demo-snap.img" ||
    { echo "the agent's cut differs from the volume"; exit 1; }
}

# The jmp configs: the demo's tokens, the NodePort endpoint, the certificate as the CA.
demo_jmp_configs() {
  secret() { "${kubectl[@]}" -n "$1" get secret "$2" -o "jsonpath={.data.$3}" | base64 -d; }
  jmp_configs "$jdir" "$grpc_endpoint" "$(secret ucm-system ucm-exporter-grpc-tls 'tls\.crt')" \
    "$(secret default dev-client token)" "$(secret default demo-exporter token)"
}

stage "Demo: Jumpstarter Client dev and Exporter demo, jmp configs in $jdir" "a few seconds" \
  demo_jumpstarter
stage "Demo: VirtualMachineExport demo-disk of a 16 MiB disk, downloaded and checked" "about 15 s" \
  demo_vmexport
stage "Demo: MiroirSnapshot demo-snap of loopfile volume demo-vol, cut and compared" "about 15 s" \
  demo_snapshot
stage "jmp configs for this host" "a second" demo_jmp_configs

ip=$("${kubectl[@]}" -n ucm-system get pod -l app.kubernetes.io/component=manager \
  -o jsonpath='{.items[0].status.podIP}')
metrics_ip=$("${kubectl[@]}" -n ucm-system get service ucm-controller-manager-metrics -o jsonpath='{.spec.clusterIP}')
k="e2e/bin/kubectl"
cat <<TXT

ucm is running on node ucm-node, every demo object ready ($((SECONDS - t0))s). In another terminal:
  cd $root
  export KUBECONFIG=$kubeconfig

Jumpstarter (exporter feature). Client default/dev, Exporter default/demo (label board=demo):
  $k get clients,exporters,leases.jumpstarter.dev -o wide
Exporter demo shows Status empty and Message "Never seen" (condition Online=False) until an
exporter process connects with its token: Status is Available while \`jmp run\` runs, Offline
after it stops. \`jmp shell\` takes a Lease (Ended false), ended when the shell exits. From this
host (controller gRPC $grpc_endpoint and router $router_endpoint: NodePorts of hack/demo/node;
the configs in $jdir hold the tokens and the CA):
$(jmp_commands "$jdir" | sed 's/^/  /')
If jmp says "Exporter demo is unreachable", the client or the exporter cannot reach the router
the controller hands out: the manager's log names it ("dial: ... meet at router ...").

VirtualMachineExport demo-disk (vmexport feature) of PVC demo-disk, written by Pod demo-disk-writer:
  $k get vmexports,pvc,pods -n default
  $(curl_cmd) | md5sum
(the md5 the writer printed: $k logs demo-disk-writer)

MiroirSnapshot demo-snap (snapshot feature) of MiroirVolume demo-vol, a loopfile leg on this node,
cut by the ucm-snapshot-agent DaemonSet:
  $k get miroirvolumes,miroirsnapshots
  ls -ls $pool/volumes $pool/snapshots
(kubectl printed a PodSecurity warning for that DaemonSet while installing: it is privileged by
design, for filesystem freezes and DRBD/LVM/ZFS control; namespace ucm-system enforces
"privileged" and warns at "restricted". Logs of every step: .run/logs/.)

The manager (Deployment ucm-system/ucm-controller-manager), its probes and metrics:
  curl -s http://$ip:8081/readyz?verbose
  curl -s http://$metrics_ip:8080/metrics | grep ^ucm_        # e.g. ucm_build_info, reconcile counts
The Grafana dashboard: deploy/chart/ucm/dashboards/ucm.json (import it; it reads these metrics
through Prometheus); ServiceMonitors and alert rules for the Prometheus Operator: config/prometheus/.
Pod and Service IPs are routed from this host; names resolve in Pods (CoreDNS).

Following the manager's log (readable; the JSON lines in .run/manager.log.json). Ctrl-C stops
ucm, the node and the control plane.
TXT
: >.run/manager.log.json
# Every manager replica's log, followed again after a Pod is replaced (the JSON lines as logged).
(
  since=--tail=-1
  while :; do
    "${kubectl[@]}" -n ucm-system logs -f -l app.kubernetes.io/component=manager --prefix $since \
      --max-log-requests=10 || true
    since=--since=10s
    sleep 2
  done
) >>.run/manager.log.json 2>&1 &
follower=$!
tail -n 20 -f --pid="$follower" .run/manager.log.json | readable_log &
wait $!
