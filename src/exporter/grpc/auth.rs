//! Caller authentication and authorization (spec §7.2): exactly one `authorization: Bearer <jwt>`
//! verified by [`Authn`] (internal, external issuers, TokenReview), the
//! `jumpstarter-namespace/kind/name` metadata, and the named object's accepted usernames; with
//! `provisioning.enabled`, a missing Client is created for an external identity (as upstream's
//! `BasicAuthorizer`). Errors never carry token text, Secret names or Kubernetes errors.

use jiff::Timestamp;
use kube::{Api, Resource, ResourceExt};
use tonic::{Request, Status};

use crate::exporter::auth::token;
use crate::exporter::auth::{Authn, Identity};
use crate::exporter::crd::{Client, ClientSpec, Exporter};
use crate::exporter::reconcile::Ctx;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Exporter,
    Client,
}

#[derive(Debug, Clone)]
pub struct Caller {
    pub namespace: String,
    pub name: String,
    pub kind: Kind,
}

fn one_md<'a, T>(req: &'a Request<T>, key: &str) -> Result<&'a str, Status> {
    let mut values = req.metadata().get_all(key).iter();
    match (values.next(), values.next()) {
        (Some(v), None) => v
            .to_str()
            .ok()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| Status::invalid_argument(format!("malformed metadata: {key}"))),
        (None, _) => Err(Status::invalid_argument(format!("missing metadata: {key}"))),
        _ => Err(Status::invalid_argument(format!(
            "multiple values for metadata: {key}"
        ))),
    }
}

/// The bearer token (rule 7.2.1): missing → Unauthenticated, malformed → InvalidArgument.
pub fn bearer<T>(req: &Request<T>) -> Result<&str, Status> {
    let mut values = req.metadata().get_all("authorization").iter();
    let v = match (values.next(), values.next()) {
        (None, _) => return Err(Status::unauthenticated("missing authorization header")),
        (Some(v), None) => v,
        _ => return Err(Status::invalid_argument("multiple authorization headers")),
    };
    let v = v
        .to_str()
        .map_err(|_| Status::invalid_argument("malformed authorization header"))?;
    match v.split_once(' ') {
        Some((scheme, tok)) if scheme.eq_ignore_ascii_case("bearer") && !tok.trim().is_empty() => {
            Ok(tok.trim())
        }
        _ => Err(Status::invalid_argument("malformed authorization header")),
    }
}

/// The metadata part (rule 7.2.2): which object the caller claims to be.
pub fn caller<T>(req: &Request<T>, watched: Option<&str>) -> Result<Caller, Status> {
    let namespace = one_md(req, "jumpstarter-namespace")?.to_string();
    let kind = match one_md(req, "jumpstarter-kind")? {
        "Exporter" => Kind::Exporter,
        "Client" => Kind::Client,
        _ => {
            return Err(Status::invalid_argument(
                "invalid metadata: jumpstarter-kind",
            ));
        }
    };
    let name = one_md(req, "jumpstarter-name")?.to_string();
    if watched.is_some_and(|w| w != namespace) {
        return Err(Status::permission_denied(format!(
            "namespace {namespace} is not served by this controller"
        )));
    }
    Ok(Caller {
        namespace,
        name,
        kind,
    })
}

/// Token and metadata: the caller and who presented the token.
pub async fn identify<T>(
    authn: &Authn,
    req: &Request<T>,
    watched: Option<&str>,
    now: Timestamp,
) -> Result<(Caller, Identity), Status> {
    let tok = bearer(req)?;
    let identity = authn.authenticate(tok, now).await?;
    Ok((caller(req, watched)?, identity))
}

/// A token ucm minted names the object it was minted for (its holder); it must be this one, so
/// migration annotations on another object cannot borrow this object's identity.
fn holds<K: Resource<DynamicType = ()>>(
    holder: Option<&str>,
    kind_prefix: &str,
    namespace: &str,
    obj: &K,
) -> bool {
    holder.is_none_or(|h| {
        h == token::holder(
            kind_prefix,
            namespace,
            &obj.name_any(),
            obj.meta().uid.as_deref().unwrap_or_default(),
        )
    })
}

fn accepted<K: Resource<DynamicType = ()>>(
    prefix: &str,
    obj: &K,
    kind_prefix: &str,
    namespace: &str,
    spec_username: Option<&str>,
) -> Vec<String> {
    let subject = token::subject(
        kind_prefix,
        namespace,
        &obj.name_any(),
        obj.meta().uid.as_deref().unwrap_or_default(),
        obj.meta().annotations.as_ref(),
    );
    let mut v = vec![format!("{prefix}{subject}")];
    v.extend(spec_username.map(str::to_string));
    v
}

/// Full check (rules 7.2.1–7.2.5): `allowed` lists the kinds the RPC accepts.
pub async fn authorize<T>(
    ctx: &Ctx,
    authn: &Authn,
    watched: Option<&str>,
    req: &Request<T>,
    allowed: &[Kind],
) -> Result<Caller, Status> {
    let (caller, identity) = identify(authn, req, watched, Timestamp::now()).await?;
    if !allowed.contains(&caller.kind) {
        return Err(Status::permission_denied(format!(
            "this call is not available to a {:?}",
            caller.kind
        )));
    }
    let denied = || {
        Status::permission_denied(format!(
            "{:?} {}/{} is not authorized",
            caller.kind, caller.namespace, caller.name
        ))
    };
    let prefix = authn.prefix();
    let holder = identity.holder.as_deref();
    let names = match caller.kind {
        Kind::Exporter => {
            let api: Api<Exporter> = Api::namespaced(ctx.client.clone(), &caller.namespace);
            let obj = api
                .get_opt(&caller.name)
                .await
                .map_err(|_| Status::unavailable("cannot read the caller's object"))?
                .ok_or_else(denied)?;
            if !holds(holder, "exporter", &caller.namespace, &obj) {
                return Err(denied());
            }
            accepted(
                prefix,
                &obj,
                "exporter",
                &caller.namespace,
                obj.spec.username.as_deref(),
            )
        }
        Kind::Client => {
            let api: Api<Client> = Api::namespaced(ctx.client.clone(), &caller.namespace);
            let found = api
                .get_opt(&caller.name)
                .await
                .map_err(|_| Status::unavailable("cannot read the caller's object"))?;
            let obj = match found {
                Some(obj) => obj,
                None if ctx.settings.config.provisioning && !identity.internal => {
                    provision(ctx, &api, &caller, &identity.username).await?
                }
                None => return Err(denied()),
            };
            if !holds(holder, "client", &caller.namespace, &obj) {
                return Err(denied());
            }
            accepted(
                prefix,
                &obj,
                "client",
                &caller.namespace,
                obj.spec.username.as_deref(),
            )
        }
    };
    if names.contains(&identity.username) {
        Ok(caller)
    } else {
        Err(denied())
    }
}

/// `provisioning.enabled`: the Client the caller names, for its username. A concurrent first
/// call may create it first; then the existing one is judged as usual.
async fn provision(
    ctx: &Ctx,
    api: &Api<Client>,
    caller: &Caller,
    username: &str,
) -> Result<Client, Status> {
    let client = Client {
        metadata: kube::api::ObjectMeta {
            name: Some(caller.name.clone()),
            namespace: Some(caller.namespace.clone()),
            ..Default::default()
        },
        spec: ClientSpec {
            username: Some(username.to_string()),
        },
        status: None,
    };
    match ctx.writer.create(api, &client).await {
        Ok(created) => {
            tracing::info!(client = %caller.name, namespace = %caller.namespace, %username,
                "provisioned a Client for an authenticated identity");
            Ok(created)
        }
        Err(e) if e.is_conflict() => api
            .get_opt(&caller.name)
            .await
            .ok()
            .flatten()
            .ok_or_else(|| Status::unavailable("cannot read the caller's object")),
        Err(e) => {
            tracing::warn!(client = %caller.name, namespace = %caller.namespace, error = %e,
                "cannot provision a Client");
            Err(Status::unavailable(
                "cannot provision the Client; retry later",
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exporter::auth::token::{DEFAULT_PREFIX, SigningKey};
    use jiff::SignedDuration;

    fn req(token: Option<&str>, md: &[(&'static str, &str)]) -> Request<()> {
        let mut r = Request::new(());
        if let Some(t) = token {
            r.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        for (k, v) in md {
            r.metadata_mut().append(*k, v.parse().unwrap());
        }
        r
    }

    const MD: &[(&str, &str)] = &[
        ("jumpstarter-namespace", "lab"),
        ("jumpstarter-kind", "Exporter"),
        ("jumpstarter-name", "e1"),
    ];

    fn authn(key: &SigningKey) -> Authn {
        let offline =
            kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap()))
                .unwrap();
        Authn::new(key.clone(), &Default::default(), &offline).unwrap()
    }

    #[tokio::test]
    async fn codes_as_upstream_and_no_token_text() {
        let key = SigningKey::from_seed("a").unwrap();
        let other = SigningKey::from_seed("b").unwrap();
        let authn = authn(&key);
        let now = Timestamp::now();
        let (good, _) = token::mint(
            &key,
            "exporter:lab:e1:u",
            now,
            SignedDuration::from_hours(1),
        );
        let (foreign, _) = token::mint(
            &other,
            "exporter:lab:e1:u",
            now,
            SignedDuration::from_hours(1),
        );
        let (expired, _) = token::mint(
            &key,
            "exporter:lab:e1:u",
            now - SignedDuration::from_hours(2),
            SignedDuration::from_hours(1),
        );
        let (c, who) = identify(&authn, &req(Some(&good), MD), None, now)
            .await
            .unwrap();
        assert_eq!(
            (c.kind, c.name.as_str(), who.username.as_str(), who.internal),
            (Kind::Exporter, "e1", "internal:exporter:lab:e1:u", true)
        );
        assert_eq!(authn.prefix(), DEFAULT_PREFIX);
        let code =
            async |r: Request<()>, w: Option<&str>| identify(&authn, &r, w, now).await.unwrap_err();
        assert_eq!(
            code(req(None, MD), None).await.code(),
            tonic::Code::Unauthenticated
        );
        for bad in [&foreign, &expired] {
            let e = code(req(Some(bad), MD), None).await;
            assert_eq!(e.code(), tonic::Code::Unauthenticated);
            assert!(!e.message().contains(bad.as_str()));
        }
        assert_eq!(
            code(req(Some(&good), &MD[..2]), None).await.code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            code(req(Some(&good), MD), Some("elsewhere")).await.code(),
            tonic::Code::PermissionDenied
        );
        let mut two = req(Some(&good), MD);
        two.metadata_mut()
            .append("authorization", "Bearer x".parse().unwrap());
        assert_eq!(code(two, None).await.code(), tonic::Code::InvalidArgument);
    }
}
