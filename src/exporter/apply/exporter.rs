//! The Exporter pass (docs/exporter.md, "The Exporter pass"): the credential, the held lease
//! from the Lease cache, the status decided by `crate::exporter::decide::exporter`, one fenced
//! status write when it changed, then the transition events.

use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Secret;
use kube::api::PartialObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use tracing::warn;

use crate::conditions;
use crate::exporter::apply::credential::{Outcome, credential_owners, credential_step};
use crate::exporter::apply::{emit, gone_is_done, requeue};
use crate::exporter::context::{Caches, Context, Error};
use crate::exporter::crd::{Exporter, Lease};
use crate::exporter::decide::exporter::{self as exporter_status, HeldLease};
use crate::exporter::decide::lease::expiry;
use crate::runtime::controller::Guarded;
use crate::runtime::own_writes::STALE_RECHECK;
use crate::runtime::writer::status_merge_patch;

/// The Exporter pass (docs/exporter.md, "The Exporter pass").
pub async fn reconcile(exporter: Arc<Exporter>, ctx: Arc<Context>) -> Result<Action, Error> {
    gone_is_done(exporter_pass(exporter, ctx).await)
}

async fn exporter_pass(exporter: Arc<Exporter>, ctx: Arc<Context>) -> Result<Action, Error> {
    let now = Timestamp::now();
    let ns = exporter.namespace().unwrap_or_default();
    let name = exporter.name_any();
    let rv = exporter.resource_version().unwrap_or_default();
    if ctx.replaced.exporters.is_stale(&ns, &name, &rv) {
        return Ok(Action::requeue(STALE_RECHECK));
    }
    // Before the first lists complete there is nothing to read.
    if !ctx.caches.synced.wait().await {
        return Ok(Action::await_change()); // shutting down
    }
    let (claims, no_credential) =
        match credential_step(&ctx, &*exporter, &ctx.settings.token, now).await? {
            Outcome::Unowned => return Ok(Action::await_change()),
            Outcome::Held(claims) => (Some(claims), None),
            Outcome::Refused(problem) => (None, Some(problem)),
        };

    let held = held_lease(&ctx, &ns, &name);
    let mut desired = exporter_status::decide(
        &exporter,
        claims.as_ref(),
        held.as_ref(),
        &ctx.settings.status,
        &ctx.settings.token,
        now,
    );
    if let Some(problem) = no_credential {
        desired.status.credential = None;
        let conds = desired.status.conditions.get_or_insert_with(Vec::new);
        conditions::set(
            conds,
            problem,
            exporter.metadata.generation,
            &conditions::time(now),
        );
    }
    if desired.replaced_owing_record {
        warn!(exporter = %name, "replacing a lease-hooks record that still owes afterLease");
    }
    let mut events = Vec::new();
    if let Some(patch) = status_merge_patch(exporter.status.as_ref(), &desired.status) {
        let api: Api<Exporter> = Api::namespaced(ctx.client.clone(), &ns);
        let written = ctx
            .writer
            .merge_status_fenced(&api, &name, &rv, &patch)
            .await?;
        let written_rv = written.resource_version().unwrap_or_default();
        ctx.replaced.exporters.note(&ns, &name, &rv, &written_rv);
        ctx.metrics
            .status_writes
            .with_label_values(&["reconcile"])
            .inc();
        events.extend(exporter_status::transition_events(
            &name,
            exporter.status.as_ref(),
            &desired.status,
            ctx.settings.status.offline_threshold,
            now,
        ));
    }
    emit(&ctx, &*exporter, &events).await;
    Ok(requeue(
        &ctx.wakeups.exporters,
        &ns,
        &name,
        desired.requeue_after,
    ))
}

/// The lease the exporter holds, from the Lease cache. The cache is enough here: a Lease change
/// that alters the held lease triggers a pass after the cache has it.
fn held_lease(ctx: &Context, ns: &str, name: &str) -> Option<HeldLease> {
    let leases: Vec<Lease> = Caches::in_namespace(&ctx.caches.leases, ns)
        .iter()
        .filter_map(|g| g.0.as_ref().ok())
        .filter(|l| l.status.as_ref().and_then(|s| s.exporter_ref_name()) == Some(name))
        .cloned()
        .collect();
    let (held, several) = expiry::held_lease(name, &leases);
    if several {
        warn!(exporter = %name, "several active leases name this exporter; using the earliest");
    }
    held.map(|l| HeldLease {
        name: l.name_any(),
        uid: l.uid(),
        client_name: l.spec.client_ref.name.clone(),
    })
}

/// The Exporters a Lease change concerns (the watch mapper of the Exporter controller's Lease
/// trigger): the one its status names and its controller owner (a lease that ends leaves the
/// label-selected watch as a deletion).
pub fn of_lease(lease: Guarded<Lease>) -> Vec<ObjectRef<Guarded<Exporter>>> {
    // An unreadable Lease names no exporter anyone can trust.
    let Ok(lease) = lease.0 else {
        return Vec::new();
    };
    let ns = lease.metadata.namespace.clone().unwrap_or_default();
    let by_status = lease
        .status
        .as_ref()
        .and_then(|s| s.exporter_ref_name())
        .map(str::to_string);
    let by_owner = lease
        .metadata
        .owner_references
        .iter()
        .flatten()
        .filter(|r| r.controller == Some(true) && r.kind == "Exporter")
        .map(|r| r.name.clone())
        .collect::<Vec<_>>();
    by_status
        .into_iter()
        .chain(by_owner)
        .map(move |name| ObjectRef::<Guarded<Exporter>>::new(&name).within(&ns))
        .collect()
}

/// The Exporter whose credential Secret changed.
pub fn of_credential_secret(s: PartialObjectMeta<Secret>) -> Vec<ObjectRef<Guarded<Exporter>>> {
    credential_owners::<Exporter>(&s.metadata, "Exporter", "-exporter")
}
