//! Pure helpers shared by the manager and the agent: the heartbeat Leases' name and label, round
//! identity, time stamps, slot queries and the exact fenced JSON Patch bodies (docs/snapshot.md, "Slot writes" and "Round writes").

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use serde_json::{Value, json};

use super::types::{MiroirSnapshot, MiroirSnapshotStatus, SlotState};
use crate::runtime::time::whole_seconds;

/// Prefix of the agents' heartbeat Leases.
pub const AGENT_LEASE_PREFIX: &str = "ucm-snapshot-agent-";
/// The label every heartbeat Lease carries (set at each renewal): the manager watches those
/// Leases apart from the round grants, whose number grows with the volumes.
pub const AGENT_LEASE_LABEL: (&str, &str) = ("app.kubernetes.io/name", "ucm-snapshot-agent");

/// Parses a `suspendedAt` stamp. Unparseable stamps are treated by callers as "expired".
pub fn parse_stamp(s: &str) -> Option<Timestamp> {
    s.parse::<Timestamp>().ok()
}

/// RFC 3339 UTC with second precision (docs/snapshot.md, "Objects").
pub fn format_stamp(ts: Timestamp) -> String {
    whole_seconds(ts).to_string()
}

/// Non-negative time from `from` to `to`.
pub fn elapsed(from: Timestamp, to: Timestamp) -> Duration {
    let d = to.duration_since(from);
    if d.is_negative() {
        Duration::ZERO
    } else {
        d.unsigned_abs()
    }
}

/// Go-like short duration text for messages: "45s", "2m10s", "1h2m3s".
pub fn human(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, (s % 3600) / 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec}s"),
        (h, m, sec) => format!("{h}h{m}m{sec}s"),
    }
}

/// Time of day of a stamp for messages ("10:15:02Z").
pub fn clock(ts: Timestamp) -> String {
    let s = format_stamp(ts);
    s.split_once('T').map(|(_, t)| t.to_string()).unwrap_or(s)
}

/// RFC 6901 escaping of one reference token.
pub fn escape_pointer(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

/// The round a snapshot's status describes, as far as the fields go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoundView<'a> {
    pub ready: bool,
    pub io_suspended: bool,
    pub suspended_at: Option<&'a str>,
    pub slots: &'a BTreeMap<String, SlotState>,
}

static NO_SLOTS: BTreeMap<String, SlotState> = BTreeMap::new();

impl<'a> RoundView<'a> {
    pub fn of(s: &'a MiroirSnapshot) -> Self {
        Self::of_status(s.status.as_ref())
    }

    pub fn of_status(st: Option<&'a MiroirSnapshotStatus>) -> Self {
        RoundView {
            ready: st.and_then(|s| s.ready_to_use).unwrap_or(false),
            io_suspended: st.and_then(|s| s.io_suspended).unwrap_or(false),
            suspended_at: st.and_then(|s| s.suspended_at.as_deref()),
            slots: st.and_then(|s| s.per_node.as_ref()).unwrap_or(&NO_SLOTS),
        }
    }

    pub fn slot(&self, node: &str) -> Option<SlotState> {
        self.slots.get(node).copied()
    }

    /// Every node in `diskful` has a slot in one of `states`. False for an empty set: a round
    /// with nothing to cut never counts as complete.
    pub fn all_diskful_in(&self, diskful: &[String], states: &[SlotState]) -> bool {
        !diskful.is_empty()
            && diskful
                .iter()
                .all(|n| self.slot(n).is_some_and(|s| states.contains(&s)))
    }

    /// The first node (in key order) whose slot is `Error`.
    pub fn first_error(&self) -> Option<&'a str> {
        self.slots
            .iter()
            .find(|(_, s)| **s == SlotState::Error)
            .map(|(n, _)| n.as_str())
    }
}

fn status_path(field: &str) -> String {
    format!("/status/{field}")
}

fn test(path: &str, value: Value) -> Value {
    json!({"op": "test", "path": path, "value": value})
}

fn add(path: &str, value: Value) -> Value {
    json!({"op": "add", "path": path, "value": value})
}

fn pending_slots(diskful: &[String]) -> Value {
    let m: serde_json::Map<String, Value> = diskful
        .iter()
        .map(|n| (n.clone(), json!(SlotState::Pending.as_str())))
        .collect();
    Value::Object(m)
}

fn conditions_value(conditions: &[Condition]) -> Value {
    serde_json::to_value(conditions).unwrap_or_else(|_| json!([]))
}

/// The agent's slot write (docs/snapshot.md, "Slot writes"): exactly three tests and one add on its
/// own escaped key.
pub fn agent_slot_patch(uid: &str, suspended_at: &str, node: &str, state: SlotState) -> Value {
    json!([
        test("/metadata/uid", json!(uid)),
        test("/status/ioSuspended", json!(true)),
        test("/status/suspendedAt", json!(suspended_at)),
        add(
            &format!("/status/perNode/{}", escape_pointer(node)),
            json!(state.as_str())
        ),
    ])
}

/// First status write of the manager (docs/snapshot.md, "Who writes what"): `readyToUse` and
/// `ioSuspended` become present (false), keeping every other status field. Fenced by
/// `resourceVersion` because no round can be open yet.
pub fn init_patch(
    uid: &str,
    resource_version: &str,
    current: Option<&MiroirSnapshotStatus>,
    conditions: &[Condition],
) -> Value {
    let mut st = current.cloned().unwrap_or_default();
    st.ready_to_use.get_or_insert(false);
    st.io_suspended.get_or_insert(false);
    st.conditions = conditions.to_vec();
    json!([
        test("/metadata/uid", json!(uid)),
        test("/metadata/resourceVersion", json!(resource_version)),
        add(
            "/status",
            serde_json::to_value(&st).unwrap_or_else(|_| json!({}))
        ),
    ])
}

/// The tests that pin a manager write to the round it was computed from.
fn round_tests(uid: &str, io_suspended: bool, suspended_at: Option<&str>) -> Vec<Value> {
    let mut ops = vec![
        test("/metadata/uid", json!(uid)),
        test("/status/ioSuspended", json!(io_suspended)),
    ];
    if let Some(at) = suspended_at {
        ops.push(test("/status/suspendedAt", json!(at)));
    }
    ops
}

/// Open a round (docs/snapshot.md, "Round writes").
pub fn open_patch(
    uid: &str,
    observed_suspended_at: Option<&str>,
    resource_version: &str,
    stamp: &str,
    diskful: &[String],
    conditions: &[Condition],
) -> Value {
    let mut ops = round_tests(uid, false, observed_suspended_at);
    if observed_suspended_at.is_none() {
        // No stamp to pin yet: the resourceVersion stands in for it.
        ops.push(test("/metadata/resourceVersion", json!(resource_version)));
    }
    ops.push(test("/status/readyToUse", json!(false)));
    ops.push(add(&status_path("ioSuspended"), json!(true)));
    ops.push(add(&status_path("suspendedAt"), json!(stamp)));
    ops.push(add(&status_path("perNode"), pending_slots(diskful)));
    ops.push(add(
        &status_path("conditions"),
        conditions_value(conditions),
    ));
    Value::Array(ops)
}

/// The fence of a write to an open round: its `suspendedAt`, or, for a round whose stamp is missing
/// (manager row 8 voids it as expired), the resourceVersion, as `open_patch` does. A test on the
/// absent field would always fail and leave such a round suspended forever (found by the
/// `snapshot_round` fuzz target).
fn open_round_tests(uid: &str, round: Option<&str>, resource_version: &str) -> Vec<Value> {
    let mut ops = round_tests(uid, true, round);
    if round.is_none() {
        ops.push(test("/metadata/resourceVersion", json!(resource_version)));
    }
    ops
}

/// The open patch for `snap` as observed: [`open_patch`] once the flags are present, else (the
/// snapshot's first status write, docs/snapshot.md "Manager states" row 3) the whole status with
/// the flags and the round, pinned to the resourceVersion: no round can be open before it.
pub fn open_patch_of(
    snap: &MiroirSnapshot,
    stamp: &str,
    diskful: &[String],
    conditions: &[Condition],
) -> Value {
    let uid = snap.metadata.uid.as_deref().unwrap_or_default();
    let rv = snap
        .metadata
        .resource_version
        .as_deref()
        .unwrap_or_default();
    let st = snap.status.as_ref();
    if st.is_some_and(|s| s.ready_to_use.is_some() && s.io_suspended.is_some()) {
        let at = st.and_then(|s| s.suspended_at.as_deref());
        return open_patch(uid, at, rv, stamp, diskful, conditions);
    }
    let mut status = st.cloned().unwrap_or_default();
    status.ready_to_use = Some(false);
    status.io_suspended = Some(true);
    status.suspended_at = Some(stamp.to_string());
    status.per_node = Some(
        diskful
            .iter()
            .map(|n| (n.clone(), SlotState::Pending))
            .collect(),
    );
    status.conditions = conditions.to_vec();
    json!([
        test("/metadata/uid", json!(uid)),
        test("/metadata/resourceVersion", json!(rv)),
        add(
            "/status",
            serde_json::to_value(&status).unwrap_or_else(|_| json!({}))
        ),
    ])
}

/// Publish a round in one fenced write (docs/snapshot.md, "Round writes"). `round` is the observed
/// `suspendedAt`.
pub fn publish_patch(
    uid: &str,
    round: Option<&str>,
    resource_version: &str,
    size_bytes: i64,
    source_formatted: bool,
    slots: &BTreeMap<String, SlotState>,
    conditions: &[Condition],
) -> Value {
    let mut ops = open_round_tests(uid, round, resource_version);
    ops.push(add(&status_path("ioSuspended"), json!(false)));
    ops.push(add(&status_path("readyToUse"), json!(true)));
    ops.push(add(&status_path("sizeBytes"), json!(size_bytes)));
    ops.push(add(
        &status_path("sourceFormatted"),
        json!(source_formatted),
    ));
    ops.push(add(&status_path("perNode"), json!(slots)));
    ops.push(add(
        &status_path("conditions"),
        conditions_value(conditions),
    ));
    Value::Array(ops)
}

/// Void a round (docs/snapshot.md, "Round writes"). `round` is the observed `suspendedAt`.
pub fn void_patch(
    uid: &str,
    round: Option<&str>,
    resource_version: &str,
    stamp: &str,
    diskful: &[String],
    conditions: &[Condition],
) -> Value {
    let mut ops = open_round_tests(uid, round, resource_version);
    ops.push(add(&status_path("ioSuspended"), json!(false)));
    ops.push(add(&status_path("suspendedAt"), json!(stamp)));
    ops.push(add(&status_path("perNode"), pending_slots(diskful)));
    ops.push(add(
        &status_path("conditions"),
        conditions_value(conditions),
    ));
    Value::Array(ops)
}

/// Set a forged `readyToUse` back to false (manager row 2): pinned to the resourceVersion the
/// forgery was seen at, so it never undoes a later write. `ioSuspended` goes false too: agents
/// lift on a `readyToUse` (agent row 2), so a round that was open is over; its `suspendedAt` stays
/// and counts as a void's (the backoff runs from it).
pub fn unpublish_patch(uid: &str, resource_version: &str, conditions: &[Condition]) -> Value {
    json!([
        test("/metadata/uid", json!(uid)),
        test("/metadata/resourceVersion", json!(resource_version)),
        add(&status_path("readyToUse"), json!(false)),
        add(&status_path("ioSuspended"), json!(false)),
        add(&status_path("conditions"), conditions_value(conditions)),
    ])
}

/// Conditions alone, pinned to the observed round fields so it can never undo a round change.
pub fn conditions_patch(
    uid: &str,
    io_suspended: bool,
    suspended_at: Option<&str>,
    conditions: &[Condition],
) -> Value {
    let mut ops = round_tests(uid, io_suspended, suspended_at);
    ops.push(add(
        &status_path("conditions"),
        conditions_value(conditions),
    ));
    Value::Array(ops)
}

/// Replace the finalizer list, fenced by `resourceVersion` (manager adds, agent removes its own).
pub fn finalizers_patch(uid: &str, resource_version: &str, finalizers: &[String]) -> Value {
    json!([
        test("/metadata/uid", json!(uid)),
        test("/metadata/resourceVersion", json!(resource_version)),
        add("/metadata/finalizers", json!(finalizers)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::time::after;

    /// Applies a patch body the way the API server does (RFC 6902, all or nothing).
    fn apply(doc: &mut Value, p: Value) -> Result<(), json_patch::PatchError> {
        let p: json_patch::Patch = serde_json::from_value(p).unwrap();
        json_patch::patch(doc, &p)
    }

    fn nodes(ns: &[&str]) -> Vec<String> {
        ns.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn stamps_are_second_precision_utc() {
        let ts: Timestamp = "2025-03-01T10:15:02.987654Z".parse().unwrap();
        assert_eq!(format_stamp(ts), "2025-03-01T10:15:02Z");
        assert_eq!(
            parse_stamp("2025-03-01T10:15:02Z").unwrap().as_second(),
            ts.as_second()
        );
        assert_eq!(parse_stamp("yesterday"), None);
        assert_eq!(clock(ts), "10:15:02Z");
        assert_eq!(
            format_stamp(after(ts, Duration::from_secs(60))),
            "2025-03-01T10:16:02Z"
        );
    }

    #[test]
    fn human_durations() {
        assert_eq!(human(Duration::from_secs(45)), "45s");
        assert_eq!(human(Duration::from_secs(130)), "2m10s");
        assert_eq!(human(Duration::from_secs(3723)), "1h2m3s");
        let a: Timestamp = "2025-03-01T10:00:00Z".parse().unwrap();
        let b: Timestamp = "2025-03-01T10:00:05Z".parse().unwrap();
        assert_eq!(elapsed(a, b), Duration::from_secs(5));
        assert_eq!(elapsed(b, a), Duration::ZERO);
    }

    #[test]
    fn pointer_escape_follows_rfc6901() {
        assert_eq!(escape_pointer("node-a"), "node-a");
        assert_eq!(escape_pointer("a/b~c"), "a~1b~0c");
        // Order matters: "~1" must not become "~01".
        assert_eq!(escape_pointer("~1"), "~01");
    }

    #[test]
    fn agent_patch_has_three_tests_and_one_add_on_its_own_key() {
        let p = agent_slot_patch(
            "u-1",
            "2025-03-01T10:15:02Z",
            "node/a",
            SlotState::Suspended,
        );
        assert_eq!(
            p,
            json!([
                {"op": "test", "path": "/metadata/uid", "value": "u-1"},
                {"op": "test", "path": "/status/ioSuspended", "value": true},
                {"op": "test", "path": "/status/suspendedAt", "value": "2025-03-01T10:15:02Z"},
                {"op": "add", "path": "/status/perNode/node~1a", "value": "Suspended"},
            ])
        );
    }

    #[test]
    fn agent_patch_applies_only_to_the_round_it_names() {
        let doc = json!({
            "metadata": {"uid": "u-1"},
            "status": {"ioSuspended": true, "suspendedAt": "2025-03-01T10:16:40Z",
                       "perNode": {"a": "Pending", "b": "Pending"}}
        });
        // A late Done from the previous round is fenced out.
        let late = agent_slot_patch("u-1", "2025-03-01T10:15:02Z", "a", SlotState::Done);
        let mut d = doc.clone();
        assert!(apply(&mut d, late).is_err());
        // So is a write for a re-created object of the same name.
        let other = agent_slot_patch("u-0", "2025-03-01T10:16:40Z", "a", SlotState::Done);
        let mut d = doc.clone();
        assert!(apply(&mut d, other).is_err());
        // The current round's write changes exactly its own slot.
        let ok = agent_slot_patch("u-1", "2025-03-01T10:16:40Z", "a", SlotState::Suspended);
        let mut d = doc.clone();
        apply(&mut d, ok).unwrap();
        let mut want = doc.clone();
        want["status"]["perNode"]["a"] = json!("Suspended");
        assert_eq!(d, want);
    }

    #[test]
    fn open_patch_pins_the_observed_round() {
        let p = open_patch(
            "u",
            Some("2025-03-01T10:00:00Z"),
            "41",
            "2025-03-01T10:00:31Z",
            &nodes(&["a", "b"]),
            &[],
        );
        let ops = p.as_array().unwrap();
        assert_eq!(
            ops[0],
            json!({"op": "test", "path": "/metadata/uid", "value": "u"})
        );
        assert_eq!(
            ops[1],
            json!({"op": "test", "path": "/status/ioSuspended", "value": false})
        );
        assert_eq!(
            ops[2],
            json!({"op": "test", "path": "/status/suspendedAt", "value": "2025-03-01T10:00:00Z"})
        );
        assert_eq!(
            ops[3],
            json!({"op": "test", "path": "/status/readyToUse", "value": false})
        );
        assert!(ops.iter().all(|o| o["path"] != "/metadata/resourceVersion"));
        let mut doc = json!({"metadata": {"uid": "u", "resourceVersion": "41"}, "status": {
            "readyToUse": false, "ioSuspended": false, "suspendedAt": "2025-03-01T10:00:00Z",
            "perNode": {"a": "Pending", "b": "Pending", "gone": "Done"}}});
        apply(&mut doc, p.clone()).unwrap();
        assert_eq!(doc["status"]["ioSuspended"], true);
        assert_eq!(doc["status"]["suspendedAt"], "2025-03-01T10:00:31Z");
        assert_eq!(
            doc["status"]["perNode"],
            json!({"a": "Pending", "b": "Pending"})
        );
        // The same patch cannot open a second round.
        assert!(apply(&mut doc, p).is_err());
    }

    #[test]
    fn first_open_is_pinned_by_resource_version() {
        let p = open_patch("u", None, "41", "2025-03-01T10:00:31Z", &nodes(&["a"]), &[]);
        let ops = p.as_array().unwrap();
        assert!(
            ops.contains(
                &json!({"op": "test", "path": "/metadata/resourceVersion", "value": "41"})
            )
        );
        let mut doc = json!({"metadata": {"uid": "u", "resourceVersion": "42"},
            "status": {"readyToUse": false, "ioSuspended": false}});
        assert!(apply(&mut doc, p).is_err());
    }

    #[test]
    fn publish_and_void_are_fenced_on_the_round() {
        let slots: BTreeMap<String, SlotState> = [
            ("a".to_string(), SlotState::Done),
            ("b".to_string(), SlotState::Done),
        ]
        .into();
        let doc = json!({"metadata": {"uid": "u"}, "status": {
            "readyToUse": false, "ioSuspended": true, "suspendedAt": "2025-03-01T10:00:31Z",
            "perNode": {"a": "Done", "b": "Done", "client": "Suspended"}}});
        let pubp = publish_patch(
            "u",
            Some("2025-03-01T10:00:31Z"),
            "9",
            1 << 20,
            true,
            &slots,
            &[],
        );
        let mut d = doc.clone();
        apply(&mut d, pubp).unwrap();
        assert_eq!(d["status"]["readyToUse"], true);
        assert_eq!(d["status"]["ioSuspended"], false);
        assert_eq!(d["status"]["sizeBytes"], 1 << 20);
        assert_eq!(d["status"]["sourceFormatted"], true);
        assert_eq!(d["status"]["perNode"], json!({"a": "Done", "b": "Done"}));
        assert_eq!(d["status"]["suspendedAt"], "2025-03-01T10:00:31Z");

        let stale = publish_patch("u", Some("2025-03-01T09:59:00Z"), "9", 1, true, &slots, &[]);
        let mut d = doc.clone();
        assert!(apply(&mut d, stale).is_err());

        let v = void_patch(
            "u",
            Some("2025-03-01T10:00:31Z"),
            "9",
            "2025-03-01T10:01:31Z",
            &nodes(&["a", "b"]),
            &[],
        );
        let mut d = doc.clone();
        apply(&mut d, v).unwrap();
        assert_eq!(d["status"]["ioSuspended"], false);
        assert_eq!(d["status"]["readyToUse"], false);
        assert_eq!(d["status"]["suspendedAt"], "2025-03-01T10:01:31Z");
        assert_eq!(
            d["status"]["perNode"],
            json!({"a": "Pending", "b": "Pending"})
        );
    }

    #[test]
    fn a_round_without_its_stamp_can_still_be_voided_or_published() {
        // ioSuspended with no suspendedAt (manager row 8 voids it as expired): fenced on the
        // resourceVersion, since a test on the missing field could never pass.
        let doc = json!({"metadata": {"uid": "u", "resourceVersion": "9"}, "status": {
            "readyToUse": false, "ioSuspended": true, "perNode": {"a": "Pending"}}});
        let v = void_patch("u", None, "9", "2025-03-01T10:01:31Z", &nodes(&["a"]), &[]);
        let mut d = doc.clone();
        apply(&mut d, v.clone()).unwrap();
        assert_eq!(d["status"]["ioSuspended"], false);
        assert_eq!(d["status"]["suspendedAt"], "2025-03-01T10:01:31Z");
        let mut newer = doc.clone();
        newer["metadata"]["resourceVersion"] = json!("10");
        assert!(apply(&mut newer, v).is_err(), "still fenced");
        let slots: BTreeMap<String, SlotState> = [("a".to_string(), SlotState::Done)].into();
        let p = publish_patch("u", None, "9", 1, false, &slots, &[]);
        let mut d = doc.clone();
        apply(&mut d, p).unwrap();
        assert_eq!(d["status"]["readyToUse"], true);
    }

    #[test]
    fn init_keeps_existing_fields_and_adds_false_flags() {
        let cur = MiroirSnapshotStatus {
            size_bytes: Some(7),
            ..Default::default()
        };
        let p = init_patch("u", "5", Some(&cur), &[]);
        let mut d = json!({"metadata": {"uid": "u", "resourceVersion": "5"}});
        apply(&mut d, p).unwrap();
        assert_eq!(
            d["status"],
            json!({"readyToUse": false, "ioSuspended": false, "sizeBytes": 7})
        );
    }

    #[test]
    fn round_view_queries() {
        let st = MiroirSnapshotStatus {
            io_suspended: Some(true),
            per_node: Some(
                [
                    ("a".to_string(), SlotState::Done),
                    ("b".to_string(), SlotState::Suspended),
                    ("c".to_string(), SlotState::Error),
                ]
                .into(),
            ),
            ..Default::default()
        };
        let r = RoundView::of_status(Some(&st));
        assert!(r.io_suspended && !r.ready);
        assert!(r.all_diskful_in(
            &nodes(&["a", "b"]),
            &[SlotState::Suspended, SlotState::Done]
        ));
        assert!(!r.all_diskful_in(&nodes(&["a", "b"]), &[SlotState::Done]));
        assert!(!r.all_diskful_in(&nodes(&["a", "z"]), &[SlotState::Done]));
        assert!(!r.all_diskful_in(&[], &[SlotState::Done]));
        assert_eq!(r.first_error(), Some("c"));
        let empty = RoundView::of_status(None);
        assert!(!empty.io_suspended && empty.suspended_at.is_none() && empty.slots.is_empty());
    }
}
