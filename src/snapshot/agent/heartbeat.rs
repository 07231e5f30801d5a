//! The agent's heartbeat Lease (`ucm-snapshot-agent-<node>`): the manager reads its renewals
//! to tell a live node from a lost one.

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::{
    Api, Client,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::snapshot::round::{AGENT_LEASE_LABEL, AGENT_LEASE_PREFIX};

pub(super) async fn heartbeat(
    client: Client,
    namespace: String,
    node: String,
    interval: Duration,
    stop: CancellationToken,
) {
    let api: Api<Lease> = Api::namespaced(client, &namespace);
    let name = format!("{AGENT_LEASE_PREFIX}{node}");
    loop {
        let now = MicroTime(Timestamp::now());
        let spec = LeaseSpec {
            holder_identity: Some(node.clone()),
            renew_time: Some(now.clone()),
            lease_duration_seconds: Some(
                i32::try_from(interval.as_secs().saturating_mul(3)).unwrap_or(i32::MAX),
            ),
            ..Default::default()
        };
        // One request per beat: patch, and create only when the Lease is not there yet.
        let patched = api
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({
                    "metadata": {"labels": {AGENT_LEASE_LABEL.0: AGENT_LEASE_LABEL.1}},
                    "spec": spec,
                })),
            )
            .await;
        let res = match patched {
            Ok(_) => Ok(()),
            Err(e) if crate::runtime::writer::is_not_found(&e) => {
                let lease = Lease {
                    metadata: kube::api::ObjectMeta {
                        name: Some(name.clone()),
                        labels: Some(
                            [(
                                AGENT_LEASE_LABEL.0.to_string(),
                                AGENT_LEASE_LABEL.1.to_string(),
                            )]
                            .into(),
                        ),
                        ..Default::default()
                    },
                    spec: Some(LeaseSpec {
                        acquire_time: Some(now),
                        ..spec
                    }),
                };
                api.create(&PostParams::default(), &lease).await.map(|_| ())
            }
            Err(e) => Err(e),
        };
        if let Err(e) = res {
            warn!(error = %e, "heartbeat Lease renewal failed");
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}
