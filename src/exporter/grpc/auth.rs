//! Caller authentication and authorization (docs/exporter.md, "Who may call"): exactly one
//! `authorization: Bearer <jwt>` verified by [`Authn`] (internal, external issuers, TokenReview),
//! the `jumpstarter-namespace/kind/name` metadata (an external identity may leave the name empty:
//! it is derived from the username, as upstream does), and the named object's accepted usernames;
//! with `provisioning.enabled`, a missing Client is created for an external identity.
//! Errors never carry token text, Secret names or Kubernetes errors.

use jiff::Timestamp;
use kube::{Api, Resource, ResourceExt};
use tonic::{Request, Status};

use crate::exporter::auth::token;
use crate::exporter::auth::{Authn, Identity};
use crate::exporter::context::Context;
use crate::exporter::crd::{Client, ClientSpec, Exporter};

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

/// The bearer token (docs/exporter.md, "Who may call"): missing → Unauthenticated, malformed →
/// InvalidArgument.
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

/// The metadata part: which object the caller claims to be. An empty or missing
/// `jumpstarter-name` is resolved by [`resolve_name`] once the token is known.
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
    let name = match req.metadata().get_all("jumpstarter-name").iter().count() {
        0 => String::new(),
        1 => req
            .metadata()
            .get("jumpstarter-name")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| Status::invalid_argument("malformed metadata: jumpstarter-name"))?
            .to_string(),
        _ => return Err(one_md(req, "jumpstarter-name").unwrap_err()),
    };
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

/// The object name an external identity stands for, as upstream derives it
/// (docs/exporter.md, "Object names from external identities"): the username without its
/// provider prefix (up to the first `:`), lower-cased, every run of characters outside
/// `[a-z0-9]` made one `-`, trimmed of `-` and cut to 63 characters.
/// `None` for identities that must name their object: internal tokens and ServiceAccounts.
pub fn name_from_identity(identity: &Identity) -> Option<String> {
    const SERVICE_ACCOUNT: &str = "system:serviceaccount:";
    if identity.internal || identity.username.contains(SERVICE_ACCOUNT) {
        return None;
    }
    let bare = identity
        .username
        .split_once(':')
        .map_or(identity.username.as_str(), |(_, rest)| rest);
    let mut name = String::with_capacity(bare.len());
    for c in bare.chars().flat_map(char::to_lowercase) {
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            name.push(c);
        } else if !name.is_empty() && !name.ends_with('-') {
            name.push('-');
        }
    }
    name.truncate(63);
    Some(name.trim_end_matches('-').to_string())
}

/// Fills in or checks the caller's name against its identity, as upstream v0.9.0 does: an
/// external identity may leave the name empty (it is derived) but not name another object;
/// internal and ServiceAccount identities must name theirs.
pub fn resolve_name(caller: &mut Caller, identity: &Identity) -> Result<(), Status> {
    match name_from_identity(identity) {
        None if caller.name.is_empty() => Err(Status::invalid_argument(
            "resource name required: jumpstarter-name is empty",
        )),
        None => Ok(()),
        Some(derived) if derived.is_empty() => Err(Status::invalid_argument(
            "resource name required: the username gives no object name",
        )),
        Some(derived) if caller.name.is_empty() => {
            caller.name = derived;
            Ok(())
        }
        Some(derived) if derived == caller.name => Ok(()),
        Some(derived) => Err(Status::invalid_argument(format!(
            "resource name mismatch: provided {:?}, expected {derived:?} for this identity",
            caller.name
        ))),
    }
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
    let mut caller = caller(req, watched)?;
    resolve_name(&mut caller, &identity)?;
    Ok((caller, identity))
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

/// Full check (docs/exporter.md, "Who may call"): `allowed` lists the kinds the RPC accepts.
/// A refusal is logged at info with the caller's address, as upstream logs it
/// (`client authentication failed` / `exporter authentication failed`), never with the token.
pub async fn authorize<T>(
    ctx: &Context,
    authn: &Authn,
    watched: Option<&str>,
    req: &Request<T>,
    allowed: &[Kind],
) -> Result<Caller, Status> {
    let result = check(ctx, authn, watched, req, allowed).await;
    if let Err(e) = &result {
        let who = match req.metadata().get("jumpstarter-kind").map(|v| v.as_bytes()) {
            Some(b"Client") => "client",
            Some(b"Exporter") => "exporter",
            _ => "caller",
        };
        let peer = req
            .remote_addr()
            .map_or_else(|| "unknown".to_string(), |a| a.to_string());
        tracing::info!(%peer, code = ?e.code(), reason = e.message(),
            "{who} authentication failed");
    }
    result
}

async fn check<T>(
    ctx: &Context,
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
    ctx: &Context,
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
    match ctx.calls.create(api, &client).await {
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

    fn who(username: &str, internal: bool) -> Identity {
        Identity {
            username: username.into(),
            holder: None,
            internal,
        }
    }

    #[test]
    fn external_usernames_name_objects_as_upstream() {
        let derived = |u: &str| name_from_identity(&who(u, false));
        // Upstream's own vectors for this derivation.
        for (username, name) in [
            ("dex:test-exporter-hooks", "test-exporter-hooks"),
            (
                "dex:test-client-oidc-provisioning",
                "test-client-oidc-provisioning",
            ),
            ("dex:foo@example.com", "foo-example-com"),
            ("foo", "foo"),
            ("foo@example.com", "foo-example-com"),
            ("kc:Alice.Smith", "alice-smith"),
            ("kc:@@a@@", "a"),
        ] {
            assert_eq!(derived(username).as_deref(), Some(name), "{username}");
        }
        assert_eq!(derived(&"a".repeat(70)).unwrap(), "a".repeat(63));
        assert_eq!(
            derived(&format!("x:{}-b", "a".repeat(62))).unwrap(),
            "a".repeat(62)
        );
        // ServiceAccounts (through dex or a TokenReview) and internal tokens must name the object.
        assert_eq!(
            derived("dex:system:serviceaccount:lab:test-exporter-sa"),
            None
        );
        assert_eq!(derived("system:serviceaccount:lab:ci"), None);
        assert_eq!(
            name_from_identity(&who("internal:client:lab:c:u", true)),
            None
        );
    }

    #[test]
    fn an_empty_name_is_derived_a_different_one_refused() {
        let caller = |name: &str| Caller {
            namespace: "lab".into(),
            name: name.into(),
            kind: Kind::Client,
        };
        let dex = who("dex:test-client-oidc-provisioning", false);
        let mut c = caller("");
        resolve_name(&mut c, &dex).unwrap();
        assert_eq!(c.name, "test-client-oidc-provisioning");
        let mut same = caller("test-client-oidc-provisioning");
        resolve_name(&mut same, &dex).unwrap();
        let e = resolve_name(&mut caller("alice-dev"), &dex).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message().contains("resource name mismatch"),
            "{}",
            e.message()
        );
        assert!(
            e.message().contains("alice-dev")
                && e.message().contains("test-client-oidc-provisioning")
        );
        for must_name in [
            who("internal:client:lab:c:u", true),
            who("system:serviceaccount:lab:ci", false),
        ] {
            let e = resolve_name(&mut caller(""), &must_name).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains("resource name required"));
            let mut any = caller("any-name-works");
            resolve_name(&mut any, &must_name).unwrap();
            assert_eq!(any.name, "any-name-works");
        }
    }
}
