//! One round per volume (I8, docs/snapshot.md, "One round per volume"), without listing the
//! volume's snapshots: before a round opens, the manager writes a **grant** on a Lease of that
//! volume (`ucm-snapshot-round-<volume>`, in the agent namespace), fenced by the Lease's
//! `resourceVersion`, naming the snapshot and the `suspendedAt` the round will carry. A grant
//! is over once that round provably ended, read from the holder's status (cached or fresh): a
//! closed round never reopens without a new grant, so a stale copy can only make a successor
//! wait, never open early. A grant whose round never opened is over at its stamp + D, when no
//! agent would raise for it any more.
//!
//! Pure: the Lease's name, reading and writing a grant, and the holder's state.

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::round::{RoundView, format_stamp, parse_stamp};
use super::types::{MiroirSnapshot, MiroirVolume};
use crate::runtime::time::after;

/// Prefix of the per-volume round Leases (the agents' heartbeats use `ucm-snapshot-agent-`).
pub const ROUND_LEASE_PREFIX: &str = "ucm-snapshot-round-";

/// The round Lease of `volume`: the prefix and the name, or, where that would pass the 253
/// characters of an object name, a cut name and a hash of the whole.
pub fn lease_name(volume: &str) -> String {
    let name = format!("{ROUND_LEASE_PREFIX}{volume}");
    if name.len() <= 253 {
        return name;
    }
    let digest = Sha256::digest(volume.as_bytes());
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let mut cut = name[..253 - 17].to_string();
    while cut.ends_with(['-', '.']) {
        cut.pop();
    }
    format!("{cut}-{hash}")
}

/// A grant: the snapshot (name and uid) that may open a round stamped `stamp`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub snapshot: String,
    pub uid: String,
    pub stamp: Timestamp,
    /// The granting manager's D.
    pub deadline: Duration,
}

/// The grant a Lease holds: `holderIdentity` is `<snapshot>/<uid>`, `acquireTime` the stamp,
/// `leaseDurationSeconds` D. None for a Lease without a readable grant (treated as free: the
/// write that takes it is fenced all the same).
pub fn grant_of(lease: &Lease) -> Option<Grant> {
    let spec = lease.spec.as_ref()?;
    let (snapshot, uid) = spec.holder_identity.as_deref()?.rsplit_once('/')?;
    let stamp = spec.acquire_time.as_ref()?.0;
    let deadline = Duration::from_secs(spec.lease_duration_seconds?.max(0) as u64);
    Some(Grant {
        snapshot: snapshot.to_string(),
        uid: uid.to_string(),
        stamp,
        deadline,
    })
}

fn spec(snap: &MiroirSnapshot, stamp: &str, deadline: Duration) -> Value {
    json!({
        "holderIdentity": format!("{}/{}", snap.name_any(), snap.uid().unwrap_or_default()),
        "acquireTime": MicroTime(parse_stamp(stamp).unwrap_or_else(Timestamp::now)),
        "leaseDurationSeconds": deadline.as_secs().min(i32::MAX as u64),
    })
}

/// A new round Lease granting `snap` the round stamped `stamp`, owned by its volume so it goes
/// with the volume.
pub fn new_lease(
    namespace: &str,
    volume: &MiroirVolume,
    snap: &MiroirSnapshot,
    stamp: &str,
    deadline: Duration,
) -> Lease {
    let owner = volume.uid().map(|uid| OwnerReference {
        api_version: MiroirVolume::api_version(&()).into_owned(),
        kind: MiroirVolume::kind(&()).into_owned(),
        name: volume.name_any(),
        uid,
        ..Default::default()
    });
    Lease {
        metadata: ObjectMeta {
            name: Some(lease_name(&volume.name_any())),
            namespace: Some(namespace.to_string()),
            owner_references: owner.map(|o| vec![o]),
            labels: Some([("app.kubernetes.io/name".to_string(), "ucm".to_string())].into()),
            ..Default::default()
        },
        spec: serde_json::from_value::<LeaseSpec>(spec(snap, stamp, deadline)).ok(),
    }
}

/// Move the grant to `snap` for the round stamped `stamp`: the Lease's whole spec, fenced by the
/// `resourceVersion` the decision read, so two writers can never both take it.
pub fn grant_patch(
    resource_version: &str,
    snap: &MiroirSnapshot,
    stamp: &str,
    deadline: Duration,
) -> Value {
    json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version},
        {"op": "add", "path": "/spec", "value": spec(snap, stamp, deadline)},
    ])
}

/// What the grant's holder allows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder {
    /// The grant's round is over (or the grant is the asker's own): a new grant may be written.
    Over,
    /// The granted round is open: wait for it to close (its change wakes the waiters).
    Open,
    /// The granted round has not opened in this copy: wait, at most until the stamp + D.
    Pending(Timestamp),
    /// The holder is not in the cache: read it (uncached) and ask again.
    Unknown,
}

/// The state of `grant` given a copy of its holder (`holder`: the snapshot of that name, None
/// when there is none). `asker_uid` is the snapshot that wants to open.
pub fn holder_state(
    grant: &Grant,
    holder: Option<&MiroirSnapshot>,
    asker_uid: &str,
    now: Timestamp,
    deadline: Duration,
    fresh: bool,
) -> Holder {
    if grant.uid == asker_uid {
        // Its own earlier grant: that round is over per the asker's own status, which the open
        // patch tests.
        return Holder::Over;
    }
    let expiry = after(grant.stamp, deadline.max(grant.deadline));
    let Some(h) = holder.filter(|h| h.uid().as_deref() == Some(grant.uid.as_str())) else {
        // Gone (uncached read: deleted, or its name reused) or never seen in the cache.
        return if fresh || now >= expiry {
            Holder::Over
        } else {
            Holder::Unknown
        };
    };
    let r = RoundView::of(h);
    // A deleting snapshot's agents lift and raise no more (agent row 1); a published one is
    // terminal (I13).
    if h.metadata.deletion_timestamp.is_some() || r.ready {
        return Holder::Over;
    }
    if r.io_suspended {
        return Holder::Open;
    }
    // Closed: a void (or a corrected forgery) left a stamp at or after the grant's. Before the
    // open the stamp is older than the grant's (a new stamp is always later than the last).
    if r.suspended_at
        .and_then(parse_stamp)
        .is_some_and(|t| t >= grant.stamp)
    {
        return Holder::Over;
    }
    if now >= expiry {
        // Never opened (its manager stopped between the grant and the open), or opened and past
        // its deadline, where no agent holds or raises a barrier for it.
        return Holder::Over;
    }
    Holder::Pending(expiry)
}

/// The grant's stamp, as written, for messages.
pub fn stamp_text(g: &Grant) -> String {
    format_stamp(g.stamp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::types::{MiroirSnapshotSpec, MiroirSnapshotStatus};

    const D: Duration = Duration::from_secs(60);

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn snap(name: &str, uid: &str, status: Option<(bool, bool, Option<&str>)>) -> MiroirSnapshot {
        let mut s = MiroirSnapshot::new(
            name,
            MiroirSnapshotSpec {
                volume_name: "v".into(),
            },
        );
        s.metadata.uid = Some(uid.into());
        s.status = status.map(|(ready, open, at)| MiroirSnapshotStatus {
            ready_to_use: Some(ready),
            io_suspended: Some(open),
            suspended_at: at.map(str::to_string),
            ..Default::default()
        });
        s
    }

    fn granted(holder: &MiroirSnapshot, stamp: &str) -> Grant {
        let mut l = Lease::default();
        l.metadata.resource_version = Some("5".into());
        let mut doc = serde_json::to_value(&l).unwrap();
        let p = grant_patch("5", holder, stamp, D);
        json_patch::patch(
            &mut doc,
            &serde_json::from_value::<json_patch::Patch>(p).unwrap(),
        )
        .unwrap();
        grant_of(&serde_json::from_value(doc).unwrap()).unwrap()
    }

    #[test]
    fn a_grant_round_trips_through_the_lease() {
        let s1 = snap("s1", "u1", None);
        let g = granted(&s1, "2026-01-01T10:00:00Z");
        assert_eq!(g.snapshot, "s1");
        assert_eq!(g.uid, "u1");
        assert_eq!(g.stamp, ts("2026-01-01T10:00:00Z"));
        assert_eq!(g.deadline, D);
        assert_eq!(stamp_text(&g), "2026-01-01T10:00:00Z");
        assert_eq!(grant_of(&Lease::default()), None);
    }

    #[test]
    fn the_grant_write_is_fenced_by_the_resource_version_read() {
        // A stale Lease cache: someone granted the round since; our write must fail.
        let mut newer = Lease::default();
        newer.metadata.resource_version = Some("6".into());
        let mut doc = serde_json::to_value(&newer).unwrap();
        let p = grant_patch("5", &snap("s2", "u2", None), "2026-01-01T10:00:00Z", D);
        assert!(
            json_patch::patch(
                &mut doc,
                &serde_json::from_value::<json_patch::Patch>(p).unwrap()
            )
            .is_err()
        );
    }

    #[test]
    fn an_open_granted_round_holds_the_volume() {
        let now = ts("2026-01-01T10:00:10Z");
        let at = "2026-01-01T10:00:00Z";
        let h = snap("s1", "u1", Some((false, true, Some(at))));
        let g = granted(&h, at);
        assert_eq!(
            holder_state(&g, Some(&h), "u2", now, D, false),
            Holder::Open
        );
        // Also past its deadline: the manager voids it first, and that change wakes the waiters.
        let late = ts("2026-01-01T10:05:00Z");
        assert_eq!(
            holder_state(&g, Some(&h), "u2", late, D, false),
            Holder::Open
        );
    }

    #[test]
    fn a_stale_copy_of_the_holder_waits_and_never_frees_early() {
        // The cache still shows the holder before its open (older stamp, not suspended): it
        // may be opening right now, so the successor waits, until the stamp + D at most.
        let now = ts("2026-01-01T10:00:10Z");
        let before_open = snap(
            "s1",
            "u1",
            Some((false, false, Some("2026-01-01T09:59:00Z"))),
        );
        let g = granted(&before_open, "2026-01-01T10:00:00Z");
        let until = ts("2026-01-01T10:01:00Z");
        assert_eq!(
            holder_state(&g, Some(&before_open), "u2", now, D, false),
            Holder::Pending(until)
        );
        let never_initialised = snap("s1", "u1", None);
        assert_eq!(
            holder_state(&g, Some(&never_initialised), "u2", now, D, false),
            Holder::Pending(until)
        );
        // At the stamp + D no agent raises for that round any more.
        assert_eq!(
            holder_state(&g, Some(&before_open), "u2", until, D, false),
            Holder::Over
        );
    }

    #[test]
    fn a_closed_round_frees_the_volume() {
        let now = ts("2026-01-01T10:00:10Z");
        let at = "2026-01-01T10:00:00Z";
        let g = granted(&snap("s1", "u1", None), at);
        let published = snap("s1", "u1", Some((true, false, Some(at))));
        let voided = snap(
            "s1",
            "u1",
            Some((false, false, Some("2026-01-01T10:00:05Z"))),
        );
        let voided_same_second = snap("s1", "u1", Some((false, false, Some(at))));
        let mut deleting = snap("s1", "u1", Some((false, true, Some(at))));
        deleting.metadata.deletion_timestamp = Some(crate::conditions::now());
        for h in [published, voided, voided_same_second, deleting] {
            assert_eq!(
                holder_state(&g, Some(&h), "u2", now, D, false),
                Holder::Over,
                "{h:?}"
            );
        }
    }

    #[test]
    fn an_unknown_holder_is_read_before_the_volume_is_freed() {
        // After a restart, or with a cache behind the Lease's watch: the holder is not cached.
        let now = ts("2026-01-01T10:00:10Z");
        let at = "2026-01-01T10:00:00Z";
        let g = granted(&snap("s1", "u1", None), at);
        assert_eq!(holder_state(&g, None, "u2", now, D, false), Holder::Unknown);
        // A snapshot of that name with another uid is not the holder either.
        let reused = snap("s1", "u9", Some((false, false, None)));
        assert_eq!(
            holder_state(&g, Some(&reused), "u2", now, D, false),
            Holder::Unknown
        );
        // The uncached read found none: the holder is gone, its agents lifted (agent row 1).
        assert_eq!(holder_state(&g, None, "u2", now, D, true), Holder::Over);
        // The uncached read found it open: wait.
        let open = snap("s1", "u1", Some((false, true, Some(at))));
        assert_eq!(
            holder_state(&g, Some(&open), "u2", now, D, true),
            Holder::Open
        );
    }

    #[test]
    fn its_own_grant_never_blocks_a_snapshot() {
        let at = "2026-01-01T10:00:00Z";
        let me = snap("s1", "u1", Some((false, false, Some(at))));
        let g = granted(&me, at);
        assert_eq!(
            holder_state(&g, Some(&me), "u1", ts(at), D, false),
            Holder::Over
        );
    }

    #[test]
    fn lease_names_fit_and_stay_distinct() {
        assert_eq!(lease_name("pvc-1"), "ucm-snapshot-round-pvc-1");
        let long_a = format!("{}a", "x".repeat(252));
        let long_b = format!("{}b", "x".repeat(252));
        let (a, b) = (lease_name(&long_a), lease_name(&long_b));
        assert!(
            a.len() <= 253 && crate::k8s_names::is_dns_subdomain(&a),
            "{a}"
        );
        assert_ne!(a, b);
    }
}
