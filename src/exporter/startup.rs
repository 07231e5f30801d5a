//! Start-up inputs that live in the manager's namespace (the `jumpstarter-controller` ConfigMap,
//! the signing key Secrets): while one is missing or invalid the feature reports not ready with the
//! reason (docs/exporter.md, "Settings and RBAC") and waits for that object to change, then starts
//! by itself. Event-driven: a watch on the one object plus leadership changes, no polling.

use std::fmt::Debug;
use std::future::Future;

use futures::StreamExt;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tracing::{info, warn};

use crate::exporter::auth::signing::{
    GENERATED_KEY_SECRET, KEY_PEM, KeySource, generated_secret, key_from_secret,
};
use crate::exporter::auth::token::SigningKey;
use crate::exporter::config::{self, CONFIGMAP};
use crate::runtime::Runtime;

/// One evaluation of a start-up input.
pub enum Step<T> {
    Done(T),
    /// Not usable yet; the message is the feature's readiness failure.
    Wait(String),
}

/// Runs `step` until it is `Done`, re-running it whenever the named object in the manager's
/// namespace changes or leadership changes. `None` means shutdown came first.
pub async fn settle<K, T, F, Fut>(rt: &Runtime, name: &str, mut step: F) -> Option<T>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + 'static,
    F: FnMut() -> Fut,
    Fut: Future<Output = Step<T>>,
{
    let check = crate::exporter::FEATURE.check_name();
    let api: Api<K> = rt.own_namespace();
    let mut changes = watcher(
        api,
        watcher::Config::default().fields(&format!("metadata.name={name}")),
    )
    .default_backoff()
    .boxed();
    let mut leading = rt.leadership.subscribe();
    let (mut leading_open, mut watching) = (true, true);
    let mut last: Option<String> = None;
    loop {
        match step().await {
            Step::Done(v) => {
                if last.is_some() {
                    info!(object = name, "start-up input is usable now");
                    rt.health.set(
                        &check,
                        Err("starting: waiting for the feature's watches to list".into()),
                    );
                }
                return Some(v);
            }
            Step::Wait(msg) => {
                if last.as_ref() != Some(&msg) {
                    warn!(feature = "exporter", "not ready: {msg}");
                    rt.health.set(&check, Err(msg.clone()));
                    last = Some(msg);
                }
            }
        }
        tokio::select! {
            _ = rt.shutdown.cancelled() => return None,
            e = changes.next(), if watching => watching = e.is_some(),
            r = leading.changed(), if leading_open => leading_open = r.is_ok(),
        }
    }
}

/// Reads and validates the ConfigMap; waits while it exists but does not parse.
pub async fn load_config(rt: &Runtime) -> Option<config::Loaded> {
    let api: Api<ConfigMap> = rt.own_namespace();
    let ns = rt.config.manager_namespace.clone();
    settle::<ConfigMap, _, _, _>(rt, CONFIGMAP, || {
        let api = api.clone();
        let ns = ns.clone();
        async move {
            match api.get_opt(CONFIGMAP).await {
                Err(e) => Step::Wait(format!("cannot read ConfigMap {CONFIGMAP}: {e}")),
                Ok(cm) => {
                    let data = cm.map(|c| c.data.unwrap_or_default());
                    match config::parse(data.as_ref(), &ns) {
                        Ok(loaded) => Step::Done(loaded),
                        Err(msg) => Step::Wait(msg),
                    }
                }
            }
        }
    })
    .await
}

/// Resolves the signing key (docs/exporter.md, "The signing key"): every replica and every
/// restart resolve the same key; only the leader creates the generated Secret, and nobody
/// overwrites it. An invalid seed is an error (the feature reports it and stays off); key
/// Secrets are awaited until usable. `None` means shutdown came first.
pub async fn load_key(rt: &Runtime, source: &KeySource) -> Result<Option<SigningKey>, String> {
    let secrets: Api<Secret> = rt.own_namespace();
    let ns = rt.config.manager_namespace.clone();
    match source {
        KeySource::Seed(seed) => SigningKey::from_seed(seed)
            .map(Some)
            .map_err(|e| e.to_string()),
        KeySource::Secret(name) => Ok(settle::<Secret, _, _, _>(rt, name, || {
            let secrets = secrets.clone();
            let ns = ns.clone();
            let name = name.clone();
            async move {
                match secrets.get_opt(&name).await {
                    Err(e) => Step::Wait(format!("cannot read the signing key Secret {name}: {e}")),
                    Ok(None) => Step::Wait(format!(
                        "signing key Secret {name} (--exporter-signing-key-secret) not found in namespace {ns}; create it with a PKCS#8 P-256 private key under {KEY_PEM}"
                    )),
                    Ok(Some(s)) => match key_from_secret(&s, &name) {
                        Ok(key) => Step::Done(key),
                        Err(msg) => Step::Wait(msg),
                    },
                }
            }
        })
        .await),
        KeySource::Generated => {
            let writer = rt.writer("exporter");
            let leadership = rt.leadership.clone();
            Ok(settle::<Secret, _, _, _>(rt, GENERATED_KEY_SECRET, || {
                let secrets = secrets.clone();
                let ns = ns.clone();
                let writer = writer.clone();
                let leader = leadership.is_leader();
                async move {
                    match secrets.get_opt(GENERATED_KEY_SECRET).await {
                        Err(e) => Step::Wait(format!(
                            "cannot read Secret {GENERATED_KEY_SECRET}: {e}"
                        )),
                        // Never overwritten: a broken one is for the operator to delete.
                        Ok(Some(s)) => match key_from_secret(&s, GENERATED_KEY_SECRET) {
                            Ok(key) => Step::Done(key),
                            Err(msg) => Step::Wait(format!(
                                "{msg}; delete Secret {GENERATED_KEY_SECRET} to generate a new key (every token is then re-minted)"
                            )),
                        },
                        Ok(None) if !leader => Step::Wait(format!(
                            "waiting for the leader to generate Secret {GENERATED_KEY_SECRET}"
                        )),
                        Ok(None) => {
                            let key = SigningKey::generate();
                            match writer.create(&secrets, &generated_secret(&key, &ns)).await {
                                Ok(_) => {
                                    info!(
                                        secret = GENERATED_KEY_SECRET,
                                        "generated the exporter signing key"
                                    );
                                    Step::Done(key)
                                }
                                // Created meanwhile (a previous leader): its watch event
                                // brings the next evaluation, which reads that key.
                                Err(e) if e.is_conflict() => Step::Wait(format!(
                                    "Secret {GENERATED_KEY_SECRET} appeared meanwhile; reading it"
                                )),
                                Err(e) => Step::Wait(format!(
                                    "cannot create Secret {GENERATED_KEY_SECRET}: {e}"
                                )),
                            }
                        }
                    }
                }
            })
            .await)
        }
    }
}
