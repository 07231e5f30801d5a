//! The IO barrier (docs/snapshot.md, "Backends and barrier"): DRBD `suspend-io`/`resume-io` plus
//! FIFREEZE/FITHAW on the mounted filesystem. Implementations: DRBD (`drbd`) and the recording test
//! double (`fake`). Unreplicated volumes take no barrier at all (the agent's `CutUnreplicated`
//! step; docs/snapshot.md, "Special legs"). Invariants (I2, I8, I12) are those of docs/snapshot.md,
//! "Invariants".

pub mod drbd;
pub mod fake;
pub mod mount;

use std::path::{Path, PathBuf};

use futures::future::BoxFuture;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BarrierError(pub String);

pub type Result<T> = std::result::Result<T, BarrierError>;

/// One peer of a DRBD resource as the local kernel sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// DRBD host name, which is the Kubernetes node name.
    pub node: String,
    /// e.g. `Connected`, `Connecting`, `StandAlone`.
    pub connection: String,
    /// e.g. `UpToDate`, `Inconsistent`, `Diskless`, `DUnknown`.
    pub disk: String,
    /// `Primary`, `Secondary` or `Unknown`.
    pub role: String,
    /// A resync runs towards or from this peer.
    pub resyncing: bool,
}

/// A DRBD resource on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceStatus {
    /// The kernel's user-suspend flag (`suspended-user`).
    pub suspended_user: bool,
    /// `Primary` or `Secondary`.
    pub role: String,
    /// Local disk state; `Diskless` on tie-breakers and client legs.
    pub disk: String,
    pub peers: Vec<Peer>,
}

impl ResourceStatus {
    pub fn is_primary(&self) -> bool {
        self.role == "Primary"
    }

    /// DRBD 8.4 does not name its peer in `events2` (`conn-name:peer`; it has exactly one): give
    /// a single peer that is none of the volume's nodes the volume's only other node, so the
    /// checks below can name it.
    pub fn name_peer(mut self, others: &[String]) -> Self {
        if let ([p], [other]) = (self.peers.as_mut_slice(), others)
            && !others.contains(&p.node)
        {
            p.node = other.clone();
        }
        self
    }

    /// Connected peers that are Primary: the write origin when it is not this node (I2).
    pub fn primary_peers(&self) -> Vec<String> {
        self.peers
            .iter()
            .filter(|p| p.connection == "Connected" && p.role == "Primary")
            .map(|p| p.node.clone())
            .collect()
    }
}

/// Precondition 3 of docs/snapshot.md, "Raise and cut", on the kernel's view: local disk `UpToDate`
/// (diskful leg), every diskful peer connected and `UpToDate`, nothing resyncing. Split brain shows
/// as a peer that is not `Connected` (DRBD drops to StandAlone).
pub fn healthy(
    status: &ResourceStatus,
    local_diskful: bool,
    diskful_peers: &[String],
) -> std::result::Result<(), String> {
    if local_diskful && status.disk != "UpToDate" {
        return Err(format!("local disk is {}, not UpToDate", status.disk));
    }
    for node in diskful_peers {
        let Some(p) = status.peers.iter().find(|p| &p.node == node) else {
            return Err(format!("peer {node} is not configured on this node"));
        };
        if p.connection != "Connected" {
            return Err(format!("peer {node} is {}, not Connected", p.connection));
        }
        if p.disk != "UpToDate" {
            return Err(format!("peer {node} disk is {}, not UpToDate", p.disk));
        }
    }
    if let Some(p) = status.peers.iter().find(|p| p.resyncing) {
        return Err(format!("a resync with {} is in progress", p.node));
    }
    Ok(())
}

/// Precondition 4 of docs/snapshot.md, "Raise and cut" (I8): the user-suspend flag must be
/// clear unless this agent's journal records it for this very round. Someone else's barrier is
/// never touched.
pub fn flag_free(
    status: &ResourceStatus,
    resource: &str,
    journal_holds_round: bool,
) -> std::result::Result<(), String> {
    if status.suspended_user && !journal_holds_round {
        Err(format!(
            "IO on DRBD resource {resource} is already suspended by another round or an operator; refusing to raise a second barrier"
        ))
    } else {
        Ok(())
    }
}

pub trait Barrier: Send + Sync {
    /// The resource's state on this node; None when it is not configured here.
    fn status<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<ResourceStatus>>>;
    /// `suspend-io`; idempotent.
    fn suspend<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<()>>;
    /// `resume-io`; idempotent.
    fn resume<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<()>>;
    /// Resources on this node with the user-suspend flag set.
    fn suspended(&self) -> BoxFuture<'_, Result<Vec<String>>>;
    /// Where the resource's device is mounted on this node, if anywhere.
    fn mountpoint<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<PathBuf>>>;
    /// FIFREEZE; "already frozen" is success.
    fn freeze<'a>(&'a self, resource: &'a str, mountpoint: &'a Path) -> BoxFuture<'a, Result<()>>;
    /// FITHAW; "not frozen" is success.
    fn thaw<'a>(&'a self, resource: &'a str, mountpoint: &'a Path) -> BoxFuture<'a, Result<()>>;
    /// Called after a successful cut (sync, delete and cut took `took`); only the fake barrier
    /// records it (event log order, and the cut time `make bench` subtracts).
    fn note_cut<'a>(
        &'a self,
        _resource: &'a str,
        _snapshot: &'a str,
        _took: std::time::Duration,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(node: &str, conn: &str, disk: &str, role: &str) -> Peer {
        Peer {
            node: node.into(),
            connection: conn.into(),
            disk: disk.into(),
            role: role.into(),
            resyncing: false,
        }
    }

    fn status(disk: &str, peers: Vec<Peer>) -> ResourceStatus {
        ResourceStatus {
            suspended_user: false,
            role: "Secondary".into(),
            disk: disk.into(),
            peers,
        }
    }

    #[test]
    fn health_rules() {
        let d = vec!["b".to_string()];
        let ok = status(
            "UpToDate",
            vec![
                peer("b", "Connected", "UpToDate", "Primary"),
                peer("t", "Connecting", "DUnknown", "Unknown"),
            ],
        );
        // A disconnected tie-breaker does not matter (I12).
        assert_eq!(healthy(&ok, true, &d), Ok(()));
        assert_eq!(ok.primary_peers(), ["b"]);
        assert_eq!(
            healthy(&status("Inconsistent", ok.peers.clone()), true, &d),
            Err("local disk is Inconsistent, not UpToDate".into())
        );
        // A diskless Primary's own disk state is irrelevant.
        assert_eq!(
            healthy(&status("Diskless", ok.peers.clone()), false, &d),
            Ok(())
        );
        let s = status(
            "UpToDate",
            vec![peer("b", "StandAlone", "DUnknown", "Unknown")],
        );
        assert_eq!(
            healthy(&s, true, &d),
            Err("peer b is StandAlone, not Connected".into())
        );
        let s = status(
            "UpToDate",
            vec![peer("b", "Connected", "Outdated", "Secondary")],
        );
        assert_eq!(
            healthy(&s, true, &d),
            Err("peer b disk is Outdated, not UpToDate".into())
        );
        let mut p = peer("b", "Connected", "UpToDate", "Secondary");
        p.resyncing = true;
        assert_eq!(
            healthy(&status("UpToDate", vec![p]), true, &d),
            Err("a resync with b is in progress".into())
        );
        assert_eq!(
            healthy(&status("UpToDate", vec![]), true, &d),
            Err("peer b is not configured on this node".into())
        );
    }

    #[test]
    fn foreign_flag_is_refused() {
        let mut s = status("UpToDate", vec![]);
        assert!(flag_free(&s, "pvc-1", false).is_ok());
        s.suspended_user = true;
        assert!(flag_free(&s, "pvc-1", true).is_ok());
        assert_eq!(
            flag_free(&s, "pvc-1", false),
            Err("IO on DRBD resource pvc-1 is already suspended by another round or an operator; refusing to raise a second barrier".into())
        );
    }
}
