#!/usr/bin/env bash
# Builds (once) what the storage lab's guests boot: Debian's cloud kernel extracted (never
# installed on the host), DRBD 9.3.3 built for it, and a busybox initramfs with the storage
# tools copied from the host with their libraries (docs/snapshot.md, "Testing"). Everything is
# cached under ~/.cache/ucm/storage-lab, keyed by its inputs, so a warm run only checks it.
# Prints the cache directory's variables for lab.sh (source the output).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
. "$here/config.sh"

log() { echo "storage-lab: $*" >&2; }
die() { echo "storage-lab: FAILED: $*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "needs root (apt-get, dpkg -x of a kernel package, QEMU)"
mkdir -p "$SL_CACHE"

# 1. Host packages (the emulator, the storage tools copied into the guests, DRBD's build deps).
pkgs=(qemu-system-x86 busybox-static drbd-utils lvm2 thin-provisioning-tools e2fsprogs xfsprogs
      util-linux kmod curl cpio coccinelle flex bison libelf-dev libc6-dev binutils gcc python3
      "linux-headers-$SL_KVER")
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  apt-get update -qq || die "apt-get update"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]}"
fi

# 2. The guest kernel: apt-get download + dpkg -x (never installed on the host).
kdir=$SL_CACHE/kernel-$SL_KVER
if [[ ! -f $kdir/.done ]]; then
  log "downloading linux-image-$SL_KVER (extracted, not installed)"
  rm -rf "$kdir" && mkdir -p "$kdir/deb"
  (cd "$kdir/deb" && apt-get download -qq "linux-image-$SL_KVER") || die "apt-get download linux-image-$SL_KVER"
  dpkg -x "$kdir"/deb/*.deb "$kdir/root" || die "dpkg -x"
  # The package's postinst would run depmod; here we do, into the extracted tree only.
  depmod -b "$kdir/root" "$SL_KVER" || die "depmod of the extracted kernel"
  rm -rf "$kdir/deb"
  touch "$kdir/.done"
fi

# 3. DRBD 9 for that kernel, from the reference tree (copied out: it is read-only).
ddir=$SL_CACHE/drbd-$SL_DRBD-$SL_KVER
if [[ ! -f $ddir/.done ]]; then
  [[ -d $SL_DRBD_SRC/drbd ]] || die "DRBD source not found at $SL_DRBD_SRC"
  log "building DRBD $SL_DRBD for $SL_KVER (about 1.5 min)"
  rm -rf "$ddir" && mkdir -p "$ddir"
  cp -a "$SL_DRBD_SRC" "$ddir/src"
  # The copy has no .git: Kbuild wants the revision file instead.
  echo "GIT-hash: drbd-$SL_DRBD" > "$ddir/src/drbd/.drbd_git_revision"
  # SPAAS=false: LINBIT's online compat service is out of reach; Debian's spatch does it.
  make -C "$ddir/src" KDIR="/usr/src/linux-headers-$SL_KVER" KVER="$SL_KVER" SPAAS=false \
    >"$ddir/build.log" 2>&1 || { tail -30 "$ddir/build.log" >&2; die "DRBD build (log: $ddir/build.log)"; }
  mkdir -p "$ddir/modules"
  for m in drbd drbd_transport_tcp handshake; do
    f=$(find "$ddir/src/drbd" -name "$m.ko" | head -1)
    [[ -n $f ]] || die "DRBD build made no $m.ko"
    strip --strip-debug -o "$ddir/modules/$m.ko" "$f"
  done
  rm -rf "$ddir/src"
  touch "$ddir/.done"
fi

# 4. The initramfs: busybox + the storage tools and their libraries + kernel modules + /init.
key=$( { echo "$SL_KVER $SL_DRBD"; cat "$here/init.sh" "$here/config.sh";
         dpkg-query -W busybox-static drbd-utils lvm2 thin-provisioning-tools e2fsprogs xfsprogs util-linux kmod curl; } \
       | sha256sum | cut -c1-16)
initrd=$SL_CACHE/initramfs-$key.cpio.gz
if [[ ! -f $initrd ]]; then
  log "building the initramfs ($key)"
  t=$(mktemp -d) ; r=$t/root
  mkdir -p "$r"/{bin,sbin,etc,proc,sys,dev,tmp,run,mnt,var/lib,var/run,lib/modules,etc/lvm,payload,data}
  cp /bin/busybox "$r/bin/busybox"
  for a in $("$r/bin/busybox" --list); do if [[ ! -e $r/bin/$a ]]; then ln -s busybox "$r/bin/$a"; fi; done
  bins=(/usr/sbin/drbdadm /usr/sbin/drbdsetup /usr/sbin/drbdmeta /usr/lib/drbd/drbdadm-84 /usr/lib/drbd/drbdsetup-84
        /usr/sbin/lvm /usr/sbin/dmsetup /usr/sbin/pdata_tools
        /usr/sbin/mkfs.ext4 /usr/sbin/mke2fs /usr/sbin/e2fsck /usr/sbin/mkfs.xfs /usr/sbin/xfs_repair /usr/sbin/xfs_io
        /usr/sbin/fsfreeze /usr/sbin/losetup /usr/sbin/blockdev /usr/bin/mount /usr/bin/umount
        /usr/bin/curl /usr/bin/sha256sum /usr/bin/date /usr/bin/cp /usr/bin/stat /usr/bin/sync /usr/bin/kmod /usr/bin/dd)
  for b in "${bins[@]}"; do
    [[ -e $b ]] || die "missing host tool $b"
    mkdir -p "$r$(dirname "$b")"; cp -L "$b" "$r$b"
    ldd "$b" 2>/dev/null | awk '/=>/{print $3} /ld-linux/{print $1}' | while read -r l; do
      if [[ -f $l ]]; then mkdir -p "$r$(dirname "$l")"; cp -Ln "$l" "$r$l"; fi
    done
  done
  mkdir -p "$r/lib64" && cp -L /lib64/ld-linux-x86-64.so.2 "$r/lib64/"
  # drbdadm hands DRBD 8.4 kernels to /lib/drbd/drbdadm-84 (Debian's /lib is /usr/lib).
  mkdir -p "$r/usr/lib/drbd" && cp -a /usr/lib/drbd/. "$r/usr/lib/drbd/" && ln -s ../usr/lib/drbd "$r/lib/drbd"
  # The tools the agent runs by name, first on PATH (busybox has its own fsfreeze/losetup).
  for n in lvcreate lvremove lvs vgs lvchange vgcreate pvcreate lvextend vgchange lvdisplay; do ln -sf lvm "$r/usr/sbin/$n"; done
  for n in modprobe insmod rmmod lsmod depmod; do ln -sf ../bin/kmod "$r/usr/sbin/$n"; done
  for n in thin_check thin_dump thin_repair thin_restore; do ln -sf pdata_tools "$r/usr/sbin/$n"; done
  cat > "$r/etc/lvm/lvm.conf" <<'LVM'
devices { obtain_device_list_from_udev = 0 }
activation { udev_sync = 0 udev_rules = 0 monitoring = 0 }
global { use_lvmetad = 0 }
LVM
  # Kernel modules: storage, virtio, networking; with their dependencies.
  mods=(dm-mod dm-thin-pool dm-snapshot dm-bufio dm-persistent-data libcrc32c lru_cache loop xfs
        virtio_blk virtio_net virtio_pci drbd)
  kmods=$kdir/root/lib/modules/$SL_KVER
  for m in "${mods[@]}"; do
    modprobe -d "$kdir/root" -S "$SL_KVER" --show-depends "$m" 2>/dev/null | awk '$1=="insmod"{print $2}'
  done | sort -u | while read -r f; do
    rel=${f#"$kdir/root"}; mkdir -p "$r$(dirname "$rel")"; cp "$f" "$r$rel"
  done
  cp "$kmods"/modules.{order,builtin,builtin.modinfo} "$r/lib/modules/$SL_KVER/" 2>/dev/null || true
  depmod -b "$r" "$SL_KVER" || die "depmod"
  mkdir -p "$r/lib/drbd9" && cp "$ddir"/modules/*.ko "$r/lib/drbd9/"
  cp "$here/init.sh" "$r/init"; chmod +x "$r/init"
  (cd "$r" && find . | cpio -o -H newc --quiet | gzip -1) > "$initrd.tmp"
  mv "$initrd.tmp" "$initrd"; rm -rf "$t"
fi

vmlinuz=$(ls "$kdir/root/boot/vmlinuz-$SL_KVER")
echo "SL_VMLINUZ=$vmlinuz"
echo "SL_INITRD=$initrd"
