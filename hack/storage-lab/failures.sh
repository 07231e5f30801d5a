# Sourced by full.sh: failure paths on real storage (docs/snapshot.md, "Deadline, void and
# recovery"). Each ends with the round recut, checked like any other, and nothing left
# suspended or frozen.

# until_log GUEST SNAP MESSAGE: waits for the agent on GUEST to log MESSAGE for SNAP.
until_log() {
  for _ in $(seq 240); do
    rpc "$1" "grep '\"snapshot\":\"$2\"' /tmp/agent.log | grep -q '\"message\":\"$3\"'" && return 0
    sleep 0.5
  done
  rpc "$1" "grep '\"snapshot\":\"$2\"' /tmp/agent.log | tail -n 20" 2>/dev/null | sed "s/^/[$1 agent] /" >&2 || true
  die "the agent on $1 never logged \"$3\" for $2"
}
# both_raised SNAP: waits until both legs have raised their barrier for SNAP (polled tightly: the
# kill must come before lab-b's cut, which waits for lab-a's slot and then runs lvcreate). A
# lab-a raising after lab-b is gone would refuse (peer not connected) and never hold its writers,
# which is not the case these paths are about.
both_raised() {
  local g n
  for _ in $(seq 600); do
    n=0
    for g in lab-a lab-b; do
      rpc "$g" "grep '\"snapshot\":\"$1\"' /tmp/agent.log | grep -q '\"message\":\"barrier raised\"'" && n=$((n + 1))
    done
    ((n == 2)) && return 0
    sleep 0.1
  done
  die "the legs never both raised their barrier for $1"
}
not_suspended() { # GUEST WITHIN_SECONDS
  for _ in $(seq $(($2 * 2))); do
    rpc "$1" "drbdsetup events2 --now vol1" | grep -q '^exists resource .*suspended:no' && return 0
    sleep 0.5
  done
  die "DRBD vol1 on $1 still suspended $2 s later: $(rpc "$1" 'drbdsetup events2 --now vol1')"
}
writer_moves() { # within 10 s of now, the writer on lab-a acknowledges a new record
  local n0 n1; n0=$(rpc lab-a "wc -l < /tmp/acks-vol1"); sleep 3; n1=$(rpc lab-a "wc -l < /tmp/acks-vol1")
  ((n1 > n0)) || die "the writer on lab-a is stuck ($1)"
}
ready_reason() { k get miroirsnapshot "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].reason}'; }

# dead_leg SNAP T_EVENT SCENARIO: lab-b died mid-round; lab-a must lift long before the deadline
# (the manager's early void on lab-b's silent heartbeat, row 8a), and its writer go on.
dead_leg() {
  local snap=$1 t_event=$2 scenario=$3 why m
  until_log lab-a "$snap" "barrier lifted"
  not_suspended lab-a 5
  writer_moves "$scenario"
  why=$(ready_reason "$snap")
  [[ $why == AgentSilent || $why == WaitingForReplicas ]] \
    || die "$snap: voided as $why, not for lab-b's silence: $(k get miroirsnapshot "$snap" -o jsonpath='{.status.conditions}')"
  rpc lab-a "cat /tmp/agent.log" >"$work/agent-lab-a.log"
  rpc lab-a "cat /tmp/acks-vol1" >"$work/acks-vol1"
  m=$(python3 "$here/verify.py" deadleg "$snap" "$work/agent-lab-a.log" "$work/acks-vol1" "$t_event") \
    || die "$snap: no pause figures: $m"
  read -r pause stall after <<<"$(echo "$m" | python3 -c 'import json,sys; m=json.load(sys.stdin); print(m["io_pause_s"], m["writer_stall_s"], m["lifted_after_s"])')"
  # K (10 s) after lab-b's last beat, plus a watch delivery and the lift: far below D (60 s).
  python3 -c "import sys; sys.exit(0 if $stall < 30 else 1)" \
    || die "$snap: lab-a's writer stalled ${stall}s: the round was not voided early (deadline 60 s)"
  result "$scenario" "lab-a lifted ${after}s after it (early void, AgentSilent; deadline 60 s): IO pause ${pause}s, writer stall ${stall}s"
}

# 1. SIGKILL of lab-b's agent while its barrier is up. The manager voids the round once lab-b's
# heartbeat is K silent and lab-a lifts; the agent restarted (as its DaemonSet would) finds its
# journal and lifts lab-b's barrier; the next round, held until lab-b beats again, recuts.
log "failure path: SIGKILL of lab-b's agent mid-round"
snapshot kill-agent vol1
both_raised kill-agent
rpc lab-b 'kill -9 $(cat /tmp/agent.pid)' >/dev/null
dead_leg kill-agent "$(date +%s.%N)" "agent SIGKILL"
log "restarting lab-b's agent"
rpc lab-b ". guest-lib.sh; start_agent lab-b" >/dev/null
not_suspended lab-b 60
check_round vol1 kill-agent lab-a lab-b
result "agent SIGKILL: recut" "$last_summary"

# 2. lab-b powered off while its barrier is up: lab-a lifts at the early void and its writer goes
# on; lab-b boots again from its disk, DRBD resyncs, the round recuts.
log "failure path: lab-b powered off mid-round"
snapshot power-off vol1
both_raised power-off
kill -9 "$pid_lab_b"; wait "$pid_lab_b" 2>/dev/null || true
dead_leg power-off "$(date +%s.%N)" "guest powered off"
log "booting lab-b again"
: >"$work/console-lab-b.log"
boot lab-b 192.168.100.2 9 "$accel" 384 -netdev "socket,id=p,connect=127.0.0.1:$link" -device virtio-net-pci,netdev=p
wait_ready lab-b 180 || die "lab-b did not boot again"
log "clock of lab-b was $(sync_clock lab-b) s off the host's after the reboot; set"
rpc lab-b ". guest-lib.sh; vgchange -q -ay vg0 >/dev/null && mkdir -p /etc/drbd.d &&
  echo 'include \"/etc/drbd.d/*.res\";' > /etc/drbd.conf &&
  drbd_conf vol1 0 7789 lab-a:192.168.100.1 lab-b:192.168.100.2 && drbdadm up vol1 && start_agent lab-b" \
  >"$work/reboot-lab-b.log" 2>&1 || { cat "$work/reboot-lab-b.log" >&2; die "lab-b's storage after the reboot"; }
check_round vol1 power-off lab-a lab-b
result "power-off: recut" "$last_summary"

# 3. SIGKILL of the manager while the legs are suspended. The agents need no manager to finish a
# round (resume before publish) nor to lift at the deadline: past the round's deadline nothing
# may be suspended or frozen. The manager restarted continues from status: the complete round
# is published (row 7), or an incomplete one voided and recut.
log "failure path: SIGKILL of the manager mid-round"
snapshot mgr-kill vol1
until_log lab-a mgr-kill "barrier raised"
kill -9 "$manager_pid"; wait "$manager_pid" 2>/dev/null || true
t_kill=$(date +%s.%N)
log "manager killed with lab-a's barrier up"
for g in lab-a lab-b; do until_log "$g" mgr-kill "barrier lifted"; done
lifted_after=$(python3 -c "import time; print(round(time.time() - $t_kill, 1))")
sa=$(k get miroirsnapshot mgr-kill -o jsonpath='{.status.suspendedAt}')
open=$(k get miroirsnapshot mgr-kill -o jsonpath='{.status.ioSuspended}')
wait_s=$(python3 -c "
import datetime, time
d = datetime.datetime.fromisoformat('$sa'.replace('Z', '+00:00')).timestamp() + 60 + 3
print(max(0, int(d - time.time()) + 1))")
log "both legs lifted ${lifted_after}s after the kill (ioSuspended still $open: no manager); checking again past the deadline in ${wait_s}s"
sleep "$wait_s"
for g in lab-a lab-b; do
  not_suspended "$g" 1
  rpc "$g" "! grep -q mgr-kill /run/ucm-snapshot-agent/journal.json 2>/dev/null" \
    || die "$g's journal still holds a barrier of mgr-kill past the deadline: $(rpc "$g" 'cat /run/ucm-snapshot-agent/journal.json')"
done
writer_moves "after the manager's SIGKILL, past the deadline (frozen?)"
start_manager
log "manager restarted"
check_round vol1 mgr-kill lab-a lab-b
raises=$(grep -c '"snapshot":"mgr-kill".*"message":"barrier raised"\|"message":"barrier raised".*"snapshot":"mgr-kill"' "$work/agent-lab-a.log" || true)
result "manager SIGKILL" "legs lifted ${lifted_after}s after the kill with no manager (ioSuspended $open); past the deadline neither leg suspended (events2) nor in a journal, writer moving; the restarted manager $( ((raises > 1)) && echo "voided and recut it ($raises raises)" || echo "published the round the legs had completed"): $last_summary"
log "failure paths passed: no leg left suspended or frozen, every round recut or published and checked"
