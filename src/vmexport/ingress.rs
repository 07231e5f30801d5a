//! Time-outs on the proxy's Ingress (docs/vmexport.md, "Ingress time-outs"): the Ingress the
//! manager follows for the external host (any Ingress in its namespace routing to the Service
//! `ucm-export-proxy`) gets the read/send time-outs of ingress-nginx and the OpenShift/HAProxy
//! route time-out, so a router never ends a multi-hour download (kubevirt#18638; HAProxy's
//! default is 30 s). A value someone else set is never overwritten: ucm applies, with its own
//! field manager and without force, only the annotations that are missing or already hold its
//! value (a server-side apply keeps a field only if the apply names it), so a user's value is
//! left alone and the user's later change wins.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::Ingress;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;

/// The field manager of these annotations: only they, so they never mix with other writes.
pub const FIELD_MANAGER: &str = "ucm-vmexport-timeouts";

/// The annotations and ucm's values: a day, the longest a download can run after the TTL by
/// default (`--export-ttl-transfer-wait`).
pub const TIMEOUTS: [(&str, &str); 3] = [
    ("nginx.ingress.kubernetes.io/proxy-read-timeout", "86400"),
    ("nginx.ingress.kubernetes.io/proxy-send-timeout", "86400"),
    ("haproxy.router.openshift.io/timeout", "24h"),
];

/// Whether `ing` routes to the Service `service` (default backend or any path).
pub fn routes_to(ing: &Ingress, service: &str) -> bool {
    let Some(spec) = &ing.spec else { return false };
    let to = |b: &k8s_openapi::api::networking::v1::IngressBackend| {
        b.service.as_ref().is_some_and(|s| s.name == service)
    };
    spec.default_backend.as_ref().is_some_and(to)
        || spec.rules.iter().flatten().any(|r| {
            r.http
                .as_ref()
                .is_some_and(|h| h.paths.iter().any(|p| to(&p.backend)))
        })
}

/// The annotations to apply to `ing`, or `None` when none is missing (no write: an Ingress that
/// has them all, whoever set them, costs nothing).
pub fn desired(ing: &Ingress) -> Option<BTreeMap<String, String>> {
    let have = ing.annotations();
    if TIMEOUTS.iter().all(|(k, _)| have.contains_key(*k)) {
        return None;
    }
    Some(
        TIMEOUTS
            .iter()
            .filter(|(k, v)| have.get(*k).is_none_or(|h| h == v))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

/// Applies the missing time-outs to `ing` when it routes to `service`. A conflict (someone took
/// a field between our read and our write) is left to the next event.
pub async fn ensure(
    client: &kube::Client,
    ing: &Ingress,
    service: &str,
) -> Result<(), kube::Error> {
    if !routes_to(ing, service) {
        return Ok(());
    }
    let Some(annotations) = desired(ing) else {
        return Ok(());
    };
    let ns = ing.namespace().unwrap_or_default();
    let name = ing.name_any();
    let api: Api<Ingress> = Api::namespaced(client.clone(), &ns);
    let body = json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": {"name": name, "namespace": ns, "annotations": annotations},
    });
    match api
        .patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(body),
        )
        .await
    {
        Ok(_) => {
            tracing::info!(%ns, ingress = %name, "download time-outs set on the export proxy's Ingress");
            Ok(())
        }
        Err(kube::Error::Api(e)) if e.code == 409 => {
            tracing::debug!(%ns, ingress = %name, "another manager took a time-out annotation; left to it");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ingress(annotations: &[(&str, &str)], to: &str) -> Ingress {
        serde_json::from_value(json!({
            "metadata": {"name": "i", "namespace": "ucm",
                "annotations": annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>()},
            "spec": {"rules": [{"host": "h", "http": {"paths": [{"path": "/", "pathType": "Prefix",
                "backend": {"service": {"name": to, "port": {"number": 443}}}}]}}]},
        }))
        .unwrap()
    }

    #[test]
    fn only_missing_or_own_values_are_applied() {
        let all = desired(&ingress(&[], "ucm-export-proxy")).unwrap();
        assert_eq!(all.len(), 3);
        assert_eq!(all["haproxy.router.openshift.io/timeout"], "24h");
        // A user's value is not named (so never overwritten); ours are kept named.
        let mine = desired(&ingress(
            &[
                ("haproxy.router.openshift.io/timeout", "5m"),
                ("nginx.ingress.kubernetes.io/proxy-read-timeout", "86400"),
            ],
            "ucm-export-proxy",
        ))
        .unwrap();
        assert_eq!(
            mine.keys().collect::<Vec<_>>(),
            [
                "nginx.ingress.kubernetes.io/proxy-read-timeout",
                "nginx.ingress.kubernetes.io/proxy-send-timeout"
            ]
        );
        // All present, whatever their values: no write.
        let full: Vec<(&str, &str)> = TIMEOUTS.iter().map(|(k, _)| (*k, "1")).collect();
        assert!(desired(&ingress(&full, "ucm-export-proxy")).is_none());
    }

    #[test]
    fn only_ingresses_to_the_proxy() {
        assert!(routes_to(
            &ingress(&[], "ucm-export-proxy"),
            "ucm-export-proxy"
        ));
        assert!(!routes_to(&ingress(&[], "other"), "ucm-export-proxy"));
    }
}
