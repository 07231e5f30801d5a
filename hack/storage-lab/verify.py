#!/usr/bin/env python3
"""The storage lab's checks and figures (docs/snapshot.md, "Testing").

verify.py records RECORDS ACKS RAISED LIFTED: RECORDS is the `records` file read from the snapshot,
ACKS the writer's "SEQ EPOCH" lines, RAISED/LIFTED the Primary leg's barrier raise start and
lift end (epoch seconds, the guest's clock, as the acks). Prints one JSON line; exits 1 when
the snapshot is not a gap-free, checksummed prefix holding every record acknowledged before the
raise and none acknowledged only after the lift.

verify.py times SNAP AGENT_LOG...: the round's timings from the agents'
JSON logs ("barrier raised", "cut", "barrier lifted"), the first log the Primary's: its pause start and end (epoch
seconds) and per leg the breakdown in milliseconds.

verify.py summary RESULTS.jsonl: median and p99 of the writer stall and of each leg's IO pause
over the replicated rounds, and of the bare sequence's.

verify.py bench SUMMARY.json bench/results.json COMMIT: those figures into the bench results.

verify.py deadleg SNAP AGENT_LOG ACKS T_EVENT: a failure path's first round on the Primary
(AGENT_LOG, read before any recut): its IO pause (raise to lift), the writer's longest gap
between acknowledgements around it, and how long after T_EVENT (the kill, epoch seconds) the
Primary lifted. Prints one JSON line."""
import json, sys


def fnv1a(b):
    h = 2166136261
    for c in b:
        h = ((h ^ c) * 16777619) & 0xFFFFFFFF
    return h


def epoch(stamp):
    """RFC 3339 UTC (jiff's form, up to nanoseconds) to epoch seconds."""
    from datetime import datetime, timezone
    main_part, _, frac = stamp.rstrip("Z").partition(".")
    t = datetime.strptime(main_part, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    return t + (float("0." + frac) if frac else 0.0)


def logs(path):
    out = []
    for line in open(path, errors="replace"):
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def times(snap, primary, legs):
    res = {"legs": {}}
    for path in legs:
        leg = {}
        for e in logs(path):
            if e.get("snapshot") != snap:
                continue
            m = e.get("message")
            if m == "barrier raised":
                leg.update(paused_at=epoch(e["paused_at"]), freeze_ms=e["freeze_ms"], suspend_ms=e["suspend_ms"])
            elif m == "cut":
                leg.update(cut_started=epoch(e["started_at"]), cut_ms=e["cut_ms"])
            elif m == "barrier lifted":
                leg.update(lifted_at=epoch(e["lifted_at"]), io_pause_ms=e.get("io_pause_ms"),
                           resume_ms=e["resume_ms"], thaw_ms=e["thaw_ms"])
        res["legs"][path.rsplit("agent-", 1)[-1].removesuffix(".log")] = leg
        if path == primary:
            if "paused_at" in leg and "lifted_at" in leg:
                res["raised"], res["lifted"] = leg["paused_at"], leg["lifted_at"]
            elif "cut_started" in leg:  # unreplicated: no barrier, the cut is the instant
                res["raised"] = leg["cut_started"]
                res["lifted"] = leg["cut_started"] + leg["cut_ms"] / 1000
    if "raised" not in res:
        print(json.dumps(res))
        sys.exit(1)
    print(json.dumps(res))


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None


def summary(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    out = {}
    for kind in ("ucm", "bare"):
        rs = [r for r in rows if r.get("kind", "ucm") == kind and r["volume"] == "vol1"]
        if not rs:
            continue
        stall = [r["check"]["writer_stall_s"] * 1000 for r in rs]
        fig = {"rounds": len(rs), "writer_stall_ms": {"median": pct(stall, 50), "p99": pct(stall, 99)}}
        parts = {}
        for r in rs:
            for leg, t in r["timings"]["legs"].items():
                for k, v in t.items():
                    if k.endswith("_ms") and v is not None:
                        parts.setdefault(f"{leg}.{k}", []).append(v)
        for k, v in sorted(parts.items()):
            fig[k] = {"median": round(pct(v, 50), 1), "p99": round(pct(v, 99), 1)}
        out[kind] = fig
    print(json.dumps(out, indent=1))


def bench(summary_path, results_path, commit):
    """Writes the lab's pause figures into bench/results.json as phase `storage` (rendered into
    bench/results.md by `make bench`'s report, section "Snapshot pause on real storage")."""
    from datetime import datetime, timezone
    fig = json.load(open(summary_path))
    ucm, bare = fig["ucm"], fig["bare"]
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    rounds = ucm["rounds"]

    def breakdown(f, leg):
        parts = [(k.split(".", 1)[1], v["median"]) for k, v in f.items() if k.startswith(leg + ".")]
        return ", ".join(f"{k[:-3]} {v:g}" for k, v in parts if k != "io_pause_ms")

    out = []

    def add(fid, title, value, ref, ref_what, note):
        out.append({"id": f"storage.{fid}", "phase": "storage", "title": title, "unit": "ms",
                    "samples": [value], "median": value, "min": value, "max": value,
                    "reference": {"value": ref, "what": ref_what, "measured": True},
                    "ratio": value / ref if ref else None, "better": "lower", "note": note,
                    "rerun": "make storage-lab", "measured_at": now})

    for q in ("median", "p99"):
        add(f"writer_stall_{q}", f"writer stall per round, 2-replica DRBD 9 volume: {q} ({rounds} rounds)",
            ucm["writer_stall_ms"][q], bare["writer_stall_ms"][q],
            f"the bare sequence's {q} without ucm, same guests", "longest gap between two acknowledged fdatasync'ed records around the round")
        for leg, who in (("lab-a", "Primary"), ("lab-b", "Secondary")):
            add(f"io_pause_{leg}_{q}", f"IO pause of the {who} leg (freeze or suspend to resume and thaw): {q}",
                ucm[f"{leg}.io_pause_ms"][q], bare[f"{leg}.io_pause_ms"][q],
                f"the bare sequence's {q}, same guests",
                f"ucm medians (ms): {breakdown(ucm, leg)}; bare: {breakdown(bare, leg)}")
    data = json.load(open(results_path))
    data["figures"] = [f for f in data["figures"] if f["phase"] != "storage"] + out
    data["meta"]["commit (storage lab)"] = commit
    data["meta"]["date (storage lab)"] = now
    json.dump(data, open(results_path, "w"), indent=2, ensure_ascii=False)


def records():
    rec_path, ack_path, raised, lifted = sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
    data = open(rec_path, "rb").read()
    errors = []
    if len(data) % 64:
        errors.append(f"records file is {len(data)} bytes, not a multiple of 64 (a torn record)")
    n = len(data) // 64
    for i in range(n):
        r = data[i * 64:(i + 1) * 64]
        head = r[:14]
        want = b"seq=%010d" % (i + 1)
        if head != want:
            errors.append(f"record {i + 1} reads {r[:40]!r}: not a gap-free prefix")
            break
        if r[15:27] != b"sum=%08x" % fnv1a(head):
            errors.append(f"record {i + 1} has a bad checksum: {r[:40]!r}")
            break
    acks = [(int(a), float(b)) for a, b in (l.split() for l in open(ack_path) if l.strip())]
    before = max((s for s, t in acks if t < raised), default=0)
    after = min((s for s, t in acks if t > lifted), default=None)
    if n < before:
        errors.append(f"record {before} was acknowledged before the barrier went up but the snapshot ends at {n}")
    if after is not None and n >= after:
        errors.append(f"the snapshot holds record {n}, acknowledged only after the barrier came down (first such: {after})")
    win = [t for s, t in acks if raised - 2 <= t <= lifted + 2]
    stall = max((b - a for a, b in zip(win, win[1:])), default=0.0)
    print(json.dumps({"records": n, "acked_before_raise": before, "first_acked_after_lift": after,
                      "writer_stall_s": round(stall, 3), "errors": errors}))
    sys.exit(1 if errors else 0)


def deadleg(snap, log, acks_path, t_event):
    raised = lifted = None
    for e in logs(log):
        if e.get("snapshot") != snap:
            continue
        if e.get("message") == "barrier raised" and raised is None:
            raised = epoch(e["paused_at"])
        elif e.get("message") == "barrier lifted" and lifted is None:
            lifted = epoch(e["lifted_at"])
    if raised is None or lifted is None:
        sys.exit(f"no raise and lift of {snap} in {log}")
    acks = [float(l.split()[1]) for l in open(acks_path) if l.strip()]
    win = [t for t in acks if raised - 2 <= t <= lifted + 2]
    stall = max((b - a for a, b in zip(win, win[1:])), default=0.0)
    print(json.dumps({"io_pause_s": round(lifted - raised, 2), "writer_stall_s": round(stall, 2),
                      "lifted_after_s": round(lifted - t_event, 2)}))


if sys.argv[1] == "records":
    records()
elif sys.argv[1] == "times":
    times(sys.argv[2], sys.argv[3], sys.argv[3:])
elif sys.argv[1] == "summary":
    summary(sys.argv[2])
elif sys.argv[1] == "deadleg":
    deadleg(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
elif sys.argv[1] == "bench":
    bench(sys.argv[2], sys.argv[3], sys.argv[4])
else:
    sys.exit("usage: verify.py records|times|summary ...")
