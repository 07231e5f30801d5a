//! What `ucm rbac` prints: per feature, a ClusterRole `ucm-<feature>` (read access to its own CRDs,
//! which the runtime watches for readiness, plus the feature's rules) and, when the feature needs
//! access in the manager's namespace only, a Role `ucm-<feature>`; and the runtime's own Role
//! `ucm-leader-election`. `config/rbac` must grant exactly this (e2e/tests/platform/deploy.rs checks).

use k8s_openapi::api::rbac::v1::PolicyRule;
use kube::ResourceExt;

use super::Feature;

/// A PolicyRule from string slices.
pub fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> PolicyRule {
    let v = |xs: &[&str]| Some(xs.iter().map(|s| s.to_string()).collect());
    PolicyRule {
        api_groups: v(groups),
        resources: v(resources),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// The runtime reads each feature CRD (by name, with a field selector) before starting it.
pub fn crd_read_rule(f: &Feature) -> PolicyRule {
    PolicyRule {
        resource_names: Some(f.installed_crds().iter().map(|c| c.name_any()).collect()),
        ..rule(
            &["apiextensions.k8s.io"],
            &["customresourcedefinitions"],
            &["get", "list", "watch"],
        )
    }
}

pub fn cluster_rules(f: &Feature) -> Vec<PolicyRule> {
    std::iter::once(crd_read_rule(f))
        .chain((f.rbac)())
        .collect()
}

/// Leader election in the manager's namespace: the Lease, Events, and the leader Pod label
/// (patch our Pod, list labelled Pods to unlabel a former leader).
pub fn leader_election_rules() -> Vec<PolicyRule> {
    vec![
        rule(
            &["coordination.k8s.io"],
            &["leases"],
            &["get", "list", "watch", "create", "update", "patch"],
        ),
        rule(&[""], &["pods"], &["list", "patch"]),
        rule(&["events.k8s.io"], &["events"], &["create", "patch"]),
    ]
}

/// Every role as (kind, name, rules), in print order.
pub fn roles(features: &[&Feature]) -> Vec<(&'static str, String, Vec<PolicyRule>)> {
    let mut out = vec![(
        "Role",
        "ucm-leader-election".to_string(),
        leader_election_rules(),
    )];
    for f in features {
        out.push(("ClusterRole", format!("ucm-{}", f.name), cluster_rules(f)));
        let ns = (f.namespaced_rbac)();
        if !ns.is_empty() {
            out.push(("Role", format!("ucm-{}", f.name), ns));
        }
    }
    out
}
