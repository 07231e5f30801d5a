//! The exporter feature against the local control plane, with `ucm manager` as a subprocess.
//! Tests act as an exporter would by patching Exporter status the way the gRPC service will.
//! Design: docs/exporter.md.
//!
//! The exporter feature's whole e2e area: the reconciler tests here and in `credentials`, `idle`,
//! `input`, `keys`, `leases` and `queue`; the gRPC service (`grpc`), exporter hooks (`hooks`)
//! and the real Jumpstarter peers (`jumpstarter`).

mod credentials;
mod grpc;
mod hooks;
mod idle;
mod input;
// `platform::node` runs a real `jmp` exporter with its helpers.
pub(crate) mod jumpstarter;
mod keys;
mod leases;
mod queue;

use std::time::{Duration, Instant};

use crate::common::*;
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use ucm::exporter::auth::token::{self, Claims, SigningKey};
use ucm::exporter::crd::{Exporter, ExporterStatusValue, Lease};
use ucm::exporter::decide::time::rfc3339;

const SEED: &str = "e2e-controller-key";
const DAY: i64 = 86_400;

type JClient = ucm::exporter::crd::Client;

/// Manager options with the exporter feature only and the test seed as CONTROLLER_KEY.
fn opts<'a>(env: &'a TestEnv, extra: &[&str]) -> ManagerOpts<'a> {
    ManagerOpts {
        env: vec![("CONTROLLER_KEY".into(), SEED.into())],
        ..ManagerOpts::new(&env.kubeconfig, &env.ns)
    }
    .only("exporter")
    .args(extra.iter().map(|s| s.to_string()))
}

fn manager(env: &TestEnv, extra: &[&str]) -> Manager {
    Manager::start(opts(env, extra))
}

/// Manager options without any key source (the generated key or a key Secret).
fn keyless<'a>(env: &'a TestEnv, extra: &[&str]) -> ManagerOpts<'a> {
    ManagerOpts::new(&env.kubeconfig, &env.ns)
        .only("exporter")
        .args(extra.iter().map(|s| s.to_string()))
}

/// Only the exporter and snapshot features, to show that an exporter setting does not stop
/// another feature.
fn with_snapshot_too<'a>(o: ManagerOpts<'a>) -> ManagerOpts<'a> {
    let flags: Vec<String> = ucm::FEATURES
        .iter()
        .map(|f| {
            format!(
                "--enable-{}={}",
                f.name,
                f.name == "exporter" || f.name == "snapshot"
            )
        })
        .collect();
    ManagerOpts {
        extra: o
            .extra
            .into_iter()
            .filter(|a| !a.starts_with("--enable-"))
            .chain(flags)
            .collect(),
        ..o
    }
}

async fn create(client: &Client, ns: &str, manifest: serde_json::Value) {
    let kind = manifest["kind"].as_str().unwrap().to_string();
    let name = manifest["metadata"]["name"].as_str().unwrap().to_string();
    let pp = PostParams::default();
    let res = match kind.as_str() {
        "Exporter" => Api::<Exporter>::namespaced(client.clone(), ns)
            .create(&pp, &serde_json::from_value(manifest).unwrap())
            .await
            .map(|_| ()),
        "Lease" => Api::<Lease>::namespaced(client.clone(), ns)
            .create(&pp, &serde_json::from_value(manifest).unwrap())
            .await
            .map(|_| ()),
        "Client" => Api::<JClient>::namespaced(client.clone(), ns)
            .create(&pp, &serde_json::from_value(manifest).unwrap())
            .await
            .map(|_| ()),
        "ExporterAccessPolicy" => {
            Api::<ucm::exporter::crd::ExporterAccessPolicy>::namespaced(client.clone(), ns)
                .create(&pp, &serde_json::from_value(manifest).unwrap())
                .await
                .map(|_| ())
        }
        "ConfigMap" => Api::<ConfigMap>::namespaced(client.clone(), ns)
            .create(&pp, &serde_json::from_value(manifest).unwrap())
            .await
            .map(|_| ()),
        "Secret" => Api::<Secret>::namespaced(client.clone(), ns)
            .create(&pp, &serde_json::from_value(manifest).unwrap())
            .await
            .map(|_| ()),
        other => panic!("unsupported kind {other}"),
    };
    res.unwrap_or_else(|e| panic!("create {kind} {name}: {e}"));
}

fn exporter_manifest(name: &str, labels: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Exporter",
           "metadata": {"name": name, "labels": labels}, "spec": {}})
}

fn client_manifest(name: &str, labels: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Client",
           "metadata": {"name": name, "labels": labels}, "spec": {}})
}

fn lease_manifest(name: &str, spec: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
           "metadata": {"name": name}, "spec": spec})
}

/// Reports the exporter alive until the manager has marked it `Online=True`. Reporting again
/// keeps `lastSeen` fresh, so a slow first pass under load cannot see it stale already.
async fn bring_online(exporters: &Api<Exporter>, name: &str) {
    let start = Instant::now();
    loop {
        report_available(exporters, name).await;
        let round = Instant::now();
        while round.elapsed() < Duration::from_secs(2) {
            let online = exporters
                .get(name)
                .await
                .ok()
                .and_then(|e| exporter_condition(&e, "Online"))
                .is_some_and(|c| c.0 == "True");
            if online {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "exporter {name} not Online within {TIMEOUT:?}"
        );
    }
}

fn lease_cond(l: &Lease, t: &str) -> Option<Condition> {
    find_condition(l.status.as_ref()?.conditions.as_ref(), t)
}

fn client_cond(c: &JClient, t: &str) -> Option<Condition> {
    find_condition(c.status.as_ref()?.conditions.as_ref(), t)
}

async fn token_of(secrets: &Api<Secret>, name: &str) -> Option<String> {
    let s = secrets.get_opt(name).await.ok().flatten()?;
    let bytes = s.data?.get("token")?.0.clone();
    String::from_utf8(bytes).ok()
}

/// The claims of the token in Secret `name`, if it verifies with `key`.
async fn valid_claims(secrets: &Api<Secret>, name: &str, key: &SigningKey) -> Option<Claims> {
    token::verify(key, &token_of(secrets, name).await?, Timestamp::now()).ok()
}

async fn put_token(secrets: &Api<Secret>, name: &str, jwt: &str) {
    secrets
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"token": jwt}})),
        )
        .await
        .unwrap();
}

/// A token for `sub` signed with `key`, expiring at `exp` after a 365-day life.
fn token_expiring_at(key: &SigningKey, sub: &str, exp: Timestamp) -> String {
    token::sign(
        key,
        &Claims {
            iss: token::ISSUER.into(),
            aud: vec![token::AUDIENCE.into()],
            sub: sub.into(),
            iat: exp.as_second() - 365 * DAY,
            exp: exp.as_second(),
            jti: None,
            holder: None,
        },
    )
}

/// (reason, note, type) of the events about object `name`, oldest first, one entry per
/// occurrence (repeated identical events are one Event object with a series count).
async fn events_of(client: &Client, ns: &str, name: &str) -> Vec<(String, String, String)> {
    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    let mut items: Vec<_> = api
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .collect();
    items.sort_by_key(|e| e.event_time.as_ref().map(|t| t.0));
    items
        .into_iter()
        .flat_map(|e| {
            let n = e.series.as_ref().map_or(1, |s| s.count.max(1)) as usize;
            let one = (
                e.reason.unwrap_or_default(),
                e.note.unwrap_or_default(),
                e.type_.unwrap_or_default(),
            );
            std::iter::repeat_n(one, n)
        })
        .collect()
}

async fn wait_reconciles(m: &Manager, controller: &str, above: f64) {
    eventually(
        TIMEOUT,
        &format!("a {controller} reconcile (more than {above})"),
        || async { reconciles(m, controller).await > above },
    )
    .await;
}

async fn readyz_503_with(m: &Manager, what: &str, needles: &[&str]) {
    let start = Instant::now();
    loop {
        let r = m.readyz().await;
        if let Some((503, body)) = &r
            && needles.iter().all(|n| body.contains(n))
        {
            return;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "timed out waiting for {what}; last /readyz: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn touch<K>(api: &Api<K>, name: &str) -> String
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"e2e.ucm.io/touched": unique("t")}}})),
    )
    .await
    .unwrap()
    .resource_version()
    .unwrap()
}

fn rv<K: kube::Resource>(obj: &K) -> String {
    obj.meta().resource_version.clone().unwrap()
}

/// Waits until the Exporter and Client tokens verify with `key`; returns them.
async fn tokens_signed_by(secrets: &Api<Secret>, key: &SigningKey, what: &str) -> (String, String) {
    eventually(TIMEOUT, what, || async {
        valid_claims(secrets, "e1-exporter", key).await.is_some()
            && valid_claims(secrets, "c1-client", key).await.is_some()
    })
    .await;
    (
        token_of(secrets, "e1-exporter").await.unwrap(),
        token_of(secrets, "c1-client").await.unwrap(),
    )
}

fn config_map(data: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "jumpstarter-controller"}, "data": data})
}
