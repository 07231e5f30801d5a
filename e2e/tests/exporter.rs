//! The exporter feature against the local control plane, with `ucm manager` as a subprocess.
//! Tests act as an exporter would by patching Exporter status the way the gRPC service will.

mod common;

use std::time::Duration;

use common::*;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use ucm::exporter::token::{self, SigningKey};
use ucm::exporter::types::{Exporter, Lease};

const SEED: &str = "e2e-controller-key";

fn manager(env: &TestEnv, extra: &[&str]) -> Manager {
    Manager::start(
        ManagerOpts {
            env: vec![("CONTROLLER_KEY".into(), SEED.into())],
            ..ManagerOpts::new(&env.kubeconfig, &env.ns)
        }
        .only("exporter")
        .args(extra.iter().map(|s| s.to_string())),
    )
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
        "Client" => Api::<ucm::exporter::types::Client>::namespaced(client.clone(), ns)
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

/// What the gRPC service writes on Register + ReportStatus(AVAILABLE).
async fn report_available(exporters: &Api<Exporter>, name: &str) {
    let now = jiff::fmt::strtime::format("%Y-%m-%dT%H:%M:%SZ", Timestamp::now()).unwrap();
    let patch = json!({"status": {"lastSeen": now, "devices": [], "exporterStatus": "Available",
                                  "statusMessage": "Available"}});
    exporters
        .patch_status(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
}

fn condition(e: &Exporter, t: &str) -> Option<(String, String, String)> {
    let c = e
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == t)?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn schema_rejects_bad_values() {
    let env = TestEnv::new("exp-schema").await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    create(&env.client, &env.ns, exporter_manifest("e1", json!({}))).await;
    for bad in [
        json!({"status": {"exporterStatus": "Dancing"}}),
        json!({"status": {"leaseHooks": {"afterLease": {"phase": "Maybe", "attempts": 1}}}}),
        json!({"status": {"leaseHooks": {"beforeLease": {"phase": "Running", "onFailure": "panic"}}}}),
    ] {
        let err = exporters
            .patch_status("e1", &PatchParams::default(), &Patch::Merge(bad.clone()))
            .await
            .expect_err(&format!("{bad} must be rejected"));
        assert!(err.to_string().contains("Unsupported value"), "{err}");
    }
    // A Lease with neither selector nor exporterRef.
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let lease: Lease = serde_json::from_value(
        json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
        "metadata": {"name": "l0"}, "spec": {"clientRef": {"name": "c"}, "duration": "1h"}}),
    )
    .unwrap();
    let err = leases
        .create(&PostParams::default(), &lease)
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("one of selector or exporterRef.name is required"),
        "{err}"
    );
    // Oversized tags, and a tags edit.
    let tags: serde_json::Map<_, _> = (0..11).map(|i| (format!("k{i}"), json!("v"))).collect();
    let lease: Lease = serde_json::from_value(
        json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
        "metadata": {"name": "l1"}, "spec": {"clientRef": {"name": "c"}, "duration": "1h",
        "selector": {"matchLabels": {"a": "b"}}, "tags": tags}}),
    )
    .unwrap();
    assert!(leases.create(&PostParams::default(), &lease).await.is_err());
    create(
        &env.client,
        &env.ns,
        json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
        "metadata": {"name": "l2"}, "spec": {"clientRef": {"name": "c"}, "duration": "1h",
        "selector": {"matchLabels": {"a": "b"}}, "tags": {"a": "1"}}}),
    )
    .await;
    let err = leases
        .patch(
            "l2",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"tags": {"a": "2"}}})),
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("tags are immutable after creation"),
        "{err}"
    );
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn exporter_credential_status_and_liveness() {
    let env = TestEnv::new("exp-cred").await;
    let m = manager(
        &env,
        &[
            "--exporter-grpc-endpoint=grpc.e2e:443",
            "--exporter-offline-threshold=4s",
        ],
    );
    m.wait_ready().await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    create(
        &env.client,
        &env.ns,
        exporter_manifest("e1", json!({"board": "rpi"})),
    )
    .await;

    // A3/A5/A9/A10: Secret with a valid token, owned by the Exporter; status fields.
    eventually(TIMEOUT, "the Exporter status", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| e.status)
            .is_some_and(|s| s.token_expires_at.is_some())
    })
    .await;
    let e = exporters.get("e1").await.unwrap();
    let secret = secrets.get("e1-exporter").await.unwrap();
    let owner = &secret.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller),
        ("Exporter", "e1", Some(true))
    );
    let jwt = String::from_utf8(secret.data.unwrap()["token"].0.clone()).unwrap();
    let key = SigningKey::from_seed(SEED).unwrap();
    let claims = token::verify(&key, &jwt, Timestamp::now())
        .expect("the token verifies with the seed's key");
    assert_eq!(
        claims.sub,
        format!("exporter:{}:e1:{}", env.ns, e.uid().unwrap())
    );
    assert_eq!(claims.exp - claims.iat, 365 * 86_400);
    let status = e.status.clone().unwrap();
    assert_eq!(status.credential.unwrap().name, "e1-exporter");
    assert_eq!(status.endpoint.as_deref(), Some("grpc.e2e:443"));
    assert_eq!(status.token_expires_at.unwrap().0.as_second(), claims.exp);
    assert_eq!(
        condition(&e, "Online").unwrap(),
        ("False".into(), "Seen".into(), "Never seen".into())
    );
    assert_eq!(status.status_message.as_deref(), Some("Never seen"));
    assert_eq!(condition(&e, "Registered").unwrap().1, "Unregister");
    assert_eq!(condition(&e, "TokenExpiring").unwrap().1, "Valid");

    // A17: a quiet exporter is not rewritten.
    let rv = e.resource_version();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        exporters.get("e1").await.unwrap().resource_version(),
        rv,
        "no write on an unchanged Exporter"
    );

    // A12/A13: reported alive → Online, Registered.
    report_available(&exporters, "e1").await;
    eventually(TIMEOUT, "Online=True", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| condition(&e, "Online"))
            .is_some_and(|c| c.0 == "True")
    })
    .await;
    let e = exporters.get("e1").await.unwrap();
    assert_eq!(
        condition(&e, "Online").unwrap().2,
        "Last seen less than 4 seconds ago"
    );
    assert_eq!(condition(&e, "Registered").unwrap().0, "True");

    // A11/A19: silence → Offline right after lastSeen + T, by the exact requeue.
    eventually(
        Duration::from_secs(15),
        "Offline after the threshold",
        || async {
            exporters.get("e1").await.ok().is_some_and(|e| {
                e.status.as_ref().and_then(|s| s.exporter_status)
                    == Some(ucm::exporter::types::ExporterStatusValue::Offline)
            })
        },
    )
    .await;
    let e = exporters.get("e1").await.unwrap();
    let s = e.status.clone().unwrap();
    let stale_at = s.last_seen.unwrap().0 + jiff::SignedDuration::from_secs(4);
    assert_eq!(
        s.status_message.as_deref(),
        Some("Connection lost - last seen more than 4 seconds ago")
    );
    assert_eq!(
        condition(&e, "Online").unwrap().2,
        "Last seen more than 4 seconds ago"
    );
    let offline_at = e
        .status
        .as_ref()
        .unwrap()
        .conditions
        .as_ref()
        .unwrap()
        .iter()
        .find(|c| c.type_ == "Online")
        .unwrap()
        .last_transition_time
        .0;
    assert!(
        offline_at.duration_since(stale_at) <= jiff::SignedDuration::from_secs(2),
        "Offline at {offline_at}, stale at {stale_at}"
    );

    // A15: events for the persisted transitions, from the reconciler.
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(env.client.clone(), &env.ns);
    let reasons = || async {
        events
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("e1"))
            .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
            .collect::<Vec<_>>()
    };
    eventually(TIMEOUT, "the exporter events", || async {
        let r = reasons().await;
        [
            "CredentialCreated",
            "ExporterRegistered",
            "ExporterOnline",
            "ExporterOffline",
        ]
        .iter()
        .all(|want| r.iter().any(|(reason, _)| reason == want))
    })
    .await;
    let r = reasons().await;
    assert!(
        r.contains(&(
            "CredentialCreated".into(),
            "Credential secret created for exporter: secret=e1-exporter".into()
        )),
        "{r:?}"
    );
    assert!(
        r.contains(&(
            "ExporterRegistered".into(),
            "Exporter registered its capabilities: deviceCount=0".into()
        )),
        "{r:?}"
    );
    assert!(
        r.iter().any(|(reason, note)| reason == "ExporterOffline"
            && note.starts_with("Exporter went offline (connection lost): exporter=e1")),
        "{r:?}"
    );

    // A4: a token signed by another key is replaced.
    let (foreign, _) = token::mint(
        &SigningKey::from_seed("other").unwrap(),
        &claims.sub,
        Timestamp::now(),
        jiff::SignedDuration::from_hours(1),
    );
    secrets
        .patch(
            "e1-exporter",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"token": foreign}})),
        )
        .await
        .unwrap();
    eventually(TIMEOUT, "the foreign token to be re-minted", || async {
        secrets
            .get("e1-exporter")
            .await
            .ok()
            .and_then(|s| s.data)
            .is_some_and(|d| {
                let t = String::from_utf8(d["token"].0.clone()).unwrap();
                token::verify(&key, &t, Timestamp::now()).is_ok()
            })
    })
    .await;

    // Deleting the Exporter garbage-collects its Secret.
    exporters
        .delete("e1", &DeleteParams::default())
        .await
        .unwrap();
    eventually(TIMEOUT, "the Secret to be garbage-collected", || async {
        secrets
            .get_opt("e1-exporter")
            .await
            .ok()
            .flatten()
            .is_none()
    })
    .await;
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn lease_is_assigned_released_and_labelled() {
    let env = TestEnv::new("exp-lease").await;
    let m = manager(&env, &["--exporter-offline-threshold=1h"]);
    m.wait_ready().await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    create(
        &env.client,
        &env.ns,
        exporter_manifest("e1", json!({"board": "rpi"})),
    )
    .await;
    create(
        &env.client,
        &env.ns,
        json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Client",
        "metadata": {"name": "c1"}, "spec": {}}),
    )
    .await;
    // Pending/Offline before the exporter reports in.
    create(
        &env.client,
        &env.ns,
        json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
        "metadata": {"name": "l1"}, "spec": {"clientRef": {"name": "c1"}, "duration": "1h",
        "selector": {"matchLabels": {"board": "rpi"}}}}),
    )
    .await;
    let lease_cond = |l: &Lease, t: &str| {
        l.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == t).cloned())
    };
    eventually(TIMEOUT, "Pending/Offline", || async {
        leases
            .get("l1")
            .await
            .ok()
            .and_then(|l| lease_cond(&l, "Pending"))
            .is_some_and(|c| c.reason == "Offline")
    })
    .await;

    // The exporter comes online: the pending lease is retried and acquired.
    report_available(&exporters, "e1").await;
    eventually(TIMEOUT, "the lease to be acquired", || async {
        leases
            .get("l1")
            .await
            .ok()
            .and_then(|l| l.status)
            .and_then(|s| s.exporter_ref)
            .is_some_and(|r| r.name == "e1")
    })
    .await;
    eventually(TIMEOUT, "the controller ownerRef and leaseRef", || async {
        let l = leases.get("l1").await.unwrap();
        let e = exporters.get("e1").await.unwrap();
        l.owner_references()
            .iter()
            .any(|r| r.name == "e1" && r.controller == Some(true))
            && e.status
                .and_then(|s| s.lease_ref)
                .is_some_and(|r| r.name == "l1")
    })
    .await;
    let l = leases.get("l1").await.unwrap();
    let ready = lease_cond(&l, "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "Ready")
    );
    let metrics = m.metrics().await;
    assert!(
        metrics.contains("ucm_exporter_exporters{status=\"Available\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ucm_exporter_exporters_online{online=\"true\"} 1"),
        "{metrics}"
    );

    // A second lease for the same exporter waits: NotAvailable.
    create(
        &env.client,
        &env.ns,
        json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
        "metadata": {"name": "l2"}, "spec": {"clientRef": {"name": "c1"}, "duration": "1h",
        "exporterRef": {"name": "e1"}}}),
    )
    .await;
    eventually(TIMEOUT, "Pending/NotAvailable", || async {
        leases
            .get("l2")
            .await
            .ok()
            .and_then(|l| lease_cond(&l, "Pending"))
            .is_some_and(|c| c.reason == "NotAvailable")
    })
    .await;

    // A17: the running lease is not rewritten.
    let rv = leases.get("l1").await.unwrap().resource_version();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(leases.get("l1").await.unwrap().resource_version(), rv);

    // Release: ended, Ready=False/Released, label, leaseRef cleared; l2 then gets the exporter.
    leases
        .patch(
            "l1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"release": true}})),
        )
        .await
        .unwrap();
    eventually(TIMEOUT, "the release", || async {
        let l = leases.get("l1").await.unwrap();
        l.status.as_ref().is_some_and(|s| s.ended)
            && l.labels()
                .get("jumpstarter.dev/lease-ended")
                .map(String::as_str)
                == Some("true")
    })
    .await;
    let l = leases.get("l1").await.unwrap();
    assert_eq!(lease_cond(&l, "Ready").unwrap().reason, "Released");
    eventually(TIMEOUT, "l2 to get the exporter", || async {
        leases
            .get("l2")
            .await
            .ok()
            .and_then(|l| l.status)
            .and_then(|s| s.exporter_ref)
            .is_some_and(|r| r.name == "e1")
    })
    .await;
    eventually(TIMEOUT, "leaseRef to follow", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| e.status)
            .and_then(|s| s.lease_ref)
            .is_some_and(|r| r.name == "l2")
    })
    .await;

    // An unsatisfiable lease ends with the upstream condition and counts as a failure.
    create(
        &env.client,
        &env.ns,
        json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
        "metadata": {"name": "l3"}, "spec": {"clientRef": {"name": "c1"}, "duration": "1h",
        "exporterRef": {"name": "missing"}}}),
    )
    .await;
    eventually(TIMEOUT, "ExporterNotFound", || async {
        leases.get("l3").await.ok().is_some_and(|l| {
            l.status.as_ref().is_some_and(|s| s.ended)
                && lease_cond(&l, "Unsatisfiable").is_some_and(|c| {
                    c.reason == "ExporterNotFound"
                        && c.message == "Requested exporter missing was not found"
                })
        })
    })
    .await;
    let metrics = m.metrics().await;
    assert!(
        metrics.contains("jumpstarter_lease_acquisitions_total{result=\"success\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("jumpstarter_lease_acquisitions_total{result=\"failure\"} 1"),
        "{metrics}"
    );

    // Deleting the exporter garbage-collects its leases, ended or not.
    exporters
        .delete("e1", &DeleteParams::default())
        .await
        .unwrap();
    eventually(TIMEOUT, "leases to be garbage-collected", || async {
        leases.get_opt("l1").await.ok().flatten().is_none()
            && leases.get_opt("l2").await.ok().flatten().is_none()
    })
    .await;
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn client_gets_a_credential() {
    let env = TestEnv::new("exp-client").await;
    let m = manager(&env, &[]);
    m.wait_ready().await;
    create(
        &env.client,
        &env.ns,
        json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Client",
        "metadata": {"name": "c1"}, "spec": {}}),
    )
    .await;
    let clients: Api<ucm::exporter::types::Client> = Api::namespaced(env.client.clone(), &env.ns);
    eventually(TIMEOUT, "the Client status", || async {
        clients
            .get("c1")
            .await
            .ok()
            .and_then(|c| c.status)
            .is_some_and(|s| s.token_expires_at.is_some())
    })
    .await;
    let c = clients.get("c1").await.unwrap();
    let secret = Api::<Secret>::namespaced(env.client.clone(), &env.ns)
        .get("c1-client")
        .await
        .unwrap();
    let jwt = String::from_utf8(secret.data.unwrap()["token"].0.clone()).unwrap();
    let claims = token::verify(
        &SigningKey::from_seed(SEED).unwrap(),
        &jwt,
        Timestamp::now(),
    )
    .unwrap();
    assert_eq!(
        claims.sub,
        format!("client:{}:c1:{}", env.ns, c.uid().unwrap())
    );
    let s = c.status.unwrap();
    assert_eq!(s.credential.unwrap().name, "c1-client");
    assert_eq!(s.endpoint.as_deref(), Some("localhost:8082"));
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn lease_hooks_record_and_gate() {
    let env = TestEnv::new("exp-hooks").await;
    let m = manager(&env, &["--exporter-offline-threshold=1h"]);
    m.wait_ready().await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    create(
        &env.client,
        &env.ns,
        exporter_manifest("e1", json!({"board": "rpi"})),
    )
    .await;
    report_available(&exporters, "e1").await;
    // What a declaring Register writes.
    exporters
        .patch_status(
            "e1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"recordsLeaseHooks": true}})),
        )
        .await
        .unwrap();
    let lease = |name: &str| {
        json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease", "metadata": {"name": name},
               "spec": {"clientRef": {"name": "c1"}, "duration": "1h", "selector": {"matchLabels": {"board": "rpi"}}}})
    };
    create(&env.client, &env.ns, lease("l1")).await;
    eventually(TIMEOUT, "the record for l1", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| e.status)
            .and_then(|s| s.lease_hooks)
            .is_some_and(|r| {
                r.lease_ref.is_some_and(|l| l.name == "l1")
                    && r.client_name.as_deref() == Some("c1")
            })
    })
    .await;
    let l1_uid = leases.get("l1").await.unwrap().uid();
    let record = exporters
        .get("e1")
        .await
        .unwrap()
        .status
        .unwrap()
        .lease_hooks
        .unwrap();
    assert_eq!(record.lease_uid, l1_uid);
    assert!(record.before_lease.is_none() && record.after_lease.is_none());

    // The exporter starts afterLease (as ReportStatus records it), the lease ends, and the
    // exporter claims to be Available: the next lease must wait for the hook.
    exporters
        .patch_status(
            "e1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"leaseHooks": {"afterLease": {"phase": "Running", "attempts": 1}}}})),
        )
        .await
        .unwrap();
    leases
        .patch(
            "l1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"release": true}})),
        )
        .await
        .unwrap();
    eventually(TIMEOUT, "leaseRef cleared, record kept", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| e.status)
            .is_some_and(|s| {
                s.lease_ref.is_none()
                    && s.lease_hooks
                        .is_some_and(|r| r.lease_ref.is_some_and(|l| l.name == "l1"))
            })
    })
    .await;
    create(&env.client, &env.ns, lease("l2")).await;
    eventually(TIMEOUT, "Pending/NotReady naming the owed hook", || async {
        leases
            .get("l2")
            .await
            .ok()
            .and_then(|l| l.status)
            .and_then(|s| s.conditions)
            .is_some_and(|cs| {
                cs.iter().any(|c| {
                    c.type_ == "Pending"
                        && c.reason == "NotReady"
                        && c.message
                            .ends_with("; afterLease hook owed for lease l1 by exporter e1")
                })
            })
    })
    .await;
    // The hook finishes: l2 is assigned right away and gets a fresh record.
    exporters
        .patch_status(
            "e1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"leaseHooks": {"afterLease": {"phase": "Succeeded", "attempts": 1}}}})),
        )
        .await
        .unwrap();
    eventually(TIMEOUT, "l2 to be acquired", || async {
        leases
            .get("l2")
            .await
            .ok()
            .and_then(|l| l.status)
            .and_then(|s| s.exporter_ref)
            .is_some_and(|r| r.name == "e1")
    })
    .await;
    let l2_uid = leases.get("l2").await.unwrap().uid();
    eventually(TIMEOUT, "the record to follow l2", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| e.status)
            .and_then(|s| s.lease_hooks)
            .is_some_and(|r| r.lease_uid == l2_uid && r.after_lease.is_none())
    })
    .await;
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn generated_key_is_shared_and_a_new_seed_remints() {
    let env = TestEnv::new("exp-key").await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let token_of = |s: Secret| String::from_utf8(s.data.unwrap()["token"].0.clone()).unwrap();

    // Neither CONTROLLER_KEY nor a key Secret: the leader generates ucm-exporter-signing-key.
    let plain = |lease: &str| {
        Manager::start(
            ManagerOpts::new(&env.kubeconfig, &env.ns)
                .only("exporter")
                .args([
                    "--leader-elect".to_string(),
                    format!("--leader-election-id={lease}"),
                ]),
        )
    };
    let id = unique("ucm-key");
    let mut a = plain(&id);
    a.wait_ready().await;
    create(&env.client, &env.ns, exporter_manifest("e1", json!({}))).await;
    eventually(TIMEOUT, "the generated key and a token", || async {
        secrets
            .get_opt("ucm-exporter-signing-key")
            .await
            .ok()
            .flatten()
            .is_some()
            && secrets
                .get_opt("e1-exporter")
                .await
                .ok()
                .flatten()
                .is_some()
    })
    .await;
    let pem_secret = secrets.get("ucm-exporter-signing-key").await.unwrap();
    let pem = String::from_utf8(pem_secret.data.clone().unwrap()["key.pem"].0.clone()).unwrap();
    let generated = SigningKey::from_pkcs8_pem(&pem).unwrap();
    let first = token_of(secrets.get("e1-exporter").await.unwrap());
    token::verify(&generated, &first, Timestamp::now()).expect("signed with the generated key");

    // A second process (after a hand-over) uses the same key: the token is kept.
    a.signal("TERM");
    a.wait_exit(Duration::from_secs(30));
    let b = plain(&id);
    b.wait_ready().await;
    // Poke the exporter so the new leader reconciles it.
    exporters
        .patch(
            "e1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"poke": "1"}}})),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        secrets
            .get("ucm-exporter-signing-key")
            .await
            .unwrap()
            .resource_version(),
        pem_secret.resource_version()
    );
    assert_eq!(
        token_of(secrets.get("e1-exporter").await.unwrap()),
        first,
        "same key, token kept"
    );
    drop(b);

    // A seed replaces the key: the token is re-minted in the first pass.
    let c = manager(&env, &[]);
    c.wait_ready().await;
    let seed_key = SigningKey::from_seed(SEED).unwrap();
    eventually(
        TIMEOUT,
        "the token re-minted with the seed's key",
        || async {
            secrets
                .get("e1-exporter")
                .await
                .ok()
                .is_some_and(|s| token::verify(&seed_key, &token_of(s), Timestamp::now()).is_ok())
        },
    )
    .await;
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn bad_leases_end_with_a_condition_and_others_keep_going() {
    let env = TestEnv::new("exp-bad").await;
    let m = manager(&env, &["--exporter-offline-threshold=1h"]);
    m.wait_ready().await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    create(
        &env.client,
        &env.ns,
        exporter_manifest("e1", json!({"board": "rpi"})),
    )
    .await;
    report_available(&exporters, "e1").await;
    let mk = |name: &str, spec: serde_json::Value| json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease", "metadata": {"name": name}, "spec": spec});
    create(
        &env.client,
        &env.ns,
        mk(
            "bad-duration",
            json!({"clientRef": {"name": "c"}, "duration": "forever",
        "selector": {"matchLabels": {"board": "rpi"}}}),
        ),
    )
    .await;
    create(
        &env.client,
        &env.ns,
        mk(
            "bad-selector",
            json!({"clientRef": {"name": "c"}, "duration": "1h",
        "selector": {"matchExpressions": [{"key": "board", "operator": "Bogus"}]}}),
        ),
    )
    .await;
    create(
        &env.client,
        &env.ns,
        mk(
            "disabled-pin",
            json!({"clientRef": {"name": "c"}, "duration": "1h",
        "exporterRef": {"name": "e1"}, "selector": {"matchLabels": {"board": "qemu"}}}),
        ),
    )
    .await;
    // A scheduled lease: waits for beginTime, then runs until spec.endTime.
    // Whole seconds: metav1.Time stores no fraction.
    let begin = Timestamp::from_second(Timestamp::now().as_second() + 4).unwrap();
    let fmt = |t: Timestamp| jiff::fmt::strtime::format("%Y-%m-%dT%H:%M:%SZ", t).unwrap();
    create(
        &env.client,
        &env.ns,
        mk(
            "scheduled",
            json!({"clientRef": {"name": "c"},
        "beginTime": fmt(begin), "endTime": fmt(begin + jiff::SignedDuration::from_secs(4)),
        "selector": {"matchLabels": {"board": "rpi"}}}),
        ),
    )
    .await;

    let cond = |l: &Lease, t: &str| {
        l.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == t).cloned())
    };
    for (name, type_, reason) in [
        ("bad-duration", "Invalid", "InvalidDuration"),
        ("bad-selector", "Invalid", "InvalidSelector"),
        ("disabled-pin", "Unsatisfiable", "SelectorMismatch"),
    ] {
        eventually(TIMEOUT, &format!("{name} to end with {reason}"), || async {
            leases.get(name).await.ok().is_some_and(|l| {
                l.status.as_ref().is_some_and(|s| s.ended)
                    && cond(&l, type_).is_some_and(|c| c.reason == reason)
            })
        })
        .await;
    }
    // Not assigned before its begin time.
    let early = leases.get("scheduled").await.unwrap();
    assert!(early.status.and_then(|s| s.exporter_ref).is_none() || Timestamp::now() >= begin);
    eventually(TIMEOUT, "the scheduled lease to start", || async {
        leases
            .get("scheduled")
            .await
            .ok()
            .and_then(|l| l.status)
            .and_then(|s| s.begin_time)
            .is_some()
    })
    .await;
    let started = leases
        .get("scheduled")
        .await
        .unwrap()
        .status
        .unwrap()
        .begin_time
        .unwrap()
        .0;
    assert!(started >= begin, "started at {started}, before {begin}");
    eventually(
        Duration::from_secs(20),
        "the scheduled lease to expire at endTime",
        || async {
            leases
                .get("scheduled")
                .await
                .ok()
                .is_some_and(|l| cond(&l, "Ready").is_some_and(|c| c.reason == "Expired"))
        },
    )
    .await;
    let ended = leases
        .get("scheduled")
        .await
        .unwrap()
        .status
        .unwrap()
        .end_time
        .unwrap()
        .0;
    assert!(
        ended.duration_since(begin + jiff::SignedDuration::from_secs(4))
            <= jiff::SignedDuration::from_secs(2)
    );
}
