//! What tests read back: status conditions, an Exporter's status, Prometheus metrics, the admin
//! endpoints over HTTP, YAML streams.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{
    Api,
    api::{Patch, PatchParams},
};
use ucm::exporter::crd::{Exporter, ExporterStatusValue};

/// A minimal HTTP/1.1 GET over loopback (the admin endpoints are plain HTTP).
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .ok()?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&buf).to_string();
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    Some((code, dechunk(&body)))
}

fn dechunk(body: &str) -> String {
    // axum answers small bodies with Content-Length; chunked bodies are rare here but handled.
    let mut out = String::new();
    let mut rest = body;
    loop {
        let Some((size_line, after)) = rest.split_once("\r\n") else {
            return body.to_string();
        };
        let Ok(size) = usize::from_str_radix(size_line.trim(), 16) else {
            return body.to_string();
        };
        if size == 0 {
            return out;
        }
        if after.len() < size {
            return body.to_string();
        }
        out.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
}

/// Condition `t` of a status's condition list.
pub fn find_condition(conds: Option<&Vec<Condition>>, t: &str) -> Option<Condition> {
    conds?.iter().find(|c| c.type_ == t).cloned()
}

/// Condition `t` of a status's condition list as (status, reason, message).
pub fn condition(conds: Option<&Vec<Condition>>, t: &str) -> Option<(String, String, String)> {
    find_condition(conds, t).map(|c| (c.status, c.reason, c.message))
}

/// [`condition`] of an Exporter.
pub fn exporter_condition(e: &Exporter, t: &str) -> Option<(String, String, String)> {
    condition(e.status.as_ref()?.conditions.as_ref(), t)
}

/// An Exporter's `status.exporterStatus`.
pub fn exporter_status(e: &Exporter) -> Option<ExporterStatusValue> {
    e.status.as_ref().and_then(|s| s.exporter_status)
}

/// What `jmp` and a user see as serving: Available, Online and Registered.
pub fn exporter_available(e: &Exporter) -> bool {
    exporter_status(e) == Some(ExporterStatusValue::Available)
        && exporter_condition(e, "Online").is_some_and(|c| c.0 == "True")
        && exporter_condition(e, "Registered").is_some_and(|c| c.0 == "True")
}

pub fn now_rfc3339() -> String {
    jiff::fmt::strtime::format("%Y-%m-%dT%H:%M:%SZ", jiff::Timestamp::now()).unwrap()
}

/// The status an exporter reports (`lastSeen` now), as the gRPC service writes it.
pub async fn report(exporters: &Api<Exporter>, name: &str, status: &str, message: &str) {
    let patch = serde_json::json!({"status": {"lastSeen": now_rfc3339(), "devices": [],
                                  "exporterStatus": status, "statusMessage": message}});
    exporters
        .patch_status(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
}

/// What the gRPC service writes on Register + ReportStatus(AVAILABLE).
pub async fn report_available(exporters: &Api<Exporter>, name: &str) {
    report(exporters, name, "Available", "Available").await;
}

/// The sum of the samples of metric `family` whose labels include every `want` pair.
pub fn metric(text: &str, family: &str, want: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (head, value) = l.rsplit_once(' ')?;
            let (name, labels) = match head.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (head, ""),
            };
            let matches = name == family
                && want
                    .iter()
                    .all(|(k, v)| labels.split(',').any(|pair| pair == format!("{k}=\"{v}\"")));
            matches.then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

/// Every YAML document of a multi-document stream, as JSON values (empty documents dropped).
pub fn yaml_docs(text: &str) -> Vec<serde_json::Value> {
    serde_saphyr::from_str_multiple::<serde_json::Value, Vec<_>>(text)
        .unwrap_or_else(|e| panic!("bad YAML: {e}\n{text}"))
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}
