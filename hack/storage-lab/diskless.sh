# Sourced by full.sh: a diskless Primary (docs/snapshot.md, "Special legs" 3). vol4 is a thin LV
# under DRBD resource vol4 on lab-a, its only diskful leg; lab-b attaches it diskless, is its
# Primary and holds its ext4 and writer. A round must suspend the writer's node too: lab-b's
# agent joins with a slot of its own (freeze, suspend-io, Suspended) and lab-a cuts only once it
# has (I2), so the snapshot on lab-a holds every record lab-b acknowledged before its freeze.
log "diskless Primary: vol4, diskful on lab-a, attached diskless and Primary on lab-b"
res4="resource vol4 {
  net { protocol C; }
  on lab-a { node-id 0; address 192.168.100.1:7790; volume 0 { device minor 1; disk /dev/vg0/vol4; meta-disk internal; } }
  on lab-b { node-id 1; address 192.168.100.2:7790; volume 0 { device minor 1; disk none; } }
}"
rpc lab-a ". guest-lib.sh; lvcreate -q -V 64M -T vg0/pool -n vol4 && printf '%s\n' '$res4' > /etc/drbd.d/vol4.res &&
  drbdadm create-md --force vol4 >/dev/null && drbdadm up vol4" >"$work/setup-vol4-a.log" 2>&1 \
  || { cat "$work/setup-vol4-a.log" >&2; die "vol4 on lab-a"; }
rpc lab-b ". guest-lib.sh; printf '%s\n' '$res4' > /etc/drbd.d/vol4.res && drbdadm up vol4" >"$work/setup-vol4-b.log" 2>&1 \
  || { cat "$work/setup-vol4-b.log" >&2; die "vol4 on lab-b"; }
for i in $(seq 60); do
  rpc lab-a "drbdsetup events2 --now vol4" 2>/dev/null | grep -q 'connection .*connection:Connected' && break
  ((i == 60)) && die "DRBD vol4 did not connect: $(rpc lab-a 'drbdsetup events2 --now vol4')"
  sleep 1
done
# lab-a's disk becomes the UpToDate one (no other disk to sync from), then lab-b takes over.
rpc lab-a "drbdadm primary --force vol4 && drbdadm secondary vol4" >"$work/setup-vol4-a2.log" 2>&1 \
  || { cat "$work/setup-vol4-a2.log" >&2; die "vol4: making lab-a's disk UpToDate"; }
rpc lab-b ". guest-lib.sh; drbdadm primary vol4 && mkfs.ext4 -q /dev/drbd1 && mkdir -p /mnt/vol4 &&
  mount /dev/drbd1 /mnt/vol4 && start_writer /mnt/vol4 vol4" >"$work/setup-vol4-b2.log" 2>&1 \
  || { cat "$work/setup-vol4-b2.log" >&2; die "vol4: Primary and ext4 on lab-b"; }
vol4_bytes=$(rpc lab-b "blockdev --getsize64 /dev/drbd1")
log "vol4: $(rpc lab-b 'drbdsetup events2 --now vol4' | grep -o 'device .*disk:[A-Za-z]*' | head -1) on lab-b; $(rpc lab-a 'drbdsetup events2 --now vol4' | grep -o 'device .*disk:[A-Za-z]*' | head -1) on lab-a"
echo "{\"apiVersion\":\"miroir.home-operations.com/v1alpha1\",\"kind\":\"MiroirVolume\",\"metadata\":{\"name\":\"vol4\"},
      \"spec\":{\"sizeBytes\":67108864,\"replicas\":[{\"node\":\"lab-a\",\"backend\":\"lvmthin\"},{\"node\":\"lab-b\",\"diskless\":true}],\"drbd\":{\"port\":7790}}}" \
  | k create -f - >/dev/null
k patch miroirvolume vol4 --subresource=status --type=merge -p '{"status":{"formatted":true,"perNode":{
  "lab-a":{"deviceCreated":true,"diskState":"UpToDate","splitBrain":false},
  "lab-b":{"deviceCreated":true,"diskState":"Diskless","splitBrain":false}}}}' >/dev/null
for i in 1 2; do
  PRIMARY=lab-b round vol4 "diskless-$i" lab-a
  grep -q '"message":"barrier raised"' <(grep "\"snapshot\":\"diskless-$i\"" "$work/agent-lab-b.log") \
    || die "diskless-$i: lab-b, the diskless Primary, never raised its barrier"
  result "diskless-Primary $i" "vol4, DRBD 9 diskful lab-a + diskless Primary lab-b (its barrier: freeze, suspend-io), ext4: $last_summary"
done
rpc lab-b 'kill $(cat /tmp/writer-vol4.pid)' >/dev/null || true
