# Sourced by the storage lab's scripts inside a guest (busybox sh; tools by path where busybox
# has an applet of the same name). docs/snapshot.md, "Testing".
export LD_LIBRARY_PATH=/payload/lib

setup_vg() { # thin pool on the virtio disk; thin LVs are made per volume
  pvcreate -q /dev/vda && vgcreate -q vg0 /dev/vda && lvcreate -q -L 1536M -T vg0/pool
}

drbd_conf() { # RES MINOR PORT NODE:IP...  (DRBD 9 syntax, one volume, a full mesh)
  res=$1 minor=$2 port=$3; shift 3
  { echo "resource $res {"
    echo "  net { protocol C; }"
    echo "  volume 0 { device minor $minor; disk /dev/vg0/$res; meta-disk internal; }"
    id=0
    for nip in "$@"; do
      echo "  on ${nip%%:*} { node-id $id; address ${nip#*:}:$port; }"; id=$((id + 1))
    done
    printf '  connection-mesh { hosts'; for nip in "$@"; do printf ' %s' "${nip%%:*}"; done; echo '; }'
    echo "}"; } > "/etc/drbd.d/$res.res"
}

start_agent() { # NODE [extra args]
  node=$1; shift
  mkdir -p /etc/drbd.d
  setsid /payload/bin/ucm snapshot-agent --node-name="$node" --barrier=drbd \
    --pools=/payload/pools.yaml --kubeconfig=/payload/kubeconfig --namespace=default \
    --log-format=json --metrics-bind-address=0.0.0.0:8080 --health-probe-bind-address=0.0.0.0:8081 "$@" \
    </dev/null >>/tmp/agent.log 2>&1 &
  echo $! > /tmp/agent.pid
}

start_writer() { # MOUNTPOINT NAME
  setsid /payload/bin/writer "$1/records" "/tmp/acks-$2" 20 </dev/null >>"/tmp/writer-$2.log" 2>&1 &
  echo $! > "/tmp/writer-$2.pid"
}

hash_lv() { # LV BYTES
  /usr/bin/dd if="/dev/$1" bs=1M count=$(($2 / 1048576)) status=none | /usr/bin/sha256sum | cut -d' ' -f1
}

# check_snap SNAP BYTES [records]: activates the thin snapshot, hashes its first BYTES (the DRBD
# device's size: the rest is DRBD's own metadata, which differs per node), restores a volume
# from it with the lvmthin backend's restore commands and hashes that too, checks the file
# system read-only, optionally prints the writer's records from it, deactivates it.
check_snap() {
  lv=vg0/miroir-$1
  lvchange -q -ay -K "$lv" || return 1
  echo "hash=$(hash_lv "$lv" "$2")"
  lvcreate -q --snapshot --name "restore-$1" "$lv" && lvchange -q -ay --ignoreactivationskip "vg0/restore-$1" || return 1
  echo "restored=$(hash_lv "vg0/restore-$1" "$2")"
  lvremove -q -y "vg0/restore-$1" >/dev/null || return 1
  e2fsck -fn "/dev/$lv" >/tmp/fsck.out 2>&1; rc=$?
  echo "fsck=$rc"; [ $rc = 0 ] || cat /tmp/fsck.out
  if [ "$3" = records ]; then
    mkdir -p /mnt/check && mount -t ext4 -o ro,noload "/dev/$lv" /mnt/check && {
      echo "records-begin"; cat /mnt/check/records; echo "records-end"; umount /mnt/check; }
  fi
  lvchange -q -an "$lv"
}

# check_loop_snap SNAP: the loopfile backend's snapshot of vol3 (BASE/snapshots/SNAP.img on the
# XFS pool): its extent map (shared extents: a reflink, not a copy), its hash and that of a
# reflink copy (what the backend's restore makes). The copy is mounted (XFS replays the log a
# crash-consistent cut leaves) to print the writer's records, then checked with xfs_repair -n.
check_loop_snap() {
  f=/mnt/xfspool/snapshots/$1.img r=/mnt/xfspool/restore-$1.img
  [ -f "$f" ] || { echo "no snapshot file $f"; return 1; }
  echo "fiemap-begin"; xfs_io -r -c "fiemap -v" "$f"; echo "fiemap-end"
  echo "hash=$(/usr/bin/sha256sum < "$f" | cut -d' ' -f1)"
  /usr/bin/cp --reflink=always "$f" "$r" || return 1
  echo "restored=$(/usr/bin/sha256sum < "$r" | cut -d' ' -f1)"
  dev=$(/usr/sbin/losetup -f --show "$r") || return 1
  mkdir -p /mnt/check && mount -t xfs -o nouuid "$dev" /mnt/check || { /usr/sbin/losetup -d "$dev"; return 1; }
  echo "records-begin"; cat /mnt/check/records; echo "records-end"
  umount /mnt/check
  xfs_repair -n "$dev" >/tmp/fsck.out 2>&1; rc=$?
  echo "fsck=$rc"; [ $rc = 0 ] || cat /tmp/fsck.out
  /usr/sbin/losetup -d "$dev"; rm -f "$r"
}
