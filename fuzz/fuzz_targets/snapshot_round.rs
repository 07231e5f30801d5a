//! The snapshot round decision table (src/snapshot/decide.rs `decide`, src/snapshot/round.rs
//! patches) over any snapshot, volume, heartbeats and clock. Properties: no panic; each step is
//! taken only in the state its table row names (published snapshots never change, a round
//! opens only when none is open, every diskful agent is fresh and no other round holds the
//! volume, with a stamp later than the last; publish only when every diskful leg is Done; void
//! only an open round, for an Error slot or a passed deadline on a fresh read); a requeue is
//! always in the future; finalizers only grow. Then the step's own patch is applied to the
//! object and the table asked again at the same instant: an opened round is not opened twice
//! or voided, a voided round waits for its backoff, a published snapshot stays published.
#![no_main]

use std::collections::BTreeMap;
use std::time::Duration;

use arbitrary::Arbitrary;
use jiff::Timestamp;
use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};
use ucm::conditions::is_valid_reason;
use ucm::snapshot::context::Settings;
use ucm::snapshot::decide::{Decision, Observed, Step, VoidCause, decide, reason};
use ucm::runtime::time::whole_seconds;
use ucm::snapshot::round::{
    format_stamp, open_patch_of, parse_stamp, publish_patch, unpublish_patch, void_patch,
};
use ucm::snapshot::types::{MiroirSnapshot, MiroirVolume, SlotState, teardown_finalizer};

const NODES: [&str; 4] = ["n1", "n2", "n3", "n/4~x"];
const SLOTS: [&str; 4] = ["Pending", "Suspended", "Done", "Error"];
const T0: i64 = 1_800_000_000;

#[derive(Arbitrary, Debug)]
struct NodeStatus {
    node: u8,
    device_created: Option<bool>,
    disk_state: u8,
    split_brain: Option<bool>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    replicas: Vec<(u8, bool)>,
    volume: bool,
    node_status: Vec<NodeStatus>,
    status: Option<(Option<bool>, Option<bool>)>,
    stamp: Option<Result<i16, String>>,
    slots: Option<Vec<(u8, u8)>>,
    finalizers: Vec<u8>,
    deleting: bool,
    heartbeats: Vec<(u8, i16)>,
    other_round: bool,
    fresh: bool,
    now_ms: u32,
    deadline: u8,
    backoff: u8,
    stale: u8,
}

fn node(b: u8) -> String {
    NODES[b as usize % NODES.len()].to_string()
}

fn check(d: &Decision, o: &Observed<'_>, s: &Settings) {
    let snap = o.snapshot;
    let st = snap.status.as_ref();
    let ready = st.and_then(|x| x.ready_to_use).unwrap_or(false);
    let suspended = st.and_then(|x| x.io_suspended).unwrap_or(false);
    let prev = st
        .and_then(|x| x.suspended_at.as_deref())
        .and_then(parse_stamp);
    let slots = st.and_then(|x| x.per_node.clone()).unwrap_or_default();
    let diskful = o.volume.map(|v| v.diskful_nodes()).unwrap_or_default();

    if let Some(r) = &d.ready {
        assert!(reason::ALL.contains(&r.reason) && is_valid_reason(r.reason));
    }
    if let Some(at) = d.requeue_at {
        assert!(at > o.now, "requeue {at} is not after now {}", o.now);
    }
    let cut = slots.values().any(|v| *v == SlotState::Done);
    if snap.metadata.deletion_timestamp.is_some() || (ready && cut) {
        assert_eq!(d.step, Step::Wait, "deleting or published: {d:?}");
    }
    if ready && snap.metadata.deletion_timestamp.is_none() {
        // A published snapshot reports Ready=True; a forged one (no Done cut) is set back.
        if cut {
            assert!(d.ready.as_ref().is_some_and(|r| r.status));
        } else {
            assert_eq!(d.step, Step::Unpublish, "forged readyToUse kept: {d:?}");
            assert!(d.ready.as_ref().is_some_and(|r| !r.status));
        }
    }
    if d.step == Step::Unpublish {
        assert!(ready && !cut && snap.metadata.deletion_timestamp.is_none());
    }
    match &d.step {
        Step::Open {
            stamp,
            diskful: legs,
        } => {
            assert!(!suspended && !ready);
            assert!(
                o.other_round.is_none(),
                "opened while another round holds the volume"
            );
            assert!(!legs.is_empty());
            assert_eq!(legs, &diskful);
            for n in legs {
                let hb = o
                    .heartbeats
                    .get(n)
                    .expect("opened with an agent that never beat");
                assert!(
                    o.now.duration_since(*hb)
                        < jiff::SignedDuration::try_from(s.agent_stale_after).unwrap()
                );
            }
            let t = parse_stamp(stamp).expect("the stamp parses");
            assert_eq!(format_stamp(t), *stamp, "stamps round-trip");
            assert_eq!(t, whole_seconds(o.now));
            if let Some(p) = prev {
                assert!(t > p, "a new stamp must be later than the last");
            }
            let finalizers = snap.metadata.finalizers.clone().unwrap_or_default();
            for n in o.volume.unwrap().replica_nodes() {
                assert!(finalizers.contains(&teardown_finalizer(&n)));
            }
        }
        Step::Publish {
            slots: published, ..
        } => {
            assert!(suspended);
            assert!(!diskful.is_empty());
            for n in &diskful {
                assert_eq!(slots.get(n), Some(&SlotState::Done));
            }
            assert_eq!(
                published.keys().cloned().collect::<Vec<_>>().len(),
                diskful.len()
            );
            assert!(published.keys().all(|k| diskful.contains(k)));
            assert!(!slots.values().any(|v| *v == SlotState::Error));
        }
        Step::Void { cause, .. } => {
            assert!(suspended);
            match cause {
                VoidCause::Failed => assert!(slots.values().any(|v| *v == SlotState::Error)),
                VoidCause::Silent => {
                    assert!(o.fresh, "voided on a cached read");
                    assert!(!s.round_stale_after.is_zero());
                    let k = jiff::SignedDuration::try_from(s.round_stale_after).unwrap();
                    assert!(
                        diskful.iter().any(|n| slots.get(n) != Some(&SlotState::Done)
                            && o.heartbeats.get(n).is_none_or(|b| o.now >= *b + k)
                            && prev.is_none_or(|p| o.now >= p + k)),
                        "voided as silent with every pending leg beating"
                    );
                }
                VoidCause::Expired => {
                    assert!(o.fresh, "voided on a cached read");
                    if let Some(p) = prev {
                        assert!(o.now >= p + jiff::SignedDuration::try_from(s.deadline).unwrap());
                    }
                }
            }
        }
        Step::ReRead => assert!(!o.fresh && suspended),
        Step::SetFinalizers(list) => {
            let had = snap.metadata.finalizers.clone().unwrap_or_default();
            assert!(had.iter().all(|f| list.contains(f)), "finalizers only grow");
            for n in o.volume.unwrap().replica_nodes() {
                assert!(list.contains(&teardown_finalizer(&n)));
            }
        }
        Step::Wait | Step::Unpublish => {}
    }
}

fn apply(snap: &MiroirSnapshot, patch: Value) -> MiroirSnapshot {
    let mut doc = serde_json::to_value(snap).unwrap();
    let p: json_patch::Patch = serde_json::from_value(patch).unwrap();
    json_patch::patch(&mut doc, &p)
        .expect("the step's patch applies to the object it was computed from");
    serde_json::from_value(doc).unwrap()
}

fuzz_target!(|inp: Input| {
    let s = Settings {
        deadline: Duration::from_secs(1 + u64::from(inp.deadline % 120)),
        void_backoff: Duration::from_secs(1 + u64::from(inp.backoff % 60)),
        agent_stale_after: Duration::from_secs(1 + u64::from(inp.stale % 120)),
        round_stale_after: Duration::from_secs(u64::from(inp.stale % 30)),
        agent_namespace: None,
    };
    let now = Timestamp::from_millisecond(T0 * 1000 + i64::from(inp.now_ms % 600_000)).unwrap();
    let stamp = inp.stamp.as_ref().map(|r| match r {
        Ok(off) => format_stamp(Timestamp::from_second(T0 + i64::from(*off)).unwrap()),
        Err(junk) => junk.clone(),
    });
    let mut status = serde_json::Map::new();
    if let Some((ready, susp)) = inp.status {
        if let Some(r) = ready {
            status.insert("readyToUse".into(), json!(r));
        }
        if let Some(x) = susp {
            status.insert("ioSuspended".into(), json!(x));
        }
        if let Some(t) = &stamp {
            status.insert("suspendedAt".into(), json!(t));
        }
        if let Some(sl) = &inp.slots {
            let m: BTreeMap<String, &str> = sl
                .iter()
                .map(|(n, v)| (node(*n), SLOTS[*v as usize % 4]))
                .collect();
            status.insert("perNode".into(), json!(m));
        }
    }
    let finalizers: Vec<String> = inp
        .finalizers
        .iter()
        .map(|n| teardown_finalizer(&node(*n)))
        .collect();
    let mut meta = json!({"name": "snap", "namespace": "ns", "uid": "u1", "resourceVersion": "7", "finalizers": finalizers});
    if inp.deleting {
        meta["deletionTimestamp"] = json!("2027-01-01T00:00:00Z");
    }
    let mut snap_json = json!({"apiVersion": "miroir.home-operations.com/v1alpha1", "kind": "MiroirSnapshot",
        "metadata": meta, "spec": {"volumeName": "vol"}});
    if inp.status.is_some() {
        snap_json["status"] = Value::Object(status);
    }
    let Ok(snap) = serde_json::from_value::<MiroirSnapshot>(snap_json) else {
        return;
    };
    let replicas: Vec<Value> = inp
        .replicas
        .iter()
        .take(3)
        .map(|(n, diskless)| json!({"node": node(*n), "diskless": diskless}))
        .collect();
    let per_node: BTreeMap<String, Value> = inp
        .node_status
        .iter()
        .map(|ns| {
            let disk_state = ["UpToDate", "Inconsistent", ""][ns.disk_state as usize % 3];
            (
                node(ns.node),
                json!({"deviceCreated": ns.device_created, "splitBrain": ns.split_brain,
            "diskState": disk_state}),
            )
        })
        .collect();
    let volume: MiroirVolume = serde_json::from_value(json!({"apiVersion": "miroir.home-operations.com/v1alpha1",
        "kind": "MiroirVolume", "metadata": {"name": "vol", "namespace": "ns"},
        "spec": {"sizeBytes": 1 << 30, "replicas": replicas}, "status": {"formatted": true, "perNode": per_node}})).unwrap();
    let heartbeats: BTreeMap<String, Timestamp> = inp
        .heartbeats
        .iter()
        .map(|(n, off)| {
            (
                node(*n),
                Timestamp::from_second(T0 + i64::from(*off)).unwrap(),
            )
        })
        .collect();
    let o = Observed {
        snapshot: &snap,
        volume: inp.volume.then_some(&volume),
        heartbeats: &heartbeats,
        other_round: inp.other_round.then_some("other"),
        fresh: inp.fresh,
        now,
    };
    let d = decide(&o, &s);
    assert_eq!(decide(&o, &s), d, "decide is a function of its input");
    check(&d, &o, &s);

    // The step's own write, then the table again at the same instant.
    let observed_at = snap.status.as_ref().and_then(|x| x.suspended_at.clone());
    let next = match &d.step {
        Step::Open { stamp, diskful } => Some(apply(&snap, open_patch_of(&snap, stamp, diskful, &[]))),
        Step::Void { stamp, diskful, .. } => Some(apply(
            &snap,
            void_patch("u1", observed_at.as_deref(), "7", stamp, diskful, &[]),
        )),
        Step::Publish {
            size_bytes,
            source_formatted,
            slots,
            ..
        } => Some(apply(
            &snap,
            publish_patch(
                "u1",
                observed_at.as_deref(),
                "7",
                *size_bytes,
                *source_formatted,
                slots,
                &[],
            ),
        )),
        Step::Unpublish => Some(apply(&snap, unpublish_patch("u1", "7", &[]))),
        _ => None,
    };
    if let Some(next) = next {
        let o2 = Observed {
            snapshot: &next,
            fresh: true,
            ..o
        };
        let d2 = decide(&o2, &s);
        check(&d2, &o2, &s);
        match &d.step {
            Step::Open { stamp, .. } => {
                assert_eq!(d2.step, Step::Wait, "just opened: {d2:?}");
                let deadline = parse_stamp(stamp).unwrap()
                    + jiff::SignedDuration::try_from(s.deadline).unwrap();
                assert_eq!(d2.requeue_at, Some(deadline));
            }
            Step::Void { .. } => {
                assert_eq!(d2.step, Step::Wait, "just voided: {d2:?}");
            }
            Step::Publish { .. } => {
                assert_eq!(d2.step, Step::Wait);
                assert!(d2.ready.is_some_and(|r| r.status));
            }
            Step::Unpublish => {
                let st = next.status.as_ref().unwrap();
                assert_eq!((st.ready_to_use, st.io_suspended), (Some(false), Some(false)));
                assert_ne!(d2.step, Step::Unpublish, "corrected twice: {d2:?}");
            }
            _ => {}
        }
    }
});
