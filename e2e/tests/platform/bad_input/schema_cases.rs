//! The schema table: for every CRD ucm installs, every invalid shape its schema must refuse, with
//! the text the API server must answer. Messages come from the seeds and specs (CEL messages word
//! for word) or are the API server's own wording for the OpenAPI keyword the seed implies
//! (required, enum, pattern, maxLength, format, type, minimum, maxItems).

use serde_json::{Value, json};

use super::{Case, Crd, Op};

/// A valid metav1 Condition (the seed's schema), to break one field at a time.
fn condition() -> Value {
    json!({"type": "Ready", "status": "False", "reason": "Because", "message": "m",
           "lastTransitionTime": "2025-01-01T00:00:00Z", "observedGeneration": 1})
}

fn with(mut v: Value, key: &str, value: Value) -> Value {
    if value.is_null() {
        v.as_object_mut().unwrap().remove(key);
    } else {
        v[key] = value;
    }
    v
}

/// The metav1 Condition rules (seed: type ≤ 316 with its pattern, status enum, reason 1–1024
/// with its pattern, message ≤ 32768, lastTransitionTime date-time, observedGeneration ≥ 0,
/// five required fields), as status patches of `crd`. `extra` is merged into every status
/// (Lease status requires `ended`).
fn condition_cases(crd: Crd, extra: Value) -> Vec<Case> {
    let status = |c: Value| {
        let mut s = extra.clone();
        s["conditions"] = json!([c]);
        Op::Status(json!({ "status": s }))
    };
    let c = condition;
    let p = "status.conditions[0]";
    vec![
        Case::new(
            crd,
            "condition status outside True/False/Unknown",
            status(with(c(), "status", json!("Maybe"))),
            &format!("{p}.status: Unsupported value: \"Maybe\""),
        ),
        Case::new(
            crd,
            "condition status in lower case",
            status(with(c(), "status", json!("true"))),
            &format!("{p}.status: Unsupported value: \"true\""),
        ),
        Case::new(
            crd,
            "condition reason not CamelCase (pattern)",
            status(with(c(), "reason", json!("not a reason!"))),
            &format!("{p}.reason in body should match"),
        ),
        Case::new(
            crd,
            "condition reason empty (minLength 1)",
            status(with(c(), "reason", json!(""))),
            &format!("{p}.reason in body should be at least 1 chars long"),
        ),
        Case::new(
            crd,
            "condition reason over 1024 characters",
            status(with(c(), "reason", json!("R".repeat(1025)))),
            &format!("{p}.reason: Too long: may not be more than 1024 bytes"),
        ),
        Case::new(
            crd,
            "condition type with spaces (pattern)",
            status(with(c(), "type", json!("bad type"))),
            &format!("{p}.type in body should match"),
        ),
        Case::new(
            crd,
            "condition type over 316 characters",
            status(with(c(), "type", json!("T".repeat(317)))),
            &format!("{p}.type: Too long: may not be more than 316 bytes"),
        ),
        Case::new(
            crd,
            "condition message over 32768 characters",
            status(with(c(), "message", json!("m".repeat(32769)))),
            &format!("{p}.message: Too long: may not be more than 32768 bytes"),
        ),
        Case::new(
            crd,
            "condition lastTransitionTime not a date-time",
            status(with(c(), "lastTransitionTime", json!("yesterday"))),
            &format!("{p}.lastTransitionTime in body must be of type date-time"),
        ),
        Case::new(
            crd,
            "condition observedGeneration negative",
            status(with(c(), "observedGeneration", json!(-1))),
            &format!("{p}.observedGeneration in body should be greater than or equal to 0"),
        ),
        Case::new(
            crd,
            "condition observedGeneration not an integer",
            status(with(c(), "observedGeneration", json!("one"))),
            &format!("{p}.observedGeneration in body must be of type integer"),
        ),
        Case::new(
            crd,
            "condition without type",
            status(with(c(), "type", Value::Null)),
            &format!("{p}.type: Required value"),
        ),
        Case::new(
            crd,
            "condition without reason",
            status(with(c(), "reason", Value::Null)),
            &format!("{p}.reason: Required value"),
        ),
        Case::new(
            crd,
            "condition without message",
            status(with(c(), "message", Value::Null)),
            &format!("{p}.message: Required value"),
        ),
        Case::new(
            crd,
            "condition without lastTransitionTime",
            status(with(c(), "lastTransitionTime", Value::Null)),
            &format!("{p}.lastTransitionTime: Required value"),
        ),
        Case::new(
            crd,
            "conditions not a list",
            Op::Status(json!({"status": with(extra.clone(), "conditions", json!("Ready"))})),
            "status.conditions in body must be of type array",
        ),
    ]
}

/// Cases every CRD shares: an invalid object name, a wrong-typed spec, and (where the schema is
/// structural without preserve-unknown-fields) a misspelt field under strict field validation,
/// which is what kubectl sends.
fn common_cases(crd: Crd, typo: Option<(Value, &str)>) -> Vec<Case> {
    let mut v = vec![
        Case::new(
            crd,
            "object name not a DNS subdomain",
            Op::Create(json!({"metadata": {"name": "Bad_Name"}, "spec": crd.minimal_spec()})),
            "a lowercase RFC 1123 subdomain must consist of",
        ),
        Case::new(
            crd,
            "object name over 253 characters",
            Op::Create(json!({"metadata": {"name": "n".repeat(254)}, "spec": crd.minimal_spec()})),
            "must be no more than 253 characters",
        ),
        Case::new(
            crd,
            "spec a string",
            Op::Create(json!({"spec": "enabled"})),
            "spec in body must be of type object",
        ),
    ];
    if let Some((spec, field)) = typo {
        v.push(Case::new(
            crd,
            "misspelt field (strict field validation)",
            Op::Create(json!({ "spec": spec })),
            &format!("unknown field \"{field}\""),
        ));
    }
    v
}

fn exporter() -> Vec<Case> {
    let c = Crd::Exporter;
    let st = |s: Value| Op::Status(json!({ "status": s }));
    let hook = |h: Value| st(json!({"leaseHooks": {"afterLease": h}}));
    let mut v = common_cases(c, Some((json!({"enabeld": false}), "spec.enabeld")));
    v.extend([
        Case::new(
            c,
            "spec.enabled a string",
            Op::Create(json!({"spec": {"enabled": "yes"}})),
            "spec.enabled in body must be of type boolean",
        ),
        Case::new(
            c,
            "spec.username a number",
            Op::Create(json!({"spec": {"username": 7}})),
            "spec.username in body must be of type string",
        ),
        Case::new(
            c,
            "status.exporterStatus outside the 8 values",
            st(json!({"exporterStatus": "Dancing"})),
            "status.exporterStatus: Unsupported value: \"Dancing\"",
        ),
        Case::new(
            c,
            "status.exporterStatus in the wire's SCREAMING case",
            st(json!({"exporterStatus": "EXPORTER_STATUS_AVAILABLE"})),
            "status.exporterStatus: Unsupported value: \"EXPORTER_STATUS_AVAILABLE\"",
        ),
        Case::new(
            c,
            "status.leaseHooks.afterLease.phase outside the 4 values",
            hook(json!({"phase": "Maybe"})),
            "status.leaseHooks.afterLease.phase: Unsupported value: \"Maybe\"",
        ),
        Case::new(
            c,
            "status.leaseHooks.beforeLease.onFailure outside warn/endLease/exit",
            st(json!({"leaseHooks": {"beforeLease": {"phase": "Running", "onFailure": "panic"}}})),
            "status.leaseHooks.beforeLease.onFailure: Unsupported value: \"panic\"",
        ),
        Case::new(
            c,
            "status.leaseHooks.afterLease without phase",
            hook(json!({"attempts": 1})),
            "status.leaseHooks.afterLease.phase: Required value",
        ),
        Case::new(
            c,
            "status.leaseHooks.afterLease.attempts a string",
            hook(json!({"phase": "Running", "attempts": "two"})),
            "status.leaseHooks.afterLease.attempts in body must be of type integer",
        ),
        Case::new(
            c,
            "status.leaseHooks.afterLease.lastTransitionTime not a date-time",
            hook(json!({"phase": "Running", "lastTransitionTime": "now"})),
            "status.leaseHooks.afterLease.lastTransitionTime in body must be of type date-time",
        ),
        Case::new(
            c,
            "status.lastSeen not a date-time",
            st(json!({"lastSeen": "never"})),
            "status.lastSeen in body must be of type date-time",
        ),
        Case::new(
            c,
            "status.tokenExpiresAt not a date-time",
            st(json!({"tokenExpiresAt": "2025-13-45"})),
            "status.tokenExpiresAt in body must be of type date-time",
        ),
        Case::new(
            c,
            "status.devices not a list",
            st(json!({"devices": "d1"})),
            "status.devices in body must be of type array",
        ),
        Case::new(
            c,
            "status.devices[].labels with a numeric value",
            st(json!({"devices": [{"uuid": "d1", "labels": {"a": 1}}]})),
            "status.devices[0].labels.a in body must be of type string",
        ),
        Case::new(
            c,
            "status.recordsLeaseHooks a string",
            st(json!({"recordsLeaseHooks": "yes"})),
            "status.recordsLeaseHooks in body must be of type boolean",
        ),
        Case::new(
            c,
            "status.credential a string",
            st(json!({"credential": "base-exporter"})),
            "status.credential in body must be of type object",
        ),
    ]);
    v.extend(condition_cases(c, json!({})));
    v
}

fn lease() -> Vec<Case> {
    let c = Crd::Lease;
    let ok = || {
        json!({"clientRef": {"name": "c"}, "duration": "1h",
               "selector": {"matchLabels": {"board": "none"}}})
    };
    let create = |patch: Value| {
        let mut s = ok();
        json_patch::merge(&mut s, &patch);
        Op::Create(json!({ "spec": s }))
    };
    let st = |s: Value| Op::Status(json!({ "status": s }));
    let tags: serde_json::Map<_, _> = (0..11).map(|i| (format!("k{i}"), json!("v"))).collect();
    let context: serde_json::Map<_, _> = (0..9).map(|i| (format!("k{i}"), json!("v"))).collect();
    let mut v = common_cases(
        c,
        Some((
            json!({"clientref": {"name": "c"}, "clientRef": {"name": "c"},
                   "selector": {"matchLabels": {"a": "b"}}}),
            "spec.clientref",
        )),
    );
    v.extend([
        Case::new(
            c,
            "no spec.clientRef",
            Op::Create(json!({"spec": {"selector": {"matchLabels": {"a": "b"}}}})),
            "spec.clientRef: Required value",
        ),
        Case::new(
            c,
            "neither selector nor exporterRef",
            Op::Create(json!({"spec": {"clientRef": {"name": "c"}, "duration": "1h"}})),
            "one of selector or exporterRef.name is required",
        ),
        Case::new(
            c,
            "empty selector and empty exporterRef.name",
            Op::Create(json!({"spec": {"clientRef": {"name": "c"}, "selector": {},
                                       "exporterRef": {"name": ""}}})),
            "one of selector or exporterRef.name is required",
        ),
        Case::new(
            c,
            "11 tags (at most 10)",
            create(json!({ "tags": tags })),
            "spec.tags: Too many: 11: must have at most 10 items",
        ),
        Case::new(
            c,
            "9 context entries (at most 8)",
            create(json!({ "context": context })),
            "spec.context: Too many: 9: must have at most 8 items",
        ),
        Case::new(
            c,
            "context key over 32 characters",
            create(json!({"context": {"k".repeat(33): "v"}})),
            "context keys max 32 chars, values max 64 chars",
        ),
        Case::new(
            c,
            "context value over 64 characters",
            create(json!({"context": {"k": "v".repeat(65)}})),
            "context keys max 32 chars, values max 64 chars",
        ),
        Case::new(
            c,
            "tags a list",
            create(json!({"tags": ["a"]})),
            "spec.tags in body must be of type object",
        ),
        Case::new(
            c,
            "tag value a number",
            create(json!({"tags": {"a": 1}})),
            "spec.tags.a in body must be of type string",
        ),
        Case::new(
            c,
            "spec.beginTime not a date-time",
            create(json!({"beginTime": "tomorrow"})),
            "spec.beginTime in body must be of type date-time",
        ),
        Case::new(
            c,
            "spec.endTime not a date-time",
            create(json!({"endTime": "2025-02-30T00:00:00Z"})),
            "spec.endTime in body must be of type date-time",
        ),
        Case::new(
            c,
            "spec.duration a number of seconds",
            create(json!({"duration": 3600})),
            "spec.duration in body must be of type string",
        ),
        Case::new(
            c,
            "spec.release a string",
            create(json!({"release": "yes"})),
            "spec.release in body must be of type boolean",
        ),
        Case::new(
            c,
            "spec.allowDisabled a string",
            create(json!({"allowDisabled": "no"})),
            "spec.allowDisabled in body must be of type boolean",
        ),
        Case::new(
            c,
            "selector expression without operator",
            create(json!({"selector": {"matchExpressions": [{"key": "a"}]}})),
            "spec.selector.matchExpressions[0].operator: Required value",
        ),
        Case::new(
            c,
            "selector expression without key",
            create(json!({"selector": {"matchExpressions": [{"operator": "Exists"}]}})),
            "spec.selector.matchExpressions[0].key: Required value",
        ),
        Case::new(
            c,
            "selector matchLabels value a number",
            create(json!({"selector": {"matchLabels": {"a": 1}}})),
            "spec.selector.matchLabels.a in body must be of type string",
        ),
        Case::new(
            c,
            "clientRef a string",
            create(json!({"clientRef": "c"})),
            "spec.clientRef in body must be of type object",
        ),
        Case::new(
            c,
            "tags edited after creation",
            Op::Patch(json!({"spec": {"tags": {"team": "b"}}})),
            "tags are immutable after creation",
        ),
        Case::new(
            c,
            "a tag added after creation",
            Op::Patch(json!({"spec": {"tags": {"extra": "x"}}})),
            "tags are immutable after creation",
        ),
        Case::new(
            c,
            "tags removed after creation",
            Op::Patch(json!({"spec": {"tags": null}})),
            "tags are immutable after creation",
        ),
        Case::new(
            c,
            "context edited after creation",
            Op::Patch(json!({"spec": {"context": {"ticket": "T-2"}}})),
            "context is immutable after creation",
        ),
        Case::new(
            c,
            "context removed after creation",
            Op::Patch(json!({"spec": {"context": null}})),
            "context is immutable after creation",
        ),
        Case::new(
            c,
            "status without ended",
            st(json!({"ended": null})),
            "status.ended: Required value",
        ),
        Case::new(
            c,
            "status.ended a string",
            st(json!({"ended": "no"})),
            "status.ended in body must be of type boolean",
        ),
        Case::new(
            c,
            "status.priority a string",
            st(json!({"ended": true, "priority": "high"})),
            "status.priority in body must be of type integer",
        ),
        Case::new(
            c,
            "status.beginTime not a date-time",
            st(json!({"ended": true, "beginTime": "soon"})),
            "status.beginTime in body must be of type date-time",
        ),
    ]);
    v.extend(condition_cases(c, json!({"ended": true})));
    v
}

fn client() -> Vec<Case> {
    let c = Crd::Client;
    let st = |s: Value| Op::Status(json!({ "status": s }));
    let mut v = common_cases(c, Some((json!({"userName": "u"}), "spec.userName")));
    v.extend([
        Case::new(
            c,
            "spec.username a list",
            Op::Create(json!({"spec": {"username": ["u"]}})),
            "spec.username in body must be of type string",
        ),
        Case::new(
            c,
            "status.tokenExpiresAt not a date-time",
            st(json!({"tokenExpiresAt": "in a year"})),
            "status.tokenExpiresAt in body must be of type date-time",
        ),
        Case::new(
            c,
            "status.credential.name a number",
            st(json!({"credential": {"name": 1}})),
            "status.credential.name in body must be of type string",
        ),
        Case::new(
            c,
            "status.endpoint a list",
            st(json!({"endpoint": ["a"]})),
            "status.endpoint in body must be of type string",
        ),
    ]);
    v.extend(condition_cases(c, json!({})));
    v
}

fn access_policy() -> Vec<Case> {
    let c = Crd::AccessPolicy;
    let policy = |p: Value| Op::Create(json!({"spec": {"policies": [p]}}));
    let mut v = common_cases(
        c,
        Some((
            json!({"policies": [{"priorty": 1}]}),
            "spec.policies[0].priorty",
        )),
    );
    v.extend([
        Case::new(
            c,
            "policies[].priority a word",
            policy(json!({"priority": "high"})),
            "spec.policies[0].priority in body must be of type integer",
        ),
        Case::new(
            c,
            "policies[].priority a fraction",
            policy(json!({"priority": 1.5})),
            "spec.policies[0].priority in body must be of type integer",
        ),
        Case::new(
            c,
            "policies[].spotAccess a string",
            policy(json!({"spotAccess": "yes"})),
            "spec.policies[0].spotAccess in body must be of type boolean",
        ),
        Case::new(
            c,
            "policies[].maximumDuration a number",
            policy(json!({"maximumDuration": 3600})),
            "spec.policies[0].maximumDuration in body must be of type string",
        ),
        Case::new(
            c,
            "policies not a list",
            Op::Create(json!({"spec": {"policies": "admins"}})),
            "spec.policies in body must be of type array",
        ),
        Case::new(
            c,
            "policies[].from not a list",
            policy(json!({"from": "admins"})),
            "spec.policies[0].from in body must be of type array",
        ),
        Case::new(
            c,
            "clientSelector expression without operator",
            policy(json!({"from": [{"clientSelector": {"matchExpressions": [{"key": "a"}]}}]})),
            "spec.policies[0].from[0].clientSelector.matchExpressions[0].operator: Required value",
        ),
        Case::new(
            c,
            "exporterSelector matchLabels value a boolean",
            Op::Create(json!({"spec": {"exporterSelector": {"matchLabels": {"a": true}}}})),
            "spec.exporterSelector.matchLabels.a in body must be of type string",
        ),
        Case::new(
            c,
            "exporterSelector expression values not a list",
            Op::Create(json!({"spec": {"exporterSelector": {"matchExpressions":
                    [{"key": "a", "operator": "In", "values": "x"}]}}})),
            "spec.exporterSelector.matchExpressions[0].values in body must be of type array",
        ),
    ]);
    v
}

fn snapshot() -> Vec<Case> {
    let c = Crd::Snapshot;
    let st = |s: Value| Op::Status(json!({ "status": s }));
    let mut v = common_cases(c, Some((json!({"volumename": "v"}), "spec.volumename")));
    v.extend([
        Case::new(
            c,
            "no spec",
            Op::Create(json!({})),
            "spec: Required value",
        ),
        Case::new(
            c,
            "no spec.volumeName",
            Op::Create(json!({"spec": {}})),
            "spec.volumeName: Required value",
        ),
        Case::new(
            c,
            "spec.volumeName empty",
            Op::Create(json!({"spec": {"volumeName": ""}})),
            "spec.volumeName in body should be at least 1 chars long",
        ),
        Case::new(
            c,
            "spec.volumeName a number",
            Op::Create(json!({"spec": {"volumeName": 42}})),
            "spec.volumeName in body must be of type string",
        ),
        Case::new(
            c,
            "spec.volumeName retargeted",
            Op::Patch(json!({"spec": {"volumeName": "elsewhere"}})),
            "volumeName is immutable: the snapshot's backend data lives on the volume it was cut from",
        ),
        Case::new(
            c,
            "status.perNode value outside Pending/Suspended/Done/Error",
            st(json!({"perNode": {"node-a": "Bogus"}})),
            "status.perNode.node-a: Unsupported value: \"Bogus\"",
        ),
        Case::new(
            c,
            "status.perNode value in lower case",
            st(json!({"perNode": {"node-a": "done"}})),
            "status.perNode.node-a: Unsupported value: \"done\"",
        ),
        Case::new(
            c,
            "status.perNode a list",
            st(json!({"perNode": ["node-a"]})),
            "status.perNode in body must be of type object",
        ),
        Case::new(
            c,
            "status.readyToUse a string",
            st(json!({"readyToUse": "true"})),
            "status.readyToUse in body must be of type boolean",
        ),
        Case::new(
            c,
            "status.ioSuspended a number",
            st(json!({"ioSuspended": 1})),
            "status.ioSuspended in body must be of type boolean",
        ),
        Case::new(
            c,
            "status.sizeBytes a quantity string",
            st(json!({"sizeBytes": "1Gi"})),
            "status.sizeBytes in body must be of type integer",
        ),
        Case::new(
            c,
            "status.sizeBytes a fraction",
            st(json!({"sizeBytes": 1.5})),
            "status.sizeBytes in body must be of type int64",
        ),
        Case::new(
            c,
            "status.sizeBytes beyond int64",
            st(json!({"sizeBytes": 1e25})),
            "status.sizeBytes in body must be of type int64",
        ),
        Case::new(
            c,
            "status.suspendedAt not a date-time",
            st(json!({"suspendedAt": "now"})),
            "status.suspendedAt in body must be of type date-time",
        ),
        Case::new(
            c,
            "status.sourceFormatted a string",
            st(json!({"sourceFormatted": "yes"})),
            "status.sourceFormatted in body must be of type boolean",
        ),
    ]);
    v.extend(condition_cases(c, json!({})));
    v
}

fn volume() -> Vec<Case> {
    let c = Crd::Volume;
    let spec = |s: Value| Op::Create(json!({ "spec": s }));
    let replica = |r: Value| spec(json!({"sizeBytes": 1024, "replicas": [r]}));
    // MiroirVolume keeps unknown fields (upstream's schema is a superset), so no typo case.
    let mut v = common_cases(c, None);
    v.extend([
        Case::new(c, "no spec", Op::Create(json!({})), "spec: Required value"),
        Case::new(
            c,
            "no spec.sizeBytes",
            spec(json!({"replicas": [{"node": "a"}]})),
            "spec.sizeBytes: Required value",
        ),
        Case::new(
            c,
            "spec.sizeBytes zero",
            spec(json!({"sizeBytes": 0})),
            "spec.sizeBytes in body should be greater than or equal to 1",
        ),
        Case::new(
            c,
            "spec.sizeBytes negative",
            spec(json!({"sizeBytes": -4096})),
            "spec.sizeBytes in body should be greater than or equal to 1",
        ),
        Case::new(
            c,
            "spec.sizeBytes a quantity string",
            spec(json!({"sizeBytes": "10Gi"})),
            "spec.sizeBytes in body must be of type integer",
        ),
        Case::new(
            c,
            "spec.sizeBytes a fraction",
            spec(json!({"sizeBytes": 1.5})),
            "spec.sizeBytes in body must be of type int64",
        ),
        Case::new(
            c,
            "spec.sizeBytes beyond int64",
            spec(json!({"sizeBytes": 1e25})),
            "spec.sizeBytes in body must be of type int64",
        ),
        Case::new(
            c,
            "no replicas in the list",
            spec(json!({"sizeBytes": 1024, "replicas": []})),
            "spec.replicas in body should have at least 1 items",
        ),
        Case::new(
            c,
            "four replicas (at most 3)",
            spec(json!({"sizeBytes": 1024, "replicas":
                [{"node": "a"}, {"node": "b"}, {"node": "c"}, {"node": "d"}]})),
            "spec.replicas: Too many: 4: must have at most 3 items",
        ),
        Case::new(
            c,
            "replica without node",
            replica(json!({"backend": "zfs"})),
            "spec.replicas[0].node: Required value",
        ),
        Case::new(
            c,
            "replica node a number",
            replica(json!({"node": 1})),
            "spec.replicas[0].node in body must be of type string",
        ),
        Case::new(
            c,
            "replica backend outside lvmthin/zfs/loopfile",
            replica(json!({"node": "a", "backend": "ext4"})),
            "spec.replicas[0].backend: Unsupported value: \"ext4\"",
        ),
        Case::new(
            c,
            "replica diskless a string",
            replica(json!({"node": "a", "diskless": "yes"})),
            "spec.replicas[0].diskless in body must be of type boolean",
        ),
        Case::new(
            c,
            "replicas not a list",
            spec(json!({"sizeBytes": 1024, "replicas": "a,b"})),
            "spec.replicas in body must be of type array",
        ),
        Case::new(
            c,
            "status.formatted a string",
            Op::Status(json!({"status": {"formatted": "yes"}})),
            "status.formatted in body must be of type boolean",
        ),
        Case::new(
            c,
            "status.perNode entry deviceCreated a string",
            Op::Status(json!({"status": {"perNode": {"a": {"deviceCreated": "yes"}}}})),
            "status.perNode.a.deviceCreated in body must be of type boolean",
        ),
    ]);
    v
}

fn vmexport() -> Vec<Case> {
    let c = Crd::VmExport;
    let pvc = || json!({"kind": "PersistentVolumeClaim", "name": "disk"});
    let ttl = |t: Value| Op::Create(json!({"spec": {"source": pvc(), "ttlDuration": t}}));
    let ttl_msg = "ttlDuration must be a non-negative duration such as 2h or 90m";
    let st = |s: Value| Op::Status(json!({ "status": s }));
    let link = |l: Value| st(json!({"links": {"internal": l}}));
    let mut v = common_cases(
        c,
        Some((
            json!({"source": pvc(), "ttlduration": "1h"}),
            "spec.ttlduration",
        )),
    );
    v.extend([
        Case::new(c, "no spec", Op::Create(json!({})), "spec: Required value"),
        Case::new(
            c,
            "no spec.source",
            Op::Create(json!({"spec": {"ttlDuration": "1h"}})),
            "spec.source: Required value",
        ),
        Case::new(
            c,
            "no source.kind",
            Op::Create(json!({"spec": {"source": {"name": "disk"}}})),
            "spec.source.kind: Required value",
        ),
        Case::new(
            c,
            "no source.name",
            Op::Create(json!({"spec": {"source": {"kind": "PersistentVolumeClaim"}}})),
            "spec.source.name: Required value",
        ),
        Case::new(
            c,
            "source.kind empty",
            Op::Create(json!({"spec": {"source": {"kind": "", "name": "disk"}}})),
            "spec.source.kind in body should be at least 1 chars long",
        ),
        Case::new(
            c,
            "source.name empty",
            Op::Create(json!({"spec": {"source": {"kind": "PersistentVolumeClaim", "name": ""}}})),
            "spec.source.name in body should be at least 1 chars long",
        ),
        Case::new(
            c,
            "source a string",
            Op::Create(json!({"spec": {"source": "pvc/disk"}})),
            "spec.source in body must be of type object",
        ),
        Case::new(
            c,
            "source.apiGroup a number",
            Op::Create(
                json!({"spec": {"source": {"kind": "VirtualMachine", "name": "vm", "apiGroup": 1}}}),
            ),
            "spec.source.apiGroup in body must be of type string",
        ),
        Case::new(
            c,
            "tokenSecretRef a boolean",
            Op::Create(json!({"spec": {"source": pvc(), "tokenSecretRef": true}})),
            "spec.tokenSecretRef in body must be of type string",
        ),
        Case::new(c, "ttlDuration negative", ttl(json!("-1s")), ttl_msg),
        Case::new(c, "ttlDuration not a duration", ttl(json!("forever")), ttl_msg),
        Case::new(c, "ttlDuration in days (not Go syntax)", ttl(json!("2d")), ttl_msg),
        Case::new(c, "ttlDuration empty", ttl(json!("")), ttl_msg),
        Case::new(c, "ttlDuration beyond Go's range", ttl(json!("9999999h")), ttl_msg),
        Case::new(
            c,
            "ttlDuration a number of seconds",
            ttl(json!(7200)),
            "spec.ttlDuration in body must be of type string",
        ),
        Case::new(
            c,
            "source.name changed after creation",
            Op::Patch(json!({"spec": {"source": {"name": "other"}}})),
            "spec is immutable after creation",
        ),
        Case::new(
            c,
            "ttlDuration changed after creation",
            Op::Patch(json!({"spec": {"ttlDuration": "10h"}})),
            "spec is immutable after creation",
        ),
        Case::new(
            c,
            "tokenSecretRef added after creation",
            Op::Patch(json!({"spec": {"tokenSecretRef": "mine"}})),
            "spec is immutable after creation",
        ),
        Case::new(
            c,
            "v1alpha1: spec changed after creation",
            Op::PatchAlpha(json!({"spec": {"source": {"kind": "VirtualMachine"}}})),
            "spec is immutable after creation",
        ),
        Case::new(
            c,
            "v1alpha1: source.name empty",
            Op::CreateAlpha(
                json!({"spec": {"source": {"kind": "PersistentVolumeClaim", "name": ""}}}),
            ),
            "spec.source.name in body should be at least 1 chars long",
        ),
        Case::new(
            c,
            "v1alpha1: ttlDuration negative",
            Op::CreateAlpha(json!({"spec": {"source": pvc(), "ttlDuration": "-5m"}})),
            ttl_msg,
        ),
        Case::new(
            c,
            "status condition without type",
            st(json!({"conditions": [{"status": "True"}]})),
            "status.conditions[0].type: Required value",
        ),
        Case::new(
            c,
            "status condition without status",
            st(json!({"conditions": [{"type": "Ready"}]})),
            "status.conditions[0].status: Required value",
        ),
        Case::new(
            c,
            "status condition lastTransitionTime not a date-time",
            st(json!({"conditions": [{"type": "Ready", "status": "True",
                                       "lastTransitionTime": "today"}]})),
            "status.conditions[0].lastTransitionTime in body must be of type date-time",
        ),
        Case::new(
            c,
            "status.ttlExpirationTime not a date-time",
            st(json!({"ttlExpirationTime": "in 2h"})),
            "status.ttlExpirationTime in body must be of type date-time",
        ),
        Case::new(
            c,
            "status.phase a number",
            st(json!({"phase": 3})),
            "status.phase in body must be of type string",
        ),
        Case::new(
            c,
            "status.links.internal without cert",
            link(json!({"volumes": []})),
            "status.links.internal.cert: Required value",
        ),
        Case::new(
            c,
            "status.links volume without name",
            link(json!({"cert": "", "volumes": [{"formats": []}]})),
            "status.links.internal.volumes[0].name: Required value",
        ),
        Case::new(
            c,
            "status.links two volumes with one name (map list)",
            link(json!({"cert": "", "volumes": [{"name": "d"}, {"name": "d"}]})),
            "status.links.internal.volumes[1]: Duplicate value",
        ),
        Case::new(
            c,
            "status.links format without url",
            link(json!({"cert": "", "volumes": [{"name": "d", "formats": [{"format": "raw"}]}]})),
            "status.links.internal.volumes[0].formats[0].url: Required value",
        ),
        Case::new(
            c,
            "status.links manifest without url",
            link(json!({"cert": "", "manifests": [{"type": "all"}]})),
            "status.links.internal.manifests[0].url: Required value",
        ),
    ]);
    v
}

/// Every case, in CRD order.
pub fn all() -> Vec<Case> {
    let mut v = exporter();
    v.extend(lease());
    v.extend(client());
    v.extend(access_policy());
    v.extend(snapshot());
    v.extend(volume());
    v.extend(vmexport());
    v
}
