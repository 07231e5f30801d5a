//! Observe (docs/architecture.md, "How a pass is built", step 1; docs/vmexport.md, "Pass steps"):
//! what the caches say about an export, its source and its children.
//!
//! A pass on an unchanged export sends no request: the Service, the Secrets (metadata), the
//! Pod and the source all come from the watches that trigger passes. Reads that remain: the
//! serving certificate's Secret before a pod is made (its certificate decides the reissue and
//! the pod's deadline), the manifest ConfigMap of VM, snapshot and template sources, the CA once per
//! process, and the proxy Ingress's TLS Secret for external links.

use kube::ResourceExt;
use kube::runtime::reflector::Store;

use super::api::*;
use super::context::Context;
use super::decide::Observed;
use super::naming;
use super::sources::kind::{SourceKind, classify_source, unsupported_source_message};
use super::sources::*;
use super::types::VirtualMachineExport;

pub(super) fn store_ready<K: kube::runtime::reflector::Lookup + Clone + 'static>(
    store: &Store<K>,
) -> bool
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    use futures::FutureExt;
    matches!(store.wait_until_ready().now_or_never(), Some(Ok(())))
}

/// What the caches say about `export`: its source and its children. Sends no request.
pub(super) fn observe(ctx: &Context, export: &VirtualMachineExport) -> Observed {
    let st = &ctx.stores;
    let ns = export.namespace().unwrap_or_default();
    let name = export.name_any();
    let kind = classify_source(&export.spec);
    let (source, snapshot_vm) = match kind {
        SourceKind::Pvc => (resolve_pvc(st, export), None),
        SourceKind::Unsupported => (
            unavailable(
                PHASE_SKIPPED,
                REASON_UNSUPPORTED_SOURCE,
                unsupported_source_message(&export.spec),
            ),
            None,
        ),
        SourceKind::VirtualMachine => (resolve_vm(st, export), None),
        SourceKind::VirtualMachineSnapshot => resolve_snapshot(st, export),
        SourceKind::VirtualMachineTemplate => (resolve_template(st, export), None),
    };
    let secret = |n: String| {
        let cached = st.secret(&ns, &n);
        ctx.recent.secrets.overlay(&ns, &n, cached)
    };
    let svc = naming::service_name(&name);
    let pod = naming::pod_name(&name);
    Observed {
        export: export.clone(),
        kind,
        source,
        snapshot_vm,
        service: ctx
            .recent
            .services
            .overlay(&ns, &svc, st.service(&ns, &svc)),
        token: secret(naming::token_secret_name(&name)),
        cert: secret(naming::cert_secret_name(&name)),
        pod: ctx.recent.pods.overlay(&ns, &pod, st.pod(&ns, &pod)),
    }
}
