//! The VirtualMachineTemplate source (KubeVirt 1.9, `virtctl vmexport create --vmtemplate`),
//! with template objects the API server validates against virt-template's own CRD
//! (e2e/testdata/virt-template). The API arriving after the manager is in `sources` (e11, on a
//! control plane of its own).

use super::*;

const TEMPLATE_CRD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/e2e/testdata/virt-template/virtualmachinetemplates.template.kubevirt.io.yaml"
);

/// virt-template's CRD, as its repository generates it.
pub(super) async fn install_template_crd(c: &Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let text = std::fs::read_to_string(TEMPLATE_CRD)
        .unwrap_or_else(|e| panic!("{TEMPLATE_CRD} is required for this test: {e}"));
    let crd: CustomResourceDefinition = serde_saphyr::from_str(&text).unwrap();
    let crds: Api<CustomResourceDefinition> = Api::all(c.clone());
    apply_crd(&crds, &crd).await;
    wait_established(&crds, "virtualmachinetemplates.template.kubevirt.io").await;
}

fn templates(c: &Client, ns: &str, version: &str) -> Api<DynamicObject> {
    dynapi(
        c,
        ns,
        "template.kubevirt.io",
        version,
        "VirtualMachineTemplate",
        "virtualmachinetemplates",
    )
}

/// The Ready condition virt-template's controller writes (every field the schema requires).
fn ready(status: &str) -> serde_json::Value {
    json!({"conditions": [{"type": "Ready", "status": status, "reason": "Test",
        "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]})
}

pub(super) fn template_source(name: &str) -> serde_json::Value {
    json!({"apiGroup": "template.kubevirt.io", "kind": "VirtualMachineTemplate", "name": name})
}

/// A Ready template in `ns` whose VM has one volume, the claim `claim`.
pub(super) async fn create_template(c: &Client, ns: &str, name: &str, claim: &str) {
    create_dyn(
        &templates(c, ns, "v1beta1"),
        json!({
            "apiVersion": "template.kubevirt.io/v1beta1", "kind": "VirtualMachineTemplate",
            "metadata": {"name": name},
            "spec": {"virtualMachine": {"spec": {"template": {"spec": {"volumes": [
                {"name": "disk", "persistentVolumeClaim": {"claimName": claim}}]}}}}},
            "status": ready("True"),
        }),
    )
    .await;
}

/// The template of these tests: a DataVolume template cloning `${SRC}` (default `golden-root`),
/// a claim `${DATA}` (default `data1`), a DataVolume `${NAME}-scratch` whose parameter has no
/// default (skipped), and a cloud-init disk.
fn template_body(name: &str, status: Option<serde_json::Value>) -> serde_json::Value {
    let mut t = json!({
        "apiVersion": "template.kubevirt.io/v1beta1", "kind": "VirtualMachineTemplate",
        "metadata": {"name": name, "labels": {"os": "fedora"}, "annotations": {"note": "golden"}},
        "spec": {
            "message": "VM ${NAME} created",
            "parameters": [
                {"name": "NAME", "required": true},
                {"name": "SRC", "value": "golden-root"},
                {"name": "DATA", "value": "data1"},
            ],
            "virtualMachine": {
                "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                "metadata": {"name": "${NAME}"},
                "spec": {
                    "runStrategy": "Halted",
                    "dataVolumeTemplates": [{"metadata": {"name": "${NAME}-root"},
                        "spec": {"source": {"pvc": {"name": "${SRC}"}}, "storage": {"resources": {"requests": {"storage": "1Gi"}}}}}],
                    "template": {"spec": {"domain": {"devices": {}}, "volumes": [
                        {"name": "root", "dataVolume": {"name": "${NAME}-root"}},
                        {"name": "data", "persistentVolumeClaim": {"claimName": "${DATA}"}},
                        {"name": "scratch", "dataVolume": {"name": "${NAME}-scratch"}},
                        {"name": "cloudinit", "cloudInitNoCloud": {"userData": "#cloud-config"}},
                    ]}},
                },
            },
        },
    });
    if let Some(s) = status {
        t["status"] = s;
    }
    t
}

/// What virtctl from kubevirt main does for `vmexport create NAME --vmtemplate=T` and then
/// `vmexport download NAME --volume=... ` and `--manifest [--include-secret]`: the export
/// through `export.kubevirt.io/v1` with `tokenSecretRef: secret-NAME`, its token Secret, a wait
/// for `phase=Ready` with links, then each link downloaded with the token header and the
/// manifests fetched as YAML (applied here with `--dry-run=server`, so the template is checked
/// against virt-template's schema and the DataVolumes against CDI's).
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn t1_vmtemplate_export_as_virtctl_makes_it() {
    let env = TestEnv::new("vmx-t1").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    install_template_crd(&c).await;
    install_crd(
        &c,
        "cdi.kubevirt.io",
        "v1beta1",
        "DataVolume",
        "datavolumes",
    )
    .await;
    let m = manager(&env);
    m.wait_ready().await;
    create_pvc(&c, &ns, "golden-root", Some("kubevirt"), false).await;
    create_pvc(&c, &ns, "data1", None, false).await;
    create_dyn(
        &templates(&c, &ns, "v1beta1"),
        template_body("fedora", Some(ready("True"))),
    )
    .await;

    let exports = dynapi(
        &c,
        &ns,
        "export.kubevirt.io",
        "v1",
        "VirtualMachineExport",
        "virtualmachineexports",
    );
    let name = "tpl-export";
    let token = "token-of-the-template-export-0123456789";
    create_dyn(
        &exports,
        json!({
            "apiVersion": "export.kubevirt.io/v1", "kind": "VirtualMachineExport",
            "metadata": {"name": name},
            "spec": {"source": template_source("fedora"), "tokenSecretRef": format!("secret-{name}")},
        }),
    )
    .await;
    let tok_secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": format!("secret-{name}")}, "stringData": {"token": token},
    }))
    .unwrap();
    Api::<Secret>::namespaced(c.clone(), &ns)
        .create(&PostParams::default(), &tok_secret)
        .await
        .unwrap();
    let e = wait_phase(&c, &ns, name, "Pending", "PodPending").await;
    assert_eq!(
        e.status.as_ref().unwrap().virtual_machine_name,
        None,
        "upstream names no VM for a template"
    );
    let pod_name = format!("virt-export-{name}");
    let pod = Api::<Pod>::namespaced(c.clone(), &ns)
        .get(&pod_name)
        .await
        .unwrap();
    let claims: Vec<String> = pod
        .spec
        .clone()
        .unwrap()
        .volumes
        .unwrap()
        .into_iter()
        .filter_map(|v| v.persistent_volume_claim.map(|p| p.claim_name))
        .collect();
    assert_eq!(
        claims,
        ["golden-root", "data1"],
        "the DataVolume template's source claim and the claim, parameters resolved; the unresolvable one skipped"
    );
    let cm = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(c.clone(), &ns)
        .get(&format!("exporter-vm-manifest-{name}"))
        .await
        .unwrap();
    assert!(
        cm.data
            .unwrap()
            .contains_key("virtualmachinetemplate-manifest"),
        "upstream's manifest key"
    );

    mark_pod(&c, &ns, &pod_name, "Running", true).await;
    // virtctl waits for phase=Ready and links, read through export.kubevirt.io/v1
    let t0 = Instant::now();
    let obj = loop {
        let o = exports.get(name).await.unwrap();
        if o.data["status"]["phase"] == "Ready" && !o.data["status"]["links"]["internal"].is_null()
        {
            break o;
        }
        assert!(t0.elapsed() < WAIT, "not Ready: {:?}", o.data["status"]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let e: VirtualMachineExport =
        serde_json::from_value(serde_json::to_value(&obj).unwrap()).unwrap();
    assert_eq!(ready_reason(&e).1, "PodReady");
    let int = e.status.clone().unwrap().links.unwrap().internal.unwrap();
    let h = format!("https://virt-export-{name}.{ns}.svc");
    let shape: Vec<(String, Vec<(String, String)>)> = int
        .volumes
        .clone()
        .unwrap()
        .into_iter()
        .map(|v| {
            (
                v.name,
                v.formats
                    .unwrap()
                    .into_iter()
                    .map(|f| (f.format, f.url))
                    .collect(),
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            (
                "golden-root".to_string(),
                vec![
                    (
                        "raw".to_string(),
                        format!("{h}/volumes/golden-root/disk.img")
                    ),
                    (
                        "gzip".to_string(),
                        format!("{h}/volumes/golden-root/disk.img.gz")
                    ),
                ]
            ),
            (
                "data1".to_string(),
                vec![
                    ("dir".to_string(), format!("{h}/volumes/data1/dir")),
                    (
                        "tar.gz".to_string(),
                        format!("{h}/volumes/data1/disk.tar.gz")
                    ),
                ]
            ),
        ]
    );
    let manifests: Vec<(String, String)> = int
        .manifests
        .clone()
        .unwrap()
        .into_iter()
        .map(|m| (m.type_, m.url))
        .collect();
    assert_eq!(
        manifests,
        [
            ("all".to_string(), format!("{h}/internal/manifests/all")),
            (
                "auth-header-secret".to_string(),
                format!("{h}/internal/manifests/secret")
            ),
        ]
    );

    // every link through the rendered Pod run as `ucm export-server`; the manifests applied
    // with --dry-run=server (template CRD and CDI's DataVolume CRD validate them)
    let pod = Api::<Pod>::namespaced(c.clone(), &ns)
        .get(&pod_name)
        .await
        .unwrap();
    let bodies = bridge(&env, &pod, token, &int_urls(&e)).await;
    let all: serde_json::Value =
        serde_json::from_slice(&bodies[&format!("{h}/internal/manifests/all")]).unwrap();
    let items = all["items"].as_array().unwrap();
    let kinds: Vec<&str> = items.iter().map(|i| i["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "ConfigMap",
            "VirtualMachineTemplate",
            "DataVolume",
            "DataVolume"
        ]
    );
    let tpl = &items[1];
    assert_eq!(tpl["apiVersion"], "template.kubevirt.io/v1beta1");
    assert_eq!(
        tpl["metadata"],
        json!({"name": "fedora", "labels": {"os": "fedora"}, "annotations": {"note": "golden"}}),
        "metadata reduced to name, labels and annotations"
    );
    assert!(tpl.get("status").is_none(), "no status");
    let source = template_body("fedora", None);
    assert_eq!(tpl["spec"]["parameters"], source["spec"]["parameters"]);
    assert_eq!(tpl["spec"]["message"], source["spec"]["message"]);
    let vm = &tpl["spec"]["virtualMachine"];
    assert_eq!(
        vm["spec"]["dataVolumeTemplates"][0]["spec"],
        json!({"source": {"pvc": {"name": "golden-root"}}, "storage": {"resources": {"requests": {"storage": "1Gi"}}}}),
        "the DataVolume template points at the exported claim"
    );
    assert_eq!(
        vm["spec"]["template"]["spec"]["volumes"],
        json!([
            {"name": "root", "dataVolume": {"name": "${NAME}-root"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "${DATA}"}},
            {"name": "scratch", "dataVolume": {"name": "${NAME}-scratch"}},
            {"name": "cloudinit", "cloudInitNoCloud": {"userData": "#cloud-config"}},
        ]),
        "volumes kept where a name does not resolve or names a DataVolume template"
    );
    let dvs: Vec<(String, String)> = items[2..]
        .iter()
        .map(|d| {
            (
                d["metadata"]["name"].as_str().unwrap().to_string(),
                d["spec"]["source"]["http"]["url"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            )
        })
        .collect();
    assert_eq!(
        dvs,
        [
            ("data1".to_string(), String::new()),
            (
                "golden-root".to_string(),
                format!("{h}/volumes/golden-root/disk.img.gz")
            ),
        ],
        "a DataVolume per exported claim, importing the gzip link where there is one"
    );
    assert_eq!(
        items[3]["spec"]["source"]["http"]["secretExtraHeaders"],
        json!([format!("header-secret-{name}")])
    );

    // a template change reaches the served manifest (the ConfigMap is kept up to date)
    let tpls = templates(&c, &ns, "v1beta1");
    tpls.patch(
        "fedora",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"os": "fedora-42"}}})),
    )
    .await
    .unwrap();
    eventually(
        WAIT,
        "the manifest ConfigMap follows the template",
        || async {
            Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(c.clone(), &ns)
                .get(&format!("exporter-vm-manifest-{name}"))
                .await
                .unwrap()
                .data
                .unwrap()["virtualmachinetemplate-manifest"]
                .contains("fedora-42")
        },
    )
    .await;
}

/// Upstream's reasons and messages: `VMTemplateNotFound`, `VMTemplateNotReady` (the template's
/// `Ready` condition), `VolumesNotPopulated` until the claims exist, `VMNoVolumes`; a template
/// written through the deprecated v1alpha1 works the same.
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn t2_vmtemplate_not_found_not_ready_not_populated_no_volumes() {
    let env = TestEnv::new("vmx-t2").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    install_template_crd(&c).await;
    let m = manager(&env);
    m.wait_ready().await;

    create_export(&c, &ns, "nf", template_source("fedora"), None)
        .await
        .unwrap();
    let (_, _, msg) =
        ready_reason(&wait_phase(&c, &ns, "nf", "Skipped", "VMTemplateNotFound").await);
    assert_eq!(msg, format!("VirtualMachineTemplate {ns}/fedora not found"));
    eventually(WAIT, "a VMTemplateNotFound event", || async {
        has_event(&c, &ns, "VMTemplateNotFound").await
    })
    .await;

    // created without a Ready condition (virt-template's controller has not seen it yet)
    let tpls = templates(&c, &ns, "v1beta1");
    create_dyn(&tpls, template_body("fedora", None)).await;
    let (_, _, msg) =
        ready_reason(&wait_phase(&c, &ns, "nf", "Skipped", "VMTemplateNotReady").await);
    assert_eq!(
        msg,
        format!("VirtualMachineTemplate {ns}/fedora is not ready")
    );
    tpls.patch_status(
        "fedora",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": ready("False")})),
    )
    .await
    .unwrap();
    // Ready=False is not ready either; nothing changes
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        ready_reason(&export(&c, &ns, "nf").await.unwrap()).1,
        "VMTemplateNotReady"
    );

    // Ready, but its claims do not exist: no content yet, so Skipped as upstream
    tpls.patch_status(
        "fedora",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": ready("True")})),
    )
    .await
    .unwrap();
    let (_, _, msg) =
        ready_reason(&wait_phase(&c, &ns, "nf", "Skipped", "VolumesNotPopulated").await);
    assert_eq!(
        msg,
        format!("Not all volumes in VirtualMachineTemplate {ns}/fedora are populated")
    );
    // one claim found, one missing: Pending
    create_pvc(&c, &ns, "golden-root", Some("kubevirt"), false).await;
    wait_phase(&c, &ns, "nf", "Pending", "VolumesNotPopulated").await;
    create_pvc(&c, &ns, "data1", None, false).await;
    wait_phase(&c, &ns, "nf", "Pending", "PodPending").await;

    // no claim to export: VMNoVolumes, written through the deprecated v1alpha1
    let mut empty = template_body("bare", Some(ready("True")));
    empty["apiVersion"] = json!("template.kubevirt.io/v1alpha1");
    empty["spec"]["virtualMachine"]["spec"]["dataVolumeTemplates"] = json!([]);
    empty["spec"]["virtualMachine"]["spec"]["template"]["spec"]["volumes"] =
        json!([{"name": "cloudinit", "cloudInitNoCloud": {"userData": "#cloud-config"}}]);
    create_dyn(&templates(&c, &ns, "v1alpha1"), empty).await;
    create_export(&c, &ns, "none", template_source("bare"), None)
        .await
        .unwrap();
    let (_, _, msg) = ready_reason(&wait_phase(&c, &ns, "none", "Skipped", "VMNoVolumes").await);
    assert_eq!(
        msg,
        format!("VirtualMachineTemplate {ns}/bare has no volumes")
    );

    // the template's group is part of the source: another group is not a template source
    create_export(
        &c,
        &ns,
        "wrong-group",
        json!({"apiGroup": "kubevirt.io", "kind": "VirtualMachineTemplate", "name": "fedora"}),
        None,
    )
    .await
    .unwrap();
    wait_phase(&c, &ns, "wrong-group", "Skipped", "UnsupportedSource").await;
}
