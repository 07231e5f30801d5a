//! A test's world on the shared control plane: a fresh namespace with ucm's CRDs installed, and
//! the polling every assertion on eventual state goes through.

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    core::v1::{Namespace, ServiceAccount},
    rbac::v1::ClusterRoleBinding,
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, PostParams},
};

use crate::{TIMEOUT, client_for, install_crds, shared_kubeconfig};

/// The shared cluster with ucm's CRDs installed, plus a fresh namespace whose `default`
/// ServiceAccount exists. The namespace is deleted (best effort) when the guard drops.
pub struct TestEnv {
    pub client: Client,
    pub kubeconfig: PathBuf,
    pub ns: String,
}

impl TestEnv {
    pub async fn new(test: &str) -> TestEnv {
        let kubeconfig = tokio::task::spawn_blocking(shared_kubeconfig)
            .await
            .unwrap();
        let client = client_for(&kubeconfig).await;
        static CRDS: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
        // Each test has its own tokio runtime; the install is idempotent, so a second install
        // in another runtime is harmless, but one per process is enough.
        CRDS.get_or_init(|| async { install_crds(&client).await })
            .await;
        let ns = create_namespace(&client, test).await;
        TestEnv {
            client,
            kubeconfig,
            ns,
        }
    }

    pub fn user_kubeconfig(&self) -> PathBuf {
        self.kubeconfig.with_file_name("kubeconfig-user")
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let client = self.client.clone();
        let ns = self.ns.clone();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = Api::<Namespace>::all(client.clone())
                    .delete(&ns, &DeleteParams::default())
                    .await;
                // The shipped identity's ClusterRoleBindings are cluster-scoped: no namespace GC.
                let _ = Api::<ClusterRoleBinding>::all(client)
                    .delete_collection(
                        &DeleteParams::default(),
                        &ListParams::default().labels(&format!("{E2E_NS_LABEL}={ns}")),
                    )
                    .await;
            });
        }
    }
}

pub fn unique(prefix: &str) -> String {
    let short: String = prefix
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(30)
        .collect::<String>()
        .to_lowercase();
    format!("{short}-{:06x}", rand::random::<u32>() & 0xffffff)
}

pub async fn create_namespace(client: &Client, test: &str) -> String {
    let name = unique(&format!("ucm-e2e-{test}"));
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &name);
    eventually(
        TIMEOUT,
        "the namespace's default ServiceAccount",
        || async { sas.get_opt("default").await.ok().flatten().is_some() },
    )
    .await;
    name
}

/// Polls `check` until true; panics naming `what` after `timeout`. Assertions only: never a
/// substitute for synchronisation inside the product.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return;
        }
        if start.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `key` of Secret `name`, once the Secret has it.
pub async fn secret_data(
    api: &Api<k8s_openapi::api::core::v1::Secret>,
    name: &str,
    key: &str,
) -> Vec<u8> {
    eventually(TIMEOUT, &format!("Secret {name}"), || async {
        api.get_opt(name)
            .await
            .ok()
            .flatten()
            .is_some_and(|s| s.data.is_some_and(|d| d.contains_key(key)))
    })
    .await;
    api.get(name).await.unwrap().data.unwrap()[key].0.clone()
}

/// Labels the shipped identity's cluster-scoped bindings with the test namespace they serve.
pub const E2E_NS_LABEL: &str = "ucm.io/e2e-namespace";
