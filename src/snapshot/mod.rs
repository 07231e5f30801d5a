//! The `snapshot` feature: the MiroirSnapshot round coordinator (manager side) and the pure
//! decision logic, backends and barriers of `ucm snapshot-agent`.
//!
//! Spec: `shared/spec/snapshot.md`. Upstream (Miroir) is AGPL: this is a clean-room design from
//! the spec's behaviour only.

pub mod agent;
pub mod build;
pub mod round;
pub mod types;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// Every CRD this feature ships: MiroirSnapshot and the MiroirVolume subset.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![types::MiroirSnapshot::crd(), types::MiroirVolume::crd()]
}
