//! The local control plane is a real one: schema and CEL validation, the status subresource,
//! garbage collection, RBAC and Leases behave as in a cluster (issue: local control plane).

use std::time::Duration;

use crate::common::*;
use k8s_openapi::{
    api::{
        coordination::v1::Lease,
        core::v1::{ConfigMap, Pod},
        rbac::v1::{Role, RoleBinding},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams},
    discovery::ApiResource,
};
use serde_json::json;

/// A throwaway CRD with a CEL rule and a status subresource, owned by these tests only.
fn widget_crd() -> CustomResourceDefinition {
    serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.e2e.ucm.io"},
        "spec": {
            "group": "e2e.ucm.io",
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "listKind": "WidgetList"},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "spec": {
                            "type": "object",
                            "properties": {
                                "size": {"type": "integer", "minimum": 1},
                                "name": {"type": "string"}
                            },
                            "x-kubernetes-validations": [
                                {"rule": "self.name == oldSelf.name", "message": "name is immutable"}
                            ]
                        },
                        "status": {"type": "object", "properties": {"phase": {"type": "string"}}}
                    }
                }}
            }]
        }
    }))
    .unwrap()
}

fn widget_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("e2e.ucm.io", "v1", "Widget"),
        "widgets",
    )
}

async fn widgets(env: &TestEnv) -> Api<DynamicObject> {
    let crds: Api<CustomResourceDefinition> = Api::all(env.client.clone());
    apply_crd(&crds, &widget_crd()).await;
    wait_established(&crds, "widgets.e2e.ucm.io").await;
    Api::namespaced_with(env.client.clone(), &env.ns, &widget_resource())
}

fn widget(name: &str, size: i64) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "e2e.ucm.io/v1", "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"size": size, "name": name}
    }))
    .unwrap()
}

fn api_message(e: kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} {}", s.code, s.message),
        other => panic!("expected an API error, got {other}"),
    }
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn schema_and_cel_rules_are_enforced() {
    let env = TestEnv::new("schema").await;
    let api = widgets(&env).await;
    let err = api
        .create(&PostParams::default(), &widget("too-small", 0))
        .await
        .unwrap_err();
    let msg = api_message(err);
    assert!(
        msg.starts_with("422")
            && msg.contains("spec.size")
            && msg.contains("should be greater than or equal to 1"),
        "{msg}"
    );

    api.create(&PostParams::default(), &widget("w1", 1))
        .await
        .unwrap();
    let err = api
        .patch(
            "w1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"name": "renamed"}})),
        )
        .await
        .unwrap_err();
    let msg = api_message(err);
    assert!(msg.contains("name is immutable"), "{msg}");
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn status_subresource_does_not_change_spec_or_generation() {
    let env = TestEnv::new("status").await;
    let api = widgets(&env).await;
    let created = api
        .create(&PostParams::default(), &widget("w2", 3))
        .await
        .unwrap();
    let generation = created.metadata.generation;
    let patched = api
        .patch_status(
            "w2",
            &PatchParams::apply("ucm-e2e").force(),
            &Patch::Apply(json!({"apiVersion": "e2e.ucm.io/v1", "kind": "Widget", "status": {"phase": "Ready"}, "spec": {"size": 99}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.data["status"]["phase"], "Ready");
    assert_eq!(
        patched.data["spec"]["size"], 3,
        "spec must be ignored on /status"
    );
    assert_eq!(
        patched.metadata.generation, generation,
        "a status write must not bump generation"
    );
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn deleting_an_owner_collects_its_dependents() {
    let env = TestEnv::new("gc").await;
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.ns);
    let owner = cms
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "owner"}})).unwrap(),
        )
        .await
        .unwrap();
    let dependent: ConfigMap = serde_json::from_value(
        json!({"metadata": {"name": "dependent", "ownerReferences": [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.uid().unwrap()
        }]}}),
    )
    .unwrap();
    cms.create(&PostParams::default(), &dependent)
        .await
        .unwrap();
    cms.delete("owner", &DeleteParams::default()).await.unwrap();
    eventually(
        Duration::from_secs(90),
        "the garbage collector to delete the dependent",
        || async { cms.get_opt("dependent").await.unwrap().is_none() },
    )
    .await;
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn restricted_user_is_forbidden_until_bound() {
    let env = TestEnv::new("rbac").await;
    let user = client_for(&env.user_kubeconfig()).await;
    let pods: Api<Pod> = Api::namespaced(user, &env.ns);
    let err = pods.list(&Default::default()).await.unwrap_err();
    assert!(api_message(err).starts_with("403"));

    let roles: Api<Role> = Api::namespaced(env.client.clone(), &env.ns);
    roles
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "pod-reader"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]}))
            .unwrap(),
        )
        .await
        .unwrap();
    let bindings: Api<RoleBinding> = Api::namespaced(env.client.clone(), &env.ns);
    bindings
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "pod-reader"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "e2e-user"}]}))
            .unwrap(),
        )
        .await
        .unwrap();
    eventually(TIMEOUT, "the RoleBinding to take effect", || async {
        pods.list(&Default::default()).await.is_ok()
    })
    .await;
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn leases_can_be_created_and_renewed() {
    let env = TestEnv::new("lease").await;
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let lease: Lease = serde_json::from_value(json!({"metadata": {"name": "l"},
        "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15, "renewTime": "2026-01-01T00:00:00.000000Z"}}))
    .unwrap();
    let created = leases.create(&PostParams::default(), &lease).await.unwrap();
    let mut renewed = created.clone();
    renewed.spec.as_mut().unwrap().renew_time = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(jiff::Timestamp::now()),
    );
    let after = leases
        .replace("l", &PostParams::default(), &renewed)
        .await
        .unwrap();
    assert_ne!(after.resource_version(), created.resource_version());
    // A stale resourceVersion is refused: the optimistic lock leader election relies on.
    let err = leases
        .replace("l", &PostParams::default(), &renewed)
        .await
        .unwrap_err();
    assert!(api_message(err).starts_with("409"));
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn kubectl_matches_the_server_version() {
    let env = TestEnv::new("version").await;
    let (ok, out) = kubectl(&env.kubeconfig, &["version"], None);
    assert!(ok, "{out}");
    assert!(
        out.contains("Client Version: v1.37") && out.contains("Server Version: v1.37"),
        "{out}"
    );
}
