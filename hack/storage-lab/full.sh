# Sourced by rounds.sh for the whole lab (`make storage-lab`): the pause figures over many
# replicated rounds, the bare sequence without ucm in the same guests, and the failure paths.

now() { echo '$(/usr/bin/date +%s.%N)'; } # guest-side wall clock, as the agents' logs

# bare_round I: freeze + suspend-io on the Primary, suspend-io on the peer, lvcreate on both legs
# at once, resume-io on both, thaw: what ucm's round does, run directly by this script.
bare_round() {
  local i=$1 lv=bare-$1 a b ca cb ra
  a=$(rpc lab-a "t0=$(now); /usr/sbin/fsfreeze -f /mnt/vol1; t1=$(now); drbdsetup suspend-io 0; t2=$(now); echo \$t0 \$t1 \$t2") || die "bare: freeze/suspend on lab-a"
  b=$(rpc lab-b "t0=$(now); drbdsetup suspend-io 0; t1=$(now); echo \$t0 \$t1") || die "bare: suspend on lab-b"
  local cut="t0=$(now); lvcreate -q --snapshot --name $lv --setactivationskip y --activate n vg0/vol1 >/dev/null; t1=$(now); echo \$t0 \$t1"
  rpc lab-a "$cut" >"$work/bare-a" & local pa=$!
  rpc lab-b "$cut" >"$work/bare-b" & local pb=$!
  wait $pa || die "bare: lvcreate on lab-a"; wait $pb || die "bare: lvcreate on lab-b"
  ca=$(cat "$work/bare-a"); cb=$(cat "$work/bare-b")
  rb=$(rpc lab-b "t0=$(now); drbdsetup resume-io 0; t1=$(now); echo \$t0 \$t1") || die "bare: resume on lab-b"
  ra=$(rpc lab-a "t0=$(now); drbdsetup resume-io 0; t1=$(now); /usr/sbin/fsfreeze -u /mnt/vol1; t2=$(now); echo \$t0 \$t1 \$t2") || die "bare: resume/thaw on lab-a"
  for g in lab-a lab-b; do rpc "$g" "lvremove -q -y vg0/$lv" >/dev/null; done
  rpc lab-a "cat /tmp/acks-vol1" >"$work/acks-vol1"
  python3 - "$a" "$b" "$ca" "$cb" "$ra" "$rb" "$work/acks-vol1" "$i" >>"$results" <<'PY'
import json, sys
a, b, ca, cb, ra, rb = ([float(x) for x in s.split()] for s in sys.argv[1:7])
ms = lambda x, y: round((y - x) * 1000, 1)
acks = [float(l.split()[1]) for l in open(sys.argv[7]) if l.strip()]
win = [t for t in acks if a[0] - 2 <= t <= ra[2] + 2]
stall = max((y - x for x, y in zip(win, win[1:])), default=0.0)
legs = {"lab-a": {"freeze_ms": ms(a[0], a[1]), "suspend_ms": ms(a[1], a[2]), "cut_ms": ms(ca[0], ca[1]),
                  "resume_ms": ms(ra[0], ra[1]), "thaw_ms": ms(ra[1], ra[2]), "io_pause_ms": ms(a[0], ra[2])},
        "lab-b": {"suspend_ms": ms(b[0], b[1]), "cut_ms": ms(cb[0], cb[1]), "resume_ms": ms(rb[0], rb[1]),
                  "io_pause_ms": ms(b[0], rb[1])}}
print(json.dumps({"kind": "bare", "snapshot": f"bare-{sys.argv[8]}", "volume": "vol1",
                  "check": {"writer_stall_s": round(stall, 3)}, "timings": {"legs": legs}}))
PY
}

# The loopfile backend on XFS with reflink (vol3, unreplicated, no barrier: the cut is a
# FICLONE of the volume file): each snapshot file byte-checked against a reflink copy, its
# extents shared, its XFS replayed and `xfs_repair -n` clean, the records a checked prefix.
log "loopfile volume on XFS with reflink: 3 rounds of vol3"
for i in 1 2 3; do
  round vol3 "xfs-$i" lab-a
  result "loopfile-xfs round $i" "vol3, loopfile (reflink) on XFS, XFS inside: $last_summary"
done

. "$here/diskless.sh"

# Alternated, so both see the same load on the host.
if ((rounds > 0)); then
  log "pause figures: $rounds rounds of vol1 through ucm, each followed by the bare sequence"
  for i in $(seq "$rounds"); do
    round vol1 "r$i" lab-a lab-b
    bare_round "$i"
  done
  python3 "$here/verify.py" summary "$results" | tee "$SL_CACHE/last-figures.json"
  result "pause figures" "$(python3 -c '
import json, sys
f = json.load(open(sys.argv[1]))
u, b = f["ucm"], f["bare"]
print("%d rounds: writer stall median %.2f s / p99 %.2f s (bare sequence: %.2f / %.2f s)" % (
    u["rounds"], u["writer_stall_ms"]["median"] / 1000, u["writer_stall_ms"]["p99"] / 1000,
    b["writer_stall_ms"]["median"] / 1000, b["writer_stall_ms"]["p99"] / 1000))' "$SL_CACHE/last-figures.json")"
fi
# Into bench/results.json (phase storage) from 20 rounds on; `make bench`'s report renders
# bench/results.md.
if ((rounds >= 20)); then
  python3 "$here/verify.py" bench "$SL_CACHE/last-figures.json" "$root/bench/results.json" \
    "$(git -C "$root" rev-parse --short HEAD)"
fi
. "$here/failures.sh"
log "the whole lab passed"
