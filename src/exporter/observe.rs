//! What the passes read of the caches (docs/exporter.md, "Lease assignment"): the readable
//! objects of a namespace, or one by name. An unreadable object is skipped here and reported
//! by its own controller's pass.

use std::sync::Arc;

use kube::Resource;
use kube::runtime::reflector::{ObjectRef, Store};

use crate::exporter::context::Caches;
use crate::runtime::controller::Guarded;

impl Caches {
    /// The readable objects of `namespace` in `store`.
    pub(crate) fn in_namespace<K>(
        store: &Store<Guarded<K>>,
        namespace: &str,
    ) -> Vec<Arc<Guarded<K>>>
    where
        K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        store
            .state()
            .into_iter()
            .filter(|g| g.0.is_ok() && g.meta().namespace.as_deref() == Some(namespace))
            .collect()
    }

    pub(crate) fn get<K>(
        store: &Store<Guarded<K>>,
        namespace: &str,
        name: &str,
    ) -> Option<Arc<Guarded<K>>>
    where
        K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        store
            .get(&ObjectRef::new(name).within(namespace))
            .filter(|g| g.0.is_ok())
    }
}

/// The readable objects behind [`Caches::in_namespace`]'s guards.
pub(crate) fn readable<K>(guards: &[Arc<Guarded<K>>]) -> Vec<&K> {
    guards.iter().filter_map(|g| g.0.as_ref().ok()).collect()
}
