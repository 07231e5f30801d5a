//! Optional APIs (docs/vmexport.md, "Optional APIs"): KubeVirt
//! VirtualMachine/VirtualMachineInstance, snapshots, VirtualMachineTemplate and CDI DataVolume
//! are read only where installed.
//! Discovery runs at start and every 60 s; a watch starts once its API appears, and its events (and
//! the appearance itself) re-trigger the exports that depend on it. A missing API never stops the
//! manager.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::mpsc::UnboundedSender;

pub const DISCOVERY_PERIOD: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    VirtualMachine,
    VirtualMachineInstance,
    DataVolume,
    VirtualMachineSnapshot,
    VirtualMachineSnapshotContent,
    VolumeSnapshot,
    VirtualMachineTemplate,
}

const N: usize = 7;

impl Kind {
    pub const ALL: [Kind; N] = [
        Kind::VirtualMachine,
        Kind::VirtualMachineInstance,
        Kind::DataVolume,
        Kind::VirtualMachineSnapshot,
        Kind::VirtualMachineSnapshotContent,
        Kind::VolumeSnapshot,
        Kind::VirtualMachineTemplate,
    ];

    /// Group, versions in order of preference, kind, plural.
    fn def(
        self,
    ) -> (
        &'static str,
        &'static [&'static str],
        &'static str,
        &'static str,
    ) {
        match self {
            Kind::VirtualMachine => ("kubevirt.io", &["v1"], "VirtualMachine", "virtualmachines"),
            Kind::VirtualMachineInstance => (
                "kubevirt.io",
                &["v1"],
                "VirtualMachineInstance",
                "virtualmachineinstances",
            ),
            Kind::DataVolume => ("cdi.kubevirt.io", &["v1beta1"], "DataVolume", "datavolumes"),
            Kind::VirtualMachineSnapshot => (
                "snapshot.kubevirt.io",
                &["v1beta1", "v1alpha1"],
                "VirtualMachineSnapshot",
                "virtualmachinesnapshots",
            ),
            Kind::VirtualMachineSnapshotContent => (
                "snapshot.kubevirt.io",
                &["v1beta1", "v1alpha1"],
                "VirtualMachineSnapshotContent",
                "virtualmachinesnapshotcontents",
            ),
            Kind::VolumeSnapshot => (
                "snapshot.storage.k8s.io",
                &["v1"],
                "VolumeSnapshot",
                "volumesnapshots",
            ),
            // virt-template serves v1beta1 (storage) and the deprecated v1alpha1.
            Kind::VirtualMachineTemplate => (
                "template.kubevirt.io",
                &["v1beta1", "v1alpha1"],
                "VirtualMachineTemplate",
                "virtualmachinetemplates",
            ),
        }
    }

    /// The resource at its most preferred version.
    pub fn resource(self) -> ApiResource {
        self.resource_at(self.def().1[0])
    }

    fn resource_at(self, version: &str) -> ApiResource {
        let (group, _, kind, plural) = self.def();
        ApiResource {
            group: group.into(),
            version: version.into(),
            api_version: format!("{group}/{version}"),
            kind: kind.into(),
            plural: plural.into(),
        }
    }

    /// `group/Kind`, for messages.
    pub fn gvk(self) -> String {
        let (group, versions, kind, _) = self.def();
        format!("{group}/{} {kind}", versions.join(" or "))
    }
}

/// A started watch: its cache and the version it watches.
type Watched = (Store<DynamicObject>, ApiResource);

/// Stores of the optional kinds; `None` while the API is not installed (or not yet listed).
#[derive(Default)]
pub struct Optional {
    stores: RwLock<[Option<Watched>; N]>,
}

impl Optional {
    fn idx(k: Kind) -> usize {
        Kind::ALL.iter().position(|x| *x == k).unwrap_or(0)
    }

    /// The store once its initial list is complete.
    pub fn store(&self, k: Kind) -> Option<Store<DynamicObject>> {
        self.store_with_resource(k).map(|(s, _)| s)
    }

    /// The store and the version it watches.
    pub fn store_with_resource(&self, k: Kind) -> Option<(Store<DynamicObject>, ApiResource)> {
        let (s, ar) =
            self.stores.read().unwrap_or_else(|e| e.into_inner())[Self::idx(k)].clone()?;
        use futures::FutureExt;
        matches!(s.wait_until_ready().now_or_never(), Some(Ok(()))).then_some((s, ar))
    }

    fn started(&self, k: Kind) -> bool {
        self.stores.read().unwrap_or_else(|e| e.into_inner())[Self::idx(k)].is_some()
    }

    fn set(&self, k: Kind, s: Store<DynamicObject>, ar: ApiResource) {
        self.stores.write().unwrap_or_else(|e| e.into_inner())[Self::idx(k)] = Some((s, ar));
    }
}

/// The most preferred installed version of `k`, if any.
async fn installed(client: &Client, k: Kind) -> Option<ApiResource> {
    for v in k.def().1 {
        let r = k.resource_at(v);
        if let Ok(list) = client.list_api_group_resources(&r.api_version).await
            && list.resources.iter().any(|x| x.name == r.plural)
        {
            return Some(r);
        }
    }
    None
}

/// Runs discovery until `shutdown`; every event of a watched kind, and the end of its initial
/// list, is sent to `events` as `(kind, object or None for "API appeared")`.
pub async fn run(
    client: Client,
    namespace: Option<String>,
    optional: Arc<Optional>,
    events: UnboundedSender<(Kind, Option<DynamicObject>)>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    loop {
        for k in Kind::ALL {
            if optional.started(k) {
                continue;
            }
            let Some(ar) = installed(&client, k).await else {
                continue;
            };
            tracing::info!(api = %format!("{}/{}", ar.api_version, ar.kind), "optional API installed; starting its watch");
            let api: Api<DynamicObject> = match &namespace {
                Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
                None => Api::all_with(client.clone(), &ar),
            };
            let writer = reflector::store::Writer::new(ar.clone());
            optional.set(k, writer.as_reader(), ar.clone());
            let tx = events.clone();
            let stop = shutdown.clone();
            tokio::spawn(async move {
                let tx2 = tx.clone();
                let stream = watcher(api, watcher::Config::default())
                    .default_backoff()
                    .inspect(move |ev| {
                        if matches!(ev, Ok(watcher::Event::InitDone)) {
                            let _ = tx2.send((k, None));
                        }
                    })
                    .reflect(writer)
                    .touched_objects();
                futures::pin_mut!(stream);
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        ev = stream.next() => match ev {
                            Some(Ok(obj)) => { let _ = tx.send((k, Some(obj))); }
                            Some(Err(e)) => tracing::debug!(api = %k.gvk(), error = %e, "watch error"),
                            None => return,
                        }
                    }
                }
            });
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(DISCOVERY_PERIOD) => {}
        }
    }
}

#[cfg(test)]
impl Optional {
    /// Stores as if the API of `k` were installed and its watch had listed `objects`.
    pub fn listed(k: Kind, objects: Vec<DynamicObject>) -> Self {
        let o = Optional::default();
        let ar = k.resource();
        let mut w = reflector::store::Writer::new(ar.clone());
        w.apply_watcher_event(&watcher::Event::Init);
        for obj in objects {
            w.apply_watcher_event(&watcher::Event::InitApply(obj));
        }
        w.apply_watcher_event(&watcher::Event::InitDone);
        o.set(k, w.as_reader(), ar);
        o
    }
}
