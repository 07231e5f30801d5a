//! Phase `objects` (docs/vmexport.md, "Performance goals": P3, time to objects): 50 PVC exports
//! created one after another against a warm manager, each on its own Bound PVC. The clock starts at
//! the create call and stops when a watch has seen all four children: the Service, the token
//! Secret, the serving-certificate Secret and the export-server Pod. Goal: p95 under 100 ms.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret, Service};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use ucm::vmexport::naming;
use ucm::vmexport::types::VirtualMachineExport;

use crate::Ctx;
use crate::report::{Figure, median, percentile};

const PHASE: &str = "objects";
const NS: &str = "bench-objects";
const EXPORTS: usize = 50;

/// First time each object name of kind `K` in the namespace was seen by a watch.
fn seen<K>(
    client: &Client,
    times: Arc<Mutex<HashMap<String, Instant>>>,
) -> tokio::task::JoinHandle<()>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
{
    let api: Api<K> = Api::namespaced(client.clone(), NS);
    tokio::spawn(async move {
        let stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .touched_objects();
        futures::pin_mut!(stream);
        while let Some(Ok(o)) = stream.next().await {
            let now = Instant::now();
            times
                .lock()
                .unwrap()
                .entry(format!("{}/{}", K::kind(&()), o.name_any()))
                .or_insert(now);
        }
    })
}

async fn bound_pvc(client: &Client, name: &str) {
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {"cdi.kubevirt.io/storage.contentType": "kubevirt"}},
        "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": "Filesystem",
                 "resources": {"requests": {"storage": "1Gi"}}, "storageClassName": "none"}
    }))
    .unwrap();
    api.create(&PostParams::default(), &pvc).await.unwrap();
    // No volume controller binds it here: the status a bound claim has, patched as the e2e
    // tests do on a control plane without one.
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(
            json!({"status": {"phase": "Bound", "accessModes": ["ReadWriteOnce"],
                                          "capacity": {"storage": "1Gi"}}}),
        ),
    )
    .await
    .unwrap();
}

pub async fn run(ctx: &Ctx) -> Vec<Figure> {
    let (c, mut m) = ctx.phase_manager("objects", NS).await;

    let times = Arc::new(Mutex::new(HashMap::new()));
    let watches = [
        seen::<Service>(&c, times.clone()),
        seen::<Secret>(&c, times.clone()),
        seen::<Pod>(&c, times.clone()),
    ];
    let exports: Api<VirtualMachineExport> = Api::namespaced(c.clone(), NS);
    let (mut medians, mut p95s, mut all) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..ctx.runs {
        let mut samples = Vec::new();
        // One warm-up export per run (the first one also creates the CA), then the measured ones.
        for i in 0..=EXPORTS {
            let (name, pvc) = (format!("r{r}-x{i:02}"), format!("r{r}-d{i:02}"));
            bound_pvc(&c, &pvc).await;
            let vmx: VirtualMachineExport = serde_json::from_value(json!({
                "apiVersion": "export.kubevirt.io/v1", "kind": "VirtualMachineExport",
                "metadata": {"name": name},
                "spec": {"source": {"apiGroup": "", "kind": "PersistentVolumeClaim", "name": pvc}}
            }))
            .unwrap();
            let want = [
                format!("Service/{}", naming::service_name(&name)),
                format!("Secret/{}", naming::token_secret_name(&name)),
                format!("Secret/{}", naming::cert_secret_name(&name)),
                format!("Pod/{}", naming::pod_name(&name)),
            ];
            let t0 = Instant::now();
            exports.create(&PostParams::default(), &vmx).await.unwrap();
            let done = loop {
                let last = {
                    let t = times.lock().unwrap();
                    want.iter()
                        .map(|k| t.get(k).copied())
                        .collect::<Option<Vec<_>>>()
                };
                if let Some(last) = last {
                    break last.into_iter().max().unwrap();
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(60),
                    "export {name}: not all of {want:?} appeared within 60 s"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            };
            if i > 0 {
                samples.push(done.saturating_duration_since(t0).as_secs_f64() * 1000.0);
            }
        }
        eprintln!(
            "  run {r}: {} exports, median {:.1} ms, p95 {:.1} ms",
            samples.len(),
            median(&samples),
            percentile(&samples, 0.95)
        );
        medians.push(median(&samples));
        p95s.push(percentile(&samples, 0.95));
        all.extend(samples);
    }
    for w in watches {
        w.abort();
    }
    m.stop("TERM");
    let title = format!(
        "time to objects: {EXPORTS} PVC exports, create → Service, token and cert Secrets and Pod seen by a watch"
    );
    let how = "exports created one after another against a warm manager (one warm-up export per run not counted), each on its own Bound PVC";
    vec![
        Figure::new(
            PHASE,
            "objects.vmexport_children_p95",
            &format!("{title}: per-run p95"),
            "ms",
            p95s,
        )
        .reference(
            100.0,
            "ucm goal: p95 under 100 ms (docs/vmexport.md, \"Performance goals\", P3)",
            false,
        )
        .note(format!(
            "{how}; over all {} exports: median {:.1} ms, p95 {:.1} ms, max {:.1} ms",
            all.len(),
            median(&all),
            percentile(&all, 0.95),
            all.iter().copied().fold(0.0, f64::max)
        )),
        Figure::new(
            PHASE,
            "objects.vmexport_children_median",
            &format!("{title}: per-run median"),
            "ms",
            medians,
        )
        .reference(
            100.0,
            "ucm goal: p95 under 100 ms (docs/vmexport.md, \"Performance goals\", P3)",
            false,
        )
        .note(how.to_string()),
    ]
}
