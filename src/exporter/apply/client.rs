//! The Client pass (docs/exporter.md, "The Client pass"): the credential, the status decided by
//! `crate::exporter::decide::client`, one fenced status write when it changed, then the events.

use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Secret;
use kube::api::PartialObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};

use crate::exporter::apply::credential::{Outcome, credential_owners, credential_step};
use crate::exporter::apply::{emit, gone_is_done, requeue};
use crate::exporter::context::{Context, Error};
use crate::exporter::crd::Client;
use crate::exporter::decide::client as client_status;
use crate::runtime::controller::Guarded;
use crate::runtime::own_writes::STALE_RECHECK;
use crate::runtime::writer::status_merge_patch;

/// The Client pass (docs/exporter.md, "The Client pass").
pub async fn reconcile(client: Arc<Client>, ctx: Arc<Context>) -> Result<Action, Error> {
    gone_is_done(client_pass(client, ctx).await)
}

async fn client_pass(client: Arc<Client>, ctx: Arc<Context>) -> Result<Action, Error> {
    let now = Timestamp::now();
    let ns = client.namespace().unwrap_or_default();
    let name = client.name_any();
    let rv = client.resource_version().unwrap_or_default();
    if ctx.replaced.clients.is_stale(&ns, &name, &rv) {
        return Ok(Action::requeue(STALE_RECHECK));
    }
    if !ctx.caches.synced.wait().await {
        return Ok(Action::await_change()); // shutting down
    }
    let policy = ctx.settings.token.without_renewal();
    let claims = match credential_step(&ctx, &*client, &policy, now).await? {
        Outcome::Unowned => return Ok(Action::await_change()),
        Outcome::Held(claims) => claims,
        Outcome::Refused(problem) => {
            let status = client_status::without_credential(
                &client,
                problem,
                &ctx.settings.status.endpoint,
                now,
            );
            if let Some(patch) = status_merge_patch(client.status.as_ref(), &status) {
                let api: Api<Client> = Api::namespaced(ctx.client.clone(), &ns);
                let written = ctx
                    .writer
                    .merge_status_fenced(&api, &name, &rv, &patch)
                    .await?;
                let written_rv = written.resource_version().unwrap_or_default();
                ctx.replaced.clients.note(&ns, &name, &rv, &written_rv);
            }
            return Ok(Action::await_change());
        }
    };
    let desired = client_status::decide(
        &client,
        &claims,
        &ctx.settings.status.endpoint,
        ctx.settings.status.max_requeue,
        now,
    );
    let mut persisted = None;
    if let Some(patch) = status_merge_patch(client.status.as_ref(), &desired.status) {
        let api: Api<Client> = Api::namespaced(ctx.client.clone(), &ns);
        let written = ctx
            .writer
            .merge_status_fenced(&api, &name, &rv, &patch)
            .await?;
        let written_rv = written.resource_version().unwrap_or_default();
        ctx.replaced.clients.note(&ns, &name, &rv, &written_rv);
        persisted = Some(&desired.status);
    }
    let events = client_status::events(
        &name,
        client.status.as_ref(),
        persisted.unwrap_or(client.status.as_ref().unwrap_or(&desired.status)),
    );
    emit(&ctx, &*client, &events).await;
    Ok(requeue(
        &ctx.wakeups.clients,
        &ns,
        &name,
        desired.requeue_after,
    ))
}

/// The Client whose credential Secret changed (the watch mapper of the Client controller's
/// Secret trigger).
pub fn of_credential_secret(s: PartialObjectMeta<Secret>) -> Vec<ObjectRef<Guarded<Client>>> {
    credential_owners::<Client>(&s.metadata, "Client", "-client")
}
