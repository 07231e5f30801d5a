#!/usr/bin/env bash
# A real node for the local control plane (docs/operations.md, "A real local node"):
# `hack/node/node.sh up|down|status`.
#
# up:   a control plane of its own (kharness serve --with-kcm, plus a second `kharness kcm` with the
#       workload controllers and kube-scheduler), and one node: containerd 1.6 + runc + kubelet
#       and kube-proxy v1.37.2 in a network namespace of their own, Pods on a bridge CNI, the ucm
#       image (`make image`) and the node's images (`hack/build/image.sh node`) imported from OCI
#       archives, then the add-ons (hack/node/addons.yaml): CoreDNS and the local-path
#       provisioner with the default StorageClass. Prints the kubeconfig.
# down: stops all of it and restores what kubelet changed; leaves no process, mount, network
#       namespace, cgroup or changed sysctl (hack/node/check.sh checks that).
#
# Needs root (network namespace, cgroups, mounts); one node per machine. Host side: one veth
# (UCM_NODE_NAME-h, 10.213.0.1/30) so the API server reaches kubelet on the node's InternalIP,
# with routes to the Pod and Service CIDRs over it; no other address, route or firewall rule.
# The node reaches the API server (host loopback) through `kharness forward`; Pods reach it at
# the `kubernetes` Service IP through one DNAT rule in the node's namespace (kharness publishes
# no endpoints for it); kube-proxy (iptables) routes every other Service, from Pods and from the
# host. Tested on a hybrid cgroup v1 host (Debian 12).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
name=${UCM_NODE_NAME:-ucm-node}
state=${UCM_NODE_DIR:-$root/.run/node}
image=${UCM_IMAGE_ARCHIVE:-${CARGO_TARGET_DIR:-$root/target}/ucm-image.oci.tar}
images=${UCM_CACHE:-$HOME/.cache/ucm}/image # hack/build/image.sh node
node_images=(pause coredns local-path busybox)
bin=$root/e2e/bin
netns=/run/netns/$name
# Kubelet's root directory stays the default: the snapshot agent's DaemonSet mounts
# /var/lib/kubelet/pods, and kubelet's device-plugin directory there is not configurable anyway.
kubelet_dir=/var/lib/kubelet
mark=.ucm-node # in kubelet_dir while this node owns it
# Where the local-path provisioner puts PersistentVolumes (a hostPath its helper Pods mount).
volume_dir=/var/lib/ucm-node-volumes
# Host paths the node may create: kubelet (its root, and the /var/log/containers links, which
# are not configurable); containerd 1.6's shim sockets (/run/containerd/s, not configurable)
# and libcni's result cache (/var/lib/cni), both left behind by containers that are killed
# rather than stopped through CRI; DirectoryOrCreate hostPath volumes of the shipped
# DaemonSets; ip netns. Those absent at `up` are removed at `down`.
created_paths=(/var/lib/kubelet /var/log/containers /run/containerd /var/lib/cni /run/netns /run/lvm
  /run/lock /var/lib/drbd /run/ucm-snapshot-agent /var/lib/miroir "$volume_dir")
host_ip=10.213.0.1
node_ip=10.213.0.2
pod_cidr=10.244.0.0/24
service_cidr=10.0.0.0/24 # kharness's --service-cluster-ip-range
service_ip=10.0.0.1       # its first address: the `kubernetes` Service
dns_ip=10.0.0.10          # the kube-dns Service (CoreDNS), kubelet's clusterDNS
pause_ref=localhost/ucm-pause:1 # as hack/build/image.sh node names it
# What kubelet's setupKernelTunables changes on the host (pkg/kubelet/cm/container_manager_linux.go).
sysctls=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
  kernel.keys.root_maxkeys kernel.keys.root_maxbytes)
kubectl=("$bin/kubectl" --kubeconfig "$state/cluster/kubeconfig")

say() { echo "node: $*" >&2; }
die() {
  say "$*"
  exit 1
}
# Every cgroup hierarchy: on a v1 or hybrid host the mounts under /sys/fs/cgroup (v1
# controllers and the v2 "unified" one); on a v2-only host /sys/fs/cgroup itself.
hierarchies() {
  if [ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ]; then
    echo /sys/fs/cgroup
  else
    find /sys/fs/cgroup -mindepth 1 -maxdepth 1 -type d
  fi
}
# The v2 hierarchy when the host is hybrid (v1 controllers + unified), or the v2 root.
tracking() { if [ -d /sys/fs/cgroup/unified ]; then echo /sys/fs/cgroup/unified; else echo /sys/fs/cgroup; fi; }

# start NAME [--netns] CMD...: a daemon in the node's tracking cgroup (so `down` finds every
# process it and its children start, shims and containers included), its own session, logs
# under $state/logs.
start() {
  local n=$1
  shift
  local wrap=()
  if [ "$1" = --netns ]; then
    wrap=(nsenter "--net=$netns" --)
    shift
  fi
  (
    echo "$BASHPID" >"$(tracking)/$name/sys/cgroup.procs"
    exec setsid "${wrap[@]}" "$@" </dev/null >>"$state/logs/$n.log" 2>&1
  ) &
  echo $! >"$state/pids/$n"
}

alive() { [ -f "$state/pids/$1" ] && kill -0 "$(cat "$state/pids/$1")" 2>/dev/null; }

wait_for() { # SECONDS WHAT CMD...
  local t=$1 what=$2
  shift 2
  local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < end)) || die "$what did not come up within ${t}s; logs: $state/logs/"
    sleep 0.2
  done
}

write_configs() {
  local port=$1
  mkdir -p "$state/cni/net.d" "$state/containerd"
  # host-local keeps its leases under $state, not /var/lib/cni.
  cat >"$state/cni/net.d/10-ucm.conflist" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "ucm-pods",
  "plugins": [
    {
      "type": "bridge", "bridge": "cni0", "isGateway": true, "isDefaultGateway": true,
      "ipMasq": false, "hairpinMode": true,
      "ipam": {"type": "host-local", "ranges": [[{"subnet": "$pod_cidr"}]], "dataDir": "$state/cni/ipam"}
    }
  ]
}
JSON
  # restrict_oom_score_adj: the VM lacks CAP_SYS_RESOURCE, so runc cannot lower a container's
  # oom_score_adj below its own and every sandbox fails without it. Pod network namespaces are
  # mounted under the state directory, so `down` finds them with every other mount.
  cat >"$state/containerd.toml" <<TOML
version = 2
root = "$state/containerd/root"
state = "$state/containerd/state"
[grpc]
  address = "$state/containerd.sock"
[ttrpc]
  address = "$state/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$state/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$pause_ref"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        Root = "$state/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$state/cni/net.d"
TOML
  # failCgroupV1: false, as this host has the hybrid v1 layout. cgroupRoot: every Pod cgroup
  # lives under /$name, which `down` removes. Kubelet's port is reachable from the host only (the
  # veth); the API server calls it anonymously (kharness has no kubelet client certificate).
  cat >"$state/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /$name
containerRuntimeEndpoint: unix://$state/containerd.sock
address: $node_ip
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
failSwapOn: false
podCIDR: $pod_cidr
resolvConf: /etc/resolv.conf
clusterDNS: [$dns_ip]
clusterDomain: cluster.local
podLogsDir: $state/pod-logs
serializeImagePulls: false
imageGCHighThresholdPercent: 100
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
YAML
  # masqueradeAll: Pods share one bridge, and without br_netfilter a reply from a Service's
  # endpoint to a Pod on the same bridge would bypass the node's conntrack; masquerading sends it
  # back through the node. Zero conntrack and OOM settings: kube-proxy leaves the host's global
  # sysctls and its own score alone (the VM has no CAP_SYS_RESOURCE either).
  cat >"$state/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $state/cluster/kubeconfig}
hostnameOverride: $name
mode: iptables
clusterCIDR: $pod_cidr
nodePortAddresses: [primary]
iptables: {masqueradeAll: true}
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
oomScoreAdj: 0
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
YAML
}

# The add-ons' manifest with this node's values.
addons() {
  sed -e "s|@COREDNS_IMAGE@|$(image_ref coredns)|" -e "s|@LOCALPATH_IMAGE@|$(image_ref local-path)|" \
    -e "s|@BUSYBOX_IMAGE@|$(image_ref busybox)|g" -e "s|@DNS_IP@|$dns_ip|" -e "s|@VOLUME_DIR@|$volume_dir|" \
    hack/node/addons.yaml
}
# The name an image archive of hack/build/image.sh carries (and `ctr images import` gives it).
image_ref() { tar -xOf "$images/$1.oci.tar" index.json | jq -r '.manifests[0].annotations["org.opencontainers.image.ref.name"]'; }

up() {
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespace, cgroups, mounts); use 'make run LOCAL=1' (no node)"
  hack/build/host-deps.sh node
  for b in kharness kubectl kubelet kube-scheduler kube-proxy pause coredns local-path-provisioner; do
    [ -x "$bin/$b" ] || die "missing $bin/$b: run 'make node' (it builds them)"
  done
  [ -f "$image" ] || die "missing $image: run 'make image'"
  for p in "${node_images[@]}"; do
    [ -f "$images/$p.oci.tar" ] || die "missing $images/$p.oci.tar: run 'make node' (it builds it)"
  done
  if alive kubelet; then
    say "already up: export KUBECONFIG=$state/cluster/kubeconfig"
    return
  fi
  # A node an interrupted run (or another checkout) left behind: its namespace, or kubelet's
  # directory with our mark. Nothing else on the machine uses either, so take it down first.
  if [ -e "$netns" ] || [ -e "$kubelet_dir/$mark" ]; then
    say "a node left by an interrupted run is still here ($netns, $kubelet_dir): taking it down first"
    down
    if [ -e "$kubelet_dir/$mark" ]; then
      find "$kubelet_dir" -xdev -mindepth 1 -delete
    fi
  fi
  if [ -n "$(ls -A "$kubelet_dir" 2>/dev/null)" ]; then
    die "$kubelet_dir is not empty: another kubelet uses this machine (or run '$0 down')"
  fi
  local t0=$SECONDS p
  # A failed start takes down what it started (the logs stay in $state.logs).
  trap 'rc=$?; trap - EXIT; if [ $rc -ne 0 ]; then say "up failed, cleaning up"; down; exit $rc; fi' EXIT
  mkdir -p "$state/pids" "$state/logs"
  for p in "${created_paths[@]}"; do [ -e "$p" ] || echo "$p"; done >"$state/created"
  mkdir -p "$kubelet_dir" && touch "$kubelet_dir/$mark"
  # ip netns makes /run/netns a shared bind mount of itself the first time.
  mountpoint -q /run/netns || echo /run/netns >"$state/netns-mount"
  # Saved once, before anything changes them; `down` restores and then deletes this file.
  [ -f "$state/sysctl.saved" ] || for s in "${sysctls[@]}"; do echo "$s=$(sysctl -n "$s")"; done >"$state/sysctl.saved"

  # cgroups: /$name in every hierarchy (kubelet requires its cgroupRoot to exist), and
  # /$name/sys in the v2 one for the daemons. v1 cpuset children start empty: copy the parent's.
  local h
  for h in $(hierarchies); do
    mkdir -p "$h/$name"
    if [ -f "$h/cpuset.cpus" ]; then
      cat "$h/cpuset.cpus" >"$h/$name/cpuset.cpus"
      cat "$h/cpuset.mems" >"$h/$name/cpuset.mems"
    fi
  done
  mkdir -p "$(tracking)/$name/sys"

  # The node's network: its own namespace, a veth to the host, loopback up.
  ip netns add "$name"
  ip link add "$name-h" type veth peer name eth0 netns "$name"
  ip addr add "$host_ip/30" dev "$name-h"
  ip link set "$name-h" up
  # Pod IPs are reachable from the host (curl a Pod's probe or metrics port); the route goes
  # with the link.
  ip route add "$pod_cidr" via "$node_ip" dev "$name-h"
  ip route add "$service_cidr" via "$node_ip" dev "$name-h"
  ip -n "$name" addr add "$node_ip/30" dev eth0
  ip -n "$name" link set eth0 up
  ip -n "$name" link set lo up
  # The node has no default route (nothing leaves it), so its own processes (kubelet's probes, a
  # peer run in the namespace) get one for the Service CIDR: kube-proxy's OUTPUT rules then
  # rewrite the Service IP to an endpoint.
  ip -n "$name" route add "$service_cidr" dev eth0

  # Control plane on the host's loopback, as `make run` and the e2e suite have it.
  start apiserver "$bin/kharness" serve --dir "$state/cluster" --with-kcm \
    -- --kubelet-preferred-address-types=InternalIP
  wait_for 180 "the API server" test -s "$state/cluster/kubeconfig"
  wait_for 60 "the API server" "${kubectl[@]}" get --raw /readyz
  local port
  port=$(jq -r .apiserver "$state/cluster/ports.json")
  # The workload and volume controllers kharness's own KCM leaves out (tests patch those
  # statuses by hand). The PV binder hands claims to the local-path provisioner; the protection
  # controllers release a deleted claim or volume once nothing uses it.
  start kcm-workloads "$bin/kharness" kcm --kubeconfig "$state/cluster/kubeconfig" \
    --controllers=deployment-controller,replicaset-controller,daemonset-controller,statefulset-controller,job-controller,endpointslice-controller,endpoints-controller,pod-garbage-collector-controller,ttl-after-finished-controller,disruption-controller,node-lifecycle-controller,persistentvolume-binder-controller,persistentvolumeclaim-protection-controller,persistentvolume-protection-controller
  start scheduler "$bin/kube-scheduler" --kubeconfig "$state/cluster/kubeconfig" --leader-elect=false --secure-port=0
  # Inside the node: the API server at the same address as on the host (so kubelet uses the
  # admin kubeconfig unchanged, and the certificate's 127.0.0.1 SAN holds), and at the node
  # address for Pods, whose `kubernetes` Service IP is DNATed to it (the certificate's SANs
  # include that Service IP).
  start forward "$bin/kharness" forward --netns "$netns" \
    --listen "127.0.0.1:$port,$node_ip:$port" --to "127.0.0.1:$port"
  nsenter "--net=$netns" -- iptables -t nat -A PREROUTING -d "$service_ip/32" -p tcp --dport 443 \
    -j DNAT --to-destination "$node_ip:$port"
  nsenter "--net=$netns" -- sysctl -qw net.ipv4.ip_forward=1 # per namespace

  write_configs "$port"
  start containerd --netns containerd --config "$state/containerd.toml"
  local ctr=(ctr --address "$state/containerd.sock" --namespace k8s.io)
  wait_for 30 containerd "${ctr[@]}" version
  "${ctr[@]}" images import "$image" >/dev/null
  for p in "${node_images[@]}"; do "${ctr[@]}" images import "$images/$p.oci.tar" >/dev/null; done
  start kubelet --netns "$bin/kubelet" --config "$state/kubelet.yaml" \
    --kubeconfig "$state/cluster/kubeconfig" --root-dir "$kubelet_dir" --cert-dir "$state/kubelet-pki" \
    --node-ip "$node_ip" --hostname-override "$name"
  wait_for 120 "node $name" "${kubectl[@]}" get node "$name"
  "${kubectl[@]}" wait --for=condition=Ready "node/$name" --timeout=120s >/dev/null ||
    die "node $name is not Ready; logs: $state/logs/kubelet.log"
  start kube-proxy --netns "$bin/kube-proxy" --config "$state/kube-proxy.yaml"
  addons | "${kubectl[@]}" apply --server-side --field-manager=ucm-node -f - >/dev/null
  "${kubectl[@]}" -n kube-system rollout status deployment/coredns --timeout=120s >/dev/null ||
    die "CoreDNS is not available; $("${kubectl[@]}" -n kube-system get pods -o wide 2>&1)"
  "${kubectl[@]}" -n local-path-storage rollout status deployment/local-path-provisioner --timeout=120s >/dev/null ||
    die "the local-path provisioner is not available; $("${kubectl[@]}" -n local-path-storage get pods -o wide 2>&1)"
  trap - EXIT
  say "node $name Ready after $((SECONDS - t0))s; export KUBECONFIG=$state/cluster/kubeconfig"
}

# stop SECONDS NAME...: SIGTERM to each, SIGKILL to those still running after SECONDS.
stop() {
  local t=$1 n pids=()
  shift
  for n in "$@"; do
    [ -f "$state/pids/$n" ] || continue
    pids+=("$(cat "$state/pids/$n")")
    rm -f "$state/pids/$n"
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  local end=$((SECONDS + t)) p left
  while ((SECONDS < end)); do
    left=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
    [ $left = 1 ] || break
    sleep 0.1
  done
  kill -KILL "${pids[@]}" 2>/dev/null || true
}

# Every process in /$name of any hierarchy: the daemons and everything they started.
members() {
  local h
  for h in $(hierarchies); do
    if [ -d "$h/$name" ]; then find "$h/$name" -name cgroup.procs -exec cat {} + 2>/dev/null || true; fi
  done | sort -un
}

down() {
  [ "$(id -u)" -eq 0 ] || die "needs root"
  [ -d "$state" ] || [ -e "$netns" ] || { say "not up"; return 0; }
  local t0=$SECONDS
  # Kubelet first, so it does not restart what is stopped next; then the runtime and the
  # control plane. Shims and containers are not children of containerd: killed by cgroup.
  stop 15 kubelet kube-proxy
  stop 10 containerd
  # The control plane shuts down gracefully (in parallel) while shims and containers are killed.
  local graceful pids p tries=0
  graceful=" $(cat "$state"/pids/* 2>/dev/null | tr '\n' ' ' || true) "
  stop 40 forward scheduler kcm-workloads apiserver &
  local cp=$!
  while pids=$(members) && [ -n "$pids" ]; do
    for p in $pids; do
      case $graceful in *" $p "*) continue ;; esac
      kill -KILL "$p" 2>/dev/null || true
    done
    ((++tries < 500)) || die "processes still in cgroup /$name: $pids"
    sleep 0.1
  done
  wait "$cp"
  # Mounts: kubelet's root dir (it bind-mounts it rshared), its volumes, Pod network
  # namespaces (under containerd's state dir), overlay root file systems. Deepest first.
  local m
  for m in $(awk -v s="$state/" -v k="$kubelet_dir" \
    'index($5, s) == 1 || $5 == k || index($5, k "/") == 1 {print $5}' /proc/self/mountinfo | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m"
  done
  say "processes stopped, mounts gone after $((SECONDS - t0))s"
  [ -e "$netns" ] && ip netns delete "$name" # takes the veth pair and the DNAT rule with it
  if [ -f "$state/netns-mount" ] && [ -z "$(ls -A /run/netns)" ]; then umount /run/netns; fi
  local h
  for h in $(hierarchies); do
    [ -d "$h/$name" ] && find "$h/$name" -depth -type d -exec rmdir {} +
  done
  if [ -f "$state/sysctl.saved" ]; then
    sysctl -q -p "$state/sysctl.saved" >/dev/null
    rm -f "$state/sysctl.saved"
  fi
  if [ -f "$state/created" ]; then
    while read -r p; do
      if [ "$p" = /run/netns ]; then rmdir "$p" 2>/dev/null || true; else rm -rf --one-file-system "$p"; fi
    done <"$state/created"
  fi
  # Keep the logs for a post-mortem; everything else goes.
  if [ -d "$state" ]; then
    rm -rf "$state.logs" && mv "$state/logs" "$state.logs" 2>/dev/null || true
    rm -rf --one-file-system "$state"
  fi
  say "down after $((SECONDS - t0))s (logs kept in $state.logs)"
}

status() {
  local n
  for n in apiserver kcm-workloads scheduler forward containerd kubelet kube-proxy; do
    if alive "$n"; then echo "$n: running (pid $(cat "$state/pids/$n"))"; else echo "$n: stopped"; fi
  done
  alive apiserver && "${kubectl[@]}" get nodes -o wide
  return 0
}

case ${1:-} in
up) up ;;
down) down ;;
status) status ;;
image-ref) image_ref "$2" ;;
*)
  echo "usage: $0 up|down|status|image-ref NAME" >&2
  exit 2
  ;;
esac
