//! [`Guarded<K>`]: an object of kind `K` that decodes even when `K` cannot read it, so one bad
//! object never fails a whole list or watch. The bad one keeps its metadata and the error, and
//! the controller reports it (see [`super::unreadable`]).
//!
//! kube's `DeserializeGuard` does the same by first decoding every object into a generic value
//! tree, cloning it and decoding `K` from the clone: two and a half times the CPU of decoding
//! `K` alone, on every object of every list. This one borrows the object's JSON text from
//! serde_json and decodes `K` from it; only a bad object is read a second time (for its
//! metadata).

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::core::PartialObjectMeta;
pub use kube::core::error_boundary::InvalidObject;
use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;

#[derive(Debug, Clone)]
pub struct Guarded<K>(pub Result<K, InvalidObject>);

impl<'de, K: DeserializeOwned + Resource> Deserialize<'de> for Guarded<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Every decoder in kube is serde_json, which hands over the text of the object (a
        // serde_json::Value, as tests use, works too).
        let raw = Box::<RawValue>::deserialize(d)?;
        match serde_json::from_str::<K>(raw.get()) {
            Ok(k) => Ok(Guarded(Ok(k))),
            Err(e) => {
                let PartialObjectMeta { metadata, .. } =
                    serde_json::from_str::<PartialObjectMeta<K>>(raw.get())
                        .map_err(D::Error::custom)?;
                Ok(Guarded(Err(InvalidObject {
                    error: e.to_string(),
                    metadata,
                })))
            }
        }
    }
}

impl<K: Resource> Resource for Guarded<K> {
    type DynamicType = K::DynamicType;
    type Scope = K::Scope;

    fn kind(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::kind(dt)
    }
    fn group(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::group(dt)
    }
    fn version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::version(dt)
    }
    fn plural(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        match &self.0 {
            Ok(k) => k.meta(),
            Err(bad) => &bad.metadata,
        }
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match &mut self.0 {
            Ok(k) => k.meta_mut(),
            Err(bad) => &mut bad.metadata,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::core::ObjectList;
    use serde_json::json;

    #[test]
    fn a_bad_object_keeps_its_metadata_and_the_list_its_good_ones() {
        let text = json!({
            "apiVersion": "v1", "kind": "ConfigMapList", "metadata": {"resourceVersion": "9"},
            "items": [
                {"metadata": {"name": "good", "namespace": "ns"}, "data": {"k": "v"}},
                {"metadata": {"name": "bad", "namespace": "ns"}, "data": {"k": 7}},
            ]
        })
        .to_string();
        let list: ObjectList<Guarded<ConfigMap>> = serde_json::from_str(&text).unwrap();
        let good = list.items[0].0.as_ref().unwrap();
        assert_eq!(good.data.as_ref().unwrap()["k"], "v");
        let bad = list.items[1].0.as_ref().unwrap_err();
        assert_eq!(bad.metadata.name.as_deref(), Some("bad"));
        assert!(bad.error.contains("invalid type"), "{}", bad.error);
        assert_eq!(list.items[1].meta().name.as_deref(), Some("bad"));
    }

    #[test]
    fn decodes_from_a_value_and_from_a_watch_event() {
        let g: Guarded<ConfigMap> =
            serde_json::from_value(json!({"metadata": {"name": "a"}})).unwrap();
        assert_eq!(g.meta().name.as_deref(), Some("a"));
        let line =
            r#"{"type":"MODIFIED","object":{"metadata":{"name":"b","resourceVersion":"3"}}}"#;
        let ev: kube::core::WatchEvent<Guarded<ConfigMap>> = serde_json::from_str(line).unwrap();
        let kube::core::WatchEvent::Modified(g) = ev else {
            panic!("not a MODIFIED event")
        };
        assert_eq!(g.meta().name.as_deref(), Some("b"));
    }

    #[test]
    fn an_object_without_readable_metadata_fails_the_decode() {
        let r = serde_json::from_str::<Guarded<ConfigMap>>(r#"{"metadata": 5}"#);
        assert!(r.is_err());
    }
}
