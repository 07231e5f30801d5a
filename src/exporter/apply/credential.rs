//! The credential Secret of an Exporter or a Client (docs/exporter.md, "Credentials",
//! "Renewal"), one code path for both kinds ([`Holder`]): read it from the caches and the token
//! memory (primed at start by [`prime_tokens`]), keep, adopt or mint its token, and report a
//! Secret name that is too long or taken as the `TokenExpiring` condition of the status.

use std::collections::BTreeMap;
use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, OwnerReference};
use kube::api::{ObjectMeta, PartialObjectMeta, Patch};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;

use crate::conditions;
use crate::exporter::apply::emit;
use crate::exporter::auth::token::{self, Claims, MintReason, TokenAction, TokenPolicy};
use crate::exporter::context::{Context, Error};
use crate::exporter::crd::{Client, Exporter};
use crate::exporter::decide::credential::{
    REASON_SECRET_CONFLICT, credential_name_too_long, secret_conflict,
};
use crate::exporter::decide::events::{EventSpec, mint_note};
use crate::runtime::controller::Guarded;
use crate::runtime::meta::{controlled_by, controller_ref};

/// An Exporter or a Client: the kinds that hold a credential Secret `<name><SUFFIX>`.
pub trait Holder: Resource<DynamicType = ()> {
    /// What follows the object's name in its Secret's name.
    const SUFFIX: &'static str;
    /// Whether a first credential ([`MintReason::Created`]) gets a `CredentialCreated` event.
    const CREATED_EVENT: bool;
    /// The conditions of the status as persisted.
    fn status_conditions(&self) -> Option<&[Condition]>;
}

impl Holder for Exporter {
    const SUFFIX: &'static str = "-exporter";
    /// An Exporter's first credential gets no event (upstream emits none for Exporters): with
    /// thousands created at once it would be a third of their requests. A renewal or a
    /// replacement is news, so those keep theirs.
    const CREATED_EVENT: bool = false;
    fn status_conditions(&self) -> Option<&[Condition]> {
        self.status.as_ref().and_then(|s| s.conditions.as_deref())
    }
}

impl Holder for Client {
    const SUFFIX: &'static str = "-client";
    const CREATED_EVENT: bool = true;
    fn status_conditions(&self) -> Option<&[Condition]> {
        self.status.as_ref().and_then(|s| s.conditions.as_deref())
    }
}

/// What the credential step leaves the rest of an Exporter or Client pass.
pub enum Outcome {
    /// The object has no controller reference to give its Secret: the pass ends.
    Unowned,
    /// The claims of the token the Secret holds after this pass.
    Held(Claims),
    /// No credential can be issued: the `TokenExpiring` condition that says why.
    Refused(conditions::Desired<'static>),
}

/// The credential step of the Exporter and Client passes: ensures `<name><SUFFIX>` under
/// `policy` ([`ensure_credential`]), with `CredentialCreated` right after a mint and
/// `SecretConflict` once when the name is taken.
pub async fn credential_step<K: Holder>(
    ctx: &Context,
    obj: &K,
    policy: &TokenPolicy,
    now: Timestamp,
) -> Result<Outcome, Error> {
    let Some(owner) = controller_ref(obj) else {
        return Ok(Outcome::Unowned);
    };
    let kind = K::kind(&());
    let lower = kind.to_lowercase();
    let ns = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    let subject = token::subject(
        &lower,
        &ns,
        &name,
        obj.uid().as_deref().unwrap_or_default(),
        obj.meta().annotations.as_ref(),
    );
    let secret_name = format!("{name}{}", K::SUFFIX);
    if let Some(problem) = credential_name_too_long(&kind, &name, K::SUFFIX) {
        return Ok(Outcome::Refused(problem));
    }
    match ensure_credential(ctx, &ns, &secret_name, &owner, &subject, policy, now).await? {
        Credential::Held(claims, minted) => {
            let news = minted.filter(|m| K::CREATED_EVENT || !matches!(m, MintReason::Created));
            credential_event(ctx, obj, &lower, news, &secret_name).await;
            Ok(Outcome::Held(claims))
        }
        Credential::Conflict => {
            let problem = secret_conflict(&kind, &ns, &secret_name);
            conflict_event(ctx, obj, obj.status_conditions(), &problem).await;
            Ok(Outcome::Refused(problem))
        }
    }
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
/// no such name, its token from [`crate::exporter::own_writes::Tokens`] when the cached version is one we wrote or read.
/// Otherwise (or with `fresh`) one GET.
async fn stored_credential(
    ctx: &Context,
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

/// Remembers the token a credential Secret holds at `rv` (see [`crate::exporter::own_writes::Tokens`]).
fn remember_token(ctx: &Context, namespace: &str, name: &str, rv: &str, token: token::Read) {
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
pub async fn prime_tokens(rt: crate::runtime::Runtime, ctx: Arc<Context>) {
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
    ctx: &Context,
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
    ctx: &Context,
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
        && !controlled_by(&secret.meta, &owner.uid)
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
            if controlled_by(&secret.meta, &owner.uid) {
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
            let written =
                write_token(ctx, &api, namespace, secret_name, owner, existing, data).await?;
            remember(&written.metadata, token);
            Ok(Credential::Held(claims, Some(reason)))
        }
    }
}

/// Writes a minted token: a new Secret owned by `owner`, or the existing one's `data` replaced
/// entirely (a merge patch would keep stray keys) and `owner` made its controller, fenced by
/// the version read.
async fn write_token(
    ctx: &Context,
    api: &Api<Secret>,
    namespace: &str,
    secret_name: &str,
    owner: &OwnerReference,
    existing: Option<Stored>,
    data: BTreeMap<String, ByteString>,
) -> Result<Secret, Error> {
    let Some(secret) = existing else {
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
        return Ok(ctx.writer.create(api, &secret).await?);
    };
    let mut refs = secret.meta.owner_references.clone().unwrap_or_default();
    if !controlled_by(&secret.meta, &owner.uid) {
        refs.retain(|r| r.controller != Some(true));
        refs.push(owner.clone());
    }
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": secret.meta.resource_version},
        {"op": "add", "path": "/data", "value": data},
        {"op": "add", "path": "/metadata/ownerReferences", "value": refs},
    ]))
    .expect("valid JSON patch");
    Ok(ctx
        .writer
        .patch(api, secret_name, &Patch::<()>::Json(patch))
        .await?)
}

/// Warning `SecretConflict` naming the Secret, once: when the status did not say so yet.
async fn conflict_event<K: Resource<DynamicType = ()>>(
    ctx: &Context,
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

/// `CredentialCreated`, right after the Secret write that minted the token: a later failure
/// in the same pass (a status conflict) must not lose it.
async fn credential_event<K: Resource<DynamicType = ()>>(
    ctx: &Context,
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

/// What the credential passes read of a cached Secret: its name, version, owners and deletion.
/// The cache holds every Secret of the watched namespaces, so the rest (labels, annotations: a
/// client-side apply's annotation repeats the whole Secret, data included) is dropped.
pub fn slim_secret(s: &mut PartialObjectMeta<Secret>) {
    s.types = None;
    let m = std::mem::take(&mut s.metadata);
    s.metadata = ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        resource_version: m.resource_version,
        owner_references: m.owner_references,
        deletion_timestamp: m.deletion_timestamp,
        ..Default::default()
    };
}

/// The objects whose credential Secret this is: its controller owner of `kind`, and the object
/// its name points to (`<name><suffix>`), so that a Secret that lost its ownerRef, or was
/// deleted, still triggers its owner's pass (which restores or recreates it).
pub fn credential_owners<K>(
    meta: &ObjectMeta,
    kind: &str,
    suffix: &str,
) -> Vec<ObjectRef<Guarded<K>>>
where
    K: kube::Resource<DynamicType = ()>,
{
    let ns = meta.namespace.clone().unwrap_or_default();
    let mut names: Vec<&str> = meta
        .owner_references
        .iter()
        .flatten()
        .filter(|r| r.controller == Some(true) && r.kind == kind)
        .map(|r| r.name.as_str())
        .collect();
    names.extend(
        meta.name
            .as_deref()
            .and_then(|n| n.strip_suffix(suffix))
            .filter(|n| !n.is_empty()),
    );
    names.sort_unstable();
    names.dedup();
    names
        .into_iter()
        .map(|n| ObjectRef::<Guarded<K>>::new(n).within(&ns))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn credential_secrets_map_to_their_owner_by_ref_and_by_name() {
        let meta = |name: &str, owners: Vec<(&str, &str, bool)>| ObjectMeta {
            name: Some(name.into()),
            namespace: Some("lab".into()),
            owner_references: Some(
                owners
                    .into_iter()
                    .map(|(kind, name, controller)| OwnerReference {
                        kind: kind.into(),
                        name: name.into(),
                        controller: Some(controller),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        };
        let names = |m: &ObjectMeta, kind: &str, suffix: &str| {
            credential_owners::<Exporter>(m, kind, suffix)
                .into_iter()
                .map(|r| (r.name, r.namespace.unwrap()))
                .collect::<Vec<_>>()
        };
        let lab = |n: &str| (n.to_string(), "lab".to_string());
        // Owned and named: one pass, not two.
        let m = meta("e1-exporter", vec![("Exporter", "e1", true)]);
        assert_eq!(names(&m, "Exporter", "-exporter"), vec![lab("e1")]);
        // The ownerRef was removed: the name still leads to the owner.
        let m = meta("e1-exporter", vec![]);
        assert_eq!(names(&m, "Exporter", "-exporter"), vec![lab("e1")]);
        // Other kinds and non-controller refs are ignored; other Secrets map to nothing.
        let m = meta(
            "db-password",
            vec![("Deployment", "db", true), ("Exporter", "x", false)],
        );
        assert!(names(&m, "Exporter", "-exporter").is_empty());
        let m = meta("-client", vec![]);
        assert!(names(&m, "Client", "-client").is_empty());
        let m = meta("c1-client", vec![("Client", "c1", true)]);
        assert_eq!(names(&m, "Client", "-client"), vec![lab("c1")]);
    }
}
