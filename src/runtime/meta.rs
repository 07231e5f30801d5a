//! Object metadata questions every feature asks.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Resource;

/// The controller owner reference to `obj` that every feature writes on what it creates: it
/// blocks `obj`'s deletion until the garbage collector removed the dependant, as
/// controller-runtime's `SetControllerReference` writes it. None for an object with no name or
/// uid (never stored).
pub fn controller_ref<K: Resource<DynamicType = ()>>(obj: &K) -> Option<OwnerReference> {
    let mut owner = obj.controller_owner_ref(&())?;
    owner.block_owner_deletion = Some(true);
    Some(owner)
}

/// Whether `meta` carries a controller owner reference to the object with `uid`: the one test
/// of "ours" (a same-named object of someone else's is left alone).
pub fn controlled_by(meta: &ObjectMeta, uid: &str) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|r| r.controller == Some(true) && r.uid == uid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    #[test]
    fn only_a_controller_reference_to_that_uid_counts() {
        let owner = |uid: &str, controller: Option<bool>| OwnerReference {
            uid: uid.into(),
            controller,
            ..Default::default()
        };
        let meta = |refs: Vec<OwnerReference>| ObjectMeta {
            owner_references: Some(refs),
            ..Default::default()
        };
        assert!(controlled_by(&meta(vec![owner("u", Some(true))]), "u"));
        assert!(!controlled_by(&meta(vec![owner("u", None)]), "u"));
        assert!(!controlled_by(&meta(vec![owner("v", Some(true))]), "u"));
        assert!(!controlled_by(&ObjectMeta::default(), "u"));
    }
}
