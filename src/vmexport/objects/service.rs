//! The export's Service (docs/vmexport.md, "Children"), and why an existing one of its name cannot
//! be used.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;

use super::app_labels;
use crate::runtime::meta::controller_ref;
use crate::vmexport::api::*;
use crate::vmexport::naming;
use crate::vmexport::types::VirtualMachineExport;

pub fn build_service(export: &VirtualMachineExport) -> Service {
    let name = export.name_any();
    let mut labels = app_labels();
    labels.extend(export.labels().clone());
    Service {
        metadata: ObjectMeta {
            name: Some(naming::service_name(&name)),
            namespace: export.namespace(),
            labels: Some(labels),
            annotations: (!export.annotations().is_empty()).then(|| export.annotations().clone()),
            owner_references: controller_ref(export).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            ports: Some(vec![ServicePort {
                protocol: Some("TCP".into()),
                port: 443,
                target_port: Some(IntOrString::Int(SERVER_PORT)),
                ..Default::default()
            }]),
            selector: Some(BTreeMap::from([(
                EXPORT_SERVICE_LABEL.to_string(),
                naming::selector_label_value(&name),
            )])),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Why an existing Service of this export's name cannot be used: it is controlled by another
/// object. Upstream's naming maps `.` to `-`, so the exports `a.b` and `a-b` of one namespace
/// share the Service name `virt-export-a-b`; the second one must not advertise links that
/// reach the first one's server.
pub fn service_conflict(existing: &Service, export: &VirtualMachineExport) -> Option<String> {
    let uid = export.uid().unwrap_or_default();
    let owner = existing
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true));
    match owner {
        Some(o) if o.uid == uid => None,
        Some(o) => Some(format!(
            "Service {} already exists and belongs to {} {}; VirtualMachineExport names that differ only in '.' and '-' share a Service name, rename this export",
            existing.name_any(),
            o.kind,
            o.name
        )),
        None => Some(format!(
            "Service {} already exists and is not owned by this VirtualMachineExport; delete it or rename this export",
            existing.name_any()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmexport::fixtures::export;

    #[test]
    fn service_render() {
        let svc = build_service(&export("my.exp"));
        assert_eq!(svc.metadata.name.as_deref(), Some("virt-export-my-exp"));
        let labels = svc.metadata.labels.unwrap();
        assert_eq!(labels["kubevirt.io"], "virt-exporter");
        assert_eq!(labels["team"], "a");
        assert_eq!(svc.metadata.annotations.unwrap()["note"], "x");
        let spec = svc.spec.unwrap();
        assert_eq!(spec.selector.unwrap()[EXPORT_SERVICE_LABEL], "my.exp");
        let port = &spec.ports.unwrap()[0];
        assert_eq!(
            (port.port, port.target_port.clone()),
            (443, Some(IntOrString::Int(8443)))
        );
        let owner = &svc.metadata.owner_references.unwrap()[0];
        assert_eq!(owner.api_version, "export.kubevirt.io/v1");
        assert_eq!(owner.block_owner_deletion, Some(true));
    }

    #[test]
    fn a_service_of_another_export_is_a_conflict() {
        // `a.b` and `a-b` map to the same Service name (upstream's naming).
        let mut first = export("a.b");
        first.metadata.uid = Some("uid-first".into());
        let mut second = export("a-b");
        second.metadata.uid = Some("uid-second".into());
        assert_eq!(
            crate::vmexport::naming::service_name("a.b"),
            crate::vmexport::naming::service_name("a-b")
        );
        let svc = build_service(&first);
        assert_eq!(service_conflict(&svc, &first), None);
        let msg = service_conflict(&svc, &second).unwrap();
        assert!(
            msg.contains("virt-export-a-b") && msg.contains("a.b"),
            "{msg}"
        );
        let mut orphan = svc.clone();
        orphan.metadata.owner_references = None;
        assert!(service_conflict(&orphan, &first).is_some());
    }
}
