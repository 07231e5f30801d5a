//! The links of a ready export pod, and the external host from the proxy's Ingress
//! (docs/vmexport.md, "Links", "Export proxy").

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;

use crate::vmexport::api::*;
use crate::vmexport::types::{
    VirtualMachineExportLink, VirtualMachineExportLinks, VirtualMachineExportManifest,
    VirtualMachineExportVolume, VirtualMachineExportVolumeFormat,
};

/// Formats in upstream's order, with the env suffix that carries each URI.
const FORMATS: [(&str, &str); 4] = [
    ("raw", "EXPORT_RAW_URI"),
    ("gzip", "EXPORT_RAW_GZIP_URI"),
    ("dir", "EXPORT_DIR_URI"),
    ("tar.gz", "EXPORT_ARCHIVE_URI"),
];

/// Where the links point.
#[derive(Clone, Debug, Default)]
pub struct LinkSettings {
    pub namespace: String,
    pub export_name: String,
    pub service_name: String,
    /// The ucm CA, PEM.
    pub internal_cert: String,
    /// `--export-external-host`.
    pub external_host: Option<String>,
    /// Contents of `--export-external-ca-file`, or empty.
    pub external_cert: String,
    /// For snapshot sources: the `<export>-` prefix stripped from volume names.
    pub strip_prefix: Option<String>,
}

/// Builds `status.links` from the ready pod's environment: the links describe what that pod
/// serves, and the volume name is the `/volumes/<pvc>/` segment of the URI ("Links", rule 2).
pub fn links_from_pod(pod: &Pod, s: &LinkSettings) -> VirtualMachineExportLinks {
    let envs: BTreeMap<String, String> = pod
        .spec
        .as_ref()
        .and_then(|sp| sp.containers.first())
        .and_then(|c| c.env.as_ref())
        .map(|e| {
            e.iter()
                .filter_map(|v| Some((v.name.clone(), v.value.clone()?)))
                .collect()
        })
        .unwrap_or_default();
    // Indexes in numeric order, not lexical order of the names.
    let mut indexes: Vec<usize> = envs
        .keys()
        .filter_map(|k| {
            let rest = k.strip_prefix("VOLUME")?;
            let (n, _) = rest.split_once('_')?;
            n.parse().ok()
        })
        .collect();
    indexes.sort_unstable();
    indexes.dedup();

    let internal_base = format!("https://{}.{}.svc", s.service_name, s.namespace);
    let external_base = s.external_host.as_ref().map(|h| {
        format!(
            "https://{h}/api/{OWNER_API_VERSION}/namespaces/{}/virtualmachineexports/{}",
            s.namespace, s.export_name
        )
    });

    let build = |base: &str, manifest_prefix: &str, cert: &str| {
        let mut volumes = Vec::new();
        for i in &indexes {
            let mut formats = Vec::new();
            let mut name = None;
            for (format, suffix) in FORMATS {
                if let Some(uri) = envs.get(&format!("VOLUME{i}_{suffix}")) {
                    if name.is_none() {
                        name = volume_name_from_uri(uri);
                    }
                    let uri = uri.trim_end_matches('/');
                    formats.push(VirtualMachineExportVolumeFormat {
                        format: format.into(),
                        url: format!("{base}{uri}"),
                    });
                }
            }
            let Some(mut name) = name else { continue };
            if let Some(p) = &s.strip_prefix
                && let Some(stripped) = name.strip_prefix(&format!("{p}-"))
            {
                name = stripped.to_string();
            }
            volumes.push(VirtualMachineExportVolume {
                name,
                formats: Some(formats),
            });
        }
        let mut manifests = Vec::new();
        if let Some(uri) = envs.get("EXPORT_VM_DEF_URI") {
            manifests.push(VirtualMachineExportManifest {
                type_: "all".into(),
                url: format!("{base}/{manifest_prefix}{uri}"),
            });
        }
        if let Some(uri) = envs.get("EXPORT_SECRET_DEF_URI") {
            manifests.push(VirtualMachineExportManifest {
                type_: "auth-header-secret".into(),
                url: format!("{base}/{manifest_prefix}{uri}"),
            });
        }
        // Upstream's `oci` manifest type: the archive, without /internal or /external.
        if let Some(uri) = envs.get("EXPORT_OCI_URI") {
            manifests.push(VirtualMachineExportManifest {
                type_: "oci".into(),
                url: format!("{base}{uri}"),
            });
        }
        VirtualMachineExportLink {
            cert: cert.to_string(),
            volumes: Some(volumes),
            manifests: (!manifests.is_empty()).then_some(manifests),
        }
    };
    VirtualMachineExportLinks {
        internal: Some(build(&internal_base, "internal", s.internal_cert.trim())),
        external: external_base.map(|b| build(&b, "external", s.external_cert.trim())),
    }
}

/// The external host from an Ingress that routes to the export proxy's Service, as KubeVirt finds
/// its proxy's Ingress: a default backend on the Service (host of the first rule), else the first
/// rule with a path to it. Also returns the TLS Secret listed for that host, if any.
pub fn external_from_ingresses<'a>(
    ingresses: impl IntoIterator<Item = &'a k8s_openapi::api::networking::v1::Ingress>,
    service: &str,
) -> Option<(String, Option<String>)> {
    let mut found: Vec<(String, String, Option<String>)> = Vec::new();
    for ing in ingresses {
        let Some(spec) = &ing.spec else { continue };
        let to_proxy = |b: &k8s_openapi::api::networking::v1::IngressBackend| {
            b.service.as_ref().is_some_and(|s| s.name == service)
        };
        let rules = spec.rules.as_deref().unwrap_or_default();
        let host = if spec.default_backend.as_ref().is_some_and(to_proxy) {
            rules.first().and_then(|r| r.host.clone())
        } else {
            rules
                .iter()
                .find(|r| {
                    r.http
                        .as_ref()
                        .is_some_and(|h| h.paths.iter().any(|p| to_proxy(&p.backend)))
                })
                .and_then(|r| r.host.clone())
        };
        let Some(host) = host.filter(|h| !h.is_empty()) else {
            continue;
        };
        let secret = spec
            .tls
            .iter()
            .flatten()
            .find(|t| t.hosts.as_ref().is_some_and(|hs| hs.contains(&host)))
            .and_then(|t| t.secret_name.clone());
        found.push((ing.metadata.name.clone().unwrap_or_default(), host, secret));
    }
    // Deterministic when several match: the first by name.
    found.sort();
    found.into_iter().next().map(|(_, h, s)| (h, s))
}

/// The CA users should trust for an Ingress TLS Secret: `ca.crt` if present, else the last
/// certificate of the `tls.crt` chain (the one closest to the root; a self-signed certificate is
/// its own).
pub fn ingress_ca(secret: &k8s_openapi::api::core::v1::Secret) -> String {
    let d = secret.data.clone().unwrap_or_default();
    let text = |k: &str| d.get(k).map(|b| String::from_utf8_lossy(&b.0).into_owned());
    if let Some(ca) = text("ca.crt").filter(|c| !c.trim().is_empty()) {
        return ca.trim().to_string();
    }
    let chain = text("tls.crt").unwrap_or_default();
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    match chain.rfind(BEGIN) {
        Some(i) => chain[i..].trim().to_string(),
        None => String::new(),
    }
}

fn volume_name_from_uri(uri: &str) -> Option<String> {
    let rest = uri.strip_prefix("/volumes/")?;
    let (name, _) = rest.split_once('/')?;
    (!name.is_empty()).then(|| name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmexport::fixtures::{export, input};
    use crate::vmexport::objects::pod::{ExportVolume, PodSettings, build_pod};
    use k8s_openapi::api::core::v1::{ContainerStatus, PodStatus};

    fn ready_pod(vols: &[ExportVolume], vm: bool) -> Pod {
        let e = export("e1");
        let mut pod = build_pod(&input(&e, vols, vm), &PodSettings::default());
        pod.status = Some(PodStatus {
            phase: Some("Running".into()),
            container_statuses: Some(vec![ContainerStatus {
                ready: true,
                ..Default::default()
            }]),
            ..Default::default()
        });
        pod
    }

    fn link_settings() -> LinkSettings {
        LinkSettings {
            namespace: "ns1".into(),
            export_name: "e1".into(),
            service_name: "virt-export-e1".into(),
            internal_cert: "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".into(),
            ..Default::default()
        }
    }

    #[test]
    fn links_internal_shapes() {
        let vols = vec![
            ExportVolume {
                pvc: "disk.v1".into(),
                block: false,
                kubevirt_content: true,
            },
            ExportVolume {
                pvc: "files".into(),
                block: false,
                kubevirt_content: false,
            },
        ];
        let links = links_from_pod(&ready_pod(&vols, false), &link_settings());
        assert!(links.external.is_none());
        let int = links.internal.unwrap();
        assert_eq!(
            int.cert,
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"
        );
        let v = int.volumes.unwrap();
        assert_eq!(v[0].name, "disk.v1");
        let f: Vec<_> = v[0]
            .formats
            .clone()
            .unwrap()
            .into_iter()
            .map(|f| (f.format, f.url))
            .collect();
        assert_eq!(
            f,
            [
                (
                    "raw".to_string(),
                    "https://virt-export-e1.ns1.svc/volumes/disk.v1/disk.img".to_string()
                ),
                (
                    "gzip".to_string(),
                    "https://virt-export-e1.ns1.svc/volumes/disk.v1/disk.img.gz".to_string()
                ),
            ]
        );
        let f: Vec<_> = v[1]
            .formats
            .clone()
            .unwrap()
            .into_iter()
            .map(|f| (f.format, f.url))
            .collect();
        assert_eq!(
            f,
            [
                (
                    "dir".to_string(),
                    "https://virt-export-e1.ns1.svc/volumes/files/dir".to_string()
                ),
                (
                    "tar.gz".to_string(),
                    "https://virt-export-e1.ns1.svc/volumes/files/disk.tar.gz".to_string()
                ),
            ]
        );
        let m = int.manifests.unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].type_, "auth-header-secret");
        assert_eq!(
            m[0].url,
            "https://virt-export-e1.ns1.svc/internal/manifests/secret"
        );
    }

    #[test]
    fn links_external_and_snapshot_prefix() {
        let vols = vec![ExportVolume {
            pvc: "e1-rootdisk".into(),
            block: true,
            kubevirt_content: true,
        }];
        let mut s = link_settings();
        s.external_host = Some("proxy.example.com:8443".into());
        s.external_cert = "EXTCA\n".into();
        s.strip_prefix = Some("e1".into());
        let links = links_from_pod(&ready_pod(&vols, true), &s);
        let ext = links.external.unwrap();
        assert_eq!(ext.cert, "EXTCA");
        let v = &ext.volumes.as_ref().unwrap()[0];
        assert_eq!(v.name, "rootdisk");
        assert_eq!(
            v.formats.as_ref().unwrap()[0].url,
            "https://proxy.example.com:8443/api/export.kubevirt.io/v1/namespaces/ns1/virtualmachineexports/e1/volumes/e1-rootdisk/disk.img"
        );
        let m = ext.manifests.unwrap();
        assert_eq!(m[0].type_, "all");
        assert!(
            m[0].url
                .ends_with("/virtualmachineexports/e1/external/manifests/all")
        );
        assert!(m[1].url.ends_with("/external/manifests/secret"));
        let int = links.internal.unwrap();
        assert_eq!(
            int.manifests.unwrap()[0].url,
            "https://virt-export-e1.ns1.svc/internal/manifests/all"
        );
    }

    #[test]
    fn links_follow_numeric_index_order() {
        let vols: Vec<_> = (0..12)
            .map(|i| ExportVolume {
                pvc: format!("d{i}"),
                block: false,
                kubevirt_content: true,
            })
            .collect();
        let links = links_from_pod(&ready_pod(&vols, false), &link_settings());
        let names: Vec<_> = links
            .internal
            .unwrap()
            .volumes
            .unwrap()
            .into_iter()
            .map(|v| v.name)
            .collect();
        let want: Vec<_> = (0..12).map(|i| format!("d{i}")).collect();
        assert_eq!(names, want);
    }

    #[test]
    fn external_host_from_the_proxy_ingress() {
        use k8s_openapi::api::networking::v1::Ingress;
        let ing = |name: &str, spec: serde_json::Value| -> Ingress {
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}, "spec": spec}))
                .unwrap()
        };
        let other = ing(
            "a-other",
            serde_json::json!({"rules": [{"host": "other.example", "http": {"paths": [{"path": "/", "pathType": "Prefix",
            "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}]}),
        );
        let by_path = ing(
            "b-proxy",
            serde_json::json!({
            "tls": [{"hosts": ["x.example"], "secretName": "x-tls"}, {"hosts": ["vmexport.example"], "secretName": "proxy-tls"}],
            "rules": [
                {"host": "web.example", "http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}},
                {"host": "vmexport.example", "http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "ucm-export-proxy", "port": {"number": 443}}}}]}},
            ]}),
        );
        let default_backend = ing(
            "c-default",
            serde_json::json!({"defaultBackend": {"service": {"name": "ucm-export-proxy", "port": {"number": 443}}},
            "rules": [{"host": "d.example"}]}),
        );
        assert_eq!(external_from_ingresses([&other], "ucm-export-proxy"), None);
        assert_eq!(
            external_from_ingresses([&other, &by_path], "ucm-export-proxy"),
            Some((
                "vmexport.example".to_string(),
                Some("proxy-tls".to_string())
            ))
        );
        assert_eq!(
            external_from_ingresses([&default_backend], "ucm-export-proxy"),
            Some(("d.example".to_string(), None))
        );
        // several: the first by name
        assert_eq!(
            external_from_ingresses([&default_backend, &by_path], "ucm-export-proxy")
                .unwrap()
                .0,
            "vmexport.example"
        );
        let secret = |data: serde_json::Value| -> k8s_openapi::api::core::v1::Secret {
            serde_json::from_value(serde_json::json!({"data": data})).unwrap()
        };
        use base64::Engine;
        let b = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let chain = "-----BEGIN CERTIFICATE-----\nLEAF\n-----END CERTIFICATE-----\n-----BEGIN CERTIFICATE-----\nISSUER\n-----END CERTIFICATE-----\n";
        assert_eq!(
            ingress_ca(&secret(serde_json::json!({"tls.crt": b(chain)}))),
            "-----BEGIN CERTIFICATE-----\nISSUER\n-----END CERTIFICATE-----"
        );
        assert_eq!(
            ingress_ca(&secret(
                serde_json::json!({"tls.crt": b(chain), "ca.crt": b("CA\n")})
            )),
            "CA"
        );
    }

    #[test]
    fn oci_link_is_a_manifest_without_prefix() {
        let vols = vec![ExportVolume {
            pvc: "rootdisk".into(),
            block: false,
            kubevirt_content: true,
        }];
        let e = export("e1");
        let mut inp = input(&e, &vols, true);
        inp.oci = true;
        let mut pod = ready_pod(&vols, true);
        pod.spec = build_pod(&inp, &PodSettings::default()).spec;
        let mut s = link_settings();
        s.external_host = Some("proxy.example.com".into());
        let links = links_from_pod(&pod, &s);
        let types = |l: &VirtualMachineExportLink| -> Vec<(String, String)> {
            l.manifests
                .clone()
                .unwrap()
                .into_iter()
                .map(|m| (m.type_, m.url))
                .collect()
        };
        let int = types(links.internal.as_ref().unwrap());
        assert_eq!(
            int[2],
            (
                "oci".to_string(),
                "https://virt-export-e1.ns1.svc/export.oci.tar".to_string()
            ),
            "after all and auth-header-secret, as upstream"
        );
        assert_eq!(
            types(links.external.as_ref().unwrap())[2].1,
            "https://proxy.example.com/api/export.kubevirt.io/v1/namespaces/ns1/virtualmachineexports/e1/export.oci.tar"
        );
        // only with the manifest data the archive is built from
        inp.vm_manifest = false;
        pod.spec = build_pod(&inp, &PodSettings::default()).spec;
        let int = types(links_from_pod(&pod, &s).internal.as_ref().unwrap());
        assert!(int.iter().all(|(t, _)| t != "oci"), "{int:?}");
    }
}
