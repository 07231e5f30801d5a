# Sourced by lab.sh: booting guests and running scripts in them (docs/snapshot.md, "Testing").
# Needs $work, $payimg, $SL_VMLINUZ, $SL_INITRD; fills guests, qemu_pids, rpc_<name>, pid_<name>.

qemu_base=(qemu-system-x86_64 -nographic -display none -monitor none -no-reboot -smp 1)

boot() { # name ip drbd accel mem extra-netdev-args...
  local name=$1 ip=$2 drbd=$3 accel=$4 mem=$5; shift 5
  local rpc=$(( 20000 + RANDOM % 20000 ))
  truncate -s 2G "$work/data-$name.img"
  "${qemu_base[@]}" -accel "$accel" -m "$mem" -kernel "$SL_VMLINUZ" -initrd "$SL_INITRD" \
    -append "console=ttyS0 panic=-1 loglevel=4 sl.name=$name sl.ip=$ip sl.drbd=$drbd" \
    -drive "file=$work/data-$name.img,if=virtio,format=raw" \
    -drive "file=$payimg,if=virtio,format=raw,readonly=on" \
    -netdev "user,id=u,net=10.0.2.0/24,hostfwd=tcp:127.0.0.1:$rpc-:80" -device virtio-net-pci,netdev=u \
    "$@" -serial "file:$work/console-$name.log" </dev/null >/dev/null 2>"$work/qemu-$name.err" &
  qemu_pids+=($!)
  eval "rpc_${name//-/_}=$rpc pid_${name//-/_}=$!"
  guests+=("$name")
}
wait_ready() { # name timeout
  local t0=$(date +%s)
  until grep -q SL-READY "$work/console-$1.log" 2>/dev/null; do
    (($(date +%s) - t0 > $2)) && return 1
    local pid=pid_${1//-/_}; kill -0 "${!pid}" 2>/dev/null || return 1
    sleep 0.5
  done
}
# rpc GUEST SCRIPT...: runs shell text in the guest (stdin if no script), prints its output,
# fails with the script's exit code.
rpc() {
  local g=$1; shift; local port=rpc_${g//-/_}
  port=${!port}
  local out rc
  if (($#)); then out=$(printf '%s\n' "$*" | curl -sS --max-time 600 --data-binary @- "http://127.0.0.1:$port/cgi-bin/rpc") || return 99
  else out=$(curl -sS --max-time 600 --data-binary @- "http://127.0.0.1:$port/cgi-bin/rpc") || return 99; fi
  rc=$(printf '%s\n' "$out" | sed -n 's/^__rc=//p' | tail -1)
  printf '%s\n' "$out" | sed '/^__rc=/d'
  return "${rc:-98}"
}

