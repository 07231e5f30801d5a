//! The serve table: objects the schema admits but ucm cannot serve. Each must end with a
//! condition whose reason names the problem and whose message says what to do, and must not
//! leave a reconcile error loop behind.

use serde_json::{Value, json};

use super::Crd;

/// One unservable input: the objects to create (fixtures first, the bad object last) and the
/// condition the bad object (or `observe`, when the problem shows on another object) must get.
pub struct ServeCase {
    /// The CRD whose input is bad (the count goes there).
    pub crd: Crd,
    pub what: &'static str,
    pub create: Vec<(Crd, Value)>,
    /// The object that shows the condition (kind, name).
    pub observe: (Crd, String),
    pub condition: &'static str,
    pub status: &'static str,
    pub reason: &'static str,
    /// Substrings of the message that make it actionable.
    pub says: Vec<String>,
}

fn obj(crd: Crd, name: &str, spec: Value) -> (Crd, Value) {
    (crd, json!({"metadata": {"name": name}, "spec": spec}))
}

fn case(
    crd: Crd,
    what: &'static str,
    create: Vec<(Crd, Value)>,
    condition: (&'static str, &'static str, &'static str),
    says: &[&str],
) -> ServeCase {
    let (ocrd, body) = create.last().expect("a bad object").clone();
    let name = body["metadata"]["name"].as_str().unwrap().to_string();
    ServeCase {
        crd,
        what,
        create,
        observe: (ocrd, name),
        condition: condition.0,
        status: condition.1,
        reason: condition.2,
        says: says.iter().map(|s| s.to_string()).collect(),
    }
}

fn lease(name: &str, spec: Value) -> (Crd, Value) {
    let mut s = json!({"clientRef": {"name": "ctl"}, "duration": "1h"});
    json_patch::merge(&mut s, &spec);
    obj(Crd::Lease, name, s)
}

fn exporter(name: &str, board: &str, enabled: bool) -> (Crd, Value) {
    (
        Crd::Exporter,
        json!({"metadata": {"name": name, "labels": {"board": board}},
               "spec": {"enabled": enabled}}),
    )
}

fn vme(name: &str, spec: Value) -> (Crd, Value) {
    obj(Crd::VmExport, name, spec)
}

fn pvc(name: &str) -> (Crd, Value) {
    (
        Crd::Pvc,
        json!({"metadata": {"name": name,
                   "annotations": {"cdi.kubevirt.io/storage.contentType": "kubevirt"}},
               "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "none",
                        "resources": {"requests": {"storage": "1Gi"}}}}),
    )
}

/// Every case. `ns` is the test namespace, `u` a unique prefix for cluster-scoped names and
/// `dead_node` a node where no snapshot agent runs.
pub fn all(ns: &str, u: &str, dead_node: &str) -> Vec<ServeCase> {
    let unsat = |r| ("Unsatisfiable", "True", r);
    let invalid = |r| ("Invalid", "True", r);
    let pending = |r| ("Pending", "True", r);
    let ready_false = |r| ("Ready", "False", r);
    vec![
        // Exporter and Client: names that leave no room for the credential Secret's name.
        case(
            Crd::Exporter,
            "name of 245 characters (its Secret name would be 254)",
            vec![exporter(&"e".repeat(245), "none", true)],
            ("TokenExpiring", "True", "CredentialNameTooLong"),
            &["over the Kubernetes limit of 253", "at most 244 characters"],
        ),
        case(
            Crd::Client,
            "name of 250 characters (its Secret name would be 257)",
            vec![obj(Crd::Client, &"c".repeat(250), json!({}))],
            ("TokenExpiring", "True", "CredentialNameTooLong"),
            &["over the Kubernetes limit of 253", "at most 246 characters"],
        ),
        // Leases (the namespace has ExporterAccessPolicies, so a Client is needed).
        case(
            Crd::Lease,
            "selector matching no exporter",
            vec![lease(
                "sel-none",
                json!({"selector": {"matchLabels": {"board": "nothing"}}}),
            )],
            unsat("NoAccess"),
            &["While there are 0 exporters matching the selector"],
        ),
        case(
            Crd::Lease,
            "pinned to an exporter that does not exist",
            vec![lease(
                "pin-ghost",
                json!({"exporterRef": {"name": "ghost"}}),
            )],
            unsat("ExporterNotFound"),
            &["Requested exporter ghost was not found"],
        ),
        case(
            Crd::Lease,
            "pinned to a disabled exporter",
            vec![
                exporter("off", "off", false),
                lease("pin-off", json!({"exporterRef": {"name": "off"}})),
            ],
            unsat("ExporterDisabled"),
            &[
                "Requested exporter off is disabled",
                "spec.allowDisabled: true",
            ],
        ),
        case(
            Crd::Lease,
            "selector matching only disabled exporters",
            vec![
                exporter("off2", "off2", false),
                lease(
                    "sel-off",
                    json!({"selector": {"matchLabels": {"board": "off2"}}}),
                ),
            ],
            unsat("AllDisabled"),
            &["All 1 exporters matching the selector are disabled"],
        ),
        case(
            Crd::Lease,
            "pinned exporter outside its selector",
            vec![
                exporter("qemu", "qemu", true),
                lease(
                    "pin-mismatch",
                    json!({"exporterRef": {"name": "qemu"},
                           "selector": {"matchLabels": {"board": "rpi"}}}),
                ),
            ],
            unsat("SelectorMismatch"),
            &["Requested exporter qemu does not match selector board=rpi"],
        ),
        case(
            Crd::Lease,
            "spec.duration not a duration",
            vec![lease(
                "dur-word",
                json!({"duration": "forever",
                "selector": {"matchLabels": {"board": "ctl"}}}),
            )],
            invalid("InvalidDuration"),
            &["spec.duration: invalid duration \"forever\""],
        ),
        case(
            Crd::Lease,
            "spec.duration negative",
            vec![lease(
                "dur-negative",
                json!({"duration": "-1h",
                "selector": {"matchLabels": {"board": "ctl"}}}),
            )],
            invalid("InvalidDuration"),
            &["is not positive; set a duration such as 1h"],
        ),
        case(
            Crd::Lease,
            "selector with an unknown operator",
            vec![lease(
                "sel-operator",
                json!({"selector": {"matchExpressions":
                [{"key": "board", "operator": "Equals", "values": ["ctl"]}]}}),
            )],
            invalid("InvalidSelector"),
            &["\"Equals\" is not a valid label selector operator"],
        ),
        case(
            Crd::Lease,
            "selector with a malformed label key",
            vec![lease(
                "sel-key",
                json!({"selector": {"matchLabels": {"board type!": "ctl"}}}),
            )],
            invalid("InvalidSelector"),
            &["key: Invalid value: \"board type!\""],
        ),
        case(
            Crd::Lease,
            "spec.beginTime after spec.endTime",
            vec![lease(
                "time-backwards",
                json!({"duration": null,
                "beginTime": "2030-01-02T00:00:00Z", "endTime": "2030-01-01T00:00:00Z",
                "selector": {"matchLabels": {"board": "ctl"}}}),
            )],
            invalid("InvalidTimeRange"),
            &[
                "is not before spec.endTime",
                "set an endTime after the beginTime",
            ],
        ),
        case(
            Crd::Lease,
            "spec.clientRef naming a Client that does not exist",
            vec![lease(
                "client-ghost",
                json!({"clientRef": {"name": "ghost"},
                "selector": {"matchLabels": {"board": "ctl"}}}),
            )],
            pending("ClientNotFound"),
            &[
                "Client ghost was not found",
                "create it or fix spec.clientRef.name",
            ],
        ),
        case(
            Crd::Lease,
            "spec.clientRef.name empty",
            vec![lease(
                "client-empty",
                json!({"clientRef": {"name": ""},
                "selector": {"matchLabels": {"board": "ctl"}}}),
            )],
            pending("ClientNotFound"),
            &["spec.clientRef.name is empty"],
        ),
        case(
            Crd::Lease,
            "only exporter offline",
            vec![
                exporter("asleep", "asleep", true),
                lease(
                    "offline",
                    json!({"selector": {"matchLabels": {"board": "asleep"}}}),
                ),
            ],
            pending("Offline"),
            &["none of them are online"],
        ),
        // ExporterAccessPolicies that can never approve: named in the lease's NoAccess.
        case(
            Crd::AccessPolicy,
            "policy with an unparsable maximumDuration",
            vec![
                exporter("gated", "gated", true),
                obj(
                    Crd::AccessPolicy,
                    "bad-duration",
                    json!({"exporterSelector": {"matchLabels": {"board": "gated"}},
                           "policies": [{"maximumDuration": "a week", "from": [{"clientSelector": {}}]}]}),
                ),
                lease(
                    "policy-duration",
                    json!({"selector": {"matchLabels": {"board": "gated"}}}),
                ),
            ],
            unsat("NoAccess"),
            &["bad-duration: spec.policies[0].maximumDuration \"a week\" is not a duration"],
        ),
        case(
            Crd::AccessPolicy,
            "policy with a malformed client selector",
            vec![
                exporter("typo", "typo", true),
                obj(
                    Crd::AccessPolicy,
                    "bad-selector",
                    json!({"exporterSelector": {"matchLabels": {"board": "typo"}},
                           "policies": [{"from": [{"clientSelector": {"matchExpressions":
                               [{"key": "team", "operator": "In"}]}}]}]}),
                ),
                lease(
                    "policy-selector",
                    json!({"selector": {"matchLabels": {"board": "typo"}}}),
                ),
            ],
            unsat("NoAccess"),
            &["bad-selector: spec.policies[0].from[0].clientSelector: values: Invalid value: []"],
        ),
        // MiroirSnapshot and MiroirVolume.
        case(
            Crd::Snapshot,
            "spec.volumeName naming no MiroirVolume",
            vec![(
                Crd::Snapshot,
                json!({"metadata": {"name": format!("{u}-novol")},
                       "spec": {"volumeName": format!("{u}-absent")}}),
            )],
            ready_false("VolumeNotFound"),
            &["not found; create it or delete this snapshot"],
        ),
        case(
            Crd::Volume,
            "volume with no diskful replica",
            vec![
                (
                    Crd::Volume,
                    json!({"metadata": {"name": format!("{u}-tb")},
                           "spec": {"sizeBytes": 4096,
                                    "replicas": [{"node": format!("{u}-tb"), "diskless": true}]}}),
                ),
                (
                    Crd::Snapshot,
                    json!({"metadata": {"name": format!("{u}-tb")},
                           "spec": {"volumeName": format!("{u}-tb")}}),
                ),
            ],
            ready_false("WaitingForReplicas"),
            &["has no diskful replica; nothing to cut"],
        ),
        case(
            Crd::Volume,
            "replica node name too long for its teardown finalizer",
            vec![
                (
                    Crd::Volume,
                    json!({"metadata": {"name": format!("{u}-longnode")},
                           "spec": {"sizeBytes": 4096,
                                    "replicas": [{"node": "n".repeat(60), "backend": "zfs"}]}}),
                ),
                (
                    Crd::Snapshot,
                    json!({"metadata": {"name": format!("{u}-longnode")},
                           "spec": {"volumeName": format!("{u}-longnode")}}),
                ),
            ],
            ready_false("InvalidVolume"),
            &[
                "cannot carry the teardown finalizer",
                "fix the volume's spec.replicas",
            ],
        ),
        case(
            Crd::Volume,
            "replica on a node with no snapshot agent",
            vec![
                (
                    Crd::Volume,
                    json!({"metadata": {"name": format!("{u}-noagent")},
                           "spec": {"sizeBytes": 4096,
                                    "replicas": [{"node": dead_node, "backend": "loopfile"}]}}),
                ),
                (
                    Crd::Snapshot,
                    json!({"metadata": {"name": format!("{u}-noagent")},
                           "spec": {"volumeName": format!("{u}-noagent")}}),
                ),
            ],
            ready_false("WaitingForReplicas"),
            &[
                "no snapshot agent heartbeat",
                "is ucm snapshot-agent running there?",
            ],
        ),
        // VirtualMachineExports.
        case(
            Crd::VmExport,
            "source kind Pod",
            vec![vme(
                "kind-pod",
                json!({"source": {"kind": "Pod", "name": "p"}}),
            )],
            ready_false("UnsupportedSource"),
            &[
                "source kind \"Pod\" in API group \"core\" is not supported",
                "supported sources are",
            ],
        ),
        case(
            Crd::VmExport,
            "VirtualMachine of another API group",
            vec![vme(
                "kind-group",
                json!({"source": {"kind": "VirtualMachine",
                "apiGroup": "foo.io", "name": "vm"}}),
            )],
            ready_false("UnsupportedSource"),
            &["in API group \"foo.io\" is not supported"],
        ),
        case(
            Crd::VmExport,
            "source kind in lower case",
            vec![vme(
                "kind-case",
                json!({"source": {"kind": "persistentvolumeclaim", "name": "p"}}),
            )],
            ready_false("UnsupportedSource"),
            &["PersistentVolumeClaim (core group)"],
        ),
        case(
            Crd::VmExport,
            "PersistentVolumeClaim that does not exist",
            vec![vme(
                "pvc-missing",
                json!({"source": {"kind": "PersistentVolumeClaim",
                "name": "missing"}}),
            )],
            ("PVCReady", "False", "PVCNotFound"),
            &[&format!("PersistentVolumeClaim {ns}/missing not found")],
        ),
        case(
            Crd::VmExport,
            "PersistentVolumeClaim in use by another Pod",
            vec![
                pvc("busy"),
                (
                    Crd::Pod,
                    json!({"metadata": {"name": "user"},
                           "spec": {"containers": [{"name": "c", "image": "busybox"}],
                                    "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "busy"}}]}}),
                ),
                vme(
                    "pvc-busy",
                    json!({"source": {"kind": "PersistentVolumeClaim", "name": "busy"}}),
                ),
            ],
            ready_false("InUse"),
            &[&format!("PersistentVolumeClaim {ns}/busy is in use")],
        ),
        case(
            Crd::VmExport,
            "tokenSecretRef not a Secret name",
            vec![
                pvc("tok-bad"),
                vme(
                    "token-bad",
                    json!({"source": {"kind": "PersistentVolumeClaim", "name": "tok-bad"},
                    "tokenSecretRef": "My_Token"}),
                ),
            ],
            ready_false("InvalidTokenSecretRef"),
            &[
                "\"My_Token\" is not a valid Secret name",
                "delete this export",
            ],
        ),
        case(
            Crd::VmExport,
            "tokenSecretRef empty",
            vec![
                pvc("tok-empty"),
                vme(
                    "token-empty",
                    json!({"source": {"kind": "PersistentVolumeClaim", "name": "tok-empty"},
                    "tokenSecretRef": ""}),
                ),
            ],
            ready_false("InvalidTokenSecretRef"),
            &["leave tokenSecretRef out to get a generated token"],
        ),
    ]
}
