//! vmexport naming and link building (src/vmexport/naming.rs, objects/) for any set of claims an
//! export may serve. Properties: every generated object name is a valid Kubernetes name of at
//! most 63 characters; pod volume names are unique labels; the links built from the rendered
//! pod list exactly its claims, in order, with the formats of their content, under the right
//! host, with manifests only where the pod serves them; and the export server, configured from
//! the same pod environment, serves exactly the URIs those links name.
#![no_main]

use std::collections::BTreeSet;
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use ucm::vmexport::objects::links::{LinkSettings, links_from_pod};
use ucm::vmexport::objects::pod::{ExportVolume, PodInput, PodSettings, build_pod, dedup_volumes};
use ucm::vmexport::objects::service::build_service;
use ucm::vmexport::naming;
use ucm::vmexport::server::config::from_env;
use ucm::vmexport::{VirtualMachineExport, VirtualMachineExportSpec};

/// A DNS-1123 subdomain (what the API server admits as an object name), from fuzz bytes.
fn dns_name(bytes: &[u8], max: usize) -> String {
    const A: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789-.";
    let mut s: String = bytes
        .iter()
        .take(max)
        .map(|b| A[*b as usize % A.len()] as char)
        .collect();
    // labels start and end alphanumeric, and are not empty
    s = s
        .split('.')
        .map(|l| l.trim_matches('-'))
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(".");
    if s.is_empty() { "x".into() } else { s }
}

fn is_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_label)
}

#[derive(Arbitrary, Debug)]
struct Vol {
    name: Vec<u8>,
    block: bool,
    kubevirt: bool,
}

#[derive(Arbitrary, Debug)]
struct Input {
    export: Vec<u8>,
    ns: Vec<u8>,
    vols: Vec<Vol>,
    snapshot: bool,
    vm_manifest: bool,
    external: Option<u16>,
}

fuzz_target!(|inp: Input| {
    let name = dns_name(&inp.export, 120);
    let ns = dns_name(&inp.ns, 20).replace('.', "-");
    for n in [
        naming::service_name(&name),
        naming::selector_label_value(&name),
        naming::pod_name(&name),
        naming::token_secret_name(&name),
        naming::cert_secret_name(&name),
    ] {
        assert!(n.len() <= naming::MAX_NAME, "{n:?} from {name:?}");
    }
    let svc = naming::service_name(&name);
    assert!(
        is_label(&svc) && svc.starts_with(|c: char| c.is_ascii_lowercase()),
        "Service name {svc:?}"
    );
    for n in [
        naming::pod_name(&name),
        naming::token_secret_name(&name),
        naming::cert_secret_name(&name),
    ] {
        assert!(is_subdomain(&n), "{n:?} from {name:?}");
    }
    let sel = naming::selector_label_value(&name);
    assert!(sel.len() <= 63, "label value {sel:?}");

    let mut export = VirtualMachineExport::new(
        &name,
        serde_json::from_value::<VirtualMachineExportSpec>(
            serde_json::json!({"source": {"kind": "PersistentVolumeClaim", "name": "x"}}),
        )
        .unwrap(),
    );
    export.metadata.namespace = Some(ns.clone());
    export.metadata.uid = Some("uid-1".into());
    let service = build_service(&export);
    assert_eq!(service.metadata.name.as_deref(), Some(svc.as_str()));

    let prefix = inp.snapshot.then(|| name.clone());
    let volumes = dedup_volumes(
        inp.vols
            .iter()
            .take(12)
            .map(|v| {
                let claim = dns_name(&v.name, 70);
                ExportVolume {
                    pvc: match &prefix {
                        Some(p) => naming::restore_pvc_name(p, &claim),
                        None => claim,
                    },
                    block: v.block,
                    kubevirt_content: v.kubevirt,
                }
            })
            .collect(),
    );
    let deadline = jiff::Timestamp::from_second(1_900_000_000).unwrap();
    let pod = build_pod(
        &PodInput {
            export: &export,
            volumes: &volumes,
            token_secret: &naming::token_secret_name(&name),
            cert_secret: &naming::cert_secret_name(&name),
            deadline,
            vm_manifest: inp.vm_manifest,
        },
        &PodSettings {
            cert_duration: Duration::from_secs(86_400),
            cert_renew_before: Duration::from_secs(3600),
            ..PodSettings::default()
        },
    );
    let spec = pod.spec.clone().unwrap();
    let vol_names: Vec<String> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.clone())
        .collect();
    assert_eq!(
        vol_names.len(),
        vol_names.iter().collect::<BTreeSet<_>>().len(),
        "pod volume names collide: {vol_names:?}"
    );
    for v in &vol_names {
        assert!(is_label(v), "pod volume name {v:?}");
    }

    let host = inp.external.map(|p| format!("proxy.example:{p}"));
    let links = links_from_pod(
        &pod,
        &LinkSettings {
            namespace: ns.clone(),
            export_name: name.clone(),
            service_name: svc.clone(),
            internal_cert: "CA\n".into(),
            external_host: host.clone(),
            external_cert: String::new(),
            strip_prefix: prefix.clone(),
        },
    );
    assert_eq!(links.external.is_some(), host.is_some());
    let internal = links.internal.clone().unwrap();
    let got = internal.volumes.clone().unwrap_or_default();
    assert_eq!(got.len(), volumes.len(), "one link entry per served claim");

    // The server reads the same environment.
    let env: Vec<(String, String)> = spec.containers[0]
        .env
        .iter()
        .flatten()
        .filter_map(|e| Some((e.name.clone(), e.value.clone()?)))
        .collect();
    let cfg = from_env(env).expect("the pod's environment configures the server");
    assert_eq!(cfg.volumes.len(), volumes.len());
    assert_eq!(cfg.deadline, Some(deadline));

    let base = format!("https://{svc}.{ns}.svc");
    for ((v, link), served) in volumes.iter().zip(&got).zip(&cfg.volumes) {
        let want_name = match &prefix {
            Some(p) => v.pvc.strip_prefix(&format!("{p}-")).unwrap().to_string(),
            None => v.pvc.clone(),
        };
        assert_eq!(link.name, want_name);
        assert_eq!(served.name, v.pvc);
        let formats: Vec<(&str, &str)> = link
            .formats
            .iter()
            .flatten()
            .map(|f| (f.format.as_str(), f.url.as_str()))
            .collect();
        let p = &v.pvc;
        let want: Vec<(String, String)> = if v.block || v.kubevirt_content {
            vec![
                ("raw".into(), format!("{base}/volumes/{p}/disk.img")),
                ("gzip".into(), format!("{base}/volumes/{p}/disk.img.gz")),
            ]
        } else {
            vec![
                ("dir".into(), format!("{base}/volumes/{p}/dir")),
                ("tar.gz".into(), format!("{base}/volumes/{p}/disk.tar.gz")),
            ]
        };
        let want: Vec<(&str, &str)> = want.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        assert_eq!(formats, want);
        // every advertised URL is one the server routes for this volume
        for (_, url) in &formats {
            let path = url.strip_prefix(&base).unwrap();
            let routes = [
                &served.raw_uri,
                &served.gzip_uri,
                &served.archive_uri,
                &served.dir_uri,
            ];
            assert!(
                routes
                    .iter()
                    .any(|r| r.as_deref().map(|r| r.trim_end_matches('/')) == Some(path)),
                "{path} is not served by {served:?}"
            );
        }
        assert_eq!(served.is_image(), v.block || v.kubevirt_content);
    }
    let manifests: Vec<(String, String)> = internal
        .manifests
        .unwrap_or_default()
        .into_iter()
        .map(|m| (m.type_, m.url))
        .collect();
    let mut want = Vec::new();
    if inp.vm_manifest {
        want.push(("all".to_string(), format!("{base}/internal/manifests/all")));
    }
    want.push((
        "auth-header-secret".to_string(),
        format!("{base}/internal/manifests/secret"),
    ));
    assert_eq!(manifests, want);
    assert_eq!(cfg.vm_def_uri.is_some(), inp.vm_manifest);
});
