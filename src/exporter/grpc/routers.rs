//! Which router a Dial names (docs/exporter.md, "Dial and Listen", "Routers that drain"): the
//! ConfigMap's `router` entries when there are any; else, with `--exporter-router-service`, one
//! ready router Pod of that Service, by its address; else `--exporter-router-endpoint`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tracing::debug;

use crate::exporter::config::{self, RouterEntry};

pub struct Routers {
    /// `--exporter-router-endpoint`.
    fallback: String,
    /// The router Pods of `--exporter-router-service`, when set.
    pods: Option<(Api<EndpointSlice>, String, Store<EndpointSlice>)>,
    writer: std::sync::Mutex<Option<reflector::store::Writer<EndpointSlice>>>,
    /// Round robin over the ready routers.
    next: AtomicUsize,
}

impl Routers {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        fallback: String,
        service: Option<String>,
    ) -> Arc<Routers> {
        let (store, writer) = reflector::store();
        Arc::new(Routers {
            fallback,
            pods: service.map(|s| (Api::namespaced(client, namespace), s, store)),
            writer: std::sync::Mutex::new(Some(writer)),
            next: AtomicUsize::new(0),
        })
    }

    /// Keeps the router Service's EndpointSlices until `stop` (nothing without the Service).
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let (Some((api, service, _)), Some(writer)) =
            (&self.pods, self.writer.lock().expect("routers").take())
        else {
            return;
        };
        let cfg =
            watcher::Config::default().labels(&format!("kubernetes.io/service-name={service}"));
        let events = watcher::watcher(api.clone(), cfg)
            .default_backoff()
            .reflect(writer)
            .touched_objects();
        tokio::pin!(events);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                ev = events.next() => match ev {
                    Some(Ok(_)) => {}
                    Some(Err(e)) => debug!(error = %e, "router EndpointSlice watch: retrying"),
                    None => return,
                },
            }
        }
    }

    /// The router for an exporter with `labels`. `UNAVAILABLE` (which jmp retries) when the
    /// Service has no ready router.
    pub fn choose(
        &self,
        entries: &BTreeMap<String, RouterEntry>,
        labels: &BTreeMap<String, String>,
    ) -> Result<String, Status> {
        if let Some(e) = config::choose_router(entries, labels) {
            return Ok(e.to_string());
        }
        let Some((_, service, store)) = &self.pods else {
            return Ok(self.fallback.clone());
        };
        let ready = ready_routers(&store.state());
        if ready.is_empty() {
            return Err(Status::unavailable(format!(
                "no router of Service {service} is ready; retry later"
            )));
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % ready.len();
        Ok(ready[i].clone())
    }
}

/// `ip:port` of every endpoint that is ready and not terminating (a router that drains is
/// terminating from its Pod's deletion on, before it even gets SIGTERM), sorted. The port is the
/// one named `grpc`, else the first.
pub fn ready_routers(slices: &[Arc<EndpointSlice>]) -> Vec<String> {
    let mut out = Vec::new();
    for s in slices {
        let ports = s.ports.as_deref().unwrap_or_default();
        let Some(port) = ports
            .iter()
            .find(|p| p.name.as_deref() == Some("grpc"))
            .or(ports.first())
            .and_then(|p| p.port)
        else {
            continue;
        };
        let v6 = s.address_type == "IPv6";
        for e in s.endpoints.iter().flatten() {
            let c = e.conditions.as_ref();
            // Absent `ready` means ready (the API's rule).
            let ready = c.and_then(|c| c.ready).unwrap_or(true);
            let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
            if !ready || terminating {
                continue;
            }
            if let Some(ip) = e.addresses.first() {
                out.push(if v6 {
                    format!("[{ip}]:{port}")
                } else {
                    format!("{ip}:{port}")
                });
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice(v: serde_json::Value) -> Arc<EndpointSlice> {
        Arc::new(serde_json::from_value(v).unwrap())
    }

    #[test]
    fn only_ready_routers_that_do_not_drain_are_named() {
        let s = slice(json!({
            "metadata": {"name": "ucm-router-abc"},
            "addressType": "IPv4",
            "ports": [{"name": "metrics", "port": 8080}, {"name": "grpc", "port": 8083}],
            "endpoints": [
                {"addresses": ["10.0.0.2"], "conditions": {"ready": true, "serving": true, "terminating": false}},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": false, "serving": true, "terminating": true}},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": false}},
                {"addresses": ["10.0.0.1"]},
            ],
        }));
        let v6 = slice(json!({
            "metadata": {"name": "ucm-router-v6"},
            "addressType": "IPv6",
            "ports": [{"port": 8083}],
            "endpoints": [{"addresses": ["fd00::5"], "conditions": {"ready": true}}],
        }));
        assert_eq!(
            ready_routers(&[s, v6]),
            ["10.0.0.1:8083", "10.0.0.2:8083", "[fd00::5]:8083"]
        );
        let no_ports = slice(json!({
            "metadata": {"name": "x"}, "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.9"]}],
        }));
        assert!(ready_routers(&[no_ports]).is_empty());
    }

    #[tokio::test]
    async fn entries_win_then_ready_pods_in_turn_then_unavailable() {
        let client =
            kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap()))
                .unwrap();
        let none: BTreeMap<String, RouterEntry> = BTreeMap::new();
        let labels: BTreeMap<String, String> = BTreeMap::new();
        let plain = Routers::new(client.clone(), "ns", "r.svc:8083".into(), None);
        assert_eq!(plain.choose(&none, &labels).unwrap(), "r.svc:8083");

        let pods = Routers::new(client, "ns", "r.svc:8083".into(), Some("r".into()));
        let err = pods.choose(&none, &labels).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable);
        let mut w = pods.writer.lock().unwrap().take().unwrap();
        let mut s = (*slice(json!({
            "metadata": {"name": "r-1", "namespace": "ns"},
            "addressType": "IPv4",
            "ports": [{"name": "grpc", "port": 8083}],
            "endpoints": [{"addresses": ["10.0.0.2"]}, {"addresses": ["10.0.0.3"]}],
        })))
        .clone();
        w.apply_watcher_event(&watcher::Event::Apply(s.clone()));
        let picks: Vec<String> = (0..4)
            .map(|_| pods.choose(&none, &labels).unwrap())
            .collect();
        assert_eq!(picks.iter().filter(|p| *p == "10.0.0.2:8083").count(), 2);
        assert_eq!(picks.iter().filter(|p| *p == "10.0.0.3:8083").count(), 2);
        // One drains: only the other is named.
        s.endpoints.as_mut().unwrap()[0].conditions =
            Some(serde_json::from_value(json!({"ready": false, "terminating": true})).unwrap());
        w.apply_watcher_event(&watcher::Event::Apply(s));
        for _ in 0..3 {
            assert_eq!(pods.choose(&none, &labels).unwrap(), "10.0.0.3:8083");
        }
        let entries: BTreeMap<String, RouterEntry> =
            serde_json::from_value(json!({"default": {"endpoint": "router.example:443"}})).unwrap();
        assert_eq!(
            pods.choose(&entries, &labels).unwrap(),
            "router.example:443"
        );
    }
}
