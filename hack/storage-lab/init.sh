#!/bin/sh
# The storage lab guest's /init (busybox): mounts the kernel file systems, loads the storage
# modules (DRBD 9 from /lib/drbd9 unless sl.drbd=84), brings up the user-mode link to the host
# (10.0.2.2 is the host's loopback) and the socket link to the other guests, mounts the payload
# disk (/dev/vdb: ucm, test scripts) and serves /cgi-bin/rpc on port 80: the host POSTs a shell
# script and reads its output, ending in a line "__rc=N".
export PATH=/payload/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts
mount -t tmpfs tmp /tmp; mount -t tmpfs run /run; mkdir -p /run/lvm /run/lock /var/lib/drbd; ln -s /run/lock /var/lock
arg() { tr ' ' '\n' </proc/cmdline | sed -n "s/^$1=//p"; }
name=$(arg sl.name); ip=$(arg sl.ip); drbd=$(arg sl.drbd)
hostname "$name"
for m in virtio_pci virtio_blk virtio_net dm-mod dm-thin-pool dm-snapshot loop xfs; do /usr/sbin/modprobe "$m"; done
if [ "$drbd" = 84 ]; then
  /usr/sbin/modprobe drbd
else
  /usr/sbin/modprobe lru_cache; /usr/sbin/modprobe libcrc32c
  for m in handshake drbd drbd_transport_tcp; do /usr/sbin/insmod /lib/drbd9/$m.ko; done
fi
ip link set lo up
ip link set eth0 up; ip addr add 10.0.2.15/24 dev eth0; ip route add default via 10.0.2.2
ip link set eth1 up 2>/dev/null && ip addr add "$ip/24" dev eth1
mount -o ro /dev/vdb /payload
mkdir -p /www/cgi-bin
cat > /www/cgi-bin/rpc <<'RPC'
#!/bin/sh
echo "Content-Type: text/plain"; echo
f=/tmp/rpc.$$; head -c "$CONTENT_LENGTH" > $f
export PATH=/payload/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin
sh $f 2>&1; echo "__rc=$?"; rm -f $f
RPC
chmod +x /www/cgi-bin/rpc
httpd -p 80 -h /www
echo "storage-lab guest $name up: $(cat /proc/drbd 2>/dev/null | head -1)"
echo "SL-READY"
while :; do sleep 3600; done
