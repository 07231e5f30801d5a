//! Pure builders of what a pass writes (docs/architecture.md, "How a pass is built";
//! docs/vmexport.md, "Children"): no client, no clock (time is a parameter). Each function turns
//! plain inputs into plain objects: the export's children (`service`, `token`, `pod`, `manifest`),
//! its links (`links`) and its status (`status`).

pub mod links;
pub mod manifest;
pub mod pod;
pub mod service;
pub mod status;
pub mod token;

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;

use super::api::*;
use super::types::VirtualMachineExport;

pub fn owner_reference(export: &VirtualMachineExport) -> OwnerReference {
    OwnerReference {
        api_version: OWNER_API_VERSION.into(),
        kind: KIND.into(),
        name: export.name_any(),
        uid: export.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

fn app_labels() -> BTreeMap<String, String> {
    BTreeMap::from([(APP_LABEL.to_string(), APP_LABEL_VALUE.to_string())])
}
