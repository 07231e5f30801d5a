#!/usr/bin/env bash
# The storage lab (docs/snapshot.md, "Testing"): two QEMU guests booting Debian's cloud kernel
# with real DRBD 9.3.3, LVM thin and ext4, each running the shipped `ucm snapshot-agent` as a
# storage node against the local control plane on the host, where `ucm manager` runs with only
# the snapshot feature. MiroirSnapshots are created through the API while a writer appends
# fsync'ed records, and every Ready snapshot is checked as a user would (verify.py).
#
#   lab.sh --ci            one replicated and one unreplicated round (run by `make test`)
#   lab.sh [--rounds N]    the whole lab: N rounds (default 20) with pause figures, the bare
#                          sequence without ucm in the same guests, and the failure paths
#
# Guests reach the host only at 10.0.2.2 (QEMU user networking; the host's loopback; no default
# route) and each other over a QEMU socket link on 127.0.0.1. Needs root and $UCM (built).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
. "$here/config.sh"
. "$root/hack/lib/controlplane.sh"
. "$here/host-lib.sh"

mode=full rounds=20
while (($#)); do
  case $1 in
    --ci) mode=ci; shift ;;
    --rounds) rounds=$2; shift 2 ;;
    *) echo "usage: lab.sh [--ci] [--rounds N]" >&2; exit 2 ;;
  esac
done
UCM=${UCM:-${CARGO_TARGET_DIR:-$root/target}/debug/ucm}
KUBECTL=$root/e2e/bin/kubectl
start=$(date +%s)
log() { echo "storage-lab [$(($(date +%s) - start))s]: $*" >&2; }
# result SCENARIO TEXT: one line of the per-scenario results printed at the end (and logged now).
result() { log "RESULT $1: $2"; printf '%-22s %s\n' "$1" "$2" >>"${work:-/tmp}/summary"; }
die() { echo "storage-lab: FAILED: $*" >&2; exit 1; }
[[ -x $UCM ]] || die "no ucm binary at $UCM (cargo build first)"
[[ -x $root/e2e/bin/kharness && -x $KUBECTL ]] || die "no e2e/bin/kharness or kubectl (make cluster)"
command -v python3 >/dev/null || die "python3 missing"

eval "$("$here/prepare.sh")"
work=$(mktemp -d /tmp/storage-lab-XXXXXX)
guests=()
cleanup() {
  local rc=$?
  if [[ -s $work/summary ]]; then
    echo "storage-lab: per-scenario results ($( ((rc == 0)) && echo passed || echo 'FAILED at the last') ; load: $(cut -d' ' -f1-3 /proc/loadavg)):" >&2
    sed 's/^/  /' "$work/summary" >&2
  fi
  for pid in "${qemu_pids[@]:-}"; do [[ -n $pid ]] && kill -9 "$pid" 2>/dev/null || true; done
  for pid in "${qemu_pids[@]:-}"; do [[ -n $pid ]] && wait "$pid" 2>/dev/null || true; done
  [[ -n ${manager_pid:-} ]] && kill "$manager_pid" 2>/dev/null || true
  if ((rc != 0)); then
    log "failed; logs kept in $work (console-*.log, manager.log, agent-*.log)"
    for g in "${guests[@]}"; do tail -n 15 "$work/console-$g.log" 2>/dev/null | sed "s/^/[$g console] /" >&2; done
  else
    rm -rf "$work"
  fi
  controlplane_down 2>/dev/null || true
}
qemu_pids=()

# --- The payload disk: ucm (the shipped binary, debug info stripped) with its libraries, the
# writer, the agent's pools file and kubeconfig. ---
pay=$work/payload
mkdir -p "$pay/bin" "$pay/lib"
objcopy --strip-debug "$UCM" "$pay/bin/ucm"
ldd "$UCM" | awk '/=>/{print $3}' | while read -r l; do if [[ -f $l ]]; then cp -L "$l" "$pay/lib/"; fi; done
gcc -static -O2 -o "$pay/bin/writer" "$here/writer.c" || die "gcc -static writer.c (libc6-dev)"
cp "$here/guest-lib.sh" "$pay/bin/"
cat > "$pay/pools.yaml" <<'P'
pools:
  default: {backend: lvmthin, volumeGroup: vg0}
P
# The whole lab adds a loopfile pool on an XFS (reflink=1) thin LV on lab-a (vol3).
[[ $mode == full ]] && echo "  loop: {backend: loopfile, base: /mnt/xfspool}" >>"$pay/pools.yaml"

# --- Control plane on the host; the guests' kubeconfig points at 10.0.2.2. ---
controlplane_up storage-lab
# After controlplane_up, whose own EXIT trap this replaces (cleanup calls controlplane_down).
trap cleanup EXIT
trap "exit 130" INT TERM
kc=$UCM_E2E_KUBECONFIG
k() { "$KUBECTL" --kubeconfig "$kc" "$@"; }
api_port=$(k config view --minify -o jsonpath='{.clusters[0].cluster.server}' | sed 's/.*://')
k config view --raw --minify --flatten > "$pay/kubeconfig"
cluster=$(k config view --minify -o jsonpath='{.clusters[0].name}')
"$KUBECTL" --kubeconfig "$pay/kubeconfig" config set-cluster "$cluster" \
  --server="https://10.0.2.2:$api_port" --tls-server-name=kubernetes >/dev/null
k apply -f "$root/crds" >/dev/null

payimg=$work/payload.img
mb=$(( $(du -sm "$pay" | cut -f1) + 32 ))
truncate -s "${mb}M" "$payimg"
mke2fs -q -F -t ext4 -d "$pay" "$payimg" || die "mke2fs -d payload"

# --- Accelerator: KVM when it boots the guest kernel, TCG otherwise (probed once per host). ---
accel_file=$SL_CACHE/accel-$(uname -r)-$SL_KVER
if [[ ! -f $accel_file ]]; then
  accel=tcg,tb-size=64
  if [[ -r /dev/kvm ]]; then
    boot probe 192.168.99.1 84 kvm 256
    if wait_ready probe 40; then accel=kvm; fi
    kill "$pid_probe" 2>/dev/null || true; wait "$pid_probe" 2>/dev/null || true
    guests=(); qemu_pids=()
  fi
  echo "$accel" > "$accel_file"
fi
accel=$(cat "$accel_file")
log "accelerator: $accel ($( [[ $accel == kvm ]] && echo 'KVM boots the guest kernel' || echo 'software emulation: /dev/kvm does not boot the guest kernel here' ))"

link=$(( 40000 + RANDOM % 20000 ))
boot lab-a 192.168.100.1 9 "$accel" 384 -netdev "socket,id=p,listen=127.0.0.1:$link" -device virtio-net-pci,netdev=p
sleep 0.5
boot lab-b 192.168.100.2 9 "$accel" 384 -netdev "socket,id=p,connect=127.0.0.1:$link" -device virtio-net-pci,netdev=p
for g in lab-a lab-b; do wait_ready "$g" 180 || die "guest $g did not boot"; done
# The guests' clocks from the host's, as NTP would keep a node's: the manager compares the
# agents' heartbeat stamps with its own clock (docs/snapshot.md, "Deadline, void and recovery").
sync_clock() { # GUEST: sets it, prints the skew it had (guest - host, seconds)
  local h g; h=$(date +%s.%N); g=$(rpc "$1" "/usr/bin/date +%s.%N; /usr/bin/date -s @$(date +%s.%N) >/dev/null") || return 1
  python3 -c "print(round($g - $h, 3))"
}
for g in lab-a lab-b; do log "clock of $g was $(sync_clock "$g") s off the host's; set"; done
log "guests lab-a and lab-b up ($(grep -aho 'version: [0-9.]*' "$work/console-lab-a.log" | head -1 | sed 's/version/DRBD/'))"

# --- Storage in the guests: VG vg0 with a thin pool; vol1 = thin LV under DRBD resource vol1 on
# both guests (Primary + ext4 on lab-a); vol2 = an unreplicated thin LV with ext4 on lab-a. ---
for g in lab-a lab-b; do
  rpc "$g" ". guest-lib.sh; setup_vg && lvcreate -q -V 128M -T vg0/pool -n vol1 && mkdir -p /etc/drbd.d &&
       echo 'include \"/etc/drbd.d/*.res\";' > /etc/drbd.conf &&
       drbd_conf vol1 0 7789 lab-a:192.168.100.1 lab-b:192.168.100.2 &&
       drbdadm create-md --force vol1 >/dev/null && drbdadm up vol1" >"$work/setup-$g.log" 2>&1 \
    || { cat "$work/setup-$g.log" >&2; die "storage setup in $g"; }
done
for i in $(seq 120); do
  rpc lab-a "drbdsetup events2 --now vol1" 2>/dev/null | grep -q 'connection .*connection:Connected' && break
  ((i == 120)) && die "DRBD vol1 did not connect: $(rpc lab-a 'drbdsetup status vol1')"
  sleep 1
done
rpc lab-a ". guest-lib.sh; drbdadm new-current-uuid --clear-bitmap vol1/0 && drbdadm primary vol1 &&
  mkfs.ext4 -q /dev/drbd0 && mkdir -p /mnt/vol1 && mount /dev/drbd0 /mnt/vol1 &&
  lvcreate -q -V 64M -T vg0/pool -n vol2 && mkfs.ext4 -q /dev/vg0/vol2 && mkdir -p /mnt/vol2 && mount /dev/vg0/vol2 /mnt/vol2" \
  >"$work/setup-primary.log" 2>&1 || { cat "$work/setup-primary.log" >&2; die "Primary setup"; }
# vol3 (whole lab): the loopfile pool is an XFS with reflink on a thin LV; the volume is the
# file volumes/vol3.img on it, loop-attached, with XFS of its own (mkfs.xfs's minimum: 300 MB).
if [[ $mode == full ]]; then
  rpc lab-a ". guest-lib.sh; lvcreate -q -V 1G -T vg0/pool -n xfspool && mkfs.xfs -q -m reflink=1 /dev/vg0/xfspool &&
    mkdir -p /mnt/xfspool && mount /dev/vg0/xfspool /mnt/xfspool && mkdir -p /mnt/xfspool/volumes /mnt/xfspool/snapshots &&
    truncate -s 320M /mnt/xfspool/volumes/vol3.img && losetup /dev/loop0 /mnt/xfspool/volumes/vol3.img &&
    mkfs.xfs -q /dev/loop0 && mkdir -p /mnt/vol3 && mount /dev/loop0 /mnt/vol3" \
    >"$work/setup-xfs.log" 2>&1 || { cat "$work/setup-xfs.log" >&2; die "loopfile-on-XFS setup"; }
  log "vol3: loopfile volume (XFS) in an XFS pool with reflink=1 on lab-a"
fi
drbd_bytes=$(rpc lab-a "blockdev --getsize64 /dev/drbd0")
drbd_version=$(rpc lab-a "head -1 /proc/drbd")
log "DRBD $drbd_version: vol1 Primary on lab-a ($drbd_bytes bytes, ext4), vol2 unreplicated lvmthin (ext4)"

# --- ucm: agents in the guests, the manager on the host (snapshot feature only). ---
for g in lab-a lab-b; do rpc "$g" ". guest-lib.sh; start_agent $g" >/dev/null || die "agent start in $g"; done
# The manager's two ports, below the kernel's ephemeral range: a port inside it can meanwhile
# be the local end of any outgoing connection on the host, and the manager's bind then fails
# (it did once: EADDRINUSE on the health port, and the lab waited for rounds nobody ran).
ephemeral=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range)
mport=$(( 10000 + RANDOM % (ephemeral - 10002) ))
flags=()
for f in exporter snapshot vmexport; do flags+=("--enable-$f=$([[ $f == snapshot ]] && echo true || echo false)"); done
start_manager() { # appends to manager.log; a restart after a SIGKILL continues from status
  "$UCM" manager --kubeconfig="$kc" --namespace=default "${flags[@]}" --log-format=json \
    --metrics-bind-address="127.0.0.1:$mport" --health-probe-bind-address="127.0.0.1:$((mport + 1))" \
    >>"$work/manager.log" 2>&1 &
  manager_pid=$!
  # Ready (its caches synced) before anything is asked of it; a manager that exited fails here.
  local i
  for i in $(seq 120); do
    curl -sf --max-time 2 "http://127.0.0.1:$((mport + 1))/readyz" >/dev/null && return 0
    kill -0 "$manager_pid" 2>/dev/null || die "the manager exited: $(tail -3 "$work/manager.log")"
    sleep 0.5
  done
  die "the manager was not ready 60 s after its start: $(tail -3 "$work/manager.log")"
}
start_manager

volume() { # NAME NODE...   (BACKEND/POOL from the environment: lvmthin in the default pool)
  local name=$1; shift
  local reps="" per=""
  for n in "$@"; do
    reps+="${reps:+,}{\"node\":\"$n\",\"backend\":\"${BACKEND:-lvmthin}\"${POOL:+,\"pool\":\"$POOL\"}}"
    per+="${per:+,}\"$n\":{\"deviceCreated\":true,\"diskState\":\"UpToDate\",\"splitBrain\":false}"
  done
  echo "{\"apiVersion\":\"miroir.home-operations.com/v1alpha1\",\"kind\":\"MiroirVolume\",\"metadata\":{\"name\":\"$name\"},
        \"spec\":{\"sizeBytes\":${SIZE:-134217728},\"replicas\":[$reps],\"drbd\":{\"port\":7789}}}" | k create -f - >/dev/null
  k patch miroirvolume "$name" --subresource=status --type=merge \
    -p "{\"status\":{\"formatted\":true,\"perNode\":{$per}}}" >/dev/null
}
volume vol1 lab-a lab-b
volume vol2 lab-a
rpc lab-a ". guest-lib.sh; start_writer /mnt/vol1 vol1; start_writer /mnt/vol2 vol2" >/dev/null || die "writer start"
if [[ $mode == full ]]; then
  BACKEND=loopfile POOL=loop SIZE=335544320 volume vol3 lab-a
  rpc lab-a ". guest-lib.sh; start_writer /mnt/vol3 vol3" >/dev/null || die "writer start (vol3)"
fi

# Wait for both agents' heartbeats (their Leases) before the first round.
for i in $(seq 120); do
  n=$(k get leases -n default -o name 2>/dev/null | grep -c 'lab-' || true)
  ((n >= 2)) && break
  ((i == 120)) && { rpc lab-a "tail -20 /tmp/agent.log" >&2; die "the agents did not come up"; }
  sleep 1
done
log "agents alive on lab-a and lab-b; manager on the host"

. "$here/rounds.sh"
