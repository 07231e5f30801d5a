//! IO of the Exporter, Client and Lease reconcilers: read, call the pure builders, write only
//! what changed (a resourceVersion-fenced JSON merge patch of status), then emit events.

use std::collections::BTreeMap;
use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{ObjectMeta, PartialObjectMeta, Patch};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource, ResourceExt};
use serde_json::{Map, json};
use tracing::{info, warn};

use crate::conditions;
use crate::exporter::auth::token::{
    self, Claims, MintReason, SigningKey, TokenAction, TokenPolicy,
};
use crate::exporter::crd::{Client, Exporter, ExporterAccessPolicy, Lease};
use crate::exporter::lease::assign::{
    self, AssignInputs, Assignment, ENDED_LABEL, ENDED_VALUE, QueueInputs, UNSATISFIABLE,
};
use crate::exporter::lease::queue;
use crate::exporter::own_writes::{Ledger, Replacements, STALE_RECHECK, Tokens};
use crate::exporter::settings::Settings;
use crate::exporter::status::client as client_status;
use crate::exporter::status::credential::{
    REASON_SECRET_CONFLICT, credential_name_too_long, secret_conflict,
};
use crate::exporter::status::events::{EventSpec, mint_note};
use crate::exporter::status::exporter::{self as exporter_status, HeldLease};
use crate::runtime::controller::Guarded;
use crate::runtime::timers::Timers;
use crate::runtime::writer::kube_metric_label;
use crate::runtime::{ReconcileError, Synced, WriteError, Writer};

pub struct Ctx {
    pub writer: Writer,
    pub client: kube::Client,
    pub settings: Settings,
    pub key: SigningKey,
    pub metrics: crate::exporter::metrics::Metrics,
    pub caches: Caches,
    /// Our lease assignments the Lease cache may not show yet.
    pub ledger: Ledger,
    /// Our status writes whose watch event has not arrived.
    pub replaced: Replacements,
    /// The tokens our credential Secrets hold, per resourceVersion.
    pub tokens: Tokens,
    /// Each controller's timed wake-ups.
    pub wakeups: Wakeups,
}

/// The next timed pass of every Exporter, Client and Lease that has one (a token threshold, an
/// exporter going offline, a lease's begin or end), fed back to its controller as a trigger.
#[derive(Default)]
pub struct Wakeups {
    pub exporters: Arc<Timers<Guarded<Exporter>>>,
    pub clients: Arc<Timers<Guarded<Client>>>,
    pub leases: Arc<Timers<Guarded<Lease>>>,
}

/// The feature's caches, one per kind, each fed by the watch that also triggers the passes
/// that read it (see `crate::exporter::start`). Guarded: an unreadable object is skipped by every
/// decision that reads the cache, and reported by its own controller's pass.
pub struct Caches {
    /// Open once every cache below has listed.
    pub synced: Synced,
    pub exporters: Store<Guarded<Exporter>>,
    /// Active Leases: without the ended label.
    pub leases: Store<Guarded<Lease>>,
    pub clients: Store<Guarded<Client>>,
    pub policies: Store<Guarded<ExporterAccessPolicy>>,
    /// Metadata only.
    pub secrets: Store<PartialObjectMeta<Secret>>,
}

impl Caches {
    /// The readable objects of `namespace` in `store`.
    fn in_namespace<K>(store: &Store<Guarded<K>>, namespace: &str) -> Vec<Arc<Guarded<K>>>
    where
        K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        store
            .state()
            .into_iter()
            .filter(|g| g.0.is_ok() && g.meta().namespace.as_deref() == Some(namespace))
            .collect()
    }

    fn get<K>(store: &Store<Guarded<K>>, namespace: &str, name: &str) -> Option<Arc<Guarded<K>>>
    where
        K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        store
            .get(&ObjectRef::new(name).within(namespace))
            .filter(|g| g.0.is_ok())
    }
}

/// The readable objects behind [`Caches::in_namespace`]'s guards.
fn readable<K>(guards: &[Arc<Guarded<K>>]) -> Vec<&K> {
    guards.iter().filter_map(|g| g.0.as_ref().ok()).collect()
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Write(#[from] WriteError),
    /// A credential Secret the metadata cache knows, read for its token.
    #[error("read Secret {0}")]
    ReadSecret(String, #[source] kube::Error),
    /// The exporter a lease is about to get, read fresh (docs/exporter.md, "Lease hooks: the
    /// assignment gate").
    #[error("read Exporter {0}")]
    ReadExporter(String, #[source] kube::Error),
    /// The fresh reads an Unsatisfiable end is decided on.
    #[error("confirm that Lease {0} is unsatisfiable")]
    ConfirmUnsatisfiable(String, #[source] kube::Error),
}

impl ReconcileError for Error {
    fn metric_label(&self) -> &'static str {
        match self {
            Error::Write(e) => e.metric_label(),
            Error::ReadSecret(_, e)
            | Error::ReadExporter(_, e)
            | Error::ConfirmUnsatisfiable(_, e) => kube_metric_label(e),
        }
    }
    fn is_conflict(&self) -> bool {
        match self {
            Error::Write(e) => e.is_conflict(),
            // Reads never conflict.
            _ => false,
        }
    }
}

pub use crate::runtime::writer::status_merge_patch;

/// A controller owner reference to `obj` that blocks its deletion until the garbage collector
/// removed the dependant, as controller-runtime's `SetControllerReference` writes it.
fn controller_ref<K: Resource<DynamicType = ()>>(obj: &K) -> Option<OwnerReference> {
    let mut owner = obj.controller_owner_ref(&())?;
    owner.block_owner_deletion = Some(true);
    Some(owner)
}

fn has_controller_ref(meta: &ObjectMeta, owner: &OwnerReference) -> bool {
    crate::runtime::meta::controlled_by(meta, &owner.uid)
}

/// The credential after [`ensure_credential`]: the claims of the token the Secret holds after
/// this pass and why it was minted, if it was; or the Secret name is taken by someone else.
enum Credential {
    Held(Claims, Option<MintReason>),
    Conflict,
}

/// The credential Secret as this pass sees it: its metadata and its token as read (none when
/// it holds no `token` key).
struct Stored {
    meta: ObjectMeta,
    token: Option<token::Read>,
}

/// The Secret from the caches where they know it: absent when the (synced) Secret cache has
/// no such name, its token from [`Tokens`] when the cached version is one we wrote or read.
/// Otherwise (or with `fresh`) one GET.
async fn stored_credential(
    ctx: &Ctx,
    api: &Api<Secret>,
    namespace: &str,
    name: &str,
    fresh: bool,
) -> Result<Option<Stored>, Error> {
    if !fresh {
        ctx.tokens.wait_primed().await;
        let Some(cached) = ctx
            .caches
            .secrets
            .get(&ObjectRef::new(name).within(namespace))
        else {
            return Ok(None);
        };
        let rv = cached
            .metadata
            .resource_version
            .as_deref()
            .unwrap_or_default();
        if let Some(token) = ctx.tokens.get(namespace, name, rv) {
            return Ok(Some(Stored {
                meta: cached.metadata.clone(),
                token: Some(token),
            }));
        }
    }
    let Some(secret) = api
        .get_opt(name)
        .await
        .map_err(|e| Error::ReadSecret(name.to_string(), e))?
    else {
        return Ok(None);
    };
    let token = token_in(&secret).map(|t| token::read(t, &ctx.key));
    Ok(Some(Stored {
        meta: secret.metadata,
        token,
    }))
}

/// The `token` key of a Secret's data.
fn token_in(secret: &Secret) -> Option<&[u8]> {
    Some(&secret.data.as_ref()?.get("token")?.0)
}

/// Remembers the token a credential Secret holds at `rv` (see [`super::own_writes::Tokens`]).
fn remember_token(ctx: &Ctx, namespace: &str, name: &str, rv: &str, token: token::Read) {
    ctx.tokens.put(namespace, name, rv, token, |ns, n| {
        ctx.caches
            .secrets
            .get(&ObjectRef::new(n).within(ns))
            .is_some()
    });
}

/// The token of a credential Secret: one an Exporter or Client controls, holding `token`.
fn credential_token(secret: &Secret) -> Option<(&str, &str, &str, &[u8])> {
    let m = &secret.metadata;
    m.owner_references.iter().flatten().find(|o| {
        o.controller == Some(true)
            && (o.kind == "Exporter" || o.kind == "Client")
            && o.api_version.starts_with("jumpstarter.dev/")
    })?;
    Some((
        m.namespace.as_deref()?,
        m.name.as_deref()?,
        m.resource_version.as_deref()?,
        token_in(secret)?,
    ))
}

/// A starting manager knows no token (the Secret cache holds metadata only), so every
/// Exporter's and Client's first pass would GET its Secret: thousands of reads after a
/// restart. Once the caches are synced (after `/readyz`), this reads the Opaque Secrets of
/// the watched namespaces in pages of 100 instead and remembers each credential's token; the
/// passes wait for it. On an error each pass reads its own Secret, as before.
pub async fn prime_tokens(rt: crate::runtime::Runtime, ctx: Arc<Ctx>) {
    if ctx.caches.synced.wait().await {
        let api: Api<Secret> = rt.watched();
        let mut lp = kube::api::ListParams::default()
            .fields("type=Opaque")
            .limit(100);
        let mut known = 0usize;
        loop {
            let page = tokio::select! {
                page = api.list(&lp) => page,
                _ = rt.shutdown.cancelled() => break,
            };
            let page = match page {
                Ok(page) => page,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot list credential Secrets; each pass reads its own");
                    break;
                }
            };
            for secret in &page.items {
                if let Some((ns, name, rv, token)) = credential_token(secret) {
                    remember_token(&ctx, ns, name, rv, token::read(token, &ctx.key));
                    known += 1;
                }
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(c) => lp = lp.continue_token(&c),
                None => {
                    tracing::info!(credentials = known, "credential tokens read");
                    break;
                }
            }
        }
    }
    ctx.tokens.primed();
}

/// Ensures the credential Secret (docs/exporter.md, "Credentials"). A Secret of that name is
/// written only when this object controls it, or when the token it holds is one ucm minted for this
/// very object (uid included: a Secret that lost its ownerRef); any other is left untouched.
async fn ensure_credential(
    ctx: &Ctx,
    namespace: &str,
    secret_name: &str,
    owner: &OwnerReference,
    subject: &str,
    policy: &TokenPolicy,
    now: Timestamp,
) -> Result<Credential, Error> {
    // From the caches first; fresh once if the cache had not seen the Secret yet (someone
    // created it meanwhile: the create met AlreadyExists).
    let mut fresh = false;
    loop {
        let pass = credential_pass(
            ctx,
            namespace,
            secret_name,
            owner,
            subject,
            policy,
            now,
            fresh,
        );
        match pass.await {
            Err(Error::Write(e)) if !fresh && e.is_already_exists() => fresh = true,
            other => return other,
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn credential_pass(
    ctx: &Ctx,
    namespace: &str,
    secret_name: &str,
    owner: &OwnerReference,
    subject: &str,
    policy: &TokenPolicy,
    now: Timestamp,
    fresh: bool,
) -> Result<Credential, Error> {
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
    let existing = stored_credential(ctx, &api, namespace, secret_name, fresh).await?;
    let holder = token::holder(
        &owner.kind.to_lowercase(),
        namespace,
        &owner.name,
        &owner.uid,
    );
    // A token ucm minted for another object (its holder) is never kept, even with our subject.
    let stored = existing.as_ref().and_then(|s| s.token.as_ref());
    let action = match token::judge(stored, subject, now, policy) {
        TokenAction::Keep(c) if c.holder.as_ref().is_some_and(|h| *h != holder) => {
            TokenAction::Mint(MintReason::Replaced(token::Invalid::Subject))
        }
        action => action,
    };
    if let Some(secret) = &existing
        && !has_controller_ref(&secret.meta, owner)
        && !matches!(&action, TokenAction::Keep(c) if c.holder.as_deref() == Some(holder.as_str()))
    {
        return Ok(Credential::Conflict);
    }
    // Whatever this pass leaves in the Secret, at the version it leaves, is known from now on.
    let remember = |written: &ObjectMeta, token: token::Read| {
        let rv = written.resource_version.as_deref().unwrap_or_default();
        remember_token(ctx, namespace, secret_name, rv, token);
    };
    match action {
        TokenAction::Keep(claims) => {
            let secret = existing.expect("a kept token was stored");
            let token = Ok(claims.clone());
            if has_controller_ref(&secret.meta, owner) {
                remember(&secret.meta, token);
            } else {
                let mut refs = secret.meta.owner_references.clone().unwrap_or_default();
                refs.retain(|r| r.controller != Some(true));
                refs.push(owner.clone());
                let patch = json!({"metadata": {"ownerReferences": refs, "resourceVersion": secret.meta.resource_version}});
                let written = ctx
                    .writer
                    .patch(&api, secret_name, &Patch::Merge(patch))
                    .await?;
                remember(&written.metadata, token);
            }
            Ok(Credential::Held(claims, None))
        }
        TokenAction::Mint(reason) => {
            let (jwt, claims) =
                token::mint_for(&ctx.key, subject, Some(&holder), now, policy.lifetime);
            let token = Ok(claims.for_judging());
            let data = BTreeMap::from([("token".to_string(), ByteString(jwt.into_bytes()))]);
            let written = match existing {
                None => {
                    let secret = Secret {
                        metadata: ObjectMeta {
                            name: Some(secret_name.to_string()),
                            namespace: Some(namespace.to_string()),
                            owner_references: Some(vec![owner.clone()]),
                            ..Default::default()
                        },
                        type_: Some("Opaque".into()),
                        data: Some(data),
                        ..Default::default()
                    };
                    ctx.writer.create(&api, &secret).await?
                }
                Some(secret) => {
                    let mut refs = secret.meta.owner_references.clone().unwrap_or_default();
                    if !has_controller_ref(&secret.meta, owner) {
                        refs.retain(|r| r.controller != Some(true));
                        refs.push(owner.clone());
                    }
                    // `data` is replaced entirely (merge patch would keep stray keys).
                    let patch: json_patch::Patch = serde_json::from_value(json!([
                        {"op": "test", "path": "/metadata/resourceVersion", "value": secret.meta.resource_version},
                        {"op": "add", "path": "/data", "value": data},
                        {"op": "add", "path": "/metadata/ownerReferences", "value": refs},
                    ]))
                    .expect("valid JSON patch");
                    ctx.writer
                        .patch(&api, secret_name, &Patch::<()>::Json(patch))
                        .await?
                }
            };
            remember(&written.metadata, token);
            Ok(Credential::Held(claims, Some(reason)))
        }
    }
}

/// Warning `SecretConflict` naming the Secret, once: when the status did not say so yet.
async fn conflict_event<K: Resource<DynamicType = ()>>(
    ctx: &Ctx,
    obj: &K,
    before: Option<&[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition]>,
    problem: &conditions::Desired<'_>,
) {
    let already = before
        .unwrap_or_default()
        .iter()
        .any(|c| c.type_ == problem.type_ && c.reason == problem.reason);
    if !already {
        let event = EventSpec {
            warning: true,
            reason: REASON_SECRET_CONFLICT,
            note: problem.message.clone(),
        };
        emit(ctx, obj, &[event]).await;
    }
}

/// Publishes the events of one pass in order, off the pass's critical path: an event is a
/// courtesy, so the status write it accompanies need not wait for it.
async fn emit<K: Resource<DynamicType = ()>>(ctx: &Ctx, obj: &K, events: &[EventSpec]) {
    if events.is_empty() {
        return;
    }
    let regarding = obj.object_ref(&());
    let writer = ctx.writer.clone();
    let events: Vec<(EventType, &'static str, &'static str, String)> = events
        .iter()
        .map(|e| {
            let t = if e.warning {
                EventType::Warning
            } else {
                EventType::Normal
            };
            (t, e.reason, e.action(), e.note.clone())
        })
        .collect();
    tokio::spawn(async move {
        for (t, reason, action, note) in events {
            writer.event(&regarding, t, reason, action, note).await;
        }
    });
}

/// `CredentialCreated`, right after the Secret write that minted the token: a later failure
/// in the same pass (a status conflict) must not lose it.
async fn credential_event<K: Resource<DynamicType = ()>>(
    ctx: &Ctx,
    obj: &K,
    kind: &str,
    minted: Option<MintReason>,
    secret: &str,
) {
    if let Some(reason) = minted {
        let event = EventSpec {
            warning: false,
            reason: "CredentialCreated",
            note: mint_note(kind, reason, secret),
        };
        emit(ctx, obj, &[event]).await;
    }
}

/// A write answered 404: the object (or its Secret) was deleted meanwhile. Its deletion event
/// brings whatever pass is still needed, so this pass ends without an error.
fn gone_is_done(result: Result<Action, Error>) -> Result<Action, Error> {
    match result {
        Err(Error::Write(e)) if e.is_not_found() => Ok(Action::await_change()),
        other => other,
    }
}

/// Sets the object's next timed pass, replacing the one before ([`Wakeups`]: compact, unlike
/// kube's scheduler, which keeps only the short-lived requeues: a stale pass's recheck, the
/// error backoff).
fn requeue<K>(
    timers: &Timers<K>,
    ns: &str,
    name: &str,
    after: Option<std::time::Duration>,
) -> Action {
    timers.set(ns, name, after);
    Action::await_change()
}

/// The Exporter pass (docs/exporter.md, "The Exporter pass").
pub async fn reconcile_exporter(exporter: Arc<Exporter>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    gone_is_done(exporter_pass(exporter, ctx).await)
}

async fn exporter_pass(exporter: Arc<Exporter>, ctx: Arc<Ctx>) -> Result<Action, Error> {
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
    let Some(owner) = controller_ref(&*exporter) else {
        return Ok(Action::await_change());
    };
    let subject = token::subject(
        "exporter",
        &ns,
        &name,
        exporter.uid().as_deref().unwrap_or_default(),
        exporter.metadata.annotations.as_ref(),
    );
    let secret_name = format!("{name}-exporter");
    let mut no_credential = credential_name_too_long("Exporter", &name, "-exporter");
    let claims = if no_credential.is_some() {
        None
    } else {
        match ensure_credential(
            &ctx,
            &ns,
            &secret_name,
            &owner,
            &subject,
            &ctx.settings.token,
            now,
        )
        .await?
        {
            Credential::Held(claims, minted) => {
                // An Exporter's first credential gets no event (upstream emits none for
                // Exporters): with thousands created at once it would be a third of their
                // requests. A renewal or a replacement is news, so those keep theirs.
                let news = minted.filter(|m| !matches!(m, MintReason::Created));
                credential_event(&ctx, &*exporter, "exporter", news, &secret_name).await;
                Some(claims)
            }
            Credential::Conflict => {
                let problem = secret_conflict("Exporter", &ns, &secret_name);
                let before = exporter
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_deref());
                conflict_event(&ctx, &*exporter, before, &problem).await;
                no_credential = Some(problem);
                None
            }
        }
    };

    // The cache is enough here: a Lease change that alters the held lease triggers a pass
    // after the cache has it.
    let leases: Vec<Lease> = Caches::in_namespace(&ctx.caches.leases, &ns)
        .iter()
        .filter_map(|g| g.0.as_ref().ok())
        .filter(|l| l.status.as_ref().and_then(|s| s.exporter_ref_name()) == Some(name.as_str()))
        .cloned()
        .collect();
    let (held, several) = assign::held_lease(&name, &leases);
    if several {
        warn!(exporter = %name, "several active leases name this exporter; using the earliest");
    }
    let held = held.map(|l| HeldLease {
        name: l.name_any(),
        uid: l.uid(),
        client_name: l.spec.client_ref.name.clone(),
    });
    let mut desired = exporter_status::desired_status(
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
            &conditions::truncate(now),
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

/// The Client pass (docs/exporter.md, "The Client pass").
pub async fn reconcile_client(client: Arc<Client>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    gone_is_done(client_pass(client, ctx).await)
}

async fn client_pass(client: Arc<Client>, ctx: Arc<Ctx>) -> Result<Action, Error> {
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
    let Some(owner) = controller_ref(&*client) else {
        return Ok(Action::await_change());
    };
    let subject = token::subject(
        "client",
        &ns,
        &name,
        client.uid().as_deref().unwrap_or_default(),
        client.metadata.annotations.as_ref(),
    );
    let secret_name = format!("{name}-client");
    let policy = ctx.settings.token.without_renewal();
    let mut problem = credential_name_too_long("Client", &name, "-client");
    let mut held = None;
    if problem.is_none() {
        match ensure_credential(&ctx, &ns, &secret_name, &owner, &subject, &policy, now).await? {
            Credential::Held(claims, minted) => held = Some((claims, minted)),
            Credential::Conflict => {
                let p = secret_conflict("Client", &ns, &secret_name);
                let before = client.status.as_ref().and_then(|s| s.conditions.as_deref());
                conflict_event(&ctx, &*client, before, &p).await;
                problem = Some(p);
            }
        }
    }
    if let Some(problem) = problem {
        let status =
            client_status::without_credential(&client, problem, &ctx.settings.status.endpoint, now);
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
    let Some((claims, minted)) = held else {
        return Ok(Action::await_change());
    };
    credential_event(&ctx, &*client, "client", minted, &secret_name).await;
    let desired = client_status::desired_status(
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

/// The Lease pass (docs/exporter.md, "The Lease pass"): decide, write status, count, then metadata.
pub async fn reconcile_lease(lease: Arc<Lease>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    gone_is_done(lease_pass(lease, ctx).await)
}

async fn lease_pass(lease: Arc<Lease>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let now = Timestamp::now();
    let ns = lease.namespace().unwrap_or_default();
    let name = lease.name_any();
    let rv = lease.resource_version().unwrap_or_default();
    if ctx.replaced.leases.is_stale(&ns, &name, &rv) {
        return Ok(Action::requeue(STALE_RECHECK));
    }
    // An empty cache would make every pinned exporter "not found" and end the lease.
    if !ctx.caches.synced.wait().await {
        return Ok(Action::await_change()); // shutting down
    }
    let status = lease.status.clone().unwrap_or_default();
    let prior_unsatisfiable = conditions::is_true(
        status.conditions.as_deref().unwrap_or_default(),
        UNSATISFIABLE,
    );

    // The assignment reads caches only. Each is fed by a watch that also triggers
    // this controller, so a change a pending lease waits for always brings a pass that sees it.
    let exporters = Caches::in_namespace(&ctx.caches.exporters, &ns);
    let mut assignment = None;
    // The waiting leases behind this one, whose shown position changes when it enters or
    // leaves the queue.
    let mut wake: Vec<String> = Vec::new();
    if !status.ended && status.exporter_ref_name().is_none() {
        let exporter_refs = readable(&exporters);
        let policies = Caches::in_namespace(&ctx.caches.policies, &ns);
        let policy_refs = readable(&policies);
        // An empty name is no Client; it is reported as not found.
        let client = if policies.is_empty() || lease.spec.client_ref.name.is_empty() {
            None
        } else {
            Caches::get(&ctx.caches.clients, &ns, &lease.spec.client_ref.name)
        };
        // Decides and reserves under the ledger's lock, from the inputs given. The queue
        // (docs/exporter.md, "Lease scheduling") is built from the same snapshot: every waiting
        // lease of the namespace, with the Clients that policies approve by.
        let decide = |exporters: &[&Exporter],
                      policies: &[&ExporterAccessPolicy],
                      client: Option<&Client>| {
            let clients = if policies.is_empty() {
                Vec::new()
            } else {
                Caches::in_namespace(&ctx.caches.clients, &ns)
            };
            let by_name: std::collections::HashMap<&str, &Client> = readable(&clients)
                .into_iter()
                .map(|c| (c.metadata.name.as_deref().unwrap_or_default(), c))
                .collect();
            let lookup = |n: &str| by_name.get(n).copied();
            let mut behind = Vec::new();
            let assignment = ctx.ledger.decide(
                &ns,
                &name,
                || Caches::in_namespace(&ctx.caches.leases, &ns),
                |active| {
                    let field = queue::waiting(exporters, active, policies, &lookup, now);
                    let q = QueueInputs {
                        field: &field,
                        grace: ctx.settings.preemption_grace,
                    };
                    let d = assign::decide(&AssignInputs {
                        lease: &lease,
                        exporters,
                        active_leases: active,
                        policies,
                        client,
                        now,
                        queue: Some(&q),
                    });
                    behind = d.behind;
                    d.assignment
                },
            );
            (assignment, behind)
        };
        let (mut decision, behind) = decide(
            &exporter_refs,
            &policy_refs,
            client.as_ref().and_then(|c| c.0.as_ref().ok()),
        );
        wake = behind;
        // Unsatisfiable ends the lease, so it is never decided on caches alone: an
        // Exporter, policy or Client created just before the Lease may not be in them yet.
        // The failure is decided again on fresh reads (three requests, failures only).
        if matches!(decision, Assignment::Unsatisfiable { .. }) {
            let confirm = |e| Error::ConfirmUnsatisfiable(name.clone(), e);
            let exporters = Api::<Exporter>::namespaced(ctx.client.clone(), &ns)
                .list(&Default::default())
                .await
                .map_err(confirm)?
                .items;
            let policies = Api::<ExporterAccessPolicy>::namespaced(ctx.client.clone(), &ns)
                .list(&Default::default())
                .await
                .map_err(confirm)?
                .items;
            let client = if policies.is_empty() || lease.spec.client_ref.name.is_empty() {
                None
            } else {
                Api::<Client>::namespaced(ctx.client.clone(), &ns)
                    .get_opt(&lease.spec.client_ref.name)
                    .await
                    .map_err(confirm)?
            };
            (decision, wake) = decide(
                &exporters.iter().collect::<Vec<_>>(),
                &policies.iter().collect::<Vec<_>>(),
                client.as_ref(),
            );
        }
        // docs/exporter.md, "Lease hooks: the assignment gate": the caches are not mutually
        // consistent, so an exporter that records lease hooks is re-checked on a fresh read: its
        // cache may predate the record of the lease it was handed last. Others gate on the
        // exporterStatus they report, as upstream reads it from its cache; their assignment costs
        // no read.
        if let Assignment::Assign { exporter, .. } = &decision
            && exporter_refs.iter().any(|e| {
                e.metadata.name.as_deref() == Some(exporter.as_str())
                    && e.status.as_ref().and_then(|s| s.records_lease_hooks) == Some(true)
            })
        {
            let fresh = Api::<Exporter>::namespaced(ctx.client.clone(), &ns)
                .get_opt(exporter)
                .await;
            let gated = match fresh {
                Ok(Some(fresh)) => assign::gate_on_fresh(&fresh),
                Ok(None) => Some(Assignment::Pending {
                    reason: "ExporterNotFound",
                    message: format!("Exporter {exporter} was deleted"),
                }),
                Err(e) => {
                    ctx.ledger.release(&ns, &name);
                    return Err(Error::ReadExporter(exporter.clone(), e));
                }
            };
            if let Some(pending) = gated {
                ctx.ledger.release(&ns, &name);
                decision = pending;
            }
        }
        if let Assignment::Queued {
            preempt: Some(p), ..
        } = &decision
            && p.due
        {
            preempt(&ctx, &ns, &name, &p.lease, now).await?;
        }
        assignment = Some(decision);
    }

    let out = assign::build_status(&lease, assignment, now);
    // The version the metadata patch below replaces.
    let mut current_rv = rv.clone();
    if let Some(patch) = status_merge_patch(lease.status.as_ref(), &out.status) {
        let api: Api<Lease> = Api::namespaced(ctx.client.clone(), &ns);
        let written = match ctx
            .writer
            .merge_status_fenced(&api, &name, &rv, &patch)
            .await
        {
            Ok(written) => written,
            Err(e) => {
                // Not assigned after all: the exporter is free for the next decision.
                ctx.ledger.release(&ns, &name);
                return Err(e.into());
            }
        };
        current_rv = written.resource_version().unwrap_or_default();
        ctx.replaced.leases.note(&ns, &name, &rv, &current_rv);
        if let Some(exporter) = &out.assigned {
            info!(lease = %name, exporter = %exporter, "lease acquired");
            ctx.metrics
                .acquisitions
                .with_label_values(&["success"])
                .inc();
            ctx.metrics
                .lease_wait
                .with_label_values(&[&ns])
                .observe(waited(&lease, now));
        }
        // Coalesced position updates (docs/exporter.md, "Lease scheduling"): a lease that
        // leaves the queue (assigned or ended) or enters it ahead of others moves the leases
        // behind it, at most POSITION_CAP + 1 of them; each is woken within the settle time,
        // so a burst of changes costs each of them one pass and at most one write.
        let was_waiting = status.exporter_ref_name().is_none() && !status.ended;
        let left = was_waiting && (out.assigned.is_some() || out.status.ended);
        let entered = status.queue.is_none() && out.status.queue.is_some();
        if left || entered {
            for other in &wake {
                ctx.wakeups.leases.wake_within(&ns, other, POSITION_SETTLE);
            }
        }
        let now_unsatisfiable = conditions::is_true(
            out.status.conditions.as_deref().unwrap_or_default(),
            UNSATISFIABLE,
        );
        if !prior_unsatisfiable && now_unsatisfiable {
            ctx.metrics
                .acquisitions
                .with_label_values(&["failure"])
                .inc();
        }
    }

    // Metadata: the ended label and the controller ownerRef to the assigned exporter.
    let mut labels = lease.labels().clone();
    if out.status.ended {
        labels.insert(ENDED_LABEL.into(), ENDED_VALUE.into());
    }
    let mut owners = lease.metadata.owner_references.clone().unwrap_or_default();
    if let Some(exporter_name) = out.status.exporter_ref_name()
        && let Some(exporter) = exporters
            .iter()
            .filter_map(|g| g.0.as_ref().ok())
            .find(|e| e.metadata.name.as_deref() == Some(exporter_name))
        && let Some(owner) = controller_ref(exporter)
        && !has_controller_ref(&lease.metadata, &owner)
    {
        owners.retain(|r| r.controller != Some(true));
        owners.push(owner);
    }
    let labels_changed = &labels != lease.labels();
    let owners_changed =
        Some(&owners) != lease.metadata.owner_references.as_ref() && !owners.is_empty();
    if labels_changed || owners_changed {
        let api: Api<Lease> = Api::namespaced(ctx.client.clone(), &ns);
        let mut meta = Map::new();
        if labels_changed {
            meta.insert("labels".into(), json!({ ENDED_LABEL: ENDED_VALUE }));
        }
        if owners_changed {
            meta.insert("ownerReferences".into(), json!(owners));
        }
        let written = ctx
            .writer
            .patch(&api, &name, &Patch::Merge(json!({ "metadata": meta })))
            .await?;
        let written_rv = written.resource_version().unwrap_or_default();
        ctx.replaced
            .leases
            .note(&ns, &name, &current_rv, &written_rv);
    }
    Ok(requeue(&ctx.wakeups.leases, &ns, &name, out.requeue_after))
}

/// How long position updates of the leases behind a queue change wait, to coalesce a burst.
const POSITION_SETTLE: std::time::Duration = std::time::Duration::from_secs(1);

/// Seconds from a lease's creation, or its beginTime when later, to `now`.
fn waited(lease: &Lease, now: Timestamp) -> f64 {
    let created = lease.metadata.creation_timestamp.as_ref().map(|t| t.0);
    let begin = lease.spec.begin_time.as_ref().map(|t| t.0);
    let from = created.max(begin).unwrap_or(now);
    from.duration_until(now).as_secs_f64().max(0.0)
}

/// Ends the spot lease `victim`, preempted by `by` (docs/exporter.md, "Lease scheduling"): one
/// status write fenced by the cached version, so a lease that changed meanwhile is decided on
/// again. Its own pass then labels it ended, and its exporter comes free for the waiting lease.
async fn preempt(ctx: &Ctx, ns: &str, by: &str, victim: &str, now: Timestamp) -> Result<(), Error> {
    let Some(cached) = Caches::get(&ctx.caches.leases, ns, victim) else {
        return Ok(()); // gone or ended: nothing to preempt
    };
    let Ok(held) = cached.0.as_ref() else {
        return Ok(());
    };
    let rv = held.resource_version().unwrap_or_default();
    // Ended already, or by our own write the cache does not show yet.
    if held.status.as_ref().is_none_or(|s| s.ended) || ctx.replaced.leases.is_stale(ns, victim, &rv)
    {
        return Ok(());
    }
    let status = assign::preempted_status(held, by, now);
    let Some(patch) = status_merge_patch(held.status.as_ref(), &status) else {
        return Ok(());
    };
    let api: Api<Lease> = Api::namespaced(ctx.client.clone(), ns);
    let written = ctx
        .writer
        .merge_status_fenced(&api, victim, &rv, &patch)
        .await?;
    let written_rv = written.resource_version().unwrap_or_default();
    ctx.replaced.leases.note(ns, victim, &rv, &written_rv);
    ctx.metrics.preemptions.with_label_values(&[ns]).inc();
    info!(lease = %victim, by = %by, "spot lease preempted");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// The start-up list keeps the tokens of Secrets an Exporter or Client controls, nothing else.
    #[test]
    fn credential_tokens_are_those_of_secrets_our_kinds_control() {
        let secret = |kind: &str, api_version: &str, controller: bool, token: Option<&str>| {
            let mut v = serde_json::json!({
                "metadata": {"name": "s", "namespace": "ns", "resourceVersion": "7",
                    "ownerReferences": [{"apiVersion": api_version, "kind": kind, "name": "o",
                                         "uid": "u", "controller": controller}]},
                "type": "Opaque"
            });
            if let Some(t) = token {
                use base64::Engine as _;
                v["data"] = serde_json::json!({
                    "token": base64::engine::general_purpose::STANDARD.encode(t)
                });
            }
            serde_json::from_value::<Secret>(v).unwrap()
        };
        let ours = secret("Exporter", "jumpstarter.dev/v1alpha1", true, Some("jwt"));
        let (ns, name, rv, token) = credential_token(&ours).unwrap();
        assert_eq!((ns, name, rv, token), ("ns", "s", "7", &b"jwt"[..]));
        assert!(
            credential_token(&secret(
                "Client",
                "jumpstarter.dev/v1alpha1",
                true,
                Some("t")
            ))
            .is_some()
        );
        assert!(
            credential_token(&secret(
                "Exporter",
                "jumpstarter.dev/v1alpha1",
                false,
                Some("t")
            ))
            .is_none()
        );
        assert!(credential_token(&secret("Exporter", "example.com/v1", true, Some("t"))).is_none());
        assert!(credential_token(&secret("Deployment", "apps/v1", true, Some("t"))).is_none());
        assert!(
            credential_token(&secret("Exporter", "jumpstarter.dev/v1alpha1", true, None)).is_none()
        );
    }

    #[test]
    fn read_errors_name_their_step_and_print_the_cause_once() {
        let forbidden = || {
            kube::Error::Api(Box::new(kube::core::Status {
                code: 403,
                message: "secrets \"e1-exporter\" is forbidden".into(),
                ..Default::default()
            }))
        };
        let e = Error::ReadSecret("e1-exporter".into(), forbidden());
        // The step's own message holds no cause: the chain adds it once, after it.
        assert_eq!(e.to_string(), "read Secret e1-exporter");
        let chain = crate::runtime::controller::error_chain(&e);
        assert!(chain.starts_with("read Secret e1-exporter: "), "{chain}");
        assert_eq!(e.metric_label(), "forbidden");
        let e = Error::ConfirmUnsatisfiable("l1".into(), forbidden());
        assert!(e.to_string().contains("Lease l1"), "{e}");
        assert!(!e.is_conflict());
    }

    #[test]
    fn merge_patch_has_only_changes_and_nulls_for_removals() {
        let old = json!({"a": 1, "b": {"x": 1}, "gone": "y"});
        let new = json!({"a": 1, "b": {"x": 2}, "added": [1]});
        let p = status_merge_patch(Some(&old), &new).unwrap();
        assert_eq!(p, json!({"b": {"x": 2}, "added": [1], "gone": null}));
        // Nested removals are explicit too (a merge patch merges objects).
        let old = json!({"rec": {"lease": "l1", "after": {"phase": "Succeeded"}}, "list": [1, 2]});
        let new = json!({"rec": {"lease": "l2"}, "list": [1]});
        let p = status_merge_patch(Some(&old), &new).unwrap();
        assert_eq!(
            p,
            json!({"rec": {"lease": "l2", "after": null}, "list": [1]})
        );
        let mut applied = old.clone();
        json_patch::merge(&mut applied, &p);
        assert_eq!(applied, new);
        assert_eq!(status_merge_patch(Some(&new), &new), None);
        assert_eq!(
            status_merge_patch(None::<&Value>, &json!({"a": 1})),
            Some(json!({"a": 1}))
        );
    }
}
