//! The status step (docs/architecture.md, "How a pass is built", step 4; docs/vmexport.md, "Pass
//! steps", "Links", "Metrics"): the one status write of a pass, the links it carries, and
//! `ucm_vmexport_exports{phase}` counted from the cached statuses. The status itself is computed
//! purely (decide.rs, objects/status.rs).

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::Store;
use kube::{Api, ResourceExt};
use prometheus::{IntGaugeVec, Opts};

use super::context::{Context, Error};
use super::naming;
use super::objects::links::{LinkSettings, links_from_pod};
use super::sources::kind::SourceKind;
use super::types::{VirtualMachineExport, VirtualMachineExportStatus};
use crate::runtime::controller::Guarded;

/// The links of the ready pod (docs/vmexport.md, "Links").
pub(super) async fn links(
    ctx: &Context,
    export: &VirtualMachineExport,
    kind: SourceKind,
    pod: &Pod,
) -> Result<super::types::VirtualMachineExportLinks, Error> {
    let name = export.name_any();
    let ca = ctx.ca().await?;
    let external = ctx.external().await;
    Ok(links_from_pod(
        pod,
        &LinkSettings {
            namespace: export.namespace().unwrap_or_default(),
            export_name: name.clone(),
            service_name: naming::service_name(&name),
            internal_cert: ca.cert,
            external_cert: external.as_ref().map(|e| e.1.clone()).unwrap_or_default(),
            external_host: external.map(|e| e.0),
            strip_prefix: (kind == SourceKind::VirtualMachineSnapshot).then(|| name.clone()),
        },
    ))
}

pub(super) async fn write(
    ctx: &Context,
    export: &VirtualMachineExport,
    status: &VirtualMachineExportStatus,
) -> Result<(), Error> {
    // A merge patch of the difference, with nulls for what this pass no longer reports (a
    // forged `links`), so the whole computed status is what the object ends up with.
    let Some(patch) = crate::runtime::writer::status_merge_patch(export.status.as_ref(), status)
    else {
        return Ok(());
    };
    let api: Api<VirtualMachineExport> =
        Api::namespaced(ctx.client.clone(), &export.namespace().unwrap_or_default());
    let rv = export.resource_version().unwrap_or_default();
    let (ns, name) = (export.namespace().unwrap_or_default(), export.name_any());
    let written = ctx
        .writer
        .merge_status_fenced(&api, &name, &rv, &patch)
        .await
        .map_err(Error::WriteStatus)?;
    ctx.replaced.note(
        &ns,
        &name,
        &rv,
        &written.resource_version().unwrap_or_default(),
    );
    Ok(())
}

/// `ucm_vmexport_exports{phase}` from the export cache, evaluated on every scrape.
pub(super) struct PhaseCollector {
    store: Store<Guarded<VirtualMachineExport>>,
    desc: prometheus::core::Desc,
}

impl PhaseCollector {
    const PHASES: [&'static str; 5] = ["Pending", "Ready", "Terminated", "Skipped", "Unset"];

    pub(super) fn new(store: Store<Guarded<VirtualMachineExport>>) -> Self {
        let desc = prometheus::core::Desc::new(
            "ucm_vmexport_exports".into(),
            "VirtualMachineExports by phase".into(),
            vec!["phase".into()],
            Default::default(),
        )
        .expect("valid metric");
        PhaseCollector { store, desc }
    }
}

impl prometheus::core::Collector for PhaseCollector {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let g = IntGaugeVec::new(
            Opts::new("ucm_vmexport_exports", "VirtualMachineExports by phase"),
            &["phase"],
        )
        .expect("valid metric");
        for p in Self::PHASES {
            g.with_label_values(&[p]).set(0);
        }
        for e in self.store.state() {
            let phase =
                e.0.as_ref()
                    .ok()
                    .and_then(|e| e.status.as_ref()?.phase.clone())
                    .unwrap_or_default();
            let key = Self::PHASES
                .into_iter()
                .find(|k| *k == phase)
                .unwrap_or("Unset");
            g.with_label_values(&[key]).inc();
        }
        prometheus::core::Collector::collect(&g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::{reflector, watcher};
    use prometheus::Encoder;

    #[test]
    fn phase_collector_counts_from_the_cache() {
        let (reader, mut writer) = reflector::store::<Guarded<VirtualMachineExport>>();
        for (name, phase) in [
            ("a", Some("Ready")),
            ("b", Some("Pending")),
            ("c", None),
            ("d", Some("Ready")),
        ] {
            let mut e = VirtualMachineExport::new(name, Default::default());
            e.metadata.namespace = Some("ns".into());
            e.status = phase.map(|p| VirtualMachineExportStatus {
                phase: Some(p.into()),
                ..Default::default()
            });
            let g: Guarded<VirtualMachineExport> =
                serde_json::from_value(serde_json::to_value(&e).unwrap()).unwrap();
            writer.apply_watcher_event(&watcher::Event::Apply(g));
        }
        let registry = prometheus::Registry::new();
        registry
            .register(Box::new(PhaseCollector::new(reader)))
            .unwrap();
        let mut buf = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&registry.gather(), &mut buf)
            .unwrap();
        let text = String::from_utf8(buf).unwrap();
        assert!(
            text.contains("ucm_vmexport_exports{phase=\"Ready\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("ucm_vmexport_exports{phase=\"Pending\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("ucm_vmexport_exports{phase=\"Unset\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("ucm_vmexport_exports{phase=\"Skipped\"} 0"),
            "{text}"
        );
    }
}
