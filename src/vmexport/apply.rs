//! Apply (docs/architecture.md, "How a pass is built", step 3; docs/vmexport.md, "Pass steps",
//! "Children"): the plan's writes in order (a failure stops what depends on it), the export pod,
//! the deletion at TTL expiry, and the status (status.rs) once at the end of every pass (also when
//! a create failed, #19020).
//!
//! Each child (Service, token Secret, serving certificate, manifest ConfigMap) is created when
//! missing and never overwritten needlessly. The plan decides from the caches which ones are
//! missing; a create that answers AlreadyExists (a cache behind, or an object of someone else's
//! without our label) reads that one object to decide.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret, Service};
use kube::api::ObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};

use super::api::*;
use super::certs::{self, Pem};
use super::context::{Context, Error, object_ref};
use super::decide::{
    CERT_ADVICE, CertStep, Decision, Failed, Observed, PlannedEvent, PodStep,
    REASON_CONFIGMAP_CONFLICT, REASON_SECRET_CONFLICT, TOKEN_ADVICE, TokenStep, conflict,
    failure_event,
};
use super::naming;
use super::objects::manifest::{
    EXPAND_API, ManifestInput, build_manifest_configmap, build_template_configmap, expand_request,
    needs_expansion,
};
use super::objects::pod::{ExportVolume, PodInput, build_pod, dedup_volumes};
use super::objects::service::service_conflict;
use super::objects::status::condition;
use super::objects::token::{build_token_secret, generate_token};
use super::podcache::slim_pod;
use super::sources::kind::SourceKind;
use super::sources::{source_template, source_vm};
use super::status::{self, links};
use super::types::{Condition, VirtualMachineExport};
use crate::runtime::meta::controller_ref;
use crate::runtime::own_writes::STALE_RECHECK;

pub(super) async fn create_restore_pvcs(
    ctx: &Context,
    export: &VirtualMachineExport,
    pvcs: &[PersistentVolumeClaim],
) -> Result<(), String> {
    let api: Api<PersistentVolumeClaim> =
        Api::namespaced(ctx.client.clone(), &export.namespace().unwrap_or_default());
    for pvc in pvcs {
        match ctx.writer.create(&api, pvc).await {
            Ok(_) => {}
            Err(e) if e.is_already_exists() => {}
            Err(e) => return Err(format!("PersistentVolumeClaim {}: {e}", pvc.name_any())),
        }
    }
    Ok(())
}

async fn emit(ctx: &Context, export: &VirtualMachineExport, ev: &PlannedEvent) {
    ctx.writer
        .event(
            &object_ref(export),
            ev.type_,
            ev.reason,
            ev.action,
            ev.note.clone(),
        )
        .await;
}

/// Applies `plan`: the children in order (a failure stops what depends on it), the pod, the
/// status, and the requeue.
pub(super) async fn apply(
    ctx: &Context,
    export: &VirtualMachineExport,
    observed: &Observed,
    plan: &Decision,
) -> Result<Action, Error> {
    let ns = export.namespace().unwrap_or_default();
    let name = export.name_any();
    for ev in &plan.events {
        emit(ctx, export, ev).await;
    }
    if plan.expired {
        return delete_expired(ctx, export).await;
    }
    let mut failure: Option<Condition> = plan.failure.clone();
    let fail = |msg: String| condition(COND_READY, false, REASON_OBJECT_CREATION_FAILED, msg);

    if let Some(svc) = &plan.create_service
        && let Err(msg) = create_service(ctx, export, svc).await
    {
        failure = Some(fail(msg));
    }
    let pod_name = naming::pod_name(&name);
    let mut stale_pod = false;
    if let (Some(token), None) = (&plan.token, &failure) {
        let token_ok = match token {
            TokenStep::Given(_) | TokenStep::Present(_) => true,
            TokenStep::Create(n) => match create_token(ctx, export, n).await {
                Ok(()) => true,
                Err(f) => {
                    failure = Some(f.condition());
                    false
                }
            },
        };
        let mut vm_manifest = false;
        if plan.manifest {
            match ensure_manifest(ctx, export, observed.kind, &observed.source.volumes).await {
                Ok(ok) => vm_manifest = ok,
                Err(f) => failure = Some(f.condition()),
            }
        }
        let token_name = match token {
            TokenStep::Given(n) | TokenStep::Present(n) | TokenStep::Create(n) => n,
        };
        match plan.cert {
            CertStep::Valid if token_ok && failure.is_none() => {
                let ca = ctx.ca().await?;
                match ensure_cert(ctx, export, &ca, observed.cert.as_ref()).await {
                    Err(f) => failure = Some(f.condition()),
                    Ok(_) => {
                        let expiry = plan
                            .status
                            .ttl_expiration_time
                            .as_ref()
                            .map(|t| t.0)
                            .unwrap_or_default();
                        let volumes = dedup_volumes(observed.source.volumes.clone());
                        let input = PodInput {
                            export,
                            volumes: &volumes,
                            token_secret: token_name,
                            cert_secret: &naming::cert_secret_name(&name),
                            // The TTL only: the certificate is renewed under the running
                            // server ("Certificates", rule 4).
                            deadline: expiry,
                            vm_manifest,
                            oci: plan.oci,
                        };
                        match create_pod(ctx, export, &build_pod(&input, &ctx.settings.pod)).await {
                            Ok(true) => {}
                            Ok(false) => stale_pod = true,
                            Err(msg) => {
                                failure = Some(condition(
                                    COND_READY,
                                    false,
                                    REASON_POD_CREATION_FAILED,
                                    msg,
                                ));
                            }
                        }
                    }
                }
            }
            // A running pod keeps its certificate; only a deleted Secret is issued again, so
            // that the next pod (and the kubelet's remount) finds one. (The plan checked that
            // a cached one is ours.)
            CertStep::Present if failure.is_none() && observed.cert.is_none() => {
                let ca = ctx.ca().await?;
                if let Err(f) = ensure_cert(ctx, export, &ca, None).await {
                    failure = Some(f.condition());
                }
            }
            CertStep::Renew if failure.is_none() => {
                let ca = ctx.ca().await?;
                if let Err(f) = renew_cert(ctx, export, &ca).await {
                    failure = Some(f.condition());
                }
            }
            _ => {}
        }
    }

    if let PodStep::Delete { uid, .. } = &plan.pod {
        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
        ctx.writer
            .delete(&pods, &pod_name, Some(uid))
            .await
            .map_err(|e| Error::DeletePod(pod_name.clone(), e))?;
    }
    if stale_pod {
        // The pod exists but the cache does not show it yet: its watch event brings the next
        // pass; the status waits for it.
        return Err(Error::Reported {
            until: plan.requeue,
        });
    }

    if let Some(f) = &failure
        && let Some(ev) = failure_event(export.status.as_ref(), f)
    {
        emit(ctx, export, &ev).await;
    }
    let mut status = if failure == plan.failure {
        plan.status.clone()
    } else {
        plan.status_with(failure.as_ref())
    };
    if let (Some(p), None) = (&plan.links_pod, &failure) {
        status.links = Some(links(ctx, export, observed.kind, p).await?);
    }
    if export.status.as_ref() != Some(&status) {
        let rv = export.resource_version().unwrap_or_default();
        if ctx.replaced.is_stale(&ns, &name, &rv) {
            // Our last status write has not reached the cache: writing again would only
            // conflict (409) with it. Look again once its echo is in.
            return Ok(Action::requeue(STALE_RECHECK));
        }
        status::write(ctx, export, &status).await?;
    }
    match failure {
        // The status says what failed; the runtime's backoff retries it, by the TTL at the
        // latest.
        Some(_) => Err(Error::Reported {
            until: plan.requeue,
        }),
        None => Ok(Action::requeue(plan.requeue)),
    }
}

/// Creates the export pod: `Ok(false)` when one exists that the cache does not show yet.
async fn create_pod(
    ctx: &Context,
    export: &VirtualMachineExport,
    pod: &Pod,
) -> Result<bool, String> {
    let ns = export.namespace().unwrap_or_default();
    let name = pod.name_any();
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    match ctx.writer.create(&api, pod).await {
        Ok(mut p) => {
            slim_pod(&mut p);
            ctx.recent.pods.remember(&ns, &name, p);
            Ok(true)
        }
        Err(e) if e.is_already_exists() => Ok(false),
        Err(e) => {
            let msg = format!("Pod {name}: {e}");
            ctx.writer
                .event(
                    &object_ref(export),
                    kube::runtime::events::EventType::Warning,
                    REASON_POD_CREATION_FAILED,
                    "Create",
                    msg.clone(),
                )
                .await;
            Err(msg)
        }
    }
}

/// The TTL passed: delete the export (this one: fenced on its uid).
async fn delete_expired(ctx: &Context, export: &VirtualMachineExport) -> Result<Action, Error> {
    let ns = export.namespace().unwrap_or_default();
    let name = export.name_any();
    let api: Api<VirtualMachineExport> = Api::namespaced(ctx.client.clone(), &ns);
    let deleted = ctx
        .writer
        .delete(&api, &name, export.uid().as_deref())
        .await
        .map_err(Error::DeleteExport)?;
    if deleted {
        ctx.ttl_deletions.inc();
        ctx.writer
            .event(
                &object_ref(export),
                kube::runtime::events::EventType::Normal,
                "TTLExpired",
                "Delete",
                format!("VirtualMachineExport {ns}/{name} reached its TTL and was deleted"),
            )
            .await;
    }
    Ok(Action::await_change())
}

/// Creates or updates the manifest ConfigMap; `Ok(false)` when the `all` manifest cannot be
/// offered (Warning event `ManifestFailed`; the pod then has no EXPORT_VM_DEF_URI).
pub(super) async fn ensure_manifest(
    ctx: &Context,
    export: &VirtualMachineExport,
    kind: SourceKind,
    volumes: &[ExportVolume],
) -> Result<bool, Failed> {
    let ns = export.namespace().unwrap_or_default();
    // A template is served as upstream keeps it; instancetypes stay references (its VM is not
    // one KubeVirt can expand: it may hold `${PARAM}` placeholders).
    let template = match kind {
        SourceKind::VirtualMachineTemplate => match source_template(&ctx.stores, export) {
            Some(t) => Some(t),
            None => return Ok(false),
        },
        _ => None,
    };
    let mut vm = match &template {
        Some((tpl, _)) => tpl.clone(),
        None => match source_vm(&ctx.stores, export, kind) {
            Some(vm) => vm,
            None => return Ok(false),
        },
    };
    if template.is_none() && needs_expansion(&vm) {
        match expand_vm(ctx, &ns, kind, &export.spec.source.name, &vm).await {
            Ok(expanded) => vm = expanded,
            Err(msg) => {
                manifest_failed(ctx, export, msg).await;
                return Ok(false);
            }
        }
    }
    let mut claims = BTreeMap::new();
    for v in volumes {
        if let Some(p) = ctx.stores.pvcs.get(&ObjectRef::new(&v.pvc).within(&ns))
            && let Some(spec) = &p.spec
        {
            let claim = match kind {
                SourceKind::VirtualMachineSnapshot => v
                    .pvc
                    .strip_prefix(&format!("{}-", export.name_any()))
                    .unwrap_or(&v.pvc)
                    .to_string(),
                _ => v.pvc.clone(),
            };
            claims.insert(claim, spec.clone());
        }
    }
    let ca = ctx
        .ca()
        .await
        .map_err(|e| crate::runtime::controller::error_chain(&e))?;
    let external = ctx.external().await;
    let input = ManifestInput {
        export,
        vm: &vm,
        claims: &claims,
        internal_cert: &ca.cert,
        external_host: external.as_ref().map(|e| e.0.as_str()),
        external_cert: external.as_ref().map(|e| e.1.as_str()).unwrap_or_default(),
        volume_prefix: (kind == SourceKind::VirtualMachineSnapshot)
            .then(|| format!("{}-", export.name_any())),
    };
    let built = match &template {
        Some((_, api_version)) => Ok(build_template_configmap(&input, api_version)),
        None => build_manifest_configmap(&input),
    };
    let desired = match built {
        Ok(cm) => cm,
        Err(msg) => {
            manifest_failed(ctx, export, msg).await;
            return Ok(false);
        }
    };
    let api: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    let name = desired.name_any();
    let existing = api
        .get_opt(&name)
        .await
        .map_err(|e| format!("ConfigMap {name}: {e}"))?;
    if let Some(f) = existing.as_ref().and_then(|c| {
        conflict(
            REASON_CONFIGMAP_CONFLICT,
            "ConfigMap",
            &c.metadata,
            export,
            "Delete or rename it, or rename this export",
        )
    }) {
        return Err(f);
    }
    if existing.as_ref().and_then(|c| c.data.as_ref()) != desired.data.as_ref() {
        ctx.writer
            .apply(&api, &desired)
            .await
            .map_err(|e| format!("ConfigMap {name}: {e}"))?;
    }
    Ok(true)
}

/// Warning event `ManifestFailed` (docs/vmexport.md, "Failures"): the export goes on without the
/// `all` manifest.
async fn manifest_failed(ctx: &Context, export: &VirtualMachineExport, msg: String) {
    ctx.writer
        .event(
            &object_ref(export),
            EventType::Warning,
            "ManifestFailed",
            "Create",
            msg,
        )
        .await;
}

/// The VM with its instancetype and preference expanded by KubeVirt (docs/vmexport.md, "Optional
/// APIs"): `Err` says why not, for the `ManifestFailed` event.
async fn expand_vm(
    ctx: &Context,
    ns: &str,
    kind: SourceKind,
    vm_name: &str,
    vm: &serde_json::Value,
) -> Result<serde_json::Value, String> {
    let req = expand_request(ns, kind, vm_name, vm)?;
    match ctx.client.request::<serde_json::Value>(req).await {
        Ok(v) if v["spec"].is_object() => Ok(v),
        Ok(_) => Err(format!(
            "{EXPAND_API} expand-spec returned no VirtualMachine spec; the all manifest is not offered"
        )),
        Err(kube::Error::Api(s)) if s.code == 404 => Err(format!(
            "the VirtualMachine references an instancetype or preference and {EXPAND_API} expand-spec is not available ({}); install KubeVirt's virt-api to get the all manifest",
            s.message
        )),
        Err(e) => Err(format!(
            "{EXPAND_API} expand-spec failed: {e}; the all manifest is not offered"
        )),
    }
}

/// Creates the Service the cache does not show.
pub(super) async fn create_service(
    ctx: &Context,
    export: &VirtualMachineExport,
    svc: &Service,
) -> Result<(), String> {
    let ns = export.namespace().unwrap_or_default();
    let name = svc.name_any();
    let api: Api<Service> = Api::namespaced(ctx.client.clone(), &ns);
    match ctx.writer.create(&api, svc).await {
        Ok(created) => {
            ctx.recent.services.remember(&ns, &name, created.metadata);
            Ok(())
        }
        // Made meanwhile, or someone else's the cache does not show (unlabelled): whose?
        Err(e) if e.is_already_exists() => match api.get_metadata_opt(&name).await {
            Ok(Some(m)) => {
                let existing = Service {
                    metadata: m.metadata,
                    ..Default::default()
                };
                match service_conflict(&existing, export) {
                    Some(msg) => Err(msg),
                    None => Ok(()),
                }
            }
            _ => Err(format!("Service {name}: {e}")),
        },
        Err(e) => Err(format!("Service {name}: {e}")),
    }
}

/// Whether this export may use the Secret `meta` describes.
fn secret_ours(
    meta: &ObjectMeta,
    export: &VirtualMachineExport,
    advice: &str,
) -> Result<(), Failed> {
    match conflict(REASON_SECRET_CONFLICT, "Secret", meta, export, advice) {
        Some(f) => Err(f),
        None => Ok(()),
    }
}

/// Creates the token Secret the cache does not show; a deleted one is recreated with a new
/// token (docs/vmexport.md, "Token").
pub(super) async fn create_token(
    ctx: &Context,
    export: &VirtualMachineExport,
    name: &str,
) -> Result<(), Failed> {
    let ns = export.namespace().unwrap_or_default();
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let s = build_token_secret(export, name, &generate_token(TOKEN_LENGTH));
    match ctx.writer.create(&api, &s).await {
        Ok(created) => {
            ctx.recent.secrets.remember(&ns, name, created.metadata);
            Ok(())
        }
        // Created meanwhile (another leader, or someone else, possibly unlabelled so the cache
        // never shows it): whose is it? Its metadata is all this reads.
        Err(e) if e.is_already_exists() => match api.get_metadata_opt(name).await {
            Ok(Some(s)) => secret_ours(&s.metadata, export, TOKEN_ADVICE),
            _ => Err(format!("Secret {name}: {e}").into()),
        },
        Err(e) => Err(format!("Secret {name}: {e}").into()),
    }
}

/// Ensures a valid serving certificate before a pod is made; returns its notAfter
/// (docs/vmexport.md, "Certificates", rule 3).
/// The one Secret read with its data: whether it must be reissued, and the pod's deadline,
/// depend on the certificate in it. It is read only when a pod is about to be created and the
/// cache shows the Secret.
pub(super) async fn ensure_cert(
    ctx: &Context,
    export: &VirtualMachineExport,
    ca: &Pem,
    cached: Option<&ObjectMeta>,
) -> Result<jiff::Timestamp, Failed> {
    let ns = export.namespace().unwrap_or_default();
    let name = naming::cert_secret_name(&export.name_any());
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let now = jiff::Timestamp::now();
    if let Some(m) = cached {
        secret_ours(m, export, CERT_ADVICE)?;
        return current_or_reissue(ctx, export, ca, &api, now).await;
    }
    // Created, not applied: a Secret of that name the cache does not show yet (someone else's)
    // is never overwritten.
    let (secret, not_after) = cert_secret(ctx, export, ca, now)?;
    match ctx.writer.create(&api, &secret).await {
        Ok(created) => {
            ctx.recent.secrets.remember(&ns, &name, created.metadata);
            Ok(not_after)
        }
        Err(e) if e.is_already_exists() => current_or_reissue(ctx, export, ca, &api, now).await,
        Err(e) => Err(format!("Secret {name}: {e}").into()),
    }
}

/// The existing certificate's notAfter if it is still good, else a new one applied in place.
async fn current_or_reissue(
    ctx: &Context,
    export: &VirtualMachineExport,
    ca: &Pem,
    api: &Api<Secret>,
    now: jiff::Timestamp,
) -> Result<jiff::Timestamp, Failed> {
    let ns = export.namespace().unwrap_or_default();
    let svc = naming::service_name(&export.name_any());
    let name = naming::cert_secret_name(&export.name_any());
    let existing = api
        .get_opt(&name)
        .await
        .map_err(|e| format!("Secret {name}: {e}"))?;
    if let Some(s) = &existing {
        secret_ours(&s.metadata, export, CERT_ADVICE)?;
        let crt = s
            .data
            .as_ref()
            .and_then(|d| d.get("tls.crt"))
            .map(|b| String::from_utf8_lossy(&b.0).into_owned());
        if let Some(crt) = crt
            && let Ok(info) = certs::inspect(&crt, &ca.cert)
            && !certs::needs_reissue(&info, &svc, &ns, now, ctx.settings.pod.cert_renew_before)
        {
            return Ok(info.not_after);
        }
    }
    let (secret, not_after) = cert_secret(ctx, export, ca, now)?;
    // Reissued in place: apply replaces the data of our own Secret.
    ctx.writer
        .apply(api, &secret)
        .await
        .map_err(|e| format!("Secret {name}: {e}"))?;
    Ok(not_after)
}

/// Reissues the serving certificate in place under a running Pod (the plan checked that the
/// cached Secret is ours and due).
async fn renew_cert(ctx: &Context, export: &VirtualMachineExport, ca: &Pem) -> Result<(), Failed> {
    let ns = export.namespace().unwrap_or_default();
    let name = naming::cert_secret_name(&export.name_any());
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let (secret, not_after) = cert_secret(ctx, export, ca, jiff::Timestamp::now())?;
    ctx.writer
        .apply(&api, &secret)
        .await
        .map_err(|e| format!("Secret {name}: {e}"))?;
    tracing::info!(%ns, secret = %name, %not_after, "serving certificate renewed under the running export server");
    Ok(())
}

/// A new serving certificate Secret and its notAfter.
fn cert_secret(
    ctx: &Context,
    export: &VirtualMachineExport,
    ca: &Pem,
    now: jiff::Timestamp,
) -> Result<(Secret, jiff::Timestamp), Failed> {
    let ns = export.namespace().unwrap_or_default();
    let svc = naming::service_name(&export.name_any());
    let name = naming::cert_secret_name(&export.name_any());
    let pem = certs::issue_serving(ca, &svc, &ns, now, ctx.settings.pod.cert_duration)
        .map_err(|e| format!("Secret {name}: {e}"))?;
    let not_after = certs::inspect(&pem.cert, &ca.cert)
        .map_err(|e| format!("Secret {name}: {e}"))?
        .not_after;
    let renew = jiff::SignedDuration::try_from(ctx.settings.pod.cert_renew_before)
        .unwrap_or(jiff::SignedDuration::ZERO);
    let renew_at = not_after.checked_sub(renew).unwrap_or(now);
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(ns.clone()),
            labels: Some(BTreeMap::from([(
                APP_LABEL.to_string(),
                APP_LABEL_VALUE.to_string(),
            )])),
            annotations: Some(BTreeMap::from([(
                ANN_CERT_RENEW_AT.to_string(),
                jiff::Timestamp::from_second(renew_at.as_second())
                    .unwrap_or(renew_at)
                    .to_string(),
            )])),
            owner_references: controller_ref(export).map(|o| vec![o]),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(BTreeMap::from([
            (
                "tls.crt".to_string(),
                k8s_openapi::ByteString(pem.cert.into_bytes()),
            ),
            (
                "tls.key".to_string(),
                k8s_openapi::ByteString(pem.key.into_bytes()),
            ),
            (
                "ca.crt".to_string(),
                k8s_openapi::ByteString(ca.cert.clone().into_bytes()),
            ),
        ])),
        ..Default::default()
    };
    Ok((secret, not_after))
}
