# Sourced by lab.sh: the rounds on real storage and their checks (docs/snapshot.md, "Testing").
results=$work/results.jsonl
: >"$results"

snapshot() { # NAME VOLUME
  echo "{\"apiVersion\":\"miroir.home-operations.com/v1alpha1\",\"kind\":\"MiroirSnapshot\",
         \"metadata\":{\"name\":\"$1\"},\"spec\":{\"volumeName\":\"$2\"}}" | k create -f - >/dev/null
}
wait_snapshot() { # NAME TIMEOUT
  local t0=$(date +%s)
  until [[ $(k get miroirsnapshot "$1" -o jsonpath='{.status.readyToUse}' 2>/dev/null) == true ]]; do
    (($(date +%s) - t0 > $2)) && return 1
    sleep 0.5
  done
}

# round VOLUME SNAP LEG...: one MiroirSnapshot through the API, then every check a user would
# make of it. The first leg is the Primary (writer, file system).
round() {
  snapshot "$2" "$1"
  check_round "$@"
}

# check_round VOLUME SNAP LEG...: waits for the snapshot to be Ready and checks it. LEG... are the
# diskful legs (each holds a snapshot); the Primary (writer, file system, the pause) is $PRIMARY
# when set (a diskless Primary), else the first leg.
check_round() {
  local vol=$1 snap=$2; shift 2
  local legs=("$@") t0 primary
  primary=${PRIMARY:-${legs[0]}}
  t0=$(k get miroirsnapshot "$snap" -o jsonpath='{.metadata.creationTimestamp}' | python3 -c 'import sys,datetime; print(datetime.datetime.fromisoformat(sys.stdin.read().strip().replace("Z","+00:00")).timestamp())')
  wait_snapshot "$snap" 240 || {
    k get miroirsnapshot "$snap" -o yaml >&2
    for g in "${legs[@]}"; do rpc "$g" "tail -n 30 /tmp/agent.log" | sed "s/^/[$g agent] /" >&2; done
    die "$snap ($vol) did not become readyToUse"; }
  local ready=$(date +%s.%N)
  sleep 2 # the legs lift right after Ready
  local bytes=$drbd_bytes hashes=() g fsck=e2fsck
  [[ $vol == vol2 ]] && bytes=$(rpc "${legs[0]}" "blockdev --getsize64 /dev/vg0/$vol")
  [[ $vol == vol4 ]] && bytes=$vol4_bytes
  for g in "${legs[@]}"; do
    local what=""; [[ $g == "${legs[0]}" ]] && what=records
    if [[ $vol == vol3 ]]; then # the loopfile backend's snapshot file on XFS
      fsck=xfs_repair
      rpc "$g" ". guest-lib.sh; check_loop_snap $snap" >"$work/check-$snap-$g.out" \
        || { cat "$work/check-$snap-$g.out" >&2; die "$snap: reading the snapshot file on $g failed"; }
      local shared
      shared=$(sed -n '/^fiemap-begin$/,/^fiemap-end$/p' "$work/check-$snap-$g.out" | python3 -c '
import sys
n = 0
for l in sys.stdin:
    f = l.split()
    if len(f) >= 5 and f[0].rstrip(":").isdigit() and f[-1].startswith("0x"):
        n += bool(int(f[-1], 16) & 0x2000)  # FIEMAP_EXTENT_SHARED
print(n)')
      ((shared > 0)) || { cat "$work/check-$snap-$g.out" >&2; die "$snap: the snapshot file shares no extent with the volume (not a reflink)"; }
    else
      rpc "$g" ". guest-lib.sh; check_snap $snap $bytes $what" >"$work/check-$snap-$g.out" \
        || { cat "$work/check-$snap-$g.out" >&2; die "$snap: activating or reading the thin snapshot on $g failed"; }
    fi
    grep -q '^fsck=0$' "$work/check-$snap-$g.out" \
      || { cat "$work/check-$snap-$g.out" >&2; die "$snap: $fsck -n of the snapshot on $g is not clean"; }
    hashes+=("$(sed -n 's/^hash=//p' "$work/check-$snap-$g.out")")
    [[ $(sed -n 's/^restored=//p' "$work/check-$snap-$g.out") == "${hashes[-1]}" ]] \
      || die "$snap: the volume restored from $g's snapshot differs from it"
  done
  if [[ $vol == vol1 || $vol == vol4 ]]; then
    for g in $(printf '%s\n' "${legs[@]}" "$primary" | sort -u); do
      rpc "$g" "drbdsetup events2 --now $vol" | grep -q '^exists resource .*suspended:no' \
        || die "$snap: DRBD $vol on $g is still suspended after the round: $(rpc "$g" "drbdsetup events2 --now $vol")"
    done
  fi
  local h; for h in "${hashes[@]}"; do
    [[ $h == "${hashes[0]}" && -n $h ]] || die "$snap: the legs' thin snapshots differ: ${hashes[*]}"
  done
  sed -n '/^records-begin$/,/^records-end$/p' "$work/check-$snap-${legs[0]}.out" | sed '1d;$d' >"$work/records-$snap"
  rpc "$primary" "cat /tmp/acks-$vol" >"$work/acks-$vol"
  local times leglogs=() everyone
  everyone=("$primary"); for g in "${legs[@]}"; do [[ $g == "$primary" ]] || everyone+=("$g"); done
  for g in "${everyone[@]}"; do rpc "$g" "cat /tmp/agent.log" >"$work/agent-$g.log"; leglogs+=("$work/agent-$g.log"); done
  times=$(python3 "$here/verify.py" times "$snap" "${leglogs[@]}") \
    || die "$snap: no barrier/cut timings in the agent logs: $times"
  read -r raised lifted <<<"$(echo "$times" | python3 -c 'import json,sys; t=json.load(sys.stdin); print(t["raised"], t["lifted"])')"
  local v
  v=$(python3 "$here/verify.py" records "$work/records-$snap" "$work/acks-$vol" "$raised" "$lifted") \
    || die "$snap: the writer's records in the snapshot are wrong: $v"
  # The writer goes on after the round: no freeze or suspend is left behind.
  local last; last=$(rpc "$primary" "tail -n 1 /tmp/acks-$vol" | cut -d' ' -f2)
  python3 -c "import sys; sys.exit(0 if float('$last') > float('$lifted') + 1 else 1)" \
    || die "$snap: the writer on $vol has not acknowledged a record since the barrier came down (frozen?)"
  echo "{\"snapshot\":\"$snap\",\"volume\":\"$vol\",\"ready_s\":$(python3 -c "print(round($ready-$t0,3))"),\"hash\":\"${hashes[0]:0:16}\",\"check\":$v,\"timings\":$times}" >>"$results"
  last_summary="Ready in $(python3 -c "print(round($ready-$t0,1))")s; hashes equal, $fsck clean; $(echo "$v" | python3 -c 'import json,sys; c=json.load(sys.stdin); print("%s records, gap-free, every ack before the raise kept; writer stall %ss" % (c["records"], c["writer_stall_s"]))')"
  log "$snap ($vol, legs ${legs[*]}): $last_summary"
  k delete miroirsnapshot "$snap" --wait=false >/dev/null
}

round vol1 ci-replicated lab-a lab-b
result "replicated round" "vol1, DRBD 9 + lvmthin, ext4: $last_summary"
round vol2 ci-unreplicated lab-a
result "unreplicated round" "vol2, lvmthin, ext4: $last_summary"
if [[ $mode == ci ]]; then
  log "CI subset passed: one replicated round (DRBD $drbd_version, 2 legs) and one unreplicated round"
  exit 0
fi
. "$here/full.sh"
